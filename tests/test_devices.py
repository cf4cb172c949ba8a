"""DeviceGraph: presets, derived routes, JSON, validation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import DeviceGraphError
from planner.hardware.devices import Device, DeviceGraph, Link
from planner.hardware.presets import (
    CPU_LOCAL_DEFAULTS,
    DGX1_NVLINKS,
    get_preset,
    list_presets,
    load_devices,
    measure_cpu_local,
    preset_device_count,
)

EXPECTED_DEVICES = {
    "p100-1x4": 4,
    "p100-2x4": 8,
    "p100-4x4": 16,
    "p100-8x4": 32,
    "p100-16x4": 64,
    "p100-64x4": 256,
    "p100-256x4": 1024,
    "k80-1x4": 4,
    "k80-4x4": 16,
    "k80-16x4": 64,
    "v100-dgx1-1": 1,
    "v100-dgx1-2": 2,
    "v100-dgx1-3": 3,
    "v100-dgx1-4": 4,
    "v100-dgx1-8": 8,
    "dgx-a100-1": 8,
    "dgx-a100-4": 32,
    "dgx-a100-32": 256,
    "dgx-a100-128": 1024,
    "dgx-a100-80g-1": 8,
    "dgx-a100-80g-4": 32,
    "dgx-a100-80g-32": 256,
    "dgx-a100-80g-128": 1024,
    "dgx-h100-1": 8,
    "dgx-h100-4": 32,
    "dgx-h100-32": 256,
    "dgx-h100-128": 1024,
    "dgx-h100-1024": 8192,
    "dgx-h100-2048": 16384,
    "dgx-h200-1": 8,
    "dgx-h200-4": 32,
    "dgx-h200-32": 256,
    "dgx-h200-128": 1024,
    "hgx-h800-1": 8,
    "hgx-h800-32": 256,
    "hgx-h800-256": 2048,
    "cpu-local-2": 2,
    "cpu-local-4": 4,
}
SAMPLE = [
    "p100-4x4",
    "k80-4x4",
    "v100-dgx1-8",
    "cpu-local-4",
    "p100-2x3",
    "k80-2x3",
    "dgx-a100-2",
    "dgx-h100-2",
]


@pytest.fixture(autouse=True)
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """cpu-local presets read no user cache unless a test writes one."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(cache))
    return cache


def gpu(name: str, host: str = "node0") -> Device:
    return Device(name, "gpu", 1e12, 1e11, 2**30, host)


def two_gpus(**link: float) -> DeviceGraph:
    bandwidth, latency = link.get("bandwidth", 1e9), link.get("latency", 1e-6)
    return DeviceGraph("pair", [gpu("g0"), gpu("g1")], [Link("g0", "g1", bandwidth, latency)])


def endpoints(g: DeviceGraph, route: tuple[int, ...]) -> list[tuple[str, str]]:
    return [(g.links[k].a, g.links[k].b) for k in route]


def assert_chains(g: DeviceGraph, i: int, j: int) -> None:
    """The links of route(i, j) lead, endpoint to endpoint, from device i to device j."""
    node = g.devices[i].name
    for a, b in endpoints(g, g.route(i, j)):
        assert node in (a, b)
        node = b if node == a else a
    assert node == g.devices[j].name


# -- presets ----------------------------------------------------------------------------------


def test_list_presets_covers_every_family() -> None:
    assert set(list_presets()) == set(EXPECTED_DEVICES)


@pytest.mark.parametrize("name", [n for n, d in EXPECTED_DEVICES.items() if d <= 256])
def test_preset_builds_with_right_device_count(name: str) -> None:
    g = get_preset(name)
    assert g.name == name
    assert g.num_devices == EXPECTED_DEVICES[name] == len(g.devices)
    assert g.inv_bandwidth.shape == g.latency.shape == (g.num_devices, g.num_devices)
    assert preset_device_count(name) == g.num_devices  # counted from the name alone


def test_preset_device_count_needs_no_building() -> None:
    for name, devices in EXPECTED_DEVICES.items():
        assert preset_device_count(name) == devices
    assert preset_device_count("p100-100000x8") == 800_000  # building it would never finish
    assert preset_device_count("dgx-a100-100000") == 800_000
    for other in ("a100-4x4", "cluster.json", "p100-4x4.json", "cpu-local-"):
        assert preset_device_count(other) is None


