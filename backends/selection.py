"""The additive objective's data, shared by the `ilp` and `cpsat` backends (no solver here).

`Selection`: the additive objective (OptCNN Eq. 1) over one choice per node, built once from a
`Problem` by `selection` and encoded by both backends, so the two encodings can only differ in
how they say the same thing. The reductions are exact: forbidden (inf) choices removed, arc
consistency over forbidden pairs, parallel edges merged, edges with a single-choice end or a
separable table folded into node costs, and the memory rule of the cost-table format (for
every distinct interval start t and pool m, the usages live at t sum to at most the limit)
reduced to its non-dominated live sets (`live_sets`, also used by `backends.placement`).
`seed_choices` finds a valid choice vector fast: the solvers' first incumbent and hint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from backends.base import past
from planner.problems.evaluate import additive_cost, memory_feasible

if TYPE_CHECKING:
    from planner.problems.problem import Problem

__all__ = [
    "MemoryRow",
    "Selection",
    "live_sets",
    "seed_choices",
    "selection",
]

MEMORY_RTOL = 1e-9  # the tolerance of planner.problems.evaluate.memory_feasible


def live_sets(intervals: np.ndarray) -> list[np.ndarray]:
    """Node sets live at the distinct interval starts, without those inside another set."""
    start, end = intervals[:, 0], intervals[:, 1]
    times = np.unique(start)
    live = (start[None, :] <= times[:, None]) & (times[:, None] < end[None, :])
    live = np.unique(live[live.any(axis=1)], axis=0)
    live = live[np.argsort(-live.sum(axis=1), kind="stable")]
    packed = np.packbits(live, axis=1)
    kept: list[int] = []
    for r in range(len(live)):
        if kept and ((packed[r] & ~packed[kept]) == 0).all(axis=1).any():
            continue  # a subset of a kept set: its constraint is implied (usages are >= 0)
        kept.append(r)
    return [np.flatnonzero(live[r]) for r in kept]


@dataclass(frozen=True)
class MemoryRow:
    """sum over listed nodes i of coef[k][position of c_i] <= rhs (one pool, one live set)."""

    pool: int
    nodes: np.ndarray
    coef: tuple[np.ndarray, ...]  # per listed node: usage above its smallest, per allowed choice
    rhs: float


@dataclass(frozen=True)
class Selection:
    """The additive objective's tables after exact reductions (see the module docstring)."""

    allowed: tuple[np.ndarray, ...]  # per node: the choice indices that remain possible
    node_cost: tuple[np.ndarray, ...]  # per node: cost per allowed choice (edges folded in)
    edges: tuple[tuple[int, int], ...]  # remaining edges, u < v, no parallel ones
    edge_cost: tuple[np.ndarray, ...]  # (allowed u, allowed v); inf: a forbidden pair
    memory: tuple[MemoryRow, ...]
    infeasible: str | None = None  # why no choice vector can be valid, when the reductions show it

    @property
    def num_nodes(self) -> int:
        return len(self.allowed)

    @property
    def num_pairs(self) -> int:
        return int(sum(np.isfinite(t).sum() for t in self.edge_cost))

    def positions(self, choices: Sequence[int]) -> list[int] | None:
        """Index of each choice in its node's allowed list; None if one is not allowed."""
        out = []
        for a, c in zip(self.allowed, choices, strict=True):
            k = int(np.searchsorted(a, c))
            if k >= len(a) or a[k] != c:
                return None
            out.append(k)
        return out

    def cost(self, choices: Sequence[int]) -> float:
        """The objective of a choice vector in these tables (equals `additive_cost`)."""
        pos = self.positions(choices)
        if pos is None:
            return math.inf
        total = sum(float(c[k]) for c, k in zip(self.node_cost, pos, strict=True))
        for (u, v), t in zip(self.edges, self.edge_cost, strict=True):
            total += float(t[pos[u], pos[v]])
        return total

    def trivial_bound(self) -> float:
        """A proven lower bound: every node and edge at its own minimum."""
        if self.infeasible:
            return math.inf
        return float(sum(c.min() for c in self.node_cost) + sum(t.min() for t in self.edge_cost))


