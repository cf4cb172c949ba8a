"""`evaluate`: re-score a strategy file (OptCNN's additive cost, FlexFlow's simulated step),
or simulate a pipelined plan's step; optionally a Chrome trace and a Gantt chart."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from planner.cli.args import UsageError
from planner.cli.inputs import check_cost_section, check_outputs, malformed
from planner.cli.output import quantity
from planner.files import strict_json

__all__ = ["cmd_evaluate"]

EVALUATE_LOG = logging.getLogger("planner.evaluate")


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Re-score a strategy file; each phase says what it does on stderr once it has lasted a
    few seconds (a 70B pipeline plan's simulation takes minutes): planner.logs.phase."""
    from planner.logs import phase
    from planner.plans import Evaluation
    from planner.problems.evaluate import score_strategy
    from planner.problems.sizes import describe_peak, peak_parts
    from planner.problems.strategy import load_strategy
    from planner.sim.simulator import simulate
    from planner.sources import cost_model

    check_outputs((args.trace, "trace"), (args.plot, "plot"))
    path = args.strategy
    with phase(EVALUATE_LOG, f"reading {path}: rebuilding its graph and devices"):
        strategy, data = malformed("strategy file", path, lambda: load_strategy(path))
    cost = check_cost_section(data.get("cost", {}))
    options = {k: v for k, v in cost.items() if k != "source"}
    what = f"{strategy.graph.name} ({quantity(len(strategy.graph.ops), 'op')})"
    on = f"{strategy.devices.name} ({quantity(strategy.devices.num_devices, 'device')})"
    with phase(EVALUATE_LOG, f"the cost model of {what} on {on}"):
        cm = cost_model(strategy.graph, strategy.devices, cost.get("source", "analytic"), **options)
    if "pipeline" in data:  # the step is the schedule's timeline of micro-batch costs
        return _evaluate_pipelined(strategy, data, cm, args)
    with phase(EVALUATE_LOG, f"the additive cost (OptCNN Eq. 1) of {what}"):
        b = score_strategy(cm, strategy)
    with phase(EVALUATE_LOG, f"simulating the step of {what} on {on} (FlexFlow)"):
        timeline = simulate(cm, strategy)
    scores = Evaluation(
        b.total, timeline.makespan, b.compute, b.sync, b.transfer, float(b.memory.max()), timeline
    )
    _timeline_files(scores.timeline, strategy, args)
    parts = peak_parts(cm, strategy.configs)
    if args.json:
        print(strict_json({**scores.to_json(), "memory_peak_parts": parts}))
    else:
        print(
            f"additive (OptCNN Eq. 1): {scores.additive * 1e3:.3f} ms = compute "
            f"{scores.compute * 1e3:.3f} + sync {scores.sync * 1e3:.3f} + transfer "
            f"{scores.transfer * 1e3:.3f}; peak memory per device "
            f"{scores.memory_peak_bytes / 2**20:.1f} MiB"
        )
        print(f"makespan (FlexFlow simulation): {scores.makespan * 1e3:.3f} ms")
        print(f"memory: {describe_peak(parts)}")
    return 0


def _evaluate_pipelined(
    strategy: Any, data: dict[str, Any], cm: Any, args: argparse.Namespace
) -> int:
    """A pipelined plan file: its step simulated as a pipeline (docs/simulator.md,
    "Pipelines"); --plot draws the pipeline's timeline, --trace is refused."""
    from planner.logs import phase
    from planner.pipeline.spec import Pipeline, PipelinedStrategy
    from planner.pipeline.stages import simulate_pipelined
    from planner.problems.sizes import describe_peak, pipeline_peak_parts

    if args.trace:
        raise UsageError("--trace is not written for a pipelined plan: use --plot")
    pipe = malformed("strategy file", args.strategy, lambda: Pipeline.from_json(data["pipeline"]))
    ps = malformed("strategy file", args.strategy, lambda: PipelinedStrategy(strategy, pipe))
    chunks = quantity(pipe.chunks, "chunk")
    group = quantity(len(pipe.group_of(0)), "device")
    with phase(EVALUATE_LOG, f"simulating the pipeline's step: {chunks}, {group} per stage"):
        timeline = simulate_pipelined(cm, ps)
    out = {
        "makespan": timeline.makespan,
        "bubble": timeline.bubble,
        "memory_peak_bytes": max(timeline.peak_bytes),
        "peak_bytes_per_stage": list(timeline.peak_bytes),
        "memory_peak_parts": pipeline_peak_parts(timeline, strategy.devices, cm.options),
        "stages": pipe.stages,
        "chunks": pipe.chunks,
        "micro_batches": pipe.micro_batches,
        "schedule": pipe.schedule,
    }
    if args.plot:
        from planner.pipeline.chart import gantt

        with phase(EVALUATE_LOG, f"drawing {args.plot}"):
            gantt(timeline, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        print(strict_json(out))
    else:
        print(
            f"pipeline: {quantity(pipe.stages, 'stage')} x {quantity(pipe.virtual, 'chunk')}, "
            f"{quantity(pipe.micro_batches, 'micro-batch', plural='micro-batches')}, "
            f"{pipe.schedule}; peak memory per device "
            f"{out['memory_peak_bytes'] / 2**20:.1f} MiB"
        )
        print(
            f"step (pipeline simulation): {timeline.makespan * 1e3:.3f} ms, bubble "
            f"{timeline.bubble:.1%}"
        )
        print(f"memory: {describe_peak(out['memory_peak_parts'])}")
    return 0


def _timeline_files(timeline: Any, strategy: Any, args: argparse.Namespace) -> None:
    from planner.sim.trace import save_chrome_trace, save_gantt

    if args.trace:
        save_chrome_trace(timeline, args.trace)
        print(f"trace written to {args.trace}", file=sys.stderr)
    if args.plot:
        save_gantt(
            timeline,
            args.plot,
            f"{strategy.graph.name} on {strategy.devices.name}: "
            f"{timeline.makespan * 1e3:.3f} ms simulated",
        )
        print(f"plot written to {args.plot}", file=sys.stderr)
