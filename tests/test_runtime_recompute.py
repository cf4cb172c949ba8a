"""Activation recomputation in the runtime (RunOptions.recompute, the plan file's
cost.recompute): the tasks of the ops `recomputed_ops` names run their forward again in the
backward pass, and training stays what single-process training computes (float64, gloo)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from test_capture_llm import gpt2
from test_runtime_llm import F64, budget  # noqa: F401 (budget: an autouse fixture)
from test_runtime_reduce import _graph, _sequence, megatron
from user_models import BlockCNN

import planner
import runtime
from planner.costs.recompute import recomputed_ops
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.strategy import Strategy
from runtime.plan import RuntimeConfigError, build_plan
from runtime.run import EXIT_BAD_INPUT, _recompute_mode, main

FULL = dataclasses.replace(F64, recompute="full")


def recomputed_tasks(strategy: Strategy) -> int:
    """Tasks (over all ranks) of the ops that recompute and save a tensor for their backward:
    each runs its forward twice a step. A slice's or an add's backward reads no saved tensor:
    checkpointing them discards nothing and runs nothing again."""
    plan = build_plan(strategy)
    world = strategy.devices.num_devices
    graph = strategy.graph
    rec = recomputed_ops(graph).block
    saving = [i for i in rec if graph.ops[i].kind not in ("slice", "elementwise")]
    assert all(graph.ops[i].name.endswith(".add") for i in set(rec) - set(saving)
               if graph.ops[i].kind == "elementwise")  # fmt: skip
    return sum(plan.ops[i].task_of(r) is not None for i in saving for r in range(world))


def _strategy(kind: str) -> Strategy:
    graph = _graph()  # gpt2("sdpa"), planned once (cached)
    if kind == "data-2":
        return data_parallel(graph, get_preset("cpu-local-2"))
    return megatron(graph, 4, _sequence(4))  # column/row pairs, the rest by sequence


@pytest.mark.parametrize(
    "kind",
    ["data-2", pytest.param("megatron-4", marks=pytest.mark.slow)],  # world 4: 7 s
)
def test_recomputing_blocks_trains_like_single_process(kind: str) -> None:
    strategy = _strategy(kind)
    expected = recomputed_tasks(strategy)
    # both blocks' norms, linears and attention, on every rank
    assert expected == 2 * 7 * strategy.devices.num_devices
    run = runtime.run_strategy(strategy, gpt2("sdpa"), FULL)
    assert run.deviation is not None
    assert run.deviation["max_deviation"] < 1e-9, run.deviation
    assert run.deviation["replica_deviation"] == 0.0
    assert all(math.isfinite(x) for x in run.losses)
    # each recomputed task ran its forward a second time, in the backward pass, every step
    assert run.recomputed_tasks == [expected] * F64.steps
    assert run.summary()["recomputed_tasks"] == [expected] * F64.steps


def test_a_recomputed_batch_norm_sums_its_statistics_again() -> None:
    # conv + batch norm (folded) in numbered blocks, samples split: the recomputed forward
    # of each task all-reduces its statistics with its peer again, in the backward pass
    torch.manual_seed(0)
    net = BlockCNN()
    images = (torch.randn(4, 3, 8, 8),)
    planned = planner.plan(net, "cpu-local-2", example_inputs=images, backend="elimination")
    graph = planned.problem.dnn().graph
    assert graph is not None
    strategy = data_parallel(graph, get_preset("cpu-local-2"))
    plan = build_plan(strategy)
    rec = recomputed_ops(graph).block
    assert sorted(graph.ops[i].name for i in rec) == ["blocks.0.conv", "blocks.1.conv"]
    assert all(plan.ops[i].batch_norm and plan.ops[i].norm_groups[0] == (0, 1) for i in rec)
    run = runtime.run_strategy(strategy, net, FULL)
    assert run.recomputed_tasks == [recomputed_tasks(strategy)] * F64.steps == [4, 4]
    assert run.deviation is not None and run.deviation["max_deviation"] < 1e-9, run.deviation


def test_recomputing_the_first_block_only() -> None:
    strategy = _strategy("data-2")
    run = runtime.run_strategy(strategy, gpt2("sdpa"), dataclasses.replace(F64, recompute=1))
    # one of the two blocks: half the forwards of "full"
    assert run.recomputed_tasks == [recomputed_tasks(strategy) // 2] * F64.steps
    assert run.deviation is not None and run.deviation["max_deviation"] < 1e-9


def test_without_recompute_no_forward_runs_again() -> None:
    run = runtime.run_strategy(_strategy("data-2"), gpt2("sdpa"), F64)
    assert run.recomputed_tasks == [0] * F64.steps
    assert run.deviation is not None and run.deviation["max_deviation"] < 1e-9


def test_the_mode_comes_from_the_plan_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _recompute_mode({}) == "none"
    assert _recompute_mode({"cost": {"zero": 1}}) == "none"
    assert _recompute_mode({"cost": {"recompute": "full"}}) == "full"
    assert _recompute_mode({"cost": {"recompute": "selective"}}) == "selective"
    path = tmp_path / "plan.json"
    data = _strategy("data-2").to_json()
    data["cost"] = {"recompute": "some"}
    path.write_text(json.dumps(data))
    capsys.readouterr()  # what building the strategy logged (with a handler an earlier test set)
    assert main([str(path)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: the strategy file's cost.recompute must be 'none', 'selective', 'full' or a "
        "number of blocks >= 0, got 'some'"
    ]
    with pytest.raises(
        RuntimeConfigError,
        match="recompute must be 'none', 'selective', 'full' or a number of blocks",
    ):
        runtime.RunOptions(recompute="block").validate()


def test_selective_recomputation_reruns_the_attention_only() -> None:
    # Megatron-LM's selective recomputation: the attention ops (one per block) run their
    # forward again in the backward, on every rank, and training is unchanged
    strategy = _strategy("data-2")
    graph = strategy.graph
    rec = recomputed_ops(graph, "selective").block
    assert {graph.ops[i].kind for i in rec} == {"attention"} and len(rec) == 2
    run = runtime.run_strategy(
        strategy, gpt2("sdpa"), dataclasses.replace(F64, recompute="selective")
    )
    assert run.recomputed_tasks == [2 * strategy.devices.num_devices] * F64.steps
    assert run.deviation is not None and run.deviation["max_deviation"] < 1e-9, run.deviation
