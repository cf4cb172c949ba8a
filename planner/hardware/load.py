"""How busy this machine is around a measurement, and what a cached measurement says.

A measurement (`presets.measure_cpu_local`, `costs.profile.profile_graph`) times work on this
machine, so other processes computing meanwhile inflate it. "Busy" is one threshold: the
1-minute load average (`os.getloadavg`) per core above `max_load()`: DEFAULT_MAX_LOAD, or
$LAYERWISE_MAX_LOAD, or a caller's limit (the CLI's `--max-load`; `inf` measures whatever
the load). `LoadWatch` refuses to start on a busy machine and, during and after the
measurement, refuses one that became busy (less what the measurement's own processes added
to the average); the caller then caches nothing. Every measurement records its `Load` and
time. `note_cached` says, in one log line, where a cached measurement that feeds a result
comes from, how old it is and at what load it was taken; a warning when it was taken on a
busy machine or has no recorded load (older caches), with the command to measure again.

The load average is slow (an exponential average over a minute, sampled every 5 s): it still
counts work that ended a minute ago, and a burst of a few seconds barely moves it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from planner.errors import LayerwiseError

__all__ = [
    "DEFAULT_MAX_LOAD",
    "MAX_LOAD_ENV",
    "Load",
    "LoadWatch",
    "MachineBusyError",
    "load_average",
    "max_load",
    "note_cached",
    "trusted",
    "wait_until_quiet",
]

MAX_LOAD_ENV = "LAYERWISE_MAX_LOAD"
# 1-minute load average per core above which the machine is busy. On 2 cores one other
# busy process (load 1.0, 0.5 per core) is over it; a quiet machine's background is not.
DEFAULT_MAX_LOAD = 0.3
WINDOW = 60.0  # seconds: the time constant of the 1-minute load average

logger = logging.getLogger(__name__)


class MachineBusyError(LayerwiseError):
    """Other processes compute on this machine: a measurement now would time their work too."""


def max_load(limit: float | None = None) -> float:
    """The busy threshold (load average per core): `limit`, else $LAYERWISE_MAX_LOAD, else
    DEFAULT_MAX_LOAD."""
    if limit is not None:
        if not limit >= 0:  # NaN too
            raise LayerwiseError(
                f"the load limit must be a load average per core >= 0 (inf: measure whatever "
                f"the load), got {limit}"
            )
        return limit
    text = os.environ.get(MAX_LOAD_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_LOAD
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise LayerwiseError(
            f"{MAX_LOAD_ENV} must be a load average per core >= 0 (e.g. {DEFAULT_MAX_LOAD}, or "
            f"inf to measure whatever the load), got {text!r}"
        )
    return value


def cores() -> int:
    """The machine's cores: the load average counts the whole machine's processes."""
    return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class Load:
    """The 1-minute load average around one measurement: when it started (`before`) and when
    it ended less what the measurement's own processes added (`after`); None where unknown."""

    before: float | None
    after: float | None
    cores: int

    @property
    def per_core(self) -> float | None:
        """The higher of before and after, per core; None when neither is known."""
        known = [x for x in (self.before, self.after) if x is not None]
        return max(known) / self.cores if known else None

    def to_json(self) -> dict[str, Any]:
        """The form caches record (`per_core` rounded, for reading; `from_json` ignores it)."""
        per_core = self.per_core
        return {
            "before": self.before,
            "after": self.after,
            "cores": self.cores,
            "per_core": None if per_core is None else round(per_core, 3),
        }

    @classmethod
    def from_json(cls, data: Any) -> Load | None:
        """The load a cache recorded; None when it recorded none (or not in this form)."""
        if not isinstance(data, dict):
            return None
        try:
            before, after = (
                None if v is None else float(v) for v in (data["before"], data["after"])
            )
            count = int(data["cores"])
        except (KeyError, TypeError, ValueError):
            return None
        return cls(before, after, count) if count >= 1 else None


def _busy_text(load: float, count: int, limit: float) -> str:
    return f"{load:.2f} on {count} cores ({load / count:.2f} per core, busy above {limit:g})"


RAISE_LIMIT = f"raise the limit (--max-load, or {MAX_LOAD_ENV}) to measure anyway"


