"""The neighbourhood search (`backends.mathprog.lns`): its sub-problems are the problem with the other
nodes fixed, it proves the optimum when a neighbourhood is the whole problem, and `cpsat`
(one worker) and `portfolio` use it; the restricted rounds keep a later round's better answer."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import BackendError, SolveOptions, Status, get_backend
from backends.base import Channel
from backends.heuristics.feasible import feasible_choices
from backends.mathprog.cpsat import solve_sub
from backends.mathprog.lns import lns_enabled, neighbourhood_search, sub_selection
from backends.model.selection import selection
from planner.problems.costtable import brute_force, contest_problem, random_problem
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem
from tests.test_anytime import tight_problems


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_problems(), st.integers(0, 2**31 - 1))
def test_a_sub_problem_is_the_problem_with_the_other_nodes_fixed(p: Problem, seed: int) -> None:
    """For every way of setting the free nodes: the sub-problem's cost differs from the
    problem's by one constant, and its memory rule (and forbidden pairs) agree."""
    start = feasible_choices(p)
    if start is None:
        return
    sel = selection(p)
    pos = np.array(sel.positions(start))
    rng = np.random.default_rng(seed)
    free = np.sort(rng.choice(sel.num_nodes, size=rng.integers(1, sel.num_nodes + 1),
                              replace=False))  # fmt: skip
    sub, keep = sub_selection(sel, pos, free)
    assert sub.infeasible is None and sub.num_nodes == len(free)
    offset = None
    for combo in itertools.product(*(range(len(sel.allowed[i])) for i in free)):
        full = pos.copy()
        full[free] = combo
        choices = sel.choices(full.tolist())
        cost = additive_cost(p, choices)
        valid = math.isfinite(cost) and memory_feasible(p, choices)
        inside = all(int(c) in kp for c, kp in zip(combo, keep, strict=True))
        if not inside:  # a dropped choice meets a forbidden pair with a fixed node
            assert not math.isfinite(cost)
            continue
        sub_pos = [int(np.searchsorted(kp, c)) for c, kp in zip(combo, keep, strict=True)]
        sub_cost = sub.position_cost(sub_pos)
        assert math.isfinite(sub_cost) == math.isfinite(cost)
        if not math.isfinite(cost):
            continue
        assert sub.choices(sub_pos) == tuple(choices[i] for i in free)
        assert sub.fits(sub_pos) == valid
        if offset is None:
            offset = cost - sub_cost
        assert cost - sub_cost == pytest.approx(offset, rel=1e-9, abs=1e-6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_problems())
def test_a_whole_neighbourhood_proves_the_brute_force_optimum(p: Problem) -> None:
    start = feasible_choices(p)
    best, value = brute_force(p)
    if start is None:
        assert best is None
        return
    sel = selection(p)
    out = neighbourhood_search(p, sel, start, time.perf_counter() + 20.0, solve_sub=solve_sub)
    assert out.proven, out.stats
    assert out.value == pytest.approx(value, rel=1e-9, abs=1e-9)
    assert additive_cost(p, out.choices) == pytest.approx(value, rel=1e-9, abs=1e-9)
    assert memory_feasible(p, out.choices)


@pytest.mark.parametrize("limit", [6.0, pytest.param(10.0, marks=pytest.mark.slow)])
def test_large_problems_improve_round_by_round_and_stay_valid(limit: float) -> None:
    """6 s by default (a round improved in each of 6 runs side by side on 2 cores, not always
    at 4 s; smaller problems improved less often, and at 150 nodes one round proves the
    optimum), 10 s under slow."""
    p = contest_problem(400, seed=2)
    sel = selection(p)
    start = feasible_choices(p)
    assert start is not None
    seen: list[float] = []
    out = neighbourhood_search(
        p, sel, start, time.perf_counter() + limit, seed=3,
        on_incumbent=lambda ch, who: seen.append(additive_cost(p, ch)), solve_sub=solve_sub,
    )  # fmt: skip
    assert out.stats["rounds"] > 1 and out.stats["improved"] >= 1
    assert out.value < additive_cost(p, start)
    assert seen == sorted(seen, reverse=True) and seen[-1] == pytest.approx(out.value)
    assert memory_feasible(p, out.choices) and not out.proven


