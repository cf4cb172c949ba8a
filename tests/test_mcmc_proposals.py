"""mcmc proposals: structured neighbours, groups, repairs, and the Eq. 1 bookkeeping."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from backends.mcmc.proposals import DNN_MIX, KINDS, Proposer
from backends.mcmc.state import AdditiveCost, ChainState
from backends.testing import tiny_cnn
from planner.hardware.presets import get_preset
from planner.problems.costtable import random_problem
from planner.problems.evaluate import additive_cost
from planner.problems.problem import Problem, build_problem


@pytest.fixture(scope="module")
def problem() -> Problem:
    return build_problem(tiny_cnn(), get_preset("p100-2x2"))


def _cfg(p: Problem, i: int, c: int):
    return p.dnn().space[p.ops_of_nodes[i][0]].configs[c]


def test_degree_and_move_neighbours_are_one_step_away(problem: Problem) -> None:
    proposer = Proposer(problem, DNN_MIX, np.random.default_rng(0))
    for i in range(problem.num_nodes):
        ops = proposer._neighbours(i)
        for c in range(problem.sizes[i]):
            here = _cfg(problem, i, c)
            for k in ops.moves(c):
                there = _cfg(problem, i, int(k))
                assert there.grid == here.grid and there.devices != here.devices
            for k in ops.degrees(c):
                there = _cfg(problem, i, int(k))
                # task grids, with the contraction degree (1 when not split) last
                a, b = (*here.degrees, here.reduce), (*there.degrees, there.reduce)
                changed = [x != y for x, y in zip(a, b, strict=True)]
                assert sum(changed) in (1, 2)
                if sum(changed) == 2:  # a factor moved between two dimensions
                    assert math.prod(a) == math.prod(b)
                same_split = [
                    _cfg(problem, i, j)
                    for j in range(problem.sizes[i])
                    if _cfg(problem, i, j).grid == there.grid
                ]
                best = max(len(set(here.devices) & set(s.devices)) for s in same_split)
                assert len(set(here.devices) & set(there.devices)) == best


def test_proposals_change_something_and_stay_in_range(problem: Problem) -> None:
    rng = np.random.default_rng(1)
    choices = [int(rng.integers(n)) for n in problem.sizes]
    state = ChainState(problem, choices, "additive")
    proposer = Proposer(problem, DNN_MIX, rng)
    seen = set()
    for _ in range(300):
        out = proposer.propose(state, repair=0.0)
        assert out is not None
        kind, changes = out
        seen.add(kind)
        assert kind in KINDS and changes
        assert len({i for i, _ in changes}) == len(changes)
        for i, c in changes:
            assert 0 <= c < problem.sizes[i] and c != state.choices[i]
        state.move(changes)
    assert seen == set(DNN_MIX)


def test_group_changes_move_nodes_that_shared_the_config(problem: Problem) -> None:
    rng = np.random.default_rng(2)
    state = ChainState(problem, [0] * problem.num_nodes, "additive")  # every op alike
    proposer = Proposer(problem, {"group": 1.0}, rng)
    grew = 0
    for _ in range(100):
        out = proposer.propose(state, repair=0.0)
        assert out is not None
        _, changes = out
        i, c = changes[0]
        old = state.choices[i]
        for j, new in changes[1:]:
            assert proposer._translate(i, old, j) == state.choices[j]
            assert proposer._translate(i, c, j) == new
        grew += len(changes) > 1
    assert grew > 10


def test_repairs_free_memory_on_the_over_full_pool() -> None:
    for seed in range(20):
        p = random_problem(8, 4, seed=seed, memory=True)
        assert p.usage is not None
        worst = [int(np.argmax(u[:, 0])) for u in p.usage]
        state = ChainState(p, worst, "additive")
        if state.memory is None or state.memory.overfull() is None:
            continue
        out = Proposer(p, {"jump": 1.0}, np.random.default_rng(seed)).propose(state, repair=1.0)
        assert out is not None and out[0] == "repair"
        (i, c), *partners = out[1]
        assert p.usage[i][c, 0] < p.usage[i][worst[i], 0]
        for j, d in partners:  # neighbours moved only off a pair the repair forbids
            k = next(k for k, e in enumerate(p.edges) if set(e) == {i, j})
            u, _ = p.edges[k]
            now = p.edge_cost[k][c, worst[j]] if u == i else p.edge_cost[k][worst[j], c]
            after = p.edge_cost[k][c, d] if u == i else p.edge_cost[k][d, c]
            assert not np.isfinite(now) and np.isfinite(after)


def test_a_repair_moves_a_neighbour_off_a_forbidden_pair() -> None:
    """Node 1 must drop to its 167-byte config to fit, which node 0's cheapest config
    forbids: one repair proposal moves both (a single change would be inf)."""
    p = random_problem(3, 4, seed=4, memory=True)
    assert p.usage_limit is not None
    p = dataclasses.replace(p, usage_limit=p.usage_limit * 0.75)
    state = ChainState(p, [2, 2, 3], "additive")
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(50):
        out = Proposer(p, {"jump": 1.0}, rng).propose(state, repair=1.0)
        assert out is not None and out[0] == "repair"
        seen.add(tuple(sorted(out[1])))
    assert ((0, 0), (1, 1)) in seen


def test_additive_bookkeeping_equals_the_evaluator() -> None:
    p = random_problem(12, 5, seed=4, memory=False)
    rng = np.random.default_rng(0)
    choices = [int(rng.integers(n)) for n in p.sizes]
    add = AdditiveCost(p, choices)
    for _ in range(200):
        changes = [
            (int(i), int(rng.integers(p.sizes[i]))) for i in rng.integers(p.num_nodes, size=3)
        ]
        changes = list(dict(changes).items())
        predicted = add.delta_many(changes)
        before = additive_cost(p, add.choices)
        for i, c in changes:
            add.set(i, c)
        after = additive_cost(p, add.choices)
        assert add.cost == pytest.approx(after, rel=1e-9) or (math.isinf(after) and add.forbidden)
        if math.isfinite(before) and math.isfinite(after):
            assert predicted == pytest.approx(after - before, rel=1e-9, abs=1e-6)


def test_lazy_undo_keeps_the_simulation_exact(problem: Problem) -> None:
    from backends.base import evaluate_objective

    rng = np.random.default_rng(3)
    state = ChainState(problem, [0] * problem.num_nodes, "makespan")
    proposer = Proposer(problem, DNN_MIX, rng)
    for step in range(40):
        out = proposer.propose(state, repair=0.0)
        assert out is not None
        was = state.cost, state.violation
        undo = [(i, state.choices[i]) for i, _ in out[1]]
        cost, _ = state.move(out[1])
        assert cost == evaluate_objective(problem, state.choices, "makespan")  # bit for bit
        if step % 3:
            state.undo(undo, *was)
            assert state.cost == was[0]


def test_a_large_jump_is_simulated_in_full_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A change of most nodes (a restart) rebuilds the simulation instead of a delta; the
    makespan is the one a fresh simulation gives, and later deltas go on from it."""
    import backends.mcmc.state as ms

    monkeypatch.setattr(ms, "REBUILD_MIN", 0)  # tiny_cnn has fewer nodes than the default
    p = build_problem(tiny_cnn(), get_preset("p100-1x4"))
    rng = np.random.default_rng(3)
    state = ChainState(p, [0] * p.num_nodes, "makespan")
    target = [int(rng.integers(n)) for n in p.sizes]
    sim = state.sim
    state.jump_to(target)
    assert state.sim is not sim  # rebuilt
    assert state.cost == ChainState(p, target, "makespan").cost
    i = next(k for k, n in enumerate(p.sizes) if n > 1)
    c = (target[i] + 1) % p.sizes[i]
    sim = state.sim
    state.move([(i, c)])
    assert state.sim is sim  # a one-node change is a delta
    target[i] = c
    assert state.cost == ChainState(p, target, "makespan").cost
