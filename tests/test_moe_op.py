"""The `moe` op kind: its arithmetic against straight per-token loops, its checks, its kernel
on token boxes, its FLOPs, and the expert-parallel degree of its configs."""

from __future__ import annotations

import pytest
import torch
from graphs import moe_op

from planner.costs.config import ParallelConfig, check_config
from planner.costs.kernels import plan_task, run_task
from planner.errors import ConfigError, GraphError
from planner.graph.moe import (
    Weights,
    moe_flops,
    moe_math,
    moe_spec,
    route,
    spec_of,
)
from planner.graph.opgraph import Op, OpGraph, Param, Tensor

H, F, E, K = 8, 12, 6, 2


def moe_graph(
    experts: int = E,
    top_k: int = K,
    stacked: bool = False,
    shared: int = 0,
    extra: dict | None = None,
    length: int = 6,
) -> OpGraph:
    x = Op("x", "input", (), Tensor.of(8, sample=2, length=length, channel=H))
    out = Tensor.of(8, sample=2, length=length, channel=H)
    rest = dict(experts=experts, top_k=top_k) | (extra or {})
    e, k = rest.pop("experts"), rest.pop("top_k")
    moe = moe_op("moe", "x", out, e, k, F, shared, stacked, bool(shared), **rest)
    return OpGraph("m", (x, moe))


def random_params(graph: OpGraph, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, dtype=torch.float64, generator=gen) for p in graph.ops[1].params]


def expert_loop(x, w1, w3, w2):
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def test_softmax_routing_is_mistral_top_k_of_logits_then_softmax() -> None:
    graph = moe_graph()
    op = graph.ops[1]
    params = random_params(graph)
    x = torch.randn(2, 6, H, dtype=torch.float64)
    y = moe_math(x, params, moe_spec(op))
    router, experts = params[0], params[1:]
    want = torch.zeros_like(x)
    for s in range(2):
        for t in range(6):  # Mistral's reference: top-k of the logits, softmax over the k
            token = x[s, t]
            logits, chosen = torch.topk(token @ router.T, K)
            for g, i in zip(torch.softmax(logits, -1), chosen.tolist(), strict=True):
                w1, w3, w2 = experts[3 * i : 3 * i + 3]
                want[s, t] += g * expert_loop(token, w1, w3, w2)
    assert torch.allclose(y, want, rtol=0, atol=1e-12)


def test_sigmoid_routing_with_bias_and_groups_is_deepseek_v3_gate() -> None:
    extra = dict(router="sigmoid", groups=3, topk_groups=2, route_scale=2.5)
    graph = moe_graph(extra=extra, shared=5)
    roles = [*moe_spec(graph.ops[1]).roles]
    spec = spec_of(dict(graph.ops[1].attrs) | {"roles": [*roles, "router_bias"]})
    params = [*random_params(graph), torch.randn(E, dtype=torch.float64)]
    x = torch.randn(5, H, dtype=torch.float64)
    gate, index = route(x, spec, Weights(spec, params))
    router, bias = params[0], params[-1]
    for t in range(5):
        scores = torch.sigmoid(x[t] @ router.T)
        biased = (scores + bias).view(3, 2)
        groups = biased.topk(2, -1).values.sum(-1).topk(2).indices.tolist()
        allowed = [i for i in range(E) if i // 2 in groups]
        ranked = sorted(allowed, key=lambda i: -float(scores[i] + bias[i]))[:K]
        weights = scores[ranked] / scores[ranked].sum() * 2.5
        assert sorted(index[t].tolist()) == sorted(ranked)
        got = dict(zip(index[t].tolist(), gate[t].tolist(), strict=True))
        for i, w in zip(ranked, weights.tolist(), strict=True):
            assert got[i] == pytest.approx(w, abs=1e-12)


def test_stacked_experts_compute_what_per_expert_modules_do() -> None:
    listed, stacked = moe_graph(), moe_graph(stacked=True)
    params = random_params(listed)
    experts = [params[1 + 3 * i : 4 + 3 * i] for i in range(E)]
    w13 = torch.stack([torch.cat([w1, w3]) for w1, w3, _ in experts])
    w2 = torch.stack([w for _, _, w in experts])
    x = torch.randn(3, H, dtype=torch.float64)
    a = moe_math(x, params, moe_spec(listed.ops[1]))
    b = moe_math(x, [params[0], w13, w2], moe_spec(stacked.ops[1]))
    assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("degrees", "expert"), [((2, 3, 1), 1), ((1, 6, 1), 3), ((2, 1, 1), 2)])