def test_an_incoming_better_answer_is_taken() -> None:
    p = contest_problem(200, seed=5)
    sel = selection(p)
    start = feasible_choices(p)
    good = get_backend("ilp").solve(p, SolveOptions(time_limit=10.0)).choices
    assert start is not None and good is not None
    handed = [good]
    out = neighbourhood_search(p, sel, start, time.perf_counter() + 1.0, solve_sub=solve_sub,
                               incoming=lambda: handed.pop() if handed else None)  # fmt: skip
    assert out.stats["taken"] == 1
    assert out.value <= additive_cost(p, good) * (1 + 1e-12)


@pytest.mark.parametrize("limit", [3.0, pytest.param(6.0, marks=pytest.mark.slow)])
def test_cpsat_with_one_worker_ends_with_the_neighbourhoods(limit: float) -> None:
    p = contest_problem(300, seed=1)
    seen: list[float] = []
    report = Channel(on_incumbent=lambda ch, who: seen.append(additive_cost(p, ch)))
    opts = SolveOptions(time_limit=limit, threads=1, channel=report)
    r = get_backend("cpsat").solve(p, opts)
    assert r.status in (Status.FEASIBLE, Status.OPTIMAL) and r.objective is not None
    assert memory_feasible(p, r.choices)
    assert r.stats["lns"]["rounds"] >= 1
    assert r.objective == pytest.approx(min(seen))  # the best answer reported is the answer
    off = get_backend("cpsat").solve(
        p, SolveOptions(time_limit=1.0, threads=1, extra={"lns": False})
    )
    assert "lns" not in off.stats


def test_the_lns_setting_is_checked() -> None:
    assert lns_enabled("auto", threads=1) and not lns_enabled("auto", threads=2)
    assert lns_enabled(True, threads=2) and not lns_enabled(False, threads=1)
    p = random_problem(5, 3, seed=1)
    with pytest.raises(BackendError, match="lns"):
        get_backend("cpsat").solve(p, SolveOptions(time_limit=1.0, extra={"lns": "yes"}))


@pytest.mark.parametrize("nodes", [200, pytest.param(300, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["ilp", "cpsat"])
def test_a_later_restricted_round_that_finds_better_is_kept(name: str, nodes: int) -> None:
    """Every answer a round reports is compared with the best: the answer returned is the
    best one any round reported (rounds used to be compared without their objectives, and
    every round after the first was thrown away). By default 200 nodes (the second round
    finds better there too), 300 under slow."""
    p = contest_problem(nodes, seed=1)
    seen: list[float] = []
    extra = {"terms_per_second": 3000.0, **({"lns": False} if name == "cpsat" else {})}
    report = Channel(on_incumbent=lambda ch, who: seen.append(additive_cost(p, ch)))
    opts = SolveOptions(time_limit=8.0, threads=1, extra=extra, channel=report)
    r = get_backend(name).solve(p, opts)
    assert r.stats["restricted_rounds"] >= 2 and r.objective is not None
    assert r.objective <= min(seen) * (1 + 1e-12)


@pytest.mark.parametrize("limit", [5.0, pytest.param(8.0, marks=pytest.mark.slow)])
def test_portfolio_hands_better_answers_to_the_cpsat_neighbourhoods(limit: float) -> None:
    # the generator's first shape (no follow edges, saved activations, parallel, reversed or
    # never-live nodes): CP-SAT's whole model ends in time there and its neighbourhoods run
    p = contest_problem(300, seed=2, follow=0, saved=0, parallel=0, reverse=0, never_live=0)
    r = get_backend("portfolio").solve(p, SolveOptions(time_limit=limit))
    assert r.has_solution and memory_feasible(p, r.choices)
    runs = r.stats["members"]["cpsat"]
    assert len(runs) == 1, "with the neighbourhood search CP-SAT is never restarted"
    assert runs[0]["lns"]["rounds"] >= 1
