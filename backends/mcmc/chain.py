"""`mcmc`: FlexFlow's Markov chain Monte Carlo search (Jia et al. 2019, Sec. 6).

Metropolis-Hastings over strategies: a proposal changes the config of one node (several tied
ops) and is accepted with probability

    alpha(S* | S) = min(1, exp(beta * (cost(S) - cost(S*))))

(Sec. 6.1, Eq. 2; the formula is from the FlexFlow slides, 004, which 002 lost in
extraction). The cost is the simulated makespan (delta simulation, FlexFlow Alg. 2,
`planner.sim.simulator`) or the additive cost (OptCNN Eq. 1, updated in O(degree)).

Starts (`backends.mcmc.starts`). FlexFlow (Sec. 6.2) runs one chain per initial strategy,
one after another; with a proposal costing ~0.1 s at 16 devices, a 60 s budget then never
reaches the later, better starts. Here every start is scored first, in the order of its
Eq. 1 cost (hopeless ones are not simulated: SKIP_FACTOR, START_SHARE), and one chain runs
from the best. The answer is the best valid strategy seen, so never worse than the best
valid start.

Temperature. beta = 1 / (T * cost(first state)): a proposal T (relative) worse than the
current one is accepted with probability 1/e. T starts at `temperature[0]` and returns there
at every new best; after `cycle` * 2^level proposals without one, the chain goes back to the
best strategy and the level rises (T doubles, up to `temperature[1]`); at the hottest level
every other round restarts from one of the starts instead. `beta` fixes beta instead.

Memory (FlexFlow's implementation penalized memory over the limit instead of forbidding it):
the energy is cost + w * (violation + OVER_CHARGE if over) * cost(first state), where violation
is the peak's relative excess over the limit summed over pools (kept incrementally:
`backends.mcmc.state`); the fixed charge makes a state over the limit by a hair cost as much as
one over by OVER_CHARGE, else a state 1e-5 over would outweigh any valid one. w grows geometrically from `penalty[0]` to `penalty[1]` over the budget. `repair`
proposals free memory on the over-full pool. Only valid strategies are ever returned.

Settings (`McmcSettings`, given as `SolveOptions.extra`; docs/simulator.md, "MCMC search"):
"iterations" (a cap on proposals; default none: run to the time limit, limit TIME), "inits",
"temperature", "cycle", "beta", "mix" (weights of the proposal kinds,
`backends.mcmc.proposals`), "screen" (reject unsimulated a proposal whose Eq. 1 increase
exceeds this share of the current makespan; 0 disables), "penalty", "repair", "simulation"
("delta" or "full"), "polish" (after an iteration-capped chain, a first-improvement local
search over single-node changes).

Deterministic for a seed under an iteration cap. `stats["trace"]` (`backends.trace`) holds
(seconds, best) at every new best, in the objective's units (the makespan: the chain's
simulated seconds). With a caller's `SolveOptions.channel` (the portfolio) a new best goes
to `on_incumbent` at most every SEND_SECONDS (the last one with the result).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import numpy as np

from backends.base import (
    Backend,
    BackendSettings,
    Check,
    Coerce,
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
from backends.mcmc.proposals import DNN_MIX, KINDS, TABLE_MIX, Proposer
from backends.mcmc.starts import INITS, start_choices
from backends.mcmc.state import ChainState
from backends.trace import Improvements, own_trace
from planner.problems.evaluate import additive_cost
from planner.problems.problem import Problem

START_SHARE = 0.3  # of the time limit, at most, for simulating the starts (one at least)
SKIP_FACTOR = 4.0  # starts whose Eq. 1 cost is over this times the best start's: not simulated
SEND_SECONDS = 1.0  # a new best goes to the caller's channel at most this often
RESYNC = 1000  # accepted moves between exact recomputations of the memory sweep
OVER_CHARGE = 1e-3  # the violation charged for being over the limit at all (see Memory above)


def _energy(cost: float, violation: float, weight: float, scale: float) -> float:
    over = violation + OVER_CHARGE if violation > 0 else 0.0
    return cost + weight * over * scale


def _unit(problem: Problem, state: ChainState) -> float:
    """The unit of temperature and of the memory penalty: the chain's first state's cost when
    that state is valid. An invalid first state's cost (forbidden terms left out, memory
    over the limit) may be far below every valid one's (a random start: 26 where the one
    valid strategy costs 6,475), and a penalty in its unit could then never outweigh the
    climb to validity: the unit is then at least an upper bound of any strategy's finite
    cost, the sum of every node's and edge's dearest finite cost."""
    if state.valid:
        return max(state.cost, 1e-300)
    tables = (np.asarray(t, dtype=np.float64) for t in (*problem.node_cost, *problem.edge_cost))
    dearest = sum(float(t[np.isfinite(t)].max()) for t in tables if np.isfinite(t).any())
    return max(state.cost, dearest, 1e-300)


__all__ = ["McmcBackend", "McmcSettings"]


def _positive(v: float) -> bool:
    return v > 0


def _none_or_positive(v: float | None) -> bool:
    return v is None or v > 0


def _none_or_nonnegative(v: float | None) -> bool:
    return v is None or v >= 0


def _all_positive(pair: tuple[float, ...]) -> bool:
    return all(t > 0 for t in pair)


def _inits_ok(inits: tuple[str, ...]) -> bool:
    return bool(inits) and set(inits) <= set(INITS)


def _pair(value: Any) -> Any:
    """One number for a pair of equal ones (a temperature or penalty range)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value), float(value)
    return value


