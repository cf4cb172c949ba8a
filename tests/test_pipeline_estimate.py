"""The pipeline search's estimates and its rule for what it simulates and returns: the
closed-form estimate of a stage layout against its costing, a candidate's estimate against
its simulation, the in-flight counts and blocks per stage, and best first on fake steps."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import pytest

import backends.pipeline.search as search
from backends.pipeline.candidates import balance, in_flight_counts, splits, sync_tail, virtuals
from backends.pipeline.estimate import closed_form_chunk
from backends.pipeline.select import ESTIMATE, EVERY_DEVICE, STAGE, TWO_REPLICAS, BestFirst
from backends.pipeline.settings import PipelineSettings
from backends.pipeline.units import Unit, Units, parameter_state, unit_costs
from planner.costs.costmodel import CostOptions
from planner.deadline import Deadline
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.pipeline.problem import PipelineProblem
from planner.pipeline.schedule import in_flight, schedule
from planner.pipeline.stages import simulate_chunk
from planner.pipeline.timeline import ChunkTimes, simulate_pipeline
from planner.problems.baselines import megatron

OPTIONS = CostOptions(optimizer="adam", master_weights=True)
GPT = {"seq": 64, "n_layer": 8, "n_head": 8, "n_embd": 256, "vocab_size": 512}


def _space(devices: str, layers: int = 8, **settings: Any) -> search._Space:
    graph = model_graph("gpt2", batch=32, **(GPT | {"n_layer": layers}))
    problem = PipelineProblem(graph, get_preset(devices), OPTIONS)
    chosen = PipelineSettings.of({"inner": "rule", **settings}, "the pipeline search")
    return search._Space(problem, chosen, 80e9, parameter_state(graph, OPTIONS))


def _ranks(x: list[float]) -> np.ndarray:
    return np.argsort(np.argsort(np.asarray(x)))


def test_the_closed_form_ranks_stage_layouts_as_their_costing_does() -> None:
    """Each stage layout's estimate without a simulation (the cost model's per-op times)
    beside the one its costing gives (three small simulations): the same order, nearly
    (rank correlation 0.93 here, above 0.85; 0.997 on the 48-layer GPT of docs/pipeline.md),
    and the best costed among the first three estimated."""
    space = _space("dgx-a100-80g-2", recompute="none", zero=0)
    fitting = search._holding(space, search._stage_layouts(space))
    ranked = search._rank(space, fitting, None)
    quick = dict((key, value) for value, key in ranked.estimates)
    costed = {}
    for key in quick:
        found = search._cost(space, [key], Deadline.never()).found
        costed[key] = min(c.estimate for c in found)
    keys = sorted(quick)
    assert len(keys) >= 20
    rho = np.corrcoef(_ranks([quick[k] for k in keys]), _ranks([costed[k] for k in keys]))[0, 1]
    assert rho > 0.85
    best = min(keys, key=lambda k: costed[k])
    assert best in sorted(keys, key=lambda k: quick[k])[:3]


def test_the_closed_form_keeps_the_simulations_memory() -> None:
    """The closed form counts memory as the simulation does (`CostModel.memory_parts`): a
    stage layout none of whose candidates fits by it is one its costing would drop too."""
    graph = model_graph("gpt2", batch=4, **GPT)
    devices = get_preset("dgx-a100-80g-2")
    group = devices.subset(range(8))
    options = dataclasses.replace(OPTIONS, recompute="full", zero=1)
    simulated = unit_costs(graph, devices, group, 4, options, 8, 2, megatron, simulate_chunk)
    closed = unit_costs(graph, devices, group, 4, options, 8, 2, megatron, closed_form_chunk)
    for name in ("first", "middle", "last"):
        a, b = getattr(simulated, name), getattr(closed, name)
        assert (a.kept, a.params, a.working) == (b.kept, b.params, b.working)


def test_an_interleaved_estimate_counts_its_chunks_syncs() -> None:
    """Interleaved, a stage's chunks sync one at a time as their last backwards end (the
    pipeline's timeline): the estimate counts what they leave after the stage's last
    backward (`sync_tail`) and comes within 13% of the simulation (uneven chunks: their
    stages' fill and drain approximated; 12% below to 11% above here); every chunk's sync added, as
    when the timeline ran them all after the last backward, was 6-9% above; the largest
    chunk's sync alone up to 20% below. 8 blocks: equal chunks; 10 blocks on 4 stages:
    uneven ones."""
    uneven = 0
    for layers in (8, 10):
        space = _space("dgx-a100-80g-2", layers, zero=0)
        options = space.cost_options("none", 0)
        for key in [(2, 1, 1, "none", 0, "rule", 1, 1), (4, 1, 1, "none", 0, "rule", 1, 1)]:
            for cand in search._cost(space, [key], Deadline.never()).found:
                if cand.layout.virtual == 1:
                    continue
                graph, devices = space.problem.graph, space.problem.devices
                _, timeline = search._simulate(
                    graph, devices, cand.layout, options, space.micro, space.groups
                )
                assert cand.estimate == pytest.approx(timeline.makespan, rel=0.13)
                uneven += len(set(cand.layout.blocks)) > 1
    assert uneven >= 3


def test_the_sync_tail_bounds_the_timelines() -> None:
    """`sync_tail`, a stage's syncs past its last backward in closed form, is never below
    what the pipeline's timeline leaves there (it takes the shortest gaps between the
    chunks' last backwards), equals it on one chunk per stage or without overlap, and
    interleaved it hides a later chunk's overlapped sync under the backwards of the chunks
    before it."""
    rng = random.Random(0)
    for _ in range(200):
        p, v = rng.randint(1, 5), rng.randint(1, 4)
        name = "interleaved" if v > 1 else rng.choice(["gpipe", "1f1b"])
        m = p * rng.randint(1, 4)
        overlap = rng.choice([0.0, 0.3, 1.0])
        chunks = [
            ChunkTimes(rng.uniform(0.1, 1.0), rng.uniform(0.2, 2.0), sync=rng.uniform(0, 3))
            for _ in range(p * v)
        ]
        timeline = simulate_pipeline(chunks, name, p, m, grad_overlap=overlap)
        for g in range(p):
            last = max(s.end for s in timeline.works if s.group == g)
            tail = max(s.end for s in timeline.syncs if s.group == g) - last
            estimate = sync_tail(chunks[g::p], p, overlap)
            assert estimate >= tail - 1e-9
            if v == 1 or overlap == 0:
                assert estimate == pytest.approx(tail, abs=1e-9)
    uniform = [ChunkTimes(1.0, 2.0, sync=0.5)] * 8  # 2 stages of 4 chunks
    assert sync_tail(uniform[0::2], 2) == 0.5  # not 4 x 0.5
    assert sync_tail(uniform[0::2], 2, overlap=0.0) == 2.0  # after the flush: all of them


def test_without_the_overlapped_reduce_the_syncs_wait_for_the_flush() -> None:
    """`grad_overlap` 0.5 (`CostOptions.dp_overlap`): half of each chunk's sync runs under
    the earlier chunks' backwards, the other half after the stage's last backward, in the
    timeline and in `sync_tail` alike. By hand, stage 0's chunks 0, 2, 4, 6 (syncs 0.5, 0.4,
    0.6, 0.5 s; their last backwards 4 s apart, room for every early half): past the last
    backward, chunk 0's early half and then every late half, 0.25 + 1.0 = 1.25 s."""
    p, m = 2, 4
    syncs = (0.5, 0.3, 0.4, 0.2, 0.6, 0.1, 0.5, 0.3)
    chunks = [ChunkTimes(1.0, 2.0, sync=s) for s in syncs]
    timeline = simulate_pipeline(chunks, "interleaved", p, m, grad_overlap=0.5)
    for g, want in ((0, 1.25), (1, 0.15 + 0.45)):
        last = max(s.end for s in timeline.works if s.group == g)
        tail = max(s.end for s in timeline.syncs if s.group == g) - last
        assert tail == pytest.approx(want)
        assert sync_tail(chunks[g::p], p, 0.5) == pytest.approx(want)
    assert sync_tail(chunks[0::p], p) == 0.5  # all overlapped: chunk 0's sync only


