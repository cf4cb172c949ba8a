"""The result contract every backend follows (docs/architecture.md, Backends): what to
solve (`SolveOptions`), how a search ended (`Status`, `Limit`) and its answer
(`SolveResult`), with `evaluate_objective`, the re-score no backend's own number replaces.

These live in the core so that `planner.plan` and the recommendation rule use them without
importing a backend; `backends` builds on them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from planner.deadline import Deadline
from planner.errors import BackendError
from planner.problems.evaluate import additive_cost

if TYPE_CHECKING:
    from planner.costs.costmodel import CostOptions
    from planner.pipeline.problem import Layout, PipelineProblem
    from planner.pipeline.spec import PipelinedStrategy
    from planner.pipeline.timeline import PipelineTimeline
    from planner.problems.problem import Problem
    from planner.problems.strategy import Strategy

__all__ = [
    "DEFAULT_GAP_TOLERANCE",
    "DEFAULT_SOLVE_SECONDS",
    "OBJECTIVES",
    "BackendError",
    "Channel",
    "Limit",
    "PipelineResult",
    "PipelineSolver",
    "SolveOptions",
    "Solver",
    "SolveResult",
    "Status",
    "StopFlag",
    "evaluate_objective",
    "format_cost",
    "gap_tolerance_error",
    "proven_within",
    "result_gap",
]

OBJECTIVES = ("additive", "makespan")
DEFAULT_SOLVE_SECONDS = 10.0  # seconds, for SolveOptions given neither a time_limit nor a deadline
# The relative gap (objective / bound - 1) at which every search with a bound stops and calls
# its answer OPTIMAL: the default of MIP solvers (Gurobi's MIPGap and CPLEX's mip tolerances
# mipgap are 1e-4; HiGHS's mip_rel_gap too). 0 proves the optimum exactly.
DEFAULT_GAP_TOLERANCE = 1e-4
# Floating point in the proofs themselves (sums in another order, integer scaling): a gap this
# small above the tolerance still counts as within it (the exact backends agree to 1e-9).
PROOF_RTOL = 1e-9


class Status(enum.Enum):
    """How a search ended: what its answer is worth (a proof, an answer, or nothing)."""

    # proven optimal within the relative gap tolerance (`SolveOptions.gap_tolerance`, the MIP
    # convention): objective <= bound * (1 + tolerance); exactly optimal with tolerance 0
    OPTIMAL = "OPTIMAL"
    FEASIBLE = "FEASIBLE"  # a valid answer, optimality not proven
    INFEASIBLE = "INFEASIBLE"  # proven that no valid answer exists
    NO_SOLUTION = "NO_SOLUTION"  # nothing found, nothing proven


class Limit(enum.Enum):
    """Why a search stopped before it could prove anything more (None in a result: it
    finished on its own)."""

    TIME = "TIME"
    ITERATIONS = "ITERATIONS"
    INTERRUPTED = "INTERRUPTED"  # the user asked to stop (Ctrl-C): best answer so far


class StopFlag(Protocol):
    """What a search polls to know it should stop: a `threading.Event` or a
    `multiprocessing.Event`."""

    def is_set(self) -> bool:
        """Whether the search should stop now."""


@dataclass(frozen=True)
class Channel:
    """How the caller of a running search talks with it (the portfolio with its members):
    not a setting, and not compared between options.

    `on_incumbent(choices, who)` is called with each better answer a search finds (`ilp`'s
    LP rounding; `cpsat`'s solutions, LP rounding and neighbourhood search); `stop`, once
    set, stops the search early as Ctrl-C does (`ilp`, `cpsat`); `incoming()` returns a
    better answer found elsewhere, or None, which `cpsat`'s neighbourhood search continues
    from at its next round. `on_candidate(choices, who)` is called with a valid answer that
    is not better than the search's best but may lead to one (`toulbar2`'s repaired rounds
    within a few percent of its best), and `candidate()` returns such an answer found
    elsewhere, or None, which `local` anneals from once its own search has stalled.
    `on_bound(bound, who)` is called with each better lower bound a search proves while it
    runs (`ilp`'s CBC, `cpsat`'s, `toulbar2`'s Lagrangian bound), so that the portfolio can
    stop every member once the best answer is within the gap tolerance of the best bound;
    `bound()` returns the best lower bound proven elsewhere, or None (the portfolio's shared
    bound, `auto`'s unconstrained optimum): `local` and `mcmc`, which prove none, stop when
    their answer is within the tolerance of it. Backends that do not take part ignore the
    channel. `Backend.solve` listens to `on_incumbent` and `on_bound` itself (the anytime
    trace, `stats["trace"]`: `backends.trace`) and passes every call on to the caller's."""

    on_incumbent: Callable[[tuple[int, ...], str], None] | None = None
    stop: StopFlag | None = None
    incoming: Callable[[], Sequence[int] | None] | None = None
    on_candidate: Callable[[tuple[int, ...], str], None] | None = None
    candidate: Callable[[], Sequence[int] | None] | None = None
    on_bound: Callable[[float, str], None] | None = None
    bound: Callable[[], float | None] | None = None

    def known_bound(self) -> float | None:
        """The lower bound proven elsewhere (`bound()`), None when there is none."""
        return self.bound() if self.bound is not None else None


@dataclass(frozen=True)
class SolveOptions:
    """What to solve and within what: `objective` ("additive": OptCNN's Eq. 1 cost tables;
    "makespan": the simulated iteration time, FlexFlow Sec. 5), the time the whole `solve`
    has: either a wall-clock `time_limit` in seconds or a `deadline` shared with the caller's
    other phases, never both (neither: `DEFAULT_SOLVE_SECONDS`), a `seed` (every search is
    deterministic for one seed, given the same limit), `threads` for the solvers that use
    several, an optional `warm_start` (a choice vector, used as the incumbent where
    supported), the backend-specific `extra` settings (a mapping of setting names to values,
    or the backend's settings object, itself such a mapping: `Backend.solve` checks it
    against the backend's `settings_type` once, and an unknown name or a bad value is a
    BackendError) and the `channel` a caller talks with the running search through
    (`Channel`). A caller that narrows the time of a solve it was given uses `within`.

    `gap_tolerance`: every search with a lower bound stops as soon as its answer is proven
    within this relative gap of the optimum (objective <= bound * (1 + gap_tolerance),
    `proven_within`) and returns it as OPTIMAL, the MIP solvers' convention; the bound it
    reports stays the one it proved, so `SolveResult.gap` is the gap actually reached
    (`stats["gap_tolerance"]` records the tolerance). 0 proves the optimum exactly;
    default `DEFAULT_GAP_TOLERANCE` (1e-4)."""

    objective: str = "additive"
    time_limit: float | None = None
    seed: int = 0
    threads: int = 1
    warm_start: tuple[int, ...] | None = None  # choices from another backend, where supported
    extra: Mapping[str, Any] = field(default_factory=dict)  # backend-specific settings
    gap_tolerance: float = DEFAULT_GAP_TOLERANCE
    deadline: Deadline | None = field(default=None, compare=False)
    channel: Channel = field(default_factory=Channel, compare=False)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise BackendError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.time_limit is not None and self.deadline is not None:
            raise BackendError(
                "SolveOptions takes a time_limit or a deadline, not both "
                f"(got time_limit={self.time_limit:g}): use options.with_deadline(deadline)"
            )
        if self.time_limit is not None and not self.time_limit > 0:
            raise BackendError(f"time_limit must be positive, got {self.time_limit}")
        if self.threads < 1:
            raise BackendError(f"threads must be >= 1, got {self.threads}")
        reason = gap_tolerance_error(self.gap_tolerance)
        if reason is not None:
            raise BackendError(reason)

    def clock(self) -> Deadline:
        """The deadline of this solve: `deadline`, else `time_limit` (or the default) from
        now (`Backend.solve` makes it once, so every phase reads the same)."""
        if self.deadline is not None:
            return self.deadline
        return Deadline.after(DEFAULT_SOLVE_SECONDS if self.time_limit is None else self.time_limit)

    def with_deadline(self, deadline: Deadline) -> SolveOptions:
        """These options with `deadline` as their time instead of theirs (and no
        `time_limit`): a phase's own part of the solve's deadline."""
        return replace(self, time_limit=None, deadline=deadline)


def gap_tolerance_error(value: Any) -> str | None:
    """None when `value` is a valid relative gap tolerance (a number in [0, 1)), else what is
    wrong with it, in one line."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and 0 <= value < 1:
        return None
    return (
        "gap_tolerance must be a number in [0, 1) (a relative gap: 1e-4 stops a search once "
        f"its answer is proven within 0.01% of the optimum; 0 proves it exactly), got {value!r}"
    )


def proven_within(objective: float | None, bound: float | None, tolerance: float) -> bool:
    """Whether `bound` proves `objective` within the relative gap `tolerance` of the optimum
    (objective / bound - 1 <= tolerance, `result_gap`, up to `PROOF_RTOL` of floating point):
    the rule at which every search stops (`SolveOptions.gap_tolerance`)."""
    gap = result_gap(objective, bound)
    return gap is not None and gap <= tolerance + PROOF_RTOL


def result_gap(objective: float | None, bound: float | None) -> float | None:
    """objective / bound - 1 where both are known (0 when proven optimal)."""
    if objective is None or bound is None:
        return None
    if bound <= 0:
        return 0.0 if objective <= 0 else math.inf
    return max(0.0, objective / bound - 1.0)


def format_cost(value: float | None) -> str:
    """A cost-table objective or bound as people read it: the costs have no unit, so a plain
    number, every digit of an integer ('1,549,187,759'), else up to 15 significant digits;
    '-' for None."""
    if value is None:
        return "-"
    if math.isfinite(value) and float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.15g}"


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
        """Whether an answer was found (`choices` is not None)."""
        return self.choices is not None

    def objective_value(self) -> float:
        """The objective; BackendError when there is no answer."""
        if self.objective is None:
            raise BackendError(f"{self.backend} returned no solution (status {self.status.value})")
        return self.objective

    @property
    def gap(self) -> float | None:
        """objective / bound - 1 where both are known (0 when proven optimal)."""
        return result_gap(self.objective, self.bound)


class Solver(Protocol):
    """A backend as planner sees it (`backends.base.Backend` implements it): its name, the
    objectives it optimizes, whether it proves optima, `can_run` and `solve`."""

    name: str
    objectives: tuple[str, ...]
    exact: bool

    def can_run(self, problem: Problem, options: SolveOptions) -> str | None:
        """None when it can solve `problem` as asked, else the reason it cannot."""
        ...

    def solve(self, problem: Problem, options: SolveOptions | None = None) -> SolveResult:
        """Search `problem` as `options` say; the answer re-scored by planner's evaluators."""
        ...

    def settings(self, options: SolveOptions) -> Mapping[str, Any]:
        """`options.extra` checked as this backend's settings (its settings object, a
        mapping of its fields); a BackendError names a bad setting and lists the valid ones."""
        ...


def evaluate_objective(
    problem: Problem, choices: Sequence[int], objective: str, deadline: float = math.inf
) -> float:
    """The requested objective of a choice vector, from planner's evaluators: OptCNN's Eq. 1
    on the tables, or the makespan of FlexFlow's full simulation of the strategy (which
    raises `planner.deadline.OutOfTime` past `deadline`, a perf_counter value)."""
    if objective == "additive":
        return additive_cost(problem, choices)
    if not problem.is_dnn:
        raise BackendError(
            f"the makespan objective needs a problem built from a DNN; {problem.name!r} is "
            "a cost-table problem (use the additive objective)"
        )
    from planner.sim.simulator import Simulator

    # The makespan only: a Timeline with every task's name costs twice the simulation
    # (1.3 million tasks on 1,024 GPUs: 28 s of names for a 15 s simulation).
    return Simulator(problem.dnn().cost_model, problem.strategy(choices).configs, deadline).makespan


@dataclass(frozen=True)
class PipelineResult(SolveResult):
    """The pipeline search's answer (`backends.pipeline.search.PipelineSearch`): `status`
    FEASIBLE with a layout, INFEASIBLE when no layout of the space fits the memory, or
    NO_SOLUTION; `limit` TIME, INTERRUPTED, ITERATIONS (its cap on exact simulations) or
    None; `objective` the simulated step in seconds, `bound` the compute bound (no layout of
    any kind steps faster), `gap` the shared rule (`result_gap`). No `choices`: the answer is
    the pipelined strategy `planned` (`strategy` is its micro-batch strategy), the `layout`
    it follows, the `cost_options` it was simulated with (the layout's recomputation and
    ZeRO), its simulated `timeline` and the search's `estimate` of its step. `message`: why
    there is no answer, in one line."""

    planned: PipelinedStrategy | None = None
    layout: Layout | None = None
    cost_options: CostOptions | None = None
    timeline: PipelineTimeline | None = None
    estimate: float | None = None
    message: str | None = None

    @property
    def has_solution(self) -> bool:
        """Whether a layout was found (`planned` is not None)."""
        return self.planned is not None

    @property
    def peak_bytes(self) -> float | None:
        """The answer's most memory on one device, simulated (None without an answer)."""
        return max(self.timeline.peak_bytes) if self.timeline is not None else None


class PipelineSolver(Protocol):
    """The pipeline search as planner sees it (`backends.pipeline.search.PipelineSearch`
    implements it, reached through `planner.registry.get_pipeline_solver`)."""

    name: str

    def settings(self, options: SolveOptions) -> Mapping[str, Any]:
        """`options.extra` checked as the search's settings: one BackendError line for a bad
        one, naming the valid settings."""
        ...

    def solve(
        self, problem: PipelineProblem, options: SolveOptions | None = None
    ) -> PipelineResult:
        """Search `problem` as `options` say (the time from `options.clock()`)."""
        ...
