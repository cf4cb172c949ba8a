"""Where the cases of `experiments.iopddl` run: one after another in this process (`Local`,
the default), or as Ray tasks on a local Ray instance or a cluster (`RayDispatch`).

Either way a case is `execute(case)`: the case's own process (`run_child`: hard timeout,
peak RSS, killed as a group) with `--background` burners around it, then the answer
re-checked from the file (`recheck`), the machine's load before and after. A case is known
by `case_key` (instance, backend, seed, limit, background), its trace file by `trace_name`.
A Ray task reserves the cores the case uses (`num_cpus`: its threads; with burners a whole
node, so that the case and its burners are alone there, as `--background` simulates), so two
2-core cases never share 2 cores. Ray's own retries are off: a task whose worker dies
(killed, node lost) comes back as an ERROR outcome, and the caller decides whether to retry
it (`needs_retry`); a task that waits for more cores than any live node has (its node lost)
becomes one within a minute.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.background import background_load
from planner.cli.args import EXIT_BAD_INPUT, one_line  # a case's bad input: not a crash
from planner.errors import LayerwiseError

__all__ = [
    "CRASH_ENV",
    "EXIT_BAD_INPUT",
    "GRACE",
    "INSTALL",
    "Case",
    "CaseKey",
    "Local",
    "Outcome",
    "RayDispatch",
    "case_key",
    "execute",
    "fire",
    "impossible",
    "instance_name",
    "lost",
    "ray_installed",
    "reachable",
    "recheck",
    "run_child",
    "trace_name",
]

CaseKey = tuple[str, str, int, float, int]  # instance, backend, seed, time limit, background

# Test hook: "case:FILE" or "task:FILE". While FILE exists, the next case to start removes it
# and dies by SIGKILL: its own process ("case") or the Ray worker that runs it ("task").
CRASH_ENV = "LAYERWISE_IOPDDL_CRASH"
GRACE = 60.0  # seconds past the time limit before a case is killed (then 15 more after SIGINT)
NODES_SECONDS = 60.0  # how often a Ray run looks for cases no live node can run
LOG_TAIL = 1 << 20  # bytes of a case's log brought back to the results folder
INSTALL = "pip install 'layerwise[bench]'"
REPO = Path(__file__).resolve().parent.parent


def case_key(instance: str, backend: str, seed: int, limit: float, background: int) -> CaseKey:
    """What identifies a case among a run's rows (and a resumed run's, and the traces)."""
    return (str(instance), str(backend), int(seed), float(limit), int(background))


def trace_name(key: CaseKey) -> str:
    """The file name of a case's trace under a results folder's traces/."""
    instance, backend, seed, limit, background = key
    return f"{instance}-{backend}-seed{seed}-{limit:g}s-bg{background}.json"


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
        return instance_name(self.path)

    @property
    def key(self) -> CaseKey:
        return case_key(self.name, self.backend, self.seed, self.limit, self.background)


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


def instance_name(path: Path) -> str:
    """The file's name without .json / .json.gz."""
    return re.sub(r"\.json(\.gz)?$", "", path.name)


def recheck(problem: Any, answer: dict) -> tuple[str, float | None]:
    """(verdict, re-scored cost) of an answer, by planner's evaluators on the file's tables."""
    from planner.problems.evaluate import additive_cost, memory_peak

    choices = answer.get("choices")
    if choices is None:
        return "-", None
    try:
        cost = additive_cost(problem, choices)
        peak = memory_peak(problem, choices)
    except LayerwiseError as exc:
        return f"no: {one_line(exc)}", None
    limit = problem.usage_limit
    if not math.isfinite(cost):
        return "no: a forbidden choice or pair", None
    if limit is not None and bool((peak > limit * (1 + 1e-9)).any()):
        return f"no: memory peak {peak.max():.6g} over the limit {limit.max():.6g}", cost
    reported = answer.get("objective")
    if reported is not None and not math.isclose(cost, reported, rel_tol=1e-9):
        return f"no: reported {reported:.10g} but re-scored {cost:.10g}", cost
    return "yes", cost


