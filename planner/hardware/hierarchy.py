"""A cluster's route costs as nested groups of devices (`Hierarchy`), found from one device's
routes and proven without deriving every pair's (docs/devices.md, "Hierarchy").

**Candidate.** Device 0's route costs give the levels: its cheapest peers must be the
devices right after it, the next cheapest the block after those, and so on (`_candidate`).

**Proof.** The candidate holds when every pair (i, j) costs what the level of its first
differing digit says. On a small graph every pair is compared (the D x D tables exist). On
a larger one the proof is by symmetry, in three checks, each linear in the links:

1. device 0's routes cost what the candidate says, level by level (one tree);
2. ties do not matter: from device 0 to each device there is one cheapest route (fewest
   hops), or all of them have the same bottleneck bandwidth and the same latency summed in
   route order, and fewer than 8 hops (numpy sums longer routes in its own order); a dynamic
   program over the cheapest routes keeps each node's least and largest of both, and their
   number;
3. for every level l, the map that adds 1 (modulo its size) to every device's digit l
   extends to an automorphism of the routing graph (its core: `planner.hardware.routing`):
   a permutation of the nodes that maps every link to a link of the same bandwidth and
   latency. The switches' images are found from their neighbours' images and the whole map
   is then checked link by link, so a wrong guess is never accepted.

Why that suffices: the maps of 3 generate the digit-wise additions, so for every device i
there is an automorphism t with t(0) = i that keeps "the level at which two devices part"
(adding the same digits to both keeps which digits agree). An automorphism maps the
cheapest routes from 0 to k onto those from i to t(k), link for link, so by 2 the route
from i to t(k) that the tie-break picks costs, bit for bit, what the route from 0 to k does,
which by 1 is the level's cost. Every device j is t(k) for k = t^-1(j), and its level
relative to i is k's relative to 0. (A pair's route is its lower device's, so this covers
both directions.)

A graph where the proof fails (an unusual switch fabric) is compared pair by pair up to
`EXACT_DEVICES` devices; a larger one is taken as having no hierarchy (logged), which only
makes the cost tables take their general path.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from planner.hardware.pairs import Levels, PairCosts, shared_levels
from planner.hardware.routing import (
    LONG_ROUTE_HOPS,
    ROUTE_PROBE_BYTES,
    RouteGraph,
    distances,
    tight_edges,
)

__all__ = ["EXACT_DEVICES", "Hierarchy", "route_levels"]

log = logging.getLogger(__name__)

EXACT_DEVICES = 1024  # a larger graph not proven by symmetry is not compared pair by pair


@dataclass(frozen=True)
class Hierarchy:
    """A homogeneous cluster seen as nested groups of devices (outermost level first).

    `sizes[l]` groups of level l+1 make one group of level l; their product is the number of
    devices, which are numbered group by group (device = mixed-radix digits over `sizes`).
    Every device is identical, and the route between two devices costs `inv_bandwidth[l]`
    seconds per byte and `latency[l]` seconds, where l is the outermost level at which their
    digits differ. p100-16x4 is (16, 4): 16 nodes of 4 GPUs; k80-NxG has a level for the
    PCIe switch a pair of dies shares; a DGX-1's cube-mesh is not a hierarchy (None)."""

    sizes: tuple[int, ...]
    inv_bandwidth: tuple[float, ...]
    latency: tuple[float, ...]

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def block(self, level: int) -> int:
        """Devices in one group of `level` (0: the whole cluster)."""
        return math.prod(self.sizes[level:])


def route_levels(pairs: PairCosts, name: str) -> tuple[Hierarchy, Levels] | None:
    """The levels of the graph's route costs (any devices), proven (see the module
    docstring), or None."""
    n = pairs.num_devices
    if n == 1:
        one = Hierarchy((1,), (0.0,), (0.0,))
        return one, Levels((1,), np.zeros(2), np.zeros(2), np.zeros(2, dtype=np.int32))
    if pairs.small:
        t = pairs.tables()
        inv_row, lat_row, hops_row = t.inv_bandwidth[0], t.latency[0], t.hops[0]
    else:  # device 0's tree alone (the costs of its pairs are its routes')
        row = pairs.row(0, neighbours=False)
        inv_row, lat_row, hops_row = row.inv_bandwidth, row.latency, row.hops
    found = _candidate(inv_row, lat_row, n)
    if found is None:
        return None
    h = found
    levels = _levels(h, hops_row)
    if pairs.small:
        checked = _every_pair(pairs, levels)
        return None if checked is None else (h, checked)
    why = _symmetry_fails(pairs.graph, h, levels, inv_row, lat_row)
    if why is None:  # hops are kept by automorphisms too: device 0's per level hold for all
        return h, levels
    if n <= EXACT_DEVICES:
        checked = _every_pair_by_trees(pairs, levels)
        return None if checked is None else (h, checked)
    log.info(
        "%s: route costs not proven to follow levels %s (%s): no hierarchy", name, h.sizes, why
    )
    return None


