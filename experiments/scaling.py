"""`python -m experiments.scaling`: how planning grows with the cluster, 4 to 1,024 GPUs.

For every model and device preset, in a fresh subprocess (so peak RSS is the case's own and a
case that runs away can be stopped): capture the graph with a per-device batch (default 32,
as OptCNN), simulate data parallelism in full (FlexFlow Alg. 1), build the Problem (the
config space, `--space` passed to `build_problem` where it takes one), solve it with
`elimination` (OptCNN Alg. 1) and any `--backends`, simulate the found strategy, and record:
configs per op, cost-table entries, seconds per phase, status and gap, simulated iteration
time and its speedup over data parallelism, and peak RSS. A case that passes `--case-timeout`
or `--memory-cap` is stopped; the phases it finished are kept.

Writes `scaling.csv`, `scaling.json` and a log-log plot of seconds and peak memory against the
device count, with the least-squares growth exponent of each line in its legend
(`scaling.png`), to `--out` (default results/scaling). The default is a quick run (a few
minutes); `--full` is the docs' table (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.cli.args import (
    OneLineArgumentParser,
    one_line,
    positive_int,
    positive_number,
    positive_seconds,
)
from planner.errors import LayerwiseError

EXIT_BAD_INPUT = 2
QUICK_MODELS = ["inception_v3", "resnet101", "transformer"]
FULL_MODELS = ["inception_v3", "resnet101", "vgg16", "transformer", "nmt"]
QUICK_DEVICES = [4, 16]
FULL_DEVICES = [4, 16, 64, 256, 1024]
FAMILIES = ("p100", "dgx")
BACKENDS = ("search", "mcmc", "ilp", "cpsat")
log = logging.getLogger("experiments.scaling")


def preset_for(family: str, devices: int) -> str | None:
    """The preset of a family with `devices` GPUs (None when the family has no such size)."""
    if family == "p100":
        return f"p100-{devices // 4}x4" if devices % 4 == 0 else None
    return f"dgx-a100-{devices // 8}" if devices % 8 == 0 else None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.scaling", description=__doc__)
    p.add_argument("--models", nargs="+", help=f"zoo models (quick: {' '.join(QUICK_MODELS)})")
    p.add_argument("--devices", nargs="+", type=positive_int, help="device counts (quick: 4 16)")
    p.add_argument(
        "--families",
        nargs="+",
        choices=FAMILIES,
        help="p100: p100-(D/4)x4; dgx: dgx-a100-(D/8) (quick: p100)",
    )
    p.add_argument("--full", action="store_true", help="the docs' run: every model and size")
    p.add_argument("--per-device-batch", type=positive_int, default=32)
    p.add_argument(
        "--space",
        default=None,
        choices=("full", "mesh", "auto"),
        help="config space for build_problem (default: its auto)",
    )
    p.add_argument("--max-configs", type=positive_int, default=None)
    p.add_argument(
        "--backends", nargs="*", default=[], choices=BACKENDS, help="besides elimination"
    )
    p.add_argument("--time-limit", type=positive_seconds, default=300.0, help="per solve")
    p.add_argument("--case-timeout", type=positive_seconds, default=None, help="per case")
    p.add_argument("--memory-cap", type=positive_number, default=12.0, help="GiB of RSS per case")
    p.add_argument("--out", type=Path, default=Path("results/scaling"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--case", nargs=2, metavar=("MODEL", "PRESET"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = args.models or (FULL_MODELS if args.full else QUICK_MODELS)
    args.devices = args.devices or (FULL_DEVICES if args.full else QUICK_DEVICES)
    args.families = args.families or (list(FAMILIES) if args.full else ["p100"])
    args.case_timeout = args.case_timeout or (1800.0 if args.full else 600.0)
    from planner.graph.zoo import MODELS

    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown model(s) {unknown}; available: {', '.join(MODELS)}")
    return args


# -- one case, in its own process ---------------------------------------------------------------


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_case(model: str, preset: str, args: argparse.Namespace) -> None:
    """Measure one (model, preset) and print a JSON record after every phase."""
    from backends import SolveOptions, get_backend
    from planner.costs.costmodel import CostModel
    from planner.graph.zoo import model_graph
    from planner.hardware.presets import get_preset
    from planner.problems.baselines import data_parallel
    from planner.problems.problem import build_problem
    from planner.sim.simulator import Simulator

    rec: dict[str, Any] = {"model": model, "preset": preset, "phase": "devices"}

    def done(phase: str, **values: Any) -> None:
        rec.update(values, phase=phase, peak_rss_gib=round(_rss_gib(), 3))
        print(json.dumps(rec), flush=True)

    t = time.perf_counter()
    devices = get_preset(preset)
    D = devices.num_devices
    done("devices", devices=D, devices_seconds=time.perf_counter() - t)
    t = time.perf_counter()
    graph = model_graph(model, batch=args.per_device_batch * D)
    done(
        "graph",
        batch=args.per_device_batch * D,
        ops=len(graph.ops),
        graph_seconds=time.perf_counter() - t,
    )
    cm = CostModel(graph, devices)
    t = time.perf_counter()
    dp = Simulator(cm, data_parallel(graph, devices).configs)
    done(
        "simulate_dp",
        dp_ms=dp.makespan * 1e3,
        dp_tasks=dp.num_tasks,
        dp_sim_seconds=time.perf_counter() - t,
    )
    del dp
    kwargs: dict[str, Any] = {"max_configs": args.max_configs}
    if args.space is not None:
        kwargs["space"] = args.space
    t = time.perf_counter()
    problem = build_problem(graph, devices, cm, **kwargs)
    sizes = problem.sizes
    done(
        "build",
        space=problem.space_kind or "-",
        nodes=problem.num_nodes,
        configs_max=max(sizes),
        configs_median=statistics.median(sizes),
        table_entries=int(sum(t.size for t in problem.edge_cost) + sum(sizes)),
        distinct_tables=_distinct(problem),
        build_seconds=time.perf_counter() - t,
    )
    best = None
    for name in ["elimination", *args.backends]:
        objective = "makespan" if name == "mcmc" else "additive"
        opts = SolveOptions(objective=objective, time_limit=args.time_limit)
        t = time.perf_counter()
        result = get_backend(name).solve(problem, opts)
        gap = result.gap
        done(
            f"solve_{name}",
            **{
                f"{name}_seconds": time.perf_counter() - t,
                f"{name}_status": result.status.value
                + (f"/{result.limit.value}" if result.limit else ""),
                f"{name}_gap": None if gap is None else gap,
                f"{name}_objective": result.objective,
            },
        )
        if name == "elimination":
            best = result
    if best is not None and best.choices is not None:
        t = time.perf_counter()
        found = Simulator(cm, problem.strategy(best.choices).configs)
        found_ms = found.makespan * 1e3
        done(
            "simulate_found",
            found_ms=found_ms,
            found_tasks=found.num_tasks,
            found_sim_seconds=time.perf_counter() - t,
            speedup_over_dp=rec["dp_ms"] / found_ms,
        )


def _distinct(problem: Any) -> str:
    """distinct / total cost tables (node and edge), by array identity."""
    tables = [*problem.node_cost, *problem.edge_cost]
    return f"{len({id(t) for t in tables})}/{len(tables)}"


# -- the driver -----------------------------------------------------------------------------------


def _child_args(model: str, preset: str, args: argparse.Namespace) -> list[str]:
    out = [sys.executable, "-m", "experiments.scaling", "--case", model, preset]
    out += ["--per-device-batch", str(args.per_device_batch), "--time-limit", str(args.time_limit)]
    if args.space is not None:
        out += ["--space", args.space]
    if args.max_configs is not None:
        out += ["--max-configs", str(args.max_configs)]
    if args.backends:
        out += ["--backends", *args.backends]
    return out


def _rss_of(pid: int) -> float:
    """Current RSS of a process in GiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def measure(model: str, preset: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one case in a subprocess under the time and memory caps; its last record."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        _child_args(model, preset, args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    peak, outcome = 0.0, "ok"
    while proc.poll() is None:
        peak = max(peak, _rss_of(proc.pid))
        if time.perf_counter() - start > args.case_timeout:
            outcome = f"stopped: over {args.case_timeout:g} s"
        elif peak > args.memory_cap:
            outcome = f"stopped: over {args.memory_cap:g} GiB"
        if outcome != "ok":
            proc.kill()
            break
        time.sleep(0.25)
    stdout, stderr = proc.communicate()
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    rec = records[-1] if records else {"model": model, "preset": preset, "phase": "none"}
    if outcome == "ok" and proc.returncode != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        outcome = f"failed: {lines[-1] if lines else proc.returncode}"
    rec["outcome"] = outcome
    rec["peak_rss_gib"] = round(max(peak, rec.get("peak_rss_gib", 0.0)), 3)
    rec["case_seconds"] = time.perf_counter() - start
    return rec


COLUMNS = [
    "model", "preset", "devices", "batch", "outcome", "phase", "space", "ops", "nodes",
    "configs_max", "configs_median", "table_entries", "distinct_tables", "devices_seconds",
    "graph_seconds", "build_seconds", "elimination_seconds", "elimination_status",
    "elimination_gap", "dp_sim_seconds", "dp_tasks", "found_sim_seconds", "found_tasks",
    "dp_ms", "found_ms", "speedup_over_dp", "peak_rss_gib", "case_seconds",
]  # fmt: skip


def save(rows: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    columns = COLUMNS + sorted({k for r in rows for k in r} - set(COLUMNS))
    with open(args.out / "scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    meta = {k: str(v) for k, v in vars(args).items() if k != "case"}
    meta["load_average"] = os.getloadavg()
    (args.out / "scaling.json").write_text(json.dumps({"args": meta, "rows": rows}, indent=1))
    if not args.no_plot:
        plot(rows, args.out / "scaling.png")
    return args.out


def growth(devices: Sequence[float], values: Sequence[float]) -> float | None:
    """Least-squares slope of log(value) against log(devices): value ~ devices^slope."""
    pts = [(math.log(d), math.log(v)) for d, v in zip(devices, values, strict=True) if v and v > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("seconds", [("build_seconds", "build", "-"), ("elimination_seconds", "elimination", "--"),
                     ("dp_sim_seconds", "simulate DP", ":")]),
        ("peak RSS (GiB)", [("peak_rss_gib", "peak RSS", "-")]),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    series = sorted({(r["model"], r["preset"].split("-")[0]) for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (ylabel, lines) in zip(axes, panels, strict=True):
        for s, (model, family) in enumerate(series):
            mine = sorted(
                (r for r in rows if r["model"] == model and r["preset"].startswith(family)),
                key=lambda r: r.get("devices", 0),
            )
            for field, what, style in lines:
                pts = [(r["devices"], r[field]) for r in mine if r.get(field) and r.get("devices")]
                if not pts:
                    continue
                k = growth([d for d, _ in pts], [v for _, v in pts])
                slope = f", D^{k:.2f}" if k is not None else ""
                ax.plot(*zip(*pts, strict=True), style, marker="o", color=colors[s % len(colors)],
                        label=f"{model} ({family}) {what}{slope}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("devices")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.suptitle("layerwise at scale (least-squares growth exponent in each legend)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def report(rec: dict[str, Any]) -> str:
    keys = ("devices", "configs_max", "build_seconds", "elimination_seconds",
            "elimination_status", "dp_sim_seconds", "speedup_over_dp", "peak_rss_gib")  # fmt: skip
    values = ", ".join(f"{k} {_fmt(rec.get(k))}" for k in keys if k in rec)
    return f"{rec['model']} on {rec['preset']}: {rec['outcome']} after {rec['phase']}; {values}"


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        args = parse_args(argv)
        if args.case is not None:
            run_case(*args.case, args)
            return 0
        cases = [
            (model, preset)
            for model in args.models
            for family in args.families
            for d in args.devices
            if (preset := preset_for(family, d)) is not None
        ]
        rows = []
        for k, (model, preset) in enumerate(cases, 1):
            log.info("[%d/%d] %s on %s ...", k, len(cases), model, preset)
            rows.append(measure(model, preset, args))
            log.info("  %s", report(rows[-1]))
        folder = save(rows, args)
    except (LayerwiseError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    log.info("results written to %s", folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
