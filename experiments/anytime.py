"""Anytime quality of the bench's cases: metrics on traces, and the report that plots them.

    python -m experiments.anytime RESULTS_FOLDER [MORE_FOLDERS] [--out FOLDER]

A case's trace is its backend's `stats["trace"]` (`backends.trace`: the incumbent and the
lower bound as step functions, (t, value) at each improvement) stored by
`experiments.iopddl` in the results folder as traces/<case>.json, with `offset`: the seconds
of the case's clock used before the solve started (the process's start, the imports, loading
the instance), so a point's time on the case's clock is offset + t (at most T: an answer
written just past it counts as at it), and the clock's horizon T is the case's time limit.
The metrics (pure functions of the points, on the case's clock):

- time to target: the first time the incumbent is within 1% (0.1%) of the best known,
  value <= best + 0.01 |best|; None when never within the horizon;
- primal integral (Berthold 2013, "Measuring the impact of primal heuristics", Oper. Res.
  Lett. 41(6), 611-614, Def. 1-3): P(T) = integral over [0, T] of the primal gap
  p(t) = |best - inc(t)| / max(|best|, |inc(t)|) (0 when both are 0; 1 when their signs
  differ, and 1 before the first incumbent), in seconds; also divided by T (0: the best
  from the start, 1: nothing all along);
- primal-dual integral: the same integral of (inc(t) - bound(t)) / max(|inc(t)|, |bound(t)|)
  clipped to [0, 1] (1 while either is missing).

"best" is the best-known cost; a case that found better uses its own answer instead (per
case, in rows.csv), and the report uses the best of the best-known and every case's answer
on the instance, so all backends are measured against one value.

The report reads rows.json (or rows.csv) and traces/ from each folder given and writes, in
the first (or `--out`):
- profile-cost.png and profile-time-1pct.png: performance profiles (Dolan and More 2002,
  "Benchmarking optimization software with performance profiles", Math. Program. 91(2),
  201-213): for each solver s, rho_s(tau) = share of instances on which the performance
  ratio r = m_s / min over solvers of m is <= tau, where m is the median over the seeds of
  the final cost (no valid answer: infinite) or of the time to 1% (never: infinite).
  Per instance with the seeds' median, not per (instance, seed): seeds are not paired
  across solvers. A "solver" is a backend, with its time limit when an instance ran at
  several and its background load when the folders hold several;
- curve-<instance>.png: incumbent (solid) and bound (dashed) over time per backend and seed,
  log time, the best known as a black line; above the whole range on a log scale, below a
  zoom to within 5% of the best;
- anytime.csv and anytime.md: per (instance, solver) the seeds' median (of an even count:
  the mean of the middle two), min and max of the
  final cost / best, the gap, the times to 1% and 0.1%, and the primal and primal-dual
  integrals divided by T.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.dispatch import CaseKey, case_key, trace_name
from planner.cli.args import OneLineArgumentParser
from planner.errors import LayerwiseError
from planner.files import read_json_checked, read_text_checked

__all__ = [
    "Case",
    "case_metrics",
    "format_gap",
    "gap_integral",
    "performance_profile",
    "primal_dual_gap",
    "primal_gap",
    "primal_integral",
    "primal_dual_integral",
    "read_cases",
    "report",
    "shifted",
    "time_to_target",
]

TARGETS = (0.01, 0.001)  # within 1% and 0.1% of the best known
TIME_FLOOR = 1e-3  # seconds: a time to target below it counts as it in a ratio
ZOOM = 0.05  # the lower panel of a curve: within 5% of the best
DPI = 100
TRACES = "traces"

Points = Sequence[Sequence[float]]


# ----------------------------------------------------------------------------- metrics


def shifted(points: Points, offset: float, horizon: float = math.inf) -> list[tuple[float, float]]:
    """(offset + t, value) of each point: the backend's clock onto the case's; a time past
    `horizon` (the answer written just after the limit) counts as at it."""
    return [(min(offset + float(t), horizon), float(v)) for t, v in points]


def time_to_target(incumbent: Points, best: float, within: float, horizon: float) -> float | None:
    """The first time the incumbent is within `within` (a fraction) of `best`, at most
    `horizon`; None when never."""
    target = best + within * abs(best)
    slack = 1e-12 * abs(target)  # rounding, whatever the sign of the target
    for t, v in incumbent:
        if t > horizon:
            return None
        if v <= target + slack:
            return float(t)
    return None


def primal_gap(value: float | None, best: float) -> float:
    """Berthold's primal gap of an incumbent `value` against `best` (Def. 1): 1 without an
    incumbent or when the signs differ, 0 when both are 0, else |best - value| / max(|best|,
    |value|)."""
    if value is None or not math.isfinite(value):
        return 1.0
    if value == 0 and best == 0:
        return 0.0
    if value * best < 0:
        return 1.0
    return abs(best - value) / max(abs(best), abs(value))


def primal_dual_gap(value: float | None, bound: float | None) -> float:
    """The gap between an incumbent and a lower bound, as the primal gap: 1 when either is
    missing or their signs differ, 0 when both are 0, else (value - bound) / max(|value|,
    |bound|) clipped to [0, 1]."""
    if value is None or bound is None or not (math.isfinite(value) and math.isfinite(bound)):
        return 1.0
    if value == 0 and bound == 0:
        return 0.0
    if value * bound < 0:
        return 1.0
    return min(1.0, max(0.0, (value - bound) / max(abs(value), abs(bound))))


def gap_integral(
    incumbent: Points, bound: Points | None, horizon: float, gap: Any, best: float | None = None
) -> float:
    """The integral over [0, horizon] of gap(inc(t), best) (`bound` None) or of gap(inc(t),
    bound(t)): one sweep over the step functions' change points (each sorted by time)."""
    events = sorted(
        [(float(t), 0, float(v)) for t, v in incumbent]
        + [(float(t), 1, float(v)) for t, v in bound or ()],
        key=lambda e: e[:2],  # stable: of two points at one time, the later in its list
    )
    current: list[float | None] = [None, None]  # the incumbent's and the bound's values
    total, at, k = 0.0, 0.0, 0
    while at < horizon:
        while k < len(events) and events[k][0] <= at:
            current[events[k][1]] = events[k][2]
            k += 1
        end = min(events[k][0], horizon) if k < len(events) else horizon
        g = gap(current[0], best) if bound is None else gap(current[0], current[1])
        total += g * (end - at)
        at = end
    return total