@pytest.mark.parametrize("name", SAMPLE)
def test_route_costs_symmetric_positive(name: str) -> None:
    g = get_preset(name)
    off = ~np.eye(g.num_devices, dtype=bool)
    for matrix in (g.inv_bandwidth, g.latency):
        assert np.array_equal(matrix, matrix.T)
        assert np.all(np.diag(matrix) == 0)
        assert np.all(matrix[off] > 0)
    assert not g.inv_bandwidth.flags.writeable


@pytest.mark.parametrize("name", SAMPLE)
def test_routes_chain_from_i_to_j(name: str) -> None:
    g = get_preset(name)
    for i in range(g.num_devices):
        assert g.route(i, i) == ()
        for j in set(range(g.num_devices)) - {i}:
            assert_chains(g, i, j)
            route = g.route(i, j)
            assert g.latency[i, j] == pytest.approx(sum(g.links[k].latency for k in route))
            assert g.inv_bandwidth[i, j] == 1 / min(g.links[k].bandwidth for k in route)


def test_p100_intra_node_faster_than_inter_node() -> None:
    g = get_preset("p100-4x4")
    assert g.devices[1].host == g.devices[0].host != g.devices[4].host
    assert g.transfer_time(0, 1, 1e8) < g.transfer_time(0, 4, 1e8)
    assert g.inv_bandwidth[0, 1] == 1 / 20e9  # NVLink
    assert g.inv_bandwidth[0, 4] == 1 / 12e9  # PCIe to the NIC is the bottleneck
    kinds = [g.links[k].kind for k in g.route(0, 4)]
    assert kinds == ["pcie", "infiniband", "infiniband", "pcie"]


def test_k80_pair_switch_is_closer_than_other_pair() -> None:
    g = get_preset("k80-1x4")
    assert len(g.route(0, 1)) == 2 and len(g.route(0, 2)) == 4
    assert g.latency[0, 1] < g.latency[0, 2]


def test_dgx1_nvlink_topology() -> None:
    per_gpu = np.zeros(8, dtype=int)
    for (x, y), count in DGX1_NVLINKS.items():
        per_gpu[[x, y]] += count
    assert list(per_gpu) == [6] * 8  # six NVLink 2.0 ports per V100
    g = get_preset("v100-dgx1-8")
    assert g.inv_bandwidth[0, 3] == 1 / 50e9 and g.inv_bandwidth[0, 1] == 1 / 25e9
    assert all(g.links[k].kind == "nvlink" for k in g.route(0, 5))
    assert endpoints(g, g.route(0, 5)) == [("gpu0", "gpu1"), ("gpu1", "gpu5")]  # name tie-break


@pytest.mark.parametrize(
    "name",
    [
        "p100-4x9",
        "p100-0x4",
        "k80-1x0",
        "v100-dgx1-5",
        "cpu-local-0",
        "dgx-a100-0",
        "dgx-a100-80g-0",
        "dgx-h100-0",
    ],
)
def test_out_of_range_preset_sizes(name: str) -> None:
    with pytest.raises(DeviceGraphError, match=name):
        get_preset(name)


def test_unknown_preset_lists_valid_forms() -> None:
    with pytest.raises(DeviceGraphError, match=r"'a100-4x4'.*p100-NxG.*cpu-local-N"):
        get_preset("a100-4x4")


def test_cpu_local_defaults_and_cache(empty_cache: Path) -> None:
    g = get_preset("cpu-local-2")
    assert g.devices[0].flops == CPU_LOCAL_DEFAULTS["flops"]
    assert g.transfer_time(0, 1, 3e9) == pytest.approx(1 + 60e-6)
    empty_cache.mkdir()
    figures = {"bandwidth": 1e9, "latency": 1e-4, "flops": 5e10, "mem_bandwidth": 2e10}
    (empty_cache / "cpu-local.json").write_text(json.dumps(figures))
    g = get_preset("cpu-local-2")
    assert g.devices[1].flops == 5e10 and g.latency[0, 1] == pytest.approx(1e-4)
    # an older cache without the message overhead: the default one
    assert g.devices[0].message_overhead == CPU_LOCAL_DEFAULTS["message_overhead"]
    (empty_cache / "cpu-local.json").write_text(json.dumps(figures | {"message_overhead": 2e-3}))
    g = get_preset("cpu-local-4")
    assert {d.message_overhead for d in g.devices} == {2e-3}
    assert len(g.links) == 6 and not g.switches  # one link per pair: a message crosses once
    assert all(len(g.route(a, b)) == 1 for a in range(4) for b in range(4) if a != b)


