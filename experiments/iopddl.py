"""`python -m experiments.iopddl DIR_OR_FILES`: backends on IOPDDL contest instances, scored
as the contest scored them.

    python -m experiments.iopddl DIR --backends portfolio   # DIR: the contest's instances
    python -m experiments.iopddl A.json.gz G.json.gz --backends portfolio cpsat --time-limit 30

(the contest's instances: https://github.com/google/iopddl/tree/main/benchmarks)

Every (instance, backend, seed) runs in a fresh process (`--case`) with a hard timeout, so a
hang or a crash is a row, not the end of the experiment; its peak RSS is measured (the
largest process, from wait4, and the process group's sum, sampled). Each instance gets its
contest time limit (experiments/data/iopddl_limits.csv, the contest's rules: 60-300 s, the
instance matched by its contest name, `asplos-2025-iopddl-A` or `A`; `DEFAULT_TIME_LIMIT`
with a one-line note for other names; `--time-limit` overrides), counted from the process's
start, loading included. `--background N` runs N CPU-burning processes beside each case
(`experiments.background`: other jobs on a shared machine), recorded in each row. Every
answer is re-checked here, from the file, by planner's evaluators
(`planner.problems.evaluate`: the backends' searches do not use them): forbidden choices
and pairs, the memory profile against the limit, the cost re-scored. The contest score of
a row is best / cost (0 without a valid answer), with the best-known costs of
experiments/data/iopddl_best.csv (`--best FILE` for others). The table is printed and
written, with the run's provenance, to results/iopddl-<time>/ as rows.csv and rows.json.
Ctrl-C stops the running case (it returns its best answer so far) and the run after it; the
rows done are kept (exit 130).

Anytime quality: each case's backend returns its anytime trace (`backends.trace`: when each
better answer and bound came), stored as traces/<case>.json; each row has the time to within
1% and 0.1% of the best known, the primal integral (Berthold 2013) and the primal-dual
integral (`experiments.anytime`, on the case's clock, loading included), and the run ends
with `experiments.anytime`'s report in the results folder: performance profiles,
cost-over-time curves per instance (PNG) and anytime.md / anytime.csv. Bad arguments are one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from experiments.background import background_load
from experiments.runinfo import finish, load, new_results_folder, run_info
from planner.cli.args import (
    OneLineArgumentParser,
    nonnegative_int,
    one_line,
    positive_int,
    positive_seconds,
)
from planner.errors import LayerwiseError
from planner.result import format_cost

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
DEFAULT_TIME_LIMIT = 60.0  # seconds, for an instance the contest did not name
DATA = Path(__file__).resolve().parent / "data"
LIMITS_FILE = DATA / "iopddl_limits.csv"  # the contest's time limit of each of its instances
BEST_FILE = DATA / "iopddl_best.csv"
CONTEST_NAME = re.compile(r"(?:asplos-2025-iopddl-)?([A-Z])")  # "asplos-2025-iopddl-A" or "A"
GRACE = 60.0  # seconds past the time limit before a case is killed (then 15 more after SIGINT)
EXIT_SECONDS = 0.3  # of a case's time limit, kept for writing the answer and exiting


@dataclass
class Row:
    instance: str
    backend: str
    seed: int
    status: str  # the backend's status, or ERROR / TIMEOUT
    cost: float | None  # re-scored here; None without an answer
    bound: float | None
    gap: float | None  # cost / bound - 1
    time_limit: float
    background: int  # CPU-burning processes running beside the case (`--background`)
    wall: float  # the case's process, from start to exit
    load_seconds: float  # reading the file in the case's process
    rss_mib: float  # the largest process (wait4)
    tree_rss_mib: float  # the process group's summed RSS, sampled every 0.2 s
    valid: str  # "yes", "no: why", "-" (no answer)
    best: float | None  # best-known cost
    ratio: float | None  # cost / best
    score: float | None  # best / cost, 0 without a valid answer, None without a best cost
    load_start: float
    load_end: float
    reported: float | None = None  # the backend's own cost
    error: str = ""
    # anytime quality (experiments.anytime), on the case's clock, against the best known (or
    # the case's own answer, if better): the first time within 1% / 0.1% (None: never), the
    # primal integral (Berthold 2013) and the primal-dual integral in seconds and divided by
    # the time limit
    time_to_1pct: float | None = None
    time_to_0_1pct: float | None = None
    primal_integral: float | None = None
    primal_integral_norm: float | None = None
    primal_dual_integral: float | None = None
    primal_dual_integral_norm: float | None = None
    # the backend's anytime trace (backends.trace) and its offset on the case's clock: stored
    # in traces/ by `save`, not in rows.csv / rows.json
    trace: dict[str, Any] | None = field(default=None, repr=False, compare=False)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        prog="python -m experiments.iopddl",
        description="Run backends on IOPDDL contest instances (*.json, *.json.gz) at their "
        "contest time limits, each in its own process; re-check every answer; print a table "
        "with contest scores and write CSV and JSON to results/.",
    )
    p.add_argument("paths", type=Path, nargs="*", help="instance files or folders of them")
    p.add_argument("--backends", nargs="+", default=["portfolio"], help="registered names")
    p.add_argument(
        "--time-limit",
        type=positive_seconds,
        help="seconds per case for every instance (default: the contest's limit of each of its "
        f"instances, 60-300; {DEFAULT_TIME_LIMIT:g} for other names)",
    )
    p.add_argument(
        "--background",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="run N CPU-burning processes beside each case, as other jobs on a shared machine "
        "would (default 0)",
    )
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=[0])
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--best", type=Path, default=BEST_FILE, help="CSV: instance,best_cost,...")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for the results")
    p.add_argument("--case", type=Path, help=argparse.SUPPRESS)  # one case, in a child
    p.add_argument("--answer", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case is None and not args.paths:
        raise LayerwiseError("give instance files or folders of them (*.json, *.json.gz)")
    return args


# ----------------------------------------------------------------------------- inputs


def instance_name(path: Path) -> str:
    """The file's name without .json / .json.gz."""
    return re.sub(r"\.json(\.gz)?$", "", path.name)


