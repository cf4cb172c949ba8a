"""The many-strategy generator (`planner.problems.many_strategies`) and the portfolio's choice
of members by what makes a problem hard (`backends.model.hardness`, `backends.portfolio`
`_members` and `exact_fits`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from backends import portfolio
from backends.model.hardness import hardness, model_size
from backends.model.selection import selection
from backends.portfolio import (
    EXACT_ALWAYS,
    EXACT_MOST,
    EXACT_SECONDS_PER_COLUMN,
    PortfolioBackend,
    PortfolioSettings,
    exact_fits,
)
from experiments.many_strategies import main as many_main
from planner.errors import ProblemError
from planner.problems.costtable import contest_problem, load_problem, random_problem, save_problem
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.many_strategies import many_strategies
from planner.problems.problem import Problem


@functools.cache
def g_ish() -> Problem:
    """A small source shaped like IOPDDL G: 4-16 strategies per node (G: 12.3 on average)."""
    return contest_problem(200, seed=0, strategies=(4, 16))


@functools.cache
def g_like(seed: int = 0) -> Problem:
    return many_strategies(g_ish(), seed, mean=29, most=120)


def test_the_generator_keeps_the_graph_and_draws_the_strategies_asked_for() -> None:
    src, p = g_ish(), g_like()
    assert p.edges == src.edges and p.node_names == src.node_names
    assert np.array_equal(p.intervals, src.intervals)
    assert np.array_equal(p.usage_limit, src.usage_limit)
    sizes = np.array(p.sizes)
    assert abs(sizes.mean() - 29) < 0.5 and sizes.max() == 120
    assert sizes.max() > 3 * np.median(sizes)  # heavy-tailed
    banned = sum(int((~np.isfinite(c)).sum()) for c in p.node_cost) / sizes.sum()
    assert 0.08 < banned < 0.12
    assert all(np.isfinite(c).any() for c in p.node_cost)


def test_the_generator_keeps_the_source_strategies_so_its_answers_stay_valid() -> None:
    """Band 0 is the source's allowed strategies unchanged: a valid answer of the source,
    mapped, is valid at the same cost (here the least-memory vector of the source, which
    contest_problem keeps valid)."""
    src, p = g_ish(), g_like()
    allowed = [np.flatnonzero(np.isfinite(c)) for c in src.node_cost]
    assert src.usage is not None
    use = [np.asarray(u).reshape(-1) for u in src.usage]
    least = [int(a[np.argmin(u[a])]) for a, u in zip(allowed, use, strict=True)]
    mapped = [int(np.searchsorted(a, c)) for a, c in zip(allowed, least, strict=True)]
    assert memory_feasible(src, least) and memory_feasible(p, mapped)
    assert additive_cost(p, mapped) == additive_cost(src, least)
    # costs and usages that are not integers stay the source's too (band 0 was floored)
    frac = dataclasses.replace(
        src,
        node_cost=tuple(c * 1.5 + 0.25 for c in src.node_cost),
        usage=tuple(np.asarray(u) + 0.5 for u in src.usage),
    )
    q = many_strategies(frac, 0, mean=29, most=120)
    assert q.usage is not None and frac.usage is not None
    for i, a in enumerate(allowed):  # band 0: the first len(a) strategies of each node
        assert np.array_equal(q.node_cost[i][: len(a)], frac.node_cost[i][a])
        u = np.asarray(frac.usage[i]).reshape(len(frac.node_cost[i]), -1)[a]
        assert np.array_equal(np.asarray(q.usage[i]).reshape(len(q.node_cost[i]), -1)[: len(a)], u)


def test_the_generator_is_deterministic_by_seed_and_its_file_reads_back(tmp_path: Path) -> None:
    a, b, c = g_like(0), many_strategies(g_ish(), 0, mean=29, most=120), g_like(1)
    assert a.sizes == b.sizes
    assert all(np.array_equal(x, y) for x, y in zip(a.edge_cost, b.edge_cost, strict=True))
    assert a.sizes != c.sizes
    path = tmp_path / "g-like.json.gz"
    assert many_main([str(tmp_path / "src.json"), str(path)]) == 2  # no such source
    save_problem(g_ish(), tmp_path / "src.json")
    assert many_main([str(tmp_path / "src.json"), str(path), "--mean", "29", "--most", "120"]) == 0
    back = load_problem(path)
    assert back.sizes == a.sizes
    assert all(np.array_equal(x, y) for x, y in zip(back.node_cost, a.node_cost, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(back.edge_cost, a.edge_cost, strict=True))


def test_the_generator_refuses_what_it_cannot_make() -> None:
    with pytest.raises(ProblemError, match="most >= the source's allowed strategies"):
        many_strategies(g_ish(), 0, mean=10, most=8)
    with pytest.raises(ProblemError, match="seed >= 0"):
        many_strategies(g_ish(), -1)
    with pytest.raises(ProblemError, match="a mean of at least the source's"):
        many_strategies(g_ish(), 0, mean=2, most=120)  # (it gave the source's mean, 9.9)
    with pytest.raises(ProblemError, match="forbids only new strategies"):
        many_strategies(g_ish(), 0, mean=12, most=120, forbidden=0.5)  # (it gave less)


LARGE_INSTALLED = all(importlib.util.find_spec(m) for m in ("pytoulbar2", "numba"))
EXACT_INSTALLED = all(importlib.util.find_spec(m) for m in ("pulp", "ortools"))


@pytest.mark.skipif(
    not (LARGE_INSTALLED and EXACT_INSTALLED), reason="needs pytoulbar2, numba, pulp, ortools"
)
def test_a_g_like_problem_gets_toulbar2_and_local_and_a_tiny_one_the_exact_members() -> None:
    """By model columns against the time, not by node count: 200 nodes of G-like tables
    (30,000 columns, 4.5 s predicted) do not fit 5 s; 30 random nodes always do."""
    backend, settings = PortfolioBackend(), PortfolioSettings()
    members, why, _ = backend._members(settings, g_like(), 5.0)
    assert members == ["toulbar2", "local"]
    assert why["columns"] == model_size(selection(g_like())) > EXACT_ALWAYS
    assert why["entries"] == hardness(g_like()).entries
    tiny = random_problem(30, 6, seed=0)
    members, why, _ = backend._members(settings, tiny, 1.0)
    assert members[:2] == ["ilp", "cpsat"] and why["columns"] <= EXACT_ALWAYS
    forced = PortfolioSettings(members=("toulbar2",))
    assert backend._members(forced, tiny, 1.0)[0] == ["toulbar2"]


@pytest.mark.skipif(not LARGE_INSTALLED, reason="needs pytoulbar2 and numba")
def test_without_the_exact_solvers_a_g_like_problem_still_gets_toulbar2_and_local(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (the member choice fell through to mcmc alone when pulp and ortools were missing)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        portfolio.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("pulp", "ortools") else real(name, *a),
    )
    members, _, _ = PortfolioBackend()._members(PortfolioSettings(), g_like(), 5.0)
    assert members == ["toulbar2", "local"]


def test_exact_fits_weighs_the_predicted_time_against_the_limit_and_the_cpu_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g_columns = 66_628  # IOPDDL G's model
    assert exact_fits(EXACT_ALWAYS, 0.1)[0]
    assert not exact_fits(EXACT_MOST, 1e9)[0]
    assert not exact_fits(g_columns, 10.0)[0]  # --time-limit 10: toulbar2 found the optimum
    monkeypatch.setattr("backends.portfolio.cpu_share", lambda: 1.0)
    fits, rule = exact_fits(g_columns, 120.0)
    assert fits and rule["predicted_seconds"] == round(g_columns * EXACT_SECONDS_PER_COLUMN, 2)
    monkeypatch.setattr("backends.portfolio.cpu_share", lambda: 0.1)  # a loaded machine
    assert not exact_fits(g_columns, 120.0)[0]


@pytest.mark.parametrize(
    "argv, says",
    [(["a", "b", "--seed", "-1"], "--seed"), (["{tmp}/none.json", "b"], "does not exist")],
)
def test_the_command_line_refuses_bad_arguments_in_one_line(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert many_main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and says in err


@pytest.mark.slow
def test_the_portfolio_on_a_g_like_problem_runs_toulbar2_and_local_and_answers() -> None:
    """At 5 s the default members of the small G-like problem are toulbar2 and local, and
    the answer is valid, no worse than the source's least-memory answer mapped, with a bound."""
    from backends import SolveOptions, get_backend

    p = g_like()
    r = get_backend("portfolio").solve(p, SolveOptions(time_limit=5.0))
    assert r.stats["choice"]["members"] == ["toulbar2", "local"]
    assert r.has_solution and memory_feasible(p, r.choices)
    src = g_ish()
    assert src.usage is not None
    allowed = [np.flatnonzero(np.isfinite(c)) for c in src.node_cost]
    use = [np.asarray(u).reshape(-1) for u in src.usage]
    mapped = [int(np.argmin(u[a])) for a, u in zip(allowed, use, strict=True)]
    assert r.objective <= additive_cost(p, mapped)
    assert r.bound is not None and 0 < r.bound <= r.objective
