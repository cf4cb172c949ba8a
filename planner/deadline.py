"""One clock for a whole call: a `Deadline` made where the call enters, handed to every phase.

`planner.plan`, the command lines and the experiments make one `Deadline` from the user's
time limit; capture, build, search, re-score, recommendation and writing all read it, and a
phase that cannot finish in what is left degrades and says so. Ctrl-C sets the same deadline
to now: `request_stop()` makes every `Deadline` (and every `past(t)`) expired at once.

Hot loops compare a plain `time.perf_counter()` value (`Deadline.at`) with `past(at)`, or
count with a `Clock` that looks every `CHECK_EVERY` items and raises `OutOfTime`.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from planner.errors import LayerwiseError

T = TypeVar("T")

__all__ = [
    "CHECK_EVERY",
    "BuildOutOfTime",
    "Clock",
    "Deadline",
    "OutOfTime",
    "catch_interrupt",
    "clear_stop",
    "past",
    "request_stop",
    "run_within",
    "shielded",
    "stop_requested",
    "stopped",
]

CHECK_EVERY = 512  # items (encoded terms, eliminated nodes) between two looks at the clock

_STOP = threading.Event()
# Threads whose step `run_within` abandoned: every deadline has passed for them, for good (the
# stop request that abandoned them ends with its call, and they would run on to their own).
_ABANDONED: set[int] = set()
_ABANDONED_LOCK = threading.Lock()
_SHIELDED = threading.local()  # `depth`: the `shielded` steps this thread is in


def request_stop() -> None:
    """Expire every deadline now: running searches return their best answer so far."""
    _STOP.set()


def stop_requested() -> bool:
    """Whether a stop was asked (Ctrl-C, or `request_stop`) since the call began, unless this
    thread runs a step `shielded` from it, or this thread's step was abandoned
    (`run_within`)."""
    if _ABANDONED and threading.get_ident() in _ABANDONED:
        return True
    return _STOP.is_set() and not getattr(_SHIELDED, "depth", 0)


def clear_stop() -> None:
    """Forget a stop request (what the outermost `catch_interrupt` does when it ends)."""
    _STOP.clear()


def past(at: float) -> bool:
    """True when `at` (a `time.perf_counter()` value) has passed or a stop was asked."""
    return stop_requested() or time.perf_counter() > at


class OutOfTime(Exception):
    """A deadline passed inside a phase that has no answer to return yet."""


@dataclass(frozen=True)
class Deadline:
    """A point in time (`at`, a `time.perf_counter()` value; inf for none) and the limit in
    seconds it was made from, for messages. Immutable: a phase's own share is a new one."""

    at: float
    limit: float = math.inf
    began: float = math.nan  # when the limit began to count (`after`), for messages

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline `seconds` from now."""
        now = time.perf_counter()
        return cls(now + seconds, seconds, now)

    @classmethod
    def never(cls) -> Deadline:
        """No deadline (only a stop request ends it)."""
        return cls(math.inf)

    def left(self) -> float:
        """Seconds left (0 once expired or stopped)."""
        if stop_requested():
            return 0.0
        return max(0.0, self.at - time.perf_counter())

    def expired(self) -> bool:
        """Whether it has passed, or a stop was asked."""
        return past(self.at)

    def within(self, seconds: float) -> Deadline:
        """The earlier of this deadline and `seconds` from now (a phase's cap)."""
        return Deadline(
            min(self.at, time.perf_counter() + max(0.0, seconds)), self.limit, self.began
        )

    def share(self, fraction: float) -> Deadline:
        """`fraction` of what is left, from now."""
        return self.within(fraction * self.left()) if math.isfinite(self.at) else self

    def from_now(self) -> Deadline:
        """This deadline as a limit of its own that begins now: the same `at`, its `limit`
        what is left (at least 1 ms), `began` now. What `Backend.solve` hands a search, whose
        phases then take `part`s of that span."""
        now = time.perf_counter()
        return Deadline(self.at, max(self.left(), 1e-3), now)

    def part(self, fraction: float) -> Deadline:
        """`fraction` of the whole span (`limit`) from now, capped at this deadline: a
        phase's cap that does not shrink with the time its caller has already spent."""
        if not fraction > 0:
            return self.within(0.0)
        return self.within(fraction * self.limit)

    def at_least(self, seconds: float) -> Deadline:
        """This deadline, or `seconds` from now if that is later: what a phase that proves
        (an exact search) gets at the least, so that milliseconds of work started with no time
        left finish their proof instead of stopping at the first look (a stop request still
        ends it at once: `past` is true after one whatever the time)."""
        return Deadline(
            max(self.at, time.perf_counter() + max(0.0, seconds)), self.limit, self.began
        )

    def extended(self, fraction: float, least: float, most: float) -> Deadline:
        """This deadline moved `fraction` of its limit later (at least `least`, at most `most`
        seconds; `least` for a deadline without a limit), counted from now when it has
        passed already: the overrun a phase may take past the limit for an answer it has
        none without (the pipeline search's first costing)."""
        if not math.isfinite(self.at):
            return self
        span = fraction * self.limit if math.isfinite(self.limit) else least
        extra = min(max(span, least), most)
        return Deadline(max(self.at, time.perf_counter()) + extra, self.limit, self.began)

    def reserve(self, seconds: float) -> Deadline:
        """This deadline moved `seconds` earlier (time kept for a later phase)."""
        return Deadline(self.at - max(0.0, seconds), self.limit, self.began)

    def check(self) -> None:
        """Raise OutOfTime if expired (between the steps of a phase)."""
        if self.expired():
            raise OutOfTime


class Clock:
    """Counts items and raises OutOfTime past `at` (looks every CHECK_EVERY items)."""

    def __init__(self, at: float, every: int = CHECK_EVERY):
        self.at, self.every, self.count = at, every, 0

    def tick(self) -> None:
        """Count one item; raise OutOfTime when the deadline has passed at a look."""
        self.count += 1
        if self.count % self.every == 0 and past(self.at):
            raise OutOfTime

    def check(self) -> None:
        """Raise OutOfTime now if the deadline has passed (between phases)."""
        if past(self.at):
            raise OutOfTime


def run_within(fn: Callable[[], T], deadline: Deadline, poll: float = 0.05) -> T:
    """`fn()` for a step that has no clock of its own (an import of torch's machinery): run in
    a daemon thread while this one waits for it or for the deadline (or a stop request),
    whichever comes first. Past the deadline it raises OutOfTime and leaves `fn` in the
    background (a daemon thread: it does not hold the process open), where every deadline
    has passed from then on (`stop_requested` is true there), so a step that looks at its
    clock ends soon. Its exception is raised here."""
    if deadline.expired():
        raise OutOfTime
    done: list[T] = []
    failed: list[BaseException] = []
    finished: list[bool] = []

    def work() -> None:
        try:
            done.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failed.append(exc)
        finally:
            with _ABANDONED_LOCK:  # its ident may be another thread's later
                _ABANDONED.discard(threading.get_ident())
                finished.append(True)

    thread = threading.Thread(target=work, name="layerwise-run-within", daemon=True)
    thread.start()
    while thread.is_alive():
        if deadline.expired():
            with _ABANDONED_LOCK:  # its own deadlines pass too: a step that looks ends soon
                if not finished and thread.ident is not None:
                    _ABANDONED.add(thread.ident)
            raise OutOfTime
        thread.join(min(poll, max(deadline.left(), 0.001)))
    if failed:
        raise failed[0]
    return done[0]


class shielded:  # noqa: N801 - used as `with shielded():`
    """While a step runs in this thread: a stop request (a first Ctrl-C, `request_stop`) is
    not seen (`stop_requested` is false, `past(at)` only looks at the time), so the step
    ends at its own deadline only. For a step its caller has no answer without, when it
    answers after a stop (the pipeline search's first costing: the first Ctrl-C asks for
    the best answer so far, and a first answer takes that step); a second Ctrl-C still
    raises KeyboardInterrupt, and an abandoned thread (`run_within`) still stops."""

    def __enter__(self) -> shielded:
        _SHIELDED.depth = getattr(_SHIELDED, "depth", 0) + 1
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _SHIELDED.depth -= 1


class catch_interrupt:  # noqa: N801 - used as `with catch_interrupt():`
    """While a call runs in the main thread: the first Ctrl-C (SIGINT) expires every deadline
    (one warning line), a second raises KeyboardInterrupt. Nested uses and other threads do
    nothing, so the outermost call (`planner.plan`, a command line) owns the signal: a stop
    stays asked until it ends, and every later phase of that call sees it."""

    _depth = 0

    def __enter__(self) -> catch_interrupt:
        self.previous: Any = None
        if threading.current_thread() is not threading.main_thread():
            return self
        if catch_interrupt._depth == 0:
            _STOP.clear()
            self.previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, _handle)
        catch_interrupt._depth += 1
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        catch_interrupt._depth -= 1
        if catch_interrupt._depth == 0:
            signal.signal(signal.SIGINT, self.previous)
            _STOP.clear()


def _handle(signum: int, frame: Any) -> None:
    if _STOP.is_set():
        raise KeyboardInterrupt
    logging.getLogger("planner").warning(
        "interrupted: stopping with the best answer so far, if any (Ctrl-C again to abort)"
    )
    _STOP.set()


class BuildOutOfTime(LayerwiseError):
    """Capturing the model or building its cost tables did not finish in the time it had."""


def stopped(what: str, deadline: Deadline, started: float, advice: str) -> BaseException:
    """The error for `what` (a step begun at `started`) stopped by `deadline`: a Ctrl-C is
    KeyboardInterrupt("interrupted ..."), else a `BuildOutOfTime` that says after how long
    (an attempt of an "auto" option may have had only a share of the limit) and `advice`."""
    if stop_requested():
        return KeyboardInterrupt(f"interrupted while {what}")
    spent = time.perf_counter() - started
    return BuildOutOfTime(
        f"{what} did not finish within the time limit of {deadline.limit:g} s (stopped after "
        f"{spent:.3g} s, when the time it had ran out): {advice}"
    )
