"""Expert parallelism in the runtime: a tiny mixture-of-experts language model
(`moe_models.MoELM`, Mixtral's and DeepSeek-V3's routings, experts as modules or stacked)
trained on gloo workers with its moe ops' experts spread over ranks and the tokens exchanged
by all-to-all, compared with single-process training in float64; and the all-to-all and the
expert-parallel kernel alone, against the single-process computation."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
import torch
from moe_models import MoELM
from test_runtime_llm import budget  # noqa: F401 (an autouse fixture)
from workers import run_workers

import runtime
from planner.costs.config import ParallelConfig
from planner.costs.kernels import expert_parallel_moe, plan_task, shard_params
from planner.graph.capture import capture
from planner.graph.moe import moe_math, moe_spec
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import LENGTH, SAMPLE
from planner.hardware.presets import get_preset
from planner.problems.strategy import Strategy
from runtime.plan import ShardKey, build_plan

F64 = runtime.RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=60)
TOKENS = (torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0)),)
MODELS = {
    "mixtral": {},
    "mixtral-stacked": {"stacked": True},
    "deepseek": {"deepseek": True},
    "deepseek-stacked": {"deepseek": True, "stacked": True},
}


def _model(name: str) -> tuple[MoELM, OpGraph]:
    torch.manual_seed(0)
    module = MoELM(**MODELS[name])
    return module, capture(module, TOKENS, "moe_lm")


def _strategy(graph: OpGraph, world: int, moe: dict[str, int], reverse: bool = False) -> Strategy:
    """Every op split by samples over all ranks, except the moe ops: `moe` gives their
    sample/length degrees, "expert" and "reduce" (expert tensor parallelism; on ranks in
    reverse order with `reverse`)."""
    configs = []
    for op in graph.ops:
        split = moe if op.kind == "moe" else {SAMPLE: world}
        degrees = tuple(split.get(d, 1) for d in op.output.dims)
        expert, reduce = split.get("expert", 1), split.get("reduce", 1)
        devices = tuple(range(math.prod(degrees) * reduce))
        if reverse and op.kind == "moe":
            devices = devices[::-1]
        configs.append(ParallelConfig(degrees, devices, reduce, expert))
    return Strategy(graph, get_preset(f"cpu-local-{world}"), tuple(configs))


def _check_run(
    run: runtime.RunResult, graph: OpGraph, strategy: Strategy, tokens: int | None = None
) -> None:
    """Deviation within 1e-9, and per step every moe op's token copies dispatched to their
    experts' owners, each owner computing exactly the copies sent to its experts."""
    assert run.deviation is not None
    assert run.deviation["max_deviation"] < 1e-9, run.deviation
    for i, op in enumerate(graph.ops):
        cfg = strategy.configs[i]
        if op.kind != "moe" or cfg.expert == 1:
            continue
        experts, per = moe_spec(op).experts, moe_spec(op).experts // cfg.expert
        for step in run.expert_tokens:
            counts = step[op.name]
            assert sorted(counts) == sorted(cfg.devices)
            for group in cfg.expert_groups():
                for m, t in enumerate(group):
                    computed = counts[cfg.devices[t]][1]
                    sent = [
                        sum(counts[cfg.devices[u]][0][m * per + j] for u in group)
                        for j in range(per)
                    ]
                    assert computed == sent
            total = sum(sum(sent) for sent, _ in counts.values())  # each partial's copies
            assert total == (tokens or TOKENS[0].numel()) * moe_spec(op).top_k * cfg.reduce
            assert all(len(sent) == experts for sent, _ in counts.values())


CASES = {  # name: (world, moe split)
    "data": (2, {SAMPLE: 2}),
    "expert": (2, {SAMPLE: 2, "expert": 2}),
    "expert-length": (2, {LENGTH: 2, "expert": 2}),
    "expert-x-data": (4, {SAMPLE: 4, "expert": 2}),
    "expert-4": (4, {SAMPLE: 4, "expert": 4}),
    "expert-4-sample-length": (4, {SAMPLE: 2, LENGTH: 2, "expert": 4}),
}


@pytest.mark.parametrize(
    ("case", "model"),
    [
        pytest.param("expert", "mixtral", marks=pytest.mark.slow),
        pytest.param("expert-x-data", "deepseek-stacked", marks=pytest.mark.slow),
        pytest.param("data", "mixtral", marks=pytest.mark.slow),
        pytest.param("expert", "deepseek", marks=pytest.mark.slow),
        pytest.param("expert-length", "mixtral-stacked", marks=pytest.mark.slow),
        pytest.param("expert-length", "deepseek", marks=pytest.mark.slow),
        pytest.param("expert-x-data", "mixtral", marks=pytest.mark.slow),
        pytest.param("expert-4", "mixtral", marks=pytest.mark.slow),
        pytest.param("expert-4", "deepseek-stacked", marks=pytest.mark.slow),
        pytest.param("expert-4-sample-length", "deepseek", marks=pytest.mark.slow),
    ],
)
def test_expert_parallel_trains_like_single_process(case: str, model: str) -> None:
    world, moe = CASES[case]
    module, graph = _model(model)
    strategy = _strategy(graph, world, moe)
    run = runtime.run_strategy(strategy, module, F64)
    _check_run(run, graph, strategy)
    if moe.get("expert", 1) > 1:
        assert run.expert_tokens and all(run.expert_tokens)


