"""The mcmc backend: conformance, determinism, and quality against exact optima."""

from __future__ import annotations

import math

import pytest

from backends import SolveOptions, Status, get_backend
from backends.testing import BackendConformance, tiny_cnn
from planner.hardware.presets import get_preset
from planner.problems.costtable import brute_force, random_problem
from planner.problems.problem import build_problem


class TestMcmcConformance(BackendConformance):
    backend_name = "mcmc"
    extra = {"iterations": 300}  # noqa: RUF012


def _tiny_problem():
    return build_problem(tiny_cnn(), get_preset("p100-1x2"), max_configs=6)


def test_makespan_answers_are_simulated_and_deterministic() -> None:
    p = _tiny_problem()
    opts = SolveOptions(objective="makespan", time_limit=60, seed=5, extra={"iterations": 200})
    a = get_backend("mcmc").solve(p, opts)
    b = get_backend("mcmc").solve(p, opts)
    assert a.status is Status.FEASIBLE and a.choices == b.choices
    dp = get_backend("baselines").solve(p, SolveOptions(objective="makespan"))
    assert a.objective <= dp.objective * (1 + 1e-12)
    assert [t for t, _ in a.stats["trace"]] == sorted(t for t, _ in a.stats["trace"])


def test_additive_search_finds_small_optima() -> None:
    hits = 0
    for seed in range(10):
        p = random_problem(7, 4, seed=seed, memory=False)
        _, best = brute_force(p)
        r = get_backend("mcmc").solve(p, SolveOptions(seed=seed, extra={"iterations": 2000}))
        assert r.objective >= best * (1 - 1e-9)
        hits += math.isclose(r.objective, best, rel_tol=1e-9)
    assert hits >= 8


def test_memory_limit_is_respected() -> None:
    for seed in range(5):
        p = random_problem(8, 4, seed=seed, memory=True)
        r = get_backend("mcmc").solve(p, SolveOptions(seed=seed, extra={"iterations": 500}))
        if r.choices is not None:
            from planner.problems.evaluate import memory_feasible

            assert memory_feasible(p, r.choices)


def test_bad_options_are_errors() -> None:
    from backends import BackendError

    with pytest.raises(BackendError, match="inits"):
        get_backend("mcmc").solve(
            random_problem(4, 3, seed=0), SolveOptions(extra={"inits": ["x"]})
        )


def test_polish_leaves_no_improving_single_node_change() -> None:
    from backends.base import evaluate_objective

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
