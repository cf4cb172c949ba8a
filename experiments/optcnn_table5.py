"""`python -m experiments.optcnn_table5`: OptCNN Table 5 (VGG-16 on 4 P100s) beside ours.

Runs `elimination` on vgg16 with a per-GPU batch of 32 (global 128) on `p100-1x4`, analytic
costs, and prints the configuration it chooses per layer group beside the one the paper
reports. Then it re-scores the paper's strategy under our cost model, so the difference in
the choices can be read as a difference in cost.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from backends import SolveOptions, get_backend
from planner.cli.args import OneLineArgumentParser, positive_int, report_errors
from planner.costs.config import ParallelConfig
from planner.graph.opgraph import Op, OpGraph
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.evaluate import score_strategy
from planner.problems.problem import build_problem
from planner.problems.strategy import Strategy

# The paper's Table 5, per group of layers (our copy of the paper lost the fourth conv row;
# its text says sample parallelism for the early blocks and height x width for the last
# three convolutions).
PAPER = [
    ("conv block 1 (2 conv + pool)", {"sample": 4}),
    ("conv block 2 (2 conv + pool)", {"sample": 4}),
    ("conv block 3 (3 conv + pool)", {"sample": 4}),
    ("conv block 4 (3 conv + pool)", {"sample": 4}),
    ("conv block 5 (3 conv + pool)", {"height": 2, "width": 2}),
    ("fully-connected 1", {"channel": 4}),
    ("fully-connected 2", {"channel": 4}),
    ("fully-connected 3", {"channel": 2}),
    ("softmax", {}),
]


def groups(graph: OpGraph) -> list[list[int]]:
    """Op indices per row of PAPER: five conv blocks (each ended by a pool; the adaptive
    average pool joins the fifth), the three linears, the softmax."""
    rows: list[list[int]] = [[] for _ in PAPER]
    block = linear = 0
    for i, op in enumerate(graph.ops):
        if op.kind == "linear":
            rows[5 + linear].append(i)
            linear += 1
        elif op.kind == "softmax":
            rows[8].append(i)
        elif op.kind != "input":
            rows[min(block, 4)].append(i)
            block += op.kind == "pool2d"
    return rows


def _config(op: Op, degrees: dict[str, int]) -> ParallelConfig:
    """The paper's degrees where they divide this op's dims, else sample over all 4 GPUs."""
    if any(op.output.size(d) % g for d, g in degrees.items() if d in op.output.dims):
        degrees = {"sample": 4}
    deg = tuple(degrees.get(d, 1) for d in op.output.dims)
    k = 1
    for g in deg:
        k *= g
    return ParallelConfig(deg, tuple(range(k)))


def paper_strategy(graph: OpGraph, devices: object) -> Strategy:
    configs: list[ParallelConfig | None] = [None] * len(graph.ops)
    configs[0] = _config(graph.ops[0], {"sample": 4})
    for (_, degrees), idx in zip(PAPER, groups(graph), strict=True):
        for i in idx:
            configs[i] = _config(graph.ops[i], degrees)
    return Strategy(graph, devices, tuple(c for c in configs if c is not None))  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment; bad arguments are one `error:` line and exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = OneLineArgumentParser(prog="python -m experiments.optcnn_table5", description=__doc__)
    p.add_argument("--per-gpu-batch", type=positive_int, default=32)
    args = p.parse_args(argv)
    devices = get_preset("p100-1x4")
    graph = model_graph("vgg16", batch=4 * args.per_gpu_batch)
    problem = build_problem(graph, devices)
    result = get_backend("elimination").solve(problem, SolveOptions())
    ours = result.strategy
    assert ours is not None
    paper = paper_strategy(graph, devices)
    t = Table(title=f"OptCNN Table 5: VGG-16, 4 P100s, batch {4 * args.per_gpu_batch}")
    for col in ("layers", "paper", "layerwise (elimination)"):
        t.add_column(col)
    for (label, degrees), idx in zip(PAPER, groups(graph), strict=True):
        mine = sorted({ours.configs[i].describe(graph.ops[i]) for i in idx})
        paper_text = ", ".join(f"{d}={g}" for d, g in degrees.items()) or "one GPU"
        t.add_row(
            f"{label}: {', '.join(graph.ops[i].name for i in idx)}", paper_text, "; ".join(mine)
        )
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(t)
    cm = problem.dnn().cost_model
    b_ours, b_paper = score_strategy(cm, ours), score_strategy(cm, paper)
    for name, b in (("layerwise", b_ours), ("paper's Table 5", b_paper)):
        console.print(
            f"{name:16s} t_O = {b.total * 1e3:8.2f} ms  (compute {b.compute * 1e3:.2f}, "
            f"sync {b.sync * 1e3:.2f}, transfer {b.transfer * 1e3:.2f})"
        )
    console.print(
        f"the paper's strategy is {b_paper.total / b_ours.total - 1:+.1%} under our model"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
