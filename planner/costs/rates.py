"""Achievable rates by kernel and shape: GEMMs by (m, n, k), fused attention by kernel.

One fraction of peak per op class (`Device.efficiency`) cannot be right both for a 1.7B model
on one GPU and for a 400B model's narrow tensor-parallel shards. For the GPUs a measured
calibration exists for (`ChipRates`, matched by `chip_rates`), the cost model prices:

- **a linear op's task as its three GEMMs** (`linear_gemms`): forward (m tokens x n outputs,
  contracting k inputs), the input gradient (m x k, contracting n) and the weight gradient
  (n x k, contracting the m tokens), each at `GemmFit.seconds`: a kernel's fixed time plus
  its FLOPs over the peak times `GemmFit.fraction(m, n, k)`. The fraction falls when the
  output has few tiles to spread over the GPU's SMs (small m n: narrow tensor-parallel
  shards, small micro-batches) and when the contraction is short (small k: each tile's
  fixed prologue and epilogue weigh more). Its form and constants are fitted on measured
  bf16 GEMM throughput of an H100 SXM (`experiments/data/gemm_h100_bf16.csv`, from OpenXLA's
  measured matmul table; `python -m experiments.gemm_fit` reproduces the fit and prints its
  error on the table), its ceiling is the Maximum Achievable Matmul FLOPS of the chip
  (docs/devices.md, "Precisions and achievable fractions");
- **attention by its kernel** (`AttentionKernel`): the graph records 4 s^2 h FLOPs per sample
  for the two batched matrix products (causal or not). A causal kernel skips the masked
  blocks and does half of that work; FlashAttention's and cuDNN's benchmarks count the
  same half (Dao, FlashAttention-2, Sec. 4.1; Shah et al., FlashAttention-3, Sec. 4.1), so
  forward seconds = work / the kernel's measured forward FLOP/s at that sequence length,
  backward seconds = 2.5 x work / its backward FLOP/s (five matrix products to two).

Devices without a calibration keep the flat fraction per class (docs/cost_model.md,
"Analytic mode").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.graph.opkinds import CHANNEL

if TYPE_CHECKING:
    from planner.costs.config import ParallelConfig
    from planner.graph.opgraph import Op
    from planner.hardware.devices import Device

__all__ = [
    "ATTENTION_KERNELS",
    "AttentionKernel",
    "ChipRates",
    "GemmFit",
    "H100_FP8_GEMM",
    "H100_GEMM",
    "H100_RATES",
    "attention_seconds",
    "chip_rates",
    "linear_gemms",
]

# The backward pass of attention runs five matrix products where the forward runs two
# (dS, dP, dQ, dK, dV against S, O), as the FlashAttention benchmarks count it.
ATTENTION_BACKWARD_WORK = 2.5


@dataclass(frozen=True)
class GemmFit:
    """Achievable fraction of peak of a GEMM C (m x n) = A (m x k) B (k x n) on one chip.

    fraction(m, n, k) = cap / (1 + (tiles / (m n)) ** exponent) / (1 + depth / k)

    `cap`: the fraction the largest GEMMs reach; `tiles` (output elements) and `exponent`:
    how fast a GEMM with few output tiles leaves SMs idle; `depth` (contraction elements): the
    per-tile fixed work (prologue, epilogue) in units of the contraction loop; `launch`:
    seconds every kernel takes besides its work. A batched GEMM of b problems is m = b x rows.
    """

    cap: float
    tiles: float
    exponent: float
    depth: float
    launch: float

    def fraction(self, m: float, n: float, k: float) -> float:
        """The fraction of peak the GEMM's FLOPs run at (its launch time aside)."""
        return float(self.fraction_array(np.asarray(m), np.asarray(n), np.asarray(k)))

    def fraction_array(self, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
        m, n, k = (np.asarray(x, dtype=np.float64) for x in (m, n, k))
        return self.cap / (1.0 + (self.tiles / (m * n)) ** self.exponent) / (1.0 + self.depth / k)

    def seconds(self, m: float, n: float, k: float, peak: float) -> float:
        """Seconds of one GEMM on a chip of `peak` FLOP/s."""
        return self.launch + 2.0 * m * n * k / (peak * self.fraction(m, n, k))


@dataclass(frozen=True)
class AttentionKernel:
    """Measured FLOP/s of a fused attention kernel (head dimension 128, bf16) at the
    sequence lengths `SEQUENCES`: forward causal, forward full, backward full, each in
    TFLOP/s as its benchmark counts them (a causal kernel's FLOPs halved). The causal
    backward is not published: it is estimated as the full backward times the causal
    forward's share of the full forward's rate at the same length."""

    name: str
    source: str
    forward_causal: tuple[float, ...]
    forward_full: tuple[float, ...]
    backward_full: tuple[float, ...]

    def rates(self, seq: int, causal: bool) -> tuple[float, float]:
        """(forward, backward) FLOP/s at sequence length `seq`, interpolated in log2(seq)
        between the measured lengths and held at the ends."""
        fwd_full = _interpolate(seq, self.forward_full)
        bwd_full = _interpolate(seq, self.backward_full)
        if not causal:
            return fwd_full * 1e12, bwd_full * 1e12
        fwd = _interpolate(seq, self.forward_causal)
        return fwd * 1e12, bwd_full * fwd / fwd_full * 1e12


SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)


