"""The anytime trace of a search: when each better answer and each better lower bound came.

Every `Backend.solve` returns one in `stats["trace"]`:

    {"incumbent": [[t, value], ...], "bound": [[t, value], ...]}

`t`: seconds since `solve` started (rounded to 0.1 ms), non-decreasing; `value`: the
objective's units (the additive objective: OptCNN's Eq. 1 cost); incumbents strictly
decreasing, bounds strictly increasing, only finite values. The last incumbent is the
answer's re-scored objective and the last bound the result's bound (added at the time
`solve` returned when the search had not reported them sooner); an incumbent value within
rounding (CLIP_RTOL) below the re-scored objective is raised to it, and one further below
(a search's own measure, as mcmc's simulated makespan) left out, with one warning. Each
list keeps at most `TRACE_POINTS` points (`thin`: the first, the last, and log-spaced in time).

Where the points come from (`TraceRecorder`, which `Backend.solve` puts in the search's
`SolveOptions.channel`):
- `on_bound(bound, who)`: every better bound the search proves while it runs (`ilp`'s CBC,
  `cpsat`, `toulbar2`'s Lagrangian bound), recorded as it comes;
- `on_incumbent(choices, who)`: every better answer (`ilp`, `cpsat` and its neighbourhood
  search, `toulbar2`), its value computed here by `additive_cost` on the problem's tables.
  On 35,000-node tables that takes about 20 ms, so a value is computed at most once per
  window of (time it took) / EVALUATION_SHARE (one second there; microseconds on small
  problems): an answer that arrives within the window waits, and a better one arriving
  before the window ends replaces it (its value is lost, its successor is recorded at the
  successor's time; `stats["trace_seconds"]` is the time spent so). Under the makespan
  objective (a full simulation per value) answers sent so are not recorded: only the
  search's own trace and the final answer are;
- `offer_answer(on_incumbent, value, who, choices)`: a better answer whose value the search
  already has (`cpsat`'s solutions, its neighbourhood search's moves): recorded at once,
  without valuing it, and its choices extracted (`choices()`) only when the caller listens
  too; so a standalone solve does no more work per answer than without the trace;
- the search's own trace: a backend with `own_trace` (`local`, `mcmc`, the `portfolio`)
  knows the value of each better answer and returns the same format in `stats["trace"]`
  itself (times since its `_solve` began, within a millisecond of `solve`'s start); the
  answers it sends to `on_incumbent` are then only forwarded.
Searches that report nothing as they go (`search`, `elimination`, `baselines`) have one
point per list: their answer and bound at the end.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.problems.evaluate import additive_cost
from planner.result import Channel, SolveResult

if TYPE_CHECKING:
    from planner.problems.problem import Problem

__all__ = [
    "EVALUATION_SHARE",
    "TRACE_POINTS",
    "AnswerListener",
    "Improvements",
    "TraceRecorder",
    "merge_points",
    "offer_answer",
    "own_trace",
    "thin",
]

TRACE_POINTS = 1000  # points per list at most (`thin`)
EVALUATION_SHARE = 0.02  # of the search's time at most for computing answers' values
TIME_DIGITS = 4  # seconds are rounded to 0.1 ms
THIN_FLOOR = 1e-3  # seconds: times below it share the first log-spaced bin
CLIP_RTOL = 1e-6  # a search's own value this far below the re-scored one is its arithmetic

log = logging.getLogger(__name__)

Point = tuple[float, float]
Answers = Callable[[tuple[int, ...], str], None]


def merge_points(points: Iterable[Sequence[float]], lower: bool = True) -> list[Point]:
    """The improvements among `points` (t, value) in time order: a point is kept when its
    value is better (lower; higher with `lower=False`, for bounds) than every earlier kept
    one (at the same time, the better value first)."""
    sign = 1.0 if lower else -1.0
    out: list[Point] = []
    finite = [(float(t), float(v)) for t, v in points if math.isfinite(v) and math.isfinite(t)]
    for t, v in sorted(finite, key=lambda p: (p[0], sign * p[1])):
        if not out or sign * v < sign * out[-1][1]:
            out.append((t, v))
    return out


def thin(points: Sequence[Point], cap: int = TRACE_POINTS) -> list[Point]:
    """At most `cap` of a step function's points: the first, the last, and of the others the
    last in each of cap - 2 bins equally spaced in log time (times below THIN_FLOOR in the
    first bin). The last point of a bin holds the step's value at the bin's end, so a value
    is reached at most one bin width (a share log(t_last / t_first) / cap of the time) later
    than the full trace says."""
    if len(points) <= cap:
        return list(points)
    if cap < 3:
        return [points[0], points[-1]][:cap]
    inner = points[1:-1]
    key = np.log(np.maximum([t for t, _ in inner], THIN_FLOOR))
    span = max(float(key[-1] - key[0]), 1e-12)
    bins = np.minimum(((key - key[0]) / span * (cap - 2)).astype(int), cap - 3)
    last = np.flatnonzero(np.append(bins[1:] != bins[:-1], True))  # the last of each bin
    return [points[0], *(inner[int(i)] for i in last), points[-1]]


class Improvements:
    """A search's own trace as it goes: `add(value)` records (seconds since `start`, value)
    when the value is lower than the last."""

    def __init__(self, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.points: list[Point] = []

    def add(self, value: float, at: float | None = None) -> None:
        if not math.isfinite(value) or (self.points and not value < self.points[-1][1]):
            return
        now = time.perf_counter() if at is None else at
        self.points.append((round(now - self.start, TIME_DIGITS), float(value)))


class TraceRecorder:
    """`Backend.solve`'s listener on the search's channel (module docstring): it records
    better answers and bounds, forwards every call to the caller's own callbacks, and
    `finish` puts the trace in the result's stats."""

    def __init__(self, problem: Problem, objective: str, evaluate: bool, start: float):
        self.problem, self.start = problem, start
        self.evaluate = evaluate and objective == "additive"
        self.incumbents: list[Point] = []
        self.bounds: list[Point] = []
        self.pending: tuple[float, tuple[int, ...]] | None = None  # waiting for its window
        self.next_value = -math.inf  # perf_counter time from which a value may be computed
        self.lock = threading.Lock()  # CP-SAT's and CBC's callbacks come from their threads
        self.seconds = 0.0  # spent computing answers' values (stats["trace_seconds"])

    def channel(self, channel: Channel) -> Channel:
        """`channel` with this recorder listening to `on_bound` and, when it computes
        values, `on_incumbent` (an `AnswerListener`; each call forwarded to the caller's
        own)."""
        out = replace(channel, on_bound=self._forward_bound(channel.on_bound))
        if self.evaluate:
            out = replace(out, on_incumbent=AnswerListener(self, channel.on_incumbent))
        return out

    def _forward_bound(
        self, given: Callable[[float, str], None] | None
    ) -> Callable[[float, str], None]:
        def on_bound(bound: float, who: str) -> None:
            now = time.perf_counter()
            if given is not None:
                given(bound, who)
            with self.lock:
                if math.isfinite(bound) and (not self.bounds or bound > self.bounds[-1][1]):
                    self.bounds.append((self._t(now), float(bound)))

        return on_bound

    def _t(self, now: float) -> float:
        return round(now - self.start, TIME_DIGITS)

    def _answer(self, now: float, choices: tuple[int, ...]) -> None:
        with self.lock:
            waiting = self.pending
            self.pending = (now, choices)
            if now < self.next_value:
                return  # within the window: it waits (and a better one may replace it)
            self.pending = None
            t0 = time.perf_counter()
            if waiting is not None:  # its window has passed: it is recorded too
                self._record(*waiting)
            self._record(now, choices)
            took = time.perf_counter() - t0
            self.seconds += took
            self.next_value = time.perf_counter() + took / EVALUATION_SHARE

    def _record(self, at: float, choices: tuple[int, ...], value: float | None = None) -> None:
        if value is None:
            value = additive_cost(self.problem, choices)
        if math.isfinite(value) and (not self.incumbents or value < self.incumbents[-1][1]):
            self.incumbents.append((self._t(at), value))

    def _valued(self, now: float, value: float) -> None:
        with self.lock:
            if math.isfinite(value) and (not self.incumbents or value < self.incumbents[-1][1]):
                self.incumbents.append((self._t(now), float(value)))

    def finish(self, result: SolveResult) -> SolveResult:
        """`result` with `stats["trace"]`: what was recorded, the search's own trace (its
        `stats["trace"]`, if any) and the final answer and bound, merged and thinned."""
        now = time.perf_counter()
        with self.lock:
            if self.pending is not None:
                at, choices = self.pending
                known = result.objective if choices == result.choices else None
                t0 = time.perf_counter()
                self._record(at, choices, known)
                self.seconds += time.perf_counter() - t0
                self.pending = None
            incumbents, bounds = list(self.incumbents), list(self.bounds)
        own = result.stats.get("trace")
        if isinstance(own, Mapping):
            incumbents += [tuple(p) for p in own.get("incumbent", ())]
            bounds += [tuple(p) for p in own.get("bound", ())]
        end = self._t(now)
        objective = result.objective
        if objective is not None and math.isfinite(objective):
            # the answer's re-scored value: a search's own arithmetic never beats it. Within
            # rounding (CLIP_RTOL) a value is the answer's; further below, the search's own
            # values measure something else (mcmc's simulated makespan under the full
            # re-score): those points are dropped, not raised, which would flatten the trace
            floor = objective * (1 - CLIP_RTOL) - CLIP_RTOL
            below = [v for _, v in incumbents if v < floor]
            if below:
                log.warning(
                    "%s: its trace reached %.9g, below its answer's re-scored %.9g: the %d "
                    "point(s) below it are left out",
                    result.backend,
                    min(below),
                    objective,
                    len(below),
                )
            incumbents = [(t, max(v, objective)) for t, v in incumbents if v >= floor]
            incumbents.append((end, objective))
        if result.bound is not None and math.isfinite(result.bound):
            bounds.append((end, float(result.bound)))
        trace = {
            "incumbent": _lists(thin(merge_points(incumbents))),
            "bound": _lists(thin(merge_points(bounds, lower=False))),
        }
        stats = {**result.stats, "trace": trace}
        if self.evaluate:
            stats["trace_seconds"] = round(self.seconds, 6)
        return replace(result, stats=stats)


