"""The pipeline search: stages, tensor and data degrees, micro-batches, schedule, recomputation
and ZeRO for a transformer on a cluster, ranked by per-block estimates, the best simulated
exactly.

The space (the one Narayanan et al., SC'21, Sec. 3, explore by hand, searched here):

- p stages of g = N / p consecutive devices each (p divides the N devices and is at most
  the blocks), every stage laid out by Megatron-LM's rule at tensor degree t (a power of two
  up to a host's devices, dividing g: tensor parallelism inside a node) and data degree
  d = g / t (`planner.problems.baselines.megatron`);
- b samples per replica per micro-batch (powers of two), so m = B / (d b) micro-batches;
- the schedule: GPipe and 1F1B with one chunk per stage, or interleaved 1F1B with v chunks;
- recomputation ("none" or "full") and the ZeRO stage, from the caller's choices;
- the blocks per stage: equal for interleaved; else the first and last stages (which also
  hold the embeddings and the head) take a few blocks more or fewer than the others, which
  share the rest evenly: the layer-range partition minimising the busiest stage's work per
  micro-batch, within the devices' memory (a dynamic program over layer ranges reduces to
  this on a model of equal blocks).

Each (p, t, b, recomputation, ZeRO) costs three small simulations (`units.unit_costs`); a
candidate is then scored in closed form: `estimate` = fill and drain through every stage
plus (m - 1) x the busiest stage (m x it plus its share of the bubble, interleaved), and
its memory per stage = fixed bytes + kept bytes x the micro-batches in flight of its
schedule. Candidates that fit are simulated exactly (`planner.pipeline.stages.
simulate_pipelined`: every distinct chunk with FlexFlow's simulator, the schedule's
timeline) in order of estimate until the next one's `floor` (m x the busiest stage's work:
no schedule beats it) is above the best exact step, the deadline passes, or `exact` have
been. `bound` is `units.compute_bound`: no layout of any kind steps faster.

The steps, in `_search`: `_searched_layouts` (the per-op search's stage layouts),
`_stage_layouts` (enumerate the space), `_holding` (those whose devices hold the parameters,
in costing order), `_cost` (units and estimates), `_simulate_exactly` (rank by two replicas'
simulation) and `_on_every_device` (the best few again on every device).

`PipelineSearch` is the search under the result contract (`planner.result.PipelineResult`,
reached through `planner.registry.get_pipeline_solver`): a `PipelineProblem`, its settings
in `SolveOptions.extra` (`PipelineSettings`), its time from `options.clock()`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

from backends.pipeline.inner import SearchedLayout, searched_layout
from backends.pipeline.settings import PipelineSettings
from backends.pipeline.units import (
    Units,
    compute_bound,
    parameter_state,
    ring_factor,
    unit_costs,
    zero_factor,
)
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.memory import usable_memory
from planner.deadline import Deadline, OutOfTime, catch_interrupt, run_within, stop_requested
from planner.errors import BackendError, given
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.pipeline.layouts import block_ranges
from planner.pipeline.problem import Layout, PipelineProblem
from planner.pipeline.schedule import in_flight, schedule
from planner.pipeline.spec import (
    Pipeline,
    PipelinedStrategy,
    batch_graph,
    micro_batch_graph,
)
from planner.pipeline.stages import chunk_times, simulate_pipelined
from planner.pipeline.timeline import PipelineTimeline, simulate_pipeline
from planner.problems.baselines import megatron
from planner.problems.strategy import Strategy
from planner.result import Limit, PipelineResult, SolveOptions, Status

__all__ = ["Layout", "PipelineSearch", "PipelineSettings"]

log = logging.getLogger("backends.pipeline")
T = TypeVar("T")

FULL_SIMULATION_TASKS = 200_000  # the answer is simulated on every device up to this
INNER_SHARE = 0.1  # of the time, at most, for the per-op searches of the stages' layouts
COSTING_SHARE = 0.45
FULL_SIMULATIONS = 3  # the best layouts by two replicas' simulation simulated on every device
# seconds of a full simulation per second of two replicas', per replica pair (measured 0.18-0.38)
FULL_SIMULATION_COST = (
    0.4  # of the time left, for costing stage layouts; the rest simulates exactly
)
MAX_MICRO_BATCH = 16  # samples per replica per micro-batch: more only adds to the bubble

StageLayout = tuple[int, int, int, str, int, str]  # (p, t, b, recompute, ZeRO, inner rule)


class PipelineSearch:
    """The pipeline search under the result contract: `solve(PipelineProblem, SolveOptions)`
    with its settings in `options.extra` (`PipelineSettings`), its time from
    `options.clock()`; a Ctrl-C (`planner.deadline.request_stop`) ends it with the best
    layout so far, limit INTERRUPTED. Its objective is always the simulated step
    (`options.objective` is not read); deterministic: the seed is not used."""

    name: ClassVar[str] = "pipeline"
    settings_type: ClassVar[type[PipelineSettings]] = PipelineSettings

    def settings(self, options: SolveOptions) -> PipelineSettings:
        """`options.extra` as the search's settings: one BackendError line for a bad one."""
        return self.settings_type.of(options.extra, f"the {self.name} search")

    def solve(
        self, problem: PipelineProblem, options: SolveOptions | None = None
    ) -> PipelineResult:
        """The fastest layout found for `problem` within its devices' usable memory: status
        FEASIBLE with the layout; INFEASIBLE when nothing in the space fits (`message` says
        why, in one line); limit TIME when the deadline cut the search, INTERRUPTED at a
        Ctrl-C."""
        options = options or SolveOptions()
        settings = self.settings(options)
        if not isinstance(problem, PipelineProblem):
            raise BackendError(
                f"the {self.name} search solves a PipelineProblem (planner.pipeline.problem), "
                f"got {given(problem)}"
            )
        with catch_interrupt():
            result = _search(problem, settings, options.clock(), log.info, options.gap_tolerance)
            proven = result.status is Status.INFEASIBLE and result.limit is None
            if stop_requested() and not proven:
                result = dataclasses.replace(result, limit=Limit.INTERRUPTED)
            return result