ETP_CASES = {  # expert tensor parallelism: name: (world, moe split)
    "etp-2": (2, {"reduce": 2}),
    "etp-4": (4, {"reduce": 4}),
    "etp-2-data": (4, {SAMPLE: 2, "reduce": 2}),
    "etp-2-expert-2": (4, {SAMPLE: 2, "reduce": 2, "expert": 2}),
    "etp-2-expert-2-length": (4, {LENGTH: 2, "reduce": 2, "expert": 2}),
}


@pytest.mark.parametrize(
    ("case", "model"),
    [
        ("etp-2", "deepseek"),
        pytest.param("etp-2", "mixtral-stacked", marks=pytest.mark.slow),
        pytest.param("etp-4", "deepseek-stacked", marks=pytest.mark.slow),
        pytest.param("etp-2-data", "mixtral", marks=pytest.mark.slow),
        pytest.param("etp-2-expert-2", "deepseek", marks=pytest.mark.slow),
        pytest.param("etp-2-expert-2", "mixtral-stacked", marks=pytest.mark.slow),
        pytest.param("etp-2-expert-2-length", "deepseek-stacked", marks=pytest.mark.slow),
    ],
)
def test_expert_tensor_parallel_trains_like_single_process(case: str, model: str) -> None:
    """Each moe op's experts (and shared expert) cut along their hidden width over `reduce`
    ranks that compute the same tokens, the consumers adding the partial sums; alone and
    with the experts spread (then one expert-parallel group per partial index)."""
    world, moe = ETP_CASES[case]
    module, graph = _model(model)
    strategy = _strategy(graph, world, moe)
    run = runtime.run_strategy(strategy, module, F64)
    _check_run(run, graph, strategy)
    assert run.deviation is not None and run.deviation["max_deviation"] <= 1e-9


def test_expert_tensor_parallel_ranks_hold_the_cut_weights_whole_and_sum_them() -> None:
    _, graph = _model("deepseek-stacked")
    plan = build_plan(_strategy(graph, 4, {SAMPLE: 2, "reduce": 2, "expert": 2}))
    moe = next(o for o in plan.ops if o.op.kind == "moe")
    assert plan.groups["expert"] == ((0, 2), (1, 3))  # one group per partial index
    roles = dict(zip((p.name for p in moe.op.params), moe_spec(moe.op).roles, strict=True))
    cut = {n for n, r in roles.items() if r.startswith(("w13", "w2", "sw"))}
    assert cut <= plan.whole and not {n for n, r in roles.items() if r == "router"} & plan.whole
    hit = [i for i in plan.sync if i.param in cut or roles.get(i.param) == "router"]
    assert hit and all(item.ranks == (0, 1, 2, 3) for item in hit)


def test_uneven_routing_with_empty_splits_and_ranks_out_of_order() -> None:
    # the moe tasks on ranks (1, 0): member 0 of the group is rank 1; some rank sends no
    # token copy to some expert in some step (an all-to-all split of 0 rows)
    module, graph = _model("mixtral")
    strategy = _strategy(graph, 2, {SAMPLE: 2, "expert": 2}, reverse=True)
    run = runtime.run_strategy(strategy, module, F64)
    _check_run(run, graph, strategy)
    sent = [s for step in run.expert_tokens for ranks in step.values() for s, _ in ranks.values()]
    assert any(0 in s for s in sent)
    assert all(max(s) > 0 for s in sent)


@pytest.mark.slow
def test_recomputed_experts_exchange_again_and_train_identically() -> None:
    module, graph = _model("deepseek")
    strategy = _strategy(graph, 2, {SAMPLE: 2, "expert": 2})
    plain = runtime.run_strategy(strategy, module, F64)
    again = runtime.run_strategy(strategy, module, replace(F64, recompute="full"))
    _check_run(again, graph, strategy)
    assert again.recomputed_tasks[0] >= 4  # both moe ops' tasks on both ranks
    assert again.losses == plain.losses
    assert again.params is not None and plain.params is not None
    for name, p in plain.params.items():
        assert torch.equal(p, again.params[name]), name


