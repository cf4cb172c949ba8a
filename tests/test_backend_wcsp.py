"""The `toulbar2` backend and the Lagrangian lower bound (backends/wcsp)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np
import pytest

from backends import SolveOptions, Status, get_backend
from backends.base import Channel
from backends.testing import BackendConformance
from backends.wcsp.bound import Lagrangian, lower_bound
from backends.wcsp.contract import contract
from backends.wcsp.memory import kernel_arrays, profile, repair, steps, unbreak
from backends.wcsp.network import build_network
from backends.wcsp.trws import incidence
from planner.deadline import Deadline
from planner.problems.costtable import brute_force, contest_problem, random_problem
from planner.problems.evaluate import additive_cost, memory_feasible

RTOL = 1e-9


class TestToulbar2Conformance(BackendConformance):
    backend_name = "toulbar2"
    extra = {"bound_share": 0.2, "round_seconds": 5.0}


def _problems(count: int, nodes: int = 8, memory: bool = True) -> list:
    return [random_problem(nodes, 4, seed=s, memory=memory, forbid_prob=0.15) for s in range(count)]


@pytest.mark.parametrize("memory", [False, True])
def test_exact_against_brute_force(memory: bool) -> None:
    """Small problems (knapsack rows for memory): OPTIMAL and the brute-force optimum."""
    backend = get_backend("toulbar2")
    for problem in _problems(25, memory=memory):
        best, value = brute_force(problem)
        result = backend.solve(problem, SolveOptions(time_limit=10, seed=0, gap_tolerance=0.0))
        if best is None:
            assert result.choices is None and result.status is Status.INFEASIBLE
            continue
        assert result.status is Status.OPTIMAL, problem.name
        assert math.isclose(result.objective, value, rel_tol=RTOL)


@pytest.mark.parametrize("count", [10, pytest.param(25, marks=pytest.mark.slow)])
def test_priced_rounds_are_valid_and_bounded(count: int) -> None:
    """Memory as prices (no knapsack rows): every answer valid, never below the optimum, the
    bound never above it, OPTIMAL only at the optimum (10 problems by default, some of them
    ending at the time limit; 25 under slow)."""
    backend = get_backend("toulbar2")
    opts = SolveOptions(time_limit=2, seed=0, extra={"exact_memory_nodes": 0}, gap_tolerance=0.0)
    round_bounds = 0
    for problem in _problems(count, nodes=9):
        best, value = brute_force(problem)
        result = backend.solve(problem, opts)
        if best is None:
            assert result.choices is None
            continue
        if "round_bound" in result.stats:  # toulbar2's dual of a priced round, L(lambda)
            round_bounds += 1
            assert result.stats["round_bound"] <= value * (1 + RTOL) + 1e-9, problem.name
        if result.choices is None:
            continue
        assert memory_feasible(problem, result.choices)
        assert result.objective >= value * (1 - RTOL)
        if result.bound is not None:
            assert result.bound <= value * (1 + RTOL) + 1e-9
        if result.status is Status.OPTIMAL:
            assert math.isclose(result.objective, value, rel_tol=RTOL)
    # the priced rounds' bounds were checked, not skipped (the problems whose optimum the
    # Lagrangian bound proves before any round, half of them, need none)
    assert round_bounds >= count // 5


@pytest.mark.parametrize("seeds", [20, pytest.param(60, marks=pytest.mark.slow)])
def test_lower_bound_never_exceeds_the_optimum(seeds: int) -> None:
    """The Lagrangian bound over TRW-S, on problems with memory limits and forbidden entries."""
    closed = 0
    for seed in range(seeds):
        problem = random_problem(8, 4, seed=seed, memory=seed % 4 != 0, forbid_prob=0.15)
        best, value = brute_force(problem)
        bound = lower_bound(problem, Deadline.after(5.0))
        if best is None:
            continue  # any bound (inf included) is valid on an infeasible problem
        assert bound <= value * (1 + RTOL) + 1e-9, problem.name
        closed += bound >= value * (1 - 0.05)
    assert closed >= seeds // 3  # and it is not trivially low


@pytest.mark.parametrize("seeds", [14, pytest.param(40, marks=pytest.mark.slow)])
def test_the_bound_on_the_contracted_network_never_exceeds_the_optimum(seeds: int) -> None:
    """The Lagrangian bound over TRW-S on the contracted network (the functional nodes folded
    into their roots) is a bound on contest-like problems, and as close as on the network."""
    contracted, closed = 0, 0
    for seed in range(seeds):
        problem = contest_problem(7, seed=seed, strategies=(3, 5))
        best, value = brute_force(problem)
        net = build_network(problem)
        con = contract(net)
        if best is None or net.empty is not None or con is None or con.removed == 0:
            continue
        contracted += 1
        plain = Lagrangian(net, steps(problem)).run(Deadline.after(2.0), value)
        folded = Lagrangian(net, steps(problem), contraction=con).run(Deadline.after(2.0), value)
        assert folded <= value * (1 + RTOL) + 1e-9, seed
        closed += folded >= min(plain, value * (1 - 0.05))
    assert contracted >= seeds // 4 and closed >= contracted - 2


def test_lower_bound_is_exact_on_trees_without_memory() -> None:
    """TRW-S is exact on a tree: the bound reaches the optimum."""
    problem = random_problem(10, 4, seed=3, edge_prob=0.0, memory=False, forbid_prob=0.0)
    assert len(problem.edges) < problem.num_nodes  # a forest
    _, value = brute_force(problem)
    assert lower_bound(problem, Deadline.after(5.0)) == pytest.approx(value, rel=1e-9)


def test_expired_deadline_returns_at_once() -> None:
    problem = random_problem(30, 5, seed=1)
    expired = Deadline(time.perf_counter() - 1.0)
    result = get_backend("toulbar2").solve(problem, SolveOptions(deadline=expired))
    assert result.choices is None and result.status is Status.NO_SOLUTION
    assert lower_bound(problem, expired) == -math.inf or lower_bound(problem, expired) <= (
        brute_force(random_problem(30, 5, seed=1, memory=False))[1] * 10
    )


def test_repair_brings_an_answer_within_the_limit() -> None:
    """From the least-cost labelling (memory ignored), the repair finds one within the limit
    that avoids every forbidden pair."""
    fixed = 0
    for seed in range(20):
        problem = random_problem(12, 4, seed=seed, forbid_prob=0.1)
        net = build_network(problem)
        st = steps(problem)
        assert st is not None and net.empty is None
        x = np.array(
            [
                int(np.argmin(net.unary[a:b]))
                for a, b in zip(net.noff[:-1], net.noff[1:], strict=True)
            ]
        )
        if not math.isfinite(additive_cost(problem, net.choices(x))):
            continue
        prof = profile(st, net.usage[net.noff[:-1] + x], st.count)
        inc = incidence(net.noff, net.eu, net.ev)
        g = kernel_arrays(net.noff, net.unary, net.eu, net.ev, net.eoff, net.binary, inc)
        ok = repair(x, prof, st.first, st.after, st.limit, net.usage, g, 1000, 50)
        if ok == 1:
            choices = net.choices(x)
            assert memory_feasible(problem, choices)
            assert math.isfinite(additive_cost(problem, choices))
            fixed += 1
    assert fixed >= 5


def test_every_repair_move_lowers_the_total_excess() -> None:
    """Each move of the repair lowers the summed excess over the limit, so it cannot cycle
    (a chain move that saved at the fullest step but added at another was made and undone
    forever: toulbar2 on contest_problem(60, seed=2) spent its whole time limit there)."""
    moves = 0
    for seed in range(30):
        problem = contest_problem(60, seed=seed)
        net = build_network(problem)
        st = steps(problem)
        assert st is not None and net.empty is None
        rng = np.random.default_rng(seed)
        x = np.array([int(rng.integers(d)) for d in net.dom], dtype=np.int64)
        inc = incidence(net.noff, net.eu, net.ev)
        g = kernel_arrays(net.noff, net.unary, net.eu, net.ev, net.eoff, net.binary, inc)
        unbreak(x, g, 200)
        prof = profile(st, net.usage[net.noff[:-1] + x], st.count)
        excess = float(np.clip(prof - st.limit, 0, None).sum())
        for _ in range(500):
            ok = repair(x, prof, st.first, st.after, st.limit, net.usage, g, 1, 200)
            after = float(np.clip(prof - st.limit, 0, None).sum())
            if ok != -1:
                assert ok == 0 or after == 0.0
                break
            assert after < excess
            excess = after
            moves += 1
        else:
            raise AssertionError("the repair did not end")
    assert moves > 30


def test_toulbar2_priced_rounds_on_a_small_contest_problem_end() -> None:
    """The case where the repair cycled: the rounds all run and an answer comes back."""
    extra = {
        "exact_memory_nodes": 0, "round_seconds": 9.0, "bound_share": 0.0,
        "min_round_seconds": 0.5, "max_rounds": 3,
    }  # fmt: skip
    problem = contest_problem(60, seed=2)
    result = get_backend("toulbar2").solve(problem, SolveOptions(time_limit=20, extra=extra))
    assert result.stats["rounds"] == 3
    assert result.choices is not None and memory_feasible(problem, result.choices)


@pytest.mark.parametrize(
    "seeds", [(1,), pytest.param((0, 1, 2), marks=pytest.mark.slow)], ids=["seed-1", "seeds-0-2"]
)
def test_rounds_are_crossed_with_the_best_answer(seeds: tuple[int, ...]) -> None:
    """After a round, the best answer takes the parts of the round's labellings that pay and
    fit (`backends.wcsp.crossover`): on contest-like problems some part moves, and the
    answer stays valid (by default on seed 1, where the most parts moved when measured; the
    three seeds under slow)."""
    extra = {
        "exact_memory_nodes": 0, "round_seconds": 4.0, "bound_share": 0.0,
        "min_round_seconds": 0.5, "max_rounds": 4,
    }  # fmt: skip
    crossed = 0
    for seed in seeds:
        problem = contest_problem(200, seed=seed)
        result = get_backend("toulbar2").solve(problem, SolveOptions(time_limit=20, extra=extra))
        assert result.choices is not None and memory_feasible(problem, result.choices)
        crossed += result.stats.get("crossed", 0)
    assert crossed > 0


def test_answers_a_little_worse_than_the_best_go_out_as_candidates() -> None:
    """toulbar2's repaired answers: a better one to `on_incumbent`, one within
    CANDIDATE_RANGE above the best to `on_candidate`, a worse or invalid one to neither."""
    from backends.wcsp.toulbar2 import CANDIDATE_RANGE, _Best

    problem = random_problem(6, 3, seed=2, memory=False, forbid_prob=0.0)
    ranked = sorted(
        (additive_cost(problem, c), c) for c in itertools.product(*map(range, problem.sizes))
    )
    best_cost, best = ranked[0]
    near = next(c for v, c in ranked if best_cost < v <= best_cost * (1 + CANDIDATE_RANGE))
    far = next(c for v, c in ranked if v > best_cost * (1 + CANDIDATE_RANGE))
    seen: dict[str, list[tuple[int, ...]]] = {"better": [], "candidate": []}
    channel = Channel(
        on_incumbent=lambda ch, who: seen["better"].append(ch),
        on_candidate=lambda ch, who: seen["candidate"].append(ch),
    )
    keeper = _Best(channel=channel)
    for choices in (best, near, far):
        keeper.offer(problem, tuple(choices), "toulbar2 round")
    keeper.offer(problem, tuple(near), "incoming")  # another's answer is not sent back
    assert seen == {"better": [tuple(best)], "candidate": [tuple(near)]}


def test_a_node_with_only_forbidden_partners_is_infeasible() -> None:
    problem = random_problem(5, 3, seed=0, memory=False, forbid_prob=0.0)
    u, v = problem.edges[0]
    tables = list(problem.edge_cost)
    tables[0] = np.full_like(tables[0], np.inf)
    blocked = dataclasses.replace(problem, edge_cost=tuple(tables))
    assert brute_force(blocked)[0] is None
    result = get_backend("toulbar2").solve(blocked, SolveOptions(time_limit=5))
    assert result.status is Status.INFEASIBLE and result.choices is None
    assert lower_bound(blocked, Deadline.after(1.0)) == math.inf


@pytest.mark.slow
def test_bound_and_answer_on_a_larger_problem() -> None:
    problem = random_problem(300, 8, seed=5, forbid_prob=0.1)
    result = get_backend("toulbar2").solve(problem, SolveOptions(time_limit=20, seed=0))
    assert result.choices is not None and result.bound is not None
    assert result.bound <= result.objective * (1 + RTOL)


def _never_ends(*args: object) -> None:
    time.sleep(600)


def test_a_toulbar2_round_that_does_not_end_is_killed_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A round runs in a child process: one that would never end (toulbar2 cannot be
    interrupted in-process) is killed at the deadline and counts as a round without answer."""
    import backends.wcsp.toulbar2 as tb

    monkeypatch.setattr(tb, "_run", _never_ends)  # the forked child runs this
    run = tb._apart(Deadline.after(0.2))
    assert run.labels is None and run.timed_out and not run.proven


