"""docs/devices.md, "Your own machines: a device file": its commands run as written, and its
example is the preset it names with the two links it names edited."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from planner.cli import main
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]
SECTION = (ROOT / "docs" / "devices.md").read_text().split("## Your own machines")[1]
SECTION = SECTION.split("\n## ")[0]


def block(language: str) -> str:
    match = re.search(rf"```{language}\n(.*?)```", SECTION, flags=re.S)
    assert match is not None, f"no {language} block"
    return match[1]


def test_the_example_is_the_preset_with_ethernet_between_the_nodes() -> None:
    example = DeviceGraph.from_json(json.loads(block("json")))
    preset = get_preset("p100-2x2")
    assert example.devices == preset.devices and example.switches == preset.switches
    changed = [(a, b) for a, b in zip(preset.links, example.links, strict=True) if a != b]
    assert [(a.a, a.b) for a, _ in changed] == [("node0/nic", "ib"), ("node1/nic", "ib")]
    assert all((b.bandwidth, b.latency) == (3.125e9, 1e-5) for _, b in changed)
    assert example.inv_bandwidth[0, 2] == 1 / 3.125e9  # the route between nodes


def test_the_commands_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    commands = [shlex.split(line.split("#")[0]) for line in block("sh").splitlines()]
    assert [c[:4] for c in commands] == [["python", "-m", "planner", "devices"]] * 2 + [
        ["python", "-m", "planner", "plan"]
    ]
    assert main(commands[0][3:]) == 0  # the preset, written
    assert DeviceGraph.load(tmp_path / "my_cluster.json") == get_preset("p100-2x2")
    (tmp_path / "my_cluster.json").write_text(block("json"))  # "edited"
    assert main(commands[1][3:]) == 0
    assert main(commands[2][3:]) == 0
    out, err = capsys.readouterr()
    assert "error" not in err, err
    assert "my-cluster: 4 devices" in out, out
    assert (tmp_path / "plan.json").exists()
