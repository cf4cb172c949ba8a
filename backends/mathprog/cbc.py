"""Running CBC (the binary pulp ships) under a time limit, and reading its log.

Part of the `ilp` backend (only `backends.mathprog.ilp` imports it; it imports no solver package: the
binary's path comes from pulp there). CBC looks at its own time limit (-sec) only between
phases and can overrun it by many seconds at the root node, so `run_cbc` also sends SIGINT
at a stop time (CBC then stops at its next check and writes its best solution) and kills it
at a hard limit (its solution is then lost; the caller falls back to its start). CBC's output
goes to a log file, line-buffered through `stdbuf` where there is one, so that even a killed
run's last bound and incumbent value can be read (`parse_log`).
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.deadline import stop_requested

__all__ = ["CbcProcess", "parse_log", "run_cbc"]

NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"  # a number in CBC's log
POLL_SECONDS = 0.1  # how often a running CBC is checked for a stop request
EARLY_KILL_SECONDS = 5.0  # after a stop request CBC is killed at most this much later
INTERRUPT_KILL_SECONDS = 0.3  # ... and this much after the user's Ctrl-C (exit within 1 s)


@dataclass(frozen=True)
class CbcProcess:
    """How a CBC run ended: its output, whether it was interrupted or killed, its exit code."""

    text: str
    interrupted: bool
    killed: bool
    returncode: int
    wall: float
    peak_mib: float  # CBC's peak resident memory, as last seen (Linux /proc), else 0


def run_cbc(
    args: Sequence[str],
    log: Path,
    stop_at: float,
    kill_at: float,
    should_stop: Callable[[], bool] = lambda: False,
    on_bound: Callable[[float], None] | None = None,
) -> CbcProcess:
    """Run CBC with `args`; SIGINT at `stop_at` (or as soon as `should_stop()`), kill at
    `kill_at` (perf_counter times; kill_at moves up to a few seconds after an early stop).
    `on_bound(bound)`: each better lower bound CBC's log shows while it runs (in CBC's
    objective: scaled, without a constant kept out of the model)."""
    prefix = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
    start = time.perf_counter()
    interrupted = killed = False
    bounds = _BoundWatch(log, on_bound) if on_bound is not None else None
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, *args], stdout=out, stderr=out, stdin=subprocess.DEVNULL)
        peak = 0.0
        while proc.poll() is None and time.perf_counter() < stop_at and not should_stop():
            if bounds is not None:
                bounds.read()
            peak = max(peak, _peak_mib(proc.pid))
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(POLL_SECONDS, max(0.0, stop_at - time.perf_counter())))
        if proc.poll() is None:
            interrupted = True
            early = INTERRUPT_KILL_SECONDS if stop_requested() else EARLY_KILL_SECONDS
            kill_at = min(kill_at, time.perf_counter() + early)
            proc.send_signal(signal.SIGINT)  # our own child, by its handle
            try:
                proc.wait(timeout=max(0.05, kill_at - time.perf_counter()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed = True
    text = log.read_text(errors="replace")
    wall = time.perf_counter() - start
    return CbcProcess(text, interrupted, killed, proc.returncode, wall, peak)


class _BoundWatch:
    """Reads what CBC has appended to its log and reports each better "best possible" bound
    (its progress lines: "Cbc0010I After 100 nodes, ... best possible 85900 (0.50 seconds)")."""

    def __init__(self, log: Path, on_bound: Callable[[float], None]):
        self.log, self.on_bound = log, on_bound
        self.offset, self.best = 0, -math.inf

    def read(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        cut = data.rfind(b"\n") + 1  # whole lines only: the rest is read next time
        self.offset += cut
        text = data[:cut].decode(errors="replace")
        for found in re.findall(rf"best possible ({NUMBER})", text):
            value = float(found)
            if self.best < value < 1e30:
                self.best = value
                self.on_bound(value)


def _peak_mib(pid: int) -> float:
    """A running process's peak resident memory in MiB (VmHWM), 0 where unknown."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else 0.0


def parse_log(text: str) -> dict[str, Any]:
    """Status, objective, lower bound and the warm start's fate from CBC's output."""
    out: dict[str, Any] = {"stopped": False}
    result = re.search(r"Result - (.*)", text)
    line = result.group(1) if result else "no result line"
    out["cbc_result"] = line
    if "Problem is infeasible" in text or "infeasible" in line.lower():
        out["result"] = "INFEASIBLE"
    elif "ctrl-c" in line:
        out["stopped"] = True
        out["result"] = "FEASIBLE"
    elif line.startswith("Optimal"):
        out["result"] = "OPTIMAL"
    else:
        out["stopped"] = "Stopped" in line
        out["result"] = "FEASIBLE"
    if "No feasible solution found" in text or "no integer solution" in text.lower():
        out["result"] = "UNKNOWN" if out["result"] != "INFEASIBLE" else "INFEASIBLE"
    for key, pattern in (
        ("objective", rf"Objective value:\s+({NUMBER})"),
        ("bound", rf"Lower bound:\s+({NUMBER})"),
    ):
        found = re.search(pattern, text)
        if found and abs(float(found.group(1))) < 1e30:  # CBC prints -1e50 for "none"
            out[key] = float(found.group(1))
    if out["result"] == "FEASIBLE" and "objective" not in out:
        out["result"] = "UNKNOWN"
    if "bound" not in out and out["result"] != "OPTIMAL":  # stopped early: the last bound seen
        seen = re.findall(rf"best possible ({NUMBER})", text) or re.findall(
            rf"Continuous objective value is ({NUMBER})", text
        )
        if seen:
            out["bound"] = float(seen[-1])
    incumbents = re.findall(rf"Integer solution of ({NUMBER})", text)
    if incumbents:
        out["last_incumbent"] = float(incumbents[-1])
    if "MIPStart provided solution" in text:
        out["warm_start_accepted"] = True
    elif "mipstart" in text.lower() or "MIPStart" in text:
        out["warm_start_accepted"] = False
    return out
