"""The `local` backend: a compiled local search for cost-table problems (additive objective).

1. Flatten the Problem once (`backends.local.flat`).
2. Compile (or load from numba's cache) the kernels in a thread the deadline bounds: the
   compile time counts against the time limit (`stats["compile_seconds"]`); past the
   deadline, NO_SOLUTION with the reason in `stats["reason"]`.
3. Feasible first (`kernels.arc_consistency`, `least_memory_start`, `mac_start`,
   `repair`): forbidden pairs propagated (AC-3), the least-memory strategies, the nodes
   placed in turn maintaining arc consistency (least usage first; then, if its repair
   fails, lowest cost first), then min-conflicts on forbidden pairs and cheapest-per-byte
   memory repair, until the answer is valid (`stats["first_feasible_seconds"]`). A node left
   without strategies, or with one memory pool an over-full least-memory start, proves that
   no answer exists (INFEASIBLE); a repair that finds nothing in time is NO_SOLUTION, never
   an invalid answer.
   A valid `warm_start` replaces the construction (`stats["warm_start"]` is its cost).
4. Simulated annealing over valid states (`kernels.anneal`) in rounds: each round cools
   geometrically from its start temperature to `end_temperature` and the next restarts from
   the best state, cooler (`restart_temperature`). Temperatures are relative to the median
   uphill single-node move at the first valid state; a round is `round_moves` moves or, by
   default, sized from the rate so far so that ROUNDS_IN_BUDGET rounds fit in the time left.
   The moves run in chunks sized to take about CHUNK_SECONDS; the clock (and Ctrl-C) is
   looked at between chunks. A run ends at the deadline (limit TIME), after `max_moves`
   (limit ITERATIONS), or after `patience` rounds without a better answer (limit None): for a
   seed and a move count the answer is always the same.

With a caller's `SolveOptions.channel` (the portfolio): each better answer goes to
`on_incumbent` at the end of a round and at most every SEND_SECONDS within one; between two
chunks a better answer from `incoming()` is adopted and a new round starts from it
(`stats["adopted"]` counts them); `stop` ends the search as the deadline does.
`stats["trace"]`: the best after every chunk of moves (`backends.trace`).

The answer is FEASIBLE (never OPTIMAL: nothing is proven), with no bound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np

from backends.base import (
    POSITIVE,
    Backend,
    BackendSettings,
    Channel,
    Check,
    Limit,
    ProgressLog,
    SolveOptions,
    SolveResult,
    Status,
    at_least,
    between,
    past,
    proven_within,
)
from backends.local import kernels
from backends.local.flat import FlatProblem, flatten
from backends.trace import Improvements, own_trace
from planner.deadline import OutOfTime, run_within
from planner.problems.problem import Problem

__all__ = ["LocalBackend", "LocalSettings", "compile_kernels"]

REPAIR_CHUNK = 2000  # repair steps between two looks at the clock
MIN_ROUND = 20_000  # moves of an automatic round at the least (small problems end early)
ROUNDS_IN_BUDGET = 3  # automatic rounds are sized so that this many fit in what is left
FIRST_CHUNK = 1000  # annealing moves in the first chunk; then sized to CHUNK_SECONDS
CHUNK_SECONDS = 0.05  # between two looks at the clock
MAC_TRIES = 3  # strategies a node tries in the construction before it is left to the repair
SEND_SECONDS = 1.0  # a better answer goes to the caller's channel at most this often mid-round
STALL_SECONDS = 10.0  # the search has stalled when its best fell by less than STALL_GAIN in
STALL_GAIN = 1e-3  # this long: then it takes a candidate (`Channel.candidate`) to anneal from
# (IOPDDL S, portfolio: after adopting a toulbar2 round it gains 3% in 25 s, then 0.02% in
# the next 100 s)
CALIBRATION_SAMPLES = 4000  # random single-node moves that set the temperature unit
_NONNEGATIVE_INT = Check("an integer >= 0", lambda v: v >= 0)


@dataclass(frozen=True)
class LocalSettings(BackendSettings):
    """The `local` backend's settings (module docstring)."""

    start_temperature: Annotated[float, POSITIVE] = 0.3
    """the first round's start temperature, in median uphill moves at the first valid state"""
    restart_temperature: Annotated[float, POSITIVE] = 0.05
    """later rounds' start temperature (a restart from the best), in the same unit"""
    end_temperature: Annotated[float, POSITIVE] = 1e-4
    """every round's end temperature, in the same unit"""
    round_moves: Annotated[int, _NONNEGATIVE_INT] = 0
    """moves per round; 0: 300 per movable node (at least MIN_ROUND), fewer when the rate of
    moves so far would not fit ROUNDS_IN_BUDGET rounds in the time (or `max_moves`) left"""
    patience: Annotated[int, _NONNEGATIVE_INT] = 5
    """rounds without a better answer before the search ends; 0: run to the time limit"""
    max_moves: Annotated[int, _NONNEGATIVE_INT] = 0
    """a cap on the annealing moves (limit ITERATIONS); 0: none"""
    edge_share: Annotated[float, between(0, 1)] = 0.1
    """the share of moves that move both ends of an edge to their best pair"""
    repair_share: Annotated[float, between(0, 1)] = 0.2
    """the share of moves of one node with its neighbours' best responses"""
    tree_share: Annotated[float, between(0, 1)] = 0.0
    """the share of moves of a tree of nodes to its best assignment given the rest (0 by
    default: on the contest instances 0.2 took G from 12.5 to 7.1 million but M from 1.0e11
    to 2.4e11, see docs/solvers.md)"""
    repair_steps: Annotated[int, at_least(1, "an integer")] = 200
    """repair steps at most per node (then NO_SOLUTION)"""


