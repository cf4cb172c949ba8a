"""Model data shared by the `ilp` and `cpsat` backends (no solver imported here).

Two problems, each built once from a `Problem` and encoded by both backends, so the two
encodings can only differ in how they say the same thing:

- `Selection`: the additive objective (OptCNN Eq. 1) over one choice per node, after exact
  reductions: forbidden (inf) choices removed, arc consistency over forbidden pairs, parallel
  edges merged, edges with a single-choice end or a separable table folded into node costs,
  and the memory rule of the cost-table format (for every distinct interval start t and pool
  m, the usages live at t sum to at most the limit) reduced to its non-dominated live sets.
- `PlacementProblem`: DLPlacer's device placement (Pal et al. 2019, Sec. 6, Eqs. 7-13). Every
  op of a training graph has a forward, a backward and (with parameters) an update task, as in
  `planner.simulator`; each node of the Problem goes to one device (Eq. 7) and takes that
  device's single-device config; a tensor whose producer and consumer are apart pays the
  route's delay, sum over its links of bytes / bandwidth + latency (Eq. 11; routes over the
  hardware graph, Eqs. 8-9); tasks on one device do not overlap (Eq. 12); memory per device
  (Eq. 13, or the Problem's liveness rule when it has a limit). Schedules come in two orders:
  "free" (DLPlacer: any order on a device; zero-time tasks hold no device) and "fifo" (the
  simulator's program order on every device), and are timed by `list_schedule`.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import networkx as nx
import numpy as np

from planner.errors import LayerwiseError
from planner.evaluate import additive_cost, memory_feasible

if TYPE_CHECKING:
    from backends.base import SolveOptions
    from planner.costmodel import CostModel
    from planner.devices import DeviceGraph
    from planner.opgraph import Edge, OpGraph
    from planner.problem import Problem

__all__ = [
    "MemoryRow",
    "PlacementOutcome",
    "PlacementProblem",
    "Schedule",
    "Selection",
    "canonical_placement",
    "check_schedule",
    "device_symmetries",
    "greedy_placement",
    "improve_placement",
    "horizon",
    "live_sets",
    "list_schedule",
    "retime",
    "placement_lower_bound",
    "placement_problem",
    "random_placement_problem",
    "seed_choices",
    "selection",
    "series_bound",
    "series_segments",
    "solve_placement_problem",
    "upward_priority",
    "warm_schedule",
]

MEMORY_RTOL = 1e-9  # the tolerance of planner.evaluate.memory_feasible
ORDERS = ("free", "fifo")
Devices = Sequence[int] | np.ndarray  # a device per node
Times = Sequence[float] | np.ndarray  # a time per task
ROUTINGS = ("fixed", "shortest")


class PlacementError(LayerwiseError):
    """A placement problem cannot be built from this Problem (no DNN, no single-device configs)."""


# ================================================================================ additive


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
    while improved and time.perf_counter() < deadline:
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


# =============================================================================== placement


@dataclass(frozen=True)
class PlacementMemory:
    """sum over (node, device) of coef[node, device] * P[node, device] <= limit."""

    coef: np.ndarray  # (nodes, D)
    limit: float


@dataclass(frozen=True, eq=False)
class PlacementProblem:
    """Tasks, precedences with transfer delays, devices and memory of a placement problem.

    Task indices are a topological order (every precedence goes from a lower to a higher
    index); `order_key` is the simulator's program order, used by the "fifo" schedule.
    """

    name: str
    devices: DeviceGraph
    node_names: tuple[str, ...]
    config_of: np.ndarray  # (nodes, D) single-device config index per device, -1: none
    task_names: tuple[str, ...]
    task_node: np.ndarray  # (T,)
    duration: np.ndarray  # (T, D) seconds
    order_key: tuple[tuple[int, int], ...]  # (T,)
    prec: np.ndarray  # (P, 2) task pairs (before, after)
    nbytes: np.ndarray  # (P,) bytes moved when the two tasks are on different devices
    delay: np.ndarray  # (P, D, D) seconds; 0 on the diagonal and where nbytes == 0
    routing: str = "fixed"
    memory: tuple[PlacementMemory, ...] = ()
    symmetries: tuple[tuple[int, ...], ...] = field(default=())  # device permutations

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    @property
    def num_tasks(self) -> int:
        return len(self.task_names)

    @property
    def num_devices(self) -> int:
        return self.devices.num_devices

    @property
    def allowed(self) -> np.ndarray:
        """(nodes, D) bool: the node has a single-device config on the device."""
        return self.config_of >= 0

    def choices(self, placement: Devices) -> tuple[int, ...]:
        """Config indices (the Problem's choice vector) of a device per node."""
        out = []
        for node, d in enumerate(placement):
            c = int(self.config_of[node, d])
            if c < 0:
                raise PlacementError(f"node {self.node_names[node]!r} cannot go to device {d}")
            out.append(c)
        return tuple(out)

    def placement_of(self, choices: Sequence[int]) -> tuple[int, ...] | None:
        """The device per node of a choice vector, None unless every choice is single-device."""
        out = []
        for node, c in enumerate(choices):
            hit = np.flatnonzero(self.config_of[node] == c)
            if len(hit) != 1:
                return None
            out.append(int(hit[0]))
        return tuple(out)

    def memory_ok(self, placement: Devices) -> bool:
        idx = np.arange(self.num_nodes), np.asarray(placement)
        return all(
            float(row.coef[idx].sum()) <= row.limit * (1 + MEMORY_RTOL) for row in self.memory
        )

    def descendants(self) -> list[int]:
        """Bitsets (Python ints) of the tasks reachable from each task."""
        succ: list[list[int]] = [[] for _ in range(self.num_tasks)]
        for x, y in self.prec:
            succ[int(x)].append(int(y))
        desc = [0] * self.num_tasks
        for t in range(self.num_tasks - 1, -1, -1):
            for s in succ[t]:
                desc[t] |= desc[s] | (1 << s)
        return desc

    def exclusive_pairs(self, order: str) -> list[tuple[int, int]]:
        """Task pairs x < y that may share a device and that no precedence path orders.

        "free": both take time on some common device (Eq. 12 needs an order for them);
        "fifo": every such pair (the program order decides, zero-time tasks included)."""
        desc = self.descendants()
        busy: np.ndarray = np.asarray((self.duration > 0).any(axis=1))
        allowed = self.allowed
        out = []
        for x in range(self.num_tasks):
            if order == "free" and not busy[x]:
                continue
            ax = allowed[self.task_node[x]]
            for y in range(x + 1, self.num_tasks):
                if (desc[x] >> y) & 1 or (order == "free" and not busy[y]):
                    continue
                if (ax & allowed[self.task_node[y]]).any():
                    out.append((x, y))
        return out

    def scaled(self, factor: float, rounding: str = "ceil") -> tuple[np.ndarray, np.ndarray]:
        """Durations and delays in integer units of 1/factor seconds (rounded up by default:
        a schedule of the rounded times is valid with the real times)."""
        op = np.ceil if rounding == "ceil" else np.floor
        return (
            op(self.duration * factor - 1e-9).astype(np.int64),
            op(self.delay * factor - 1e-9).astype(np.int64),
        )


@dataclass(frozen=True)
class Schedule:
    placement: tuple[int, ...]
    start: np.ndarray  # (T,) seconds
    end: np.ndarray  # (T,)

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if len(self.end) else 0.0


def list_schedule(
    pp: PlacementProblem,
    placement: Devices,
    order: str = "free",
    priority: Sequence[int] | None = None,
    duration: np.ndarray | None = None,
    delay: np.ndarray | None = None,
) -> Schedule:
    """Earliest start of every task, in `priority` (a topological order; default: task index)
    for "free" or in program order for "fifo": a task starts when its predecessors are done
    and their tensors have arrived, and when the device's previous task in that order is done
    (in "free", zero-time tasks neither wait for nor hold the device). The minimum over all
    priorities is the optimum of "free" for this placement; "fifo" has a single schedule."""
    dur = pp.duration if duration is None else duration
    dly = pp.delay if delay is None else delay
    place = np.asarray(placement)
    dev = place[pp.task_node]
    if order == "fifo":
        seq: Sequence[int] = sorted(range(pp.num_tasks), key=lambda t: (pp.order_key[t], t))
    else:
        seq = range(pp.num_tasks) if priority is None else priority
    preds: list[list[tuple[int, int]]] = [[] for _ in range(pp.num_tasks)]
    for p, (x, y) in enumerate(pp.prec):
        preds[int(y)].append((int(x), p))
    start = np.zeros(pp.num_tasks, dtype=dur.dtype)
    end = np.zeros(pp.num_tasks, dtype=dur.dtype)
    free = np.zeros(pp.num_devices, dtype=dur.dtype)
    for t in seq:
        d = dev[t]
        ready = max((end[x] + dly[p, dev[x], d] for x, p in preds[t]), default=0)
        length = dur[t, d]
        holds = order == "fifo" or length > 0
        if holds:
            ready = max(ready, free[d])
        start[t], end[t] = ready, ready + length
        if holds:
            free[d] = end[t]
    return Schedule(tuple(int(d) for d in place), start, end)


def check_schedule(
    pp: PlacementProblem, placement: Devices, start: np.ndarray, order: str = "free"
) -> float:
    """The makespan of a placement and start times, after checking every constraint."""
    place = np.asarray(placement)
    if not pp.allowed[np.arange(pp.num_nodes), place].all():
        raise PlacementError("a node is on a device where it has no single-device config")
    dev = place[pp.task_node]
    dur = pp.duration[np.arange(pp.num_tasks), dev]
    end = start + dur
    span = float(end.max()) if len(end) else 0.0
    tol = 1e-9 * max(span, 1e-12)
    for p, (x, y) in enumerate(pp.prec):
        if start[y] < end[x] + pp.delay[p, dev[x], dev[y]] - tol:
            raise PlacementError(f"{pp.task_names[y]} starts before {pp.task_names[x]} arrives")
    for d in range(pp.num_devices):
        on = np.flatnonzero(dev == d)
        if order == "fifo":
            on = np.array(sorted(on, key=lambda t: (pp.order_key[t], t)), dtype=np.int64)
            bad = start[on[1:]] < end[on[:-1]] - tol
        else:
            on = on[dur[on] > 0]
            on = on[np.argsort(start[on], kind="stable")]
            bad = start[on[1:]] < end[on[:-1]] - tol
        if bad.any():
            raise PlacementError(f"two tasks overlap on device {d}")
    if not pp.memory_ok(place):
        raise PlacementError("the placement exceeds a memory limit")
    return span


def placement_lower_bound(pp: PlacementProblem) -> float:
    """max(longest path with no transfers at each task's fastest device, smallest device load
    total / D): a proven lower bound on the makespan of any placement."""
    fastest = np.where(pp.allowed[pp.task_node], pp.duration, np.inf).min(axis=1)
    head = np.zeros(pp.num_tasks)
    preds: list[list[int]] = [[] for _ in range(pp.num_tasks)]
    for x, y in pp.prec:
        preds[int(y)].append(int(x))
    for t in range(pp.num_tasks):
        head[t] = max((head[x] + fastest[x] for x in preds[t]), default=0.0)
    path = float((head + fastest).max()) if pp.num_tasks else 0.0
    return max(path, float(fastest.sum()) / pp.num_devices)


def greedy_placement(
    pp: PlacementProblem, order: str = "free", deadline: float = math.inf
) -> Schedule | None:
    """A list-scheduling placement (HEFT-like): tasks by decreasing upward rank, each new
    node on the device where its task finishes first within memory; or everything on one
    device if that is faster; then `improve_placement` until the deadline. None if nothing
    fits in memory."""
    D = pp.num_devices
    allowed = pp.allowed
    priority = upward_priority(pp)
    preds: list[list[tuple[int, int]]] = [[] for _ in range(pp.num_tasks)]
    for p, (x, y) in enumerate(pp.prec):
        preds[int(y)].append((int(x), p))
    place = np.full(pp.num_nodes, -1)
    end = np.zeros(pp.num_tasks)
    free = np.zeros(D)
    load = [np.zeros(()) for _ in pp.memory]
    for t in priority:
        node = pp.task_node[t]
        if place[node] < 0:
            best, best_key = -1, (math.inf, math.inf)  # (finish time, device)
            for d in np.flatnonzero(allowed[node]):
                if not all(
                    load[r] + row.coef[node, d] <= row.limit * (1 + MEMORY_RTOL)
                    for r, row in enumerate(pp.memory)
                ):
                    continue
                ready = max((end[x] + pp.delay[p, place[pp.task_node[x]], d]
                             for x, p in preds[t]), default=0.0)  # fmt: skip
                finish = max(ready, free[d]) + pp.duration[t, d]
                if (finish, d) < best_key:
                    best, best_key = int(d), (float(finish), float(d))
            if best < 0:
                return _packed_schedule(pp, order, priority)
            place[node] = best
            for r, row in enumerate(pp.memory):
                load[r] = load[r] + row.coef[node, best]
        d = place[node]
        ready = max((end[x] + pp.delay[p, place[pp.task_node[x]], d] for x, p in preds[t]),
                    default=0.0)  # fmt: skip
        end[t] = max(ready, free[d]) + pp.duration[t, d]
        if pp.duration[t, d] > 0:
            free[d] = end[t]
    options = [canonical_placement(pp, place)]
    for dev in range(D):
        if allowed[:, dev].all() and pp.memory_ok([dev] * pp.num_nodes):
            options.append(canonical_placement(pp, [dev] * pp.num_nodes))
            break
    schedules = [
        list_schedule(pp, p, order, priority if order == "free" else None) for p in options
    ]
    return improve_placement(pp, min(schedules, key=lambda s: s.makespan), order, deadline)


def improve_placement(
    pp: PlacementProblem, schedule: Schedule, order: str = "free", deadline: float = math.inf
) -> Schedule:
    """Local search: move one node to another device when the re-timed schedule (in the
    current schedule's order) is shorter and fits in memory; until no move helps."""
    best = schedule
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for k in range(pp.num_nodes):
            for d in np.flatnonzero(pp.allowed[k]):
                if d == best.placement[k]:
                    continue
                place = list(best.placement)
                place[k] = int(d)
                if not pp.memory_ok(place):
                    continue
                moved = retime(pp, place, best.start, order)
                if moved.makespan < best.makespan * (1 - 1e-12):
                    best, improved = moved, True
    # A device symmetry maps a schedule to one with the same times: keep the canonical image.
    return replace(best, placement=canonical_placement(pp, best.placement))


def upward_priority(pp: PlacementProblem) -> list[int]:
    """Tasks by decreasing upward rank (mean time to the end, transfers included): HEFT's
    list order, a topological order."""
    allowed = pp.allowed[pp.task_node]
    mean_dur = np.where(allowed, pp.duration, 0).sum(axis=1) / np.maximum(1, allowed.sum(axis=1))
    D = pp.num_devices
    mean_delay = pp.delay.sum(axis=(1, 2)) / max(1, D * (D - 1))
    succ: list[list[tuple[int, int]]] = [[] for _ in range(pp.num_tasks)]
    for p, (x, y) in enumerate(pp.prec):
        succ[int(x)].append((int(y), p))
    rank = np.zeros(pp.num_tasks)
    for t in range(pp.num_tasks - 1, -1, -1):
        rank[t] = mean_dur[t] + max((rank[y] + mean_delay[p] for y, p in succ[t]), default=0.0)
    return sorted(range(pp.num_tasks), key=lambda t: (-rank[t], t))


def _packed_schedule(pp: PlacementProblem, order: str, priority: list[int]) -> Schedule | None:
    """Memory first: nodes by decreasing size, each on the device it fills least."""
    place = np.full(pp.num_nodes, -1)
    load = np.zeros(len(pp.memory))
    limit = np.array([row.limit * (1 + MEMORY_RTOL) for row in pp.memory])
    size = sum((row.coef.max(axis=1) / row.limit for row in pp.memory), np.zeros(pp.num_nodes))
    for node in np.argsort(-size, kind="stable"):
        best, best_fill = -1, math.inf
        for d in np.flatnonzero(pp.allowed[node]):
            new = load + np.array([row.coef[node, d] for row in pp.memory])
            fill = float((new / limit).max()) if len(limit) else 0.0
            if (new <= limit).all() and fill < best_fill:
                best, best_fill = int(d), fill
        if best < 0:
            return None
        place[node] = best
        load += np.array([row.coef[node, best] for row in pp.memory])
    return list_schedule(pp, canonical_placement(pp, place), order, priority)


def horizon(pp: PlacementProblem) -> float:
    """Every task and every transfer one after the other: no semi-active schedule of any
    placement is longer (an upper bound of the optimum, for big-M)."""
    return float(pp.duration.max(axis=1).sum() + pp.delay.max(axis=(1, 2)).sum())


def canonical_placement(pp: PlacementProblem, placement: Devices) -> tuple[int, ...]:
    """The lexicographically smallest image of a placement under the device symmetries."""
    place = tuple(int(d) for d in placement)
    return min([place, *(tuple(sigma[d] for d in place) for sigma in pp.symmetries)])


# ------------------------------------------------------------------------ building one


def placement_problem(
    problem: Problem, phases: str = "training", routing: str = "fixed"
) -> PlacementProblem:
    """DLPlacer's placement problem of a Problem built from a DNN (see the module docstring).

    phases: "training" (forward, backward and update tasks) or "forward" (inference).
    routing: "fixed" (the device graph's routes, as the simulator) or "shortest" (each
    tensor's fastest path over the hardware graph: what Eqs. 8-9's routing variables pick
    when links carry no contention). Memory: the Problem's liveness rule and limit when it
    has one, else each device's capacity (Eq. 13)."""
    if phases not in ("training", "forward"):
        raise PlacementError(f"phases must be 'training' or 'forward', got {phases!r}")
    if routing not in ROUTINGS:
        raise PlacementError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if problem.graph is None or problem.space is None or problem.cost_model is None:
        raise PlacementError(
            f"problem {problem.name!r} has no DNN behind it: the makespan objective places ops "
            "of a graph (build the problem with planner.problem.build_problem)"
        )
    assert problem.devices is not None
    graph, cm, devices = problem.graph, problem.cost_model, problem.devices
    D = devices.num_devices
    ops_of = problem.ops_of_nodes
    node_of = {i: k for k, ops in enumerate(ops_of) for i in ops}
    config_of = np.full((len(ops_of), D), -1, dtype=np.int64)
    for k, ops in enumerate(ops_of):
        for c, cfg in enumerate(problem.space[ops[0]].configs):
            if cfg.num_tasks == 1:
                config_of[k, cfg.devices[0]] = c
    if not (config_of >= 0).any(axis=1).all():
        raise PlacementError(
            f"problem {problem.name!r} has ops without a single-device config (max_configs "
            "cut them): build it without max_configs for the makespan objective"
        )
    n = len(graph.ops)
    names: list[str] = []
    node: list[int] = []
    dur: list[np.ndarray] = []
    keys: list[tuple[int, int]] = []
    index: dict[tuple[str, int], int] = {}

    def add(phase: str, i: int, times: np.ndarray, key: tuple[int, int]) -> None:
        index[(phase, i)] = len(names)
        names.append(f"{phase} {graph.ops[i].name}")
        node.append(node_of[i])
        dur.append(times)
        keys.append(key)

    for i in range(n):
        add("fwd", i, _per_device(problem, cm, i, config_of[node_of[i]], 0), (0, i))
    if phases == "training":
        for i in range(n - 1, -1, -1):
            add("bwd", i, _per_device(problem, cm, i, config_of[node_of[i]], 1), (1, n - 1 - i))
        for s in _sync_groups(graph):
            op = graph.ops[s]
            if op.params:
                copies, eff = cm.options.param_copies, cm.options.memory_efficiency
                times = copies * op.param_bytes / (cm.mem_bw * eff)
                add("update", s, np.where(config_of[node_of[s]] >= 0, times, 0.0), (2, s))
    prec: list[tuple[int, int]] = []
    nbytes: list[float] = []
    for e in graph.edges:
        b = _edge_bytes(graph, e)
        if b == 0:
            continue
        prec.append((index[("fwd", e.src)], index[("fwd", e.dst)]))
        nbytes.append(b)
        if phases == "training":
            prec.append((index[("bwd", e.dst)], index[("bwd", e.src)]))
            nbytes.append(b)
    if phases == "training":
        for i in range(n):
            prec.append((index[("fwd", i)], index[("bwd", i)]))
            nbytes.append(0.0)
        for s, members in _sync_groups(graph).items():
            if ("update", s) in index:
                for j in members:
                    prec.append((index[("bwd", j)], index[("update", s)]))
                    nbytes.append(0.0)
    bytes_arr = np.array(nbytes, dtype=np.float64)
    pp = PlacementProblem(
        name=f"{problem.name}@{devices.name}",
        devices=devices,
        node_names=problem.node_names,
        config_of=config_of,
        task_names=tuple(names),
        task_node=np.array(node, dtype=np.int64),
        duration=np.array(dur, dtype=np.float64).reshape(len(names), D),
        order_key=tuple(keys),
        prec=np.array(prec, dtype=np.int64).reshape(-1, 2),
        nbytes=bytes_arr,
        delay=route_delays(devices, bytes_arr, routing),
        routing=routing,
        memory=_placement_memory(problem, config_of),
    )
    return replace(pp, symmetries=device_symmetries(pp))


def _per_device(
    problem: Problem, cm: CostModel, i: int, configs: np.ndarray, phase: int
) -> np.ndarray:
    """Forward (phase 0) or backward (1) seconds of op i on each device (0 where not allowed)."""
    assert problem.space is not None
    out = np.zeros(len(configs))
    for d, c in enumerate(configs):
        if c >= 0:
            out[d] = float(cm.task_times(i, problem.space[i].configs[c])[phase][0])
    return out


def _sync_groups(graph: OpGraph) -> dict[int, list[int]]:
    """Parameter group -> its ops, keyed by its first op (as planner.simulator)."""
    first: dict[str, int] = {}
    out: dict[int, list[int]] = {}
    for i, op in enumerate(graph.ops):
        g = op.param_group
        if g is not None and g in first:
            out[first[g]].append(i)
            continue
        if g is not None:
            first[g] = i
        out[i] = [i]
    return out


def _edge_bytes(graph: OpGraph, e: Edge) -> float:
    """Bytes a whole consumer needs from a whole producer (the regions of planner.regions)."""
    from planner.regions import needed_boxes, overlap_volume, task_boxes

    src, dst = graph.ops[e.src], graph.ops[e.dst]
    ones_u = np.ones((1, len(src.output.sizes)), dtype=np.int64)
    ones_v = np.ones((1, len(dst.output.sizes)), dtype=np.int64)
    plo, phi = task_boxes(src.output.sizes, ones_u, 1)
    olo, ohi = task_boxes(dst.output.sizes, ones_v, 1)
    nlo, nhi = needed_boxes(graph.input_maps(e), src.output.sizes, dst.output.dims, olo, ohi)
    return float(overlap_volume(plo, phi, nlo, nhi)[0, 0, 0, 0] * src.output.dtype_bytes)


def _placement_memory(problem: Problem, config_of: np.ndarray) -> tuple[PlacementMemory, ...]:
    if problem.usage is None:
        return ()
    D = config_of.shape[1]
    if problem.usage_limit is not None and problem.intervals is not None:
        limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1)
        sets = live_sets(problem.intervals)
    else:
        assert problem.devices is not None
        limit = np.array([float(d.memory) for d in problem.devices.devices])
        sets = [np.arange(len(config_of))]
    rows = []
    for nodes in sets:
        for m in range(len(limit)):
            coef = np.zeros(config_of.shape)
            for k in nodes:
                for d in range(D):
                    if config_of[k, d] >= 0:
                        coef[k, d] = np.asarray(problem.usage[k])[config_of[k, d]].reshape(-1)[m]
            if coef.max(axis=1).sum() > limit[m]:  # else it cannot bind
                rows.append(PlacementMemory(coef, float(limit[m])))
    return tuple(rows)


