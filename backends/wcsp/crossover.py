"""Crossover of two labellings of a `Network`: the parts of one that pay, moved into the
other within the memory limit (`backends.wcsp.toulbar2` recombines its rounds with the best
answer).

Two labellings x (the base) and y (the donor) differ on a set of nodes. The edges between
two differing nodes split that set into components. Moving one component from x's values to
y's changes the cost by its nodes' unary changes plus the changes of the edges that touch it,
and by nothing else: an edge from the component to a node outside it meets a node that has
the same value in x and y. So the components' gains are independent and add up (partition
crossover; Tinós, Whitley and Chicano, "Partition crossover for pseudo-Boolean
optimization", FOGA 2015). Every pair a moved component touches is a pair of y's, so y's
forbidden pairs make a gain -inf and that component never moves.

`crossover` moves the components that gain, largest gain first, each only when the usage
profile then stays within the limit at every step and pool it adds to. From a valid base
the result is valid and costs at most the base; a donor far over the limit (a priced
round's labelling) still gives every part of it that fits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from backends.wcsp.memory import Steps, edge_cost, polish, profile, repair
from planner.deadline import Deadline, past

__all__ = ["components", "crossover", "crossover_repaired"]

REPAIR_MOVES = 10  # repair moves between two looks at the clock (IOPDDL A: 50 took up to 0.9 s)


@njit(cache=True)
def _root(parent, i):  # pragma: no cover - compiled
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


@njit(cache=True)
def components(x, donor, g):  # pragma: no cover - compiled
    """The components where `donor` differs from `x` (module docstring): (order, start,
    members, gain). `order` lists the roots of the components that gain, largest gain
    first; root r's members are `members[start[r]:start[r + 1]]`, its gain `gain[r]` (the
    cost of x less the cost with the component at the donor's values)."""
    noff, unary, eu, ev, eoff, binary, ioff, iedge, iside = g
    n = len(x)
    differs = x != donor
    parent = np.arange(n)
    for e in range(len(eu)):
        a, b = eu[e], ev[e]
        if differs[a] and differs[b]:
            ra, rb = _root(parent, a), _root(parent, b)
            if ra != rb:
                parent[ra] = rb
    for i in range(n):
        parent[i] = _root(parent, i)
    gain = np.zeros(n)
    for i in range(n):
        if differs[i]:
            gain[parent[i]] += unary[noff[i] + x[i]] - unary[noff[i] + donor[i]]
    for e in range(len(eu)):
        a, b = eu[e], ev[e]
        if differs[a] or differs[b]:
            r = parent[a] if differs[a] else parent[b]
            gain[r] += edge_cost(e, x[a], x[b], g) - edge_cost(e, donor[a], donor[b], g)
    # the members of each component, grouped by root (a counting sort)
    start = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        if differs[i]:
            start[parent[i] + 1] += 1
    for i in range(n):
        start[i + 1] += start[i]
    fill = start[:-1].copy()
    members = np.empty(start[n], dtype=np.int64)
    for i in range(n):
        if differs[i]:
            members[fill[parent[i]]] = i
            fill[parent[i]] += 1
    roots = np.empty(n, dtype=np.int64)
    count = 0
    for r in range(n):
        if differs[r] and parent[r] == r and gain[r] > 0:  # (a NaN or -inf gain never)
            roots[count] = r
            count += 1
    roots = roots[:count]
    return roots[np.argsort(-gain[roots])], start, members, gain


@njit(cache=True)
def crossover(x, donor, prof, first, after, limit, usage, g):  # pragma: no cover - compiled
    """Move the components where `donor` differs from `x` into x, largest gain first, each
    when the profile stays within `limit` (module docstring). x and prof (T, M) are updated
    in place; `g` is the network's arrays (`backends.wcsp.memory.kernel_arrays`); node i
    is live at steps [first[i], after[i]). Returns (components moved, cost gained)."""
    order, start, members, gain = components(x, donor, g)
    noff = g[0]
    steps, pools = prof.shape
    change = np.zeros((steps + 1, pools))
    moved, gained = 0, 0.0
    done = np.zeros(len(order), dtype=np.bool_)
    again = True
    while again:  # a component that frees memory may make room for one that did not fit
        again = False
        for q in range(len(order)):
            if not done[q]:
                r = order[q]
                if _move(
                    r, start, members, x, donor, prof, change, first, after, limit, usage, noff
                ):
                    done[q], again = True, True
                    moved += 1
                    gained += gain[r]
    return moved, gained


