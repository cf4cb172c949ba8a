"""Activations kept for the backward pass, as training frameworks keep them.

An op's output stays in memory from the forward to the backward pass only when some op needs
it there. What each op saves for its own backward is the table below (PyTorch's autograd
formulas, tools/autograd/derivatives.yaml, and the fused kernels large-model training runs:
FlashAttention, fused norms, Megatron-Core's fused SwiGLU and vocabulary-parallel cross
entropy):

| op | saves for its backward |
| --- | --- |
| linear, conv2d, embedding | its input (the activation; an embedding: the token ids); an FP8 linear (`planner.costs.fp8`) its input's FP8 copy, 1 byte per element, as Transformer Engine saves it |
| moe | its input, its router's fp32 probabilities, each token's k dispatched copies, the experts' outputs and hidden activations, the shared expert's; FP8 (`planner.costs.fp8`): its GEMMs' inputs as FP8 copies (`moe_buffers`) |
| lstm, rnn_attention | its inputs, and its gates (an LSTM: 4 gates and the cell, 5 outputs' worth) |
| norm (layer, RMS, batch) | its input and fp32 statistics: mean and 1/std per row (layer), 1/std (RMS) |
| attention | q, k, v and its output, and the fp32 logsumexp per row and head (FlashAttention: the s x s scores are never kept); with QK-norm (Qwen3) also the normed q and k and their fp32 1/rms per row and head; MLA (DeepSeek-V3) also the key it forms (its rotary part copied to every head) |
| gelu, silu, leaky relu, hardtanh | its input |
| relu, sigmoid, tanh, exp, softmax | its output |
| mul, div | both inputs (an activation's output read only by muls, the gated unit act(a) * b of SwiGLU and GeGLU, is not: it is recomputed from act's input in the fused kernel, as Megatron-Core's `bias_swiglu` and torch.compile do) |
| dropout | a 1-byte mask per element |
| add, sub, neg, slice, concat, flatten, input | nothing |
| the loss (a softmax no op reads) | the probabilities in fp32 (Megatron-LM upcasts the logits for its vocabulary-parallel cross entropy), not the logits |

Folded functions (`planner.graph.coarsen`: a conv with its batch norm and ReLU, a linear with
its GELU and dropout) save the same: each keeps its input or its output (a tensor the size of
the op's output, inside the op, or the op's output itself when it is the last), a dropout its
mask, a folded norm its statistics.

Each op is charged what is kept *of it*: its output when a consumer saves it (counted once
however many do), and its own buffers (masks, statistics, logsumexp, the loss's fp32
probabilities). Counted where and as the producer holds its output: a column-parallel linear
whose input is sequence-parallel keeps that shard (Megatron-LM keeps it so and all-gathers it
again in the backward, Korthikanti et al. 2022, Sec. 4.2.2). An op no op reads keeps nothing
(a pipeline chunk's last tensor is kept by the next chunk, which reads it), except the loss.

With activation recomputation (`planner.costs.recompute`) an op that recomputes keeps only
what an op that does not recompute saves of it; the rest of what it would keep is rebuilt
during its region's backward (`work`: by then the readers that do not recompute have run
their backward and released their copy), and the tensors it reads from outside the region
are kept (the checkpoints). The loss's gradient of the logits (their dtype) exists
once, while every kept activation still does, at the start of the backward: a transient
region of its own (`LOSS_REGION`), as a recomputed region's working set is.

Per layer this gives Korthikanti et al.'s count (Sec. 4, Table 2) with FlashAttention: 34 s b h
bytes for a GPT layer (16-bit activations, dropout), divided by t under tensor and sequence
parallelism (docs/cost_model.md, "Memory"; tests/test_activations.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.graph.opkinds import CHANNEL, attention_dims, fused_ops
from planner.graph.precision import computes_in_fp8, fp8_linear

if TYPE_CHECKING:
    from planner.costs.recompute import RecomputeShare
    from planner.graph.opgraph import Op, OpGraph

__all__ = [
    "LOSS_REGION",
    "ActivationMemory",
    "activation_memory",
    "is_loss",
    "moe_buffers",
    "moe_dispatched_bytes",
    "saves_input",
]

FP32 = 4
MASK_BYTES = 1  # a dropout mask: one byte (torch.bool) per element
FP8_BYTES = 1  # an FP8 linear's saved input (Transformer Engine: planner.costs.fp8)
INDEX_BYTES = 8  # max pooling's int64 argmax per output element
LSTM_GATES = 5  # an LSTM cell keeps its 4 gates and its cell state: 5 outputs' worth
LOSS_REGION = "(loss)"  # the transient region of the loss's logits gradient

# Functions whose backward reads their output, or their input (PyTorch derivatives.yaml)
_SAVE_OUTPUT = frozenset({"relu", "sigmoid", "tanh", "exp"})
_SAVE_INPUT = frozenset(
    {"gelu", "gelu_tanh", "silu", "leaky_relu", "leakyrelu", "hardtanh", "relu6", "mul",
     "truediv", "div", "batch_norm", "layer_norm"}
)  # fmt: skip
_SAVE_NOTHING = frozenset({"add", "sub", "neg", "identity", "dropout"})
_ACTIVATIONS = frozenset({"gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh"})
_NORM_STATS = {"layer": 2, "rms": 1, "batch": 0}  # fp32 per row; batch: per channel, ~0


@dataclass(frozen=True)
class ActivationMemory:
    """Per op of a graph, bytes kept for the backward per byte of its output (a task keeps
    that times its share of the output): `kept` from the forward to the backward pass of a
    micro-batch, `work` only during its region's backward (a recomputed op's rebuilt tensors;
    the loss's logits gradient), with `region[i]` naming the region of an op with work
    (a recomputed block, attention op, or `LOSS_REGION`) and `share[i]` the share of its
    work the additive per-op memory rule charges it (1 / the regions alike)."""

    kept: np.ndarray  # (n,)
    work: np.ndarray  # (n,)
    region: dict[int, str]
    share: dict[int, float]

    def per_op(self, i: int) -> float:
        """Op i's factor in the additive per-op rule: kept + its share of its work."""
        return float(self.kept[i]) + float(self.work[i]) * self.share.get(i, 1.0)


