"""`python -m experiments.memory_published`: the memory per GPU of published training runs.

Every run listed here trained on its GPUs (80 GB A100s or H100s) with the layout given; the
planner must estimate that it fits them: its peak per GPU no more than the memory less what
a plan keeps free by default (`planner.costs.memory.DEFAULT_HEADROOM` and `DEFAULT_RESERVE`:
74 of 80 GiB). Per run and pipeline stage, the estimate is:

- the run's model captured with three blocks at its micro-batch (bf16), laid out by
  Megatron-LM's rule at its tensor degree with sequence parallelism
  (`planner.problems.baselines.megatron`), its three units simulated once
  (`backends.pipeline.units.unit_costs`: the embedding and block 0, a middle block, the last
  block with the head and the loss) and composed into the run's chunks, `layers` blocks in
  all, as the run split them (uneven where it did: Megatron's `account_for_embedding_in_
  pipeline_split`, Meta's lighter first and last stages);
- the schedule's timeline of those chunks (`planner.pipeline.timeline.simulate_pipeline`):
  per stage its parameters with their training state, the activations of the micro-batches
  it has in flight (1F1B: p - s on stage s; interleaved more, each of fewer layers) and the
  largest working set (a recomputed region, or the loss's logits gradient);
- training as the runs did: bf16 weights and gradients, Adam with fp32 master weights and
  moments (16 bytes per parameter), sharded over the data-parallel replicas where the run
  used Megatron's distributed optimizer (ZeRO 1; `distopt`), its recomputation.

Approximations, each said in the table's notes: one data-parallel replica is simulated (the
others hold the same activations; the optimizer state is scaled to the run's replicas:
`units.scale_factors`, per parameter class); context parallelism of c splits each sequence c ways (each GPU keeps
the activations of s / c tokens, ring attention's received keys and values are transient)
and its ranks share the optimizer state as data-parallel ones do; FP8 runs are counted with
bf16 activations (FP8 keeps less: an upper bound).

`--before` runs the same layouts through the cost model as it was before activations were
counted as frameworks keep them (every op's output kept; no selective recomputation: such
rows as "none"): run this module from a checkout of that code with `--before` to get the
column docs/cost_model.md shows beside today's.

Writes `memory_published.csv` and `.json` to `--out` (default results/memory_published).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 2**30


@dataclass(frozen=True)
class Run:
    """A published training run: the model, the layout it trained with and where it says so.
    `split`: blocks per pipeline chunk where the run cut them unevenly (else equal)."""

    name: str
    source: str
    arch: str  # "gpt" (GPT-2/3: learned positions, GELU, dropout 0.1, tied head) or "llama"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gpus: int
    gbs: int
    mbs: int
    tp: int
    pp: int
    cp: int = 1
    vp: int = 1
    recompute: str = "none"
    zero: int = 1  # 1: Megatron's distributed optimizer; 0: none (SC'21)
    gpu: str = "h100"
    split: tuple[int, ...] | None = None

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def micro_batches(self) -> int:
        return self.gbs // (self.mbs * self.dp)

    @property
    def schedule(self) -> str:
        return "interleaved" if self.vp > 1 else "1f1b"

    def blocks_per_chunk(self) -> tuple[int, ...]:
        chunks = self.pp * self.vp
        if self.split is not None:
            assert len(self.split) == chunks and sum(self.split) == self.layers, self
            return self.split
        assert self.layers % chunks == 0, self
        return (self.layers // chunks,) * chunks

    def layout(self) -> str:
        parts = [f"TP {self.tp}", f"PP {self.pp}"]
        parts += [f"VP {self.vp}"] * (self.vp > 1) + [f"CP {self.cp}"] * (self.cp > 1)
        parts += [f"DP {self.dp}", f"MBS {self.mbs}", f"GBS {self.gbs}", f"seq {self.seq}"]
        return ", ".join(parts)


MB = "docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html"
NEMO = "github.com/NVIDIA/NeMo/blob/main/docs/source/performance/performance_summary.md"
DGXC = "github.com/NVIDIA/dgxc-benchmarking"
META = "arxiv.org/abs/2407.21783 (The Llama 3 Herd of Models, Sec. 3.3.2, Table 4)"
SC21 = "Narayanan et al., SC'21, Table 1 (examples/sc21/run_table_1.sh)"
LLAMA3_70B: dict[str, Any] = {"arch": "llama", "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
              "ffn": 28672, "vocab": 128256, "seq": 8192}  # fmt: skip
LLAMA31_405B: dict[str, Any] = {"arch": "llama", "layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8,
                "ffn": 53248, "vocab": 128256, "seq": 8192}  # fmt: skip
GPT3_175B: dict[str, Any] = {"arch": "gpt", "layers": 96, "hidden": 12288, "heads": 96, "kv_heads": 96,
             "ffn": 49152, "vocab": 51200, "seq": 2048}  # fmt: skip
LLAMA2_70B: dict[str, Any] = {"arch": "llama", "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
              "ffn": 28672, "vocab": 32000, "seq": 4096}  # fmt: skip

# experiments/data/h100_published.csv's dense rows with pipelines (the memory-heavy ones)
H100_RUNS = (
    Run("Llama3-70B", MB, **LLAMA3_70B, gpus=64, gbs=128, mbs=1, tp=4, pp=8, vp=5),
    Run("Llama3-70B", NEMO, **LLAMA3_70B, gpus=64, gbs=128, mbs=1, tp=4, pp=4, cp=2, vp=5),
    Run("Llama3.1-70B", DGXC, **LLAMA3_70B, gpus=64, gbs=128, mbs=1, tp=4, pp=4, cp=2, vp=5),
    Run("Llama2-70B", NEMO, **LLAMA2_70B, gpus=64, gbs=128, mbs=1, tp=4, pp=4, vp=20),
    Run(
        "GPT3-175B",
        NEMO,
        **GPT3_175B,
        gpus=128,
        gbs=256,
        mbs=1,
        tp=4,
        pp=8,
        vp=6,
        recompute="selective",
    ),
    Run(
        "GPT3-175B",
        NEMO,
        **GPT3_175B,
        gpus=512,
        gbs=2048,
        mbs=2,
        tp=4,
        pp=8,
        vp=6,
        recompute="selective",
    ),
    Run(
        "GPT3-175B",
        DGXC,
        **GPT3_175B,
        gpus=128,
        gbs=256,
        mbs=1,
        tp=4,
        pp=8,
        vp=12,
        recompute="selective",
    ),
    # 126 layers in 64 chunks: the first and last hold one block (and the embedding, the head)
    Run(
        "Llama3.1-405B",
        MB,
        **LLAMA31_405B,
        gpus=1024,
        gbs=512,
        mbs=1,
        tp=8,
        pp=8,
        cp=2,
        vp=8,
        split=(1, *(2,) * 62, 1),
    ),
    # Meta's: one block fewer on the first and the last of 16 stages
    Run(
        "Llama3.1-405B",
        META,
        **LLAMA31_405B,
        gpus=16384,
        gbs=2048,
        mbs=1,
        tp=8,
        pp=16,
        split=(7, *(8,) * 14, 7),
    ),
)


def sc21_runs() -> tuple[Run, ...]:
    """Megatron-LM SC'21 Table 1's pipelined rows (A100 80 GB; full recomputation, no ZeRO),
    with the micro-batches and schedules `experiments.megatron.PIPELINE_RUNS` gives."""
    from experiments.megatron import PIPELINE_RUNS, SEQ, TABLE1, VOCAB

    out = []
    for row in TABLE1:
        if row.pipeline == 1:
            continue
        run = PIPELINE_RUNS[row.row]
        out.append(
            Run(
                f"GPT-{row.billions}B (row {row.row})",
                SC21,
                "gpt",
                row.layers,
                row.hidden,
                row.heads,
                row.heads,
                4 * row.hidden,
                VOCAB,
                SEQ,
                row.gpus,
                row.batch,
                run.micro_batch,
                row.tensor,
                row.pipeline,
                vp=run.virtual,
                recompute="full",
                zero=0,
                gpu="a100",
            )  # fmt: skip
        )
    return tuple(out)


def build(run: Run) -> Any:
    """The run's model with three blocks, at what one tensor-parallel group of one replica
    computes per micro-batch: mbs sequences of seq / cp tokens (its share under context
    parallelism)."""
    from planner.graph.capture import capture
    from planner.graph.llm import build_llm

    seq = run.seq // run.cp
    if run.arch == "gpt":
        module, inputs = build_llm(
            "gpt2", batch=run.mbs, seq=seq, dtype="bfloat16", n_layer=3,
            n_head=run.heads, n_embd=run.hidden, vocab_size=run.vocab, block_size=seq,
        )  # fmt: skip
    else:
        module, inputs = build_llm(
            "llama2-7b", batch=run.mbs, seq=seq, dtype="bfloat16", n_layers=3,
            n_heads=run.heads, n_kv_heads=run.kv_heads, dim=run.hidden, hidden_dim=run.ffn,
            vocab_size=run.vocab, max_seq_len=seq,
        )  # fmt: skip
    return capture(module, inputs, run.name)


def options(run: Run, before: bool) -> Any:
    """The run's training as cost options (before: the old code's, which had no selective
    recomputation and no reserve)."""
    from planner.costs.costmodel import CostOptions

    recompute = "none" if before and run.recompute == "selective" else run.recompute
    return CostOptions(optimizer="adam", master_weights=True, zero=run.zero, recompute=recompute)


def usable(run: Run) -> float:
    """Bytes of one of the run's 80 GiB GPUs a plan may use by default."""
    try:
        from planner.costs.memory import DEFAULT_HEADROOM, DEFAULT_RESERVE
    except ImportError:  # --before, in a checkout of the code before them: today's values
        DEFAULT_HEADROOM, DEFAULT_RESERVE = 0.05, 2 * GiB  # noqa: N806
    return 80 * GiB * (1 - DEFAULT_HEADROOM) - DEFAULT_RESERVE


