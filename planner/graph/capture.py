"""Capture an `nn.Module` as an `OpGraph` with torch.fx, on the meta device (no real compute).

`capture(module, example_inputs, name)` traces the module with a tracer whose leaves are the
layers layerwise knows (conv, pool, linear, norms, activations, embedding, LSTM cell and any
module that declares a `layerwise_kind`), runs the traced graph once on meta tensors to get
every node's shape and, under `FlopCounterMode`, its forward FLOPs (2 per multiply-add; only
matmuls, convolutions and attention count, so pointwise ops get 0 FLOPs and their memory
traffic in `mem_bytes`). Every fx node becomes an op of `planner.graph.opkinds` or is folded away
when it carries no compute (getitem, size, identity); anything else raises `GraphError`.

Dimension names: 4D activations (sample, channel, height, width), 3D (sample, length,
channel), 2D (sample, channel); integer token tensors (sample, length) or (sample,).

A module may declare its own op kind: a class attribute `layerwise_kind = "attention"` makes
it a leaf mapped to that kind, with attrs from its `layerwise_attrs()` method if it has one.
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from planner.deadline import Deadline, OutOfTime
from planner.errors import GraphError
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.opkinds import CHANNEL, HEIGHT, LENGTH, SAMPLE, WIDTH

__all__ = ["DEFAULT_LEAF_MODULES", "capture"]

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


def capture(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    name: str,
    leaf_modules: Sequence[type[nn.Module]] = DEFAULT_LEAF_MODULES,
    deadline: Deadline | None = None,
) -> OpGraph:
    """Trace `module` on the meta device and return its validated OpGraph named `name`.
    Past `deadline` (looked at before every node's meta run) it raises OutOfTime."""
    gm = _trace(module, tuple(leaf_modules), name)
    inputs = tuple(_to_meta(x) for x in example_inputs)
    values, flops = _run_on_meta(gm, inputs, name, deadline)
    batch = _batch_size(inputs, name)
    return OpGraph(name, _Builder(gm, values, flops, batch).build())


def warm_up() -> None:
    """Load what a process's first capture loads on its first op, so that a caller with a
    deadline can bound it (`planner.deadline.run_within`): torch runs the meta kernels of its
    Python references, and every dispatch mode, under a guard against torch.compile that
    imports `torch._dynamo` on first use (1.9 s on a quiet 2-core machine, beside the 2.5 s
    of `import torch`; a zoo model's capture after it: 0.07-0.8 s)."""
    import torch._dynamo  # noqa: F401


# -- tracing and shape/FLOP propagation --------------------------------------------------------


class _Tracer(fx.Tracer):
    def __init__(self, leaf_modules: tuple[type[nn.Module], ...]) -> None:
        super().__init__()
        self.leaf_modules = leaf_modules

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_modules) or hasattr(type(m), "layerwise_kind"):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _trace(
    module: nn.Module, leaf_modules: tuple[type[nn.Module], ...], name: str
) -> fx.GraphModule:
    try:
        graph = _Tracer(leaf_modules).trace(module)
    except Exception as exc:  # fx raises many kinds: TraceError, TypeError, NotImplementedError
        raise GraphError(f"torch.fx could not trace {name!r}: {type(exc).__name__}: {exc}") from exc
    return fx.GraphModule(module, graph)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_like(x, device="meta")
    return x


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

    def run_node(self, n: fx.Node) -> Any:
        if self.deadline is not None:
            self.deadline.check()
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
    state = {k: _to_meta(v) for k, v in runner.state_dict(keep_vars=True).items()}
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
        raise GraphError(
            f"running {name!r} on meta tensors failed: {type(exc).__name__}: "
            + (str(exc).splitlines() or [""])[0]
        ) from exc
    finally:
        for m, flag in training.items():
            m.training = flag
    return recorder.values, recorder.flops


