"""A pipelined strategy's step: chunk problems from the op graph, their simulated costs and
the schedule's timeline; the rule-built layouts (Megatron-LM's stages)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.costs.costmodel import CostModel, CostOptions
from planner.errors import StrategyError
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.pipeline.layouts import block_bounds, block_starts, pipelined, stage_groups
from planner.pipeline.schedule import bubble_fraction
from planner.pipeline.spec import Pipeline, PipelinedStrategy, PipelineError, micro_batch_graph
from planner.pipeline.stages import chunk_problem, chunk_times, simulate_pipelined
from planner.problems.baselines import data_parallel, megatron
from planner.sim.simulator import simulate

OPTIONS = CostOptions(optimizer="adam", master_weights=True)


@pytest.fixture(scope="module")
def gpt() -> OpGraph:
    return model_graph("gpt2", batch=8, seq=64, n_layer=4, n_head=4, n_embd=128, vocab_size=512)


def _megatron(tensor: int):  # noqa: ANN202
    return lambda g, d: megatron(g, d, tensor)


@pytest.mark.parametrize("rule", [_megatron(2), _megatron(1), lambda g, d: data_parallel(g, d)])
def test_one_stage_one_micro_batch_is_the_plain_simulation(gpt: OpGraph, rule) -> None:  # noqa: ANN001
    devices = get_preset("dgx-a100-80g-1")
    cm = CostModel(gpt, devices, OPTIONS)
    ps = pipelined(gpt, devices, 1, 1, rule)
    assert simulate_pipelined(cm, ps).makespan == pytest.approx(
        simulate(cm, ps.strategy).makespan, rel=1e-12
    )


def test_chunks_are_their_ops_and_inputs_on_their_group(gpt: OpGraph) -> None:
    devices = get_preset("dgx-a100-80g-2")
    ps = pipelined(gpt, devices, 2, 1, _megatron(8))
    cm = CostModel(gpt, devices, OPTIONS)
    second = chunk_problem(cm, ps, 1)
    names = [op.name for op in second.graph.ops]
    assert names[0] == "transformer.h.1.add_1"  # the residual stream from chunk 0
    assert second.graph.ops[0].kind == "input" and second.group == tuple(range(8, 16))
    assert second.devices.num_devices == 8 and names[-1] == "lm_head.loss"
    assert set(names[1:]) == {op.name for op in gpt.ops[ps.pipeline.bounds[1] :]}


def test_a_two_stage_pipeline_times_its_bubble_and_messages(gpt: OpGraph) -> None:
    devices = get_preset("dgx-a100-80g-2")  # a stage per node: messages cross InfiniBand
    m = 4
    mg = micro_batch_graph(gpt, m)
    cm = CostModel(mg, devices, OPTIONS)
    ps = pipelined(mg, devices, 2, m, _megatron(8))
    chunks = chunk_times(cm, ps)
    assert all(c.forward > 0 and c.backward > 0 and c.sync > 0 for c in chunks)
    assert chunks[0].send_forward > 0 and chunks[1].send_backward == chunks[0].send_forward
    assert chunks[1].send_forward == 0 and chunks[0].send_backward == 0
    tl = simulate_pipelined(cm, ps)
    work = sum(c.forward + c.backward for c in chunks)
    assert tl.makespan > m * max(c.forward + c.backward for c in chunks)
    assert tl.makespan >= (m - 1) * max(c.forward + c.backward for c in chunks) + work
    assert tl.bubble > 0.5 * bubble_fraction("1f1b", 2, m)
    # free messages and sync: the timeline shrinks by at least the two messages of a micro-batch
    free = [dataclasses.replace(c, send_forward=0.0, send_backward=0.0, sync=0.0) for c in chunks]
    from planner.pipeline.timeline import simulate_pipeline

    assert (
        simulate_pipeline(free, "1f1b", 2, m).makespan <= tl.makespan - 2 * chunks[0].send_forward
    )


def test_one_f_one_b_holds_less_than_gpipe_and_more_micro_batches_cost_less_bubble(
    gpt: OpGraph,
) -> None:
    devices = get_preset("dgx-a100-80g-2")
    base = {}
    for m in (2, 8):
        mg = micro_batch_graph(gpt, m)
        cm = CostModel(mg, devices, OPTIONS)
        for name in ("gpipe", "1f1b"):
            base[name, m] = simulate_pipelined(cm, pipelined(mg, devices, 2, m, _megatron(8), name))
    assert base["1f1b", 8].peak_bytes[0] < base["gpipe", 8].peak_bytes[0]
    assert base["1f1b", 8].bubble < base["1f1b", 2].bubble
    assert base["gpipe", 8].makespan == pytest.approx(base["1f1b", 8].makespan, rel=0.05)


def test_interleaved_chunks_alternate_groups(gpt: OpGraph) -> None:
    devices = get_preset("dgx-a100-80g-2")
    mg = micro_batch_graph(gpt, 4)
    ps = pipelined(mg, devices, 2, 4, _megatron(8), "interleaved", 2)
    assert ps.pipeline.chunks == 4 and ps.pipeline.virtual == 2
    assert [ps.pipeline.group_of(c)[0] for c in range(4)] == [0, 8, 0, 8]
    plain = simulate_pipelined(
        CostModel(mg, devices, OPTIONS), pipelined(mg, devices, 2, 4, _megatron(8))
    )
    inter = simulate_pipelined(CostModel(mg, devices, OPTIONS), ps)
    assert inter.bubble < plain.bubble
    assert len(inter.messages) == 2 * (4 * 3)  # 4 micro-batches x 3 chunk boundaries, both ways


def test_the_pipelines_syncs_take_the_cost_options_gradient_overlap(gpt: OpGraph) -> None:
    """`CostOptions.chunk_sync_share` (dp_overlap x chunk_sync_overlap) reaches the
    pipeline's timeline: with both 1 a chunk's sync starts at its last backward; without
    the overlapped gradient reduce, or with chunk_sync_overlap 0 (the default), every
    chunk's sync waits for its group's last backward."""
    from planner.pipeline.timeline import simulate_pipeline

    devices = get_preset("dgx-a100-80g-2")
    mg = micro_batch_graph(gpt, 4)
    ps = pipelined(mg, devices, 2, 4, _megatron(8), "interleaved", 2)

    def step(dp: float, chunk: float) -> float:
        options = dataclasses.replace(OPTIONS, dp_overlap=dp, chunk_sync_overlap=chunk)
        return simulate_pipelined(CostModel(mg, devices, options), ps).makespan

    cm = CostModel(mg, devices, dataclasses.replace(OPTIONS, dp_overlap=0.0))
    chunks = chunk_times(cm, ps)
    late = simulate_pipeline(chunks, "interleaved", 2, 4, cm.options.pp_overlap, 0.0)
    early = simulate_pipeline(chunks, "interleaved", 2, 4, cm.options.pp_overlap, 1.0)
    assert early.makespan < late.makespan
    assert step(0.0, 1.0) == pytest.approx(late.makespan, rel=1e-12)
    assert step(1.0, 0.0) > step(1.0, 1.0)
    for g in range(2):
        last_backward = max(s.end for s in late.works if s.group == g)
        assert all(s.start >= last_backward for s in late.syncs if s.group == g)


def test_bad_pipelines_are_one_line_errors(gpt: OpGraph) -> None:
    devices = get_preset("dgx-a100-80g-1")
    n = len(gpt.ops)
    with pytest.raises(PipelineError, match="must start at 0 and increase"):
        Pipeline((0, 5, 5, n), ((0,), (1,), (2,)), 2)
    with pytest.raises(PipelineError, match="repeat a device"):
        Pipeline((0, 5, n), ((0, 1), (1, 2)), 2)
    with pytest.raises(PipelineError, match="multiple of 2 chunks"):
        Pipeline((0, 5, 9, n), ((0,), (1,)), 2)
    dp = data_parallel(gpt, devices)  # every op on all 8 devices: not inside a group
    with pytest.raises(StrategyError, match="is in pipeline chunk 0 on devices"):
        PipelinedStrategy(dp, Pipeline(block_bounds(gpt, 2), stage_groups(devices, 2), 2))
    with pytest.raises(PipelineError, match="4 blocks, which do not cut into 3"):
        block_bounds(gpt, 3)
    with pytest.raises(PipelineError, match="micro-batches do not divide"):
        micro_batch_graph(gpt, 3)
    with pytest.raises(PipelineError, match="do not split the 8 devices"):
        stage_groups(devices, 3)
    assert len(block_starts(gpt)) == 4
    with pytest.raises(PipelineError, match="the last bound must be"):
        Pipeline((0, 5, n - 1), ((0,), (1,)), 2).check(gpt, 8)


def test_evaluate_scores_a_pipelined_plan_file_as_a_pipeline(
    gpt: OpGraph,
    tmp_path,
    capsys: pytest.CaptureFixture[str],  # noqa: ANN001
) -> None:
    import json

    from planner.cli import main

    devices = get_preset("dgx-a100-80g-2")
    mg = micro_batch_graph(gpt, 4)
    ps = pipelined(mg, devices, 2, 4, _megatron(8))
    path = tmp_path / "plan.json"
    ps.save(path)
    want = simulate_pipelined(CostModel(mg, devices, CostOptions()), ps)
    plot = tmp_path / "step.png"
    assert main(["evaluate", str(path), "--json", "--plot", str(plot)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["makespan"] == pytest.approx(want.makespan, rel=1e-12) and plot.stat().st_size > 0
    assert (
        got["micro_batches"] == 4
        and got["stages"] == 2
        and got["bubble"] == pytest.approx(want.bubble)
    )
    assert main(["evaluate", str(path), "--trace", str(tmp_path / "t.json")]) == 2
    assert "use --plot" in capsys.readouterr().err


def test_alike_chunks_are_simulated_once_and_time_as_each_alone(
    gpt: OpGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Middle chunks of a transformer differ only in block numbers and devices: one
    simulation serves them all, and gives what each chunk's own simulation gives."""
    from planner.pipeline import stages

    devices = get_preset("dgx-a100-80g-4")
    mg = micro_batch_graph(gpt, 4)
    cm = CostModel(mg, devices, OPTIONS)
    ps = pipelined(mg, devices, 4, 4, _megatron(8), "1f1b")
    keys = [stages.chunk_key(chunk_problem(cm, ps, c)) for c in range(4)]
    assert keys[1] == keys[2] and keys[0] != keys[1] and keys[3] != keys[1]
    calls = []
    real = stages.simulate_chunk
    monkeypatch.setattr(stages, "simulate_chunk", lambda *a: calls.append(1) or real(*a))
    shared = chunk_times(cm, ps)
    assert len(calls) == 3
    monkeypatch.setattr(stages, "chunk_key", lambda ch: (repr(ch.group),))  # every chunk alone
    alone = chunk_times(cm, ps)
    assert len(calls) == 3 + 4 and shared == alone


