"""`python -m backends.warm` (run by `make install`): every family's kernels compiled or
loaded, so a first search does not spend its limit compiling."""

from __future__ import annotations

import pytest

from backends import SolveOptions, get_backend
from backends.local import anneal
from backends.warm import warm
from backends.wcsp import crossover
from planner.problems.costtable import contest_problem


def test_warm_compiles_each_family_then_a_short_search_answers() -> None:
    seconds = warm()
    assert set(seconds) == {"local", "toulbar2", "reader"}
    assert all(v >= 0 for v in seconds.values())
    assert "seconds" in anneal._COMPILED  # the local kernels are loaded in this process
    for kernel in (crossover.crossover, crossover.components, crossover._cost):
        assert kernel.signatures, kernel  # toulbar2's crossovers too
    # a limit far shorter than a cold compile: the search answers (it was NO_SOLUTION)
    problem = contest_problem(100, seed=3)
    result = get_backend("local").solve(problem, SolveOptions(time_limit=0.5))
    assert result.choices is not None, result.stats
    assert result.stats["compile_seconds"] == pytest.approx(0.0)
