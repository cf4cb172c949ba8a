"""FP8 training as NVIDIA Transformer Engine runs it: what an FP8 linear costs besides its GEMMs.

A linear the "transformer-engine" precisions mark (`planner.graph.precision`: `compute="fp8"`)
runs its three GEMMs (forward Y = X W^T, input gradient dX = dY W, weight gradient dW =
dY^T X) on the FP8 tensor cores (`Device.peak8`; on a chip with kernel rates, at the FP8 GEMM
fit `planner.costs.rates.H100_FP8_GEMM`). Hopper's FP8 GEMMs take only the "TN" layout, so
each operand exists in FP8 as it is and, for the backward GEMMs, transposed. Transformer
Engine makes those copies in memory-bound passes (its `_Linear` and `grad_output_preprocess`,
transformer_engine/pytorch/module/linear.py and base.py; with sequence parallelism, the
usual layout of tensor-parallel runs):

- forward: the input X is cast to FP8 (read 2 bytes, write 1 per element) on each rank's
  sequence shard before its all-gather, which then moves FP8 (1 byte per element: the
  transfer into an FP8 linear is priced so, `CostModel.edge_element_bytes`);
- backward: the output gradient dY is cast to FP8 (read 2, write 1) with its transpose (1
  more) where it is local, or on each rank's shard before its all-gather (a row-parallel
  linear: the gathered FP8 gradient, 1 byte per element, is then transposed, read 1 write 1);
  the saved FP8 input is transposed for the weight gradient (read 1, write 1);
- the weights are cast to FP8 with their transposes once per step (the first micro-batch;
  Transformer Engine keeps both across micro-batches: 2 bytes per element of the weight in
  memory, `WEIGHT_CACHE_BYTES`), counted with the optimizer step.

Scaling (the recipes' names): "delayed" (`DelayedScaling`, Transformer Engine's default and
the "fp8" of NeMo's and Megatron-Bridge's recipes) takes each tensor's scale from the amax
history of earlier steps and records the new amax in the same pass that casts it; "current"
(`Float8CurrentScaling`, the recipes' "fp8-cs") computes the tensor's own amax first: one
more read of X and of dY (2 bytes per element) before each cast. Its amax all-reduce over the
tensor-parallel group (a few bytes, a latency each) and delayed scaling's once-per-step
history update are not priced; neither is the fusion of a layer norm with the cast of its
output (Transformer Engine's LayerNormLinear writes the FP8 output directly: the norm's bf16
write and this cast's read are counted, 3 bytes per element of the shard more than it moves).

The activations kept for the backward: the FP8 copy of the input (1 byte per element,
`planner.costs.activations`), not the bf16 one. "mxfp8" (Blackwell's block scaling) is not
modelled.

A mixture of experts the precisions mark (a `moe` op with `compute="fp8"`) runs its experts'
GEMMs so (Megatron-Core's `TEGroupedLinear`, one FP8 grouped linear for the local experts'
fc1, w1 and w3 fused, and one for their fc2, w2; DeepSeek-AI 2024, DeepSeek-V3 report, Sec.
3.3.1: Fprop, Dgrad and Wgrad of each expert linear in FP8); its router's GEMM and softmax or
sigmoid stay bf16 (fp32 scores), as both keep the gating in higher precision. Its casts
(`moe_cast_bytes`) are `cast_bytes`' for each of its GEMMs: the dispatched token copies
(the task's routed rows x h) cast once before fc1, the activation's output (rows x f) before
fc2, the two output gradients cast with their transposes, the two saved FP8 inputs
transposed; the shared expert's alike on the task's own tokens. Under expert tensor
parallelism each task casts its box's token copies itself (it dispatched them) and its slice
of the hidden activations, so each cast is local. Its weights (the routed and
shared experts' matrices, `fp8_weight_elements`; not the router) keep `WEIGHT_CACHE_BYTES`
of FP8 caches per element. Its tokens travel in bf16 (the router reads them in bf16;
DeepSeek-V3's FP8 dispatch, Sec. 3.3.4, is not modelled) and it keeps FP8 copies of its
GEMMs' inputs for the backward (`planner.costs.activations`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.graph.moe import EXPERT_ROLES, moe_spec, split_role, tokens_of
from planner.graph.opkinds import CHANNEL
from planner.graph.precision import computes_in_fp8, fp8_linear

if TYPE_CHECKING:
    from planner.costs.config import ParallelConfig
    from planner.graph.opgraph import Op, Param

__all__ = [
    "FP8_BYTES",
    "WEIGHT_CACHE_BYTES",
    "cast_bytes",
    "computes_in_fp8",
    "fp8_linear",
    "fp8_weight_elements",
    "moe_cast_bytes",
]

FP8_BYTES = 1  # bytes per element of an FP8 tensor (E4M3 or E5M2)
WEIGHT_CACHE_BYTES = 2  # per weight element: its FP8 copy and its FP8 transpose
_CAST = 3  # read 2 bytes (bf16), write 1 (FP8)
_AMAX = 2  # current scaling: one more read of the bf16 tensor for its amax
_TRANSPOSE = 2  # read 1 byte (FP8), write 1


def cast_bytes(
    op: Op, cfg: ParallelConfig, m: int, n: int, k: int, sharers: int = 1
) -> tuple[float, float]:
    """(forward, backward) bytes of memory traffic one task of an FP8 linear `op` under `cfg`
    spends on Transformer Engine's casts and transposes (module docstring), for its GEMM of m
    rows, n outputs and k contracted inputs; (0, 0) for an op that is not FP8. `sharers`:
    the FP8 linears that read the same input and cast it once between them (Megatron-Core's
    fused QKV and gate/up projections are one linear: `CostOptions.transfer_once`), each
    charged its share of the input's cast and transpose."""
    if not computes_in_fp8(op):
        return 0.0, 0.0
    dims = op.output.dims
    column = cfg.degrees[dims.index(CHANNEL)] if CHANNEL in dims else 1
    return _gemm_casts(_quantize(op), m, n, k, column, cfg.reduce, sharers)


