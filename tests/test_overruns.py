"""Time limits that are limits (issue 19): every phase that can run long looks at the clock,
and one that cannot finish degrades and says so. No test here asserts a wall-clock time:
each puts a deadline in the past (or asks to stop) and checks what comes back."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import pytest

from backends import Limit, SolveOptions, Status, get_backend
from backends.base import RESCORE_SKIPPED, Backend, BackendSettings, SolveResult
from backends.mathprog.common import ENCODE_TIMEOUT
from backends.placement import series
from backends.placement.problem import (
    LEX_SYMMETRIES,
    PlacementProblem,
    Schedule,
    canonical_placement,
    device_symmetries,
    lex_symmetries,
    placement_problem,
    random_placement_problem,
)
from backends.testing import tiny_cnn
from experiments.overruns import FIELDS, NOT_SEARCHED, run_cell
from planner.deadline import Deadline, catch_interrupt, clear_stop, request_stop
from planner.errors import LayerwiseError
from planner.hardware.presets import get_preset
from planner.problems.costtable import contest_problem, random_problem
from planner.problems.problem import Problem, build_problem
from planner.sim.simulator import simulate


def _over() -> Deadline:
    """A deadline that passed a second ago."""
    return Deadline(time.perf_counter() - 1.0, 10.0)


@pytest.fixture
def dnn() -> Problem:
    return build_problem(tiny_cnn(), get_preset("p100-1x4"))


# -- the series bound of the placement models ------------------------------------------------


def _tiny_pp() -> PlacementProblem:
    return placement_problem(build_problem(tiny_cnn(), get_preset("p100-1x4")))


def _never(sub: PlacementProblem, left: float) -> tuple[float, Schedule | None]:
    raise AssertionError("a segment was solved past the deadline")


@pytest.mark.parametrize("how", ["deadline passed", "stop requested"])
def test_series_bound_past_the_deadline_degrades_at_once(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pp = _tiny_pp()
    built = []  # sub-problems built: one per pinning before (D^2 per segment), now per group
    real = series.segments_problem

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(series, "segments_problem", counted)
    full, full_stats, _, _ = series.series_bound(
        pp, lambda sub, left: (series.placement_lower_bound(sub), None)
    )
    built.clear()
    deadline = time.perf_counter() - 1.0
    if how == "stop requested":
        deadline = time.perf_counter() + 3600.0
        request_stop()
    try:
        bound, stats, place, _ = series.series_bound(pp, _never, deadline)
    finally:
        clear_stop()
    assert stats["segment_solves"] == 0
    assert "time limit" in stats["series_cut"]
    assert 0 < bound <= full * (1 + 1e-12)  # still a lower bound, a weaker one
    assert place is not None and len(place) == pp.num_nodes
    assert len(built) <= 2 * stats["segments"], len(built)
    assert "series_cut" not in full_stats


def test_folded_dp_past_the_deadline_uses_one_bound_per_group() -> None:
    pp = _tiny_pp()
    segments = series.series_segments(pp)
    chain = [segments[0].first] + [seg.last for seg in segments]
    fold = series._fold([int(pp.task_node[t]) for t in chain])
    assert fold is not None
    spans = series._Spans(pp, _never, time.perf_counter() - 1.0)
    value, devices, groups = series._folded_dp(pp, chain, segments, spans, fold)
    assert np.isfinite(value) and len(devices) == len(chain)
    assert spans.solves == 0 and not spans.found
    assert spans.cut >= pp.num_devices**2
    assert len(spans.loose) <= len(segments)


def test_symmetric_pinnings_are_solved_once() -> None:
    pp = _tiny_pp()  # 4 identical GPUs: every pinning of two ends is one of two up to symmetry
    seg = series.series_segments(pp)[0]
    spans = series._Spans(pp, lambda sub, left: (1.0, None), time.perf_counter() + 3600)
    for a in range(pp.num_devices):
        for b in range(pp.num_devices):
            spans((seg,), ((seg.first, a), (seg.last, b)))
    assert len(spans.found) <= 2


# -- the placement models' encoding ------------------------------------------------------


@pytest.mark.parametrize("backend", ["cpsat", "ilp"])
def test_placement_model_not_encoded_in_time_keeps_the_start(backend: str) -> None:
    pp = random_placement_problem(40, get_preset("p100-1x4"), seed=0)
    opts = SolveOptions(objective="makespan", deadline=_over())
    solver = get_backend(backend)
    out = solver.solve_placement(pp, opts)  # type: ignore[attr-defined]
    assert out.stats["solver_status"] == ENCODE_TIMEOUT
    assert out.schedule is not None and out.timed_out
    assert out.stats["warm_start"] is not None


def test_device_symmetries_match_one_at_a_time() -> None:
    def preserves(pp: PlacementProblem, sigma: np.ndarray) -> bool:
        rows = [(r.coef, r.limit) for r in pp.memory]
        return (
            np.array_equal(pp.allowed[:, sigma], pp.allowed)
            and np.allclose(pp.duration[:, sigma], pp.duration, rtol=1e-12, atol=0)
            and np.allclose(pp.delay[:, sigma][:, :, sigma], pp.delay, rtol=1e-12, atol=0)
            and all(
                any(lim == r.limit and np.allclose(c[:, sigma], r.coef) for c, lim in rows)
                for r in pp.memory
            )
        )

    rng = np.random.default_rng(0)
    for seed in range(4):
        for preset in ("p100-2x2", "p100-1x4", "v100-dgx1-4"):
            pp = random_placement_problem(
                5, get_preset(preset), seed, memory=seed % 2 == 0, heterogeneous=seed == 3
            )
            found = device_symmetries(pp)
            stripped = placement_problem_without_checks(pp)
            assert list(found) == [s for s in stripped if preserves(pp, np.array(s))]
            for _ in range(3):
                place = rng.integers(0, pp.num_devices, pp.num_nodes)
                images = [
                    tuple(int(d) for d in place),
                    *(tuple(s[d] for d in place) for s in found),
                ]
                assert canonical_placement(pp, place) == min(images)


def placement_problem_without_checks(pp: PlacementProblem) -> list[tuple[int, ...]]:
    """Every automorphism of the hardware graph (what device_symmetries then filters)."""
    import itertools

    import networkx as nx

    from backends.placement.problem import MAX_AUTOMORPHISMS, hardware_graph

    g = hardware_graph(pp.devices)
    names = [d.name for d in pp.devices.devices]
    where = {n: k for k, n in enumerate(names)}
    matcher = nx.algorithms.isomorphism.GraphMatcher(
        g,
        g,
        node_match=lambda a, b: a["role"] == b["role"],
        edge_match=lambda a, b: a["links"] == b["links"],
    )
    found = {
        tuple(where[m[n]] for n in names)
        for m in itertools.islice(matcher.isomorphisms_iter(), MAX_AUTOMORPHISMS)
    }
    return sorted(found - {tuple(range(len(names)))})


def test_lexicographic_leader_breaks_a_bounded_number_of_symmetries() -> None:
    pp = random_placement_problem(3, get_preset("p100-2x4"), seed=0)
    assert len(pp.symmetries) > LEX_SYMMETRIES
    broken = lex_symmetries(pp)
    assert len(broken) == LEX_SYMMETRIES and set(broken) <= set(pp.symmetries)
    moved = [sum(d != k for k, d in enumerate(s)) for s in broken]
    assert moved == sorted(moved) and moved[0] == 2  # the swaps of two GPUs first


# -- exact searches: a proof that completes is a proof -----------------------------------


def test_elimination_that_completes_is_optimal_with_no_time_left() -> None:
    problem = random_problem(40, 6, seed=1, edge_prob=0.08, memory=False)
    opts = SolveOptions(deadline=_over())
    result = get_backend("elimination").solve(problem, opts)
    assert result.status is Status.OPTIMAL and result.limit is None, result.stats
    assert result.stats["eliminations_finished"]
    assert result.bound == pytest.approx(result.objective)


def test_elimination_still_stops_at_once_when_asked() -> None:
    problem = random_problem(40, 6, seed=1, edge_prob=0.08, memory=False)
    with catch_interrupt():  # the caller's: the stop stays asked while the backend runs
        request_stop()
        result = get_backend("elimination").solve(problem, SolveOptions(time_limit=10.0))
    assert result.limit is Limit.INTERRUPTED
    assert not result.stats["eliminations_finished"]


# -- the re-score of makespan answers ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _NoSettings(BackendSettings):
    """No settings."""


class _Reports(Backend[_NoSettings]):
    """Returns the first config of every node with a makespan of its own."""

    name = "reports"
    objectives = ("makespan",)
    settings_type = _NoSettings

    def _solve(self, problem: Problem, options: SolveOptions, settings: _NoSettings) -> SolveResult:
        choices = tuple(0 for _ in range(problem.num_nodes))
        return SolveResult(self.name, Status.FEASIBLE, choices, objective=123.0)


def test_no_time_to_simulate_keeps_the_reported_makespan(
    dnn: Problem, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        result = _Reports().solve(dnn, SolveOptions(objective="makespan", deadline=_over()))
    assert result.objective == 123.0
    assert result.stats["rescore"] == RESCORE_SKIPPED
    assert any("no time left to simulate" in r.getMessage() for r in caplog.records)


def test_with_time_left_the_makespan_is_simulated(dnn: Problem) -> None:
    result = _Reports().solve(dnn, SolveOptions(objective="makespan", time_limit=30.0))
    assert result.strategy is not None
    assert result.objective == pytest.approx(
        simulate(dnn.dnn().cost_model, result.strategy).makespan
    )
    assert "rescore" not in result.stats


def test_baselines_stop_scoring_candidates_past_the_deadline(dnn: Problem) -> None:
    opts = SolveOptions(objective="makespan", deadline=_over())
    result = get_backend("baselines").solve(dnn, opts)
    assert result.status is Status.FEASIBLE and result.limit is Limit.TIME
    assert len(result.stats["candidates"]) == 1 and result.stats["not_scored_for_time"]
    assert result.stats["rescore"] == RESCORE_SKIPPED


# -- the command line's clock ----------------------------------------------------------------


def test_plan_honours_a_deadline_started_by_its_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's deadline has passed: no search runs (capture and build finish within
    their overrun and the answer is found without a search, said in one line); with no
    overrun allowed, one error."""
    import planner
    import planner.request

    spent = Deadline(time.perf_counter(), 7)
    out = planner.plan("lenet5", "p100-1x4", time_limit=60, deadline=spent)
    assert out.has_solution and "time limit of 7 s ran out before the search" in out.message
    assert out.stats["search_seconds"] < 1.0 and out.stats["overrun"] == out.message
    monkeypatch.setattr(planner.request, "OVERRUN", 0.0)
    monkeypatch.setattr(planner.request, "OVERRUN_SECONDS", 0.0)
    with pytest.raises(LayerwiseError, match="time limit of 7 s"):
        planner.plan("lenet5", "p100-1x4", time_limit=60, deadline=spent)


