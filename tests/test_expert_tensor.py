"""Expert tensor parallelism: a moe op's `reduce` r cuts every expert's hidden width r ways.

The kernel's r partial sums of a token box add up to the unsplit op (float64, random
problems, both routings, stacked and per-expert weights, a gated shared expert), and so do
their gradients; the space offers the degrees that divide the widths; the cost model prices
the router whole and the experts' GEMMs, weights and hidden activations cut, the partial
sums' reduction as a row-parallel linear's and each partial's all-to-all in its own group;
full and delta simulation agree; `megatron(..., expert_tensor=t)` lays it out."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from graphs import moe_op
from test_expert_parallel import moe_model

from planner.costs.activations import moe_buffers
from planner.costs.config import ConfigSpace, ParallelConfig, check_config, degree_options
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.experts import a2a_bytes, expert_gemm_seconds, moe_task_flops
from planner.costs.kernels import plan_task, run_task, shard_params
from planner.costs.memory import param_bytes
from planner.costs.rates import chip_rates
from planner.errors import ConfigError, LayerwiseError
from planner.graph.moe import ffn_axis, ffn_shard, moe_flops, moe_math, moe_spec
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.opkinds import contraction
from planner.hardware.presets import get_preset
from planner.problems.baselines import megatron
from planner.sim.simulator import Simulator


def random_moe(seed: int) -> tuple[OpGraph, int]:
    """A random moe op (its sizes, routing, weight layout, shared expert) and a reduce
    degree r that divides its hidden widths."""
    rng = random.Random(seed)
    r = rng.choice([2, 3, 4])
    h, experts = rng.choice([4, 6, 8]), rng.choice([4, 6, 8])
    top_k = rng.randint(1, 3)
    ffn, shared = r * rng.randint(1, 4), r * rng.choice([0, 1, 2])
    extra: dict[str, object] = {}
    deepseek = rng.random() < 0.5
    if deepseek:
        extra = dict(router="sigmoid", groups=2, topk_groups=1, route_scale=2.5)
        top_k = min(top_k, experts // 2)
    stacked = rng.random() < 0.5
    gate = bool(shared) and rng.random() < 0.7
    out = Tensor.of(8, sample=2, length=4, channel=h)
    x = Op("x", "input", (), out)
    op = moe_op("moe", "x", out, experts, top_k, ffn, shared, stacked, gate, **extra)
    if deepseek:  # DeepSeek-V3's selection bias
        roles = [*moe_spec(op).roles, "router_bias"]
        attrs = Op.make_attrs(dict(op.attrs) | {"roles": roles})
        params = (*op.params, Param("moe.router_bias", (experts,), 8))
        op = dataclasses.replace(op, params=params, attrs=attrs)
    return OpGraph("etp", (x, op)), r


def params_of(graph: OpGraph, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(p.shape, dtype=torch.float64, generator=gen) * 0.5 for p in graph.ops[1].params
    ]


@pytest.mark.parametrize("seed", range(24))
def test_partial_sums_of_the_hidden_width_add_up_to_the_op(seed: int) -> None:
    graph, r = random_moe(seed)
    op = graph.ops[1]
    spec = moe_spec(op)
    params = params_of(graph, seed)
    x = torch.randn(2, 4, op.output.size("channel"), dtype=torch.float64)
    ref_x = x.clone().requires_grad_()
    ref_p = [p.clone().requires_grad_() for p in params]
    full = moe_math(ref_x, ref_p, spec)
    weight = torch.randn_like(full)
    (full * weight).sum().backward()
    boxes = random.Random(seed).choice([(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)])
    cfg = ParallelConfig(boxes, tuple(range(math.prod(boxes) * r)), reduce=r)
    total = torch.zeros_like(x)
    grad_x = torch.zeros_like(x)
    grads = [torch.zeros_like(p) for p in params]
    for t in range(cfg.num_tasks):
        plan = plan_task(graph, 1, cfg, t)
        assert plan.summed is not None
        (a, b), (c, d), _ = plan.in_boxes[0]
        assert plan.in_boxes[0][2] == (0, x.shape[2])  # the tokens whole, every partial
        whole = [p.clone().requires_grad_() for p in params]
        shards = shard_params(plan, whole)
        assert [tuple(s.shape) for s in shards] == list(plan.param_shapes)
        xt = x[a:b, c:d].clone().requires_grad_()
        y = run_task(plan, [xt], shards)
        total[a:b, c:d] += y.detach()
        (y * weight[a:b, c:d]).sum().backward()
        assert xt.grad is not None
        grad_x[a:b, c:d] += xt.grad
        for g, w in zip(grads, whole, strict=True):
            if w.grad is not None:  # none: an expert no token of the box chose, the bias
                g += w.grad
    assert torch.allclose(total, full, rtol=0, atol=1e-12)
    assert ref_x.grad is not None and torch.allclose(grad_x, ref_x.grad, rtol=0, atol=1e-12)
    for g, ref, role in zip(grads, ref_p, spec.roles, strict=True):
        want = torch.zeros_like(g) if ref.grad is None else ref.grad
        assert torch.allclose(g, want, rtol=0, atol=1e-12), role


def test_one_partial_is_a_slice_of_each_experts_width_and_whole_params_are_cut() -> None:
    out = Tensor.of(8, sample=2, length=4, channel=4)
    op = moe_op("moe", "x", out, 4, 2, 6, 4, stacked=True, shared_gate=True)
    graph = OpGraph("etp", (Op("x", "input", (), out), op))
    params = params_of(graph, 1)
    cfg = ParallelConfig((1, 1, 1), (0, 1), reduce=2)
    plan = plan_task(graph, 1, cfg, 1)
    shapes = dict(zip(moe_spec(op).roles, plan.param_shapes, strict=True))
    assert shapes == {
        "router": (4, 4),
        "w13": (4, 6, 4),  # the gate rows 3:6 and the up rows 9:12
        "w2": (4, 4, 3),
        "sw1": (2, 4),
        "sw3": (2, 4),
        "sw2": (4, 2),
        "sgate": (1, 4),
    }
    w13 = shard_params(plan, params)[1]
    assert torch.equal(w13, torch.cat([params[1][:, 3:6], params[1][:, 9:12]], dim=1))
    x = torch.randn(2, 4, 4, dtype=torch.float64)
    given_whole = run_task(plan, [x], params)
    assert torch.equal(given_whole, run_task(plan, [x], shard_params(plan, params)))


def test_the_hidden_width_axis_of_every_role_and_layout() -> None:
    assert ffn_axis("w1.3") == (0, 1) and ffn_axis("w2.0") == (1, 1)
    assert ffn_axis("w13") == (1, 2) and ffn_axis("w2") == (2, 1)
    assert ffn_axis("w13^T") == (2, 2) and ffn_axis("w2^T") == (1, 1)  # torchtitan (E, in, out)
    assert ffn_axis("sw1") == (0, 1) and ffn_axis("sw2") == (1, 1)
    assert ffn_axis("router") is None and ffn_axis("sgate") is None
    w = torch.arange(24.0).view(2, 12)  # a w1 of f 2, h 12: part 1 of 2 is its row 1
    assert torch.equal(ffn_shard(w, "w1.0", 1, 2), w[1:])
    assert ffn_shard(w, "router", 1, 2) is w


def test_reduce_degrees_divide_the_gcd_of_the_widths_and_refuse_others() -> None:
    out = Tensor.of(8, sample=2, length=4, channel=4)
    op = moe_op("moe", "x", out, 4, 2, 12, 8)
    con = contraction(op)
    assert con is not None and con.internal and con.size == 4  # gcd(12, 8)
    assert degree_options(op, 8)[-1] == [1, 2, 4]
    check_config(op, ParallelConfig((1, 1, 1), (0, 1, 2, 3), reduce=4), 4)
    with pytest.raises(ConfigError, match="reduce degree 8 does not divide the 4"):
        check_config(op, ParallelConfig((1, 1, 1), tuple(range(8)), reduce=8), 8)
    # with expert parallelism: groups of token boxes, one per partial index
    cfg = ParallelConfig((2, 1, 1), (0, 1, 2, 3), reduce=2, expert=2)
    check_config(op, cfg, 4)
    assert cfg.expert_groups() == [[0, 2], [1, 3]]


# -- the cost model and the simulator -----------------------------------------------------


def etp(boxes: int, t: int, e: int = 1, devices: tuple[int, ...] | None = None) -> ParallelConfig:
    """A moe config of `boxes` sample boxes, each cut t ways, experts spread e ways."""
    return ParallelConfig((boxes, 1, 1), devices or tuple(range(boxes * t)), t, e)


def test_the_router_runs_whole_on_every_partial_the_experts_on_their_slices() -> None:
    graph = moe_model()
    op = graph.ops[2]
    parts = moe_flops(moe_spec(op), 16, 16 * 8)
    for boxes, t in ((1, 2), (2, 4), (4, 2)):
        got = moe_task_flops(op, etp(boxes, t), 1.0)
        assert got == pytest.approx(
            parts.router / boxes + (parts.experts + parts.shared) / (boxes * t)
        )


def test_on_an_h100_a_partial_runs_the_gemms_of_an_op_with_1_over_t_of_the_widths() -> None:
    """Expert tensor parallelism t on one box prices what the same op with f / t and fs / t
    costs unsplit: the router's GEMM whole on every partial, each expert's GEMMs narrower."""
    devices = get_preset("dgx-h100-1")
    chip = chip_rates(devices.devices[0])
    assert chip is not None and chip.gemm is not None
    peak = devices.devices[0].peak16
    wide = moe_model(sample=8, length=4096, hidden=2048, ffn=4096, shared=1024)
    for t in (2, 4):
        narrow = moe_model(sample=8, length=4096, hidden=2048, ffn=4096 // t, shared=1024 // t)
        for e in (1, 2):
            cut = expert_gemm_seconds(wide.ops[2], etp(2, t, e), chip.gemm, peak, 1.25)
            want = expert_gemm_seconds(narrow.ops[2], etp(2, 1, e), chip.gemm, peak, 1.25)
            assert cut == pytest.approx(want, rel=1e-12)
    cm = CostModel(wide, devices)
    one, two = cm.task_times(2, etp(1, 1))[0][0], cm.task_times(2, etp(1, 2))[0][0]
    assert one / 2 < two < one  # narrower experts, the router and the permutation whole


def test_partial_sums_are_reduced_as_a_row_parallel_linears_are() -> None:
    """moe (its widths cut 2 ways) -> linear split by samples costs what linear (its sum cut
    2 ways) -> moe split by samples does: a reduce-scatter of partials of one shape."""
    graph, devices = moe_model(), get_preset("p100-2x4")
    cm = CostModel(graph, devices)
    into, out = graph.edges[1], graph.edges[2]  # up -> moe, moe -> out
    assert (graph.ops[out.src].kind, graph.ops[into.dst].kind) == ("moe", "moe")
    split = ParallelConfig((2, 1, 1), (0, 1))
    row = ParallelConfig((1, 1, 1), (0, 1), reduce=2)
    got = cm.transfer_time(out, etp(1, 2), split)
    assert got > 0 and got == pytest.approx(cm.transfer_time(into, row, split), rel=1e-12)


def test_each_partial_dispatches_its_box_to_its_own_group() -> None:
    """Boxes 2, t 2, e 2 on GPUs 0-3: groups (0, 2) and (1, 3), each all-to-all the size of
    boxes 2, e 2 without the cut, on the same pair of GPUs."""
    graph, devices = moe_model(sample=16, length=4096, hidden=1024), get_preset("dgx-h100-1")
    op, cm = graph.ops[2], CostModel(graph, devices)
    cfg = etp(2, 2, 2)
    assert cfg.expert_groups() == [[0, 2], [1, 3]]
    assert a2a_bytes(op, cfg) == a2a_bytes(op, etp(2, 1, 2))
    a2a = cm.expert_exchange(2, cfg)
    alone = cm.expert_exchange(2, etp(2, 1, 2, (0, 2)))
    assert a2a is not None and alone is not None
    assert np.allclose(a2a[0], alone[0][0]) and np.allclose(a2a[1], alone[1][0])


def test_weights_and_adam_state_router_whole_shared_over_t_experts_over_e_t() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    op = graph.ops[2]
    for zero in (0, 1):
        options = CostOptions(optimizer="adam", master_weights=True, zero=zero)
        cm = CostModel(graph, devices, options)
        roles = dict(zip((p.name for p in op.params), moe_spec(op).roles, strict=True))
        by = {
            kind: param_bytes(
                [p for p in op.params if roles[p.name].startswith(prefix)], "adam", True
            )
            for kind, prefix in (("router", "router"), ("shared", "sw"), ("routed", "w"))
        }
        for boxes, t, e in ((1, 2, 1), (2, 2, 2), (1, 8, 1), (4, 2, 4)):
            weights, grads, state = cm._param_parts(2, etp(boxes, t, e))
            assert weights == pytest.approx(
                by["router"].weights + by["shared"].weights / t + by["routed"].weights / (e * t)
            )
            r_router, r_shared, r_routed = (boxes * t, boxes, boxes // e) if zero else (1, 1, 1)
            assert state == pytest.approx(
                by["router"].state / r_router
                + by["shared"].state / t / r_shared
                + by["routed"].state / (e * t) / r_routed
            )
            assert grads == pytest.approx(
                by["router"].gradients
                + by["shared"].gradients / t
                + by["routed"].gradients / (e * t)
            )
        classes = cm.param_groups(op, etp(2, 2, 2))
        assert [a.tolist() for _, a in classes] == [
            [[0, 1, 2, 3]],  # the router
            [[0, 2], [1, 3]],  # the shared expert: partial 0, partial 1
            [[0], [1], [2], [3]],  # routed: (expert rank, partial) each on one GPU
        ]


def test_activations_keep_the_box_whole_and_the_hidden_widths_cut() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    op = graph.ops[2]
    h, b, tokens = 16, 2, 16 * 8
    spec = moe_spec(op)
    for capacity in (1.0, 1.5):
        cm = CostModel(graph, devices, CostOptions(expert_capacity=capacity))
        for boxes, t, e in ((1, 2, 1), (2, 4, 1), (2, 2, 2)):
            cfg = etp(boxes, t, e)
            base = cm.activation_bytes(2, etp(boxes * t, 1))  # the same tasks, no cut
            rest = base - cm._kept_unit(2, etp(boxes * t, 1)) * moe_buffers(op)
            # per token: its k copies and outputs (2 h), probabilities (E fp32), the hidden
            # 3 f / t per copy and the shared expert's 3 fs / t
            per_token = b * (spec.top_k * (2 * h + 3 * 24 / t) + 3 * 8 / t) + 4 * 8
            if e > 1:
                per_token += (capacity - 1) * b * spec.top_k * (2 * h + 3 * 24 / t)
            want = rest + tokens / boxes * per_token
            assert cm.activation_bytes(2, cfg) == pytest.approx(want, rel=1e-12)


def test_delta_equals_full_with_the_experts_widths_cut() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    options = CostOptions(optimizer="adam", zero=1, expert_capacity=1.5, ep_overlap=0.5)
    cm = CostModel(graph, devices, options)
    space = ConfigSpace(graph, devices)
    rng = np.random.default_rng(5)
    pick = [space[i].configs for i in range(len(graph.ops))]
    cut = [c for c in pick[2] if c.reduce > 1]
    assert {c.reduce for c in cut} == {2, 4, 8} and any(c.expert > 1 for c in cut)
    sim = Simulator(cm, [c[int(rng.integers(len(c)))] for c in pick])
    seen = set()
    for step in range(32):
        i = 2 if step % 2 == 0 else int(rng.integers(len(graph.ops)))  # the moe op: cut
        options_i = cut if step % 2 == 0 else pick[i]
        sim.change(i, options_i[int(rng.integers(len(options_i)))])
        seen.add((sim.configs[2].reduce, sim.configs[2].expert))
        if step % 4 == 3:
            full = Simulator(cm, sim.configs)
            assert sim.timeline().by_key() == full.timeline().by_key()
            assert sim.makespan == full.makespan
    assert len({r for r, _ in seen if r > 1}) > 1


def test_megatron_expert_tensor_cuts_the_widths_and_keeps_its_default() -> None:
    graph, devices = moe_model(), get_preset("p100-2x4")
    before = megatron(graph, devices, tensor=2, expert=4)
    assert before.configs[2] == ParallelConfig((4, 2, 1), tuple(range(8)), 1, 4)
    same = megatron(graph, devices, tensor=2, expert=4, expert_tensor=1)
    assert same.configs == before.configs
    cut = megatron(graph, devices, tensor=2, expert=2, expert_tensor=2)
    assert cut.configs[2] == ParallelConfig((4, 1, 1), tuple(range(8)), 2, 2)
    assert cut.configs[1] == before.configs[1] and cut.configs[3] == before.configs[3]
    assert cut.configs[2].expert_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    four = megatron(graph, devices, tensor=4, expert=2, expert_tensor=4)
    assert four.configs[2] == ParallelConfig((2, 1, 1), tuple(range(8)), 4, 2)
    with pytest.raises(LayerwiseError, match="must divide tensor-parallel size 2"):
        megatron(graph, devices, tensor=2, expert_tensor=4)
    wide = moe_model(ffn=24, shared=12)  # gcd 12: no 8
    with pytest.raises(LayerwiseError, match="hidden width 12"):
        megatron(wide, devices, tensor=8, expert_tensor=8)
