"""The mesh config space: device blocks, partitions, counts, baselines, and what plans record."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
from graphs import GRAPHS, chain_cnn, conv2d, input_op, shared_steps
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.config import (
    MESH_MAX_SPLIT_DIMS,
    ConfigSpace,
    check_config,
    count_partitions,
    partitions,
)
from planner.costs.mesh import block_devices, mesh_blocks, spread_counts
from planner.errors import ConfigError, LayerwiseError
from planner.graph.opgraph import OpGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import BASELINES, applicable
from planner.problems.problem import build_problem
from planner.problems.sizes import estimate
from planner.problems.strategy import strategy_from_json

HIERARCHICAL = ["p100-2x4", "p100-4x2", "k80-2x4", "k80-1x8", "cpu-local-3"]


@functools.cache
def _preset(name: str):
    return get_preset(name)


# -- blocks -----------------------------------------------------------------------------------


def test_mesh_blocks_by_hand():
    # 4 nodes x 4 GPUs: contiguous, spread over every node, translates inside node 0.
    assert mesh_blocks((4, 4), 16).tolist() == [list(range(16))]
    assert mesh_blocks((4, 4), 8).tolist() == [list(range(8)), [0, 1, 4, 5, 8, 9, 12, 13]]
    assert mesh_blocks((4, 4), 4).tolist() == [[0, 1, 2, 3], [0, 4, 8, 12]]
    assert mesh_blocks((4, 4), 2).tolist() == [[0, 1], [2, 3]]
    assert mesh_blocks((4, 4), 1).tolist() == [[0], [1], [2], [3]]
    # k80: node, PCIe pair, die. The spread block of 8 takes one die of each pair.
    assert mesh_blocks((4, 2, 2), 8).tolist() == [list(range(8)), list(range(0, 16, 2))]
    assert mesh_blocks((4, 2, 2), 4).tolist() == [[0, 1, 2, 3], [0, 4, 8, 12]]
    # One level (all devices alike): contiguous blocks only.
    assert mesh_blocks((4,), 2).tolist() == [[0, 1]]


def test_spread_counts():
    assert spread_counts((256, 4), 512) == (256, 2)
    assert spread_counts((256, 4), 256) == (256, 1)
    assert spread_counts((256, 4), 128) is None  # fewer tasks than nodes
    assert spread_counts((256, 4), 1024) is None  # the whole cluster is contiguous
    assert spread_counts((3, 4), 6) == (3, 2)
    assert block_devices((3, 4), (3, 2)).tolist() == [0, 1, 4, 5, 8, 9]


@pytest.mark.parametrize("sizes", [(4, 4), (4, 2, 2), (16, 4), (8, 8), (3, 4), (256, 4)])
def test_mesh_blocks_are_few_distinct_sets_of_k_devices(sizes):
    D = math.prod(sizes)
    for k in [k for k in range(1, D + 1) if D % k == 0]:
        blocks = mesh_blocks(sizes, k)
        assert blocks.shape[1] == k and len(blocks) <= 2 + math.prod(sizes[1:])
        assert len({tuple(b) for b in blocks}) == len(blocks)
        for b in blocks:
            assert len(set(b.tolist())) == k and b.min() >= 0 and b.max() < D
            assert (np.diff(b) > 0).all()  # tasks map to devices in increasing order
        assert blocks[0].tolist() == list(range(k))


# -- partitions and counts --------------------------------------------------------------------


@st.composite
def _conv(draw):
    n = draw(st.sampled_from([1, 2, 4, 6, 8, 12, 16, 32]))
    c = draw(st.sampled_from([1, 3, 4, 8, 10, 16, 64]))
    h = draw(st.sampled_from([1, 2, 4, 7, 8, 14]))
    x = input_op("x", sample=n, channel=3, height=h, width=h)
    return OpGraph("conv", (x, conv2d("conv", x, c, kernel=1, pad=0))).ops[1]


@settings(deadline=None, max_examples=60)
@given(
    op=_conv(),
    devices=st.sampled_from([1, 4, 6, 12, 16, 64, 96]),
    cap=st.sampled_from([None, 1, 2, 3]),
)
def test_count_partitions_counts_the_listed_partitions(op, devices, cap):
    listed = partitions(op, devices, cap)
    counted = count_partitions(op, devices, cap)
    by_k: dict[int, int] = {}
    for p in listed:
        by_k[math.prod(p)] = by_k.get(math.prod(p), 0) + 1
        assert cap is None or sum(g > 1 for g in p) <= cap
    assert counted == by_k


@pytest.mark.parametrize("preset", HIERARCHICAL)
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_mesh_space_configs_are_valid_and_structured(name, preset):
    g, dg = GRAPHS[name](), _preset(preset)
    space = ConfigSpace(g, dg, kind="mesh")
    full = ConfigSpace(g, dg)
    sizes = dg.hierarchy().sizes
    for i, op in enumerate(g.ops):
        configs = space[i].configs
        assert len(set(configs)) == len(configs)
        for cfg in configs:
            check_config(op, cfg, dg.num_devices)
            assert sum(d > 1 for d in cfg.degrees) <= MESH_MAX_SPLIT_DIMS
            blocks = {tuple(b) for b in mesh_blocks(sizes, cfg.num_tasks)}
            assert cfg.devices in blocks
        # The same partitions as the full space (up to the split-dims cap), never more.
        assert {c.degrees for c in configs} == {
            c.degrees for c in full[i].configs if sum(d > 1 for d in c.degrees) <= 2
        }
        ks = [c.num_tasks for c in configs]
        assert ks == sorted(ks, reverse=True)


def test_mesh_space_shares_config_lists_between_identical_ops():
    g = shared_steps(steps=4)
    space = ConfigSpace(g, _preset("p100-2x4"), kind="mesh")
    steps = [space[g.index(f"step{s}")] for s in range(4)]
    assert all(s is steps[0] for s in steps[1:])


def test_mesh_space_needs_a_hierarchy():
    g = chain_cnn()
    with pytest.raises(ConfigError, match="homogeneous"):
        ConfigSpace(g, _preset("v100-dgx1-8"), kind="mesh")
    with pytest.raises(LayerwiseError, match="space='full'"):
        build_problem(g, _preset("v100-dgx1-8"), space="mesh")
    with pytest.raises(ConfigError, match="kind"):
        ConfigSpace(g, _preset("p100-2x4"), kind="grid")
    with pytest.raises(LayerwiseError, match="space must be one of"):
        build_problem(g, _preset("p100-2x4"), space="grid")


@pytest.mark.parametrize("preset", ["p100-2x4", "k80-2x4", "p100-1x4"])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_estimate_counts_the_space_exactly(name, preset):
    g, dg = GRAPHS[name](), _preset(preset)
    sizes = dg.hierarchy().sizes
    hosts = len({d.host for d in dg.devices})
    for kind, cap in (("full", None), ("full", 3), ("mesh", None), ("mesh", 5)):
        space = ConfigSpace(g, dg, max_configs=cap, kind=kind)
        est = estimate(g, dg.num_devices, kind, sizes, hosts, max_configs=cap)
        assert est.configs_total == sum(space.sizes())
        assert est.configs_max == max(space.sizes())
        assert est.edge_entries_all == sum(len(space[e.src]) * len(space[e.dst]) for e in g.edges)


# -- baselines and plan files -----------------------------------------------------------------


@pytest.mark.parametrize("preset", ["p100-2x4", "k80-2x4", "p100-4x2"])
@pytest.mark.parametrize("name", ["chain_cnn", "inception", "shared_steps", "attention_block"])
def test_every_baseline_is_in_the_mesh_space(name, preset):
    g, dg = GRAPHS[name](), _preset(preset)
    problem = build_problem(g, dg, space="mesh")
    assert problem.space_kind == "mesh"
    for baseline in applicable(g):
        strategy = BASELINES[baseline](g, dg)
        choices = problem.choices_of(strategy)  # raises if a config is missing
        assert problem.strategy(choices).configs == strategy.configs


def test_the_rnn_expert_is_in_the_mesh_space():
    from planner.graph.zoo import model_graph

    g = model_graph("rnnlm", batch=8, steps=2, hidden=64, vocab=100)
    dg = _preset("k80-2x4")
    problem = build_problem(g, dg, space="mesh")
    expert = BASELINES["expert"](g, dg)
    strided = {c.devices for c in expert.configs if c.num_tasks > 1 and c.devices[0] != 0}
    assert strided  # layers on other local devices than 0, one per host
    assert problem.strategy(problem.choices_of(expert)).configs == expert.configs


def test_plan_files_record_the_space():
    g, dg = chain_cnn(), _preset("p100-2x4")
    for kind in ("full", "mesh"):
        problem = build_problem(g, dg, space=kind)
        strategy = problem.strategy([0] * problem.num_nodes)
        data = strategy.to_json()
        assert data["space"]["kind"] == kind
        assert data["space"]["hierarchy"] == ([2, 4] if kind == "mesh" else None)
        assert strategy_from_json(data).space == data["space"]
    # auto resolves to a kind, and says which.
    assert build_problem(g, dg).space_kind == "full"
