"""ZeRO in the DTensor export (`parallelize(..., zero=)`): a GPT-2 (Adam) and a CNN with batch
norm (SGD with momentum), sharded by FSDP2 (stages 2, 3) or trained by the
ZeroRedundancyOptimizer of `Exported.optimizer` (stage 1) on gloo (data parallel and
Megatron's column/row pairing at world 2, Megatron on a (2, 2) mesh at world 4), train like
single-process training in float64 and really shard: the parameters' local parts between the
steps and from the forward to the backward, the optimizer state per rank."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from budget import time_budget
from test_export_llm import megatron
from user_models import SmallCNN
from workers import run_workers

import planner
from planner.export import ExportError, export_plan
from planner.graph.llm import build_llm
from planner.graph.opkinds import HEIGHT, LENGTH
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, split_along
from planner.problems.strategy import Strategy, strategy_from_json

TOKENS = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
IMAGES = (torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)
STEPS = 2
TOLERANCE = 1e-9


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(150):
        yield


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    module, _ = build_llm("gpt2", device="cpu", n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                          block_size=16, dropout=0.0, batch=4, seq=16)  # fmt: skip
    return module


@functools.cache  # one plan per model and world (callers read, never change, the dict)
def strategies(world: int) -> dict[str, tuple[dict[str, Any], tuple[int, ...], str]]:
    """Data parallelism and Megatron's pairing: on a 1-D mesh at world 2, (2, 2) at world 4."""
    result = planner.plan(gpt2(), "cpu-local-2", example_inputs=(TOKENS,), backend="baselines")
    dp = data_parallel(result.problem.dnn().graph, get_preset(f"cpu-local-{world}"))
    if world == 4:
        return {"gpt2 megatron-2x2": (megatron(dp, data=2).to_json(), (2, 2), "error")}
    return {"gpt2 data": (dp.to_json(), (2,), "error"),
            "gpt2 megatron": (megatron(dp).to_json(), (2,), "error")}  # fmt: skip


def test_the_plan_shards_each_module_over_the_dims_that_replicate_it() -> None:
    module = gpt2()
    data, _, _ = strategies(2)["gpt2 data"]
    plan = export_plan(strategy_from_json(data), module, zero=3)
    assert plan.zero == 3 and plan.sharded == tuple((p, (0,)) for p, _ in plan.modules)
    assert export_plan(strategy_from_json(data), module).sharded == ()
    tensor_parallel = strategy_from_json(strategies(2)["gpt2 megatron"][0])
    one_d = dict(export_plan(tensor_parallel, module, zero=2).sharded)
    assert "transformer.h.0.attn.c_attn" not in one_d  # a 1-D tensor-parallel shard: no replicas
    assert one_d["transformer.h.0.ln_1"] == (0,)
    two_d = export_plan(strategy_from_json(strategies(4)["gpt2 megatron-2x2"][0]), module,
                        mesh_shape=(2, 2), zero=1)  # fmt: skip
    sharded = dict(two_d.sharded)
    assert sharded["transformer.h.0.attn.c_attn"] == (0,)  # over the data dim
    assert sharded["transformer.h.0.mlp.c_proj"] == (0,)
    assert sharded["transformer.h.0.ln_1"] == (0, 1)  # data parallel over the whole mesh
    assert "ZeRO-1 over mesh dims (0, 1)" in " ".join(two_d.describe())
    for bad in (4, -1, True, "3"):
        with pytest.raises(ExportError, match="zero must be a ZeRO stage 0, 1, 2 or 3"):
            export_plan(strategy_from_json(data), module, zero=bad)  # type: ignore[arg-type]


def test_a_replicated_fallback_is_sharded_too() -> None:
    """A module that falls back to replication has data-parallel replicas like any other."""
    module = gpt2()
    dp = strategy_from_json(strategies(2)["gpt2 data"][0])
    configs = list(dp.configs)
    i = dp.graph.index("transformer.ln_f")
    configs[i] = split_along(dp.graph.ops[i], LENGTH, [0, 1])
    strategy = Strategy(dp.graph, dp.devices, tuple(configs))
    for zero in (1, 2, 3):
        plan = export_plan(strategy, module, fallback="replicate", zero=zero)
        assert [o.op for o in plan.fell_back] == ["transformer.ln_f"]
        assert dict(plan.sharded)["transformer.ln_f"] == (0,)


# -- on gloo: the same numbers as single-process training, and the parts really sharded ---------


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return SmallCNN()