def contest_key(name: str) -> str | None:
    """The contest's letter of an instance named as the contest names it
    ("asplos-2025-iopddl-A", or "A" as its results do), else None."""
    m = CONTEST_NAME.fullmatch(name)
    return m.group(1) if m else None


@functools.cache
def contest_limits(path: Path = LIMITS_FILE) -> dict[str, float]:
    """The contest's time limit of each of its instances, by letter, in seconds."""
    return _numbers(path, "time_limit_s", "the contest's time limits")


def time_limit_of(name: str, override: float | None) -> float:
    """`override`, else the contest's limit of the instance `name`, else the default."""
    if override is not None:
        return override
    return contest_limits().get(contest_key(name) or "", DEFAULT_TIME_LIMIT)


def limit_note(name: str, override: float | None) -> str | None:
    """One line for an instance that gets the default limit because the contest has no such
    name; None for the others."""
    if override is not None or (contest_key(name) or "") in contest_limits():
        return None
    return (
        f"note: {name} is not a contest instance name (asplos-2025-iopddl-A ... -Y, or A ... "
        f"Y): {DEFAULT_TIME_LIMIT:g} s per case (--time-limit sets another)"
    )


def instances(paths: Sequence[Path]) -> list[Path]:
    """The instance files named or found (*.json, *.json.gz) in the folders named."""
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            inside = sorted([*path.glob("*.json"), *path.glob("*.json.gz")])
            if not inside:
                raise LayerwiseError(f"{path} holds no *.json or *.json.gz instances")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise LayerwiseError(f"{path} does not exist")
    return found


def read_best(path: Path) -> dict[str, float]:
    """instance -> best-known cost, from a CSV with columns instance and best_cost."""
    return _numbers(path, "best_cost", "the best-known costs")


