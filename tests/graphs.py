"""Small hand-built OpGraphs shared by the planner tests (built from Op/Tensor/Param, no torch).

Every builder returns a fresh, validated `OpGraph`. Sizes are small and divisible by 2, 4
and 8 where it matters, so config spaces on 4- and 8-device presets stay in the tens and
every cost table builds in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.graph.opgraph import Op, OpGraph, Param, Tensor

# -- op builders ------------------------------------------------------------------------------


def input_op(name: str, **dims: int) -> Op:
    return Op(name, "input", (), Tensor.of(**dims))


def conv2d(
    name: str,
    x: Op,
    cout: int,
    kernel: int = 3,
    stride: int = 1,
    pad: int = 1,
    param_group: str | None = None,
) -> Op:
    n, cin = x.output.size("sample"), x.output.size("channel")
    h, w = x.output.size("height"), x.output.size("width")
    ho = (h + 2 * pad - kernel) // stride + 1
    wo = (w + 2 * pad - kernel) // stride + 1
    return Op(
        name,
        "conv2d",
        (x.name,),
        Tensor.of(sample=n, channel=cout, height=ho, width=wo),
        params=(
            Param(f"{name}.weight", (cout, cin, kernel, kernel)),
            Param(f"{name}.bias", (cout,)),
        ),
        flops=2.0 * n * cout * ho * wo * cin * kernel * kernel,
        param_group=param_group,
        attrs=Op.make_attrs(
            {"kernel": (kernel, kernel), "stride": (stride, stride), "padding": (pad, pad)}
        ),
    )


def pool2d(name: str, x: Op, kernel: int = 2, stride: int = 2, pad: int = 0) -> Op:
    n, c = x.output.size("sample"), x.output.size("channel")
    h, w = x.output.size("height"), x.output.size("width")
    ho = (h + 2 * pad - kernel) // stride + 1
    wo = (w + 2 * pad - kernel) // stride + 1
    return Op(
        name,
        "pool2d",
        (x.name,),
        Tensor.of(sample=n, channel=c, height=ho, width=wo),
        flops=float(n * c * ho * wo * kernel * kernel),
        attrs=Op.make_attrs(
            {
                "kernel": (kernel, kernel),
                "stride": (stride, stride),
                "padding": (pad, pad),
                "mode": "max",
            }
        ),
    )


def elementwise(name: str, *xs: Op, fn: str = "relu") -> Op:
    out = xs[0].output
    return Op(
        name,
        "elementwise",
        tuple(x.name for x in xs),
        out,
        flops=float(out.numel * len(xs)),
        attrs=Op.make_attrs({"fn": fn}),
    )


def batch_norm(name: str, x: Op) -> Op:
    c = x.output.size("channel")
    return Op(
        name,
        "norm",
        (x.name,),
        x.output,
        params=(Param(f"{name}.weight", (c,)), Param(f"{name}.bias", (c,))),
        flops=4.0 * x.output.numel,
        attrs=Op.make_attrs({"norm": "batch"}),
    )


def layer_norm(name: str, x: Op) -> Op:
    c = x.output.size("channel")
    return Op(
        name,
        "norm",
        (x.name,),
        x.output,
        params=(Param(f"{name}.weight", (c,)), Param(f"{name}.bias", (c,))),
        flops=4.0 * x.output.numel,
        attrs=Op.make_attrs({"norm": "layer"}),
    )


def concat(name: str, *xs: Op, dim: str = "channel") -> Op:
    sizes = [x.output.size(dim) for x in xs]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    shape = tuple((d, sum(sizes) if d == dim else s) for d, s in xs[0].output.shape)
    return Op(
        name,
        "concat",
        tuple(x.name for x in xs),
        Tensor(shape),
        attrs=Op.make_attrs({"dim": dim, "offsets": offsets}),
    )


def flatten(name: str, x: Op) -> Op:
    n = x.output.size("sample")
    return Op(name, "flatten", (x.name,), Tensor.of(sample=n, channel=x.output.numel // n))


def linear(name: str, x: Op, out: int, param_group: str | None = None) -> Op:
    n, cin = x.output.size("sample"), x.output.size("channel")
    return Op(
        name,
        "linear",
        (x.name,),
        Tensor.of(sample=n, channel=out),
        params=(Param(f"{name}.weight", (out, cin)), Param(f"{name}.bias", (out,))),
        flops=2.0 * n * cin * out,
        param_group=param_group,
    )


def softmax(name: str, x: Op) -> Op:
    return Op(name, "softmax", (x.name,), x.output, flops=3.0 * x.output.numel)


# -- graphs -----------------------------------------------------------------------------------


def chain_cnn(sample: int = 8) -> OpGraph:
    """input -> conv -> bn -> relu -> pool -> conv -> relu -> flatten -> linear -> softmax."""
    x = input_op("data", sample=sample, channel=3, height=16, width=16)
    c1 = conv2d("conv1", x, 8)
    bn = batch_norm("bn1", c1)
    r1 = elementwise("relu1", bn)
    p1 = pool2d("pool1", r1)
    c2 = conv2d("conv2", p1, 16)
    r2 = elementwise("relu2", c2)
    fl = flatten("flat", r2)
    fc = linear("fc", fl, 10)
    sm = softmax("loss", fc)
    return OpGraph("chain_cnn", (x, c1, bn, r1, p1, c2, r2, fl, fc, sm))


# Channels of the inception branches: concatenated to 48 = 4 x 12, so with a channel
# degree of 4 branch "b1" lands on task 0 only, "b5" on task 2 only, "b3" and "bpool" straddle.
INCEPTION_BRANCHES = {"b1": 8, "b3": 16, "b5": 8, "bpool": 16}


def inception() -> OpGraph:
    """A stem conv, four branches (1x1, 3x3, 5x5 convs, 3x3 pool + 1x1 conv), a channel concat."""
    x = input_op("data", sample=8, channel=3, height=8, width=8)
    stem = conv2d("stem", x, 16)
    b1 = conv2d("b1", stem, INCEPTION_BRANCHES["b1"], kernel=1, pad=0)
    b3 = conv2d("b3", stem, INCEPTION_BRANCHES["b3"], kernel=3, pad=1)
    b5 = conv2d("b5", stem, INCEPTION_BRANCHES["b5"], kernel=5, pad=2)
    pool = pool2d("pool", stem, kernel=3, stride=1, pad=1)
    bp = conv2d("bpool", pool, INCEPTION_BRANCHES["bpool"], kernel=1, pad=0)
    cat = concat("concat", b1, b3, b5, bp)
    fl = flatten("flat", cat)
    fc = linear("fc", fl, 8)
    sm = softmax("loss", fc)
    return OpGraph("inception", (x, stem, b1, b3, b5, pool, bp, cat, fl, fc, sm))


def residual() -> OpGraph:
    """conv -> relu -> conv, added back to the relu (a skip edge), then a linear head."""
    x = input_op("data", sample=8, channel=8, height=8, width=8)
    c1 = conv2d("conv1", x, 8)
    r1 = elementwise("relu1", c1)
    c2 = conv2d("conv2", r1, 8)
    add = elementwise("add", c2, r1, fn="add")
    r2 = elementwise("relu2", add)
    fl = flatten("flat", r2)
    fc = linear("fc", fl, 16)
    sm = softmax("loss", fc)
    return OpGraph("residual", (x, c1, r1, c2, add, r2, fl, fc, sm))


def linear_head() -> OpGraph:
    """input -> linear -> layer norm -> relu -> linear -> softmax."""
    x = input_op("data", sample=8, channel=32)
    fc1 = linear("fc1", x, 64)
    ln = layer_norm("ln", fc1)
    r = elementwise("relu", ln)
    fc2 = linear("fc2", r, 16)
    sm = softmax("loss", fc2)
    return OpGraph("linear_head", (x, fc1, ln, r, fc2, sm))


def shared_steps(steps: int = 3, width: int = 16) -> OpGraph:
    """Unrolled recurrent-like steps: `steps` linears sharing the parameter group "cell"."""
    x = input_op("data", sample=8, channel=width)
    ops: list[Op] = [x]
    prev = x
    for s in range(steps):
        step = linear(f"step{s}", prev, width, param_group="cell")
        ops.append(step)
        prev = step
    ops.append(softmax("loss", prev))
    return OpGraph("shared_steps", tuple(ops))


def attention_block(heads: int = 4) -> OpGraph:
    """int64 tokens -> embedding -> self-attention (q = k = v, `heads` heads) -> linear -> softmax."""
    n, length, c = 4, 8, 16
    tokens = Op("tokens", "input", (), Tensor.of(dtype_bytes=8, sample=n, length=length))
    emb = Op(
        "embed",
        "embedding",
        ("tokens",),
        Tensor.of(sample=n, length=length, channel=c),
        params=(Param("embed.weight", (100, c)),),
    )
    att = Op(
        "attn",
        "attention",
        ("embed", "embed", "embed"),
        Tensor.of(sample=n, length=length, channel=c),
        flops=4.0 * n * length * length * c,
        attrs=Op.make_attrs({"heads": heads}),
    )
    proj = Op(
        "proj",
        "linear",
        ("attn",),
        Tensor.of(sample=n, length=length, channel=c),
        params=(Param("proj.weight", (c, c)), Param("proj.bias", (c,))),
        flops=2.0 * n * length * c * c,
    )
    sm = softmax("loss", proj)
    return OpGraph("attention_block", (tokens, emb, att, proj, sm))


def attention_heads(form: str) -> OpGraph:
    """int64 tokens -> q, k, v embeddings -> attention -> linear -> softmax, with the
    attention's inputs read by head: `form` "gqa" (4 query heads of 4 sharing 2 k/v heads)
    or "mla" (4 heads, q and k heads of 6 channels, the last 2 rotary from a rotary key all
    heads share, v heads of 4; kv holds per head 4 key then 4 value channels)."""
    n, length = 4, 8
    tokens = Op("tokens", "input", (), Tensor.of(dtype_bytes=8, sample=n, length=length))
    if form == "gqa":
        widths, out = {"q": 16, "k": 8, "v": 8}, 16
        attrs: dict[str, object] = {"heads": 4, "kv_heads": 2, "causal": True}
    else:
        widths, out = {"q": 24, "kv": 32, "k_rope": 2}, 16
        attrs = {"heads": 4, "causal": True, "head_dim": 6, "v_head_dim": 4, "rope_dim": 2}
        attrs["mla"] = True
    ops = [tokens]
    for name, c in widths.items():
        ops.append(
            Op(
                name,
                "embedding",
                ("tokens",),
                Tensor.of(sample=n, length=length, channel=c),
                params=(Param(f"{name}.weight", (100, c)),),
            )
        )
    att = Op(
        "attn",
        "attention",
        tuple(widths),
        Tensor.of(sample=n, length=length, channel=out),
        flops=4.0 * n * length * length * out,
        attrs=Op.make_attrs(attrs),
    )
    proj = Op(
        "proj",
        "linear",
        ("attn",),
        Tensor.of(sample=n, length=length, channel=16),
        params=(Param("proj.weight", (16, out)),),
        flops=2.0 * n * length * 16 * out,
    )
    return OpGraph(f"attention_{form}", (*ops, att, proj, softmax("loss", proj)))


GRAPHS: dict[str, Callable[[], OpGraph]] = {
    "attention_block": attention_block,
    "chain_cnn": chain_cnn,
    "inception": inception,
    "residual": residual,
    "linear_head": linear_head,
    "shared_steps": shared_steps,
}


def moe_op(
    name: str,
    src: str,
    out: Tensor,
    experts: int,
    top_k: int,
    ffn: int,
    shared: int = 0,
    stacked: bool = True,
    shared_gate: bool = False,
    **attrs: object,
) -> Op:
    """A gated mixture of experts over `out`'s channels (planner.graph.moe): a router, the
    experts stacked ((E, 2f, h) and (E, h, f)) or one (w1, w3, w2) per expert, a shared
    expert of width `shared` (with its sigmoid gate), its FLOPs `moe_flops`' total; `attrs`
    beside the sizes (router, groups, ...)."""
    from planner.graph.moe import moe_flops, spec_of

    h = out.size("channel")
    if stacked:
        roles = ["router", "w13", "w2"]
        shapes = [(experts, h), (experts, 2 * ffn, h), (experts, h, ffn)]
    else:
        per = {"w1": (ffn, h), "w3": (ffn, h), "w2": (h, ffn)}
        roles = ["router"] + [f"{w}.{i}" for i in range(experts) for w in ("w1", "w3", "w2")]
        shapes = [(experts, h)] + [per[r.split(".")[0]] for r in roles[1:]]
    if shared:
        roles += ["sw1", "sw3", "sw2"] + ["sgate"] * shared_gate
        shapes += [(shared, h), (shared, h), (h, shared)] + [(1, h)] * shared_gate
    values = dict(experts=experts, top_k=top_k, ffn=ffn, roles=roles, shared_ffn=shared)
    values |= attrs
    tokens = out.numel // h
    flops = moe_flops(spec_of(values, name), h, tokens).total
    b = out.dtype_bytes
    params = tuple(Param(f"{name}.{r}", s, b) for r, s in zip(roles, shapes, strict=True))
    return Op(name, "moe", (src,), out, params, flops, attrs=Op.make_attrs(values))
