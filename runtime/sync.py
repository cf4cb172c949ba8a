"""Sums across ranks: parameter gradients (then SGD) and batch-norm statistics.

`GradientSync` holds a rank's parameter shards (the leaves its tasks compute with: tasks of
one op, or of the steps of a shared parameter group, that hold the same shard use the same
leaf, so their gradients accumulate locally). After the backward pass has passed every op that
uses a `SyncItem`, the rank's contribution (the sum of its shards' gradients over the item's
channel interval) is all-reduced asynchronously in the group of the item's ranks. Items of one
group are merged into buckets of about BUCKET_NUMEL elements in backward order, as DDP does
(a gloo all-reduce costs about 0.5 ms on these machines whatever its size); the grouping
depends on the plan only, so every member of a group forms the same buckets. A gradient of
BUCKET_NUMEL elements or more that is one whole shard is summed in place. `finish_and_update`
waits, writes the sums back into every shard that holds the interval, and takes the SGD step.

ZeRO (`zero` >= 1, the plan's `CostOptions.zero`): a bucket of a group of r ranks is
reduce-scattered instead (`reduce_scatter_tensor`, padded to a multiple of r: gloo supports
it in the torch this project pins), each rank takes the SGD step on its 1/r slice of the
bucket's parameters, and the updated slices are all-gathered (`all_gather_into_tensor`) into
every shard that holds them: the collectives and the sliced update of ZeRO 1-2 (Rajbhandari
et al., SC'20, Sec. 5.1-5.2, 7.2.1). With SGD (no optimizer state) the numbers are those of
the all-reduce up to the order of the sums. The full gradients and weights stay allocated
(no memory is saved here), and stage 3 runs as stage 2: the weights are not gathered per op.

`group_sum` sums a tensor over a group's ranks: the batch-norm statistics of tasks that hold
the same channels (`planner.costs.kernels.shared_batch_norm` calls it forward and backward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.costs.costmodel import CostOptions
from planner.costs.kernels import shard_params
from runtime.plan import ExecPlan, ShardKey, SyncItem

__all__ = ["GradientSync", "first_non_finite", "group_sum"]

Waiter = Callable[[Any], None]
# Elements per all-reduce bucket: the cost model's bucket (4 MiB) of float32.
BUCKET_NUMEL = int(CostOptions.sync_bucket_bytes) // 4


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
        groups: dict[tuple[str, tuple[int, ...]], Any],
        wait: Waiter,
        zero: int = 0,
    ):
        self.plan = plan
        self.rank = rank
        self.groups = groups
        self.wait = wait
        self.zero = zero
        self.shards: dict[ShardKey, torch.Tensor] = {}
        self.op_params: dict[int, list[torch.Tensor]] = {}
        self.sliced: dict[int, tuple[Any, list[torch.Tensor], list[int]]] = {}
        for o in plan.ops:
            t = o.task_of(rank)
            if t is None or not o.op.params:
                continue
            keys = o.shards[t]
            views = shard_params(o.plans[t], [params[p.name] for p in o.op.params])
            for key, v, p in zip(keys, views, o.op.params, strict=True):
                if key not in self.shards and key.lo < key.hi:
                    v = params[p.name] if p.name in plan.whole else v
                    leaf = v.detach().to(device, dtype, copy=True)
                    self.shards[key] = leaf.requires_grad_()
            # a shard of nothing (lo = hi: another rank's expert) is an empty tensor here
            self.op_params[o.index] = [
                self.shards[k] if k.lo < k.hi else v.detach().to(device, dtype)
                for k, v in zip(keys, views, strict=True)
            ]
            whole = [i for i, p in enumerate(o.op.params) if p.name in plan.whole]
            if whole:  # the task's slices are cut from the whole leaf at every use
                full = [
                    self.shards[k] if i in whole else torch.empty(p.shape, device="meta")
                    for i, (k, p) in enumerate(zip(keys, o.op.params, strict=True))
                ]
                self.sliced[o.index] = (o.plans[t], full, whole)
        mine = [item for item in plan.sync if rank in item.ranks]
        self.buckets = _buckets(plan, mine)
        self.keys = {
            item: [
                k
                for k in self.shards
                if k.name == item.param and k.lo <= item.lo and item.hi <= k.hi
            ]
            for item in mine
        }
        self.pending: list[tuple[_Bucket, torch.Tensor, Any]] = []
        self.scattered: list[tuple[_Bucket, torch.Tensor, Any]] = []  # ZeRO: this rank's slice

    def params_of(self, op: int) -> list[torch.Tensor]:
        """Op `op`'s parameter shards on this rank (slices of whole leaves made anew)."""
        sliced = self.sliced.get(op)
        if sliced is None:
            return self.op_params.get(op, [])
        plan, full, whole = sliced
        views = shard_params(plan, full)
        return [views[i] if i in whole else p for i, p in enumerate(self.op_params[op])]

    def launch(self, op: int) -> None:
        """Start the sums of the buckets that are complete once op `op`'s backward is done."""
        for bucket in self.buckets.get(op, ()):
            if self.zero and len(bucket.ranks) > 1:
                self._reduce_scatter(bucket)
                continue
            if len(bucket.items) == 1:
                grad = self._whole_shard_grad(bucket.items[0])
                if grad is not None:
                    self._all_reduce(_Bucket(bucket.ranks, ()), grad)  # in place
                    continue
            pieces = [self._contribution(item) for item in bucket.items]
            flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            self._all_reduce(bucket, flat)

    def _all_reduce(self, bucket: _Bucket, flat: torch.Tensor) -> None:
        work = None
        if len(bucket.ranks) > 1:
            group = self.groups[("sync", bucket.ranks)]
            work = dist.all_reduce(flat, group=group, async_op=True)
        self.pending.append((bucket, flat, work))

    def _reduce_scatter(self, bucket: _Bucket) -> None:
        """ZeRO: start summing the bucket's gradients into this rank's 1/r slice."""
        pieces = [self._contribution(item) for item in bucket.items]
        flat = _padded(torch.cat(pieces) if len(pieces) > 1 else pieces[0], len(bucket.ranks))
        mine = flat.new_empty(flat.numel() // len(bucket.ranks))
        group = self.groups[("sync", bucket.ranks)]
        work = dist.reduce_scatter_tensor(mine, flat, group=group, async_op=True)
        self.scattered.append((bucket, mine, work))

    def _update_slices(self, lr: float) -> None:
        """ZeRO: the SGD step on this rank's slice of every scattered bucket, then the
        updated slices all-gathered into every shard holding them; their gradients are
        zeroed so that the step on the whole leaves leaves them as they are."""
        gathers = []
        for bucket, grad, work in self.scattered:
            self.wait(work)
            group = self.groups[("sync", bucket.ranks)]
            weights = _padded(self._bucket_weights(bucket), len(bucket.ranks))
            at = dist.get_group_rank(group, self.rank) * grad.numel()
            mine = torch.add(weights[at : at + grad.numel()], grad, alpha=-lr)
            work = dist.all_gather_into_tensor(weights, mine, group=group, async_op=True)
            gathers.append((bucket, weights, work))
        self.scattered = []
        with torch.no_grad():
            for bucket, weights, work in gathers:
                self.wait(work)
                for item, chunk in self._chunks(bucket, weights):
                    for key in self.keys[item]:
                        leaf = self.shards[key]
                        grads = self._views(leaf.grad, key, item) if leaf.grad is not None else []
                        self._fill(self._views(leaf, key, item), chunk)
                        for g in grads:
                            g.zero_()

    def _bucket_weights(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's parameters, laid out as its gradients (every shard holding an
        item's interval holds the same values: the first one's)."""
        pieces = []
        for item in bucket.items:
            key = self.keys[item][0]
            leaf = self.shards[key].detach()
            pieces.extend(v.reshape(-1) for v in self._views(leaf, key, item))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()

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
            for item, chunk in self._chunks(bucket, flat):
                for key in self.keys[item]:
                    leaf = self.shards[key]
                    if leaf.grad is None:
                        leaf.grad = torch.zeros_like(leaf)
                    self._fill(self._views(leaf.grad, key, item), chunk)
        self.pending = []
        self._update_slices(lr)
        with torch.no_grad():
            for leaf in self.shards.values():
                if leaf.grad is not None:
                    leaf.add_(leaf.grad, alpha=-lr)
                    leaf.grad = None

    def first_non_finite(self) -> str | None:
        """The name of a parameter with a NaN or infinite element in this rank's shards."""
        return first_non_finite(self.shards)

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

    def _chunks(
        self, bucket: _Bucket, flat: torch.Tensor
    ) -> Iterator[tuple[SyncItem, torch.Tensor]]:
        """Each item of the bucket with its part of the bucket's flat buffer, in order."""
        at = 0
        for item in bucket.items:
            size = self._numel(item)
            yield item, flat[at : at + size]
            at += size

    @staticmethod
    def _fill(views: list[torch.Tensor], chunk: torch.Tensor) -> None:
        """Copy `chunk` into `views`, one after the other (a shard's blocks of the item)."""
        off = 0
        for v in views:
            v.copy_(chunk[off : off + v.numel()].view_as(v))
            off += v.numel()

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


def first_non_finite(shards: Mapping[ShardKey, torch.Tensor]) -> str | None:
    """The parameter name of the first shard with a NaN or infinite element (None if none).
    One sum per shard; the exact element test only when the sum is not finite (it also
    overflows for huge finite values)."""
    for key, t in shards.items():
        t = t.detach()
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            return key.name
    return None


def _buckets(plan: ExecPlan, items: list[SyncItem]) -> dict[int, list[_Bucket]]:
    """Items merged per rank set, in backward order, into buckets of about BUCKET_NUMEL
    elements; each bucket starts at the op after which its last item is ready."""
    by_ranks: dict[tuple[int, ...], list[SyncItem]] = {}
    for item in sorted(items, key=lambda it: -it.ready):  # stable: plan order within an op
        by_ranks.setdefault(item.ranks, []).append(item)
    out: dict[int, list[_Bucket]] = {}
    for ranks, group in sorted(by_ranks.items()):
        current: list[SyncItem] = []
        size = 0
        for item in group:
            n = _item_numel(plan, item)
            if n >= BUCKET_NUMEL:
                out.setdefault(item.ready, []).append(_Bucket(ranks, (item,)))
                continue
            current.append(item)
            size += n
            if size >= BUCKET_NUMEL:
                out.setdefault(item.ready, []).append(_Bucket(ranks, tuple(current)))
                current, size = [], 0
        if current:
            out.setdefault(current[-1].ready, []).append(_Bucket(ranks, tuple(current)))
    return out


def _padded(flat: torch.Tensor, r: int) -> torch.Tensor:
    """`flat` with zeros appended up to a multiple of r elements (a new tensor)."""
    pad = -flat.numel() % r
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat.clone()


def _item_numel(plan: ExecPlan, item: SyncItem) -> int:
    info = plan.params[item.param]
    return math.prod(info.shape) // info.extent * (item.hi - item.lo)


PAIR_TAG = 1 << 30  # message tag of the pairwise sums (transfer tags stay far below)


def group_sum(t: torch.Tensor, ranks: tuple[int, ...], group: Any, rank: int) -> torch.Tensor:
    """The sum of `t` over the ranks of a group, the same bits on every member. Two ranks
    swap their tensors and add (a + b == b + a exactly): one message each way, about a
    quarter of a gloo all-reduce's latency on these machines; larger groups all-reduce."""
    if len(ranks) == 2:
        peer = ranks[1] if ranks[0] == rank else ranks[0]
        other = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, peer, group=group, tag=PAIR_TAG)]
        ops.append(dist.P2POp(dist.irecv, other, peer, group=group, tag=PAIR_TAG))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return t + other
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out
