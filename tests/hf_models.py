"""Tiny Hugging Face causal LMs (2 layers, width 64, 4 query and 2 k/v heads, vocabulary 256)
built from their configs as users build them, for the runtime and export tests; importable
by worker processes and as plan-file factories (`hf_models:llama`). Needs `transformers`."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

SMALL: dict[str, Any] = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
EXTRA: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 16},  # its default head_dim (128) is not width / heads
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1},  # in the vocabulary
}
CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "phi3": "Phi3Config",
}
FAMILIES = tuple(CONFIGS)


def hf(family: str, tied: bool = False, layers: int = 2, norms64: bool = False) -> nn.Module:
    """The family's causal LM from its config (seeded: the same parameters in every process);
    `tied`: the head shares the embedding's weight; `norms64`: every RMSNorm computes in the
    model's dtype instead of float32 (`norms_in_model_dtype`)."""
    import transformers

    config = getattr(transformers, CONFIGS[family])(
        **(SMALL | EXTRA.get(family, {}) | {"num_hidden_layers": layers}),
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return norms_in_model_dtype(model) if norms64 else model


def norms_in_model_dtype(model: nn.Module) -> nn.Module:
    """`model` with each Hugging Face RMSNorm (`LlamaRMSNorm`, Qwen3's q_norm and k_norm, ...)
    computing in its input's dtype: the families' own norms compute in float32 whatever the
    model's dtype, and in float64 tests a last-bit difference upstream (a sum in another order)
    then sometimes flips a float32 rounding, 1e-8 after two steps. Without that cast, what a
    layout computes is compared with single-process training at float64 precision. The forward
    is replaced on each instance (the classes and parameter names stay the model's)."""
    for sub in model.modules():
        if type(sub).__name__.endswith("RMSNorm") and hasattr(sub, "variance_epsilon"):
            sub.forward = types.MethodType(_rms_norm, sub)
    return model


def _rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RMSNorm (weight x x / sqrt(mean(x^2) + eps)) in x's dtype."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def llama() -> nn.Module:
    """LlamaForCausalLM, 2 layers of width 64 (a plan-file factory)."""
    return hf("llama")


def mistral() -> nn.Module:
    """MistralForCausalLM, 2 layers of width 64."""
    return hf("mistral")


def qwen2() -> nn.Module:
    """Qwen2ForCausalLM, 2 layers of width 64 (biases on q, k, v)."""
    return hf("qwen2")


def qwen3() -> nn.Module:
    """Qwen3ForCausalLM, 2 layers of width 64, heads of 16 (QK-norm)."""
    return hf("qwen3")


def phi3() -> nn.Module:
    """Phi3ForCausalLM, 2 layers of width 64 (fused qkv_proj and gate_up_proj)."""
    return hf("phi3")
