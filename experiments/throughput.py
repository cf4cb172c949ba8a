"""Shared by the paper reproductions (experiments.optcnn_fig7, experiments.flexflow_throughput):
build a problem at a paper's setting, score named strategies under both objectives, and turn
a simulated iteration time into training throughput (samples per second); the options every
reproduction has (`reproduction_parser`), the loop over models and GPU counts (`run_grid`)
and the command line around it (`reproduce`, given a `Reproduction`).

A strategy's throughput is its global batch over its simulated iteration time (FlexFlow's
simulator, planner/sim); `score="additive"` uses OptCNN's Eq. 1 instead (what OptCNN's
Table 4 compares with measured step times). Expert strategies are scored straight from
their configs (`planner.problems.evaluate.score_strategy`, `planner.sim.simulate`), so they
need not be in a capped config space.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from backends import BackendError, SolveOptions, SolveResult, get_backend
from backends.base import evaluate_objective
from experiments.runinfo import finish, load_line, new_results_folder, recorded_args, run_info
from planner.cli.args import OneLineArgumentParser, positive_int, report_errors
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.errors import LayerwiseError
from planner.problems.baselines import BASELINES
from planner.problems.problem import Problem


class LocalBatchNormCostModel(CostModel):
    """Batch norm with per-device statistics, as frameworks ran it in 2018 (OptCNN, FlexFlow):
    no statistics exchange is priced (t_c) or simulated. The default `CostModel` synchronizes
    them so that any split trains like one device (docs/cost_model.md)."""

    def norm_groups(self, i: int, cfg: ParallelConfig) -> list[list[int]] | None:
        return None


@dataclass(frozen=True)
class Setting:
    """Where a problem comes from: a zoo model at a global batch on a device preset."""

    model: str
    gpus: int
    preset: str
    batch: int
    sync: str = "ring"
    batch_norm: str = "sync"  # "local": LocalBatchNormCostModel
    space: str = "full"  # what config space was searched (see `build`)


@dataclass(frozen=True)
class Point:
    """One strategy at one setting: both objectives (seconds) and the throughput."""

    model: str
    gpus: int
    strategy: str
    additive: float | None
    simulated: float | None
    throughput: float | None  # samples per second, from the score chosen by the experiment
    search_seconds: float | None = None
    status: str = ""
    note: str = ""


def preset_for(gpus: int, cluster: str = "p100", per_node: int = 4) -> str:
    """1, 2, 4 GPUs on one node; more on nodes of `per_node` (OptCNN's and FlexFlow's
    clusters): 8 GPUs = 2 nodes, 16 = 4 nodes, 64 = 16 nodes."""
    if gpus <= per_node:
        return f"{cluster}-1x{gpus}"
    if gpus % per_node:
        raise ValueError(f"{gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    return f"{cluster}-{gpus // per_node}x{per_node}"


def build(
    model: str,
    gpus: int,
    batch: int,
    cluster: str = "p100",
    sync: str = "ring",
    batch_norm: str = "sync",
    max_configs: int | None = None,
) -> tuple[Problem, Setting]:
    """The problem of `model` at global `batch` on `gpus` GPUs of `cluster`, in the config
    space `build_problem` picks (`space="auto"`: the full space while its tables are small,
    else the mesh space, docs/space.md), optionally capped at `max_configs` per op; the
    Setting says which space was searched."""
    from planner.graph.zoo import model_graph
    from planner.hardware.presets import get_preset
    from planner.problems.problem import build_problem

    preset = preset_for(gpus, cluster)
    graph = model_graph(model, batch=batch)
    devices = get_preset(preset)
    model_class = LocalBatchNormCostModel if batch_norm == "local" else CostModel
    cm = model_class(graph, devices, CostOptions(sync=sync))  # type: ignore[arg-type]
    problem = build_problem(graph, devices, cm, max_configs, space="auto")
    space = problem.space_kind or "full"
    if max_configs is not None:
        space += f", first {max_configs} configs per op"
    return problem, Setting(model, gpus, preset, batch, sync, batch_norm, space)


def score_baseline(problem: Problem, name: str) -> tuple[float, float]:
    """(additive, simulated) seconds of an expert strategy, from its configs."""
    from planner.problems.evaluate import score_strategy
    from planner.sim.simulator import simulate

    dnn = problem.dnn("the expert strategies are strategies of a DNN")
    strategy = BASELINES[name](dnn.graph, dnn.devices)
    return score_strategy(dnn.cost_model, strategy).total, simulate(
        dnn.cost_model, strategy
    ).makespan


def solve(problem: Problem, backend: str, options: SolveOptions) -> SolveResult | str:
    """A backend's result, or why it cannot run."""
    try:
        return get_backend(backend).solve(problem, options)
    except BackendError as exc:
        return str(exc)


