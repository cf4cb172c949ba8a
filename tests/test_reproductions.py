"""The paper reproductions (experiments.optcnn_fig7, experiments.flexflow_throughput) on tiny
settings: what they compute, what they write, and their one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments import flexflow_throughput, optcnn_fig7
from experiments.throughput import (
    LocalBatchNormCostModel,
    Point,
    build,
    lookup,
    preset_for,
    score_baseline,
)
from planner.costs.costmodel import CostModel
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.sim.simulator import simulate
from tests.graphs import chain_cnn


def results(out: Path) -> tuple[Path, dict[str, Any]]:
    (folder,) = out.iterdir()
    return folder, json.loads((folder / "results.json").read_text())


def test_presets_follow_the_papers_nodes_of_four() -> None:
    assert [preset_for(g) for g in (1, 2, 4, 8, 16, 64)] == [
        "p100-1x1",
        "p100-1x2",
        "p100-1x4",
        "p100-2x4",
        "p100-4x4",
        "p100-16x4",
    ]
    assert preset_for(8, "k80") == "k80-2x4"
    with pytest.raises(ValueError, match="nodes"):
        preset_for(6)


def test_optcnn_fig7_on_one_and_two_gpus(tmp_path: Path) -> None:
    plot = tmp_path / "fig7.png"
    argv = ["--models", "lenet5", "--gpus", "1", "2", "--out", str(tmp_path / "r")]
    assert optcnn_fig7.main([*argv, "--plot", str(plot)]) == 0
    _, data = results(tmp_path / "r")
    assert data["run"]["command"].startswith("python -m experiments.optcnn_fig7")
    assert [(s["gpus"], s["batch"], s["preset"]) for s in data["settings"]] == [
        (1, 32, "p100-1x1"),
        (2, 64, "p100-1x2"),
    ]
    points = [Point(**p) for p in data["points"]]
    assert {p.strategy for p in points} == set(optcnn_fig7.STRATEGIES)
    for p in points:
        batch = 32 * p.gpus
        assert p.throughput == pytest.approx(batch / p.simulated, rel=1e-12), p
    one = {p.throughput for p in points if p.gpus == 1}
    assert max(one) == pytest.approx(min(one), rel=1e-9)  # one GPU: every strategy is the same
    ours = optcnn_fig7.headline(points, "lenet5", [1, 2])
    lw = [lookup(points, "lenet5", g, "layer-wise") for g in (1, 2)]
    assert ours["scaling"] == pytest.approx(lw[1].throughput / lw[0].throughput)  # type: ignore[union-attr,operator]
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_a_finished_run_prints_and_plots_again_from_its_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--models", "lenet5", "--gpus", "1", "2", "--out", str(tmp_path)]
    assert optcnn_fig7.main([*argv, "--sync", "ps"]) == 0
    folder, _ = results(tmp_path)
    first = capsys.readouterr().out
    plot = tmp_path / "again.png"
    again = ["--from-results", str(folder / "results.json"), "--plot", str(plot)]
    assert optcnn_fig7.main(again) == 0  # its own settings (ps sync), nothing computed
    second = capsys.readouterr().out
    table = first[first.index("Training throughput") : first.index("setting:")]
    assert table in second and "ps sync" in second
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert len(list(tmp_path.iterdir())) == 2  # no new results folder (the folder + again.png)
    assert optcnn_fig7.main(["--from-results", str(folder / "plans.json")]) == 2
    assert flexflow_throughput.main(["--from-results", str(folder / "results.json")]) == 2
    assert "not a results file of experiments.flexflow_throughput" in capsys.readouterr().err


def test_optcnn_fig7_shows_the_papers_scaling_only_for_1_to_16_gpus() -> None:
    points = [
        Point("alexnet", g, s, 1.0, 1.0, float(g)) for g in (1, 2) for s in optcnn_fig7.STRATEGIES
    ]
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(optcnn_fig7.paper_table(points, ["alexnet"], [1, 2]))
    text = console.export_text()
    assert "12.2x" not in text and "2.2x" in text  # "up to" is quoted, 16 / 1 is not


def test_flexflow_throughput_on_four_gpus(tmp_path: Path) -> None:
    argv = ["--models", "lenet5", "rnnlm", "--gpus", "4", "--time-limit", "0.5"]
    assert flexflow_throughput.main([*argv, "--out", str(tmp_path)]) == 0
    folder, data = results(tmp_path)
    assert (folder / "flexflow_throughput.png").exists()
    assert [(s["model"], s["batch"]) for s in data["settings"]] == [
        ("lenet5", 256),
        ("rnnlm", 256),
    ]
    points = [Point(**p) for p in data["points"]]
    assert {p.strategy for p in points} == set(flexflow_throughput.STRATEGIES)
    expert = {p.model: p.note for p in points if p.strategy == "expert"}
    assert expert == {"lenet5": "owt", "rnnlm": "expert"}  # the paper's experts: OWT, GNMT
    mcmc = lookup(points, "rnnlm", 4, "mcmc")
    assert mcmc is not None and mcmc.simulated is not None and mcmc.status.startswith("FEASIBLE")


def test_flexflow_batches_are_per_gpu_or_global() -> None:
    args = flexflow_throughput.parse_args(["--models", "alexnet", "rnnlm"])
    assert flexflow_throughput.batch_of(args, "alexnet", 16) == 256 * 16
    assert flexflow_throughput.batch_of(args, "rnnlm", 16) == 64 * 16
    args = flexflow_throughput.parse_args(["--batch-mode", "global"])
    assert flexflow_throughput.batch_of(args, "alexnet", 16) == 256


def test_local_batch_norm_prices_no_statistics_exchange() -> None:
    graph, devices = chain_cnn(), get_preset("p100-1x2")
    dp = data_parallel(graph, devices)
    synced = simulate(CostModel(graph, devices), dp).makespan
    local = simulate(LocalBatchNormCostModel(graph, devices), dp).makespan
    assert local < synced
    problem, setting = build("lenet5", 2, 64, batch_norm="local")
    assert setting.batch_norm == "local" and isinstance(problem.dnn().cost_model, CostModel)
    additive, simulated = score_baseline(problem, "data_parallel")
    assert additive > 0 and simulated > 0


@pytest.mark.parametrize(
    ("module", "argv", "expected"),
    [
        (optcnn_fig7, ["--gpus", "6"], "nodes of 4"),
        (optcnn_fig7, ["--models", "nope"], "unknown model"),
        (optcnn_fig7, ["--per-gpu-batch", "8", "--global-batch", "8"], "not allowed with"),
        (optcnn_fig7, ["--gpus", "0"], "--gpus"),
        (flexflow_throughput, ["--time-limit", "0"], "--time-limit"),
        (flexflow_throughput, ["--cluster", "tpu"], "--cluster"),
        (flexflow_throughput, ["--gpus", "12", "10"], "nodes of 4"),
    ],
)
def test_bad_input_is_one_error_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    module: Any,
    argv: list[str],
    expected: str,
) -> None:
    assert module.main([*argv, "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not any(tmp_path.iterdir())


def test_pipeline_chart_draws_a_one_f_one_b_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments import pipeline_chart

    out = tmp_path / "chart.png"
    argv = ["--stages", "2", "--layers", "2", "--batch", "8", "--micro-batches", "4"]
    assert pipeline_chart.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.stat().st_size > 0 and "1f1b: 2 stages x 1 chunk, 4 micro-batches" in printed
    assert "closed form on uniform stages with free messages 20.0%" in printed
