"""Published training runs, as rows of a CSV: what each says, and what the cost model can
express of it (`python -m experiments.calibration`, docs/calibration.md).

A row (`COLUMNS`) gives a dense decoder-only model (layers, hidden and MLP sizes, heads and
key/value heads, vocabulary, tied embedding), the GPUs, the precision, the batch (sequence,
GBS, MBS), the layout (TP, PP, CP, VP, EP, the data-parallel sharding, sequence
parallelism, recomputation) and the measured tokens/s and TFLOP/s per GPU.
`read_rows` parses a file (one LayerwiseError naming the file, line and column of a bad
value), `unsupported` says why a row cannot be simulated, `assumptions` what the simulation
assumes where the row does not say.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import LayerwiseError

ROWS = Path(__file__).parent / "data" / "h100_published.csv"
COLUMNS = [
    "source",
    "release",
    "model",
    "layers",
    "hidden",
    "ffn_hidden",
    "heads",
    "kv_heads",
    "vocab",
    "tied",
    "gpus",
    "gpu",
    "precision",
    "seq",
    "gbs",
    "mbs",
    "tp",
    "pp",
    "cp",
    "vp",
    "ep",
    "fsdp",
    "sequence_parallel",
    "recompute",
    "recompute_layers",
    "tokens_per_sec_per_gpu",
    "tflops_per_gpu",
    "notes",
]
PRESETS = {"H100-SXM-80GB": "dgx-h100", "H200": "dgx-h200", "H200-SXM-141GB": "dgx-h200"}
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Published:
    """One published run: the model, the GPUs, the layout, the measured throughput."""

    line: int
    source: str
    release: str
    model: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    gpus: int
    gpu: str
    precision: str
    seq: int
    gbs: int
    mbs: int | None
    tp: int
    pp: int
    cp: int
    vp: int | None
    ep: int
    fsdp: str
    sequence_parallel: bool
    recompute: str
    recompute_layers: int | None
    tokens: float | None
    tflops: float | None
    notes: str
    missing: tuple[str, ...] = ()  # required columns left empty (0 above)

    @property
    def data(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def micro_batch(self) -> int:
        """Samples per replica per micro-batch (1 when the source does not say)."""
        return self.mbs or 1

    @property
    def virtual(self) -> int:
        """Model chunks per stage (1 when the row does not say: `unsupported` refuses a
        pipelined row that does not)."""
        return self.vp or 1

    @property
    def micro_batches(self) -> int:
        return self.gbs // (self.micro_batch * self.data)

    @property
    def name(self) -> str:
        layout = f"TP{self.tp} PP{self.pp}" + (f" CP{self.cp}" if self.cp > 1 else "")
        layout += f" VP{self.virtual}" if self.virtual > 1 else ""
        fp8 = f" {self.precision.upper()}" if self.precision.lower().startswith("fp8") else ""
        return f"{self.model} {self.gpus} GPUs {layout} GBS {self.gbs}{fp8}"


_INTS = ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "gpus", "seq", "gbs")
_INTS += ("tp", "pp", "cp", "ep")
_OPTIONAL_INTS = ("mbs", "vp", "recompute_layers")


def read_rows(path: Path) -> list[Published]:
    """The rows of a published-runs CSV (`COLUMNS`); LayerwiseError naming the file, line
    and column of the first bad value."""
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise LayerwiseError(
                    f"{path}: missing column(s) {', '.join(missing)}; a rows file needs the "
                    f"header {','.join(COLUMNS)}"
                )
            return [_row(path, n, raw) for n, raw in enumerate(reader, start=2)]
    except OSError as exc:
        raise LayerwiseError(f"cannot read rows file {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise LayerwiseError(f"{path} is not a CSV file: {exc}") from None


def _row(path: Path, line: int, raw: dict[str, str | None]) -> Published:
    def text(col: str) -> str:
        return (raw.get(col) or "").strip()

    def number(col: str, optional: bool = False, kind: type = int) -> Any:
        value = text(col)
        if not value and optional:
            return None
        try:
            parsed = kind(value)
        except ValueError:
            parsed = None
        if parsed is None or not parsed > 0 or not math.isfinite(parsed):
            what = "a positive integer" if kind is int else "a positive number"
            raise LayerwiseError(f"{path}:{line}: column {col!r} must be {what}, got {value!r}")
        return parsed

    values: dict[str, Any] = {c: number(c, optional=True) for c in _INTS}
    values["missing"] = tuple(c for c in _INTS if values[c] is None)
    values |= {c: 0 for c in values["missing"]}
    values |= {c: number(c, optional=True) for c in _OPTIONAL_INTS}
    for col, key in (("tokens_per_sec_per_gpu", "tokens"), ("tflops_per_gpu", "tflops")):
        values[key] = number(col, optional=True, kind=float)
    for col in ("source", "release", "model", "gpu", "precision", "fsdp", "recompute", "notes"):
        values[col] = text(col)
    values["tied"] = text("tied").lower() == "true"
    values["sequence_parallel"] = text("sequence_parallel").lower() == "true"
    if values["tokens"] is None and values["tflops"] is None:
        raise LayerwiseError(
            f"{path}:{line}: give tokens_per_sec_per_gpu or tflops_per_gpu (both are empty)"
        )
    return Published(line=line, **values)


def family(row: Published) -> str | None:
    """ "gpt", "nemotron" (squared ReLU), "llama" (SwiGLU), or None (not a zoo block)."""
    name = row.model.lower()
    if "gpt" in name and "oss" not in name:
        return "gpt"
    if "nemotron" in name:
        return "nemotron"
    if any(k in name for k in ("llama", "mistral", "qwen")):
        return "llama"
    return None


# Precisions a row may give, and the `planner.graph.precision` name each trains in
PRECISIONS = {"bf16": None, "fp8": "transformer-engine", "fp8-cs": "transformer-engine-cs"}
LLAMA3_PAPER = "arxiv.org/abs/2407.21783"  # the Llama 3 paper's rows (Table 4)


def unsupported(row: Published) -> str | None:
    """Why the cost model cannot express `row` (None: it can)."""
    if row.missing:
        return f"no {', '.join(row.missing)} given"
    checks = (
        (row.ep > 1 or "moe" in row.notes.lower(), "mixture of experts: no expert layers"),
        (
            "finetun" in row.release.lower(),
            "fine-tuning on packed sequences: attention within each packed sequence, whose "
            "lengths are not given",
        ),
        (
            row.precision.lower() not in PRECISIONS,
            f"precision {row.precision!r} is not priced (bf16, fp8, fp8-cs)",
        ),
        (row.gpu not in PRESETS, f"no preset for the GPU {row.gpu!r}"),
        (family(row) is None, f"{row.model!r} is not a Llama, Nemotron or GPT block"),
        (row.gpus % (row.tp * row.pp * row.cp) != 0, "TP x PP x CP does not divide the GPUs"),
        (row.tp > GPUS_PER_NODE, "tensor parallelism beyond one 8-GPU node"),
        (row.gpus % GPUS_PER_NODE != 0, "GPUs are not whole 8-GPU nodes"),
    )
    for failed, reason in checks:
        if failed:
            return reason
    if row.gbs % (row.micro_batch * row.data):
        return f"GBS {row.gbs} is not a multiple of MBS x DP = {row.micro_batch * row.data}"
    if row.pp > 1 and row.vp is None:
        return "pipelined without its virtual stages: the schedule's bubble is not known"
    if row.virtual > 1 and row.micro_batches % row.pp:
        return "interleaved schedule needs micro-batches that the stages divide"
    if row.layers < row.pp * row.virtual - 2:
        return "fewer layers than pipeline chunks, the embedding's and the head's aside"
    if family(row) == "gpt" and (row.ffn_hidden != 4 * row.hidden or row.kv_heads != row.heads):
        return "GPT block with other than a 4h MLP and one key/value head per head"
    if row.recompute not in ("none", "full", "selective", "unknown"):
        return f"recompute {row.recompute!r}"
    return None


def assumptions(row: Published) -> list[str]:
    """What the simulation assumes where the row does not say."""
    out = []
    if row.mbs is None:
        out.append("MBS 1")
    if row.recompute == "unknown":
        out.append(f"recompute {recompute(row)} (the framework's default)")
    if row.recompute == "selective":
        out.append("selective recomputation timed as none")
    if zero_stage(row) is None:
        out.append("distributed optimizer")
    if row.tokens is None:
        out.append("tokens/s from TFLOP/s by NeMo's formula")
    if family(row) == "gpt" and not row.tied:
        out.append("embedding tied")
    return out


def precision(row: Published) -> str | None:
    """The `planner.graph.precision` name of the row's training: None for bf16 (the graph is
    captured in bf16), Transformer Engine's FP8 with delayed scaling for "fp8" (the recipes'
    default: NeMo's `fp8_hybrid`, Megatron-Bridge's "FP8"), with current scaling for
    "fp8-cs"; torchtitan's float8 (torchao's `Float8Linear`, tensorwise dynamic scaling: the
    tensor's own amax, as current scaling) as current scaling."""
    name = PRECISIONS[row.precision.lower()]
    if name == "transformer-engine" and "torchtitan" in row.source.lower():
        return "transformer-engine-cs"
    return name


