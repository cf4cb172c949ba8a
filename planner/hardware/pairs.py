"""Costs and routes of device pairs, derived on demand (docs/devices.md, "Routes at scale").

`PairCosts` answers, for index arrays i and j (broadcast against each other), the seconds
per byte of the route from device i to device j (1 / its bottleneck bandwidth), its latency
and its hops, and a route's links, from one of three sources:

- a small graph (at most `DENSE_DEVICES` devices): every route derived at the first query
  (`routing.route_trees`) and kept in D x D tables, as every graph was before;
- a graph whose route costs depend only on the level at which two devices' groups part
  (`Levels`, proven once by `planner.hardware.hierarchy`): a pair's costs are looked up by
  that level, with no route derived;
- any other: the shortest-path tree of each pair's lower device (its routes are the
  pair's), derived for the sources a query needs, a chunk of neighbouring sources at a time,
  and kept in one cache shared by every graph (`ROW_CACHE_BYTES`, least recently used
  first out).

All three give the same numbers, bit for bit: the tables and the trees are the same
computation, and `Levels` are only used where they are proven equal (tests compare them on
presets and random graphs).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from planner.hardware.routing import RouteGraph, RouteTrees, route_trees, walk

__all__ = ["DENSE_DEVICES", "ROW_CACHE_BYTES", "Levels", "PairCosts", "shared_levels"]

DENSE_DEVICES = 256  # up to here, every route at the first query, in D x D tables
ROW_CACHE_BYTES = 256 * 2**20  # trees kept after a query, every graph's together
_TOKENS = itertools.count()


@dataclass(frozen=True)
class Levels:
    """Route costs by level: devices i and j share `shared(i, j)` levels of groups (groups of
    `blocks[l]` consecutive devices, coarsest first, the last of one device), and their route
    costs `inv_bandwidth[shared]` seconds per byte, `latency[shared]` seconds and
    `hops[shared]` links (the last entries, for i == j: 0; hops None when a level's routes
    differ in hops)."""

    blocks: tuple[int, ...]
    inv_bandwidth: np.ndarray
    latency: np.ndarray
    hops: np.ndarray | None

    def shared(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        return shared_levels(self.blocks, i, j)

    def shared_one(self, i: int, j: int) -> int:
        return sum(1 for b in self.blocks if i // b == j // b)


def shared_levels(blocks: Sequence[int], i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Levels of groups (of `blocks` consecutive devices each) devices i and j share."""
    out = np.zeros(np.broadcast(i, j).shape, dtype=np.int64)
    for b in blocks:
        out += (i // b) == (j // b)
    return out


@dataclass(frozen=True)
class _Row:
    """Routes from one source device: its tree's parent links, and to every device the
    route's hops, seconds per byte and latency (read for devices after the source)."""

    parent: np.ndarray
    hops: np.ndarray
    inv_bandwidth: np.ndarray
    latency: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.parent, self.hops, self.inv_bandwidth, self.latency))