@dataclass(frozen=True)
class _Candidate:
    estimate: float
    floor: float
    layout: Layout
    peak: float


@dataclass(frozen=True)
class _Simulated:
    """A candidate simulated exactly: its step, the seconds that took, and what it was."""

    step: float
    seconds: float
    candidate: _Candidate
    planned: PipelinedStrategy
    timeline: PipelineTimeline
    options: CostOptions
    on_every_device: bool


@dataclass
class _Space:
    """What every step of one search reads: the problem, its settings and usable memory,
    and the caches the steps share (device groups, micro-batch graphs, schedules' in-flight
    counts, the per-op search's stage layouts by tensor degree)."""

    problem: PipelineProblem
    settings: PipelineSettings
    usable: float
    state: float  # bytes of the parameters' training state, unsharded
    tolerance: float = 0.0  # the relative gap at which the exact simulations stop
    groups: dict[Any, DeviceGraph] = field(default_factory=dict)
    micro: dict[int, OpGraph] = field(default_factory=dict)
    flights: dict[tuple[str, int, int, int], tuple[int, ...]] = field(default_factory=dict)
    searched: dict[int, SearchedLayout] = field(default_factory=dict)

    def cost_options(self, recompute: str, zero: int) -> CostOptions:
        return dataclasses.replace(self.problem.options, recompute=recompute, zero=zero)  # type: ignore[arg-type]


@dataclass
class _Costed:
    """What the costing found: the candidates that fit, by estimate, and how it went."""

    found: list[_Candidate]
    costed: int  # stage layouts whose units were simulated
    least: float  # the least memory per device seen
    stopped: bool


