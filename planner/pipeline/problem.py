"""What the pipeline search solves and the points of its space.

`PipelineProblem` is a full-batch model of numbered blocks (`planner.pipeline.layouts.
block_ranges`), the devices and the cost options, checked once where it is made: one
PipelineError line for a model the search cannot cut (fewer than two numbered blocks, no
sample dimension). `Layout` is one point of the space the search explores (docs/pipeline.md,
"The space"): stages, tensor and data degrees, micro-batches, schedule, recomputation, ZeRO
and the blocks per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from planner.costs.costmodel import CostOptions
from planner.errors import given
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import SAMPLE
from planner.hardware.devices import DeviceGraph
from planner.pipeline.layouts import block_ranges
from planner.pipeline.spec import PipelineError

__all__ = ["Layout", "PipelineProblem", "batch_samples"]


@dataclass(frozen=True)
class PipelineProblem:
    """A full-batch `graph` (a model of repeated, numbered blocks: a GPT's `transformer.h.3`)
    to lay out on `devices` under the cost model's `options` (training memory, headroom;
    the search chooses recomputation and ZeRO itself)."""

    graph: OpGraph
    devices: DeviceGraph
    options: CostOptions

    def __post_init__(self) -> None:
        for name, value, kind in (
            ("graph", self.graph, OpGraph),
            ("devices", self.devices, DeviceGraph),
            ("options", self.options, CostOptions),
        ):
            if not isinstance(value, kind):
                raise PipelineError(
                    f"a pipeline problem's {name} must be a {kind.__name__}, got {given(value)}"
                )
        _ = self.blocks, self.samples  # one line for a model the search cannot cut

    @cached_property
    def blocks(self) -> int:
        """The model's numbered blocks (PipelineError for fewer than two)."""
        return len(block_ranges(self.graph))

    @cached_property
    def samples(self) -> int:
        """The batch: samples to split into micro-batches."""
        return batch_samples(self.graph)


def batch_samples(graph: OpGraph) -> int:
    """The most samples an op of `graph` has (its batch); PipelineError without any."""
    sizes = [op.output.size(SAMPLE) for op in graph.ops if SAMPLE in op.output.dims]
    if not sizes:
        raise PipelineError(f"{graph.name!r} has no sample dimension to split into micro-batches")
    return max(sizes)


@dataclass(frozen=True, order=True)
class Layout:
    """One point of the pipeline search's space."""

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
    context: int = 1  # context-parallel degree: the sequence split over that many tensor groups
    expert: int = 1  # expert-parallel degree: a moe op's experts over that many token boxes

    def describe(self) -> str:
        """One line: 'PP 2 x TP 4 x DP 2, 8 micro-batches of 1 per replica, 1f1b, ...'
        ('x CP c' after TP with context parallelism; ', EP e' after DP with expert
        parallelism, whose groups fold into a stage's TP x CP x DP ranks)."""
        sched = self.schedule if self.virtual == 1 else f"{self.schedule} v={self.virtual}"
        zero = f", ZeRO {self.zero}" if self.zero else ""
        cp = f" x CP {self.context}" if self.context > 1 else ""
        ep = f", EP {self.expert}" if self.expert > 1 else ""
        return (
            f"PP {self.stages} x TP {self.tensor}{cp} x DP {self.data}{ep}, {self.micro_batches} "
            f"micro-batches of {self.micro_batch} per replica, {sched}, recompute "
            f"{self.recompute}{zero}, {self._blocks()}"
            + (", stages laid out by the per-op search" if self.inner == "search" else "")
        )

    def _blocks(self) -> str:
        per = "chunk" if self.virtual > 1 else "stage"
        if len(set(self.blocks)) == 1:
            k = self.blocks[0]
            return f"{k} block{'s' if k != 1 else ''} per {per}"
        return f"blocks per {per} {list(self.blocks)}"
