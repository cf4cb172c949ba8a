"""Regions (task boxes, needed boxes) and the cost model: t_x, t_c, t_s, memory."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from graphs import (
    GRAPHS,
    INCEPTION_BRANCHES,
    chain_cnn,
    conv2d,
    elementwise,
    input_op,
    linear,
    shared_steps,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.config import ConfigSpace, ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.regions import needed_boxes, overlap_volume, task_boxes, task_index
from planner.errors import LayerwiseError
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import DimMap, stats_groups
from planner.graph.zoo import model_graph
from planner.hardware.devices import Device, DeviceGraph, Link
from planner.hardware.presets import get_preset
from planner.sim.simulator import Simulator

# -- shared, cached fixtures ------------------------------------------------------------------


@functools.cache
def _graph(name: str) -> OpGraph:
    return GRAPHS[name]()


@functools.cache
def _model(name: str, preset: str, cap: int | None = None) -> tuple[CostModel, ConfigSpace]:
    g = _graph(name)
    dg = get_preset(preset)
    return CostModel(g, dg), ConfigSpace(g, dg, max_configs=cap)


@functools.cache
def _edge_table(name: str, preset: str, cap: int | None, k: int) -> np.ndarray:
    cm, space = _model(name, preset, cap)
    e = cm.graph.edges[k]
    return cm.edge_table(e, space[e.src], space[e.dst])


def _edge(g: OpGraph, src: str, dst: str, position: int = 0):
    (e,) = [
        e
        for e in g.edges
        if g.ops[e.src].name == src and g.ops[e.dst].name == dst and e.position == position
    ]
    return e


def _flat_device_graph(n: int, bandwidth: float, latency: float) -> DeviceGraph:
    """n identical devices on one switch: every pair is 2 hops."""
    devices = [Device(f"d{i}", "gpu", 1e13, 5e11, 2**34, "h") for i in range(n)]
    links = [Link(f"d{i}", "sw", bandwidth, latency) for i in range(n)]
    return DeviceGraph("flat", devices, links, ["sw"])


# -- regions ----------------------------------------------------------------------------------


@st.composite
def _partitioned_shape(draw):
    n = draw(st.integers(1, 4))
    degrees = tuple(draw(st.sampled_from([1, 2, 3, 4])) for _ in range(n))
    sizes = tuple(g * draw(st.integers(1, 5)) for g in degrees)
    return sizes, degrees


@settings(deadline=None, max_examples=80)
@given(shapes=st.lists(_partitioned_shape(), min_size=1, max_size=3), extra=st.integers(0, 3))
def test_task_boxes_tile_the_tensor(shapes, extra):
    # Several partitions of the same sizes at once (as the cost model batches them).
    sizes = shapes[0][0]
    n = len(sizes)
    parts = [shapes[0][1]]
    for _, d in shapes[1:]:
        if len(d) == n:
            parts.append(tuple(g if size % g == 0 else 1 for g, size in zip(d, sizes, strict=True)))
    parts_arr = np.array(parts, dtype=np.int64)
    slots = int(parts_arr.prod(axis=1).max()) + extra
    lo, hi = task_boxes(sizes, parts_arr, slots)
    assert lo.shape == hi.shape == (len(parts), slots, n)
    numel = math.prod(sizes)
    vol = overlap_volume(lo, hi, lo, hi)  # (P, T, P, T)
    for p, part in enumerate(parts):
        k = math.prod(part)
        # Padded slots are empty boxes.
        assert (hi[p, k:] == lo[p, k:]).all()
        assert (lo[p, :k] >= 0).all() and (hi[p, :k] <= np.array(sizes)).all()
        self_vol = vol[p, :k, p, :k]
        # Disjoint: off-diagonal overlaps are zero; volumes sum to numel; all equal.
        assert (self_vol[~np.eye(k, dtype=bool)] == 0).all()
        assert np.diag(self_vol).sum() == numel
        assert np.all(np.diag(self_vol) == numel // k)
        # Row-major task order, as np.unravel_index.
        for t in range(k):
            idx = np.unravel_index(t, part)
            step = [s // g for s, g in zip(sizes, part, strict=True)]
            assert lo[p, t].tolist() == [int(i) * st_ for i, st_ in zip(idx, step, strict=True)]


def test_task_index_row_major():
    idx = task_index(np.array([[2, 3], [1, 1]]), 7)
    assert idx[0].tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2], [-1, -1]]
    assert idx[1].tolist() == [[0, 0]] + [[-1, -1]] * 6


@settings(deadline=None, max_examples=60)
@given(shape=_partitioned_shape(), extra=st.integers(0, 2))
def test_needed_boxes_same_maps_equal_output_boxes(shape, extra):
    sizes, part = shape
    dims = tuple(f"d{i}" for i in range(len(sizes)))
    parts = np.array([part], dtype=np.int64)
    slots = math.prod(part) + extra
    olo, ohi = task_boxes(sizes, parts, slots)
    maps = tuple(DimMap("same", d) for d in dims)
    nlo, nhi = needed_boxes(maps, sizes, dims, olo, ohi)
    assert (nlo == olo).all() and (nhi == ohi).all()
    # "full" on every dim: every real task needs the whole tensor, padding stays empty.
    flo, fhi = needed_boxes(tuple(DimMap("full") for _ in dims), sizes, dims, olo, ohi)
    k = math.prod(part)
    assert (flo[0, :k] == 0).all() and (fhi[0, :k] == np.array(sizes)).all()
    assert (fhi[0, k:] == 0).all()


def test_needed_boxes_conv_window_by_hand():
    # 3x3, stride 1, pad 1 over height 16 split in 2: rows [0, 9) and [7, 16).
    m = DimMap("window", "height", kernel=3, stride=1, pad=1)
    olo, ohi = task_boxes((16,), np.array([[2]]), 2)
    lo, hi = needed_boxes((m,), (16,), ("height",), olo, ohi)
    assert list(zip(lo[0, :, 0].tolist(), hi[0, :, 0].tolist(), strict=True)) == [(0, 9), (7, 16)]
    # 3x3, stride 2, pad 1: output 8 rows split in 2 -> input rows [0, 8) and [7, 16).
    m2 = DimMap("window", "height", kernel=3, stride=2, pad=1)
    olo, ohi = task_boxes((8,), np.array([[2]]), 2)
    lo, hi = needed_boxes((m2,), (16,), ("height",), olo, ohi)
    assert list(zip(lo[0, :, 0].tolist(), hi[0, :, 0].tolist(), strict=True)) == [(0, 8), (7, 16)]
    # Dilation 2, kernel 3 (extent 5), pad 2, 4 tasks of 4 rows.
    m3 = DimMap("window", "height", kernel=3, stride=1, pad=2, dilation=2)
    olo, ohi = task_boxes((16,), np.array([[4]]), 4)
    lo, hi = needed_boxes((m3,), (16,), ("height",), olo, ohi)
    assert list(zip(lo[0, :, 0].tolist(), hi[0, :, 0].tolist(), strict=True)) == [
        (0, 6), (2, 10), (6, 14), (10, 16)
    ]  # fmt: skip


def test_needed_boxes_concat_offsets():
    g = _graph("inception")
    cat = g.op("concat")
    parts = np.array([[1, 4, 1, 1]])  # channel split in 4: 12 channels per task
    olo, ohi = task_boxes(cat.output.sizes, parts, 4)
    c = cat.output.dims.index("channel")
    ranges = {}
    for e in g.edges:
        if g.ops[e.dst].name != "concat":
            continue
        src = g.ops[e.src].output
        lo, hi = needed_boxes(g.input_maps(e), src.sizes, cat.output.dims, olo, ohi)
        ranges[g.ops[e.src].name] = [
            (int(a), int(b)) if b > a else None
            for a, b in zip(lo[0, :, c], hi[0, :, c], strict=True)
        ]
    # Output channels: b1 [0, 8), b3 [8, 24), b5 [24, 32), bpool [32, 48); tasks of 12.
    assert ranges["b1"] == [(0, 8), None, None, None]
    assert ranges["b3"] == [(0, 4), (4, 16), None, None]
    assert ranges["b5"] == [None, None, (0, 8), None]
    assert ranges["bpool"] == [None, None, (0, 4), (4, 16)]
    assert INCEPTION_BRANCHES == {"b1": 8, "b3": 16, "b5": 8, "bpool": 16}


@settings(deadline=None, max_examples=40)
@given(
    boxes=st.lists(
        st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)),
        min_size=2,
        max_size=5,
    )
)
def test_overlap_volume_brute_force(boxes):
    # 2-D boxes [a, a + w) x [b, b + h) compared with a cell count.
    lo = np.array([[[a, b] for a, b, _, _ in boxes]])
    hi = np.array([[[a + w, b + h] for a, b, w, h in boxes]])
    vol = overlap_volume(lo, hi, lo, hi)
    cells = [{(x, y) for x in range(a, a + w) for y in range(b, b + h)} for a, b, w, h in boxes]
    for i, j in itertools.product(range(len(boxes)), repeat=2):
        assert vol[0, i, 0, j] == len(cells[i] & cells[j])


# -- t_x --------------------------------------------------------------------------------------


SAME_EDGES = [
    ("chain_cnn", "conv1", "bn1", 0),
    ("chain_cnn", "bn1", "relu1", 0),
    ("residual", "conv2", "add", 0),
    ("residual", "relu1", "add", 1),
    ("residual", "add", "relu2", 0),
    ("linear_head", "fc1", "ln", 0),
]


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4"])
@pytest.mark.parametrize("name, src, dst, pos", SAME_EDGES)
def test_tx_zero_when_configs_coincide(name, src, dst, pos, preset):
    cm, space = _model(name, preset)
    g = cm.graph
    e = _edge(g, src, dst, pos)
    table = cm.edge_table(e, space[e.src], space[e.dst])
    cu, cv = space[e.src], space[e.dst]
    matched = 0
    for j, cfg in enumerate(cv.configs):
        if cfg not in cu.configs:
            continue
        i = cu.index(cfg)
        matched += 1
        assert table[i, j] == 0.0
        assert cm.transfer_time(e, cfg, cfg) == 0.0
    assert matched >= len(cv) // 2
    # Same partition on disjoint devices moves the whole tensor: positive.
    whole = g.ops[e.dst].output.dims
    one = ParallelConfig(tuple(1 for _ in whole), (0,))
    other = ParallelConfig(tuple(1 for _ in whole), (1,))
    assert cm.transfer_time(e, one, other) > 0
    assert table[cu.index(one), cv.index(other)] > 0


HALO_CASES = [
    # (kernel, stride, pad, rows device 0 receives, rows device 1 receives), worked by hand for
    # an input of 16 rows split [0, 8) | [8, 16) and the conv output split in 2 the same way.
    (3, 1, 1, 1, 1),
    (5, 1, 2, 2, 2),
    (3, 2, 1, 0, 1),
    (1, 1, 0, 0, 0),
]


def _halo_graph(kernel: int, stride: int, pad: int) -> OpGraph:
    x = input_op("x", sample=2, channel=4, height=16, width=8)
    r = elementwise("relu", x)
    c = conv2d("conv", r, 4, kernel=kernel, stride=stride, pad=pad)
    return OpGraph("halo", (x, r, c))


@pytest.mark.parametrize(
    "preset, devs", [("p100-1x4", (0, 1)), ("p100-2x4", (3, 4)), ("cpu-local-2", (0, 1))]
)
@pytest.mark.parametrize("kernel, stride, pad, rows0, rows1", HALO_CASES)
def test_conv_halo_by_hand(kernel, stride, pad, rows0, rows1, preset, devs):
    g = _halo_graph(kernel, stride, pad)
    dg = get_preset(preset)
    cm = CostModel(g, dg)
    e = _edge(g, "relu", "conv")
    d0, d1 = devs
    prod_cfg = ParallelConfig((1, 1, 2, 1), devs)  # relu split in height
    cons_cfg = ParallelConfig((1, 1, 2, 1), devs)  # conv split in height
    row = 2 * 4 * 8 * 4  # sample * channel * width * 4 bytes
    w = dg.inv_bandwidth
    # Per message: the route latency and both endpoints' processor overheads (cpu-local).
    ovh = [d.message_overhead for d in dg.devices]
    lat = dg.latency + np.add.outer(ovh, ovh)

    def t(rows, a, b):  # rows sent from device a to device b
        return rows * row * w[a, b] + lat[a, b] if rows else 0.0

    forward = max(t(rows0, d1, d0), t(rows1, d0, d1))
    backward = max(t(rows1, d1, d0), t(rows0, d0, d1))  # gradients of what each one received
    expected = forward + backward
    assert cm.transfer_time(e, prod_cfg, cons_cfg) == pytest.approx(expected, rel=1e-12)
    if rows0 == rows1 == 1:  # the plain 3x3 case in words: one row each way, both directions
        assert expected == pytest.approx(2 * (row * w[d0, d1] + lat[d0, d1]), rel=1e-12)
    if devs == (0, 1):
        space = ConfigSpace(g, dg)
        table = cm.edge_table(e, space[1], space[2])
        assert table[space[1].index(prod_cfg), space[2].index(cons_cfg)] == pytest.approx(
            expected, rel=1e-12
        )


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("producer_dim", ["channel", "sample"])
def test_channel_split_linear_needs_the_full_input(k, producer_dim):
    g = _graph("linear_head")
    dg = get_preset("p100-1x4")
    cm = CostModel(g, dg)
    e = _edge(g, "relu", "fc2")
    src = g.op("relu").output  # (sample=8, channel=64)
    devs = tuple(range(k))
    prod = ParallelConfig((k, 1) if producer_dim == "sample" else (1, k), devs)
    cons = ParallelConfig((1, k), devs)  # fc2 split by output channel
    # Each consumer task reads the whole input and holds 1/k of it locally.
    parts_u = np.array([prod.degrees])
    plo, phi = task_boxes(src.sizes, parts_u, k)
    olo, ohi = task_boxes(g.op("fc2").output.sizes, np.array([cons.degrees]), k)
    nlo, nhi = needed_boxes(g.input_maps(e), src.sizes, g.op("fc2").output.dims, olo, ohi)
    vol = overlap_volume(plo, phi, nlo, nhi)[0, :, 0, :]  # (producer task, consumer task)
    for q in range(k):
        received = sum(vol[p, q] for p in range(k) if devs[p] != devs[q]) * src.dtype_bytes
        assert received == src.nbytes * (k - 1) / k
    # The time: each receiver gets k-1 messages of nbytes/k, forward and backward.
    w, lat = dg.inv_bandwidth, dg.latency
    chunk = src.nbytes / k
    fwd = max(sum(chunk * w[p, q] + lat[p, q] for p in devs if p != q) for q in devs)
    bwd = max(sum(chunk * w[q, p] + lat[q, p] for q in devs if q != p) for p in devs)
    assert cm.transfer_time(e, prod, cons) == pytest.approx(fwd + bwd, rel=1e-12)
    space = ConfigSpace(g, dg)
    table = cm.edge_table(e, space[e.src], space[e.dst])
    assert table[space[e.src].index(prod), space[e.dst].index(cons)] == pytest.approx(
        fwd + bwd, rel=1e-12
    )


def test_concat_routes_each_branch_to_its_channels():
    g = _graph("inception")
    dg = get_preset("p100-1x4")
    cm = CostModel(g, dg)
    w, lat = dg.inv_bandwidth, dg.latency
    cat_cfg = ParallelConfig((1, 4, 1, 1), (0, 1, 2, 3))  # channels 12 per device
    whole = (1, 1, 1, 1)

    def tx(branch, dev, cat=cat_cfg):
        return cm.transfer_time(
            _edge(g, branch, "concat", list(g.op("concat").inputs).index(branch)),
            ParallelConfig(whole, (dev,)),
            cat,
        )

    nb = {b: g.op(b).output.nbytes for b in INCEPTION_BRANCHES}
    # b1 lands entirely on task 0 (device 0), b5 on task 2 (device 2): local producer, no cost.
    assert tx("b1", 0) == 0.0
    assert tx("b5", 2) == 0.0
    # From elsewhere: one message to that device only, and its gradient back.
    for dev in (1, 2, 3):
        assert tx("b1", dev) == pytest.approx(
            nb["b1"] * (w[dev, 0] + w[0, dev]) + lat[dev, 0] + lat[0, dev], rel=1e-12
        )
    # With the concat tasks permuted, task 2 (b5's channels) sits on device 1.
    permuted = ParallelConfig((1, 4, 1, 1), (2, 0, 1, 3))
    assert tx("b5", 1, permuted) == 0.0
    assert tx("b5", 2, permuted) > 0.0
    assert tx("b1", 2, permuted) == 0.0  # task 0 is now on device 2
    # b3 straddles tasks 0 and 1 (4 and 12 of its 16 channels). On device 1 it sends only the
    # 4 channels of task 0 to device 0; on device 0 the 12 channels of task 1 to device 1.
    assert tx("b3", 1) == pytest.approx(2 * (nb["b3"] / 4 * w[1, 0] + lat[1, 0]), rel=1e-12)
    assert tx("b3", 0) == pytest.approx(2 * (nb["b3"] * 3 / 4 * w[0, 1] + lat[0, 1]), rel=1e-12)
    # On device 2 (holding none of its channels) both pieces go out, to different receivers.
    fwd = max(nb["b3"] / 4 * w[2, 0] + lat[2, 0], nb["b3"] * 3 / 4 * w[2, 1] + lat[2, 1])
    bwd = nb["b3"] / 4 * w[0, 2] + lat[0, 2] + nb["b3"] * 3 / 4 * w[1, 2] + lat[1, 2]
    assert tx("b3", 2) == pytest.approx(fwd + bwd, rel=1e-12)


EDGE_CASES = [(name, preset) for name in sorted(GRAPHS) for preset in ("p100-1x4", "p100-2x4")]


@settings(deadline=None, max_examples=150)
@given(
    case=st.sampled_from(EDGE_CASES),
    cap=st.sampled_from([None, None, 1, 5, 13]),
    data=st.data(),
)
def test_edge_table_equals_transfer_time(case, cap, data):
    name, preset = case
    cm, space = _model(name, preset, cap)
    g = cm.graph
    k = data.draw(st.integers(0, len(g.edges) - 1), label="edge")
    e = g.edges[k]
    table = _edge_table(name, preset, cap, k)
    assert table.shape == (len(space[e.src]), len(space[e.dst]))
    for _ in range(5):
        i = data.draw(st.integers(0, table.shape[0] - 1), label="producer config")
        j = data.draw(st.integers(0, table.shape[1] - 1), label="consumer config")
        direct = cm.transfer_time(e, space[e.src].configs[i], space[e.dst].configs[j])
        assert table[i, j] == pytest.approx(direct, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("preset, stride", [("p100-1x4", 1), ("p100-2x4", 7)])
def test_edge_table_on_concat_edges_grid(preset, stride):
    # Every pair on 4 devices; every 7th producer x consumer config on 8.
    name = "inception"
    cm, space = _model(name, preset, None)
    g = cm.graph
    for k, e in enumerate(g.edges):
        if g.ops[e.dst].name != "concat":
            continue
        table = _edge_table(name, preset, None, k)
        us, vs = space[e.src].configs[::stride], space[e.dst].configs[::stride]
        direct = np.array([[cm.transfer_time(e, a, b) for b in vs] for a in us])
        np.testing.assert_allclose(table[::stride, ::stride], direct, rtol=1e-9, atol=1e-15)
        assert (table >= 0).all() and (table > 0).any()


# -- t_c --------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["p100-1x4", "cpu-local-2"])
def test_batch_norm_exchange_by_hand(preset):
    """A batch norm split in samples (or height) sums 2 x channels float64 statistics with
    the tasks that hold the same channels: one message each way between two devices; a
    channel split needs none, and neither does an op without batch norm."""
    g = chain_cnn()
    dg = get_preset(preset)
    cm = CostModel(g, dg)
    bn, relu = g.index("bn1"), g.index("relu1")
    ovh = [d.message_overhead for d in dg.devices]
    cases = [(2, 1, 1, 1), (1, 1, 2, 1), (2, 2, 1, 1)]
    for degrees in [d for d in cases if math.prod(d) <= dg.num_devices]:
        cfg = ParallelConfig(degrees, tuple(range(math.prod(degrees))))
        exchange = cm.norm_exchange(bn, cfg)
        assert exchange is not None and exchange.shape == (cfg.num_tasks,)
        channels = 8 // degrees[1]
        for t, dev in enumerate(cfg.devices):
            peer = cfg.devices[t ^ (1 if degrees[1] == 1 else 2)]  # same channels, other half
            by_hand = 2 * 8 * channels * dg.inv_bandwidth[dev, peer] + dg.latency[dev, peer]
            assert exchange[t] == pytest.approx(by_hand + ovh[dev] + ovh[peer], rel=1e-12)
        fwd, bwd = cm.task_times(bn, cfg)
        expected = float((fwd + bwd + 2 * exchange).max())
        assert cm.compute_time(bn, cfg) == pytest.approx(expected, rel=1e-12)
    assert cm.norm_exchange(bn, ParallelConfig((1, 2, 1, 1), (0, 1))) is None
    assert cm.norm_exchange(bn, ParallelConfig((1, 1, 1, 1), (0,))) is None
    assert cm.norm_exchange(relu, ParallelConfig((2, 1, 1, 1), (0, 1))) is None


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4", "cpu-local-2"])
@pytest.mark.parametrize("name", ["chain_cnn", "inception", "linear_head"])
def test_compute_time_halves_when_sample_degree_doubles(name, preset):
    g = _graph(name)
    dg = get_preset(preset)
    cm = CostModel(g, dg)
    checked = 0
    for i, op in enumerate(g.ops):
        if op.kind == "input":
            assert cm.compute_time(i, ParallelConfig((1,) * len(op.output.dims), (0,))) == 0.0
            continue
        s = op.output.dims.index("sample")
        deg = 1
        prev = None
        while deg <= dg.num_devices and op.output.size("sample") % deg == 0:
            degrees = tuple(deg if d == s else 1 for d in range(len(op.output.dims)))
            cfg = ParallelConfig(degrees, tuple(range(deg)))
            fwd, bwd = cm.task_times(i, cfg)
            t = float((fwd + bwd).max())  # the kernels' time; batch-norm exchanges apart
            exchange = cm.norm_exchange(i, cfg)
            extra = 0.0 if exchange is None else 2 * float(exchange.max())
            assert cm.compute_time(i, cfg) == pytest.approx(t + extra, rel=1e-12)
            assert t > 0
            if prev is not None:
                assert t == pytest.approx(prev / 2, rel=1e-9)
                checked += 1
            prev = t
            deg *= 2
    assert checked > 0


def test_compute_time_roofline_by_hand():
    g = _graph("chain_cnn")
    dg = get_preset("p100-1x4")
    opts = CostOptions(compute_efficiency=0.5, memory_efficiency=0.8, backward_factor=2.0)
    cm = CostModel(g, dg, opts)
    conv2 = g.op("conv2")  # flops-bound
    flops = 2.0 * 8 * 16 * 8 * 8 * 8 * 3 * 3
    assert conv2.flops == flops
    nbytes = g.op("pool1").output.nbytes + conv2.output.nbytes + conv2.param_bytes
    for k in (1, 2, 4):
        cfg = ParallelConfig((k, 1, 1, 1), tuple(range(k)))
        fwd = max(flops / k / (10.6e12 * 0.5), nbytes / k / (732e9 * 0.8))
        assert cm.compute_time(g.index("conv2"), cfg) == pytest.approx(3 * fwd, rel=1e-12)
    relu = g.op("relu1")  # memory-bound
    nb = 2 * relu.output.nbytes
    fwd = max(relu.flops / (10.6e12 * 0.5), nb / (732e9 * 0.8))
    assert fwd == nb / (732e9 * 0.8)
    cfg = ParallelConfig((1, 1, 1, 1), (2,))
    assert cm.compute_time(g.index("relu1"), cfg) == pytest.approx(3 * fwd, rel=1e-12)
    over = CostModel(g, dg, CostOptions(task_overhead=1e-3))
    assert over.compute_time(g.index("relu1"), cfg) == pytest.approx(3 * fwd + 1e-3, rel=1e-12)


def test_cost_options_validation():
    with pytest.raises(LayerwiseError, match="sync"):
        CostOptions(sync="gossip")  # type: ignore[arg-type]
    with pytest.raises(LayerwiseError, match="efficiency"):
        CostOptions(compute_efficiency=0.0)
    with pytest.raises(LayerwiseError, match=">= 0"):
        CostOptions(task_overhead=-1.0)


# -- t_s --------------------------------------------------------------------------------------


def _fc_graph() -> OpGraph:
    x = input_op("x", sample=8, channel=32)
    return OpGraph("fc", (x, linear("fc", x, 64)))


def test_sync_zero_without_replicas():
    g = _fc_graph()
    dg = get_preset("p100-1x4")
    for sync in ("ring", "ps"):
        cm = CostModel(g, dg, CostOptions(sync=sync))
        assert cm.sync_time(1, ParallelConfig((1, 1), (2,))) == 0.0
        full_channel = ParallelConfig((1, 4), (0, 1, 2, 3))
        assert cm.replica_groups(g.ops[1], full_channel) == [[0], [1], [2], [3]]
        assert cm.sync_time(1, full_channel) == 0.0
        assert cm.sync_time(0, ParallelConfig((4, 1), (0, 1, 2, 3))) == 0.0  # no params
        assert cm.sync_time(1, ParallelConfig((2, 1), (0, 1))) > 0
        assert cm.sync_time(1, ParallelConfig((2, 2), (0, 1, 2, 3))) > 0


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4"])
def test_sync_ring_and_ps_by_hand(preset):
    g = _fc_graph()
    dg = get_preset(preset)
    w, lat = dg.inv_bandwidth, dg.latency
    P = g.ops[1].param_bytes
    ring = CostModel(g, dg, CostOptions(sync="ring"))
    ps = CostModel(g, dg, CostOptions(sync="ps"))
    D = dg.num_devices
    for r in (2, 4, 8):
        if r > D:
            continue
        devs = list(range(r))
        cfg = ParallelConfig((r, 1), tuple(devs))
        pairs = [(devs[i], devs[(i + 1) % r]) for i in range(r)]
        exp_ring = 2 * (r - 1) / r * P * max(w[a, b] for a, b in pairs) + 2 * (r - 1) * max(
            lat[a, b] for a, b in pairs
        )
        exp_ps = sum(2 * (P * w[d, 0] + lat[d, 0]) for d in devs[1:])
        assert ring.sync_time(1, cfg) == pytest.approx(exp_ring, rel=1e-12)
        assert ps.sync_time(1, cfg) == pytest.approx(exp_ps, rel=1e-12)
    # Two shards of 2 replicas: each shard is half the parameters.
    cfg = ParallelConfig((2, 2), (0, 1, 2, 3))
    assert ring.replica_groups(g.ops[1], cfg) == [[0, 2], [1, 3]]
    exp = max(2 * (1 / 2) * (P / 2) * w[a, b] + 2 * lat[a, b] for a, b in [(0, 2), (1, 3)])
    assert ring.sync_time(1, cfg) == pytest.approx(exp, rel=1e-12)


@pytest.mark.parametrize("name", ["chain_cnn", "linear_head", "shared_steps", "attention_block"])
def test_ps_at_least_ring_for_more_than_two_replicas(name):
    g = _graph(name)
    dg = get_preset("p100-1x4")
    ring = CostModel(g, dg, CostOptions(sync="ring"))
    ps = CostModel(g, dg, CostOptions(sync="ps"))
    space = ConfigSpace(g, dg)
    compared = 0
    for i, op in enumerate(g.ops):
        if not op.params:
            continue
        for cfg in space[i].configs:
            groups = ring.replica_groups(op, cfg)
            r = max(len(x) for x in groups)
            a, b = ring.sync_time(i, cfg), ps.sync_time(i, cfg)
            if r == 1:
                assert a == b == 0.0
            else:
                assert a > 0 and b > 0
            if r > 2:
                assert b >= a
                compared += 1
    assert compared > 0


def test_param_group_sync_share_without_latency():
    # With latency-free links the sync is pure bandwidth, so 1/|group| holds exactly.
    dg = _flat_device_graph(4, 10e9, 0.0)
    steps = 3
    g = shared_steps(steps=steps)
    alone = OpGraph("alone", (g.ops[0], replace(g.ops[1], param_group=None)))
    grouped, single = CostModel(g, dg), CostModel(alone, dg)
    cfg = ParallelConfig((4, 1), (0, 1, 2, 3))
    full = single.sync_time(1, cfg)
    assert full > 0
    for s in range(steps):
        assert grouped.sync_time(g.index(f"step{s}"), cfg) == pytest.approx(full / steps)


@pytest.mark.parametrize("sync", ["ring", "ps"])
def test_param_group_ops_carry_a_share_of_the_sync(sync):
    dg = get_preset("p100-1x4")
    steps = 3
    g = shared_steps(steps=steps)
    alone = OpGraph("alone", (g.ops[0], replace(g.ops[1], param_group=None)))
    opts = CostOptions(sync=sync)
    grouped, single = CostModel(g, dg, opts), CostModel(alone, dg, opts)
    cfg = ParallelConfig((4, 1), (0, 1, 2, 3))
    full = single.sync_time(1, cfg)
    total = sum(grouped.sync_time(g.index(f"step{s}"), cfg) for s in range(steps))
    assert total == pytest.approx(full, rel=1e-9)


# -- memory -----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4"])
@pytest.mark.parametrize("name", ["chain_cnn", "linear_head", "inception"])
def test_memory_only_on_config_devices(name, preset):
    cm, space = _model(name, preset)
    g = cm.graph
    for i, op in enumerate(g.ops):
        for cfg in space[i].configs[:: max(1, len(space[i]) // 10)]:
            mem = cm.memory(i, cfg)
            assert mem.shape == (cm.num_devices,)
            on = set(np.flatnonzero(mem).tolist())
            assert on <= set(cfg.devices)  # (an op that keeps nothing: on none)
            shards = len(cm.replica_groups(op, cfg)) if op.params else 1
            # the activations kept of it (planner/costs/activations.py) per task: a
            # contraction split's partial sums kept once scattered over all its tasks
            kept = op.output.nbytes / cfg.num_tasks * cm.activations.per_op(i)
            expected = op.param_bytes / shards * 2.0 + kept
            assert mem[list(cfg.devices)] == pytest.approx(expected)
            assert (on == set(cfg.devices)) == (expected > 0)
        table = cm.memory_table(i, space[i])
        assert table.shape == (len(space[i]), cm.num_devices)


def test_memory_channel_split_shards_parameters():
    g = _fc_graph()
    cm = CostModel(g, get_preset("p100-1x4"))
    P = g.ops[1].param_bytes
    data_par = cm.memory(1, ParallelConfig((4, 1), (0, 1, 2, 3)))
    model_par = cm.memory(1, ParallelConfig((1, 4), (0, 1, 2, 3)))
    # weights and gradients; its output no op reads, so no backward keeps it
    assert data_par[0] == pytest.approx(2 * P)
    assert model_par[0] == pytest.approx(2 * P / 4)
    assert model_par.sum() < data_par.sum()
    # its input is what the linear's backward reads: kept, a quarter per task
    x = cm.memory(0, ParallelConfig((4, 1), (0, 1, 2, 3)))
    assert x[0] == pytest.approx(g.ops[0].output.nbytes / 4)


def test_node_table_is_compute_plus_sync():
    cm, space = _model("chain_cnn", "p100-1x4")
    for i in range(len(cm.graph)):
        table = cm.node_table(i, space[i])
        expected = [cm.compute_time(i, c) + cm.sync_time(i, c) for c in space[i].configs]
        np.testing.assert_allclose(table, expected, rtol=1e-12)
        assert cm.source == "analytic"


def test_lstm_state_edges_carry_h_and_c() -> None:
    """An LSTM step passes (h, c) to the next step: one message of both boxes."""
    g = model_graph("rnnlm", batch=4, steps=2, hidden=8, layers=1, vocab=10)
    dg = get_preset("p100-1x2")
    cm = CostModel(g, dg)
    state = next(e for e in g.edges if g.ops[e.dst].kind == "lstm" and e.position == 1)
    other = next(e for e in g.edges if g.ops[e.dst].kind == "lstm" and e.position == 0)
    assert cm.edge_components(state) == 2 and cm.edge_components(other) == 1
    src = g.ops[state.src]
    one = ParallelConfig((1,) * len(src.output.dims), (0,))
    there = ParallelConfig((1,) * len(g.ops[state.dst].output.dims), (1,))
    message = 2 * src.output.nbytes * dg.inv_bandwidth[0, 1] + dg.latency[0, 1]
    assert cm.transfer_time(state, one, there) == pytest.approx(2 * message, rel=1e-12)
    configs = [
        ParallelConfig((1,) * len(op.output.dims), (0 if i == state.src else 1,))
        for i, op in enumerate(g.ops)
    ]
    timeline = Simulator(cm, configs).timeline()
    dst = g.ops[state.dst].name
    forward = [t for t in timeline.tasks if t.name.startswith(f"xfer {src.name}->{dst} ")]
    backward = [t for t in timeline.tasks if t.name.startswith(f"xfer grad {dst}->{src.name} ")]
    assert len(forward) == len(backward) == len(dg.route(0, 1))
    hop = dg.links[dg.route(0, 1)[0]]
    assert forward[0].end - forward[0].start == pytest.approx(
        2 * src.output.nbytes / hop.bandwidth + hop.latency, rel=1e-12
    )


@pytest.mark.parametrize("degrees", [(2, 1, 1, 1), (1, 2, 2, 1), (2, 2, 1, 2), (1, 4, 1, 1)])
def test_stats_groups_are_the_tasks_with_the_same_channels(degrees) -> None:
    g = chain_cnn()
    bn = g.ops[g.index("bn1")]
    groups = stats_groups(bn, degrees)
    tasks = math.prod(degrees)
    channel = [int(np.unravel_index(t, degrees)[1]) for t in range(tasks)]
    if degrees[1] == tasks:
        assert groups is None  # a channel split shares nothing
        return
    assert groups is not None and len(groups) == tasks
    for t, members in enumerate(groups):
        assert members == [m for m in range(tasks) if channel[m] == channel[t]]
    assert stats_groups(g.ops[g.index("relu1")], degrees) is None


@pytest.mark.parametrize("rates", ["shape", "flat"])
def test_communication_sms_slow_every_kernel_by_the_share_they_take(rates):
    from planner.graph.precision import with_precision

    graph = with_precision(model_graph("gpt2", batch=4, seq=64), "bf16-mixed")
    devices = get_preset("dgx-h100-1")
    base = CostOptions(rates=rates, task_overhead=1e-5)
    share = CostOptions(rates=rates, task_overhead=1e-5, comm_sm_share=0.25)
    cm, cs = CostModel(graph, devices, base), CostModel(graph, devices, share)
    space = ConfigSpace(graph, devices)
    checked = shaped = 0
    for i, op in enumerate(graph.ops):
        if op.kind == "input":
            continue
        cfg = space[i].configs[-1]
        (f0, b0), (f1, b1) = cm.task_times(i, cfg), cs.task_times(i, cfg)
        np.testing.assert_allclose(f1 - 1e-5, (f0 - 1e-5) / 0.75, rtol=1e-12)
        np.testing.assert_allclose(b1, b0 / 0.75, rtol=1e-12)
        checked += 1
        shaped += cm._kernel_times(i, cfg) is not None
    assert checked > 10 and (shaped > 0) == (rates == "shape")


@pytest.mark.parametrize("bad", [-0.1, 1.0, True, "20/132"])
def test_communication_sm_share_must_be_a_fraction_below_one(bad):
    with pytest.raises(LayerwiseError, match="comm_sm_share"):
        CostOptions(comm_sm_share=bad)
