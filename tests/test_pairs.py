"""Device-pair costs on demand (planner/hardware/pairs.py, hierarchy.py): the queries of a
graph too large for D x D tables (levels proven by symmetry, or shortest-path trees per
source) give the tables' numbers, routes and hierarchy exactly, on presets and on random
graphs; subsets are cheap and keep their routes; the cost model reads pairs, not tables."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner.costs.costmodel as costmodel_module
import planner.hardware.hierarchy as hierarchy_module
import planner.hardware.pairs as pairs_module
from planner.costs.config import ConfigSpace
from planner.costs.costmodel import CostModel
from planner.errors import DeviceGraphError
from planner.graph.zoo import model_graph
from planner.hardware.devices import Device, DeviceGraph, Link
from planner.hardware.presets import get_preset
from planner.problems.sizes import SizeError, check_devices_spec, device_graph_bytes

PRESETS = [
    "p100-1x4",
    "p100-2x3",
    "p100-4x4",
    "p100-16x4",
    "k80-2x3",
    "k80-4x4",
    "v100-dgx1-3",
    "v100-dgx1-8",
    "dgx-a100-1",
    "dgx-a100-4",
    "dgx-h100-2",
    "cpu-local-4",
]


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    """cpu-local presets read no user cache."""
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path / "cache"))


@contextlib.contextmanager
def lazily(exact: int | None = None) -> Iterator[None]:
    """Every graph built inside takes the path of a large one (no D x D tables; levels or
    trees per source), the cost model too; `exact`: the largest graph whose unproven levels
    are compared pair by pair (0: none, the symmetry proof alone)."""
    saved = (
        pairs_module.DENSE_DEVICES,
        costmodel_module.DENSE_DEVICES,
        hierarchy_module.EXACT_DEVICES,
    )
    pairs_module.DENSE_DEVICES = 0
    costmodel_module.DENSE_DEVICES = 0
    if exact is not None:
        hierarchy_module.EXACT_DEVICES = exact
    try:
        yield
    finally:
        (pairs_module.DENSE_DEVICES, costmodel_module.DENSE_DEVICES,
         hierarchy_module.EXACT_DEVICES) = saved  # fmt: skip


def copy(g: DeviceGraph) -> DeviceGraph:
    return DeviceGraph(g.name, g.devices, g.links, g.switches)


def reference(g: DeviceGraph, routes: bool = True) -> dict[str, object]:
    """What a graph's D x D tables say (call it outside `lazily`)."""
    n = g.num_devices
    assert g._pairs.small
    idx = np.arange(n)
    ends = [(0, n - 1), (n - 1, 0), (n // 2, n // 3)]
    return {
        "inv": g.inv_bandwidth.copy(),
        "lat": g.latency.copy(),
        "hops": g.hops_of(idx[:, None], idx[None, :]),
        "hierarchy": g.hierarchy(),
        "summary": g.summary(),
        "routes": [[g.route(i, j) for j in range(n)] for i in range(n)] if routes else None,
        "times": [g.transfer_time(i, j, 3e6) for i, j in ends],
    }


def assert_same_pairs(want: dict[str, object], lazy: DeviceGraph, summary: bool = True) -> None:
    """The lazy graph's queries equal the tables' (`reference`), bit for bit."""
    assert not lazy._pairs.small
    n = lazy.num_devices
    idx = np.arange(n)
    inv, lat = lazy.pair_costs(idx[:, None], idx[None, :])
    assert np.array_equal(inv, want["inv"]) and np.array_equal(lat, want["lat"])
    assert np.array_equal(lazy.hops_of(idx[:, None], idx[None, :]), want["hops"])
    assert lazy.hierarchy() == want["hierarchy"]
    assert lazy.summary() == want["summary"] or not summary
    if want["routes"] is not None:
        assert [[lazy.route(i, j) for j in range(n)] for i in range(n)] == want["routes"]
    ends = [(0, n - 1), (n - 1, 0), (n // 2, n // 3)]
    assert [lazy.transfer_time(i, j, 3e6) for i, j in ends] == want["times"]
    assert lazy._pairs._tables is None  # no table was derived


@pytest.mark.parametrize("name", PRESETS)
def test_queries_equal_the_tables_on_presets(name: str) -> None:
    dense = get_preset(name)
    want = reference(dense)
    with lazily(exact=0):
        assert_same_pairs(want, copy(dense))


@pytest.mark.parametrize("name", ["p100-64x4", "dgx-a100-32", "k80-64x4"])
def test_levels_equal_the_tables_on_larger_presets(name: str) -> None:
    dense = get_preset(name)
    want = reference(dense, routes=False)
    n = dense.num_devices
    routes = [dense.route(i, (i * 7 + 3) % n) for i in range(n)]
    with lazily(exact=0):
        lazy = copy(dense)
        assert_same_pairs(want, lazy)
        assert lazy._pairs.levels is not None  # proven by symmetry, no tree per source
        assert [lazy.route(i, (i * 7 + 3) % n) for i in range(n)] == routes


@st.composite
def random_graphs(draw: st.DrawFn) -> DeviceGraph:
    """Connected graphs of devices and switches, with many equal-cost routes."""
    n_devices = draw(st.integers(2, 9))
    n_switches = draw(st.integers(0, 4))
    names = [f"d{i}" for i in range(n_devices)] + [f"s{i}" for i in range(n_switches)]
    order = draw(st.permutations(names))
    pairs = list(pairwise(order))
    pairs += draw(st.lists(st.tuples(*[st.sampled_from(names)] * 2), max_size=16))
    links = [
        Link(a, b, draw(st.sampled_from([1e9, 2e9, 12e9])), draw(st.sampled_from([0.0, 1e-6])))
        for a, b in pairs
        if a != b
    ]
    devices = [Device(name, "gpu", 1e12, 1e11, 2**30, "h") for name in names[:n_devices]]
    return DeviceGraph("random", devices, links, names[n_devices:])


@settings(max_examples=80, deadline=None)
@given(random_graphs())
def test_queries_equal_the_tables_on_random_graphs(g: DeviceGraph) -> None:
    want = reference(g)
    with lazily():
        assert_same_pairs(want, copy(g))


@st.composite
def clusters(draw: st.DrawFn) -> tuple[DeviceGraph, tuple[int, ...], bool]:
    """Homogeneous clusters of nested groups (1-3 levels): each group's members joined to a
    switch of their own, or all pairs linked directly at the innermost level, NICs per
    device at random, names in a random order (tie-breaks differ); with `broken`, one link
    somewhere is made different (then the cluster may not be a hierarchy at all). Returns
    the graph, the sizes it was built with and whether it is broken."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    figures = [
        (draw(st.sampled_from([5e9, 25e9, 50e9])), draw(st.sampled_from([1e-6, 2e-6, 5e-6])))
        for _ in sizes
    ]
    direct = draw(st.booleans())  # innermost level: all pairs linked, no switch
    nics = draw(st.booleans())
    n = math.prod(sizes)
    label = draw(st.permutations(range(n)))
    names = [f"g{label[d]}" for d in range(n)]
    links: list[Link] = []
    switches: list[str] = []

    def group(level: int, first: int) -> list[str]:
        """Build group `first` of `level`; return the nodes that link it to its parent."""
        if level == len(sizes):
            if not nics:
                return [names[first]]
            nic = f"nic{label[first]}"
            switches.append(nic)
            links.append(Link(names[first], nic, 40e9, 1e-6))
            return [nic]
        block = math.prod(sizes[level + 1 :])
        bw, lat = figures[level]
        ups = [up for k in range(sizes[level]) for up in group(level + 1, first + k * block)]
        if direct and level == len(sizes) - 1:  # all pairs linked; each member links up
            links.extend(Link(a, b, bw, lat) for k, a in enumerate(ups) for b in ups[k + 1 :])
            return ups
        switch = f"sw{level}.{label[first]}"
        switches.append(switch)
        links.extend(Link(up, switch, bw, lat) for up in ups)
        return [switch]

    group(0, 0)
    broken = draw(st.booleans()) and len(links) > 1
    if broken:
        k = draw(st.integers(0, len(links) - 1))
        links[k] = Link(links[k].a, links[k].b, links[k].bandwidth * 2, links[k].latency)
    devices = [Device(names[d], "gpu", 1e12, 1e11, 2**30, f"h{d // sizes[-1]}") for d in range(n)]
    return DeviceGraph("cluster", devices, links, switches), tuple(sizes), broken


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters())
def test_the_symmetry_proof_is_sound_and_finds_symmetric_clusters(
    case: tuple[DeviceGraph, tuple[int, ...], bool],
) -> None:
    """Proven levels are always the exact check's; the levels a cluster is built with are
    proven (others, found because two levels happen to cost the same, may not be: then the
    graph is compared pair by pair up to EXACT_DEVICES, else has no hierarchy)."""
    dense, sizes, broken = case
    want = reference(dense, routes=False)
    exact = want["hierarchy"]
    with lazily(exact=0):
        lazy = copy(dense)
        proven = lazy.hierarchy()
        if proven is not None:
            assert proven == exact
            assert_same_pairs(want, lazy)
    built = tuple(size for size in sizes if size > 1) or (1,)
    if not broken and exact is not None and exact.sizes == built:
        assert proven == exact
    with lazily():  # pair by pair when the proof fails: always the exact answer
        assert copy(dense).hierarchy() == exact


def test_a_broken_symmetry_is_not_proven() -> None:
    """p100-4x4 with one NVLink of node 2 faster: device 0's routes look as before, but the
    graph has no hierarchy; the proof must not accept it."""
    g = get_preset("p100-4x4")
    links = list(g.links)
    k = next(i for i, link in enumerate(links) if link.a == "gpu9" and link.b == "gpu10")
    links[k] = Link(links[k].a, links[k].b, 40e9, links[k].latency, links[k].kind)
    dense = DeviceGraph("broken", g.devices, links, g.switches)
    want = reference(dense)
    assert want["hierarchy"] is None
    with lazily(exact=0):
        assert_same_pairs(want, copy(dense))


def test_subset_keeps_costs_and_routes_and_drops_dangling_switches() -> None:
    g = get_preset("dgx-a100-4")
    keep = [3, 4, 9, 30, 31]
    sub = g.subset(keep, "part")
    # the old subset: every switch and every link among the kept devices and the switches
    names = {g.devices[i].name for i in keep} | set(g.switches)
    old_links = [link for link in g.links if link.a in names and link.b in names]
    used = {end for link in old_links for end in (link.a, link.b)}
    old = DeviceGraph("part", [g.devices[i] for i in keep], old_links,
                      [s for s in g.switches if s in used])  # fmt: skip
    want = reference(old, routes=False)
    with lazily():
        assert_same_pairs(want, sub, summary=False)
    for i in range(len(keep)):
        for j in range(len(keep)):
            assert [sub.links[k] for k in sub.route(i, j)] == [
                old.links[k] for k in old.route(i, j)
            ]
    # only the kept GPUs' NICs, the NVSwitches of nodes with two kept GPUs and the fabric
    # switch are left (node 1's NVSwitch would join gpu9 to nothing)
    assert set(sub.switches) == {"ib", "node0/nvswitch", "node3/nvswitch",
                                 "node0/nic3", "node0/nic4", "node1/nic1", "node3/nic6",
                                 "node3/nic7"}  # fmt: skip
    with pytest.raises(DeviceGraphError, match="distinct device indices"):
        g.subset([1, 1])


def test_sixteen_thousand_gpus_need_no_pair_tables() -> None:
    g = get_preset("dgx-h100-2048")
    h = g.hierarchy()
    assert h is not None and h.sizes == (2048, 8)
    assert g._pairs._tables is None and g._pairs.levels is not None
    assert g.inv_bandwidth_of(5, 16000) == 1 / 50e9 and g.hops_of(16000, 5) == 4
    assert g.latency_of(np.array([0, 8]), 7).tolist() == pytest.approx([5e-6, 14e-6], rel=1e-12)
    kinds = [g.links[k].kind for k in g.route(16383, 2)]
    assert kinds == ["pcie", "infiniband", "infiniband", "pcie"]
    with pytest.raises(DeviceGraphError, match=r"16,384 x 16,384 table .*inv_bandwidth_of"):
        g.inv_bandwidth  # noqa: B018 - the property is the call
    stage = g.subset(range(1024, 2048), "stage")
    assert stage.hierarchy() == type(h)((128, 8), h.inv_bandwidth, h.latency)
    assert len(stage.switches) == 1 + 128 + 1024  # its own NVSwitches and NICs, the fabric
    assert "routes: 50-450 GB/s, 5-14 us, 2-4 hops" in g.summary()


def test_a_large_graph_without_levels_derives_trees_per_source() -> None:
    """300 GPUs on 7 leaf switches by index modulo 7 (no levels: device 0's nearest peers
    are not the devices after it), leaves joined to two spines: costs from each pair's
    lower device's tree, as the tables give them."""
    n = 300
    devices = [Device(f"g{i:03d}", "gpu", 1e12, 1e11, 2**30, f"h{i % 7}") for i in range(n)]
    links = [Link(f"g{i:03d}", f"leaf{i % 7}", 25e9, 1e-6) for i in range(n)]
    links += [Link(f"leaf{k}", f"spine{s}", 50e9, 2e-6) for k in range(7) for s in range(2)]
    switches = [*(f"leaf{k}" for k in range(7)), "spine0", "spine1"]
    lazy = DeviceGraph("leaves", devices, links, switches)
    assert lazy.num_devices > pairs_module.DENSE_DEVICES
    idx = np.arange(n)
    pairs = [(i, (i * 11 + 5) % n) for i in range(n)]
    with lazily():
        pairs_module.DENSE_DEVICES = n  # the reference: the tables
        dense = copy(lazy)
        want = (dense.inv_bandwidth, dense.latency, dense.hops_of(idx[:, None], idx))
        routes = [dense.route(i, j) for i, j in pairs]
        assert dense.hierarchy() is None
    assert lazy.hierarchy() is None and lazy._pairs.levels is None
    inv, lat = lazy.pair_costs(idx[:, None], idx[None, :])
    assert np.array_equal(inv, want[0]) and np.array_equal(lat, want[1])
    assert np.array_equal(lazy.hops_of(idx[:, None], idx), want[2])
    assert [lazy.route(i, j) for i, j in pairs] == routes
    assert lazy._pairs._tables is None


@pytest.mark.parametrize("name", ["p100-2x4", "v100-dgx1-8", "k80-2x3"])
def test_the_cost_model_reads_pairs_as_it_read_tables(name: str) -> None:
    graph = model_graph("lenet5")
    dense_graph = get_preset(name)
    dense = CostModel(graph, dense_graph)
    space = ConfigSpace(graph, dense_graph, max_configs=12)
    with lazily(exact=0):
        lazy = CostModel(graph, copy(dense_graph))
        assert lazy._tables is None
        lazy_space = ConfigSpace(graph, lazy.devices, max_configs=12)
        for i in range(len(graph.ops)):
            assert np.array_equal(dense.node_table(i, space[i]), lazy.node_table(i, lazy_space[i]))
        for e in graph.edges:
            want = dense.edge_table(e, space[e.src], space[e.dst])
            assert np.array_equal(want, lazy.edge_table(e, lazy_space[e.src], lazy_space[e.dst]))
            for a in space[e.src].configs[:4]:
                for b in space[e.dst].configs[:4]:
                    assert dense.transfer_time(e, a, b) == lazy.transfer_time(e, a, b)


def test_the_guard_counts_the_device_graph_not_its_pairs() -> None:
    check_devices_spec("dgx-h100-2048")  # 16,384 GPUs: ~128 MiB, no 22 GiB of pair tables
    assert device_graph_bytes(16384) < 2**30
    with pytest.raises(SizeError, match="800,000 devices: its device graph alone"):
        check_devices_spec("dgx-a100-100000")


def test_a_pickled_graph_has_its_own_routes_cache() -> None:
    """The tree cache is keyed per graph: a graph read back from a pickle (another process's
    copy) is built again and never reads another graph's trees."""
    import pickle

    g = get_preset("p100-2x4").subset(range(1, 7))
    again = pickle.loads(pickle.dumps(g))
    assert again == g and again._pairs._token != g._pairs._token
    idx = np.arange(g.num_devices)
    assert np.array_equal(again.inv_bandwidth_of(idx[:, None], idx), g.inv_bandwidth)
