"""A pipeline over an op graph: chunks of ops, the device groups that run them, micro-batches
and a schedule; and the strategy that adds one config per op (`PipelinedStrategy`).

- `bounds`: chunk c holds the ops `bounds[c] <= i < bounds[c + 1]` of the graph's
  topological order (`OpGraph.ops`), so every chunk is contiguous and the chunks cover the
  graph; an edge may skip chunks forward (a residual into a later chunk), never go back.
- `groups`: the device indices of each of the p stages; chunk c runs on group `c % p`
  (v = chunks / p chunks per group: Megatron-LM's interleaved schedule when v > 1). Groups
  are disjoint.
- `micro_batches`: m; the strategy's graph is one micro-batch's (a global batch of B
  samples is m micro-batches of B / m, each spread over the data-parallel replicas of its
  stage as the configs say): `micro_batch_graph` makes it from a full-batch graph.
- `schedule`: "gpipe", "1f1b", "interleaved" or "dualpipe" (`planner.pipeline.schedule`).
  DualPipe (one chunk per group, p even, groups of equally many devices) also keeps a copy
  of chunk c on group p - 1 - c for the micro-batches fed from the other end, its configs
  at the same positions in that group; `planner.pipeline.stages.simulate_pipelined` times
  the copy as the chunk (the groups must be alike) and counts both copies' memory. It is
  timed only: the pipeline search does not choose it, the runtime and the exports refuse
  it.

In a plan file (docs/strategy.md) the pipeline is the `pipeline` section:
`{"bounds": [...], "groups": [[...], ...], "micro_batches": m, "schedule": "1f1b"}`.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import LayerwiseError, StrategyError, given
from planner.graph.opgraph import OpGraph, Tensor
from planner.graph.opkinds import SAMPLE
from planner.pipeline.schedule import DUALPIPE, check_schedule
from planner.problems.strategy import Strategy, load_strategy, strategy_from_json


class PipelineError(LayerwiseError):
    """A pipeline that does not fit its graph or devices, or a graph that does not split
    into micro-batches."""


class PipelineOutOfTime(PipelineError):
    """The pipeline search found no layout within its time limit and the grace for a first
    answer: not a refusal (no other search is tried instead), raise the time limit."""


@dataclass(frozen=True)
class Pipeline:
    bounds: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    micro_batches: int
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", tuple(int(b) for b in self.bounds))
        object.__setattr__(self, "groups", tuple(tuple(int(d) for d in g) for g in self.groups))
        p = len(self.groups)
        if p < 1:
            raise PipelineError("a pipeline needs at least one stage (device group)")
        if len(self.bounds) < 2 or (len(self.bounds) - 1) % p:
            raise PipelineError(
                f"a pipeline of {p} stages needs a multiple of {p} chunks, got "
                f"{len(self.bounds) - 1} (bounds {list(self.bounds)})"
            )
        if self.bounds[0] != 0 or any(
            a >= b for a, b in zip(self.bounds, self.bounds[1:], strict=False)
        ):
            raise PipelineError(
                f"pipeline bounds must start at 0 and increase (every chunk holds an op), "
                f"got {list(self.bounds)}"
            )
        seen: set[int] = set()
        for k, g in enumerate(self.groups):
            if not g:
                raise PipelineError(f"pipeline stage {k} has no devices")
            if seen & set(g) or len(set(g)) != len(g):
                raise PipelineError(
                    f"pipeline stage {k}'s devices {list(g)} repeat a device of another stage "
                    f"(or their own): stages need disjoint device groups"
                )
            seen |= set(g)
        check_schedule(self.schedule, p, self.micro_batches, self.virtual)
        sizes = sorted({len(g) for g in self.groups})
        if self.schedule == DUALPIPE and len(sizes) > 1:
            raise PipelineError(
                f"dualpipe keeps a copy of stage s on group p - 1 - s laid out as on group s: "
                f"its groups need equally many devices, got {sizes}"
            )

    @property
    def stages(self) -> int:
        """p: the device groups."""
        return len(self.groups)

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def virtual(self) -> int:
        """v: chunks per stage."""
        return self.chunks // self.stages

    def chunk_of(self, i: int) -> int:
        """The chunk that holds op i."""
        for c in range(self.chunks):
            if i < self.bounds[c + 1]:
                return c
        raise PipelineError(f"op {i} is past the pipeline's last bound {self.bounds[-1]}")

    def chunk_ops(self, c: int) -> range:
        return range(self.bounds[c], self.bounds[c + 1])

    def group_of(self, c: int) -> tuple[int, ...]:
        """The devices of chunk c."""
        return self.groups[c % self.stages]

    def check(self, graph: OpGraph, num_devices: int) -> None:
        """One-line errors when the pipeline does not fit `graph` and the devices."""
        if self.bounds[-1] != len(graph.ops):
            raise PipelineError(
                f"the pipeline's chunks cover ops 0-{self.bounds[-1] - 1}, but {graph.name!r} "
                f"has {len(graph.ops)} ops: the last bound must be {len(graph.ops)}"
            )
        bad = [d for g in self.groups for d in g if not 0 <= d < num_devices]
        if bad:
            raise PipelineError(
                f"pipeline devices {bad} are out of range: the devices are 0-{num_devices - 1}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "bounds": list(self.bounds),
            "groups": [list(g) for g in self.groups],
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
        }

    @classmethod
    def from_json(cls, data: Any) -> Pipeline:
        if not isinstance(data, Mapping):
            raise PipelineError(f"a pipeline section must be an object, got {given(data)}")
        missing = [k for k in ("bounds", "groups", "micro_batches") if k not in data]
        if missing:
            raise PipelineError(f"the pipeline section lacks {', '.join(missing)}")
        try:
            return cls(
                tuple(data["bounds"]),
                tuple(tuple(g) for g in data["groups"]),
                data["micro_batches"],
                data.get("schedule", "1f1b"),
            )
        except (TypeError, ValueError) as exc:
            raise PipelineError(f"a malformed pipeline section: {exc}") from None


@dataclass(frozen=True)
class PipelinedStrategy:
    """A strategy for one micro-batch's graph whose ops each run on their chunk's group, and
    the pipeline that runs m micro-batches of it per step."""

    strategy: Strategy
    pipeline: Pipeline

    def __post_init__(self) -> None:
        graph, pipe = self.strategy.graph, self.pipeline
        pipe.check(graph, self.strategy.devices.num_devices)
        for i, (op, cfg) in enumerate(zip(graph.ops, self.strategy.configs, strict=True)):
            c = pipe.chunk_of(i)
            group = set(pipe.group_of(c))
            if not set(cfg.devices) <= group:
                raise StrategyError(
                    f"op {op.name!r} is in pipeline chunk {c} on devices {sorted(group)}, but "
                    f"its config runs on {sorted(set(cfg.devices) - group)} too"
                )
        for e in graph.edges:
            if pipe.chunk_of(e.src) > pipe.chunk_of(e.dst):  # cannot: ops are in order
                raise PipelineError(f"edge {e} goes back across the pipeline")

    def to_json(
        self, model: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The strategy file of the micro-batch strategy (`Strategy.to_json`; `model` is the
        whole batch's, as planned) with the pipeline as its `pipeline` section."""
        return self.strategy.to_json(model, {**(extra or {}), "pipeline": self.pipeline.to_json()})

    def save(self, path: str | Path, **kwargs: Any) -> None:
        Path(path).write_text(json.dumps(self.to_json(**kwargs), indent=1))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PipelinedStrategy:
        """Read a strategy file with a `pipeline` section (one-line errors)."""
        if "pipeline" not in data:
            raise PipelineError("the strategy file has no 'pipeline' section")
        return cls(strategy_from_json(data), Pipeline.from_json(data["pipeline"]))


