"""Moves per second of the `local` backend's annealing (pytest-benchmark; run with
`pytest -m benchmark --benchmark-enable tests/test_bench_local.py`)."""

from __future__ import annotations

import pytest

from backends import SolveOptions, get_backend
from backends.local.anneal import compile_kernels
from planner.problems.costtable import random_problem

pytestmark = pytest.mark.benchmark

MOVES = 2_000_000


@pytest.mark.parametrize("nodes", [1_000, 20_000])
def test_moves_per_second(benchmark, nodes: int) -> None:  # type: ignore[no-untyped-def]
    compile_kernels()
    problem = random_problem(nodes, 12, seed=0, forbid_prob=0.1, memory=True)
    extra = {"max_moves": MOVES, "patience": 0}
    backend = get_backend("local")

    def run():  # type: ignore[no-untyped-def]
        return backend.solve(problem, SolveOptions(time_limit=600, seed=0, extra=extra))

    result = benchmark.pedantic(run, rounds=1, iterations=1)
    assert result.stats["moves"] == MOVES
    benchmark.extra_info["moves_per_second"] = result.stats["moves_per_second"]
    benchmark.extra_info["first_feasible_seconds"] = result.stats["first_feasible_seconds"]
    print(f"\n{nodes} nodes: {result.stats['moves_per_second']:,.0f} moves/s")
