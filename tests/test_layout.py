"""planner/ is grouped in subpackages; the 0.1 flat module names still import."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from planner._compat import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_flat_name_is_the_moved_module(old: str) -> None:
    moved = importlib.import_module(f"planner.{MOVED[old]}.{old}")
    assert importlib.import_module(f"planner.{old}") is moved


def test_public_names_resolve_lazily() -> None:
    import planner

    for name in planner.__all__:
        assert getattr(planner, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = planner.nonsense  # type: ignore[attr-defined]


def test_importing_planner_does_not_import_torch() -> None:
    code = "import sys, planner, planner.problem; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
