"""Expert parallelism's token exchange: the all-to-all of a moe task's group of ranks.

A moe op under `ParallelConfig.expert` e > 1 runs `planner.costs.kernels.expert_parallel_moe`
on each task, which calls its group's exchange three times per forward, in the same order on
every member: the per-expert counts (`counts`, no gradient), the token copies to their
experts' owners (dispatch), and the experts' results back (combine). `AllToAll` is
`dist.all_to_all_single` with uneven splits as an autograd function whose backward is the
reverse all-to-all (the gradient of a row goes back to the member that sent it), so each
member's backward runs the combine's reverse, then the dispatch's: again one order on all
members. A recomputed task (`torch.utils.checkpoint`) runs the three again in its backward
pass, every member at the same op.

Members are numbered in the group's task order (`ParallelConfig.expert_groups`); the process
group numbers its ranks in ascending order, so an exchange whose tasks are not on ascending
ranks reorders its blocks before and after the all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AllToAll", "GroupExchange", "all_to_all"]


class AllToAll(torch.autograd.Function):
    """`all_to_all(x, send, recv, group)`: rows of x, send[g] of them to group rank g in
    order, exchanged for recv[g] rows from each group rank g. Backward: the reverse
    exchange of the gradient (recv[g] rows back to g, send[g] from g)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(recv), list(send), group=group)
    return out


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """`AllToAll.apply` (typed)."""
    out: torch.Tensor = AllToAll.apply(x, send, recv, group)
    return out


class GroupExchange:
    """The exchange of one moe task with its group (`planner.costs.kernels.ExpertExchange`):
    `members` are the group's ranks in member order, `group` their process group. `log`,
    when given, receives (sent, received) count matrices of each `counts` call;
    `waiting(flag)` marks the rank as blocked on its peers (the launcher's hang report)."""

    def __init__(
        self,
        members: Sequence[int],
        group: Any,
        log: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        waiting: Callable[[bool], None] | None = None,
    ) -> None:
        ordered = sorted(members)
        self.to_group = [members.index(r) for r in ordered]  # group rank -> member
        self.identity = list(members) == ordered
        self.group = group
        self.log = log
        self.waiting = waiting or (lambda flag: None)

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        flat = self._rows(sent.contiguous()).contiguous()
        out = torch.empty_like(flat)
        self.waiting(True)
        dist.all_to_all_single(out, flat, group=self.group)
        self.waiting(False)
        received = self._rows(out, back=True)
        if self.log is not None:
            self.log(sent, received)
        return received

    def __call__(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if not self.identity:
            x = torch.cat([x.split(send)[m] for m in self.to_group])
        send_g = [send[m] for m in self.to_group]
        recv_g = [recv[m] for m in self.to_group]
        self.waiting(True)
        out = all_to_all(x, send_g, recv_g, self.group)
        self.waiting(False)
        if self.identity:
            return out
        blocks = dict(zip(self.to_group, out.split(recv_g), strict=True))
        return torch.cat([blocks[m] for m in range(len(send))])

    def _rows(self, t: torch.Tensor, back: bool = False) -> torch.Tensor:
        """Rows of a (members, ...) tensor in group-rank order (back: in member order)."""
        if self.identity:
            return t
        if not back:
            return t[self.to_group]
        out = torch.empty_like(t)
        out[self.to_group] = t
        return out
