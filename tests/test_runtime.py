"""The runtime: execution plans, numerical equivalence with single-process training, faults.

Runs start real worker processes (gloo on the CPU). Every test has a time budget (SIGALRM)
on top of the runtime's own hang detection, so nothing can hang the suite.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from budget import time_budget

from planner.costs.config import ParallelConfig
from planner.graph.opgraph import Op, OpGraph, Tensor
from planner.graph.opkinds import CHANNEL, HEIGHT, SAMPLE, WIDTH, parallel_dims
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, model_parallel, owt
from planner.problems.strategy import Strategy
from runtime.launch import RunOptions, RunResult, WorkerError, run_strategy
from runtime.plan import RuntimeConfigError, build_plan
from runtime.reference import ModelSpec
from runtime.strategies import random_strategy

LENET = ModelSpec("lenet5", 8, {})
RNNLM = ModelSpec("rnnlm", 4, {"steps": 3, "hidden": 8, "layers": 2, "vocab": 20})
TRANSFORMER = ModelSpec(
    "transformer", 4, {"seq": 8, "width": 16, "layers": 1, "heads": 2, "vocab": 20}
)
F64 = RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=30)
F64_TOL = 1e-9
F32_TOL = 1e-5


@pytest.fixture(autouse=True)
def budget(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that runs longer than its budget (120 s, slow tests 900 s)."""
    with time_budget(900 if request.node.get_closest_marker("slow") else 120):
        yield


def devices(n: int) -> DeviceGraph:
    return get_preset(f"cpu-local-{n}")


def check(
    strategy: Strategy, model: ModelSpec, options: RunOptions = F64, tol: float = F64_TOL
) -> RunResult:
    result = run_strategy(strategy, model, options)
    assert result.deviation is not None
    dev = result.deviation
    assert dev["max_deviation"] <= tol, (dev, strategy.describe())
    assert dev["replica_deviation"] == 0.0
    assert all(math.isfinite(x) for x in result.losses)
    return result


# -- strategies built by hand ----------------------------------------------------------------------


def split_where(
    graph: OpGraph, devs: DeviceGraph, rule: Callable[[Op], dict[str, int] | None]
) -> Strategy:
    """Each op split as `rule` says (dims -> degrees) on the first devices where the degree
    divides the dimension, else whole."""
    configs = []
    for op in graph.ops:
        degrees = rule(op) or {}
        degs = tuple(
            g if d in parallel_dims(op) and s % g == 0 else 1
            for d, s, g in zip(
                op.output.dims,
                op.output.sizes,
                (degrees.get(d, 1) for d in op.output.dims),
                strict=True,
            )
        )
        configs.append(ParallelConfig(degs, tuple(range(math.prod(degs)))))
    return Strategy(graph, devs, tuple(configs))


def spatial(op: Op) -> dict[str, int] | None:
    """Height splits for convs and pools (halos), channel splits for dense layers."""
    if op.kind in ("conv2d", "pool2d", "input"):
        return {HEIGHT: 2}
    if op.kind == "linear":
        return {CHANNEL: 2}
    return {SAMPLE: 2}


def spatial4(op: Op) -> dict[str, int] | None:
    """Height x width splits for convs and pools; sample x channel for dense layers."""
    if op.kind in ("conv2d", "pool2d"):
        return {HEIGHT: 2, WIDTH: 2}
    if op.kind == "linear":
        return {SAMPLE: 2, CHANNEL: 2}
    return {SAMPLE: 4}


def placed(graph: OpGraph, devs: DeviceGraph) -> Strategy:
    """Whole ops on different ranks (the operation dimension): layer k on rank k mod n."""
    n = devs.num_devices
    configs = [
        ParallelConfig((1,) * len(op.output.dims), (k % n,)) for k, op in enumerate(graph.ops)
    ]
    return Strategy(graph, devs, tuple(configs))


# -- the execution plan (no processes) -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_transfers_tile_every_needed_box(seed: int) -> None:
    """The pieces a consumer task receives are disjoint and cover exactly its input box (r
    times over from a producer that splits its contraction r ways: its partial sums)."""
    graph = LENET.graph()
    plan = build_plan(random_strategy(graph, devices(4), seed))
    for o in plan.ops:
        for t, tp in enumerate(o.plans):
            for pos, k in enumerate(e for e, edge in enumerate(graph.edges) if edge.dst == o.index):
                need = tp.in_boxes[pos]
                cover = np.zeros([b - a for a, b in need], dtype=int)
                src = plan.ops[graph.edges[k].src]
                for tr in plan.into.get((k, t), ()):
                    assert tr.partial == (src.cfg.reduce > 1)
                    cover[
                        tuple(
                            slice(a - lo, b - lo)
                            for (a, b), (lo, _) in zip(tr.box, need, strict=True)
                        )
                    ] += 1
                assert (cover == src.cfg.reduce).all(), (o.op.name, t, pos)


