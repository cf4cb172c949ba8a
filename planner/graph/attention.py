"""Attention written as tensor code, found in a traced graph and read as one `attention` op.

A transformer's attention is written as people write it: q, k and v (sample, length,
channel) tensors are viewed into heads (`view`/`reshape`, `transpose`/`permute`), multiplied
(`q @ k.transpose(-2, -1)`, `matmul`, `bmm`, `einsum`) or handed to
`F.scaled_dot_product_attention`, masked (`masked_fill`/`where` with a causal mask built from
`torch.ones(...).tril()`, a registered `tril` buffer, or `is_causal=True`), scaled, softmaxed,
multiplied by v, and merged back to (sample, length, channel). Capture
(`planner.graph.capture`) does not give each of those an op kind: the search could not split
them any better than the attention op does, and the runtime computes attention with one
kernel. Instead `find_regions` tracks which tensors are in head form and returns each
connected region of them as an `AttentionRegion`: its three entry tensors (q, k, v, in
(sample, length, channel) form), its exit (the merge back), and the attrs of the op it
computes (heads, kv_heads, causal, scale), read from the code's structure:

- a tensor is *in head form* when it comes from a view, reshape, transpose or permute of a
  (sample, length, channel) tensor that changes its shape, or from any op that reads one;
  the region ends where a view or reshape gives back a (batch, length, channel) tensor;
- q, k, v are the (sample, length, channel) tensors the attention product's operands come
  from: SDPA's three arguments, or the operands of the product whose result is softmaxed
  (q, k) and of the product that reads the softmax (v);
- heads and the head size come from q's head-form shape, kv_heads from k's channels;
- scale: SDPA's `scale` (default 1/sqrt(head size)) or 1, times every constant factor
  (`* c`, `/ c`) on the way from q or k to the softmax;
- causal: `is_causal=True`, or a mask computed without the inputs (from shapes and
  buffers) that involves `tril` or `triu`. A mask computed from the inputs (padding) is
  refused: the attention op has none.

Anything else in a region (an op that is not a shape op, a product, a mask, a scale, a
softmax or a dropout) is refused with a GraphError naming it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from planner.errors import GraphError

__all__ = [
    "AttentionRegion",
    "attention_math",
    "evaluate_constant",
    "find_regions",
    "module_key",
    "rope_table",
]

_SHAPE_METHODS = {
    "view",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "unflatten",
    "flatten",
    "expand",
    "unsqueeze",
    "squeeze",
    "repeat_interleave",
    "unbind",
    "split",
    "float",
    "type_as",
    "to",
}
_SHAPE_FUNCTIONS: set[Any] = {
    torch.reshape,
    torch.transpose,
    torch.permute,
    torch.unsqueeze,
    torch.squeeze,
    torch.flatten,
    torch.repeat_interleave,
    torch.unbind,
    torch.split,
}
_ENTRY_METHODS = {"view", "reshape", "transpose", "permute", "unflatten"}
_ENTRY_FUNCTIONS: set[Any] = {torch.reshape, torch.transpose, torch.permute}
_PRODUCT_FUNCTIONS: set[Any] = {torch.matmul, torch.bmm, operator.matmul, torch.einsum}
_PRODUCT_METHODS = {"matmul", "bmm", "__matmul__"}
_SOFTMAX_FUNCTIONS: set[Any] = {F.softmax, torch.softmax}
_MASK_FUNCTIONS: set[Any] = {torch.masked_fill, torch.where}
_MASK_METHODS = {"masked_fill", "masked_fill_"}
_SCALE_FUNCTIONS: set[Any] = {operator.mul, operator.truediv, torch.mul, torch.div}
_SCALE_METHODS = {"mul", "div", "__mul__", "__truediv__", "mul_", "div_"}
_DROPOUT_FUNCTIONS: set[Any] = {F.dropout}
_TANH_FUNCTIONS: set[Any] = {torch.tanh, F.tanh}
_TRIANGLES = {"tril", "triu"}
# mask elements (batch x length^2) up to which a mask's values are computed to read it:
# Hugging Face builds a (batch, 1, length, length) mask by indexing, about 5 bytes per element
# at its peak (batch 8 x 8,192 tokens: 2.5 GB, 10 s)
MASK_ELEMENTS = 2**29
# a score at or below this hides its key: -inf, or a dtype's lowest (float16's -65,504)
HIDDEN = -1e4
VERIFY_SIZE = 2**27  # score elements (q elements x key length) up to which a region is checked
_VERIFIED: set[Hashable] = set()  # `_region_key`s of the regions that `_verify` compared
# rotary position embeddings: q * cos + rotate_half(q) * sin, rotate_half(x) = cat(-x2, x1)
_ROPE_METHODS = {"neg", "__neg__", "add", "__add__", "mul", "__mul__"}
_ROPE_FUNCTIONS: set[Any] = {
    operator.neg,
    operator.add,
    operator.mul,
    torch.neg,
    torch.add,
    torch.mul,
    torch.cat,
}


@dataclass
class AttentionRegion:
    """One attention computation in the traced graph (see the module docstring)."""

    nodes: set[fx.Node]  # the region's head-form nodes and the constants only they read
    exit: fx.Node  # its output, back in (sample, length, channel) form
    q: fx.Node
    k: fx.Node
    v: fx.Node
    attrs: dict[str, Any] = field(default_factory=dict)
    flops: int = 0
    packed: bool = False  # q, k, v are the thirds of one tensor (q = k = v here): capture
    # reads them through three slice ops of it
    # QK-norm's modules (q's, k's), whose weights the op holds as its parameters
    norms: tuple[fx.Node, ...] = ()

    @property
    def inputs(self) -> tuple[fx.Node, fx.Node, fx.Node]:
        """The op's three inputs: q, k, v (MLA: q, kv, the shared rotary key)."""
        return (self.q, self.k, self.v)

    def params(self, gm: fx.GraphModule) -> list[tuple[str, torch.Tensor]]:
        """The op's parameters: QK-norm's weights, named by their modules."""
        out: list[tuple[str, torch.Tensor]] = []
        for n in self.norms:
            for name, p in gm.get_submodule(str(n.target)).named_parameters():
                out.append((f"{n.target}.{name}", p))
        return out


NormOf = Callable[[nn.Module], "dict[str, Any] | None"]


def find_regions(
    gm: fx.GraphModule,
    values: dict[fx.Node, Any],
    flops: dict[fx.Node, int],
    constant: set[fx.Node],
    sequence: Callable[[fx.Node], bool],
    norm_of: NormOf | None = None,
) -> list[AttentionRegion]:
    """The attention regions of `gm`. `values` are the nodes' meta values, `constant` the
    nodes computed without the inputs, and `sequence(n)` says whether node n is a
    (sample, length, channel) tensor of an op that capture maps (a region's possible entry).
    `norm_of(module)`: a module's norm attrs (`planner.graph.capture.norm_of`), to read an
    RMS norm of q's and k's heads (QK-norm)."""
    inside: set[fx.Node] = set()
    exits: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node in constant:
            continue
        reads = [a for a in _args(node) if a not in constant]
        if any(a in inside for a in reads):
            if _is_exit(node, sequence):
                exits.add(node)
            else:
                inside.add(node)
        elif _is_entry(node, reads, values, sequence):
            inside.add(node)
    if not inside:
        return []
    regions = []
    for group in _components(inside):
        out = [e for e in exits if any(a in group for a in _args(e))]
        regions.append(_region(gm, group, out, values, flops, constant, norm_of))
    return regions


# -- region membership ----------------------------------------------------------------------


