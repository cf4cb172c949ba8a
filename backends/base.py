"""The contract every search backend follows (docs/architecture.md, Backends).

A backend sees only the frozen `Problem` and `SolveOptions`. `Backend.solve` checks that the
backend can run, calls the subclass's `_solve`, and re-scores the returned choices with
planner's evaluators: the `objective` of a result is never the backend's own number (that
is kept in `stats["reported_objective"]` when the backend gives one).

Stopping early. Every search loop looks at `past(deadline)`: true once its deadline (a
`time.perf_counter()` value) has passed *or* the user asked to stop. While `solve` runs in
the main thread, the first Ctrl-C (SIGINT) only asks to stop (`request_stop`): the backend
returns its best answer so far and `solve` marks the result with limit INTERRUPTED (status
FEASIBLE unless optimality was proven). A second Ctrl-C raises KeyboardInterrupt as usual.

Progress. Long searches report best-so-far lines through the standard `logging` module
(`logging.getLogger("backends.<name>")`), at most one every `PROGRESS_SECONDS`
(`ProgressLog`); the command lines show them on stderr.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import logging
import math
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
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
    """How a search ended: what its answer is worth (a proof, an answer, or nothing)."""

    OPTIMAL = "OPTIMAL"  # proven optimal (within the solver's gap tolerance)
    FEASIBLE = "FEASIBLE"  # a valid answer, optimality not proven
    INFEASIBLE = "INFEASIBLE"  # proven that no valid answer exists
    NO_SOLUTION = "NO_SOLUTION"  # nothing found, nothing proven


class Limit(enum.Enum):
    """Why a search stopped before it could prove anything more (None in a result: it
    finished on its own)."""

    TIME = "TIME"
    ITERATIONS = "ITERATIONS"
    INTERRUPTED = "INTERRUPTED"  # the user asked to stop (Ctrl-C): best answer so far


PROGRESS_SECONDS = 5.0  # at most one progress line per search this often

_STOP = threading.Event()


def request_stop() -> None:
    """Ask every running search to return its best answer so far (what Ctrl-C does)."""
    _STOP.set()


def stop_requested() -> bool:
    return _STOP.is_set()


def past(deadline: float) -> bool:
    """True when `deadline` (a `time.perf_counter()` value) has passed or a stop was asked."""
    return _STOP.is_set() or time.perf_counter() > deadline


class ProgressLog:
    """Best-so-far lines for a long search: `log(lambda: "...")` logs at INFO at most once
    every `every` seconds (the message is only built when it is logged)."""

    def __init__(self, name: str, every: float = PROGRESS_SECONDS):
        self.logger = logging.getLogger(f"backends.{name}")
        self.every = every
        self.start = self.last = time.perf_counter()

    def __call__(self, message: Callable[[], str], force: bool = False) -> None:
        now = time.perf_counter()
        if (force or now - self.last >= self.every) and self.logger.isEnabledFor(logging.INFO):
            self.last = now
            self.logger.info("%.1f s: %s", now - self.start, message())


class _CatchInterrupt:
    """While a search runs in the main thread: the first SIGINT asks it to stop, the second
    raises KeyboardInterrupt. Elsewhere (a worker thread) it does nothing."""

    def __enter__(self) -> _CatchInterrupt:
        _STOP.clear()
        self.previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if _STOP.is_set():
            raise KeyboardInterrupt
        logging.getLogger("backends").warning(
            "interrupted: returning the best answer so far (Ctrl-C again to abort)"
        )
        _STOP.set()

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


@dataclass(frozen=True)
class SolveOptions:
    """What to solve and within what: `objective` ("additive": OptCNN's Eq. 1 cost tables;
    "makespan": the simulated iteration time, FlexFlow Sec. 5), a wall-clock `time_limit` in
    seconds that covers the whole `solve`, a `seed` (every search is deterministic for one
    seed, given the same limit), `threads` for the solvers that use several, an optional
    `warm_start` (a choice vector, used as the incumbent where supported) and
    backend-specific `extra` settings (documented per backend; unknown keys are errors)."""

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
    """A backend's answer: `status`, the chosen config per node (`choices`, None without an
    answer), its `objective` value, the best proven lower `bound` (None if none), the `limit`
    that stopped the search early (None if it finished), the `strategy` for DNN problems, and
    backend-specific `stats` (phases in seconds, counts, the solver's own status)."""

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
    from planner.sim.simulator import Simulator

    # The makespan only: a Timeline with every task's name costs twice the simulation
    # (1.3 million tasks on 1,024 GPUs: 28 s of names for a 15 s simulation).
    return Simulator(problem.cost_model, problem.strategy(choices).configs).makespan


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
        with _CatchInterrupt():
            raw = self._solve(problem, options)
            interrupted = stop_requested()
        _STOP.clear()
        elapsed = time.perf_counter() - start
        proven = raw.status in (Status.OPTIMAL, Status.INFEASIBLE) and raw.limit is None
        if interrupted and not proven:
            status = Status.FEASIBLE if raw.choices is not None else Status.NO_SOLUTION
            raw = dataclasses.replace(raw, status=status, limit=Limit.INTERRUPTED)
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