def _candidate(inv_row: np.ndarray, lat_row: np.ndarray, n: int) -> Hierarchy | None:
    """The levels device 0's route costs suggest: its cheapest peers must be the devices
    right after it, the next cheapest the block after those, and so on."""
    row = (inv_row * ROUTE_PROBE_BYTES + lat_row)[1:]
    blocks: list[int] = []  # devices per group, innermost level first
    inv_bw: list[float] = []
    latency: list[float] = []
    for value in np.unique(row):
        near = np.flatnonzero(row <= value) + 1
        size = len(near) + 1
        if not np.array_equal(near, np.arange(1, size)) or n % size:
            return None
        if blocks and size % blocks[-1]:
            return None
        j = int(near[-1])
        blocks.append(size)
        inv_bw.append(float(inv_row[j]))
        latency.append(float(lat_row[j]))
    if blocks[-1] != n:
        return None
    levels = len(blocks)
    sizes = tuple(
        blocks[levels - 1 - k] // (blocks[levels - 2 - k] if k < levels - 1 else 1)
        for k in range(levels)
    )
    return Hierarchy(sizes, tuple(inv_bw[::-1]), tuple(latency[::-1]))


def _levels(h: Hierarchy, hops_row: np.ndarray) -> Levels:
    """`h` as pair-cost levels, with each level's hops from device 0's routes (None when
    two routes of one level from device 0 differ in hops: hops are then read from trees)."""
    L = len(h.sizes)
    blocks = tuple(h.block(level + 1) for level in range(L))
    shared = shared_levels(blocks, np.zeros(1, dtype=np.int64), np.arange(1, h.num_devices))
    hops: np.ndarray | None = np.zeros(L + 1, dtype=np.int32)
    for level in range(L):
        seen = np.unique(hops_row[1:][shared == level])
        if len(seen) > 1:
            hops = None
            break
        if len(seen) and hops is not None:
            hops[level] = seen[0]
    return Levels(blocks, np.array([*h.inv_bandwidth, 0.0]), np.array([*h.latency, 0.0]), hops)


def _every_pair(pairs: PairCosts, levels: Levels) -> Levels | None:
    """`levels` if every pair of a small graph costs what its level says (the D x D
    tables), without hops when some pair's differ from its level's; else None."""
    idx = np.arange(pairs.num_devices)
    shared = levels.shared(idx[:, None], idx[None, :])
    t = pairs.tables()
    if not (
        np.array_equal(t.inv_bandwidth, levels.inv_bandwidth[shared])
        and np.array_equal(t.latency, levels.latency[shared])
    ):
        return None
    if levels.hops is not None and not np.array_equal(t.hops, levels.hops[shared]):
        return dataclasses.replace(levels, hops=None)
    return levels


def _every_pair_by_trees(pairs: PairCosts, levels: Levels) -> Levels | None:
    """As `_every_pair`, tree by tree (nothing kept)."""
    graph, n = pairs.graph, pairs.num_devices
    hops_agree = levels.hops is not None
    for lo in range(0, n - 1, graph.chunk):
        sources = np.arange(lo, min(n - 1, lo + graph.chunk))
        trees = graph.trees(sources)
        with np.errstate(divide="ignore"):
            inv = 1.0 / trees.min_bandwidth
        after = np.arange(n)[None, :] > sources[:, None]
        shared = levels.shared(sources[:, None], np.arange(n)[None, :])
        if not (
            np.array_equal(inv[after], levels.inv_bandwidth[shared][after])
            and np.array_equal(trees.latency[after], levels.latency[shared][after])
        ):
            return None
        if hops_agree and levels.hops is not None:
            hops_agree = np.array_equal(trees.hops[after], levels.hops[shared][after])
    return levels if hops_agree else dataclasses.replace(levels, hops=None)


