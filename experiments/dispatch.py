"""Where the cases of `experiments.iopddl` run: one after another in this process (`Local`,
the default), or as Ray tasks on a local Ray instance or a cluster (`RayDispatch`).

Either way a case is `execute(case)`: the case's own process (`iopddl.run_child`: hard
timeout, peak RSS, killed as a group) with `--background` burners around it, then the answer
re-checked from the file, the machine's load before and after. A Ray task reserves the cores
the case uses (`num_cpus`: its threads; with burners a whole node, so that the case and its
burners are alone there, as `--background` simulates), so two 2-core cases never share 2
cores. Ray's own retries are off: a task whose worker dies (killed, node lost) comes back
as an ERROR outcome, and the caller decides whether to retry it (`needs_retry`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import signal
import socket
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.cli.args import one_line
from planner.errors import LayerwiseError

__all__ = [
    "CRASH_ENV",
    "Case",
    "Local",
    "Outcome",
    "RayDispatch",
    "execute",
    "fire",
    "ray_installed",
]

# Test hook: "case:FILE" or "task:FILE". While FILE exists, the next case to start removes it
# and dies by SIGKILL: its own process ("case") or the Ray worker that runs it ("task").
CRASH_ENV = "LAYERWISE_IOPDDL_CRASH"
LOG_TAIL = 1 << 20  # bytes of a case's log brought back to the results folder
INSTALL = "pip install 'layerwise[bench]'"
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Case:
    path: Path
    backend: str
    seed: int
    limit: float  # seconds
    background: int  # CPU burners beside it
    threads: int
    attempt: int = 1

    @property
    def name(self) -> str:
        from experiments.iopddl import instance_name

        return instance_name(self.path)

    @property
    def key(self) -> tuple[str, str, int, float, int]:
        """What identifies the case among a run's rows (and a resumed run's)."""
        return (self.name, self.backend, self.seed, float(self.limit), self.background)


@dataclass
class Outcome:
    case: Case
    answer: dict | None
    measured: dict[str, Any]  # wall, rss_mib, tree_rss_mib, load_start, load_end, error, ...
    verdict: str = "-"
    cost: float | None = None
    log: str = ""  # the case's output (its last LOG_TAIL bytes)

    @property
    def needs_retry(self) -> bool:
        """A crash (a signal, an unexpected exit, a lost worker): not a timeout (it would time
        out again), nor a one-line error of bad input (exit status 2: it would fail again)."""
        return self.answer is None and bool(self.measured.get("crashed"))


# ----------------------------------------------------------------------------- one case

_PROBLEM: dict[tuple[str, float], Any] = {}  # the last instance re-checked, in this process


def execute(case: Case, hook: str | None = None, keep: bool = False) -> Outcome:
    """Run `case` here: burners, the case's process, the re-check (see the module doc);
    `keep` the instance loaded for the next case's re-check (the driver; not an idle Ray
    worker, beside the cases other workers run)."""
    from experiments import iopddl
    from experiments.runinfo import load
    from planner.deadline import catch_interrupt

    if hook and hook.startswith("task:") and fire(hook):
        os.kill(os.getpid(), signal.SIGKILL)  # the test hook: this worker dies
    start = (load() or [math.nan])[0]
    with tempfile.TemporaryDirectory(prefix="iopddl-case-") as tmp:
        log = Path(tmp) / "case.log"
        # a Ray task: ray.cancel (Ctrl-C at the driver) arrives as SIGINT, which `_wait`
        # passes on to the case (its best answer so far); in the driver, a no-op
        with catch_interrupt(), iopddl.background_load(case.background):
            answer, measured = iopddl.run_child(
                case.path, case.backend, case.seed, case.limit, case.threads, Path(tmp), log,
                hook if hook and hook.startswith("case:") else None,
            )  # fmt: skip
        text = log.read_bytes()[-LOG_TAIL:].decode("utf-8", "replace") if log.exists() else ""
    c, host = case, socket.gethostname()  # which node, on a cluster
    head = f"# {c.name} {c.backend} seed {c.seed} attempt {c.attempt} on {host}\n"
    out = Outcome(case, answer, {**measured, "load_start": start}, log=head + text)
    if answer is not None and answer.get("choices") is not None:
        out.verdict, out.cost = iopddl.recheck(_problem(case.path, keep), answer)
    out.measured["load_end"] = (load() or [math.nan])[0]
    return out


def fire(hook: str) -> bool:
    """Whether the hook's file existed (it is removed: the hook fires once)."""
    try:
        Path(hook.split(":", 1)[1]).unlink()
    except OSError:
        return False
    return True


def _problem(path: Path, keep: bool) -> Any:
    """The instance at `path`, loaded once for the cases of it this process re-checks in a
    row when `keep`."""
    from planner.problems.costtable import load_problem

    key = (str(path), path.stat().st_mtime)
    if key not in _PROBLEM:
        _PROBLEM.clear()  # one instance in memory at a time
        problem = load_problem(path)
        if not keep:
            return problem
        _PROBLEM[key] = problem
    return _PROBLEM[key]


