"""`python -m experiments.iopddl DIR_OR_FILES`: backends on IOPDDL contest instances, scored
as the contest scored them.

    python -m experiments.iopddl DIR --backends portfolio   # DIR: the contest's instances
    python -m experiments.iopddl A.json.gz G.json.gz --backends portfolio cpsat --time-limit 30
    python -m experiments.iopddl DIR --backends portfolio toulbar2 --seeds 0 1 2 --dispatch ray
    python -m experiments.iopddl --resume results/iopddl-20261207-224826

(the contest's instances: https://github.com/google/iopddl/tree/main/benchmarks)

Every (instance, backend, seed) runs in a fresh process (`--case`) with a hard timeout, so a
hang or a crash is a row, not the end of the experiment; its peak RSS is measured (the
largest process, from wait4, and the process group's sum, sampled). Each instance gets its
contest time limit (experiments/data/iopddl_limits.csv, the contest's rules: 60-300 s, the
instance matched by its contest name, `asplos-2025-iopddl-A` or `A`; `DEFAULT_TIME_LIMIT`
with a one-line note for other names; `--time-limit` overrides), counted from the process's
start, loading included. `--background N` runs N CPU-burning processes beside each case
(`experiments.background`: other jobs on a shared machine), recorded in each row. Every
answer is re-checked, from the file, by planner's evaluators
(`planner.problems.evaluate`: the backends' searches do not use them): forbidden choices
and pairs, the memory profile against the limit, the cost re-scored. The contest score of
a row is best / cost (0 without a valid answer), with the best-known costs of
experiments/data/iopddl_best.csv (`--best FILE` for others).

Where the cases run (experiments/dispatch.py): one after another here (`--dispatch local`,
the default: nothing but the case and its burners on the machine, as the timings assume),
or as Ray tasks (`--dispatch ray`, `pip install 'layerwise[bench]'`) on a Ray instance the
run starts on this machine, each reserving the cores it uses (`--threads`; with
`--background`, a whole node, so a case and its burners are alone there), as many at once
as the cores allow; `--ray ADDRESS` runs them on a Ray cluster, whose nodes need layerwise
installed and the instance files at the same paths (a shared filesystem). Each case still
runs in its own process inside its task, with the same timeout and measurements.

The results folder, results/iopddl-<time>/, holds run.json (the arguments that define the
cases, and the instance files with their limits), rows.csv and rows.json (with the run's
provenance), rewritten as each case ends, and one log per case in logs/. `--resume FOLDER`
continues a stopped run there with its recorded arguments (arguments given beside it must
be the same, except --dispatch and --ray; the instance files too): it runs the cases
without a finished row (none, cut short by Ctrl-C, or a crash not yet retried).
A case that crashes (killed by a signal, an unexpected exit, its Ray worker or node lost)
is an ERROR row and is run once more; the retry's row (attempt 2) takes its place and the
crashed row moves to rows.json's run.retried. A case killed at its timeout is a TIMEOUT row
and is not retried, nor is a one-line error of bad input (exit status 2); column `crashed`
says which ERROR rows were crashes, and `--resume` retries those alone.
Ctrl-C stops the running cases (each returns its best answer so far) and starts no more;
the rows done are kept (exit 130) and `--resume` continues. Bad arguments are one
`error: ...` line and exit status 2.

Anytime quality: each case's backend returns its anytime trace (`backends.trace`: when each
better answer and bound came), stored once as traces/<case>.json when the case ends; each
row has the time to within 1% and 0.1% of the best known, the primal integral (Berthold
2013) and the primal-dual integral (`experiments.anytime`, on the case's clock, loading
included; empty for an answer the re-check refused), and the run ends with
`experiments.anytime`'s report in the results folder: performance profiles, cost-over-time
curves per instance (PNG) and anytime.md / anytime.csv.
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
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from experiments.anytime import TRACES, case_metrics, format_gap, report, shifted
from experiments.dispatch import (
    CRASH_ENV,
    INSTALL,
    Case,
    CaseKey,
    Local,
    Outcome,
    RayDispatch,
    case_key,
    fire,
    instance_name,
    ray_installed,
    reachable,
    trace_name,
)
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

EXIT_INTERRUPTED = 130
DEFAULT_TIME_LIMIT = 60.0  # seconds, for an instance the contest did not name
DATA = Path(__file__).resolve().parent / "data"
LIMITS_FILE = DATA / "iopddl_limits.csv"  # the contest's time limit of each of its instances
BEST_FILE = DATA / "iopddl_best.csv"
CONTEST_NAME = re.compile(r"(?:asplos-2025-iopddl-)?([A-Z])")  # "asplos-2025-iopddl-A" or "A"
EXIT_SECONDS = 0.3  # seconds of a case's time limit kept for writing the answer and exiting


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
    attempt: int = 1  # 2: the first crashed (its row moved to rows.json's run.retried)
    crashed: bool = False  # killed by a signal, an unexpected exit, its Ray worker lost
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
    args = _parser().parse_args(argv)
    if args.case is None and not args.paths and args.resume is None:
        raise LayerwiseError("give instance files or folders of them (*.json, *.json.gz)")
    if args.ray is not None and args.dispatch == "local":
        raise LayerwiseError("--ray ADDRESS dispatches through Ray: drop --dispatch local")
    args.dispatch = args.dispatch or ("local" if args.ray is None else "ray")
    if args.dispatch == "ray" and not ray_installed():
        raise LayerwiseError(f"--dispatch ray and --ray need ray: {INSTALL}")
    return args


def _parser(defaults: bool = True) -> OneLineArgumentParser:
    """The command line; without `defaults`, an option not given is absent from the result
    (what `--resume` compares with the run it continues)."""

    def d(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p = OneLineArgumentParser(
        prog="python -m experiments.iopddl",
        description="Run backends on IOPDDL contest instances (*.json, *.json.gz) at their "
        "contest time limits, each in its own process; re-check every answer; print a table "
        "with contest scores and write CSV and JSON to results/ as cases end.",
        argument_default=d(None),
    )
    p.add_argument("paths", type=Path, nargs="*", help="instance files or folders of them")
    p.add_argument("--backends", nargs="+", default=d(["portfolio"]), help="registered names")
    p.add_argument(
        "--time-limit",
        type=positive_seconds,
        help="seconds per case for every instance (default: the contest's limit of each of its "
        f"instances, 60-300; {DEFAULT_TIME_LIMIT:g} for other names)",
    )
    p.add_argument(
        "--background",
        type=nonnegative_int,
        default=d(0),
        metavar="N",
        help="run N CPU-burning processes beside each case, as other jobs on a shared machine "
        "would (default 0); with Ray a case with burners reserves a whole node",
    )
    p.add_argument("--seeds", type=nonnegative_int, nargs="+", default=d([0]))
    p.add_argument("--threads", type=positive_int, default=d(os.cpu_count() or 1))
    p.add_argument("--best", type=Path, default=d(BEST_FILE), help="CSV: instance,best_cost,...")
    p.add_argument("--out", type=Path, default=d(Path("results")), help="folder for the results")
    p.add_argument(
        "--dispatch",
        choices=("local", "ray"),
        help="local (default): cases one after another here; ray: as Ray tasks on a Ray "
        "instance started for the run, each reserving the cores it uses (--threads), as many "
        f"at once as the cores allow ({INSTALL})",
    )
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the cases on the Ray cluster at ADDRESS (HOST:PORT, as `ray start --head` "
        "prints; `auto`: the one running here); its nodes need layerwise installed and the "
        "instance files at the same paths (a shared filesystem)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="FOLDER",
        help="continue the interrupted run whose results are in FOLDER with its arguments "
        "(recorded in FOLDER/run.json): run the cases it has no rows of; other arguments may "
        "only repeat its own, or change --dispatch and --ray",
    )
    p.add_argument("--case", type=Path, help=argparse.SUPPRESS)  # one case, in a child
    p.add_argument("--answer", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    return p


CASE_ARGS = ("paths", "backends", "seeds", "time_limit", "background", "threads", "best")
RUN_FILE = "run.json"  # in a results folder: the arguments that define its cases


def _recordable(name: str, value: Any) -> Any:
    """An argument as run.json holds it (paths absolute: a resume may start elsewhere)."""
    if name == "paths":
        return [str(p.resolve()) for p in value]
    if name == "best":
        return str(Path(value).resolve())
    return value


def resolved_cases(args: argparse.Namespace) -> list[list[Any]]:
    """The instance files the arguments name, as run.json records them: [absolute path, time
    limit] each (the folders' contents and iopddl_limits.csv may change before a resume)."""
    return [[str(f.resolve()), time_limit_of(instance_name(f), args.time_limit)]
            for f in instances(args.paths)]  # fmt: skip


def record_run(args: argparse.Namespace, folder: Path) -> None:
    from planner.files import strict_json, write_text_atomic

    recorded = {k: _recordable(k, getattr(args, k)) for k in CASE_ARGS}
    doc = {"args": recorded, "cases": resolved_cases(args)}
    write_text_atomic(folder / RUN_FILE, strict_json(doc, 1))


def check_cases(args: argparse.Namespace, folder: Path) -> None:
    """One LayerwiseError line when the instance files or their time limits are not those
    the run in `folder` recorded (a file added, removed or renamed in a folder it named, or
    another limit in iopddl_limits.csv): its rows would no longer match its cases."""
    recorded = json.loads((folder / RUN_FILE).read_text()).get("cases")
    if recorded is None:  # a run recorded before run.json held its cases
        return
    now = resolved_cases(args)
    if now != recorded:
        gone = [c[0] for c in recorded if c not in now]
        new = [c[0] for c in now if c not in recorded]
        what = f"gone or changed: {gone[:3]}" if gone else f"new or changed: {new[:3]}"
        raise LayerwiseError(
            f"--resume {folder}: its instances are not those it began with ({what}); restore "
            "them, or start a new run"
        )


def resumed(args: argparse.Namespace, argv: Sequence[str] | None) -> argparse.Namespace:
    """`args` with the case arguments of the run in `args.resume`; one LayerwiseError line
    when the arguments given describe other cases."""
    folder = args.resume
    try:
        recorded = json.loads((folder / RUN_FILE).read_text())["args"]
    except (OSError, ValueError, KeyError):
        raise LayerwiseError(
            f"--resume {folder}: no readable {RUN_FILE} there; give a results folder of "
            "python -m experiments.iopddl"
        ) from None
    given = vars(_parser(defaults=False).parse_args(argv))
    for name in CASE_ARGS:
        if name in given and (name != "paths" or given[name]):
            mine = _recordable(name, given[name])
            if mine != recorded[name]:
                flag = "instances" if name == "paths" else "--" + name.replace("_", "-")
                raise LayerwiseError(
                    f"--resume {folder}: that run has other cases ({flag} {recorded[name]} "
                    f"there, {mine} here); give --resume {folder} alone to continue it"
                )
    out = argparse.Namespace(**vars(args))
    for name in CASE_ARGS:
        setattr(out, name, recorded[name])
    out.paths, out.best = [Path(p) for p in recorded["paths"]], Path(recorded["best"])
    return out


# ----------------------------------------------------------------------------- inputs


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
    seen: dict[str, Path] = {}
    for f in found:  # rows, logs and traces are named by the instance's name
        other = seen.setdefault(instance_name(f), f)
        if other != f:
            raise LayerwiseError(
                f"{other} and {f} are both instance {instance_name(f)!r}: give one of them "
                "(rows, logs and traces are named by the instance)"
            )
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
    path: Path,
    backend: str,
    time_limit: float,
    seed: int,
    threads: int,
    age: float = 0.0,
    reserve: float = 0.0,
) -> dict:
    """In the child: load, solve within `time_limit` less the seconds the process has
    already lived (`age`) and those kept for writing the answer (`reserve`), loading
    included; the answer with what the backend said about it."""
    entered = time.perf_counter()  # the imports below count too
    from backends import SolveOptions, get_backend
    from planner.deadline import Deadline, catch_interrupt
    from planner.problems.costtable import load_problem

    deadline = Deadline.after(time_limit - age - reserve - (time.perf_counter() - entered))
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
        # (the one its deadline counts: the process's age at this call, then imports and
        # loading; not the reserve, which is not yet spent) at that start
        "trace": {**trace, "offset": round(age + began - entered, 4)},
    }


