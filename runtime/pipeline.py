"""Pipelined steps: m micro-batches through chunks of ops on device groups, in a schedule's order.

A `planner.pipeline.PipelinedStrategy` is one micro-batch's strategy (its graph has B / m
samples) and a `Pipeline`: chunk c holds the ops `bounds[c] <= i < bounds[c + 1]` and runs
on device group `c % p`; each group runs the forward ("F") and backward ("B") works of its
chunks in the order `planner.pipeline.schedule.schedule` gives it (GPipe, 1F1B, interleaved).

`PipelineExecutor` is the plain `Executor` of the micro-batch strategy's plan, run one work at
a time instead of one whole pass: a work of micro-batch k on chunk c runs `_forward_op` (or
`_backward_op`) for the chunk's ops only, so inside a chunk every op keeps its config (data
parallelism and tensor splits within the group, partial sums, halos) exactly as in a
plain run. What changes:

- state per micro-batch: the executor's per-pass dicts (outputs, autograd leaves, losses,
  gradients of outputs) belong to a micro-batch; before each work the executor is pointed
  at that micro-batch's (`_use`). A chunk's outputs are freed by its backward; a
  micro-batch's state is dropped after this rank's last backward work of it.
- messages: the same transfers as a plain run (activations into a later chunk, on another
  group, are ordinary transfers whose consumer runs later), with tags offset per
  micro-batch (`Executor.tag_base`: k * 2 * plan.backward_offset), so the messages of
  several micro-batches in flight between two ranks never match each other's receives. A
  work posts the receives of its chunk's ops when it starts; sends are non-blocking. A
  work blocks only on messages of works that precede it in the schedule's dependency order
  (the forward of the same micro-batch on an earlier chunk, the backward on a later one):
  every group runs the same order on all its ranks, so the exchange is deadlock-free
  whenever the schedule is (`planner.pipeline.timeline` runs each schedule to completion).
  A chunk's forward sends are waited for at the end of its backward (they have arrived:
  their consumers sent back the gradients just received), so their buffers go with the
  activations; the rest at the end of the step.
- loss and accumulation: each micro-batch's loss part is divided by the positions of the
  whole batch (`Executor.micro_batches`), so the parts add up to the full-batch mean loss;
  parameter gradients accumulate in the shards' `.grad` over the m micro-batches.
- sync and update once per step: after this rank's last work, every gradient bucket is
  launched in reverse op order (the same order on every member of a sum, whichever groups
  it spans: a tied embedding and head on the first and last stage), then the SGD step.

Not supported: batch norm with m > 1 (its statistics would be per micro-batch, not what the
full batch computes), the ordered exchange (NCCL); refused by `check_pipelined`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.graph.opgraph import OpGraph, Tensor
from planner.graph.opkinds import CHANNEL, SAMPLE, is_batch_norm
from planner.pipeline.schedule import DUALPIPE, FORWARD, Work, schedule
from planner.pipeline.spec import Pipeline
from runtime.executor import SYNC, Executor, Message
from runtime.plan import ExecPlan, RuntimeConfigError

__all__ = ["PipelineExecutor", "check_pipelined", "full_batch_graph"]


def check_pipelined(graph: OpGraph, pipeline: Pipeline, ordered: bool) -> None:
    """Refuse what a pipelined run cannot compute as single-process training does."""
    if pipeline.schedule == DUALPIPE:
        raise RuntimeConfigError(
            "the dualpipe schedule is timed by the planner only: the runtime does not run it "
            "(two copies of each stage, split backwards); run the plan with 1f1b or "
            "interleaved"
        )
    if ordered:
        raise RuntimeConfigError(
            "a pipelined run exchanges messages eagerly (gloo); the ordered exchange that "
            "NCCL needs is not supported for pipelines"
        )
    if pipeline.micro_batches > 1:
        for op in graph.ops:
            if is_batch_norm(op):
                raise RuntimeConfigError(
                    f"op {op.name!r} normalizes with batch statistics: over "
                    f"{pipeline.micro_batches} micro-batches they would be each micro-batch's, "
                    "not the batch's; pipelines with batch norm run with 1 micro-batch only"
                )


def full_batch_graph(graph: OpGraph, micro_batches: int) -> OpGraph:
    """The micro-batch graph with m times its samples: the input and target shapes of the
    whole batch, which the data of a step is drawn with (`runtime.reference.make_inputs`).
    Only the shapes are scaled (FLOPs are not)."""
    if micro_batches == 1:
        return graph
    ops = []
    for op in graph.ops:
        if SAMPLE in op.output.dims:
            shape = tuple((d, s * micro_batches if d == SAMPLE else s) for d, s in op.output.shape)
            op = dataclasses.replace(op, output=Tensor(shape, op.output.dtype_bytes))
        ops.append(op)
    return OpGraph(graph.name, tuple(ops))


def _micro(
    tensors: Sequence[torch.Tensor], dims: Sequence[tuple[str, ...]], k: int, m: int
) -> list[torch.Tensor]:
    """Micro-batch k of m of each full-batch tensor (`dims`: its dimensions): samples
    k B / m ... (k + 1) B / m - 1."""
    out = []
    for x, ds in zip(tensors, dims, strict=True):
        if SAMPLE in ds:
            axis = ds.index(SAMPLE)
            b = x.shape[axis] // m
            x = x.narrow(axis, k * b, b)
        out.append(x)
    return out


@dataclass
class _MicroBatch:
    """One micro-batch's share of the executor's per-pass state on this rank."""

    out: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    leaves: dict[int, list[tuple[int, int, torch.Tensor]]] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    sent: dict[int, list[Message]] = field(default_factory=dict)  # chunk -> forward sends
    backwards: int = 0  # this rank's backward works of it still to run


class PipelineExecutor(Executor):
    """Runs rank `rank`'s works of `pipeline` on the plan of one micro-batch's strategy;
    the other arguments are the `Executor`'s."""

    def __init__(self, pipeline: Pipeline, plan: ExecPlan, rank: int, *args: Any, **kwargs: Any):
        super().__init__(plan, rank, *args, **kwargs)
        check_pipelined(plan.graph, pipeline, self.ordered)
        self.pipeline = pipeline
        self.micro_batches = pipeline.micro_batches
        groups = [g for g, devices in enumerate(pipeline.groups) if rank in devices]
        orders = schedule(pipeline.schedule, pipeline.stages, self.micro_batches, pipeline.virtual)
        self.works: tuple[Work, ...] = orders[groups[0]] if groups else ()
        self.micro_tags = 2 * plan.backward_offset  # tags per micro-batch
        self.states: dict[int, _MicroBatch] = {}
        self.input_dims = [o.op.output.dims for o in plan.ops if o.op.kind == "input"]
        self.target_dims = [
            tuple(d for d in plan.ops[i].op.output.dims if d != CHANNEL) for i in plan.sinks
        ]

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        """This rank's works of the step in schedule order, then gradient sync and SGD;
        returns this rank's part of the loss. `inputs` and `targets` are the whole batch's
        (where this rank needs them): micro-batch k reads its k-th m-th of the samples."""
        m = self.micro_batches
        micro_inputs = [_micro(inputs, self.input_dims, k, m) if inputs else [] for k in range(m)]
        micro_targets = [
            _micro(targets, self.target_dims, k, m) if targets else [] for k in range(m)
        ]
        self.states = {}
        for w in self.works:
            self.states.setdefault(w.micro, _MicroBatch()).backwards += w.kind != FORWARD
        loss, seconds, recomputed = 0.0, {"F": 0.0, "B": 0.0}, 0
        for w in self.works:
            t0, before = time.perf_counter(), self.task_forwards
            self._use(w.micro)
            if w.kind == FORWARD:
                loss += self._forward_chunk(w, micro_inputs[w.micro], micro_targets[w.micro])
            else:
                self._backward_chunk(w)
                recomputed += self.task_forwards - before
            seconds[w.kind] += time.perf_counter() - t0
        # every micro-batch's activations went with its last backward here, every receive
        # posted was consumed by the work that posted it
        assert not self.states and not self.recvs, (list(self.states), list(self.recvs))
        t0 = time.perf_counter()
        self.status.set(self.step_index, SYNC)
        for o in reversed(self.plan.ops):
            self.sync.launch(o.index)
        self._finish_step(seconds["F"], seconds["B"], recomputed, since=t0)
        return loss

    def _use(self, micro: int) -> None:
        """Point the executor's per-pass state and message tags at micro-batch `micro`."""
        state = self.states[micro]
        self.out, self.leaves, self.losses, self.grads = (
            state.out,
            state.leaves,
            state.losses,
            state.grads,
        )
        self.tag_base = micro * self.micro_tags

    def _forward_chunk(
        self, w: Work, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
    ) -> float:
        ops = self.pipeline.chunk_ops(w.chunk)
        self.recvs.update(self._post_recvs(False, ops))
        sent = self.states[w.micro].sent.setdefault(w.chunk, [])
        for i in ops:
            o = self.plan.ops[i]
            n = len(self.sends)
            self._forward_op(o, inputs, targets)
            if o.op.kind != "input":  # data gets no gradient back: waited for at the end
                sent.extend(self.sends[n:])
                del self.sends[n:]
        return sum(float(self.losses[i].detach()) for i in ops if i in self.losses)

    def _backward_chunk(self, w: Work) -> None:
        ops = self.pipeline.chunk_ops(w.chunk)
        self.recvs.update(self._post_recvs(True, ops))
        for i in reversed(ops):
            self._backward_op(self.plan.ops[i])
        state = self.states[w.micro]
        for work, _ in state.sent.pop(w.chunk, ()):
            self._wait(work)
        for i in ops:  # the outputs of input ops (a backward pops the others')
            self.out.pop(i, None)
            self.losses.pop(i, None)
        state.backwards -= 1
        if not state.backwards:
            del self.states[w.micro]