@pytest.mark.parametrize("model", ["mixtral", "deepseek-stacked"])
def test_each_rank_holds_only_its_experts_and_syncs_them_with_their_replicas(model: str) -> None:
    _, graph = _model(model)
    strategy = _strategy(graph, 4, {SAMPLE: 4, "expert": 2})
    plan = build_plan(strategy)
    moe = next(o for o in plan.ops if o.op.kind == "moe")
    roles = moe_spec(moe.op).roles
    assert plan.groups["expert"] == ((0, 1), (2, 3))
    for t, keys in enumerate(moe.shards):
        lo, hi = (0, 4) if t % 2 == 0 else (4, 8)
        for key, role in zip(keys, roles, strict=True):
            base, _, index = role.partition(".")
            if base in ("w13", "w2") and not index:
                assert (key.lo, key.hi) == (lo, hi)  # rows of the stacked tensor
            elif index:
                assert (key.hi > key.lo) == (lo <= int(index) < hi)
    syncs = {
        (item.param, item.lo, item.hi): item.ranks
        for item in plan.sync
        if item.param.startswith(moe.op.name)
    }
    for param, role in zip(moe.op.params, roles, strict=True):
        if role.startswith(("router", "sw", "sgate")):
            assert syncs[(param.name, 0, 1)] == (0, 1, 2, 3)
    experts = {r for (p, _, _), r in syncs.items() if ".experts." in p or p.endswith(("w13", "w2"))}
    assert experts == {(0, 2), (1, 3)}  # the expert-data-parallel groups


# -- the all-to-all and the kernel alone, on 2 gloo workers ---------------------------------------


def _exchange_worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    from runtime.experts import GroupExchange

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    report: dict[str, Any] = {}
    try:
        report |= _check_all_to_all(rank)
        report |= _check_kernel(rank)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"report-{rank}.json"), "w") as f:
        json.dump(report, f)
    del GroupExchange


def _check_all_to_all(rank: int) -> dict[str, float]:
    """Members in order (1, 0), uneven splits with an empty one: rows and gradients against
    the same exchange computed in one process."""
    import torch.distributed as dist

    from runtime.experts import GroupExchange

    members = (1, 0)
    sends = {0: [3, 0], 1: [2, 4]}  # member m's rows for members 0, 1
    gen = torch.Generator().manual_seed(1)
    xs = {m: torch.randn(sum(sends[m]), 5, dtype=torch.float64, generator=gen) for m in (0, 1)}
    ws = {m: torch.randn(sends[0][m] + sends[1][m], 5, dtype=torch.float64, generator=gen)
          for m in (0, 1)}  # fmt: skip
    me = members.index(rank)
    x = xs[me].clone().requires_grad_()
    recv = [sends[0][me], sends[1][me]]
    y = GroupExchange(members, dist.group.WORLD)(x, sends[me], recv)
    (y * ws[me]).sum().backward()
    # one process: member m's block for member n, gathered per receiver in member order
    leaves = {m: xs[m].clone().requires_grad_() for m in (0, 1)}
    blocks = {m: leaves[m].split(sends[m]) for m in (0, 1)}
    ys = {n: torch.cat([blocks[0][n], blocks[1][n]]) for n in (0, 1)}
    sum((ys[n] * ws[n]).sum() for n in (0, 1)).backward()
    assert x.grad is not None and leaves[me].grad is not None
    return {
        "rows": float((y - ys[me]).abs().max()),
        "grad": float((x.grad - leaves[me].grad).abs().max()),
    }


def _check_kernel(rank: int) -> dict[str, float]:
    """`expert_parallel_moe` on each rank's half of the tokens with its experts, against
    `moe_math` on all tokens: outputs, the input's gradient, the router's (summed over the
    ranks) and each expert's (its owner's)."""
    import torch.distributed as dist

    from runtime.experts import GroupExchange

    _, graph = _model("deepseek")
    i = next(k for k, op in enumerate(graph.ops) if op.kind == "moe")
    op = graph.ops[i]
    spec = moe_spec(op)
    gen = torch.Generator().manual_seed(2)
    full = [torch.randn(p.shape, dtype=torch.float64, generator=gen) * 0.3 for p in op.params]
    x = torch.randn(4, 8, 16, dtype=torch.float64, generator=gen)
    ref_params = [p.clone().requires_grad_() for p in full]
    ref_x = x.clone().requires_grad_()
    moe_math(ref_x, ref_params, spec).pow(2).sum().backward()
    cfg = ParallelConfig((2, 1, 1), (0, 1), expert=2)
    plan = plan_task(graph, i, cfg, rank)
    assert plan.experts is not None
    mine = [p.clone().requires_grad_() for p in shard_params(plan, full)]
    xr = x[2 * rank : 2 * rank + 2].reshape(-1, 16).clone().requires_grad_()
    exchange = GroupExchange((0, 1), dist.group.WORLD)
    y = expert_parallel_moe(xr, mine, spec, plan.experts, 2, exchange)
    y.pow(2).sum().backward()
    out = {
        "kernel_out": float(
            (y - moe_math(x[2 * rank : 2 * rank + 2], full, spec).reshape(-1, 16)).abs().max()
        )
    }
    assert xr.grad is not None and ref_x.grad is not None
    out["kernel_x_grad"] = float(
        (xr.grad - ref_x.grad[2 * rank : 2 * rank + 2].reshape(-1, 16)).abs().max()
    )
    worst = 0.0
    for p, ref, full_p, role in zip(mine, ref_params, full, spec.roles, strict=True):
        if p.numel() == 0:
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if not role.startswith(("w1", "w2", "w3")):  # replicated: sum over the ranks
            dist.all_reduce(grad)
        ref_grad = ref.grad if ref.grad is not None else torch.zeros_like(ref)  # router_bias
        want = ref_grad if p.shape == full_p.shape else ref_grad[plan.experts[0] : plan.experts[1]]
        worst = max(worst, float((grad - want).abs().max()))
    out["kernel_param_grads"] = worst
    return out


