"""Never recommend a strategy that the simulator says is slower than an expert baseline.

OptCNN's additive objective (Eq. 1) sums compute, parameter synchronization and transfers as
if nothing overlapped; FlexFlow's simulator (Sec. 5) overlaps them. The two can rank
strategies differently: on rnnlm / p100-1x4 the additive optimum simulates at 78.6 ms and
model parallelism at 70.0 ms. An answer searched under the additive objective is the right
object for research (it is what the paper optimizes, with a proof), but not what a user
should run when a baseline is clearly faster.

`recommend(problem, result)` applies the rule: simulate the answer and every applicable
expert strategy (`planner.problems.baselines`, those in the problem's config space, within
its memory limit and within every device's own memory: a plan that does not fit is never
recommended); if a baseline simulates faster by more than `SIMULATOR_ERROR` (the simulator's
stated error, below), return that baseline as the answer. The returned result is then
FEASIBLE (it is not the optimum of the searched objective), its `objective` is the baseline's
value under that objective, and the backend's `bound` stays, so `gap` says how far the
recommendation is from the proven optimum of the searched objective. The replaced answer is
kept in `stats["searched"]` (choices, status, both objectives, bound: what was proven stays
said), and `stats["recommendation"]` always says what was decided and why, with the margin.

The margin: the simulator's median error against measured step times is 5.6-10.3% for the
zoo models where it meets its accuracy target (README, docs/runtime.md "Simulator
accuracy"), so a baseline simulated 0.02% faster (alexnet on 4 GPUs, 13.49 against 13.50
ms) is no evidence that it runs faster, and neither is lenet5's 7.7% on p100-1x4; a proven
optimum is replaced only beyond `SIMULATOR_ERROR` = 10%.

Simulating a baseline can cost more than the search (model parallelism of inception_v3 on
64 GPUs: 40 s, for a strategy that simulates 50x slower than the answer). A baseline whose
Eq. 1 cost is over `HOPELESS` = 10 times the answer's is not simulated; it is listed in
`stats["recommendation"]["not_simulated"]` with that ratio. This is a heuristic, chosen from
a measurement: over the zoo's 9 models on 4, 8 and 16 P100s, the baselines that simulate
faster than elimination's optimum have at most 3.5 times its Eq. 1 cost (data parallelism
of lenet5 on 4 GPUs; the others at most 1.24 times). `baseline_times` (what `compare`
uses) simulates every baseline.

The rule holds for both objectives (under "makespan" it only switches when the search ended
worse than a baseline) and does nothing for cost-table problems (nothing to simulate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.deadline import Deadline, OutOfTime
from planner.errors import ConfigError
from planner.problems.baselines import BASELINES, applicable
from planner.problems.evaluate import additive_cost, fits_devices, memory_peak
from planner.problems.problem import Problem
from planner.result import SolveResult, Status, evaluate_objective

__all__ = [
    "HOPELESS",
    "SIMULATOR_ERROR",
    "BaselineTime",
    "baseline_choices",
    "baseline_times",
    "is_switched",
    "recommend",
]

# A baseline must simulate faster than the answer by more than this fraction to replace it:
# the simulator's stated error (its median error per model, 5.6-10.3%: module docstring).
SIMULATOR_ERROR = 0.10
HOPELESS = 10.0  # a baseline over this many times the answer's Eq. 1 cost is not simulated


@dataclass(frozen=True)
class BaselineTime:
    """An expert strategy of a problem: its choices and simulated iteration time (s)."""

    name: str
    choices: tuple[int, ...]
    simulated: float


def baseline_choices(problem: Problem) -> dict[str, tuple[int, ...]]:
    """The applicable baselines of a DNN problem that are in its config space, its memory
    limit and every device's memory, as choice vectors. Empty for cost-table problems."""
    return _baselines(problem)[0]


def _baselines(problem: Problem) -> tuple[dict[str, tuple[int, ...]], dict[str, float]]:
    """`baseline_choices`, and the baselines in the space that do not fit the memory (each
    with its peak bytes on the fullest device)."""
    if not problem.is_dnn:
        return {}, {}
    dnn = problem.dnn()
    fit, too_big = {}, {}
    for name in applicable(dnn.graph):
        try:
            choices = problem.choices_of(BASELINES[name](dnn.graph, dnn.devices))
        except ConfigError:
            continue  # not in the (capped) config space
        if fits_devices(problem, choices):
            fit[name] = choices
        else:
            too_big[name] = float(memory_peak(problem, choices).max())
    return fit, too_big