# -- fx nodes to ops ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    """What an fx node stands for: an op's output, an LSTM cell state, a slice of an input op,
    a parameter (get_attr), or nothing (ints, sizes)."""

    kind: str  # "op" | "state" | "select" | "param" | "none"
    op: str = ""
    select: tuple[str, int] | None = None
    params: tuple[tuple[str, torch.Tensor], ...] = ()


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
    ) -> None:
        self.gm = gm
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
        for node in self.gm.graph.nodes:
            if node.op == "output":
                continue
            self.refs[node] = self._visit(node)
        return self._assign_param_groups()

    def _visit(self, node: fx.Node) -> _Ref:
        if node.op == "placeholder":
            return self._add(node, "input", {}, name=self._unique(str(node.target)))
        if node.op == "get_attr":
            value = self.values[node]
            if not isinstance(value, torch.Tensor):
                return _Ref("none")
            return _Ref("param", params=((str(node.target), value),))
        folded = self._fold(node)
        if folded is not None:
            if self.flops.get(node, 0):
                raise GraphError(
                    f"fx node {node.name!r} ({_target(node)}) has FLOPs but no op kind"
                )
            return folded
        kind, attrs = self._classify(node)
        return self._add(node, kind, attrs)

    # nodes that carry no compute ---------------------------------------------------------------

    def _fold(self, node: fx.Node) -> _Ref | None:
        value = self.values[node]
        if node.op == "call_function" and node.target is operator.getitem:
            return self._getitem(node)
        if node.op == "call_module" and isinstance(self._module(node), nn.Identity):
            return self._same_as_input(node)
        if node.op == "call_method" and node.target in _NO_OP_METHODS:
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

    def _getitem(self, node: fx.Node) -> _Ref:
        src, index = node.args[0], node.args[1]
        assert isinstance(src, fx.Node)
        ref = self.refs[src]
        src_value = self.values[src]
        if isinstance(src_value, tuple | list):
            if ref.kind == "op" and self._op(ref.op).kind == "lstm" and index in (0, 1):
                return ref if index == 0 else _Ref("state", ref.op)
            if not any(isinstance(v, torch.Tensor) for v in src_value):
                return _Ref("none")
            raise GraphError(
                f"fx node {node.name!r} takes item {index!r} of the tuple produced by "
                f"{src.name!r} ({_target(src)}); only an LSTM cell's (h, c) can be unpacked"
            )
        if not isinstance(src_value, torch.Tensor):
            return _Ref("none")
        # Slicing one step out of an input tensor (tokens[:, t]): the consumer reads the input
        # op and records the step in attr "select"; slicing computed tensors has no op kind.
        if ref.kind == "op" and self._op(ref.op).kind == "input":
            select = _select_index(index, self._op(ref.op).output)
            if select is not None:
                return _Ref("select", ref.op, select=select)
        raise GraphError(
            f"fx node {node.name!r} slices {src.name!r} with {index!r}; layerwise has no slice op "
            "(only a single step of an input tensor, x[:, t], can be selected)"
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
            return str(declared), dict(attrs_fn()) if callable(attrs_fn) else {}
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
        if isinstance(m, nn.CrossEntropyLoss):
            return "softmax", {"op": "cross_entropy"}
        if isinstance(m, nn.Flatten):
            return self._flatten(node)
        raise self._unmappable(node)

    def _classify_function(self, node: fx.Node) -> tuple[str, dict[str, Any]]:
        t = node.target
        if t in _POINTWISE_FUNCTIONS:
            return "elementwise", {"op": _fn_name(t)}
        if t in _SOFTMAX_FUNCTIONS:
            self._check_softmax_dim(node, _arg(node, 1, "dim", None))
            return "softmax", {"op": _fn_name(t)}
        if t is F.cross_entropy:
            return "softmax", {"op": "cross_entropy"}
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
            return "elementwise", {"op": t.strip("_")}
        if t in ("softmax", "log_softmax"):
            self._check_softmax_dim(node, _arg(node, 1, "dim", None))
            return "softmax", {"op": t}
        if t in _RESHAPE_METHODS:
            return self._flatten(node)
        raise self._unmappable(node)

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
        self, node: fx.Node, kind: str, attrs: dict[str, Any], name: str | None = None
    ) -> _Ref:
        value = self.values[node]
        out_value = value[0] if kind == "lstm" and isinstance(value, tuple | list) else value
        output = self._tensor(node, out_value)
        inputs, params = self._inputs(node, kind, attrs)
        if kind != "input" and not inputs:
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) reads no activation tensor "
                "(only parameters or constants); fold it into the module that uses it"
            )
        owner, module_params = self._module_params(node)
        params = module_params + params
        op_name = name or self._op_name(node)
        param_objs = tuple(p for _, p in params)
        op = Op(
            name=op_name,
            kind=kind,
            inputs=tuple(inputs),
            output=output,
            params=tuple(Param(n, tuple(p.shape), p.element_size()) for n, p in params),
            flops=float(self.flops.get(node, 0)),
            mem_bytes=float(self._mem_bytes(node, kind, param_objs)),
            attrs=Op.make_attrs(attrs),
        )
        owner = owner or "+".join(n for n, _ in params)
        self.ops.append(_Pending(op, owner, frozenset(id(p) for p in param_objs)))
        self.by_name[op_name] = op
        return _Ref("op", op_name)

    def _inputs(
        self, node: fx.Node, kind: str, attrs: dict[str, Any]
    ) -> tuple[list[str], list[tuple[str, torch.Tensor]]]:
        inputs: list[str] = []
        params: list[tuple[str, torch.Tensor]] = []
        for arg in _node_args(node):
            ref = self.refs[arg]
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

    def _mem_bytes(self, node: fx.Node, kind: str, params: tuple[torch.Tensor, ...]) -> int:
        moved = sum(_nbytes(self.values[a]) for a in _node_args(node))
        out = _nbytes(self.values[node])
        if kind == "embedding":  # a lookup reads the rows it gathers, not the whole table
            return moved + 2 * out
        return moved + out + sum(_nbytes(p) for p in params)

    def _tensor(self, node: fx.Node, value: Any) -> Tensor:
        if not isinstance(value, torch.Tensor):
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) produces {type(value).__name__}, "
                "not a tensor"
            )
        if value.dim() == 0:
            # A loss reduced to a scalar: the op's region is its input's (the logits).
            value = self.values[self._tensor_args(node)[0]]
        names = _dim_names(value)
        if names is None or int(value.shape[0]) != self.batch:
            raise GraphError(
                f"fx node {node.name!r} ({_target(node)}) produces a tensor of shape "
                f"{tuple(value.shape)} ({value.dtype}); layerwise names the dims of "
                f"(batch={self.batch}, ...) float tensors of rank 2-4 and integer tensors of "
                "rank 1-2"
            )
        return Tensor(
            tuple(zip(names, (int(s) for s in value.shape), strict=True)), value.element_size()
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

    def _module(self, node: fx.Node) -> nn.Module:
        return self.gm.get_submodule(str(node.target))

    def _op(self, name: str) -> Op:
        return self.by_name[name]

    def _unmappable(self, node: fx.Node) -> GraphError:
        return GraphError(
            f"cannot map fx node {node.name!r} ({_target(node)}) to a layerwise op kind; "
            "supported modules: Conv2d, Linear, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, "
            "BatchNorm2d, LayerNorm, ReLU/GELU/Tanh/Sigmoid/Dropout, Embedding, LSTMCell, "
            "Softmax, Flatten, Identity and modules with a `layerwise_kind`; functions: "
            "pointwise math, torch.cat, torch.flatten, softmax, pooling"
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
