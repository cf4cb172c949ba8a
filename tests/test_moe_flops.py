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
