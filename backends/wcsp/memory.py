"""The memory rule over a `Network`: time steps, live usage, prices, repair and polish.

Only the distinct interval starts matter (`planner.problems.evaluate.live_usage`): the
nodes live at any time are a subset of those live at the latest start before it. Node i is
live at the steps `[first[i], after[i])` of those starts, so its share of per-step prices is
a difference of prefix sums and a usage profile is a difference array: linear in the nodes.

`repair` turns a labelling into one within the limit, greedily: while some step is over
full, it moves the node live there whose cheaper-in-memory value costs least per byte saved
(the change of its unary and edge costs given its neighbours, which may be a gain); a
neighbour the move would put on a forbidden pair moves along to its best allowed value, and
so on outwards (contest tables tie long runs of nodes to equal layouts), or the move is not
made. `polish` then takes single-node moves that lower the cost and keep
every live step within the limit (first improvement, node order).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from planner.problems.problem import Problem

__all__ = [
    "Steps",
    "edge_cost",
    "kernel_arrays",
    "node_prices",
    "polish",
    "profile",
    "repair",
    "steps",
]

CONFLICT = 1e30  # the price of a pair a neighbour must then leave
TOL = 1e-9  # relative tolerance of the limit, as planner.problems.evaluate.memory_feasible
TRIED = 64  # repair: the best-ranked moves whose total excess is computed, per move (each
# costs the length of the moved nodes' live ranges: up to 25,000 steps on IOPDDL S)


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


def kernel_arrays(
    noff: np.ndarray,
    unary: np.ndarray,
    eu: np.ndarray,
    ev: np.ndarray,
    eoff: np.ndarray,
    binary: np.ndarray,
    incidence: tuple[np.ndarray, ...],
) -> tuple[np.ndarray, ...]:
    """What the compiled moves read of a network, as one tuple `g`: (noff, unary, eu, ev,
    eoff, binary, ioff, iedge, iside), the last three from `trws.incidence`."""
    return (noff, unary, eu, ev, eoff, binary, *incidence[:3])


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
def _delta(i, s, x, g):  # pragma: no cover - compiled
    """The change of cost when node i moves from x[i] to s (inf if s breaks a pair)."""
    noff, unary, eu, ev, eoff, binary, ioff, iedge, iside = g
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
def _label(j, x, tent, stamp, now):  # pragma: no cover - compiled
    return tent[j] if stamp[j] == now else x[j]


@njit(cache=True)
def edge_cost(e, a, b, g):  # pragma: no cover - compiled
    """Edge e's cost with its lower end at a and its higher end at b."""
    noff, unary, eu, ev, eoff, binary, ioff, iedge, iside = g
    dv = noff[ev[e] + 1] - noff[ev[e]]
    return binary[eoff[e] + a * dv + b]


