"""A Ctrl-C while a command starts: its imports (numpy, the planner; 0.1-0.5 s) come before any
handler of its own, and a KeyboardInterrupt there is a traceback of importlib frames. Between
`guard_start()` and `end_guard(previous)` a Ctrl-C ends the process with the one line every
interrupted command prints, `error: interrupted`, and status 130. This module imports nothing
heavy (`import planner` is lazy), so a command's first line can use it."""

from __future__ import annotations

import os
import signal
from typing import Any

__all__ = ["end_guard", "guard_start"]


def _interrupted_while_starting(signum: int, frame: object) -> None:
    os.write(2, b"error: interrupted\n")
    os._exit(130)


def guard_start() -> Any:
    """Until `end_guard`, a Ctrl-C ends the process in one line; the handler it replaced."""
    return signal.signal(signal.SIGINT, _interrupted_while_starting)


def end_guard(previous: Any) -> None:
    """The handler before `guard_start` again (the command handles Ctrl-C from here on)."""
    signal.signal(signal.SIGINT, previous)
