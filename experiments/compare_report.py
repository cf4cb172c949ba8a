"""What `python -m experiments.compare` prints: a table per setting, its summary, a legend.

Kept apart from the run loop (experiments/compare.py) so the wording can be read and tested
on its own. Times are in milliseconds; "xDP" is data parallelism's time over the row's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NEAR = 0.01  # "within 1%"
OVER_BUDGET = 0.01  # a solve call longer than the budget by more than this is named
RTOL = 1e-6
OBJECTIVE_NAMES = {"additive": "additive (OptCNN Eq. 1)", "makespan": "simulated (FlexFlow)"}
SHORT_LIMITS = {"ITERATIONS": "ITERS", "INTERRUPTED": "STOPPED"}
PROBLEM_VERDICTS = ("DISAGREES", "BELOW PROVEN OPTIMUM")


# -- what is reported (experiments/compare.py fills them) --------------------------------------


@dataclass
class Row:
    """One method on one case. `objective` is the searched objective's value, `additive` and
    `simulated` are both objectives (seconds); speedups are data parallelism's time over
    this one's."""

    model: str
    preset: str
    method: str  # a backend name, or "[name]" for an expert baseline
    status: str  # "OPTIMAL", "FEASIBLE/TIME", ..., "baseline", "cannot run"
    objective: float | None = None
    speedup: float | None = None
    search_seconds: float | None = None  # the backend's own clock (re-score excluded)
    call_seconds: float | None = None  # the whole solve call, re-score included (harness)
    gap: float | None = None
    verdict: str = ""
    simulated: float | None = None
    additive: float | None = None
    additive_speedup: float | None = None
    simulated_speedup: float | None = None
    bound: float | None = None
    recommended: str = ""  # "same", or the baseline `recommend` switches to ("" for baselines)
    recommended_simulated: float | None = None
    choices: list[int] | None = None
    plan: str | None = None  # the strategy file, relative to the results folder
    note: str = ""  # why a backend could not run

    @property
    def is_baseline(self) -> bool:
        return self.method.startswith("[")


@dataclass
class Case:
    """One model on one device preset: its rows (methods), summary and verdict flags."""

    model: str
    preset: str
    devices: int
    batch: int
    build_seconds: float
    rows: list[Row] = field(default_factory=list)
    summary: str = ""
    flagged: bool = False  # a proven additive optimum simulates slower than a baseline
    seconds: float = 0.0


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


def gap_cell(row: Row) -> str:
    """The row's own gap, except beside "= optimum": the answer is the optimum another
    backend proved, and a gap there would only say that this backend's own bound is weaker
    (cpsat's restricted rounds keep only the trivial bound): "unproven" (the summary gives
    the number)."""
    text = fmt_gap(row)
    weaker = row.verdict == "= optimum" and text[:1].isdigit() and text != "0%"
    return "unproven" if weaker else text


COLUMN_WORDS = {"additive": "additive", "makespan": "simulated"}  # an objective's columns


def case_table(case: Case, objective: str) -> Table:
    """One row per method. Each objective's columns (ms, xDP) stand together under its name;
    the gap and the verdict follow the searched (*) objective's, the verdict naming it."""
    digits = decimals([r.additive for r in case.rows] + [r.simulated for r in case.rows])
    t = Table(
        title=f"{case.model} on {case.preset}: {case.devices} devices, batch {case.batch}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    cells: list[tuple[str, str, Callable[[Row], Text]]] = [
        ("\nmethod", "left", lambda r: Text(r.method, style="italic" if r.is_baseline else "")),
        ("\nstatus", "left", lambda r: Text(_status_cell(r))),
    ]
    for kind, word in COLUMN_WORDS.items():
        mark = "*" if kind == objective else ""
        cells += [
            (f"{word}{mark}\nms", "right", partial(_time_cell, kind, digits)),
            ("\nxDP", "right", partial(_speedup_cell, kind)),
        ]
        if kind == objective:
            cells += [
                ("own\ngap", "right", lambda r: Text(gap_cell(r))),
                (f"vs {word}\noptimum", "right", _verdict_cell),
            ]
    cells += [
        ("search\ns", "right", lambda r: Text(_seconds(r.search_seconds))),
        ("\nrecommend", "left", _recommend_cell),
    ]
    for name, justify, _ in cells:
        t.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in case.rows:
        t.add_row(*(cell(r) for _, _, cell in cells))  # Text: "[owt]" is a name, not a style
    return t


def _switched(row: Row) -> bool:
    return row.recommended not in ("", "same")


def _status_cell(row: Row) -> str:
    return fmt_status(row.status) if row.status != "cannot run" else "n/a"


def _time_cell(kind: str, digits: int, row: Row) -> Text:
    if kind == "additive":
        return Text(fmt_ms(row.additive, digits))
    return Text(fmt_ms(row.simulated, digits), style="bold yellow" if _switched(row) else "")


def _speedup_cell(kind: str, row: Row) -> Text:
    return Text(fmt_x(row.additive_speedup if kind == "additive" else row.simulated_speedup))


def _verdict_cell(row: Row) -> Text:
    return Text(row.verdict, style="bold red" if row.verdict in PROBLEM_VERDICTS else "")


