"""`python -m experiments.scaling`: arguments, one case, the growth fit and the plot."""

from __future__ import annotations

import json
import math

import pytest

from experiments import scaling


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "resnet9000"], "unknown model"),
        (["--devices", "0"], "positive integer"),
        (["--families", "tpu"], "invalid choice"),
        (["--time-limit", "-1"], "--time-limit"),
    ],
)
def test_bad_arguments_are_one_error_line(argv, message, capsys) -> None:
    assert scaling.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_presets_per_family() -> None:
    assert scaling.preset_for("p100", 1024) == "p100-256x4"
    assert scaling.preset_for("dgx", 1024) == "dgx-a100-128"
    assert scaling.preset_for("dgx", 4) is None


def test_growth_is_the_least_squares_exponent() -> None:
    devices = [4, 16, 64, 256]
    assert scaling.growth(devices, [3 * d**2 for d in devices]) == pytest.approx(2.0)
    assert scaling.growth(devices, [5.0 * d**0.5 for d in devices]) == pytest.approx(0.5)
    assert scaling.growth([4], [1.0]) is None


def test_one_case_reports_every_phase(capsys) -> None:
    assert scaling.main(["--case", "lenet5", "p100-1x4", "--per-device-batch", "8"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    phases = [r["phase"] for r in records]
    assert phases == [
        "devices",
        "graph",
        "simulate_dp",
        "build",
        "solve_elimination",
        "simulate_found",
    ]
    last = records[-1]
    assert last["batch"] == 32 and last["elimination_status"] == "OPTIMAL"
    assert last["configs_max"] >= 1 and last["table_entries"] > 0
    assert math.isclose(last["speedup_over_dp"], last["dp_ms"] / last["found_ms"])
    assert last["peak_rss_gib"] > 0


def test_plot_writes_a_log_log_chart(tmp_path) -> None:
    rows = [
        {"model": "m", "preset": f"p100-{d // 4}x4", "devices": d, "build_seconds": 0.1 * d,
         "elimination_seconds": 0.01 * d * d, "dp_sim_seconds": 0.2, "peak_rss_gib": 0.3}
        for d in (4, 16, 64)
    ]  # fmt: skip
    scaling.plot(rows, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_driver_measures_cases_in_subprocesses(tmp_path) -> None:
    argv = ["--models", "lenet5", "--devices", "4", "--out", str(tmp_path)]
    assert scaling.main([*argv, "--per-device-batch", "8"]) == 0
    data = json.loads((tmp_path / "scaling.json").read_text())
    (row,) = data["rows"]
    assert row["outcome"] == "ok" and row["phase"] == "simulate_found"
    assert (tmp_path / "scaling.csv").exists() and (tmp_path / "scaling.png").exists()
