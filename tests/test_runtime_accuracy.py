"""experiments.accuracy: statistics, candidate strategies, and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from budget import time_budget

from experiments.accuracy import MODELS, Row, candidates, main, ranks, spearman, summarize
from planner.costs.costmodel import CostModel
from planner.hardware.presets import get_preset
from planner.problems.problem import build_problem


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(120):
        yield


def test_ranks_average_ties() -> None:
    assert list(ranks([10.0, 30.0, 20.0, 20.0])) == [1.0, 4.0, 2.5, 2.5]


def test_spearman() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(spearman([1, 2], [1, 2]))
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))


def test_summary_compares_the_planner_with_data_parallelism() -> None:
    rows = [
        Row("m", "data_parallel", 2.0, 4.0, -0.5, 0, None),
        Row("m", "elimination", 1.0, 2.0, -0.5, 0, None),
        Row("m", "mcmc", 1.5, 1.0, 0.5, 0, None),
        Row("m", "random0", 3.0, 3.0, 0.0, 0, None),
    ]
    (s,) = summarize(rows)
    assert s["median_abs_error"] == 0.5 and s["best_planned"] == "elimination"
    assert s["predicted_speedup_over_dp"] == 2.0 and s["measured_speedup_over_dp"] == 2.0


def test_candidates_are_distinct_and_include_the_planners() -> None:
    spec = MODELS["lenet5"]
    devices = get_preset("cpu-local-2")
    graph = spec.graph()
    problem = build_problem(graph, devices, CostModel(graph, devices))
    named = candidates(problem, 12, seed=0, mcmc_seconds=1.0)
    names = [n for n, _ in named]
    assert len(named) == 12 and len({s.configs for _, s in named}) == 12
    parts = {part for n in names for part in n.split("+")}
    assert {"data_parallel", "model_parallel", "owt", "one_worker", "elimination"} <= parts


@pytest.mark.slow  # 40 s: profiling, 10 runtime runs; the parts are tested above and below
def test_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny run: lenet5 profiled into a private cache, 10 strategies, CSV/JSON/plot. The
    suite may run on a busy machine: --max-load inf measures anyway (and records the load)."""
    args = ["--models", "lenet5", "--steps", "2", "--warmup", "1", "--repeats", "1"]
    args += ["--mcmc-seconds", "1", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path)]
    args += ["--wait-idle", "0", "--max-load", "inf"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "median |error|" in out and "spearman" in out
    assert "runtime overhead per task" in out and "message overhead" in out
    (folder,) = tmp_path.glob("accuracy-*")
    data = json.loads((folder / "accuracy.json").read_text())
    assert len(data["rows"]) == 10 and data["summary"][0]["model"] == "lenet5"
    notes = data["measurements"]  # where each measurement used comes from: time and load
    assert set(notes) == {"cpu-local figures", "op costs of lenet5", "op costs of runtime-probe"}
    assert all(" per core (busy above " in note for note in notes.values()), notes
    for row in data["rows"]:  # two rounds by default; the fastest counts
        assert len(row["rounds"]) == 2 and row["measured"] == min(row["rounds"])
    assert (folder / "accuracy.csv").exists() and (folder / "accuracy.png").exists()


def test_keep_links_keeps_only_trusted_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--keep-links measures the cpu-local figures again when the cached ones are untrusted
    (here: an older cache, with no recorded load). The load is faked; nothing is timed."""
    import planner.hardware.presets as presets
    from experiments.accuracy import link_figures
    from planner.hardware.load import Load

    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LAYERWISE_MAX_LOAD", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr("experiments.accuracy._wait_for_idle", lambda *a: None)
    cache = tmp_path / "cpu-local.json"
    old = dict(presets.CPU_LOCAL_DEFAULTS) | {"latency": 2e-3}
    cache.write_text(json.dumps(old))
    measured: list[int] = []

    def measure(n: int, path: Path | None = None, max_load: float | None = None) -> None:
        measured.append(n)
        quiet = {"measured_at": datetime.now(UTC).isoformat(), "load": Load(0.0, 0.1, 2).to_json()}
        cache.write_text(json.dumps(dict(presets.CPU_LOCAL_DEFAULTS) | quiet))

    monkeypatch.setattr(presets, "measure_cpu_local", measure)
    args = argparse.Namespace(keep_links=True, workers=2, wait_idle=0.0, max_load=None)
    said: list[str] = []
    notes: dict[str, str] = {}
    link_figures(args, said.append, notes)
    assert measured == [2] and "untrusted; measuring them again" in said[0]
    assert "at load 0.05 per core" in notes["cpu-local figures"] and "latency 60 us" in said[-1]
    link_figures(args, said.append, notes)  # trusted now: kept
    assert measured == [2]


def test_probe_graph_is_a_chain_of_tiny_ops() -> None:
    from experiments.accuracy import PROBE_OPS, probe_graph

    g = probe_graph()
    kinds = [op.kind for op in g.ops]
    assert kinds == ["input"] + ["linear"] * PROBE_OPS + ["softmax"]
    assert len(g.edges) == PROBE_OPS + 1


@pytest.mark.parametrize(
    "args, says",
    [
        (["--timeout", "-5"], "seconds > 0"),
        (["--wait-idle", "-1"], "seconds >= 0"),
        (["--task-overhead", "inf"], "seconds >= 0"),
        (["--models", "resnet50"], "unknown model"),
        (["--preset", "cpu-local-x"], "cpu-local-N preset"),
        (["--preset", "p100-1x4"], "cpu-local-N preset"),
        (["--max-load", "-0.5"], "load average per core >= 0"),
    ],
)
def test_bad_arguments_are_one_line_errors(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1, err
