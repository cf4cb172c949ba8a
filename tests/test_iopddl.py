"""`python -m experiments.iopddl`: contest-like files through backends, one process per case,
every answer re-checked from the file, contest scores against the best-known costs."""

from __future__ import annotations

import csv
import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import iopddl
from planner.problems.costtable import contest_problem, load_problem, save_problem


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two small contest-like instances: "x-G" (G's best-known cost applies) and a gzipped
    one with a name no best-known cost has."""
    d = tmp_path / "instances"
    d.mkdir()
    save_problem(contest_problem(60, seed=1, name="x-G"), d / "x-G.json")
    save_problem(contest_problem(50, seed=2), tmp_path / "other.json")
    (d / "other.json.gz").write_bytes(gzip.compress((tmp_path / "other.json").read_bytes()))
    return d


def test_rows_scores_and_provenance(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "results"
    argv = [str(folder), "--backends", "baselines", "--time-limit", "5", "--out", str(out)]
    assert iopddl.main(argv) == 0
    (run,) = out.glob("iopddl-*")
    rows = list(csv.DictReader((run / "rows.csv").open()))
    assert [r["instance"] for r in rows] == ["other", "x-G"]
    for r in rows:
        assert r["valid"] == "yes" and r["backend"] == "baselines" and r["seed"] == "0"
        assert float(r["wall"]) > 0 and float(r["rss_mib"]) > 0 and float(r["time_limit"]) == 5
    other, g = rows
    assert other["best"] == "" and other["score"] == ""  # no best-known cost: no score
    assert math.isclose(float(g["score"]), 217039 / float(g["cost"]))
    assert math.isclose(float(g["ratio"]), float(g["cost"]) / 217039)
    doc = json.loads((run / "rows.json").read_text())
    assert doc["run"]["command"].startswith("python -m experiments.iopddl")
    assert "load_start" in doc["run"]["machine"] and "load_end" in doc["run"]["machine"]
    assert len(doc["rows"]) == 2 and (run / "logs").is_dir()


def test_the_recheck_catches_a_tampered_answer(folder: Path) -> None:
    path = folder / "x-G.json"
    answer = iopddl.run_case(path, "baselines", 5.0, 0, 1)
    problem = load_problem(path)
    verdict, cost = iopddl.recheck(problem, answer)
    assert verdict == "yes" and math.isclose(cost or 0, answer["objective"])
    lied = {**answer, "objective": answer["objective"] - 1}
    assert iopddl.recheck(problem, lied)[0].startswith("no: reported")
    # every node at its largest usage: over the memory limit
    most = [int(np.argmax(u[:, 0] + np.where(np.isfinite(c), 0, -1e30)))
            for u, c in zip(problem.usage or (), problem.node_cost, strict=True)]  # fmt: skip
    verdict, _ = iopddl.recheck(problem, {**answer, "choices": most, "objective": None})
    assert verdict.startswith("no: memory peak") or verdict.startswith("no: a forbidden")
    # a forbidden strategy
    i = next(i for i, c in enumerate(problem.node_cost) if not np.isfinite(c).all())
    bad = list(answer["choices"])
    bad[i] = int(np.flatnonzero(~np.isfinite(problem.node_cost[i]))[0])
    assert iopddl.recheck(problem, {**answer, "choices": bad}) == (
        "no: a forbidden choice or pair",
        None,
    )
    assert iopddl.recheck(problem, {**answer, "choices": [0]})[0].startswith("no: ")
    assert iopddl.recheck(problem, {"choices": None}) == ("-", None)


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

    broken, fine = rows("broken.json", "x-G.json")
    assert broken["status"] == "ERROR" and 'has no "edges"' in broken["error"]
    assert broken["valid"] == "-" and broken["score"] == "" and broken["cost"] == ""
    assert fine["valid"] == "yes"  # the run went on after the crash
    monkeypatch.setattr(iopddl, "GRACE", -4.95)  # killed at the first look after 0.05 s
    (hung,) = rows("x-G.json")
    assert hung["status"] == "TIMEOUT" and "killed after" in hung["error"]
    assert hung["score"] == "0.0"  # a best-known cost but no valid answer


def test_time_limits_and_names() -> None:
    assert iopddl.instance_name(Path("d/asplos-2025-iopddl-A.json.gz")) == "asplos-2025-iopddl-A"
    assert iopddl.contest_key("asplos-2025-iopddl-A") == "A" and iopddl.contest_key("S") == "S"
    assert iopddl.time_limit_of("asplos-2025-iopddl-M", None) == 180
    assert iopddl.time_limit_of("G", None) == 120
    assert iopddl.time_limit_of("mine", None) == iopddl.DEFAULT_TIME_LIMIT
    assert iopddl.time_limit_of("A", 7.0) == 7.0
    best = iopddl.read_best(iopddl.BEST_FILE)
    assert best == {"A": 6548641531, "G": 217039, "M": 49928460991, "S": 1534613444}


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
