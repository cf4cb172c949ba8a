"""`python -m experiments.dlplacer_inception`: DLPlacer's Inception-v3 case (Pal et al. 2019, Sec. 6).

Inception-v3's training graph (forward, backward and update tasks of every op) placed op by
op on the first G V100s of a DGX-1 (`v100-dgx1-G`, analytic costs), by the placement model of
the `ilp` and `cpsat` backends: the predicted per-step speedup of the best placement found over
one GPU (the paper: 1.32x at 2 GPUs, marginal beyond), the solve time, the final gap to the
proven bound, and the placement as a per-device op list. The simulator's re-score of each
placement (link contention, FIFO order) is shown beside the model's prediction.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backends import SolveOptions, get_backend
from backends.placement.problem import PlacementProblem, list_schedule, placement_problem
from planner.cli.args import (
    OneLineArgumentParser,
    UsageError,
    nonnegative_int,
    positive_int,
    positive_seconds,
    report_errors,
)
from planner.files import check_output_path, strict_json, write_text_atomic
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.problem import Problem, build_problem

PAPER_SPEEDUP = {2: 1.32}  # Sec. 6: "the 1.32x speedup obtained with the real silicon 2-GPU"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.dlplacer_inception", description=__doc__)
    p.add_argument(
        "--gpus", type=positive_int, nargs="+", default=[1, 2, 3, 4], help="G of v100-dgx1-G"
    )
    p.add_argument("--backends", nargs="+", default=["cpsat", "ilp"], choices=["cpsat", "ilp"])
    p.add_argument("--time-limit", type=positive_seconds, default=60.0, help="seconds per solve")
    p.add_argument("--threads", type=positive_int, default=2, help="solver threads (2)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--batch", type=positive_int, default=None, help="batch (the zoo's default: 64)")
    p.add_argument("--order", choices=["free", "fifo"], default="free",
                   help="schedule per device: free (DLPlacer) or fifo (the simulator's)")  # fmt: skip
    p.add_argument("--show", type=positive_int, nargs="*", default=None,
                   help="G values whose placement is printed (default: every G > 1)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    if max(args.gpus) > 8:
        raise UsageError(f"--gpus: a DGX-1 has 8 GPUs, got {max(args.gpus)}")
    return args


def solve(problem: Problem, name: str, args: argparse.Namespace) -> dict[str, Any]:
    options = SolveOptions(
        objective="makespan",
        time_limit=args.time_limit,
        seed=args.seed,
        threads=args.threads,
        extra={"order": args.order},
    )
    start = time.perf_counter()
    result = get_backend(name).solve(problem, options)
    stats = result.stats
    return {
        "backend": name,
        "seconds": time.perf_counter() - start,
        "model_status": stats.get("model_status"),
        "makespan": stats.get("schedule_makespan"),
        "bound": stats.get("model_bound"),
        "gap": stats.get("model_gap"),
        "simulated": result.objective,
        "warm_start": stats.get("warm_start"),
        "series_bound": stats.get("series_bound"),
        "placement": stats.get("placement"),
    }


def per_device(pp: PlacementProblem, placement: dict[str, str]) -> dict[str, list[str]]:
    """Op names per device in graph order (tied groups by their node name)."""
    out: dict[str, list[str]] = {d.name: [] for d in pp.devices.devices}
    for node in pp.node_names:
        out[placement[node]].append(node)
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    graph = model_graph("inception_v3", batch=args.batch)
    rows: list[dict[str, Any]] = []
    show = args.show if args.show is not None else [g for g in args.gpus if g > 1]
    for g in args.gpus:
        problem = build_problem(graph, get_preset(f"v100-dgx1-{g}"))
        pp = placement_problem(problem)
        one_gpu = list_schedule(pp, [0] * pp.num_nodes, args.order).makespan
        print(f"\nv100-dgx1-{g}: {pp.num_tasks} tasks, {len(pp.prec)} precedences, "
              f"one GPU: {one_gpu * 1e3:.2f} ms per step")  # fmt: skip
        if g == 1:
            rows.append({"gpus": 1, "backend": "-", "makespan": one_gpu, "speedup": 1.0,
                         "bound": one_gpu, "gap": 0.0, "seconds": 0.0, "simulated": one_gpu,
                         "model_status": "OPTIMAL"})  # fmt: skip
            continue
        best: dict[str, Any] | None = None
        for name in args.backends:
            row = {"gpus": g, **solve(problem, name, args)}
            row["speedup"] = one_gpu / row["makespan"] if row["makespan"] else None
            row["speedup_bound"] = one_gpu / row["bound"] if row["bound"] else None
            row["simulated_speedup"] = one_gpu / row["simulated"] if row["simulated"] else None
            rows.append(row)
            print(_line(row))
            if row["makespan"] and (best is None or row["makespan"] < best["makespan"]):
                best = row
        if best is not None and g in show and best["placement"]:
            print(f"  placement of {best['backend']} ({best['makespan'] * 1e3:.2f} ms):")
            for device, ops in per_device(pp, best["placement"]).items():
                print(f"    {device} ({len(ops)} ops): {', '.join(ops)}")
    return rows


def _line(row: dict[str, Any]) -> str:
    paper = PAPER_SPEEDUP.get(row["gpus"])
    gap = f"{row['gap'] * 100:.2f}%" if row["gap"] is not None else "-"
    up = f"<= {row['speedup_bound']:.3f}x" if row.get("speedup_bound") else ""
    return (
        f"  {row['backend']:5s} {row['model_status']:8s} step {row['makespan'] * 1e3:7.2f} ms "
        f"speedup {row['speedup']:.3f}x {up} (gap {gap}; simulator {row['simulated'] * 1e3:.2f} "
        f"ms = {row['simulated_speedup']:.3f}x) in {row['seconds']:.1f} s; start from "
        f"{row['warm_start']}" + (f"; paper {paper}x" if paper else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment; bad arguments are one `error:` line and exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        check_output_path(args.json, "rows JSON")
    rows = run(args)
    if args.json is not None:
        write_text_atomic(args.json, strict_json(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
