"""Numerical equivalence on small versions of the zoo models, world sizes 1, 2 and 4 (slow).

Per model and world: data parallelism, model parallelism, OWT, the elimination backend's
strategy (analytic costs) and random strategies drawn from the ConfigSpace, each trained for
two SGD steps in float64 and compared with single-process training of the same model.

Deep batch-normalized nets (ResNet-101, Inception-v3) are ill-conditioned at these tiny
batches: their single-process reference, run again with channels-last convolutions (only the
summation order changes), already deviates from itself by about 6e-10 (docs/runtime.md), so
they are held to 1e-8 instead of 1e-9.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from budget import time_budget

from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, model_parallel, owt
from planner.problems.strategy import Strategy
from runtime.launch import RunOptions, run_strategy
from runtime.reference import ModelSpec
from runtime.strategies import random_strategy

pytestmark = pytest.mark.slow

# name -> (model, learning rate, float64 tolerance)
MODELS: dict[str, tuple[ModelSpec, float, float]] = {
    "alexnet": (ModelSpec("alexnet", 2, {"num_classes": 10}), 0.01, 1e-9),
    "vgg16": (ModelSpec("vgg16", 2, {"num_classes": 10}), 0.01, 1e-9),
    "inception_v3": (ModelSpec("inception_v3", 2, {"num_classes": 10}), 0.01, 1e-8),
    "resnet101": (ModelSpec("resnet101", 4, {"image_size": 64, "num_classes": 10}), 1e-3, 1e-8),
    "rnnlm": (
        ModelSpec("rnnlm", 4, {"steps": 4, "hidden": 16, "layers": 2, "vocab": 30}),
        0.1,
        1e-9,
    ),
    "transformer": (
        ModelSpec("transformer", 4, {"seq": 8, "width": 16, "layers": 2, "heads": 2, "vocab": 30}),
        0.1,
        1e-9,
    ),
}
RANDOM = 2  # random strategies per model and world


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(1800):
        yield


_GRAPHS: dict[str, Any] = {}


def graph_of(model: str) -> Any:
    if model not in _GRAPHS:
        _GRAPHS[model] = MODELS[model][0].graph()
    return _GRAPHS[model]


def elimination(graph: Any, devices: Any) -> Strategy:
    from backends import SolveOptions, get_backend
    from planner.problems.problem import build_problem

    result = get_backend("elimination").solve(
        build_problem(graph, devices), SolveOptions(time_limit=60.0)
    )
    assert result.strategy is not None
    return result.strategy


def strategies(world: int) -> list[tuple[str, Callable[[Any, Any], Strategy]]]:
    if world == 1:
        return [("single", data_parallel)]
    named: list[tuple[str, Callable[[Any, Any], Strategy]]] = [
        ("data_parallel", data_parallel),
        ("model_parallel", model_parallel),
        ("owt", owt),
        ("elimination", elimination),
    ]
    for seed in range(RANDOM):
        named.append((f"random{seed}", lambda g, d, s=seed: random_strategy(g, d, s)))
    return named


CASES = [
    (model, world, name, make)
    for model in MODELS
    for world in (1, 2, 4)
    for name, make in strategies(world)
]


@pytest.mark.parametrize(
    "model,world,name,make", CASES, ids=[f"{m}-w{w}-{n}" for m, w, n, _ in CASES]
)
def test_equivalence(model: str, world: int, name: str, make: Callable[..., Strategy]) -> None:
    spec, lr, tol = MODELS[model]
    strategy = make(graph_of(model), get_preset(f"cpu-local-{world}"))
    options = RunOptions(steps=2, dtype="float64", lr=lr, check=True, timeout=300)
    result = run_strategy(strategy, spec, options)
    assert result.deviation is not None
    assert result.deviation["max_deviation"] <= tol, (result.deviation, strategy.describe())
    assert result.deviation["replica_deviation"] == 0.0
    print(f"{model} world {world} {name}: {result.deviation}")


@pytest.mark.parametrize("make", [data_parallel, owt], ids=["data_parallel", "owt"])
def test_alexnet_float32(make: Callable[..., Strategy]) -> None:
    spec, lr, _ = MODELS["alexnet"]
    options = RunOptions(steps=3, dtype="float32", lr=lr, check=True, timeout=300)
    result = run_strategy(make(graph_of("alexnet"), get_preset("cpu-local-2")), spec, options)
    assert result.deviation is not None and result.deviation["max_deviation"] <= 1e-5


# (model, world, random strategies, shared weights tied)
SWEEP = [
    ("lenet5", 2, 20, True),
    ("lenet5", 4, 20, True),
    ("rnnlm", 2, 10, True),
    ("rnnlm", 2, 10, False),
    ("rnnlm", 4, 10, True),
    ("rnnlm", 4, 10, False),
    ("transformer", 2, 10, True),
    ("transformer", 4, 10, True),
    ("alexnet", 2, 5, True),
    ("alexnet", 4, 5, True),
]
SWEEP_MODELS = {**MODELS, "lenet5": (ModelSpec("lenet5", 8, {}), 0.1, 1e-9)}


@pytest.mark.parametrize(
    "model,world,count,tie",
    SWEEP,
    ids=[f"{m}-w{w}-{'tied' if t else 'untied'}" for m, w, _, t in SWEEP],
)
def test_random_sweep(model: str, world: int, count: int, tie: bool) -> None:
    spec, lr, tol = SWEEP_MODELS[model]
    options = RunOptions(steps=2, dtype="float64", lr=lr, check=True, timeout=300)
    devices = get_preset(f"cpu-local-{world}")
    graph = spec.graph()
    for seed in range(100, 100 + count):
        strategy = random_strategy(graph, devices, seed, tie_groups=tie)
        result = run_strategy(strategy, spec, options)
        assert result.deviation is not None
        assert result.deviation["max_deviation"] <= tol, (seed, result.deviation)
        assert result.deviation["replica_deviation"] == 0.0
