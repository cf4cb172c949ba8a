"""Communication overlap per kind (`planner.costs.overlap`): each setting changes the
communication it names and nothing else, and hidden communication never makes a step
longer than none at all. Also: a tensor moved once to the consumers that share it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from backends.pipeline.units import Unit, Units
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.overlap import FRAMEWORK_OVERLAP, exposed_seconds
from planner.errors import LayerwiseError
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.hardware.devices import Device, DeviceGraph, Link
from planner.pipeline.timeline import ChunkTimes, simulate_pipeline
from planner.sim.simulator import Simulator

WIDE = 4096


def two_gpus(bandwidth: float = 50e9, latency: float = 0.0) -> DeviceGraph:
    """Two bf16 GPUs (100 TFLOP/s) joined by one link."""
    gpus = [
        Device(f"gpu{i}", "gpu", 1e13, 2e12, 80 * 2**30, "node0", flops16=1e14) for i in range(2)
    ]
    return DeviceGraph("pair", gpus, [Link("gpu0", "gpu1", bandwidth, latency)], [])


def chain(rows: int = 2048) -> OpGraph:
    """x -> fc1 -> fc2 -> act: linears of WIDE x WIDE in bf16, then an elementwise op."""
    x = Op("x", "input", (), Tensor.of(2, sample=rows, channel=WIDE))
    ops = [x]
    for name, src in (("fc1", "x"), ("fc2", "fc1")):
        ops.append(
            Op(
                name,
                "linear",
                (src,),
                Tensor.of(2, sample=rows, channel=WIDE),
                (Param(f"{name}.weight", (WIDE, WIDE), 2),),
                flops=2.0 * rows * WIDE * WIDE,
            )
        )
    ops.append(Op("act", "elementwise", ("fc2",), Tensor.of(2, sample=rows, channel=WIDE)))
    return OpGraph("chain", tuple(ops))


# Megatron's pair: x split by samples, fc1 by output channels (it gathers x), fc2 by its
# contraction (row-parallel: its partial sums are reduce-scattered into act's samples).
# Every transfer is into or out of a linear, and no parameter is replicated: no sync.
SAMPLES = ParallelConfig((2, 1), (0, 1))
CHANNELS = ParallelConfig((1, 2), (0, 1))
ROWS = ParallelConfig((1, 1), (0, 1), reduce=2)
MIXED = (SAMPLES, CHANNELS, ROWS, SAMPLES)
DATA_PARALLEL = (SAMPLES,) * 4


def step(configs: tuple[ParallelConfig, ...], devices: DeviceGraph, **options: object) -> float:
    cm = CostModel(chain(), devices, CostOptions(**options))  # type: ignore[arg-type]
    return Simulator(cm, configs).makespan


def test_exposed_seconds_is_the_part_no_compute_covers() -> None:
    assert exposed_seconds(1.0, 5.0, 1.0) == 0.0
    assert exposed_seconds(1.0, 0.25, 1.0) == 0.75  # longer than its GEMM
    assert exposed_seconds(1.0, 5.0, 0.4) == pytest.approx(0.6)
    assert exposed_seconds(1.0, 0.0, 0.0) == 1.0


def test_tensor_parallel_overlap_hides_transfers_no_longer_than_their_gemms() -> None:
    slow, free = two_gpus(), two_gpus(bandwidth=1e18)
    none = step(MIXED, slow, tp_overlap=0.0)
    half = step(MIXED, slow, tp_overlap=0.5)
    full = step(MIXED, slow, tp_overlap=1.0)
    no_comm = step(MIXED, free, tp_overlap=0.0)
    assert none > half > full
    assert full == pytest.approx(no_comm, rel=1e-6)  # every transfer fits under a GEMM
    # with a link too slow for any GEMM to cover, overlap hides at most the GEMM's time
    crawl = two_gpus(bandwidth=1e8)
    assert step(MIXED, crawl, tp_overlap=1.0) > 0.9 * step(MIXED, crawl, tp_overlap=0.0)
    assert step(MIXED, crawl, tp_overlap=1.0) >= no_comm


def test_each_overlap_changes_only_its_own_kind_of_communication() -> None:
    pair = two_gpus()
    # data parallelism moves no activations: tensor-parallel overlap changes nothing
    assert step(DATA_PARALLEL, pair, tp_overlap=1.0) == step(DATA_PARALLEL, pair)
    # one device syncs nothing: the data-parallel settings change nothing
    alone = tuple(ParallelConfig((1, 1), (0,)) for _ in range(4))
    base = step(alone, pair)
    assert step(alone, pair, dp_overlap=0.0, param_gather_overlap=1.0, zero=1) == base
    # without ZeRO there is no parameter all-gather to hide
    assert step(DATA_PARALLEL, pair, param_gather_overlap=1.0) == step(DATA_PARALLEL, pair)
    # the pipeline setting has no effect outside a pipeline, the sync settings none
    # where nothing is replicated
    base = step(MIXED, pair)
    assert step(MIXED, pair, pp_overlap=0.0, dp_overlap=0.0, zero=1) == base


def test_gradient_sync_after_the_backward_pass_is_exposed() -> None:
    pair = two_gpus()
    overlapped = step(DATA_PARALLEL, pair, dp_overlap=1.0)
    after = step(DATA_PARALLEL, pair, dp_overlap=0.0)
    half = step(DATA_PARALLEL, pair, dp_overlap=0.5)
    assert after > half > overlapped
    cm = CostModel(chain(), pair, CostOptions(dp_overlap=0.0))
    timeline = Simulator(cm, DATA_PARALLEL).timeline()
    backward = max(t.end for t in timeline.tasks if t.name.startswith("bwd "))
    syncs = [t for t in timeline.tasks if "allreduce" in t.name]
    assert syncs and min(t.start for t in syncs) >= backward  # Megatron-LM's default


def test_hidden_parameter_gathers_shorten_a_zero_step() -> None:
    pair = two_gpus(bandwidth=5e9)
    exposed = step(DATA_PARALLEL, pair, zero=1)
    hidden = step(DATA_PARALLEL, pair, zero=1, param_gather_overlap=1.0)
    free = step(DATA_PARALLEL, two_gpus(bandwidth=1e18), zero=1)
    assert exposed > hidden >= free
    assert (
        CostModel(chain(), pair, CostOptions(zero=3, param_gather_overlap=0.5)).exposed_passes == 2
    )


def test_blocking_pipeline_sends_keep_their_sender_busy() -> None:
    chunks = [ChunkTimes(1.0, 2.0, send_forward=0.5), ChunkTimes(1.0, 2.0, send_backward=0.5)]
    overlapped = simulate_pipeline(chunks, "1f1b", 2, 4).makespan
    blocking = simulate_pipeline(chunks, "1f1b", 2, 4, p2p_overlap=0.0).makespan
    assert blocking > overlapped
    quiet = [dataclasses.replace(c, send_forward=0.0, send_backward=0.0) for c in chunks]
    assert simulate_pipeline(quiet, "1f1b", 2, 4, p2p_overlap=0.0).makespan == pytest.approx(
        simulate_pipeline(quiet, "1f1b", 2, 4).makespan
    )


def test_the_per_block_estimates_count_a_blocking_send() -> None:
    unit = Unit(1.0, 2.0, 0.1, 0.0, 0.0, 0.0)
    overlapped = Units(unit, unit, unit, 0.5)
    blocking = dataclasses.replace(overlapped, blocking=1.0)
    middle = blocking.chunk(1, 3, 2)
    assert middle.forward == overlapped.chunk(1, 3, 2).forward + 0.5
    assert middle.backward == overlapped.chunk(1, 3, 2).backward + 0.5
    assert blocking.chunk(2, 3, 2).forward == overlapped.chunk(2, 3, 2).forward  # the last


def twins(rows: int = 1024) -> OpGraph:
    """x -> norm -> (q, k) -> add: two linears read the norm's output."""
    t = Tensor.of(2, sample=rows, channel=WIDE)
    weight = (WIDE, WIDE)
    ops = (
        Op("x", "input", (), t),
        Op("norm", "elementwise", ("x",), t),
        Op("q", "linear", ("norm",), t, (Param("q.w", weight, 2),), flops=2.0 * rows * WIDE**2),
        Op("k", "linear", ("norm",), t, (Param("k.w", weight, 2),), flops=2.0 * rows * WIDE**2),
        Op("add", "elementwise", ("q", "k"), t),
    )
    return OpGraph("twins", ops)


