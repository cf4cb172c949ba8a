"""Speed at scale (pytest-benchmark; run with `make bench`): the cost tables and the
elimination DP at 64 devices, full and delta simulation at 256 devices."""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any

import numpy as np
import pytest

from backends import SolveOptions, Status, get_backend
from planner.costs.config import ConfigSpace
from planner.costs.costmodel import CostModel
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.problem import build_problem
from planner.sim.simulator import Simulator

pytestmark = pytest.mark.benchmark

PER_DEVICE_BATCH = 32


@cache
def graph(model: str, devices: int) -> OpGraph:
    return model_graph(model, batch=PER_DEVICE_BATCH * devices)


def _space_options() -> dict[str, Any]:
    """The structured space where build_problem has one; else the first 64 configs per op
    (today's full space at 64 devices takes minutes to build)."""
    if "space" in inspect.signature(build_problem).parameters:
        return {"space": "auto"}
    return {"max_configs": 64}


def test_build_and_eliminate_inception_64_devices(benchmark) -> None:
    g, devices = graph("inception_v3", 64), get_preset("p100-16x4")

    def plan() -> Any:
        problem = build_problem(g, devices, **_space_options())
        return get_backend("elimination").solve(problem, SolveOptions(time_limit=600))

    result = benchmark.pedantic(plan, rounds=1, iterations=1)
    assert result.status is Status.OPTIMAL


@cache
def dp_case(model: str, preset: str) -> tuple[CostModel, Any]:
    devices = get_preset(preset)
    g = graph(model, devices.num_devices)
    return CostModel(g, devices), data_parallel(g, devices).configs


def test_full_simulation_inception_256_devices(benchmark) -> None:
    cm, configs = dp_case("inception_v3", "p100-64x4")
    sim = benchmark.pedantic(Simulator, (cm, configs), rounds=2, iterations=1)
    assert sim.num_tasks > 200_000


def test_delta_simulation_inception_256_devices(benchmark) -> None:
    """One MCMC-like proposal (a random op to a random config) from data parallelism, and
    its undo, per round: compare with the full simulation above."""
    cm, configs = dp_case("inception_v3", "p100-64x4")
    space = ConfigSpace(cm.graph, cm.devices, max_configs=200)
    sim = Simulator(cm, configs)
    rng = np.random.default_rng(0)

    def propose() -> None:
        i = int(rng.integers(len(configs)))
        sim.change(i, space[i].configs[int(rng.integers(len(space[i])))])
        sim.change(i, configs[i])

    benchmark.pedantic(propose, rounds=5, iterations=1)
    assert sim.makespan == Simulator(cm, configs).makespan
