"""The additive objective's data, shared by several families (no search here): encoded by
`ilp` and `cpsat`, searched by `heuristics.feasible` and the `portfolio`.

`Selection`: the additive objective (OptCNN Eq. 1) over one choice per node, built once from a
`Problem` by `selection` and encoded by both backends, so the two encodings can only differ in
how they say the same thing. The reductions are exact: forbidden (inf) choices removed, arc
consistency over forbidden pairs, parallel edges merged, edges with a single-choice end or a
separable table folded into node costs.

The memory rule of the cost-table format (at every interval start t and pool m, the usages
live at t sum to at most the limit) is kept as a sweep (`Memory`, O(n) numbers): it only
needs checking at the starts whose live set is not inside another's (`check_times`: a live
set only grows at a start, and the set at one start is inside the set at the next unless a
node ends in between), and each node is live over one contiguous range of those times.
A 35,000-node problem's rule is built in well under a second, where a dense time x node table
took minutes and gigabytes. `live_sets` lists the sets themselves (for `backends.placement.problem`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from planner.problems.problem import Problem

__all__ = [
    "DIRECT_TERMS",
    "MEMORY_RTOL",
    "Memory",
    "Selection",
    "check_times",
    "edge_groups",
    "live_ranges",
    "live_sets",
    "memory_form",
    "edge_sizes",
    "model_terms",
    "range_sum",
    "restricted_terms",
    "selection",
]

MEMORY_RTOL = 1e-9  # the tolerance of planner.problems.evaluate.memory_feasible


def check_times(intervals: np.ndarray) -> np.ndarray:
    """The sorted interval starts whose live set is inside no other live set.

    For each node live at some time, the last start before its end is such a time (the node
    leaves before the next start); those are all of them, in O(n log n)."""
    start, end = intervals[:, 0], intervals[:, 1]
    alive = end > start
    if not alive.any():
        return np.zeros(0, dtype=np.int64)
    times = np.unique(start[alive])
    closing = np.searchsorted(times, end[alive], side="left") - 1
    return times[np.unique(closing)]


def live_ranges(intervals: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node, [first, last): the indices of `times` (sorted) at which it is live."""
    first = np.searchsorted(times, intervals[:, 0], side="left")
    last = np.searchsorted(times, intervals[:, 1], side="left")
    return first, np.maximum(first, last)


def live_sets(intervals: np.ndarray) -> list[np.ndarray]:
    """The node sets live at `check_times` (none inside another), in time order."""
    times = check_times(intervals)
    first, last = live_ranges(intervals, times)
    return list(_members(first, last, np.arange(len(first)), len(times)))


def _members(
    first: np.ndarray, last: np.ndarray, items: np.ndarray, count: int
) -> Iterator[np.ndarray]:
    """For t in range(count): the items whose range [first, last) holds t (output-sized)."""
    spans = last - first
    when = np.repeat(first - np.cumsum(spans) + spans, spans) + np.arange(spans.sum())
    who = np.repeat(items, spans)
    order = np.argsort(when, kind="stable")
    bounds = np.searchsorted(when[order], np.arange(count + 1))
    for t in range(count):
        yield who[order[bounds[t] : bounds[t + 1]]]


def range_sum(first: np.ndarray, last: np.ndarray, values: np.ndarray, count: int) -> np.ndarray:
    """(count,): at each t, the sum of the values whose range [first, last) holds t."""
    delta = np.bincount(first, values, minlength=count + 1)
    delta -= np.bincount(last, values, minlength=count + 1)
    return np.cumsum(delta[:count])


