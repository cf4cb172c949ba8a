"""The exact backends: conformance, and agreement with brute force on random problems."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import BackendError, SolveOptions, Status, get_backend
from backends.elimination import min_plus
from backends.testing import BackendConformance
from planner.problems.costtable import brute_force, random_problem
from planner.problems.evaluate import additive_cost
from planner.problems.problem import Problem


class TestEliminationConformance(BackendConformance):
    backend_name = "elimination"


class TestSearchConformance(BackendConformance):
    backend_name = "search"


class TestAstarConformance(BackendConformance):
    backend_name = "search"

    extra = {"mode": "astar"}  # noqa: RUF012


def _no_memory(p: Problem) -> Problem:
    return dataclasses.replace(p, usage_limit=None)


def _solve(name: str, p: Problem, **extra: str) -> object:
    return get_backend(name).solve(p, SolveOptions(time_limit=30.0, extra=extra))


def test_min_plus_matches_the_definition() -> None:
    rng = np.random.default_rng(0)
    a, mid, b = rng.random((5, 7)), rng.random(7), rng.random((7, 3))
    expected = np.array(
        [[min(a[i, j] + mid[j] + b[j, k] for j in range(7)) for k in range(3)] for i in range(5)]
    )
    assert np.allclose(min_plus(a, mid, b), expected)


def test_elimination_refuses_memory() -> None:
    p = random_problem(6, 3, seed=0, memory=True)
    with pytest.raises(BackendError, match="memory"):
        get_backend("elimination").solve(p)


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    n = draw(st.integers(1, 9))
    k = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    p = random_problem(n, k, seed=seed, edge_prob=draw(st.sampled_from([0.1, 0.4, 0.8])))
    return p


def _check_agreement(p: Problem) -> None:
    best, value = brute_force(_no_memory(p))
    modes = ({}, {"mode": "astar"}, {"mode": "plain"})
    for name, extra in [("elimination", {}), *(("search", m) for m in modes)]:
        r = _solve(name, _no_memory(p), **extra)
        if best is None:
            assert r.status is Status.INFEASIBLE, (name, extra)
            continue
        assert r.status is Status.OPTIMAL, (name, extra)
        assert math.isclose(r.objective, value, rel_tol=1e-9, abs_tol=1e-9), (name, extra)
        assert math.isclose(additive_cost(p, r.choices), r.objective, rel_tol=1e-12)
    if p.usage_limit is not None:
        mem_best, mem_value = brute_force(p)
        r = _solve("search", p)
        if mem_best is None:
            assert r.status is Status.INFEASIBLE
        else:
            assert r.status is Status.OPTIMAL
            assert math.isclose(r.objective, mem_value, rel_tol=1e-9, abs_tol=1e-9)
    baseline = _solve("baselines", _no_memory(p))
    if baseline.choices is not None and best is not None:
        assert baseline.objective >= value * (1 - 1e-9)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_exact_backends_agree_with_brute_force(p: Problem) -> None:
    _check_agreement(p)


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_exact_backends_agree_with_brute_force_many(p: Problem) -> None:
    _check_agreement(p)


def _brute_force_makespan(p: Problem) -> float:
    import itertools

    from backends.base import evaluate_objective

    return min(
        evaluate_objective(p, choices, "makespan")
        for choices in itertools.product(*(range(n) for n in p.sizes))
    )


@pytest.mark.parametrize("preset, cap", [("p100-1x2", 3), ("p100-2x2", 2)])
def test_search_proves_the_makespan_optimum_of_small_graphs(preset: str, cap: int) -> None:
    from backends.testing import tiny_cnn
    from planner.hardware.presets import get_preset
    from planner.problems.problem import build_problem

    p = build_problem(tiny_cnn(), get_preset(preset), max_configs=cap)
    best = _brute_force_makespan(p)
    r = get_backend("search").solve(p, SolveOptions(objective="makespan", time_limit=60))
    assert r.status is Status.OPTIMAL
    assert math.isclose(r.objective, best, rel_tol=1e-12)
    m = get_backend("mcmc").solve(
        p, SolveOptions(objective="makespan", time_limit=60, extra={"iterations": 300})
    )
    assert m.objective >= best * (1 - 1e-12)


def test_cost_table_files_go_through_the_exact_backends(tmp_path) -> None:
    from planner.problems.costtable import load_problem, save_problem

    for seed in range(5):
        path = tmp_path / f"p{seed}.json"
        save_problem(_no_memory(random_problem(8, 4, seed=seed)), path)
        p = load_problem(path)
        _, value = brute_force(p)
        for name in ("elimination", "search"):
            r = _solve(name, p)
            assert r.status is Status.OPTIMAL
            assert math.isclose(r.objective, value, rel_tol=1e-9)
