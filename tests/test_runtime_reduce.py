"""Contraction (row-parallel) splits trained by the runtime on gloo workers and compared with
single-process training in float64: Megatron-LM's column-then-row pairing of a GPT-2 block,
its partial sums reduce-scattered into a sequence split or summed on one rank."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
from test_capture_llm import gpt2
from test_runtime_llm import F64, TOKENS, budget  # noqa: F401 (budget: an autouse fixture)

import planner
import runtime
from planner.costs.config import ParallelConfig
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import CHANNEL, LENGTH, SAMPLE, contraction
from planner.hardware.presets import get_preset
from planner.problems.strategy import Strategy
from runtime.plan import build_plan


@functools.cache
def _graph() -> OpGraph:
    """The planned graph of gpt2("sdpa") (seeded, built the same each time): once a file."""
    result = planner.plan(gpt2("sdpa"), "cpu-local-2", example_inputs=TOKENS, backend="elimination")
    graph = result.problem.dnn().graph
    assert graph is not None
    return graph


def megatron(graph: OpGraph, world: int, rest: Callable[[Op], dict[str, int]]) -> Strategy:
    """Linears that can sum in pieces split their sum `world` ways (row-parallel), the other
    linears and attention their channels (column-parallel, whole heads); every other op as
    `rest` says, on the first devices."""
    configs = []
    for op in graph.ops:
        if op.kind == "linear" and contraction(op) is not None and "c_attn" not in op.name:
            cfg = ParallelConfig((1,) * len(op.output.dims), tuple(range(world)), world)
        else:
            split = {CHANNEL: world} if op.kind in ("linear", "attention") else rest(op)
            degrees = tuple(split.get(d, 1) for d in op.output.dims)
            cfg = ParallelConfig(degrees, tuple(range(math.prod(degrees))))
        configs.append(cfg)
    return Strategy(graph, get_preset(f"cpu-local-{world}"), tuple(configs))


def _sequence(world: int) -> Callable[[Op], dict[str, int]]:
    """Norms, adds and the rest split along the sequence (Megatron's sequence parallelism):
    the partial sums are reduce-scattered into it."""
    return lambda op: {LENGTH: world} if LENGTH in op.output.dims else {SAMPLE: world}


def _whole(op: Op) -> dict[str, int]:
    """Everything else whole on rank 0: the partial sums are added there."""
    return {}


@pytest.mark.parametrize(  # by default the sums reduce-scattered at world 4, added at world 2
    "rest, world",
    [
        ("sequence", 4),
        ("whole", 2),
        pytest.param("sequence", 2, marks=pytest.mark.slow),
        pytest.param("whole", 4, marks=pytest.mark.slow),
    ],
)
def test_megatron_pairing_trains_like_single_process(world: int, rest: str) -> None:
    module = gpt2("sdpa")
    graph = _graph()
    strategy = megatron(graph, world, _sequence(world) if rest == "sequence" else _whole)
    reduced = [c for c in strategy.configs if c.reduce > 1]
    assert len(reduced) >= 4  # each block's attention projection and MLP output
    plan = build_plan(strategy)
    assert any(t.partial and not t.local for t in plan.transfers)
    run = runtime.run_strategy(strategy, module, F64)
    assert run.deviation is not None
    assert run.deviation["max_deviation"] < 1e-9, run.deviation
    assert all(math.isfinite(x) for x in run.losses)


def test_partial_sums_with_sample_splits_and_two_dimensional_tensor_parallelism() -> None:
    # reduce 2 x channel 2 on the MLP's output layer, sample splits elsewhere: partial sums
    # of channel blocks, each added by the consumer tasks that read them
    module = gpt2("sdpa")
    graph = _graph()
    configs = []
    for op in graph.ops:
        if op.kind == "linear" and contraction(op) is not None and "mlp.c_proj" in op.name:
            degrees = tuple(2 if d == CHANNEL else 1 for d in op.output.dims)
            cfg = ParallelConfig(degrees, (0, 1, 2, 3), 2)
        else:
            degrees = tuple(4 if d == SAMPLE else 1 for d in op.output.dims)
            cfg = ParallelConfig(degrees, tuple(range(math.prod(degrees))))
        configs.append(cfg)
    strategy = Strategy(graph, get_preset("cpu-local-4"), tuple(configs))
    assert sum(c.reduce > 1 for c in strategy.configs) >= 1
    run = runtime.run_strategy(strategy, module, F64)
    assert run.deviation is not None
    assert run.deviation["max_deviation"] < 1e-9, run.deviation