def primal_integral(incumbent: Points, best: float, horizon: float) -> float:
    """Berthold's primal integral P(T) (Def. 3), in seconds."""
    return gap_integral(incumbent, None, horizon, primal_gap, best)


def primal_dual_integral(incumbent: Points, bound: Points, horizon: float) -> float:
    """The integral over [0, T] of `primal_dual_gap` of the incumbent and the bound."""
    return gap_integral(incumbent, bound, horizon, primal_dual_gap)


def case_metrics(
    incumbent: Points, bound: Points, best: float | None, horizon: float
) -> dict[str, float | None]:
    """A case's metrics (module docstring), its points on the case's clock; `best`: the
    reference cost (None: only the primal-dual integral)."""
    out: dict[str, float | None] = dict.fromkeys(
        ("time_to_1pct", "time_to_0_1pct", "primal_integral", "primal_integral_norm"), None
    )
    if best is not None and math.isfinite(best):
        out["time_to_1pct"] = time_to_target(incumbent, best, TARGETS[0], horizon)
        out["time_to_0_1pct"] = time_to_target(incumbent, best, TARGETS[1], horizon)
        pi = primal_integral(incumbent, best, horizon)
        out["primal_integral"], out["primal_integral_norm"] = pi, pi / horizon
    pdi = primal_dual_integral(incumbent, bound, horizon)
    out["primal_dual_integral"], out["primal_dual_integral_norm"] = pdi, pdi / horizon
    return out


def performance_profile(
    metric: dict[str, dict[str, float]],
) -> tuple[list[str], dict[str, list[float]]]:
    """Dolan and More's performance ratios: `metric[instance][solver]` (inf: failed; a
    solver missing on an instance: failed) -> (the instances, each solver's ratios, one per
    instance, sorted). rho_s(tau) is the share of a solver's ratios <= tau. An instance no
    solver solved gives every solver an infinite ratio."""
    instances = sorted(metric)
    solvers = sorted({s for row in metric.values() for s in row})
    ratios: dict[str, list[float]] = {s: [] for s in solvers}
    for inst in instances:
        row = metric[inst]
        finite = [max(v, TIME_FLOOR) for v in row.values() if math.isfinite(v)]
        low = min(finite) if finite else math.inf
        for s in solvers:
            v = row.get(s, math.inf)
            ok = math.isfinite(v) and math.isfinite(low)
            ratios[s].append(max(v, TIME_FLOOR) / low if ok else math.inf)
    return instances, {s: sorted(r) for s, r in ratios.items()}


def rho(ratios: Sequence[float], tau: float) -> float:
    """The share of `ratios` <= tau."""
    return sum(r <= tau for r in ratios) / len(ratios) if ratios else 0.0


# ----------------------------------------------------------------------------- reading


