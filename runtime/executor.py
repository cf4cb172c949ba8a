"""One rank's share of a training step: its tasks forward and backward, and the transfers.

Every op task is an autograd island: its input boxes are fresh leaves, its output the result
of `planner.costs.kernels.run_task` on them and on the rank's parameter shards. The forward pass
walks the ops in graph order; as soon as a task has computed its output box it sends the
regions that consumer tasks on other ranks need (non-blocking), and a task waits only for the
regions it reads. Receives are posted at the start of each pass. The backward pass walks the
ops in reverse: a task sums the gradient pieces of its output box (from local consumers and
received), back-propagates through its island, and sends each producer the gradient of the
region it sent. Gradient sums and SGD: `runtime.sync.GradientSync`.

With `recompute="full"` (the plan file's `cost.recompute`), the tasks of the ops that
`planner.costs.recompute.recomputed_ops` names run their forward under
`torch.utils.checkpoint.checkpoint` (non-reentrant): the task keeps its inputs and output but
none of the tensors its kernels save, and runs its forward again when its backward needs them.

All ranks visit the ops in the same order and block only on data that an earlier op (in that
order) produces, so the exchange cannot deadlock. Message tags are the transfers' indices
(backward: plus `plan.backward_offset`). With `ordered=True` each edge's messages are instead
exchanged by all its ranks together, in one global order (see `_exchange`).

A pipeline (`runtime.pipeline.PipelineExecutor`) runs the same per-op steps (`_forward_op`,
`_backward_op`) one chunk and micro-batch at a time, in its schedule's order.
"""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from planner.costs.kernels import BN_EPS, TaskPlan, lstm_step, run_task
from planner.costs.recompute import recompute_error, recomputed_ops
from planner.graph.opkinds import CHANNEL
from runtime.experts import GroupExchange
from runtime.plan import ExecPlan, OpExec, RuntimeConfigError, ShardKey, Transfer
from runtime.reference import log_head, nll_part
from runtime.sync import GradientSync, group_sum

__all__ = ["Executor", "Status"]

Box = tuple[tuple[int, int], ...]
Message = tuple[Any, torch.Tensor]  # (work or None, buffer)

# Phases reported in the shared status array (see runtime.launch).
INIT, FORWARD, BACKWARD, SYNC, DONE = 0, 1, 2, 3, 4
PHASES = {INIT: "step setup", FORWARD: "forward", BACKWARD: "backward", SYNC: "sync", DONE: "done"}


class Status:
    """Where a rank is (step, phase, op, waiting), in shared memory the launcher reads to
    name a hung rank. Slots per rank: step, phase, op, waiting, heartbeat."""

    SLOTS = 5

    def __init__(self, array: Any | None, rank: int):
        self.array = array
        self.base = rank * self.SLOTS

    def set(self, step: int, phase: int, op: int = -1) -> None:
        a = self.array
        if a is not None:
            b = self.base
            a[b], a[b + 1], a[b + 2] = step, phase, op
            a[b + 4] += 1

    def waiting(self, flag: bool) -> None:
        if self.array is not None:
            self.array[self.base + 3] = int(flag)
            self.array[self.base + 4] += 1


def _rel(box: Box, base: Box) -> tuple[slice, ...]:
    """Slices of `box` inside a tensor that holds `base` (both absolute)."""
    return tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(box, base, strict=True))


def _shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


