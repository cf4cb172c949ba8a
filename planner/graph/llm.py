"""Decoder-only language models written the way their authors' reference code writes them.

- `GPT2` follows nanoGPT's model.py (Karpathy), itself a port of OpenAI's GPT-2 and Hugging
  Face's GPT2LMHeadModel: fused `c_attn`, learned positions, pre-LN blocks, tanh GELU, the LM
  head tied to the token embedding, nanoGPT's initialisation. The embeddings and blocks sit in
  a `GPT2Model` named `transformer` as in Hugging Face (nanoGPT's ModuleDict there has the
  same parameter names, e.g. `transformer.h.0.attn.c_attn.weight`).
- `Llama` follows Meta's reference llama/model.py (RMSNorm, SwiGLU feed-forward and its
  hidden-size rule, grouped-query attention, no biases) with the rotary embedding in Hugging
  Face's real-valued form (modeling_llama.py: `rotate_half`, cached cos/sin tables).
- `MoETransformer` is that Llama with mixture-of-experts feed-forwards written as Mixtral's,
  DeepSeek-V3's, Qwen1.5-MoE's and Qwen3-MoE's reference code writes them (`MoEConfig`), and
  the attention of today's MoE models: heads sized apart from the width and QK-norm
  (Qwen3, `head_dim`, `qk_norm`), DeepSeek-V3's multi-head latent attention (`MLA`).

Plain PyTorch: nothing here is written for the planner (no leaf modules, no op kinds), and the
models are not in `zoo.MODELS`. `LLM_SIZES` holds the published sizes; `build_llm` builds one
(on the meta device by default: no memory, no compute) with example token inputs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from planner.errors import LayerwiseError, given

__all__ = [
    "GPT2",
    "LLM_SIZES",
    "GPT2Config",
    "GPT2Model",
    "Llama",
    "LlamaConfig",
    "MLA",
    "MoEConfig",
    "MoETransformer",
    "RMSNorm",
    "DTYPES",
    "build_llm",
    "ffn_hidden_dim",
    "repeat_kv",
    "rotate_half",
]

GPT2_ATTENTION = ("sdpa", "buffer", "ones")
LLAMA_ATTENTION = ("sdpa", "ones")
LLAMA_MLP = ("swiglu", "relu2")


def _check_sizes(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayerwiseError(f"{name} must be a positive integer, got {given(value)}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise LayerwiseError(f"{name} must be one of {', '.join(choices)}, got {given(value)}")


def _check_dropout(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise LayerwiseError(f"dropout must be a number in [0, 1), got {given(value)}")


# -- GPT-2 (nanoGPT) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2's sizes (defaults: the 124M model) and how its attention is computed.

    `attention`: "sdpa" (`F.scaled_dot_product_attention` with `is_causal`), "buffer" (explicit
    softmax masked by nanoGPT's registered tril buffer) or "ones" (explicit softmax, the mask
    built in forward). `dropout` 0.1 is GPT-2's (Hugging Face's GPT2Config; nanoGPT's default
    is 0.0). `bias`: biases in the Linears and LayerNorms (GPT-2 has them)."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.1
    bias: bool = True
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        _check_sizes(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head:
            raise LayerwiseError(
                f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}: "
                "choose a width that is a multiple of the head count"
            )
        _check_dropout(self.dropout)
        _check_choice("attention", self.attention, GPT2_ATTENTION)


class CausalSelfAttention(nn.Module):
    bias: torch.Tensor  # the causal mask buffer of the "buffer" variant

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        # key, query, value projections for all heads, in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attention = config.attention
        if self.attention == "buffer":
            size = config.block_size
            mask = torch.tril(torch.ones(size, size)).view(1, 1, size, size)
            self.register_buffer("bias", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, embedding width (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.attention == "sdpa":
            dropout_p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=dropout_p, is_causal=True
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            if self.attention == "buffer":
                att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            else:
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """GPT-2's embeddings and blocks (Hugging Face's GPT2Model): hidden states (B, T, n_embd)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The final LayerNorm's output for token ids `idx` (B, T)."""
        b, t = idx.size()
        if t > self.block_size:
            raise LayerwiseError(
                f"cannot forward a sequence of length {t}: block size is {self.block_size}"
            )
        pos = torch.arange(t, device=idx.device)  # shape (t)
        tok_emb = self.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.wpe(pos)  # position embeddings of shape (t, n_embd)
        x = self.drop(tok_emb + pos_emb)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2(nn.Module):
    """GPT-2 as nanoGPT writes it; `forward(idx)` gives logits (B, T, vocab),
    `forward(idx, targets)` gives (logits, mean cross-entropy)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # weight tying as GPT-2 does: one matrix embeds the tokens and scores them
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 paper: residual projections scaled by 1/sqrt(number of residual layers)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for token ids `idx` (B, T); with `targets` (B, T), also their loss."""
        logits = self.lm_head(self.transformer(idx))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# -- Llama (Meta's reference, Hugging Face's rotary form) ---------------------------------------


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Llama's SwiGLU hidden size as Meta's reference computes it: 2/3 of 4 * dim, times
    `ffn_dim_multiplier` if given, rounded up to a multiple of `multiple_of`."""
    hidden_dim = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


@dataclass(frozen=True)
class LlamaConfig:
    """Llama's sizes (defaults: Llama-2 7B) and implementation choices.

    `n_kv_heads` None means n_heads (no grouped-query attention). The feed-forward width is
    `hidden_dim` if given, else Meta's rule `ffn_hidden_dim(dim, multiple_of,
    ffn_dim_multiplier)`. `attention`: "sdpa" or "ones" (explicit softmax with a mask built in
    forward). `torch_rmsnorm`: `nn.RMSNorm` instead of the hand-written `RMSNorm`. `mlp`:
    "swiglu" (Llama's gated SiLU, three linears) or "relu2" (squared ReLU, not gated, two
    linears: Nemotron-4's). `head_dim`: channels per q, k and v head (None: dim // n_heads;
    Qwen3 has heads x head_dim != dim, and the output projection maps heads x head_dim back
    to dim). `qk_norm`: each q and k head RMS-normed over its head_dim channels (one weight
    per projection, shared by the heads) before the rotary embedding, as Qwen3 does."""

    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    hidden_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention: str = "sdpa"
    torch_rmsnorm: bool = False
    mlp: str = "swiglu"
    head_dim: int | None = None
    qk_norm: bool = False

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len")
        _check_sizes(self, sizes + ("n_kv_heads",) * (self.n_kv_heads is not None))
        _check_sizes(self, ("hidden_dim",) * (self.hidden_dim is not None))
        _check_sizes(self, ("head_dim",) * (self.head_dim is not None))
        if self.head_dim is not None and self.head_dim % 2:
            raise LayerwiseError(
                f"head_dim must be even (rotary embeddings rotate pairs of channels), got "
                f"{self.head_dim}"
            )
        if self.head_dim is None and (self.dim % self.n_heads or (self.dim // self.n_heads) % 2):
            raise LayerwiseError(
                f"dim {self.dim} must be n_heads {self.n_heads} times an even head size "
                "(rotary embeddings rotate pairs of channels), or give head_dim"
            )
        if self.n_heads % self.kv_heads:
            raise LayerwiseError(
                f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}: "
                "each key/value head serves a whole group of query heads"
            )
        _check_choice("attention", self.attention, LLAMA_ATTENTION)
        _check_choice("mlp", self.mlp, LLAMA_MLP)

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_size(self) -> int:
        """Channels per q, k and v head."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Channels per head the rotary embedding turns."""
        return self.head_size

    @property
    def ffn_hidden(self) -> int:
        """The feed-forward (SwiGLU) hidden width."""
        if self.hidden_dim is not None:
            return self.hidden_dim
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm as Meta's reference writes it (computed in float32)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` normalised over its last dimension, scaled by the weight."""
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class RotaryEmbedding(nn.Module):
    """Cached cos/sin tables of rotary position embeddings (Hugging Face's Llama form)."""

    cos_cached: torch.Tensor
    sin_cached: torch.Tensor

    def __init__(self, dim: int, max_position_embeddings: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        t = torch.arange(max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_position_embeddings, dim)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables of positions 0..seq_len-1, in `x`'s dtype."""
        return (
            self.cos_cached[:seq_len].to(dtype=x.dtype),
            self.sin_cached[:seq_len].to(dtype=x.dtype),
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input: (x1, x2) -> (-x2, x1)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys (B, heads, T, head_dim) rotated by their positions' angles."""
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, kv_heads, T, head_dim) -> (B, kv_heads * n_rep, T, head_dim), each key/value head
    repeated for its group of query heads (query head h reads key/value head h // n_rep)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(
        batch, num_key_value_heads, n_rep, slen, head_dim
    )
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    """Grouped-query attention (Meta's reference), with Qwen's q/k/v biases (`qkv_bias`) and
    Qwen3's head size and QK-norm as Hugging Face's modeling_qwen3.py writes them: heads of
    `head_dim` (heads x head_dim may differ from dim), q and k RMS-normed per head on their
    (batch, length, heads, head_dim) view, before the transpose and the rotary embedding."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = config.head_size
        self.attention = config.attention
        bias = bool(getattr(config, "qkv_bias", False))  # Qwen's q, k, v have biases
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = _norm(config, self.head_dim)
            self.k_norm = _norm(config, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = xq.transpose(1, 2), xk.transpose(1, 2)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        xq, xk = apply_rotary_pos_emb(xq, xk, cos, sin)
        keys = repeat_kv(xk, self.n_rep)  # (bs, n_heads, seqlen, head_dim)
        values = repeat_kv(xv, self.n_rep)
        if self.attention == "sdpa":
            output = F.scaled_dot_product_attention(xq, keys, values, is_causal=True)
        else:
            scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
            mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            scores = F.softmax(scores.float(), dim=-1).type_as(xq)
            output = torch.matmul(scores, values)  # (bs, n_heads, seqlen, head_dim)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, mlp: str = "swiglu") -> None:
        super().__init__()
        self.gated = mlp == "swiglu"
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        if self.gated:
            self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:  # squared ReLU (Nemotron-4)
            r = F.relu(self.w1(x))
            return self.w2(r * r)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V3 technical report, arXiv 2412.19437, Sec. 2.1.1,
    Eqs. 1-11) as DeepSeek-V3's reference writes it (inference/model.py
    `MLA` with attn_impl "naive": keys and values up-projected per head, no weight
    absorption), its tensors laid out (batch, heads, length, head) and its rotary embedding
    in the rotate-half form, as Hugging Face's modeling_deepseek_v3.py writes them (the
    reference's interleaved complex rotation is the same up to a fixed order of the rotary
    channels, that is of wq_b's and wkv_a's rows).

    q = wq_b(q_norm(wq_a(x))) per head (nope | rope); wkv_a(x) = (latent | k_pe), k_pe one
    rotary key shared by the heads; wkv_b(kv_norm(latent)) per head (k_nope | v); scores over
    the q/k heads of qk_nope_head_dim + qk_rope_head_dim, values of v_head_dim, scaled by
    1/sqrt(q/k head) (the reference's YaRN factor applies only beyond the pre-training
    context, max_seq_len > 4096); wo maps heads x v_head_dim back to dim."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert isinstance(config, MoEConfig)
        self.dim = config.dim
        self.n_heads = config.n_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.attention = config.attention
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(self.dim, self.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(self.dim, self.q_lora_rank, bias=False)
            self.q_norm = _norm(config, self.q_lora_rank)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(self.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = _norm(config, self.kv_lora_rank)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, self.dim, bias=False)
        self.softmax_scale = self.qk_head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, self.n_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.view(bsz, 1, seqlen, self.qk_rope_head_dim)  # one rotary key for all heads
        q_pe, k_pe = apply_rotary_pos_emb(q_pe, k_pe, cos, sin)
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv))
        kv = kv.view(bsz, seqlen, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(
            kv.transpose(1, 2), [self.qk_nope_head_dim, self.v_head_dim], dim=-1
        )
        k = torch.cat([k_nope, k_pe.expand(-1, self.n_heads, -1, -1)], dim=-1)
        if self.attention == "sdpa":  # q, k of qk_head_dim; v of v_head_dim
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        else:
            scores = torch.matmul(q, k.transpose(2, 3)) * self.softmax_scale
            mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            scores = F.softmax(scores.float(), dim=-1).type_as(q)
            out = torch.matmul(scores, v)  # (bsz, n_heads, seqlen, v_head_dim)
        out = out.transpose(1, 2).contiguous().view(bsz, seqlen, -1)  # the reference: flatten(2)
        return self.wo(out)


def _norm(config: LlamaConfig, width: int | None = None) -> nn.Module:
    """An RMS norm over `width` channels (default: the model's width)."""
    width = config.dim if width is None else width
    if config.torch_rmsnorm:
        return nn.RMSNorm(width, eps=config.norm_eps)
    return RMSNorm(width, eps=config.norm_eps)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, feed_forward: nn.Module | None = None) -> None:
        super().__init__()
        self.attention: nn.Module = (
            MLA(config) if getattr(config, "mla", False) else LlamaAttention(config)
        )
        if feed_forward is None:
            feed_forward = FeedForward(config.dim, config.ffn_hidden, config.mlp)
        self.feed_forward = feed_forward
        self.attention_norm = _norm(config)
        self.ffn_norm = _norm(config)
        # Hugging Face's sparse MoE blocks return (hidden states, router logits)
        self.router_logits = isinstance(
            feed_forward, Qwen2MoeSparseMoeBlock | Qwen3MoeSparseMoeBlock
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        if self.router_logits:
            out, _router_logits = self.feed_forward(self.ffn_norm(h))  # no auxiliary loss
            return h + out
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama (2 and 3) as Meta's reference writes it, rotary in Hugging Face's form;
    `forward(tokens)` gives logits (B, T, vocab), `forward(tokens, targets)` gives (logits,
    mean cross-entropy)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rotary_emb = RotaryEmbedding(config.rope_dim, config.max_seq_len, config.rope_theta)
        self.layers = nn.ModuleList(self.block(config, i) for i in range(config.n_layers))
        self.norm = _norm(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def block(self, config: LlamaConfig, layer_id: int) -> nn.Module:
        """Layer `layer_id`: attention and a dense feed-forward."""
        return TransformerBlock(config)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits for token ids `tokens` (B, T); with `targets` (B, T), also their loss."""
        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)
        cos, sin = self.rotary_emb(h, seqlen)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        logits = self.output(h)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


# -- mixtures of experts (Mixtral, DeepSeek-V3, Qwen-MoE) ---------------------------------------

MOE_STYLES = ("mixtral", "deepseek", "qwen", "qwen3")
SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama-style decoder whose feed-forward is a mixture of experts (defaults: Mixtral
    8x7B's MoE sizes), written as its authors' reference code writes the block (`moe`):

    - "mixtral": Mistral's reference `MoeLayer` (mistral-src moe.py): a gate linear, top-k of
      the logits, softmax over the k, a loop over the experts with `torch.where`.
    - "deepseek": DeepSeek-V3's reference `Gate` and `MoE` (DeepSeek-V3 inference/model.py):
      sigmoid (or softmax) scores, a selection bias, group-limited routing (`n_groups`,
      `topk_groups`, groups ranked by their two best biased scores), the chosen scores
      normalised and scaled by `route_scale`, `bincount` then `torch.where` per expert, plus
      `n_shared` shared experts as one MLP of width n_shared x moe_hidden.
    - "qwen": Hugging Face's Qwen2MoeSparseMoeBlock (Qwen1.5-MoE): softmax over E, top-k,
      normalised when `norm_topk`, a shared expert of width `shared_hidden` with a sigmoid gate
      (h -> 1); it returns (hidden states, router logits).
    - "qwen3": Hugging Face's Qwen3MoeSparseMoeBlock (Qwen3-MoE): the same without the shared
      expert.

    Layers below `first_dense` keep a dense feed-forward of width `ffn_hidden` (DeepSeek-V3's
    first 3 layers). `qkv_bias`: biases on q, k and v (Qwen). The gate weights are computed in
    the input's dtype (the references take the softmax in float32), so that a float64 model
    computes exactly what the `moe` op's kernel does.

    `mla`: multi-head latent attention (`MLA`, DeepSeek-V2/V3) instead of grouped-query
    attention, of sizes `q_lora_rank` (0: q projected from the input by one linear),
    `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim` (the rotary part of each q and k
    head) and `v_head_dim` (defaults: DeepSeek-V3's)."""

    moe: str = "mixtral"
    n_experts: int = 8
    top_k: int = 2
    moe_hidden: int = 14336
    n_shared: int = 0
    shared_hidden: int = 0
    score_func: str = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0
    n_groups: int = 1
    topk_groups: int = 1
    first_dense: int = 0
    qkv_bias: bool = False
    mla: bool = False
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_sizes(self, ("n_experts", "top_k", "moe_hidden", "n_groups", "topk_groups"))
        if self.mla:
            self._check_mla()
        _check_choice("moe", self.moe, MOE_STYLES)
        _check_choice("score_func", self.score_func, SCORE_FUNCS)
        if self.top_k > self.n_experts:
            raise LayerwiseError(
                f"top_k {self.top_k} is more than the {self.n_experts} experts: choose top_k "
                "<= n_experts"
            )
        if self.n_experts % self.n_groups or self.topk_groups > self.n_groups:
            raise LayerwiseError(
                f"n_groups {self.n_groups} must divide n_experts {self.n_experts} and "
                f"topk_groups {self.topk_groups} be at most n_groups"
            )
        if not 0 <= self.first_dense <= self.n_layers:
            raise LayerwiseError(
                f"first_dense must be between 0 and n_layers {self.n_layers}, got "
                f"{given(self.first_dense)}"
            )

    def _check_mla(self) -> None:
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        _check_sizes(self, mla)
        q_rank = self.q_lora_rank
        if isinstance(q_rank, bool) or not isinstance(q_rank, int) or q_rank < 0:
            raise LayerwiseError(
                f"q_lora_rank must be a non-negative integer (0: no query compression), got "
                f"{given(q_rank)}"
            )
        if self.qk_rope_head_dim % 2:
            raise LayerwiseError(
                f"qk_rope_head_dim must be even (rotary embeddings rotate pairs of channels), "
                f"got {self.qk_rope_head_dim}"
            )
        others = {
            "n_kv_heads": self.n_kv_heads is not None and self.n_kv_heads != self.n_heads,
            "head_dim": self.head_dim is not None,
            "qk_norm": self.qk_norm,
            "qkv_bias": self.qkv_bias,
        }
        if any(others.values()):
            names = ", ".join(k for k, v in others.items() if v)
            raise LayerwiseError(
                f"multi-head latent attention (mla) has no {names}: its heads are sized by "
                "qk_nope_head_dim, qk_rope_head_dim and v_head_dim, one key/value head per "
                "query head"
            )

    @property
    def rope_dim(self) -> int:
        """Channels per head the rotary embedding turns (MLA: qk_rope_head_dim)."""
        return self.qk_rope_head_dim if self.mla else self.head_size


@dataclass(frozen=True)
class MoeArgs:
    """Mistral's MoE arguments (mistral-src moe.py)."""

    num_experts: int
    num_experts_per_tok: int


class MoeLayer(nn.Module):
    """Mixtral's sparse block as Mistral's reference writes it."""

    def __init__(self, experts: Sequence[nn.Module], gate: nn.Module, moe_args: MoeArgs) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.args = moe_args

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        inputs_squashed = inputs.view(-1, inputs.shape[-1])
        gate_logits = self.gate(inputs_squashed)
        weights, selected_experts = torch.topk(gate_logits, self.args.num_experts_per_tok)
        weights = F.softmax(weights, dim=1).type_as(inputs)  # reference: dtype=torch.float
        results = torch.zeros_like(inputs_squashed)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(
                inputs_squashed[batch_idx]
            )
        return results.view_as(inputs)


class Gate(nn.Module):
    """DeepSeek-V3's router (inference/model.py `Gate`). Its selection bias (the report's
    auxiliary-loss-free balancing bias, Sec. 2.1.2) is a parameter as in DeepSeek's code
    (`self.bias = nn.Parameter(...)`); it only shifts which experts are chosen, so no gradient
    reaches it (the report adjusts it by a fixed step per batch, outside the optimizer)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.dim = config.dim
        self.topk = config.top_k
        self.n_groups = config.n_groups
        self.topk_groups = config.topk_groups
        self.score_func = config.score_func
        self.route_scale = config.route_scale
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.dim))
        self.bias = nn.Parameter(torch.zeros(config.n_experts))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # as nn.Linear initialises

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight)
        # the reference's softmax is in float32 (dtype=torch.float32)
        scores = scores.softmax(dim=-1) if self.score_func == "softmax" else scores.sigmoid()
        original_scores = scores
        scores = scores + self.bias
        if self.n_groups > 1:
            scores = scores.view(x.size(0), self.n_groups, -1)
            group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
            indices = group_scores.topk(self.topk_groups, dim=-1)[1]
            mask = scores.new_ones(x.size(0), self.n_groups, dtype=torch.bool)
            mask = mask.scatter(1, indices, False)
            scores = scores.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.topk, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        if self.score_func == "sigmoid":  # out of place (the reference divides in place)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * self.route_scale
        return weights.type_as(x), indices


class MoE(nn.Module):
    """DeepSeek-V3's MoE block (inference/model.py `MoE`, on one process: all experts local)
    with its shared experts as one MLP (`FeedForward`, DeepSeek's `MLP`)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.dim = config.dim
        self.n_routed_experts = config.n_experts
        self.n_activated_experts = config.top_k
        self.gate = Gate(config)
        self.experts = nn.ModuleList(
            FeedForward(config.dim, config.moe_hidden) for _ in range(config.n_experts)
        )
        self.shared_experts = FeedForward(config.dim, config.n_shared * config.moe_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.n_routed_experts):
            if counts[i] == 0:
                continue
            expert = self.experts[i]
            idx, top = torch.where(indices == i)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        z = self.shared_experts(x)
        return (y + z).view(shape)


class Qwen2MoeMLP(nn.Module):
    """Qwen-MoE's expert (Hugging Face modeling_qwen2_moe.py): a SwiGLU MLP."""

    def __init__(self, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse block as Hugging Face writes it (modeling_qwen3_moe.py): softmax over
    E, top-k, normalised when `norm_topk`, no shared expert. (The reference loops over the
    experts some token chose, `expert_hitted`; this loops over all, as its Qwen2-MoE does: an
    expert no token chose adds nothing.)"""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.n_experts
        self.top_k = config.top_k
        self.norm_topk_prob = config.norm_topk
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = nn.ModuleList(
            Qwen2MoeMLP(config.dim, config.moe_hidden) for _ in range(config.n_experts)
        )

    def routed(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' sum over (tokens, hidden) and the router's logits."""
        hidden_dim = hidden_states.shape[-1]
        router_logits = self.gate(hidden_states)  # (batch * sequence_length, n_experts)
        routing_weights = F.softmax(router_logits, dim=1)  # reference: dtype=torch.float
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros_like(hidden_states)
        # one-hot of the chosen experts: (n_experts, top_k, tokens)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states = final_hidden_states.index_add(
                0, top_x, current_hidden_states.to(hidden_states.dtype)
            )  # the reference adds in place (index_add_)
        return final_hidden_states, router_logits

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        final_hidden_states, router_logits = self.routed(hidden_states.view(-1, hidden_dim))
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


class Qwen2MoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """Qwen1.5-MoE's sparse block as Hugging Face writes it (modeling_qwen2_moe.py): Qwen3's
    routing (softmax over E, top-k, normalised when `norm_topk`) plus a shared expert with a
    sigmoid gate."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)
        self.shared_expert = Qwen2MoeMLP(config.dim, config.shared_hidden)
        self.shared_expert_gate = nn.Linear(config.dim, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        final_hidden_states, router_logits = self.routed(hidden_states)
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = (
            F.sigmoid(self.shared_expert_gate(hidden_states)) * shared_expert_output
        )
        final_hidden_states = final_hidden_states + shared_expert_output
        final_hidden_states = final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)
        return final_hidden_states, router_logits


def moe_block(config: MoEConfig) -> nn.Module:
    """The sparse feed-forward of `config.moe`'s reference code."""
    if config.moe == "deepseek":
        return MoE(config)
    if config.moe == "qwen":
        return Qwen2MoeSparseMoeBlock(config)
    if config.moe == "qwen3":
        return Qwen3MoeSparseMoeBlock(config)
    experts = [FeedForward(config.dim, config.moe_hidden) for _ in range(config.n_experts)]
    gate = nn.Linear(config.dim, config.n_experts, bias=False)
    return MoeLayer(experts, gate, MoeArgs(config.n_experts, config.top_k))


class MoETransformer(Llama):
    """A Llama-style decoder (`Llama`: attention, RMSNorm, rotary) whose feed-forward is a
    mixture of experts from layer `first_dense` on (`MoEConfig`)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)

    def block(self, config: LlamaConfig, layer_id: int) -> nn.Module:
        """Layer `layer_id`: attention and a dense or sparse feed-forward."""
        assert isinstance(config, MoEConfig)
        if layer_id < config.first_dense:
            return TransformerBlock(config)
        return TransformerBlock(config, moe_block(config))


# -- registry -----------------------------------------------------------------------------------

LlmConfig = GPT2Config | LlamaConfig  # MoEConfig is a LlamaConfig

# Published sizes: GPT-2 (Radford et al. 2019, Hugging Face configs), Llama 2 (params.json of
# Meta's release: multiple_of 256, 70B with 1.3 and 4096), Llama 3 8B (multiple_of 1024, 1.3).
LLM_SIZES: dict[str, LlmConfig] = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    "llama2-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32),
    "llama2-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40),
    "llama2-70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, multiple_of=4096, ffn_dim_multiplier=1.3
    ),
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        max_seq_len=8192,
    ),
    # Mixtral 8x7B: HF mistralai/Mixtral-8x7B-v0.1 config.json (46.7B parameters, 12.9B
    # active: mistral.ai/news/mixtral-of-experts).
    "mixtral-8x7b": MoEConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336, rope_theta=1e6,
        max_seq_len=32768, moe="mixtral", n_experts=8, top_k=2, moe_hidden=14336,
    ),
    # DeepSeek-V3's sizes (arXiv 2412.19437 Sec. 4.2; HF deepseek-ai/DeepSeek-V3 config.json:
    # 61 layers, the first 3 dense of 18432, then 1 shared + 256 routed experts of 2048, top 8
    # in 4 of 8 groups, sigmoid scores, route scale 2.5, vocabulary 129280; MLA of 128 heads,
    # q_lora_rank 1536, kv_lora_rank 512, q/k heads of 128 + 64 rotary, v heads of 128) at
    # its pre-training context (4096), without its multi-token-prediction module:
    # 671,026,419,200 parameters, the report's 671B.
    "deepseek-v3-like": MoEConfig(
        vocab_size=129280, dim=7168, n_layers=61, n_heads=128, hidden_dim=18432, norm_eps=1e-6,
        max_seq_len=4096, moe="deepseek", n_experts=256, top_k=8, moe_hidden=2048, n_shared=1,
        score_func="sigmoid", route_scale=2.5, n_groups=8, topk_groups=4, first_dense=3,
        mla=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128,
    ),
    # Qwen1.5-MoE-A2.7B: HF Qwen/Qwen1.5-MoE-A2.7B config.json (60 experts of 1408, top 4 not
    # renormalised, a gated shared expert of 5632, q/k/v biases; 14.3B parameters).
    "qwen-moe-like": MoEConfig(
        vocab_size=151936, dim=2048, n_layers=24, n_heads=16, hidden_dim=5632, norm_eps=1e-6,
        rope_theta=1e6, max_seq_len=8192, moe="qwen", n_experts=60, top_k=4, moe_hidden=1408,
        shared_hidden=5632, norm_topk=False, qkv_bias=True,
    ),
    # Qwen3-30B-A3B and Qwen3-235B-A22B: HF Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B
    # config.json (q/k/v heads of 128 with QK-norm, 4 k/v heads, every layer sparse: 128
    # experts, top 8 renormalised, no shared expert; untied; 30,532,122,624 and
    # 235,093,634,560 parameters). hidden_dim is their unused dense intermediate_size.
    "qwen3-30b-a3b": MoEConfig(
        vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        qk_norm=True, hidden_dim=6144, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
        moe="qwen3", n_experts=128, top_k=8, moe_hidden=768, norm_topk=True,
    ),
    "qwen3-235b-a22b": MoEConfig(
        vocab_size=151936, dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
        qk_norm=True, hidden_dim=12288, norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960,
        moe="qwen3", n_experts=128, top_k=8, moe_hidden=1536, norm_topk=True,
    ),
}  # fmt: skip


def _config(name: str, overrides: dict[str, object]) -> LlmConfig:
    try:
        config = LLM_SIZES[name]
    except KeyError:
        raise LayerwiseError(
            f"unknown model {name!r}; available models: {', '.join(LLM_SIZES)}"
        ) from None
    fields = [f.name for f in dataclasses.fields(config)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise LayerwiseError(
            f"model {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid options: batch, seq, dtype, {', '.join(fields)}"
        )
    return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_llm(
    name: str,
    *,
    device: str | torch.device = "meta",
    batch: int = 1,
    seq: int | None = None,
    dtype: str = "float32",
    **overrides: object,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Model `name` of `LLM_SIZES` (in train mode) on `device`, its parameters and buffers of
    floating `dtype` ("float32", "bfloat16" or "float16": mixed-precision training's 16-bit
    weights), with example token ids of shape (batch, seq) (dtype long; `seq` defaults to
    the model's context length).

    Keyword arguments override the config's fields; an unknown model, field or dtype, or a
    `seq` beyond the context length, raises LayerwiseError."""
    if dtype not in DTYPES:
        raise LayerwiseError(f"dtype must be one of {', '.join(DTYPES)}, got {given(dtype)}")
    config = _config(name, overrides)
    context = config.block_size if isinstance(config, GPT2Config) else config.max_seq_len
    seq = context if seq is None else seq
    for what, value, limit in (("batch", batch, None), ("seq", seq, context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayerwiseError(f"{what} must be a positive integer, got {given(value)}")
        if limit is not None and value > limit:
            raise LayerwiseError(
                f"seq {value} is longer than {name!r}'s context of {limit} tokens: "
                "pass a smaller seq (or override the context length)"
            )
    dev = torch.device(device)
    with dev:
        if isinstance(config, GPT2Config):
            module: nn.Module = GPT2(config)
        elif isinstance(config, MoEConfig):
            module = MoETransformer(config)
        else:
            module = Llama(config)
    module.train()
    if dtype != "float32":
        module = module.to(DTYPES[dtype])
    if dev.type == "meta":
        tokens = torch.empty(batch, seq, dtype=torch.long, device=dev)
    else:
        tokens = torch.randint(0, config.vocab_size, (batch, seq), device=dev)
    return module, (tokens,)
