"""Pipelined strategies in the runtime (runtime.pipeline): m micro-batches per step through
chunks of ops on device groups, in GPipe, 1F1B and interleaved order, trained on gloo
workers and compared with single-process training of the whole batch in float64; and what
a pipelined run refuses, before any worker starts."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from budget import time_budget
from user_models import LogSoftmaxMLP, SmallCNN

import runtime
from planner.costs.config import ParallelConfig
from planner.errors import StrategyError
from planner.graph.capture import capture
from planner.graph.coarsen import coarsen
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import CHANNEL, SAMPLE
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.pipeline.spec import Pipeline, PipelinedStrategy, load_planned, micro_batch_graph
from planner.problems.strategy import Strategy
from runtime.plan import RuntimeConfigError, build_plan
from runtime.run import EXIT_BAD_INPUT, main

F64 = runtime.RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=60)
LENET = runtime.ModelSpec("lenet5", 8, {})
GPT_SIZES: dict[str, Any] = {
    "seq": 16,
    "n_head": 2,
    "n_embd": 32,
    "vocab_size": 128,
    "block_size": 16,
}


def gpt(layers: int) -> runtime.ModelSpec:
    return runtime.ModelSpec("gpt2", 4, {**GPT_SIZES, "n_layer": layers})


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(120):
        yield


@functools.cache
def graph_of(spec: str) -> OpGraph:
    """The whole batch's graph: "lenet5" or "gpt2-L" (L layers)."""
    if spec == "lenet5":
        return model_graph("lenet5", batch=8)
    return model_graph("gpt2", batch=4, **GPT_SIZES, n_layer=int(spec.split("-")[1]))


def pipelined(
    graph: OpGraph,
    bounds: tuple[int, ...],
    groups: tuple[tuple[int, ...], ...],
    m: int,
    schedule: str,
    tensor: bool = False,
) -> PipelinedStrategy:
    """One micro-batch's strategy: every op split over its chunk's group by samples (data
    parallel inside the stage; with `tensor`, linears and attention by channels), or whole
    on the group's first device where the group's size does not divide the dimension."""
    micro = micro_batch_graph(graph, m)
    pipe = Pipeline(bounds, groups, m, schedule)
    configs = []
    for i, op in enumerate(micro.ops):
        group = pipe.group_of(pipe.chunk_of(i))
        dim = CHANNEL if tensor and op.kind in ("linear", "attention") else SAMPLE
        n = len(group) if dim in op.output.dims and op.output.size(dim) % len(group) == 0 else 1
        degrees = tuple(n if d == dim else 1 for d in op.output.dims)
        configs.append(ParallelConfig(degrees, group[:n]))
    world = sum(len(g) for g in groups)
    strategy = Strategy(micro, get_preset(f"cpu-local-{world}"), tuple(configs))
    return PipelinedStrategy(strategy, pipe)


TWO, TWO_BY_TWO, FOUR = ((0,), (1,)), ((0, 1), (2, 3)), ((0,), (1,), (2,), (3,))
# (model, bounds, groups, micro-batches, schedule, tensor splits inside the stages)
CASES = {
    "lenet5-2x1-gpipe-m2": ("lenet5", (0, 4, 9), TWO, 2, "gpipe", False),
    "lenet5-2x1-1f1b-m4": ("lenet5", (0, 4, 9), TWO, 4, "1f1b", False),
    "lenet5-2x2-1f1b-m2": ("lenet5", (0, 4, 9), TWO_BY_TWO, 2, "1f1b", False),
    "lenet5-4x1-1f1b-m4": ("lenet5", (0, 2, 4, 6, 9), FOUR, 4, "1f1b", False),
    "lenet5-interleaved-2x2chunks-m2": ("lenet5", (0, 2, 4, 6, 9), TWO, 2, "interleaved", False),
    "gpt2-2x1-gpipe-m2": ("gpt2-2", (0, 15, 30), TWO, 2, "gpipe", False),
    "gpt2-2x1-1f1b-m4": ("gpt2-2", (0, 15, 30), TWO, 4, "1f1b", False),
    "gpt2-2x2-1f1b-m2": ("gpt2-2", (0, 15, 30), TWO_BY_TWO, 2, "1f1b", False),
    "gpt2-2x2-tensor-gpipe-m2": ("gpt2-2", (0, 15, 30), TWO_BY_TWO, 2, "gpipe", True),
    "gpt2-4x1-1f1b-m4": ("gpt2-4", (0, 15, 27, 39, 54), FOUR, 4, "1f1b", False),
    # chunk 0 ends inside block 0: its residual (op 10) skips chunk 1 into chunk 2, on the
    # same rank, kept there between the two chunks' works
    "gpt2-interleaved-2x2chunks-m2": ("gpt2-2", (0, 11, 13, 22, 30), TWO, 2, "interleaved", False),
    "gpt2-interleaved-2x2chunks-m4": ("gpt2-2", (0, 15, 17, 27, 30), TWO, 4, "interleaved", False),
}


