"""Timelines people can look at: a Chrome trace (Perfetto, chrome://tracing) and a Gantt chart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.sim.simulator import Timeline

COLORS = {
    "fwd": "tab:blue",
    "bwd": "tab:orange",
    "xfer": "tab:green",
    "sync": "tab:red",
    "update": "tab:purple",
    "msg": "tab:olive",
    "bn": "tab:brown",
}


def _kind(name: str) -> str:
    """fwd, bwd, xfer (activations and gradients), sync (parameter sync traffic), update,
    msg (a message's processor time on a device), bn (batch-norm statistics exchange)."""
    kind = name.split(" ", 1)[0]
    if kind == "xfer" and any(w in name for w in (" allreduce ", " push ", " pull ")):
        return "sync"
    if kind in ("send", "recv"):
        return "msg"
    return "sync" if kind == "ps" else kind


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Trace events: one row (thread) per device or link direction, times in microseconds."""
    used = sorted({t.resource for t in timeline.tasks})
    events: list[dict[str, Any]] = [
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 0,
            "tid": r,
            "args": {"name": timeline.resource_names[r]},
        }
        for r in used
    ]
    events += [
        {
            "name": t.name,
            "cat": _kind(t.name),
            "ph": "X",
            "pid": 0,
            "tid": t.resource,
            "ts": t.start * 1e6,
            "dur": (t.end - t.start) * 1e6,
        }
        for t in timeline.tasks
        if t.end > t.start
    ]
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"makespan_seconds": timeline.makespan},
    }


def save_chrome_trace(timeline: Timeline, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(timeline)))


GANTT_ROWS = 96  # a chart of more rows is unreadable: the busiest ones are drawn


def gantt_rows(
    timeline: Timeline, limit: int = GANTT_ROWS
) -> tuple[list[int], dict[int, dict[str, list[tuple[float, float]]]], int]:
    """The (at most `limit`) busiest resources in resource order, every resource's bars by
    kind in ms (start, duration), and how many resources are busy at all: one pass over the
    tasks."""
    bars: dict[int, dict[str, list[tuple[float, float]]]] = {}
    busy: dict[int, float] = {}
    for t in timeline.tasks:
        if t.end > t.start:
            row = bars.setdefault(t.resource, {})
            row.setdefault(_kind(t.name), []).append((t.start * 1e3, (t.end - t.start) * 1e3))
            busy[t.resource] = busy.get(t.resource, 0.0) + t.end - t.start
    rows = sorted(sorted(busy, key=lambda r: (-busy[r], r))[:limit])
    return rows, bars, len(busy)


def save_gantt(timeline: Timeline, path: str | Path, title: str = "") -> None:
    """A Gantt chart of the busy devices and links (matplotlib, PNG or any format it writes);
    on large clusters, of the GANTT_ROWS busiest ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, bars, used = gantt_rows(timeline)
    fig, ax = plt.subplots(figsize=(11, max(2.5, 0.3 * len(rows) + 1)))
    for y, r in enumerate(rows):
        for kind, color in COLORS.items():
            if kind in bars[r]:
                ax.broken_barh(bars[r][kind], (y - 0.4, 0.8), facecolors=color)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([timeline.resource_names[r] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    shown = f" ({len(rows)} busiest of {used} rows)" if used > len(rows) else ""
    ax.set_title((title or f"simulated iteration: {timeline.makespan * 1e3:.3f} ms") + shown)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), fontsize=7, loc="upper right", ncol=len(COLORS))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