def test_uneven_stages_as_megatron_sets_them() -> None:
    """The first and last stage's blocks given (Megatron-LM's
    --decoder-first/last-pipeline-num-layers), the rest shared by the stages between: a
    model of 10 blocks as 2, 3, 3, 2 over four stages, its chunks cut at those blocks, the
    embeddings with the first and the head with the last; 126 blocks over 16 as 7, 8 x 14, 7."""
    from planner.pipeline.layouts import stage_blocks

    assert stage_blocks(126, 16, 7, 7) == (7, *[8] * 14, 7)
    assert stage_blocks(10, 4, 2, 2) == (2, 3, 3, 2)
    graph = model_graph("gpt2", batch=8, seq=64, n_layer=10, n_head=4, n_embd=128, vocab_size=512)
    devices = get_preset("dgx-a100-80g-1")
    ps = pipelined(graph, devices, 4, 2, _megatron(2), first=2, last=2)
    starts = block_starts(graph)
    assert ps.pipeline.bounds == (0, starts[2], starts[5], starts[8], len(graph.ops))
    listed = pipelined(graph, devices, 4, 2, _megatron(2), blocks=(2, 3, 3, 2))
    assert listed.pipeline == ps.pipeline
    assert block_bounds(graph, 2, [1, 9]) == (0, starts[1], len(graph.ops))


