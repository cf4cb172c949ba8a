"""Per-task kernels (planner.costs.kernels) and the measured cost mode (planner.costs.profile)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from graphs import (
    attention_block,
    chain_cnn,
    conv2d,
    elementwise,
    inception,
    input_op,
    pool2d,
    softmax,
)
from zoo_sizes import GPT2_SMALL, LLAMA_SMALL

from planner.costs.config import ConfigSpace, ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.kernels import (
    plan_op,
    plan_task,
    random_inputs,
    random_params,
    run_task,
    shard_params,
    shared_batch_norm,
    task_fn,
)
from planner.costs.profile import MeasuredTimes, cache_path, profile_graph, task_key
from planner.errors import GraphError, LayerwiseError
from planner.graph.coarsen import coarsen
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.zoo import model_graph
from planner.hardware import load as machine
from planner.hardware.load import MachineBusyError
from planner.hardware.presets import get_preset


@pytest.fixture(autouse=True, scope="module")
def quiet_machine() -> Iterator[None]:
    """Profiling refuses a busy machine: these tests fake a quiet 2-core one (the timings
    themselves are only checked for being positive)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        mp.setattr(machine, "cores", lambda: 2)
        mp.delenv(machine.MAX_LOAD_ENV, raising=False)
        yield


# -- kernels: a task's output is the slice of the whole op's output ---------------------------


def _cfg(op: Op, **degrees: int) -> ParallelConfig:
    degs = tuple(degrees.get(d, 1) for d in op.output.dims)
    return ParallelConfig(degs, tuple(range(math.prod(degs))))