def test_in_flight_counts_are_the_schedules_own() -> None:
    for name in ("gpipe", "1f1b", "interleaved"):
        for p in range(1, 6):
            for m in range(1, 10):
                for v in (1, 2, 3) if name == "interleaved" else (1,):
                    if name == "interleaved" and m % p:
                        continue
                    orders = schedule(name, p, m, v)
                    assert in_flight_counts(name, p, m, v) == tuple(in_flight(o) for o in orders)


def _units(first: float, last: float) -> Units:
    """Units of a block of 1 s of work per micro-batch; the first and last ranges `first`
    and `last` seconds (block 0 and the embeddings; the last block, head and loss)."""

    def unit(work: float) -> Unit:
        return Unit(work / 3, 2 * work / 3, 0.0, 1.0, 1.0, 0.0)

    return Units(unit(first), unit(1.0), unit(last), 0.0)


def test_a_heavy_head_makes_the_last_stage_lighter() -> None:
    """A head and loss weighing four blocks (a 128k vocabulary on a narrow model): with 16
    stages of 126 blocks each stage does (126 + 4) / 16 blocks' work, so the last holds
    about four blocks fewer than the first; the splits tried are centred there."""
    first, last = balance(126, 16, _units(1.0, 5.0))
    assert (first, last) == (8, 4)
    tried = splits(126, 16, 1, _units(1.0, 5.0))
    assert all(sum(s) == 126 and len(s) == 16 and min(s) >= 1 for s in tried)
    assert [8, *[8] * 14, 6] in tried or [8, *[8] * 13, 7, 6] in tried
    assert not any(s[-1] > 7 for s in tried)


