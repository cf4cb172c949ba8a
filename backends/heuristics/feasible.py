"""A valid answer first: the feasibility heuristic every additive backend starts from.

`feasible_choices(problem, deadline)` returns a choice vector that is allowed (no forbidden
choice or pair) and keeps the memory rule, or None when it found none in time. It works on
the reduced tables (`backends.model.selection.Selection`) in three steps:

1. Start from the smallest-memory vector: every node at its least usage (the lowest load at
   every time, so with one memory pool it always fits), cheapest among equals.
2. Repair (min-conflicts with a tabu list and a little noise, seeded): while some edge
   meets a forbidden pair or some check time is over the limit, move one node involved to
   the choice that leaves the fewest forbidden pairs, then the least memory overflow, then
   the lowest cost. Over memory, the node moved is the one that frees bytes at the fullest
   time at the lowest cost per byte.
3. Improve without ever leaving feasibility (`improve`): every node's best move given its
   neighbours that fits in the memory left over its live range; moves that need no memory
   first, then those that need some in order of cost saved per byte, until none helps.

Steps 2-3 are O(degree + live range) per move with numpy, so a 35,000-node problem gets a
valid, locally optimal answer in seconds. `rounded_positions` runs steps 2-3 from an LP
relaxation's largest x per node (the backends' LP-rounding starts); `neighbourhood` lists
the choices of a restricted problem around an answer (for models too large to solve whole).
Keep `feasible_choices`'s name and signature: other backends (mcmc) call it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from backends.base import past
from backends.model.selection import Selection, selection

if TYPE_CHECKING:
    from planner.problems.problem import Problem

__all__ = [
    "LocalSearch",
    "backtrack",
    "feasible_choices",
    "feasible_positions",
    "improve",
    "neighbourhood",
    "rounded_positions",
]

TABU_TENURE = 7  # repair moves before a node may return to a choice it left
NOISE = 0.1  # probability that a repair move picks a random allowed choice
REPAIR_MOVES = 1000  # repair moves at most, plus REPAIR_MOVES_PER_NODE per node
REPAIR_MOVES_PER_NODE = 100


def feasible_choices(
    problem: Problem, deadline: float = math.inf, seed: int = 0
) -> tuple[int, ...] | None:
    """A valid choice vector of `problem` (additive tables, memory rule), or None if none
    was found before `deadline` (a `time.perf_counter()` value) or none exists."""
    sel = selection(problem)
    pos = feasible_positions(sel, deadline, seed)
    return None if pos is None else sel.choices(pos)


def feasible_positions(
    sel: Selection, deadline: float = math.inf, seed: int = 0, polish_until: float | None = None
) -> list[int] | None:
    """`feasible_choices` on reduced tables: a position per node (into `sel.allowed`). The
    repair may run until `deadline`; the improvement stops at `polish_until` if sooner."""
    if sel.infeasible:
        return None
    search = LocalSearch(sel, _least_memory(sel))
    if not search.repair(deadline, seed):
        found = backtrack(sel, deadline)  # complete where the repair is not: small problems
        if found is None:
            return None
        search = LocalSearch(sel, np.asarray(found, dtype=np.int64))
    search.improve(min(deadline, polish_until if polish_until is not None else math.inf))
    return search.pos.tolist()


BACKTRACK_STEPS = 200_000  # assignments tried at most by `backtrack`
BACKTRACK_NODES = 500  # larger problems are not backtracked (under Python's recursion limit)


def backtrack(
    sel: Selection, deadline: float = math.inf, steps: int = BACKTRACK_STEPS
) -> list[int] | None:
    """A valid position vector by depth-first search, or None when there is none or none
    was found within `steps` assignments or before `deadline`. The repair's min-conflicts
    moves can miss a valid vector on a tight problem; this search cannot, on problems small
    enough for it to finish: a node's choice is tried only if it meets no forbidden pair
    with the nodes already chosen and the memory rule still holds with every node not yet
    chosen at its least usage (a lower bound on the final load, so no valid vector is cut)."""
    n = sel.num_nodes
    if n > BACKTRACK_NODES:  # one recursion level per node; the repair serves large problems
        return None
    order = sorted(range(n), key=lambda i: len(sel.allowed[i]))  # fewest choices first
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (u, v), t in zip(sel.edges, sel.edge_cost, strict=True):
        nbrs[u].append((v, t))
        nbrs[v].append((u, t.T))
    # per pool: the load above the least usages at every check time, and per node its span
    loads = [np.zeros(m.num_times) for m in sel.memory]
    spans: list[list[tuple[int, int, int, np.ndarray]]] = [[] for _ in range(n)]
    for k, m in enumerate(sel.memory):
        for j, i in enumerate(m.nodes):
            spans[int(i)].append((k, int(m.first[j]), int(m.last[j]), m.coef[j]))
    pos = [-1] * n
    tried = 0

    def fits(i: int, c: int) -> bool:
        for k, a, b, coef in spans[i]:
            if coef[c] > 0 and (loads[k][a:b] + coef[c] > sel.memory[k].rhs[a:b] + 1e-9).any():
                return False
        return all(pos[j] < 0 or math.isfinite(t[c, pos[j]]) for j, t in nbrs[i])

    def place(i: int, c: int, sign: int) -> None:
        for k, a, b, coef in spans[i]:
            loads[k][a:b] += sign * coef[c]

    def go(depth: int) -> bool:
        nonlocal tried
        if depth == n:
            return True
        i = order[depth]
        for c in np.argsort(sel.node_cost[i], kind="stable"):
            tried += 1
            if tried > steps or (tried % 1024 == 0 and past(deadline)):
                return False
            if fits(i, int(c)):
                pos[i] = int(c)
                place(i, int(c), 1)
                if go(depth + 1):
                    return True
                place(i, int(c), -1)
                pos[i] = -1
        return False

    return pos if go(0) else None


def rounded_positions(
    sel: Selection, weights: Sequence[np.ndarray], deadline: float = math.inf, seed: int = 0
) -> list[int] | None:
    """A valid position vector from per-choice weights (e.g. an LP relaxation's x): each
    node's heaviest choice, then repaired and improved as in `feasible_positions`."""
    pos = np.array([int(np.argmax(w)) for w in weights], dtype=np.int64)
    search = LocalSearch(sel, pos)
    if not search.repair(deadline, seed):
        return None
    search.improve(deadline)
    return search.pos.tolist()


def improve(sel: Selection, pos: Sequence[int], deadline: float = math.inf) -> list[int]:
    """A valid position vector made locally optimal (single-node moves within memory)."""
    search = LocalSearch(sel, np.asarray(pos, dtype=np.int64))
    search.improve(deadline)
    return search.pos.tolist()


def neighbourhood(sel: Selection, pos: Sequence[int], k: int) -> list[np.ndarray]:
    """Per node, the choice indices (into the problem's tables) of a restricted problem
    around a valid answer: its own choice, its k - 1 cheapest given its neighbours' choices
    and its least-memory one (so the answer stays inside and memory can still be freed)."""
    search = LocalSearch(sel, np.asarray(pos, dtype=np.int64))
    least = _least_memory(sel)
    out = []
    for i, allowed in enumerate(sel.allowed):
        local = search.local(i)
        local[~np.isfinite(local)] = np.inf
        best = np.argsort(local, kind="stable")[: max(k - 1, 0)]
        picked = np.unique(np.concatenate([[pos[i], least[i]], best]))
        out.append(allowed[picked])
    return out


def _least_memory(sel: Selection) -> np.ndarray:
    """Each node's least-usage choice (summed over pools), cheapest among equals."""
    use = [np.zeros(len(a)) for a in sel.allowed]
    for mem in sel.memory:
        for i, c in zip(mem.nodes, mem.coef, strict=True):
            use[i] = use[i] + c
    return np.array([int(np.lexsort((c, u))[0]) for c, u in zip(sel.node_cost, use, strict=True)])


class LocalSearch:
    """A position per node with what single-node moves need: each node's neighbours, the
    memory left at every check time, and the forbidden pairs in use."""

    def __init__(self, sel: Selection, pos: np.ndarray):
        self.sel = sel
        n = sel.num_nodes
        self.pos = np.asarray(pos, dtype=np.int64).copy()
        self.nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        self.incident: list[list[int]] = [[] for _ in range(n)]
        for e, ((u, v), t) in enumerate(zip(sel.edges, sel.edge_cost, strict=True)):
            self.nbrs[u].append((v, t))
            self.nbrs[v].append((u, t.T))
            self.incident[u].append(e)
            self.incident[v].append(e)
        self.bad = {e for e in range(len(sel.edges)) if not self._allowed_pair(e)}
        # per node: (pool index, first, last, usage above the smallest per choice)
        self.mem: list[list[tuple[int, int, int, np.ndarray]]] = [[] for _ in range(n)]
        self.slack = []
        for p, m in enumerate(sel.memory):
            self.slack.append(m.rhs - m.load(self.pos))
            for i, a, b, c in zip(m.nodes, m.first, m.last, m.coef, strict=True):
                self.mem[i].append((p, int(a), int(b), c))

    # ---------------------------------------------------------------- single-node moves

    def local(self, i: int) -> np.ndarray:
        """Cost of each choice of node i given its neighbours (inf: a forbidden pair)."""
        acc = self.sel.node_cost[i].copy()
        for j, t in self.nbrs[i]:
            acc += t[:, self.pos[j]]
        return acc

    def extra(self, i: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per pool node i is in: (memory each choice adds, slack over its live range)."""
        out = []
        for p, a, b, c in self.mem[i]:
            out.append((c - c[self.pos[i]], self.slack[p][a:b]))
        return out

    def fitting(self, i: int) -> np.ndarray:
        """Which choices of node i keep every check time within the limit."""
        ok = np.ones(len(self.sel.allowed[i]), dtype=bool)
        for add, slack in self.extra(i):
            if len(slack):
                ok &= add <= slack.min()
        return ok

    def move(self, i: int, c: int) -> None:
        for p, a, b, coef in self.mem[i]:
            self.slack[p][a:b] -= coef[c] - coef[self.pos[i]]
        self.pos[i] = c
        for e in self.incident[i]:
            if self._allowed_pair(e):
                self.bad.discard(e)
            else:
                self.bad.add(e)

    def _allowed_pair(self, e: int) -> bool:
        u, v = self.sel.edges[e]
        return math.isfinite(self.sel.edge_cost[e][self.pos[u], self.pos[v]])

    # ---------------------------------------------------------------------------- repair

    def repair(self, deadline: float, seed: int) -> bool:
        """Until no forbidden pair and no overflow (False if out of time or moves): forbidden
        pairs by min-conflicts, then memory by the cheapest bytes (`_free_memory`)."""
        rng = np.random.default_rng(seed)
        tabu: dict[tuple[int, int], int] = {}
        for step in range(REPAIR_MOVES + REPAIR_MOVES_PER_NODE * self.sel.num_nodes):
            if past(deadline):
                return False
            if self.bad:
                self._min_conflicts(rng, tabu, step)
                continue
            over = [
                (p, int(np.argmin(s))) for p, s in enumerate(self.slack) if s.min(initial=0) < 0
            ]
            if not over:
                return True
            if not self._free_memory(*over[0]):
                self._min_conflicts(rng, tabu, step, self._memory_culprit(*over[0]))
        return False

    def _min_conflicts(
        self, rng: np.random.Generator, tabu: dict[tuple[int, int], int], step: int, i: int = -1
    ) -> None:
        """Move a node on a forbidden pair (or node i) to its least-violating choice that is
        not tabu (sometimes a random one)."""
        if i < 0:
            e = sorted(self.bad)[int(rng.integers(len(self.bad)))]
            i = self.sel.edges[e][int(rng.integers(2))]
        score = self._repair_scores(i)
        allowed = [c for c in range(len(score)) if tabu.get((i, c), -1) < step]
        if rng.random() < NOISE:
            c = int(rng.choice(allowed)) if allowed else int(self.pos[i])
        else:
            c = min(allowed or range(len(score)), key=lambda k: score[k])
        if c != self.pos[i]:
            tabu[(i, int(self.pos[i]))] = step + TABU_TENURE
            self.move(i, c)

    def _free_memory(self, p: int, t: int) -> bool:
        """At the fullest time t of pool p, the move (a node live there, a choice with less
        usage, no forbidden pair) that costs least per byte of the overflow it removes;
        False if there is none. Usage only falls over the node's range: no new overflow."""
        mem = self.sel.memory[p]
        need = -float(self.slack[p][t])
        best: tuple[float, int, int] | None = None
        for k in np.flatnonzero((mem.first <= t) & (t < mem.last)):
            i = int(mem.nodes[k])
            coef = mem.coef[k]
            freed = coef[self.pos[i]] - coef
            if freed.max() <= 0:
                continue
            local = self.local(i)
            worse = local - local[self.pos[i]]  # inf - inf when the node is on a forbidden pair
            ratio = np.full(len(freed), np.inf)
            helps = (freed > 0) & np.isfinite(worse)
            ratio[helps] = worse[helps] / np.minimum(freed[helps], need)
            c = int(np.argmin(ratio))
            if np.isfinite(ratio[c]) and (best is None or ratio[c] < best[0]):
                best = (float(ratio[c]), i, c)
        if best is None:
            return False
        self.move(best[1], best[2])
        return True

    def _repair_scores(self, i: int) -> list[tuple[int, float, float]]:
        """Per choice of node i: (forbidden pairs, memory overflow, finite cost)."""
        forbidden = np.zeros(len(self.sel.allowed[i]), dtype=np.int64)
        cost = self.sel.node_cost[i].copy()
        for j, t in self.nbrs[i]:
            col = t[:, self.pos[j]]
            forbidden += ~np.isfinite(col)
            cost += np.where(np.isfinite(col), col, 0.0)
        overflow = np.zeros(len(forbidden))
        for add, slack in self.extra(i):
            if len(slack):
                overflow += np.maximum(add[:, None] - slack[None, :], 0).sum(axis=1)
        return list(zip(forbidden.tolist(), overflow.tolist(), cost.tolist(), strict=True))

    def _memory_culprit(self, p: int, t: int) -> int:
        """A node live at time t that can lower its usage (for min-conflicts when every such
        move meets a forbidden pair)."""
        mem = self.sel.memory[p]
        for k in np.flatnonzero((mem.first <= t) & (t < mem.last)):
            if mem.coef[k][self.pos[mem.nodes[k]]] > mem.coef[k].min():
                return int(mem.nodes[k])
        return int(mem.nodes[np.flatnonzero((mem.first <= t) & (t < mem.last))[0]])

    # --------------------------------------------------------------------------- improve

    def improve(self, deadline: float) -> None:
        """Best single-node moves that fit, memory-free ones first, then by cost saved per
        byte, until no move helps (the answer stays valid throughout)."""
        active = set(range(self.sel.num_nodes))
        while active and not past(deadline):
            moves = []
            for i in sorted(active):
                if len(self.sel.allowed[i]) > 1:
                    found = self._best_move(i)
                    if found is not None:
                        moves.append(found)
            active = set()
            moves.sort(key=lambda m: (m[2] > 0, -m[1] / max(m[2], 1e-300) if m[2] > 0 else -m[1]))
            for i, *_ in moves:
                if past(deadline):
                    return
                found = self._best_move(i)  # the neighbours or the memory may have changed
                if found is None:
                    continue
                self.move(i, found[3])
                active.add(i)
                active.update(j for j, _ in self.nbrs[i])
                if found[2] < 0:  # memory freed: nodes sharing a check time may use it
                    for p, a, b, _ in self.mem[i]:
                        mem = self.sel.memory[p]
                        near = (mem.first < b) & (a < mem.last)
                        active.update(int(j) for j in mem.nodes[near])

    def _best_move(self, i: int) -> tuple[int, float, float, int] | None:
        """(node, cost saved, memory added, choice) of node i's best fitting move, if any."""
        local = self.local(i)
        here = local[self.pos[i]]
        local[~self.fitting(i)] = math.inf
        c = int(np.argmin(local))
        if c == self.pos[i] or not _lower(float(local[c]), float(here)):
            return None
        added = max((float(add[c]) for add, _ in self.extra(i)), default=0.0)
        return i, float(here - local[c]), added, c


def _lower(value: float, than: float) -> bool:
    """`value` is below `than` by more than rounding: 1e-12 of its size (an infinite `than`,
    a forbidden choice, is above every finite value). With negative costs `than * (1 - 1e-12)`
    is *above* `than`, and a move that saves nothing was taken again and again."""
    if math.isinf(than):
        return value < than
    return value < than - 1e-12 * abs(than) - 1e-300
