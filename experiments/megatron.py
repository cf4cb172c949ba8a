"""`python -m experiments.megatron`: Megatron-LM's published throughput, predicted and searched.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT models of 1.7B to 1T parameters (vocabulary 51,200,
sequence 2,048) trained on 32 to 3,072 A100 80 GB GPUs of Selene, 137-163 TFLOP/s per GPU.
For each row whose configuration uses no pipeline (rows 1-4: 1.7B to 18.4B, tensor-parallel
size 1 to 8, data parallel over the rest):

1. capture the GPT (`planner.graph.llm.GPT2`: learned positions, pre-LN blocks, GELU MLP,
   the head tied to the embedding) in bf16 at the row's global batch;
2. simulate the published configuration (`planner.problems.baselines.megatron`: tensor
   parallelism of the row's size inside each DGX node, data parallelism across) on
   `dgx-a100-80g-N` with the training Megatron-LM ran (mixed-precision Adam with fp32 master
   weights, full activation recomputation) and 2021's attention kernels (`ATTENTION_2021`);
3. print the predicted TFLOP/s per GPU, Eq. 3's FLOPs over the simulated step, beside the
   published one, and the error;
4. plan the same model, GPUs and batch with `planner.plan` (backend auto, recompute "auto",
   the same optimizer and devices; no ZeRO and no pipeline, as Megatron-LM's row), simulate
   its answer and print its throughput and what it chose.

Rows 5-10 (39.1B to 1T, pipelines of 2 to 64 stages): the published configuration, tensor
parallelism of 8 inside each node, data parallelism across a stage's nodes, the row's stages
over consecutive nodes, with the micro-batches and schedule the run used (`PIPELINE_RUNS`),
simulated as a pipeline (`planner.pipeline`): one micro-batch's GPT captured, each stage's
micro-batch costs from FlexFlow's simulator, the schedule's timeline. Writes `megatron.csv`,
`megatron.json` and `megatron.png` (published, predicted and planned TFLOP/s per GPU by row)
to `--out` (default results/megatron). docs/megatron.md has the table and how to read it.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from planner.cli.args import OneLineArgumentParser, one_line, positive_seconds, report_errors
from planner.errors import LayerwiseError

log = logging.getLogger("experiments.megatron")

VOCAB = 51200
SEQ = 2048
A100_BF16_PEAK = 312e12


@dataclass(frozen=True)
class Row:
    """One row of Table 1 (Narayanan et al., SC'21): model size, its shape, the parallel
    configuration, the GPUs and global batch, and the throughput achieved."""

    row: int
    billions: float  # parameters, as published
    heads: int
    hidden: int
    layers: int
    tensor: int
    pipeline: int
    gpus: int
    batch: int
    tflops: float  # achieved teraFLOP/s per GPU
    percent: int  # of the 312 TFLOP/s bf16 peak
    aggregate: float  # achieved petaFLOP/s over all GPUs

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)


TABLE1 = (
    Row(1, 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    Row(2, 3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    Row(3, 7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    Row(4, 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    Row(5, 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    Row(6, 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    Row(7, 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    Row(8, 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    Row(9, 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    Row(10, 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)


@dataclass(frozen=True)
class PipelineRun:
    """How a pipelined row ran (Megatron-LM's examples/sc21/run_table_1.sh: the paper lists
    no micro-batch sizes): samples per data-parallel replica per micro-batch, the schedule,
    and model chunks per stage (v > 1: interleaved, `--num-layers-per-virtual-pipeline-stage`)."""

    micro_batch: int
    schedule: str
    virtual: int = 1

    def micro_batches(self, row: Row) -> int:
        return row.batch // (self.micro_batch * row.data)


PIPELINE_RUNS = {
    5: PipelineRun(4, "1f1b"),
    6: PipelineRun(2, "interleaved", 3),
    7: PipelineRun(2, "interleaved", 2),
    8: PipelineRun(1, "interleaved", 2),
    9: PipelineRun(1, "interleaved", 3),
    10: PipelineRun(1, "1f1b"),
}

# Megatron-LM's attention of 2021: unfused kernels that write the (sequence x sequence) scores
# to memory, scale, mask, softmax and dropout them and read them back. FlashAttention, which
# avoids that traffic, still reached "only 25-40% of the theoretical maximum FLOPs/s" (Dao,
# FlashAttention-2, 2023, Sec. 1); the unfused kernels reach less: 20% here, an estimate
# (docs/megatron.md shows the predictions with the preset's 50% too).
ATTENTION_2021 = 0.2
# The training Megatron-LM ran: mixed-precision Adam (bf16 weights and gradients, fp32 master
# weights and moments: 16 bytes per parameter) and full activation recomputation (Sec. 3.5).
TRAINING = {"optimizer": "adam", "master_weights": True, "recompute": "full"}


def eq3_flops(row: Row) -> float:
    """Eq. 3: FLOPs of one training step, forward, backward and the recomputed forward
    (96 B s l h^2 (1 + s / 6h + V / 16lh))."""
    b, s, layers, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def eq2_params(row: Row) -> float:
    """Eq. 2: parameters, 12 l h^2 (1 + 13 / 12h + (V + s) / 12lh)."""
    layers, h = row.layers, row.hidden
    return 12 * layers * h * h * (1 + 13 / (12 * h) + (VOCAB + SEQ) / (12 * layers * h))


def selene(nodes: int, attention: float = ATTENTION_2021) -> Any:
    """`dgx-a100-80g-N` with the attention fraction of 2021's kernels."""
    from planner.hardware.devices import DeviceGraph
    from planner.hardware.presets import get_preset

    base = get_preset(f"dgx-a100-80g-{nodes}")
    devices = [
        replace(
            d, efficiency=tuple((c, attention if c == "attention" else f) for c, f in d.efficiency)
        )
        for d in base.devices
    ]
    return DeviceGraph(base.name, devices, base.links, base.switches)


def build_gpt(row: Row, batch: int | None = None) -> Any:
    """The row's GPT in bf16, captured at the global batch (or `batch`)."""
    from planner.graph.capture import capture
    from planner.graph.llm import build_llm

    module, inputs = build_llm(
        "gpt2",
        dtype="bfloat16",
        batch=batch or row.batch,
        seq=SEQ,
        n_layer=row.layers,
        n_head=row.heads,
        n_embd=row.hidden,
        vocab_size=VOCAB,
        block_size=SEQ,
    )
    return capture(module, inputs, f"gpt-{row.billions}b")


def simulate_published(row: Row, graph: Any, devices: Any) -> dict[str, Any]:
    """Row's published configuration, simulated: step seconds, TFLOP/s per GPU, peak memory."""
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.problems.baselines import megatron
    from planner.sim.simulator import simulate

    cm = CostModel(graph, devices, CostOptions(**TRAINING))  # type: ignore[arg-type]
    timeline = simulate(cm, megatron(graph, devices, row.tensor))
    peak = float(cm.strategy_memory(megatron(graph, devices, row.tensor).configs).max())
    step = timeline.makespan
    return {
        "step_seconds": step,
        "tflops_predicted": eq3_flops(row) / step / row.gpus / 1e12,
        "peak_gib": peak / 2**30,
    }


def simulate_published_pipeline(
    row: Row, devices: Any, run: PipelineRun | None = None
) -> dict[str, Any]:
    """A pipelined row's published configuration (tensor parallelism inside each node, data
    parallelism across the nodes of a stage, `row.pipeline` stages of consecutive nodes, the
    run's micro-batches and schedule: `PIPELINE_RUNS`), simulated: the GPT is captured at one
    micro-batch (`micro_batch` samples per replica) and its step is the schedule's timeline
    (`planner.pipeline.stages.simulate_pipelined`)."""
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.pipeline.layouts import pipelined
    from planner.pipeline.stages import simulate_pipelined
    from planner.problems.baselines import megatron

    run = run or PIPELINE_RUNS[row.row]
    m = run.micro_batches(row)
    graph = build_gpt(row, batch=run.micro_batch * row.data)
    cm = CostModel(graph, devices, CostOptions(**TRAINING))  # type: ignore[arg-type]
    ps = pipelined(
        graph,
        devices,
        row.pipeline,
        m,
        lambda g, d: megatron(g, d, row.tensor),
        run.schedule,
        run.virtual,
    )
    timeline = simulate_pipelined(cm, ps)
    step = timeline.makespan
    return {
        "step_seconds": step,
        "tflops_predicted": eq3_flops(row) / step / row.gpus / 1e12,
        "peak_gib": max(timeline.peak_bytes) / 2**30,
        "micro_batch": run.micro_batch,
        "micro_batches": m,
        "schedule": run.schedule if run.virtual == 1 else f"{run.schedule} v={run.virtual}",
        "bubble": timeline.bubble,
    }


def plan_row(row: Row, graph: Any, devices: Any, time_limit: float, seed: int) -> dict[str, Any]:
    """The planner's own answer for the row, simulated with the same cost options."""
    import planner
    from planner.sim.simulator import simulate

    t0 = time.perf_counter()
    result = planner.plan(
        graph,
        devices,
        time_limit=time_limit,
        seed=seed,
        optimizer="adam",
        master_weights=True,
        recompute="auto",  # Megatron-LM used no ZeRO: neither does the planner here
        pipeline=False,  # nor a pipeline in rows 1-4 (auto would pipeline across hosts)
    )
    seconds = time.perf_counter() - t0
    if result.strategy is None:
        return {"plan_status": result.status.value, "plan_seconds": seconds}
    cm = result.problem.dnn().cost_model
    step = simulate(cm, result.strategy).makespan
    peak = float(cm.strategy_memory(result.strategy.configs).max())
    layout = describe_layout(result.strategy)
    return planned(row, result, seconds, step, peak, cm.options, layout)


def planned(
    row: Row, result: Any, seconds: float, step: float, peak: float, options: Any, layout: str
) -> dict[str, Any]:
    """The record's columns of a plan (`result`: a PlanResult or a PipelinePlan) simulated
    at `step` seconds and `peak` bytes per device, with the cost options it used."""
    return {
        "plan_status": result.status.value,
        "plan_backend": result.backend,
        "plan_seconds": seconds,
        "plan_step_seconds": step,
        "plan_tflops": eq3_flops(row) / step / row.gpus / 1e12,
        "plan_peak_gib": peak / 2**30,
        "plan_recompute": options.recompute,
        "plan_zero": options.zero,
        "plan_layout": layout,
    }


def plan_pipelined_row(row: Row, devices: Any, time_limit: float, seed: int) -> dict[str, Any]:
    """The planner's pipeline search for a pipelined row (`planner.plan_pipeline`: stages,
    tensor and data degrees, micro-batches, schedule and recomputation; no ZeRO, as
    Megatron-LM), the GPT captured at the row's global batch."""
    import planner

    t0 = time.perf_counter()
    graph = build_gpt(row)
    result = planner.plan_pipeline(
        graph,
        devices,
        time_limit=max(1.0, time_limit - (time.perf_counter() - t0)),
        seed=seed,
        optimizer="adam",
        master_weights=True,
        zero=0,
    )
    seconds = time.perf_counter() - t0
    peak = max(result.timeline.peak_bytes)
    return planned(
        row, result, seconds, result.objective, peak, result.options, result.layout.describe()
    )


def describe_layout(strategy: Any) -> str:
    """The configs of one transformer block's linears and attention, e.g.
    'attn.c_attn sample=32,channel=8; ...' (the first block; the others are alike)."""
    parts = []
    for op, cfg in zip(strategy.graph.ops, strategy.configs, strict=True):
        if op.name.startswith("transformer.h.0.") and op.kind in ("linear", "attention", "norm"):
            what = cfg.describe(op).split(" @ ")[0]
            parts.append(f"{op.name.removeprefix('transformer.h.0.')} {what}")
    return "; ".join(parts)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def run(
    rows: Sequence[Row],
    search: bool,
    time_limit: float,
    seed: int,
    attention: float = ATTENTION_2021,
) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        rec: dict[str, Any] = {k: v for k, v in asdict(row).items()}
        rec["eq2_billions"] = eq2_params(row) / 1e9
        rec["eq3_flops"] = eq3_flops(row)
        if row.pipeline > 1:
            t0 = time.perf_counter()
            devices = selene(row.gpus // 8, attention)
            rec.update(simulate_published_pipeline(row, devices))
            rec["simulate_seconds"] = time.perf_counter() - t0
            rec["error"] = rec["tflops_predicted"] / row.tflops - 1
            line = (
                f"row {row.row}: {row.billions}B, TP {row.tensor} x PP {row.pipeline} x DP "
                f"{row.data} on {row.gpus} GPUs, {rec['micro_batches']} micro-batches "
                f"({rec['schedule']}): published {row.tflops:.0f}, predicted "
                f"{rec['tflops_predicted']:.1f} TFLOP/s per GPU ({rec['error']:+.1%})"
            )
            if search:
                try:
                    rec.update(plan_pipelined_row(row, devices, time_limit, seed))
                except LayerwiseError as exc:
                    rec["plan_status"] = f"error: {one_line(exc)}"
                    line += f", planner: {rec['plan_status']}"
                if "plan_tflops" in rec:
                    line += f", planned {rec['plan_tflops']:.1f} ({rec['plan_seconds']:.0f} s)"
            print(line, file=sys.stderr, flush=True)
            out.append(rec)
            continue
        t0 = time.perf_counter()
        graph = build_gpt(row)
        devices = selene(row.gpus // 8, attention)
        rec["capture_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rec.update(simulate_published(row, graph, devices))
        rec["simulate_seconds"] = time.perf_counter() - t0
        rec["error"] = rec["tflops_predicted"] / row.tflops - 1
        line = (
            f"row {row.row}: {row.billions}B, TP {row.tensor} x DP {row.data} on {row.gpus} GPUs: "
            f"published {row.tflops:.0f}, predicted {rec['tflops_predicted']:.1f} TFLOP/s per GPU "
            f"({rec['error']:+.1%})"
        )
        if search:
            try:
                rec.update(plan_row(row, graph, devices, time_limit, seed))
            except LayerwiseError as exc:  # e.g. out of time: the row keeps its prediction
                rec["plan_status"] = f"error: {one_line(exc)}"
                line += f", planner: {rec['plan_status']}"
            if "plan_tflops" in rec:
                line += f", planned {rec['plan_tflops']:.1f} ({rec['plan_seconds']:.0f} s)"
        print(line, file=sys.stderr, flush=True)
        out.append(rec)
    return out


COLUMNS = (
    "row", "billions", "eq2_billions", "tensor", "data", "gpus", "batch", "tflops",
    "tflops_predicted", "error", "step_seconds", "peak_gib", "plan_tflops",
    "plan_step_seconds", "plan_peak_gib", "plan_recompute", "plan_zero", "plan_status",
    "plan_seconds", "plan_layout", "pipeline", "micro_batch", "micro_batches", "schedule",
    "bubble",
)  # fmt: skip


def table(records: Sequence[dict[str, Any]]) -> str:
    """The markdown table the docs show."""
    head = (
        "| row | model | TP x PP x DP | GPUs | batch | micro-batches | published TFLOP/s "
        "| predicted | error | planned | recomputed blocks | planner's layout (first block) |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    lines = [head]
    for r in records:
        planned = f"{r['plan_tflops']:.1f}" if "plan_tflops" in r else "-"
        micro = f"{r['micro_batches']} ({r['schedule']})" if "micro_batches" in r else "-"
        lines.append(
            f"| {r['row']} | {r['billions']}B | {r['tensor']} x {r['pipeline']} x "
            f"{r['gpus'] // (r['tensor'] * r['pipeline'])} | {r['gpus']} | {r['batch']} | {micro} "
            f"| {r['tflops']:.0f} | {r['tflops_predicted']:.1f} | {r['error']:+.1%} | {planned} "
            f"| {recomputed(r)} | {r.get('plan_layout', '-')} |"
        )
    return "\n".join(lines)


def recomputed(r: dict[str, Any]) -> str:
    """The planner's recomputation: 'all 24', '12 of 40', 'none' or '-'."""
    mode = r.get("plan_recompute")
    if mode is None:
        return "-"
    if mode in ("none", 0):
        return "none"
    return f"all {r['layers']}" if mode == "full" else f"{mode} of {r['layers']}"


def write(records: list[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "megatron.json").write_text(json.dumps({"meta": meta, "rows": records}, indent=1))
    with open(out / "megatron.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in records:
            w.writerow(r)
    plot(records, out / "megatron.png")


def plot(records: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = list(records)
    if not done:
        return
    x = range(len(done))
    fig, ax = plt.subplots(figsize=(9.6, 3.8))
    width = 0.27
    ax.bar([i - width for i in x], [r["tflops"] for r in done], width, label="published")
    ax.bar(x, [r["tflops_predicted"] for r in done], width, label="predicted (published layout)")
    planned = [r.get("plan_tflops", 0.0) for r in done]
    if any(planned):
        ax.bar([i + width for i in x], planned, width, label="planner's layout")
    ax.set_xticks(list(x), [f"{r['billions']}B\n{r['gpus']} GPUs" for r in done])
    ax.set_ylabel("TFLOP/s per GPU (Eq. 3)")
    ax.axhline(A100_BF16_PEAK / 1e12, color="grey", lw=0.5)
    ax.set_title("Megatron-LM (SC'21) Table 1")
    ax.set_ylim(0, 360)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.megatron", description=__doc__)
    p.add_argument(
        "--rows",
        nargs="+",
        type=int,
        choices=[r.row for r in TABLE1],
        default=[r.row for r in TABLE1],
        help="rows of Table 1 (default: all; 5-10 use pipelines)",
    )
    p.add_argument("--no-search", action="store_true", help="only the published configurations")
    p.add_argument(
        "--time-limit",
        type=positive_seconds,
        default=120.0,
        help="seconds per row for the planner's search (default 120)",
    )
    p.add_argument(
        "--attention-efficiency",
        type=fraction,
        default=ATTENTION_2021,
        help=f"fraction of the bf16 peak attention reaches (default {ATTENTION_2021}: 2021's "
        "unfused kernels; the dgx-a100-80g preset's is 0.5)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/megatron"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment; bad arguments are one `error:` line and exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    rows = [r for r in TABLE1 if r.row in args.rows]
    t0 = time.perf_counter()
    records = run(rows, not args.no_search, args.time_limit, args.seed, args.attention_efficiency)
    meta = {
        "command": "python -m experiments.megatron "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "seconds": time.perf_counter() - t0,
        "load": os.getloadavg(),
        "attention_efficiency": args.attention_efficiency,
        "training": TRAINING,
    }
    write(records, args.out, meta)
    print(table(records))
    print(f"wrote {args.out}/megatron.csv, .json, .png in {meta['seconds']:.0f} s "
          f"(load {meta['load'][0]:.1f})", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