def recompute(row: Published) -> str:
    """The row's recomputation: as published, else the framework's default for these
    models: MaxText's GPU configurations rematerialise every layer (`remat_policy: 'full'`,
    MaxText/configs/a3/llama_2_70b), NeMo's and Megatron-Bridge's pretraining recipes none.
    Selective recomputation (attention's core, Korthikanti et al. 2022) is timed as none:
    it recomputes under 3% of these models' FLOPs."""
    if row.recompute == "full":
        return "full"
    if row.recompute == "unknown" and "maxtext" in (row.source + row.release).lower():
        return "full"
    return "none"


def zero_stage(row: Published) -> int | None:
    """ZeRO stage of the row's data parallelism: the distributed optimizer 1, a sharded
    data-parallel layout (Megatron-FSDP, FSDP2, JAX FSDP) 3, None when it does not say."""
    kind = row.fsdp.lower()
    if kind.startswith(("mfsdp", "fsdp2", "fsdp:")):
        return 3
    if kind.startswith("fsdp-like"):  # the Llama 3 paper: optimizer state and gradients
        return 2  # sharded, weights not resharded after the forward (Sec. 3.3.2)
    if kind.startswith("distopt"):
        return 1
    if kind in ("none", "ddp", "0"):
        return 0
    return None


def nemo_flops_per_token(row: Published) -> float:
    """Training FLOPs per token by NeMo's formula (nemo/utils/flops_formulas.py: forward and
    backward, no recomputation, full s^2 attention, the LM head): 12 L h^2 (1 + g / a) +
    (18 or 12) L h f + 12 L h s + 6 V h."""
    layers, h, f, s, v = row.layers, row.hidden, row.ffn_hidden, row.seq, row.vocab
    mlp = 12 if family(row) in ("nemotron", "gpt") else 18
    attention = 12 * layers * h * h * (1 + row.kv_heads / row.heads)
    return attention + mlp * layers * h * f + 12 * layers * h * s + 6 * v * h


# -- the model and the layout -------------------------------------------------------------