def test_a_tensor_two_consumers_share_moves_once() -> None:
    graph, pair = twins(), two_gpus(bandwidth=5e9)
    configs = (SAMPLES, SAMPLES, CHANNELS, CHANNELS, SAMPLES)
    each = Simulator(CostModel(graph, pair, CostOptions()), configs)
    once = Simulator(CostModel(graph, pair, CostOptions(transfer_once=True)), configs)
    assert once.num_tasks < each.num_tasks
    assert once.makespan < each.makespan


@pytest.mark.parametrize(
    "options",
    [
        {"transfer_once": True},
        {"tp_overlap": 0.7, "dp_overlap": 0.3},
        {"transfer_once": True, "tp_overlap": 1.0, "dp_overlap": 0.0, "zero": 1},
    ],
)
def test_delta_simulation_equals_full_simulation_with_the_new_settings(
    options: dict[str, object],
) -> None:
    graph, pair = twins(), two_gpus(bandwidth=5e9, latency=2e-6)
    choices = [SAMPLES, CHANNELS, ParallelConfig((1, 1), (0,)), ParallelConfig((1, 1), (1,))]
    rng = random.Random(0)
    cm = CostModel(graph, pair, CostOptions(**options))  # type: ignore[arg-type]
    configs = [SAMPLES] * len(graph.ops)
    sim = Simulator(cm, configs)
    for _ in range(25):
        i = rng.randrange(1, len(graph.ops))
        cfg = rng.choice(choices)
        configs[i] = cfg
        delta = sim.change(i, cfg)
        assert delta == Simulator(cm, configs).makespan


def test_the_frameworks_settings_and_bad_fractions() -> None:
    default = CostOptions()
    pytorch = FRAMEWORK_OVERLAP["pytorch"].options()
    assert {k: getattr(default, k) for k in pytorch} == pytorch
    assert FRAMEWORK_OVERLAP["megatron"].dp_overlap == 0.0  # --overlap-grad-reduce is off
    for name in pytorch:
        with pytest.raises(LayerwiseError, match=f"{name} must be the fraction"):
            CostOptions(**{name: 1.5})  # type: ignore[arg-type]
    with pytest.raises(LayerwiseError, match="transfer_once must be True or False"):
        CostOptions(transfer_once=1)  # type: ignore[arg-type]