def route_delays(devices: DeviceGraph, nbytes: np.ndarray, routing: str) -> np.ndarray:
    """(P, D, D) seconds to move each tensor between two devices: sum over the route's links
    of bytes / bandwidth + latency (Eq. 11)."""
    D = devices.num_devices
    out = np.zeros((len(nbytes), D, D))
    if routing == "fixed":
        for a, b in itertools.permutations(range(D), 2):
            links = [devices.links[li] for li in devices.route(a, b)]
            inv = sum(1.0 / link.bandwidth for link in links)
            lat = sum(link.latency for link in links)
            out[:, a, b] = np.where(nbytes > 0, nbytes * inv + lat, 0.0)
        return out
    g = hardware_graph(devices)
    names = [d.name for d in devices.devices]
    for size in np.unique(nbytes[nbytes > 0]):
        for _, _, data in g.edges(data=True):
            data["w"] = min(size / bw + lat for bw, lat in data["links"])
        rows = nbytes == size
        for a in range(D):
            dist = nx.single_source_dijkstra_path_length(g, names[a], weight="w")
            for b in range(D):
                if a != b:
                    out[rows, a, b] = dist[names[b]]
    return out


def hardware_graph(devices: DeviceGraph) -> nx.Graph:
    """Devices and switches; each edge lists its links' (bandwidth, latency)."""
    g = nx.Graph()
    for d in devices.devices:
        g.add_node(d.name, role=("device", d.kind, d.flops, d.mem_bandwidth, d.memory))
    for s in devices.switches:
        g.add_node(s, role=("switch",))
    for link in devices.links:
        if g.has_edge(link.a, link.b):
            g[link.a][link.b]["links"] = tuple(
                sorted((*g[link.a][link.b]["links"], (link.bandwidth, link.latency)))
            )
        else:
            g.add_edge(link.a, link.b, links=((link.bandwidth, link.latency),))
    return g


