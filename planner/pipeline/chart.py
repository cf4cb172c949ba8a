"""A pipeline step's timeline as a picture: one row per stage, one box per micro-batch's
forward (light) or backward (dark) on a chunk, numbered by micro-batch (and chunk when
interleaved), gradient sync and update hatched, messages as thin bars under their sender's
row. What Narayanan et al. (SC'21) draw in Figs. 3-4, from `simulate_pipeline`."""

from __future__ import annotations

from pathlib import Path

from planner.pipeline.schedule import FORWARD
from planner.pipeline.timeline import PipelineTimeline, counted


def gantt(timeline: PipelineTimeline, path: str | Path, title: str = "") -> None:
    """Write the chart of `timeline` to `path` (PNG, SVG or PDF by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = timeline.groups
    scale, unit = _unit(timeline.makespan)
    # constrained: the legend gets its own room under the x-axis label, whatever the height
    fig, ax = plt.subplots(figsize=(10, 0.55 * p + 1.6), layout="constrained")
    colours = plt.get_cmap("tab10")
    labels = len(timeline.works) <= 400  # numbers only where they can be read
    for s in timeline.works:
        light = s.work.kind == FORWARD
        colour = colours(s.work.chunk // p % 10)
        ax.broken_barh(
            [(s.start * scale, (s.end - s.start) * scale)],
            (p - 1 - s.group - 0.4, 0.7),
            facecolors=colour,
            alpha=0.45 if light else 0.95,
            edgecolor="white",
            linewidth=0.5,
        )
        if labels:
            text = str(s.work.micro + 1)
            ax.text(
                (s.start + s.end) / 2 * scale,
                p - 1 - s.group - 0.05,
                text,
                ha="center",
                va="center",
                fontsize=6,
                color="black" if light else "white",
            )
    for s in timeline.messages:
        ax.broken_barh(
            [(s.start * scale, max((s.end - s.start) * scale, 1e-9))],
            (p - 1 - s.group - 0.48, 0.06),
            facecolors="grey",
        )
    for s in timeline.syncs:
        if s.end > s.start:
            ax.broken_barh(
                [(s.start * scale, (s.end - s.start) * scale)],
                (p - 1 - s.group - 0.4, 0.7),
                facecolors="none",
                edgecolor="black",
                hatch="////",
                linewidth=0.5,
            )
    ax.set_yticks(range(p), [f"stage {p - 1 - k}" for k in range(p)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, timeline.makespan * scale)
    sched = timeline.schedule + (
        f", {timeline.virtual} chunks per stage" if timeline.virtual > 1 else ""
    )
    micro = counted(timeline.micro_batches, "micro-batch", "micro-batches")
    ax.set_title(
        title or f"{sched}: {counted(p, 'stage')}, {micro}, bubble {timeline.bubble:.1%}",
        fontsize=10,
    )
    from matplotlib.patches import Patch

    fig.legend(
        handles=[
            Patch(facecolor=colours(0), alpha=0.45, label="forward (micro-batch number)"),
            Patch(facecolor=colours(0), alpha=0.95, label="backward"),
            Patch(facecolor="none", edgecolor="black", hatch="////", label="gradient sync, update"),
            Patch(facecolor="grey", label="messages (sender's row)"),
        ],
        fontsize=7,
        loc="outside lower center",  # below the axes and their label, never over them
        ncol=4,
        frameon=False,
    )
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"
