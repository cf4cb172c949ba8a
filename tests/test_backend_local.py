"""The `local` backend (backends/local): conformance, brute-force agreement, the segment
tree against a naive profile, determinism and the deadline."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import SolveOptions, Status, get_backend
from backends.base import Channel
from backends.local import kernels
from backends.local.anneal import compile_kernels
from backends.local.flat import flatten
from backends.local.segtree import Profile
from backends.testing import BackendConformance
from planner.deadline import Deadline
from planner.problems.costtable import brute_force, random_problem
from planner.problems.evaluate import additive_cost, live_usage, memory_feasible

FAST = {"round_moves": 20_000}


@pytest.fixture(scope="module", autouse=True)
def compiled() -> None:
    """Compile (or load) the kernels once, outside any time limit: a cold compile takes
    about a minute, and a solve whose limit ends first answers NO_SOLUTION."""
    compile_kernels()


class TestLocalConformance(BackendConformance):
    backend_name = "local"
    extra = FAST


def solve(problem, **kwargs):  # type: ignore[no-untyped-def]
    limit = {} if "deadline" in kwargs else {"time_limit": 30.0}  # one of the two
    args = {**limit, "seed": 0, "extra": FAST, **kwargs}
    return get_backend("local").solve(problem, SolveOptions(**args))


# ------------------------------------------------------------------------- brute force


@pytest.mark.parametrize(  # 20 by default (every size and memory case), the other 20 slow
    "seed", [s if s < 20 else pytest.param(s, marks=pytest.mark.slow) for s in range(40)]
)
def test_valid_and_usually_optimal_on_small_random_problems(seed: int) -> None:
    """Memory limits and forbidden entries: the answer is always valid, never below the
    brute-force optimum, and equal to it on (nearly) all of these small problems."""
    problem = random_problem(
        5 + seed % 4, 4, seed=100 + seed, forbid_prob=0.15, memory=seed % 3 != 0
    )
    best, value = brute_force(problem)
    result = solve(problem)
    if best is None:
        assert result.choices is None
        return
    assert result.choices is not None, result.stats
    assert result.status is Status.FEASIBLE
    assert math.isfinite(additive_cost(problem, result.choices))
    assert memory_feasible(problem, result.choices)
    assert result.objective >= value * (1 - 1e-9)
    assert result.objective == pytest.approx(value, rel=1e-9)


@pytest.mark.parametrize(  # at most one miss among the first 6 by default, among all 12 slow
    "count", [6, pytest.param(12, marks=pytest.mark.slow)]
)
def test_optimal_on_most_larger_problems(count: int) -> None:
    """On 9-node problems (up to 5 strategies) brute force is still cheap: count the hits."""
    hits = total = 0
    for seed in range(count):
        problem = random_problem(9, 5, seed=500 + seed, forbid_prob=0.1, memory=True)
        best, value = brute_force(problem)
        if best is None:
            continue
        total += 1
        result = solve(problem, extra={"round_moves": 50_000})
        assert result.choices is not None and memory_feasible(problem, result.choices)
        hits += math.isclose(result.objective, value, rel_tol=1e-9)
    assert hits >= total - 1, f"optimal on {hits} of {total}"


def test_dnn_problem_with_a_memory_limit() -> None:
    from backends.testing import tiny_cnn
    from planner.hardware.presets import get_preset
    from planner.problems.problem import build_problem

    problem = build_problem(tiny_cnn(), get_preset("p100-1x2"), max_configs=4)
    assert problem.usage is not None and problem.intervals is not None
    free, _ = brute_force(problem, respect_memory=False)
    assert free is not None
    use = np.stack([u[k] for u, k in zip(problem.usage, free, strict=True)])
    high = live_usage(problem.intervals, use).max(axis=0)
    for factor in (0.98, 0.95, 0.9, 0.8, 0.7):
        tight = dataclasses.replace(problem, usage_limit=high * factor)
        best, value = brute_force(tight)
        if best is not None and best != free:  # a limit that binds
            break
    else:
        pytest.skip("no binding memory limit found for the tiny CNN")
    result = solve(tight)
    assert result.choices is not None
    assert memory_feasible(tight, result.choices)
    assert result.objective == pytest.approx(value, rel=1e-9)


# ------------------------------------------------------------------------- segment tree


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=40),
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-1000, 1000)),
        max_size=60,
    ),
)
def test_segment_tree_matches_a_naive_profile(values: list[float], updates: list) -> None:
    naive = np.array(values)
    tree = Profile(naive)
    t = len(values)
    for a, b, v in updates:
        lo, hi = min(a, b) % (t + 1), max(a, b) % (t + 1)
        lo, hi = min(lo, hi), max(lo, hi)
        tree.add(lo, hi, float(v))
        naive[lo:hi] += v
        if lo < hi:
            assert tree.max(lo, hi) == pytest.approx(naive[lo:hi].max(), abs=1e-6)
        else:
            assert tree.max(lo, hi) == -math.inf
        assert tree.max(0, t) == pytest.approx(naive.max(), abs=1e-6)
        assert naive[tree.argmax()] == pytest.approx(naive.max(), abs=1e-6)
    np.testing.assert_allclose(tree.values(), naive, atol=1e-6)


def test_profile_kept_by_the_moves_matches_the_evaluator() -> None:
    """After annealing, the trees the moves kept equal a fresh sweep of the live usages."""
    problem = random_problem(40, 6, seed=3, memory=True)
    flat = flatten(problem)
    arrays = flat.arrays()
    state = kernels.new_state(arrays, flat.num_times, 0, flat.max_size)
    assert kernels.least_memory_start(arrays, state) == 0
    alive = np.isfinite(flat.cost).astype(np.uint8)
    kernels.mac_start(arrays, state, alive, True, 3)
    assert kernels.repair(arrays, state, 10_000) == 1
    kernels.take_current_as_best(arrays, state)
    kernels.anneal(arrays, state, 5000, 0, 5000, 100.0, 0.1, 0.2, 0.2, 0.2)
    x = state[0]
    use = np.stack([u[k] for u, k in zip(problem.usage, x, strict=True)])
    assert problem.intervals is not None
    swept = live_usage(problem.intervals, use)[:, 0]
    start = problem.intervals[:, 0]
    times = np.unique(start[problem.intervals[:, 1] > start])
    at = np.searchsorted(np.unique(start), times)
    tree_values = [kernels.seg_max(state[2][0], state[3][0], t, t + 1) for t in range(len(times))]
    np.testing.assert_allclose(tree_values, swept[at], rtol=1e-12)
    assert state[6][kernels.F_COST] == pytest.approx(additive_cost(problem, x), rel=1e-9)


# ------------------------------------------------------------------ determinism, clock


def test_same_seed_and_move_count_same_answer() -> None:
    problem = random_problem(300, 8, seed=11, memory=True)
    extra = {"max_moves": 200_000, "round_moves": 60_000, "patience": 0}
    first = solve(problem, seed=5, extra=extra)
    second = solve(problem, seed=5, extra=extra)
    assert first.choices == second.choices
    assert first.stats["moves"] == second.stats["moves"] == 200_000
    assert first.limit is not None and first.limit.value == "ITERATIONS"
    other = solve(problem, seed=6, extra=extra)
    assert other.choices is not None


def test_an_expired_deadline_returns_the_first_valid_answer() -> None:
    problem = random_problem(200, 6, seed=4, memory=True)
    gone = Deadline(time.perf_counter() - 1.0, 1.0)
    result = solve(problem, deadline=gone)
    assert result.choices is not None and memory_feasible(problem, result.choices)
    assert result.stats["moves"] == 0
    assert result.limit is not None and result.limit.value == "TIME"
    assert result.objective == pytest.approx(result.stats["first_feasible_objective"])


def test_stats_report_the_search() -> None:
    result = solve(random_problem(100, 6, seed=1, memory=True))
    for key in ("moves", "moves_per_second", "compile_seconds", "restarts",
                "first_feasible_seconds"):  # fmt: skip
        assert key in result.stats
    assert result.bound is None and result.status is Status.FEASIBLE


def test_refuses_the_makespan_objective() -> None:
    backend = get_backend("local")
    assert "makespan" not in backend.objectives


# ------------------------------------------------------------ warm start and the channel


def test_a_valid_warm_start_replaces_the_construction() -> None:
    problem = random_problem(200, 6, seed=21, memory=True)
    first = solve(problem, extra={**FAST, "max_moves": 50_000})
    assert first.choices is not None
    gone = Deadline(time.perf_counter() - 1.0, 1.0)  # no moves: the answer is the start
    again = solve(problem, warm_start=first.choices, deadline=gone)
    assert again.choices == first.choices
    assert again.stats["warm_start"] == pytest.approx(additive_cost(problem, first.choices))
    assert "first_feasible_seconds" not in again.stats


def test_an_invalid_warm_start_is_left_for_the_construction() -> None:
    problem = random_problem(30, 4, seed=5, memory=True)
    # the most memory everywhere: over the limit (random_problem's limit is below it)
    worst = tuple(int(np.argmax(u.sum(axis=1))) for u in problem.usage)
    assert not memory_feasible(problem, worst)
    result = solve(problem, warm_start=worst)
    assert "warm_start" not in result.stats
    assert result.choices is not None and memory_feasible(problem, result.choices)


def test_the_channel_sends_better_answers_and_adopts_better_ones() -> None:
    """Each answer sent is valid and better than the one before; a better answer given
    through `incoming` becomes the search's best and its answer is at least as good."""
    problem = random_problem(120, 6, seed=8, memory=True)
    reference = solve(problem, extra={**FAST, "patience": 0, "max_moves": 400_000})
    assert reference.choices is not None and reference.objective is not None
    sent: list[float] = []
    given = [reference.choices]

    def on_incumbent(choices: tuple[int, ...], who: str) -> None:
        assert who == "local" and memory_feasible(problem, choices)
        sent.append(additive_cost(problem, choices))

    channel = Channel(on_incumbent=on_incumbent, incoming=lambda: given.pop() if given else None)
    result = solve(problem, seed=3, channel=channel, extra={**FAST, "max_moves": 100_000})
    assert sent and all(b < a for a, b in zip(sent, sent[1:], strict=False))
    assert result.stats.get("adopted", 0) >= 1 or sent[0] <= reference.objective
    assert result.objective is not None and result.objective <= reference.objective + 1e-9