def _is_entry(
    node: fx.Node, reads: list[fx.Node], values: dict[fx.Node, Any], sequence: Callable
) -> bool:
    """A shape op that takes a (sample, length, channel) tensor out of that form."""
    if not reads or not sequence(reads[0]) or not isinstance(values[node], torch.Tensor):
        return False
    shaped = (node.op == "call_method" and node.target in _ENTRY_METHODS) or (
        node.op == "call_function" and node.target in _ENTRY_FUNCTIONS
    )
    if not shaped:
        return node.op == "call_function" and node.target is F.scaled_dot_product_attention
    return tuple(values[node].shape) != tuple(values[reads[0]].shape) or _is_swap(node)


def _is_swap(node: fx.Node) -> bool:
    """A transpose or permute that moves dims (a square tensor keeps its shape)."""
    return node.target in ("transpose", "permute", torch.transpose, torch.permute)


def _is_exit(node: fx.Node, sequence: Callable) -> bool:
    reshape = (node.op == "call_method" and node.target in ("view", "reshape", "flatten")) or (
        node.op == "call_function" and node.target in (torch.reshape, torch.flatten)
    )
    return reshape and sequence(node)


def _components(nodes: set[fx.Node]) -> list[set[fx.Node]]:
    parent = {n: n for n in nodes}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in _args(n):
            if a in nodes:
                parent[find(a)] = find(n)
    groups: dict[fx.Node, set[fx.Node]] = {}
    for n in nodes:
        groups.setdefault(find(n), set()).add(n)
    order = {n: i for i, n in enumerate(next(iter(nodes)).graph.nodes)}
    return sorted(groups.values(), key=lambda g: min(order[n] for n in g))


# -- reading one region ---------------------------------------------------------------------


def _region(
    gm: fx.GraphModule,
    group: set[fx.Node],
    exits: list[fx.Node],
    values: dict[fx.Node, Any],
    flops: dict[fx.Node, int],
    constant: set[fx.Node],
    norm_of: NormOf | None = None,
) -> AttentionRegion:
    where = _where(group)
    if len(exits) != 1:
        raise GraphError(
            f"the tensor code at {where} leaves (sample, length, channel) form and "
            + (
                "never comes back to it (view or reshape it to (batch, length, channel))"
                if not exits
                else f"comes back {len(exits)} times; layerwise reads such code only as one "
                "attention (q, k, v viewed into heads, their products, a mask and a softmax)"
            )
        )
    exit_node = exits[0]
    for n in group:
        _check_allowed(gm, n, norm_of)
    sdpa = [n for n in group if _is_call(n, F.scaled_dot_product_attention)]
    softmax = [n for n in group if _is_softmax(n)]
    if len(sdpa) + len(softmax) != 1:
        raise GraphError(
            f"the tensor code at {where} has {len(sdpa)} scaled_dot_product_attention and "
            f"{len(softmax)} softmax calls; layerwise reads it as attention only with exactly "
            "one of them"
        )
    consts = {a for n in group for a in _args(n) if a in constant}
    if sdpa:
        q_op, k_op, v_op, scale, causal = _read_sdpa(sdpa[0], values, constant)
        softcap = None
    else:
        q_op, k_op, v_op, scale, causal, softcap = _read_manual(softmax[0], values, constant, group)
    q4 = values[q_op]
    if q4.dim() != 4:
        raise GraphError(
            f"the attention at {where} multiplies q of shape {tuple(q4.shape)}; layerwise "
            "reads attention over (batch, heads, length, head size) tensors"
        )
    heads, head = int(q4.shape[1]), int(q4.shape[3])
    out_channels = int(values[exit_node].shape[-1])
    if out_channels % heads:
        raise GraphError(
            f"the attention at {where}: its output has {out_channels} channels, not whole "
            f"heads of its {heads} query heads"
        )
    v_head = out_channels // heads
    sources = {
        role: _entries(x, group, values, constant)
        for x, role in ((q_op, "q"), (k_op, "k"), (v_op, "v"))
    }
    tables = _rope_tables(group, consts, values, where)
    rope = head if tables is None else int(values[tables[0]].shape[-1])
    mla = _latent(sources, values, heads, head, v_head, rope)
    if mla is not None:  # MLA: (q, the per-head k | v, the shared rotary key)
        q, k, v = mla
        kv_heads = heads
    else:
        q, k, v = (_one(sources[r], r, where) for r in ("q", "k", "v"))
        kv_heads = _check_heads(values, (q, k, v), out_channels, heads, head, where)
    scale *= _factors(q_op, q, group, values) * _factors(k_op, k, group, values)
    attrs: dict[str, Any] = {
        "heads": heads,
        "kv_heads": kv_heads,
        "causal": causal,
        "scale": scale,
    }
    if head != v_head:  # q/k heads wider or narrower than v's (MLA: 192 and 128)
        attrs |= {"head_dim": head, "v_head_dim": v_head}
    if mla is not None:
        attrs["mla"] = True
    if softcap is not None:
        attrs["softcap"] = softcap
    windows = {n.meta["layerwise_window"] for n in group if "layerwise_window" in n.meta}
    if windows:
        attrs["window"] = windows.pop()
    if any(_mentions(c, _TRIANGLES) for c in consts) and not causal:
        raise GraphError(
            f"the attention at {where} builds a triangular mask that is not read as causal; "
            "layerwise reads masked_fill(~tril, -inf), masked_fill(tril == 0, -inf) and "
            "is_causal=True"
        )
    if tables is not None:
        attrs["rope"] = "half"
        attrs["rope_tables"] = [tables[0].name, tables[1].name]
        if rope != head:
            _check_rope_last(group, tables, where)
            attrs["rope_dim"] = rope
    norms = _qk_norms(gm, group, q_op, k_op, head, norm_of, tables or (), where)
    if norms:
        attrs |= _qk_norm_attrs(gm, norms, norm_of, where)
    if any(_is_float32_cast(n) for n in group):
        attrs["softmax"] = "float32"  # the model computes its softmax in float32
    packed = q is k is v  # one projection viewed as (..., 3, heads, head) and indexed
    region = AttentionRegion(
        group | consts,
        exit_node,
        q,
        k,
        v,
        attrs,
        sum(flops.get(n, 0) for n in group),
        packed,
        norms,
    )
    _verify(gm, region, values, where)
    return region


def _one(found: set[fx.Node], role: str, where: str) -> fx.Node:
    if len(found) != 1:
        names = ", ".join(sorted(n.name for n in found)) or "none"
        raise GraphError(
            f"the attention at {where}: its {role} comes from {len(found)} tensors ({names}); "
            "layerwise needs q, k and v each to be one (batch, length, channel) tensor (or "
            "multi-head latent attention's key: per-head channels and a rotary key all heads "
            "share)"
        )
    return next(iter(found))


def _check_heads(
    values: dict[fx.Node, Any],
    qkv: tuple[fx.Node, fx.Node, fx.Node],
    out_channels: int,
    heads: int,
    head: int,
    where: str,
) -> int:
    """The k/v heads of standard attention, after checking that q, k and v hold whole heads
    (q and k of `head` channels, v of the output's)."""
    channels = [int(values[x].shape[-1]) for x in qkv]
    v_head = out_channels // heads
    if qkv[0] is qkv[1] is qkv[2] and channels[0] == 2 * heads * head + out_channels:
        channels = [heads * head, heads * head, out_channels]  # its thirds (checked by running)
    if channels[0] != heads * head:
        raise GraphError(
            f"the attention at {where}: q has {channels[0]} channels, not heads x head size = "
            f"{heads} x {head}"
        )
    kv = channels[1] // head
    if channels[1] % head or channels[2] != kv * v_head or heads % kv:
        raise GraphError(
            f"the attention at {where}: k and v have {channels[1]} and {channels[2]} channels; "
            f"layerwise needs whole heads (k of {head}, v of {v_head}) that divide the "
            f"{heads} query heads"
        )
    return kv


