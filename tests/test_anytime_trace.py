"""The anytime trace every backend returns (`backends.trace`, `stats["trace"]`)."""

from __future__ import annotations

import importlib.util
import math
import time

import pytest

from backends import SolveOptions, get_backend
from backends.trace import (
    EVALUATION_SHARE,
    Improvements,
    TraceRecorder,
    merge_points,
    offer_answer,
    thin,
)
from planner.problems.costtable import random_problem
from planner.problems.evaluate import additive_cost
from planner.result import Channel, SolveResult, Status


def test_merge_keeps_improvements_in_time_order() -> None:
    points = [(2.0, 5.0), (1.0, 7.0), (3.0, 6.0), (3.0, 4.0), (0.5, math.inf), (4.0, 4.0)]
    assert merge_points(points) == [(1.0, 7.0), (2.0, 5.0), (3.0, 4.0)]
    bounds = [(1.0, 2.0), (2.0, 1.0), (2.5, 3.0), (2.5, 3.5), (4.0, -math.inf)]
    assert merge_points(bounds, lower=False) == [(1.0, 2.0), (2.5, 3.5)]


def test_thin_keeps_first_last_and_the_last_of_each_log_bin() -> None:
    points = [(0.001 * 1.01**k, 1e6 - k) for k in range(5000)]
    out = thin(points, 100)
    assert len(out) <= 100 and out[0] == points[0] and out[-1] == points[-1]
    assert [t for t, _ in out] == sorted(t for t, _ in out)
    assert all(a[1] > b[1] for a, b in zip(out, out[1:], strict=False))
    # log-spaced: as many points in the first decade of time as in the last
    ts = [t for t, _ in out]
    first = sum(t < ts[0] * 10 for t in ts)
    last = sum(t > ts[-1] / 10 for t in ts)
    assert abs(first - last) <= 2
    assert thin(points[:50], 100) == points[:50]


def test_improvements_record_only_better_values() -> None:
    imp = Improvements(start=10.0)
    for at, v in [(11.0, 5.0), (12.0, 6.0), (13.0, 5.0), (14.0, 3.0), (15.0, math.nan)]:
        imp.add(v, at)
    assert imp.points == [(1.0, 5.0), (4.0, 3.0)]


def _result(problem, choices, bound=None) -> SolveResult:  # type: ignore[no-untyped-def]
    value = additive_cost(problem, choices)
    return SolveResult("x", Status.FEASIBLE, tuple(choices), value, bound)


def test_recorder_values_answers_forwards_calls_and_ends_at_the_answer() -> None:
    p = random_problem(12, 4, seed=1, memory=False, forbid_prob=0.0)
    seen: list[tuple[str, object]] = []
    given = Channel(
        on_incumbent=lambda ch, who: seen.append(("answer", ch)),
        on_bound=lambda b, who: seen.append(("bound", b)),
    )
    rec = TraceRecorder(p, "additive", True, time.perf_counter())
    channel = rec.channel(given)
    answers = [tuple((k + j) % p.sizes[j] for j in range(p.num_nodes)) for k in range(4)]
    answers.sort(key=lambda ch: -additive_cost(p, ch))  # each better than the last
    for ch in answers:
        assert channel.on_incumbent is not None
        channel.on_incumbent(ch, "test")
    assert channel.on_bound is not None
    channel.on_bound(1.0, "test")
    channel.on_bound(0.5, "test")  # not better: not recorded, still forwarded
    assert [k for k, _ in seen] == ["answer"] * 4 + ["bound"] * 2
    time.sleep(0.001)  # the final bound a time step (0.1 ms) after the one heard
    out = rec.finish(_result(p, answers[-1], bound=2.0)).stats["trace"]
    values = [v for _, v in out["incumbent"]]
    assert values[-1] == additive_cost(p, answers[-1])
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert set(values) <= {additive_cost(p, ch) for ch in answers}
    assert [v for _, v in out["bound"]] == [1.0, 2.0]


def test_recorder_values_at_most_a_share_of_the_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # a slow evaluation (0.1 s): the next answer within 0.1 / share waits, and a better one
    # replaces it; the one waiting when the window has passed is recorded with the new one
    p = random_problem(6, 3, seed=2, memory=False, forbid_prob=0.0)
    clock = [100.0]
    monkeypatch.setattr("backends.trace.time.perf_counter", lambda: clock[0])

    def slow(problem, choices):  # type: ignore[no-untyped-def]
        clock[0] += 0.1
        return float(choices[0] * -1 + 10)

    monkeypatch.setattr("backends.trace.additive_cost", slow)
    rec = TraceRecorder(p, "additive", True, 100.0)
    on = rec.channel(Channel()).on_incumbent
    assert on is not None
    window = 0.1 / EVALUATION_SHARE
    on((1, 0, 0, 0, 0, 0), "t")  # t=0: recorded, value 9
    clock[0] = 101.0
    on((2, 0, 0, 0, 0, 0), "t")  # within the window: waits
    clock[0] = 102.0
    on((3, 0, 0, 0, 0, 0), "t")  # replaces it
    clock[0] = 100.1 + window + 1
    on((4, 0, 0, 0, 0, 0), "t")  # the window has passed: the waiting one and this one
    assert rec.incumbents == [(0.0, 9.0), (2.0, 7.0), (round(0.1 + window + 1, 4), 6.0)]