def _symmetry_fails(
    graph: RouteGraph, h: Hierarchy, levels: Levels, inv_row: np.ndarray, lat_row: np.ndarray
) -> str | None:
    """Why the symmetry proof (checks 1-3 of the module docstring) does not hold for the
    candidate `h` found from device 0's route costs `inv_row`, `lat_row` (None: it holds)."""
    n = graph.num_devices
    shared = shared_levels(levels.blocks, np.zeros(1, dtype=np.int64), np.arange(1, n))
    if not (
        np.array_equal(inv_row[1:], levels.inv_bandwidth[shared])
        and np.array_equal(lat_row[1:], levels.latency[shared])
    ):
        return "device 0's routes of one level differ in bandwidth or latency"
    dist, level = distances(np.zeros(1, dtype=np.int64), graph)
    (bw_lo, lat_lo), (bw_hi, lat_hi), count = _route_cost_range(graph, dist, level)
    devices = slice(1, n)
    alike = (bw_lo[devices] == bw_hi[devices]) & (lat_lo[devices] == lat_hi[devices])
    alike &= level[0, devices] < LONG_ROUTE_HOPS  # numpy sums those in its own order
    if not (alike | (count[devices] == 1)).all():
        return "device 0's cheapest routes to a device differ in bandwidth or latency"
    for k, size in enumerate(h.sizes):
        if size > 1 and automorphism(graph, _shift(h.sizes, k)) is None:
            return f"no symmetry moves the groups of level {k}"
    return None


def _route_cost_range(
    graph: RouteGraph, dist: np.ndarray, level: np.ndarray
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], np.ndarray]:
    """Over every cheapest route (fewest hops) from device 0 to each node: the least and
    the largest bottleneck bandwidth, the least and largest latency summed in route order,
    and how many such routes there are (2: more than one), as ((least bandwidth, least
    latency), (largest bandwidth, largest latency), count)."""
    V = graph.num_nodes
    _, e = tight_edges(dist, level, graph)
    v_level = level[0, graph.head[e]]
    e = e[np.argsort(v_level, kind="stable")]
    v_level = np.sort(v_level)
    bw_lo, bw_hi = np.full(V, np.inf), np.full(V, np.inf)
    lat_lo, lat_hi = np.zeros(V), np.zeros(V)
    count = np.zeros(V, dtype=np.int64)
    count[0] = 1
    for r in range(1, int(v_level.max(initial=0)) + 1):
        part = e[v_level == r]
        p, v, link = graph.tail[part], graph.head[part], graph.link[part]
        bw, lat = graph.bandwidth[link], graph.latency[link]
        bw_lo[v], bw_hi[v] = np.inf, -np.inf
        lat_lo[v], lat_hi[v] = np.inf, -np.inf
        np.minimum.at(bw_lo, v, np.minimum(bw_lo[p], bw))
        np.maximum.at(bw_hi, v, np.minimum(bw_hi[p], bw))
        np.minimum.at(lat_lo, v, lat_lo[p] + lat)
        np.maximum.at(lat_hi, v, lat_hi[p] + lat)
        np.add.at(count, v, count[p])
        np.minimum(count, 2, out=count)
    return (bw_lo, lat_lo), (bw_hi, lat_hi), count


