"""mcmc under memory limits: a path to feasibility, only valid answers, cheap exact bookkeeping."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backends import SolveOptions, Status, get_backend
from backends.mcmc.state import ChainState, MemoryUsage
from backends.testing import tiny_cnn
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.costtable import brute_force, random_problem
from planner.problems.evaluate import memory_feasible, memory_peak
from planner.problems.problem import Problem, build_problem


def _tightened(nodes: int, strategies: int, seed: int, factor: float) -> Problem:
    p = random_problem(nodes, strategies, seed=seed, memory=True)
    assert p.usage_limit is not None
    return dataclasses.replace(p, usage_limit=p.usage_limit * factor)


problems = st.builds(
    _tightened,
    st.integers(2, 8),
    st.integers(1, 4),
    st.integers(0, 10_000),
    st.floats(0.6, 1.0),
)


@settings(max_examples=60, deadline=None)
@given(problems, st.sampled_from([None, ["random"], ["data_parallel"]]))
# Over the limit by 1e-5 of it: a charge proportional to the excess alone never made the one
# feasible answer (cost +124) worth taking, so the chain stayed over the limit.
@example(_tightened(2, 3, 3, 0.99999), ["data_parallel"])
# A random start with a forbidden pair and a cost of 26, where the one valid strategy costs
# 6,475: a penalty in the start's cost could never pay for the climb (NO_SOLUTION).
@example(_tightened(4, 3, 141, 1.0), ["random"])
def test_finds_a_feasible_answer_wherever_brute_force_does(p: Problem, inits) -> None:
    # The old backend rejected every proposal over the limit: from an infeasible start it had
    # no path to feasibility (19 of 100 such problems ended with NO_SOLUTION).
    extra = {"iterations": 300, **({"inits": inits} if inits else {})}
    r = get_backend("mcmc").solve(p, SolveOptions(seed=1, extra=extra))
    best, value = brute_force(p)
    if best is None:
        assert r.choices is None and r.status in (Status.INFEASIBLE, Status.NO_SOLUTION)
        return
    assert r.choices is not None, f"no feasible answer on {p.name} (inits {inits})"
    assert memory_feasible(p, r.choices)
    assert r.objective >= value * (1 - 1e-9)


@settings(max_examples=40, deadline=None)
@given(problems, st.integers(0, 2**32 - 1))
def test_incremental_live_usage_equals_the_evaluator(p: Problem, seed: int) -> None:
    rng = np.random.default_rng(seed)
    choices = [int(rng.integers(n)) for n in p.sizes]
    mem = MemoryUsage(p, choices)
    for _ in range(30):
        i = int(rng.integers(p.num_nodes))
        choices[i] = int(rng.integers(p.sizes[i]))
        mem.set(i, choices[i])
        peak = mem.live.max(axis=0) if len(mem.live) else np.zeros(1)
        np.testing.assert_allclose(peak, memory_peak(p, choices), rtol=1e-12)
        assert (mem.excess() == 0) == memory_feasible(p, choices)


def test_impossible_limits_are_proven_infeasible_at_once() -> None:
    p = build_problem(tiny_cnn(), get_preset("p100-1x2"), max_configs=6, memory_limit=1e3)
    r = get_backend("mcmc").solve(p, SolveOptions(objective="makespan", time_limit=60))
    assert r.status is Status.INFEASIBLE and r.limit is None
    assert "memory" in r.stats["infeasible"]


def _dnn_with_binding_limit() -> tuple[Problem, tuple[int, ...]]:
    """tiny_cnn on 2 devices with a limit that data parallelism exceeds but others meet."""
    free = build_problem(tiny_cnn(), get_preset("p100-1x2"), max_configs=6)
    dp = free.choices_of(data_parallel(free.dnn().graph, free.dnn().devices))
    assert free.usage is not None
    least = tuple(int(np.argmin(u.max(axis=1))) for u in free.usage)
    limit = 0.5 * (memory_peak(free, least).max() + memory_peak(free, dp).max())
    p = build_problem(tiny_cnn(), get_preset("p100-1x2"), max_configs=6, memory_limit=limit)
    assert not memory_feasible(p, dp)
    return p, dp


def test_a_dnn_over_its_memory_limit_reaches_a_feasible_strategy() -> None:
    # Old backend: NO_SOLUTION (every start over the limit, every move over it rejected).
    p, _ = _dnn_with_binding_limit()
    opts = SolveOptions(objective="makespan", extra={"iterations": 300, "inits": ["data_parallel"]})
    r = get_backend("mcmc").solve(p, opts)
    assert r.status is Status.FEASIBLE and memory_feasible(p, r.choices)
    assert r.stats["starts"] == {"data_parallel": None}  # the start itself was over the limit


def test_the_penalty_state_counts_memory_excess() -> None:
    p, dp = _dnn_with_binding_limit()
    state = ChainState(p, dp, "makespan")
    assert not state.valid and state.violation > 0
    assert state.memory is not None and state.memory.overfull() is not None
