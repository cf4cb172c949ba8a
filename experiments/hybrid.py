"""`python -m experiments.hybrid --model M`: when does hybrid data x model parallelism win?

DLPlacer's projection (Pal et al. 2019, Sec. 3, Eqs. 2-6). With N data-parallel workers of
one device each, the speedup over one device is SU_N = SE_N x N x E_1 / E_N (Eq. 3); with N
workers of M devices each (M x N devices), SU_N^M = SU^M x SE_N x N x E_1 / E_N (Eq. 5), and
plain data parallelism on the same M x N devices gives SU_(MxN) (Eq. 4). Hybrid wins where
SU_N^M > SU_(MxN) (Eq. 6). Here:

- SU^M: layerwise's best M-way strategy against one device, both under the additive objective
  (OptCNN Eq. 1, the `elimination` backend's optimum) on M devices of one node of the family.
- SE_N = T_1 / (T_1 + AR_N): T_1 is the one-device step time (the same additive optimum on one
  device, per-device batch B) and AR_N the ring all-reduce of every parameter over N devices
  of the family's cluster preset (planner.costs.costmodel's t_s of a data-parallel config), not
  overlapped with compute. `--scaling one` takes SE_N = 1, the paper's assumption (Sec. 4.3).
- E_1 / E_N from an epochs-to-converge versus global-batch CSV (global batch = N x B;
  log-linear interpolation). The default, experiments/data/epochs_vs_batch.csv, is
  ILLUSTRATIVE, not measured.

Prints the table and the first device count where hybrid wins, and plots both curves.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends import SolveOptions, get_backend
from planner.cli.args import (
    OneLineArgumentParser,
    UsageError,
    positive_int,
    positive_seconds,
    report_errors,
)
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel
from planner.files import check_output_path
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import MODELS, model_graph
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.problem import build_problem

DEFAULT_EPOCHS = Path(__file__).parent / "data" / "epochs_vs_batch.csv"


@dataclass(frozen=True)
class Point:
    workers: int  # N
    devices: int  # M x N
    se_n: float
    se_mn: float
    epochs_n: float
    epochs_mn: float
    hybrid: float  # SU_N^M, Eq. 5
    data_parallel: float  # SU_(MxN), Eq. 4


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.hybrid", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="inception_v3", choices=sorted(MODELS))
    p.add_argument(
        "--m", type=positive_int, default=2, help="devices per model-parallel worker (2)"
    )
    p.add_argument("--family", default="p100", choices=["p100", "k80"], help="cluster presets")
    p.add_argument("--gpus-per-node", type=positive_int, default=4, help="devices per node (4)")
    p.add_argument("--max-devices", type=positive_int, default=256, help="largest M x N (256)")
    p.add_argument(
        "--batch", type=positive_int, default=None, help="per-device batch B (zoo default)"
    )
    p.add_argument("--epochs", type=Path, default=DEFAULT_EPOCHS, help="epochs vs batch CSV")
    p.add_argument("--scaling", choices=["model", "one"], default="model",
                   help="SE_N from the all-reduce model, or 1 as the paper assumes")  # fmt: skip
    p.add_argument("--time-limit", type=positive_seconds, default=60.0, help="elimination seconds")
    p.add_argument("--plot", type=Path, default=None, help="PNG (default results/hybrid-MODEL.png)")
    return p.parse_args(argv)


def preset(family: str, devices: int, per_node: int) -> DeviceGraph:
    """`devices` GPUs of the family: one node if they fit, else full nodes."""
    if devices <= per_node:
        return get_preset(f"{family}-1x{devices}")
    if devices % per_node:
        raise UsageError(f"{devices} devices do not fill nodes of {per_node}")
    return get_preset(f"{family}-{devices // per_node}x{per_node}")


def additive_time(graph: OpGraph, devices: DeviceGraph, time_limit: float) -> float:
    """The `elimination` optimum of OptCNN's Eq. 1 (seconds per step)."""
    problem = build_problem(graph, devices)
    result = get_backend("elimination").solve(problem, SolveOptions(time_limit=time_limit))
    return result.objective_value()


def allreduce_time(graph: OpGraph, devices: DeviceGraph) -> float:
    """Ring all-reduce of every op's parameters over all devices (data parallelism)."""
    cm = CostModel(graph, devices)
    n = devices.num_devices
    total = 0.0
    for i, op in enumerate(graph.ops):
        if op.params:
            degrees = tuple(n if d == "sample" else 1 for d in op.output.dims)
            total += cm.sync_time(i, ParallelConfig(degrees, tuple(range(n))))
    return total