def _mix_ok(mix: Mapping[str, float]) -> bool:
    weights = list(mix.values())
    drawn = set(KINDS[:-1])  # repairs are not drawn by weight: see `repair`
    return set(mix) <= drawn and all(w >= 0 for w in weights) and (not mix or sum(weights) > 0)


Pair = Annotated[
    tuple[float, float], Coerce(_pair), Check("a positive number or a pair of them", _all_positive)
]


@dataclass(frozen=True)
class McmcSettings(BackendSettings):
    """The `mcmc` backend's settings (module docstring)."""

    iterations: Annotated[int | None, Check("a positive integer or None", _none_or_positive)] = None
    """a cap on proposals (limit ITERATIONS); None: run to the time limit (limit TIME)"""
    inits: Annotated[tuple[str, ...], Check(f"a non-empty list from {INITS}", _inits_ok)] = INITS
    """the starts scored before the chain (`backends.mcmc.starts`)"""
    temperature: Pair = (0.001, 0.02)
    """the relative temperature T at a new best and its hottest level (one number: both)"""
    beta: Annotated[float | None, Check("a number >= 0 or None", _none_or_nonnegative)] = None
    """a fixed beta instead of 1 / (T * cost of the first state)"""
    cycle: Annotated[int, Check("a positive integer", _positive)] = 50
    """proposals without a new best before the level rises (times 2^level)"""
    mix: Annotated[
        Mapping[str, float],
        Check(f"weights >= 0 of proposal kinds from {KINDS[:-1]}, a positive weight among them",
              _mix_ok),
    ] = field(default_factory=dict)  # fmt: skip
    """weights of the proposal kinds (`backends.mcmc.proposals`); {}: the default mix"""
    screen: Annotated[float, at_least(0)] = 0.05
    """reject unsimulated a proposal whose Eq. 1 increase exceeds this share of the current
    makespan; 0 disables"""
    penalty: Pair = (1.0, 1000.0)
    """the memory penalty weight at the start and at the end of the budget"""
    repair: Annotated[float, between(0, 1)] = 0.5
    """the share of proposals that free memory on an over-full pool while over the limit"""
    simulation: Literal["delta", "full"] = "delta"
    """delta simulation (FlexFlow Alg. 2) or a full simulation per proposal"""
    polish: bool = False
    """after an iteration-capped chain, a first-improvement search over single-node changes"""


class McmcBackend(Backend[McmcSettings]):
    name = "mcmc"
    objectives = ("makespan", "additive")
    exact = False
    settings_type = McmcSettings
    own_trace = True  # every new best, valued by the chain (stats["trace"])

    def _solve(
        self, problem: Problem, options: SolveOptions, settings: McmcSettings
    ) -> SolveResult:
        return _Search(problem, options, settings).run()


