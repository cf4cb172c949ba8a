"""The pipeline search under its time limit (docs/pipeline.md, "Time"): a first answer early,
what no answer exists without bounded by a grace past the limit, the best costed layout's
estimate when the limit comes before any simulation, one error line when nothing was costed,
and the clock inside the steps that take long (a chunk's simulation)."""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from typing import Any

import pytest

import planner
from backends.pipeline import search
from backends.pipeline.estimate import _figures
from backends.pipeline.select import ESTIMATE, STAGE, TWO_REPLICAS, BestFirst
from backends.pipeline.testing import PipelineConformance, small_problem
from planner.costs.costmodel import CostModel
from planner.costs.memory import usable_memory
from planner.deadline import (
    Deadline,
    OutOfTime,
    catch_interrupt,
    past,
    request_stop,
    shielded,
    stop_requested,
)
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.pipeline.spec import PipelineOutOfTime
from planner.pipeline.stages import simulate_pipelined
from planner.result import Limit, SolveOptions, Status

CHOICES = {"zero": (0,), "recompute": ("none",), "inner": ("rule",)}

# -- the clock ---------------------------------------------------------------------------------


def test_a_grace_is_a_share_of_the_limit_between_its_bounds() -> None:
    now = time.perf_counter()
    assert Deadline(now + 60, 60.0).extended(0.1, 2.0, 30.0).at == pytest.approx(now + 66)
    assert Deadline(now + 5, 5.0).extended(0.1, 2.0, 30.0).at == pytest.approx(now + 7)
    assert Deadline(now + 900, 900.0).extended(0.1, 2.0, 30.0).at == pytest.approx(now + 930)
    gone = Deadline(now - 100, 10.0).extended(0.1, 2.0, 30.0)  # counted from now once passed
    assert gone.at >= now + 2.0 and not gone.expired()
    assert math.isinf(Deadline.never().extended(0.1, 2.0, 30.0).at)


def test_a_shielded_step_sees_the_time_not_a_first_ctrl_c() -> None:
    with catch_interrupt():
        request_stop()
        assert stop_requested() and past(math.inf)
        with shielded():
            assert not stop_requested() and not past(math.inf)
            assert past(time.perf_counter() - 1.0)  # its own deadline still ends it
            assert not Deadline.after(60).expired()
        assert stop_requested()


def test_a_chunk_simulation_looks_at_its_clock() -> None:
    """An exact simulation past its deadline raises OutOfTime (it used to look at none and
    run to its end, in the background once abandoned)."""
    problem = small_problem("p100-2x2")
    lay = search.Layout(2, 2, 1, 1, 8, "1f1b", 1, "none", 0, (2, 2))
    args = (problem.graph, problem.devices, lay, problem.options, {}, {})
    with pytest.raises(OutOfTime):
        search._simulate(*args, deadline=time.perf_counter() - 1.0)
    planned, timeline = search._simulate(*args, deadline=time.perf_counter() + 600)
    assert timeline.makespan > 0 and planned.pipeline.stages == 2


def test_route_figures_are_the_transfer_times_of_every_pair() -> None:
    """The closed form's key for a group (computed once per devices and ends, every pair at
    once) holds what `DeviceGraph.transfer_time` gives for each pair."""
    devices = get_preset("dgx-h100-2")
    ends = (*range(4), *range(12, 16))
    _, routes = _figures(devices, ends)
    again = [
        float(x)
        for size in (1.0, 2.0**20)
        for x in [devices.transfer_time(a, b, size) for a in ends for b in ends]
    ]
    import numpy as np

    assert np.frombuffer(routes[0] + routes[1]).tolist() == again


# -- best first, cut short -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Measure:
    step: float
    level: int
    layout: str