def is_loss(graph: OpGraph, i: int) -> bool:
    """Whether op i is the loss: a softmax no op reads (the cross entropy of the logits,
    implicit for a model that returns logits, or a classifier's own softmax)."""
    return graph.ops[i].kind == "softmax" and not graph.consumers[i]


def saves_input(graph: OpGraph, i: int, position: int) -> bool:
    """Whether op i saves its input `position` for its backward (the module's table)."""
    op = graph.ops[i]
    kind = op.kind
    if kind in ("linear", "conv2d", "embedding"):
        return position == 0
    if kind in ("lstm", "rnn_attention", "attention", "pool2d", "moe"):
        return True
    if kind == "norm":
        return position == 0
    if kind == "elementwise":
        fn = str(op.attr("op", "identity"))
        if fn in ("mul", "truediv", "div"):
            return not _gated(graph, graph.index(op.inputs[position]))
        return fn in _SAVE_INPUT
    return False  # softmax (saves its output or fp32 copy), slice, concat, flatten, input


def _gated(graph: OpGraph, j: int) -> bool:
    """Whether op j's output is an activation's (alone or folded last) that only muls read:
    the act(a) of a gated unit act(a) * b, recomputed in the fused kernel (SwiGLU, GeGLU)."""
    if _last_function(graph.ops[j]) not in _ACTIVATIONS:
        return False
    readers = graph.consumers[j]
    return bool(readers) and all(
        graph.ops[r].kind == "elementwise" and graph.ops[r].attr("op") == "mul" for r in readers
    )


def _last_function(op: Op) -> str | None:
    """The function that makes op's output: its last folded one, else an elementwise op's own."""
    folded = _folded(op)
    if folded:
        return folded[-1]
    return str(op.attr("op", "identity")) if op.kind == "elementwise" else None


def _saves_output(op: Op) -> bool:
    """Whether op's own backward (or its last folded function's) reads its output."""
    if op.kind in ("attention", "softmax"):
        return True  # (the loss keeps an fp32 copy instead: a buffer, see `_buffers`)
    return _last_function(op) in _SAVE_OUTPUT


def _folded(op: Op) -> tuple[str, ...]:
    """The functions folded into op, applied to its output (`fused_ops`)."""
    return () if op.kind == "input" else fused_ops(op)


def _buffers(graph: OpGraph, i: int) -> float:
    """Bytes op i keeps of its own (not its inputs' or its output) per byte of its output."""
    op = graph.ops[i]
    out = op.output
    b = out.dtype_bytes
    if is_loss(graph, i):
        return FP32 / b  # the probabilities in fp32
    extra = 0.0
    if op.kind == "attention":  # logsumexp: fp32 per (sample, head, row)
        a = attention_dims(op)
        extra += FP32 / (a.v_head_dim * b)
        if a.qk_norm:  # normed q and k (the core's inputs) and their 1/rms per head
            qk_heads = (a.heads + a.kv_heads) / a.heads
            extra += qk_heads * (a.head_dim / a.v_head_dim + FP32 / (a.v_head_dim * b))
        if a.mla:  # the formed key's rotary part, one copy per head
            extra += a.rope_dim / a.v_head_dim
    elif op.kind == "norm":
        extra += _stats(op)
    elif op.kind == "moe":
        extra += moe_buffers(op)
    elif op.kind == "lstm":
        extra += LSTM_GATES
    elif op.kind == "rnn_attention":
        extra += 1.0
    elif op.kind == "pool2d" and op.attr("mode") == "max":
        extra += INDEX_BYTES / b
    elif op.kind == "elementwise" and op.attr("op") == "dropout":
        extra += MASK_BYTES / b
    fns = _folded(op)
    if fns and op.kind == "elementwise" and op.attr("op") in _SAVE_OUTPUT:
        extra += 1.0  # its own output, inside the op
    for k, fn in enumerate(fns):
        if fn == "dropout":
            extra += MASK_BYTES / b
        elif fn.endswith("_norm"):
            extra += 1.0 + _stats(op, fn[: -len("_norm")])  # its input, its statistics
        elif fn in _SAVE_OUTPUT:
            extra += 0.0 if k == len(fns) - 1 else 1.0  # the last's output: the op's own
        elif fn not in _SAVE_NOTHING:
            extra += 1.0  # its input, inside the op
    return extra