def _latent(
    sources: dict[str, set[fx.Node]],
    values: dict[fx.Node, Any],
    heads: int,
    head: int,
    v_head: int,
    rope: int,
) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """Multi-head latent attention's inputs (q, kv, rotary key; DeepSeek-V3, arXiv 2412.19437,
    Sec. 2.1.1, Eqs. 1-11), or None: k read from two
    tensors, the one v is read from (per head, head - rope key channels then the value's)
    and a rotary key of `rope` < head channels that every head appends to its key (checked
    by running the region, `_verify`)."""
    if len(sources["q"]) != 1 or len(sources["v"]) != 1 or len(sources["k"]) != 2:
        return None
    (q,), (v,) = sources["q"], sources["v"]
    if v not in sources["k"]:
        return None
    (k_rope,) = sources["k"] - {v}
    width = {x: int(values[x].shape[-1]) for x in (q, v, k_rope)}
    if rope >= head or width[k_rope] != rope or width[q] != heads * head:
        return None
    if width[v] != heads * (head - rope + v_head):
        return None
    return q, v, k_rope


def _check_rope_last(group: set[fx.Node], tables: tuple[fx.Node, fx.Node], where: str) -> None:
    """A rotary table narrower than the head turns the head's last channels: the rotated
    part (x * cos + rotate_half(x) * sin, then views or an expand) is the last piece of the
    torch.cat that rebuilds q and k (MLA's cat(nope, rope)); a rotation of the first
    channels (GPT-NeoX's partial rotary) is refused."""
    refused = GraphError(
        f"the attention at {where} turns part of each head with its rotary tables but not "
        "its last channels; layerwise reads a partial rotation of the last rope_dim channels "
        "of each q and k head (DeepSeek's MLA: cat(nope, rope))"
    )
    for turned in (n for n in group if tables[0] in _args(n)):  # x * cos
        node = turned
        for _ in range(8):
            users = [u for u in node.users if u in group]
            cat = next((u for u in users if _is_call(u, torch.cat)), None)
            if cat is not None:
                pieces = _argument(cat, 0, "tensors")
                if not isinstance(pieces, list | tuple) or pieces[-1] is not node:
                    raise refused
                break
            if len(users) != 1:
                raise refused
            node = users[0]
        else:
            raise refused


def _rope_tables(
    group: set[fx.Node], consts: set[fx.Node], values: dict[fx.Node, Any], where: str
) -> tuple[fx.Node, fx.Node] | None:
    """(cos, sin): the constant float tables that multiply q and k (sin the rotated half's),
    or None when the attention has no rotary embedding."""
    cos: set[fx.Node] = set()
    sin: set[fx.Node] = set()
    for n in group:
        if not (
            _is_call(n, operator.mul) or _is_call(n, torch.mul) or n.target in ("mul", "__mul__")
        ):
            continue
        args = [a for a in n.args if isinstance(a, fx.Node)]
        table = [a for a in args if a in consts and _is_float_table(values.get(a))]
        other = [a for a in args if a in group]
        if len(table) != 1 or len(other) != 1:
            continue
        (sin if _rotated(other[0], group) else cos).add(table[0])
    if not cos and not sin:
        return None
    if len(cos) != 1 or len(sin) != 1:
        raise GraphError(
            f"the attention at {where} multiplies q or k by constant tables ({len(cos)} "
            f"and {len(sin)} of them); layerwise reads one cos and one sin table (rotary "
            "embeddings in the rotate-half form: q * cos + rotate_half(q) * sin)"
        )
    return cos.pop(), sin.pop()