@dataclass
class Case:
    """One row of a results folder, with its trace on the case's clock (empty lists when
    the folder has none)."""

    instance: str
    backend: str
    seed: int
    time_limit: float
    background: int
    cost: float | None
    bound: float | None
    best: float | None
    incumbent: list[tuple[float, float]] = field(default_factory=list)
    bounds: list[tuple[float, float]] = field(default_factory=list)
    label: str = ""

    @property
    def key(self) -> CaseKey:
        return case_key(self.instance, self.backend, self.seed, self.time_limit, self.background)


ROW_KEYS = ("instance", "backend", "seed", "time_limit")  # what a row must name


def _rows(folder: Path) -> list[dict[str, Any]]:
    """The rows of a results folder (rows.json, else rows.csv); one LayerwiseError line for
    a file that cannot be read or lacks what a row must name."""
    if (folder / "rows.json").exists():
        path = folder / "rows.json"
        data = read_json_checked(path, "rows")
        rows = data.get("rows") if isinstance(data, dict) else None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise LayerwiseError(f"{path} holds no list of rows: give a results folder")
    elif (folder / "rows.csv").exists():
        path = folder / "rows.csv"
        rows = list(csv.DictReader(io.StringIO(read_text_checked(path, "rows"))))
    else:
        raise LayerwiseError(f"{folder} holds no rows.json or rows.csv: give a results folder")
    for k, row in enumerate(rows):
        missing = [c for c in ROW_KEYS if row.get(c) in (None, "")]
        if missing:
            raise LayerwiseError(f"{path}: row {k + 1} has no {', '.join(missing)}")
    return rows


def _number(x: Any) -> float | None:
    if x is None or x == "":
        return None
    return float(x)


def _case(row: dict[str, Any]) -> Case:
    """A row as a Case (no trace yet); ValueError for a number that is not one."""
    valid = str(row.get("valid", "yes")) == "yes"
    return Case(
        instance=str(row["instance"]),
        backend=str(row["backend"]),
        seed=int(row["seed"]),
        time_limit=float(row["time_limit"]),
        background=int(row.get("background") or 0),
        cost=_number(row.get("cost")) if valid else None,
        bound=_number(row.get("bound")),
        best=_number(row.get("best")),
    )


def read_cases(folders: Sequence[Path]) -> list[Case]:
    """Every row of the folders (a case given twice: the later one) with its trace."""
    cases: dict[CaseKey, Case] = {}
    for folder in folders:
        for k, row in enumerate(_rows(folder)):
            try:
                case = _case(row)
            except ValueError:
                raise LayerwiseError(
                    f"{folder}: row {k + 1} has a seed, time limit, background, cost, bound "
                    "or best that is not a number"
                ) from None
            valid = str(row.get("valid", "yes")) == "yes"
            path = folder / TRACES / trace_name(case.key)
            if valid and path.exists():  # an answer the re-check refused: nor its trace
                trace = read_json_checked(path, "trace")
                offset = float(trace.get("offset", 0.0))
                case.incumbent = shifted(trace.get("incumbent", []), offset, case.time_limit)
                case.bounds = shifted(trace.get("bound", []), offset, case.time_limit)
            cases[case.key] = case
    out = list(cases.values())
    # the limit names a solver only when an instance ran at several (the contest's limits
    # differ by instance: at each one's own limit, a backend is one solver)
    limits: dict[str, set[float]] = {}
    for c in out:
        limits.setdefault(c.instance, set()).add(c.time_limit)
    several = any(len(v) > 1 for v in limits.values())
    loads = {c.background for c in out}
    for c in out:
        c.label = c.backend + (f" {c.time_limit:g}s" if several else "")
        c.label += f" bg{c.background}" if len(loads) > 1 else ""
    return out


def references(cases: Iterable[Case]) -> dict[str, float]:
    """Per instance: the best of the best-known cost and every case's answer."""
    out: dict[str, float] = {}
    for c in cases:
        for v in (c.best, c.cost):
            if v is not None and math.isfinite(v):
                out[c.instance] = min(out.get(c.instance, math.inf), v)
    return out


# ----------------------------------------------------------------------------- summary


