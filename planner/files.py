"""Writing user-facing files: output paths checked before the work, atomic writes, strict JSON.

A command that will write a file checks its path first (`check_output_path`: it creates and
removes a probe file in the directory, so a directory no file can be made in, such as /proc,
is refused too), so a typo in a directory name is one error at once, not after a 60 s search.
Files are written to a temporary file in the same directory and renamed over the target
(`write_text_atomic`): an interrupted or failed write never leaves half a plan behind. The
file gets the permissions any new file gets (0666 less the user's umask), and a failed
write names the user's path, not the temporary one. JSON written or printed for machines is
strict (`strict_json`): infinities and NaN become null (Python's default would write
`Infinity`, which is not JSON).
"""

from __future__ import annotations

import json
import math
import os
import secrets
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
    try:  # os.access says yes to root everywhere, and nothing says whether /proc takes files
        fd, probe = _create_temporary(path, ".probe")
    except OSError as exc:
        raise LayerwiseError(
            f"cannot write {what} {path}: no file can be created in {parent} ({exc.strerror})"
        ) from None
    os.close(fd)
    probe.unlink(missing_ok=True)
    return path


def _create_temporary(path: Path, suffix: str) -> tuple[int, Path]:
    """A new hidden file beside `path`, open for writing, mode 0666 less the umask (mkstemp's
    would be 0600, which a rename would give the user's file)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{suffix}"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename.

    The file gets the user's umask; a failure is one LayerwiseError naming `path`."""
    path = Path(path)
    try:
        fd, tmp = _create_temporary(path, ".tmp")
    except OSError as exc:
        raise LayerwiseError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayerwiseError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
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
