"""Logging for the command lines: the standard `logging` module, one setup for every CLI.

Library code logs under its module's name (`planner.api`, `backends.<name>` for a backend's
best-so-far lines, `runtime.launch`, ...) and configures nothing. A command line calls
`setup_logging`: by default stderr shows warnings, and the line that says where a cached
measurement feeding a result comes from (`planner.hardware.load`), only (the command's own
output says the rest); `-v` shows everything from DEBUG up: the backends' INFO progress lines (one every few
seconds during a long search), the planner's phases, solver incumbents and bounds;
`--log-file F` writes everything from DEBUG up to F, with or without `-v`.

`phase(log, what)` wraps a step of a command that may take long (evaluate's simulation of a
big plan: minutes): its line shows with `-v` when it starts and, without `-v`, once it has
lasted SLOW_PHASE seconds (with how long it took when it ends), so a long command says what
it is doing and a short one stays quiet.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from planner.files import check_output_path

__all__ = ["PACKAGES", "SLOW_PHASE", "phase", "setup_logging"]

PACKAGES = ("planner", "backends", "runtime", "experiments")
_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (tests swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


NOTICES = ("planner.hardware.load",)  # INFO shown without -v: where a measurement comes from


def _default_filter(record: logging.LogRecord) -> bool:
    """Without -v: warnings from anyone, NOTICES' INFO lines, and the lines of slow phases."""
    return (
        record.levelno >= logging.WARNING
        or getattr(record, "slow", False)
        or (record.levelno >= logging.INFO and record.name.startswith(NOTICES))
    )


def _not_late(record: logging.LogRecord) -> bool:
    """With -v and in a log file: a slow phase's late line repeats its first: left out."""
    return not getattr(record, "late", False)


SLOW_PHASE = 2.0  # seconds after which a phase says what it does even without -v


@contextlib.contextmanager
def phase(log: logging.Logger, what: str) -> Iterator[None]:
    """Run the body as a phase called `what` (e.g. "simulating 1,024 devices"): logged at
    INFO when it starts (-v); without -v, logged once it has lasted SLOW_PHASE seconds, and
    then its duration when it ends."""
    t0 = time.perf_counter()
    log.info("%s", what)
    late = threading.Event()

    def still_running() -> None:
        late.set()
        _slow_line(log, f"{what} ...", late=True)

    timer = threading.Timer(SLOW_PHASE, still_running)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        done = f"{what}: done in {time.perf_counter() - t0:.3g} s"
        if late.is_set():
            _slow_line(log, done, late=False)
        else:
            log.info("%s", done)


def _slow_line(log: logging.Logger, message: str, late: bool) -> None:
    """An INFO line of a slow phase, past the logger's level (WARNING without -v): the
    handlers' filters decide (`_default_filter` shows it; `_not_late` drops a late one)."""
    record = log.makeRecord(log.name, logging.INFO, "", 0, message, (), None)
    record.__dict__.update(slow=True, late=late)
    log.handle(record)


def setup_logging(verbose: int = 0, log_file: str | Path | None = None) -> None:
    """Attach layerwise's handlers to the package loggers (again: replaces the old ones)."""
    if log_file is not None:
        log_file = check_output_path(log_file, "log file", append=True)
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for h in [h for h in logger.handlers if getattr(h, "layerwise", False)]:
            logger.removeHandler(h)
            h.close()
        # below WARNING only when someone reads it: a progress line is not even formatted
        logger.setLevel(logging.DEBUG if verbose or log_file else logging.WARNING)
    for name in NOTICES:  # their INFO lines pass even without -v
        logging.getLogger(name).setLevel(logging.NOTSET if verbose or log_file else logging.INFO)
    handlers: list[logging.Handler] = []
    err = _Stderr()
    err.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    err.setLevel(logging.DEBUG if verbose else logging.INFO)
    err.addFilter(_not_late if verbose else _default_filter)
    handlers.append(err)
    if log_file is not None:
        f = logging.FileHandler(log_file, encoding="utf-8")
        f.setFormatter(logging.Formatter(_FORMAT))
        f.setLevel(logging.DEBUG)
        f.addFilter(_not_late)
        handlers.append(f)
    for h in handlers:
        h.layerwise = True  # type: ignore[attr-defined]
        for name in PACKAGES:
            logging.getLogger(name).addHandler(h)