def test_every_token_box_computes_its_part_alone(degrees, expert) -> None:
    graph = moe_graph(shared=4)
    op = graph.ops[1]
    params = random_params(graph)
    x = torch.randn(2, 6, H, dtype=torch.float64)
    full = moe_math(x, params, moe_spec(op))
    tasks = degrees[0] * degrees[1]
    cfg = ParallelConfig(degrees, tuple(range(tasks)), expert=expert)
    for t in range(tasks):
        plan = plan_task(graph, 1, cfg, t)
        (a, b), (c, d), _ = plan.in_boxes[0]
        y = run_task(plan, [x[a:b, c:d]], params)
        assert torch.allclose(y, full[a:b, c:d], rtol=0, atol=1e-12)


def test_flops_count_the_active_experts_not_all() -> None:
    spec = moe_spec(moe_graph(shared=4).ops[1])
    flops = moe_flops(spec, H, tokens=10)
    assert flops.router == 2 * H * E * 10
    assert flops.experts == K * 2 * 3 * H * F * 10
    assert flops.shared == (2 * 3 * H * 4 + 2 * H) * 10
    # the dense form (every expert on every token) is E / K times the experts' part
    x = torch.randn(10, H, dtype=torch.float64)
    w = torch.randn(F, H, dtype=torch.float64)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        for _ in range(E):
            expert_loop(x, w, w, w.T)
    assert counter.get_total_flops() * K / E == flops.experts


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(top_k=E + 1), "top_k"),
        (dict(router="relu"), "router"),
        (dict(groups=4), "groups"),
        (dict(expert_act="tanh"), "expert_act"),
    ],
)
def test_bad_attributes_are_refused_naming_them(change, message) -> None:
    with pytest.raises(GraphError, match=message):
        moe_graph(extra=change)


def test_parameters_that_disagree_with_the_roles_are_refused() -> None:
    graph = moe_graph()
    op = graph.ops[1]
    bad = (*op.params[:1], Param("moe.w", (F + 1, H), 8), *op.params[2:])
    with pytest.raises(GraphError, match="shape"):
        OpGraph("m", (graph.ops[0], Op("moe", "moe", ("x",), op.output, bad, attrs=op.attrs)))
    short = Op("moe", "moe", ("x",), op.output, op.params[:-3], attrs=op.attrs)
    with pytest.raises(GraphError, match="roles"):
        OpGraph("m", (graph.ops[0], short))


def test_expert_degree_only_on_moe_and_dividing_experts_and_boxes() -> None:
    graph = moe_graph()
    op = graph.ops[1]
    check_config(op, ParallelConfig((2, 3, 1), tuple(range(6)), expert=6), 6)
    with pytest.raises(ConfigError, match="must divide its 6 experts"):
        check_config(op, ParallelConfig((2, 2, 1), tuple(range(4)), expert=4), 4)
    with pytest.raises(ConfigError, match="token boxes"):
        check_config(op, ParallelConfig((2, 1, 1), tuple(range(2)), expert=3), 2)
    with pytest.raises(ConfigError, match="moe ops only"):
        check_config(graph.ops[0], ParallelConfig((2, 1, 1), (0, 1), expert=2), 2)


def test_expert_groups_are_consecutive_token_boxes_and_survive_json() -> None:
    op = moe_graph().ops[1]
    cfg = ParallelConfig((2, 3, 1), tuple(range(6)), expert=3)
    assert cfg.expert_groups() == [[0, 1, 2], [3, 4, 5]]
    assert [cfg.expert_rank(t) for t in range(6)] == [0, 1, 2, 0, 1, 2]
    assert "expert=3" in cfg.describe(op)
    data = cfg.to_json(op)
    assert data["expert"] == 3
    assert ParallelConfig.from_json(op, data, 6) == cfg
    plain = ParallelConfig((2, 3, 1), tuple(range(6)))
    assert "expert" not in plain.to_json(op)
    assert plain.expert_groups() == [[t] for t in range(6)]
