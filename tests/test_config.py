"""ParallelConfig, check_config and ConfigSpace enumeration (counts, divisibility, order, cap)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from graphs import GRAPHS, attention_block, conv2d, input_op
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.config import (
    ConfigSpace,
    ParallelConfig,
    check_config,
    device_ranges,
    device_sets,
    make_config,
    partitions,
)
from planner.errors import ConfigError, GraphError
from planner.graph.opgraph import Op, OpGraph, Tensor
from planner.hardware.presets import get_preset

PRESETS = ["p100-1x4", "p100-2x4", "p100-4x2", "cpu-local-2", "v100-dgx1-3"]

# Table 1 of OptCNN / FlexFlow as layerwise states it: the output dims each kind may split.
PARALLEL = {
    "input": {"sample", "height", "width", "length"},
    "conv2d": {"sample", "channel", "height", "width"},
    "pool2d": {"sample", "channel", "height", "width"},
    "linear": {"sample", "length", "channel"},
    "embedding": {"sample", "length", "channel"},
    "attention": {"sample", "length", "channel"},
    "norm": {"sample", "channel", "height", "width", "length"},
    "elementwise": {"sample", "channel", "height", "width", "length"},
    "concat": {"sample", "channel", "height", "width", "length"},
    "flatten": {"sample"},
    "softmax": {"sample", "length"},
}


def _expected_parallel(op: Op) -> set[str]:
    dims = PARALLEL[op.kind] & set(op.output.dims)
    if op.kind == "norm" and op.attr("norm") == "layer":
        dims.discard("channel")
    return dims


def _unit(op: Op, dim: str) -> int:
    if op.kind == "attention" and dim == "channel":
        return op.output.size("channel") // op.attr("heads")
    return 1


def _expected_sets(dg, k: int) -> list[tuple[int, ...]]:
    """Aligned blocks of k, then (multi-host, uniform hosts, k == #hosts) one device per host."""
    D = dg.num_devices
    sets = [tuple(range(o, o + k)) for o in range(0, D, k)]
    hosts: dict[str, list[int]] = {}
    for i, d in enumerate(dg.devices):
        hosts.setdefault(d.host, []).append(i)
    local = {len(v) for v in hosts.values()}
    if len(hosts) > 1 and len(local) == 1 and local.pop() > 1 and k == len(hosts):
        per_host = list(hosts.values())
        sets += [tuple(h[i] for h in per_host) for i in range(len(per_host[0]))]
    return sets


def _summed(op: Op) -> int | None:
    """The length a linear or ungrouped conv without folded ops sums over (its weight's
    second axis), which a contraction split cuts; None for other ops."""
    plain = not op.attr("fused") and op.attr("norm") is None and int(op.attr("groups", 1)) == 1
    if op.kind in ("linear", "conv2d") and op.params and plain:
        return op.params[0].shape[1]
    return None


def _expected_configs(op: Op, dg) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Brute force over all degree tuples in 1..D per dim (and a contraction degree, last in
    the task grid when above 1)."""
    D = dg.num_devices
    allowed = _expected_parallel(op)
    summed = _summed(op)
    out = set()
    ranges = [range(1, D + 1) if d in allowed else range(1, 2) for d in op.output.dims]
    ranges.append(range(1, D + 1) if summed is not None else range(1, 2))
    for *degs, r in itertools.product(*ranges):
        k = math.prod(degs) * r
        if D % k or (summed is not None and summed % r):
            continue
        if any(
            s % (g * _unit(op, d))
            for d, s, g in zip(op.output.dims, op.output.sizes, degs, strict=True)
        ):
            continue
        grid = (*degs, r) if r > 1 else tuple(degs)
        for devs in _expected_sets(dg, k):
            out.add((grid, devs))
    return out


def _conv_graph(n: int, c: int, h: int, w: int) -> OpGraph:
    x = input_op("x", sample=n, channel=3, height=h, width=w)
    return OpGraph("conv", (x, conv2d("conv", x, c, kernel=1, pad=0)))


# -- hand counts ------------------------------------------------------------------------------


def test_conv_count_on_4_devices_by_hand():
    # sample=8, channel=16, height=16, width=16 on 4 devices, one host:
    #   k=1: 1 degree tuple  x 4 offsets =  4
    #   k=2: 4 tuples        x 2 offsets =  8
    #   k=4: 4 (one dim 4) + 6 (two dims 2) = 10 tuples x 1 offset = 10
    g = _conv_graph(8, 16, 16, 16)
    space = ConfigSpace(g, get_preset("p100-1x4"))
    assert len(space[1]) == 4 + 8 + 10
    ks = [c.num_tasks for c in space[1].configs]
    assert ks.count(1) == 4 and ks.count(2) == 8 and ks.count(4) == 10


def test_conv_count_on_2_hosts_by_hand():
    # 8 devices on 2 hosts of 4: k=2 has 4 aligned blocks + 4 one-per-host sets.
    #   k=1: 1 x 8 = 8;  k=2: 4 x (4 + 4) = 32;  k=4: 10 x 2 = 20;
    #   k=8: 4 (one dim 8) + 12 (a 4 and a 2) + 4 (three 2s) = 20 x 1 = 20
    g = _conv_graph(8, 16, 16, 16)
    dg = get_preset("p100-2x4")
    space = ConfigSpace(g, dg)
    assert len(space[1]) == 8 + 32 + 20 + 20
    k2 = {c.devices for c in space[1].configs if c.num_tasks == 2}
    assert k2 == {(0, 1), (2, 3), (4, 5), (6, 7), (0, 4), (1, 5), (2, 6), (3, 7)}


def test_device_sets_strided():
    hosts = [0, 0, 0, 0, 1, 1, 1, 1]
    assert device_sets(8, 2, hosts).tolist() == [
        [0, 1], [2, 3], [4, 5], [6, 7], [0, 4], [1, 5], [2, 6], [3, 7]
    ]  # fmt: skip
    assert device_sets(8, 4, hosts).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert device_sets(8, 2, None).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    four_hosts = [0, 0, 1, 1, 2, 2, 3, 3]
    assert device_sets(8, 4, four_hosts).tolist() == [
        [0, 1, 2, 3], [4, 5, 6, 7], [0, 2, 4, 6], [1, 3, 5, 7]
    ]  # fmt: skip
    assert device_sets(4, 1).shape == (4, 1)


# -- enumeration matches an independent brute force -------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_enumeration_matches_brute_force(name, preset):
    g = GRAPHS[name]()
    dg = get_preset(preset)
    space = ConfigSpace(g, dg)
    for i, op in enumerate(g.ops):
        got = [(c.grid, c.devices) for c in space[i].configs]
        assert len(got) == len(set(got)), f"duplicate configs for {op.name}"
        assert set(got) == _expected_configs(op, dg), op.name


@settings(deadline=None, max_examples=60)
@given(
    n=st.integers(1, 12),
    c=st.integers(1, 12),
    h=st.integers(1, 12),
    w=st.integers(1, 12),
    preset=st.sampled_from(PRESETS),
)
def test_enumeration_property_random_conv(n, c, h, w, preset):
    g = _conv_graph(n, c, h, w)
    dg = get_preset(preset)
    D = dg.num_devices
    space = ConfigSpace(g, dg)
    op = g.ops[1]
    configs = space[1].configs
    for cfg in configs:
        for size, deg in zip(op.output.sizes, cfg.degrees, strict=True):
            assert size % deg == 0
        assert D % cfg.num_tasks == 0
        assert len(cfg.devices) == cfg.num_tasks == len(set(cfg.devices))
        assert all(0 <= d < D for d in cfg.devices)
        check_config(op, cfg, D)
    got = {(cfg.grid, cfg.devices) for cfg in configs}
    assert len(got) == len(configs)
    assert got == _expected_configs(op, dg)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_non_parallel_dims_never_split_and_parallel_ones_are(name, preset):
    g = GRAPHS[name]()
    dg = get_preset(preset)
    space = ConfigSpace(g, dg)
    D = dg.num_devices
    smallest = min(p for p in range(2, D + 1) if D % p == 0)
    for i, op in enumerate(g.ops):
        allowed = _expected_parallel(op)
        split = set()
        for cfg in space[i].configs:
            for d, deg in zip(op.output.dims, cfg.degrees, strict=True):
                if deg > 1:
                    split.add(d)
            assert split <= allowed, (op.name, cfg)
        # Every allowed dim that the smallest prime factor of D divides (in units) is split
        # by some config: the enumeration does not miss dims either.
        for d in allowed:
            if (op.output.size(d) // _unit(op, d)) % smallest == 0:
                assert d in split, (op.name, d)


def test_layer_norm_channel_never_split():
    g = GRAPHS["linear_head"]()
    space = ConfigSpace(g, get_preset("p100-1x4"))
    ln = g.index("ln")
    fc1 = g.index("fc1")
    c = g.ops[ln].output.dims.index("channel")
    assert all(cfg.degrees[c] == 1 for cfg in space[ln].configs)
    assert any(cfg.degrees[c] > 1 for cfg in space[fc1].configs)  # same shape, linear splits it


@pytest.mark.parametrize("heads, allowed", [(1, {1}), (2, {1, 2}), (4, {1, 2, 4})])
def test_attention_channel_split_by_whole_heads(heads, allowed):
    g = attention_block(heads=heads)
    space = ConfigSpace(g, get_preset("p100-1x4"))
    att = g.ops[g.index("attn")]
    c = att.output.dims.index("channel")
    degrees = {cfg.degrees[c] for cfg in space[g.index("attn")].configs}
    assert degrees == allowed
    # The projection after it (same shape, a linear) splits channel freely.
    proj = {cfg.degrees[c] for cfg in space[g.index("proj")].configs}
    assert proj == {1, 2, 4}


@pytest.mark.parametrize("channel, heads", [(15, 2), (9, 2), (4, 8)])
def test_attention_heads_not_dividing_channel_is_rejected_or_consistent(channel, heads):
    tokens = Op("t", "input", (), Tensor.of(sample=4, length=8))
    emb = Op("e", "embedding", ("t",), Tensor.of(sample=4, length=8, channel=channel))
    att = Op(
        "a",
        "attention",
        ("e", "e", "e"),
        Tensor.of(sample=4, length=8, channel=channel),
        attrs=Op.make_attrs({"heads": heads}),
    )
    try:
        g = OpGraph("bad_heads", (tokens, emb, att))
    except GraphError:
        return  # rejecting the graph is an acceptable fix
    space = ConfigSpace(g, get_preset("p100-1x4"))
    assert len(space[2]) > 0
    for cfg in space[2].configs:
        check_config(att, cfg, 4)


# -- order, determinism, cap ------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4"])
def test_enumeration_order(preset):
    g = GRAPHS["inception"]()
    dg = get_preset(preset)
    space = ConfigSpace(g, dg)
    for i, op in enumerate(g.ops):
        configs = space[i].configs
        keys = [(-c.num_tasks, sum(x > 1 for x in c.grid)) for c in configs]
        assert keys == sorted(keys), op.name
        # Configs of one partition are contiguous and their device sets follow _expected_sets.
        seen: list[tuple[int, ...]] = []
        for part, group in itertools.groupby(configs, key=lambda c: c.grid):
            assert part not in seen, (op.name, part)
            seen.append(part)
            assert [c.devices for c in group] == _expected_sets(dg, math.prod(part))
        assert seen == partitions(op, dg.num_devices)


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4", "cpu-local-2"])
def test_enumeration_is_deterministic(preset):
    dg = get_preset(preset)
    for name, build in GRAPHS.items():
        a = ConfigSpace(build(), dg)
        b = ConfigSpace(build(), get_preset(preset))
        assert [x.configs for x in a.ops] == [y.configs for y in b.ops], name
        assert a.sizes() == b.sizes()


def test_groups_are_consistent_with_configs():
    g = GRAPHS["chain_cnn"]()
    for preset in ("p100-1x4", "p100-2x4"):
        for cap in (None, 1, 7, 30):
            space = ConfigSpace(g, get_preset(preset), max_configs=cap)
            for op, opc in zip(g.ops, space.ops, strict=True):
                covered = []
                for part, sets, idx in opc.groups:
                    assert sets.shape == (len(idx), math.prod(part))
                    for row, j in zip(sets, idx, strict=True):
                        cfg = make_config(op, part, tuple(int(d) for d in row))
                        assert opc.configs[j] == cfg
                    covered += idx.tolist()
                assert covered == list(range(len(opc)))
                for j, cfg in enumerate(opc.configs):
                    assert opc.index(cfg) == j


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4"])
def test_max_configs_truncates_to_a_prefix(preset):
    g = GRAPHS["residual"]()
    dg = get_preset(preset)
    full = ConfigSpace(g, dg)
    longest = max(full.sizes())
    for cap in [1, 2, 3, 5, 8, 13, 21, longest, longest + 5]:
        space = ConfigSpace(g, dg, max_configs=cap)
        for i in range(len(g)):
            assert len(space[i]) == min(cap, len(full[i]))
            assert space[i].configs == full[i].configs[:cap]


@pytest.mark.parametrize("cap", [0, -3])
def test_max_configs_must_be_positive(cap):
    with pytest.raises(ConfigError, match="max_configs"):
        ConfigSpace(GRAPHS["chain_cnn"](), get_preset("p100-1x4"), max_configs=cap)


def test_index_of_a_config_outside_the_space():
    g = GRAPHS["chain_cnn"]()
    space = ConfigSpace(g, get_preset("p100-1x4"), max_configs=2)
    with pytest.raises(ConfigError, match="not in the config space"):
        space[1].index(ParallelConfig((1, 1, 1, 1), (3,)))


# -- check_config -----------------------------------------------------------------------------


def _conv_op() -> Op:
    return _conv_graph(8, 16, 16, 16).ops[1]


def test_device_ranges_are_short_at_any_scale_and_keep_the_task_order():
    assert device_ranges(range(1024)) == "0-1023"
    assert device_ranges([*range(8), *range(16, 24)]) == "0-7,16-23"
    assert device_ranges(range(0, 1024, 4)) == "0,4,...,1020"  # one device per node
    spread = [n * 4 + g for n in range(256) for g in range(2)]  # 2 of each node's 4
    assert device_ranges(spread) == "0-1,4-5,...,1020-1021"
    assert device_ranges([3, 2, 1, 0]) == "3,2,1,0"  # task order, not sorted
    assert device_ranges([0, 1, 5, 9, 13, 17]) == "0-1,5,9,13,17"  # runs of two lengths
    assert device_ranges([0, 2, 4, 6]) == "0,2,4,6" and device_ranges([5]) == "5"
    irregular = [*range(0, 20, 2), 25]  # not one spacing: every run is written
    assert device_ranges(irregular) == "0,2,4,6,8,10,12,14,16,18,25"


def test_check_config_accepts_valid():
    op = _conv_op()
    check_config(op, ParallelConfig((2, 2, 1, 1), (3, 0, 1, 2)), 4)
    check_config(op, ParallelConfig((1, 1, 1, 1), (3,)), 4)


@pytest.mark.parametrize(
    "degrees, devices, pattern",
    [
        ((1, 3, 1, 1), (0, 1, 2), "degree 3 does not divide dimension 'channel' of size 16"),
        ((2, 1, 1, 1), (0,), "2 tasks but 1 devices"),
        ((2, 2, 1, 1), (0, 1, 2), "4 tasks but 3 devices"),
        ((2, 1, 1, 1), (1, 1), "two tasks on one device"),
        ((2, 1, 1, 1), (0, 4), "device 4 out of range"),
        ((2, 1, 1, 1), (-1, 0), "device -1 out of range"),
        ((1, 1, 1), (0,), "3 degrees for dims"),
        ((0, 1, 1, 1), (), "degree 0 on 'sample'"),
    ],
)
def test_check_config_errors(degrees, devices, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        check_config(_conv_op(), ParallelConfig(degrees, devices), 4)
    assert "'conv'" in str(info.value)


@pytest.mark.parametrize(
    "graph, op_name, dim",
    [
        ("chain_cnn", "flat", "channel"),
        ("chain_cnn", "loss", "channel"),
        ("linear_head", "ln", "channel"),
        ("chain_cnn", "data", "channel"),
    ],
)
def test_check_config_rejects_non_parallel_dim(graph, op_name, dim):
    g = GRAPHS[graph]()
    op = g.op(op_name)
    degrees = tuple(2 if d == dim else 1 for d in op.output.dims)
    with pytest.raises(ConfigError, match=f"cannot be split along '{dim}'"):
        check_config(op, ParallelConfig(degrees, (0, 1)), 4)


def test_check_config_attention_heads():
    g = attention_block(heads=2)
    op = g.op("attn")
    check_config(op, ParallelConfig((1, 1, 2), (0, 1)), 4)
    with pytest.raises(ConfigError, match="in units of 8"):
        check_config(op, ParallelConfig((1, 1, 4), (0, 1, 2, 3)), 4)


# -- ParallelConfig ---------------------------------------------------------------------------


def test_parallel_config_helpers_and_json():
    op = _conv_op()
    cfg = ParallelConfig((2, 1, 2, 1), (0, 1, 2, 3))
    assert cfg.num_tasks == 4
    assert cfg.partition == (2, 1, 2, 1)
    assert cfg.degree(op, "height") == 2 and cfg.degree(op, "length") == 1
    assert cfg.describe(op) == "sample=2,height=2 @ [0-3]"
    assert ParallelConfig((1, 1, 1, 1), (2,)).describe(op) == "whole @ [2]"
    data = cfg.to_json(op)
    assert data == {"degrees": {"sample": 2, "height": 2}, "devices": [0, 1, 2, 3]}
    assert ParallelConfig.from_json(op, data, 4) == cfg


def test_parallel_config_from_json_errors():
    op = _conv_op()
    with pytest.raises(ConfigError, match="no dimension"):
        ParallelConfig.from_json(op, {"degrees": {"length": 2}, "devices": [0, 1]}, 4)
    with pytest.raises(ConfigError, match="out of range"):
        ParallelConfig.from_json(op, {"degrees": {"sample": 2}, "devices": [0, 9]}, 4)


def test_device_sets_array_shape():
    sets = device_sets(8, 8, [0] * 4 + [1] * 4)
    assert isinstance(sets, np.ndarray) and sets.shape == (1, 8)
