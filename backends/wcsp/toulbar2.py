"""`toulbar2`: the Problem as a cost function network solved by toulbar2, the memory rule
priced into the costs, with a Lagrangian lower bound (docs/solvers.md, "toulbar2").

toulbar2 (Cooper, de Givry, Schiex et al.; soft arc consistency, "Soft arc consistency
revisited", AIJ 2010, and hybrid best-first search, Allouche et al. 2015) minimizes a sum of
unary and binary cost functions over finite domains. The network (`backends.wcsp.network`)
has the nodes' costs as unary functions, the edges' as binary ones, forbidden pairs as hard
(top) costs and forbidden strategies out of the domains. Costs are integers in toulbar2:
they are scaled by one factor (1 when every cost is an integer and the sums fit) and rounded
down, so a proof on the rounded network is a proof, within n/scale, on the real one; the
answer is re-scored in float from the Problem.

The memory rule: on a small problem with integral usages, each time step's row is a
knapsack constraint of toulbar2's, and a proof is a proof. Otherwise it is relaxed into
penalties: a price per time step and pool (the Lagrangian multipliers of `backends.wcsp.bound`,
found in the first `bound_share` of the time), each node's usage priced by the sum over the
steps it is live at. Rounds: toulbar2 solves the priced network (at most `round_seconds`,
twice that after a round that found no labelling, in
a child process that is killed at the deadline or at Ctrl-C: one solve cannot be
interrupted in-process); the steps its answer
overfills get their price multiplied by `growth` (or a first price), those with more than
SLACK of their limit free have theirs divided by sqrt(growth) (a price belongs to a step at
its limit; the steps there keep theirs), the answer is repaired
greedily into the limit (`backends.wcsp.memory.repair`) and polished by single-node moves;
the best answer is kept; a repaired answer a little above the best goes to the caller's
`channel.on_candidate` (the portfolio's `local` anneals from it). The best answer is crossed
with the rounds' labellings and answers (the last POOL; `backends.wcsp.crossover`): after
each round, and during one when another member's answer improves it. The bound and the rounds
work on the network contracted along its functional edges (`backends.wcsp.contract`). The
bound reported is the Lagrangian bound (and toulbar2's proof where it has one).

With a caller's `SolveOptions.channel` (the portfolio): each better answer goes to
`on_incumbent`, and a better answer from `incoming()` (looked at before each round and
during the bound's iterations) becomes the best, the bound's upper value with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
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
    stop_requested,
)
from backends.wcsp import trws
from backends.wcsp.bound import MARGIN, Lagrangian
from backends.wcsp.contract import Contraction, contract
from backends.wcsp.crossover import crossover, crossover_repaired
from backends.wcsp.memory import (
    Steps,
    kernel_arrays,
    node_prices,
    polish,
    profile,
    repair,
    steps,
    unbreak,
)
from backends.wcsp.network import Network, build_network
from planner.deadline import Deadline
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem

__all__ = ["Toulbar2Backend", "Toulbar2Settings"]

TOTAL = 1e14  # the largest total cost toulbar2 is given (its costs are 64-bit integers)
KILL_SECONDS = 0.5  # a toulbar2 round still running this long past the deadline is killed
INTERRUPT_GRACE_SECONDS = 0.1  # ... and this long after a Ctrl-C (exit within 1 s; the
# portfolio kills members 0.4 s after one: with 0.3 here, on IOPDDL S at load 2-3, toulbar2's
# result, and the bound with it, came too late twice in two tries)
POLL_SECONDS = 0.05
MEND_NODES = 5_000  # larger: the bound's labellings are not repaired (too slow there)
FEW_CONFLICTS = 20  # forbidden pairs a labelling may have to be mended (memory.unbreak)
BUILD_PER_ENTRY = 1e-6  # seconds to hand toulbar2 a table entry (6 M on IOPDDL A: 5 s)
REPAIR_MOVES = 50  # repair moves between two looks at the clock
PROPAGATE = 200  # nodes one repair move may take along (backends.wcsp.memory.repair)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
FIRST_ROUND_SECONDS = 45.0  # kept for the rounds before the bound takes its share (IOPDDL
# A, 60 s: a first round takes 20-30 s; with 12 s of bound before it one round fitted and the
# gap was 11%, with 3 s two rounds and 7%; on S, 240 s, 48 s of bound gave a better one)
CONTRACT_PER_ENTRY = 1e-6  # seconds to contract a network, per table entry (A: 5.8 M, 4-8 s)
SLACK = 0.01  # a step this far below the limit has room: its price falls after a round
# (before, every price fell after a round within the limit and none after one over it; IOPDDL
# S, portfolio, 240 s: 1.5885e9 and 1.5511e9 became 1.5449e9 at seeds 1 and 0)
FIX_OVERFULL = 0.02  # a round's labelling over the limit at more than this share of the
# time steps is not repaired once there is an answer (IOPDDL S's first rounds: 0.5%)
SMALL_TABLES = 100_000  # entries a network may have to be solved with under a second left
FIRST_FACTOR = 1.25  # a round after one that found its first labelling in t seconds of CPU
FIRST_EXTRA = 1.0  # ... is FIRST_FACTOR * t + FIRST_EXTRA long, within min_round_seconds and
# round_seconds. IOPDDL, portfolio: S (240 s, a first labelling in 7-12 s) gave 1.549e9 with
# 15 s rounds (11 rounds) and 1.563e9-1.594e9 with 30 s ones (5); M (180 s, first labelling in
# 3 s) lost 0.3% with 5 s rounds (toulbar2 still improves the labelling for seconds after the
# first) and none with 15 s ones; A (60 s) got no round answer at all with a fixed 15 s
POOL = 24  # earlier rounds' labellings and answers kept to cross with the best answer
# (3-6 ms a crossover on IOPDDL S)
CROSS_SECONDS = 5.0  # during a round, another member's better answer is crossed at most
# this often (each time: POOL crossovers, about 0.2 s on S)
CROSS_REPAIR_SECONDS = 6.0  # after a round, at most this long for the crossovers with repair
# (a third of it during a round), and at most CROSS_REPAIR_SHARE of the round's own time (on
# IOPDDL A rounds take 1-3 s: the rounds keep most of the time)
CROSS_REPAIR_SHARE = 0.4
TRIES = 3  # ... of at most this many components per labelling
CANDIDATE_RANGE = 0.06  # a valid answer this far above the best goes to `on_candidate`
# (IOPDDL S: a repaired round 3% above the best, annealed by `local`, can end below it)
IDLE_BOUND_SHARE = 0.2  # without `overlap`, until a round has ended (and given its bound),
# the bound's steps take this share of the time a round runs: on a large problem whose rounds
# do not end in the time the bound would otherwise be its first share's alone
_SOLUTION_LINE = re.compile(r"^New solution: .*?([0-9.]+) seconds\)", re.MULTILINE)


@dataclass(frozen=True)
class Toulbar2Settings(BackendSettings):
    """The `toulbar2` backend's settings."""

    bound_share: Annotated[float, between(0.0, 0.9, "a share")] = 0.2
    """share of the time for the Lagrangian bound (and the first prices) before toulbar2: of
    the time beyond FIRST_ROUND_SECONDS, or of a quarter of the time if that is more"""
    round_seconds: Annotated[float, POSITIVE] = 30.0
    """at most this long per toulbar2 solve (a Ctrl-C is seen between solves), and the first
    round's length; a round after one without a labelling is twice as long as that one"""
    min_round_seconds: Annotated[float, POSITIVE] = 8.0
    """a round after one that found its first labelling in t seconds is FIRST_FACTOR * t +
    FIRST_EXTRA long, but at least this (and at most round_seconds); 8 rather than 15 since
    the crossovers use every round's labelling (IOPDDL S, seeds 1 and 2: 1.541e9 and 1.548e9
    against 1.553e9-1.555e9 and 1.550e9)"""
    max_rounds: Annotated[int, Check("a positive integer", lambda v: v > 0)] = 500
    """at most this many priced solves"""
    growth: Annotated[float, at_least(1.0, "a number")] = 2.0
    """the factor a price grows by while its time step is over full"""
    exact_memory_nodes: Annotated[int, at_least(0, "an integer")] = 40
    """up to this many nodes, with integral usages: memory rows as toulbar2 constraints"""
    overlap: bool = True
    """the bound's steps go on in this process while a round runs in its child (a second
    core); the portfolio turns it off (its other member has that core)"""


