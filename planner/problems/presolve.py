"""Presolve: a smaller cost-table problem with the same optimum, and the map back.

    reduced = presolve(problem)          # a Presolved
    reduced.problem                      # same nodes and edges, fewer strategies per node
    answer = solve(reduced.problem)      # any backend
    reduced.expand(answer)               # choices of the original problem, same cost

Three rules remove strategies that no optimal answer needs, iterated to a fixpoint:

- **forbidden** (arc consistency on the forbidden pairs): a strategy whose node cost is inf,
  or whose every pairing with the remaining strategies of a neighbour is inf on some edge
  (either orientation), is in no valid answer;
- **memory**: a strategy of a live node whose usage, added to the least usage every other
  live node can have at some time of its interval, exceeds the limit (with the evaluator's
  tolerance), is in no answer that fits in memory;
- **dominated**: strategy a of a node is removed when another strategy b of the same node is
  no worse in every respect: cost, usage in every pool (only when the node is ever live and
  there is a limit), and every entry of its row (or column) of every incident edge over the
  neighbour's remaining strategies. Any answer using a stays valid, with a cost no higher,
  when it uses b instead. Among equal strategies the first is kept.

Nodes and edges are kept (a node left with one strategy is "fixed": its edges are then
linear terms of its neighbours, which the backends see as such), so the map back is a
lookup: `expand(choices)[i] = kept[i][choices[i]]`. A node left with no strategy means the
problem has no valid answer: a ProblemError says which node and why. The reduced problem is
a cost-table problem (a DNN problem's `origin` is not kept: map its answers back with
`expand` and use the original). See docs/costtable.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.deadline import Deadline
from planner.errors import ProblemError
from planner.problems.evaluate import live_usage
from planner.problems.problem import Problem

__all__ = ["Presolved", "presolve"]

RTOL = 1e-9  # the memory tolerance of planner.problems.evaluate.memory_feasible
_CHUNK = 1 << 22  # elements compared at once when testing dominance


@dataclass(frozen=True, eq=False)
class Presolved:
    """The reduced problem, the original strategies it kept, and what each rule removed."""

    problem: Problem
    original: Problem
    kept: tuple[np.ndarray, ...]  # kept[i][k]: the original index of reduced strategy k
    removed: dict[str, int] = field(default_factory=dict)  # strategies removed, per rule
    fixed_nodes: int = 0  # nodes with several strategies left with one
    rounds: int = 0
    seconds: float = 0.0
    complete: bool = True  # False when the deadline stopped it before the fixpoint

    def expand(self, choices: Sequence[int]) -> tuple[int, ...]:
        """The original problem's choices for choices of the reduced one (same cost)."""
        ch = self.problem.check_choices(choices)
        return tuple(int(k[c]) for k, c in zip(self.kept, ch, strict=True))

    def restrict(self, choices: Sequence[int]) -> tuple[int, ...] | None:
        """The reduced problem's choices for original ones (a hint for a backend); None when
        they use a removed strategy."""
        ch = self.original.check_choices(choices)
        out = []
        for k, c in zip(self.kept, ch, strict=True):
            where = np.flatnonzero(k == c)
            if not len(where):
                return None
            out.append(int(where[0]))
        return tuple(out)

    def summary(self) -> dict[str, float | int | bool]:
        """Counts for a log line or a results row."""
        before, after = sum(self.original.sizes), sum(self.problem.sizes)
        return {
            "strategies_before": before,
            "strategies_after": after,
            **{f"removed_{k}": v for k, v in self.removed.items()},
            "fixed_nodes": self.fixed_nodes,
            "rounds": self.rounds,
            "seconds": round(self.seconds, 3),
            "complete": self.complete,
        }