def load_planned(path: str | Path) -> tuple[Strategy | PipelinedStrategy, dict[str, Any]]:
    """A strategy file's strategy, pipelined when the file has a `pipeline` section, and the
    raw file contents (`planner.problems.strategy.load_strategy` reads the strategy alone)."""
    strategy, data = load_strategy(path)
    if "pipeline" not in data:
        return strategy, data
    return PipelinedStrategy(strategy, Pipeline.from_json(data["pipeline"])), data


def micro_batch_graph(graph: OpGraph, micro_batches: int) -> OpGraph:
    """One micro-batch's graph: every tensor's samples, and its op's FLOPs and bytes moved,
    divided by `micro_batches` (which must divide each op's samples)."""
    if micro_batches == 1:
        return graph
    for op in graph.ops:
        if SAMPLE in op.output.dims and op.output.size(SAMPLE) % micro_batches:
            raise PipelineError(
                f"op {op.name!r} of {graph.name!r} has {op.output.size(SAMPLE)} samples, which "
                f"{micro_batches} micro-batches do not divide: use a batch that the micro-batch "
                f"count divides"
            )
    batch = max(op.output.size(SAMPLE) for op in graph.ops if SAMPLE in op.output.dims)
    return batch_graph(graph, batch // micro_batches)


def batch_graph(graph: OpGraph, samples: int) -> OpGraph:
    """`graph` at a batch of `samples` instead of its own B: every op's samples, FLOPs and
    bytes moved scaled by samples / B (each op's samples times that must be whole)."""
    sizes = {op.output.size(SAMPLE) for op in graph.ops if SAMPLE in op.output.dims}
    batch = max(sizes, default=0)
    if not batch:
        raise PipelineError(f"{graph.name!r} has no sample dimension to resize")
    if samples == batch:
        return graph
    ops = []
    for op in graph.ops:
        if SAMPLE not in op.output.dims:
            ops.append(op)
            continue
        n = op.output.size(SAMPLE)
        if (n * samples) % batch:
            raise PipelineError(
                f"op {op.name!r} of {graph.name!r} has {n} samples of a batch of {batch}: it "
                f"does not scale to a batch of {samples}"
            )
        shape = tuple((d, s * samples // batch if d == SAMPLE else s) for d, s in op.output.shape)
        ops.append(
            dataclasses.replace(
                op,
                output=Tensor(shape, op.output.dtype_bytes),
                flops=op.flops * samples / batch,
                mem_bytes=op.mem_bytes * samples / batch,
            )
        )
    return OpGraph(graph.name, tuple(ops))


def even_bounds(
    graph: OpGraph, chunks: int, blocks: Sequence[tuple[int, int]] | None = None
) -> tuple[int, ...]:
    """Bounds that cut `graph` into `chunks` chunks of about equal FLOPs, at op boundaries
    (or, given `blocks` as (first op, end) ranges, at block boundaries only)."""
    n = len(graph.ops)
    cuts = [b[0] for b in blocks] if blocks else list(range(1, n))
    cuts = sorted({c for c in cuts if 0 < c < n})
    if len(cuts) < chunks - 1:
        raise PipelineError(
            f"{graph.name!r} has {len(cuts) + 1} pieces to cut into {chunks} pipeline chunks"
        )
    flops = [max(op.flops, 0.0) for op in graph.ops]
    total = sum(flops) or 1.0
    prefix = [0.0]
    for f in flops:
        prefix.append(prefix[-1] + f)
    bounds = [0]
    for k in range(1, chunks):
        target = total * k / chunks
        lo = bisect.bisect_right(cuts, bounds[-1])  # after the last cut
        hi = len(cuts) - (chunks - 1 - k)  # leave a cut for each chunk still to come
        bounds.append(min(cuts[lo:hi], key=lambda c: abs(prefix[c] - target)))
    bounds.append(n)
    return tuple(bounds)