@dataclass
class _Best:
    """The best answer so far, in the Problem's strategy indices."""

    choices: tuple[int, ...] | None = None
    cost: float = math.inf
    found_by: str = ""
    channel: Channel = field(default_factory=Channel)

    def offer(self, problem: Problem, choices: tuple[int, ...], who: str) -> float:
        cost = additive_cost(problem, choices)
        if not math.isfinite(cost) or not memory_feasible(problem, choices):
            return cost
        if cost < self.cost:
            self.choices, self.cost, self.found_by = choices, cost, who
            if self.channel.on_incumbent is not None and who != "incoming":
                self.channel.on_incumbent(choices, "toulbar2")
        elif (
            self.channel.on_candidate is not None
            and who != "incoming"
            and cost <= self.cost * (1 + CANDIDATE_RANGE)
        ):
            self.channel.on_candidate(choices, "toulbar2")
        return cost

    def receive(self, problem: Problem) -> None:
        """Take a better answer found elsewhere (`channel.incoming`), if there is one."""
        if self.channel.incoming is not None:
            other = self.channel.incoming()
            if other is not None:
                self.offer(problem, tuple(int(c) for c in other), "incoming")


class Toulbar2Backend(Backend[Toulbar2Settings]):
    name = "toulbar2"
    objectives = ("additive",)
    exact = True
    REQUIRED_MODULES = ("pytoulbar2",)
    settings_type = Toulbar2Settings

    def _solve(
        self, problem: Problem, options: SolveOptions, settings: Toulbar2Settings
    ) -> SolveResult:
        clock = options.clock()
        stats: dict[str, Any] = {"rounds": 0}
        if clock.expired():
            return SolveResult(self.name, Status.NO_SOLUTION, limit=Limit.TIME, stats=stats)
        if problem.num_nodes == 0:  # nothing to choose (and toulbar2 needs a variable)
            return SolveResult(self.name, Status.OPTIMAL, (), 0.0, 0.0, stats=stats)
        t0 = time.perf_counter()
        net = build_network(problem, clock)
        stats["network_seconds"] = time.perf_counter() - t0
        if net.empty is not None:  # no value of that node avoids every forbidden pair
            return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
        st = steps(problem)
        best = _Best(channel=options.channel)
        if options.warm_start is not None:
            best.offer(problem, problem.check_choices(options.warm_start), "warm start")
        scale = _scale(net)
        stats["scale"] = scale
        exact_rows = st is not None and _exact_memory(problem, net, settings)
        if st is None or exact_rows:
            return self._exact(problem, options, net, st, scale, best, stats, clock)
        # the rounds end KILL_SECONDS early: a round killed at its deadline is then killed by
        # the caller's, and the last repair and the answer fit (a portfolio member has 1 s)
        work = clock.reserve(min(KILL_SECONDS, 0.05 * clock.left()))
        return self._priced(problem, options, settings, net, st, scale, best, stats, work)

    # ----------------------------------------------------------------- exact: one solve

    def _exact(
        self,
        problem: Problem,
        options: SolveOptions,
        net: Network,
        st: Steps | None,
        scale: float,
        best: _Best,
        stats: dict[str, Any],
        clock: Deadline,
    ) -> SolveResult:
        """No memory rule, or its rows as knapsack constraints: one toulbar2 solve proves."""
        seconds = _seconds(net, clock.left())
        if seconds is None:
            return self._answer(best, None, Limit.TIME, stats)
        tolerance = options.gap_tolerance
        # UB - LB <= tolerance x a bound known now (<= LB) keeps UB / LB - 1 <= tolerance
        least = _least_cost(net)
        gap = tolerance * least * (1 - 1e-6) if 0 < least < math.inf else 0.0
        run = _apart(
            clock, net, np.zeros_like(net.unary), scale, options.seed, seconds, st, problem, gap
        )
        stats.update(rounds=1, toulbar2_seconds=run.seconds, toulbar2_nodes=run.nodes)
        if run.labels is not None:
            best.offer(problem, net.choices(run.labels), "toulbar2")
        # rounded down: the network's optimum / scale <= the real one, and the answer is
        # within n / scale of it (the module docstring)
        bound = run.bound / run.scale if run.labels is not None or run.proven else None
        if run.proven and best.choices is None:
            return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
        if best.choices is not None and proven_within(best.cost, bound, tolerance):
            if run.proven and tolerance == 0:  # exact: the rounding is below the proof's
                bound = best.cost
            return self._answer(best, bound, None, stats, Status.OPTIMAL)
        if run.proven:
            return self._answer(best, bound, None, stats)
        limit = Limit.TIME if past(clock.at) or run.timed_out else None
        return self._answer(best, bound, limit, stats)

    # ----------------------------------------------------------- priced rounds

    def _priced(
        self,
        problem: Problem,
        options: SolveOptions,
        settings: Toulbar2Settings,
        net: Network,
        st: Steps,
        scale: float,
        best: _Best,
        stats: dict[str, Any],
        clock: Deadline,
    ) -> SolveResult:
        """The memory rule priced (module docstring): the bound's share, the rounds, the rest
        of the time to the bound; its answer, bound and limit. Before anything else, the
        least-cost bound (each node's and each edge's cheapest, memory ignored) is sent: the
        caller has a bound however slow the network's contraction, the Lagrangian steps and
        the rounds are on a large problem."""
        least = _least_cost(net)
        least -= MARGIN * abs(least)
        stats["least_cost_bound"] = least
        if math.isfinite(least) and options.channel.on_bound is not None:
            options.channel.on_bound(least, "toulbar2")
        search = _PricedSearch(
            self.name, problem, options, settings, net, st, scale, best, stats, clock
        )
        search.first_bound()
        timed_out = search.rounds()
        search.last_bound()
        lagrange = search.lagrange
        best_bound = max(lagrange.best, stats.get("round_bound", -math.inf), least)
        bound = best_bound if math.isfinite(best_bound) else None
        if lagrange.best == math.inf:
            return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
        if best.choices is not None and proven_within(best.cost, bound, options.gap_tolerance):
            return self._answer(best, bound, None, stats, Status.OPTIMAL)
        limit = Limit.TIME if timed_out or past(clock.at) else Limit.ITERATIONS
        return self._answer(best, bound, limit, stats)

    def _answer(
        self,
        best: _Best,
        bound: float | None,
        limit: Limit | None,
        stats: dict[str, Any],
        status: Status | None = None,
    ) -> SolveResult:
        stats["found_by"] = best.found_by
        if best.choices is None:
            return SolveResult(self.name, Status.NO_SOLUTION, None, None, bound, limit, None, stats)
        if bound is not None:
            bound = min(bound, best.cost)
        status = status or Status.FEASIBLE
        return SolveResult(self.name, status, best.choices, best.cost, bound, limit, None, stats)


