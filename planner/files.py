"""Writing user-facing files: output paths checked before the work, atomic writes, strict JSON.

A command that will write a file checks its path first (`check_output_path`), so a typo in a
directory name is one error at once, not after a 60 s search. Files are written to a
temporary file in the same directory and renamed over the target (`write_text_atomic`): an
interrupted or failed write never leaves half a plan behind. JSON written or printed for
machines is strict (`strict_json`): infinities and NaN become null (Python's default would
write `Infinity`, which is not JSON).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from planner.errors import LayerwiseError

__all__ = ["check_output_path", "finite_or_none", "strict_json", "write_text_atomic"]


def check_output_path(path: str | Path, what: str = "output") -> Path:
    """`path` as a Path when a file can be written there; else one `LayerwiseError` that says
    why (its directory is missing or not a directory, it is a directory, or not writable)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise LayerwiseError(f"{what} path {path} is a directory: give a file name")
    if not parent.exists():
        raise LayerwiseError(
            f"cannot write {what} {path}: directory {parent} does not exist (create it first)"
        )
    if not parent.is_dir():
        raise LayerwiseError(f"cannot write {what} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise LayerwiseError(f"cannot write {what} {path}: permission denied")
    return path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def finite_or_none(value: Any) -> Any:
    """A float that is inf or NaN becomes None; anything else is returned unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _sanitize(value: Any) -> Any:
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, Mapping):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sanitize(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _sanitize(value.item())
    return value


def strict_json(value: Any, indent: int | None = None) -> str:
    """JSON text of `value` with every inf/NaN float written as null (RFC 8259 JSON)."""
    return json.dumps(_sanitize(value), indent=indent, allow_nan=False)
