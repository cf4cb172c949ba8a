"""`python -m planner`: every command's success path, and one-line errors for bad input.

Commands run in-process through `planner.cli.main` (fast); one subprocess proves the
`python -m planner` entry point.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from planner.cli import build_parser, main
from planner.cli.output import PLAN_GROUPS, PLAN_ROWS, print_ops
from planner.costs.config import device_ranges
from planner.files import strict_json
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import MODELS, model_graph
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel
from planner.problems.costtable import contest_problem, load_problem, random_problem, save_problem
from planner.problems.evaluate import additive_cost
from planner.problems.problem import Problem
from planner.problems.strategy import load_strategy

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["lenet5", "--batch", "8"]
DEVICES = ["--devices", "p100-1x4"]
LENET5_PARAMETER_BYTES = 4 * 61706  # float32 weights and biases of LeNet-5 (10 classes)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "error" not in err
    return out


def only_json(out: str) -> dict[str, Any]:
    """The one JSON object `plan --json` prints: the whole of stdout, strict JSON."""
    assert len(out.strip().splitlines()) == 1, out

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    data: dict[str, Any] = json.loads(out, parse_constant=refuse)
    return data


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Good and bad input files, written once for the module."""
    d = tmp_path_factory.mktemp("cli")
    graph = model_graph("lenet5", batch=8)
    graph.save(d / "graph.json")
    get_preset("p100-1x4").save(d / "devices.json")

    cyclic = json.loads((d / "graph.json").read_text())
    for op in cyclic["ops"]:
        if op["name"] == "conv2":
            op["inputs"] = ["pool2"]  # conv2 -> pool2 -> conv2
    (d / "cycle.json").write_text(json.dumps(cyclic))

    dev = json.loads((d / "devices.json").read_text())
    dev["links"][0]["bandwidth"] = 0
    (d / "zero_bandwidth.json").write_text(json.dumps(dev))
    (d / "not_json.json").write_text("this is { not JSON")
    (d / "binary.json").write_bytes(bytes(range(256)))

    save_problem(random_problem(6, 3, seed=0), d / "problem.json")
    (d / "malformed_problem.json").write_text(json.dumps({"problem": {"nodes": {"costs": [[1]]}}}))

    assert main(["plan", *MODEL, *DEVICES, "-o", str(d / "plan.json")]) == 0
    plan = json.loads((d / "plan.json").read_text())
    tampered = json.loads(json.dumps(plan))
    tampered["graph"]["fingerprint"] = "0" * len(plan["graph"]["fingerprint"])
    (d / "tampered.json").write_text(json.dumps(tampered))
    changes: dict[str, dict[str, Any]] = {
        "embedded_graph_list": {"graph": [1]},
        "bad_cost": {"cost": [1]},
        "bad_cost_source": {"cost": {"source": "guessed"}},
        "bad_cost_option": {"cost": {"compute_efficiency": "high", "source": "analytic"}},
    }
    for name, change in changes.items():
        (d / f"{name}.json").write_text(json.dumps({**plan, **change}))
    return {p.stem: str(p) for p in d.iterdir()} | {"missing": str(d / "missing.json")}


# -- success paths ------------------------------------------------------------------------


