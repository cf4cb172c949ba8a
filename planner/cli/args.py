"""What every command line of the project shares: the parser that fails in one line, the
argument types, the logging options, and how a command ends (one `error: ...` line and an
exit status; `exit_now`).

`python -m planner` (planner.cli), `python -m runtime.run` and the experiments' scripts build
their parsers from these, so a bad value reads the same wherever it is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from planner.errors import LayerwiseError

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERRUPTED",
    "EXIT_NO_SOLUTION",
    "MAX_LOAD_HELP",
    "VERBOSE_HELP",
    "OneLineArgumentParser",
    "UsageError",
    "add_logging_options",
    "exit_now",
    "load_limit",
    "nonnegative_int",
    "nonnegative_seconds",
    "one_line",
    "positive_int",
    "positive_number",
    "positive_seconds",
    "report_errors",
    "size_bytes",
    "zoo_model",
]

EXIT_NO_SOLUTION = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class UsageError(LayerwiseError):
    """The command line itself is wrong (unknown option, missing argument, bad value)."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reports usage errors as one `UsageError` (no usage block), and
    reads a value that starts with a minus and a digit as a value (`--memory-limit -1G`,
    `--time-limit -1e3`), which the option's type then refuses in one line, not as an
    unknown option ("expected one argument")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse's own pattern is only -5 and -.5 (-1G and -1e9 were options); Python 3.13's
        # is this one. No option of ours starts with a minus and a digit.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        """Raise the usage error as one UsageError line (argparse would print and exit)."""
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


# -- argument types -------------------------------------------------------------------------


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def _finite_float(text: str, what: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise argparse.ArgumentTypeError(f"expected a finite {what} {bound}, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A finite number of seconds > 0 (a time limit)."""
    return _finite_float(text, "number of seconds", positive=True)


def nonnegative_seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    return _finite_float(text, "number of seconds", positive=False)


def positive_number(text: str) -> float:
    """A finite number > 0."""
    return _finite_float(text, "number", positive=True)


def load_limit(text: str) -> float:
    """--max-load: a load average per core >= 0; inf measures whatever the load."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(
            f"expected a load average per core >= 0 (or inf), got {text!r}"
        )
    return value


MAX_LOAD_HELP = (
    "busy threshold: the 1-minute load average per core above which measuring is refused "
    "(default $LAYERWISE_MAX_LOAD, else 0.3; inf measures whatever the load, and the load is "
    "recorded)"
)


def size_bytes(text: str) -> float:
    """A size option's value in bytes: 16GiB, 512MiB, 16GB, 1e9 (`parse_bytes`, the one size
    parser of every command line)."""
    from planner.problems.sizes import parse_bytes

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a size cannot be negative, got {text!r}")
    try:
        return float(parse_bytes(text))
    except LayerwiseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def zoo_model(text: str) -> str:
    """A zoo model name (the experiments' --models)."""
    from planner.graph.zoo import MODELS

    if text not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {text!r}; one of {', '.join(MODELS)}")
    return text


# -- shared options -------------------------------------------------------------------------

VERBOSE_HELP = "log progress and DEBUG lines on stderr (default: warnings only)"


def add_logging_options(
    p: argparse.ArgumentParser, verbose_help: str = VERBOSE_HELP, log_file_help: str = ""
) -> None:
    """-v/--verbose (a count) and --log-file, read by `planner.logs.setup_logging`."""
    p.add_argument("-v", "--verbose", action="count", default=0, help=verbose_help)
    p.add_argument(
        "--log-file", type=Path, help=log_file_help or "also write every log line (DEBUG up) here"
    )


# -- how a command ends ---------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    """The first non-empty line of an error message (some wrap a multi-line torch error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def report_errors(
    run: Callable[[], int], status: Callable[[LayerwiseError], int] | None = None
) -> int:
    """Run a command; bad input becomes one `error: ...` line on stderr and exit status 2
    (a LayerwiseError's status is `status(error)` when given), a Ctrl-C exit status 130."""
    try:
        return run()
    except LayerwiseError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT if status is None else status(exc)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UnicodeDecodeError as exc:  # a binary file given where JSON was expected
        print(f"error: an input file is not UTF-8 text (JSON expected): {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as exc:  # what was interrupted, when the raiser says
        print(f"error: {one_line(exc) if str(exc) else 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED


def exit_now(code: int) -> NoReturn:
    """End the process with `code` once everything is written (standard streams flushed, log
    files closed), skipping the interpreter's teardown: with torch loaded it takes 0.5-1 s,
    time a command line's `--time-limit` would otherwise overrun by. Files are written
    atomically before this, and the portfolio's members have been joined."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
