"""A conformance suite that any pipeline search runs through (pytest), as
`backends.testing` is for the backends.

Subclass `PipelineConformance` in a test module and set `search_name` (a name in
`planner.registry.PIPELINE_REGISTRY`); every test below then runs against that search on a
small transformer and a small cluster (`small_problem`). The answer is checked, never
trusted: its pipelined strategy validates against the problem's graph and devices and uses
every device (stages x tensor x data), its memory fits when simulated again on every device,
its bound is at most its step, the same problem gives the same answer (here and in a fresh
process), a deadline already past or a Ctrl-C (`planner.deadline.request_stop`) before or
during the search returns with limit TIME or INTERRUPTED, a space where nothing fits is
status INFEASIBLE with a one-line message, and a bad setting is one BackendError line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pytest

from backends.settings import BackendSettings
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.memory import usable_memory
from planner.deadline import Deadline, catch_interrupt, clear_stop, request_stop
from planner.errors import BackendError
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.pipeline.problem import PipelineProblem
from planner.pipeline.spec import PipelinedStrategy, PipelineError, micro_batch_graph
from planner.pipeline.stages import simulate_pipelined
from planner.registry import get_pipeline_solver
from planner.result import Limit, PipelineResult, SolveOptions, Status, result_gap

__all__ = ["SMALL_MODEL", "PipelineConformance", "small_problem"]

RTOL = 1e-9
SMALL_MODEL: dict[str, Any] = {
    "batch": 8,
    "seq": 64,
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "vocab_size": 512,
}
NO_HANG_SECONDS = 120.0  # a search that has not returned by then hangs


def small_problem(
    devices: str = "p100-2x2", headroom: float = 0.0, model: Mapping[str, Any] | None = None
) -> PipelineProblem:
    """A GPT-2 of 4 small blocks (`SMALL_MODEL`) on `devices`, trained with Adam and fp32
    master weights, keeping `headroom` of each device's memory free."""
    graph = model_graph("gpt2", **(model or SMALL_MODEL))
    options = CostOptions(optimizer="adam", master_weights=True, headroom=headroom)
    return PipelineProblem(graph, get_preset(devices), options)


def _answer(result: PipelineResult) -> dict[str, Any]:
    """What must be the same in two runs: the layout, the step, the bound."""
    layout = dataclasses.asdict(result.layout) if result.layout is not None else None
    return {"layout": layout, "objective": result.objective, "bound": result.bound}


def _returns(fn: Callable[[], PipelineResult], seconds: float = NO_HANG_SECONDS) -> PipelineResult:
    """`fn()` run in a thread, failing the test if it has not returned within `seconds`."""
    out: list[PipelineResult] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
            failed.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"the search did not return within {seconds:g} s"
    if failed:
        raise failed[0]
    return out[0]