@njit(cache=True)
def _propagate(i, s, x, tent, stamp, now, changed, g, cap):  # pragma: no cover - compiled
    """Node i to value s, and every neighbour that now meets a forbidden pair to its best
    value that meets none, in turn (at most `cap` nodes): the count of nodes changed (listed
    in `changed`, their values in `tent` where stamp == now) and the change of cost;
    count 0 when some neighbour has no such value."""
    noff, unary, eu, ev, eoff, binary, ioff, iedge, iside = g
    stamp[i] = now
    tent[i] = s
    changed[0] = i
    count = 1
    head = 0
    while head < count:
        j = changed[head]
        head += 1
        for k in range(ioff[j], ioff[j + 1]):
            e = iedge[k]
            other = ev[e] if iside[k] == 0 else eu[e]
            a = _label(eu[e], x, tent, stamp, now)
            b = _label(ev[e], x, tent, stamp, now)
            if edge_cost(e, a, b, g) != np.inf:
                continue
            if stamp[other] == now or count >= cap:
                return 0, 0.0
            best_v, best_c = -1, np.inf
            for v in range(noff[other + 1] - noff[other]):
                c = unary[noff[other] + v]
                for q in range(ioff[other], ioff[other + 1]):
                    f = iedge[q]
                    if iside[q] == 0:
                        far = ev[f]
                        p = edge_cost(f, v, _label(far, x, tent, stamp, now), g)
                    else:
                        far = eu[f]
                        p = edge_cost(f, _label(far, x, tent, stamp, now), v, g)
                    if p == np.inf:
                        if stamp[far] == now:
                            c = np.inf  # a node this move already set: never
                            break
                        p = CONFLICT  # an unmoved one: it will move along, if it can
                    c += p
                if c < best_c:
                    best_v, best_c = v, c
            if best_v < 0:
                return 0, 0.0
            stamp[other] = now
            tent[other] = best_v
            changed[count] = other
            count += 1
    delta = 0.0
    for h in range(count):
        j = changed[h]
        delta += unary[noff[j] + tent[j]] - unary[noff[j] + x[j]]
        for k in range(ioff[j], ioff[j + 1]):
            e = iedge[k]
            other = ev[e] if iside[k] == 0 else eu[e]
            if stamp[other] == now and other < j:
                continue  # counted from the other end
            a = _label(eu[e], x, tent, stamp, now)
            new = edge_cost(e, a, _label(ev[e], x, tent, stamp, now), g)
            old = edge_cost(e, x[eu[e]], x[ev[e]], g)
            delta += new - (CONFLICT if old == np.inf else old)
    return count, delta


@njit(cache=True)
def _excess_change(
    count, changed, x, tent, first, after, prof, limit, usage, noff
):  # pragma: no cover - compiled
    """The change of the total excess, the sum over steps and pools of max(0, prof - limit),
    when the `count` nodes listed in `changed` take their values in `tent`."""
    lo, hi = prof.shape[0], 0
    for h in range(count):
        j = changed[h]
        if first[j] < after[j]:
            lo, hi = min(lo, first[j]), max(hi, after[j])
    if hi <= lo:
        return 0.0
    pools = prof.shape[1]
    diff = np.zeros((hi - lo + 1, pools))  # the nodes' ranges may overlap: a difference array
    for h in range(count):
        j = changed[h]
        if first[j] < after[j]:
            for m in range(pools):
                du = usage[noff[j] + tent[j], m] - usage[noff[j] + x[j], m]
                diff[first[j] - lo, m] += du
                diff[after[j] - lo, m] -= du
    total = 0.0
    for m in range(pools):
        run = 0.0
        for t in range(lo, hi):
            run += diff[t - lo, m]
            if run != 0.0:
                before = prof[t, m] - limit[m]
                total += max(before + run, 0.0) - max(before, 0.0)
    return total


