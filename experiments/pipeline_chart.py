"""`python -m experiments.pipeline_chart`: one pipelined training step of a GPT, simulated
and drawn.

The zoo's GPT-2 (`--layers` blocks, at `--batch` samples) in bf16 with mixed-precision Adam
and full recomputation, cut into `--stages` stages of equally many blocks (x `--chunks` per
stage: the interleaved schedule) on `dgx-a100-80g-N` (one node per stage, Megatron-LM's
tensor parallelism of 8 inside it), `--micro-batches` micro-batches, `--schedule`. Prints
the step time, the bubble against its closed form, the peak memory per stage, and writes
the timeline chart (`planner.pipeline.chart.gantt`) to `--out`. docs/simulator.md shows one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from planner.cli.args import OneLineArgumentParser, report_errors


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.pipeline_chart", description=__doc__)
    p.add_argument("--stages", type=int, default=4, help="pipeline stages, a node each (default 4)")
    p.add_argument("--chunks", type=int, default=1, help="chunks per stage (default 1)")
    p.add_argument("--micro-batches", type=int, default=8, help="default 8")
    p.add_argument(
        "--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b", help="default 1f1b"
    )
    p.add_argument("--layers", type=int, default=16, help="GPT blocks (default 16)")
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--out", type=Path, default=Path("results/pipeline_1f1b.png"))
    args = p.parse_args(argv)
    for name in ("stages", "chunks", "micro_batches", "layers", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    from planner.pipeline.schedule import check_schedule

    check_schedule(args.schedule, args.stages, args.micro_batches, args.chunks)  # before capture
    if args.layers % (args.stages * args.chunks):
        p.error(
            f"{args.layers} blocks, which do not cut into {args.stages * args.chunks} chunks of "
            "equally many: use --layers a multiple of --stages x --chunks"
        )
    if args.batch % args.micro_batches:
        p.error(f"--micro-batches {args.micro_batches} must divide --batch {args.batch}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run it; bad arguments are one `error:` line and exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.graph.capture import capture
    from planner.graph.llm import build_llm
    from planner.hardware.presets import get_preset
    from planner.pipeline.chart import gantt
    from planner.pipeline.layouts import pipelined
    from planner.pipeline.schedule import bubble_fraction
    from planner.pipeline.spec import micro_batch_graph
    from planner.pipeline.stages import simulate_pipelined
    from planner.pipeline.timeline import counted
    from planner.problems.baselines import megatron

    module, inputs = build_llm(
        "gpt2", dtype="bfloat16", batch=args.batch, seq=1024, n_layer=args.layers, n_head=16,
        n_embd=1024, vocab_size=51200,
    )  # fmt: skip
    graph = micro_batch_graph(capture(module, inputs, "gpt2-pipeline"), args.micro_batches)
    devices = get_preset(f"dgx-a100-80g-{args.stages}")
    options = CostOptions(optimizer="adam", master_weights=True, recompute="full")
    ps = pipelined(
        graph, devices, args.stages, args.micro_batches, lambda g, d: megatron(g, d, 8),
        args.schedule, args.chunks,
    )  # fmt: skip
    timeline = simulate_pipelined(CostModel(graph, devices, options), ps)
    closed = bubble_fraction(args.schedule, args.stages, args.micro_batches, args.chunks)
    print(
        f"{args.schedule}: {counted(args.stages, 'stage')} x {counted(args.chunks, 'chunk')}, "
        f"{counted(args.micro_batches, 'micro-batch', 'micro-batches')}: step "
        f"{timeline.makespan * 1e3:.2f} ms, bubble {timeline.bubble:.1%} "
        f"(closed form on uniform stages with free messages {closed:.1%}), peak per stage "
        + ", ".join(f"{b / 2**30:.1f}" for b in timeline.peak_bytes)
        + f" GiB (load {os.getloadavg()[0]:.1f})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    gantt(timeline, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
