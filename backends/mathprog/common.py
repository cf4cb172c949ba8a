"""What the `ilp` and `cpsat` backends share: the clock, the starts, the `SolverBackend` base.

Both backends are split into encode / solve / decode (see docs/solvers.md). Everything
around those three steps is the same for both and lives here:

- the additive objective (OptCNN Eq. 1): `backends.model.selection.Selection` is encoded with a
  warm start (`warm_choices`: SolveOptions.warm_start when it is valid, else
  `backends.heuristics.feasible`'s heuristic); if the time limit passes while encoding (`Clock` raises `OutOfTime`),
  the answer is that start (`out_of_time`);
- the makespan objective (DLPlacer, Pal et al. 2019, Eqs. 7-13): `placement_for` builds the
  `backends.placement.problem.PlacementProblem`, `SolverBackend.solve_placement` runs
  `backends.placement.series.solve_placement_problem` with the backend's model as the whole-problem
  solve, and `placement_result` turns its outcome into a SolveResult.

A subclass gives its solver's steps as `SolverSteps` (`encode_selection`, `encode_placement`,
`solve_encoded`, `decode_placement`, `decode`: the module's functions); `SolverBackend._solve`
calls them.

Settings. `IlpSettings` and `CpsatSettings` (the backends' `settings_type`) are defined here,
not in `ilp` and `cpsat` (which re-export them), so that the portfolio can name them without
importing either solver. Both extend `SolverSettings` (what the additive solve here reads),
which extends `backends.placement.series.PlacementSettings` (the makespan solve's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from backends.base import (
    POSITIVE,
    Backend,
    BackendError,
    Check,
    Limit,
    SolveOptions,
    SolveResult,
    Status,
    past,
    proven_within,
)
from backends.heuristics.feasible import (
    feasible_positions,
    improve,
    neighbourhood,
    rounded_positions,
)
from backends.mathprog.additive_lp import AdditiveProgram
from backends.mathprog.lns import SubSolve, lns_enabled, neighbourhood_search
from backends.model.selection import (
    Selection,
    edge_sizes,
    model_terms,
    restricted_terms,
    selection,
)
from backends.placement.problem import (
    PlacementError,
    PlacementOutcome,
    PlacementProblem,
    Schedule,
    placement_problem,
)
from backends.placement.series import PlacementSettings, solve_placement_problem, warm_schedule
from backends.trace import offer_answer
from planner.deadline import OutOfTime
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem

__all__ = [
    "CpsatSettings",
    "IlpSettings",
    "SolverBackend",
    "SolverSettings",
    "SolverSteps",
    "Warm",
    "out_of_time",
    "placement_for",
    "placement_result",
    "rounded_lp_start",
    "warm_choices",
]

START_FRACTION = 0.1  # of the time limit, at most, for polishing the start before encoding
# choices per node tried when the whole model is too big, the largest that fits first
RESTRICTED_CHOICES = (64, 32, 16, 8, 4, 3, 2, 1)
MAX_ROUNDS = 20  # restricted rounds at most
ROUND_SHARE = 0.1  # a new restricted round only with this share of the time limit left
RATE_GAIN = 2.0  # ... or when the last round ran this many times faster than assumed
LNS_WHOLE_SHARE = 0.3  # of the time limit for the whole model when the neighbourhoods follow
LARGE_POLISH_FRACTION = 0.4  # of the time left, at most, to polish the start of a restriction

Warm = tuple[tuple[int, ...], str]  # a valid choice vector and where it came from
ENCODE_TIMEOUT = "not run (time limit while encoding)"  # stats["solver_status"]
SYMMETRY_SHARE = 0.1  # of the time left, at most, for finding the device symmetries

POSITIVE_INT = Check("a positive integer", lambda v: v > 0)


@dataclass(frozen=True)
class SolverSettings(PlacementSettings):
    """The settings `ilp` and `cpsat` share: the makespan objective's (`PlacementSettings`)
    and the additive objective's below (docs/solvers.md)."""

    edges: Literal["marginal", "implied", "plain"] = "marginal"
    """the edge encoding: row and column sums ("marginal", a strong LP), only
    y >= x_u + x_v - 1 for positive costs ("implied"), or ("plain", cpsat) the product"""
    memory: Literal["auto", "rows", "chain"] = "auto"
    """the memory rule's form: a row per binding check time, a running sum, or by size"""
    seed_heuristic: bool = True
    """without a valid warm start, start from `backends.heuristics.feasible`'s answer"""
    lp_start: bool = True
    """round the LP relaxation into a start (and a bound) before the search"""
    terms_per_second: Annotated[float, POSITIVE] = 100_000.0
    """model terms worth building per second left; a larger model is restricted"""
    max_rounds: Annotated[int, POSITIVE_INT] = MAX_ROUNDS
    """restricted rounds at most"""

    def model_terms(self, sel: Selection) -> int:
        """About how many terms this solver's model of `sel` has (`model_terms`)."""
        return model_terms(sel, self.edges)

    def neighbourhoods(self, threads: int) -> bool:
        """Whether `backends.mathprog.lns` follows the whole model (with `threads`)."""
        return False


