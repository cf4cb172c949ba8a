"""OpGraph: validation errors, topological order, JSON, fingerprint, parameter bytes, summary."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
from graphs import (
    GRAPHS,
    chain_cnn,
    conv2d,
    elementwise,
    input_op,
    linear,
    shared_steps,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.errors import GraphError
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.opkinds import KINDS


def _vec(name: str, kind: str, inputs: tuple[str, ...], **kw) -> Op:
    """A (sample=4, channel=8) op."""
    return Op(name, kind, inputs, Tensor.of(sample=4, channel=8), **kw)


def _valid_order(g: OpGraph) -> bool:
    pos = {op.name: i for i, op in enumerate(g.ops)}
    return all(pos[src] < pos[op.name] for op in g.ops for src in op.inputs)


# -- validation errors ------------------------------------------------------------------------


def test_cycle_error_names_the_ops_in_the_cycle():
    ops = (
        _vec("source", "input", ()),
        _vec("alpha", "elementwise", ("source", "gamma")),
        _vec("beta", "elementwise", ("alpha",)),
        _vec("gamma", "elementwise", ("beta",)),
        _vec("tail", "elementwise", ("gamma",)),
    )
    with pytest.raises(GraphError, match="cycle") as info:
        OpGraph("cyclic", ops)
    msg = str(info.value)
    path = msg.split("cycle:", 1)[1]
    for name in ("alpha", "beta", "gamma"):
        assert name in path
    assert "source" not in path and "tail" not in path
    # The path is closed: it starts and ends at the same op.
    steps = [s.strip() for s in path.split("->")]
    assert steps[0] == steps[-1]
    assert set(steps) == {"alpha", "beta", "gamma"}


def test_self_loop_is_a_cycle():
    ops = (_vec("x", "input", ()), _vec("loop", "elementwise", ("x", "loop")))
    with pytest.raises(GraphError, match=r"cycle.*loop"):
        OpGraph("g", ops)


def test_dangling_input_names_op_and_missing_name():
    ops = (_vec("x", "input", ()), _vec("relu", "elementwise", ("x", "ghost_tensor")))
    with pytest.raises(GraphError) as info:
        OpGraph("g", ops)
    assert "'relu'" in str(info.value)
    assert "'ghost_tensor'" in str(info.value)


def test_shape_mismatch_names_op_and_dimension():
    x = input_op("x", sample=4, channel=3, height=8, width=8)
    good = conv2d("conv", x, 8)
    bad = replace(good, output=Tensor.of(sample=4, channel=8, height=7, width=8))
    with pytest.raises(GraphError, match="shape mismatch") as info:
        OpGraph("g", (x, bad))
    msg = str(info.value)
    assert "'conv'" in msg and "'height'" in msg
    OpGraph("g", (x, good))  # the unmodified op is fine


def test_shape_mismatch_elementwise_add():
    x = input_op("x", sample=4, channel=8, height=8, width=8)
    y = Op("y", "elementwise", ("x",), x.output)
    z = input_op("z", sample=4, channel=8, height=8, width=4)
    add = Op("add", "elementwise", ("y", "z"), x.output)
    with pytest.raises(GraphError) as info:
        OpGraph("g", (x, y, z, add))
    assert "'add'" in str(info.value) and "'width'" in str(info.value)


def test_unknown_kind_lists_known_kinds():
    ops = (_vec("x", "input", ()), _vec("weird", "frobnicate", ("x",)))
    with pytest.raises(GraphError, match="frobnicate") as info:
        OpGraph("g", ops)
    for kind in KINDS:
        assert kind in str(info.value)


def test_duplicate_names():
    ops = (_vec("x", "input", ()), _vec("twin", "elementwise", ("x",)))
    ops += (_vec("twin", "elementwise", ("x",)),)
    with pytest.raises(GraphError, match="'twin'"):
        OpGraph("g", ops)


def test_input_op_with_inputs():
    ops = (_vec("x", "input", ()), _vec("x2", "input", ("x",)))
    with pytest.raises(GraphError, match="'x2'.*input op takes no inputs"):
        OpGraph("g", ops)


def test_non_input_op_without_inputs():
    with pytest.raises(GraphError, match="'orphan'.*no inputs"):
        OpGraph("g", (_vec("orphan", "elementwise", ()),))


@pytest.mark.parametrize(
    "output, pattern",
    [
        (Tensor.of(channel=8, sample=4), "first output dimension must be 'sample'"),
        (Tensor.of(sample=4, channel=0), "positive"),
        (Tensor((("sample", 4), ("channel", 8), ("channel", 8))), "repeated dimension"),
    ],
)
def test_bad_output_tensor(output, pattern):
    with pytest.raises(GraphError, match=pattern):
        OpGraph("g", (Op("x", "input", (), output),))


def test_negative_flops():
    with pytest.raises(GraphError, match="flops"):
        OpGraph("g", (_vec("x", "input", ()), _vec("r", "elementwise", ("x",), flops=-1.0)))


def test_malformed_attributes():
    x = input_op("x", sample=4, channel=8, height=4, width=4)
    cat = Op(
        "cat",
        "concat",
        ("x", "x"),
        Tensor.of(sample=4, channel=16, height=4, width=4),
        attrs=Op.make_attrs({"dim": "channel"}),  # no offsets
    )
    with pytest.raises(GraphError, match="'cat'.*attributes"):
        OpGraph("g", (x, cat))


def test_concat_offset_out_of_range():
    x = input_op("x", sample=4, channel=8, height=4, width=4)
    cat = Op(
        "cat",
        "concat",
        ("x", "x"),
        Tensor.of(sample=4, channel=16, height=4, width=4),
        attrs=Op.make_attrs({"dim": "channel", "offsets": [0, 12]}),
    )
    with pytest.raises(GraphError, match="'cat'.*'channel'"):
        OpGraph("g", (x, cat))


@pytest.mark.parametrize("out_channels, offsets", [(48, [0, 16]), (32, [0, 0])])
def test_concat_inputs_must_tile_the_output(out_channels, offsets):
    x = input_op("x", sample=4, channel=16, height=4, width=4)
    a = elementwise("a", x)
    b = elementwise("b", x)
    cat = Op(
        "cat",
        "concat",
        ("a", "b"),
        Tensor.of(sample=4, channel=out_channels, height=4, width=4),
        attrs=Op.make_attrs({"dim": "channel", "offsets": offsets}),
    )
    with pytest.raises(GraphError, match="'cat'"):
        OpGraph("g", (x, a, b, cat))


def test_graph_rejects_non_op():
    with pytest.raises(GraphError, match="Op objects"):
        OpGraph("g", ("not an op",))  # type: ignore[arg-type]


def test_index_of_unknown_op():
    g = chain_cnn()
    with pytest.raises(GraphError, match="'nope'"):
        g.index("nope")
    assert g.op("conv2").name == "conv2"


# -- topological order ------------------------------------------------------------------------


def test_out_of_order_ops_are_sorted():
    g = chain_cnn()
    shuffled = tuple(reversed(g.ops))
    h = OpGraph(g.name, shuffled)
    assert _valid_order(h)
    # A chain has a single topological order, so the result is the original graph.
    assert h == g
    assert [op.name for op in h.ops][0] == "data"


@settings(deadline=None, max_examples=40)
@given(name=st.sampled_from(sorted(GRAPHS)), data=st.data())
def test_any_permutation_gives_a_valid_topological_order(name, data):
    g = GRAPHS[name]()
    perm = data.draw(st.permutations(g.ops))
    h = OpGraph(g.name, tuple(perm))
    assert _valid_order(h)
    assert sorted(op.name for op in h.ops) == sorted(op.name for op in g.ops)

    # Same edges by name whatever the order.
    def named_edges(graph):
        return sorted(
            (graph.ops[e.src].name, graph.ops[e.dst].name, e.position) for e in graph.edges
        )

    assert named_edges(h) == named_edges(g)
    # Re-building from a topological order keeps it unchanged.
    assert OpGraph(h.name, h.ops).ops == h.ops


def test_already_sorted_order_is_kept():
    # Two independent branches: both orders are topological, and the given one is kept.
    x = input_op("x", sample=4, channel=8)
    a = elementwise("a", x)
    b = elementwise("b", x)
    assert [op.name for op in OpGraph("g", (x, b, a)).ops] == ["x", "b", "a"]
    assert [op.name for op in OpGraph("g", (x, a, b)).ops] == ["x", "a", "b"]


def test_parallel_edges_and_consumers():
    x = input_op("x", sample=4, channel=8)
    sq = elementwise("sq", x, x, fn="mul")
    g = OpGraph("g", (x, sq))
    assert [(e.src, e.dst, e.position) for e in g.edges] == [(0, 1, 0), (0, 1, 1)]
    assert g.consumers == ((1, 1), ())
    assert g.to_networkx().number_of_edges() == 2


# -- JSON -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_json_round_trip(name):
    g = GRAPHS[name]()
    assert OpGraph.from_json(g.to_json()) == g
    # Through JSON text (everything must be serializable).
    assert OpGraph.from_json(json.loads(json.dumps(g.to_json()))) == g


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_json_round_trip_through_file(name, tmp_path):
    g = GRAPHS[name]()
    path = tmp_path / f"{name}.json"
    g.save(path)
    h = OpGraph.load(path)
    assert h == g
    assert h.fingerprint() == g.fingerprint()
    # Attributes come back as the same frozen values (tuples, not lists).
    for a, b in zip(g.ops, h.ops, strict=True):
        assert a.attrs == b.attrs
        assert a.output.dtype_bytes == b.output.dtype_bytes


def test_json_round_trip_keeps_param_dtype():
    x = input_op("x", sample=4, channel=8)
    fc = Op(
        "fc",
        "linear",
        ("x",),
        Tensor.of(sample=4, channel=8),
        params=(Param("fc.weight", (8, 8), dtype_bytes=2),),
    )
    g = OpGraph("half", (x, fc))
    h = OpGraph.from_json(json.loads(json.dumps(g.to_json())))
    assert h.parameter_bytes == g.parameter_bytes == 8 * 8 * 2
    assert h == g


@pytest.mark.parametrize(
    "data, pattern",
    [
        ({"format": "something.else", "version": 1, "ops": []}, "not a layerwise graph"),
        ([1, 2, 3], "not a layerwise graph"),
        ({"format": "layerwise.opgraph", "version": 99, "ops": []}, "version 99"),
        ({"format": "layerwise.opgraph", "version": 1, "ops": [{"name": "x"}]}, "op #0"),
        (
            {
                "format": "layerwise.opgraph",
                "version": 1,
                "ops": [{"name": "x", "kind": "input", "output": {"sample": "many"}}],
            },
            "'x'.*malformed",
        ),
    ],
)
def test_from_json_errors(data, pattern):
    with pytest.raises(GraphError, match=pattern):
        OpGraph.from_json(data)


def test_load_errors(tmp_path):
    with pytest.raises(GraphError, match="does not exist"):
        OpGraph.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GraphError, match="not valid JSON"):
        OpGraph.load(bad)


# -- fingerprint, parameter bytes, summary ----------------------------------------------------


def test_fingerprint_stable_and_sensitive():
    g = chain_cnn()
    assert g.fingerprint() == chain_cnn().fingerprint()
    assert len(g.fingerprint()) == 16
    assert chain_cnn(sample=16).fingerprint() != g.fingerprint()
    # A single size change deep in the graph changes it too.
    x = input_op("x", sample=4, channel=8)
    a = OpGraph("g", (x, linear("fc", x, 16)))
    b = OpGraph("g", (x, linear("fc", x, 32)))
    assert a.fingerprint() != b.fingerprint()
    # ... and so does a FLOP count.
    c = OpGraph("g", (x, replace(linear("fc", x, 16), flops=1.0)))
    assert c.fingerprint() != a.fingerprint()


def test_equality_and_hash():
    assert chain_cnn() == chain_cnn()
    assert hash(chain_cnn()) == hash(chain_cnn())
    assert chain_cnn() != chain_cnn(sample=16)
    assert chain_cnn() != "chain_cnn"


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_parameter_bytes_counts_shared_group_once(steps):
    g = shared_steps(steps=steps, width=16)
    one_step = (16 * 16 + 16) * 4
    assert g.parameter_bytes == one_step
    ungrouped = OpGraph(g.name, tuple(replace(op, param_group=None) for op in g.ops))
    assert ungrouped.parameter_bytes == steps * one_step


def test_parameter_bytes_without_groups():
    g = chain_cnn()
    expected = sum(p.nbytes for op in g.ops for p in op.params)  # no groups: every op counts
    conv1 = (8 * 3 * 3 * 3 + 8) * 4
    bn = (8 + 8) * 4
    conv2 = (16 * 8 * 3 * 3 + 16) * 4
    fc = (10 * 16 * 8 * 8 + 10) * 4
    assert expected == conv1 + bn + conv2 + fc
    assert g.parameter_bytes == expected


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_summary(name):
    g = GRAPHS[name]()
    s = g.summary()
    assert s["name"] == g.name
    assert s["ops"] == len(g) == len(g.ops)
    assert s["edges"] == sum(len(op.inputs) for op in g.ops)
    assert s["forward_flops"] == pytest.approx(sum(op.flops for op in g.ops))
    assert s["parameter_bytes"] == g.parameter_bytes
    assert s["kinds"] == dict(Counter(op.kind for op in g.ops))
    assert list(s["kinds"]) == sorted(s["kinds"])


def test_inception_concat_offsets():
    g = GRAPHS["inception"]()
    cat = g.op("concat")
    assert cat.output.size("channel") == sum(g.op(n).output.size("channel") for n in cat.inputs)
    maps = [g.input_maps(e) for e in g.edges if e.dst == g.index("concat")]
    offsets = [m[1].offset for m in maps]
    assert offsets == [0, 8, 24, 32]
    assert all(m[1].kind == "offset" for m in maps)


def test_tensor_helpers():
    t = Tensor.of(dtype_bytes=2, sample=2, channel=3, height=5)
    assert t.dims == ("sample", "channel", "height")
    assert t.sizes == (2, 3, 5)
    assert t.numel == 30 and t.nbytes == 60
    assert t.size("height") == 5
    with pytest.raises(KeyError):
        t.size("width")