# -- the measurement ---------------------------------------------------------------------------


def test_a_cell_of_the_overrun_table() -> None:
    row = run_cell("elimination", "additive", "lenet5", "p100-1x4", 2.0)
    assert set(row) == set(FIELDS)
    assert (row["backend"], row["objective"], row["model"], row["devices"], row["limit"]) == (
        "elimination",
        "additive",
        "lenet5",
        "p100-1x4",
        2.0,
    )
    assert row["outcome"] in ("answer", "no answer", "error", NOT_SEARCHED), row
    assert row["net"] == pytest.approx(row["wall"] - row["startup"], abs=2e-3)
    assert row["overrun"] == pytest.approx(row["net"] - 2.0, abs=2e-3)
    assert isinstance(row["passed"], bool)
    if row["outcome"] == "answer":
        assert row["status"] in ("OPTIMAL", "FEASIBLE")
    else:
        assert row["detail"]  # the line that says why


def test_a_refused_cell_is_not_judged() -> None:
    row = run_cell("elimination", "makespan", "lenet5", "p100-1x4", 2.0, startup=0.0)
    assert row["outcome"] == "refused" and row["passed"] is None
    assert "does not optimize" in row["detail"]


def test_the_recommendation_simulates_no_baseline_past_the_deadline(dnn: Problem) -> None:
    from planner.recommend import recommend

    answer = _Reports().solve(dnn, SolveOptions(objective="makespan", time_limit=30.0))
    decision = recommend(dnn, answer, "makespan", deadline=_over()).stats["recommendation"]
    assert decision["baselines"] == {} and decision["not_simulated_for_time"]
    timed = recommend(dnn, answer, "makespan", deadline=Deadline.after(3600))
    assert timed.stats["recommendation"]["baselines"]  # with time, they are simulated