def test_126_blocks_over_16_stages_are_searched() -> None:
    """Megatron-LM's way for a model of 126 layers on 16 stages (7, 8 x 14, 7) is a split
    the search tries when the first and last stages weigh about a block each."""
    tried = splits(126, 16, 1, _units(1.0, 1.0))
    assert [7, *[8] * 14, 7] in tried


def test_interleaved_chunks_need_not_divide_the_blocks() -> None:
    """126 blocks on 16 stages interleaved (Llama 3 405B's layout): no v >= 2 cuts them into
    equal chunks, yet every v up to 7 (a block per chunk at least) is a candidate, its
    chunks one block apart at most between the first and last; 96 blocks divide into 32
    equal chunks, the only split tried then, and 48 blocks on 2 stages are interleaved
    only at the v that divide them."""
    assert virtuals("interleaved", 16, 16, 126) == [2, 3, 4, 5, 6, 7]
    for v in (2, 7):
        tried = splits(126, 16, v, _units(1.0, 1.0))
        assert tried and all(len(s) == 16 * v and sum(s) == 126 and min(s) >= 1 for s in tried)
        assert any(max(s[1:-1]) - min(s[1:-1]) <= 1 for s in tried)
    assert splits(96, 16, 2, _units(1.0, 1.0)) == [[3] * 32]
    assert virtuals("interleaved", 2, 4, 48) == [2, 3, 4, 6, 8, 12, 24]
    assert virtuals("interleaved", 16, 8, 126) == []  # m not a multiple of p


# -- best first on fake steps ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Measure:
    step: float
    level: int
    layout: str


class _Fake(BestFirst):
    """Stage layouts "A" and "B", each one candidate of the same name; steps by level."""

    def __init__(
        self, quick: dict[str, float], steps: dict[str, dict[int, float]], tolerance: float = 0.0
    ) -> None:
        super().__init__(Deadline.never(), [], None, tolerance)
        self.steps = steps
        self.done: list[tuple[str, int]] = []
        for key, value in quick.items():
            self.push(value, STAGE, key)

    def rank(self, batch: list[Any], needed: bool) -> list[Any]:
        return []

    def cost(self, key: str) -> bool:
        self.done.append((key, STAGE))
        self.push(self.steps[key][ESTIMATE], ESTIMATE, key)
        return True

    def simulate(self, candidate: str) -> bool:
        self.done.append((candidate, ESTIMATE))
        self.keep(_Measure(self.steps[candidate][TWO_REPLICAS], TWO_REPLICAS, candidate))
        return True

    def everywhere(self, measure: _Measure) -> bool:
        self.done.append((measure.layout, TWO_REPLICAS))
        full = self.steps[measure.layout].get(EVERY_DEVICE)
        if full is None:  # too large: two replicas are its measure
            self.settle(measure)
        else:
            self.keep(_Measure(full, EVERY_DEVICE, measure.layout))
        return True


def test_best_first_measures_what_is_estimated_below_the_answer() -> None:
    """A looks best until simulated on every device (1.5); B, estimated at 1.1 and too large
    for every device, is measured at 1.2 on two replicas: B is the answer, A is not taken
    on its two-replica step (1.0) against B's, nor B's estimate left unmeasured."""
    steps = {
        "A": {ESTIMATE: 0.95, TWO_REPLICAS: 1.0, EVERY_DEVICE: 1.5},
        "B": {ESTIMATE: 1.1, TWO_REPLICAS: 1.2},
    }
    fake = _Fake({"A": 0.9, "B": 1.05}, steps)
    tally = fake.run()
    assert tally.answer.layout == "B" and tally.answer.step == 1.2
    assert ("B", TWO_REPLICAS) in fake.done and not tally.stopped


