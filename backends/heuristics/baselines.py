"""`baselines`: the best of the expert strategies (planner.problems.baselines) under the objective.

For cost-table problems with no DNN behind them the candidates are the cheapest choice per
node, per node the first allowed choice, and the answer of the feasibility heuristic
(`backends.heuristics.feasible`), which keeps forbidden pairs and the memory limit; for a DNN problem
the heuristic is the fallback when no expert strategy is valid (under the additive
objective). Never proves optimality: status FEASIBLE. The candidates are scored in turn (a full
simulation each under the makespan objective); once the time limit has passed the ones left
are not scored (`stats["not_scored_for_time"]`, limit TIME). No settings
(`BaselinesSettings`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import (
    Backend,
    BackendSettings,
    Limit,
    SolveOptions,
    SolveResult,
    Status,
    evaluate_objective,
    past,
)
from backends.heuristics.feasible import feasible_choices
from planner.errors import ConfigError
from planner.problems.baselines import BASELINES, applicable
from planner.problems.evaluate import memory_feasible
from planner.problems.problem import Problem

__all__ = ["BaselinesBackend", "BaselinesSettings"]


@dataclass(frozen=True)
class BaselinesSettings(BackendSettings):
    """The `baselines` backend has no settings: it scores every applicable expert strategy."""


class BaselinesBackend(Backend[BaselinesSettings]):
    name = "baselines"
    objectives = ("additive", "makespan")
    exact = False
    settings_type = BaselinesSettings

    def _candidates(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        if not problem.is_dnn:
            return {
                "cheapest_node": tuple(int(np.argmin(c)) for c in problem.node_cost),
                "first_allowed": tuple(int(np.argmax(np.isfinite(c))) for c in problem.node_cost),
            }
        dnn = problem.dnn()
        out = {}
        for name in applicable(dnn.graph):
            strategy = BASELINES[name](dnn.graph, dnn.devices)
            try:
                out[name] = problem.choices_of(strategy)
            except ConfigError:
                continue  # not in the (capped) config space
        return out

    def _solve(
        self, problem: Problem, options: SolveOptions, settings: BaselinesSettings
    ) -> SolveResult:
        deadline = options.clock().at
        values: dict[str, float] = {}
        best: tuple[float, str, tuple[int, ...]] | None = None
        candidates = self._candidates(problem)
        valid = [ch for ch in candidates.values() if _valid(problem, ch)]
        if options.objective == "additive" and (not problem.is_dnn or not valid):
            found = feasible_choices(problem, deadline, options.seed)
            if found is not None:
                candidates["feasible"] = found
        skipped = []
        for name, choices in candidates.items():
            if best is not None and past(deadline):  # a simulation each: keep to the limit
                skipped.append(name)
                continue
            value = evaluate_objective(problem, choices, options.objective)
            values[name] = value
            if not math.isfinite(value) or not memory_feasible(problem, choices):
                continue
            if best is None or value < best[0]:
                best = (value, name, choices)
        stats: dict[str, Any] = {"candidates": values}
        if skipped:
            stats["not_scored_for_time"] = skipped
        if best is None:
            return SolveResult(self.name, Status.NO_SOLUTION, stats=stats)
        limit = Limit.TIME if skipped else None
        stats["chosen"] = best[1]
        return SolveResult(self.name, Status.FEASIBLE, best[2], best[0], limit=limit, stats=stats)


def _valid(problem: Problem, choices: tuple[int, ...]) -> bool:
    """No forbidden choice or pair, and within memory."""
    return math.isfinite(evaluate_objective(problem, choices, "additive")) and memory_feasible(
        problem, choices
    )
