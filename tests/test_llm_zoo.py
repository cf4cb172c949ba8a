"""GPT-2 and Llama as their reference code writes them: published parameter counts, analytic
FLOPs, equal outputs of the implementation variants, losses and gradients, build errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from planner.errors import LayerwiseError
from planner.graph.llm import (
    LLM_SIZES,
    GPT2Config,
    LlamaConfig,
    RMSNorm,
    build_llm,
    rotate_half,
)

# Published parameter counts (tied GPT-2 embeddings counted once, as torch's parameters() does).
PUBLISHED = {
    "gpt2": 124_439_808,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
}
# GPT-2 sizes as the paper and model cards round them, in millions.
GPT2_ROUNDED = {"gpt2": 124, "gpt2-medium": 355, "gpt2-large": 774, "gpt2-xl": 1558}
# Llama's published feed-forward widths (params.json of Meta's releases).
LLAMA_FFN = {"llama2-7b": 11008, "llama2-13b": 13824, "llama2-70b": 28672, "llama3-8b": 14336}

TINY: dict[str, dict[str, Any]] = {
    "gpt2": dict(vocab_size=97, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0),
    "llama2-7b": dict(
        vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=32
    ),
}


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def tiny(name: str, **overrides: Any) -> tuple[nn.Module, torch.Tensor]:
    """A 2-layer, width-64 model in float64 on CPU, with tokens of shape (2, 16)."""
    torch.manual_seed(0)
    model, (tokens,) = build_llm(name, device="cpu", batch=2, seq=16, **{**TINY[name], **overrides})
    return model.double(), tokens


def copy_of(source: nn.Module, name: str, **overrides: Any) -> tuple[nn.Module, torch.Tensor]:
    """A tiny model built with `overrides`, holding `source`'s weights."""
    model, tokens = tiny(name, **overrides)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    assert unexpected == [] and all(k.endswith(".attn.bias") for k in missing)  # GPT-2's mask
    return model, tokens


# -- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_published_parameter_counts(name: str) -> None:
    model, _ = build_llm(name)
    assert next(model.parameters()).device.type == "meta"
    assert n_params(model) == PUBLISHED[name]


@pytest.mark.parametrize("name", GPT2_ROUNDED)
def test_gpt2_counts_follow_the_formula_and_round_to_the_published_sizes(name: str) -> None:
    c = LLM_SIZES[name]
    assert isinstance(c, GPT2Config)
    d = c.n_embd
    # embeddings (the head shares wte), per block 2 LayerNorms + 12 d^2 weights + 9 d biases
    formula = (c.vocab_size + c.block_size) * d + c.n_layer * (12 * d * d + 13 * d) + 2 * d
    model, _ = build_llm(name)
    assert n_params(model) == formula
    assert round(formula / 1e6) == GPT2_ROUNDED[name]


@pytest.mark.parametrize("name", LLAMA_FFN)
def test_metas_ffn_rule_gives_the_published_widths(name: str) -> None:
    c = LLM_SIZES[name]
    assert isinstance(c, LlamaConfig) and c.hidden_dim is None
    assert c.ffn_hidden == LLAMA_FFN[name]
    model, _ = build_llm(name, n_layers=1, hidden_dim=1000)
    assert model.layers[0].feed_forward.w1.weight.shape == (1000, c.dim)


def test_gpt2_ties_its_head_and_llama_ties_on_request() -> None:
    gpt2, _ = build_llm("gpt2", n_layer=1)
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    untied, _ = build_llm("llama2-7b", n_layers=1)
    tied, _ = build_llm("llama2-7b", n_layers=1, tie_embeddings=True)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert n_params(untied) - n_params(tied) == 32000 * 4096


def test_the_models_are_plain_pytorch() -> None:
    for name in ("gpt2", "llama2-7b"):
        model, _ = tiny(name)
        assert not any(hasattr(m, "layerwise_kind") for m in model.modules())
        assert {type(m).__module__.split(".")[0] for m in model.modules()} == {"planner", "torch"}


# -- FLOPs on the meta device -------------------------------------------------------------------


