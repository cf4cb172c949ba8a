"""Memory as training spends it: optimizer state, master weights, ZeRO 0-3, headroom
(planner/costs/memory.py, CostOptions), their t_s, the simulator's sync and update tasks,
and the planner's options."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from graphs import chain_cnn, input_op

import planner
from planner.costs.config import ConfigSpace, ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.memory import param_bytes
from planner.errors import LayerwiseError
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.problem import build_problem
from planner.problems.sizes import SizeError, least_memory, strategy_memory
from planner.problems.strategy import Strategy
from planner.sim.simulator import Simulator, simulate


def bf16_linear_graph(cin: int = 1024, cout: int = 1024, dtype_bytes: int = 2) -> OpGraph:
    """data -> one linear layer without bias, weights of `dtype_bytes` bytes per element."""
    x = input_op("data", sample=8, channel=cin)
    fc = Op(
        "fc",
        "linear",
        ("data",),
        Tensor.of(sample=8, channel=cout),
        params=(Param("fc.weight", (cout, cin), dtype_bytes),),
        flops=2.0 * 8 * cin * cout,
    )
    return OpGraph("bf16_linear", (x, fc))


def per_param(graph: OpGraph, devices: int, cfg: ParallelConfig, **options: object) -> float:
    """Bytes per parameter element a task of the linear keeps (its activations excluded:
    none, no op reads its output)."""
    cm = CostModel(graph, get_preset(f"p100-1x{devices}"), CostOptions(**options))  # type: ignore[arg-type]
    op = graph.ops[1]
    assert cm.activations.per_op(1) == 0.0
    held = cm.memory(1, cfg)[cfg.devices[0]]
    shards = cfg.num_tasks // _replicas(cm, cfg)
    return held / (math_prod(op.params[0].shape) / shards)


def _replicas(cm: CostModel, cfg: ParallelConfig) -> int:
    return cm.replica_array(cm.graph.ops[1], cfg).shape[1]


def math_prod(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape))


DP4 = ParallelConfig((4, 1), (0, 1, 2, 3))  # 4 replicas of one shard
TP2_DP2 = ParallelConfig((2, 2), (0, 1, 2, 3))  # 2 shards x 2 replicas


# -- bytes per parameter ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, optimizer, master, expected",
    [
        (2, "none", False, 4),  # today's rule: weights + gradients
        (4, "none", False, 8),
        (4, "sgd", False, 12),  # + fp32 momentum
        (4, "adam", False, 16),  # + two fp32 moments
        (4, "adam", True, 16),  # fp32 weights need no master copy
        (2, "adam", False, 12),
        (2, "adam", True, 16),  # ZeRO Sec. 3.1: 2 + 2 + 12 = 16 Psi
        (2, "sgd", True, 12),
    ],
)
def test_bytes_per_parameter_at_zero_0(
    dtype: int, optimizer: str, master: bool, expected: int
) -> None:
    g = bf16_linear_graph(dtype_bytes=dtype)
    one = ParallelConfig((1, 1), (0,))
    assert per_param(g, 4, one, optimizer=optimizer, master_weights=master) == expected
    # Replicas at stage 0 each keep everything.
    assert per_param(g, 4, DP4, optimizer=optimizer, master_weights=master) == expected


@pytest.mark.parametrize("cfg, r", [(DP4, 4), (TP2_DP2, 2)])
def test_zero_stages_shard_over_the_replicas_of_each_shard(cfg: ParallelConfig, r: int) -> None:
    g = bf16_linear_graph()
    opts = {"optimizer": "adam", "master_weights": True}
    expected = {0: 2 + 2 + 12, 1: 2 + 2 + 12 / r, 2: 2 + (2 + 12) / r, 3: 16 / r}
    for zero, want in expected.items():
        assert per_param(g, 4, cfg, zero=zero, **opts) == pytest.approx(want, rel=1e-12), zero


def test_default_options_keep_weights_gradients_and_activations() -> None:
    """Default = weights + gradients: param_bytes / shards * 2, bit for bit, + the
    activations kept of the op (planner/costs/activations.py; its task's share of them)."""
    g, dg = chain_cnn(), get_preset("p100-1x4")
    cm = CostModel(g, dg)
    space = ConfigSpace(g, dg)
    for i, op in enumerate(g.ops):
        for cfg in space[i].configs:
            shards = cm.replica_array(op, cfg).shape[0] if op.params else 1
            kept = op.output.nbytes / cfg.num_tasks * cm.activations.per_op(i)
            old = op.param_bytes / shards * 2.0 + kept
            assert cm.memory(i, cfg)[cfg.devices[0]] == old
            assert cm.param_copies(op, cfg.num_tasks // shards) == (2.0 if op.params else 0.0)


def test_param_bytes_splits_weights_gradients_and_state() -> None:
    pb = param_bytes([Param("w", (10, 10), 2), Param("b", (10,), 4)], "adam", True)
    assert (pb.weights, pb.gradients) == (200 + 40, 200 + 40)
    assert pb.state == 100 * (8 + 4) + 10 * 8  # master copy only for the 16-bit tensor
    assert pb.held(4, 3) == pytest.approx(pb.total / 4)
    assert pb.updated(4, 0) == pb.total and pb.updated(4, 1) == pb.total / 4


def test_least_memory_counts_one_copy_of_every_state_whatever_the_stage() -> None:
    g = bf16_linear_graph()
    out = g.ops[0].output.nbytes  # the linear's input: its backward reads it (not its output)
    n = 1024 * 1024
    for zero in range(4):
        opts = CostOptions(optimizer="adam", master_weights=True, zero=zero)
        assert least_memory(g, opts) == out + 16 * n


def test_headroom_lowers_what_a_plan_may_use() -> None:
    g, dg = bf16_linear_graph(), get_preset("p100-1x4")
    cm = CostModel(g, dg, CostOptions(headroom=0.25))
    assert cm.usable_memory() == pytest.approx([0.75 * d.memory for d in dg.devices])
    fit = strategy_memory(cm, data_parallel(g, dg))
    assert fit.capacity == pytest.approx(cm.usable_memory())
    p = build_problem(g, dg, cm, memory_limit="device")
    assert p.usage_limit == pytest.approx(cm.usable_memory())


@pytest.mark.parametrize(
    "options, says",
    [
        ({"optimizer": "lamb"}, "optimizer must be 'none', 'sgd' or 'adam'"),
        ({"zero": 4}, "zero must be a ZeRO stage 0, 1, 2 or 3"),
        ({"zero": True}, "zero must be a ZeRO stage"),
        ({"master_weights": 1}, "master_weights must be True or False"),
        ({"headroom": 1.0}, "headroom must be a fraction"),
        ({"headroom": -0.1}, "headroom must be a fraction"),
        ({"zero": 1, "sync": "ps"}, "use sync='ring' with zero >= 1"),
    ],
)
def test_bad_memory_options_are_one_line_errors(options: dict, says: str) -> None:
    with pytest.raises(LayerwiseError, match=says) as err:
        CostOptions(**options)
    assert "\n" not in str(err.value)


# -- time -------------------------------------------------------------------------------------


def test_sync_time_per_stage() -> None:
    """ZeRO 1-2: reduce-scatter + all-gather cost the all-reduce on a ring; ZeRO 3: 1.5x."""
    g, dg = bf16_linear_graph(), get_preset("p100-2x4")
    dp8 = ParallelConfig((8, 1), tuple(range(8)))
    ts = {z: CostModel(g, dg, CostOptions(zero=z)).sync_time(1, dp8) for z in range(4)}
    assert ts[0] > 0
    assert ts[1] == ts[2] == ts[0]
    assert ts[3] == pytest.approx(1.5 * ts[0], rel=1e-12)
    # No replicas, nothing to sync at any stage.
    tp = ParallelConfig((1, 8), tuple(range(8)))
    assert CostModel(g, dg, CostOptions(zero=3)).sync_time(1, tp) == 0.0


def _sync_and_update(zero: int, optimizer: str = "none") -> tuple[float, float, float]:
    """(makespan, seconds between the backward's end and the update's start, update seconds)
    of the data-parallel linear on 4 GPUs."""
    g, dg = bf16_linear_graph(4096, 4096), get_preset("p100-1x4")
    cm = CostModel(g, dg, CostOptions(zero=zero, optimizer=optimizer))
    t = simulate(cm, Strategy(g, dg, (ParallelConfig((4, 1), (0, 1, 2, 3)),) * 2))
    bwd = max(task.end for task in t.tasks if task.name.startswith("bwd fc"))
    updates = [task for task in t.tasks if task.name.startswith("update fc")]
    start = min(task.start for task in updates)
    return t.makespan, start - bwd, max(task.end - task.start for task in updates)


def test_the_simulator_moves_with_the_stage_as_t_s_does() -> None:
    g, dg = bf16_linear_graph(4096, 4096), get_preset("p100-1x4")
    ts = [CostModel(g, dg, CostOptions(zero=z)).sync_time(1, DP4) for z in range(4)]
    sim = [_sync_and_update(z) for z in range(4)]
    sync = [s[1] for s in sim]
    assert sync[1] == sync[2] == sync[0]  # same ring volume as the all-reduce
    # ZeRO 3 adds half an all-reduce, in the simulator as in t_s (the simulator pays each
    # transfer's latency once, t_s once per ring step: 2% here).
    assert (sync[3] - sync[0]) / sync[0] == pytest.approx((ts[3] - ts[0]) / ts[0], rel=0.02)
    # The update: each replica updates its 1/4 slice at any ZeRO stage.
    assert sim[1][2] == pytest.approx(sim[0][2] / 4, rel=1e-12)
    assert sim[3][0] > sim[0][0] > sim[1][0]
    # Adam's state makes the step read more: bf16 (2 + 2 + 8) / (2 + 2) = 3x.
    assert _sync_and_update(0, "adam")[2] == pytest.approx(3 * sim[0][2], rel=1e-12)


def test_delta_equals_full_with_zero_3_and_adam() -> None:
    g, dg = chain_cnn(), get_preset("p100-1x4")
    cm = CostModel(g, dg, CostOptions(optimizer="adam", master_weights=True, zero=3))
    space = ConfigSpace(g, dg)
    rng = np.random.default_rng(0)
    sim = Simulator(cm, [space[i].configs[0] for i in range(len(g.ops))])
    for step in range(16):
        i = int(rng.integers(len(g.ops)))
        sim.change(i, space[i].configs[int(rng.integers(len(space[i])))])
        if step % 4 == 3:
            full = Simulator(cm, sim.configs)
            assert sim.timeline().by_key() == full.timeline().by_key()


# -- the planner ------------------------------------------------------------------------------


def _tight_devices(memory: float) -> DeviceGraph:
    """4 P100s with `memory` bytes each."""
    dg = get_preset("p100-1x4")
    devices = [dataclasses.replace(d, memory=int(memory)) for d in dg.devices]
    return DeviceGraph(dg.name, devices, dg.links, dg.switches)


def test_zero_auto_takes_the_next_stage_when_the_plan_does_not_fit() -> None:
    """A linear whose one output channel cannot be split: 256 Ki fp32 parameters with Adam,
    16 B/param (4 MiB), an 8 MiB input split over the batch, 3.9 MiB per device. Stage 0:
    the device of any task of the linear keeps 4 MiB. Stage 1, data parallel over 4:
    (4 + 4 + 8 / 4) B/param = 2.5 MiB + 2 MiB of input. Stage 2: (4 + 12 / 4) B/param =
    1.75 MiB + 2 MiB = 3.75 MiB: fits."""
    g = bf16_linear_graph(cin=2**18, cout=1, dtype_bytes=4)
    dg = _tight_devices(3.9 * 2**20)
    # without contraction splits: a sum split 4 ways would cut the weight at stage 0
    # the 3.9 MiB all usable: none kept free (the default keeps 5% and a reserve per GPU)
    kw = {"optimizer": "adam", "recommend": False, "time_limit": 60, "reduce": False,
          "headroom": 0.0, "reserve": 0}  # fmt: skip
    r = planner.plan(g, dg, zero="auto", backend="search", memory_limit="device", **kw)
    assert r.stats["memory_fits"]
    assert r.stats["zero"]["chose"] == 2
    tried = r.stats["zero"]["tried"]
    assert [t["zero"] for t in tried] == [0, 1] and "no answer that fits" in tried[0]["why"]
    assert r.problem.dnn().cost_model.options.zero == 2
    assert r.summary()["zero"]["chose"] == 2
    # A stage that does not fit: plan refuses the answer (elimination ignores the memory).
    with pytest.raises(SizeError, match="does not fit the devices' memory"):
        planner.plan(g, dg, zero=1, backend="elimination", **kw)


@pytest.mark.slow
def test_zero_auto_with_the_default_backend() -> None:
    """The same with backend "auto" (elimination, then portfolio under the memory)."""
    g = bf16_linear_graph(cin=2**18, cout=1, dtype_bytes=4)
    r = planner.plan(g, _tight_devices(3.9 * 2**20), zero="auto", optimizer="adam",
                     recommend=False, time_limit=60, reduce=False, headroom=0.0,
                     reserve=0)  # fmt: skip
    assert r.stats["memory_fits"] and r.stats["zero"]["chose"] == 2


def test_plan_refuses_bad_memory_options_before_any_work() -> None:
    for options, says in (
        ({"zero": 5}, "zero must be a ZeRO stage"),
        ({"zero": "yes"}, "zero must be 0, 1, 2, 3 or 'auto'"),
        ({"optimizer": "lamb"}, "optimizer must be"),
        ({"zero": 2, "sync": "ps"}, "sync='ring'"),
        ({"headroom": 2}, "headroom must be a fraction"),
    ):
        with pytest.raises(LayerwiseError, match=says):
            planner.plan("no_such_model", "p100-1x4", **options)  # type: ignore[arg-type]


def test_param_copies_from_an_old_plan_file() -> None:
    from planner.sources import cost_model

    g, dg = bf16_linear_graph(), get_preset("p100-1x4")
    assert cost_model(g, dg, param_copies=2.0).options == CostOptions()
    with pytest.raises(LayerwiseError, match="param_copies=3.0 is no longer a cost option"):
        cost_model(g, dg, param_copies=3.0)


@pytest.mark.slow
def test_cli_plan_and_evaluate_keep_the_memory_options(tmp_path, capsys) -> None:
    import json

    from planner.cli import main

    out = tmp_path / "plan.json"
    args = ["plan", "lenet5", "--batch", "8", "--devices", "p100-1x2", "--backend",
            "elimination", "--optimizer", "adam", "--zero", "3", "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    cost = json.loads(out.read_text())["cost"]
    assert (cost["optimizer"], cost["zero"], cost["master_weights"]) == ("adam", 3, False)
    capsys.readouterr()
    assert main(["evaluate", str(out), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["memory_peak_bytes"] == json.loads(out.read_text())["memory_peak_bytes"]
    for bad in (["--zero", "5"], ["--headroom", "1.5"], ["--optimizer", "lamb"]):
        assert main(["plan", "lenet5", "--devices", "p100-1x2", *bad]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:"), err
