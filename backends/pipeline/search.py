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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from backends.pipeline.inner import SearchedLayout, searched_layout
from backends.pipeline.units import (
    Units,
    block_ranges,
    compute_bound,
    parameter_state,
    ring_factor,
    unit_costs,
    zero_factor,
)
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.memory import usable_memory
from planner.deadline import Deadline, OutOfTime, run_within, stop_requested
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import SAMPLE
from planner.hardware.devices import DeviceGraph
from planner.pipeline.schedule import in_flight, schedule
from planner.pipeline.spec import (
    Pipeline,
    PipelinedStrategy,
    PipelineError,
    batch_graph,
    micro_batch_graph,
)
from planner.pipeline.stages import chunk_times, simulate_pipelined
from planner.pipeline.timeline import PipelineTimeline, simulate_pipeline
from planner.problems.baselines import megatron
from planner.problems.strategy import Strategy

__all__ = ["Layout", "PipelineAnswer", "search_pipeline"]

log = logging.getLogger("backends.pipeline")
T = TypeVar("T")

FULL_SIMULATION_TASKS = 200_000  # the answer is simulated on every device up to this
INNER = ("rule", "search")  # how a stage is laid out: Megatron-LM's rule, the per-op search
INNER_SHARE = 0.1  # of the time, at most, for the per-op searches of the stages' layouts
COSTING_SHARE = 0.45
FULL_SIMULATIONS = 3  # the best layouts by two replicas' simulation simulated on every device
# seconds of a full simulation per second of two replicas', per replica pair (measured 0.18-0.38)
FULL_SIMULATION_COST = (
    0.4  # of the time left, for costing stage layouts; the rest simulates exactly
)
MAX_MICRO_BATCH = 16  # samples per replica per micro-batch: more only adds to the bubble


@dataclass(frozen=True, order=True)
class Layout:
    """One point of the space."""

    stages: int
    tensor: int
    data: int
    micro_batch: int  # samples per data-parallel replica per micro-batch
    micro_batches: int
    schedule: str
    virtual: int
    recompute: str
    zero: int
    blocks: tuple[int, ...]  # per chunk, in chunk order
    inner: str = "rule"  # each stage laid out by Megatron-LM's rule or the per-op search

    def describe(self) -> str:
        sched = self.schedule if self.virtual == 1 else f"{self.schedule} v={self.virtual}"
        zero = f", ZeRO {self.zero}" if self.zero else ""
        return (
            f"PP {self.stages} x TP {self.tensor} x DP {self.data}, {self.micro_batches} "
            f"micro-batches of {self.micro_batch} per replica, {sched}, recompute "
            f"{self.recompute}{zero}, {self._blocks()}"
            + (", stages laid out by the per-op search" if self.inner == "search" else "")
        )

    def _blocks(self) -> str:
        if len(set(self.blocks)) == 1:
            per = "chunk" if self.virtual > 1 else "stage"
            k = self.blocks[0]
            return f"{k} block{'s' if k != 1 else ''} per {per}"
        return f"blocks per stage {list(self.blocks)}"


@dataclass(frozen=True)
class PipelineAnswer:
    """The search's best layout, as a pipelined strategy with its exact simulation."""

    planned: PipelinedStrategy
    layout: Layout
    options: CostOptions  # the cost options with the layout's recomputation and ZeRO
    timeline: PipelineTimeline
    estimate: float
    bound: float
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def step_seconds(self) -> float:
        return self.timeline.makespan

    @property
    def peak_bytes(self) -> float:
        return max(self.timeline.peak_bytes)


@dataclass(frozen=True)
class _Candidate:
    estimate: float
    floor: float
    layout: Layout
    peak: float


