"""`search`: exact depth-first branch and bound (or A*) over every op's config.

OptCNN's baseline (Sec. 5.2, Table 3) is a depth-first search over the original graph; this
one prunes with an admissible bound (`backends.branch_and_bound`), so it is exact and much
faster than plain DFS, yet still exponential: use it on small graphs or with a time limit,
after which it returns its best-so-far answer as FEASIBLE with limit TIME. Memory limits are
honoured exactly. Options (`SolveOptions.extra`): mode "dfs" (default), "astar", or "plain"
(no lookahead bound: the DFS baseline of OptCNN Table 3).
"""

from __future__ import annotations

import math

from backends.base import Backend, BackendError, Limit, SolveOptions, SolveResult, Status
from backends.branch_and_bound import Memory, solve_exact
from planner.evaluate import additive_cost, memory_feasible
from planner.problem import Problem


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


class SearchBackend(Backend):
    name = "search"
    objectives = ("additive",)
    exact = True

    def _solve(self, problem: Problem, options: SolveOptions) -> SolveResult:
        mode = options.extra.get("mode", "dfs")
        if mode not in ("dfs", "astar", "plain"):
            raise BackendError(f"search mode must be 'dfs', 'astar' or 'plain', got {mode!r}")
        edges = [(u, v, t) for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True)]
        incumbent = warm_incumbent(problem, options)
        out = solve_exact(
            problem.node_cost,
            edges,
            options.time_limit,
            memory=memory_of(problem),
            incumbent=incumbent,
            mode=mode,
        )
        stats = {"expanded": out.expanded, "mode": mode, "warm_start_used": incumbent is not None}
        if out.complete:
            if out.choices is None:
                return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
            return SolveResult(self.name, Status.OPTIMAL, out.choices, bound=out.value, stats=stats)
        if out.choices is None:
            return SolveResult(
                self.name, Status.NO_SOLUTION, bound=out.bound, limit=Limit.TIME, stats=stats
            )
        return SolveResult(
            self.name, Status.FEASIBLE, out.choices, bound=out.bound, limit=Limit.TIME, stats=stats
        )
