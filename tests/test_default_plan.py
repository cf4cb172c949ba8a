"""The default plan (`planner.plan(model, devices)`, `python -m planner plan MODEL --devices
D`) works on every zoo model on every preset family with 1, 2 and 4 hosts (issue 42): the
pipeline search is tried first only for a stack of alike blocks (a transformer) across
hosts, and its refusal falls back to the per-op search.

Fast by default: every case's choice of search (`auto_search`) on the zoo's models at small
sizes; the whole default plan of every model on two P100 hosts (2 GPUs per host; the LLMs
whose small graph another LLM has are planned under slow), and of the small transformer on
one, two and four; the other hosts' and families' whole plans and the full-size LLMs'
choice are marked slow."""

from __future__ import annotations

import logging
import re
from functools import cache

import pytest
from zoo_sizes import LLMS, SMALL

import planner
import planner.pipelined
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import list_models, model_graph
from planner.hardware.presets import get_preset, list_presets
from planner.pipeline.spec import PipelineError

MODELS = list_models()
TRANSFORMERS = {"transformer", *LLMS}  # stacks of alike blocks
HOSTS = (1, 2, 4)
# family -> its preset of h hosts (None: the family has one host only)
FAMILIES = {
    "p100": lambda h: f"p100-{h}x2",
    "k80": lambda h: f"k80-{h}x2",
    "v100-dgx1": lambda h: "v100-dgx1-8" if h == 1 else None,
    "dgx-a100": lambda h: f"dgx-a100-{h}",
    "dgx-a100-80g": lambda h: f"dgx-a100-80g-{h}",
    "dgx-h100": lambda h: f"dgx-h100-{h}",
    "dgx-h200": lambda h: f"dgx-h200-{h}",
    "hgx-h800": lambda h: f"hgx-h800-{h}",
    "cpu-local": lambda h: "cpu-local-2" if h == 1 else None,
}
FAST_FAMILY = "p100"
SIZES = {name: {"batch": 8, **SMALL.get(name, {})} for name in MODELS}
CASES = [
    (model, family, hosts)
    for model in MODELS
    for family, preset in FAMILIES.items()
    for hosts in HOSTS
    if preset(hosts) is not None
]


def _family(preset: str) -> str:
    return re.sub(r"-\d+(x\d+)?$", "", preset)


@cache
def small_graph(model: str) -> OpGraph:
    return model_graph(model, **SIZES[model])


def test_every_preset_family_is_covered() -> None:
    assert {_family(p) for p in list_presets()} == set(FAMILIES)
    for family, preset in FAMILIES.items():
        for hosts in HOSTS:
            name = preset(hosts)
            if name is not None:
                devices = get_preset(name)
                assert _family(name) == family
                assert len({d.host for d in devices.devices}) == hosts


@pytest.mark.parametrize("model,family,hosts", CASES)
def test_the_default_tries_pipelines_only_for_alike_blocks_across_hosts(
    model: str, family: str, hosts: int
) -> None:
    devices = get_preset(FAMILIES[family](hosts))
    want = planner.pipelined.PIPELINE if model in TRANSFORMERS and hosts > 1 else "per-op"
    assert planner.pipelined.auto_search(small_graph(model), devices) == want


# At the small sizes these LLMs capture to the graph of the one named beside them (checked
# below): their whole plans run under slow only.
SAME_SMALL_GRAPH = {
    "gpt2-medium": "gpt2",
    "gpt2-large": "gpt2",
    "gpt2-xl": "gpt2",
    "llama2-13b": "llama2-7b",
    "llama2-70b": "llama3-8b",
}


def test_the_llms_planned_only_under_slow_have_the_small_graph_of_one_planned_by_default() -> None:
    for model, twin in SAME_SMALL_GRAPH.items():
        assert _fast(twin, FAST_FAMILY, 2)
        ours, theirs = small_graph(model), small_graph(twin)
        assert [(op.kind, op.output, op.params) for op in ours.ops] == [
            (op.kind, op.output, op.params) for op in theirs.ops
        ], model


def _fast(model: str, family: str, hosts: int) -> bool:
    """The cases of the default run: every model of its own small graph on two P100 hosts
    (transformers pipelined, the others per op across hosts) and the small transformer on
    one and four hosts too."""
    if family != FAST_FAMILY or model in SAME_SMALL_GRAPH:
        return False
    return hosts == 2 or model == "transformer"


@pytest.mark.parametrize(
    "model,family,hosts",
    [pytest.param(*case, marks=() if _fast(*case) else pytest.mark.slow) for case in CASES],
)
def test_the_default_plan_works(model: str, family: str, hosts: int) -> None:
    devices = FAMILIES[family](hosts)
    out = planner.plan(model, devices, model_kwargs=SIZES[model], time_limit=60)
    assert out.has_solution, out.stats
    pipelined = isinstance(out, planner.PipelinePlan)
    assert pipelined == (model in TRANSFORMERS and hosts > 1)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(LLMS))
def test_the_full_size_llms_try_pipelines_across_hosts(model: str) -> None:
    graph = model_graph(model, batch=8)
    for hosts in HOSTS:
        devices = get_preset(f"dgx-a100-80g-{hosts}")
        want = planner.pipelined.PIPELINE if hosts > 1 else planner.pipelined.PER_OP
        assert planner.pipelined.auto_search(graph, devices) == want


def test_a_pipeline_refusal_falls_back_to_the_per_op_search(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise PipelineError("no pipeline layout of 'gpt2' fits (a test's refusal)")

    monkeypatch.setattr(planner.pipelined, "plan_pipeline_request", refuse)
    gpt = small_graph("gpt2")
    with caplog.at_level(logging.WARNING, logger="planner.pipeline"):
        out = planner.plan(gpt, "p100-2x2", recommend=False)
    assert isinstance(out, planner.PlanResult) and out.has_solution
    assert "a test's refusal" in out.stats["pipeline_refused"]
    said = [r.getMessage() for r in caplog.records if "planning per op instead" in r.getMessage()]
    assert len(said) == 1
    with pytest.raises(PipelineError, match="a test's refusal"):  # asked for: not masked
        planner.plan(gpt, "p100-2x2", pipeline=True)