@dataclass(frozen=True)
class Memory:
    """The memory rule of one pool over its check times, as a sweep.

    At check time t the listed nodes live there (`first[k] <= t < last[k]`) use at most
    `rhs[t]` above their smallest usages; `binding[t]` is False where even their largest
    usages fit (the row is implied). Only nodes whose usage depends on their choice are
    listed; `coef[k]` is node `nodes[k]`'s usage above its smallest, per allowed choice."""

    pool: int
    rhs: np.ndarray
    binding: np.ndarray
    nodes: np.ndarray
    first: np.ndarray
    last: np.ndarray
    coef: tuple[np.ndarray, ...]

    @property
    def num_times(self) -> int:
        return len(self.rhs)

    def rows(self) -> Iterator[tuple[int, np.ndarray]]:
        """(t, listed indices k live at t) for every binding t: the explicit rows."""
        for t, ks in enumerate(_members(self.first, self.last, np.arange(len(self.nodes)),
                                        self.num_times)):  # fmt: skip
            if self.binding[t]:
                yield t, ks

    def row_terms(self) -> int:
        """How many (node, choice) terms the explicit binding rows hold in all."""
        sizes = np.array([len(c) for c in self.coef], dtype=np.float64)
        per_time = range_sum(self.first, self.last, sizes, self.num_times)
        return int(per_time[self.binding].sum())

    def load(self, pos: Sequence[int] | np.ndarray) -> np.ndarray:
        """(T,) usage above the smallest at every check time, for a position per node."""
        use = np.array([c[pos[i]] for i, c in zip(self.nodes, self.coef, strict=True)])
        return range_sum(self.first, self.last, use.reshape(-1), self.num_times)

    def fits(self, pos: Sequence[int] | np.ndarray) -> bool:
        return bool((self.load(pos) <= self.rhs).all())


@dataclass(frozen=True)
class Selection:
    """The additive objective's tables after exact reductions (see the module docstring)."""

    allowed: tuple[np.ndarray, ...]  # per node: the choice indices that remain possible
    node_cost: tuple[np.ndarray, ...]  # per node: cost per allowed choice (edges folded in)
    edges: tuple[tuple[int, int], ...]  # remaining edges, u < v, no parallel ones
    edge_cost: tuple[np.ndarray, ...]  # (allowed u, allowed v); inf: a forbidden pair
    memory: tuple[Memory, ...]  # one per pool whose rule can bind
    infeasible: str | None = None  # why no choice vector can be valid, when the reductions show it
    _groups: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def groups(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`edge_groups` of edge e's table, computed once (the size estimates and both
        encoders use it)."""
        if e not in self._groups:
            self._groups[e] = edge_groups(self.edge_cost[e])
        return self._groups[e]

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

    def choices(self, pos: Sequence[int]) -> tuple[int, ...]:
        """The choice vector of a position per node."""
        return tuple(int(a[k]) for a, k in zip(self.allowed, pos, strict=True))

    def cost(self, choices: Sequence[int]) -> float:
        """The objective of a choice vector in these tables (equals `additive_cost`)."""
        pos = self.positions(choices)
        if pos is None:
            return math.inf
        return self.position_cost(pos)

    def position_cost(self, pos: Sequence[int]) -> float:
        total = sum(float(c[k]) for c, k in zip(self.node_cost, pos, strict=True))
        for (u, v), t in zip(self.edges, self.edge_cost, strict=True):
            total += float(t[pos[u], pos[v]])
        return total

    def fits(self, pos: Sequence[int]) -> bool:
        """Whether a position per node keeps the memory rule."""
        return all(m.fits(pos) for m in self.memory)

    def trivial_bound(self) -> float:
        """A proven lower bound: every node and edge at its own minimum."""
        if self.infeasible:
            return math.inf
        return float(sum(c.min() for c in self.node_cost) + sum(t.min() for t in self.edge_cost))


def selection(problem: Problem, keep: Sequence[np.ndarray] | None = None) -> Selection:
    """The reduced additive tables of `problem` (exact: same optimum, same feasible set).

    `keep`: per node, the choice indices to consider (a restricted problem, for models too
    large to solve whole; its optimum is only an upper bound of the problem's)."""
    allowed = [np.flatnonzero(np.isfinite(c)) for c in problem.node_cost]
    if keep is not None:
        allowed = [np.intersect1d(a, k) for a, k in zip(allowed, keep, strict=True)]
    node_cost = [np.asarray(c, dtype=np.float64)[a] for c, a in
                 zip(problem.node_cost, allowed, strict=True)]  # fmt: skip
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True):
        a, b, tab = (u, v, t) if u < v else (v, u, t.T)
        tab = _restrict(np.asarray(tab, dtype=np.float64), allowed[a], allowed[b])
        merged[(a, b)] = merged[(a, b)] + tab if (a, b) in merged else tab
    empty = [i for i, a in enumerate(allowed) if len(a) == 0]
    reason = f"node {problem.node_names[empty[0]]!r} has only forbidden choices" if empty else None
    if reason is None:
        reason = _arc_consistency(allowed, node_cost, merged, problem.node_names)
    memory: tuple[Memory, ...] = ()
    if reason is None:
        _fold_edges(node_cost, merged)
        if problem.usage_limit is not None:
            memory, reason = _memory(problem, allowed)
    keys = sorted(merged)
    return Selection(
        tuple(allowed),
        tuple(node_cost),
        tuple(keys),
        tuple(merged[k] for k in keys),
        memory,
        reason,
    )


