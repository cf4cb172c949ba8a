"""`portfolio`: the additive backends together, within one time limit, on the machine's cores.

1. `backends.heuristics.feasible`'s heuristic: a valid answer within a second or so (a 35,000-node
   problem: a few seconds);
2. then at once, each warm-started with the best answer so far: `ilp` in a process (CBC runs
   in its own process, one core; it first rounds the LP relaxation, which gives an answer
   and a bound within seconds) and `cpsat` in a process (one worker, the other core; exactly
   as `cpsat` alone: its own LP rounding as the hint of its whole model for 30% of the time,
   then `backends.mathprog.lns`'s neighbourhood search). Members report each better
   answer (`SolveOptions.channel.on_incumbent`); when one beats the answer CP-SAT last had
   by RESTART_GAIN, it goes to CP-SAT's neighbourhood search, which continues from it at
   its next round (`channel.incoming`). With cpsat's setting "lns" False CP-SAT is stopped
   (`channel.stop`) and restarted from it instead (CBC cannot take an answer once it runs,
   CP-SAT's whole model only at its start), and its LP start is left to `ilp`;
3. `mcmc` (through `get_backend`) joins when there is a third core, or runs alone when
   no solver (ilp, cpsat, toulbar2, local) is installed.

On a larger model (`_members`, `exact_fits`: by the columns the exact members' models would
have, their predicted solve time against the time limit and the share of a core measured
here, not by node count) the members are instead `toulbar2` and `local`, one core each
(toulbar2's rounds run in a child process while its own waits), with no heuristic start
(local finds a valid answer in about a second): every better
answer either finds goes to the other (`channel.incoming`; SHARED), so local's annealing
continues from toulbar2's repaired rounds and toulbar2's bound uses local's answers as its
upper value. The bound is toulbar2's Lagrangian bound. `stats["choice"]` holds what decided
the members: the problem's features (`backends.model.hardness`), the model's columns, the
predicted seconds and the measured CPU share where they were needed.

Members share answers and bounds: each sends every better answer and every better lower
bound it proves while it runs (`Channel.on_bound`: CBC's, CP-SAT's, toulbar2's Lagrangian
bound; at most one every BOUND_SECONDS), and a bound given to the portfolio
(`SolveOptions.channel.bound`, e.g. `auto`'s unconstrained optimum) starts the board's. When
the best answer is within the gap tolerance of the best bound (`SolveOptions.gap_tolerance`,
`proven_within`), or a member proves its answer optimal within it, every member is stopped
and the answer is OPTIMAL. The answer is the best valid answer any member found (ties: the
first member in MEMBERS order), the bound the best proven one; `stats["events"]` lists who
found what and when, `stats["bounds"]` who proved which bound when (their merged history is
the anytime trace, `stats["trace"]`, `backends.trace`), `stats["members"]` each member's
result. With a patience (settings "patience", seconds, and "patience_share",
of the time to the last gain; `auto` sets them for a DNN's search under the memory limit)
the members are also stopped once no answer has been better by "patience_gain" (default:
the gap tolerance) for that long: FEASIBLE, limit None, `stats["stalled"]` (seconds without
a gain). Deterministic for a seed only when every member finishes before the limit (a search
stopped by the clock, the neighbourhood search's rounds included, depends on the machine's
speed). Settings (`PortfolioSettings`, given as `SolveOptions.extra`): "members" (names,
default by cores), "workers" (cores to use, default all), "patience", "patience_share" and
"patience_gain" (above), and each member's own settings
("ilp", "cpsat", "mcmc", "toulbar2", "local": `IlpSettings`, `CpsatSettings`,
`McmcSettings`, `Toulbar2Settings`, `LocalSettings`, as mappings; local's patience is 0 here,
so it searches to the limit). A `warm_start` is the first answer on the board.

The makespan objective is delegated to `mcmc` (the placement models of `ilp` and `cpsat`
answer a narrower question, see docs/solvers.md); `stats["delegated"]` says so.
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

import numpy as np

from backends import get_backend
from backends.base import (
    Backend,
    BackendSettings,
    Channel,
    Check,
    Limit,
    ProgressLog,
    SolveOptions,
    SolveResult,
    Status,
    at_least,
    between,
    past,
    proven_within,
    request_stop,
    stop_requested,
)
from backends.heuristics.feasible import feasible_positions
from backends.local.anneal import LocalSettings
from backends.mathprog.common import CpsatSettings, IlpSettings
from backends.mcmc.chain import McmcSettings
from backends.model.hardness import hardness, model_size
from backends.model.selection import Selection, selection
from backends.wcsp.toulbar2 import Toulbar2Settings
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem

__all__ = ["PortfolioBackend", "PortfolioSettings"]

MEMBERS = ("ilp", "cpsat", "toulbar2", "local", "mcmc")  # in tie-breaking order
SOLVERS = {"ilp": "pulp", "cpsat": "ortools"}  # the exact members (models of a fitting size)
LARGE_SOLVERS = {"toulbar2": "pytoulbar2", "local": "numba"}  # ... for larger models
# The exact members run when their model (`backends.model.hardness.model_size`: columns of
# the LP, a strategy or a grouped pair each) is small, or when its predicted solve time fits
# in EXACT_SHARE of the time limit at the share of a core this process gets (measured:
# `cpu_share`) and the model is below EXACT_MOST; else toulbar2 and local. Node count does
# not decide: IOPDDL G (816 nodes, 66,620 columns) is proven by ilp and cpsat in 7-15 s of a
# 120 s limit, but with --time-limit 10 at load 3.5 they answered 384x the optimum where
# toulbar2 found it; a problem with G's graph and 29 strategies per node (430,000-450,000
# columns) is 378x the best after 20 s and 39.5x after 300 s with them, 1.00x with toulbar2
# and local (docs/solvers.md, "What decides the members")
EXACT_ALWAYS = 20_000  # columns: the exact members whatever the limit (contest_problem(120):
# 8,000, proven in 2 s)
EXACT_MOST = 200_000  # columns: never the exact members above (G-like: 430,000+)
EXACT_SECONDS_PER_COLUMN = 1.5e-4  # G: 66,620 columns proven in 7-15 s (load 1-2)
EXACT_SHARE = 0.5  # of the time limit the exact members' predicted solve time may take
EXACT_SCAN_ENTRIES = 2_000_000  # table entries from which the model is not sized (grouping
# shrinks real tables 3-4x: IOPDDL S 5.1 M entries to 1.7 M columns; sizing S takes 1.7 s)
PROBE_SECONDS = 0.05  # the CPU-share probe (only when the share decides)
SHARED = ("local", "toulbar2")  # members that take every better answer found elsewhere
CANDIDATES = ("toulbar2", "local")  # the first sends candidates (`Channel.on_candidate`:
# valid answers a little above its best), the second anneals from them when it has stalled
WIND_DOWN_SECONDS = 1.0  # members search until this much before the deadline (or
WIND_DOWN_SHARE = 0.1  # this share of the time limit, if less): their wind-down (a toulbar2
# round killed up to 0.5 s past its own deadline, its bound, a re-score, the process's exit) is
# inside the limit; members still running at the deadline are killed (each has sent its
# answers as it found them; what is lost is a last result's bound)
START_FRACTION = 0.1  # of the time limit for polishing the heuristic's answer
RESTART_GAIN = 0.002  # CP-SAT gets another member's answer when it is this much better
POLL_SECONDS = 0.1
BOUND_SECONDS = 0.05  # a member sends a better bound at most this often
INTERRUPT_GRACE_SECONDS = 0.4  # after Ctrl-C, members still running this much later are killed
MAILBOX_TRIES = 100  # reads of a mailbox that is being written before `latest` gives up


def _members_ok(names: tuple[str, ...] | None) -> bool:
    return names is None or (bool(names) and set(names) <= set(MEMBERS))


def _workers_ok(workers: int | None) -> bool:
    return workers is None or workers > 0


@dataclass(frozen=True)
class PortfolioSettings(BackendSettings):
    """The `portfolio` backend's settings: which members run, and each member's settings."""

    members: Annotated[
        tuple[str, ...] | None, Check(f"None or a non-empty list from {MEMBERS}", _members_ok)
    ] = None
    """the members to run; None: the installed solvers, and mcmc with a core to spare"""
    workers: Annotated[int | None, Check("None or a positive integer", _workers_ok)] = None
    """the cores to count on when choosing the members; None: all (os.cpu_count())"""
    ilp: IlpSettings = field(default_factory=IlpSettings)
    """the ilp member's settings"""
    cpsat: CpsatSettings = field(default_factory=CpsatSettings)
    """the cpsat member's settings (its "lns" runs with one thread: "auto" is on; with it
    off and ilp running, its LP start is off: ilp's LP rounding arrives as an answer)"""
    mcmc: McmcSettings = field(default_factory=McmcSettings)
    """the mcmc member's settings, and mcmc's when the makespan objective is delegated"""
    toulbar2: Toulbar2Settings = field(default_factory=lambda: Toulbar2Settings(overlap=False))
    """the toulbar2 member's settings (its bound does not overlap its rounds here: `local`
    has the other core)"""
    local: LocalSettings = field(default_factory=lambda: LocalSettings(patience=0))
    """the local member's settings (by default it searches to the limit: patience 0)"""
    patience: Annotated[float, at_least(0.0, "a number of seconds >= 0")] = 0.0
    """seconds without a gain (an answer better by `patience_gain`) after which every member
    is stopped, FEASIBLE with limit None and `stats["stalled"]`; 0 (with `patience_share`
    0): never (the members search to the time limit or a proof)"""
    patience_share: Annotated[float, at_least(0.0, "a number >= 0")] = 0.0
    """... or, when longer, this share of the time the search took to its last gain (1:
    stop at twice that time, the same rule on a machine k times slower)"""
    patience_gain: Annotated[float, between(0.0, 1.0, "a fraction")] = 0.0
    """what counts as a gain: an answer better than the last gain's by this fraction (0: by
    more than the gap tolerance)"""