def test_best_first_stops_once_the_answer_is_below_every_other_value() -> None:
    """B's closed-form estimate (2.0) is above A's step on every device (1.2): B is never
    costed."""
    steps = {
        "A": {ESTIMATE: 1.0, TWO_REPLICAS: 1.1, EVERY_DEVICE: 1.2},
        "B": {ESTIMATE: 0.5, TWO_REPLICAS: 0.5, EVERY_DEVICE: 0.5},
    }
    fake = _Fake({"A": 0.9, "B": 2.0}, steps)
    tally = fake.run()
    assert tally.answer.layout == "A" and tally.answer.step == 1.2
    assert all(key == "A" for key, _ in fake.done)


def test_best_first_stops_within_the_gap_tolerance() -> None:
    """A settles at 1.2 on every device; B's closed-form estimate (1.15) could beat it by
    4%, within a 10% gap tolerance: B is not costed (at tolerance 0 it is, and wins)."""
    steps = {
        "A": {ESTIMATE: 1.0, TWO_REPLICAS: 1.1, EVERY_DEVICE: 1.2},
        "B": {ESTIMATE: 1.15, TWO_REPLICAS: 1.15, EVERY_DEVICE: 1.15},
    }
    near = _Fake({"A": 0.9, "B": 1.15}, steps, tolerance=0.1)
    tally = near.run()
    assert tally.answer.layout == "A" and all(key == "A" for key, _ in near.done)
    exact = _Fake({"A": 0.9, "B": 1.15}, steps).run()
    assert exact.answer.layout == "B" and exact.answer.step == 1.15


def test_cut_short_the_answer_is_one_measured_as_far_as_it_can_be() -> None:
    """B is settled on every device (1.2); A has a two-replica step of 1.0 when the time
    runs out, not yet simulated on every device (where it would take 1.5): the answer is B,
    not A's optimistic two-replica step."""
    steps = {
        "A": {ESTIMATE: 0.92, TWO_REPLICAS: 1.0, EVERY_DEVICE: 1.5},
        "B": {ESTIMATE: 0.6, TWO_REPLICAS: 0.7, EVERY_DEVICE: 1.2},
    }

    class Late(_Fake):
        def late(self) -> bool:  # the time runs out once A is simulated on two replicas
            return ("A", ESTIMATE) in self.done

    tally = Late({"A": 0.9, "B": 0.5}, steps).run()
    assert tally.stopped and tally.answer.layout == "B" and tally.answer.step == 1.2


def test_a_layout_left_on_two_replicas_for_want_of_time_is_not_trusted() -> None:
    """A's two-replica step (1.0) is the lowest value, but the time left is too short to
    simulate it on every device (where it takes 1.5): the search sets it aside and answers
    with B, settled on every device (1.2), rather than trust A's two-replica step."""
    steps = {
        "A": {ESTIMATE: 0.92, TWO_REPLICAS: 1.0, EVERY_DEVICE: 1.5},
        "B": {ESTIMATE: 0.6, TWO_REPLICAS: 0.7, EVERY_DEVICE: 1.2},
    }

    class Short(_Fake):
        def everywhere(self, measure: _Measure) -> bool:
            if measure.layout == "A":  # too little time left for it
                self.settle(measure, for_want_of_time=True)
                return True
            return super().everywhere(measure)

    tally = Short({"A": 0.9, "B": 0.5}, steps).run()
    assert tally.stopped and tally.answer.layout == "B" and tally.answer.step == 1.2


def test_late_with_no_answer_the_shortest_way_to_one() -> None:
    """The time limit was spent before the search began: A is costed (an answer needs one),
    then its candidate is simulated at once, though B's closed-form estimate (0.6) is below
    A's costed estimate (1.0): B is not costed."""
    steps = {
        "A": {ESTIMATE: 1.0, TWO_REPLICAS: 1.1, EVERY_DEVICE: 1.2},
        "B": {ESTIMATE: 0.7, TWO_REPLICAS: 0.8, EVERY_DEVICE: 0.9},
    }

    class Late(_Fake):
        def late(self) -> bool:
            return True

    fake = Late({"A": 0.5, "B": 0.6}, steps)
    tally = fake.run()
    assert tally.stopped and tally.answer.layout == "A" and ("B", STAGE) not in fake.done
