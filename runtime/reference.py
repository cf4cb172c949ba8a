"""What a training step computes, defined once for the runtime and its single-process reference.

- parameters: the model recorded with the strategy (a zoo model or a user factory,
  `planner.graph.models.ModelSpec`) built on the CPU under `torch.manual_seed(seed)`, or a
  user's module instance (`runtime.models.ModuleModel`): every rank builds the same model, so
  every rank has the same full parameters; a graph without a model gets seeded random
  parameters per name.
- data: step s reads inputs and targets drawn from a generator seeded by (seed, s): float
  inputs standard normal, token inputs uniform over the vocabulary of the embeddings that
  read them, one class per output position of every softmax output.
- loss: the sum over the graph's softmax outputs of the mean over output positions (samples,
  and sequence positions) of -log p[target]; an output that is already a log-probability
  (`log_softmax`, `nn.LogSoftmax`: the usual classifier head) contributes -output[target]
  (the NLL loss). A task of a softmax op holding part of the positions contributes its part
  of that sum, so the parts add up to the loss.
- dropout runs as the identity (p = 0) on both sides, so runs are deterministic.
- update: plain SGD, p <- p - lr * grad.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.costs.kernels import BN_EPS
from planner.errors import LayerwiseError
from planner.graph.attention import rope_table
from planner.graph.hf import traceable
from planner.graph.models import ModelSpec
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import CHANNEL

__all__ = [
    "Model",
    "ModelSpec",
    "NonFiniteError",
    "ReferenceResult",
    "constant_scalars",
    "deviation",
    "float64_islands",
    "init_params",
    "model_constants",
    "log_head",
    "make_inputs",
    "make_targets",
    "nll_part",
    "reference_train",
]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
PARAM_FLOOR = 1e-2  # parameter scale below which deviations are absolute (see `deviation`)
LOG_HEADS = ("log_softmax", "logsoftmax")  # softmax op attrs whose output is log p


class NonFiniteError(LayerwiseError):
    """Training produced a non-finite loss or parameter (a NaN or infinite gradient)."""


class Model(Protocol):
    """What the runtime needs of a model: a zoo/factory `ModelSpec` or a `ModuleModel`."""

    name: str

    def graph(self) -> OpGraph: ...

    def build(self, seed: int, dtype: torch.dtype) -> nn.Module: ...

    def describe(self) -> str: ...


def init_params(
    graph: OpGraph,
    spec: Model | None,
    seed: int,
    dtype: torch.dtype,
    module: nn.Module | None = None,
) -> tuple[dict[str, torch.Tensor], dict[int, float]]:
    """Full initial parameters by graph parameter name, and the epsilon of every batch norm
    op (by op index) that differs from the kernels' default 1e-5.

    The graph does not record a norm's epsilon (Inception-v3 uses 1e-3): it is read from the
    model's BatchNorm2d modules, found by the names of the norm's parameters. `module`: the
    model already built from `spec` (else built here)."""
    names = {p.name: p.shape for op in graph.ops for p in op.params}
    if spec is None:
        out = {}
        for k, (name, shape) in enumerate(sorted(names.items())):
            g = torch.Generator().manual_seed(_mix(seed, 0, k))
            out[name] = (torch.randn(shape, generator=g, dtype=torch.float64) * 0.1).to(dtype)
        return out, {}
    module = spec.build(seed, dtype) if module is None else module
    have = dict(module.named_parameters())
    missing = sorted(set(names) - set(have))
    if missing:
        raise LayerwiseError(
            f"{spec.describe()} has no parameters named {missing[:3]}: the graph does not "
            "come from this model"
        )
    return {n: have[n].detach() for n in names}, _norm_eps(graph, module)


class Float64Islands(TorchFunctionMode):
    """In a float64 run, what a model computes in float32 whatever its input's dtype (norms and
    softmaxes in float32: Meta's and Hugging Face's code; a weight applied in float32: Gemma's
    norms; a router in float32) computed in float64 instead: casts of float64 tensors to
    float32 keep float64, and a float32 `dtype=` of an op on a float64 tensor becomes float64.
    Both sides of a float64 `--check` run under it (the single-process reference and every
    rank), so the check compares the parallel decomposition in float64 throughout: with the
    islands kept, a weight gradient that the model sums in float32 over all rows (Gemma's
    1 + weight) cannot equal the sum of its ranks' float32 partial sums, and data parallelism
    alone deviates by ~1e-8. float32 runs keep the islands as the model has them."""

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _CASTS and kwargs.get("dtype") is not torch.float32:
            return func(*args, **kwargs)  # every other call: as it is, at once
        wide = torch.float64
        x = args[0] if args else None
        # (meta tensors are capture's: it traces in float64 and must see the model's casts)
        if isinstance(x, torch.Tensor) and x.dtype == wide and not x.is_meta:
            if kwargs.get("dtype") is torch.float32:  # softmax(x, dtype=torch.float32)
                kwargs = {**kwargs, "dtype": wide}
            if func is torch.Tensor.float:
                return args[0]
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = tuple(wide if a is torch.float32 else a for a in args)
            elif func is torch.Tensor.type_as and args[1].dtype == torch.float32:
                return args[0]
        return func(*args, **kwargs)


_CASTS = frozenset({torch.Tensor.float, torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as})


def float64_islands(
    dtype: torch.dtype, graph: OpGraph | None = None
) -> contextlib.AbstractContextManager[Any]:
    """`Float64Islands` for a float64 run (of a graph whose ops say they compute something in
    float32, when `graph` is given: a mode costs every torch call a Python step), nothing
    otherwise."""
    if dtype != torch.float64 or (graph is not None and not has_islands(graph)):
        return contextlib.nullcontext()
    return Float64Islands()


def has_islands(graph: OpGraph) -> bool:
    """Whether an op of `graph` computes something in float32 whatever the run's dtype (an
    attr "float32": a norm's compute, a softmax, a QK-norm, a router)."""
    return any(v == "float32" for op in graph.ops for _, v in op.attrs)


