"""A Problem's origin: `DnnOrigin` for a problem built from a DNN, None for a cost-table
problem; `Problem.is_dnn` is the one test of which kind a problem is, `Problem.dnn()` the one
way to the DNN's parts, and a backend says through `needs_dnn_for` which objectives need one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from graphs import GRAPHS, chain_cnn

from backends import BackendError, SolveOptions, backend_names, get_backend
from planner.costs.config import ConfigSpace
from planner.costs.costmodel import CostModel
from planner.errors import ProblemError
from planner.hardware.presets import get_preset
from planner.problems.costtable import random_problem
from planner.problems.problem import DnnOrigin, Problem, build_problem
from planner.recommend import baseline_choices
from planner.result import evaluate_objective

DNN_FIELDS = ("graph", "devices", "space", "cost_model", "node_ops")


def _dnn(tie: bool = True) -> Problem:
    return build_problem(GRAPHS["shared_steps"](), get_preset("p100-1x4"), tie_groups=tie)


def test_the_dnn_parts_live_in_the_origin_only() -> None:
    fields = {f.name for f in dataclasses.fields(Problem)}
    assert "origin" in fields and not fields & set(DNN_FIELDS)
    assert tuple(f.name for f in dataclasses.fields(DnnOrigin)) == DNN_FIELDS


def test_a_dnn_problem_is_dnn_and_keeps_its_origin() -> None:
    graph, devices = chain_cnn(), get_preset("p100-1x4")
    p = build_problem(graph, devices)
    assert p.is_dnn and p.origin is not None and p.dnn() is p.origin
    origin = p.dnn()
    assert origin.graph is graph and origin.devices is devices
    assert isinstance(origin.space, ConfigSpace) and isinstance(origin.cost_model, CostModel)
    assert origin.node_ops == p.ops_of_nodes == tuple((i,) for i in range(len(graph.ops)))
    assert p.space_kind == origin.space.kind
    assert p.choices_of(p.strategy([0] * p.num_nodes)) == (0,) * p.num_nodes
    with pytest.raises(dataclasses.FrozenInstanceError):
        origin.graph = graph  # type: ignore[misc]


def test_tied_groups_are_the_origins_node_ops() -> None:
    tied, untied = _dnn(tie=True), _dnn(tie=False)
    assert tied.num_nodes < untied.num_nodes == len(untied.dnn().graph.ops)
    assert tied.ops_of_nodes == tied.dnn().node_ops
    assert any(len(ops) > 1 for ops in tied.dnn().node_ops)


def test_a_cost_table_problem_is_not_dnn_and_says_so_in_one_line() -> None:
    p = random_problem(5, 3, seed=0)
    assert not p.is_dnn and p.origin is None
    assert p.space_kind is None
    assert p.ops_of_nodes == tuple((i,) for i in range(p.num_nodes))
    with pytest.raises(ProblemError) as err:
        p.dnn()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"problem {p.name!r} has no DNN behind it (a cost-table problem)")
    with pytest.raises(ProblemError, match="what needed it"):
        p.dnn("what needed it")
    with pytest.raises(ProblemError, match="no DNN behind it.*use the choices"):
        p.strategy([0] * p.num_nodes)
    strategy = _dnn().strategy([0] * _dnn().num_nodes)
    with pytest.raises(ProblemError, match="no DNN behind it.*no config space"):
        p.choices_of(strategy)


def test_readers_decide_by_is_dnn() -> None:
    table = random_problem(5, 3, seed=0)
    assert baseline_choices(table) == {}
    with pytest.raises(BackendError, match="needs a problem built from a DNN"):
        evaluate_objective(table, [0] * table.num_nodes, "makespan")
    dnn = build_problem(chain_cnn(), get_preset("p100-1x4"))
    assert "data_parallel" in baseline_choices(dnn)
    assert evaluate_objective(dnn, [0] * dnn.num_nodes, "makespan") > 0


def test_an_origin_must_cover_the_nodes() -> None:
    p = _dnn(tie=True)
    origin = p.dnn()
    short = dataclasses.replace(origin, node_ops=origin.node_ops[:-1])
    with pytest.raises(ProblemError, match="node_ops"):
        dataclasses.replace(p, origin=short)
    twice = dataclasses.replace(origin, node_ops=(origin.node_ops[0], *origin.node_ops[:-1]))
    with pytest.raises(ProblemError, match="node_ops"):
        dataclasses.replace(p, origin=twice)
    table = dataclasses.replace(p, origin=None)  # the same tables, no DNN behind them
    assert not table.is_dnn and table.num_nodes == p.num_nodes


@pytest.mark.parametrize("name", backend_names())
def test_every_backend_refuses_a_cost_table_problem_where_it_needs_a_dnn(name: str) -> None:
    backend = get_backend(name)
    if not backend.is_installed():
        pytest.skip(f"{name} is not installed")
    assert "makespan" in backend.needs_dnn_for
    table = random_problem(4, 3, seed=0, memory=False)
    dnn = build_problem(chain_cnn(), get_preset("p100-1x2"), max_configs=4)
    for objective in backend.objectives:
        opts = SolveOptions(objective=objective, time_limit=1.0)
        reason = backend.can_run(table, opts)
        if objective in backend.needs_dnn_for:
            assert reason is not None
            assert "needs a problem built from a DNN" in reason and "cost-table problem" in reason
        else:
            assert reason is None
        assert backend.can_run(dnn, opts) is None


def test_a_backend_that_needs_a_dnn_always_says_so() -> None:
    from backends.heuristics.baselines import BaselinesBackend

    class DnnOnly(BaselinesBackend):
        name = "dnn_only"
        needs_dnn_for = ("additive", "makespan")

    table = random_problem(4, 3, seed=0)
    reason = DnnOnly().can_run(table, SolveOptions(objective="additive"))
    assert reason is not None and "needs a problem built from a DNN" in reason
    assert "use the" not in reason  # no objective to fall back on
    with pytest.raises(BackendError, match="cost-table problem"):
        DnnOnly().solve(table, SolveOptions(objective="additive"))
    assert np.isfinite(DnnOnly().solve(_dnn(), SolveOptions()).objective_value())
