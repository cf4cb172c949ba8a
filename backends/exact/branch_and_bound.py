"""Exact search over pairwise cost tables: depth-first branch and bound, and A*.

Shared by the `search` backend (on a whole problem) and the `elimination` backend (on the
final graph its eliminations leave). Minimizes

    sum_i node_cost[i][c_i] + sum_(u,v) edge_cost[u,v][c_u, c_v]

over one choice per node, optionally under the liveness memory rule of the cost-table format.

Nodes are assigned in a fixed order. The admissible bound charges every edge to its later
endpoint: an unassigned node i costs at least min_c acc_i[c], where acc_i[c] = node cost +
the exact cost of edges from assigned neighbours + the column minimum of edges from
unassigned earlier neighbours. Assigning a node replaces those column minima by exact rows,
so the bound only grows along a path (consistent). Children are tried cheapest first, so the
first dive is a greedy solution. With a memory limit, unassigned nodes count with their
smallest usage, so a partial assignment whose live usage already exceeds the limit is cut.

A relative gap `tolerance` (`SolveOptions.gap_tolerance`) prunes every subtree whose bound
is within it of the incumbent (bound * (1 + tolerance) >= incumbent), as MIP solvers do:
the search then proves the incumbent within the tolerance of the optimum, and the bound it
returns is the least bound of a subtree pruned so (the incumbent's value when none was),
a proven lower bound on the optimum. Tolerance 0 is the exact search.
"""

from __future__ import annotations

import heapq
import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.base import ProgressLog, past

CHECK_EVERY = 256  # expansions between two looks at the clock
# Seconds an exact search gets even when its deadline has (nearly) passed: a proof of a
# few milliseconds finishes instead of stopping at the first look (`Deadline.at_least`).
EXACT_GRACE = 0.1


@dataclass(frozen=True)
class Memory:
    usage: Sequence[np.ndarray]  # (C_i, M) per node
    intervals: np.ndarray  # (n, 2) [start, end)
    limit: np.ndarray  # (M,)


@dataclass
class Outcome:
    choices: tuple[int, ...] | None
    value: float
    complete: bool  # the whole tree was searched (so `choices` is optimal, or none exists)
    bound: float  # a proven lower bound on the optimum
    expanded: int


