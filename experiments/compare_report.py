"""What `python -m experiments.compare` prints: a table per setting, its summary, a legend.

Kept apart from the run loop (experiments/compare.py) so the wording can be read and tested
on its own. Times are in milliseconds; "xDP" is data parallelism's time over the row's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from experiments.compare import Case, Row

NEAR = 0.01  # "within 1%"
RTOL = 1e-6
OBJECTIVE_NAMES = {"additive": "additive (OptCNN Eq. 1)", "makespan": "simulated (FlexFlow)"}
SHORT_LIMITS = {"ITERATIONS": "ITERS", "INTERRUPTED": "STOPPED"}
PROBLEM_VERDICTS = ("DISAGREES", "BELOW PROVEN OPTIMUM")


# -- cells ----------------------------------------------------------------------------------


def decimals(values: Sequence[float | None]) -> int:
    """Decimals that give the smallest value (seconds, printed in ms) 3 significant digits."""
    ms = [v * 1e3 for v in values if v is not None and v > 0]
    if not ms:
        return 3
    return min(4, max(1, 2 - math.floor(math.log10(min(ms)))))


def fmt_ms(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value * 1e3:.{digits}f}"


def fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def fmt_status(status: str) -> str:
    head, _, limit = status.partition("/")
    return f"{head}/{SHORT_LIMITS.get(limit, limit)}" if limit else head


def fmt_gap(row: Row) -> str:
    """'no bound' (the method proves none) is not '100%' (a bound half the answer)."""
    if row.is_baseline or row.objective is None:
        return ""
    if row.gap is None:
        return "no bound"
    if math.isinf(row.gap):
        return "bound 0"
    if row.gap < 5e-5:  # a solver's tolerance, not a gap worth printing
        return "0%"
    return f"{row.gap:.1%}" if row.gap < 0.1 else f"{row.gap:.0%}"


def _searched_mark(objective: str, column: str) -> str:
    return "*" if column == objective else ""


# -- tables ---------------------------------------------------------------------------------


def case_table(case: Case, objective: str) -> Table:
    digits = decimals([r.additive for r in case.rows] + [r.simulated for r in case.rows])
    t = Table(
        title=f"{case.model} on {case.preset}: {case.devices} devices, batch {case.batch}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    columns = [
        ("\nmethod", "left"),
        ("\nstatus", "left"),
        (f"additive{_searched_mark(objective, 'additive')}\nms", "right"),
        ("\nxDP", "right"),
        (f"simulated{_searched_mark(objective, 'makespan')}\nms", "right"),
        ("\nxDP", "right"),
        ("search\ns", "right"),
        ("\ngap", "right"),
        ("vs\noptimum", "right"),
        ("\nrecommend", "left"),
    ]
    for name, justify in columns:
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in case.rows:
        switched = r.recommended not in ("", "same")
        cells = [
            Text(r.method, style="italic" if r.is_baseline else ""),
            Text(fmt_status(r.status) if r.status != "cannot run" else "n/a"),
            Text(fmt_ms(r.additive, digits)),
            Text(fmt_x(r.additive_speedup)),
            Text(fmt_ms(r.simulated, digits), style="bold yellow" if switched else ""),
            Text(fmt_x(r.simulated_speedup)),
            Text("" if r.search_seconds is None else f"{r.search_seconds:.2f}"),
            Text(fmt_gap(r)),
            Text(r.verdict, style="bold red" if r.verdict in PROBLEM_VERDICTS else ""),
            Text(r.recommended, style="bold yellow" if switched else ""),
        ]
        t.add_row(*cells)  # Text, not markup: "[owt]" is a method name, not a style tag
    return t


def tables(cases: Sequence[Case], objective: str, time_limit: float) -> list[RenderableType]:
    """Per setting: its table and its summary paragraph."""
    out: list[RenderableType] = []
    for case in cases:
        out.append(Group(case_table(case, objective), Text(case.summary), Text("")))
    flagged = [c for c in cases if c.flagged]
    if objective == "additive":
        out.append(
            Text(
                f"{len(flagged)} of {len(cases)} settings: a proven additive optimum simulates "
                "slower than an expert baseline"
                + (
                    f" ({', '.join(f'{c.model} on {c.preset}' for c in flagged)})"
                    if flagged
                    else ""
                ),
                style="bold yellow" if flagged else "",
            )
        )
    return out


# -- summaries ------------------------------------------------------------------------------


def _ms(value: float) -> str:
    return f"{value * 1e3:#.4g}".rstrip(".") + " ms"


def _value(row: Row) -> float:
    return math.inf if row.objective is None else row.objective


def _who(rows: Sequence[Row]) -> str:
    return ", ".join(f"{r.method} ({r.search_seconds or 0:.2f} s)" for r in rows)


def summary(case: Case, objective: str, time_limit: float) -> tuple[str, bool]:
    """One paragraph: who reaches the optimum and how fast, who is within 1%, what the
    simulator says about it, what is recommended. Also whether the case is flagged (a proven
    additive optimum simulates slower than a baseline)."""
    searched = [r for r in case.rows if not r.is_baseline]
    found = [r for r in searched if r.objective is not None]
    proven = [r for r in found if r.status.startswith("OPTIMAL")]
    name = OBJECTIVE_NAMES[objective]
    parts = [f"{case.model} on {case.preset}, {name} objective, {time_limit:g} s per backend."]
    if proven:
        reference = min(r.objective for r in proven if r.objective is not None)
        provers = sorted(proven, key=lambda r: r.search_seconds or 0.0)
        parts.append(f"Optimum {_ms(reference)}, proven by {_who(provers)}.")
    elif found:
        best = min(found, key=_value)
        reference = _value(best)
        parts.append(
            f"No backend proves the optimum in {time_limit:g} s; best answer {_ms(reference)} "
            f"by {best.method} (gap {fmt_gap(best)})."
        )
    else:
        parts.append("No backend found an answer.")
        return " ".join(parts), False
    others = [r for r in found if r not in proven]
    reached = [r for r in others if _value(r) <= reference * (1 + RTOL)]
    near = [r for r in others if r not in reached and _value(r) <= reference * (1 + NEAR)]
    far = [r for r in others if r not in reached and r not in near]
    if reached and proven:
        parts.append(f"Reached without a proof by {_who(reached)}.")
    near_names = ", ".join(r.method for r in near) or "no other backend"
    parts.append(f"Within 1%: {near_names}.")
    if far:
        excess = [f"{r.method} +{_value(r) / reference - 1:.1%}" for r in far]
        parts.append(f"Further: {', '.join(excess)}.")
    text, flagged = _simulated_part(case, proven if proven else found, objective)
    parts.append(text)
    failed = [r for r in searched if r.objective is None]
    if failed:
        why = ", ".join(f"{r.method} ({r.note or r.status})" for r in failed)
        parts.append(f"Not run or no answer: {why}.")
    return " ".join(p for p in parts if p), flagged


def _simulated_part(case: Case, best: Sequence[Row], objective: str) -> tuple[str, bool]:
    baselines = [r for r in case.rows if r.is_baseline and r.simulated is not None]
    top = min(best, key=lambda r: (r.objective or math.inf, r.search_seconds or 0.0))
    if top.simulated is None:
        return "", False
    fastest = min(baselines, key=lambda r: r.simulated or math.inf, default=None)
    optimum = top.status == "OPTIMAL"
    label = f"the {objective} optimum ({top.method})" if optimum else f"{top.method}'s answer"
    text = (
        f"Simulated, {label} runs {_ms(top.simulated)}, "
        f"{fmt_x(top.simulated_speedup)} over data parallelism "
        f"(additive: {fmt_x(top.additive_speedup)})"
    )
    switched = top.recommended not in ("", "same")
    if switched and fastest is not None and fastest.simulated is not None:
        text += (
            f"; SLOWER than {fastest.method} ({_ms(fastest.simulated)}): "
            f"recommended {top.recommended}."
        )
    else:
        text += "; no baseline simulates faster: recommended as searched."
    flagged = objective == "additive" and any(
        r.status == "OPTIMAL" and r.recommended not in ("", "same") for r in best
    )
    return text, flagged


# -- legend ---------------------------------------------------------------------------------


def legend(objective: str) -> Table:
    """What every column and status means (printed once, under the tables)."""
    searched = OBJECTIVE_NAMES[objective]
    entries = [
        ("*", f"the objective every backend minimized: {searched}."),
        (
            "additive",
            "OptCNN's cost (Eq. 1): per op compute + parameter sync, plus every tensor "
            "transfer, summed as if nothing overlapped (ms per iteration).",
        ),
        (
            "simulated",
            "FlexFlow's simulation of the same strategy's task graph, where compute, "
            "transfers and sync overlap (ms per iteration).",
        ),
        ("xDP", "data parallelism's time / this row's, in that column's objective (> 1: faster)."),
        ("[name]", "an expert strategy (baseline): scored, not searched."),
        (
            "status",
            "OPTIMAL: proven optimal for the * objective. FEASIBLE: an answer, not proven; "
            "/TIME: stopped at the time budget; /ITERS: stopped by its own iteration cap before "
            "the budget; /STOPPED: Ctrl-C. n/a: cannot run here (the summary says why).",
        ),
        ("search s", "the backend's wall-clock seconds; every backend had the same budget."),
        (
            "gap",
            "answer / proven lower bound - 1, for the * objective. 'no bound': the method "
            "proves none (a heuristic), which is not a 100% gap; 'bound 0': a trivial bound.",
        ),
        (
            "vs optimum",
            "excess over the smallest proven optimum. 'agrees': a proven optimum equal to the "
            "others; '= optimum': reached, not proven. DISAGREES (proofs differ) and BELOW "
            "PROVEN OPTIMUM are bugs: exit status 1.",
        ),
        (
            "recommend",
            "what planner.recommend returns for the answer: 'same', or the baseline it "
            "switches to because that baseline simulates faster (highlighted).",
        ),
    ]
    t = Table.grid(padding=(0, 2))
    t.title = "Legend"
    t.title_justify = "left"
    t.add_column(no_wrap=True)
    t.add_column()
    for key, text in entries:
        t.add_row(Text(key), Text(text))
    return t


# -- plot -----------------------------------------------------------------------------------


def plot(cases: Sequence[Case], path: Path) -> None:
    """Speedup over data parallelism per case and method, additive above, simulated below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c.model}\n{c.preset}" for c in cases]
    methods = list(dict.fromkeys(r.method for c in cases for r in c.rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, len(cases) * 1.3), 6.5), sharex=True)
    width = 0.8 / max(1, len(methods))
    for ax, attr, title in (
        (axes[0], "additive_speedup", "additive (OptCNN Eq. 1)"),
        (axes[1], "simulated_speedup", "simulated (FlexFlow)"),
    ):
        for k, m in enumerate(methods):
            vals = []
            for c in cases:
                r = next((r for r in c.rows if r.method == m), None)
                vals.append(getattr(r, attr) or 0.0 if r is not None else 0.0)
            ax.bar([i + k * width for i in range(len(cases))], vals, width, label=m)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_ylabel(f"x data parallel\n{title}", fontsize=8)
    axes[1].set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    axes[1].set_xticklabels(labels, fontsize=7)
    axes[0].legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
