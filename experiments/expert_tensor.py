"""`python -m experiments.expert_tensor`: one mixture-of-experts layer under expert tensor
parallelism, priced by the cost model.

The model (a zoo entry, one layer of it, bf16, coarsened) is laid out by Megatron-LM's rule
(`planner.problems.baselines.megatron`) for each (tensor, expert, expert tensor) triple of
`--layouts`: tensor parallelism T with sequence parallelism for the attention and the
norms, the moe op's experts spread E ways, and their hidden widths cut t ways (Megatron-Core's
`--expert-tensor-parallel-size`; "-" keeps `megatron`'s default: the moe op's tokens split
T ways, every expert whole). The training is Megatron-Core's (mixed-precision Adam, the
distributed optimizer as ZeRO 1, shaped kernel rates on Hopper, the performance recipe's
overlap, NCCL's rails). For each layout it prints the moe op's config, the busiest task's
forward and backward compute, one all-to-all pass (dispatch + combine), the reduction of
its partial sums into its consumer (a reduce-scatter: 0 without the cut), the layer's
simulated step and the peak memory per GPU. One layer: the gradient sync of its weights is
not hidden under other layers' backward as in a whole model's step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.cli.args import OneLineArgumentParser, positive_int, report_errors
from planner.errors import LayerwiseError

__all__ = ["DEFAULT_LAYOUTS", "Layout", "main", "measure", "parse_layout"]

Layout = tuple[int, int, int | None]  # tensor, expert, expert tensor (None: the default)
DEFAULT_LAYOUTS = ("2x8x-", "2x4x2", "2x8x2", "8x8x-", "8x8x8", "8x1x8")
MODELS = ("mixtral-8x7b", "qwen-moe-like")  # zoo entries whose first layer is a moe


def parse_layout(text: str) -> Layout:
    """'TxExt' (t '-': `megatron`'s default) -> (T, E, t); an argparse error otherwise."""
    parts = text.split("x")
    try:
        if len(parts) != 3:
            raise ValueError
        tensor, expert = int(parts[0]), int(parts[1])
        cut = None if parts[2] == "-" else int(parts[2])
        if min(tensor, expert, cut or 1) < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"layout {text!r} is not tensor x expert x expert-tensor (positive sizes), e.g. "
            "2x4x2 or 2x8x-"
        ) from None
    return tensor, expert, cut


def measure(
    model: str, preset: str, batch: int, seq: int, layouts: Sequence[Layout]
) -> list[dict[str, Any]]:
    """One record per layout (module docstring)."""
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.costs.overlap import FRAMEWORK_OVERLAP
    from planner.graph.capture import capture
    from planner.graph.coarsen import coarsen
    from planner.graph.llm import build_llm
    from planner.hardware.presets import get_preset
    from planner.problems.baselines import megatron
    from planner.sim.simulator import simulate

    module, inputs = build_llm(model, dtype="bfloat16", batch=batch, seq=seq, n_layers=1)
    graph = coarsen(capture(module, inputs, model))
    devices = get_preset(preset)
    options = CostOptions(
        optimizer="adam",
        master_weights=True,
        zero=1,
        rates="shape",
        nic_rails=True,
        **FRAMEWORK_OVERLAP["megatron-recipe"].options(),
    )
    cm = CostModel(graph, devices, options)
    moe = [i for i, op in enumerate(graph.ops) if op.kind == "moe"]
    if len(moe) != 1:
        raise LayerwiseError(f"{model!r}'s first layer has {len(moe)} moe ops, not one")
    i = moe[0]
    out = [e for e in graph.edges if e.src == i]
    records = []
    for tensor, expert, cut in layouts:
        strategy = megatron(graph, devices, tensor, 1, expert, cut)
        cfg = strategy.configs[i]
        fwd, bwd = cm.task_times(i, cfg)
        a2a = cm.expert_exchange(i, cfg)
        reduction = sum(cm.transfer_time(e, cfg, strategy.configs[e.dst]) for e in out)
        records.append(
            {
                "layout": f"TP{tensor} EP{expert} ETP{'-' if cut is None else cut}",
                "moe": cfg.describe(graph.ops[i]),
                "moe_forward_ms": 1e3 * float(fwd.max()),
                "moe_backward_ms": 1e3 * float(bwd.max()),
                "all_to_all_ms": 0.0 if a2a is None else 1e3 * float(a2a[0].max()),
                "reduction_ms": 1e3 * reduction,
                "step_ms": 1e3 * simulate(cm, strategy).makespan,
                "peak_gib": float(cm.strategy_memory(strategy.configs).max()) / 2**30,
            }
        )
    return records


def table(records: Sequence[dict[str, Any]]) -> str:
    head = (
        "| layout | moe op | forward ms | backward ms | all-to-all ms (one pass) | "
        "partial sums reduced ms | layer step ms | peak GiB |"
    )
    rows = [head, "|" + " --- |" * 8]
    for r in records:
        rows.append(
            f"| {r['layout']} | {r['moe']} | {r['moe_forward_ms']:.3f} | "
            f"{r['moe_backward_ms']:.3f} | {r['all_to_all_ms']:.3f} | {r['reduction_ms']:.3f} | "
            f"{r['step_ms']:.2f} | {r['peak_gib']:.2f} |"
        )
    return "\n".join(rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m experiments.expert_tensor", description=__doc__)
    parser.add_argument("--model", choices=MODELS, default="mixtral-8x7b")
    parser.add_argument("--preset", default="dgx-h100-8")
    parser.add_argument("--batch", type=positive_int, default=64)
    parser.add_argument("--seq", type=positive_int, default=4096)
    parser.add_argument(
        "--layouts",
        nargs="+",
        type=parse_layout,
        default=[parse_layout(x) for x in DEFAULT_LAYOUTS],
        help="tensor x expert x expert-tensor, '-' for megatron's default (no cut)",
    )
    parser.add_argument("--json", type=Path, help="also write the records here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    from experiments.runinfo import finish, load_line, run_info

    args = parse_args(argv)
    info = run_info("experiments.expert_tensor", argv, args)
    layouts = args.layouts
    print(f"{args.model}, one layer, batch {args.batch} x {args.seq} on {args.preset}", flush=True)
    records = measure(args.model, args.preset, args.batch, args.seq, layouts)
    meta = finish(info)
    print(table(records))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=2))
    print(f"{meta['elapsed_seconds']:.1f} s ({load_line(meta)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
