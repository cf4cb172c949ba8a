"""`python -m experiments.accuracy`: simulated against measured step time (FlexFlow Fig. 11).

For each model (small sizes that run in seconds on this machine) on `cpu-local-2`:

0. profile the op costs of every config on this machine (`planner.costs.profile`, cached),
   every model's (and the runtime-overhead probe's) before any worker starts;
1. measure the gloo figures of `cpu-local-N` (latency, bandwidth, the message overhead of
   busy workers: `planner.hardware.presets.measure_cpu_local`, cached);
2. build the cost model from those measured costs and plan: data parallelism, model
   parallelism, OWT (and the GNMT expert for RNNs), everything on one worker, the elimination
   backend's optimum (OptCNN's additive objective), MCMC on the simulated makespan, then
   random strategies from the ConfigSpace up to `--strategies`;
3. predict each strategy's step time with the simulator (`planner.sim.simulator.simulate`; the
   additive objective with `--prediction additive`), run it with `runtime.run_strategy` on 2
   worker processes and take the median step time after the warm-up steps; every strategy
   runs `--rounds` times (all of a model's strategies in turn, so a slow spell of the shared
   machine hits one round, not one strategy) and the fastest median counts;
4. print per strategy the simulated and measured times and the relative error
   (simulated - measured) / measured, and per model the median absolute error and the
   Spearman rank correlation. Results go to results/accuracy-<time>/ as CSV and JSON with a
   scatter plot (simulated vs measured, log-log, y = x).

The machine must be otherwise idle. Before each measurement (profiling, the cpu-local
figures) it waits up to `--wait-idle` seconds for the load average per core to fall to
`--max-load` (`planner.hardware.load`); a measurement refuses a machine that is still or
becomes busy, and the experiment ends with that error. Where each measurement used comes
from (its time and load) is printed and kept in accuracy.json ("measurements"). Before each
run it waits for idle cores, records the idle fraction (/proc/stat) and warns when other
processes compete for them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from experiments.runinfo import new_results_folder
from planner.cli.args import (
    MAX_LOAD_HELP,
    OneLineArgumentParser,
    load_limit,
    nonnegative_int,
    nonnegative_seconds,
    one_line,
    positive_int,
    positive_seconds,
)
from planner.errors import LayerwiseError
from runtime.reference import ModelSpec

# Sizes for this 2-core machine: compute-bound enough that a step takes tens to hundreds of
# milliseconds, small enough that ten strategies run in minutes.
MODELS: dict[str, ModelSpec] = {
    "lenet5": ModelSpec("lenet5", 64, {}),
    "alexnet": ModelSpec("alexnet", 8, {"num_classes": 100}),
    "vgg16": ModelSpec("vgg16", 2, {"num_classes": 100}),
    "inception_v3": ModelSpec("inception_v3", 4, {"num_classes": 100}),
    "resnet101": ModelSpec("resnet101", 8, {"image_size": 64, "num_classes": 100}),
    "rnnlm": ModelSpec("rnnlm", 32, {"steps": 8, "hidden": 256, "layers": 2, "vocab": 2000}),
    "transformer": ModelSpec(
        "transformer", 8, {"seq": 64, "width": 128, "layers": 2, "heads": 4, "vocab": 2000}
    ),
}
QUICK = ["lenet5", "alexnet", "rnnlm"]
# The simulator is planner's FlexFlow execution simulator; `additive` (OptCNN Eq. 1) is the
# alternative, for comparison.
PREDICTIONS = ("simulator", "additive")
EXIT_BAD_INPUT = 2


@dataclass
class Row:
    model: str
    strategy: str
    simulated: float  # seconds per step
    measured: float  # median seconds per step after warm-up
    error: float  # (simulated - measured) / measured
    transfer_bytes: int
    idle_before: float | None  # fraction of CPU time idle before the runs (lowest; 1.0: quiet)
    rounds: list[float] = field(default_factory=list)  # median step time of each round


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        prog="python -m experiments.accuracy",
        description="Simulated vs measured step time of planned strategies on this machine.",
    )
    p.add_argument("--models", nargs="+", default=list(MODELS), help="zoo models (default all)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--preset", default="cpu-local-2", help="cpu-local-N preset (default 2)")
    p.add_argument("--strategies", type=positive_int, default=10, help="per model (default 10)")
    p.add_argument("--steps", type=positive_int, default=7, help="training steps per run")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=2,
        help="runs per strategy, all strategies in turn; the fastest median counts (default 2)",
    )
    p.add_argument("--warmup", type=nonnegative_int, default=2, help="steps left out")
    p.add_argument("--repeats", type=positive_int, default=5, help="profiling repeats")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random strategies' seed")
    p.add_argument("--prediction", choices=PREDICTIONS, default="simulator")
    p.add_argument(
        "--mcmc-seconds", type=positive_seconds, default=10.0, help="MCMC budget per model"
    )
    p.add_argument(
        "--timeout", type=positive_seconds, default=300.0, help="hang timeout per run (s)"
    )
    p.add_argument(
        "--wait-idle",
        type=nonnegative_seconds,
        default=120.0,
        help="seconds to wait for a quiet machine before each measurement and for idle "
        "cores before each run (default 120)",
    )
    p.add_argument("--max-load", type=load_limit, metavar="PER_CORE", help=MAX_LOAD_HELP)
    p.add_argument(
        "--cache",
        type=Path,
        help="measured-cost cache folder (default: $LAYERWISE_CACHE_DIR or ~/.cache/layerwise)",
    )
    p.add_argument(
        "--refresh", action="store_true", help="profile again even where the cache has a time"
    )
    p.add_argument(
        "--task-overhead",
        type=nonnegative_seconds,
        help="runtime seconds per task beyond the kernels (default: measured with a probe)",
    )
    p.add_argument(
        "--keep-links",
        action="store_true",
        help="use the cached cpu-local figures instead of measuring them again (unless they "
        "are untrusted: measured on a busy machine or at no recorded load)",
    )
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.models = QUICK
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    match = re.fullmatch(r"cpu-local-(\d+)", args.preset)
    if match is None or int(match[1]) < 2:
        p.error("the runtime executes on this machine's workers: use a cpu-local-N preset, N >= 2")
    args.workers = int(match[1])
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} leaves no step to time out of --steps {args.steps}")
    return args


# -- strategies ------------------------------------------------------------------------------------


def candidates(problem: Any, count: int, seed: int, mcmc_seconds: float) -> list[tuple[str, Any]]:
    """Named strategies: baselines, one worker, backend results, then random ones (distinct)."""
    from backends import SolveOptions, backend_names, get_backend
    from planner.costs.config import ParallelConfig
    from planner.problems.baselines import BASELINES, applicable
    from planner.problems.strategy import Strategy
    from runtime.strategies import random_strategy

    dnn = problem.dnn()
    graph, devices = dnn.graph, dnn.devices
    out: list[tuple[str, Any]] = [
        (name, BASELINES[name](graph, devices)) for name in applicable(graph)
    ]
    single = tuple(ParallelConfig((1,) * len(op.output.dims), (0,)) for op in graph.ops)
    out.append(("one_worker", Strategy(graph, devices, single)))
    solves = [("elimination", SolveOptions(objective="additive", time_limit=60.0))]
    if "mcmc" in backend_names():
        solves.append(("mcmc", SolveOptions(objective="makespan", time_limit=mcmc_seconds)))
    for name, opts in solves:
        result = get_backend(name).solve(problem, opts)
        if result.strategy is not None:
            out.append((name, result.strategy))
    k = 0
    while len(_distinct(out)) < count and k < 50 * count:
        out.append((f"random{k}", random_strategy(graph, devices, seed + k)))
        k += 1
    return _distinct(out)


def _distinct(named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """One entry per distinct strategy; a repeat adds its name: "owt+elimination"."""
    index: dict[Any, int] = {}
    out: list[tuple[str, Any]] = []
    for name, s in named:
        k = index.get(s.configs)
        if k is None:
            index[s.configs] = len(out)
            out.append((name, s))
        elif name not in out[k][0].split("+"):
            out[k] = (f"{out[k][0]}+{name}", out[k][1])
    return out


def predict(cost_model: Any, strategy: Any, how: str) -> float:
    if how == "simulator":
        from planner.sim.simulator import simulate

        return float(simulate(cost_model, strategy).makespan)
    from planner.problems.evaluate import score_strategy

    return float(score_strategy(cost_model, strategy).total)


# -- statistics -------------------------------------------------------------------------------------


def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks 1..n, ties getting their average rank."""
    a = np.asarray(values, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    r = np.empty(len(a))
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and a[order[j + 1]] == a[order[i]]:
            j += 1
        r[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (nan with fewer than 3 points or a constant side)."""
    if len(x) < 3:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    out = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        planned = [r for r in mine if {"elimination", "mcmc"} & set(r.strategy.split("+"))]
        best = min(planned, key=lambda r: r.simulated) if planned else None
        dp = next((r for r in mine if "data_parallel" in r.strategy.split("+")), None)
        out.append(
            {
                "model": model,
                "strategies": len(mine),
                "median_abs_error": statistics.median(abs(r.error) for r in mine),
                "spearman": spearman([r.simulated for r in mine], [r.measured for r in mine]),
                "best_planned": best.strategy if best else None,
                "predicted_speedup_over_dp": dp.simulated / best.simulated if best and dp else None,
                "measured_speedup_over_dp": dp.measured / best.measured if best and dp else None,
            }
        )
    return out


# -- running ----------------------------------------------------------------------------------------


def profile_all(args: argparse.Namespace, say: Any) -> None:
    """Profile the probe graph (unless --task-overhead) and every model, before any worker
    runs: a worker's load would stay in the load average for a minute."""
    graphs = [] if args.task_overhead is not None else [(probe_graph(), "cpu-local-1")]
    graphs += [(MODELS[model].graph(), args.preset) for model in args.models]
    for graph, preset in graphs:
        t0 = time.perf_counter()
        measure_when_quiet(args, say, f"profiling {graph.name}", _profiler(graph, preset, args))
        say(f"{graph.name}: op costs profiled in {time.perf_counter() - t0:.0f} s")


def _profiler(graph: Any, preset: str, args: argparse.Namespace) -> Callable[[], Any]:
    from planner.costs.profile import profile_graph
    from planner.hardware.presets import load_devices

    return lambda: profile_graph(
        graph,
        load_devices(preset),
        repeats=args.repeats,
        progress=lambda *a: None,
        refresh=args.refresh,
        max_load=args.max_load,
    )


def measure_when_quiet(
    args: argparse.Namespace, say: Any, what: str, measure: Callable[[], Any]
) -> Any:
    """`measure()` once the load average per core is down to --max-load (waiting up to
    --wait-idle seconds) and the cores are idle; a still busy machine is its error."""
    from planner.hardware.load import wait_until_quiet

    if not wait_until_quiet(args.wait_idle, args.max_load):
        say(f"the machine stayed busy for {args.wait_idle:g} s before {what}")
    _wait_for_idle(args.wait_idle, say, what)
    return measure()


def measured_times(graph: Any, devices: Any, say: Any, notes: dict[str, str]) -> Any:
    """The cached op costs of `graph`, saying (and keeping in `notes`) where they come from."""
    from planner.costs.profile import MeasuredTimes

    measured = MeasuredTimes.load(devices, graph=graph)
    notes[f"op costs of {graph.name}"] = measured.note
    say(f"{graph.name}: {measured.note}")
    return measured


def run_model(
    model: str, args: argparse.Namespace, say: Any, overhead: float, notes: dict[str, str]
) -> list[Row]:
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.hardware.presets import load_devices
    from planner.problems.problem import build_problem
    from runtime.launch import RunOptions, run_strategy

    spec = MODELS[model]
    graph = spec.graph()
    devices = load_devices(args.preset)
    costs = CostOptions(task_overhead=overhead)
    cm = CostModel(graph, devices, costs, measured=measured_times(graph, devices, say, notes))
    problem = build_problem(graph, devices, cm)
    named = candidates(problem, args.strategies, args.seed, args.mcmc_seconds)
    options = RunOptions(steps=args.steps, warmup=args.warmup, timeout=args.timeout)
    simulated = [predict(cm, strategy, args.prediction) for _, strategy in named]
    times: list[list[float]] = [[] for _ in named]
    idle: list[float | None] = [None] * len(named)
    sent = [0] * len(named)
    for r in range(args.rounds):  # every strategy once per round, rounds in turn
        for k, (name, strategy) in enumerate(named):
            quiet = _wait_for_idle(args.wait_idle, say, f"running {name}")
            idle[k] = quiet if idle[k] is None or quiet is None else min(idle[k], quiet)
            result = run_strategy(strategy, spec, options)
            times[k].append(result.median_step_seconds)
            sent[k] = result.transfer_bytes
            if r == args.rounds - 1:
                say(_line(model, name, simulated[k], times[k]))
    return [
        Row(model, name, sim, min(ts), (sim - min(ts)) / min(ts), b, quiet, ts)
        for (name, _), sim, ts, b, quiet in zip(named, simulated, times, sent, idle, strict=True)
    ]


def _line(model: str, name: str, simulated: float, times: list[float]) -> str:
    measured = min(times)
    rounds = "/".join(f"{t * 1e3:.1f}" for t in times)
    return (
        f"  {model:12s} {name:16s} simulated {simulated * 1e3:9.2f} ms  measured "
        f"{measured * 1e3:9.2f} ms  error {(simulated - measured) / measured * 100:+7.1f}%  "
        f"(rounds {rounds} ms)"
    )


def link_figures(args: argparse.Namespace, say: Any, notes: dict[str, str]) -> None:
    """Measure the cpu-local figures (gloo latency, bandwidth, the message overhead of busy
    workers; about 10 s) into the cache, unless `--keep-links` and they are there, trusted."""
    from planner.hardware.presets import cpu_local_figures, measure_cpu_local

    cached = cpu_local_figures() if args.keep_links else None
    if cached is not None and cached.measured and not cached.trusted:
        say("--keep-links: the cached cpu-local figures are untrusted; measuring them again")
    if cached is None or not cached.trusted:
        measure_when_quiet(
            args,
            say,
            "measuring the cpu-local figures",
            lambda: measure_cpu_local(args.workers, max_load=args.max_load),
        )
        cached = cpu_local_figures()
    notes["cpu-local figures"] = cached.note
    say(cached.note)  # the figures, where and when they were measured, at what load


PROBE_OPS = 48  # tiny linear ops of the runtime-overhead probe


def probe_graph(ops: int = PROBE_OPS) -> Any:
    """A chain of `ops` tiny linears (8 x 32 -> 32) ending in a softmax: almost no compute,
    so a step measures what the runtime spends per task around the kernels."""
    from planner.graph.opgraph import Op, OpGraph, Param, Tensor

    out = [Op("x", "input", (), Tensor.of(sample=8, channel=32))]
    for k in range(ops):
        out.append(
            Op(
                f"fc{k}",
                "linear",
                (out[-1].name,),
                Tensor.of(sample=8, channel=32),
                params=(Param(f"fc{k}.weight", (32, 32)), Param(f"fc{k}.bias", (32,))),
                flops=2.0 * 8 * 32 * 32,
            )
        )
    out.append(Op("loss", "softmax", (out[-1].name,), Tensor.of(sample=8, channel=32)))
    return OpGraph("runtime-probe", tuple(out))


def runtime_task_overhead(args: argparse.Namespace, say: Any, notes: dict[str, str]) -> float:
    """Seconds the runtime spends per task (forward + backward) beyond the profiled kernels:
    (measured one-worker step - the sum of the probe's profiled task times) / its tasks.
    Measured on `probe_graph`, not on the models evaluated; the cost model charges it to
    every task (`CostOptions.task_overhead`)."""
    from planner.costs.config import ParallelConfig
    from planner.hardware.presets import load_devices
    from planner.problems.strategy import Strategy
    from runtime.launch import RunOptions, run_strategy

    graph = probe_graph()
    devices = load_devices("cpu-local-1")
    measured = measured_times(graph, devices, say, notes)  # profiled by profile_all
    _wait_for_idle(args.wait_idle, say, "the runtime-overhead probe")
    single = tuple(ParallelConfig((1,) * len(op.output.dims), (0,)) for op in graph.ops)
    kernels = sum(measured.task_time(op, c) or 0.0 for op, c in zip(graph.ops, single, strict=True))
    options = RunOptions(steps=args.steps + 8, warmup=args.warmup + 3, timeout=args.timeout)
    step = run_strategy(Strategy(graph, devices, single), None, options).median_step_seconds
    tasks = sum(1 for op in graph.ops if op.kind != "input")
    overhead = max(step - kernels, 0.0) / tasks
    say(
        f"runtime overhead per task: {overhead * 1e6:.0f} us (probe of {tasks} tiny ops: step "
        f"{step * 1e3:.2f} ms, profiled kernels {kernels * 1e3:.2f} ms)"
    )
    return overhead


IDLE_ENOUGH = 0.9  # fraction of idle CPU time over 1 s that counts as a quiet machine


def idle_fraction(seconds: float = 1.0) -> float | None:
    """Fraction of all cores' time idle over the next `seconds` (Linux /proc/stat)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (idle1 - idle0) / max(total1 - total0, 1)


def _wait_for_idle(limit: float, say: Any, what: str) -> float | None:
    """Wait up to `limit` seconds for the other processes to leave the cores idle."""
    deadline = time.monotonic() + limit
    idle = idle_fraction()
    while idle is not None and idle < IDLE_ENOUGH and time.monotonic() < deadline:
        idle = idle_fraction()
    if idle is not None and idle < IDLE_ENOUGH:
        say(f"warning: cores only {idle:.0%} idle before {what}: other processes compete")
    return None if idle is None else round(idle, 3)


def save(
    rows: list[Row],
    summary: list[dict[str, Any]],
    args: argparse.Namespace,
    notes: dict[str, str],
) -> Path:
    folder = new_results_folder(args.out, "accuracy")
    data = [asdict(r) for r in rows]
    meta = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    (folder / "accuracy.json").write_text(
        json.dumps(
            {"args": meta, "measurements": notes, "rows": data, "summary": summary}, indent=1
        )
    )
    with open(folder / "accuracy.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(data[0]))
        w.writeheader()
        w.writerows({**d, "rounds": "/".join(f"{t:.6f}" for t in d["rounds"])} for d in data)
    if not args.no_plot:
        plot(rows, folder / "accuracy.png")
    return folder


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5.5))
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        ax.scatter([r.simulated * 1e3 for r in mine], [r.measured * 1e3 for r in mine], label=model)
    lo = min(min(r.simulated, r.measured) for r in rows) * 1e3 / 1.5
    hi = max(max(r.simulated, r.measured) for r in rows) * 1e3 * 1.5
    xs = np.array([lo, hi])
    ax.plot(xs, xs, color="black", lw=0.8, label="simulated = measured")
    ax.fill_between(xs, xs / 1.3, xs * 1.3, color="grey", alpha=0.15, label="within 30%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("simulated step time (ms)")
    ax.set_ylabel("measured step time (ms)")
    ax.set_title("simulator accuracy on cpu-local-2 (gloo, 1 thread per worker)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(summary: list[dict[str, Any]], say: Any) -> None:
    say(
        f"{'model':12s} {'n':>3s} {'median |error|':>15s} {'spearman':>9s}  planner vs data parallel"
    )
    for s in summary:
        speed = ""
        if s["predicted_speedup_over_dp"] is not None:
            speed = (
                f"{s['best_planned']}: predicted {s['predicted_speedup_over_dp']:.2f}x, "
                f"measured {s['measured_speedup_over_dp']:.2f}x"
            )
        say(
            f"{s['model']:12s} {s['strategies']:3d} {s['median_abs_error'] * 100:14.1f}% "
            f"{s['spearman']:9.2f}  {speed}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    def say(text: str) -> None:
        print(text, flush=True)

    try:
        args = parse_args(argv)
        if args.cache is not None:
            os.environ["LAYERWISE_CACHE_DIR"] = str(args.cache)
        notes: dict[str, str] = {}  # where each measurement used comes from
        profile_all(args, say)
        link_figures(args, say, notes)
        overhead = (
            runtime_task_overhead(args, say, notes)
            if args.task_overhead is None
            else args.task_overhead
        )
        rows: list[Row] = []
        for model in args.models:
            rows += run_model(model, args, say, overhead, notes)
        summary = summarize(rows)
        print_summary(summary, say)
        folder = save(rows, summary, args, notes)
    except (LayerwiseError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    say(f"results written to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