_COMPILED: dict[str, float] = {}


def compile_kernels() -> float:
    """Run every kernel once on a two-node problem (numba compiles or loads its cache); the
    seconds it took, the first time in this process (0 after)."""
    if "seconds" in _COMPILED:
        return 0.0
    t0 = time.perf_counter()
    from planner.problems.costtable import random_problem

    flat = flatten(random_problem(3, 2, seed=0, memory=True))
    arrays = flat.arrays()
    state = kernels.new_state(arrays, flat.num_times, 0, flat.max_size)
    alive = np.isfinite(flat.cost).astype(np.uint8)
    kernels.arc_consistency(arrays, alive)
    kernels.least_memory_start(arrays, state)
    kernels.mac_start(arrays, state, alive, False, 2)
    kernels.repair(arrays, state, 10)
    kernels.take_current_as_best(arrays, state)
    kernels.uphill_deltas(arrays, state, 10)
    kernels.anneal(arrays, state, 100, 0, 100, 1.0, 0.01, 0.2, 0.2, 0.2)
    kernels.reset_to_best(arrays, state)
    kernels.memory_ok(arrays, state)
    _COMPILED["seconds"] = time.perf_counter() - t0
    return _COMPILED["seconds"]


def _adopt(arrays: tuple[np.ndarray, ...], state: tuple[np.ndarray, ...], choices: Any) -> bool:
    """Continue from `choices` (a valid answer found elsewhere: a warm start, another
    backend's answer) as the best state; False, and the state as it was, if it is not valid
    (a forbidden strategy or pair, or memory over the limit)."""
    x = state[0]
    kept = state[1].copy()
    x[:] = np.asarray(choices, dtype=np.int64)
    kernels.take_current_as_best(arrays, state)  # the best is x, its cost computed
    kernels.reset_to_best(arrays, state)  # the trees built from it
    if math.isfinite(float(state[6][kernels.F_BEST])) and kernels.memory_ok(arrays, state):
        return True
    state[1][:] = kept
    kernels.reset_to_best(arrays, state)
    return False


