"""Pipeline schedules and their timelines: orders, the bubble's closed form, in-flight
activations, messages and sync."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    ScheduleError,
    Work,
    bubble_fraction,
    in_flight,
    schedule,
)
from planner.pipeline.timeline import ChunkTimes, simulate_pipeline


def _valid(orders: tuple[tuple[Work, ...], ...], p: int, m: int, v: int) -> None:
    """Each group runs exactly its chunks' works, every forward before its backward."""
    for g, order in enumerate(orders):
        want = {
            Work(k, i, c) for k in (FORWARD, BACKWARD) for i in range(m) for c in range(g, p * v, p)
        }
        assert set(order) == want and len(order) == len(want)
        pos = {w: k for k, w in enumerate(order)}
        assert all(
            pos[Work(FORWARD, w.micro, w.chunk)] < k
            for k, w in enumerate(order)
            if w.kind == BACKWARD
        )


@pytest.mark.parametrize(
    "name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)]
)
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 8), (4, 4), (3, 6), (4, 12)])
def test_uniform_stages_idle_the_closed_form_share(name: str, v: int, p: int, m: int) -> None:
    orders = schedule(name, p, m, v)
    _valid(orders, p, m, v)
    chunks = [ChunkTimes(forward=1.0 / v, backward=2.0 / v)] * (p * v)
    tl = simulate_pipeline(chunks, name, p, m)
    assert math.isclose(tl.bubble, bubble_fraction(name, p, m, v), rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(tl.makespan, (m + (p - 1) / v) * 3.0, rel_tol=1e-12)


def test_one_f_one_b_keeps_fewer_micro_batches_than_gpipe() -> None:
    p, m = 4, 8
    gpipe = [in_flight(o) for o in schedule("gpipe", p, m)]
    ofob = [in_flight(o) for o in schedule("1f1b", p, m)]
    assert gpipe == [m] * p and ofob == [p - s for s in range(p)]
    chunks = [ChunkTimes(1.0, 2.0, activation_bytes=10.0, fixed_bytes=5.0)] * p
    tl = simulate_pipeline(chunks, "1f1b", p, m)
    assert tl.peak_bytes == tuple(5.0 + 10.0 * (p - s) for s in range(p))
    assert simulate_pipeline(chunks, "gpipe", p, m).peak_bytes == (5.0 + 10.0 * m,) * p


def test_messages_and_sync_lengthen_the_step() -> None:
    p, m = 2, 4
    free = simulate_pipeline([ChunkTimes(1.0, 2.0)] * p, "1f1b", p, m)
    sent = simulate_pipeline(
        [ChunkTimes(1.0, 2.0, send_forward=0.5, send_backward=0.5)] * p, "1f1b", p, m
    )
    assert free.makespan == pytest.approx((m + p - 1) * 3.0)
    # by hand: stage 1 runs F0 at 1.5 (after F0 on stage 0 and its message), B0 at 2.5, whose
    # gradient reaches stage 0 at 5.0; from then on each of stage 0's backwards waits for a
    # round trip: B0 5-7, F2 7-8, B1 8-10, F3 10-11, B2 12-14, B3 15-17
    assert sent.makespan == pytest.approx(17.0)
    assert len(sent.messages) == 2 * m and all(s.end - s.start == 0.5 for s in sent.messages)
    synced = simulate_pipeline([ChunkTimes(1.0, 2.0, sync=0.25)] * p, "1f1b", p, m)
    # group 0 finishes last (its last backward waits for group 1's): its sync ends the step
    assert synced.makespan == pytest.approx(free.makespan + 0.25)


def test_interleaved_syncs_overlap_the_earlier_chunks_backwards() -> None:
    """The interleaved backward runs a group's chunks in reverse: a later chunk's last
    backward ends first, and its sync starts then, under the group's backwards of earlier
    chunks (Megatron-Core's overlapped gradient reduce). Only the first chunk's sync is
    left after the group's last backward. (Ordered by chunk index, every sync waited for
    the first chunk's, after the last backward: 4 x 0.5 s past it.)"""
    p, m, v = 2, 4, 4
    chunks = [ChunkTimes(1.0, 2.0, sync=0.5)] * (p * v)
    tl = simulate_pipeline(chunks, "interleaved", p, m)
    free = simulate_pipeline([ChunkTimes(1.0, 2.0)] * (p * v), "interleaved", p, m)
    for g in range(p):
        last_backward = max(s.end for s in tl.works if s.group == g)
        mine = sorted((s for s in tl.syncs if s.group == g), key=lambda s: s.start)
        assert [s.work.chunk for s in mine] == list(range(g + (v - 1) * p, -1, -p))
        assert all(s.end <= last_backward for s in mine[:-1])  # under later backwards
        assert mine[-1].work.chunk == g and mine[-1].start == last_backward
    assert [s.work.chunk for s in tl.syncs] == list(range(p * v))  # listed in chunk order
    assert tl.makespan == pytest.approx(free.makespan + 0.5)
    # without the overlapped reduce (Megatron-LM's default) every sync follows the flush
    late = simulate_pipeline(chunks, "interleaved", p, m, grad_overlap=0.0)
    for g in range(p):
        last_backward = max(s.end for s in late.works if s.group == g)
        assert all(s.start >= last_backward for s in late.syncs if s.group == g)
    assert late.makespan == pytest.approx(free.makespan + v * 0.5)
    half = simulate_pipeline(chunks, "interleaved", p, m, grad_overlap=0.5)
    assert tl.makespan < half.makespan < late.makespan


def test_messages_on_one_link_go_one_at_a_time() -> None:
    # a fast first stage sends its outputs faster than the link carries them
    chunks = [ChunkTimes(0.1, 0.1, send_forward=1.0), ChunkTimes(0.1, 0.1)]
    tl = simulate_pipeline(chunks, "gpipe", 2, 3)
    forward = sorted((s.start, s.end) for s in tl.messages if s.work.kind == FORWARD)
    assert all(b[0] >= a[1] for a, b in zip(forward, forward[1:], strict=False))


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 5),
    rounds=st.integers(1, 4),
    v=st.integers(1, 3),
    data=st.data(),
)
def test_every_schedule_is_a_valid_order_and_no_faster_than_its_busiest_group(
    p: int, rounds: int, v: int, data: st.DataObject
) -> None:
    m = p * rounds
    name = "interleaved" if v > 1 else data.draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    times = st.floats(0.01, 2.0)
    chunks = [ChunkTimes(data.draw(times), data.draw(times), data.draw(times), data.draw(times))
              for _ in range(p * v)]  # fmt: skip
    _valid(schedule(name, p, m, v), p, m, v)
    tl = simulate_pipeline(chunks, name, p, m)
    assert tl.makespan >= max(tl.busy) - 1e-9
    ends = {s.work: s.end for s in tl.works}
    starts = {s.work: s.start for s in tl.works}
    for w, t in starts.items():  # data dependencies hold
        if w.kind == FORWARD and w.chunk > 0:
            assert t >= ends[Work(FORWARD, w.micro, w.chunk - 1)] - 1e-12
        if w.kind == BACKWARD:
            assert t >= ends[Work(FORWARD, w.micro, w.chunk)] - 1e-12
            if w.chunk < p * v - 1:
                assert t >= ends[Work(BACKWARD, w.micro, w.chunk + 1)] - 1e-12


