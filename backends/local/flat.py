"""A Problem as flat numpy arrays, the form the compiled search (`kernels`) reads.

Built once per solve, in O(nodes + edges + table entries) numpy work (no Python loop over
table entries): 35,000 nodes and 6 million edge entries take well under a second.

- strategies: node i's strategies are the global indices `off[i] .. off[i + 1]`; `cost`
  holds their node costs (inf: forbidden), `usage` their memory (S, M) in M pools;
- edges: edge e = (eu[e], ev[e]) has its |S_u| x |S_v| table row-major at
  `etab[eoff[e]:eoff[e + 1]]` (stride `ncol[e]` = |S_v|; inf: a forbidden pair);
- adjacency (CSR): node i's incident edges are `aedge[aoff[i]:aoff[i + 1]]`, with the other
  end `aother` and `aside` 0 when i is the edge's first node (its row), 1 when its second;
- memory: live ranges compressed to the distinct interval starts (the memory peak is reached
  at a start, as in `planner.problems.evaluate.live_usage`): node i is live over the time
  indices [lo[i], hi[i]) of `times`; `limit` (M,) is inf in a pool without a limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from planner.problems.problem import Problem

__all__ = ["FlatProblem", "flatten"]


@dataclass(frozen=True, eq=False)
class FlatProblem:
    """The arrays of the module docstring; `movable` lists the nodes with two or more allowed
    strategies, `has_limit` whether any pool has a memory limit, `max_size` the most
    strategies of a node."""

    off: np.ndarray
    cost: np.ndarray
    usage: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    limit: np.ndarray
    eu: np.ndarray
    ev: np.ndarray
    eoff: np.ndarray
    ncol: np.ndarray
    etab: np.ndarray
    aoff: np.ndarray
    aedge: np.ndarray
    aother: np.ndarray
    aside: np.ndarray
    movable: np.ndarray
    num_times: int
    has_limit: bool
    max_size: int

    def restricted(self, alive: np.ndarray) -> FlatProblem:
        """The same problem with the strategies not `alive` forbidden (node cost inf)."""
        cost = np.where(alive.astype(bool), self.cost, np.inf)
        allowed = (
            np.add.reduceat(alive.astype(np.int64), self.off[:-1]) if self.num_nodes else alive
        )
        movable = np.flatnonzero(allowed >= 2).astype(np.int64)
        return dataclasses.replace(self, cost=cost, movable=movable)

    @property
    def num_nodes(self) -> int:
        return len(self.off) - 1

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The problem tuple the kernels take (`kernels.P_*` name the positions)."""
        return (
            self.off, self.cost, self.usage, self.lo, self.hi, self.limit, self.eu, self.ev,
            self.eoff, self.ncol, self.etab, self.aoff, self.aedge, self.aother, self.aside,
            self.movable,
        )  # fmt: skip


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.zeros(0)
    return np.ascontiguousarray(np.concatenate([np.ravel(p) for p in parts]), dtype=np.float64)


def flatten(problem: Problem) -> FlatProblem:
    """The flat arrays of `problem` (see the module docstring)."""
    n = problem.num_nodes
    sizes = np.fromiter((len(c) for c in problem.node_cost), dtype=np.int64, count=n)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    cost = _concat(list(problem.node_cost))
    cost[cost >= 1e18] = np.inf
    pairs = np.array(problem.edges, dtype=np.int64).reshape(-1, 2)
    eu, ev = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
    ncol = sizes[ev] if len(pairs) else np.zeros(0, dtype=np.int64)
    eoff = np.zeros(len(pairs) + 1, dtype=np.int64)
    np.cumsum(sizes[eu] * ncol, out=eoff[1:])
    etab = _concat(list(problem.edge_cost))
    etab[etab >= 1e18] = np.inf
    # adjacency: both ends of every edge, grouped by node (stable, so in edge order)
    ends = np.concatenate([eu, ev])
    order = np.argsort(ends, kind="stable")
    m = len(pairs)
    aedge = (order % max(m, 1)).astype(np.int64)
    aside = (order >= m).astype(np.int64)
    aother = np.where(aside == 0, ev[aedge], eu[aedge]) if m else np.zeros(0, dtype=np.int64)
    aoff = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(ends, minlength=n), out=aoff[1:])
    usage, lo, hi, limit, num_times = _memory(problem, n, int(off[-1]))
    allowed = np.add.reduceat(np.isfinite(cost).astype(np.int64), off[:-1]) if n else sizes
    return FlatProblem(
        off=off,
        cost=cost,
        usage=usage,
        lo=lo,
        hi=hi,
        limit=limit,
        eu=eu,
        ev=ev,
        eoff=eoff,
        ncol=np.ascontiguousarray(ncol, dtype=np.int64),
        etab=etab,
        aoff=aoff,
        aedge=np.ascontiguousarray(aedge),
        aother=np.ascontiguousarray(aother, dtype=np.int64),
        aside=np.ascontiguousarray(aside),
        movable=np.flatnonzero(allowed >= 2).astype(np.int64),
        num_times=num_times,
        has_limit=bool(np.isfinite(limit).any()),
        max_size=int(sizes.max(initial=1)),
    )


def _memory(
    problem: Problem, n: int, total: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """usage (S, M), lo, hi (n,), limit (M,) and the number of compressed times."""
    if problem.usage is None or problem.intervals is None or problem.usage_limit is None:
        zeros = np.zeros(n, dtype=np.int64)
        return np.zeros((total, 1)), zeros, zeros.copy(), np.full(1, np.inf), 1
    pools = int(np.asarray(problem.usage_limit).reshape(-1).size)
    usage = np.concatenate(
        [np.asarray(u, dtype=np.float64).reshape(len(u), -1) for u in problem.usage]
    )
    usage = np.ascontiguousarray(usage.reshape(total, pools))
    start = problem.intervals[:, 0].astype(np.int64)
    end = problem.intervals[:, 1].astype(np.int64)
    live = end > start
    times = np.unique(start[live])
    lo = np.searchsorted(times, start, side="left").astype(np.int64)
    hi = np.searchsorted(times, end, side="left").astype(np.int64)
    lo[~live] = 0
    hi[~live] = 0
    limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1).copy()
    return usage, lo, hi, limit, max(len(times), 1)
