"""Planning with pipeline parallelism: `plan_pipeline` and its answer, a `PipelinePlan`
(planner/plans.py).

`plan_pipeline(model, devices, ...)` captures the model (no cost tables: a 70B GPT on 1,024
GPUs would need millions of entries), then runs the pipeline search
(`backends.pipeline.search.PipelineSearch`, through `planner.registry`): stages, tensor
and data degrees, micro-batches, schedule, recomputation and ZeRO. `planner.plan` calls it
for a stack of alike numbered blocks on more than one host (`auto_search`; the per-op search
when it finds no layout), and when a model does not fit the devices without it
(docs/pipeline.md). The answer holds a `PipelinedStrategy` (one micro-batch's strategy
and its `Pipeline`) with its simulated step: `save` writes a plan file with a `pipeline`
section that `planner evaluate`, `runtime.run` and `planner.export.pipelining` read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from planner.costs.costmodel import CostOptions
from planner.deadline import Deadline, catch_interrupt, stop_requested
from planner.errors import LayerwiseError
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.pipeline.problem import PipelineProblem
from planner.pipeline.spec import PipelineError, PipelineOutOfTime
from planner.plans import PipelinePlan
from planner.problems.sizes import pipeline_peak_parts
from planner.registry import get_pipeline_solver
from planner.request import DEFAULT_TIME_LIMIT, PlanRequest, overrun_words
from planner.result import Limit, SolveOptions

__all__ = [
    "PER_OP",
    "PIPELINE",
    "PipelinePlan",
    "auto_search",
    "has_blocks",
    "plan_pipeline_request",
    "plan_pipeline",
]

log = logging.getLogger("planner.pipeline")


def plan_pipeline(
    model: Any,
    devices: Any,
    *,
    time_limit: float = DEFAULT_TIME_LIMIT,
    seed: int = 0,
    example_inputs: Any = None,
    model_kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    coarsen: bool = True,
    precision: str | None = None,
    optimizer: str | None = None,
    master_weights: bool | None = None,
    zero: int | str | None = None,
    headroom: float | None = None,
    reserve: float | None = None,
    recompute: str | None = None,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
    deadline: Deadline | None = None,
) -> PipelinePlan:
    """The fastest pipelined layout found for `model` (a model of numbered blocks: a GPT's
    `transformer.h.3`, a Llama's `layers.3`) on `devices` within their memory.

    zero: a stage, or None/"auto" (stages 0 and 1 are searched); recompute: "none",
    "selective", "full", or None/"auto" (all three searched); headroom and reserve: the
    fraction of each device's memory and the bytes per GPU kept free (None: `planner.costs.
    memory.DEFAULT_HEADROOM` and `DEFAULT_RESERVE`); schedules: of "gpipe", "1f1b", "interleaved" (default
    all); stages: pipeline sizes to try (default every divisor of the devices up to the
    blocks); precision: as `planner.plan`'s. The search is deterministic: `seed` is recorded
    only. PipelineError when no layout fits."""
    request = PlanRequest.make(
        model,
        devices,
        time_limit=time_limit,
        seed=seed,
        example_inputs=example_inputs,
        model_kwargs=model_kwargs,
        name=name,
        coarsen=coarsen,
        precision=precision,
        optimizer=optimizer,
        master_weights=master_weights,
        zero=zero,
        headroom=headroom,
        reserve=reserve,
        recompute=recompute,
        deadline=deadline,
        pipeline=True,
    )
    out = plan_pipeline_request(request, schedules, stages)
    if "overrun" in out.stats:
        log.warning("%s", out.stats["overrun"])
    return out


def plan_pipeline_request(
    request: PlanRequest,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
) -> PipelinePlan:
    """`plan_pipeline` of a request: the model captured (once: a captured request is not
    captured again), then the pipeline search (`planner.registry.get_pipeline_solver`, under
    the result contract) within the request's deadline. PipelineError when it finds no
    layout."""
    start = time.perf_counter()
    memory = request.memory
    solver = get_pipeline_solver()
    settings = check_choices(request, schedules, stages, solver)
    with catch_interrupt():
        request = request.capture()
        graph, device_graph = request.model, request.devices
        if not isinstance(graph, OpGraph):
            raise LayerwiseError(
                "a cost-table problem has no layers to cut into pipeline stages: plan it "
                "without pipeline (pipeline=False, --pipeline off)"
            )
        kept = memory.with_defaults(device_graph)  # the default headroom and reserve when unset
        given = {"optimizer": memory.optimizer, "master_weights": memory.master_weights,
                 "headroom": kept.headroom, "reserve": kept.reserve}  # fmt: skip
        options = CostOptions(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
        log.info(
            "%s: %d ops captured in %.3g s; searching pipelines on %s",
            graph.name,
            len(graph.ops),
            request.capture_seconds,
            device_graph.name,
        )
        late = request.call.expired() and not stop_requested()  # capture used the limit up
        t0 = time.perf_counter()
        problem = PipelineProblem(graph, device_graph, options)
        solve = SolveOptions(
            extra=settings, deadline=request.deadline, gap_tolerance=request.gap_tolerance
        )
        result = solver.solve(problem, solve)
    overrun = _overrun(request, result.stats.get("first_answer_grace_seconds")) if late else None
    if not result.has_solution:
        if result.stats.get("no_answer_in_time"):
            if result.limit is Limit.INTERRUPTED:
                raise KeyboardInterrupt("interrupted while searching pipelines, none costed yet")
            raise PipelineOutOfTime(
                f"{overrun}; {result.message}" if overrun else (result.message or "")
            )
        raise PipelineError(result.message or _no_layout(result))
    phases = {
        **{k: v for k, v in result.stats.items() if k != "seconds"},
        "capture_seconds": request.capture_seconds,
        "build_seconds": 0.0,
        "search_seconds": time.perf_counter() - t0,
        "total_seconds": time.perf_counter() - start + request.capture_seconds,
        "memory_peak_bytes": result.peak_bytes,
        "memory_fits": True,
        "memory_peak_parts": pipeline_peak_parts(
            result.timeline, device_graph, result.cost_options or options
        ),
        "gap_tolerance": request.gap_tolerance,
        **({"overrun": overrun} if overrun else {}),
    }
    out = PipelinePlan(result, phases=phases, model=request.spec)
    log.info(
        "pipeline: %s, step %.4g s, bound %.4g s (%.3g s in all)",
        out.layout.describe(),
        out.objective,
        out.bound,
        phases["total_seconds"],
    )
    return out


def _overrun(request: PlanRequest, grace: float | None) -> str:
    """The line that says capture used the call's time limit up: the search then ran only
    what gives a first answer, for at most `grace` seconds (the search's
    `first_answer_grace_seconds`)."""
    head, advice = overrun_words(request.call, request.capture_seconds, "capturing the model")
    within = f" within {grace:.3g} s" if grace else ""
    message = (
        f"{head}: the pipeline search ran only what gives a first answer{within} (estimates "
        f"until a layout fits, its costing, and its simulation if expected to end by then); "
        f"{advice}"
    )
    log.info("%s", message)
    return message


def _no_layout(result: Any) -> str:
    limit = f", limit {result.limit.value}" if result.limit else ""
    return f"the pipeline search found no layout (status {result.status.value}{limit})"


def check_choices(
    request: PlanRequest,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
    solver: Any = None,
) -> Mapping[str, Any]:
    """The pipeline search's settings from the request's memory options (zero, recompute:
    None is "auto"), its table budget (for the per-op searches inside the stages) and
    `schedules`, `stages` (None: all), validated by the search (`solver`, the registered one
    by default: one BackendError line for a bad one)."""
    memory = request.memory
    extra: dict[str, Any] = {}
    for key, value in (("zero", memory.zero), ("recompute", memory.recompute),
                       ("schedules", schedules), ("stages", stages)):  # fmt: skip
        if value is not None:
            extra[key] = value
    if "table_budget" in request.search.build_options:
        extra["table_budget"] = request.search.build_options["table_budget"]
    return (solver or get_pipeline_solver()).settings(SolveOptions(extra=extra))


PIPELINE = "pipeline"
PER_OP = "per-op"


def auto_search(graph: OpGraph, devices: DeviceGraph) -> str:
    """The search `plan` tries first by default for a captured model: `PIPELINE` for a stack
    of repeated, alike blocks (a transformer's: `planner.pipeline.layouts.repeated_blocks`)
    on devices of more than one host, else `PER_OP` (which turns to pipelines only when the
    model does not fit the devices otherwise). The pipeline search's refusal falls back to
    the per-op search."""
    hosts = len({d.host for d in devices.devices})
    return PIPELINE if hosts >= 2 and has_blocks(graph) else PER_OP


def has_blocks(graph: Any) -> bool:
    """Whether the pipeline search can cut `graph`: a stack of repeated, alike blocks."""
    from planner.pipeline.layouts import repeated_blocks

    return repeated_blocks(graph)
