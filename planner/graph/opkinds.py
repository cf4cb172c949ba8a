"""Operator kinds: their parallelizable dimensions (SOAP) and how output regions map to inputs.

The parallelizable dimensions follow Table 1 of OptCNN (000, Sec. 4) and of FlexFlow (002,
Sec. 4): every op can split its *output* tensor along some named dimensions; each dimension is
tagged Sample, Attribute (no parameter split) or Parameter (splits the op's weights).

A task owns a box of the output tensor. `input_dim_map` tells, per dimension of an input
tensor, which input range the task needs: the same range of an output dimension ("same"), the
whole dimension ("full"), a sliding window as in convolution and pooling ("window", with the
halo that follows from kernel, stride and padding), or a shifted range ("offset", concat).
Region overlaps in the cost model and the runtime's transfer plan both come from this table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol


class Tensor(Protocol):
    """What this module reads of a tensor (`planner.graph.opgraph.Tensor`): its named
    dimensions and their sizes. A protocol, so that opgraph (which uses this table) is not
    imported back."""

    @property
    def dims(self) -> tuple[str, ...]: ...

    def size(self, dim: str) -> int: ...


class Op(Protocol):
    """What this module reads of an op (`planner.graph.opgraph.Op`)."""

    @property
    def kind(self) -> str: ...

    @property
    def output(self) -> Tensor: ...

    @property
    def params(self) -> Sequence[Any]: ...

    def attr(self, key: str, default: Any = None) -> Any: ...


SAMPLE, CHANNEL, HEIGHT, WIDTH, LENGTH = "sample", "channel", "height", "width", "length"

Tag = Literal["S", "A", "P"]


@dataclass(frozen=True)
class DimMap:
    """How one dimension of an input tensor follows the op's output region.

    kind "same": input range == output range of `out_dim`;
    "full": the whole input dimension;
    "window": output index o needs inputs [o*stride - pad, o*stride - pad + extent) (clipped),
    with extent = dilation*(kernel-1)+1;
    "offset": input range = output range of `out_dim` shifted by -offset, clipped to the input
    (the input occupies [offset, offset + size) of the output, as in concat; a negative offset
    reads a slice of the input);
    "group": attention's inputs read by head: output channels [a, b) are query heads
    [a / out_head, b / out_head) of `out_head` channels (0: `kernel`), and query head h reads
    input head h // stride of `kernel` channels (grouped-query attention's k and v: stride
    query heads share one; a q or k head wider than the output's v head), so the input range
    is input heads [a // (out_head stride), ceil(b / (out_head stride))).
    """

    kind: Literal["same", "full", "window", "offset", "group"]
    out_dim: str = ""
    kernel: int = 1
    stride: int = 1
    pad: int = 0
    dilation: int = 1
    offset: int = 0
    out_head: int = 0

    @property
    def per_input_head(self) -> int:
        """ "group": the output channels whose query heads read one input head."""
        return (self.out_head or self.kernel) * self.stride


@dataclass(frozen=True)
class KindSpec:
    """What layerwise knows about one op kind.

    The shapes it computes on (checked by `OpGraph`): its output has the dims `out_dims`
    besides sample (and no others when `exact`), each input the dims `in_dims`, and with
    `keeps` every input dim is an output dim (a pointwise op sums nothing away; an input step
    read through attr select excepted)."""

    name: str
    soap: dict[str, Tag]  # parallelizable output dims and their SOAP tag
    compute: Literal["flops", "bytes"]  # what dominates its cost: matmul-like or memory-bound
    description: str
    out_dims: tuple[str, ...] = ()
    exact: bool = False
    in_dims: tuple[str, ...] = ()
    keeps: bool = False


def _spec(
    name: str,
    soap: dict[str, Tag],
    compute: str,
    description: str,
    out_dims: tuple[str, ...] = (),
    exact: bool = False,
    in_dims: tuple[str, ...] = (),
    keeps: bool = False,
) -> KindSpec:
    return KindSpec(name, soap, compute, description, out_dims, exact, in_dims, keeps)  # type: ignore[arg-type]


_IMAGE = (CHANNEL, HEIGHT, WIDTH)


# Dimensions that appear in an op's output but are absent from its soap dict are not split.
# Dims not present in a particular op's output tensor are simply ignored.
KINDS: dict[str, KindSpec] = {
    k.name: k
    for k in [
        _spec(
            "input",
            {SAMPLE: "S", HEIGHT: "A", WIDTH: "A", LENGTH: "A"},
            "bytes",
            "training data fed to the network",
        ),
        _spec(
            "conv2d",
            {SAMPLE: "S", HEIGHT: "A", WIDTH: "A", CHANNEL: "P"},
            "flops",
            "2D convolution (attrs: kernel, stride, padding, dilation, groups)",
            out_dims=_IMAGE,
            exact=True,
            in_dims=_IMAGE,
        ),
        _spec(
            "pool2d",
            {SAMPLE: "S", HEIGHT: "A", WIDTH: "A", CHANNEL: "A"},
            "bytes",
            "2D max/avg pooling, adaptive pooling (attrs: kernel, stride, padding, mode)",
            out_dims=_IMAGE,
            exact=True,
            in_dims=_IMAGE,
            keeps=True,
        ),
        _spec(
            "linear",
            {SAMPLE: "S", LENGTH: "A", CHANNEL: "P"},
            "flops",
            "fully-connected layer over the last dimension; other non-sample dims are read whole",
            out_dims=(CHANNEL,),
        ),
        _spec(
            "embedding",
            {SAMPLE: "S", LENGTH: "A", CHANNEL: "P"},
            "bytes",
            "embedding lookup of integer tokens",
            out_dims=(CHANNEL,),
        ),
        _spec(
            "lstm",
            {SAMPLE: "S", CHANNEL: "P"},
            "flops",
            "one time step of an LSTM cell (inputs: x_t, then the previous step's state)",
            out_dims=(CHANNEL,),
            exact=True,
            in_dims=(CHANNEL,),
        ),
        _spec(
            "attention",
            {SAMPLE: "S", LENGTH: "A", CHANNEL: "A"},
            "flops",
            "scaled dot-product attention over (sample, length, channel) q, k, v; channel splits by heads",
            out_dims=(LENGTH, CHANNEL),
            exact=True,
            in_dims=(LENGTH, CHANNEL),
        ),
        _spec(
            "rnn_attention",
            {SAMPLE: "S", CHANNEL: "P"},
            "flops",
            "attention of a decoder state over encoder states, with its output projection",
            out_dims=(CHANNEL,),
            exact=True,
            in_dims=(CHANNEL,),
        ),
        _spec(
            "moe",
            {SAMPLE: "S", LENGTH: "A"},
            "flops",
            "mixture of experts: a router, the top k of E expert MLPs per token, optionally a "
            "shared expert (planner.graph.moe; experts spread by ParallelConfig.expert)",
            out_dims=(CHANNEL,),
            in_dims=(CHANNEL,),
        ),
        _spec(
            "norm",
            {SAMPLE: "S", HEIGHT: "A", WIDTH: "A", LENGTH: "A", CHANNEL: "P"},
            "bytes",
            "batch norm (per channel), layer or RMS norm (over channel: channel not split)",
            out_dims=(CHANNEL,),
            keeps=True,
        ),
        _spec(
            "elementwise",
            {SAMPLE: "S", HEIGHT: "A", WIDTH: "A", LENGTH: "A", CHANNEL: "A"},
            "bytes",
            "pointwise ops: activations, dropout, add, mul",
            keeps=True,
        ),
        _spec(
            "concat",
            {SAMPLE: "S", HEIGHT: "A", WIDTH: "A", LENGTH: "A", CHANNEL: "A"},
            "bytes",
            "concatenation along attr 'dim'",
            keeps=True,
        ),
        _spec(
            "slice",
            {SAMPLE: "S", HEIGHT: "A", WIDTH: "A", LENGTH: "A", CHANNEL: "A"},
            "bytes",
            "a contiguous range [start, start + size) of its input along attr 'dim' (a piece "
            "of split or chunk: the q, k, v of a fused projection)",
            keeps=True,
        ),
        _spec(
            "flatten",
            {SAMPLE: "S"},
            "bytes",
            "reshape to (sample, channel)",
            out_dims=(CHANNEL,),
            exact=True,
        ),
        _spec(
            "softmax",
            {SAMPLE: "S", LENGTH: "A"},
            "bytes",
            "softmax with cross-entropy loss over channel",
            out_dims=(CHANNEL,),
            keeps=True,
        ),
    ]
}


def kind_spec(kind: str) -> KindSpec:
    """The spec of `kind`; raises GraphError naming the known kinds when it is unknown."""
    from planner.errors import GraphError

    try:
        return KINDS[kind]
    except KeyError:
        raise GraphError(
            f"unknown op kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}"
        ) from None


def parallel_dims(op: Op) -> tuple[str, ...]:
    """The output dims `op` may split, in the order of its output tensor."""
    soap = kind_spec(op.kind).soap
    dims = [d for d in op.output.dims if d in soap]
    if op.attr("norm") in ("layer", "rms"):  # (alone or folded) normalizes over channel
        dims = [d for d in dims if d != CHANNEL]
    return tuple(dims)


def parameter_dims(op: Op) -> tuple[str, ...]:
    """Parallel dims tagged P: splitting them splits the op's parameters."""
    soap = kind_spec(op.kind).soap
    return tuple(d for d in parallel_dims(op) if soap[d] == "P")


@dataclass(frozen=True)
class AttentionDims:
    """The head geometry of an attention op (attrs heads, kv_heads, head_dim, rope_dim, mla,
    qk_norm; the output holds heads x v_head_dim channels).

    Standard attention reads q (heads x head_dim), k (kv_heads x head_dim) and v (kv_heads x
    v_head_dim); multi-head latent attention (`mla`, DeepSeek-V3, arXiv 2412.19437, Sec. 2.1.1, Eqs. 1-11, without weight
    absorption) reads q (heads x head_dim), kv (per head, head_dim - rope_dim key channels
    then v_head_dim value channels: the key/value up-projection's output) and a rotary key
    of rope_dim channels that every head shares. Rotary embeddings turn the last `rope_dim`
    channels of each q and k head."""

    heads: int
    kv_heads: int
    head_dim: int  # q and k channels per head
    v_head_dim: int  # v and output channels per head
    rope_dim: int
    mla: bool
    qk_norm: bool = False  # q and k heads RMS-normed (Qwen3), two weights of head_dim

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    def input_head(self, index: int) -> int:
        """Channels per head of input `index` (0 for MLA's shared rotary key)."""
        if index == 0:
            return self.head_dim
        if self.mla:
            return self.head_dim - self.rope_dim + self.v_head_dim if index == 1 else 0
        return self.head_dim if index == 1 else self.v_head_dim


def attention_dims(op: Op) -> AttentionDims:
    """`op`'s head geometry (`AttentionDims`): head_dim and v_head_dim default to the
    output's channels per head, kv_heads to heads, rope_dim to head_dim."""
    heads = int(op.attr("heads", 1))
    v = op.output.size(CHANNEL) // heads if CHANNEL in op.output.dims else 1
    d = int(op.attr("head_dim", v))
    return AttentionDims(
        heads=heads,
        kv_heads=int(op.attr("kv_heads", heads)),
        head_dim=d,
        v_head_dim=v,
        rope_dim=int(op.attr("rope_dim", d)),
        mla=bool(op.attr("mla", False)),
        qk_norm=bool(op.attr("qk_norm", False)),
    )


def split_unit(op: Op, dim: str) -> int:
    """The granularity of a split along `dim` (attention splits channel by whole heads)."""
    if op.kind == "attention" and dim == CHANNEL:  # whole heads; with fewer k/v heads, whole
        # groups of the query heads that share one (a task then reads whole k/v heads)
        heads = int(op.attr("heads", 1))
        group = heads // int(op.attr("kv_heads", heads))
        return op.output.size(CHANNEL) // heads * group
    if op.kind == "conv2d" and dim == CHANNEL:
        groups = int(op.attr("groups", 1))
        return op.output.size(CHANNEL) // groups if groups > 1 else 1
    return 1


# -- contraction (reduction-dimension) splits ---------------------------------------------------

REDUCE = "reduce"  # the task-grid dim of a contraction split (its size: the summed length)
# Folded functions that a sum of partial results commutes with: a task of a contraction split
# applies them to its partial sum (dropout: the runtime computes it as the identity)
_LINEAR_FUSED = ("dropout",)


@dataclass(frozen=True)
class Contraction:
    """What a contraction split of an op cuts (Megatron-LM's row-parallel linear, Shoeybi et
    al. 2019, Sec. 3): input `position`'s dim `dim`, of `size` elements, over which the op
    sums; weight parameter `param` is cut along its `axis` with it. Task j of r computes the
    sum over elements [j size/r, (j+1) size/r): a partial result of its whole output box,
    which the consumers add up (a reduce-scatter or an all-reduce, priced and run as the
    transfers of the partials).

    An internal contraction (`position` -1, `param` -1) sums over a dim inside the op that no
    input holds: a mixture of experts' expert hidden width (`planner.graph.moe`, expert
    tensor parallelism). Every task of it reads its inputs whole and holds a slice of the
    weights that `planner.graph.moe.ffn_axes` names; `size` is the width every slice
    divides."""

    position: int
    dim: str
    size: int
    param: int
    axis: int

    @property
    def internal(self) -> bool:
        """Whether the summed dim is inside the op (no input is cut with it)."""
        return self.position < 0


def contraction(op: Op, summed: Tensor | None = None) -> Contraction | None:
    """The contraction `op` may split, or None: a linear over the last (channel) dim, or a
    convolution over its input channels (groups 1), with its weight, no absorbed flatten or
    input functions, and folded functions only from `_LINEAR_FUSED` (a folded norm or
    activation of a partial sum would compute something else). With `summed`, the input it
    sums over (`OpGraph.contraction` passes it): a linear that flattens other dims of it into
    its features, or whose channels differ from the weight's, sums over more than one dim:
    None. A moe op: its experts' hidden width, an internal contraction (`Contraction`)."""
    if op.kind == "moe":
        return _expert_contraction(op)
    if op.kind not in ("linear", "conv2d") or not op.params or op.attr("flatten"):
        return None
    if summed is not None:
        con = contraction(op)
        if con is None or con.dim not in summed.dims or summed.size(con.dim) != con.size:
            return None
        if op.kind == "linear" and set(summed.dims) - {SAMPLE, LENGTH, CHANNEL}:
            return None
        return con
    if op.attr("pre_ops") or any(f not in _LINEAR_FUSED for f in fused_ops(op)):
        return None
    if op.attr("norm") is not None:
        return None
    weight = op.params[0].shape
    if op.kind == "linear":
        if len(weight) != 2:
            return None
        axis = 0 if op.attr("transposed") else 1
        return Contraction(0, CHANNEL, int(weight[axis]), 0, axis)
    if len(weight) != 4 or int(op.attr("groups", 1)) != 1:
        return None
    return Contraction(0, CHANNEL, int(weight[1]), 0, 1)


FFN = "ffn"  # the internal contracted dim of a moe op: its experts' hidden width


def _expert_contraction(op: Op) -> Contraction | None:
    """A moe op's experts' hidden width (and its shared expert's: a split must divide both,
    so `size` is their gcd), which expert tensor parallelism cuts (Megatron-Core's
    `--expert-tensor-parallel-size`): each task holds 1/r of every expert's w1 and w3 rows
    and w2 columns, and its output is a partial sum. None without the `ffn` attribute."""
    ffn = int(op.attr("ffn", 0))
    if ffn < 1:
        return None
    shared = int(op.attr("shared_ffn", 0))
    return Contraction(-1, FFN, math.gcd(ffn, shared) if shared else ffn, -1, -1)


def input_dim_map(op: Op, index: int, tensor: Tensor) -> tuple[DimMap, ...]:
    """Per dimension of input `index` (shaped `tensor`), how it follows op's output region."""
    out = op.output.dims
    maps: list[DimMap] = []
    for dim in tensor.dims:
        maps.append(_dim_map(op, index, dim, out))
    return tuple(maps)


def _window(op: Op, axis: int) -> DimMap:
    kernel = op.attr("kernel", (1, 1))
    stride = op.attr("stride", (1, 1))
    padding = op.attr("padding", (0, 0))
    dilation = op.attr("dilation", (1, 1))
    return DimMap(
        "window",
        (HEIGHT, WIDTH)[axis],
        kernel=int(kernel[axis]),
        stride=int(stride[axis]),
        pad=int(padding[axis]),
        dilation=int(dilation[axis]),
    )


def _dim_map(op: Op, index: int, dim: str, out: tuple[str, ...]) -> DimMap:
    kind = op.kind
    if dim == SAMPLE:
        return DimMap("same", SAMPLE)
    if kind in ("conv2d", "pool2d") and dim in (HEIGHT, WIDTH):
        return _window(op, 0 if dim == HEIGHT else 1)
    if kind == "conv2d" and dim == CHANNEL:
        return DimMap("full")
    if kind == "concat" and dim == op.attr("dim"):
        return DimMap("offset", dim, offset=int(op.attr("offsets")[index]))
    if kind == "slice" and dim == op.attr("dim"):  # input range = output range + start
        return DimMap("offset", dim, offset=-int(op.attr("start")))
    if kind == "attention":
        # q rows follow the output rows; k and v are read whole along length.
        if dim == LENGTH and index > 0:
            return DimMap("full")
        if dim == CHANNEL and CHANNEL in out:
            return _attention_channels(op, index)
        return DimMap("same", dim) if dim in out else DimMap("full")
    if kind in ("linear", "lstm", "rnn_attention", "flatten", "softmax", "moe") and dim == CHANNEL:
        return DimMap("full")
    if kind == "norm" and dim == CHANNEL and op.attr("norm") in ("layer", "rms"):
        return DimMap("full")
    if kind in ("linear", "lstm", "rnn_attention", "flatten") and dim not in (LENGTH,):
        return DimMap("full")
    if dim in out:
        return DimMap("same", dim)
    return DimMap("full")


def _attention_channels(op: Op, index: int) -> DimMap:
    """The channels of attention input `index` that a task of whole query heads reads: the
    same heads of q, the key/value heads its query heads share (`AttentionDims`), all of
    MLA's shared rotary key."""
    a = attention_dims(op)
    kernel = a.input_head(index)
    if kernel == 0:
        return DimMap("full")
    stride = 1 if index == 0 or a.mla else a.group
    if kernel == a.v_head_dim and stride == 1:
        return DimMap("same", CHANNEL)
    out_head = 0 if kernel == a.v_head_dim else a.v_head_dim
    return DimMap("group", CHANNEL, kernel=kernel, stride=stride, out_head=out_head)


# -- folded ops ------------------------------------------------------------------------------

# Name fragments of folded ops, in the order they are tried (see `fused_ops`).
_GUESSES = (
    ("drop", "dropout"),
    ("gelu", "gelu"),
    ("silu", "silu"),
    ("sigmoid", "sigmoid"),
    ("tanh", "tanh"),
    ("relu", "relu"),
    ("add", "add"),
    ("mul", "mul"),
    ("sub", "sub"),
    ("div", "div"),
)


def fused_ops(op: Op) -> tuple[str, ...]:
    """The functions of the ops folded into `op`, in the order they are applied.

    From attr "fused_ops" when the graph records it; otherwise from the names in attr
    "fused": a folded norm (attr norm) first, the absorbed flatten dropped, the rest guessed
    from their names (default relu)."""
    explicit = op.attr("fused_ops")
    if explicit is not None:
        return tuple(str(f) for f in explicit if f != "flatten")
    names = [str(n) for n in op.attr("fused", ())]
    if op.attr("flatten") and names:
        names.pop(0)  # coarsen lists the absorbed flatten first
    out: list[str] = []
    norm = op.attr("norm")
    if op.kind != "norm" and norm in ("batch", "layer"):
        out.append(f"{norm}_norm")
        if names:
            looks = [i for i, n in enumerate(names) if any(s in n.lower() for s in ("bn", "norm"))]
            names.pop(looks[0] if looks else 0)
    for name in names:
        base = name.lower()
        out.append(next((fn for frag, fn in _GUESSES if frag in base), "relu"))
    return tuple(out)


def is_batch_norm(op: Op) -> bool:
    """Whether `op` normalizes with batch statistics (a batch norm of its own or folded in):
    a task that holds part of its samples, height or width must sum its statistics with the
    tasks that hold the same channels."""
    if op.kind == "norm":
        return bool(op.attr("norm", "batch") == "batch")
    return "batch_norm" in fused_ops(op)


def stats_groups(op: Op, degrees: tuple[int, ...]) -> list[list[int]] | None:
    """Per task (row-major over `degrees`), the tasks that hold the same channels of a batch
    norm whose partition splits its samples, height or width: they sum their statistics
    (synchronized batch norm). None when op needs no such sum."""
    tasks = math.prod(degrees)
    if tasks == 1 or not is_batch_norm(op) or CHANNEL not in op.output.dims:
        return None
    c = op.output.dims.index(CHANNEL)
    if degrees[c] == tasks:
        return None
    index = [(t // math.prod(degrees[c + 1 :])) % degrees[c] for t in range(tasks)]
    members: dict[int, list[int]] = {}
    for t, k in enumerate(index):
        members.setdefault(k, []).append(t)
    return [members[k] for k in index]