class _Link:
    """The search's side of `SolveOptions.channel`: each better answer sent (at most every
    SEND_SECONDS, and at the end of every round), a better answer from elsewhere adopted,
    the caller's stop flag."""

    def __init__(
        self,
        channel: Channel,
        arrays: tuple[np.ndarray, ...],
        state: tuple[np.ndarray, ...],
        improvements: Improvements,
    ):
        self.channel, self.arrays, self.state = channel, arrays, state
        self.improvements = improvements  # the anytime trace: the best after every chunk
        self.sent = math.inf
        self.when = -math.inf
        self.kept: tuple[float, np.ndarray] | None = None  # the best before a candidate
        self.mark, self.mark_time = math.inf, time.perf_counter()  # the last real gain

    def send(self, force: bool = False) -> None:
        best = float(self.state[6][kernels.F_BEST])
        now = time.perf_counter()
        self.improvements.add(min(best, self.kept[0]) if self.kept else best, now)
        if self.channel.on_incumbent is None or not best < self.sent:
            return
        if force or now - self.when >= SEND_SECONDS:
            self.channel.on_incumbent(tuple(int(c) for c in self.state[1]), "local")
            self.sent, self.when = best, now

    def receive(self) -> bool:
        """Whether a better answer came in and is now the best state."""
        if self.channel.incoming is None:
            return False
        other = self.channel.incoming()
        if other is None:
            return False
        choices = np.asarray(other, dtype=np.int64)
        value = kernels.total_cost(self.arrays, choices)
        if not value < float(self.state[6][kernels.F_BEST]):
            return False  # not better: the search goes on undisturbed
        if not _adopt(self.arrays, self.state, choices):
            return False
        self.sent = float(self.state[6][kernels.F_BEST])  # the sender has it
        self.mark, self.mark_time = self.sent, time.perf_counter()
        return True

    def take_candidate(self) -> bool:
        """Whether the search had stalled (STALL_SECONDS) and a candidate from elsewhere is
        now the state to anneal from; the best so far is kept (`best`)."""
        best = float(self.state[6][kernels.F_BEST])
        now = time.perf_counter()
        if best < self.mark * (1 - STALL_GAIN):
            self.mark, self.mark_time = best, now
        if self.channel.candidate is None or now - self.mark_time < STALL_SECONDS:
            return False
        other = self.channel.candidate()
        if other is None:
            return False
        if self.kept is None or best < self.kept[0]:
            self.kept = (best, self.state[1].copy())
        if not _adopt(self.arrays, self.state, np.asarray(other, dtype=np.int64)):
            return False
        self.mark, self.mark_time = float(self.state[6][kernels.F_BEST]), now
        self.sent = min(self.sent, self.kept[0])  # only an answer below the kept one is news
        return True

    def best(self) -> tuple[float, tuple[int, ...]]:
        """The best answer of the search: the state's, or one kept before a candidate."""
        value = float(self.state[6][kernels.F_BEST])
        if self.kept is not None and self.kept[0] < value:
            value, x = self.kept
        else:
            x = self.state[1]
        return value, tuple(int(c) for c in x)

    def stopped(self) -> bool:
        return self.channel.stop is not None and self.channel.stop.is_set()

    def proven(self, tolerance: float) -> bool:
        """Whether the best answer is within the gap tolerance of a bound proven elsewhere
        (`Channel.bound`): nothing left worth finding."""
        bound = self.channel.known_bound()
        return bound is not None and proven_within(self.best()[0], bound, tolerance)


def _report(rounds: int, moves: int, floats: np.ndarray) -> Callable[[], str]:
    return lambda: f"round {rounds}: best {floats[kernels.F_BEST]:.6g} after {moves} moves"