def test_a_toulbar2_round_is_killed_at_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    import backends.wcsp.toulbar2 as tb
    from planner.deadline import clear_stop, request_stop

    monkeypatch.setattr(tb, "_run", _never_ends)
    request_stop()  # what the first Ctrl-C does
    try:
        run = tb._apart(Deadline.never())
    finally:
        clear_stop()
    assert run.labels is None and run.timed_out


def test_a_round_without_a_labelling_is_tried_again_for_longer(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A priced round that ends without a labelling (too short for toulbar2 to find one)
    does not end the rounds: the same prices again, twice as long (S with 10 s rounds ended
    without an answer)."""
    from backends.wcsp import toulbar2 as module

    real = module._apart
    asked: list[int] = []

    def first_empty(clock, net, penalty, scale, seed, seconds, *rest, **kw):  # type: ignore[no-untyped-def]
        asked.append(seconds)
        if len(asked) == 1:
            return module._Run(None, 0.0, False, True, 0.0, 0, 0.0)
        return real(clock, net, penalty, scale, seed, seconds, *rest, **kw)

    monkeypatch.setattr(module, "_apart", first_empty)
    problem = contest_problem(80, seed=4)
    extra = {"exact_memory_nodes": 0, "round_seconds": 2.0, "max_rounds": 3}
    result = get_backend("toulbar2").solve(problem, SolveOptions(time_limit=20, extra=extra))
    assert result.stats["empty_rounds"] == 1 and len(asked) >= 2
    assert asked[1] >= asked[0]  # twice 2 s (whole CPU seconds, by the CPU share)
    assert result.choices is not None and memory_feasible(problem, result.choices)


def _round_lengths(monkeypatch, **extra):  # type: ignore[no-untyped-def]
    """toulbar2 on a small contest-like problem with priced rounds of at most 9 s: its result
    and the CPU seconds each round was given."""
    from backends.wcsp import toulbar2 as module

    real = module._apart
    asked: list[int] = []

    def record(clock, net, penalty, scale, seed, seconds, *rest, **kw):  # type: ignore[no-untyped-def]
        asked.append(seconds)
        return real(clock, net, penalty, scale, seed, seconds, *rest, **kw)

    monkeypatch.setattr(module, "_apart", record)
    monkeypatch.setattr(module._CpuShare, "share", lambda self: 1.0)  # a whole core, as if quiet
    extra = {"exact_memory_nodes": 0, "round_seconds": 9.0, "bound_share": 0.0, **extra}
    options = SolveOptions(time_limit=30, extra=extra)
    return get_backend("toulbar2").solve(contest_problem(60, seed=2), options), asked


def test_rounds_after_the_first_are_as_long_as_a_first_labelling_took(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A round's length follows how long toulbar2 took to its first labelling in the round
    before (read from its log), so the prices change more often (IOPDDL S: 11 rounds in
    240 s instead of 5); `round_seconds` stays the cap."""
    from backends.wcsp.toulbar2 import FIRST_EXTRA, FIRST_FACTOR

    result, asked = _round_lengths(monkeypatch, min_round_seconds=0.5, max_rounds=3)
    firsts = result.stats["first_labelling_seconds"]
    assert firsts and all(0.0 <= t < 9.0 for t in firsts)
    assert asked[0] == 9 and len(asked) >= 2
    assert asked[1] == max(1, int(FIRST_FACTOR * firsts[0] + FIRST_EXTRA))


def test_rounds_are_at_least_min_round_seconds(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """toulbar2 still improves a labelling for seconds after its first (IOPDDL M lost 0.3%
    with 5 s rounds): later rounds are never shorter than `min_round_seconds`."""
    result, asked = _round_lengths(monkeypatch, min_round_seconds=4.0, max_rounds=2)
    assert result.stats["first_labelling_seconds"][0] < 2.0  # a small network: at once
    assert asked[:2] == [9, 4]


def test_the_first_labelling_time_is_read_from_toulbar2s_log(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from backends.wcsp.toulbar2 import _first_labelling

    log = tmp_path / "tb2.log"
    log.write_text(
        "Preprocessing time: 4.255 seconds.\n"
        "New solution: 891393839 (0 backtracks, 511 nodes, depth 513, 12.509 seconds)\n"
        "New solution: 887665732 (489 backtracks, 1418 nodes, depth 419, 19.036 seconds)\n"
    )
    assert _first_labelling(str(log)) == 12.509
    assert not log.exists()  # the log is deleted once read
    empty = tmp_path / "none.log"
    empty.write_text("Time limit expired... Aborting...\n")
    assert _first_labelling(str(empty)) is None
    assert _first_labelling(None) is None


def test_a_prebuilt_round_solves_the_network_a_whole_build_solves() -> None:
    """A priced round on the network built once (`_Prebuilt`, forbidden pairs at HARD) finds
    the same optimum of the priced network, with the same dual bound, as a round that builds
    it whole; its log's first-labelling time counts from the round's own start."""
    from backends.wcsp import toulbar2 as module

    p = contest_problem(40, seed=3)
    net = build_network(p, Deadline.after(10))
    rng = np.random.default_rng(0)
    penalty = np.floor(rng.random(len(net.unary)) * 1000)
    clock = Deadline.after(20)
    whole = module._apart(clock, net, penalty, 1.0, 0, 5, None, p)
    pre = module._prebuild(net, 1.0)  # toulbar2's clock starts here (this process's CPU)
    assert pre is not None and pre.fits(net, penalty)
    for seed in (0, 1):  # the parent's network is never touched: twice the same round
        run = module._apart(clock, net, penalty, 1.0, seed, 5, pre, solve=module._run_prebuilt)
        assert run.proven and whole.proven and run.bound == whole.bound
        assert run.labels is not None and whole.labels is not None
        cost = net.unary + penalty
        value = [
            float(cost[net.noff[:-1] + x].sum())
            + sum(float(net.table(e)[x[net.eu[e]], x[net.ev[e]]]) for e in range(len(net.eu)))
            for x in (run.labels, whole.labels)
        ]
        assert value[0] == value[1]
        assert run.first is not None and 0 <= run.first < 1.0