def _or(x: float | None, default: float) -> float:
    return default if x is None else float(x)


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def summary(cases: Sequence[Case]) -> list[dict[str, Any]]:
    """Per (instance, solver): the seeds' median, min and max of each metric (module
    docstring; a time never reached and a missing answer count as infinite)."""
    ref = references(cases)
    groups: dict[tuple[str, str], list[Case]] = defaultdict(list)
    for c in cases:
        groups[(c.instance, c.label)].append(c)
    out = []
    for (inst, label), group in sorted(groups.items()):
        best = ref.get(inst)
        per: dict[str, list[float]] = defaultdict(list)
        for c in group:
            m = case_metrics(c.incumbent, c.bounds, best, c.time_limit)
            cost = math.inf if c.cost is None else c.cost
            per["ratio"].append(cost / best if best else math.nan)
            per["gap"].append(cost / c.bound - 1 if c.bound and c.bound > 0 else math.inf)
            for k in ("time_to_1pct", "time_to_0_1pct"):  # never: infinite
                per[k].append(_or(m[k], math.inf))
            for k in ("primal_integral_norm", "primal_dual_integral_norm"):  # no best: NaN
                per[k].append(_or(m[k], math.nan))
        row: dict[str, Any] = {"instance": inst, "solver": label, "seeds": len(group)}
        for k, vs in per.items():
            row[f"{k}_median"] = _median(vs)
            row[f"{k}_min"] = min(vs)
            row[f"{k}_max"] = max(vs)
        out.append(row)
    return out


METRICS = (  # key, column title, format, what an infinite value means
    ("ratio", "cost / best", "{:.4f}", "no answer"),
    ("gap", "gap", "gap", "-"),
    ("time_to_1pct", "t 1% s", "{:.1f}", "never"),
    ("time_to_0_1pct", "t 0.1% s", "{:.1f}", "never"),
    ("primal_integral_norm", "primal int. / T", "{:.4f}", "-"),
    ("primal_dual_integral_norm", "primal-dual int. / T", "{:.4f}", "-"),
)


def format_gap(gap: float | None) -> str:
    """A gap cost / bound - 1 as a percentage, or past 1000% the ratio cost / bound (a
    trivial bound); "-" for none."""
    if gap is None:
        return "-"
    return f"{gap:.2%}" if gap < 10 else f"{gap + 1:.3g}x"


def _cell(x: float, spec: str, infinite: str) -> str:
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return infinite
    return format_gap(x) if spec == "gap" else spec.format(x)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table: median [min, max] over the seeds."""
    head = ["instance", "solver", "seeds", *(title for _, title, _, _ in METRICS)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [r["instance"], r["solver"], str(r["seeds"])]
        for key, _, spec, infinite in METRICS:
            med, lo, hi = (_cell(r[f"{key}_{s}"], spec, infinite) for s in ("median", "min", "max"))
            cells.append(med if r["seeds"] == 1 else f"{med} [{lo}, {hi}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_csv(rows: Sequence[dict[str, Any]]) -> str:
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return buf.getvalue()


# ----------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_profile(ratios: dict[str, list[float]], title: str, path: Path) -> None:
    """rho_s(tau) for every solver, a step function of tau on a log2 axis."""
    plt = _pyplot()
    finite = [r for rs in ratios.values() for r in rs if math.isfinite(r)]
    top = max(2.0, max(finite, default=1.0) * 1.5)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = ("-", "--", ":", "-.")
    for k, (s, rs) in enumerate(sorted(ratios.items())):
        taus = [1.0, *sorted(r for r in rs if math.isfinite(r)), top]
        # solvers on the same steps stay visible: each thinner, in its own line style
        ax.step(taus, [rho(rs, t) for t in taus], where="post", label=s,
                ls=styles[k % len(styles)], lw=max(3.0 - 0.5 * k, 1.0))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlim(1.0, top)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("tau (ratio to the best solver on the instance)")
    ax.set_ylabel("share of instances with ratio <= tau")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.11, right=0.97, bottom=0.12, top=0.87)  # tight_layout: 2x slower
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _steps(points: Sequence[tuple[float, float]], end: float) -> tuple[list[float], list[float]]:
    """A step function's points extended to `end` (for `step(where="post")`)."""
    xs = [max(t, TIME_FLOOR) for t, _ in points]
    ys = [v for _, v in points]
    if points and end > xs[-1]:
        xs.append(end)
        ys.append(ys[-1])
    return xs, ys


