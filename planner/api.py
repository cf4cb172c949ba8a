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
total). The library never imports a backend at module level (backends import planner);
`plan` imports the one it uses.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.costs.recompute import RECOMPUTE_AUTO, check_graph_options
from planner.deadline import (
    BuildOutOfTime,
    Deadline,
    OutOfTime,
    catch_interrupt,
    stop_requested,
    stopped,
)
from planner.errors import BackendError, LayerwiseError, given
from planner.files import check_output_path, finite_or_none, strict_json, write_text_atomic
from planner.graph.models import ModelSpec
from planner.result import Limit, SolveOptions, SolveResult, Status
from planner.sources import problem_of

if TYPE_CHECKING:
    from planner.costs.costmodel import CostModel
    from planner.graph.opgraph import OpGraph
    from planner.hardware.devices import DeviceGraph
    from planner.pipelined import PipelinePlan
    from planner.problems.problem import Problem
    from planner.problems.sizes import MemoryRefusal
    from planner.problems.strategy import Strategy

__all__ = ["DEFAULT_TIME_LIMIT", "Evaluation", "PlanResult", "evaluate_strategy", "plan"]

# Seconds for a whole call. Exact backends return as soon as they have proven their answer
# (inception_v3 on 16 GPUs: a 2-15 s build, depending on the machine's load, and 5 ms of
# elimination), so a generous default costs them nothing; mcmc and the solvers use it all.
DEFAULT_TIME_LIMIT = 60.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Evaluation:
    """A strategy re-scored by planner's evaluators: OptCNN's Eq. 1 (additive, with its
    compute, sync and transfer parts) and FlexFlow's simulated iteration time (makespan), in
    seconds; the largest per-device memory of the strategy in bytes."""

    additive: float
    makespan: float
    compute: float
    sync: float
    transfer: float
    memory_peak_bytes: float
    timeline: Any = field(default=None, repr=False, compare=False)  # the simulated Timeline

    def to_json(self) -> dict[str, float]:
        """The numbers as a JSON object (what `planner evaluate --json` prints)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[:6]}


def evaluate_strategy(strategy: Strategy, cost_model: CostModel | None = None) -> Evaluation:
    """Re-score `strategy` under both objectives (analytic costs unless `cost_model` given)."""
    from planner.costs.costmodel import CostModel
    from planner.problems.evaluate import score_strategy
    from planner.sim.simulator import simulate

    cm = cost_model or CostModel(strategy.graph, strategy.devices)
    b = score_strategy(cm, strategy)
    timeline = simulate(cm, strategy)
    return Evaluation(
        b.total, timeline.makespan, b.compute, b.sync, b.transfer, float(b.memory.max()), timeline
    )


@dataclass(frozen=True)
class PlanResult:
    """What `plan` found: the backend's `result` (a `SolveResult`: status OPTIMAL, FEASIBLE,
    INFEASIBLE or NO_SOLUTION, limit TIME, ITERATIONS, INTERRUPTED or None, the objective
    re-scored by planner's evaluators, the proven bound where the backend has one, the
    choices and the strategy: None for a cost-table problem), and what planning adds: the
    objective it was searched under, the Problem that was searched, the seconds of every
    phase (`phases`: capture_seconds, build_seconds, search_seconds, rescore_seconds,
    recommend_seconds, total_seconds), the model spec to record in the plan file, and
    `message`: why there is no answer when `plan` itself knows (e.g. the build used up the
    time limit), or what a phase left out for lack of time. `stats` is the backend's
    statistics with the phases."""

    result: SolveResult
    objective_kind: str
    problem: Problem
    phases: Mapping[str, Any] = field(default_factory=dict)
    model: ModelSpec | None = None
    message: str | None = None

    @property
    def status(self) -> Status:
        """The backend's status (OPTIMAL, FEASIBLE, INFEASIBLE, NO_SOLUTION)."""
        return self.result.status

    @property
    def limit(self) -> Limit | None:
        """Why the search stopped early (TIME, ITERATIONS, INTERRUPTED), or None."""
        return self.result.limit

    @property
    def objective(self) -> float | None:
        """The answer's value re-scored by planner's evaluators (None without one)."""
        return self.result.objective

    @property
    def bound(self) -> float | None:
        """The proven lower bound, where the backend has one."""
        return self.result.bound

    @property
    def backend(self) -> str:
        """The backend's name."""
        return self.result.backend

    @property
    def strategy(self) -> Strategy | None:
        """The strategy (None for a cost-table problem or without an answer)."""
        return self.result.strategy

    @property
    def choices(self) -> tuple[int, ...] | None:
        """One config index per node (None without an answer)."""
        return self.result.choices

    @property
    def stats(self) -> dict[str, Any]:
        """The backend's statistics with the phase seconds of the call."""
        return {**self.result.stats, **self.phases}

    @property
    def has_solution(self) -> bool:
        """Whether an answer was found (`choices` is not None)."""
        return self.result.has_solution

    @property
    def gap(self) -> float | None:
        """objective / bound - 1 where both are known (0 when proven optimal)."""
        return self.result.gap

    def summary(self) -> dict[str, Any]:
        """Status, objective, bound, gap and phase seconds as strict-JSON values (inf and
        NaN are None): the head of a plan file and what `plan --json` prints."""
        s = self.stats
        out: dict[str, Any] = {
            "status": self.status.value,
            "limit": self.limit.value if self.limit else None,
            "objective": self.objective,
            "bound": self.bound,
            "gap": self.gap,
            "backend": self.backend,
            "objective_kind": self.objective_kind,
            **{k: s.get(k) for k in PHASES if k in s or k in ALWAYS},
            **{k: s[k] for k in (*MEMORY_KEYS, *DEVICE_KEYS) if k in s},
        }
        if self.problem.is_dnn:  # what was searched (docs/space.md), as in the file
            out["space"] = self.problem.dnn().space.describe()
        if self.message:
            out["message"] = self.message
        out = {k: finite_or_none(v) for k, v in out.items()}
        # backend choice, re-rank rule, the memory options "auto" chose
        for key in (
            "auto",
            "recommendation",
            "searched",
            "zero",
            "recompute",
            "memory_fallback",
            "pipeline_refused",
        ):
            if key in s:
                out[key] = _strict(s[key])
        return out

    def to_json(self) -> dict[str, Any]:
        """The plan file: a strategy file (docs/strategy.md) with the summary and the cost
        options, or for a cost-table problem the summary and the choices. Strict JSON."""
        head = self.summary()
        if self.strategy is None:
            data = {**head, "choices": list(self.choices) if self.choices else None}
        else:
            cost: dict[str, Any] = {}
            if self.problem.is_dnn:
                cm = self.problem.dnn().cost_model
                cost = {**dataclasses.asdict(cm.options), "source": cm.source}
            model = self.model.to_json() if self.model else None
            data = self.strategy.to_json(model=model, extra={**head, "cost": cost})
        return dict(_strict(data))

    def save(self, path: str | Path) -> None:
        """Write `to_json()` to `path` atomically (a temporary file, then a rename)."""
        path = check_output_path(path, "plan")
        write_text_atomic(path, strict_json(self.to_json(), indent=1))

    def describe(self) -> list[tuple[str, str, str]]:
        """(op name, kind, config) rows of the strategy (empty without one)."""
        return self.strategy.describe() if self.strategy is not None else []

    def evaluate(self) -> Evaluation:
        """The strategy re-scored under both objectives with the cost model it was planned
        with (LayerwiseError without a strategy)."""
        if self.strategy is None:
            raise LayerwiseError(
                f"nothing to evaluate: the plan has no strategy (status {self.status.value})"
            )
        cm = self.problem.dnn().cost_model if self.problem.is_dnn else None
        return evaluate_strategy(self.strategy, cm)


