"""Problem tables, the additive evaluator and memory, Strategy and its JSON file."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
from graphs import GRAPHS, chain_cnn
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.errors import ConfigError, ProblemError, StrategyError
from planner.graph.opgraph import OpGraph
from planner.hardware.presets import get_preset
from planner.problems.evaluate import additive_cost, memory_feasible, memory_peak, score_strategy
from planner.problems.problem import Problem, build_problem
from planner.problems.strategy import Strategy, load_strategy, strategy_from_json


@functools.cache
def _problem(
    name: str, preset: str, cap: int | None = None, sync: str = "ring", tie: bool = False
) -> Problem:
    g = GRAPHS[name]()
    dg = get_preset(preset)
    cm = CostModel(g, dg, CostOptions(sync=sync))
    return build_problem(g, dg, cm, max_configs=cap, tie_groups=tie)


def _choices(problem: Problem, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(rng.integers(n)) for n in problem.sizes]


def _strategy(name: str = "chain_cnn", preset: str = "p100-1x4", seed: int = 3) -> Strategy:
    p = _problem(name, preset)
    return p.strategy(_choices(p, seed))


# -- Problem tables ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, cap", [("p100-1x4", None), ("p100-2x4", 9), ("cpu-local-2", None)]
)
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_build_problem_shapes(name, preset, cap):
    p = _problem(name, preset, cap)
    g = GRAPHS[name]()
    D = get_preset(preset).num_devices
    n = len(g)
    assert p.num_nodes == n
    assert p.node_names == tuple(op.name for op in g.ops)
    assert p.sizes == tuple(len(p.dnn().space[i]) for i in range(n))
    if cap is not None:
        assert max(p.sizes) <= cap
    for i in range(n):
        assert p.node_cost[i].shape == (p.sizes[i],)
        assert np.isfinite(p.node_cost[i]).all() and (p.node_cost[i] >= 0).all()
        assert p.usage[i].shape == (p.sizes[i], D)
    assert p.edges == tuple((e.src, e.dst) for e in g.edges)
    for (u, v), t in zip(p.edges, p.edge_cost, strict=True):
        assert t.shape == (p.sizes[u], p.sizes[v])
    assert p.intervals.tolist() == [[i, 2 * n - i] for i in range(n)]
    assert p.usage_limit is None and not p.has_memory_limit
    assert set(p.stats) >= {"node_seconds", "edge_seconds", "build_seconds"}


CASES = [(name, preset) for name in sorted(GRAPHS) for preset in ("p100-1x4", "p100-2x4")]


@settings(deadline=None, max_examples=60)
@given(case=st.sampled_from(CASES), sync=st.sampled_from(["ring", "ps"]), data=st.data())
def test_additive_cost_equals_direct_score(case, sync, data):
    name, preset = case
    p = _problem(name, preset, None, sync)
    choices = [data.draw(st.integers(0, n - 1)) for n in p.sizes]
    strategy = p.strategy(choices)
    score = score_strategy(p.dnn().cost_model, strategy)
    assert additive_cost(p, choices) == pytest.approx(score.total, rel=1e-9)
    nodes = sum(float(c[k]) for c, k in zip(p.node_cost, choices, strict=True))
    assert score.compute + score.sync == pytest.approx(nodes, rel=1e-9)
    # All nodes are live at the turn from forward to backward: the peak is the total.
    np.testing.assert_allclose(memory_peak(p, choices), score.memory, rtol=1e-9)
    assert p.choices_of(strategy) == tuple(choices)


def test_additive_cost_by_hand_on_a_chain():
    # Everything on device 0: no transfers, no sync; the total is the sum of compute times.
    p = _problem("chain_cnn", "p100-1x4")
    cm = p.dnn().cost_model
    choices = [p.dnn().space[i].index(ParallelConfig((1,) * len(op.output.dims), (0,)))
               for i, op in enumerate(p.dnn().graph.ops)]  # fmt: skip
    expected = sum(cm.compute_time(i, p.dnn().space[i].configs[c]) for i, c in enumerate(choices))
    assert additive_cost(p, choices) == pytest.approx(expected, rel=1e-12)
    # Moving only the last op (loss) to device 1 adds exactly the fc -> loss transfer.
    moved = list(choices)
    last = len(choices) - 1
    moved[last] = p.dnn().space[last].index(ParallelConfig((1, 1), (1,)))
    nbytes = p.dnn().graph.ops[last - 1].output.nbytes
    dg = p.dnn().devices
    tx = nbytes * (dg.inv_bandwidth[0, 1] + dg.inv_bandwidth[1, 0]) + 2 * dg.latency[0, 1]
    assert additive_cost(p, moved) == pytest.approx(expected + tx, rel=1e-12)


def test_memory_limits():
    g = chain_cnn()
    dg = get_preset("p100-1x4")
    p = build_problem(g, dg, memory_limit="device")
    assert p.has_memory_limit
    np.testing.assert_array_equal(p.usage_limit, [float(d.memory) for d in dg.devices])
    ch = _choices(p, 0)
    assert memory_feasible(p, ch)
    tiny = build_problem(g, dg, memory_limit=1.0)
    assert not memory_feasible(tiny, ch)
    # A limit right at the peak of one strategy: that one fits, a 10% tighter one does not.
    peak = float(memory_peak(p, ch).max())
    assert memory_feasible(build_problem(g, dg, memory_limit=peak), ch)
    assert not memory_feasible(build_problem(g, dg, memory_limit=peak * 0.9), ch)
    assert memory_feasible(build_problem(g, dg), ch)  # no limit


@pytest.mark.parametrize(
    "limit, pattern", [("host", "'device'"), (0, "positive"), (-5.0, "positive")]
)
def test_memory_limit_errors(limit, pattern):
    with pytest.raises(ProblemError, match=pattern):
        build_problem(chain_cnn(), get_preset("p100-1x4"), memory_limit=limit)


def test_check_choices_errors():
    p = _problem("chain_cnn", "p100-1x4")
    n = p.num_nodes
    with pytest.raises(ProblemError, match=f"{n - 1} choices for {n} nodes"):
        p.check_choices([0] * (n - 1))
    bad = [0] * n
    bad[2] = p.sizes[2]
    with pytest.raises(ProblemError, match=f"'{p.node_names[2]}'"):
        p.check_choices(bad)
    bad[2] = -1
    with pytest.raises(ProblemError, match="not in"):
        additive_cost(p, bad)
    assert p.check_choices(np.zeros(n, dtype=np.int64)) == (0,) * n


def test_progress_callback():
    calls = []
    g = chain_cnn()
    build_problem(g, get_preset("cpu-local-2"), progress=lambda k, t: calls.append((k, t)))
    assert calls == [(k, len(g.edges)) for k in range(1, len(g.edges) + 1)]


def test_problem_without_dnn():
    p = Problem(
        "tables",
        ("a", "b"),
        (np.array([1.0, 2.0]), np.array([3.0])),
        ((0, 1),),
        (np.array([[0.5], [0.0]]),),
    )
    assert additive_cost(p, [0, 0]) == 4.5
    assert additive_cost(p, [1, 0]) == 5.0
    assert memory_feasible(p, [0, 0])
    with pytest.raises(ProblemError, match="no DNN"):
        p.strategy([0, 0])
    with pytest.raises(ProblemError, match=r"\(2, 2\)"):
        Problem("t", ("a", "b"), (np.ones(2), np.ones(1)), ((0, 1),), (np.ones((2, 2)),))


# -- Strategy ---------------------------------------------------------------------------------


def test_strategy_checks_configs():
    s = _strategy()
    with pytest.raises(StrategyError, match="configs for"):
        Strategy(s.graph, s.devices, s.configs[:-1])
    bad = list(s.configs)
    bad[1] = ParallelConfig((1, 1, 1, 1), (7,))
    with pytest.raises(StrategyError, match="out of range"):
        Strategy(s.graph, s.devices, tuple(bad))
    assert s.config("conv1") == s.configs[s.graph.index("conv1")]
    rows = s.describe()
    assert [r[0] for r in rows] == [op.name for op in s.graph.ops]
    assert rows[1][2] == s.configs[1].describe(s.graph.ops[1])


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_strategy_json_round_trip(name):
    s = _strategy(name, "p100-2x4", seed=11)
    data = json.loads(json.dumps(s.to_json()))
    assert strategy_from_json(data) == s
    assert strategy_from_json(data, s.graph, s.devices) == s


def test_strategy_file_round_trip(tmp_path):
    s = _strategy("inception", "p100-1x4", seed=5)
    path = tmp_path / "plan.json"
    s.save(path, model={"zoo": "inception", "args": {}}, extra={"objective": 1.5})
    loaded, raw = load_strategy(path)
    assert loaded == s
    assert loaded.configs == s.configs
    assert raw["objective"] == 1.5
    assert raw["graph"]["model"] == {"zoo": "inception", "args": {}}
    assert raw["graph"]["fingerprint"] == s.graph.fingerprint()
    assert raw["devices"]["fingerprint"] == s.devices.fingerprint()
    # Re-scored from the file, the strategy costs the same.
    cm = CostModel(s.graph, s.devices)
    assert score_strategy(cm, loaded).total == score_strategy(cm, s).total


def test_load_against_another_graph(tmp_path):
    s = _strategy("chain_cnn")
    path = tmp_path / "plan.json"
    s.save(path)
    other = chain_cnn(sample=16)
    with pytest.raises(StrategyError) as info:
        load_strategy(path, graph=other)
    msg = str(info.value)
    assert s.graph.fingerprint() in msg and other.fingerprint() in msg
    assert "'chain_cnn'" in msg and "graph" in msg
    renamed = OpGraph("different_name", GRAPHS["residual"]().ops)
    with pytest.raises(StrategyError, match="'chain_cnn'.*'different_name'"):
        strategy_from_json(s.to_json(), graph=renamed)


def test_load_against_another_device_graph():
    s = _strategy("chain_cnn", "p100-1x4")
    other = get_preset("p100-2x4")
    with pytest.raises(StrategyError, match="device graph 'p100-1x4'") as info:
        strategy_from_json(s.to_json(), devices=other)
    assert other.fingerprint() in str(info.value)
    assert s.devices.fingerprint() in str(info.value)


def _edited(s: Strategy, op: str, config) -> dict:
    data = json.loads(json.dumps(s.to_json()))
    data["configs"][op] = config
    return data


def test_degree_that_does_not_divide():
    s = _strategy()
    data = _edited(s, "conv2", {"degrees": {"channel": 3}, "devices": [0, 1, 2]})
    with pytest.raises(StrategyError, match="'conv2'.*degree 3 does not divide"):
        strategy_from_json(data)


def test_device_out_of_range():
    s = _strategy()
    data = _edited(s, "fc", {"degrees": {"sample": 2}, "devices": [0, 4]})
    with pytest.raises(StrategyError, match="'fc'.*device 4 out of range"):
        strategy_from_json(data)


@pytest.mark.parametrize(
    "config, pattern",
    [
        ({"degrees": {"channel": 2}, "devices": [0, 1]}, "cannot be split along 'channel'"),
        ({"degrees": {"length": 2}, "devices": [0, 1]}, "no dimension"),
        ({"degrees": {"sample": 2}, "devices": [0, 0]}, "two tasks on one device"),
        ({"degrees": {"sample": 2}, "devices": [0]}, "2 tasks but 1 devices"),
        ({"degrees": {"sample": "x"}, "devices": [0]}, "'flat'"),
        ([1, 2], "'flat'"),
    ],
)
def test_bad_config_entries(config, pattern):
    data = _edited(_strategy(), "flat", config)
    with pytest.raises(StrategyError, match=pattern):
        strategy_from_json(data)


def test_missing_op_config():
    data = json.loads(json.dumps(_strategy().to_json()))
    del data["configs"]["relu2"]
    with pytest.raises(StrategyError, match=r"no config for op\(s\) \['relu2'\]"):
        strategy_from_json(data)


def test_unknown_op_name():
    data = _edited(_strategy(), "conv9", {"devices": [0]})
    with pytest.raises(StrategyError, match="conv9"):
        strategy_from_json(data)


def test_not_a_strategy_file(tmp_path):
    g = chain_cnn()
    with pytest.raises(StrategyError, match="not a layerwise strategy"):
        strategy_from_json(g.to_json())
    with pytest.raises(StrategyError, match="not a layerwise strategy"):
        strategy_from_json([1, 2])  # type: ignore[arg-type]
    data = _strategy().to_json()
    with pytest.raises(StrategyError, match="version 7"):
        strategy_from_json({**data, "version": 7})
    with pytest.raises(StrategyError, match="'configs'"):
        strategy_from_json({**data, "configs": [1]})
    path = tmp_path / "graph.json"
    g.save(path)
    with pytest.raises(StrategyError, match="not a layerwise strategy"):
        load_strategy(path)
    with pytest.raises(StrategyError, match="does not exist"):
        load_strategy(tmp_path / "nothing.json")
    (tmp_path / "junk.json").write_text("{oops")
    with pytest.raises(StrategyError, match="not valid JSON"):
        load_strategy(tmp_path / "junk.json")


def test_embedded_graph_missing_or_invalid():
    s = _strategy()
    data = json.loads(json.dumps(s.to_json()))
    del data["graph"]["json"]
    with pytest.raises(StrategyError, match="embeds no graph"):
        strategy_from_json(data)
    assert strategy_from_json(data, graph=s.graph) == s  # passing it works
    data = json.loads(json.dumps(s.to_json()))
    data["graph"]["json"]["ops"][1]["kind"] = "mystery"
    with pytest.raises(StrategyError, match="invalid.*mystery"):
        strategy_from_json(data)


def test_score_strategy_for_another_graph():
    s = _strategy("chain_cnn")
    other = GRAPHS["residual"]()
    with pytest.raises(StrategyError, match="another graph"):
        score_strategy(CostModel(other, s.devices), s)


@pytest.mark.parametrize("preset", ["p100-1x4", "p100-2x4"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_tied_groups_score_like_the_strategy_they_stand_for(preset, seed):
    """Tying a parameter group into one node is exact for strategies whose group ops agree."""
    tied = _problem("shared_steps", preset, tie=True)
    g = GRAPHS["shared_steps"]()
    assert tied.num_nodes < len(g.ops)
    assert sorted(i for ops in tied.ops_of_nodes for i in ops) == list(range(len(g.ops)))
    choices = _choices(tied, seed)
    strategy = tied.strategy(choices)
    assert tied.choices_of(strategy) == tuple(choices)
    direct = score_strategy(tied.dnn().cost_model, strategy).total
    assert additive_cost(tied, choices) == pytest.approx(direct, rel=1e-9)
    untied = _problem("shared_steps", preset)
    assert additive_cost(untied, untied.choices_of(strategy)) == pytest.approx(direct, rel=1e-9)


def test_tied_problem_rejects_a_strategy_that_splits_a_group():
    tied = _problem("shared_steps", "p100-1x4", tie=True)
    untied = _problem("shared_steps", "p100-1x4")
    choices = [0] * untied.num_nodes
    first, second = untied.ops_of_nodes[1][0], untied.ops_of_nodes[2][0]
    assert untied.dnn().graph.ops[first].param_group == untied.dnn().graph.ops[second].param_group
    choices[second] = 1
    with pytest.raises(ConfigError, match="parameter group"):
        tied.choices_of(untied.strategy(choices))
