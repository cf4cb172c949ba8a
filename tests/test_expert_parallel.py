"""Expert parallelism (`ParallelConfig.expert`) in the space, the cost model
(`planner.costs.experts`), the simulator and the baselines."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from graphs import moe_op

from planner.costs.config import (
    ConfigSpace,
    ParallelConfig,
    count_partitions,
    divisors,
    partitions,
)
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.experts import (
    a2a_bytes,
    a2a_seconds,
    expert_gemm_seconds,
    token_pass_bytes,
)
from planner.costs.memory import param_bytes
from planner.costs.overlap import exposed_seconds
from planner.costs.rates import chip_rates
from planner.errors import LayerwiseError
from planner.graph.moe import is_routed, moe_flops, moe_spec
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.hardware.presets import get_preset
from planner.problems.baselines import BASELINES, applicable, expert_parallel, megatron
from planner.problems.problem import build_problem
from planner.problems.sizes import estimate
from planner.sim.simulator import Simulator


def moe_model(
    sample: int = 16,
    length: int = 8,
    hidden: int = 16,
    experts: int = 8,
    top_k: int = 2,
    ffn: int = 24,
    shared: int = 8,
    dtype: int = 2,
    around: bool = True,
) -> OpGraph:
    """input -> linear -> moe (router, stacked gated experts, a shared expert) -> linear,
    every tensor (sample, length, channel); `around` False: input -> moe only."""

    def tensor(c: int = hidden) -> Tensor:
        return Tensor.of(dtype, sample=sample, length=length, channel=c)

    def dense(name: str, src: str) -> Op:
        flops = 2.0 * sample * length * hidden * hidden
        params = (Param(f"{name}.weight", (hidden, hidden), dtype),)
        return Op(name, "linear", (src,), tensor(), params, flops=flops)

    x = Op("x", "input", (), tensor())
    if not around:
        return OpGraph("moe1", (x, moe_op("moe", "x", tensor(), experts, top_k, ffn, shared)))
    moe = moe_op("moe", "up", tensor(), experts, top_k, ffn, shared)
    return OpGraph("moe3", (x, dense("up", "x"), moe, dense("out", "moe")))


def spread(tasks: int, expert: int, devices: tuple[int, ...] | None = None) -> ParallelConfig:
    """A moe config splitting samples `tasks` ways, experts `expert` ways."""
    return ParallelConfig((tasks, 1, 1), devices or tuple(range(tasks)), expert=expert)


# -- the space ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "mesh"])
def test_moe_configs_take_every_expert_degree_and_the_estimate_counts_them(kind) -> None:
    graph, devices = moe_model(experts=4), get_preset("p100-2x4")
    space = ConfigSpace(graph, devices, kind=kind)
    moe, dense = space[2].configs, space[1].configs
    by_grid = Counter(c.grid for c in moe)
    for cfg in moe:  # degrees dividing the token boxes (a reduce degree adds none)
        assert cfg.expert in divisors(math.gcd(4, cfg.num_tasks // cfg.reduce))
    degrees = Counter((c.grid, c.expert) for c in moe)
    for (grid, _), n in degrees.items():  # every degree on every grid's device sets
        assert n * len(divisors(math.gcd(4, math.prod(grid[:3])))) == by_grid[grid]
    assert {c.expert for c in moe} == {1, 2, 4}
    assert {c.reduce for c in moe} == {1, 2, 4, 8}  # expert tensor parallelism: ffn 16
    assert all(c.expert == 1 for c in dense)
    sizes = devices.hierarchy().sizes
    for cap in (None, 7):
        space = ConfigSpace(graph, devices, kind=kind, max_configs=cap)
        est = estimate(graph, 8, kind, sizes, 2, max_configs=cap)
        assert est.configs_total == sum(space.sizes())
    split = 2 if kind == "mesh" else None
    want: Counter[int] = Counter()
    for p in partitions(graph.ops[2], 8, split):
        want[math.prod(p)] += len(divisors(math.gcd(4, math.prod(p[:3]))))
    assert count_partitions(graph.ops[2], 8, split) == dict(want)


def test_the_mesh_space_keeps_the_zoo_config_counts() -> None:
    """Ops without experts list what they did before expert parallelism (counted at 9ef1f2c:
    a guard, not a test that fails on the old code)."""
    from planner.graph.zoo import model_graph

    graph = model_graph("transformer", batch=8, seq=16, width=32, layers=2, heads=4, vocab=100)
    for kind, count in (("mesh", 1015), ("full", 1601)):
        space = ConfigSpace(graph, get_preset("p100-2x4"), kind=kind)
        assert sum(space.sizes()) == count
        assert all(c.expert == 1 for op in space.ops for c in op.configs)


def test_an_expert_seed_of_a_degree_the_space_lacks_is_added() -> None:
    graph, devices = moe_model(experts=4), get_preset("p100-2x4")
    seed = spread(8, 4, (1, 0, 3, 2, 5, 4, 7, 6))
    seeds = [[] for _ in graph.ops]
    seeds[2] = [seed]
    space = ConfigSpace(graph, devices, kind="mesh", seeds=seeds)
    assert seed in space[2].configs
    assert space[2].configs[space[2].index(seed)].expert == 4


# -- the cost model ------------------------------------------------------------------------


def big_moe(tokens_per_task: int = 4096, hidden: int = 4096) -> OpGraph:
    """Shapes only (nothing is allocated): 16 samples of `tokens_per_task` tokens."""
    return moe_model(sample=16, length=tokens_per_task, hidden=hidden, ffn=64, shared=64)


def test_all_to_all_inside_a_node_runs_at_nvlink_across_nodes_at_infiniband() -> None:
    graph, devices = big_moe(32768, 8192), get_preset("dgx-h100-2")
    cm = CostModel(graph, devices)
    inside = spread(16, 2)  # EP groups (0, 1), (2, 3), ...: one node's NVLink
    across = spread(16, 2, tuple(d for g in range(8) for d in (g, g + 8)))  # (0, 8), (1, 9), ...
    a, b = cm.expert_exchange(2, inside), cm.expert_exchange(2, across)
    assert a is not None and b is not None
    # 32768 tokens x k 2 x h 8192 x 2 bytes / e 2 = 512 MiB per peer, dispatch and combine
    # each one message out and one in, priced by the pair's bandwidth and fixed cost
    for got, peer in ((a, 1), (b, 8)):
        want = 2 * (2**29 * cm.inv_bw[0, peer] + cm.msg_cost[0, peer])
        assert got[0] == pytest.approx(np.full(16, want), rel=1e-12)
        assert np.array_equal(got[0], got[1])  # the backward: the same two, reversed
    nvlink, ib = 1.0 / float(cm.inv_bw[0, 1]), 1.0 / float(cm.inv_bw[0, 8])
    assert nvlink > 5 * ib
    assert b[0].max() / a[0].max() == pytest.approx(nvlink / ib, rel=1e-2)


@pytest.mark.parametrize("e", [2, 4, 8])
def test_each_member_sends_and_receives_its_tokens_k_h_bytes_times_e_minus_1_over_e(e) -> None:
    graph = moe_model()
    op = graph.ops[2]
    cfg = spread(8, e)
    tokens = 16 * 8 / 8  # per task
    per_member = tokens * 2 * 16 * 2 * (e - 1) / e  # tokens x k x h x bytes x (e - 1) / e
    assert a2a_bytes(op, cfg) * (e - 1) == per_member

    def unit(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.ones(np.shape(a)), np.zeros(np.shape(a))  # 1 s per byte, free messages

    dispatch, combine = a2a_seconds(unit, cfg, a2a_bytes(op, cfg), 1.0)
    assert np.allclose(dispatch, per_member) and np.allclose(combine, per_member)
    dispatch, combine = a2a_seconds(unit, cfg, a2a_bytes(op, cfg), 1.5)  # the busiest rank
    assert np.allclose(dispatch, 1.5 * per_member) and np.allclose(combine, 1.5 * per_member)


def test_the_capacity_factor_scales_the_busiest_ranks_expert_compute_only() -> None:
    graph, devices = big_moe(tokens_per_task=512), get_preset("p100-2x4")
    op = graph.ops[2]
    parts = moe_flops(moe_spec(op), 4096, 16 * 512)
    spread_, alone = spread(8, 8), spread(8, 1)
    times = {}
    for cf in (1.0, 1.5):
        cm = CostModel(graph, devices, CostOptions(expert_capacity=cf))
        times[cf] = (cm.task_times(2, spread_)[0], cm.task_times(2, alone)[0])
    cm = CostModel(graph, devices)
    rate, bandwidth = cm.compute_rate(op)[0], cm.mem_bw[0] * cm.options.memory_efficiency
    activation = token_pass_bytes(op, spread_, 1.5) - token_pass_bytes(op, spread_, 1.0)
    extra = 0.5 * parts.experts / 8 / rate + activation / bandwidth
    assert times[1.5][0] - times[1.0][0] == pytest.approx(np.full(8, extra), rel=1e-9)
    assert np.array_equal(times[1.5][1], times[1.0][1])  # e = 1: every rank its own tokens
    assert np.allclose(times[1.0][0], times[1.0][1])


def test_bad_capacity_and_overlap_are_refused() -> None:
    for bad in (0.5, True, float("inf"), "2"):
        with pytest.raises(LayerwiseError, match="expert_capacity"):
            CostOptions(expert_capacity=bad)
    with pytest.raises(LayerwiseError, match="ep_overlap"):
        CostOptions(ep_overlap=1.5)


def _classes(op: Op, options: CostOptions) -> tuple[object, object]:
    roles = moe_spec(op).roles
    routed = [p for p, r in zip(op.params, roles, strict=True) if is_routed(r)]
    dense = [p for p, r in zip(op.params, roles, strict=True) if not is_routed(r)]
    o = options
    return param_bytes(dense, o.optimizer, o.master_weights), param_bytes(
        routed, o.optimizer, o.master_weights
    )


def test_expert_weights_and_adam_state_are_cut_e_ways_the_router_is_replicated() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    options = CostOptions(optimizer="adam", master_weights=True)
    cm = CostModel(graph, devices, options)
    dense, routed = _classes(graph.ops[2], options)
    for e in (2, 4, 8):
        weights, grads, state = cm._param_parts(2, spread(8, e))
        assert weights == pytest.approx(dense.weights + routed.weights / e)
        assert grads == pytest.approx(dense.gradients + routed.gradients / e)
        assert state == pytest.approx(dense.state + routed.state / e)
    whole = cm._param_parts(2, spread(8, 1))
    assert whole[2] == pytest.approx(dense.state + routed.state)


def test_zero_shards_expert_state_over_the_expert_data_parallel_group() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    options = CostOptions(optimizer="adam", zero=1)
    cm = CostModel(graph, devices, options)
    dense, routed = _classes(graph.ops[2], options)
    cfg = spread(8, 4)
    weights, _, state = cm._param_parts(2, cfg)
    assert weights == pytest.approx(dense.weights + routed.weights / 4)
    # the dense state over all 8 replicas, an expert's over the 2 tasks of its rank
    assert state == pytest.approx(dense.state / 8 + routed.state / 4 / 2)
    (dense_bytes, every), (routed_bytes, ranks) = cm.param_groups(graph.ops[2], cfg)
    assert every.tolist() == [list(range(8))]
    assert ranks.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (dense_bytes, routed_bytes) == (dense.weights, routed.weights)
    want = (
        cm._sync_groups(every, dense_bytes).max() + cm._sync_groups(ranks, routed_bytes / 4).max()
    )
    assert cm.sync_time(2, cfg) == pytest.approx(float(want), rel=1e-12)


def test_activations_of_the_busiest_rank_grow_by_the_capacity_factor() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    spec = moe_spec(graph.ops[2])
    plain = CostModel(graph, devices).activation_bytes(2, spread(8, 4))
    busy = CostModel(graph, devices, CostOptions(expert_capacity=1.5))
    dispatched = spec.top_k * (2 * 16 + 3 * spec.ffn) / 16  # per byte of output
    unit = graph.ops[2].output.nbytes / 8
    assert busy.activation_bytes(2, spread(8, 4)) == pytest.approx(plain + 0.5 * dispatched * unit)
    assert busy.activation_bytes(2, spread(8, 1)) == plain


def test_on_an_h100_the_experts_run_as_grouped_gemms_of_their_routed_rows() -> None:
    graph, devices = big_moe(tokens_per_task=4096, hidden=1024), get_preset("dgx-h100-1")
    cm = CostModel(graph, devices, CostOptions(expert_capacity=1.25))
    op, cfg = graph.ops[2], spread(8, 4)
    chip = chip_rates(devices.devices[0])
    assert chip is not None and chip.gemm is not None
    want = expert_gemm_seconds(op, cfg, chip.gemm, devices.devices[0].peak16, 1.25)
    fwd, bwd = cm.task_times(2, cfg)
    passes = token_pass_bytes(op, cfg, 1.25) / (cm.mem_bw[0] * cm.options.memory_efficiency)
    overhead = cm.options.task_overhead
    assert fwd[0] == pytest.approx(want[0] + passes + overhead, rel=1e-12)
    assert bwd[0] == pytest.approx(want[1] + passes * cm.options.backward_factor, rel=1e-12)
    # 2 local experts of 4096 x 4 x 2 / 8 x 1.25 = 5120 rows: w1 and w3 (5120 x 64, over h)
    g, peak = chip.gemm, devices.devices[0].peak16
    w1 = g.launch + 2.0 * 2 * 5120 * 64 * 1024 / (peak * g.fraction(2 * 5120, 64, 1024))
    router = g.seconds(4096, 8, 1024, peak)
    assert want[0] > 2 * w1 + router
    flat = CostModel(graph, devices, CostOptions(expert_capacity=1.25, rates="flat"))
    assert flat.task_times(2, cfg)[0][0] != pytest.approx(fwd[0], rel=1e-3)


# -- the simulator -------------------------------------------------------------------------


def test_delta_equals_full_after_random_changes_of_a_moe_graph() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    cm = CostModel(
        graph, devices, CostOptions(optimizer="adam", expert_capacity=1.5, ep_overlap=0.5)
    )
    space = ConfigSpace(graph, devices)
    rng = np.random.default_rng(3)
    pick = [space[i].configs for i in range(len(graph.ops))]
    sim = Simulator(cm, [c[int(rng.integers(len(c)))] for c in pick])
    seen = set()
    for step in range(24):
        i = int(rng.integers(len(graph.ops)))
        sim.change(i, pick[i][int(rng.integers(len(pick[i])))])
        seen.add(sim.configs[2].expert)
        if step % 4 == 3:
            full = Simulator(cm, sim.configs)
            assert sim.timeline().by_key() == full.timeline().by_key()
            assert sim.makespan == full.makespan
    assert len(seen) > 1


def test_without_overlap_the_simulated_step_is_the_additive_cost() -> None:
    """input -> moe on 8 GPUs, experts spread over all 8: the simulated forward, dispatch
    and combine, backward and their reverse end at t_c (compute and four all-to-alls)."""
    graph, devices = moe_model(sample=8, around=False), get_preset("dgx-h100-1")
    cm = CostModel(graph, devices, CostOptions(ep_overlap=0.0))
    configs = [ParallelConfig((8, 1, 1), tuple(range(8))), spread(8, 8)]
    timeline = Simulator(cm, configs).timeline()
    by_name = {t.name: t for t in timeline.tasks}
    # the sync starts when every task's compute and all-to-alls are done: t_c
    assert by_name["sync moe ready"].start == pytest.approx(cm.compute_time(1, configs[1]))
    assert cm.expert_exchange(1, configs[1]) is not None
    names = Counter(t.name.split(" moe")[0] for t in timeline.tasks)
    assert names["ep a2a"] == 8 and names["ep grad a2a"] == 8


def test_ep_overlap_hides_the_all_to_all_under_the_ops_compute() -> None:
    graph, devices = moe_model(sample=8, around=False), get_preset("dgx-h100-1")
    configs = [ParallelConfig((8, 1, 1), tuple(range(8))), spread(8, 4)]
    for f in (0.0, 0.5, 1.0):
        cm = CostModel(graph, devices, CostOptions(ep_overlap=f))
        a2a = cm.expert_exchange(1, configs[1])
        assert a2a is not None
        fwd, _ = cm.task_times(1, configs[1])
        by_name = {t.name: t for t in Simulator(cm, configs).timeline().tasks}
        task = by_name["ep a2a moe #0"]
        assert task.end - task.start == pytest.approx(exposed_seconds(a2a[0][0], fwd[0], f))
        group_end = max(by_name[f"fwd moe #{t}"].end for t in range(4))
        assert task.start >= group_end - 1e-15


# -- baselines ---------------------------------------------------------------------------


def test_megatron_spreads_experts_over_consecutive_devices_and_refuses_bad_degrees() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    strategy = megatron(graph, devices, tensor=2, expert=4)
    moe = strategy.configs[2]
    assert moe.expert == 4 and moe.devices == tuple(range(8))
    assert moe.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [c.expert for i, c in enumerate(strategy.configs) if i != 2] == [1, 1, 1]
    plain = megatron(graph, devices, tensor=2)
    assert [c.degrees for c in plain.configs] == [c.degrees for c in strategy.configs]
    with pytest.raises(LayerwiseError, match="expert-parallel size 3 must divide its 8 experts"):
        megatron(graph, devices, tensor=2, expert=3)
    with pytest.raises(LayerwiseError, match="expert-parallel size 16 must divide"):
        megatron(graph, devices, tensor=1, expert=16)


def test_the_expert_parallel_baseline_is_applicable_and_in_the_mesh_space() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    assert "expert_parallel" in applicable(graph)
    assert "expert_parallel" not in applicable(OpGraph("e", (graph.ops[0],)))
    strategy = BASELINES["expert_parallel"](graph, devices)
    assert strategy.configs[2].expert == 4  # the largest degree inside a node of 4
    assert expert_parallel(graph, get_preset("dgx-h100-1")).configs[2].expert == 8
    problem = build_problem(graph, devices, space="mesh")
    assert problem.strategy(problem.choices_of(strategy)).configs == strategy.configs


def test_routing_permutation_and_activation_passes_add_to_the_gemms() -> None:
    graph = moe_model(around=False)
    op = graph.ops[1]
    cfg = spread(8, 4)
    h, f, fs, k, b = 16, 24, 8, 2, 2
    tokens = 16 * 8 / 8
    per_token = 16 * 8 + b * (2 * h + 2 * k * h + 3 * fs + 3 * h)
    assert token_pass_bytes(op, cfg, 1.0) == tokens * (per_token + b * k * 3 * f)
    assert token_pass_bytes(op, cfg, 1.5) == tokens * (per_token + 1.5 * b * k * 3 * f)
    devices = get_preset("p100-2x4")  # a roofline chip: compute or memory, then the passes
    cm = CostModel(graph, devices, CostOptions(task_overhead=0.0))
    fwd, bwd = cm.task_times(1, cfg)
    compute = moe_flops(moe_spec(op), h, 16 * 8).total / 8 / cm.compute_rate(op)[0]
    bandwidth = cm.mem_bw[0] * cm.options.memory_efficiency
    memory = op.mem_bytes / 8 / bandwidth if op.mem_bytes else 0.0
    passes = token_pass_bytes(op, cfg, 1.0) / bandwidth
    assert fwd[0] == pytest.approx(max(compute, memory) + passes, rel=1e-9)
    assert bwd[0] == pytest.approx(
        cm.options.backward_factor * (max(compute, memory) + passes) + 0.0, rel=1e-9
    )


def _routed(experts: int, top_k: int, groups: int = 1, topk_groups: int = 1) -> OpGraph:
    """A moe op on 64 tasks of 4096 tokens (h 1024, bf16), for the node dispatch."""
    graph = moe_model(sample=64, length=4096, hidden=1024, experts=experts, top_k=top_k)
    op = graph.ops[2]
    attrs = dict(op.attrs) | {"groups": groups, "topk_groups": topk_groups}
    moe = Op(op.name, "moe", op.inputs, op.output, op.params, op.flops, attrs=Op.make_attrs(attrs))
    return OpGraph(graph.name, (*graph.ops[:2], moe, graph.ops[3]))


def test_node_dispatch_sends_a_token_once_per_node_it_uses() -> None:
    from planner.costs.experts import nodes_per_token

    graph, devices = _routed(64, 8, groups=8, topk_groups=4), get_preset("dgx-h100-8")
    op, cfg = graph.ops[2], spread(64, 64)  # one group over 8 nodes of 8 GPUs
    assert nodes_per_token(op, 8) == 4.0  # 8 (1 - (7/8)^8) = 5.25, limited to 4 groups
    free = _routed(64, 8).ops[2]
    assert nodes_per_token(free, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8))
    direct = CostModel(graph, devices, CostOptions()).expert_exchange(2, cfg)
    node = CostModel(graph, devices, CostOptions(ep_dispatch="node")).expert_exchange(2, cfg)
    assert direct is not None and node is not None
    cm = CostModel(graph, devices)
    # direct: 56 of a member's 63 messages cross InfiniBand, each tokens x k x h x 2 / 64
    per_peer = 4096 * 8 * 1024 * 2 / 64
    ib = 56 * (per_peer * cm.inv_bw[0, 8] + cm.msg_cost[0, 8])
    nvl = 7 * (per_peer * cm.inv_bw[0, 1] + cm.msg_cost[0, 1])
    assert direct[0][0] == pytest.approx(2 * (ib + nvl), rel=1e-9)
    # node: the token once to each of 4 x 7 / 8 remote nodes on average, spread over 7
    # nodes' same-place GPUs; its 8 copies fanned out over NVLink, the slower leg each time
    per_node = 4096 * 1024 * 2 * 4 * (7 / 8) / 7
    ib = 7 * (per_node * cm.inv_bw[0, 8] + cm.msg_cost[0, 8])
    nvl = 7 * (per_peer * 8 * cm.inv_bw[0, 1] + cm.msg_cost[0, 1])
    assert node[0][0] == pytest.approx(2 * max(ib, nvl), rel=1e-9)
    assert node[0][0] < direct[0][0] / 2


def test_fp8_dispatch_halves_the_dispatch_not_the_combine() -> None:
    graph, devices = _routed(64, 8), get_preset("dgx-h100-8")
    cfg = spread(64, 64)
    bf16 = CostModel(graph, devices).expert_exchange(2, cfg)
    fp8 = CostModel(graph, devices, CostOptions(ep_dispatch_bytes=1)).expert_exchange(2, cfg)
    assert bf16 is not None and fp8 is not None
    cm = CostModel(graph, devices)
    per_peer = 4096 * 8 * 1024 * 2 / 64
    fixed = 56 * cm.msg_cost[0, 8] + 7 * cm.msg_cost[0, 1]
    one = 56 * per_peer * cm.inv_bw[0, 8] + 7 * per_peer * cm.inv_bw[0, 1]
    assert bf16[0][0] == pytest.approx(2 * (one + fixed), rel=1e-9)
    assert fp8[0][0] == pytest.approx(one / 2 + one + 2 * fixed, rel=1e-9)
    for bad in ("nodes", 3, True):
        with pytest.raises(LayerwiseError, match="ep_dispatch"):
            CostOptions(**{"ep_dispatch" if isinstance(bad, str) else "ep_dispatch_bytes": bad})