@dataclass
class _Board:
    """The best valid answer so far and how it got there (in the portfolio's process)."""

    problem: Problem
    start: float
    best: tuple[float, int, tuple[int, ...], str] | None = None  # value, rank, choices, who
    bound: float = -math.inf  # the best lower bound proven so far (any member's, or given)
    bound_from: str = ""
    gain: float = 0.0  # a better answer by less than this (relative) is no gain (patience)
    gained: tuple[float, float] = (math.inf, 0.0)  # the last gain: value, perf_counter time
    events: list[tuple[float, str, float]] = field(default_factory=list)  # better answers
    bounds: list[tuple[float, str, float]] = field(default_factory=list)  # better bounds
    lock: threading.Lock = field(default_factory=threading.Lock)
    progress: ProgressLog = field(default_factory=lambda: ProgressLog("portfolio"))

    def offer(self, choices: Sequence[int], source: str) -> bool:
        """Record a member's answer if it is valid and the best so far."""
        ch = tuple(int(c) for c in choices)
        value = additive_cost(self.problem, ch)
        if not math.isfinite(value) or not memory_feasible(self.problem, ch):
            return False
        rank = MEMBERS.index(source) if source in MEMBERS else len(MEMBERS)
        with self.lock:
            if self.best is not None and ((value, rank) >= self.best[:2] or ch == self.best[2]):
                return False  # not better (or the answer itself, handed to another member)
            self.best = (value, rank, ch, source)
            now = time.perf_counter()
            self.events.append((round(now - self.start, 3), source, value))
            if value < self.gained[0] * (1 - self.gain):
                self.gained = (value, now)
        self.progress(lambda: f"best {value:.6g} from {source}")
        return True

    def offer_bound(self, bound: float, source: str) -> None:
        """Record a member's proven lower bound if it is the best so far."""
        with self.lock:
            if bound > self.bound:
                self.bound, self.bound_from = bound, source
                self.bounds.append((round(time.perf_counter() - self.start, 3), source, bound))

    def value(self) -> float:
        with self.lock:
            return self.best[0] if self.best else math.inf


