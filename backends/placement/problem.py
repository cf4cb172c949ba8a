"""DLPlacer's placement problem, shared by the `ilp` and `cpsat` backends (no solver here).

`PlacementProblem`: DLPlacer's device placement (Pal et al. 2019, Sec. 6, Eqs. 7-13), built
once from a `Problem` by `placement_problem` and encoded by both backends. Every op of a
training graph has a forward, a backward and (with parameters) an update task, as in
`planner.sim.simulator`; each node of the Problem goes to one device (Eq. 7) and takes that
device's single-device config; a tensor whose producer and consumer are apart pays the route's
delay, sum over its links of bytes / bandwidth + latency (Eq. 11; routes over the hardware
graph, Eqs. 8-9); tasks on one device do not overlap (Eq. 12); memory per device (Eq. 13, or
the Problem's liveness rule when it has a limit). Schedules come in two orders: "free"
(DLPlacer: any order on a device; zero-time tasks hold no device) and "fifo" (the simulator's
program order on every device), and are timed by `list_schedule`. Also here: lower and upper
bounds, the greedy placement and its local search, device symmetries, random instances, and
`PlacementOutcome`, what a solver reached. The series decomposition and the makespan solve
both backends share are in `backends.placement.series`; the additive objective's data in
`backends.model.selection`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING

import networkx as nx
import numpy as np

from backends.base import past
from backends.model.selection import MEMORY_RTOL, live_sets
from planner.errors import LayerwiseError

if TYPE_CHECKING:
    from planner.costs.costmodel import CostModel
    from planner.graph.opgraph import Edge, OpGraph
    from planner.hardware.devices import DeviceGraph
    from planner.problems.problem import Problem

__all__ = [
    "PlacementOutcome",
    "PlacementProblem",
    "Schedule",
    "canonical_placement",
    "check_schedule",
    "device_symmetries",
    "greedy_placement",
    "improve_placement",
    "horizon",
    "lex_symmetries",
    "list_schedule",
    "retime",
    "placement_lower_bound",
    "placement_problem",
    "random_placement_problem",
    "upward_priority",
]

ORDERS = ("free", "fifo")
Devices = Sequence[int] | np.ndarray  # a device per node
Times = Sequence[float] | np.ndarray  # a time per task
ROUTINGS = ("fixed", "shortest")


class PlacementError(LayerwiseError):
    """A placement problem cannot be built from this Problem (no DNN, no single-device configs)."""


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

    @cached_property
    def permutations(self) -> np.ndarray:
        """(1 + symmetries, D): the identity, then every symmetry, as an array."""
        return np.array([tuple(range(self.num_devices)), *self.symmetries], dtype=np.int64)

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
    while improved and not past(deadline):
        improved = False
        for k in range(pp.num_nodes):
            if past(deadline):  # a sweep re-times the whole schedule nodes x devices times
                break
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
    place = np.asarray(placement, dtype=np.int64)
    if not pp.symmetries or len(place) == 0:
        return tuple(int(d) for d in place)
    images = pp.permutations[:, place]  # identity first
    first = np.lexsort(images.T[::-1])[0]  # numpy's lexsort: the last key is the primary one
    return tuple(int(d) for d in images[first])


def lex_symmetries(pp: PlacementProblem) -> tuple[tuple[int, ...], ...]:
    """The symmetries the placement models break (lexicographic leader), at most
    LEX_SYMMETRIES of them, those that move the fewest devices first (a swap of two identical
    GPUs forbids the most per clause): every subset is valid, and 5,000 (16 GPUs) would add
    millions of clauses, more than a time limit of minutes can encode."""
    ranked = sorted(pp.symmetries, key=lambda s: (sum(d != k for k, d in enumerate(s)), s))
    return tuple(ranked[:LEX_SYMMETRIES])


# ------------------------------------------------------------------------ building one


def placement_problem(
    problem: Problem, phases: str = "training", routing: str = "fixed", deadline: float = math.inf
) -> PlacementProblem:
    """DLPlacer's placement problem of a Problem built from a DNN (see the module docstring).

    phases: "training" (forward, backward and update tasks) or "forward" (inference).
    routing: "fixed" (the device graph's routes, as the simulator) or "shortest" (each
    tensor's fastest path over the hardware graph: what Eqs. 8-9's routing variables pick
    when links carry no contention). Memory: the Problem's liveness rule and limit when it
    has one, else each device's capacity (Eq. 13). The search for device symmetries stops at
    `deadline` (`device_symmetries`)."""
    if phases not in ("training", "forward"):
        raise PlacementError(f"phases must be 'training' or 'forward', got {phases!r}")
    if routing not in ROUTINGS:
        raise PlacementError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if not problem.is_dnn:
        raise PlacementError(
            f"problem {problem.name!r} has no DNN behind it: the makespan objective places ops "
            "of a graph (build the problem with planner.problems.problem.build_problem)"
        )
    dnn = problem.dnn()
    graph, cm, devices = dnn.graph, dnn.cost_model, dnn.devices
    D = devices.num_devices
    ops_of = problem.ops_of_nodes
    node_of = {i: k for k, ops in enumerate(ops_of) for i in ops}
    config_of = np.full((len(ops_of), D), -1, dtype=np.int64)
    for k, ops in enumerate(ops_of):
        for c, cfg in enumerate(dnn.space[ops[0]].configs):
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
                copies, eff = cm.update_copies(op), cm.options.memory_efficiency
                times = copies * op.param_bytes / (cm.mem_bw * eff)
                add("update", s, np.where(config_of[node_of[s]] >= 0, times, 0.0), (2, s))
    prec: list[tuple[int, int]] = []
    nbytes: list[float] = []
    for e in graph.edges:
        b = _edge_bytes(graph, e) * cm.edge_components(e)  # an LSTM state: h and c
        if b == 0:
            continue
        prec.append((index[("fwd", e.src)], index[("fwd", e.dst)]))
        nbytes.append(b)
        if phases == "training" and graph.ops[e.src].kind != "input":  # data: no gradient
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
    return replace(pp, symmetries=device_symmetries(pp, deadline))


def _per_device(
    problem: Problem, cm: CostModel, i: int, configs: np.ndarray, phase: int
) -> np.ndarray:
    """Forward (phase 0) or backward (1) seconds of op i on each device (0 where not allowed)."""
    space = problem.dnn().space
    out = np.zeros(len(configs))
    for d, c in enumerate(configs):
        if c >= 0:
            out[d] = float(cm.task_times(i, space[i].configs[c])[phase][0])
    return out


def _sync_groups(graph: OpGraph) -> dict[int, list[int]]:
    """Parameter group -> its ops, keyed by its first op (as planner.sim.simulator)."""
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
    """Bytes a whole consumer needs from a whole producer (the regions of planner.costs.regions)."""
    from planner.costs.regions import needed_boxes, overlap_volume, task_boxes

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
        limit = problem.dnn().cost_model.usable_memory()  # memory less the headroom
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
    of bytes / bandwidth + latency (Eq. 11), plus both devices' message overheads (CPU
    workers; DLPlacer's GPUs have none)."""
    D = devices.num_devices
    out = np.zeros((len(nbytes), D, D))
    ovh = np.array([d.message_overhead for d in devices.devices])
    if routing == "fixed":
        for a, b in itertools.permutations(range(D), 2):
            links = [devices.links[li] for li in devices.route(a, b)]
            inv = sum(1.0 / link.bandwidth for link in links)
            lat = sum(link.latency for link in links) + ovh[a] + ovh[b]
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
                    out[rows, a, b] = dist[names[b]] + ovh[a] + ovh[b]
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
LEX_SYMMETRIES = 64  # symmetries broken by the placement models' lexicographic leader


