"""Capture an `nn.Module` as an `OpGraph` with torch.fx, on the meta device (no real compute).

`capture(module, example_inputs, name)` traces the module with a tracer whose leaves are the
layers layerwise knows (conv, pool, linear, norms, activations, embedding, LSTM cell and any
module that declares a `layerwise_kind`), runs the traced graph once on meta tensors to get
every node's shape and, under `FlopCounterMode`, its forward FLOPs (2 per multiply-add; only
matmuls, convolutions and attention count, so pointwise ops get 0 FLOPs and their memory
traffic in `mem_bytes`). Every fx node becomes an op of `planner.graph.opkinds` or is folded away
when it carries no compute (getitem, size, identity); anything else raises `GraphError`.

Transformer code (docs/graphs.md, "Tensor code"): the tracer knows the example's shapes
(`_Tracer`, a MetaTracer) and traces floating tensors in TRACE_DTYPE; attention written as
tensor code becomes one attention op (`planner.graph.attention.find_regions`); modules that
compute a norm or a transposed linear are leaves found by running them (`norm_of`,
`linear_of`); nodes computed without the inputs are constants (`_constants`); split, chunk
and ranges give slice ops; a model that returns logits gets an implicit log_softmax. A model
that computes its loss in forward (a torch loss function or module, or a scalar returned) is
refused: the runtime computes the loss itself, from the model's outputs.

Dimension names: 4D activations (sample, channel, height, width), 3D (sample, length,
channel), 2D (sample, channel); integer token tensors (sample, length) or (sample,).

A module may declare its own op kind: a class attribute `layerwise_kind = "attention"` makes
it a leaf mapped to that kind, with attrs from its `layerwise_attrs()` method if it has one.

Mixtures of experts (docs/moe.md, "Capture"): a module `planner.graph.moe_capture.moe_of`
recognises, or one declaring `layerwise_kind = "moe"`, is a leaf never run on meta (its
reference forms cannot: `torch.where(mask)`, `bincount().tolist()`): its output is its input's
shape (with (tokens, E) router logits when it returns them, which nothing may read) and its
FLOPs are `planner.graph.moe.moe_flops` (the k active experts), not FlopCounterMode's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import linecache
import operator
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.meta_tracer import MetaProxy, MetaTracer
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.flop_counter import FlopCounterMode

from planner.deadline import Deadline, OutOfTime
from planner.errors import GraphError
from planner.graph.attention import evaluate_constant, find_regions, module_key, rms_norm
from planner.graph.hf import traceable
from planner.graph.moe_capture import (
    MoEFound,
    declared_moe,
    moe_found,
    moe_of,
    refusal,
    unread_moe,
    unread_reason,
)
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.opkinds import CHANNEL, HEIGHT, LENGTH, SAMPLE, WIDTH

__all__ = ["DEFAULT_LEAF_MODULES", "Declared", "capture", "constant_values", "norm_of"]

Declared = tuple[str, "nn.Module", "fx.Node"]  # an op whose kind its module declares

DEFAULT_LEAF_MODULES: tuple[type[nn.Module], ...] = (
    nn.Conv2d,
    nn.Linear,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.BatchNorm2d,
    nn.LayerNorm,
    nn.ReLU,
    nn.GELU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Dropout,
    nn.Embedding,
    nn.LSTMCell,
)

_ACTIVATION_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.Hardtanh,
    nn.Dropout,
)
_POINTWISE_FUNCTIONS: set[Any] = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    torch.exp,
    F.relu,
    F.relu6,
    F.gelu,
    F.silu,
    F.tanh,
    F.sigmoid,
    F.leaky_relu,
    F.hardtanh,
    F.dropout,
}
_POINTWISE_METHODS = {
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "relu",
    "tanh",
    "sigmoid",
    "exp",
    "__add__",
    "__mul__",
}
_SOFTMAX_FUNCTIONS: set[Any] = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax}
_RESHAPE_METHODS = {"view", "reshape", "flatten"}
_NO_OP_METHODS = {"contiguous", "clone", "detach", "float"}
_NO_OP_FUNCTIONS: set[Any] = {torch.clone}
# torch's loss functions (F.cross_entropy, F.nll_loss, F.mse_loss, ...; their modules are
# nn.modules.loss._Loss): a model that computes its loss in forward is refused (`_refuse_loss`)
_LOSS_FUNCTIONS: set[Any] = {
    getattr(F, n) for n in dir(F) if n.endswith("_loss") or "cross_entropy" in n or n == "kl_div"
}


def capture(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    name: str,
    leaf_modules: Sequence[type[nn.Module]] = DEFAULT_LEAF_MODULES,
    deadline: Deadline | None = None,
    check: Callable[[OpGraph, list[Declared], dict[fx.Node, Any]], None] | None = None,
) -> OpGraph:
    """Trace `module` on the meta device and return its validated OpGraph named `name`.
    Past `deadline` (looked at before every node's meta run) it raises OutOfTime. `check`,
    if given, is called with the graph, the ops whose kind a module declares (`Declared`:
    op name, module, fx node) and the nodes' meta values, to compare them with their kernels
    (`planner.costs.declared.check_declared`, a layer above this one)."""
    module = traceable(module)  # a Hugging Face model: forward(input_ids) -> logits
    gm = _trace(module, tuple(leaf_modules), name, example_inputs)
    inputs = tuple(_to_meta(x) for x in example_inputs)
    values, flops = _run_on_meta(gm, inputs, name, deadline)
    batch = _batch_size(inputs, name)
    # a tied weight is named as the module names it (its first name: named_parameters)
    canonical = {id(p): n for n, p in module.named_parameters()}
    builder = _Builder(gm, values, flops, batch, canonical, _float_bytes(module, example_inputs))
    graph = OpGraph(name, builder.build())
    if check is not None:
        check(graph, [(builder.node_op[n], m, n) for n, m in builder.declared], values)
    return graph


def constant_values(
    module: nn.Module, example_inputs: tuple[torch.Tensor, ...], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The values of the fx nodes `names` (constants: computed from shapes and the module's
    buffers, such as rotary tables) in `module`'s traced graph, computed on the CPU from its
    real buffers. Capture names nodes deterministically, so an op's attrs can name them."""
    gm = _trace(traceable(module), DEFAULT_LEAF_MODULES, "model", example_inputs)
    values, _ = _run_on_meta(gm, tuple(_to_meta(x) for x in example_inputs), "model")
    nodes = {n.name: n for n in gm.graph.nodes}
    out = {}
    for name in names:
        node = nodes.get(name)
        value = evaluate_constant(node, values) if node is not None else None
        if not isinstance(value, torch.Tensor):
            raise GraphError(
                f"the model's constant {name!r} (a rotary table) cannot be computed from its "
                "buffers: build the model on the CPU"
            )
        out[name] = value
    return out


def warm_up() -> None:
    """Load what a process's first capture loads on its first op, so that a caller with a
    deadline can bound it (`planner.deadline.run_within`): torch runs the meta kernels of its
    Python references, and every dispatch mode, under a guard against torch.compile that
    imports `torch._dynamo` on first use (1.9 s on a quiet 2-core machine, beside the 2.5 s
    of `import torch`; a zoo model's capture after it: 0.07-0.8 s)."""
    import torch._dynamo  # noqa: F401


# -- tracing and shape/FLOP propagation --------------------------------------------------------


class _Proxy(MetaProxy):
    """A proxy whose meta value is a tuple (split, chunk) iterates over its items, so that
    `for y in x.split(...)` and `map(f, x.chunk(3, -1))` trace."""

    def __iter__(self) -> Iterator[Any]:
        meta = getattr(self, "_tensor_meta", None)
        if isinstance(meta, tuple | list):
            return iter([self[i] for i in range(len(meta))])  # type: ignore[index]
        return super().__iter__()

    def size(self, dim: int | None = None) -> Any:
        # MetaProxy.size(0) returns the whole size (it tests `if dim`)
        meta = getattr(self, "_tensor_meta", None)
        if isinstance(meta, torch.Tensor):
            return meta.size() if dim is None else meta.size(dim)
        return super().size(dim)

    def __len__(self) -> int:
        meta = getattr(self, "_tensor_meta", None)
        if isinstance(meta, torch.Tensor | tuple | list):
            return len(meta)
        raise TypeError("len() of a traced value of unknown size")


class _Tracer(MetaTracer):
    """torch.fx's tracer with the example inputs' shapes known while it traces (torch's
    MetaTracer): `x.size()`, `x.shape` and `len(x)` are numbers, so code that slices a
    mask buffer to the sequence length, builds `torch.ones(T, T)` or checks
    `assert T <= block_size` traces (with the example's shapes baked in, which capture uses
    anyway). Layers layerwise knows stay leaves; a leaf's output shape is found by running it
    on meta copies of its parameters (the module may hold real ones)."""

    def __init__(
        self,
        leaf_modules: tuple[type[nn.Module], ...],
        norms: dict[int, Any] | None = None,
        moes: dict[int, MoEFound] | None = None,
    ) -> None:
        super().__init__()
        self.leaf_modules = leaf_modules
        self.norms = norms or {}  # id(module) -> norm attrs (found before tracing: `norm_of`)
        self.moes = moes or {}  # id(module) -> a mixture of experts (`_moe_leaves`)
        self.proxy_buffer_attributes = True  # buffers (masks, rotary tables) as get_attr
        self.inserted: list[str] = []  # submodules this tracer added to the root

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if hasattr(type(m), "layerwise_kind"):
            return True
        if isinstance(m, self.leaf_modules):
            # a subclass that computes more in its own forward (Gemma's embedding times
            # sqrt(width)) is traced: its kind would drop what it adds
            return not _overrides_forward(m)
        if self.norms.get(id(m)) is not None:  # an RMSNorm or LayerNorm written by hand
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def proxy(self, node: fx.Node) -> _Proxy:
        return _Proxy(node, self)

    def _insert_module_as_submodule(self, mod: nn.Module) -> str:
        # MetaTracer adds a stateless module that is no attribute (Hugging Face wraps its
        # rotary function as one) to the root; `_trace` takes it out again
        path = super()._insert_module_as_submodule(mod)
        self.inserted.append(path)
        return path

    def create_proxy(
        self, kind: str, target: Any, args: Any, kwargs: Any, *rest: Any, **kw: Any
    ) -> Any:
        with warnings.catch_warnings():  # a shape it cannot find stays symbolic, silently
            warnings.simplefilter("ignore")
            if kind != "call_module":
                proxy = super().create_proxy(kind, target, args, kwargs, *rest, **kw)
                meta = getattr(proxy, "_tensor_meta", None)
                if kind == "get_attr" and isinstance(meta, torch.Tensor):
                    proxy.install_tensor_meta(_to_meta(meta))  # a parameter read directly
                if kind == "call_function" and target is torch.where and meta is None:
                    # MetaTracer's own torch.where stand-in fails on a number operand
                    # (Hugging Face's where(mask, 0, dtype.min)): torch's meta kernel does not
                    metas = fx.node.map_aggregate(
                        (args, kwargs), lambda a: getattr(a, "_tensor_meta", a)
                    )
                    with contextlib.suppress(Exception):
                        proxy.install_tensor_meta(torch.where(*metas[0], **metas[1]))
                return proxy
            mod = self.root.get_submodule(target)
            found = self.moes.get(id(mod))
            if found is not None:  # never run on meta (module docstring)
                leaf = fx.Tracer.create_proxy(self, kind, target, args, kwargs, *rest, **kw)
                x = getattr(args[0], "_tensor_meta", None) if args else None
                if isinstance(leaf, MetaProxy) and isinstance(x, torch.Tensor):
                    leaf.install_tensor_meta(found.output(_to_meta(x)))
                return leaf
            state = {
                k: _to_meta(v)
                for k, v in itertools.chain(
                    mod.named_parameters(remove_duplicate=False),
                    mod.named_buffers(remove_duplicate=False),
                )
            }
            with _reparametrize_module(mod, state):
                return super().create_proxy(kind, target, args, kwargs, *rest, **kw)


def _overrides_forward(m: nn.Module) -> bool:
    """Whether `m`'s class, derived from one of torch.nn's, defines its own forward."""
    for cls in type(m).__mro__:
        if "forward" in cls.__dict__:
            return not cls.__module__.startswith("torch.nn.")
    return False


_NORMS_SEEN: dict[int, tuple[nn.Module, dict[str, Any] | None]] = {}
NORM_EPS_NAMES = ("eps", "variance_epsilon", "epsilon", "norm_eps", "layer_norm_eps")
_EPS_GUESSES = (1e-5, 1e-6, 1e-8, 1e-12, 0.0)


def norm_of(m: nn.Module) -> dict[str, Any] | None:
    """The norm op's attrs when module `m` computes a layer norm or an RMS norm over its
    input's last dim with its own weight (and bias), whatever its code: found by running it
    on a small random input with random weights (its own stay untouched, on any device) and
    comparing with each formula. The epsilon is the module's (attribute eps,
    variance_epsilon, ...) or the one of _EPS_GUESSES that fits; "compute": "float32" when
    the module computes in float32 whatever its input (as Meta's reference code does)."""
    return _seen(_NORMS_SEEN, _NORMS_BY_KEY, m, _recognise_norm)


def linear_of(m: nn.Module) -> dict[str, Any] | None:
    """{"transposed": True} when module `m`, not an nn.Linear, computes x @ weight + bias
    over its input's last dim with a weight of shape (in, out) (Hugging Face's Conv1D, which
    writes it as addmm on a flattened view), found by running it on a small random input
    with random weights; None otherwise."""
    return _seen(_LINEARS_SEEN, _LINEARS_BY_KEY, m, _recognise_linear)


_LINEARS_SEEN: dict[int, tuple[nn.Module, dict[str, Any] | None]] = {}


def activation_of(m: nn.Module) -> dict[str, Any] | None:
    """{"op": name} when module `m`, holding no parameters, buffers or submodules and not one
    of torch's own, computes one of the activations the elementwise op runs (`ACTIVATIONS`)
    whatever its code (Hugging Face's NewGELUActivation writes the tanh GELU as
    `0.5 * x * (1 + tanh(...pow(x, 3)))`), found by running it on a small random input."""
    return _seen(_ACTIVATIONS_SEEN, _ACTIVATIONS_BY_KEY, m, _recognise_activation)


_ACTIVATIONS_SEEN: dict[int, tuple[nn.Module, dict[str, Any] | None]] = {}
# the elementwise op's unary functions (planner.costs.kernels runs them by these names)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def _recognise_activation(m: nn.Module) -> dict[str, Any] | None:
    if _torch_own(m) or any(True for _ in itertools.chain(m.parameters(), m.buffers())):
        return None
    if any(True for _ in m.children()):
        return None
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    try:
        with torch.no_grad():
            y = m(x)
    except Exception:  # noqa: BLE001 - not a module of one tensor in, one out
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
        return None
    for name, fn in ACTIVATIONS.items():
        if torch.allclose(y, fn(x), rtol=1e-12, atol=1e-12):
            return {"op": name}
    return None


# what recognising a module found, by `module_key`: a model's 80 layers' norms are one
# class with one width and eps, recognised once (each run took 0.1-0.2 s on a busy machine)
_NORMS_BY_KEY: dict[Hashable, dict[str, Any] | None] = {}
_LINEARS_BY_KEY: dict[Hashable, dict[str, Any] | None] = {}
_ACTIVATIONS_BY_KEY: dict[Hashable, dict[str, Any] | None] = {}


def _seen(
    cache: dict[int, tuple[nn.Module, dict[str, Any] | None]],
    by_key: dict[Hashable, dict[str, Any] | None],
    m: nn.Module,
    recognise: Callable[[nn.Module], dict[str, Any] | None],
) -> dict[str, Any] | None:
    """`recognise(m)`, once per module (the cache keeps the module: ids are reused) and once
    per `module_key` (everything the run depends on: class, parameter shapes, attributes);
    a module without a key is recognised itself."""
    hit = cache.get(id(m))
    if hit is not None and hit[0] is m:
        return hit[1]
    key = module_key(m)
    if key is not None and key in by_key:
        found = by_key[key]
    else:
        found = recognise(m)
        if key is not None:
            by_key[key] = found
    cache[id(m)] = (m, found)
    return found


def _recognise_linear(m: nn.Module) -> dict[str, Any] | None:
    params = dict(m.named_parameters())
    if _torch_own(m) or set(params) not in ({"weight"}, {"weight", "bias"}):
        return None
    if list(m.buffers()) or any(True for _ in m.children()) or params["weight"].dim() != 2:
        return None
    n_in, n_out = (int(s) for s in params["weight"].shape)
    if "bias" in params and tuple(params["bias"].shape) != (n_out,):
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, n_in, generator=g, dtype=torch.float64)
    state = {
        n: torch.randn(tuple(p.shape), generator=g, dtype=torch.float64) for n, p in params.items()
    }
    try:
        with torch.no_grad():
            y = torch.func.functional_call(m, state, (x,))
    except Exception:  # noqa: BLE001 - not a module of one tensor in, one out
        return None
    want = x @ state["weight"] + state.get("bias", 0.0)
    if not isinstance(y, torch.Tensor) or y.shape != want.shape:
        return None
    return {"transposed": True} if torch.allclose(y, want, rtol=1e-12, atol=1e-12) else None