Tables = dict[int, tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) by attention op index


def model_constants(
    graph: OpGraph,
    spec: Model | None,
    seed: int,
    dtype: torch.dtype,
    module: nn.Module | None = None,
) -> tuple[dict[int, float], Tables]:
    """What the graph's ops name of the model's constants, computed by the model on the CPU
    in one trace (capture names fx nodes deterministically, so attrs can name them): the
    value of every elementwise op's constant factor that capture could not compute (attr
    scalar_node: a 0-d tensor computed from buffers, as Gemma's embedding scale on a meta
    model), by op index, and every rotary attention op's (cos, sin) tables (attr
    rope_tables). `module`: the model already built (else built here when needed)."""
    scalars = {i: n for i, op in enumerate(graph.ops) if (n := op.attr("scalar_node")) is not None}
    scalars = {i: n for i, n in scalars.items() if graph.ops[i].attr("scalar") is None}
    ropes = {i: op.attr("rope_tables") for i, op in enumerate(graph.ops) if op.attr("rope")}
    if not scalars and not ropes:
        return {}, {}
    if spec is None:
        raise LayerwiseError(
            "a graph with rotary attention or a model's constant factors needs its model to run"
        )
    from planner.graph.capture import constant_values

    module = spec.build(seed, dtype) if module is None else module
    inputs = make_inputs(graph, 0, seed, dtype)
    names = sorted({*scalars.values(), *(n for pair in ropes.values() for n in pair)})
    values = constant_values(module, tuple(inputs), names)
    tables = {i: (rope_table(values[c]), rope_table(values[s])) for i, (c, s) in ropes.items()}
    return {i: float(values[n]) for i, n in scalars.items()}, tables


def with_scalars(graph: OpGraph, scalars: Mapping[int, float]) -> OpGraph:
    """`graph` with attr scalar set on the ops `scalars` gives values for (by op index)."""
    if not scalars:
        return graph
    ops = list(graph.ops)
    for i, value in scalars.items():
        ops[i] = dataclasses.replace(
            ops[i], attrs=Op.make_attrs(dict(ops[i].attrs) | {"scalar": value})
        )
    return OpGraph(graph.name, tuple(ops))