def _shift(sizes: tuple[int, ...], level: int) -> np.ndarray:
    """The device permutation that adds 1 (mod its size) to every device's digit `level`."""
    n = math.prod(sizes)
    block = math.prod(sizes[level + 1 :])
    x = np.arange(n)
    digit = (x // block) % sizes[level]
    return x + (((digit + 1) % sizes[level]) - digit) * block


def automorphism(graph: RouteGraph, devices: np.ndarray) -> np.ndarray | None:
    """A permutation of the routing graph's nodes that moves device d to `devices[d]` and
    every link to a link of the same bandwidth and latency, or None when none is found.
    Each switch goes where its neighbours' images have the one switch neighbour its link
    asks for; where several qualify, the first free one that every mapped neighbour
    allows. The whole map is checked at the end."""
    D, V = graph.num_devices, graph.num_nodes
    attr = _link_kinds(graph)
    kinds = int(attr.max(initial=0)) + 1
    edge_attr = attr[graph.link]
    node = np.full(V, -1, dtype=np.int64)
    node[:D] = devices
    to_switch = graph.head >= D
    keys = graph.tail[to_switch] * kinds + edge_attr[to_switch]
    order = np.argsort(keys, kind="stable")
    keys, neighbours = keys[order], graph.head[to_switch][order]
    unique, first, count = np.unique(keys, return_index=True, return_counts=True)
    adjacency: dict[tuple[int, int], set[int]] | None = None
    while True:
        if not _propagate(graph, node, edge_attr, kinds, unique, first, count, neighbours):
            return None
        if (node >= 0).all():
            break
        if adjacency is None:
            adjacency = defaultdict(set)
            for t, hd, a in zip(
                graph.tail.tolist(), graph.head.tolist(), edge_attr.tolist(), strict=True
            ):
                if hd >= D:
                    adjacency[t, a].add(hd)
        if not _guess_one(graph, node, edge_attr, adjacency):
            return None
    return node if _is_automorphism(graph, node, attr) else None


def _link_kinds(graph: RouteGraph) -> np.ndarray:
    """Per link index: an id of its (bandwidth, latency) (its route weight follows)."""
    pairs = np.stack([graph.bandwidth, graph.latency], axis=1)
    if not len(pairs):
        return np.zeros(0, dtype=np.int64)
    return np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1)


def _propagate(
    graph: RouteGraph,
    node: np.ndarray,
    edge_attr: np.ndarray,
    kinds: int,
    unique: np.ndarray,
    first: np.ndarray,
    count: np.ndarray,
    neighbours: np.ndarray,
) -> bool:
    """Map every switch that a mapped neighbour's image pins down (the image has exactly one
    switch neighbour over a link of that kind); False on a contradiction."""
    while True:
        e = np.flatnonzero((node[graph.tail] >= 0) & (node[graph.head] < 0))
        if not len(e):
            return True
        k = node[graph.tail[e]] * kinds + edge_attr[e]
        pos = np.minimum(np.searchsorted(unique, k), max(len(unique) - 1, 0))
        if not len(unique) or not (unique[pos] == k).all():
            return False  # the image has no switch neighbour over such a link
        single = count[pos] == 1
        if not single.any():
            return True
        switches, images = graph.head[e[single]], neighbours[first[pos[single]]]
        order = np.lexsort((images, switches))
        switches, images = switches[order], images[order]
        same = switches[1:] == switches[:-1]
        if (same & (images[1:] != images[:-1])).any():
            return False
        node[switches] = images


def _guess_one(
    graph: RouteGraph,
    node: np.ndarray,
    edge_attr: np.ndarray,
    adjacency: dict[tuple[int, int], set[int]],
) -> bool:
    """Map the first unmapped switch with a mapped neighbour to the first free switch that
    all its mapped neighbours' images allow; False when there is none."""
    e = np.flatnonzero((node[graph.tail] >= 0) & (node[graph.head] < 0))
    if not len(e):
        return False
    switch = int(graph.head[e].min())
    mine = e[graph.head[e] == switch]
    allowed: set[int] | None = None
    for t, a in zip(graph.tail[mine].tolist(), edge_attr[mine].tolist(), strict=True):
        options = adjacency.get((int(node[t]), a), set())
        allowed = set(options) if allowed is None else allowed & options
    taken = set(node[node >= 0].tolist())
    free = sorted((allowed or set()) - taken)
    if not free:
        return False
    node[switch] = free[0]
    return True


def _is_automorphism(graph: RouteGraph, node: np.ndarray, attr: np.ndarray) -> bool:
    V = graph.num_nodes
    if not np.array_equal(np.sort(node), np.arange(V)):
        return False
    ends = graph.ends[graph.chosen]
    kinds = int(attr.max(initial=0)) + 1

    def keys(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        return np.sort((lo * V + hi) * kinds + attr[graph.chosen])

    return bool(
        np.array_equal(keys(ends[:, 0], ends[:, 1]), keys(node[ends[:, 0]], node[ends[:, 1]]))
    )