def _tree_rss(pgid: int) -> int:
    """Summed RSS (bytes) of the processes in group `pgid`, from /proc."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields_ = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields_[2]) == pgid:  # field 5 of stat: the process group
                total += int(fields_[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss pages
    return total


def run_child(
    path: Path,
    backend: str,
    seed: int,
    limit: float,
    threads: int,
    workdir: Path,
    log_path: Path,
    hook: str | None = None,
) -> tuple[dict | None, dict[str, Any]]:
    """One case in a fresh process (its own session, killed as a group past the timeout or
    when this process dies): (the answer or None, measurements and the error line; `crashed`
    when it died by a signal or exited unexpectedly)."""
    from planner.deadline import stop_requested

    answer_path = workdir / f".answer-{os.getpid()}.json"
    cmd = [sys.executable, "-m", "experiments.iopddl", "--case", str(path), "--answer",
           str(answer_path), "--backends", backend, "--time-limit", str(limit), "--seeds",
           str(seed), "--threads", str(threads), "--parent", str(os.getpid())]  # fmt: skip
    env = {**os.environ, CRASH_ENV: hook} if hook else None
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            status, usage, tree = _wait(proc, limit + GRACE, t0)
        except BaseException:  # a second Ctrl-C: the case's processes go with this one
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    proc.returncode = 0  # reaped by wait4
    wall = time.perf_counter() - t0
    measured: dict[str, Any] = {
        "wall": wall, "rss_mib": usage.ru_maxrss / 1024, "tree_rss_mib": tree / 2**20
    }  # fmt: skip
    answer = None
    if status < 0:
        measured["error"] = (
            f"killed after {wall:.0f} s (time limit {limit:g} s)"
            if status == -1
            else f"interrupted, then killed after {wall:.0f} s (time limit {limit:g} s)"
        )
    elif status == 0 and answer_path.exists():
        answer = json.loads(answer_path.read_text())
    else:
        lines = [x for x in log_path.read_text().splitlines() if x.strip()]
        code = os.waitstatus_to_exitcode(status)
        died = f"died of {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        # a one-line error of bad input (exit status 2) would be the same again: no retry
        measured["crashed"] = code != EXIT_BAD_INPUT
        last = lines[-1].removeprefix("error: ") if lines else ""
        measured["error"] = died if code < 0 or not last else last
        if stop_requested():  # stopped while it started, before it could answer: no crash
            measured["crashed"] = False
            measured["error"] = "interrupted: " + measured["error"]
    answer_path.unlink(missing_ok=True)
    return answer, measured


def _wait(proc: subprocess.Popen, timeout: float, t0: float) -> tuple[int, Any, int]:
    """Wait for the case's process: (its wait status, or -1 when killed past `timeout`, -2
    when killed 15 s after a stop request; its rusage; the largest summed RSS of its process
    group seen). A stop request (Ctrl-C) passes SIGINT on to the group and gives it 15 s to
    answer."""
    from planner.deadline import stop_requested

    interrupted, tree = False, 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage, tree
        tree = max(tree, _tree_rss(proc.pid))
        elapsed = time.perf_counter() - t0
        if stop_requested() and not interrupted:  # the case stops with its best answer
            interrupted, timeout = True, elapsed + 15.0
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
        if elapsed > timeout:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            _, _, usage = os.wait4(proc.pid, 0)
            return -2 if interrupted else -1, usage, tree
        time.sleep(0.2)


_PROBLEM: dict[tuple[str, float], Any] = {}  # the last instance re-checked, in this process


def execute(case: Case, hook: str | None = None, keep: bool = False) -> Outcome:
    """Run `case` here: burners, the case's process, the re-check (see the module doc);
    `keep` the instance loaded for the next case's re-check (the driver; not an idle Ray
    worker, beside the cases other workers run)."""
    from experiments.runinfo import load
    from planner.deadline import catch_interrupt

    if hook and hook.startswith("task:") and fire(hook):
        os.kill(os.getpid(), signal.SIGKILL)  # the test hook: this worker dies
    start = (load() or [math.nan])[0]
    # a Ray task: ray.cancel (Ctrl-C at the driver) arrives as SIGINT, which `_wait` passes
    # on to the case (its best answer so far); one that comes later, during the re-check,
    # only asks to stop, so the finished answer is kept. In the driver, a no-op
    with catch_interrupt():
        with tempfile.TemporaryDirectory(prefix="iopddl-case-") as tmp:
            log = Path(tmp) / "case.log"
            with background_load(case.background):
                answer, measured = run_child(
                    case.path, case.backend, case.seed, case.limit, case.threads, Path(tmp),
                    log, hook if hook and hook.startswith("case:") else None,
                )  # fmt: skip
            text = log.read_bytes()[-LOG_TAIL:].decode("utf-8", "replace") if log.exists() else ""
        c, host = case, socket.gethostname()  # which node, on a cluster
        head = f"# {c.name} {c.backend} seed {c.seed} attempt {c.attempt} on {host}\n"
        out = Outcome(case, answer, {**measured, "load_start": start}, log=head + text)
        if answer is not None and answer.get("choices") is not None:
            out.verdict, out.cost = recheck(_problem(case.path, keep), answer)
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


def impossible(needs: dict[Any, int], node_cpus: list[int]) -> list[Any]:
    """The pending tasks (`needs`: task -> cores it reserves) that no live node (`node_cpus`:
    each one's cores) can run: they would wait forever (their node is gone)."""
    most = max(node_cpus, default=0)
    return [task for task, cpus in needs.items() if cpus > most]


def lost(case: Case, exc: BaseException | str) -> Outcome:
    """The outcome of a case whose Ray task failed (its worker died, its node was lost) or
    cannot run (`exc` a reason): nothing measured."""
    nan = math.nan
    why = exc if isinstance(exc, str) else f"{type(exc).__name__}: {one_line(exc)}"
    error = f"Ray task failed: {why}"[:500]
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
    checked: float = field(default_factory=time.monotonic)  # when the nodes were last looked at

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
        self.node_cpus = max(_alive_cpus())
        self.task = ray.remote(max_retries=0)(execute)
        self.needs: dict[Any, int] = {}  # the cores each pending task reserves
        self.unrunnable: deque[Outcome] = deque()  # found by `_unrunnable`, not yet returned

    def cpus(self, case: Case) -> int:
        """Cores the case reserves: its threads (at most a node's), with burners a whole node."""
        return self.node_cpus if case.background else min(case.threads, self.node_cpus)

    def submit(self, case: Case) -> None:
        cpus = self.cpus(case)
        ref = self.task.options(num_cpus=cpus).remote(case, os.environ.get(CRASH_ENV))
        self.pending[ref], self.needs[ref] = case, cpus

    def next(self) -> Outcome | None:
        """The outcome of the next case to end; None once none is left. After a stop request
        (Ctrl-C): running cases are asked to stop (they answer with their best so far) and
        cases not started are dropped."""
        import ray
        from ray.exceptions import RayError, TaskCancelledError

        from planner.deadline import stop_requested

        while self.pending or self.unrunnable:
            if self.unrunnable:
                return self.unrunnable.popleft()
            if stop_requested() and not self.stopping:
                self.stopping = True
                for ref in self.pending:
                    ray.cancel(ref, force=False)  # SIGINT in a running task, drop a queued one
            done, _ = ray.wait(list(self.pending), num_returns=1, timeout=0.2)
            if not done:
                if (out := self._unrunnable()) is not None:
                    return out
                continue
            case = self.pending.pop(done[0])
            self.needs.pop(done[0], None)
            try:
                return ray.get(done[0])
            except TaskCancelledError:
                continue  # it never started
            except RayError as exc:
                return lost(case, exc)
        return None

    def _unrunnable(self) -> Outcome | None:
        """About once a minute (NODES_SECONDS): the cases waiting for more cores than any
        live node has (their node lost) as `lost` outcomes, their tasks cancelled; the
        first of them (the others on the next calls), else None."""
        import ray

        if not self.unrunnable and time.monotonic() - self.checked >= NODES_SECONDS:
            self.checked = time.monotonic()
            cpus = _alive_cpus()
            most = max(cpus, default=0)
            for ref in impossible(self.needs, cpus):
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
                case, need = self.pending.pop(ref), self.needs.pop(ref)
                why = f"it needs {need} cores and the largest live node has {most}"
                self.unrunnable.append(lost(case, why))
        return self.unrunnable.popleft() if self.unrunnable else None

    def close(self) -> None:
        """Cancel what is left (a second Ctrl-C: force) and stop the Ray instance started."""
        import ray

        for ref in self.pending:
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=True)
        self.pending.clear()
        self.needs.clear()
        if self.started:
            ray.shutdown()


def _alive_cpus() -> list[int]:
    """The cores of each live node of the Ray cluster."""
    import ray

    return [int(n["Resources"].get("CPU", 1)) for n in ray.nodes() if n.get("Alive")]


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
