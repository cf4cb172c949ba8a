"""NCCL's rails (`CostOptions.nic_rails`, `CostModel.ring_plan`): a gradient ring whose
replicas are several on each of several hosts runs one ring per member position, each
crossing hosts on its own NIC (docs/devices.md, "Rails")."""

from __future__ import annotations

import numpy as np
import pytest

from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.hardware.presets import get_preset
from planner.sim.simulator import Simulator

SAMPLES, WIDTH = 64, 4096


def one_linear() -> OpGraph:
    x = Op("x", "input", (), Tensor.of(2, sample=SAMPLES, channel=WIDTH))
    fc = Op(
        "fc",
        "linear",
        ("x",),
        Tensor.of(2, sample=SAMPLES, channel=WIDTH),
        (Param("fc.weight", (WIDTH, WIDTH), 2),),
        flops=2.0 * SAMPLES * WIDTH * WIDTH,
    )
    return OpGraph("fc", (x, fc))


def test_the_plan_sends_most_within_a_host_and_a_share_across() -> None:
    devices = get_preset("dgx-h100-2")
    group = [0, 4, 8, 12]  # two replicas on each node (TP 4)
    src, dst, part = CostModel(one_linear(), devices, CostOptions(nic_rails=True)).ring_plan(group)
    pairs = sorted(zip(src.tolist(), dst.tolist(), part.tolist(), strict=True))
    assert pairs == [
        (0, 4, 0.5), (0, 8, 0.5), (4, 0, 0.5), (4, 12, 0.5),
        (8, 0, 0.5), (8, 12, 0.5), (12, 4, 0.5), (12, 8, 0.5),
    ]  # fmt: skip
    one = CostModel(one_linear(), devices).ring_plan(group)
    assert one[1].tolist() == [4, 8, 12, 0] and one[2].tolist() == [1, 1, 1, 1]
    # one replica per host, or all on one host: one ring
    rails = CostModel(one_linear(), devices, CostOptions(nic_rails=True))
    assert rails.ring_plan([0, 8])[1].tolist() == [8, 0]
    assert rails.ring_plan([0, 1, 2])[2].tolist() == [1, 1, 1]


def test_rails_divide_the_host_crossing_time_by_the_replicas_per_host() -> None:
    """Data parallelism over 16 GPUs of two nodes: t_s over one NIC is 8x the NVLink-bound
    time across rails (the host-crossing share 1/8 on 50 GB/s against 7/8 on 450 GB/s)."""
    devices = get_preset("dgx-h100-2")
    g = one_linear()
    cfg = ParallelConfig((16, 1), tuple(range(16)))
    plain = CostModel(g, devices).sync_time(1, cfg)
    rails = CostModel(g, devices, CostOptions(nic_rails=True)).sync_time(1, cfg)
    shard = WIDTH * WIDTH * 2
    ring = 2 * 15 / 16 * shard
    latency = 2 * 15 * float(CostModel(g, devices).pair_costs(7, 8)[1])  # 30 steps, 14 us
    assert plain == pytest.approx(ring / 50e9 + latency, rel=0.01)
    assert rails == pytest.approx(ring * max(1 / 8 / 50e9, 7 / 8 / 450e9) + latency, rel=0.01)
    sims = [
        Simulator(CostModel(g, devices, CostOptions(nic_rails=f, dp_overlap=0.0)), (
            ParallelConfig((16, 1), tuple(range(16))), cfg
        )).makespan
        for f in (False, True)
    ]  # fmt: skip
    assert sims[1] < sims[0] and np.isfinite(sims).all()


def test_a_strategy_file_keeps_nic_rails() -> None:
    """A plan's cost section with `nic_rails` (a bool, as the plan writes it) reads back; a
    non-bool is refused by `CostOptions`, in one line."""
    from planner.cli.inputs import check_cost_section
    from planner.errors import LayerwiseError

    assert CostOptions(**check_cost_section({"nic_rails": True})).nic_rails
    with pytest.raises(LayerwiseError, match="nic_rails must be True or False"):
        CostOptions(**check_cost_section({"nic_rails": 1}))
