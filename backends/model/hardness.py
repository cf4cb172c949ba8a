"""What makes a cost-table Problem hard for an exact model: its size in table entries, its
strategies per node and how tight its memory is (`hardness`), read off the Problem in
milliseconds (the portfolio chooses its members by them, docs/solvers.md).

The models of `ilp` and `cpsat` have a variable per allowed pair of an edge's table (or per
row and column of it) beside one per strategy, so their LP, and with it their first answer
and their bound, grows with the table entries, not with the nodes: IOPDDL G (816 nodes, 12.3
strategies per node, 212,622 entries) is proven optimal by them in 7-15 s, a problem with G's
graph and 29 strategies per node (1.15 M entries) is 378x the best answer after 20 s and
39.5x after 300 s, and a 2,000-node chain of 2-strategy nodes is a small model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from backends.model.selection import Selection, edge_sizes
from planner.problems.evaluate import memory_peak
from planner.problems.problem import Problem

__all__ = ["Hardness", "hardness", "model_size"]


@dataclass(frozen=True)
class Hardness:
    """A Problem's size as the exact models see it."""

    nodes: int
    edges: int
    entries: int  # table entries: the sum over the edges of |S_u| x |S_v|
    mean_strategies: float  # strategies per node (forbidden ones included)
    max_strategies: int
    forbidden: float  # the share of the strategies that are forbidden
    tightness: float | None  # the least-memory peak over the limit (1: no room); None: no limit

    def row(self) -> dict[str, float | int | None]:
        """The features as a flat mapping (for stats and tables)."""
        return {
            "nodes": self.nodes,
            "edges": self.edges,
            "entries": self.entries,
            "mean_strategies": round(self.mean_strategies, 2),
            "max_strategies": self.max_strategies,
            "forbidden": round(self.forbidden, 3),
            "tightness": None if self.tightness is None else round(self.tightness, 3),
        }


def hardness(problem: Problem) -> Hardness:
    """The Problem's `Hardness` (a pass over its node tables; the edge tables' sizes only)."""
    sizes = np.array(problem.sizes, dtype=np.int64)
    entries = sum(int(t.size) for t in problem.edge_cost)
    costs = problem.node_cost
    forbidden = sum(int((~np.isfinite(c)).sum()) for c in costs) / max(int(sizes.sum()), 1)
    return Hardness(
        nodes=problem.num_nodes,
        edges=len(problem.edges),
        entries=entries,
        mean_strategies=float(sizes.mean()) if len(sizes) else 0.0,
        max_strategies=int(sizes.max(initial=0)),
        forbidden=forbidden,
        tightness=_tightness(problem),
    )


def _tightness(problem: Problem) -> float | None:
    """The peak of every node at its least-memory allowed strategy (pool by pool), over the
    limit: above 1 no answer keeps the limit, near 1 few do."""
    if problem.usage is None or problem.intervals is None or problem.usage_limit is None:
        return None
    least = []
    for c, u in zip(problem.node_cost, problem.usage, strict=True):
        use = np.asarray(u, dtype=np.float64).reshape(len(c), -1).sum(axis=1)
        least.append(int(np.argmin(np.where(np.isfinite(c), use, np.inf))))
    peak = memory_peak(problem, least)
    limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(limit > 0, peak / limit, np.where(peak > 0, math.inf, 0.0))
    return float(ratio.max(initial=0.0))


def model_size(sel: Selection) -> int:
    """The columns of the exact members' models (`backends.mathprog.additive_lp`): one per
    allowed strategy of a node with a choice, one per allowed pair of an edge's groups of
    equal rows and columns (`Selection.groups`: tables of layouts shrink a lot, IOPDDL G's
    212,622 entries to 59,025 pairs)."""
    strategies = sum(len(a) for a in sel.allowed if len(a) > 1)
    return strategies + int(edge_sizes(sel)[:, 2].sum())
