"""Ctrl-C (SIGINT) at any point of a command line: one line, status 130, no traceback, and what
the command promises on an interrupt (the best plan so far; the comparison's finished cases).

A signal "during an import" is sent by the child to itself just before it imports a given
module (a hook on `builtins.__import__`), so it lands inside the import chain whatever the
machine's load; the others are sent after a line that says where the child is.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from planner.problems.costtable import random_problem, save_problem
from tests.processes import session_processes, wait_for

ROOT = Path(__file__).resolve().parents[1]

# Runs `python -m MODULE ARGS...` (argv[2:]) and sends itself SIGINT just before the first
# `import TARGET` statement (argv[1]) executes.
INTERRUPT_AT_IMPORT = """
import builtins, os, runpy, signal, sys
target, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
real = builtins.__import__
def interrupting(name, *args, **kwargs):
    if name == target:
        builtins.__import__ = real
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *args, **kwargs)
builtins.__import__ = interrupting
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def interrupted_at_import(target: str, module: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", INTERRUPT_AT_IMPORT, target, module, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def assert_one_line(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "error: interrupted\n", proc.stderr


@pytest.mark.parametrize(
    "module,argv",
    [
        ("planner", ["plan", "alexnet", "--devices", "p100-1x4"]),
        ("runtime.run", ["plan.json", "--steps", "2"]),
        ("experiments.compare", ["--models", "lenet5"]),
    ],
)
def test_ctrl_c_while_the_command_imports_is_one_line(module: str, argv: list[str]) -> None:
    """numpy is imported by the command's own imports, before `main` can catch anything."""
    assert_one_line(interrupted_at_import("numpy", module, *argv))


@pytest.mark.slow
def test_ctrl_c_while_runtime_run_imports_torch_is_one_line(tmp_path: Path) -> None:
    """runtime's package used to import torch (seconds) before runtime.run's main started."""
    assert_one_line(interrupted_at_import("torch", "runtime.run", str(tmp_path / "p.json")))


def _popen(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )


def _wait_for_line(stream: Any, text: str) -> None:
    for line in stream:
        if text in line:
            return
    raise AssertionError(f"the child ended without printing {text!r}")


def test_an_interrupted_plan_says_so_once(tmp_path: Path) -> None:
    """The first Ctrl-C during a search: planner.deadline's warning says it, the status line
    says (INTERRUPTED), and the plan written is the best so far; no line repeats the
    warning (it was 'interrupted: this is the best answer found so far' again)."""
    problem = random_problem(60, 12, seed=3, edge_prob=0.6, memory=False)
    save_problem(problem, tmp_path / "p.json")
    out = tmp_path / "best.json"
    proc = _popen(
        "-m", "planner", "plan", "--problem", str(tmp_path / "p.json"), "--backend", "search",
        "--time-limit", "120", "-o", str(out), "-v",
    )  # fmt: skip
    try:
        _wait_for_line(proc.stderr, "searching with search")
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    said = [line for line in stderr.replace(str(out), "F").splitlines() if "interrupted" in line]
    assert len(said) == 1, stderr
    assert f"plan written to {out} (the best answer found so far)" in stderr
    assert "FEASIBLE (INTERRUPTED)" in stdout
    assert json.loads(out.read_text())["limit"] == "INTERRUPTED"


@pytest.fixture(scope="module")
def lenet_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from planner.graph.models import ModelSpec
    from planner.hardware.presets import get_preset
    from planner.problems.baselines import owt

    lenet = ModelSpec("lenet5", 8, {})
    path = tmp_path_factory.mktemp("plans") / "lenet-owt.json"
    owt(lenet.graph(), get_preset("cpu-local-2")).save(path, model=lenet.to_json())
    return path


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_mid_run_stops_every_worker(lenet_plan: Path) -> None:
    """Sent while both workers train: one line, 130, and every process of the run ends."""
    proc = _popen("-m", "runtime.run", str(lenet_plan), "--steps", "100000", "--timeout", "60")

    def training() -> bool:  # the forkserver and the two workers it forked
        return sum("forkserver" in _cmdline(p) for p in session_processes(proc.pid)) >= 3

    try:
        assert wait_for(training, 120), "the workers did not start"
        time.sleep(1.0)  # into the steps
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert err == "error: interrupted\n", err
        assert wait_for(lambda: not session_processes(proc.pid), 30)
    finally:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.slow
def test_an_interrupted_comparison_keeps_its_finished_cases(tmp_path: Path) -> None:
    """Ctrl-C in the second case, after CP-SAT ran in the first: CP-SAT had left SIGINT at
    SIG_DFL, so the signal killed the comparison without a line, a table or results.json.
    Now the finished case is printed and saved (marked partial), status 130."""
    proc = _popen(
        "-m", "experiments.compare", "--models", "lenet5", "--presets", "p100-1x2", "p100-1x4",
        "--backends", "mcmc", "cpsat", "--time-limit", "3", "--out", str(tmp_path), "--no-plot",
    )  # fmt: skip
    try:
        _wait_for_line(proc.stdout, "done lenet5 on p100-1x2")
        os.killpg(proc.pid, signal.SIGINT)  # during the second case's mcmc (3 s)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stdout + stderr
    assert "lenet5 on p100-1x2: 2 devices" in stdout  # its table
    assert "(partial: 1 of 2 cases)" in " ".join(stdout.split())  # rich wraps long lines
    assert stderr.splitlines()[-1] == "error: interrupted after 1 case(s)", stderr
    (folder,) = tmp_path.iterdir()
    data = json.loads((folder / "results.json").read_text())
    assert data["partial"] is True and data["cases_asked"] == 2
    assert [c["preset"] for c in data["cases"]] == ["p100-1x2"]


def test_a_second_ctrl_c_in_a_comparison_still_saves_the_cases_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second Ctrl-C (KeyboardInterrupt) during the second case: the first case's table and
    results.json (partial) are still written; it was 'error: interrupted' and nothing."""
    import experiments.compare as compare

    real = compare._solve_row

    def interrupted(model: str, preset: str, *args: Any) -> Any:
        if preset == "p100-1x4":
            raise KeyboardInterrupt
        return real(model, preset, *args)

    monkeypatch.setattr(compare, "_solve_row", interrupted)
    argv = ["--models", "lenet5", "--presets", "p100-1x2", "p100-1x4"]
    argv += ["--backends", "elimination", "--time-limit", "5", "--out", str(tmp_path), "--no-plot"]
    assert compare.main(argv) == 130
    out, err = capsys.readouterr()
    assert "lenet5 on p100-1x2: 2 devices" in out and "Traceback" not in err
    assert err.splitlines() == ["error: interrupted after 1 case(s)"], err
    (folder,) = tmp_path.iterdir()
    data = json.loads((folder / "results.json").read_text())
    assert data["partial"] is True and [c["preset"] for c in data["cases"]] == ["p100-1x2"]