def _die_with_parent(parent: int) -> None:
    """In the case's process: when the process that started it (`parent`) dies (a Ray worker
    killed), SIGTERM, which ends its whole process group (the portfolio's members too)."""
    import ctypes

    signal.signal(signal.SIGTERM, lambda signum, frame: os.killpg(0, signal.SIGKILL))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call
        os.killpg(0, signal.SIGKILL)


# ----------------------------------------------------------------------------- the run


ATTEMPTS = 2  # a crashed case is retried once


def run(
    args: argparse.Namespace, console: Console, folder: Path, info: dict[str, Any]
) -> tuple[list[Row], bool]:
    """Every case `folder` has no finished row of, rows written there as each ends; (every
    row, whether Ctrl-C stopped the run before all were done)."""
    from planner.deadline import catch_interrupt, stop_requested

    files = instances(args.paths)
    best = read_best(args.best)
    for name in dict.fromkeys(instance_name(f) for f in files):
        note = limit_note(name, args.time_limit)
        if note:
            console.print(note, highlight=False)
    cases = [Case(f, b, s, time_limit_of(instance_name(f), args.time_limit), args.background,
                  args.threads) for f in files for b in args.backends for s in args.seeds]  # fmt: skip
    order = {c.key: k for k, c in enumerate(cases)}
    earlier, retried = previous_rows(folder)
    rows = {key: r for r in earlier if (key := row_key(r)) in order}
    info["retried"] = [row_fields(r) for r in retried]  # crashed attempts, replaced by their retry
    todo = [c if c.key not in rows else replace(c, attempt=_next_attempt(rows[c.key]))
            for c in cases if c.key not in rows or not finished(rows[c.key])]  # fmt: skip
    if rows:
        console.print(
            f"resuming {folder}: {len(cases) - len(todo)} case(s) done, {len(todo)} to run"
        )
    beside = f", background {args.background}" if args.background else ""

    def announce(case: Case) -> None:
        start = load()[0] if load() else math.nan
        again = f" (attempt {case.attempt})" if case.attempt > 1 else ""
        console.print(
            f"[{order[case.key] + 1}/{len(cases)}] {case.name} {case.backend} seed {case.seed}"
            f"{again}: {case.limit:g} s (load {start:.2f}{beside}) ..."
        )

    # Ray first: catch_interrupt's SIGINT handler is then the one in place
    dispatch = Local(announce) if args.dispatch == "local" else RayDispatch(args.ray)
    try:
        with catch_interrupt():
            for case in todo:
                dispatch.submit(case)
            while (out := dispatch.next()) is not None:
                row = _outcome_row(out, best)
                replaced = rows.get(out.case.key)
                if replaced is not None and replaced.crashed:
                    info["retried"].append(row_fields(replaced))
                rows[out.case.key] = row
                save_trace(row, folder)
                _save_log(out, folder)
                head = "" if args.dispatch == "local" else (
                    f"[{order[out.case.key] + 1}/{len(cases)}] {out.case.name} "
                    f"{out.case.backend} seed {out.case.seed} attempt {out.case.attempt}: "
                )  # fmt: skip
                console.print("    " + head + _line(row))
                save(sorted(rows.values(), key=lambda r: order[row_key(r)]), finish(info), folder)
                if out.needs_retry and out.case.attempt < ATTEMPTS and not stop_requested():
                    dispatch.submit(replace(out.case, attempt=out.case.attempt + 1))
            done = sorted(rows.values(), key=lambda r: order[row_key(r)])
            complete = len(done) == len(cases) and all(finished(r) for r in done)
            return done, stop_requested() and not complete
    finally:
        dispatch.close()


