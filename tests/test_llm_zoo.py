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
    MLA,
    GPT2Config,
    LlamaConfig,
    MoEConfig,
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

MOE_PUBLISHED = {  # HF config.json shapes; mistral.ai: 46.7B, Qwen's cards: 14.3B, 30.5B, 235B
    "mixtral-8x7b": 46_702_792_704,
    "qwen-moe-like": 14_315_784_192,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "deepseek-v3-like": 671_026_419_200,  # the report's 671B (its MTP module not built)
}
MOE_ROUNDED = {  # billions, as published
    "mixtral-8x7b": 46.7,
    "qwen-moe-like": 14.3,
    "qwen3-30b-a3b": 30.5,
    "qwen3-235b-a22b": 235.1,
    "deepseek-v3-like": 671.0,
}
MOE_TINY: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(n_experts=4, top_k=2, moe_hidden=48),
    "deepseek-v3-like": dict(
        n_experts=8, top_k=2, moe_hidden=16, n_groups=4, topk_groups=2, first_dense=1,
        hidden_dim=96, n_kv_heads=None, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=4, v_head_dim=8,
    ),
    "qwen-moe-like": dict(n_experts=6, top_k=2, moe_hidden=16, shared_hidden=32),
    "qwen3-30b-a3b": dict(n_experts=6, top_k=2, moe_hidden=16, head_dim=24),
}  # fmt: skip


def moe_tiny(name: str, **overrides: Any) -> tuple[nn.Module, torch.Tensor]:
    model, (tokens,) = build_llm(
        name, device="cpu", batch=2, seq=16, **{**TINY["llama2-7b"], **MOE_TINY[name], **overrides}
    )
    return model.double(), tokens


BIG = ("qwen3-235b-a22b",)  # ~5 s to build on meta: in the slow run


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in BIG else n for n in MOE_PUBLISHED]
)
def test_the_moe_parameter_counts(name: str) -> None:
    model, _ = build_llm(name)
    assert next(model.parameters()).device.type == "meta"
    assert n_params(model) == MOE_PUBLISHED[name]
    assert round(n_params(model) / 1e8) / 10 == MOE_ROUNDED[name]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_qwen3_counts_follow_the_hugging_face_config(name: str) -> None:
    """Per layer: q and o of heads x head_dim (not the width: 32 x 128 = 4096 for a width of
    2048), k and v of 4 heads, the two QK-norm weights (head_dim each), 2 RMSNorms, the
    router and 128 SwiGLU experts; untied embeddings and a final norm."""
    c = LLM_SIZES[name]
    assert isinstance(c, MoEConfig) and c.head_dim == 128 and c.n_heads * 128 != c.dim
    h, d = c.dim, c.head_size
    attention = 2 * h * c.n_heads * d + 2 * h * c.kv_heads * d + 2 * d
    layer = attention + 2 * h + c.n_experts * h + c.n_experts * 3 * h * c.moe_hidden
    formula = c.n_layers * layer + 2 * c.vocab_size * h + h
    assert formula == MOE_PUBLISHED[name]
    model, _ = build_llm(name, n_layers=1)
    attn = model.layers[0].attention
    assert attn.wq.weight.shape == (c.n_heads * 128, h)
    assert attn.wo.weight.shape == (h, c.n_heads * 128)  # heads x head_dim -> the width
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (128,)
    assert not hasattr(model.layers[0].feed_forward, "shared_expert")


def test_mixtral_activates_12_9b_parameters_per_token() -> None:
    model, _ = build_llm("mixtral-8x7b")
    c = model.config
    idle = c.n_layers * (c.n_experts - c.top_k) * 3 * c.dim * c.moe_hidden
    assert n_params(model) - idle == 12_879_925_248  # mistral.ai: 12.9B active