class PortfolioBackend(Backend[PortfolioSettings]):
    name = "portfolio"
    objectives = ("additive", "makespan")
    exact = True  # when a member proves the optimum
    settings_type = PortfolioSettings
    own_trace = True  # the board's events and bounds (`_Run.result`)

    def _solve(
        self, problem: Problem, options: SolveOptions, settings: PortfolioSettings
    ) -> SolveResult:
        if options.objective == "makespan":
            result = get_backend("mcmc").solve(problem, replace(options, extra=settings.mcmc))
            stats = {**result.stats, "delegated": "mcmc"}
            # mcmc's objective (the simulator's) stays the reported one: the re-score keeps it
            # when no time is left to simulate again
            return replace(result, backend=self.name, strategy=None, stats=stats)
        t0 = time.perf_counter()
        deadline = options.clock().at
        first = options.clock().part(START_FRACTION).at  # the heuristic's cap, from t0
        board = _Board(problem, t0, gain=settings.patience_gain or options.gap_tolerance)
        members, why, sel = self._members(settings, problem, deadline - t0)
        trivial = -math.inf  # no bound of our own unless the heuristic's tables give one
        if "local" not in members:  # local finds a first answer sooner than the heuristic
            sel = sel if sel is not None else selection(problem)
            if sel.infeasible:
                stats = {"reason": sel.infeasible}
                return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
            start = feasible_positions(sel, deadline, options.seed, first)
            if start is not None:
                board.offer(sel.choices(start), "heuristic")
            trivial = sel.trivial_bound()
        if options.warm_start is not None:
            board.offer(problem.check_choices(options.warm_start), "warm start")
        given = options.channel.known_bound()
        if given is not None:  # a bound proven elsewhere (auto's unconstrained optimum)
            board.offer_bound(given, "given")
        run = _Run(board, options, settings, deadline, members)
        run.go()
        result = run.result(self.name, trivial, time.perf_counter() - t0)
        return replace(result, stats={**result.stats, "choice": {**why, "members": members}})

    def _members(
        self, settings: PortfolioSettings, problem: Problem, seconds: float
    ) -> tuple[list[str], dict[str, Any], Selection | None]:
        """The members, why (features and the rule's numbers, `stats["choice"]`), and the
        selection made for the features (None if none was needed)."""
        if settings.members is not None:
            return list(settings.members), {"by": "members"}, None
        workers = settings.workers if settings.workers is not None else os.cpu_count() or 1
        names = [m for m, module in SOLVERS.items() if importlib.util.find_spec(module)]
        large = [m for m, module in LARGE_SOLVERS.items() if importlib.util.find_spec(module)]
        features = hardness(problem)
        why: dict[str, Any] = features.row()
        sel = None
        exact = bool(names)  # (no exact solver installed: the large members, or mcmc)
        if names and large and features.entries >= EXACT_SCAN_ENTRIES:
            exact = False  # too large to be worth the selection's seconds
        elif names and large:
            sel = selection(problem)
            if not sel.infeasible:  # (else the exact members' path says so)
                exact, rule = exact_fits(model_size(sel), seconds)
                why.update(rule)
        if large and not exact:
            return large, why, sel
        if workers > len(names) or not names:
            names.append("mcmc")
        return names, why, sel


