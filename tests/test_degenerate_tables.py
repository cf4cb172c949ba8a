"""Tiny and degenerate cost tables against every registered additive backend (issue 42, item
9): random tables of 1-3 nodes with 1-3 strategies, forbidden choices and pairs, zero costs,
parallel edges, memory limits that one answer or none meets. Each answer is checked against
brute force (`backends.testing.check_answer`): the right status, a valid answer that
re-scores to the reported objective, never an exception. The hand-written cases
(`backends.testing.degenerate_problems`) run in every backend's conformance suite."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends import SolveOptions, Status, get_backend
from backends.base import integral_bound
from backends.model.selection import edge_groups, selection
from backends.testing import check_answer, degenerate_problems, table_problem
from backends.wcsp import lower_bound
from planner.cli import main
from planner.deadline import Deadline
from planner.problems.costtable import brute_force, random_problem
from planner.problems.problem import Problem
from planner.registry import backend_names

# caps that end the searching backends' runs early on tables this small (else they search
# to the time limit)
EXTRA: dict[str, dict[str, Any]] = {"mcmc": {"iterations": 300}, "local": {"round_moves": 2000}}
SECONDS = 2.0


def additive_backends() -> list[str]:
    """Every registered backend that is installed and optimizes the additive objective."""
    out = []
    for name in backend_names():
        backend = get_backend(name)
        if "additive" in backend.objectives and backend.is_installed():  # type: ignore[attr-defined]
            out.append(name)
    return out


COST = st.sampled_from([0.0, 0.0, 1.0, 2.0, 7.0, 40.0, math.inf])
PAIR = st.sampled_from([0.0, 0.0, 3.0, 5.0, math.inf])


@st.composite
def tiny_problems(draw: st.DrawFn) -> Problem:
    """1-3 nodes of 1-3 strategies; any costs forbidden; 0-3 edges (parallel and reversed
    ones too); with or without a memory limit (intervals may be empty)."""
    n = draw(st.integers(1, 3))
    sizes = [draw(st.integers(1, 3)) for _ in range(n)]
    costs = tuple(np.array([draw(COST) for _ in range(k)]) for k in sizes)
    edges: list[tuple[int, int]] = []
    tables = []
    if n > 1:
        for _ in range(draw(st.integers(0, 3))):
            u, v = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
            edges.append((u, v))
            tables.append(
                np.array([[draw(PAIR) for _ in range(sizes[v])] for _ in range(sizes[u])])
            )
    usage = intervals = limit = None
    if draw(st.booleans()):
        usage = tuple(np.array([[draw(st.integers(0, 4))] for _ in range(k)], float) for k in sizes)
        starts = [draw(st.integers(0, 2)) for _ in range(n)]
        intervals = np.array([(s, s + draw(st.integers(0, 2))) for s in starts], dtype=np.int64)
        limit = np.array([float(draw(st.integers(0, 8)))])
    return Problem(
        name="tiny",
        node_names=tuple(str(i) for i in range(n)),
        node_cost=costs,
        edges=tuple(edges),
        edge_cost=tuple(tables),
        usage=usage,
        intervals=intervals,
        usage_limit=limit,
    )


def check_every_backend(problem: Problem) -> None:
    for name in additive_backends():
        options = SolveOptions(time_limit=SECONDS, seed=0, extra=EXTRA.get(name, {}))
        check_answer(name, problem, options)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=tiny_problems())
def test_tiny_tables_in_every_backend(problem: Problem) -> None:
    check_every_backend(problem)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=tiny_problems())
def test_tiny_tables_in_every_backend_at_length(problem: Problem) -> None:
    check_every_backend(problem)


def test_an_empty_edge_table_has_integer_groups() -> None:
    """A node whose choices are all forbidden leaves its edge tables with no rows; their
    groups were float arrays (np.array([])), and indexing with them raised IndexError."""
    rows, cols, table = edge_groups(np.zeros((0, 2)))
    assert rows.dtype.kind == "i" and len(rows) == 0 and table.shape[0] == 0
    assert cols.dtype.kind == "i"
    (problem,) = [p for p in degenerate_problems() if p.name == "single-strategy-forbidden"]
    sel = selection(problem)
    assert sel.infeasible is not None
    assert sel.groups(0)[0].dtype.kind == "i"


ISSUE = {
    "problem": {
        "name": "t",
        "nodes": {
            "intervals": [[0, 1], [0, 1]],
            "costs": [[999999999999999999], [1, 2]],
            "usages": [[1], [1, 1]],
        },
        "edges": {"nodes": [[0, 1]], "costs": [[0, 0]]},
        "usage_limit": 10,
    }
}


@pytest.mark.parametrize("backend", ["ilp", "cpsat"])
@pytest.mark.parametrize("cost", [999999999999999999, 7])
def test_a_single_strategy_node_on_an_edge_plans_or_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str, cost: int
) -> None:
    """The issue's table: one strategy on node 0, an edge to node 1. It crashed with an
    IndexError from `edge_groups` when that strategy was forbidden; now a plan, or one
    `error:` line that says no solution exists (whether 999999999999999999 is forbidden is
    the cost-table reader's business)."""
    doc = json.loads(json.dumps(ISSUE))
    doc["problem"]["nodes"]["costs"][0] = [cost]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    code = main(["plan", "--problem", str(path), "--backend", backend, "--time-limit", "5"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if code == 0:
        assert "OPTIMAL" in out
        if cost == 7:
            assert "additive 8" in out
    else:
        assert cost != 7
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "INFEASIBLE" in lines[0], err


# ------------------------------------------------------------------ bounds (issue 42, item 10)


def test_a_bound_within_rounding_of_an_integer_is_that_integer() -> None:
    assert integral_bound(217038.999999783) == 217039.0
    assert integral_bound(519282.99999948073) == 519283.0
    assert integral_bound(7.0000001) == 7.0  # a float's overshoot is not a unit more
    assert integral_bound(7.4) == 8.0  # an integer objective of at least 7.4 is at least 8
    # the tolerance is at most half a unit: 0.25 above an integer counts as noise
    assert integral_bound(1e15 + 0.25) == 1e15 and integral_bound(1e15 + 0.75) == 1e15 + 1
    assert integral_bound(0.0) == 0.0 and integral_bound(math.inf) == math.inf


def test_an_exact_proof_on_integer_costs_has_the_objective_as_its_bound() -> None:
    """CBC's bound came back as 43,261.99999995674 for an optimum of 43,262."""
    problem = random_problem(60, 6, seed=0, memory=True)
    assert problem.integer_costs
    result = get_backend("ilp").solve(problem, SolveOptions(time_limit=20.0, seed=0))
    assert result.status is Status.OPTIMAL
    assert result.bound == result.objective


def test_bounds_of_fractional_costs_are_not_rounded() -> None:
    problem = table_problem("halves", [[0.5, 2.25], [1.5, 0.75]], {(0, 1): [[0.5, 0], [0, 0.5]]})
    assert not problem.integer_costs
    result = get_backend("ilp").solve(problem, SolveOptions(time_limit=20.0, seed=0))
    assert result.status is Status.OPTIMAL
    assert math.isclose(result.objective_value(), 1.25)
    assert result.bound is not None and math.isclose(result.bound, 1.25, rel_tol=1e-6)
    assert result.bound <= 1.25 + 1e-9


def test_the_lagrangian_bound_of_tiny_tables() -> None:
    """`backends.wcsp.lower_bound` (public, for other backends): never above the optimum, inf
    when nothing is valid, on every degenerate table (no nodes: it raised ValueError)."""
    for problem in degenerate_problems():
        _, value = brute_force(problem)
        bound = lower_bound(problem, Deadline.after(1.0))
        assert bound <= value * (1 + 1e-9) + 1e-9, problem.name
        if value == math.inf and problem.name != "the-pair-that-fits-is-forbidden":
            assert bound == math.inf, problem.name  # that one takes the multipliers seconds