def selection(problem: Problem) -> Selection:
    """The reduced additive tables of `problem` (exact: same optimum, same feasible set)."""
    allowed = [np.flatnonzero(np.isfinite(c)) for c in problem.node_cost]
    node_cost = [c[a].astype(np.float64) for c, a in zip(problem.node_cost, allowed, strict=True)]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True):
        a, b, tab = (u, v, t) if u < v else (v, u, t.T)
        tab = tab[np.ix_(allowed[a], allowed[b])].astype(np.float64)
        merged[(a, b)] = merged[(a, b)] + tab if (a, b) in merged else tab
    empty = [i for i, a in enumerate(allowed) if len(a) == 0]
    reason = f"node {problem.node_names[empty[0]]!r} has only forbidden choices" if empty else None
    if reason is None:
        reason = _arc_consistency(allowed, node_cost, merged, problem.node_names)
    memory: list[MemoryRow] = []
    if reason is None:
        _fold_edges(node_cost, merged)
        if problem.usage_limit is not None:
            reason = _memory_rows(problem, allowed, memory)
    keys = sorted(merged)
    return Selection(
        tuple(allowed),
        tuple(node_cost),
        tuple(keys),
        tuple(merged[k] for k in keys),
        tuple(memory),
        reason,
    )


def _arc_consistency(
    allowed: list[np.ndarray],
    node_cost: list[np.ndarray],
    tables: dict[tuple[int, int], np.ndarray],
    names: Sequence[str],
) -> str | None:
    """Drop choices with no finite partner on some edge, until nothing changes."""
    changed = True
    while changed:
        changed = False
        for key in list(tables):
            finite = np.isfinite(tables[key])
            for node, keep in ((key[0], finite.any(axis=1)), (key[1], finite.any(axis=0))):
                if keep.all():
                    continue
                changed = True
                allowed[node], node_cost[node] = allowed[node][keep], node_cost[node][keep]
                for (a, b), tab in tables.items():
                    if a == node:
                        tables[(a, b)] = tab[keep]
                    elif b == node:
                        tables[(a, b)] = tab[:, keep]
                if len(allowed[node]) == 0:
                    return f"every choice of node {names[node]!r} meets a forbidden pair"
                finite = np.isfinite(tables[key])
    return None


def _fold_edges(node_cost: list[np.ndarray], tables: dict[tuple[int, int], np.ndarray]) -> None:
    """Move edges with a single-choice end, or an additively separable table, into nodes
    (after arc consistency such tables are finite)."""
    for (u, v), t in list(tables.items()):
        if t.shape[0] == 1:
            node_cost[v] = node_cost[v] + t[0]
        elif t.shape[1] == 1:
            node_cost[u] = node_cost[u] + t[:, 0]
        elif np.isfinite(t).all() and _separable(t):
            node_cost[u] = node_cost[u] + (t[:, 0] - t[0, 0])
            node_cost[v] = node_cost[v] + t[0]
        else:
            continue
        del tables[(u, v)]


def _separable(t: np.ndarray) -> bool:
    """t[a, b] == r[a] + c[b] (to rounding)."""
    rebuilt = (t[:, :1] - t[:1, :1]) + t[:1, :]
    return bool(np.allclose(rebuilt, t, rtol=0, atol=1e-12 * max(1.0, float(np.abs(t).max()))))


def _memory_rows(problem: Problem, allowed: list[np.ndarray], out: list[MemoryRow]) -> str | None:
    assert problem.usage is not None and problem.intervals is not None
    assert problem.usage_limit is not None
    limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1)
    usage = [np.asarray(u, dtype=np.float64).reshape(len(u), -1)[a] for u, a in
             zip(problem.usage, allowed, strict=True)]  # fmt: skip
    base = [u.min(axis=0) for u in usage]
    excess = [u - b for u, b in zip(usage, base, strict=True)]
    for nodes in live_sets(problem.intervals):
        for m in range(len(limit)):
            rhs = limit[m] * (1 + MEMORY_RTOL) - float(sum(base[i][m] for i in nodes))
            if rhs < 0:
                return (
                    f"memory limit {limit[m]:.6g} of pool {m} is below the smallest possible "
                    f"live usage {limit[m] - rhs:.6g}"
                )
            keep = [i for i in nodes if excess[i][:, m].max() > 0]
            if sum(excess[i][:, m].max() for i in keep) <= rhs:
                continue  # cannot bind
            coef = tuple(excess[i][:, m] for i in keep)
            out.append(MemoryRow(m, np.array(keep, dtype=np.int64), coef, rhs))
    return None