def test_message_overhead_is_validated_and_kept_in_json() -> None:
    with pytest.raises(DeviceGraphError, match="message_overhead"):
        Device("d", "cpu", 1e9, 1e9, 2**30, "h", message_overhead=-1.0)
    g = get_preset("cpu-local-2")
    data = g.to_json()
    assert all("message_overhead" in d for d in data["devices"])
    assert DeviceGraph.from_json(data) == g
    gpu = get_preset("p100-1x2").to_json()
    assert not any("message_overhead" in d for d in gpu["devices"])  # 0: left out


def test_cpu_local_bad_cache_warns_and_uses_defaults(empty_cache: Path) -> None:
    empty_cache.mkdir()
    (empty_cache / "cpu-local.json").write_text("{not json")
    with pytest.warns(UserWarning, match="cpu-local cache"):
        g = get_preset("cpu-local-2")
    assert g.devices[0].flops == CPU_LOCAL_DEFAULTS["flops"]


def test_planner_import_does_not_import_torch() -> None:
    code = "import sys, planner.hardware.presets; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


# -- queries, identity, JSON -----------------------------------------------------------------


def test_transfer_time() -> None:
    g = two_gpus(bandwidth=2e9, latency=1e-5)
    assert g.transfer_time(0, 1, 4e9) == pytest.approx(2 + 1e-5)
    assert g.transfer_time(0, 0, 4e9) == 0 and g.transfer_time(0, 1, 0) == 0
    with pytest.raises(DeviceGraphError, match="out of range"):
        g.route(0, 2)


def test_parallel_links_route_picks_the_faster_one() -> None:
    links = [Link("g0", "g1", 1e9, 1e-6), Link("g0", "g1", 4e9, 1e-6), Link("g1", "g0", 4e9, 1e-6)]
    g = DeviceGraph("parallel", [gpu("g0"), gpu("g1")], links)
    assert g.route(0, 1) == g.route(1, 0) == (1,)


@pytest.mark.parametrize("name", SAMPLE)
def test_json_round_trip(name: str, tmp_path: Path) -> None:
    g = get_preset(name)
    assert DeviceGraph.from_json(json.loads(json.dumps(g.to_json()))) == g
    path = tmp_path / f"{name}.json"
    g.save(path)
    loaded = DeviceGraph.load(path)
    assert loaded == g and hash(loaded) == hash(g) and loaded.fingerprint() == g.fingerprint()
    assert load_devices(str(path)) == g == load_devices(name)
    assert g.to_json()["format"] == "layerwise.devicegraph" and g.to_json()["version"] == 1


def test_fingerprint_stable_and_sensitive() -> None:
    g = get_preset("p100-2x4")
    assert g.fingerprint() == get_preset("p100-2x4").fingerprint()
    assert len(g.fingerprint()) == 16
    links = list(g.links)
    links[0] = replace(links[0], bandwidth=links[0].bandwidth * 2)
    changed = DeviceGraph(g.name, g.devices, links, g.switches)
    assert changed != g and changed.fingerprint() != g.fingerprint()
    renamed = DeviceGraph("other", g.devices, g.links, g.switches)
    assert renamed != g and renamed.fingerprint() == g.fingerprint()


def test_summary_mentions_devices_and_links() -> None:
    text = get_preset("p100-4x4").summary()
    assert "16 devices" in text and "nvlink" in text and "infiniband" in text


# -- validation -------------------------------------------------------------------------------


def test_zero_bandwidth() -> None:
    with pytest.raises(DeviceGraphError, match="g0-g1: bandwidth"):
        two_gpus(bandwidth=0)
    with pytest.raises(DeviceGraphError, match="g0-g1: bandwidth"):
        two_gpus(bandwidth=float("inf"))


def test_negative_latency() -> None:
    with pytest.raises(DeviceGraphError, match="g0-g1: latency"):
        two_gpus(latency=-1e-6)


def test_unreachable_device() -> None:
    devices = [gpu("g0"), gpu("g1"), gpu("g2")]
    with pytest.raises(DeviceGraphError, match="no route from g0 to g2"):
        DeviceGraph("island", devices, [Link("g0", "g1", 1e9, 0)])