@functools.cache  # one plan (callers read, never change, the dict)
def cnn_strategies() -> dict[str, tuple[dict[str, Any], tuple[int, ...], str]]:
    """Data parallel (batch norm: DTensor computes it on the whole batch, so its gradients are
    whole on every rank), and a height split that falls back to replication."""
    result = planner.plan(cnn(), "cpu-local-2", example_inputs=IMAGES, backend="baselines")
    dp = data_parallel(result.problem.dnn().graph, get_preset("cpu-local-2"))
    configs = list(dp.configs)
    i = dp.graph.index("conv1")
    configs[i] = split_along(dp.graph.ops[i], HEIGHT, [0, 1])
    height = Strategy(dp.graph, dp.devices, tuple(configs))
    return {"cnn data": (dp.to_json(), (2,), "error"),
            "cnn height replicated": (height.to_json(), (2,), "replicate")}  # fmt: skip


MODELS: dict[str, Any] = {"gpt2": gpt2, "cnn": cnn}


def _batches(model: str) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    if model == "gpt2":
        return [((TOKENS,), torch.randint(0, 64, (4, 16), generator=g)) for _ in range(STEPS)]
    images = (IMAGES[0].double(),)
    return [(images, torch.randint(0, 5, (8,), generator=g)) for _ in range(STEPS)]


def _optimizer(model: str) -> tuple[Any, dict[str, Any]]:
    """Adam for the GPT-2; SGD with momentum for the CNN, whose first convolution's bias
    feeds a batch norm (its true gradient is 0): Adam would scale its rounding noise to
    steps of the learning rate."""
    if model == "gpt2":
        return torch.optim.Adam, {"lr": 0.01}
    return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}


def _train(
    model: str, net: Any, optimizer: Any, exported: Any = None, probe: Any = None
) -> list[float]:
    """STEPS steps of `net`, parallelized by `exported` (None: a single process)."""
    losses = []
    for inputs, target in _batches(model):
        out = net(*(exported.distribute_inputs(*inputs) if exported else inputs))
        if probe is not None:
            probe()  # between the forward and the backward
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        if model == "gpt2":
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        else:
            loss = F.nll_loss(out, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _deviation(net: Any, ref: Any, losses: list[float], ref_losses: list[float]) -> float:
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    params = {n: _full(q) for n, q in ref.named_parameters()}
    for n, p in net.named_parameters():
        full, q = _full(p), params[n]
        worst = max(worst, float((full - q).abs().max() / q.abs().max()))
    return worst


def _full(p: Any) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _local_shapes(net: Any) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.to_local().shape) for n, p in net.named_parameters()}


def _shrunk(plan: Any, net: Any, unsharded: dict[str, tuple[int, ...]], mesh: Any) -> bool:
    """Does every parameter of `plan.sharded`'s modules keep at most its rank's chunk of rows
    (dim 0: FSDP's sharding) of its unsharded local part, over the r ranks of the dims it is
    sharded over (rows >= 2, r = 2 or 4 here: less than the whole), every other parameter
    the whole?"""
    dims = dict(plan.sharded)
    owner = {}
    for path, sub in net.named_modules():
        for key, _ in sub.named_parameters(recurse=False):
            owner[f"{path}.{key}" if path else key] = path
    for name, shape in _local_shapes(net).items():
        r = math.prod(mesh.size(d) for d in dims.get(owner[name], ()))
        rows, *rest = unsharded[name]
        size, whole = math.prod(shape), rows * math.prod(rest)
        if r == 1 and size != whole:
            return False
        if r > 1 and (size > math.ceil(rows / r) * math.prod(rest) or size == whole):
            return False
    return True


