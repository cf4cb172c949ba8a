"""docs/strategy.schema.json describes the plan files layerwise writes (checked with a small
validator for the subset of JSON Schema it uses: tests/schema_subset.py)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from schema_subset import errors
from user_models import SmallCNN

import planner
from backends import Limit, Status
from planner.cli import main
from planner.costs.costmodel import CostOptions
from planner.graph.models import DTYPE_NAMES
from planner.hardware.presets import get_preset
from planner.problems.baselines import owt

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "strategy.schema.json").read_text())


@pytest.fixture(scope="module")
def plan_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    d = tmp_path_factory.mktemp("plans")
    assert main(["plan", "lenet5", "--batch", "8", "--devices", "p100-1x2", "--backend",
                 "elimination", "-o", str(d / "zoo.json")]) == 0  # fmt: skip
    assert main(["plan", "lenet5", "--batch", "8", "--devices", "p100-1x2", "--optimizer",
                 "adam", "--master-weights", "--zero", "auto", "--headroom", "0.1",
                 "-o", str(d / "memory.json")]) == 0  # fmt: skip
    images = (torch.randn(8, 3, 16, 16),)
    factory = planner.plan("user_models:make_cnn", "cpu-local-2", example_inputs=images)
    factory.save(d / "factory.json")
    instance = planner.plan(SmallCNN(), "p100-1x4", objective="makespan", backend="baselines",
                            example_inputs=images)  # fmt: skip
    stopped = dataclasses.replace(instance.result, limit=Limit.INTERRUPTED, status=Status.FEASIBLE)
    interrupted = dataclasses.replace(instance, result=stopped)
    interrupted.save(d / "interrupted.json")
    graph = factory.problem.dnn().graph
    assert graph is not None
    owt(graph, get_preset("cpu-local-2")).save(d / "bare.json")  # Strategy.save: no plan head
    from planner.graph.zoo import model_graph
    from planner.pipeline.layouts import pipelined
    from planner.pipeline.spec import micro_batch_graph

    gpt = micro_batch_graph(model_graph("gpt2", batch=4, seq=16, n_layer=2, n_head=2, n_embd=32,
                                        vocab_size=128), 2)  # fmt: skip
    pipelined(gpt, get_preset("p100-1x2"), 2, 2, owt).save(d / "pipelined.json")
    assert main(["plan", "gpt2", "--set", "batch=8", "--set", "n_layer=2", "--set", "n_embd=64",
                 "--set", "n_head=2", "--set", "seq=32", "--devices", "p100-1x2", "--pipeline",
                 "on", "-o", str(d / "planned.json")]) == 0  # fmt: skip
    return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")}


def test_every_plan_file_matches_the_schema(plan_files: dict[str, dict[str, Any]]) -> None:
    assert set(plan_files) == {
        "zoo",
        "factory",
        "interrupted",
        "bare",
        "memory",
        "pipelined",
        "planned",
    }
    for name, data in plan_files.items():
        assert list(errors(data, SCHEMA)) == [], name
    assert plan_files["interrupted"]["limit"] == "INTERRUPTED"
    assert plan_files["pipelined"]["pipeline"]["micro_batches"] == 2
    planned = plan_files["planned"]
    assert planned["backend"] == "pipeline" and planned["layout"]["stages"] >= 1
    assert planned["pipeline"]["micro_batches"] == planned["layout"]["micro_batches"]
    assert plan_files["factory"]["graph"]["model"]["factory"] == "user_models:make_cnn"
    memory = plan_files["memory"]
    assert memory["zero"] == {"chose": 0, "tried": []}
    assert {k: memory["cost"][k] for k in ("optimizer", "master_weights", "zero", "headroom")} == {
        "optimizer": "adam", "master_weights": True, "zero": 0, "headroom": 0.1}  # fmt: skip


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda d: d.update(status="DONE"), "is not one of"),
        (lambda d: d.pop("configs"), "missing 'configs'"),
        (lambda d: d["configs"]["fc1"].update(devices=[]), "fewer than 1 items"),
        (lambda d: d["configs"]["fc1"].update(degrees={"channel": 0}), "0 < 1"),
        (lambda d: d["graph"]["model"].update(factory="no_colon"), "matches 0 of the oneOf"),
        (lambda d: d["graph"].update(fingerprint="xyz"), "does not match"),
        (lambda d: d.update(gap="Infinity"), "expected number or null"),
    ],
)
def test_the_schema_rejects_broken_files(
    plan_files: dict[str, dict[str, Any]], change: Any, says: str
) -> None:
    data = copy.deepcopy(plan_files["factory"])
    change(data)
    found = list(errors(data, SCHEMA))
    assert any(says in e for e in found), found


def test_the_schema_lists_what_the_code_writes() -> None:
    props = SCHEMA["properties"]
    assert set(props["status"]["enum"]) == {s.value for s in Status}
    assert set(props["limit"]["enum"]) == {x.value for x in Limit} | {None}
    inputs = SCHEMA["$defs"]["factory_model"]["properties"]["inputs"]["items"]
    assert tuple(inputs["properties"]["dtype"]["enum"]) == DTYPE_NAMES
    cost = set(SCHEMA["$defs"]["cost"]["properties"])
    assert {f.name for f in dataclasses.fields(CostOptions)} | {"source"} == cost
    from planner.plans import DEVICE_KEYS, MEMORY_KEYS, PHASES

    written = {"auto", "recommendation", "zero", "recompute", "memory_fallback", "layout"}
    assert {*PHASES, *MEMORY_KEYS, *DEVICE_KEYS, *written} <= set(props)
    assert {"margin", "not_fitting"} <= set(props["recommendation"]["properties"])
