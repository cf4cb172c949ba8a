"""Shortest routes between every pair of devices of a hardware graph, vectorized over sources.

A route minimises the sum of its links' integer weights (`Link.route_weight`); ties go to
fewer hops, then to the lexicographically smaller sequence of node names from the source
(docs/devices.md, "Routing rule"). This module computes, for every source device at once:

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

Only the tree (one parent link per source and node) is kept; `route_links` walks it on
demand. Memory is O(devices x nodes); sources are processed in chunks so the (sources x
links) temporaries stay small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

__all__ = ["RouteTrees", "route_trees", "walk"]

_INF = np.iinfo(np.int64).max // 4
CHUNK_ENTRIES = 1 << 21  # sources x directed links per chunk


@dataclass(frozen=True)
class RouteTrees:
    """Shortest-path trees from devices 0..D-2 (node index: devices first, then switches).

    parent_link[i, v]: link index into node v on the route from device i (-1 at the root and
    for devices before i, whose routes are read from their own tree). hops, inv_bandwidth,
    latency: (D, D), symmetric (the route j -> i is the route i -> j reversed)."""

    parent_link: np.ndarray
    hops: np.ndarray
    inv_bandwidth: np.ndarray
    latency: np.ndarray
    unreachable: tuple[int, int] | None  # the first (i, j), i < j, with no route


def route_trees(
    names: Sequence[str],
    num_devices: int,
    link_ends: Sequence[tuple[int, int]],
    link_weight: Sequence[int],
    link_bandwidth: Sequence[float],
    link_latency: Sequence[float],
) -> RouteTrees:
    """Routes on the graph of `names` (devices first) joined by the links `link_ends`
    (node index pairs) with integer routing weights >= 1. Parallel links: the lightest
    (lowest index on a tie) carries the routes."""
    V, D = len(names), num_devices
    best: dict[tuple[int, int], tuple[int, int]] = {}
    for index, ((a, b), w) in enumerate(zip(link_ends, link_weight, strict=True)):
        pair = (min(a, b), max(a, b))
        if pair not in best or (w, index) < best[pair]:
            best[pair] = (w, index)
    chosen = np.array(sorted(index for _, index in best.values()), dtype=np.int64)
    ends = np.array(link_ends, dtype=np.int64).reshape(-1, 2)[chosen]
    # Directed edges, both ways, sorted by head node (for per-head reductions).
    tail = np.concatenate([ends[:, 0], ends[:, 1]])
    head = np.concatenate([ends[:, 1], ends[:, 0]])
    link = np.concatenate([chosen, chosen])
    order = np.lexsort((tail, head))
    tail, head, link = tail[order], head[order], link[order]
    weight = np.asarray(link_weight, dtype=np.int64)[link]
    bandwidth = np.asarray(link_bandwidth, dtype=np.float64)
    latency = np.asarray(link_latency, dtype=np.float64)
    name_rank = np.empty(V, dtype=np.int64)
    name_rank[np.argsort(np.array(names, dtype=object), kind="stable")] = np.arange(V)

    parent = np.full((max(D - 1, 0), V), -1, dtype=np.int32)
    hops = np.zeros((D, D), dtype=np.int32)
    min_bw = np.full((D, D), np.inf)
    lat = np.zeros((D, D))
    step = max(1, CHUNK_ENTRIES // max(1, len(tail)))
    for lo in range(0, D - 1, step):
        sources = np.arange(lo, min(D - 1, lo + step))
        dist, level = _distances(sources, V, tail, head, weight)
        tree, bottleneck, summed = _tree(
            sources, dist, level, tail, head, link, weight, name_rank, bandwidth, latency
        )
        parent[sources] = tree
        hops[sources] = level[:, :D]
        min_bw[sources] = bottleneck[:, :D]
        lat[sources] = summed[:, :D]
    unreachable = _first_unreachable(hops, D)
    upper = np.triu(np.ones((D, D), dtype=bool), 1)
    hops = np.where(upper, hops, hops.T)
    with np.errstate(divide="ignore"):
        inv_bw = np.where(upper, 1.0 / min_bw, (1.0 / min_bw).T)
    lat = np.where(upper, lat, lat.T)
    np.fill_diagonal(inv_bw, 0.0)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(hops, 0)
    trees = RouteTrees(parent, hops, inv_bw, lat, unreachable)
    _sum_long_routes(trees, link_ends, latency)
    for array in (parent, hops, inv_bw, lat):
        array.setflags(write=False)
    return trees


def _distances(
    sources: np.ndarray, V: int, tail: np.ndarray, head: np.ndarray, weight: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Jacobi Bellman-Ford from each source: (S, V) distances and fewest hops (-1: none)."""
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


def _tree(
    sources: np.ndarray,
    dist: np.ndarray,
    level: np.ndarray,
    tail: np.ndarray,
    head: np.ndarray,
    link: np.ndarray,
    weight: np.ndarray,
    name_rank: np.ndarray,
    bandwidth: np.ndarray,
    latency: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parent link per (source, node), bottleneck bandwidth and summed latency of each route."""
    S, V = dist.shape
    rows = np.arange(S)
    parent = np.full((S, V), -1, dtype=np.int32)
    min_bw = np.full((S, V), np.inf)
    lat = np.zeros((S, V))
    rank = np.full((S, V), -1, dtype=np.int64)
    rank[rows, sources] = 0
    # Candidate (source, edge) pairs: the edge ends a cheapest route with the fewest hops.
    lt, lh = level[:, tail], level[:, head]
    tight = (lt >= 0) & (lh == lt + 1) & (dist[:, tail] + weight[None, :] == dist[:, head])
    s_all, e_all = np.nonzero(tight)
    by_level = np.argsort(lh[s_all, e_all], kind="stable")
    s_all, e_all = s_all[by_level], e_all[by_level]
    bounds = np.searchsorted(lh[s_all, e_all], np.arange(1, int(level.max()) + 2))
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


def _first_unreachable(hops_rows: np.ndarray, D: int) -> tuple[int, int] | None:
    for i in range(D - 1):
        missing = np.flatnonzero(hops_rows[i, i + 1 :] < 0)
        if len(missing):
            return i, i + 1 + int(missing[0])
    return None


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


def _sum_long_routes(
    trees: RouteTrees, link_ends: Sequence[tuple[int, int]], latency: np.ndarray
) -> None:
    """Latencies of routes of 8 hops or more, summed with numpy's sum over the route (its
    pairwise summation groups terms differently from the running sum along the tree)."""
    if trees.unreachable is not None:
        return
    ends = np.array(link_ends, dtype=np.int64).reshape(-1, 2)
    for i, j in zip(*np.nonzero(np.triu(trees.hops >= 8, 1)), strict=True):
        route = walk(trees.parent_link[i], ends, int(i), int(j))
        trees.latency[i, j] = trees.latency[j, i] = latency[route].sum()
