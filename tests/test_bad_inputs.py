"""Two hundred bad inputs, each ending in one clean `error:` line (issue 42's target).

Every case runs `python -m planner` in-process (`planner.cli.main`) with one defect: a bad
option value, or a file (cost table, graph, device graph, plan) with one field deleted, of the
wrong type, negative, not finite or empty. What must hold for each: exit status 2, exactly one
line on stderr and it starts with `error:`, nothing on stdout that claims success, and no
exception out of `main` (which would be a traceback for a user). A case that hangs fails
(SIGALRM). Cases that are valid after all (a mutation of an optional field) are listed in
`ACCEPTED` so that a change in what is accepted is seen.
"""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.costtable import problem_to_json, random_problem

# Seconds one case may take before it counts as a hang (a bad input is refused at once).
HANG_SECONDS = 30

BAD_VALUES: list[tuple[str, Any]] = [
    ("missing", None),  # the key deleted
    ("null", "__null__"),
    ("string", "x"),
    ("negative", -1),
    ("empty-list", []),
    ("object", {"a": 1}),
    ("nan", float("nan")),
    ("huge", 1e308),
]


def _mutations(doc: dict[str, Any], paths: list[tuple[Any, ...]]) -> Iterator[tuple[str, Any]]:
    """`doc` with the value at each path replaced by each bad value (or deleted)."""
    for path in paths:
        for label, value in BAD_VALUES:
            out = copy.deepcopy(doc)
            parent = out
            for key in path[:-1]:
                parent = parent[key]
            if value is None:
                del parent[path[-1]]
            else:
                parent[path[-1]] = None if value == "__null__" else value
            yield f"{'.'.join(map(str, path))}={label}", out


def _problem_doc() -> dict[str, Any]:
    return problem_to_json(random_problem(4, 3, seed=1, forbid_prob=0.0))


def _graph_doc() -> dict[str, Any]:
    return model_graph("lenet5", batch=8).to_json()


def _devices_doc() -> dict[str, Any]:
    return get_preset("p100-1x2").to_json()


PROBLEM_PATHS = [
    ("problem",),
    ("problem", "nodes"),
    ("problem", "nodes", "costs"),
    ("problem", "nodes", "costs", 0),
    ("problem", "nodes", "usages"),
    ("problem", "nodes", "usages", 0),
    ("problem", "nodes", "intervals"),
    ("problem", "nodes", "intervals", 0),
    ("problem", "edges", "nodes"),
    ("problem", "edges", "costs"),
    ("problem", "edges", "costs", 0),
    ("problem", "usage_limit"),
]
GRAPH_PATHS = [
    ("ops",),
    ("ops", 1),
    ("ops", 1, "kind"),
    ("ops", 1, "inputs"),
    ("ops", 1, "output"),
    ("ops", 1, "output", "channel"),
    ("ops", 1, "params"),
    ("ops", 1, "flops"),
]
DEVICE_PATHS = [
    ("devices",),
    ("devices", 0),
    ("devices", 0, "flops"),
    ("devices", 0, "memory"),
    ("devices", 0, "host"),
    ("links",),
    ("links", 0, "bandwidth"),
    ("links", 0, "latency"),
    ("links", 0, "a"),
]

# Mutations that leave a valid input (an optional field, a value the format allows).
ACCEPTED = {
    "problem.usage_limit=missing",
    "problem.usage_limit=null",
    "problem.usage_limit=huge",
    "ops.1.flops=missing",
    "ops.1.params=missing",
    "ops.1.params=empty-list",
    "ops.1.flops=huge",  # finite: the plan's time is astronomical, and says so
    "devices.0.flops=huge",
    "devices.0.memory=huge",
    "devices.0.host=string",  # another host's name
    "links.0.bandwidth=huge",
}


def _file_cases() -> Iterator[Any]:
    for label, doc in _mutations(_problem_doc(), PROBLEM_PATHS):
        yield pytest.param("problem", doc, id=f"problem:{label}")
    for label, doc in _mutations(_graph_doc(), GRAPH_PATHS):
        yield pytest.param("graph", doc, id=f"graph:{label}")
    for label, doc in _mutations(_devices_doc(), DEVICE_PATHS):
        yield pytest.param("devices", doc, id=f"devices:{label}")


def _command(kind: str, path: Path) -> list[str]:
    if kind == "problem":
        return ["plan", "--problem", str(path), "--backend", "ilp", "--time-limit", "5"]
    if kind == "graph":
        return ["plan", "--graph", str(path), "--devices", "p100-1x2", "--backend", "elimination"]
    return ["plan", "lenet5", "--batch", "8", "--devices", str(path), "--backend", "elimination"]


class Hang(Exception):
    pass


