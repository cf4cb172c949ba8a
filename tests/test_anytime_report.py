"""`experiments.anytime`: the metrics on hand-made step functions, performance profiles on a
hand example, and the report on a small synthetic results folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from experiments import anytime
from experiments.anytime import (
    case_metrics,
    performance_profile,
    primal_dual_integral,
    primal_gap,
    primal_integral,
    rho,
    time_to_target,
)
from experiments.dispatch import trace_name

# best 100, horizon 10: no answer until 2, then 200, 110 from 4, 100.5 from 8
INCUMBENT = [(2.0, 200.0), (4.0, 110.0), (8.0, 100.5)]
BOUND = [(3.0, 50.0), (6.0, 90.0)]


def test_primal_gap_follows_berthold() -> None:
    assert primal_gap(None, 100.0) == 1.0
    assert primal_gap(0.0, 0.0) == 0.0
    assert primal_gap(-5.0, 10.0) == 1.0
    assert primal_gap(200.0, 100.0) == 0.5
    assert primal_gap(90.0, 100.0) == pytest.approx(0.1)  # better than the reference


def test_time_to_target_on_a_step_function() -> None:
    assert time_to_target(INCUMBENT, 100.0, 0.01, 10.0) == 8.0
    assert time_to_target(INCUMBENT, 100.0, 0.001, 10.0) is None
    assert time_to_target(INCUMBENT, 100.0, 0.01, 7.0) is None  # after the horizon
    assert time_to_target(INCUMBENT, 110.0, 0.0, 10.0) == 4.0


def test_primal_and_primal_dual_integrals_by_hand() -> None:
    pi = 2 * 1 + 2 * (100 / 200) + 4 * (10 / 110) + 2 * (0.5 / 100.5)
    assert primal_integral(INCUMBENT, 100.0, 10.0) == pytest.approx(pi, rel=1e-12)
    # [0,3): 1 (no answer, then no bound); [3,4): 150/200; [4,6): 60/110; [6,8): 20/110;
    # [8,10): 10.5/100.5
    pdi = 3 * 1 + 1 * 0.75 + 2 * (60 / 110) + 2 * (20 / 110) + 2 * (10.5 / 100.5)
    assert primal_dual_integral(INCUMBENT, BOUND, 10.0) == pytest.approx(pdi, rel=1e-12)
    m = case_metrics(INCUMBENT, BOUND, 100.0, 10.0)
    assert m["time_to_1pct"] == 8.0 and m["time_to_0_1pct"] is None
    assert m["primal_integral_norm"] == pytest.approx(pi / 10)
    assert m["primal_dual_integral_norm"] == pytest.approx(pdi / 10)
    # past the horizon nothing counts; an answer at 0 equal to the best: no gap at all
    assert primal_integral(INCUMBENT, 100.0, 3.0) == pytest.approx(2 + 0.5)
    assert primal_integral([(0.0, 100.0)], 100.0, 5.0) == 0.0
    assert case_metrics([], [], None, 5.0)["primal_dual_integral_norm"] == 1.0


def test_a_negative_target_gets_the_same_rounding_slack() -> None:
    # -100 within 0% is -100: a value a rounding above it (-99.99999999999999) still counts
    assert time_to_target([(1.0, -100.0 + 1e-14)], -100.0, 0.0, 10.0) == 1.0
    assert time_to_target([(1.0, 100.0 + 1e-14)], 100.0, 0.0, 10.0) == 1.0


def test_an_answer_just_past_the_limit_counts_at_it() -> None:
    # the answer written just after T (loading, exit): at T, not never
    points = anytime.shifted([(0.5, 300.0), (9.75, 100.0)], 0.3, 10.0)
    assert points == [(0.8, 300.0), (10.0, 100.0)]
    assert case_metrics(points, [], 100.0, 10.0)["time_to_1pct"] == 10.0


def test_the_integral_sweep_matches_a_scan_at_every_change_point() -> None:
    rng = np.random.default_rng(0)
    inc = sorted(zip(rng.uniform(0, 12, 300), rng.uniform(100, 400, 300), strict=True))
    inc = [(t, v) for k, (t, v) in enumerate(inc) if v < min([w for _, w in inc[:k]] + [1e9])]
    bnd = sorted(zip(rng.uniform(0, 12, 200), rng.uniform(0, 100, 200), strict=True))
    bnd = [(t, v) for k, (t, v) in enumerate(bnd) if v > max([w for _, w in bnd[:k]] + [-1.0])]

    def at(points: list[tuple[float, float]], t: float) -> float | None:
        before = [v for s, v in points if s <= t]
        return before[-1] if before else None

    times = sorted({0.0, 10.0} | {t for t, _ in inc + bnd if t < 10})
    want = sum(
        anytime.primal_dual_gap(at(inc, a), at(bnd, a)) * (b - a)
        for a, b in zip(times, times[1:], strict=False)
    )
    assert primal_dual_integral(inc, bnd, 10.0) == pytest.approx(want, rel=1e-12)


def test_performance_profile_by_hand() -> None:
    inf = math.inf
    metric = {
        "I1": {"a": 10.0, "b": 20.0},
        "I2": {"a": 30.0, "b": 15.0},
        "I3": {"a": inf, "b": 5.0},
        "I4": {"a": inf, "b": inf},  # nobody: failed for both
        "I5": {"b": 7.0},  # a did not run: failed
    }
    instances, ratios = performance_profile(metric)
    assert instances == ["I1", "I2", "I3", "I4", "I5"]
    assert ratios["a"] == [1.0, 2.0, inf, inf, inf]
    assert ratios["b"] == [1.0, 1.0, 1.0, 2.0, inf]
    assert rho(ratios["a"], 1.0) == 0.2 and rho(ratios["a"], 2.0) == 0.4
    assert rho(ratios["b"], 1.0) == 0.6 and rho(ratios["b"], 1.99) == 0.6
    assert rho(ratios["b"], 2.0) == 0.8 and rho(ratios["b"], 1e9) == 0.8


def _folder(tmp_path: Path) -> Path:
    """Two instances x two backends x two seeds: rows.json and traces/."""
    folder = tmp_path / "run"
    (folder / anytime.TRACES).mkdir(parents=True)
    rows = []
    for inst, best in (("A", 1000.0), ("B", 50.0)):
        for backend, slow in (("fast", 1.0), ("slow", 4.0)):
            for seed in (0, 1):
                final = best * (1.0 + 0.002 * seed) * (1.0 if backend == "fast" else 1.02)
                rows.append({
                    "instance": inst, "backend": backend, "seed": seed, "time_limit": 20.0,
                    "background": 0, "cost": final, "bound": best * 0.9, "best": best,
                    "valid": "yes",
                })  # fmt: skip
                trace = {
                    "offset": 0.5,
                    "incumbent": [[0.1 * slow, best * 3], [slow * (1 + seed), final]],
                    "bound": [[1.0, best * 0.5], [2.0 * slow, best * 0.9]],
                }
                name = trace_name((inst, backend, seed, 20.0, 0))
                (folder / anytime.TRACES / name).write_text(json.dumps(trace))
    (folder / "rows.json").write_text(json.dumps({"run": {}, "rows": rows}))
    return folder


def test_the_report_on_a_synthetic_folder(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    assert anytime.main([str(folder)]) == 0
    for name in ("profile-cost.png", "profile-time-1pct.png", "curve-A.png", "curve-B.png"):
        path = folder / name
        assert path.exists() and path.stat().st_size > 1000, name
        assert path.read_bytes()[:4] == b"\x89PNG"
    summary = {
        (r["instance"], r["solver"]): r for r in anytime.summary(anytime.read_cases([folder]))
    }
    fast, slow = summary[("A", "fast")], summary[("A", "slow")]
    assert fast["seeds"] == 2
    assert fast["ratio_min"] == 1.0 and fast["ratio_max"] == pytest.approx(1.002)
    # fast reaches its final cost at 0.5 + 1 (seed 0) and 0.5 + 2 (seed 1); slow never gets
    # within 1% (1.02x the best)
    assert fast["time_to_1pct_min"] == 1.5 and fast["time_to_1pct_max"] == 2.5
    assert fast["time_to_1pct_median"] == 2.0
    assert slow["time_to_1pct_median"] == math.inf
    md = (folder / "anytime.md").read_text()
    assert "| A | slow | 2 |" in md and "never" in md
    assert (folder / "anytime.csv").read_text().startswith("instance,solver,seeds,")


def test_the_report_refuses_a_folder_without_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert anytime.main([str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "rows.json" in err[0]


def _rows_at(tmp_path: Path, limits: dict[str, list[float]]) -> Path:
    """A folder of rows (no traces) of backend "b" on each instance at each of its limits."""
    folder = tmp_path / "limits"
    folder.mkdir()
    rows = [
        {"instance": inst, "backend": "b", "seed": 0, "time_limit": limit, "background": 0,
         "cost": 10.0, "bound": 9.0, "best": 10.0, "valid": "yes"}
        for inst, its in limits.items() for limit in its
    ]  # fmt: skip
    (folder / "rows.json").write_text(json.dumps({"run": {}, "rows": rows}))
    return folder


def test_each_instance_at_its_own_limit_is_one_solver(tmp_path: Path) -> None:
    # the contest's limits differ by instance (60 s for A, 120 s for G): one solver, not one
    # per limit (each of which would have been the only solver on its one instance)
    cases = anytime.read_cases([_rows_at(tmp_path, {"A": [60.0], "G": [120.0]})])
    assert {c.label for c in cases} == {"b"}


def test_an_instance_at_two_limits_names_the_limit(tmp_path: Path) -> None:
    cases = anytime.read_cases([_rows_at(tmp_path, {"A": [10.0, 60.0], "G": [120.0]})])
    assert {c.label for c in cases} == {"b 10s", "b 60s", "b 120s"}


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("rows.csv", "instance,backend\nA,b\n", "row 1 has no seed, time_limit"),
        ("rows.csv", "instance,backend,seed,time_limit\nA,b,x,5\n", "is not a number"),
        ("rows.json", '{"rows": [', "is not valid JSON"),
        ("rows.json", '{"rows": 3}', "holds no list of rows"),
    ],
)
def test_a_bad_rows_file_is_one_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, says: str
) -> None:
    (tmp_path / name).write_text(text)
    assert anytime.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and says in err, err
    assert str(tmp_path) in err
