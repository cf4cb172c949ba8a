"""Decoder-only language models written the way their authors' reference code writes them.

- `GPT2` follows nanoGPT's model.py (Karpathy), itself a port of OpenAI's GPT-2 and Hugging
  Face's GPT2LMHeadModel: fused `c_attn`, learned positions, pre-LN blocks, tanh GELU, the LM
  head tied to the token embedding, nanoGPT's initialisation. The embeddings and blocks sit in
  a `GPT2Model` named `transformer` as in Hugging Face (nanoGPT's ModuleDict there has the
  same parameter names, e.g. `transformer.h.0.attn.c_attn.weight`).
- `Llama` follows Meta's reference llama/model.py (RMSNorm, SwiGLU feed-forward and its
  hidden-size rule, grouped-query attention, no biases) with the rotary embedding in Hugging
  Face's real-valued form (modeling_llama.py: `rotate_half`, cached cos/sin tables).

Plain PyTorch: nothing here is written for the planner (no leaf modules, no op kinds), and the
models are not in `zoo.MODELS`. `LLM_SIZES` holds the published sizes; `build_llm` builds one
(on the meta device by default: no memory, no compute) with example token inputs.
"""

from __future__ import annotations

import dataclasses
import math
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
    linears: Nemotron-4's)."""

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

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len")
        _check_sizes(self, sizes + ("n_kv_heads",) * (self.n_kv_heads is not None))
        _check_sizes(self, ("hidden_dim",) * (self.hidden_dim is not None))
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise LayerwiseError(
                f"dim {self.dim} must be n_heads {self.n_heads} times an even head size "
                "(rotary embeddings rotate pairs of channels)"
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
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.attention = config.attention
        self.wq = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
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


def _norm(config: LlamaConfig) -> nn.Module:
    if config.torch_rmsnorm:
        return nn.RMSNorm(config.dim, eps=config.norm_eps)
    return RMSNorm(config.dim, eps=config.norm_eps)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention = LlamaAttention(config)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden, config.mlp)
        self.attention_norm = _norm(config)
        self.ffn_norm = _norm(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Llama (2 and 3) as Meta's reference writes it, rotary in Hugging Face's form;
    `forward(tokens)` gives logits (B, T, vocab), `forward(tokens, targets)` gives (logits,
    mean cross-entropy)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rotary_emb = RotaryEmbedding(
            config.dim // config.n_heads, config.max_seq_len, config.rope_theta
        )
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = _norm(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

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


# -- registry -----------------------------------------------------------------------------------

LlmConfig = GPT2Config | LlamaConfig

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
}


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
        module = GPT2(config) if isinstance(config, GPT2Config) else Llama(config)
    module.train()
    if dtype != "float32":
        module = module.to(DTYPES[dtype])
    if dev.type == "meta":
        tokens = torch.empty(batch, seq, dtype=torch.long, device=dev)
    else:
        tokens = torch.randint(0, config.vocab_size, (batch, seq), device=dev)
    return module, (tokens,)
