"""The plan a search returns, one type whichever searched: `Plan`, with `PlanResult` (the
per-op search, `planner.plan`) and `PipelinePlan` (the pipeline search,
`planner.plan_pipeline`); and `Evaluation`, a strategy re-scored under both objectives.

A user reads the same fields whatever searched: status, limit, objective, bound and gap (the
shared rule, `planner.result.result_gap`), backend, strategy, stats (the search's statistics
with every phase's seconds), `summary()` (the head of a plan file and of `plan --json`),
`to_json()`, `save(path)` and `describe()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import LayerwiseError
from planner.files import check_output_path, finite_or_none, strict_json, write_text_atomic
from planner.graph.models import ModelSpec
from planner.result import Limit, PipelineResult, SolveResult, Status

if TYPE_CHECKING:
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.pipeline.problem import Layout
    from planner.pipeline.spec import PipelinedStrategy
    from planner.pipeline.timeline import PipelineTimeline
    from planner.problems.problem import Problem
    from planner.problems.strategy import Strategy

__all__ = ["Evaluation", "PipelinePlan", "Plan", "PlanResult", "evaluate_strategy"]


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
class Plan:
    """What a search found, whichever searched (the per-op search: `PlanResult`; the pipeline
    search: `PipelinePlan`), read through the same fields: status, limit, objective, bound,
    gap (`planner.result.result_gap`), backend, strategy, stats; `summary`, `to_json`,
    `save`, `describe`.

    `result` is the search's answer (a `SolveResult`: status OPTIMAL, FEASIBLE,
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
    problem: Problem | None
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
            **({"gap_tolerance": s["gap_tolerance"]} if "gap_tolerance" in s else {}),
            "backend": self.backend,
            "objective_kind": self.objective_kind,
            **{k: s.get(k) for k in PHASES if k in s or k in ALWAYS},
            **{k: s[k] for k in (*MEMORY_KEYS, *DEVICE_KEYS) if k in s},
        }
        if self.problem is not None and self.problem.is_dnn:  # what was searched (docs/space.md)
            out["space"] = self.problem.dnn().space.describe()
        if self.message:
            out["message"] = self.message
        out = {k: finite_or_none(v) for k, v in out.items()}
        out.update(self.details())
        # backend choice, re-rank rule, the memory options "auto" chose, fallbacks
        for key in EXTRA_KEYS:
            if key in s:
                out[key] = _strict(s[key])
        return out

    def details(self) -> dict[str, Any]:
        """What this kind of plan adds to the summary (the pipeline's layout)."""
        return {}

    def to_json(self) -> dict[str, Any]:
        """The plan file (strict JSON)."""
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        """Write `to_json()` to `path` atomically (a temporary file, then a rename)."""
        path = check_output_path(path, "plan")
        write_text_atomic(path, strict_json(self.to_json(), indent=1))

    def describe(self) -> list[tuple[str, str, str]]:
        """(op name, kind, config) rows of the strategy (empty without one)."""
        return self.strategy.describe() if self.strategy is not None else []


@dataclass(frozen=True)
class PlanResult(Plan):
    """What the per-op search found (`planner.plan`): `problem` is the Problem searched
    (its cost tables), `strategy` the whole strategy (None for a cost-table problem)."""

    problem: Problem

    def to_json(self) -> dict[str, Any]:
        """The plan file: a strategy file (docs/strategy.md) with the summary and the cost
        options, or for a cost-table problem the summary and the choices. Strict JSON."""
        head = self.summary()
        if self.strategy is None:
            data = {**head, "choices": list(self.choices) if self.choices else None}
        else:
            cost: dict[str, Any] = {}
            if self.problem is not None and self.problem.is_dnn:
                cm = self.problem.dnn().cost_model
                cost = {**dataclasses.asdict(cm.options), "source": cm.source}
            model = self.model.to_json() if self.model else None
            data = self.strategy.to_json(model=model, extra={**head, "cost": cost})
        return dict(_strict(data))

    def evaluate(self) -> Evaluation:
        """The strategy re-scored under both objectives with the cost model it was planned
        with (LayerwiseError without a strategy)."""
        if self.strategy is None:
            raise LayerwiseError(
                f"nothing to evaluate: the plan has no strategy (status {self.status.value})"
            )
        dnn = self.problem is not None and self.problem.is_dnn
        cm = self.problem.dnn().cost_model if self.problem is not None and dnn else None
        return evaluate_strategy(self.strategy, cm)