def _restrict(t: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """t[rows][:, cols], without a copy when nothing is dropped."""
    if len(rows) < t.shape[0]:
        t = t[rows]
    if len(cols) < t.shape[1]:
        t = t[:, cols]
    return t


def _arc_consistency(
    allowed: list[np.ndarray],
    node_cost: list[np.ndarray],
    tables: dict[tuple[int, int], np.ndarray],
    names: Sequence[str],
) -> str | None:
    """Drop choices with no finite partner on some edge, until nothing changes."""
    incident: dict[int, list[tuple[int, int]]] = {}
    for key in tables:
        incident.setdefault(key[0], []).append(key)
        incident.setdefault(key[1], []).append(key)
    queue = [key for key, t in tables.items() if not np.isfinite(t).all()]
    while queue:
        key = queue.pop()
        finite = np.isfinite(tables[key])
        for node, keep in ((key[0], finite.any(axis=1)), (key[1], finite.any(axis=0))):
            if keep.all():
                continue
            allowed[node], node_cost[node] = allowed[node][keep], node_cost[node][keep]
            if len(allowed[node]) == 0:
                return f"every choice of node {names[node]!r} meets a forbidden pair"
            for other in incident[node]:
                tab = tables[other]
                tables[other] = tab[keep] if other[0] == node else tab[:, keep]
                if not np.isfinite(tables[other]).all():
                    queue.append(other)
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
    return float(np.abs(rebuilt - t).max()) <= 1e-12 * max(1.0, float(np.abs(t).max()))


def _memory(problem: Problem, allowed: list[np.ndarray]) -> tuple[tuple[Memory, ...], str | None]:
    """The memory rule per pool as a sweep (`Memory`), or why no choice vector keeps it."""
    assert problem.usage is not None and problem.intervals is not None
    assert problem.usage_limit is not None
    limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1)
    usage = [np.asarray(u, dtype=np.float64).reshape(len(u), -1)[a] for u, a in
             zip(problem.usage, allowed, strict=True)]  # fmt: skip
    times = check_times(problem.intervals)
    first, last = live_ranges(problem.intervals, times)
    out = []
    for m in range(len(limit)):
        base = np.array([u[:, m].min() for u in usage])
        excess = [u[:, m] - b for u, b in zip(usage, base, strict=True)]
        rhs = limit[m] * (1 + MEMORY_RTOL) - range_sum(first, last, base, len(times))
        if (rhs < 0).any():
            t = int(np.argmax(rhs < 0))
            return (), (
                f"memory limit {limit[m]:.6g} of pool {m} is below the smallest possible live "
                f"usage {limit[m] - rhs[t]:.6g} (at time {times[t]})"
            )
        top = np.array([e.max() for e in excess])
        listed = np.flatnonzero((top > 0) & (last > first))
        most = range_sum(first[listed], last[listed], top[listed], len(times))
        binding = most > rhs
        if binding.any():
            coef = tuple(excess[i] for i in listed)
            out.append(Memory(m, rhs, binding, listed, first[listed], last[listed], coef))
    return tuple(out), None


