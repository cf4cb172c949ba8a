"""`search`: exact depth-first branch and bound (or A*) over every op's config.

OptCNN's baseline (Sec. 5.2, Table 3) is a depth-first search over the original graph; this
one prunes with an admissible bound (`backends.exact.branch_and_bound`), so it is exact and much
faster than plain DFS, yet still exponential: use it on small graphs or with a time limit,
after which it returns its best-so-far answer as FEASIBLE with limit TIME. Memory limits are
honoured exactly. Settings (`SearchSettings`, given as `SolveOptions.extra`): mode "dfs"
(default), "astar", or "plain" (no lookahead bound: the DFS baseline of OptCNN Table 3).

The makespan objective (FlexFlow's simulated iteration time) is searched depth first over
nodes in topological order with delta simulation of the partial strategy: ops not assigned
yet are left out of the task graph, and since every op only adds tasks and dependencies, the
partial makespan is a lower bound for every completion (the max-plus timeline is monotone).
Exact, but exponential: meant for small graphs (FlexFlow Sec. 8.4) or as a time-limited
improver from a warm start. Both searches prune within `SolveOptions.gap_tolerance`
(`backends.exact.branch_and_bound`): OPTIMAL is then optimal within it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from backends.base import (
    Backend,
    BackendSettings,
    Limit,
    ProgressLog,
    SolveOptions,
    SolveResult,
    Status,
    past,
)
from backends.exact.branch_and_bound import EXACT_GRACE, Memory, solve_exact
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem

__all__ = ["SearchBackend", "SearchSettings", "memory_of", "warm_incumbent"]


@dataclass(frozen=True)
class SearchSettings(BackendSettings):
    """The `search` backend's settings (additive objective; the makespan search has none)."""

    mode: Literal["dfs", "astar", "plain"] = "dfs"
    """"dfs": depth first with the lookahead bound; "astar": best first (`(f, counter, ...)`
    heap); "plain": depth first without the lookahead bound (OptCNN Table 3's baseline)."""


def memory_of(problem: Problem) -> Memory | None:
    if problem.usage_limit is None or problem.usage is None or problem.intervals is None:
        return None
    return Memory(problem.usage, problem.intervals, problem.usage_limit)


def warm_incumbent(problem: Problem, options: SolveOptions) -> tuple[tuple[int, ...], float] | None:
    """The warm start as an incumbent, when it is a valid answer."""
    if options.warm_start is None:
        return None
    choices = problem.check_choices(options.warm_start)
    value = additive_cost(problem, choices)
    if math.isfinite(value) and memory_feasible(problem, choices):
        return choices, value
    return None


class SearchBackend(Backend[SearchSettings]):
    name = "search"
    objectives = ("additive", "makespan")
    exact = True
    settings_type = SearchSettings

    def _solve(
        self, problem: Problem, options: SolveOptions, settings: SearchSettings
    ) -> SolveResult:
        if options.objective == "makespan":
            return self._solve_makespan(problem, options)
        mode = settings.mode
        edges = [(u, v, t) for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True)]
        incumbent = warm_incumbent(problem, options)
        out = solve_exact(
            problem.node_cost,
            edges,
            options.clock().at_least(EXACT_GRACE).at,
            memory=memory_of(problem),
            incumbent=incumbent,
            mode=mode,
            progress=ProgressLog(self.name),
            tolerance=options.gap_tolerance,
        )
        stats = {"expanded": out.expanded, "mode": mode, "warm_start_used": incumbent is not None}
        if out.complete:
            if out.choices is None:
                return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
            return SolveResult(self.name, Status.OPTIMAL, out.choices, bound=out.bound, stats=stats)
        if out.choices is None:
            return SolveResult(
                self.name, Status.NO_SOLUTION, bound=out.bound, limit=Limit.TIME, stats=stats
            )
        return SolveResult(
            self.name, Status.FEASIBLE, out.choices, bound=out.bound, limit=Limit.TIME, stats=stats
        )

    def _solve_makespan(self, problem: Problem, options: SolveOptions) -> SolveResult:
        from planner.sim.simulator import Simulator

        dnn = problem.dnn("the makespan objective simulates the DNN's strategy")
        cm, space, graph = dnn.cost_model, dnn.space, dnn.graph
        deadline = options.clock().at
        best: list[Any] = [math.inf, None]
        if options.warm_start is not None:
            start = problem.check_choices(options.warm_start)
            if memory_feasible(problem, start):
                best = [Simulator(cm, problem.strategy(start).configs).makespan, start]
        warm_used = best[1] is not None
        shrink = 1.0 / (1.0 + options.gap_tolerance)  # a partial makespan must beat best * shrink
        pruned_low = [math.inf]  # the least partial makespan the tolerance alone pruned
        sim = Simulator(cm, [None] * len(graph.ops))
        ops_of = problem.ops_of_nodes
        order = [np.argsort(c, kind="stable") for c in problem.node_cost]  # cheap first
        choice = [0] * problem.num_nodes
        stats = {"expanded": 0, "leaves": 0}
        timed_out = [False]

        def assign(node: int, c: int | None) -> None:
            sim.change_many(
                [(op, None if c is None else space[op].configs[c]) for op in ops_of[node]]
            )

        def visit(depth: int) -> None:
            if depth == problem.num_nodes:
                stats["leaves"] += 1
                if sim.makespan < best[0] and memory_feasible(problem, choice):
                    best[0], best[1] = sim.makespan, tuple(choice)
                return
            for c in order[depth]:
                stats["expanded"] += 1
                if past(deadline):
                    timed_out[0] = True
                    return  # no undoing on the way out: each undo re-times the simulation
                if not math.isfinite(problem.node_cost[depth][c]):
                    continue
                assign(depth, int(c))
                choice[depth] = int(c)
                if sim.makespan < best[0] * shrink:
                    visit(depth + 1)
                elif sim.makespan < best[0]:
                    pruned_low[0] = min(pruned_low[0], sim.makespan)
                if timed_out[0]:
                    return
            assign(depth, None)

        visit(0)
        stats["warm_start_used"] = warm_used
        if not timed_out[0]:
            if best[1] is None:
                return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
            bound = min(best[0], pruned_low[0])  # a partial makespan bounds its completions
            return SolveResult(self.name, Status.OPTIMAL, best[1], bound=bound, stats=stats)
        status = Status.FEASIBLE if best[1] is not None else Status.NO_SOLUTION
        return SolveResult(self.name, status, best[1], limit=Limit.TIME, stats=stats)
