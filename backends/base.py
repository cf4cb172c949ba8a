"""The contract every search backend follows (docs/architecture.md, Backends).

A backend sees only the frozen `Problem` and `SolveOptions`. `Backend.solve` checks that the
backend can run, calls the subclass's `_solve`, and re-scores the returned choices with
planner's evaluators: the `objective` of a result is not the backend's own number (that is
kept in `stats["reported_objective"]` when the backend gives one). One exception, so that a
time limit holds: a makespan answer returned when no time is left for the full simulation is
checked with the additive evaluator only (forbidden choices, memory) and keeps the backend's
own simulated makespan, when it gave one; `stats["rescore"]` and a warning say so.

Stopping early. `solve` makes one deadline (`planner.deadline.Deadline`: the caller's, or
`time_limit` from now), keeps a share of it for the re-score, and hands the rest to `_solve`
as `options.deadline` (with no `time_limit`), its span counted from then
(`Deadline.from_now`): a search's phases take shares of it (`part`, `share`, `reserve`,
`within`), and no backend computes a deadline from a number of seconds. Every search loop
looks at `past(options.deadline.at)`: true once it has passed *or* the user asked to stop. While `solve` runs in the main thread, the first
Ctrl-C (SIGINT) only asks to stop (`request_stop`): the backend returns its best answer so
far and `solve` marks the result with limit INTERRUPTED (status FEASIBLE unless optimality
was proven). A second Ctrl-C raises KeyboardInterrupt as usual.

Settings (`backends.settings`). Each backend declares its settings as a frozen dataclass (`settings_type`, a
`BackendSettings`: typed fields, documented, with today's defaults; `Annotated` rules such as
`POSITIVE` for the values). `solve` turns `options.extra` into that object once, before it
searches (`BackendSettings.of`: every name must be a field, every value of the field's type
and within its rules), and hands it to `_solve`; an unknown name or a bad value is one
BackendError line that names it and lists the valid names, e.g. "backend 'search' has no
setting 'tyop'; its settings are: mode". A settings object is itself a read-only mapping of
its fields, so it can be given as `extra` directly. What the caller and a running search say
to each other (answers, a stop flag) is not a setting: `SolveOptions.channel`.

The gap tolerance (`SolveOptions.gap_tolerance`, default 1e-4). A search with a lower bound
stops as soon as its answer is proven within the tolerance (objective <= bound * (1 +
tolerance), `proven_within`) and says OPTIMAL, as MIP solvers do; the bound it returns is
the one it proved, so `SolveResult.gap` is the gap reached, and `stats["gap_tolerance"]`
the tolerance. `_finish` holds every backend to that rule on the re-scored objective: an
answer its bound proves within the tolerance is OPTIMAL (limit None, unless the user
interrupted the search), and an OPTIMAL one its bound does not prove is FEASIBLE, with a
warning. Tolerance 0: exact proofs only (to float rounding, `PROOF_RTOL`).

The anytime trace. `solve` returns, in `stats["trace"]`, when each better answer and each
better lower bound came: {"incumbent": [[t, value], ...], "bound": [[t, value], ...]}, t in
seconds since `solve` started, values in the objective's units, the incumbents strictly
decreasing to the re-scored objective, the bounds strictly increasing to the result's bound,
at most `backends.trace.TRACE_POINTS` points each (`backends.trace` says how: it listens to
the search's `channel.on_incumbent` and `on_bound`, or takes the search's own trace when the
backend sets `own_trace`).

Progress. Long searches report best-so-far lines through the standard `logging` module
(`logging.getLogger("backends.<name>")`), at most one every `PROGRESS_SECONDS`
(`ProgressLog`); the command lines show them on stderr.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import (
    ClassVar,
    Generic,
    TypeVar,
)

from backends.settings import (
    POSITIVE,
    BackendSettings,
    Check,
    Coerce,
    at_least,
    between,
)
from backends.trace import TraceRecorder
from planner.deadline import (
    Deadline,
    catch_interrupt,
    past,
    request_stop,
    stop_requested,
)
from planner.errors import BackendError
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem
from planner.result import (
    OBJECTIVES,
    Channel,
    Limit,
    SolveOptions,
    SolveResult,
    Status,
    StopFlag,
    evaluate_objective,
    proven_within,
)

__all__ = [
    "OBJECTIVES",
    "POSITIVE",
    "PROGRESS_SECONDS",
    "BOUND_RTOL",
    "Backend",
    "BackendError",
    "BackendSettings",
    "Channel",
    "Check",
    "Coerce",
    "Limit",
    "ProgressLog",
    "SolveOptions",
    "SolveResult",
    "Status",
    "StopFlag",
    "at_least",
    "between",
    "evaluate_objective",
    "integral_bound",
    "past",
    "proven_within",
    "request_stop",
    "stop_requested",
]

PROGRESS_SECONDS = 5.0  # at most one progress line per search this often
RESCORE_SHARE = 0.05  # of a makespan search's time kept for the re-score's simulation
RESCORE_SKIPPED = "additive only: no time left to simulate"  # stats["rescore"]

log = logging.getLogger(__name__)

# A bound this close below an integer is that integer when every cost is one (the objective
# then is, and the difference is the solver's floating point): relative, at most half a unit
BOUND_RTOL = 1e-6


def integral_bound(bound: float) -> float:
    """A lower bound on an integer objective, rounded up to an integer: ceil(bound - tol) with
    tol = BOUND_RTOL * |bound| (at most 0.5), so 217,038.999999783 (an exact proof of
    217,039 in floating point) is 217,039, and 7.4 is 8 (an integer at least 7.4)."""
    if not math.isfinite(bound):
        return bound
    return float(math.ceil(bound - min(0.5, BOUND_RTOL * abs(bound))))


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


def _by_gap(
    raw: SolveResult, value: float, tolerance: float, name: str
) -> tuple[Status, Limit | None]:
    """The status the answer's re-scored `value` and its bound earn under the gap tolerance:
    OPTIMAL when the bound proves it within the tolerance (also when the search did not say
    so: it stopped on its clock just after the proof; not after a Ctrl-C, which says it was
    stopped), FEASIBLE when a search said OPTIMAL with a bound that does not prove it (a bug
    in that search, logged)."""
    status, limit = raw.status, raw.limit
    if raw.bound is None:
        return status, limit
    within = proven_within(value, raw.bound, tolerance)
    if status is Status.FEASIBLE and within and limit is not Limit.INTERRUPTED:
        return Status.OPTIMAL, None
    if status is Status.OPTIMAL and not within:
        log.warning(
            "%s: said OPTIMAL but its bound %.9g does not prove %.9g within the gap "
            "tolerance %g: reported as FEASIBLE",
            name,
            raw.bound,
            value,
            tolerance,
        )
        return Status.FEASIBLE, limit
    return status, limit


SettingsT = TypeVar("SettingsT", bound=BackendSettings)


class Backend(ABC, Generic[SettingsT]):
    """Base class: subclasses set the class attributes (`settings_type` among them: the
    backend's settings) and implement `_solve`.

    `objectives` are the objectives the backend optimizes; `needs_dnn_for` those of them for
    which it needs a problem built from a DNN (`Problem.is_dnn`): the makespan simulates the
    strategy, so every backend needs a DNN for it. `can_run` refuses the rest with a reason."""

    name: ClassVar[str]
    settings_type: type[SettingsT]
    objectives: ClassVar[tuple[str, ...]] = ("additive",)
    needs_dnn_for: ClassVar[tuple[str, ...]] = ("makespan",)
    exact: ClassVar[bool] = False
    REQUIRED_MODULES: ClassVar[tuple[str, ...]] = ()
    # True: `_solve` returns its own anytime trace in stats["trace"] (`backends.trace`), and
    # the answers it sends to `channel.on_incumbent` are not evaluated again for it
    own_trace: ClassVar[bool] = False

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
        if options.objective in self.needs_dnn_for and not problem.is_dnn:
            usable = [o for o in self.objectives if o not in self.needs_dnn_for]
            hint = f" (use the {usable[0]} objective)" if usable else ""
            return (
                f"backend {self.name!r} needs a problem built from a DNN for the "
                f"{options.objective} objective; {problem.name!r} is a cost-table problem{hint}"
            )
        return None

    def settings(self, options: SolveOptions) -> SettingsT:
        """`options.extra` as this backend's settings, checked (see the module docstring)."""
        return self.settings_type.of(options.extra, f"backend {self.name!r}")

    def solve(self, problem: Problem, options: SolveOptions | None = None) -> SolveResult:
        options = options or SolveOptions()
        settings = self.settings(options)
        reason = self.can_run(problem, options)
        if reason is not None:
            raise BackendError(reason)
        start = time.perf_counter()
        clock = options.clock()  # the one deadline of this solve
        trace = TraceRecorder(problem, options.objective, not self.own_trace, start)
        with catch_interrupt():
            search = clock
            if options.objective == "makespan" and math.isfinite(clock.at):
                search = clock.reserve(RESCORE_SHARE * clock.left())
            inner = options.with_deadline(search.from_now())
            inner = dataclasses.replace(inner, channel=trace.channel(inner.channel))
            raw = self._solve(problem, inner, settings)
            interrupted = stop_requested()
            elapsed = time.perf_counter() - start
            proven = raw.status in (Status.OPTIMAL, Status.INFEASIBLE) and raw.limit is None
            if interrupted and not proven:
                status = Status.FEASIBLE if raw.choices is not None else Status.NO_SOLUTION
                raw = dataclasses.replace(raw, status=status, limit=Limit.INTERRUPTED)
            return trace.finish(self._finish(problem, options, raw, elapsed, clock))

    @abstractmethod
    def _solve(self, problem: Problem, options: SolveOptions, settings: SettingsT) -> SolveResult:
        """Search with these settings (`options.extra` checked). Return choices, status,
        limit, bound, stats; the objective is re-scored."""

    def _finish(
        self,
        problem: Problem,
        options: SolveOptions,
        raw: SolveResult,
        elapsed: float,
        clock: Deadline | None = None,
    ) -> SolveResult:
        """Re-score `raw` (see the module docstring); `clock`: the whole solve's deadline.
        `stats["gap_tolerance"]`: the tolerance the search stopped at (an OPTIMAL answer is
        proven within it; `SolveResult.gap` is the gap reached)."""
        stats = {"search_seconds": elapsed, **raw.stats, "gap_tolerance": options.gap_tolerance}
        bound = raw.bound
        if (
            bound is not None
            and not float(bound).is_integer()
            and options.objective == "additive"
            and problem.integer_costs
        ):
            raw = dataclasses.replace(raw, bound=integral_bound(bound))
        if raw.objective is not None:
            stats["reported_objective"] = raw.objective
        if raw.choices is None:
            return SolveResult(self.name, raw.status, None, None, raw.bound, raw.limit, None, stats)
        choices = problem.check_choices(raw.choices)
        own = raw.objective if options.objective == "makespan" else None
        if own is not None and clock is not None and clock.expired():
            # no time left for the full simulation: check what the additive evaluator can
            # check (forbidden choices, memory) and keep the backend's own makespan
            value = own if math.isfinite(additive_cost(problem, choices)) else math.inf
            stats["rescore"] = RESCORE_SKIPPED
            log.warning(
                "%s: no time left to simulate the answer: its makespan (%.6g s) is the "
                "backend's own, checked for forbidden choices and memory only",
                self.name,
                raw.objective,
            )
        else:
            t0 = time.perf_counter()
            value = evaluate_objective(problem, choices, options.objective)
            if options.objective == "makespan":  # what a simulation of it costs (recommend)
                stats["simulate_seconds"] = time.perf_counter() - t0
        if not math.isfinite(value) or not memory_feasible(problem, choices):
            raise BackendError(
                f"backend {self.name!r} returned an invalid answer (forbidden choice or memory "
                "over the limit): this is a bug in the backend"
            )
        status, limit = _by_gap(raw, value, options.gap_tolerance, self.name)
        strategy = problem.strategy(choices) if problem.is_dnn else None
        return SolveResult(self.name, status, choices, value, raw.bound, limit, strategy, stats)
