"""Models outside the zoo, end to end through the public API: capture, plan, run, check.

The models live in tests/user_models.py (importable by the worker processes, as a user's
own module would be). Runs start real gloo workers on the CPU, world 2.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from budget import time_budget
from user_models import FunctionalLogSoftmaxMLP, LogSoftmaxMLP, SmallCNN

import planner
import runtime
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, model_parallel, owt
from runtime.run import EXIT_WORKER_FAILED
from runtime.run import main as run_main

F64 = runtime.RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=30)
IMAGES = (torch.randn(8, 3, 16, 16),)


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(120):
        yield


def finite_and_equal(result: runtime.RunResult) -> None:
    assert all(math.isfinite(x) for x in result.losses), result.losses
    assert result.deviation is not None
    assert result.deviation["max_deviation"] < 1e-9, result.deviation


@pytest.mark.parametrize("cls", [FunctionalLogSoftmaxMLP, LogSoftmaxMLP])
def test_a_log_softmax_head_trains_like_single_process(cls: type[torch.nn.Module]) -> None:
    """The issue: a log_softmax head trained on NaN (the runtime took the log of log p)."""
    module = cls()
    graph = (
        planner.plan(module, "cpu-local-2", example_inputs=torch.randn(8, 16)).problem.dnn().graph
    )
    assert graph is not None
    cpus = get_preset("cpu-local-2")
    for baseline in (data_parallel, model_parallel):
        result = runtime.run_strategy(baseline(graph, cpus), module, F64)
        finite_and_equal(result)
        assert all(x > 0 for x in result.losses)  # an NLL of log-probabilities


def test_a_user_module_instance_plans_and_runs_in_process() -> None:
    net = SmallCNN()
    result = planner.plan(net, "cpu-local-2", example_inputs=IMAGES, backend="elimination")
    assert result.status.value == "OPTIMAL" and result.strategy is not None
    assert result.model is not None and result.model.factory == "user_models:SmallCNN"
    finite_and_equal(runtime.run_strategy(result.strategy, net, F64))
    assert result.problem.is_dnn
    finite_and_equal(
        runtime.run_strategy(owt(result.problem.dnn().graph, get_preset("cpu-local-2")), net, F64)
    )


def test_a_user_factory_plans_and_runs_from_its_plan_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Capture, plan, save, then `runtime.run PLAN --check` rebuilds the module from the
    factory the file names, in the worker processes and for the reference."""
    result = planner.plan(
        "user_models:make_cnn",
        "cpu-local-2",
        example_inputs=IMAGES,
        model_kwargs={"classes": 3},
        backend="elimination",
    )
    path = tmp_path / "plan.json"
    result.save(path)
    model = json.loads(path.read_text())["graph"]["model"]
    assert model["factory"] == "user_models:make_cnn" and model["kwargs"] == {"classes": 3}
    assert model["inputs"] == [{"shape": [8, 3, 16, 16], "dtype": "float32"}]
    args = [str(path), "--check", "--world", "2", "--steps", "2", "--dtype", "float64", "--json"]
    assert run_main(args) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert out["max_deviation"] < 1e-9 and out["world"] == 2


def test_a_module_instance_plan_file_runs_with_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's promise: `result.save("plan.json")` of a plan made from an instance is
    a file `runtime.run --check` runs, when the instance's class rebuilds it without
    arguments (it names the class as the factory)."""
    result = planner.plan(SmallCNN(), "cpu-local-2", example_inputs=IMAGES)
    result.save(tmp_path / "plan.json")
    model = json.loads((tmp_path / "plan.json").read_text())["graph"]["model"]
    assert model["factory"] == "user_models:SmallCNN" and model["kwargs"] == {}
    args = [str(tmp_path / "plan.json"), "--check", "--steps", "2", "--dtype", "float64", "--json"]
    assert run_main(args) == 0
    assert json.loads(capsys.readouterr().out)["max_deviation"] < 1e-9


class NeedsArguments(SmallCNN):
    def __init__(self, classes: int) -> None:
        super().__init__(classes)


def test_an_instance_another_process_cannot_rebuild_records_no_model() -> None:
    class Local(SmallCNN):  # not importable: defined in a function
        pass

    for module in (SmallCNN(width=2), NeedsArguments(5), Local()):
        result = planner.plan(module, "cpu-local-2", example_inputs=IMAGES, backend="baselines")
        assert result.model is None, module
        assert result.to_json()["graph"].get("model") is None


def test_a_non_finite_loss_stops_the_run_with_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kwargs = {"poison": True}
    result = planner.plan(
        "user_models:make_cnn", "cpu-local-2", example_inputs=IMAGES, model_kwargs=kwargs
    )
    result.save(tmp_path / "nan.json")
    capsys.readouterr()  # what planning logged (e.g. that it leaves a device idle)
    assert run_main([str(tmp_path / "nan.json"), "--steps", "2"]) == EXIT_WORKER_FAILED
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "step 0: the loss is nan" in err, err
    with pytest.raises(runtime.WorkerError, match="the loss is nan"):
        runtime.run_strategy(result.strategy, SmallCNN(poison=True), runtime.RunOptions(steps=2))


def test_a_module_that_is_not_the_strategys_is_refused() -> None:
    result = planner.plan(SmallCNN(), "cpu-local-2", example_inputs=IMAGES)
    assert result.strategy is not None
    with pytest.raises(runtime.RuntimeConfigError, match="not the graph of this SmallCNN"):
        runtime.run_strategy(result.strategy, SmallCNN(width=2))


def test_a_non_finite_parameter_is_found_and_huge_finite_ones_are_not() -> None:
    from runtime.plan import ShardKey
    from runtime.sync import first_non_finite

    big = torch.full((4,), 3e38)  # its float32 sum overflows, every element is finite
    shards = {ShardKey("a", 0, 4): big, ShardKey("b", 0, 2): torch.zeros(2)}
    assert first_non_finite(shards) is None
    shards[ShardKey("c", 0, 3)] = torch.tensor([0.0, math.inf, 1.0])
    assert first_non_finite(shards) == "c"
    shards[ShardKey("b", 0, 2)] = torch.tensor([math.nan, 0.0])
    assert first_non_finite(shards) == "b"
