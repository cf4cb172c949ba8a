"""`python -m experiments.space_build`: Problem build time and memory at scale, per config space.

Each case (model x cluster) runs in a fresh process so its peak RSS (`resource.getrusage`) is
its own: capture the graph at 32 samples per device (OptCNN's per-GPU batch; `--per-device-
batch`), build the device graph, build the Problem in `--space` (default mesh) and, with
`--solve`, run `elimination` on it. Prints a line per case and a table; writes a CSV
(default results/space_build.csv). `experiments.scaling` covers the whole pipeline
(simulation, speedups); this one isolates the cost tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from planner.cli import OneLineArgumentParser, positive_int, positive_seconds
from planner.errors import LayerwiseError
from planner.graph.zoo import MODELS

DEFAULT_MODELS = ["inception_v3", "resnet101", "transformer", "vgg16", "nmt"]
DEFAULT_PRESETS = ["p100-16x4", "p100-64x4", "p100-256x4"]
COLUMNS = [
    "model", "devices", "space", "batch", "configs_max", "edge_tables", "edge_tables_distinct",
    "table_mib", "capture_s", "devices_s", "build_s", "build_cpu_s", "estimated_s", "solve_s",
    "status", "peak_rss_gib", "error",
]  # fmt: skip


def case(
    model: str, preset: str, space: str, per_device: int, solve: float | None
) -> dict[str, Any]:
    """One case, in this process (the parent runs it in a child for a clean RSS)."""
    from planner.graph.zoo import model_graph
    from planner.hardware.presets import load_devices
    from planner.problems.problem import build_problem

    row: dict[str, Any] = {"model": model, "devices": preset, "space": space}
    t0 = time.perf_counter()
    devices = load_devices(preset)
    row["devices_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = model_graph(model, batch=per_device * devices.num_devices)
    row["capture_s"] = time.perf_counter() - t0
    row["batch"] = per_device * devices.num_devices
    t0, c0 = time.perf_counter(), time.process_time()
    problem = build_problem(graph, devices, space=space, table_budget=None)
    row["build_s"] = time.perf_counter() - t0
    row["build_cpu_s"] = time.process_time() - c0
    s = problem.stats
    row["space"] = problem.space_kind
    row["configs_max"] = int(s["configs_max"])
    row["edge_tables"] = int(s["edge_tables"])
    row["edge_tables_distinct"] = int(s["edge_tables_distinct"])
    row["table_mib"] = s["table_bytes"] / 2**20
    row["estimated_s"] = s["estimated_seconds"]
    if solve is not None:
        from backends import SolveOptions, get_backend

        result = get_backend("elimination").solve(problem, SolveOptions(time_limit=solve))
        row["solve_s"] = result.stats.get("search_seconds")
        row["status"] = result.status.value
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def _parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m experiments.space_build", description=__doc__)
    p.add_argument("--models", nargs="+", default=DEFAULT_MODELS)
    p.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS)
    p.add_argument("--space", choices=["auto", "full", "mesh"], default="mesh")
    p.add_argument("--per-device-batch", type=positive_int, default=32)
    p.add_argument(
        "--solve", type=positive_seconds, help="also run elimination with this time limit"
    )
    p.add_argument(
        "--timeout", type=positive_seconds, default=1800.0, help="seconds per case (child)"
    )
    p.add_argument("--output", type=Path, default=Path("results/space_build.csv"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        unknown = [m for m in args.models if m not in MODELS]
        if unknown:
            raise LayerwiseError(f"unknown model(s) {unknown}; zoo models: {sorted(MODELS)}")
    except LayerwiseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.child:
        row = case(args.models[0], args.presets[0], args.space, args.per_device_batch, args.solve)
        print(json.dumps(row))
        return 0
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:
        for model in args.models:
            print(f"[space_build] {model} on {preset} ({args.space}) ...", flush=True)
            row = _run_child(model, preset, args)
            rows.append(row)
            print(f"[space_build] {_line(row)}", flush=True)
            with args.output.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
    _table(rows)
    print(f"[space_build] wrote {args.output}")
    return 0


def _run_child(model: str, preset: str, args: Any) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "experiments.space_build", "--child", "--models", model,
           "--presets", preset, "--space", args.space,
           "--per-device-batch", str(args.per_device_batch)]  # fmt: skip
    if args.solve is not None:
        cmd += ["--solve", str(args.solve)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "devices": preset, "error": f"timeout {args.timeout:g} s"}
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not lines:
        tail = (run.stderr.strip().splitlines() or ["?"])[-1]
        return {"model": model, "devices": preset, "error": tail[:200]}
    row: dict[str, Any] = json.loads(lines[-1])
    return row


def _line(r: dict[str, Any]) -> str:
    if r.get("error"):
        return f"{r['model']} on {r['devices']}: {r['error']}"
    solve = f", elimination {r['solve_s']:.1f} s {r['status']}" if r.get("solve_s") else ""
    return (
        f"{r['model']} on {r['devices']} ({r['space']}): {r['configs_max']} configs/op max, "
        f"{r['edge_tables_distinct']}/{r['edge_tables']} edge tables, build {r['build_s']:.1f} s "
        f"(cpu {r['build_cpu_s']:.1f} s, estimate {r['estimated_s']:.0f} s){solve}, "
        f"peak RSS {r['peak_rss_gib']:.2f} GiB (devices {r['devices_s']:.1f} s, capture "
        f"{r['capture_s']:.1f} s)"
    )


def _table(rows: list[dict[str, Any]]) -> None:
    t = Table(title="Problem build at scale (32 samples per device)")
    for col in ("model", "devices", "space", "configs/op max", "edge tables", "build s",
                "cpu s", "solve s", "peak RSS GiB"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("model", "devices", "space") else "right")
    for r in rows:
        if r.get("error"):
            t.add_row(r["model"], r["devices"], "-", "-", "-", r["error"], "", "", "")
            continue
        t.add_row(
            r["model"], r["devices"], r["space"], str(r["configs_max"]),
            f"{r['edge_tables_distinct']}/{r['edge_tables']}", f"{r['build_s']:.1f}",
            f"{r['build_cpu_s']:.1f}", f"{r['solve_s']:.1f}" if r.get("solve_s") else "-",
            f"{r['peak_rss_gib']:.2f}",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(t)


if __name__ == "__main__":
    raise SystemExit(main())