def _interpolate(seq: int, values: tuple[float, ...]) -> float:
    x = math.log2(max(1, seq))
    return float(np.interp(x, np.log2(SEQUENCES), values))


# Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
# Low-precision" (2024), Fig. 5 (forward, bf16, head dimension 128, batch x sequence 16k,
# hidden 2,048; panels "without / with causal mask") and Fig. 6 (backward, without causal
# mask), H100 80GB SXM5; TFLOP/s at sequence lengths 512 to 16k.
_FA3_PAPER = "Shah et al. 2024 (FlashAttention-3), Fig. 5-6, H100 SXM5, head dim 128"
ATTENTION_KERNELS: Mapping[str, AttentionKernel] = {
    "cudnn": AttentionKernel(
        "cudnn",
        _FA3_PAPER + ": cuDNN",
        (315, 410, 484, 518, 529, 539),
        (497, 574, 617, 609, 600, 595),
        (305, 408, 465, 499, 518, 516),
    ),
    "fa2": AttentionKernel(
        "fa2",
        _FA3_PAPER + ": FlashAttention-2",
        (191, 260, 298, 319, 333, 335),
        (309, 350, 362, 368, 370, 370),
        (214, 260, 291, 310, 318, 322),
    ),
    "fa3": AttentionKernel(
        "fa3",
        _FA3_PAPER + ": FlashAttention-3",
        (292, 423, 521, 579, 602, 616),
        (467, 565, 625, 638, 646, 648),
        (316, 424, 501, 542, 559, 561),
    ),
}


@dataclass(frozen=True)
class ChipRates:
    """A chip's measured kernel rates: its 16-bit peak (how a device is recognised), its
    GEMM fit, its attention kernels and its FP8 GEMM fit."""

    name: str
    peak16: float
    gemm: GemmFit
    attention: Mapping[str, AttentionKernel]
    gemm8: GemmFit | None = None  # FP8 GEMMs (None: the chip has no FP8 calibration)


# H100 SXM, bf16. The cap is the Maximum Achievable Matmul FLOPS measured on an H100 SXM,
# 794.5 of 989 TFLOP/s (S. Bekman, "Machine Learning Engineering", compute/accelerator,
# "Maximum Achievable Matmul FLOPS comparison table"); the other constants are fitted on
# experiments/data/gemm_h100_bf16.csv by `python -m experiments.gemm_fit` (docs/cost_model.md,
# "GEMMs by shape").
H100_GEMM = GemmFit(cap=794.5 / 989.0, tiles=3.06e5, exponent=1.15, depth=111.1, launch=5.5e-6)
# H100 SXM, FP8 (E4M3 x E4M3 -> bf16, per-tensor scales: Transformer Engine's cuBLASLt GEMMs).
# The cap is the FP8 Maximum Achievable Matmul FLOPS of an H100 SXM, 1,402.6 of 1,979 TFLOP/s
# (the same table as the bf16 cap: S. Bekman, "Machine Learning Engineering", "Maximum
# Achievable Matmul FLOPS comparison table", FP8 float8_e4m3fn, torch 2.7.0+cu126); tiles,
# exponent and launch are the bf16 fit's; depth is fitted on DeepGEMM's dense FP8 GEMMs on an
# H800 SXM (deepseek-ai/DeepGEMM README, "Normal GEMMs for dense models", M = 4,096) by
# `python -m experiments.gemm_fit --fp8` (docs/cost_model.md, "FP8 training").
H100_FP8_GEMM = GemmFit(
    cap=1402.6 / 1979.0, tiles=3.06e5, exponent=1.15, depth=659.0, launch=5.5e-6
)
H100_RATES = ChipRates("H100 SXM", 989e12, H100_GEMM, ATTENTION_KERNELS, H100_FP8_GEMM)
CHIPS = (H100_RATES,)


