"""Coarsening: fold cheap single-input ops into their producers so the search sees layers.

A conv followed by its batch norm and ReLU becomes one conv op carrying all three ops'
FLOPs, memory traffic and parameters; a flatten feeding a linear disappears (the linear
reads the 4D tensor whole along its non-sample dims). Total forward FLOPs and parameter
bytes are preserved exactly; the merged op keeps the producer's name, kind and output, lists
the ops it absorbed in attr "fused" and what they compute, in order, in attr "fused_ops"
(applied to its output) and "pre_ops" (applied to its input: ops that had been folded into
an absorbed flatten).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from planner.errors import GraphError
from planner.graph.opgraph import Op, OpGraph

__all__ = ["coarsen"]


def coarsen(
    graph: OpGraph,
    fold_kinds: Iterable[str] = ("elementwise", "norm"),
    fold_flatten: bool = True,
) -> OpGraph:
    """Return a coarser, equivalent OpGraph (see the module docstring for the rules).

    An op folds into its producer when its kind is in `fold_kinds`, it has one input, the
    producer is not an `input` op and has no other consumer, and their output shapes are
    equal. Batch norm folds into any producer (attr norm="batch"), layer norm only into a
    linear (attr norm="layer"). Ops with parameters fold only where neither side belongs to
    a shared parameter group. Multi-input ops (a residual add) stay. A concat read only by
    another concat along the same dim is inlined into it."""
    kinds = frozenset(fold_kinds)
    n_consumers = Counter(src for op in graph.ops for src in op.inputs)
    own_mem = {op.name: op.mem_bytes for op in graph.ops}
    kept: dict[str, Op] = {}
    alias: dict[str, str] = {}
    for op in graph.ops:
        op = replace(op, inputs=tuple(alias.get(i, i) for i in op.inputs))
        producer = kept.get(op.inputs[0]) if len(op.inputs) == 1 else None
        if producer is not None and _can_fold(op, producer, kinds, n_consumers):
            kept[producer.name] = _merge(producer, op)
            alias[op.name] = producer.name
            n_consumers[producer.name] = n_consumers[op.name]
            continue
        if op.kind == "concat":
            op = _inline_concats(op, kept, n_consumers)
        if fold_flatten and producer is not None and _can_drop_flatten(op, producer, n_consumers):
            del kept[producer.name]
            op = _absorb_flatten(op, producer, own_mem[producer.name])
        kept[op.name] = op
    result = OpGraph(graph.name, tuple(kept.values()))
    _check_preserved(graph, result)
    return result


def _can_fold(op: Op, producer: Op, kinds: frozenset[str], n_consumers: Counter[str]) -> bool:
    if op.kind not in kinds or producer.kind in ("input", "moe") or n_consumers[producer.name] != 1:
        return False
    if op.output.shape != producer.output.shape:
        return False
    if op.params and (op.param_group is not None or producer.param_group is not None):
        return False
    if op.attr("scalar") is not None or op.attr("scalar_node") is not None:
        # a fused op is a function's name: x * 0.5 stays an op
        return False
    if op.kind == "norm":
        norm = op.attr("norm")
        if producer.attr("norm") is not None:
            return False
        if norm == "layer":  # layer norm needs the whole channel: only a linear absorbs it
            return producer.kind == "linear"
        return norm == "batch"
    return True


def _merge(producer: Op, op: Op) -> Op:
    attrs = dict(producer.attrs)
    if op.kind == "norm":
        attrs["norm"] = op.attr("norm")
    attrs["fused"] = tuple(attrs.get("fused", ())) + (op.name,)
    attrs["fused_ops"] = tuple(attrs.get("fused_ops", ())) + (_function(op),)
    return replace(
        producer,
        params=producer.params + op.params,
        flops=producer.flops + op.flops,
        mem_bytes=producer.mem_bytes + op.mem_bytes,
        attrs=Op.make_attrs(attrs),
    )


def _inline_concats(op: Op, kept: dict[str, Op], n_consumers: Counter[str]) -> Op:
    """A concat whose input is another concat along the same dim, read by nothing else,
    takes that concat's inputs directly (Inception-E's nested concats)."""
    dim = op.attr("dim")
    inputs: list[str] = []
    offsets: list[int] = []
    fused = list(op.attr("fused", ()))
    mem = op.mem_bytes
    for name, off in zip(op.inputs, op.attr("offsets"), strict=True):
        inner = kept.get(name)
        if (
            inner is None
            or inner.kind != "concat"
            or inner.attr("dim") != dim
            or n_consumers[name] != 1
        ):
            inputs.append(name)
            offsets.append(int(off))
            continue
        del kept[name]
        inputs.extend(inner.inputs)
        offsets.extend(int(off) + int(o) for o in inner.attr("offsets"))
        fused.extend((*inner.attr("fused", ()), inner.name))
        mem += inner.mem_bytes
    if len(inputs) == len(op.inputs):
        return op
    attrs = {**dict(op.attrs), "offsets": tuple(offsets), "fused": tuple(fused)}
    return replace(op, inputs=tuple(inputs), mem_bytes=mem, attrs=Op.make_attrs(attrs))


def _function(op: Op) -> str:
    """What a folded op computes, for attr "fused_ops" (e.g. relu, dropout, batch_norm)."""
    if op.kind == "norm":
        return f"{op.attr('norm')}_norm"
    return str(op.attr("op", "identity"))  # hand-built graphs may not say which function


def _can_drop_flatten(op: Op, flatten: Op, n_consumers: Counter[str]) -> bool:
    if op.kind != "linear" or flatten.kind != "flatten" or len(flatten.inputs) != 1:
        return False
    if n_consumers[flatten.name] != 1:
        return False
    return not flatten.params or (flatten.param_group is None and op.param_group is None)


def _absorb_flatten(linear: Op, flatten: Op, flatten_own_mem: float) -> Op:
    """The linear reads the flatten's input; it keeps what other ops had folded into the
    flatten (the reshape's own traffic is a view and is dropped)."""
    attrs = dict(linear.attrs)
    attrs["flatten"] = True
    absorbed = (flatten.name, *flatten.attr("fused", ()), *attrs.get("fused", ()))
    attrs["fused"] = absorbed
    pre = tuple(flatten.attr("fused_ops", ()))  # folded into the flatten: run on the input
    if pre:
        attrs["pre_ops"] = pre
    return replace(
        linear,
        inputs=flatten.inputs,
        params=flatten.params + linear.params,
        flops=linear.flops + flatten.flops,
        mem_bytes=linear.mem_bytes + max(0.0, flatten.mem_bytes - flatten_own_mem),
        attrs=Op.make_attrs(attrs),
    )


def _check_preserved(before: OpGraph, after: OpGraph) -> None:
    if before.forward_flops != after.forward_flops:
        raise GraphError(
            f"coarsening {before.name!r} changed forward FLOPs "
            f"({before.forward_flops} -> {after.forward_flops})"
        )
    if before.parameter_bytes != after.parameter_bytes:
        raise GraphError(
            f"coarsening {before.name!r} changed parameter bytes "
            f"({before.parameter_bytes} -> {after.parameter_bytes})"
        )
