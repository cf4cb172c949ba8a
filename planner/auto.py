"""`backend="auto"`, the default of `planner.plan` and `python -m planner plan`: the backend
whose answer a user can trust most, chosen for the problem and the objective.

- The additive objective (OptCNN's Eq. 1): `elimination`, which proves the optimum (the zoo's
  models on up to 1,024 GPUs: docs/scaling.md). It cannot enforce a memory limit, so its
  answer is then checked against the memory: the problem's limit if it has one, and for a DNN
  problem every device's own memory. An answer that fits is also the optimum under that
  limit (a limit only removes answers). When it does not fit, memory is tight: the problem is
  searched again under the limit (a DNN problem without one gets its devices' memory) by
  `portfolio`, which finds a valid answer first (the feasibility heuristic), then lets `ilp`
  and `cpsat` improve it and prove what they can; elimination's optimum, proven without the
  limit, stays as a lower bound. A cost-table problem with a memory limit (every IOPDDL
  problem has one) goes to `portfolio` directly. When some answer could exceed the limit,
  elimination gets the search time but `SECOND_SEARCH_SHARE` (25%), kept for that search.
  For a DNN problem of `DNN_MEMBERS_NODES` nodes or more that second search is `toulbar2`
  and `local` (`DNN_MEMBERS`; on smaller ones the portfolio's default members), with
  elimination's optimum as the portfolio's first bound, and it ends as soon as its answer is
  within the gap tolerance of the bound, or once it has stopped improving (`DNN_PATIENCE`):
  on a model's tables (a 7B Llama on 8 GPUs: 421 nodes, every one live at the memory peak)
  they find in 10-20 s answers within 0.5% of what `ilp` and `cpsat` found in the whole
  minute, often better (by up to 11%), and prove them within 0.2-1.6% (toulbar2's
  Lagrangian bound) where `ilp` and `cpsat` proved nothing closer than 6-19%
  (docs/solvers.md, "auto under the memory limit").
- The makespan objective (FlexFlow's simulated iteration time): `mcmc`, FlexFlow's search.

Every backend except `elimination` enforces a memory limit (`MEMORY_BACKENDS`).
`stats["auto"]` says which backend answered and why.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from planner.problems.evaluate import device_capacity, fits_devices, memory_peak
from planner.problems.problem import Problem
from planner.problems.sizes import format_bytes
from planner.registry import get_backend
from planner.result import SolveOptions, SolveResult, Status

__all__ = ["AUTO", "MEMORY_BACKEND", "MEMORY_BACKENDS", "solve_auto"]

AUTO = "auto"
MEMORY_BACKEND = "portfolio"  # what auto searches with when memory is tight
MEMORY_BACKENDS = ("portfolio", "cpsat", "ilp", "search", "mcmc", "local", "toulbar2")
# Of the search time, kept for a search under the memory limit when some answer could exceed
# it (elimination usually needs a fraction of a second, and a proof, not this share, is what
# a large problem may need the time for).
SECOND_SEARCH_SHARE = 0.25
# A DNN's search under the memory limit: these members (the portfolio's for large tables)
# and a patience: stopped once no answer gained DNN_PATIENCE_GAIN on the last gain's for
# DNN_PATIENCE seconds or, when longer, for as long as the search took to that gain (so at
# twice that time: the same rule on a busy machine). Measured on the 7B plans of
# docs/solvers.md, "auto under the memory limit".
DNN_MEMBERS = ("toulbar2", "local")
# ... from this many nodes: on smaller tables ilp and cpsat (the portfolio's default) prove
# the optimum in a second or two, where toulbar2 and local stalled 32% above it (a 3-layer
# GPT-2 on 2 GPUs, 42 nodes: tests/test_cli.py)
DNN_MEMBERS_NODES = 200
DNN_PATIENCE = 2.0
DNN_PATIENCE_SHARE = 1.0
DNN_PATIENCE_GAIN = 1e-3

log = logging.getLogger(__name__)


def solve_auto(
    problem: Problem, options: SolveOptions, cutoff: float | None = None
) -> tuple[SolveResult, Problem]:
    """Solve `problem` as the module docstring says; the result and the problem it answers
    (the one searched last: with the memory limit it was searched under). `cutoff`: an
    answer the caller has in hand; when elimination's optimum without the memory limit
    cannot beat it by more than the gap tolerance, there is no search under the limit (its
    answers would cost at least that optimum): elimination's answer is returned as it is."""
    if options.objective == "makespan":
        why = "the makespan objective: FlexFlow's MCMC search"
        return _solve("mcmc", problem, options, why), problem
    if problem.has_memory_limit and not problem.is_dnn:
        why = "a cost-table problem with a memory limit"
        return _solve(MEMORY_BACKEND, problem, options, why), problem
    limited = _limited(problem)
    if limited is None:
        why = "the additive objective: exact, and no memory limit applies"
        return _solve("elimination", problem, options, why), problem
    clock = options.clock()
    first = clock.reserve(SECOND_SEARCH_SHARE * clock.left()) if _can_exceed(limited) else clock
    free = problem.with_usage_limit(None)
    why = "the additive objective: exact, and its answer fits the memory"
    result = _solve("elimination", free, options.with_deadline(first), why)
    if result.choices is not None and fits_devices(limited, result.choices):
        return result, problem
    tight = _tight(limited, result)
    low = result.bound if result.status is Status.OPTIMAL else None
    if cutoff is not None and low is not None and low * (1 + options.gap_tolerance) >= cutoff:
        why = f"{tight}; its optimum cannot beat the answer in hand ({cutoff:.6g}): no search"
        auto = {**result.stats["auto"], "why": why}
        return dataclasses.replace(result, stats={**result.stats, "auto": auto}), problem
    log.warning("%s: searching again under the memory limit with %s", tight, MEMORY_BACKEND)
    # a limit only removes answers: elimination's bound without it bounds the search under it
    free_bound = result.bound if result.status is Status.OPTIMAL else None
    channel = dataclasses.replace(options.channel, bound=lambda: free_bound)
    second_options = dataclasses.replace(
        options.with_deadline(clock), channel=channel, extra=_memory_settings(limited, options)
    )
    second = _solve(MEMORY_BACKEND, limited, second_options, tight)
    bound = second.bound
    if free_bound is not None:
        bound = free_bound if bound is None else max(bound, free_bound)
    auto = {**second.stats["auto"], "unconstrained": _summary(result)}
    return dataclasses.replace(second, bound=bound, stats={**second.stats, "auto": auto}), limited


