"""The crossover of two labellings (backends/wcsp/crossover.py)."""

from __future__ import annotations

import itertools
import math

import networkx as nx
import numpy as np

from backends.wcsp.crossover import components, crossover, crossover_repaired
from backends.wcsp.memory import kernel_arrays, polish, profile, repair, steps, unbreak
from backends.wcsp.network import Network, build_network
from backends.wcsp.trws import incidence
from planner.deadline import Deadline
from planner.problems.costtable import contest_problem, random_problem
from planner.problems.evaluate import additive_cost, memory_feasible


def _arrays(net: Network) -> tuple[np.ndarray, ...]:
    inc = incidence(net.noff, net.eu, net.ev)
    return kernel_arrays(net.noff, net.unary, net.eu, net.ev, net.eoff, net.binary, inc)


def _random(net: Network, rng: np.random.Generator, g: tuple[np.ndarray, ...]) -> np.ndarray:
    x = np.array([int(rng.integers(d)) for d in net.dom], dtype=np.int64)
    unbreak(x, g, 200)
    return x


def test_the_result_is_valid_never_worse_and_gains_what_it_says() -> None:
    """From a valid base and any donor (random, or the cheapest values memory ignored, over
    the limit): the result is
    valid, costs the base's cost less the gain reported, and the profile kept in place is
    the result's."""
    moved_total, gained_total = 0, 0.0
    for seed in range(30):
        problem = contest_problem(60, seed=seed)
        net = build_network(problem)
        st = steps(problem)
        assert st is not None and net.empty is None
        g = _arrays(net)
        rng = np.random.default_rng(seed)
        base = _random(net, rng, g)
        prof = profile(st, net.usage[net.noff[:-1] + base], st.count)
        args = (st.first, st.after, st.limit, net.usage, g)
        ok = -1
        while ok == -1:
            ok = repair(base, prof, *args, 50, 200)
        if ok != 1 or not math.isfinite(additive_cost(problem, net.choices(base))):
            continue
        before = additive_cost(problem, net.choices(base))
        cheapest = np.array(
            [
                int(np.argmin(net.unary[a:b]))
                for a, b in zip(net.noff[:-1], net.noff[1:], strict=True)
            ]
        )
        unbreak(cheapest, g, 200)  # memory ignored: mostly far over the limit
        for donor in (_random(net, rng, g), _random(net, rng, g), cheapest):
            x = base.copy()
            p = prof.copy()
            moved, gained = crossover(x, donor, p, *args)
            after = additive_cost(problem, net.choices(x))
            assert memory_feasible(problem, net.choices(x))
            assert math.isfinite(after) and after <= before + 1e-9 * before
            assert math.isclose(before - after, gained, rel_tol=1e-9, abs_tol=1e-6 * before)
            assert np.allclose(p, profile(st, net.usage[net.noff[:-1] + x], st.count))
            assert np.all((x == base) | (x == donor))
            moved_total += moved
            gained_total += gained
    assert moved_total > 20 and gained_total > 0


def _components(net: Network, a: np.ndarray, b: np.ndarray) -> list[list[int]]:
    graph = nx.Graph()
    differ = np.flatnonzero(a != b)
    graph.add_nodes_from(differ.tolist())
    graph.add_edges_from(
        (int(u), int(v))
        for u, v in zip(net.eu, net.ev, strict=True)
        if a[u] != b[u] and a[v] != b[v]
    )
    return [sorted(c) for c in nx.connected_components(graph)]


def test_without_a_memory_limit_it_takes_the_best_set_of_components() -> None:
    """No limit: the result is the cheapest of the 2^k labellings that take each component
    of difference from either side (so at most both sides' costs): the components' gains
    are independent, as the module says."""
    checked = 0
    for seed in range(40):
        problem = random_problem(9, 3, seed=seed, memory=False, forbid_prob=0.1)
        net = build_network(problem)
        if net.empty is not None:
            continue
        g = _arrays(net)
        rng = np.random.default_rng(seed)
        a, b = _random(net, rng, g), _random(net, rng, g)
        cost_a = additive_cost(problem, net.choices(a))
        if not math.isfinite(cost_a):
            continue
        parts = _components(net, a, b)
        options = []
        for pick in itertools.product((False, True), repeat=len(parts)):
            y = a.copy()
            for take, part in zip(pick, parts, strict=True):
                if take:
                    y[part] = b[part]
            options.append(additive_cost(problem, net.choices(y)))
        first = np.zeros(net.num_nodes, dtype=np.int64)  # never live: no step to check
        prof, limit = np.zeros((1, 1)), np.full(1, np.inf)
        x = a.copy()
        crossover(x, b, prof, first, first, limit, net.usage[:, :1].copy(), g)
        result = additive_cost(problem, net.choices(x))
        assert math.isclose(result, min(options), rel_tol=1e-9, abs_tol=1e-9)
        assert result <= min(cost_a, additive_cost(problem, net.choices(b))) + 1e-9
        checked += len(parts) > 1
    assert checked >= 10


