"""The exact backends: conformance, and agreement with brute force on random problems."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import BackendError, Limit, SolveOptions, Status, get_backend
from backends.exact.minplus import min_plus, min_plus_dense
from backends.testing import BackendConformance
from planner.problems.costtable import brute_force, random_problem
from planner.problems.evaluate import additive_cost
from planner.problems.problem import Problem


class TestEliminationConformance(BackendConformance):
    backend_name = "elimination"


class TestSearchConformance(BackendConformance):
    backend_name = "search"
    given_settings = {"mode": "plain"}  # noqa: RUF012


class TestAstarConformance(BackendConformance):
    backend_name = "search"

    extra = {"mode": "astar"}  # noqa: RUF012


def _no_memory(p: Problem) -> Problem:
    return dataclasses.replace(p, usage_limit=None)


def _solve(name: str, p: Problem, **extra: str) -> object:
    # gap tolerance 0: compared with brute force to 1e-9
    return get_backend(name).solve(p, SolveOptions(time_limit=30.0, extra=extra, gap_tolerance=0.0))


def test_min_plus_matches_the_definition() -> None:
    rng = np.random.default_rng(0)
    a, mid, b = rng.random((5, 7)), rng.random(7), rng.random((7, 3))
    expected = np.array(
        [[min(a[i, j] + mid[j] + b[j, k] for j in range(7)) for k in range(3)] for i in range(5)]
    )
    assert np.allclose(min_plus(a, mid, b), expected)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 140), st.integers(1, 140), st.integers(1, 300)),
    seed=st.integers(0, 2**31 - 1),
    levels=st.sampled_from([3, 50, 10**6]),
)
def test_min_plus_is_the_dense_product_bit_for_bit(
    shape: tuple[int, int, int], seed: int, levels: int
) -> None:
    """Early termination over bounded j changes no value, ties and forbidden (inf) entries
    included (few cost levels make many ties)."""
    n, J, K = shape
    rng = np.random.default_rng(seed)
    a = rng.integers(0, levels, (n, J)).astype(float)
    mid = rng.integers(0, levels, J) * 10.0 ** rng.uniform(0, 3, J)
    b = rng.integers(0, levels, (J, K)).astype(float)
    a[rng.random((n, J)) < 0.05] = np.inf
    b[rng.random((J, K)) < 0.05] = np.inf
    assert np.array_equal(min_plus(a, mid, b), min_plus_dense(a, mid, b))


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


@st.composite
def shared_problems(draw: st.DrawFn) -> Problem:
    """Repeated blocks whose nodes and edges share one array per position, as a Problem
    built from a DNN shares identical ops' and edges' tables: some arrays also serve edges
    in the other direction (transposed), and blocks are chained with residual edges."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    size = draw(st.integers(1, 4))
    per_block = draw(st.integers(1, 3))
    blocks = draw(st.integers(1, max(1, 9 // per_block)))
    n = per_block * blocks

    def table(shape: tuple[int, ...]) -> np.ndarray:
        t = np.floor(rng.random(shape) * 10 ** rng.uniform(0.5, 3))
        t[rng.random(shape) < 0.08] = np.inf
        t.flat[0] = min(t.flat[0], 1.0)  # never every choice forbidden
        t.setflags(write=False)
        return t

    costs = [table((size,)) for _ in range(per_block)]
    pool = [table((size, size)) for _ in range(draw(st.integers(1, 3)))]
    inner = [(u, v) for v in range(per_block) for u in range(v) if rng.random() < 0.7]
    links = [(per_block - 1, 0)] + ([(0, 0)] if draw(st.booleans()) else [])
    edges, edge_cost = [], []
    for b in range(blocks):
        base = b * per_block
        for u, v in inner:
            edges.append((base + u, base + v))
            edge_cost.append(pool[(u + v) % len(pool)])
        if b + 1 < blocks:
            for u, v in links:
                edges.append((base + u, base + per_block + v))
                edge_cost.append(pool[-1])
    node_cost = tuple(costs[i % per_block] for i in range(n))
    return Problem("shared", tuple(map(str, range(n))), node_cost, tuple(edges), tuple(edge_cost))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_problems())
def test_exact_backends_agree_on_problems_with_shared_tables(p: Problem) -> None:
    _check_agreement(p)


def test_repeated_blocks_cost_one_elimination_each() -> None:
    """A chain of 40 identical residual blocks: the memo reuses the blocks' eliminations
    (same input arrays), and the answer is the one without sharing."""
    rng = np.random.default_rng(1)
    C = 30
    cost = [np.floor(rng.random(C) * 1000) for _ in range(3)]
    tables = [np.floor(rng.random((C, C)) * 100) for _ in range(4)]
    edges, edge_cost = [], []
    for b in range(40):
        x, y, z = 3 * b, 3 * b + 1, 3 * b + 2
        edges += [(x, y), (y, z)]
        edge_cost += [tables[0], tables[1]]
        if b < 39:
            edges += [(z, x + 3), (x, x + 3)]  # next block, and a residual edge
            edge_cost += [tables[2], tables[3]]
    names = tuple(map(str, range(120)))
    shared = Problem(
        "blocks", names, tuple(cost[i % 3] for i in range(120)), tuple(edges), tuple(edge_cost)
    )
    copied = Problem(
        "blocks",
        names,
        tuple(c.copy() for c in shared.node_cost),
        tuple(edges),
        tuple(t.copy() for t in edge_cost),
    )
    a = _solve("elimination", shared)
    b = _solve("elimination", copied)
    assert a.status is b.status is Status.OPTIMAL
    assert a.objective == b.objective and a.choices == b.choices
    assert b.stats["reused_eliminations"] == 0
    assert a.stats["reused_eliminations"] > 0.8 * a.stats["node_eliminations"]


def _big_problem(nodes: int, configs: int, seed: int = 0) -> Problem:
    """A long chain with skip edges and many configs: seconds of elimination, far more for
    search to prove."""
    rng = np.random.default_rng(seed)
    node_cost = tuple(np.floor(rng.random(configs) * 1e4) for _ in range(nodes))
    edges = [(i, i + 1) for i in range(nodes - 1)] + [(i, i + 2) for i in range(0, nodes - 2, 3)]
    edge_cost = tuple(np.floor(rng.random((configs, configs)) * 1e3) for _ in edges)
    return Problem("big", tuple(map(str, range(nodes))), node_cost, tuple(edges), edge_cost)


@pytest.mark.parametrize(
    "backend, extra", [("elimination", {}), ("search", {}), ("search", {"mode": "astar"})]
)
def test_a_short_time_limit_returns_an_answer_with_a_bound(backend: str, extra: dict) -> None:
    """Far too little time: the best answer so far (a greedy dive at least), FEASIBLE with
    limit TIME and a lower bound, not a hang or nothing."""
    p = _big_problem(300, 200)
    r = get_backend(backend).solve(p, SolveOptions(time_limit=0.05, extra=extra))
    assert r.status is Status.FEASIBLE and r.limit is Limit.TIME
    assert r.objective is not None and r.bound is not None
    assert r.bound <= r.objective
    if backend == "elimination":
        assert not r.stats["eliminations_finished"]


@pytest.mark.parametrize(
    "backend, words", [("elimination", "eliminated"), ("search", "best so far")]
)
def test_long_searches_log_progress(
    backend: str, words: str, caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    import functools
    import importlib
    import logging

    from backends.base import ProgressLog

    module = importlib.import_module(f"backends.exact.{backend}")
    monkeypatch.setattr(module, "ProgressLog", functools.partial(ProgressLog, every=0.0))
    with caplog.at_level(logging.INFO, logger=f"backends.{backend}"):
        get_backend(backend).solve(_big_problem(40, 8), SolveOptions(time_limit=0.5))
    assert any(words in r.getMessage() for r in caplog.records)


def _brute_force_makespan(p: Problem) -> float:
    import itertools

    from backends.base import evaluate_objective

    return min(
        evaluate_objective(p, choices, "makespan")
        for choices in itertools.product(*(range(n) for n in p.sizes))
    )


@pytest.mark.parametrize(
    "preset, cap",
    [
        ("p100-1x2", 2),
        ("p100-2x2", 2),
        pytest.param("p100-1x2", 3, marks=pytest.mark.slow),  # 3^7 simulations to brute-force
    ],
)
def test_search_proves_the_makespan_optimum_of_small_graphs(preset: str, cap: int) -> None:
    from backends.testing import tiny_cnn
    from planner.hardware.presets import get_preset
    from planner.problems.problem import build_problem

    p = build_problem(tiny_cnn(), get_preset(preset), max_configs=cap)
    best = _brute_force_makespan(p)
    r = get_backend("search").solve(
        p, SolveOptions(objective="makespan", time_limit=60, gap_tolerance=0.0)
    )
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
