"""Functional contraction (`backends.wcsp.contract`): the contracted network has the same
costs and the same optimum as the original, for any added unary costs, and its answers lift
back exactly. Checked against enumeration on small random networks with functional edges."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from backends.wcsp.contract import contract
from backends.wcsp.network import Network, build_network
from planner.problems.costtable import contest_problem, random_problem
from planner.problems.problem import Problem


def _functional(problem: Problem, seed: int, share: float = 0.6) -> Problem:
    """`problem` with a share of its edges made functional one way or the other: one allowed
    partner per value (the rest forbidden, 1e18 as in the contest files)."""
    rng = np.random.default_rng(seed)
    tables = []
    for t in problem.edge_cost:
        t = np.array(t, dtype=np.float64)
        if rng.random() < share:
            flip = rng.random() < 0.5
            m = t.T.copy() if flip else t
            f = rng.integers(m.shape[1], size=m.shape[0])
            keep = m[np.arange(m.shape[0]), f]
            m[:] = np.inf
            m[np.arange(m.shape[0]), f] = keep
            t = m.T.copy() if flip else m
        tables.append(t)
    return dataclasses.replace(problem, edge_cost=tuple(tables))


def _cost(net: Network, unary: np.ndarray, labels: np.ndarray) -> float:
    dv = net.noff[net.ev + 1] - net.noff[net.ev]
    pairs = net.binary[net.eoff[:-1] + labels[net.eu] * dv + labels[net.ev]]
    return float(unary[net.noff[:-1] + labels].sum() + pairs.sum())


def _optimum(net: Network, unary: np.ndarray) -> float:
    return min(
        _cost(net, unary, np.array(x, dtype=np.int64))
        for x in itertools.product(*(range(int(d)) for d in net.dom))
    )


def test_the_contracted_network_has_the_same_optimum_for_any_prices() -> None:
    checked = removed = 0
    for seed in range(24):
        problem = random_problem(7, 3, seed=seed, edge_prob=0.5, forbid_prob=0.0, memory=False)
        net = build_network(_functional(problem, seed, share=0.4))
        if net.empty is not None:
            continue  # no answer avoids the forbidden pairs
        con = contract(net)
        assert con is not None
        checked, removed = checked + 1, removed + con.removed
        rng = np.random.default_rng(seed)
        for _ in range(3):  # the original's costs plus random "prices"
            unary = net.unary + rng.uniform(0, 50, size=len(net.unary))
            small = con.unary(unary)
            assert _optimum(con.net, small) == pytest.approx(_optimum(net, unary), rel=1e-12)
            for y in itertools.product(*(range(int(d)) for d in con.net.dom)):
                y = np.array(y, dtype=np.int64)  # every contracted labelling, lifted: same cost
                assert _cost(net, unary, con.lift(y)) == pytest.approx(_cost(con.net, small, y))
    assert checked >= 12 and removed >= checked // 2  # the check saw real contractions


def test_functional_chains_fold_into_one_node_and_cycles_do_not_loop() -> None:
    problem = _functional(random_problem(9, 3, seed=5, edge_prob=0.6, memory=False), 5, 1.0)
    net = build_network(problem)
    con = contract(net)
    assert con is not None and con.removed > 0
    assert con.net.num_nodes == net.num_nodes - con.removed
    assert np.all(con.net.eu < con.net.ev)  # oriented as build_network's


def test_a_network_without_functional_edges_is_left_as_it_is() -> None:
    problem = random_problem(6, 3, seed=1, forbid_prob=0.0, memory=False)
    net = build_network(problem)
    con = contract(net)
    assert con is not None and con.removed == 0 and con.net.num_nodes == net.num_nodes


def test_contraction_stops_at_the_deadline() -> None:
    from planner.deadline import Deadline

    net = build_network(contest_problem(200, seed=0))
    assert contract(net, Deadline.after(-1.0)) is None
