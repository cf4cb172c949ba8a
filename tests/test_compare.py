"""`python -m experiments.compare`: a tiny run end to end, its results file, its plans (they
re-score to the same numbers), the wording of the report, and the agreement verdicts."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from backends import backend_names
from experiments.compare import MODES, Case, Row, judge, main, parse_args
from experiments.compare_report import (
    case_table,
    fmt_gap,
    gap_cell,
    series_styles,
    speedup_figure,
    summary,
)
from planner.cli import main as planner_main
from planner.graph.zoo import model_graph
from planner.problems.baselines import applicable

TINY = ["--models", "lenet5", "--presets", "p100-1x2", "--time-limit", "2"]


def results(out: Path) -> tuple[Path, dict[str, Any]]:
    (folder,) = out.iterdir()
    data: dict[str, Any] = json.loads((folder / "results.json").read_text())
    return folder, data


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path, dict[str, Any]]:
    """One tiny comparison with every backend (shared: it is the slowest part of this file)."""
    out = tmp_path_factory.mktemp("compare")
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = main([*TINY, "--out", str(out), "--no-plot"])
    folder, data = results(out)
    return status, buffer.getvalue(), folder, data


def test_a_tiny_comparison_runs_every_method_and_both_objectives(
    tiny_run: tuple[int, str, Path, dict[str, Any]],
) -> None:
    status, _, _, data = tiny_run
    assert status == 0
    (case,) = data["cases"]
    assert (case["model"], case["preset"], case["devices"], case["batch"]) == (
        "lenet5",
        "p100-1x2",
        2,
        64,
    )
    rows = case["rows"]
    baselines = [f"[{name}]" for name in applicable(model_graph("lenet5"))]
    assert [r["method"] for r in rows] == baselines + backend_names()
    by_method = {r["method"]: r for r in rows}
    dp = by_method["[data_parallel]"]
    assert dp["additive_speedup"] == 1.0 and dp["simulated_speedup"] == 1.0
    for r in rows:
        assert r["status"] != "cannot run", r
        assert r["additive"] > 0 and r["simulated"] > 0, r
        assert r["additive_speedup"] == pytest.approx(dp["additive"] / r["additive"])
        assert r["simulated_speedup"] == pytest.approx(dp["simulated"] / r["simulated"])
        assert r["verdict"] not in ("DISAGREES", "BELOW PROVEN OPTIMUM"), r
        assert r["objective"] == r["additive"]  # the searched objective is the additive one
        if not r["method"].startswith("["):
            assert r["recommended"], r  # every answer gets a recommendation
            # the harness times the whole call: the backend's search and its re-score
            assert r["call_seconds"] >= r["search_seconds"] > 0, r
    # the baselines backend returns the best expert strategy
    best = min(by_method[m]["additive"] for m in baselines)
    assert by_method["baselines"]["additive"] == pytest.approx(best, rel=1e-12)
    assert case["summary"].startswith("lenet5 on p100-1x2, additive")


def test_the_results_file_says_how_to_repeat_the_run(
    tiny_run: tuple[int, str, Path, dict[str, Any]],
) -> None:
    _, _, folder, data = tiny_run
    assert data["format"] == "layerwise.compare" and data["version"] == 2
    run = data["run"]
    assert run["command"].startswith("python -m experiments.compare --models lenet5")
    assert run["args"]["time_limit"] == 2.0 and run["args"]["seed"] == 0
    assert run["args"]["mode"] == "quick"
    assert set(run["versions"]) >= {"layerwise", "torch", "ortools", "pulp", "numpy"}
    assert run["versions"]["numpy"]
    assert run["git"] is None or len(run["git"]["commit"]) == 40
    assert run["machine"]["cores"] >= 1 and "platform" in run["machine"]
    assert run["elapsed_seconds"] > 0 and run["started"] and run["ended"]
    with open(folder / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    rows = data["cases"][0]["rows"]
    assert [r["method"] for r in table] == [r["method"] for r in rows]
    assert float(table[0]["simulated"]) == pytest.approx(rows[0]["simulated"], rel=1e-12)
    assert not (folder / "speedup.png").exists()


def test_a_saved_plan_rescores_to_the_same_numbers(
    tiny_run: tuple[int, str, Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, folder, data = tiny_run
    rows = data["cases"][0]["rows"]
    for method in ("[model_parallel]", "elimination", "mcmc"):
        row = next(r for r in rows if r["method"] == method)
        capsys.readouterr()
        assert planner_main(["evaluate", str(folder / row["plan"]), "--json"]) == 0
        scored = json.loads(capsys.readouterr().out)
        assert scored["additive"] == pytest.approx(row["additive"], rel=1e-9), method
        assert scored["makespan"] == pytest.approx(row["simulated"], rel=1e-9), method


def test_the_printout_has_a_legend_and_never_inf(
    tiny_run: tuple[int, str, Path, dict[str, Any]],
) -> None:
    _, out, _, _ = tiny_run
    assert out.startswith("done lenet5 on p100-1x2 (2 devices): best ")  # the progress line
    assert "Legend" in out and "OptCNN's cost (Eq. 1)" in out and "FlexFlow's simulation" in out
    assert "no bound" in out  # the heuristics' gap
    assert "inf" not in out.lower().replace("infeasible", "")
    # who proves it first depends on timing: elimination is among the provers
    provers = re.search(r"Optimum\s+[0-9.]+\s+ms,\s+proven\s+by\s+(.*?)\.\s+Within", out, re.S)
    assert provers is not None and "elimination" in provers[1], out
    assert max(len(line) for line in out.splitlines()) <= 120
    assert "results written to" in out


def test_a_tiny_comparison_with_its_plot(tmp_path: Path) -> None:
    assert main([*TINY, "--backends", "baselines", "--out", str(tmp_path)]) == 0
    folder, data = results(tmp_path)
    assert [r["method"] for r in data["cases"][0]["rows"]][-1] == "baselines"
    png = (folder / "speedup.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_the_makespan_objective_is_searched_and_judged_on_the_simulated_time(
    tmp_path: Path,
) -> None:
    argv = [*TINY, "--objective", "makespan", "--backends", "baselines", "elimination", "search"]
    assert main([*argv, "--out", str(tmp_path), "--no-plot"]) == 0
    _, data = results(tmp_path)
    (case,) = data["cases"]
    by_method = {r["method"]: r for r in case["rows"]}
    assert by_method["elimination"]["status"] == "cannot run"
    assert "does not optimize the 'makespan' objective" in case["summary"]
    for m in ("[data_parallel]", "baselines", "search"):
        assert by_method[m]["objective"] == by_method[m]["simulated"], m
    assert by_method["search"]["status"] == "OPTIMAL"
    assert by_method["search"]["simulated"] <= by_method["[data_parallel]"]["simulated"]
    assert not case["flagged"]  # the flag is about the additive optimum


def test_two_runs_in_the_same_second_keep_both_results(tmp_path: Path) -> None:
    argv = [*TINY, "--backends", "baselines", "--out", str(tmp_path), "--no-plot"]
    assert main(argv) == 0 and main(argv) == 0
    assert len(list(tmp_path.iterdir())) == 2


def test_modes_fill_what_is_not_given() -> None:
    quick = parse_args([])
    assert quick.mode == "quick" and quick.models == MODES["quick"]["models"]
    assert quick.time_limit == MODES["quick"]["time_limit"]
    full = parse_args(["--full", "--time-limit", "4"])
    assert full.presets == MODES["full"]["presets"] and full.time_limit == 4.0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--models", "nope"], "unknown model"),
        (["--presets", "p100-0x4"], "out of range"),
        (["--backends", "nope"], "unknown backend"),
        (["--time-limit", "0"], "--time-limit"),
        (["--max-configs", "0"], "--max-configs"),
        (["--batch", "-1"], "--batch"),
        (["--threads", "0"], "--threads"),
        (["--quick", "--full"], "not allowed with"),
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


# -- verdicts and wording -----------------------------------------------------------------


def row(method: str, status: str, objective: float | None, **kw: Any) -> Row:
    return Row("m", "p", method, status, objective, additive=objective, **kw)


def test_judge_speedups_are_over_data_parallelism() -> None:
    rows = [
        row("[data_parallel]", "baseline", 2.0, simulated=1.0),
        row("fast", "FEASIBLE", 0.5, simulated=2.0),
    ]
    judge(rows)
    assert [r.speedup for r in rows] == [1.0, 4.0]
    assert [r.additive_speedup for r in rows] == [1.0, 4.0]
    assert [r.simulated_speedup for r in rows] == [1.0, 0.5]
    assert [r.verdict for r in rows] == ["", ""]  # no proven optimum: nothing to judge


def test_judge_flags_a_feasible_answer_below_a_proven_optimum() -> None:
    rows = [
        row("[data_parallel]", "baseline", 3.0),
        row("exact", "OPTIMAL", 2.0),
        row("heuristic", "FEASIBLE/TIME", 1.5),
        row("slower", "FEASIBLE", 2.5),
        row("same", "FEASIBLE/TIME", 2.0),
        row("broken", "NO_SOLUTION", None),
    ]
    judge(rows)
    verdicts = {r.method: r.verdict for r in rows}
    assert verdicts["heuristic"] == "BELOW PROVEN OPTIMUM"
    assert verdicts["exact"] == "agrees"
    assert verdicts["slower"] == "+25.0%"
    assert verdicts["same"] == "= optimum"
    assert verdicts["[data_parallel]"] == "+50.0%"
    assert verdicts["broken"] == ""


def test_judge_flags_proven_optima_that_differ() -> None:
    rows = [row("a", "OPTIMAL", 2.0), row("b", "OPTIMAL", 2.1), row("c", "FEASIBLE", 2.2)]
    judge(rows)
    assert [r.verdict for r in rows] == ["DISAGREES", "DISAGREES", "+10.0%"]


def test_judge_accepts_optima_equal_to_the_tolerance() -> None:
    rows = [row("a", "OPTIMAL", 2.0), row("b", "OPTIMAL", 2.0 * (1 + 1e-9))]
    judge(rows)
    assert [r.verdict for r in rows] == ["agrees", "agrees"]


def test_results_are_strict_json_without_infinity(tmp_path: Path) -> None:
    from experiments.compare import save

    rows = [
        row("[data_parallel]", "baseline", 2.0),
        row("cpsat", "FEASIBLE/TIME", 1.0, gap=math.inf),
    ]
    judge(rows)
    save([Case("m", "p", 4, 64, 0.1, rows)], {"command": "x"}, tmp_path, make_plot=False)
    text = (tmp_path / "results.json").read_text()
    assert "Infinity" not in text and json.loads(text)["cases"][0]["rows"][1]["gap"] is None


def test_gaps_never_read_inf_and_no_bound_is_not_100_percent() -> None:
    assert fmt_gap(row("mcmc", "FEASIBLE/TIME", 1.0)) == "no bound"
    assert fmt_gap(row("cpsat", "FEASIBLE/TIME", 1.0, gap=math.inf)) == "bound 0"
    assert fmt_gap(row("ilp", "FEASIBLE/TIME", 2.0, gap=1.0)) == "100%"
    assert fmt_gap(row("ilp", "OPTIMAL", 2.0, gap=1e-9)) == "0%"
    assert fmt_gap(row("ilp", "FEASIBLE/TIME", 2.0, gap=0.0123)) == "1.2%"
    assert fmt_gap(row("[owt]", "baseline", 2.0)) == ""


def test_the_summary_flags_an_optimum_that_simulates_slower_than_a_baseline() -> None:
    rows = [
        row("[data_parallel]", "baseline", 3.0, simulated=1.0),
        row(
            "exact", "OPTIMAL", 2.0, simulated=1.5, recommended="data_parallel", search_seconds=0.1
        ),
        row("close", "FEASIBLE/TIME", 2.01, simulated=1.5, recommended="data_parallel"),
        row("far", "FEASIBLE/ITERATIONS", 3.0, simulated=1.0, recommended="same"),
    ]
    judge(rows)
    case = Case("m", "p", 4, 64, 0.1, rows)
    text, flagged = summary(case, "additive", 3.0)
    assert flagged
    assert "Optimum 2000 ms, proven by exact (0.10 s)." in text
    assert "Within 1%: close." in text and "Further: far +50.0%." in text
    assert "SLOWER than [data_parallel] (1000 ms): recommended data_parallel." in text
    rows[1].recommended = rows[2].recommended = "same"
    text, flagged = summary(case, "additive", 3.0)
    assert not flagged and "no baseline simulates faster" in text


def test_an_interrupted_comparison_is_one_error_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import experiments.compare as compare

    def interrupted(args: Any, console: Any, folder: Any) -> list[Case]:
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "run", interrupted)
    assert main([*TINY, "--out", str(tmp_path), "--no-plot"]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_a_disagreement_makes_main_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import experiments.compare as compare

    def fake_run(args: Any, console: Any, folder: Any) -> list[Case]:
        rows = [row("a", "OPTIMAL", 1.0), row("b", "OPTIMAL", 2.0)]
        judge(rows)
        case = Case("m", "p", 4, 64, 0.1, rows)
        case.summary, case.flagged = summary(case, "additive", 1.0)
        return [case]

    monkeypatch.setattr(compare, "run", fake_run)
    assert main([*TINY, "--out", str(tmp_path), "--no-plot"]) == 1
    out = capsys.readouterr().out
    assert "DISAGREES" in out and "2 disagreement(s)" in out


def test_ctrl_c_stops_the_comparison_and_keeps_the_cases_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first Ctrl-C stops the running search and the comparison after it: the cases
    finished before are printed and saved, the interrupted one is left out, exit 130."""
    import signal

    import experiments.compare as compare

    real = compare._solve_row
    calls: list[str] = []

    def interrupted(model: str, preset: str, *args: Any) -> Any:
        calls.append(preset)
        if preset == "p100-1x4":
            signal.raise_signal(signal.SIGINT)  # what a terminal sends on Ctrl-C
        return real(model, preset, *args)

    monkeypatch.setattr(compare, "_solve_row", interrupted)
    argv = ["--models", "lenet5", "--presets", "p100-1x2", "p100-1x4"]
    argv += ["--backends", "elimination", "search", "--time-limit", "5"]
    status = main([*argv, "--out", str(tmp_path), "--no-plot"])
    out, err = capsys.readouterr()
    assert status == 130, out + err
    assert calls == ["p100-1x2", "p100-1x2", "p100-1x4"]  # no backend after the stop
    assert "interrupted during lenet5 on p100-1x4" in out
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: interrupted after 1 case(s)"], err
    assert "Traceback" not in err
    _, data = results(tmp_path)
    assert [c["preset"] for c in data["cases"]] == ["p100-1x2"]


