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
- **messages**: each tensor it sends to a later chunk goes task by task from the producer's
  devices to the same positions in the receiving group (`DeviceGraph.transfer_time`, the
  tasks at once: their slowest), and its gradient comes back the same way;
- **memory per device**: its parameters' training state and the recomputation's working
  set once, and its kept activations per micro-batch in flight (`CostModel.memory_parts`).

`simulate_pipelined` feeds these to `planner.pipeline.timeline.simulate_pipeline`.

Not modelled: messages that skip a chunk (a tensor read two chunks later) are timed as
sent at the end of the producer's chunk with that chunk's message; the all-reduce of an
embedding tied across the first and last stage (Megatron-LM's) is left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel
from planner.graph.opgraph import Op, OpGraph
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


def chunk_problem(cost_model: CostModel, ps: PipelinedStrategy, c: int) -> Chunk:
    """Chunk c's graph (its ops and an input op per tensor from an earlier chunk), its
    group's devices and the configs on them."""
    pipe, graph = ps.pipeline, ps.strategy.graph
    configs = ps.strategy.configs
    group = pipe.group_of(c)
    local = {d: k for k, d in enumerate(group)}
    ops: list[Op] = []
    cfgs: list[ParallelConfig] = []
    outside: set[int] = set()
    for i in pipe.chunk_ops(c):
        for name in graph.ops[i].inputs:
            j = graph.index(name)
            if j < pipe.bounds[c] and j not in outside:
                outside.add(j)
                src = graph.ops[j]
                ops.append(Op(src.name, "input", (), src.output))
                cfgs.append(_landed(src, configs[j], pipe.group_of(pipe.chunk_of(j)), group))
    for i in pipe.chunk_ops(c):
        cfg = configs[i]
        ops.append(graph.ops[i])
        cfgs.append(dataclasses.replace(cfg, devices=tuple(local[d] for d in cfg.devices)))
    sub = OpGraph(f"{graph.name}[chunk {c}]", tuple(ops))
    order = {op.name: k for k, op in enumerate(ops)}
    configs_sorted = tuple(cfgs[order[op.name]] for op in sub.ops)  # OpGraph re-sorts
    devices = cost_model.devices.subset(
        group, f"{cost_model.devices.name}[stage {c % pipe.stages}]"
    )
    return Chunk(sub, devices, configs_sorted, group)


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


def chunk_times(cost_model: CostModel, ps: PipelinedStrategy) -> list[ChunkTimes]:
    """Every chunk's `ChunkTimes` (see the module's docstring)."""
    pipe = ps.pipeline
    out = []
    sends = message_seconds(cost_model, ps)
    for c in range(pipe.chunks):
        ch = chunk_problem(cost_model, ps, c)
        cm = CostModel(ch.graph, ch.devices, cost_model.options, measured=cost_model.measured)
        sim = Simulator(cm, ch.configs)
        forward, backward = sim.phase_ends()
        step = sim.makespan
        params, kept, working = cm.memory_parts(ch.configs)
        out.append(
            ChunkTimes(
                forward=forward,
                backward=backward - forward,
                send_forward=sends[c] if c < pipe.chunks - 1 else 0.0,
                send_backward=sends[c - 1] if c > 0 else 0.0,
                sync=step - backward,
                activation_bytes=float(np.max(kept)),
                fixed_bytes=float(np.max(params + working)),
            )
        )
    return out


def simulate_pipelined(cost_model: CostModel, ps: PipelinedStrategy) -> PipelineTimeline:
    """The step of a pipelined strategy: the schedule's timeline of its chunks' micro-batch
    costs. `cost_model` is the micro-batch graph's on every device (the strategy's own)."""
    pipe = ps.pipeline
    return simulate_pipeline(
        chunk_times(cost_model, ps), pipe.schedule, pipe.stages, pipe.micro_batches
    )