PHASES = (
    "capture_seconds",
    "build_seconds",
    "encode_seconds",
    "search_seconds",
    "rescore_seconds",
    "recommend_seconds",
    "total_seconds",
)
ALWAYS = ("build_seconds", "search_seconds", "total_seconds")
MEMORY_KEYS = ("memory_peak_bytes", "memory_fits")
DEVICE_KEYS = ("devices_used", "devices_total", "idle_devices")  # planner/problems/idle.py


def _strict(value: Any) -> Any:
    import json

    return json.loads(strict_json(value))


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
    memory_limit: float | str | None = None,
    cost: str = "analytic",
    sync: str | None = None,
    optimizer: str | None = None,
    master_weights: bool | None = None,
    zero: int | str | None = None,
    headroom: float | None = None,
    recompute: str | int | None = None,
    max_configs: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
    recommend: bool = True,
    check_memory: bool = True,
    deadline: Deadline | None = None,
    pipeline: bool | str | None = None,
    **build_options: Any,
) -> PlanResult | PipelinePlan:
    """Find a parallelization strategy for `model` on `devices` with `backend`.

    model: a zoo name ("lenet5"), an `nn.Module` with `example_inputs`, a user factory
    "package.module:callable" with `example_inputs` (recorded in the plan file so that
    `runtime.run` can rebuild the module in other processes), an OpGraph, a Problem, or the
    path of a graph JSON or cost-table (IOPDDL) JSON file. `model_kwargs` size a zoo model
    (e.g. {"batch": 8}) or are passed to the factory. devices: a preset name, a device JSON
    path or a DeviceGraph (not for cost-table problems). backend: "auto" (the default:
    elimination, exact, when its answer fits the memory; portfolio under the memory limit
    when memory is tight; mcmc for the makespan objective; `stats["auto"]` says which and
    why: planner/auto.py) or a registered backend's name. objective: "additive" (OptCNN
    Eq. 1) or "makespan" (FlexFlow's simulated iteration time). time_limit: seconds for the
    whole call, capture and build included. memory_limit: None, "device" or bytes per
    device. cost: "analytic" or "measured" (profiled: `python -m planner profile`); sync:
    "ring" or "ps". Training memory (docs/cost_model.md, "Memory"): optimizer "none" (the
    default: weights and gradients only), "sgd" (a momentum buffer) or "adam" (two fp32
    moments); master_weights: an fp32 copy of 16-bit weights; zero: the ZeRO stage 0-3
    (optimizer state, then gradients, then weights sharded over the data-parallel replicas)
    or "auto" (stage 0, and the next stage while the answer does not fit the devices'
    memory; `stats["zero"]` says which stage and why); headroom: the fraction of each
    device's memory kept free (default 0); recompute: "none" (the default), "full" (the ops
    inside the model's numbered blocks, e.g. a GPT's `transformer.h.3`, keep no outputs
    and run their forward again in the backward: `planner.costs.recompute`), a number k
    (the first k blocks do) or "auto" (the fastest answer that fits of none, full and, after
    full, the fewest blocks its answer needs; `stats["recompute"]` says which and why).
    With zero and recompute both left unset and the backend "auto", a model or plan that
    does not fit without them is planned again with both "auto" instead of being refused
    (`stats["memory_fallback"]` says why); a plan that fits without them is unchanged.
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
    `time_limit` from now ends the call. Further keyword arguments go to `build_problem`
    unchanged (space, table_budget, max_split_dims: docs/space.md).

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
    clock = Deadline.after(time_limit) if _positive(time_limit) else Deadline.never()
    deadline = clock if deadline is None else deadline.within(clock.left())
    if pipeline not in (None, True, False, "auto"):
        raise LayerwiseError(f"pipeline must be True, False or 'auto', got {given(pipeline)}")
    _check_call(
        objective,
        time_limit,
        seed,
        build_options,
        backend=backend,
        max_configs=max_configs,
        memory_limit=memory_limit,
        backend_options=backend_options,
    )  # before either search: a bad value is one line whichever runs
    if pipeline is not True:  # the per-op search's backend and settings, before any capture
        _checked_settings(backend, objective, backend_options)
    _check_memory_options(
        sync,
        {
            "optimizer": optimizer,
            "master_weights": master_weights,
            "zero": zero,
            "headroom": headroom,
            "recompute": recompute,
        },
    )
    from planner.graph.opgraph import OpGraph

    if isinstance(model, OpGraph):  # a model is checked once captured (choose_pipeline)
        check_graph_options(model, recompute, master_weights)
    call = {
        "model": model,
        "devices": devices,
        "backend": backend,
        "objective": objective,
        "time_limit": time_limit,
        "seed": seed,
        "example_inputs": example_inputs,
        "model_kwargs": model_kwargs,
        "name": name,
        "coarsen": coarsen,
        "memory_limit": memory_limit,
        "cost": cost,
        "sync": sync,
        "optimizer": optimizer,
        "master_weights": master_weights,
        "zero": zero,
        "headroom": headroom,
        "recompute": recompute,
        "max_configs": max_configs,
        "backend_options": backend_options,
        "recommend": recommend,
        "check_memory": check_memory,
        "deadline": deadline,
        **build_options,
    }
    from planner.pipelined import choose_pipeline

    with catch_interrupt():  # one Ctrl-C for the whole call: no phase clears it for the next
        if pipeline is False:
            out = _plan_plain(**call)
        else:
            out = choose_pipeline(_plan_plain, pipeline, **call)
    if isinstance(out, PlanResult) and BELOW_FOOTPRINT in out.phases:
        from planner.problems.sizes import SizeError

        raise SizeError(out.phases[BELOW_FOOTPRINT])  # a limit no answer meets: one line
    return out


def _plan_plain(
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
    memory_limit: float | str | None = None,
    cost: str = "analytic",
    sync: str | None = None,
    optimizer: str | None = None,
    master_weights: bool | None = None,
    zero: int | str | None = None,
    headroom: float | None = None,
    recompute: str | int | None = None,
    max_configs: int | None = None,
    backend_options: Mapping[str, Any] | None = None,
    recommend: bool = True,
    check_memory: bool = True,
    deadline: Deadline | None = None,
    **build_options: Any,
) -> PlanResult:
    """`plan` without pipelines (the per-op search)."""
    clock = Deadline.after(time_limit) if _positive(time_limit) else Deadline.never()
    deadline = clock if deadline is None else deadline.within(clock.left())
    start = time.perf_counter()
    _check_call(
        objective,
        time_limit,
        seed,
        build_options,
        backend=backend,
        max_configs=max_configs,
        memory_limit=memory_limit,
        backend_options=backend_options,
    )
    memory_options: dict[str, Any] = {
        "optimizer": optimizer,
        "master_weights": master_weights,
        "zero": zero,
        "headroom": headroom,
        "recompute": recompute,
    }
    _check_memory_options(sync, memory_options)
    captured = _captured(
        model,
        devices,
        deadline,
        example_inputs=example_inputs,
        model_kwargs=model_kwargs,
        name=name,
        coarsen=coarsen,
    )
    if captured is not None:  # once, for every attempt below
        graph, spec, seconds = captured
        check_graph_options(graph, recompute, master_weights)
        out = _plan_plain(
            graph,
            devices,
            backend,
            objective,
            time_limit,
            seed,
            name=name,
            coarsen=coarsen,
            memory_limit=memory_limit,
            cost=cost,
            sync=sync,
            max_configs=max_configs,
            backend_options=backend_options,
            recommend=recommend,
            check_memory=check_memory,
            deadline=deadline,
            **memory_options,
            **build_options,
        )
        total = out.phases.get("total_seconds", 0.0) + seconds
        phases = {**out.phases, "capture_seconds": seconds, "total_seconds": total}
        return dataclasses.replace(out, model=spec, phases=phases)
    call = {
        "model": model,
        "devices": devices,
        "backend": backend,
        "objective": objective,
        "time_limit": time_limit,
        "seed": seed,
        "example_inputs": example_inputs,
        "model_kwargs": model_kwargs,
        "name": name,
        "coarsen": coarsen,
        "memory_limit": memory_limit,
        "cost": cost,
        "sync": sync,
        "max_configs": max_configs,
        "backend_options": backend_options,
        "recommend": recommend,
        **memory_options,
        **build_options,
    }
    if recompute == RECOMPUTE_AUTO:  # plan again per choice
        del call["recompute"]
        return _plan_recompute_auto(deadline, check_memory, **call)
    if zero == ZERO_AUTO:
        del call["zero"]
        return _plan_zero_auto(deadline, check_memory, **call)
    from planner.problems.sizes import MemoryRefusal, usage_limit_error

    try:
        solver, settings = _checked_settings(backend, objective, backend_options)
        with catch_interrupt():
            problem, spec, phases = _problem(
                model,
                devices,
                deadline,
                example_inputs=example_inputs,
                model_kwargs=model_kwargs,
                name=name,
                coarsen=coarsen,
                options={
                    "memory_limit": memory_limit,
                    "cost": cost,
                    "sync": sync,
                    **memory_options,
                },
                max_configs=max_configs,
                build_options=build_options,
            )
            if deadline.expired():
                return _out_of_time(problem, spec, backend, objective, deadline, start, phases)
            beyond = usage_limit_error(problem)
            if beyond is not None:  # no answer can meet the limit: not searched (plan raises)
                log.info("%s", beyond)
                result = SolveResult(backend, Status.INFEASIBLE)
                done = {**phases, "search_seconds": 0.0, BELOW_FOOTPRINT: beyond}
                done["total_seconds"] = time.perf_counter() - start
                return PlanResult(result, objective, problem, done, spec, beyond)
            dnn = problem.is_dnn
            search = (
                deadline.reserve(RECOMMEND_SHARE * deadline.left())
                if recommend and dnn
                else deadline
            )
            log.info(
                "searching with %s (%s objective): %.3g s left of the %.3g s time limit",
                backend,
                objective,
                search.left(),
                time_limit,
            )
            options = SolveOptions(
                objective=objective,
                time_limit=max(search.left(), 1e-3),
                seed=seed,
                extra=settings,
                deadline=search,
            )
            t0 = time.perf_counter()
            if solver is None:
                from planner.auto import solve_auto

                result, problem = solve_auto(problem, options)
            else:
                result = solver.solve(problem, options)
            solve_seconds = time.perf_counter() - t0
            search_seconds = float(result.stats.get("search_seconds", solve_seconds))
            t1 = time.perf_counter()
            if recommend and dnn and result.has_solution:
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
            recommend_seconds = time.perf_counter() - t1
        memory: dict[str, Any] = {}
        if result.strategy is not None and problem.is_dnn:
            from planner.problems.sizes import check_strategy_memory, strategy_memory

            fit = (check_strategy_memory if check_memory else strategy_memory)(
                problem.dnn().cost_model, result.strategy
            )
            memory = {"memory_peak_bytes": float(fit.peak.max()), "memory_fits": fit.fits}
            memory.update(_device_use(problem, result, objective))
        phases = {
            **phases,
            **memory,
            "search_seconds": search_seconds,
            "rescore_seconds": max(0.0, solve_seconds - search_seconds),
            "recommend_seconds": recommend_seconds,
            "total_seconds": time.perf_counter() - start,
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
        return PlanResult(result, objective, problem, phases, spec)
    except MemoryRefusal as exc:  # ZeRO and recomputation unset: both "auto" instead
        if zero is not None or recompute is not None or not check_memory or backend != "auto":
            raise
        return _plan_memory_fallback(deadline, call, exc)


# phases key of a plan not searched because its memory limit is below any answer's least
# footprint (`planner.problems.sizes.usage_limit_error`): the "auto" memory options go on to
# their next choice, `plan` raises it
BELOW_FOOTPRINT = "limit_below_least_footprint"
RECOMMEND_SHARE = 0.1  # of the time left after the build, kept for the recommendation
ZERO_AUTO = "auto"
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "full")  # in the order "auto" tries them


def _check_memory_options(sync: str | None, options: Mapping[str, Any]) -> None:
    """The training-memory options, refused before any work (CostOptions' one-line errors)."""
    from planner.costs.costmodel import CostOptions
    from planner.costs.recompute import recompute_error

    values = {k: v for k, v in options.items() if v is not None}
    if values.get("zero") == ZERO_AUTO:
        values["zero"] = ZERO_STAGES[-1]
    if values.get("recompute") == RECOMPUTE_AUTO:
        values["recompute"] = RECOMPUTE_MODES[-1]
    elif "recompute" in values and recompute_error(values["recompute"]) is not None:
        raise LayerwiseError(
            "recompute must be 'none', 'full', 'auto' or a number of blocks >= 0, got "
            f"{given(options['recompute'])}"
        )
    if "zero" in values and (not isinstance(values["zero"], int) or values["zero"] is True):
        raise LayerwiseError(f"zero must be 0, 1, 2, 3 or 'auto', got {given(options['zero'])}")
    if values.get("master_weights") is True and values.get("optimizer", "none") == "none":
        raise LayerwiseError(
            "master_weights are the optimizer's fp32 copies of 16-bit weights, and optimizer "
            "is 'none' (weights and gradients only): give an optimizer (optimizer='sgd' or "
            "'adam', --optimizer) or leave master_weights unset"
        )
    if sync is not None:
        values["sync"] = sync
    CostOptions(**values)


def _plan_memory_fallback(
    deadline: Deadline, call: dict[str, Any], refusal: MemoryRefusal
) -> PlanResult:
    """ZeRO and recomputation left unset, and the model or its plan without either (ZeRO
    stage 0, every activation kept) does not fit the devices' memory (`refusal`, a
    `MemoryRefusal`): the plan with both "auto" in the time left instead of a refusal.
    `stats["memory_fallback"]`: why the plain plan was refused."""
    from planner.problems.sizes import MemoryRefusal

    first = str(refusal)
    if refusal.final:  # no memory option can help: said at once
        raise refusal
    if deadline.expired():
        raise MemoryRefusal(
            f"{first} (no time was left to try ZeRO and recomputation: raise the time limit)",
            refusal.fact,
        ) from None
    log.info("%s: planning again with zero='auto' and recompute='auto'", first)
    try:
        out = _plan_plain(
            **{**call, "zero": ZERO_AUTO, "recompute": RECOMPUTE_AUTO}, deadline=deadline
        )
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


def _plan_zero_auto(deadline: Deadline, check_memory: bool, **call: Any) -> PlanResult:
    """zero="auto": plan at ZeRO stage 0, then at the next stage while the answer does not
    fit the devices' memory (or none was found), each stage with an equal share of the time
    left; the first that fits, else the last tried (which `check_memory` refuses as usual).
    `stats["zero"]`: the stage chosen and, per stage tried before it, why it was not enough."""
    from planner.problems.sizes import format_bytes

    tried: list[dict[str, Any]] = []
    out: PlanResult | None = None
    for k, stage in enumerate(ZERO_STAGES):
        share = deadline.share(1.0 / (len(ZERO_STAGES) - k))
        out = _plan_plain(**call, zero=stage, check_memory=False, deadline=share)
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
    return _chosen(out, "zero", tried, check_memory)


def _plan_recompute_auto(deadline: Deadline, check_memory: bool, **call: Any) -> PlanResult:
    """recompute="auto": the fastest answer that fits the devices' memory, without
    recomputation, with every block's ("full") or with the first k blocks' (`zero`, "auto"
    included, applies to each attempt). In turn, each with a share of the time left:

    1. "none", with elimination alone when the backend is "auto" (a quick probe: when its
       proven optimum fits it is the answer, since recomputing only adds time to a strategy);
       skipped when the model cannot fit at all without recomputing (`check_memory_fits`);
    2. "full", with the backend asked for;
    3. when "full"'s strategy would fit recomputing only its first k blocks (`_fewer_blocks`),
       recompute=k: the choice per block, time for memory;
    4. when nothing fits yet and step 1 was a probe, "none" with the backend asked for (the
       portfolio under the memory limit) in the time left.

    The answer of lower objective (seconds per iteration under its own cost model) among
    those that fit wins, else the last. `stats["recompute"]`: the mode chosen and, per other
    mode tried, its objective or why it lost."""
    from planner.problems.sizes import MemoryRefusal, format_bytes

    tried: list[dict[str, Any]] = []
    refusals: list[MemoryRefusal] = []
    answers: list[tuple[str | int, PlanResult]] = []
    backend = call.get("backend", "auto")
    probe = backend == "auto" and call.get("objective", "additive") == "additive"

    def fits(o: PlanResult) -> bool:
        return o.has_solution and o.stats.get("memory_fits") is not False

    def attempt(mode: str | int, share: float, **over: Any) -> PlanResult | None:
        try:
            out = _plan_plain(**{**call, **over}, recompute=mode, check_memory=False,
                       deadline=deadline.share(share))  # fmt: skip
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

    first = attempt("none", 0.5, **({"backend": "elimination"} if probe else {}))
    proven = (first is not None and fits(first) and first.status is Status.OPTIMAL
              and first.backend == "elimination")  # fmt: skip
    if not proven and not deadline.expired():
        full = attempt("full", 0.6)
        fewer = _fewer_blocks(full) if full is not None and fits(full) else None
        if fewer is not None and not deadline.expired():
            attempt(fewer, 1.0)
        if probe and not any(fits(o) for _, o in answers) and not deadline.expired():
            attempt("none", 1.0)
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
        else:
            why = f"objective {o.objective:.6g} s against {answers[best][1].objective:.6g} s"
        tried.append({"recompute": option, "why": why})
    return _chosen(answers[best][1], "recompute", tried, check_memory)


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


def _checked_settings(
    backend: str, objective: str, backend_options: Any
) -> tuple[Any, Mapping[str, Any]]:
    """The backend class (None for "auto") and its validated settings: an unknown name or a
    bad setting is one BackendError before any work."""
    solver = check_backend(backend, objective)
    if solver is not None:
        return solver, solver.settings(SolveOptions(extra=backend_options or {}))
    if backend_options:
        raise LayerwiseError(
            "backend_options are the settings of one backend: name it (backend='cpsat', ...); "
            "'auto' chooses the backend per problem and takes no settings"
        )
    return None, {}


def check_backend(backend: str, objective: str) -> Any:
    """The backend registered as `backend` when it optimizes `objective`, None for "auto"
    (planner/auto.py: it chooses per problem); else one error."""
    from planner.auto import AUTO
    from planner.registry import REGISTRY, get_backend

    if backend == AUTO:
        return None
    if backend not in REGISTRY:
        raise BackendError(
            f"unknown backend {backend!r}; available: {AUTO} (the default), {', '.join(REGISTRY)}"
        )
    solver = get_backend(backend)
    if objective not in solver.objectives:
        raise LayerwiseError(
            f"backend {backend!r} does not optimize the {objective!r} objective (it does: "
            f"{', '.join(solver.objectives)}; backend 'auto' chooses one that does)"
        )
    return solver


def _positive(seconds: Any) -> bool:
    return isinstance(seconds, int | float) and 0 < seconds < float("inf")


def _problem(model: Any, devices: Any, deadline: Deadline, **kwargs: Any) -> tuple[Any, Any, Any]:
    """`problem_of` within the deadline: a build that cannot finish in time is one error."""
    from planner.graph.opgraph import OpGraph

    started = time.perf_counter()
    try:
        return problem_of(model, devices, deadline=deadline, **kwargs)
    except OutOfTime:
        captured = isinstance(model, OpGraph)  # captured already (`_captured`)
        raise stopped(
            "building the cost tables"
            if captured
            else "capturing the model and building its cost tables",
            deadline,
            started,
            "raise the time limit, or make the problem smaller (max_configs, space='mesh', "
            "fewer devices)",
        ) from None


def _captured(
    model: Any, devices: Any, deadline: Deadline, **kwargs: Any
) -> tuple[OpGraph, ModelSpec | None, float] | None:
    """`model` captured once (an OpGraph, its spec, the seconds) so that every attempt of
    the "auto" memory options reuses it; None when it needs no capture (an OpGraph, a
    Problem, a cost-table file)."""
    from planner.graph.opgraph import OpGraph
    from planner.problems.problem import Problem
    from planner.sources import _is_problem_file, graph_of

    if isinstance(model, OpGraph | Problem) or _is_problem_file(model):
        return None
    started = time.perf_counter()
    with catch_interrupt():
        try:
            graph, spec, _, seconds = graph_of(model, devices, deadline=deadline, **kwargs)
            if stop_requested():  # a Ctrl-C while the devices were built
                raise OutOfTime
        except OutOfTime:
            raise stopped(
                "capturing the model", deadline, started, "raise the time limit"
            ) from None
    return graph, spec, seconds


def _check_call(
    objective: Any, time_limit: Any, seed: Any, build_options: Mapping, **values: Any
) -> None:
    """Arguments that are wrong whatever the model: refused before any work, each error
    saying what was expected and what was given, with its type (`planner.errors.given`)."""
    from planner.problems.problem import build_problem

    if objective not in ("additive", "makespan"):
        raise LayerwiseError(f"objective must be 'additive' or 'makespan', got {given(objective)}")
    if not (_number(time_limit) and 0 < time_limit < float("inf")):
        raise LayerwiseError(
            f"time_limit must be a positive number of seconds (an int or a float), got "
            f"{given(time_limit)}"
        )
    if not _integer(seed) or seed < 0:
        raise LayerwiseError(f"seed must be an integer >= 0, got {given(seed)}")
    for name, ok, expected in (
        ("backend", isinstance(values["backend"], str), "a backend's name (a str)"),
        ("max_configs", _optional_count(values["max_configs"]), "None or an integer >= 1"),
        (
            "memory_limit",
            _memory_limit(values["memory_limit"]),
            "None, 'device' or a positive number of bytes per device",
        ),
        (
            "backend_options",
            values["backend_options"] is None or isinstance(values["backend_options"], Mapping),
            "a mapping of setting names to values, or the backend's settings object",
        ),
    ):
        if not ok:
            raise LayerwiseError(f"{name} must be {expected}, got {given(values[name])}")
    accepted = set(inspect.signature(build_problem).parameters) - {"graph", "devices"}
    accepted -= {"cost_model", "max_configs", "memory_limit"}
    unknown = sorted(set(build_options) - accepted)
    if unknown:
        raise LayerwiseError(
            f"plan() got unknown option(s) {', '.join(unknown)}; build_problem accepts "
            f"{', '.join(sorted(accepted))}"
        )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_count(value: Any) -> bool:
    return value is None or (_integer(value) and value >= 1)


def _memory_limit(value: Any) -> bool:
    if value is None or (isinstance(value, str) and value == "device"):
        return True
    return _number(value) and 0 < value < float("inf")


def _out_of_time(
    problem: Problem,
    spec: ModelSpec | None,
    backend: str,
    objective: str,
    deadline: Deadline,
    start: float,
    phases: dict[str, float],
) -> PlanResult:
    used = time.perf_counter() - start
    before = start - deadline.began  # start-up, reading the problem, loading the solver
    spent = f"{used:.3g} s capturing and building the problem"
    if before >= 0.01:  # NaN (a deadline not made by `after`) is not
        spent = (
            f"{before:.3g} s before planning began (start-up, reading the input, loading the "
            f"solver) and {spent}"
        )
    message = (
        f"the time limit of {deadline.limit:g} s ran out before the search began: {spent}. "
        "Raise the time limit, or make the problem smaller (max_configs, fewer devices, a "
        "smaller model)"
    )
    limit = Limit.TIME
    if stop_requested():
        message, limit = "interrupted before the search began", Limit.INTERRUPTED
    log.info(message)
    result = SolveResult(backend, Status.NO_SOLUTION, limit=limit)
    phases = {**phases, "search_seconds": 0.0, "total_seconds": used}
    return PlanResult(result, objective, problem, phases, spec, message)
