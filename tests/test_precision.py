"""Precision in the analytic cost model: the compute peak an op's dtype and kind pick, the
achievable fraction per op class (docs/cost_model.md, "Analytic mode"), the device fields that
carry them and their JSON (docs/devices.md), and the LLM-era presets."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from graphs import attention_block

from planner.cli import main
from planner.costs.config import ParallelConfig
from planner.costs.costmodel import (
    CostModel,
    CostOptions,
    compute_efficiency_of,
    compute_peak,
    efficiency_class,
)
from planner.errors import DeviceGraphError, LayerwiseError
from planner.graph.opgraph import Op, OpGraph, Param, Tensor
from planner.hardware.devices import Device, DeviceGraph, Link
from planner.hardware.presets import get_preset, list_presets, preset_device_count

ONE = ParallelConfig((1, 1), (0,))  # one task on device 0 (a 2-d output: sample, channel)


def mlp(dtype_bytes: int, n: int = 4096, c: int = 4096) -> OpGraph:
    """x (n, c) -> linear c -> relu, every tensor in `dtype_bytes` floats: the linear is
    compute-bound on every GPU preset, the relu memory-bound."""
    x = Op("x", "input", (), Tensor.of(dtype_bytes, sample=n, channel=c))
    fc = Op(
        "fc",
        "linear",
        ("x",),
        Tensor.of(dtype_bytes, sample=n, channel=c),
        params=(Param("fc.weight", (c, c), dtype_bytes), Param("fc.bias", (c,), dtype_bytes)),
        flops=2.0 * n * c * c,
    )
    relu = Op("relu", "elementwise", ("fc",), fc.output, flops=float(n * c))
    return OpGraph(f"mlp{dtype_bytes}", (x, fc, relu))


def seconds(graph: OpGraph, devices: DeviceGraph, op: str, **options: object) -> float:
    """t_c of `op` as one task on device 0."""
    cm = CostModel(graph, devices, CostOptions(**options))  # type: ignore[arg-type]
    return cm.compute_time(graph.index(op), ONE)


def with_devices(devices: DeviceGraph, **fields: object) -> DeviceGraph:
    """`devices` with `fields` replaced on every device."""
    changed = [replace(d, **fields) for d in devices.devices]  # type: ignore[arg-type]
    return DeviceGraph(devices.name, changed, devices.links, devices.switches)


def roofline(flops: float, rate: float, nbytes: float, bandwidth: float) -> float:
    """t_c of one task: the forward roofline times 1 + backward_factor (2)."""
    return 3 * max(flops / rate, nbytes / (bandwidth * 0.8))


# -- the peak an op's dtype picks --------------------------------------------------------------


@pytest.mark.parametrize("preset", ["dgx-a100-1", "dgx-a100-80g-1"])
def test_bf16_linear_is_16x_faster_than_float32_on_an_a100(preset: str) -> None:
    devices = get_preset(preset)
    fp32, bf16 = seconds(mlp(4), devices, "fc"), seconds(mlp(2), devices, "fc")
    assert fp32 / bf16 == pytest.approx(312 / 19.5, rel=1e-12)  # 16x
    a100 = devices.devices[0]
    rate = 312e12 * (a100.efficiency_of("matmul") or 0.5)
    op = mlp(2).op("fc")
    nbytes = 2 * op.output.nbytes + op.param_bytes  # input + output + weights
    assert op.flops / rate > nbytes / (a100.mem_bandwidth * 0.8)  # compute-bound in bf16 too
    assert bf16 == pytest.approx(roofline(op.flops, rate, nbytes, a100.mem_bandwidth), rel=1e-12)


def test_a_memory_bound_op_is_unaffected_by_the_peak() -> None:
    a100 = get_preset("dgx-a100-1")
    no_tensor_cores = with_devices(a100, flops16=None, flops_tf32=None)
    for dtype in (2, 4):
        relu = seconds(mlp(dtype), a100, "relu")
        assert relu == seconds(mlp(dtype), no_tensor_cores, "relu")
        assert relu == seconds(mlp(dtype), a100, "relu", tf32=True)
        op = mlp(dtype).op("relu")
        assert relu == pytest.approx(3 * 2 * op.output.nbytes / (1555e9 * 0.8), rel=1e-12)
    # half the bytes, half the time: bf16 moves half of float32's bytes
    assert seconds(mlp(2), a100, "relu") == pytest.approx(seconds(mlp(4), a100, "relu") / 2)
    # the linear does see the tensor cores
    assert seconds(mlp(2), a100, "fc") < seconds(mlp(2), no_tensor_cores, "fc") / 10


def test_tf32_is_off_by_default_and_speeds_up_float32_matmuls_only() -> None:
    a100 = get_preset("dgx-a100-1")
    fp32 = seconds(mlp(4), a100, "fc")
    assert seconds(mlp(4), a100, "fc", tf32=False) == fp32
    assert fp32 / seconds(mlp(4), a100, "fc", tf32=True) == pytest.approx(156 / 19.5, rel=1e-12)
    assert seconds(mlp(2), a100, "fc", tf32=True) == seconds(mlp(2), a100, "fc")  # bf16: no


def test_float64_runs_at_half_fp32_unless_the_device_gives_its_peak() -> None:
    p100 = get_preset("p100-1x1")  # no FP64 figure: FP32 / 2
    assert p100.devices[0].flops64 is None
    ratio = seconds(mlp(8), p100, "fc") / seconds(mlp(4), p100, "fc")
    assert ratio == pytest.approx(2.0, rel=1e-12)
    k80 = get_preset("k80-1x1")  # GK210: FP64 at a third of FP32
    ratio = seconds(mlp(8), k80, "fc") / seconds(mlp(4), k80, "fc")
    assert ratio == pytest.approx(3.0, rel=1e-12)


def test_compute_peak_by_kind_and_dtype() -> None:
    d = Device("g", "gpu", 10e12, 1e12, 2**30, "h", flops16=100e12, flops_tf32=40e12)
    assert compute_peak(d, "linear", 2) == compute_peak(d, "attention", 2) == 100e12
    assert compute_peak(d, "conv2d", 4) == 10e12 and compute_peak(d, "lstm", 4, tf32=True) == 40e12
    assert compute_peak(d, "elementwise", 2) == compute_peak(d, "norm", 4, tf32=True) == 10e12
    assert compute_peak(d, "linear", 8) == compute_peak(d, "softmax", 8) == 5e12
    assert [efficiency_class(k) for k in ("linear", "conv2d", "lstm", "rnn_attention")] == [
        "matmul"
    ] * 4
    assert efficiency_class("attention") == "attention"
    assert efficiency_class("elementwise") is None and efficiency_class("embedding") is None


# -- the fraction of peak per op class ---------------------------------------------------------


def test_per_class_fractions_apply_in_order_options_device_default() -> None:
    graph = attention_block()  # embedding, attention, linear, softmax
    plain = get_preset("v100-dgx1-1")
    calibrated = with_devices(plain, efficiency={"matmul": 0.8, "attention": 0.25})

    def rates(devices: DeviceGraph, **options: object) -> dict[str, float]:
        cm = CostModel(graph, devices, CostOptions(**options))  # type: ignore[arg-type]
        return {op.name: float(cm.compute_rate(op)[0]) for op in graph.ops[1:]}  # no input

    fp32 = 15.7e12
    assert rates(plain) == {k: fp32 * 0.5 for k in ("embed", "attn", "proj", "loss")}
    got = rates(calibrated)
    assert (got["proj"], got["attn"]) == (fp32 * 0.8, fp32 * 0.25)
    assert got["embed"] == got["loss"] == fp32 * 0.5  # memory-bound: compute_efficiency
    got = rates(calibrated, matmul_efficiency=0.6, compute_efficiency=0.3)
    assert (got["proj"], got["attn"], got["loss"]) == (fp32 * 0.6, fp32 * 0.25, fp32 * 0.3)
    got = rates(plain, attention_efficiency=0.1)
    assert (got["proj"], got["attn"]) == (fp32 * 0.5, fp32 * 0.1)
    # the fraction divides the compute-bound time
    bound = seconds(mlp(4), plain, "fc") / seconds(mlp(4), plain, "fc", matmul_efficiency=1.0)
    assert bound == pytest.approx(2.0, rel=1e-12)


def test_the_llm_presets_carry_calibrated_fractions_the_older_ones_do_not() -> None:
    options = CostOptions()
    h100 = get_preset("dgx-h100-1").devices[0]
    a100 = get_preset("dgx-a100-80g-1").devices[0]
    assert compute_efficiency_of(h100, "linear", options) == 0.7
    assert compute_efficiency_of(h100, "attention", options) == 0.35
    assert compute_efficiency_of(a100, "attention", options) == 0.5
    assert compute_efficiency_of(a100, "elementwise", options) == 0.5
    for name in ("dgx-a100-1", "p100-1x1", "v100-dgx1-1", "k80-1x1"):
        assert get_preset(name).devices[0].efficiency == ()


def test_cost_options_refuse_bad_fractions_in_one_line() -> None:
    for bad in ({"matmul_efficiency": 0.0}, {"attention_efficiency": 1.5}, {"tf32": "yes"}):
        with pytest.raises(LayerwiseError) as info:
            CostOptions(**bad)  # type: ignore[arg-type]
        assert next(iter(bad)) in str(info.value) and "\n" not in str(info.value)


def test_default_options_keep_float32_times_bit_for_bit() -> None:
    graph = attention_block()
    for name in ("dgx-a100-1", "p100-1x4", "k80-1x2", "v100-dgx1-2"):
        devices = get_preset(name)
        cm = CostModel(graph, devices)
        for i, op in enumerate(graph.ops):
            if op.kind == "input":
                continue
            cfg = ParallelConfig((1,) * len(op.output.dims), (0,))
            flops, nbytes = cm._task_work(op)
            fwd = max(
                flops / (devices.devices[0].flops * 0.5),
                nbytes / (devices.devices[0].mem_bandwidth * 0.8),
            )
            assert cm.task_times(i, cfg)[0][0] == fwd  # exactly: as before precisions


# -- device fields and JSON --------------------------------------------------------------------


def strip(data: dict[str, object]) -> dict[str, object]:
    """A device file as written before precisions: no peaks but FP32, no efficiency."""
    out = json.loads(json.dumps(data))
    for d in out["devices"]:
        for field in ("flops16", "flops_tf32", "flops64", "efficiency"):
            d.pop(field, None)
    return out


def test_an_old_device_file_loads_with_its_old_fingerprint() -> None:
    old = strip(get_preset("v100-dgx1-2").to_json())
    g = DeviceGraph.from_json(old)
    assert g.fingerprint() == "31370d01d1d9f0dd"  # v100-dgx1-2's before this change
    assert all(d.peak16 == d.flops == d.peak_tf32 and d.peak64 == d.flops / 2 for d in g.devices)
    assert g.to_json() == old and g != get_preset("v100-dgx1-2")
    old = strip(get_preset("dgx-a100-1").to_json())
    assert DeviceGraph.from_json(old).fingerprint() == "a74ee06af1de35ec"


@pytest.mark.parametrize("name", ["dgx-h100-2", "dgx-a100-80g-1", "k80-1x2", "v100-dgx1-2"])
def test_json_round_trip_with_the_new_fields(name: str) -> None:
    g = get_preset(name)
    data = json.loads(json.dumps(g.to_json()))
    loaded = DeviceGraph.from_json(data)
    assert loaded == g and loaded.fingerprint() == g.fingerprint() and hash(loaded) == hash(g)
    assert loaded.fingerprint() != DeviceGraph.from_json(strip(data)).fingerprint()


def test_the_json_holds_only_the_fields_a_device_gives() -> None:
    h100 = get_preset("dgx-h100-1").to_json()["devices"][0]
    assert h100["efficiency"] == {"attention": 0.35, "matmul": 0.7}
    assert (h100["flops"], h100["flops16"], h100["flops_tf32"]) == (67e12, 989e12, 494.5e12)
    assert h100["flops8"] == 1979e12
    cpu = get_preset("cpu-local-2").to_json()["devices"][0]
    assert not {"flops16", "flops_tf32", "flops64", "flops8", "efficiency"} & set(cpu)


def test_devices_that_differ_in_a_peak_are_no_hierarchy() -> None:
    g = get_preset("dgx-a100-1")
    assert g.hierarchy() is not None
    devices = list(g.devices)
    devices[3] = replace(devices[3], flops16=100e12)
    assert DeviceGraph(g.name, devices, g.links, g.switches).hierarchy() is None
    devices[3] = replace(g.devices[3], efficiency={"matmul": 0.9})
    assert DeviceGraph(g.name, devices, g.links, g.switches).hierarchy() is None


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("flops16", -1.0, "flops16 must be finite and > 0"),
        ("flops_tf32", 0, "flops_tf32 must be finite and > 0"),
        ("flops64", float("inf"), "flops64 must be finite and > 0"),
        ("flops16", "fast", "malformed"),
        ("efficiency", {"conv": 0.5}, "each must be one of"),
        ("efficiency", {"matmul": 2}, "in (0, 1]"),
        ("efficiency", {"matmul": "high"}, "fraction of peak"),
        ("efficiency", [0.5], "must be an object"),
    ],
)
def test_bad_values_are_one_line_errors(field: str, value: object, says: str) -> None:
    data = two_gpus().to_json()
    data["devices"][0][field] = value
    with pytest.raises(DeviceGraphError) as info:
        DeviceGraph.from_json(data)
    assert says in str(info.value) and "\n" not in str(info.value)


def two_gpus() -> DeviceGraph:
    gpus = [Device(f"g{k}", "gpu", 1e12, 1e11, 2**30, "h") for k in range(2)]
    return DeviceGraph("pair", gpus, [Link("g0", "g1", 1e9, 1e-6)])


# -- presets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_the_llm_presets_build_with_the_right_counts_and_figures(nodes: int) -> None:
    a100, h100 = get_preset(f"dgx-a100-80g-{nodes}"), get_preset(f"dgx-h100-{nodes}")
    for g in (a100, h100):
        assert g.num_devices == 8 * nodes == preset_device_count(g.name)
        assert len({d.host for d in g.devices}) == nodes
        hierarchy = g.hierarchy()
        assert hierarchy is not None and hierarchy.sizes == ((nodes, 8) if nodes > 1 else (8,))
    d = a100.devices[0]
    assert (d.flops, d.flops16, d.flops_tf32, d.mem_bandwidth) == (19.5e12, 312e12, 156e12, 2039e9)
    assert d.memory == 80 * 2**30
    d = h100.devices[0]
    assert (d.flops, d.flops16, d.mem_bandwidth, d.memory) == (67e12, 989e12, 3.35e12, 80 * 2**30)
    assert h100.inv_bandwidth[0, 1] == 1 / 450e9  # NVLink 4 through NVSwitch
    if nodes > 1:
        assert a100.inv_bandwidth[0, 8] == 1 / 25e9  # HDR: 200 Gb/s per GPU
        assert h100.inv_bandwidth[0, 8] == 1 / 50e9  # NDR: 400 Gb/s per GPU
        assert sum(link.kind == "infiniband" for link in h100.links) == 8 * nodes


def test_the_40_gb_a100_gains_its_16_bit_peak_and_keeps_the_rest() -> None:
    d = get_preset("dgx-a100-1").devices[0]
    assert (d.flops, d.flops16, d.flops_tf32, d.memory) == (19.5e12, 312e12, 156e12, 40 * 2**30)
    assert d.mem_bandwidth == 1555e9 and d.efficiency == ()


def test_the_h200_is_an_h100_with_more_and_faster_memory() -> None:
    """NVIDIA H200 datasheet: 141 GB of HBM3e at 4.8 TB/s, the H100's compute; the DGX
    H200's NVLink 4 (450 GB/s per direction per GPU) and one 400 Gb/s NDR NIC per GPU."""
    h100, h200 = get_preset("dgx-h100-2"), get_preset("dgx-h200-2")
    d = h200.devices[0]
    assert (d.memory, d.mem_bandwidth) == (141 * 2**30, 4.8e12)
    same = ("flops", "flops16", "flops_tf32", "flops64", "efficiency")
    assert all(getattr(d, f) == getattr(h100.devices[0], f) for f in same)
    assert [(x.bandwidth, x.latency, x.kind) for x in h200.links] == [
        (x.bandwidth, x.latency, x.kind) for x in h100.links
    ]
    assert h200.inv_bandwidth[0, 1] == 1 / 450e9 and h200.inv_bandwidth[0, 8] == 1 / 50e9


