"""`python -m experiments.compare`: every backend and the expert baselines, side by side.

For every (model, device preset) the Problem is built once. The expert strategies
(`planner.problems.baselines`) are scored; every backend solves the problem under the same
objective, seed and wall-clock budget (no iteration caps: an anytime backend runs until the
budget unless it proves optimality). Every answer is scored under *both* objectives, OptCNN's
additive Eq. 1 and FlexFlow's simulated iteration time, each with its speedup over data
parallelism, and `planner.recommend` says what a user should run (never a strategy that
simulates slower than a baseline). Verdicts: proven optima must agree and nothing may be
below one (exit status 1 otherwise).

`--quick` (default) fits in about two minutes on 2 cores; `--full` is the comparison of
docs/compare.md. The results folder (results/compare-<time>/) holds results.json (the run's
provenance, every case with its rows and summary), results.csv (one line per row), a plot,
and plans/ with every answer as a strategy file that `python -m planner evaluate` re-scores.
"""

from __future__ import annotations

import signal
import threading

# A Ctrl-C during the imports below (rich, numpy, the planner) is one line and status 130,
# not a traceback of importlib frames; `main` handles the later ones.
if __name__ == "__main__":
    from planner.startup import end_guard, guard_start

    _previous = guard_start()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.progress import Progress, TaskID  # noqa: E402

from backends import BackendError, SolveOptions, backend_names, get_backend  # noqa: E402
from backends.base import evaluate_objective  # noqa: E402
from experiments.compare_report import (  # noqa: E402
    PROBLEM_VERDICTS,
    RTOL,
    Case,
    Row,
    legend,
    plot,
    summary,
    tables,
)
from experiments.runinfo import finish, new_results_folder, run_info  # noqa: E402
from planner.cli.args import (  # noqa: E402
    OneLineArgumentParser,
    exit_now,
    nonnegative_int,
    positive_int,
    positive_seconds,
    report_errors,
)
from planner.deadline import Deadline, OutOfTime, catch_interrupt, stop_requested  # noqa: E402
from planner.errors import LayerwiseError  # noqa: E402
from planner.files import write_text_atomic  # noqa: E402
from planner.problems.problem import Problem  # noqa: E402
from planner.recommend import BaselineTime, baseline_times, recommend  # noqa: E402
from planner.result import DEFAULT_GAP_TOLERANCE, Solver  # noqa: E402

if __name__ == "__main__":
    end_guard(_previous)