MAX_AUTOMORPHISMS = 5000


def device_symmetries(pp: PlacementProblem) -> tuple[tuple[int, ...], ...]:
    """Device permutations (not the identity) that map the problem onto itself: automorphisms
    of the hardware graph under which durations, delays, allowed devices and memory agree."""
    g = hardware_graph(pp.devices)
    names = [d.name for d in pp.devices.devices]
    where = {name: k for k, name in enumerate(names)}
    matcher = nx.algorithms.isomorphism.GraphMatcher(
        g,
        g,
        node_match=lambda a, b: a["role"] == b["role"],
        edge_match=lambda a, b: a["links"] == b["links"],
    )
    found: set[tuple[int, ...]] = set()
    for mapping in itertools.islice(matcher.isomorphisms_iter(), MAX_AUTOMORPHISMS):
        sigma = tuple(where[mapping[name]] for name in names)
        if sigma != tuple(range(len(names))):
            found.add(sigma)
    return tuple(sorted(s for s in found if _preserves(pp, np.array(s))))


def _preserves(pp: PlacementProblem, sigma: np.ndarray) -> bool:
    if not np.array_equal(pp.allowed[:, sigma], pp.allowed):
        return False
    if not np.allclose(pp.duration[:, sigma], pp.duration, rtol=1e-12, atol=0):
        return False
    if not np.allclose(pp.delay[:, sigma][:, :, sigma], pp.delay, rtol=1e-12, atol=0):
        return False
    rows = [(r.coef, r.limit) for r in pp.memory]
    return all(
        any(lim == r.limit and np.allclose(c[:, sigma], r.coef) for c, lim in rows)
        for r in pp.memory
    )


