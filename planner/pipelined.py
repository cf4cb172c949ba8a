"""Planning with pipeline parallelism: `plan_pipeline` and its answer, `PipelinePlan`.

`plan_pipeline(model, devices, ...)` captures the model (no cost tables: a 70B GPT on 1,024
GPUs would need millions of entries), then runs the pipeline search
(`backends.pipeline.search.search_pipeline`, through `planner.registry`): stages, tensor
and data degrees, micro-batches, schedule, recomputation and ZeRO. `planner.plan` calls it
for a stack of alike numbered blocks on more than one host (`auto_search`; the per-op search
when it finds no layout), and when a model does not fit the devices without it
(docs/pipeline.md). The answer is a `PipelinedStrategy` (one
micro-batch's strategy and its `Pipeline`) with its simulated step: `save` writes a plan
file with a `pipeline` section that `planner evaluate`, `runtime.run` and
`planner.export_pipeline` read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.costs.costmodel import CostOptions
from planner.deadline import (
    Deadline,
    catch_interrupt,
    stop_requested,
)
from planner.errors import LayerwiseError, given
from planner.files import check_output_path, finite_or_none, strict_json, write_text_atomic
from planner.graph.models import ModelSpec
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.pipeline.schedule import SCHEDULES
from planner.pipeline.spec import PipelinedStrategy
from planner.pipeline.timeline import PipelineTimeline
from planner.problems.strategy import Strategy
from planner.request import DEFAULT_TIME_LIMIT, PlanRequest
from planner.result import Limit, Status

__all__ = [
    "PER_OP",
    "PIPELINE",
    "PipelinePlan",
    "auto_search",
    "has_blocks",
    "pipeline_plan",
    "plan_pipeline",
]

log = logging.getLogger("planner.pipeline")

RECOMPUTE_CHOICES = ("none", "full")
ZERO_CHOICES = (0, 1)  # with pipelines Megatron-LM-style runs shard the optimizer state at most


@dataclass(frozen=True)
class PipelinePlan:
    """What `plan_pipeline` found: the pipelined strategy, the layout it follows (stages,
    tensor and data degrees, micro-batches, schedule, recomputation, ZeRO, blocks per
    stage), the cost options it was simulated with, its simulated step (`timeline`), a lower
    bound on any layout's step (`bound`) and the phases' seconds."""

    planned: PipelinedStrategy
    layout: Any  # backends.pipeline.search.Layout
    options: CostOptions
    timeline: PipelineTimeline
    bound: float
    phases: Mapping[str, Any] = field(default_factory=dict)
    model: ModelSpec | None = None
    objective_kind: str = "makespan"

    status = Status.FEASIBLE
    backend = "pipeline"

    @property
    def limit(self) -> Limit | None:
        if self.phases.get("interrupted"):
            return Limit.INTERRUPTED
        return Limit.TIME if self.phases.get("stopped_by_time_limit") else None

    @property
    def objective(self) -> float:
        """The simulated step in seconds (m micro-batches, the bubble, messages, sync)."""
        return self.timeline.makespan

    @property
    def gap(self) -> float | None:
        return self.objective / self.bound - 1 if self.bound > 0 else None

    @property
    def strategy(self) -> Strategy:
        """One micro-batch's strategy (its graph has B / m samples)."""
        return self.planned.strategy

    @property
    def stats(self) -> dict[str, Any]:
        return dict(self.phases)

    @property
    def has_solution(self) -> bool:
        return True

    def summary(self) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {
            "status": self.status.value,
            "limit": self.limit.value if self.limit else None,
            "objective": self.objective,
            "bound": self.bound,
            "gap": self.gap,
            "backend": self.backend,
            "objective_kind": self.objective_kind,
            **{k: v for k, v in self.phases.items() if k.endswith("_seconds")},
            "memory_peak_bytes": max(self.timeline.peak_bytes),
            "memory_fits": True,
        }
        out = {k: finite_or_none(v) for k, v in out.items()}
        out["layout"] = {
            "layout": lay.describe(),
            "stages": lay.stages,
            "tensor": lay.tensor,
            "data": lay.data,
            "micro_batches": lay.micro_batches,
            "micro_batch": lay.micro_batch,
            "schedule": lay.schedule,
            "virtual": lay.virtual,
            "recompute": self.options.recompute,
            "zero": self.options.zero,
            "bubble": self.timeline.bubble,
            "blocks": list(lay.blocks),
            "inner": getattr(lay, "inner", "rule"),
            "layouts_fit": self.phases.get("layouts_fit"),
            "simulated": self.phases.get("simulated_exactly"),
        }
        if "memory_fallback" in self.phases:
            out["memory_fallback"] = self.phases["memory_fallback"]
        return out

    def to_json(self) -> dict[str, Any]:
        """The plan file: the micro-batch strategy file with its `pipeline` section, the
        summary and the cost options; `model` is the whole batch's, as planned."""
        cost = {**dataclasses.asdict(self.options), "source": "analytic"}
        model = self.model.to_json() if self.model else None
        return self.planned.to_json(model=model, extra={**self.summary(), "cost": cost})

    def save(self, path: str | Path) -> None:
        path = check_output_path(path, "plan")
        write_text_atomic(path, strict_json(self.to_json(), indent=1))

    def describe(self) -> list[tuple[str, str, str]]:
        return self.strategy.describe()


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
    optimizer: str | None = None,
    master_weights: bool | None = None,
    zero: int | str | None = None,
    headroom: float | None = None,
    recompute: str | None = None,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
    deadline: Deadline | None = None,
) -> PipelinePlan:
    """The fastest pipelined layout found for `model` (a model of numbered blocks: a GPT's
    `transformer.h.3`, a Llama's `layers.3`) on `devices` within their memory.

    zero: a stage, or None/"auto" (stages 0 and 1 are searched); recompute: "none", "full",
    or None/"auto" (both searched); schedules: of "gpipe", "1f1b", "interleaved" (default
    all); stages: pipeline sizes to try (default every divisor of the devices up to the
    blocks). The search is deterministic: `seed` is recorded only. PipelineError when no
    layout fits."""
    request = PlanRequest.make(
        model,
        devices,
        time_limit=time_limit,
        seed=seed,
        example_inputs=example_inputs,
        model_kwargs=model_kwargs,
        name=name,
        coarsen=coarsen,
        optimizer=optimizer,
        master_weights=master_weights,
        zero=zero,
        headroom=headroom,
        recompute=recompute,
        deadline=deadline,
        pipeline=True,
    )
    return pipeline_plan(request, schedules, stages)


