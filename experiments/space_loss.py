"""`python -m experiments.space_loss`: what the mesh config space costs against the full one.

For each model and cluster, the additive optimum (OptCNN Eq. 1, proven by the `elimination`
backend) in the full space and in the mesh space (docs/space.md), the loss of the mesh
optimum in %, configs per op, and the build and solve seconds of each. Prints a progress line
per case, a table at the end, and writes a CSV (default results/space_loss.csv). A loss is
only reported when both optima are proven (status OPTIMAL).
"""

from __future__ import annotations

import csv
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backends import SolveOptions, get_backend
from planner.cli.args import OneLineArgumentParser, positive_int, positive_seconds
from planner.errors import LayerwiseError
from planner.graph.zoo import MODELS, model_graph
from planner.hardware.presets import load_devices
from planner.problems.problem import build_problem

CNNS = ["lenet5", "alexnet", "vgg16", "inception_v3", "resnet101"]
PRESETS = ["p100-4x4", "p100-8x4"]
COLUMNS = [
    "model",
    "devices",
    "batch",
    "full_configs_max",
    "mesh_configs_max",
    "full_configs_mean",
    "mesh_configs_mean",
    "full_optimum_ms",
    "mesh_optimum_ms",
    "loss_pct",
    "full_status",
    "mesh_status",
    "full_build_s",
    "mesh_build_s",
    "full_solve_s",
    "mesh_solve_s",
]


def _parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m experiments.space_loss", description=__doc__)
    p.add_argument("--models", nargs="+", default=CNNS, help=f"zoo models (default {CNNS})")
    p.add_argument("--presets", nargs="+", default=PRESETS, help=f"clusters (default {PRESETS})")
    p.add_argument(
        "--per-device-batch",
        type=positive_int,
        help="batch = this x devices (default: each model's own batch)",
    )
    p.add_argument(
        "--max-split-dims", type=positive_int, help="the mesh space's split-dims cap (default 2)"
    )
    p.add_argument(
        "--time-limit",
        type=positive_seconds,
        default=600.0,
        help="seconds per elimination run (default 600)",
    )
    p.add_argument(
        "--output", type=Path, default=Path("results/space_loss.csv"), help="the CSV to write"
    )
    return p


def _solve(graph: Any, devices: Any, kind: str, args: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    split = args.max_split_dims if kind == "mesh" else None  # the full space stays whole
    problem = build_problem(graph, devices, space=kind, table_budget=None, max_split_dims=split)
    build = time.perf_counter() - t0
    result = get_backend("elimination").solve(
        problem, SolveOptions(objective="additive", time_limit=args.time_limit, seed=0)
    )
    return {
        "configs_max": max(problem.sizes),
        "configs_mean": statistics.mean(problem.sizes),
        "optimum_ms": None if result.objective is None else result.objective * 1e3,
        "status": result.status.value,
        "build_s": build,
        "solve_s": result.stats.get("search_seconds", 0.0),
    }


def run_case(model: str, preset: str, args: Any) -> dict[str, Any]:
    devices = load_devices(preset)
    batch = None if args.per_device_batch is None else args.per_device_batch * devices.num_devices
    graph = model_graph(model, batch=batch)
    row: dict[str, Any] = {"model": model, "devices": preset, "batch": graph.ops[0].output.sizes[0]}
    for kind in ("full", "mesh"):
        for key, value in _solve(graph, devices, kind, args).items():
            row[f"{kind}_{key}"] = value
    proven = row["full_status"] == row["mesh_status"] == "OPTIMAL"
    row["loss_pct"] = (
        100.0 * (row["mesh_optimum_ms"] / row["full_optimum_ms"] - 1.0) if proven else None
    )
    return row


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        unknown = [m for m in args.models if m not in MODELS]
        if unknown:
            raise LayerwiseError(f"unknown model(s) {unknown}; zoo models: {sorted(MODELS)}")
        for preset in args.presets:
            load_devices(preset)  # bad presets fail before any work
    except LayerwiseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for model in args.models:
        for preset in args.presets:
            print(f"[space_loss] {model} on {preset} ...", flush=True)
            try:
                row = run_case(model, preset, args)
            except LayerwiseError as exc:  # e.g. a table budget or memory guard
                print(f"[space_loss] {model} on {preset}: skipped ({exc})", flush=True)
                continue
            rows.append(row)
            print(
                f"[space_loss] {model} on {preset}: full {_fmt(row['full_optimum_ms'])} ms "
                f"({row['full_status']}, {row['full_configs_max']} configs/op max), mesh "
                f"{_fmt(row['mesh_optimum_ms'])} ms ({row['mesh_status']}, "
                f"{row['mesh_configs_max']}), loss {_fmt(row['loss_pct'], '.3f')} %",
                flush=True,
            )
            with args.output.open("w", newline="") as f:  # rewritten after every case
                writer = csv.DictWriter(f, fieldnames=COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
    _print_table(rows)
    print(f"[space_loss] wrote {args.output}")
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    t = Table(title="Mesh vs full config space: additive optimum (elimination)")
    for col in ("model", "devices", "configs/op max full/mesh", "optimum ms full", "mesh",
                "loss %", "build s full/mesh", "solve s full/mesh"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("model", "devices") else "right")
    for r in rows:
        t.add_row(
            r["model"],
            r["devices"],
            f"{r['full_configs_max']} / {r['mesh_configs_max']}",
            _fmt(r["full_optimum_ms"]),
            _fmt(r["mesh_optimum_ms"]),
            _fmt(r["loss_pct"]),
            f"{r['full_build_s']:.1f} / {r['mesh_build_s']:.1f}",
            f"{r['full_solve_s']:.1f} / {r['mesh_solve_s']:.1f}",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


if __name__ == "__main__":
    raise SystemExit(main())
