"""The wheel ships what users need: the type marker, the experiments' data, the Hugging Face
configs, the license, the `layerwise` console script, the `hf` extra (built from a copy of the
repository in a temporary folder)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_ships_data_types_license_and_the_console_script(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "results", "build", "dist", "*.egg-info", "__pycache__"
        ),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("layerwise-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        metadata, entry_points = z.read(meta).decode(), z.read(entry).decode()
    assert "planner/py.typed" in names
    assert "experiments/data/epochs_vs_batch.csv" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: MIT" in metadata
    assert "Provides-Extra: hf" in metadata
    assert "layerwise = planner.__main__:console_main" in entry_points
    assert "planner/api.py" in names and "planner/export/dtensor.py" in names
    assert "planner/cli/args.py" in names
    shipped = {
        f"planner/graph/hf_configs/{p.name}"
        for p in (ROOT / "planner/graph/hf_configs").glob("*.json")
    }
    assert shipped and shipped <= names  # the Hugging Face configs `hf:NAME` builds
