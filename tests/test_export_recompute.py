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
from test_export_llm import MODELS, _train, budget, strategies  # noqa: F401 (budget: autouse)
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
