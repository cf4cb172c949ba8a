"""The operator graph: ops with named output dimensions, inputs, parameters and FLOPs.

An `OpGraph` is immutable and validated on construction: unknown op kinds, dangling inputs,
cycles and shape mismatches raise `GraphError` naming the op. Ops are kept in a topological
order; edges are (producer, consumer, input position) triples, so an op may read the same
tensor twice (parallel edges).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import networkx as nx

from planner.errors import GraphError
from planner.files import read_json_checked
from planner.graph.opkinds import (
    CHANNEL,
    LENGTH,
    SAMPLE,
    Contraction,
    DimMap,
    attention_dims,
    contraction,
    input_dim_map,
    kind_spec,
)

GRAPH_FORMAT = "layerwise.opgraph"
GRAPH_VERSION = 1


@dataclass(frozen=True)
class Tensor:
    """A tensor shape with named dimensions, e.g. (("sample", 64), ("channel", 96), ...)."""

    shape: tuple[tuple[str, int], ...]
    dtype_bytes: int = 4

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(d for d, _ in self.shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.shape)

    def size(self, dim: str) -> int:
        for d, s in self.shape:
            if d == dim:
                return s
        raise KeyError(f"tensor {self.dims} has no dimension {dim!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype_bytes

    @classmethod
    def of(cls, dtype_bytes: int = 4, **dims: int) -> Tensor:
        """Tensor.of(sample=8, channel=3, height=32, width=32)."""
        return cls(tuple(dims.items()), dtype_bytes)


@dataclass(frozen=True)
class Param:
    """A trainable parameter tensor of an op."""

    name: str
    shape: tuple[int, ...]
    dtype_bytes: int = 4

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype_bytes


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class Op:
    """One operator. `flops` counts the forward pass of the whole batch (2 per multiply-add);
    `mem_bytes` the bytes it moves through device memory in the forward pass (0: derive it)."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    output: Tensor
    params: tuple[Param, ...] = ()
    flops: float = 0.0
    mem_bytes: float = 0.0
    param_group: str | None = None
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    @staticmethod
    def make_attrs(attrs: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
        return tuple(sorted((k, _freeze(v)) for k, v in attrs.items()))


@dataclass(frozen=True)
class Edge:
    """A tensor edge: the output of ops[src] is input `position` of ops[dst]."""

    src: int
    dst: int
    position: int


@dataclass(frozen=True, eq=False)
class OpGraph:
    """Operators in topological order. Build with `OpGraph(name, ops)`; validated eagerly."""

    name: str
    ops: tuple[Op, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.ops:
            raise GraphError(f"graph {self.name!r} has no ops")
        ops = _topological(tuple(self.ops))
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "_index", {op.name: i for i, op in enumerate(ops)})
        for op in ops:
            _check_op(op, [ops[self._index[n]].output for n in op.inputs])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OpGraph) and (self.name, self.ops) == (other.name, other.ops)

    def __hash__(self) -> int:
        return hash((self.name, self.ops))

    def __len__(self) -> int:
        return len(self.ops)

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise GraphError(f"graph {self.name!r} has no op named {name!r}") from None

    def op(self, name: str) -> Op:
        return self.ops[self.index(name)]

    @cached_property
    def edges(self) -> tuple[Edge, ...]:
        return tuple(
            Edge(self._index[src], dst, pos)
            for dst, op in enumerate(self.ops)
            for pos, src in enumerate(op.inputs)
        )

    def input_tensor(self, edge: Edge) -> Tensor:
        return self.ops[edge.src].output

    def contraction(self, i: int) -> Contraction | None:
        """The sum op i may split (`planner.graph.opkinds.contraction`, given the input it
        sums over), or None."""
        op = self.ops[i]
        con = contraction(op)
        if con is None or con.internal:  # internal: no input is cut with it (a moe op)
            return con
        if con.position >= len(op.inputs):
            return None
        return contraction(op, self.op(op.inputs[con.position]).output)

    def input_maps(self, edge: Edge) -> tuple[DimMap, ...]:
        """How each dim of the edge's tensor follows the consumer's output region."""
        return input_dim_map(self.ops[edge.dst], edge.position, self.ops[edge.src].output)

    @cached_property
    def consumers(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.ops]
        for e in self.edges:
            out[e.src].append(e.dst)
        return tuple(tuple(c) for c in out)

    @property
    def forward_flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    @property
    def parameter_bytes(self) -> int:
        """Bytes of trainable parameters, counting each shared parameter group once."""
        return sum(op.param_bytes for op in self.parameter_owners())

    def parameter_owners(self) -> list[Op]:
        """The ops whose parameters count: every op but the later ones of a shared parameter
        group (an unrolled RNN's steps share their first step's weights)."""
        seen: set[str] = set()
        owners = []
        for op in self.ops:
            if op.param_group is not None:
                if op.param_group in seen:
                    continue
                seen.add(op.param_group)
            owners.append(op)
        return owners

    def to_networkx(self) -> nx.MultiDiGraph:
        g = nx.MultiDiGraph()
        g.add_nodes_from(range(len(self.ops)))
        for e in self.edges:
            g.add_edge(e.src, e.dst, key=e.position)
        return g

    # -- JSON -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": GRAPH_FORMAT,
            "version": GRAPH_VERSION,
            "name": self.name,
            "ops": [_op_to_json(op) for op in self.ops],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpGraph:
        if not isinstance(data, Mapping) or data.get("format") != GRAPH_FORMAT:
            raise GraphError(f'not a layerwise graph: expected "format": "{GRAPH_FORMAT}"')
        if data.get("version") != GRAPH_VERSION:
            raise GraphError(
                f"graph format version {data.get('version')!r} is not supported "
                f"(this layerwise reads version {GRAPH_VERSION})"
            )
        raw = data.get("ops")
        if not isinstance(raw, list) or not raw:
            raise GraphError('a graph JSON needs "ops": a non-empty list of op objects')
        ops = [_op_from_json(o, i) for i, o in enumerate(raw)]
        return cls(str(data.get("name", "graph")), tuple(ops))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        return cls.from_json(read_json_checked(path, "graph", GraphError))

    def fingerprint(self) -> str:
        """A short hash of the graph's content (names, kinds, shapes, edges, FLOPs)."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for op in self.ops:
            kinds[op.kind] = kinds.get(op.kind, 0) + 1
        return {
            "name": self.name,
            "ops": len(self.ops),
            "edges": len(self.edges),
            "forward_flops": self.forward_flops,
            "parameter_bytes": self.parameter_bytes,
            "kinds": dict(sorted(kinds.items())),
        }


# -- validation -----------------------------------------------------------------------------


def _topological(ops: tuple[Op, ...]) -> tuple[Op, ...]:
    names: dict[str, Op] = {}
    for op in ops:
        if not isinstance(op, Op):
            raise GraphError(f"graph ops must be Op objects, got {type(op).__name__}")
        if op.name in names:
            raise GraphError(f"two ops are named {op.name!r}")
        names[op.name] = op
    for op in ops:
        for src in op.inputs:
            if src not in names:
                raise GraphError(f"op {op.name!r} reads {src!r}, which is not an op of the graph")
    order = {op.name: i for i, op in enumerate(ops)}
    if all(order[src] < order[op.name] for op in ops for src in op.inputs):
        return ops
    g = nx.DiGraph()
    g.add_nodes_from(op.name for op in ops)
    g.add_edges_from((src, op.name) for op in ops for src in op.inputs)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        sorted_names = nx.lexicographical_topological_sort(g, key=order.__getitem__)
        return tuple(names[n] for n in sorted_names)
    path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
    raise GraphError(f"the graph has a cycle: {path}")


def _window_out(size: int, m: DimMap) -> int:
    return (size + 2 * m.pad - m.dilation * (m.kernel - 1) - 1) // m.stride + 1


def _check_op(op: Op, inputs: Sequence[Tensor]) -> None:
    kind_spec(op.kind)  # unknown kinds raise here, naming the known ones
    out = op.output
    if len(set(out.dims)) != len(out.dims):
        raise GraphError(f"op {op.name!r}: repeated dimension names in output {out.dims}")
    if any(s <= 0 for s in out.sizes):
        raise GraphError(f"op {op.name!r}: output sizes must be positive, got {out.shape}")
    if out.dims[:1] != (SAMPLE,):
        raise GraphError(
            f"op {op.name!r}: the first output dimension must be 'sample', got {out.dims}"
        )
    if op.kind == "input" and inputs:
        raise GraphError(f"op {op.name!r}: an input op takes no inputs")
    if op.kind != "input" and not inputs:
        raise GraphError(f"op {op.name!r} of kind {op.kind!r} has no inputs")
    if op.flops < 0 or op.mem_bytes < 0:
        raise GraphError(f"op {op.name!r}: flops and mem_bytes must be >= 0")
    _check_kind_dims(op, inputs)
    if op.kind in ("conv2d", "pool2d"):
        _check_window(op)
    if op.kind == "attention":
        _check_attention(op, inputs)
    for pos, tensor in enumerate(inputs):
        for dim, size, m in zip(tensor.dims, tensor.sizes, _maps(op, pos, tensor), strict=True):
            _check_dim(op, pos, dim, size, m)
    if op.kind == "concat":
        _check_concat(op, inputs)
    _check_split_units(op)
    _check_weight(op, inputs)


def _check_kind_dims(op: Op, inputs: Sequence[Tensor]) -> None:
    """The output and inputs have the dims the op's kind computes on (`KindSpec`): a conv
    without a channel dim, or a norm whose output lost a dim of its input, is refused (the
    dim maps would read such a dim whole and check nothing)."""
    spec = kind_spec(op.kind)
    out = op.output.dims
    shape = f"(sample, {', '.join(spec.out_dims)})"
    missing = [d for d in spec.out_dims if d not in out]
    if missing:
        raise GraphError(
            f"op {op.name!r} ({op.kind}): its output {out} has no {missing[0]!r} dimension; "
            f"a {op.kind}'s output is {shape}{'' if spec.exact else ', maybe with others'}: "
            "add it (or correct its name)"
        )
    extra = [d for d in out[1:] if d not in spec.out_dims]
    if spec.exact and extra:
        raise GraphError(
            f"op {op.name!r} ({op.kind}): its output {out} has a {extra[0]!r} dimension; a "
            f"{op.kind}'s output is exactly {shape}: remove it (or correct its name)"
        )
    for pos, tensor in enumerate(inputs):
        src = op.inputs[pos]
        lacking = [d for d in spec.in_dims if d not in tensor.dims]
        if lacking:
            raise GraphError(
                f"op {op.name!r} ({op.kind}): input {pos} ({src!r}) of dims {tensor.dims} has "
                f"no {lacking[0]!r} dimension; a {op.kind} reads (sample, "
                f"{', '.join(spec.in_dims)}) tensors: correct {src!r}'s output"
            )
        lost = [d for d in tensor.dims if d not in out and d != _stepped(op)]
        if spec.keeps and lost:
            raise GraphError(
                f"op {op.name!r} ({op.kind}): input {pos} ({src!r}) has a {lost[0]!r} "
                f"dimension that its output {out} lacks; a {op.kind} keeps its input's dims: "
                f"add {lost[0]!r} to the output (or correct its name)"
            )


def _check_window(op: Op) -> None:
    """A conv's or pool's kernel, stride and dilation are >= 1 and its padding >= 0 (pairs:
    height, width)."""
    for key, low in (("kernel", 1), ("stride", 1), ("dilation", 1), ("padding", 0)):
        value = op.attr(key)
        if value is None:
            continue
        pair = value if isinstance(value, tuple) else ()
        if len(pair) != 2 or not all(type(v) is int and v >= low for v in pair):
            raise GraphError(
                f"op {op.name!r} ({op.kind}): attr {key} {_thaw(value)!r} must be a pair of "
                f"integers >= {low} (height, width)"
            )


def _stepped(op: Op) -> str | None:
    """The input dim that op reads one step of (attr select: (dim, index), x[:, t])."""
    select = op.attr("select")
    if isinstance(select, tuple) and select and select[0] not in op.output.dims:
        return str(select[0])
    return None


def _features(op: Op, x: Tensor) -> int:
    """The features a linear or an LSTM cell reads from input x, as the kernels flatten
    them: all of x's dims but sample, length when the output keeps it, and a selected step."""
    kept = {SAMPLE, _stepped(op)} | ({LENGTH} if LENGTH in op.output.dims else set())
    return math.prod(s for d, s in x.shape if d not in kept)