def test_unknown_endpoint() -> None:
    with pytest.raises(DeviceGraphError, match="'sw9' is neither a device nor a switch"):
        DeviceGraph("bad", [gpu("g0"), gpu("g1")], [Link("g0", "sw9", 1e9, 0)], ["sw0"])


def test_duplicate_name() -> None:
    with pytest.raises(DeviceGraphError, match="duplicate.*'g0'"):
        DeviceGraph("dup", [gpu("g0"), gpu("g1")], [Link("g0", "g1", 1e9, 0)], ["g0"])


def test_no_devices_and_bad_device_figures() -> None:
    with pytest.raises(DeviceGraphError, match="no devices"):
        DeviceGraph("empty", [], [])
    with pytest.raises(DeviceGraphError, match="g0: flops"):
        replace(gpu("g0"), flops=0.0)
    with pytest.raises(DeviceGraphError, match="g0: memory"):
        replace(gpu("g0"), memory=0)
    with pytest.raises(DeviceGraphError, match="g0: kind"):
        replace(gpu("g0"), kind="tpu")


def test_bad_json() -> None:
    data = two_gpus().to_json()
    with pytest.raises(DeviceGraphError, match="version"):
        DeviceGraph.from_json(data | {"version": 99})
    with pytest.raises(DeviceGraphError, match="format"):
        DeviceGraph.from_json(data | {"format": "other"})
    with pytest.raises(DeviceGraphError, match="malformed"):
        DeviceGraph.from_json({k: v for k, v in data.items() if k != "links"})


# -- property: routes on random graphs --------------------------------------------------------


@st.composite
def random_graphs(draw: st.DrawFn) -> DeviceGraph:
    n_devices = draw(st.integers(2, 5))
    n_switches = draw(st.integers(0, 2))
    names = [f"g{i}" for i in range(n_devices)] + [f"s{i}" for i in range(n_switches)]
    order = draw(st.permutations(names))
    pairs = list(pairwise(order))  # a spanning chain keeps the graph connected
    pairs += draw(st.lists(st.tuples(*[st.sampled_from(names)] * 2), max_size=8))
    links = [
        Link(
            a,
            b,
            draw(st.sampled_from([1e9, 5e9, 12e9, 25e9])),
            draw(st.sampled_from([0, 1e-6, 5e-6])),
        )
        for a, b in pairs
        if a != b
    ]
    devices = [gpu(name) for name in names[:n_devices]]
    return DeviceGraph("random", devices, links, names[n_devices:])


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_routes_are_cheapest_and_costs_match(g: DeviceGraph) -> None:
    graph = nx.MultiGraph()
    for link in g.links:
        graph.add_edge(link.a, link.b, weight=link.route_weight)
    assert DeviceGraph.from_json(g.to_json()) == g
    for i, src in enumerate(g.devices):
        for j, dst in enumerate(g.devices):
            assert_chains(g, i, j)
            route = g.route(i, j)
            assert g.route(j, i) == route[::-1]
            assert g.latency[i, j] == pytest.approx(sum(g.links[k].latency for k in route))
            if i != j:
                best = nx.shortest_path_length(graph, src.name, dst.name, weight="weight")
                assert sum(g.links[k].route_weight for k in route) == best


# -- the real measurement ---------------------------------------------------------------------


@pytest.mark.slow
def test_measure_cpu_local(empty_cache: Path) -> None:
    figures = measure_cpu_local(2, max_load=math.inf)  # the suite may keep the machine busy
    assert figures["load"]["cores"] >= 1 and figures["measured_at"]
    for key in CPU_LOCAL_DEFAULTS:
        assert figures[key] > 0
    assert (empty_cache / "cpu-local.json").exists()
    g = get_preset("cpu-local-2")
    assert g.devices[0].flops == pytest.approx(figures["flops"])
    assert g.latency[0, 1] == pytest.approx(figures["latency"])
    assert g.devices[1].message_overhead == pytest.approx(figures["message_overhead"])
    # a swap between busy workers costs the latency and an overhead at each end
    assert figures["busy_exchange"] == pytest.approx(
        figures["latency"] + 2 * figures["message_overhead"], rel=1e-9
    )


