"""Timelines people can look at: a Chrome trace (Perfetto, chrome://tracing) and a Gantt chart."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from planner.sim.simulator import Timeline


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
GANTT_LABELS = 40  # at most this many bars are labelled, the longest first
LABEL_MIN_FRACTION = 0.02  # ... and only bars at least this share of the chart's width
LABEL_CHARS = 180  # characters of a label that fit across the whole time axis
LEGEND_COLUMNS = 10  # legend entries per line at most
# A device's work for an op is coloured by the op's kind (tab20 without its greys, one
# colour per kind of `planner.graph.opkinds.KINDS`, in that order) and hatched by phase;
# transfers, parameter sync and message overheads are greys.
OP_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
    "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
    "#dbdb8d", "#9edae5",
)  # fmt: skip
OTHER_KIND = "#7b4173"  # an op kind beyond the palette, or not known (legend: "other")
PHASES = {  # task kind -> legend label, hatch
    "fwd": ("forward", ""),
    "bwd": ("backward", "////"),
    "bn": ("batch-norm stats", "xxxx"),
    "update": ("update", "...."),
}
LINK_KINDS = {  # task kind -> legend label, colour
    "xfer": ("transfer", "0.65"),
    "sync": ("gradient sync", "0.3"),
    "msg": ("message overhead", "0.85"),
}

Style = tuple[str, str]  # (task kind: fwd, bwd, bn, update, xfer, sync, msg; op kind or "")


def _op_name(name: str) -> str | None:
    """The op a device task works for ("fwd conv1 #2" -> "conv1"); None for a transfer."""
    for prefix in ("fwd ", "bwd ", "bn grad stats ", "bn stats "):
        if name.startswith(prefix):
            return name[len(prefix) :].rsplit(" #", 1)[0]
    if name.startswith("update "):
        return name[len("update ") :].rsplit(" shard ", 1)[0]
    return None


def _label(name: str) -> str:
    """What a bar shows: its op ("conv1"), or what a transfer carries ("conv1->relu1",
    "allreduce fc6")."""
    op = _op_name(name)
    if op is not None:
        return op
    head, _, rest = name.partition(" ")
    if head == "xfer":  # "xfer WHAT a->b hop h"
        return rest.rsplit(" ", 3)[0]
    return rest or name


def _style(timeline: Timeline, name: str) -> Style:
    kind = _kind(name)
    if kind in LINK_KINDS:
        return kind, ""
    op = _op_name(name)
    return kind, timeline.op_kinds.get(op, "") if op is not None else ""


def kind_color(op_kind: str) -> str:
    """The colour of an op kind's bars (the same in every chart)."""
    from planner.graph.opkinds import KINDS

    order = list(KINDS)
    if op_kind in order and order.index(op_kind) < len(OP_PALETTE):
        return OP_PALETTE[order.index(op_kind)]
    return OTHER_KIND


def style_of(style: Style) -> tuple[str, str]:
    """(face colour, hatch) of a bar."""
    kind, op_kind = style
    if kind in LINK_KINDS:
        return LINK_KINDS[kind][1], ""
    return kind_color(op_kind), PHASES.get(kind, ("", ""))[1]


def gantt_rows(
    timeline: Timeline, limit: int = GANTT_ROWS
) -> tuple[list[int], dict[int, dict[Style, list[tuple[float, float]]]], int]:
    """The (at most `limit`) busiest resources in resource order, every resource's bars by
    style (task kind, op kind) in ms (start, duration), and how many resources are busy at
    all: one pass over the tasks."""
    bars: dict[int, dict[Style, list[tuple[float, float]]]] = {}
    busy: dict[int, float] = {}
    for t in timeline.tasks:
        if t.end > t.start:
            row = bars.setdefault(t.resource, {})
            bar = (t.start * 1e3, (t.end - t.start) * 1e3)
            row.setdefault(_style(timeline, t.name), []).append(bar)
            busy[t.resource] = busy.get(t.resource, 0.0) + t.end - t.start
    rows = sorted(sorted(busy, key=lambda r: (-busy[r], r))[:limit])
    return rows, bars, len(busy)


