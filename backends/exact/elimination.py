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
whose graphs are series-parallel) is solved exactly (within `SolveOptions.gap_tolerance`) by
branch and bound (`backends.exact.branch_and_bound`) within the time limit, and the
eliminations are undone in reverse order, each choosing the eliminated node's best config
given its neighbours' (Algorithm 1, lines "undo"): the eliminations are exact, so the
answer's gap is the final graph's.

At scale. The min-plus product of Eq. 2 is pruned by bounds (`backends.exact.minplus`, exact).
An elimination is a pure function of its input tables, and a Problem shares one read-only
array between identical ops and edges, so repeated blocks (ResNet bottlenecks, Transformer
layers) feed the same array objects to their eliminations: results are memoized by the
identity of their inputs (the memo holds the inputs, so an id is never reused while its
entry lives) and every repeat of a block costs a dictionary lookup. Node costs are never
copied for the same reason. Products check the clock between row chunks: when the time
limit passes during the eliminations, the graph reduced so far is handed to branch and
bound, whose greedy dive gives an answer and whose root bound is a valid lower bound (the
reduced graph has the original optimum), so the result is FEASIBLE with limit TIME.

Exact for the additive objective (OptCNN Eq. 1). A memory limit is not separable over the
eliminations, so `can_run` refuses problems with one (use `search`). No settings
(`EliminationSettings`).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backends.base import (
    Backend,
    BackendSettings,
    Limit,
    ProgressLog,
    SolveOptions,
    SolveResult,
    Status,
    past,
)
from backends.exact.branch_and_bound import EXACT_GRACE, solve_exact
from backends.exact.minplus import OutOfTime, min_plus
from planner.problems.problem import Problem

__all__ = ["EliminationBackend", "EliminationSettings", "min_plus"]

# A table as stored: (array, flipped); the oriented [c_a, c_b] table of key (a, b), a < b,
# is the array, or its transpose when flipped (no new view objects: identities stay stable).
Stored = tuple[np.ndarray, bool]


def _view(stored: Stored) -> np.ndarray:
    array, flipped = stored
    return array.T if flipped else array


@dataclass
class _Memo:
    """Results of eliminations keyed by the identities of their inputs (kept alive here)."""

    entries: dict[tuple[Any, ...], tuple[tuple[Any, ...], np.ndarray]] = field(default_factory=dict)
    hits: int = 0

    def get(self, key: tuple[Any, ...]) -> np.ndarray | None:
        found = self.entries.get(key)
        if found is None:
            return None
        self.hits += 1
        return found[1]

    def put(self, key: tuple[Any, ...], inputs: tuple[Any, ...], out: np.ndarray) -> np.ndarray:
        out.setflags(write=False)
        self.entries[key] = (inputs, out)
        return out


