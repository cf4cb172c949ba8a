"""`elimination`: OptCNN's graph-search dynamic programming (Jia et al. 2018, Sec. 5.2).

Algorithm 1 of the paper, on the problem's cost tables seen as an undirected graph (the cost
of an edge only depends on the configs at its two ends, whichever way the tensor flows):

- node elimination (Eq. 2): a node j with two neighbours i and k is replaced by an edge
  whose cost is t(i, k)[c_i, c_k] = min_{c_j} t(i, j)[c_i, c_j] + cost_j[c_j] + t(j, k)[c_j, c_k]
  (Theorem 1: an optimal strategy of the smaller graph extends to one of the larger);
- edge elimination (Eq. 3): parallel edges between the same two nodes merge into one whose
  cost is their sum (Theorem 2);
- we add the degenerate node elimination the paper's graphs did not need: a node j with a
  single neighbour i folds into i's cost, cost_i[c_i] += min_{c_j} t(i, j)[c_i, c_j] + cost_j[c_j].

Eliminations run until none applies; the final graph (K nodes; K <= 1 for the zoo's CNNs,
whose graphs are series-parallel) is solved exactly by branch and bound
(`backends.branch_and_bound`) within the time limit, and the eliminations are undone in
reverse order, each choosing the eliminated node's best config given its neighbours'
(Algorithm 1, lines "undo"). The min-plus product of Eq. 2, O(C^3), is vectorized in chunks.

Exact for the additive objective (OptCNN Eq. 1). A memory limit is not separable over the
eliminations, so `can_run` refuses problems with one (use `search`).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from backends.base import Backend, Limit, SolveOptions, SolveResult, Status
from backends.branch_and_bound import solve_exact
from planner.problems.problem import Problem

CHUNK_ELEMENTS = 1 << 21  # elements of one broadcast block in the min-plus product


def min_plus(a: np.ndarray, mid: np.ndarray, b: np.ndarray) -> np.ndarray:
    """out[i, k] = min_j a[i, j] + mid[j] + b[j, k]  (OptCNN Eq. 2), chunked over rows of a."""
    left = a + mid[None, :]
    rows = max(1, CHUNK_ELEMENTS // max(1, b.size))
    out = np.empty((a.shape[0], b.shape[1]))
    for r in range(0, a.shape[0], rows):
        out[r : r + rows] = (left[r : r + rows, :, None] + b[None, :, :]).min(axis=1)
    return out


@dataclass
class _Graph:
    """The problem's tables as an undirected graph that eliminations shrink."""

    cost: dict[int, np.ndarray]
    nbrs: dict[int, set[int]]
    table: dict[tuple[int, int], np.ndarray]  # key (a, b) with a < b, oriented [c_a, c_b]
    log: list[tuple] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"node": 0, "leaf": 0, "edge": 0})

    @classmethod
    def of(cls, problem: Problem) -> _Graph:
        g = cls({i: c.copy() for i, c in enumerate(problem.node_cost)}, {}, {})
        for i in range(problem.num_nodes):
            g.nbrs[i] = set()
        for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True):
            g.add_edge(u, v, t)
        return g

    def oriented(self, a: int, b: int) -> np.ndarray:
        return self.table[(a, b)] if a < b else self.table[(b, a)].T

    def add_edge(self, a: int, b: int, t: np.ndarray) -> None:
        key, t = ((a, b), t) if a < b else ((b, a), t.T)
        if key in self.table:  # edge elimination, Eq. 3
            self.table[key] = self.table[key] + t
            self.counts["edge"] += 1
        else:
            self.table[key] = t
            self.nbrs[a].add(b)
            self.nbrs[b].add(a)

    def remove(self, j: int) -> None:
        for i in self.nbrs.pop(j):
            self.nbrs[i].discard(j)
            self.table.pop((min(i, j), max(i, j)))
        del self.cost[j]

    def eliminate(self) -> None:
        heap = [j for j in self.nbrs if len(self.nbrs[j]) <= 2]
        heapq.heapify(heap)
        while heap:
            j = heapq.heappop(heap)
            if j not in self.nbrs or not 1 <= len(self.nbrs[j]) <= 2:
                continue
            touched = sorted(self.nbrs[j])
            if len(touched) == 1:
                self._leaf(j, touched[0])
            else:
                self._series(j, *touched)
            for i in touched:
                if len(self.nbrs[i]) <= 2:
                    heapq.heappush(heap, i)

    def _leaf(self, j: int, i: int) -> None:
        t_ij, cost_j = self.oriented(i, j), self.cost[j]
        self.cost[i] = self.cost[i] + (t_ij + cost_j[None, :]).min(axis=1)
        self.log.append(("leaf", j, i, t_ij, cost_j))
        self.counts["leaf"] += 1
        self.remove(j)

    def _series(self, j: int, i: int, k: int) -> None:
        t_ij, t_jk, cost_j = self.oriented(i, j), self.oriented(j, k), self.cost[j]
        self.log.append(("node", j, i, k, t_ij, cost_j, t_jk))
        self.counts["node"] += 1
        self.remove(j)
        self.add_edge(i, k, min_plus(t_ij, cost_j, t_jk))

    def undo(self, choice: dict[int, int]) -> None:
        """Choose each eliminated node's config given its neighbours' (reverse order)."""
        for entry in reversed(self.log):
            if entry[0] == "leaf":
                _, j, i, t_ij, cost_j = entry
                choice[j] = int(np.argmin(t_ij[choice[i]] + cost_j))
            else:
                _, j, i, k, t_ij, cost_j, t_jk = entry
                choice[j] = int(np.argmin(t_ij[choice[i]] + cost_j + t_jk[:, choice[k]]))


class EliminationBackend(Backend):
    name = "elimination"
    objectives = ("additive",)
    exact = True

    def can_run(self, problem: Problem, options: SolveOptions) -> str | None:
        reason = super().can_run(problem, options)
        if reason is None and problem.usage_limit is not None:
            reason = (
                "elimination's dynamic programming cannot enforce a memory limit exactly "
                "(OptCNN Algorithm 1 has none): use the search, ilp or cpsat backend"
            )
        return reason

    def _solve(self, problem: Problem, options: SolveOptions) -> SolveResult:
        start = time.perf_counter()
        g = _Graph.of(problem)
        g.eliminate()
        t_elim = time.perf_counter() - start
        final = sorted(g.cost)
        index = {node: k for k, node in enumerate(final)}
        edges = [(index[a], index[b], t) for (a, b), t in g.table.items()]
        budget = max(1e-3, options.time_limit - t_elim)
        out = solve_exact([g.cost[n] for n in final], edges, budget)
        stats = {
            "final_nodes": len(final),
            "final_edges": len(edges),
            "node_eliminations": g.counts["node"],
            "leaf_eliminations": g.counts["leaf"],
            "edge_eliminations": g.counts["edge"],
            "eliminate_seconds": t_elim,
            "final_expanded": out.expanded,
        }
        if out.choices is None:
            status = Status.INFEASIBLE if out.complete else Status.NO_SOLUTION
            limit = None if out.complete else Limit.TIME
            return SolveResult(self.name, status, bound=out.bound, limit=limit, stats=stats)
        choice = {node: out.choices[index[node]] for node in final}
        g.undo(choice)
        choices = tuple(choice[i] for i in range(problem.num_nodes))
        if out.complete:
            return SolveResult(self.name, Status.OPTIMAL, choices, bound=out.value, stats=stats)
        bound = out.bound if math.isfinite(out.bound) else None
        return SolveResult(
            self.name, Status.FEASIBLE, choices, bound=bound, limit=Limit.TIME, stats=stats
        )
