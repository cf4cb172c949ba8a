"""The makespan solve the `ilp` and `cpsat` backends share, with its series decomposition.

`solve_placement_problem` runs a backend's DLPlacer model (Pal et al. 2019, Eqs. 7-13) on a
`backends.placement.problem.PlacementProblem` from a warm start (`warm_schedule`: SolveOptions.
warm_start when it is a placement, else the greedy placement). Before that, `series_bound`
splits the task graph into a chain of segments (`series_segments`: dominators of the main
sink), solves small groups of segments exactly with the same backend and combines them by
dynamic programming over the chain's devices into a lower bound on the makespan, and lays the
segment solutions end to end into a second candidate placement.

`PlacementSettings` are the makespan objective's settings of both backends (the fields of
`backends.mathprog.common.IlpSettings` and `CpsatSettings` that this solve and
`backends.mathprog.common.placement_for` read).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import networkx as nx
import numpy as np

from backends.base import BackendSettings, past
from backends.placement.problem import (
    PlacementOutcome,
    PlacementProblem,
    Schedule,
    canonical_placement,
    greedy_placement,
    improve_placement,
    list_schedule,
    placement_lower_bound,
    retime,
)

if TYPE_CHECKING:
    from backends.base import SolveOptions

__all__ = [
    "PlacementSettings",
    "series_bound",
    "series_segments",
    "solve_placement_problem",
    "warm_schedule",
]

SEGMENT_TASKS = 40  # segments up to this many tasks are solved exactly for the bound


@dataclass(frozen=True)
class PlacementSettings(BackendSettings):
    """The makespan objective's settings of `ilp` and `cpsat` (DLPlacer's placement model,
    docs/solvers.md)."""

    phases: Literal["training", "forward"] = "training"
    """the tasks placed: forward, backward and update ("training") or forward only"""
    routing: Literal["fixed", "shortest"] = "fixed"
    """transfers over the device graph's routes (as the simulator) or each tensor's
    fastest path ("shortest": what Eqs. 8-9's routing variables pick without contention)"""
    order: Literal["free", "fifo"] = "free"
    """tasks on a device in any order (DLPlacer) or in program order ("fifo")"""
    series_bound: bool = True
    """the series decomposition's bound and placement before the whole model"""


SettingsT = TypeVar("SettingsT", bound=PlacementSettings)


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
    """Shortest spans of segment groups for pinned end devices, solved once each up to the
    device symmetries (a symmetric pinning has the same span: solved for the smallest
    image of its pins only); with the solution found: device per node and start per task
    (relative to the group's start). Past the deadline nothing more is solved: a group not
    met yet counts with the longest path of its unpinned problem, one per group (`cut`
    counts those lookups), so the DP over the chain ends at once."""

    pp: PlacementProblem
    solve: SegmentSolver
    deadline: float
    solves: int = 0
    cut: int = 0
    found: dict[tuple, tuple[float, dict[int, int], dict[int, float]]] = field(default_factory=dict)
    loose: dict[tuple[Segment, ...], float] = field(default_factory=dict)

    def __call__(self, segs: tuple[Segment, ...], pins: tuple[tuple[int, int], ...]) -> float:
        if past(self.deadline):
            hit = self.found.get((segs, pins))  # no search for a symmetric image any more
            if hit is not None:
                return hit[0]
            self.cut += 1
            if segs not in self.loose:
                sub = segments_problem(self.pp, segs, {})
                self.loose[segs] = placement_lower_bound(sub) if sub is not None else 0.0
            return self.loose[segs]
        key, _ = self._canonical(segs, pins)
        if key not in self.found:
            self.found[key] = self._solve(segs, dict(key[1]))
        return self.found[key][0]

    def solution(
        self, segs: tuple[Segment, ...], pins: tuple[tuple[int, int], ...]
    ) -> tuple[dict[int, int], dict[int, float]]:
        """The device per node and start per task found for these pins ({} when none)."""
        key, sigma = self._canonical(segs, pins)
        _, place, start = self.found.get(key, (0.0, {}, {}))
        inverse = np.argsort(sigma)  # the solution of the image, mapped back
        return {k: int(inverse[d]) for k, d in place.items()}, start

    def _canonical(
        self, segs: tuple[Segment, ...], pins: tuple[tuple[int, int], ...]
    ) -> tuple[tuple, np.ndarray]:
        """(segs, the smallest image of the pins under the symmetries) and the symmetry."""
        perms = self.pp.permutations  # identity first: ties keep the pins as they are
        if len(perms) == 1 or not pins:
            return (segs, pins), perms[0]
        devices = np.array([d for _, d in pins], dtype=np.int64)
        images = perms[:, devices]
        codes = images @ (self.pp.num_devices ** np.arange(len(pins) - 1, -1, -1))
        j = int(np.argmin(codes))
        image = tuple((t, int(d)) for (t, _), d in zip(pins, images[j], strict=True))
        return (segs, image), perms[j]

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
    problem's makespan and its best placement; segment groups above 2 x SEGMENT_TASKS tasks
    count their longest path only, and once the deadline has passed (or a stop was asked)
    every group not solved yet counts the longest path of its unpinned problem, so the DP
    ends within moments (`stats["series_cut"]` says how many spans were cut so). The
    placement takes each chain node's device from the DP and each segment's from its
    solution; -1 for the nodes the segments leave out."""
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
    stats: dict[str, Any] = {
        "segments": len(segments),
        "segment_solves": spans.solves,
        "folded": fold is not None,
    }
    if spans.cut:
        stats["series_cut"] = (
            f"time limit: {spans.cut} segment spans counted with their longest path only"
        )
    place = np.full(pp.num_nodes, -1)
    rel: dict[int, float] = {}  # task -> start relative to its group's sub-problem
    for segs, pins in groups:
        sub_place, sub_start = spans.solution(segs, pins)
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
    settings: SettingsT,
    solve_model: Callable[
        [PlacementProblem, SolveOptions, SettingsT, Schedule | None], PlacementOutcome
    ],
    warm: tuple[Schedule, str] | None = None,
) -> PlacementOutcome:
    """The makespan solve both backends share: a warm start (SolveOptions.warm_start when it
    is a valid placement, else `greedy_placement`); the series bound (`settings.series_bound`,
    default on; segments solved by the same backend, with the series bound off) and the
    placement it builds, improved by local search, as a second candidate; then `solve_model`
    on the whole problem from the better candidate for the time left (each solve by its
    options' deadline). The bound reported is the better of the two."""
    t0 = time.perf_counter()
    clock = options.clock()
    # the phases' caps: shares of the time limit from the start
    heuristic_until = clock.part(HEURISTIC_SHARE).at
    bound_until = clock.part(BOUND_SHARE).at
    improve_until = clock.part(BOUND_SHARE + HEURISTIC_SHARE).at
    order = settings.order
    if warm is None:
        warm = warm_schedule(pp, options, settings, heuristic_until)
    series: float | None = None
    stats: dict[str, Any] = {}
    start_seconds = time.perf_counter() - t0
    if settings.series_bound and pp.num_tasks > 2:
        inner = replace(settings, series_bound=False)

        def segment(sub: PlacementProblem, left: float) -> tuple[float, Schedule | None]:
            cap = clock.within(max(0.05, min(left, SEGMENT_SECONDS))).from_now()
            opts = options.with_deadline(cap)
            start = greedy_placement(sub, order, cap.at)
            out = solve_model(sub, opts, inner, start)
            bound = out.bound if out.bound is not None else placement_lower_bound(sub)
            return bound, out.schedule

        t1 = time.perf_counter()
        series, stats, place, est = series_bound(pp, segment, bound_until)
        stats["series_seconds"] = time.perf_counter() - t1
        if place is not None and warm is not None:  # nodes off the segments: as the warm start
            place = tuple(d if d >= 0 else w for d, w in zip(place, warm[0].placement, strict=True))
        if place is not None and est is not None and min(place) >= 0 and pp.memory_ok(place):
            built = retime(pp, place, est, order)
            built = improve_placement(pp, built, order, improve_until)
            stats["series_placement"] = built.makespan
            if warm is None or built.makespan < warm[0].makespan:
                warm = (built, "series")
    t2 = time.perf_counter()
    out = solve_model(pp, options, settings, warm[0] if warm else None)
    stats = {**out.stats, **stats, "warm_start": warm[1] if warm else None, "series_bound": series}
    stats.update(start_seconds=start_seconds, model_seconds=time.perf_counter() - t2)
    schedule, status = out.schedule, out.status
    if warm is not None and (schedule is None or warm[0].makespan < schedule.makespan):
        # the solver found nothing better: in time (FEASIBLE), or it proved its own answer
        # optimal and the start re-times a hair shorter (its time grid): optimal too
        hair = schedule is not None and warm[0].makespan >= schedule.makespan * (1 - 1e-6)
        schedule, status = warm[0], "OPTIMAL" if out.status == "OPTIMAL" and hair else "FEASIBLE"
    bound = max((b for b in (out.bound, series) if b is not None), default=None)
    if schedule is not None and bound is not None:
        bound = min(bound, schedule.makespan)
        if status == "FEASIBLE" and bound >= schedule.makespan * (1 - 1e-9):
            status = "OPTIMAL"
    return PlacementOutcome(status, schedule, out.model_makespan, bound, out.timed_out, stats)


def warm_schedule(
    pp: PlacementProblem,
    options: SolveOptions,
    settings: PlacementSettings,
    deadline: float = math.inf,
) -> tuple[Schedule, str] | None:
    """SolveOptions.warm_start as a placement (canonical, re-timed) when it is one and fits
    in memory, else the greedy placement (both in `settings.order`); with where it came
    from."""
    order = settings.order
    if options.warm_start is not None:
        place = pp.placement_of(options.warm_start)
        if place is not None and pp.memory_ok(place):
            return list_schedule(pp, canonical_placement(pp, place), order), "warm_start"
    greedy = greedy_placement(pp, order, deadline)
    return (greedy, "heuristic") if greedy is not None else None