def _is_float_table(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2


def _rotated(node: fx.Node, group: set[fx.Node]) -> bool:
    """Whether `node` is (a view of) a torch.cat: rotate_half's output."""
    while node in group:
        if _is_call(node, torch.cat):
            return True
        if not (node.op == "call_method" and node.target in _SHAPE_METHODS):
            return False
        node = node.args[0]  # type: ignore[assignment]
    return False


def _is_float32_cast(n: fx.Node) -> bool:
    if _is_softmax(n) and n.kwargs.get("dtype") == torch.float32:
        return True
    if n.op != "call_method":
        return False
    if n.target == "float":
        return True
    return n.target == "to" and (torch.float32 in n.args or n.kwargs.get("dtype") == torch.float32)


def _verify(
    gm: fx.GraphModule, region: AttentionRegion, values: dict[fx.Node, Any], where: str
) -> None:
    """Run the region's own code on random q, k, v (float64, CPU) and compare it with the
    attention op it was read as (`attention_math`); GraphError on a difference. Skipped when
    a constant it reads cannot be computed here (a buffer on the meta device): the runtime's
    `--check` compares the whole model then."""
    memo: dict[fx.Node, Any] = {}
    entries = (region.q, region.k, region.v)
    order = [n for n in gm.graph.nodes if n in region.nodes or n is region.exit]
    constants = [
        n
        for n in order
        if n.op == "get_attr" or not any(a in region.nodes or a in entries for a in _args(n))
    ]
    q, k = values[region.q], values[region.k]
    if q.numel() * k.shape[1] > VERIFY_SIZE:
        return  # too big to compute here: the runtime's --check compares the model
    for n in constants:  # first: on the meta device there is nothing to compare
        value = _evaluate(n, memo, values)
        if value is None and isinstance(values.get(n), torch.Tensor):
            return  # a constant not computable here (a meta buffer)
    # a transformer's layers repeat one region: it is compared once per distinct key
    key = _region_key(gm, region, order, constants, memo, values)
    if key is not None and key in _VERIFIED:
        return
    g = torch.Generator().manual_seed(0)
    for x in entries:
        memo[x] = torch.randn(tuple(values[x].shape), generator=g, dtype=torch.float64)
    # QK-norm's modules run with random weights, the same the op gets
    weights = {
        n: {
            name: torch.randn(tuple(p.shape), generator=g, dtype=torch.float64) + 1.0
            for name, p in gm.get_submodule(str(n.target)).named_parameters()
        }
        for n in region.norms
    }
    qkv = [memo[x] for x in entries]
    if region.packed:  # its thirds, as the slice ops will give them
        third = qkv[0].shape[-1] // 3
        qkv = [qkv[0][..., i * third : (i + 1) * third] for i in range(3)]
    for n in order:
        if n in memo or n in constants:
            continue
        try:
            memo[n] = _run_node(gm, n, memo, values, weights.get(n))
        except Exception:  # noqa: BLE001 - e.g. a view of a float64 input; not checkable
            return
    got = memo.get(region.exit)
    if not isinstance(got, torch.Tensor):
        return
    tables = None
    if region.attrs.get("rope"):
        named = {n.name: n for n in region.nodes}
        cos, sin = (
            rope_table(memo[named[t]] if named[t] in memo else _evaluate(named[t], memo, values))
            for t in region.attrs["rope_tables"]
        )
        tables = (cos, sin)
    norms = [next(iter(weights[n].values())) for n in region.norms]
    want = attention_math(qkv[0], qkv[1], qkv[2], region.attrs, tables=tables, norms=norms)
    scale = float(want.abs().max()) or 1.0
    error = float((got.to(want.dtype) - want).abs().max()) / scale
    float32 = "float32" in (region.attrs.get("softmax"), region.attrs.get("qk_norm_compute"))
    limit = 1e-5 if float32 else 1e-9
    if not error <= limit:
        raise GraphError(
            f"the attention at {where} was read as {_summary(region.attrs)}, but its code "
            f"computes something else (relative difference {error:.2g} on a random input); "
            "layerwise reads causal or full attention, rotary tables in the rotate-half form "
            "(on whole heads or their last channels), QK-norm before them, multi-head latent "
            "attention's shared rotary key and constant scales"
        )
    if key is not None:
        _VERIFIED.add(key)


def _run_node(
    gm: fx.GraphModule,
    n: fx.Node,
    memo: dict[fx.Node, Any],
    values: dict,
    weights: dict[str, torch.Tensor] | None = None,
) -> Any:
    def get(a: fx.Node) -> Any:
        return memo[a] if a in memo else _evaluate(a, memo, values)

    args = fx.node.map_arg(n.args, get)
    kwargs = dict(fx.node.map_arg(n.kwargs, get))
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if isinstance(mod, nn.Dropout):
            return args[0]  # attention dropout: compared without it
        if weights is not None:  # a QK-norm, with the weights the op is compared with
            return torch.func.functional_call(mod, weights, tuple(args), kwargs)
        return mod(*args, **kwargs)
    if n.op == "call_function":
        if n.target is F.dropout:
            return args[0]
        if n.target is F.scaled_dot_product_attention:  # compared without its dropout
            args = tuple(0.0 if i == 4 else a for i, a in enumerate(args))
            kwargs.pop("dropout_p", None)
        return n.target(*args, **kwargs)  # type: ignore[operator]
    return getattr(args[0], str(n.target))(*args[1:], **kwargs)


def _summary(attrs: dict[str, Any]) -> str:
    parts = [f"{attrs['heads']} heads", f"{attrs['kv_heads']} k/v heads"]
    parts.append("causal" if attrs["causal"] else "not masked")
    parts.append(f"scale {attrs['scale']:.4g}")
    if attrs.get("head_dim"):
        parts.append(f"q/k heads of {attrs['head_dim']}, v heads of {attrs['v_head_dim']}")
    if attrs.get("rope"):
        turned = f" of the last {attrs['rope_dim']} channels" if attrs.get("rope_dim") else ""
        parts.append(f"rotary (rotate-half{turned})")
    if attrs.get("qk_norm"):
        parts.append("QK-norm")
    if attrs.get("mla"):
        parts.append("multi-head latent attention")
    if attrs.get("softcap"):
        parts.append(f"scores soft-capped at {attrs['softcap']:g}")
    if attrs.get("window"):
        parts.append(f"a sliding window of {attrs['window']}")
    return "attention (" + ", ".join(parts) + ")"


def rope_table(value: torch.Tensor) -> torch.Tensor:
    """A cos or sin table as (positions, head size): its size-1 dims dropped (tables are
    often shaped to broadcast, e.g. (1, 1, T, d))."""
    squeezed = value.reshape([s for s in value.shape if s != 1])
    if squeezed.dim() == 3:  # one table per sample (position ids per row): all rows alike
        squeezed = squeezed[0]
    if squeezed.dim() != 2:
        raise GraphError(f"a rotary table of shape {tuple(value.shape)} is not (positions, dims)")
    return squeezed


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attrs: dict[str, Any] | Any,
    q_start: int = 0,
    heads: int | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    positions: torch.Tensor | None = None,
    norms: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """The attention op on (sample, length, channel) q, k, v: `heads` heads in q (default:
    the op's; a task holds fewer), k and v with the heads their channels hold (each shared by
    a group of q's), the causal mask at q's positions [q_start, q_start + length) (with attr
    window, only the window keys up to each query's own: a sliding window), the scale, the
    soft cap of the scores (attr softcap: cap * tanh(scores / cap), Gemma 2's logit
    soft-capping, arXiv 2408.00118 Sec. 2; the window: Mistral 7B's sliding window attention,
    arXiv 2310.06825 Sec. 2, Longformer's, arXiv 2004.05150),
    the rotary tables (positions x rope_dim) and a float32 softmax as attrs say.

    Heads (`planner.graph.opkinds.AttentionDims`): q and k heads of head_dim channels (q's
    channels / heads), v and output heads of v_head_dim (default head_dim); rotary
    embeddings turn the last rope_dim channels of each q and k head (default all). With attr
    mla, k is the key/value up-projection's output (per head head_dim - rope_dim key then
    v_head_dim value channels) and v the rotary key (rope_dim channels) every head appends to
    its key. With attr qk_norm "rms", `norms` holds the weights (head_dim,) of q's and k's RMS
    norm over each head's channels (epsilon qk_norm_eps, in float32 with qk_norm_compute),
    applied before the rotation (Qwen3's QK-norm).

    `positions`: the token position at each place of the whole sequence when it is laid out
    in another order (context parallelism's balanced order, `planner.costs.context`): q holds
    places [q_start, q_start + length), k and v every place; the mask and the rotation follow
    the tokens' positions."""
    get = attrs.get if isinstance(attrs, dict) else attrs.attr
    n, lq, c = q.shape
    lk = k.shape[1]
    heads = int(get("heads", 1)) if heads is None else heads
    d = c // heads
    dv = int(get("v_head_dim", d))
    rope_dim = int(get("rope_dim", d))

    def split(x: torch.Tensor, size: int) -> torch.Tensor:
        return x.reshape(n, x.shape[1], x.shape[-1] // size, size).transpose(1, 2)

    qh = split(q, d)
    if get("mla"):  # per head (key | value) of the up-projection, one rotary key for all
        kv = split(k, d - rope_dim + dv)
        k_nope, vh = kv.split([d - rope_dim, dv], dim=-1)
        k_rope = v.reshape(n, 1, lk, rope_dim).expand(n, kv.shape[1], lk, rope_dim)
        kh = torch.cat([k_nope, k_rope], dim=-1)
    else:
        kh, vh = split(k, d), split(v, dv)
    if get("qk_norm"):
        norm = {k: get(f"qk_norm_{k}", None) for k in RMS_ATTRS}
        qh, kh = (_rms(x, w, norm) for x, w in ((qh, norms[0]), (kh, norms[1])))
    if positions is not None:
        pos = positions.to(q.device)
        q_rows, k_rows = pos[q_start : q_start + lq], pos[:lk]
        mask = q_rows.unsqueeze(1) >= k_rows.unsqueeze(0) if get("causal", False) else None
        causal = False
        count = len(pos)
    else:
        q_rows = torch.arange(q_start, q_start + lq, device=q.device)
        k_rows = torch.arange(lk, device=q.device)
        causal = bool(get("causal", False)) and q_start == 0 and lq == lk
        mask = None
        if get("causal", False) and not causal:
            mask = q_rows.unsqueeze(1) >= k_rows.unsqueeze(0)
        count = q_start + lq + lk
    window = get("window", None)
    if window and get("causal", False):  # keys in (query - window, query]
        behind = q_rows.unsqueeze(1) - k_rows.unsqueeze(0)
        mask = (behind >= 0) & (behind < int(window))
        causal = False
    if get("rope"):
        if tables is None:  # no values (cost measurements): the same work, identity rotation
            tables = (
                torch.ones(count, rope_dim, dtype=q.dtype),
                torch.zeros(count, rope_dim, dtype=q.dtype),
            )
        cos, sin = (t.to(q.device, q.dtype) for t in tables)
        qh = _rotate(qh, cos[q_rows], sin[q_rows], rope_dim)
        kh = _rotate(kh, cos[k_rows], sin[k_rows], rope_dim)
    kv_heads = kh.shape[1]
    if kv_heads != heads:  # each k/v head serves heads // kv_heads query heads
        kh = kh.repeat_interleave(heads // kv_heads, dim=1)
        vh = vh.repeat_interleave(heads // kv_heads, dim=1)
    scale = get("scale")
    s = None if scale is None else float(scale)
    softcap = get("softcap", None)
    if get("softmax") == "float32" or softcap:  # scores in the model's dtype, as it computes
        scores = (qh @ kh.transpose(-2, -1)) * (s if s is not None else 1 / math.sqrt(d))
        if softcap:  # Gemma 2's logit soft-capping (arXiv 2408.00118, Sec. 2)
            scores = torch.tanh(scores / float(softcap)) * float(softcap)
        if causal:
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if get("softmax") == "float32":
            y = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ vh
        else:
            y = torch.softmax(scores, dim=-1) @ vh
    else:
        y = F.scaled_dot_product_attention(qh, kh, vh, mask, is_causal=causal, scale=s)
    return y.transpose(1, 2).reshape(n, lq, heads * dv)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    """x (..., rows, head) with its last `dim` channels rotated by the rows' cos and sin
    (rows x dim, the rotate-half form)."""
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    keep, turn = x[..., : x.shape[-1] - dim], x[..., x.shape[-1] - dim :]
    return torch.cat([keep, turn * cos + rotate_half(turn) * sin], dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, attrs: Mapping[str, Any]) -> torch.Tensor:
    """RMS norm of (batch, heads, rows, head) x over each head (`rms_norm` with the norm's
    attrs); computed on the (batch, rows, heads, head) layout the model normalises,
    contiguous, so that float32 sums add in the model's order whatever part of the rows a
    task holds."""
    return rms_norm(x.transpose(1, 2).contiguous(), weight, attrs).transpose(1, 2)


RMS_ATTRS = ("eps", "compute", "offset", "weight")  # what `rms_norm` reads of a norm's attrs


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, attrs: Mapping[str, Any]
) -> torch.Tensor:
    """RMS norm of x over its last dim (Zhang and Sennrich, arXiv 1910.07467, Eq. 4) as the
    model computes it, by the norm op's attrs: eps;
    compute "float32" (normalised in float32 whatever x's dtype, as Meta's and Hugging Face's
    code do); offset (the scale is offset + weight: Gemma's (1 + weight)); weight "inside"
    (the scale applied before the cast back to x's dtype, as Gemma does) or after it (Llama)."""
    xc = x.float() if attrs.get("compute") == "float32" else x
    eps = attrs.get("eps")
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + (1e-6 if eps is None else float(eps)))
    if weight is None:
        return y.to(x.dtype)
    offset = float(attrs.get("offset") or 0.0)
    if attrs.get("weight") == "inside":
        scale = weight.to(xc.dtype)
        return (y * (scale + offset if offset else scale)).to(x.dtype)
    return y.to(x.dtype) * (weight + offset if offset else weight)


def _check_allowed(gm: fx.GraphModule, n: fx.Node, norm_of: NormOf | None = None) -> None:
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        if isinstance(m, nn.Dropout | nn.Identity | nn.Softmax):
            return
        if norm_of is not None and norm_of(m) is not None:
            return  # a norm of q's or k's heads (QK-norm: `_qk_norms`)
    elif (
        n.op == "call_method"
        and n.target
        in (
            _SHAPE_METHODS
            | _PRODUCT_METHODS
            | _MASK_METHODS
            | _SCALE_METHODS
            | _ROPE_METHODS
            | {"softmax", "tanh"}
        )
        or n.op == "call_function"
        and (
            n.target
            in _SHAPE_FUNCTIONS
            | _PRODUCT_FUNCTIONS
            | _SOFTMAX_FUNCTIONS
            | _MASK_FUNCTIONS
            | _SCALE_FUNCTIONS
            | _DROPOUT_FUNCTIONS
            | _ROPE_FUNCTIONS
            | _TANH_FUNCTIONS
            | {F.scaled_dot_product_attention, operator.getitem, operator.add, torch.add}
        )
    ):
        return
    raise GraphError(
        f"fx node {n.name!r} ({_describe(n)}) computes on attention heads; layerwise reads "
        "head-form code only as attention: views, transposes, matmul/@/bmm/einsum, "
        "scaled_dot_product_attention, masked_fill/where with a causal mask, scaling by a "
        "constant, softmax and dropout"
    )


def _read_sdpa(
    n: fx.Node, values: dict[fx.Node, Any], constant: set[fx.Node]
) -> tuple[fx.Node, fx.Node, fx.Node, float, bool]:
    q, k, v = (_argument(n, i, name) for i, name in enumerate(("query", "key", "value")))
    mask = _argument(n, 3, "attn_mask")
    causal = bool(_argument(n, 5, "is_causal") or False)
    dropout = _argument(n, 4, "dropout_p") or 0.0
    scale = _argument(n, 6, "scale")
    head = int(values[q].shape[-1])
    if isinstance(dropout, fx.Node):
        raise GraphError(
            f"{_where({n})}: scaled_dot_product_attention with a dropout_p computed from the "
            "inputs; give it a number"
        )
    # a number: attention dropout is planned like nn.Dropout (no cost of its own) and the
    # runtime computes attention without it, as it does every dropout (runs are
    # deterministic); `planner.graph.models.prepare_for_training` turns it off in the model
    if mask is not None:
        causal = causal or _causal_mask(mask, constant, n, values)
    return q, k, v, 1 / math.sqrt(head) if scale is None else float(scale), causal


def _read_manual(
    soft: fx.Node, values: dict[fx.Node, Any], constant: set[fx.Node], group: set[fx.Node]
) -> tuple[fx.Node, fx.Node, fx.Node, float, bool, float | None]:
    dim = _argument(soft, 1, "dim")
    if dim is not None and int(dim) % values[soft].dim() != values[soft].dim() - 1:
        raise GraphError(f"{_where({soft})}: attention's softmax must run over the last dim")
    # back from the softmax to the product q @ k^T, through masks, constant factors and a
    # soft cap (cap * tanh(scores / cap): Gemma 2's attn_logit_softcapping)
    scale, causal, node, softcap = 1.0, False, _tensor_arg(soft, constant), None
    while not _is_product(node):
        if _is_tanh(node):
            if softcap is not None or scale <= 0:
                raise GraphError(
                    f"{_where({node})}: attention's scores pass a tanh; layerwise reads it as "
                    "a soft cap, cap * tanh(scores / cap), once"
                )
            softcap, scale = scale, 1.0
        elif (mask := _additive_mask(node, constant)) is not None:
            if not _causal_mask(mask, constant, node, values):
                raise GraphError(
                    f"{_where({node})}: the attention mask added to the scores hides nothing"
                )
            causal = True
        elif _is_mask(node):
            fill = _argument(node, 2, "value") if node.target != torch.where else node.args[2]
            fill = _number(fill, values)  # -inf, or torch.finfo(dtype).min as a 0-d tensor
            if fill is None or fill > HIDDEN:
                raise GraphError(
                    f"{_where({node})}: attention's mask fills {fill!r}; layerwise reads a "
                    "mask that hides positions with -inf (or a large negative number)"
                )
            mask = _mask_of(node)
            if mask is None or not _causal_mask(mask, constant, node, values):
                raise GraphError(
                    f"{_where({node})}: the attention mask is computed from the inputs "
                    "(a padding mask?); layerwise's attention op has only the causal mask"
                )
            causal = True
        elif _is_scale(node, values):
            scale *= _scalar_factor(node, values)
        elif not _is_passthrough(node):
            raise GraphError(
                f"{_where({node})} ({_describe(node)}): between attention's "
                "product and its softmax only masks and constant factors are read"
            )
        node = _tensor_arg(node, constant)
    a, b = _product_args(node)
    # forward from the softmax to the product with v, through dropout
    probs, users = soft, [u for u in soft.users if u in group]
    while len(users) == 1 and not _is_product(users[0]):
        if not (_is_dropout(users[0]) or _is_passthrough(users[0])):
            break
        probs, users = users[0], [u for u in users[0].users if u in group]
    if len(users) != 1 or not _is_product(users[0]):
        raise GraphError(f"{_where({soft})}: the softmax's output is not multiplied by v")
    pa, pb = _product_args(users[0])
    if pa is not probs:
        raise GraphError(f"{_where({soft})}: attention must multiply softmax(...) @ v")
    if softcap is not None:  # the factors inside the tanh are scale / cap
        scale *= softcap
    return a, b, pb, scale, causal, softcap


def _is_tanh(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _TANH_FUNCTIONS) or (
        node.op == "call_method" and node.target == "tanh"
    )


def _additive_mask(node: fx.Node, constant: set[fx.Node]) -> fx.Node | None:
    """The mask of `scores + mask` (a float mask computed without the inputs, 0 where
    attention looks and a large negative number where it does not: Hugging Face's eager
    attention), or None."""
    if not (node.op == "call_function" and node.target in (operator.add, torch.add)):
        return None
    masks = [a for a in node.args[:2] if isinstance(a, fx.Node) and a in constant]
    return masks[0] if len(masks) == 1 else None


def _entries(
    x: fx.Node, group: set[fx.Node], values: dict[fx.Node, Any], constant: set[fx.Node]
) -> set[fx.Node]:
    """The (sample, length, channel) tensors that `x` (inside the region) comes from."""
    found: set[fx.Node] = set()
    stack, seen = [x], set()
    while stack:
        n = stack.pop()
        if n in seen or n in constant:
            continue
        seen.add(n)
        if n not in group:
            found.add(n)
            continue
        stack.extend(a for a in _args(n) if _is_tensor(values.get(a)))  # (also unbind's)
    return {
        n
        for n in found
        if n.op != "get_attr"
        and isinstance(values[n], torch.Tensor)
        and values[n].is_floating_point()
    }


def _ancestors(x: fx.Node, group: set[fx.Node]) -> set[fx.Node]:
    """The region's nodes that `x` is computed from, `x` included."""
    out: set[fx.Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n in out or n not in group:
            continue
        out.add(n)
        stack.extend(_args(n))
    return out


def _qk_norms(
    gm: fx.GraphModule,
    group: set[fx.Node],
    q_op: fx.Node,
    k_op: fx.Node,
    head: int,
    norm_of: NormOf | None,
    tables: tuple[fx.Node, ...],
    where: str,
) -> tuple[fx.Node, ...]:
    """QK-norm (Qwen3): the norm modules of the region, one on q's way and one on k's, each
    over a head's channels and before the rotary embedding; () when it has none."""
    found = [n for n in group if n.op == "call_module"]
    found = [n for n in found if norm_of is not None and norm_of(_module_of(gm, n)) is not None]
    if not found:
        return ()
    q_side, k_side = _ancestors(q_op, group), _ancestors(k_op, group)
    on_q = [n for n in found if n in q_side and n not in k_side]
    on_k = [n for n in found if n in k_side and n not in q_side]
    widths = {int(p.shape[0]) for n in found for p in _module_of(gm, n).parameters()}
    if len(on_q) != 1 or len(on_k) != 1 or len(found) != 2 or widths != {head}:
        raise GraphError(
            f"the attention at {where} normalises its heads with {len(found)} norm modules; "
            f"layerwise reads QK-norm: one RMS norm over each q head's {head} channels and "
            "one over each k head's (Qwen3)"
        )
    turned = {n for n in group if any(t in _args(n) for t in tables)}
    if any(turned & _ancestors(n, group) for n in found):
        raise GraphError(
            f"the attention at {where} normalises q or k heads after their rotary embedding; "
            "layerwise reads QK-norm before it (Qwen3)"
        )
    return on_q[0], on_k[0]


def _qk_norm_attrs(
    gm: fx.GraphModule, norms: tuple[fx.Node, ...], norm_of: NormOf | None, where: str
) -> dict[str, Any]:
    assert norm_of is not None
    found = [norm_of(_module_of(gm, n)) or {} for n in norms]
    if any(f.get("norm") != "rms" for f in found) or found[0] != found[1]:
        raise GraphError(
            f"the attention at {where} normalises q and k heads with {found}; layerwise reads "
            "QK-norm as two RMS norms of one epsilon (Qwen3)"
        )
    attrs: dict[str, Any] = {"qk_norm": "rms"}
    attrs.update({f"qk_norm_{k}": v for k, v in found[0].items() if k != "norm"})
    return attrs


def _module_of(gm: fx.GraphModule, n: fx.Node) -> nn.Module:
    return gm.get_submodule(str(n.target))


def _factors(x: fx.Node, entry: fx.Node, group: set[fx.Node], values: dict[fx.Node, Any]) -> float:
    """The product of the constant factors on the way from `entry` to `x` (q or k scaled
    before their product)."""
    out, node = 1.0, x
    while node is not entry and node in group:
        if _is_scale(node, values):
            out *= _scalar_factor(node, values)
        reads = [a for a in _args(node) if isinstance(values.get(a), torch.Tensor)]
        if not reads:
            break
        node = reads[0]
    return out


# -- node predicates ------------------------------------------------------------------------


def _args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _argument(node: fx.Node, pos: int, key: str) -> Any:
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(key)


def _is_call(node: fx.Node, fn: Any) -> bool:
    return node.op == "call_function" and node.target is fn


def _is_softmax(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _SOFTMAX_FUNCTIONS
    if node.op == "call_method":
        return node.target == "softmax"
    return node.op == "call_module" and isinstance(_module(node), nn.Softmax)


def _is_product(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _PRODUCT_FUNCTIONS) or (
        node.op == "call_method" and node.target in _PRODUCT_METHODS
    )


def _is_mask(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MASK_FUNCTIONS) or (
        node.op == "call_method" and node.target in _MASK_METHODS
    )


def _is_scale(node: fx.Node, values: dict[fx.Node, Any]) -> bool:
    """A product or quotient of a tensor and a constant number (a Python number, or a 0-d
    tensor computed without the inputs, as `torch.full([], d ** 0.5)`)."""
    scaled = (node.op == "call_function" and node.target in _SCALE_FUNCTIONS) or (
        node.op == "call_method" and node.target in _SCALE_METHODS
    )
    return scaled and any(_number(a, values) is not None for a in node.args)


def _number(a: Any, values: dict[fx.Node, Any]) -> float | None:
    """`a` as a constant number, or None."""
    if isinstance(a, int | float) and not isinstance(a, bool):
        return float(a)
    if isinstance(a, fx.Node):
        meta = values.get(a)
        if isinstance(meta, torch.Tensor) and meta.numel() == 1:
            value = _evaluate(a, {}, values)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                return float(value)
    return None


def _is_dropout(node: fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(_module(node), nn.Dropout)
    return node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS


def _is_passthrough(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target in ("contiguous", "float", "type_as", "to")


def _module(node: fx.Node) -> nn.Module | None:
    owner = node.graph.owning_module
    return owner.get_submodule(str(node.target)) if owner is not None else None


def _scalar_factor(node: fx.Node, values: dict[fx.Node, Any]) -> float:
    numbers = [(i, _number(a, values)) for i, a in enumerate(node.args)]
    at, number = next((i, n) for i, n in numbers if n is not None)
    divide = node.target in (operator.truediv, torch.div, "div", "__truediv__", "div_")
    if divide and at == 1:
        return 1.0 / number
    return number


def _tensor_arg(node: fx.Node, constant: set[fx.Node]) -> fx.Node:
    reads = [a for a in _args(node) if a not in constant]
    if not reads:
        raise GraphError(f"{_where({node})}: reads no computed tensor")
    return reads[0]


def _product_args(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The two operands of a product (matmul, @, bmm, or a two-operand einsum: which dims it
    contracts is checked by running the region, `_verify`)."""
    if node.target is torch.einsum:
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], list | tuple):
            operands = tuple(operands[0])
        if len(operands) != 2:
            raise GraphError(f"{_where({node})}: an einsum of {len(operands)} operands")
        a, b = operands
    else:
        a, b = node.args[0], node.args[1]
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        raise GraphError(f"{_where({node})}: a product of a tensor and a constant")
    return a, b


def _mask_of(node: fx.Node) -> fx.Node | None:
    if node.target in ("masked_fill", "masked_fill_", torch.masked_fill):
        mask = _argument(node, 1, "mask")
    else:  # where(mask, scores, -inf)
        mask = _argument(node, 0, "condition")
    return mask if isinstance(mask, fx.Node) else None


def _causal_mask(
    mask: Any, constant: set[fx.Node], at: fx.Node, values: dict[fx.Node, Any]
) -> bool:
    """Whether `mask` (computed without the inputs) hides exactly the positions after each
    query's own, or those and the ones beyond a sliding window (its size then in
    `at.meta["layerwise_window"]`): read from its values when they can be computed here
    (shapes, real buffers, constants fx baked in); else from its code (a tril or triu, or a
    registered triangular buffer), and then confirmed by the runtime, which has the values.
    A mask computed from the inputs, or one that hides other positions, raises GraphError."""
    if not isinstance(mask, fx.Node):
        return False
    if mask not in constant:
        raise GraphError(
            f"{_where({at})}: the attention mask is computed from the inputs (a padding "
            "mask?); layerwise's attention op has only the causal mask"
        )
    # one mask serves every layer: read once per kind of consumer
    kind = (at.target is torch.where, at.target is F.scaled_dot_product_attention)
    read = mask.meta.setdefault("layerwise_mask", {})
    if kind not in read:
        read[kind] = _read_mask(mask, at, values)
    causal, window = read[kind]
    if window is not None:
        at.meta["layerwise_window"] = window
    return causal


def _read_mask(mask: fx.Node, at: fx.Node, values: dict[fx.Node, Any]) -> tuple[bool, int | None]:
    """(causal, sliding window) of the mask's values (`_causal_mask`)."""
    meta = values.get(mask)
    if (
        isinstance(meta, torch.Tensor)
        and meta.numel() > MASK_ELEMENTS
        and not _mentions(mask, _TRIANGLES)
    ):
        raise GraphError(
            f"{_where({at})}: the attention mask, {tuple(meta.shape)}, is too big to compute "
            f"here (over {MASK_ELEMENTS:,} elements, several GiB while it is built); capture "
            "with a smaller batch or a shorter sequence"
        )
    value = _evaluate(mask, {}, values)
    if not isinstance(value, torch.Tensor):
        if _mentions(mask, _TRIANGLES):
            return True, None
        raise GraphError(
            f"{_where({at})}: layerwise cannot tell what the attention mask hides (its values "
            "cannot be computed here and its code has no tril or triu)"
        )
    square = value.reshape(-1, *value.shape[-2:])[0] if value.dim() >= 2 else value
    if square.dim() != 2 or square.shape[0] != square.shape[1]:
        raise GraphError(f"{_where({at})}: an attention mask of shape {tuple(value.shape)}")
    upper = torch.ones_like(square, dtype=torch.bool).triu(1)
    if at.target is torch.where:  # where(mask, scores, -inf): True keeps
        hidden = ~square.bool()
    elif square.dtype == torch.bool:  # masked_fill: True hides; SDPA's attn_mask: True keeps
        hidden = ~square if at.target is F.scaled_dot_product_attention else square
    else:  # an additive float mask: -inf (or the dtype's lowest: Hugging Face) hides
        hidden = square <= HIDDEN
        if bool((square[~hidden] != 0).any()):
            raise GraphError(
                f"{_where({at})}: the attention mask adds values other than 0 and a large "
                "negative number (a bias?); layerwise's attention op has only the causal mask"
            )
    if torch.equal(hidden, upper):
        return True, None
    if not hidden.any():
        return False, None
    # a sliding window (Mistral, Gemma's local layers, Phi-3): each query sees its own
    # position and the window - 1 before it
    window = int(square.shape[-1] - hidden[-1].sum())
    if 0 < window < square.shape[-1] and torch.equal(hidden, upper | upper.T.tril(-window)):
        return True, window
    raise GraphError(
        f"{_where({at})}: the attention mask hides other positions than those after each "
        "query's own (causal) or beyond a sliding window; layerwise's attention op has only "
        "those masks"
    )


def _evaluate(node: fx.Node, memo: dict[fx.Node, Any], values: dict[fx.Node, Any]) -> Any:
    """`node`'s value computed on the CPU from shapes and real buffers; None if it cannot be
    (a meta buffer, an op that fails)."""
    if node in memo:
        return memo[node]
    owner = node.graph.owning_module
    out: Any = None
    known = values.get(node)
    try:
        if isinstance(known, torch.device):
            out = torch.device("cpu")  # a tensor's .device: computed here on the CPU
        elif known is not None and not _is_tensor(known):
            out = known  # a size, a dim: as the meta run found it
        elif node.op == "get_attr" and owner is not None:
            out = owner.get_buffer(str(node.target))
            out = None if out.is_meta else out
        elif node.op in ("call_function", "call_method"):
            unknown: list[fx.Node] = []  # arguments not computable here (a literal None is)

            def value(a: fx.Node) -> Any:
                v = _evaluate(a, memo, values)
                if v is None:
                    unknown.append(a)
                return v

            args = fx.node.map_arg(node.args, value)
            kwargs = fx.node.map_arg(node.kwargs, value)
            if unknown:
                return None
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
            if node.op == "call_function":
                out = node.target(*args, **kwargs)  # type: ignore[operator]
            else:
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
    except Exception:  # noqa: BLE001 - not computable here: the runtime checks instead
        out = None
    memo[node] = out
    return out


def evaluate_constant(node: fx.Node, values: dict[fx.Node, Any]) -> Any:
    """The value of a node computed without the inputs (from sizes, arange, ones, tril and
    real buffers), on the CPU; None when it cannot be computed here (a meta buffer)."""
    return _evaluate(node, {}, values)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or (
        isinstance(x, tuple | list) and any(isinstance(v, torch.Tensor) for v in x)
    )


def _flat(x: Any) -> list[Any]:
    if isinstance(x, tuple | list):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flat(v)]
    return [x]


def _mentions(node: fx.Node, names: Iterable[str]) -> bool:
    """Whether `node` or what it is computed from calls one of `names` (or reads a buffer
    made by one: a registered tril mask is recognised by its values' pattern instead)."""
    wanted = set(names)
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        target = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if target in wanted:
            return True
        if n.op == "get_attr" and _triangular_buffer(n):
            return True
        stack.extend(_args(n))
    return False


def _triangular_buffer(n: fx.Node) -> bool:
    """A registered buffer that holds a causal mask: ones on and below the diagonal of its
    last two dims, zeros above. On the meta device its values cannot be read: then it is
    taken as one, and the runtime's check of the op against the module's own forward (which
    has the values) confirms it."""
    owner = n.graph.owning_module
    try:
        value = owner.get_buffer(str(n.target)) if owner is not None else None
    except AttributeError:
        return False
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    if value.is_meta:
        return True
    square = value.reshape(-1, *value.shape[-2:])[0]
    return bool(torch.equal(square != 0, torch.ones_like(square, dtype=torch.bool).tril()))


def _where(nodes: set[fx.Node] | Iterable[fx.Node]) -> str:
    nodes = set(nodes)
    if not nodes:
        return "?"
    # the graph's first node among them (one pass: an index per node was quadratic, 1.3 s
    # of a 70B's capture)
    first = next(n for n in next(iter(nodes)).graph.nodes if n in nodes)
    stack = first.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return f"{path or '<top>'} (fx node {first.name!r})"


def _describe(n: fx.Node) -> str:
    if n.op == "call_function":
        return f"call_function {getattr(n.target, '__name__', n.target)}"
    return f"{n.op} {n.target}"


# -- structure keys: a numeric check done once per distinct structure ------------------------


class NoKey(Exception):
    """A value that a structure key cannot stand for by value: its owner is checked itself."""


_PLAIN_TYPES = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout)


def plain_key(v: Any) -> Hashable:
    """`v` as a hashable value that compares as `v` does (with its type: 1, 1.0 and True
    differ): plain values, containers of them, a dataclass config by its fields; NoKey for
    anything else (a function, a tensor, an object)."""
    if v is None or v is Ellipsis or isinstance(v, _PLAIN_TYPES + (torch.memory_format,)):
        return (type(v), v)
    if isinstance(v, tuple | list):
        return (type(v), tuple(plain_key(x) for x in v))
    if isinstance(v, set | frozenset):
        return (type(v), frozenset(plain_key(x) for x in v))
    if isinstance(v, dict):
        return (type(v), tuple((plain_key(k), plain_key(x)) for k, x in v.items()))
    if isinstance(v, slice):
        return (slice, plain_key(v.start), plain_key(v.stop), plain_key(v.step))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):  # a config object
        fields = dataclasses.fields(v)
        return (type(v), tuple((f.name, plain_key(getattr(v, f.name))) for f in fields))
    raise NoKey


def class_key(cls: type) -> Hashable:
    """The classes of `cls` up to nn.Module with what they define: their functions by
    identity (a forward patched between two captures is another key), plain values by value."""
    parts: list[Hashable] = []
    for c in cls.__mro__:
        if c is nn.Module:
            break
        for name, v in vars(c).items():
            if isinstance(v, type | staticmethod | classmethod | property) or callable(v):
                parts.append((name, v))
            elif not name.startswith("__"):
                parts.append((name, plain_key(v)))
        parts.append(c)
    return tuple(parts)


def tensor_shape(t: torch.Tensor) -> Hashable:
    return (tuple(t.shape), t.dtype)


def _module_key(m: nn.Module) -> Hashable:
    # buffers: values a forward may read; children: what recognising refuses at once
    if m._buffers or m._modules:
        raise NoKey
    state = vars(m)
    params = tuple((n, None if p is None else tensor_shape(p)) for n, p in m._parameters.items())
    plain = tuple(
        (k, plain_key(v))
        for k, v in sorted(state.items())
        if k not in ("_parameters", "_buffers", "_modules")
    )  # hooks are dicts of functions: a module with one has no key
    return (class_key(type(m)), params, plain)


def module_key(m: nn.Module) -> Hashable | None:
    """What running module `m` on a given input depends on, as a key that compares by value:
    its classes (and the functions they define), its parameters' names, shapes and dtypes
    (not their values: checks run it with random ones) and its plain attributes (eps, dims,
    the training flag). None when it holds anything else (a buffer, a child module, a hook, a
    function or object attribute) or torch has global module hooks: such a module is checked
    itself."""
    from torch.nn.modules import module as torch_module

    hooks = (
        torch_module._global_forward_hooks,
        torch_module._global_forward_pre_hooks,
        torch_module._global_backward_hooks,
        torch_module._global_backward_pre_hooks,
    )
    if any(hooks):
        return None
    try:
        key = _module_key(m)
        hash(key)  # a class attribute may be an unhashable callable
    except (NoKey, TypeError):
        return None
    return key


def _value_key(value: Any) -> Hashable:
    """A constant's value (a mask, a rotary table, a size) as a key: tensors by their bytes."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return (tensor_shape(value), hashlib.blake2b(data.tobytes(), digest_size=16).digest())
    if isinstance(value, tuple | list):
        return (type(value), tuple(_value_key(v) for v in value))
    return plain_key(value)


def _meta_key(value: Any) -> Hashable:
    """A node's meta value as a key: tensors by shape and dtype."""
    if isinstance(value, torch.Tensor):
        return tensor_shape(value)
    if isinstance(value, tuple | list):
        return (type(value), tuple(_meta_key(v) for v in value))
    return plain_key(value)


def _region_key(
    gm: fx.GraphModule,
    region: AttentionRegion,
    order: list[fx.Node],
    constants: list[fx.Node],
    memo: dict[fx.Node, Any],
    values: dict[fx.Node, Any],
) -> Hashable | None:
    """What `_verify`'s comparison of `region` depends on, as a key that compares by value:
    the attrs it was read as, its entries' shapes, and per node in order its op, target
    (a module by `module_key`), arguments (nodes by position in the region) and shape;
    constants (masks, rotary tables) by their values. None when it reads something else."""
    entries = (region.q, region.k, region.v)
    local: dict[fx.Node, Hashable] = {
        x: ("entry", i) for i, x in reversed(list(enumerate(entries)))
    }
    local.update({n: ("node", i) for i, n in enumerate(order)})

    def ref(a: fx.Node | None) -> Any:
        if a not in local:
            raise NoKey  # a node outside the region: not keyed
        return local[a]

    try:
        attrs = dict(region.attrs)
        if "rope_tables" in attrs:  # node names: the tables' values are in the key instead
            named = {n.name: n for n in order}
            attrs["rope_tables"] = [ref(named.get(t)) for t in attrs["rope_tables"]]
        parts: list[Hashable] = [
            plain_key(attrs),
            region.packed,
            tuple(local[x] for x in entries),
            tuple(_meta_key(values[x]) for x in entries),
        ]
        for n in order:
            if n in constants:
                parts.append(("const", _value_key(memo.get(n))))
                continue
            target: Hashable = n.target
            if n.op == "call_module":  # run with its own weights here: keyed without them
                mod = gm.get_submodule(str(n.target))
                random = n in region.norms  # a QK-norm runs with random weights
                owned = any(True for _ in mod.parameters()) and not random
                target = None if owned else module_key(mod)
                if target is None:
                    return None
            args = fx.node.map_arg((n.args, n.kwargs), ref)
            parts.append((n.op, target, plain_key(args), _meta_key(values.get(n))))
        key = tuple(parts)
        hash(key)
    except (NoKey, TypeError):
        return None
    return key