class Executor:
    """Runs rank `rank`'s tasks of `plan`; `params` are the full initial parameters."""

    def __init__(
        self,
        plan: ExecPlan,
        rank: int,
        params: dict[str, torch.Tensor],
        lr: float,
        dtype: torch.dtype,
        device: torch.device,
        groups: dict[tuple[str, tuple[int, ...]], Any],
        timeout: float = 60.0,
        status: Status | None = None,
        norm_eps: dict[int, float] | None = None,
        ordered: bool = False,
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        zero: int = 0,
        recompute: str | int = "none",
    ):
        if (error := recompute_error(recompute)) is not None:
            raise RuntimeConfigError(error)
        self.plan = plan
        self.graph = plan.graph
        self.rank = rank
        self.lr = lr
        self.dtype = dtype
        self.device = device
        self.groups = groups
        self.timeout = timedelta(seconds=timeout)
        self.status = status or Status(None, rank)
        self.norm_eps = norm_eps or {}
        self.ordered = ordered
        self.tables = tables or {}  # rotary (cos, sin) of attention ops, by op index
        # the token position at each place of the sequence when it runs permuted (context
        # parallelism's balanced order: `planner.costs.context.sequence_positions`)
        self.positions: torch.Tensor | None = None
        self.task: list[int | None] = [o.task_of(rank) for o in plan.ops]
        self.in_edges: list[list[int]] = [[] for _ in plan.ops]
        for k, e in sorted(enumerate(self.graph.edges), key=lambda ke: ke[1].position):
            self.in_edges[e.dst].append(k)
        self.edge_transfers: dict[int, list[Transfer]] = {}
        for tr in plan.transfers:
            self.edge_transfers.setdefault(tr.edge, []).append(tr)
        self.sync = GradientSync(plan, rank, params, device, dtype, groups, self._wait, zero)
        self.recv_plan = {False: self._recv_plan(False), True: self._recv_plan(True)}
        self.msg_spec = {
            tag: (shape, dtype) for p in self.recv_plan.values() for tag, _, shape, dtype, _ in p
        }
        self.sink_index = {i: k for k, i in enumerate(plan.sinks)}
        self.input_index = {
            o.index: k for k, o in enumerate(o for o in plan.ops if o.op.kind == "input")
        }
        # A pipeline (runtime.pipeline) runs m micro-batches of this plan's graph per step:
        # each loss part is then its share of an m times larger batch, and the messages of
        # micro-batch k have tags offset by tag_base = k * 2 * plan.backward_offset.
        self.micro_batches = 1
        self.tag_base = 0
        rec = recomputed_ops(self.graph, recompute).block
        self.recomputed = frozenset(rec)  # ops whose tasks run their forward again
        self.task_forwards = 0  # kernel forwards run by this rank's tasks (recomputed: twice)
        self.step_index = 0
        self.sends: list[Message] = []
        self.recvs: dict[int, Message] = {}
        self.outbox: dict[int, torch.Tensor] = {}  # ordered mode: gradients waiting to go
        # per step: forward, backward, sync + update seconds, and seconds spent waiting
        self.phase_seconds: list[tuple[float, float, float, float]] = []
        self.recomputed_tasks: list[int] = []  # per step: task forwards run in the backward
        # per step, per moe op under expert parallelism: (token copies this rank sent to each
        # expert, copies each of its own experts computed)
        self.expert_tokens: dict[int, dict[str, tuple[list[int], list[int]]]] = {}
        self.waited = 0.0

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        """Forward, backward, gradient sync and SGD; returns this rank's part of the loss.

        `inputs`: the full input tensors (one per input op, needed on ranks that hold input
        tasks); `targets`: the full targets of each loss op (on ranks that hold loss tasks)."""
        t0 = time.perf_counter()
        loss = self.forward(inputs, targets)
        t1 = time.perf_counter()
        before = self.task_forwards
        self.backward()
        self._finish_step(t1 - t0, time.perf_counter() - t1, self.task_forwards - before)
        return loss

    def _finish_step(
        self, forward: float, backward: float, recomputed: int, since: float | None = None
    ) -> None:
        """Wait for the sends, complete the gradient sums, take the SGD step, and record the
        step's phase seconds (sync + update from `since`, by default now) and the task
        forwards its backward ran again."""
        t = time.perf_counter() if since is None else since
        self.recomputed_tasks.append(recomputed)
        self.status.set(self.step_index, SYNC)
        for work, _ in self.sends:
            self._wait(work)
        self.sends = []
        self.sync.finish_and_update(self.lr)
        self.phase_seconds.append((forward, backward, time.perf_counter() - t, self.waited))
        self.waited = 0.0
        self.step_index += 1

    def shard_state(self) -> dict[ShardKey, torch.Tensor]:
        return self.sync.state()

    # -- forward -------------------------------------------------------------------------------

    def forward(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float:
        self.out: dict[int, tuple[torch.Tensor, ...]] = {}
        self.leaves: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.recvs = {} if self.ordered else self._post_recvs(backward=False)
        for o in self.plan.ops:
            if self.ordered:
                self._exchange(o, backward=False)
            self._forward_op(o, inputs, targets)
        return float(sum(float(v.detach()) for v in self.losses.values()))

    def _forward_op(
        self, o: OpExec, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]
    ) -> None:
        """This rank's task of op o, if any: its output, sent to consumers on other ranks."""
        i, t = o.index, self.task[o.index]
        if t is None:
            return
        self.status.set(self.step_index, FORWARD, i)
        if o.op.kind == "input":
            full = tuple((0, s) for s in o.op.output.sizes)
            x = inputs[self.input_index[i]][_rel(o.plans[t].out_box, full)]
            outs: tuple[torch.Tensor, ...] = (x.to(self.device),)
        else:
            outs = self._forward_task(o, t, targets)
        self.out[i] = outs
        if not self.ordered:
            self._send(self.plan.out_of.get((i, t), ()), outs, o.plans[t].out_box)

    def _forward_task(
        self, o: OpExec, t: int, targets: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        plan = o.plans[t]
        xs: list[torch.Tensor] = []
        slots: list[tuple[int, int, torch.Tensor]] = []  # (input position, component, leaf)
        for pos, k in enumerate(self.in_edges[o.index]):
            comps = 2 if o.op.kind == "lstm" and pos == 1 else 1
            for c in range(comps):
                x = self._gather(k, t, plan.in_boxes[pos], c)
                if x.is_floating_point() and plan.needs_grad(pos):
                    x = x.detach().requires_grad_()
                    slots.append((pos, c, x))
                xs.append(x)
        self.leaves[o.index] = slots
        params = self.sync.params_of(o.index)

        def compute(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
            self.task_forwards += 1
            ins, ps = list(args[: len(xs)]), list(args[len(xs) :])
            if o.op.kind == "lstm":
                return tuple(lstm_step(plan, ins, ps))
            if o.batch_norm:
                return (self._batch_norm_task(o, t, ins, ps),)
            if plan.experts is not None:
                return (run_task(plan, ins, ps, exchange=self._expert_exchange(o, t)),)
            tables = self.tables.get(o.index)
            return (run_task(plan, ins, ps, tables=tables, positions=self.positions),)

        outs: tuple[torch.Tensor, ...]
        with torch.enable_grad():
            if o.index in self.recomputed:
                # keeps the arguments, drops what the kernels save, and runs `compute` again
                # when the task's backward needs it (a batch norm's statistics sums too: every
                # rank of its group recomputes at the same op of the backward pass)
                outs = checkpoint(compute, *xs, *params, use_reentrant=False)
            else:
                outs = compute(*xs, *params)
            sink = self.sink_index.get(o.index)
            if sink is not None:
                self.losses[o.index] = self._loss(o, plan, outs[0], targets[sink])
        return outs

    def _loss(self, o: OpExec, plan: TaskPlan, y: torch.Tensor, target: torch.Tensor) -> Any:
        dims = o.op.output.dims
        box = tuple(r for d, r in zip(dims, plan.out_box, strict=True) if d != CHANNEL)
        tbox = target[tuple(slice(a, b) for a, b in box)].to(self.device)
        count = target.numel() * self.micro_batches  # the positions of the whole batch
        return nll_part(y, tbox, dims.index(CHANNEL), count, log_head(o.op))

    def _gather(self, edge: int, task: int, need: Box, c: int) -> torch.Tensor:
        """The consumer task's box `need` of the edge's tensor, from its pieces."""
        trs = self.plan.into.get((edge, task), ())
        src = self.plan.ops[self.graph.edges[edge].src]
        if len(trs) == 1 and trs[0].box == need and not trs[0].partial:
            return self._piece(trs[0], src, c)
        if trs and trs[0].partial:  # partial sums of a contraction split: add them up
            buf = torch.zeros(_shape(need), dtype=self._dtype(src), device=self.device)
            for tr in trs:
                buf[_rel(tr.box, need)] += self._piece(tr, src, c)
            return buf
        buf = torch.empty(_shape(need), dtype=self._dtype(src), device=self.device)
        for tr in trs:
            buf[_rel(tr.box, need)] = self._piece(tr, src, c)
        return buf

    def _piece(self, tr: Transfer, src: OpExec, c: int) -> torch.Tensor:
        if tr.local:
            return self.out[src.index][c][_rel(tr.box, src.plans[tr.src_task].out_box)]
        work, buf = self.recvs.pop(self._tag(tr, c))
        self._wait(work)
        return buf

    def _dtype(self, o: OpExec) -> torch.dtype:
        """Token inputs are integers; everything else has the run's dtype."""
        if o.op.kind == "input" and any(
            self.graph.ops[c].kind == "embedding" for c in self.graph.consumers[o.index]
        ):
            return torch.int64
        return self.dtype

    def _batch_norm_task(
        self, o: OpExec, t: int, xs: list[torch.Tensor], params: list[torch.Tensor]
    ) -> torch.Tensor:
        """Batch norm (an op's own or folded) with the model's epsilon; statistics summed
        over the tasks that hold the same channels when samples, height or width are split
        (`planner.costs.kernels.shared_batch_norm`, the computation the profiler measures)."""
        plan = o.plans[t]
        eps = self.norm_eps.get(o.index, BN_EPS)
        ranks = o.norm_groups[t]
        if not plan.stats_count or len(ranks) == 1:
            return run_task(plan, xs, params, eps=eps)
        group = self.groups[("norm", ranks)]

        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.status.waiting(True)
            y = group_sum(x.contiguous(), ranks, group, self.rank)
            self.status.waiting(False)
            return y

        return run_task(plan, xs, params, reduce, eps)

    def _expert_exchange(self, o: OpExec, t: int) -> GroupExchange:
        """The all-to-all of a moe task with its expert-parallel group (`runtime.experts`);
        the counts of the step's first forward of the op go to `expert_tokens`."""
        members = o.expert_groups[t]
        group = self.groups[("expert", tuple(sorted(members)))]
        step = self.step_index

        def log(sent: torch.Tensor, received: torch.Tensor) -> None:
            record = self.expert_tokens.setdefault(step, {})
            if o.op.name not in record:  # not again when the task is recomputed
                record[o.op.name] = (sent.reshape(-1).tolist(), received.sum(0).tolist())

        return GroupExchange(members, group, log, self.status.waiting)

    # -- backward ------------------------------------------------------------------------------

    def backward(self) -> None:
        self.recvs = {} if self.ordered else self._post_recvs(backward=True)
        self.grads: dict[int, list[torch.Tensor | None]] = {}  # op -> its output components
        for o in reversed(self.plan.ops):
            self._backward_op(o)
            if self.ordered:
                self._exchange(o, backward=True)
            self.sync.launch(o.index)

    def _backward_op(self, o: OpExec) -> None:
        t = self.task[o.index]
        if t is not None and o.op.kind != "input":
            self.status.set(self.step_index, BACKWARD, o.index)
            self._backward_task(o, t)

    def _backward_task(self, o: OpExec, t: int) -> None:
        i = o.index
        outs = self.out.pop(i)
        if i in self.losses:
            self.losses[i].backward()
        else:
            grads = self._output_grads(o, t, len(outs))
            pairs = [(y, g) for y, g in zip(outs, grads, strict=True) if g is not None]
            pairs = [(y, g) for y, g in pairs if y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        self._send_input_grads(o, t)

    def _output_grads(self, o: OpExec, t: int, comps: int) -> list[torch.Tensor | None]:
        grads = self.grads.pop(o.index, [None, None])[:comps]
        box = o.plans[t].out_box
        for tr in self.plan.out_of.get((o.index, t), ()):
            if tr.local:
                continue
            for c in range(tr.components):
                work, buf = self.recvs.pop(self._tag(tr, c, backward=True))
                self._wait(work)
                grads[c] = self._accumulate(grads[c], box, tr.box, buf)
        return grads

    def _accumulate(
        self, acc: torch.Tensor | None, base: Box, box: Box, piece: torch.Tensor
    ) -> torch.Tensor:
        if acc is None:
            if box == base:
                return piece  # a received buffer, or a finished consumer's leaf gradient
            acc = torch.zeros(_shape(base), dtype=piece.dtype, device=self.device)
        acc[_rel(box, base)] += piece
        return acc

    def _send_input_grads(self, o: OpExec, t: int) -> None:
        """Each producer gets the gradient of the region it sent (every transfer has its
        backward message, zeros when the input did not matter)."""
        plan = o.plans[t]
        for pos, c, leaf in self.leaves.pop(o.index):
            k = self.in_edges[o.index][pos]
            src = self.plan.ops[self.graph.edges[k].src]
            if src.op.kind == "input":
                continue
            need = plan.in_boxes[pos]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for tr in self.plan.into.get((k, t), ()):
                piece = grad[_rel(tr.box, need)]
                if tr.local:
                    acc = self.grads.setdefault(src.index, [None, None])
                    base = src.plans[tr.src_task].out_box
                    acc[c] = self._accumulate(acc[c], base, tr.box, piece)
                    continue
                tag = self._tag(tr, c, backward=True)
                buf = piece.contiguous()
                if self.ordered:
                    self.outbox[tag] = buf
                else:
                    self.sends.append((dist.isend(buf, tr.src_rank, tag=tag), buf))

    # -- communication ---------------------------------------------------------------------------

    def _tag(self, tr: Transfer, c: int, backward: bool = False) -> int:
        """The message tag of component c of a transfer (of the current micro-batch)."""
        return self.tag_base + (self.plan.backward_offset if backward else 0) + tr.tag + c

    def _recv_plan(
        self, backward: bool
    ) -> list[tuple[int, int, tuple[int, ...], torch.dtype, int]]:
        """(tag, peer, shape, dtype, op) of every message this rank receives in a pass
        (forward: regions its tasks of op read; backward: gradients of the regions its tasks
        of op sent), tags of micro-batch 0."""
        out = []
        offset = self.plan.backward_offset if backward else 0
        for tr in self.plan.transfers:
            if tr.local:
                continue
            e = self.graph.edges[tr.edge]
            src = self.plan.ops[e.src]
            if backward:
                if tr.src_rank != self.rank or src.op.kind == "input":
                    continue
                peer, dtype, op = tr.dst_rank, self.dtype, e.src
            else:
                if tr.dst_rank != self.rank:
                    continue
                peer, dtype, op = tr.src_rank, self._dtype(src), e.dst
            for c in range(tr.components):
                out.append((offset + tr.tag + c, peer, _shape(tr.box), dtype, op))
        return out

    def _post_recvs(self, backward: bool, ops: Container[int] | None = None) -> dict[int, Message]:
        """Eager mode: post every receive of the pass (of `ops` only, if given) at its start."""
        out: dict[int, Message] = {}
        for tag, peer, shape, dtype, op in self.recv_plan[backward]:
            if ops is not None and op not in ops:
                continue
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            tag += self.tag_base
            out[tag] = (dist.irecv(buf, peer, tag=tag), buf)
        return out

    def _send(self, trs: Sequence[Transfer], outs: Sequence[torch.Tensor], base: Box) -> None:
        """Eager mode: send a task's output regions to the consumer tasks on other ranks."""
        for tr in trs:
            if tr.local:
                continue
            for c in range(tr.components):
                buf = outs[c].detach()[_rel(tr.box, base)].contiguous()
                self.sends.append((dist.isend(buf, tr.dst_rank, tag=self._tag(tr, c)), buf))

    def _exchange(self, o: OpExec, backward: bool) -> None:
        """Ordered mode: every rank posts its sends and receives of op o's input edges
        together (forward: before o runs; backward: after), in the same global order on all
        ranks. Slower than eager sends (no overlap), but it keeps each pair's messages in
        one order on both sides, which NCCL's in-order point-to-point streams need."""
        ops = []
        offset = self.plan.backward_offset if backward else 0
        for k in self.in_edges[o.index]:
            src = self.plan.ops[self.graph.edges[k].src]
            if backward and src.op.kind == "input":
                continue
            for tr in self.edge_transfers.get(k, ()):
                if tr.local:
                    continue
                sender, receiver = tr.src_rank, tr.dst_rank
                if backward:
                    sender, receiver = receiver, sender
                for c in range(tr.components):
                    tag = offset + tr.tag + c
                    if sender == self.rank:
                        if backward:
                            buf = self.outbox.pop(tag)
                        else:
                            box = _rel(tr.box, src.plans[tr.src_task].out_box)
                            buf = self.out[src.index][c].detach()[box].contiguous()
                        ops.append(dist.P2POp(dist.isend, buf, receiver, tag=tag))
                    elif receiver == self.rank:
                        shape, dtype = self.msg_spec[tag]
                        buf = torch.empty(shape, dtype=dtype, device=self.device)
                        ops.append(dist.P2POp(dist.irecv, buf, sender, tag=tag))
                        self.recvs[tag] = (None, buf)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                self._wait(work)

    def _wait(self, work: Any) -> None:
        if work is None:
            return
        self.status.waiting(True)
        t = time.perf_counter()
        work.wait(self.timeout)
        self.waited += time.perf_counter() - t
        self.status.waiting(False)