class _Costed(BestFirst):
    """Stage layouts of one candidate each (the same name); a simulation takes `expected`
    seconds and finds the candidates in `unfit` do not fit."""

    def __init__(
        self,
        quick: dict[str, float],
        estimates: dict[str, float],
        expected: float,
        unfit: tuple[str, ...] = (),
    ) -> None:
        super().__init__(Deadline.after(60), [], None)
        self.estimates, self._expected, self.unfit = estimates, expected, set(unfit)
        self.simulated: list[str] = []
        for key, value in quick.items():
            self.push(value, STAGE, key)

    def rank(self, batch: list[Any], needed: bool) -> list[Any]:
        return []

    def cost(self, key: str) -> bool:
        self.push(self.estimates[key], ESTIMATE, key)
        return True

    def simulate(self, candidate: str) -> bool:
        self.simulated.append(candidate)
        if candidate not in self.unfit:
            self.keep(_Measure(self.estimates[candidate], TWO_REPLICAS, candidate))
        return True

    def everywhere(self, measure: _Measure) -> bool:
        self.settle(measure)
        return True

    def expected(self, candidate: str) -> float:
        return self._expected

    def unsimulated(self, candidate: str) -> _Measure:
        return _Measure(self.estimates[candidate], ESTIMATE, candidate)


def test_a_simulation_longer_than_the_time_left_is_set_aside_for_the_costed_estimate() -> None:
    """No simulation fits in the time left (an hour each): every stage layout is costed, none
    simulated, and the answer is the best costed candidate at its estimate, cut short."""
    fake = _Costed({"A": 1.0, "B": 2.0}, {"A": 1.5, "B": 1.2}, expected=3600.0)
    tally = fake.run()
    assert fake.simulated == [] and tally.set_aside == 2 and tally.stopped
    assert tally.answer == _Measure(1.2, ESTIMATE, "B")


def test_a_candidate_simulated_and_unfit_is_no_answer_by_estimate() -> None:
    """B was simulated and does not fit: when the time then cuts the search, the answer by
    estimate is A, not B's lower estimate."""

    class Late(_Costed):
        def late(self) -> bool:
            return bool(self.simulated)

        def expected(self, candidate: str) -> float:
            return 0.0 if candidate == "B" else 3600.0

    fake = Late({"A": 1.0, "B": 0.5}, {"A": 1.5, "B": 1.2}, expected=0.0, unfit={"B"})
    tally = fake.run()
    assert fake.simulated == ["B"] and tally.stopped
    assert tally.answer == _Measure(1.5, ESTIMATE, "A")


def test_late_in_the_time_the_best_costed_is_simulated_before_more_costing() -> None:
    """Past `due` with nothing simulated, the best candidate costed is simulated before the
    next stage layout is costed, though that one's closed form is lower: the answer at the
    limit is then a simulated one (here the time ends after that simulation)."""

    class Due(_Costed):
        def __init__(self) -> None:
            super().__init__({"A": 1.0, "B": 1.1}, {"A": 1.5, "B": 1.2}, expected=0.001)
            self.due = Deadline(time.perf_counter() - 1.0)  # passed
            self.costed_keys: list[str] = []

        def cost(self, key: str) -> bool:
            self.costed_keys.append(key)
            return super().cost(key)

        def late(self) -> bool:
            return bool(self.simulated)

    fake = Due()
    tally = fake.run()
    assert fake.costed_keys == ["A"] and fake.simulated == ["A"]
    assert tally.answer == _Measure(1.5, TWO_REPLICAS, "A") and tally.stopped


def test_with_time_to_simulate_the_answer_is_simulated() -> None:
    fake = _Costed({"A": 1.0, "B": 2.0}, {"A": 1.5, "B": 1.2}, expected=0.001)
    tally = fake.run()
    assert tally.answer.level == TWO_REPLICAS and not tally.stopped and tally.set_aside == 0


# -- the search -----------------------------------------------------------------------------------