def row_key(r: Row) -> CaseKey:
    """The case a row is of (`Case.key`)."""
    return case_key(r.instance, r.backend, r.seed, r.time_limit, r.background)


def finished(r: Row) -> bool:
    """Whether a row ends its case: not one cut short by Ctrl-C, nor a crash still to retry
    (a timeout and a one-line error of bad input are no crash: they would happen again)."""
    interrupted = "(INTERRUPTED)" in r.status or r.error.startswith("interrupted")
    return not interrupted and not (r.crashed and r.attempt < ATTEMPTS)


def _next_attempt(r: Row) -> int:
    """The attempt that follows row `r` of its case: a crash counts, a Ctrl-C does not."""
    return r.attempt + 1 if r.crashed else r.attempt


def previous_rows(folder: Path) -> tuple[list[Row], list[Row]]:
    """The rows an earlier run wrote to `folder`, and the crashed attempts it retried (none
    in a new folder)."""
    path = folder / "rows.json"
    if not path.exists():
        return [], []
    names = {f.name for f in fields(Row)}

    floats = {f.name for f in fields(Row) if f.type == "float"}  # NaN was written as null

    def rows(dicts: list[dict]) -> list[Row]:
        return [
            Row(**{k: math.nan if v is None and k in floats else v
                   for k, v in _with_crashed(d).items() if k in names})
            for d in dicts
        ]  # fmt: skip

    try:
        doc = json.loads(path.read_text())
        return rows(doc["rows"]), rows(doc["run"].get("retried", []))
    except (ValueError, KeyError, TypeError) as exc:
        raise LayerwiseError(
            f"{path} cannot be read back ({one_line(exc)}): start a new run"
        ) from None