@dataclass(frozen=True)
class IlpSettings(SolverSettings):
    """The `ilp` backend's settings (`SolverSettings`, and `route_variables`)."""

    edges: Literal["marginal", "implied"] = "marginal"
    """row and column sums ("marginal") or only y >= x_u + x_v - 1 ("implied")"""
    terms_per_second: Annotated[float, POSITIVE] = 40_000.0
    """what CBC still searches well in the time (numpy builds faster)"""
    route_variables: bool = False
    """makespan: Eqs. 8-9's routing variables (needs routing "shortest")"""


@dataclass(frozen=True)
class CpsatSettings(SolverSettings):
    """The `cpsat` backend's settings (`SolverSettings`, and CP-SAT's own below)."""

    terms_per_second: Annotated[float, POSITIVE] = 15_000.0
    """building the model in Python takes ~8 us per term"""
    groups: bool = True
    """edge variables per group of equal rows and columns (not per pair of choices)"""
    presolve: bool = False
    """CP-SAT's presolve on the additive model"""
    interleave: bool = False
    """interleaved (deterministic) search with several workers"""
    parameters: Mapping[str, Any] = field(default_factory=dict)
    """CP-SAT parameters by name (`SatParameters`), checked when the solver is set up"""
    lns: bool | Literal["auto"] = "auto"
    """`backends.mathprog.lns` after the whole model: "auto" with one thread"""

    def model_terms(self, sel: Selection) -> int:
        return model_terms(sel, self.edges, self.groups)

    def neighbourhoods(self, threads: int) -> bool:
        return lns_enabled(self.lns, threads)


SettingsT = TypeVar("SettingsT", bound=SolverSettings)


class _Model(Protocol):
    stats: dict[str, Any]


ModelT = TypeVar("ModelT", bound=_Model)
RunT = TypeVar("RunT")


def warm_choices(
    problem: Problem,
    sel: Selection,
    options: SolveOptions,
    settings: SolverSettings,
    deadline: float = math.inf,
    polish_until: float | None = None,
) -> Warm | None:
    """SolveOptions.warm_start when it is valid, else `backends.heuristics.feasible`'s heuristic
    (unless `settings.seed_heuristic` is False), with where it came from; None when there is
    neither. Either is improved by the heuristic's local search until `polish_until`."""
    if options.warm_start is not None:
        ch = problem.check_choices(options.warm_start)
        if math.isfinite(additive_cost(problem, ch)) and memory_feasible(problem, ch):
            pos = sel.positions(ch)
            if pos is not None and polish_until is not None:
                ch = sel.choices(improve(sel, pos, min(deadline, polish_until)))
            return ch, "warm_start"
    if settings.seed_heuristic:
        pos = feasible_positions(sel, deadline, options.seed, polish_until)
        if pos is not None:
            return sel.choices(pos), "heuristic"
    return None


