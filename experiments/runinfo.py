"""What a results file records so that a run can be understood and repeated later.

`run_info(argv, args)` at the start of a run: the command line and parsed arguments, the
layerwise version and git revision (when run from a checkout), the versions of the packages
that change the numbers, and the machine (platform, cores, load). `finish(info)` at the end
adds the end time, the elapsed seconds and the load then (timings are only comparable at a
similar load).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PACKAGES = ("layerwise", "torch", "ortools", "pulp", "numpy", "networkx")
REPO = Path(__file__).resolve().parent.parent


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision(root: Path = REPO) -> dict[str, Any] | None:
    """HEAD and whether the tree has uncommitted changes; None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "dirty": bool(dirty)}


def load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def run_info(module: str, argv: Sequence[str] | None, args: argparse.Namespace) -> dict[str, Any]:
    """Provenance of a run of `python -m <module>` that starts now (see the module docstring);
    `argv` is what was parsed (None: the process's own arguments)."""
    given = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": shlex.join(["python", "-m", module, *given]),
        "args": {k: _jsonable(v) for k, v in sorted(vars(args).items())},
        "versions": versions(),
        "git": git_revision(),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cores": os.cpu_count(),
            "load_start": load(),
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "_t0": time.perf_counter(),
    }


def finish(info: dict[str, Any]) -> dict[str, Any]:
    """`info` with the end time, elapsed seconds and the load at the end."""
    out = {k: v for k, v in info.items() if k != "_t0"}
    out["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    out["elapsed_seconds"] = round(time.perf_counter() - info["_t0"], 3)
    out["machine"] = {**info["machine"], "load_end": load()}
    return out


def load_line(info: dict[str, Any] | None = None) -> str:
    """`load average 0.47, 0.30, 0.26 -> 0.52, 0.41, 0.30 on 2 cores` (at the start and the
    end of the run `info` describes), or the load now without one: timings are only
    comparable at a similar load."""

    def text(avg: Any) -> str:
        return ", ".join(f"{x:.2f}" for x in avg) if avg else "unknown"

    if info is None:
        return f"load average {text(load())} on {os.cpu_count()} cores"
    m = info.get("machine", {})
    return (
        f"load average {text(m.get('load_start'))} -> {text(m.get('load_end'))} "
        f"on {m.get('cores')} cores"
    )


def new_results_folder(out: Path, name: str) -> Path:
    """A new folder `out/<name>-<date>-<time>` for a run's results (a second run in the same
    second gets `-2`, `-3`, ...: both results are kept)."""
    stamp = time.strftime(f"{name}-%Y%m%d-%H%M%S")
    folder = out / stamp
    k = 1
    while folder.exists():
        k += 1
        folder = out / f"{stamp}-{k}"
    folder.mkdir(parents=True)
    return folder


def recorded_args(args: argparse.Namespace, info: dict[str, Any]) -> argparse.Namespace:
    """`args` with the arguments a finished run recorded (what it computed), except where
    the output goes."""
    keep = {"plot", "from_results", "out"}
    recorded = {k: v for k, v in info.get("args", {}).items() if k not in keep}
    return argparse.Namespace(**{**vars(args), **recorded})