class LocalBackend(Backend[LocalSettings]):
    name = "local"
    objectives = ("additive",)
    exact = False
    REQUIRED_MODULES = ("numba",)
    settings_type = LocalSettings
    own_trace = True  # the best after every chunk of moves (stats["trace"])

    def _solve(
        self, problem: Problem, options: SolveOptions, settings: LocalSettings
    ) -> SolveResult:
        clock = options.clock()
        t0 = time.perf_counter()
        flat = flatten(problem)
        stats: dict[str, Any] = {"flatten_seconds": time.perf_counter() - t0}
        try:
            stats["compile_seconds"] = (
                compile_kernels() if _COMPILED else run_within(compile_kernels, clock)
            )
        except OutOfTime:
            stats["reason"] = "out of time while compiling the kernels (numba)"
            return SolveResult(self.name, Status.NO_SOLUTION, limit=Limit.TIME, stats=stats)
        alive = np.isfinite(flat.cost).astype(np.uint8)
        dropped = kernels.arc_consistency(flat.arrays(), alive)
        if dropped < 0:
            stats["reason"] = f"node {-1 - dropped} has no strategy left by the forbidden pairs"
            return SolveResult(self.name, Status.INFEASIBLE, stats=stats)
        flat = flat.restricted(alive)
        stats["pruned_strategies"] = int(dropped)
        arrays = flat.arrays()
        state = kernels.new_state(arrays, flat.num_times, options.seed, flat.max_size)
        warm = options.warm_start
        if warm is not None and _adopt(arrays, state, problem.check_choices(warm)):
            stats["warm_start"] = float(state[6][kernels.F_BEST])
        else:
            found = self._first_feasible(flat, arrays, state, alive, settings, clock.at, stats)
            stats["first_feasible_seconds"] = time.perf_counter() - t0
            if found is not None:
                return found
        link = _Link(options.channel, arrays, state, Improvements(t0))
        link.send(force=True)
        limit = self._anneal(flat, arrays, state, settings, clock.at, stats, link, options)
        value, choices = link.best()
        stats["trace"] = own_trace(link.improvements)
        bound = options.channel.known_bound()  # proven elsewhere: OPTIMAL when within it
        return SolveResult(
            self.name, Status.FEASIBLE, choices, objective=value, bound=bound, limit=limit,
            stats=stats,
        )  # fmt: skip

    def _first_feasible(
        self,
        flat: FlatProblem,
        arrays: tuple[np.ndarray, ...],
        state: tuple[np.ndarray, ...],
        alive: np.ndarray,
        settings: LocalSettings,
        at: float,
        stats: dict[str, Any],
    ) -> SolveResult | None:
        """Construct and repair (module docstring, 3.): a cost-first construction, then a
        memory-first one if its repair fails; a result when no answer was found, None when
        the state is valid."""
        code = kernels.least_memory_start(arrays, state)
        if code < 0:
            stats["reason"] = f"node {-1 - code} has no allowed strategy"
            return SolveResult(self.name, Status.INFEASIBLE, stats=stats)
        if not kernels.memory_ok(arrays, state) and len(flat.limit) == 1:
            stats["reason"] = "the least memory of the nodes live at some time is over the limit"
            return SolveResult(self.name, Status.INFEASIBLE, stats=stats)
        cap = settings.repair_steps * max(flat.num_nodes, 1) + 1000
        outcome = 0
        for attempt, memory_first in enumerate((True, False)):
            if attempt:
                kernels.least_memory_start(arrays, state)
            stats[f"unpropagated_{attempt}"] = kernels.mac_start(
                arrays, state, alive.copy(), memory_first, MAC_TRIES
            )
            steps = 0
            while True:
                outcome = kernels.repair(arrays, state, REPAIR_CHUNK)
                steps += REPAIR_CHUNK
                if outcome != 0 or steps >= cap or past(at):
                    break
            stats[f"repair_steps_{attempt}"] = steps
            if outcome != 0 or past(at):
                break
        stats["construction_attempts"] = attempt + 1
        if outcome == 1:
            kernels.take_current_as_best(arrays, state)
            return None
        if outcome == 2:
            stats["reason"] = "the least memory of the nodes live at some time is over the limit"
            return SolveResult(self.name, Status.INFEASIBLE, stats=stats)
        left = int(state[7][kernels.I_NBAD])
        stats["reason"] = (
            f"no valid answer found ({left} forbidden pairs"
            f"{', memory over the limit' if not kernels.memory_ok(arrays, state) else ''} left "
            f"after {int(state[7][kernels.I_STEP])} repair steps)"
        )
        limit = Limit.TIME if past(at) else Limit.ITERATIONS
        return SolveResult(self.name, Status.NO_SOLUTION, limit=limit, stats=stats)

    def _anneal(
        self,
        flat: FlatProblem,
        arrays: tuple[np.ndarray, ...],
        state: tuple[np.ndarray, ...],
        settings: LocalSettings,
        at: float,
        stats: dict[str, Any],
        link: _Link,
        options: SolveOptions,
    ) -> Limit | None:
        """Annealing rounds (module docstring, 4.); the limit that ended them (None also
        when the best is within the gap tolerance of a bound given by the channel)."""
        floats, ints = state[6], state[7]
        uphill = kernels.uphill_deltas(arrays, state, CALIBRATION_SAMPLES)
        unit = float(np.median(uphill)) if len(uphill) else 0.0
        if not unit > 0:
            unit = max(abs(float(floats[kernels.F_COST])), 1.0) / max(flat.num_nodes, 1) * 1e-3
        longest = settings.round_moves or max(MIN_ROUND, 300 * len(flat.movable))
        if settings.max_moves:  # rounds that cool within the move budget, whatever the clock
            longest = min(longest, max(settings.max_moves // ROUNDS_IN_BUDGET, FIRST_CHUNK))
        timed = not settings.round_moves and not settings.max_moves
        per_round = longest
        progress = ProgressLog(self.name)
        t0 = time.perf_counter()
        moves, rounds, stale, limit, proven = 0, 0, 0, None, False
        chunk_size = FIRST_CHUNK
        first = float(floats[kernels.F_BEST])
        while True:
            before = float(floats[kernels.F_BEST])
            if timed and moves:  # ROUNDS_IN_BUDGET rounds in the time left, at the rate so far
                rate = moves / max(time.perf_counter() - t0, 1e-9)
                left = max(at - time.perf_counter(), 0.0)
                per_round = int(min(longest, max(rate * left / ROUNDS_IN_BUDGET, FIRST_CHUNK)))
            hot = settings.start_temperature if rounds == 0 else settings.restart_temperature
            t_start, t_end = hot * unit, settings.end_temperature * unit
            done = 0
            while done < per_round and limit is None:
                if past(at) or link.stopped():  # also before the first chunk: an expired
                    limit = Limit.TIME  # deadline keeps the start
                    break
                proven = link.proven(options.gap_tolerance)
                if proven:
                    break
                if link.receive():  # a better answer from elsewhere: a new round from it
                    stats["adopted"] = stats.get("adopted", 0) + 1
                    break
                if link.take_candidate():  # stalled: a new round from another's candidate
                    stats["candidates"] = stats.get("candidates", 0) + 1
                    break
                chunk = min(chunk_size, per_round - done)
                if settings.max_moves:
                    chunk = min(chunk, settings.max_moves - moves)
                t1 = time.perf_counter()
                kernels.anneal(
                    arrays, state, chunk, done, per_round, t_start, t_end,
                    settings.edge_share, settings.repair_share, settings.tree_share,
                )  # fmt: skip
                took = time.perf_counter() - t1
                # the next chunk aims at CHUNK_SECONDS (the moves do not depend on it)
                chunk_size = int(min(max(chunk * CHUNK_SECONDS / max(took, 1e-6), 100), 10**7))
                done += chunk
                moves += chunk
                if timed and rounds == 0 and moves == chunk:  # the first chunk gives the rate
                    rate = chunk / max(took, 1e-9)
                    left = max(at - time.perf_counter(), 0.0)
                    per_round = int(
                        min(longest, max(rate * left / ROUNDS_IN_BUDGET, done + FIRST_CHUNK))
                    )
                progress(_report(rounds, moves, floats))
                link.send()
                if settings.max_moves and moves >= settings.max_moves:
                    limit = Limit.ITERATIONS
            rounds += 1
            better = floats[kernels.F_BEST] < before * (1 - 1e-12) - 1e-300
            stale = 0 if better else stale + 1
            kernels.reset_to_best(arrays, state)
            link.send(force=True)
            if limit is not None or proven or (settings.patience and stale >= settings.patience):
                break
        seconds = time.perf_counter() - t0
        stats.update(
            moves=moves,
            moves_per_second=moves / seconds if seconds > 0 else math.inf,
            anneal_seconds=seconds,
            accepted=int(ints[kernels.I_ACCEPTED]),
            new_bests=int(ints[kernels.I_BESTS]),
            rounds=rounds,
            restarts=max(rounds - 1, 0),
            last_round_moves=per_round,
            temperature_unit=unit,
            first_feasible_objective=first,
        )
        return limit
