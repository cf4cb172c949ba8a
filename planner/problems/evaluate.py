"""Evaluators that re-score any answer without trusting the backend that produced it.

- `additive_cost(problem, choices)`: OptCNN Eq. 1 on the cost tables,
  t_O = sum_i (t_c + t_s)(i, c_i) + sum_(u,v) t_x(e, c_u, c_v); inf when a choice is forbidden.
- `memory_peak` / `memory_feasible`: the liveness rule of the cost-table format;
  `device_capacity` / `fits_devices`: a DNN problem's answer against each device's own
  memory, whether the problem was built with a memory limit or not.
- `score_strategy(cost_model, strategy)`: Eq. 1 computed directly from the cost functions
  (t_x task pair by task pair), independent of the vectorized tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from planner.costs.costmodel import CostModel
    from planner.problems.problem import Problem
    from planner.problems.strategy import Strategy


def additive_cost(problem: Problem, choices: Sequence[int]) -> float:
    """OptCNN Eq. 1 on the problem's tables for one choice per node."""
    ch = problem.check_choices(choices)
    total = sum(float(c[k]) for c, k in zip(problem.node_cost, ch, strict=True))
    for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True):
        total += float(t[ch[u], ch[v]])
    return total


def memory_peak(problem: Problem, choices: Sequence[int]) -> np.ndarray:
    """Largest live usage over time, per memory pool (M,). Zeros when there is no usage.

    A sweep over the interval events, O(n log n) time and O(n) memory: the usage live at
    time t is the sum of the usages that started at or before t minus those that ended at
    or before t (node i is live when start_i <= t < end_i, so an empty interval adds and
    removes its usage at the same time and is never live). Live sets only grow at a start,
    so the peak is the largest of these sums at the distinct start times.
    """
    if problem.usage is None or problem.intervals is None:
        return np.zeros(1)
    ch = problem.check_choices(choices)
    use = np.stack([u[k] for u, k in zip(problem.usage, ch, strict=True)]).reshape(len(ch), -1)
    return live_usage(problem.intervals, use).max(axis=0, initial=0.0)


def live_usage(intervals: np.ndarray, use: np.ndarray) -> np.ndarray:
    """(T, M) usage live at each distinct interval start (sorted), from (n, M) usages."""
    start, end = intervals[:, 0], intervals[:, 1]
    times, first = np.unique(start, return_inverse=True)
    after = np.searchsorted(times, end, side="left")  # the first start time >= each end
    inside = after < len(times)  # usages that end before the last start
    delta = np.empty((len(times), use.shape[1]))
    for m in range(use.shape[1]):
        added = np.bincount(first, use[:, m], minlength=len(times))
        removed = np.bincount(after[inside], use[inside, m], minlength=len(times))
        delta[:, m] = added - removed
    return np.cumsum(delta, axis=0)


def memory_feasible(problem: Problem, choices: Sequence[int], rtol: float = 1e-9) -> bool:
    """True when the choices' memory peak (`memory_peak`: a sweep over the live intervals)
    is within the problem's usage limit in every pool (relative tolerance `rtol`); always
    True without a limit."""
    if problem.usage_limit is None:
        return True
    return bool((memory_peak(problem, choices) <= problem.usage_limit * (1 + rtol)).all())


def device_capacity(problem: Problem) -> np.ndarray | None:
    """Each device's usable memory in bytes (D,) for a DNN problem (its memory less the cost
    options' headroom); None for a cost-table problem (its only limit is its `usage_limit`)."""
    if not problem.is_dnn:
        return None
    return problem.dnn().cost_model.usable_memory()


def fits_devices(problem: Problem, choices: Sequence[int], rtol: float = 1e-9) -> bool:
    """`memory_feasible`, and for a DNN problem also within every device's own memory: what a
    plan must meet to run, whether the problem was searched under a memory limit or not."""
    if not memory_feasible(problem, choices, rtol):
        return False
    capacity = device_capacity(problem)
    if capacity is None or problem.usage is None:
        return True
    return bool((memory_peak(problem, choices) <= capacity * (1 + rtol)).all())


@dataclass(frozen=True)
class Breakdown:
    """A strategy's Eq. 1 cost split into its three sums, plus per-device memory."""

    compute: float
    sync: float
    transfer: float
    memory: np.ndarray

    @property
    def total(self) -> float:
        return self.compute + self.sync + self.transfer


def score_strategy(cost_model: CostModel, strategy: Strategy) -> Breakdown:
    """Eq. 1 straight from the cost functions, without the cost tables."""
    g = cost_model.graph
    if strategy.graph != g:
        from planner.errors import StrategyError

        raise StrategyError("the strategy was made for another graph than the cost model's")
    cfgs = strategy.configs
    compute = sum(cost_model.compute_time(i, c) for i, c in enumerate(cfgs))
    sync = sum(cost_model.sync_time(i, c) for i, c in enumerate(cfgs))
    transfer = sum(cost_model.transfer_time(e, cfgs[e.src], cfgs[e.dst]) for e in g.edges)
    memory = cost_model.strategy_memory(cfgs)
    return Breakdown(compute, sync, transfer, memory)
