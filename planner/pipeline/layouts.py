"""Pipelined layouts built by rule: the stages of Megatron-LM and of the searches' answers.

`block_bounds(graph, chunks, blocks)` cuts a model at its numbered blocks
(`transformer.h.3`, `layers.3`: `planner.costs.recompute.block_of`) into chunks of equally
many blocks, or of the blocks given per chunk, the ops before the first block (embeddings)
in the first chunk and those after the last (the final norm, the head, the loss) in the
last, as Megatron-LM assigns layers to stages. `stage_blocks(total, stages, first, last)`
gives the blocks per stage of Megatron-LM's uneven pipelines: `first` blocks on the first
stage, `last` on the last (its `--decoder-first-pipeline-num-layers` and
`--decoder-last-pipeline-num-layers`; Megatron-Bridge's `num_layers_in_first_pipeline_stage`
and `num_layers_in_last_pipeline_stage`), the rest shared equally by the stages between:
126 layers over 16 stages as 7, 8 x 14, 7.
`stage_groups(devices, stages)` gives stage s the s-th run of consecutive devices (Megatron-
LM's rank order: tensor parallelism innermost, then data, then pipeline). `pipelined`
applies a per-stage rule (e.g. `planner.problems.baselines.megatron`) to every chunk on
its group.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

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
    while end < len(graph.ops) and _block_name(graph.ops[end].name) == (last and last[0]):
        end += 1
    return [(a, b) for a, b in zip(starts, [*starts[1:], end], strict=True)]


def _block_name(name: str) -> str | None:
    """The numbered block an op's module path is in (`block_of`'s block), or None."""
    found = block_of(name)
    return None if found is None else found[0]


def repeated_blocks(graph: OpGraph) -> bool:
    """Whether `graph` is a stack of at least two numbered blocks that are the same layer
    repeated, as a transformer's are, or of two such layers one run after the other (a
    mixture of experts' stack whose first layers are dense: DeepSeek-V3's 3 dense blocks,
    then 58 MoE blocks; `block_kinds`): what the pipeline search can cut, costing one block
    of each kind for all (`backends.pipeline.units`). A CNN's `features.3` or a ResNet's
    `layer2.1` are numbered but not alike."""
    try:
        kinds = block_kinds(graph)
    except PipelineError:
        return False
    if len(kinds) < 2 or max(kinds) > 1:
        return False
    return list(kinds) == sorted(kinds)  # one kind, or a run of one kind and a run of another


def block_kinds(graph: OpGraph) -> tuple[int, ...]:
    """Per numbered block, its kind: blocks alike (the same op names within the block, kinds,
    output shapes and parameter shapes, in the same order) share one, numbered by first
    appearance (a transformer's blocks are all 0; DeepSeek-V3's 0, 0, 0, 1, ..., 1)."""
    starts = block_starts(graph)
    ends = [*starts[1:], len(graph.ops)] if starts else []
    seen: dict[tuple[object, ...], int] = {}
    kinds = []
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
        kinds.append(seen.setdefault(tuple(signature), len(seen)))
    return tuple(kinds)


def block_bounds(
    graph: OpGraph, chunks: int, blocks: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Bounds of `chunks` chunks with equally many blocks each, or `blocks[c]` blocks in
    chunk c (every chunk at least one; they add up to the model's blocks)."""
    starts = block_starts(graph)
    if not starts:
        raise PipelineError(
            f"{graph.name!r} has no numbered blocks (e.g. 'layers.3') to cut into pipeline chunks"
        )
    if blocks is None:
        if len(starts) % chunks:
            raise PipelineError(
                f"{graph.name!r} has {len(starts)} blocks, which do not cut into {chunks} "
                f"pipeline chunks of equally many: use a chunk count that divides "
                f"{len(starts)}, or give the blocks per chunk (or of the first and last stage)"
            )
        blocks = [len(starts) // chunks] * chunks
    _check_blocks(graph, list(blocks), chunks, len(starts))
    firsts = list(itertools.accumulate(blocks))[:-1]
    return (0, *(starts[k] for k in firsts), len(graph.ops))


def _check_blocks(graph: OpGraph, blocks: list[int], chunks: int, total: int) -> None:
    """One line when `blocks` are not `chunks` counts >= 1 that add up to `total`."""
    if len(blocks) != chunks or any(
        not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in blocks
    ):
        raise PipelineError(
            f"blocks per chunk must be {chunks} whole numbers >= 1 (one per chunk), got {blocks}"
        )
    if sum(blocks) != total:
        raise PipelineError(
            f"the blocks per chunk {blocks} add up to {sum(blocks)}, but {graph.name!r} has "
            f"{total} blocks: give counts that add up to {total}"
        )


def stage_blocks(
    total: int, stages: int, first: int | None = None, last: int | None = None
) -> tuple[int, ...]:
    """Blocks per stage, Megatron-LM's way: `first` on the first stage and `last` on the
    last (None: no count of its own), the rest shared equally by the other stages (which
    they must divide, as Megatron-LM requires). `stage_blocks(126, 16, 7, 7)`: 7, 8 x 14, 7."""
    given = {"first": first, "last": last}
    for what, count in given.items():
        if count is not None and (
            not isinstance(count, int) or isinstance(count, bool) or not 1 <= count < total
        ):
            raise PipelineError(
                f"the {what} stage's blocks must be a whole number from 1 to {total - 1} (of "
                f"{total}), got {count!r}"
            )
    if stages < 1 or (stages == 1 and (first, last) != (None, None)):
        raise PipelineError(
            f"a pipeline of {stages} stage{'s' if stages != 1 else ''} has no first and last "
            f"stage of their own: give their blocks with 2 stages or more"
        )
    fixed = [c for c in (first, last) if c is not None]
    if stages == 2 and len(fixed) == 2 and sum(fixed) != total:
        raise PipelineError(
            f"2 stages of {first} and {last} blocks hold {sum(fixed)} of the {total} blocks: "
            f"give counts that add up to {total}"
        )
    rest, others = total - sum(fixed), stages - len(fixed)
    if others and (rest < others or rest % others):
        left = (
            f"the {rest} blocks left after the first and last stage's"
            if fixed
            else (f"{rest} blocks")
        )
        raise PipelineError(
            f"{left} do not share equally over {others} stages: {_suggestion(total, stages)}"
        )
    share = rest // others if others else 0
    counts = [share] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return tuple(counts)


def _suggestion(total: int, stages: int) -> str:
    """What to give instead: first and last stage counts c, as near an equal share as can
    be, that leave the stages between a multiple of theirs."""
    if stages == 2:
        return f"give the first and last stage's blocks, e.g. {total // 2} and {total - total // 2}"
    share = round(total / stages)
    for c in sorted(range(1, total), key=lambda c: (abs(c - share), -c)):
        if (total - 2 * c) >= stages - 2 and (total - 2 * c) % (stages - 2) == 0:
            middle = (total - 2 * c) // (stages - 2)
            return (
                f"give the first and last stage {c} blocks each ({middle} on each of the "
                f"{stages - 2} between)"
            )
    return f"give blocks per stage that add up to {total}"


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
    blocks: Sequence[int] | None = None,
    first: int | None = None,
    last: int | None = None,
) -> PipelinedStrategy:
    """`graph` (one micro-batch's) in `stages` x `virtual` chunks by blocks on consecutive
    device groups, each op configured by `rule` as if the whole graph ran on one group.
    Chunks of equally many blocks, or `blocks` per chunk, or (one chunk per stage) `first`
    blocks on the first stage and `last` on the last, the rest shared equally
    (`stage_blocks`)."""
    groups = stage_groups(devices, stages)
    if first is not None or last is not None:
        if blocks is not None or virtual != 1:
            raise PipelineError(
                "the blocks of the first and last stage set one chunk per stage: give "
                "either them or the blocks per chunk, with virtual 1"
            )
        blocks = stage_blocks(len(block_starts(graph)), stages, first, last)
    bounds = block_bounds(graph, stages * virtual, blocks)
    pipe = Pipeline(bounds, groups, micro_batches, schedule)
    inner = rule(graph, devices.subset(groups[0]))
    configs = []
    for i, cfg in enumerate(inner.configs):
        group = pipe.group_of(pipe.chunk_of(i))
        configs.append(dataclasses.replace(cfg, devices=tuple(group[d] for d in cfg.devices)))
    return PipelinedStrategy(Strategy(graph, devices, tuple(configs)), pipe)
