"""The memory rule over a `Network`: time steps, live usage, prices, repair and polish.

Only the distinct interval starts matter (`planner.problems.evaluate.live_usage`): the
nodes live at any time are a subset of those live at the latest start before it. Node i is
live at the steps `[first[i], after[i])` of those starts, so its share of per-step prices is
a difference of prefix sums and a usage profile is a difference array: linear in the nodes.

`repair` turns a labelling into one within the limit, greedily: while some step is over
full, it moves the node live there whose cheaper-in-memory value costs least per byte saved
(the change of its unary and edge costs given its neighbours, which may be a gain), never to a
forbidden value or pair. `polish` then takes single-node moves that lower the cost and keep
every live step within the limit (first improvement, node order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from planner.problems.problem import Problem

__all__ = ["Steps", "node_prices", "polish", "profile", "repair", "steps"]

TOL = 1e-9  # relative tolerance of the limit, as planner.problems.evaluate.memory_feasible


@dataclass(frozen=True)
class Steps:
    """The time steps that matter: node i is live at steps [first[i], after[i]); `limit`
    per pool (M,) (inf without a limit)."""

    first: np.ndarray
    after: np.ndarray
    limit: np.ndarray

    @property
    def count(self) -> int:
        return int(self.after.max(initial=0)) if len(self.after) else 0


def steps(problem: Problem) -> Steps | None:
    """The problem's time steps, or None when it has no memory limit."""
    if problem.usage_limit is None or problem.usage is None or problem.intervals is None:
        return None
    start, end = problem.intervals[:, 0], problem.intervals[:, 1]
    times = np.unique(start)
    first = np.searchsorted(times, start, side="left").astype(np.int64)
    after = np.searchsorted(times, end, side="left").astype(np.int64)
    after = np.maximum(after, first)  # an empty interval is never live
    limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1) * (1 + TOL)
    return Steps(first, after, limit)


def node_prices(st: Steps, lam: np.ndarray) -> np.ndarray:
    """(n, M) sum of the per-step prices `lam` (T, M) over each node's live steps."""
    cum = np.vstack([np.zeros((1, lam.shape[1])), np.cumsum(lam, axis=0)])
    return cum[st.after] - cum[st.first]


def profile(st: Steps, use: np.ndarray, count: int) -> np.ndarray:
    """(T, M) live usage per step from per-node usages (n, M)."""
    delta = np.zeros((count + 1, use.shape[1]))
    np.add.at(delta, st.first, use)
    np.add.at(delta, st.after, -use)
    return np.cumsum(delta, axis=0)[:count]


@njit(cache=True)
def _delta(i, s, x, noff, unary, eu, ev, eoff, binary, ioff, iedge, iside):  # pragma: no cover
    """The change of cost when node i moves from x[i] to s (inf if s breaks a pair)."""
    cur = x[i]
    d = unary[noff[i] + s] - unary[noff[i] + cur]
    for k in range(ioff[i], ioff[i + 1]):
        e = iedge[k]
        dv = noff[ev[e] + 1] - noff[ev[e]]
        if iside[k] == 0:
            new = binary[eoff[e] + s * dv + x[ev[e]]]
            old = binary[eoff[e] + cur * dv + x[ev[e]]]
        else:
            new = binary[eoff[e] + x[eu[e]] * dv + s]
            old = binary[eoff[e] + x[eu[e]] * dv + cur]
        if new == np.inf:
            return np.inf
        d += new - old
    return d


@njit(cache=True)
def repair(
    x,
    prof,
    first,
    after,
    limit,
    usage,
    noff,
    unary,
    eu,
    ev,
    eoff,
    binary,
    ioff,
    iedge,
    iside,
    max_moves,
):  # pragma: no cover - compiled
    """Move nodes until every step is within `limit` (module docstring); x and prof (T, M)
    are updated in place. Returns True when within the limit."""
    n = len(noff) - 1
    pools = prof.shape[1]
    for _ in range(max_moves):
        worst, wt, wm = 0.0, -1, -1
        for t in range(prof.shape[0]):
            for m in range(pools):
                over = prof[t, m] - limit[m]
                if over > worst:
                    worst, wt, wm = over, t, m
        if wt < 0:
            return True
        best_i, best_s, best_score = -1, -1, np.inf
        for i in range(n):
            if not (first[i] <= wt < after[i]):
                continue
            cur = noff[i] + x[i]
            for s in range(noff[i + 1] - noff[i]):
                saved = usage[cur, wm] - usage[noff[i] + s, wm]
                if saved <= 0:
                    continue
                d = _delta(i, s, x, noff, unary, eu, ev, eoff, binary, ioff, iedge, iside)
                if d == np.inf:
                    continue
                score = d / min(saved, worst) if d > 0 else d * min(saved, worst)
                if score < best_score:
                    best_i, best_s, best_score = i, s, score
        if best_i < 0:
            return False
        old = noff[best_i] + x[best_i]
        new = noff[best_i] + best_s
        for t in range(first[best_i], after[best_i]):
            for m in range(pools):
                prof[t, m] += usage[new, m] - usage[old, m]
        x[best_i] = best_s
    return False


@njit(cache=True)
def polish(
    x, prof, first, after, limit, usage, noff, unary, eu, ev, eoff, binary, ioff, iedge, iside
):  # pragma: no cover - compiled
    """One sweep of improving single-node moves that keep the limit; returns the gain."""
    n = len(noff) - 1
    pools = prof.shape[1]
    gain = 0.0
    for i in range(n):
        best_s, best_d = -1, 0.0
        cur = noff[i] + x[i]
        for s in range(noff[i + 1] - noff[i]):
            if s == x[i]:
                continue
            d = _delta(i, s, x, noff, unary, eu, ev, eoff, binary, ioff, iedge, iside)
            if not d < best_d:
                continue
            fits = True
            for m in range(pools):
                grow = usage[noff[i] + s, m] - usage[cur, m]
                if grow <= 0:
                    continue
                for t in range(first[i], after[i]):
                    if prof[t, m] + grow > limit[m]:
                        fits = False
                        break
                if not fits:
                    break
            if fits:
                best_s, best_d = s, d
        if best_s >= 0:
            for t in range(first[i], after[i]):
                for m in range(pools):
                    prof[t, m] += usage[noff[i] + best_s, m] - usage[cur, m]
            x[i] = best_s
            gain -= best_d
    return gain