def test_a_search_value_below_the_answer_is_raised_or_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # within rounding: raised to the answer's value; further below (a search's own measure,
    # mcmc's simulated makespan): dropped, so the points above it keep their shape
    p = random_problem(6, 3, seed=2, memory=False, forbid_prob=0.0)
    ch = (0,) * p.num_nodes
    value = additive_cost(p, ch)
    rec = TraceRecorder(p, "additive", False, time.perf_counter() - 1.0)  # ends at 1 s
    own = {
        "incumbent": [[0.1, value * 2], [0.2, value * 1.5], [0.3, value * 0.5]],
        "bound": [],
    }
    res = SolveResult("x", Status.FEASIBLE, ch, value, None, stats={"trace": own})
    out = rec.finish(res).stats["trace"]["incumbent"]
    assert out[:2] == [[0.1, value * 2], [0.2, value * 1.5]] and out[-1][1] == value
    assert "left out" in caplog.text
    own = {"incumbent": [[0.1, value * 2], [0.2, value - 1e-9]], "bound": []}
    res = SolveResult("x", Status.FEASIBLE, ch, value, None, stats={"trace": own})
    out = rec.finish(res).stats["trace"]["incumbent"]
    assert out == [[0.1, value * 2], [0.2, value]]


def test_a_known_value_is_recorded_without_extracting_or_valuing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    p = random_problem(6, 3, seed=2, memory=False, forbid_prob=0.0)
    monkeypatch.setattr("backends.trace.additive_cost", lambda *a: pytest.fail("valued"))
    rec = TraceRecorder(p, "additive", True, time.perf_counter())
    alone = rec.channel(Channel()).on_incumbent
    offer_answer(alone, 5.0, "t", lambda: pytest.fail("extracted"))
    seen: list[tuple[int, ...]] = []
    forwards = rec.channel(Channel(on_incumbent=lambda ch, who: seen.append(ch))).on_incumbent
    offer_answer(forwards, 4.0, "t", lambda: (1,) * p.num_nodes)
    offer_answer(lambda ch, who: seen.append(ch), 3.0, "t", lambda: (2,))  # a plain callback
    assert [v for _, v in rec.incumbents] == [5.0, 4.0] and seen == [(1,) * p.num_nodes, (2,)]


@pytest.mark.skipif(not importlib.util.find_spec("ortools"), reason="ortools is not installed")
def test_a_standalone_cpsat_values_no_answer_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # the trace alone listens: no cost computed per answer (the solver's value is offered);
    # with the caller listening too, the trace's values are its answers' costs
    import backends.mathprog.common as common

    calls = {"common": 0, "trace": 0}

    def counted(where: str):  # type: ignore[no-untyped-def]
        def cost(problem, choices):  # type: ignore[no-untyped-def]
            calls[where] += 1
            return additive_cost(problem, choices)

        return cost

    import backends.trace as trace

    monkeypatch.setattr(common, "additive_cost", counted("common"))
    monkeypatch.setattr(trace, "additive_cost", counted("trace"))
    p = random_problem(40, 4, seed=3)
    r = get_backend("cpsat").solve(p, SolveOptions(time_limit=2.0, seed=0, threads=1))
    # none per solution; the recorder values at most the answer handed over at the end
    assert calls["common"] == 0 and calls["trace"] <= 1
    assert r.stats["trace"]["incumbent"][-1][1] == r.objective
    got: list[float] = []
    channel = Channel(on_incumbent=lambda ch, who: got.append(additive_cost(p, ch)))
    r = get_backend("cpsat").solve(p, SolveOptions(time_limit=2.0, seed=0, channel=channel))
    assert {v for _, v in r.stats["trace"]["incumbent"]} <= set(got)


BACKENDS = [
    ("baselines", "baselines"),
    ("search", None),
    ("mcmc", None),
    ("ilp", "pulp"),
    ("cpsat", "ortools"),
    ("toulbar2", "pytoulbar2"),
    ("local", "numba"),
]


@pytest.mark.parametrize(("name", "module"), BACKENDS, ids=[b for b, _ in BACKENDS])
def test_every_backend_returns_a_valid_trace(name: str, module: str | None) -> None:
    if module is not None and module != "baselines" and not importlib.util.find_spec(module):
        pytest.skip(f"{module} is not installed")
    p = random_problem(14, 4, seed=7)
    limit = 2.0
    if name == "local":  # numba's kernels, outside the limit (a cold compile: a minute)
        from backends.local.anneal import compile_kernels

        compile_kernels()
    extra = {"iterations": 3000} if name == "mcmc" else {}
    r = get_backend(name).solve(p, SolveOptions(time_limit=limit, seed=1, extra=extra))
    assert r.objective is not None
    trace = r.stats["trace"]
    inc, bnd = trace["incumbent"], trace["bound"]
    assert inc and inc[-1][1] == r.objective
    for points, sign in ((inc, 1), (bnd, -1)):
        times = [t for t, _ in points]
        assert times == sorted(times) and all(0 <= t <= limit + 1 for t in times)
        values = [sign * v for _, v in points]
        assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert all(v <= r.objective * (1 + 1e-9) for _, v in bnd)
    if r.bound is not None:
        assert bnd[-1][1] == r.bound
    if name in ("mcmc", "local"):  # their own trace: points from the search, not the end
        assert inc[0][0] < r.stats["search_seconds"]
    if name == "local":  # from a worse first answer (mcmc starts from the optimum here)
        assert len(inc) >= 2 and inc[0][1] > inc[-1][1]