MODES: dict[str, dict[str, Any]] = {
    # Measured: about 2 minutes on 2 cores (docs/compare.md gives the command and the load).
    "quick": {
        "models": ["lenet5", "alexnet", "inception_v3", "rnnlm"],
        "presets": ["p100-1x4", "p100-2x4"],
        "time_limit": 3.0,
    },
    "full": {
        "models": [
            "lenet5",
            "alexnet",
            "vgg16",
            "inception_v3",
            "resnet101",
            "rnntc",
            "rnnlm",
            "nmt",
            "transformer",
        ],
        "presets": ["p100-1x4", "p100-2x4", "p100-4x4"],
        "time_limit": 10.0,
    },
}
EXIT_DISAGREEMENT = 1
EXIT_INTERRUPTED = 130
RESULTS_FORMAT = "layerwise.compare"
RESULTS_VERSION = 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        prog="python -m experiments.compare",
        description="Compare every backend and the expert baselines on models x device "
        "presets under one wall-clock budget: a table per setting with both objectives "
        "(additive, simulated), a legend and a summary; results.json, results.csv, a plot "
        "and the plans in a results folder. Exit status 1 when backends disagree, 2 on bad "
        "input.",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        dest="mode",
        action="store_const",
        const="quick",
        help=f"the default: {_mode_help('quick')}; about 2 minutes on 2 cores",
    )
    mode.add_argument(
        "--full",
        dest="mode",
        action="store_const",
        const="full",
        help=f"the comparison of docs/compare.md: {_mode_help('full')}",
    )
    p.add_argument("--models", nargs="+", help="zoo models (default: the mode's)")
    p.add_argument("--presets", nargs="+", help="device presets (default: the mode's)")
    p.add_argument("--backends", nargs="+", default=None, help="default: every registered one")
    p.add_argument(
        "--objective",
        default="additive",
        choices=["additive", "makespan"],
        help="what the backends minimize: additive = OptCNN Eq. 1 (default); makespan = "
        "FlexFlow's simulated iteration time",
    )
    p.add_argument(
        "--time-limit",
        type=positive_seconds,
        default=None,
        help="wall-clock seconds per backend run, the same for all (default: the mode's)",
    )
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random seed (default 0)")
    p.add_argument(
        "--threads", type=positive_int, default=1, help="solver threads, every backend (default 1)"
    )
    p.add_argument(
        "--batch", type=positive_int, default=None, help="global batch (default: the model's)"
    )
    p.add_argument("--max-configs", type=positive_int, default=None, help="cap on configs per op")
    p.add_argument(
        "--out", type=Path, default=Path("results"), help="results folder (default results/)"
    )
    p.add_argument("--no-plot", action="store_true", help="skip the speedup plot")
    args = p.parse_args(argv)
    args.mode = args.mode or "quick"
    for key, value in MODES[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _mode_help(mode: str) -> str:
    m = MODES[mode]
    return f"{', '.join(m['models'])} on {', '.join(m['presets'])}, {m['time_limit']:g} s each"


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


def run(args: argparse.Namespace, console: Console, folder: Path | None = None) -> list[Case]:
    """Every case, with one progress line per finished case; each answer's plan file goes to
    `folder`/plans when a folder is given. After a Ctrl-C, the cases finished before it
    (fewer than asked for): the first stops the running search and the run after it, a
    second (KeyboardInterrupt) abandons the running case at once."""
    backends = check_args(args)
    opts = SolveOptions(
        objective=args.objective, time_limit=args.time_limit, seed=args.seed, threads=args.threads
    )
    cases: list[Case] = []
    todo = [(m, p) for m in args.models for p in args.presets]
    # The experiment owns Ctrl-C: the first stops the running search (it returns its best
    # answer) and the experiment after it; the cases done so far are reported and saved.
    try:
        with catch_interrupt(), Progress(console=console, transient=True) as progress:
            task = progress.add_task("comparing", total=len(todo))
            for model, preset in todo:
                try:
                    case, problem = _run_case(args, backends, opts, model, preset, progress, task)
                except (OutOfTime, KeyboardInterrupt):  # Ctrl-C in the build; a second one
                    case = None
                if case is None or stop_requested():
                    console.print(
                        f"interrupted during {model} on {preset}: its rows are left out; "
                        f"{len(cases)} of {len(todo)} cases done"
                    )
                    break
                if folder is not None:
                    write_plans(folder, case, problem, args.objective, args.batch)
                cases.append(case)
                console.print(_progress_line(case))
                progress.advance(task)
    except KeyboardInterrupt:  # a second Ctrl-C between cases: the cases done still count
        console.print(f"interrupted: {len(cases)} of {len(todo)} cases done")
    return cases


def _run_case(
    args: argparse.Namespace,
    backends: list[Solver],
    opts: SolveOptions,
    model: str,
    preset: str,
    progress: Progress,
    task: TaskID,
) -> tuple[Case, Problem]:
    """One model on one preset: the baselines and every backend (the backends after a stop
    request are not run)."""
    from planner.graph.zoo import model_graph
    from planner.hardware.presets import get_preset
    from planner.problems.problem import build_problem

    t0 = time.perf_counter()
    progress.update(task, description=f"{model} on {preset}: building cost tables")
    graph = model_graph(model, batch=args.batch, deadline=Deadline.never())
    devices = get_preset(preset)
    problem = build_problem(graph, devices, max_configs=args.max_configs, deadline=Deadline.never())
    batch = graph.ops[0].output.size("sample")
    case = Case(model, preset, devices.num_devices, batch, problem.stats["build_seconds"])
    times = baseline_times(problem)
    case.rows = _baseline_rows(model, preset, problem, times, args.objective)
    warm = _additive_optimum(problem) if args.objective == "makespan" else None
    for backend in backends:
        if stop_requested():
            break
        progress.update(task, description=f"{model} on {preset}: {backend.name}")
        opts_k = replace(opts, warm_start=warm)
        case.rows.append(_solve_row(model, preset, problem, backend, opts_k, times))
    judge(case.rows, opts.gap_tolerance)
    case.seconds = time.perf_counter() - t0
    case.summary, case.flagged = summary(case, args.objective, args.time_limit)
    return case, problem


def _progress_line(case: Case) -> str:
    found = [r for r in case.rows if not r.is_baseline and r.objective is not None]
    if not found:
        best = "no backend found an answer"
    else:
        b = min(found, key=lambda r: (r.objective, r.search_seconds or 0.0))
        best = f"best {b.method} ({b.status}, {b.search_seconds or 0:.2f} s)"
    return (
        f"done {case.model} on {case.preset} ({case.devices} devices): {best}; "
        f"case {case.seconds:.1f} s"
    )


def _baseline_rows(
    model: str, preset: str, problem: Any, times: dict[str, BaselineTime], objective: str
) -> list[Row]:
    """The expert strategies, scored under both objectives."""
    rows = []
    for name, b in times.items():
        additive = evaluate_objective(problem, b.choices, "additive")
        value = additive if objective == "additive" else b.simulated
        rows.append(
            Row(
                model,
                preset,
                f"[{name}]",
                "baseline",
                value,
                simulated=b.simulated,
                additive=additive,
                choices=list(b.choices),
            )
        )
    return rows


def _additive_optimum(problem: Any) -> tuple[int, ...] | None:
    """The elimination optimum of OptCNN's model: a warm start for makespan searches."""
    try:
        return get_backend("elimination").solve(problem, SolveOptions(time_limit=60)).choices
    except BackendError:
        return None


def _solve_row(
    model: str,
    preset: str,
    problem: Any,
    backend: Any,
    opts: SolveOptions,
    times: dict[str, BaselineTime],
) -> Row:
    t0 = time.perf_counter()
    try:
        result = backend.solve(problem, opts)
    except BackendError as exc:
        return Row(model, preset, backend.name, "cannot run", note=str(exc))
    finally:
        _reinstall_sigint()
    call = time.perf_counter() - t0
    status = result.status.value + (f"/{result.limit.value}" if result.limit else "")
    row = Row(
        model,
        preset,
        backend.name,
        status,
        result.objective,
        search_seconds=result.stats.get("search_seconds"),
        call_seconds=call,
        gap=result.gap,
        bound=result.bound,
    )
    if result.choices is None:
        return row
    rec = recommend(problem, result, opts.objective, times)
    decision = rec.stats["recommendation"]
    row.choices = list(result.choices)
    row.simulated = decision["simulated"]
    row.additive = (
        result.objective
        if opts.objective == "additive"
        else evaluate_objective(problem, result.choices, "additive")
    )
    row.recommended = decision["to"] if decision["switched"] else "same"
    row.recommended_simulated = (
        times[decision["to"]].simulated if decision["switched"] else row.simulated
    )
    return row


def _reinstall_sigint() -> None:
    """Set Python's SIGINT handler again. CP-SAT (ortools 9.15) catches SIGINT during its
    search and leaves it at SIG_DFL below Python's view: the next Ctrl-C killed the
    comparison without a line, a table or results.json."""
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)
        if handler is not None:
            signal.signal(signal.SIGINT, handler)


