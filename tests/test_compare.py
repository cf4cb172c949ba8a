"""`python -m experiments.compare`: a tiny run end to end, and the agreement verdicts."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from backends import backend_names
from experiments.compare import Row, _judge, main
from planner.graph.zoo import model_graph
from planner.problems.baselines import applicable

TINY = ["--models", "lenet5", "--presets", "p100-1x2", "--time-limit", "2"]


def results(out: Path) -> tuple[Path, list[dict[str, Any]]]:
    (folder,) = out.iterdir()
    rows: list[dict[str, Any]] = json.loads((folder / "results.json").read_text())
    return folder, rows


def test_a_tiny_comparison_writes_every_method(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TINY, "--out", str(tmp_path), "--no-plot"]) == 0
    folder, rows = results(tmp_path)
    baselines = [f"[{name}]" for name in applicable(model_graph("lenet5"))]
    assert [r["method"] for r in rows] == baselines + backend_names()
    assert {(r["model"], r["preset"]) for r in rows} == {("lenet5", "p100-1x2")}
    by_method = {r["method"]: r for r in rows}
    assert by_method["[data_parallel]"]["speedup"] == 1.0
    for r in rows:
        assert r["status"] != "cannot run", r
        assert r["objective"] > 0 and r["speedup"] > 0
        assert r["verdict"] not in ("DISAGREES", "BELOW PROVEN OPTIMUM"), r
    # the baselines backend returns the best expert strategy
    best = min(by_method[m]["objective"] for m in baselines)
    assert by_method["baselines"]["objective"] == pytest.approx(best, rel=1e-12)

    with open(folder / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == [r["method"] for r in rows]
    assert float(table[0]["objective"]) == pytest.approx(rows[0]["objective"], rel=1e-12)
    assert not (folder / "speedup.png").exists()
    out = capsys.readouterr().out
    assert "[data_parallel]" in out and "results written to" in out


def test_a_tiny_comparison_with_its_plot(tmp_path: Path) -> None:
    assert main([*TINY, "--backends", "baselines", "--out", str(tmp_path)]) == 0
    folder, rows = results(tmp_path)
    assert [r["method"] for r in rows][-1] == "baselines"
    png = (folder / "speedup.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_two_runs_in_the_same_second_keep_both_results(tmp_path: Path) -> None:
    argv = [*TINY, "--backends", "baselines", "--out", str(tmp_path), "--no-plot"]
    assert main(argv) == 0 and main(argv) == 0
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--models", "nope"], "unknown model"),
        (["--presets", "p100-0x4"], "out of range"),
        (["--backends", "nope"], "unknown backend"),
        (["--time-limit", "0"], "--time-limit"),
        (["--max-configs", "0"], "--max-configs"),
        (["--batch", "-1"], "--batch"),
        (["--frob"], "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    assert main([*TINY, *argv, "--out", str(tmp_path), "--no-plot"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # failed before any work


# -- verdicts -----------------------------------------------------------------------------


def row(method: str, status: str, objective: float | None) -> Row:
    return Row("m", "p", method, status, objective, None, None, None)


def test_judge_speedups_are_over_data_parallelism() -> None:
    rows = [row("[data_parallel]", "baseline", 2.0), row("fast", "FEASIBLE", 0.5)]
    _judge(rows)
    assert [r.speedup for r in rows] == [1.0, 4.0]
    assert [r.verdict for r in rows] == ["", ""]  # no proven optimum: nothing to judge


def test_judge_flags_a_feasible_answer_below_a_proven_optimum() -> None:
    rows = [
        row("[data_parallel]", "baseline", 3.0),
        row("exact", "OPTIMAL", 2.0),
        row("heuristic", "FEASIBLE/TIME", 1.5),
        row("slower", "FEASIBLE", 2.5),
        row("broken", "NO_SOLUTION", None),
    ]
    _judge(rows)
    verdicts = {r.method: r.verdict for r in rows}
    assert verdicts["heuristic"] == "BELOW PROVEN OPTIMUM"
    assert verdicts["exact"] == "agrees"
    assert verdicts["slower"] == "+25.0% vs optimum"
    assert verdicts["[data_parallel]"] == "+50.0% vs optimum"
    assert verdicts["broken"] == ""


def test_judge_flags_proven_optima_that_differ() -> None:
    rows = [row("a", "OPTIMAL", 2.0), row("b", "OPTIMAL", 2.1), row("c", "FEASIBLE", 2.2)]
    _judge(rows)
    assert [r.verdict for r in rows] == ["DISAGREES", "DISAGREES", "+10.0% vs optimum"]


def test_judge_accepts_optima_equal_to_the_tolerance() -> None:
    rows = [row("a", "OPTIMAL", 2.0), row("b", "OPTIMAL", 2.0 * (1 + 1e-9))]
    _judge(rows)
    assert [r.verdict for r in rows] == ["agrees", "agrees"]


def test_a_disagreement_makes_main_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import experiments.compare as compare

    def fake_run(args: Any, console: Any) -> list[Row]:
        rows = [row("a", "OPTIMAL", 1.0), row("b", "OPTIMAL", 2.0)]
        _judge(rows)
        return rows

    monkeypatch.setattr(compare, "run", fake_run)
    assert main([*TINY, "--out", str(tmp_path), "--no-plot"]) == 1
    out = capsys.readouterr().out
    assert "DISAGREES" in out and "2 disagreement(s)" in out
