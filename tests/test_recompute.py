"""Activation recomputation (planner/costs/recompute.py, CostOptions.recompute): which ops
recompute, the forward they run again, the memory they free, and the peak of a block."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import planner
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.recompute import block_of, blocks_of, recomputed_ops
from planner.errors import LayerwiseError
from planner.graph.capture import capture
from planner.graph.llm import build_llm
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.sizes import SizeError, least_memory
from planner.sim.simulator import simulate


@pytest.fixture(scope="module")
def gpt() -> OpGraph:
    module, inputs = build_llm(
        "gpt2", batch=4, seq=16, n_layer=3, n_head=2, n_embd=32, vocab_size=128, block_size=16
    )
    return capture(module, inputs, "gpt2-tiny")


def test_block_of_names_the_numbered_module() -> None:
    assert block_of("transformer.h.3.attn.c_attn") == ("transformer.h.3", "attn.c_attn")
    assert block_of("layers.12.feed_forward.w1") == ("layers.12", "feed_forward.w1")
    assert block_of("layer1.0.conv1") == ("layer1.0", "conv1")
    assert block_of("transformer.ln_f") is None
    assert block_of("lm_head") is None


def test_only_ops_read_inside_their_block_recompute(gpt: OpGraph) -> None:
    rec = recomputed_ops(gpt)
    names = {gpt.ops[i].name for i in rec.block}
    assert "transformer.h.0.attn.c_attn" in names
    assert "transformer.h.1.mlp.c_fc" in names
    # the block's output (read by the next block or the final norm) is its checkpoint
    for k in range(3):
        assert f"transformer.h.{k}.add_1" not in names
        assert f"transformer.h.{k}.add" in names  # the mid-block residual: read inside only
    assert not names & {"idx", "transformer.wte", "transformer.ln_f", "lm_head"}
    assert all(share == pytest.approx(1 / 3) for share in rec.share.values())
    # every block recomputes the same ops
    inner = {n.split(".", 3)[3] for n in names}
    assert all(f"transformer.h.{k}.{x}" in names for k in range(3) for x in inner)


def _setup(gpt: OpGraph, recompute: str) -> tuple[CostModel, list[ParallelConfig]]:
    devices = get_preset("dgx-a100-80g-1")
    cm = CostModel(gpt, devices, CostOptions(recompute=recompute))  # type: ignore[arg-type]
    return cm, list(data_parallel(gpt, devices).configs)


def test_recomputed_ops_run_their_forward_again_in_the_backward(gpt: OpGraph) -> None:
    plain, cfgs = _setup(gpt, "none")
    full, _ = _setup(gpt, "full")
    rec = full.recomputed
    assert len(rec) > 0 and len(plain.recomputed) == 0
    for i, cfg in enumerate(cfgs):
        f0, b0 = plain.task_times(i, cfg)
        f1, b1 = full.task_times(i, cfg)
        np.testing.assert_allclose(f1, f0)
        kernels = f0 - plain.options.task_overhead
        np.testing.assert_allclose(b1, b0 + (kernels if i in rec else 0.0))


def test_the_peak_keeps_one_block_of_recomputed_outputs(gpt: OpGraph) -> None:
    plain, cfgs = _setup(gpt, "none")
    full, _ = _setup(gpt, "full")
    rec = full.recomputed
    a, b = plain.activations, full.activations
    before = plain.strategy_memory(cfgs)
    regions: dict[str, np.ndarray] = {}
    freed = np.zeros(full.num_devices)
    for i, cfg in enumerate(cfgs):
        unit = np.zeros(full.num_devices)
        unit[list(cfg.devices)] = gpt.ops[i].output.nbytes / cfg.num_tasks
        if i in rec:
            # what a recomputed op stops keeping is what its block's backward rebuilds
            assert a.kept[i] == pytest.approx(b.kept[i] + b.work[i])
            freed += unit * (a.kept[i] - b.kept[i])
            regions[rec.block[i]] = regions.get(rec.block[i], 0) + unit * b.work[i]
        else:
            assert b.kept[i] == a.kept[i]  # the other ops keep what they kept
            if i in b.region:  # the loss's logits gradient, alike in both
                regions[b.region[i]] = unit * b.work[i]
    largest = np.max(np.stack(list(regions.values())), axis=0)
    loss = [i for i in a.region]
    assert len(loss) == 1 and a.region[loss[0]] == "(loss)"
    loss_work = np.zeros(full.num_devices)
    cfg = cfgs[loss[0]]
    loss_work[list(cfg.devices)] = gpt.ops[loss[0]].output.nbytes / cfg.num_tasks * a.work[loss[0]]
    after = full.strategy_memory(cfgs)
    np.testing.assert_allclose(after, before - loss_work - freed + largest)
    used = before > 0  # a batch of 4: data parallelism uses 4 of the 8 GPUs
    assert used.sum() == 4 and (after[used] < before[used]).all()
    # alike blocks, alike placed: the per-op shares the searches add up are at least the
    # peak (the loss's working set added, not the larger of it and a block's)
    shares = sum(full.memory(i, c) for i, c in enumerate(cfgs))
    np.testing.assert_allclose(shares, after - largest + loss_work + regions["transformer.h.0"])
    # and the simulator reports that peak
    strategy = data_parallel(gpt, full.devices)
    np.testing.assert_allclose(simulate(full, strategy).memory, after)


def test_an_unknown_recompute_mode_is_one_clear_error() -> None:
    with pytest.raises(
        LayerwiseError,
        match="recompute must be 'none', 'selective', 'full' or a number of blocks",
    ):
        CostOptions(recompute="attention")  # type: ignore[arg-type]


def test_a_recomputed_consumer_receives_its_inputs_again(gpt: OpGraph) -> None:
    from planner.costs.config import ConfigSpace
    from planner.problems.baselines import megatron

    devices = get_preset("dgx-a100-80g-1")
    plain = CostModel(gpt, devices, CostOptions())
    full = CostModel(gpt, devices, CostOptions(recompute="full"))
    cfgs = megatron(gpt, devices, 2).configs  # tensor parallel 2 x data parallel 4
    rec = full.recomputed
    again = 0
    for e in gpt.edges:
        cu, cv = cfgs[e.src], cfgs[e.dst]
        t0, t1 = plain.transfer_time(e, cu, cv), full.transfer_time(e, cu, cv)
        if e.dst not in rec:
            assert t1 == pytest.approx(t0)
            continue
        # forward twice, backward once: t1 - t0 is the forward part, at most t0
        assert t0 <= t1 <= 2 * t0 + 1e-15
        again += t1 > t0
    assert again > 0
    # the tables price it as the direct computation does
    space = ConfigSpace(gpt, devices)
    for e in gpt.edges[:40]:
        cu, cv = space[e.src], space[e.dst]
        table = full.edge_table(e, cu, cv)
        for a in range(0, len(cu), max(1, len(cu) // 5)):
            for b in range(0, len(cv), max(1, len(cv) // 5)):
                direct = full.transfer_time(e, cu.configs[a], cv.configs[b])
                assert table[a, b] == pytest.approx(direct, rel=1e-9, abs=1e-15)


def test_the_simulator_sends_a_recomputed_ops_inputs_again_before_its_backward(
    gpt: OpGraph,
) -> None:
    from planner.problems.baselines import megatron

    devices = get_preset("dgx-a100-80g-1")
    strategy = megatron(gpt, devices, 2)
    timelines = {
        mode: simulate(CostModel(gpt, devices, CostOptions(recompute=mode)), strategy)  # type: ignore[arg-type]
        for mode in ("none", "full")
    }
    again = [t for t in timelines["full"].tasks if "xfer again " in t.name]
    assert again and not any("again" in t.name for t in timelines["none"].tasks)
    assert timelines["full"].makespan > timelines["none"].makespan


# every byte of the devices usable (the default keeps 5% and a reserve per GPU free): the
# tests below size their devices against the memory the model needs
ALL = {"headroom": 0.0, "reserve": 0}


def _with_memory(name: str, memory: float) -> DeviceGraph:
    base = get_preset(name)
    devices = [dataclasses.replace(d, memory=memory) for d in base.devices]
    return DeviceGraph(base.name, devices, base.links, base.switches)


def test_plan_recomputes_only_when_the_model_does_not_fit_otherwise(gpt: OpGraph) -> None:
    plain = least_memory(gpt, CostOptions())
    full = least_memory(gpt, CostOptions(recompute="full"))
    assert full < plain
    roomy = planner.plan(gpt, "p100-1x2", **ALL, backend="auto", recompute="auto", recommend=False)
    assert roomy.stats["recompute"] == {"chose": "none", "tried": []}  # the optimum fits
    # just too little to keep every activation, even spread evenly over both devices
    tight = _with_memory("p100-1x2", 0.99 * plain / 2)
    with pytest.raises(SizeError, match="recompute activations"):
        planner.plan(gpt, tight, **ALL, recompute="none", recommend=False)
    out = planner.plan(gpt, tight, **ALL, recompute="auto", recommend=False, time_limit=30)
    chose = out.stats["recompute"]
    # every block, or (when the answer with every block fits with fewer) the first 2
    assert chose["chose"] in ("full", 2)
    assert out.problem.dnn().cost_model.options.recompute == chose["chose"]
    assert chose["tried"][0]["recompute"] == "none" and "needs at least" in chose["tried"][0]["why"]
    # then the attention ops alone: FlashAttention keeps little they could free, too little
    assert chose["tried"][1]["recompute"] == "selective"
    assert "needs at least" in chose["tried"][1]["why"]
    if chose["chose"] != "full":  # then it was faster than recomputing every block
        assert [t["recompute"] for t in chose["tried"]] == ["none", "selective", "full"]
        assert "against" in chose["tried"][2]["why"]
    assert out.stats["memory_fits"]
    with pytest.raises(
        LayerwiseError,
        match="recompute must be 'none', 'selective', 'full', 'auto' or a number of blocks",
    ):
        planner.plan(gpt, "p100-1x2", **ALL, recompute="some")


def test_unset_memory_options_plan_again_with_both_auto_only_when_needed(gpt: OpGraph) -> None:
    roomy = planner.plan(gpt, "p100-1x2", **ALL, recommend=False)
    assert "memory_fallback" not in roomy.stats and "recompute" not in roomy.stats
    assert roomy.problem.dnn().cost_model.options.recompute == "none"
    tight = _with_memory("p100-1x2", 0.99 * least_memory(gpt, CostOptions()) / 2)
    out = planner.plan(gpt, tight, **ALL, recommend=False, time_limit=30)
    assert "recompute activations" in out.stats["memory_fallback"]
    assert out.stats["memory_fits"] and out.stats["recompute"]["chose"] != "none"
    assert out.problem.dnn().cost_model.options.recompute == out.stats["recompute"]["chose"]
    assert "zero" in out.stats  # each recompute mode tried its ZeRO stages
    assert planner.plan(gpt, tight, **ALL, zero=0, recompute="full", recommend=False).stats[
        "memory_fits"
    ]
    # too little for the whole batch's activations even with ZeRO stage 3 and every block
    # recomputed: pipelines, whose micro-batches keep fewer activations at once
    least = least_memory(gpt, CostOptions(recompute="full", zero=3))
    tighter = _with_memory("p100-1x2", 0.9 * least / 2)
    piped = planner.plan(gpt, tighter, **ALL, recommend=False, time_limit=30)
    assert isinstance(piped, planner.PipelinePlan) and piped.layout.micro_batches > 1
    assert "did not make it fit either" in piped.stats["memory_fallback"]
    assert max(piped.timeline.peak_bytes) <= 0.9 * least / 2
    # too little for the parameters alone: one clear refusal
    hopeless = _with_memory("p100-1x2", 1e3)
    with pytest.raises(
        SizeError, match="training state alone.*no ZeRO stage, recomputation, pipeline"
    ):
        planner.plan(gpt, hopeless, **ALL, recommend=False, time_limit=30)


def test_recomputing_the_first_blocks_only(gpt: OpGraph) -> None:
    blocks = blocks_of(gpt)
    assert blocks == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    every = recomputed_ops(gpt)
    assert len(recomputed_ops(gpt, 0)) == len(recomputed_ops(gpt, "none")) == 0
    assert recomputed_ops(gpt, 3).block == every.block == recomputed_ops(gpt, 7).block
    one = recomputed_ops(gpt, 1)
    assert set(one.block.values()) == {"transformer.h.0"}
    assert len(one) == len(every) // 3 and set(one.share.values()) == {1.0}
    # time and memory in between
    devices = get_preset("dgx-a100-80g-1")
    cfgs = data_parallel(gpt, devices).configs
    models = [CostModel(gpt, devices, CostOptions(recompute=k)) for k in ("none", 1, 2, "full")]
    work = [sum(m.compute_time(i, c) for i, c in enumerate(cfgs)) for m in models]
    peak = [m.strategy_memory(cfgs).max() for m in models]
    assert work == sorted(work) and len(set(work)) == 4
    # one block recomputed frees at most what the loss's logits gradient needs beyond a
    # block (its activations come back for its backward, but are gone at the loss's);
    # each further one frees a block's worth
    assert peak[0] >= peak[1] > peak[2] > peak[3]
    assert peak[0] - peak[1] <= models[0].strategy_memory(cfgs).max() - peak[2]
    for bad in (-1, True, "some", 1.5):
        with pytest.raises(LayerwiseError, match="a number of blocks >= 0"):
            CostOptions(recompute=bad)  # type: ignore[arg-type]