def judge(rows: list[Row], tolerance: float = DEFAULT_GAP_TOLERANCE) -> None:
    """Speedups over data parallelism and agreement verdicts for the rows of one case.

    Proven optima (status OPTIMAL: within the gap `tolerance` of the optimum, the searches'
    `SolveOptions.gap_tolerance`) must agree within it (to RTOL with tolerance 0): if they do
    not, every OPTIMAL row is "DISAGREES" (which proof is wrong is not known). No answer may
    be below the smallest proven optimum by more than the tolerance ("BELOW PROVEN
    OPTIMUM"); other answers get their excess over it.
    """
    dp = next((r for r in rows if r.method == "[data_parallel]"), None)
    proven = [
        r.objective for r in rows if r.status.startswith("OPTIMAL") and r.objective is not None
    ]
    optimum = min(proven) if proven else None
    agree = optimum is None or all(v <= optimum * (1 + tolerance) * (1 + RTOL) for v in proven)
    for r in rows:
        if r.objective is None:
            continue
        if dp is not None:
            r.speedup = _ratio(dp.objective, r.objective)
            r.additive_speedup = _ratio(dp.additive, r.additive)
            r.simulated_speedup = _ratio(dp.simulated, r.simulated)
        if optimum is None or r.verdict:
            continue
        if r.status.startswith("OPTIMAL"):
            r.verdict = "agrees" if agree else "DISAGREES"
        elif r.objective < optimum / (1 + tolerance) * (1 - RTOL):
            r.verdict = "BELOW PROVEN OPTIMUM"
        elif r.objective <= optimum * (1 + RTOL):
            r.verdict = "= optimum"
        elif optimum > 0:
            r.verdict = f"+{(r.objective / optimum - 1) * 100:.1f}%"


