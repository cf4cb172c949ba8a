"""Refusals said at once and named for what stopped the call (issue 42): memory that nothing
fits beats the clock, a Ctrl-C says "interrupted", a memory limit below any answer's least
footprint is not searched, and options that would do nothing are one line."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import numpy as np
import pytest

import planner
import planner.api
import planner.problems.sizes
import planner.sources
from planner.costs.costmodel import CostOptions
from planner.deadline import Deadline, OutOfTime, clear_stop, request_stop
from planner.errors import LayerwiseError
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import model_graph
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.pipeline.problem import PipelineProblem
from planner.problems.problem import Problem
from planner.problems.sizes import MemoryRefusal, SizeError, least_memory
from planner.result import SolveOptions

TINY_GPT = {"seq": 16, "n_layer": 3, "n_head": 2, "n_embd": 32, "vocab_size": 128, "block_size": 16}


@pytest.fixture(scope="module")
def gpt() -> OpGraph:
    return model_graph("gpt2", batch=4, **TINY_GPT)


@pytest.fixture(autouse=True)
def _no_stop_left() -> Any:
    yield
    clear_stop()


def _with_memory(name: str, memory: float) -> DeviceGraph:
    base = get_preset(name)
    devices = [dataclasses.replace(d, memory=memory) for d in base.devices]
    return DeviceGraph(base.name, devices, base.links, base.switches)


def _count(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# -- memory that nothing fits, before the clock ---------------------------------------------


def test_parameters_that_no_device_count_holds_are_refused_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The parameters' training state alone exceeds the devices' memory: no ZeRO stage,
    recomputation or pipeline can help, so the call says so after one capture and one check
    (it used to capture and build again per fallback, and could end on the time limit)."""
    captures = _count(monkeypatch, planner.sources, "_capture")
    checks = _count(monkeypatch, planner.problems.sizes, "check_memory_fits")
    hopeless = _with_memory("p100-1x2", 1e3)
    with pytest.raises(MemoryRefusal) as caught:
        planner.plan("gpt2", hopeless, model_kwargs={"batch": 4, **TINY_GPT}, optimizer="adam")
    message = str(caught.value)
    assert caught.value.final and "training state alone" in message
    assert "use at least" in message and "devices of" in message
    assert "time limit" not in message
    assert len(captures) == 1 and len(checks) == 1