def result_point(
    problem: Problem, setting: Setting, name: str, result: SolveResult | str, score: str
) -> Point:
    """A backend's answer as a Point (both objectives re-scored by planner's evaluators)."""
    if isinstance(result, str) or result.choices is None:
        note = result if isinstance(result, str) else f"no answer ({result.status.value})"
        return Point(setting.model, setting.gpus, name, None, None, None, note=note)
    additive = evaluate_objective(problem, result.choices, "additive")
    simulated = evaluate_objective(problem, result.choices, "makespan")
    status = result.status.value + (f"/{result.limit.value}" if result.limit else "")
    return Point(
        setting.model,
        setting.gpus,
        name,
        additive,
        simulated,
        throughput(setting.batch, additive if score == "additive" else simulated),
        result.stats.get("search_seconds"),
        status,
    )


def baseline_point(problem: Problem, setting: Setting, name: str, score: str) -> Point:
    additive, simulated = score_baseline(problem, name)
    value = additive if score == "additive" else simulated
    return Point(
        setting.model, setting.gpus, name, additive, simulated, throughput(setting.batch, value)
    )


def throughput(batch: int, seconds: float | None) -> float | None:
    return None if seconds is None or not seconds > 0 else batch / seconds


def lookup(points: Sequence[Point], model: str, gpus: int, strategy: str) -> Point | None:
    return next(
        (p for p in points if (p.model, p.gpus, p.strategy) == (model, gpus, strategy)), None
    )


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b > 0 else a / b


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def save_results(
    name: str, out: Path, info: dict[str, Any], settings: list[Setting], points: list[Point]
) -> Path:
    """results/<name>-<time>/results.json with the run's provenance, settings and points."""
    folder = new_results_folder(out, name)
    data = {
        "format": f"layerwise.{name}",
        "version": 1,
        "run": info,
        "settings": [asdict(s) for s in settings],
        "points": [asdict(p) for p in points],
    }
    (folder / "results.json").write_text(json.dumps(data, indent=1))
    return folder


def load_results(path: Path, name: str) -> tuple[dict[str, Any], list[Setting], list[Point]]:
    """The run info, settings and points of a results.json that `save_results(name, ...)`
    wrote, to print and plot a finished run again without computing it."""
    from planner.errors import LayerwiseError
    from planner.files import read_json_checked

    data = read_json_checked(path, "results", LayerwiseError)
    if not isinstance(data, dict) or data.get("format") != f"layerwise.{name}":
        raise LayerwiseError(f"{path} is not a results file of experiments.{name}")
    try:
        settings = [Setting(**s) for s in data["settings"]]
        points = [Point(**p) for p in data["points"]]
    except (KeyError, TypeError) as exc:
        raise LayerwiseError(f"{path} is malformed: {exc}") from None
    return data.get("run", {}), settings, points


def plot_throughput(
    points: Sequence[Point],
    models: Sequence[str],
    strategies: Sequence[str],
    path: Path,
    title: str,
    ideal_from: str | None = None,
    score: str = "simulated",
) -> None:
    """Throughput against GPUs on log-log axes (linear scaling is a straight line), one panel
    per model, one line per strategy; `ideal_from` draws linear scaling from that strategy's
    smallest setting (the papers' red / dashed lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(models))
    rows = math.ceil(len(models) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    for ax, model in zip(axes.flat, models, strict=False):
        gpus = sorted({p.gpus for p in points if p.model == model})
        for s in strategies:
            ys = [getattr(lookup(points, model, g, s), "throughput", None) for g in gpus]
            xs = [g for g, y in zip(gpus, ys, strict=True) if y is not None]
            if xs:
                ax.plot(xs, [y for y in ys if y is not None], marker="o", ms=3, label=s)
        if ideal_from is not None and gpus:
            first = lookup(points, model, gpus[0], ideal_from)
            if first is not None and first.throughput is not None:
                base = first.throughput / gpus[0]
                ax.plot(gpus, [base * g for g in gpus], "r--", lw=0.8, label="linear scaling")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(gpus)
        ax.set_xticklabels([str(g) for g in gpus])
        ax.minorticks_off()
        ax.set_title(model, fontsize=9)
        ax.set_xlabel("GPUs", fontsize=8)
        ax.set_ylabel(f"samples / s ({score} time)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reproduction_parser(
    prog: str, description: str, models: Sequence[str], gpus: Sequence[int]
) -> argparse.ArgumentParser:
    """A parser with the options every reproduction has (`models`, `gpus`: the defaults);
    each adds its own, then `parse_reproduction_args`."""
    p = OneLineArgumentParser(prog=prog, description=description)
    p.add_argument("--models", nargs="+", default=models, help=f"default {' '.join(models)}")
    p.add_argument(
        "--gpus",
        nargs="+",
        type=positive_int,
        default=gpus,
        help=f"default {' '.join(map(str, gpus))}",
    )
    p.add_argument("--sync", choices=["ring", "ps"], default="ring", help="parameter sync model")
    p.add_argument(
        "--batch-norm",
        choices=["sync", "local"],
        default="sync",
        help="sync: statistics exchanged across a sample split (default); local: per-device "
        "statistics, unpriced (as in 2018)",
    )
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder")
    p.add_argument("--plot", type=Path, help="write the figure here (default: results folder)")
    p.add_argument(
        "--from-results",
        type=Path,
        metavar="RESULTS_JSON",
        help="print and plot a finished run's results.json again (its own settings), "
        "computing nothing",
    )
    return p


def parse_reproduction_args(
    p: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """`p`'s arguments, with the models checked against the zoo and the GPU counts against
    the papers' nodes of 4 (`preset_for`)."""
    from planner.graph.zoo import MODELS as ZOO

    args = p.parse_args(argv)
    unknown = [m for m in args.models if m not in ZOO]
    if unknown:
        raise LayerwiseError(f"unknown model(s) {unknown}; available: {', '.join(ZOO)}")
    bad = [g for g in args.gpus if g > 4 and g % 4]
    if bad:
        raise LayerwiseError(f"--gpus {bad}: above 4, GPUs come in nodes of 4 (8, 12, 16, ...)")
    return args