def test_sync_items_follow_replicas_and_shards() -> None:
    graph = LENET.graph()
    dp = build_plan(data_parallel(graph, devices(2)))
    assert {it.param for it in dp.sync} == {p.name for op in graph.ops for p in op.params}
    assert {it.ranks for it in dp.sync} == {(0, 1)}
    mp = build_plan(model_parallel(graph, devices(2)))
    assert mp.sync == ()  # every parameter split along channel: nothing to sum
    half = build_plan(split_where(graph, devices(4), spatial4))
    fc1 = [it for it in half.sync if it.param == "fc1.weight"]
    # sample=2 x channel=2: each channel half is held by two ranks
    assert [(it.lo, it.hi, it.ranks) for it in fc1] == [(0, 60, (0, 2)), (60, 120, (1, 3))]


def test_untied_shared_groups_sum_per_elementary_interval() -> None:
    graph = RNNLM.graph()
    devs = devices(2)
    configs = []
    for op in graph.ops:
        degs = [1] * len(op.output.dims)
        devices_ = (0,)
        if op.name == "cells.0@1":  # one step of the shared cell split by channel
            degs[op.output.dims.index(CHANNEL)] = 2
            devices_ = (0, 1)
        configs.append(ParallelConfig(tuple(degs), devices_))
    plan = build_plan(Strategy(graph, devs, tuple(configs)))
    items = [it for it in plan.sync if it.param == "cells.0.weight_ih"]
    assert [(it.lo, it.hi, it.ranks) for it in items] == [(0, 4, (0,)), (4, 8, (0, 1))]


def test_outputs_must_be_softmax() -> None:
    x = Op("x", "input", (), Tensor.of(sample=4, channel=3))
    fc = Op("fc", "linear", ("x",), Tensor.of(sample=4, channel=2), ())
    graph = OpGraph("g", (x, fc))
    strategy = Strategy(graph, devices(1), (ParallelConfig((1, 1), (0,)),) * 2)
    with pytest.raises(RuntimeConfigError, match="not a softmax"):
        build_plan(strategy)


def test_batch_norm_tasks_share_statistics_over_sample_splits() -> None:
    graph = ModelSpec("resnet101", 2, {"image_size": 64, "num_classes": 10}).graph()
    plan = build_plan(data_parallel(graph, devices(2)))
    bn = [o for o in plan.ops if o.batch_norm]
    assert bn and all(o.norm_groups == ((0, 1), (0, 1)) for o in bn)
    assert plan.groups["norm"] == ((0, 1),) and plan.groups["sync"] == ((0, 1),)


# -- numerical equivalence -------------------------------------------------------------------------


def test_world_1_equals_single_process_exactly() -> None:
    graph = LENET.graph()
    result = check(data_parallel(graph, devices(1)), LENET)
    assert result.deviation is not None and result.deviation["max_deviation"] == 0.0


@pytest.mark.parametrize(
    "world,make",
    # every baseline at world 2 and data parallelism at world 4 by default, the rest slow
    [
        pytest.param(
            w,
            m,
            id=f"{w}-{m.__name__}",
            marks=pytest.mark.slow if w == 4 and m is not data_parallel else (),
        )
        for w in (2, 4)
        for m in (data_parallel, model_parallel, owt, placed)
    ],
)
def test_lenet_baselines(make: Callable[..., Strategy], world: int) -> None:
    check(make(LENET.graph(), devices(world)), LENET)


@pytest.mark.parametrize("rule", [spatial, spatial4], ids=["height", "height_width"])
def test_lenet_spatial_splits_with_halos(rule: Callable[[Op], Any]) -> None:
    world = 2 if rule is spatial else 4
    check(split_where(LENET.graph(), devices(world), rule), LENET)


@pytest.mark.parametrize(
    "world,seed",
    # one draw per world by default, three per world under slow
    [
        (w, s) if s == 0 else pytest.param(w, s, marks=pytest.mark.slow)
        for w in (2, 4)
        for s in range(3)
    ],
)
def test_lenet_random_strategies(world: int, seed: int) -> None:
    check(random_strategy(LENET.graph(), devices(world), seed), LENET)


@pytest.mark.parametrize("world,seed", [(2, 4), (4, 5)])
def test_ordered_exchange(world: int, seed: int) -> None:
    """The globally ordered exchange (the NCCL mode) computes the same."""
    options = RunOptions(**{**vars(F64), "exchange": "ordered"})
    check(random_strategy(LENET.graph(), devices(world), seed), LENET, options)
    check(random_strategy(RNNLM.graph(), devices(world), seed), RNNLM, options)