def _ratio(base: float | None, value: float | None) -> float | None:
    if base is None or value is None or not value > 0:
        return None
    return base / value


# -- results --------------------------------------------------------------------------------


def write_plans(folder: Path, case: Case, problem: Any, objective: str, batch: int | None) -> None:
    """Every answer of `case` as a strategy file (what `python -m planner plan -o` writes), so
    `python -m planner evaluate FILE` re-scores it without this run."""
    cm = problem.dnn("a strategy file records the cost model").cost_model
    cost = {**dataclasses.asdict(cm.options), "source": cm.source}
    model = {"name": case.model, "batch": batch, "kwargs": {}, "coarsen": True}
    plans = folder / "plans"
    plans.mkdir(exist_ok=True)
    for r in case.rows:
        if r.choices is None:
            continue
        name = f"{case.model}-{case.preset}-{r.method.strip('[]')}.json"
        extra = {
            "method": r.method,
            "status": r.status,
            "objective_kind": objective,
            "objective": r.objective,
            "bound": r.bound,
            "additive": r.additive,
            "makespan": r.simulated,
            "cost": cost,
        }
        data = problem.strategy(r.choices).to_json(model=model, extra=extra)
        (plans / name).write_text(json.dumps(data))
        r.plan = f"plans/{name}"


def save(
    cases: list[Case],
    info: dict[str, Any],
    folder: Path,
    make_plot: bool,
    cases_asked: int | None = None,
) -> None:
    """results.json, results.csv and the plot in the run's folder. `partial` in results.json
    says whether a Ctrl-C left out cases (fewer than `cases_asked`)."""
    asked = len(cases) if cases_asked is None else cases_asked
    data = {
        "format": RESULTS_FORMAT,
        "version": RESULTS_VERSION,
        "run": info,
        "partial": len(cases) < asked,
        "cases_asked": asked,
        "cases": [_record(c) for c in cases],
    }
    # strict JSON: a gap over a zero bound is null (the bound says why), never Infinity
    write_text_atomic(folder / "results.json", json.dumps(data, indent=1, allow_nan=False))
    flat = [row for case in data["cases"] for row in case["rows"]]
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(flat[0]) if flat else ["model"])
        w.writeheader()
        w.writerows(
            {k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in flat
        )
    if make_plot and flat:
        plot(cases, folder / "speedup.png")


def _record(case: Case) -> dict[str, Any]:
    def finite(row: Row) -> dict[str, Any]:
        d = dataclasses.asdict(row)
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in d.items()
        }

    out = {k: v for k, v in dataclasses.asdict(case).items() if k != "rows"}
    return {**out, "rows": [finite(r) for r in case.rows]}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison; bad input is one `error:` line (exit 2), a disagreement between
    backends exit 1. The first Ctrl-C stops the running search and the comparison after it:
    the cases done are printed and saved, exit 130; a second Ctrl-C abandons the running
    case, and the cases done are still printed and saved (130)."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a log file gets the whole table
    args = parse_args(argv)
    info = run_info("experiments.compare", argv, args)
    check_args(args)
    folder = new_results_folder(args.out, "compare")
    cases = run(args, console, folder)
    asked = len(args.models) * len(args.presets)
    with _uninterrupted():  # the cases are final: a Ctrl-C more would only lose them
        save(cases, finish(info), folder, not args.no_plot, asked)
        for t in tables(cases, args.objective, args.time_limit):
            console.print(t)
        console.print(legend(args.objective))
    partial = f" (partial: {len(cases)} of {asked} cases)" if len(cases) < asked else ""
    console.print(f"results written to {folder}{partial}")
    bad = [r for c in cases for r in c.rows if r.verdict in PROBLEM_VERDICTS]
    if bad:
        console.print(f"[red]{len(bad)} disagreement(s) between backends[/red]")
        return EXIT_DISAGREEMENT
    if len(cases) < asked:
        print(f"error: interrupted after {len(cases)} case(s)", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """SIGINT ignored meanwhile (in the main thread): the user pressing Ctrl-C again while the
    run's results are written (a second or so) lost them all."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    exit_now(main())  # without the interpreter's teardown (1-2 s with torch loaded)