class AnswerListener:
    """The recorder's `on_incumbent`: called as any, `(choices, who)`, it values the answer
    within the recorder's rate window; a search that knows the value calls `offer` instead
    (`offer_answer`), and the choices are only extracted when the caller listens too."""

    def __init__(self, recorder: TraceRecorder, given: Answers | None):
        self.recorder, self.given = recorder, given

    @property
    def forwards(self) -> bool:
        """Whether the caller listens too (then every answer's choices are wanted)."""
        return self.given is not None

    def __call__(self, choices: tuple[int, ...], who: str) -> None:
        now = time.perf_counter()
        if self.given is not None:
            self.given(choices, who)
        self.recorder._answer(now, tuple(choices))

    def offer(self, value: float, who: str, choices: Callable[[], tuple[int, ...]]) -> None:
        """A better answer of known `value` (the objective's units); `choices()` is called
        only when the caller listens."""
        now = time.perf_counter()
        if self.given is not None:
            self.given(choices(), who)
        self.recorder._valued(now, value)


def offer_answer(
    send: Answers | None, value: float, who: str, choices: Callable[[], tuple[int, ...]]
) -> None:
    """Send a better answer of known `value` to `send` (a channel's `on_incumbent`): to an
    `AnswerListener` (or any object with `offer`) with its value, extracting the choices only
    when someone needs them; to a plain callback as `send(choices(), who)`."""
    if send is None:
        return
    offer = getattr(send, "offer", None)
    if offer is not None:
        offer(value, who, choices)
    else:
        send(choices(), who)


def _lists(points: Sequence[Point]) -> list[list[float]]:
    return [[t, v] for t, v in points]


def own_trace(improvements: Improvements) -> dict[str, Any]:
    """A search's own `stats["trace"]` from its improvements (module docstring): searches
    with their own trace prove no bound."""
    return {"incumbent": _lists(improvements.points), "bound": []}