# ---------------------------------------------------------------------- random instances


def random_placement_problem(
    num_ops: int,
    devices: DeviceGraph,
    seed: int,
    training: bool = True,
    edge_prob: float = 0.4,
    heterogeneous: bool = False,
    memory: bool = False,
    routing: str = "fixed",
) -> PlacementProblem:
    """A seeded random DAG of ops placed on `devices`: times of 0.1-10 ms, tensors of
    0-64 MB, optionally per-device speeds and a memory limit (always feasible)."""
    rng = np.random.default_rng(seed)
    D = devices.num_devices
    edges = sorted(
        {(int(rng.integers(0, v)), v) for v in range(1, num_ops)}
        | {(u, v) for u in range(num_ops) for v in range(u + 1, num_ops) if rng.random() < edge_prob / (v - u)}
    )  # fmt: skip
    speed = rng.uniform(0.5, 1.5, D) if heterogeneous else np.ones(D)
    fwd = rng.uniform(1e-4, 1e-2, num_ops) * (rng.random(num_ops) > 0.1)
    names, node, dur, keys = [], [], [], []
    for i in range(num_ops):
        names.append(f"fwd op{i}")
        node.append(i)
        dur.append(fwd[i] / speed)
        keys.append((0, i))
    if training:
        for i in range(num_ops - 1, -1, -1):
            names.append(f"bwd op{i}")
            node.append(i)
            dur.append(2 * fwd[i] / speed)
            keys.append((1, num_ops - 1 - i))
    bwd = {i: 2 * num_ops - 1 - i for i in range(num_ops)}
    prec, nbytes = [], []
    for u, v in edges:
        b = float(rng.integers(0, 64)) * 2**20
        prec.append((u, v))
        nbytes.append(b)
        if training:
            prec.append((bwd[v], bwd[u]))
            nbytes.append(b)
    if training:
        for i in range(num_ops):
            prec.append((i, bwd[i]))
            nbytes.append(0.0)
    bytes_arr = np.array(nbytes)
    rows: tuple[PlacementMemory, ...] = ()
    if memory:  # the limit lets the largest-first greedy packing through: always feasible
        use = rng.uniform(1, 10, num_ops)
        bins = np.zeros(D)
        for u in np.sort(use)[::-1]:
            bins[np.argmin(bins)] += u
        limit = float(bins.max() * rng.uniform(1.0, 1.2))
        rows = tuple(
            PlacementMemory(np.outer(use, np.eye(D)[d]), limit) for d in range(D)
        )  # fmt: skip
    pp = PlacementProblem(
        name=f"random-placement-n{num_ops}-{devices.name}-seed{seed}",
        devices=devices,
        node_names=tuple(f"op{i}" for i in range(num_ops)),
        config_of=np.tile(np.arange(D), (num_ops, 1)),
        task_names=tuple(names),
        task_node=np.array(node, dtype=np.int64),
        duration=np.array(dur).reshape(len(names), D),
        order_key=tuple(keys),
        prec=np.array(prec, dtype=np.int64).reshape(-1, 2),
        nbytes=bytes_arr,
        delay=route_delays(devices, bytes_arr, routing),
        routing=routing,
        memory=rows,
    )
    return replace(pp, symmetries=device_symmetries(pp))