def test_no_time_to_simulate_answers_the_best_costed_layout_at_its_estimate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every exact simulation expected to take longer than the time left: the answer is a
    valid layout within memory, its step from its costed units (said in its stats), cut by
    the limit, and near what simulating it on every device gives."""
    monkeypatch.setattr(search._Selection, "expected", lambda self, cand: math.inf)
    problem = small_problem("p100-2x2")
    options = SolveOptions(extra=CHOICES, deadline=Deadline.after(600))
    result = search.PipelineSearch().solve(problem, options)
    assert result.status is Status.FEASIBLE and result.limit is Limit.TIME
    assert not result.stats["answer_simulated"] and result.stats["simulated_exactly"] == 0
    assert result.stats["answer_simulated_on"].startswith("no device")
    PipelineConformance().check_valid(problem, result)
    usable = usable_memory(problem.devices, problem.options.headroom, problem.options.reserve)
    assert result.peak_bytes <= float(usable.min())
    assert result.objective == result.timeline.makespan
    cm = CostModel(result.planned.strategy.graph, problem.devices, result.cost_options)
    exact = simulate_pipelined(cm, result.planned).makespan
    assert result.objective == pytest.approx(exact, rel=0.25)


def test_the_cheapest_layout_to_cost_is_costed_first() -> None:
    """With a time limit, the first costing is the stage layout whose units are simulated
    on the fewest devices (here a stage of 1 device per replica), not the best ranked."""
    problem = small_problem("p100-2x2")
    costed: list[tuple[Any, ...]] = []
    real = search._cost

    def watch(space: Any, fitting: list[Any], *args: Any, **kwargs: Any) -> Any:
        costed.extend(fitting)
        return real(space, fitting, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search, "_cost", watch)
        timed = search.PipelineSearch().solve(
            problem, SolveOptions(extra=CHOICES, deadline=Deadline.after(600))
        )
    space = search._Space(problem, search.PipelineSettings.of(CHOICES, "x"), math.inf, 0.0)
    sizes = [search._costing_devices(space, k) for k in costed]
    assert timed.has_solution and sizes[0] == min(sizes)
    untimed = search.PipelineSearch().solve(
        problem, SolveOptions(extra=CHOICES, deadline=Deadline.never())
    )  # the same answer: the first costing only adds a candidate
    assert (untimed.layout, untimed.objective) == (timed.layout, timed.objective)


def _stuck(options: Any, measured: Any, ch: Any, deadline: float = math.inf) -> Any:
    """A chunk simulation that never ends but looks at its clock."""
    while not past(deadline):
        time.sleep(0.01)
    raise OutOfTime


def test_nothing_costed_within_the_limit_and_its_grace_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every costing stuck: the search gives up at the grace's end with one line that says
    to raise the limit, and `plan` does not turn to the per-op search (it would have less
    time still)."""
    import planner.api

    monkeypatch.setattr(search, "simulate_chunk", _stuck)
    per_op: list[int] = []
    monkeypatch.setattr(planner.api, "_per_op_after_refusal", lambda *a: per_op.append(1))
    graph = model_graph("gpt2", batch=8, seq=64, n_layer=4, n_head=4, n_embd=128, vocab_size=512)
    with pytest.raises(PipelineOutOfTime) as err:
        planner.plan(graph, "p100-2x2", time_limit=0.5)
    message = str(err.value)
    assert "raise the time limit" in message and "\n" not in message and not per_op


def test_a_first_ctrl_c_lets_the_first_costing_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C during the costing the search has no answer without: the costing goes on
    (shielded) and the search answers with it, limit INTERRUPTED."""
    real = search.unit_costs
    calls: list[int] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            request_stop()  # in the middle of the first costing
            assert not stop_requested()  # shielded
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "unit_costs", interrupted)
    problem = small_problem("p100-2x2")
    with catch_interrupt():
        result = search.PipelineSearch().solve(
            problem, SolveOptions(extra=CHOICES, deadline=Deadline.after(600))
        )
    assert result.has_solution and result.limit is Limit.INTERRUPTED and len(calls) == 1


def test_a_past_deadline_with_every_costing_stuck_returns_at_the_graces_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deadline already past and every costing stuck: the search returns at its grace's
    end (in a thread: it must not hang), NO_SOLUTION with limit TIME and its one line."""
    monkeypatch.setattr(search, "simulate_chunk", _stuck)
    problem = small_problem("p100-2x2")
    gone = Deadline(time.perf_counter() - 1.0, 1.0)
    done: list[Any] = []
    worker = threading.Thread(
        target=lambda: done.append(
            search.PipelineSearch().solve(problem, SolveOptions(extra=CHOICES, deadline=gone))
        ),
        daemon=True,
    )
    worker.start()
    worker.join(120)
    assert done, "the search did not return"
    result = done[0]
    assert result.status is Status.NO_SOLUTION and result.limit is Limit.TIME
    assert "raise the time limit" in result.message and "\n" not in result.message