def lost(case: Case, exc: BaseException) -> Outcome:
    """The outcome of a case whose Ray task failed (its worker died, its node was lost):
    nothing measured."""
    nan = math.nan
    error = f"Ray task failed: {type(exc).__name__}: {one_line(exc)}"[:500]
    measured = {"wall": nan, "rss_mib": nan, "tree_rss_mib": nan, "error": error,
                "crashed": True, "load_start": nan, "load_end": nan}  # fmt: skip
    return Outcome(case, None, measured)


# ----------------------------------------------------------------------------- dispatchers


class Local:
    """Cases one after another, in this process's children; `announce(case)` as each starts."""

    def __init__(self, announce: Callable[[Case], None] | None = None) -> None:
        self.queue: deque[Case] = deque()
        self.announce = announce

    def submit(self, case: Case) -> None:
        self.queue.append(case)

    def next(self) -> Outcome | None:
        """The next case's outcome (run now); None once none is left or a stop was asked."""
        from planner.deadline import stop_requested

        if not self.queue or stop_requested():
            return None
        case = self.queue.popleft()
        if self.announce:
            self.announce(case)
        hook = os.environ.get(CRASH_ENV, "")  # "task:" would kill this process: Ray's only
        return execute(case, hook if hook.startswith("case:") else None, keep=True)

    def close(self) -> None:
        self.queue.clear()


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


@dataclass
class RayDispatch:
    """Cases as Ray tasks: on a Ray instance this starts (`address` None: every core of this
    machine) or on the cluster at `address` (`ray start --head` printed it; "auto": the one
    running here). Cases run as cores free up; outcomes come in the order they end."""

    address: str | None = None
    pending: dict[Any, Case] = field(default_factory=dict)
    stopping: bool = False

    def __post_init__(self) -> None:
        if not ray_installed():
            raise LayerwiseError(f"Ray dispatch needs ray: {INSTALL}")
        if self.address and self.address != "auto":
            reachable(self.address)
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        self.started = not ray.is_initialized()
        if self.started:
            quiet = {"include_dashboard": False, "log_to_driver": False,
                     "logging_level": logging.ERROR}  # fmt: skip
            try:
                if self.address:
                    ray.init(address=self.address, **quiet)
                else:  # the workers import experiments from this checkout, as this process does
                    path = os.environ.get("PYTHONPATH")
                    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), path]))
                    # "local": a new instance, never a cluster `ray start` left running here
                    ray.init(address="local", num_cpus=os.cpu_count() or 1, **quiet)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = self.address or "a local instance"
                raise LayerwiseError(f"cannot start Ray on {where}: {one_line(exc)}") from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.node_cpus = max(int(n["Resources"].get("CPU", 1)) for n in nodes)
        self.task = ray.remote(max_retries=0)(execute)

    def cpus(self, case: Case) -> int:
        """Cores the case reserves: its threads (at most a node's), with burners a whole node."""
        return self.node_cpus if case.background else min(case.threads, self.node_cpus)

    def submit(self, case: Case) -> None:
        ref = self.task.options(num_cpus=self.cpus(case)).remote(case, os.environ.get(CRASH_ENV))
        self.pending[ref] = case

    def next(self) -> Outcome | None:
        """The outcome of the next case to end; None once none is left. After a stop request
        (Ctrl-C): running cases are asked to stop (they answer with their best so far) and
        cases not started are dropped."""
        import ray
        from ray.exceptions import RayError, TaskCancelledError

        from planner.deadline import stop_requested

        while self.pending:
            if stop_requested() and not self.stopping:
                self.stopping = True
                for ref in self.pending:
                    ray.cancel(ref, force=False)  # SIGINT in a running task, drop a queued one
            done, _ = ray.wait(list(self.pending), num_returns=1, timeout=0.2)
            if not done:
                continue
            case = self.pending.pop(done[0])
            try:
                return ray.get(done[0])
            except TaskCancelledError:
                continue  # it never started
            except RayError as exc:
                return lost(case, exc)
        return None

    def close(self) -> None:
        """Cancel what is left (a second Ctrl-C: force) and stop the Ray instance started."""
        import ray

        for ref in self.pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        self.pending.clear()
        if self.started:
            ray.shutdown()


def reachable(address: str, timeout: float = 5.0) -> None:
    """One LayerwiseError line unless a TCP connection to `address` (host:port, or
    ray://host:port) opens within `timeout` (ray.init would wait minutes for it)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise LayerwiseError(f"--ray {address}: give HOST:PORT (as `ray start --head` prints)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise LayerwiseError(
            f"no Ray cluster answers at {address} ({why}): start one with `ray start --head` "
            "or give its address"
        ) from None
