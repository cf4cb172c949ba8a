"""Small things of the command lines (issue 42): negative-looking option values, how bounds
and the total print, plurals, evaluate's progress lines, the pipeline chart's legend."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from graphs import chain_cnn

import planner.cli.output as output
from planner.cli import main
from planner.hardware.presets import get_preset
from planner.pipeline.spec import Pipeline, PipelinedStrategy
from planner.pipeline.timeline import ChunkTimes, simulate_pipeline
from planner.problems.baselines import data_parallel
from planner.problems.problem import Problem


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- negative-looking values ----------------------------------------------------------------


@pytest.mark.parametrize(
    "option,value,says",
    [
        ("--memory-limit", "-1G", "a size cannot be negative, got '-1G'"),
        ("--memory-limit", "-1e9", "a size cannot be negative"),
        ("--table-budget", "-4GiB", "a size cannot be negative"),
        ("--time-limit", "-1e3", "expected a finite number of seconds > 0, got -1e3"),
        ("--time-limit", "-5", "expected a finite number of seconds > 0, got -5"),
        ("--seed", "-1", "expected an integer >= 0, got -1"),
        ("--headroom", "-0.1", "expected a fraction in [0, 1)"),
    ],
)
def test_a_negative_value_is_refused_as_a_value(
    capsys: pytest.CaptureFixture[str], option: str, value: str, says: str
) -> None:
    """argparse took -1G and -1e3 for options ("expected one argument")."""
    code, _, err = run(capsys, "plan", "lenet5", "--devices", "p100-1x4", option, value)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert f"argument {option}: {says}" in err, err


# -- the status line ------------------------------------------------------------------------


def _summary(**kw: Any) -> dict[str, Any]:
    base = {
        "status": "OPTIMAL",
        "limit": None,
        "objective_kind": "additive",
        "objective": 217039.0,
        "bound": 217038.999999783,
        "gap": 217039.0 / 217038.999999783 - 1,
        "backend": "toulbar2",
        "build_seconds": 0.5,
        "search_seconds": 1.0,
        "total_seconds": 1.6,
    }
    return {**base, **kw}


def _table_problem(cost: float) -> Problem:
    return Problem(
        "p", ("a", "b"), (np.array([cost, 2.0]), np.array([1.0, 3.0])), ((0, 1),),
        (np.zeros((2, 2)),),
    )  # fmt: skip


def test_an_exact_bound_prints_as_the_objective(capsys: pytest.CaptureFixture[str]) -> None:
    """A bound a rounding error below an integer objective of integer costs printed as
    217,038.999999783 with a gap of 1e-10%."""
    output.print_summary(_summary(), seconds=False, problem=_table_problem(1.0))
    out = capsys.readouterr().out
    assert "additive 217,039, bound 217,039, gap 0% (toulbar2;" in out, out


def test_bounds_print_with_sensible_digits() -> None:
    integer = _table_problem(1.0)
    assert output.format_bound(217038.999999783, 217039.0, integer) == "217,039"
    # fractional costs: the objective may truly be a hair above the bound
    assert output.format_bound(217038.999999783, 217039.0, _table_problem(1.5)) == "217,039"
    assert output.format_bound(216960.5, 217039.0, integer) == "216,960.5"
    assert output.format_bound(1549187758.25, 1549187760.0, integer) == "1,549,187,758.2"
    assert output.format_bound(0.0123456789012, 0.02, integer) == "0.0123456789"
    assert output.format_bound(216960.0, 217039.0, integer) == "216,960"
    assert output.format_bound(None, 217039.0, integer) == "-"


def test_the_total_counts_from_the_process_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was the plan call's total: the interpreter's start and torch's import (seconds)
    were left out."""
    age = output.process_seconds()
    # this process started before planner.cli was imported (/proc's clock ticks: 0.01 s)
    assert age >= time.time() - output.PROCESS_STARTED - 0.05
    monkeypatch.setattr(output, "process_seconds", lambda: 42.0)
    output.print_summary(_summary(), seconds=False, problem=_table_problem(1.0))
    assert "search 1 s, total 42 s)" in capsys.readouterr().out


# -- plurals, evaluate's progress, the chart ------------------------------------------------


@pytest.fixture
def one_stage_plan(tmp_path: Path) -> Path:
    graph = chain_cnn()
    strategy = data_parallel(graph, get_preset("p100-1x4"))
    pipe = Pipeline((0, len(graph.ops)), ((0, 1, 2, 3),), 1, "1f1b")
    path = tmp_path / "piped.json"
    PipelinedStrategy(strategy, pipe).save(path)
    return path


def test_one_stage_and_one_micro_batch_are_singular(
    capsys: pytest.CaptureFixture[str], one_stage_plan: Path
) -> None:
    code, out, err = run(capsys, "evaluate", str(one_stage_plan))
    assert code == 0, err
    assert "pipeline: 1 stage x 1 chunk, 1 micro-batch, 1f1b;" in out, out


def test_evaluate_says_what_it_does_when_a_phase_is_slow(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A 70B pipeline plan's evaluate said nothing for minutes: now a phase that lasts
    SLOW_PHASE seconds says what it does, without -v (here every phase is slow)."""
    import planner.logs

    path = tmp_path / "dp.json"
    data_parallel(chain_cnn(), get_preset("p100-1x4")).save(path)
    code, _, err = run(capsys, "evaluate", str(path))
    assert code == 0 and err == "", err  # a fast evaluate stays quiet
    monkeypatch.setattr(planner.logs, "SLOW_PHASE", 0.0)
    monkeypatch.setattr(planner.sim.simulator, "simulate", _slow(planner.sim.simulator.simulate))
    code, _, err = run(capsys, "evaluate", str(path))
    assert code == 0, err
    lines = err.splitlines()
    assert f"planner.evaluate: reading {path}: rebuilding its graph and devices ..." in lines
    assert any(line.startswith("planner.evaluate: simulating the step of") for line in lines)
    assert any(": done in " in line for line in lines), err


def _slow(fn: Any) -> Any:
    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.2)  # past SLOW_PHASE (0 here): the phase's timer has fired
        return fn(*args, **kwargs)

    return slow


@pytest.mark.parametrize("stages,micro_batches", [(1, 1), (4, 8)])
def test_the_chart_legend_stays_off_the_axis_label(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stages: int, micro_batches: int
) -> None:
    """The legend was anchored a fixed share of the axes' height below them: on a short
    chart (one stage) it covered the x-axis label."""
    from matplotlib.figure import Figure

    from planner.pipeline.chart import gantt

    drawn: list[tuple[Any, Any, str]] = []  # (legend's box, x label's box, title) as saved
    save = Figure.savefig

    def keep(fig: Figure, *args: Any, **kwargs: Any) -> None:
        save(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        (ax,) = fig.axes
        (legend,) = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
        label = ax.xaxis.label.get_window_extent(renderer)
        drawn.append((legend.get_window_extent(renderer), label, ax.get_title()))

    monkeypatch.setattr(Figure, "savefig", keep)
    chunk = ChunkTimes(1e-3, 2e-3, 1e-4, 1e-4, 5e-4)
    gantt(simulate_pipeline([chunk] * stages, "1f1b", stages, micro_batches), tmp_path / "t.png")
    ((legend, label, title),) = drawn
    assert not legend.overlaps(label)
    plural = "s" * (stages > 1)
    assert title.startswith(f"1f1b: {stages} stage{plural}, {micro_batches} micro-batch")
    assert ("micro-batches" in title) == (micro_batches > 1)
