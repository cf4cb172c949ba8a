"""Speed of the exact backends (pytest-benchmark; run with `make bench`)."""

from __future__ import annotations

from functools import cache

import pytest

from backends import SolveOptions, Status, get_backend
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.problem import Problem, build_problem

pytestmark = pytest.mark.benchmark


@cache
def problem(model: str, preset: str) -> Problem:
    return build_problem(model_graph(model), get_preset(preset))


@pytest.mark.parametrize(
    "model, preset",
    [
        ("vgg16", "p100-1x4"),
        ("inception_v3", "p100-1x4"),
        ("inception_v3", "p100-4x4"),
        ("resnet101", "p100-4x4"),
    ],
)
def test_elimination(benchmark, model: str, preset: str) -> None:
    p = problem(model, preset)
    result = benchmark(get_backend("elimination").solve, p, SolveOptions(time_limit=60))
    assert result.status is Status.OPTIMAL


@pytest.mark.parametrize("model", ["alexnet", "vgg16", "inception_v3"])
def test_search_branch_and_bound(benchmark, model: str) -> None:
    p = problem(model, "p100-1x4")
    result = benchmark(get_backend("search").solve, p, SolveOptions(time_limit=60))
    assert result.status is Status.OPTIMAL


def test_build_problem_inception_16_devices(benchmark) -> None:
    graph, devices = model_graph("inception_v3"), get_preset("p100-4x4")
    p = benchmark.pedantic(build_problem, (graph, devices), rounds=2, iterations=1)
    assert p.num_nodes == len(graph.ops)
