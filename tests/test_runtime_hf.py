"""Hugging Face models as they are (transformers' Llama, Mistral, Qwen2, Qwen3 and Phi-3 causal
LMs from their configs, `tests/hf_models.py`) trained by the runtime under plans at world 2
and 4, against single-process training of the same module in float64 (`--check`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import pytest
import torch
from budget import time_budget

import planner
import runtime
from planner.graph.opkinds import CHANNEL
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, megatron
from planner.problems.strategy import Strategy
from runtime.strategies import random_strategy

pytest.importorskip("transformers")
from hf_models import FAMILIES, hf  # noqa: E402

F64 = runtime.RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=120)
TOKENS = (torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)),)


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(600):
        yield


@functools.cache
def planned(family: str, tied: bool = False) -> Strategy:
    """The elimination backend's plan of the family's model on cpu-local-2."""
    result = planner.plan(hf(family, tied), "cpu-local-2", example_inputs=TOKENS,
                          backend="elimination")  # fmt: skip
    return result.strategy


def strategies(family: str, world: int, tied: bool = False) -> dict[str, Strategy]:
    """Data parallelism, Megatron-LM's layout (q/k/v, gate/up and the vocabulary
    column-parallel, attention by heads, o_proj and down_proj row-parallel, norms and residual
    adds by sequence; at world 4 that over 2 ranks, data parallel over 2 pairs) and a random
    draw of the config space; at world 2 also the planner's own plan."""
    plan = planned(family, tied)
    graph, devices = plan.graph, get_preset(f"cpu-local-{world}")
    out = {
        "data": data_parallel(graph, devices),
        "megatron": megatron(graph, devices, tensor=2),
        "random": random_strategy(graph, devices, 1),
    }
    if world == 2:
        out["planned"] = plan
    return out


def _deviation(strategy: Strategy, family: str, tied: bool = False) -> float:
    run = runtime.run_strategy(strategy, hf(family, tied), F64)
    assert all(math.isfinite(x) for x in run.losses)
    assert run.deviation is not None
    return float(run.deviation["max_deviation"])


@pytest.mark.slow  # 14 s at load 2 (6 s of it the workers, which import transformers)
def test_megatron_plan_of_llama_trains_like_single_process_at_world_2() -> None:
    """The module itself (not a wrapper) goes to the workers; its forward takes keyword
    arguments and returns a ModelOutput, and the reference calls it as capture traced it."""
    strategy = strategies("llama", 2)["megatron"]
    summed = {op.name for op, c in zip(strategy.graph.ops, strategy.configs, strict=True)
              if c.reduce > 1}  # fmt: skip
    assert "model.layers.0.self_attn.o_proj" in summed and "model.layers.1.mlp.down_proj" in summed
    assert _deviation(strategy, "llama") <= 1e-9


@pytest.mark.slow
def test_phi3_fused_projections_cut_by_columns_train_like_single_process() -> None:
    """Phi-3's qkv_proj (q | k | v) and gate_up_proj (gate | up) cut in 2 by output channels
    hold contiguous halves of the fused output (q alone, then k and v); the slices that take
    q, k and v apart read the regions they need from both tasks (transfers the cost model
    prices), so no part needs to be split on its own."""
    strategy = strategies("phi3", 2)["megatron"]
    fused = [
        dict(zip(op.output.dims, c.degrees, strict=True))[CHANNEL]
        for op, c in zip(strategy.graph.ops, strategy.configs, strict=True)
        if op.name.endswith(("qkv_proj", "gate_up_proj"))
    ]
    assert fused == [2, 2, 2, 2]
    assert _deviation(strategy, "phi3") <= 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_like_single_process(family: str, world: int) -> None:
    worst = max(_deviation(s, family) for s in strategies(family, world).values())
    assert worst <= 1e-9


@pytest.mark.slow
def test_a_tied_head_trains_like_single_process() -> None:
    """tie_word_embeddings: lm_head.weight is model.embed_tokens.weight, one parameter of the
    graph (by its first name), its two uses' gradients summed."""
    module = hf("llama", tied=True)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    for name, strategy in strategies("llama", 2, tied=True).items():
        assert _deviation(strategy, "llama", tied=True) <= 1e-9, name