def seed_choices(
    problem: Problem, sel: Selection, deadline: float = math.inf
) -> tuple[tuple[int, ...], float] | None:
    """A valid choice vector found fast, with its cost; None when none was found.

    Greedy passes in node order (each node takes the choice cheapest with the edges to nodes
    already chosen, among those that keep every memory row satisfiable), from scratch and
    also each node's cheapest and smallest-memory choices, each improved by local search
    (one node at a time to its best choice given its neighbours, within memory, until no
    move helps). Used as the solvers' first incumbent and hint."""
    if sel.infeasible:
        return None
    n = sel.num_nodes
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (u, v), t in zip(sel.edges, sel.edge_cost, strict=True):
        nbrs[u].append((v, t))
        nbrs[v].append((u, t.T))
    rows_of = _rows_of_nodes(sel)
    starts = [_greedy_positions(sel, nbrs, rows_of)]
    starts.append([int(np.argmin(c)) for c in sel.node_cost])
    if sel.memory:
        use = [np.zeros(len(a)) for a in sel.allowed]
        for row in sel.memory:
            for i, c in zip(row.nodes, row.coef, strict=True):
                use[i] += c
        starts.append([int(np.argmin(u)) for u in use])
    best: tuple[tuple[int, ...], float] | None = None
    for pos in starts:
        if pos is None or not _fits(sel, pos):
            continue
        _local_search(sel, pos, nbrs, rows_of, deadline)
        ch = tuple(int(a[k]) for a, k in zip(sel.allowed, pos, strict=True))
        value = additive_cost(problem, ch)
        valid = math.isfinite(value) and memory_feasible(problem, ch)
        if valid and (best is None or value < best[1]):
            best = (ch, value)
    return best


def _rows_of_nodes(sel: Selection) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per node: the memory rows it is in and its coefficients there, (R_i,) and (R_i, C_i)."""
    rows: list[list[int]] = [[] for _ in range(sel.num_nodes)]
    coefs: list[list[np.ndarray]] = [[] for _ in range(sel.num_nodes)]
    for r, row in enumerate(sel.memory):
        for i, c in zip(row.nodes, row.coef, strict=True):
            rows[i].append(r)
            coefs[i].append(c)
    return [
        (np.array(r, dtype=np.int64), np.array(c).reshape(len(r), len(sel.allowed[i])))
        for i, (r, c) in enumerate(zip(rows, coefs, strict=True))
    ]


def _fits(sel: Selection, pos: Sequence[int]) -> bool:
    return all(
        sum(float(c[pos[i]]) for i, c in zip(row.nodes, row.coef, strict=True)) <= row.rhs
        for row in sel.memory
    )


def _greedy_positions(
    sel: Selection,
    nbrs: list[list[tuple[int, np.ndarray]]],
    rows_of: list[tuple[np.ndarray, np.ndarray]],
) -> list[int] | None:
    """Node by node, the cheapest choice given the chosen neighbours that keeps the memory
    rows satisfiable if the rest take no more than their smallest usage."""
    slack = np.array([row.rhs for row in sel.memory])
    pos = [-1] * sel.num_nodes
    for i in range(sel.num_nodes):
        acc = sel.node_cost[i].copy()
        for j, t in nbrs[i]:
            if pos[j] >= 0:
                acc = acc + t[:, pos[j]]
        rows, coef = rows_of[i]
        if len(rows):
            acc[~(coef <= slack[rows][:, None]).all(axis=0)] = math.inf
        if not np.isfinite(acc).any():
            return None
        pos[i] = int(np.argmin(acc))
        if len(rows):
            slack[rows] -= coef[:, pos[i]]
    return pos


def _local_search(
    sel: Selection,
    pos: list[int],
    nbrs: list[list[tuple[int, np.ndarray]]],
    rows_of: list[tuple[np.ndarray, np.ndarray]],
    deadline: float,
) -> None:
    """Move one node at a time to its best choice given its neighbours, within memory."""
    slack = np.array([row.rhs for row in sel.memory])
    for i, (rows, coef) in enumerate(rows_of):
        if len(rows):
            slack[rows] -= coef[:, pos[i]]
    improved = True
    while improved and not past(deadline):
        improved = False
        for i in range(sel.num_nodes):
            if len(sel.allowed[i]) == 1:
                continue
            acc = sel.node_cost[i].copy()
            for j, t in nbrs[i]:
                acc = acc + t[:, pos[j]]
            rows, coef = rows_of[i]
            if len(rows):
                room = slack[rows] + coef[:, pos[i]]
                acc[~(coef <= room[:, None]).all(axis=0)] = math.inf
            k = int(np.argmin(acc))
            if acc[k] < acc[pos[i]] * (1 - 1e-12) - 1e-300:
                if len(rows):
                    slack[rows] += coef[:, pos[i]] - coef[:, k]
                pos[i] = k
                improved = True