class LoadWatch:
    """Guards one measurement by `workers` busy processes: construction raises
    MachineBusyError on a busy machine; `check()` (during and after) raises it when the
    machine became busy meanwhile, and returns the `Load` so far."""

    def __init__(self, what: str, workers: int, limit: float | None = None) -> None:
        self.what = what
        self.workers = workers
        self.limit = max_load(limit)
        self.cores = cores()
        self.before = load_average()
        self.started = time.monotonic()
        if self.before is None:
            logger.warning("this platform has no load average: %s cannot check it is quiet", what)
        elif self.before / self.cores > self.limit:
            raise MachineBusyError(
                f"the machine is busy: load average "
                f"{_busy_text(self.before, self.cores, self.limit)}, so {what} now would time "
                f"other processes' work too; measure when it is quiet (the 1-minute average "
                f"takes a minute to settle), or {RAISE_LIMIT}"
            )

    def own(self) -> float:
        """What this measurement's processes have added to the 1-minute average by now."""
        return self.workers * -math.expm1(-(time.monotonic() - self.started) / WINDOW)

    def load(self) -> Load:
        """The load so far (see `Load`), without judging it."""
        now = load_average()
        after = None if now is None else round(max(0.0, now - self.own()), 2)
        return Load(None if self.before is None else round(self.before, 2), after, self.cores)

    def check(self) -> Load:
        """`load()`; MachineBusyError when the others' part of it is over the limit."""
        load = self.load()
        if load.after is not None and load.after / self.cores > self.limit:
            raise MachineBusyError(
                f"the machine became busy while {self.what}: the other processes' load "
                f"average {_busy_text(load.after, self.cores, self.limit)}; nothing was "
                f"cached: measure again when it is quiet, or {RAISE_LIMIT}"
            )
        return load


def wait_until_quiet(seconds: float, limit: float | None = None, poll: float = 5.0) -> bool:
    """Wait up to `seconds` for the load average per core to fall to the limit; True if it
    did (or the platform has no load average)."""
    bound = max_load(limit)
    deadline = time.monotonic() + seconds
    while True:
        load = load_average()
        if load is None or load / cores() <= bound:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))


# -- cached measurements ------------------------------------------------------------------------


def trusted(load: Load | None) -> bool:
    """A measurement at a known load within the busy threshold (`max_load()`)."""
    per_core = None if load is None else load.per_core
    return per_core is not None and per_core <= max_load()


def note_cached(
    what: str,
    path: Path,
    taken: Sequence[tuple[str | None, Load | None]],
    remeasure: str,
    unit: str = "",
    now: datetime | None = None,
) -> str:
    """Log (and return) one line on cached measurements that feed a result: `what` from
    `path`, `taken` = (ISO time, load) of each measurement (of `unit`, e.g. "task shapes").
    INFO when all were taken at a known load within the limit; else WARNING, saying how many
    were not and to measure again with `remeasure`."""
    limit = max_load()
    count = f"{len(taken)} {unit}, " if unit else ""
    line = f"{what} from {path}: {count}{_when([t for t, _ in taken], now)}"
    loads = [load.per_core for _, load in taken if load is not None]
    known = [x for x in loads if x is not None]
    if known:
        low, high = min(known), max(known)
        span = f"{low:.2f}" if high - low < 0.005 else f"{low:.2f}-{high:.2f}"
        line += f" at load {span} per core (busy above {limit:g})"
    unknown = sum(1 for _, load in taken if load is None or load.per_core is None)
    busy = len(taken) - unknown - sum(1 for _, load in taken if trusted(load))
    if not unknown and not busy:
        logger.info("%s", line)
        return line
    of = f" of {len(taken)}" if len(taken) > 1 else ""
    parts = []
    if unknown:
        parts.append(f"{unknown}{of} without a recorded load (an older cache)")
    if busy:
        parts.append(f"{busy}{of} measured on a busy machine")
    line += (
        f"; untrusted: {' and '.join(parts)}, so they may count other processes' work: "
        f"measure again on a quiet machine with `{remeasure}`"
    )
    logger.warning("%s", line)
    return line


def _when(times: Sequence[str | None], now: datetime | None) -> str:
    stamps = sorted(t for t in (_parse(x) for x in times) if t is not None)
    if not stamps:
        return "measured at an unknown time"
    now = now or datetime.now(UTC)
    first, last = stamps[0], stamps[-1]
    if first == last:
        return f"measured {first:%Y-%m-%d %H:%M} UTC ({_age(now - first)} ago)"
    return (
        f"measured {first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} UTC "
        f"({_age(now - last)} to {_age(now - first)} ago)"
    )


def _parse(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        stamp = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def _age(delta: timedelta) -> str:
    seconds = max(delta.total_seconds(), 0.0)
    for size, unit in ((86400, "days"), (3600, "h"), (60, "min")):
        if seconds >= size:
            value = seconds / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{seconds:.0f} s"
