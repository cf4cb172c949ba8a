"""Per-block costs of a layout: the simulated micro-batch of one block, composed into chunks.

For a transformer (numbered blocks, `planner.pipeline.layouts.block_starts`) laid out at
tensor degree t over a group of g devices by Megatron-LM's rule (`planner.problems.baselines.
megatron`) or by the per-op search (`backends.pipeline.inner`), three op ranges are
simulated once each with FlexFlow's simulator, as a pipeline
chunk would be (`planner.pipeline.stages.range_problem`): `first` (the ops before block 1:
the embeddings and block 0), `middle` (block 1) and `last` (the last block and what follows:
the final norm, the head, the loss). A chunk of k blocks is then composed: the first chunk
`first` + (k - 1) `middle`, the last (k - 1) `middle` + `last`, others k `middle`; times and
kept activations add, parameters add, the recomputation's working set (one block's) does
not. The gradient sync left after a chunk's last backward grows by (k - 1) x what a block's
sync exceeds its backward (a ring all-reduce per block overlapping the next block's
backward). The overlap options (`planner.costs.overlap`) enter through the simulated units
(tensor-parallel and data-parallel overlap, ZeRO's hidden all-gathers) and, for the pipeline's
messages, through `Units.blocking`: a blocking send's seconds are its sender's, and for
the chunks' syncs through `Units.grad_overlap` (`backends.pipeline.candidates.sync_tail`).
These are estimates for ranking layouts: the search simulates its best ones exactly
(`planner.pipeline.stages.simulate_pipelined`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.experts import cuts_experts, param_classes
from planner.costs.memory import ParamBytes, param_bytes
from planner.graph.moe import is_routed, moe_spec
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import parameter_dims
from planner.hardware.devices import DeviceGraph
from planner.pipeline.layouts import block_kinds, block_ranges
from planner.pipeline.stages import Chunk, range_problem, simulate_chunk
from planner.pipeline.timeline import ChunkTimes
from planner.problems.baselines import megatron
from planner.problems.strategy import Strategy

__all__ = ["Unit", "Units", "unit_costs"]


@dataclass(frozen=True)
class Unit:
    """One micro-batch on one op range: seconds and bytes per device of its group."""

    forward: float
    backward: float
    sync: float
    kept: float  # activations kept per micro-batch in flight
    params: float  # parameters and their training state
    working: float  # the recomputation's working set


@dataclass(frozen=True)
class Units:
    """The units of a layout: `first`, `middle` (block 1's) and `last`, and in a stack of
    blocks of two kinds (`planner.pipeline.layouts.block_kinds`) the middle unit of each
    kind (`kinds` per block, `others` by kind)."""

    first: Unit
    middle: Unit
    last: Unit
    message: float  # seconds to send the residual stream to the next group (and its gradient)
    blocking: float = 0.0  # share of a message its sender waits for (1 - CostOptions.pp_overlap)
    grad_overlap: float = 1.0  # share of a chunk's sync ready at its last backward
    kinds: tuple[int, ...] = ()  # per block, its kind (empty: every block alike)
    others: dict[int, Unit] = field(default_factory=dict)  # middle unit by kind

    @property
    def mixed(self) -> bool:
        """Whether blocks differ in kind (a chunk's composition then depends on its blocks)."""
        return len(set(self.kinds)) > 1

    def block(self, j: int) -> Unit:
        """The middle unit of block j's kind."""
        if not self.kinds:
            return self.middle
        return self.others.get(self.kinds[j], self.middle)

    def chunk(self, index: int, count: int, blocks: int, start: int = 0) -> ChunkTimes:
        """Chunk `index` of `count`, holding `blocks` blocks from block `start`, composed."""
        middles = [self.block(start + j) for j in range(blocks)]
        parts = list(middles)
        if index == 0:
            parts[0] = self.first
        if index == count - 1:
            parts[-1] = self.last if blocks > 1 or index > 0 else _merge(self.first, self.last)
        tail = parts[-1].sync + sum(max(0.0, u.sync - u.backward) for u in middles[:-1])
        send_forward = self.message if index < count - 1 else 0.0
        send_backward = self.message if index > 0 else 0.0
        return ChunkTimes(  # a blocking send keeps its sender busy (`planner.costs.overlap`)
            forward=sum(u.forward for u in parts) + self.blocking * send_forward,
            backward=sum(u.backward for u in parts) + self.blocking * send_backward,
            send_forward=send_forward,
            send_backward=send_backward,
            sync=tail,
            activation_bytes=sum(u.kept for u in parts),
            fixed_bytes=sum(u.params for u in parts) + max(u.working for u in parts),
            working_bytes=max(u.working for u in parts),
        )


def _merge(a: Unit, b: Unit) -> Unit:
    """A one-block model's only block is both the first and the last: the larger of each."""
    return Unit(*(max(x, y) for x, y in zip(_fields(a), _fields(b), strict=True)))


def _fields(u: Unit) -> tuple[float, ...]:
    return (u.forward, u.backward, u.sync, u.kept, u.params, u.working)


def unit_costs(
    graph: OpGraph,
    devices: DeviceGraph,
    group: DeviceGraph,
    tensor: int,
    options: CostOptions,
    next_group_offset: int,
    replicas: int | None = None,
    layout: Callable[[OpGraph, DeviceGraph, int], Strategy] = megatron,
    measure: Callable[[CostOptions, Any, Chunk], tuple[float, ...]] = simulate_chunk,
) -> Units:
    """The three units of the micro-batch graph `graph` at tensor degree `tensor` on `group`
    (the first devices of `devices`; the next stage's group starts at device
    `next_group_offset`, where the message goes).

    `replicas`: the stage's real data-parallel degree when `group` holds fewer replicas
    (each with the same samples: `graph` has the group's share of the micro-batch). Every
    replica computes and exchanges within its tensor-parallel group alike, so two stand for
    many (an expert-parallel group spans whole replicas of `group`: the search simulates
    whole groups); only the gradient sync and ZeRO's sharding differ, scaled per parameter
    class from its replicas in `group` to the stage's (`scale_factors`; ZeRO 3's
    all-gathers are not: simulate every replica with ZeRO 3).

    `measure`: how a range's micro-batch is timed, `simulate_chunk` (FlexFlow's simulator)
    or `backends.pipeline.estimate.closed_form_chunk` (the cost model's per-op times)."""
    strategy = layout(graph, group, tensor)
    mine = tuple(range(group.num_devices))
    ranges = unit_ranges(graph)
    measured = {}
    for key, ops in ranges.items():
        ch = range_problem(group, graph, strategy.configs, ops, mine, lambda j: mine)
        measured[key] = measure(options, None, ch)
    message = unit_message(devices, group, graph, strategy, ranges["middle"], next_group_offset)
    here = group.num_devices // tensor
    scales = range_scales(graph, strategy.configs, ranges, options, here, replicas)
    return composed_units(measured, scales, options, message, block_kinds(graph))


def unit_ranges(graph: OpGraph) -> dict[str, range]:
    """The op ranges of the units: `first` (the ops before block 1), `middle` (block 1) and
    `last` (the last block and what follows it); in a stack of blocks of more than one kind
    (`planner.pipeline.layouts.block_kinds`), `middle.k` for each other kind k that a block
    between the first and the last has (its first such block)."""
    blocks = block_ranges(graph)
    n = len(graph.ops)
    first_end = blocks[1][0]
    last_start = blocks[-1][0] if len(blocks) > 2 else blocks[1][0]
    out = {
        "first": range(0, first_end),
        "middle": range(blocks[1][0], blocks[1][1]),
        "last": range(last_start, n),
    }
    kinds = block_kinds(graph)
    for j in range(2, len(blocks) - 1):
        if kinds[j] != kinds[1] and f"middle.{kinds[j]}" not in out:
            out[f"middle.{kinds[j]}"] = range(*blocks[j])
    return out


def composed_units(
    measured: dict[str, tuple[float, ...]],
    scales: dict[str, tuple[float, float]],
    options: CostOptions,
    message: float,
    kinds: tuple[int, ...] = (),
) -> Units:
    """The units from each range's measured (forward, backward, sync, kept, fixed, working)
    on the replicas simulated, its sync and parameter bytes times the range's `scales`
    (`range_scales`: to the stage's real replicas); `kinds`: each block's kind, when the
    ranges hold a `middle.k` per other kind (`unit_ranges`)."""
    units = {}
    for key, (forward, backward, sync, kept, fixed, working) in measured.items():
        sync_scale, param_scale = scales.get(key, (1.0, 1.0))
        params = (fixed - working) * param_scale
        units[key] = Unit(forward, backward, sync * sync_scale, kept, params, working)
    others = {int(key.split(".")[1]): u for key, u in units.items() if key.startswith("middle.")}
    if kinds and len(kinds) > 1:
        others[kinds[1]] = units["middle"]
    return Units(
        units["first"],
        units["middle"],
        units["last"],
        message,
        1 - options.pp_overlap,
        options.chunk_sync_share,
        kinds if len(set(kinds)) > 1 else (),
        others if len(set(kinds)) > 1 else {},
    )


def range_scales(
    graph: OpGraph,
    configs: Sequence[ParallelConfig],
    ranges: dict[str, range],
    options: CostOptions,
    here: int,
    replicas: int | None,
) -> dict[str, tuple[float, float]]:
    """Per op range, `scale_factors` from `here` simulated data-parallel replicas to
    `replicas` (None or no more: no scaling)."""
    if replicas is None or replicas <= here:
        return {key: (1.0, 1.0) for key in ranges}
    return {
        key: scale_factors(graph, configs, ops, options, replicas / here)
        for key, ops in ranges.items()
    }


def scale_factors(
    graph: OpGraph,
    configs: Sequence[ParallelConfig],
    ops: range,
    options: CostOptions,
    scale: float,
) -> tuple[float, float]:
    """(sync, parameter bytes) of op range `ops` laid out by `configs` on some of a stage's
    data-parallel replicas, per second and byte simulated there, when every parameter class
    has `scale` times the replicas it has there (the stage's replicas / those simulated).

    Each class of parameters (`param_class_replicas`: one per op, two for a moe op whose
    experts are spread) syncs over its own replicas r: a dense weight over data x context
    ranks (and the tensor ranks that do not cut it, as a sequence-parallel norm's), a
    routed expert over its expert-data-parallel group (tasks / e). Its ring moves
    2 (r - 1) / r of its shard per device (`ring_factor`), and ZeRO shards its state r
    ways (`ParamBytes.held`); the factors weigh each class by its shard's bytes."""
    sync = [0.0, 0.0]  # scaled, simulated
    held = [0.0, 0.0]
    zero = options.zero
    for i in ops:
        op = graph.ops[i]
        if not op.params:
            continue
        for state, shards, r in param_class_replicas(op, configs[i], options):
            real = max(1, round(r * scale))
            shard = state.weights / shards
            sync[0] += shard * ring_factor(real)
            sync[1] += shard * ring_factor(r)
            held[0] += state.held(real, zero) / shards
            held[1] += state.held(r, zero) / shards
    return (
        sync[0] / sync[1] if sync[1] else 1.0,
        held[0] / held[1] if held[1] else 1.0,
    )


def param_class_replicas(
    op: Op, cfg: ParallelConfig, options: CostOptions
) -> list[tuple[ParamBytes, int, int]]:
    """op's parameters by class under cfg, each (its unsharded training bytes, its shards,
    the replicas of each shard), as the cost model counts them (`CostModel.param_groups`,
    `_param_parts`): one class, or a moe op's router and shared expert (replicated on every
    task) and its routed experts (cut `expert` ways, `expert_replicas`) when cfg spreads
    them, with the shared expert a class of its own when cfg cuts the experts' widths
    (`planner.costs.experts.param_classes`)."""
    opt, master = options.optimizer, options.master_weights
    if not cuts_experts(op, cfg):
        shards = math.prod(cfg.degree(op, d) for d in parameter_dims(op)) * cfg.reduce
        return [(param_bytes(op.params, opt, master), shards, max(1, cfg.num_tasks // shards))]
    out = []
    for params, tasks in param_classes(op, cfg):
        if params:
            shards, r = tasks.shape if tasks.size else (1, cfg.num_tasks)
            out.append((param_bytes(params, opt, master), int(shards), int(r)))
    return out


def unit_message(
    devices: DeviceGraph,
    group: DeviceGraph,
    graph: OpGraph,
    strategy: Strategy,
    middle_ops: range,
    next_group_offset: int,
) -> float:
    """Seconds to send a middle block's input (the residual stream) from `group`'s devices
    to the next stage's, `next_group_offset` devices on (0: no next stage)."""
    if not next_group_offset:
        return 0.0
    mine = tuple(range(group.num_devices))
    middle = range_problem(group, graph, strategy.configs, middle_ops, mine, lambda j: mine)
    message = 0.0
    for op, cfg in zip(middle.graph.ops, middle.configs, strict=True):
        if op.kind != "input":
            continue
        nbytes = op.output.nbytes / max(1, cfg.num_tasks // cfg.reduce)
        message += max(devices.transfer_time(d, d + next_group_offset, nbytes) for d in cfg.devices)
    return message


def ring_factor(replicas: int) -> float:
    """A ring all-reduce's (and ZeRO's reduce-scatter + all-gather's) bytes per byte over
    `replicas`: 2 (r - 1) / r."""
    return 2 * (replicas - 1) / replicas


def parameter_state(graph: OpGraph, options: CostOptions) -> float:
    """Bytes of every parameter's training state (weights, gradients, optimizer state and
    master copies), unsharded."""
    return float(
        sum(
            param_bytes(op.params, options.optimizer, options.master_weights).total
            for op in graph.ops
        )
    )


def routed_state(graph: OpGraph, options: CostOptions) -> float:
    """Of `parameter_state`, the bytes of the mixtures of experts' routed experts (those
    expert parallelism cuts: `planner.graph.moe.is_routed`)."""
    total = 0.0
    for op in graph.ops:
        if op.kind == "moe":
            roles = moe_spec(op).roles
            routed = [p for p, r in zip(op.params, roles, strict=True) if is_routed(r)]
            total += param_bytes(routed, options.optimizer, options.master_weights).total
    return total


def compute_bound(graph: OpGraph, devices: DeviceGraph, options: CostOptions) -> float:
    """A lower bound on the step of any layout of the full-batch `graph` on `devices`: every
    op's forward and backward on one device of the fastest kind, summed, over the devices
    (splitting an op never makes its work smaller in the cost model; no recomputation, no
    transfer, no sync)."""
    fastest = max(range(devices.num_devices), key=lambda i: devices.devices[i].flops)
    one = devices.subset([fastest], f"{devices.name}[1]")
    cm = CostModel(graph, one, dataclasses.replace(options, recompute="none"))
    total = 0.0
    for i, op in enumerate(graph.ops):
        cfg = ParallelConfig(tuple(1 for _ in op.output.dims), (0,))
        total += cm.compute_time(i, cfg)
    return total / devices.num_devices if math.isfinite(total) else 0.0