def _with_crashed(d: dict[str, Any]) -> dict[str, Any]:
    """A row read back from a run written before rows had the `crashed` column: an ERROR
    not cut short by Ctrl-C was taken for a crash then."""
    if "crashed" in d:
        return d
    error = str(d.get("error") or "")
    return {**d, "crashed": d.get("status") == "ERROR" and not error.startswith("interrupted")}


def _outcome_row(out: Outcome, best: dict[str, float]) -> Row:
    c = out.case
    row = _row(c.name, c.backend, c.seed, c.limit, out.answer, out.measured, out.verdict,
               out.cost, best, out.measured["load_start"], c.background)  # fmt: skip
    row.attempt = c.attempt
    row.crashed = bool(out.measured.get("crashed"))
    return row


def _save_log(out: Outcome, folder: Path) -> None:
    c = out.case
    again = f"-attempt{c.attempt}" if c.attempt > 1 else ""
    log = folder / "logs" / f"{c.name}-{c.backend}-seed{c.seed}{again}.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text(out.log)


def _row(name: str, backend: str, seed: int, limit: float, answer: dict | None,
         measured: dict, verdict: str, cost: float | None, best: dict[str, float],
         start: float, background: int = 0) -> Row:  # fmt: skip
    known = best.get(name, best.get(contest_key(name) or ""))
    ok = verdict == "yes" and cost is not None
    bound = answer.get("bound") if answer else None
    gap = cost / bound - 1 if ok and bound and cost is not None else None
    status = answer["status"] if answer else ("TIMEOUT" if "killed" in measured.get("error", "")
                                              else "ERROR")  # fmt: skip
    # an answer the re-check refused: its trace's values are not to be trusted either (no
    # metrics, no trace file)
    trace = answer.get("trace") if answer and ok else None
    anytime = _anytime(trace, known, cost, limit)
    return Row(
        instance=name, backend=backend, seed=seed, status=status, cost=cost, bound=bound,
        gap=gap, time_limit=limit, background=background,
        wall=measured["wall"],
        load_seconds=answer["load_seconds"] if answer else 0.0,
        rss_mib=measured["rss_mib"], tree_rss_mib=measured["tree_rss_mib"], valid=verdict,
        best=known, ratio=cost / known if ok and known and cost is not None else None,
        score=None if known is None else (known / cost if ok and cost else 0.0),
        load_start=start, load_end=measured["load_end"],
        reported=answer.get("objective") if answer else None,
        error=measured.get("error", ""), trace=trace, **anytime,
    )  # fmt: skip


