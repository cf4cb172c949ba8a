"""Asking a search to stop (what Ctrl-C does) returns its best answer so far."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backends import Limit, SolveOptions, Status, get_backend
from backends.base import ProgressLog, past, request_stop, stop_requested
from planner.problems.costtable import random_problem


def test_past_is_true_after_a_stop_request_even_before_the_deadline() -> None:
    from planner.deadline import clear_stop

    try:
        assert not past(time.perf_counter() + 60)
        request_stop()
        assert stop_requested()
        assert past(time.perf_counter() + 60)
    finally:
        clear_stop()


def test_a_stopped_search_returns_its_best_answer_marked_interrupted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 60 nodes of up to 12 choices with many edges: search cannot prove it in a second.
    import backends.exact.branch_and_bound as bb

    seen_stop = []  # every look at the clock that found the stop request

    def watched(deadline: float) -> bool:
        stop = past(deadline)
        if stop:
            seen_stop.append(deadline)
        return stop

    monkeypatch.setattr(bb, "past", watched)
    problem = random_problem(60, 12, seed=3, edge_prob=0.6, memory=False)
    timer = threading.Timer(0.5, request_stop)
    timer.start()
    result = get_backend("search").solve(problem, SolveOptions(time_limit=120))
    timer.cancel()
    assert result.limit is Limit.INTERRUPTED
    assert result.status is Status.FEASIBLE
    assert result.objective is not None
    # returned long before its 120 s limit: at its first look at the clock after the request
    assert len(seen_stop) == 1
    assert not stop_requested()  # the next solve starts clean


def test_progress_lines_are_throttled(caplog: pytest.LogCaptureFixture) -> None:
    log = ProgressLog("test", every=3600)
    with caplog.at_level(logging.INFO, logger="backends.test"):
        log(lambda: "first", force=True)
        log(lambda: "second")  # within the hour: not logged
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == ["first"]


@pytest.mark.slow
def test_ctrl_c_in_a_cpsat_plan_returns_its_best_answer(tmp_path: Path) -> None:
    """CP-SAT (ortools 9.15) catches SIGINT while it searches and leaves it at SIG_DFL below
    Python's view: the Ctrl-C after one of the backend's solves killed `plan` without a line
    or a plan. The backend sets Python's handler again after each solve."""
    from planner.problems.costtable import contest_problem, save_problem

    path = tmp_path / "c1500.json"
    save_problem(contest_problem(1500, seed=1), path)  # not proven within 30 s
    argv = ["plan", "--problem", str(path), "--backend", "cpsat", "--time-limit", "60"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner", *argv, "-v"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # wait for the neighbourhood rounds: solve after solve
            if line.startswith("backends.lns"):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-500:]
    assert "INTERRUPTED" in out


CPSAT_CTRL_C = """
import os, signal, threading
from ortools.sat.python import cp_model
from backends import SolveOptions, get_backend
from planner.deadline import catch_interrupt
from planner.problems.costtable import random_problem

solve = cp_model.CpSolver.solve


def pressed_during_the_solve(*args, **kwargs):  # Ctrl-C 0.5 s into CP-SAT's first search
    if not pressed:
        pressed.append(threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)))
        pressed[0].start()
    return solve(*args, **kwargs)


pressed = []
cp_model.CpSolver.solve = pressed_during_the_solve
problem = random_problem(300, 16, seed=0)  # CP-SAT proves nothing about it in 20 s
with catch_interrupt():
    result = get_backend("cpsat").solve(problem, SolveOptions(time_limit=20))
print(len(pressed), result.limit.value)
"""


def test_a_ctrl_c_during_a_cpsat_solve_stops_it() -> None:
    """CP-SAT's own SIGINT handler swallowed the Ctrl-C: the search ran to its limit and the
    phases after it went on as if nothing had been pressed."""
    out = subprocess.run(
        [sys.executable, "-c", CPSAT_CTRL_C], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.split()[-2:] == ["1", "INTERRUPTED"]
