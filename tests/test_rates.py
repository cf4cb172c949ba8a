"""Kernel rates by shape (`planner.costs.rates`): the GEMM fit against its measured table,
linears priced as their three GEMMs, attention by kernel, and where the flat fraction stays."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.gemm_fit import errors, fit_table, load_table, predicted_tflops
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.rates import ATTENTION_KERNELS, H100_GEMM, GemmFit, chip_rates
from planner.errors import LayerwiseError
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.hardware.presets import get_preset

PEAK = 989e12


def linear_graph(rows: int, n: int, k: int, dtype_bytes: int = 2) -> OpGraph:
    """x (rows, k) -> fc (rows, n), bf16 by default."""
    x = Op("x", "input", (), Tensor.of(dtype_bytes, sample=rows, channel=k))
    fc = Op(
        "fc",
        "linear",
        ("x",),
        Tensor.of(dtype_bytes, sample=rows, channel=n),
        (Param("fc.weight", (n, k), dtype_bytes),),
        flops=2.0 * rows * n * k,
    )
    return OpGraph("fc", (x, fc))


def attention_graph(seq: int, causal: bool, batch: int = 1, hidden: int = 2048) -> OpGraph:
    q = Op("q", "input", (), Tensor.of(2, sample=batch, length=seq, channel=hidden))
    attn = Op(
        "attn",
        "attention",
        ("q", "q", "q"),
        Tensor.of(2, sample=batch, length=seq, channel=hidden),
        flops=4.0 * batch * seq * seq * hidden,
        attrs=Op.make_attrs({"causal": causal, "heads": hidden // 128}),
    )
    return OpGraph("attn", (q, attn))


def times(graph: OpGraph, preset: str = "dgx-h100-1", **options: object) -> tuple[float, float]:
    cm = CostModel(graph, get_preset(preset), CostOptions(**options))  # type: ignore[arg-type]
    i = len(graph.ops) - 1
    cfg = ParallelConfig((1,) * len(graph.ops[i].output.dims), (0,))
    fwd, bwd = cm.task_times(i, cfg)
    return float(fwd[0]), float(bwd[0])


def test_the_gemm_fit_matches_its_measured_table() -> None:
    """The H100 fit's error on the 150 measured GEMMs (experiments/data/gemm_h100_bf16.csv):
    median 3.3%, at most 18.3% on the transformer-sized ones; one flat fraction (0.7 of
    peak, the preset's) is off by a median 13% there, and twofold over the table."""
    table = load_table()
    fit = errors(H100_GEMM, table)
    assert fit["rows"] == 150 and fit["large_rows"] == 57
    assert fit["median"] < 0.04 and fit["large_median"] < 0.05 and fit["large_max"] < 0.2
    flat = np.abs(0.7 * PEAK / 1e12 / table["tflops"] - 1)
    assert np.median(flat) > 1.0  # small GEMMs: far below 0.7 of peak
    assert fit["max"] < 0.4


def test_the_fit_reproduces_the_constants_the_cost_model_uses() -> None:
    fitted = fit_table(load_table())
    assert fitted.cap == H100_GEMM.cap == pytest.approx(794.5 / 989)
    for name in ("tiles", "exponent", "depth", "launch"):
        assert getattr(fitted, name) == pytest.approx(getattr(H100_GEMM, name), rel=0.02)


def test_a_gemm_runs_slower_when_narrow_or_short() -> None:
    big = H100_GEMM.fraction(8192, 8192, 8192)
    assert 0.75 < big < H100_GEMM.cap
    assert H100_GEMM.fraction(8192, 128, 8192) < 0.9 * big  # a narrow shard: few tiles
    assert H100_GEMM.fraction(8192, 8192, 128) < 0.6 * big  # a short contraction
    assert H100_GEMM.fraction(256, 256, 256) < 0.15 * big  # and its launch comes on top


def test_the_predicted_table_uses_the_batch_as_rows() -> None:
    table = load_table()
    one = {k: v[:1] for k, v in table.items()}
    fit = GemmFit(1.0, 1.0, 1.0, 1.0, 0.0)
    rows = one["batch"] * one["m"]
    expected = fit.fraction_array(rows, one["n"], one["k"]) * PEAK / 1e12
    assert predicted_tflops(fit, one) == pytest.approx(expected)


def test_a_bf16_linear_on_an_h100_is_its_three_gemms() -> None:
    rows, n, k = 4096, 1024, 8192
    fwd, bwd = times(linear_graph(rows, n, k))
    assert fwd == pytest.approx(H100_GEMM.seconds(rows, n, k, PEAK))
    expected = H100_GEMM.seconds(rows, k, n, PEAK) + H100_GEMM.seconds(n, k, rows, PEAK)
    assert bwd == pytest.approx(expected)  # input gradient + weight gradient
    flat_fwd, flat_bwd = times(linear_graph(rows, n, k), rates="flat")
    assert flat_fwd == pytest.approx(2 * rows * n * k / (0.7 * PEAK))  # the preset's 0.7
    assert flat_bwd == pytest.approx(2 * flat_fwd)
    assert fwd < flat_fwd  # this GEMM reaches more than 0.7 of peak


def test_a_split_linear_prices_its_tasks_shape() -> None:
    graph = linear_graph(4096, 1024, 8192)
    cm = CostModel(graph, get_preset("dgx-h100-1"))
    column = ParallelConfig((2, 4), tuple(range(8)))  # 4096/2 rows, 1024/4 outputs
    row = ParallelConfig((2, 1), tuple(range(8)), reduce=4)  # 8192/4 of the contraction
    assert cm.task_times(1, column)[0][0] == pytest.approx(H100_GEMM.seconds(2048, 256, 8192, PEAK))
    assert cm.task_times(1, row)[0][0] == pytest.approx(H100_GEMM.seconds(2048, 1024, 2048, PEAK))


def test_a_given_fraction_and_other_chips_and_dtypes_stay_flat() -> None:
    graph = linear_graph(4096, 4096, 4096)
    flops = 2 * 4096**3
    assert times(graph, matmul_efficiency=0.5)[0] == pytest.approx(flops / (0.5 * PEAK))
    # the A100 80 GB (Megatron-LM SC'21) has no measured GEMM table: its preset's 0.7
    assert times(graph, "dgx-a100-80g-1")[0] == pytest.approx(flops / (0.7 * 312e12))
    # the 40 GB A100 preset has no calibration at all: the options' 0.5
    assert times(graph, "dgx-a100-1")[0] == pytest.approx(flops / (0.5 * 312e12))
    fp32 = linear_graph(4096, 4096, 4096, dtype_bytes=4)  # the table is bf16
    assert times(fp32)[0] == pytest.approx(flops / (0.7 * 67e12))


def test_causal_attention_does_half_the_work_at_the_kernels_measured_rate() -> None:
    for seq in (2048, 8192):
        flops = 4.0 * seq * seq * 2048
        for name, kernel in ATTENTION_KERNELS.items():
            fwd, bwd = times(attention_graph(seq, True), attention_kernel=name)
            rate, back = kernel.rates(seq, True)
            assert fwd == pytest.approx(flops / 2 / rate)
            assert bwd == pytest.approx(2.5 * flops / 2 / back)
            full, _ = times(attention_graph(seq, False), attention_kernel=name)
            assert full == pytest.approx(flops / kernel.rates(seq, False)[0])
            assert fwd < full  # half the work, at a lower rate
    fa2, fa3 = (times(attention_graph(8192, True), attention_kernel=k)[0] for k in ("fa2", "fa3"))
    assert fa3 < 0.6 * fa2  # FlashAttention-3: 602 against 333 TFLOP/s at 8k (Shah et al.)


def test_attention_rates_are_interpolated_and_held_at_the_ends() -> None:
    cudnn = ATTENTION_KERNELS["cudnn"]
    assert cudnn.rates(4096, False)[0] == pytest.approx(609e12)
    assert cudnn.rates(100, False) == cudnn.rates(512, False)
    assert cudnn.rates(10**6, True) == cudnn.rates(16384, True)
    middle = cudnn.rates(2896, False)[0]  # about sqrt(2048 * 4096)
    assert 609e12 < middle < 617e12


def test_the_h100_and_h200_presets_have_the_h100_rates_and_others_none() -> None:
    for name in ("dgx-h100-1", "dgx-h200-1"):
        rates = chip_rates(get_preset(name).devices[0])
        assert rates is not None and rates.gemm == H100_GEMM
    for name in ("dgx-a100-80g-1", "dgx-a100-1", "p100-1x2"):
        assert chip_rates(get_preset(name).devices[0]) is None


def test_bad_rate_options_are_refused_in_one_line() -> None:
    with pytest.raises(LayerwiseError, match="rates must be 'shape'"):
        CostOptions(rates="fast")  # type: ignore[arg-type]
    with pytest.raises(LayerwiseError, match="attention_kernel must be one of"):
        CostOptions(attention_kernel="fa4")  # type: ignore[arg-type]
