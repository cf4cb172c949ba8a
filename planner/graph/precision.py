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

Input ops (the data) keep the dtype they were captured with. Lightning's short names map as
Lightning maps them ("bf16" -> "bf16-mixed", "16" -> "16-mixed", "32" -> "32-true", "64" ->
"64-true"). The rewrite is idempotent and keeps shapes, FLOPs and names; an op's `mem_bytes`
(bytes its forward moves) scales with its inputs', output's and parameters' bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from planner.errors import LayerwiseError, given
from planner.graph.opgraph import Op, OpGraph, Param

__all__ = ["PRECISIONS", "check_precision", "with_precision"]

# Lightning's names (lightning.fabric.connector's precision values) and the bytes they mean.
TRUE_BYTES = {"64-true": 8, "32-true": 4, "16-true": 2, "bf16-true": 2}
MIXED = ("16-mixed", "bf16-mixed")
ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
PRECISIONS = (*TRUE_BYTES, *MIXED)
# Under autocast: kinds computed on the 16-bit tensor cores, and kinds kept in fp32.
LOWER = frozenset(("linear", "conv2d", "attention", "lstm", "rnn_attention"))
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
        ops.append(_retyped(op, nbytes, params, ins, graph))
    return OpGraph(graph.name, tuple(ops))


def _output_bytes(op: Op, name: str, inputs: list[int]) -> int:
    if op.kind == "input":
        return op.output.dtype_bytes
    if name in TRUE_BYTES:
        return TRUE_BYTES[name]
    if op.kind in LOWER:
        return HALF
    if op.kind in FP32 or not inputs:
        return FULL
    return max(inputs)


def _param_bytes(name: str) -> int:
    return TRUE_BYTES.get(name, FULL)


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