def _anytime(
    trace: dict[str, Any] | None, known: float | None, cost: float | None, limit: float
) -> dict[str, float | None]:
    """A case's anytime metrics (`experiments.anytime.case_metrics`) from its trace, against
    the best known or the case's own valid answer if that is better (no best known: only
    the primal-dual integral); {} without a trace."""
    if trace is None:
        return {}
    offset = float(trace.get("offset", 0.0))
    best = None if known is None else min(known, cost if cost is not None else math.inf)
    incumbent = shifted(trace.get("incumbent", []), offset, limit)
    return case_metrics(incumbent, shifted(trace.get("bound", []), offset, limit), best, limit)


def _number(x: float | None, spec: str | None = None) -> str:
    """A cost as the plain number it is (`format_cost`), or `x` in `spec`."""
    return format_cost(x) if spec is None or x is None else format(x, spec)


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
            _number(r.cost), _number(r.bound), format_gap(r.gap),
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


KEY_FIELDS = ("instance", "backend", "seed", "time_limit", "background")  # `row_key`'s


def save_trace(r: Row, folder: Path) -> None:
    """The row's anytime trace as traces/<case>.json (`trace_name`, with the case's key),
    written once as its outcome arrives and then dropped from the row; an outcome without
    one (no answer, a crash) removes the file an earlier attempt of the case left."""
    from planner.files import strict_json, write_text_atomic

    path = folder / TRACES / trace_name(row_key(r))
    if r.trace is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(exist_ok=True)
    text = strict_json({**dict(zip(KEY_FIELDS, row_key(r), strict=True)), **r.trace})
    write_text_atomic(path, text)
    r.trace = None


