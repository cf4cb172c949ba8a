"""Worker processes for the tests that export to DTensor on gloo: start `world` of them from
the runtime's warm forkserver, wait, kill any still running, and return their exit codes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.launch import worker_context


def run_workers(target: Callable[..., None], world: int, *args: Any, timeout: float) -> list[Any]:
    """Run `target(rank, *args)` in `world` processes; their exit codes (None: killed after
    `timeout` seconds each)."""
    ctx = worker_context()
    procs = [ctx.Process(target=target, args=(r, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    return codes