def test_a_stalled_search_anneals_from_a_candidate_and_keeps_its_best(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once stalled, the search takes a candidate (`Channel.candidate`, a valid answer worse
    than its best) as its state, sends only answers better than the best it had, and
    answers with the better of the two."""
    from backends.local import anneal

    monkeypatch.setattr(anneal, "STALL_SECONDS", 0.0)  # stalled at once
    problem = random_problem(120, 6, seed=8, memory=True)
    poor = solve(problem, extra={**FAST, "max_moves": 1})
    good = solve(problem, extra={**FAST, "patience": 0, "max_moves": 400_000})
    assert poor.objective is not None and good.objective is not None
    assert poor.objective > good.objective  # a candidate worse than the best
    sent: list[float] = []
    given = [poor.choices]

    def on_incumbent(choices: tuple[int, ...], who: str) -> None:
        sent.append(additive_cost(problem, choices))

    channel = Channel(on_incumbent=on_incumbent, candidate=lambda: given.pop() if given else None)
    result = solve(
        problem, channel=channel, warm_start=good.choices, extra={**FAST, "max_moves": 200_000}
    )
    assert result.stats["candidates"] == 1 and not given
    assert all(b < a for a, b in zip(sent, sent[1:], strict=False))
    assert sent[0] == pytest.approx(good.objective)  # the warm start, then only better ones
    assert result.choices is not None and memory_feasible(problem, result.choices)
    assert result.objective == pytest.approx(additive_cost(problem, result.choices))
    assert result.objective <= good.objective + 1e-9


def test_the_channels_stop_flag_ends_the_search() -> None:
    problem = random_problem(200, 6, seed=4, memory=True)
    stop = threading.Event()
    stop.set()
    result = solve(problem, channel=Channel(stop=stop), extra={"patience": 0})
    assert result.choices is not None and result.stats["moves"] == 0
