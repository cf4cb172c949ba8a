"""FP8 training as Transformer Engine runs it: the FP8 peak of a device, the precision that marks
the linears that compute in FP8, their GEMM rates, Transformer Engine's casts, the FP8 tensors
moved and kept (`planner.costs.fp8`; docs/cost_model.md, "FP8 training")."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from experiments.gemm_fit import FP8_TABLE, H100_FP8_PEAK, load_table, predicted_tflops
from planner.costs.config import OpConfigs, ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions, compute_peak
from planner.costs.fp8 import cast_bytes
from planner.costs.rates import H100_FP8_GEMM, H100_GEMM, chip_rates
from planner.errors import DeviceGraphError, LayerwiseError
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.graph.precision import check_precision, computes_in_fp8, with_precision
from planner.hardware.devices import Device, DeviceGraph
from planner.hardware.presets import get_preset

ROWS, N, K = 8192, 8192, 8192


def block_graph(rows: int = ROWS, n: int = N, k: int = K) -> OpGraph:
    """x -> norm -> `layers.0.fc` (rows x n, k inputs) -> `head` (n -> 1,000): a block's
    linear and a head outside the blocks, bf16."""
    x = Op("x", "input", (), Tensor.of(2, sample=rows, channel=k))
    norm = Op(
        "layers.0.norm",
        "norm",
        ("x",),
        Tensor.of(2, sample=rows, channel=k),
        attrs=Op.make_attrs({"norm": "rms"}),
    )
    fc = Op(
        "layers.0.fc",
        "linear",
        ("layers.0.norm",),
        Tensor.of(2, sample=rows, channel=n),
        (Param("layers.0.fc.weight", (n, k), 2),),
        flops=2.0 * rows * n * k,
    )
    head = Op(
        "head",
        "linear",
        ("layers.0.fc",),
        Tensor.of(2, sample=rows, channel=1000),
        (Param("head.weight", (1000, n), 2),),
        flops=2.0 * rows * 1000 * n,
    )
    return OpGraph("block", (x, norm, fc, head))


def task_times(graph: OpGraph, name: str, cfg: ParallelConfig | None = None, **options: object):
    cm = CostModel(graph, get_preset("dgx-h100-1"), CostOptions(**options))  # type: ignore[arg-type]
    i = graph.index(name)
    cfg = cfg or ParallelConfig((1,) * len(graph.ops[i].output.dims), (0,))
    fwd, bwd = cm.task_times(i, cfg)
    return float(fwd[0]), float(bwd[0])


# -- the FP8 peak --------------------------------------------------------------------------


def test_the_h100_and_h200_have_the_datasheets_fp8_peak_and_others_their_16_bit_one() -> None:
    for preset in ("dgx-h100-1", "dgx-h200-1"):
        d = get_preset(preset).devices[0]
        assert d.flops8 == 1979e12 and d.peak8 == 1979e12  # H100/H200 SXM, dense
    a100 = get_preset("dgx-a100-1").devices[0]
    assert a100.flops8 is None and a100.peak8 == a100.peak16 == 312e12
    assert compute_peak(a100, "linear", 2, fp8=True) == 312e12  # no FP8 tensor cores


def test_the_fp8_peak_goes_through_json_and_is_checked() -> None:
    g = get_preset("dgx-h100-1")
    data = json.loads(json.dumps(g.to_json()))
    assert data["devices"][0]["flops8"] == 1979e12
    assert DeviceGraph.from_json(data) == g
    del data["devices"][0]["flops8"]
    assert DeviceGraph.from_json(data).devices[0].peak8 == 989e12
    with pytest.raises(DeviceGraphError, match="flops8 must be finite and > 0"):
        replace(g.devices[0], flops8=-1.0)
    data["devices"][1]["flops8"] = "fast"
    with pytest.raises(DeviceGraphError, match='"flops8" must be a number'):
        DeviceGraph.from_json(data)


# -- the precision ---------------------------------------------------------------------------


def test_transformer_engine_marks_the_blocks_linears_and_keeps_bf16_elsewhere() -> None:
    fp8 = with_precision(block_graph(), "transformer-engine")
    assert [op.name for op in fp8.ops if computes_in_fp8(op)] == ["layers.0.fc"]
    fc = fp8.op("layers.0.fc")
    assert fc.attr("fp8_scaling") == "delayed" and fc.output.dtype_bytes == 2
    assert all(p.dtype_bytes == 2 for op in fp8.ops for p in op.params)  # bf16 weights
    assert all(op.output.dtype_bytes == 2 for op in fp8.ops)
    cs = with_precision(block_graph(), "fp8-cs")  # alias of "transformer-engine-cs"
    assert cs.op("layers.0.fc").attr("fp8_scaling") == "current"
    assert check_precision("fp8") == "transformer-engine"


def test_the_rewrite_is_idempotent_and_another_precision_drops_it() -> None:
    g = block_graph()
    fp8 = with_precision(g, "transformer-engine")
    assert with_precision(fp8, "transformer-engine") == fp8
    assert with_precision(fp8, "bf16-true") == with_precision(g, "bf16-true")
    assert not any(computes_in_fp8(op) for op in with_precision(fp8, "bf16-mixed").ops)


def test_a_linear_fp8_gemms_cannot_take_stays_bf16() -> None:
    g = with_precision(block_graph(n=8200), "transformer-engine")  # 8,200 outputs: not % 16
    assert not any(computes_in_fp8(op) for op in g.ops)
    with pytest.raises(LayerwiseError, match="fp8"):
        check_precision("mxfp8")


# -- the GEMMs and the casts ----------------------------------------------------------------


def test_the_fp8_gemm_fit_has_the_fp8_ceiling_and_its_fitted_depth() -> None:
    """cap: the H100's FP8 Maximum Achievable Matmul FLOPS (1,402.6 of 1,979 TFLOP/s); the
    depth fitted on DeepGEMM's dense FP8 GEMMs predicts them within 13% (median 2.3%)."""
    assert H100_FP8_GEMM.cap == pytest.approx(1402.6 / 1979)
    assert H100_FP8_GEMM.tiles == H100_GEMM.tiles and H100_FP8_GEMM.depth > H100_GEMM.depth
    table = load_table(FP8_TABLE)
    err = np.abs(predicted_tflops(H100_FP8_GEMM, table, H100_FP8_PEAK) / table["tflops"] - 1)
    assert np.median(err) < 0.03 and err.max() < 0.13
    assert chip_rates(get_preset("dgx-h100-1").devices[0]).gemm8 is H100_FP8_GEMM


