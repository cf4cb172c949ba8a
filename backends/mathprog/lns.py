"""A large-neighbourhood search over nodes for the additive objective, with CP-SAT sub-solves.

`neighbourhood_search(problem, sel, choices, deadline)` improves a valid answer: each round
frees a set of nodes, fixes every other node at its current choice and solves the small
problem that remains exactly (`sub_selection`, solved by the caller's `SubSolve`: the `cpsat`
backend gives one CP-SAT worker for at most SUB_SECONDS), and keeps the answer when it is
better. Fixing a node folds its edges into its free neighbours' costs and its memory into the
limit, so a round's model has the size of its free nodes, their edges and live ranges,
whatever the problem's size (building it adds O(n) vectorized work for the fixed nodes'
memory); the sub-problem's optimum is never worse than the current answer (which stays
inside it). A neighbourhood that has grown to every node is solved with all
the time left (a small problem is thus solved whole, as without the search).

Neighbourhoods alternate between a breadth-first ball in the graph of edges (nodes that share
resharding costs) and a window of nodes that start one after the other in time (nodes that
share memory), both grown to a number of model terms (`backends.model.selection.model_terms`: what
encoding and solving cost) that adapts: it grows when a sub-problem was proven optimal quickly
and shrinks when its encoding or solve ran out of time. (FlexFlow's and OptCNN's searches
change one node at a time; this is the classic large-neighbourhood search of constraint
programming, which CP-SAT runs internally only with two or more workers.) When a
neighbourhood holds every node and is proven optimal, so is the answer.

The rounds are seeded (`seed`: the neighbourhoods and each sub-solve), but each sub-solve has a
time limit, so the path depends on the machine's speed. They stop at `deadline`, at a stop
request (Ctrl-C) or when `stop` (an Event: `SolveOptions.channel.stop`) is set.
`incoming()` (optional: `SolveOptions.channel.incoming`) returns a better answer found
elsewhere (the portfolio's other members), which the search then continues from. Each round
gets SolveOptions with one thread, its seed, its time limit, the channel's `stop` and the
gap tolerance; the round solver's settings are its own (`cpsat`: its defaults without the LP
start). Given a proven `bound` (the whole model's, before the search), the search stops once
its answer is within the gap tolerance of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from backends.base import (
    BackendError,
    Channel,
    ProgressLog,
    SolveOptions,
    StopFlag,
    past,
    proven_within,
)
from backends.model.selection import Memory, Selection, edge_sizes, range_sum
from backends.trace import offer_answer
from planner.deadline import OutOfTime

if TYPE_CHECKING:
    from planner.problems.problem import Problem

__all__ = [
    "LnsOutcome",
    "SubRun",
    "SubSolve",
    "lns_enabled",
    "neighbourhood_search",
    "sub_selection",
]

START_TERMS = 20_000  # model terms of the first round's neighbourhood (about 30 nodes of a
# contest problem; CP-SAT encodes and solves ~50,000 terms a second on one core)
MIN_TERMS = 200
GROW, SHRINK = 1.15, 0.85  # the size after a quick proof / after a solve that ran out of time
QUICK = 0.5  # a proof within this share of the sub-solve's limit counts as quick
SUB_SECONDS = 1.0  # time limit of one sub-solve (less when less is left)
MIN_SUB_SECONDS = 0.05  # no round starts with less time than this left


@dataclass(frozen=True)
class SubRun:
    """One round's exact sub-solve: its answer (None if none), whether it was proven optimal
    (within the gap tolerance), the seconds its solver ran, and its proven bound (in the
    sub-problem's costs; None if none)."""

    choices: tuple[int, ...] | None
    optimal: bool
    wall: float
    bound: float | None = None


class SubSolve(Protocol):
    """Solves a round's sub-problem: encode within `seconds` (raise OutOfTime past them),
    then search for `seconds`, never past `latest` (a `time.perf_counter()` value)."""

    def __call__(
        self,
        sub: Selection,
        options: SolveOptions,
        hint: tuple[tuple[int, ...], str],
        seconds: float,
        latest: float,
    ) -> SubRun: ...


@dataclass
class LnsOutcome:
    """The best answer of a search, whether it was proven optimal (within the gap tolerance:
    by a whole-problem round, or by `bound`), the best bound known (the caller's, or a
    whole-problem round's), and what the rounds did."""

    choices: tuple[int, ...]
    value: float
    proven: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    bound: float | None = None


class _Graph:
    """Each node's neighbours (CSR) and incident edges, the nodes in time order, and the
    model terms (`backends.model.selection.model_terms`) of each node and edge."""

    def __init__(self, sel: Selection, starts: np.ndarray | None):
        n = sel.num_nodes
        ends = np.array(sel.edges, dtype=np.int64).reshape(-1, 2)
        src = np.concatenate([ends[:, 0], ends[:, 1]])
        dst = np.concatenate([ends[:, 1], ends[:, 0]])
        eid = np.concatenate([np.arange(len(ends)), np.arange(len(ends))])
        order = np.argsort(src, kind="stable")
        self.dst, self.eid = dst[order], eid[order]
        self.ptr = np.searchsorted(src[order], np.arange(n + 1))
        key = np.arange(n) if starts is None else starts
        self.order = np.argsort(key, kind="stable")
        self.rank = np.empty(n, dtype=np.int64)
        self.rank[self.order] = np.arange(n)
        self.node_terms = np.array([len(c) for c in sel.node_cost], dtype=np.int64)
        sizes = edge_sizes(sel).reshape(-1, 4)
        self.edge_terms = 2 * sizes[:, 2] + sizes[:, 0] + sizes[:, 1]
        self.total = int(self.node_terms.sum() + self.edge_terms.sum())

    def neighbours(self, i: int) -> np.ndarray:
        return self.dst[self.ptr[i] : self.ptr[i + 1]]

    def _cost(self, v: int, picked: np.ndarray) -> int:
        """The terms node v adds to a neighbourhood: its own and its edges into `picked`."""
        lo, hi = self.ptr[v], self.ptr[v + 1]
        inside = picked[self.dst[lo:hi]]
        return int(self.node_terms[v] + self.edge_terms[self.eid[lo:hi][inside]].sum())

    def ball(self, rng: np.random.Generator, budget: int) -> np.ndarray:
        """A breadth-first ball from a random node, while its model has at most `budget`
        terms (random jumps when the component is exhausted; at least one node)."""
        n = len(self.rank)
        picked = np.zeros(n, dtype=bool)
        out: list[int] = []
        terms = 0
        front: list[int] = []
        while True:
            if not front:
                rest = np.flatnonzero(~picked)
                if len(rest) == 0:
                    break
                front = [int(rng.choice(rest))]
                cost = self._cost(front[0], picked)
                if out and terms + cost > budget:
                    break
                picked[front[0]] = True
                out.append(front[0])
                terms += cost
            nxt: list[int] = []
            full = False
            for u in front:
                nb = self.neighbours(u)
                for v in rng.permutation(nb[~picked[nb]]).tolist():
                    if picked[v]:
                        continue
                    cost = self._cost(v, picked)
                    if terms + cost > budget:
                        full = True
                        break
                    picked[v] = True
                    out.append(v)
                    nxt.append(v)
                    terms += cost
                if full:
                    break
            if full:
                break
            front = nxt
        return np.sort(np.array(out, dtype=np.int64))

    def window(self, rng: np.random.Generator, budget: int) -> np.ndarray:
        """Nodes consecutive in time (or in index order) from a random one on, while their
        model has at most `budget` terms (at least one node)."""
        n = len(self.rank)
        picked = np.zeros(n, dtype=bool)
        first = int(rng.integers(n))
        terms = 0
        for r in range(first, n):
            v = int(self.order[r])
            cost = self._cost(v, picked)
            if r > first and terms + cost > budget:
                break
            picked[v] = True
            terms += cost
        return np.flatnonzero(picked)


def sub_selection(
    sel: Selection, pos: np.ndarray, free: np.ndarray, graph: _Graph | None = None
) -> tuple[Selection, list[np.ndarray]]:
    """The problem left when every node outside `free` (sorted) keeps its position `pos`:
    a Selection over the free nodes (renumbered in order) whose choices are the problem's,
    and per free node the positions (into sel.allowed[i]) its sub-choices stand for.

    Edges to fixed nodes are folded into node costs (choices that would meet a forbidden pair
    are dropped), the fixed nodes' memory is taken off the limit, and the memory check times
    are merged into the segments between the free nodes' starts and ends (the limit of a
    segment is its lowest)."""
    graph = graph if graph is not None else _Graph(sel, None)
    n = sel.num_nodes
    index = np.full(n, -1, dtype=np.int64)
    index[free] = np.arange(len(free))
    cost = [sel.node_cost[i].copy() for i in free]
    inner: list[int] = []
    for k, i in enumerate(free.tolist()):
        lo, hi = graph.ptr[i], graph.ptr[i + 1]
        for j, e in zip(graph.dst[lo:hi].tolist(), graph.eid[lo:hi].tolist(), strict=True):
            u, v = sel.edges[e]
            if index[j] >= 0:
                if i == u:
                    inner.append(e)  # both ends free: kept once, from its first end
                continue
            t = sel.edge_cost[e]
            cost[k] += t[:, pos[j]] if i == u else t[pos[j], :]
    keep = [np.flatnonzero(np.isfinite(c)) for c in cost]
    allowed = tuple(sel.allowed[i][kp] for i, kp in zip(free.tolist(), keep, strict=True))
    node_cost = tuple(c[kp] for c, kp in zip(cost, keep, strict=True))
    edges, tables = [], []
    for e in inner:
        u, v = sel.edges[e]
        edges.append((int(index[u]), int(index[v])))
        tables.append(sel.edge_cost[e][np.ix_(keep[index[u]], keep[index[v]])])
    memory = tuple(m for m in (_sub_memory(mem, pos, index, keep) for mem in sel.memory) if m)
    infeasible = None
    if any(len(kp) == 0 for kp in keep):
        infeasible = "a free node meets a forbidden pair with every choice"
    sub = Selection(allowed, node_cost, tuple(edges), tuple(tables), memory, infeasible)
    return sub, keep


def _sub_memory(
    mem: Memory, pos: np.ndarray, index: np.ndarray, keep: list[np.ndarray]
) -> Memory | None:
    """One pool's memory rule over the free nodes, in segments between their events."""
    listed = np.flatnonzero(index[mem.nodes] >= 0)
    if len(listed) == 0:
        return None
    use = np.array([c[pos[i]] for i, c in zip(mem.nodes, mem.coef, strict=True)])
    first, last = mem.first[listed], mem.last[listed]
    out = index[mem.nodes] < 0  # the fixed nodes' usage, summed directly (no cancellation)
    rhs = mem.rhs - range_sum(mem.first[out], mem.last[out], use[out], mem.num_times)
    cuts = np.unique(np.concatenate([first, last, [0]]))
    cuts = cuts[cuts < mem.num_times]
    seg_rhs = np.minimum.reduceat(rhs, cuts)
    seg_first = np.searchsorted(cuts, first)
    seg_last = np.searchsorted(cuts, last)
    coef = tuple(mem.coef[k][keep[index[mem.nodes[k]]]] for k in listed.tolist())
    top = np.array([c.max() if len(c) else 0.0 for c in coef])
    most = range_sum(seg_first, seg_last, top, len(cuts))
    binding = most > seg_rhs
    if not binding.any():
        return None
    nodes = index[mem.nodes[listed]]
    return Memory(mem.pool, seg_rhs, binding, nodes, seg_first, seg_last, coef)


def neighbourhood_search(
    problem: Problem,
    sel: Selection,
    choices: Sequence[int],
    deadline: float,
    *,
    seed: int = 0,
    stop: StopFlag | None = None,
    incoming: Callable[[], Sequence[int] | None] | None = None,
    on_incumbent: Callable[[tuple[int, ...], str], None] | None = None,
    sub_seconds: float = SUB_SECONDS,
    solve_sub: SubSolve,
    bound: float | None = None,
    tolerance: float = 0.0,
) -> LnsOutcome:
    """Improve the valid answer `choices` of `problem` (reduced tables `sel`) until
    `deadline` (a `time.perf_counter()` value), solving each round with `solve_sub`; see the
    module docstring. `bound`, a proven lower bound of the problem's optimum: the search
    stops as soon as its answer is within the relative gap `tolerance` of it (each round's
    sub-solve proves within `tolerance` too)."""

    t0 = time.perf_counter()
    start = sel.positions(choices)
    if start is None:
        raise BackendError("neighbourhood_search needs an answer in the reduced tables")
    pos = np.asarray(start, dtype=np.int64)
    value = sel.position_cost(start)
    starts = None if problem.intervals is None else np.asarray(problem.intervals)[:, 0]
    graph = _Graph(sel, starts)
    rng = np.random.default_rng(seed)
    n = sel.num_nodes
    size = START_TERMS  # the neighbourhoods' model terms
    progress = ProgressLog("lns")
    stats: dict[str, Any] = {"rounds": 0, "improved": 0, "proofs": 0, "timeouts": 0,
                             "taken": 0}  # fmt: skip
    opts = SolveOptions(threads=1, channel=Channel(stop=stop), gap_tolerance=tolerance)
    proven = False

    def stopped() -> bool:
        if proven_within(value, bound, tolerance):
            return True  # within the tolerance of the bound: nothing left worth finding
        return past(deadline - MIN_SUB_SECONDS) or (stop is not None and stop.is_set())

    while n > 0 and not stopped():
        if incoming is not None:
            other = incoming()
            other_pos = sel.positions(other) if other is not None else None
            if other_pos is not None and sel.fits(other_pos):
                other_value = sel.position_cost(other_pos)
                if other_value < value:
                    pos, value = np.asarray(other_pos, dtype=np.int64), other_value
                    stats["taken"] += 1
        stats["rounds"] += 1
        whole = size >= graph.total
        if whole:  # the whole problem, from the best answer, with all the time left
            free = np.arange(n)
        else:
            free = graph.ball(rng, size) if stats["rounds"] % 2 else graph.window(rng, size)
        stats["nodes"] = len(free)
        sub, keep = sub_selection(sel, pos, free, graph)
        if sub.infeasible:  # cannot happen from a valid answer; skip the round
            continue
        at = [int(np.searchsorted(kp, pos[i])) for kp, i in zip(keep, free.tolist(), strict=True)]
        hint = sub.choices(at)
        left = deadline - time.perf_counter()
        limit = left if whole else min(sub_seconds, left)
        o = replace(opts, seed=seed + stats["rounds"])  # its time: `limit` and `deadline`
        try:
            run = solve_sub(sub, o, (hint, "lns"), limit, deadline)
        except OutOfTime:  # too large to encode in a round's time: a smaller one
            stats["timeouts"] += 1
            size = max(MIN_TERMS, int(size * SHRINK * SHRINK))
            continue
        found = run.choices
        if run.optimal:
            stats["proofs"] += 1
            if whole:  # the sub-problem is the problem: its bound is the problem's
                proven = True
                if run.bound is not None:
                    bound = run.bound if bound is None else max(bound, run.bound)
        moved = sub.positions(found) if found is not None else None
        if moved is not None:
            # the sub-problem's cost differs from the problem's by a constant and its memory
            # rule is the problem's (tests/test_lns.py): O(neighbourhood), not O(problem)
            delta = sub.position_cost(moved) - sub.position_cost(at)
            if delta < -1e-9 * max(1.0, abs(value)) and sub.fits(moved):
                pos[free] = [kp[k] for kp, k in zip(keep, moved, strict=True)]
                value += delta
                stats["improved"] += 1
                # its value is known: the anytime trace need not compute it again, and the
                # choices are read (at once, from `pos` as it is now) only for a listener
                offer_answer(on_incumbent, value, "lns", partial(_choices_of, sel, pos))
                progress(partial(_line, value, stats["rounds"], size))
        if proven:
            break
        if run.optimal and run.wall < QUICK * limit:
            size = min(graph.total, int(size * GROW) + 1)
        elif not run.optimal:
            stats["timeouts"] += 1
            size = max(MIN_TERMS, int(size * SHRINK))
    stats.update(terms=size, seconds=time.perf_counter() - t0)
    final = pos.tolist()  # the value summed once more, without the rounds' rounding
    value = sel.position_cost(final)
    proven = proven or proven_within(value, bound, tolerance)
    return LnsOutcome(sel.choices(final), value, proven, stats, bound)


def _line(value: float, rounds: int, terms: int) -> str:
    return f"best {value:.6g} (round {rounds}, {terms} terms)"


def lns_enabled(setting: bool | str, threads: int) -> bool:
    """Whether the search runs, by the setting "lns" (`CpsatSettings.lns`): True / False, or
    "auto" (the default): on with one thread, where CP-SAT runs no neighbourhood search of
    its own."""
    if setting == "auto":
        return threads <= 1
    if isinstance(setting, bool):
        return setting
    raise BackendError(f"setting 'lns' must be True, False or 'auto', got {setting!r}")


def _choices_of(sel: Selection, pos: np.ndarray) -> tuple[int, ...]:
    """The problem's choices of the positions `pos` as they are when called."""
    return sel.choices(pos.tolist())