def moe_buffers(op: Op, parts: int = 1) -> float:
    """What a mixture of experts keeps per byte of its output (h elements per token): each
    of a token's k copies dispatched (h) and its expert output before the combine (h), the
    expert MLP's hidden activations (w1's and w3's outputs and their product: 3 f gated, 2 f
    otherwise), the router's fp32 probabilities (E) and the shared expert's hidden
    activations (as Megatron-Core's MoE layer keeps them for its backward). An FP8 moe
    (`planner.costs.fp8`) keeps its GEMMs' inputs as Transformer Engine saves them, FP8
    copies of 1 byte per element: the dispatched copies and the activations' products (w2's
    inputs), and the shared expert's FP8 copy of the token (its router keeps the bf16 one).
    `parts`: the hidden widths cut that many ways (one task of expert tensor parallelism:
    its token's copies, outputs and probabilities whole, its hidden activations 1/parts)."""
    from planner.graph.moe import moe_spec

    spec = moe_spec(op)
    h, b = op.output.size(CHANNEL), op.output.dtype_bytes
    fs = spec.shared_ffn / parts
    shared = float(spec.matrices * fs)
    if computes_in_fp8(op) and spec.shared_ffn:
        # the token's FP8 copy (h, 1 byte) more; w2's input (fs) in 1 byte, not b
        shared += (h * FP8_BYTES - fs * (b - FP8_BYTES)) / b
    return (moe_dispatched_bytes(op, parts) + shared) / h + FP32 * spec.experts / (h * b)


def moe_dispatched_bytes(op: Op, parts: int = 1) -> float:
    """Per token, in elements of a moe op's output dtype, what it keeps where its tokens are
    dispatched (`moe_buffers`): k x (the copy, h; the expert's output, h; its hidden
    activations, 3 f gated, 2 f otherwise, f cut `parts` ways), the copy and w2's input at
    1 byte per element when the op is FP8."""
    from planner.graph.moe import moe_spec

    spec = moe_spec(op)
    h, f = op.output.size(CHANNEL), spec.ffn / parts
    per_copy = 2.0 * h + spec.matrices * f
    if computes_in_fp8(op):
        b = op.output.dtype_bytes
        per_copy -= (h + f) * (b - FP8_BYTES) / b
    return spec.top_k * per_copy


def _stats(op: Op, norm: str | None = None) -> float:
    """A norm's fp32 statistics per byte of its output (per row of its channels)."""
    count = _NORM_STATS.get(str(norm or op.attr("norm", "batch")), 0)
    if not count or CHANNEL not in op.output.dims:
        return 0.0
    return count * FP32 / (op.output.size(CHANNEL) * op.output.dtype_bytes)


def activation_memory(graph: OpGraph, recomputed: RecomputeShare) -> ActivationMemory:
    """What each op of `graph` keeps for the backward (see the module's docstring) when the
    ops of `recomputed` recompute."""
    n = len(graph.ops)
    saved = np.zeros(n, dtype=bool)  # some op's backward reads op j's output
    saved_outside = np.zeros(n, dtype=bool)  # ... some op that does not recompute
    read_by_recomputed = np.zeros(n, dtype=bool)
    fp8_copy = np.zeros(n)  # an FP8 linear that does not recompute keeps an FP8 copy of it
    for i, op in enumerate(graph.ops):
        for position, name in enumerate(op.inputs):
            j = graph.index(name)
            if saves_input(graph, i, position) and fp8_linear(op):
                if i not in recomputed:  # (a recomputed one casts it again)
                    fp8_copy[j] = FP8_BYTES / graph.ops[j].output.dtype_bytes
            elif saves_input(graph, i, position):
                saved[j] = True
                saved_outside[j] |= i not in recomputed
            if i in recomputed:
                read_by_recomputed[j] = True
    kept = np.zeros(n)
    work = np.zeros(n)
    region: dict[int, str] = {}
    share: dict[int, float] = {}
    for i, op in enumerate(graph.ops):
        own = _buffers(graph, i)
        itself = saved[i] or _saves_output(op) and not is_loss(graph, i)
        if i in recomputed:
            # what an op that does not recompute saves of it stays; its own backward's copy
            # replaces that one (released by then: the reader's backward runs first)
            kept[i] = float(saved_outside[i]) + fp8_copy[i]
            work[i] = float(itself and not saved_outside[i]) + own
            region[i], share[i] = recomputed.block[i], recomputed.share[i]
            continue
        kept[i] = float(itself or read_by_recomputed[i]) + own + fp8_copy[i]
        if is_loss(graph, i):
            work[i] = 1.0  # the logits' gradient, in their dtype (~ the loss output's)
            region[i], share[i] = LOSS_REGION, 1.0
    return ActivationMemory(kept, work, region, share)