@dataclass
class _Graph:
    """The problem's tables as an undirected graph that eliminations shrink."""

    cost: dict[int, np.ndarray]
    nbrs: dict[int, set[int]]
    table: dict[tuple[int, int], Stored]  # key (a, b) with a < b
    deadline: float = math.inf
    log: list[tuple[Any, ...]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"node": 0, "leaf": 0, "edge": 0})
    memo: _Memo = field(default_factory=_Memo)
    generation: dict[int, int] = field(default_factory=dict)  # id(array) -> depth; inputs 0

    @classmethod
    def of(cls, problem: Problem, deadline: float = math.inf) -> _Graph:
        g = cls(dict(enumerate(problem.node_cost)), {}, {}, deadline)
        for i in range(problem.num_nodes):
            g.nbrs[i] = set()
        for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True):
            g.add_edge(u, v, (t, False))
        return g

    def oriented(self, a: int, b: int) -> Stored:
        """The table of edge (a, b) oriented [c_a, c_b], as (array, flipped)."""
        array, flipped = self.table[(a, b)] if a < b else self.table[(b, a)]
        return (array, flipped) if a < b else (array, not flipped)

    def add_edge(self, a: int, b: int, t: Stored) -> None:
        key, t = ((a, b), t) if a < b else ((b, a), (t[0], not t[1]))
        old = self.table.get(key)
        if old is None:
            self.table[key] = t
            self.nbrs[a].add(b)
            self.nbrs[b].add(a)
            return
        # edge elimination, Eq. 3
        memo_key = ("edge", id(old[0]), old[1], id(t[0]), t[1])
        merged = self.memo.get(memo_key)
        if merged is None:
            merged = self.memo.put(memo_key, (old[0], t[0]), _view(old) + _view(t))
            self._derived(merged, old[0], t[0])
        self.table[key] = (merged, False)
        self.counts["edge"] += 1

    def remove(self, j: int) -> None:
        for i in self.nbrs.pop(j):
            self.nbrs[i].discard(j)
            self.table.pop((min(i, j), max(i, j)))
        del self.cost[j]

    def _derived(self, out: np.ndarray, *inputs: np.ndarray) -> None:
        self.generation[id(out)] = 1 + max(self.generation.get(id(a), 0) for a in inputs)

    def _inputs(self, j: int) -> list[np.ndarray]:
        """The arrays the elimination of j (degree 1 or 2) reads."""
        nbrs = sorted(self.nbrs[j])
        arrays = [self.cost[j], *(self.oriented(j, i)[0] for i in nbrs)]
        return [*arrays, self.cost[nbrs[0]]] if len(nbrs) == 1 else arrays

    def _priority(self, j: int) -> tuple[int, int]:
        return max(self.generation.get(id(a), 0) for a in self._inputs(j)), j

    def eliminate(self, progress: ProgressLog | None = None) -> None:
        """Eliminate while a node of degree 1 or 2 is left (raises OutOfTime at the deadline).

        Order: by generation (how many eliminations made the input tables: 0 for the
        problem's own), then by node index. Identical blocks are then reduced side by side,
        from the same input arrays, before the eliminations sweeping in from the graph's
        ends reach them with tables that are theirs alone: the memo reuses their results."""
        heap = [self._priority(j) for j in self.nbrs if 1 <= len(self.nbrs[j]) <= 2]
        heapq.heapify(heap)
        start = len(self.nbrs)
        while heap:
            gen, j = heapq.heappop(heap)
            if j not in self.nbrs or not 1 <= len(self.nbrs[j]) <= 2:
                continue
            now = self._priority(j)
            if now[0] != gen:  # its tables changed since it was pushed
                heapq.heappush(heap, now)
                continue
            if past(self.deadline):
                raise OutOfTime
            touched = sorted(self.nbrs[j])
            if len(touched) == 1:
                self._leaf(j, touched[0])
            else:
                self._series(j, *touched)
            for i in touched:
                if 1 <= len(self.nbrs[i]) <= 2:
                    heapq.heappush(heap, self._priority(i))
            if progress is not None:
                progress(lambda: self._progress(start))

    def _progress(self, start: int) -> str:
        done = start - len(self.nbrs)
        return (
            f"eliminated {done} of {start} nodes ({self.memo.hits} eliminations reused), "
            f"{len(self.nbrs)} left"
        )

    def _leaf(self, j: int, i: int) -> None:
        t_ij, cost_i, cost_j = self.oriented(i, j), self.cost[i], self.cost[j]
        key = ("leaf", id(cost_i), id(t_ij[0]), t_ij[1], id(cost_j))
        folded = self.memo.get(key)
        if folded is None:
            folded = cost_i + (_view(t_ij) + cost_j[None, :]).min(axis=1)
            folded = self.memo.put(key, (cost_i, t_ij[0], cost_j), folded)
            self._derived(folded, cost_i, t_ij[0], cost_j)
        self.cost[i] = folded
        self.log.append(("leaf", j, i, _view(t_ij), cost_j))
        self.counts["leaf"] += 1
        self.remove(j)

    def _series(self, j: int, i: int, k: int) -> None:
        t_ij, t_jk, cost_j = self.oriented(i, j), self.oriented(j, k), self.cost[j]
        key = ("node", id(t_ij[0]), t_ij[1], id(cost_j), id(t_jk[0]), t_jk[1])
        product = self.memo.get(key)
        if product is None:
            out = min_plus(_view(t_ij), cost_j, _view(t_jk), self.deadline)
            product = self.memo.put(key, (t_ij[0], cost_j, t_jk[0]), out)
            self._derived(product, t_ij[0], cost_j, t_jk[0])
        self.log.append(("node", j, i, k, _view(t_ij), cost_j, _view(t_jk)))
        self.counts["node"] += 1
        self.remove(j)
        self.add_edge(i, k, (product, False))

    def undo(self, choice: dict[int, int]) -> None:
        """Choose each eliminated node's config given its neighbours' (reverse order)."""
        for entry in reversed(self.log):
            if entry[0] == "leaf":
                _, j, i, t_ij, cost_j = entry
                choice[j] = int(np.argmin(t_ij[choice[i]] + cost_j))
            else:
                _, j, i, k, t_ij, cost_j, t_jk = entry
                choice[j] = int(np.argmin(t_ij[choice[i]] + cost_j + t_jk[:, choice[k]]))


