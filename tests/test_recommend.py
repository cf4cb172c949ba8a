"""planner.recommend: never recommend a strategy the simulator says is slower than a baseline."""

from __future__ import annotations

import dataclasses
import time
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import SolveOptions, SolveResult, Status, get_backend
from backends.base import evaluate_objective
from planner.graph.zoo import model_graph
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.costtable import random_problem
from planner.problems.evaluate import additive_cost, memory_peak
from planner.problems.problem import Problem, build_problem
from planner.recommend import (
    HOPELESS,
    SIMULATOR_ERROR,
    baseline_choices,
    baseline_times,
    is_switched,
    recommend,
)


@cache
def problem(model: str, preset: str) -> Problem:
    return build_problem(model_graph(model), get_preset(preset))


def test_lenet5_on_four_p100s_recommends_data_parallelism_with_no_margin() -> None:
    """elimination's additive optimum simulates slower than data parallelism, so with no
    margin for the simulator's error the recommendation is data parallelism, and the
    optimum is kept with its status."""
    p = problem("lenet5", "p100-1x4")
    optimum = get_backend("elimination").solve(p, SolveOptions())
    dp = p.choices_of(data_parallel(p.dnn().graph, p.dnn().devices))
    simulated_optimum = evaluate_objective(p, optimum.choices, "makespan")  # type: ignore[arg-type]
    simulated_dp = evaluate_objective(p, dp, "makespan")
    assert optimum.status is Status.OPTIMAL and simulated_dp < simulated_optimum

    rec = recommend(p, optimum, margin=0.0)
    assert is_switched(rec)
    assert rec.choices == dp and rec.strategy == p.strategy(dp)
    assert rec.status is Status.FEASIBLE and rec.limit is None  # no longer the optimum
    assert rec.objective == pytest.approx(evaluate_objective(p, dp, "additive"), rel=1e-12)
    assert rec.bound == optimum.bound and rec.gap == pytest.approx(
        rec.objective / optimum.bound - 1
    )
    decision = rec.stats["recommendation"]
    assert decision["to"] == "data_parallel" and "data_parallel simulates at" in decision["reason"]
    assert "stays under 'searched' (OPTIMAL under the additive objective)" in decision["reason"]
    assert decision["simulated"] == pytest.approx(simulated_optimum, rel=1e-12)
    searched = rec.stats["searched"]
    assert searched["choices"] == list(optimum.choices)  # type: ignore[arg-type]
    assert searched["status"] == "OPTIMAL" and searched["objective"] == optimum.objective
    assert searched["additive"] == pytest.approx(optimum.objective, rel=1e-12)
    assert searched["simulated"] == pytest.approx(simulated_optimum, rel=1e-12)
    assert rec.stats["search_seconds"] == optimum.stats["search_seconds"]  # stats kept


def test_an_answer_faster_than_every_baseline_is_kept() -> None:
    p = problem("lenet5", "p100-2x4")
    optimum = get_backend("elimination").solve(p, SolveOptions())
    rec = recommend(p, optimum, "additive", baseline_times(p))
    assert not is_switched(rec)
    assert dataclasses.replace(rec, stats=optimum.stats) == optimum
    decision = rec.stats["recommendation"]
    assert decision["reason"] == "no baseline simulates faster"
    assert decision["simulated"] < min(decision["baselines"].values())


def test_the_makespan_objective_reuses_the_answers_simulated_time() -> None:
    p = problem("lenet5", "p100-1x4")
    result = get_backend("baselines").solve(p, SolveOptions(objective="makespan"))
    rec = recommend(p, result, "makespan", baseline_times(p))
    assert not is_switched(rec)  # the best baseline under the simulator: nothing is faster
    assert rec.stats["recommendation"]["simulated"] == result.objective