def presolve(
    problem: Problem, dominance: bool = True, deadline: Deadline | None = None
) -> Presolved:
    """Remove forbidden, memory-infeasible and (with `dominance`) dominated strategies to a
    fixpoint (see the module docstring). Past `deadline` it stops between steps and returns
    what it has (every removal so far is safe; `complete` is then False). A node left with
    no strategy raises ProblemError: the problem has no valid answer."""
    t0 = time.perf_counter()
    state = _State(problem)
    removed = {"forbidden": 0, "memory": 0, "dominated": 0}
    rounds, complete = 0, True
    removed["forbidden"] += state.remove(~np.isfinite(state.cost), "forbidden")
    dirty = np.ones(problem.num_nodes, dtype=bool)  # nodes whose dominance may have changed
    while True:
        if deadline is not None and deadline.expired():
            complete = False
            break
        rounds += 1
        before = state.alive.copy()
        removed["forbidden"] += state.arc_consistency()
        removed["memory"] += state.memory()
        if not dominance:
            if (state.alive == before).all():
                break
            continue
        dirty |= state.touched(before)
        dominated, dirty = state.dominance(dirty, deadline)
        removed["dominated"] += dominated
        if (state.alive == before).all():
            break
    kept = tuple(np.flatnonzero(a) for a in np.split(state.alive, state.off[1:-1]))
    fixed = sum(1 for k, s in zip(kept, problem.sizes, strict=True) if len(k) == 1 and s > 1)
    return Presolved(
        problem=_reduced(problem, kept),
        original=problem,
        kept=kept,
        removed=removed,
        fixed_nodes=fixed,
        rounds=rounds,
        seconds=time.perf_counter() - t0,
        complete=complete,
    )


