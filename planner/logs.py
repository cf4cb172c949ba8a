"""Logging for the command lines: the standard `logging` module, one setup for every CLI.

Library code logs under its module's name (`planner.api`, `backends.<name>` for a backend's
best-so-far lines, `runtime.launch`, ...) and configures nothing. A command line calls
`setup_logging`: by default stderr shows warnings, and the line that says where a cached
measurement feeding a result comes from (`planner.hardware.load`), only (the command's own
output says the rest); `-v` shows everything from DEBUG up: the backends' INFO progress lines (one every few
seconds during a long search), the planner's phases, solver incumbents and bounds;
`--log-file F` writes everything from DEBUG up to F, with or without `-v`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from planner.files import check_output_path

__all__ = ["PACKAGES", "setup_logging"]

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
    """Without -v: warnings from anyone, and NOTICES' INFO lines."""
    return record.levelno >= logging.WARNING or (
        record.levelno >= logging.INFO and record.name.startswith(NOTICES)
    )


def setup_logging(verbose: int = 0, log_file: str | Path | None = None) -> None:
    """Attach layerwise's handlers to the package loggers (again: replaces the old ones)."""
    if log_file is not None:
        log_file = check_output_path(log_file, "log file")
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
    if not verbose:
        err.addFilter(_default_filter)
    handlers.append(err)
    if log_file is not None:
        f = logging.FileHandler(log_file, encoding="utf-8")
        f.setFormatter(logging.Formatter(_FORMAT))
        f.setLevel(logging.DEBUG)
        handlers.append(f)
    for h in handlers:
        h.layerwise = True  # type: ignore[attr-defined]
        for name in PACKAGES:
            logging.getLogger(name).addHandler(h)
