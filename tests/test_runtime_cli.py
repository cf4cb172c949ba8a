"""`python -m runtime.run`: output, --check, and every bad input refused before spawning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from budget import time_budget

from planner.hardware.presets import get_preset
from planner.problems.baselines import owt
from runtime.reference import ModelSpec
from runtime.run import EXIT_BAD_INPUT, EXIT_DEVIATION, EXIT_WORKER_FAILED, main
from tests.processes import session_processes, wait_for

LENET = ModelSpec("lenet5", 8, {})
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(120):
        yield


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "lenet-owt.json"
    strategy = owt(LENET.graph(), get_preset("cpu-local-2"))
    strategy.save(path, model=LENET.to_json())
    return path


def edited(src: Path, dst: Path, edit: Any) -> Path:
    data = json.loads(src.read_text())
    edit(data)
    dst.write_text(json.dumps(data))
    return dst


def test_json_with_check(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(plan_file), "--steps", "3", "--check", "--json", "--dtype", "float64"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["median_step_seconds"] > 0 and out["world"] == 2
    assert out["max_deviation"] < 1e-9 and len(out["losses"]) == 3


def test_check_fails_with_its_own_status_above_the_tolerance(
    plan_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # float64 deviates by ~1e-16 here: any run is "wrong" against a tolerance of 1e-300
    args = [str(plan_file), "--steps", "2", "--check", "--dtype", "float64"]
    assert main([*args, "--tolerance", "1e-300"]) == EXIT_DEVIATION
    captured = capsys.readouterr()
    assert "max relative deviation" in captured.out  # the report comes first
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the run deviates") and "1e-300" in err[0]
    assert main(args) == 0  # the float64 default (1e-8) holds
    assert "error" not in capsys.readouterr().err


def test_text_output(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(plan_file), "--steps", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "lenet5 on 2 workers (gloo, float32): median step" in out
    assert "over 1 step after 1 warm-up" in out and "loss " in out


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], match: str) -> None:
    start = time.monotonic()
    assert main(args) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, no usage block
    assert err.startswith("error: ") and match in err, err
    assert time.monotonic() - start < 10  # refused before any worker started


def test_world_mismatch(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused([str(plan_file), "--world", "4"], capsys, "world size is 4")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "0"], "positive integer"),
        (["--warmup", "-1"], "integer >= 0"),
        (["--lr", "-0.1"], "number > 0"),
        (["--timeout", "nan"], "seconds > 0"),
        (["--frob"], "unrecognized arguments"),
        (["--dtype", "float8"], "invalid choice"),
        (["--steps", "3", "--warmup", "3"], "leaves no step to time"),
        (["--steps", "2", "--warmup", "5"], "leaves no step to time"),
        (["--log-file", "/nonexistent-dir/x.log"], "does not exist"),
    ],
)
def test_bad_option_values(
    plan_file: Path, capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    _refused([str(plan_file), *args], capsys, says)


def test_missing_strategy_argument(capsys: pytest.CaptureFixture[str]) -> None:
    _refused([], capsys, "required")


def test_malformed_model_in_the_file(
    plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(plan_file.read_text())
    data["graph"]["model"]["kwargs"] = 5
    (tmp_path / "bad-model.json").write_text(json.dumps(data))
    _refused([str(tmp_path / "bad-model.json")], capsys, "malformed")


def test_missing_and_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _refused([str(tmp_path / "nope.json")], capsys, "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    _refused([str(tmp_path / "bad.json")], capsys, "JSON")
    (tmp_path / "other.json").write_text('{"format": "something"}')
    _refused([str(tmp_path / "other.json")], capsys, "not a layerwise strategy file")


def test_fingerprints_checked(
    plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def graph_print(d: dict[str, Any]) -> None:
        d["graph"]["fingerprint"] = "0" * 16

    def device_print(d: dict[str, Any]) -> None:
        d["devices"]["fingerprint"] = "0" * 16

    _refused([str(edited(plan_file, tmp_path / "g.json", graph_print))], capsys, "made for graph")
    path = edited(plan_file, tmp_path / "d.json", device_print)
    _refused([str(path)], capsys, "made for device graph")


def test_model_must_match_the_graph(
    plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def other_batch(d: dict[str, Any]) -> None:
        d["graph"]["model"]["batch"] = 4

    path = edited(plan_file, tmp_path / "m.json", other_batch)
    _refused([str(path)], capsys, "is not the graph of model 'lenet5'")


def test_check_without_model(
    plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = edited(plan_file, tmp_path / "nomodel.json", lambda d: d["graph"].pop("model"))
    _refused([str(path), "--check"], capsys, "needs the model")


def test_bad_config(plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def three_way(d: dict[str, Any]) -> None:
        d["configs"]["fc1"] = {"degrees": {"channel": 7}, "devices": [0, 1, 2, 3, 4, 5, 6]}

    path = edited(plan_file, tmp_path / "cfg.json", three_way)
    _refused([str(path)], capsys, "bad config for op 'fc1'")


def test_entry_point_runs_as_a_module(plan_file: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runtime.run", str(plan_file), "--steps", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["max_deviation"] is None


def test_worker_failure_exit_status(
    plan_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import runtime.launch as launch

    real = launch.run_strategy

    def faulty(strategy: Any, model: Any, options: Any, world: Any = None) -> Any:
        fault = {"rank": 0, "step": 0, "kind": "raise"}
        return real(strategy, model, launch.RunOptions(**{**vars(options), "fault": fault}))

    monkeypatch.setattr(launch, "run_strategy", faulty)
    assert main([str(plan_file), "--steps", "2"]) == EXIT_WORKER_FAILED
    assert "rank 0: RuntimeError: injected fault" in capsys.readouterr().err


def _proc(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_while_workers_start_is_one_line_and_leaves_no_process(plan_file: Path) -> None:
    """Ctrl-C at a terminal interrupts the whole foreground process group: the launcher, the
    forkserver and any worker. Sent while the forkserver imports torch (seconds, before any
    worker can start), it printed the server's KeyboardInterrupt traceback. Now: one line,
    status 130, and every process of the run ends."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.run", str(plan_file), "--steps", "50", "--timeout", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=as_from_a_terminal,
    )

    def importing_torch() -> bool:
        return any(
            "forkserver" in _proc(p, "cmdline") and "libtorch" in _proc(p, "maps")
            for p in session_processes(proc.pid)
        )

    try:
        assert wait_for(importing_torch, 60), "no forkserver started"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert err == "error: interrupted\n", err
        assert wait_for(lambda: not session_processes(proc.pid), 30), [
            _proc(p, "cmdline") for p in session_processes(proc.pid)
        ]
    finally:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_the_zero_stage_comes_from_the_plan_file(
    plan_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    import runtime.launch

    zero1 = edited(plan_file, tmp_path / "zero1.json", lambda d: d.update(cost={"zero": 1}))
    args = ["--steps", "2", "--check", "--json", "--dtype", "float64"]
    assert main([str(zero1), *args]) == 0
    assert json.loads(capsys.readouterr().out)["max_deviation"] < 1e-9
    seen: list[int] = []

    def spy(strategy: Any, model: Any, options: Any, world: Any) -> Any:
        seen.append(options.zero)
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime.launch, "run_strategy", spy)
    main([str(zero1)])
    main([str(plan_file)])
    assert seen == [1, 0]
    bad = edited(plan_file, tmp_path / "zero7.json", lambda d: d.update(cost={"zero": 7}))
    capsys.readouterr()
    assert main([str(bad)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cost.zero must be 0, 1, 2 or 3" in err[0]


def as_from_a_terminal() -> None:
    """In the child before it runs: SIGINT at its default, as a command started at a terminal
    has it. A test run started in the background by a shell without job control inherits
    SIGINT ignored, and a child that starts with it ignored never sees a Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


PRESSED_WHILE_THE_SERVER_STARTS = """
import os, signal, time
if __name__ == "__main__":
    import multiprocessing
    from multiprocessing import forkserver
    import runtime.launch as launch
    real = forkserver.ensure_running
    def pressed():
        real()
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the server starts
    forkserver.ensure_running = pressed
    try:
        launch._start_server(multiprocessing.get_context("forkserver"))
        time.sleep(0.5)
        print("lost")
    except KeyboardInterrupt:
        print("interrupted")
"""


def test_a_ctrl_c_while_the_forkserver_starts_reaches_the_launcher(tmp_path: Path) -> None:
    """The launcher ignores SIGINT while it starts the forkserver (so the server inherits the
    ignore); a Ctrl-C in that window was lost and the run went on to its end (status 0)."""
    script = tmp_path / "pressed.py"
    script.write_text(PRESSED_WHILE_THE_SERVER_STARTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        preexec_fn=as_from_a_terminal,
    )
    assert out.stdout.strip() == "interrupted", out.stderr[-500:]