def _check_weight(op: Op, inputs: Sequence[Tensor]) -> None:
    """The op's weight (its first parameter, as the kernels read it) agrees with its output
    and its input: a conv's out channels and in channels x groups, a linear's out and in
    features, an embedding's width, an LSTM cell's 4 x hidden rows and input width, a
    norm's per-channel parameters, a mixture of experts' router and experts
    (`planner.graph.moe.check_params`). Other ops without parameters are not checked."""
    if op.kind == "moe" and inputs:
        from planner.graph.moe import check_params

        check_params(op, inputs[0].size(CHANNEL), op.output.size(CHANNEL))
        return
    if not op.params or not inputs:
        return
    weight = op.params[0]
    w = weight.shape
    out = op.output
    x = inputs[0]

    def refuse(what: str) -> GraphError:
        return GraphError(
            f"op {op.name!r} ({op.kind}): {what}; make the weight, the output and the input agree"
        )

    if op.kind == "conv2d":
        groups = int(op.attr("groups", 1))
        if len(w) != 4:
            raise refuse(
                f"its first parameter {weight.name!r} of shape {w} is not a conv weight (out "
                "channels, in channels / groups, kernel height, kernel width)"
            )
        if w[0] != out.size(CHANNEL):
            raise refuse(
                f"weight {weight.name!r} {w} gives {w[0]} channels, the output has "
                f"{out.size(CHANNEL)}"
            )
        if w[1] * groups != x.size(CHANNEL):
            raise refuse(
                f"input {op.inputs[0]!r} has {x.size(CHANNEL)} channels but weight "
                f"{weight.name!r} {w} with groups {groups} reads {w[1] * groups}"
            )
        kernel = op.attr("kernel")
        if kernel is not None and tuple(int(k) for k in kernel) != tuple(w[2:]):
            raise refuse(f"attr kernel {list(kernel)} differs from weight {weight.name!r} {w}")
    elif op.kind == "linear":
        if len(w) != 2:
            raise refuse(f"its first parameter {weight.name!r} of shape {w} is not a 2D weight")
        n_out, n_in = (w[1], w[0]) if op.attr("transposed") else (w[0], w[1])
        if n_out != out.size(CHANNEL):
            raise refuse(
                f"weight {weight.name!r} {w} gives {n_out} output features, the "
                f"output has {out.size(CHANNEL)} channels"
            )
        features = _features(op, x)
        if features != n_in:
            raise refuse(
                f"input {op.inputs[0]!r} {x.dims} gives {features} features but weight "
                f"{weight.name!r} {w} reads {n_in}"
            )
    elif op.kind == "embedding":
        if len(w) != 2 or w[1] != out.size(CHANNEL):
            raise refuse(
                f"table {weight.name!r} {w} is not (vocabulary, "
                f"{out.size(CHANNEL)} output channels)"
            )
    elif op.kind == "lstm":
        hidden = out.size(CHANNEL)
        if len(w) != 2 or w[0] != 4 * hidden or w[1] != _features(op, x):
            raise refuse(
                f"input weight {weight.name!r} {w} is not (4 x {hidden} hidden, "
                f"{_features(op, x)} input features of {op.inputs[0]!r})"
            )
    elif op.kind == "norm":
        wrong = [p for p in op.params if p.shape != (out.size(CHANNEL),)]
        if wrong:
            raise refuse(
                f"parameter {wrong[0].name!r} {wrong[0].shape} is not one value per "
                f"channel ({out.size(CHANNEL)})"
            )