def _numbers(path: Path, column: str, what: str) -> dict[str, float]:
    """instance -> the number in `column`, from a CSV whose `#` lines are comments; one
    LayerwiseError line for a file that cannot be read, lacks the columns or holds another
    value."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LayerwiseError(f"cannot read {what} {path}: {exc.strerror}") from None
    rows = list(csv.DictReader(line for line in io.StringIO(text) if not line.startswith("#")))
    if rows and not {"instance", column} <= set(rows[0]):
        raise LayerwiseError(f"{path} needs the columns instance and {column}")
    out = {}
    for row in rows:
        try:
            out[row["instance"]] = float(row[column])
        except (TypeError, ValueError):
            raise LayerwiseError(f"{path}: {column} {row[column]!r} is not a number") from None
    return out


# ----------------------------------------------------------------------------- one case


def _process_age() -> float:
    """Seconds since this process started (Linux, from /proc; elsewhere 0)."""
    try:
        fields_ = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started = int(fields_[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


def run_case(
    path: Path, backend: str, time_limit: float, seed: int, threads: int, spent: float = 0.0
) -> dict:
    """In the child: load, solve within `time_limit` from now less `spent` (loading
    included), and the answer with what the backend said about it."""
    entered = time.perf_counter()  # the imports below count too
    from backends import SolveOptions, get_backend
    from planner.deadline import Deadline, catch_interrupt
    from planner.problems.costtable import load_problem

    deadline = Deadline.after(time_limit - spent - (time.perf_counter() - entered))
    t0 = time.perf_counter()
    with catch_interrupt():  # SIGINT from the parent: the best answer so far
        problem = load_problem(path)
        loaded = time.perf_counter() - t0
        solver = get_backend(backend)
        began = time.perf_counter()
        result = solver.solve(problem, SolveOptions(seed=seed, threads=threads, deadline=deadline))
    trace = result.stats.get("trace") or {"incumbent": [], "bound": []}
    return {
        "status": result.status.value + (f" ({result.limit.value})" if result.limit else ""),
        "choices": list(result.choices) if result.choices is not None else None,
        "objective": result.objective,
        "bound": result.bound,
        "load_seconds": loaded,
        # the anytime trace, its times from the solve's start; `offset`: the case's clock
        # (the one its deadline counts: `spent` before this call, then imports and loading)
        # at that start
        "trace": {**trace, "offset": round(spent + began - entered, 4)},
    }


def recheck(problem: Any, answer: dict) -> tuple[str, float | None]:
    """(verdict, re-scored cost) of an answer, by planner's evaluators on the file's tables."""
    from planner.problems.evaluate import additive_cost, memory_peak

    choices = answer.get("choices")
    if choices is None:
        return "-", None
    try:
        cost = additive_cost(problem, choices)
        peak = memory_peak(problem, choices)
    except LayerwiseError as exc:
        return f"no: {one_line(exc)}", None
    limit = problem.usage_limit
    if not math.isfinite(cost):
        return "no: a forbidden choice or pair", None
    if limit is not None and bool((peak > limit * (1 + 1e-9)).any()):
        return f"no: memory peak {peak.max():.6g} over the limit {limit.max():.6g}", cost
    reported = answer.get("objective")
    if reported is not None and not math.isclose(cost, reported, rel_tol=1e-9):
        return f"no: reported {reported:.10g} but re-scored {cost:.10g}", cost
    return "yes", cost


def _tree_rss(pgid: int) -> int:
    """Summed RSS (bytes) of the processes in group `pgid`, from /proc."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields_ = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields_[2]) == pgid:  # field 5 of stat: the process group
                total += int(fields_[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss pages
    return total


def run_child(
    path: Path, backend: str, seed: int, limit: float, threads: int, folder: Path
) -> tuple[dict | None, dict[str, Any]]:
    """One case in a fresh process (its own session, killed as a group past the timeout):
    (the answer or None, measurements and the error line)."""
    answer_path = folder / f".answer-{os.getpid()}.json"
    log_path = folder / "logs" / f"{instance_name(path)}-{backend}-seed{seed}.log"
    log_path.parent.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "experiments.iopddl", "--case", str(path), "--answer",
           str(answer_path), "--backends", backend, "--time-limit", str(limit), "--seeds",
           str(seed), "--threads", str(threads)]  # fmt: skip
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status, usage, tree = _wait(proc, limit + GRACE, t0)
        except BaseException:  # a second Ctrl-C: the case's processes go with this one
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    proc.returncode = 0  # reaped by wait4
    wall = time.perf_counter() - t0
    measured = {"wall": wall, "rss_mib": usage.ru_maxrss / 1024, "tree_rss_mib": tree / 2**20}
    answer = None
    if status == -1:
        measured["error"] = f"killed after {wall:.0f} s (time limit {limit:g} s)"
    elif status == 0 and answer_path.exists():
        answer = json.loads(answer_path.read_text())
    else:
        lines = [x for x in log_path.read_text().splitlines() if x.strip()]
        measured["error"] = (
            lines[-1].removeprefix("error: ")
            if lines
            else f"exit status {os.waitstatus_to_exitcode(status)}"
        )
    answer_path.unlink(missing_ok=True)
    return answer, measured


def _wait(proc: subprocess.Popen, timeout: float, t0: float) -> tuple[int, Any, int]:
    """Wait for the case's process: (wait status, or -1 when killed past `timeout`; its
    rusage; the largest summed RSS of its process group seen). A stop request (Ctrl-C)
    passes SIGINT on to the group and gives it 15 s to answer."""
    from planner.deadline import stop_requested

    interrupted, tree = False, 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage, tree
        tree = max(tree, _tree_rss(proc.pid))
        elapsed = time.perf_counter() - t0
        if stop_requested() and not interrupted:  # the case stops with its best answer
            interrupted, timeout = True, elapsed + 15.0
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
        if elapsed > timeout:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _, _, usage = os.wait4(proc.pid, 0)
            return -1, usage, tree
        time.sleep(0.2)


# ----------------------------------------------------------------------------- the run


def run(args: argparse.Namespace, console: Console, folder: Path) -> tuple[list[Row], bool]:
    """Every case; (rows, whether Ctrl-C stopped the run early)."""
    from planner.deadline import catch_interrupt, stop_requested
    from planner.problems.costtable import load_problem

    files = instances(args.paths)
    best = read_best(args.best)
    for name in dict.fromkeys(instance_name(f) for f in files):
        note = limit_note(name, args.time_limit)
        if note:
            console.print(note, highlight=False)
    rows: list[Row] = []
    todo = [(f, b, s) for f in files for b in args.backends for s in args.seeds]
    beside = f", background {args.background}" if args.background else ""
    with catch_interrupt():
        problems: dict[Path, Any] = {}
        for k, (path, backend, seed) in enumerate(todo):
            name = instance_name(path)
            limit = time_limit_of(name, args.time_limit)
            start = load()[0] if load() else math.nan
            console.print(
                f"[{k + 1}/{len(todo)}] {name} {backend} seed {seed}: {limit:g} s "
                f"(load {start:.2f}{beside}) ..."
            )
            with background_load(args.background):  # started before the case, stopped after
                answer, measured = run_child(path, backend, seed, limit, args.threads, folder)
            verdict, cost = "-", None
            if answer is not None and answer.get("choices") is not None:
                if path not in problems:
                    problems = {path: load_problem(path)}  # one instance in memory at a time
                verdict, cost = recheck(problems[path], answer)
            rows.append(_row(name, backend, seed, limit, answer, measured, verdict, cost,
                             best, start, args.background))  # fmt: skip
            console.print("    " + _line(rows[-1]))
            if stop_requested():
                return rows, len(rows) < len(todo)
    return rows, False


def _row(name: str, backend: str, seed: int, limit: float, answer: dict | None,
         measured: dict, verdict: str, cost: float | None, best: dict[str, float],
         start: float, background: int = 0) -> Row:  # fmt: skip
    known = best.get(name, best.get(contest_key(name) or ""))
    ok = verdict == "yes" and cost is not None
    bound = answer.get("bound") if answer else None
    gap = cost / bound - 1 if ok and bound and cost is not None else None
    status = answer["status"] if answer else ("TIMEOUT" if "killed" in measured.get("error", "")
                                              else "ERROR")  # fmt: skip
    trace = answer.get("trace") if answer else None
    anytime = _anytime(trace, known, cost if ok else None, limit)
    return Row(
        instance=name, backend=backend, seed=seed, status=status, cost=cost, bound=bound,
        gap=gap, time_limit=limit, background=background,
        wall=measured["wall"],
        load_seconds=answer["load_seconds"] if answer else 0.0,
        rss_mib=measured["rss_mib"], tree_rss_mib=measured["tree_rss_mib"], valid=verdict,
        best=known, ratio=cost / known if ok and known and cost is not None else None,
        score=None if known is None else (known / cost if ok and cost else 0.0),
        load_start=start, load_end=(load() or [math.nan])[0],
        reported=answer.get("objective") if answer else None,
        error=measured.get("error", ""), trace=trace, **anytime,
    )  # fmt: skip


def _anytime(
    trace: dict[str, Any] | None, known: float | None, cost: float | None, limit: float
) -> dict[str, float | None]:
    """A case's anytime metrics (`experiments.anytime.case_metrics`) from its trace, against
    the best known or the case's own valid answer if that is better (no best known: only
    the primal-dual integral); {} without a trace."""
    from experiments.anytime import case_metrics, shifted

    if trace is None:
        return {}
    offset = float(trace.get("offset", 0.0))
    best = None if known is None else min(known, cost if cost is not None else math.inf)
    incumbent = shifted(trace.get("incumbent", []), offset)
    return case_metrics(incumbent, shifted(trace.get("bound", []), offset), best, limit)


def _number(x: float | None, spec: str | None = None) -> str:
    """A cost as the plain number it is (`format_cost`), or `x` in `spec`."""
    return format_cost(x) if spec is None or x is None else format(x, spec)


def _gap(gap: float | None) -> str:
    """A percentage, or past 1000% the ratio cost / bound (a trivial bound)."""
    if gap is None:
        return "-"
    return f"{100 * gap:.2f}%" if gap < 10 else f"{gap + 1:.3g}x"


def _line(r: Row) -> str:
    return (
        f"{r.status} cost {_number(r.cost)} valid {r.valid} score {_number(r.score, '.4f')} wall "
        f"{r.wall:.1f} s RSS {r.rss_mib:.0f} MiB (group {r.tree_rss_mib:.0f})"
        + (f" error {r.error}" if r.error else "")
    )


def table(rows: list[Row], title: str) -> Table:
    t = Table(title=title)
    cols = ("instance", "backend", "seed", "status", "cost", "bound", "gap", "limit s", "bg",
            "wall s", "RSS MiB", "valid", "contest best", "ratio", "score", "load")  # fmt: skip
    for c in cols:
        t.add_column(
            c, justify="left" if c in ("instance", "backend", "status", "valid") else "right"
        )
    for r in rows:
        t.add_row(
            r.instance, r.backend, str(r.seed), r.status if not r.error else f"{r.status}: {r.error}",
            _number(r.cost), _number(r.bound), _gap(r.gap),
            f"{r.time_limit:g}", str(r.background), f"{r.wall:.1f}",
            f"{r.rss_mib:.0f} ({r.tree_rss_mib:.0f})",
            r.valid, _number(r.best), _number(r.ratio, ".4f"), _number(r.score, ".4f"),
            f"{r.load_start:.2f}->{r.load_end:.2f}",
        )  # fmt: skip
    return t


def row_fields(row: Row) -> dict[str, Any]:
    """A row as rows.csv and rows.json hold it (its trace goes to traces/)."""
    out = asdict(row)
    del out["trace"]
    return out


def save(rows: list[Row], info: dict[str, Any], folder: Path, plots: bool = True) -> None:
    """rows.csv and rows.json; each row's anytime trace as traces/<case>.json (with the case:
    instance, backend, seed, time limit, background); then, with `plots`, the anytime
    report beside them (`experiments.anytime.report`: profiles, curves, anytime.md)."""
    from experiments.anytime import TRACES, report, trace_name
    from planner.files import strict_json, write_text_atomic

    names = [f.name for f in fields(Row) if f.name != "trace"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=names)
    writer.writeheader()
    writer.writerows(row_fields(r) for r in rows)
    write_text_atomic(folder / "rows.csv", buf.getvalue())
    write_text_atomic(
        folder / "rows.json", strict_json({"run": info, "rows": [row_fields(r) for r in rows]}, 1)
    )
    for r in rows:
        if r.trace is None:
            continue
        case = (r.instance, r.backend, r.seed, r.time_limit, r.background)
        (folder / TRACES).mkdir(exist_ok=True)
        keys = ("instance", "backend", "seed", "time_limit", "background")
        text = strict_json({**dict(zip(keys, case, strict=True)), **r.trace})
        write_text_atomic(folder / TRACES / trace_name(*case), text)
    if plots and rows:
        report([folder])


def main(argv: Sequence[str] | None = None) -> int:
    from planner.cli.args import report_errors

    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    if args.case is not None:  # a child: one case, its answer as JSON
        # the limit counts from the case process's start: the interpreter's start and the
        # imports are in the wall time measured (1-2 s of it on IOPDDL S, which then ended
        # 1.1-1.8 s over), and the answer is still to be written
        answer = run_case(
            args.case, args.backends[0], args.time_limit or DEFAULT_TIME_LIMIT, args.seeds[0],
            args.threads, _process_age() + EXIT_SECONDS,
        )  # fmt: skip
        args.answer.write_text(json.dumps(answer))
        return 0
    from backends import backend_names

    unknown = [b for b in args.backends if b not in backend_names()]
    if unknown:
        raise LayerwiseError(
            f"unknown backend {unknown[0]!r}; available: {', '.join(backend_names())}"
        )
    instances(args.paths)  # fail fast on a missing path or an empty folder
    read_best(args.best)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)  # a log file gets the whole table
    info = run_info("experiments.iopddl", argv, args)
    args.out.mkdir(parents=True, exist_ok=True)
    folder = new_results_folder(args.out, "iopddl")
    rows, interrupted = run(args, console, folder)
    limits = "contest limits" if args.time_limit is None else f"{args.time_limit:g} s"
    beside = f", {args.background} background burner(s)" if args.background else ""
    console.print(table(rows, f"IOPDDL instances, {limits}, {args.threads} thread(s){beside}"))
    info = finish(info)
    save(rows, info, folder)
    m = info["machine"]
    console.print(f"load {m['load_start']} -> {m['load_end']}; results written to {folder}")
    if interrupted:
        print(f"error: interrupted after {len(rows)} case(s)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
