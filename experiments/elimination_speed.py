"""`python -m experiments.elimination_speed`: OptCNN Table 3 on this machine.

Search time of the `elimination` backend (excluding building the cost tables, reported
separately) for CNNs on 4 to 64 P100s, with the candidate configs per op and the size K of
the final graph; beside it, on the small cases, the plain depth-first search OptCNN compared
against and our branch and bound (`search`), each under a time cap.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from backends import SolveOptions, get_backend
from planner.cli.args import (
    OneLineArgumentParser,
    nonnegative_int,
    positive_int,
    positive_seconds,
    report_errors,
    zoo_model,
)
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.problem import build_problem

MODELS = ["lenet5", "alexnet", "vgg16", "inception_v3", "resnet101"]
PRESETS = ["p100-1x4", "p100-2x4", "p100-4x4", "p100-8x4", "p100-16x4"]


def _fmt(result: object | None, cap: float) -> str:
    if result is None:
        return "-"
    seconds = result.stats["search_seconds"]  # type: ignore[attr-defined]
    if result.limit is not None:  # type: ignore[attr-defined]
        return f"> {cap:g} s"
    return f"{seconds:.3f} s"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment; bad arguments are one `error:` line and exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = OneLineArgumentParser(prog="python -m experiments.elimination_speed", description=__doc__)
    p.add_argument("--models", nargs="+", default=MODELS, type=zoo_model)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument(
        "--large-cap",
        type=positive_int,
        default=96,
        help="max configs per op on 32 or more devices (default 96)",
    )
    p.add_argument("--dfs-cap", type=positive_seconds, default=30.0, help="seconds per DFS run")
    p.add_argument("--dfs-devices", type=nonnegative_int, default=4, help="DFS columns up to here")
    p.add_argument("--repeats", type=positive_int, default=3, help="elimination runs (median)")
    p.add_argument(
        "--space",
        default=None,
        choices=("full", "mesh", "auto"),
        help="config space (default: build_problem's)",
    )
    args = p.parse_args(argv)
    space = {} if args.space is None else {"space": args.space}
    t = Table(title="OptCNN Table 3 on this machine: search time, analytic P100 costs")
    for col in (
        "model",
        "devices",
        "configs/op max/med",
        "build s",
        "elimination",
        "K",
        "search (B&B)",
        "DFS (plain)",
        "same optimum",
    ):
        t.add_column(col, justify="left" if col in ("model", "devices") else "right")
    elim = get_backend("elimination")
    search = get_backend("search")
    console = Console(width=None if sys.stdout.isatty() else 160)
    for model in args.models:
        graph = model_graph(model)
        for preset in args.presets:
            devices = get_preset(preset)
            cap = args.large_cap if devices.num_devices >= 32 and not space else None
            t0 = time.perf_counter()
            problem = build_problem(graph, devices, max_configs=cap, **space)
            build = time.perf_counter() - t0
            runs = [elim.solve(problem, SolveOptions(time_limit=600)) for _ in range(args.repeats)]
            secs = statistics.median(r.stats["search_seconds"] for r in runs)
            best = runs[0]
            dfs = bnb = None
            if devices.num_devices <= args.dfs_devices:
                opts = SolveOptions(time_limit=args.dfs_cap)
                bnb = search.solve(problem, opts)
                dfs = search.solve(
                    problem, SolveOptions(time_limit=args.dfs_cap, extra={"mode": "plain"})
                )
            same = "-"
            if bnb is not None and bnb.limit is None:
                same = (
                    "yes" if abs(bnb.objective - best.objective) <= 1e-9 * best.objective else "NO"
                )
            sizes = problem.sizes
            t.add_row(
                model,
                f"{preset} ({devices.num_devices})",
                f"{max(sizes)} / {statistics.median(sizes):g}" + (f" (cap {cap})" if cap else ""),
                f"{build:.2f}",
                f"{secs:.4f} s",
                str(best.stats["final_nodes"]),
                _fmt(bnb, args.dfs_cap),
                _fmt(dfs, args.dfs_cap),
                same,
            )
            console.print(f"done: {model} on {preset}", style="dim")
    console.print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