# ----------------------------------------------------------------------- priced rounds


class _PricedSearch:
    """One solve with the memory rule priced (module docstring): the Lagrangian bound's
    share of the time (`first_bound`), the priced rounds (`rounds`: toulbar2 on the priced
    network, each answer repaired (`fix`) and crossed with the earlier ones (`recombine`),
    then the prices moved), the rest of the time to the bound (`last_bound`). The rounds and
    the bound both work on the contracted network, when that pays."""

    def __init__(
        self,
        name: str,
        problem: Problem,
        options: SolveOptions,
        settings: Toulbar2Settings,
        net: Network,
        st: Steps,
        scale: float,
        best: _Best,
        stats: dict[str, Any],
        clock: Deadline,
    ):
        self.problem, self.options, self.settings, self.scale = problem, options, settings, scale
        self.net, self.st, self.best, self.stats, self.clock = net, st, best, stats, clock
        self.progress = ProgressLog(name)
        inc = trws.incidence(net.noff, net.eu, net.ev)
        self.con = _contraction(net, clock, stats)
        self.solved = self.con.net if self.con is not None else net  # what toulbar2 is given
        self.tolerance = options.gap_tolerance
        on_bound = options.channel.on_bound
        self.lagrange = Lagrangian(
            net, st, contraction=self.con, tolerance=self.tolerance,
            on_bound=(lambda b: on_bound(b, "toulbar2")) if on_bound is not None else None,
        )  # fmt: skip
        self.upper = best.cost if best.choices is not None else None
        self.g = kernel_arrays(net.noff, net.unary, net.eu, net.ev, net.eoff, net.binary, inc)
        self.pool: list[np.ndarray] = []  # the rounds' labellings and answers, newest last
        self.crossed = (time.perf_counter(), math.inf)  # when recombine last ran, from what best
        self.idle_budget = 0.0  # seconds for crossovers with repair while the round runs
        self.seen = 0  # the bound's labellings
        self.cpu = _CpuShare()  # the share of a core the rounds get, measured from here
        self.next_step = 0.0  # when `idle` may take its next step of the bound
        self.pre: _Prebuilt | None = None  # the rounds' network, built once (`_prebuilt`)
        self.pre_failed = False

    # -- the bound ---------------------------------------------------------------------

    def first_bound(self) -> None:
        """The bound's share of the time beyond what a first round needs on a large network."""
        t0 = time.perf_counter()
        clock, settings = self.clock, self.settings
        left = clock.left()
        share = clock.within(settings.bound_share * max(left - FIRST_ROUND_SECONDS, 0.25 * left))
        self.lagrange.run(share, self.upper, self.on_labelling)
        self.stats["bound_seconds"] = time.perf_counter() - t0

    def last_bound(self) -> None:
        """The rest of the time, if any, to the bound; with no answer yet, the bound's
        decoded labelling repaired."""
        lagrange, clock, best = self.lagrange, self.clock, self.best
        if not past(clock.at):
            lagrange.run(clock, best.cost if best.choices is not None else None, self.on_labelling)
        self.stats["bound_steps"] = lagrange.iterations
        if best.choices is None and not past(clock.at):
            at = lagrange.solved
            decoded = trws.decode(
                at.noff, lagrange.unary(), at.eu, at.ev, at.eoff, at.binary,
                *lagrange.inc[:3], lagrange.msg_u, lagrange.msg_v,
            )  # fmt: skip
            self.fix(lagrange.lift(decoded), "decoded")

    def on_labelling(self, x: np.ndarray) -> float | None:
        """Each labelling of the bound's: a better answer from elsewhere taken, one in ten
        repaired on a small network; the upper value the bound uses."""
        best = self.best
        self.seen += 1
        best.receive(self.problem)
        if self.seen % 10 == 1 and self.net.num_nodes <= MEND_NODES:
            self.fix(x, "lagrangian")
        return best.cost if best.choices is not None else None

    def proven(self) -> bool:
        """Whether the best answer is within the gap tolerance of the best bound (the
        Lagrangian one, or a round's): the search can stop."""
        bound = max(self.lagrange.best, self.stats.get("round_bound", -math.inf))
        cost = self.best.cost if self.best.choices is not None else None
        return proven_within(cost, bound, self.tolerance)

    def step(self) -> None:
        """One step of the bound while a round runs (`overlap`)."""
        best = self.best
        self.lagrange.run(
            self.clock, best.cost if best.choices is not None else None, self.on_labelling, 1
        )

    def idle(self) -> bool:
        """While a round runs: a step of the bound (`overlap`), or a short sleep; and
        every CROSS_SECONDS, if another member's answer is better than the best the
        last crossover started from, the crossovers from it. True: the best answer is now
        proven within the gap tolerance (the round is stopped)."""
        if self.settings.overlap:
            self.step()
        elif "round_bound" not in self.stats and time.perf_counter() >= self.next_step:
            t0 = time.perf_counter()  # no round has ended yet: the bound goes on, a share of
            self.step()  # a core (the other member has the other core)
            spent = time.perf_counter() - t0
            self.next_step = t0 + spent / IDLE_BOUND_SHARE
        else:
            time.sleep(POLL_SECONDS)
        if self.options.channel.incoming is None or not self.pool:
            return self.proven()
        if time.perf_counter() - self.crossed[0] >= CROSS_SECONDS:
            self.best.receive(self.problem)
            if self.best.cost < self.crossed[1]:
                self.recombine(None, None, "crossover", self.idle_budget)
            else:
                self.crossed = time.perf_counter(), self.crossed[1]
        return self.proven()

    # -- the rounds --------------------------------------------------------------------

    def rounds(self) -> bool:
        """The priced rounds, until `max_rounds`, a proof, an answer that needs no prices or
        the deadline; whether the time limit ended them."""
        settings, stats, clock, st, net = self.settings, self.stats, self.clock, self.st, self.net
        lagrange = self.lagrange
        stats["bound_steps"] = lagrange.iterations
        lam = lagrange.best_lam if lagrange.best_lam is not None else lagrange.lam
        lam = lam.copy()
        # a first price for a step that is over full and unpriced: the mean cost per byte
        base = float(np.mean(net.unary)) / max(float(np.mean(net.usage)), 1.0) / max(st.count, 1)
        timed_out = False
        round_limit = settings.round_seconds
        for k in range(settings.max_rounds):
            if self.proven():
                break  # the best answer is within the gap tolerance of the bound
            seconds = self._round_seconds(k, round_limit)
            if seconds is None:
                timed_out = True
                break
            run = self._round(k, lam, seconds)
            timed_out = run.timed_out
            if run.labels is None:
                if run.proven or past(clock.at) or self.proven():
                    break  # nothing avoids the forbidden pairs, no time is left, or proven
                # too short to find a labelling (S with 10 s rounds: none in 240 s): the
                # same prices again, twice as long
                stats["empty_rounds"] = stats.get("empty_rounds", 0) + 1
                round_limit *= 2
                continue
            if run.first is not None:  # as long as a first labelling took, and a margin
                stats.setdefault("first_labelling_seconds", []).append(round(run.first, 2))
                length = max(settings.min_round_seconds, FIRST_FACTOR * run.first + FIRST_EXTRA)
                round_limit = min(settings.round_seconds, length)
            over, prof = self._answer_of(k, run, seconds)
            if not over.any() and not lam.any():
                break  # the unpriced network's answer keeps the limit: nothing to price
            self._reprice(lam, over, prof, base)
            if past(clock.at):
                timed_out = True
                break
        return timed_out

    def _round_seconds(self, k: int, round_limit: float) -> int | None:
        """Round k's time limit for toulbar2 (None: no time for a round). Building and
        preprocessing are not on toulbar2's clock: the last round's building time is kept
        twice over for them."""
        stats, solved = self.stats, self.solved
        built = stats.get("build_seconds", 0.0) / k if k else BUILD_PER_ENTRY * solved.binary.size
        spare = self.clock.left() - 2 * built
        return _seconds(solved, min(spare, round_limit), self.cpu.share())

    def _round(self, k: int, lam: np.ndarray, seconds: int) -> _Run:
        """Round k: toulbar2 on the network priced by `lam`, in a child process; its
        bound on the relaxation kept in stats["round_bound"]."""
        st, net, con, stats, options = self.st, self.net, self.con, self.stats, self.options
        self.best.receive(self.problem)
        prices = np.repeat(node_prices(st, lam), net.dom, axis=0)
        penalty = (prices * net.usage).sum(axis=1)
        if con is not None:  # the trees' sums: `solved`'s own unary costs are zeros
            penalty = con.unary(net.unary + penalty)
        self.idle_budget = min(CROSS_REPAIR_SECONDS / 3, CROSS_REPAIR_SHARE * seconds)
        overlap = self.settings.overlap or options.channel.incoming is not None
        idle = self.idle if overlap else None
        pre = self._prebuilt(penalty)
        if pre is not None:  # only the priced unary costs are posted in the round's child
            run = _apart(
                self.clock, self.solved, penalty, pre.scale, options.seed + k, seconds, pre,
                idle=idle, solve=_run_prebuilt,
            )  # fmt: skip
        else:
            run = _apart(
                self.clock, self.solved, penalty, self.scale, options.seed + k, seconds, None,
                self.problem, idle=idle,
            )  # fmt: skip
        stats["build_seconds"] = stats.get("build_seconds", 0.0) + run.build
        stats["rounds"] = k + 1
        stats["toulbar2_seconds"] = stats.get("toulbar2_seconds", 0.0) + run.seconds
        if run.labels is not None or run.nodes:  # toulbar2's dual bound of the priced
            # network, less the prices times the limits: L(lam), a bound (module docstring)
            value = run.bound / run.scale - float((lam.sum(axis=0) * st.limit).sum())
            value -= MARGIN * abs(value)
            if value > stats.get("round_bound", -math.inf):
                stats["round_bound"] = value
        return run

    def _prebuilt(self, penalty: np.ndarray) -> _Prebuilt | None:
        """The rounds' network built once (`_Prebuilt`), if these prices fit its scale."""
        if self.pre is None and not self.pre_failed:
            t0 = time.perf_counter()
            self.pre = _prebuild(self.solved, self.scale)
            self.pre_failed = self.pre is None
            self.stats["prebuild_seconds"] = time.perf_counter() - t0
        if self.pre is None or not self.pre.fits(self.solved, penalty):
            return None
        return self.pre

    def _answer_of(self, k: int, run: _Run, seconds: int) -> tuple[np.ndarray, np.ndarray]:
        """Round k's labelling repaired into the limit (unless far over it) and crossed with
        the best; its over-full steps and the memory profile."""
        st, net, best, problem = self.st, self.net, self.best, self.problem
        assert run.labels is not None
        x = run.labels if self.con is None else self.con.lift(run.labels)
        prof = profile(st, net.usage[net.noff[:-1] + x], st.count)
        over = prof > st.limit
        fixed = None
        if best.choices is None or int(over.sum()) <= FIX_OVERFULL * st.count:
            fixed = self.fix(x, f"toulbar2 round {k + 1}")
        else:  # far over the limit: its repair would take seconds (A: 9 s for 15,796
            # over-full steps) and end far above the best; it only moves the prices
            self.stats["unrepaired"] = self.stats.get("unrepaired", 0) + 1
        repaired = "not" if fixed is None else f"{fixed[1]:.6g}"
        answer = None if fixed is None else fixed[0]
        spend = min(CROSS_REPAIR_SECONDS, CROSS_REPAIR_SHARE * run.seconds)
        self.recombine(x, answer, f"crossover of round {k + 1}", spend)
        line = (
            f"round {k + 1} ({seconds} s): labelling {{:.6g}} with {int(over.sum())} "
            f"over-full steps, repaired {repaired}, best {best.cost:.6g}"
        )

        def described(line: str = line, x: np.ndarray = x) -> str:
            return line.format(additive_cost(problem, net.choices(x)))  # only when logged

        self.progress(described)
        return over, prof

    def _reprice(self, lam: np.ndarray, over: np.ndarray, prof: np.ndarray, base: float) -> None:
        """Prices grow on the over-full steps and fall on the steps with room to spare
        (complementary slackness: a price belongs to a step at its limit); the steps at the
        limit keep theirs."""
        growth = self.settings.growth
        if over.any():
            lam[over] = np.where(lam[over] > 0, lam[over] * growth, base)
        lam[prof < self.st.limit * (1 - SLACK)] /= math.sqrt(growth)

    # -- answers -----------------------------------------------------------------------

    def fix(self, labels: np.ndarray, who: str) -> tuple[np.ndarray, float] | None:
        """Repair and polish a labelling into the limit; offer it; the answer and its
        cost (None if the repair failed or the answer is not valid)."""
        net, st, g, clock, stats = self.net, self.st, self.g, self.clock, self.stats
        t1 = time.perf_counter()
        x = labels.astype(np.int64).copy()
        if _conflicts(net, x) > FEW_CONFLICTS:
            return None  # too far from an answer to mend quickly
        if unbreak(x, g, PROPAGATE) > 0:
            return None
        use = net.usage[net.noff[:-1] + x]
        prof = profile(st, use, st.count)
        args = (st.first, st.after, st.limit, net.usage, g)
        ok = -1
        while ok == -1 and not past(clock.at):
            ok = repair(x, prof, *args, REPAIR_MOVES, PROPAGATE)
        if ok != 1:
            stats["repair_failed"] = stats.get("repair_failed", 0) + 1
            return None
        while polish(x, prof, *args) > 0 and not past(clock.at):
            pass
        cost = self.best.offer(self.problem, net.choices(x), who)
        stats["fix_seconds"] = stats.get("fix_seconds", 0.0) + time.perf_counter() - t1
        return (x, cost) if math.isfinite(cost) else None

    def recombine(
        self, raw: np.ndarray | None, fixed: np.ndarray | None, who: str, seconds: float
    ) -> None:
        """Cross the best answer (another member's newest included) with this round's
        labelling, its repaired answer and the earlier rounds' (at most POOL, newest
        first; `backends.wcsp.crossover`), then for up to `seconds` with the parts of
        them that pay but do not fit, repaired (`crossover_repaired`); and the repaired
        answer with the best and the rest; offer what comes out."""
        net, st, g, best, stats, pool = self.net, self.st, self.g, self.best, self.stats, self.pool
        pool.extend(y for y in (raw, fixed) if y is not None)
        del pool[:-POOL]
        if past(self.clock.at):
            return
        best.receive(self.problem)
        self.crossed = time.perf_counter(), best.cost
        base = net.local(best.choices) if best.choices is not None else None
        if base is None:
            return  # no valid answer to start from
        starts = [base]
        if fixed is not None and not np.array_equal(fixed, base):
            starts.append(fixed)
        args = (st.first, st.after, st.limit, net.usage, g)
        for start in starts:
            x = start.copy()
            prof = profile(st, net.usage[net.noff[:-1] + x], st.count)
            donors = [y for y in (base, *reversed(pool)) if y is not start]
            moved = sum(crossover(x, y, prof, *args)[0] for y in donors)
            stats["crossed"] = stats.get("crossed", 0) + moved
            if start is base:
                until = self.clock.within(seconds)
                for y in donors:
                    if crossover_repaired(x, y, prof, st, net.usage, g, TRIES, until):
                        moved += 1
                        stats["crossed_repaired"] = stats.get("crossed_repaired", 0) + 1
            if moved:
                best.offer(self.problem, net.choices(x), who)


