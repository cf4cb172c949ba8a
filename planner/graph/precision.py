"""How a model trains, in the words users know: Lightning's `precision` ("bf16-mixed",
"32-true", ...), applied to a captured graph's dtypes.

A graph captures the dtypes its module holds: a float32 `nn.Module` trained under
`torch.autocast(dtype=torch.bfloat16)` is captured in float32 and would be priced at FP32
rates. `with_precision(graph, precision)` rewrites the bytes per element of every op's
output and parameters as the training runs them, so the cost model prices each op at the
peak of its compute dtype (`planner.costs.costmodel.compute_peak`) and memory counts the
bytes the run keeps:

- "32-true" / "16-true" / "bf16-true" / "64-true" (Lightning's "true" precisions, the
  module converted to that dtype): every op's output and every parameter in that dtype.
- "16-mixed" / "bf16-mixed" (Lightning's mixed precision: `torch.autocast` over fp32
  weights, Micikevicius et al., "Mixed Precision Training", ICLR 2018): parameters stay
  fp32 (4 bytes: weights, gradients and the optimizer's state are fp32, so master weights
  add nothing); matrix products (linear, conv2d, attention, lstm, rnn_attention) run on the
  16-bit tensor cores and return 16-bit outputs, as autocast's lower-precision op list
  casts them; norms, softmax and the loss run in fp32 (autocast's fp32 list: layer_norm,
  softmax, log_softmax, cross_entropy, pow/rsqrt of a hand-written RMSNorm); an embedding
  returns its fp32 weights' dtype; pointwise and shape ops (elementwise, concat, slice,
  flatten, pooling) take the widest of their inputs (PyTorch's type promotion: a bf16
  linear output added to an fp32 residual stream is fp32).

- "transformer-engine" (Lightning's name for NVIDIA Transformer Engine's FP8 training, which
  converts the weights to bf16: `TransformerEnginePrecision(weights_dtype=torch.bfloat16)`;
  alias "fp8") and "transformer-engine-cs" (alias "fp8-cs"): every output and parameter in
  bf16 as "bf16-true", and the linears of the model's numbered blocks (`layers.3.mlp.w1`: the
  transformer layers Megatron-Core builds from Transformer Engine modules; the LM head and
  the embedding stay bf16, as Megatron-Core's output layer does) compute their three GEMMs
  (forward, input gradient, weight gradient) in FP8. Such a linear keeps its bf16 output and
  parameters and carries the attributes `compute="fp8"` and `fp8_scaling`: "delayed"
  (Transformer Engine's default recipe, `DelayedScaling`: each tensor scaled by the amax
  history of earlier steps, recorded in the same pass that casts it) or "current"
  (`Float8CurrentScaling`, the "fp8-cs" of the Megatron-Bridge recipes: the amax of the
  tensor itself, one more read before its cast). A linear whose sizes FP8 GEMMs cannot take
  stays bf16 (input features a multiple of 8 and output features a multiple of 16, the rule
  by which Lightning's plugin converts `nn.Linear`s). Attention, norms and the rest stay bf16,
  as Transformer Engine's FP8 recipes leave them. A mixture of experts (a `moe` op) of a
  numbered block is marked alike: its experts' GEMMs (the routed experts' grouped GEMMs and
  the shared expert's) run in FP8 as Megatron-Core's `TEGroupedLinear` and Transformer
  Engine's linears run them (DeepSeek-AI 2024, DeepSeek-V3 report, Sec. 3.3.1: the three
  GEMMs of each expert linear in FP8), while its router (and a shared expert's sigmoid gate)
  stays bf16, as both keep the gating in higher precision; it is marked when its expert
  matrices are of sizes FP8 GEMMs take (h, f and the shared expert's width multiples of 16).
  What the cost model does with it: `planner.costs.fp8` and docs/cost_model.md, "FP8
  training".

Input ops (the data) keep the dtype they were captured with. Lightning's short names map as
Lightning maps them ("bf16" -> "bf16-mixed", "16" -> "16-mixed", "32" -> "32-true", "64" ->
"64-true"). The rewrite is idempotent and keeps shapes, FLOPs and names; an op's `mem_bytes`
(bytes its forward moves) scales with its inputs', output's and parameters' bytes. Another
precision applied to an FP8 graph drops the FP8 attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from planner.errors import LayerwiseError, given
from planner.graph.opgraph import Op, OpGraph, Param
from planner.graph.opkinds import CHANNEL

__all__ = [
    "FP8_SCALING",
    "PRECISIONS",
    "check_precision",
    "computes_in_fp8",
    "fp8_linear",
    "with_precision",
]

# Lightning's names (lightning.fabric.connector's precision values) and the bytes they mean.
TRUE_BYTES = {"64-true": 8, "32-true": 4, "16-true": 2, "bf16-true": 2}
MIXED = ("16-mixed", "bf16-mixed")
# Transformer Engine's FP8 training, by its scaling recipe (module docstring)
FP8_SCALING = {"transformer-engine": "delayed", "transformer-engine-cs": "current"}
ALIASES = {
    "64": "64-true",
    "32": "32-true",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    "fp8": "transformer-engine",
    "fp8-cs": "transformer-engine-cs",
}
PRECISIONS = (*TRUE_BYTES, *MIXED, *FP8_SCALING)
FP8_ATTRS = ("compute", "fp8_scaling")  # what the rewrite marks on an FP8 linear or moe
# FP8 GEMMs take sizes Lightning's plugin converts (in % 8, out % 16: its `_convert_layers`)
FP8_IN_MULTIPLE, FP8_OUT_MULTIPLE = 8, 16
# Under autocast: kinds computed on the 16-bit tensor cores, and kinds kept in fp32.
LOWER = frozenset(("linear", "conv2d", "attention", "lstm", "rnn_attention", "moe"))
FP32 = frozenset(("norm", "softmax", "embedding"))
HALF, FULL = 2, 4


def check_precision(precision: object) -> str | None:
    """The canonical name of `precision` (None: train as captured); one LayerwiseError line
    for an unknown one."""
    if precision is None:
        return None
    if isinstance(precision, str) and precision in PRECISIONS:
        return precision
    if isinstance(precision, str | int) and str(precision) in ALIASES:
        return ALIASES[str(precision)]
    raise LayerwiseError(
        f"precision must be one of {', '.join(PRECISIONS)} (Lightning's names; also "
        f"{', '.join(ALIASES)}), or None to train in the dtypes the model holds; got "
        f"{given(precision)}"
    )


def with_precision(graph: OpGraph, precision: str | None) -> OpGraph:
    """`graph` with the output and parameter dtypes of `precision` (module docstring); the
    same graph when `precision` is None."""
    name = check_precision(precision)
    if name is None:
        return graph
    out: dict[str, int] = {}
    ops = []
    for op in graph.ops:
        ins = [out[n] for n in op.inputs]
        nbytes = _output_bytes(op, name, ins)
        params = _param_bytes(name)
        out[op.name] = nbytes
        ops.append(_fp8_marked(_retyped(op, nbytes, params, ins, graph), name))
    return OpGraph(graph.name, tuple(ops))


def computes_in_fp8(op: Op) -> bool:
    """Whether `op` runs its GEMMs in FP8 (a linear the "transformer-engine" precisions mark,
    or a moe op they mark: its experts' GEMMs, not its router)."""
    return op.attr("compute") == "fp8"


def fp8_linear(op: Op) -> bool:
    """Whether `op` is a linear that runs its GEMMs in FP8 (its input and output gradient
    travel in FP8; a moe op's tokens travel in bf16, its router reads them so)."""
    return op.kind == "linear" and computes_in_fp8(op)


def _fp8_marked(op: Op, name: str) -> Op:
    """`op` with the FP8 attributes of `name` (a linear of a numbered block under a
    Transformer Engine precision), and without them otherwise."""
    attrs = {k: v for k, v in op.attrs if k not in FP8_ATTRS}
    if name in FP8_SCALING and (_fp8_linear(op) or _fp8_moe(op)):
        attrs |= {"compute": "fp8", "fp8_scaling": FP8_SCALING[name]}
    if len(attrs) == len(op.attrs) and all(op.attr(k) == v for k, v in attrs.items()):
        return op
    return dataclasses.replace(op, attrs=Op.make_attrs(attrs))


def _fp8_linear(op: Op) -> bool:
    """A linear with a 2-D weight, inside a numbered block (a numeric part in its module
    path: `layers.3.mlp.w1`), of sizes FP8 GEMMs take."""
    if op.kind != "linear" or not op.params or len(op.params[0].shape) != 2:
        return False
    if not _in_block(op):
        return False
    out_f, in_f = op.params[0].shape
    if op.attr("transposed"):
        out_f, in_f = in_f, out_f
    return in_f % FP8_IN_MULTIPLE == 0 and out_f % FP8_OUT_MULTIPLE == 0


def _fp8_moe(op: Op) -> bool:
    """A moe op inside a numbered block whose expert matrices FP8 GEMMs take: hidden size,
    expert width and shared expert width multiples of 16 (each is some GEMM's output
    features, `FP8_OUT_MULTIPLE`, and another's input features)."""
    if op.kind != "moe" or not _in_block(op) or CHANNEL not in op.output.dims:
        return False
    from planner.graph.moe import moe_spec  # (imports torch: only for a moe op)

    spec = moe_spec(op)
    sizes = (op.output.size(CHANNEL), spec.ffn, spec.shared_ffn)
    return all(size % FP8_OUT_MULTIPLE == 0 for size in sizes)


def _in_block(op: Op) -> bool:
    """Whether op's module path has a numeric part (`layers.3.mlp.w1`): a numbered block."""
    return any(part.isdigit() for part in op.name.split("."))


def _output_bytes(op: Op, name: str, inputs: list[int]) -> int:
    if op.kind == "input":
        return op.output.dtype_bytes
    if name in FP8_SCALING:
        return HALF
    if name in TRUE_BYTES:
        return TRUE_BYTES[name]
    if op.kind in LOWER:
        return HALF
    if op.kind in FP32 or not inputs:
        return FULL
    return max(inputs)


def _param_bytes(name: str) -> int:
    return HALF if name in FP8_SCALING else TRUE_BYTES.get(name, FULL)


def _retyped(op: Op, nbytes: int, param_bytes: int, inputs: list[int], graph: OpGraph) -> Op:
    """`op` with its output in `nbytes` per element and its parameters in `param_bytes`; its
    `mem_bytes` scaled by the ratio of what it reads and writes after and before."""
    params = tuple(dataclasses.replace(p, dtype_bytes=param_bytes) for p in op.params)
    output = dataclasses.replace(op.output, dtype_bytes=nbytes)
    mem = op.mem_bytes
    if mem:
        sizes: Mapping[str, int] = {n: graph.op(n).output.numel for n in op.inputs}
        before = _moved(
            op,
            op.output.dtype_bytes,
            op.params,
            [graph.op(n).output.dtype_bytes for n in op.inputs],
            sizes,
        )
        after = _moved(op, nbytes, params, inputs, sizes)
        mem = mem * after / before if before else mem
    return dataclasses.replace(op, output=output, params=params, mem_bytes=mem)


def _moved(
    op: Op, nbytes: int, params: tuple[Param, ...], inputs: list[int], sizes: Mapping[str, int]
) -> float:
    reads = sum(sizes[n] * b for n, b in zip(op.inputs, inputs, strict=True))
    return float(reads + op.output.numel * nbytes + sum(p.nbytes for p in params))
