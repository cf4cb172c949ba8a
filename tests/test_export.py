"""DTensor export: which configs map to which placements, and a numerical check on gloo.

The distributed test starts 2 worker processes (gloo, CPU, one thread each, FileStore
rendezvous), parallelizes a user CNN with `planner.parallelize` under several strategies and
trains it 2 SGD steps in float64 beside single-process training of the same module.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from budget import time_budget
from user_models import SmallCNN
from workers import run_workers

import planner
from planner.export import ExportError, export_plan
from planner.graph.opkinds import CHANNEL, HEIGHT
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, owt, split_along
from planner.problems.strategy import Strategy, strategy_from_json

IMAGES = (torch.randn(8, 3, 16, 16),)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(120):
        yield


@pytest.fixture(scope="module")
def graph() -> Any:
    return planner.plan(SmallCNN(), "cpu-local-2", example_inputs=IMAGES).problem.dnn().graph


def with_config(strategy: Strategy, name: str, dim: str, devices: list[int]) -> Strategy:
    configs = list(strategy.configs)
    i = strategy.graph.index(name)
    configs[i] = split_along(strategy.graph.ops[i], dim, devices)
    return Strategy(strategy.graph, strategy.devices, tuple(configs))


def test_sample_splits_are_data_parallel(graph: Any) -> None:
    plan = export_plan(data_parallel(graph, get_preset("cpu-local-2")), SmallCNN())
    assert plan.inputs == "shard" and not plan.fell_back
    assert dict(plan.modules) == {m: "data" for m in ("conv1", "bn1", "conv2", "fc1", "fc2")}


def test_channel_split_linears_are_colwise(graph: Any) -> None:
    plan = export_plan(owt(graph, get_preset("cpu-local-2")), SmallCNN())
    modules = dict(plan.modules)
    assert modules["fc1"] == "colwise" and modules["conv1"] == "data" and not plan.fell_back
    assert modules["fc2"] == "data"  # 5 classes: owt splits fc2's samples


@pytest.mark.parametrize(
    "op, dim, devices, says",
    [
        ("conv1", HEIGHT, [0, 1], "a height split"),
        ("conv2", CHANNEL, [0, 1], "output-channel split of a convolution"),
        ("fc1", CHANNEL, [1, 0], "not on the whole mesh in order"),
        ("fc2", CHANNEL, [1], "placed on devices [1]"),
    ],
)
def test_what_dtensor_cannot_express_is_one_error(
    graph: Any, op: str, dim: str, devices: list[int], says: str
) -> None:
    strategy = with_config(data_parallel(graph, get_preset("cpu-local-2")), op, dim, devices)
    with pytest.raises(ExportError, match="fallback='replicate'") as info:
        export_plan(strategy, SmallCNN())
    assert f"{op} (" in str(info.value) and says in str(info.value)
    plan = export_plan(strategy, SmallCNN(), fallback="replicate")
    assert [o.op for o in plan.fell_back] == [op]
    assert dict(plan.modules)[op] == "replicate"


def test_a_module_that_is_not_the_strategys_is_refused(graph: Any) -> None:
    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)

    with pytest.raises(ExportError, match="does not come from this module"):
        export_plan(data_parallel(graph, get_preset("cpu-local-2")), Other())
    with pytest.raises(ExportError, match="fallback must be"):
        export_plan(data_parallel(graph, get_preset("cpu-local-2")), SmallCNN(), "guess")


def test_parallelize_needs_a_process_group(graph: Any) -> None:
    with pytest.raises(ExportError, match="initialized process group"):
        planner.parallelize(data_parallel(graph, get_preset("cpu-local-2")), SmallCNN())


def test_the_process_group_ends_with_a_barrier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank that destroys the group while a peer's collectives are in flight can make gloo
    abort at exit: `process_group` waits for every rank first (not after an exception)."""
    import torch.distributed as dist

    calls: list[str] = []

    def recorded(name: str) -> Any:
        real = getattr(dist, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    for name in ("barrier", "destroy_process_group"):
        monkeypatch.setattr(dist, name, recorded(name))

    def alone(name: str) -> Any:  # a world of one rank
        return planner.process_group(
            "gloo", store=dist.FileStore(str(tmp_path / name), 1), rank=0, world_size=1
        )

    with alone("a"):
        assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert not dist.is_initialized() and calls == ["barrier", "destroy_process_group"]
    calls.clear()
    with pytest.raises(RuntimeError, match="a failed step"), alone("b"):
        raise RuntimeError("a failed step")
    assert not dist.is_initialized() and calls == ["destroy_process_group"]


# -- on gloo, world 2: the same numbers as single-process training ---------------------------


def _train(
    module: torch.nn.Module, inputs: Any, target: torch.Tensor, step: Any, steps: int = 2
) -> list[float]:
    losses = []
    for _ in range(steps):
        out = module(*step(inputs))
        logp = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = F.nll_loss(logp, target)
        loss.backward()
        with torch.no_grad():
            for p in module.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(float(loss.detach()))
    return losses


def _worker(rank: int, world: int, tmp: str, cases: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 3, 16, 16, generator=g, dtype=torch.float64)
        target = torch.randint(0, 5, (8,), generator=g)
        for name, (data, fallback) in cases.items():
            torch.manual_seed(0)
            net = SmallCNN().double()
            ref = copy.deepcopy(net)
            exported = planner.parallelize(strategy_from_json(data), net, fallback=fallback)
            losses = _train(net, (x,), target, lambda a, e=exported: e.distribute_inputs(*a))
            ref_losses = _train(ref, (x,), target, lambda a: a)
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
            for p, q in zip(net.parameters(), ref.parameters(), strict=True):
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                diff = float((full.detach() - q.detach()).abs().max())
                worst = max(worst, diff / float(q.detach().abs().max()))
            report[name] = {
                "deviation": worst,
                "fell_back": [o.op for o in exported.fell_back],
                "modules": dict(exported.plan.modules),
            }
    if rank == 0:
        Path(tmp, "report.json").write_text(json.dumps(report))


def test_parallelized_training_equals_single_process_on_gloo(graph: Any, tmp_path: Path) -> None:
    # owt: data-parallel convs and fc2, a colwise fc1 (Shard(-1) -> Shard(0) before fc2);
    # then a height split that falls back to replication. Two cases keep it quick: most of
    # the time is DTensor's first use in each worker.
    cpus = get_preset("cpu-local-2")
    cases = {
        "owt (colwise linears)": (owt(graph, cpus).to_json(), "error"),
        "height split, replicated": (
            with_config(data_parallel(graph, cpus), "conv1", HEIGHT, [0, 1]).to_json(),
            "replicate",
        ),
    }
    assert run_workers(_worker, 2, 2, str(tmp_path), cases, timeout=100) == [0, 0]
    report = json.loads((tmp_path / "report.json").read_text())
    for name, r in report.items():
        assert r["deviation"] < 1e-12, (name, r)
    assert report["owt (colwise linears)"]["modules"]["fc1"] == "colwise"
    assert report["height split, replicated"]["fell_back"] == ["conv1"]


@pytest.mark.slow
def test_the_dtensor_script_of_docs_runtime_md_runs_under_torchrun(
    graph: Any, tmp_path: Path
) -> None:
    """The script as written (with a `batches()` and a `mymodels`), 2 processes, a plan with
    colwise linears: it trains and exits cleanly on both ranks."""
    text = (ROOT / "docs" / "runtime.md").read_text()
    script = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "train_dtensor" in b)
    (tmp_path / "mymodels.py").write_text("from user_models import SmallCNN as make_net\n")
    (tmp_path / "train_dtensor.py").write_text(
        "import torch\n\n\ndef batches():\n"
        "    for _ in range(2):\n"
        "        yield torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))\n\n\n" + script
    )
    owt(graph, get_preset("cpu-local-2")).save(tmp_path / "plan.json")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (tmp_path, tests, ROOT)))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "train_dtensor.py", "plan.json"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr
