"""DualPipe (DeepSeek-V3, arXiv 2412.19437, Sec. 3.2.1, Fig. 5, Table 2): its orders, its
timeline against the published bubble and the order's own closed form, its memory."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    ScheduleError,
    Work,
    bubble_fraction,
    dualpipe_bubble,
    group_of,
    in_flight,
    schedule,
)
from planner.pipeline.timeline import ChunkTimes, PipelineTimeline, simulate_pipeline

SIZES = [(2, 4), (4, 8), (4, 10), (6, 12), (6, 20), (8, 16), (8, 20), (16, 120)]


def _check_order(p: int, m: int) -> None:
    """Each group runs, once each, F, B and W of its two stages' micro-batches (stage g for
    the first m / 2, fed at group 0; stage p - 1 - g for the others, fed at group p - 1),
    each micro-batch's F before its B before its W."""
    for g, order in enumerate(schedule("dualpipe", p, m)):
        want = {Work(k, i, g if i < m // 2 else p - 1 - g) for k in "FBW" for i in range(m)}
        assert len(order) == len(set(order)) == 3 * m and set(order) == want
        assert all(group_of("dualpipe", p, m, w) == g for w in order)
        pos = {w: k for k, w in enumerate(order)}
        for w in order:
            if w.kind != FORWARD:
                before = Work(FORWARD if w.kind == BACKWARD else BACKWARD, w.micro, w.chunk)
                assert pos[before] < pos[w]
        assert not order[-1].joined  # a unit ends in the order


def _check_dependencies(tl: PipelineTimeline, p: int) -> None:
    """Every work starts after its inputs end: the forward of the stage before, the
    backward of the stage after, its own forward (B) or input gradient (W)."""
    end = {s.work: s.end for s in tl.works}
    assert len(end) == len(tl.works) == 3 * tl.micro_batches * p
    for s in tl.works:
        w, needs = s.work, []
        if w.kind == FORWARD and w.chunk > 0:
            needs.append(Work(FORWARD, w.micro, w.chunk - 1))
        if w.kind == BACKWARD:
            needs.append(Work(FORWARD, w.micro, w.chunk))
            if w.chunk < p - 1:
                needs.append(Work(BACKWARD, w.micro, w.chunk + 1))
        if w.kind == WEIGHT:
            needs.append(Work(BACKWARD, w.micro, w.chunk))
        assert all(s.start >= end[n] - 1e-9 for n in needs), w
    for g in range(p):  # one work at a time on a group
        mine = sorted((s.start, s.end) for s in tl.works if s.group == g)
        assert all(b[0] >= a[1] - 1e-12 for a, b in zip(mine, mine[1:], strict=False))


@pytest.mark.parametrize("p,m", SIZES)
def test_every_micro_batch_runs_once_in_dependency_order(p: int, m: int) -> None:
    _check_order(p, m)
    tl = simulate_pipeline([ChunkTimes(1.0, 2.0)] * p, "dualpipe", p, m)
    _check_dependencies(tl, p)


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("forward,backward,weight", [(1.0, 2.0, 1.0), (1.0, 1.75, 0.75)])
def test_uniform_idle_is_table_2s_bubble(
    p: int, m: int, forward: float, backward: float, weight: float
) -> None:
    """Table 2: (PP/2 - 1)(F&B + B - 3W), with the overlapped F&B counted as F + B (the
    timeline hides the pair's communication, not its computation), on stages whose forward
    is as long as the input gradient and no shorter than the weight gradient (Fig. 5's
    cells: F = B - W = W)."""
    chunks = [ChunkTimes(forward, backward, weight_share=weight / backward)] * p
    tl = simulate_pipeline(chunks, "dualpipe", p, m)
    table_2 = (p / 2 - 1) * ((forward + backward) + backward - 3 * weight)
    for busy in tl.busy:
        assert busy == pytest.approx(m * (forward + backward), rel=1e-12)
        assert tl.makespan - busy == pytest.approx(table_2, abs=1e-9)
    fraction = bubble_fraction(
        "dualpipe", p, m, forward=forward, backward=backward, weight_share=weight / backward
    )
    assert math.isclose(tl.bubble, fraction, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("p,m", [(4, 8), (8, 20), (16, 120)])
def test_dualpipe_idles_less_than_1f1b(p: int, m: int) -> None:
    # Table 2 with F = 1, B = 2, W = 1: (p/2 - 1) 2 against 1F1B's (p - 1) 3
    chunks = [ChunkTimes(1.0, 2.0)] * p
    dual = simulate_pipeline(chunks, "dualpipe", p, m)
    ofob = simulate_pipeline(chunks, "1f1b", p, m)
    assert dual.makespan == pytest.approx(3.0 * m + (p / 2 - 1) * 2.0)
    assert ofob.makespan == pytest.approx(3.0 * (m + p - 1))
    assert bubble_fraction("dualpipe", p, m) == pytest.approx((p - 2) / (3 * m + p - 2))


@settings(max_examples=60, deadline=None)
@given(
    half=st.integers(1, 8),
    extra=st.integers(0, 6),
    forward=st.floats(0.05, 3.0),
    grad=st.floats(0.05, 3.0),
    weight=st.floats(0.0, 3.0),
)
def test_uniform_idle_is_the_orders_closed_form(
    half: int, extra: int, forward: float, grad: float, weight: float
) -> None:
    """Any proportions of F, B - W and W: the idle time is `dualpipe_bubble`'s, whatever m."""
    p = 2 * half
    m = 2 * p + 2 * extra
    backward = grad + weight
    chunks = [ChunkTimes(forward, backward, weight_share=weight / backward)] * p
    tl = simulate_pipeline(chunks, "dualpipe", p, m)
    idle = dualpipe_bubble(p, forward, backward, weight)
    assert tl.makespan - m * (forward + backward) == pytest.approx(idle, abs=1e-9 * tl.makespan)
    assert tl.bubble == pytest.approx(
        bubble_fraction(
            "dualpipe", p, m, forward=forward, backward=backward, weight_share=weight / backward
        ),
        abs=1e-9,
    )


@settings(max_examples=40, deadline=None)
@given(half=st.integers(1, 4), extra=st.integers(0, 3), data=st.data())
def test_any_costs_run_to_the_end_in_dependency_order(
    half: int, extra: int, data: st.DataObject
) -> None:
    """Unequal stages, messages both ways, blocking sends, syncs: no deadlock, every
    dependency held, no faster than its busiest group."""
    p = 2 * half
    m = 2 * p + 2 * extra
    t = st.floats(0.01, 2.0)
    chunks = [
        ChunkTimes(data.draw(t), data.draw(t), data.draw(t), data.draw(t), data.draw(t),
                   weight_share=data.draw(st.floats(0.0, 1.0)))
        for _ in range(p)
    ]  # fmt: skip
    overlap = data.draw(st.sampled_from([1.0, 0.5, 0.0]))
    tl = simulate_pipeline(chunks, "dualpipe", p, m, overlap, data.draw(st.floats(0.0, 1.0)))
    _check_dependencies(tl, p)
    assert tl.makespan >= max(tl.busy) - 1e-9


def test_messages_go_both_ways() -> None:
    p, m = 4, 8
    chunks = [ChunkTimes(1.0, 2.0, send_forward=0.1, send_backward=0.1)] * p
    tl = simulate_pipeline(chunks, "dualpipe", p, m)
    assert len(tl.messages) == 2 * m * (p - 1)  # each micro-batch: p - 1 each way
    links = {(s.group, s.to) for s in tl.messages}
    assert links == {(g, g + 1) for g in range(p - 1)} | {(g + 1, g) for g in range(p - 1)}
    for s in tl.messages:  # direction A's forwards go up the groups, direction B's down
        forward_up = (s.work.micro < m // 2) == (s.work.kind == FORWARD)
        assert s.to == s.group + (1 if forward_up else -1)
    free = simulate_pipeline([ChunkTimes(1.0, 2.0)] * p, "dualpipe", p, m)
    assert tl.makespan > free.makespan


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 20), (16, 120)])
def test_memory_two_parameter_copies_and_p_plus_1_micro_batches(p: int, m: int) -> None:
    orders = schedule("dualpipe", p, m)
    assert [in_flight(o) for o in orders] == [p + 1] * p
    # stage s: parameters 100 (s + 1), working set s, 1 byte of activations per micro-batch
    chunks = [
        ChunkTimes(1.0, 2.0, activation_bytes=1.0, fixed_bytes=100.0 * (s + 1) + s, working_bytes=s)
        for s in range(p)
    ]
    tl = simulate_pipeline(chunks, "dualpipe", p, m)
    for g, parts in enumerate(tl.peak_parts):
        assert parts["parameters"] == 100.0 * (g + 1) + 100.0 * (p - g)  # both copies
        assert parts["activations"] == p + 1
        assert parts["working_set"] == max(g, p - 1 - g)
    assert tl.in_flight == (p + 1,) * p


def test_each_parameter_copy_syncs_after_its_last_weight_gradient() -> None:
    p, m = 4, 8
    chunks = [ChunkTimes(1.0, 2.0, sync=0.5)] * p
    tl = simulate_pipeline(chunks, "dualpipe", p, m)
    free = simulate_pipeline([ChunkTimes(1.0, 2.0)] * p, "dualpipe", p, m)
    assert sorted((s.group, s.work.chunk) for s in tl.syncs) == sorted(
        (g, k) for g in range(p) for k in (g, p - 1 - g)
    )
    for s in tl.syncs:
        last = max(
            w.end
            for w in tl.works
            if w.group == s.group and w.work.chunk == s.work.chunk and w.work.kind == WEIGHT
        )
        assert s.start >= last - 1e-12 and s.end - s.start == pytest.approx(0.5)
    assert tl.makespan > free.makespan


def test_the_weight_share_leaves_the_other_schedules_alone() -> None:
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        a = simulate_pipeline([ChunkTimes(1.0, 2.0, weight_share=0.1)] * (4 * v), name, 4, 8)
        b = simulate_pipeline([ChunkTimes(1.0, 2.0, weight_share=0.9)] * (4 * v), name, 4, 8)
        assert a == b


def test_bad_dualpipe_counts_are_one_line_errors() -> None:
    with pytest.raises(ScheduleError, match="even number of stages, got 3"):
        schedule("dualpipe", 3, 6)
    with pytest.raises(ScheduleError, match=r"even number >= 2 x 4 stages = 8, got 6"):
        schedule("dualpipe", 4, 6)
    with pytest.raises(ScheduleError, match=r"even number >= 2 x 4 stages = 8, got 9"):
        schedule("dualpipe", 4, 9)
    with pytest.raises(ScheduleError, match="need the 'interleaved' schedule, not 'dualpipe'"):
        schedule("dualpipe", 4, 8, 2)
    with pytest.raises(ScheduleError, match="expected one of gpipe, 1f1b, interleaved, dualpipe"):
        schedule("dual", 4, 8)
    for bad in (
        lambda: schedule("dualpipe", 4, 6),
        lambda: simulate_pipeline([ChunkTimes(1.0, 2.0)] * 4, "dualpipe", 4, 6),
    ):
        with pytest.raises(ScheduleError) as info:
            bad()
        assert "\n" not in str(info.value)


def test_an_overlapped_pair_waits_for_both_inputs_and_sends_when_it_ends() -> None:
    """DualPipe's overlapped forward and backward (and a backward with its weight gradient)
    run as one unit: back to back, from when both inputs are there, their messages after."""
    p, m = 4, 8
    chunks = [ChunkTimes(1.0, 2.0, send_forward=0.3, send_backward=0.7)] * p
    tl = simulate_pipeline(chunks, "dualpipe", p, m)
    slot = {s.work: s for s in tl.works}
    arrived = {s.work: s.end for s in tl.messages}  # keyed by the receiving work
    sent = {}  # the sending work of each message
    for s in tl.messages:
        w = s.work
        sent[Work(w.kind, w.micro, w.chunk + (-1 if w.kind == FORWARD else 1))] = s
    pairs = 0
    for order in schedule("dualpipe", p, m):
        k = 0
        while k < len(order):
            unit = [order[k]]
            while unit[-1].joined:
                unit.append(order[k + len(unit)])
            k += len(unit)
            slots = [slot[w] for w in unit]
            assert all(b.start == a.end for a, b in zip(slots, slots[1:], strict=False))
            assert all(slots[0].start >= arrived.get(w, 0.0) for w in unit)
            assert all(sent[w].start >= slots[-1].end for w in unit if w in sent)
            pairs += unit[0].kind == FORWARD and len(unit) == 3
    assert pairs > 0


@pytest.mark.parametrize("p,m", SIZES)
def test_the_order_has_dualpipes_phases(p: int, m: int) -> None:
    """Per group h stages from its end (P = p / 2, n = m / 2): 2 (P - h - 1) + 1 forwards of
    its own direction before the other's first; n - p + h + 1 steady rounds of two overlapped
    pairs (the middle groups run their first pair apart) and P - h - 1 more in the drain;
    p - 1 - h backwards whose weight gradient runs apart (zero bubble)."""
    half, n = p // 2, m // 2
    for g, order in enumerate(schedule("dualpipe", p, m)):
        h = min(g, p - 1 - g)
        near = range(n) if g < half else range(n, m)
        first_far = next(k for k, w in enumerate(order) if w.micro not in near)
        assert first_far == 2 * (half - h - 1) + 1
        assert all(w.kind == FORWARD for w in order[:first_far])
        pairs = sum(w.kind == FORWARD and w.joined for w in order)
        assert pairs == 2 * (n - p + h + 1) + (half - h - 1) - (h == half - 1)
        apart = sum(w.kind == BACKWARD and not w.joined for w in order)
        assert apart == p - 1 - h


def test_fig_5s_first_group() -> None:
    # 8 groups, 20 micro-batches (Fig. 5): group 0 runs 7 forwards of its own direction,
    # then the other direction's first (micro-batch 10 on stage 7), then three times the
    # other direction's input gradient, its weight gradient and a forward
    order = [str(w) for w in schedule("dualpipe", 8, 20)[0]]
    assert order[:17] == [
        "F0", "F1", "F2", "F3", "F4", "F5", "F6", "F10.7",
        "B10.7", "W10.7", "F11.7", "B11.7", "W11.7", "F12.7", "B12.7", "W12.7", "F13.7",
    ]  # fmt: skip


# -- a pipelined strategy with DualPipe: timed, both copies counted; refused where it cannot run


@pytest.fixture(scope="module")
def gpt_dualpipe():  # noqa: ANN201
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.graph.zoo import model_graph
    from planner.hardware.presets import get_preset
    from planner.pipeline.layouts import pipelined
    from planner.pipeline.spec import micro_batch_graph
    from planner.problems.baselines import megatron

    gpt = model_graph("gpt2", batch=8, seq=64, n_layer=4, n_head=4, n_embd=128, vocab_size=512)
    devices = get_preset("dgx-a100-80g-2")
    mg = micro_batch_graph(gpt, 4)
    cm = CostModel(mg, devices, CostOptions(optimizer="adam", master_weights=True))
    return cm, pipelined(mg, devices, 2, 4, lambda g, d: megatron(g, d, 8), "dualpipe")


def test_a_pipelined_strategy_runs_dualpipe_with_both_copies(gpt_dualpipe) -> None:  # noqa: ANN001
    from planner.pipeline.stages import chunk_problem, chunk_times, simulate_pipelined, weight_share

    cm, ps = gpt_dualpipe
    chunks = chunk_times(cm, ps)
    tl = simulate_pipelined(cm, ps)
    assert tl.schedule == "dualpipe" and len(tl.works) == 3 * 4 * 2
    params = [c.fixed_bytes - c.working_bytes for c in chunks]
    assert all(parts["parameters"] == pytest.approx(sum(params)) for parts in tl.peak_parts)
    # attention's scores have no weights: a block's weight gradients are under half its backward
    assert all(0.3 < c.weight_share < 0.5 for c in chunks)
    assert chunks[0].weight_share == weight_share(chunk_problem(cm, ps, 0).graph, 2.0)
    one = simulate_pipeline(chunks, "1f1b", 2, 4)
    assert sum(tl.busy) == pytest.approx(sum(one.busy))


def test_weight_share_is_the_weight_gradients_flops() -> None:
    from graphs import attention_block, input_op, linear

    from planner.graph.opgraph import OpGraph
    from planner.pipeline.stages import weight_share

    x = input_op("x", sample=4, channel=8)
    a = linear("a", x, 16)
    chain = OpGraph("chain", (x, a, linear("b", a, 8)))
    assert weight_share(chain, 2.0) == 0.5  # dW beside dX, each the forward's GEMM
    assert weight_share(chain, 3.0) == pytest.approx(1 / 3)
    g = attention_block()
    flops = {op.name: op.flops for op in g.ops}  # attention and loss: no weight gradient
    assert weight_share(g, 2.0) == pytest.approx(flops["proj"] / (2 * sum(flops.values())))
    assert weight_share(OpGraph("none", (x,)), 2.0) == 0.5


def test_dualpipe_pipelines_need_alike_groups(gpt_dualpipe) -> None:  # noqa: ANN001
    from planner.pipeline.spec import Pipeline, PipelinedStrategy, PipelineError
    from planner.pipeline.stages import simulate_pipelined
    from planner.problems.baselines import megatron
    from planner.problems.strategy import Strategy

    cm, ps = gpt_dualpipe
    pipe, graph, devices = ps.pipeline, ps.strategy.graph, ps.strategy.devices
    with pytest.raises(PipelineError, match=r"equally many devices, got \[4, 8\]"):
        Pipeline(pipe.bounds, (tuple(range(4)), tuple(range(8, 16))), 4, "dualpipe")
    # stage 0 on two GPUs of node 0, stage 1 on the last of node 0 and the first of node 1
    groups = ((0, 1), (7, 8))
    inner = megatron(graph, devices.subset(groups[0]), 2)
    unlike = Pipeline(pipe.bounds, groups, 4, "dualpipe")
    configs = tuple(
        type(c)(c.degrees, tuple(groups[unlike.chunk_of(i)][d] for d in c.devices), c.reduce)
        for i, c in enumerate(inner.configs)
    )
    planned = PipelinedStrategy(Strategy(graph, devices, configs), unlike)
    with pytest.raises(PipelineError, match="the two groups' devices or links differ"):
        simulate_pipelined(cm, planned)
    alike = Pipeline(pipe.bounds, ((0, 1), (2, 3)), 4, "dualpipe")
    configs = tuple(
        type(c)(c.degrees, tuple(alike.groups[alike.chunk_of(i)][d] for d in c.devices), c.reduce)
        for i, c in enumerate(inner.configs)
    )
    assert simulate_pipelined(cm, PipelinedStrategy(Strategy(graph, devices, configs), alike))


def test_the_runtime_and_the_export_refuse_dualpipe(gpt_dualpipe) -> None:  # noqa: ANN001
    import torch

    from planner.errors import ExportError
    from planner.export.pipelining import pipeline_plan
    from runtime.pipeline import check_pipelined
    from runtime.plan import RuntimeConfigError

    _, ps = gpt_dualpipe
    with pytest.raises(RuntimeConfigError, match="dualpipe schedule is timed by the planner only"):
        check_pipelined(ps.strategy.graph, ps.pipeline, ordered=False)
    with pytest.raises(ExportError, match="torch's pipelining has no 'dualpipe' schedule"):
        pipeline_plan(ps, torch.nn.Linear(2, 2))


def test_the_pipeline_search_does_not_choose_dualpipe() -> None:
    from backends.pipeline.settings import PipelineSettings
    from planner.errors import BackendError

    assert "dualpipe" not in PipelineSettings().schedules
    with pytest.raises(BackendError, match="'schedules' must be some of gpipe, 1f1b, inter"):
        PipelineSettings.of({"schedules": "dualpipe"})


@pytest.mark.parametrize("bad", [{"weight_share": 1.5}, {"weight_share": -0.1}, {"backward": -1.0}])
def test_chunk_costs_out_of_range_are_one_line(bad: dict) -> None:
    chunks = [ChunkTimes(1.0, 2.0), ChunkTimes(**({"forward": 1.0, "backward": 2.0} | bad))]
    with pytest.raises(ScheduleError, match="pipeline chunk 1"):
        simulate_pipeline(chunks, "dualpipe", 2, 4)