def test_parts_that_do_not_fit_are_moved_and_repaired_only_when_that_pays() -> None:
    """`crossover_repaired` after `crossover`, from a valid polished base and random
    donors or the cheapest labelling (memory ignored, over the limit): the result is valid,
    never costs more than before (a repaired copy can: it is then not taken), costs the
    cost before less the gain reported, and some calls gain."""
    gained_total = 0.0
    for seed in range(30):
        problem = contest_problem(100, seed=seed)
        net = build_network(problem)
        st = steps(problem)
        assert st is not None and net.empty is None
        g = _arrays(net)
        rng = np.random.default_rng(seed)
        x = _random(net, rng, g)
        prof = profile(st, net.usage[net.noff[:-1] + x], st.count)
        args = (st.first, st.after, st.limit, net.usage, g)
        ok = -1
        while ok == -1:
            ok = repair(x, prof, *args, 50, 200)
        if ok != 1 or not math.isfinite(additive_cost(problem, net.choices(x))):
            continue
        while polish(x, prof, *args) > 0:
            pass
        cheapest = np.array(
            [
                int(np.argmin(net.unary[a:b]))
                for a, b in zip(net.noff[:-1], net.noff[1:], strict=True)
            ]
        )
        unbreak(cheapest, g, 200)
        for donor in (_random(net, rng, g), _random(net, rng, g), _random(net, rng, g), cheapest):
            crossover(x, donor, prof, *args)
            before = additive_cost(problem, net.choices(x))
            gained = crossover_repaired(x, donor, prof, st, net.usage, g, 5, Deadline.after(10))
            after = additive_cost(problem, net.choices(x))
            assert memory_feasible(problem, net.choices(x)) and after <= before
            assert math.isclose(before - after, gained, rel_tol=1e-9, abs_tol=1e-6 * before)
            assert np.allclose(prof, profile(st, net.usage[net.noff[:-1] + x], st.count))
            gained_total += gained
    assert gained_total > 0


def test_a_repaired_copy_that_costs_more_is_not_taken() -> None:
    """contest_problem(200, seed=42), a polished base crossed with three random donors and
    the cheapest labelling: moving the cheapest's best part that does not fit and
    repairing costs more than the base (checked here), so `crossover_repaired` with one try
    keeps x and its profile and gains 0."""
    problem = contest_problem(200, seed=42)
    net = build_network(problem)
    st = steps(problem)
    assert st is not None
    g = _arrays(net)
    rng = np.random.default_rng(42)
    x = _random(net, rng, g)
    prof = profile(st, net.usage[net.noff[:-1] + x], st.count)
    args = (st.first, st.after, st.limit, net.usage, g)
    assert repair(x, prof, *args, 10_000, 200) == 1
    while polish(x, prof, *args) > 0:
        pass
    cheapest = np.array(
        [int(np.argmin(net.unary[a:b])) for a, b in zip(net.noff[:-1], net.noff[1:], strict=True)]
    )
    unbreak(cheapest, g, 200)
    for donor in (_random(net, rng, g), _random(net, rng, g), _random(net, rng, g)):
        crossover(x, donor, prof, *args)
        crossover_repaired(x, donor, prof, st, net.usage, g, 5, Deadline.after(10))
    crossover(x, cheapest, prof, *args)
    order, start, members, _ = components(x, cheapest, g)
    assert len(order)
    y = x.copy()
    part = members[start[order[0]] : start[order[0] + 1]]
    y[part] = cheapest[part]
    p = profile(st, net.usage[net.noff[:-1] + y], st.count)
    assert repair(y, p, *args, 10_000, 200) == 1
    while polish(y, p, *args) > 0:
        pass
    cost = additive_cost(problem, net.choices(x))
    assert additive_cost(problem, net.choices(y)) > cost  # the precondition
    kept, kept_prof = x.copy(), prof.copy()
    assert crossover_repaired(x, cheapest, prof, st, net.usage, g, 1, Deadline.after(10)) == 0
    assert np.array_equal(x, kept) and np.array_equal(prof, kept_prof)
