"""A pipelined strategy's step, simulated: each chunk's micro-batch costs from FlexFlow's
simulator on the chunk's own ops and devices, then the schedule's timeline of them.

Per chunk c (ops `bounds[c]..bounds[c+1]`, devices `group_of(c)`):

- **its graph**: the chunk's ops, and one `input` op per tensor it reads from an earlier
  chunk, laid out as its producer's tasks are but on this group's devices, position for
  position (the message lands there; the chunk's own transfers then move it to where its
  ops need it, as Megatron-LM's scatter-gather of the boundary tensor does);
- **its devices**: `DeviceGraph.subset` of the group, so its transfers and gradient sync use
  the group's own links;
- **forward and backward seconds of one micro-batch**: from one simulation of the chunk
  (`Simulator.phase_ends`): the forward ends with its last forward task, the backward with
  its last backward task that is not parameter sync (a chunk's backward starts once its
  forward is done and the gradient is there; recomputation is in it). The sync shares the
  links with the backward's transfers in that simulation, as it does in the pipeline's
  last micro-batch; in the earlier ones, which sync nothing, it may slow them a little;
- **sync**: the rest of that simulated step, i.e. the gradient sync and the optimizer step
  left after one micro-batch's backward;
- **the weight gradient's share of the backward** (for schedules that run it apart,
  "dualpipe"): of the backward's FLOPs, those of the weight gradients (`weight_share`);
- **messages**: each tensor it sends to a later chunk goes task by task from the producer's
  devices to the same positions in the receiving group (`DeviceGraph.transfer_time`, the
  tasks at once: their slowest), and its gradient comes back the same way;
- **memory per device**: its parameters' training state and its working set once (the
  largest recomputed region's, or on the last stage the loss's logits gradient), and its
  kept activations per micro-batch in flight (`CostModel.memory_parts`,
  `planner.costs.activations`: on the first stage the embedding's output as the first block
  keeps it, on the last the loss's fp32 probabilities); a stage's peak adds them up over
  its chunks (`planner.pipeline.timeline.stage_peak`).

`simulate_pipelined` feeds these to `planner.pipeline.timeline.simulate_pipeline`.

Not modelled: messages that skip a chunk (a tensor read two chunks later) are timed as
sent at the end of the producer's chunk with that chunk's message; the all-reduce of an
embedding tied across the first and last stage (Megatron-LM's) is left out.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.recompute import block_of
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import kind_spec
from planner.pipeline.schedule import DUALPIPE
from planner.pipeline.spec import PipelinedStrategy, PipelineError
from planner.pipeline.timeline import ChunkTimes, PipelineTimeline, simulate_pipeline
from planner.sim.simulator import Simulator

if TYPE_CHECKING:
    from planner.hardware.devices import DeviceGraph


@dataclass(frozen=True)
class Chunk:
    """One chunk as a problem of its own: its graph, devices and configs (local device
    indices), and the global device index of each local one."""

    graph: OpGraph
    devices: DeviceGraph
    configs: tuple[ParallelConfig, ...]
    group: tuple[int, ...]


def chunk_problem(
    cost_model: CostModel,
    ps: PipelinedStrategy,
    c: int,
    groups: dict[Any, DeviceGraph] | None = None,
) -> Chunk:
    """Chunk c's graph (its ops and an input op per tensor from an earlier chunk), its
    group's devices and the configs on them. `groups`: the groups' device graphs made so far
    (a stage's chunks share one: each costs a route derivation, a second on 1,024 GPUs)."""
    pipe = ps.pipeline
    return range_problem(
        cost_model.devices,
        ps.strategy.graph,
        ps.strategy.configs,
        pipe.chunk_ops(c),
        pipe.group_of(c),
        lambda j: pipe.group_of(pipe.chunk_of(j)),
        f"{cost_model.devices.name}[stage {c % pipe.stages}]",
        groups,
    )


def range_problem(
    devices: DeviceGraph,
    graph: OpGraph,
    configs: Sequence[ParallelConfig],
    ops: range,
    group: tuple[int, ...],
    group_of_op: Callable[[int], tuple[int, ...]],
    name: str | None = None,
    groups: dict[Any, DeviceGraph] | None = None,
) -> Chunk:
    """The ops `ops` of `graph` (configs on `devices`' indices, every op of the range on
    `group`) as a problem of their own, with an input op per tensor they read from before
    the range (produced on `group_of_op(j)`, landed on `group`)."""
    local = {d: k for k, d in enumerate(group)}
    sub_ops: list[Op] = []
    cfgs: list[ParallelConfig] = []
    outside: set[int] = set()
    for i in ops:
        for input_name in graph.ops[i].inputs:
            j = graph.index(input_name)
            if j < ops.start and j not in outside:
                outside.add(j)
                src = graph.ops[j]
                sub_ops.append(Op(src.name, "input", (), src.output))
                cfgs.append(_landed(src, configs[j], group_of_op(j), group))
    for i in ops:
        cfg = configs[i]
        sub_ops.append(graph.ops[i])
        cfgs.append(dataclasses.replace(cfg, devices=tuple(local[d] for d in cfg.devices)))
    sub = OpGraph(f"{graph.name}[ops {ops.start}-{ops.stop - 1}]", tuple(sub_ops))
    order = {op.name: k for k, op in enumerate(sub_ops)}
    configs_sorted = tuple(cfgs[order[op.name]] for op in sub.ops)  # OpGraph re-sorts
    if name is None and group == tuple(range(devices.num_devices)):
        on = devices  # every device, in order: a subset would only derive their routes again
    elif groups is not None:
        if (group, name) not in groups:
            groups[group, name] = devices.subset(group, name)
        on = groups[group, name]
    else:
        on = devices.subset(group, name)
    return Chunk(sub, on, configs_sorted, group)


def _landed(
    op: Op, cfg: ParallelConfig, src_group: tuple[int, ...], dst_group: tuple[int, ...]
) -> ParallelConfig:
    """Where a tensor from another chunk lands: the producer's layout, task k on the device
    at its producer's position in the receiving group (local indices)."""
    if cfg.reduce > 1:
        raise PipelineError(
            f"op {op.name!r} ends a pipeline chunk as a partial sum (a contraction split): "
            f"a chunk must hand on whole tensors"
        )
    where = {d: k for k, d in enumerate(src_group)}
    return ParallelConfig(cfg.degrees, tuple(where[d] % len(dst_group) for d in cfg.devices))


def message_seconds(cost_model: CostModel, ps: PipelinedStrategy) -> list[float]:
    """Per chunk, seconds to send every tensor it hands to later chunks: per tensor, its
    tasks' parts at once from the producer's devices to the same positions in the first
    receiving chunk's group (the slowest), tensors one after another."""
    pipe, graph = ps.pipeline, ps.strategy.graph
    devices = cost_model.devices
    chunk = [pipe.chunk_of(i) for i in range(len(graph.ops))]
    first_later: dict[int, int] = {}  # op -> the first later chunk that reads it
    for e in graph.edges:
        if chunk[e.dst] > chunk[e.src]:
            first_later[e.src] = min(first_later.get(e.src, chunk[e.dst]), chunk[e.dst])
    out = [0.0] * pipe.chunks
    for i, to in sorted(first_later.items()):
        c = chunk[i]
        cfg = ps.strategy.configs[i]
        src_group, dst_group = pipe.group_of(c), pipe.group_of(to)
        where = {d: k for k, d in enumerate(src_group)}
        nbytes = graph.ops[i].output.nbytes / (cfg.num_tasks // cfg.reduce)
        out[c] += max(
            devices.transfer_time(d, dst_group[where[d] % len(dst_group)], nbytes)
            for d in cfg.devices
        )
    return out


def chunk_times(
    cost_model: CostModel,
    ps: PipelinedStrategy,
    cache: ChunkCache | None = None,
    deadline: float = math.inf,
) -> list[ChunkTimes]:
    """Every chunk's `ChunkTimes` (see the module's docstring). Chunks alike (the same ops
    but for their block numbers, the same configs, groups of the same devices and links) are
    simulated once: the middle stages of a transformer's pipeline are; with a `cache`, once
    across calls too. OutOfTime past `deadline` (a perf_counter value) or at a stop request,
    when it is finite (`simulate_chunk`)."""
    pipe = ps.pipeline
    sends = message_seconds(cost_model, ps)
    seen: dict[tuple[str, ...], tuple[float, ...]] = {}
    groups: dict[Any, DeviceGraph] = {}

    def share(graph: OpGraph) -> float:  # only DualPipe splits the backward (ChunkTimes)
        if pipe.schedule != DUALPIPE:
            return ChunkTimes.weight_share
        return weight_share(graph, cost_model.options.backward_factor)

    out = []
    for c in range(pipe.chunks):
        ch = chunk_problem(cost_model, ps, c, groups)
        key = chunk_key(ch)
        if key not in seen:
            seen[key] = (
                cache.simulated(cost_model, ch, key, deadline)
                if cache is not None
                else simulate_chunk(cost_model.options, cost_model.measured, ch, deadline)
            )
        forward, backward, sync, kept, fixed, working = seen[key]
        out.append(
            ChunkTimes(
                forward=forward,
                backward=backward,
                send_forward=sends[c] if c < pipe.chunks - 1 else 0.0,
                send_backward=sends[c - 1] if c > 0 else 0.0,
                sync=sync,
                activation_bytes=kept,
                fixed_bytes=fixed,
                working_bytes=working,
                weight_share=share(ch.graph),
            )
        )
    return out


def weight_share(graph: OpGraph, backward_factor: float) -> float:
    """The weight gradients' share of `graph`'s backward FLOPs (the split of Qi et al., Zero
    Bubble Pipeline Parallelism, arXiv 2401.10241) (backward_factor x its
    forward's): an op with weights whose cost is FLOPs (a linear, convolution, LSTM cell,
    mixture of experts' router and experts) computes its weight gradient as one GEMM of its
    forward's size (dW = X^T dY beside dX = dY W^T: half a linear's backward); attention's
    scores and the byte-bound ops (norms' and embeddings' parameters among them) none.
    0.5 (a linear's) for a graph without FLOPs."""
    total = sum(max(op.flops, 0.0) for op in graph.ops)
    if total <= 0 or backward_factor <= 0:
        return 0.5
    weights = sum(
        max(op.flops, 0.0)
        for op in graph.ops
        if op.params and kind_spec(op.kind).compute == "flops"
    )
    return min(1.0, weights / (backward_factor * total))


class ChunkCache:
    """Chunk simulations kept across `chunk_times` calls, by `chunk_key` and cost options,
    the `size` most recent (thread-safe). The layouts a search simulates one after another
    share most chunks (blocks per stage [31, 32, 32, 31] and [32, 32, 31, 31] both hold a
    middle stage of 32 blocks, seconds to simulate); equal keys, equal simulations
    (`chunk_key`). Analytic costs only: a measured cost model is never cached."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._kept: OrderedDict[tuple[Any, ...], tuple[float, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def simulated(
        self, cost_model: CostModel, ch: Chunk, key: tuple[str, ...], deadline: float = math.inf
    ) -> tuple[float, ...]:
        """`simulate_chunk`'s numbers for `ch`, whose `chunk_key` is `key` (OutOfTime past a
        finite `deadline`: nothing kept)."""
        if cost_model.measured is not None:
            return simulate_chunk(cost_model.options, cost_model.measured, ch, deadline)
        full = (key, cost_model.options)
        with self._lock:
            found = self._kept.get(full)
            if found is not None:
                self._kept.move_to_end(full)
                return found
        found = simulate_chunk(cost_model.options, None, ch, deadline)
        with self._lock:
            self._kept[full] = found
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
        return found


def simulate_chunk(
    options: CostOptions, measured: Any, ch: Chunk, deadline: float = math.inf
) -> tuple[float, float, float, float, float, float]:
    """(forward, backward, sync seconds; kept, fixed and working bytes: the largest on a
    device of its group) of one micro-batch on a chunk; fixed holds the working set too.
    With a finite `deadline` (a perf_counter value), OutOfTime past it or at a stop request
    (`Simulator`'s looks at the clock: between ops and edges, and while timing)."""
    cm = CostModel(ch.graph, ch.devices, options, measured=measured)
    sim = Simulator(cm, ch.configs, deadline)
    forward, backward = sim.phase_ends()
    params, kept, working = cm.memory_parts(ch.configs)
    return (
        forward,
        backward - forward,
        sim.makespan - backward,
        float(np.max(kept)),
        float(np.max(params + working)),
        float(np.max(working)),
    )


_QUOTED = re.compile(r"'[^']*'")
_BLOCK_INDEX = re.compile(r"\.(\d+)(?=\.|'|$)")


def chunk_key(ch: Chunk) -> tuple[str, ...]:
    """What a chunk's simulation depends on, with block numbers made relative to the chunk's
    first block (`transformer.h.7.mlp` in a chunk from block 6 on reads `h.+1.mlp`) and the
    group's devices by position: equal keys, equal simulations."""
    found = [block_of(op.name) for op in ch.graph.ops if op.kind != "input"]
    indices = [int(b[0].rsplit(".", 1)[1]) for b in found if b is not None]
    base = min(indices, default=0)

    def relative(match: re.Match[str]) -> str:
        return _BLOCK_INDEX.sub(lambda m: f".{int(m.group(1)) - base:+d}", match.group(0), count=1)

    ops = _QUOTED.sub(relative, repr(ch.graph.ops))
    return (ops, repr(ch.configs), group_key(ch.devices))


def group_key(devices: DeviceGraph) -> str:
    """A device graph up to its names: each device's figures and host by first appearance,
    each link's figures and ends (a device by position; a switch numbered in the order it is
    reached from the devices, breadth first over links sorted by what is already numbered)."""
    hosts: dict[str, int] = {}
    parts = [
        repr((d.kind, d.flops, d.mem_bandwidth, d.memory, d.message_overhead, d.flops16,
              d.flops_tf32, d.flops64, d.efficiency, d.flops8,
              hosts.setdefault(d.host, len(hosts))))
        for d in devices.devices
    ]  # fmt: skip
    name = {d.name: f"d{k:06d}" for k, d in enumerate(devices.devices)}
    links = list(devices.links)
    while True:
        reached = sorted(
            (name[known], str(link.bandwidth), str(link.latency), k, other)
            for k, link in enumerate(links)
            for known, other in ((link.a, link.b), (link.b, link.a))
            if known in name and other not in name
        )
        if not reached:
            break
        for *_, other in reached:
            name.setdefault(other, f"s{len(name):06d}")
    parts += sorted(
        repr(
            (*sorted((name.get(link.a, "?"), name.get(link.b, "?"))), link.bandwidth, link.latency)
        )
        for link in links
    )
    return "|".join(parts)


def simulate_pipelined(
    cost_model: CostModel, ps: PipelinedStrategy, deadline: float = math.inf
) -> PipelineTimeline:
    """The step of a pipelined strategy: the schedule's timeline of its chunks' micro-batch
    costs. `cost_model` is the micro-batch graph's on every device (the strategy's own).
    With "dualpipe" the copy of chunk c on group p - 1 - c and its messages are timed as
    chunk c's on group c: the two groups must be alike (`group_key`). OutOfTime past a
    finite `deadline` (a perf_counter value) or at a stop request."""
    pipe = ps.pipeline
    if pipe.schedule == DUALPIPE:
        devices = cost_model.devices
        for g in range(pipe.stages // 2):
            mirror = pipe.stages - 1 - g
            a, b = (group_key(devices.subset(pipe.groups[k])) for k in (g, mirror))
            if a != b:
                raise PipelineError(
                    f"dualpipe runs stage {g}'s copy on stage {mirror}'s devices and times it "
                    f"as on stage {g}'s, but the two groups' devices or links differ: use "
                    f"alike groups (the same devices and links) or another schedule"
                )
    return simulate_pipeline(
        chunk_times(cost_model, ps, deadline=deadline),
        pipe.schedule,
        pipe.stages,
        pipe.micro_batches,
        cost_model.options.pp_overlap,
        cost_model.options.chunk_sync_share,
    )
