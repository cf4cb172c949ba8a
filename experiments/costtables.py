"""`python -m experiments.costtables DIR`: every cost-table file in DIR through chosen backends.

    python -m experiments.costtables DIR --backends ilp cpsat portfolio --time-limit 60
    python -m experiments.costtables --generate DIR --sizes 800,35000 --count 3

Each (file, backend) case runs in its own process (`--case`), so its peak memory is its own:
the process loads the file, solves it (additive objective, the file's memory limit; as the
command line does, the backend's time limit is what loading left of --time-limit), and
re-checks the answer independently of the backend (`planner.problems.evaluate`: no forbidden
choice or pair, the memory profile within the limit). The table shows objective, bound and
gap ("no bound" when there is none), status, wall time in total and per phase, peak RSS of
the Python process and of CBC (a child process: its own peak, read from /proc while it
runs), the check's verdict and time; the same rows
go to results/costtables-<time>.csv. `--generate` writes seeded contest-like problems
(`planner.problems.costtable.contest_problem`) to DIR, so all of this runs without outside
data. Bad arguments end in one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

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
PHASES = ("selection", "start", "size", "encode", "model", "decode", "lns")
# Named variants for --backends (docs/solvers.md's CP-SAT table): backend, extra, threads.
# Each row of that table adds one change to the row before it.
VARIANTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "cpsat-plain": ("cpsat", {"edges": "plain", "groups": False, "presolve": True,
                              "lp_start": False, "lns": False}, 1),
    "cpsat-marginal": ("cpsat", {"groups": False, "presolve": True, "lp_start": False,
                                 "lns": False}, 1),
    "cpsat-groups": ("cpsat", {"presolve": True, "lp_start": False, "lns": False}, 1),
    "cpsat-nopresolve": ("cpsat", {"lp_start": False, "lns": False}, 1),
    "cpsat-lp": ("cpsat", {"lns": False}, 1),
    "cpsat-lns": ("cpsat", {}, 1),  # the default with one worker
    "cpsat-lin2": ("cpsat", {"parameters": {"linearization_level": 2}, "lns": False}, 1),
    "cpsat-2workers": ("cpsat", {}, 2),  # CP-SAT's own neighbourhood search, both cores
    "cpsat-chain": ("cpsat", {"memory": "chain", "lns": False}, 1),
    "ilp-2threads": ("ilp", {}, 2),
}  # fmt: skip


@dataclass
class Row:
    problem: str
    nodes: int
    backend: str
    status: str
    limit: str
    objective: float | None
    bound: float | None
    gap: float | None
    wall: float  # the whole case: load + solve + check
    load: float
    solve: float
    check: float
    phases: str  # "encode 1.2 search 55.0 ..."
    rss_mib: float
    solver_rss_mib: float
    valid: str  # "yes", "no: why", or "-" (no answer)
    answer_from: str = ""
    error: str = ""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        prog="python -m experiments.costtables",
        description="Run every cost-table file (*.json, *.json.gz) in DIR through the chosen backends with "
        "one time limit, each case in its own process; re-check every answer; print a table "
        "and write a CSV to results/. Or write contest-like problems with --generate.",
    )
    p.add_argument("dir", type=Path, nargs="?", help="a directory of cost-table JSON files")
    p.add_argument("--backends", nargs="+", default=["ilp", "cpsat", "portfolio"])
    p.add_argument("--time-limit", type=positive_seconds, default=60.0)
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--threads", type=positive_int, default=1, help="per backend (default 1)")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for the CSV")
    p.add_argument("--generate", type=Path, metavar="DIR", help="write problems to DIR instead")
    p.add_argument("--sizes", default="800,35000", help="with --generate: node counts")
    p.add_argument("--count", type=positive_int, default=3, help="with --generate: per size")
    p.add_argument("--case", type=Path, help=argparse.SUPPRESS)  # one case, in a child process
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.generate is None and args.case is None and args.dir is None:
        raise LayerwiseError("give a directory of cost-table files, or --generate DIR")
    return args


# ----------------------------------------------------------------------------- generate


def generate(folder: Path, sizes: str, count: int, seed: int, console: Console) -> list[Path]:
    """contest_problem files for every size, `count` seeds each."""
    from planner.problems.costtable import contest_problem, save_problem

    try:
        nodes = [int(s) for s in sizes.split(",")]
    except ValueError:
        raise LayerwiseError(f"--sizes must be node counts like 800,35000, got {sizes!r}") from None
    if any(n < 2 for n in nodes):
        raise LayerwiseError(f"--sizes must be at least 2 nodes each, got {sizes!r}")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for n in nodes:
        for k in range(count):
            path = folder / f"contest-n{n}-seed{seed + k}.json"
            t0 = time.perf_counter()
            save_problem(contest_problem(n, seed + k), path)
            size = path.stat().st_size / 2**20
            console.print(f"wrote {path} ({size:.0f} MiB, {time.perf_counter() - t0:.1f} s)")
            written.append(path)
    return written


# ----------------------------------------------------------------------------- one case


def run_case(path: Path, backend: str, time_limit: float, seed: int, threads: int) -> dict:
    """Load, solve and check one case in this process; the row as a dict."""
    from backends import SolveOptions, get_backend
    from experiments.dispatch import recheck
    from planner.problems.costtable import load_problem

    name, extra, threads = VARIANTS.get(backend, (backend, {}, threads))
    t0 = time.perf_counter()
    problem = load_problem(path)
    t1 = time.perf_counter()
    # as the command line does, the backend gets what loading the file left of the limit
    left = max(0.1 * time_limit, time_limit - (t1 - t0))
    result = get_backend(name).solve(
        problem, SolveOptions(time_limit=left, seed=seed, threads=threads, extra=extra)
    )
    t2 = time.perf_counter()
    choices = list(result.choices) if result.choices is not None else None
    valid, _ = recheck(problem, {"choices": choices, "objective": result.objective})
    t3 = time.perf_counter()
    stats = result.stats
    phases = " ".join(
        f"{p} {stats[p + '_seconds']:.1f}" for p in PHASES if stats.get(p + "_seconds") is not None
    )
    return asdict(
        Row(
            problem=_name(path),
            nodes=problem.num_nodes,
            backend=backend,
            status=result.status.value,
            limit=result.limit.value if result.limit else "",
            objective=result.objective,
            bound=result.bound,
            gap=result.gap,
            wall=t3 - t0,
            load=t1 - t0,
            solve=t2 - t1,
            check=t3 - t2,
            phases=phases,
            rss_mib=_rss_mib(resource.RUSAGE_SELF),
            solver_rss_mib=_solver_mib(stats),
            valid=valid,
            answer_from=str(stats.get("answer_from", stats.get("answer", ""))),
        )
    )


def _name(path: Path) -> str:
    return path.name.removesuffix(".gz").removesuffix(".json")


def _rss_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # Linux reports KiB


def _solver_mib(stats: Any) -> float:
    """CBC's peak RSS (the ilp backend's, or the largest of a portfolio's ilp runs)."""
    found = [float(stats.get("cbc_peak_mib") or 0.0)]
    for runs in stats.get("members", {}).values():
        found += [float(r.get("cbc_peak_mib") or 0.0) for r in runs]
    return max(found)