def test_the_presets_are_listed_and_their_sizes_checked() -> None:
    assert {"dgx-a100-80g-1", "dgx-h100-1", "dgx-h100-128"} <= set(list_presets())
    assert preset_device_count("dgx-h100-100000") == 800_000
    for name in ("dgx-h100-0", "dgx-a100-80g-0"):
        with pytest.raises(DeviceGraphError, match=name):
            get_preset(name)
    with pytest.raises(DeviceGraphError, match="dgx-h100-N"):
        get_preset("h100-4")


def test_the_devices_command_shows_the_16_bit_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "dgx-h100-1"]) == 0
    out = capsys.readouterr().out
    assert "67 TFLOP/s FP32, 989 TFLOP/s 16-bit, 1979 TFLOP/s FP8, 80 GiB" in out
    assert "matmul 0.7" in out and "attention 0.35" in out


def test_a_bf16_layer_is_faster_on_the_h100_by_the_ratio_of_peaks() -> None:
    """The same bf16 layer on one GPU: DGX H100 against DGX A100 80 GB, each class at one
    fraction (`rates="flat"`: the H100's GEMMs by shape are tested in test_rates.py)."""
    h100, a100 = get_preset("dgx-h100-1"), get_preset("dgx-a100-80g-1")
    ratio = seconds(mlp(2), a100, "fc", rates="flat") / seconds(mlp(2), h100, "fc", rates="flat")
    assert ratio == pytest.approx(989 / 312, rel=1e-12)  # both at matmul 0.7