# -- hierarchy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("p100-1x4", (4,)),
        ("p100-4x4", (4, 4)),
        ("p100-3x2", (3, 2)),
        ("k80-4x4", (4, 2, 2)),  # nodes, PCIe switches, dies
        ("cpu-local-2", (2,)),
        ("dgx-a100-1", (8,)),
        ("dgx-a100-3", (3, 8)),
    ],
)
def test_homogeneous_clusters_have_a_hierarchy(name: str, sizes: tuple[int, ...]) -> None:
    from planner.hardware.presets import get_preset

    h = get_preset(name).hierarchy()
    assert h is not None and h.sizes == sizes and h.num_devices == get_preset(name).num_devices
    # costs grow outwards: the outermost level is the slowest
    assert list(h.inv_bandwidth) == sorted(h.inv_bandwidth, reverse=True)


def test_hierarchy_level_costs_are_the_routes_costs() -> None:
    from planner.hardware.presets import get_preset

    g = get_preset("p100-2x4")
    h = g.hierarchy()
    assert h is not None
    assert h.inv_bandwidth == (g.inv_bandwidth[0, 4], g.inv_bandwidth[0, 1])
    assert h.latency == (g.latency[0, 4], g.latency[0, 1])
    assert h.block(0) == 8 and h.block(1) == 4 and h.block(2) == 1


@pytest.mark.parametrize("name", ["v100-dgx1-8", "v100-dgx1-4", "k80-2x3"])
def test_clusters_without_uniform_levels_have_none(name: str) -> None:
    from planner.hardware.presets import get_preset

    assert get_preset(name).hierarchy() is None


def test_a_shuffled_device_order_or_a_different_device_is_not_a_hierarchy() -> None:
    from planner.hardware.presets import get_preset

    g = get_preset("p100-2x2")
    order = [0, 2, 1, 3]  # nodes interleaved: device 0's cheapest peer is not device 1
    shuffled = DeviceGraph("shuffled", [g.devices[i] for i in order], g.links, g.switches)
    assert shuffled.hierarchy() is None
    slow = replace(g.devices[3], flops=g.devices[3].flops / 2)
    mixed = DeviceGraph("mixed", [*g.devices[:3], slow], g.links, g.switches)
    assert mixed.hierarchy() is None


# -- routes at scale: the same routes as one Dijkstra per device, exactly --------------------


def reference_routes(g: DeviceGraph) -> tuple[list[list[tuple[int, ...]]], np.ndarray, np.ndarray]:
    """The routing rule as it was first written: networkx Dijkstra from each device, ties to
    fewer hops then to the smaller sequence of node names, costs summed over each route."""
    graph = nx.Graph()
    graph.add_nodes_from(sorted(d.name for d in g.devices))
    graph.add_nodes_from(sorted(g.switches))
    for index, link in enumerate(g.links):
        key = (link.route_weight, index)
        current = graph.get_edge_data(link.a, link.b)
        if current is None or key < current["key"]:
            graph.add_edge(link.a, link.b, weight=link.route_weight, key=key, link=index)
    names = [d.name for d in g.devices]
    n = len(names)
    routes: list[list[tuple[int, ...]]] = [[() for _ in names] for _ in names]
    for i, source in enumerate(names[:-1]):
        preds, dist = nx.dijkstra_predecessor_and_distance(graph, source, weight="weight")
        best: dict[str, tuple[int, list[str]]] = {source: (0, [source])}
        for node in sorted(dist, key=lambda v: (dist[v], v)):
            if node != source:
                hops, path = min(best[p] for p in preds[node])
                best[node] = (hops + 1, [*path, node])
        for j in range(i + 1, n):
            path = best[names[j]][1]
            route = tuple(graph[u][v]["link"] for u, v in pairwise(path))
            routes[i][j], routes[j][i] = route, route[::-1]
    bandwidth = np.array([link.bandwidth for link in g.links])
    latency = np.array([link.latency for link in g.links])
    inv_bw, lat = np.zeros((n, n)), np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            r = list(routes[i][j])
            inv_bw[i, j] = inv_bw[j, i] = 1.0 / bandwidth[r].min()
            lat[i, j] = lat[j, i] = latency[r].sum()
    return routes, inv_bw, lat


def assert_same_as_reference(g: DeviceGraph) -> None:
    routes, inv_bw, lat = reference_routes(g)
    n = g.num_devices
    assert [[g.route(i, j) for j in range(n)] for i in range(n)] == routes
    assert np.array_equal(g.inv_bandwidth, inv_bw) and np.array_equal(g.latency, lat)
    assert all(g.hops(i, j) == len(routes[i][j]) for i in range(n) for j in range(n))