def baseline_times(problem: Problem) -> dict[str, BaselineTime]:
    """`baseline_choices`, each simulated."""
    return {
        name: BaselineTime(name, choices, evaluate_objective(problem, choices, "makespan"))
        for name, choices in baseline_choices(problem).items()
    }


def recommend(
    problem: Problem,
    result: SolveResult,
    objective: str = "additive",
    baselines: Mapping[str, BaselineTime] | None = None,
    deadline: Deadline | None = None,
    margin: float = SIMULATOR_ERROR,
) -> SolveResult:
    """`result` unless an expert baseline that fits the memory simulates faster by more than
    `margin` (a fraction: default the simulator's stated error); then that baseline (see the
    module docstring). `objective` is the one `result` was searched under; `baselines` may
    pass `baseline_times(problem)` when the caller has it already (then none is skipped;
    those that do not fit are still never recommended). The simulations stop at `deadline`
    (or Ctrl-C): a baseline whose simulation did not finish is listed under
    "not_simulated_for_time", the most promising ones are simulated first, and an answer
    that could not be simulated in time is returned as it is, with the reason."""
    if result.choices is None or not problem.is_dnn:
        reason = "no answer" if result.choices is None else "a cost-table problem"
        return _with(result, {"switched": False, "reason": f"nothing to simulate: {reason}"})
    at = (deadline or Deadline.never()).at
    if objective == "makespan" and result.objective is not None:
        simulated = result.objective  # simulated by the re-score
    else:
        try:
            simulated = evaluate_objective(problem, result.choices, "makespan", at)
        except OutOfTime:
            why = "no time left to simulate the answer: not compared with the baselines"
            return _with(result, {"switched": False, "reason": why})
    skipped: dict[str, float] = {}
    late: list[str] = []
    fitting, too_big = _baselines(problem)
    if baselines is None:
        times = {}
        eq1 = additive_cost(problem, result.choices)
        ranked = sorted(
            (additive_cost(problem, choices) / eq1 if eq1 > 0 else 1.0, name, choices)
            for name, choices in fitting.items()
        )  # the most promising first
        for ratio, name, choices in ranked:
            if ratio > HOPELESS:
                skipped[name] = ratio
                continue
            try:
                value = evaluate_objective(problem, choices, "makespan", at)
            except OutOfTime:
                late.append(name)
                continue
            times[name] = BaselineTime(name, choices, value)
    else:
        times = {name: b for name, b in baselines.items() if name not in too_big}
    decision: dict[str, Any] = {
        "simulated": simulated,
        "baselines": {name: b.simulated for name, b in times.items()},
        "margin": margin,
    }
    if skipped:
        decision["not_simulated"] = skipped
    if late:
        decision["not_simulated_for_time"] = late
    if too_big:
        decision["not_fitting"] = too_big  # peak bytes on the fullest device
    fastest = min(times.values(), key=lambda b: b.simulated, default=None)
    proven = f"{result.status.value} under the {objective} objective"
    if fastest is None or not fastest.simulated < simulated * (1 - margin):
        why = "no baseline simulates faster"
        if fastest is None:
            why = f"no baseline within {HOPELESS:g}x Eq. 1" if skipped else "no baseline applies"
        elif fastest.simulated < simulated:
            why = (
                f"{fastest.name} simulates {1 - fastest.simulated / simulated:.2%} faster "
                f"({fastest.simulated * 1e3:.4g} against {simulated * 1e3:.4g} ms), within the "
                f"simulator's stated accuracy of {margin:.0%}: the {result.backend} answer "
                f"({proven}) is kept"
            )
        if too_big and fastest is None:
            why += f"; {', '.join(too_big)} would not fit the devices' memory"
        return _with(result, {**decision, "switched": False, "reason": why})
    decision.update(
        switched=True,
        to=fastest.name,
        reason=f"{fastest.name} simulates at {fastest.simulated * 1e3:.4g} ms, "
        f"{1 - fastest.simulated / simulated:.1%} faster (beyond the simulator's stated accuracy "
        f"of {margin:.0%}) than the {result.backend} answer at {simulated * 1e3:.4g} ms, "
        f"which stays under 'searched' ({proven})",
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
    value = fastest.simulated
    if objective != "makespan":
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