@dataclass(frozen=True)
class EliminationSettings(BackendSettings):
    """The `elimination` backend has no settings: the algorithm is exact and has no knobs."""


class EliminationBackend(Backend[EliminationSettings]):
    name = "elimination"
    objectives = ("additive",)
    exact = True
    settings_type = EliminationSettings

    def can_run(self, problem: Problem, options: SolveOptions) -> str | None:
        reason = super().can_run(problem, options)
        if reason is None and problem.usage_limit is not None:
            reason = (
                "elimination's dynamic programming cannot enforce a memory limit exactly "
                "(OptCNN Algorithm 1 has none): use backend 'auto' (the default) or one that "
                "enforces it: portfolio, cpsat, ilp, search, mcmc, local or toulbar2"
            )
        return reason

    def _solve(
        self, problem: Problem, options: SolveOptions, settings: EliminationSettings
    ) -> SolveResult:
        start = time.perf_counter()
        deadline = options.clock().at_least(EXACT_GRACE).at
        g = _Graph.of(problem, deadline)
        progress = ProgressLog(self.name)
        finished = True
        try:
            g.eliminate(progress)
        except OutOfTime:
            finished = False  # solve what is left: the reduced graph has the same optimum
        t_elim = time.perf_counter() - start
        final = sorted(g.cost)
        index = {node: k for k, node in enumerate(final)}
        edges = [(index[a], index[b], _view(t)) for (a, b), t in g.table.items()]
        out = solve_exact(
            [g.cost[n] for n in final], edges, deadline, progress=progress,
            tolerance=options.gap_tolerance,
        )  # fmt: skip
        stats = {
            "final_nodes": len(final),
            "final_edges": len(edges),
            "node_eliminations": g.counts["node"],
            "leaf_eliminations": g.counts["leaf"],
            "edge_eliminations": g.counts["edge"],
            "reused_eliminations": g.memo.hits,
            "eliminate_seconds": t_elim,
            "eliminations_finished": finished,
            "final_expanded": out.expanded,
        }
        complete = out.complete and finished
        if out.choices is None:
            status = Status.INFEASIBLE if complete else Status.NO_SOLUTION
            limit = None if complete else Limit.TIME
            return SolveResult(self.name, status, bound=out.bound, limit=limit, stats=stats)
        choice = {node: out.choices[index[node]] for node in final}
        g.undo(choice)
        choices = tuple(choice[i] for i in range(problem.num_nodes))
        if complete:  # optimal, within the gap tolerance (branch and bound's bound)
            return SolveResult(self.name, Status.OPTIMAL, choices, bound=out.bound, stats=stats)
        bound = out.bound if math.isfinite(out.bound) else None
        progress(lambda: f"time limit: best {out.value:.6g}, bound {bound}", force=True)
        return SolveResult(
            self.name, Status.FEASIBLE, choices, bound=bound, limit=Limit.TIME, stats=stats
        )