def test_cost_table_problems_and_missing_answers_are_left_alone() -> None:
    p = random_problem(6, 3, seed=1)
    result = get_backend("search").solve(p, SolveOptions())
    rec = recommend(p, result)
    assert not is_switched(rec) and rec.choices == result.choices
    assert "cost-table problem" in rec.stats["recommendation"]["reason"]
    none = SolveResult("x", Status.NO_SOLUTION)
    assert recommend(problem("lenet5", "p100-1x4"), none).choices is None


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_the_recommendation_never_simulates_slower_than_a_baseline(data: st.DataObject) -> None:
    """Any answer (random choices, under either objective): what is recommended simulates no
    slower than the answer, and no applicable baseline simulates faster than it by more than
    the simulator's stated error."""
    preset = data.draw(st.sampled_from(["p100-1x2", "p100-1x4", "p100-2x2"]))
    p = problem("lenet5", preset)
    choices = tuple(data.draw(st.integers(0, n - 1)) for n in p.sizes)
    objective = data.draw(st.sampled_from(["additive", "makespan"]))
    value = evaluate_objective(p, choices, objective)
    result = SolveResult("random", Status.FEASIBLE, choices, value, strategy=p.strategy(choices))
    times = baseline_times(p)
    rec = recommend(p, result, objective, times)
    assert rec.choices is not None
    simulated = evaluate_objective(p, rec.choices, "makespan")
    assert simulated <= evaluate_objective(p, choices, "makespan") * (1 + 1e-12)
    assert all(
        simulated * (1 - SIMULATOR_ERROR) <= b.simulated * (1 + 1e-12) for b in times.values()
    )
    assert rec.objective == pytest.approx(evaluate_objective(p, rec.choices, objective), rel=1e-12)
    if is_switched(rec):
        assert rec.choices in [b.choices for b in times.values()]
        assert rec.stats["searched"]["choices"] == list(choices)


def test_hopeless_baselines_are_listed_not_simulated() -> None:
    """lenet5 on 8 GPUs: every baseline costs over HOPELESS times the optimum under Eq. 1;
    none is simulated, each is listed with its ratio, and the decision is the one full
    simulation of every baseline gives."""
    p = problem("lenet5", "p100-2x4")
    result = get_backend("elimination").solve(p, SolveOptions())
    rec = recommend(p, result)
    decision = rec.stats["recommendation"]
    assert decision["baselines"] == {} and decision["reason"] == "no baseline within 10x Eq. 1"
    ratios = decision["not_simulated"]
    assert set(ratios) == set(baseline_times(p)) and min(ratios.values()) > HOPELESS
    for name, ratio in ratios.items():
        choices = baseline_times(p)[name].choices
        assert ratio == pytest.approx(additive_cost(p, choices) / result.objective_value())
    assert rec.choices == recommend(p, result, "additive", baseline_times(p)).choices


def test_a_baseline_within_the_ratio_is_simulated_and_can_win() -> None:
    """lenet5 on 4 GPUs: data parallelism has 3.5 times the optimum's Eq. 1 cost and
    simulates faster; it is simulated, not skipped, and recommended."""
    p = problem("lenet5", "p100-1x4")
    rec = recommend(p, get_backend("elimination").solve(p, SolveOptions()), margin=0.0)
    assert "data_parallel" in rec.stats["recommendation"]["baselines"]
    assert rec.stats["recommendation"].get("to") == "data_parallel"


def test_a_simulation_past_its_deadline_stops_with_out_of_time() -> None:
    from planner.deadline import OutOfTime
    from planner.sim.simulator import Simulator

    p = problem("lenet5", "p100-1x4")
    dp = p.choices_of(data_parallel(p.dnn().graph, p.dnn().devices))
    configs = p.strategy(dp).configs
    assert Simulator(p.dnn().cost_model, configs).makespan > 0
    with pytest.raises(OutOfTime):
        Simulator(p.dnn().cost_model, configs, deadline=time.perf_counter() - 1.0)


