"""A plan in the formats people launch: torchtitan's job config, Megatron-LM's arguments, an
FSDP2 + tensor-parallel script (`export_launcher`, `planner export --to ...`).

- `layout`: the uniform layout nearest to a plan (`read_plan`) and its simulated step;
- `torchtitan`, `megatron`, `fsdp`: each launcher's names for it, and what it changes;
- `common`: the one-line notes and the result type, `Launch`.

Launchers take degrees, not per-op layouts: what a launcher cannot express of a plan (ops laid
out otherwise than any uniform layout, stages on other devices, a schedule, a ZeRO stage or
a precision it lacks) is one line each, with the nearest layout it can express and that
layout's simulated step beside the plan's. Nothing here imports torch. See docs/launchers.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from planner.errors import ExportError
from planner.export.launchers.common import Change, Launch, base_changes, note_lines, summary
from planner.export.launchers.layout import LaunchPlan, Uniform, read_plan

__all__ = ["LAUNCHERS", "Launch", "LaunchPlan", "Uniform", "export_launcher", "read_plan"]

Builder = tuple[
    Callable[[LaunchPlan], tuple[Uniform, list[Change]]],
    Callable[[LaunchPlan, Uniform, tuple[str, ...], str], tuple[str, list[str]]],
]


def _builders() -> dict[str, Builder]:
    from planner.export.launchers import fsdp, megatron, torchtitan

    return {
        "torchtitan": (torchtitan.torchtitan_changes, torchtitan.render),
        "megatron": (megatron.megatron_changes, megatron.render),
        "fsdp": (fsdp.fsdp_changes, fsdp.render),
    }


LAUNCHERS = ("torchtitan", "megatron", "fsdp")


def export_launcher(plan: Any, to: str, *, simulate: bool = True) -> Launch:
    """`plan` (a plan file's path, its JSON, or a `planner.Plan` of a model) as `to`:
    "torchtitan" (a TOML job config, torchtitan 0.3's overrides in its header), "megatron"
    (Megatron-LM's arguments) or "fsdp" (a Python script: FSDP2 and DTensor tensor
    parallelism). `simulate`: time the plan and the nearest layouts (the plan's cost model;
    False skips it, for a large plan). One ExportError line for an unknown `to` or a file
    that is not a plan."""
    if to not in LAUNCHERS:
        raise ExportError(f"unknown launcher {to!r}: one of {', '.join(LAUNCHERS)}")
    changes_of, render = _builders()[to]
    lp = read_plan(plan, simulate)
    exported, changes = changes_of(lp)
    notes, planned, out = note_lines(lp, [*base_changes(lp), *changes], exported, simulate)
    text, args = render(lp, exported, notes, summary(out, planned))
    return Launch(to, text, tuple(args), exported, notes, planned, out)