@pytest.mark.parametrize(
    "call,says",
    [
        (lambda g: block_bounds(g, 2, [5, 4]), "add up to 9, but 'gpt2' has 10 blocks"),
        (lambda g: block_bounds(g, 2, [10]), "must be 2 whole numbers >= 1"),
        (lambda g: block_bounds(g, 2, [0, 10]), "must be 2 whole numbers >= 1"),
        (lambda g: block_bounds(g, 3), "or give the blocks per chunk"),
        (lambda g: _uneven(g, first=2, last=3), "8 on each|leave|do not share"),
        (lambda g: _uneven(g, first=0), "from 1 to 9"),
        (lambda g: _uneven(g, first=2, virtual=2), "one chunk per stage"),
    ],
)
def test_uneven_stages_refuse_bad_counts_in_one_line(call, says: str) -> None:  # noqa: ANN001
    graph = model_graph("gpt2", batch=8, seq=64, n_layer=10, n_head=4, n_embd=128, vocab_size=512)
    with pytest.raises(PipelineError) as info:
        call(graph)
    assert "\n" not in str(info.value)
    assert any(part in str(info.value) for part in says.split("|")), str(info.value)


def _uneven(graph: OpGraph, **kwargs: int) -> object:
    m = 2 * kwargs.get("virtual", 1)
    return pipelined(
        graph,
        get_preset("dgx-a100-80g-1"),
        4,
        m,
        _megatron(2),
        "interleaved" if kwargs.get("virtual", 1) > 1 else "1f1b",
        **kwargs,
    )