# --------------------------------------------------------------------------- toulbar2


@dataclass(frozen=True)
class _Run:
    labels: np.ndarray | None  # domain indices
    bound: float  # toulbar2's dual bound, in its integer costs
    proven: bool  # the search finished: optimal (or no answer) on the network
    timed_out: bool
    seconds: float
    nodes: int
    build: float
    scale: float = 1.0  # the scale the network's costs were given in (lowered for high prices)
    first: float | None = None  # toulbar2's CPU seconds to its first labelling (from its log)


def _contraction(net: Network, clock: Deadline, stats: dict[str, Any]) -> Contraction | None:
    """The network contracted along its functional edges (`backends.wcsp.contract`), for the
    bound and the rounds: None when that would take more than a quarter of the time left (an
    estimate per table entry), when the deadline passes during it, or when it removes
    nothing."""
    if CONTRACT_PER_ENTRY * net.binary.size > 0.25 * clock.left():
        return None
    t0 = time.perf_counter()
    con = contract(net, clock)
    stats["contract_seconds"] = time.perf_counter() - t0
    if con is None or con.removed == 0 or con.net.empty is not None:
        return None  # (a tree without a value: the rounds on `net` find that out)
    stats["contracted"] = f"{net.num_nodes} -> {con.net.num_nodes} nodes"
    return con


