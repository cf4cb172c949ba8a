"""Coarsening: which ops fold, what the merged op carries, and what is preserved."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from zoo_sizes import MOES, SMALL

from planner.graph.coarsen import coarsen
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.zoo import MODELS, model_graph

RECURRENT = ("rnntc", "rnnlm", "nmt")


@cache
def graphs(name: str) -> tuple[OpGraph, OpGraph]:
    raw = model_graph(name, coarsen=False, **SMALL.get(name, {}))
    return raw, coarsen(raw)


@pytest.mark.parametrize("name", list(MODELS))
def test_coarsening_preserves_flops_and_parameters(name: str) -> None:
    raw, coarse = graphs(name)
    assert coarse.forward_flops == raw.forward_flops
    assert coarse.parameter_bytes == raw.parameter_bytes
    assert OpGraph.from_json(coarse.to_json()) == coarse
    assert coarsen(coarse) == coarse  # one pass folds everything it can
    if name in RECURRENT:  # every op of an unrolled RNN carries compute: nothing to fold
        assert len(coarse) == len(raw)
    elif name in MOES:  # the feed-forward is one moe op: nothing left to fold at small sizes
        assert len(coarse) <= len(raw)
    else:
        assert len(coarse) < len(raw)
    assert not any(op.kind == "flatten" for op in coarse.ops)


def test_model_graph_coarsens_by_default() -> None:
    assert model_graph("alexnet", batch=1) == coarsen(
        model_graph("alexnet", batch=1, coarsen=False)
    )


def test_op_counts_of_cnns() -> None:
    counts = {n: (len(graphs(n)[0]), len(graphs(n)[1])) for n in ("alexnet", "vgg16")}
    assert counts == {"alexnet": (24, 14), "vgg16": (42, 24)}
    raw, coarse = graphs("inception_v3")
    assert len(raw) > 300 and 100 <= len(coarse) <= 140
    conv = sum(op.kind == "conv2d" for op in coarse.ops)
    assert conv == 96  # 94 in the main path + 2 in the aux head, each with its BN and ReLU


def test_conv_bn_relu_become_one_op() -> None:
    raw, coarse = graphs("resnet101")
    conv1 = coarse.op("layer1.0.conv1")
    assert conv1.kind == "conv2d" and conv1.attr("norm") == "batch"
    assert conv1.attr("fused") == ("layer1.0.bn1", "layer1.0.relu@0")
    merged = [raw.op(n) for n in ("layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu@0")]
    assert conv1.flops == sum(op.flops for op in merged)
    assert conv1.mem_bytes == sum(op.mem_bytes for op in merged)
    assert conv1.params == merged[0].params + merged[1].params
    assert coarse.op("layer1.0.conv2").inputs == ("layer1.0.conv1",)
    # The residual add keeps both inputs and absorbs the ReLU after it.
    add = coarse.op("layer1.0.add")
    assert add.inputs == ("layer1.0.conv3", "layer1.0.downsample.0")
    assert add.attr("fused") == ("layer1.0.relu@2",)
    assert coarse.op("layer1.1.conv1").inputs == ("layer1.0.add",)


def test_flatten_before_linear_is_removed() -> None:
    raw, coarse = graphs("alexnet")
    fc = coarse.op("classifier.1")
    assert fc.inputs == ("avgpool",) and fc.attr("flatten") is True
    assert fc.attr("fused") == ("flatten", "classifier.0", "classifier.2", "classifier.3")
    kept = coarsen(raw, fold_flatten=False)
    assert kept.op("flatten").inputs == ("avgpool",)
    assert kept.op("classifier.1").inputs == ("flatten",)
    nothing = coarsen(raw, fold_kinds=(), fold_flatten=False)
    assert nothing == raw


def test_transformer_layer_norms_stay_and_dropouts_fold() -> None:
    raw, coarse = graphs("transformer")
    assert coarse.op("blocks.0.ln1").kind == "norm"  # reads a residual add with 2 consumers
    assert coarse.op("ln_f").kind == "norm"  # a layer norm folds into a linear only
    assert coarse.op("blocks.0.fc1").attr("fused") == ("blocks.0.act",)
    emb = coarse.op("tok_embed")
    assert [p.name for p in emb.params] == ["tok_embed.weight", "pos_embed"]
    assert emb.attr("fused") == ("add", "drop")


# -- hand-built graphs --------------------------------------------------------------------


def act(**dims: int) -> Tensor:
    return Tensor.of(**dims)


def chain(*ops: Op) -> OpGraph:
    return OpGraph("g", (Op("x", "input", (), act(sample=4, channel=8)), *ops))


def lin(name: str, src: str, out: int = 8, **kw: Any) -> Op:
    params = (Param(f"{name}.w", (out, 8)),)
    return Op(name, "linear", (src,), act(sample=4, channel=out), params, 512.0, 100.0, **kw)


def pointwise(name: str, *srcs: str, kind: str = "elementwise", **kw: Any) -> Op:
    return Op(name, kind, srcs, act(sample=4, channel=8), mem_bytes=10.0, **kw)


def test_layer_norm_folds_into_linear_only() -> None:
    ln = {"attrs": Op.make_attrs({"norm": "layer"}), "params": (Param("ln.g", (8,)),)}
    g = chain(lin("fc", "x"), pointwise("ln", "fc", kind="norm", **ln), lin("out", "ln"))
    c = coarsen(g)
    assert [op.name for op in c.ops] == ["x", "fc", "out"]
    assert c.op("fc").attr("norm") == "layer" and c.op("fc").mem_bytes == 110.0
    assert c.op("out").inputs == ("fc",)
    assert c.parameter_bytes == g.parameter_bytes
    g2 = chain(
        lin("fc", "x"),
        pointwise("add", "fc", "x"),
        pointwise("ln", "add", kind="norm", **ln),
        lin("out", "ln"),
    )
    assert coarsen(g2) == g2


def test_no_fold_into_inputs_or_shared_producers() -> None:
    g = chain(
        pointwise("relu0", "x"),  # reads the input op: stays
        lin("fc", "relu0"),
        pointwise("a", "fc"),  # fc has two consumers: neither folds
        pointwise("b", "fc"),
        pointwise("sum", "a", "b"),
    )
    assert coarsen(g) == g


def test_no_fold_across_shared_parameter_groups() -> None:
    scale: dict[str, Any] = {"params": (Param("scale", (8,)),)}
    g = chain(
        lin("fc@0", "x", param_group="fc"),
        pointwise("s0", "fc@0", **scale),  # own parameters, producer shared: stays
        lin("fc@1", "s0", param_group="fc"),
        pointwise("relu", "fc@1"),  # no parameters: folds into a shared op
    )
    c = coarsen(g)
    assert [op.name for op in c.ops] == ["x", "fc@0", "s0", "fc@1"]
    assert c.op("fc@1").param_group == "fc"
    assert c.parameter_bytes == g.parameter_bytes


def test_shape_changing_ops_do_not_fold() -> None:
    x = Op("x", "input", (), act(sample=2, channel=3, height=8, width=8))
    conv = Op(
        "conv",
        "conv2d",
        ("x",),
        act(sample=2, channel=4, height=8, width=8),
        flops=10.0,
        attrs=Op.make_attrs({"kernel": (3, 3), "padding": (1, 1)}),
    )
    pool = Op(
        "pool",
        "pool2d",
        ("conv",),
        act(sample=2, channel=4, height=4, width=4),
        attrs=Op.make_attrs({"kernel": (2, 2), "stride": (2, 2), "mode": "max"}),
    )
    g = OpGraph("g", (x, conv, pool))
    assert coarsen(g, fold_kinds=("pool2d",)) == g


def test_batch_norm_does_not_stack_on_a_normalized_op() -> None:
    bn = {"attrs": Op.make_attrs({"norm": "batch"})}
    g = chain(lin("fc", "x"), pointwise("bn1", "fc", kind="norm", **bn))
    g2 = chain(*g.ops[1:], pointwise("bn2", "bn1", kind="norm", **bn))
    c = coarsen(g2)
    assert [op.name for op in c.ops] == ["x", "fc", "bn2"]
    assert c.op("fc").attr("fused") == ("bn1",)


def test_nested_concat_is_inlined_with_shifted_offsets() -> None:
    def t4(c: int) -> Tensor:
        return Tensor.of(sample=2, channel=c, height=4, width=4)

    x = Op("x", "input", (), t4(3))
    convs = [
        Op(
            n,
            "conv2d",
            ("x",),
            t4(c),
            (Param("w", (c, 3, 1, 1)),),
            1.0,
            attrs=Op.make_attrs({"kernel": (1, 1)}),
        )
        for n, c in (("a", 2), ("b", 3), ("c", 5))
    ]
    inner = Op(
        "inner",
        "concat",
        ("b", "c"),
        t4(8),
        attrs=Op.make_attrs({"dim": "channel", "offsets": (0, 3)}),
    )
    outer = Op(
        "outer",
        "concat",
        ("a", "inner"),
        t4(10),
        attrs=Op.make_attrs({"dim": "channel", "offsets": (0, 2)}),
    )
    g = coarsen(OpGraph("nested", (x, *convs, inner, outer)))
    assert [op.name for op in g.ops if op.kind == "concat"] == ["outer"]
    out = g.op("outer")
    assert out.inputs == ("a", "b", "c")
    assert out.attr("offsets") == (0, 2, 5)
    assert "inner" in out.attr("fused")