def _check_concat(op: Op, inputs: Sequence[Tensor]) -> None:
    """Concat inputs must tile the output along `dim`: offsets are the running sums."""
    dim = op.attr("dim")
    if dim not in op.output.dims:
        raise GraphError(
            f"op {op.name!r} (concat): attr dim {dim!r} is not a dimension of its output "
            f"{op.output.dims}: name the dim it concatenates along"
        )
    offsets = list(op.attr("offsets"))
    sizes = [t.size(dim) for t in inputs]
    expected = [sum(sizes[:k]) for k in range(len(sizes))]
    if offsets != expected or sum(sizes) != op.output.size(dim):
        raise GraphError(
            f"op {op.name!r}: concat inputs of sizes {sizes} along {dim!r} at offsets "
            f"{offsets} do not tile the output size {op.output.size(dim)} "
            f"(offsets must be {expected}, total {sum(sizes)})"
        )


def _check_attention(op: Op, inputs: Sequence[Tensor]) -> None:
    """Whole heads: heads divide the output channels, kv_heads the heads, the rotary part
    fits in a head; MLA (attr mla) reads one key/value head per query head and a shared
    rotary key of rope_dim channels as its third input."""
    _check_split_units(op)
    a = attention_dims(op)
    sizes = {"kv_heads": a.kv_heads, "head_dim": a.head_dim, "rope_dim": a.rope_dim}
    bad = [k for k, v in sizes.items() if v < 1]
    if bad or a.heads % a.kv_heads or a.rope_dim > a.head_dim:
        raise GraphError(
            f"op {op.name!r}: attention attrs {sizes} must be positive, kv_heads must divide "
            f"heads {a.heads} and rope_dim be at most head_dim"
        )
    if op.attr("v_head_dim") is not None and op.attr("v_head_dim") != a.v_head_dim:
        raise GraphError(
            f"op {op.name!r}: v_head_dim {op.attr('v_head_dim')!r} is not the output's "
            f"{a.v_head_dim} channels per head"
        )
    if a.mla:
        rope = inputs[2].size(CHANNEL) if len(inputs) == 3 and CHANNEL in inputs[2].dims else 0
        if a.kv_heads != a.heads or a.rope_dim >= a.head_dim or rope != a.rope_dim:
            raise GraphError(
                f"op {op.name!r}: multi-head latent attention reads (q, kv, rotary key) with "
                f"one key/value head per query head and a rotary key of rope_dim "
                f"{a.rope_dim} < head_dim {a.head_dim} channels (got {rope})"
            )