def exact_fits(columns: int, seconds: float) -> tuple[bool, dict[str, Any]]:
    """Whether the exact members (ilp and cpsat) fit a model of `columns` columns in
    `seconds`, and the rule's numbers: always up to EXACT_ALWAYS columns, never from
    EXACT_MOST; between, when the predicted solve time, at the share of a core this process
    gets (probed only when it decides), is within EXACT_SHARE of the time."""
    predicted = columns * EXACT_SECONDS_PER_COLUMN
    rule: dict[str, Any] = {"columns": columns, "predicted_seconds": round(predicted, 2)}
    if columns <= EXACT_ALWAYS or columns >= EXACT_MOST:
        return columns <= EXACT_ALWAYS, rule
    budget = EXACT_SHARE * seconds
    if predicted > budget or not math.isfinite(budget):  # (no limit: no probe)
        return predicted <= budget, rule
    share = cpu_share()
    rule["cpu_share"] = round(share, 2)
    return predicted / share <= budget, rule


def cpu_share(seconds: float = PROBE_SECONDS) -> float:
    """The share of a core this process gets now (CPU time over wall time of a busy loop):
    about 1 on a quiet machine, 2 / (runnable processes) on a busy 2-core one."""
    x = np.arange(1024.0)
    w0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - w0 < seconds:
        x = np.sqrt(x * x + 1.0)
    return min(1.0, max(0.05, (time.process_time() - c0) / (time.perf_counter() - w0)))


