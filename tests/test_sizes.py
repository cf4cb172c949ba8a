"""planner.problems.sizes: parsing sizes, estimates, shared tables, strategy memory."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from graphs import chain_cnn, input_op, linear, softmax

from planner.costs.costmodel import CostModel
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, model_parallel
from planner.problems.problem import build_problem
from planner.problems.sizes import (
    SizeError,
    check_devices_spec,
    check_strategy_memory,
    estimate,
    parse_bytes,
    strategy_memory,
)


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2G") == 2 * 2**30
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("1.5 KiB") == 1536
    # KB, MB, GB, TB are powers of 1000 (as GNU tools read them); letters in any case
    assert parse_bytes("16GB") == 16 * 10**9 and parse_bytes("16gb") == 16 * 10**9
    assert parse_bytes("16gib") == 16 * 2**30 and parse_bytes("2 TB") == 2 * 10**12
    assert parse_bytes("100B") == parse_bytes("100") == 100
    for bad in ("", "4 GB per device", "-1", "0", "GiB", "inf", "1e400", "0.5B", "1.2.3"):
        with pytest.raises(SizeError):
            parse_bytes(bad)
    with pytest.raises(SizeError, match="unknown size unit 'Gb/s' in '4Gb/s'"):
        parse_bytes("4Gb/s")


def test_a_preset_too_large_to_build_is_refused_by_its_name_in_every_family():
    for spec in ("p100-100000x8", "k80-100000x8", "dgx-a100-100000", "cpu-local-800000"):
        with pytest.raises(SizeError, match="800,000 devices"):
            check_devices_spec(spec)
    for spec in ("p100-16x4", "dgx-a100-128", "v100-dgx1-8", "cluster.json"):
        check_devices_spec(spec)  # small enough, or not a preset name: nothing to refuse


# -- the table budget -------------------------------------------------------------------------


def test_auto_takes_the_mesh_space_when_the_full_one_is_large(monkeypatch):
    from planner.problems import sizes

    g, dg = chain_cnn(sample=64), get_preset("p100-2x4")
    full = build_problem(g, dg)
    assert full.space_kind == "full"
    assert estimate(g, 8, "full", (2, 4), 2).configs_max == full.stats["configs_max"]
    need, seconds = full.stats["estimated_bytes"], full.stats["estimated_seconds"]
    monkeypatch.setattr(sizes, "AUTO_FULL_BYTES", need - 1)
    mesh = build_problem(g, dg)
    assert mesh.space_kind == "mesh"
    assert mesh.stats["configs_max"] < full.stats["configs_max"]
    monkeypatch.setattr(sizes, "AUTO_FULL_BYTES", need)
    monkeypatch.setattr(sizes, "AUTO_FULL_SECONDS", seconds / 2)
    assert build_problem(g, dg).space_kind == "mesh"
    # Without a hierarchy there is no mesh space: auto stays full.
    assert build_problem(g, get_preset("v100-dgx1-4")).space_kind == "full"


def test_stats_count_shared_tables():
    from graphs import shared_steps

    g = shared_steps(steps=5)
    problem = build_problem(g, get_preset("p100-2x4"), space="mesh", tie_groups=False)
    s = problem.stats
    assert s["node_tables"] == len(g.ops) and s["node_tables_distinct"] < s["node_tables"]
    assert s["edge_tables"] == len(g.edges) and s["edge_tables_distinct"] < s["edge_tables"]
    # step0 reads data; step4 feeds the loss, which keeps its own fp32 copy of step4's output
    # rather than step4's output (planner/costs/activations.py): its memory table differs
    steps = [problem.node_names.index(f"step{i}") for i in range(1, 4)]
    assert all(problem.node_cost[i] is problem.node_cost[steps[0]] for i in steps)
    assert all(problem.usage[i] is problem.usage[steps[0]] for i in steps)
    shared = [t for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True)
              if u in steps[:2] and v in steps[1:3]]  # fmt: skip
    assert len(shared) == 2 and shared[0] is shared[1]
    for table in (*problem.node_cost, *problem.edge_cost):
        assert not table.flags.writeable


# -- absurd inputs ----------------------------------------------------------------------------


def _small_memory(dg: DeviceGraph, memory: int) -> DeviceGraph:
    return DeviceGraph(
        dg.name, [replace(d, memory=memory) for d in dg.devices], dg.links, dg.switches
    )


def test_strategy_memory_against_capacity():
    x = input_op("data", sample=8, channel=1024)
    fc = linear("fc", x, 4096)
    g = OpGraph("wide", (x, fc, softmax("loss", fc)))
    params = g.ops[1].param_bytes
    dg = _small_memory(get_preset("p100-1x4"), int(params))  # 2 copies do not fit one device
    cm = CostModel(g, dg)
    dp, mp = data_parallel(g, dg), model_parallel(g, dg)
    fit = strategy_memory(cm, dp)
    assert not fit.fits and fit.peak.max() > params * 2
    np.testing.assert_allclose(fit.capacity, params)
    with pytest.raises(SizeError, match=r"memory_limit='device' \(--memory-limit device\)"):
        check_strategy_memory(cm, dp)
    assert check_strategy_memory(cm, mp).fits  # parameters sharded 4 ways