class _State:
    """Which strategies are still alive, as one flat mask over every node's strategies
    (node i's are `off[i]:off[i + 1]`), and the flat views of the tables the rules sweep."""

    def __init__(self, problem: Problem):
        p = self.p = problem
        sizes = np.array(p.sizes, dtype=np.int64)
        self.off = np.concatenate([[0], np.cumsum(sizes)])
        self.node_of = np.repeat(np.arange(p.num_nodes), sizes)
        self.cost = np.concatenate(p.node_cost)
        self.alive = np.ones(len(self.cost), dtype=bool)
        self.incident: list[list[int]] = [[] for _ in range(p.num_nodes)]
        for e, (u, v) in enumerate(p.edges):
            self.incident[u].append(e)
            self.incident[v].append(e)
        self._edge_entries(sizes)
        self.memory_limited = (
            p.usage is not None and p.intervals is not None and p.usage_limit is not None
        )
        self.live = (
            p.intervals[:, 1] > p.intervals[:, 0]
            if p.intervals is not None
            else np.zeros(p.num_nodes, dtype=bool)
        )
        self.usage = (
            np.concatenate([np.asarray(u, dtype=np.float64).reshape(len(u), -1) for u in p.usage])
            if p.usage is not None
            else None
        )

    def _edge_entries(self, sizes: np.ndarray) -> None:
        """Every edge entry in one flat array, row-major by edge: the strategy (flat index)
        of its row and of its column, and where each row and each column starts."""
        p = self.p
        pairs = np.array(p.edges, dtype=np.int64).reshape(-1, 2)
        rows_e, cols_e = sizes[pairs[:, 0]], sizes[pairs[:, 1]]
        count = rows_e * cols_e
        self.finite = (
            np.concatenate([np.isfinite(t).reshape(-1) for t in p.edge_cost])
            if len(pairs)
            else np.zeros(0, dtype=bool)
        )
        entry_edge = np.repeat(np.arange(len(pairs)), count)
        edge_off = np.cumsum(count) - count
        k = np.arange(len(self.finite)) - edge_off[entry_edge]
        width, height = cols_e[entry_edge], rows_e[entry_edge]
        a, b = k // width, k % width
        self.row_of = self.off[pairs[entry_edge, 0]] + a
        self.col_of = self.off[pairs[entry_edge, 1]] + b
        self.row_starts = np.flatnonzero(b == 0)
        # the same entries column-major by edge ((edge, column, row) order): a permutation
        self.by_col = np.empty(len(k), dtype=np.int64)
        self.by_col[edge_off[entry_edge] + b * height + a] = np.arange(len(k))
        first_row = a == 0  # in row-major order (edge, 0, b) come by edge, then b: sorted
        self.col_starts = (edge_off[entry_edge] + b * height)[first_row]

    def remove(self, gone: np.ndarray, rule: str) -> int:
        """Mark flat strategies `gone` removed; raise if a node is left with none."""
        gone = gone & self.alive
        count = int(np.count_nonzero(gone))
        if count:
            self.alive &= ~gone
            left = np.add.reduceat(self.alive, self.off[:-1])
            if (left == 0).any():
                self._no_answer(int(np.flatnonzero(left == 0)[0]), rule)
        return count

    def _no_answer(self, i: int, rule: str) -> None:
        p = self.p
        why = {
            "forbidden": "each of its strategies has a forbidden (inf) cost or is forbidden "
            "with every remaining strategy of a neighbour (nodes "
            + ", ".join(
                repr(p.node_names[u if u != i else v])
                for u, v in (p.edges[e] for e in self.incident[i][:5])
            )
            + ("..." if len(self.incident[i]) > 5 else "")
            + ")",
            "memory": "every strategy overflows the memory limit",
            "dominated": "all dominated (a bug: the best of them is always kept)",
        }[rule]
        raise ProblemError(
            f"problem {p.name!r} has no valid answer: node {p.node_names[i]!r} has no "
            f"strategy left: {why}"
        )

    def touched(self, before: np.ndarray) -> np.ndarray:
        """Nodes that lost strategies since `before`, and their neighbours."""
        lost = np.zeros(self.p.num_nodes, dtype=bool)
        lost[self.node_of[before & ~self.alive]] = True
        out = lost.copy()
        for i in np.flatnonzero(lost).tolist():
            for e in self.incident[i]:
                out[list(self.p.edges[e])] = True
        return out

    def arc_consistency(self) -> int:
        """Remove strategies with no allowed pairing on some edge (either end), sweeping
        every edge at once until nothing changes."""
        removed = 0
        while len(self.finite):
            ok = self.finite & self.alive[self.row_of] & self.alive[self.col_of]
            dead = np.zeros(len(self.alive), dtype=bool)
            rows = np.logical_or.reduceat(ok, self.row_starts)
            dead[self.row_of[self.row_starts[~rows]]] = True
            cols = np.logical_or.reduceat(ok[self.by_col], self.col_starts)
            dead[self.col_of[self.by_col[self.col_starts[~cols]]]] = True
            count = self.remove(dead, "forbidden")
            if not count:
                break
            removed += count
        return removed

    def memory(self) -> int:
        """Remove strategies that overflow the limit even when every other node live at some
        time of their interval takes its least usage."""
        if not self.memory_limited:
            return 0
        p = self.p
        assert self.usage is not None and p.intervals is not None and p.usage_limit is not None
        masked = np.where(self.alive[:, None], self.usage, np.inf)
        least = np.minimum.reduceat(masked, self.off[:-1], axis=0)  # (n, M)
        times = np.unique(p.intervals[:, 0])
        base = live_usage(p.intervals, least)  # (T, M) at each distinct start
        first = np.searchsorted(times, p.intervals[:, 0], side="left")
        last = np.searchsorted(times, p.intervals[:, 1], side="left")  # exclusive
        peak = _range_max(base, first, np.maximum(last, first + 1))  # (n, M)
        limit = np.asarray(p.usage_limit, dtype=np.float64).reshape(-1) * (1 + RTOL)
        room = limit[None, :] - peak  # what a live node may add to its least usage
        short = np.flatnonzero(self.live & (room.min(axis=1) < 0))
        if len(short):
            raise ProblemError(
                f"problem {p.name!r} has no valid answer: the least usage of the nodes live "
                f"with node {p.node_names[short[0]]!r} exceeds the limit "
                f"{float(np.asarray(p.usage_limit).reshape(-1)[0]):.6g}"
            )
        over = ((self.usage - least[self.node_of]) > room[self.node_of]).any(axis=1)
        return self.remove(over & self.live[self.node_of], "memory")

    def dominance(self, dirty: np.ndarray, deadline: Deadline | None) -> tuple[int, np.ndarray]:
        """Remove every strategy beaten by another of its node (module docstring), for the
        `dirty` nodes; the nodes to look at again (neighbours of those that lost some)."""
        p = self.p
        removed = 0
        again = np.zeros(p.num_nodes, dtype=bool)
        sizes = np.add.reduceat(self.alive, self.off[:-1])
        for n_seen, i in enumerate(np.flatnonzero(dirty & (sizes > 1)).tolist()):
            if n_seen % 256 == 0 and deadline is not None and deadline.expired():
                again[i:] = dirty[i:]
                break
            idx = np.flatnonzero(self.alive[self.off[i] : self.off[i + 1]])
            no_worse = self._node_no_worse(i, idx)
            if not no_worse.any():
                continue
            # b beats a: b no worse than a, and (a not no worse than b, or b comes first)
            beats = no_worse & (~no_worse.T | np.tri(len(idx), k=-1, dtype=bool).T)
            gone = np.zeros(len(self.alive), dtype=bool)
            gone[self.off[i] + idx[beats.any(axis=0)]] = True
            count = self.remove(gone, "dominated")  # never all: the unbeaten ones stay
            if count:
                removed += count
                for e in self.incident[i]:
                    again[list(p.edges[e])] = True
        return removed, again

    def _node_no_worse(self, i: int, idx: np.ndarray) -> np.ndarray:
        """[b, a]: strategy idx[b] of node i is no worse than idx[a] (b != a)."""
        p = self.p
        flat = self.off[i] + idx
        cost = self.cost[flat]
        no_worse = cost[:, None] <= cost[None, :]
        if self.memory_limited and self.live[i]:
            assert self.usage is not None
            use = self.usage[flat]
            no_worse &= (use[:, None, :] <= use[None, :, :]).all(axis=2)
        np.fill_diagonal(no_worse, False)
        for e in self.incident[i]:
            if not no_worse.any():
                break
            u, v = p.edges[e]
            t = p.edge_cost[e]
            if u == i:  # i's rows against v's remaining strategies
                rows = t[idx][:, self.alive[self.off[v] : self.off[v + 1]]]
            else:  # i's columns against u's remaining strategies
                rows = t[self.alive[self.off[u] : self.off[u + 1]]][:, idx].T
            no_worse &= _rows_no_worse(rows, no_worse)
        return no_worse


