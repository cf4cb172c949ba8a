"""What every launcher export shares: the one-line notes on what it cannot express, with the
nearest layout it can and that layout's simulated step beside the plan's, and the result
type (`Launch`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.errors import LayerwiseError
from planner.export.launchers.layout import LaunchPlan, Uniform, share
from planner.files import check_output_path, write_text_atomic

__all__ = ["Change", "Launch", "base_changes", "note_lines"]


@dataclass(frozen=True)
class Change:
    """One thing of the plan a launcher cannot express: what (`what`, "schedule gpipe:
    Megatron-LM runs 1F1B or interleaved"), the nearest it can (`nearest`, "1f1b"), and
    the layout with that change alone (None when the cost model cannot tell it apart)."""

    what: str
    nearest: str
    layout: Uniform | None = None


@dataclass(frozen=True)
class Launch:
    """A launcher's configuration of a plan: `text` (the file: a TOML, an argument list, a
    script), `args` (torchtitan 0.3's overrides or Megatron-LM's arguments as a list), the
    layout it runs (`uniform`), one line per thing it cannot express (`notes`), and the
    plan's and the exported layout's simulated steps in seconds (None when not simulated)."""

    to: str
    text: str
    args: tuple[str, ...]
    uniform: Uniform
    notes: tuple[str, ...]
    planned_seconds: float | None
    exported_seconds: float | None

    def save(self, path: str | Path) -> None:
        """Write `text` to `path` atomically."""
        path = check_output_path(path, f"{self.to} configuration")
        write_text_atomic(path, self.text)


def base_changes(lp: LaunchPlan) -> list[Change]:
    """What no launcher expresses: stages on other devices than n/p consecutive ranks, and
    ops laid out otherwise than the nearest uniform layout."""
    out = []
    if lp.pipeline is not None and not lp.stage_groups:
        groups = [list(g) for g in lp.pipeline.groups]
        out.append(
            Change(
                f"stage devices {groups[:4]}{'...' if len(groups) > 4 else ''}: a launcher "
                f"gives each of the {lp.uniform.stages} stages n/p consecutive ranks",
                lp.uniform.degrees(),
                lp.uniform,
            )
        )
    if lp.differ:
        ops = len([op for op in lp.strategy.graph.ops if op.kind != "input"])
        example = lp.differ[0]
        cfg = lp.strategy.config(example)
        op = next(o for o in lp.strategy.graph.ops if o.name == example)
        out.append(
            Change(
                f"per-op layouts: {len(lp.differ)} of {ops} ops ({share(1 - lp.alike)} of the "
                f"FLOPs) are laid out otherwise than uniform degrees lay them out (e.g. "
                f"{example}: {cfg.describe(op)})",
                lp.uniform.degrees()
                + (f" (the fastest of {lp.ties} as alike)" if lp.ties > 1 else ""),
                lp.uniform,
            )
        )
    return out


def note_lines(
    lp: LaunchPlan, changes: Sequence[Change], exported: Uniform, simulate: bool
) -> tuple[tuple[str, ...], float | None, float | None]:
    """The notes (one line per change, its nearest layout's simulated step beside the
    plan's), the plan's and the exported layout's seconds (None when not simulated or when
    the exported layout cannot be simulated)."""
    planned = lp.planned_seconds if simulate else None
    lines = []
    for change in changes:
        line = f"{change.what}: nearest {change.nearest}"
        if simulate and change.layout is not None:
            line += _beside(lp, change.layout, planned)
        elif simulate:
            line += " (not simulated: the cost model does not tell it apart)"
        lines.append(line)
    out = _seconds(lp.simulate, exported) if simulate else None
    return tuple(lines), planned, out if isinstance(out, float) else None


def summary(launch_seconds: float | None, planned: float | None) -> str:
    """One line: the exported layout's simulated step beside the plan's."""
    if launch_seconds is None or planned is None:
        return "not simulated"
    return f"simulated step {_ms(launch_seconds)}, the plan's {_ms(planned)}"


def _beside(lp: LaunchPlan, layout: Uniform, planned: float | None) -> str:
    got = _seconds(lp.simulate, layout)
    if isinstance(got, str):
        return f" (not simulated: {got})"
    return f" (simulated {_ms(got)} vs the plan's {_ms(planned)})"


def _seconds(simulate: Callable[[Uniform], float], layout: Uniform) -> float | str:
    try:
        return simulate(layout)
    except LayerwiseError as exc:
        return str(exc)


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.4g} ms"


def keeps_master_weights(lp: LaunchPlan, layout: Uniform) -> bool:
    """Whether `layout`'s 16-bit weights keep fp32 master copies (its own setting, else the
    plan's cost option `master_weights`)."""
    if layout.master_weights is not None:
        return layout.master_weights
    return bool(lp.cost.get("master_weights"))


def changed(layout: Uniform, **kwargs: object) -> Uniform:
    """`layout` with some fields changed."""
    return dataclasses.replace(layout, **kwargs)  # type: ignore[arg-type]
