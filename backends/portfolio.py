"""`portfolio`: the additive backends together, within one time limit, on the machine's cores.

1. `backends.feasible`'s heuristic: a valid answer within a second or so (a 35,000-node
   problem: a few seconds);
2. then at once, each warm-started with the best answer so far: `ilp` in a thread (CBC runs
   in its own process, one core; it first rounds the LP relaxation, which gives an answer
   and a bound within seconds) and `cpsat` in a thread (one worker, the other core; it
   leaves the LP to `ilp` rather than solving it again). Members
   report each better answer (SolveOptions.extra "on_incumbent"); when one beats the answer
   CP-SAT was started from by RESTART_GAIN, CP-SAT is stopped and restarted from it (CBC
   cannot take an answer once it runs, CP-SAT can only be hinted at its start);
3. `mcmc` (through `get_backend`) joins when there is a third core, or runs alone when
   neither solver is installed.

When a member proves its answer optimal the others are stopped. The answer is the best valid
answer any member found (ties: the first member in MEMBERS order), the bound the best proven
one; `stats["events"]` lists who found what and when, `stats["members"]` each member's
result. Deterministic for a seed when no member is stopped early (every member finishes, or
every one runs to the limit). Options: extra "members" (names, default by cores), "workers"
(cores to use, default all).

The makespan objective is delegated to `mcmc` (the placement models of `ilp` and `cpsat`
answer a narrower question, see docs/solvers.md); `stats["delegated"]` says so.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from backends import get_backend
from backends.base import (
    Backend,
    Limit,
    ProgressLog,
    SolveOptions,
    SolveResult,
    Status,
    past,
    request_stop,
    stop_requested,
)
from backends.feasible import feasible_positions
from backends.selection import selection
from planner.problems.evaluate import additive_cost, memory_feasible
from planner.problems.problem import Problem

__all__ = ["PortfolioBackend"]

MEMBERS = ("ilp", "cpsat", "mcmc")  # in tie-breaking order
START_FRACTION = 0.05  # of the time limit for polishing the heuristic's answer
RESTART_GAIN = 0.002  # CP-SAT restarts from another member's answer this much better
POLL_SECONDS = 0.1


@dataclass
class _Board:
    """The best valid answer so far and how it got there (shared by the member threads)."""

    problem: Problem
    start: float
    best: tuple[float, int, tuple[int, ...], str] | None = None  # value, rank, choices, who
    events: list[tuple[float, str, float]] = field(default_factory=list)
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
            if self.best is not None and (value, rank) >= self.best[:2]:
                return False
            self.best = (value, rank, ch, source)
            self.events.append((round(time.perf_counter() - self.start, 3), source, value))
        self.progress(lambda: f"best {value:.6g} from {source}")
        return True

    def value(self) -> float:
        with self.lock:
            return self.best[0] if self.best else math.inf


class PortfolioBackend(Backend):
    name = "portfolio"
    objectives = ("additive", "makespan")
    exact = True  # when a member proves the optimum

    def _solve(self, problem: Problem, options: SolveOptions) -> SolveResult:
        if options.objective == "makespan":
            result = get_backend("mcmc").solve(problem, options)
            stats = {**result.stats, "delegated": "mcmc"}
            return replace(result, backend=self.name, objective=None, strategy=None, stats=stats)
        t0 = time.perf_counter()
        deadline = t0 + options.time_limit
        sel = selection(problem)
        if sel.infeasible:
            stats = {"reason": sel.infeasible}
            return SolveResult(self.name, Status.INFEASIBLE, bound=math.inf, stats=stats)
        board = _Board(problem, t0)
        start = feasible_positions(
            sel, deadline, options.seed, t0 + START_FRACTION * options.time_limit
        )
        if start is not None:
            board.offer(sel.choices(start), "heuristic")
        members = self._members(problem, options)
        run = _Run(board, options, deadline, members)
        run.go()
        return run.result(self.name, sel.trivial_bound(), time.perf_counter() - t0)

    def _members(self, problem: Problem, options: SolveOptions) -> list[str]:
        names = options.extra.get("members")
        if names is None:
            workers = int(options.extra.get("workers", os.cpu_count() or 1))
            names = [m for m in ("ilp", "cpsat") if get_backend(m).is_installed()]
            if workers > len(names) or not names:
                names.append("mcmc")
        return [m for m in names if get_backend(m).can_run(problem, options) is None]


class _Run:
    """The member threads of one solve and the loop that coordinates them."""

    def __init__(self, board: _Board, options: SolveOptions, deadline: float, members: list[str]):
        self.board, self.options, self.deadline = board, options, deadline
        self.members = members
        self.results: dict[str, list[SolveResult]] = {m: [] for m in members}
        self.stop_all = threading.Event()
        self.restart = threading.Event()  # CP-SAT: stop and start again from the best answer
        self.hinted = math.inf  # the value CP-SAT was last started from
        self.interrupted = False

    def go(self) -> None:
        threads = [
            threading.Thread(target=self._member, args=(m,), daemon=True) for m in self.members
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(POLL_SECONDS)
            if stop_requested():
                self.interrupted = True
                self.stop_all.set()
            if self._proven():
                self.stop_all.set()
            if "cpsat" in self.members and self.board.value() < self.hinted * (1 - RESTART_GAIN):
                self.restart.set()
        if self.interrupted:
            request_stop()  # a member's solve may have cleared it: Backend.solve reads it

    def _member(self, name: str) -> None:
        backend = get_backend(name)
        while not self.stop_all.is_set() and not past(self.deadline):
            with self.board.lock:
                warm = self.board.best[2] if self.board.best else None
                value = self.board.best[0] if self.board.best else math.inf
            stop = self.restart if name == "cpsat" else self.stop_all
            if name == "cpsat":
                self.hinted = value
                self.restart.clear()
            extra = {**self.options.extra, "on_incumbent": self.board.offer, "stop": stop}
            extra.pop("members", None)
            if name == "cpsat" and "ilp" in self.members:
                extra.setdefault("lp_start", False)  # ilp's LP rounding arrives as an answer
            opts = replace(
                self.options,
                time_limit=max(0.05, self.deadline - time.perf_counter()),
                threads=1,
                warm_start=warm,
                extra=extra if name != "mcmc" else {},
            )
            result = backend.solve(self.board.problem, opts)
            self.results[name].append(result)
            if result.choices is not None:
                self.board.offer(result.choices, name)
            again = name == "cpsat" and self.restart.is_set() and not self.stop_all.is_set()
            if not again:
                return

    def _proven(self) -> bool:
        value = self.board.value()
        return any(
            r.status is Status.OPTIMAL
            and r.objective is not None
            and r.objective <= value * (1 + 1e-9)
            for rs in self.results.values()
            for r in rs
        )

    def result(self, name: str, trivial: float, elapsed: float) -> SolveResult:
        bounds = [trivial] + [
            r.bound for rs in self.results.values() for r in rs if r.bound is not None
        ]
        bound = max(bounds)
        stats: dict[str, Any] = {
            "events": list(self.board.events),
            "members": {m: [_summary(r) for r in rs] for m, rs in self.results.items()},
            "portfolio_seconds": elapsed,
        }
        if self.board.best is None:
            return SolveResult(name, Status.NO_SOLUTION, bound=bound, limit=Limit.TIME, stats=stats)
        value, _, choices, source = self.board.best
        stats["answer_from"] = source
        optimal = self._proven() or bound >= value * (1 - 1e-9)
        status = Status.OPTIMAL if optimal else Status.FEASIBLE
        limit = None if optimal else Limit.TIME
        return SolveResult(name, status, choices, bound=min(bound, value), limit=limit, stats=stats)


def _summary(r: SolveResult) -> dict[str, Any]:
    keep = ("solve_seconds", "search_seconds", "restricted", "hint", "answer", "cbc_result",
            "cbc_peak_mib", "lp_start")  # fmt: skip
    return {
        "status": r.status.value,
        "limit": r.limit.value if r.limit else None,
        "objective": r.objective,
        "bound": r.bound,
        **{k: r.stats[k] for k in keep if k in r.stats},
    }
