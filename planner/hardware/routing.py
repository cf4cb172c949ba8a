"""Shortest routes between devices of a hardware graph, vectorized over sources, on demand.

A route minimises the sum of its links' integer weights (`Link.route_weight`); ties go to
fewer hops, then to the lexicographically smaller sequence of node names from the source
(docs/devices.md, "Routing rule"). `RouteGraph` holds what routing reads (built once, in
time and memory linear in the nodes and links); `RouteGraph.trees(sources)` computes, for a
few source devices at once:

1. distances and hop counts by Bellman-Ford in Jacobi rounds over numpy arrays (sources x
   nodes): round r relaxes the links out of the nodes that improved in round r - 1, so the
   round in which a node last improved is the fewest hops of its cheapest routes. Clusters
   are shallow (a P100 cluster's routes have at most 4 hops), so a handful of rounds over a
   few thousand links replaces one Dijkstra per device;
2. the shortest-path tree, level by level (hop count): a node's parent is the candidate
   (a node one hop closer with dist + weight == dist) whose own route ranks first; ranks are
   dense per source and level, ordered by (parent's rank, node name), which is exactly the
   lexicographic order of the routes' name sequences;
3. each route's bottleneck bandwidth and summed latency along the tree.

Routing runs on the graph's *core*: one link per pair of nodes (the lightest; the lowest
index on a tie) and no switch that hangs off the rest by one link (removed again and again:
a switch with one link is never inside a route between two devices, so every route, its
ties and its costs are the same with or without it). A pipeline stage's group of a large
cluster keeps every NIC of the cluster hanging off the fabric switch; its core has only its
own.

`route_trees` computes every source at once (the small graphs' dense tables); larger graphs
ask `trees` for the sources they need (`planner.hardware.pairs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

__all__ = [
    "ROUTE_PROBE_BYTES",
    "RouteGraph",
    "RouteTrees",
    "SourceTrees",
    "core_nodes",
    "distances",
    "route_trees",
    "tight_edges",
    "walk",
]

# A route minimises the sum over its links of (latency + ROUTE_PROBE_BYTES / bandwidth):
# the time a 1 MiB message would take if every link forwarded it in turn.
ROUTE_PROBE_BYTES = 2**20
_INF = np.iinfo(np.int64).max // 4
CHUNK_ENTRIES = 1 << 21  # sources x directed links per chunk
LONG_ROUTE_HOPS = 8  # from here on numpy's sum groups a route's latencies pairwise


@dataclass(frozen=True)
class SourceTrees:
    """Shortest-path trees from `sources` (devices): for each, the parent link of every core
    node (indices into the graph's links; -1 at the root and off the core) and, to every
    device j, the route's hops, bottleneck bandwidth and summed latency. Only the entries
    j > source are what the graph's costs read (a pair's route is its lower device's)."""

    sources: np.ndarray  # (S,)
    parent_link: np.ndarray  # (S, core nodes) int32
    hops: np.ndarray  # (S, D) int32
    min_bandwidth: np.ndarray  # (S, D)
    latency: np.ndarray  # (S, D)


@dataclass(frozen=True)
class RouteTrees:
    """Routes from every device (the dense tables of a small graph). parent_link[i, v]: link
    index into core node v on the route from device i (-1 at the root and for devices
    before i, whose routes are read from their own tree). hops, inv_bandwidth, latency:
    (D, D), symmetric (the route j -> i is the route i -> j reversed)."""

    parent_link: np.ndarray
    hops: np.ndarray
    inv_bandwidth: np.ndarray
    latency: np.ndarray


class RouteGraph:
    """What routing reads of a hardware graph: its core (see the module docstring) as
    directed edges sorted by head node, the links' weights, bandwidths and latencies, and
    the node names' ranks. Devices are nodes 0..D-1 in the core as in the graph."""

    def __init__(
        self,
        names: Sequence[str],
        num_devices: int,
        link_ends: np.ndarray,
        link_weight: np.ndarray,
        link_bandwidth: np.ndarray,
        link_latency: np.ndarray,
    ) -> None:
        D, V = num_devices, len(names)
        ends = np.asarray(link_ends, dtype=np.int64).reshape(-1, 2)
        weights = np.asarray(link_weight, dtype=np.int64)
        chosen = _lightest_per_pair(ends, weights)
        alive = core_nodes(ends[chosen], V, D)
        chosen = chosen[alive[ends[chosen, 0]] & alive[ends[chosen, 1]]]
        seen = _reached(ends[chosen], V)
        missing = np.flatnonzero(~seen[:D])
        self.unreachable = int(missing[0]) if len(missing) else None  # from device 0
        if self.unreachable is None:  # nothing apart from the devices carries a route
            alive &= seen
            chosen = chosen[alive[ends[chosen, 0]] & alive[ends[chosen, 1]]]
        compact = np.full(V, -1, dtype=np.int64)
        compact[alive] = np.arange(int(alive.sum()))
        self.num_devices = D
        self.num_nodes = int(alive.sum())
        self.node_names = [names[v] for v in np.flatnonzero(alive).tolist()]
        self.chosen = chosen  # link indices the routes use (one per core pair)
        # Ends of every link in core node indices (-1 for an end off the core).
        self.ends = np.where(alive[ends], compact[ends], -1)
        core = self.ends[chosen]
        tail = np.concatenate([core[:, 0], core[:, 1]])
        head = np.concatenate([core[:, 1], core[:, 0]])
        link = np.concatenate([chosen, chosen])
        order = np.lexsort((tail, head))
        self.tail, self.head, self.link = tail[order], head[order], link[order]
        self.weight = weights[self.link]
        self.link_weight = weights
        self.bandwidth = np.asarray(link_bandwidth, dtype=np.float64)
        self.latency = np.asarray(link_latency, dtype=np.float64)
        self.name_rank = np.empty(self.num_nodes, dtype=np.int64)
        self.name_rank[np.argsort(np.array(self.node_names, dtype=object), kind="stable")] = (
            np.arange(self.num_nodes)
        )

    @property
    def chunk(self) -> int:
        """Sources per `trees` step: (sources x directed links) temporaries stay small."""
        return max(1, CHUNK_ENTRIES // max(1, len(self.tail)))

    def trees(self, sources: np.ndarray) -> SourceTrees:
        """The shortest-path trees from `sources` (device indices), computed `chunk` at a
        time; latencies of routes of 8 hops or more summed as numpy sums them."""
        sources = np.asarray(sources, dtype=np.int64)
        S, D = len(sources), self.num_devices
        parent = np.full((S, self.num_nodes), -1, dtype=np.int32)
        hops = np.zeros((S, D), dtype=np.int32)
        min_bw = np.full((S, D), np.inf)
        lat = np.zeros((S, D))
        for lo in range(0, S, self.chunk):
            part = slice(lo, min(S, lo + self.chunk))
            dist, level = distances(sources[part], self)
            tree, bottleneck, summed = _tree(sources[part], dist, level, self)
            parent[part] = tree
            hops[part] = level[:, :D]
            min_bw[part] = bottleneck[:, :D]
            lat[part] = summed[:, :D]
        out = SourceTrees(sources, parent, hops, min_bw, lat)
        self._sum_long_routes(out)
        return out

    def route(self, parent_row: np.ndarray, source: int, target: int) -> list[int]:
        """Links from `source` to `target` in path order, following a tree's parent links."""
        return walk(parent_row, self.ends, source, target)

    def _sum_long_routes(self, trees: SourceTrees) -> None:
        """Latencies of routes of 8 hops or more (to devices after the source), summed with
        numpy's sum over the route (its pairwise summation groups terms differently from the
        running sum along the tree)."""
        rows, cols = np.nonzero(trees.hops >= LONG_ROUTE_HOPS)
        for r, j in zip(rows.tolist(), cols.tolist(), strict=True):
            i = int(trees.sources[r])
            if j > i:
                route = self.route(trees.parent_link[r], i, j)
                trees.latency[r, j] = self.latency[route].sum()


def route_trees(graph: RouteGraph) -> RouteTrees:
    """Routes from every device: the dense, symmetric tables of a small graph whose devices
    all reach each other (`RouteGraph.unreachable` is None)."""
    D = graph.num_devices
    trees = graph.trees(np.arange(max(D - 1, 0)))
    hops = np.zeros((D, D), dtype=np.int32)
    min_bw = np.full((D, D), np.inf)
    lat = np.zeros((D, D))
    hops[: D - 1], min_bw[: D - 1], lat[: D - 1] = trees.hops, trees.min_bandwidth, trees.latency
    upper = np.triu(np.ones((D, D), dtype=bool), 1)
    hops = np.where(upper, hops, hops.T)
    with np.errstate(divide="ignore"):
        inv_bw = np.where(upper, 1.0 / min_bw, (1.0 / min_bw).T)
    lat = np.where(upper, lat, lat.T)
    np.fill_diagonal(inv_bw, 0.0)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(hops, 0)
    parent = trees.parent_link
    for array in (parent, hops, inv_bw, lat):
        array.setflags(write=False)
    return RouteTrees(parent, hops, inv_bw, lat)


def _lightest_per_pair(ends: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Sorted link indices: per unordered pair of ends, the lightest (lowest index on a tie)."""
    if not len(ends):
        return np.zeros(0, dtype=np.int64)
    lo, hi = ends.min(axis=1), ends.max(axis=1)
    order = np.lexsort((np.arange(len(ends)), weights, hi, lo))
    first = np.r_[True, (lo[order][1:] != lo[order][:-1]) | (hi[order][1:] != hi[order][:-1])]
    return np.sort(order[first])


def _reached(ends: np.ndarray, num_nodes: int) -> np.ndarray:
    """The nodes linked to node 0 (device 0) by some chain of `ends`."""
    seen = np.zeros(num_nodes, dtype=bool)
    if not num_nodes:
        return seen
    seen[0] = True
    tail = np.concatenate([ends[:, 0], ends[:, 1]])
    head = np.concatenate([ends[:, 1], ends[:, 0]])
    frontier = seen.copy()
    while frontier.any():
        reached = np.zeros(num_nodes, dtype=bool)
        reached[head[frontier[tail]]] = True
        frontier = reached & ~seen
        seen |= frontier
    return seen


def core_nodes(ends: np.ndarray, num_nodes: int, num_devices: int) -> np.ndarray:
    """Nodes kept for routing: every device (nodes 0..num_devices-1), and the switches left
    once switches linked to at most one other node are removed, again and again (none of
    them is inside a route between two devices)."""
    alive = np.ones(num_nodes, dtype=bool)
    if not len(ends):
        alive[num_devices:] = False
        return alive
    lo, hi = ends.min(axis=1), ends.max(axis=1)
    key = np.unique(lo * num_nodes + hi)  # one per pair of nodes
    pairs = np.stack([key // num_nodes, key % num_nodes], axis=1)
    live = np.ones(len(pairs), dtype=bool)
    switch = np.arange(num_nodes) >= num_devices
    while True:
        degree = np.bincount(pairs[live].reshape(-1), minlength=num_nodes)
        leaf = switch & alive & (degree <= 1)
        if not leaf.any():
            return alive
        alive[leaf] = False
        live &= alive[pairs[:, 0]] & alive[pairs[:, 1]]


def distances(sources: np.ndarray, graph: RouteGraph) -> tuple[np.ndarray, np.ndarray]:
    """Jacobi Bellman-Ford from each source: (S, V) distances and fewest hops (-1: none)."""
    V, tail, head, weight = graph.num_nodes, graph.tail, graph.head, graph.weight
    S = len(sources)
    rows = np.arange(S)
    dist = np.full((S, V), _INF, dtype=np.int64)
    level = np.full((S, V), -1, dtype=np.int32)
    dist[rows, sources] = 0
    level[rows, sources] = 0
    changed = np.zeros(V, dtype=bool)
    changed[sources] = True
    r = 0
    while changed.any():
        r += 1
        active = np.flatnonzero(changed[tail])  # edges sorted by head stay sorted
        if not len(active):
            break
        heads = head[active]
        cand = dist[:, tail[active]] + weight[active][None, :]
        starts = np.flatnonzero(np.r_[True, heads[1:] != heads[:-1]])
        nodes = heads[starts]
        best = np.minimum.reduceat(cand, starts, axis=1)
        better = best < dist[:, nodes]
        dist[:, nodes] = np.where(better, best, dist[:, nodes])
        level[:, nodes] = np.where(better, r, level[:, nodes])
        changed[:] = False
        changed[nodes[better.any(axis=0)]] = True
    return dist, level


def tight_edges(
    dist: np.ndarray, level: np.ndarray, graph: RouteGraph
) -> tuple[np.ndarray, np.ndarray]:
    """(source row, directed edge) pairs that end a cheapest route with the fewest hops."""
    tail, head, weight = graph.tail, graph.head, graph.weight
    lt, lh = level[:, tail], level[:, head]
    tight = (lt >= 0) & (lh == lt + 1) & (dist[:, tail] + weight[None, :] == dist[:, head])
    rows, edges = np.nonzero(tight)
    return rows, edges


def _tree(
    sources: np.ndarray, dist: np.ndarray, level: np.ndarray, graph: RouteGraph
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parent link per (source, node), bottleneck bandwidth and summed latency of each route."""
    tail, head, link = graph.tail, graph.head, graph.link
    bandwidth, latency, name_rank = graph.bandwidth, graph.latency, graph.name_rank
    S, V = dist.shape
    rows = np.arange(S)
    parent = np.full((S, V), -1, dtype=np.int32)
    min_bw = np.full((S, V), np.inf)
    lat = np.zeros((S, V))
    rank = np.full((S, V), -1, dtype=np.int64)
    rank[rows, sources] = 0
    s_all, e_all = tight_edges(dist, level, graph)
    lh = level[s_all, head[e_all]]
    by_level = np.argsort(lh, kind="stable")
    s_all, e_all = s_all[by_level], e_all[by_level]
    bounds = np.searchsorted(lh[by_level], np.arange(1, int(level.max()) + 2))
    for lo, hi in pairwise(bounds):
        s, e = s_all[lo:hi], e_all[lo:hi]
        p, v = tail[e], head[e]
        # Per (source, node): the candidate whose parent route ranks first.
        pick = np.lexsort((rank[s, p], s * V + v))
        s, e, p, v = s[pick], e[pick], p[pick], v[pick]
        first = np.r_[True, (s[1:] != s[:-1]) | (v[1:] != v[:-1])]
        s, e, p, v = s[first], e[first], p[first], v[first]
        parent[s, v] = link[e]
        min_bw[s, v] = np.minimum(min_bw[s, p], bandwidth[link[e]])
        lat[s, v] = lat[s, p] + latency[link[e]]
        # Dense ranks per source (< V), ordered by (parent's rank, name): route order.
        combined = (s * V + rank[s, p]) * V + name_rank[v]
        dense = np.unique(combined, return_inverse=True)[1].reshape(-1)
        start = np.full(S, len(dense), dtype=np.int64)
        np.minimum.at(start, s, dense)
        rank[s, v] = dense - start[s]
    return parent, min_bw, lat


def walk(parent_row: np.ndarray, link_ends: np.ndarray, source: int, target: int) -> list[int]:
    """Links from `source` to `target` in path order, following the tree's parent links."""
    out: list[int] = []
    node = target
    while node != source:
        li = int(parent_row[node])
        out.append(li)
        a, b = link_ends[li]
        node = int(a) if int(b) == node else int(b)
    out.reverse()
    return out
