"""Load beside a measured run: `background_load(n)` keeps n CPU-burning processes running
while its block runs, as n other jobs of a shared machine would (`python -m
experiments.iopddl --background N`), so a solver's robustness to load is measured rather
than hoped for. Each burner is a Python loop that never sleeps (one core's worth of demand at
normal priority, no memory or I/O), in its own session so a Ctrl-C at the terminal reaches
only the experiment. They stop when the block ends, however it ends (an exception, a second
Ctrl-C), and each also stops by itself within milliseconds once its parent is gone (a crash
or a SIGKILL of the experiment leaves none behind: it watches `os.getppid`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["BURN", "background_load", "stop"]

# Spin; every few ms of spinning look whether the parent is still the one that started us
# (its pid comes as the argument: it may be gone before this interpreter has started).
BURN = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(100_000):\n"
    "        pass\n"
)


@contextlib.contextmanager
def background_load(n: int) -> Iterator[list[subprocess.Popen]]:
    """Run `n` CPU burners while the block runs (none for n = 0); yields their processes."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-S", "-c", BURN, str(os.getpid())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        yield procs
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill the burners and reap them (no zombies, none left running)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    for proc in procs:
        proc.wait()
