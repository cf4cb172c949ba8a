"""Pipelined layouts built by rule: the stages of Megatron-LM and of the searches' answers.

`block_bounds(graph, chunks)` cuts a model at its numbered blocks (`transformer.h.3`,
`layers.3`: `planner.costs.recompute.block_of`) into chunks of equally many blocks, the
ops before the first block (embeddings) in the first chunk and those after the last (the
final norm, the head, the loss) in the last, as Megatron-LM assigns layers to stages.
`stage_groups(devices, stages)` gives stage s the s-th run of consecutive devices (Megatron-
LM's rank order: tensor parallelism innermost, then data, then pipeline). `pipelined`
applies a per-stage rule (e.g. `planner.problems.baselines.megatron`) to every chunk on
its group.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.costs.recompute import block_of
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.pipeline.spec import Pipeline, PipelinedStrategy, PipelineError
from planner.problems.strategy import Strategy


def block_starts(graph: OpGraph) -> list[int]:
    """The first op of each numbered block, in graph order (blocks must be contiguous)."""
    starts: list[int] = []
    seen: dict[str, int] = {}
    last = None
    for i, op in enumerate(graph.ops):
        found = block_of(op.name)
        name = found[0] if found else None
        if name is not None and name != last:
            if name in seen:
                raise PipelineError(
                    f"block {name!r} of {graph.name!r} is not contiguous in the graph's order "
                    f"(ops {seen[name]} and {i}): it cannot be cut into pipeline chunks by blocks"
                )
            seen[name] = i
            starts.append(i)
        if name is not None:
            last = name
    return starts


def block_ranges(graph: OpGraph) -> list[tuple[int, int]]:
    """(first op, end) of each numbered block; the ops after the last block are not in it.
    PipelineError for fewer than two blocks: a pipeline search needs repeated blocks."""
    starts = block_starts(graph)
    if len(starts) < 2:
        raise PipelineError(
            f"{graph.name!r} has {len(starts)} numbered blocks (e.g. 'layers.3'): a pipeline "
            f"search needs a model of repeated blocks"
        )
    last = block_of(graph.ops[starts[-1]].name)
    end = starts[-1]
    while end < len(graph.ops) and block_of(graph.ops[end].name) == last:
        end += 1
    return [(a, b) for a, b in zip(starts, [*starts[1:], end], strict=True)]


def repeated_blocks(graph: OpGraph) -> bool:
    """Whether `graph` is a stack of at least two numbered blocks that are the same layer
    repeated (every block's ops: the same names within the block, kinds, output shapes and
    parameter shapes, in the same order), as a transformer's are: what the pipeline search
    can cut, costing one block for all (`backends.pipeline.units`). A CNN's `features.3` or
    a ResNet's `layer2.1` are numbered but not alike."""
    try:
        starts = block_starts(graph)
    except PipelineError:
        return False
    if len(starts) < 2:
        return False
    ends = [*starts[1:], len(graph.ops)]
    first = None
    for a, b in zip(starts, ends, strict=True):
        found = block_of(graph.ops[a].name)
        assert found is not None
        signature = []
        for op in graph.ops[a:b]:
            here = block_of(op.name)
            if here is None or here[0] != found[0]:
                continue  # an op after the last block (or between blocks): not its own
            params = tuple(p.shape for p in op.params)
            signature.append((here[1], op.kind, op.output.shape, params))
        if first is None:
            first = signature
        elif signature != first:
            return False
    return True


def block_bounds(graph: OpGraph, chunks: int) -> tuple[int, ...]:
    """Bounds of `chunks` chunks with equally many blocks each."""
    starts = block_starts(graph)
    if not starts:
        raise PipelineError(
            f"{graph.name!r} has no numbered blocks (e.g. 'layers.3') to cut into pipeline chunks"
        )
    if len(starts) % chunks:
        raise PipelineError(
            f"{graph.name!r} has {len(starts)} blocks, which do not cut into {chunks} pipeline "
            f"chunks of equally many: use a chunk count that divides {len(starts)}"
        )
    per = len(starts) // chunks
    return (0, *(starts[k * per] for k in range(1, chunks)), len(graph.ops))


def stage_groups(devices: DeviceGraph, stages: int) -> tuple[tuple[int, ...], ...]:
    n = devices.num_devices
    if stages < 1 or n % stages:
        raise PipelineError(
            f"{stages} pipeline stages do not split the {n} devices of {devices.name} evenly"
        )
    size = n // stages
    return tuple(tuple(range(s * size, (s + 1) * size)) for s in range(stages))


def pipelined(
    graph: OpGraph,
    devices: DeviceGraph,
    stages: int,
    micro_batches: int,
    rule: Callable[[OpGraph, DeviceGraph], Strategy],
    schedule: str = "1f1b",
    virtual: int = 1,
) -> PipelinedStrategy:
    """`graph` (one micro-batch's) in `stages` x `virtual` chunks by blocks on consecutive
    device groups, each op configured by `rule` as if the whole graph ran on one group."""
    groups = stage_groups(devices, stages)
    pipe = Pipeline(block_bounds(graph, stages * virtual), groups, micro_batches, schedule)
    inner = rule(graph, devices.subset(groups[0]))
    configs = []
    for i, cfg in enumerate(inner.configs):
        group = pipe.group_of(pipe.chunk_of(i))
        configs.append(type(cfg)(cfg.degrees, tuple(group[d] for d in cfg.devices), cfg.reduce))
    return PipelinedStrategy(Strategy(graph, devices, tuple(configs)), pipe)