def test_makespan_search_does_not_undo_its_simulation_after_the_deadline(
    dnn: Problem, monkeypatch: pytest.MonkeyPatch
) -> None:
    from planner.sim.simulator import Simulator

    changes = []
    real = Simulator.change_many

    def counted(self, items):  # type: ignore[no-untyped-def]
        changes.append(items)
        return real(self, items)

    monkeypatch.setattr(Simulator, "change_many", counted)
    opts = SolveOptions(objective="makespan", deadline=_over())
    result = get_backend("search").solve(dnn, opts)
    assert result.limit is Limit.TIME
    assert changes == []  # timed out at its first look: nothing assigned, nothing undone


def test_no_capture_begins_with_no_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.request
    import planner.sources

    def capture(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("captured with no time left")

    monkeypatch.setattr(planner.sources, "_capture", capture)
    monkeypatch.setattr(planner.request, "OVERRUN", 0.0)  # no time past the limit either
    monkeypatch.setattr(planner.request, "OVERRUN_SECONDS", 0.0)
    with pytest.raises(LayerwiseError, match="time limit of 7 s"):
        planner.plan("lenet5", "p100-1x4", time_limit=60, deadline=Deadline(time.perf_counter(), 7))


def test_cbc_does_not_start_on_a_model_it_cannot_write_in_time() -> None:
    from backends.mathprog import ilp

    pp = random_placement_problem(8, get_preset("p100-1x4"), seed=0)
    opts = SolveOptions(objective="makespan", time_limit=30.0)
    settings = ilp.IlpSettings()
    model = ilp.encode_placement(pp, opts, settings)
    run = ilp.solve_encoded(model, opts, settings, 1e-3)
    assert run.log["cbc_result"].startswith("not run (writing the model")
    assert run.status == "UNKNOWN" and run.timed_out


def test_cbc_is_killed_no_later_than_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CBC run (the LP start and the search) is given a kill time at or before the
    solve's deadline, so the limit covers the whole solve (the kill came 0.25 s past it:
    `ilp` took 3.3 s for 3 s on a busy machine)."""
    from backends.mathprog import ilp

    kills: list[float] = []
    real = ilp.run_cbc

    def recorded(args: Any, log: Any, stop_at: float, kill_at: float, *rest: Any) -> Any:
        kills.append(kill_at)
        return real(args, log, stop_at, kill_at, *rest)

    monkeypatch.setattr(ilp, "run_cbc", recorded)
    deadline = Deadline.after(20.0)
    p = contest_problem(60, seed=4)
    r = get_backend("ilp").solve(p, SolveOptions(deadline=deadline))
    assert r.has_solution and kills  # CBC ran
    assert max(kills) <= deadline.at


# -- steps with no clock of their own: imports, run in a thread the deadline bounds ----------


def test_run_within_returns_the_value_and_raises_the_error() -> None:
    from planner.deadline import run_within

    assert run_within(lambda: 41 + 1, Deadline.after(60)) == 42
    with pytest.raises(ZeroDivisionError):
        run_within(lambda: 1 // 0, Deadline.after(60))


def test_run_within_leaves_a_step_that_overruns_to_finish_alone() -> None:
    import threading

    from planner.deadline import OutOfTime, run_within

    release, finished = threading.Event(), threading.Event()

    def blocked() -> None:  # would never end if run_within waited for it
        release.wait(60)
        finished.set()

    with pytest.raises(OutOfTime):
        run_within(blocked, Deadline.after(0.05))
    assert not finished.is_set()  # OutOfTime came while the step still ran
    release.set()
    assert finished.wait(10)  # and the step was left to finish, not killed mid-way


def test_run_within_stops_when_asked() -> None:
    import threading

    from planner.deadline import OutOfTime, run_within

    release = threading.Event()

    def ask_then_wait() -> None:
        request_stop()
        release.wait(60)

    try:
        with pytest.raises(OutOfTime):
            run_within(ask_then_wait, Deadline.never())
    finally:
        release.set()
        clear_stop()


def test_capture_looks_at_the_clock_between_nodes() -> None:
    from planner.deadline import OutOfTime
    from planner.graph.zoo import model_graph

    with pytest.raises(OutOfTime):
        model_graph("lenet5", batch=4, deadline=_over())
    assert model_graph("lenet5", batch=4, deadline=Deadline.after(3600)).ops


def test_loading_torch_past_the_deadline_is_one_line_that_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from planner.sources import load_torch

    load_torch(_over())  # loaded already in this process: nothing to wait for, no error
    # as in a fresh process (an expired deadline: nothing is imported, it says so at once)
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)
    with pytest.raises(LayerwiseError, match="loading torch's tracing machinery .* time limit"):
        load_torch(_over())


def test_capture_imports_no_torch_compile_machinery_after_the_warm_up() -> None:
    """What `warm_up` loads is all a capture loads on its first op: nothing unbounded is
    left for the capture itself (a fresh process, so that nothing was loaded before)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from planner.graph.capture import warm_up\n"
        "warm_up()\n"
        "before = set(sys.modules)\n"
        "from planner.graph.zoo import model_graph\n"
        "model_graph('lenet5', batch=4)\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch._dynamo')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
