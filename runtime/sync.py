"""Sums across ranks: parameter gradients (then SGD) and batch-norm statistics.

`GradientSync` holds a rank's parameter shards (the leaves its tasks compute with: tasks of
one op, or of the steps of a shared parameter group, that hold the same shard use the same
leaf, so their gradients accumulate locally). After the backward pass has passed every op that
uses a `SyncItem`, the rank's contribution (the sum of its shards' gradients over the item's
channel interval) is all-reduced asynchronously in the group of the item's ranks, bucketed per
(ready op, group). `finish_and_update` waits, writes the sums back into every shard that holds
the interval, and takes the SGD step.

`sync_batch_norm` is batch norm over the tasks that hold the same channels: per-channel sums
all-reduced forward, and (autograd through `_AllReduceSum`) backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.kernels import shard_params
from runtime.plan import ExecPlan, ShardKey, SyncItem

__all__ = ["GradientSync", "sync_batch_norm"]

Waiter = Callable[[Any], None]
IN_PLACE_NUMEL = 1 << 15  # gradients this large are all-reduced in place, not concatenated


@dataclass(frozen=True)
class _Bucket:
    """SyncItems reduced in one all-reduce: same rank set, same ready op."""

    ranks: tuple[int, ...]
    items: tuple[SyncItem, ...]


class GradientSync:
    """Rank `rank`'s parameter shards of `plan`, cut from the full initial `params`."""

    def __init__(
        self,
        plan: ExecPlan,
        rank: int,
        params: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        groups: dict[tuple[int, ...], Any],
        wait: Waiter,
    ):
        self.plan = plan
        self.rank = rank
        self.groups = groups
        self.wait = wait
        self.shards: dict[ShardKey, torch.Tensor] = {}
        self.op_params: dict[int, list[torch.Tensor]] = {}
        for o in plan.ops:
            t = o.task_of(rank)
            if t is None or not o.op.params:
                continue
            keys = o.shards[t]
            if any(k not in self.shards for k in keys):
                views = shard_params(o.plans[t], [params[p.name] for p in o.op.params])
                for key, v in zip(keys, views, strict=True):
                    if key not in self.shards:
                        leaf = v.detach().to(device, dtype, copy=True)
                        self.shards[key] = leaf.requires_grad_()
            self.op_params[o.index] = [self.shards[k] for k in keys]
        grouped: dict[tuple[int, tuple[int, ...]], list[SyncItem]] = {}
        for item in plan.sync:
            if rank in item.ranks:
                grouped.setdefault((item.ready, item.ranks), []).append(item)
        self.buckets: dict[int, list[_Bucket]] = {}
        for (ready, ranks), items in sorted(grouped.items()):
            self.buckets.setdefault(ready, []).append(_Bucket(ranks, tuple(items)))
        self.keys = {
            item: [
                k
                for k in self.shards
                if k.name == item.param and k.lo <= item.lo and item.hi <= k.hi
            ]
            for items in grouped.values()
            for item in items
        }
        self.pending: list[tuple[_Bucket, torch.Tensor, Any]] = []

    def params_of(self, op: int) -> list[torch.Tensor]:
        return self.op_params.get(op, [])

    def launch(self, op: int) -> None:
        """Start the sums of the buckets that are complete once op `op`'s backward is done:
        a large gradient that is one whole shard is summed in place, the rest of a bucket
        is concatenated into one all-reduce."""
        for bucket in self.buckets.get(op, ()):
            small = []
            for item in bucket.items:
                grad = self._whole_shard_grad(item)
                if grad is not None and grad.numel() >= IN_PLACE_NUMEL:
                    self._all_reduce(_Bucket(bucket.ranks, ()), grad)
                else:
                    small.append(item)
            if small:
                pieces = [self._contribution(item) for item in small]
                flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
                self._all_reduce(_Bucket(bucket.ranks, tuple(small)), flat)

    def _all_reduce(self, bucket: _Bucket, flat: torch.Tensor) -> None:
        work = None
        if len(bucket.ranks) > 1:
            work = dist.all_reduce(flat, group=self.groups[bucket.ranks], async_op=True)
        self.pending.append((bucket, flat, work))

    def _whole_shard_grad(self, item: SyncItem) -> torch.Tensor | None:
        """The gradient of the one shard of this rank that the item covers exactly, if so."""
        keys = self.keys[item]
        if len(keys) != 1 or (keys[0].lo, keys[0].hi) != (item.lo, item.hi):
            return None
        leaf = self.shards[keys[0]]
        if leaf.grad is None:
            leaf.grad = torch.zeros_like(leaf)
        return leaf.grad if leaf.grad.is_contiguous() else None

    def finish_and_update(self, lr: float) -> None:
        """Wait for the sums, give every shard its summed gradient, take the SGD step."""
        for bucket, flat, work in self.pending:
            if work is not None:
                self.wait(work)
            at = 0
            for item in bucket.items:
                size = self._numel(item)
                chunk = flat[at : at + size]
                at += size
                for key in self.keys[item]:
                    leaf = self.shards[key]
                    if leaf.grad is None:
                        leaf.grad = torch.zeros_like(leaf)
                    off = 0
                    for v in self._views(leaf.grad, key, item):
                        v.copy_(chunk[off : off + v.numel()].view_as(v))
                        off += v.numel()
        self.pending = []
        with torch.no_grad():
            for leaf in self.shards.values():
                if leaf.grad is not None:
                    leaf.add_(leaf.grad, alpha=-lr)
                    leaf.grad = None

    def state(self) -> dict[ShardKey, torch.Tensor]:
        """This rank's parameter shards (CPU copies)."""
        return {k: v.detach().cpu().clone() for k, v in self.shards.items()}

    def _views(self, tensor: torch.Tensor, key: ShardKey, item: SyncItem) -> list[torch.Tensor]:
        """The parts of a shard-shaped tensor that hold the item's channels (one per block)."""
        info = self.plan.params[item.param]
        if info.axis is None:
            return [tensor]
        width = key.hi - key.lo
        return [
            tensor.narrow(info.axis, b * width + item.lo - key.lo, item.hi - item.lo)
            for b in range(info.blocks)
        ]

    def _numel(self, item: SyncItem) -> int:
        key = self.keys[item][0]
        return sum(v.numel() for v in self._views(self.shards[key], key, item))

    def _contribution(self, item: SyncItem) -> torch.Tensor:
        total: torch.Tensor | None = None
        for key in self.keys[item]:
            leaf = self.shards[key]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            flat = torch.cat([v.reshape(-1) for v in self._views(grad, key, item)])
            total = flat if total is None else total + flat
        assert total is not None, f"rank {self.rank} holds no shard of {item}"
        return total


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group; its backward sums the gradients over the group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, waiting: Callable[[bool], None]) -> Any:
        ctx.group, ctx.waiting = group, waiting
        y = x.clone()
        waiting(True)
        dist.all_reduce(y, group=group)
        waiting(False)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        g = g.clone()
        ctx.waiting(True)
        dist.all_reduce(g, group=ctx.group)
        ctx.waiting(False)
        return g, None, None


def sync_batch_norm(
    x: torch.Tensor,
    w: torch.Tensor | None,
    b: torch.Tensor | None,
    axis: int,
    count: int,
    eps: float,
    group: Any,
    waiting: Callable[[bool], None],
) -> torch.Tensor:
    """Batch norm of x over all dims but `axis`, with the statistics of the whole group's
    `count` positions per channel (biased variance, as torch's training mode)."""
    dims = [d for d in range(x.dim()) if d != axis]
    shape = [1] * x.dim()
    shape[axis] = x.shape[axis]
    mean = _AllReduceSum.apply(x.sum(dims), group, waiting) / count
    xc = x - mean.view(shape)
    var = _AllReduceSum.apply((xc * xc).sum(dims), group, waiting) / count
    y = xc * torch.rsqrt(var + eps).view(shape)
    if w is not None and b is not None:
        y = y * w.view(shape) + b.view(shape)
    return y