class _Run:
    """The member processes of one solve and the loop that coordinates them.

    Members run in processes forked from this one (no lock between Python members, and the
    problem's tables are shared until written); they send each better answer and their
    results through one queue. CP-SAT is restarted from a better answer by setting its stop
    event and handing it the answer."""

    def __init__(
        self,
        board: _Board,
        options: SolveOptions,
        settings: PortfolioSettings,
        deadline: float,
        members: list[str],
    ):
        self.board, self.options, self.deadline = board, options, deadline
        self.tolerance = options.gap_tolerance
        self.patience = (settings.patience, settings.patience_share)
        self.stalled: float | None = None  # seconds without a gain when patience ended it
        self.clock = options.clock()  # its `at` is `deadline` (a test may give another)
        wind_down = min(WIND_DOWN_SECONDS, WIND_DOWN_SHARE * self.clock.limit)
        self.members_until = deadline - wind_down  # the members' own deadline
        self.members = members
        ctx = multiprocessing.get_context("fork")
        self.queue: Any = ctx.Queue()
        self.stop = {m: ctx.Event() for m in members}  # the member's current search stops
        self.done = ctx.Event()  # no member starts again
        self.ended = ctx.RawValue("b", 0)  # 1 with `done`: each member stops (`_stop_when`)
        nodes = len(board.problem.node_cost)
        self.hints = {m: _Mailbox(ctx, nodes) for m in members}
        sender, taker = CANDIDATES
        self.candidates = (
            _Mailbox(ctx, nodes) if sender in members and taker in members else None
        )  # the sender's candidates for the taker
        self.results: dict[str, list[SolveResult]] = {m: [] for m in members}
        self.hinted = {m: board.value() for m in members}  # the value each was last sent
        self.interrupted = False
        # CP-SAT with one worker ends in `backends.mathprog.lns`, which takes better answers as it goes
        self.lns = settings.cpsat.neighbourhoods(threads=1)
        cpsat = settings.cpsat
        if "ilp" in members and not self.lns:
            cpsat = replace(cpsat, lp_start=False)  # ilp's LP rounding arrives as an answer
        self.settings: dict[str, BackendSettings] = {
            "ilp": settings.ilp,
            "cpsat": cpsat,
            "mcmc": settings.mcmc,
            "toulbar2": settings.toulbar2,
            "local": settings.local,
        }
        with board.lock:
            warm = board.best[2] if board.best else None
        self.procs = {
            # toulbar2 forks its rounds, which a daemonic process may not: no member is
            # daemonic, and `go` kills every one still running however it ends
            m: ctx.Process(target=self._member, args=(m, warm), daemon=False)
            for m in members
        }

    def go(self) -> None:
        try:
            self._go()
        finally:
            for p in self.procs.values():
                if p.is_alive():
                    p.kill()  # our own child, by its handle
                    p.join()

    def _go(self) -> None:
        for p in self.procs.values():
            p.start()
        hard = self.deadline
        while any(p.is_alive() for p in self.procs.values()) or not self.queue.empty():
            self._drain(min(POLL_SECONDS, hard - time.perf_counter()))
            if stop_requested() and not self.interrupted:
                self.interrupted = True
                # the members' answers so far are on the board (each sends every better
                # one); what they would send while stopping is not worth the user's wait
                hard = min(hard, time.perf_counter() + INTERRUPT_GRACE_SECONDS)
            if self.interrupted or self._proven() or self._stalled():
                self.done.set()
                self.ended.value = 1
                for e in self.stop.values():
                    e.set()
            self._restart_cpsat()
            self._share()
            if time.perf_counter() > hard:
                break
        for p in self.procs.values():
            p.join(timeout=max(0.0, hard - time.perf_counter()))
            if p.is_alive():
                p.kill()  # our own child, by its handle
        self._drain(0.0)  # what is in the pipe already (every member has ended or was killed)
        if self.interrupted:
            request_stop()  # Backend.solve marks the result INTERRUPTED

    def _drain(self, timeout: float = POLL_SECONDS) -> None:
        try:
            kind, name, item = self.queue.get(timeout=max(timeout, 1e-3))
        except queue.Empty:
            return
        while True:
            if kind == "answer":
                self.board.offer(item, name)
            elif kind == "bound":
                self.board.offer_bound(item, name)
            elif kind == "candidate":
                if self.candidates is not None and not self.done.is_set():
                    self.candidates.put(item)
            else:
                self.results[name].append(item)
                if item.choices is not None:
                    self.board.offer(item.choices, name)
            try:
                kind, name, item = self.queue.get_nowait()
            except queue.Empty:
                return

    def _restart_cpsat(self) -> None:
        """Hand CP-SAT a better answer: its neighbourhood search takes it at its next round;
        a search without one (cpsat's lns False) is stopped and started again from it."""
        if "cpsat" not in self.procs or not self.procs["cpsat"].is_alive() or self.done.is_set():
            return
        value = self.board.value()
        if value < self.hinted["cpsat"] * (1 - RESTART_GAIN):
            with self.board.lock:
                assert self.board.best is not None
                self.hints["cpsat"].put(self.board.best[2])
            self.hinted["cpsat"] = value
            if not self.lns:
                self.stop["cpsat"].set()

    def _share(self) -> None:
        """Hand each running member of SHARED every better answer another member found."""
        if self.done.is_set():
            return
        with self.board.lock:
            if self.board.best is None:
                return
            value, _, choices, source = self.board.best
        for m in SHARED:
            if m in self.procs and m != source and value < self.hinted[m]:
                if self.procs[m].is_alive():
                    self.hints[m].put(choices)
                self.hinted[m] = value

    def _member(self, name: str, warm: tuple[int, ...] | None) -> None:
        """In the member's process: solve, and for CP-SAT again from each better answer."""
        # Ctrl-C reaches every process of the terminal's group: a member stops quietly (the
        # parent says it once and stops the others through their events)
        signal.signal(signal.SIGINT, lambda signum, frame: request_stop())
        # a Ctrl-C that reached only the parent (a `kill -INT`, `timeout -s INT`), or another
        # member's proof, ends the whole portfolio (`done`): the member stops as at a Ctrl-C,
        # in time to send its result (toulbar2's bound came too late: it only looks at the
        # process's stop flag)
        threading.Thread(target=_stop_when, args=(self.ended,), daemon=True).start()
        backend = get_backend(name)
        send = self.queue.put
        sender, taker = CANDIDATES
        with_candidates = self.candidates is not None
        channel = Channel(
            on_incumbent=lambda ch, who: send(("answer", name, tuple(ch))),
            on_bound=_BoundSender(name, send),
            stop=self.stop[name],
            incoming=self.hints[name].latest
            if name in SHARED or name == "cpsat" and self.lns
            else None,
            on_candidate=(lambda ch, who: send(("candidate", name, tuple(ch))))
            if with_candidates and name == sender
            else None,
            candidate=self.candidates.latest
            if self.candidates is not None and name == taker
            else None,
        )
        while True:
            opts = replace(
                # the members' deadline, or 50 ms from now if that is later (not past ours)
                self.options.with_deadline(
                    self.clock.within(max(0.05, self.members_until - time.perf_counter()))
                ),
                threads=1,
                warm_start=warm,
                extra=self.settings[name],
                channel=channel,
            )
            try:
                result = backend.solve(self.board.problem, opts)
            except Exception as exc:  # a member's failure is reported, not raised here
                result = SolveResult(name, Status.NO_SOLUTION, stats={"error": str(exc)})
            send(("result", name, replace(result, stats=_summary(result))))
            if name != "cpsat" or self.lns or self.done.is_set() or past(self.members_until):
                return
            warm = self.hints[name].wait(POLL_SECONDS)
            if warm is None:
                return  # it stopped for another reason
            self.stop[name].clear()

    def _proven(self) -> bool:
        """Whether the search is over: a member proved that nothing is valid, or the best
        answer is within the gap tolerance of the best bound (any member's, sent as it was
        proven or with its result), or a member proved its answer optimal (within the
        tolerance) and the best is no worse."""
        value = self.board.value()
        if self._infeasible() or proven_within(value, self._bound(), self.tolerance):
            return True
        return any(
            r.status is Status.OPTIMAL
            and r.objective is not None
            and r.objective <= value * (1 + 1e-9)
            for rs in self.results.values()
            for r in rs
        )

    def _bound(self) -> float:
        """The best lower bound proven so far: sent while the members ran, or in a result."""
        ended = [r.bound for rs in self.results.values() for r in rs if r.bound is not None]
        with self.board.lock:
            return max([self.board.bound, *ended])

    def _stalled(self) -> bool:
        """Whether the patience (`patience` seconds, or `patience_share` of the time to the
        last gain) passed without a gain (`patience_gain`): the search is stopped
        (`stats["stalled"]`)."""
        seconds, share = self.patience
        if not (seconds or share) or self.board.best is None:
            return self.stalled is not None
        gained = self.board.gained[1]
        quiet = time.perf_counter() - gained
        if self.stalled is None and quiet >= max(seconds, share * (gained - self.board.start)):
            self.stalled = quiet
        return self.stalled is not None

    def _infeasible(self) -> bool:
        """Whether a member proved that no answer is valid (an exact member's proof)."""
        return any(r.status is Status.INFEASIBLE for rs in self.results.values() for r in rs)

    def result(self, name: str, trivial: float, elapsed: float) -> SolveResult:
        best_bound = max(trivial, self._bound())
        bound = best_bound if best_bound > -math.inf else None  # no member proved one
        stats: dict[str, Any] = {
            "events": list(self.board.events),
            "members": {m: [dict(r.stats) for r in rs] for m, rs in self.results.items()},
            "portfolio_seconds": elapsed,
            "bounds": list(self.board.bounds),
            # the anytime trace (backends.trace): the best answer and the best bound over
            # every member, as the board saw them
            "trace": {
                "incumbent": [[t, v] for t, _, v in self.board.events],
                "bound": [[t, b] for t, _, b in self.board.bounds],
            },
        }
        if self.board.best is None:
            if self._infeasible():
                return SolveResult(name, Status.INFEASIBLE, bound=math.inf, stats=stats)
            return SolveResult(name, Status.NO_SOLUTION, bound=bound, limit=Limit.TIME, stats=stats)
        value, _, choices, source = self.board.best
        stats["answer_from"] = source
        optimal = self._proven() or proven_within(value, bound, self.tolerance)
        status = Status.OPTIMAL if optimal else Status.FEASIBLE
        limit = None if optimal or self.stalled is not None else Limit.TIME
        if self.stalled is not None:
            stats["stalled"] = round(self.stalled, 3)
        if optimal and not proven_within(value, bound, self.tolerance):
            # a member's own proof (its result OPTIMAL, no worse than the best): the
            # optimum is at least its answer / (1 + tolerance)
            bound = max(-math.inf if bound is None else bound, value / (1 + self.tolerance))
        if bound is not None:
            bound = min(bound, value)
        return SolveResult(name, status, choices, bound=bound, limit=limit, stats=stats)