def _memory_settings(problem: Problem, options: SolveOptions) -> dict[str, Any]:
    """The portfolio's settings for the search under the memory limit: for a DNN problem
    `DNN_MEMBERS` (when installed) and the patience; none for a cost-table problem (its
    search uses the whole time limit)."""
    if not problem.is_dnn:
        return {}
    out: dict[str, Any] = {
        "patience": DNN_PATIENCE,
        "patience_share": DNN_PATIENCE_SHARE,
        "patience_gain": DNN_PATIENCE_GAIN,
    }
    plain = dataclasses.replace(options, extra={})
    large = problem.num_nodes >= DNN_MEMBERS_NODES
    if large and all(get_backend(m).can_run(problem, plain) is None for m in DNN_MEMBERS):
        out["members"] = list(DNN_MEMBERS)
    return out


def _limited(problem: Problem) -> Problem | None:
    """`problem` under the limit its answer must meet (its own and, for a DNN problem, each
    device's memory); None when nothing limits it."""
    capacity = device_capacity(problem)
    if capacity is None or problem.usage is None:
        return problem if problem.has_memory_limit else None
    given = problem.usage_limit
    return problem.with_usage_limit(capacity if given is None else np.minimum(given, capacity))


def _can_exceed(problem: Problem) -> bool:
    """Whether some answer could exceed the problem's limit: every node's largest usage,
    summed, does (an upper bound on any answer's peak)."""
    assert problem.usage is not None and problem.usage_limit is not None
    worst = np.sum([u.max(axis=0) for u in problem.usage], axis=0)
    return bool((worst > problem.usage_limit).any())


def _tight(limited: Problem, result: SolveResult) -> str:
    """Why the exact answer was not enough, in one line."""
    if result.choices is None:
        return f"elimination found no answer (status {result.status.value})"
    peak = memory_peak(limited, result.choices)
    assert limited.usage_limit is not None
    worst = int(np.argmax(peak / limited.usage_limit))
    return (
        f"memory is tight: elimination's optimum needs {format_bytes(float(peak[worst]))} on "
        f"device {worst}, over its limit of {format_bytes(float(limited.usage_limit[worst]))}"
    )


def _solve(name: str, problem: Problem, options: SolveOptions, why: str) -> SolveResult:
    result = get_backend(name).solve(problem, options)
    return dataclasses.replace(result, stats={**result.stats, "auto": {"chose": name, "why": why}})


def _summary(result: SolveResult) -> dict[str, Any]:
    return {
        "backend": result.backend,
        "status": result.status.value,
        "objective": result.objective,
        "choices": list(result.choices) if result.choices is not None else None,
    }