def plot_curves(instance: str, cases: Sequence[Case], best: float | None, path: Path) -> None:
    """Incumbent and bound over time of every case of one instance (module docstring)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(7.2, 6.4), sharex=True)
    labels = sorted({c.label for c in cases})
    colors = {s: plt.get_cmap("tab10")(k % 10) for k, s in enumerate(labels)}
    end = max([c.time_limit for c in cases], default=1.0)
    for ax in axes:
        for c in sorted(cases, key=lambda c: (c.label, c.seed)):
            first = c.seed == min(d.seed for d in cases if d.label == c.label)
            for points, style, what in ((c.incumbent, "-", ""), (c.bounds, "--", " bound")):
                positive = [(t, v) for t, v in points if v > 0] if ax is axes[0] else points
                if not positive:
                    continue
                xs, ys = _steps(positive, c.time_limit)
                ax.step(xs, ys, where="post", ls=style, color=colors[c.label], lw=1.0,
                        alpha=0.8, label=f"{c.label}{what}" if first else None)  # fmt: skip
        if best is not None:
            ax.axhline(
                best, color="black", lw=0.8, ls=":", label="best known" if ax is axes[0] else None
            )
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    values = [v for c in cases for _, v in (*c.incumbent, *c.bounds) if v > 0]
    if values and max(values) / min(values) > 10:
        axes[0].set_yscale("log")
    first = [c.incumbent[0][0] for c in cases if c.incumbent]
    axes[0].set_xlim(max(TIME_FLOOR, 0.8 * min(first, default=TIME_FLOOR)), end)
    if best is not None and best > 0:
        # the end game: from below the best known to ZOOM above it, or to the best final
        # answer when none ends within ZOOM (the others are in the upper panel)
        lowest = min((c.incumbent[-1][1] for c in cases if c.incumbent), default=best)
        top = max(best * (1 + ZOOM), lowest * (1 + ZOOM / 5))
        axes[1].set_ylim(best * (1 - ZOOM / 2), top)
        axes[1].set_title(
            f"the end: {top / best - 1:.1%} above the best known to below it", fontsize=9
        )
    axes[0].set_title(
        f"{instance}: incumbent (solid) and bound (dashed) per backend and seed", fontsize=10
    )
    axes[0].set_ylabel("cost")
    axes[1].set_ylabel("cost")
    axes[1].set_xlabel("seconds on the case's clock (loading included)")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7, loc="upper right")
    if not any(c.incumbent or c.bounds for c in cases):
        axes[0].text(0.5, 0.5, "no trace", transform=axes[0].transAxes, ha="center")
    fig.subplots_adjust(left=0.13, right=0.95, bottom=0.08, top=0.95, hspace=0.18)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# ----------------------------------------------------------------------------- the report


def report(folders: Sequence[Path], out: Path | None = None) -> list[Path]:
    """Read the folders' rows and traces; write the profiles, the curves and the summary
    (module docstring) to `out` (default: the first folder). Returns the files written."""
    from planner.files import write_text_atomic

    out = out or folders[0]
    out.mkdir(parents=True, exist_ok=True)
    cases = read_cases(folders)
    ref = references(cases)
    written: list[Path] = []
    rows = summary(cases)
    for name, text in (("anytime.csv", summary_csv(rows)), ("anytime.md", markdown(rows))):
        write_text_atomic(out / name, text)
        written.append(out / name)
    if not cases:
        return written
    cost: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    reach: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cases:
        best = ref.get(c.instance)
        cost[c.instance][c.label].append(c.cost if c.cost is not None else math.inf)
        t = None if best is None else time_to_target(c.incumbent, best, TARGETS[0], c.time_limit)
        reach[c.instance][c.label].append(math.inf if t is None else t)
    for metric, name, title in (
        (cost, "profile-cost.png", "final cost"),
        (reach, "profile-time-1pct.png", "time to within 1% of the best known"),
    ):
        medians = {i: {s: _median(v) for s, v in row.items()} for i, row in metric.items()}
        instances, ratios = performance_profile(medians)
        plot_profile(
            ratios,
            f"Performance profile (Dolan and More 2002): {title}\n"
            f"seeds' median per instance, {len(instances)} instances",
            out / name,
        )
        written.append(out / name)
    by_instance: dict[str, list[Case]] = defaultdict(list)
    for c in cases:
        by_instance[c.instance].append(c)
    for inst, group in sorted(by_instance.items()):
        path = out / f"curve-{inst}.png"
        plot_curves(inst, group, ref.get(inst), path)
        written.append(path)
    return written


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(
        prog="python -m experiments.anytime",
        description="Anytime report of experiments.iopddl results folders: performance "
        "profiles, cost-over-time curves and a per-(instance, backend) summary over seeds.",
    )
    p.add_argument("folders", type=Path, nargs="+", help="results folders (rows.json, traces/)")
    p.add_argument("--out", type=Path, help="folder for the report (default: the first folder)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from planner.cli.args import report_errors

    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    for folder in args.folders:
        if not folder.is_dir():
            raise LayerwiseError(
                f"{folder} is not a folder: give results folders of experiments.iopddl"
            )
        _rows(folder)  # one that holds no rows: one error line before any work
    for path in report(args.folders, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