@pytest.mark.slow  # builds the 671B model again (~5 s); its total is checked by default
def test_deepseek_v3_likes_moe_part_is_the_published_architectures() -> None:
    """58 MoE layers of 256 routed + 1 shared expert (3 x 7168 x 2048 each), the router
    (256 x 7168) and its selection bias (256, a parameter as in DeepSeek's code); the rest:
    untied embeddings, 3 dense SwiGLU layers of 18432, and 61 layers of multi-head latent
    attention (HF config: q_lora_rank 1536, kv_lora_rank 512, 128 heads of 128 + 64 rotary
    q/k channels and 128 v channels, with the q and kv latents' RMSNorms) with 2 RMSNorms:
    671,026,419,200, DeepSeek-V3's 671B (its 14B multi-token-prediction module not built)."""
    model, _ = build_llm("deepseek-v3-like")
    moe = sum(
        p.numel() for n, p in model.named_parameters() if ".feed_forward." in n
        and int(n.split(".")[1]) >= 3
    )  # fmt: skip
    assert moe == 58 * (257 * 3 * 7168 * 2048 + 256 * 7168 + 256) == 656_569_547_264
    d, heads, q_rank, kv_rank, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    mla = (
        d * q_rank + q_rank + q_rank * heads * (nope + rope)  # wq_a, q_norm, wq_b
        + d * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)  # wkv_a, kv_norm, wkv_b
        + heads * v * d  # wo
    )  # fmt: skip
    assert mla == 187_107_328
    rest = 2 * 129280 * d + d + 61 * (mla + 2 * d) + 3 * 3 * d * 18432
    assert n_params(model) == moe + rest == 671_026_419_200


def _absorbed_mla(attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # type: ignore[no-untyped-def]
    """DeepSeek-V3's other form of MLA (inference/model.py, attn_impl "absorb"): wkv_b's key
    half folded into q and its value half applied after the attention, scores over the
    kv_norm'd latent plus the rotary parts; no per-head keys or values formed."""
    b, t, _ = x.shape
    heads, nope, rope, v = (
        attn.n_heads,
        attn.qk_nope_head_dim,
        attn.qk_rope_head_dim,
        attn.v_head_dim,
    )
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(b, t, heads, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    latent, k_pe = attn.wkv_a(x).split([attn.kv_lora_rank, rope], dim=-1)
    latent = attn.kv_norm(latent)
    q_pe = q_pe * cos[:, None] + rotate_half(q_pe) * sin[:, None]
    k_pe = k_pe * cos + rotate_half(k_pe) * sin
    wkv_b = attn.wkv_b.weight.view(heads, nope + v, attn.kv_lora_rank)
    q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :nope])
    scores = torch.einsum("bshc,btc->bsht", q_nope, latent)
    scores = (scores + torch.einsum("bshr,btr->bsht", q_pe, k_pe)) * attn.softmax_scale
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future[:, None, :], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bsht,btc->bshc", scores, latent)
    out = torch.einsum("bshc,hdc->bshd", out, wkv_b[:, -v:])
    return attn.wo(out.flatten(2))


@pytest.mark.parametrize("attention", ["sdpa", "ones"])
def test_deepseek_v3_likes_mla_equals_deepseeks_absorbed_form(attention: str) -> None:
    """The zoo writes MLA in DeepSeek's naive form (per-head keys and values, SDPA over q/k
    heads of nope + rope channels and v heads of v_head_dim); its absorbed form from the same
    weights computes the same attention."""
    model, tokens = moe_tiny("deepseek-v3-like", attention=attention)
    attn = model.layers[0].attention
    assert isinstance(attn, MLA) and attn.softmax_scale == (12 + 4) ** -0.5
    x = model.layers[0].attention_norm(model.tok_embeddings(tokens))
    cos, sin = model.rotary_emb(x, tokens.shape[1])
    assert cos.shape == (16, 4)  # the rotary part only
    atol = 1e-12 if attention == "sdpa" else 1e-6  # "ones": the softmax in float32
    torch.testing.assert_close(
        attn(x, cos, sin), _absorbed_mla(attn, x, cos, sin), rtol=0, atol=atol
    )


def test_qwen3s_qk_norm_normalises_each_head_before_the_rotary_embedding() -> None:
    """With QK-norm weights of ones and no epsilon, every q and k head reaches the rotary
    embedding with unit RMS, whatever the projection's scale."""
    model, tokens = moe_tiny("qwen3-30b-a3b")
    attn = model.layers[0].attention
    seen = {}
    attn.q_norm.register_forward_hook(lambda m, i, o: seen.setdefault("q", o))
    attn.k_norm.register_forward_hook(lambda m, i, o: seen.setdefault("k", o))
    with torch.no_grad():
        attn.wq.weight.mul_(100.0)
    model(tokens)
    assert all(bool((n.weight == 1).all()) for n in (attn.q_norm, attn.k_norm))  # as built
    for out in seen.values():
        assert out.shape[-2:] == (4 if out is seen["q"] else 2, 24)  # per head
        rms = out.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=0, atol=1e-5)


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
