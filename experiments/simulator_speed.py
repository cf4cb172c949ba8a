"""`python -m experiments.simulator_speed`: full vs delta simulation (FlexFlow Sec. 5, Table 4).

Table 1, per model and preset: tasks in the task graph, milliseconds per full simulation and
per delta simulation (one op's config changed at random, as an MCMC proposal does), their
ratio, the tasks a change re-timed (median), and the number of timeline mismatches between
the two (every delta result is checked against a full simulation of the same strategy, task
by task: must be 0). Only the config space is built, not the cost tables, so large presets
work (`--per-device-batch 32 --presets p100-64x4 --no-search`).

Table 2, as FlexFlow's Table 4: end-to-end time of the same MCMC search (same seed, same
number of proposals, one chain from data parallelism) with full and with delta simulation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

from backends import SolveOptions, get_backend
from planner.costs.config import ConfigSpace
from planner.costs.costmodel import CostModel
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.problem import build_problem
from planner.sim.simulator import Simulator

MODELS = ["alexnet", "resnet101", "inception_v3", "rnntc", "rnnlm", "nmt"]
PRESETS = ["p100-1x4", "p100-2x4", "p100-4x4"]


def speed_row(
    cm: CostModel, space: ConfigSpace, changes: int, seed: int
) -> tuple[int, float, float, int, int]:
    """(tasks, ms per full, ms per delta, tasks re-timed, mismatches) over `changes` random
    config changes from data parallelism."""
    rng = np.random.default_rng(seed)
    configs = data_parallel(cm.graph, cm.devices).configs
    sim = Simulator(cm, configs)
    full_ms, delta_ms, retimed, mismatches = [], [], [], 0
    for _ in range(changes):
        i = int(rng.integers(len(cm.graph.ops)))
        cfg = space[i].configs[int(rng.integers(len(space[i])))]
        t0 = time.perf_counter()
        sim.change(i, cfg)
        t1 = time.perf_counter()
        ref = Simulator(cm, sim.configs)
        t2 = time.perf_counter()
        delta_ms.append((t1 - t0) * 1e3)
        full_ms.append((t2 - t1) * 1e3)
        retimed.append(sim.retimed)
        mismatches += (
            sim.makespan != ref.makespan or sim.timeline().by_key() != ref.timeline().by_key()
        )
    return (
        sim.num_tasks,
        statistics.median(full_ms),
        statistics.median(delta_ms),
        int(statistics.median(retimed)),
        mismatches,
    )


def search_row(problem, proposals: int, seed: int, cap: float) -> tuple[float, float, bool]:  # type: ignore[no-untyped-def]
    """Seconds of the same MCMC search with full and with delta simulation; same answer?"""
    out = []
    for simulation in ("full", "delta"):
        extra = {"iterations": proposals, "inits": ["data_parallel"], "simulation": simulation}
        opts = SolveOptions(objective="makespan", time_limit=cap, seed=seed, extra=extra)
        r = get_backend("mcmc").solve(problem, opts)
        out.append((r.stats["search_seconds"], r.choices, r.limit))
    same = out[0][1] == out[1][1] and out[0][2] == out[1][2]
    return out[0][0], out[1][0], same


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.simulator_speed", description=__doc__)
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--changes", type=int, default=20, help="random config changes per case")
    p.add_argument("--proposals", type=int, default=100, help="MCMC proposals per search")
    p.add_argument("--search-cap", type=float, default=600.0, help="seconds per MCMC search")
    p.add_argument("--no-search", action="store_true", help="skip the MCMC table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--per-device-batch",
        type=int,
        default=None,
        help="batch = this x devices (default: the zoo's)",
    )
    p.add_argument("--max-configs", type=int, default=None, help="cap per op on the random configs")
    args = p.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    speed = Table(title="Full vs delta simulation (median per simulation)")
    for col in (
        "model",
        "devices",
        "tasks",
        "full ms",
        "delta ms",
        "full / delta",
        "re-timed",
        "mismatches",
    ):
        speed.add_column(col, justify="left" if col in ("model", "devices") else "right")
    search = Table(title=f"MCMC search time, {args.proposals} proposals (FlexFlow Table 4)")
    for col in (
        "model",
        "devices",
        "full simulation s",
        "delta simulation s",
        "speedup",
        "same answer",
    ):
        search.add_column(col, justify="left" if col in ("model", "devices") else "right")
    for model in args.models:
        for preset in args.presets:
            devices = get_preset(preset)
            batch = args.per_device_batch and args.per_device_batch * devices.num_devices
            graph = model_graph(model, batch=batch)
            cm = CostModel(graph, devices)
            space = ConfigSpace(graph, devices, max_configs=args.max_configs)
            tasks, full, delta, retimed, bad = speed_row(cm, space, args.changes, args.seed)
            speed.add_row(
                model,
                preset,
                str(tasks),
                f"{full:.1f}",
                f"{delta:.1f}",
                f"{full / delta:.1f}x",
                str(retimed),
                str(bad),
            )
            if not args.no_search:
                problem = build_problem(graph, devices, cm)
                f, d, same = search_row(problem, args.proposals, args.seed, args.search_cap)
                search.add_row(
                    model, preset, f"{f:.1f}", f"{d:.1f}", f"{f / d:.1f}x", "yes" if same else "NO"
                )
            console.print(f"done: {model} on {preset}", style="dim")
    console.print(speed)
    if not args.no_search:
        console.print(search)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
