"""The processes a test started: those of one session (a command and every process it made),
and waiting for a condition on them with a bound."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def session_processes(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies left out)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def wait_for(done: Callable[[], object], seconds: float) -> bool:
    """Whether `done()` became true within `seconds` (looked at every 20 ms)."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