def _quantize(op: Op) -> int:
    """Bytes per element of one cast to FP8 under op's scaling recipe."""
    return _CAST + (_AMAX if op.attr("fp8_scaling") == "current" else 0)


def _gemm_casts(
    quantize: int, m: float, n: float, k: float, column: int, reduce: int, sharers: int
) -> tuple[float, float]:
    """`cast_bytes` of one GEMM given the bytes per element of a cast (`_quantize`)."""
    # X: each of the `column` tasks that read the same rows casts its shard before the gather
    forward = quantize * m * k / column / sharers
    if reduce > 1:  # row-parallel: dY cast on the shard, gathered in FP8, transposed
        grad = quantize * m * n / reduce + _TRANSPOSE * m * n
    else:  # dY local: cast with its transpose (one more byte written)
        grad = (quantize + FP8_BYTES) * m * n
    return float(forward), float(grad + _TRANSPOSE * m * k / sharers)


def moe_cast_bytes(op: Op, cfg: ParallelConfig, capacity: float) -> tuple[float, float]:
    """(forward, backward) bytes one task of an FP8 moe op under `cfg` spends on its expert
    GEMMs' casts and transposes (module docstring): `cast_bytes`' accounting for fc1 (rows x
    (w1, w3) outputs, contracting h) and fc2 (rows x h, contracting f) of its routed rows,
    the task's tokens x k (times `capacity` on the busiest rank when `cfg` spreads the
    experts, as `planner.costs.experts` prices it), and of the shared expert on the task's
    tokens; under expert tensor parallelism (`reduce` t) the box's tokens and 1/t of the
    hidden widths, every task casting its own copies (no FP8 gather); (0, 0) for an op that
    is not an FP8 moe."""
    if op.kind != "moe" or not computes_in_fp8(op):
        return 0.0, 0.0
    spec = moe_spec(op)
    h, quantize, t = op.output.size(CHANNEL), _quantize(op), cfg.reduce
    m = tokens_of(op.output.sizes) / (cfg.num_tasks // t)  # its box's tokens
    rows = m * spec.top_k * (capacity if cfg.expert > 1 else 1.0)
    f, fs = spec.ffn / t, spec.shared_ffn / t  # expert tensor parallelism: 1/t of the widths
    gemms = [(rows, f), (m, fs)] if spec.shared_ffn else [(rows, f)]
    forward = backward = 0.0
    for tokens, f in gemms:
        for n, k in ((spec.matrices - 1) * f, h), (h, f):  # fc1, fc2
            fwd, bwd = _gemm_casts(quantize, tokens, n, k, 1, 1, 1)
            forward, backward = forward + fwd, backward + bwd
    return forward, backward


def fp8_weight_elements(op: Op, params: Sequence[Param] | None = None) -> int:
    """Elements of op's weights (of `params`, a subset of them; default all) that run in FP8
    and have FP8 caches: an FP8 linear's weight; an FP8 moe's routed and shared experts'
    matrices (not its router, its router bias or a shared expert's gate); 0 otherwise."""
    if not computes_in_fp8(op) or not op.params:
        return 0
    params = op.params if params is None else params
    if op.kind != "moe":
        return math.prod(op.params[0].shape) if op.params[0] in params else 0
    roles = dict(zip((p.name for p in op.params), moe_spec(op).roles, strict=True))
    fp8 = (*EXPERT_ROLES, "sw1", "sw3", "sw2")
    return sum(math.prod(p.shape) for p in params if split_role(roles[p.name])[0] in fp8)