def _torch_own(m: nn.Module) -> bool:
    """A module of torch.nn itself (nn.Linear, nn.Embedding, ...), whose kind its class says:
    never run to be recognised (a 51,200 x 10,240 embedding's random stand-in alone would take
    4 GiB and 17 s)."""
    return type(m).__module__.startswith("torch.nn.")


def _recognise_norm(m: nn.Module) -> dict[str, Any] | None:
    params = dict(m.named_parameters())
    if set(params) not in ({"weight"}, {"weight", "bias"}) or list(m.buffers()):
        return None
    if any(True for _ in m.children()) or params["weight"].dim() != 1:
        return None
    width = int(params["weight"].shape[0])
    if width < 2 or any(p.shape != (width,) for p in params.values()):
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, width, generator=g, dtype=torch.float64) * 1e-3  # eps matters
    state = {n: torch.randn(width, generator=g, dtype=torch.float64) + 1.0 for n in params}
    try:
        with torch.no_grad():
            y = torch.func.functional_call(m, state, (x,))
    except Exception:  # noqa: BLE001 - not a module of one tensor in, one out
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    w, b = state["weight"], state.get("bias")
    own = [float(getattr(m, n)) for n in NORM_EPS_NAMES if isinstance(getattr(m, n, None), float)]
    if getattr(m, "eps", 0) is None:  # nn.RMSNorm(eps=None): the dtype's machine epsilon
        own.append(float(torch.finfo(torch.float64).eps))
    for eps in (*own, *_EPS_GUESSES):
        for compute in (torch.float64, torch.float32):
            if b is not None:
                xc = x.to(compute)
                ref = F.layer_norm(xc, (width,), None, None, eps).to(x.dtype) * w + b
                if torch.allclose(y, ref, rtol=1e-12, atol=0.0):
                    return {"norm": "layer", "eps": eps} | _compute(compute)
                continue
            # RMS norms: the scale weight or 1 + weight (Gemma), after the cast back to the
            # input's dtype (Llama) or before it (Gemma)
            for offset, inside in itertools.product((0.0, 1.0), (False, True)):
                if inside and compute == torch.float64:
                    continue  # the same as after
                attrs: dict[str, Any] = {"norm": "rms", "eps": eps} | _compute(compute)
                attrs |= {"offset": offset} if offset else {}
                attrs |= {"weight": "inside"} if inside else {}
                if torch.allclose(y, rms_norm(x, w, attrs), rtol=1e-12, atol=0.0):
                    return attrs
    return None