def estimate(run: Run, before: bool = False) -> dict[str, Any]:
    """Per stage, the run's peak bytes per GPU and what it holds."""
    from backends.pipeline.units import unit_costs
    from planner.hardware.presets import get_preset
    from planner.pipeline.timeline import simulate_pipeline

    t0 = time.perf_counter()
    graph = build(run)
    family = "dgx-h100" if run.gpu == "h100" else "dgx-a100-80g"
    devices = get_preset(f"{family}-{max(1, 2 * run.tp // 8)}")
    group = devices.subset(list(range(run.tp)), f"{devices.name}[tp {run.tp}]")
    units = unit_costs(graph, devices, group, run.tp, options(run, before), run.tp,
                       replicas=run.dp * run.cp)  # fmt: skip
    split = run.blocks_per_chunk()
    chunks = [units.chunk(c, len(split), k) for c, k in enumerate(split)]
    timeline = simulate_pipeline(chunks, run.schedule, run.pp, run.micro_batches)
    parts = getattr(timeline, "peak_parts", ()) or [{} for _ in timeline.peak_bytes]
    return {
        "run": run.name,
        "source": run.source,
        "layout": run.layout(),
        "recompute": run.recompute,
        "zero": run.zero,
        "micro_batches": run.micro_batches,
        "in_flight": list(timeline.in_flight),
        "peak_gib": [b / GiB for b in timeline.peak_bytes],
        "parts_gib": [{k: v / GiB for k, v in p.items()} for p in parts],
        "max_gib": max(timeline.peak_bytes) / GiB,
        "usable_gib": usable(run) / GiB,
        "fits": max(timeline.peak_bytes) <= usable(run),
        "seconds": time.perf_counter() - t0,
    }