def _rows_no_worse(rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """[b, a]: row b <= row a everywhere, computed for the candidate pairs only."""
    k, m = rows.shape
    if k * k * m <= _CHUNK:
        return np.asarray((rows[:, None, :] <= rows[None, :, :]).all(axis=2))
    out = np.zeros_like(candidates)
    bs, as_ = np.nonzero(candidates)
    step = max(1, _CHUNK // max(1, m))
    for s in range(0, len(bs), step):
        b, a = bs[s : s + step], as_[s : s + step]
        out[b, a] = (rows[b] <= rows[a]).all(axis=1)
    return out


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo[k]:hi[k]]) per query (hi > lo), by a sparse table: (T, M) -> (Q, M)."""
    levels = [values]
    while 2 ** len(levels) <= len(values):
        prev, half = levels[-1], 2 ** (len(levels) - 1)
        levels.append(np.maximum(prev[:-half], prev[half:]))
    span = hi - lo
    k = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
    out = np.empty((len(lo), values.shape[1]))
    for level in np.unique(k).tolist():
        q = np.flatnonzero(k == level)
        table = levels[level]
        out[q] = np.maximum(table[lo[q]], table[hi[q] - 2**level])
    return out


def _reduced(p: Problem, kept: tuple[np.ndarray, ...]) -> Problem:
    full = [len(k) == size for k, size in zip(kept, p.sizes, strict=True)]
    if all(full):
        return p

    def table(e: int) -> np.ndarray:
        (u, v), t = p.edges[e], p.edge_cost[e]
        t = t if full[u] else t[kept[u]]
        return t if full[v] else t[:, kept[v]]

    return Problem(
        name=p.name,
        node_names=p.node_names,
        node_cost=tuple(c[k] for c, k in zip(p.node_cost, kept, strict=True)),
        edges=p.edges,
        edge_cost=tuple(table(e) for e in range(len(p.edges))),
        usage=None if p.usage is None else tuple(u[k] for u, k in zip(p.usage, kept, strict=True)),
        intervals=p.intervals,
        usage_limit=p.usage_limit,
    )
