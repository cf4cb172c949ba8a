"""A wall-clock budget for tests that start worker processes: a test that hangs fails."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def time_budget(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in the test if it runs longer than `seconds` (SIGALRM)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"test exceeded its {seconds} s budget")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
