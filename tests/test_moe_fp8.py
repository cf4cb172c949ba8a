"""FP8 mixtures of experts: a moe op under the "transformer-engine" precisions runs its experts'
GEMMs in FP8 (Megatron-Core's `TEGroupedLinear`; DeepSeek-V3 report, Sec. 3.3.1) and its
router in bf16, with Transformer Engine's casts, FP8 weight caches and FP8 copies kept for
the backward (`planner.costs.fp8`; docs/cost_model.md, "FP8 training")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from graphs import moe_op

from planner.costs.activations import moe_dispatched_bytes
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.experts import (
    a2a_bytes,
    expert_gemm_seconds,
    token_pass_bytes,
)
from planner.costs.fp8 import fp8_weight_elements, moe_cast_bytes
from planner.costs.rates import H100_FP8_GEMM, H100_GEMM, GemmFit
from planner.graph.moe import moe_flops, moe_spec
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.precision import computes_in_fp8, with_precision
from planner.hardware.presets import get_preset

PEAK16, PEAK8 = 989e12, 1979e12
BANDWIDTH = 3.35e12 * 0.8  # an H100's HBM3 times the default memory efficiency


def moe_graph(
    tokens: int = 8192,
    hidden: int = 4096,
    experts: int = 8,
    top_k: int = 2,
    ffn: int = 14336,
    shared: int = 0,
    name: str = "layers.0.moe",
) -> OpGraph:
    """x -> `name` (a gated moe op, stacked experts, optionally a shared expert) -> `out` (a
    linear outside the blocks), bf16; shapes only (Mixtral 8x7B's by default)."""

    def tensor() -> Tensor:
        return Tensor.of(2, sample=tokens // 1024, length=1024, channel=hidden)

    x = Op("x", "input", (), tensor())
    moe = moe_op(name, "x", tensor(), experts, top_k, ffn, shared)
    out = Op(
        "out",
        "linear",
        (name,),
        tensor(),
        (Param("out.weight", (hidden, hidden), 2),),
        flops=2.0 * tokens * hidden * hidden,
    )
    return OpGraph("moe", (x, moe, out))


def whole() -> ParallelConfig:
    return ParallelConfig((1, 1, 1), (0,))


def moe_times(graph: OpGraph, cfg: ParallelConfig | None = None, **options: object):
    cm = CostModel(graph, get_preset("dgx-h100-1"), CostOptions(**options))  # type: ignore[arg-type]
    fwd, bwd = cm.task_times(1, cfg or whole())
    return float(fwd[0]), float(bwd[0])


# -- the marking ------------------------------------------------------------------------------


def test_transformer_engine_marks_a_blocks_moe_and_its_tokens_still_travel_in_bf16() -> None:
    fp8 = with_precision(moe_graph(), "transformer-engine")
    moe = fp8.op("layers.0.moe")
    assert computes_in_fp8(moe) and moe.attr("fp8_scaling") == "delayed"
    assert with_precision(moe_graph(), "fp8-cs").op("layers.0.moe").attr("fp8_scaling") == (
        "current"
    )
    assert moe.output.dtype_bytes == 2 and all(p.dtype_bytes == 2 for p in moe.params)
    assert not computes_in_fp8(fp8.op("out"))  # outside the blocks
    cm = CostModel(fp8, get_preset("dgx-h100-1"))
    edges = {(fp8.ops[e.src].name, fp8.ops[e.dst].name): e for e in fp8.edges}
    assert cm.edge_element_bytes(edges["x", "layers.0.moe"]) == (2, 2)  # the router reads bf16
    assert cm.edge_element_bytes(edges["layers.0.moe", "out"]) == (2, 2)
    spread = ParallelConfig((8, 1, 1), tuple(range(8)), expert=8)
    assert a2a_bytes(moe, spread) == a2a_bytes(moe_graph().op("layers.0.moe"), spread)


def test_only_the_transformer_engine_precisions_mark_a_moe_of_fp8_sizes_in_a_block() -> None:
    assert computes_in_fp8(with_precision(moe_graph(), "fp8").op("layers.0.moe"))
    for precision in (None, "bf16-mixed", "bf16-true", "32-true"):
        g = with_precision(moe_graph(), precision)
        assert not any(computes_in_fp8(op) for op in g.ops), precision
    assert not computes_in_fp8(with_precision(moe_graph(name="moe"), "fp8").op("moe"))
    for sizes in ({"ffn": 24}, {"shared": 40}):  # not multiples of 16
        g = with_precision(moe_graph(tokens=1024, hidden=64, **sizes), "fp8")  # type: ignore[arg-type]
        assert not computes_in_fp8(g.op("layers.0.moe")), sizes
    fp8 = with_precision(moe_graph(), "fp8")
    assert with_precision(fp8, "bf16-true") == with_precision(moe_graph(), "bf16-true")


# -- the GEMMs ----------------------------------------------------------------------------------


def test_an_fp8_moe_runs_its_experts_at_the_fp8_fit_and_about_that_much_faster() -> None:
    """Mixtral 8x7B's expert GEMMs (8,192 tokens, 2 of 8 experts of 14,336 on one H100): the
    expert GEMMs take the FP8 fit's time, so the op's forward falls by about the fits' ratio
    at their shapes (the router, the token passes and the casts stay memory- or bf16-bound)."""
    g16, g8 = moe_graph(), with_precision(moe_graph(), "transformer-engine")
    op16, op8 = g16.op("layers.0.moe"), g8.op("layers.0.moe")
    gemms16 = expert_gemm_seconds(op16, whole(), H100_GEMM, PEAK16, 1.0)
    gemms8 = expert_gemm_seconds(op8, whole(), H100_GEMM, PEAK16, 1.0, (H100_FP8_GEMM, PEAK8))
    bf16, fp8 = moe_times(g16), moe_times(g8)
    casts = moe_cast_bytes(op8, whole(), 1.0)
    assert fp8[0] - bf16[0] == pytest.approx(gemms8[0] - gemms16[0] + casts[0] / BANDWIDTH)
    assert fp8[1] - bf16[1] == pytest.approx(gemms8[1] - gemms16[1] + casts[1] / BANDWIDTH)
    rows = 8192 * 2  # the 8 local experts' rows as one grouped GEMM: w1, w3, then w2

    def routed(fit: GemmFit, peak: float) -> float:
        return 2 * fit.seconds(rows, 14336, 4096, peak) + fit.seconds(rows, 4096, 14336, peak)

    fits = routed(H100_FP8_GEMM, PEAK8) / routed(H100_GEMM, PEAK16)
    assert gemms8[0] / gemms16[0] == pytest.approx(fits, rel=0.01)  # (+ the bf16 router)
    assert 0.6 < fits < 0.7
    assert 0.6 < fp8[0] / bf16[0] < 0.8


def test_the_router_stays_bf16() -> None:
    """With expert GEMMs that take no time, what is left of the GEMMs is the router's at the
    bf16 fit and peak; at flat rates the router's FLOPs run at the bf16 rate."""
    op = with_precision(moe_graph(), "transformer-engine").op("layers.0.moe")
    instant = replace(H100_FP8_GEMM, launch=0.0)
    fwd, bwd = expert_gemm_seconds(op, whole(), H100_GEMM, PEAK16, 1.0, (instant, 1e40))
    assert fwd == pytest.approx(H100_GEMM.seconds(8192, 8, 4096, PEAK16))
    assert bwd == pytest.approx(
        H100_GEMM.seconds(8192, 4096, 8, PEAK16) + H100_GEMM.seconds(8, 4096, 8192, PEAK16)
    )
    g = with_precision(moe_graph(), "transformer-engine")
    flat = CostModel(g, get_preset("dgx-h100-1"), CostOptions(rates="flat", task_overhead=0.0))
    parts = moe_flops(moe_spec(op), 4096, 8192)
    want = parts.router / (PEAK16 * 0.7) + (parts.experts + parts.shared) / (PEAK8 * 0.7)
    passes = moe_cast_bytes(op, whole(), 1.0)[0] + token_pass_bytes(op, whole(), 1.0)
    assert flat.task_times(1, whole())[0][0] == pytest.approx(want + passes / BANDWIDTH)


def test_the_shared_expert_runs_in_fp8_too() -> None:
    op = with_precision(moe_graph(shared=2048), "fp8").op("layers.0.moe")
    bf16 = expert_gemm_seconds(op, whole(), H100_GEMM, PEAK16, 1.0)
    fp8 = expert_gemm_seconds(op, whole(), H100_GEMM, PEAK16, 1.0, (H100_FP8_GEMM, PEAK8))
    routed = moe_graph().op("layers.0.moe")
    gap = (
        expert_gemm_seconds(routed, whole(), H100_GEMM, PEAK16, 1.0)[0]
        - expert_gemm_seconds(routed, whole(), H100_GEMM, PEAK16, 1.0, (H100_FP8_GEMM, PEAK8))[0]
    )
    shared16 = 2 * H100_GEMM.seconds(8192, 2048, 4096, PEAK16)
    shared16 += H100_GEMM.seconds(8192, 4096, 2048, PEAK16)
    shared8 = 2 * H100_FP8_GEMM.seconds(8192, 2048, 4096, PEAK8)
    shared8 += H100_FP8_GEMM.seconds(8192, 4096, 2048, PEAK8)
    assert bf16[0] - fp8[0] == pytest.approx(gap + shared16 - shared8)


# -- the casts ----------------------------------------------------------------------------------


def test_the_casts_of_each_expert_gemm_are_counted() -> None:
    """Per routed row: X cast before fc1 (3 h), the activation's output before fc2 (3 f);
    backward: dY of fc2 cast and transposed (4 h), of fc1 (4 x 2 f), the saved FP8 inputs
    transposed (2 h + 2 f). Current scaling reads X and dY once more (2 bytes each)."""
    h, f, rows = 4096, 14336, 8192 * 2
    op = with_precision(moe_graph(), "transformer-engine").op("layers.0.moe")
    assert moe_cast_bytes(op, whole(), 1.0) == (
        3.0 * rows * (h + f),
        rows * (4.0 * 2 * f + 2 * h + 4 * h + 2 * f),
    )
    cs = with_precision(moe_graph(), "transformer-engine-cs").op("layers.0.moe")
    current = moe_cast_bytes(cs, whole(), 1.0)
    assert current[0] - 3.0 * rows * (h + f) == 2.0 * rows * (h + f)
    spread = ParallelConfig((8, 1, 1), tuple(range(8)), expert=8)  # the busiest: 1.5 x rows
    assert moe_cast_bytes(op, spread, 1.5)[0] == 3.0 * rows / 8 * 1.5 * (h + f)
    assert moe_cast_bytes(moe_graph().op("layers.0.moe"), whole(), 1.0) == (0.0, 0.0)
    shared = with_precision(moe_graph(shared=2048), "fp8").op("layers.0.moe")
    assert moe_cast_bytes(shared, whole(), 1.0)[0] == 3.0 * rows * (h + f) + 3.0 * 8192 * (h + 2048)


# -- memory -------------------------------------------------------------------------------------


def test_the_experts_weights_keep_fp8_caches_the_router_does_not() -> None:
    g16, g8 = moe_graph(shared=2048), with_precision(moe_graph(shared=2048), "fp8")
    op = g8.op("layers.0.moe")
    h, f, fs, e = 4096, 14336, 2048, 8
    routed, shared = e * 3 * h * f, 3 * h * fs
    assert fp8_weight_elements(op) == routed + shared
    devices = get_preset("dgx-h100-1")
    cm8, cm16 = CostModel(g8, devices), CostModel(g16, devices)
    assert cm8.param_state(op).weights == cm16.param_state(g16.op("layers.0.moe")).weights + 2 * (
        routed + shared
    )
    spread = ParallelConfig((8, 1, 1), tuple(range(8)), expert=8)
    weights8 = cm8._param_parts(1, spread)[0]
    weights16 = cm16._param_parts(1, spread)[0]
    assert weights8 - weights16 == pytest.approx(2 * (routed / 8 + shared))


def test_an_fp8_moe_keeps_fp8_copies_of_its_gemm_inputs() -> None:
    """Per token (in bytes over the 2 h of its output): the k dispatched copies and the k
    activations' products at 1 byte instead of 2; the shared expert's product too, and its
    FP8 copy of the token; the token itself stays kept in bf16 (the router's input)."""
    h, f, fs, k = 4096, 14336, 2048, 2
    g16, g8 = moe_graph(shared=fs), with_precision(moe_graph(shared=fs), "fp8")
    devices = get_preset("dgx-h100-1")
    kept16 = CostModel(g16, devices).activations.kept
    kept8 = CostModel(g8, devices).activations.kept
    assert kept8[0] == kept16[0] == 1.0  # x, read by the router
    saved = (k * (h + f) + fs - h) / (2 * h)
    assert kept16[1] - kept8[1] == pytest.approx(saved)
    op8, op16 = g8.op("layers.0.moe"), g16.op("layers.0.moe")
    assert (moe_dispatched_bytes(op16) - moe_dispatched_bytes(op8)) / h == pytest.approx(
        k * (h + f) / (2 * h)
    )
    assert np.isclose(moe_dispatched_bytes(op16) / h, k * (2 * h + 3 * f) / h)