def _search(
    problem: PipelineProblem,
    settings: PipelineSettings,
    deadline: Deadline,
    say: Callable[[str], None],
    tolerance: float = 0.0,
) -> PipelineResult:
    """The search's steps: the per-op search's stage layouts (if asked), the stage layouts
    that can hold the parameters, their units costed and candidates estimated, the best
    simulated exactly (within the relative gap `tolerance`), the best few again on every
    device."""
    t0 = time.perf_counter()
    graph, devices, options = problem.graph, problem.devices, problem.options
    usable = float(usable_memory(devices, options.headroom).min())
    space = _Space(problem, settings, usable, parameter_state(graph, options), tolerance)
    bound = compute_bound(graph, devices, options)  # first: not on a Ctrl-C's way out
    if "search" in settings.inner:
        space.searched = _searched_layouts(problem, deadline.share(INNER_SHARE))
    keys = _stage_layouts(space)
    fitting = _holding(space, keys)
    costed = _cost(space, fitting, deadline.share(COSTING_SHARE))
    stats: dict[str, Any] = {
        "layouts_fit": len(costed.found),
        "stage_layouts_costed": costed.costed,
        "stage_layouts": len(fitting),
    }
    if not costed.found:
        least = min(_held(space, k) for k in keys) if keys and not fitting else costed.least
        message = _nothing_fits(problem, least, usable)
        return _no_answer(Status.INFEASIBLE, None, message, bound, stats, costed.stopped, t0)
    found = sorted(costed.found, key=lambda c: (c.estimate, c.layout))
    say(
        f"pipeline search: {len(found)} layouts fit ({costed.costed} of {len(fitting)} stage "
        f"layouts costed{', stopped by the time limit' if costed.stopped else ''}); best "
        f"estimate {found[0].estimate:.3f} s ({found[0].layout.describe()})"
    )
    ranked, simulated, stopped = _simulate_exactly(space, found, deadline)
    stopped = stopped or costed.stopped
    stats["simulated_exactly"] = simulated
    if not ranked:  # every one simulated did not fit: all of them, or `exact` of them
        every = simulated == len(found)
        status, limit = (
            (Status.INFEASIBLE, None) if every else (Status.NO_SOLUTION, Limit.ITERATIONS)
        )
        message = (
            f"the pipeline layouts of {graph.name!r} estimated to fit the devices of "
            f"{devices.name} do not fit when simulated exactly: plan with recomputation or "
            f"ZeRO among the choices, more devices or a smaller batch"
        )
        return _no_answer(status, limit, message, bound, stats, stopped, t0)
    best = _on_every_device(space, ranked, deadline)
    on = "every device" if best.on_every_device else "two replicas per stage"
    stats["answer_simulated_on"] = on
    stats["stopped_by_time_limit"] = stopped
    stats["seconds"] = time.perf_counter() - t0
    return PipelineResult(
        PipelineSearch.name,
        Status.FEASIBLE,
        objective=best.step,
        bound=bound,
        limit=Limit.TIME if stopped else None,
        strategy=best.planned.strategy,
        stats=stats,
        planned=best.planned,
        layout=best.candidate.layout,
        cost_options=best.options,
        timeline=best.timeline,
        estimate=best.candidate.estimate,
    )


def _nothing_fits(problem: PipelineProblem, least: float, usable: float) -> str:
    graph, devices = problem.graph, problem.devices
    return (
        f"no pipeline layout of {graph.name!r} fits the {devices.num_devices} devices of "
        f"{devices.name}: the least memory per device seen is {least / 2**30:.1f} GiB of "
        f"{usable / 2**30:.1f} GiB usable (more devices, a smaller batch, or recomputation "
        f"and ZeRO among the choices)"
    )


def _no_answer(
    status: Status,
    limit: Limit | None,
    message: str,
    bound: float,
    stats: dict[str, Any],
    stopped: bool,
    t0: float,
) -> PipelineResult:
    seconds = time.perf_counter() - t0
    return PipelineResult(
        PipelineSearch.name,
        status,
        bound=bound,
        limit=limit,
        stats={**stats, "stopped_by_time_limit": stopped, "seconds": seconds},
        message=message,
    )