def _call(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{' '.join(argv)} did not end within {HANG_SECONDS} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_SECONDS)
    try:
        code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error(code: int, out: str, err: str, what: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{what}: exit {code}, stderr {err!r}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{what}: stderr {err!r}"
    assert "Traceback" not in err and "plan written" not in out, what


@pytest.mark.parametrize(("kind", "doc"), list(_file_cases()))
def test_malformed_file(
    kind: str, doc: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: Any
) -> None:
    label = request.node.callspec.id.split(":", 1)[1]
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    code, out, err = _call(_command(kind, path), capsys)
    if label in ACCEPTED:
        assert code == 0, f"{label} is valid input: {err!r}"
        return
    _assert_one_error(code, out, err, label)


PLAN = ["plan", "lenet5", "--batch", "8", "--devices", "p100-1x2"]
BAD_ARGS: list[list[str]] = [
    [],
    ["nope"],
    ["plan"],
    ["plan", "no_such_model", "--devices", "p100-1x2"],
    ["plan", "no.such.module:f", "--input", "8x3", "--devices", "p100-1x2"],
    ["plan", "os:getcwd", "--input", "8x3", "--devices", "p100-1x2"],
    ["plan", ":", "--devices", "p100-1x2"],
    ["plan", "lenet5", "--devices", "no-such-preset"],
    ["plan", "lenet5", "--devices", "p100-0x4"],
    ["plan", "lenet5", "--devices", ""],
    ["plan", "lenet5", "--devices", "/no/such/file.json"],
    [*PLAN, "--batch", "0"],
    [*PLAN, "--batch", "-1"],
    [*PLAN, "--batch", "x"],
    [*PLAN, "--batch", "1.5"],
    [*PLAN, "--time-limit", "0"],
    [*PLAN, "--time-limit", "-1"],
    [*PLAN, "--time-limit", "nan"],
    [*PLAN, "--time-limit", "abc"],
    [*PLAN, "--seed", "-1"],
    [*PLAN, "--seed", "x"],
    [*PLAN, "--memory-limit", "abc"],
    [*PLAN, "--memory-limit", "-1G"],
    [*PLAN, "--memory-limit", "1B"],
    [*PLAN, "--memory-limit", "nan"],
    [*PLAN, "--backend", "nope"],
    [*PLAN, "--objective", "nope"],
    [*PLAN, "--backend", "search", "--option", "nope=1"],
    [*PLAN, "--backend", "search", "--option", "mode=wrong"],
    [*PLAN, "--backend", "search", "--option", "novalue"],
    [*PLAN, "--set", "nonsense=1"],
    [*PLAN, "--set", "batch"],
    [*PLAN, "--input", "0x3"],
    [*PLAN, "--input", "8x3:float99"],
    [*PLAN, "--space", "nope"],
    [*PLAN, "--pipeline", "maybe"],
    [*PLAN, "--zero", "4"],
    [*PLAN, "--headroom", "1.5"],
    [*PLAN, "--headroom", "-0.1"],
    [*PLAN, "--recompute", "-1"],
    [*PLAN, "--optimizer", "sgdx"],
    [*PLAN, "--max-configs", "0"],
    [*PLAN, "--sync", "tree"],
    [*PLAN, "--cost", "guess"],
    [*PLAN, "-o", "/no/such/dir/plan.json"],
    [*PLAN, "-o", "/"],
    ["graph", "lenet5", "--batch", "0"],
    ["graph", "no_such_model"],
    ["graph", "lenet5", "--json", "/no/such/dir/g.json"],
    ["devices", "no-such-preset"],
    ["devices", "p100-1x2", "--json", "/no/such/dir/d.json"],
    ["evaluate", "/no/such/plan.json"],
    ["evaluate", "/"],
    ["plan", "--problem", "/no/such/problem.json"],
    ["plan", "--problem", "/"],
    ["plan", "--graph", "/no/such/graph.json", "--devices", "p100-1x2"],
    ["profile", "lenet5", "--repeats", "0"],
]


@pytest.mark.parametrize("argv", BAD_ARGS, ids=lambda a: " ".join(a) or "(nothing)")
def test_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _call(argv, capsys)
    _assert_one_error(code, out, err, " ".join(argv))


TEXT_FILES: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("spaces", b"   \n"),
    ("not-json", b"hello"),
    ("truncated", b'{"problem": {"nodes": '),
    ("list", b"[1, 2, 3]"),
    ("number", b"42"),
    ("string", b'"problem"'),
    ("binary", bytes(range(256))),
    ("nan", b'{"problem": NaN}'),
    ("deep", b"[" * 100_000 + b"]" * 100_000),
]


@pytest.mark.parametrize("command", ["problem", "graph", "devices", "evaluate"])
@pytest.mark.parametrize(("label", "data"), TEXT_FILES, ids=[t[0] for t in TEXT_FILES])
def test_not_a_file_of_its_kind(
    command: str, label: str, data: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "input.json"
    path.write_bytes(data)
    argv = ["evaluate", str(path)] if command == "evaluate" else _command(command, path)
    code, out, err = _call(argv, capsys)
    _assert_one_error(code, out, err, f"{command} {label}")


def test_the_cases_number_two_hundred() -> None:
    """Issue 42's target: a run of 200 bad inputs, each one clean line."""
    files = len(list(_file_cases())) - len(ACCEPTED)
    assert files + len(BAD_ARGS) + 4 * len(TEXT_FILES) >= 200