def pipeline_plan(
    request: PlanRequest,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
) -> PipelinePlan:
    """`plan_pipeline` of a request: the model captured (once: a captured request is not
    captured again), then the pipeline search within the request's deadline."""
    start = time.perf_counter()
    memory = request.memory
    search_options = check_choices(request, schedules, stages)
    given = {"optimizer": memory.optimizer, "master_weights": memory.master_weights,
             "headroom": memory.headroom}  # fmt: skip
    options = CostOptions(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    from planner.registry import get_pipeline_search

    with catch_interrupt():
        request = request.capture()
        graph, device_graph = request.model, request.devices
        if not isinstance(graph, OpGraph):
            raise LayerwiseError(
                "a cost-table problem has no layers to cut into pipeline stages: plan it "
                "without pipeline (pipeline=False, --pipeline off)"
            )
        log.info(
            "%s: %d ops captured in %.3g s; searching pipelines on %s",
            graph.name,
            len(graph.ops),
            request.capture_seconds,
            device_graph.name,
        )
        t0 = time.perf_counter()
        answer = get_pipeline_search()(
            graph, device_graph, options, deadline=request.deadline, **search_options
        )
        interrupted = stop_requested()
    phases = {
        "capture_seconds": request.capture_seconds,
        "build_seconds": 0.0,
        "search_seconds": time.perf_counter() - t0,
        "total_seconds": time.perf_counter() - start + request.capture_seconds,
        **{k: v for k, v in answer.stats.items() if k != "seconds"},
        "interrupted": interrupted,
    }
    log.info(
        "pipeline: %s, step %.4g s, bound %.4g s (%.3g s in all)",
        answer.layout.describe(),
        answer.step_seconds,
        answer.bound,
        phases["total_seconds"],
    )
    return PipelinePlan(
        answer.planned,
        answer.layout,
        answer.options,
        answer.timeline,
        answer.bound,
        phases,
        request.spec,
    )


def check_choices(
    request: PlanRequest,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The pipeline search's choices from the request's memory options (and `schedules`,
    `stages`), one-line errors for bad ones."""
    memory = request.memory
    return _search_choices(memory.zero, memory.recompute, schedules, stages, request.seed)


def _search_choices(
    zero: Any, recompute: Any, schedules: Any, stages: Any, seed: Any
) -> dict[str, Any]:
    """The search's choices from plan()'s options, one-line errors for bad ones."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LayerwiseError(f"seed must be an integer >= 0, got {given(seed)}")
    if zero in (None, "auto"):
        zeros: tuple[int, ...] = ZERO_CHOICES
    elif zero in (0, 1, 2, 3) and not isinstance(zero, bool):
        zeros = (int(zero),)
    else:
        raise LayerwiseError(f"zero must be 0, 1, 2, 3 or 'auto', got {given(zero)}")
    if recompute in (None, "auto"):
        modes: tuple[str, ...] = RECOMPUTE_CHOICES
    elif recompute in RECOMPUTE_CHOICES:
        modes = (recompute,)
    else:
        raise LayerwiseError(
            f"with pipelines recompute must be 'none', 'full' or 'auto' (whole blocks), got "
            f"{given(recompute)}"
        )
    chosen = tuple(schedules) if schedules is not None else SCHEDULES
    bad = [s for s in chosen if s not in SCHEDULES]
    if bad or not chosen:
        raise LayerwiseError(
            f"schedules must be some of {', '.join(SCHEDULES)}, got {given(schedules)}"
        )
    if stages is not None and (
        not stages or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in stages)
    ):
        raise LayerwiseError(f"stages must be pipeline sizes >= 1, got {given(stages)}")
    return {
        "recompute": modes,
        "zero": zeros,
        "schedules": chosen,
        "stages": tuple(stages) if stages is not None else None,
    }


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
