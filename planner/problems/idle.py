"""Which devices a plan leaves idle, and why (what `planner.plan` reports after a search).

A config splits an op into equal parts: each degree divides its dimension (in whole split
units) and their product k, the number of tasks, divides the device count D (docs/space.md).
So on D = 20 GPUs an op whose dimensions are powers of two (VGG-16's convolutions at batch
64) can be split over 1, 2 or 4 of them, never more, while on 16 GPUs the same ops split 16
ways. And a search can choose fewer devices when they are cheaper under its objective
(OptCNN's Eq. 1 charges every replica's synchronization in full).

`device_use(problem, choices, ...)` counts the devices the strategy gives tasks to and, when
some are idle, says which of the two it is, or both: ops with most of the forward FLOPs cannot
be split over every device (their share, the most devices they can use here, and the largest
device count they could all use in full), and the search chose fewer devices than the space
offered.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.costs.config import divisors
from planner.graph.opgraph import Op
from planner.graph.opkinds import parallel_dims, split_unit
from planner.problems.problem import Problem

__all__ = ["MOSTLY", "DeviceUse", "device_use", "split_counts"]

# The idle devices are (also) the space's doing when ops with at least this share of the
# forward FLOPs cannot be split over every device; they are (also) the search's choice when
# the plan uses fewer devices than those ops (or, else, the widest op) could.
MOSTLY = 0.5


@dataclass(frozen=True)
class DeviceUse:
    """The devices a strategy gives tasks to (`used` of `total`), the most devices any op's
    config in the space spans (`widest`), and why devices are idle (`reason`, None if none)."""

    used: int
    total: int
    widest: int
    reason: str | None


def device_use(
    problem: Problem, choices: Sequence[int], objective: str = "additive", proven: bool = False
) -> DeviceUse:
    """How many of a DNN problem's devices `choices` use, and why the others are idle.
    `proven`: the answer is proven optimal under `objective`."""
    dnn = problem.dnn("devices belong to a DNN problem")
    strategy = problem.strategy(choices)
    used = len({d for cfg in strategy.configs for d in cfg.devices})
    total = dnn.devices.num_devices
    widths = [
        max((math.prod(part) for part, _, idx in dnn.space[i].groups if len(idx)), default=1)
        for i in range(len(dnn.graph.ops))
    ]
    widest = max(widths)
    if used == total:
        return DeviceUse(used, total, widest, None)
    ops = dnn.graph.ops
    capped = [i for i, w in enumerate(widths) if w < total and ops[i].flops > 0]
    share = sum(ops[i].flops for i in capped) / (dnn.graph.forward_flops or 1.0)
    facts = []
    limit = widest
    if share >= MOSTLY:  # most of the work cannot spread over every device: the space's doing
        limit = max(widths[i] for i in capped)
        common = split_counts(ops[capped[0]], total)
        for i in capped[1:]:
            common &= split_counts(ops[i], total)
        best = max(common)
        facts.append(
            f"ops with {share:.0%} of the forward FLOPs cannot be split over more than "
            f"{limit:,} of them here (a split's degrees must divide the op's dimensions and "
            f"their product the device count, {total:,})"
        )
        if best > limit:
            facts.append(f"all of those ops split {best:,} ways: plan on {best:,} devices")
        else:
            facts.append("a larger batch would let more devices share their work")
    if used < limit:  # the space offered more: the search's choice
        found = "the proven optimum" if proven else "the best answer found"
        choice = (
            f"configs over up to {limit:,} of them were searched, and {found} under the "
            f"{objective} objective uses fewer"
        )
        facts.append(choice + (" (no plan that uses more costs less under it)" if proven else ""))
    reason = f"the plan uses {used:,} of the {total:,} devices: {'; '.join(facts)}"
    return DeviceUse(used, total, widest, reason)


def split_counts(op: Op, limit: int) -> set[int]:
    """The task counts (at most `limit`) of the equal splits of `op`, whatever the device
    count: the products <= limit of degrees that divide the op's dimensions."""
    pdims = parallel_dims(op)
    units = tuple(
        size // split_unit(op, dim)
        for dim, size in zip(op.output.dims, op.output.sizes, strict=True)
        if dim in pdims
    )
    return set(_products(units, limit))


@functools.cache
def _products(units: tuple[int, ...], limit: int) -> frozenset[int]:
    """Products <= limit of one divisor of each of `units` (ops of one shape share them)."""
    products = {1}
    for n in units:
        options = [g for g in divisors(n) if g <= limit]
        products = {p * g for p in products for g in options if p * g <= limit}
    return frozenset(products)
