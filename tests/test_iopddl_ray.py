"""`python -m experiments.iopddl --dispatch ray`: cases as Ray tasks on a local Ray instance of
2 cores (started once for the module), rows streamed to the results folder, `--resume`, a
crashed case (its own process, or the Ray worker running it) an ERROR row retried once."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from experiments import dispatch, iopddl
from planner.problems.costtable import contest_problem, save_problem

ray = pytest.importorskip("ray")

# baselines answers these at once, the same answer every time: a case is ~1.5 s of process
# start; the limit only matters under load
LIMIT = "20"


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One Ray instance of 2 cores for the module (its start is ~4 s); the runs use it."""
    started = dispatch.RayDispatch()
    started.started = False  # the runs below must not stop it
    yield
    ray.shutdown()


@pytest.fixture
def instances(tmp_path: Path) -> Path:
    d = tmp_path / "instances"
    d.mkdir()
    for k in range(2):
        save_problem(contest_problem(40, seed=k, name=f"p{k}"), d / f"p{k}.json")
    return d


def run(argv: list[str], expect: int = 0) -> Path:
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    assert iopddl.main(argv) == expect
    if "--resume" in argv:
        return Path(argv[argv.index("--resume") + 1])
    assert out is not None
    (folder,) = out.glob("iopddl-*")
    return folder


def rows(folder: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((folder / "rows.csv").open()))


def key(r: dict[str, str]) -> tuple[str, ...]:
    return (r["instance"], r["backend"], r["seed"], r["time_limit"], r["background"])


def argv(instances: Path, out: Path, *more: str) -> list[str]:
    return [str(instances), "--backends", "baselines", "--seeds", "0", "1", "--time-limit",
            LIMIT, "--threads", "1", "--dispatch", "ray", "--out", str(out), *more]  # fmt: skip


def test_rows_for_every_case_and_a_resume_runs_only_the_missing(
    local_ray: None, instances: Path, tmp_path: Path
) -> None:
    whole = run(argv(instances, tmp_path / "a", "--seeds", "0"))  # 2 cases at once
    done = rows(whole)
    assert [key(r) for r in done] == [(f"p{i}", "baselines", "0", "20.0", "0") for i in range(2)]
    assert all(r["valid"] == "yes" and r["attempt"] == "1" for r in done)
    recorded = json.loads((whole / "run.json").read_text())["args"]
    assert recorded["seeds"] == [0] and recorded["paths"] == [str(instances.resolve())]
    # as if the run had stopped after one case: its folder with one row
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    doc = json.loads((cut / "rows.json").read_text())
    doc["rows"] = doc["rows"][1:]
    doc["rows"][0]["rss_mib"] = None  # as NaN is written (a lost worker's row)
    (cut / "rows.json").write_text(json.dumps(doc))
    for log in (cut / "logs").iterdir():
        log.unlink()
    run([str(instances), "--resume", str(cut), "--dispatch", "ray"])
    again = rows(cut)
    assert [key(r) for r in again] == [key(r) for r in done]  # the cases' order
    assert [r["cost"] for r in again] == [r["cost"] for r in done]  # a deterministic backend
    assert [p.name for p in (cut / "logs").iterdir()] == ["p0-baselines-seed0.log"]  # only it ran
    assert json.loads((cut / "rows.json").read_text())["run"]["resumed"]["command"]


