"""Small sizes of the zoo models, shared by the tests: the same structure, quick to capture."""

from __future__ import annotations

from typing import Any

GPT2S = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
LLAMAS = ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b")
MOES = ("mixtral-8x7b", "deepseek-v3-like", "qwen-moe-like", "qwen3-30b-a3b", "qwen3-235b-a22b")
LLMS = GPT2S + LLAMAS + MOES

GPT2_SMALL: dict[str, Any] = {
    "seq": 16,
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 4,
    "vocab_size": 100,
    "block_size": 16,
}
LLAMA_SMALL: dict[str, Any] = {
    "seq": 16,
    "n_layers": 2,
    "dim": 64,
    "n_heads": 4,
    "n_kv_heads": 2,
    "vocab_size": 100,
    "max_seq_len": 16,
    "multiple_of": 32,
}

# The mixtures of experts at Llama's small size: 4 experts of 32 (DeepSeek: 2 groups and no
# dense layer, so that its blocks are alike as the pipeline search needs, and small MLA
# ranks and heads; Qwen: a shared expert of 48; Qwen3: heads of 24, not 64 / 4).
MOE_SMALL: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": {**LLAMA_SMALL, "n_experts": 4, "top_k": 2, "moe_hidden": 32},
    "deepseek-v3-like": {
        **LLAMA_SMALL, "n_experts": 4, "top_k": 2, "moe_hidden": 32, "n_groups": 2,
        "topk_groups": 1, "first_dense": 0, "n_kv_heads": None, "q_lora_rank": 32,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    },
    "qwen-moe-like": {
        **LLAMA_SMALL, "n_experts": 4, "top_k": 2, "moe_hidden": 32, "shared_hidden": 48,
    },
    "qwen3-30b-a3b": {
        **LLAMA_SMALL, "n_experts": 4, "top_k": 2, "moe_hidden": 32, "head_dim": 24,
    },
    "qwen3-235b-a22b": {
        **LLAMA_SMALL, "n_experts": 4, "top_k": 2, "moe_hidden": 32, "head_dim": 24,
    },
}  # fmt: skip

# Small sizes for the recurrent models and the transformers.
SMALL: dict[str, dict[str, Any]] = {
    "rnntc": {"steps": 5, "hidden": 32, "vocab": 100},
    "rnnlm": {"steps": 5, "hidden": 32, "vocab": 100},
    "nmt": {"src_steps": 4, "tgt_steps": 3, "hidden": 32, "src_vocab": 90, "tgt_vocab": 80},
    "transformer": {"seq": 16, "width": 32, "layers": 2, "heads": 4, "vocab": 100},
    **{name: GPT2_SMALL for name in GPT2S},
    **{name: LLAMA_SMALL for name in LLAMAS},
    **MOE_SMALL,
}
