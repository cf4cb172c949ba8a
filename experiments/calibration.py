"""`python -m experiments.calibration`: predicted against published H100 training throughput.

Each row of a file of published runs (default `experiments/data/h100_published.csv`, columns
`COLUMNS`; sources in `experiments/data/SOURCES.md`; read by `experiments.published`) gives a
dense decoder-only model, the GPUs, the batch and the layout the run used, and its measured
tokens/s (and TFLOP/s) per GPU. For every row the model can express (`unsupported` says why
another is skipped):

1. the model as the row says (`build_graph`: a Llama-style block of `planner.graph.llm`,
   squared-ReLU for Nemotron-4, GPT for GPT-3) in bf16, an FP8 row's block linears in FP8
   as Transformer Engine runs them, captured at one micro-batch of the two data-parallel
   replicas simulated per stage;
2. the published layout (`simulate_row`): tensor parallelism of the row's size inside each
   node with sequence parallelism, then context parallelism
   (`planner.problems.baselines.megatron`), the row's
   pipeline stages and virtual stages (interleaved 1F1B; the first and last chunks a layer
   lighter when the layers do not divide), data parallelism over the rest, the
   distributed optimizer as ZeRO 1 (a sharded data-parallel layout as ZeRO 3), the
   recomputation published, MBS and GBS as micro-batches; simulated on `dgx-h100-N`
   (`dgx-h200-N`) as the pipeline search does (`backends.pipeline.search._simulate`): two
   replicas per stage, the gradient sync scaled to the stage's replicas;
3. the training the frameworks ran (`framework_options`): mixed-precision Adam with fp32
   master weights, the kernels (`CostOptions.rates` "shape", cuDNN fused attention;
   torchtitan's FlashAttention-2), NCCL's rails and the communication overlap of
   Megatron-Core's performance recipes;
4. predicted tokens/s per GPU = GBS x sequence / step / GPUs, and TFLOP/s per GPU in the
   row's own convention: the published TFLOP/s x predicted / published tokens/s (the FLOPs
   per token the source counted); a row without tokens/s converts its TFLOP/s with NeMo's
   formula (`nemo_flops_per_token`).

Each row's step is broken down (`Breakdown`): the busiest stage's compute by class (GEMMs,
attention, memory-bound ops), its exposed tensor-parallel communication, the pipeline
bubble, the exposed point-to-point messages and the exposed data-parallel sync.

Calibration (docs/calibration.md): the physical constants come from independent sources
(datasheets, the GEMM table, the attention kernels' benchmarks, the frameworks' settings);
the global parameters in `FITTED` were fitted on the rows of the configurations
`calibration_configurations` picks by a rule on the rows' metadata, and the error is
reported separately on the others.
Writes calibration.csv, calibration.json and calibration.png to --out (results/calibration).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.published import (
    COLUMNS,
    GPUS_PER_NODE,
    LLAMA3_PAPER,
    PRESETS,
    ROWS,
    Published,
    assumptions,
    family,
    nemo_flops_per_token,
    precision,
    read_rows,
    recompute,
    unsupported,
    zero_stage,
)
from planner.cli.args import OneLineArgumentParser, one_line, report_errors
from planner.errors import LayerwiseError

__all__ = [
    "COLUMNS",
    "ROWS",
    "Breakdown",
    "build_graph",
    "calibration_configurations",
    "chunk_layers",
    "configuration",
    "fit",
    "framework_options",
    "main",
    "micro_batch_times",
    "nemo_flops_per_token",
    "predict",
    "read_rows",
    "recompute",
    "replica_devices",
    "replica_layout",
    "simulate_row",
    "unsupported",
]

log = logging.getLogger("experiments.calibration")

CALIBRATION_SHARE = 1 / 3  # of the configurations (`configuration`)


def build_graph(row: Published, batch: int, layers: int | None = None) -> Any:
    """The row's model in bf16 captured at `batch` samples (and `layers` blocks, default
    the row's), coarsened as the planner plans it (`planner.graph.coarsen`: an activation
    or dropout folds into the linear before it, as the frameworks fuse them), in the row's
    precision (`experiments.published.precision`: FP8 rows as Transformer Engine trains)."""
    from planner.graph.capture import capture
    from planner.graph.coarsen import coarsen
    from planner.graph.llm import build_llm
    from planner.graph.precision import with_precision

    n = layers or row.layers
    if family(row) == "gpt":
        module, inputs = build_llm(
            "gpt2", dtype="bfloat16", batch=batch, seq=row.seq, n_layer=n, n_head=row.heads,
            n_embd=row.hidden, vocab_size=row.vocab, block_size=row.seq, dropout=0.0,
        )  # fmt: skip
    else:
        module, inputs = build_llm(
            "llama3-8b", dtype="bfloat16", batch=batch, seq=row.seq, n_layers=n,
            dim=row.hidden, n_heads=row.heads, n_kv_heads=row.kv_heads,
            hidden_dim=row.ffn_hidden, vocab_size=row.vocab, max_seq_len=row.seq,
            tie_embeddings=row.tied, mlp="relu2" if family(row) == "nemotron" else "swiglu",
        )  # fmt: skip
    return with_precision(coarsen(capture(module, inputs, row.model)), precision(row))


def chunk_layers(layers: int, chunks: int) -> list[int]:
    """Layers per pipeline chunk: equal shares, the layers left over going to the middle
    chunks, evenly spread, so that the first and the last chunks (which also hold the
    embedding and the head) are the lighter ones (Llama 3 405B: 126 layers on 16 stages, 7
    on the first and the last, 8 on the others)."""
    base, extra = divmod(layers, chunks)
    out = [base] * chunks
    middle = list(range(1, chunks - 1)) or list(range(chunks))
    for k in range(extra):
        out[middle[(k * len(middle)) // extra if extra <= len(middle) else k % len(middle)]] += 1
    return out


def replica_layout(row: Published) -> tuple[tuple[int, ...], int, int]:
    """Which devices are simulated: the first and the last data-parallel replica of every
    stage (Megatron-LM's rank order: tensor innermost, then context, then data, then
    pipeline), as indices on a preset of just the nodes they occupy (every node alike on one
    non-blocking fabric: the same links between them as in the whole cluster); that preset's
    nodes; the replicas per stage simulated."""
    t, d, p = row.tp * row.cp, row.data, row.pp  # a replica: its tensor x context ranks
    group = t * d
    replicas = (0, d - 1) if d >= 2 else (0,)
    real = [s * group + r * t + k for s in range(p) for r in replicas for k in range(t)]
    nodes = sorted({x // GPUS_PER_NODE for x in real})
    compact = {n: i for i, n in enumerate(nodes)}
    keep = tuple(compact[x // GPUS_PER_NODE] * GPUS_PER_NODE + x % GPUS_PER_NODE for x in real)
    return keep, len(nodes), len(replicas)


def replica_devices(row: Published) -> tuple[Any, int]:
    """The simulated devices (`replica_layout`) and the replicas per stage among them."""
    from planner.hardware.presets import get_preset

    keep, nodes, here = replica_layout(row)
    graph = get_preset(f"{PRESETS[row.gpu]}-{nodes}")
    return graph.subset(keep, f"{graph.name}[{row.pp} x {row.tp * row.cp * here}]"), here


# -- the simulation -----------------------------------------------------------------------


def framework_options(row: Published, **overrides: Any) -> Any:
    """The training the published runs did, as cost options: mixed-precision Adam with fp32
    master weights (16 bytes per parameter), the row's ZeRO stage (the distributed optimizer
    when the row does not say) and recomputation, the kernels of Megatron-Core with
    Transformer Engine on Hopper (`CostOptions.rates` "shape", cuDNN fused attention;
    torchtitan's rows PyTorch's `scaled_dot_product_attention`, FlashAttention-2), the
    overlap of its performance recipes (`FRAMEWORK_OVERLAP["megatron-recipe"]`) and NCCL's
    rings, one per NIC (`nic_rails`). `overrides`: other cost options."""
    from planner.costs.costmodel import CostOptions
    from planner.costs.overlap import FRAMEWORK_OVERLAP

    zero = zero_stage(row)
    values: dict[str, Any] = {
        "optimizer": "adam",
        "master_weights": True,
        "zero": 1 if zero is None else zero,
        "recompute": recompute(row),
        "rates": "shape",
        "attention_kernel": "fa2" if "torchtitan" in row.source.lower() else "cudnn",
        "transfer_once": True,
        "nic_rails": True,
    }
    values |= FRAMEWORK_OVERLAP["megatron-recipe"].options()
    # Megatron-Bridge overlaps p2p only with interleaving; else batched, blocking sends
    values["pp_overlap"] = 1.0 if row.virtual > 1 else 0.0
    if row.source == LLAMA3_PAPER:  # Sec. 3.3.2: "asynchronous point-to-point communication
        # in PP"; all-gather context parallelism, "the all-gather communication latency is
        # exposed in the critical path"
        values |= {"pp_overlap": 1.0, "cp_overlap": 0.0}
    values |= FITTED
    return CostOptions(**(values | overrides))


@dataclass(frozen=True)
class Breakdown:
    """Seconds of one step on the busiest stage: its compute by class (GEMMs, attention,
    memory-bound ops, summed over its micro-batches and chunks), its exposed tensor-parallel
    communication (its busy time beyond that compute), the pipeline bubble (the step without
    messages and sync, beyond the busiest stage's busy time), the exposed point-to-point
    messages and the exposed data-parallel sync and update. They add up to the step."""

    gemm: float
    attention: float
    memory: float
    tp: float
    bubble: float
    p2p: float
    dp: float

    @property
    def step(self) -> float:
        return sum(dataclasses.astuple(self))


_KINDS = {"linear": "gemm", "matmul": "gemm", "conv2d": "gemm", "attention": "attention"}


def simulate_row(row: Published, options: Any) -> tuple[float, Breakdown]:
    """The row's step in seconds (its published layout simulated on two replicas per stage,
    the gradient sync scaled to the stage's replicas), and its breakdown."""
    from backends.pipeline.units import ring_factor
    from planner.pipeline.timeline import simulate_pipeline

    p, v, m = row.pp, row.virtual, row.micro_batches
    here = min(row.data, 2) * row.cp  # a weight's replicas: data x context ranks
    simulated, work = _chunks(_layout_key(row), options)
    scale = ring_factor(row.data * row.cp) / ring_factor(here) if here > 1 else 0.0
    chunks = [dataclasses.replace(c, sync=c.sync * scale) for c in simulated]
    schedule = "interleaved" if v > 1 else "1f1b"
    overlap = (options.pp_overlap, options.chunk_sync_share)
    full = simulate_pipeline(chunks, schedule, p, m, *overlap)
    quiet = [dataclasses.replace(c, send_forward=0.0, send_backward=0.0, sync=0.0) for c in chunks]
    no_sync = [dataclasses.replace(c, sync=0.0) for c in chunks]
    t0 = simulate_pipeline(quiet, schedule, p, m, *overlap).makespan
    t1 = simulate_pipeline(no_sync, schedule, p, m, *overlap).makespan
    busiest = max(range(p), key=lambda g: full.busy[g])
    compute = {k: m * sum(w[k] for w in work[busiest::p]) for k in ("gemm", "attention", "memory")}
    busy = full.busy[busiest]
    return full.makespan, Breakdown(
        gemm=compute["gemm"],
        attention=compute["attention"],
        memory=compute["memory"],
        tp=busy - sum(compute.values()),
        bubble=t0 - busy,
        p2p=t1 - t0,
        dp=full.makespan - t1,
    )


def _layout_key(row: Published) -> tuple[Published, tuple[int, ...], int]:
    """What a row's chunk simulation depends on: the row without its GPUs, batch and
    provenance, and its simulated devices (`replica_layout`: which of them share a node)."""
    keep, nodes, here = replica_layout(row)
    bare = dataclasses.replace(
        row, line=0, source="torchtitan" if "torchtitan" in row.source.lower() else "",
        release="", gpus=row.tp * row.cp * row.pp * here,
        gbs=here * row.micro_batch * row.pp, tokens=None, tflops=1.0, notes="",
    )  # fmt: skip
    return bare, keep, nodes


@functools.lru_cache(maxsize=64)
def _chunks(
    key: tuple[Published, tuple[int, ...], int], options: Any
) -> tuple[list[Any], list[dict[str, float]]]:
    """Every chunk's `ChunkTimes` (sync not scaled yet) and its compute per micro-batch by
    class, for a row's layout (`_layout_key`) on its simulated devices."""
    from planner.costs.costmodel import CostModel
    from planner.hardware.presets import get_preset
    from planner.pipeline.stages import chunk_problem

    row, keep, nodes = key
    graph_of = get_preset(f"{PRESETS[row.gpu]}-{nodes}")
    here = row.data
    t, c, p, v = row.tp, row.cp, row.pp, row.virtual
    devices = graph_of.subset(keep, f"{graph_of.name}[{p} x {t * c * here}]")
    graph = build_graph(row, here * row.micro_batch)
    ps = pipelined_megatron(graph, devices, row.layers, t, c, p, v)
    cm = CostModel(graph, devices, options)
    work = []
    for c in range(p * v):  # compute per micro-batch by class, on the chunk's first device
        ch = chunk_problem(cm, ps, c)
        local = CostModel(ch.graph, ch.devices, options)
        mine = {"gemm": 0.0, "attention": 0.0, "memory": 0.0}
        for i, (op, cfg) in enumerate(zip(ch.graph.ops, ch.configs, strict=True)):
            fwd, bwd = local.task_times(i, cfg)
            mine[_KINDS.get(op.kind, "memory")] += float(fwd[0] + bwd[0])
        work.append(mine)
    return micro_batch_times(cm, ps), work


def pipelined_megatron(
    graph: Any, devices: Any, layers: int, t: int, c: int, p: int, v: int, expert: int = 1
) -> Any:
    """A published layout on `devices` (p stages of equal groups, in order): `layers` blocks
    in p x v chunks (`chunk_layers`; a chunk past the last block holds the head alone),
    interleaved when v > 1, each stage laid out by Megatron-LM's rule
    (`planner.problems.baselines.megatron` at tensor t, context c and expert degree
    `expert`)."""
    from planner.pipeline.layouts import block_ranges
    from planner.pipeline.spec import Pipeline, PipelinedStrategy
    from planner.problems.baselines import megatron
    from planner.problems.strategy import Strategy

    group = devices.num_devices // p
    ranges = block_ranges(graph)
    bounds, at = [0], 0
    for k in chunk_layers(layers, p * v)[:-1]:
        at += k
        bounds.append(ranges[at][0] if at < len(ranges) else ranges[-1][1])
    bounds.append(len(graph.ops))
    groups = tuple(tuple(range(s * group, (s + 1) * group)) for s in range(p))
    pipe = Pipeline(
        tuple(bounds), groups, p * v if v > 1 else 1, "interleaved" if v > 1 else "1f1b"
    )
    inner = megatron(graph, devices.subset(range(group)), t, c, expert)
    configs = tuple(
        dataclasses.replace(
            cfg, devices=tuple(groups[pipe.chunk_of(i) % p][d] for d in cfg.devices)
        )
        for i, cfg in enumerate(inner.configs)
    )
    return PipelinedStrategy(Strategy(graph, devices, configs), pipe)


def micro_batch_times(cm: Any, ps: Any) -> list[Any]:
    """Every chunk's `ChunkTimes`, its forward and backward those of a micro-batch that
    syncs nothing: `chunk_times` simulates one micro-batch with its gradient sync, which
    runs beside its backward (`dp_overlap`) and, on links the backward's own messages use
    (keys and values between context ranks on two nodes), delays them; every micro-batch
    would pay that, where only the last one of a step syncs. So the forward and backward
    come from the same simulation with the sync after the backward, and the sync is what
    the last micro-batch takes beyond them."""
    from planner.costs.costmodel import CostModel
    from planner.pipeline.stages import chunk_times

    full = chunk_times(cm, ps)
    if cm.options.dp_overlap <= 0:
        return full
    after = dataclasses.replace(cm.options, dp_overlap=0.0)
    quiet = chunk_times(CostModel(cm.graph, cm.devices, after), ps)
    return [
        dataclasses.replace(
            f,
            forward=q.forward,
            backward=q.backward,
            sync=max(0.0, f.forward + f.backward + f.sync - q.forward - q.backward),
        )
        for f, q in zip(full, quiet, strict=True)
    ]


# -- calibration --------------------------------------------------------------------------


def configuration(row: Published) -> str:
    """A row's configuration: its source, release, model and layout, but not its scale (a
    scaling series of one layout on more GPUs is one configuration)."""
    parts = (row.source, row.release, row.model, row.tp, row.pp, row.virtual, row.mbs, row.seq)
    return "|".join(map(str, parts))


def calibration_configurations(rows: Sequence[Published]) -> set[str]:
    """The calibration subset's configurations: of those the model could express before FP8
    and context parallelism (`calibration_candidate`), the third (rounded up) with the
    smallest SHA-256 digests of `configuration` (a rule on the rows' metadata only;
    docs/calibration.md says how it came about). Every FP8 row, every row with context
    parallelism and the Llama 3 paper's rows are held out."""
    keys = sorted({configuration(r) for r in rows if calibration_candidate(r)}, key=_digest)
    return set(keys[: math.ceil(len(keys) * CALIBRATION_SHARE)])


def calibration_candidate(row: Published) -> bool:
    """Whether `row` may be in the calibration subset: a row the model expresses, in bf16,
    without context parallelism, whose virtual stages its source gives (not the Llama 3
    paper's, derived from its text)."""
    plain = row.precision.lower() == "bf16" and row.cp == 1 and row.source != LLAMA3_PAPER
    return plain and unsupported(row) is None


def held_out_kind(row: Published) -> str:
    """What kind of row a held-out row is, for the summaries: "fp8", "cp", "fp8+cp" (both),
    "frontier" (the Llama 3 paper's rows), or "bf16"."""
    if row.source == LLAMA3_PAPER:
        return "frontier"
    fp8, cp = row.precision.lower().startswith("fp8"), row.cp > 1
    return "fp8+cp" if fp8 and cp else "fp8" if fp8 else "cp" if cp else "bf16"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# The global parameters fitted on the calibration subset (`fit`, `--fit`): the fraction of
# tensor-parallel traffic Transformer Engine's userbuffers overlap leaves hidden net of
# what it costs the GEMMs it runs beside, and the share of the data-parallel sync the
# overlapped reduce hides (the recipes' 1.0 fits best), and the share of an interleaved
# stage's chunk syncs that runs under its later backwards (docs/calibration.md, "What is
# fitted").
FITTED: dict[str, float] = {"tp_overlap": 0.0, "dp_overlap": 1.0, "chunk_sync_overlap": 0.0}
FIT_GRID = {
    "tp_overlap": tuple(k / 10 for k in range(11)),
    "dp_overlap": tuple(k / 10 for k in range(11)),
    "chunk_sync_overlap": (0.0, 0.25, 0.5, 0.75, 1.0),
}


def fit(rows: Sequence[Published]) -> dict[str, float]:
    """Each parameter of `FIT_GRID` (one at a time, the others at `FITTED`): the grid value
    with the smallest median absolute error on the calibration subset's rows, ties broken
    by the mean (a parameter that moves only some rows, `chunk_sync_overlap`: the
    interleaved ones, may leave the median where it is)."""
    chosen = calibration_configurations(rows)
    mine = [r for r in rows if configuration(r) in chosen and calibration_candidate(r)]
    out = dict(FITTED)
    for name, grid in FIT_GRID.items():
        scores = []
        for value in grid:
            options = {**out, name: value}
            errors = sorted(abs(predict(r, framework_options(r, **options))["error"]) for r in mine)
            scores.append((errors[len(errors) // 2], sum(errors) / len(errors), value))
            print(f"fit {name} = {value}: median |error| {scores[-1][0]:.1%}, mean "
                  f"{scores[-1][1]:.1%} on {len(mine)} calibration rows",
                  file=sys.stderr, flush=True)  # fmt: skip
        out[name] = min(scores)[2]
    return out


def predict(row: Published, options: Any) -> dict[str, Any]:
    """The row's prediction: step, tokens/s and TFLOP/s per GPU (the row's convention), the
    error against the published figure, and the step's breakdown (shares of the step)."""
    step, parts = simulate_row(row, options)
    tokens = row.gbs * row.seq / step / row.gpus
    if row.tokens is not None:
        published = row.tokens
        per_token = row.tflops / row.tokens if row.tflops is not None else None
    else:
        assert row.tflops is not None
        per_token = nemo_flops_per_token(row) / 1e12
        published = row.tflops / per_token
    out: dict[str, Any] = {
        "step_seconds": step,
        "tokens_predicted": tokens,
        "tokens_published": published,
        "tflops_published": row.tflops,
        "tflops_predicted": tokens * per_token if per_token is not None else None,
        "error": tokens / published - 1,
    }
    out |= {f"share_{k}": v / step for k, v in dataclasses.asdict(parts).items()}
    return out


def run(rows: Sequence[Published], calibrated: bool, **overrides: Any) -> list[dict[str, Any]]:
    """Every row's record: what it is, why it is skipped or its prediction; `calibrated`:
    the rows are the default table, split into calibration and held-out rows."""
    records = []
    chosen = calibration_configurations(rows) if calibrated else set()
    for row in rows:
        mine = configuration(row) in chosen and calibration_candidate(row)
        held = "calibration" if mine else "held-out"
        rec: dict[str, Any] = {
            "line": row.line,
            "source": row.source,
            "release": row.release,
            "run": row.name,
            "model": row.model,
            "precision": row.precision,
            "kind": held_out_kind(row),
            "set": held if calibrated else "yours",
        }
        reason = unsupported(row)
        if reason is not None:
            records.append(rec | {"skipped": reason})
            continue
        t0 = time.perf_counter()
        try:
            rec |= predict(row, framework_options(row, **overrides))
        except LayerwiseError as exc:
            records.append(rec | {"skipped": f"error: {one_line(exc)}"})
            continue
        rec["assumes"] = "; ".join(assumptions(row))
        rec["seconds"] = time.perf_counter() - t0
        print(
            f"line {row.line}: {row.name}: published {rec['tokens_published']:.0f}, predicted "
            f"{rec['tokens_predicted']:.0f} tokens/s per GPU ({rec['error']:+.1%}, "
            f"{rec['set']}; {rec['seconds']:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        records.append(rec)
    return records


def summary(
    records: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], str] | None = None
) -> dict[str, dict[str, float]]:
    """Median and largest absolute error, the mean signed error, and the count, per set of
    predicted rows (or per `key` of a record)."""
    group = key or (lambda r: str(r["set"]))
    out: dict[str, dict[str, float]] = {}
    done = [r for r in records if "error" in r]
    for name in sorted({group(r) for r in done}):
        signed = [r["error"] for r in done if group(r) == name]
        errors = sorted(abs(e) for e in signed)
        mid = len(errors) // 2
        median = errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2
        out[name] = {
            "rows": len(errors),
            "median": median,
            "max": errors[-1],
            "mean": sum(signed) / len(signed),
        }
    return out


def held_out_summaries(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The held-out rows' summaries by kind (`held_out_kind`), and the FP8 and context-
    parallel rows' by model and precision."""
    held = [r for r in records if r.get("set") == "held-out"]
    out = {f"held-out {k}": v for k, v in summary(held, lambda r: r["kind"]).items()}
    new = [r for r in held if r["kind"] in ("fp8", "cp", "fp8+cp")]
    by = summary(
        new, lambda r: f"{r['model']} {r['precision']}{' CP' if 'cp' in r['kind'] else ''}"
    )
    return out | {f"  {k}": v for k, v in by.items()}


def table(records: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the predicted rows, then the skipped ones by reason."""
    head = (
        "| line | run | set | published tok/s | predicted | error | published TFLOP/s | "
        "predicted | GEMM | attn | mem | TP | bubble | p2p | DP | assumes |"
    )
    lines = [head, "|" + " --- |" * 16]
    for r in records:
        if "error" not in r:
            continue
        tflops = (
            f"{r['tflops_published']:.0f} | {r['tflops_predicted']:.0f}"
            if r["tflops_predicted"] is not None
            else "- | -"
        )
        shares = " | ".join(
            f"{r['share_' + k]:.0%}"
            for k in ("gemm", "attention", "memory", "tp", "bubble", "p2p", "dp")
        )
        lines.append(
            f"| {r['line']} | {r['run']} | {r['set']} | {r['tokens_published']:.0f} | "
            f"{r['tokens_predicted']:.0f} | {r['error']:+.1%} | {tflops} | {shares} | "
            f"{r.get('assumes', '')} |"
        )
    skipped: dict[str, int] = {}
    for r in records:
        if "skipped" in r:
            skipped[r["skipped"]] = skipped.get(r["skipped"], 0) + 1
    lines.append("")
    lines += [f"skipped, {n} rows: {reason}" for reason, n in sorted(skipped.items())]
    for name, s in (summary(records) | held_out_summaries(records)).items():
        lines.append(
            f"{name}: {s['rows']} rows, median |error| {s['median']:.1%}, max {s['max']:.1%}, "
            f"mean {s['mean']:+.1%}"
        )
    return "\n".join(lines)


def write(records: Sequence[dict[str, Any]], out: Path, meta: dict[str, Any]) -> None:
    """calibration.csv, calibration.json (with `meta` and the summary) and calibration.png."""
    from planner.files import write_text_atomic

    out.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in records:
        keys += [k for k in r if k not in keys]
    with open(out / "calibration.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(records)
    payload = {
        "meta": meta,
        "summary": summary(records) | held_out_summaries(records),
        "rows": list(records),
    }
    write_text_atomic(out / "calibration.json", json.dumps(payload, indent=2, default=str) + "\n")
    _plot(records, out / "calibration.png")


def _plot(records: Sequence[dict[str, Any]], path: Path) -> None:
    """Each predicted row's error, in file order, coloured by its set, with the +-10% and
    +-15% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if "error" in r]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = {"calibration": "tab:orange", "held-out": "tab:blue", "yours": "tab:green"}
    for name, color in colors.items():
        mine = [(k, r) for k, r in enumerate(done) if r["set"] == name]
        if mine:
            ax.bar(
                [k for k, _ in mine],
                [100 * r["error"] for _, r in mine],
                color=color,
                label=f"{name} ({len(mine)} rows)",
            )
    for level, style in ((10, ":"), (15, "--")):
        for sign in (1, -1):
            ax.axhline(sign * level, color="grey", linestyle=style, linewidth=0.8)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(done)), [str(r["line"]) for r in done], rotation=90, fontsize=6)
    ax.set(xlabel="line of the rows file", ylabel="predicted / published tokens/s - 1 (%)")
    ax.set_title("Published training runs: the error of the prediction per row")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.calibration", description=__doc__)
    p.add_argument(
        "--rows",
        type=Path,
        help=f"a CSV of published runs with the header {','.join(COLUMNS)} (default: "
        f"{ROWS.relative_to(Path(__file__).parent.parent)})",
    )
    p.add_argument("--lines", type=int, nargs="+", help="only these lines of the rows file")
    p.add_argument(
        "--fit",
        action="store_true",
        help="fit the global parameters (FITTED) on the calibration subset again and use them",
    )
    p.add_argument("--out", type=Path, default=Path("results/calibration"))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the experiment; a bad argument or rows file is one `error:` line, exit status 2."""
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    from experiments.runinfo import finish, load_line, run_info

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    info = run_info("experiments.calibration", argv, args)
    rows = read_rows(args.rows or ROWS)
    if args.lines:
        rows = [r for r in rows if r.line in set(args.lines)]
    fitted = fit(rows) if args.fit else dict(FITTED)
    records = run(rows, calibrated=args.rows is None, **fitted)
    meta = finish(info) | {"rows": str(args.rows or ROWS), "fitted": fitted}
    write(records, args.out, meta)
    print(table(records))
    print(f"wrote {args.out}/calibration.csv, .json, .png in {meta['elapsed_seconds']:.0f} s "
          f"({load_line(meta)})", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