# The default run keeps one case per schedule, stage layout and model kind: GPipe (a CNN; a
# transformer with tensor splits in 2-device stages), 1F1B (more micro-batches than stages;
# 4 stages at world 4), interleaved (a residual skipping a chunk); the repeats run under slow.
DEFAULT_CASES = (
    "lenet5-2x1-gpipe-m2",
    "lenet5-4x1-1f1b-m4",
    "gpt2-2x1-1f1b-m4",
    "gpt2-2x2-tensor-gpipe-m2",
    "gpt2-interleaved-2x2chunks-m2",
)


@pytest.mark.parametrize(
    "case",
    [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
)
def test_pipelines_train_like_single_process(case: str) -> None:
    name, bounds, groups, m, schedule, tensor = CASES[case]
    graph = graph_of(name)
    strategy = pipelined(graph, bounds, groups, m, schedule, tensor)
    model = LENET if name == "lenet5" else gpt(int(name.split("-")[1]))
    run = runtime.run_strategy(strategy, model, F64)
    assert run.deviation is not None
    print(f"{case}: max deviation {run.deviation['max_deviation']:.2e}")
    assert run.deviation["max_deviation"] <= 1e-9, run.deviation
    assert run.deviation["replica_deviation"] == 0.0
    assert all(math.isfinite(x) for x in run.losses) and len(run.losses) == F64.steps
    assert run.world == sum(len(g) for g in groups)
    # every micro-batch's transfers, stage boundaries included
    plan = build_plan(strategy.strategy)
    assert run.transfer_bytes == m * plan.transfer_bytes(8) > 0


def test_a_module_instance_runs_pipelined() -> None:
    # an MLP handed over as the nn.Module itself: the workers rebuild it for the whole batch
    torch.manual_seed(0)
    net = LogSoftmaxMLP()
    graph = coarsen(capture(net, (torch.randn(8, 16),), "mlp"))
    strategy = pipelined(graph, (0, 2, len(graph.ops)), TWO, 4, "1f1b")
    run = runtime.run_strategy(strategy, net, F64)
    assert run.deviation is not None
    print(f"mlp-module-2x1-1f1b-m4: max deviation {run.deviation['max_deviation']:.2e}")
    assert run.deviation["max_deviation"] <= 1e-9, run.deviation


def test_recomputation_and_zero_carry_over_to_pipelines() -> None:
    strategy = pipelined(graph_of("gpt2-2"), (0, 15, 30), TWO, 2, "1f1b")
    run = runtime.run_strategy(strategy, gpt(2), dataclasses.replace(F64, recompute="full"))
    assert run.deviation is not None
    print(f"gpt2-2x1-1f1b-m2-recompute: max deviation {run.deviation['max_deviation']:.2e}")
    assert run.deviation["max_deviation"] <= 1e-9
    # 7 ops of each of the 2 blocks, run again in the backward of each of the 2 micro-batches
    assert run.recomputed_tasks == [2 * 7 * 2] * F64.steps
    strategy = pipelined(graph_of("gpt2-2"), (0, 15, 30), TWO_BY_TWO, 2, "gpipe")
    run = runtime.run_strategy(strategy, gpt(2), dataclasses.replace(F64, zero=1))
    assert run.deviation is not None
    print(f"gpt2-2x2-gpipe-m2-zero1: max deviation {run.deviation['max_deviation']:.2e}")
    assert run.deviation["max_deviation"] <= 1e-9
    assert run.deviation["replica_deviation"] == 0.0


def test_a_plan_file_with_a_pipeline_section_runs_pipelined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    strategy = pipelined(graph_of("lenet5"), (0, 4, 9), TWO, 2, "1f1b")
    path = tmp_path / "plan.json"
    strategy.save(path, model=LENET.to_json())
    loaded, data = load_planned(path)
    assert loaded == strategy and data["pipeline"]["schedule"] == "1f1b"
    capsys.readouterr()
    assert main([str(path), "--steps", "2", "--check", "--dtype", "float64", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["max_deviation"] <= 1e-9 and summary["world"] == 2


def test_an_op_outside_its_chunks_group_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = pipelined(graph_of("lenet5"), (0, 4, 9), TWO, 2, "gpipe")
    configs = list(good.strategy.configs)
    configs[5] = ParallelConfig(configs[5].degrees, (0,))  # fc1: chunk 1, on group (1,)
    bad = dataclasses.replace(good.strategy, configs=tuple(configs))
    message = "op 'fc1' is in pipeline chunk 1 on devices [1], but its config runs on [0] too"
    with pytest.raises(StrategyError) as info:
        PipelinedStrategy(bad, good.pipeline)
    assert str(info.value) == message
    # from a plan file: one `error:` line, nothing started
    data = bad.to_json(model=LENET.to_json(), extra={"pipeline": good.pipeline.to_json()})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main([str(path), "--check"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]


def test_what_a_pipelined_run_refuses_before_starting_workers() -> None:
    strategy = pipelined(graph_of("lenet5"), (0, 4, 9), TWO, 2, "gpipe")
    with pytest.raises(RuntimeConfigError, match="ordered exchange that NCCL needs"):
        runtime.run_strategy(strategy, LENET, dataclasses.replace(F64, exchange="ordered"))
    # a strategy for micro-batches of 4 samples under a pipeline of 4 micro-batches
    wrong = PipelinedStrategy(
        strategy.strategy, dataclasses.replace(strategy.pipeline, micro_batches=4)
    )
    with pytest.raises(RuntimeConfigError, match="is not the graph of one of 4 micro-batches"):
        runtime.run_strategy(wrong, LENET, F64)
    # batch statistics of micro-batches are not the batch's
    net = SmallCNN()
    graph = coarsen(capture(net, (torch.randn(8, 3, 16, 16),), "cnn"))
    cnn = pipelined(graph, (0, 2, len(graph.ops)), TWO, 2, "gpipe")
    with pytest.raises(RuntimeConfigError, match="normalizes with batch statistics") as info:
        runtime.run_strategy(cnn, net, F64)
    assert "\n" not in str(info.value)


def test_a_searched_pipeline_runs_like_single_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end: the pipeline search's plan file (a GPT-2 in 2 stages on two CPU workers,
    whatever micro-batches, schedule, recomputation and ZeRO it chose) trains as one process."""
    import planner

    sizes = {"batch": 4, "seq": 16, "n_layer": 4, "n_head": 2, "n_embd": 32, "vocab_size": 64}
    out = planner.plan_pipeline("gpt2", "cpu-local-2", model_kwargs=sizes, stages=[2])
    assert out.layout.stages == 2
    path = tmp_path / "plan.json"
    out.save(path)
    capsys.readouterr()
    assert main([str(path), "--steps", "2", "--check", "--dtype", "float64", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    print(
        f"searched pipeline ({out.layout.describe()}): max deviation {summary['max_deviation']:.2e}"
    )
    assert summary["max_deviation"] <= 1e-9 and summary["world"] == 2
