"""The crossover of two labellings (backends/wcsp/crossover.py)."""

from __future__ import annotations

import itertools
import math

import networkx as nx
import numpy as np

from backends.wcsp.crossover import crossover
from backends.wcsp.memory import kernel_arrays, profile, repair, steps, unbreak
from backends.wcsp.network import Network, build_network
from backends.wcsp.trws import incidence
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