def test_all_to_all_and_expert_kernel_match_one_process(tmp_path: Any) -> None:
    assert run_workers(_exchange_worker, 2, 2, str(tmp_path), timeout=60) == [0, 0]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report-{rank}.json").read_text())
        assert set(report) == {"rows", "grad", "kernel_out", "kernel_x_grad", "kernel_param_grads"}
        assert report["rows"] == 0.0 and report["grad"] == 0.0, report
        assert max(report.values()) < 1e-12, report


def test_shard_keys_of_a_moe_without_expert_parallelism_hold_everything() -> None:
    _, graph = _model("mixtral-stacked")
    plan = build_plan(_strategy(graph, 2, {SAMPLE: 2}))
    moe = next(o for o in plan.ops if o.op.kind == "moe")
    assert plan.groups["expert"] == ()
    stacked = [p.name for p in moe.op.params if p.name.endswith(("w13", "w2"))]
    assert len(stacked) == 2
    for keys in moe.shards:
        assert all(k.hi > k.lo for k in keys)
        assert {ShardKey(name, 0, 8) for name in stacked} <= set(keys)


def test_dtensor_export_refuses_expert_and_expert_tensor_parallelism_naming_them() -> None:
    from planner.errors import LayerwiseError
    from planner.export.dtensor import export_plan

    module, graph = _model("mixtral-stacked")
    strategy = _strategy(graph, 2, {SAMPLE: 2, "expert": 2})
    with pytest.raises(LayerwiseError, match=r"expert parallelism \(expert 2\) is not exported"):
        export_plan(strategy, module)
    plan = export_plan(strategy, module, fallback="replicate")
    assert {o.op for o in plan.fell_back} == {"layers.0.moe", "layers.1.moe"}
    assert export_plan(_strategy(graph, 2, {SAMPLE: 2}), module).fell_back == ()
    cut = _strategy(graph, 2, {"reduce": 2})
    widths = r"expert tensor parallelism \(the experts' widths cut 2 ways\) is not exported"
    with pytest.raises(LayerwiseError, match=widths):
        export_plan(cut, module)
    both = _strategy(graph, 4, {SAMPLE: 2, "reduce": 2, "expert": 2})
    with pytest.raises(LayerwiseError, match=r"\(expert 2\) and expert tensor parallelism"):
        export_plan(both, module)
    assert len(export_plan(cut, module, fallback="replicate").fell_back) == 2


def _searched(world: int) -> tuple[MoELM, Strategy]:
    """The exact search's strategy for a MoE whose experts outweigh its tokens (the
    experts' gradient sync costs more than the all-to-all of 128 tokens), on `world` CPU
    workers."""
    import planner

    torch.manual_seed(0)
    module = MoELM(hidden=64, experts=8, ffn=1024, layers=2)
    tokens = (torch.randint(0, 32, (4, 32), generator=torch.Generator().manual_seed(0)),)
    graph = capture(module, tokens, "moe_lm")
    planned = planner.plan(graph, f"cpu-local-{world}", backend="elimination", pipeline=False)
    assert planned.strategy is not None
    return module, planned.strategy


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_searched_strategy_spreads_the_experts_and_trains_like_one_process(
    world: int,
) -> None:
    module, strategy = _searched(world)
    pairs = zip(strategy.graph.ops, strategy.configs, strict=True)
    spread = [cfg.expert for op, cfg in pairs if op.kind == "moe"]
    assert spread and min(spread) > 1, spread
    run = runtime.run_strategy(strategy, module, F64)
    _check_run(run, strategy.graph, strategy, tokens=4 * 32)