def _slices(box: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def check_task_slices(graph: OpGraph, name: str, **degrees: int) -> None:
    """Every task's output (on its input boxes and parameter shards) equals its box of the
    whole op's output computed with the same float64 data and weights."""
    i = graph.index(name)
    op = graph.ops[i]
    whole = plan_task(graph, i, _cfg(op), task=0)
    gen = torch.Generator().manual_seed(0)
    inputs = random_inputs(whole, torch.float64, gen)
    params = random_params(whole, torch.float64, gen)
    expected = run_task(whole, inputs, params)
    assert tuple(expected.shape) == op.output.sizes
    cfg = _cfg(op, **degrees)
    assert cfg.num_tasks > 1
    for t in range(cfg.num_tasks):
        plan = plan_task(graph, i, cfg, task=t)
        boxes = list(plan.in_boxes) + (
            [plan.in_boxes[1]] if len(inputs) > len(plan.in_boxes) else []
        )
        task_inputs = [x[_slices(b)] for x, b in zip(inputs, boxes, strict=True)]
        shards = shard_params(plan, params)
        assert [tuple(p.shape) for p in shards] == list(plan.param_shapes)
        out = run_task(plan, task_inputs, shards)
        torch.testing.assert_close(out, expected[_slices(plan.out_box)], rtol=1e-10, atol=1e-10)


def _conv_graph(
    kernel: int = 3, stride: int = 1, pad: int = 1, size: int = 12, groups: int = 1
) -> OpGraph:
    x = input_op("data", sample=4, channel=4, height=size, width=size)
    ho = wo = (size + 2 * pad - kernel) // stride + 1
    conv = Op(
        "conv",
        "conv2d",
        ("data",),
        Tensor.of(sample=4, channel=8, height=ho, width=wo),
        params=(Param("conv.weight", (8, 4 // groups, kernel, kernel)), Param("conv.bias", (8,))),
        attrs=Op.make_attrs(
            {
                "kernel": (kernel, kernel),
                "stride": (stride, stride),
                "padding": (pad, pad),
                "dilation": (1, 1),
                "groups": groups,
            }
        ),
    )
    return OpGraph("conv", (x, conv))


def test_conv_height_split_uses_halos_not_padding() -> None:
    g = chain_cnn()  # conv1: 3x3, padding 1, 16x16
    check_task_slices(g, "conv1", height=4)
    check_task_slices(g, "conv1", sample=2, height=2, width=2)
    plan = plan_task(g, g.index("conv1"), _cfg(g.op("conv1"), height=4), task=1)
    assert plan.in_boxes[0][2] == (3, 9)  # rows 4..7 need a one-row halo on each side
    assert plan.pads[0] == (1, 1, 0, 0)  # zero padding only on the left/right borders


@pytest.mark.parametrize("kernel,stride,pad,size", [(3, 2, 1, 12), (5, 1, 2, 12), (4, 3, 0, 13)])
def test_conv_strided_and_wide_windows_split_spatially(
    kernel: int, stride: int, pad: int, size: int
) -> None:
    g = _conv_graph(kernel, stride, pad, size)
    check_task_slices(g, "conv", height=2)
    check_task_slices(g, "conv", height=2, width=2)


def test_conv_channel_split_with_folded_batch_norm_and_relu() -> None:
    g = coarsen(chain_cnn())
    assert g.op("conv1").attr("norm") == "batch" and len(g.op("conv1").params) == 4
    check_task_slices(g, "conv1", channel=2)
    check_task_slices(g, "conv1", channel=4)
    check_task_slices(_conv_graph(), "conv", channel=2, sample=2)


def test_grouped_conv_channel_split_reads_its_groups() -> None:
    g = _conv_graph(groups=2)
    check_task_slices(g, "conv", channel=2)
    plan = plan_task(g, 1, _cfg(g.ops[1], channel=2), task=1)
    assert plan.compute_shapes()[0][1] == 2  # half the input channels


def test_linear_channel_split() -> None:
    check_task_slices(chain_cnn(), "fc", channel=2)  # reads the flatten op's (sample, channel)
    g = coarsen(chain_cnn())  # fc absorbed the flatten: reads the 4D tensor whole
    assert g.op("fc").attr("flatten")
    check_task_slices(g, "fc", channel=2)
    check_task_slices(g, "fc", channel=2, sample=2)


def test_pool_width_split() -> None:
    x = input_op("data", sample=2, channel=4, height=9, width=13)
    for mode in ("max", "avg"):
        p = pool2d("pool", x, kernel=3, stride=2, pad=1)
        p = replace(p, attrs=Op.make_attrs({**dict(p.attrs), "mode": mode}))
        g = OpGraph("pool", (x, p))
        check_task_slices(g, "pool", width=7)  # 7 output columns: one per task
        check_task_slices(g, "pool", width=7, channel=2)
    check_task_slices(chain_cnn(), "pool1", width=2, height=2)


def test_concat_channel_split() -> None:
    g = inception()  # branches of 8, 16, 8, 16 channels: some tasks straddle two inputs
    check_task_slices(g, "concat", channel=4)
    check_task_slices(g, "concat", channel=2, sample=2)


def test_attention_head_split() -> None:
    g = attention_block(heads=4)
    check_task_slices(g, "attn", channel=2)
    check_task_slices(g, "attn", channel=4, sample=2)
    causal = OpGraph(
        "causal",
        tuple(
            replace(op, attrs=Op.make_attrs({"heads": 4, "causal": True}))
            if op.name == "attn"
            else op
            for op in g.ops
        ),
    )
    check_task_slices(causal, "attn", channel=2)
    check_task_slices(causal, "attn", length=2, channel=2)  # masks at absolute positions


@cache
def _rnn(name: str) -> OpGraph:
    small: dict[str, Any] = {
        "rnntc": {"batch": 4, "steps": 2, "hidden": 8, "layers": 1, "vocab": 20},
        "nmt": {
            "batch": 4,
            "src_steps": 2,
            "tgt_steps": 2,
            "hidden": 8,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "src_vocab": 20,
            "tgt_vocab": 12,
        },
    }
    return model_graph(name, **small[name])


def test_lstm_channel_split() -> None:
    g = _rnn("rnntc")
    check_task_slices(g, "cells.0@0", channel=2)  # first step: no previous state
    check_task_slices(g, "cells.0@1", channel=2)  # reads (h, c) of the previous step
    check_task_slices(g, "cells.0@1", channel=4, sample=2)
    check_task_slices(g, "embed@1", channel=2, sample=2)  # selects one token column


def test_rnn_attention_and_norms_split() -> None:
    check_task_slices(_rnn("nmt"), "attention@1", channel=2, sample=2)
    bn = chain_cnn()
    check_task_slices(bn, "bn1", channel=4)  # batch statistics stay per channel


def test_unknown_kind_and_bad_input_raise_graph_error() -> None:
    x = Op("data", "input", (), Tensor.of(sample=2, channel=4))
    with pytest.raises(GraphError, match="unknown op kind 'mystery'|no kernel"):
        plan_op(Op("m", "mystery", ("data",), x.output), ParallelConfig((1, 1), (0,)))
    g = OpGraph("g", (x, softmax("loss", x)))
    with pytest.raises(GraphError, match="is an input"):
        run_task(plan_task(g, 0, ParallelConfig((1, 1), (0,))), [], [])


def test_task_fn_runs_forward_and_backward() -> None:
    g = chain_cnn()
    i = g.index("conv1")
    fn, leaves = task_fn(g, i, _cfg(g.ops[i], height=2))
    out = fn()
    assert tuple(out.shape) == (8, 8, 8, 16)
    out.sum().backward()
    # weight and bias: conv1 reads the graph's data, which gets no gradient
    assert len(leaves) == 2 and all(t.grad is not None for t in leaves)
    j = g.index("conv2")
    fn, leaves = task_fn(g, j, _cfg(g.ops[j], height=2))
    fn().sum().backward()
    assert len(leaves) == 3 and all(t.grad is not None for t in leaves)  # x, weight, bias
    assert plan_task(g, i, _cfg(g.ops[i])).data_inputs == (0,)
    assert plan_task(g, j, _cfg(g.ops[j])).data_inputs == ()


# -- measured costs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lenet_profile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("cache")
    graph = model_graph("lenet5", batch=4)
    devices = get_preset("cpu-local-2")
    calls: list[tuple[int, int, str]] = []
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAYERWISE_CACHE_DIR", str(cache_dir))
        path = profile_graph(
            graph, devices, repeats=2, progress=lambda d, t, label: calls.append((d, t, label))
        )
    assert torch.get_num_threads() == threads
    yield {"graph": graph, "devices": devices, "path": path, "calls": calls, "dir": cache_dir}


def test_profile_writes_the_cache_file(lenet_profile: dict[str, Any]) -> None:
    path: Path = lenet_profile["path"]
    assert path == lenet_profile["dir"] / "measured-cpu-1thread.json"
    data = json.loads(path.read_text())
    assert data["format"] == "layerwise.measured" and data["version"] == 2
    assert data["machine"]["threads"] == 1 and data["machine"]["torch"] == torch.__version__
    assert data["entries"] and all(s > 0 and run == 0 for s, run in data["entries"].values())
    (record,) = data["profiled"]
    assert record["graph"] == "lenet5" and record["measured"] == len(data["entries"])
    assert record["load"] == {"before": 0.0, "after": 0.0, "cores": 2, "per_core": 0.0}
    calls = lenet_profile["calls"]
    assert [c[0] for c in calls] == list(range(1, len(data["entries"]) + 1))
    assert calls[-1][1] == len(data["entries"])


def test_every_config_gets_a_measured_time(lenet_profile: dict[str, Any]) -> None:
    graph, devices = lenet_profile["graph"], lenet_profile["devices"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAYERWISE_CACHE_DIR", str(lenet_profile["dir"]))
        measured = MeasuredTimes.load(devices)
        assert measured.path == lenet_profile["path"] == cache_path("cpu-1thread")
    cm = CostModel(graph, devices, measured=measured)
    bound = CostModel(graph, devices, measured=measured.bind(graph))
    over = CostModel(graph, devices, CostOptions(task_overhead=1e-3), measured=measured)
    assert cm.source == "measured"
    space = ConfigSpace(graph, devices)
    for i, op in enumerate(graph.ops):
        for cfg in space[i].configs:
            if op.kind == "input":
                assert cm.compute_time(i, cfg) == 0.0
                continue
            t = measured.bind(graph).task_time(op, cfg)
            assert t is not None and t > 0, (op.name, cfg)
            assert cm.compute_time(i, cfg) == t == bound.compute_time(i, cfg)
            assert over.compute_time(i, cfg) == pytest.approx(t + 1e-3, rel=1e-12)
            assert measured.bind(graph).key(op, cfg) == task_key(graph, i, cfg)
            if all(graph.op(n).kind != "input" for n in op.inputs):  # else unknown as data
                assert measured.task_time(op, cfg) == t


def test_unprofiled_shapes_fall_back_to_analytic(lenet_profile: dict[str, Any]) -> None:
    devices = lenet_profile["devices"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAYERWISE_CACHE_DIR", str(lenet_profile["dir"]))
        measured = MeasuredTimes.load(devices)
    other = model_graph("lenet5", batch=6)  # another batch: other task shapes
    i = other.index("conv1")
    cfg = ParallelConfig((2, 1, 1, 1), (0, 1))
    assert measured.task_time(other.ops[i], cfg) is None
    assert CostModel(other, devices, measured=measured).compute_time(i, cfg) == CostModel(
        other, devices
    ).compute_time(i, cfg)


def test_identical_layers_share_keys() -> None:
    x = input_op("data", sample=8, channel=8, height=8, width=8)
    r = elementwise("relu", x)
    c1 = conv2d("conv1", r, 8)
    c2 = conv2d("conv2", c1, 8)
    g = OpGraph("twins", (x, r, c1, c2))
    a, b = g.index("conv1"), g.index("conv2")
    for degrees in [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (2, 2, 1, 1)]:
        cfg = ParallelConfig(degrees, tuple(range(math.prod(degrees))))
        moved = ParallelConfig(degrees, tuple(reversed(cfg.devices)))
        assert task_key(g, a, cfg) == task_key(g, b, cfg) == task_key(g, b, moved)
        assert "conv" not in task_key(g, a, cfg).replace("conv2d", "")
    whole = ParallelConfig((1, 1, 1, 1), (0,))
    halves = ParallelConfig((2, 1, 1, 1), (0, 1))
    assert task_key(g, a, whole) != task_key(g, a, halves)
    # half of a batch of 8 is the same task as a whole batch of 4
    small = input_op("data", sample=4, channel=8, height=8, width=8)
    act = elementwise("act", small)
    half = OpGraph("half", (small, act, conv2d("other", act, 8)))
    assert task_key(half, 2, whole) == task_key(g, a, halves)
    # reading the data (no input gradient) is another task
    direct = OpGraph("direct", (small, conv2d("other", small, 8)))
    assert task_key(direct, 1, whole) != task_key(half, 2, whole)


def test_profile_merges_and_skips_cached_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path))
    devices = get_preset("cpu-local-2")
    first = chain_cnn(sample=4)
    path = profile_graph(first, devices, repeats=1, max_configs=2)
    n = len(json.loads(path.read_text())["entries"])
    profile_graph(first, devices, repeats=1, max_configs=2)  # nothing new
    profile_graph(inception(), devices, repeats=1, max_configs=1)
    data = json.loads(path.read_text())
    assert [r["measured"] for r in data["profiled"]] == [n, 0, data["profiled"][2]["shapes"]]
    assert len(data["entries"]) == n + data["profiled"][2]["shapes"]


def test_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path))
    devices = get_preset("cpu-local-2")
    with pytest.raises(
        LayerwiseError, match="python -m planner profile MODEL --devices cpu-local-2"
    ):
        MeasuredTimes.load(devices)
    with pytest.raises(LayerwiseError, match="only this machine's CPU workers"):
        profile_graph(chain_cnn(), get_preset("p100-1x2"))
    with pytest.raises(LayerwiseError, match="repeats"):
        profile_graph(chain_cnn(), devices, repeats=0)
    (tmp_path / "measured-cpu-1thread.json").write_text('{"format": "other"}')
    with pytest.raises(LayerwiseError, match="not a measured-cost cache"):
        MeasuredTimes.load(devices)


def _loads(monkeypatch: pytest.MonkeyPatch, *loads: float) -> None:
    """The load average reads `loads` in turn, then the last one for ever."""
    values = list(loads)
    monkeypatch.setattr(
        os, "getloadavg", lambda: (values.pop(0) if len(values) > 1 else values[0],) * 3
    )


def test_profiling_records_its_load_and_refuses_a_busy_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, "planner.hardware.load")
    devices, graph = get_preset("cpu-local-2"), chain_cnn(sample=4)
    _loads(monkeypatch, 1.2)  # 0.6 per core
    with pytest.raises(MachineBusyError, match="busy: load average 1.20 on 2 cores"):
        profile_graph(graph, devices, repeats=1, max_configs=1)
    assert not cache_path("cpu-1thread").exists()
    _loads(monkeypatch, 0.1, 2.5)  # quiet at the start, then another process starts
    with pytest.raises(MachineBusyError, match="became busy while profiling the op costs"):
        profile_graph(graph, devices, repeats=1, max_configs=1)
    assert not cache_path("cpu-1thread").exists()  # nothing of that run is cached
    _loads(monkeypatch, 1.2)
    path = profile_graph(graph, devices, repeats=1, max_configs=1, max_load=math.inf)
    data = json.loads(path.read_text())
    (record,) = data["profiled"]
    assert data["version"] == 2 and record["load"]["before"] == 1.2 and record["at"]
    assert record["load"]["per_core"] == 0.6 and record["measured"] == len(data["entries"])
    assert all(run == 0 for _, run in data["entries"].values())
    measured = MeasuredTimes.load(devices)  # measured on purpose on a busy machine: said
    assert "measured on a busy machine" in measured.note
    assert caplog.records[-1].levelno == logging.WARNING
    assert "python -m planner profile MODEL --devices cpu-local-2" in measured.note
    _loads(monkeypatch, 0.2)  # quiet again: those untrusted entries are measured again
    profile_graph(graph, devices, repeats=1, max_configs=1)
    data = json.loads(path.read_text())
    assert data["profiled"][1]["measured"] == record["measured"]
    assert all(run == 1 for _, run in data["entries"].values())
    measured = MeasuredTimes.load(devices)
    assert caplog.records[-1].levelno == logging.INFO and "untrusted" not in measured.note
    assert f"from {path}: {len(data['entries'])} task shapes, measured " in measured.note
    assert "at load 0.10 per core (busy above 0.3)" in measured.note


def test_a_version_1_cache_is_used_untrusted_and_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Caches written before loads were recorded: their times feed plans with a warning."""
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, "planner.hardware.load")
    devices, graph = get_preset("cpu-local-2"), chain_cnn(sample=4)
    path = profile_graph(graph, devices, repeats=1, max_configs=1)
    data = json.loads(path.read_text())
    old = {k: seconds for k, (seconds, _) in data["entries"].items()}
    record = {k: v for k, v in data["profiled"][0].items() if k != "load"}
    path.write_text(json.dumps(data | {"version": 1, "entries": old, "profiled": [record]}))
    measured = MeasuredTimes.load(devices)
    assert measured.entries == old
    assert f"untrusted: {len(old)} of {len(old)} without a recorded load" in measured.note
    assert caplog.records[-1].levelno == logging.WARNING
    profile_graph(graph, devices, repeats=1, max_configs=1)  # measures them all again
    data = json.loads(path.read_text())
    assert data["version"] == 2 and data["profiled"][1]["measured"] == len(old)


def test_a_plan_on_measured_costs_says_where_they_come_from(
    lenet_profile: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    from planner.cli import main

    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(lenet_profile["dir"]))
    args = ["plan", "lenet5", "--batch", "4", "--devices", "cpu-local-2", "--cost", "measured"]
    assert main([*args, "--backend", "baselines", "--time-limit", "30"]) == 0
    err = capsys.readouterr().err
    assert f"planner.hardware.load: measured op costs from {lenet_profile['path']}: " in err
    assert "at load 0.00 per core" in err


def test_cli_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from planner.cli import main

    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path))
    args = ["profile", "lenet5", "--batch", "2", "--devices", "cpu-local-2", "--repeats", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out  # what was measured, where it went, how to use it
    path = tmp_path / "measured-cpu-1thread.json"
    entries = len(json.loads(path.read_text())["entries"])
    assert out.startswith("measured ") and " new task shapes of lenet5 on cpu-local-2 in " in out
    assert (
        f"the cache {path} holds {entries:,} task shapes in all: plan with --cost measured" in out
    )
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing new to measure: every task shape of lenet5") and str(path) in out
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert main([*args, "--refresh"]) == 2  # every shape again, on a busy machine: refused
    err = capsys.readouterr().err
    assert err.startswith("error: the machine is busy") and err.count("\n") == 1
    assert main([*args, "--max-load", "-1"]) == 2
    assert "load average per core >= 0" in capsys.readouterr().err
    assert main([*args, "--refresh", "--max-load", "inf"]) == 0
    data = json.loads((tmp_path / "measured-cpu-1thread.json").read_text())
    assert data["profiled"][-1]["measured"] == len(data["entries"])  # the refresh: every shape


# -- slow: bigger models --------------------------------------------------------------------------

ZOO_SMALL: dict[str, dict[str, Any]] = {
    "lenet5": {"batch": 4},
    "alexnet": {"batch": 2},
    "resnet101": {"batch": 2, "image_size": 64},
    "inception_v3": {"batch": 2},
    "rnntc": {"batch": 4, "steps": 3, "hidden": 16, "vocab": 50},
    "nmt": {"batch": 4, "src_steps": 3, "tgt_steps": 2, "hidden": 16},
    "transformer": {"batch": 2, "seq": 16, "width": 32, "layers": 2, "heads": 4, "vocab": 50},
    "gpt2": {"batch": 2, **GPT2_SMALL},
    "llama2-70b": {"batch": 2, **LLAMA_SMALL},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO_SMALL))
def test_zoo_tasks_run_and_keys_need_no_graph(name: str) -> None:
    """Every task of every config on 4 workers runs, has its box's shape, and its key from the
    op alone equals its key from the graph (what CostModel looks up)."""
    graph = model_graph(name, **ZOO_SMALL[name])
    space = ConfigSpace(graph, get_preset("cpu-local-4"))
    for i, op in enumerate(graph.ops):
        if op.kind == "input":
            continue
        for cfg in {c.degrees: c for c in space[i].configs}.values():
            plan = plan_task(graph, i, cfg)
            assert plan_op(op, cfg).compute_shapes() == plan.compute_shapes()
            fn, leaves = task_fn(graph, i, cfg)
            out = fn()
            assert tuple(out.shape) == plan.out_shape
            out.sum().backward()


@pytest.mark.slow
def test_profile_alexnet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path))
    graph = model_graph("alexnet", batch=4)
    devices = get_preset("cpu-local-2")
    profile_graph(graph, devices, repeats=2)
    measured = MeasuredTimes.load(devices)
    space = ConfigSpace(graph, devices)
    for i, op in enumerate(graph.ops):
        for cfg in space[i].configs:
            assert op.kind == "input" or (measured.task_time(op, cfg) or 0) > 0


@pytest.mark.parametrize("axis", [1, 3])
def test_shared_batch_norm_halves_equal_one_batch_norm(axis):
    """Two halves of a batch, each normalized with the other's statistics added by `reduce`
    (forward: sums of x and x^2; backward: sums of dy and dy (x - mean)), give exactly the
    output and input gradients of one batch norm over the whole batch, and their weight
    gradients add up to its."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 6, 5, 3, dtype=torch.float64, generator=gen) * 2 + 1).movedim(1, axis)
    gy = torch.randn(x.shape, dtype=torch.float64, generator=gen)
    w = torch.randn(6, dtype=torch.float64, generator=gen).requires_grad_()
    b = torch.randn(6, dtype=torch.float64, generator=gen).requires_grad_()
    xs = x.clone().requires_grad_()
    full = torch.batch_norm(xs.movedim(axis, 1), w, b, None, None, True, 0.1, 1e-3, False)
    gx, gw, gb = torch.autograd.grad(full.movedim(1, axis), (xs, w, b), gy)
    dims = [d for d in range(4) if d != axis]
    count = x.numel() // 6
    mean = x.sum(dims) / count
    shape = [6 if d == axis else 1 for d in range(4)]
    got_w = torch.zeros(6, dtype=torch.float64)
    got_b = torch.zeros(6, dtype=torch.float64)
    for mine, other in [(slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))]:
        xo, go = x[other], gy[other]
        addends = [
            torch.stack([xo.sum(dims), (xo * xo).sum(dims)]),
            torch.stack([go.sum(dims), (go * (xo - mean.view(shape))).sum(dims)]),
        ]
        calls = []

        def reduce(t, addends=addends, calls=calls):
            calls.append(t.dtype)
            return t + addends[len(calls) - 1]

        xm = x[mine].clone().requires_grad_()
        y = shared_batch_norm(xm, w, b, axis, count, 1e-3, reduce)
        assert torch.allclose(y, full.movedim(1, axis)[mine], rtol=0, atol=1e-12)
        g_x, g_w, g_b = torch.autograd.grad(y, (xm, w, b), gy[mine])
        assert calls == [torch.float64, torch.float64]  # one reduction each way
        assert torch.allclose(g_x, gx[mine], rtol=0, atol=1e-12)
        got_w += g_w
        got_b += g_b
    assert torch.allclose(got_w, gw, rtol=0, atol=1e-12)
    assert torch.allclose(got_b, gb, rtol=0, atol=1e-12)


def test_shared_batch_norm_plans_and_keys():
    """A batch norm split in samples shares its statistics (its own profile key); split in
    channels it does not; ops without batch norm never do."""
    g = chain_cnn()
    bn, conv = g.ops[g.index("bn1")], g.index("conv1")
    by_sample = plan_task(g, g.index("bn1"), _cfg(bn, sample=2))
    by_channel = plan_task(g, g.index("bn1"), _cfg(bn, channel=2))
    assert by_sample.stats_count == 8 * 16 * 16 and by_channel.stats_count == 0
    assert plan_task(g, conv, _cfg(g.ops[conv], sample=2)).stats_count == 0
    single = plan_task(g, g.index("bn1"), _cfg(bn))
    assert single.stats_count == 0
    assert '"shared_stats":true' in task_key(g, g.index("bn1"), _cfg(bn, sample=2))
    assert "shared_stats" not in task_key(g, g.index("bn1"), _cfg(bn, channel=2))