def test_a_crashed_case_and_a_lost_worker_are_error_rows_retried_once(
    local_ray: None, instances: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for where in ("case", "task"):
        marker = tmp_path / f"crash-{where}"
        marker.touch()  # the first case to start dies by SIGKILL, once
        monkeypatch.setenv(dispatch.CRASH_ENV, f"{where}:{marker}")
        folder = run(argv(instances / "p0.json", tmp_path / where, "--seeds", "0"))
        assert not marker.exists()
        (row,) = rows(folder)
        assert row["attempt"] == "2" and row["status"] != "ERROR" and row["valid"] == "yes"
        (crashed,) = json.loads((folder / "rows.json").read_text())["run"]["retried"]
        assert crashed["status"] == "ERROR" and crashed["attempt"] == 1
        why = "died of SIGKILL" if where == "case" else "Ray task failed"
        assert crashed["error"].startswith(why), crashed["error"]


def test_a_timeout_is_not_retried(
    instances: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "GRACE", -19.95)  # killed at the first look after 0.05 s
    given = argv(instances / "p0.json", tmp_path / "r", "--seeds", "0", "--dispatch", "local")
    folder = run(given)  # here, where GRACE is the one set
    (row,) = rows(folder)
    assert row["status"] == "TIMEOUT" and row["attempt"] == "1"
    assert json.loads((folder / "rows.json").read_text())["run"]["retried"] == []


@pytest.mark.slow
def test_a_run_stopped_by_ctrl_c_and_resumed_has_the_rows_of_one_not_stopped(
    local_ray: None, instances: Path, tmp_path: Path
) -> None:
    # mcmc searches until its limit (4 s) and finds these optima early; 2 threads: a case
    # reserves both cores, so the cases run one at a time and the Ctrl-C finds one running
    given = ["--backends", "mcmc", "--time-limit", "4", "--threads", "2"]
    whole = rows(run([*argv(instances, tmp_path / "whole"), *given]))
    out = tmp_path / "stopped"

    def ctrl_c_after_the_first_row() -> None:
        end = time.monotonic() + 60
        while time.monotonic() < end and not list(out.glob("iopddl-*/rows.csv")):
            time.sleep(0.05)
        time.sleep(1.0)  # the second case has started
        os.kill(os.getpid(), signal.SIGINT)

    stopper = threading.Thread(target=ctrl_c_after_the_first_row)
    stopper.start()
    folder = run([*argv(instances, out), *given], expect=iopddl.EXIT_INTERRUPTED)
    stopper.join()
    stopped, _ = iopddl.previous_rows(folder)
    assert len(stopped) == 2 and iopddl.finished(stopped[0]) and not iopddl.finished(stopped[1])
    assert "(INTERRUPTED)" in stopped[1].status, stopped[1]  # answered when asked to stop
    run(["--resume", str(folder)])  # the recorded arguments, the local runner
    resumed = rows(folder)
    assert [key(r) for r in resumed] == [key(r) for r in whole]
    assert [r["cost"] for r in resumed] == [r["cost"] for r in whole]
    assert all(r["valid"] == "yes" and r["attempt"] == "1" for r in resumed)


def test_a_resume_of_other_cases_is_refused(
    instances: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    args = iopddl.parse_args([str(instances), "--seeds", "0", "1", "--threads", "1"])
    iopddl.record_run(args, folder)
    for other in (
        ["--seeds", "0"],
        ["--backends", "local"],
        ["--time-limit", "3"],
        [str(tmp_path)],
    ):
        assert iopddl.main(["--resume", str(folder), *other]) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert err.startswith(f"error: --resume {folder}: that run has other cases"), err
    assert iopddl.main(["--resume", str(tmp_path)]) == 2  # no run.json
    assert "no readable run.json" in capsys.readouterr().err


def test_ray_missing_or_unreachable_is_one_error_line(
    instances: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def error(*given: str) -> str:
        assert iopddl.main([str(instances), "--out", str(tmp_path), *given]) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        return err

    # a port nothing listens on: refused at once, where ray.init would retry for minutes
    assert "no Ray cluster answers at 127.0.0.1:9" in error("--ray", "127.0.0.1:9")
    assert "give HOST:PORT" in error("--ray", "nowhere")
    assert "drop --dispatch local" in error("--ray", "auto", "--dispatch", "local")
    monkeypatch.setattr(iopddl, "ray_installed", lambda: False)
    for given in (["--ray", "auto"], ["--dispatch", "ray"]):
        assert "pip install 'layerwise[bench]'" in error(*given)
    assert not list(tmp_path.glob("iopddl-*"))


def test_a_case_reserves_its_threads_and_with_burners_a_whole_node(local_ray: None) -> None:
    on = dispatch.RayDispatch()  # the module's instance: 2 cores
    case = dispatch.Case(Path("p0.json"), "baselines", 0, 2.0, background=0, threads=1)
    assert on.cpus(case) == 1
    assert on.cpus(replace(case, threads=8)) == 2  # at most a node's
    assert on.cpus(replace(case, background=1)) == 2  # alone with its burners


@pytest.mark.slow
def test_cases_on_a_cluster_of_two_nodes(instances: Path, tmp_path: Path) -> None:
    """`--ray ADDRESS`: a Ray cluster of two 1-core nodes (ray.cluster_utils), the run in
    its own process (this one may hold the module's Ray instance)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        root = str(Path(iopddl.__file__).resolve().parent.parent)
        out = tmp_path / "out"
        code = "import sys; from experiments.iopddl import main; sys.exit(main(sys.argv[1:]))"
        given = argv(instances, out, "--ray", cluster.address)  # --dispatch ray too: fine
        done = subprocess.run([sys.executable, "-c", code, *given], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
        assert done.returncode == 0, done.stderr
    finally:
        cluster.shutdown()
    (folder,) = out.glob("iopddl-*")
    got = rows(folder)
    assert len(got) == 4 and all(r["valid"] == "yes" for r in got)


def test_a_case_no_live_node_can_run_becomes_a_lost_row(monkeypatch: pytest.MonkeyPatch) -> None:
    # its node gone, a 4-core case would wait forever on 2-core nodes: an ERROR row instead
    rd = object.__new__(dispatch.RayDispatch)  # no Ray instance: the check alone
    case = dispatch.Case(Path("p.json"), "b", 0, 1.0, 0, 4)
    rd.pending, rd.needs = {"gone": case, "fits": case}, {"gone": 4, "fits": 2}
    rd.unrunnable, rd.checked = deque(), -math.inf
    monkeypatch.setattr(dispatch, "_alive_cpus", lambda: [2, 2])
    out = rd._unrunnable()
    assert out is not None and out.case == case and out.needs_retry
    assert "needs 4 cores and the largest live node has 2" in out.measured["error"]
    assert list(rd.pending) == ["fits"] and rd._unrunnable() is None  # next look: in a minute