def _recommend_cell(row: Row) -> Text:
    return Text(row.recommended, style="bold yellow" if _switched(row) else "")


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def tables(cases: Sequence[Case], objective: str, time_limit: float) -> list[RenderableType]:
    """Per setting: its table and its summary paragraph."""
    out: list[RenderableType] = []
    for case in cases:
        out.append(Group(case_table(case, objective), Text(case.summary), Text("")))
    flagged = [c for c in cases if c.flagged]
    if objective == "additive" and cases:  # none when a Ctrl-C came in the first case
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
    return ", ".join(f"{r.method} ({r.search_seconds or 0:.2f} s{_own_gap(r)})" for r in rows)


def _own_gap(row: Row) -> str:
    return ", own gap " + fmt_gap(row) if gap_cell(row) == "unproven" else ""


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
    parts.append(_over_budget(searched, time_limit))
    failed = [r for r in searched if r.objective is None]
    if failed:
        why = ", ".join(f"{r.method} ({r.note or r.status})" for r in failed)
        parts.append(f"Not run or no answer: {why}.")
    return " ".join(p for p in parts if p), flagged


def _over_budget(rows: Sequence[Row], time_limit: float) -> str:
    """The solve calls that took more than the budget (by OVER_BUDGET), and how much of it
    was outside the backend's own clock (the re-score)."""
    over = [
        r
        for r in rows
        if r.call_seconds is not None and r.call_seconds > time_limit * (1 + OVER_BUDGET)
    ]
    if not over:
        return ""
    calls = ", ".join(
        f"{r.method} {r.call_seconds:.2f} s (search {r.search_seconds or 0:.2f} s)" for r in over
    )
    return f"Over the {time_limit:g} s budget: {calls}."


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
        (
            "xDP",
            "data parallelism's time / this row's, in the objective on its left (> 1: faster).",
        ),
        ("[name]", "an expert strategy (baseline): scored, not searched."),
        (
            "status",
            "OPTIMAL: proven optimal for the * objective. FEASIBLE: an answer, not proven; "
            "/TIME: stopped at the time budget; /ITERS: stopped by its own iteration cap before "
            "the budget; /STOPPED: Ctrl-C. n/a: cannot run here (the summary says why).",
        ),
        (
            "search s",
            "the backend's wall-clock seconds, re-score excluded; every backend had the same "
            "budget (a whole call over it is named in the summary).",
        ),
        (
            "own gap",
            "in the * objective: answer / the backend's own proven lower bound - 1. 'no bound': "
            "the method proves none (a heuristic), which is not a 100% gap; 'bound 0': a trivial "
            "bound; 'unproven': the answer is the optimum another backend proved, its own bound "
            "is weaker (the summary gives its gap).",
        ),
        (
            "vs ... optimum",
            "in the * objective only: excess over the smallest optimum proven in it (the other "
            "objective has no proven optimum here). 'agrees': a proven optimum equal to the "
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


# tab20's strong colours, then its light ones (greys left out: the reference line is grey)
SERIES_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
    "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
    "#dbdb8d", "#9edae5",
)  # fmt: skip
SERIES_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*", "d", "8", "H")


def series_styles(methods: Sequence[str]) -> dict[str, tuple[str, str]]:
    """A colour and a marker for every method: no two share either while there are at most
    as many methods as markers (15; the registry and the baselines make 12)."""
    return {
        m: (SERIES_COLORS[k % len(SERIES_COLORS)], SERIES_MARKERS[k % len(SERIES_MARKERS)])
        for k, m in enumerate(methods)
    }


def speedup_figure(cases: Sequence[Case]) -> Figure:
    """Speedup over data parallelism per case and method (log scale), additive above,
    simulated below: one marker per method and case, each method its own colour and marker;
    a method without a value in a case has no marker there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c.model}\n{c.preset}" for c in cases]
    methods = list(dict.fromkeys(r.method for c in cases for r in c.rows))
    styles = series_styles(methods)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.5, len(cases) * 1.4), 7.0), sharex=True)
    step = 0.8 / max(1, len(methods))
    for ax, attr, title in (
        (axes[0], "additive_speedup", OBJECTIVE_NAMES["additive"]),
        (axes[1], "simulated_speedup", OBJECTIVE_NAMES["makespan"]),
    ):
        for k, m in enumerate(methods):
            xs, ys = [], []
            for i, c in enumerate(cases):
                r = next((r for r in c.rows if r.method == m), None)
                value = getattr(r, attr) if r is not None else None
                if value is not None and value > 0:
                    xs.append(i - 0.4 + (k + 0.5) * step)
                    ys.append(value)
            color, marker = styles[m]
            ax.plot(xs, ys, linestyle="none", marker=marker, color=color, markersize=5, label=m)
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_yscale("log")
        ax.set_ylabel(f"x data parallel\n{title}", fontsize=8)
        ax.grid(axis="y", which="major", color="0.9", lw=0.5)
    axes[1].set_xticks(range(len(cases)))
    axes[1].set_xticklabels(labels, fontsize=7)
    axes[0].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot(cases: Sequence[Case], path: Path) -> None:
    """`speedup_figure` written to `path`."""
    import matplotlib.pyplot as plt

    fig = speedup_figure(cases)
    fig.savefig(path, dpi=120)
    plt.close(fig)
