"""`python -m experiments.compare`: models x device presets x backends, in one table.

For every (model, preset) the Problem is built once; each backend solves it under the same
objective and budget; every answer is re-scored by planner's evaluators (the backend contract
does it) and compared: exact backends that prove optimality must agree, and no answer may be
below a proven optimum. Results go to results/compare-<time>/ as JSON and CSV, with a plot.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from backends import BackendError, SolveOptions, backend_names, get_backend
from planner.baselines import BASELINES, applicable
from planner.errors import LayerwiseError
from planner.evaluate import additive_cost

QUICK_MODELS = ["lenet5", "alexnet", "vgg16", "inception_v3", "rnnlm"]
QUICK_PRESETS = ["p100-1x4", "p100-2x4"]
RTOL = 1e-6


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m experiments.compare",
        description="Compare parallelization strategies found by every backend.",
    )
    p.add_argument("--models", nargs="+", default=QUICK_MODELS, help="zoo models")
    p.add_argument("--presets", nargs="+", default=QUICK_PRESETS, help="device presets")
    p.add_argument("--backends", nargs="+", default=None, help="default: every registered one")
    p.add_argument("--objective", default="additive", choices=["additive", "makespan"])
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds per backend run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=None, help="global batch (default per model)")
    p.add_argument("--max-configs", type=int, default=None, help="cap on configs per op")
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def run(args: argparse.Namespace, console: Console) -> list[Row]:
    from planner.presets import get_preset
    from planner.problem import build_problem
    from planner.zoo import model_graph

    names = args.backends or backend_names()
    backends = [get_backend(n) for n in names]
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
            case_rows = _baseline_rows(model, preset, problem)
            for backend in backends:
                progress.update(task, description=f"{model} on {preset}: {backend.name}")
                case_rows.append(_solve_row(model, preset, problem, backend, opts))
            _judge(case_rows)
            rows.extend(case_rows)
            progress.advance(task)
    return rows


def _baseline_rows(model: str, preset: str, problem: Any) -> list[Row]:
    rows = []
    dp = None
    for name in applicable(problem.graph):
        try:
            choices = problem.choices_of(BASELINES[name](problem.graph, problem.devices))
        except LayerwiseError:
            continue
        value = additive_cost(problem, choices)
        if name == "data_parallel":
            dp = value
        rows.append(Row(model, preset, f"[{name}]", "baseline", value, None, None, None))
    for r in rows:
        r.speedup = dp / r.objective if dp and r.objective else None
    return rows


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
    )


def _judge(rows: list[Row]) -> None:
    """Speedups over data parallelism and agreement verdicts between backends."""
    dp = next((r.objective for r in rows if r.method == "[data_parallel]"), None)
    proven = [
        r.objective for r in rows if r.status.startswith("OPTIMAL") and r.objective is not None
    ]
    optimum = min(proven) if proven else None
    for r in rows:
        if r.objective is None:
            continue
        if dp:
            r.speedup = dp / r.objective
        if optimum is None or r.verdict:
            continue
        if r.objective < optimum * (1 - RTOL):
            r.verdict = "BELOW PROVEN OPTIMUM"
        elif r.status.startswith("OPTIMAL"):
            r.verdict = (
                "agrees" if math.isclose(r.objective, optimum, rel_tol=RTOL) else "DISAGREES"
            )
        else:
            r.verdict = f"+{(r.objective / optimum - 1) * 100:.1f}% vs optimum"


def table(rows: list[Row], objective: str) -> Table:
    t = Table(title=f"layerwise: {objective} per-iteration time (analytic cost model)")
    for col in (
        "model",
        "devices",
        "method",
        "status",
        "time (ms)",
        "speedup vs DP",
        "search (s)",
        "gap",
        "verdict",
    ):
        t.add_column(
            col,
            justify="right"
            if col in ("time (ms)", "speedup vs DP", "search (s)", "gap")
            else "left",
        )
    for r in rows:
        t.add_row(
            r.model,
            r.preset,
            r.method,
            r.status,
            f"{r.objective * 1e3:.3f}" if r.objective is not None else "-",
            f"{r.speedup:.2f}x" if r.speedup else "-",
            f"{r.search_seconds:.3f}" if r.search_seconds is not None else "-",
            f"{r.gap:.2%}" if r.gap is not None else "-",
            r.verdict,
        )
    return t


def save(rows: list[Row], out: Path, plot: bool) -> Path:
    folder = out / time.strftime("compare-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    data = [r.__dict__ for r in rows]
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
    args = parse_args(argv)
    console = Console()
    try:
        rows = run(args, console)
    except LayerwiseError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    console.print(table(rows, args.objective))
    folder = save(rows, args.out, not args.no_plot)
    console.print(f"results written to {folder}")
    bad = [r for r in rows if r.verdict in ("DISAGREES", "BELOW PROVEN OPTIMUM")]
    if bad:
        console.print(f"[red]{len(bad)} disagreement(s) between backends[/red]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