def constant_scalars(graph: OpGraph, spec: Model | None, seed: int, dtype: torch.dtype) -> OpGraph:
    """`graph` with its constant factors filled in from the model (`model_constants`)."""
    return with_scalars(graph, model_constants(graph, spec, seed, dtype)[0])


def _norm_eps(graph: OpGraph, module: nn.Module) -> dict[int, float]:
    eps: dict[int, float] = {}
    for i, op in enumerate(graph.ops):
        for p in op.params:
            path = p.name.rsplit(".", 1)[0] if "." in p.name else ""
            try:
                m = module.get_submodule(path) if path else None
            except AttributeError:
                m = None
            if isinstance(m, nn.BatchNorm2d) and m.eps != BN_EPS:
                eps[i] = float(m.eps)
    return eps


def _mix(seed: int, step: int, k: int) -> int:
    return (seed * 1_000_003 + step * 7919 + k * 104_729) % (2**63 - 1)


def input_vocab(graph: OpGraph, i: int) -> int:
    """Token range of integer input op i: the smallest vocabulary of the embeddings reading it."""
    vocabs = [
        graph.ops[c].params[0].shape[0]
        for c in graph.consumers[i]
        if graph.ops[c].kind == "embedding" and graph.ops[c].params
    ]
    if not vocabs:
        raise LayerwiseError(f"integer input {graph.ops[i].name!r} is read by no embedding")
    return min(vocabs)


def make_inputs(graph: OpGraph, step: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Full input tensors of step `step`, one per input op in graph order."""
    out = []
    for k, (i, op) in enumerate((i, op) for i, op in enumerate(graph.ops) if op.kind == "input"):
        g = torch.Generator().manual_seed(_mix(seed, step, k))
        shape = op.output.sizes
        if any(graph.ops[c].kind == "embedding" for c in graph.consumers[i]):
            out.append(torch.randint(0, input_vocab(graph, i), shape, generator=g))
        else:
            out.append(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))
    return out


def make_targets(graph: OpGraph, sinks: Sequence[int], step: int, seed: int) -> list[torch.Tensor]:
    """Target classes of step `step` for each loss op: its output shape without channel."""
    out = []
    for k, i in enumerate(sinks):
        op = graph.ops[i]
        g = torch.Generator().manual_seed(_mix(seed + 1, step, k))
        shape = tuple(s for d, s in op.output.shape if d != CHANNEL)
        out.append(torch.randint(0, op.output.size(CHANNEL), shape, generator=g))
    return out


def log_head(op: Op) -> bool:
    """Whether softmax op `op` outputs log-probabilities (log_softmax) rather than p."""
    return str(op.attr("op", "softmax")) in LOG_HEADS


def nll_part(
    out: torch.Tensor, target: torch.Tensor, axis: int, count: int, log: bool = False
) -> torch.Tensor:
    """-sum log p[target] over the given positions, divided by the output's positions; `out`
    holds p, or log p when `log` (a log_softmax head: taking its log again gave NaN)."""
    picked = out.gather(axis, target.unsqueeze(axis))
    return -(picked if log else torch.log(picked)).sum() / count


def check_finite(loss: float, step: int, where: str) -> None:
    """Stop training at a non-finite loss, with what to try."""
    if not math.isfinite(loss):
        raise NonFiniteError(
            f"step {step}: the loss is {loss} {where}; training diverged or the model's output "
            "is not a probability (the loss is the NLL of every softmax output: end the model "
            "in softmax or log_softmax over the classes); try a smaller --lr or --dtype float64"
        )


def _head(out: torch.Tensor, op: Op, axis: int) -> torch.Tensor:
    """A model output as its loss op sees it: logits get the log_softmax that capture added
    to the graph for them (attr implicit: the model returns the logits)."""
    return torch.log_softmax(out, dim=axis) if op.attr("implicit") else out


def loss_sinks(graph: OpGraph) -> tuple[int, ...]:
    return tuple(
        i for i, op in enumerate(graph.ops) if op.kind == "softmax" and not graph.consumers[i]
    )


@dataclass
class ReferenceResult:
    losses: list[float]
    params: dict[str, torch.Tensor]
    initial: dict[str, torch.Tensor]


def reference_train(
    spec: Model,
    graph: OpGraph,
    steps: int,
    lr: float,
    seed: int,
    dtype: torch.dtype,
) -> ReferenceResult:
    """Single-process training of the model: the runtime must reproduce it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with float64_islands(dtype, graph):
            return _reference_train(spec, graph, steps, lr, seed, dtype)
    finally:
        torch.set_num_threads(threads)


def _reference_train(
    spec: Model, graph: OpGraph, steps: int, lr: float, seed: int, dtype: torch.dtype
) -> ReferenceResult:
    # a Hugging Face model is called as capture traced it: forward(input_ids) -> logits
    module = traceable(spec.build(seed, dtype))
    named = dict(module.named_parameters())
    initial = {n: p.detach().clone() for n, p in named.items()}
    sinks = loss_sinks(graph)
    losses = []
    for s in range(steps):
        inputs = make_inputs(graph, s, seed, dtype)
        targets = make_targets(graph, sinks, s, seed)
        outs = module(*inputs)
        outs = tuple(outs) if isinstance(outs, tuple | list) else (outs,)
        if len(outs) != len(sinks):
            raise LayerwiseError(
                f"{spec.describe()} returns {len(outs)} outputs but its graph has "
                f"{len(sinks)} softmax outputs"
            )
        loss = sum(
            (
                nll_part(_head(o, graph.ops[i], axis), t, axis, t.numel(), log_head(graph.ops[i]))
                for o, t, i in zip(outs, targets, sinks, strict=True)
                for axis in [graph.ops[i].output.dims.index(CHANNEL)]
            ),
            torch.zeros((), dtype=dtype),
        )
        check_finite(float(loss.detach()), s, "in single-process training (the reference)")
        module.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            for p in module.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in named.items()}
    return ReferenceResult(losses, params, initial)


