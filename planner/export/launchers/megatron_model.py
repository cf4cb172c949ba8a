"""Megatron-LM's model arguments for a plan's model, read from its graph
(`planner.export.launchers.architecture`), and what its GPT model cannot express.

| the graph says | Megatron-LM |
| --- | --- |
| numbered blocks, the width (a block's norm), attention heads, key-value heads | `--num-layers --hidden-size --num-attention-heads`, `--group-query-attention --num-query-groups` |
| a head's q/k width times the heads is not the width (Qwen3, Gemma) | `--kv-channels` |
| the MLP's hidden width (the down-projection's input) | `--ffn-hidden-size` |
| a gated MLP w2(silu(w1 x) * w3 x) | `--swiglu` |
| RMS / layer norms, their epsilon, a scale of 1 + weight (Gemma) | `--normalization RMSNorm` / `LayerNorm`, `--norm-epsilon`, `--apply-layernorm-1p` (Megatron-Core's zero-centred gamma) |
| rotary embeddings (attention attr rope) turning rope_dim of a head's channels | `--position-embedding-type rope`, `--rotary-percent rope_dim/head_dim` |
| a learned position table (P, width) | `--position-embedding-type learned_absolute --max-position-embeddings P` |
| a head that does not hold the embedding's weight | `--untie-embeddings-and-output-weights` |
| no biases on the blocks' linears; biases on q, k, v only (Qwen2) | `--disable-bias-linear`; `--disable-bias-linear --add-qkv-bias` |
| QK-norm (attention attr qk_norm) | `--qk-layernorm` |
| a sliding window of W keys on every layer, or on all but every n-th, or by a pattern | `--window-size W-1,0` (Transformer Engine's (left, right)), `--window-attn-skip-freq n` or `"([1]*a+[0]*b)"` (1: windowed) |
| the embedding's rows V | `--padded-vocab-size V` (Megatron-LM's vocabulary of the model, else the tokenizer's padded to 128 t) |
| no dropout op anywhere | `--hidden-dropout 0` |
| MLA: q and kv latents, q/k heads of a no-rope and a rope part, v heads | `--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim` |
| a mixture of experts: E experts of width f, top k, a shared expert of width s, on some layers | `--num-experts E --moe-router-topk k --moe-ffn-hidden-size f`, `--moe-shared-expert-intermediate-size s`, `--moe-layer-freq "([0]*a+[1]*b)"` |
| routing: sigmoid scores, softmax over all E (not renormalised over the k), groups, a scale, a selection bias, float32 | `--moe-router-score-function sigmoid`, `--moe-router-pre-softmax`, `--moe-router-num-groups --moe-router-group-topk`, `--moe-router-topk-scaling-factor`, `--moe-router-enable-expert-bias`, `--moe-router-dtype fp32` |

What the graph does not hold (the rotary base and scaling, the attention's dropout) is one
header line; what Megatron-LM's GPT cannot build (a soft cap, norms after the attention and
the MLP, scaled embeddings, a gated MLP of another activation, layers unlike each other, ...)
is one "cannot express" line (`model_differences`).
"""

from __future__ import annotations

import itertools

from planner.export.launchers.architecture import Architecture
from planner.export.launchers.layout import ModelFacts

__all__ = ["model_args", "model_differences", "not_in_graph"]


