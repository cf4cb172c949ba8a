"""`python -m experiments.iopddl`: contest-like files through backends, one process per case,
every answer re-checked from the file, contest scores against the best-known costs."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from experiments import dispatch, iopddl
from experiments.anytime import shifted
from experiments.background import background_load
from planner.errors import LayerwiseError
from planner.problems.costtable import contest_problem, load_problem, save_problem

G = "asplos-2025-iopddl-G"  # named as the contest names its instance G


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two small contest-like instances: one named as the contest's G (G's best-known cost
    applies) and a gzipped one with a name no best-known cost has."""
    d = tmp_path / "instances"
    d.mkdir()
    save_problem(contest_problem(60, seed=1, name=G), d / f"{G}.json")
    save_problem(contest_problem(50, seed=2), tmp_path / "other.json")
    (d / "other.json.gz").write_bytes(gzip.compress((tmp_path / "other.json").read_bytes()))
    return d


def test_rows_scores_and_provenance(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    argv = [str(folder), "--backends", "baselines", "--time-limit", "5", "--out", str(out)]
    assert iopddl.main(argv) == 0
    (run,) = out.glob("iopddl-*")
    rows = list(csv.DictReader((run / "rows.csv").open()))
    assert [r["instance"] for r in rows] == [G, "other"]
    for r in rows:
        assert r["valid"] == "yes" and r["backend"] == "baselines" and r["seed"] == "0"
        assert float(r["wall"]) > 0 and float(r["rss_mib"]) > 0 and float(r["time_limit"]) == 5
        assert r["background"] == "0"
    g, other = rows
    assert other["best"] == "" and other["score"] == ""  # no best-known cost: no score
    assert math.isclose(float(g["score"]), 217039 / float(g["cost"]))
    assert math.isclose(float(g["ratio"]), float(g["cost"]) / 217039)
    doc = json.loads((run / "rows.json").read_text())
    assert doc["run"]["command"].startswith("python -m experiments.iopddl")
    assert "load_start" in doc["run"]["machine"] and "load_end" in doc["run"]["machine"]
    assert len(doc["rows"]) == 2 and (run / "logs").is_dir()
    # the anytime traces, their metrics and the report (experiments.anytime)
    trace = json.loads((run / "traces" / f"{G}-baselines-seed0-5s-bg0.json").read_text())
    assert trace["incumbent"][-1][1] == float(g["cost"]) and trace["offset"] > 0
    # on the case's clock (the process's age added), clamped to its limit: no wall-clock bound
    on_clock = shifted(trace["incumbent"], trace["offset"], 5.0)
    assert on_clock[-1][1] == float(g["cost"]) and 0 < on_clock[-1][0] <= 5
    assert float(g["primal_integral_norm"]) == pytest.approx(float(g["primal_integral"]) / 5)
    assert other["primal_integral"] == "" and float(other["primal_dual_integral_norm"]) == 1.0
    assert "trace" not in doc["rows"][0]
    for name in ("anytime.md", "profile-cost.png", f"curve-{G}.png", "curve-other.png"):
        assert (run / name).stat().st_size > 0


def test_the_recheck_catches_a_tampered_answer(folder: Path) -> None:
    path = folder / f"{G}.json"
    answer = iopddl.run_case(path, "baselines", 5.0, 0, 1)
    problem = load_problem(path)
    verdict, cost = dispatch.recheck(problem, answer)
    assert verdict == "yes" and math.isclose(cost or 0, answer["objective"])
    lied = {**answer, "objective": answer["objective"] - 1}
    assert dispatch.recheck(problem, lied)[0].startswith("no: reported")
    # every node at its largest usage: over the memory limit
    most = [int(np.argmax(u[:, 0] + np.where(np.isfinite(c), 0, -1e30)))
            for u, c in zip(problem.usage or (), problem.node_cost, strict=True)]  # fmt: skip
    verdict, _ = dispatch.recheck(problem, {**answer, "choices": most, "objective": None})
    assert verdict.startswith("no: memory peak") or verdict.startswith("no: a forbidden")
    # a forbidden strategy
    i = next(i for i, c in enumerate(problem.node_cost) if not np.isfinite(c).all())
    bad = list(answer["choices"])
    bad[i] = int(np.flatnonzero(~np.isfinite(problem.node_cost[i]))[0])
    assert dispatch.recheck(problem, {**answer, "choices": bad}) == (
        "no: a forbidden choice or pair",
        None,
    )
    assert dispatch.recheck(problem, {**answer, "choices": [0]})[0].startswith("no: ")
    assert dispatch.recheck(problem, {"choices": None}) == ("-", None)


def test_a_crash_and_a_hang_are_rows(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (folder / "broken.json").write_text('{"problem": {"nodes": {}}}')

    def rows(*files: str) -> list[dict[str, str]]:
        out = tmp_path / f"results-{len(list(tmp_path.glob('results-*')))}"
        argv = [*(str(folder / f) for f in files), "--backends", "baselines",
                "--time-limit", "5", "--out", str(out)]  # fmt: skip
        assert iopddl.main(argv) == 0
        (run,) = out.glob("iopddl-*")
        return list(csv.DictReader((run / "rows.csv").open()))

    broken, fine = rows("broken.json", f"{G}.json")
    assert broken["status"] == "ERROR" and 'has no "edges"' in broken["error"]
    assert broken["valid"] == "-" and broken["score"] == "" and broken["cost"] == ""
    assert fine["valid"] == "yes"  # the run went on after the crash
    monkeypatch.setattr(dispatch, "GRACE", -4.95)  # killed at the first look after 0.05 s
    (hung,) = rows(f"{G}.json")
    assert hung["status"] == "TIMEOUT" and "killed after" in hung["error"]
    assert hung["score"] == "0.0"  # a best-known cost but no valid answer


def test_names() -> None:
    assert dispatch.instance_name(Path("d/asplos-2025-iopddl-A.json.gz")) == "asplos-2025-iopddl-A"
    assert iopddl.contest_key("asplos-2025-iopddl-A") == "A" and iopddl.contest_key("S") == "S"
    for other in ("mine", "x-G", "asplos-2025-iopddl-AB", "a", "asplos-2024-iopddl-A"):
        assert iopddl.contest_key(other) is None


def limits_table() -> list[dict[str, str]]:
    text = iopddl.LIMITS_FILE.read_text()
    return list(csv.DictReader(x for x in text.splitlines() if not x.startswith("#")))


def test_every_contest_instance_gets_its_published_limit() -> None:
    """The contest's rules: A-E 1 minute, F-J 2, K-O 3, P-T 4, U-Y 5; matched by the file's
    name as the contest names it, or by the letter alone."""
    rows = limits_table()
    assert [r["instance"] for r in rows] == [chr(c) for c in range(ord("A"), ord("Y") + 1)]
    for k, row in enumerate(rows):
        published = 60.0 * (1 + k // 5)
        assert float(row["time_limit_s"]) == published and row["source"].startswith("https://")
        name = dispatch.instance_name(Path("d") / row["file"])
        assert name == f"asplos-2025-iopddl-{row['instance']}"
        assert iopddl.time_limit_of(name, None) == published
        assert iopddl.time_limit_of(row["instance"], None) == published
        assert iopddl.limit_note(name, None) is None
        assert iopddl.time_limit_of(name, 7.0) == 7.0


def test_an_unknown_name_gets_the_default_limit_with_a_note() -> None:
    assert iopddl.DEFAULT_TIME_LIMIT == 60.0  # the documented default
    for name in ("mine", "x-G", "asplos-2025-iopddl-Z"):
        assert iopddl.time_limit_of(name, None) == iopddl.DEFAULT_TIME_LIMIT
        note = iopddl.limit_note(name, None)
        assert note is not None and "\n" not in note
        assert note.startswith(f"note: {name} is not a contest instance name") and "60 s" in note
        assert iopddl.limit_note(name, 30.0) is None  # --time-limit given: nothing to note


def test_best_costs_and_bounds_have_sources() -> None:
    """Every instance has the contest best; every number has a source; a bound is never
    above the best-known cost, nor that above the contest best."""
    best = iopddl.read_best(iopddl.BEST_FILE)
    assert sorted(best) == [chr(c) for c in range(ord("A"), ord("Y") + 1)]
    assert {k: best[k] for k in "AGMS"} == {
        "A": 6548641531, "G": 217039, "M": 49928460991, "S": 1534613444
    }  # fmt: skip
    text = iopddl.BEST_FILE.read_text()
    for row in csv.DictReader(x for x in text.splitlines() if not x.startswith("#")):
        for number in ("best_cost", "best_known", "lower_bound"):
            source = row[f"{number}_source"]
            assert source, (row["instance"], number)
            if row[number]:
                assert source.startswith(("https://", "the contest best")), source
            else:
                assert number == "lower_bound" and source == "none found published"
        bound = float(row["lower_bound"] or 0)
        assert bound <= float(row["best_known"]) <= float(row["best_cost"]), row["instance"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give instance files"),
        (["{tmp}/nope.json"], "does not exist"),
        (["{tmp}", "--backends", "nope"], "unknown backend 'nope'"),
        (["{tmp}"], "holds no *.json"),
        (["{tmp}", "--time-limit", "0"], "time-limit"),
        (["{tmp}/x.json", "--best", "{tmp}/missing.csv"], "cannot read the best-known costs"),
        (["{tmp}/x.json", "--best", "{tmp}/x.json"], "needs the columns instance and best_cost"),
    ],
)
def test_bad_arguments_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    (tmp_path / "x.json").write_text("a,b\n1,2\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    argv = [str(empty) if a == str(tmp_path) else a for a in argv]
    assert iopddl.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_a_case_process_knows_its_age() -> None:
    """The case's limit counts from its process's start (`_process_age`): a process that
    slept 0.3 s before asking is at least 0.3 s old, and not much more."""
    code = (
        "import time; time.sleep(0.3)\n"
        "from experiments.iopddl import _process_age\n"
        "print(_process_age())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert 0.3 <= float(out.stdout) < 10.0


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process, in clock ticks (Linux /proc)."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields_[11]) + int(fields_[12])  # fields 14 and 15 of stat


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process `pid` has exited (or is a zombie) within `within` seconds."""
    end = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_background_burners_burn_and_stop() -> None:
    """`background_load(n)`: n processes using CPU while the block runs, none after it, also
    when the block raises; n = 0 starts none."""
    with background_load(0) as none:
        assert none == []
    with pytest.raises(RuntimeError), background_load(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        end = time.monotonic() + 10.0
        while time.monotonic() < end and not all(_cpu_ticks(p.pid) > 0 for p in procs):
            time.sleep(0.05)
        assert all(_cpu_ticks(p.pid) > 0 for p in procs)  # burning, not sleeping
        raise RuntimeError("the case crashed")
    assert all(p.returncode is not None for p in procs)  # killed and reaped
    assert all(not Path(f"/proc/{p.pid}").exists() for p in procs)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_background_burners_outlive_no_killed_parent() -> None:
    """A burner whose parent dies without cleaning up (SIGKILL, a crash) stops by itself."""
    code = (
        "import os, sys\n"
        "from experiments.background import background_load\n"
        "with background_load(1) as procs:\n"
        "    print(procs[0].pid, flush=True)\n"
        "    os._exit(0)  # no cleanup, as after a SIGKILL\n"
    )
    root = str(Path(iopddl.__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, env={**os.environ, "PYTHONPATH": root})  # fmt: skip
    assert _gone(int(out.stdout))


def test_rows_carry_the_background_and_no_burner_is_left(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen] = []

    @contextlib.contextmanager
    def recorded(n: int) -> Iterator[list[subprocess.Popen]]:
        with background_load(n) as procs:
            assert all(p.poll() is None for p in procs)  # running when the case starts
            started.extend(procs)
            yield procs

    monkeypatch.setattr(dispatch, "background_load", recorded)
    out = tmp_path / "results"
    argv = [str(folder / f"{G}.json"), "--backends", "baselines", "--time-limit", "2",
            "--background", "1", "--out", str(out)]  # fmt: skip
    assert iopddl.main(argv) == 0
    (run,) = out.glob("iopddl-*")
    rows = list(csv.DictReader((run / "rows.csv").open()))
    # under load the 2 s may pass before an answer: a row all the same
    assert [r["background"] for r in rows] == ["1"] and rows[0]["status"] != "ERROR"
    doc = json.loads((run / "rows.json").read_text())
    assert [r["background"] for r in doc["rows"]] == [1]
    assert len(started) == 1 and all(p.returncode is not None for p in started)  # stopped
    assert all(_gone(p.pid, within=0) for p in started)


# ----------------------------------------------------------------------------- rows, traces

ANSWER = {
    "status": "FEASIBLE", "choices": [0], "objective": 100.0, "bound": 50.0,
    "load_seconds": 0.1,
    # the last answer written 0.05 s past the 10 s limit (offset 0.3 s of process start)
    "trace": {"incumbent": [[0.5, 300.0], [9.75, 100.0]], "bound": [], "offset": 0.3},
}  # fmt: skip


def _outcome(answer: dict | None, measured: dict | None = None, verdict: str = "yes",
             cost: float | None = 100.0, attempt: int = 1) -> dispatch.Outcome:  # fmt: skip
    case = dispatch.Case(Path("d/p.json"), "b", 0, 10.0, 0, 1, attempt)
    m = {"wall": 1.0, "rss_mib": 1.0, "tree_rss_mib": 1.0, "load_start": 0.0,
         "load_end": 0.0, **(measured or {})}  # fmt: skip
    return dispatch.Outcome(case, answer, m, verdict, cost)


CRASH = {"error": "died of SIGKILL", "crashed": True}


def test_metrics_count_an_answer_past_the_limit_at_it_and_only_valid_answers() -> None:
    row = iopddl._outcome_row(_outcome(ANSWER), {"p": 100.0})
    assert row.time_to_1pct == 10.0 and row.primal_integral is not None
    refused = iopddl._outcome_row(_outcome(ANSWER, verdict="no: x", cost=None), {"p": 100.0})
    assert refused.time_to_1pct is None and refused.primal_dual_integral is None


def test_a_refused_answer_leaves_no_trace_file(tmp_path: Path) -> None:
    refused = iopddl._outcome_row(_outcome(ANSWER, verdict="no: x", cost=None), {"p": 100.0})
    iopddl.save_trace(refused, tmp_path)
    assert not (tmp_path / "traces").exists() or not any((tmp_path / "traces").iterdir())


def test_a_trace_is_written_once_and_an_attempt_without_one_removes_it(tmp_path: Path) -> None:
    row = iopddl._outcome_row(_outcome(ANSWER), {})
    iopddl.save_trace(row, tmp_path)
    (path,) = (tmp_path / "traces").iterdir()
    assert json.loads(path.read_text())["offset"] == 0.3 and row.trace is None  # dropped
    crashed = iopddl._outcome_row(_outcome(None, CRASH, "-", None, attempt=2), {})
    iopddl.save_trace(crashed, tmp_path)
    assert not path.exists()


def test_bad_input_is_finished_and_a_crash_is_retried_once(tmp_path: Path) -> None:
    bad = iopddl._outcome_row(_outcome(None, {"error": "bad", "crashed": False}, "-", None), {})
    crash = iopddl._outcome_row(_outcome(None, CRASH, "-", None), {})
    assert bad.status == crash.status == "ERROR"
    assert iopddl.finished(bad) and not iopddl.finished(crash)
    assert iopddl.finished(dataclasses.replace(crash, attempt=2))
    assert iopddl._next_attempt(bad) == 1 and iopddl._next_attempt(crash) == 2
    iopddl.save([bad, crash], {}, tmp_path)
    back, _ = iopddl.previous_rows(tmp_path)
    assert [r.crashed for r in back] == [False, True]


def test_one_instance_name_twice_is_refused(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(LayerwiseError, match="both instance 'other'"):
        iopddl.instances([folder, tmp_path / "other.json"])


def test_a_resume_refuses_instances_that_changed(folder: Path, tmp_path: Path) -> None:
    args = iopddl.parse_args([str(folder), "--time-limit", "5"])
    iopddl.record_run(args, tmp_path)
    iopddl.check_cases(args, tmp_path)  # the same: continues
    save_problem(contest_problem(20, seed=3), folder / "new.json")
    with pytest.raises(LayerwiseError, match="new or changed.*new.json"):
        iopddl.check_cases(args, tmp_path)


def test_a_late_ctrl_c_keeps_the_finished_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Ray's cancel (SIGINT) arriving while the answer is re-checked only asks to stop
    answer = {"choices": [0], "status": "FEASIBLE"}
    monkeypatch.setattr(dispatch, "run_child", lambda *a: (answer, {"wall": 1.0}))
    monkeypatch.setattr(dispatch, "_problem", lambda path, keep: None)

    def recheck(problem: object, given: dict) -> tuple[str, float]:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        return "yes", 1.0

    monkeypatch.setattr(dispatch, "recheck", recheck)
    try:
        out = dispatch.execute(dispatch.Case(tmp_path / "p.json", "b", 0, 1.0, 0, 1))
    except KeyboardInterrupt:
        pytest.fail("the finished answer was lost to the Ctrl-C")
    assert (out.verdict, out.cost) == ("yes", 1.0)


def test_cases_no_live_node_can_run_are_found() -> None:
    assert dispatch.impossible({"a": 2, "b": 4, "c": 1}, [2, 2]) == ["b"]
    assert dispatch.impossible({"a": 1}, []) == ["a"]  # every node gone
    assert dispatch.impossible({"a": 8}, [8, 2]) == []
