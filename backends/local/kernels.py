"""The compiled inner loops of the `local` backend (numba): construction, repair, annealing.

Everything here reads the problem tuple `P` (`FlatProblem.arrays()`) and changes the state
tuple `S` (`new_state`) in place; the Python driver (`backends.local.anneal`) calls them in
chunks of a few thousand moves and looks at the clock in between.

- A choice vector `x` holds a position per node (0 .. |S_i| - 1); a node's *local cost*
  of strategy a is its node cost plus its incident edges' costs with the neighbours as they
  are (`local_cost`): a move's cost delta is the difference of two local costs, O(degree).
- The memory profile of every pool is a segment tree (`backends.local.segtree`): a move of
  node i from s to a fits when max over i's live range + usage(a) - usage(s) <= limit,
  O(log T); the move itself is a range add.
- Construction: `arc_consistency` (AC-3) drops strategies with no allowed partner;
  `least_memory_start` puts each node at its least-memory strategy (with one pool the least
  profile at every time: over the limit, no answer exists); `mac_start` places the nodes in
  turn maintaining arc consistency; `repair` fixes what is left: min-conflicts with tabu and
  noise on forbidden pairs (Minton et al. 1992, "Minimizing conflicts: a heuristic repair
  method"), preferring strategies that keep memory within the limit, then, at the fullest
  time, the move that frees memory at the lowest cost per byte.
- `anneal` is simulated annealing (Kirkpatrick et al. 1983) over valid states only, with
  four moves: a heat-bath move of one node; both ends of an edge to their best pair given
  the rest; one node to a random strategy with its neighbours' best responses and an
  ejection chain off the pairs that became forbidden; a tree of nodes to its best
  assignment by dynamic programming. The best state is kept lazily: the nodes changed since
  the last best are listed and copied at the next best, so a new best costs O(changes).

The random numbers are our own xorshift64* (Marsaglia 2003; Vigna 2016) in the state, so a
run is deterministic for a seed and a move count whatever else uses numba's generator.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from backends.local.segtree import seg_add, seg_argmax, seg_build, seg_max

INF = np.inf
TABU_TENURE = 7  # repair steps before a node may return to a strategy it left
CHAIN = 64  # nodes an ejection chain may move beyond the first node's neighbours
REGION = 48  # nodes of a tree move
TREE_WORK = 2048  # strategy pairs a tree move's dynamic programming may look at
HUB = 64  # compound moves leave out nodes of a higher degree but as the first node of a
# repair move, which they are HUB / degree as often as others (the move costs O(degree))
NOISE = 0.1  # probability that a repair step picks a random allowed strategy

# positions in the float / int state vectors
F_COST, F_BEST = 0, 1
I_DIRTY, I_ACCEPTED, I_BESTS, I_STEP, I_NBAD = 0, 1, 2, 3, 4


def new_state(arrays: tuple[np.ndarray, ...], num_times: int, seed: int, max_size: int):
    """The state tuple for a problem: x, best, trees (mx, ad), the dirty list, float and int
    scalars, the generator, scratch arrays, the forbidden-edge set and the tabu list."""
    off, usage, aoff = arrays[0], arrays[2], arrays[11]
    n = len(off) - 1
    pools = usage.shape[1]
    size = 1
    while size < num_times:
        size *= 2
    edges = len(arrays[6])
    degree = int(np.max(np.diff(aoff), initial=0))
    rng = np.array([_splitmix(seed)], dtype=np.uint64)
    return (
        np.zeros(n, dtype=np.int64),  # x
        np.zeros(n, dtype=np.int64),  # best
        np.full((pools, 2 * size), -np.inf),  # mx
        np.zeros((pools, 2 * size)),  # ad
        np.zeros(n, dtype=np.uint8),  # dirty
        np.zeros(n, dtype=np.int64),  # dlist
        np.zeros(4),  # floats
        np.zeros(8, dtype=np.int64),  # ints
        rng,
        np.zeros(max_size),  # cu
        np.zeros(max_size),  # cv
        np.zeros(max(degree + CHAIN, REGION) + 2, dtype=np.int64),  # journal: nodes
        np.zeros(max(degree + CHAIN, REGION) + 2, dtype=np.int64),  # journal: old positions
        np.zeros(edges, dtype=np.int64),  # forbidden edges
        np.full(edges, -1, dtype=np.int64),  # their positions in that list
        np.zeros(int(off[-1]), dtype=np.int64),  # tabu: step until which a strategy is tabu
        np.full(n, -1, dtype=np.int64),  # position of a node in the journal (-1: not in it)
        np.full(n, -1, dtype=np.int64),  # position of a node in the region (-1: not in it)
        np.zeros((4, REGION), dtype=np.int64),  # region: node, parent position, edge, side
        np.zeros((REGION, max_size)),  # region: dynamic programming values
        np.zeros((REGION, max_size), dtype=np.int64),  # region: best child strategy per parent's
    )


def _splitmix(seed: int) -> int:
    z = (seed * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) or 1


# ------------------------------------------------------------------------------ random


@njit(cache=True)
def rand_u64(rng: np.ndarray) -> np.uint64:
    z = rng[0]
    z ^= z >> np.uint64(12)
    z ^= z << np.uint64(25)
    z ^= z >> np.uint64(27)
    rng[0] = z
    return z * np.uint64(2685821657736338717)


@njit(cache=True)
def rand_int(rng: np.ndarray, n: int) -> int:
    """Uniform in [0, n)."""
    return int(np.int64(rand_u64(rng) >> np.uint64(11)) % n)


@njit(cache=True)
def rand_float(rng: np.ndarray) -> float:
    """Uniform in [0, 1)."""
    return np.float64(rand_u64(rng) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


# ------------------------------------------------------------------------- evaluation


@njit(cache=True)
def _entry(eoff, ncol, etab, aedge, aside, k: int, a: int, b: int) -> float:
    """The cost of the edge at adjacency slot k with its node at strategy a and the other
    end at b (the table is row-major by the edge's first end)."""
    e = aedge[k]
    if aside[k] == 0:
        return etab[eoff[e] + a * ncol[e] + b]
    return etab[eoff[e] + b * ncol[e] + a]


@njit(cache=True)
def local_cost(
    off: np.ndarray,
    cost: np.ndarray,
    eoff: np.ndarray,
    ncol: np.ndarray,
    etab: np.ndarray,
    aoff: np.ndarray,
    aedge: np.ndarray,
    aother: np.ndarray,
    aside: np.ndarray,
    x: np.ndarray,
    i: int,
    a: int,
) -> float:
    """Node i's cost at strategy a plus its edges' costs with the neighbours at x."""
    c = cost[off[i] + a]
    for k in range(aoff[i], aoff[i + 1]):
        j = aother[k]
        c += _entry(eoff, ncol, etab, aedge, aside, k, a, x[j])
    return c


@njit(cache=True)
def total_cost(P, x: np.ndarray) -> float:
    """The additive objective of x (inf when something forbidden is chosen)."""
    off, cost, eu, ev, eoff, ncol, etab = P[0], P[1], P[6], P[7], P[8], P[9], P[10]
    total = 0.0
    for i in range(len(x)):
        total += cost[off[i] + x[i]]
    for e in range(len(eu)):
        total += etab[eoff[e] + x[eu[e]] * ncol[e] + x[ev[e]]]
    return total


@njit(cache=True)
def build_profile(P, S) -> None:
    """Build every pool's tree from x (an exact sum, no drift from earlier moves)."""
    off, usage, lo, hi = P[0], P[2], P[3], P[4]
    x, mx, ad = S[0], S[2], S[3]
    pools = usage.shape[1]
    size = mx.shape[1] // 2
    for p in range(pools):
        diff = np.zeros(size + 1)
        for i in range(len(x)):
            if lo[i] < hi[i]:
                u = usage[off[i] + x[i], p]
                diff[lo[i]] += u
                diff[hi[i]] -= u
        values = np.cumsum(diff[:size])
        seg_build(mx[p], ad[p], values)


@njit(cache=True)
def fits(P, S, i: int, a: int) -> bool:
    """Whether node i can move to strategy a within every pool's limit."""
    off, usage, lo, hi, limit = P[0], P[2], P[3], P[4], P[5]
    x, mx, ad = S[0], S[2], S[3]
    if lo[i] >= hi[i]:
        return True
    s, t = off[i] + x[i], off[i] + a
    for p in range(usage.shape[1]):
        du = usage[t, p] - usage[s, p]
        if du > 0.0 and seg_max(mx[p], ad[p], lo[i], hi[i]) + du > limit[p]:
            return False
    return True


@njit(cache=True)
def overflow(P, S, i: int, a: int) -> float:
    """How far node i at strategy a would go over the limit on its range (0: it fits)."""
    off, usage, lo, hi, limit = P[0], P[2], P[3], P[4], P[5]
    x, mx, ad = S[0], S[2], S[3]
    if lo[i] >= hi[i]:
        return 0.0
    s, t = off[i] + x[i], off[i] + a
    worst = 0.0
    for p in range(usage.shape[1]):
        du = usage[t, p] - usage[s, p]
        over = seg_max(mx[p], ad[p], lo[i], hi[i]) + du - limit[p]
        if over > worst:
            worst = over
    return worst


@njit(cache=True)
def set_position(P, S, i: int, a: int) -> None:
    """Move node i to strategy a: the trees follow (the cost does not: the caller's)."""
    off, usage, lo, hi = P[0], P[2], P[3], P[4]
    x, mx, ad = S[0], S[2], S[3]
    if lo[i] < hi[i]:
        s, t = off[i] + x[i], off[i] + a
        for p in range(usage.shape[1]):
            du = usage[t, p] - usage[s, p]
            if du != 0.0:
                seg_add(mx[p], ad[p], lo[i], hi[i], du)
    x[i] = a


@njit(cache=True)
def _mark(S, i: int) -> None:
    dirty, dlist, ints = S[4], S[5], S[7]
    if dirty[i] == 0:
        dirty[i] = 1
        dlist[ints[I_DIRTY]] = i
        ints[I_DIRTY] += 1


@njit(cache=True)
def _record_best(S) -> None:
    """The current state is the best: copy the nodes changed since the last best."""
    x, best, dirty, dlist, floats, ints = S[0], S[1], S[4], S[5], S[6], S[7]
    for k in range(ints[I_DIRTY]):
        j = dlist[k]
        best[j] = x[j]
        dirty[j] = 0
    ints[I_DIRTY] = 0
    floats[F_BEST] = floats[F_COST]
    ints[I_BESTS] += 1


@njit(cache=True)
def reset_to_best(P, S) -> None:
    """Continue from the best state (a restart): x = best, trees and cost recomputed."""
    x, best, dirty, floats, ints = S[0], S[1], S[4], S[6], S[7]
    for i in range(len(x)):
        x[i] = best[i]
        dirty[i] = 0
    ints[I_DIRTY] = 0
    build_profile(P, S)
    floats[F_COST] = total_cost(P, x)
    floats[F_BEST] = floats[F_COST]


@njit(cache=True)
def take_current_as_best(P, S) -> None:
    """After construction: the current state is the first best."""
    x, best, dirty, floats, ints = S[0], S[1], S[4], S[6], S[7]
    for i in range(len(x)):
        best[i] = x[i]
        dirty[i] = 0
    ints[I_DIRTY] = 0
    floats[F_COST] = total_cost(P, x)
    floats[F_BEST] = floats[F_COST]


@njit(cache=True)
def memory_ok(P, S) -> bool:
    """Whether every pool's maximum is within its limit."""
    limit, mx = P[5], S[2]
    for p in range(len(limit)):  # noqa: SIM110 - a loop numba compiles
        if mx[p, 1] > limit[p]:
            return False
    return True


# ------------------------------------------------------------------------ construction


@njit(cache=True)
def least_memory_start(P, S) -> int:
    """x = each node's least-memory allowed strategy (summed over pools; cheapest among
    equals); -1 - i if node i has no allowed strategy, else 0."""
    off, cost, usage = P[0], P[1], P[2]
    x = S[0]
    for i in range(len(x)):
        pick = -1
        pick_use, pick_cost = INF, INF
        for a in range(off[i + 1] - off[i]):
            c = cost[off[i] + a]
            if not np.isfinite(c):
                continue
            u = 0.0
            for p in range(usage.shape[1]):
                u += usage[off[i] + a, p]
            if u < pick_use or (u == pick_use and c < pick_cost):
                pick, pick_use, pick_cost = a, u, c
        if pick < 0:
            return -1 - i
        x[i] = pick
    build_profile(P, S)
    _rebuild_bad(P, S)
    return 0


@njit(cache=True)
def _revise(P, alive: np.ndarray, e: int, side: int) -> bool:
    """Drop the strategies of edge e's end `side` (0: its first node) that have no allowed
    partner at the other end; whether any was dropped."""
    off, eu, ev, eoff, ncol, etab = P[0], P[6], P[7], P[8], P[9], P[10]
    u, v = eu[e], ev[e]
    su, sv = off[u + 1] - off[u], off[v + 1] - off[v]
    me, other, sme, sother = (u, v, su, sv) if side == 0 else (v, u, sv, su)
    dropped = False
    for a in range(sme):
        if alive[off[me] + a] == 0:
            continue
        supported = False
        for b in range(sother):
            if alive[off[other] + b] == 0:
                continue
            entry = (
                etab[eoff[e] + a * ncol[e] + b] if side == 0 else etab[eoff[e] + b * ncol[e] + a]
            )
            if np.isfinite(entry):
                supported = True
                break
        if not supported:
            alive[off[me] + a] = 0
            dropped = True
    return dropped


@njit(cache=True)
def arc_consistency(P, alive: np.ndarray) -> int:
    """AC-3 (Mackworth 1977) over the forbidden pairs: clear `alive` (1 per allowed strategy)
    for every strategy that has no allowed partner on some edge, until none is left; such a
    strategy is in no valid answer. -1 - i if node i is left with none, else the number
    dropped."""
    off, eu, ev, aoff, aedge, aside = P[0], P[6], P[7], P[11], P[12], P[14]
    m = len(eu)
    queue = np.empty(2 * m + 1, dtype=np.int64)  # arc = 2 * edge + side, in a ring
    queued = np.ones(2 * m, dtype=np.uint8)
    for k in range(2 * m):
        queue[k] = k
    head, count, dropped = 0, 2 * m, 0
    size = 2 * m + 1
    while count > 0:
        arc = queue[head]
        head = (head + 1) % size
        count -= 1
        queued[arc] = 0
        e, side = arc // 2, arc % 2
        if not _revise(P, alive, e, side):
            continue
        node = eu[e] if side == 0 else ev[e]
        left = 0
        for g in range(off[node], off[node + 1]):
            left += alive[g]
        if left == 0:
            return -1 - node
        for k in range(aoff[node], aoff[node + 1]):
            f = aedge[k]
            back = 1 - aside[k]  # the arc of f's other end
            if f != e and queued[2 * f + back] == 0:
                queued[2 * f + back] = 1
                queue[(head + count) % size] = 2 * f + back
                count += 1
    for g in range(len(alive)):
        dropped += 1 - alive[g]
    return dropped


@njit(cache=True)
def _revise_trail(P, alive, e: int, side: int, trail, top: int) -> int:
    """`_revise` that pushes each dropped strategy on `trail`; the new top (-1 - top if the
    revised node has no strategy left)."""
    off, eu, ev, eoff, ncol, etab = P[0], P[6], P[7], P[8], P[9], P[10]
    u, v = eu[e], ev[e]
    me, other = (u, v) if side == 0 else (v, u)
    left = 0
    for a in range(off[me + 1] - off[me]):
        if alive[off[me] + a] == 0:
            continue
        supported = False
        for b in range(off[other + 1] - off[other]):
            if alive[off[other] + b] == 0:
                continue
            entry = (
                etab[eoff[e] + a * ncol[e] + b] if side == 0 else etab[eoff[e] + b * ncol[e] + a]
            )
            if np.isfinite(entry):
                supported = True
                break
        if supported:
            left += 1
        else:
            alive[off[me] + a] = 0
            trail[top] = off[me] + a
            top += 1
    return top if left > 0 else -1 - top


@njit(cache=True)
def _propagate(P, alive, node: int, trail, top: int, queue, queued) -> int:
    """AC-3 from the arcs into `node`'s neighbours after its domain shrank; the trail's new
    top, or -1 - top on a wipe-out (the queue is left empty either way)."""
    eu, ev, aoff, aedge, aside = P[6], P[7], P[11], P[12], P[14]
    size = len(queue)
    head, count = 0, 0
    for k in range(aoff[node], aoff[node + 1]):
        arc = 2 * aedge[k] + 1 - aside[k]
        if queued[arc] == 0:
            queued[arc] = 1
            queue[count] = arc
            count += 1
    wiped = False
    while count > 0:
        arc = queue[head]
        head = (head + 1) % size
        count -= 1
        queued[arc] = 0
        if wiped:
            continue
        e, side = arc // 2, arc % 2
        before = top
        top = _revise_trail(P, alive, e, side, trail, top)
        if top < 0:
            top = -1 - top
            wiped = True
            continue
        if top == before:
            continue
        changed = eu[e] if side == 0 else ev[e]
        for k in range(aoff[changed], aoff[changed + 1]):
            f = aedge[k]
            back = 2 * f + 1 - aside[k]
            if f != e and queued[back] == 0:
                queued[back] = 1
                queue[(head + count) % size] = back
                count += 1
    return -1 - top if wiped else top


@njit(cache=True)
def mac_start(P, S, alive, memory_first: bool, tries: int) -> int:
    """Place the nodes in turn, maintaining arc consistency (MAC; Sabin and Freuder 1994):
    node i takes its alive strategy with no memory overflow (the others where they are),
    then the lowest cost with the nodes placed (or the least usage first, `memory_first`),
    and the forbidden pairs are propagated; a strategy whose propagation wipes out a domain
    is undone and the next one tried, up to `tries`; then the node takes its best strategy
    unpropagated (the repair handles its conflicts). The nodes that could not be propagated."""
    off, cost, usage, eu = P[0], P[1], P[2], P[6]
    x, cu = S[0], S[9]
    n = len(x)
    m = len(eu)
    trail = np.empty(len(alive), dtype=np.int64)
    queue = np.empty(2 * m + 1, dtype=np.int64)
    queued = np.zeros(2 * m + 1, dtype=np.uint8)
    placed = np.zeros(n, dtype=np.uint8)
    failures = 0
    for i in range(n):
        size = off[i + 1] - off[i]
        # score every alive strategy: overflow first, then cost (or usage) with the placed
        for a in range(size):
            g = off[i] + a
            cu[a] = INF
            if alive[g] == 0 or not np.isfinite(cost[g]):
                continue
            c = _placed_cost(P, x, placed, i, a)
            if memory_first:
                u = 0.0
                for p in range(usage.shape[1]):
                    u += usage[g, p]
                c = u + 1e-30 * c
            cu[a] = c + (1e300 if overflow(P, S, i, a) > 0.0 else 0.0)
        done = False
        for _ in range(tries):
            pick, low = -1, INF
            for a in range(size):
                if cu[a] < low:
                    pick, low = a, cu[a]
            if pick < 0:
                break
            cu[pick] = INF
            top = 0
            for a in range(size):
                g = off[i] + a
                if a != pick and alive[g] == 1:
                    alive[g] = 0
                    trail[top] = g
                    top += 1
            top = _propagate(P, alive, i, trail, top, queue, queued)
            if top >= 0:
                set_position(P, S, i, pick)
                done = True
                break
            for k in range(-1 - top):
                alive[trail[k]] = 1
        if not done:
            failures += 1
            pick, low = x[i], INF
            for a in range(size):
                g = off[i] + a
                if np.isfinite(cost[g]):
                    c = _placed_cost(P, x, placed, i, a)
                    if c < low:
                        pick, low = a, c
            set_position(P, S, i, pick)
        placed[i] = 1
    _rebuild_bad(P, S)
    return failures


@njit(cache=True)
def _placed_cost(P, x, placed, i: int, a: int) -> float:
    """Node i's cost at a plus its edges to placed nodes (inf on a forbidden pair)."""
    off, cost, eoff, ncol, etab, aoff, aedge, aother, aside = (
        P[0], P[1], P[8], P[9], P[10], P[11], P[12], P[13], P[14],
    )  # fmt: skip
    c = cost[off[i] + a]
    for k in range(aoff[i], aoff[i + 1]):
        j = aother[k]
        if placed[j] == 0:
            continue
        c += _entry(eoff, ncol, etab, aedge, aside, k, a, x[j])
    return c


@njit(cache=True)
def _pair_ok(P, x: np.ndarray, e: int) -> bool:
    eu, ev, eoff, ncol, etab = P[6], P[7], P[8], P[9], P[10]
    return np.isfinite(etab[eoff[e] + x[eu[e]] * ncol[e] + x[ev[e]]])


@njit(cache=True)
def _bad_set(S, e: int, bad: bool) -> None:
    blist, bpos, ints = S[13], S[14], S[7]
    if bad and bpos[e] < 0:
        bpos[e] = ints[I_NBAD]
        blist[ints[I_NBAD]] = e
        ints[I_NBAD] += 1
    elif not bad and bpos[e] >= 0:
        k = bpos[e]
        last = blist[ints[I_NBAD] - 1]
        blist[k] = last
        bpos[last] = k
        bpos[e] = -1
        ints[I_NBAD] -= 1


@njit(cache=True)
def _rebuild_bad(P, S) -> None:
    x, bpos, ints = S[0], S[14], S[7]
    for e in range(len(bpos)):
        bpos[e] = -1
    ints[I_NBAD] = 0
    for e in range(len(bpos)):
        if not _pair_ok(P, x, e):
            _bad_set(S, e, True)


@njit(cache=True)
def _move_tracking_bad(P, S, i: int, a: int) -> None:
    aoff, aedge = P[11], P[12]
    set_position(P, S, i, a)
    for k in range(aoff[i], aoff[i + 1]):
        e = aedge[k]
        _bad_set(S, e, not _pair_ok(P, S[0], e))


@njit(cache=True)
def _conflicts_and_cost(P, x: np.ndarray, i: int, a: int) -> tuple[int, float]:
    """Forbidden pairs node i at strategy a would meet, and its finite local cost."""
    off, cost, eoff, ncol, etab, aoff, aedge, aother, aside = (
        P[0], P[1], P[8], P[9], P[10], P[11], P[12], P[13], P[14],
    )  # fmt: skip
    c = cost[off[i] + a]
    bad = 0
    for k in range(aoff[i], aoff[i + 1]):
        j = aother[k]
        v = _entry(eoff, ncol, etab, aedge, aside, k, a, x[j])
        if np.isfinite(v):
            c += v
        else:
            bad += 1
    return bad, c


@njit(cache=True)
def _min_conflicts_step(P, S, i: int, step: int) -> None:
    """Move node i to its allowed strategy (not the current one, not tabu) with the fewest
    forbidden pairs, then the least memory overflow, then the lowest cost; sometimes a
    random allowed one."""
    off, cost = P[0], P[1]
    x, rng, tabu = S[0], S[8], S[15]
    size = off[i + 1] - off[i]
    here = x[i]
    pick = -1
    if rand_float(rng) < NOISE:
        a = rand_int(rng, size)
        if a != here and np.isfinite(cost[off[i] + a]):
            pick = a
    if pick < 0:
        best_bad, best_over, best_cost = 1 << 60, INF, INF
        for a in range(size):
            if a == here or not np.isfinite(cost[off[i] + a]) or tabu[off[i] + a] > step:
                continue
            bad, c = _conflicts_and_cost(P, x, i, a)
            if bad > best_bad:
                continue
            over = overflow(P, S, i, a)
            if bad < best_bad or over < best_over or (over == best_over and c < best_cost):
                pick, best_bad, best_over, best_cost = a, bad, over, c
    if pick >= 0:
        tabu[off[i] + here] = step + TABU_TENURE + rand_int(rng, 3)
        _move_tracking_bad(P, S, i, pick)


@njit(cache=True)
def _free_memory_step(P, S, p: int, step: int) -> int:
    """At the fullest time t of pool p, the move of a node live at t to a strategy with less
    usage in p, no forbidden pair and no new overflow elsewhere, of the lowest cost per byte
    freed. 1 if one was made; 0 if none: then a live node that can free memory is moved
    to its least-usage strategy (conflicts or not); 2 if every live node is at its least
    usage (with one pool: no answer exists)."""
    off, cost, usage, lo, hi, limit, movable = P[0], P[1], P[2], P[3], P[4], P[5], P[15]
    x, mx, ad, rng = S[0], S[2], S[3], S[8]
    t = seg_argmax(mx[p], ad[p])
    need = mx[p, 1] - limit[p]
    best_ratio, best_i, best_a = INF, -1, -1
    culprits = 0
    culprit = -1
    for k in range(len(movable)):
        i = movable[k]
        if not (lo[i] <= t < hi[i]):
            continue
        s = off[i] + x[i]
        _, here_cost = _conflicts_and_cost(P, x, i, x[i])
        can_free = False
        for a in range(off[i + 1] - off[i]):
            g = off[i] + a
            freed = usage[s, p] - usage[g, p]
            if freed <= 0.0 or not np.isfinite(cost[g]):
                continue
            can_free = True
            bad, c = _conflicts_and_cost(P, x, i, a)
            if bad > 0:
                continue
            ok = True
            for q in range(usage.shape[1]):
                dq = usage[g, q] - usage[s, q]
                if q != p and dq > 0.0 and seg_max(mx[q], ad[q], lo[i], hi[i]) + dq > limit[q]:
                    ok = False
            if not ok:
                continue
            ratio = (c - here_cost) / min(freed, need)
            if ratio < best_ratio:
                best_ratio, best_i, best_a = ratio, i, a
        if can_free:
            culprits += 1
            if rand_int(rng, culprits) == 0:  # a uniform one among them (reservoir)
                culprit = i
    if best_i >= 0:
        _move_tracking_bad(P, S, best_i, best_a)
        return 1
    if culprit < 0:
        return 2
    pick, pick_use = -1, INF
    for a in range(off[culprit + 1] - off[culprit]):
        g = off[culprit] + a
        if np.isfinite(cost[g]) and usage[g, p] < pick_use:
            pick, pick_use = a, usage[g, p]
    _move_tracking_bad(P, S, culprit, pick)
    return 0


@njit(cache=True)
def repair(P, S, steps: int) -> int:
    """Up to `steps` repair steps; 1 once the state is valid, 2 if proven impossible (one
    pool and every live node at its least usage at the fullest time), else 0."""
    eu, ev, limit, movable = P[6], P[7], P[5], P[15]
    mx, rng, ints, blist = S[2], S[8], S[7], S[13]
    for _ in range(steps):
        step = ints[I_STEP]
        ints[I_STEP] += 1
        if ints[I_NBAD] > 0:
            e = blist[rand_int(rng, ints[I_NBAD])]
            i = eu[e] if rand_int(rng, 2) == 0 else ev[e]
            _min_conflicts_step(P, S, i, step)
            continue
        over = -1
        for p in range(len(limit)):
            if mx[p, 1] > limit[p]:
                over = p
                break
        if over < 0:
            return 1
        if len(movable) == 0:
            return 2 if len(limit) == 1 else 0
        code = _free_memory_step(P, S, over, step)
        if code == 2 and len(limit) == 1:
            return 2
    return 0


# --------------------------------------------------------------------------- annealing


@njit(cache=True)
def _local(P, x: np.ndarray, i: int, a: int) -> float:
    return local_cost(P[0], P[1], P[8], P[9], P[10], P[11], P[12], P[13], P[14], x, i, a)


@njit(cache=True)
def _random_strategy(P, rng: np.ndarray, i: int, here: int) -> int:
    """A random strategy of node i other than `here`; -1 if it is forbidden."""
    off, cost = P[0], P[1]
    size = off[i + 1] - off[i]
    a = rand_int(rng, size - 1)
    if a >= here:
        a += 1
    return a if np.isfinite(cost[off[i] + a]) else -1


@njit(cache=True)
def _accept(rng: np.ndarray, delta: float, temperature: float) -> bool:
    if delta <= 0.0:
        return True
    if temperature <= 0.0:
        return False
    return rand_float(rng) < np.exp(-delta / temperature)


@njit(cache=True)
def _commit(S, delta: float) -> None:
    floats, ints = S[6], S[7]
    floats[F_COST] += delta
    ints[I_ACCEPTED] += 1
    if floats[F_COST] < floats[F_BEST]:
        _record_best(S)


@njit(cache=True)
def _single_move(P, S, temperature: float) -> None:
    """A heat-bath move (Glauber 1963; Geman and Geman 1984): a random node takes strategy a
    with probability proportional to exp(-local cost(a) / T) among its allowed ones; the
    move is dropped if a does not fit in memory. At T -> 0 it is the best response."""
    off, cost, movable = P[0], P[1], P[15]
    x, rng, cu = S[0], S[8], S[9]
    i = movable[rand_int(rng, len(movable))]
    size = off[i + 1] - off[i]
    low = INF
    for a in range(size):
        cu[a] = _local(P, x, i, a) if np.isfinite(cost[off[i] + a]) else INF
        if cu[a] < low:
            low = cu[a]
    here = cu[x[i]]
    total = 0.0
    for a in range(size):
        if np.isfinite(cu[a]):
            w = 1.0 if cu[a] == low else 0.0
            if temperature > 0.0:
                w = np.exp(-(cu[a] - low) / temperature)
            cu[a] = w
            total += w
        else:
            cu[a] = 0.0
    r = rand_float(rng) * total
    pick = -1
    for a in range(size):
        if cu[a] > 0.0:
            pick = a
            r -= cu[a]
            if r < 0.0:
                break
    if pick < 0 or pick == x[i]:
        return
    delta = _local(P, x, i, pick) - here
    if not np.isfinite(delta) or not fits(P, S, i, pick):
        return
    set_position(P, S, i, pick)
    _mark(S, i)
    _commit(S, delta)


@njit(cache=True)
def _journal_delta(P, S, length: int) -> float:
    """The cost change of the journal's moves (nodes `jn`, old positions `jo`, new ones in
    x): their node costs and every edge they touch, once (at its first moved end)."""
    off, cost, eoff, ncol, etab, aoff, aedge, aother, aside = (
        P[0], P[1], P[8], P[9], P[10], P[11], P[12], P[13], P[14],
    )  # fmt: skip
    x, jn, jo, jpos = S[0], S[11], S[12], S[16]
    delta = 0.0
    for k in range(length):
        m = jn[k]
        delta += cost[off[m] + x[m]] - cost[off[m] + jo[k]]
        for q in range(aoff[m], aoff[m + 1]):
            w = aother[q]
            if 0 <= jpos[w] < k:
                continue  # counted at w
            old_w = jo[jpos[w]] if jpos[w] >= 0 else x[w]
            e = aedge[q]
            if aside[q] == 0:
                new = etab[eoff[e] + x[m] * ncol[e] + x[w]]
                old = etab[eoff[e] + jo[k] * ncol[e] + old_w]
            else:
                new = etab[eoff[e] + x[w] * ncol[e] + x[m]]
                old = etab[eoff[e] + old_w * ncol[e] + jo[k]]
            delta += new - old
    return delta


@njit(cache=True)
def _journal_add(S, length: int, j: int) -> int:
    x, jn, jo, jpos = S[0], S[11], S[12], S[16]
    jn[length], jo[length] = j, x[j]
    jpos[j] = length
    return length + 1


@njit(cache=True)
def _journal_clear(S, length: int) -> None:
    jn, jpos = S[11], S[16]
    for k in range(length):
        jpos[jn[k]] = -1


@njit(cache=True)
def _edge_move(P, S, temperature: float) -> None:
    """Both ends of a random edge to their best pair given the rest (other than the current
    pair), accepted by the Metropolis rule on the exact delta."""
    off, cost, eu, ev, eoff, ncol, etab = P[0], P[1], P[6], P[7], P[8], P[9], P[10]
    x, rng, cu, cv = S[0], S[8], S[9], S[10]
    if len(eu) == 0:
        return
    e = rand_int(rng, len(eu))
    u, v = eu[e], ev[e]
    su, sv = off[u + 1] - off[u], off[v + 1] - off[v]
    aoff = P[11]
    if su * sv < 2 or aoff[u + 1] - aoff[u] > HUB or aoff[v + 1] - aoff[v] > HUB:
        return
    xu, xv = x[u], x[v]
    base, stride = eoff[e], ncol[e]
    for a in range(su):
        cu[a] = INF
        if np.isfinite(cost[off[u] + a]):
            cu[a] = _local(P, x, u, a) - etab[base + a * stride + xv]
    for b in range(sv):
        cv[b] = INF
        if np.isfinite(cost[off[v] + b]):
            cv[b] = _local(P, x, v, b) - etab[base + xu * stride + b]
    pick_a, pick_b, pick = -1, -1, INF
    for a in range(su):
        if not np.isfinite(cu[a]):
            continue
        for b in range(sv):
            if a == xu and b == xv:
                continue
            c = cu[a] + cv[b] + etab[base + a * stride + b]
            if c < pick:
                pick_a, pick_b, pick = a, b, c
    if pick_a < 0:
        return
    length = _journal_add(S, 0, u)
    length = _journal_add(S, length, v)
    x[u], x[v] = pick_a, pick_b
    delta = _journal_delta(P, S, length)
    x[u], x[v] = xu, xv
    _journal_clear(S, length)
    if not np.isfinite(delta) or not _accept(rng, delta, temperature):
        return
    if not fits(P, S, u, pick_a):
        return
    set_position(P, S, u, pick_a)
    if not fits(P, S, v, pick_b):
        set_position(P, S, u, xu)
        return
    set_position(P, S, v, pick_b)
    _mark(S, u)
    _mark(S, v)
    _commit(S, delta)


@njit(cache=True)
def _best_response(P, S, j: int) -> int:
    """Node j's cheapest strategy given its neighbours that fits in memory (-1: none)."""
    off, cost = P[0], P[1]
    x = S[0]
    pick, pick_cost = -1, INF
    for b in range(off[j + 1] - off[j]):
        if not np.isfinite(cost[off[j] + b]):
            continue
        c = _local(P, x, j, b)
        if c < pick_cost and (b == x[j] or fits(P, S, j, b)):
            pick, pick_cost = b, c
    return pick


@njit(cache=True)
def _meets_moved(P, x: np.ndarray, jpos: np.ndarray, j: int, b: int) -> bool:
    """Whether node j at strategy b would be on a forbidden pair with a node already moved
    (in the journal: `jpos` >= 0)."""
    eoff, ncol, etab, aoff, aedge, aother, aside = (
        P[8], P[9], P[10], P[11], P[12], P[13], P[14],
    )  # fmt: skip
    for k in range(aoff[j], aoff[j + 1]):
        w = aother[k]
        if jpos[w] < 0:
            continue
        v = _entry(eoff, ncol, etab, aedge, aside, k, b, x[w])
        if not np.isfinite(v):
            return True
    return False


@njit(cache=True)
def _chain_response(P, S, j: int) -> int:
    """Node j's strategy that fits in memory with no forbidden pair with a node already
    moved (in the journal), the fewest with the others, then the lowest cost (-1: none)."""
    off, cost = P[0], P[1]
    x, jpos = S[0], S[16]
    pick, pick_bad, pick_cost = -1, 1 << 60, INF
    for b in range(off[j + 1] - off[j]):
        if not np.isfinite(cost[off[j] + b]) or _meets_moved(P, x, jpos, j, b):
            continue
        bad, c = _conflicts_and_cost(P, x, j, b)
        better = bad < pick_bad or (bad == pick_bad and c < pick_cost)
        if better and (b == x[j] or fits(P, S, j, b)):
            pick, pick_bad, pick_cost = b, bad, c
    return pick


@njit(cache=True)
def _repair_move(P, S, temperature: float) -> None:
    """A random node to a random strategy; its neighbours to their best response where that
    lowers their cost; then, as an ejection chain, every node left on a forbidden pair with a
    moved node to its least-conflicting strategy (`_chain_response`), whose own conflicts
    are handled the same way, up to the journal's length. Undone unless every pair is
    allowed and the Metropolis rule accepts the whole."""
    aoff, aother, movable = P[11], P[13], P[15]
    eoff, ncol, etab, aedge, aside = P[8], P[9], P[10], P[12], P[14]
    x, rng, jn, jpos = S[0], S[8], S[11], S[16]
    i = movable[rand_int(rng, len(movable))]
    degree = aoff[i + 1] - aoff[i]
    if degree > HUB and rand_float(rng) * degree > HUB:
        return  # a hub, as often as its cost per move allows
    a = _random_strategy(P, rng, i, x[i])
    if a < 0 or not fits(P, S, i, a):
        return
    length = _journal_add(S, 0, i)
    set_position(P, S, i, a)
    ok = True
    for k in range(aoff[i], aoff[i + 1]):
        j = aother[k]
        if jpos[j] >= 0 or aoff[j + 1] - aoff[j] > HUB:
            continue  # a parallel edge's end, already moved; or a hub (the chain may move it)
        b = _best_response(P, S, j)
        if b >= 0 and b != x[j] and _local(P, x, j, b) < _local(P, x, j, x[j]):
            length = _journal_add(S, length, j)
            set_position(P, S, j, b)
    head, cap = 0, min(length + CHAIN, len(jn))
    while ok and head < length:
        m = jn[head]
        head += 1
        for k in range(aoff[m], aoff[m + 1]):
            w = aother[k]
            if jpos[w] >= 0:
                continue
            v = _entry(eoff, ncol, etab, aedge, aside, k, x[m], x[w])
            if np.isfinite(v):
                continue
            if length >= cap or aoff[w + 1] - aoff[w] > HUB:
                ok = False
                break
            b = _chain_response(P, S, w)
            if b < 0:
                ok = False
                break
            length = _journal_add(S, length, w)
            set_position(P, S, w, b)
    delta = _journal_delta(P, S, length) if ok else INF
    if np.isfinite(delta) and _accept(rng, delta, temperature):
        _keep_journal(S, length, delta)
        return
    _undo_journal(P, S, length, length)


@njit(cache=True)
def _keep_journal(S, length: int, delta: float) -> None:
    """A compound move is kept: its nodes marked for the best copy, the journal emptied,
    the cost moved by delta."""
    jn = S[11]
    for k in range(length):
        _mark(S, jn[k])
    _journal_clear(S, length)
    _commit(S, delta)


@njit(cache=True)
def _undo_journal(P, S, moved: int, length: int) -> None:
    """A compound move is undone: its first `moved` nodes back to their old strategies (in
    reverse order, so the memory trees see each change undone), the journal emptied."""
    jn, jo = S[11], S[12]
    for k in range(moved - 1, -1, -1):
        set_position(P, S, jn[k], jo[k])
    _journal_clear(S, length)


@njit(cache=True)
def _tree_move(P, S, temperature: float) -> None:
    """A tree of up to REGION nodes grown breadth-first from a random node (hubs left out)
    takes its best assignment given the rest, by dynamic programming over the tree (the
    min-sum / Viterbi recursion; edges inside the region but off the tree are priced at the
    neighbour's current strategy); accepted by the Metropolis rule on the exact delta, and
    only if every moved node fits in memory. Moves whole chains of "same sharding" pairs
    that one-node moves cannot break."""
    off, cost, eoff, ncol, etab, aoff, aedge, aother, aside, movable = (
        P[0], P[1], P[8], P[9], P[10], P[11], P[12], P[13], P[14], P[15],
    )  # fmt: skip
    x, rng, jn, jo, rpos, reg, f, arg = S[0], S[8], S[11], S[12], S[17], S[18], S[19], S[20]
    root = movable[rand_int(rng, len(movable))]
    if aoff[root + 1] - aoff[root] > HUB:
        return
    size, work = 1, 0
    reg[0, 0], reg[1, 0] = root, -1
    rpos[root] = 0
    head = 0
    while head < size and size < REGION:
        m = reg[0, head]
        start = aoff[m]
        span = aoff[m + 1] - start
        shift = rand_int(rng, span) if span > 0 else 0  # a random side first
        for q in range(span):
            k = start + (q + shift) % span
            w = aother[k]
            if rpos[w] >= 0 or aoff[w + 1] - aoff[w] > HUB or size >= REGION:
                continue
            pair = (off[m + 1] - off[m]) * (off[w + 1] - off[w])
            if work + pair > TREE_WORK:
                continue
            work += pair
            rpos[w] = size
            reg[0, size], reg[1, size], reg[2, size], reg[3, size] = w, head, aedge[k], aside[k]
            size += 1
        head += 1
    # leaves first: f[r, a] = own cost at a (edges off the tree at current strategies)
    # + each child's best given a
    for r in range(size - 1, -1, -1):
        v = reg[0, r]
        for a in range(off[v + 1] - off[v]):
            c = cost[off[v] + a]
            if np.isfinite(c):
                for k in range(aoff[v], aoff[v + 1]):
                    w = aother[k]
                    pw = rpos[w]
                    if pw >= 0 and (reg[1, pw] == r and reg[2, pw] == aedge[k]):
                        continue  # a tree edge to a child: in the child's term below
                    if r > 0 and pw == reg[1, r] and aedge[k] == reg[2, r]:
                        continue  # the tree edge to the parent: in the parent's term
                    c += _entry(eoff, ncol, etab, aedge, aside, k, a, x[w])
            f[r, a] = c
    for r in range(size - 1, 0, -1):
        v, parent, e, side = reg[0, r], reg[0, reg[1, r]], reg[2, r], reg[3, r]
        pr = reg[1, r]
        for a in range(off[parent + 1] - off[parent]):
            best, best_b = INF, 0
            for b in range(off[v + 1] - off[v]):
                # side: the parent's side of edge e (0: the parent is its first node)
                if side == 0:
                    t = etab[eoff[e] + a * ncol[e] + b]
                else:
                    t = etab[eoff[e] + b * ncol[e] + a]
                c = f[r, b] + t
                if c < best:
                    best, best_b = c, b
            f[pr, a] += best
            arg[r, a] = best_b
    pick, low = x[root], INF
    for a in range(off[root + 1] - off[root]):
        if f[0, a] < low:
            pick, low = a, f[0, a]
    # the new strategies, top down (kept in the journal's old-position slots for now)
    jo[0] = pick
    for r in range(1, size):
        jo[r] = arg[r, jo[reg[1, r]]]
    for r in range(size):
        rpos[reg[0, r]] = -1
    if not np.isfinite(low):
        return
    length = 0
    for r in range(size):
        v = reg[0, r]
        if jo[r] != x[v]:
            jn[length] = v
            reg[1, length] = jo[r]  # the new strategy (reg[1, :r] is no longer read)
            length += 1
    if length == 0:
        return
    for k in range(length):  # x takes the new strategies, jo keeps the old ones
        v = jn[k]
        jo[k] = x[v]
        x[v] = reg[1, k]
        S[16][v] = k
    delta = _journal_delta(P, S, length)
    for k in range(length):
        x[jn[k]] = jo[k]
    if np.isfinite(delta) and _accept(rng, delta, temperature):
        done = 0
        while done < length and fits(P, S, jn[done], reg[1, done]):
            set_position(P, S, jn[done], reg[1, done])
            done += 1
        if done == length:
            _keep_journal(S, length, delta)
            return
        _undo_journal(P, S, done, length)
        return
    _journal_clear(S, length)


@njit(cache=True)
def anneal(
    P,
    S,
    moves: int,
    done: int,
    per_round: int,
    t_start: float,
    t_end: float,
    edge_share: float,
    repair_share: float,
    tree_share: float,
) -> None:
    """Moves `done` .. `done + moves` of a round of `per_round` moves whose temperature falls
    geometrically from `t_start` to `t_end` (computed per move from its index, so the moves
    do not depend on how a round is cut into chunks)."""
    movable = P[15]
    rng = S[8]
    if len(movable) == 0:
        return
    log_ratio = np.log(t_end / t_start)
    for k in range(done, done + moves):
        temperature = t_start * np.exp(log_ratio * k / per_round)
        r = rand_float(rng)
        if r < edge_share:
            _edge_move(P, S, temperature)
        elif r < edge_share + repair_share:
            _repair_move(P, S, temperature)
        elif r < edge_share + repair_share + tree_share:
            _tree_move(P, S, temperature)
        else:
            _single_move(P, S, temperature)


@njit(cache=True)
def uphill_deltas(P, S, samples: int) -> np.ndarray:
    """The positive finite deltas of `samples` random single-node moves (not made)."""
    movable = P[15]
    x, rng = S[0], S[8]
    out = np.empty(samples)
    count = 0
    if len(movable) == 0:
        return out[:0]
    for _ in range(samples):
        i = movable[rand_int(rng, len(movable))]
        a = _random_strategy(P, rng, i, x[i])
        if a < 0:
            continue
        delta = _local(P, x, i, a) - _local(P, x, i, x[i])
        if np.isfinite(delta) and delta > 0.0:
            out[count] = delta
            count += 1
    return out[:count]
