"""`python -m experiments.moe`: the published mixture-of-experts anchors, predicted.

Each anchor (`ANCHORS`) is a published training run of a mixture of experts: the model (a zoo
entry of `planner.graph.llm`), the GPUs, the batch and the parallel layout it ran, and the
figure it published. For each:

1. the model captured at one micro-batch of every data-parallel replica of a stage, in its
   precision (`planner.graph.precision`: FP8 runs' block linears and expert GEMMs as
   Transformer Engine runs them);
2. the published layout (`experiments.calibration.pipelined_megatron`): tensor parallelism t
   inside a node with sequence parallelism, expert parallelism e over e consecutive token
   boxes (Megatron-Core's default rank order: experts inside the data-parallel group), the
   pipeline stages and virtual stages, data parallelism over the rest, simulated on every
   GPU of a stage (an expert-parallel group spans replicas: the calibration's two replicas
   per stage would cut it), with the training the framework ran (mixed-precision Adam,
   the distributed optimizer as ZeRO 1, shaped kernel rates, Megatron-Core's performance
   recipe's overlap: `experiments.calibration.framework_options`), the anchor's own options
   beside them (`Anchor.options`);
3. the step from the pipeline timeline, tokens/s per GPU = GBS x sequence / step / GPUs, and
   the published figure's unit: TFLOP/s per GPU in the anchor's FLOP convention
   (`experiments.moe_flops`, stated per anchor) or GPU-hours per trillion tokens.

`--plan` also asks the planner (`planner.plan`, defaults) for its own layout of each anchor's
model on the anchor's GPUs and reports what it chooses beside the published layout.
Writes moe.csv and moe.json to --out (results/moe).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.moe_flops import (
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    QWEN3_235B_A22B,
    MoEShape,
    megatron_flops_per_token,
)
from planner.cli.args import OneLineArgumentParser, report_errors

__all__ = ["ANCHORS", "Anchor", "main", "predict"]

log = logging.getLogger("experiments.moe")
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Anchor:
    """A published MoE training run: the model, the GPUs, the layout, the figure."""

    name: str
    model: str  # a zoo entry (`planner.graph.llm.LLM_SIZES`)
    preset: str  # a preset family, "-N" nodes appended
    gpus: int
    seq: int
    gbs: int
    mbs: int
    tp: int
    pp: int
    vp: int
    ep: int
    precision: str
    published: float
    unit: str  # "TFLOP/s per GPU" or "GPU-hours per trillion tokens"
    shape: MoEShape  # the published model's shape, for its FLOP count
    causal: bool  # the FLOP convention: causal attention halved or not
    source: str
    notes: str
    routing: str = "learned"  # "learned" (the router's own choices) or "balanced" (forced)
    capacity_factor: float | None = None  # token dropping at this factor; None: dropless
    recompute: str = "none"
    options: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, Any] = field(default_factory=dict)  # the zoo entry's sizes overridden
    # the pipeline schedule (`planner.pipeline.schedule`); "": "interleaved" with vp > 1,
    # else "1f1b"
    schedule: str = ""

    @property
    def data(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.capacity_factor is not None and not self.capacity_factor >= 1:
            raise ValueError(f"capacity_factor must be >= 1 or None, got {self.capacity_factor}")

    @property
    def expert_capacity(self) -> float:
        """The busiest expert-parallel rank's routed tokens over the mean
        (`CostOptions.expert_capacity`): 1 when the run forced balanced routing (Megatron-
        Bridge's "force-balanced" benchmarks), else `LEARNED_IMBALANCE`, capped by the
        capacity factor of a run that drops the tokens beyond it."""
        if self.routing == "balanced":
            return 1.0
        return min(LEARNED_IMBALANCE, self.capacity_factor or LEARNED_IMBALANCE)

    @property
    def pipeline_schedule(self) -> str:
        """`schedule`, or by default "interleaved" with virtual stages, else "1f1b"."""
        return self.schedule or ("interleaved" if self.vp > 1 else "1f1b")

    @property
    def routing_label(self) -> str:
        """ "balanced", "learned" or "token drop" (a learned router capped by its factor)."""
        return "token drop" if self.capacity_factor is not None else self.routing

    @property
    def micro_batches(self) -> int:
        return self.gbs // (self.mbs * self.data)

    @property
    def layout(self) -> str:
        v = f" VP{self.vp}" if self.vp > 1 else ""
        return f"TP{self.tp} PP{self.pp}{v} EP{self.ep} DP{self.data} MBS{self.mbs} GBS{self.gbs}"


# The busiest expert-parallel rank's tokens over the mean in training with a learned router:
# the low end of the final inter-rank imbalance UltraEP measured without rebalancing, 1.30 to
# 4.01 over MoE models of 106B to 671B parameters in training and prefill (Wei et al. 2026,
# arXiv 2606.04101, abstract). The published runs report no imbalance of their own.
LEARNED_IMBALANCE = 1.3
ROUTINGS = ("learned", "balanced")

MEGATRON_MOE = (
    "github.com/NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md (MCore v0.9: 468 "
    "TFLOP/s; its 'Reference Best Parallel Mapping' table)"
)
DEEPSEEK_REPORT = (
    "DeepSeek-AI, DeepSeek-V3 Technical Report, arXiv 2412.19437: Sec. 1 and Table 1 (180K "
    "H800 GPU-hours per trillion tokens), Sec. 3.1-3.3 (2,048 H800, PP16, EP64 over 8 nodes, "
    "ZeRO-1 DP, DualPipe, FP8), Sec. 4.2 (sequence 4K, batch 15,360)"
)

# DeepEP as Megatron-Core runs it (`--moe-token-dispatcher-type flex --moe-enable-deepep`):
# a token once to each node it uses, then over NVLink, its kernels holding 20 SMs
# (`--moe-deepep-num-sms`' default) of an H100's 132 beside the computation
DEEPEP: dict[str, Any] = {"ep_dispatch": "node", "comm_sm_share": 20 / 132}


ANCHORS: tuple[Anchor, ...] = (
    Anchor(
        name="Mixtral 8x7B, Megatron-Core v0.9",
        model="mixtral-8x7b",
        preset="dgx-h100",
        gpus=64,
        seq=4096,
        gbs=256,
        mbs=1,
        tp=1,
        pp=4,
        vp=8,
        ep=8,
        precision="bf16-mixed",
        published=468.0,
        unit="TFLOP/s per GPU",
        shape=MIXTRAL_8X7B,
        causal=False,
        source=MEGATRON_MOE,
        notes=(
            "dropless, all-to-all dispatcher, grouped GEMM, distributed optimizer; the 2024 "
            "Megatron FLOP count (causal attention not halved); no recomputation named"
        ),
    ),  # fmt: skip
    Anchor(
        name="DeepSeek-V3 pre-training",
        model="deepseek-v3-like",
        preset="hgx-h800",
        gpus=2048,
        seq=4096,
        gbs=15360,
        mbs=1,
        tp=1,
        pp=16,
        vp=1,
        ep=64,
        precision="transformer-engine-cs",
        published=180_000.0,
        unit="GPU-hours per trillion tokens",
        shape=DEEPSEEK_V3,
        causal=True,
        source=DEEPSEEK_REPORT,
        notes=(
            "DualPipe (Sec. 3.2.1, Fig. 5: two copies of the stages, micro-batches fed from "
            "both ends, a forward overlapped with a backward, weight gradients filling the "
            "drain; planner.pipeline.schedule) with the "
            "all-to-alls hidden under compute (ep_overlap 1, Sec. 3.2.1), a token sent once "
            "to each node it uses (node-limited routing, at most 4 nodes, and DeepEP's "
            "forwarding over NVLink, Sec. 3.2.2) in FP8 (Sec. 3.3.4); FP8 with "
            "fine-grained (current) "
            "scaling; the zoo's model has DeepSeek-V3's MLA (naive form: per-head keys and "
            "values) and no MTP module; micro-batch size not published (1 assumed)"
        ),
        options={  # DeepEP's node dispatch and SMs (Sec. 3.2.2), in FP8 (Sec. 3.3.4)
            **DEEPEP,
            "ep_dispatch_bytes": 1,
            "ep_overlap": 1.0,
            "pp_overlap": 1.0,  # Sec. 3.2.1: DualPipe hides "both all-to-all and PP communication"
        },
        schedule="dualpipe",
    ),  # fmt: skip
)


# Megatron-Bridge's published MoE rows (experiments/data/h100_published.csv) by zoo entry,
# with the shape of the published model for its FLOP count
ROW_MODELS: dict[str, tuple[str, MoEShape]] = {
    "DeepSeekV3": ("deepseek-v3-like", DEEPSEEK_V3),
    "Qwen3-30B-A3B": ("qwen3-30b-a3b", QWEN3_30B_A3B),
    "Qwen3-235B-A22B": ("qwen3-235b-a22b", QWEN3_235B_A22B),
}


def row_anchors(rows: Sequence[Any] | None = None) -> tuple[list[Anchor], list[tuple[Any, str]]]:
    """The published MoE rows (`experiments.published.read_rows`: rows with expert
    parallelism) as anchors in tokens/s per GPU, and the rows left out with the reason.

    A row's routing is its notes': "force-balanced" runs balanced routing (`expert_capacity`
    1), "tokendrop" pads every expert to capacity factor 1 (Megatron-Bridge's token-dropping
    recipes: every rank computes the capacity, 1), other dropless runs learned routing
    (`LEARNED_IMBALANCE`). Its precision is the dense calibration's reading
    (`experiments.published.precision`); micro-batch size 1 when not given. Expert
    parallelism across nodes dispatches as DeepEP (`DEEPEP`: Megatron-Core's MoE recipes
    for H100 enable it, NVIDIA's Megatron-MoE-ModelZoo best practices for DeepSeek-V3 and
    Qwen3-235B), all-to-alls not overlapped (the rows do not say they are)."""
    from experiments.published import PRESETS, ROWS, precision, read_rows
    from planner.graph.llm import LLM_SIZES

    rows = read_rows(ROWS) if rows is None else rows
    anchors: list[Anchor] = []
    skipped: list[tuple[Any, str]] = []
    for row in rows:
        if row.ep <= 1:
            continue
        model, shape = ROW_MODELS.get(row.model, ("", None))
        reason = ""
        if shape is None:
            reason = f"{row.model!r}: no zoo entry builds it"
        elif model not in LLM_SIZES:
            reason = f"{row.model!r}: the zoo has no {model!r}"
        elif row.gpu not in PRESETS:
            reason = f"no preset for the GPU {row.gpu!r}"
        elif row.tokens is None:
            reason = "no tokens/s published"
        if reason:
            skipped.append((row, reason))
            continue
        assert shape is not None and row.tokens is not None
        notes = row.notes.lower()
        balanced = "force-balanced" in notes
        anchors.append(
            Anchor(
                name=f"{row.model} ({row.release}, line {row.line})",
                model=model,
                preset=PRESETS[row.gpu],
                gpus=row.gpus,
                seq=row.seq,
                gbs=row.gbs,
                mbs=row.micro_batch,
                tp=row.tp,
                pp=row.pp,
                vp=row.virtual,
                ep=row.ep,
                precision=precision(row) or "bf16-mixed",
                published=row.tokens,
                unit="tokens/s per GPU",
                shape=shape,
                causal=True,
                source=row.source,
                notes=row.notes,
                routing="balanced" if balanced else "learned",
                capacity_factor=1.0 if "tokendrop" in notes else None,
                options=dict(DEEPEP) if row.ep > GPUS_PER_NODE else {},  # EP across nodes
            )
        )
    return anchors, skipped


def build(anchor: Anchor, batch: int) -> Any:
    """The anchor's model captured at `batch` samples, coarsened, in its precision."""
    from planner.graph.capture import capture
    from planner.graph.coarsen import coarsen
    from planner.graph.llm import build_llm
    from planner.graph.precision import with_precision

    module, inputs = build_llm(
        anchor.model,
        dtype="bfloat16",
        batch=batch,
        seq=anchor.seq,
        **({"max_seq_len": anchor.seq} | anchor.sizes),
    )
    return with_precision(coarsen(capture(module, inputs, anchor.model)), anchor.precision)


def options_of(anchor: Anchor) -> Any:
    """The framework's training as cost options (`experiments.calibration.framework_options`
    on a row of the anchor's layout), with the anchor's own options."""
    from experiments.calibration import framework_options

    row = _row(anchor)
    return framework_options(row, **({"expert_capacity": anchor.expert_capacity} | anchor.options))


def _row(anchor: Anchor) -> Any:
    """The anchor as a calibration row (the fields `framework_options` reads)."""
    from experiments.published import Published

    return Published(
        line=0, source=anchor.source, release="", model=anchor.model, layers=0, hidden=0,
        ffn_hidden=0, heads=1, kv_heads=1, vocab=0, tied=False, gpus=anchor.gpus,
        gpu="", precision=anchor.precision, seq=anchor.seq, gbs=anchor.gbs, mbs=anchor.mbs,
        tp=anchor.tp, pp=anchor.pp, cp=1, vp=anchor.vp, ep=anchor.ep, fsdp="distopt",
        sequence_parallel=anchor.tp > 1, recompute=anchor.recompute, recompute_layers=None,
        tokens=None, tflops=None, notes="",
    )  # fmt: skip


def simulate(anchor: Anchor) -> dict[str, Any]:
    """The anchor's published layout simulated: step seconds, the busiest stage's peak
    memory per GPU and its parts, the pipeline's bubble."""
    from experiments.calibration import micro_batch_times, pipelined_megatron
    from planner.costs.costmodel import CostModel
    from planner.hardware.presets import get_preset
    from planner.pipeline.timeline import simulate_pipeline

    options = options_of(anchor)
    graph = build(anchor, anchor.data * anchor.mbs)
    devices = get_preset(f"{anchor.preset}-{anchor.gpus // GPUS_PER_NODE}")
    layers = _layers(anchor)
    planned = pipelined_megatron(
        graph, devices, layers, anchor.tp, 1, anchor.pp, anchor.vp, anchor.ep
    )
    cm = CostModel(graph, devices, options)
    chunks = micro_batch_times(cm, planned)
    overlap = (options.pp_overlap, options.chunk_sync_share)
    timeline = simulate_pipeline(
        chunks, anchor.pipeline_schedule, anchor.pp, anchor.micro_batches, *overlap
    )
    peak = max(range(anchor.pp), key=lambda g: timeline.peak_bytes[g])
    return {
        "schedule": anchor.pipeline_schedule,
        "step_seconds": timeline.makespan,
        "bubble": timeline.bubble,
        "peak_gib": timeline.peak_bytes[peak] / 2**30,
        "peak_parts_gib": {k: v / 2**30 for k, v in timeline.peak_parts[peak].items()},
        "usable_gib": float(cm.usable_memory().min()) / 2**30,
        "graph_flops_per_token": 3 * graph.forward_flops / (anchor.data * anchor.mbs * anchor.seq),
    }


def _layers(anchor: Anchor) -> int:
    from planner.graph.llm import LLM_SIZES

    return int(anchor.sizes.get("n_layers", LLM_SIZES[anchor.model].n_layers))


def predict(anchor: Anchor) -> dict[str, Any]:
    """The anchor's prediction beside its published figure (module docstring)."""
    start = time.perf_counter()
    sim = simulate(anchor)
    tokens = anchor.gbs * anchor.seq / sim["step_seconds"] / anchor.gpus
    per_token = megatron_flops_per_token(anchor.shape, anchor.seq, causal=anchor.causal)
    if anchor.unit == "TFLOP/s per GPU":
        predicted = tokens * per_token / 1e12
    elif anchor.unit == "tokens/s per GPU":
        predicted = tokens
    else:
        predicted = 1e12 / tokens / 3600
    return {
        "anchor": anchor.name,
        "layout": anchor.layout,
        "gpus": anchor.gpus,
        "unit": anchor.unit,
        "published": anchor.published,
        "predicted": predicted,
        "error": predicted / anchor.published - 1,
        "tokens_per_gpu": tokens,
        "flops_per_token": per_token,
        "routing": anchor.routing_label,
        "expert_capacity": anchor.options.get("expert_capacity", anchor.expert_capacity),
        "flop_convention": "Megatron-LM, causal attention "
        + ("halved" if anchor.causal else "not halved"),
        "seconds": time.perf_counter() - start,
        **sim,
    }


def plan_anchor(anchor: Anchor, time_limit: float) -> dict[str, Any]:
    """What the planner chooses with its defaults for the anchor's model, batch and
    precision on its GPUs: the summary of its plan and the seconds planning took."""
    import planner

    start = time.perf_counter()
    result = planner.plan(
        anchor.model,
        f"{anchor.preset}-{anchor.gpus // GPUS_PER_NODE}",
        time_limit=time_limit,
        model_kwargs={"batch": anchor.gbs, "seq": anchor.seq, **anchor.sizes},
        precision=anchor.precision,
    )
    summary = {k: v for k, v in result.summary().items() if _plain(v)}
    return {"summary": summary, "seconds": time.perf_counter() - start}


def _plain(value: Any) -> bool:
    return isinstance(value, str | int | float | bool | type(None) | list | tuple | dict)


# -- output -------------------------------------------------------------------------------


def table(records: Sequence[dict[str, Any]]) -> str:
    """The anchors as a markdown table."""
    lines = [
        "| anchor | layout | GPUs | published | predicted | error | tok/s/GPU | FLOP/token "
        "(convention) | routing (busiest rank / mean) | step | bubble | peak memory / usable |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        lines.append(
            f"| {r['anchor']} | {r['layout']} | {r['gpus']} | {r['published']:,.0f} "
            f"{r['unit']} | {r['predicted']:,.0f} | {r['error']:+.1%} | "
            f"{r['tokens_per_gpu']:,.0f} | {r['flops_per_token'] / 1e9:.1f} G "
            f"({r['flop_convention']}) | {r['routing']} ({r['expert_capacity']:.2f}) | "
            f"{r['step_seconds']:.2f} s | {r['bubble']:.1%} | "
            f"{r['peak_gib']:.1f} / {r['usable_gib']:.1f} GiB |"
        )
    return "\n".join(lines)


def write(records: Sequence[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    flat = [{k: v for k, v in r.items() if not isinstance(v, dict)} for r in records]
    with (out / "moe.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    (out / "moe.json").write_text(json.dumps({"meta": meta, "anchors": records}, indent=2))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineArgumentParser(prog="python -m experiments.moe", description=__doc__)
    names = sorted({a.model for a in ANCHORS} | {m for m, _ in ROW_MODELS.values()})
    parser.add_argument(
        "--anchor", action="append", choices=names, help="only these anchors (default: all)"
    )
    parser.add_argument(
        "--rows",
        action="store_true",
        help="also Megatron-Bridge's published MoE rows on H100 (experiments/data/"
        "h100_published.csv) whose model the zoo builds, in tokens/s per GPU",
    )
    parser.add_argument("--out", type=Path, default=Path("results/moe"))
    parser.add_argument(
        "--plan", action="store_true", help="also plan each anchor's model with defaults"
    )
    parser.add_argument("--time-limit", type=float, default=60.0, help="for --plan")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    from experiments.runinfo import finish, load_line, run_info

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = run_info("experiments.moe", argv, args)
    chosen = [a for a in ANCHORS if not args.anchor or a.model in args.anchor]
    if args.rows:
        rows, skipped = row_anchors()
        chosen += [a for a in rows if not args.anchor or a.model in args.anchor]
        for row, reason in skipped:
            print(f"line {row.line} {row.name}: left out: {reason}", file=sys.stderr)
    records = []
    for anchor in chosen:
        print(f"{anchor.name}: simulating {anchor.layout} ...", file=sys.stderr, flush=True)
        records.append(predict(anchor))
        if args.plan:
            records[-1]["plan"] = plan_anchor(anchor, args.time_limit)
    meta = finish(info)
    print(table(records))
    write(records, args.out, meta)
    print(f"wrote {args.out / 'moe.csv'} and moe.json ({load_line(meta)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