class PipelineConformance:
    search_name: ClassVar[str] = "pipeline"
    devices: ClassVar[str] = "p100-2x2"  # two hosts of two GPUs: stages, tensor and data
    time_limit: ClassVar[float] = 60.0
    extra: ClassVar[dict[str, Any]] = {}

    @classmethod
    def opts(cls, **kwargs: Any) -> SolveOptions:
        args: dict[str, Any] = {"time_limit": cls.time_limit, "extra": cls.extra}
        if "deadline" in kwargs:
            del args["time_limit"]
        return SolveOptions(**{**args, **kwargs})

    @classmethod
    def problem(cls) -> PipelineProblem:
        return small_problem(cls.devices)

    @pytest.fixture(scope="class")
    @classmethod
    def solved(cls) -> tuple[PipelineProblem, PipelineResult]:
        problem = cls.problem()
        return problem, get_pipeline_solver(cls.search_name).solve(problem, cls.opts())

    # ------------------------------------------------------------------------ the answer

    def check_valid(self, problem: PipelineProblem, result: PipelineResult) -> None:
        """A valid answer: the pipelined strategy of one micro-batch of the problem's graph
        on its devices, every device used once (stages x tensor x data)."""
        assert result.backend == self.search_name and result.has_solution
        planned, layout = result.planned, result.layout
        assert isinstance(planned, PipelinedStrategy) and layout is not None
        PipelinedStrategy(planned.strategy, planned.pipeline)  # validates again
        assert planned.strategy.devices == problem.devices
        m = planned.pipeline.micro_batches
        assert m == layout.micro_batches
        assert planned.strategy.graph == micro_batch_graph(problem.graph, m)
        n = problem.devices.num_devices
        assert layout.stages * layout.tensor * layout.context * layout.data == n
        groups = planned.pipeline.groups
        assert len(groups) == layout.stages
        assert sorted(d for g in groups for d in g) == list(range(n))
        assert result.strategy == planned.strategy
        assert result.cost_options is not None
        assert result.cost_options.recompute == layout.recompute
        assert result.cost_options.zero == layout.zero

    def test_the_answer_is_a_valid_layout(self, solved: tuple) -> None:
        problem, result = solved
        assert result.status is Status.FEASIBLE and result.limit is None
        self.check_valid(problem, result)

    def test_the_answer_fits_memory_and_is_its_own_simulation(self, solved: tuple) -> None:
        """The answer's peak is within the usable memory, simulated again on every device;
        its objective is that simulation's step (within two replicas' error when the answer
        was simulated on two replicas per stage)."""
        problem, result = solved
        usable = float(
            usable_memory(problem.devices, problem.options.headroom, problem.options.reserve).min()
        )
        assert result.peak_bytes is not None and result.peak_bytes <= usable
        planned = result.planned
        cm = CostModel(planned.strategy.graph, problem.devices, result.cost_options)
        again = simulate_pipelined(cm, planned)
        assert max(again.peak_bytes) <= usable * (1 + RTOL)
        every = result.stats.get("answer_simulated_on", "every device") == "every device"
        assert again.makespan == pytest.approx(result.objective, rel=RTOL if every else 0.15)

    def test_the_bound_is_at_most_the_step(self, solved: tuple) -> None:
        _, result = solved
        assert result.bound is not None and result.objective is not None
        assert 0 < result.bound <= result.objective
        assert result.gap == result_gap(result.objective, result.bound)
        assert result.objective_value() == result.objective

    # ------------------------------------------------------------------------ determinism

    def test_the_same_problem_gives_the_same_answer(self, solved: tuple) -> None:
        problem, result = solved
        again = get_pipeline_solver(self.search_name).solve(problem, self.opts())
        assert _answer(again) == _answer(result)

    def test_the_same_answer_in_a_fresh_process(self, solved: tuple) -> None:
        _, result = solved
        code = (
            "import dataclasses, json;"
            "from backends.pipeline.testing import small_problem;"
            "from planner.registry import get_pipeline_solver;"
            "from planner.result import SolveOptions;"
            f"r=get_pipeline_solver({self.search_name!r}).solve(small_problem({self.devices!r}),"
            f"SolveOptions(time_limit={self.time_limit!r}, extra={self.extra!r}));"
            "print(json.dumps({'layout': dataclasses.asdict(r.layout), "
            "'objective': r.objective, 'bound': r.bound}))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
        )
        assert json.loads(out.stdout) == json.loads(json.dumps(_answer(result)))

    # ------------------------------------------------------------------------ limits

    def check_stopped(self, problem: PipelineProblem, result: PipelineResult, limit: Limit) -> None:
        assert result.limit is limit
        assert result.status in (Status.FEASIBLE, Status.NO_SOLUTION)
        if result.status is Status.FEASIBLE:
            self.check_valid(problem, result)
        else:
            assert not result.has_solution and result.objective is None

    def test_a_deadline_already_past_returns_at_once(self) -> None:
        problem = self.problem()
        search = get_pipeline_solver(self.search_name)
        past = Deadline(time.perf_counter() - 1.0, 1.0)
        result = _returns(lambda: search.solve(problem, self.opts(deadline=past)))
        self.check_stopped(problem, result, Limit.TIME)

    def test_a_ctrl_c_before_the_search_returns_interrupted(self) -> None:
        problem = self.problem()
        search = get_pipeline_solver(self.search_name)
        with catch_interrupt():  # the caller's: the stop stays asked through the solve
            request_stop()
            result = search.solve(problem, self.opts())
        self.check_stopped(problem, result, Limit.INTERRUPTED)

    def test_a_ctrl_c_during_the_search_returns_interrupted(self) -> None:
        problem = self.problem()
        search = get_pipeline_solver(self.search_name)
        timer = threading.Timer(0.05, request_stop)
        try:
            timer.start()  # the search runs in a thread: nothing clears the stop there
            result = _returns(lambda: search.solve(problem, self.opts()))
        finally:
            timer.cancel()
            clear_stop()
        self.check_stopped(problem, result, Limit.INTERRUPTED)

    # ------------------------------------------------------------------------ refusals

    def test_nothing_fits_is_a_status_with_a_one_line_message(self) -> None:
        problem = small_problem(self.devices, headroom=0.9999)
        result = get_pipeline_solver(self.search_name).solve(problem, self.opts())
        assert result.status is Status.INFEASIBLE and result.limit is None
        assert not result.has_solution and result.planned is None and result.objective is None
        assert result.message and "\n" not in result.message
        with pytest.raises(BackendError):
            result.objective_value()

    def test_another_problem_is_refused_in_one_line(self) -> None:
        from planner.problems.costtable import random_problem

        with pytest.raises(BackendError, match="PipelineProblem") as info:
            get_pipeline_solver(self.search_name).solve(random_problem(3, 2, seed=0), self.opts())  # type: ignore[arg-type]
        assert "\n" not in str(info.value)

    def test_a_model_without_blocks_is_not_a_problem(self) -> None:
        with pytest.raises(PipelineError, match="numbered blocks") as info:
            PipelineProblem(model_graph("lenet5", batch=8), get_preset(self.devices), CostOptions())
        assert "\n" not in str(info.value)

    # ------------------------------------------------------------------------ settings

    def test_settings_are_declared_and_the_defaults_validate(self) -> None:
        search = get_pipeline_solver(self.search_name)
        st = type(search.settings(SolveOptions()))
        assert issubclass(st, BackendSettings) and dataclasses.is_dataclass(st)
        assert st.__dataclass_params__.frozen  # type: ignore[attr-defined]
        defaults = st()
        assert search.settings(SolveOptions()) == defaults == st.of({}) == st.of(dict(defaults))
        assert search.settings(SolveOptions(extra=defaults)) == defaults

    def test_a_bad_setting_is_one_error_naming_the_valid_ones(self) -> None:
        search = get_pipeline_solver(self.search_name)
        names = list(search.settings(SolveOptions()))
        listing = f"its settings are: {', '.join(names)}"
        problem = self.problem()
        bad: list[dict[str, Any]] = [{"tyop": 1}, *({name: object()} for name in names)]

        def attempt(options: SolveOptions) -> PipelineResult:
            return _returns(lambda: search.solve(problem, options))

        for extra in bad:
            with pytest.raises(BackendError) as info:
                attempt(SolveOptions(time_limit=1, extra=extra))
            message = str(info.value)
            assert "\n" not in message and message.endswith(f"; {listing}"), message
            assert repr(next(iter(extra))) in message, message

    def test_the_result_is_a_solve_result_with_the_shared_gap(self, solved: tuple) -> None:
        _, result = solved
        assert isinstance(result, PipelineResult)
        assert dataclasses.is_dataclass(result) and math.isfinite(result.objective_value())
        with pytest.raises(dataclasses.FrozenInstanceError):
            result.objective = 0.0  # type: ignore[misc]