def _least_cost(net: Network) -> float:
    """A lower bound of any labelling's cost: each node's cheapest value and each edge's
    cheapest allowed pair, summed."""
    unary = np.minimum.reduceat(net.unary, net.noff[:-1]).sum() if net.num_nodes else 0.0
    finite = np.where(np.isfinite(net.binary), net.binary, np.inf)
    pairs = np.minimum.reduceat(finite, net.eoff[:-1]).sum() if len(net.eu) else 0.0
    return float(unary + pairs)


def _conflicts(net: Network, x: np.ndarray) -> int:
    """How many forbidden pairs labelling x has."""
    dv = net.noff[net.ev + 1] - net.noff[net.ev]
    return int((~np.isfinite(net.binary[net.eoff[:-1] + x[net.eu] * dv + x[net.ev]])).sum())


class _CpuShare:
    """The share of a core this process (and its rounds' processes) has had since it was
    made: toulbar2's time limit counts CPU time, so on a busy machine it must be given less
    than the wall time left."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), _cpu_seconds()

    def share(self) -> float:
        wall = time.perf_counter() - self.wall
        return (_cpu_seconds() - self.cpu) / wall if wall > 0.5 else 1.0


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the toulbar2 rounds)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _scale(net: Network) -> float:
    """One factor for every cost: 1 when they are integers and their sum fits, else the
    power of two that brings the largest possible total to about TOTAL."""
    finite = net.binary[np.isfinite(net.binary)]
    total = sum(
        float(net.unary[a:b].max()) for a, b in zip(net.noff[:-1], net.noff[1:], strict=True)
    )
    total += float(finite.max(initial=0.0)) * len(net.eu)
    integral = bool(np.all(net.unary == np.round(net.unary))) and bool(
        np.all(finite == np.round(finite))
    )
    if integral and total <= TOTAL:
        return 1.0
    return 2.0 ** math.floor(math.log2(TOTAL / max(total, 1e-300)))


def _seconds(net: Network, left: float, cpu: float = 1.0) -> int | None:
    """toulbar2's time limit (whole seconds of CPU time, at least 1) for `left` seconds of
    wall time at a share `cpu` of a core: None when less than a second is left and the
    network is too large to be sure it solves within a moment."""
    left *= min(max(cpu, 0.1), 1.0)
    if left >= 1.0:
        return int(left)
    return 1 if left > 0.0 and net.binary.size <= SMALL_TABLES else None


def _exact_memory(problem: Problem, net: Network, settings: Toulbar2Settings) -> bool:
    """Whether the memory rows go to toulbar2 as knapsack constraints (exactly)."""
    if net.num_nodes > settings.exact_memory_nodes or problem.usage_limit is None:
        return False
    limit = np.asarray(problem.usage_limit, dtype=np.float64)
    return bool(np.all(net.usage == np.round(net.usage))) and bool(np.all(np.isfinite(limit)))


def _apart(
    clock: Deadline,
    *args: Any,
    idle: Callable[[], bool] | None = None,
    solve: Callable[..., _Run] | None = None,
) -> _Run:
    """`_run(*args)` in a forked child process: toulbar2's solve cannot be interrupted in
    this one (it holds the interpreter, and pytoulbar2 takes over SIGINT), so the child is
    killed at the deadline (plus KILL_SECONDS) or at Ctrl-C (plus INTERRUPT_GRACE_SECONDS),
    and the round counts as one without an answer. The child ignores SIGINT itself. `idle`,
    if given, is called again and again while the child works (a short step each time); when
    it returns True the child is killed too."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    log = _new_log()  # made and removed here: a killed child leaves none behind
    proc = ctx.Process(target=_child, args=(send, solve or _run, args, log), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    send.close()
    hard = clock.at + KILL_SECONDS
    try:
        while True:
            if receive.poll(0.0 if idle is not None else POLL_SECONDS):
                try:
                    out: _Run = receive.recv()
                    return out
                except EOFError:  # the child died without an answer
                    break
            if idle is not None and not past(clock.at):
                if idle():
                    break  # the caller needs the round no more: killed below
            elif idle is not None:
                time.sleep(POLL_SECONDS)
            now = time.perf_counter()
            if stop_requested():
                hard = min(hard, now + INTERRUPT_GRACE_SECONDS)
            if now > hard or not proc.is_alive() and not receive.poll(0):
                break
    finally:
        if proc.is_alive():
            proc.kill()  # our own child, by its handle
        proc.join()
        receive.close()
        if log is not None:
            with contextlib.suppress(OSError):
                os.unlink(log)
    return _Run(None, 0.0, False, True, time.perf_counter() - t0, 0, 0.0)


def _child(send: Any, solve: Callable[..., _Run], args: tuple[Any, ...], log: str | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    _die_with_parent()
    if log is not None:  # toulbar2 writes its log to file descriptor 1
        sys.stdout.flush()
        fd = os.open(log, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    send.send(solve(*args, log=log))  # args: the solve's parameters but the log
    send.close()


def _die_with_parent() -> None:
    """Linux: this process is killed when its parent dies (a portfolio member killed at the
    deadline must not leave its toulbar2 round running); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl: the parent's own kill still applies
            pass
        if os.getppid() == 1:  # the parent died before the call
            os._exit(1)


def _run(
    net: Network,
    penalty: np.ndarray,
    scale: float,
    seed: int,
    seconds: int,
    st: Steps | None,
    problem: Problem,
    gap: float = 0.0,
    log: str | None = None,
) -> _Run:
    """One toulbar2 solve of the network, unary costs raised by `penalty` (flat, per value)
    and, with `st`, the memory rows as knapsack constraints; it stops once its answer is
    within `gap` (real units) of its dual bound (toulbar2's -agap; its relative gap cannot
    be set through pytoulbar2 0.0.0.x, whose `option.relgap` takes only integers). High
    prices lower the scale so that the total stays within TOTAL (a priced round proves
    nothing anyway)."""
    priced = net.unary + penalty
    most = float(np.maximum.reduceat(priced, net.noff[:-1]).sum())
    most += float(np.max(net.binary, where=np.isfinite(net.binary), initial=0.0)) * len(net.eu)
    if most * scale > TOTAL:
        scale = 2.0 ** math.floor(math.log2(TOTAL / most))
    unary = np.floor(priced * scale)
    finite = net.binary[np.isfinite(net.binary)]
    binary = np.where(np.isfinite(net.binary), np.floor(net.binary * scale), 0.0)
    top = _top(net, unary, float(finite.max(initial=0.0)), scale)
    binary[~np.isfinite(net.binary)] = top
    t0 = time.perf_counter()
    import pytoulbar2  # here: the settings import without it (the portfolio's)

    cfn = pytoulbar2.CFN(ubinit=top, seed=_toulbar2_seed(seed), verbose=0)
    wcsp = cfn.CFN.wcsp
    _post_network(wcsp, net, binary)
    _post_unary(wcsp, net, unary)
    if st is not None:
        try:
            _knapsacks(cfn, net, st, problem)
        except pytoulbar2.pytb2.Contradiction:  # a row no choice meets: proven, no labelling
            _first_labelling(log)  # the log deleted
            return _Run(None, top, True, False, 0.0, 0, time.perf_counter() - t0, scale)
    return _solved(cfn, top, scale, seconds, gap, t0, log)


@dataclass(frozen=True, eq=False)
class _Prebuilt:
    """A priced round's network without its unary costs, built once in the search's process
    and inherited by each round's forked child, which posts the priced unary costs and
    solves: rebuilding the tables from Python lists each round took 0.34 s of a 1.2 s round
    on a problem with G's graph and 29 strategies per node (1.15 M entries), 40% of
    toulbar2's own time. Forbidden pairs cost HARD, above any round's upper bound (which
    makes them forbidden to toulbar2), so the tables do not depend on the prices; a round
    whose prices would need a lower scale (`_run`) is built whole instead."""

    cfn: Any  # pytoulbar2.CFN, never solved in this process
    scale: float
    binary_most: float  # the largest finite pair cost, unscaled

    def fits(self, net: Network, penalty: np.ndarray) -> bool:
        """Whether a round priced by `penalty` keeps this scale (and so its tables)."""
        priced = net.unary + penalty
        most = float(np.maximum.reduceat(priced, net.noff[:-1]).sum())
        return (most + self.binary_most * len(net.eu)) * self.scale <= TOTAL


def _top(net: Network, unary: np.ndarray, binary_most: float, scale: float) -> float:
    """Above any labelling's cost on the scaled network (each node's dearest priced value,
    each pair's dearest finite cost, one more each): toulbar2's upper bound, and the cost of
    a forbidden pair in a whole round's network."""
    dearest = float(np.maximum.reduceat(unary, net.noff[:-1]).sum())
    return dearest + (binary_most * scale + 1) * len(net.eu) + 1


def _toulbar2_seed(seed: int) -> int:
    """toulbar2's seed for ours (it takes 1 .. 2^31 - 1)."""
    return max(seed, 0) % (2**31 - 1) + 1


def _post_unary(wcsp: Any, net: Network, unary: np.ndarray) -> None:
    """Post the (scaled, integral) unary costs; a node of one cost is a nullary cost."""
    for i in range(net.num_nodes):
        costs = unary[net.noff[i] : net.noff[i + 1]]
        if len(costs) > 1 and costs.max() > costs.min():
            wcsp.postUnaryConstraint(i, costs.astype(np.int64).tolist(), False)
        elif costs[0] > 0:
            wcsp.postNullaryConstraint(int(costs.min()))


def _post_network(wcsp: Any, net: Network, binary: np.ndarray) -> None:
    """Post the network's variables and its binary tables (`binary`: scaled, integral) to a
    toulbar2 WCSP; a table of one value is a nullary cost."""
    for i in range(net.num_nodes):
        wcsp.makeEnumeratedVariable(f"x{i}", 0, int(net.dom[i]) - 1)
    for e in range(len(net.eu)):
        table = binary[net.eoff[e] : net.eoff[e + 1]]
        if table.max() > table.min():
            wcsp.postBinaryConstraint(
                int(net.eu[e]), int(net.ev[e]), table.astype(np.int64).tolist(), False
            )
        elif table[0] > 0:
            wcsp.postNullaryConstraint(int(table[0]))


HARD = 10**15  # a forbidden pair's cost in a prebuilt network (> TOTAL + the pairs' + 1)


def _prebuild(net: Network, scale: float) -> _Prebuilt | None:
    """The network's variables and binary tables as a pytoulbar2 CFN (None if pytoulbar2
    refuses them)."""
    import pytoulbar2  # here: the settings import without it (the portfolio's)

    finite = net.binary[np.isfinite(net.binary)]
    most = float(finite.max(initial=0.0))
    if (most * scale + 1) * len(net.eu) + TOTAL + 1 >= HARD:
        return None
    binary = np.where(np.isfinite(net.binary), np.floor(net.binary * scale), float(HARD))
    try:
        cfn = pytoulbar2.CFN(ubinit=None, verbose=0)
        _post_network(cfn.CFN.wcsp, net, binary)
    except Exception:  # pytoulbar2's own errors (a contradiction, a cost it cannot take)
        return None
    return _Prebuilt(cfn, scale, most)


def _run_prebuilt(
    net: Network, penalty: np.ndarray, scale: float, seed: int, seconds: int, pre: _Prebuilt,
    log: str | None = None,
) -> _Run:  # fmt: skip
    """`_run` of a priced round on the prebuilt network (in the round's child): its unary
    costs posted, the upper bound set below HARD, solved."""
    import pytoulbar2

    t0 = time.perf_counter()
    unary = np.floor((net.unary + penalty) * scale)
    top = _top(net, unary, pre.binary_most, scale)
    cfn = pre.cfn
    wcsp = cfn.CFN.wcsp
    option = pytoulbar2.pytb2.option
    option.seed = _toulbar2_seed(seed)
    # toulbar2's clock started when the parent built the network: its log's times (the
    # first labelling's, FIRST_FACTOR) count from this round's start instead
    option.startCpuTime, option.startRealTime = time.process_time(), time.time()
    _post_unary(wcsp, net, unary)
    cfn.UbInit = top
    return _solved(cfn, top, scale, seconds, 0.0, t0, log)


def _solved(
    cfn: Any, top: float, scale: float, seconds: int, gap: float, t0: float, log: str | None
) -> _Run:
    """Solve a built CFN within `seconds` (its absolute gap `gap`, real units): the round."""
    import pytoulbar2

    t1 = time.perf_counter()
    pytoulbar2.pytb2.option.limited = False  # set by toulbar2 when a limit stops the search
    pytoulbar2.pytb2.option.absgap = max(0, math.floor(gap * scale))
    result = cfn.Solve(timeLimit=seconds)
    elapsed = time.perf_counter() - t1
    dual = float(cfn.GetDDualBound())
    labels = None
    cost = math.inf
    if result is not None:
        labels = np.asarray(result[0], dtype=np.int64)
        cost = float(result[1])
    proven = dual >= min(cost, top) - 0.5
    if result is None and not pytoulbar2.pytb2.option.limited:
        # no labelling and no limit met: toulbar2 proved there is none (a knapsack row that
        # no choice meets is a contradiction before the search, its dual bound not raised)
        proven = True
    nodes = int(cfn.GetNbNodes())
    first = _first_labelling(log)  # read, and the log deleted, in every case
    first = first if labels is not None else None
    return _Run(labels, dual, proven, not proven, elapsed, nodes, t1 - t0, scale, first)


def _new_log() -> str | None:
    """A new empty temporary file for a round's toulbar2 log (None if none can be made)."""
    try:
        fd, path = tempfile.mkstemp(prefix="layerwise-toulbar2-", suffix=".log")
    except OSError:
        return None
    os.close(fd)
    return path


def _first_labelling(path: str | None) -> float | None:
    """toulbar2's seconds to the first labelling of its log (None if it has none), and the
    log deleted."""
    if path is None:
        return None
    try:
        with open(path, errors="replace") as f:
            text = f.read()
        os.unlink(path)
    except OSError:
        return None
    hit = _SOLUTION_LINE.search(text)
    return float(hit.group(1)) if hit else None


def _knapsacks(cfn: Any, net: Network, st: Steps, problem: Problem) -> None:
    """Each time step's memory row, per pool, as sum of usages <= limit (integers)."""
    assert problem.usage_limit is not None
    limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1)
    for t in range(st.count):
        live = np.flatnonzero((st.first <= t) & (t < st.after))
        for m in range(net.usage.shape[1]):
            rhs = math.floor(limit[m] * (1 + 1e-9))
            most = sum(float(net.usage[net.noff[i] : net.noff[i + 1], m].max()) for i in live)
            if most <= rhs:
                continue
            terms = [
                (int(i), s, int(net.usage[net.noff[i] + s, m]))
                for i in live
                for s in range(int(net.dom[i]))
                if net.usage[net.noff[i] + s, m] > 0
            ]
            cfn.AddGeneralizedLinearConstraint(terms, "<=", rhs)