def gantt_labels(
    timeline: Timeline, rows: list[int], limit: int = GANTT_LABELS
) -> list[tuple[int, float, str]]:
    """(row position, middle in ms, text) for the longest bars on `rows`: at most `limit`,
    each at least LABEL_MIN_FRACTION of the makespan, the text cut to what fits its bar."""
    span = timeline.makespan
    if span <= 0:
        return []
    position = {r: y for y, r in enumerate(rows)}
    wide = [
        t
        for t in timeline.tasks
        if t.resource in position and t.end - t.start >= LABEL_MIN_FRACTION * span
    ]
    wide.sort(key=lambda t: (t.start - t.end, t.resource, t.start))
    out = []
    for t in wide[:limit]:
        fits = int((t.end - t.start) / span * LABEL_CHARS)
        text = _fit(_label(t.name), fits)
        if text:
            out.append((position[t.resource], (t.start + t.end) / 2 * 1e3, text))
    return out


def _fit(text: str, chars: int) -> str:
    """`text` in at most `chars` characters: whole, or cut with an ellipsis ("" if tiny)."""
    if len(text) <= chars:
        return text
    return text[: chars - 1] + "\u2026" if chars >= 4 else ""


def gantt_legend(styles: set[Style]) -> list[tuple[str, str, str]]:
    """(label, face colour, hatch) of every op kind, phase and link kind drawn."""
    from planner.graph.opkinds import KINDS

    op_kinds = {k for kind, k in styles if kind not in LINK_KINDS}
    kinds = {kind for kind, _ in styles}
    order = [k for k in KINDS if k in op_kinds] + sorted(op_kinds - set(KINDS))
    out = [(k or "other", kind_color(k), "") for k in order]
    out += [(label, "white", hatch) for kind, (label, hatch) in PHASES.items() if kind in kinds]
    out += [(label, color, "") for kind, (label, color) in LINK_KINDS.items() if kind in kinds]
    return out


def save_gantt(timeline: Timeline, path: str | Path, title: str = "") -> None:
    """A Gantt chart of the busy devices and links (matplotlib, PNG or any format it writes);
    on large clusters, of the GANTT_ROWS busiest ones. A device's work is coloured by its
    op's kind and hatched by phase, the longest bars are labelled, the legend says which is
    which."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows, bars, used = gantt_rows(timeline)
    drawn = {style for r in rows for style in bars[r]}
    legend = gantt_legend(drawn)
    lines = max(1, math.ceil(len(legend) / LEGEND_COLUMNS))
    below = 0.25 * lines + 0.15  # inches under the axes for the legend
    height = max(3.0, 0.3 * len(rows) + 1.6) + below
    fig, ax = plt.subplots(figsize=(11, height))
    for y, r in enumerate(rows):
        for style, spans in bars[r].items():
            color, hatch = style_of(style)
            # a thin white edge keeps back-to-back tasks apart (and draws the hatch)
            ax.broken_barh(
                spans,
                (y - 0.4, 0.8),
                facecolors=color,
                edgecolors="white",
                linewidth=0.3,
                hatch=hatch,
            )
    for y, x, text in gantt_labels(timeline, rows):
        ax.text(x, y, text, ha="center", va="center", fontsize=6, clip_on=True)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([timeline.resource_names[r] for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, timeline.makespan * 1e3)
    ax.set_xlabel("time (ms)")
    shown = f" ({len(rows)} busiest of {used} rows)" if used > len(rows) else ""
    ax.set_title((title or f"simulated iteration: {timeline.makespan * 1e3:.3f} ms") + shown)
    handles = [Patch(facecolor=c, edgecolor="0.3", hatch=h, label=text) for text, c, h in legend]
    fig.legend(
        handles=handles,
        fontsize=7,
        loc="lower center",
        ncol=max(1, math.ceil(len(handles) / lines)),
        frameon=False,
    )
    fig.tight_layout(rect=(0, below / height, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
