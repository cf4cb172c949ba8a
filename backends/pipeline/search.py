"""The pipeline search: stages, tensor and data degrees, micro-batches, schedule, recomputation
and ZeRO for a transformer on a cluster, ranked by closed-form estimates, the best simulated.

The space (the one Narayanan et al., SC'21, Sec. 3, explore by hand, searched here):

- p stages of g = N / p consecutive devices each (p divides the N devices and is at most
  the blocks), every stage laid out by Megatron-LM's rule at tensor degree t (a power of two
  up to a host's devices, dividing g: tensor parallelism inside a node) and data degree
  d = g / t (`planner.problems.baselines.megatron`), or by the per-op search (`inner`);
- a context degree c and, for a model with mixtures of experts, an expert degree e (the
  divisors of the experts and of g not dominated at the moe op: `_expert_front`), laid out
  by Megatron-LM's rule (`megatron(graph, group, t, c, e)`), d = g / (t c); a stage is
  simulated on whole expert-parallel groups and its sync and ZeRO scaled per parameter
  class (`_replicas_simulated`, `units.scale_factors`);
- b samples per replica per micro-batch (powers of two), so m = B / (d b) micro-batches;
- the schedule: GPipe and 1F1B with one chunk per stage, or interleaved 1F1B with v chunks;
- recomputation ("none" or "full") and the ZeRO stage, from the caller's choices;
- the blocks per chunk: the first and last chunks (which also hold the embeddings and the
  head) around the counts that balance the chunks' work, the others sharing the rest evenly,
  and equal chunks when interleaved and they divide the blocks
  (`backends.pipeline.candidates.splits`).

How it is searched, in `_search`: `_searched_layouts` (the per-op search's stage layouts),
`_stage_layouts` (every (p, t, b, recomputation, ZeRO, rule)), `_holding` (those whose
devices hold the parameters), `_rank` (each estimated in closed form, no simulation:
`backends.pipeline.estimate`), then `_Selection`, best first on one queue
(`backends.pipeline.select`): the lowest value is measured one level further (a stage
layout's closed-form estimate -> its units costed with three small simulations,
`units.unit_costs`, and its candidates estimated, `backends.pipeline.candidates` -> a
candidate simulated exactly on two replicas per stage, `_simulate` -> on every device,
`planner.pipeline.stages.simulate_pipelined`) until the lowest is measured as far as it can
be: the answer. No layout estimated below the answer's step is left unmeasured
(docs/pipeline.md, "What is simulated and returned"). `bound` is `units.compute_bound`: no
layout of any kind steps faster.

Under a time limit (docs/pipeline.md, "Time limit"): the cheapest stage layout to cost is
costed first (`_baseline`), for an answer early; what no answer exists without runs until
the limit plus a grace (`FIRST_ANSWER_SHARE`: `Deadline.extended`), shielded from a first
Ctrl-C; every costing and simulation looks at its clock; a first simulation runs only when
its expected seconds fit (`_Selection.expected`), and in the last `SIMULATION_RESERVE` of the
time the best costed candidate is simulated before more costing; cut short with nothing
simulated, the answer is the best costed candidate at its estimate (`_by_estimate`); with
nothing costed, NO_SOLUTION, limit TIME, and a line that says to raise the limit.

`PipelineSearch` is the search under the result contract (`planner.result.PipelineResult`,
reached through `planner.registry.get_pipeline_solver`): a `PipelineProblem`, its settings
in `SolveOptions.extra` (`PipelineSettings`), its time from `options.clock()`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

import numpy as np

from backends.pipeline.candidates import Candidate, candidates
from backends.pipeline.estimate import QuickUnits
from backends.pipeline.inner import SearchedLayout, searched_layout
from backends.pipeline.select import ESTIMATE, EVERY_DEVICE, STAGE, TWO_REPLICAS, BestFirst, Tally
from backends.pipeline.settings import PipelineSettings
from backends.pipeline.units import (
    Units,
    compute_bound,
    parameter_state,
    routed_state,
    scale_factors,
    unit_costs,
    unit_ranges,
)
from planner.costs.config import divisors
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.memory import usable_memory
from planner.deadline import (
    Deadline,
    OutOfTime,
    catch_interrupt,
    run_within,
    shielded,
    stop_requested,
)
from planner.errors import BackendError, LayerwiseError, given
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import LENGTH
from planner.hardware.devices import DeviceGraph
from planner.pipeline.layouts import block_bounds
from planner.pipeline.problem import Layout, PipelineProblem
from planner.pipeline.spec import (
    Pipeline,
    PipelinedStrategy,
    batch_graph,
    micro_batch_graph,
)
from planner.pipeline.stages import ChunkCache, chunk_times, simulate_chunk, simulate_pipelined
from planner.pipeline.timeline import PipelineTimeline, simulate_pipeline
from planner.problems.baselines import megatron
from planner.problems.strategy import Strategy
from planner.result import Limit, PipelineResult, SolveOptions, Status

__all__ = ["Layout", "PipelineSearch", "PipelineSettings"]

log = logging.getLogger("backends.pipeline")
T = TypeVar("T")

FULL_SIMULATION_TASKS = 200_000  # the answer is simulated on every device up to this
INNER_SHARE = 0.1  # of the time, at most, for the per-op searches of the stages' layouts
RANKING_SHARE = 0.3  # of the time left, at most, for every stage layout's closed-form estimate
BASELINE_SHARE = 0.1  # of the time left, at most, to find the stage layout costed first
# of the time left after the first ranking, the last share in which, with nothing simulated
# yet, the best candidate costed is simulated before any more costing (if expected to fit)
SIMULATION_RESERVE = 0.25
# seconds of a full simulation per second of two replicas', per replica pair (measured 0.18-0.38)
FULL_SIMULATION_COST = 0.4
MAX_MICRO_BATCH = 16  # samples per replica per micro-batch: more only adds to the bubble
# What no answer exists without (stage layouts estimated until one fits, one costed) may run
# this share of the time limit past it, at least FIRST_ANSWER_LEAST and at most
# FIRST_ANSWER_MOST seconds (counted from the search's start when capture used the limit up);
# with nothing costed by then, the search has no answer (docs/pipeline.md, "Time limit").
FIRST_ANSWER_SHARE = 0.1
FIRST_ANSWER_LEAST = 2.0
FIRST_ANSWER_MOST = 30.0
# The chunks the exact simulations of two replicas per stage (`_simulate`) simulated lately:
# layouts simulated one after another share most of them (planner.pipeline.stages).
_CHUNKS = ChunkCache()
ON = {
    ESTIMATE: "no device (estimated from its stage layout's costed units: not simulated in time)",
    TWO_REPLICAS: "two replicas per stage",
    EVERY_DEVICE: "every device",
}

# (p, t, b, recompute, ZeRO, inner rule, c, e): c the context-parallel degree, e the expert's
StageLayout = tuple[int, int, int, str, int, str, int, int]


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
class _Simulated:
    """A candidate simulated exactly: its step, the seconds that took, and what it was."""

    step: float
    seconds: float
    candidate: Candidate
    planned: PipelinedStrategy
    timeline: PipelineTimeline
    options: CostOptions
    on_every_device: bool
    estimated: bool = False  # not simulated: its chunks from its stage layout's costed units

    @property
    def level(self) -> int:
        if self.estimated:
            return ESTIMATE
        return EVERY_DEVICE if self.on_every_device else TWO_REPLICAS

    @property
    def layout(self) -> Layout:
        return self.candidate.layout


@dataclass
class _Space:
    """What every step of one search reads: the problem, its settings and usable memory,
    and the caches the steps share (device groups, micro-batch graphs, schedules' in-flight
    counts, the per-op search's stage layouts by tensor degree)."""

    problem: PipelineProblem
    settings: PipelineSettings
    usable: float
    state: float  # bytes of the parameters' training state, unsharded
    routed: float = 0.0  # of which the routed experts' (cut e ways by expert parallelism)
    tolerance: float = 0.0  # the relative gap at which the exact simulations stop
    groups: dict[Any, DeviceGraph] = field(default_factory=dict)
    micro: dict[int, OpGraph] = field(default_factory=dict)
    flights: dict[tuple[str, int, int, int], tuple[int, ...]] = field(default_factory=dict)
    searched: dict[int, SearchedLayout] = field(default_factory=dict)
    layouts: dict[tuple[int, int, int, int, int, str], Strategy] = field(default_factory=dict)
    quick: QuickUnits = field(default_factory=QuickUnits)
    fronts: dict[Any, list[int]] = field(default_factory=dict)  # `_expert_front`'s
    # seconds of the first moe op per (g, t, c, b, ZeRO, e) (`_expert_front`), and per stage
    # layout but its expert degree the fastest such seconds of a degree all of whose
    # candidates fit (`_rank`: a slower degree cannot do better there)
    moe_seconds: dict[tuple[int, ...], float] = field(default_factory=dict)
    settled: dict[tuple[Any, ...], float] = field(default_factory=dict)
    experts: dict[int, list[int]] = field(default_factory=dict)  # `expert_degrees`'

    def expert_degrees(self, p: int) -> list[int]:
        """The expert degrees of a stage of p stages' devices (`_expert_degrees`)."""
        if p not in self.experts:
            g = self.problem.devices.num_devices // p
            self.experts[p] = _expert_degrees(self.problem.graph, g, self.settings.expert)
        return self.experts[p]

    def needless(self, key: StageLayout) -> bool:
        """Whether the stage layout `key` is slower at its mixture of experts than another
        expert degree of the same layout all of whose candidates fit (`_rank`)."""
        seconds = self.moe_seconds.get(self._moe_key(key))
        settled = self.settled.get(key[:7])
        return seconds is not None and settled is not None and seconds >= settled

    def settle(self, key: StageLayout) -> None:
        """Every candidate of `key` fits: its slower expert degrees are needless."""
        seconds = self.moe_seconds.get(self._moe_key(key))
        if seconds is not None:
            self.settled[key[:7]] = min(seconds, self.settled.get(key[:7], math.inf))

    def _moe_key(self, key: StageLayout) -> tuple[int, ...]:
        p, t, b, _, z, rule, c, e = key
        g = self.problem.devices.num_devices // p
        return (g, t, c, b, z, e) if rule == "rule" else (-1,)

    def cost_options(self, recompute: str, zero: int) -> CostOptions:
        return dataclasses.replace(self.problem.options, recompute=recompute, zero=zero)  # type: ignore[arg-type]

    def stage_rule(
        self, rule: str, t: int, c: int = 1, e: int = 1
    ) -> Callable[[OpGraph, DeviceGraph, int], Strategy]:
        """How a stage is laid out at tensor degree t, context degree c and expert degree e
        (Megatron-LM's rule, or the per-op search's layout: c = 1, e its own), each graph on each
        group size laid out once (a 1,000-op graph takes tens of milliseconds, and the
        closed form and the costing both ask). The callable's third argument is a replica's
        width, t x c."""
        lay_out = self.searched[t].strategy if rule == "search" else megatron

        def laid_out(graph: OpGraph, group: DeviceGraph, width: int) -> Strategy:
            key = (id(graph), group.num_devices, t, c, e, rule)  # graphs stay in `micro`
            if key not in self.layouts:
                self.layouts[key] = (
                    lay_out(graph, group, t)
                    if rule == "search" or (c == 1 and e == 1)
                    else megatron(graph, group, t, c, e)
                )
            return self.layouts[key]

        return laid_out

    def unit_group(self, g: int, t: int, here: int, span: int = 1) -> DeviceGraph:
        """The devices a stage of g is costed on: its first and last `span` of `here`
        replicas of t (`_unit_ends`)."""
        key = ("units", g, t * here, span)
        if key not in self.groups:
            devices = self.problem.devices
            ends = _unit_ends(g, t, here, span)
            self.groups[key] = devices.subset(ends, f"{devices.name}[{t * here} of {g}]")
        return self.groups[key]

    def first_devices(self, size: int) -> DeviceGraph:
        """The first `size` devices: what a stage rule lays a group of that size out on."""
        if size not in self.groups:  # as `_simulate` makes them: the same cache
            devices = self.problem.devices
            whole = size == devices.num_devices
            self.groups[size] = (
                devices if whole else devices.subset(range(size), f"{devices.name}[{size}]")
            )
        return self.groups[size]

    def samples_graph(self, samples: int) -> OpGraph:
        """The problem's graph at a batch of `samples` (`micro` keyed by minus them)."""
        if -samples not in self.micro:
            self.micro[-samples] = batch_graph(self.problem.graph, samples)
        return self.micro[-samples]


@dataclass
class _Costed:
    """What the costing found: the candidates that fit, by estimate, and how it went."""

    found: list[Candidate]
    costed: int  # stage layouts whose units were simulated
    least: float  # the least memory per device seen
    stopped: bool
    units: dict[StageLayout, Units] = field(default_factory=dict)  # of each layout costed
    seconds: dict[StageLayout, float] = field(default_factory=dict)  # its costing's


def _search(
    problem: PipelineProblem,
    settings: PipelineSettings,
    deadline: Deadline,
    say: Callable[[str], None],
    tolerance: float = 0.0,
) -> PipelineResult:
    """The search's steps: the per-op search's stage layouts (if asked), the stage layouts
    that can hold the parameters, each estimated in closed form, then best first
    (`_Selection`): costed, estimated, simulated on two replicas per stage and on every
    device, until the best measured on every device is within the relative gap `tolerance`
    of every value still queued."""
    t0 = time.perf_counter()
    first = deadline.extended(FIRST_ANSWER_SHARE, FIRST_ANSWER_LEAST, FIRST_ANSWER_MOST)
    graph, devices, options = problem.graph, problem.devices, problem.options
    usable = float(usable_memory(devices, options.headroom, options.reserve).min())
    space = _Space(problem, settings, usable, parameter_state(graph, options), tolerance)
    space.routed = routed_state(graph, options)
    bound = compute_bound(graph, devices, options)  # first: not on a Ctrl-C's way out
    if "search" in settings.inner:
        looking = deadline.share(INNER_SHARE)
        space.searched = _searched_layouts(problem, looking, settings.table_budget)
    keys = _stage_layouts(space)
    _check_expert_setting(graph, devices, settings.expert, bool(keys))
    fitting = _holding(space, keys)
    baseline = None
    if math.isfinite(deadline.at):  # a first answer early: the cheapest to cost, costed first
        baseline = _baseline(space, fitting, deadline.share(BASELINE_SHARE), first)
        log.info(
            "pipeline search: %s costed first (the cheapest to cost within memory), %.3g s in",
            _describe(space, baseline) if baseline else "no stage layout",
            time.perf_counter() - t0,
        )
    ranked = _rank(space, [k for k in fitting if k != baseline], deadline.share(RANKING_SHARE))
    if baseline is not None:
        ranked.estimated += 1
    selection = _Selection(space, deadline, ranked, first, baseline)
    chosen = selection.run()
    within = len(ranked.estimates) + chosen.within + int(baseline is not None)
    stats: dict[str, Any] = {
        "stage_layouts": len(fitting),
        "stage_layouts_estimated": ranked.estimated + chosen.estimated,
        "stage_layouts_within_memory": within,
        "stage_layouts_dominated": selection.dominated,
        "stage_layouts_costed": chosen.costed,
        "layouts_fit": chosen.fit,
        "simulated_exactly": chosen.simulated,
        "simulated_on_every_device": chosen.everywhere,
        "set_aside_for_time": chosen.set_aside,
        "first_answer_grace_seconds": _grace(first, deadline, t0),
    }
    stopped = chosen.stopped
    best = chosen.answer
    if best is None:
        return _without_answer(space, keys, fitting, ranked, chosen, bound, stats, t0, first)
    skipped = selection.dominated
    dominated = f" ({skipped} skipped, dominated at their mixture of experts)" if skipped else ""
    say(
        f"pipeline search: {stats['stage_layouts_estimated']} of {len(fitting)} stage layouts "
        f"estimated{dominated}, {stats['stage_layouts_within_memory']} within memory, "
        f"{chosen.costed} costed; {chosen.simulated} layouts "
        f"simulated{', stopped by the time limit' if stopped else ''}; answer "
        f"{best.step:.3f} s on {ON[best.level]} ({best.candidate.layout.describe()})"
    )
    if best.estimated:
        log.warning(
            "the time limit came before any pipeline layout was simulated: the answer's step "
            "is estimated from its stage layout's costed units (raise the time limit to "
            "simulate it)"
        )
    stats["answer_simulated_on"] = ON[best.level]
    stats["answer_simulated"] = not best.estimated
    stats["stopped_by_time_limit"] = stopped
    stats["seconds"] = time.perf_counter() - t0
    limit = Limit.TIME if stopped else Limit.ITERATIONS if chosen.capped else None
    return PipelineResult(
        PipelineSearch.name,
        Status.FEASIBLE,
        objective=best.step,
        bound=bound,
        limit=limit,
        strategy=best.planned.strategy,
        stats=stats,
        planned=best.planned,
        layout=best.candidate.layout,
        cost_options=best.options,
        timeline=best.timeline,
        estimate=best.candidate.estimate,
    )


def _grace(first: Deadline, deadline: Deadline, t0: float) -> float:
    """Seconds past the deadline (or the search's start `t0`, when that was later) that
    `first` gives a first answer."""
    return first.at - max(deadline.at, t0) if math.isfinite(first.at) else 0.0


def _without_answer(
    space: _Space,
    keys: list[StageLayout],
    fitting: list[StageLayout],
    ranked: _Ranked,
    chosen: Tally,
    bound: float,
    stats: dict[str, Any],
    t0: float,
    first: Deadline | None = None,
) -> PipelineResult:
    """INFEASIBLE when nothing estimated fits, or every layout simulated did not; else
    NO_SOLUTION (the `exact` cap, the time limit or a Ctrl-C came first: with nothing
    costed by the end of the grace for a first answer, `first`, limit TIME, the message
    says to raise the limit)."""
    problem, usable = space.problem, space.usable
    stopped = chosen.stopped  # before an answer, the `exact` cap or the grace's end
    if stopped and not chosen.capped and first is not None and first.expired():
        message = _out_of_time(space, chosen, stats, first)
        stats["no_answer_in_time"] = True
        return _no_answer(Status.NO_SOLUTION, Limit.TIME, message, bound, stats, stopped, t0)
    if not chosen.simulated:
        least = min(_held(space, k) for k in keys) if keys and not fitting else ranked.least
        message = _nothing_fits(problem, min(least, chosen.least), usable)
        return _no_answer(Status.INFEASIBLE, None, message, bound, stats, stopped, t0)
    graph, devices = problem.graph, problem.devices
    message = (
        f"the pipeline layouts of {graph.name!r} estimated to fit the devices of "
        f"{devices.name} do not fit when simulated exactly: plan with recomputation or "
        f"ZeRO among the choices, more devices or a smaller batch"
    )
    if chosen.capped:
        return _no_answer(Status.NO_SOLUTION, Limit.ITERATIONS, message, bound, stats, stopped, t0)
    status, limit = (Status.NO_SOLUTION, Limit.TIME) if stopped else (Status.INFEASIBLE, None)
    return _no_answer(status, limit, message, bound, stats, stopped, t0)


def _out_of_time(space: _Space, chosen: Tally, stats: dict[str, Any], first: Deadline) -> str:
    """The line for a search the time limit (and its grace) ended before any layout that
    fits was costed."""
    graph, devices = space.problem.graph, space.problem.devices
    limit = f" of {first.limit:g} s" if math.isfinite(first.limit) else ""
    grace = stats.get("first_answer_grace_seconds", 0.0)
    done = (
        f"{stats['stage_layouts_estimated']} of {stats['stage_layouts']} stage layouts "
        f"estimated, {chosen.costed} costed, {chosen.fit} candidates within memory"
    )
    return (
        f"the pipeline search of {graph.name!r} on {devices.name} found no layout within the "
        f"time limit{limit} and {grace:.3g} s more for a first answer ({done}): raise the "
        f"time limit"
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


def _searched_layouts(
    problem: PipelineProblem, looking: Deadline, table_budget: float | None
) -> dict[int, SearchedLayout]:
    """The per-op search on a few blocks of one tensor group, per tensor degree t, within
    `looking` and `table_budget` (`inner.searched_layout`); a Ctrl-C ends it with those found
    so far."""
    graph, devices, options = problem.graph, problem.devices, problem.options
    n = devices.num_devices
    searched: dict[int, SearchedLayout] = {}
    for t in _powers(min(_host_size(devices), n)):
        try:
            found = _interruptible(
                partial(searched_layout, graph, devices, t, options, looking, table_budget),
                needed=False,
            )
        except OutOfTime:
            break
        if found is not None:
            searched[t] = found
    return searched


def _stage_layouts(space: _Space) -> list[StageLayout]:
    """Every (p, t, b, recomputation, ZeRO, inner rule, c, e) of the space: p stages dividing
    the devices (at most the blocks), t a power of two up to a host dividing a stage's
    devices, c a context-parallel degree (`_context_degrees`) with t x c dividing them, e an
    expert-parallel degree (`_expert_degrees`: 1 without mixtures of experts), b samples per
    replica per micro-batch whose micro-batches divide the batch. Only Megatron-LM's rule
    lays out c > 1 or e > 1. The expert degrees dominated at the moe op (`_dominated`) are
    here too: `_rank` skips them, each stage layout's front found when it is reached (at
    2,048 GPUs all the fronts take 25 s, more than a time limit leaves the search)."""
    settings, problem = space.settings, space.problem
    n = problem.devices.num_devices
    node = _host_size(problem.devices)
    batch = problem.samples
    choices = [p for p in (settings.stages or divisors(n)) if n % p == 0 and p <= problem.blocks]
    rules = [r for r in ("rule", "search") if r in settings.inner]
    contexts = settings.context or _context_degrees(problem.graph, n)
    return [
        (p, t, b, rc, z, rule, c, e)
        for p in choices
        for t in _powers(min(node, n // p))
        for c in contexts
        if (n // p) % (t * c) == 0
        for b in _powers(min(batch, MAX_MICRO_BATCH))
        if batch % ((n // p // (t * c)) * b) == 0
        for z in settings.zero
        if not (z and n // p // (t * c) == 1)  # ZeRO shards over replicas: none to shard over
        for rc in settings.recompute
        for rule in rules
        for e in (space.expert_degrees(p) if rule == "rule" else _searched_expert(space, t))
        if rule == "rule" or c == 1
    ]


def _dominated(space: _Space, key: StageLayout) -> bool:
    """Whether the stage layout `key` (Megatron-LM's rule) has an expert degree outside its
    front (`_expert_front`, found once per stage size, t, c, b and ZeRO): another degree is
    no slower at the moe op and no heavier, so it never gives a faster layout nor one that
    fits where the other does not."""
    p, t, b, _, z, rule, c, e = key
    degrees = space.expert_degrees(p)
    if rule != "rule" or len(degrees) < 2:
        return False
    g = space.problem.devices.num_devices // p
    return e not in _expert_front(space, g, t, c, b, z, degrees)


def _expert_front(
    space: _Space, g: int, t: int, c: int, b: int, z: int, degrees: list[int]
) -> list[int]:
    """Of the expert degrees `degrees` of a stage of g devices at (t, c, b, ZeRO z), those
    not dominated: e is dropped when another degree's mixture of experts (the graph's first
    moe op at the stage's micro-batch, laid out by Megatron-LM's rule on the stage's
    devices) is no slower (its compute and all-to-alls, `CostModel.compute_time`, and its
    gradient sync, `CostModel.sync_time`: experts not spread sync over the tensor ranks
    that share their tokens) and keeps
    no more parameter bytes and no more activations per device. Only moe ops change with
    e, so a dominated degree never gives a faster layout nor one that fits where the other
    does not. Every degree when the rule cannot lay the op out."""
    if len(degrees) < 2:
        return degrees
    key = ("front", g, t, c, b, z, tuple(degrees))
    if key not in space.fronts:
        space.fronts[key] = _undominated(space, g, t, c, b, z, degrees)
    return space.fronts[key]


def _undominated(
    space: _Space, g: int, t: int, c: int, b: int, z: int, degrees: list[int]
) -> list[int]:
    graph = space.problem.graph
    i = next(k for k, op in enumerate(graph.ops) if op.kind == "moe")
    moe = graph.ops[i]
    source = graph.ops[graph.index(moe.inputs[0])]
    alone = OpGraph(f"{graph.name}[{moe.name}]", (Op(source.name, "input", (), source.output), moe))
    d = g // (t * c)
    devices = space.first_devices(g)
    cm = CostModel(batch_graph(alone, d * b), devices, space.cost_options("none", z))
    scores = {}
    for e in degrees:
        try:
            configs = megatron(cm.graph, devices, t, c, e).configs
        except LayerwiseError:
            return degrees
        params, kept, _ = cm.memory_parts(configs)
        seconds = cm.compute_time(1, configs[1]) + cm.sync_time(1, configs[1])
        scores[e] = (seconds, float(params.max()), float(kept.max()))
        space.moe_seconds[g, t, c, b, z, e] = scores[e][0]
    return [
        e
        for e in degrees
        if not any(
            all(x <= y for x, y in zip(scores[f], scores[e], strict=True))
            and scores[f] != scores[e]
            for f in degrees
        )
    ]


def _searched_expert(space: _Space, t: int) -> list[int]:
    """The per-op search's layout at tensor degree t, if any, as its expert degree (the
    experts it spreads inside its tensor group; 1 without)."""
    if t not in space.searched:
        return []
    e = space.searched[t].expert
    return [e] if space.settings.expert is None or e in space.settings.expert else []


def _expert_degrees(graph: OpGraph, g: int, chosen: tuple[int, ...] | None) -> list[int]:
    """The expert-parallel degrees to try on a stage of g devices: for a graph with
    mixtures of experts the divisors of their experts and of g (Megatron-LM's rule gives a
    moe op a token box per device of the stage: EP groups of e consecutive devices), those
    of `chosen` when given; 1 for a graph without."""
    counts = [int(op.attr("experts", 0)) for op in graph.ops if op.kind == "moe"]
    if not counts:
        return [1]
    common = math.gcd(g, *counts)
    return [e for e in (chosen or divisors(common)) if common % e == 0]


def _check_expert_setting(
    graph: OpGraph, devices: DeviceGraph, chosen: tuple[int, ...] | None, laid_out: bool
) -> None:
    """One BackendError line for expert-parallel degrees given where they cannot apply: a
    graph without mixtures of experts, or degrees no stage layout takes."""
    if chosen in (None, (1,)):
        return
    counts = sorted({int(op.attr("experts", 0)) for op in graph.ops if op.kind == "moe"})
    if not counts:
        raise BackendError(
            f"expert-parallel degrees {chosen} given, but {graph.name!r} has no mixture-of-"
            f"experts op: leave `expert` out"
        )
    if not laid_out:
        raise BackendError(
            f"no stage layout of {devices.num_devices} devices takes expert-parallel degrees "
            f"{chosen}: give degrees that divide the experts ({', '.join(map(str, counts))}) "
            f"and a stage's devices"
        )


def _replicas_simulated(d: int, w: int, e: int, zero: int) -> tuple[int, int]:
    """(here, span): a stage of d replicas of w devices is simulated on `here` of them, its
    first and last `span` (`_unit_ends`). span covers whole expert-parallel groups of e
    devices (lcm(e, w) / w replicas, 1 when e divides w), so that the all-to-alls run in
    whole groups and each class of parameters, routed experts too, has two replicas whose
    sync scales to the stage's; every replica when d is at most 2 spans, or at ZeRO 3."""
    span = math.lcm(e, w) // w
    if zero >= 3 or d <= 2 * span:
        return d, span
    return 2 * span, span


def _context_degrees(graph: OpGraph, n: int) -> list[int]:
    """The context-parallel degrees to try: 1, and for a graph with attention the powers of
    two up to the devices that divide its sequence (Megatron-LM's rule lays every op's
    sequence out in c chunks; a layout whose sequence t x c does not divide is skipped)."""
    seqs = [op.output.size(LENGTH) for op in graph.ops if op.kind == "attention"]
    if not seqs or any(LENGTH not in op.output.dims for op in graph.ops if op.kind == "attention"):
        return [1]
    return [c for c in _powers(n) if all(seq % c == 0 for seq in seqs)]


def _baseline(
    space: _Space, fitting: list[StageLayout], looking: Deadline, first: Deadline
) -> StageLayout | None:
    """The stage layout a search with a time limit costs first, for an answer early: of the
    stage layouts that hold the parameters, the cheapest to cost (the fewest devices its
    units are simulated on, `_costing_devices`; then in `_holding`'s order) whose
    closed-form estimate has a candidate within memory (`_rank`; one another layout
    dominates is as good a first answer), looked for until `looking` passes once one was
    tried (until `first` for the first). None when none is found in that time."""
    cheapest = sorted(fitting, key=partial(_costing_devices, space))  # stable: `_holding`'s
    for i, key in enumerate(cheapest):
        if i and (looking.expired() or time.perf_counter() > first.at):
            return None
        if _rank(space, [key], None, prune=False).estimates:
            return key
    return None


def _describe(space: _Space, key: StageLayout) -> str:
    """A stage layout in words."""
    p, t, b, rc, z, rule, c, e = key
    d = space.problem.devices.num_devices // (p * t * c)
    return (
        f"PP {p} x TP {t} x CP {c} x DP {d}, EP {e}, {b} per replica per micro-batch, "
        f"recompute {rc}, ZeRO {z}{', per-op search' if rule == 'search' else ''}"
    )


def _costing_devices(space: _Space, key: StageLayout) -> int:
    """The devices a stage layout's units are simulated on (`unit_costs`: `here` replicas of
    t x c, whole expert-parallel groups; the costing's time grows with them)."""
    p, t, _, _, z, _, c, e = key
    g = space.problem.devices.num_devices // p
    here, _ = _replicas_simulated(g // (t * c), t * c, e, z)
    return t * c * here


def _holding(space: _Space, keys: list[StageLayout]) -> list[StageLayout]:
    """The stage layouts whose devices can hold their share of the parameter state (p x t
    ways, x d with ZeRO), in the order they are estimated in closed form (what a short time
    limit reaches first): the least model parallelism that holds the parameters first (the
    fewest stages, the least bubble), then the smallest micro-batches (more of them: less
    bubble), then keeping activations before recomputing them."""
    recompute = space.settings.recompute
    fitting = [k for k in keys if _held(space, k) <= space.usable]
    fitting.sort(
        key=lambda k: (
            k[0] * k[1] * k[6],
            k[0],
            k[6],
            k[2],
            recompute.index(k[3]),
            k[4],
            k[5],
            k[7],  # expert degrees in turn: a slower one after one all of whose layouts fit
        )
    )
    return fitting


def _cost(
    space: _Space,
    fitting: list[StageLayout],
    costing: Deadline,
    answered: bool = False,
    first: Deadline | None = None,
) -> _Costed:
    """Each stage layout's units (`units.unit_costs`) and the candidates they give (every
    schedule, interleaving and blocks per stage), those within memory kept; until `costing`
    passes or a Ctrl-C once some fit or the search has an answer (`answered`: a costing that
    is not needed is abandoned then). A needed costing runs until `first` (None: to its end)
    by the time only (`shielded`: a first Ctrl-C does not end the way to a first answer)."""
    problem = space.problem
    devices = problem.devices
    n, batch = devices.num_devices, problem.samples
    out = _Costed([], 0, math.inf, False)
    for key in fitting:
        p, t, b, rc, z, rule, c, e = key
        needed = not (out.found or answered)
        until = (first or Deadline.never()) if needed else costing
        if (not needed and costing.expired()) or (needed and time.perf_counter() > until.at):
            out.stopped = True
            break
        g = n // p
        w = t * c  # a replica's devices: tensor innermost, then context
        d = g // w
        m = batch // (d * b)
        opts = space.cost_options(rc, z)
        here, span = _replicas_simulated(d, w, e, z)  # replicas simulated (`unit_costs`)
        t1 = time.perf_counter()
        try:
            lay_out = space.stage_rule(rule, t, c, e)
            u = _interruptible(
                partial(
                    unit_costs,
                    space.samples_graph(here * b),
                    devices,
                    space.unit_group(g, w, here, span),
                    w,
                    opts,
                    g if p > 1 else 0,
                    d,
                    lay_out,
                    partial(simulate_chunk, deadline=_clock(until, needed)),
                ),
                needed=needed,
                deadline=until,
            )
        except OutOfTime:  # the time or a Ctrl-C: what is costed so far is ranked
            out.stopped = True
            break
        except Exception as exc:  # noqa: BLE001 - a layout the rule cannot express: skip it
            log.debug("skipped PP %d TP %d CP %d EP %d b %d: %s", p, t, c, e, b, exc)
            continue
        out.costed += 1
        out.units[key] = u
        out.seconds[key] = time.perf_counter() - t1
        found = candidates(
            u, (p, t, d, b, m, rc, z, rule), problem.blocks, space.settings.schedules,
            space.flights, c, e,
        )  # fmt: skip
        for cand in found:
            out.least = min(out.least, cand.peak)
            if cand.peak <= space.usable:
                out.found.append(cand)
    return out


@dataclass
class _Ranked:
    """Every stage layout's closed-form estimate (`_rank`): those with a candidate within
    memory, by estimate; those the time did not reach, in costing order; the least memory
    per device seen."""

    estimates: list[tuple[float, StageLayout]]
    unreached: list[StageLayout]
    least: float
    estimated: int = 0  # stage layouts estimated, within memory or not
    dominated: int = 0  # skipped: another expert degree is no slower and no heavier


def _rank(
    space: _Space,
    fitting: list[StageLayout],
    ranking: Deadline | None,
    enough: Deadline | None = None,
    prune: bool = True,
) -> _Ranked:
    """Each stage layout estimated without a simulation: its units in closed form
    (`estimate.QuickUnits`: the cost model's per-op times summed per op range), its
    candidates scored as the costing scores them; its estimate the best of those within
    memory (the memory is the costing's own, so a layout none of whose candidates fits is
    dropped: its costing would find none). Until `ranking` passes or a Ctrl-C (None: all of
    them). With `enough` (a search with no answer yet): until `ranking` passes by the time
    only, and once `enough` has passed or a Ctrl-C, until one layout is within memory (the
    shortest way to a first answer). `prune`: skip the layouts that cannot do better than
    another (`_dominated`, `_Space.needless`)."""
    problem = space.problem
    devices, n, batch = problem.devices, problem.devices.num_devices, problem.samples
    out = _Ranked([], [], math.inf)
    for i, (p, t, b, rc, z, rule, c, e) in enumerate(fitting):
        if enough is None:
            stop = ranking is not None and ranking.expired()
        else:
            late = ranking is not None and time.perf_counter() > ranking.at
            stop = late or (bool(out.estimates) and enough.expired())
        if stop:
            out.unreached = fitting[i:]
            break
        if prune and _dominated(space, fitting[i]):
            out.dominated += 1
            continue
        if prune and space.needless(fitting[i]):
            continue
        g = n // p
        w = t * c  # a replica's devices
        d = g // w
        m = batch // (d * b)
        here, span = _replicas_simulated(d, w, e, z)  # replicas costed, as `_cost` does
        opts = space.cost_options(rc, z)
        try:
            graph = space.samples_graph(here * b)
            strategy = space.stage_rule(rule, t, c, e)(graph, space.first_devices(w * here), w)
            u = space.quick.units(
                graph,
                devices,
                _unit_ends(g, w, here, span),
                partial(space.unit_group, g, w, here, span),
                strategy,
                opts,
                g if p > 1 else 0,
                here,
                d,
            )
        except Exception as exc:  # noqa: BLE001 - a layout the rule cannot express: skip it
            log.debug("skipped PP %d TP %d CP %d EP %d b %d: %s", p, t, c, e, b, exc)
            continue
        found = candidates(
            u, (p, t, d, b, m, rc, z, rule), problem.blocks, space.settings.schedules,
            space.flights, c, e,
        )  # fmt: skip
        out.estimated += 1
        out.least = min([out.least, *(f.peak for f in found)])
        fits = [f.estimate for f in found if f.peak <= space.usable]
        if found and len(fits) == len(found):
            space.settle(fitting[i])
        if fits:
            out.estimates.append((min(fits), (p, t, b, rc, z, rule, c, e)))
    return out


class _Selection(BestFirst):
    """The rule of `backends.pipeline.select` on this search's steps: `_rank`, `_cost`,
    `_simulate_one` and `_on_every_device`."""

    def __init__(
        self,
        space: _Space,
        deadline: Deadline,
        ranked: _Ranked,
        first: Deadline | None = None,
        baseline: StageLayout | None = None,
    ) -> None:
        settings = space.settings
        due = deadline.share(1.0 - SIMULATION_RESERVE)
        super().__init__(
            deadline, list(ranked.unreached), settings.exact, space.tolerance, first, due
        )
        self.space = space
        self.tally.least = ranked.least
        self.units: dict[StageLayout, Units] = {}  # of each stage layout costed
        self.seconds: dict[StageLayout, float] = {}  # its costing's
        self.ranges = len(unit_ranges(space.problem.graph))  # op ranges a costing simulates
        self.baseline = baseline  # costed before the queue is looked at (`_baseline`)
        self.dominated = ranked.dominated  # stage layouts skipped at their moe op
        for estimate, key in ranked.estimates:
            self.push(estimate, STAGE, key)

    def run(self) -> Tally:
        if self.baseline is not None and not self.cost(self.baseline):
            self.tally.stopped = True  # the grace ended it: no answer in time
            return self.tally
        return super().run()

    def rank(self, batch: list[StageLayout], needed: bool) -> list[StageLayout]:
        if needed:  # no answer without: until the grace's end, or one fits once late
            more = _rank(self.space, batch, self.first, enough=self.deadline)
        else:
            more = _rank(self.space, batch, self.deadline)
        self.tally.estimated += more.estimated
        self.dominated += more.dominated
        self.tally.within += len(more.estimates)
        self.tally.least = min(self.tally.least, more.least)
        for estimate, key in more.estimates:
            self.push(estimate, STAGE, key)
        return more.unreached

    def cost(self, key: StageLayout) -> bool:
        answered = bool(self.measured or self._untried)
        costed = _cost(self.space, [key], self.deadline, answered, self.first)
        self.units.update(costed.units)
        self.seconds.update(costed.seconds)
        self.tally.costed += costed.costed
        self.tally.fit += len(costed.found)
        self.tally.least = min(self.tally.least, costed.least)
        for cand in costed.found:
            self.push(cand.estimate, ESTIMATE, cand)
        return not costed.stopped

    def simulate(self, candidate: Candidate) -> bool:
        until = self.deadline if self.measured else self.first  # the first: the grace too
        try:
            sim = _simulate_one(self.space, candidate, until, needed=False)
        except OutOfTime:
            return False
        self.tally.simulated += 1
        self.keep(sim)
        return True

    def expected(self, candidate: Candidate) -> float:
        """Seconds its exact simulation is expected to take: its stage layout's costing's
        per op range costed, times the blocks of its distinct chunks (the first, the last
        and each other size: `chunk_times` simulates each once), on as many replicas."""
        lay = candidate.layout
        seconds = self.seconds.get(_stage_key(lay))
        if seconds is None:
            return 0.0
        count = len(lay.blocks)
        distinct = {(min(k, 1) if k < count - 1 else 2, b) for k, b in enumerate(lay.blocks)}
        return seconds / self.ranges * sum(b for _, b in distinct)

    def unsimulated(self, candidate: Candidate) -> _Simulated | None:
        u = self.units.get(_stage_key(candidate.layout))
        return None if u is None else _by_estimate(self.space, candidate, u)

    def everywhere(self, measure: _Simulated) -> bool:
        again, why = _on_every_device(self.space, measure, self.deadline)
        if again is not None:
            self.tally.everywhere += 1
            self.keep(again)
        elif why == "memory":  # it does not fit when every device is simulated
            del self.measured[measure.layout]
        else:  # as exact as it can be: two replicas are its measure
            self.settle(measure, for_want_of_time=why == "time")
        return True


def _simulate_one(
    space: _Space, cand: Candidate, deadline: Deadline, needed: bool
) -> _Simulated | None:
    """`cand` simulated exactly (`_simulate`: two replicas per stage, every device with one
    or two replicas or ZeRO 3); None when it does not fit the memory. OutOfTime at the
    deadline or a Ctrl-C unless `needed`."""
    problem = space.problem
    lay = cand.layout
    opts = space.cost_options(lay.recompute, lay.zero)
    t1 = time.perf_counter()
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
            deadline=_clock(deadline, needed),
        ),
        needed=needed,
        deadline=deadline,
    )
    if max(timeline.peak_bytes) > space.usable:
        return None
    whole = _replicas_of(lay)[0] == lay.data  # every device simulated already
    seconds = time.perf_counter() - t1
    return _Simulated(timeline.makespan, seconds, cand, planned, timeline, opts, whole)


def _on_every_device(
    space: _Space, best: _Simulated, deadline: Deadline
) -> tuple[_Simulated | None, str]:
    """`best` (simulated on two replicas per stage) simulated again on every device
    (contention two replicas do not see), and why not when it is not: "size" (its distinct
    chunks have more than FULL_SIMULATION_TASKS tasks), "time" (its expected seconds are
    more than the time left, or the deadline or a Ctrl-C came first), "memory" (it does not
    fit when every device is simulated)."""
    problem = space.problem
    lay = best.candidate.layout
    if _tasks(problem.graph, lay) > FULL_SIMULATION_TASKS:
        return None, "size"
    expected = best.seconds * lay.data / _replicas_of(lay)[0] * FULL_SIMULATION_COST
    if expected > deadline.left():
        return None, "time"
    cm = CostModel(best.planned.strategy.graph, problem.devices, best.options)
    try:
        again = _interruptible(
            partial(simulate_pipelined, cm, best.planned, _clock(deadline, False)),
            needed=False,
            deadline=deadline,
        )
    except OutOfTime:
        return None, "time"
    if max(again.peak_bytes) > space.usable:
        return None, "memory"
    return dataclasses.replace(best, step=again.makespan, timeline=again, on_every_device=True), ""


def _interruptible(step: Callable[[], T], needed: bool, deadline: Deadline | None = None) -> T:
    """`step()`, abandoned at a Ctrl-C or past `deadline` (OutOfTime at once; the step, in
    a thread, stops at its next look at its clock, `_clock`) unless it is `needed` (the
    search has no answer without it): then it runs here, `shielded` from a first Ctrl-C,
    and ends at its own looks at its clock (OutOfTime). One costing or simulation of a
    1,024-device layout takes seconds, and a stop request or the time limit should end the
    search within a fraction of one."""
    if needed:
        with shielded():
            return step()
    if stop_requested():
        raise OutOfTime
    return run_within(step, deadline or Deadline.never())


def _clock(deadline: Deadline, needed: bool) -> float:
    """The perf_counter value a step's simulations look at (`Simulator`'s deadline): the
    deadline's; for a step that is not `needed`, finite even without one, so that the step,
    abandoned in its thread (`run_within`: every deadline has passed there), stops."""
    if needed or math.isfinite(deadline.at):
        return deadline.at
    return sys.float_info.max


def _stage_key(lay: Layout) -> StageLayout:
    """The stage layout a layout is a candidate of."""
    return (lay.stages, lay.tensor, lay.micro_batch, lay.recompute, lay.zero, lay.inner,
            lay.context, lay.expert)  # fmt: skip


def _by_estimate(space: _Space, cand: Candidate, u: Units) -> _Simulated | None:
    """`cand` measured without a simulation: its chunks composed from its stage layout's
    costed units `u` (as its estimate is), the schedule's timeline of them
    (`simulate_pipeline`); None when that timeline's peak does not fit."""
    lay = cand.layout
    p, count = lay.stages, len(lay.blocks)
    chunks, start = [], 0
    for c, k in enumerate(lay.blocks):
        chunks.append(u.chunk(c, count, k, start))
        start += k
    opts = space.cost_options(lay.recompute, lay.zero)
    timeline = simulate_pipeline(
        chunks, lay.schedule, p, lay.micro_batches, opts.pp_overlap, opts.chunk_sync_share
    )
    if max(timeline.peak_bytes) > space.usable:
        return None
    problem = space.problem
    n = problem.devices.num_devices
    planned = _strategy(
        problem.graph, problem.devices, lay, space.micro, space.groups, space.searched,
        lay.micro_batches, problem.devices, n // p, lay.data,
    )  # fmt: skip
    return _Simulated(timeline.makespan, 0.0, cand, planned, timeline, opts, False, True)


def _simulate(
    graph: OpGraph,
    devices: DeviceGraph,
    lay: Layout,
    options: CostOptions,
    micro: dict[int, OpGraph],
    groups: dict[Any, DeviceGraph],
    searched: dict[int, SearchedLayout] | None = None,
    deadline: float = math.inf,
) -> tuple[PipelinedStrategy, PipelineTimeline]:
    """The layout's pipelined strategy, and its step: every distinct chunk simulated with
    FlexFlow's simulator on two of its stage's data-parallel replicas (all compute and
    exchange alike within their tensor-parallel groups; with expert parallelism two sets of
    replicas that hold whole expert-parallel groups: `_replicas_simulated`), their gradient
    sync and ZeRO's parameter bytes scaled to the stage's replicas per parameter class
    (`units.scale_factors`); with one or two replicas (sets), or ZeRO 3, every device
    simulated. OutOfTime past a finite `deadline` (a perf_counter value) or at a stop
    request, from the simulator's looks at the clock."""
    n, p, d = devices.num_devices, lay.stages, lay.data
    g = n // p
    w = lay.tensor * lay.context  # a replica's devices: tensor innermost, then context

    def strategy(m: int, devs: DeviceGraph, size: int, data: int) -> PipelinedStrategy:
        return _strategy(graph, devices, lay, micro, groups, searched, m, devs, size, data)

    planned = strategy(lay.micro_batches, devices, g, d)
    here, span = _replicas_of(lay)
    if here == d:
        cm = CostModel(planned.strategy.graph, devices, options)
        return planned, simulate_pipelined(cm, planned, deadline)
    # the first and the last replicas: across the same links as the stage's sync crosses
    keep = [s * g + k for s in range(p) for k in _unit_ends(g, w, here, span)]
    reduced = devices.subset(keep, f"{devices.name}[{p} x {w * here}]")
    small_samples = here * lay.micro_batch
    if -small_samples not in micro:
        micro[-small_samples] = batch_graph(graph, small_samples)
    small = strategy(-small_samples, reduced, w * here, here)
    cm = CostModel(small.strategy.graph, reduced, options)
    chunks = chunk_times(cm, small, _CHUNKS, deadline)
    scaled = []
    factors: dict[tuple[int, int], tuple[float, float]] = {}
    for k, c in enumerate(chunks):  # ZeRO shards the parameters' state, not the working set
        ops = small.pipeline.chunk_ops(k)
        if (ops.start, ops.stop) not in factors:
            factors[ops.start, ops.stop] = scale_factors(
                small.strategy.graph, small.strategy.configs, ops, options, d / here
            )
        sync, zero = factors[ops.start, ops.stop]
        fixed = (c.fixed_bytes - c.working_bytes) * zero + c.working_bytes
        scaled.append(dataclasses.replace(c, sync=c.sync * sync, fixed_bytes=fixed))
    return planned, simulate_pipeline(
        scaled, lay.schedule, p, lay.micro_batches, options.pp_overlap, options.chunk_sync_share
    )


def _strategy(
    graph: OpGraph,
    devices: DeviceGraph,
    lay: Layout,
    micro: dict[int, OpGraph],
    groups: dict[Any, DeviceGraph],
    searched: dict[int, SearchedLayout] | None,
    m: int,
    devs: DeviceGraph,
    size: int,
    data: int,
) -> PipelinedStrategy:
    """The layout's pipelined strategy of graph `micro[m]` (m micro-batches of the batch, or
    minus m samples: made when missing) on `devs`, its stage rule laid out on the first
    `size` of `devices` (`groups` keeps them) with `data` replicas per stage."""
    t = lay.tensor
    if m not in micro:
        micro[m] = micro_batch_graph(graph, m)
    if size not in groups:  # all of them: the devices themselves (no routes to derive)
        whole = size == devices.num_devices
        groups[size] = devices if whole else devices.subset(range(size), f"{devices.name}[{size}]")
    if lay.inner == "search" and searched and t in searched and lay.context == 1:
        inner = searched[t].strategy(micro[m], groups[size], t)
    else:
        inner = megatron(micro[m], groups[size], t, lay.context, lay.expert)
    return _pipelined(micro[m], devs, inner, dataclasses.replace(lay, data=data))


def _pipelined(
    graph: OpGraph, devices: DeviceGraph, inner: Strategy, lay: Layout
) -> PipelinedStrategy:
    """The layout's pipelined strategy: `inner` (the micro-batch graph on the first group's
    devices) moved to each chunk's group; bounds at the blocks' first ops."""
    p = lay.stages
    g = devices.num_devices // p
    bounds = block_bounds(graph, len(lay.blocks), lay.blocks)
    groups = tuple(tuple(range(s * g, (s + 1) * g)) for s in range(p))
    pipe = Pipeline(bounds, groups, lay.micro_batches, lay.schedule)
    configs = []
    moved: dict[tuple[int, int], tuple[int, ...]] = {}  # ops share device lists: move each once
    for i, cfg in enumerate(inner.configs):
        base = (pipe.chunk_of(i) % p) * g
        key = (id(cfg.devices), base)
        if key not in moved:
            moved[key] = tuple((np.asarray(cfg.devices, dtype=np.int64) + base).tolist())
        configs.append(dataclasses.replace(cfg, devices=moved[key]))
    return PipelinedStrategy(Strategy(graph, devices, tuple(configs)), pipe)


def _unit_ends(g: int, t: int, here: int, span: int = 1) -> tuple[int, ...]:
    """The devices of a stage of g that `unit_costs` costs: its first `here - span` and last
    `span` of `here` replicas of t (the last across the same links as the stage's sync
    crosses; `span` replicas hold whole expert-parallel groups, `_replicas_simulated`)."""
    if t * here >= g:
        return tuple(range(g))
    return (*range(t * (here - span)), *range(g - t * span, g))


def _replicas_of(lay: Layout) -> tuple[int, int]:
    """`_replicas_simulated` of a layout: (replicas simulated, replicas per EP span)."""
    return _replicas_simulated(lay.data, lay.tensor * lay.context, lay.expert, lay.zero)


def _tasks(graph: OpGraph, lay: Layout) -> int:
    """About the tasks a full simulation of the layout's distinct chunks has: ops of the
    first, a middle and the last chunk, each on every device of its stage."""
    per_chunk = len(graph.ops) / (lay.stages * lay.virtual)
    return int(min(3, lay.stages * lay.virtual) * per_chunk * lay.tensor * lay.context * lay.data)


def _held(space: _Space, key: StageLayout) -> float:
    """A lower bound of a device's parameter bytes: the dense state split p x t ways, the
    routed experts' p x e ways (Megatron-LM's rule cuts no expert by t), each also over its
    data-parallel replicas with ZeRO."""
    p, t, _, _, z, _, _, e = key
    n = space.problem.devices.num_devices
    dense, routed = space.state - space.routed, space.routed
    dense_ways = p * t * (n // (p * t) if z else 1)
    routed_ways = p * e * (n // (p * e) if z else 1)
    return dense / dense_ways + routed / routed_ways


def _host_size(devices: DeviceGraph) -> int:
    first = devices.devices[0].host
    return sum(1 for d in devices.devices if d.host == first)


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out