def _compute(dtype: torch.dtype) -> dict[str, Any]:
    return {"compute": "float32"} if dtype == torch.float32 else {}


def _trace(
    module: nn.Module,
    leaf_modules: tuple[type[nn.Module], ...],
    name: str,
    inputs: tuple[Any, ...] = (),
) -> fx.GraphModule:
    params = list(inspect.signature(module.forward).parameters.values())
    # forward's arguments beyond the example inputs keep their defaults (targets=None: the
    # branch that returns logits is traced, not the one that computes a loss)
    concrete = {
        p.name: p.default for p in params[len(inputs) :] if p.default is not inspect.Parameter.empty
    }
    meta = {
        p.name: _to_meta(x)
        for p, x in zip(params, inputs, strict=False)
        if isinstance(x, torch.Tensor) and p.kind is not inspect.Parameter.VAR_POSITIONAL
    }
    try:
        # norms are recognised by running them, which cannot happen while fx traces
        moes = _moe_leaves(module, leaf_modules)
        norms = {
            id(m): norm_of(m) or linear_of(m) or moe_of(m) or activation_of(m)
            for m in _traced_modules(module, moes)
            if not isinstance(m, leaf_modules)
        }
        tracer = _Tracer(leaf_modules, norms, moes)
        # the model's own tensors as meta ones in TRACE_DTYPE while it traces, as its leaves
        # run: code that reads a parameter's dtype (Hugging Face's `self.dtype` for a mask's
        # fill value) agrees with the traced activations'
        # (parameters stay Parameters: fx names one read directly, as F.embedding(x, w))
        state = {
            k: nn.Parameter(_to_meta(v), v.requires_grad)
            for k, v in module.named_parameters(remove_duplicate=False)
        } | {k: _to_meta(v) for k, v in module.named_buffers(remove_duplicate=False)}
        try:
            with _reparametrize_module(module, state):
                graph = tracer.trace(module, meta, concrete_args=concrete or None)
            gm = fx.GraphModule(module, graph)  # with the modules the tracer added, then
        finally:
            _remove(module, tracer.inserted)  # the caller's model as it was (gm keeps refs)
    except Exception as exc:  # fx raises many kinds: TraceError, TypeError, NotImplementedError
        unread = unread_moe(module)
        if unread is not None:
            raise GraphError(
                f"torch.fx could not trace {name!r} ({type(exc).__name__}); "
                + refusal(f"module {unread!r}{unread_reason(module, unread)}")
            ) from exc
        raise GraphError(
            f"torch.fx could not trace {name!r}{_origin(exc)}: {type(exc).__name__}: {exc}"
        ) from exc
    gm.meta["moe"] = {
        str(n.target): moes[id(gm.get_submodule(str(n.target)))]
        for n in graph.nodes
        if n.op == "call_module" and id(gm.get_submodule(str(n.target))) in moes
    }
    return gm


_LIBRARY_DIRS = tuple(
    str(Path(m.__file__).resolve().parent) for m in (torch, fx) if m.__file__ is not None
) + (str(Path(__file__).resolve().parents[1]),)


def _remove(module: nn.Module, names: list[str]) -> None:
    for name in names:
        module._modules.pop(name, None)


def _origin(exc: BaseException) -> str:
    """' in Class.method (file:line: `code`)': the model's own line that tracing stopped at
    (the innermost frame outside torch and layerwise), or '' when there is none."""
    tb, found = exc.__traceback__, None
    while tb is not None:  # frame objects, to name the class whose method it is
        path = str(Path(tb.tb_frame.f_code.co_filename).resolve())
        if not path.startswith(_LIBRARY_DIRS) and "/torch/" not in path:
            found = tb
        tb = tb.tb_next
    if found is None:
        return ""
    frame = found.tb_frame
    owner = frame.f_locals.get("self")
    where = frame.f_code.co_name
    if isinstance(owner, nn.Module):
        where = f"{type(owner).__name__}.{where}"
    line = linecache.getline(frame.f_code.co_filename, found.tb_lineno).strip()
    file = Path(frame.f_code.co_filename).name
    return f" in {where} ({file}:{found.tb_lineno}: `{line}`)"


def _traced_modules(module: nn.Module, moes: dict[int, MoEFound]) -> Iterator[nn.Module]:
    """module's submodules but those inside a mixture of experts (a leaf: never traced)."""
    inside = None  # named_modules is depth first: a leaf's submodules follow it
    for name, m in module.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        if id(m) in moes:
            inside = f"{name}." if name else ""
        yield m


def _moe_leaves(
    module: nn.Module, leaf_modules: tuple[type[nn.Module], ...]
) -> dict[int, MoEFound]:
    """The mixtures of experts among module's submodules, recognised or declared, by id."""
    out: dict[int, MoEFound] = {}
    inside = None
    for name, m in module.named_modules():
        if inside is not None and name.startswith(inside) or isinstance(m, leaf_modules):
            continue
        found = declared_moe(m) or moe_found(m)
        if found is not None:
            out[id(m)] = found
            inside = f"{name}." if name else ""
    return out


