"""Contraction (row-parallel) splits in the config space and the cost model: Megatron-LM's
column-then-row pairing moves nothing between its two linears, the partial sums cost a
reduce-scatter into a consumer that splits the rows and a reduce into one that does not,
the weights are cut along the sum, and configs that cannot sum in pieces are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
from graphs import elementwise, input_op, layer_norm, linear

from planner.costs.config import ConfigSpace, ParallelConfig
from planner.costs.costmodel import CostModel
from planner.errors import ConfigError
from planner.graph.opgraph import Op, OpGraph, Tensor
from planner.graph.opkinds import contraction
from planner.hardware.presets import get_preset
from planner.sim.simulator import Simulator

D = 8


def mlp() -> OpGraph:
    """x -> fc1 (widening) -> fc2 (back) -> add: a transformer's MLP, its output read by an
    elementwise op."""
    x = input_op("x", sample=16, channel=64)
    fc1 = linear("fc1", x, 256)
    fc2 = linear("fc2", fc1, 64)
    out = elementwise("out", fc2)
    return OpGraph("mlp", (x, fc1, fc2, out))


def _model() -> tuple[OpGraph, CostModel]:
    g = mlp()
    return g, CostModel(g, get_preset("dgx-a100-1"))


def _edge(g: OpGraph, src: str, dst: str):  # type: ignore[no-untyped-def]
    (e,) = [e for e in g.edges if g.ops[e.src].name == src and g.ops[e.dst].name == dst]
    return e


def test_column_then_row_moves_nothing_between_the_two_linears() -> None:
    g, cm = _model()
    col = ParallelConfig((1, D), tuple(range(D)))
    row = ParallelConfig((1, 1), tuple(range(D)), reduce=D)
    assert cm.transfer_time(_edge(g, "fc1", "fc2"), col, row) == 0.0
    # the same row-parallel layer after a data-parallel one reads all-gathered columns
    data = ParallelConfig((D, 1), tuple(range(D)))
    assert cm.transfer_time(_edge(g, "fc1", "fc2"), data, row) > 0.0


def test_partial_sums_are_reduce_scattered_into_a_row_split_consumer() -> None:
    g, cm = _model()
    row = ParallelConfig((1, 1), tuple(range(D)), reduce=D)
    rows = ParallelConfig((D, 1), tuple(range(D)))
    nbytes = g.ops[g.index("fc2")].output.nbytes
    w, m = cm.inv_bw[0, 1], cm.msg_cost[0, 1]  # every pair alike on one NVSwitch
    # forward: each consumer task gets its 1/D box from the D - 1 other partial sums
    # (a reduce-scatter); backward: each partial task gets the D - 1 other gradient boxes
    # (an all-gather): the volume of one ring all-reduce, 2 (D - 1) / D of the bytes
    piece = (D - 1) * (nbytes / D * w + m)
    assert cm.transfer_time(_edge(g, "fc2", "out"), row, rows) == pytest.approx(2 * piece)
    # a consumer on one device receives every other partial sum whole, and sends the
    # gradient back to each
    one = ParallelConfig((1, 1), (0,))
    expected = (D - 1) * (nbytes * w + m) + (nbytes * w + m)
    assert cm.transfer_time(_edge(g, "fc2", "out"), row, one) == pytest.approx(expected)


def test_tables_price_partial_sums_as_the_direct_computation() -> None:
    g, cm = _model()
    space = ConfigSpace(g, cm.devices, kind="mesh")
    assert any(c.reduce > 1 for c in space[g.index("fc2")].configs)
    for e in g.edges:
        table = cm.edge_table(e, space[e.src], space[e.dst])
        for i, a in enumerate(space[e.src].configs):
            for j, b in enumerate(space[e.dst].configs):
                assert table[i, j] == pytest.approx(cm.transfer_time(e, a, b), rel=1e-9, abs=1e-15)


def test_a_sum_split_cuts_work_and_weights_but_not_the_output() -> None:
    g, cm = _model()
    i = g.index("fc2")
    op = g.ops[i]
    whole = ParallelConfig((1, 1), (0,))
    row = ParallelConfig((2, 1), tuple(range(D)), reduce=4)
    fwd_whole, _ = cm.task_times(i, whole)
    fwd, _ = cm.task_times(i, row)
    assert fwd == pytest.approx(np.full(D, fwd_whole[0] / D))
    mem = cm.memory(i, row)
    # weights and gradients cut 4 ways by the sum; its output only the loss reads, which
    # keeps its own fp32 copy of it (planner/costs/activations.py): none of it is kept (a
    # kept partial sum counts once scattered over the tasks: tests/test_activations.py)
    assert cm.activations.per_op(i) == 0.0
    assert mem[0] == pytest.approx(op.param_bytes / 4 * 2)
    # the 4 slices of the weight are each held by the 2 sample replicas, which sum their
    # gradients
    groups = cm.replica_groups(op, row)
    assert sorted(map(sorted, groups)) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_the_simulator_times_partial_sums_like_the_tables() -> None:
    g, cm = _model()
    col = ParallelConfig((1, D), tuple(range(D)))
    row = ParallelConfig((1, 1), tuple(range(D)), reduce=D)
    rows = ParallelConfig((D, 1), tuple(range(D)))
    x = ParallelConfig((1, 1), (0,))
    pairing = Simulator(cm, [x, col, row, rows])
    gathered = Simulator(cm, [x, col, ParallelConfig((1, D), tuple(range(D))), rows])
    # the same two linears, the second column-parallel too: it must all-gather its input
    assert pairing.makespan < gathered.makespan
    changed = Simulator(cm, [x, col, col, rows])
    changed.change(2, row)  # delta simulation of the switch agrees with a full one
    assert changed.makespan == pairing.makespan


def test_ops_that_cannot_sum_in_pieces_are_refused_in_one_line() -> None:
    g, _ = _model()
    x = input_op("x", sample=4, channel=8)
    norm = layer_norm("ln", x)
    with pytest.raises(ConfigError, match="no contraction it may split"):
        ParallelConfig.from_json(norm, {"devices": [0, 1], "reduce": 2}, 2)
    fc2 = g.ops[g.index("fc2")]
    with pytest.raises(ConfigError, match="does not divide the 256 elements"):
        ParallelConfig.from_json(fc2, {"devices": list(range(3)), "reduce": 3}, 4)
    # a linear with an activation folded in computes f(sum): its partial sums cannot be added
    folded = Op("fc", "linear", ("x",), Tensor.of(sample=4, channel=8), fc2.params,
                attrs=Op.make_attrs({"fused": ("relu",)}))  # fmt: skip
    assert contraction(folded) is None


def test_the_space_without_sum_splits_and_the_json_round_trip() -> None:
    g, cm = _model()
    with_sums = ConfigSpace(g, cm.devices, kind="mesh")
    without = ConfigSpace(g, cm.devices, kind="mesh", reduce=False)
    i = g.index("fc2")
    assert not any(c.reduce > 1 for c in without[i].configs)
    assert len(with_sums[i]) > len(without[i])
    assert {c for c in with_sums[i].configs if c.reduce == 1} == set(without[i].configs)
    op = g.ops[i]
    row = ParallelConfig((2, 1), tuple(range(D)), reduce=4)
    assert row.describe(op) == "sample=2,reduce=4 @ [0-7]"
    assert ParallelConfig.from_json(op, row.to_json(op), D) == row
    assert row.num_tasks == math.prod(row.grid) == D