def device_symmetries(
    pp: PlacementProblem, deadline: float = math.inf
) -> tuple[tuple[int, ...], ...]:
    """Device permutations (not the identity) that map the problem onto itself: automorphisms
    of the hardware graph (the first MAX_AUTOMORPHISMS networkx's matcher finds, or those
    found by `deadline`: 5,000 take 1.5-3 s on 16 GPUs; any subset is valid, a smaller one
    breaks fewer symmetries) under which durations, delays, allowed devices and memory
    agree. Checked on the distinct rows of each array and for all permutations at once:
    ~0.1 s for 5,000 on a 16-GPU problem (one at a time on every row it took 15 s)."""
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
    for k, mapping in enumerate(itertools.islice(matcher.isomorphisms_iter(), MAX_AUTOMORPHISMS)):
        if k % 64 == 63 and past(deadline):
            break
        sigma = tuple(where[mapping[name]] for name in names)
        if sigma != tuple(range(len(names))):
            found.add(sigma)
    if not found:
        return ()
    candidates = sorted(found)
    keep = _preserved(pp, np.array(candidates, dtype=np.int64))
    return tuple(sigma for sigma, ok in zip(candidates, keep, strict=True) if ok)


PERMUTATIONS_AT_ONCE = 512  # permutations checked together (bounds the temporary arrays)


def _preserved(pp: PlacementProblem, perms: np.ndarray) -> np.ndarray:
    """Per permutation (a row of `perms`): whether allowed devices, durations, delays and
    memory rows are unchanged when the devices are permuted by it."""
    D = pp.num_devices
    allowed = np.unique(pp.allowed, axis=0)
    duration = np.unique(pp.duration, axis=0)
    delay = np.unique(pp.delay.reshape(len(pp.delay), D * D), axis=0).reshape(-1, D, D)
    keep = np.zeros(len(perms), dtype=bool)
    for lo in range(0, len(perms), PERMUTATIONS_AT_ONCE):
        s = perms[lo : lo + PERMUTATIONS_AT_ONCE]
        ok = (allowed[:, s] == allowed[:, None, :]).all(axis=(0, 2))
        ok &= np.isclose(duration[:, s], duration[:, None, :], rtol=1e-12, atol=0).all(axis=(0, 2))
        moved = delay[:, s[:, :, None], s[:, None, :]]  # (rows, perms, D, D)
        ok &= np.isclose(moved, delay[:, None], rtol=1e-12, atol=0).all(axis=(0, 2, 3))
        keep[lo : lo + PERMUTATIONS_AT_ONCE] = ok
    for i in np.flatnonzero(keep):
        keep[i] = _memory_preserved(pp, perms[i])
    return keep


def _memory_preserved(pp: PlacementProblem, sigma: np.ndarray) -> bool:
    """Every memory row, permuted, is a memory row with the same limit (itself, usually)."""
    rows = [(r.coef, r.limit) for r in pp.memory]
    return all(
        np.allclose(r.coef[:, sigma], r.coef)
        or any(lim == r.limit and np.allclose(c[:, sigma], r.coef) for c, lim in rows)
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