def model_args(m: ModelFacts, a: Architecture, tensor: int) -> list[str]:
    """Megatron-LM's arguments for the model of facts `m` and architecture `a` at tensor
    parallelism `tensor` (which the vocabulary's rows must divide)."""
    args = ["--num-layers", str(m.layers)]
    if m.hidden:
        args += ["--hidden-size", str(m.hidden)]
    if m.heads:
        args += ["--num-attention-heads", str(m.heads)]
    if m.heads and m.kv_heads and m.kv_heads < m.heads:
        args += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    if a.mla:
        args += _mla_args(a)
    elif a.head_dim and m.heads and m.hidden and a.head_dim * m.heads != m.hidden:
        args += ["--kv-channels", str(a.head_dim)]
    if a.ffn:
        args += ["--ffn-hidden-size", str(a.ffn)]
    if a.gated if a.ffn else a.moe is not None and a.moe.gated:
        args.append("--swiglu")
    args += _norm_args(a)
    args += _position_args(m, a)
    if a.vocab:
        if not a.tied:
            args.append("--untie-embeddings-and-output-weights")
        args += ["--padded-vocab-size", str(-(-a.vocab // tensor) * tensor)]
    if a.bias in ("none", "qkv"):
        args.append("--disable-bias-linear")
    if a.bias == "qkv":
        args.append("--add-qkv-bias")
    if a.qk_norm:
        args.append("--qk-layernorm")
    args += _window_args(a.windows)[0]
    if not a.dropout:
        args += ["--hidden-dropout", "0"]
    args += _moe_args(a)
    return args


def _mla_args(a: Architecture) -> list[str]:
    rope = a.rope_dim or 0
    args = ["--multi-latent-attention"]
    if a.q_lora_rank:
        args += ["--q-lora-rank", str(a.q_lora_rank)]
    if a.kv_lora_rank:
        args += ["--kv-lora-rank", str(a.kv_lora_rank)]
    if a.head_dim and rope:
        args += ["--qk-head-dim", str(a.head_dim - rope), "--qk-pos-emb-head-dim", str(rope)]
    if a.v_head_dim:
        args += ["--v-head-dim", str(a.v_head_dim)]
    return args


def _norm_args(a: Architecture) -> list[str]:
    args = ["--normalization", "RMSNorm"] if a.norm == "rms" else []
    if a.norm_eps is not None:
        args += ["--norm-epsilon", f"{a.norm_eps:g}"]
    if a.norm_offset == 1.0:
        args.append("--apply-layernorm-1p")
    return args


def _position_args(m: ModelFacts, a: Architecture) -> list[str]:
    kind = {"rope": "rope", "learned": "learned_absolute"}.get(a.position, "none")
    args = ["--position-embedding-type", kind]
    if a.position == "rope" and not a.mla and a.rope_dim and a.head_dim:
        args += ["--rotary-percent", f"{a.rope_dim / a.head_dim:g}"]
    if a.position == "rope" and a.rope == "interleaved":
        args.append("--rotary-interleaved")
    if m.seq:
        longest = max(m.seq, a.positions or 0) if a.position == "learned" else m.seq
        args += ["--seq-length", str(m.seq), "--max-position-embeddings", str(longest)]
    return args


def _window_args(windows: tuple[int | None, ...]) -> tuple[list[str], str | None]:
    """`--window-size W-1,0` (W keys: the query's own and W - 1 before it, Transformer
    Engine's inclusive (left, right)) and the layers that have it (Megatron-Core's
    `is_layer_window_attention`: an integer n windows every layer but each n-th, counting
    from 1; a pattern lists 1 for a windowed layer); or what cannot be said."""
    sizes = sorted({w for w in windows if w})
    if not sizes:
        return [], None
    if len(sizes) > 1:
        return [], f"sliding windows of {' and '.join(map(str, sizes))} keys"
    args = ["--window-size", f"{sizes[0] - 1},0"]
    swa = [1 if w else 0 for w in windows]
    if all(swa):
        return args, None
    every = next(
        (n for n in range(2, len(swa) + 1)
         if all(s == int((i + 1) % n != 0) for i, s in enumerate(swa))),
        None,
    )  # fmt: skip
    return [*args, "--window-attn-skip-freq", str(every) if every else _pattern(swa)], None


def _pattern(flags: list[int]) -> str:
    """Megatron-LM's list expression of per-layer flags, by runs: "([0]*3+[1]*58)" (no
    spaces: one word of the argument file)."""
    runs = ((f, len(list(same))) for f, same in itertools.groupby(flags))
    return "(" + "+".join(f"[{f}]*{n}" for f, n in runs) + ")"


def _moe_args(a: Architecture) -> list[str]:
    s = a.moe
    if s is None:
        return []
    args = ["--num-experts", str(s.experts), "--moe-router-topk", str(s.top_k)]
    args += ["--moe-ffn-hidden-size", str(s.ffn)]
    if s.shared_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(s.shared_ffn)]
    if not all(a.moe_layers):
        args += ["--moe-layer-freq", _pattern([int(x) for x in a.moe_layers])]
    if s.router == "sigmoid":
        args += ["--moe-router-score-function", "sigmoid"]
    elif not s.norm_topk:
        args.append("--moe-router-pre-softmax")
    if s.groups > 1:
        args += ["--moe-router-num-groups", str(s.groups)]
        args += ["--moe-router-group-topk", str(s.topk_groups)]
    if s.route_scale != 1.0:
        args += ["--moe-router-topk-scaling-factor", f"{s.route_scale:g}"]
    if a.moe_router_bias and s.router == "sigmoid":
        args.append("--moe-router-enable-expert-bias")
    if s.router_dtype == "float32":
        args += ["--moe-router-dtype", "fp32"]
    return args


def model_differences(a: Architecture, tensor: int) -> list[str]:
    """What Megatron-LM's GPT model (its arguments) cannot build of architecture `a`, one
    phrase each."""
    unlike = [m for m in a.mixed if not m.startswith("layers ")]
    out = [f"{', '.join(unlike)} unlike between layers"] if unlike else []
    out += [m for m in a.mixed if m.startswith("layers ")]
    if a.heads is None:
        out.append("layers without attention (its GPT is a transformer)")
    if a.ffn and a.gated and a.activation != "silu":
        out.append(f"a gated MLP of {a.activation} (--swiglu gates with silu)")
    elif a.ffn and not a.gated and a.activation not in ("gelu", "gelu_tanh", None):
        out.append(f"an MLP of {a.activation} (Megatron-LM's is gelu)")
    if a.ffn and a.moe is not None and a.moe.gated != a.gated:
        out.append("experts gated otherwise than the dense MLP")
    if a.post_norms:
        out.append("norms on the attention's and the MLP's outputs too")
    if a.norm_offset not in (0.0, 1.0):
        out.append(f"norms scaled by {a.norm_offset:g} + weight")
    if a.qk_norm and (a.qk_norm != a.norm or a.qk_norm_offset != a.norm_offset):
        out.append("a QK-norm unlike the layers' norms")
    if a.position == "rope" and a.rope not in ("half", "interleaved"):
        out.append(f"rotary embeddings of kind {a.rope}")
    if a.head_dim and a.v_head_dim and a.head_dim != a.v_head_dim and not a.mla:
        out.append(f"q/k heads of {a.head_dim} channels and v heads of {a.v_head_dim}")
    if a.mla and not a.kv_lora_rank:
        out.append("MLA whose latents the graph does not show")
    if a.softcap:
        out.append(f"attention scores soft-capped at {a.softcap:g}")
    if a.scale:
        out.append(f"an attention scale of {a.scale:.6g}, not 1/sqrt({a.head_dim})")
    window = _window_args(a.windows)[1]
    if window:
        out.append(window)
    out += _moe_differences(a)
    if a.bias == "mixed":
        out.append("biases on some of the layers' linears")
    if a.head_bias:
        out.append("a bias on the output layer")
    if a.embedding_ops:
        scaled = a.embedding_ops == ("mul",)
        out.append("scaled embeddings" if scaled else f"{', '.join(a.embedding_ops)} on the "
                   "embeddings")  # fmt: skip
    if a.logit_ops:
        cap = " (a soft cap)" if "tanh" in a.logit_ops else ""
        out.append(f"{', '.join(a.logit_ops)} between the output layer and the loss{cap}")
    if not a.final_norm:
        out.append("no norm before the output layer")
    if a.vocab and a.vocab % tensor:
        out.append(f"a vocabulary of {a.vocab} that TP {tensor} does not divide (padded)")
    return out


def _moe_differences(a: Architecture) -> list[str]:
    s = a.moe
    if s is None:
        return []
    out = []
    if a.moe_shared_gate:
        out.append("a sigmoid gate on the shared expert")
    if s.router == "sigmoid" and not s.norm_topk and s.top_k > 1:
        out.append("sigmoid gates not renormalised over the top k")
    if a.moe_router_bias and s.router != "sigmoid":
        out.append("a selection bias on softmax scores")
    if s.groups > 1:
        per = s.top_k // max(s.topk_groups, 1)  # Megatron-Core ranks a group by its best k/g
        if (s.group_score, per) not in (("top2", 2), ("max", 1)):
            out.append(f"groups ranked by their {s.group_score} score")
    if s.expert_act not in ("swiglu", "gelu"):
        out.append(f"experts of {s.expert_act}")
    return out


def not_in_graph(a: Architecture) -> list[str]:
    """What the model needs that its graph does not hold."""
    out = ["the rotary base and scaling"] if a.position == "rope" else []
    if a.heads:
        out.append("the dropout rates" if a.dropout else "the attention's dropout")
    return out