Say = Callable[[str], None]  # shows what a measurement is doing now (the status line)
Measure = Callable[[argparse.Namespace, str, int, Say], tuple[Setting, list[Point], str]]


def run_grid(
    args: argparse.Namespace, console: Console, measure: Measure
) -> tuple[list[Setting], list[Point]]:
    """Every model of args.models on every count of args.gpus (fewest first): `measure(args,
    model, gpus, say)` gives the setting, its points and a line printed when it is done."""
    settings: list[Setting] = []
    points: list[Point] = []
    with console.status("") as status:
        for model in args.models:
            for gpus in sorted(args.gpus):

                def say(what: str, model: str = model, gpus: int = gpus) -> None:
                    status.update(f"{model} on {gpus} GPUs: {what}")

                setting, new, line = measure(args, model, gpus, say)
                settings.append(setting)
                points += new
                console.print(line)
    return settings, points


@dataclass(frozen=True)
class Reproduction:
    """What differs between the paper reproductions' command lines (`reproduce` runs one)."""

    name: str  # module name under experiments/, and the results' name
    title: str  # e.g. "OptCNN Fig. 7 setting"
    parse_args: Callable[[Sequence[str] | None], argparse.Namespace]
    measure: Measure  # one model on one GPU count (`run_grid`)
    tables: Callable[[argparse.Namespace, list[Setting], list[Point]], list[Any]]
    setting: Callable[[argparse.Namespace], str]  # one line: the modelling choices of the run
    strategies: Sequence[str]
    width: int = 130
    plot_options: Callable[[argparse.Namespace], dict[str, Any]] = lambda args: {}


def reproduce(rep: Reproduction, argv: Sequence[str] | None) -> int:
    """Run (or, with --from-results, reprint) a reproduction: tables, the setting line with the
    load, a plot; bad input is one `error:` line (exit 2), a second Ctrl-C (the first stops
    the running search) exit 130 (`planner.cli.args.report_errors`)."""
    return report_errors(lambda: _reproduce(rep, argv))


def _reproduce(rep: Reproduction, argv: Sequence[str] | None) -> int:
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, rep.width)
    args = rep.parse_args(argv)
    if args.from_results:
        info, settings, points = load_results(args.from_results, rep.name)
        args = recorded_args(args, info)
        folder = args.from_results.parent
    else:
        info = run_info(f"experiments.{rep.name}", argv, args)
        settings, points = run_grid(args, console, rep.measure)
        info = finish(info)
        folder = save_results(rep.name, args.out, info, settings, points)
    for table in rep.tables(args, settings, points):
        console.print(table)
    console.print(f"setting: {rep.setting(args)}; {load_line(info)}")
    plot_throughput(
        points,
        args.models,
        rep.strategies,
        args.plot or folder / f"{rep.name}.png",
        f"{rep.title}: {rep.setting(args)}",
        ideal_from="data_parallel",
        **rep.plot_options(args),
    )
    console.print(f"results in {folder}")
    return 0
