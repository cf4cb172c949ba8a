"""`python -m experiments.compare`: models x device presets x backends, in one table.

For every (model, preset) the Problem is built once; each backend solves it under the same
objective and budget; every answer is re-scored by planner's evaluators (the backend contract
does it) and compared: exact backends that prove optimality must agree, and no answer may be
below a proven optimum. Results go to results/compare-<time>/ as JSON and CSV, with a plot.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from backends import BackendError, SolveOptions, backend_names, get_backend
from backends.base import evaluate_objective
from planner.cli import OneLineArgumentParser, nonnegative_int, positive_int, positive_seconds
from planner.errors import LayerwiseError
from planner.problems.baselines import BASELINES, applicable

QUICK_MODELS = ["lenet5", "alexnet", "vgg16", "inception_v3", "rnnlm"]
QUICK_PRESETS = ["p100-1x4", "p100-2x4"]
RTOL = 1e-6
EXIT_DISAGREEMENT = 1
EXIT_BAD_INPUT = 2
PROBLEM_VERDICTS = ("DISAGREES", "BELOW PROVEN OPTIMUM")


@dataclass
class Row:
    model: str
    preset: str
    method: str
    status: str
    objective: float | None
    speedup: float | None
    search_seconds: float | None
    gap: float | None
    verdict: str = ""
    simulated: float | None = None  # FlexFlow simulation of the same strategy (seconds)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        prog="python -m experiments.compare",
        description="Compare the parallelization strategies of every backend and the expert "
        "baselines on models x device presets: one table, plus JSON/CSV (and a plot) in a "
        "results folder. Exit status 1 when backends disagree, 2 on bad input.",
    )
    p.add_argument(
        "--models", nargs="+", default=QUICK_MODELS, help=f"zoo models (default {QUICK_MODELS})"
    )
    p.add_argument(
        "--presets",
        nargs="+",
        default=QUICK_PRESETS,
        help=f"device presets (default {QUICK_PRESETS})",
    )
    p.add_argument("--backends", nargs="+", default=None, help="default: every registered one")
    p.add_argument(
        "--objective",
        default="additive",
        choices=["additive", "makespan"],
        help="additive: OptCNN Eq. 1 (default); makespan: simulated iteration time",
    )
    p.add_argument(
        "--time-limit",
        type=positive_seconds,
        default=10.0,
        help="seconds per backend run (default 10)",
    )
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--batch", type=positive_int, default=None, help="global batch (default per model)"
    )
    p.add_argument("--max-configs", type=positive_int, default=None, help="cap on configs per op")
    p.add_argument(
        "--out", type=Path, default=Path("results"), help="results folder (default results/)"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the speedup plot")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[Any]:
    """Fail fast on an unknown model, preset or backend; return the backends."""
    from planner.graph.zoo import MODELS
    from planner.hardware.presets import get_preset

    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        raise LayerwiseError(
            f"unknown model(s) {', '.join(map(repr, unknown))}; available: {', '.join(MODELS)}"
        )
    for preset in args.presets:
        get_preset(preset)
    return [get_backend(n) for n in (args.backends or backend_names())]


def run(args: argparse.Namespace, console: Console) -> list[Row]:
    from planner.graph.zoo import model_graph
    from planner.hardware.presets import get_preset
    from planner.problems.problem import build_problem

    backends = check_args(args)
    opts = SolveOptions(objective=args.objective, time_limit=args.time_limit, seed=args.seed)
    rows: list[Row] = []
    cases = [(m, p) for m in args.models for p in args.presets]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("comparing", total=len(cases))
        for model, preset in cases:
            progress.update(task, description=f"{model} on {preset}: building cost tables")
            graph = model_graph(model, batch=args.batch)
            devices = get_preset(preset)
            problem = build_problem(graph, devices, max_configs=args.max_configs)
            case_rows = _baseline_rows(model, preset, problem, args.objective)
            warm = _additive_optimum(problem) if args.objective == "makespan" else None
            for backend in backends:
                progress.update(task, description=f"{model} on {preset}: {backend.name}")
                row = _solve_row(model, preset, problem, backend, replace(opts, warm_start=warm))
                case_rows.append(row)
            _judge(case_rows)
            rows.extend(case_rows)
            progress.advance(task)
    return rows


def _baseline_rows(model: str, preset: str, problem: Any, objective: str) -> list[Row]:
    """The expert strategies (planner.problems.baselines) scored under `objective`."""
    rows = []
    for name in applicable(problem.graph):
        method = f"[{name}]"
        try:
            choices = problem.choices_of(BASELINES[name](problem.graph, problem.devices))
        except LayerwiseError:
            continue  # not in the (capped) config space
        try:
            value = evaluate_objective(problem, choices, objective)
        except BackendError as exc:
            rows.append(Row(model, preset, method, "cannot run", None, None, None, None, str(exc)))
            continue
        simulated = _simulated(problem, choices)
        rows.append(Row(model, preset, method, "baseline", value, None, None, None, "", simulated))
    return rows


def _simulated(problem: Any, choices: tuple[int, ...] | None) -> float | None:
    return None if choices is None else evaluate_objective(problem, choices, "makespan")


def _additive_optimum(problem: Any) -> tuple[int, ...] | None:
    """The elimination optimum of OptCNN's model: a warm start for makespan searches."""
    try:
        return get_backend("elimination").solve(problem, SolveOptions(time_limit=60)).choices
    except BackendError:
        return None