def rounded_lp_start(
    sel: Selection,
    ap: AdditiveProgram,
    x: np.ndarray,
    warm: tuple[int, ...] | None,
    until: float,
) -> tuple[tuple[int, ...] | None, str]:
    """The additive model's LP relaxation solution `x` (a value per column of `ap`) rounded to
    each node's largest x, repaired and improved until `until` (`rounded_positions`): its
    choices when they beat `warm` (else None), and what came of it (the stats' "lp_start")."""
    pos = rounded_positions(sel, [x[c] if c is not None else np.ones(1) for c in ap.x], until)
    if pos is None:
        return None, "rounding found no valid answer"
    choices = sel.choices(pos)
    value = sel.cost(choices)
    better = warm is None or value < sel.cost(warm)
    return (choices if better else None), f"rounded LP answer {value:.6g}" + (
        " (used)" if better else ""
    )


def placement_for(
    problem: Problem, settings: PlacementSettings, deadline: float = math.inf
) -> PlacementProblem:
    """The placement problem of `problem` under `settings.phases` and `settings.routing`
    (the search for device symmetries stops at `deadline`)."""
    try:
        return placement_problem(
            problem, phases=settings.phases, routing=settings.routing, deadline=deadline
        )
    except PlacementError as exc:
        raise BackendError(str(exc)) from None


def placement_result(
    pp: PlacementProblem | None, out: PlacementOutcome, limit: Limit | None, stats: dict, name: str
) -> SolveResult:
    """Makespan answers are FEASIBLE: the placement model is exact only over single-device
    placements and its schedule is not the simulator's (see docs/solvers.md); the model's
    own status, makespan, bound and gap are in the stats."""
    assert pp is not None
    stats.update(out.stats)
    stats.update(
        model_status=out.status,
        model_makespan=out.model_makespan,
        model_bound=out.bound,
        model_gap=out.gap,
        schedule_makespan=out.schedule.makespan if out.schedule else None,
    )
    if out.schedule is None:
        status = Status.INFEASIBLE if out.status == "INFEASIBLE" else Status.NO_SOLUTION
        return SolveResult(name, status, limit=limit, stats=stats)
    stats["placement"] = {
        pp.node_names[k]: pp.devices.devices[d].name for k, d in enumerate(out.schedule.placement)
    }
    return SolveResult(
        name, Status.FEASIBLE, pp.choices(out.schedule.placement), limit=limit, stats=stats
    )


def _better(a: SolveResult, b: SolveResult) -> bool:
    """a has an answer and b none, or a cheaper one."""
    if a.objective is None:
        return False
    return b.objective is None or a.objective < b.objective * (1 - 1e-12)


def _add(phases: dict[str, Any], **seconds: float) -> None:
    for key, value in seconds.items():
        phases[key] = phases.get(key, 0.0) + value


def out_of_time(sel: Selection, warm: Warm | None, name: str) -> SolveResult:
    """The time limit passed while encoding: the start, if there is one."""
    stats: dict[str, Any] = {"solver_status": ENCODE_TIMEOUT}
    if warm is None:
        return SolveResult(name, Status.NO_SOLUTION, limit=Limit.TIME, stats=stats)
    stats["hint"] = warm[1]
    return SolveResult(
        name, Status.FEASIBLE, warm[0], bound=sel.trivial_bound(), limit=Limit.TIME, stats=stats
    )


@dataclass(frozen=True)
class SolverSteps(Generic[SettingsT, ModelT, RunT]):
    """A solver's encode / solve / decode functions (the `ilp` or `cpsat` module's)."""

    encode_selection: Callable[[Selection, SolveOptions, SettingsT, Warm | None, float], ModelT]
    encode_placement: Callable[
        [PlacementProblem, SolveOptions, SettingsT, tuple[Schedule, str] | None, float], ModelT
    ]
    # at most that many seconds, the search itself ending by the second float at the latest
    solve_encoded: Callable[[ModelT, SolveOptions, SettingsT, float, float], RunT]
    decode_placement: Callable[[ModelT, RunT], PlacementOutcome]
    decode: Callable[[Problem, ModelT, RunT, str], SolveResult]  # str: the backend's name


