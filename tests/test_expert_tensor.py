"""Expert tensor parallelism: a moe op's `reduce` r cuts every expert's hidden width r ways.

The kernel's r partial sums of a token box add up to the unsplit op (float64, random
problems, both routings, stacked and per-expert weights, a gated shared expert), and so do
their gradients; the space offers the degrees that divide the widths."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from graphs import moe_op

from planner.costs.config import ParallelConfig, check_config, degree_options
from planner.costs.kernels import plan_task, run_task, shard_params
from planner.errors import ConfigError
from planner.graph.moe import ffn_axis, ffn_shard, moe_math, moe_spec
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.opkinds import contraction


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
