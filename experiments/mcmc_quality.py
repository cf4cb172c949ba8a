"""`python -m experiments.mcmc_quality`: how good FlexFlow's MCMC search is (Sec. 8.3-8.4).

Part 1 (FlexFlow 8.4): on small problems where the exact `search` backend can prove the
optimum of the simulated iteration time, does `mcmc` find the same one, and how long does
each take? (FlexFlow: exhaustive search took 0.8 h for LeNet and 18 h for RNNLM, 2 steps.)

Part 2: on zoo models at 4 to 16 devices, `mcmc` (warm-started from the additive optimum,
as one of its initial strategies) is given a budget, then polished to a local optimum: the
speedup of its simulated iteration time over data parallelism, and whether no single-op
change improves it (checked by the polish running to completion).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from backends import SolveOptions, get_backend
from backends.base import evaluate_objective
from planner.graph.zoo import list_models, model_graph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.problem import build_problem

SMALL = [("lenet5", {}), ("rnnlm", {"steps": 2})]
MODELS = list_models()


def exact_vs_mcmc(console: Console, preset: str, cap: float) -> Table:
    t = Table(title=f"Exact search vs MCMC on the simulated iteration time, {preset}")
    for col in (
        "model",
        "configs",
        "exact optimum (ms)",
        "exact status",
        "exact s",
        "mcmc best (ms)",
        "mcmc s to best",
        "same",
    ):
        t.add_column(col, justify="left" if col == "model" else "right")
    for name, kwargs in SMALL:
        problem = build_problem(model_graph(name, **kwargs), get_preset(preset))
        dp = problem.choices_of(data_parallel(problem.graph, problem.devices))
        exact = get_backend("search").solve(
            problem, SolveOptions(objective="makespan", time_limit=cap, warm_start=dp)
        )
        m = get_backend("mcmc").solve(
            problem, SolveOptions(objective="makespan", time_limit=cap, extra={"iterations": 3000})
        )
        reach = next((s for s, v in m.stats["trace"] if v <= m.objective), None)
        same = abs(m.objective - exact.objective) <= 1e-9 * exact.objective
        t.add_row(
            f"{name} {kwargs or ''}",
            " x ".join(map(str, problem.sizes)),
            f"{exact.objective * 1e3:.4f}",
            exact.status.value,
            f"{exact.stats['search_seconds']:.1f}",
            f"{m.objective * 1e3:.4f}",
            f"{reach:.1f}" if reach is not None else "-",
            "yes" if same else "NO",
        )
        console.print(f"done: {name}", style="dim")
    return t


def zoo_quality(
    console: Console, models: list[str], presets: list[str], budget: float, polish: float
) -> Table:
    t = Table(title=f"MCMC ({budget:g} s) + polish ({polish:g} s), simulated iteration time")
    for col in (
        "model",
        "devices",
        "data parallel (ms)",
        "mcmc (ms)",
        "speedup",
        "locally optimal",
    ):
        t.add_column(col, justify="left" if col in ("model", "devices") else "right")
    for name in models:
        graph = model_graph(name)
        for preset in presets:
            problem = build_problem(graph, get_preset(preset))
            dp = evaluate_objective(
                problem, problem.choices_of(data_parallel(graph, problem.devices)), "makespan"
            )
            warm = get_backend("elimination").solve(problem, SolveOptions(time_limit=60)).choices
            opts = SolveOptions(objective="makespan", time_limit=budget, warm_start=warm)
            r = get_backend("mcmc").solve(problem, opts)
            assert r.choices is not None
            polished = get_backend("mcmc").solve(
                problem,
                SolveOptions(
                    objective="makespan",
                    time_limit=polish,
                    warm_start=r.choices,
                    extra={"iterations": 1, "inits": ["warm_start"], "polish": True},
                ),
            )
            local = polished.stats.get("locally_optimal")
            t.add_row(
                name,
                preset,
                f"{dp * 1e3:.3f}",
                f"{polished.objective * 1e3:.3f}",
                f"{dp / polished.objective:.2f}x",
                "yes" if local else "not checked (time)",
            )
            console.print(f"done: {name} on {preset}", style="dim")
    return t


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.mcmc_quality", description=__doc__)
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--presets", nargs="+", default=["p100-1x4", "p100-2x4", "p100-4x4"])
    p.add_argument("--budget", type=float, default=30.0, help="mcmc seconds per case (part 2)")
    p.add_argument("--polish", type=float, default=120.0, help="polish seconds per case")
    p.add_argument("--exact-cap", type=float, default=600.0, help="seconds for part 1 searches")
    p.add_argument("--part", choices=["1", "2", "both"], default="both")
    args = p.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.part in ("1", "both"):
        console.print(exact_vs_mcmc(console, "p100-1x4", args.exact_cap))
    if args.part in ("2", "both"):
        console.print(zoo_quality(console, args.models, args.presets, args.budget, args.polish))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
