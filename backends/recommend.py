"""Never recommend a strategy that the simulator says is slower than an expert baseline.

OptCNN's additive objective (Eq. 1) sums compute, parameter synchronization and transfers as
if nothing overlapped; FlexFlow's simulator (Sec. 5) overlaps them. The two can rank
strategies differently: on lenet5 / p100-1x4 the additive optimum simulates at 0.053 ms and
data parallelism at 0.049 ms, because the ring all-reduce that Eq. 1 charges in full hides
behind the backward pass. An answer searched under the additive objective is the right
object for research (it is what the paper optimizes, with a proof), but not what a user
should run when a baseline is faster.

`recommend(problem, result)` applies the rule: simulate the answer and every applicable
expert strategy (`planner.problems.baselines`, those in the problem's config space and
within its memory limit); if a baseline simulates faster (by more than `RTOL`), return that
baseline as the answer. The returned result is then FEASIBLE (no longer the optimum of the
searched objective), its `objective` is the baseline's value under that objective, and the
backend's `bound` stays, so `gap` says how far the recommendation is from the proven optimum
of the searched objective. The replaced answer is kept in `stats["searched"]` (choices, status,
both objectives, bound), and `stats["recommendation"]` always says what was decided and why.

The rule holds for both objectives (under "makespan" it only switches when the search ended
worse than a baseline) and does nothing for cost-table problems (nothing to simulate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.base import SolveResult, Status, evaluate_objective
from planner.errors import ConfigError
from planner.problems.baselines import BASELINES, applicable
from planner.problems.evaluate import memory_feasible
from planner.problems.problem import Problem

__all__ = ["RTOL", "BaselineTime", "baseline_times", "is_switched", "recommend"]

RTOL = 1e-9  # a baseline must be faster than this relative margin to replace the answer


@dataclass(frozen=True)
class BaselineTime:
    """An expert strategy of a problem: its choices and simulated iteration time (s)."""

    name: str
    choices: tuple[int, ...]
    simulated: float


def baseline_times(problem: Problem) -> dict[str, BaselineTime]:
    """The applicable baselines of a DNN problem that are in its config space and memory
    limit, each simulated. Empty for cost-table problems."""
    if problem.graph is None or problem.devices is None or problem.cost_model is None:
        return {}
    out = {}
    for name in applicable(problem.graph):
        try:
            choices = problem.choices_of(BASELINES[name](problem.graph, problem.devices))
        except ConfigError:
            continue  # not in the (capped) config space
        if not memory_feasible(problem, choices):
            continue
        out[name] = BaselineTime(name, choices, evaluate_objective(problem, choices, "makespan"))
    return out


def recommend(
    problem: Problem,
    result: SolveResult,
    objective: str = "additive",
    baselines: Mapping[str, BaselineTime] | None = None,
) -> SolveResult:
    """`result` unless an expert baseline simulates faster; then that baseline (see the module
    docstring). `objective` is the one `result` was searched under; `baselines` may pass
    `baseline_times(problem)` when the caller has it already."""
    if result.choices is None or problem.cost_model is None or problem.space is None:
        reason = "no answer" if result.choices is None else "a cost-table problem"
        return _with(result, {"switched": False, "reason": f"nothing to simulate: {reason}"})
    times = baseline_times(problem) if baselines is None else baselines
    if objective == "makespan" and result.objective is not None:
        simulated = result.objective
    else:
        simulated = evaluate_objective(problem, result.choices, "makespan")
    decision: dict[str, Any] = {
        "simulated": simulated,
        "baselines": {name: b.simulated for name, b in times.items()},
    }
    fastest = min(times.values(), key=lambda b: b.simulated, default=None)
    if fastest is None or not fastest.simulated < simulated * (1 - RTOL):
        why = "no baseline applies" if fastest is None else "no baseline simulates faster"
        return _with(result, {**decision, "switched": False, "reason": why})
    decision.update(
        switched=True,
        to=fastest.name,
        reason=f"{fastest.name} simulates at {fastest.simulated * 1e3:.4g} ms, the "
        f"{result.backend} answer (searched under the {objective} objective) at "
        f"{simulated * 1e3:.4g} ms",
    )
    searched = {
        "backend": result.backend,
        "objective_kind": objective,
        "status": result.status.value,
        "limit": result.limit.value if result.limit else None,
        "choices": list(result.choices),
        "objective": result.objective,
        "bound": result.bound,
        "additive": evaluate_objective(problem, result.choices, "additive"),
        "simulated": simulated,
    }
    value = evaluate_objective(problem, fastest.choices, objective)
    stats = {**result.stats, "searched": searched, "recommendation": decision}
    return SolveResult(
        result.backend,
        Status.FEASIBLE,
        fastest.choices,
        value,
        result.bound,
        None,
        problem.strategy(fastest.choices),
        stats,
    )


def _with(result: SolveResult, decision: dict[str, Any]) -> SolveResult:
    return dataclasses.replace(result, stats={**result.stats, "recommendation": decision})


def is_switched(result: SolveResult) -> bool:
    """Whether `recommend` replaced the searched answer by a baseline."""
    return bool(result.stats.get("recommendation", {}).get("switched"))