@njit(cache=True)
def _move(
    r, start, members, x, donor, prof, change, first, after, limit, usage, noff
):  # pragma: no cover - compiled
    """Component r (its members `members[start[r]:start[r + 1]]`) to the donor's values
    if the profile stays within the limit wherever that adds usage; whether it moved.
    `change` is a zeroed (T + 1, M) work array, zeroed again on return."""
    steps, pools = prof.shape
    lo, hi = steps, 0
    for k in range(start[r], start[r + 1]):
        i = members[k]
        if first[i] < after[i]:
            lo, hi = min(lo, first[i]), max(hi, after[i])
            for m in range(pools):
                du = usage[noff[i] + donor[i], m] - usage[noff[i] + x[i], m]
                change[first[i], m] += du
                change[after[i], m] -= du
    fits = True
    for m in range(pools):
        run = 0.0
        for t in range(lo, hi):
            run += change[t, m]
            if run > 0 and prof[t, m] + run > limit[m]:
                fits = False
                break
        if not fits:
            break
    if fits:
        for m in range(pools):
            run = 0.0
            for t in range(lo, hi):
                run += change[t, m]
                prof[t, m] += run
        for k in range(start[r], start[r + 1]):
            x[members[k]] = donor[members[k]]
    for t in range(lo, hi + 1):
        for m in range(pools):
            change[t, m] = 0.0
    return fits


@njit(cache=True)
def _cost(x, g):  # pragma: no cover - compiled
    """The network's cost of labelling x."""
    noff, unary, eu, ev, eoff, binary, ioff, iedge, iside = g
    total = 0.0
    for i in range(len(x)):
        total += unary[noff[i] + x[i]]
    for e in range(len(eu)):
        total += edge_cost(e, x[eu[e]], x[ev[e]], g)
    return total


def crossover_repaired(
    x: np.ndarray,
    donor: np.ndarray,
    prof: np.ndarray,
    st: Steps,
    usage: np.ndarray,
    g: tuple[np.ndarray, ...],
    tries: int,
    deadline: Deadline,
    cap: int = 200,
) -> float:
    """The components that gain but do not fit (after `crossover` they are the ones left
    that gain), at most `tries` of them, largest gain first: each is moved into a copy of
    x, which is repaired into the limit (`backends.wcsp.memory.repair`, chains of at most
    `cap` nodes) and polished; the first copy that costs less than x replaces it. x and
    prof (T, M) are updated in place; returns the cost gained (0 if no copy did).

    The repair gives up some of the component's gain elsewhere, so its cost is the test.
    On IOPDDL S, the best answer of a run crossed with 19 round labellings: 1.5782e9 by
    `crossover`, then 1.5307e9 after this on each (5 tries each, 8 s)."""
    order, start, members, gain = components(x, donor, g)
    noff = g[0]
    before = _cost(x, g)
    for r in order[:tries]:
        if past(deadline.at):
            break
        y = x.copy()
        part = members[start[r] : start[r + 1]]
        y[part] = donor[part]
        p = profile(st, usage[noff[:-1] + y], st.count)
        args = (st.first, st.after, st.limit, usage, g)
        ok = -1
        while ok == -1 and not past(deadline.at):
            ok = repair(y, p, *args, REPAIR_MOVES, cap)
        if ok != 1:
            continue
        while polish(y, p, *args) > 0 and not past(deadline.at):
            pass
        after = _cost(y, g)
        if after < before - 1e-9 * abs(before):
            x[:] = y
            prof[:] = p
            return before - after
    return 0.0
