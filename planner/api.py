"""`planner.plan`: from a model to a strategy in one call, the library's entry point.

```python
import planner
result = planner.plan(net, "cpu-local-2", example_inputs=(torch.randn(8, 3, 32, 32),))
result.status, result.objective, result.gap   # Status.OPTIMAL, seconds per step, 0.0
result.save("plan.json")                       # the strategy file runtime.run executes
```

The time limit bounds the whole call from its start: capturing the model and building the
cost tables count against it and the backend gets what is left (phase seconds in
`result.stats`: capture, build, encode where the backend reports it, search, re-score,
total). Its arguments become one `planner.request.PlanRequest`, checked once; only that
request travels after. When capture and build use the limit up they are finished (up to
the request's `hard` deadline) and the answer comes without a search (`_overrun_answer`),
said in one warning line. The library never imports a backend at module level (backends import planner);
`plan` imports the one it uses.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.costs.recompute import RECOMPUTE_AUTO
from planner.deadline import (
    BuildOutOfTime,
    Deadline,
    OutOfTime,
    catch_interrupt,
    stop_requested,
    stopped,
)
from planner.errors import LayerwiseError
from planner.plans import Evaluation, PipelinePlan, PlanResult, evaluate_strategy
from planner.request import (
    AUTO,
    DEFAULT_TIME_LIMIT,
    ZERO_AUTO,
    ZERO_STAGES,
    PlanRequest,
    check_backend,
    overrun_words,
)
from planner.result import DEFAULT_GAP_TOLERANCE, Limit, SolveOptions, SolveResult, Status
from planner.sources import problem_of

if TYPE_CHECKING:
    from planner.hardware.devices import DeviceGraph
    from planner.problems.problem import Problem
    from planner.problems.sizes import MemoryRefusal

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "Evaluation",
    "PlanResult",
    "check_backend",
    "evaluate_strategy",
    "plan",
    "plan_request",
]

log = logging.getLogger(__name__)


# -- the entry point --------------------------------------------------------------------------


def plan(
    model: Any,
    devices: str | Path | DeviceGraph | None = None,
    backend: str = "auto",
    objective: str = "additive",
    time_limit: float = DEFAULT_TIME_LIMIT,
    seed: int = 0,
    *,
    example_inputs: Any = None,
    model_kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    coarsen: bool = True,
    precision: str | None = None,
    memory_limit: float | str | None = None,
    cost: str = "analytic",
    sync: str | None = None,
    optimizer: str | None = None,
    master_weights: bool | None = None,
    zero: int | str | None = None,
    headroom: float | None = None,
    reserve: float | None = None,
    recompute: str | int | None = None,
    max_configs: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
    recommend: bool = True,
    check_memory: bool = True,
    deadline: Deadline | None = None,
    pipeline: bool | str | None = None,
    gap_tolerance: float = DEFAULT_GAP_TOLERANCE,
    **build_options: Any,
) -> PlanResult | PipelinePlan:
    """Find a parallelization strategy for `model` on `devices` with `backend`.

    model: a zoo name ("lenet5"), an `nn.Module` with `example_inputs`, a user factory
    "package.module:callable" with `example_inputs` (recorded in the plan file so that
    `runtime.run` can rebuild the module in other processes), an OpGraph, a Problem, or the
    path of a graph JSON or cost-table (IOPDDL) JSON file. `model_kwargs` size a zoo model
    (e.g. {"batch": 8}) or are passed to the factory. precision: how the model trains, in
    Lightning's names: "bf16-mixed" or "16-mixed" (autocast: fp32 weights, matrix products
    at the 16-bit tensor-core rate, norms and the loss in fp32), "bf16-true", "16-true",
    "32-true", "64-true" (everything in that dtype); None (the default) prices the dtypes
    the model holds (`planner.graph.precision`; recorded in the plan file). devices: a preset name, a device JSON
    path or a DeviceGraph (not for cost-table problems). backend: "auto" (the default:
    elimination, exact, when its answer fits the memory; portfolio under the memory limit
    when memory is tight; mcmc for the makespan objective; `stats["auto"]` says which and
    why: planner/auto.py) or a registered backend's name. objective: "additive" (OptCNN
    Eq. 1) or "makespan" (FlexFlow's simulated iteration time). time_limit: seconds for the
    whole call, capture and build included (when they use it up, they are finished and the
    answer is found without a search: elimination's optimum when it is proven in 0.5 s, else
    the best expert baseline that fits; `stats["overrun"]` and one warning say so). memory_limit: None, "device" or bytes per
    device. cost: "analytic" or "measured" (profiled: `python -m planner profile`); sync:
    "ring" or "ps". Training memory (docs/cost_model.md, "Memory"): optimizer "none" (the
    default: weights and gradients only), "sgd" (a momentum buffer) or "adam" (two fp32
    moments); master_weights: an fp32 copy of 16-bit weights; zero: the ZeRO stage 0-3
    (optimizer state, then gradients, then weights sharded over the data-parallel replicas)
    or "auto" (stage 0, and the next stage while the answer does not fit the devices'
    memory; `stats["zero"]` says which stage and why); headroom: the fraction of each
    device's memory kept free (default 0.05: the allocator's fragmentation) and reserve: the
    bytes kept free on each GPU (default 2 GiB: CUDA context, NCCL buffers, workspaces;
    `planner.costs.memory.DEFAULT_RESERVE`); recompute: "none" (the default), "selective"
    (the attention ops of the model's numbered blocks run their forward again in the
    backward, Megatron-LM's selective recomputation), "full" (every op inside the numbered
    blocks, e.g. a GPT's `transformer.h.3`, keeps nothing and runs its forward again in the
    backward: `planner.costs.recompute`), a number k (the first k blocks do) or "auto" (the
    fastest answer that fits of none, selective, full and, after full, the fewest blocks its
    answer needs; `stats["recompute"]` says which and why).
    With zero and recompute both left unset and the backend "auto", a model whose
    elimination optimum does not fit the devices' memory (memory is tight), or a plan that
    does not fit, is planned again with both "auto" instead of being refused or searched
    under the memory limit at once (`stats["memory_fallback"]` says why; the search under
    the limit without ZeRO or recomputation is still made where it could beat what they
    give: docs/solvers.md, "auto under the memory limit"); a plan whose optimum fits is
    unchanged.
    recommend: never return a strategy that
    FlexFlow's simulator says is slower than an expert baseline that fits the memory
    (docs/compare.md): when one is faster beyond the simulator's stated error (10%) it is
    returned instead, status FEASIBLE, and the searched answer stays in `stats["searched"]` with its status;
    `stats["recommendation"]` says what was decided (False: the searched answer, always).
    check_memory: a strategy whose peak bytes on some device exceed that device's memory is
    an error (`planner.problems.sizes.SizeError`: plan with backend "auto", or with
    memory_limit="device" and any backend but elimination); False
    returns it anyway, with `stats["memory_fits"]` False. backend_options: the backend's
    settings (`SolveOptions.extra`: a mapping, or the backend's settings object, e.g.
    {"mode": "astar"} for "search"; docs/architecture.md, "Settings"), checked before any
    work: an unknown name or a bad value is a BackendError. deadline: a clock the caller
    started earlier (a command line's, from its own start): the earlier of it and
    `time_limit` from now ends the call. gap_tolerance: the relative gap (objective / bound
    - 1) at which every search stops once its answer is proven within it, the answer then
    OPTIMAL (MIP solvers' convention and default, 1e-4; 0 proves the optimum exactly;
    `planner.result.SolveOptions`, docs/solvers.md "Gap tolerance"); `stats["gap_tolerance"]`
    records it. Further keyword arguments go to `build_problem` unchanged (space,
    table_budget, max_split_dims: docs/space.md).

    pipeline (docs/pipeline.md): True plans with pipeline parallelism (`planner.pipelined.
    plan_pipeline`: stages, micro-batches, schedule, tensor and data degrees, recomputation
    and ZeRO searched together) and returns a `PipelinePlan`; False never does; None or
    "auto" (the default) does for a stack of repeated, alike numbered blocks (a
    transformer's; `planner.pipelined.auto_search`) on devices of more than one host, and for
    one that does not fit the devices otherwise (the plain plan refused for memory after the
    ZeRO and recomputation fallback), when backend, cost and the search options are left at
    their defaults; when that pipeline search finds no layout, the per-op search plans it
    instead (one warning; `stats["pipeline_refused"]` says why).

    Refused at once, each in one line: a memory that nothing fits (the parameters' training
    state alone exceeds the devices': `MemoryRefusal` with `final`), a memory_limit below
    any answer's least footprint (`SizeError`), a recompute the model has no blocks for, and
    master_weights without an optimizer. A Ctrl-C before there is any answer raises
    KeyboardInterrupt("interrupted ...").
    """
    request = PlanRequest.make(
        model,
        devices,
        backend,
        objective,
        time_limit,
        seed,
        example_inputs=example_inputs,
        model_kwargs=model_kwargs,
        name=name,
        coarsen=coarsen,
        precision=precision,
        memory_limit=memory_limit,
        cost=cost,
        sync=sync,
        optimizer=optimizer,
        master_weights=master_weights,
        zero=zero,
        headroom=headroom,
        reserve=reserve,
        recompute=recompute,
        max_configs=max_configs,
        backend_options=backend_options,
        recommend=recommend,
        check_memory=check_memory,
        deadline=deadline,
        pipeline=pipeline,
        gap_tolerance=gap_tolerance,
        **build_options,
    )
    return plan_request(request)


def plan_request(request: PlanRequest) -> PlanResult | PipelinePlan:
    """Plan `request` (a `planner.request.PlanRequest`, checked when it was made): what
    `plan` does once its arguments are one request."""
    with catch_interrupt():  # one Ctrl-C for the whole call: no phase clears it for the next
        out = _plan_plain(request) if request.pipeline is False else _choose_search(request)
    if isinstance(out, PlanResult) and BELOW_FOOTPRINT in out.phases:
        from planner.problems.sizes import SizeError

        raise SizeError(out.phases[BELOW_FOOTPRINT])  # a limit no answer meets: one line
    if OVERRUN_KEY in out.stats:
        log.warning("%s", out.stats[OVERRUN_KEY])
    return out


def _choose_search(request: PlanRequest) -> PlanResult | PipelinePlan:
    """`plan`'s choice between the per-op search and the pipeline search (see `plan`'s
    docstring, `pipeline`)."""
    from planner.pipeline.spec import PipelineOutOfTime
    from planner.pipelined import PER_OP, auto_search, check_choices, plan_pipeline_request
    from planner.problems.problem import Problem
    from planner.problems.sizes import MemoryRefusal
    from planner.sources import is_problem_file

    changed = request.search.changed()
    recompute = request.memory.recompute
    if isinstance(recompute, int) and not isinstance(recompute, bool):
        changed.append("recompute (a number of blocks)")
    if request.pipeline is True:
        if changed:
            raise LayerwiseError(
                f"pipeline=True plans with the pipeline search, which takes no "
                f"{', '.join(changed)}: leave them unset (or pipeline=False)"
            )
        return plan_pipeline_request(request)
    if changed or isinstance(request.model, Problem) or is_problem_file(request.model):
        return _plan_plain(request)
    request = request.capture()  # once, for every attempt below
    if auto_search(request.model, request.devices) == PER_OP:
        try:
            return _plan_plain(request)
        except MemoryRefusal as refusal:
            if request.memory.zero is not None or recompute is not None:
                raise  # chosen by hand: the refusal says what does not fit with them
            return _pipeline_after_refusal(request, refusal)
    log.info(
        "%s is a stack of repeated blocks and %s spans hosts: searching pipelines",
        request.model.name,
        request.devices.name,
    )
    check_choices(request)  # the caller's own bad option is an error, not a reason to plan per op
    with catch_interrupt():  # a Ctrl-C during the pipeline search is not a refusal
        try:
            return plan_pipeline_request(request)
        except LayerwiseError as exc:
            if stop_requested() or isinstance(exc, PipelineOutOfTime):
                raise  # out of time is no refusal: the per-op search would have less
            log.warning("the pipeline search gave no plan (%s): planning per op instead", exc)
            return _per_op_after_refusal(request, str(exc))


def _per_op_after_refusal(request: PlanRequest, refused: str) -> PlanResult:
    """The per-op plan of a captured model whose pipeline search, tried first, found no
    layout (`refused`: why; in `stats["pipeline_refused"]`, and in the error when the
    per-op search fails too)."""
    from planner.problems.sizes import MemoryRefusal

    try:
        out = _plan_plain(request)
    except MemoryRefusal as exc:
        raise MemoryRefusal(
            f"{exc}; no pipeline layout fits either ({refused})", exc.fact, exc.final
        ) from None
    except BuildOutOfTime as exc:
        raise LayerwiseError(  # what is known (no layout fits) first
            f"{refused}; the per-op search, tried instead, ran out of time ({exc})"
        ) from None
    return dataclasses.replace(out, phases={**out.phases, "pipeline_refused": refused})


def _pipeline_after_refusal(request: PlanRequest, refusal: MemoryRefusal) -> PipelinePlan:
    """The per-op plan of the captured model was refused for memory: a pipelined one
    instead, for a stack of repeated blocks, in the time left; else the refusal, with why
    pipelines did not help (at once when it is `final`: nothing can fit)."""
    from planner.pipeline.spec import PipelineOutOfTime
    from planner.pipelined import has_blocks, plan_pipeline_request
    from planner.problems.sizes import MemoryRefusal

    if request.deadline.expired() or refusal.final or not has_blocks(request.model):
        raise refusal
    log.info("%s: searching pipelines instead", refusal)
    try:
        out = plan_pipeline_request(request)
    except PipelineOutOfTime as exc:
        raise PipelineOutOfTime(f"{refusal}; planning pipelines instead: {exc}") from None
    except LayerwiseError as exc:
        raise MemoryRefusal(
            f"{refusal}; no pipeline layout fits either ({exc})", refusal.fact
        ) from None
    return dataclasses.replace(out, phases={**out.phases, "memory_fallback": str(refusal)})


def _plan_plain(request: PlanRequest) -> PlanResult:
    """The per-op search: the model captured once, then either the attempts of the "auto"
    memory options or one plan (planned again with both "auto" when it does not fit)."""
    request = request.capture()
    memory, search = request.memory, request.search
    if memory.recompute == RECOMPUTE_AUTO or memory.zero == ZERO_AUTO:  # plan again per choice
        # the attempts are compared by their searched objective; only the one chosen is
        # re-ranked against the baselines (each re-rank simulates them: 2-5 s of a 7B
        # Llama's attempt, most of its time when the answer was proven at once)
        quiet = request.with_search(recommend=False)
        if memory.recompute == RECOMPUTE_AUTO:
            out = _plan_recompute_auto(quiet)
        else:
            out = _plan_zero_auto(quiet)
        return _recommend_chosen(request, out)
    from planner.problems.sizes import MemoryRefusal

    chosen = memory.zero is not None or memory.recompute is not None
    fallback = not chosen and search.check_memory and search.backend == AUTO
    try:
        if fallback and _free_first(request):
            return _plan_free_first(request)
        return _plan_once(request)
    except MemoryRefusal as exc:  # ZeRO and recomputation unset: both "auto" instead
        if not fallback:
            raise
        return _plan_memory_fallback(request, exc)


def _free_first(request: PlanRequest) -> bool:
    """Whether the default plan of a model (ZeRO and recomputation unset, backend auto)
    tries elimination's optimum first (`_plan_free_first`): the additive objective, a
    captured DNN and no memory limit given."""
    from planner.graph.opgraph import OpGraph

    search = request.search
    return (
        isinstance(request.model, OpGraph)
        and search.objective == "additive"
        and search.memory_limit is None
    )


def _plan_free_first(request: PlanRequest) -> PlanResult:
    """The default plan of a model: elimination's proven optimum when it fits the devices'
    memory (what backend "auto" returns then); when memory is tight, MemoryRefusal, so that
    `_plan_plain` plans again with ZeRO and recomputation "auto" (their attempts search
    under the memory limit where that could beat what they find: ZeRO-1 often makes the
    optimum fit at no cost, where a search at stage 0 used the whole time limit)."""
    from planner.problems.sizes import MemoryRefusal, format_bytes

    probe = request.with_search(backend="elimination", check_memory=False, recommend=False)
    out = _plan_once(probe)
    if not _fits(out):
        usable = float(out.problem.dnn().cost_model.usable_memory().min())
        peak = out.stats.get("memory_peak_bytes")
        why = (
            f"memory is tight: elimination's optimum peaks at {format_bytes(peak or 0.0)} on a "
            f"device, over the {format_bytes(usable)} it can use"
            if out.has_solution
            else f"elimination found no answer (status {out.status.value})"
        )
        raise MemoryRefusal(why, why)
    auto = {"chose": "elimination", "why": "the additive objective: exact, and its answer fits "
            "the memory"}  # fmt: skip
    result = dataclasses.replace(out.result, stats={**out.result.stats, "auto": auto})
    return _recommend_chosen(request, dataclasses.replace(out, result=result))


def _recommend_chosen(request: PlanRequest, out: PlanResult) -> PlanResult:
    """The answer an "auto" memory option chose, re-ranked against the baselines
    (`planner.recommend`) as `_search` re-ranks one plan's, its memory use measured again
    when a baseline replaced it."""
    if not (request.search.recommend and out.has_solution and out.problem.is_dnn):
        return out
    t1 = time.perf_counter()
    result = _recommended(out.problem, out.result, request.search.objective, request.deadline)
    seconds = time.perf_counter() - t1
    phases = {**out.phases, "recommend_seconds": seconds}
    phases["total_seconds"] = phases.get("total_seconds", 0.0) + seconds
    if result.choices != out.result.choices:  # a baseline (it fits: recommend checks)
        phases.update(_memory_use(request, out.problem, result))
    return dataclasses.replace(out, result=result, phases=phases)


def _plan_once(request: PlanRequest, built: Problem | None = None) -> PlanResult:
    """Build the problem (`built`: built already, for these options), search it, re-rank the
    answer against the baselines and measure its memory: one per-op plan with every option
    fixed."""
    from planner.problems.sizes import usage_limit_error

    start = time.perf_counter()
    search = request.search
    solver = check_backend(search.backend, search.objective)  # its settings checked already
    with catch_interrupt():
        if built is None:
            problem, phases = _problem(request)
        else:  # captured once, as `_problem` says
            problem, phases = built, {"build_seconds": 0.0}
            if request.capture_seconds > 0:
                phases["capture_seconds"] = request.capture_seconds
        if stop_requested():
            return _interrupted(request, problem, phases, start)
        if request.call.expired():  # (an attempt's share alone: its search gets no time)
            return _overrun_answer(request, problem, phases, start)
        beyond = usage_limit_error(problem)
        if beyond is not None:  # no answer can meet the limit: not searched (plan raises)
            log.info("%s", beyond)
            result = SolveResult(search.backend, Status.INFEASIBLE)
            done = {**phases, "search_seconds": 0.0, BELOW_FOOTPRINT: beyond}
            done["total_seconds"] = _total(request, start)
            return PlanResult(result, search.objective, problem, done, request.spec, beyond)
        result, problem, searched = _search(request, solver, problem)
    phases = {
        **phases,
        **_memory_use(request, problem, result),
        **searched,
        "gap_tolerance": request.gap_tolerance,
        "total_seconds": _total(request, start),
    }
    log.info(
        "%s: %s%s, objective %s, bound %s (%.3g s in all)",
        result.backend,
        result.status.value,
        f" ({result.limit.value})" if result.limit else "",
        result.objective,
        result.bound,
        phases["total_seconds"],
    )
    return PlanResult(result, search.objective, problem, phases, request.spec)


def _total(request: PlanRequest, start: float) -> float:
    """Seconds of one plan, its model's capture included."""
    return time.perf_counter() - start + request.capture_seconds


def _search(
    request: PlanRequest, solver: Any, problem: Problem
) -> tuple[SolveResult, Problem, dict[str, float]]:
    """The backend's search in the time left (less a share kept for the recommendation),
    then `planner.recommend`'s re-rank; the answer, the problem searched (auto may limit its
    memory) and the phases' seconds."""
    search, deadline = request.search, request.deadline
    dnn = problem.is_dnn
    recommending = search.recommend and dnn
    clock = deadline.reserve(RECOMMEND_SHARE * deadline.left()) if recommending else deadline
    log.info(
        "searching with %s (%s objective): %.3g s left of the %.3g s time limit",
        search.backend,
        search.objective,
        clock.left(),
        deadline.limit,
    )
    options = SolveOptions(
        objective=search.objective,
        seed=request.seed,
        extra=search.settings,
        deadline=clock,
        gap_tolerance=request.gap_tolerance,
    )
    t0 = time.perf_counter()
    if solver is None:
        from planner.auto import solve_auto

        result, problem = solve_auto(problem, options, request.cutoff)
    else:
        result = solver.solve(problem, options)
    solve_seconds = time.perf_counter() - t0
    search_seconds = float(result.stats.get("search_seconds", solve_seconds))
    t1 = time.perf_counter()
    if recommending and result.has_solution:
        result = _recommended(problem, result, search.objective, deadline)
    return (
        result,
        problem,
        {
            "search_seconds": search_seconds,
            "rescore_seconds": max(0.0, solve_seconds - search_seconds),
            "recommend_seconds": time.perf_counter() - t1,
        },
    )


def _recommended(
    problem: Problem, result: SolveResult, objective: str, deadline: Deadline
) -> SolveResult:
    """`planner.recommend.recommend`, its decision logged."""
    from planner.recommend import recommend as rerank

    result = rerank(problem, result, objective, deadline=deadline)
    decision = result.stats["recommendation"]
    if decision.get("switched"):
        log.warning("recommending %s: %s", decision["to"], decision["reason"])
    if decision.get("not_simulated_for_time"):
        log.warning(
            "the time limit left no time to simulate the baseline(s) %s: the "
            "recommendation compared the answer with the others only",
            ", ".join(decision["not_simulated_for_time"]),
        )
    return result


def _memory_use(request: PlanRequest, problem: Problem, result: SolveResult) -> dict[str, Any]:
    """The answer's peak bytes, whether it fits (refused here when `check_memory`) and the
    devices it uses."""
    if result.strategy is None or not problem.is_dnn:
        return {}
    from planner.problems.sizes import check_strategy_memory, peak_parts, strategy_memory

    check = check_strategy_memory if request.search.check_memory else strategy_memory
    cm = problem.dnn().cost_model
    fit = check(cm, result.strategy)
    memory: dict[str, Any] = {
        "memory_peak_bytes": float(fit.peak.max()),
        "memory_fits": fit.fits,
        "memory_peak_parts": peak_parts(cm, result.strategy.configs),
    }
    return {**memory, **_device_use(problem, result, request.search.objective)}


# phases key of a plan not searched because its memory limit is below any answer's least
# footprint (`planner.problems.sizes.usage_limit_error`): the "auto" memory options go on to
# their next choice, `plan` raises it
BELOW_FOOTPRINT = "limit_below_least_footprint"
OVERRUN_KEY = "overrun"  # stats key: capture and build used the time limit up (`_overrun_answer`)
RECOMMEND_SHARE = 0.1  # of the time left after the build, kept for the recommendation
QUICK_EXACT_SECONDS = 0.5  # what an exact search past the time limit may take (`_quick_answer`)
MIN_SEARCH_SECONDS = 1.0  # an "auto" attempt's search under the memory limit gets this at least
# ZeRO stages that cost no more time than the stage below them: 1 and 2 replace the
# all-reduce by a reduce-scatter and an all-gather of the same volume (ZeRO, Rajbhandari et
# al. 2020, Sec. 7.2.1; docs/cost_model.md, "t_s with ZeRO"), and they only shard more. So
# every answer at stage s - 1 is an answer at stage s of the same cost.
ZERO_AT_NO_COST = (1, 2)


def _plan_memory_fallback(request: PlanRequest, refusal: MemoryRefusal) -> PlanResult:
    """ZeRO and recomputation left unset, and the model or its plan without either (ZeRO
    stage 0, every activation kept) does not fit the devices' memory (`refusal`, a
    `MemoryRefusal`): the plan with both "auto" in the time left instead of a refusal.
    `stats["memory_fallback"]`: why the plain plan was refused."""
    from planner.problems.sizes import MemoryRefusal

    first = str(refusal)
    if refusal.final:  # no memory option can help: said at once
        raise refusal
    if request.deadline.expired():
        raise MemoryRefusal(
            f"{first} (no time was left to try ZeRO and recomputation: raise the time limit)",
            refusal.fact,
        ) from None
    log.info("%s: planning again with zero='auto' and recompute='auto'", first)
    try:
        out = _plan_plain(request.with_memory(zero=ZERO_AUTO, recompute=RECOMPUTE_AUTO))
    except MemoryRefusal as exc:
        raise MemoryRefusal(
            f"{first}; ZeRO and recomputation chosen automatically (zero='auto', "
            f"recompute='auto') did not make it fit either ({exc.fact})",
            exc.fact,
            exc.final,
        ) from None
    except BuildOutOfTime:  # what is known (it does not fit) wins over the clock
        raise MemoryRefusal(
            f"{first} (the time limit ran out while trying ZeRO and recomputation: raise it "
            "to let them try)",
            refusal.fact,
        ) from None
    return dataclasses.replace(out, phases={**out.phases, "memory_fallback": first})


def _plan_zero_auto(request: PlanRequest) -> PlanResult:
    """zero="auto": plan at ZeRO stage 0, then at the next stage while the answer does not
    fit the devices' memory (or none was found), each stage with an equal share of the time
    left; the first that fits, else the last tried (which `check_memory` refuses as usual).
    With backend "auto" (additive, no memory limit given) the stages are probed first
    (`_plan_zero_probed`). `stats["zero"]`: the stage chosen and, per stage tried before it,
    why it was not enough."""
    search = request.search
    if search.backend == AUTO and search.objective == "additive" and search.memory_limit is None:
        return _plan_zero_probed(request)
    from planner.problems.sizes import format_bytes

    deadline = request.deadline
    unchecked = request.with_search(check_memory=False)
    tried: list[dict[str, Any]] = []
    out: PlanResult | None = None
    for k, stage in enumerate(ZERO_STAGES):
        share = deadline.share(1.0 / (len(ZERO_STAGES) - k))
        out = _plan_plain(unchecked.with_memory(zero=stage).within(share))
        fits = out.stats.get("memory_fits")
        if (out.has_solution and fits is not False) or deadline.expired():
            break
        if k < len(ZERO_STAGES) - 1:
            peak = out.stats.get("memory_peak_bytes")
            why = (
                f"no answer that fits (status {out.status.value})"
                if peak is None
                else f"the answer's peak {format_bytes(peak)} does not fit"
            )
            tried.append({"zero": stage, "why": why})
    assert out is not None
    return _chosen(out, "zero", tried, request.search.check_memory)


def _plan_zero_probed(request: PlanRequest) -> PlanResult:
    """zero="auto" with backend "auto": each stage's optimum without the memory limit first
    (`_zero_probes`), stage after stage until one fits the devices' memory: that one is
    proven the best of its stage. The stages below it are then searched under the memory
    limit (auto's second search), each only while its optimum without the limit, a lower
    bound of any answer of its, could beat the answer in hand (and `request.cutoff`, the
    caller's) by more than the gap tolerance (ZeRO-1 often costs no time in the model: then
    the stage-1 optimum that fits ends it at once, where the search at stage 0 took its
    share of the time limit). They are searched highest first (the most memory to spare);
    once a stage of `ZERO_AT_NO_COST` found an answer that fits, the stages below it are not
    searched (their answers are its answers at the same cost). The fastest answer that fits
    wins, else the last tried (refused as usual)."""
    deadline, tolerance = request.deadline, request.gap_tolerance
    unchecked = request.with_search(check_memory=False)
    tried: list[dict[str, Any]] = []
    best, below, last = _zero_probes(unchecked.with_search(backend="elimination"), tried)
    below.reverse()  # the highest stage first: it has the most memory to spare
    found_at: int | None = None  # the stage whose search found an answer that fits
    for k, (stage, free) in enumerate(below):
        low = free.objective if free.status is Status.OPTIMAL else None
        beat = min(_value(best) if best is not None else math.inf, request.cutoff or math.inf)
        if low is not None and low * (1 + tolerance) >= beat:
            why = f"its optimum without the memory limit, {low:.6g} s, cannot beat {beat:.6g} s"
            tried.append({"zero": stage, "why": why})
            continue
        if found_at is not None and found_at in ZERO_AT_NO_COST:
            # every answer of this stage is one of that stage's at the same cost (it shards
            # more and costs no more time): its search looks among answers that one's did
            why = f"its answers are stage {found_at}'s at the same cost, searched already"
            tried.append({"zero": stage, "why": why})
            continue
        share = deadline.share(1.0 / (len(below) - k))
        if share.left() < MIN_SEARCH_SECONDS:
            tried.append({"zero": stage, "why": "no time left to search it under the memory limit"})
            continue
        # its tables are the probe's (a 7B Llama's on a DGX-1: 1-3 s to build again)
        last = _plan_once(unchecked.with_memory(zero=stage).within(share), free.problem)
        if _fits(last):
            found_at = stage
        if _fits(last) and (best is None or _value(last) <= _value(best)):  # ties: lower stage
            if best is not None:
                tried.append({"zero": _zero_of(best), "why": _slower(best, last)})
            best = last
        else:
            tried.append({"zero": stage, "why": _not_chosen(last, best)})
    out = best if best is not None else last
    tried = [t for t in tried if t["zero"] != _zero_of(out)]
    return _chosen(out, "zero", tried, request.search.check_memory)


def _zero_probes(
    probe: PlanRequest, tried: list[dict[str, Any]]
) -> tuple[PlanResult | None, list[tuple[int, PlanResult]], PlanResult]:
    """Each ZeRO stage's plan with `probe` (elimination, no memory check) in turn until one
    fits: that plan (None if none did), the stages probed before it with their plans, and
    the last plan. A stage refused for memory is said in `tried` and skipped (the next may
    fit); MemoryRefusal when every stage was."""
    from planner.problems.sizes import MemoryRefusal

    below: list[tuple[int, PlanResult]] = []
    last: PlanResult | None = None
    refusal: MemoryRefusal | None = None
    for stage in ZERO_STAGES:
        try:
            last = _plan_plain(probe.with_memory(zero=stage))
        except MemoryRefusal as exc:
            if exc.final:
                raise
            refusal = exc
            tried.append({"zero": stage, "why": str(exc)})
            continue
        if _fits(last):
            return last, below, last
        below.append((stage, last))
        if probe.deadline.expired() or not _time_for_another(probe, last):
            break
    if last is None:  # every stage was refused: the last refusal stands
        assert refusal is not None
        raise refusal
    return None, below, last


def _time_for_another(request: PlanRequest, out: PlanResult) -> bool:
    """Whether the call has time for another attempt like `out`: its tables' build twice over
    (the build, then its search), so that an attempt does not start only to be answered
    without a search past the time limit (a 7B Llama's tables on a DGX-1: 1-7 s)."""
    return request.call.left() > 2 * float(out.phases.get("build_seconds", 0.0))


def _fits(out: PlanResult) -> bool:
    """An answer, and it fits the devices' memory."""
    return out.has_solution and out.stats.get("memory_fits") is not False


def _value(out: PlanResult) -> float:
    """The answer's objective (inf without one)."""
    return out.objective if out.objective is not None else math.inf


def _zero_of(out: PlanResult) -> int:
    return int(out.problem.dnn().cost_model.options.zero)


def _slower(out: PlanResult, than: PlanResult) -> str:
    return f"objective {_value(out):.6g} s against {_value(than):.6g} s"


def _not_chosen(out: PlanResult, best: PlanResult | None) -> str:
    """Why an attempt's answer was not taken: none, it does not fit, or it is slower."""
    from planner.problems.sizes import format_bytes

    if not out.has_solution:
        return f"no answer that fits (status {out.status.value})"
    if not _fits(out):
        return f"the answer's peak {format_bytes(out.stats.get('memory_peak_bytes') or 0.0)} does not fit"
    assert best is not None
    return _slower(out, best)


def _plan_recompute_auto(request: PlanRequest) -> PlanResult:
    """recompute="auto": the fastest answer that fits the devices' memory, without
    recomputation, with the attention ops' ("selective"), with every block's ("full") or
    with the first k blocks' (`zero`, "auto" included, applies to each attempt). In turn,
    each with a share of the time left:

    1. "none", with elimination alone when the backend is "auto" (a quick probe: when its
       proven optimum fits it is the answer, since recomputing only adds time to a strategy);
       skipped when the model cannot fit at all without recomputing (`check_memory_fits`);
    2. "selective", probed the same way, when it may fit: "none" found no answer, or its
       answer fits once its attention ops recompute (`_fits_with`; selective frees little,
       so an answer that misses by more is not planned again for it); its proven optimum,
       when it fits, is the answer (every op "selective" recomputes, "full" does too);
    3. "full", with the backend asked for;
    4. when "full"'s strategy would fit recomputing only its first k blocks (`_fewer_blocks`),
       recompute=k: the choice per block, time for memory;
    5. when step 1 was a probe, "none" with the backend asked for (the portfolio under the
       memory limit) in the time left, when nothing fits yet, or else only where its bound
       (elimination's optimum without the limit, per ZeRO stage) could beat the answer in
       hand by more than the gap tolerance (`PlanRequest.cutoff`).

    The answer of lower objective (seconds per iteration under its own cost model) among
    those that fit wins, else the last. `stats["recompute"]`: the mode chosen and, per other
    mode tried, its objective or why it lost."""
    from planner.problems.sizes import MemoryRefusal, format_bytes

    deadline = request.deadline
    unchecked = request.with_search(check_memory=False)
    tried: list[dict[str, Any]] = []
    refusals: list[MemoryRefusal] = []
    answers: list[tuple[str | int, PlanResult]] = []
    probe = request.search.backend == AUTO and request.search.objective == "additive"

    def fits(o: PlanResult | None) -> bool:
        return o is not None and o.has_solution and o.stats.get("memory_fits") is not False

    def proven(o: PlanResult | None) -> bool:
        return fits(o) and o.status is Status.OPTIMAL and o.backend == "elimination"  # type: ignore[union-attr]

    def attempt(
        mode: str | int, share: float, backend: str | None = None, cutoff: float | None = None
    ) -> PlanResult | None:
        attempt_request = unchecked.with_memory(recompute=mode).within(deadline.share(share))
        if backend is not None:
            attempt_request = attempt_request.with_search(backend=backend)
        if cutoff is not None:
            attempt_request = dataclasses.replace(attempt_request, cutoff=cutoff)
        try:
            out = _plan_plain(attempt_request)
        except MemoryRefusal as exc:  # this mode cannot fit at all
            if exc.final:
                raise  # nor can any other
            tried.append({"recompute": mode, "why": str(exc)})
            refusals.append(exc)
            return None
        except BuildOutOfTime:
            if not refusals:
                raise
            last = refusals[-1]  # what is known (it does not fit) wins over the clock
            raise MemoryRefusal(
                f"{last} (the time limit ran out before recompute={mode!r} was tried)", last.fact
            ) from None
        answers.append((mode, out))
        return out

    elimination = "elimination" if probe else None
    first = attempt("none", 0.5, elimination)
    done = proven(first)
    if not done and not deadline.expired():
        if first is None or not first.has_solution or _fits_with(first, "selective"):
            done = proven(attempt("selective", 0.4, elimination))
        else:
            tried.append({"recompute": "selective", "why": _selective_short(first)})
    if not done and not deadline.expired():
        full = attempt("full", 0.6)
        fewer = _fewer_blocks(full) if full is not None and fits(full) else None
        room = not answers or _time_for_another(request, answers[-1][1])
        if fewer is not None and not deadline.expired() and room:
            attempt(fewer, 1.0)
        found = [_value(o) for _, o in answers if fits(o)]
        room = not answers or _time_for_another(request, answers[-1][1])
        if probe and not deadline.expired() and (not found or (first is not None and room)):
            # none fits yet, or the probe's optimum did not fit: "none" searched under the
            # memory limit where that could beat the answer in hand (`cutoff`)
            attempt("none", 1.0, cutoff=min(found, default=None))
    if not answers:  # every mode was refused: the last refusal stands
        raise refusals[-1]
    fitting = sorted((o.objective, k) for k, (_, o) in enumerate(answers) if fits(o))
    best = fitting[0][1] if fitting else len(answers) - 1
    for k, (option, o) in enumerate(answers):
        if k == best:
            continue
        peak = o.stats.get("memory_peak_bytes")
        if not o.has_solution:
            why = f"no answer (status {o.status.value})"
        elif o.stats.get("memory_fits") is False:
            why = f"the answer's peak {format_bytes(peak or 0.0)} does not fit"
            beaten = [t["why"] for t in o.stats.get("zero", {}).get("tried", [])
                      if "cannot beat" in t["why"]]  # fmt: skip
            if beaten:  # not searched under the memory limit: it could not win
                why = f"not searched under the memory limit: {beaten[0]}"
        else:
            why = f"objective {o.objective:.6g} s against {answers[best][1].objective:.6g} s"
        tried.append({"recompute": option, "why": why})
    return _chosen(answers[best][1], "recompute", tried, request.search.check_memory)


def _fits_with(out: PlanResult, mode: str | int) -> bool:
    """Whether `out`'s strategy fits the devices' memory under recompute=`mode`."""
    from planner.costs.costmodel import CostModel

    if out.strategy is None or not out.problem.is_dnn:
        return False
    cm = out.problem.dnn().cost_model
    other = CostModel(cm.graph, cm.devices, dataclasses.replace(cm.options, recompute=mode))  # type: ignore[arg-type]
    return bool((other.strategy_memory(out.strategy.configs) <= other.usable_memory()).all())


def _selective_short(out: PlanResult) -> str:
    """Why "selective" was not planned after "none" gave `out`, an answer that does not fit."""
    from planner.problems.sizes import format_bytes

    peak = out.stats.get("memory_peak_bytes") or 0.0
    return (
        f"not planned: the 'none' answer (peak {format_bytes(peak)}) does not fit with its "
        "attention ops recomputed either (selective frees only what FlashAttention keeps "
        "beyond q, k, v and its output)"
    )


def _chosen(out: PlanResult, option: str, tried: list[dict[str, Any]], check: bool) -> PlanResult:
    """The answer an "auto" memory option chose, refused when `check` and it does not fit,
    with `stats[option]`: the value chosen (its cost model's) and the others tried."""
    from planner.problems.sizes import check_strategy_memory

    cm = out.problem.dnn().cost_model
    if check and out.strategy is not None:
        check_strategy_memory(cm, out.strategy)  # never a plan that does not fit
    chose = getattr(cm.options, option)
    log.info("%s='auto' chose %s", option, chose)
    return dataclasses.replace(out, phases={**out.phases, option: {"chose": chose, "tried": tried}})


def _fewer_blocks(out: PlanResult) -> int | None:
    """The fewest blocks whose recomputation lets `out`'s strategy (found recomputing every
    block) fit the devices' memory, when that is fewer than all (recomputing the first k
    blocks in graph order, `planner.costs.recompute`); else None."""
    from planner.costs.costmodel import CostModel
    from planner.costs.recompute import blocks_of

    if out.strategy is None or not out.problem.is_dnn:
        return None
    cm = out.problem.dnn().cost_model
    blocks = len(blocks_of(cm.graph))
    for k in range(blocks):
        options = dataclasses.replace(cm.options, recompute=k)
        fewer = CostModel(cm.graph, cm.devices, options, measured=cm.measured)
        if (fewer.strategy_memory(out.strategy.configs) <= fewer.usable_memory()).all():
            return k
    return None


def _device_use(problem: Problem, result: SolveResult, objective: str) -> dict[str, Any]:
    """The devices the answer uses of the problem's; when some are idle, why (also logged
    as a warning: planner/problems/idle.py)."""
    from planner.problems.idle import device_use

    assert result.choices is not None
    proven = result.status is Status.OPTIMAL and result.limit is None
    use = device_use(problem, result.choices, objective, proven)
    out: dict[str, Any] = {"devices_used": use.used, "devices_total": use.total}
    if use.reason is not None:
        log.warning("%s", use.reason)
        out["idle_devices"] = use.reason
    return out


def _problem(request: PlanRequest) -> tuple[Problem, dict[str, float]]:
    """The problem to search and the phases' seconds: `problem_of` within `request.hard`;
    a build that cannot finish by then is one error."""
    from planner.graph.opgraph import OpGraph

    started = time.perf_counter()
    search = request.search
    try:
        problem, _, phases = problem_of(
            request.model,
            request.devices,
            deadline=request.hard,
            **request.source(),
            options=search.cost_options(request.memory),
            max_configs=search.max_configs,
            build_options=search.build_options,
        )
    except OutOfTime:
        captured = isinstance(request.model, OpGraph)  # captured already (`capture`)
        raise stopped(
            "building the cost tables"
            if captured
            else "capturing the model and building its cost tables",
            request.hard,
            started,
            "raise the time limit, or make the problem smaller (max_configs, space='mesh', "
            "fewer devices)",
        ) from None
    if request.capture_seconds > 0:  # captured (or read) once, before this build
        phases = {**phases, "capture_seconds": request.capture_seconds}
    return problem, phases


def _interrupted(
    request: PlanRequest, problem: Problem, phases: dict[str, float], start: float
) -> PlanResult:
    """A Ctrl-C before the search began: no answer, limit INTERRUPTED."""
    message = "interrupted before the search began"
    log.info(message)
    result = SolveResult(request.search.backend, Status.NO_SOLUTION, limit=Limit.INTERRUPTED)
    phases = {**phases, "search_seconds": 0.0, "total_seconds": _total(request, start)}
    return PlanResult(result, request.search.objective, problem, phases, request.spec, message)


def _overrun_answer(
    request: PlanRequest, problem: Problem, phases: dict[str, float], start: float
) -> PlanResult:
    """Capture and build used the time limit up: instead of no answer, the cheapest valid
    one that takes no real search time (`_quick_answer`: elimination's optimum when it is
    proven in `QUICK_EXACT_SECONDS`, else the best expert baseline that fits), FEASIBLE with
    limit TIME unless proven, and `stats["overrun"]`: the overrun, and what time limit would
    have left the search time. No answer (NO_SOLUTION, limit TIME) when there is none."""
    search = request.search
    used = _total(request, start)
    what = "capturing the model and building its cost tables" if request.spec else "building"
    if not problem.is_dnn:
        what = "reading the problem"
    head, advice = overrun_words(
        request.call, used, what, attempt=request.deadline is not request.call
    )
    t0 = time.perf_counter()
    result = _quick_answer(problem, search.objective)
    if result is None:
        message = f"{head}: no answer without a search. Raise the time limit ({advice})"
        result = SolveResult(search.backend, Status.NO_SOLUTION, limit=Limit.TIME)
    else:
        message = f"{head}: answered with {result.backend} without a search; {advice}"
        result = dataclasses.replace(result, stats={**result.stats, OVERRUN_KEY: message})
    log.info("%s", message)
    done = {
        **phases,
        **_memory_use(request, problem, result),
        "search_seconds": time.perf_counter() - t0,
        "total_seconds": _total(request, start),
    }
    if result.has_solution:
        done[OVERRUN_KEY] = message
    return PlanResult(result, search.objective, problem, done, request.spec, message)


def _quick_answer(problem: Problem, objective: str) -> SolveResult | None:
    """The best answer found without a search: elimination's proven optimum when it proves
    it in `QUICK_EXACT_SECONDS` (additive objective, no memory limit, fits the devices),
    and the expert baselines that fit the memory (`planner.recommend.baseline_choices`),
    each scored under `objective`; None when there is none."""
    from planner.problems.evaluate import fits_devices
    from planner.recommend import baseline_choices
    from planner.registry import get_backend
    from planner.result import evaluate_objective

    found: list[tuple[float, int, SolveResult]] = []
    exact = get_backend("elimination")
    options = SolveOptions(deadline=Deadline.after(QUICK_EXACT_SECONDS))
    if objective == "additive" and exact.can_run(problem, options) is None:
        proven = exact.solve(problem, options)
        best = proven.choices if proven.status is Status.OPTIMAL else None
        if best is not None and (not problem.is_dnn or fits_devices(problem, best)):
            found.append((float(proven.objective or 0.0), 0, proven))
    for name, choices in baseline_choices(problem).items():
        value = evaluate_objective(problem, choices, objective)
        strategy = problem.strategy(choices)
        answer = SolveResult(
            f"baseline {name}", Status.FEASIBLE, choices, value, None, Limit.TIME, strategy
        )
        found.append((value, len(found) + 1, answer))
    if not found:
        return None
    return min(found, key=lambda f: (f[0], f[1]))[2]