@dataclass(frozen=True)
class PlacementOutcome:
    """What a solver reached on a placement problem, in seconds, decoded and re-timed."""

    status: str  # "OPTIMAL" | "FEASIBLE" | "INFEASIBLE" | "NO_SOLUTION" (of the placement model)
    schedule: Schedule | None  # the placement, re-timed by `list_schedule` in the solver's order
    model_makespan: float | None  # the solver's own makespan (>= schedule.makespan)
    bound: float | None  # proven lower bound on the model's optimum (rounding accounted for)
    timed_out: bool
    stats: dict

    @property
    def gap(self) -> float | None:
        if self.schedule is None or not self.bound:
            return None
        return max(0.0, self.schedule.makespan / self.bound - 1.0)


def retime(pp: PlacementProblem, placement: Devices, start: Times, order: str) -> Schedule:
    """The earliest schedule that keeps a solver's order of tasks: a topological order that
    takes the ready task with the smallest solver start first (ties by task index)."""
    indegree = np.zeros(pp.num_tasks, dtype=np.int64)
    succ: list[list[int]] = [[] for _ in range(pp.num_tasks)]
    for x, y in pp.prec:
        succ[int(x)].append(int(y))
        indegree[int(y)] += 1
    ready = [(float(start[t]), t) for t in range(pp.num_tasks) if indegree[t] == 0]
    heapq.heapify(ready)
    priority = []
    while ready:
        _, t = heapq.heappop(ready)
        priority.append(t)
        for y in succ[t]:
            indegree[y] -= 1
            if indegree[y] == 0:
                heapq.heappush(ready, (float(start[y]), y))
    return list_schedule(pp, placement, order, priority)


# ------------------------------------------------------------------ series decomposition

SEGMENT_TASKS = 40  # segments up to this many tasks are solved exactly for the bound


@dataclass(frozen=True)
class Segment:
    """Tasks that all run after `first` ends and before `last` starts (a block)."""

    first: int
    last: int
    inner: tuple[int, ...]