def _check_split_units(op: Op) -> None:
    """Attention heads and conv groups must divide the channels they split."""
    for key, kind in (("heads", "attention"), ("groups", "conv2d")):
        if op.kind != kind or "channel" not in op.output.dims:
            continue
        n = op.attr(key, 1)
        if not isinstance(n, int) or n < 1 or op.output.size("channel") % n:
            raise GraphError(
                f"op {op.name!r}: {key}={n!r} must be a positive divisor of its "
                f"{op.output.size('channel')} output channels"
            )


def _maps(op: Op, pos: int, tensor: Tensor) -> tuple[DimMap, ...]:
    try:
        return input_dim_map(op, pos, tensor)
    except (TypeError, IndexError, KeyError, ValueError) as exc:
        raise GraphError(f"op {op.name!r}: missing or malformed attributes ({exc})") from None


def _check_dim(op: Op, pos: int, dim: str, size: int, m: DimMap) -> None:
    if m.kind == "full":
        return
    if m.out_dim not in op.output.dims:
        raise GraphError(
            f"op {op.name!r}: input {pos} ({op.inputs[pos]!r}) has dimension {dim!r} "
            f"but the output {op.output.dims} has no {m.out_dim!r}"
        )
    out_size = op.output.size(m.out_dim)
    expected = {
        "same": size,
        "window": _window_out(size, m),
        "group": size // m.kernel * m.per_input_head,
    }.get(m.kind)
    if m.kind == "offset" and op.kind == "slice":  # [-offset, -offset + out) of the input
        ok = -m.offset + out_size <= size
    elif m.kind == "offset":  # a concat's piece: at [offset, offset + size) of the output
        ok = m.offset + size <= out_size
    else:
        ok = expected == out_size
    if not ok:
        raise GraphError(
            f"op {op.name!r}: shape mismatch on input {pos} ({op.inputs[pos]!r}) dimension "
            f"{dim!r}: input size {size} does not give output size {out_size} ({m.kind})"
        )