def _lenet_like_case() -> Case:
    """lenet5 on p100-1x4 as the quick run prints it: data parallelism is far from the
    additive optimum but the fastest simulated row; cpsat reaches the optimum unproven."""
    rows = [
        row("[data_parallel]", "baseline", 0.1815e-3, simulated=0.0487e-3),
        row("[owt]", "baseline", 0.0520e-3, simulated=0.0600e-3),  # = optimum, no gap
        row("elimination", "OPTIMAL", 0.0520e-3, simulated=0.0528e-3, gap=0.0),
        row("cpsat", "FEASIBLE/TIME", 0.0520e-3, simulated=0.0528e-3, gap=1.03),
        row("ilp", "FEASIBLE/TIME", 0.0530e-3, simulated=0.0528e-3, gap=1.03),
    ]
    for r in rows[2:]:
        r.search_seconds, r.call_seconds, r.recommended = 2.9, 2.95, "data_parallel"
    judge(rows)
    return Case("lenet5", "p100-1x4", 4, 64, 0.1, rows)


def _cells(table: Any, method: str) -> dict[str, str]:
    """Header -> cell text of the row of `method` (the xDP after simulated ms: "sim xDP")."""
    k = [str(c) for c in table.columns[0]._cells].index(method)
    cells: dict[str, str] = {}
    for c in table.columns:
        cells["sim xDP" if c.header in cells else c.header] = str(c._cells[k])
    return cells