def test_models_lists_every_zoo_model_with_its_arguments(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = ok(capsys, "models")
    for name in MODELS:
        assert any(line.startswith(name) for line in out.splitlines()), name
    assert "image_size=32" in out


def test_graph_summary_is_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    small = json.loads(ok(capsys, "graph", *MODEL, "--summary"))
    assert small["ops"] == len(model_graph("lenet5", batch=8).ops) > 0
    assert small["parameter_bytes"] == LENET5_PARAMETER_BYTES
    assert small["forward_flops"] > 0
    big = json.loads(ok(capsys, "graph", "lenet5", "--batch", "16", "--summary"))
    assert big["forward_flops"] == pytest.approx(2 * small["forward_flops"], rel=1e-12)
    assert big["parameter_bytes"] == small["parameter_bytes"]
    wide = json.loads(ok(capsys, "graph", *MODEL, "--set", "num_classes=20", "--summary"))
    assert wide["parameter_bytes"] == LENET5_PARAMETER_BYTES + 4 * 10 * (84 + 1)


def test_set_takes_an_optional_size_of_its_declared_type(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Llama's `hidden_dim` defaults to None (Meta's rule sizes the feed-forward): --set gives
    it an integer, as for Llama 3.1 405B's 53,248 (it was refused: "must be NoneType")."""
    tiny = ["llama3-8b", "--set", "n_layers=1", "--set", "dim=64", "--set", "n_heads=4"]
    tiny += ["--set", "n_kv_heads=2", "--set", "vocab_size=128", "--set", "seq=8"]
    rule = json.loads(ok(capsys, "graph", *tiny, "--summary"))
    wide = json.loads(ok(capsys, "graph", *tiny, "--set", "hidden_dim=1000", "--summary"))
    # three 64 x hidden matrices of the SwiGLU feed-forward, float32
    rule_hidden = 1024  # Meta's rule at dim 64, multiple_of 1024
    assert wide["parameter_bytes"] - rule["parameter_bytes"] == 4 * 3 * 64 * (1000 - rule_hidden)


def test_precision_changes_the_dtypes_priced(capsys: pytest.CaptureFixture[str]) -> None:
    """--precision bf16-true halves the parameter bytes; bf16-mixed keeps fp32 weights."""
    base = json.loads(ok(capsys, "graph", *MODEL, "--summary"))
    true = json.loads(ok(capsys, "graph", *MODEL, "--precision", "bf16-true", "--summary"))
    mixed = json.loads(ok(capsys, "graph", *MODEL, "--precision", "bf16", "--summary"))
    assert true["parameter_bytes"] * 2 == base["parameter_bytes"] == mixed["parameter_bytes"]


def test_graph_json_round_trips_through_opgraph_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = ok(capsys, "graph", *MODEL, "--json", str(tmp_path / "g.json"))
    assert out.startswith("lenet5: ") and "kinds: " in out
    loaded = OpGraph.load(tmp_path / "g.json")
    assert loaded.fingerprint() == model_graph("lenet5", batch=8).fingerprint()


def test_devices_json_round_trips_through_devicegraph_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = ok(capsys, "devices", "p100-1x4", "--json", str(tmp_path / "d.json"))
    assert "4 devices" in out
    assert DeviceGraph.load(tmp_path / "d.json") == get_preset("p100-1x4")
    assert "4 devices" in ok(capsys, "devices", str(tmp_path / "d.json"))


def test_plan_a_model_writes_a_strategy_that_evaluate_rescores(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan_path = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "plan", *MODEL, *DEVICES, "--backend", "baselines", "-o", str(plan_path), "--json"
    )
    lines = err.strip().splitlines()
    assert code == 0 and lines[-1] == f"plan written to {plan_path}"
    assert all("recommending data_parallel" in line for line in lines[:-1])  # the re-rank rule
    printed = only_json(out)
    saved = json.loads(plan_path.read_text())
    for key in ("status", "objective", "bound", "backend", "search_seconds", "total_seconds"):
        assert key in saved and saved[key] == printed[key], key
    assert saved["status"] == "FEASIBLE" and saved["backend"] == "baselines"
    assert saved["objective"] > 0 and saved["search_seconds"] >= 0
    assert saved["graph"]["model"]["name"] == "lenet5" and saved["graph"]["model"]["batch"] == 8
    strategy, _ = load_strategy(plan_path)  # OUT is itself a strategy file
    assert len(strategy.configs) == len(model_graph("lenet5", batch=8).ops)

    scored = json.loads(ok(capsys, "evaluate", str(plan_path), "--json"))
    assert math.isclose(scored["additive"], saved["objective"], rel_tol=1e-9)
    assert scored["additive"] == pytest.approx(
        scored["compute"] + scored["sync"] + scored["transfer"], rel=1e-9
    )
    text = ok(capsys, "evaluate", str(plan_path))
    assert text.startswith("additive") and f"{saved['objective'] * 1e3:.3f} ms" in text


def test_plan_from_a_graph_file_matches_the_model_plan(
    capsys: pytest.CaptureFixture[str], files: dict[str, str]
) -> None:
    from_graph = only_json(ok(capsys, "plan", "--graph", files["graph"], *DEVICES, "--json"))
    from_model = json.loads(Path(files["plan"]).read_text())
    assert from_graph["status"] == from_model["status"]
    assert math.isclose(from_graph["objective"], from_model["objective"], rel_tol=1e-9)
    # a device-graph JSON file works as --devices too
    from_json = only_json(ok(capsys, "plan", *MODEL, "--devices", files["devices"], "--json"))
    assert math.isclose(from_json["objective"], from_model["objective"], rel_tol=1e-9)


def test_plan_a_cost_table_problem_writes_its_choices(
    capsys: pytest.CaptureFixture[str], files: dict[str, str], tmp_path: Path
) -> None:
    out_path = tmp_path / "choices.json"
    out = ok(capsys, "plan", "--problem", files["problem"], "-o", str(out_path), "--json")
    saved = json.loads(out_path.read_text())
    assert saved["backend"] == saved["auto"]["chose"] == "portfolio"  # it has a memory limit
    assert saved["status"] in ("OPTIMAL", "FEASIBLE")
    assert only_json(out)["objective"] == saved["objective"]
    problem = load_problem(files["problem"])
    assert len(saved["choices"]) == problem.num_nodes
    assert math.isclose(additive_cost(problem, saved["choices"]), saved["objective"], rel_tol=1e-9)
    assert {"bound", "search_seconds"} <= set(saved)


def test_a_cost_table_objective_is_printed_as_the_plain_number_it_is(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Cost-table costs have no unit: 1,549,187,759 is not '1.549e+12 ms' (x1000 as if
    seconds), in the summary line nor in --json."""
    cost = 1_549_187_759.0
    problem = Problem("big", ("a", "b"), (np.array([cost - 7, cost + 1]), np.array([7.0])), (), ())
    save_problem(problem, tmp_path / "big.json")
    argv = ["plan", "--problem", str(tmp_path / "big.json"), "--backend", "elimination"]
    out = ok(capsys, *argv)
    assert out.startswith("OPTIMAL: additive 1,549,187,759, bound 1,549,187,759, gap 0%"), out
    assert " ms" not in out and "e+" not in out
    assert only_json(ok(capsys, *argv, "--json"))["objective"] == cost


def test_a_dnn_objective_is_printed_in_ms(capsys: pytest.CaptureFixture[str]) -> None:
    out = ok(capsys, "plan", *MODEL, *DEVICES, "--backend", "elimination", "--no-recommend")
    objective = only_json(
        ok(capsys, "plan", *MODEL, *DEVICES, "--backend", "elimination", "--no-recommend", "--json")
    )["objective"]
    assert f"OPTIMAL: additive {objective * 1e3:.4g} ms, bound " in out


def _rows(n: int, devices: int) -> list[tuple[str, str, str]]:
    """n op rows of a plan on `devices` devices: all data parallel but every tenth op."""
    dp = f"sample={devices} @ [{device_ranges(range(devices))}]"
    strided = f"channel=4 @ [{device_ranges(range(0, devices, devices // 4))}]"
    return [(f"layer{i}.conv", "conv2d", strided if i % 10 == 9 else dp) for i in range(n)]


def test_a_large_plan_prints_a_screen_and_every_op_with_v(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A 1,024-GPU plan printed 304 KB (every op line listed every device id)."""
    rows = _rows(400, 1024)
    assert rows[0][2] == "sample=1024 @ [0-1023]" and rows[9][2] == "channel=4 @ [0,256,512,768]"
    print_ops(rows, verbose=False)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) <= PLAN_GROUPS + 2 and len(out) < 2000, out
    assert lines[0].split()[:4] == ["360", "ops", "sample=1024", "@"]
    assert lines[1].split()[:2] == ["40", "ops"] and "layer9.conv, layer19.conv, " in lines[1]
    assert "400 ops in 2 configs" in lines[-1] and "-v" in lines[-1]
    print_ops(rows, verbose=True)
    assert len(capsys.readouterr().out.splitlines()) == 400
    print_ops(rows[:PLAN_ROWS], verbose=False)  # a small plan: every op, as before
    assert len(capsys.readouterr().out.splitlines()) == PLAN_ROWS
    print_ops([rows[0]] * (PLAN_ROWS + 1), verbose=False)
    assert f"({PLAN_ROWS + 1} ops in 1 config: " in capsys.readouterr().out.splitlines()[-1]


def test_a_plan_with_more_configs_than_a_screen_says_how_many_it_left_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = [(f"op{i}", "linear", f"channel=2 @ [{2 * i}-{2 * i + 1}]") for i in range(100)]
    print_ops(rows, verbose=False)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == PLAN_GROUPS + 2
    rest = 100 - PLAN_GROUPS
    assert " ".join(lines[-2].split()) == f"{rest} ops in {rest} other configs"


def test_size_options_share_one_parser() -> None:
    """--memory-limit 16GiB was refused while --table-budget 4GiB was accepted."""
    parser = build_parser("python -m planner")
    for text, size in (("16GiB", 16 * 2**30), ("16GB", 16e9), ("512 MiB", 512 * 2**20),
                       ("1e9", 1e9), ("2g", 2 * 2**30), ("4096", 4096)):  # fmt: skip
        args = parser.parse_args(["plan", *MODEL, *DEVICES, "--memory-limit", text,
                                  "--table-budget", text])  # fmt: skip
        assert args.memory_limit == args.table_budget == size, text
    args = parser.parse_args(["plan", *MODEL, *DEVICES, "--memory-limit", "device"])
    assert args.memory_limit == "device"


def test_plan_with_a_batch_no_device_count_divides_still_plans(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 7 samples cannot be split over 4 GPUs: legal input, the planner uses smaller degrees.
    out = only_json(ok(capsys, "plan", "lenet5", "--batch", "7", *DEVICES, "--json"))
    assert out["status"] in ("OPTIMAL", "FEASIBLE") and out["objective"] > 0


def test_plan_options_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    out = ok(
        capsys, "plan", "lenet5", "--set", "batch=8", *DEVICES, "--max-configs", "3",
        "--memory-limit", "device", "--sync", "ps", "--seed", "3", "--time-limit", "5", "--json",
    )  # fmt: skip
    assert only_json(out)["status"] in ("OPTIMAL", "FEASIBLE")
    ring = only_json(ok(capsys, "plan", *MODEL, *DEVICES, "--max-configs", "3", "--json"))
    assert only_json(out)["objective"] != ring["objective"]  # --sync ps changes the costs


def test_plan_that_finds_no_solution_exits_1_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # the only pair of choices that fits the memory is forbidden: no answer, though the least
    # footprint (1 + 1) is within the limit (a limit below it is refused before any search)
    problem = tmp_path / "none_fits.json"
    doc = {"nodes": {"intervals": [[0, 2], [0, 2]], "costs": [[1, 1], [1, 1]],
                     "usages": [[1, 5], [1, 5]]},
           "edges": {"nodes": [[0, 1]], "costs": [[1e18, 0, 0, 0]]}, "usage_limit": 2}  # fmt: skip
    problem.write_text(json.dumps({"problem": doc}))
    out_path = tmp_path / "none.json"
    code, out, err = run(
        capsys,
        "plan",
        "--problem",
        str(problem),
        "-o",
        str(out_path),
        "--json",
        "--time-limit",
        "10",
    )
    assert code == 1 and not out_path.exists()
    assert only_json(out)["status"] in ("NO_SOLUTION", "INFEASIBLE")
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum("error" in line for line in lines) == 1


def test_a_memory_limit_below_any_answer_is_one_error_at_once(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_path = tmp_path / "none.json"
    code, out, err = run(
        capsys, "plan", *MODEL, *DEVICES, "--memory-limit", "1", "-o", str(out_path)
    )
    assert code == 2 and not out_path.exists()
    assert err.startswith("error: the memory limit 1 B") and len(err.strip().splitlines()) == 1


def test_plan_a_factory_model_records_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "factory.json"
    argv = ["plan", "user_models:make_cnn", "--input", "8x3x16x16", "--set", "classes=3"]
    printed = only_json(ok(capsys, *argv, "--devices", "cpu-local-2", "-o", str(out), "--json"))
    saved = json.loads(out.read_text())
    assert printed["status"] == saved["status"] and saved["auto"]["chose"] == saved["backend"]
    assert saved["graph"]["model"] == {
        "name": "make_cnn",
        "factory": "user_models:make_cnn",
        "inputs": [{"shape": [8, 3, 16, 16], "dtype": "float32"}],
        "kwargs": {"classes": 3},
        "coarsen": True,
    }


@pytest.mark.parametrize(
    "command", ["", "models", "graph", "devices", "plan", "evaluate", "profile"]
)
def test_every_command_has_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"] if command else ["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m planner")
    assert len(out.splitlines()) > 3


def test_every_subcommand_has_a_one_line_help_in_the_listing() -> None:
    text = build_parser().format_help()
    for command in ("models", "graph", "devices", "plan", "evaluate", "profile"):
        line = next(line for line in text.splitlines() if line.strip().startswith(command))
        assert len(line.split()) > 2, line


def test_python_dash_m_planner_entry_point(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "planner", "devices", "p100-2x4", "--json", str(tmp_path / "d.json")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("p100-2x4: 8 devices") and proc.stderr == ""
    assert DeviceGraph.load(tmp_path / "d.json") == get_preset("p100-2x4")


# -- bad input: one `error:` line on stderr, non-zero exit, no traceback ------------------

BAD: dict[str, tuple[list[str], str]] = {
    # command line
    "no command": ([], "required"),
    "unknown command": (["frob"], "invalid choice"),
    "unknown option": (["models", "--frob"], "unrecognized arguments"),
    # graph
    "unknown model": (["graph", "nope"], "unknown model 'nope'"),
    "unknown model argument": (["graph", "lenet5", "--set", "nope=1"], "no option 'nope'"),
    "--set without =": (["graph", "lenet5", "--set", "nope"], "KEY=VALUE"),
    "model argument of the wrong type": (
        ["graph", "lenet5", "--set", "image_size=big"],
        "image_size must be a positive integer",
    ),
    "model argument too small to run": (["graph", "lenet5", "--set", "image_size=3"], "lenet5"),
    "batch 0": (["graph", "lenet5", "--batch", "0"], "--batch: expected a positive integer"),
    "negative batch": (["graph", "lenet5", "--batch", "-3"], "positive integer"),
    "fractional batch": (["graph", "lenet5", "--batch", "2.5"], "positive integer"),
    "batch given twice": (["graph", *MODEL, "--set", "batch=4"], "batch size once"),
    "negative --set batch": (["graph", "lenet5", "--set", "batch=-1"], "positive integer"),
    "--set of an optional size of the wrong type": (
        ["graph", "llama3-8b", "--set", "hidden_dim=0.5"],
        "hidden_dim must be a positive integer",
    ),
    "unknown --precision": (["graph", *MODEL, "--precision", "fp7"], "precision must be one of"),
    "--precision with --problem": (
        ["plan", "--problem", "{problem}", "--precision", "bf16"],
        "--precision only applies to a model",
    ),
    "graph --json into a missing folder": (
        ["graph", *MODEL, "--json", "{missing}/g.json"],
        "does not exist",
    ),
    # user models (factories)
    "factory without --input": (["graph", "user_models:make_cnn"], "needs --input SHAPE"),
    "factory that does not import": (
        ["graph", "no_such_module:make", "--input", "8x3"],
        "cannot import model factory",
    ),
    "factory with a bad keyword": (
        ["graph", "user_models:make_cnn", "--input", "8x3x16x16", "--set", "nope=3"],
        "unexpected keyword argument 'nope'",
    ),
    "factory with --batch": (
        ["graph", "user_models:make_cnn", "--input", "8x3x16x16", "--batch", "4"],
        "--batch applies to a zoo model",
    ),
    "malformed --input": (["graph", "user_models:make_cnn", "--input", "8xa"], "like 8x3x32x32"),
    "unknown --input dtype": (
        ["graph", "user_models:make_cnn", "--input", "8x3:float8"],
        "unknown dtype 'float8'",
    ),
    "--input for a zoo model": (["graph", *MODEL, "--input", "8x1x32x32"], "applies to a factory"),
    # devices
    "unknown preset": (["devices", "nope-1x4"], "unknown device preset"),
    "preset out of range": (["devices", "p100-0x4"], "out of range"),
    "device JSON that is not JSON": (["devices", "{not_json}"], "not_json"),
    "device JSON with a zero bandwidth": (["devices", "{zero_bandwidth}"], "bandwidth"),
    "missing device JSON": (["devices", "{missing}"], "missing.json"),
    "binary device file": (["devices", "{binary}"], "UTF-8"),
    "--measure on a GPU preset": (["devices", "p100-1x4", "--measure"], "cpu-local"),
    "--measure on a malformed cpu-local name": (
        ["devices", "cpu-local-x", "--measure"],
        "cpu-local",
    ),
    # plan
    "plan without --devices": (["plan", *MODEL], "--devices is required"),
    "plan a graph without --devices": (["plan", "--graph", "{graph}"], "--devices is required"),
    "plan with no input": (["plan", *DEVICES], "one of the arguments"),
    "plan a model and a graph": (["plan", *MODEL, "--graph", "{graph}", *DEVICES], "not allowed"),
    "plan an unknown model": (["plan", "nope", *DEVICES], "unknown model"),
    "plan with an unknown preset": (["plan", *MODEL, "--devices", "nope"], "unknown device"),
    "plan with a zero-bandwidth device file": (
        ["plan", *MODEL, "--devices", "{zero_bandwidth}"],
        "bandwidth",
    ),
    "unknown backend": (["plan", *MODEL, *DEVICES, "--backend", "nope"], "unknown backend"),
    "unknown backend setting": (
        ["plan", *MODEL, *DEVICES, "--backend", "search", "--option", "tyop=1"],
        "has no setting 'tyop'; its settings are: mode",
    ),
    "ill-typed backend setting": (
        ["plan", *MODEL, *DEVICES, "--backend", "mcmc", "--option", "cycle=x"],
        "setting 'cycle' must be",
    ),
    "makespan with a backend that cannot": (
        ["plan", *MODEL, *DEVICES, "--backend", "elimination", "--objective", "makespan"],
        "makespan",
    ),
    "unknown objective": (["plan", *MODEL, *DEVICES, "--objective", "fastest"], "invalid choice"),
    "zero time limit": (["plan", *MODEL, *DEVICES, "--time-limit", "0"], "--time-limit"),
    "negative time limit": (["plan", *MODEL, *DEVICES, "--time-limit", "-1"], "--time-limit"),
    "infinite time limit": (["plan", *MODEL, *DEVICES, "--time-limit", "inf"], "--time-limit"),
    "negative seed": (["plan", *MODEL, *DEVICES, "--seed", "-1"], "--seed"),
    "memory limit nonsense": (["plan", *MODEL, *DEVICES, "--memory-limit", "lots"], "memory"),
    "negative memory limit": (["plan", *MODEL, *DEVICES, "--memory-limit", "-5"], "memory"),
    "NaN memory limit": (["plan", *MODEL, *DEVICES, "--memory-limit", "nan"], "memory"),
    "memory limit in an unknown unit": (
        ["plan", *MODEL, *DEVICES, "--memory-limit", "16GiBs"],
        "unknown size unit 'GiBs' in '16GiBs': use B, KB/MB/GB/TB",
    ),
    "table budget in an unknown unit": (
        ["plan", *MODEL, *DEVICES, "--table-budget", "4 gigs"],
        "--table-budget: unknown size unit 'gigs'",
    ),
    "zero memory limit": (["plan", *MODEL, *DEVICES, "--memory-limit", "0GB"], "at least 1 byte"),
    "max configs 0": (["plan", *MODEL, *DEVICES, "--max-configs", "0"], "--max-configs"),
    "missing problem file": (["plan", "--problem", "{missing}"], "does not exist"),
    "problem that is not JSON": (["plan", "--problem", "{not_json}"], "not valid JSON"),
    "malformed problem": (["plan", "--problem", "{malformed_problem}"], "edges"),
    "problem with --devices": (["plan", "--problem", "{problem}", *DEVICES], "--problem"),
    "problem with --batch": (
        ["plan", "--problem", "{problem}", "--batch", "8"],
        "only applies to a model",
    ),
    "graph with --set": (
        ["plan", "--graph", "{graph}", *DEVICES, "--set", "x=1"],
        "only applies to a model",
    ),
    "graph with a cycle": (["plan", "--graph", "{cycle}", *DEVICES], "cycle"),
    "graph file that is a device graph": (["plan", "--graph", "{devices}", *DEVICES], "format"),
    "missing graph file": (["plan", "--graph", "{missing}", *DEVICES], "does not exist"),
    "binary graph file": (["plan", "--graph", "{binary}", *DEVICES], "UTF-8"),
    "binary problem file": (["plan", "--problem", "{binary}"], "binary.json"),
    "plan -o into a missing folder": (
        ["plan", *MODEL, *DEVICES, "-o", "{missing}/plan.json"],
        "does not exist",
    ),
    # evaluate
    "evaluate a graph file": (["evaluate", "{graph}"], "not a layerwise strategy"),
    "evaluate a cost-table problem": (["evaluate", "{problem}"], "not a layerwise strategy"),
    "evaluate a tampered fingerprint": (["evaluate", "{tampered}"], "fingerprint"),
    "evaluate a missing file": (["evaluate", "{missing}"], "does not exist"),
    "evaluate a file that is not JSON": (["evaluate", "{not_json}"], "not valid JSON"),
    "evaluate a binary file": (["evaluate", "{binary}"], "UTF-8"),
    "evaluate a malformed strategy": (["evaluate", "{embedded_graph_list}"], "must be objects"),
    "evaluate a strategy with a bad cost section": (["evaluate", "{bad_cost}"], "cost"),
    "evaluate an unknown cost source": (["evaluate", "{bad_cost_source}"], "guessed"),
    "evaluate a non-numeric cost option": (["evaluate", "{bad_cost_option}"], "compute_eff"),
    # profile (argument checks only: the profiler itself is tested elsewhere)
    "profile an unknown model": (["profile", "nope"], "unknown model"),
    "profile zero repeats": (["profile", "lenet5", "--repeats", "0"], "--repeats"),
    "profile max configs 0": (["profile", "lenet5", "--max-configs", "0"], "--max-configs"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_error_line(
    capsys: pytest.CaptureFixture[str], files: dict[str, str], case: str
) -> None:
    argv, expected = BAD[case]
    code, out, err = run(capsys, *(a.format(**files) for a in argv))
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err + out
    assert expected in lines[0], lines[0]


# -- progress, Ctrl-C, output paths, strict JSON ---------------------------------------------


@pytest.mark.parametrize("backend", ["search", "portfolio"])
def test_ctrl_c_during_a_search_writes_the_best_answer_so_far(backend: str, tmp_path: Path) -> None:
    """The first SIGINT, sent to the whole process group as a terminal does (the portfolio's
    members too), stops the search; plan says so once, prints and writes its best answer."""
    # search cannot prove 60 nodes of up to 12 choices with many edges in a minute, nor the
    # portfolio a contest-like problem of 1,000 nodes
    if backend == "search":
        problem = random_problem(60, 12, seed=3, edge_prob=0.6, memory=False)
    else:
        problem = contest_problem(1000, seed=1)
    save_problem(problem, tmp_path / "p.json")
    out = tmp_path / "best.json"
    argv = ["plan", "--problem", str(tmp_path / "p.json"), "--backend", backend]
    argv += ["--time-limit", "120", "-o", str(out), "--json", "-v"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner", *argv], start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # -v: planner.api says when the search starts
            if f"searching with {backend}" in line:
                break
        time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    printed = only_json(stdout)
    saved = json.loads(out.read_text())
    assert saved["limit"] == printed["limit"] == "INTERRUPTED"
    assert saved["status"] == printed["status"] == "FEASIBLE"
    assert saved["search_seconds"] < 60 and len(saved["choices"]) == problem.num_nodes
    assert "best answer found so far" in stderr
    assert stderr.count("interrupted: stopping with the best answer so far") == 1, stderr


def test_output_paths_are_checked_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import planner.api

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the search started before the output path was checked")

    monkeypatch.setattr(planner.api, "plan", no_work)
    for argv in (
        ["plan", "inception_v3", "--devices", "p100-4x4", "-o", f"{tmp_path}/no/p.json"],
        ["plan", *MODEL, *DEVICES, "-o", str(tmp_path)],  # a directory
        ["plan", *MODEL, *DEVICES, "--log-file", f"{tmp_path}/no/log.txt"],
    ):
        code, out, err = run(capsys, *argv)
        assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_directory_that_takes_no_files_is_refused_before_any_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc exists and os.access says root may write it, yet no file can be created there:
    one line naming the user's path, before the search (not a hidden temporary file after)."""
    import planner.api

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the search started before the output path was checked")

    monkeypatch.setattr(planner.api, "plan", no_work)
    for argv, path in (
        (["plan", *MODEL, *DEVICES, "-o", "/proc/plan.json"], "/proc/plan.json"),
        (["graph", *MODEL, "--json", "/proc/g.json"], "/proc/g.json"),
        (["evaluate", "x.json", "--trace", "/proc/t.json"], "/proc/t.json"),
    ):
        code, out, err = run(capsys, *argv)
        assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
        assert "cannot write" in err and f"{path}:" in err and "/proc/." not in err, err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_failed_write_names_the_users_path() -> None:
    from planner.errors import LayerwiseError
    from planner.files import write_text_atomic

    with pytest.raises(LayerwiseError, match=r"^cannot write /proc/plan\.json: ") as info:
        write_text_atomic("/proc/plan.json", "{}")
    assert ".tmp" not in str(info.value)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_plan_and_graph_files_are_written_with_the_users_umask(
    capsys: pytest.CaptureFixture[str], files: dict[str, str], tmp_path: Path, umask: int
) -> None:
    old = os.umask(umask)
    try:
        out = str(tmp_path / "p.json")
        ok(capsys, "plan", "--problem", files["problem"], "--backend", "baselines", "-o", out)
        ok(capsys, "graph", *MODEL, "--json", str(tmp_path / "g.json"))
        ok(capsys, "devices", "p100-1x4", "--json", str(tmp_path / "d.json"))
    finally:
        os.umask(old)
    for name in ("p.json", "g.json", "d.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "g.json", "p.json"]


def test_evaluate_refuses_a_plot_format_before_any_work(
    capsys: pytest.CaptureFixture[str], files: dict[str, str], tmp_path: Path
) -> None:
    code, out, err = run(capsys, "evaluate", files["plan"], "--plot", str(tmp_path / "t.xyz"))
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "'t.xyz'" in err and ".png" in err and ".svg" in err
    code, out, err = run(capsys, "evaluate", files["plan"], "--plot", str(tmp_path / "t"))
    assert code == 2 and "cannot write a plot" in err
    plot, trace = tmp_path / "t.svg", tmp_path / "t.json"
    code, out, err = run(
        capsys, "evaluate", files["plan"], "--plot", str(plot), "--trace", str(trace)
    )
    assert code == 0 and plot.read_text().lstrip().startswith("<?xml")
    assert err.splitlines() == [f"trace written to {trace}", f"plot written to {plot}"]
    assert out.startswith("additive") and json.loads(trace.read_text())


def test_logging_goes_to_stderr_and_the_log_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import logging

    log_file = tmp_path / "plan.log"
    ok(capsys, "plan", *MODEL, *DEVICES, "--json", "--log-file", str(log_file))
    text = log_file.read_text()
    # everything goes to the file (the default plan tries elimination's optimum first)
    assert "planner.api INFO: searching with elimination" in text
    # default stderr: warnings only; a backend's progress lines (INFO) need -v (README)
    logging.getLogger("backends.test").info("best so far 1.0")
    logging.getLogger("planner.api").info("phase detail")
    logging.getLogger("backends.test").warning("a warning")
    err = capsys.readouterr().err
    assert "best so far" not in err and "phase detail" not in err
    assert "backends.test: a warning" in err
    code, out, err = run(capsys, "plan", *MODEL, *DEVICES, "--json", "-v")
    assert code == 0 and "planner.api: searching with elimination" in err
    logging.getLogger("backends.test").info("best so far 2.0")
    assert "backends.test: best so far 2.0" in capsys.readouterr().err
    only_json(out)  # logging never goes to stdout


def test_plan_without_v_prints_no_log_lines(
    capsys: pytest.CaptureFixture[str], files: dict[str, str]
) -> None:
    code, out, err = run(capsys, "plan", "--problem", files["problem"], "--backend", "mcmc",
                         "--time-limit", "1")  # fmt: skip
    assert code == 0 and err == "", err
    assert out.startswith("FEASIBLE")


def test_plan_json_is_strict_even_when_the_gap_is_infinite(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import dataclasses

    from planner.api import plan

    result = plan("lenet5", "p100-1x4", backend="baselines", model_kwargs={"batch": 8})
    zero = dataclasses.replace(result, result=dataclasses.replace(result.result, bound=0.0))
    # gap = objective / 0 - 1
    assert zero.gap == math.inf
    assert zero.summary()["gap"] is None and zero.to_json()["gap"] is None
    json.loads(strict_json(zero.to_json()), parse_constant=lambda c: pytest.fail(c))


def test_the_layerwise_console_script_is_the_same_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.__main__ import console_main

    with pytest.raises(SystemExit):
        main(["--help"], prog="layerwise")
    assert capsys.readouterr().out.startswith("usage: layerwise")
    assert console_main.__doc__ and "layerwise" in console_main.__doc__


# -- the re-rank rule -------------------------------------------------------------------------


def test_plan_recommends_a_baseline_that_simulates_faster(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """lenet5 on 2 P100s: the additive optimum simulates 11% slower than data parallelism
    (more than the simulator's stated accuracy), so `plan` recommends data parallelism and
    keeps the searched optimum, with its status, in the plan file."""
    path = tmp_path / "plan.json"
    argv = ["plan", "lenet5", "--devices", "p100-1x2", "--backend", "elimination", "--json"]
    s = only_json(ok(capsys, *argv, "-o", str(path)))
    assert s["recommendation"]["switched"] and s["recommendation"]["to"] == "data_parallel"
    assert s["status"] == "FEASIBLE" and s["searched"]["status"] == "OPTIMAL"
    assert s["searched"]["simulated"] > s["recommendation"]["baselines"]["data_parallel"]
    strategy, _ = load_strategy(path)
    dp = data_parallel(strategy.graph, strategy.devices)
    assert strategy.configs == dp.configs
    raw = only_json(ok(capsys, *argv, "--no-recommend"))
    assert "recommendation" not in raw and raw["status"] == "OPTIMAL"
    assert raw["objective"] == pytest.approx(s["searched"]["objective"], rel=1e-12)


def test_the_default_backend_is_auto_as_in_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    from planner.api import plan

    args = build_parser().parse_args(["plan", *MODEL, *DEVICES])
    assert args.backend == inspect.signature(plan).parameters["backend"].default == "auto"
    code, _, err = run(capsys, "plan", *MODEL, *DEVICES, "--option", "mode=astar")
    assert code == 2 and "'auto' chooses the backend per problem" in err


def test_backend_options_reach_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.api

    seen: dict[str, Any] = {}
    real = planner.api.plan_request

    def spy(request: Any) -> Any:
        seen.update(request.search.settings)
        return real(request)

    monkeypatch.setattr(planner.api, "plan_request", spy)
    argv = ["plan", "lenet5", "--batch", "8", "--devices", "p100-1x2", "--backend", "search"]
    assert main([*argv, "--option", "mode=astar", "--json", "--no-recommend"]) == 0
    assert seen["mode"] == "astar"  # the backend's checked settings, with its defaults


def test_a_plan_with_recomputation_is_rescored_with_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan_path = tmp_path / "plan.json"
    args = ["plan", "gpt2", "--batch", "2", "--devices", "p100-1x2", "--backend", "baselines"]
    ok(capsys, *args, "--recompute", "full", "-o", str(plan_path), "--json")
    saved = json.loads(plan_path.read_text())
    assert saved["cost"]["recompute"] == "full"
    scored = json.loads(ok(capsys, "evaluate", str(plan_path), "--json"))
    assert math.isclose(scored["additive"], saved["objective"], rel_tol=1e-9)
    plain = json.loads(ok(capsys, *args, "--json"))
    assert plain["objective"] < saved["objective"]  # the forward again costs time


def test_a_model_that_fits_only_with_recomputation_is_planned_with_it_by_default(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from planner.costs.costmodel import CostOptions
    from planner.problems.sizes import least_memory

    small = {"seq": 16, "n_layer": 3, "n_head": 2, "n_embd": 32, "vocab_size": 128}
    graph = model_graph("gpt2", batch=4, **small)
    devices = get_preset("p100-1x2").to_json()
    for d in devices["devices"]:  # just too little to keep every activation
        d["memory"] = int(0.99 * least_memory(graph, CostOptions()) / 2)
    path = tmp_path / "small.json"
    path.write_text(json.dumps(devices))
    sets = [a for k, v in small.items() for a in ("--set", f"{k}={v}")]
    args = ["plan", "gpt2", "--batch", "4", *sets, "--devices", str(path), "--time-limit", "60"]
    args += ["--headroom", "0", "--reserve", "0"]  # the memory is sized to the byte
    code, out, err = run(capsys, *args, "--recompute", "none", "--no-recommend")
    assert code != 0 and "--recompute" in err and len(err.strip().splitlines()) == 1
    summary = json.loads(ok(capsys, *args, "--no-recommend", "--json"))
    assert "recompute activations" in summary["memory_fallback"]
    assert summary["memory_fits"] and summary["recompute"]["chose"] != "none"