def test_no_time_to_simulate_the_answer_keeps_it_and_says_why() -> None:
    from planner.deadline import Deadline

    p = problem("lenet5", "p100-1x4")
    optimum = get_backend("elimination").solve(p, SolveOptions())
    rec = recommend(p, optimum, deadline=Deadline(time.perf_counter() - 1.0))
    assert not is_switched(rec) and rec.choices == optimum.choices
    assert rec.status is Status.OPTIMAL
    assert "no time left to simulate the answer" in rec.stats["recommendation"]["reason"]


def test_baselines_whose_simulation_runs_out_of_time_are_listed_not_compared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lenet5 case that switches to data parallelism keeps the answer when the baselines'
    simulations do not finish in time."""
    import planner.recommend as rec_module
    from planner.deadline import Deadline, OutOfTime

    p = problem("lenet5", "p100-1x4")
    optimum = get_backend("elimination").solve(p, SolveOptions())
    real = rec_module.evaluate_objective

    def late_for_baselines(problem_: Problem, choices: tuple[int, ...], objective: str,
                           deadline: float = float("inf")) -> float:  # fmt: skip
        if objective == "makespan" and tuple(choices) != optimum.choices:
            raise OutOfTime
        return real(problem_, choices, objective, deadline)

    monkeypatch.setattr(rec_module, "evaluate_objective", late_for_baselines)
    out = recommend(p, optimum, deadline=Deadline.after(60.0), margin=0.0)
    decision = out.stats["recommendation"]
    assert not is_switched(out) and "data_parallel" in decision["not_simulated_for_time"]
    assert decision["baselines"] == {}


def test_a_baseline_faster_within_the_simulators_error_keeps_the_proven_optimum() -> None:
    """lenet5 on 4 GPUs: data parallelism simulates a few percent faster than the proven
    optimum of Eq. 1, less than the simulator's stated error: the optimum stays, OPTIMAL,
    and the decision says why."""
    p = problem("lenet5", "p100-1x4")
    optimum = get_backend("elimination").solve(p, SolveOptions())
    rec = recommend(p, optimum)
    decision = rec.stats["recommendation"]
    assert 0 < 1 - decision["baselines"]["data_parallel"] / decision["simulated"] < SIMULATOR_ERROR
    assert not is_switched(rec) and rec.status is Status.OPTIMAL and rec.choices == optimum.choices
    assert decision["margin"] == SIMULATOR_ERROR
    assert "within the simulator's stated accuracy of 10%" in decision["reason"]
    assert "(OPTIMAL under the additive objective) is kept" in decision["reason"]


def _with_memory(preset: str, memory: float) -> DeviceGraph:
    data = get_preset(preset).to_json()
    for device in data["devices"]:
        device["memory"] = int(memory)
    return DeviceGraph.from_json(data)


def test_a_baseline_that_does_not_fit_the_devices_memory_is_never_recommended() -> None:
    """The problem has no memory limit, but data parallelism needs more than each device
    has: it is not recommended, however fast it simulates, and the decision lists it."""
    p = problem("lenet5", "p100-1x4")
    dp = p.choices_of(data_parallel(p.dnn().graph, p.dnn().devices))
    need = float(memory_peak(p, dp).max())
    small = build_problem(model_graph("lenet5"), _with_memory("p100-1x4", need * 0.99))
    assert small.usage_limit is None
    optimum = get_backend("elimination").solve(small, SolveOptions())
    rec = recommend(small, optimum, margin=0.0)  # with room it switches (test above)
    assert not is_switched(rec) and rec.choices == optimum.choices
    decision = rec.stats["recommendation"]
    assert decision["not_fitting"]["data_parallel"] == pytest.approx(need)
    assert "data_parallel" not in decision["baselines"]
    assert "data_parallel" not in baseline_choices(small)
    passed = recommend(small, optimum, "additive", baseline_times(p), margin=0.0)  # from elsewhere
    assert not is_switched(passed)