def test_a_known_memory_refusal_wins_over_the_clock(
    gpt: OpGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain plan does not fit; the fallback (ZeRO and recomputation "auto") runs out of
    time building: the error is what is known, the memory, not "did not finish"."""
    real = planner.api.problem_of
    builds: list[int] = []

    def out_of_time_after_the_first(*args: Any, **kwargs: Any) -> Any:
        builds.append(1)
        if len(builds) > 1:
            raise OutOfTime
        return real(*args, **kwargs)

    monkeypatch.setattr(planner.api, "problem_of", out_of_time_after_the_first)
    tight = _with_memory("p100-1x2", 0.99 * least_memory(gpt, CostOptions()) / 2)
    with pytest.raises(MemoryRefusal) as caught:
        planner.plan(gpt, tight, pipeline=False, recommend=False)
    message = str(caught.value)
    assert "needs at least" in message and "time limit ran out" in message
    assert "did not finish" not in message and len(builds) == 2


# -- Ctrl-C -----------------------------------------------------------------------------------


def test_ctrl_c_during_the_build_says_interrupted(
    gpt: OpGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = planner.api.problem_of

    def ctrl_c_then_build(*args: Any, **kwargs: Any) -> Any:
        request_stop()  # what the first Ctrl-C does (planner.deadline._handle)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner.api, "problem_of", ctrl_c_then_build)
    with pytest.raises(KeyboardInterrupt, match="interrupted") as caught:
        planner.plan(gpt, "p100-1x2", recommend=False)
    assert "time limit" not in str(caught.value)


def test_ctrl_c_during_the_capture_says_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner.sources, "load_torch", lambda deadline: request_stop())
    with pytest.raises(KeyboardInterrupt, match="interrupted while capturing") as caught:
        planner.plan("lenet5", "p100-1x2", model_kwargs={"batch": 8})
    assert "time limit" not in str(caught.value)


# -- a memory limit no answer meets -----------------------------------------------------------


def test_a_memory_limit_below_the_least_footprint_is_not_searched(
    gpt: OpGraph, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_search(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("searched a problem no answer of which meets its limit")

    monkeypatch.setattr("planner.auto.solve_auto", no_search)
    with pytest.raises(SizeError, match="smallest footprint") as caught:
        planner.plan(gpt, "p100-1x2", memory_limit=1, recommend=False)
    assert "1 B per device" in str(caught.value) and "at least" in str(caught.value)


def _problem(usage: tuple[np.ndarray, ...], intervals: list[list[int]], limit: float) -> Problem:
    n = len(usage)
    return Problem(
        name="table",
        node_names=tuple(f"n{i}" for i in range(n)),
        node_cost=tuple(np.zeros(len(u)) for u in usage),
        edges=tuple((i, i + 1) for i in range(n - 1)),
        edge_cost=tuple(np.zeros((len(usage[i]), len(usage[i + 1]))) for i in range(n - 1)),
        usage=usage,
        intervals=np.array(intervals),
        usage_limit=np.array([limit]),
    )


def test_a_cost_table_limit_below_the_least_footprint_is_not_searched() -> None:
    from planner.problems.sizes import usage_bound

    usage = (np.array([[3.0], [2.0]]), np.array([[4.0], [5.0]]), np.array([[9.0]]))
    intervals = [[0, 4], [1, 3], [5, 6]]  # a and b live together, c alone
    assert usage_bound(_problem(usage, intervals, 6.0)).peak == 9.0  # type: ignore[union-attr]
    with pytest.raises(SizeError, match="at least 9 on the busiest pool"):
        planner.plan(_problem(usage, intervals, 8.0), recommend=False)
    fits = planner.plan(_problem(usage, intervals, 9.0), recommend=False)
    assert fits.has_solution


def test_the_usage_bound_is_below_every_answers_peak() -> None:
    from planner.problems.sizes import usage_bound

    rng = np.random.default_rng(0)
    for _ in range(30):
        n = int(rng.integers(2, 5))
        usage = tuple(rng.integers(0, 9, size=(int(rng.integers(1, 4)), 2)).astype(float)
                      for _ in range(n))  # fmt: skip
        starts = rng.integers(0, 6, size=n)
        intervals = [[int(s), int(s + rng.integers(0, 4))] for s in starts]
        p = _problem(usage, intervals, 1.0)
        bound = usage_bound(p)
        assert bound is not None
        least = min(
            _peak(p, choice) for choice in itertools.product(*(range(len(u)) for u in usage))
        )
        assert bound.peak <= least + 1e-9


def _peak(p: Problem, choice: tuple[int, ...]) -> float:
    assert p.usage is not None and p.intervals is not None
    peak = 0.0
    for t in range(int(p.intervals.max()) + 1):
        live = [i for i, (a, b) in enumerate(p.intervals) if a <= t < b]
        if live:
            peak = max(peak, float(sum(p.usage[i][choice[i]] for i in live).max()))
    return peak


# -- options that would do nothing --------------------------------------------------------------


def test_recomputation_a_model_has_no_blocks_for_is_refused(gpt: OpGraph) -> None:
    cnn = model_graph("alexnet", batch=8)
    with pytest.raises(LayerwiseError, match="recomputes nothing in 'alexnet'"):
        planner.plan(cnn, "p100-1x2", recompute="full")
    with pytest.raises(LayerwiseError, match="recomputes nothing in 'alexnet'"):
        planner.plan("alexnet", "p100-2x2", model_kwargs={"batch": 8}, recompute="full")
    with pytest.raises(LayerwiseError, match="recompute=999 blocks, but 'gpt2' has 3"):
        planner.plan(gpt, "p100-1x2", recompute=999)


def test_master_weights_without_an_optimizer_or_16_bit_weights(
    gpt: OpGraph, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(LayerwiseError, match="master_weights.*give an optimizer"):
        planner.plan(gpt, "p100-1x2", master_weights=True)
    with caplog.at_level(logging.WARNING, logger="planner.api"):
        planner.plan(gpt, "p100-1x2", optimizer="adam", master_weights=True, recommend=False)
    assert any("master_weights adds nothing" in r.getMessage() for r in caplog.records)


# -- a Ctrl-C ends the pipeline search at once ------------------------------------------------


@pytest.fixture(scope="module")
def small_gpt() -> OpGraph:
    return model_graph("gpt2", batch=16, seq=64, n_layer=4, n_head=4, n_embd=128, vocab_size=512)


@pytest.mark.parametrize("step", ["unit_costs", "_simulate"])
def test_a_ctrl_c_abandons_the_pipeline_searchs_step_in_progress(
    small_gpt: OpGraph, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A Ctrl-C during a costing or an exact simulation (seconds each on 1,024 GPUs) that
    the search does not need for an answer: the step is left to end in the background and
    the search returns what it had, instead of finishing the step (and using it)."""
    import threading

    import backends.pipeline.search as search

    real = getattr(search, step)
    calls: list[int] = []
    release = threading.Event()

    def slow_second(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            request_stop()
            release.wait(10)  # a long step: the search must not wait for it
        return real(*args, **kwargs)

    monkeypatch.setattr(search, step, slow_second)
    if step == "unit_costs":  # the first answer simulates slow: the next stage layout is costed
        simulate = search._simulate

        def slow(*args: Any, **kwargs: Any) -> Any:
            planned, timeline = simulate(*args, **kwargs)
            return planned, dataclasses.replace(timeline, makespan=100 * timeline.makespan)

        monkeypatch.setattr(search, "_simulate", slow)
    try:
        problem = PipelineProblem(small_gpt, get_preset("dgx-a100-80g-2"), CostOptions())
        extra = {"zero": (0,), "exact": 6, "inner": ("rule",)}
        opts = SolveOptions(extra=extra, deadline=Deadline.never())
        answer = search.PipelineSearch().solve(problem, opts)
    finally:
        release.set()
    assert len(calls) == 2 and answer.stats["stopped_by_time_limit"]
    done = "stage_layouts_costed" if step == "unit_costs" else "simulated_exactly"
    assert answer.stats[done] == 1


def test_a_limit_spent_before_planning_began_is_said_so() -> None:
    """The clock counts from the command's start: a limit spent before `plan` began (start-up,
    reading the problem, importing the solver) was reported as "building the problem took
    0.00634 s, the whole time limit of 2 s"."""
    import time

    from planner.deadline import Deadline
    from planner.problems.costtable import random_problem

    deadline = Deadline.after(0.2)
    time.sleep(0.3)  # what the command line spent before plan() began
    result = planner.plan(random_problem(5, 3, seed=0), backend="cpsat", deadline=deadline)
    assert result.status.value == "NO_SOLUTION"
    assert "before planning began" in result.message and "0.2 s ran out" in result.message


def test_a_limit_met_within_the_evaluators_rounding_is_not_refused() -> None:
    from planner.problems.evaluate import memory_feasible
    from planner.problems.sizes import usage_limit_error

    usage = (np.array([[0.1]]), np.array([[0.2]]))  # 0.1 + 0.2 is 0.30000000000000004
    p = _problem(usage, [[0, 2], [0, 2]], 0.3)
    assert memory_feasible(p, [0, 0])
    assert usage_limit_error(p) is None
    assert usage_limit_error(_problem(usage, [[0, 2], [0, 2]], 0.29)) is not None


def test_an_abandoned_step_sees_its_deadlines_passed_after_the_stop_ends() -> None:
    """run_within abandons a step at a stop request; a step that did not look at its clock
    before the call's stop was cleared ran on to its own deadline (a pipeline search's, in
    the background of the next plan)."""
    import threading
    import time

    from planner.deadline import Deadline, run_within

    started, busy, seen = threading.Event(), threading.Event(), []

    def step() -> None:
        own = Deadline.after(30)
        started.set()
        busy.wait(10)  # a long computation that does not look at the clock
        while not own.expired():
            time.sleep(0.01)
        seen.append(True)

    def stop_once_started() -> None:
        started.wait(10)
        request_stop()  # a Ctrl-C while the step runs

    threading.Thread(target=stop_once_started, daemon=True).start()
    try:
        with pytest.raises(OutOfTime):
            run_within(step, Deadline.after(30))
    finally:
        clear_stop()  # the call ends: its stop is forgotten
    busy.set()  # the step looks at its clock again only now
    end = time.perf_counter() + 10
    while not seen and time.perf_counter() < end:
        time.sleep(0.01)
    assert seen  # it ended (its deadlines passed for it), not 30 s later
