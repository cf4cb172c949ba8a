"""A conformance suite that any backend runs through (pytest).

Subclass `BackendConformance` in a test module and set `backend_name`; every test below then
runs against that backend. The reference optimum comes from brute force, and every answer is
re-scored by planner's evaluators, never trusted. The gap tolerance (`SolveOptions.
gap_tolerance`): with 0 an exact backend's OPTIMAL answer agrees with brute force to RTOL;
with the default (1e-4), or a large one, an OPTIMAL answer is within that tolerance of the
optimum, its bound at most the optimum and its gap at most the tolerance. The backend's settings (`settings_type`)
are checked too: the defaults validate, an unknown or ill-typed setting is one BackendError
line that lists the valid names, and `given_settings` (default: `extra`) round-trip.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys
import warnings
from typing import Any, ClassVar

import numpy as np
import pytest

from backends import BackendError, SolveOptions, SolveResult, Status, get_backend
from backends.base import Backend, BackendSettings, evaluate_objective
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.hardware.presets import get_preset
from planner.problems.costtable import brute_force, random_problem
from planner.problems.evaluate import memory_feasible
from planner.problems.problem import Problem, build_problem

RTOL = 1e-9


def tiny_cnn() -> OpGraph:
    """A small CNN with a branch and a concat: enough structure for every backend."""
    attrs = Op.make_attrs
    conv = attrs({"kernel": (3, 3), "stride": (1, 1), "padding": (1, 1)})
    t4 = Tensor.of(sample=8, channel=8, height=8, width=8)
    return OpGraph(
        "tiny_cnn",
        (
            Op("x", "input", (), Tensor.of(sample=8, channel=3, height=8, width=8)),
            Op(
                "a",
                "conv2d",
                ("x",),
                t4,
                (Param("w", (8, 3, 3, 3)),),
                2 * 8 * 8 * 64 * 27,
                attrs=conv,
            ),
            Op(
                "b",
                "conv2d",
                ("a",),
                t4,
                (Param("w", (8, 8, 3, 3)),),
                2 * 8 * 8 * 64 * 72,
                attrs=conv,
            ),
            Op(
                "c",
                "pool2d",
                ("a",),
                t4,
                attrs=attrs({"kernel": (3, 3), "stride": (1, 1), "padding": (1, 1)}),
            ),
            Op(
                "cat",
                "concat",
                ("b", "c"),
                Tensor.of(sample=8, channel=16, height=8, width=8),
                attrs=attrs({"dim": "channel", "offsets": (0, 8)}),
            ),
            Op(
                "fc",
                "linear",
                ("cat",),
                Tensor.of(sample=8, channel=16),
                (Param("w", (16, 1024)),),
                2 * 8 * 16 * 1024,
            ),
            Op("loss", "softmax", ("fc",), Tensor.of(sample=8, channel=16)),
        ),
    )


def reference_problems() -> list[Problem]:
    """Small problems with brute-forceable optima: cost tables and a DNN."""
    problems = [random_problem(6, 4, seed=s, memory=s % 2 == 0) for s in range(6)]
    problems.append(build_problem(tiny_cnn(), get_preset("p100-1x2"), max_configs=4))
    return problems


INF = math.inf


def table_problem(
    name: str,
    costs: list[list[float]],
    edges: dict[tuple[int, int], list[list[float]]] | None = None,
    usages: list[list[float]] | None = None,
    intervals: list[tuple[int, int]] | None = None,
    limit: float | None = None,
) -> Problem:
    """A cost-table problem written out by hand (inf: forbidden; one memory pool)."""
    edges = edges or {}
    memory = usages is not None
    return Problem(
        name=name,
        node_names=tuple(str(i) for i in range(len(costs))),
        node_cost=tuple(np.array(c, dtype=np.float64) for c in costs),
        edges=tuple(edges),
        edge_cost=tuple(np.array(t, dtype=np.float64) for t in edges.values()),
        usage=tuple(np.array(u, dtype=np.float64).reshape(-1, 1) for u in usages)
        if usages is not None
        else None,
        intervals=np.array(intervals, dtype=np.int64).reshape(-1, 2) if memory else None,
        usage_limit=np.array([limit], dtype=np.float64) if memory and limit is not None else None,
    )


def degenerate_problems() -> list[Problem]:
    """Tiny and degenerate cost tables (issue 42): no nodes, one strategy per node, a single
    node, no edges, every choice forbidden but one, every choice forbidden, an edge whose one
    allowed pair is the answer, zero costs, a memory limit that one answer meets and one that
    none meets. Brute force gives each optimum (inf: infeasible)."""
    both = [(0, 1), (0, 1)]
    return [
        table_problem("no-nodes", []),
        table_problem("single-node", [[5, 3, 9]]),
        table_problem("single-node-single-strategy", [[7]]),
        table_problem(
            "single-strategy-everywhere", [[7], [3], [0]], {(0, 1): [[2]], (1, 2): [[0]]}
        ),
        table_problem(
            "single-strategy-on-an-edge", [[7], [1, 2]], {(0, 1): [[0, 0]]}, [[1], [1, 1]], both, 10
        ),
        table_problem("no-edges", [[4, 2], [1, 3, 0], [6]]),
        table_problem("no-edges-with-memory", [[4, 2], [1, 3]], None, [[1, 5], [2, 1]], both, 4),
        table_problem(
            "all-forbidden-but-one",
            [[INF, 5, INF], [INF, INF, 2]],
            {(0, 1): [[1, 2, 3], [4, 5, 6], [7, 8, 9]]},
        ),
        table_problem(
            "zero-costs", [[0, 0], [0, 0], [0]], {(0, 1): [[0, 0], [0, 0]], (2, 1): [[0, 0]]}
        ),
        table_problem(
            "zero-costs-with-memory",
            [[0, 0], [0, 0]],
            {(0, 1): [[0, 0], [0, 0]]},
            [[0, 0], [0, 0]],
            both,
            0,
        ),
        table_problem("one-allowed-pair", [[1, 5], [1, 5]], {(0, 1): [[INF, INF], [INF, 2]]}),
        table_problem(
            "parallel-edges",
            [[1, 2], [3, 1]],
            {(0, 1): [[0, 4], [4, 0]], (1, 0): [[INF, 1], [2, 0]]},
        ),
        table_problem(
            "one-answer-fits",
            [[9, 1], [9, 1]],
            {(0, 1): [[0, 1], [1, 0]]},
            [[1, 3], [1, 3]],
            both,
            2,
        ),
        table_problem("one-answer-fits-exactly", [[9, 1, 4]], None, [[5, 6, 7]], [(0, 1)], 5),
        table_problem(
            "never-live",
            [[9, 1], [2]],
            {(0, 1): [[0], [0]]},
            [[1, 100], [100]],
            [(0, 1), (1, 1)],
            1,
        ),
        # infeasible:
        table_problem(
            "the-pair-that-fits-is-forbidden",
            [[0, 0], [0, 0, 0]],
            {(1, 0): [[0, 0], [0, 0], [0, INF]]},
            [[1, 0], [1, 1, 0]],
            both,
            0,
        ),
        table_problem(
            "single-strategy-forbidden",
            [[INF], [1, 2]],
            {(0, 1): [[0, 0]]},
            [[1], [1, 1]],
            both,
            10,
        ),
        table_problem("all-forbidden", [[INF, INF], [1, 2]], {(0, 1): [[0, 0], [0, 0]]}),
        table_problem("single-node-all-forbidden", [[INF, INF]]),
        table_problem("no-allowed-pair", [[1, 2], [3]], {(0, 1): [[INF], [INF]]}),
        table_problem(
            "nothing-fits", [[9, 1], [9, 1]], {(0, 1): [[0, 1], [1, 0]]}, [[2, 3], [1, 3]], both, 2
        ),
        table_problem("nothing-fits-one-node", [[1, 2]], None, [[3, 4]], [(0, 1)], 2),
    ]


DEGENERATE_SECONDS = 2.0  # the time limit of a degenerate table's solve (they are tiny)


def check_optimal(result: SolveResult, value: float, tolerance: float, where: str) -> None:
    """An OPTIMAL `result` against the brute-force optimum `value`: proven within the gap
    `tolerance` (its gap at most it, its bound at most the optimum), and with tolerance 0
    the optimum itself (RTOL)."""
    objective = result.objective_value()
    assert objective <= value * (1 + tolerance) * (1 + RTOL) + 1e-12, where
    assert objective >= value * (1 - RTOL) - 1e-12, where
    if tolerance == 0:
        assert math.isclose(objective, value, rel_tol=RTOL, abs_tol=1e-12), where
    if result.bound is not None:
        assert result.bound <= value * (1 + RTOL) + 1e-12, where
        assert result.gap is not None and result.gap <= tolerance + RTOL, where


def check_answer(name: str, problem: Problem, options: SolveOptions) -> None:
    """Solve a small cost-table `problem` with backend `name` and check the answer against
    brute force: no exception (nor numpy warning) but a refusal `can_run` announced; an exact
    backend proves the optimum (OPTIMAL: within `options.gap_tolerance`, `check_optimal`) or
    that nothing is valid (INFEASIBLE); any backend's answer is valid, re-scores to the
    objective it reported and never beats the optimum, its bound never exceeds it; with
    nothing valid, no answer (INFEASIBLE or NO_SOLUTION)."""
    backend = get_backend(name)
    reason = backend.can_run(problem, options)
    if reason is not None:
        with pytest.raises(BackendError):
            backend.solve(problem, options)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's inf - inf and the like
        result = backend.solve(problem, options)
    best, value = brute_force(problem)
    where = f"{name} on {problem.name}"
    assert result.backend == name and isinstance(result.status, Status), where
    if result.choices is None:
        if best is not None:
            assert not backend.exact and result.status is Status.NO_SOLUTION, where
        elif backend.exact:
            assert result.status is Status.INFEASIBLE, where
        else:
            assert result.status in (Status.INFEASIBLE, Status.NO_SOLUTION), where
        return
    assert best is not None, f"{where}: an answer where none is valid"
    assert memory_feasible(problem, result.choices), where
    rescored = evaluate_objective(problem, result.choices, options.objective)
    objective = result.objective_value()
    assert math.isclose(objective, rescored, rel_tol=RTOL), where
    own = result.stats.get("reported_objective")
    if own is not None:
        assert math.isclose(own, rescored, rel_tol=RTOL, abs_tol=1e-9), where
    assert result.status in (Status.OPTIMAL, Status.FEASIBLE), where
    assert objective >= value * (1 - RTOL) - 1e-12, where
    if backend.exact or result.status is Status.OPTIMAL:
        assert result.status is Status.OPTIMAL, where
        check_optimal(result, value, options.gap_tolerance, where)
    if result.bound is not None:
        assert result.bound <= value * (1 + RTOL) + 1e-12, where


class BackendConformance:
    backend_name: ClassVar[str]
    objective: ClassVar[str] = "additive"
    time_limit: ClassVar[float] = 20.0
    extra: ClassVar[dict[str, Any]] = {}
    # non-default settings, in their typed form (tuples, settings objects), for the round
    # trip; None: `extra`
    given_settings: ClassVar[dict[str, Any] | None] = None

    @classmethod
    def opts(cls, **kwargs: Any) -> SolveOptions:
        args = {"objective": cls.objective, "time_limit": cls.time_limit, "extra": cls.extra}
        return SolveOptions(**{**args, **kwargs})

    @pytest.fixture(scope="class")
    @classmethod
    def solved(cls) -> list[tuple[Problem, object]]:
        """Every reference problem the backend says it can run, with its answer (the
        default gap tolerance)."""
        return cls._solve_references(cls.opts(seed=0))

    @pytest.fixture(scope="class")
    @classmethod
    def solved_exactly(cls) -> list[tuple[Problem, object]]:
        """The same with gap tolerance 0: an exact backend's answer is the optimum."""
        return cls._solve_references(cls.opts(seed=0, gap_tolerance=0.0))

    @classmethod
    def _solve_references(cls, opts: SolveOptions) -> list[tuple[Problem, object]]:
        backend = get_backend(cls.backend_name)
        runnable = [p for p in reference_problems() if backend.can_run(p, opts) is None]
        assert runnable, f"{cls.backend_name} can run none of the reference problems"
        return [(p, backend.solve(p, opts)) for p in runnable]

    def test_answers_are_valid_and_rescored(self, solved: list) -> None:
        for problem, result in solved:
            assert result.backend == self.backend_name
            assert isinstance(result.status, Status)
            if result.choices is None:
                assert result.status in (Status.NO_SOLUTION, Status.INFEASIBLE)
                continue
            value = evaluate_objective(problem, result.choices, self.objective)
            assert math.isclose(result.objective, value, rel_tol=RTOL)
            assert memory_feasible(problem, result.choices)
            assert result.status in (Status.OPTIMAL, Status.FEASIBLE)

    def test_the_anytime_trace_ends_at_the_answer(self, solved: list) -> None:
        """`stats["trace"]` (`backends.trace`): better answers falling and better bounds
        rising over non-decreasing times, the last answer the re-scored objective, the last
        bound the result's, no bound above the answer."""
        for problem, result in solved:
            trace = result.stats["trace"]
            for points, sign in ((trace["incumbent"], 1.0), (trace["bound"], -1.0)):
                times = [t for t, _ in points]
                assert times == sorted(times) and all(t >= 0 for t in times), problem.name
                values = [sign * v for _, v in points]
                assert all(a > b for a, b in itertools.pairwise(values)), problem.name
            if result.objective is not None:
                assert trace["incumbent"][-1][1] == result.objective, problem.name
                assert all(v <= result.objective * (1 + RTOL) for _, v in trace["bound"])
            else:
                assert trace["incumbent"] == [], problem.name
            if result.bound is not None and math.isfinite(result.bound):
                assert trace["bound"][-1][1] == result.bound, problem.name

    def test_never_below_the_optimum(self, solved: list) -> None:
        exact = get_backend(self.backend_name).exact
        for problem, result in solved:
            best, value = brute_force(problem)
            if best is None:
                assert result.choices is None
                continue
            if result.choices is None:
                assert not exact, f"{self.backend_name} found nothing on {problem.name}"
                continue
            assert result.objective >= value * (1 - RTOL) - 1e-12
            if result.status is Status.OPTIMAL:  # within the default tolerance
                check_optimal(result, value, SolveOptions().gap_tolerance, problem.name)
            if result.bound is not None:
                assert result.bound <= value * (1 + RTOL) + 1e-12

    def test_exact_backends_prove_the_optimum(self, solved: list) -> None:
        if not get_backend(self.backend_name).exact:
            pytest.skip("not an exact backend")
        for problem, result in solved:
            best, _ = brute_force(problem)
            expected = Status.INFEASIBLE if best is None else Status.OPTIMAL
            assert result.status is expected, problem.name
            assert result.stats["gap_tolerance"] == SolveOptions().gap_tolerance

    def test_with_tolerance_zero_optima_agree_with_brute_force(self, solved_exactly: list) -> None:
        """Gap tolerance 0: an OPTIMAL answer (every answer of an exact backend) is the
        brute-force optimum to RTOL, its bound too."""
        exact = get_backend(self.backend_name).exact
        for problem, result in solved_exactly:
            best, value = brute_force(problem)
            if best is None or result.choices is None:
                assert best is None or not exact, problem.name
                continue
            assert result.stats["gap_tolerance"] == 0.0
            if exact:
                assert result.status is Status.OPTIMAL, problem.name
            if result.status is Status.OPTIMAL:
                check_optimal(result, value, 0.0, problem.name)
                if result.bound is not None:
                    assert math.isclose(result.bound, value, rel_tol=RTOL, abs_tol=1e-12)

    def test_a_large_gap_tolerance_is_met_and_said(self) -> None:
        """Gap tolerance 0.5 on problems with several answers: an exact backend still says
        OPTIMAL, now only within 50% of the optimum (its bound proves it, its gap says how
        far it got); any OPTIMAL answer is within the tolerance."""
        backend = get_backend(self.backend_name)
        tolerance = 0.5
        for seed in range(4):
            problem = random_problem(7, 4, seed=10 + seed, memory=seed % 2 == 1)
            opts = self.opts(seed=0, gap_tolerance=tolerance)
            if backend.can_run(problem, opts) is not None:
                continue
            result = backend.solve(problem, opts)
            best, value = brute_force(problem)
            assert best is not None  # random tables with a loose limit: something fits
            assert result.stats["gap_tolerance"] == tolerance
            if backend.exact:
                assert result.status is Status.OPTIMAL, problem.name
            if result.status is Status.OPTIMAL:
                check_optimal(result, value, tolerance, problem.name)

    def test_dnn_answers_come_with_a_strategy(self, solved: list) -> None:
        problem, result = solved[-1]
        assert problem.is_dnn and result.strategy is not None
        assert problem.choices_of(result.strategy) == result.choices

    def test_same_seed_same_answer(self) -> None:
        backend = get_backend(self.backend_name)
        problem = random_problem(12, 5, seed=7, memory=False)
        opts = self.opts(seed=3)
        assert backend.solve(problem, opts).choices == backend.solve(problem, opts).choices

    def test_same_seed_in_a_fresh_process(self) -> None:
        code = (
            "import json;from backends import get_backend, SolveOptions;"
            "from planner.problems.costtable import random_problem;"
            f"r=get_backend({self.backend_name!r}).solve(random_problem(12, 5, seed=7, memory=False),"
            f"SolveOptions(objective={self.objective!r}, time_limit={self.time_limit}, seed=3,"
            f"extra={self.extra!r}));"
            "print(json.dumps(r.choices))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        )
        backend = get_backend(self.backend_name)
        here = backend.solve(random_problem(12, 5, seed=7, memory=False), self.opts(seed=3)).choices
        assert json.loads(out.stdout) == (list(here) if here is not None else None)

    def test_short_time_limit_still_answers_validly(self) -> None:
        backend = get_backend(self.backend_name)
        problem = random_problem(60, 8, seed=1, memory=False)
        result = backend.solve(problem, self.opts(time_limit=0.2))
        assert result.status in (Status.OPTIMAL, Status.FEASIBLE, Status.NO_SOLUTION)
        if result.choices is not None:
            assert math.isfinite(result.objective_value())

    def test_impossible_memory_limit_is_a_status(self) -> None:
        problem = random_problem(6, 4, seed=2, memory=True)
        assert problem.usage is not None
        assert problem.intervals is not None
        live = problem.intervals[:, 1] > problem.intervals[:, 0]
        need = max(float(np.min(u)) for u, ok in zip(problem.usage, live, strict=True) if ok)
        assert need > 0
        tight = dataclasses.replace(problem, usage_limit=np.array([need * 0.5]))
        backend = get_backend(self.backend_name)
        reason = backend.can_run(tight, self.opts())
        if reason is not None:  # a backend may refuse memory limits, saying so
            assert "memory" in reason
            with pytest.raises(BackendError, match="memory"):
                backend.solve(tight, self.opts())
            return
        result = backend.solve(tight, self.opts())
        assert result.choices is None
        assert result.status in (Status.INFEASIBLE, Status.NO_SOLUTION)

    @pytest.mark.parametrize("problem", degenerate_problems(), ids=lambda p: p.name)
    def test_degenerate_tables(self, problem: Problem) -> None:
        """`degenerate_problems`: the right status and answer, never an exception."""
        seconds = min(self.time_limit, DEGENERATE_SECONDS)
        check_answer(self.backend_name, problem, self.opts(seed=0, time_limit=seconds))

    def test_refuses_a_cost_table_problem_where_it_needs_a_dnn(self) -> None:
        backend = self._backend()
        assert "makespan" in backend.needs_dnn_for  # the makespan simulates a DNN's strategy
        problem = random_problem(4, 3, seed=0, memory=False)
        assert not problem.is_dnn
        for objective in backend.objectives:
            reason = backend.can_run(problem, self.opts(objective=objective))
            if objective not in backend.needs_dnn_for:
                assert reason is None or "DNN" not in reason
                continue
            assert reason is not None and "needs a problem built from a DNN" in reason
            assert "cost-table problem" in reason and "\n" not in reason
            with pytest.raises(BackendError, match="needs a problem built from a DNN"):
                backend.solve(problem, self.opts(objective=objective))

    def test_unsupported_objective_is_an_error(self) -> None:
        backend = get_backend(self.backend_name)
        missing = [o for o in ("additive", "makespan") if o not in backend.objectives]
        if not missing:
            pytest.skip("supports every objective")
        with pytest.raises(BackendError, match="objective"):
            backend.solve(random_problem(4, 3, seed=0), self.opts(objective=missing[0]))

    # ------------------------------------------------------------------------ settings

    @classmethod
    def _backend(cls) -> Backend[Any]:
        backend = get_backend(cls.backend_name)
        assert isinstance(backend, Backend)
        return backend

    @classmethod
    def _listing(cls) -> str:
        names = list(cls._backend().settings_type())
        return f"its settings are: {', '.join(names)}" if names else "it takes no settings"

    def test_settings_are_declared_and_the_defaults_validate(self) -> None:
        backend = self._backend()
        st = backend.settings_type
        assert issubclass(st, BackendSettings) and dataclasses.is_dataclass(st)
        assert st.__dataclass_params__.frozen  # type: ignore[attr-defined]
        defaults = st()
        assert st.of({}) == defaults == backend.settings(SolveOptions())
        assert st.of(defaults) == defaults == st.of(dict(defaults))
        assert isinstance(backend.settings(self.opts()), st)

    def test_an_unknown_setting_is_one_error_naming_the_valid_ones(self) -> None:
        backend = self._backend()
        problem = random_problem(4, 3, seed=0)
        with pytest.raises(BackendError) as info:
            backend.solve(problem, self.opts(extra={**self.extra, "tyop": 1}))
        message = str(info.value)
        assert "\n" not in message
        assert message == f"backend {self.backend_name!r} has no setting 'tyop'; {self._listing()}"

    def test_an_ill_typed_setting_is_one_error_naming_it(self) -> None:
        backend = self._backend()
        names = list(backend.settings_type())
        if not names:
            pytest.skip("the backend takes no settings")
        problem = random_problem(4, 3, seed=0)
        for name in names:
            with pytest.raises(BackendError) as info:
                backend.solve(problem, self.opts(extra={name: object()}))
            message = str(info.value)
            assert "\n" not in message
            assert message.startswith(f"backend {self.backend_name!r} setting {name!r} must be ")
            assert message.endswith(f"; {self._listing()}")

    def test_settings_round_trip(self) -> None:
        """The settings object of `SolveOptions(extra=given)` holds what was given, gives it
        back as a mapping, and is what `solve` hands to the search."""
        backend = self._backend()
        st = backend.settings_type
        given = self.extra if self.given_settings is None else self.given_settings
        settings = backend.settings(SolveOptions(extra=given))
        assert settings == st(**given) == st.of(given)
        assert {k: settings[k] for k in given} == given
        assert st.of(dict(settings)) == settings == backend.settings(SolveOptions(extra=settings))

        class Seen(Exception):
            pass

        seen: list[BackendSettings] = []

        def record(problem: Problem, options: SolveOptions, settings: BackendSettings) -> Any:
            seen.append(settings)
            raise Seen

        opts = self.opts(extra=given)
        problem = next(p for p in reference_problems() if backend.can_run(p, opts) is None)
        backend._solve = record  # type: ignore[method-assign]  # this instance only
        with pytest.raises(Seen):
            backend.solve(problem, opts)
        assert seen == [settings]
