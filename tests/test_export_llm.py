"""DTensor export of transformers as their authors write them: causal attention (SDPA, a
`tril` mask with `masked_fill`, rotary tables, fewer k/v heads) under sample and head
splits, on gloo at world 2, against single-process training in float64."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from budget import time_budget
from test_capture_llm import gpt2, llama

import planner
from planner.export import export_plan
from planner.graph.opkinds import CHANNEL
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, split_along
from planner.problems.strategy import Strategy, strategy_from_json
from runtime.launch import worker_context

TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
MODELS = {"gpt2-ones": lambda: gpt2("ones"), "llama-sdpa": lambda: llama("sdpa")}


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(180):
        yield


def heads_split(strategy: Strategy) -> Strategy:
    """The strategy with every q/k/v projection split by output channels (colwise) and every
    attention by heads: tensor parallelism of the attention, the rest data parallel."""
    graph = strategy.graph
    configs = list(strategy.configs)
    for i, op in enumerate(graph.ops):
        feeds_attention = any(
            graph.ops[c].kind in ("attention", "slice") for c in graph.consumers[i]
        )
        if op.kind == "attention" or (op.kind == "linear" and feeds_attention):
            configs[i] = split_along(op, CHANNEL, [0, 1])
    return Strategy(graph, strategy.devices, tuple(configs))


def strategies(name: str) -> dict[str, Any]:
    module = MODELS[name]()
    graph = planner.plan(module, "cpu-local-2", example_inputs=(TOKENS,), backend="baselines")
    g = graph.problem.dnn().graph
    dp = data_parallel(g, get_preset("cpu-local-2"))
    return {"data": dp.to_json(), "heads": heads_split(dp).to_json()}


def test_attention_ops_export_by_samples_and_by_heads() -> None:
    module = gpt2("ones")
    cases = strategies("gpt2-ones")
    for kind, data in cases.items():
        plan = export_plan(strategy_from_json(data), module)
        styles = {o.op: o.style for o in plan.ops if o.kind == "attention"}
        assert set(styles.values()) == ({"data"} if kind == "data" else {"heads"})
        assert not plan.fell_back
        modules = dict(plan.modules)
        assert modules["transformer.wpe"] == "replicate"  # positions read whole
        assert modules.get("lm_head", modules["transformer.wte"]) == modules["transformer.wte"]
        expected = "data" if kind == "data" else "colwise"  # the fused q/k/v projection
        assert modules["transformer.h.0.attn.c_attn"] == expected


def _train(module: Any, step: Any, steps: int = 2) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        target = torch.randint(0, 64, (4, 16), generator=g)
        out = module(*step((TOKENS,)))
        logits = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(float(loss.detach()))
    return losses


def _worker(rank: int, world: int, tmp: str, name: str, cases: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        for case, data in cases.items():
            net = MODELS[name]().double()
            ref = copy.deepcopy(net)
            exported = planner.parallelize(strategy_from_json(data), net)
            losses = _train(net, lambda a, e=exported: e.distribute_inputs(*a))
            ref_losses = _train(ref, lambda a: a)
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
            params = dict(ref.named_parameters())
            for n, p in net.named_parameters():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                q = params[n]
                worst = max(worst, float((full.detach() - q.detach()).abs().max() / q.abs().max()))
            tied = getattr(net, "lm_head", None)
            report[case] = {
                "deviation": worst,
                "count": len(list(net.parameters())) == len(list(ref.parameters())),
                "tied": tied is None or tied.weight is net.transformer.wte.weight,
            }
    if rank == 0:
        Path(tmp, "report.json").write_text(json.dumps(report))


@pytest.mark.parametrize("name", list(MODELS))
def test_parallelized_transformers_train_like_single_process_on_gloo(
    name: str, tmp_path: Path
) -> None:
    cases = strategies(name)
    ctx = worker_context()
    procs = [
        ctx.Process(target=_worker, args=(r, 2, str(tmp_path), name, cases), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"data", "heads"}
    for case, r in report.items():
        assert r["deviation"] < 1e-12 and r["count"] and r["tied"], (case, r)