TRACE_DTYPE = torch.float64
"""Floating tensors are traced and run on meta in this dtype, whatever the model's: code that
reads a tensor's dtype (`x.to(w.dtype)`, `torch.full(..., dtype=w.dtype)`) is then traced as
it runs in float64, and a cast to float32 (`.float()`, as Meta's RMSNorm does) stays
visible. Sizes in bytes are reported in the model's own dtype (`_Builder.float_bytes`)."""


def _to_meta(x: Any) -> Any:
    """A meta copy of a tensor to trace with: floating point in TRACE_DTYPE."""
    if not isinstance(x, torch.Tensor):
        return x
    dtype = TRACE_DTYPE if x.is_floating_point() else x.dtype
    if x.device.type != "meta" or x.dtype != dtype:
        return torch.empty_like(x, device="meta", dtype=dtype)
    return x


def _float_bytes(module: nn.Module, inputs: tuple[Any, ...]) -> int:
    """Bytes per element of the model's floating tensors: its parameters' (or its float
    inputs'), 4 when it has neither."""
    for t in itertools.chain(module.parameters(), module.buffers(), inputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return int(t.element_size())
    return 4


def _batch_size(inputs: tuple[Any, ...], name: str) -> int:
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    raise GraphError(
        f"capture of {name!r} needs at least one example input tensor with a batch dim"
    )


class _Recorder(fx.Interpreter):
    """Runs the graph on meta tensors, keeping every node's value and forward FLOPs."""

    def __init__(
        self, gm: fx.GraphModule, counter: FlopCounterMode, deadline: Deadline | None
    ) -> None:
        super().__init__(gm)
        self.counter = counter
        self.deadline = deadline
        self.values: dict[fx.Node, Any] = {}
        self.flops: dict[fx.Node, int] = {}
        self.moes: dict[str, MoEFound] = gm.meta.get("moe", {})

    def run_node(self, n: fx.Node) -> Any:
        if self.deadline is not None:
            self.deadline.check()
        found = self.moes.get(str(n.target)) if n.op == "call_module" else None
        if found is not None:  # output meta and analytic FLOPs (module docstring)
            args, _ = self.fetch_args_kwargs_from_env(n)
            out = found.output(args[0])
            self.flops[n] = int(found.flops(args[0].shape))
            self.values[n] = out
            return out
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        self.flops[n] = self.counter.get_total_flops() - before
        self.values[n] = out
        return out


class _MetaRun(nn.Module):
    """Lets `functional_call` swap the graph module's weights for meta copies while it runs."""

    def __init__(self, gm: fx.GraphModule, recorder: _Recorder) -> None:
        super().__init__()
        self.gm = gm
        self.recorder = recorder

    def forward(self, *args: Any) -> Any:
        return self.recorder.run(*args)


def _run_on_meta(
    gm: fx.GraphModule, inputs: tuple[Any, ...], name: str, deadline: Deadline | None = None
) -> tuple[dict[fx.Node, Any], dict[fx.Node, int]]:
    counter = FlopCounterMode(display=False)
    recorder = _Recorder(gm, counter, deadline)
    runner = _MetaRun(gm, recorder)
    state: dict[str, Any] = {}
    seen: set[int] = set()
    for k, v in runner.state_dict(keep_vars=True).items():
        if id(v) not in seen:  # a tied weight once: functional_call ties the other names
            seen.add(id(v))
            state[k] = _to_meta(v)
    # The graph was fixed when traced (train mode keeps e.g. Inception's aux head); leaves run
    # in eval mode so that batch norm accepts a batch of one image and keeps its statistics.
    training = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        with counter:
            torch.func.functional_call(runner, state, inputs)
    except (GraphError, OutOfTime):
        raise
    except Exception as exc:
        failure = f"running {name!r} on meta tensors failed: {type(exc).__name__}"
        topk = _topk_node(gm)
        if topk is not None:
            raise GraphError(f"{failure}; " + refusal(_where(topk))) from exc
        raise GraphError(f"{failure}: " + (str(exc).splitlines() or [""])[0]) from exc
    finally:
        for m, flag in training.items():
            m.training = flag
    return recorder.values, recorder.flops


# -- fx nodes to ops ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    """What an fx node stands for: an op's output, an LSTM cell state, a slice of an input op,
    a parameter (get_attr), or nothing (ints, sizes)."""

    kind: str  # "op" | "state" | "select" | "param" | "none" | "const" | "split" | "logits"
    op: str = ""
    select: tuple[str, int] | None = None
    params: tuple[tuple[str, torch.Tensor], ...] = ()
    pieces: tuple[tuple[str, int], ...] = ()  # "split": per piece, (dim, start)


@dataclass
class _Pending:
    """An op before its parameter group is known."""

    op: Op
    owner: str  # the module path (or parameter names) that names a shared group
    key: frozenset[int] = field(default_factory=frozenset)  # ids of its parameter tensors


class _Builder:
    def __init__(
        self,
        gm: fx.GraphModule,
        values: dict[fx.Node, Any],
        flops: dict[fx.Node, int],
        batch: int,
        canonical: dict[int, str] | None = None,
        float_bytes: int = 4,
    ) -> None:
        self.gm = gm
        self.float_bytes = float_bytes  # the model's float size (traced in TRACE_DTYPE)
        self.canonical = canonical or {}
        self.declared: list[tuple[fx.Node, nn.Module]] = []  # checked after the build
        self.node_op: dict[fx.Node, str] = {}
        self.values = values
        self.flops = flops
        self.batch = batch
        self.refs: dict[fx.Node, _Ref] = {}
        self.ops: list[_Pending] = []
        self.by_name: dict[str, Op] = {}
        self.name_counts: Counter[str] = Counter()
        self.module_calls = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_module")
        self.module_seen: Counter[str] = Counter()

    # entry point -------------------------------------------------------------------------------

    def build(self) -> tuple[Op, ...]:
        self._refuse_loss()
        self.constant = _constants(self.gm, self.values)
        regions = find_regions(
            self.gm, self.values, self.flops, self.constant, self._sequence, norm_of
        )
        self.exit_of = {r.exit: r for r in regions}
        self.in_region = {n for r in regions for n in r.nodes}
        self.split_source: dict[fx.Node, fx.Node] = {}
        for node in self.gm.graph.nodes:
            if node.op == "output":
                self._loss_heads(node)
                continue
            self.refs[node] = self._visit(node)
        return self._assign_param_groups()

    def _sequence(self, node: fx.Node) -> bool:
        """Whether node's value is a (batch, length, channel) float tensor."""
        value = self.values.get(node)
        return (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.dim() == 3
            and int(value.shape[0]) == self.batch
        )

    def _visit(self, node: fx.Node) -> _Ref:
        region = self.exit_of.get(node)
        if region is not None:
            ref = self._add(
                node,
                "attention",
                dict(region.attrs),
                args=list(region.inputs),
                flops=region.flops,
                name=self._region_name(node),
                params=region.params(self.gm),
            )
            if region.packed:
                self._unpack(ref.op)
            return ref
        if node in self.in_region:
            return _Ref("none")
        if node in self.constant and node.op != "get_attr":
            return self._constant(node)
        if node.op == "placeholder":
            if not isinstance(self.values[node], torch.Tensor):
                return _Ref("none")  # an argument left at its default (targets=None)
            return self._add(node, "input", {}, name=self._unique(str(node.target)))
        if node.op == "get_attr":
            value = self._attribute(str(node.target))  # the model's own tensor (its dtype)
            if not isinstance(value, torch.Tensor):
                return _Ref("none")
            return _Ref("param", params=((str(node.target), value),))
        logits = [r for a in _node_args(node) if (r := self.refs.get(a)) and r.kind == "logits"]
        if logits:
            raise self._logits_read(node, logits[0])
        folded = self._fold(node)
        if folded is not None:
            if self.flops.get(node, 0):
                raise GraphError(
                    f"fx node {node.name!r} ({_target(node)}) has FLOPs but no op kind"
                )
            return folded
        kind, attrs = self._classify(node)
        operand = attrs.pop("_operand", None)  # a constant factor, not an input or parameter
        if operand is not None:
            return self._add(
                node, kind, attrs, args=[a for a in _node_args(node) if a is not operand]
            )
        return self._add(node, kind, attrs)

    # nodes computed without the inputs, regions, loss heads ----------------------------------

    def _constant(self, node: fx.Node) -> _Ref:
        """A node computed without the inputs: a position embedding (an embedding of
        positions 0..T-1, added to the tokens' embedding) is its weight, read by the op that
        adds it (which uses the rows of its length range); anything else is a constant that
        only attention may read (a mask, a size)."""
        if _is_no_op(node, self.values):  # pos_emb.to(x.device) as Hugging Face's GPT-2 writes
            return self._same_as_input(node)
        if node.op == "call_module" and isinstance(self._module(node), nn.Embedding):
            index = evaluate_constant(self._tensor_args(node)[0], self.values)
            if isinstance(index, torch.Tensor):  # (T,) or shaped to broadcast, as (1, T)
                index = index.reshape(-1) if max(index.shape, default=0) == index.numel() else index
            rows = int(index.numel()) if isinstance(index, torch.Tensor) else -1
            if (
                isinstance(index, torch.Tensor)
                and index.dim() == 1
                and torch.equal(index.cpu(), torch.arange(rows, dtype=index.dtype))
            ):
                weight = self._module(node).weight
                assert isinstance(weight, torch.Tensor)
                return _Ref("param", params=((f"{node.target}.weight", weight),))
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) looks up rows that do not depend on "
                "the inputs; layerwise reads that only as positions 0, 1, ..., T-1 "
                "(torch.arange(T))"
            )
        return _Ref("const")

    def _unpack(self, name: str) -> None:
        """Attention op `name` reads one tensor three times (q, k and v packed in one
        projection): it reads its thirds through three slice ops instead."""
        pending = self.ops[-1]
        src = self._op(pending.op.inputs[0])
        third = src.output.size(CHANNEL) // 3
        shape = tuple((d, third if d == CHANNEL else n) for d, n in src.output.shape)
        out = Tensor(shape, src.output.dtype_bytes)
        names = []
        for i, role in enumerate(("q", "k", "v")):
            piece = Op(
                name=self._unique(f"{name}.{role}"),
                kind="slice",
                inputs=(src.name,),
                output=out,
                params=(),
                flops=0.0,
                mem_bytes=float(2 * out.nbytes),
                attrs=Op.make_attrs({"dim": CHANNEL, "start": i * third, "size": third}),
            )
            self.ops.insert(len(self.ops) - 1, _Pending(piece, ""))
            self.by_name[piece.name] = piece
            names.append(piece.name)
        op = dataclasses.replace(pending.op, inputs=tuple(names))
        self.ops[-1] = _Pending(op, pending.owner, pending.key)
        self.by_name[name] = op

    def _region_name(self, node: fx.Node) -> str:
        stack = node.meta.get("nn_module_stack") or OrderedDict()
        prefix = list(stack.values())[-1][0] if stack else ""
        return self._unique(f"{prefix}.attention" if prefix else "attention")

    def _refuse_loss(self) -> None:
        """Refuse a model that computes its loss in forward: a loss function or module
        anywhere, or a scalar returned (`.mean()` of the gathered log-probabilities). The
        runtime feeds the model inputs only and computes the loss itself, so no op kind
        stands for it (planned as a softmax it was another computation: issue 42)."""
        found = next((n for n in self.gm.graph.nodes if self._is_loss(n)), None)
        if found is None:
            output = next(n for n in self.gm.graph.nodes if n.op == "output")
            scalars = [a for a in _node_args(output) if _is_scalar(self.values.get(a))]
            found = self._reduction(scalars[0]) if scalars else None
        if found is not None:
            raise GraphError(
                f"fx node {found.name!r} ({_target(found)}) computes a loss inside forward; "
                "return the logits (or log-probabilities) and compute the loss outside "
                "forward: the runtime trains with the cross-entropy of the model's outputs "
                "(a forward(x, targets=None) traces without its loss when example_inputs "
                "leave the targets out)"
            )

    def _reduction(self, node: fx.Node) -> fx.Node:
        """The node that first reduced the scalar `node` to a scalar (the mean of `-x.mean()`)."""
        while True:
            scalars = [a for a in _node_args(node) if _is_scalar(self.values.get(a))]
            if not scalars:
                return node
            node = scalars[0]

    def _is_loss(self, node: fx.Node) -> bool:
        if node.op == "call_function":
            return node.target in _LOSS_FUNCTIONS
        if node.op == "call_module":
            return isinstance(self._module(node), nn.modules.loss._Loss)
        return False

    def _loss_heads(self, output: fx.Node) -> None:
        """A model that returns logits (as language models do) is trained on their
        cross-entropy: each float output with classes that is not a softmax gets a
        log_softmax op of its own (attr implicit: the model does not compute it; the runtime
        and its reference apply it to the model's output)."""
        for arg in _node_args(output):
            ref = self.refs.get(arg)
            if ref is not None and ref.kind == "logits":
                raise self._logits_read(output, ref)
            if ref is None or ref.kind != "op":
                continue
            op = self._op(ref.op)
            if op.kind in ("softmax", "input") or CHANNEL not in op.output.dims:
                continue
            if any(p.op.inputs and ref.op in p.op.inputs for p in self.ops):
                continue  # read by another op too: not only an output
            out_bytes = op.output.nbytes
            head = Op(
                name=self._unique(f"{ref.op}.loss"),
                kind="softmax",
                inputs=(ref.op,),
                output=op.output,
                params=(),
                flops=0.0,
                mem_bytes=float(2 * out_bytes),
                attrs=Op.make_attrs({"op": "log_softmax", "implicit": True}),
            )
            self.ops.append(_Pending(head, ""))
            self.by_name[head.name] = head

    # nodes that carry no compute ---------------------------------------------------------------

    def _fold(self, node: fx.Node) -> _Ref | None:
        value = self.values[node]
        if node.op == "call_function" and node.target is operator.getitem:
            return self._getitem(node)
        if _is_split(node) and isinstance(value, tuple | list):
            return self._split(node, value)
        if node.op == "call_module" and isinstance(self._module(node), nn.Identity):
            return self._same_as_input(node)
        if _is_no_op(node, self.values):
            return self._same_as_input(node)
        if node.op == "call_function" and node.target in _NO_OP_FUNCTIONS:
            return self._same_as_input(node)
        if self._is_reshape(node) and isinstance(value, torch.Tensor):
            src = self._tensor_args(node)[0]
            if tuple(self.values[src].shape) == tuple(value.shape):
                return self._same_as_input(node)
            return None
        if not _is_tensor_like(value):
            return _Ref("none")  # x.size(0), x.dim(), shapes: metadata only
        return None

    def _same_as_input(self, node: fx.Node) -> _Ref:
        return self.refs[self._tensor_args(node)[0]]

    def _split(self, node: fx.Node, pieces: Any) -> _Ref:
        """split/chunk/unbind of a tensor into pieces along one dim: each piece read (x[i])
        becomes a slice op."""
        src = self._tensor_args(node)[0]
        ref = self.refs[src]
        value = self.values[src]
        names = _dim_names(value)
        if ref.kind != "op" or names is None:
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) splits {src.name!r}, which is not an "
                "op's (sample, ...) output"
            )
        if node.target in ("unbind", torch.unbind):
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}): unbind removes a dim; use split or "
                "chunk, which keep it"
            )
        dim = int(_arg(node, 2, "dim", 0)) % value.dim()
        starts, at = [], 0
        for piece in pieces:
            starts.append((names[dim], at))
            at += int(piece.shape[dim])
        self.split_source[node] = src
        return _Ref("split", ref.op, pieces=tuple(starts))

    def _getitem(self, node: fx.Node) -> _Ref:
        src, index = node.args[0], node.args[1]
        assert isinstance(src, fx.Node)
        ref = self.refs[src]
        src_value = self.values[src]
        if ref.kind == "split":
            assert isinstance(index, int)
            dim, start = ref.pieces[index]
            names = _dim_names(src_value[0]) or ()
            size = int(self.values[node].shape[names.index(dim)])
            return self._add(
                node,
                "slice",
                {"dim": dim, "start": start, "size": size},
                args=[self.split_source[src]],
            )
        if isinstance(src_value, tuple | list):
            if ref.kind == "op" and self._op(ref.op).kind == "lstm" and index in (0, 1):
                return ref if index == 0 else _Ref("state", ref.op)
            if ref.kind == "op" and self._op(ref.op).kind == "moe" and index in (0, 1):
                return ref if index == 0 else _Ref("logits", ref.op)  # refused when read
            if not any(isinstance(v, torch.Tensor) for v in src_value):
                return _Ref("none")
            raise GraphError(
                f"fx node {node.name!r} takes item {index!r} of the tuple produced by "
                f"{src.name!r} ({_target(src)}); only an LSTM cell's (h, c) can be unpacked"
            )
        if not isinstance(src_value, torch.Tensor):
            return _Ref("none")
        # Slicing one step out of an input tensor (tokens[:, t]): the consumer reads the input
        # op and records the step in attr "select"; a range of a computed tensor is a slice.
        if ref.kind == "op" and self._op(ref.op).kind == "input":
            select = _select_index(index, self._op(ref.op).output)
            if select is not None:
                return _Ref("select", ref.op, select=select)
        piece = _range_index(index, tuple(src_value.shape))
        dims = _dim_names(src_value)
        if ref.kind == "op" and piece is not None and dims is not None and piece[0] > 0:
            axis, start, size = piece  # x[:, a:b]: a range of one dim (not the samples)
            attrs = {"dim": dims[axis], "start": start, "size": size}
            return self._add(node, "slice", attrs, args=[src])
        raise GraphError(
            f"fx node {node.name!r} slices {src.name!r} with {index!r}; layerwise reads a range "
            "of one dim other than the samples (x[:, a:b]) and one step of an input tensor "
            "(x[:, t]); an index that drops a dim has no op kind"
        )

    # mapping to op kinds -------------------------------------------------------------------------

    def _classify(self, node: fx.Node) -> tuple[str, dict[str, Any]]:
        if node.op == "call_module":
            return self._classify_module(node, self._module(node))
        if node.op == "call_function":
            return self._classify_function(node)
        if node.op == "call_method":
            return self._classify_method(node)
        raise self._unmappable(node)

    def _classify_module(self, node: fx.Node, m: nn.Module) -> tuple[str, dict[str, Any]]:
        declared = getattr(type(m), "layerwise_kind", None)
        if declared is not None:
            attrs_fn = getattr(m, "layerwise_attrs", None)
            self.declared.append((node, m))
            return str(declared), dict(attrs_fn()) if callable(attrs_fn) else {}
        moe = moe_found(m)
        if moe is not None:
            return "moe", dict(moe.attrs)
        found = None if isinstance(m, nn.LayerNorm | nn.BatchNorm2d) else norm_of(m)
        if found is not None:
            return "norm", dict(found)
        if not isinstance(m, nn.Linear) and linear_of(m) is not None:
            return "linear", {"transposed": True}
        activation = activation_of(m)
        if activation is not None:
            return "elementwise", dict(activation)
        if isinstance(m, nn.Conv2d):
            return "conv2d", _conv_attrs(node, m)
        if isinstance(m, nn.MaxPool2d | nn.AvgPool2d):
            mode = "max" if isinstance(m, nn.MaxPool2d) else "avg"
            dilation = m.dilation if isinstance(m, nn.MaxPool2d) else 1
            return "pool2d", _pool_attrs(m.kernel_size, m.stride, m.padding, dilation, mode)
        if isinstance(m, nn.AdaptiveAvgPool2d | nn.AdaptiveMaxPool2d):
            mode = "max" if isinstance(m, nn.AdaptiveMaxPool2d) else "avg"
            return "pool2d", self._adaptive_attrs(node, mode)
        if isinstance(m, nn.BatchNorm2d):
            return "norm", {"norm": "batch"}
        if isinstance(m, nn.LayerNorm):
            if len(m.normalized_shape) != 1:
                raise GraphError(f"LayerNorm {node.target!r} must normalize the last dim only")
            return "norm", {"norm": "layer"}
        if isinstance(m, nn.GELU) and m.approximate == "tanh":
            return "elementwise", {"op": "gelu_tanh"}
        if isinstance(m, _ACTIVATION_MODULES):
            return "elementwise", {"op": type(m).__name__.lower()}
        if isinstance(m, nn.Linear):
            return "linear", {}
        if isinstance(m, nn.Embedding):
            return "embedding", {}
        if isinstance(m, nn.LSTMCell):
            return "lstm", {}
        if isinstance(m, nn.Softmax | nn.LogSoftmax):
            self._check_softmax_dim(node, m.dim)
            return "softmax", {"op": type(m).__name__.lower()}
        if isinstance(m, nn.Flatten):
            return self._flatten(node)
        raise self._unmappable(node)

    def _classify_function(self, node: fx.Node) -> tuple[str, dict[str, Any]]:
        t = node.target
        if t is F.gelu and _arg(node, 1, "approximate", "none") == "tanh":
            return "elementwise", {"op": "gelu_tanh"}
        if t in _POINTWISE_FUNCTIONS:
            return "elementwise", {"op": _fn_name(t)} | self._scalar(node)
        if t in _SOFTMAX_FUNCTIONS:
            self._check_softmax_dim(node, _arg(node, 1, "dim", None))
            return "softmax", {"op": _fn_name(t)}
        if t is F.linear:  # a weight read by F.linear (a head tied to the embedding)
            return "linear", {}
        if t is F.embedding:  # nn.Embedding.forward called by a subclass's own forward
            return "embedding", {}
        if t is torch.cat:
            return "concat", self._concat_attrs(node)
        if t is torch.flatten:
            return self._flatten(node)
        if t in (F.max_pool2d, F.avg_pool2d):
            mode = "max" if t is F.max_pool2d else "avg"
            kernel = _arg(node, 1, "kernel_size", None)
            stride = _arg(node, 2, "stride", None) or kernel
            padding = _arg(node, 3, "padding", 0)
            dilation = _arg(node, 4, "dilation", 1) if mode == "max" else 1
            return "pool2d", _pool_attrs(kernel, stride, padding, dilation, mode)
        if t in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
            mode = "max" if t is F.adaptive_max_pool2d else "avg"
            return "pool2d", self._adaptive_attrs(node, mode)
        raise self._unmappable(node)

    def _classify_method(self, node: fx.Node) -> tuple[str, dict[str, Any]]:
        t = str(node.target)
        if t in _POINTWISE_METHODS:
            return "elementwise", {"op": t.strip("_")} | self._scalar(node)
        if t in ("softmax", "log_softmax"):
            self._check_softmax_dim(node, _arg(node, 1, "dim", None))
            return "softmax", {"op": t}
        if t in _RESHAPE_METHODS:
            return self._flatten(node)
        raise self._unmappable(node)

    def _scalar(self, node: fx.Node) -> dict[str, Any]:
        """A binary pointwise op's number operand (`x * 0.5`, `1.0 - x`, `x / cap`) as attrs
        scalar (and scalar_first when it comes first), which the elementwise kernel applies.
        A 0-d tensor computed without the inputs (Gemma's embedding scale, a buffer) is its
        value when it can be computed here, else attr scalar_node names its fx node, whose
        value the runtime computes from the model (`constant_values`); "_operand" tells
        `_visit` not to read it as a parameter."""
        found: list[tuple[int, dict[str, Any]]] = []
        for pos, a in enumerate(node.args[:2]):
            v: Any = self.values.get(a) if isinstance(a, fx.Node) else a
            if _is_number(v):
                found.append((pos, {"scalar": float(v)}))
            elif (
                isinstance(a, fx.Node)
                and a in self.constant
                and isinstance(v, torch.Tensor)
                and v.dim() == 0
                and v.is_floating_point()
            ):
                real = evaluate_constant(a, self.values)
                known = isinstance(real, torch.Tensor) and not real.is_meta
                attrs: dict[str, Any] = (
                    {"scalar": float(real)} if known else {"scalar_node": a.name}
                )
                found.append((pos, attrs | {"_operand": a}))
        if len(node.args) < 2 or len(found) != 1:
            return {}
        pos, attrs = found[0]
        return attrs | ({"scalar_first": True} if pos == 0 else {})

    def _is_reshape(self, node: fx.Node) -> bool:
        if node.op == "call_method":
            return node.target in _RESHAPE_METHODS
        if node.op == "call_function":
            return node.target in (torch.flatten, torch.reshape)
        return node.op == "call_module" and isinstance(self._module(node), nn.Flatten)

    def _flatten(self, node: fx.Node) -> tuple[str, dict[str, Any]]:
        value = self.values[node]
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point():
            return "flatten", {}
        raise GraphError(
            f"fx node {node.name!r} ({_target(node)}) reshapes to {tuple(value.shape)}; only a "
            "flatten to (sample, features) has an op kind"
        )

    def _check_softmax_dim(self, node: fx.Node, dim: Any) -> None:
        value = self.values[node]
        if dim is None or not isinstance(value, torch.Tensor):
            return
        names = _dim_names(value)
        if names is None or names[int(dim) % value.dim()] != CHANNEL:
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}): softmax must run over the channel dim"
            )

    def _adaptive_attrs(self, node: fx.Node, mode: str) -> dict[str, Any]:
        src = self.values[self._tensor_args(node)[0]]
        out = self.values[node]
        h_in, w_in = int(src.shape[-2]), int(src.shape[-1])
        h_out, w_out = int(out.shape[-2]), int(out.shape[-1])
        if h_out > h_in or w_out > w_in:
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) pools {h_in}x{w_in} up to "
                f"{h_out}x{w_out}; adaptive pooling must not enlarge (use larger images)"
            )
        # Adaptive pooling as a fixed window: exact when the input size divides evenly.
        sh, sw = h_in // h_out, w_in // w_out
        kernel = (h_in - (h_out - 1) * sh, w_in - (w_out - 1) * sw)
        attrs = _pool_attrs(kernel, (sh, sw), 0, 1, mode)
        attrs["adaptive"] = True
        return attrs

    def _concat_attrs(self, node: fx.Node) -> dict[str, Any]:
        out = self.values[node]
        axis = int(_arg(node, 1, "dim", 0)) % out.dim()
        names = _dim_names(out)
        if names is None:
            raise GraphError(f"fx node {node.name!r}: cannot name the dims of {tuple(out.shape)}")
        tensors = _arg(node, 0, "tensors", [])
        offsets, at = [], 0
        for t in tensors:
            offsets.append(at)
            at += int(self.values[t].shape[axis])
        return {"dim": names[axis], "offsets": offsets}

    # op construction -----------------------------------------------------------------------------

    def _add(
        self,
        node: fx.Node,
        kind: str,
        attrs: dict[str, Any],
        name: str | None = None,
        args: list[fx.Node] | None = None,
        flops: int | None = None,
        params: list[tuple[str, torch.Tensor]] | None = None,
    ) -> _Ref:
        """Node as an op of `kind`; `args` replaces the fx nodes it reads (an attention
        region's q, k, v; a slice's source), `flops` its counted FLOPs, `params` are
        parameters of its own besides its module's (an attention region's QK-norm)."""
        value = self.values[node]
        tuple_out = kind in ("lstm", "moe") and isinstance(value, tuple | list)
        out_value = value[0] if tuple_out else value  # (h, c); (out, router logits)
        output = self._tensor(node, out_value)
        reads = _node_args(node) if args is None else args
        own = params
        inputs, params = self._inputs(node, kind, attrs, reads)
        if kind != "input" and not inputs:
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) reads no activation tensor "
                "(only parameters or constants); fold it into the module that uses it"
            )
        owner, module_params = self._module_params(node)
        module_params += own or []
        params = [(self.canonical.get(id(p), n), p) for n, p in module_params + params]
        op_name = name or self._op_name(node)
        self.node_op[node] = op_name
        param_objs = tuple(p for _, p in params)
        op = Op(
            name=op_name,
            kind=kind,
            inputs=tuple(inputs),
            output=output,
            params=tuple(Param(n, tuple(p.shape), p.element_size()) for n, p in params),
            flops=float(self.flops.get(node, 0) if flops is None else flops),
            mem_bytes=float(self._mem_bytes(node, kind, param_objs, reads)),
            attrs=Op.make_attrs(attrs),
        )
        owner = owner or "+".join(n for n, _ in params)
        self.ops.append(_Pending(op, owner, frozenset(id(p) for p in param_objs)))
        self.by_name[op_name] = op
        return _Ref("op", op_name)

    def _inputs(
        self, node: fx.Node, kind: str, attrs: dict[str, Any], reads: list[fx.Node]
    ) -> tuple[list[str], list[tuple[str, torch.Tensor]]]:
        inputs: list[str] = []
        params: list[tuple[str, torch.Tensor]] = []
        for arg in reads:
            ref = self.refs[arg]
            if ref.kind == "const" and isinstance(self.values.get(arg), torch.Tensor):
                raise GraphError(
                    f"fx node {node.name!r} ({_target(node)}) reads {arg.name!r}, a tensor "
                    "computed without the inputs (from shapes or buffers); layerwise reads "
                    "such tensors only as attention masks and position indices"
                )
            if ref.kind == "logits":
                raise self._logits_read(node, ref)
            if ref.kind == "split":
                raise GraphError(
                    f"fx node {node.name!r} ({_target(node)}) reads the pieces of "
                    f"{arg.name!r} together; read them one by one (q, k, v = x.split(...))"
                )
            if ref.kind == "param":
                params.extend(ref.params)
            elif ref.kind == "op":
                inputs.append(ref.op)
            elif ref.kind == "select":
                assert ref.select is not None
                if "select" in attrs and attrs["select"] != ref.select:
                    raise GraphError(f"fx node {node.name!r} reads two different input steps")
                attrs["select"] = ref.select
                inputs.append(ref.op)
            elif ref.kind == "state":
                if kind != "lstm":
                    raise GraphError(
                        f"fx node {node.name!r} ({_target(node)}) reads the cell state of "
                        f"{ref.op!r}; only another LSTM cell step may"
                    )
                if ref.op not in inputs:
                    inputs.append(ref.op)
        if kind == "lstm":  # x_t, then the previous step (h and c are one op's output)
            inputs = list(dict.fromkeys(inputs))
        return inputs, params

    def _module_params(self, node: fx.Node) -> tuple[str, list[tuple[str, torch.Tensor]]]:
        if node.op != "call_module":
            return "", []
        path = str(node.target)
        return path, [(f"{path}.{n}", p) for n, p in self._module(node).named_parameters()]

    def _itemsize(self, t: torch.Tensor) -> int:
        """Bytes per element in the model (a TRACE_DTYPE tensor has the model's float size)."""
        return self.float_bytes if t.dtype == TRACE_DTYPE else int(t.element_size())

    def _nbytes(self, value: Any) -> int:
        return sum(t.numel() * self._itemsize(t) for t in _tensors(value))

    def _mem_bytes(
        self, node: fx.Node, kind: str, params: tuple[torch.Tensor, ...], reads: list[fx.Node]
    ) -> int:
        moved = sum(self._nbytes(self.values[a]) for a in reads)
        out = self._nbytes(self.values[node])
        if kind == "embedding":  # a lookup reads the rows it gathers, not the whole table
            return moved + 2 * out
        return moved + out + sum(_nbytes(p) for p in params)

    def _tensor(self, node: fx.Node, value: Any) -> Tensor:
        if not isinstance(value, torch.Tensor):
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) produces {type(value).__name__}, "
                "not a tensor"
            )
        names = _dim_names(value)
        if names is None or int(value.shape[0]) != self.batch:
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) produces a tensor of shape "
                f"{tuple(value.shape)} ({value.dtype}); layerwise names the dims of "
                f"(batch={self.batch}, ...) float tensors of rank 2-4 and integer tensors of "
                "rank 1-2"
            )
        return Tensor(
            tuple(zip(names, (int(s) for s in value.shape), strict=True)), self._itemsize(value)
        )

    def _op_name(self, node: fx.Node) -> str:
        if node.op == "call_module":
            path = str(node.target)
            if self.module_calls[path] > 1:
                k = self.module_seen[path]
                self.module_seen[path] += 1
                return self._unique(f"{path}@{k}")
            return self._unique(path)
        stack = node.meta.get("nn_module_stack") or OrderedDict()
        prefix = list(stack.values())[-1][0] if stack else ""
        base = _fn_name(node.target) if node.op == "call_function" else str(node.target)
        return self._unique(f"{prefix}.{base.strip('_')}" if prefix else base.strip("_"))

    def _unique(self, name: str) -> str:
        if name not in self.by_name and self.name_counts[name] == 0:
            self.name_counts[name] += 1
            return name
        while True:
            k = self.name_counts[name]
            self.name_counts[name] += 1
            candidate = f"{name}_{k}"
            if candidate not in self.by_name:
                return candidate

    # parameter groups ----------------------------------------------------------------------------

    def _assign_param_groups(self) -> tuple[Op, ...]:
        """Ops that use exactly the same parameter tensors (one module called at several time
        steps, tied weights) share a param group named after the first user's module path."""
        users: dict[frozenset[int], list[_Pending]] = {}
        for p in self.ops:
            if p.key:
                users.setdefault(p.key, []).append(p)
        keys_of: dict[int, frozenset[int]] = {}
        for key, pending in users.items():
            for pid in key:
                other = keys_of.setdefault(pid, key)
                if other != key:
                    a, b = pending[0].op.name, users[other][0].op.name
                    raise GraphError(
                        f"ops {b!r} and {a!r} share some but not all of their parameters; "
                        "layerwise counts shared parameters by whole parameter groups"
                    )
        out: list[Op] = []
        for p in self.ops:
            group = users.get(p.key, [])
            if len(group) > 1:
                out.append(_replace_group(p.op, group[0].owner))
            else:
                out.append(p.op)
        return tuple(out)

    # helpers ---------------------------------------------------------------------------------

    def _tensor_args(self, node: fx.Node) -> list[fx.Node]:
        args = [a for a in _node_args(node) if isinstance(self.values.get(a), torch.Tensor)]
        if not args:
            raise GraphError(f"fx node {node.name!r} ({_target(node)}) reads no tensor")
        return args

    def _attribute(self, target: str) -> Any:
        owner: Any = self.gm
        for atom in target.split("."):
            owner = getattr(owner, atom, None)
        return owner

    def _module(self, node: fx.Node) -> nn.Module:
        return self.gm.get_submodule(str(node.target))

    def _op(self, name: str) -> Op:
        return self.by_name[name]

    def _logits_read(self, node: fx.Node, ref: _Ref) -> GraphError:
        return GraphError(
            f"fx node {node.name!r} ({_target(node)}) reads the router logits of the mixture "
            f"of experts {ref.op!r}; layerwise computes no auxiliary (load-balancing) loss: "
            "leave the logits unread (the runtime routes without one)"
        )

    def _unmappable(self, node: fx.Node) -> GraphError:
        if _is_topk(node):
            return GraphError(refusal(_where(node)))
        return GraphError(
            f"cannot map fx node {node.name!r} ({_target(node)}) to a layerwise op kind; "
            "supported modules: Conv2d, Linear, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, "
            "BatchNorm2d, LayerNorm, ReLU/GELU/Tanh/Sigmoid/Dropout, Embedding, LSTMCell, "
            "Softmax, Flatten, Identity and modules with a `layerwise_kind`; functions: "
            "pointwise math, torch.cat, torch.flatten, softmax, pooling"
        )