def series_segments(pp: PlacementProblem) -> list[Segment]:
    """A chain of segments from the main source to the main sink (the sink that ends the
    longest path), found with dominators and split recursively. Tasks off the chain's
    segments (parameter updates, the smaller of parallel branches such as an auxiliary head)
    are left out: the segments describe a relaxation of the problem."""
    g = nx.DiGraph()
    g.add_nodes_from(range(pp.num_tasks))
    g.add_edges_from((int(x), int(y)) for x, y in pp.prec)
    fastest = np.where(pp.allowed[pp.task_node], pp.duration, np.inf).min(axis=1)
    head = np.zeros(pp.num_tasks)
    for t in range(pp.num_tasks):
        head[t] = max((head[x] + fastest[x] for x in g.predecessors(t)), default=0.0)
    sinks = [t for t in range(pp.num_tasks) if g.out_degree(t) == 0]
    sink = max(sinks, key=lambda t: (head[t] + fastest[t], -t))
    keep = nx.ancestors(g, sink) | {sink}
    sources = [t for t in keep if g.in_degree(t) == 0]
    if len(sources) != 1:
        return []
    # Any chain of tasks each reachable from the previous one splits time; dominators on the
    # transitive reduction (no edge that a longer path implies) give the finest such chain.
    reduced = nx.transitive_reduction(g.subgraph(keep))
    return _split(reduced, sources[0], sink, keep)


def _split(g: nx.DiGraph, s: int, t: int, keep: set[int]) -> list[Segment]:
    """Segments from s to t: cut at the dominators of t; a segment too large to solve that
    is made of parallel branches keeps only the largest branch (a relaxation) and is cut
    again."""
    inner = (nx.descendants(g, s) & nx.ancestors(g, t) & keep) - {s, t}
    if not inner:
        return [Segment(s, t, ())]
    idom = nx.immediate_dominators(g.subgraph(inner | {s, t}), s)
    chain = [t]
    while chain[-1] != s:
        chain.append(idom[chain[-1]])
    chain.reverse()
    within = inner | {s, t}
    if len(chain) > 2:
        return [seg for a, b in itertools.pairwise(chain) for seg in _split(g, a, b, within)]
    parts = list(nx.weakly_connected_components(g.subgraph(inner)))
    if len(inner) <= SEGMENT_TASKS or len(parts) == 1:
        return [Segment(s, t, tuple(sorted(inner)))]
    largest = max(parts, key=lambda c: (len(c), -min(c)))
    return _split(g, s, t, largest | {s, t})


def segments_problem(
    pp: PlacementProblem, segs: Sequence[Segment], pins: Mapping[int, int]
) -> PlacementProblem | None:
    """Segments one after the other as a placement problem whose makespan is the sum of
    their spans (end of `first` to start of `last`; ends are instantaneous, glued by
    zero-delay precedences, and pinned to devices by `pins`, task -> device). Nodes keep
    their ties across the segments. None if the pins contradict."""
    tasks = [t for seg in segs for t in (seg.first, *seg.inner, seg.last)]
    ends = {t for seg in segs for t in (seg.first, seg.last)}
    where = {t: k for k, t in enumerate(tasks)}
    if len(where) != len(tasks):
        return None
    nodes = sorted({int(pp.task_node[t]) for t in tasks})
    node_index = {k: j for j, k in enumerate(nodes)}
    config_of = pp.config_of[nodes].copy()
    for task, d in pins.items():
        row = config_of[node_index[int(pp.task_node[task])]]
        if row[d] < 0:
            return None
        keep = row[d]
        row[:] = -1
        row[d] = keep
    if not (config_of >= 0).any(axis=1).all():
        return None
    mask = [p for p, (x, y) in enumerate(pp.prec) if int(x) in where and int(y) in where]
    prec = [[where[int(pp.prec[p, 0])], where[int(pp.prec[p, 1])]] for p in mask]
    glue = [[where[s1.last], where[s2.first]] for s1, s2 in itertools.pairwise(segs)]
    duration = pp.duration[tasks].copy()
    duration[[where[t] for t in ends]] = 0.0
    D = pp.num_devices
    return PlacementProblem(
        name=f"{pp.name}[{' + '.join(pp.task_names[seg.first] for seg in segs)}]",
        devices=pp.devices,
        node_names=tuple(pp.node_names[k] for k in nodes),
        config_of=config_of,
        task_names=tuple(pp.task_names[t] for t in tasks),
        task_node=np.array([node_index[int(pp.task_node[t])] for t in tasks], dtype=np.int64),
        duration=duration,
        order_key=tuple(pp.order_key[t] for t in tasks),
        prec=np.array(prec + glue, dtype=np.int64).reshape(-1, 2),
        nbytes=np.concatenate([pp.nbytes[mask], np.zeros(len(glue))]),
        delay=np.concatenate([pp.delay[mask], np.zeros((len(glue), D, D))]),
        routing=pp.routing,
    )


SegmentSolver = Callable[[PlacementProblem, float], tuple[float, "Schedule | None"]]


@dataclass
class _Spans:
    """Shortest spans of segment groups for pinned end devices, solved once each; with the
    solution found: device per node and start per task (relative to the group's start)."""

    pp: PlacementProblem
    solve: SegmentSolver
    deadline: float
    solves: int = 0
    found: dict[tuple, tuple[float, dict[int, int], dict[int, float]]] = field(default_factory=dict)

    def __call__(self, segs: tuple[Segment, ...], pins: tuple[tuple[int, int], ...]) -> float:
        key = (segs, pins)
        if key in self.found:
            return self.found[key][0]
        for sigma in self.pp.symmetries:  # a symmetric pinning has the same span
            image = (segs, tuple((t, sigma[d]) for t, d in pins))
            if image in self.found:
                value, place, start = self.found[image]
                inverse = {sigma[d]: d for d in range(len(sigma))}
                self.found[key] = (value, {k: inverse[d] for k, d in place.items()}, start)
                return value
        self.found[key] = self._solve(segs, dict(pins))
        return self.found[key][0]

    def _solve(
        self, segs: tuple[Segment, ...], pins: dict[int, int]
    ) -> tuple[float, dict[int, int], dict[int, float]]:
        sub = segments_problem(self.pp, segs, pins)
        if sub is None:
            return math.inf, {}, {}
        tasks = [t for seg in segs for t in (seg.first, *seg.inner, seg.last)]
        nodes = sorted({int(self.pp.task_node[t]) for t in tasks})
        left = self.deadline - time.perf_counter()
        size = sum(len(seg.inner) for seg in segs)
        found: Schedule | None = None
        if size == 0:
            pinned = [int(np.flatnonzero(row >= 0)[0]) for row in sub.config_of]
            found = list_schedule(sub, pinned)
            value = found.makespan
        elif size > 2 * SEGMENT_TASKS or left <= 0:
            value = placement_lower_bound(sub)
        else:
            self.solves += 1
            value, found = self.solve(sub, left)
        if found is None:
            return value, {}, {}
        place = dict(zip(nodes, found.placement, strict=True))
        return value, place, {t: float(found.start[k]) for k, t in enumerate(tasks)}


