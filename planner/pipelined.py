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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.costs.costmodel import CostOptions
from planner.deadline import (
    BuildOutOfTime,
    Deadline,
    OutOfTime,
    catch_interrupt,
    stop_requested,
    stopped,
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
from planner.result import Limit, Status

__all__ = ["PER_OP", "PIPELINE", "PipelinePlan", "auto_search", "plan_pipeline"]

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
    time_limit: float = 60.0,
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
    clock = Deadline.after(time_limit)
    deadline = clock if deadline is None else deadline.within(clock.left())
    start = time.perf_counter()
    search_options = _search_choices(zero, recompute, schedules, stages, seed)
    memory = {"optimizer": optimizer, "master_weights": master_weights, "headroom": headroom}
    options = CostOptions(**{k: v for k, v in memory.items() if v is not None})  # type: ignore[arg-type]
    from planner.registry import get_pipeline_search
    from planner.sources import graph_of

    with catch_interrupt():
        try:
            graph, spec, device_graph, capture = graph_of(
                model,
                devices,
                example_inputs=example_inputs,
                model_kwargs=model_kwargs,
                name=name,
                coarsen=coarsen,
                deadline=deadline,
            )
        except OutOfTime:
            raise stopped("capturing the model", deadline, start, "raise the time limit") from None
        log.info(
            "%s: %d ops captured in %.3g s; searching pipelines on %s",
            graph.name,
            len(graph.ops),
            capture,
            device_graph.name,
        )
        t0 = time.perf_counter()
        answer = get_pipeline_search()(
            graph, device_graph, options, deadline=deadline, **search_options
        )
        interrupted = stop_requested()
    phases = {
        "capture_seconds": capture,
        "build_seconds": 0.0,
        "search_seconds": time.perf_counter() - t0,
        "total_seconds": time.perf_counter() - start,
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
        answer.planned, answer.layout, answer.options, answer.timeline, answer.bound, phases, spec
    )


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


def choose_pipeline(plain: Callable[..., Any], pipeline: Any, **call: Any) -> Any:
    """`plan`'s choice between the per-op search (`plain`, planner.api) and the pipeline
    search (see `plan`'s docstring, `pipeline`)."""
    from planner.problems.sizes import MemoryRefusal
    from planner.sources import _is_problem_file

    extra = set(call) - PLAIN_ONLY - PIPELINE_ARGS - {"deadline", "check_memory", "recommend"}
    changed = sorted(
        k
        for k in PLAIN_ONLY
        if call.get(k) not in (None, {}) and call.get(k) != PLAIN_DEFAULTS.get(k)
    ) + sorted(extra)
    if isinstance(call.get("recompute"), int) and not isinstance(call.get("recompute"), bool):
        changed.append("recompute (a number of blocks)")
    if pipeline is True:
        if changed:
            raise LayerwiseError(
                f"pipeline=True plans with the pipeline search, which takes no "
                f"{', '.join(changed)}: leave them unset (or pipeline=False)"
            )
        return plan_pipeline(**_pipeline_call(call))
    model = call["model"]
    from planner.costs.recompute import check_graph_options
    from planner.problems.problem import Problem

    if changed or isinstance(model, Problem) or _is_problem_file(model):
        return plain(**call)
    as_graph, spec, seconds = _captured(call)  # once, for every attempt below
    graph, devices = as_graph["model"], as_graph["devices"]
    if not isinstance(model, OpGraph):  # an OpGraph was checked by plan()
        check_graph_options(graph, call.get("recompute"), call.get("master_weights"))
    if auto_search(graph, devices) == PER_OP:
        try:
            return _plain_captured(plain, as_graph, spec, seconds)
        except MemoryRefusal as refusal:
            if call.get("zero") is not None or call.get("recompute") is not None:
                raise  # chosen by hand: the refusal says what does not fit with them
            return _pipeline_after_refusal(refusal, as_graph, spec, seconds)
    log.info(
        "%s is a stack of repeated blocks and %s spans hosts: searching pipelines",
        graph.name,
        devices.name,
    )
    call_pipeline = _pipeline_call(as_graph)
    _search_choices(
        call_pipeline.get("zero"), call_pipeline.get("recompute"), None, None, call["seed"]
    )  # the caller's own bad option is an error, not a reason to plan per op
    with catch_interrupt():  # a Ctrl-C during the pipeline search is not a refusal
        try:
            out = plan_pipeline(**call_pipeline)
        except LayerwiseError as exc:
            if stop_requested():
                raise
            log.warning("the pipeline search gave no plan (%s): planning per op instead", exc)
            return _plain_captured(plain, as_graph, spec, seconds, refused=str(exc))
    return dataclasses.replace(out, model=spec, phases={**out.phases, "capture_seconds": seconds})


PIPELINE = "pipeline"
PER_OP = "per-op"


def auto_search(graph: OpGraph, devices: DeviceGraph) -> str:
    """The search `plan` tries first by default for a captured model: `PIPELINE` for a stack
    of repeated, alike blocks (a transformer's: `planner.pipeline.layouts.repeated_blocks`)
    on devices of more than one host, else `PER_OP` (which turns to pipelines only when the
    model does not fit the devices otherwise). The pipeline search's refusal falls back to
    the per-op search."""
    hosts = len({d.host for d in devices.devices})
    return PIPELINE if hosts >= 2 and _has_blocks(graph) else PER_OP


def _plain_captured(
    plain: Callable[..., Any],
    call: dict[str, Any],
    spec: Any,
    seconds: float,
    refused: str | None = None,
) -> Any:
    """The per-op plan of an already captured model (`_captured`'s call), with the capture's
    seconds and spec; `refused`: why the pipeline search, tried first, found no layout (in
    `stats["pipeline_refused"]`, and in the error when the per-op search fails too)."""
    from planner.problems.sizes import MemoryRefusal

    try:
        out = plain(**call)
    except MemoryRefusal as exc:
        if refused is None:
            raise
        raise MemoryRefusal(
            f"{exc}; no pipeline layout fits either ({refused})", exc.fact, exc.final
        ) from None
    except BuildOutOfTime as exc:
        if refused is None:
            raise
        raise LayerwiseError(  # what is known (no layout fits) first
            f"{refused}; the per-op search, tried instead, ran out of time ({exc})"
        ) from None
    phases = {**out.phases, "capture_seconds": seconds}
    total = out.phases.get("total_seconds", 0.0) + seconds
    phases["total_seconds"] = total
    if refused is not None:
        phases["pipeline_refused"] = refused
    return dataclasses.replace(out, model=spec, phases=phases)


def _pipeline_after_refusal(refusal: Any, call: dict[str, Any], spec: Any, seconds: float) -> Any:
    """The plain plan of the captured model (`call`) was refused for memory: a pipelined one
    instead, for a stack of repeated blocks, in the time left; else the refusal, with why
    pipelines did not help (at once when it is `final`: nothing can fit)."""
    from planner.problems.sizes import MemoryRefusal

    deadline: Deadline = call["deadline"]
    if deadline.expired() or refusal.final or not _has_blocks(call["model"]):
        raise refusal
    log.info("%s: searching pipelines instead", refusal)
    try:
        out = plan_pipeline(**_pipeline_call(call))
    except LayerwiseError as exc:
        raise MemoryRefusal(
            f"{refusal}; no pipeline layout fits either ({exc})", refusal.fact
        ) from None
    phases = {**out.phases, "capture_seconds": seconds, "memory_fallback": str(refusal)}
    return dataclasses.replace(out, model=spec, phases=phases)


def _captured(call: Mapping[str, Any]) -> tuple[dict[str, Any], Any, float]:
    """`call` with its model captured (an OpGraph) and its devices a DeviceGraph, the model's
    spec and the capture's seconds (past the call's deadline one error; at a Ctrl-C,
    KeyboardInterrupt "interrupted ...")."""
    from planner.sources import graph_of

    started = time.perf_counter()
    with catch_interrupt():
        try:
            graph, spec, devices, seconds = graph_of(
                call["model"],
                call["devices"],
                example_inputs=call["example_inputs"],
                model_kwargs=call["model_kwargs"],
                name=call["name"],
                coarsen=call["coarsen"],
                deadline=call["deadline"],
            )
            if stop_requested():  # a Ctrl-C while the devices were built
                raise OutOfTime
        except OutOfTime:
            raise stopped(
                "capturing the model", call["deadline"], started, "raise the time limit"
            ) from None
    as_graph = {**call, "model": graph, "devices": devices}
    return {**as_graph, "example_inputs": None, "model_kwargs": None}, spec, seconds


def _has_blocks(graph: Any) -> bool:
    """Whether the pipeline search can cut `graph`: a stack of repeated, alike blocks."""
    from planner.pipeline.layouts import repeated_blocks

    return repeated_blocks(graph)


PIPELINE_ARGS = {
    "model", "devices", "time_limit", "seed", "example_inputs", "model_kwargs", "name",
    "coarsen", "optimizer", "master_weights", "zero", "headroom", "recompute",
}  # fmt: skip
# plan()'s options of the per-op search, and their defaults (the pipeline search takes none)
PLAIN_DEFAULTS = {"backend": "auto", "objective": "additive", "cost": "analytic"}
PLAIN_ONLY = {
    "backend",
    "objective",
    "cost",
    "sync",
    "memory_limit",
    "max_configs",
    "backend_options",
}


def _pipeline_call(call: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: call[k] for k in PIPELINE_ARGS if k in call}
    return {**out, "deadline": call["deadline"]}
