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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.memory import param_bytes
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.pipeline.layouts import block_ranges
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
    first: Unit
    middle: Unit
    last: Unit
    message: float  # seconds to send the residual stream to the next group (and its gradient)
    blocking: float = 0.0  # share of a message its sender waits for (1 - CostOptions.pp_overlap)
    grad_overlap: float = 1.0  # share of a chunk's sync ready at its last backward

    def chunk(self, index: int, count: int, blocks: int) -> ChunkTimes:
        """Chunk `index` of `count`, holding `blocks` blocks, composed."""
        parts = [self.middle] * blocks
        if index == 0:
            parts[0] = self.first
        if index == count - 1:
            parts[-1] = self.last if blocks > 1 or index > 0 else _merge(self.first, self.last)
        tail = parts[-1].sync + (blocks - 1) * max(0.0, self.middle.sync - self.middle.backward)
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
    many; only the gradient sync differs, and it is scaled by the ring all-reduce's
    2 (r - 1) / r (ZeRO's collectives are not: simulate every replica with ZeRO).

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
    return composed_units(measured, graph, group.num_devices // tensor, replicas, options, message)


def unit_ranges(graph: OpGraph) -> dict[str, range]:
    """The op ranges of the three units: `first` (the ops before block 1), `middle` (block
    1) and `last` (the last block and what follows it)."""
    blocks = block_ranges(graph)
    n = len(graph.ops)
    first_end = blocks[1][0]
    last_start = blocks[-1][0] if len(blocks) > 2 else blocks[1][0]
    return {
        "first": range(0, first_end),
        "middle": range(blocks[1][0], blocks[1][1]),
        "last": range(last_start, n),
    }


def composed_units(
    measured: dict[str, tuple[float, ...]],
    graph: OpGraph,
    here: int,
    replicas: int | None,
    options: CostOptions,
    message: float,
) -> Units:
    """The units from each range's measured (forward, backward, sync, kept, fixed, working)
    on `here` replicas, the sync and parameter bytes scaled to `replicas`."""
    units = {}
    for key, (forward, backward, sync, kept, fixed, working) in measured.items():
        params = fixed - working
        if replicas is not None and replicas > here:
            sync *= ring_factor(replicas) / ring_factor(here) if here > 1 else 1.0
            params *= zero_factor(graph, options, replicas) / zero_factor(graph, options, here)
        units[key] = Unit(forward, backward, sync, kept, params, working)
    return Units(
        units["first"],
        units["middle"],
        units["last"],
        message,
        1 - options.pp_overlap,
        options.chunk_sync_share,
    )


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


def zero_factor(graph: OpGraph, options: CostOptions, replicas: int) -> float:
    """A device's parameter bytes at `options.zero` over `replicas` data-parallel copies, per
    byte unsharded (1.0 at ZeRO 0; with Adam, master weights and ZeRO 1 over r: (4 + 12 / r)
    / 16)."""
    if not options.zero:
        return 1.0
    key = (id(graph), repr(options), replicas)
    found = _FACTORS.get(key)
    if found is not None and found[0] is graph:
        return found[1]
    total = [param_bytes(op.params, options.optimizer, options.master_weights) for op in graph.ops]
    whole = sum(b.total for b in total)
    held = sum(b.held(replicas, options.zero) for b in total)
    factor = held / whole if whole else 1.0
    if len(_FACTORS) >= _FACTORS_KEPT:
        _FACTORS.clear()
    _FACTORS[key] = (graph, factor)
    return factor


# The factors computed last, by graph (checked by identity: an id may be reused): the
# pipeline search asks for each of its stage layouts, and a 1,000-op graph takes milliseconds.
_FACTORS: dict[tuple[int, str, int], tuple[OpGraph, float]] = {}
_FACTORS_KEPT = 256


def parameter_state(graph: OpGraph, options: CostOptions) -> float:
    """Bytes of every parameter's training state (weights, gradients, optimizer state and
    master copies), unsharded."""
    return float(
        sum(
            param_bytes(op.params, options.optimizer, options.master_weights).total
            for op in graph.ops
        )
    )


def compute_bound(graph: OpGraph, devices: DeviceGraph, options: CostOptions) -> float:
    """A lower bound on the step of any layout of the full-batch `graph` on `devices`: every
    op's forward and backward on one device of the fastest kind, summed, over the devices
    (splitting an op never makes its work smaller in the cost model; no recomputation, no
    transfer, no sync)."""
    from planner.costs.config import ParallelConfig

    fastest = max(range(devices.num_devices), key=lambda i: devices.devices[i].flops)
    one = devices.subset([fastest], f"{devices.name}[1]")
    cm = CostModel(graph, one, dataclasses.replace(options, recompute="none"))
    total = 0.0
    for i, op in enumerate(graph.ops):
        cfg = ParallelConfig(tuple(1 for _ in op.output.dims), (0,))
        total += cm.compute_time(i, cfg)
    return total / devices.num_devices if math.isfinite(total) else 0.0