class _BoundSender:
    """In a member's process: its better bounds to the portfolio, at most one every
    BOUND_SECONDS (the Lagrangian bound improves many times a second; the member's result
    carries its last bound)."""

    def __init__(self, name: str, send: Any):
        self.name, self.send = name, send
        self.sent, self.at = -math.inf, -math.inf

    def __call__(self, bound: float, who: str) -> None:
        now = time.perf_counter()
        if bound > self.sent and now - self.at >= BOUND_SECONDS:
            self.sent, self.at = float(bound), now
            self.send(("bound", self.name, float(bound)))


def _stop_when(ended: Any) -> None:
    """In a member's process: ask this process to stop (`request_stop`) once `ended` (a
    shared byte, no lock) is 1. Not an event's `wait`: a member killed while waiting on the
    portfolio's `done` left `done.set()` waiting for it for ever (the tests hung)."""
    while not ended.value:
        time.sleep(POLL_SECONDS)
    request_stop()


class _Mailbox:
    """The latest answer for one member, in shared memory: a `put` replaces the one before,
    and `latest` gives the member the newest it has not seen. (A process queue gave only
    what its feeder thread had written: an answer of a large problem fills the pipe, so on a
    busy machine the reader often found one answer, the oldest of a backlog. On IOPDDL S,
    toulbar2, which looks once a round, took `local`'s answers 30-60 s late: 2.08e9 when
    `local` was at 1.56e9.)

    No lock: a member is killed at the deadline, and a lock it held would block the next
    `put` for ever (the tests hung so). One process writes (the portfolio's); the version is
    odd while it writes, and a reader keeps a copy only if the version was even and the same
    before and after it (a sequence lock)."""

    def __init__(self, ctx: Any, nodes: int) -> None:
        self.values = ctx.RawArray("q", max(nodes, 1))  # int64 strategy indices
        self.version = ctx.RawValue("q", 0)
        self.nodes = nodes
        self.seen = 0  # in the reader's process: the version it last took

    def put(self, choices: Sequence[int]) -> None:
        """Only the portfolio's process writes."""
        v = self.version.value
        self.version.value = v + 1
        np.frombuffer(self.values, dtype=np.int64)[: self.nodes] = choices
        self.version.value = v + 2

    def latest(self) -> tuple[int, ...] | None:
        """The newest answer this process has not taken yet, or None (also while one is
        being written, after a few tries)."""
        for _ in range(MAILBOX_TRIES):
            v = self.version.value
            if v == self.seen:
                return None
            if v % 2:
                time.sleep(0.0005)
                continue
            copy = np.frombuffer(self.values, dtype=np.int64)[: self.nodes].copy()
            if self.version.value == v:
                self.seen = v
                return tuple(copy.tolist())
        return None

    def wait(self, timeout: float) -> tuple[int, ...] | None:
        """`latest`, waiting up to `timeout` seconds for one."""
        end = time.perf_counter() + timeout
        while True:
            out = self.latest()
            if out is not None or time.perf_counter() >= end:
                return out
            time.sleep(min(0.005, timeout))


def _summary(r: SolveResult) -> dict[str, Any]:
    keep = ("solve_seconds", "search_seconds", "restricted", "hint", "answer", "cbc_result",
            "cbc_peak_mib", "lp_start", "lns", "error", "adopted", "candidates", "rounds", "moves",
            "found_by", "crossed", "crossed_repaired")  # fmt: skip
    return {
        "status": r.status.value,
        "limit": r.limit.value if r.limit else None,
        "objective": r.objective,
        "bound": r.bound,
        **{k: r.stats[k] for k in keep if k in r.stats},
    }