def edge_groups(t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An edge table without repeated rows and columns: (group of each row, group of each
    column, table over groups), t[a, b] == table[rows[a], cols[b]]. Real resharding costs
    repeat a lot (they depend only on the producer's output layout and the layout the
    consumer wants), so encodings over groups are many times smaller, and as tight."""
    rows, first = _repeats(t)
    kept = t[first]
    cols, first = _repeats(kept.T)
    return rows, cols, kept[:, first]


def _repeats(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group of each row, first row of each group): equal rows compared as raw bytes."""
    t = np.ascontiguousarray(t, dtype=np.float64)
    if t.shape[0] <= 16:  # a dict is faster than numpy's sort for a few rows
        seen: dict[bytes, int] = {}
        starts: list[int] = []
        groups = []
        for i, row in enumerate(t):
            g = seen.setdefault(row.tobytes(), len(seen))
            if g == len(starts):
                starts.append(i)
            groups.append(g)
        # int64 even when empty (a table with no rows: a node with only forbidden choices);
        # np.array([]) is float64, which numpy refuses as an index
        return np.array(groups, dtype=np.int64), np.array(starts, dtype=np.int64)
    keys = t.view(np.dtype((np.void, 8 * t.shape[1]))).reshape(-1)
    _, first, group = np.unique(keys, return_index=True, return_inverse=True)
    return group.reshape(-1), first


def model_terms(sel: Selection, edges: str = "marginal", groups: bool = True) -> int:
    """About how many terms (nonzeros) an ilp or cpsat model of `sel` has: one-hot rows,
    edge rows (over groups of equal rows and columns unless `groups` is False), and the
    memory rule in the form `memory_form` picks. What the backends check against their time
    before building a model."""
    total = sum(len(c) for c in sel.node_cost if len(c) > 1)
    for gu, gv, finite, positive in edge_sizes(sel, groups and edges != "plain"):
        total += 2 * finite + gu + gv if edges == "marginal" else 3 * positive
    form = memory_form(sel)
    for m in sel.memory:
        total += m.row_terms() if form == "rows" else _chain_terms(m)
    return total


def restricted_terms(sel: Selection, k: int, sizes: np.ndarray) -> int:
    """About how many terms a marginal model of `sel` restricted to k + 1 choices per node
    has (`sizes`: `edge_sizes(sel)`), without building it."""
    keep = np.array([min(len(c), k + 1) for c in sel.node_cost])
    total = int(keep[keep > 1].sum())
    if len(sel.edges):
        u, v = np.array(sel.edges).T
        gu, gv = np.minimum(sizes[:, 0], keep[u]), np.minimum(sizes[:, 1], keep[v])
        total += int((2 * gu * gv + gu + gv).sum())
    share = keep.sum() / max(1, sum(len(c) for c in sel.node_cost))
    for m in sel.memory:
        total += int(min(m.row_terms() * share, _chain_terms(m) * share + 3 * m.num_times))
    return total


def edge_sizes(sel: Selection, groups: bool = True) -> np.ndarray:
    """(E, 4) per edge: row groups, column groups, finite group pairs, positive pairs."""
    out = np.zeros((len(sel.edge_cost), 4), dtype=np.int64)
    for e, t in enumerate(sel.edge_cost):
        table = sel.groups(e)[2] if groups else t
        out[e] = (*table.shape, np.isfinite(table).sum(), (table > 0).sum())
    return out


DIRECT_TERMS = 2_000_000  # explicit memory rows up to this many terms (else a chain)


def memory_form(sel: Selection, requested: str = "auto") -> str:
    """How the encoders write the memory rule: "rows" (one per binding check time: the
    strongest propagation, and knapsack rows for CBC's cuts) unless they would hold more than
    DIRECT_TERMS terms, else the "chain" (a running sum, O(n) terms); `requested` overrides
    "auto"."""
    if requested != "auto":
        return requested
    return "rows" if sum(m.row_terms() for m in sel.memory) <= DIRECT_TERMS else "chain"


def _chain_terms(m: Memory) -> int:
    return 2 * sum(len(c) for c in m.coef) + 3 * m.num_times
