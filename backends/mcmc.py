"""`mcmc`: FlexFlow's Markov chain Monte Carlo search (Jia et al. 2019, Sec. 6).

Metropolis-Hastings over strategies. A proposal changes the config of one random node to a
random config (Sec. 6.2); it is accepted with probability

    alpha(S* | S) = min(1, exp(beta * (cost(S) - cost(S*))))

(Sec. 6.1; the formula is from the FlexFlow slides, 004, which 002 lost in extraction).
Costs are the simulated makespan by default (delta simulation, `planner.sim.simulator`), or the
additive cost (OptCNN Eq. 1, updated in O(degree) per proposal). Proposals that break the
memory limit are rejected.

The search restarts from several initial strategies (Sec. 6.2): data parallelism, the
expert strategies (planner.problems.baselines), the warm start when one is given (e.g. the
`elimination` optimum of the additive model), and a random strategy. Each chain gets an equal
share of the proposal budget and stops early after half its budget without improvement.

Options (`SolveOptions.extra`): "iterations" (proposals per chain, default 1000),
"beta" (per second of cost; default 50 / cost of the chain's start, so a proposal 2% worse
than the start is accepted with probability 1/e), "inits" (a subset of "data_parallel",
"expert", "warm_start", "random"), "simulation" ("delta", default, or "full": rebuild and
re-simulate every proposal from scratch, FlexFlow's baseline in its Table 4), "polish"
(default False: after the chains, a first-improvement local search over single-node changes
until none improves; `stats["locally_optimal"]` says whether it finished in time).

Deterministic for a seed within the iteration budget; the time limit stops it earlier with
limit TIME. `stats["trace"]` holds (seconds, best cost) each time the best improves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from backends.base import (
    Backend,
    BackendError,
    Limit,
    SolveOptions,
    SolveResult,
    Status,
    evaluate_objective,
    past,
)
from planner.errors import ConfigError
from planner.problems.baselines import BASELINES, applicable
from planner.problems.evaluate import memory_feasible
from planner.problems.problem import Problem

INITS = ("data_parallel", "expert", "warm_start", "random")


class _Additive:
    """Eq. 1 with O(degree) updates."""

    def __init__(self, problem: Problem, choices: Sequence[int]):
        self.p = problem
        self.choices = list(choices)
        self.incident: list[list[int]] = [[] for _ in range(problem.num_nodes)]
        for k, (u, v) in enumerate(problem.edges):
            self.incident[u].append(k)
            self.incident[v].append(k)
        self.cost = evaluate_objective(problem, self.choices, "additive")

    def _node_part(self, i: int, c: int) -> float:
        total = float(self.p.node_cost[i][c])
        for k in self.incident[i]:
            u, v = self.p.edges[k]
            t = self.p.edge_cost[k]
            total += float(t[c, self.choices[v]] if u == i else t[self.choices[u], c])
        return total

    def propose(self, i: int, c: int) -> float:
        old = self.choices[i]
        if not math.isfinite(self.cost):  # from a forbidden start: no delta to build on
            self.choices[i] = c
            return evaluate_objective(self.p, self.choices, "additive")
        delta = self._node_part(i, c) - self._node_part(i, old)
        self.choices[i] = c
        return self.cost + delta if math.isfinite(delta) else math.inf

    def commit(self, cost: float) -> None:
        self.cost = cost

    def revert(self, i: int, c: int) -> None:
        self.choices[i] = c


class _Makespan:
    """The simulated makespan with delta simulation (FlexFlow Alg. 2)."""

    def __init__(self, problem: Problem, choices: Sequence[int], delta: bool = True):
        from planner.sim.simulator import Simulator

        assert problem.cost_model is not None and problem.space is not None
        self.p = problem
        self.delta = delta
        self.choices = list(choices)
        self.sim = Simulator(problem.cost_model, problem.strategy(choices).configs)
        self.cost = self.sim.makespan

    def _set(self, i: int, c: int) -> float:
        from planner.sim.simulator import Simulator

        space, cm = self.p.space, self.p.cost_model
        assert space is not None and cm is not None
        self.choices[i] = c
        if not self.delta:  # Algorithm 1 from scratch, for comparison
            self.sim = Simulator(cm, self.p.strategy(self.choices).configs)
            return self.sim.makespan
        return self.sim.change_many([(op, space[op].configs[c]) for op in self.p.ops_of_nodes[i]])

    def propose(self, i: int, c: int) -> float:
        return self._set(i, c)

    def commit(self, cost: float) -> None:
        self.cost = cost

    def revert(self, i: int, c: int) -> None:
        self._set(i, c)


class McmcBackend(Backend):
    name = "mcmc"
    objectives = ("makespan", "additive")
    exact = False

    def _solve(self, problem: Problem, options: SolveOptions) -> SolveResult:
        extra = options.extra
        iterations = int(extra.get("iterations", 1000))
        inits = tuple(extra.get("inits", INITS))
        if iterations < 1 or not set(inits) <= set(INITS):
            raise BackendError(f"mcmc needs iterations >= 1 and inits from {INITS}")
        rng = np.random.default_rng(options.seed)
        deadline = time.perf_counter() + options.time_limit
        starts = self._starts(problem, options, inits, rng)
        best: tuple[float, tuple[int, ...]] | None = None
        trace: list[tuple[float, float]] = []
        chains = []
        timed_out = False
        t0 = time.perf_counter()
        for name, choices in starts:
            if past(deadline):
                timed_out = True
                break
            value, found, steps, accepted, stop = self._chain(
                problem, options, choices, iterations, rng, deadline
            )
            chains.append({"init": name, "best": value, "proposals": steps, "accepted": accepted})
            if found is not None and (best is None or value < best[0]):
                best = (value, found)
                trace.append((time.perf_counter() - t0, value))
            timed_out = timed_out or stop
        stats: dict[str, Any] = {
            "chains": chains,
            "trace": trace,
            "iterations_per_chain": iterations,
        }
        if best is not None and extra.get("polish", False) and not timed_out:
            value, found, complete = self._polish(problem, options, best[1], deadline)
            stats["locally_optimal"] = complete
            if value < best[0]:
                best = (value, found)
                trace.append((time.perf_counter() - t0, value))
            timed_out = not complete
        limit = Limit.TIME if timed_out else Limit.ITERATIONS
        if best is None:
            return SolveResult(self.name, Status.NO_SOLUTION, limit=limit, stats=stats)
        return SolveResult(self.name, Status.FEASIBLE, best[1], limit=limit, stats=stats)

    def _starts(
        self,
        problem: Problem,
        options: SolveOptions,
        inits: tuple[str, ...],
        rng: np.random.Generator,
    ) -> list[tuple[str, tuple[int, ...]]]:
        out: list[tuple[str, tuple[int, ...]]] = []
        has_dnn = problem.graph is not None and problem.devices is not None
        for name in inits:
            if name == "warm_start" and options.warm_start is not None:
                out.append((name, problem.check_choices(options.warm_start)))
            elif name == "random":
                out.append((name, tuple(int(rng.integers(n)) for n in problem.sizes)))
            elif name in ("data_parallel", "expert") and has_dnn:
                assert problem.graph is not None and problem.devices is not None
                names = (
                    ["data_parallel"]
                    if name == "data_parallel"
                    else [b for b in applicable(problem.graph) if b != "data_parallel"]
                )
                for b in names:
                    try:
                        out.append(
                            (b, problem.choices_of(BASELINES[b](problem.graph, problem.devices)))
                        )
                    except ConfigError:
                        continue
            elif name == "data_parallel" and not has_dnn:
                out.append(("cheapest_node", tuple(int(np.argmin(c)) for c in problem.node_cost)))
        return out

    def _polish(
        self, problem: Problem, options: SolveOptions, choices: tuple[int, ...], deadline: float
    ) -> tuple[float, tuple[int, ...], bool]:
        """First-improvement local search until no single-node change improves the cost
        (then the answer is locally optimal: complete=True) or time runs out."""
        state = self._state(problem, options, choices)
        improved = True
        while improved:
            improved = False
            for i in range(problem.num_nodes):
                for c in range(problem.sizes[i]):
                    if past(deadline):
                        return state.cost, tuple(state.choices), False
                    old = state.choices[i]
                    if c == old:
                        continue
                    new = state.propose(i, c)
                    ok = problem.usage_limit is None or memory_feasible(problem, state.choices)
                    if ok and new < state.cost * (1 - 1e-12):
                        state.commit(new)
                        improved = True
                    else:
                        state.revert(i, old)
        return state.cost, tuple(state.choices), True

    @staticmethod
    def _state(
        problem: Problem, options: SolveOptions, choices: Sequence[int]
    ) -> _Makespan | _Additive:
        if options.objective == "makespan":
            return _Makespan(problem, choices, options.extra.get("simulation", "delta") == "delta")
        return _Additive(problem, choices)

    def _chain(
        self,
        problem: Problem,
        options: SolveOptions,
        choices: tuple[int, ...],
        iterations: int,
        rng: np.random.Generator,
        deadline: float,
    ) -> tuple[float, tuple[int, ...] | None, int, int, bool]:
        state = self._state(problem, options, choices)
        valid = math.isfinite(state.cost) and memory_feasible(problem, state.choices)
        best_value = state.cost if valid else math.inf
        best = tuple(state.choices) if valid else None
        beta = float(
            options.extra.get("beta", 50.0 / state.cost if valid and state.cost > 0 else 1.0)
        )
        since, accepted, step = 0, 0, 0
        for step in range(1, iterations + 1):
            if since > iterations // 2:
                break
            if step % 16 == 0 and past(deadline):
                return best_value, best, step, accepted, True
            i = int(rng.integers(problem.num_nodes))
            old = state.choices[i]
            c = int(rng.integers(problem.sizes[i]))
            u = rng.random()
            if c == old:
                since += 1
                continue
            new = state.propose(i, c)
            ok = math.isfinite(new) and (
                problem.usage_limit is None or memory_feasible(problem, state.choices)
            )
            current = state.cost if math.isfinite(state.cost) else math.inf
            if ok and (new <= current or u < math.exp(beta * (current - new))):
                state.commit(new)
                accepted += 1
                if new < best_value:
                    best_value, best, since = new, tuple(state.choices), 0
                    continue
            else:
                state.revert(i, old)
            since += 1
        return best_value, best, step, accepted, False