# -- JSON helpers ---------------------------------------------------------------------------


def _op_to_json(op: Op) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": op.name,
        "kind": op.kind,
        "inputs": list(op.inputs),
        "output": {dim: size for dim, size in op.output.shape},
    }
    if op.output.dtype_bytes != 4:
        d["dtype_bytes"] = op.output.dtype_bytes
    if op.params:
        d["params"] = [_param_to_json(p) for p in op.params]
    if op.flops:
        d["flops"] = op.flops
    if op.mem_bytes:
        d["mem_bytes"] = op.mem_bytes
    if op.param_group is not None:
        d["param_group"] = op.param_group
    if op.attrs:
        d["attrs"] = {k: _thaw(v) for k, v in op.attrs}
    return d


def _names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f'"inputs" must be a list of op names, got {value!r}')
    return tuple(value)


def _param_to_json(p: Param) -> dict[str, Any]:
    d: dict[str, Any] = {"name": p.name, "shape": list(p.shape)}
    if p.dtype_bytes != 4:
        d["dtype_bytes"] = p.dtype_bytes
    return d


def _thaw(value: Any) -> Any:
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value


def _op_from_json(d: Any, i: int) -> Op:
    if not isinstance(d, Mapping) or "name" not in d or "kind" not in d or "output" not in d:
        raise GraphError(f"op #{i} in the graph JSON needs at least name, kind and output")
    try:
        output = Tensor(
            tuple((str(k), int(v)) for k, v in d["output"].items()), int(d.get("dtype_bytes", 4))
        )
        params = tuple(
            Param(str(p["name"]), tuple(int(s) for s in p["shape"]), int(p.get("dtype_bytes", 4)))
            for p in d.get("params", [])
        )
        return Op(
            name=str(d["name"]),
            kind=str(d["kind"]),
            inputs=_names(d.get("inputs", [])),
            output=output,
            params=params,
            flops=float(d.get("flops", 0.0)),
            mem_bytes=float(d.get("mem_bytes", 0.0)),
            param_group=d.get("param_group"),
            attrs=Op.make_attrs(d.get("attrs", {})),
        )
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise GraphError(f"op {d.get('name', i)!r} in the graph JSON is malformed: {exc}") from None