def analytic_flops(config: GPT2Config | LlamaConfig, batch: int, seq: int) -> int:
    """Forward FLOPs: 2 per weight of every matmul (blocks and LM head) per token, plus the
    attention score (QK^T) and value (AV) matmuls, 2 * T * width each per token and layer."""
    if isinstance(config, GPT2Config):
        d, layers = config.n_embd, config.n_layer
        block = 12 * d * d  # c_attn 3 d^2, c_proj d^2, c_fc 4 d^2, MLP c_proj 4 d^2
    else:
        d, layers = config.dim, config.n_layers
        kv = config.kv_heads * (d // config.n_heads)
        block = 2 * d * d + 2 * d * kv + 3 * d * config.ffn_hidden  # wq wo, wk wv, w1 w2 w3
    per_token = 2 * (layers * block + config.vocab_size * d) + layers * 4 * seq * d
    return batch * seq * per_token


# FlopCounterMode counts matmuls only (mm, addmm, bmm: 2 FLOPs per multiply-add); a Linear's bias
# add, embeddings, norms, GELU/SiLU, softmax, masking, scaling and RoPE count 0. On the meta
# device F.scaled_dot_product_attention runs its math decomposition, so the counter sees its two
# bmm's, QK^T and AV, each 2*B*H*T*T*hd over the whole T x T square although is_causal masks half
# of it: the same as the explicit "buffer" and "ones" paths. (On CPU tensors torch 2.13 runs
# _scaled_dot_product_flash_attention_for_cpu, which the counter does not count at all.)
@pytest.mark.parametrize(
    "name, overrides",
    [
        ("gpt2", {}),
        ("gpt2", {"attention": "buffer"}),
        ("gpt2", {"attention": "ones", "n_layer": 3}),
        ("llama2-7b", {"n_layers": 2}),
        ("llama2-7b", {"n_layers": 2, "attention": "ones"}),
        ("llama2-70b", {"n_layers": 2}),
        ("llama3-8b", {"n_layers": 2}),
    ],
)
def test_forward_flops_match_the_analytic_count(name: str, overrides: dict[str, Any]) -> None:
    batch, seq = 2, 64
    model, (tokens,) = build_llm(name, batch=batch, seq=seq, **overrides)
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    assert counter.get_total_flops() == analytic_flops(model.config, batch, seq)


# -- tiny models on CPU in float64 --------------------------------------------------------------


# Meta's explicit attention takes its softmax in float32 (`scores.float()`), even in float64.
@pytest.mark.parametrize(
    "name, variant, atol",
    [("gpt2", "buffer", 1e-12), ("gpt2", "ones", 1e-12), ("llama2-7b", "ones", 1e-6)],
)
def test_the_attention_variants_give_the_same_logits(name: str, variant: str, atol: float) -> None:
    sdpa, tokens = tiny(name)
    other, _ = copy_of(sdpa, name, attention=variant)
    expected = sdpa(tokens)
    torch.testing.assert_close(other(tokens), expected, rtol=0, atol=atol)
    assert expected.shape == (2, 16, 97)


def test_the_hand_rmsnorm_equals_torchs() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64)
    hand, builtin = RMSNorm(64, eps=1e-5), nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hand.weight.normal_()
        builtin.weight.copy_(hand.weight)
    torch.testing.assert_close(hand(x), builtin(x), rtol=1e-6, atol=1e-6)
    # whole models in float32: Meta's RMSNorm computes in float32 (`x.float()`) even for float64
    model, tokens = tiny("llama2-7b")
    other, _ = copy_of(model, "llama2-7b", torch_rmsnorm=True)
    assert any(isinstance(m, nn.RMSNorm) for m in other.modules())
    torch.testing.assert_close(other.float()(tokens), model.float()(tokens), rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_full_attention_with_repeated_kv_heads() -> None:
    gqa, tokens = tiny("llama2-7b")  # 4 query heads, 2 key/value heads
    mha, _ = tiny("llama2-7b", n_kv_heads=4)
    state = gqa.state_dict()
    hd, rep = 64 // 4, 2
    for key, value in state.items():
        if key.endswith(("wk.weight", "wv.weight")):  # query head h reads kv head h // rep
            state[key] = value.view(2, hd, 64).repeat_interleave(rep, dim=0).reshape(64, 64)
    mha.load_state_dict(state)
    torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=0, atol=1e-12)


