"""Size guards, through the public entry points only (build_problem, the CLI): each fails on
the code before the guards existed (docs/space.md, "Guards")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from graphs import chain_cnn, conv2d, input_op, linear, softmax

from planner.cli import main
from planner.errors import LayerwiseError
from planner.graph.opgraph import OpGraph, Tensor
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.problem import build_problem

REPO = Path(__file__).resolve().parents[1]


def _big_batch(sample: int) -> OpGraph:
    x = input_op("data", sample=sample, channel=3, height=32, width=32)
    c = conv2d("conv", x, 16)
    return OpGraph("big", (x, c, softmax("loss", c)))


def test_table_budget_stops_before_building_and_names_the_options():
    g, dg = chain_cnn(sample=64), get_preset("p100-4x4")
    problem = build_problem(g, dg, space="full")
    need = problem.stats["estimated_bytes"]
    assert problem.stats["table_bytes"] <= need  # the estimate is an upper bound here
    with pytest.raises(LayerwiseError) as err:
        build_problem(g, dg, space="full", table_budget=need / 2)
    message = str(err.value)
    assert "\n" not in message
    for what in ("full config space", "16 devices", "configs per op", "--space mesh",
                 "--max-configs", "fewer devices", "--table-budget"):  # fmt: skip
        assert what in message
    # The mesh space is the way out.
    assert build_problem(g, dg, space="mesh", table_budget=need / 2).space_kind == "mesh"


def test_a_batch_no_placement_can_hold_is_refused_before_building():
    g, dg = _big_batch(10**12), get_preset("p100-2x4")
    with pytest.raises(
        LayerwiseError, match=r"needs at least .*PiB.* per device, more than"
    ) as err:
        build_problem(g, dg)
    assert "\n" not in str(err.value)
    # A batch that fits spread evenly is built.
    build_problem(_big_batch(64), dg)


def test_tensors_beyond_64_bit_sizes_are_refused():
    g = _big_batch(2**55)
    with pytest.raises(LayerwiseError, match="beyond 64-bit sizes"):
        build_problem(g, get_preset("p100-1x4"))


def _cli(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize(
    "batch, pattern",
    [
        ("1000000000000", "needs at least"),
        ("18446744073709551615", "beyond 64-bit"),
        ("9223372036854775807", "beyond 64-bit"),
        ("576460752303423488", "cannot be captured"),
    ],
)
def test_cli_absurd_batches_are_one_line_errors(batch, pattern):
    code, err = _cli("plan", "lenet5", "--batch", batch, "--devices", "p100-1x4")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and pattern in err


def test_cli_huge_preset_is_refused_before_building(monkeypatch):
    """In this process, with building any device graph made an error: the preset's size is
    refused from its name (the child below checks the same under a memory limit)."""
    import planner.hardware.presets as presets

    def never(*args: object) -> None:
        raise AssertionError(f"a device graph was built: {args}")

    monkeypatch.setattr(presets, "load_devices", never)
    monkeypatch.setattr(presets, "get_preset", never)
    code, err = _cli("plan", "lenet5", "--devices", "p100-100000x8")
    assert code == 2, err
    assert err.startswith("error: p100-100000x8 has 800,000 devices")
    assert err.count("\n") == 1


@pytest.mark.slow
def test_cli_huge_preset_is_refused_quickly_with_little_memory():
    """Run in a child limited to 2 GiB of address space and 60 s: the device graph of
    800,000 devices is never built (today it grows until the kernel kills it)."""
    code = (
        "import resource, sys; "
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
        "from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", code, "plan", "lenet5", "--devices", "p100-100000x8"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=env,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-500:]
    assert run.stderr.startswith("error: p100-100000x8 has 800,000 devices")
    assert run.stderr.count("\n") == 1


def test_cli_table_budget_option():
    code, err = _cli(
        "plan", "alexnet", "--devices", "p100-4x4", "--space", "full", "--table-budget", "100KiB"
    )
    assert code == 2 and "over the table budget of 100 KiB" in err and "--space mesh" in err
    code, err = _cli("plan", "lenet5", "--devices", "p100-1x4", "--table-budget", "lots")
    assert code == 2 and "--table-budget" in err
    code, err = _cli("plan", "--problem", "x.json", "--space", "mesh")
    assert code == 2 and "--space" in err


# -- plans that do not fit --------------------------------------------------------------------


def _small_memory(dg: DeviceGraph, memory: int) -> DeviceGraph:
    return DeviceGraph(
        dg.name, [replace(d, memory=memory) for d in dg.devices], dg.links, dg.switches
    )


def test_cli_plan_that_does_not_fit_is_an_error(tmp_path):
    # A small layer: splitting it costs more in messages than it saves, so the fastest plan
    # keeps everything on one device, which cannot hold it (4 devices can, split).
    x = input_op("data", sample=8, channel=1024)
    fc = linear("fc", x, 1024)
    g = OpGraph("small", (x, fc, softmax("loss", fc)))
    gpath = tmp_path / "g.json"
    g.save(gpath)
    # Every output once, parameters twice (weights, gradients): what any plan must hold.
    least = sum(op.output.nbytes + 2 * op.param_bytes for op in g.ops)
    dg = _small_memory(get_preset("p100-1x4"), int(least / 4 * 1.5))
    dpath = tmp_path / "d.json"
    dg.save(dpath)
    out = tmp_path / "plan.json"
    args = ["plan", "--graph", str(gpath), "--devices", str(dpath), "--no-recommend"]
    args += ["--backend", "elimination"]
    code, err = _cli(*args, "-o", str(out))
    assert code == 2 and "--memory-limit device" in err and err.count("\n") == 1
    assert not out.exists()
    args[-1] = "search"  # elimination has no memory limit
    code, err = _cli(*args, "--memory-limit", "device", "-o", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["space"]["kind"] == "full"
    out.unlink()
    code, err = _cli(*args[:-2], "-o", str(out))  # the default backend, auto, needs no option:
    assert code == 0 and "memory is tight" in err, err  # it searches under the devices' memory
    saved = json.loads(out.read_text())
    assert saved["memory_fits"] and saved["auto"]["chose"] == "portfolio"


def test_graph_json_with_huge_sizes_is_refused(tmp_path):
    op = input_op("data", sample=2**40, channel=2**20)
    g = OpGraph(
        "huge", (op, replace(softmax("loss", op), output=Tensor.of(sample=2**40, channel=2**20)))
    )
    with pytest.raises(LayerwiseError, match="beyond 64-bit"):
        build_problem(g, get_preset("p100-1x4"))