def _attention_calls(net: Any) -> list[int]:
    """Forwards of the first block's attention (again in the backward if it recomputes)."""
    calls = [0]
    if hasattr(net, "transformer"):
        attention = net.get_submodule("transformer.h.0.attn")
        attention.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _worker(
    rank: int, world: int, tmp: str, cases: dict[str, Any], stages: list[int], recompute: str
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        for case, (data, shape, fallback) in cases.items():
            model = case.split()[0]
            strategy, cls, options = strategy_from_json(data), *_optimizer(model)
            ref = MODELS[model]().double()
            ref_losses = _train(model, ref, cls(ref.parameters(), **options))
            plain = planner.parallelize(strategy, MODELS[model]().double(), fallback=fallback,
                                        mesh_shape=shape)  # fmt: skip
            unsharded = _local_shapes(plain.module)
            optimizer = plain.optimizer(cls, **options)
            plain_losses = _train(model, plain.module, optimizer, plain)
            for zero in stages:
                net = MODELS[model]().double()
                exported = planner.parallelize(strategy, net, fallback=fallback,
                                               mesh_shape=shape, zero=zero, recompute=recompute)  # fmt: skip
                refused = ""
                if zero == 1:  # the state is sharded by the optimizer only: it must be made
                    with pytest.raises(ExportError, match="exported.optimizer") as info:
                        _train(model, net, cls(net.parameters(), **options), exported)
                    refused = str(info.value)
                optimizer = exported.optimizer(cls, **options)
                calls = _attention_calls(net)
                during: list[bool] = []

                def probe(e: Any = exported, seen: list[bool] = during, u: Any = unsharded) -> None:
                    seen.append(_shrunk(e.plan, e.module, u, e.mesh))

                losses = _train(model, net, optimizer, exported, probe)
                states = [0] * world
                if zero == 1:  # a plain optimizer's state: on every rank
                    count = getattr(optimizer, "state_count", lambda o=optimizer: len(o.state))
                    dist.all_gather_object(states, count())
                report[f"{case} zero {zero}"] = {
                    "deviation": _deviation(net, ref, losses, ref_losses),
                    "from stage 0": _deviation(net, plain.module, losses, plain_losses),
                    "sharded between steps": _shrunk(exported.plan, net, unsharded, exported.mesh),
                    "sharded during forward": all(during),
                    "states per rank": states,
                    "params": len(list(net.parameters())),
                    "modules sharded": len(exported.plan.sharded),
                    "fell back": [o.op for o in exported.fell_back],
                    "checkpointed": len(exported.plan.checkpointed),
                    "attention forwards": calls[0],
                    "refused": refused,
                }
    if rank == 0:
        Path(tmp, "report.json").write_text(json.dumps(report))


def _launch(
    world: int, tmp_path: Path, cases: dict[str, Any], stages: list[int], recompute: str = "none"
) -> dict[str, Any]:
    args = (world, str(tmp_path), cases, stages, recompute)
    assert run_workers(_worker, world, *args, timeout=120) == [0] * world
    report: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == len(cases) * len(stages)
    return report


def _check(report: dict[str, Any]) -> None:
    for case, r in report.items():
        zero = int(case.rsplit(" ", 1)[-1])
        assert r["deviation"] < TOLERANCE and r["from stage 0"] < TOLERANCE, (case, r)
        assert r["modules sharded"] > 0, (case, r)
        # stages 2-3 shard the parameters between steps; 3 also from forward to backward
        assert r["sharded between steps"] == (zero >= 2), (case, r)
        assert r["sharded during forward"] == (zero == 3), (case, r)
        if zero == 1:  # each rank keeps part of the optimizer state
            assert "ZeRO stage 1" in r["refused"], (case, r)  # without exported.optimizer
            assert max(r["states per rank"]) < r["params"], (case, r)
            if "megatron" not in case:  # every parameter's state on exactly one rank
                assert sum(r["states per rank"]) == r["params"], (case, r)


# The default run: stage 1 (the optimizer's sharding) and 3 (FSDP2); stage 2 differs from 3
# only by keeping the weights gathered after the forward, and runs by default on the CNN below.
@pytest.mark.parametrize(
    "stages", [[1, 3], pytest.param([2], marks=pytest.mark.slow)], ids=["1-3", "2"]
)
def test_zero_stages_train_like_single_process_and_shard_on_gloo(
    stages: list[int], tmp_path: Path
) -> None:
    _check(_launch(2, tmp_path, strategies(2), stages))


@pytest.mark.slow  # world 4, 10-25 s; stage 3 at world 2 stays in the default run
@pytest.mark.parametrize("stages", [[3], [1, 2]])
def test_zero_with_megatron_on_a_two_by_two_mesh(stages: list[int], tmp_path: Path) -> None:
    """FSDP2 over the data dim of the DTensor mesh composed with the tensor-parallel styles
    over the other (the default run keeps stage 3: world 4 on 2 cores is time-sliced)."""
    _check(_launch(4, tmp_path, strategies(4), stages))


@pytest.mark.slow  # 5 s
def test_zero_composes_with_recomputation(tmp_path: Path) -> None:
    """FSDP2 units inside checkpointed blocks gather their weights again for the
    recomputation in the backward pass."""
    report = _launch(2, tmp_path, strategies(2), [3], recompute="full")
    _check(report)
    for case, r in report.items():
        assert r["checkpointed"] == 2 and r["attention forwards"] == 2 * STEPS, (case, r)


@pytest.mark.parametrize(  # stage 1 (the optimizer's sharding) runs by default on the GPT-2
    "stages", [[2, 3], pytest.param([1], marks=pytest.mark.slow)], ids=["2-3", "1"]
)
def test_batch_norm_and_a_replicated_fallback_are_sharded_right(
    stages: list[int], tmp_path: Path
) -> None:
    """Gradients that DTensor leaves whole on every rank (batch norm's; a module replicated
    instead of split) are summed once, not once per rank, by stages 2-3."""
    report = _launch(2, tmp_path, cnn_strategies(), stages)
    _check(report)
    for case, r in report.items():
        assert r["fell back"] == (["conv1"] if "replicated" in case else []), (case, r)
