"""`python -m experiments.build_speed`: configs per op and Problem build time per model/preset.

Prints one table: ops, edges, candidate configs per op (min / median / max, and the total),
the edge cost-table entries, and the seconds to build the node tables and the edge tables.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from planner.cli.args import OneLineArgumentParser, positive_int, report_errors, zoo_model
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.problem import build_problem


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment; bad arguments are one `error:` line and exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = OneLineArgumentParser(prog="python -m experiments.build_speed", description=__doc__)
    models = ["alexnet", "vgg16", "inception_v3", "resnet101"]
    p.add_argument("--models", nargs="+", default=models, type=zoo_model)
    p.add_argument("--presets", nargs="+", default=["p100-1x4", "p100-4x4"])
    p.add_argument("--max-configs", type=positive_int, default=None)
    args = p.parse_args(argv)
    t = Table(title="Problem build (cost tables) on this machine")
    for col in (
        "model",
        "devices",
        "ops",
        "edges",
        "configs/op min/med/max",
        "total configs",
        "edge entries",
        "graph s",
        "nodes s",
        "edges s",
    ):
        t.add_column(col, justify="left" if col in ("model", "devices") else "right")
    for model in args.models:
        t0 = time.perf_counter()
        graph = model_graph(model)
        graph_s = time.perf_counter() - t0
        for preset in args.presets:
            problem = build_problem(graph, get_preset(preset), max_configs=args.max_configs)
            sizes = problem.sizes
            entries = sum(c.size for c in problem.edge_cost)
            t.add_row(
                model,
                preset,
                str(len(sizes)),
                str(len(problem.edges)),
                f"{min(sizes)} / {statistics.median(sizes):g} / {max(sizes)}",
                str(sum(sizes)),
                f"{entries:,}",
                f"{graph_s:.2f}",
                f"{problem.stats['node_seconds']:.2f}",
                f"{problem.stats['edge_seconds']:.2f}",
            )
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