class _Reported:
    """The caller's `on_incumbent`, given only answers better than the last it was given.
    When only the anytime trace listens (`backends.trace.AnswerListener` without a caller's
    callback), answers pass unvalued: the trace values them within its rate window, so a
    standalone solve computes no cost per answer."""

    def __init__(self, problem: Problem, send: Callable[[tuple[int, ...], str], None] | None):
        self.problem, self.send, self.value = problem, send, math.inf

    def __call__(self, choices: Sequence[int], who: str) -> None:
        if self.send is None:
            return
        if not getattr(self.send, "forwards", True):
            self.send(tuple(choices), who)  # O(1) for a tuple: no per-answer copy
            return
        answer = tuple(int(c) for c in choices)
        self.offer(additive_cost(self.problem, answer), who, lambda: answer)

    def offer(self, value: float, who: str, choices: Callable[[], tuple[int, ...]]) -> None:
        """A better answer whose `value` the search knows (`backends.trace.offer_answer`)."""
        if value < self.value:
            self.value = value
            offer_answer(self.send, value, who, choices)


class SolverBackend(Backend[SettingsT], Generic[SettingsT, ModelT, RunT]):
    """A backend that encodes a model, runs a solver on it and decodes the run, on both
    objectives. Subclasses set `name`, `REQUIRED_MODULES`, `settings_type` and `steps`, their
    solver's encode / solve / decode functions."""

    objectives = ("additive", "makespan")
    exact = True
    steps: SolverSteps[SettingsT, ModelT, RunT]
    solve_sub: SubSolve | None = None  # the neighbourhood search's round solver

    def encode(self, problem: Problem, options: SolveOptions, deadline: float = math.inf) -> ModelT:
        """The model of `problem` under options.objective and the settings in options.extra
        (raises OutOfTime past deadline)."""
        settings = self.settings(options)
        if options.objective == "additive":
            sel = selection(problem)
            warm = warm_choices(problem, sel, options, settings)
            return self.steps.encode_selection(sel, options, settings, warm, deadline)
        pp = placement_for(problem, settings, options.clock().share(SYMMETRY_SHARE).at)
        warm_pp = warm_schedule(pp, options, settings)
        return self.steps.encode_placement(pp, options, settings, warm_pp, deadline)

    def solve_placement(
        self,
        pp: PlacementProblem,
        options: SolveOptions,
        warm: tuple[Schedule, str] | None = None,
        settings: SettingsT | None = None,
    ) -> PlacementOutcome:
        """Warm start, series bound and the whole model by options' deadline (see
        `backends.placement.series.solve_placement_problem`), with `settings` (default: those
        in options.extra)."""
        settings = settings if settings is not None else self.settings(options)
        return solve_placement_problem(pp, options, settings, self._solve_model, warm)

    def _solve_model(
        self,
        pp: PlacementProblem,
        options: SolveOptions,
        settings: SettingsT,
        warm: Schedule | None,
    ) -> PlacementOutcome:
        """One solve of the placement model by options' deadline, its encoding included:
        the last step of `solve_placement`, and each segment's solve of the series bound.
        When the model cannot be encoded in time the solver does not run (no schedule; the
        caller keeps its start)."""
        steps = self.steps
        t0 = time.perf_counter()
        until = options.clock().at
        try:
            model = steps.encode_placement(
                pp, options, settings, (warm, "hint") if warm is not None else None, until
            )
        except OutOfTime:
            stats = {"solver_status": ENCODE_TIMEOUT, "encode_seconds": time.perf_counter() - t0}
            return PlacementOutcome("NO_SOLUTION", None, None, None, True, stats)
        encoded = time.perf_counter()
        run = steps.solve_encoded(model, options, settings, max(1e-3, until - encoded), math.inf)
        out = steps.decode_placement(model, run)
        return replace(out, stats={**out.stats, "encode_seconds": encoded - t0})

    def _solve(self, problem: Problem, options: SolveOptions, settings: SettingsT) -> SolveResult:
        if options.objective == "makespan":
            pp = placement_for(problem, settings, options.clock().share(SYMMETRY_SHARE).at)
            out = self.solve_placement(pp, options, settings=settings)
            limit = Limit.TIME if out.timed_out else None
            return placement_result(pp, out, limit, {}, self.name)
        t0 = time.perf_counter()
        clock = options.clock()
        deadline = clock.at
        reported = _Reported(problem, options.channel.on_incumbent)
        options = replace(options, channel=replace(options.channel, on_incumbent=reported))
        lns = self.solve_sub is not None and settings.neighbourhoods(options.threads)
        # with the neighbourhood search the whole model searches only until `until` (its
        # LP and bound included), the neighbourhoods the rest of the time
        until = clock.part(LNS_WHOLE_SHARE).at if lns else deadline
        full = selection(problem)
        t1 = time.perf_counter()
        polish = clock.part(START_FRACTION).at
        warm = warm_choices(problem, full, options, settings, deadline, polish)
        t2 = time.perf_counter()
        phases: dict[str, Any] = {"selection_seconds": t1 - t0, "start_seconds": t2 - t1}
        rate = settings.terms_per_second
        round_ = partial(self._round, problem, full, options=options, settings=settings,
                         deadline=deadline, until=until, phases=phases)  # fmt: skip
        best, k, used = round_(warm, rate=rate)
        rounds, improved = 1, True
        while True:
            if rounds > 1:
                result, k, used = round_(warm, rate=rate)
                improved = _better(result, best)
                whole = k is None and result.objective is not None and not _better(best, result)
                if improved or whole:  # the whole model's answer carries its proof and bound
                    best = result
                elif result.limit is Limit.TIME:
                    best = replace(best, limit=Limit.TIME)  # the last round met the limit
            rounds += 1
            result = best
            if k is None or result.status is Status.INFEASIBLE or result.choices is None:
                break  # the whole model was solved (or nothing can be)
            # A restricted model was solved before the limit: search again around the best
            # answer (a large-neighbourhood search), with the rate this round achieved, so a
            # larger neighbourhood or the whole model is tried when it now looks affordable.
            if past(until) or until - time.perf_counter() < ROUND_SHARE * clock.limit:
                best = replace(best, limit=Limit.TIME)
                break
            if rounds > settings.max_rounds:
                break
            faster = used is not None and used > rate * RATE_GAIN
            # no gain at this size: the next round allows a larger neighbourhood
            rate = max(rate, used or 0.0) if improved or faster else rate * RATE_GAIN
            assert best.choices is not None
            warm = (best.choices, "restricted round")
        phases["restricted_rounds"] = rounds - 1
        if lns and best.status is Status.FEASIBLE and best.choices is not None:
            best = self._neighbourhood_search(problem, full, best, options, deadline, phases)
        phases["solve_seconds"] = time.perf_counter() - t0
        if best.choices is not None:  # an answer of a restricted round is not reported by
            reported(best.choices, self.name)  # the solver's callback: the caller gets it here
        return replace(best, stats={**best.stats, **phases})

    def _neighbourhood_search(
        self,
        problem: Problem,
        full: Selection,
        best: SolveResult,
        options: SolveOptions,
        deadline: float,
        phases: dict[str, Any],
    ) -> SolveResult:
        """`backends.mathprog.lns` from the best answer until the deadline; its answer, proven optimal
        when its last neighbourhood was the whole problem, or when it meets the bound."""
        assert best.choices is not None and self.solve_sub is not None
        channel = options.channel
        tolerance = options.gap_tolerance
        bound = max(
            best.bound if best.bound is not None else full.trivial_bound(),
            channel.known_bound() or -math.inf,  # e.g. the unconstrained optimum (auto)
        )
        out = neighbourhood_search(
            problem, full, best.choices, deadline, seed=options.seed, stop=channel.stop,
            incoming=channel.incoming, on_incumbent=channel.on_incumbent,
            solve_sub=self.solve_sub, bound=bound, tolerance=tolerance,
        )  # fmt: skip
        phases["lns"] = out.stats
        phases["lns_seconds"] = out.stats["seconds"]
        current = best.objective if best.objective is not None else full.cost(best.choices)
        improved = out.value < current
        value = out.value if improved else current
        bound = max(bound, out.bound if out.bound is not None else -math.inf)
        optimal = out.proven or best.status is Status.OPTIMAL
        optimal = optimal or proven_within(value, bound, tolerance)
        if optimal:  # what the proof says: the optimum is at least value / (1 + tolerance)
            bound = max(bound, value / (1 + tolerance))
        stats = {**best.stats, "answer": "lns"} if improved else dict(best.stats)
        return replace(
            best,
            status=Status.OPTIMAL if optimal else Status.FEASIBLE,
            choices=out.choices if improved else best.choices,
            objective=value,
            bound=min(bound, value),
            limit=None if optimal else Limit.TIME,
            stats=stats,
        )

    def _round(
        self,
        problem: Problem,
        full: Selection,
        warm: Warm | None,
        *,
        options: SolveOptions,
        settings: SettingsT,
        deadline: float,
        until: float,
        rate: float,
        phases: dict[str, Any],
    ) -> tuple[SolveResult, int | None, float | None]:
        """Fit (maybe restricted around `warm`, to `rate` model terms per second left),
        encode, solve and decode once; the solver searches until `until` at the latest.
        Returns the result (its objective in `full`'s tables), the restriction k (None: the
        whole model) and the model terms encoded and solved per second (None when nothing
        was solved); adds to `phases`."""
        t2 = time.perf_counter()
        sel, k, warm = self._fit(problem, full, warm, settings, rate, deadline)  # restricted?
        t3 = time.perf_counter()
        _add(phases, size_seconds=t3 - t2)
        phases["restricted"] = k
        if sel is None:  # even the smallest model is too large for the time left
            return out_of_time(full, warm, self.name), k, None
        if k is not None:  # a restricted model's bounds say nothing of the problem's optimum
            options = replace(options, channel=replace(options.channel, on_bound=None))
        try:
            model = self.steps.encode_selection(sel, options, settings, warm, deadline)
        except OutOfTime:
            return out_of_time(full, warm, self.name), k, None
        t4 = time.perf_counter()
        run = self.steps.solve_encoded(model, options, settings, deadline - t4, until)
        t5 = time.perf_counter()
        result = self.steps.decode(problem, model, run, self.name)
        if result.choices is not None:  # compared with the other rounds' answers
            result = replace(result, objective=full.cost(result.choices))
        t6 = time.perf_counter()
        _add(phases, encode_seconds=t4 - t3, model_seconds=t5 - t4, decode_seconds=t6 - t5)
        if k is not None and result.status is not Status.INFEASIBLE:
            # the restricted model's optimum and bound say nothing about the whole problem
            status = Status.FEASIBLE if result.has_solution else Status.NO_SOLUTION
            result = replace(result, status=status, bound=full.trivial_bound())
        used = settings.model_terms(sel) / max(t6 - t3, 1e-3)
        return result, k, used

    def _fit(
        self,
        problem: Problem,
        sel: Selection,
        warm: Warm | None,
        settings: SettingsT,
        rate: float,
        deadline: float,
    ) -> tuple[Selection | None, int | None, Warm | None]:
        """`sel` if its model fits the time left (`rate` model terms per second), else the
        largest restriction around the (further polished) start that does (k choices per
        node), else None; with the start."""
        budget = rate * max(0.0, deadline - time.perf_counter())
        if sel.infeasible or settings.model_terms(sel) <= budget:
            return sel, None, warm
        if warm is None:
            return None, None, None
        pos = sel.positions(warm[0])
        assert pos is not None
        # a restricted model only searches near its start: give the start's local search
        # more of the time first (it converges on 35,000 nodes in 10-30 s)
        now = time.perf_counter()
        pos = improve(sel, pos, now + LARGE_POLISH_FRACTION * (deadline - now))
        warm = (sel.choices(pos), warm[1])
        budget *= (deadline - time.perf_counter()) / max(1e-9, deadline - now)
        sizes = edge_sizes(sel)
        for k in RESTRICTED_CHOICES:  # the largest k that looks small enough, built once
            if past(deadline):
                break
            if restricted_terms(sel, k, sizes) > budget:
                continue
            small = selection(problem, neighbourhood(sel, pos, k))
            if settings.model_terms(small) <= 1.5 * budget:
                return small, k, warm
        return None, None, warm
