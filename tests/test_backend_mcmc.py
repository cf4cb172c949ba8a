"""The mcmc backend: conformance, determinism, starts, budget, options, progress and quality."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from backends import BackendError, Limit, SolveOptions, Status, get_backend
from backends.base import evaluate_objective, request_stop
from backends.testing import BackendConformance, tiny_cnn
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.baselines import BASELINES, applicable
from planner.problems.costtable import brute_force, random_problem
from planner.problems.problem import Problem, build_problem


class TestMcmcConformance(BackendConformance):
    backend_name = "mcmc"
    extra = {"iterations": 300}  # noqa: RUF012
    given_settings = {  # noqa: RUF012
        "iterations": 300,
        "inits": ("data_parallel", "random"),
        "temperature": (0.01, 0.05),
        "beta": 2.0,
        "mix": {"jump": 1.0, "eq1": 0.5},
        "penalty": (2.0, 20.0),
        "simulation": "full",
        "polish": True,
    }


def _tiny_problem() -> Problem:
    return build_problem(tiny_cnn(), get_preset("p100-1x2"), max_configs=6)


def _reference_makespan(problem: Problem) -> float:
    """The best of elimination's strategy re-simulated and the expert strategies."""
    dnn = problem.dnn()
    elim = get_backend("elimination").solve(problem, SolveOptions(time_limit=60)).choices
    assert elim is not None
    candidates = [elim] + [
        problem.choices_of(BASELINES[b](dnn.graph, dnn.devices)) for b in applicable(dnn.graph)
    ]
    return min(evaluate_objective(problem, c, "makespan") for c in candidates)


def test_makespan_answers_are_simulated_and_deterministic() -> None:
    p = _tiny_problem()
    opts = SolveOptions(objective="makespan", time_limit=60, seed=5, extra={"iterations": 200})
    a = get_backend("mcmc").solve(p, opts)
    b = get_backend("mcmc").solve(p, opts)
    assert a.status is Status.FEASIBLE and a.choices == b.choices
    dp = get_backend("baselines").solve(p, SolveOptions(objective="makespan"))
    assert a.objective <= dp.objective * (1 + 1e-12)
    times = [t for t, _ in a.stats["trace"]["incumbent"]]
    assert times == sorted(times)


def test_never_worse_than_the_best_start_alexnet() -> None:
    # Fails on the old backend: its first chain (from data parallelism, 0.109 s) used the
    # whole iteration budget, far from the Eq. 1 optimum re-simulated (0.006 s).
    p = build_problem(model_graph("alexnet"), get_preset("p100-4x4"))
    opts = SolveOptions(objective="makespan", time_limit=120, extra={"iterations": 10})
    r = get_backend("mcmc").solve(p, opts)
    assert r.objective <= _reference_makespan(p) * (1 + 1e-12)


@pytest.mark.slow
def test_never_worse_than_the_best_start_inception_v3_on_16_gpus() -> None:
    # The case: the old backend ended at 108.35 ms, the Eq. 1 optimum simulates at 70.66.
    p = build_problem(model_graph("inception_v3"), get_preset("p100-4x4"))
    opts = SolveOptions(objective="makespan", time_limit=300, extra={"iterations": 20})
    r = get_backend("mcmc").solve(p, opts)
    assert r.objective <= _reference_makespan(p) * (1 + 1e-12)


def test_the_best_is_kept_however_hot_the_chain() -> None:
    p = _tiny_problem()
    hot = {"iterations": 100, "temperature": 100.0, "cycle": 1000, "screen": 0}
    r = get_backend("mcmc").solve(p, SolveOptions(objective="makespan", extra=hot))
    starts = [v for v in r.stats["starts"].values() if v is not None]
    assert r.objective <= min(starts) * (1 + 1e-12)
    assert r.objective == pytest.approx(r.stats["trace"]["incumbent"][-1][1], rel=1e-12)
    assert r.stats["accepted"] > 50  # the chain did wander off


def test_default_runs_to_the_time_limit() -> None:
    # The old backend stopped on its iteration budget (1,000 per chain) after a few ms here.
    p = random_problem(7, 4, seed=1, memory=False)
    r = get_backend("mcmc").solve(p, SolveOptions(time_limit=0.5))
    assert r.status is Status.FEASIBLE and r.limit is Limit.TIME


def test_an_iteration_cap_is_opt_in() -> None:
    p = random_problem(7, 4, seed=1, memory=False)
    r = get_backend("mcmc").solve(p, SolveOptions(extra={"iterations": 25}))
    assert r.limit is Limit.ITERATIONS and r.stats["proposals"] == 25


def test_additive_search_finds_small_optima() -> None:
    chain_only = ["data_parallel", "random"]  # no elimination start: it would be the optimum
    hits = 0
    for seed in range(10):
        p = random_problem(7, 4, seed=seed, memory=False)
        _, best = brute_force(p)
        extra = {"iterations": 2000, "inits": chain_only}
        r = get_backend("mcmc").solve(p, SolveOptions(seed=seed, extra=extra))
        assert r.objective >= best * (1 - 1e-9)
        hits += math.isclose(r.objective, best, rel_tol=1e-9)
    assert hits >= 9


def test_a_stop_request_returns_the_best_so_far() -> None:
    p = _tiny_problem()
    timer = threading.Timer(0.5, request_stop)
    timer.start()
    r = get_backend("mcmc").solve(p, SolveOptions(objective="makespan", time_limit=120))
    timer.cancel()
    assert r.limit is Limit.INTERRUPTED and r.status is Status.FEASIBLE
    assert r.objective <= min(v for v in r.stats["starts"].values() if v is not None)


def test_progress_lines(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="backends.mcmc"):
        get_backend("mcmc").solve(_tiny_problem(), SolveOptions(extra={"iterations": 50}))
    last = caplog.records[-1].getMessage()
    for word in ("50 proposals", "best", "current", "beta", "acceptance"):
        assert word in last


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"inits": ["x"]}, "inits"),
        ({"iteration": 5}, "no setting 'iteration'"),
        ({"temperature": [0.1, 0]}, "temperature"),
        ({"mix": {"teleport": 1.0}}, "mix"),
        ({"mix": {"repair": 1.0}}, "mix"),
        ({"mix": {"jump": 0.0}}, "positive weight"),
        ({"simulation": "fast"}, "simulation"),
        ({"penalty": "high"}, "penalty"),
        ({"iterations": 2.5}, "iterations"),
        ({"polish": 1}, "polish"),
    ],
)
def test_bad_options_are_errors(extra: dict, match: str) -> None:
    with pytest.raises(BackendError, match=match):
        get_backend("mcmc").solve(random_problem(4, 3, seed=0), SolveOptions(extra=extra))


def test_polish_leaves_no_improving_single_node_change() -> None:
    p = _tiny_problem()
    opts = SolveOptions(
        objective="makespan", time_limit=60, extra={"iterations": 20, "polish": True}
    )
    r = get_backend("mcmc").solve(p, opts)
    assert r.stats["locally_optimal"] is True
    for i, n in enumerate(p.sizes):
        for c in range(n):
            moved = list(r.choices)
            moved[i] = c
            assert evaluate_objective(p, moved, "makespan") >= r.objective * (1 - 1e-9)


def test_full_and_delta_simulation_search_alike() -> None:
    p = _tiny_problem()
    out = []
    for simulation in ("full", "delta"):
        extra = {"iterations": 60, "simulation": simulation}
        out.append(get_backend("mcmc").solve(p, SolveOptions(objective="makespan", extra=extra)))
    assert out[0].choices == out[1].choices
    assert out[0].stats["accepted"] == out[1].stats["accepted"]
