"""The contract every search backend follows (see DESIGN.md, Backends).

A backend sees only the frozen `Problem` and `SolveOptions`. `Backend.solve` checks that the
backend can run, calls the subclass's `_solve`, and re-scores the returned choices with
planner's evaluators: the `objective` of a result is never the backend's own number (that
is kept in `stats["reported_objective"]` when the backend gives one).
"""

from __future__ import annotations

import enum
import importlib.util
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from planner.errors import LayerwiseError
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem
from planner.problems.strategy import Strategy

OBJECTIVES = ("additive", "makespan")


class BackendError(LayerwiseError):
    """A backend cannot run: unknown name, missing package, unsupported objective or problem."""


class Status(enum.Enum):
    OPTIMAL = "OPTIMAL"  # proven optimal (within the solver's gap tolerance)
    FEASIBLE = "FEASIBLE"  # a valid answer, optimality not proven
    INFEASIBLE = "INFEASIBLE"  # proven that no valid answer exists
    NO_SOLUTION = "NO_SOLUTION"  # nothing found, nothing proven


class Limit(enum.Enum):
    TIME = "TIME"
    ITERATIONS = "ITERATIONS"


@dataclass(frozen=True)
class SolveOptions:
    objective: str = "additive"
    time_limit: float = 10.0
    seed: int = 0
    threads: int = 1
    warm_start: tuple[int, ...] | None = None  # choices from another backend, where supported
    extra: Mapping[str, Any] = field(default_factory=dict)  # backend-specific settings

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise BackendError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not self.time_limit > 0:
            raise BackendError(f"time_limit must be positive, got {self.time_limit}")
        if self.threads < 1:
            raise BackendError(f"threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class SolveResult:
    backend: str
    status: Status
    choices: tuple[int, ...] | None = None
    objective: float | None = None
    bound: float | None = None
    limit: Limit | None = None
    strategy: Strategy | None = None
    stats: Mapping[str, Any] = field(default_factory=dict)

    @property
    def has_solution(self) -> bool:
        return self.choices is not None

    def objective_value(self) -> float:
        if self.objective is None:
            raise BackendError(f"{self.backend} returned no solution (status {self.status.value})")
        return self.objective

    @property
    def gap(self) -> float | None:
        """objective / bound - 1 where both are known (0 when proven optimal)."""
        if self.objective is None or self.bound is None:
            return None
        if self.bound <= 0:
            return 0.0 if self.objective <= 0 else math.inf
        return max(0.0, self.objective / self.bound - 1.0)


def evaluate_objective(problem: Problem, choices: Sequence[int], objective: str) -> float:
    """The requested objective of a choice vector, from planner's evaluators: OptCNN's Eq. 1
    on the tables, or the makespan of FlexFlow's full simulation of the strategy."""
    if objective == "additive":
        return additive_cost(problem, choices)
    if problem.cost_model is None or problem.space is None:
        raise BackendError(
            f"the makespan objective needs a problem built from a DNN; {problem.name!r} is "
            "a cost-table problem (use the additive objective)"
        )
    from planner.sim.simulator import simulate

    return simulate(problem.cost_model, problem.strategy(choices)).makespan


class Backend(ABC):
    """Base class: subclasses set the class attributes and implement `_solve`."""

    name: ClassVar[str]
    objectives: ClassVar[tuple[str, ...]] = ("additive",)
    exact: ClassVar[bool] = False
    REQUIRED_MODULES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def is_installed(cls) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in cls.REQUIRED_MODULES)

    def can_run(self, problem: Problem, options: SolveOptions) -> str | None:
        """None when this backend can solve `problem` as asked, else the reason it cannot."""
        if not self.is_installed():
            missing = [m for m in self.REQUIRED_MODULES if importlib.util.find_spec(m) is None]
            return f"backend {self.name!r} needs the package(s) {missing}: pip install them"
        if options.objective not in self.objectives:
            return f"backend {self.name!r} does not optimize the {options.objective!r} objective"
        if options.objective == "makespan" and problem.cost_model is None:
            return (
                f"the makespan objective needs a problem built from a DNN; {problem.name!r} is "
                "a cost-table problem (use the additive objective)"
            )
        return None

    def solve(self, problem: Problem, options: SolveOptions | None = None) -> SolveResult:
        options = options or SolveOptions()
        reason = self.can_run(problem, options)
        if reason is not None:
            raise BackendError(reason)
        start = time.perf_counter()
        raw = self._solve(problem, options)
        elapsed = time.perf_counter() - start
        return self._finish(problem, options, raw, elapsed)

    @abstractmethod
    def _solve(self, problem: Problem, options: SolveOptions) -> SolveResult:
        """Search. Return choices, status, limit, bound, stats; the objective is re-scored."""

    def _finish(
        self, problem: Problem, options: SolveOptions, raw: SolveResult, elapsed: float
    ) -> SolveResult:
        stats = {"search_seconds": elapsed, **raw.stats}
        if raw.objective is not None:
            stats["reported_objective"] = raw.objective
        if raw.choices is None:
            return SolveResult(self.name, raw.status, None, None, raw.bound, raw.limit, None, stats)
        choices = problem.check_choices(raw.choices)
        value = evaluate_objective(problem, choices, options.objective)
        if not math.isfinite(value) or not memory_feasible(problem, choices):
            raise BackendError(
                f"backend {self.name!r} returned an invalid answer (forbidden choice or memory "
                "over the limit): this is a bug in the backend"
            )
        strategy = problem.strategy(choices) if problem.space is not None else None
        return SolveResult(
            self.name, raw.status, choices, value, raw.bound, raw.limit, strategy, stats
        )
