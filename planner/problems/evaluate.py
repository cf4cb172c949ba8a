"""Evaluators that re-score any answer without trusting the backend that produced it.

- `additive_cost(problem, choices)`: OptCNN Eq. 1 on the cost tables,
  t_O = sum_i (t_c + t_s)(i, c_i) + sum_(u,v) t_x(e, c_u, c_v); inf when a choice is forbidden.
- `memory_peak` / `memory_feasible`: the liveness rule of the cost-table format.
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
    """Largest live usage over time, per memory pool (M,). Zeros when there is no usage."""
    if problem.usage is None or problem.intervals is None:
        return np.zeros(1)
    ch = problem.check_choices(choices)
    use = np.stack([u[k] for u, k in zip(problem.usage, ch, strict=True)])  # (n, M)
    start, end = problem.intervals[:, 0], problem.intervals[:, 1]
    times = np.unique(start)  # live sets only grow at a start, so peaks are at starts
    live = (start[None, :] <= times[:, None]) & (times[:, None] < end[None, :])
    return (live.astype(np.float64) @ use).max(axis=0)


def memory_feasible(problem: Problem, choices: Sequence[int], rtol: float = 1e-9) -> bool:
    if problem.usage_limit is None:
        return True
    return bool((memory_peak(problem, choices) <= problem.usage_limit * (1 + rtol)).all())


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
    memory = sum(
        (cost_model.memory(i, c) for i, c in enumerate(cfgs)), np.zeros(cost_model.num_devices)
    )
    return Breakdown(compute, sync, transfer, memory)