def save(rows: list[Row], info: dict[str, Any], folder: Path, plots: bool = False) -> None:
    """rows.csv and rows.json (the traces are written by `save_trace`); with `plots` (the
    run's last save), the anytime report beside them (`experiments.anytime.report`:
    profiles, curves, anytime.md)."""
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
    if plots and rows:
        report([folder])


def main(argv: Sequence[str] | None = None) -> int:
    from planner.cli.args import report_errors

    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    if args.case is not None:  # a child: one case, its answer as JSON
        # a Ray worker runs its task with SIGINT blocked, and a child inherits the mask: the
        # stop request `_wait` passes on would wait, unseen, for the kill
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        if args.parent:
            _die_with_parent(args.parent)
        hook = os.environ.get(CRASH_ENV, "")
        if hook.startswith("case:") and fire(hook):
            os.kill(os.getpid(), signal.SIGKILL)  # the test hook: a crash
        # the limit counts from the case process's start: the interpreter's start and the
        # imports are in the wall time measured (1-2 s of it on IOPDDL S, which then ended
        # 1.1-1.8 s over), and the answer is still to be written
        answer = run_case(
            args.case, args.backends[0], args.time_limit or DEFAULT_TIME_LIMIT, args.seeds[0],
            args.threads, _process_age(), EXIT_SECONDS,
        )  # fmt: skip
        args.answer.write_text(json.dumps(answer))
        return 0
    from backends import backend_names

    if args.resume is not None:
        args = resumed(args, argv)
        check_cases(args, args.resume)
    unknown = [b for b in args.backends if b not in backend_names()]
    if unknown:
        raise LayerwiseError(
            f"unknown backend {unknown[0]!r}; available: {', '.join(backend_names())}"
        )
    instances(args.paths)  # fail fast on a missing path or an empty folder
    read_best(args.best)
    if args.ray not in (None, "auto"):
        reachable(args.ray)  # fail fast too: ray.init would wait minutes
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)  # a log file gets the whole table
    info = run_info("experiments.iopddl", argv, args)
    if args.resume is not None:
        folder = args.resume
        with contextlib.suppress(OSError, ValueError, KeyError):
            info["resumed"] = json.loads((folder / "rows.json").read_text())["run"]
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        folder = new_results_folder(args.out, "iopddl")
        record_run(args, folder)
    rows, interrupted = run(args, console, folder, info)
    limits = "contest limits" if args.time_limit is None else f"{args.time_limit:g} s"
    beside = f", {args.background} background burner(s)" if args.background else ""
    console.print(table(rows, f"IOPDDL instances, {limits}, {args.threads} thread(s){beside}"))
    info = finish(info)
    save(rows, info, folder, plots=True)
    m = info["machine"]
    console.print(f"load {m['load_start']} -> {m['load_end']}; results written to {folder}")
    if interrupted:
        print(
            f"error: interrupted after {len(rows)} case(s); continue with --resume {folder}",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
