"""How a model trains (`planner.graph.precision`, `planner.plan(precision=...)`): Lightning's precision names rewrite the
captured graph's dtypes, and the cost model prices what they say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import planner
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel
from planner.errors import LayerwiseError
from planner.graph.models import ModelSpec
from planner.graph.precision import PRECISIONS, check_precision, with_precision
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset

SMALL = {"seq": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 64}


@pytest.fixture(scope="module")
def gpt() -> planner.OpGraph:
    return model_graph("gpt2", batch=2, **SMALL)


def test_bf16_mixed_is_autocast_over_fp32_weights(gpt: planner.OpGraph) -> None:
    mixed = with_precision(gpt, "bf16-mixed")
    kinds = {op.kind for op in mixed.ops}
    assert {"linear", "attention", "norm", "elementwise", "embedding"} <= kinds
    for op in mixed.ops:
        assert all(p.dtype_bytes == 4 for p in op.params), op.name
        if op.kind in ("linear", "attention"):
            assert op.output.dtype_bytes == 2, op.name
        elif op.kind in ("norm", "softmax", "embedding"):
            assert op.output.dtype_bytes == 4, op.name
    # the residual stream: an fp32 embedding plus bf16 projections stays fp32
    adds = [op for op in mixed.ops if op.kind == "elementwise" and len(op.inputs) == 2]
    assert adds and all(op.output.dtype_bytes == 4 for op in adds)
    # shapes, FLOPs and names are kept
    assert [(o.name, o.output.shape, o.flops) for o in mixed.ops] == [
        (o.name, o.output.shape, o.flops) for o in gpt.ops
    ]


@pytest.mark.parametrize("name, nbytes", [("bf16-true", 2), ("16-true", 2), ("64-true", 8)])
def test_true_precisions_convert_everything(gpt: planner.OpGraph, name: str, nbytes: int) -> None:
    graph = with_precision(gpt, name)
    for op in graph.ops:
        if op.kind != "input":
            assert op.output.dtype_bytes == nbytes, op.name
        assert all(p.dtype_bytes == nbytes for p in op.params), op.name


@pytest.mark.parametrize("name", PRECISIONS)
def test_rewrite_is_idempotent(gpt: planner.OpGraph, name: str) -> None:
    once = with_precision(gpt, name)
    assert with_precision(once, name).fingerprint() == once.fingerprint()


def test_mem_bytes_scale_with_the_bytes_moved(gpt: planner.OpGraph) -> None:
    true = with_precision(gpt, "bf16-true")
    data = {op.name for op in gpt.ops if op.kind == "input"}  # token ids keep their dtype
    pairs = zip(gpt.ops, true.ops, strict=True)
    moved = [(a, b) for a, b in pairs if a.mem_bytes and not data & {a.name, *a.inputs}]
    assert len(moved) > 10
    for before, after in moved:
        assert after.mem_bytes == pytest.approx(before.mem_bytes / 2), before.name


def test_mixed_linears_compute_at_the_16_bit_peak(gpt: planner.OpGraph) -> None:
    """On an A100 (312 TFLOP/s bf16, 19.5 FP32) a compute-bound linear's time falls 16x."""
    devices = get_preset("dgx-a100-1")
    fp32, mixed = CostModel(gpt, devices), CostModel(with_precision(gpt, "bf16-mixed"), devices)
    i = next(k for k, op in enumerate(gpt.ops) if op.name.endswith("mlp.c_fc"))
    one = ParallelConfig((1,) * len(gpt.ops[i].output.dims), (0,))
    rate = devices.devices[0].peak16 / devices.devices[0].flops
    assert mixed.compute_rate(mixed.graph.ops[i])[0] / fp32.compute_rate(gpt.ops[i])[0] == rate
    assert mixed.compute_time(i, one) < fp32.compute_time(i, one)


def test_names_and_refusals() -> None:
    assert check_precision("bf16") == "bf16-mixed"
    assert check_precision(32) == "32-true"
    assert check_precision(None) is None
    with pytest.raises(LayerwiseError, match="precision must be one of"):
        check_precision("fp8-mixed")
    with pytest.raises(LayerwiseError, match="precision must be one of"):
        planner.plan("lenet5", "p100-1x2", precision="half")


def test_plan_records_the_precision_and_rebuilds_the_same_graph(tmp_path: Path) -> None:
    """The plan file records the precision with the model, so `runtime.run` (which
    recaptures the model from the file) finds the graph that was planned."""
    result = planner.plan(
        "gpt2", "p100-1x2", model_kwargs={"batch": 2, **SMALL}, precision="bf16-mixed",
        backend="elimination", pipeline=False,
    )  # fmt: skip
    graph = result.strategy.graph
    assert {op.output.dtype_bytes for op in graph.ops if op.kind == "linear"} == {2}
    path = tmp_path / "plan.json"
    result.save(path)
    model = json.loads(path.read_text())["graph"]["model"]
    assert model["precision"] == "bf16-mixed"
    spec = ModelSpec.from_json(model)
    assert spec is not None and spec.graph().fingerprint() == graph.fingerprint()
    plain = planner.plan(
        "gpt2", "p100-1x2", model_kwargs={"batch": 2, **SMALL}, backend="elimination",
        pipeline=False,
    )  # fmt: skip
    assert result.objective < plain.objective  # P100: 21.2 TFLOP/s fp16 against 10.6 fp32