def _child(path: Path, backend: str, args: argparse.Namespace, timeout: float) -> Row:
    """One case in a fresh process (its own peak RSS); a failed case is a row with an error."""
    out = args.out / f".case-{os.getpid()}.json"
    cmd = [sys.executable, "-m", "experiments.costtables", "--case", str(path), "--json", str(out),
           "--backends", backend, "--time-limit", str(args.time_limit), "--seed", str(args.seed),
           "--threads", str(args.threads)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 and out.exists():
            return Row(**json.loads(out.read_text()))
        error = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    except subprocess.TimeoutExpired:
        error = f"did not finish in {timeout:.0f} s"
    finally:
        out.unlink(missing_ok=True)
    wall = time.perf_counter() - t0
    return Row(_name(path), 0, backend, "ERROR", "", None, None, None, wall, 0, 0, 0, "", 0, 0, "-",
               error=error)  # fmt: skip


# ----------------------------------------------------------------------------- report


def _number(x: float | None) -> str:
    return format_cost(x)  # unitless costs, every digit (6 significant digits hid differences)


def _gap(r: Row) -> str:
    if r.objective is None:
        return "-"
    if r.bound is None or r.gap is None or not math.isfinite(r.gap):
        return "no bound"
    return f"{100 * r.gap:.2f}%"


def table(rows: list[Row], title: str) -> Table:
    t = Table(title=title)
    for col in ("problem", "nodes", "backend", "status", "objective", "bound", "gap", "wall s",
                "load s", "solve s", "phases", "RSS MiB", "CBC MiB", "check s", "valid"):  # fmt: skip
        t.add_column(col, justify="right" if col not in ("problem", "phases", "valid") else "left")
    for r in rows:
        status = r.status + (f" ({r.limit})" if r.limit else "")
        t.add_row(
            r.problem, str(r.nodes), r.backend, status if not r.error else f"ERROR: {r.error}",
            _number(r.objective), _number(r.bound), _gap(r), f"{r.wall:.1f}", f"{r.load:.1f}",
            f"{r.solve:.1f}", r.phases, f"{r.rss_mib:.0f}", f"{r.solver_rss_mib:.0f}",
            f"{r.check:.2f}", r.valid,
        )  # fmt: skip
    return t


def save(rows: list[Row], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"costtables-{time.strftime('%Y%m%d-%H%M%S')}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])) if rows else ["problem"])
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    return path


def run(args: argparse.Namespace, console: Console) -> list[Row]:
    from backends import backend_names

    known = [*backend_names(), *VARIANTS]
    unknown = [b for b in args.backends if b not in known]
    if unknown:
        raise LayerwiseError(f"unknown backend {unknown[0]!r}; available: {', '.join(known)}")
    if not args.dir.is_dir():
        raise LayerwiseError(f"{args.dir} is not a directory of cost-table files")
    files = sorted([*args.dir.glob("*.json"), *args.dir.glob("*.json.gz")])
    if not files:
        raise LayerwiseError(f"{args.dir} holds no *.json cost-table files (or *.json.gz)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    timeout = 3 * args.time_limit + 600  # a case that hangs is reported, not waited for
    for k, path in enumerate(files):
        for backend in args.backends:
            load = os.getloadavg()[0]
            console.print(f"[{k + 1}/{len(files)}] {path.name} {backend} (load {load:.1f}) ...")
            row = _child(path, backend, args, timeout)
            rows.append(row)
            console.print(
                f"    {row.status} objective {_number(row.objective)} gap {_gap(row)} "
                f"wall {row.wall:.1f} s RSS {row.rss_mib:.0f} MiB valid {row.valid}"
                + (f" error {row.error}" if row.error else "")
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 200)  # a log file gets the whole table
    try:
        args = parse_args(argv)
        if args.case is not None:  # a child: one case, its row as JSON
            row = run_case(args.case, args.backends[0], args.time_limit, args.seed, args.threads)
            args.json.write_text(json.dumps(row))
            return 0
        if args.generate is not None:
            generate(args.generate, args.sizes, args.count, args.seed, console)
            return 0
        rows = run(args, console)
        title = f"{args.dir}: time limit {args.time_limit:g} s, seed {args.seed}"
        console.print(table(rows, title))
        path = save(rows, args.out)
    except (LayerwiseError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    console.print(f"results written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