def series_bound(
    pp: PlacementProblem, solve_segment: SegmentSolver, deadline: float = math.inf
) -> tuple[float, dict[str, Any], tuple[int, ...] | None, np.ndarray | None]:
    """A lower bound on the makespan, a placement built with it and start estimates for its
    tasks, from `series_segments`.

    The chain's tasks run one after the other with each segment in between, so the makespan
    is at least min over the chain's devices of (sum of chain task times + sum of segment
    spans given their end devices). A training graph's chain is a palindrome of nodes (the
    forward blocks, then the same blocks backward): the DP is then folded, each forward
    segment solved together with its backward mirror (same ops, same devices), from the
    outside in. `solve_segment(problem, seconds)` returns a proven lower bound on a segment
    problem's makespan and its best placement; segment groups above 2 x SEGMENT_TASKS tasks,
    or met after the deadline, count their longest path only. The placement takes each
    chain node's device from the DP and each segment's from its solution; -1 for the nodes
    the segments leave out."""
    segments = series_segments(pp)
    if not segments:
        return placement_lower_bound(pp), {"segments": 0}, None, None
    chain = [segments[0].first] + [seg.last for seg in segments]
    spans = _Spans(pp, solve_segment, deadline)
    fold = _fold([int(pp.task_node[t]) for t in chain])
    if fold is None:
        value, devices, groups = _chain_dp(pp, chain, segments, spans)
    else:
        value, devices, groups = _folded_dp(pp, chain, segments, spans, fold)
    stats = {"segments": len(segments), "segment_solves": spans.solves, "folded": fold is not None}
    place = np.full(pp.num_nodes, -1)
    rel: dict[int, float] = {}  # task -> start relative to its group's sub-problem
    for segs, pins in groups:
        _, sub_place, sub_start = spans.found.get((segs, pins), (0.0, {}, {}))
        for k, d in sub_place.items():
            if place[k] < 0:
                place[k] = d
        rel.update(sub_start)
    for t, d in zip(chain, devices, strict=True):
        if place[pp.task_node[t]] < 0:
            place[pp.task_node[t]] = d
    return value, stats, tuple(int(d) for d in place), _estimates(pp, chain, segments, devices, rel)


def _estimates(
    pp: PlacementProblem,
    chain: list[int],
    segments: list[Segment],
    devices: list[int],
    rel: dict[int, float],
) -> np.ndarray:
    """A start time per task from the segment solutions laid end to end along the chain (for
    the tasks off the segments: as soon as their predecessors are done); an order to list-
    schedule the assembled placement in."""
    est = np.full(pp.num_tasks, np.nan)
    clock = 0.0
    for k, seg in enumerate(segments):
        est[seg.first] = clock
        clock += float(pp.duration[seg.first, devices[k]])
        known = seg.first in rel and seg.last in rel
        for t in seg.inner:
            if known and t in rel:
                est[t] = clock + rel[t] - rel[seg.first]
        clock += rel[seg.last] - rel[seg.first] if known else 0.0
    est[chain[-1]] = clock
    fastest = np.where(pp.allowed[pp.task_node], pp.duration, np.inf).min(axis=1)
    preds: list[list[int]] = [[] for _ in range(pp.num_tasks)]
    for x, y in pp.prec:
        preds[int(y)].append(int(x))
    for t in range(pp.num_tasks):
        if np.isnan(est[t]):
            est[t] = max((est[x] + fastest[x] for x in preds[t]), default=0.0)
    return est


def _own(pp: PlacementProblem, task: int) -> np.ndarray:
    return np.where(pp.allowed[pp.task_node[task]], pp.duration[task], math.inf)


def _chain_dp(
    pp: PlacementProblem, chain: list[int], segments: list[Segment], spans: _Spans
) -> tuple[float, list[int], list]:
    """Unfolded: best[d] over the chain, one segment at a time."""
    D = pp.num_devices
    best = _own(pp, chain[0])
    back = []
    for seg, task in zip(segments, chain[1:], strict=True):
        table = np.array([[spans((seg,), ((seg.first, a), (seg.last, b))) for b in range(D)]
                          for a in range(D)])  # fmt: skip
        total = best[:, None] + table
        back.append(total.argmin(axis=0))
        best = total.min(axis=0) + _own(pp, task)
    devices = [int(best.argmin())]
    for arg in reversed(back):
        devices.append(int(arg[devices[-1]]))
    devices.reverse()
    groups = [((seg,), ((seg.first, devices[k]), (seg.last, devices[k + 1])))
              for k, seg in enumerate(segments)]  # fmt: skip
    return float(best.min()), devices, groups


def _fold(nodes: list[int]) -> tuple[int, int, int] | None:
    """(i0, j0, L): positions i0 + l and j0 - l hold the same node for l < L, the prefix
    before i0 and suffix after j0 are short, and the middle between i0 + L - 1 and j0 - L + 1
    is what is left. None when no long palindrome is found."""
    best = None
    n = len(nodes)
    for p, q in itertools.product(range(4), repeat=2):
        i, j, run = p, n - 1 - q, 0
        while i + run < j - run and nodes[i + run] == nodes[j - run]:
            run += 1
        if run >= 2 and (best is None or run > best[2]):
            best = (p, n - 1 - q, run)
    return best