def test_bad_schedules_are_one_line_errors() -> None:
    with pytest.raises(ScheduleError, match="unknown pipeline schedule 'zb'"):
        schedule("zb", 2, 4)
    with pytest.raises(ScheduleError, match="6 micro-batches is not a multiple of 4"):
        schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="need the 'interleaved' schedule"):
        schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="micro-batches >= 1, got 0"):
        schedule("1f1b", 2, 0)
    with pytest.raises(ScheduleError, match="do not spread evenly over 2 stages"):
        simulate_pipeline([ChunkTimes(1.0, 1.0)] * 3, "1f1b", 2, 4)


@pytest.mark.parametrize("p, v", [(4, 2), (8, 5), (4, 20)])
def test_interleaved_first_stage_keeps_korthikantis_count(p: int, v: int) -> None:
    # Korthikanti et al. 2022, Sec. 4.2.3: with L layers in p v chunks, the first stage of
    # interleaved 1F1B keeps L (1 + (p - 1) / (p v)) layers' activations, 1F1B's p x L / p
    m, layers = 4 * p, p * v
    chunks = [ChunkTimes(1.0, 2.0, activation_bytes=1.0)] * (p * v)  # a layer per chunk
    tl = simulate_pipeline(chunks, "interleaved", p, m)
    assert tl.peak_bytes[0] == pytest.approx(layers * (1 + (p - 1) / (p * v)))
    assert tl.peak_parts[0]["activations"] == tl.peak_bytes[0]
    one = [ChunkTimes(1.0, 2.0, activation_bytes=float(v))] * p  # v layers per stage
    assert simulate_pipeline(one, "1f1b", p, m).peak_bytes[0] == layers


def test_a_stage_keeps_its_largest_working_set_once() -> None:
    # two chunks per stage, each with parameters and a working set (a recomputed block's,
    # or the loss's gradient): the parameters add up, the working sets do not
    p, m = 2, 4  # v = 2 chunks per stage: chunks 0, 2 on stage 0, 1, 3 on stage 1
    chunks = [
        ChunkTimes(1.0, 2.0, activation_bytes=1.0, fixed_bytes=10.0 + w, working_bytes=w)
        for w in (3.0, 1.0, 2.0, 5.0)
    ]
    tl = simulate_pipeline(chunks, "interleaved", p, m)
    parts = tl.peak_parts
    assert parts[0]["parameters"] == 20.0 and parts[0]["working_set"] == 3.0
    assert parts[1]["parameters"] == 20.0 and parts[1]["working_set"] == 5.0
    assert tl.peak_bytes == tuple(sum(q.values()) for q in parts)
