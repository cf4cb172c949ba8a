"""Issue 42, item 3: a cost below 1e18 is allowed however float64 rounds it.

999999999999999999 (docs/costtable.md: only a cost >= 1e18 forbids) rounds to exactly 1e18
as a float64; read through a float it counted as forbidden, so a feasible problem was
reported INFEASIBLE. Every reader (the plain one, the numpy fast reader, the compiled one)
must decide from the number as written, and keep such a cost as the largest float below
1e18.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import planner.problems.costtable as ct
from planner.cli import main
from planner.problems.costtable import brute_force, load_problem, problem_from_json, save_problem
from planner.problems.problem import FORBIDDEN

NEAR = 999999999999999999  # below 1e18, and float(NEAR) == 1e18
BELOW = 999999999999999872.0  # the largest float64 below 1e18

# node 0 has one strategy, of cost NEAR: forbidding it leaves no choice at all
ONLY_NEAR: dict[str, Any] = {
    "problem": {
        "name": "t",
        "nodes": {
            "intervals": [[0, 1], [0, 1]],
            "costs": [[NEAR], [1, 2]],
            "usages": [[1], [1, 1]],
        },
        "edges": {"nodes": [[0, 1]], "costs": [[0, 0]]},
        "usage_limit": 10,
    }
}


def test_the_float_rounding_is_what_the_readers_must_not_trust() -> None:
    assert float(NEAR) == FORBIDDEN and NEAR < 10**18
    assert float(np.nextafter(FORBIDDEN, 0.0)) == BELOW == ct.BELOW_FORBIDDEN


@pytest.mark.parametrize(
    ("written", "forbidden"),
    [
        ("999999999999999999", False),
        ("999999999999999936", False),
        ("999999999999999000", False),
        ("1000000000000000000", True),
        ("1000000000000000001", True),
        ("2000000000000000000", True),
        ("1e18", True),
        ("1.0e18", True),
        ("999999999999999999.0", False),  # a decimal below 1e18 too (parsed exactly)
        ("9.99999999999999999e17", False),
        ("999999999.99999999e9", False),  # no sixteen 9s in a row
        ("99999999999.9999999e7", False),
    ],
)
def test_a_node_cost_is_forbidden_only_from_1e18(
    tmp_path: Path, written: str, forbidden: bool
) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(ONLY_NEAR).replace(str(NEAR), written))
    cost = float(load_problem(f).node_cost[0][0])
    assert math.isinf(cost) == forbidden, cost
    if not forbidden:
        assert cost < FORBIDDEN and cost == pytest.approx(float(written), rel=1e-15)


def test_an_allowed_near_1e18_cost_is_chosen_and_reported(tmp_path: Path) -> None:
    p = problem_from_json(ONLY_NEAR)
    choices, cost = brute_force(p)
    assert choices == (0, 0) and cost == BELOW + 1 and math.isfinite(cost)
    f = tmp_path / "p.json"
    save_problem(p, f)  # written back as an integer below 1e18: still allowed
    assert "999999999999999872" in f.read_text()
    assert float(load_problem(f).node_cost[0][0]) == BELOW


def test_an_edge_cost_near_1e18_is_allowed_too() -> None:
    doc = copy.deepcopy(ONLY_NEAR)
    doc["problem"]["nodes"]["costs"][0] = [0]
    doc["problem"]["edges"]["costs"] = [[NEAR, 10**18]]
    table = problem_from_json(doc).edge_cost[0]
    assert table[0, 0] == BELOW and math.isinf(table[0, 1])


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(
    ("text", "values"),
    [
        (b"[[999999999999999999,1000000000000000000]]", [BELOW, math.inf]),
        (b"[[1,999999999999999999],[7]]", [1, BELOW, 7]),
        (b"[[1.5,999999999999999999],[7]]", None),  # decimals: the exact plain reader
        (b"[[1.5,999999999.99999999e9],[7]]", None),
        (b"[[1.5,2.5],[1e18]]", None),  # a forbidden decimal: told exactly by the plain reader
        (b"[[999999999999999872,1000000000000000001]]", [BELOW, math.inf]),
    ],
)
def test_the_fast_readers_keep_it_allowed(
    text: bytes, values: list[float] | None, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ct, "COMPILED_BYTES", 0 if compiled else 1 << 62)
    got = ct._numeric_rows(text)
    if values is None:
        assert got is None
        return
    assert got is not None
    want = np.array(values)
    np.testing.assert_array_equal(np.where(got[0] >= FORBIDDEN, math.inf, got[0]), want)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("decimal", [False, True, "exponent"])
def test_a_large_file_read_fast_keeps_it_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiled: bool, decimal: bool | str
) -> None:
    doc = copy.deepcopy(ONLY_NEAR)
    doc["problem"]["nodes"]["costs"][0] = [0]
    doc["problem"]["edges"]["costs"] = [[1.5 if decimal else 1, NEAR]]
    f = tmp_path / "p.json"
    text = json.dumps(doc)
    f.write_text(text.replace(str(NEAR), "999999999.99999999e9") if decimal == "exponent" else text)
    monkeypatch.setattr(ct, "FAST_LOAD_BYTES", 0)
    monkeypatch.setattr(ct, "COMPILED_BYTES", 0 if compiled else 1 << 62)
    table = load_problem(f).edge_cost[0]
    assert table[0, 1] == BELOW


def test_plan_reports_the_optimum_not_infeasible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(ONLY_NEAR))
    code = main(["plan", "--problem", str(f), "--backend", "search", "--time-limit", "30"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "INFEASIBLE" not in out + err and "999,999,999,999,999,87" in out, out