def read_epochs(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(global batch, epochs) rows of the CSV, sorted; '#' lines are comments."""
    with path.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.lstrip().startswith("#")))
    if not rows or not {"global_batch", "epochs"} <= set(rows[0]):
        raise UsageError(f"{path}: needs columns global_batch,epochs")
    data = sorted((float(r["global_batch"]), float(r["epochs"])) for r in rows)
    batch, epochs = np.array(data).T
    return batch, epochs


def epochs_at(batch: float, table: tuple[np.ndarray, np.ndarray]) -> float:
    """Epochs at a global batch: log-linear interpolation, extrapolated past the ends."""
    xs, ys = np.log2(table[0]), table[1]
    x = math.log2(batch)
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))
    return float(np.interp(x, xs, ys))


def project(args: argparse.Namespace) -> tuple[float, list[Point], dict[str, float]]:
    graph = model_graph(args.model, batch=args.batch)
    batch = graph.ops[0].output.size("sample")
    t1 = additive_time(graph, preset(args.family, 1, args.gpus_per_node), args.time_limit)
    tm = additive_time(graph, preset(args.family, args.m, args.gpus_per_node), args.time_limit)
    su_m = t1 / tm
    table = read_epochs(args.epochs)
    e1 = epochs_at(batch, table)
    se: dict[int, float] = {}

    def scaling(n: int) -> float:
        if n not in se:
            if args.scaling == "one" or n == 1:
                se[n] = 1.0
            else:
                ar = allreduce_time(graph, preset(args.family, n, args.gpus_per_node))
                se[n] = t1 / (t1 + ar)
        return se[n]

    points = []
    n = 1
    while args.m * n <= args.max_devices:
        mn = args.m * n
        e_n, e_mn = epochs_at(n * batch, table), epochs_at(mn * batch, table)
        hybrid = su_m * scaling(n) * n * e1 / e_n  # Eq. 5
        data_parallel = scaling(mn) * mn * e1 / e_mn  # Eq. 4
        points.append(Point(n, mn, scaling(n), scaling(mn), e_n, e_mn, hybrid, data_parallel))
        n *= 2
    return su_m, points, {"t1": t1, "tm": tm, "batch": batch, "e1": e1}


def report(args: argparse.Namespace, su_m: float, points: list[Point], info: dict) -> int | None:
    print(f"{args.model}, per-device batch {info['batch']}, {args.family} presets, M = {args.m}")
    print(f"SU^M = T_1 / T_M = {info['t1'] * 1e3:.2f} ms / {info['tm'] * 1e3:.2f} ms = "
          f"{su_m:.3f} (elimination, additive objective)")  # fmt: skip
    print(f"E_1 = {info['e1']:.1f} epochs ({args.epochs}"
          f"{', ILLUSTRATIVE data' if args.epochs == DEFAULT_EPOCHS else ''})")  # fmt: skip
    print(f"{'N':>5} {'MxN':>5} {'SE_N':>6} {'SE_MN':>6} {'E_N':>6} {'E_MN':>6} "
          f"{'SU_N^M':>8} {'SU_MN':>8}  Eq. 6")  # fmt: skip
    first = None
    for p in points:
        wins = p.hybrid > p.data_parallel
        if wins and first is None:
            first = p.devices
        print(f"{p.workers:5d} {p.devices:5d} {p.se_n:6.3f} {p.se_mn:6.3f} {p.epochs_n:6.1f} "
              f"{p.epochs_mn:6.1f} {p.hybrid:8.2f} {p.data_parallel:8.2f}  "
              f"{'hybrid' if wins else 'data parallel'}")  # fmt: skip
    if first is None:
        print(f"data parallelism alone stays ahead up to {points[-1].devices} devices")
    else:
        print(f"hybrid ({args.m}-way model parallel workers) starts to win at {first} devices")
    return first


def plot(args: argparse.Namespace, points: list[Point], first: int | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = args.plot or Path("results") / f"hybrid-{args.model}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    x = [p.devices for p in points]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [p.data_parallel for p in points], "o-", label="data parallel, SU_(MxN)")
    ax.plot(x, [p.hybrid for p in points], "s-", label=f"hybrid, {args.m}-way MP x N DP, SU_N^M")
    if first is not None:
        ax.axvline(first, color="grey", linestyle=":", label=f"hybrid wins from {first}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices (M x N)")
    ax.set_ylabel("projected speedup over one device")
    title = f"{args.model}: DLPlacer Eqs. 4-6"
    if args.epochs == DEFAULT_EPOCHS:
        title += " (illustrative epochs data)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment; bad arguments are one `error:` line and exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    if args.m > args.gpus_per_node:
        raise UsageError(f"--m must be in 1..{args.gpus_per_node} (one node per worker)")
    if args.plot is not None:
        check_output_path(args.plot, "plot")
    su_m, points, info = project(args)
    first = report(args, su_m, points, info)
    print(f"plot: {plot(args, points, first)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