class _Search:
    """One run: score the starts, then one annealing chain with restarts (module docstring)."""

    def __init__(self, problem: Problem, options: SolveOptions, settings: McmcSettings):
        self.p = problem
        self.opts = options
        self.s = settings
        self.rng = np.random.default_rng(options.seed)
        self.t0 = time.perf_counter()
        self.clock = options.clock()
        self.deadline = self.clock.at
        self.starts_until = self.clock.part(START_SHARE).at  # START_SHARE of the time limit
        self.best: tuple[float, tuple[int, ...]] | None = None
        self.trace = Improvements(self.t0)  # every new best (stats["trace"])
        self.sent = -math.inf  # when the last new best went to the channel's on_incumbent
        self.log = ProgressLog("mcmc")
        self.counts = {k: [0, 0, 0] for k in KINDS}  # proposed, accepted, new best
        self.stats: dict[str, Any] = {}
        self.step = self.max_level = 0  # the chain's proposal count and highest heat level
        self.scale = 1.0  # cost of the chain's first state: the unit of temperature
        self.start_list: list[tuple[int, ...]] = []  # the simulated starts, in Eq. 1 order
        self.reserve = 0.0  # seconds kept for the re-score: the slowest full simulation seen

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> SolveResult:
        from backends.mcmc.state import MemoryUsage

        p = self.p
        if p.usage_limit is not None:
            reason = MemoryUsage(p, [0] * p.num_nodes).proven_infeasible()
            if reason is not None:
                return SolveResult("mcmc", Status.INFEASIBLE, stats={"infeasible": reason})
        state = self._best_start()
        # Backend.solve re-scores the answer with a full simulation: keep time for it (at
        # 1,024 GPUs a 30 s limit may then leave the chain nothing: the answer is the best start).
        self.deadline -= self.reserve
        limit = Limit.TIME if state is None else self._chain(state)
        if self.s.polish and self.best is not None and limit is Limit.ITERATIONS:
            limit = self._polish()
        self.stats["trace"] = own_trace(self.trace)
        self.stats["proposal_kinds"] = {k: v for k, v in self.counts.items() if v[0]}
        if self.best is None:
            return SolveResult("mcmc", Status.NO_SOLUTION, limit=limit, stats=self.stats)
        best, value = self.best[1], self.best[0]
        bound = self.opts.channel.known_bound()  # proven elsewhere: OPTIMAL when within it
        return SolveResult(
            "mcmc", Status.FEASIBLE, best, value, bound, limit=limit, stats=self.stats
        )

    def _keep(self, state: ChainState) -> bool:
        """Record the state if it is valid and better than the best so far."""
        if not state.valid or (self.best is not None and state.cost >= self.best[0]):
            return False
        self.best = (state.cost, tuple(state.choices))
        now = time.perf_counter()
        self.trace.add(state.cost, now)
        send = self.opts.channel.on_incumbent
        if send is not None and now - self.sent >= SEND_SECONDS:
            send(self.best[1], "mcmc")
            self.sent = now
        return True

    # -- starts ----------------------------------------------------------------------------

    def _best_start(self) -> ChainState | None:
        """Score the starts (module docstring) in the order of their Eq. 1 cost; return the
        state of the best one. Under the makespan objective a start is not simulated when its
        Eq. 1 cost is over SKIP_FACTOR times the best start's (its simulation can take longer
        than the whole budget: model parallelism of nmt on 16 GPUs has 3.4 M tasks, 72 s), or
        once the starts have used START_SHARE of the budget."""
        scores: dict[str, float | None] = {}
        skipped: list[str] = []
        best: tuple[float, ChainState] | None = None
        found = start_choices(self.p, self.opts, self.s.inits, self.rng, self.deadline)
        eq1 = [additive_cost(self.p, choices) for _, choices in found]
        cheapest = min(eq1, default=math.inf)
        budget = self.starts_until
        simulated = self.opts.objective == "makespan"
        longest = 0.0  # the slowest start's simulation so far
        for k in sorted(range(len(found)), key=lambda k: (eq1[k], k)):
            name, choices = found[k]
            if past(self.deadline):
                break
            began = time.perf_counter()
            late = began + longest > budget
            hopeless = eq1[k] > SKIP_FACTOR * cheapest or late
            if best is not None and simulated and hopeless:
                skipped.append(name)
                continue
            state = ChainState(self.p, choices, self.opts.objective, self.s.simulation)
            longest = max(longest, time.perf_counter() - began)
            if simulated:  # the answer is re-simulated in full after the search (Backend.solve)
                self.reserve = longest
            energy = _energy(
                state.cost, state.violation, self.s.penalty[0], max(state.cost, 1e-300)
            )
            scores[name] = state.cost if state.valid else None
            self.start_list.append(tuple(choices))
            self._keep(state)
            if best is None or energy < best[0]:
                best, self.stats["start"] = (energy, state), name
        self.stats["starts"] = scores
        self.stats["skipped_starts"] = skipped
        return None if best is None else best[1]

    # -- the chain -------------------------------------------------------------------------

    def _schedule(self, level: int) -> tuple[float, float]:
        """(beta per unit of energy, penalty weight) at this heat level and budget point."""
        if self.s.iterations is not None:
            frac = min(1.0, self.step / self.s.iterations)
        else:
            frac = min(1.0, (time.perf_counter() - self.t0) / self.clock.limit)
        (first, hottest), (w0, w1) = self.s.temperature, self.s.penalty
        temp = min(hottest, first * 2**level)
        beta = self.s.beta if self.s.beta is not None else 1.0 / (temp * self.scale)
        return beta, w0 * (w1 / w0) ** frac

    def _energy(self, cost: float, violation: float, weight: float) -> float:
        return _energy(cost, violation, weight, self.scale)

    def _proven(self) -> bool:
        """Whether the best is within the gap tolerance of a bound proven elsewhere
        (`SolveOptions.channel.bound`; mcmc proves none itself)."""
        bound = self.opts.channel.known_bound()
        best = self.best[0] if self.best is not None else None
        return bound is not None and proven_within(best, bound, self.opts.gap_tolerance)

    def _chain(self, state: ChainState) -> Limit | None:
        s, rng = self.s, self.rng
        self.scale = _unit(self.p, state)
        mix = s.mix or (DNN_MIX if self.p.is_dnn else TABLE_MIX)
        proposer = Proposer(self.p, mix, rng)
        screen = s.screen if state.sim is not None else 0.0
        first, hottest = s.temperature
        self.max_level = max(0, math.ceil(math.log2(hottest / first)))
        step = accepted = screened = level = since = restarts = 0
        limit: Limit | None = None
        beta = weight = 0.0
        longest, last = 0.0, time.perf_counter()  # the slowest step so far, and when it began
        while True:
            if s.iterations is not None and step >= s.iterations:
                limit = Limit.ITERATIONS
                break
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
            # Not a step that would end past the deadline: at 1,024 devices one (a restart's
            # jump, a group move) can take seconds.
            if past(self.deadline) or now + longest > self.deadline:
                limit = Limit.TIME
                break
            step = self.step = step + 1
            if since >= s.cycle * 2**level and self.best is not None:
                # Stuck: back to the best, and the next round hotter and longer; once at the
                # hottest, every other round goes back to one of the starts instead, in turn.
                target = self.best[1]
                if level == self.max_level and restarts % 2:
                    target = self.start_list[(restarts // 2) % len(self.start_list)]
                state.jump_to(target)
                level, since, restarts = min(level + 1, self.max_level), 0, restarts + 1
            since += 1
            beta, weight = self._schedule(level)
            proposal = proposer.propose(state, s.repair if not state.valid else 0.0)
            if proposal is None:
                limit = Limit.ITERATIONS  # a single choice vector: nothing to search
                break
            kind, changes = proposal
            self.counts[kind][0] += 1
            if screen and kind != "repair" and self._screened(state, changes, screen):
                screened += 1
                continue
            before = self._energy(state.cost, state.violation, weight)
            was = state.cost, state.violation
            undo = [(i, state.choices[i]) for i, _ in changes]
            state.move(changes)
            after = self._energy(state.cost, state.violation, weight)
            u = rng.random()
            if after <= before or u < math.exp(-beta * (after - before)):
                accepted += 1
                self.counts[kind][1] += 1
                if self._keep(state):
                    self.counts[kind][2] += 1
                    level = since = 0  # improving: stay greedy
                    if self._proven():
                        limit = None  # within the gap tolerance of a bound given: done
                        break
                if accepted % RESYNC == 0 and state.memory is not None:
                    state.memory.resync()
            else:
                state.undo(undo, *was)
            self._progress(step, accepted, state, beta)
        self.stats.update(
            proposals=step,
            accepted=accepted,
            screened=screened,
            simulated=step - screened,
            acceptance_rate=accepted / max(1, step - screened),
            restarts=restarts,
            final_level=level,
            final_beta=beta,
            final_penalty=weight,
        )
        self._progress(step, accepted, state, beta, force=True)
        return limit

    @staticmethod
    def _screened(state: ChainState, changes: list[tuple[int, int]], screen: float) -> bool:
        """OptCNN Eq. 1 says the proposal is much worse: not worth a simulation."""
        if len(changes) == 1:
            delta = state.additive.delta(*changes[0])[0]
        else:
            delta = state.additive.delta_many(changes)
        return delta > screen * state.cost

    def _progress(
        self, step: int, accepted: int, state: ChainState, beta: float, force: bool = False
    ) -> None:
        self.log(
            lambda: (
                f"{step} proposals, best {self.best[0] if self.best else math.inf:.6g}, "
                f"current {state.cost:.6g}{'' if state.valid else ' (invalid)'}, "
                f"beta {beta:.4g}, acceptance {accepted / max(1, step):.1%}"
            ),
            force=force,
        )

    def _polish(self) -> Limit:
        """First-improvement local search until no single-node change improves the best
        (stats["locally_optimal"]) or time runs out."""
        assert self.best is not None
        p = self.p
        state = ChainState(p, self.best[1], self.opts.objective, self.s.simulation)
        improved = True
        while improved:
            improved = False
            for i in range(p.num_nodes):
                for c in range(p.sizes[i]):
                    if past(self.deadline):
                        self.stats["locally_optimal"] = False
                        return Limit.TIME
                    old = state.choices[i]
                    if c == old:
                        continue
                    value, _ = state.move([(i, c)])
                    if state.valid and value < self.best[0] * (1 - 1e-12):
                        self._keep(state)
                        improved = True
                    else:
                        state.move([(i, old)])
        self.stats["locally_optimal"] = True
        return Limit.ITERATIONS