def test_rotate_half_is_metas_complex_rotary_with_the_channels_paired_by_halves() -> None:
    torch.manual_seed(0)
    model, _ = tiny("llama2-7b")
    seq, hd, theta = 16, 16, model.config.rope_theta
    x = torch.randn(seq, hd, dtype=torch.float64)
    cos, sin = model.rotary_emb(x, seq)
    hf = x * cos + rotate_half(x) * sin
    # Meta's precompute_freqs_cis / apply_rotary_emb rotate channel pairs (2i, 2i+1)
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    pairs = torch.stack((x[:, : hd // 2], x[:, hd // 2 :]), dim=-1)  # (x_i, x_{i + hd/2})
    meta = torch.view_as_real(
        torch.view_as_complex(pairs) * torch.polar(torch.ones_like(angles), angles)
    )
    torch.testing.assert_close(
        hf, torch.cat((meta[..., 0], meta[..., 1]), dim=-1), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("name", TINY)
def test_the_loss_is_the_cross_entropy_of_the_logits_and_backward_reaches_every_weight(
    name: str,
) -> None:
    model, tokens = tiny(name)
    targets = torch.roll(tokens, -1, dims=1)
    logits, loss = model(tokens, targets)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
    log_probs = torch.log_softmax(logits, dim=-1)
    expected = -log_probs.gather(-1, targets.unsqueeze(-1)).mean()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    assert math.isfinite(loss.item())
    loss.backward()
    for key, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, key


def test_gpt2s_initial_loss_is_that_of_a_uniform_guess() -> None:
    model, tokens = tiny("gpt2")
    _, loss = model(tokens, torch.roll(tokens, -1, dims=1))
    assert abs(loss.item() - math.log(97)) < 0.1


# -- building -----------------------------------------------------------------------------------


def test_build_llm_gives_a_training_model_and_token_ids() -> None:
    model, (tokens,) = build_llm("llama3-8b", batch=3)
    assert model.training and tokens.dtype == torch.long and tokens.device.type == "meta"
    assert tokens.shape == (3, 8192)
    model, tokens = tiny("gpt2")
    assert tokens.shape == (2, 16) and tokens.min() >= 0 and tokens.max() < 97


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: build_llm("gpt3"), "unknown model 'gpt3'; available models: gpt2, gpt2-medium"),
        (lambda: build_llm("gpt2", n_layers=2), "no option 'n_layers'; valid options: .*n_layer"),
        (lambda: build_llm("gpt2", seq=1025), "seq 1025 is longer than 'gpt2'.s context of 1024"),
        (lambda: build_llm("llama2-7b", seq=0), "seq must be a positive integer, got 0"),
        (lambda: build_llm("gpt2", n_embd=100), "n_embd 100 is not divisible by n_head 12"),
        (lambda: build_llm("llama2-7b", n_kv_heads=5), "not a multiple of n_kv_heads 5"),
        (lambda: build_llm("gpt2", attention="flash"), "attention must be one of sdpa, buffer"),
        (lambda: build_llm("llama2-7b", attention="buffer"), "attention must be one of sdpa, ones"),
        (lambda: build_llm("gpt2", n_layer="2"), "n_layer must be a positive integer, got '2'"),
    ],
)
def test_bad_names_and_sizes_raise_a_layerwise_error(call: Any, message: str) -> None:
    with pytest.raises(LayerwiseError, match=message):
        call()


def test_gpt2_refuses_a_sequence_longer_than_its_block() -> None:
    model, tokens = tiny("gpt2")
    with pytest.raises(LayerwiseError, match="length 33: block size is 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("name", ["gpt2", "llama2-7b"])
def test_a_bf16_model_is_captured_with_two_byte_tensors(name: str) -> None:
    from planner.graph.capture import capture

    module, inputs = build_llm(name, dtype="bfloat16", batch=2, seq=16, **TINY[name])
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    graph = capture(module, inputs, name)
    floating = [op for op in graph.ops if op.kind not in ("input",)]
    assert {op.output.dtype_bytes for op in floating} == {2}
    assert {p.dtype_bytes for op in graph.ops for p in op.params} == {2}
    with pytest.raises(LayerwiseError, match="dtype must be one of float32, bfloat16, float16"):
        build_llm(name, dtype="fp8", **TINY[name])


# -- mixtures of experts ------------------------------------------------------------------------

MOE_PUBLISHED = {  # HF config.json shapes; mistral.ai: 46.7B, Qwen's card: 14.3B
    "mixtral-8x7b": 46_702_792_704,
    "qwen-moe-like": 14_315_784_192,
}
MOE_TINY: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(n_experts=4, top_k=2, moe_hidden=48),
    "deepseek-v3-like": dict(
        n_experts=8, top_k=2, moe_hidden=16, n_groups=4, topk_groups=2, first_dense=1,
        hidden_dim=96,
    ),
    "qwen-moe-like": dict(n_experts=6, top_k=2, moe_hidden=16, shared_hidden=32),
}  # fmt: skip


def moe_tiny(name: str) -> tuple[nn.Module, torch.Tensor]:
    model, (tokens,) = build_llm(
        name, device="cpu", batch=2, seq=16, **{**TINY["llama2-7b"], **MOE_TINY[name]}
    )
    return model.double(), tokens


@pytest.mark.parametrize("name", MOE_PUBLISHED)
def test_the_moe_parameter_counts(name: str) -> None:
    model, _ = build_llm(name)
    assert next(model.parameters()).device.type == "meta"
    assert n_params(model) == MOE_PUBLISHED[name]
    assert round(n_params(model) / 1e8) / 10 == {"mixtral-8x7b": 46.7, "qwen-moe-like": 14.3}[name]


def test_mixtral_activates_12_9b_parameters_per_token() -> None:
    model, _ = build_llm("mixtral-8x7b")
    c = model.config
    idle = c.n_layers * (c.n_experts - c.top_k) * 3 * c.dim * c.moe_hidden
    assert n_params(model) - idle == 12_879_925_248  # mistral.ai: 12.9B active


def test_deepseek_v3_likes_moe_part_is_the_published_architectures() -> None:
    """58 MoE layers of 256 routed + 1 shared expert (3 x 7168 x 2048 each), the router
    (256 x 7168) and its selection bias (256, a parameter as in DeepSeek's code); the rest:
    untied embeddings, 3 dense SwiGLU layers of 18432, and (instead of MLA) 61 layers of
    multi-head attention of 4 x 7168^2 with 2 RMSNorms."""
    model, _ = build_llm("deepseek-v3-like")
    moe = sum(
        p.numel() for n, p in model.named_parameters() if ".feed_forward." in n
        and int(n.split(".")[1]) >= 3
    )  # fmt: skip
    assert moe == 58 * (257 * 3 * 7168 * 2048 + 256 * 7168 + 256) == 656_569_547_264
    d = 7168
    rest = 2 * 129280 * d + d + 61 * (4 * d * d + 2 * d) + 3 * 3 * d * 18432
    assert n_params(model) == moe + rest


@pytest.mark.parametrize("name", MOE_TINY)
def test_tiny_moes_train_and_every_expert_weight_gets_a_gradient(name: str) -> None:
    torch.manual_seed(0)
    model, tokens = moe_tiny(name)
    targets = torch.roll(tokens, -1, dims=1)
    logits, loss = model(tokens, targets)
    assert logits.shape == (2, 16, 97) and logits.dtype == torch.float64
    loss.backward()
    for key, p in model.named_parameters():
        if key.endswith("gate.bias"):  # DeepSeek's selection bias: chooses, never weighs
            assert p.grad is None
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, key


def test_the_moe_models_are_plain_pytorch() -> None:
    for name in MOE_TINY:
        model, _ = moe_tiny(name)
        assert not any(hasattr(m, "layerwise_kind") for m in model.modules())
        assert {type(m).__module__.split(".")[0] for m in model.modules()} == {"planner", "torch"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (dict(top_k=9), "top_k 9 is more than the 8 experts"),
        (dict(n_groups=3), "n_groups 3 must divide n_experts 8"),
        (dict(moe="switch"), "moe must be one of mixtral, deepseek, qwen"),
        (dict(first_dense=33), "first_dense must be between 0 and n_layers 32"),
    ],
)
def test_bad_moe_sizes_raise_a_layerwise_error(override: dict[str, Any], message: str) -> None:
    with pytest.raises(LayerwiseError, match=message):
        build_llm("mixtral-8x7b", **override)
