"""GPT-2 and Llama as their authors write them, trained by the runtime on gloo workers and
compared with single-process training in float64; and what the runtime refuses."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from budget import time_budget
from test_capture_llm import (
    HFGPT,
    EinsumNet,
    PackedNet,
    _DeclaredRMS,
    _Net,
    gpt2,
    llama,
    mla_like,
    qwen3_like,
)

import planner
import runtime
from planner.costs.config import ParallelConfig
from planner.graph.llm import GPT2, GPT2Config
from planner.graph.opkinds import CHANNEL, LENGTH
from planner.hardware.presets import get_preset
from planner.problems.strategy import Strategy
from runtime.plan import RuntimeConfigError
from runtime.strategies import random_strategy

F64 = runtime.RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=60)
TOKENS = (torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0)),)


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(300):
        yield


def _runs(module: torch.nn.Module, world: int, draws: int) -> list[float]:
    result = planner.plan(module, "cpu-local-2", example_inputs=TOKENS, backend="elimination")
    graph = result.problem.dnn().graph
    assert graph is not None
    devices = get_preset(f"cpu-local-{world}")
    strategies = [random_strategy(graph, devices, seed) for seed in range(draws)]
    if world == 2:
        strategies.append(result.strategy)
    out = []
    for strategy in strategies:
        run = runtime.run_strategy(strategy, module, F64)
        assert all(math.isfinite(x) for x in run.losses)
        assert run.deviation is not None
        out.append(run.deviation["max_deviation"])
    return out


@pytest.mark.parametrize(
    "make",
    [lambda: gpt2("buffer", context=32), lambda: llama("ones"), HFGPT, EinsumNet, PackedNet],
    ids=["gpt2-buffer-longer-context", "llama-ones", "hugging-face-idioms", "einsum", "packed"],
)
def test_reference_style_transformers_train_like_single_process(make) -> None:  # type: ignore[no-untyped-def]
    # random strategies cut heads (whole k/v groups for Llama), sequence and samples, the
    # slices of the fused QKV, the vocabulary of the tied head (held whole where the
    # embedding cuts it the other way)
    assert max(_runs(make(), 2, 1)) < 1e-9


def _attention_split(strategy: Strategy, dim: str) -> Strategy:
    """`strategy` with every attention op cut 2 ways along `dim` (its heads or its rows)."""
    configs = list(strategy.configs)
    for i, op in enumerate(strategy.graph.ops):
        if op.kind == "attention":
            degrees = tuple(2 if d == dim else 1 for d in op.output.dims)
            configs[i] = ParallelConfig(degrees, (0, 1))
    return Strategy(strategy.graph, strategy.devices, tuple(configs))


@pytest.mark.parametrize(
    ("make", "dims"),
    [
        (lambda: qwen3_like(torch_rmsnorm=True), (LENGTH, CHANNEL)),
        (lambda: qwen3_like(), (CHANNEL,)),
        (lambda: mla_like(), (LENGTH, CHANNEL)),
    ],
    ids=["qwen3-qk-norm", "qwen3-qk-norm-float32", "mla"],
)
def test_qk_norm_and_latent_attention_cut_by_heads_or_rows_train_like_single_process(
    make, dims
) -> None:  # type: ignore[no-untyped-def]
    """Qwen3's attention (heads of 24 on a width of 64, QK-norm) and DeepSeek's MLA (q/k heads
    of 16, v heads of 8, a rotary key every head shares) with their attention ops cut in 2
    by heads (a task: 2 query heads, their k/v head or their per-head k|v and the whole
    rotary key) and by query rows, against one process in float64. A QK-norm computed in
    float32 whatever the model's dtype (Hugging Face's and Meta's RMSNorm) is checked cut by
    heads: cut by rows, each task normalises the whole k and runs that norm's float32
    backward on its part of k's gradient, which one process runs once on the sum (2.9e-9
    apart after 2 steps: float32 rounding, as any float32 sum in another order)."""
    module = make()
    result = planner.plan(module, "cpu-local-2", example_inputs=TOKENS, backend="elimination")
    for dim in dims:
        strategy = _attention_split(result.strategy, dim)
        run = runtime.run_strategy(strategy, module, F64)
        assert run.deviation is not None and all(math.isfinite(x) for x in run.losses)
        assert run.deviation["max_deviation"] < 1e-9, (dim, run.deviation)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: gpt2("sdpa"),
        lambda: gpt2("ones"),
        lambda: llama("sdpa"),
        lambda: llama("ones", True),
    ],
    ids=["gpt2-sdpa", "gpt2-ones", "llama-sdpa", "llama-ones-torchnorm"],
)
def test_reference_style_transformers_at_world_4(make) -> None:  # type: ignore[no-untyped-def]
    assert max(_runs(make(), 4, 4)) < 1e-9


def test_gpt2_with_dropout_plans_and_trains_without_it_like_single_process() -> None:
    # nanoGPT passes self.dropout to SDPA: planned like nn.Dropout, off in the runtime and in
    # the reference (prepare_for_training), so the run is deterministic and comparable
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, dropout=0.1)
    module = GPT2(config)
    assert max(_runs(module, 2, 1)) < 1e-9


def test_a_declared_kind_planned_on_meta_is_checked_before_the_run() -> None:
    x = torch.randn(2, 4, 8)
    with torch.device("meta"):  # on meta capture cannot compare: the plan is made
        meta = _Net(_DeclaredRMS(8))
    result = planner.plan(meta, "cpu-local-2", example_inputs=(x,), backend="elimination")
    real = _Net(_DeclaredRMS(8))
    with pytest.raises(RuntimeConfigError, match="is declared as 'norm'"):
        runtime.run_strategy(result.strategy, real, F64)
