"""The MoE FLOP conventions of `experiments.moe_flops` against what the publications print."""

from __future__ import annotations

import pytest

from experiments.moe_flops import (
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    megatron_flops_per_token,
    six_n,
)


def test_deepseek_v3_counts_reproduce_deepseeks_own_tflops() -> None:
    # ISCA '25 "Insights into DeepSeek-V3", Table 4: 272.80B tokens a day on 2,048 GPUs at
    # 385 TFLOP/s per GPU counting causal attention, 432 not
    tokens = 272.80e9 / 86400 / 2048
    causal = megatron_flops_per_token(DEEPSEEK_V3, 4096) * tokens / 1e12
    full = megatron_flops_per_token(DEEPSEEK_V3, 4096, causal=False) * tokens / 1e12
    assert causal == pytest.approx(385, rel=0.005)
    assert full == pytest.approx(432, rel=0.005)


def test_deepseek_v3_activates_37b_parameters() -> None:
    assert DEEPSEEK_V3.active_params() == pytest.approx(37e9, rel=0.02)  # report Sec. 4.2
    assert six_n(DEEPSEEK_V3) < megatron_flops_per_token(DEEPSEEK_V3, 4096)


def test_mixtral_counts_two_of_eight_experts() -> None:
    # Mistral's announcement: 12.9B of 46.7B parameters active per token
    assert MIXTRAL_8X7B.active_params() == pytest.approx(12.9e9, rel=0.005)
    per_token = megatron_flops_per_token(MIXTRAL_8X7B, 4096, causal=False)
    attention = 32 * 6 * (4096 * (4096 + 2048) + 4096 * 4096 + 4096 * 32 * 256)
    experts = 32 * 6 * 4096 * 3 * 14336 * 2
    assert per_token == attention + experts + 6 * 4096 * 32000
    assert megatron_flops_per_token(MIXTRAL_8X7B, 4096) < per_token


def test_the_captured_mla_model_counts_megatrons_flops_with_full_attention_and_the_router() -> None:
    """The zoo's DeepSeek-V3-like (MLA, here 1 dense and 3 MoE layers) captured on meta: 3 x
    its forward FLOPs per token are Megatron's count of the same shape with the core
    attention not halved (the graph counts QK^T over q/k heads of 192 and AV over v heads of
    128 on the whole square; the causal kernel's half is the cost model's) plus the router's
    6 h E per MoE layer, which Megatron leaves out."""
    from dataclasses import replace

    from planner.graph.capture import capture
    from planner.graph.llm import build_llm

    seq = 256
    module, tokens = build_llm("deepseek-v3-like", batch=1, seq=seq, n_layers=4, first_dense=1)
    graph = capture(module, tokens, "deepseek-v3-like")
    shape = replace(DEEPSEEK_V3, dense_layers=1, moe_layers=3)
    router = 6 * shape.hidden * shape.experts * shape.moe_layers
    full = megatron_flops_per_token(shape, seq, causal=False)
    assert 3 * graph.forward_flops / seq == full + router
    # at DeepSeek-V3's size and context: 281.15 G per token, Megatron's causal count 249.81 G
    whole = megatron_flops_per_token(DEEPSEEK_V3, 4096)
    halved = 61 * 6 * 4096 * 128 * (192 + 128) / 2
    routers = 6 * 7168 * 256 * 58
    assert round((whole + halved + routers) / 1e7) == 28115