@njit(cache=True)
def repair(x, prof, first, after, limit, usage, g, max_moves, cap):  # pragma: no cover - compiled
    """Move nodes until every step is within `limit` (module docstring); a move takes along
    the neighbours it would put on a forbidden pair (`_propagate`, at most `cap` nodes).
    Candidates are ranked by their cost per byte saved at the fullest step; the best one
    (of the TRIED best-ranked) that lowers the total excess over the limit (every step,
    every pool: `_excess_change`) is made, so no two moves can undo each other (a chain
    that saved at the fullest step and added at another one was made and unmade forever).
    x and prof (T, M) are updated in place; `g` the network's arrays (`kernel_arrays`).
    Returns 1 when within the limit, 0 when no move helps, -1 after `max_moves` moves
    (call again to go on)."""
    noff = g[0]
    n = len(noff) - 1
    pools = prof.shape[1]
    tent = np.zeros(n, dtype=np.int64)
    stamp = np.zeros(n, dtype=np.int64)
    changed = np.zeros(max(cap, 1), dtype=np.int64)
    scores = np.empty(len(usage))
    cand_i = np.empty(len(usage), dtype=np.int64)
    cand_s = np.empty(len(usage), dtype=np.int64)
    now = 0
    for _ in range(max_moves):
        worst, wt, wm = 0.0, -1, -1
        for t in range(prof.shape[0]):
            for m in range(pools):
                over = prof[t, m] - limit[m]
                if over > worst:
                    worst, wt, wm = over, t, m
        if wt < 0:
            return 1
        found = 0
        for i in range(n):
            if not (first[i] <= wt < after[i]):
                continue
            cur = noff[i] + x[i]
            for s in range(noff[i + 1] - noff[i]):
                if usage[cur, wm] - usage[noff[i] + s, wm] <= 0:
                    continue
                now += 1
                count, d = _propagate(i, s, x, tent, stamp, now, changed, g, cap)
                if count == 0:
                    continue
                saved = 0.0
                for h in range(count):
                    j = changed[h]
                    if first[j] <= wt < after[j]:
                        saved += usage[noff[j] + x[j], wm] - usage[noff[j] + tent[j], wm]
                if saved <= 0:
                    continue
                scores[found] = d / min(saved, worst) if d > 0 else d * min(saved, worst)
                cand_i[found], cand_s[found] = i, s
                found += 1
        count = 0
        for k in np.argsort(scores[:found])[:TRIED]:
            now += 1
            count, d = _propagate(cand_i[k], cand_s[k], x, tent, stamp, now, changed, g, cap)
            excess = _excess_change(count, changed, x, tent, first, after, prof, limit, usage, noff)
            if excess < -1e-9 * worst:  # lower by more than rounding
                break
            count = 0
        if count == 0:
            return 0
        for h in range(count):
            j = changed[h]
            old = noff[j] + x[j]
            new = noff[j] + tent[j]
            for t in range(first[j], after[j]):
                for m in range(pools):
                    prof[t, m] += usage[new, m] - usage[old, m]
            x[j] = tent[j]
    for t in range(prof.shape[0]):
        for m in range(pools):
            if prof[t, m] > limit[m]:
                return -1
    return 1


@njit(cache=True)
def unbreak(x, g, cap):  # pragma: no cover - compiled
    """Take a labelling off its forbidden pairs (min-conflicts): for each such pair, the
    cheapest change of one of its ends that `_propagate` can carry through (its neighbours
    moving along). Returns the number of forbidden pairs left."""
    noff, eu, ev = g[0], g[2], g[3]
    n = len(noff) - 1
    tent = np.zeros(n, dtype=np.int64)
    stamp = np.zeros(n, dtype=np.int64)
    changed = np.zeros(max(cap, 1), dtype=np.int64)
    now = 0
    left = 0
    for e in range(len(eu)):
        if edge_cost(e, x[eu[e]], x[ev[e]], g) != np.inf:
            continue
        best_i, best_s, best_d = -1, -1, np.inf
        for end in range(2):
            i = eu[e] if end == 0 else ev[e]
            for s in range(noff[i + 1] - noff[i]):
                if s == x[i]:
                    continue
                now += 1
                count, d = _propagate(i, s, x, tent, stamp, now, changed, g, cap)
                if count > 0 and d < best_d:
                    best_i, best_s, best_d = i, s, d
        if best_i < 0:
            left += 1
            continue
        now += 1
        count, d = _propagate(best_i, best_s, x, tent, stamp, now, changed, g, cap)
        for h in range(count):
            x[changed[h]] = tent[changed[h]]
    return left


@njit(cache=True)
def polish(x, prof, first, after, limit, usage, g):  # pragma: no cover - compiled
    """One sweep of improving single-node moves that keep the limit; returns the gain."""
    noff = g[0]
    n = len(noff) - 1
    pools = prof.shape[1]
    gain = 0.0
    for i in range(n):
        best_s, best_d = -1, 0.0
        cur = noff[i] + x[i]
        for s in range(noff[i + 1] - noff[i]):
            if s == x[i]:
                continue
            d = _delta(i, s, x, g)
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