def _searched_layouts(problem: PipelineProblem, looking: Deadline) -> dict[int, SearchedLayout]:
    """The per-op search on a few blocks of one tensor group, per tensor degree t, within
    `looking` (`inner.searched_layout`); a Ctrl-C ends it with those found so far."""
    graph, devices, options = problem.graph, problem.devices, problem.options
    n = devices.num_devices
    searched: dict[int, SearchedLayout] = {}
    for t in _powers(min(_host_size(devices), n)):
        try:
            found = _interruptible(
                partial(searched_layout, graph, devices, t, options, looking), needed=False
            )
        except OutOfTime:
            break
        if found is not None:
            searched[t] = found
    return searched


def _stage_layouts(space: _Space) -> list[StageLayout]:
    """Every (p, t, b, recomputation, ZeRO, inner rule) of the space: p stages dividing the
    devices (at most the blocks), t a power of two up to a host dividing a stage's devices,
    b samples per replica per micro-batch whose micro-batches divide the batch."""
    settings, problem = space.settings, space.problem
    n = problem.devices.num_devices
    node = _host_size(problem.devices)
    batch = problem.samples
    choices = [p for p in (settings.stages or _divisors(n)) if n % p == 0 and p <= problem.blocks]
    rules = [r for r in ("rule", "search") if r in settings.inner]
    return [
        (p, t, b, rc, z, rule)
        for p in choices
        for t in _powers(min(node, n // p))
        if (n // p) % t == 0
        for b in _powers(min(batch, MAX_MICRO_BATCH))
        if batch % ((n // p // t) * b) == 0
        for rc in settings.recompute
        for z in settings.zero
        if not (z and n // p // t == 1)  # ZeRO shards over replicas: none to shard over
        for rule in rules
        if rule == "rule" or t in space.searched
    ]


def _holding(space: _Space, keys: list[StageLayout]) -> list[StageLayout]:
    """The stage layouts whose devices can hold their share of the parameter state (p x t
    ways, x d with ZeRO), in the order they are costed: the least model parallelism that
    holds the parameters first (the fewest stages, the least bubble), then the smallest
    micro-batches (more of them: less bubble), then keeping activations before recomputing
    them."""
    recompute = space.settings.recompute
    fitting = [k for k in keys if _held(space, k) <= space.usable]
    fitting.sort(key=lambda k: (k[0] * k[1], k[0], k[2], recompute.index(k[3]), k[4], k[5]))
    return fitting


def _cost(space: _Space, fitting: list[StageLayout], costing: Deadline) -> _Costed:
    """Each stage layout's units (`units.unit_costs`) and the candidates they give (every
    schedule, interleaving and blocks per stage), those within memory kept; until `costing`
    passes or a Ctrl-C once some fit (a needed costing finishes)."""
    problem = space.problem
    graph, devices = problem.graph, problem.devices
    n, batch = devices.num_devices, problem.samples
    out = _Costed([], 0, math.inf, False)
    for p, t, b, rc, z, rule in fitting:
        if (costing.expired() or stop_requested()) and out.found:
            out.stopped = True
            break
        g = n // p
        d = g // t
        m = batch // (d * b)
        opts = space.cost_options(rc, z)
        here = d if z >= 3 else min(d, 2)  # replicas simulated (`unit_costs`)
        mu = -here * b  # keyed by minus the samples: a graph of here x b samples
        key = ("units", g, t * here)
        if key not in space.groups:
            ends = (*range(t * here - t), *range(g - t, g))  # first and last replicas
            space.groups[key] = devices.subset(ends, f"{devices.name}[{t * here} of {g}]")
        try:
            if mu not in space.micro:
                space.micro[mu] = batch_graph(graph, here * b)
            lay_out = space.searched[t].strategy if rule == "search" else megatron
            u = _interruptible(
                partial(
                    unit_costs,
                    space.micro[mu],
                    devices,
                    space.groups[key],
                    t,
                    opts,
                    g if p > 1 else 0,
                    d,
                    lay_out,
                ),
                needed=not out.found,
            )
        except OutOfTime:  # a Ctrl-C: what is costed so far is ranked
            out.stopped = True
            break
        except Exception as exc:  # noqa: BLE001 - a layout the rule cannot express: skip it
            log.debug("skipped PP %d TP %d b %d: %s", p, t, b, exc)
            continue
        out.costed += 1
        candidates = _candidates(
            u, p, t, d, b, m, rc, z, rule, problem.blocks, space.settings.schedules, space.flights
        )
        for cand in candidates:
            out.least = min(out.least, cand.peak)
            if cand.peak <= space.usable:
                out.found.append(cand)
    return out


def _simulate_exactly(
    space: _Space, found: list[_Candidate], deadline: Deadline
) -> tuple[list[_Simulated], int, bool]:
    """The candidates, best estimate first, simulated exactly (`_simulate`) until the next
    one's floor is above the best step (less the gap tolerance: it cannot beat the best by
    more), `exact` have been, or the deadline passes once one fits: those within memory by
    step, how many were simulated, whether time stopped it."""
    problem = space.problem
    ranked: list[_Simulated] = []
    simulated = 0
    shrink = 1.0 / (1.0 + space.tolerance)
    for cand in found:
        if simulated >= space.settings.exact or (ranked and cand.floor >= ranked[0].step * shrink):
            break
        if ranked and (deadline.expired() or stop_requested()):
            return ranked, simulated, True
        lay = cand.layout
        opts = space.cost_options(lay.recompute, lay.zero)
        t1 = time.perf_counter()
        try:
            planned, timeline = _interruptible(
                partial(
                    _simulate,
                    problem.graph,
                    problem.devices,
                    lay,
                    opts,
                    space.micro,
                    space.groups,
                    space.searched,
                ),
                needed=not ranked,
            )
        except OutOfTime:
            return ranked, simulated, True
        simulated += 1
        if max(timeline.peak_bytes) <= space.usable:
            seconds = time.perf_counter() - t1
            whole = lay.data <= 2 or lay.zero >= 3  # every device simulated already
            ranked.append(
                _Simulated(timeline.makespan, seconds, cand, planned, timeline, opts, whole)
            )
            ranked.sort(key=lambda r: r.step)
    return ranked, simulated, False


def _on_every_device(space: _Space, ranked: list[_Simulated], deadline: Deadline) -> _Simulated:
    """The best few of `ranked` again on every device (contention two replicas do not see),
    in order, as time allows, and the best of those. The first that cannot be (too many
    tasks, too little time) ends the comparison, like with like: it ranks above the rest by
    two replicas, so it is the answer if none before it was simulated on every device. The
    best by two replicas when none was."""
    problem = space.problem
    full: list[_Simulated] = []
    for best in ranked[:FULL_SIMULATIONS]:
        lay = best.candidate.layout
        if best.on_every_device:
            full.append(best)
            continue
        expected = best.seconds * lay.data / 2 * FULL_SIMULATION_COST
        if _tasks(problem.graph, lay) > FULL_SIMULATION_TASKS or expected > deadline.left():
            if not full:
                full.append(best)
            break
        cm = CostModel(best.planned.strategy.graph, problem.devices, best.options)
        try:
            again = _interruptible(partial(simulate_pipelined, cm, best.planned), needed=False)
        except OutOfTime:
            break
        if max(again.peak_bytes) <= space.usable:
            full.append(
                dataclasses.replace(best, step=again.makespan, timeline=again, on_every_device=True)
            )
    return min(full, key=lambda r: r.step) if full else ranked[0]


def _interruptible(step: Callable[[], T], needed: bool) -> T:
    """`step()`, abandoned at a Ctrl-C (OutOfTime at once; the step ends in the background)
    unless it is `needed` (the search has no answer without it: it finishes, as at the
    time limit). One costing or simulation of a 1,024-device layout takes seconds, and a
    stop request should end the search within a fraction of one."""
    if needed:
        return step()
    if stop_requested():
        raise OutOfTime
    return run_within(step, Deadline.never())


def _simulate(
    graph: OpGraph,
    devices: DeviceGraph,
    lay: Layout,
    options: CostOptions,
    micro: dict[int, OpGraph],
    groups: dict[Any, DeviceGraph],
    searched: dict[int, SearchedLayout] | None = None,
) -> tuple[PipelinedStrategy, PipelineTimeline]:
    """The layout's pipelined strategy, and its step: every distinct chunk simulated with
    FlexFlow's simulator on two of its stage's data-parallel replicas (all compute and
    exchange alike within their tensor-parallel groups), their gradient sync scaled to the
    stage's replicas (`units.ring_factor`) and ZeRO's parameter bytes to its sharding; with
    one or two replicas, or ZeRO 3, every device simulated."""
    n, p, t, d = devices.num_devices, lay.stages, lay.tensor, lay.data
    g = n // p

    def strategy(m: int, devs: DeviceGraph, size: int, data: int) -> PipelinedStrategy:
        if m not in micro:
            micro[m] = micro_batch_graph(graph, m)
        if size not in groups:  # all of them: the devices themselves (no routes to derive)
            whole = size == devices.num_devices
            groups[size] = (
                devices if whole else devices.subset(range(size), f"{devices.name}[{size}]")
            )
        if lay.inner == "search" and searched and t in searched:
            inner = searched[t].strategy(micro[m], groups[size], t)
        else:
            inner = megatron(micro[m], groups[size], t)
        return _pipelined(micro[m], devs, inner, dataclasses.replace(lay, data=data))

    planned = strategy(lay.micro_batches, devices, g, d)
    here = d if lay.zero >= 3 else min(d, 2)
    if here == d:
        return planned, simulate_pipelined(
            CostModel(planned.strategy.graph, devices, options), planned
        )
    # the first and the last replica: across the same links as the stage's sync crosses
    keep = [s * g + k for s in range(p) for k in (*range(t), *range(g - t, g))]
    reduced = devices.subset(keep, f"{devices.name}[{p} x {t * here}]")
    small_samples = here * lay.micro_batch
    if -small_samples not in micro:
        micro[-small_samples] = batch_graph(graph, small_samples)
    small = strategy(-small_samples, reduced, t * here, here)
    chunks = chunk_times(CostModel(small.strategy.graph, reduced, options), small)
    sync = ring_factor(d) / ring_factor(here)
    zero = zero_factor(graph, options, d) / zero_factor(graph, options, here)
    scaled = [
        dataclasses.replace(c, sync=c.sync * sync, fixed_bytes=c.fixed_bytes * zero) for c in chunks
    ]
    return planned, simulate_pipeline(scaled, lay.schedule, p, lay.micro_batches)


def _candidates(
    u: Units,
    p: int,
    t: int,
    d: int,
    b: int,
    m: int,
    rc: str,
    z: int,
    rule: str,
    blocks: int,
    schedules: Sequence[str],
    flights: dict[tuple[str, int, int, int], tuple[int, ...]],
) -> list[_Candidate]:
    out = []
    for name in schedules:
        for v in _virtuals(name, p, m, blocks):
            for split in _splits(blocks, p, v, name):
                chunks = [u.chunk(c, p * v, k) for c, k in enumerate(split)]
                work = [0.0] * p
                fixed = [0.0] * p
                kept = [0.0] * p
                for c, ch in enumerate(chunks):
                    work[c % p] += ch.forward + ch.backward
                    fixed[c % p] += ch.fixed_bytes
                    kept[c % p] = max(kept[c % p], ch.activation_bytes)
                key = (name, p, m, v)
                if key not in flights:
                    flights[key] = tuple(in_flight(o) for o in schedule(name, p, m, v))
                peak = max(f + k * a for f, k, a in zip(fixed, kept, flights[key], strict=True))
                busiest = max(work)
                tail = max(ch.sync for ch in chunks)
                messages = 2 * (p * v - 1) * u.message
                if v == 1:
                    estimate = (m - 1) * busiest + sum(work) + messages + tail
                else:
                    estimate = m * busiest + (p - 1) * busiest / v + messages + tail
                layout = Layout(p, t, d, b, m, name, v, rc, z, tuple(split), rule)
                out.append(_Candidate(estimate, m * busiest, layout, peak))
    return out


def _virtuals(name: str, p: int, m: int, blocks: int) -> list[int]:
    if name != "interleaved":
        return [1] if name == "1f1b" or p > 1 else []
    if p == 1 or m % p:
        return []
    return [v for v in range(2, blocks // p + 1) if blocks % (p * v) == 0]


def _splits(blocks: int, p: int, v: int, name: str) -> list[list[int]]:
    """Blocks per chunk: equal when interleaved; else the first and last stages within 3
    blocks of an equal share, the middle ones sharing the rest evenly."""
    if v > 1:
        return [[blocks // (p * v)] * (p * v)]
    if p == 1:
        return [[blocks]]
    share = blocks // p
    out = []
    for first in range(max(1, share - 3), share + 4):
        for last in range(max(1, share - 3), share + 4):
            rest = blocks - first - last
            if p == 2:
                if rest == 0:
                    out.append([first, last])
                continue
            if rest < p - 2:
                continue
            q, r = divmod(rest, p - 2)
            middle = [q + (1 if k < r else 0) for k in range(p - 2)]
            if min(middle) >= 1:
                out.append([first, *middle, last])
    return out


def _pipelined(
    graph: OpGraph, devices: DeviceGraph, inner: Strategy, lay: Layout
) -> PipelinedStrategy:
    """The layout's pipelined strategy: `inner` (the micro-batch graph on the first group's
    devices) moved to each chunk's group; bounds at the blocks' first ops."""
    p = lay.stages
    g = devices.num_devices // p
    ranges = block_ranges(graph)
    bounds = [0]
    at = 0
    for k in lay.blocks[:-1]:
        at += k
        bounds.append(ranges[at][0])
    bounds.append(len(graph.ops))
    groups = tuple(tuple(range(s * g, (s + 1) * g)) for s in range(p))
    pipe = Pipeline(tuple(bounds), groups, lay.micro_batches, lay.schedule)
    configs = []
    for i, cfg in enumerate(inner.configs):
        base = (pipe.chunk_of(i) % p) * g
        configs.append(
            ParallelConfig(cfg.degrees, tuple(base + x for x in cfg.devices), cfg.reduce)
        )
    return PipelinedStrategy(Strategy(graph, devices, tuple(configs)), pipe)


def _tasks(graph: OpGraph, lay: Layout) -> int:
    """About the tasks a full simulation of the layout's distinct chunks has: ops of the
    first, a middle and the last chunk, each on every device of its stage."""
    per_chunk = len(graph.ops) / (lay.stages * lay.virtual)
    return int(min(3, lay.stages * lay.virtual) * per_chunk * lay.tensor * lay.data)


def _held(space: _Space, key: StageLayout) -> float:
    """A lower bound of a device's parameter bytes: the state split p x t ways (x d: ZeRO)."""
    p, t, _, _, z, _ = key
    n = space.problem.devices.num_devices
    return space.state / (p * t) / (n // (p * t) if z else 1)


def _host_size(devices: DeviceGraph) -> int:
    first = devices.devices[0].host
    return sum(1 for d in devices.devices if d.host == first)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out