def _folded_dp(
    pp: PlacementProblem,
    chain: list[int],
    segments: list[Segment],
    spans: _Spans,
    fold: tuple[int, int, int],
) -> tuple[float, list[int], list]:
    D = pp.num_devices
    i0, j0, L = fold

    def path(lo: int, hi: int, start: int | None, end: int | None) -> tuple[np.ndarray, list]:
        """Chain positions lo..hi as a plain DP: cost[d_lo, d_hi] (own times of lo..hi
        included) and the argmin devices, for all end pairs."""
        cost = np.full((D, D), math.inf)
        choice: list = [[None] * D for _ in range(D)]
        for a in range(D) if start is None else [start]:
            best = np.full(D, math.inf)
            best[a] = _own(pp, chain[lo])[a]
            back = []
            for k in range(lo, hi):
                seg = segments[k]
                table = np.array([[spans((seg,), ((seg.first, x), (seg.last, y)))
                                   for y in range(D)] for x in range(D)])  # fmt: skip
                total = best[:, None] + table
                back.append(total.argmin(axis=0))
                best = total.min(axis=0) + _own(pp, chain[k + 1])
            for b in range(D) if end is None else [end]:
                cost[a, b] = best[b]
                devices = [b]
                for arg in reversed(back):
                    devices.append(int(arg[devices[-1]]))
                choice[a][b] = devices[::-1]
        return cost, choice

    prefix, pre_dev = path(0, i0, None, None)
    suffix, suf_dev = path(j0, len(chain) - 1, None, None)
    outside = prefix.min(axis=0) + suffix.min(axis=1)  # own times of i0 and j0 included
    levels = [outside]
    back = []
    for lv in range(L - 1):
        i, j = i0 + lv, j0 - lv
        pair = (segments[i], segments[j - 1])
        table = np.array(
            [
                [
                    spans(
                        pair,
                        (
                            (pair[0].first, d),
                            (pair[0].last, e),
                            (pair[1].first, e),
                            (pair[1].last, d),
                        ),
                    )
                    for e in range(D)
                ]
                for d in range(D)
            ]
        )
        own = _own(pp, chain[i + 1]) + _own(pp, chain[j - 1])
        total = levels[-1][:, None] + table
        back.append(total.argmin(axis=0))
        levels.append(total.min(axis=0) + own)  # fmt: skip
    mid_lo, mid_hi = i0 + L - 1, j0 - L + 1
    middle = np.full(D, math.inf)
    mid_dev: list = [None] * D
    for d in range(D):
        cost, choice = path(mid_lo, mid_hi, d, d)
        own = _own(pp, chain[mid_lo])[d] + (_own(pp, chain[mid_hi])[d] if mid_hi != mid_lo else 0)
        middle[d], mid_dev[d] = cost[d, d] - own, choice[d][d]
    total = levels[-1] + middle
    d = int(total.argmin())
    inner_dev = [d]
    for arg in reversed(back):
        inner_dev.append(int(arg[inner_dev[-1]]))
    inner_dev.reverse()  # device of level lv's node, lv = 0 .. L - 1
    devices = [0] * len(chain)
    for lv, dv in enumerate(inner_dev):
        devices[i0 + lv] = devices[j0 - lv] = dv
    for k, dv in enumerate(mid_dev[d] or []):
        devices[mid_lo + k] = dv
    d0 = inner_dev[0]
    a = int(np.argmin(prefix[:, d0]))
    for k, dv in enumerate(pre_dev[a][d0] or []):
        devices[k] = dv
    b = int(np.argmin(suffix[d0]))
    for k, dv in enumerate(suf_dev[d0][b] or []):
        devices[j0 + k] = dv
    groups: list[tuple[tuple[Segment, ...], tuple[tuple[int, int], ...]]] = []
    for lv in range(L - 1):
        i, j = i0 + lv, j0 - lv
        e, dv = inner_dev[lv + 1], inner_dev[lv]
        pair = (segments[i], segments[j - 1])
        groups.append((pair, ((pair[0].first, dv), (pair[0].last, e), (pair[1].first, e),
                              (pair[1].last, dv))))  # fmt: skip
    for k, seg in enumerate(segments):
        if k < i0 or k >= j0 or mid_lo <= k < mid_hi:
            groups.append(((seg,), ((seg.first, devices[k]), (seg.last, devices[k + 1]))))
    return float(total.min()), devices, groups


HEURISTIC_SHARE = 0.05  # of the time limit, for the greedy placement's local search
BOUND_SHARE = 0.25  # of the time limit, for the series bound's segment solves
SEGMENT_SECONDS = 2.0  # per segment solve


def solve_placement_problem(
    pp: PlacementProblem,
    options: SolveOptions,
    solve_model: Callable[
        [PlacementProblem, SolveOptions, Schedule | None, float], PlacementOutcome
    ],
    warm: tuple[Schedule, str] | None = None,
) -> PlacementOutcome:
    """The makespan solve both backends share: a warm start (SolveOptions.warm_start when it
    is a valid placement, else `greedy_placement`); the series bound (extra "series_bound",
    default on; segments solved by the same backend) and the placement it builds, improved
    by local search, as a second candidate; then `solve_model` on the whole problem from the
    better candidate for the time left. The bound reported is the better of the two."""
    t0 = time.perf_counter()
    deadline = t0 + options.time_limit
    order = options.extra.get("order", "free")
    if warm is None:
        warm = warm_schedule(pp, options, t0 + HEURISTIC_SHARE * options.time_limit)
    series: float | None = None
    stats: dict[str, Any] = {}
    if options.extra.get("series_bound", True) and pp.num_tasks > 2:
        inner = replace(options, extra={**options.extra, "series_bound": False})

        def segment(sub: PlacementProblem, left: float) -> tuple[float, Schedule | None]:
            opts = replace(inner, time_limit=max(0.05, min(left, SEGMENT_SECONDS)))
            out = solve_model(sub, opts, greedy_placement(sub, order), opts.time_limit)
            bound = out.bound if out.bound is not None else placement_lower_bound(sub)
            return bound, out.schedule

        series, stats, place, est = series_bound(pp, segment, t0 + BOUND_SHARE * options.time_limit)
        if place is not None and warm is not None:  # nodes off the segments: as the warm start
            place = tuple(d if d >= 0 else w for d, w in zip(place, warm[0].placement, strict=True))
        if place is not None and est is not None and min(place) >= 0 and pp.memory_ok(place):
            built = retime(pp, place, est, order)
            built = improve_placement(
                pp, built, order, t0 + (BOUND_SHARE + HEURISTIC_SHARE) * options.time_limit
            )
            stats["series_placement"] = built.makespan
            if warm is None or built.makespan < warm[0].makespan:
                warm = (built, "series")
    out = solve_model(pp, options, warm[0] if warm else None, deadline - time.perf_counter())
    stats = {**out.stats, **stats, "warm_start": warm[1] if warm else None, "series_bound": series}
    schedule, status = out.schedule, out.status
    if warm is not None and (schedule is None or warm[0].makespan < schedule.makespan):
        schedule, status = warm[0], "FEASIBLE"  # the solver found nothing better in time
    bound = max((b for b in (out.bound, series) if b is not None), default=None)
    if schedule is not None and bound is not None:
        bound = min(bound, schedule.makespan)
        if status == "FEASIBLE" and bound >= schedule.makespan * (1 - 1e-9):
            status = "OPTIMAL"
    return PlacementOutcome(status, schedule, out.model_makespan, bound, out.timed_out, stats)


def warm_schedule(
    pp: PlacementProblem, options: SolveOptions, deadline: float = math.inf
) -> tuple[Schedule, str] | None:
    """SolveOptions.warm_start as a placement (canonical, re-timed) when it is one and fits
    in memory, else the greedy placement; with where it came from."""
    order = options.extra.get("order", "free")
    if options.warm_start is not None:
        place = pp.placement_of(options.warm_start)
        if place is not None and pp.memory_ok(place):
            return list_schedule(pp, canonical_placement(pp, place), order), "warm_start"
    greedy = greedy_placement(pp, order, deadline)
    return (greedy, "heuristic") if greedy is not None else None