def chip_rates(device: Device) -> ChipRates | None:
    """The measured rates of `device`'s chip: a GPU with calibrated fractions
    (`Device.efficiency`, the LLM-era presets and device files made from them) whose 16-bit
    peak is a calibrated chip's (an H100 or H200: the same compute); else None."""
    if device.kind != "gpu" or not device.efficiency:
        return None
    for chip in CHIPS:
        if device.flops16 is not None and math.isclose(device.flops16, chip.peak16, rel_tol=1e-6):
            return chip
    return None


def linear_gemms(op: Op, cfg: ParallelConfig) -> tuple[tuple[int, int, int], ...] | None:
    """The (m, n, k) of one task's forward GEMM of a linear op under `cfg` (m: the task's
    rows, every output dim but the channels; n: its output channels; k: its share of the
    contracted inputs), or None when the op is not a plain 2-D-weight linear. The backward
    runs (m, k, n) for the input gradient and (k, n, m) for the weight gradient."""
    if op.kind != "linear" or not op.params or len(op.params[0].shape) != 2:
        return None
    if CHANNEL not in op.output.dims:
        return None
    weight = op.params[0].shape
    k_in = int(weight[0] if op.attr("transposed") else weight[1])
    rows = 1
    n = 1
    for dim, size, degree in zip(op.output.dims, op.output.sizes, cfg.degrees, strict=True):
        if dim == CHANNEL:
            n = size // degree
        else:
            rows *= size // degree
    k = k_in // cfg.reduce
    if min(rows, n, k) < 1:
        return None
    return ((rows, n, k),)


def attended_share(seq: int, causal: bool, window: int | None = None) -> float:
    """The share of the full q x k product a masked kernel computes: 1 unmasked, 1/2 causal,
    and with a sliding window of w keys per query (Mistral 7B, arXiv 2310.06825 Sec. 2)
    (w(w+1)/2 + (seq - w) w) / seq^2 (a kernel with a window skips the blocks beyond it, as
    FlashAttention-2's does, arXiv 2307.08691)."""
    if not causal:
        return 1.0
    if not window or window >= seq:
        return 0.5
    return (window * (window + 1) / 2 + (seq - window) * window) / (seq * seq)


def attention_seconds(
    kernel: AttentionKernel,
    flops: float,
    seq: int,
    causal: bool,
    chunks: int = 1,
    window: int | None = None,
) -> tuple[float, float]:
    """(forward, backward) seconds of a task's attention whose graph records `flops` (4 s^2 h
    per sample: the full, unmasked product) at sequence length `seq`: a causal kernel does
    half the work, at its measured causal rate.

    With the queries split in `chunks` (context parallelism: the task holds s / chunks of the
    sequence and reads every key and value), the task's work runs as the kernels of ring
    attention (Megatron-Core with Transformer Engine, `AttnFuncWithCPAndKVP2P`; Liu et al.,
    "Ring Attention", 2023) on blocks of s / chunks queries and keys: for a causal mask, the
    block of its own chunk causal (1 / chunks of its work) and the blocks of the others full
    (the rest), each at the kernel's rate at length s / chunks. `flops` / tasks is the mean
    work of a task: the load-balanced order (each rank holds chunks i and 2 c - 1 - i of 2 c,
    as Megatron-LM and the Llama 3 paper order them, and as the runtime runs
    `CostOptions.cp_order` "balanced") gives every rank that share of the causal product;
    contiguous chunks scale it by their own share (`planner.costs.context.task_work`).

    A sliding window (`window` keys per query, Mistral's and Gemma's local layers) does its
    `attended_share` of the product at the causal rate, whole or split in chunks (its blocks
    beyond the window are skipped, not run full)."""
    work = flops * attended_share(seq, causal, window)
    if chunks <= 1 or not causal or (window and window < seq):
        forward, backward = kernel.rates(max(1, seq // max(1, chunks)), causal)
        return work / forward, ATTENTION_BACKWARD_WORK * work / backward
    local = max(1, seq // chunks)
    own, rest = work / chunks, work * (chunks - 1) / chunks
    fwd_causal, bwd_causal = kernel.rates(local, True)
    fwd_full, bwd_full = kernel.rates(local, False)
    forward = own / fwd_causal + rest / fwd_full
    backward = ATTENTION_BACKWARD_WORK * (own / bwd_causal + rest / bwd_full)
    return forward, backward