def test_an_fp8_linear_runs_its_three_gemms_at_the_fp8_fit_plus_its_casts() -> None:
    fp8 = with_precision(block_graph(), "transformer-engine")
    fwd, bwd = task_times(fp8, "layers.0.fc")
    gemm = H100_FP8_GEMM.seconds(ROWS, N, K, 1979e12)
    casts = cast_bytes(fp8.op("layers.0.fc"), ParallelConfig((1, 1), (0,)), ROWS, N, K)
    bandwidth = 3.35e12 * 0.8
    assert casts == (3.0 * ROWS * K, 4.0 * ROWS * N + 2.0 * ROWS * K)
    assert fwd == pytest.approx(gemm + casts[0] / bandwidth)
    assert bwd == pytest.approx(2 * gemm + casts[1] / bandwidth)
    bf16 = task_times(block_graph(), "layers.0.fc")
    assert 1.4 < bf16[0] / fwd < 2.0  # FP8 against bf16: twice the peak, a lower ceiling
    head = task_times(fp8, "head"), task_times(block_graph(), "head")
    assert head[0] == head[1]  # the head stays bf16


def test_current_scaling_reads_each_tensor_once_more_and_a_row_parallel_casts_its_shard() -> None:
    fc = with_precision(block_graph(), "transformer-engine").op("layers.0.fc")
    cs = with_precision(block_graph(), "transformer-engine-cs").op("layers.0.fc")
    whole = ParallelConfig((1, 1), (0,))
    delayed, current = cast_bytes(fc, whole, ROWS, N, K), cast_bytes(cs, whole, ROWS, N, K)
    assert current[0] - delayed[0] == 2.0 * ROWS * K
    assert current[1] - delayed[1] == 2.0 * ROWS * N
    column = ParallelConfig((1, 4), tuple(range(4)))  # X cast on each rank's quarter
    assert cast_bytes(fc, column, ROWS, N // 4, K)[0] == 3.0 * ROWS * K / 4
    row = ParallelConfig((1, 1), tuple(range(4)), reduce=4)  # dY cast on the shard, gathered
    assert cast_bytes(fc, row, ROWS, N, K // 4)[1] == (
        3.0 * ROWS * N / 4 + 2.0 * ROWS * N + 2.0 * ROWS * K // 4
    )
    assert cast_bytes(block_graph().op("layers.0.fc"), whole, ROWS, N, K) == (0.0, 0.0)


def test_flat_rates_run_an_fp8_linear_at_the_fp8_peak() -> None:
    fp8 = with_precision(block_graph(), "transformer-engine")
    cm = CostModel(fp8, get_preset("dgx-h100-1"), CostOptions(rates="flat"))
    assert cm.compute_rate(fp8.op("layers.0.fc"))[0] == pytest.approx(1979e12 * 0.7)
    assert cm.compute_rate(fp8.op("head"))[0] == pytest.approx(989e12 * 0.7)


# -- what moves and what is kept --------------------------------------------------------------


def test_the_input_of_an_fp8_linear_and_its_output_gradient_travel_in_one_byte() -> None:
    g = block_graph()
    fp8 = with_precision(g, "transformer-engine")
    devices = get_preset("dgx-h100-1")
    edges = {(fp8.ops[e.src].name, fp8.ops[e.dst].name): e for e in fp8.edges}
    into, out = edges["layers.0.norm", "layers.0.fc"], edges["layers.0.fc", "head"]
    cm, cm16 = CostModel(fp8, devices), CostModel(g, devices)
    assert cm.edge_element_bytes(into) == (1, 2)  # X cast before its gather; dX in bf16
    assert cm.edge_element_bytes(out) == (2, 1)  # Y in bf16; dY cast before its gather
    assert cm16.edge_element_bytes(into) == (2, 2)
    # an all-gather of the norm's row shards into a column-parallel linear: half the time
    shards = ParallelConfig((4, 1), (0, 1, 2, 3))
    column = ParallelConfig((1, 4), (0, 1, 2, 3))
    forward = cm.transfer_time(into, shards, column)
    assert forward < cm16.transfer_time(into, shards, column)
    tables = cm.edge_table(into, _configs(shards), _configs(column))
    assert tables[0, 0] == pytest.approx(forward)


def _configs(cfg: ParallelConfig) -> OpConfigs:
    """OpConfigs of one config (its own group)."""
    sets = np.asarray([cfg.devices], dtype=np.int64)
    return OpConfigs((cfg,), ((cfg.grid, sets, np.array([0])),))


def test_an_fp8_linear_keeps_its_inputs_fp8_copy_and_its_weights_fp8_caches() -> None:
    g = block_graph()
    fp8 = with_precision(g, "transformer-engine")
    devices = get_preset("dgx-h100-1")
    norm = g.index("layers.0.norm")
    stats = 4 / (K * 2)  # the RMS norm's fp32 statistics per byte of its output
    assert CostModel(g, devices).activations.kept[norm] == pytest.approx(1.0 + stats)
    assert CostModel(fp8, devices).activations.kept[norm] == pytest.approx(0.5 + stats)
    fc = fp8.op("layers.0.fc")
    assert CostModel(fp8, devices).param_state(fc).weights == 4 * N * K  # bf16 + FP8 x 2
    assert CostModel(g, devices).param_state(g.op("layers.0.fc")).weights == 2 * N * K


def test_a_device_file_without_flops8_keeps_its_16_bit_peak_for_fp8() -> None:
    d = Device("g", "gpu", 1e13, 1e12, 2**30, "h", flops16=1e14)
    assert d.peak8 == 1e14
    assert replace(d, flops8=2e14).peak8 == 2e14


def test_fused_consumers_cast_their_shared_input_once() -> None:
    """With `transfer_once` (Megatron-Core's fused QKV and gate/up projections: one linear),
    the FP8 linears reading one tensor share its cast and transpose."""
    g = block_graph()
    twin = replace(g.op("layers.0.fc"), name="layers.0.fc2")
    fp8 = with_precision(OpGraph("twins", (*g.ops[:3], twin)), "transformer-engine")
    devices = get_preset("dgx-h100-1")
    cfg = ParallelConfig((1, 1), (0,))
    apart = CostModel(fp8, devices)._fp8_casts(fp8.op("layers.0.fc"), cfg)
    fused = CostModel(fp8, devices, CostOptions(transfer_once=True))._fp8_casts(
        fp8.op("layers.0.fc"), cfg
    )
    assert fused[0] == apart[0] / 2  # X cast once for both
    assert apart[1] - fused[1] == pytest.approx(2.0 * ROWS * K / 2)  # X transposed once
