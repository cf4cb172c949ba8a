"""Presolve: the reduced problem has the original's optimum, and its answers map back to valid
answers of the original with the same cost (checked against brute force)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.deadline import Deadline
from planner.errors import ProblemError
from planner.problems.costtable import brute_force, contest_problem, random_problem
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.presolve import presolve
from planner.problems.problem import Problem


def _tiny(n: int, seed: int, forbid: float, memory: bool) -> Problem:
    """A random problem brute force can enumerate, with some dominated strategies: a copy of
    a strategy made no better (higher cost and usage, rows no lower)."""
    p = random_problem(n, 4, seed, edge_prob=0.4, forbid_prob=forbid, memory=memory)
    rng = np.random.default_rng(seed)
    i = int(rng.integers(n))
    if p.sizes[i] >= 4:
        return p
    k = int(rng.integers(p.sizes[i]))
    node_cost = list(p.node_cost)
    node_cost[i] = np.append(p.node_cost[i], p.node_cost[i][k] + rng.integers(0, 3))
    edge_cost = []
    for (u, v), t in zip(p.edges, p.edge_cost, strict=True):
        if u == i:
            t = np.vstack([t, t[k] + rng.integers(0, 2, t.shape[1])])
        if v == i:
            t = np.hstack([t, t[:, [k]] + rng.integers(0, 2, (t.shape[0], 1))])
        edge_cost.append(t)
    usage = None
    if p.usage is not None:
        usage = list(p.usage)
        usage[i] = np.vstack([p.usage[i], p.usage[i][k] + rng.integers(0, 2)])
    return Problem(
        p.name, p.node_names, tuple(node_cost), p.edges, tuple(edge_cost),
        None if usage is None else tuple(usage), p.intervals, p.usage_limit,
    )  # fmt: skip


@pytest.mark.parametrize("memory", [True, False])
def test_the_reduced_problem_keeps_the_optimum(memory: bool) -> None:
    removed = {"forbidden": 0, "memory": 0, "dominated": 0}
    for seed in range(150):
        n = 3 + seed % 6
        forbid = (0.0, 0.1, 0.3, 0.5)[seed % 4]
        p = _tiny(n, seed, forbid, memory)
        choices, best = brute_force(p)
        try:
            r = presolve(p)
        except ProblemError as exc:
            assert choices is None and "no valid answer" in str(exc), (seed, exc)
            continue
        assert r.complete and r.problem.num_nodes == p.num_nodes
        removed = {k: v + r.removed[k] for k, v in removed.items()}
        reduced, reduced_best = brute_force(r.problem)
        if choices is None:
            assert reduced is None, seed
            continue
        assert reduced is not None and math.isclose(reduced_best, best, rel_tol=1e-12), seed
        answer = r.expand(reduced)
        assert math.isclose(additive_cost(p, answer), best, rel_tol=1e-12)
        assert memory_feasible(p, answer)
        assert r.restrict(answer) == tuple(reduced)
    # every rule did something (memory only with a limit)
    assert removed["forbidden"] > 50 and removed["dominated"] > 20
    assert (removed["memory"] > 10) == memory


def test_every_answer_of_the_reduced_problem_maps_back_with_its_cost() -> None:
    p = _tiny(6, 11, 0.3, True)
    r = presolve(p)
    rng = np.random.default_rng(0)
    for _ in range(50):
        ch = [int(rng.integers(s)) for s in r.problem.sizes]
        original = r.expand(ch)
        assert additive_cost(p, original) == additive_cost(r.problem, ch)
        assert memory_feasible(p, original) == memory_feasible(r.problem, ch)


def _pair(node_a: list[float], node_b: list[float], edge: list[list[float]]) -> Problem:
    return Problem(
        "pair", ("a", "b"), (np.array(node_a, dtype=float), np.array(node_b, dtype=float)),
        ((0, 1),), (np.array(edge, dtype=float),),
    )  # fmt: skip


def test_arc_consistency_follows_forbidden_pairs_to_a_fixpoint() -> None:
    inf = math.inf
    # b's strategy 1 costs inf; a's strategy 0 is allowed only with it; so a keeps 1, 2
    p = _pair([1, 5, 6], [0, inf], [[inf, 0], [3, inf], [4, 1]])
    r = presolve(p, dominance=False)
    assert [k.tolist() for k in r.kept] == [[1, 2], [0]]
    assert r.removed == {"forbidden": 2, "memory": 0, "dominated": 0}
    assert r.fixed_nodes == 1 and r.summary()["strategies_after"] == 3
    # with dominance, a's 2 (cost 6, edge 4) loses to 1 (cost 5, edge 3)
    r = presolve(p)
    assert [k.tolist() for k in r.kept] == [[1], [0]] and r.removed["dominated"] == 1
    assert r.expand([0, 0]) == (1, 0) and r.restrict([2, 0]) is None


def test_no_valid_answer_is_one_clear_error() -> None:
    inf = math.inf
    with pytest.raises(ProblemError, match=r"no valid answer: node 'a' has no strategy left"):
        presolve(_pair([1, 2], [0, inf], [[inf, 0], [inf, 0]]))
    with pytest.raises(ProblemError, match=r"node 'b' has no strategy left.*forbidden"):
        presolve(_pair([1, 2], [inf, inf], [[0, 0], [0, 0]]))
    p = random_problem(8, 3, seed=2)
    assert p.usage_limit is not None
    tight = Problem(p.name, p.node_names, p.node_cost, p.edges, p.edge_cost, p.usage,
                    p.intervals, np.array([-1.0]))  # fmt: skip
    with pytest.raises(ProblemError, match="exceeds the limit"):
        presolve(tight)


def test_equal_strategies_keep_the_first_and_never_live_nodes_ignore_usage() -> None:
    p = Problem(
        "eq", ("a", "b"), (np.array([2.0, 2.0, 2.0]), np.array([1.0, 1.0])), ((0, 1),),
        (np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]),),
        (np.array([[3.0], [1.0], [3.0]]), np.array([[5.0], [1.0]])),
        np.array([[0, 2], [1, 1]]), np.array([100.0]),
    )  # fmt: skip
    r = presolve(p)
    # a is live: strategy 1 (usage 1) beats 0 and 2; b is never live: its usage does not
    # count, and its strategy 1 (edge column 0s) beats 0
    assert [k.tolist() for k in r.kept] == [[1], [1]]


def test_a_contest_problem_shrinks_and_an_expired_deadline_stops_early() -> None:
    p = contest_problem(300, seed=3)
    r = presolve(p)
    assert sum(r.problem.sizes) < sum(p.sizes) and r.complete
    s = r.summary()
    assert s["strategies_before"] - s["strategies_after"] == sum(r.removed.values())
    stopped = presolve(p, deadline=Deadline.after(0.0))
    assert not stopped.complete and sum(stopped.problem.sizes) >= sum(r.problem.sizes)
