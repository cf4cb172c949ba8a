"""Context parallelism trained by the runtime on gloo workers and compared with
single-process training in float64: a tiny causal Llama whose sequence is longer than its
width, under Megatron-LM's layout (context 2; tensor 2 x context 2; context 4) and under the
strategy the search chooses when splitting the sequence is cheapest, in the balanced token
order (rank i holds chunks i and 2c-1-i of 2c: `planner.costs.context`) and in order."""

from __future__ import annotations

import pytest
import torch
from test_runtime_llm import F64, budget  # noqa: F401 (budget: an autouse fixture)

import planner
import runtime
from planner.costs.context import sequence_positions
from planner.graph.capture import capture
from planner.graph.llm import Llama, LlamaConfig
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import LENGTH
from planner.hardware.presets import get_preset
from planner.problems.baselines import megatron
from planner.problems.strategy import Strategy


def tiny_llama(seq: int, heads: int = 4, kv_heads: int = 2) -> tuple[Llama, tuple[torch.Tensor]]:
    """A causal Llama with rotary tables, width 32 and a sequence of `seq` tokens."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=heads, n_kv_heads=kv_heads,
        max_seq_len=seq, multiple_of=32,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (2 if heads > 1 else 1, seq), generator=torch.Generator())
    return Llama(config), (tokens,)


def attention_length_degrees(strategy: Strategy) -> list[int]:
    graph = strategy.graph
    return [
        cfg.degrees[op.output.dims.index(LENGTH)]
        for op, cfg in zip(graph.ops, strategy.configs, strict=True)
        if op.kind == "attention"
    ]


def _deviation(strategy: Strategy, model: Llama, order: str = "balanced") -> float:
    options = runtime.RunOptions(**{**F64.__dict__, "cp_order": order})
    run = runtime.run_strategy(strategy, model, options)
    assert run.deviation is not None
    return float(run.deviation["max_deviation"])


def _megatron(world: int, tensor: int, context: int) -> tuple[Strategy, Llama]:
    model, tokens = tiny_llama(64)
    graph: OpGraph = capture(model, tokens, "tiny-llama")
    return megatron(graph, get_preset(f"cpu-local-{world}"), tensor, context), model


def test_megatron_context_2_trains_like_single_process_in_the_balanced_order() -> None:
    strategy, model = _megatron(2, 1, 2)
    positions = sequence_positions(strategy.graph, strategy.configs, "balanced")
    assert positions is not None and list(positions[:32]) == [*range(16), *range(48, 64)]
    assert _deviation(strategy, model) <= 1e-9


@pytest.mark.slow
def test_megatron_context_2_trains_like_single_process_in_order() -> None:
    strategy, model = _megatron(2, 1, 2)
    assert sequence_positions(strategy.graph, strategy.configs, "contiguous") is None
    assert _deviation(strategy, model, "contiguous") <= 1e-9


@pytest.mark.slow
@pytest.mark.parametrize(("tensor", "context"), [(2, 2), (1, 4)])
def test_megatron_context_at_world_4_trains_like_single_process(tensor: int, context: int) -> None:
    strategy, model = _megatron(4, tensor, context)
    assert attention_length_degrees(strategy) == [context, context]
    assert _deviation(strategy, model) <= 1e-9


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_searched_strategy_splits_attention_by_sequence_and_trains_exactly(world: int) -> None:
    # one head, one sample, 1024 tokens: only the sequence splits attention, and on this
    # machine's preset splitting it is cheaper than one device
    model, tokens = tiny_llama(1024, heads=1, kv_heads=1)
    found = planner.plan(model, f"cpu-local-{world}", example_inputs=tokens, backend="elimination")
    assert found.strategy is not None
    assert all(c > 1 for c in attention_length_degrees(found.strategy))
    assert _deviation(found.strategy, model) <= 1e-9


def test_the_dtensor_export_names_why_a_sequence_split_attention_is_not_exported() -> None:
    from planner.errors import ExportError
    from planner.export.dtensor import CONTEXT_PARALLEL_REASON, export_plan

    strategy, model = _megatron(2, 1, 2)
    with pytest.raises(ExportError, match="context-parallel"):
        export_plan(strategy, model)
    plan = export_plan(strategy, model, fallback="replicate")
    fell = [o for o in plan.ops if o.kind == "attention"]
    assert fell and all(str(o.reason).startswith(CONTEXT_PARALLEL_REASON) for o in fell)
    assert "CUDA" in CONTEXT_PARALLEL_REASON