class _RowCache:
    """Trees of every graph's sources, least recently used out first, within a byte budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.rows: OrderedDict[tuple[int, int], _Row] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def get(self, key: tuple[int, int]) -> _Row | None:
        with self.lock:
            row = self.rows.get(key)
            if row is not None:
                self.rows.move_to_end(key)
            return row

    def put(self, key: tuple[int, int], row: _Row) -> None:
        with self.lock:
            if key in self.rows:
                return
            self.rows[key] = row
            self.bytes += row.nbytes
            while self.bytes > self.budget and len(self.rows) > 1:
                _, old = self.rows.popitem(last=False)
                self.bytes -= old.nbytes


ROWS = _RowCache(ROW_CACHE_BYTES)


class PairCosts:
    """Route costs and routes between the devices of one `RouteGraph` (see the module
    docstring). `levels` is set once a hierarchy of the route costs is proven."""

    def __init__(self, graph: RouteGraph) -> None:
        self.graph = graph
        self.levels: Levels | None = None
        self._tables: RouteTrees | None = None
        self._token = next(_TOKENS)

    @property
    def num_devices(self) -> int:
        return self.graph.num_devices

    @property
    def small(self) -> bool:
        """Whether every route is derived at once and kept in D x D tables."""
        return self.num_devices <= DENSE_DEVICES

    def tables(self) -> RouteTrees:
        """The D x D tables of a small graph (derived at the first call)."""
        if self._tables is None:
            self._tables = route_trees(self.graph)
        return self._tables

    # -- costs ----------------------------------------------------------------------------

    def costs(self, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(seconds per byte, latency) of the routes i -> j, shaped as i and j broadcast."""
        i, j = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)
        if self.small:
            t = self.tables()
            return t.inv_bandwidth[i, j], t.latency[i, j]
        if self.levels is not None:
            shared = self.levels.shared(i, j)
            return self.levels.inv_bandwidth[shared], self.levels.latency[shared]
        inv, lat, _ = self._from_rows(i, j)
        return inv, lat

    def hops(self, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Links on the routes i -> j, shaped as i and j broadcast."""
        i, j = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)
        if self.small:
            return self.tables().hops[i, j]
        if self.levels is not None and self.levels.hops is not None:
            return self.levels.hops[self.levels.shared(i, j)]
        return self._from_rows(i, j)[2]

    def pair(self, i: int, j: int) -> tuple[float, float]:
        """(seconds per byte, latency) of the route i -> j, for one pair (no arrays made)."""
        if i == j:
            return 0.0, 0.0
        if self.small:
            t = self.tables()
            return float(t.inv_bandwidth[i, j]), float(t.latency[i, j])
        if self.levels is not None:
            k = self.levels.shared_one(i, j)
            return float(self.levels.inv_bandwidth[k]), float(self.levels.latency[k])
        row = self.row(min(i, j))
        b = max(i, j)
        return float(row.inv_bandwidth[b]), float(row.latency[b])

    def route(self, i: int, j: int) -> list[int]:
        """Link indices from device i to device j (i < j), in path order."""
        if self.small:
            return walk(self.tables().parent_link[i], self.graph.ends, i, j)
        return walk(self.row(i).parent, self.graph.ends, i, j)

    # -- trees ----------------------------------------------------------------------------

    def row(self, source: int, neighbours: bool = True) -> _Row:
        """The routes from device `source` (cached; derived with its chunk's neighbours
        unless `neighbours` is False)."""
        found = ROWS.get((self._token, source))
        if found is not None:
            return found
        if not neighbours:
            return dict(self._derive([source]))[source]
        return dict(self.rows(np.array([source])))[source]

    def rows(self, sources: np.ndarray) -> Iterator[tuple[int, _Row]]:
        """(source, routes) for each of `sources` (distinct device indices < D - 1), cached
        ones first, the rest derived a chunk at a time with the uncached neighbours of the
        chunk (the next queries tend to ask for them)."""
        missing = []
        for s in sources.tolist():
            row = ROWS.get((self._token, s))
            if row is None:
                missing.append(s)
            else:
                yield s, row
        if not missing:
            return
        yield from self._derive(self._with_neighbours(missing))

    def _with_neighbours(self, missing: Sequence[int]) -> list[int]:
        """`missing` and, up to a chunk each, the uncached sources of their aligned chunks."""
        chunk = self._chunk()
        out = set(missing)
        if len(missing) < chunk:
            for lo in {s // chunk * chunk for s in missing}:
                for s in range(lo, min(lo + chunk, self.num_devices - 1)):
                    if s not in out and ROWS.get((self._token, s)) is None:
                        out.add(s)
        wanted = set(missing)
        return sorted(out, key=lambda s: (s not in wanted, s))

    def _chunk(self) -> int:
        """Sources derived together: the routing chunk, within a quarter of the cache."""
        D, V = self.num_devices, self.graph.num_nodes
        per_row = 4 * V + 20 * D
        return max(1, min(self.graph.chunk, ROW_CACHE_BYTES // 4 // per_row))

    def _derive(self, sources: list[int]) -> Iterator[tuple[int, _Row]]:
        step = self._chunk()
        for lo in range(0, len(sources), step):
            part = np.array(sorted(sources[lo : lo + step]), dtype=np.int64)
            trees = self.graph.trees(part)
            with np.errstate(divide="ignore"):
                inv = 1.0 / trees.min_bandwidth
            for k, s in enumerate(part.tolist()):
                row = _Row(trees.parent_link[k], trees.hops[k], inv[k], trees.latency[k])
                for array in (row.parent, row.hops, row.inv_bandwidth, row.latency):
                    array.setflags(write=False)
                ROWS.put((self._token, s), row)
                yield s, row

    def _from_rows(self, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seconds per byte, latency, hops) of i -> j from the lower device's tree."""
        i, j = np.broadcast_arrays(i, j)
        shape = i.shape
        a, b = np.minimum(i, j).ravel(), np.maximum(i, j).ravel()
        inv, lat = np.zeros(a.shape), np.zeros(a.shape)
        hops = np.zeros(a.shape, dtype=np.int32)
        off = np.flatnonzero(a != b)
        if len(off):
            sources, where = np.unique(a[off], return_inverse=True)
            order = np.argsort(where, kind="stable")
            bounds = np.searchsorted(where[order], np.arange(len(sources) + 1))
            for s, row in self.rows(sources):
                k = int(np.searchsorted(sources, s))
                if k == len(sources) or sources[k] != s:
                    continue  # a neighbour derived with the chunk
                mine = off[order[bounds[k] : bounds[k + 1]]]
                inv[mine] = row.inv_bandwidth[b[mine]]
                lat[mine] = row.latency[b[mine]]
                hops[mine] = row.hops[b[mine]]
        return inv.reshape(shape), lat.reshape(shape), hops.reshape(shape)