def search_pipeline(
    graph: OpGraph,
    devices: DeviceGraph,
    options: CostOptions,
    *,
    deadline: Deadline | None = None,
    recompute: Sequence[str] = ("none", "full"),
    zero: Sequence[int] = (0,),
    schedules: Sequence[str] = ("1f1b", "interleaved", "gpipe"),
    stages: Sequence[int] | None = None,
    exact: int = 6,
    inner: Sequence[str] = INNER,
    progress: Callable[[str], None] | None = None,
) -> PipelineAnswer:
    """The fastest layout found for the full-batch `graph` (a model of numbered blocks) on
    `devices` within their usable memory (`options.headroom`). PipelineError when the model
    has no blocks or nothing in the space fits (one line, with the least memory seen)."""
    t0 = time.perf_counter()
    deadline = deadline or Deadline.never()
    say = progress or (lambda text: log.info(text))
    blocks = len(block_ranges(graph))
    batch = _samples(graph)
    n = devices.num_devices
    node = _host_size(devices)
    usable = float(usable_memory(devices, options.headroom).min())
    state = parameter_state(graph, options)
    bound = compute_bound(graph, devices, options)  # first: not on a Ctrl-C's way out
    choices = [p for p in (stages or _divisors(n)) if n % p == 0 and p <= blocks]
    costed = 0  # stage layouts whose units were simulated
    groups: dict[Any, DeviceGraph] = {}
    micro: dict[int, OpGraph] = {}
    flights: dict[tuple[str, int, int, int], tuple[int, ...]] = {}
    found: list[_Candidate] = []
    least = math.inf
    stopped = False
    searched: dict[int, SearchedLayout] = {}
    if "search" in inner:  # the per-op search on a few blocks of one tensor group, per t
        looking = deadline.share(INNER_SHARE)
        for t in _powers(min(node, n)):
            try:
                found_layout = _interruptible(
                    partial(searched_layout, graph, devices, t, options, looking), needed=False
                )
            except OutOfTime:
                break
            if found_layout is not None:
                searched[t] = found_layout
    rules = [r for r in ("rule", "search") if r in inner]
    keys = [
        (p, t, b, rc, z, rule)
        for p in choices
        for t in _powers(min(node, n // p))
        if (n // p) % t == 0
        for b in _powers(min(batch, MAX_MICRO_BATCH))
        if batch % ((n // p // t) * b) == 0
        for rc in recompute
        for z in zero
        if not (z and n // p // t == 1)  # ZeRO shards over replicas: none to shard over
        for rule in rules
        if rule == "rule" or t in searched
    ]
    # a device's parameter state alone must fit: p x t at least that many ways (ZeRO: x d)
    fitting = [k for k in keys if _held(state, n, *k) <= usable]
    if not fitting and keys:
        least = min(_held(state, n, *k) for k in keys)
    # the least model parallelism that holds the parameters first (the fewest stages, the
    # least bubble), then the smallest micro-batches (more of them: less bubble), then
    # keeping activations before recomputing them
    fitting.sort(key=lambda k: (k[0] * k[1], k[0], k[2], recompute.index(k[3]), k[4], k[5]))
    costing = deadline.share(COSTING_SHARE)
    for p, t, b, rc, z, rule in fitting:
        if (costing.expired() or stop_requested()) and found:
            stopped = True
            break
        g = n // p
        d = g // t
        m = batch // (d * b)
        opts = dataclasses.replace(options, recompute=rc, zero=z)  # type: ignore[arg-type]
        here = d if z >= 3 else min(d, 2)  # replicas simulated (`unit_costs`)
        mu = -here * b  # keyed by minus the samples: a graph of here x b samples
        key = ("units", g, t * here)
        if key not in groups:
            ends = (*range(t * here - t), *range(g - t, g))  # first and last replicas
            groups[key] = devices.subset(ends, f"{devices.name}[{t * here} of {g}]")
        try:
            if mu not in micro:
                micro[mu] = batch_graph(graph, here * b)
            lay_out = searched[t].strategy if rule == "search" else megatron
            u = _interruptible(
                partial(
                    unit_costs,
                    micro[mu],
                    devices,
                    groups[key],
                    t,
                    opts,
                    g if p > 1 else 0,
                    d,
                    lay_out,
                ),
                needed=not found,
            )
        except OutOfTime:  # a Ctrl-C: what is costed so far is ranked
            stopped = True
            break
        except Exception as exc:  # noqa: BLE001 - a layout the rule cannot express: skip it
            log.debug("skipped PP %d TP %d b %d: %s", p, t, b, exc)
            continue
        costed += 1
        for cand in _candidates(u, p, t, d, b, m, rc, z, rule, blocks, schedules, flights):
            least = min(least, cand.peak)
            if cand.peak <= usable:
                found.append(cand)
    if not found:
        raise PipelineError(
            f"no pipeline layout of {graph.name!r} fits the {n} devices of {devices.name}: the "
            f"least memory per device seen is {least / 2**30:.1f} GiB of "
            f"{usable / 2**30:.1f} GiB usable (more devices, a smaller batch, or "
            f"recomputation and ZeRO among the choices)"
        )
    found.sort(key=lambda c: (c.estimate, c.layout))
    say(
        f"pipeline search: {len(found)} layouts fit ({costed} of {len(fitting)} stage "
        f"layouts costed{', stopped by the time limit' if stopped else ''}); best estimate "
        f"{found[0].estimate:.3f} s ({found[0].layout.describe()})"
    )
    ranked: list[
        tuple[float, float, _Candidate, PipelinedStrategy, PipelineTimeline, CostOptions]
    ] = []
    simulated = 0
    for cand in found:
        if simulated >= exact or (ranked and cand.floor >= ranked[0][0]):
            break
        if ranked and (deadline.expired() or stop_requested()):
            stopped = True
            break
        lay = cand.layout
        opts = dataclasses.replace(options, recompute=lay.recompute, zero=lay.zero)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        try:
            planned, timeline = _interruptible(
                partial(_simulate, graph, devices, lay, opts, micro, groups, searched),
                needed=not ranked,
            )
        except OutOfTime:
            stopped = True
            break
        simulated += 1
        if max(timeline.peak_bytes) <= usable:
            ranked.append(
                (timeline.makespan, time.perf_counter() - t1, cand, planned, timeline, opts)
            )
            ranked.sort(key=lambda r: r[0])
    if not ranked:
        raise PipelineError(
            f"the pipeline layouts of {graph.name!r} estimated to fit the devices of "
            f"{devices.name} do not fit when simulated exactly: plan with recomputation or "
            f"ZeRO among the choices, more devices or a smaller batch"
        )
    # the best few again on every device (contention two replicas do not see), as time allows
    full: list[tuple[float, _Candidate, PipelinedStrategy, PipelineTimeline, CostOptions]] = []
    for _, seconds, cand, planned, timeline, opts in ranked[:FULL_SIMULATIONS]:
        lay = cand.layout
        if lay.data <= 2 or lay.zero >= 3:  # simulated on every device already
            full.append((timeline.makespan, cand, planned, timeline, opts))
            continue
        expected = seconds * lay.data / 2 * FULL_SIMULATION_COST
        if _tasks(graph, lay) > FULL_SIMULATION_TASKS or expected > deadline.left():
            continue
        try:
            again = _interruptible(
                partial(
                    simulate_pipelined, CostModel(planned.strategy.graph, devices, opts), planned
                ),
                needed=False,
            )
        except OutOfTime:
            break
        if max(again.peak_bytes) <= usable:
            full.append((again.makespan, cand, planned, again, opts))
    if full:
        step, cand, planned, timeline, opts = min(full, key=lambda r: r[0])
    else:
        step, _, cand, planned, timeline, opts = ranked[0]
    everything = bool(full)
    return PipelineAnswer(
        planned=planned,
        layout=cand.layout,
        options=opts,
        timeline=timeline,
        estimate=cand.estimate,
        bound=bound,
        stats={
            "layouts_fit": len(found),
            "stage_layouts_costed": costed,
            "stage_layouts": len(fitting),
            "simulated_exactly": simulated,
            "answer_simulated_on": "every device"
            if everything or cand.layout.data <= 2
            else "two replicas per stage",
            "stopped_by_time_limit": stopped,
            "seconds": time.perf_counter() - t0,
        },
    )


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


def _held(state: float, n: int, p: int, t: int, b: int, rc: str, z: int, rule: str) -> float:
    """A lower bound of a device's parameter bytes: the state split p x t ways (x d: ZeRO)."""
    return state / (p * t) / (n // (p * t) if z else 1)


def _samples(graph: OpGraph) -> int:
    sizes = [op.output.size(SAMPLE) for op in graph.ops if SAMPLE in op.output.dims]
    if not sizes:
        raise PipelineError(f"{graph.name!r} has no sample dimension to split into micro-batches")
    return max(sizes)


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