def _is_topk(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target is torch.topk
    return node.op == "call_method" and node.target == "topk"


def _topk_node(gm: fx.GraphModule) -> fx.Node | None:
    """The first top-k in the graph: a router's, in a mixture of experts not read."""
    return next((n for n in gm.graph.nodes if _is_topk(n)), None)


def _where(node: fx.Node) -> str:
    """'fx node N (target) in module M' for a refusal."""
    stack = node.meta.get("nn_module_stack") or OrderedDict()
    module = list(stack.values())[-1][0] if stack else ""
    inside = f" in module {module!r}" if module else ""
    return f"fx node {node.name!r} ({_target(node)}){inside}"


def _constants(gm: fx.GraphModule, values: dict[fx.Node, Any]) -> set[fx.Node]:
    """The nodes whose values do not depend on the inputs' values: parameters and buffers,
    sizes, and what is computed from them alone (arange, ones, tril, a buffer's slice)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            out.add(node)
        elif node.op in ("call_function", "call_method", "call_module"):
            value = values.get(node)
            reads = _node_args(node)
            constant = not _is_tensor_like(value) or all(a in out for a in reads)
            if constant and (node.op != "call_module" or reads):
                out.add(node)
    return out


def _is_no_op(node: fx.Node, values: dict[fx.Node, Any]) -> bool:
    """A method that returns its tensor as it is: contiguous, clone, ..., or `.to(device)` /
    `.to(dtype)` where the dtype does not change (devices do not exist in the graph)."""
    if node.op != "call_method":
        return False
    if node.target in _NO_OP_METHODS:
        return True
    if node.target != "to" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    out, src = values.get(node), values.get(node.args[0])
    return (
        isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) and out.dtype == src.dtype
    )


def _is_split(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("split", "chunk", "unbind", "tensor_split")
    return node.op == "call_function" and node.target in (
        torch.split,
        torch.chunk,
        torch.unbind,
        torch.tensor_split,
    )


def _replace_group(op: Op, group: str) -> Op:
    return Op(
        op.name,
        op.kind,
        op.inputs,
        op.output,
        op.params,
        op.flops,
        op.mem_bytes,
        group,
        op.attrs,
    )


def _target(node: fx.Node) -> str:
    if node.op == "call_module":
        m = node.graph.owning_module
        sub = m.get_submodule(str(node.target)) if m is not None else None
        typ = f"{type(sub).__module__}.{type(sub).__name__}" if sub is not None else "?"
        return f"call_module {node.target}: {typ}"
    if node.op == "call_function":
        return f"call_function {_fn_name(node.target)}"
    return f"{node.op} {node.target}"


def _fn_name(target: Any) -> str:
    if target is F.max_pool2d:
        return "max_pool2d"
    return str(getattr(target, "__name__", target))


def _arg(node: fx.Node, pos: int, key: str, default: Any) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(key, default)


def _node_args(node: fx.Node) -> list[fx.Node]:
    """The fx nodes `node` reads, in argument order (lists and tuples flattened)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _is_tensor_like(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, tuple | list) and any(isinstance(v, torch.Tensor) for v in value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_scalar(value: Any) -> bool:
    """A 0-d floating tensor: a value reduced over the samples too (a loss)."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _tensors(v)


def _dim_names(value: torch.Tensor) -> tuple[str, ...] | None:
    if value.is_floating_point():
        return {
            2: (SAMPLE, CHANNEL),
            3: (SAMPLE, LENGTH, CHANNEL),
            4: (SAMPLE, CHANNEL, HEIGHT, WIDTH),
        }.get(value.dim())
    return {1: (SAMPLE,), 2: (SAMPLE, LENGTH)}.get(value.dim())


def _range_index(index: Any, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(axis, start, size) when `index` takes a contiguous range of one dim and the others
    whole (x[:, a:b], x[..., a:b]); None otherwise."""
    items = index if isinstance(index, tuple) else (index,)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + (slice(None),) * (len(shape) - len(items) + 1) + items[at + 1 :]
    if len(items) > len(shape) or not all(isinstance(i, slice) for i in items):
        return None
    ranges = [(k, i.indices(shape[k])) for k, i in enumerate(items) if i != slice(None)]
    if len(ranges) != 1:
        return None
    axis, (start, stop, step) = ranges[0]
    if step != 1 or stop <= start:
        return None
    return axis, start, stop - start


def _select_index(index: Any, src: Tensor) -> tuple[str, int] | None:
    """(dim, i) when `index` picks one position of one non-sample dim: x[:, i]."""
    if not isinstance(index, tuple) or len(index) != 2:
        return None
    whole, pos = index
    if whole != slice(None) or not isinstance(pos, int) or len(src.shape) < 2:
        return None
    dim, size = src.shape[1]
    return (dim, pos % size)


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    a, b = v
    return (int(a), int(b))


def _pool_attrs(kernel: Any, stride: Any, padding: Any, dilation: Any, mode: str) -> dict[str, Any]:
    return {
        "kernel": _pair(kernel),
        "stride": _pair(stride if stride is not None else kernel),
        "padding": _pair(padding),
        "dilation": _pair(dilation),
        "mode": mode,
    }


def _conv_attrs(node: fx.Node, m: nn.Conv2d) -> dict[str, Any]:
    kernel, dilation = _pair(m.kernel_size), _pair(m.dilation)
    padding: Any = m.padding
    if padding == "valid":
        padding = (0, 0)
    elif padding == "same":
        extents = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        if any(e % 2 for e in extents):
            raise GraphError(f"conv {node.target!r}: padding='same' with an even kernel extent")
        padding = tuple(e // 2 for e in extents)
    if m.padding_mode != "zeros":
        raise GraphError(f"conv {node.target!r}: padding_mode {m.padding_mode!r} is not supported")
    return {
        "kernel": kernel,
        "stride": _pair(m.stride),
        "padding": _pair(padding),
        "dilation": dilation,
        "groups": int(m.groups),
    }