def test_float32_within_rtol() -> None:
    options = RunOptions(steps=3, dtype="float32", lr=0.1, check=True, timeout=30)
    check(random_strategy(LENET.graph(), devices(2), 7), LENET, options, F32_TOL)


def test_backend_strategy() -> None:
    from backends import SolveOptions, get_backend
    from planner.problems.problem import build_problem

    graph = LENET.graph()
    for world in (2, 4):
        problem = build_problem(graph, devices(world))
        result = get_backend("elimination").solve(problem, SolveOptions(time_limit=10.0))
        assert result.strategy is not None
        check(result.strategy, LENET)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_rnnlm_shared_weights(tie: bool) -> None:
    check(random_strategy(RNNLM.graph(), devices(2), 3, tie_groups=tie), RNNLM)


def test_transformer_random() -> None:
    check(random_strategy(TRANSFORMER.graph(), devices(2), 1), TRANSFORMER)


def test_step_times_and_losses_are_reported() -> None:
    options = RunOptions(steps=4, warmup=1, timeout=30)
    result = run_strategy(owt(LENET.graph(), devices(2)), LENET, options)
    assert len(result.step_seconds) == 4 and len(result.losses) == 4
    assert result.median_step_seconds > 0 and result.deviation is None
    assert result.transfer_bytes > 0


# -- errors before spawning and faults -----------------------------------------------------------


def test_world_size_mismatch_is_refused() -> None:
    with pytest.raises(RuntimeConfigError, match="2 devices.*world size is 4"):
        run_strategy(data_parallel(LENET.graph(), devices(2)), LENET, world=4)


def test_model_mismatch_is_refused() -> None:
    other = ModelSpec("lenet5", 4, {})
    with pytest.raises(RuntimeConfigError, match="not the graph of model 'lenet5'"):
        run_strategy(data_parallel(LENET.graph(), devices(2)), other)


def test_check_needs_a_model() -> None:
    with pytest.raises(RuntimeConfigError, match="needs the model"):
        run_strategy(data_parallel(LENET.graph(), devices(2)), None, F64)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("raise", "rank 1: RuntimeError: injected fault on rank 1 at step 1"),
        ("exit", "rank 1: exited with code 3"),
        ("kill", r"rank 1: died \(killed by SIGKILL\)"),
        ("hang", "no progress for 3 s .*rank 1: computing"),
    ],
)
def test_faults_are_reported_by_rank_and_leave_no_process(kind: str, expected: str) -> None:
    options = RunOptions(steps=3, timeout=3, fault={"rank": 1, "step": 1, "kind": kind})
    with pytest.raises(WorkerError, match=expected) as info:
        run_strategy(data_parallel(LENET.graph(), devices(2)), LENET, options)
    assert 1 in info.value.failures
    assert len(info.value.pids) == 2 and all(_gone(pid) for pid in info.value.pids)


@pytest.mark.parametrize("seed", range(4))
def test_random_strategies_tie_shared_weights_as_the_problem_does(seed: int) -> None:
    """Ops of one parameter group with the same candidates get the same config."""
    from planner.costs.config import ConfigSpace
    from planner.problems.problem import tied_nodes

    graph, dg = RNNLM.graph(), devices(2)
    s = random_strategy(graph, dg, seed)
    nodes = tied_nodes(graph, ConfigSpace(graph, dg))
    assert any(len(ops) > 1 for ops in nodes)
    for ops in nodes:
        assert len({s.configs[i] for i in ops}) == 1
    assert len(s.configs) == len(graph.ops)


@pytest.mark.parametrize("world", [2, 4])
def test_zero_reduce_scatter_all_gather_trains_identically(world: int) -> None:
    """ZeRO 1-3 in the runtime: reduce-scatter, each rank's SGD step on its 1/r slice,
    all-gather (runtime.sync); SGD has no state, so it trains as single-process does."""
    for strategy in (data_parallel(LENET.graph(), devices(world)),
                     random_strategy(LENET.graph(), devices(world), 3)):  # fmt: skip
        check(strategy, LENET, RunOptions(**{**vars(F64), "zero": 1}))
    check(random_strategy(RNNLM.graph(), devices(world), 1), RNNLM,
          RunOptions(**{**vars(F64), "zero": 2}))  # fmt: skip


def test_zero_stage_is_checked() -> None:
    with pytest.raises(RuntimeConfigError, match="zero must be a ZeRO stage"):
        RunOptions(zero=4).validate()