class _Search:
    def __init__(
        self,
        node_cost: Sequence[np.ndarray],
        edges: Sequence[tuple[int, int, np.ndarray]],
        order: Sequence[int] | None,
        memory: Memory | None,
        deadline: float,
        lookahead: bool = True,
        progress: ProgressLog | None = None,
        tolerance: float = 0.0,
    ):
        n = len(node_cost)
        self.shrink = 1.0 / (1.0 + tolerance)  # a subtree must beat incumbent * shrink
        self.pruned_low = math.inf  # the least bound of a subtree the tolerance pruned
        self.order = list(order) if order is not None else list(range(n))
        pos = {node: k for k, node in enumerate(self.order)}
        self.node_cost = [np.asarray(c, dtype=np.float64) for c in node_cost]
        # forward[a]: (b, diff) for edges to later neighbours b, where diff[c_a] is what
        # assigning c_a adds to acc_b: the exact row minus the column minimum already in acc_b
        # (0 where that minimum is inf: acc_b is inf there already).
        self.forward: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        self.base = [c.copy() for c in self.node_cost]
        # Tables shared between edges (a Problem shares identical ones) share their diff.
        seen: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for u, v, t in edges:
            flip = pos[u] > pos[v]
            a, b = (v, u) if flip else (u, v)
            key = (id(t), flip)
            if key not in seen:
                rows = t.T if flip else t
                colmin = rows.min(axis=0)
                with np.errstate(invalid="ignore"):
                    diff = rows - colmin[None, :]
                diff[:, np.isinf(colmin)] = 0.0
                if not lookahead:  # plain DFS: only assigned nodes and edges count
                    colmin = np.zeros_like(colmin)
                    diff = rows
                seen[key] = (t, colmin, diff)  # t: keeps the id from being reused
            _, colmin, diff = seen[key]
            self.forward[a].append((b, diff))
            self.base[b] = self.base[b] + colmin
        self.deadline = deadline
        self.progress = progress
        self.best_value = math.inf
        self.expanded = 0
        self.timed_out = False
        self.memory = memory
        if memory is not None:
            starts = np.unique(memory.intervals[:, 0])
            lo, hi = memory.intervals[:, 0], memory.intervals[:, 1]
            self.live = ((lo[None, :] <= starts[:, None]) & (starts[:, None] < hi[None, :])).T
            self.min_use = [u.min(axis=0) for u in memory.usage]
            self.extra = [
                np.asarray(u) - m for u, m in zip(memory.usage, self.min_use, strict=True)
            ]
            floor = sum(
                (np.outer(self.live[i], self.min_use[i]) for i in range(n)),
                np.zeros((len(starts), len(memory.limit))),
            )
            self.floor = floor
            self.limit = np.asarray(memory.limit, dtype=np.float64) * (1 + 1e-9)

        self.lookahead = lookahead

    def root_bound(self) -> float:
        return float(sum(c.min() for c in self.base))

    def _beats(self, low: float) -> bool:
        """Whether a subtree of lower bound `low` is searched: below the incumbent by more
        than the tolerance; when only the tolerance prunes it, its bound is remembered."""
        if low < self.best_value * self.shrink:
            return True
        if low < self.best_value:
            self.pruned_low = min(self.pruned_low, low)
        return False

    def proven_bound(self) -> float:
        """After a complete search: the least bound of what was not searched."""
        return min(self.best_value, self.pruned_low)

    def _out_of_time(self, every: int = CHECK_EVERY) -> bool:
        self.expanded += 1
        if self.expanded % every == 0:
            if past(self.deadline):
                self.timed_out = True
            if self.progress is not None:
                self.progress(
                    lambda: f"{self.expanded} nodes expanded, best so far {self.best_value:.6g}"
                )
        return self.timed_out

    def greedy(self) -> tuple[tuple[int, ...], float] | None:
        """One dive, each node taking its cheapest config given the ones before it (the
        first leaf of the DFS): an incumbent in O(table entries), whatever the deadline."""
        acc = [c.copy() for c in self.base]
        choice = [0] * len(self.order)
        total = 0.0
        for a in self.order:
            c = int(np.argmin(acc[a]))
            if not math.isfinite(acc[a][c]):
                return None
            choice[a] = c
            total += float(acc[a][c])  # exact: every earlier neighbour is assigned
            for b, diff in self.forward[a]:
                acc[b] = acc[b] + diff[c]
        return tuple(choice), total

    # -- depth-first branch and bound -----------------------------------------------------

    def dfs(self, best_value: float, best: tuple[int, ...] | None) -> Outcome:
        n = len(self.order)
        acc = [c.copy() for c in self.base]
        mins = np.array([c.min() for c in acc])
        choice = [0] * n
        self.best_value, self.best = best_value, best
        use = self.floor.copy() if self.memory is not None else None
        sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * n + 100))

        def visit(depth: int, g: float, h: float) -> None:
            if depth == n:
                if g < self.best_value:
                    self.best_value = g
                    self.best = tuple(choice)
                return
            if self._out_of_time():
                return
            a = self.order[depth]
            h_rest = h - mins[a] if self.lookahead else 0.0
            row = acc[a]
            for c in np.argsort(row, kind="stable"):
                gc = g + row[c]
                if not self._beats(gc + h_rest):
                    break  # children are sorted: no later c can do better
                if use is not None and not self._fits(use, a, c):
                    continue
                delta = 0.0
                saved = []
                for b, diff in self.forward[a]:
                    saved.append((b, acc[b], mins[b]))
                    acc[b] = acc[b] + diff[c]
                    if self.lookahead:
                        new_min = acc[b].min()
                        delta = math.inf if new_min == math.inf else delta + new_min - mins[b]
                        mins[b] = new_min
                if self._beats(gc + h_rest + delta):
                    choice[a] = int(c)
                    visit(depth + 1, gc, h_rest + delta)
                for b, row_b, min_b in reversed(saved):  # parallel edges: undo in order
                    acc[b], mins[b] = row_b, min_b
                if use is not None:
                    self._release(use, a, c)
                if self.timed_out:
                    return

        root = float(mins.sum())
        if self.lookahead and root == math.inf:
            # a node with no finite choice (every one forbidden, or forbidden with every
            # partner): nothing to search, and inf - inf in the bound would be NaN
            return Outcome(self.best, self.best_value, True, self.best_value, self.expanded)
        visit(0, 0.0, root if self.lookahead else 0.0)
        complete = not self.timed_out
        bound = self.proven_bound() if complete else self.root_bound()
        return Outcome(self.best, self.best_value, complete, bound, self.expanded)

    def _fits(self, use: np.ndarray, a: int, c: int) -> bool:
        """Charge node a's choice c to the live usage if it stays within the limit."""
        use += np.outer(self.live[a], self.extra[a][c])
        if (use <= self.limit).all():
            return True
        self._release(use, a, c)
        return False

    def _release(self, use: np.ndarray, a: int, c: int) -> None:
        use -= np.outer(self.live[a], self.extra[a][c])

    # -- A* -------------------------------------------------------------------------------

    def astar(self, best_value: float, best: tuple[int, ...] | None) -> Outcome:
        """Best-first over partial assignments (priority, counter, ...): small problems."""
        n = len(self.order)
        counter = itertools.count()
        heap: list[tuple[float, int, float, tuple[int, ...]]] = []
        heapq.heappush(heap, (self.root_bound(), next(counter), 0.0, ()))
        bound = self.root_bound()
        while heap:
            f, _, g, partial = heapq.heappop(heap)
            bound = f
            if f >= best_value * self.shrink:  # every open node within the tolerance
                return Outcome(best, best_value, True, min(f, best_value), self.expanded)
            if len(partial) == n:
                return Outcome(self._reorder(partial), g, True, g, self.expanded)
            self.best_value = best_value
            if self._out_of_time(every=1):  # an A* expansion is costly: look every time
                return Outcome(best, best_value, False, min(bound, best_value), self.expanded)
            acc, use = self._state(partial)
            depth = len(partial)
            a = self.order[depth]
            for c in range(len(acc[a])):
                gc = g + acc[a][c]
                if not math.isfinite(gc):
                    continue
                if use is not None and not self._fits(use.copy(), a, c):
                    continue
                child = (*partial, c)
                h = self._h(acc, a, c, depth)
                heapq.heappush(heap, (gc + h, next(counter), gc, child))
        return Outcome(best, best_value, True, best_value, self.expanded)

    def _state(self, partial: tuple[int, ...]) -> tuple[list[np.ndarray], np.ndarray | None]:
        acc = [c.copy() for c in self.base]
        use = self.floor.copy() if self.memory is not None else None
        for node, c in zip(self.order, partial, strict=False):
            for b, diff in self.forward[node]:
                acc[b] = acc[b] + diff[c]
            if use is not None:
                use += np.outer(self.live[node], self.extra[node][c])
        return acc, use

    def _h(self, acc: list[np.ndarray], a: int, c: int, depth: int) -> float:
        changed = {b: diff[c] for b, diff in self.forward[a]}
        total = 0.0
        for node in self.order[depth + 1 :]:
            row = acc[node] + changed[node] if node in changed else acc[node]
            total += float(row.min())
        return total

    def _reorder(self, partial: tuple[int, ...]) -> tuple[int, ...]:
        out = [0] * len(self.order)
        for node, c in zip(self.order, partial, strict=True):
            out[node] = c
        return tuple(out)


def solve_exact(
    node_cost: Sequence[np.ndarray],
    edges: Sequence[tuple[int, int, np.ndarray]],
    deadline: float,
    memory: Memory | None = None,
    incumbent: tuple[tuple[int, ...], float] | None = None,
    order: Sequence[int] | None = None,
    mode: str = "dfs",
    progress: ProgressLog | None = None,
    tolerance: float = 0.0,
) -> Outcome:
    """Minimize node + edge costs exactly (within the relative gap `tolerance`: the module
    docstring) until `deadline` (a `time.perf_counter()` value; then best-so-far).

    mode: "dfs" (branch and bound with the admissible bound), "astar", or "plain" (the
    depth-first search OptCNN compares against: pruned only by the cost so far)."""
    search = _Search(
        node_cost,
        edges,
        order,
        memory,
        deadline,
        lookahead=mode != "plain",
        progress=progress,
        tolerance=tolerance,
    )
    if incumbent is None and memory is None:  # anytime: an answer even at a tiny limit
        incumbent = search.greedy()
    best, value = (incumbent[0], incumbent[1]) if incumbent else (None, math.inf)
    if mode == "astar":
        return search.astar(value, best)
    return search.dfs(value, best)