# -- models too large for the whole search in the limit (slow) ---------------------------------


def _say(label: str, out: Any, seconds: float) -> None:
    load = os.getloadavg()[0]
    print(
        f"{label}: {seconds:.1f} s at load {load:.1f}: {out.layout.describe()}, "
        f"{out.objective:.4f} s on {out.stats['answer_simulated_on']}, "
        f"{out.stats['memory_peak_bytes'] / 2**30:.1f} GiB"
    )


def _valid(out: Any, devices: int) -> None:
    lay = out.layout
    assert out.has_solution and out.stats["memory_fits"] and out.stats["stopped_by_time_limit"]
    assert lay.stages * lay.tensor * lay.context * lay.data == devices
    groups = out.planned.pipeline.groups
    assert sorted(d for g in groups for d in g) == list(range(devices))


@pytest.mark.slow
def test_mixtral_on_64_h100s_in_10_s_answers_cut_by_the_limit() -> None:
    """Mixtral 8x7B on 64 H100s, whose whole search takes 20-40 s: at 10 s the answer is
    valid and cut by the limit. Time and load printed; the time only loosely asserted."""
    t0 = time.perf_counter()
    out = planner.plan("mixtral-8x7b", "dgx-h100-8", time_limit=10)
    seconds = time.perf_counter() - t0
    _say("mixtral-8x7b at 10 s", out, seconds)
    assert isinstance(out, planner.PipelinePlan) and out.limit is Limit.TIME
    _valid(out, 64)
    assert seconds < 2 * 10 + out.stats["first_answer_grace_seconds"]


@pytest.mark.slow
def test_deepseek_v3_like_on_2048_h800s_answers_within_its_limit() -> None:
    """The issue's case: DeepSeek-V3-like on 2,048 H800s with the default 60 s limit took
    126 s, its first costing and simulation past the limit. Now a valid plan, cut by the
    limit; the time only loosely asserted (it was 126 s)."""
    t0 = time.perf_counter()
    out = planner.plan("deepseek-v3-like", "hgx-h800-256")
    seconds = time.perf_counter() - t0
    _say("deepseek-v3-like at 60 s", out, seconds)
    assert isinstance(out, planner.PipelinePlan) and out.limit is Limit.TIME
    _valid(out, 2048)
    assert seconds < 1.5 * 60


def test_a_simulation_out_of_turn_counts_against_the_exact_cap() -> None:
    """`_due` simulates the best costed candidate first when it is time; with `exact`
    simulations already run (the cap), it does not: the cap bounds every simulation."""
    from backends.pipeline.select import ESTIMATE, BestFirst

    class Fake(BestFirst):
        def rank(self, batch, needed):  # type: ignore[no-untyped-def]
            return batch

        def cost(self, key):  # type: ignore[no-untyped-def]
            return True

        def simulate(self, candidate):  # type: ignore[no-untyped-def]
            return True

        def everywhere(self, measure):  # type: ignore[no-untyped-def]
            return True

        def expected(self, candidate):  # type: ignore[no-untyped-def]
            return 0.0

    def due_with(cap: int | None, simulated: int) -> object:
        fake = Fake(Deadline.after(60.0), [], cap, due=Deadline.after(0.0))
        fake.push(1.0, ESTIMATE, "layout")
        fake.tally.simulated = simulated
        return fake._due()

    assert due_with(None, 1) == "layout" and due_with(2, 1) == "layout"
    assert due_with(1, 1) is None