def test_every_number_in_the_table_names_its_objective() -> None:
    """Each objective's columns stand together under its name, the verdict names the
    searched one: data parallelism's +249% is an additive excess, beside its additive cost,
    not a claim about its simulated time."""
    case = _lenet_like_case()
    table = case_table(case, "additive")
    assert [c.header for c in table.columns] == [
        "\nmethod",
        "\nstatus",
        "additive*\nms",
        "\nxDP",
        "own\ngap",
        "vs additive\noptimum",
        "simulated\nms",
        "\nxDP",
        "search\ns",
        "\nrecommend",
    ]
    dp = _cells(table, "[data_parallel]")
    assert dp["vs additive\noptimum"] == "+249.0%" and dp["sim xDP"] == "1.00x"
    headers = [c.header for c in case_table(case, "makespan").columns]
    assert headers[2:8] == [
        "additive\nms",
        "\nxDP",
        "simulated*\nms",
        "\nxDP",
        "own\ngap",
        "vs simulated\noptimum",
    ]


def test_a_row_at_the_optimum_never_shows_a_gap_that_says_otherwise() -> None:
    """ilp's and cpsat's answers equal the proven optimum on inception_v3 / p100-2x4, their
    own bound (the trivial one, after restricted rounds) is 103% below: the cell says
    'unproven', the summary the number."""
    case = _lenet_like_case()
    table = case_table(case, "additive")
    cpsat, ilp = _cells(table, "cpsat"), _cells(table, "ilp")
    assert cpsat["vs additive\noptimum"] == "= optimum"
    assert cpsat["own\ngap"] == "unproven" == gap_cell(case.rows[3])
    assert ilp["vs additive\noptimum"] == "+1.9%" and ilp["own\ngap"] == "103%"
    assert _cells(table, "elimination")["own\ngap"] == "0%"
    owt = _cells(table, "[owt]")  # a baseline at the optimum: it has no gap to show
    assert owt["vs additive\noptimum"] == "= optimum" and owt["own\ngap"] == ""
    text, _ = summary(case, "additive", 3.0)
    assert "Reached without a proof by cpsat (2.90 s, own gap 103%)." in text


