"""What the commands print: a plan's ops (by config past PLAN_ROWS), its status line, a
cost-table bound as people read it, and the seconds since the process started."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from planner.result import format_cost

# when this process started, where /proc does not say (planner/__main__ sets an earlier one)
PROCESS_STARTED = time.time()


def process_seconds() -> float:
    """Seconds since this process started: the interpreter's start-up and every import (torch's
    among them) included, which a command's "total" counts. From /proc on Linux; elsewhere
    since PROCESS_STARTED."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started = int(stat[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: the start time
        return max(0.0, uptime - started)
    except (OSError, ValueError, IndexError):
        return max(0.0, time.time() - PROCESS_STARTED)


PLAN_ROWS = 40  # op lines `plan` prints without -v; a larger plan is shown by config
PLAN_GROUPS = 12  # configs shown then, the most used first


def print_ops(rows: list[tuple[str, str, str]], verbose: bool) -> None:
    """One line per op, or past PLAN_ROWS ops (without -v) one line per config: a summary
    that fits a screen, whatever the number of ops and devices."""
    if verbose or len(rows) <= PLAN_ROWS:
        for name, kind, cfg in rows:
            print(f"  {name:40s} {kind:12s} {cfg}")
        return
    ops: dict[str, list[str]] = {}
    for name, _, cfg in rows:
        ops.setdefault(cfg, []).append(name)
    ranked = sorted(ops, key=lambda cfg: -len(ops[cfg]))  # stable: first used first on ties
    for cfg in ranked[:PLAN_GROUPS]:
        names = ops[cfg]
        more = ", ..." if len(names) > 3 else ""
        print(f"  {quantity(len(names), 'op', 6)}  {cfg:32s} {', '.join(names[:3])}{more}")
    rest = ranked[PLAN_GROUPS:]
    if rest:
        count = sum(len(ops[cfg]) for cfg in rest)
        print(f"  {quantity(count, 'op', 6)}  in {quantity(len(rest), 'other config')}")
    print(
        f"  ({quantity(len(rows), 'op')} in {quantity(len(ops), 'config')}: -v lists every op; the "
        "plan file, -o, has every config)"
    )


def quantity(n: int, noun: str, width: int = 0, plural: str = "") -> str:
    """'1 op', '1,024 ops' (the number right-aligned in `width`; `plural` when not noun + s)."""
    return f"{n:{width},} {noun if n == 1 else plural or noun + 's'}"


def print_summary(s: dict[str, Any], seconds: bool, problem: Any = None) -> None:
    """The status line: a DNN's objective in ms, a cost-table problem's as a plain number
    (its costs have no unit); the phases' seconds, "total" from the process's start (the
    interpreter and torch's import included: what the user waited)."""

    def value(v: float | None) -> str:
        if not seconds:
            return format_cost(v)
        return "-" if v is None else f"{v * 1e3:.4g} ms"

    bound = value(s["bound"]) if seconds else format_bound(s["bound"], s["objective"], problem)
    gap = s["gap"]
    if bound == value(s["objective"]) and gap is not None and abs(gap) < 1e-9:
        gap = 0.0  # an exact proof whose bound came back a rounding error below its objective
    gap_text = "-" if gap is None else f"{gap * 100:.3g}%"
    limit = f" ({s['limit']})" if s["limit"] else ""
    phases = [  # a phase that did not run (a cost table's capture) left out
        f"{k.removesuffix('_seconds')} {s[k]:.3g} s"
        for k in ("capture_seconds", "build_seconds", "search_seconds")
        if s.get(k)
    ]
    phases.append(f"total {process_seconds():.3g} s")
    print(
        f"{s['status']}{limit}: {s['objective_kind']} {value(s['objective'])}, bound "
        f"{bound}, gap {gap_text} ({s['backend']}; {', '.join(phases)})"
    )


BOUND_DIGITS = 10  # significant digits of a bound that is not an integer (at least)
EXACT_RTOL = 1e-9  # a bound this close to an integer objective, with integer costs, is it


def format_bound(bound: float | None, objective: float | None, problem: Any = None) -> str:
    """A cost-table bound as people read it. A bound within EXACT_RTOL of an integer
    objective on a problem of integer costs is that objective (the objective is an integer,
    so the proof is exact: the difference is the solver's floating point); an integer bound
    every digit; any other to BOUND_DIGITS significant digits, or more when its integer part
    has more, plus one decimal ('217,038.5', not '217,038.999999783')."""
    if bound is None or not math.isfinite(bound):
        return format_cost(bound)
    if (
        objective is not None
        and math.isfinite(objective)
        and float(objective).is_integer()
        and abs(objective - bound) <= EXACT_RTOL * max(1.0, abs(objective))
        and (problem is None or problem.integer_costs)
    ):
        return format_cost(objective)
    if float(bound).is_integer():
        return format_cost(bound)
    whole = len(str(int(abs(bound)))) if abs(bound) >= 1 else 0
    return f"{bound:,.{max(BOUND_DIGITS, whole + 1)}g}"
