"""Activation recomputation in the DTensor export (`parallelize(..., recompute="full")`): each
numbered block of a GPT-2 runs its forward under checkpointing, again in the backward pass,
and training stays what it is without it (float64, gloo, world 2)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from test_export_llm import (  # noqa: F401 (budget: autouse)
    MODELS,
    TOKENS,
    _tolerance,
    _train,
    budget,
    strategies,
)
from workers import run_workers

import planner
from planner.export import ExportError, export_plan
from planner.problems.strategy import strategy_from_json

NAME = "gpt2-ones"  # attention masked by torch.ones(T, T).tril(): _DTensorMode in the recompute
STEPS = 2


def test_the_blocks_of_recomputed_ops_are_checkpointed() -> None:
    data, _ = strategies(NAME)["data"]
    strategy, module = strategy_from_json(data), MODELS[NAME]()
    assert export_plan(strategy, module).checkpointed == ()
    plan = export_plan(strategy, module, recompute="full")
    assert plan.checkpointed == ("transformer.h.0", "transformer.h.1")
    assert export_plan(strategy, module, recompute=1).checkpointed == ("transformer.h.0",)
    with pytest.raises(ExportError, match="'full' or a number of blocks >= 0, got 'some'"):
        export_plan(strategy, module, recompute="some")


def _counted(net: Any) -> list[int]:
    """Calls of the first block's attention module (its forward and any recomputation)."""
    calls = [0]
    attn = net.get_submodule("transformer.h.0.attn")
    attn.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _deviation(net: Any, ref: Any, losses: list[float], ref_losses: list[float]) -> float:
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    params = {n: _full(q) for n, q in ref.named_parameters()}
    for n, p in net.named_parameters():
        q = params[n]
        worst = max(worst, float((_full(p) - q).abs().max() / q.abs().max()))
    return worst


def _full(p: Any) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _worker(rank: int, world: int, tmp: str, cases: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        for case, (data, _) in cases.items():
            strategy = strategy_from_json(data)
            nets, losses, calls = {}, {}, {}
            for mode in ("none", "full"):
                net = MODELS[NAME]().double()
                exported = planner.parallelize(strategy, net, recompute=mode)
                calls[mode] = _counted(net)
                losses[mode] = _train(net, lambda a, e=exported: e.distribute_inputs(*a), STEPS)
                nets[mode] = net
            ref = MODELS[NAME]().double()
            ref_losses = _train(ref, lambda a: a, STEPS)
            report[case] = {
                "deviation": _deviation(nets["full"], ref, losses["full"], ref_losses),
                "from_plain": _deviation(
                    nets["full"], nets["none"], losses["full"], losses["none"]
                ),
                "calls": {mode: c[0] for mode, c in calls.items()},
                "names": [n for n, _ in nets["full"].named_parameters()]
                == [n for n, _ in ref.named_parameters()],
            }
    if rank == 0:
        Path(tmp, "report.json").write_text(json.dumps(report))


def test_checkpointed_blocks_train_like_without_on_gloo(tmp_path: Path) -> None:
    world, cases = 2, strategies(NAME)
    codes = run_workers(_worker, world, world, str(tmp_path), cases, timeout=150)
    assert codes == [0] * world
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == set(cases)
    for case, r in report.items():
        assert r["deviation"] < 1e-12 and r["from_plain"] < 1e-12 and r["names"], (case, r)
        # per step: the forward, and with recompute its second run in the backward
        assert r["calls"] == {"none": STEPS, "full": 2 * STEPS}, (case, r)


SELECTIVE = "llama-sdpa"  # attention by F.scaled_dot_product_attention: what selective wraps


def test_selective_recomputation_checkpoints_the_attention_modules() -> None:
    data, _ = strategies(SELECTIVE)["data"]
    strategy, module = strategy_from_json(data), MODELS[SELECTIVE]()
    plan = export_plan(strategy, module, recompute="selective")
    assert plan.checkpointed == ()
    assert plan.checkpointed_attention == ("layers.0.attention", "layers.1.attention")
    assert export_plan(strategy, module, recompute="full").checkpointed_attention == ()


def _train_counting(net: Any, step: Any) -> tuple[list[float], list[int]]:
    """`_train`'s steps, and per step the attention kernels selective recomputation ran
    again in the backward pass."""
    import torch.nn.functional as F

    from planner.export.dtensor import ATTENTION_RECOMPUTED

    g = torch.Generator().manual_seed(3)
    losses, again = [], []
    for _ in range(STEPS):
        target = torch.randint(0, 64, (4, 16), generator=g)
        out = net(*step((TOKENS,)))
        logits = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        before = ATTENTION_RECOMPUTED[0]
        loss.backward()
        again.append(ATTENTION_RECOMPUTED[0] - before)
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(float(loss.detach()))
    return losses, again


def _selective_worker(rank: int, world: int, tmp: str, cases: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        for case, (data, _) in cases.items():
            strategy = strategy_from_json(data)
            net = MODELS[SELECTIVE]().double()
            exported = planner.parallelize(strategy, net, recompute="selective")
            losses, again = _train_counting(net, lambda a, e=exported: e.distribute_inputs(*a))
            ref = MODELS[SELECTIVE]().double()
            ref_losses = _train(ref, lambda a: a, STEPS)
            report[case] = {"deviation": _deviation(net, ref, losses, ref_losses), "again": again}
        # attention written as tensor code has no kernel call to checkpoint: one clear error
        data, _ = strategies(NAME)["data"]
        ones = MODELS[NAME]().double()
        exported = planner.parallelize(strategy_from_json(data), ones, recompute="selective")
        try:
            ones(*exported.distribute_inputs(TOKENS))
        except ExportError as exc:
            report["refused"] = str(exc)
    if rank == 0:
        Path(tmp, "report.json").write_text(json.dumps(report))


def test_selective_recomputation_trains_like_without_on_gloo(tmp_path: Path) -> None:
    world = 2
    cases = {k: v for k, v in strategies(SELECTIVE).items() if k in ("data", "megatron")}
    codes = run_workers(_selective_worker, world, world, str(tmp_path), cases, timeout=150)
    assert codes == [0] * world
    report = json.loads((tmp_path / "report.json").read_text())
    for case in cases:
        r = report[case]
        assert r["deviation"] < _tolerance(SELECTIVE, case), (case, r)  # (float32 RMSNorm)
        # each step's backward runs both blocks' attention kernels again
        assert r["again"] == [2] * STEPS, (case, r)
    assert "'transformer.h.0.attn''s forward does not call" in report["refused"], report
    assert "recompute='full' or 'none'" in report["refused"]