def _solve_row(model: str, preset: str, problem: Any, backend: Any, opts: SolveOptions) -> Row:
    try:
        result = backend.solve(problem, opts)
    except BackendError as exc:
        return Row(model, preset, backend.name, "cannot run", None, None, None, None, str(exc))
    status = result.status.value + (f"/{result.limit.value}" if result.limit else "")
    return Row(
        model,
        preset,
        backend.name,
        status,
        result.objective,
        None,
        result.stats.get("search_seconds"),
        result.gap,
        "",
        _simulated(problem, result.choices),
    )


def _judge(rows: list[Row]) -> None:
    """Speedups over data parallelism and agreement verdicts for the rows of one case.

    Proven optima (status OPTIMAL) must agree to RTOL: if they do not, every OPTIMAL row is
    "DISAGREES" (which proof is wrong is not known). No answer may be below the smallest
    proven optimum ("BELOW PROVEN OPTIMUM"); other answers get their excess over it.
    """
    dp = next((r.objective for r in rows if r.method == "[data_parallel]"), None)
    proven = [
        r.objective for r in rows if r.status.startswith("OPTIMAL") and r.objective is not None
    ]
    optimum = min(proven) if proven else None
    agree = optimum is None or all(math.isclose(v, optimum, rel_tol=RTOL) for v in proven)
    for r in rows:
        if r.objective is None:
            continue
        if dp:
            r.speedup = dp / r.objective if r.objective > 0 else None
        if optimum is None or r.verdict:
            continue
        if r.status.startswith("OPTIMAL"):
            r.verdict = "agrees" if agree else "DISAGREES"
        elif r.objective < optimum * (1 - RTOL):
            r.verdict = "BELOW PROVEN OPTIMUM"
        elif optimum > 0:
            r.verdict = f"+{(r.objective / optimum - 1) * 100:.1f}% vs optimum"


def table(rows: list[Row], objective: str) -> Table:
    t = Table(
        title=f"layerwise: per-iteration time searched under the {objective} objective (time), "
        "every strategy also simulated (FlexFlow); analytic cost model"
    )
    for col in (
        "model",
        "devices",
        "method",
        "status",
        "time (ms)",
        "simulated (ms)",
        "speedup vs DP",
        "search (s)",
        "gap",
        "verdict",
    ):
        t.add_column(
            col,
            justify="right"
            if col in ("time (ms)", "simulated (ms)", "speedup vs DP", "search (s)", "gap")
            else "left",
        )
    for r in rows:
        cells = (
            r.model,
            r.preset,
            r.method,
            r.status,
            f"{r.objective * 1e3:.3f}" if r.objective is not None else "-",
            f"{r.simulated * 1e3:.3f}" if r.simulated is not None else "-",
            f"{r.speedup:.2f}x" if r.speedup else "-",
            f"{r.search_seconds:.3f}" if r.search_seconds is not None else "-",
            f"{r.gap:.2%}" if r.gap is not None else "-",
            r.verdict,
        )
        # Text, not markup: "[data_parallel]" is a method name, not a rich style tag.
        t.add_row(*(Text(c, style="bold red" if c in PROBLEM_VERDICTS else "") for c in cells))
    return t


def save(rows: list[Row], out: Path, plot: bool) -> Path:
    stamp = time.strftime("compare-%Y%m%d-%H%M%S")
    folder = out / stamp
    k = 1
    while folder.exists():  # two runs in the same second keep both results
        k += 1
        folder = out / f"{stamp}-{k}"
    folder.mkdir(parents=True)
    data = [dataclasses.asdict(r) for r in rows]
    (folder / "results.json").write_text(json.dumps(data, indent=1))
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(data[0]) if data else ["model"])
        w.writeheader()
        w.writerows(data)
    if plot and rows:
        _plot(rows, folder / "speedup.png")
    return folder


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r.model, r.preset) for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, len(cases) * 1.2), 4))
    width = 0.8 / max(1, len(methods))
    for k, m in enumerate(methods):
        vals = []
        for c in cases:
            r = next((r for r in rows if (r.model, r.preset) == c and r.method == m), None)
            vals.append(r.speedup if r and r.speedup else 0.0)
        ax.bar([i + k * width for i in range(len(cases))], vals, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{m}\n{p}" for m, p in cases], fontsize=7)
    ax.set_ylabel("speedup over data parallelism")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)  # a log file gets the whole table
    try:
        args = parse_args(argv)
        rows = run(args, console)
        console.print(table(rows, args.objective))
        folder = save(rows, args.out, not args.no_plot)
    except (LayerwiseError, OSError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        print(f"error: {lines[0] if lines else type(exc).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    console.print(f"results written to {folder}")
    bad = [r for r in rows if r.verdict in PROBLEM_VERDICTS]
    if bad:
        console.print(f"[red]{len(bad)} disagreement(s) between backends[/red]")
        return EXIT_DISAGREEMENT
    return 0


if __name__ == "__main__":
    sys.exit(main())