@dataclass(frozen=True)
class PipelinePlan(Plan):
    """What the pipeline search found (`planner.plan_pipeline`): `result` is its
    `PipelineResult` (the pipelined strategy `planned`, the `layout` it follows: stages,
    tensor and data degrees, micro-batches, schedule, recomputation, ZeRO, blocks per stage;
    the cost `options` it was simulated with, its simulated step `timeline`, and `bound`, a
    lower bound on any layout's step); no Problem (no cost tables)."""

    objective_kind: str = "makespan"
    problem: Problem | None = None

    @property
    def answer(self) -> PipelineResult:
        """The pipeline search's result, with a layout."""
        result = self.result
        if not isinstance(result, PipelineResult) or result.planned is None:
            raise LayerwiseError(f"the pipeline plan has no layout (status {self.status.value})")
        return result

    @property
    def planned(self) -> PipelinedStrategy:
        """The pipelined strategy (one micro-batch's strategy and its `Pipeline`)."""
        assert self.answer.planned is not None
        return self.answer.planned

    @property
    def layout(self) -> Layout:
        """The layout the strategy follows."""
        assert self.answer.layout is not None
        return self.answer.layout

    @property
    def options(self) -> CostOptions:
        """The cost options it was simulated with (the layout's recomputation and ZeRO)."""
        assert self.answer.cost_options is not None
        return self.answer.cost_options

    @property
    def timeline(self) -> PipelineTimeline:
        """Its simulated step (m micro-batches, the bubble, messages, sync)."""
        assert self.answer.timeline is not None
        return self.answer.timeline

    def details(self) -> dict[str, Any]:
        """The summary's `layout`: the layout, its bubble and how it was found."""
        if not self.has_solution:
            return {}
        lay, s = self.layout, self.stats
        return {
            "layout": {
                "layout": lay.describe(),
                "stages": lay.stages,
                "tensor": lay.tensor,
                "context": lay.context,
                "expert": lay.expert,
                "data": lay.data,
                "micro_batches": lay.micro_batches,
                "micro_batch": lay.micro_batch,
                "schedule": lay.schedule,
                "virtual": lay.virtual,
                "recompute": self.options.recompute,
                "zero": self.options.zero,
                "bubble": self.timeline.bubble,
                "blocks": list(lay.blocks),
                "inner": lay.inner,
                "layouts_fit": s.get("layouts_fit"),
                "simulated": s.get("simulated_exactly"),
                "simulated_on": s.get("answer_simulated_on"),
            }
        }

    def to_json(self) -> dict[str, Any]:
        """The plan file: the micro-batch strategy file with its `pipeline` section, the
        summary and the cost options; `model` is the whole batch's, as planned."""
        cost = {**dataclasses.asdict(self.options), "source": "analytic"}
        model = self.model.to_json() if self.model else None
        return self.planned.to_json(model=model, extra={**self.summary(), "cost": cost})


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
# the peak, whether it fits, and what it holds (`planner.problems.sizes.peak_parts`)
MEMORY_KEYS = ("memory_peak_bytes", "memory_fits", "memory_peak_parts")
DEVICE_KEYS = ("devices_used", "devices_total", "idle_devices")  # planner/problems/idle.py
EXTRA_KEYS = (
    "auto",
    "recommendation",
    "searched",
    "zero",
    "recompute",
    "memory_fallback",
    "pipeline_refused",
    "overrun",
)


def _strict(value: Any) -> Any:
    import json

    return json.loads(strict_json(value))