def test_the_summary_names_a_solve_call_over_the_budget() -> None:
    case = _lenet_like_case()
    text, _ = summary(case, "additive", 3.0)
    assert "budget" not in text  # 2.95 s for 3 s
    case.rows[3].call_seconds = 3.58
    text, _ = summary(case, "additive", 3.0)
    assert "Over the 3 s budget: cpsat 3.58 s (search 2.90 s)." in text


def test_every_series_of_the_plot_has_its_own_colour_and_marker() -> None:
    methods = ["[data_parallel]", "[model_parallel]", "[owt]", *backend_names(), "extra1"]
    styles = series_styles(methods)
    assert len({c for c, _ in styles.values()}) == len(methods)
    assert len({m for _, m in styles.values()}) == len(methods)
    case = _lenet_like_case()
    case.rows[4].simulated = None  # no value: no marker (not a bar at 0)
    judge(case.rows)
    fig = speedup_figure([case])
    try:
        for ax in fig.axes:
            drawn = [ln for ln in ax.get_lines() if ln.get_label() in styles]
            assert len({(ln.get_color(), ln.get_marker()) for ln in drawn}) == len(case.rows)
        ilp = next(ln for ln in fig.axes[1].get_lines() if ln.get_label() == "ilp")
        assert len(ilp.get_xdata()) == 0
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