def deviation(
    losses: Sequence[float],
    params: Mapping[str, torch.Tensor],
    ref: ReferenceResult,
) -> dict[str, Any]:
    """Largest relative deviations from the reference.

    loss: max over steps |l - l_ref| / |l_ref|; params: max over tensors of
    max|p - p_ref| / max(max|p_ref|, PARAM_FLOOR): a bias that starts at zero is compared on
    the scale of a typical weight, not of its own tiny value (its gradient is a sum with
    heavy cancellation in deep batch-normalized nets, so its relative rounding error is far
    above machine precision whatever the summation order). update: max|p - p_ref| relative
    to how far the reference moved the tensor, max|p_ref - p_0| (strict, for information: it
    sees an error in a gradient even when the parameters barely moved). max_deviation is the
    larger of the first two (what the CLI reports)."""
    if len(losses) != len(ref.losses):
        raise LayerwiseError(f"{len(losses)} losses but the reference has {len(ref.losses)}")
    loss_dev = max(
        (abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref.losses, strict=True)),
        default=0.0,
    )
    param_dev, update_dev, worst = 0.0, 0.0, ""
    for name, p in params.items():
        r = ref.params[name].to(p.dtype)
        diff = float((p - r).abs().max()) if p.numel() else 0.0
        scale = float(r.abs().max()) if r.numel() else 0.0
        moved = float((r - ref.initial[name].to(p.dtype)).abs().max()) if r.numel() else 0.0
        d = diff / max(scale, PARAM_FLOOR)
        u = diff / moved if moved > 0 else diff
        if d > param_dev:
            param_dev, worst = d, name
        update_dev = max(update_dev, u)
    if not math.isfinite(loss_dev) or any(not math.isfinite(x) for x in losses):
        loss_dev = math.inf
    return {
        "max_deviation": max(loss_dev, param_dev),
        "loss_deviation": loss_dev,
        "param_deviation": param_dev,
        "update_deviation": update_dev,
        "worst_param": worst,
    }