def table(records: Sequence[dict[str, Any]]) -> str:
    lines = ["| run | layout | recompute | peak GiB per stage (first, ..., last) | max | fits 74 GiB |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in records:
        stages = r["peak_gib"]
        shown = ", ".join(f"{g:.1f}" for g in stages)
        lines.append(
            f"| {r['run']} | {r['layout']} | {r['recompute']} | {shown} | {r['max_gib']:.1f} | "
            f"{'yes' if r['fits'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/memory_published"))
    parser.add_argument("--before", action="store_true", help="the old memory rule's column")
    parser.add_argument("--only", help="runs whose name contains this")
    args = parser.parse_args(argv)
    runs = [*H100_RUNS, *sc21_runs()]
    if args.only:
        runs = [r for r in runs if args.only in r.name]
    records = []
    for run in runs:
        record = estimate(run, args.before)
        records.append(record)
        print(f"{run.name} ({run.layout()}): max {record['max_gib']:.1f} GiB in "
              f"{record['seconds']:.1f} s", file=sys.stderr)  # fmt: skip
    print(table(records))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "memory_published_before" if args.before else "memory_published"
    (args.out / f"{name}.json").write_text(json.dumps(records, indent=1))
    with (args.out / f"{name}.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "source", "layout", "recompute", "stage", "peak_gib", "fits"])
        for r in records:
            for s, g in enumerate(r["peak_gib"]):
                writer.writerow([r["run"], r["source"], r["layout"], r["recompute"], s, f"{g:.3f}", r["fits"]])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
