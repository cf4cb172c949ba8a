"""One plan request: what `planner.plan` was asked, checked once where the call enters.

A `PlanRequest` is frozen. It holds the model source and the devices, the training-memory
options (`MemoryOptions`), the per-op search (`PerOpSearch`: the backend with its validated
settings, the objective and the cost-table options), whether the pipeline search may run
(`pipeline`) and one `Deadline`. `PlanRequest.make` turns `plan()`'s keyword arguments into
one: every argument that is wrong whatever the model is one error line there, before any
capture. After that only the request travels. The "auto" options are new requests made with
`dataclasses.replace` (`with_memory`, `with_search`, `within`), and no module turns a number
of seconds into a deadline again.

Capture and build may run past the deadline, up to `OVERRUN` times its span more and at
least `OVERRUN_SECONDS` (`hard`):
when they do, `plan` answers without a search (planner/api.py, `_overrun_answer`) instead of
with nothing. Only a stop request (Ctrl-C) ends them at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.costs.memory import kept_free
from planner.costs.recompute import (
    RECOMPUTE,
    RECOMPUTE_AUTO,
    check_graph_options,
    recompute_error,
)
from planner.deadline import Deadline
from planner.errors import BackendError, LayerwiseError, given
from planner.graph.precision import check_precision
from planner.result import DEFAULT_GAP_TOLERANCE, gap_tolerance_error

if TYPE_CHECKING:
    from planner.graph.models import ModelSpec

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "MemoryOptions",
    "PerOpSearch",
    "PlanRequest",
    "check_backend",
    "checked_settings",
    "overrun_words",
]

# Seconds for a whole call. Exact backends return as soon as they have proven their answer
# (inception_v3 on 16 GPUs: a 2-15 s build, depending on the machine's load, and 5 ms of
# elimination), so a generous default costs them nothing; mcmc and the solvers use it all.
DEFAULT_TIME_LIMIT = 60.0
# Capture and build may go on past the deadline for this many times the limit more (3 x the
# limit in all), and at least `OVERRUN_SECONDS`, before the call gives up on them: a model
# whose tables take 12 s under a 10 s limit still gets an answer, one that would take an hour
# is still refused.
OVERRUN = 2.0
OVERRUN_SECONDS = 30.0
AUTO = "auto"  # planner.auto.AUTO: the backend chosen per problem
ZERO_AUTO = "auto"
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = RECOMPUTE  # in the order "auto" tries them: none, selective, full
SOURCE_OPTIONS = ("example_inputs", "model_kwargs", "name", "coarsen", "precision")  # capture
MEMORY_OPTIONS = ("optimizer", "master_weights", "zero", "headroom", "reserve", "recompute")
PER_OP_OPTIONS = ("memory_limit", "cost", "sync", "max_configs", "recommend", "check_memory")
# the per-op search's options and their defaults: the pipeline search takes none of them
PER_OP_DEFAULTS: dict[str, Any] = {
    "backend": AUTO,
    "objective": "additive",
    "cost": "analytic",
    "sync": None,
    "memory_limit": None,
    "max_configs": None,
}
# build options both searches take: the pipeline search's per-op searches inside its stages
# build their tables within the same budget (`PipelineSettings.table_budget`)
SHARED_BUILD_OPTIONS = ("table_budget",)


@dataclass(frozen=True)
class MemoryOptions:
    """The training-memory options (docs/cost_model.md, "Memory"); None: the default.
    Unset, headroom and reserve are the plan's defaults (`with_defaults`, `planner.costs.
    memory.kept_free`: 5% of each device's memory and 2 GiB per GPU kept free) for a model, and
    nothing for a cost-table problem (its memory limit is its own)."""

    optimizer: str | None = None
    master_weights: bool | None = None
    zero: int | str | None = None
    headroom: float | None = None
    reserve: float | None = None
    recompute: str | int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The six options by name (None: unset)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def with_defaults(self, devices: Any) -> MemoryOptions:
        """These options with headroom and reserve set to the plan's defaults on `devices`
        (a DeviceGraph) when unset."""
        headroom, reserve = kept_free(self.headroom, self.reserve, devices)
        return dataclasses.replace(self, headroom=headroom, reserve=reserve)

    def check(self, sync: str | None) -> None:
        """Refused before any work (CostOptions' one-line errors)."""
        from planner.costs.costmodel import CostOptions

        values = {k: v for k, v in self.as_dict().items() if v is not None}
        if values.get("zero") == ZERO_AUTO:
            values["zero"] = ZERO_STAGES[-1]
        if values.get("recompute") == RECOMPUTE_AUTO:
            values["recompute"] = RECOMPUTE_MODES[-1]
        elif "recompute" in values and recompute_error(values["recompute"]) is not None:
            raise LayerwiseError(
                "recompute must be 'none', 'selective', 'full', 'auto' or a number of blocks "
                f">= 0, got {given(self.recompute)}"
            )
        if "zero" in values and (not isinstance(values["zero"], int) or values["zero"] is True):
            raise LayerwiseError(f"zero must be 0, 1, 2, 3 or 'auto', got {given(self.zero)}")
        if values.get("master_weights") is True and values.get("optimizer", "none") == "none":
            raise LayerwiseError(
                "master_weights are the optimizer's fp32 copies of 16-bit weights, and "
                "optimizer is 'none' (weights and gradients only): give an optimizer "
                "(optimizer='sgd' or 'adam', --optimizer) or leave master_weights unset"
            )
        if sync is not None:
            values["sync"] = sync
        CostOptions(**values)


@dataclass(frozen=True)
class PerOpSearch:
    """The per-op search: `backend` ("auto" or a registered name) with its validated
    `settings`, the objective, and the options of the cost tables it searches (cost source,
    sync, memory limit, configs per op, `build_problem`'s `build_options`); `recommend` and
    `check_memory` as `planner.plan` says."""

    backend: str = AUTO
    objective: str = "additive"
    settings: Mapping[str, Any] = field(default_factory=dict)
    cost: str = "analytic"
    sync: str | None = None
    memory_limit: float | str | None = None
    max_configs: int | None = None
    build_options: Mapping[str, Any] = field(default_factory=dict)
    recommend: bool = True
    check_memory: bool = True

    def changed(self) -> list[str]:
        """The options set away from their defaults (what the pipeline search cannot take;
        not the table budget, which bounds its per-op searches too)."""
        out = [k for k, v in PER_OP_DEFAULTS.items() if getattr(self, k) != v]
        if self.settings:
            out.append("backend_options")
        return sorted(out) + sorted(k for k in self.build_options if k not in SHARED_BUILD_OPTIONS)

    def cost_options(self, memory: MemoryOptions) -> dict[str, Any]:
        """The cost model's options (`planner.sources.problem_of`'s `options`)."""
        return {
            "memory_limit": self.memory_limit,
            "cost": self.cost,
            "sync": self.sync,
            **memory.as_dict(),
        }


@dataclass(frozen=True)
class PlanRequest:
    """What to plan (see the module docstring): the model (a zoo name, an nn.Module, a
    factory, an OpGraph, a Problem or a file) and how to capture it, the devices, the
    memory options, the per-op search, `pipeline` (True, False or "auto": `planner.plan`),
    the `seed`, the `gap_tolerance` every search stops at (`SolveOptions.gap_tolerance`), the
    `deadline` of this phase (the whole call's, or an "auto" attempt's
    share of it: `within`), `call`, the whole call's, and `hard`, past which capture and
    build stop. Once captured (`captured`), `model` is the OpGraph, `devices` the DeviceGraph,
    and `spec` and `capture_seconds` say what was captured and in how long."""

    model: Any
    devices: Any
    deadline: Deadline
    call: Deadline
    hard: Deadline
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    search: PerOpSearch = field(default_factory=PerOpSearch)
    pipeline: bool | str = AUTO
    seed: int = 0
    gap_tolerance: float = DEFAULT_GAP_TOLERANCE
    example_inputs: Any = None
    model_kwargs: Mapping[str, Any] | None = None
    name: str | None = None
    coarsen: bool = True
    precision: str | None = None
    spec: ModelSpec | None = None
    capture_seconds: float = 0.0
    is_captured: bool = False
    # an "auto" attempt's answer in hand (seconds per step): its search under the memory
    # limit runs only where its bound could beat it by more than the gap tolerance
    cutoff: float | None = None

    @classmethod
    def make(
        cls,
        model: Any,
        devices: Any = None,
        backend: str = AUTO,
        objective: str = "additive",
        time_limit: float = DEFAULT_TIME_LIMIT,
        seed: int = 0,
        *,
        deadline: Deadline | None = None,
        pipeline: bool | str | None = None,
        gap_tolerance: float = DEFAULT_GAP_TOLERANCE,
        **options: Any,
    ) -> PlanRequest:
        """`planner.plan`'s arguments as a request, each checked once (one error line for a
        bad one, before any capture). `options` are `plan`'s keyword arguments (its docstring
        says each): the model's capture (example_inputs, model_kwargs, name, coarsen), the
        memory options (`MemoryOptions`' fields), the per-op search's (memory_limit, cost,
        sync, max_configs, backend_options, recommend, check_memory), and the rest go to
        `build_problem`. `deadline`: a clock the caller started earlier; the earlier of it
        and `time_limit` from now is the request's."""
        started = time.perf_counter()  # the limit counts from the call, its checks included
        if pipeline is None:
            pipeline = AUTO
        if not (pipeline is True or pipeline is False or pipeline == AUTO):
            raise LayerwiseError(f"pipeline must be True, False or 'auto', got {given(pipeline)}")
        if gap_tolerance_error(gap_tolerance) is not None:
            raise LayerwiseError(
                "gap_tolerance must be a number in [0, 1) (the relative gap at which a search "
                "stops: 1e-4, the default, is 0.01%; 0 proves the optimum exactly), got "
                f"{given(gap_tolerance)}"
            )
        source = {k: options.pop(k) for k in SOURCE_OPTIONS if k in options}
        if "precision" in source:
            source["precision"] = check_precision(source["precision"])
        memory = MemoryOptions(**{k: options.pop(k) for k in MEMORY_OPTIONS if k in options})
        backend_options = options.pop("backend_options", None)
        per_op = {k: options.pop(k) for k in PER_OP_OPTIONS if k in options}
        _check_call(objective, time_limit, seed, options, backend=backend,
                    max_configs=per_op.get("max_configs"),
                    memory_limit=per_op.get("memory_limit"),
                    backend_options=backend_options)  # fmt: skip
        settings: Mapping[str, Any] = dict(backend_options or {})
        if pipeline is not True:  # the per-op search's backend and settings, before capture
            settings = checked_settings(backend, objective, backend_options)[1]
        memory.check(per_op.get("sync"))
        from planner.graph.opgraph import OpGraph

        if isinstance(model, OpGraph):  # a model is checked once captured
            check_graph_options(model, memory.recompute, memory.master_weights)
        clock = Deadline(started + time_limit, time_limit, started)
        if deadline is not None:
            clock = deadline.within(clock.left())
        search = PerOpSearch(backend, objective, settings, build_options=options, **per_op)
        return cls(model, devices, clock, clock, overrun_deadline(clock), memory, search,
                   pipeline, seed, float(gap_tolerance), **source)  # fmt: skip

    def captured(
        self, graph: Any, devices: Any, spec: ModelSpec | None, seconds: float
    ) -> PlanRequest:
        """This request with its model captured: every later attempt reuses the graph."""
        return dataclasses.replace(
            self,
            model=graph,
            devices=devices,
            example_inputs=None,
            model_kwargs=None,
            precision=None,  # the captured graph is in its dtypes already
            spec=spec,
            capture_seconds=seconds,
            is_captured=True,
        )

    def capture(self) -> PlanRequest:
        """This request with its model captured once (an OpGraph, its spec, the seconds) so
        that every later attempt reuses it; marked captured and otherwise unchanged when the
        model needs none (a Problem, a cost-table file); an OpGraph is taken as it is and
        its devices made a DeviceGraph. Capture may run
        past the deadline up to `hard`; a Ctrl-C stops it ("interrupted ...")."""
        from planner.deadline import OutOfTime, catch_interrupt, stop_requested, stopped
        from planner.graph.opgraph import OpGraph
        from planner.problems.problem import Problem
        from planner.sources import graph_of, is_problem_file

        if self.is_captured:
            return self
        if isinstance(self.model, Problem) or is_problem_file(self.model):
            return dataclasses.replace(self, is_captured=True)
        started = time.perf_counter()
        with catch_interrupt():
            try:
                graph, spec, devices, seconds = graph_of(
                    self.model, self.devices, deadline=self.hard, **self.source()
                )
                if stop_requested():  # a Ctrl-C while the devices were built
                    raise OutOfTime
            except OutOfTime:
                raise stopped(
                    "capturing the model", self.hard, started, "raise the time limit"
                ) from None
        if not isinstance(self.model, OpGraph):  # an OpGraph was checked when made
            check_graph_options(graph, self.memory.recompute, self.memory.master_weights)
        return self.captured(graph, devices, spec, seconds)

    def source(self) -> dict[str, Any]:
        """How the model is captured: `planner.sources`' keyword arguments."""
        return {k: getattr(self, k) for k in SOURCE_OPTIONS}

    def with_memory(self, **over: Any) -> PlanRequest:
        """This request with some memory options replaced (an "auto" option's attempt)."""
        return dataclasses.replace(self, memory=dataclasses.replace(self.memory, **over))

    def with_search(self, **over: Any) -> PlanRequest:
        """This request with some per-op search options replaced."""
        return dataclasses.replace(self, search=dataclasses.replace(self.search, **over))

    def within(self, deadline: Deadline) -> PlanRequest:
        """This request with a phase's share of its deadline (capture and build keep
        `hard`)."""
        return dataclasses.replace(self, deadline=deadline)


def overrun_deadline(deadline: Deadline) -> Deadline:
    """Where capture and build stop: `OVERRUN` times what is left of the deadline past it
    (its span, when the request is made), and at least `OVERRUN_SECONDS`."""
    if not math.isfinite(deadline.at):
        return deadline
    grace = max(OVERRUN * deadline.left(), OVERRUN_SECONDS)
    return Deadline(deadline.at + grace, deadline.limit, deadline.began)


def overrun_words(call: Deadline, used: float, what: str, attempt: bool = False) -> tuple[str, str]:
    """The head of the line that says the time limit of `call` ran out before the search
    began (`used` seconds on `what`, and what went before), and the advice: a time limit
    that would have left the search time."""
    spent = f"{used:.3g} s {what}"
    before = time.perf_counter() - call.began - used  # NaN for a deadline not made from a limit
    if before >= 0.01:
        earlier = ", earlier attempts" if attempt else ""
        spent = (
            f"{before:.3g} s before planning began (start-up, loading torch and the solver, "
            f"reading the input{earlier}) and {spent}"
        )
    whole = used + (before if before >= 0.01 else 0.0)
    head = f"the time limit of {call.limit:g} s ran out before the search began: {spent}"
    return (
        head,
        f"a time limit of {math.ceil(2 * whole):d} s or more would have left the search time",
    )


def checked_settings(
    backend: str, objective: str, backend_options: Any
) -> tuple[Any, Mapping[str, Any]]:
    """The backend class (None for "auto") and its validated settings: an unknown name or a
    bad setting is one BackendError before any work."""
    from planner.result import SolveOptions

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