@pytest.mark.parametrize("name", [*SAMPLE, "p100-16x4", "k80-16x4", "dgx-a100-4", "v100-dgx1-3"])
def test_presets_route_exactly_as_the_reference(name: str) -> None:
    assert_same_as_reference(get_preset(name))


@st.composite
def tied_graphs(draw: st.DrawFn) -> DeviceGraph:
    """Random graphs whose links mostly weigh the same, so equal-cost routes abound."""
    n_devices = draw(st.integers(2, 7))
    n_switches = draw(st.integers(0, 4))
    names = [f"d{i}" for i in range(n_devices)] + [f"s{i}" for i in range(n_switches)]
    order = draw(st.permutations(names))
    pairs = list(pairwise(order))
    pairs += draw(st.lists(st.tuples(*[st.sampled_from(names)] * 2), max_size=14))
    links = [
        Link(a, b, draw(st.sampled_from([1e9, 2e9])), draw(st.sampled_from([0.0, 1e-6])))
        for a, b in pairs
        if a != b
    ]
    devices = [gpu(name) for name in names[:n_devices]]
    return DeviceGraph("tied", devices, links, names[n_devices:])


@settings(max_examples=80, deadline=None)
@given(st.one_of(random_graphs(), tied_graphs()))
def test_random_graphs_route_exactly_as_the_reference(g: DeviceGraph) -> None:
    assert_same_as_reference(g)


def test_long_routes_sum_latencies_as_numpy_does() -> None:
    """A chain of 12 devices: routes of up to 11 hops, latencies summed over the route as
    numpy's sum does (pairwise from 8 terms on), bit for bit."""
    names = [f"d{i:02d}" for i in range(12)]
    links = [Link(a, b, 1e9, 1e-6 * (1 + k % 3) / 3) for k, (a, b) in enumerate(pairwise(names))]
    g = DeviceGraph("chain", [gpu(n) for n in names], links)
    assert g.hops(0, 11) == 11
    assert_same_as_reference(g)


def test_a_thousand_gpus_route_quickly_with_a_hierarchy() -> None:
    """p100-256x4: routes from trees, not an all-pairs table (one Dijkstra per device and a
    Python loop over a million pairs took 23 s)."""
    g = get_preset("p100-256x4")
    h = g.hierarchy()
    assert h is not None and h.sizes == (256, 4)
    kinds = [g.links[k].kind for k in g.route(5, 1022)]
    assert kinds == ["pcie", "infiniband", "infiniband", "pcie"]
    assert g.route(1022, 5) == g.route(5, 1022)[::-1]
    assert g.inv_bandwidth[5, 1022] == 1 / 12e9 and g.hops(1022, 5) == 4
    assert_chains(g, 1023, 0)


def test_dgx_a100_nvswitch_and_a_nic_per_gpu() -> None:
    g = get_preset("dgx-a100-2")
    assert g.num_devices == 16 and {d.host for d in g.devices} == {"node0", "node1"}
    assert [g.links[k].kind for k in g.route(0, 7)] == ["nvswitch", "nvswitch"]
    assert g.inv_bandwidth[0, 7] == 1 / 300e9
    # to another node: through this GPU's own NIC and the peer's own NIC
    route = g.route(3, 12)
    assert [g.links[k].kind for k in route] == ["pcie", "infiniband", "infiniband", "pcie"]
    assert g.links[route[0]].b == "node0/nic3" and g.links[route[-1]].b == "node1/nic4"
    assert g.inv_bandwidth[3, 12] == 1 / 25e9
    assert g.devices[0].memory == 40 * 2**30 and g.devices[0].flops == 19.5e12


def test_h800_has_the_h100s_compute_and_a_cut_nvlink() -> None:
    h100, h800 = get_preset("dgx-h100-2"), get_preset("hgx-h800-2")
    assert h800.devices[0].flops16 == h100.devices[0].flops16
    assert h800.inv_bandwidth[0, 1] == 1 / 200e9 and h100.inv_bandwidth[0, 1] == 1 / 450e9
    assert h800.inv_bandwidth[0, 8] == h100.inv_bandwidth[0, 8] == 1 / 50e9
