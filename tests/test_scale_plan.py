"""Planning at frontier scale: the table budget and the choice of search agree (the pipeline
search takes the budget for the per-op searches inside its stages, and is not refused for
it), and a 405B-class model is planned on 16,384 H100s (slow)."""

from __future__ import annotations

from typing import Any

import pytest

import planner
from backends.pipeline.inner import searched_layout
from planner.costs.costmodel import CostOptions
from planner.deadline import Deadline
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.pipelined import check_choices
from planner.request import PlanRequest

SMALL_GPT = {"batch": 16, "seq": 64, "n_layer": 4, "n_head": 4, "n_embd": 128, "vocab_size": 512}


def test_the_table_budget_is_not_a_per_op_option() -> None:
    request = PlanRequest.make("gpt2", "p100-2x2", model_kwargs=SMALL_GPT, table_budget=2**30)
    assert request.search.changed() == []  # the pipeline search takes it too
    assert check_choices(request).table_budget == 2**30
    assert check_choices(PlanRequest.make("gpt2", "p100-2x2")).table_budget == 4 * 2**30
    other = PlanRequest.make("gpt2", "p100-2x2", table_budget=2**30, space="mesh")
    assert other.search.changed() == ["space"]


@pytest.mark.parametrize("pipeline", [True, None])
def test_a_table_budget_plans_a_transformer_across_hosts_with_pipelines(pipeline: Any) -> None:
    """`--pipeline on --table-budget ...` was refused; with "auto" the budget sent the
    model to the per-op search."""
    out = planner.plan(
        "gpt2", "p100-2x2", model_kwargs=SMALL_GPT, time_limit=30, pipeline=pipeline,
        table_budget=2**30,
    )  # fmt: skip
    assert isinstance(out, planner.PipelinePlan)


def test_the_budget_bounds_the_per_op_search_inside_a_stage() -> None:
    graph = model_graph("gpt2", **SMALL_GPT)
    devices = get_preset("p100-2x2")
    found = searched_layout(graph, devices, 2, CostOptions(), Deadline.never())
    assert found is not None
    assert searched_layout(graph, devices, 2, CostOptions(), Deadline.never(), 1024) is None
    out = planner.plan(
        "gpt2", "p100-2x2", model_kwargs=SMALL_GPT, time_limit=30, pipeline=True,
        table_budget=1024,
    )  # fmt: skip
    assert out.layout.inner == "rule"  # no stage layout of the per-op search within 1 KiB


LLAMA_405B = {"dim": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8,
              "hidden_dim": 53248, "batch": 2048, "seq": 8192, "dtype": "bfloat16"}  # fmt: skip


@pytest.mark.slow
def test_a_405b_model_is_planned_on_16384_h100s_with_defaults() -> None:
    """Llama 3.1 405B's shape on dgx-h100-2048 at the default 60 s (the preset was refused:
    22 GiB of route tables). Times are measured in docs/scaling.md, not asserted here."""
    out = planner.plan(
        "llama3-8b", "dgx-h100-2048", model_kwargs=LLAMA_405B, optimizer="adam",
        master_weights=True,
    )  # fmt: skip
    assert isinstance(out, planner.PipelinePlan)
    lay = out.layout
    assert lay.stages * lay.tensor * lay.data == 16384
    assert out.stats["memory_fits"]


def test_a_chunk_cache_simulates_each_chunk_once_across_calls(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The exact simulations of a search share chunks: with a cache the second layout's
    chunks that the first had are not simulated again, and the times are the same."""
    from planner.costs.costmodel import CostModel
    from planner.pipeline import stages
    from planner.pipeline.layouts import pipelined
    from planner.pipeline.spec import micro_batch_graph
    from planner.problems.baselines import megatron

    graph = micro_batch_graph(model_graph("gpt2", **SMALL_GPT), 4)
    devices = get_preset("p100-2x2")
    cm = CostModel(graph, devices, CostOptions())
    ps = pipelined(graph, devices, 2, 4, lambda g, d: megatron(g, d, 2), "1f1b")
    calls: list[int] = []
    real = stages.simulate_chunk
    monkeypatch.setattr(stages, "simulate_chunk", lambda *a: calls.append(1) or real(*a))
    plain = stages.chunk_times(cm, ps)
    cache = stages.ChunkCache(size=8)
    assert stages.chunk_times(cm, ps, cache) == plain
    first = len(calls)
    assert stages.chunk_times(cm, ps, cache) == plain and len(calls) == first  # all kept
    other = CostModel(graph, devices, CostOptions(recompute="full"))
    stages.chunk_times(other, ps, cache)
    assert len(calls) > first  # other cost options: simulated again
