"""Device graph presets: the papers' GPU clusters, a DGX-1, DGX A100 and DGX H100 clusters,
and this machine's CPU workers.

Figures and their sources are in docs/devices.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from planner.errors import DeviceGraphError
from planner.files import read_json_checked, write_text_atomic
from planner.hardware.devices import Device, DeviceGraph, Link
from planner.hardware.load import Load, LoadWatch, note_cached, trusted

__all__ = [
    "CPU_LOCAL_DEFAULTS",
    "CpuLocalFigures",
    "cpu_local",
    "cpu_local_cache_path",
    "cpu_local_figures",
    "dgx_a100",
    "dgx_a100_80g",
    "dgx_h100",
    "dgx_h200",
    "get_preset",
    "hgx_h800",
    "k80_cluster",
    "list_presets",
    "load_devices",
    "measure_cpu_local",
    "p100_cluster",
    "preset_device_count",
    "v100_dgx1",
]

GiB = 2**30

# Links: bytes/s per direction, seconds per link traversal.
NVLINK1_BANDWIDTH = 20e9  # NVLink 1.0 (P100), per link
NVLINK2_BANDWIDTH = 25e9  # NVLink 2.0 (V100), per link
NVLINK3_GPU_BANDWIDTH = 300e9  # NVLink 3.0 (A100): 12 links x 25 GB/s, all to the NVSwitches
NVLINK4_GPU_BANDWIDTH = 450e9  # NVLink 4.0 (H100): 18 links x 25 GB/s, all to the NVSwitches
# H800 SXM (the export H100): NVLink cut to 400 GB/s both directions, 200 GB/s each way
# (Zhao et al., Insights into DeepSeek-V3, ISCA '25, arXiv 2505.09343, Sec. 4.1)
NVLINK4_H800_BANDWIDTH = 200e9
PCIE4_BANDWIDTH = 25e9  # PCIe 4.0 x16, achievable (31.5 GB/s raw)
PCIE5_BANDWIDTH = 50e9  # PCIe 5.0 x16, achievable (63 GB/s raw)
IB_HDR_BANDWIDTH = 25e9  # 200 Gb/s HDR InfiniBand
IB_NDR_BANDWIDTH = 50e9  # 400 Gb/s NDR InfiniBand
PCIE3_BANDWIDTH = 12e9  # PCIe 3.0 x16, achievable (15.75 GB/s raw)
IB_EDR_BANDWIDTH = 12.5e9  # 100 Gb/s EDR InfiniBand
IB_FDR_BANDWIDTH = 7e9  # 56 Gb/s FDR InfiniBand
QPI_BANDWIDTH = 19.2e9  # Xeon E5 v4 QPI at 9.6 GT/s
NVLINK_LATENCY = 5e-6
NVSWITCH_LATENCY = 2.5e-6  # per link: GPU -> NVSwitch -> GPU costs one NVLink hop's 5 us
PCIE_LATENCY = 5e-6
IB_LATENCY = 2e-6
QPI_LATENCY = 1e-6

# Devices: peak FP32 FLOP/s, memory bandwidth (bytes/s), memory (bytes); peaks of other
# precisions where the datasheet gives them (dense: no sparsity; docs/devices.md, "Figures").
P100 = {"flops": 10.6e12, "flops16": 21.2e12, "mem_bandwidth": 732e9, "memory": 16 * GiB}
K80_DIE = {"flops": 4.37e12 / 2, "flops64": 4.37e12 / 6, "mem_bandwidth": 240e9, "memory": 12 * GiB}
V100 = {"flops": 15.7e12, "flops16": 125e12, "mem_bandwidth": 900e9, "memory": 16 * GiB}
A100 = {
    "flops": 19.5e12,
    "flops16": 312e12,
    "flops_tf32": 156e12,
    "flops64": 9.7e12,
    "mem_bandwidth": 1555e9,
    "memory": 40 * GiB,
}
A100_80G = A100 | {"mem_bandwidth": 2039e9, "memory": 80 * GiB}
H100 = {
    "flops": 67e12,
    "flops16": 989e12,
    "flops8": 1979e12,
    "flops_tf32": 494.5e12,
    "flops64": 34e12,
    "mem_bandwidth": 3.35e12,
    "memory": 80 * GiB,
}
# H200 SXM: the H100's compute (the same GH100 die and clocks) with 141 GB of HBM3e at
# 4.8 TB/s (NVIDIA H200 Tensor Core GPU datasheet).
H200 = H100 | {"mem_bandwidth": 4.8e12, "memory": 141 * GiB}
# Achievable fractions of peak per op class (`Device.efficiency`) for the LLM-era presets:
# matmul from "optimized GEMM can reach up to 80-90% of the theoretical maximum" (Dao,
# FlashAttention-2, 2023, Sec. 1; Shah et al., FlashAttention-3, 2024, Sec. 1 for H100), less
# for a layer's smaller and transposed backward GEMMs; attention as PyTorch's
# scaled_dot_product_attention runs it with FlashAttention-2: 50-73% of peak forward, up to 63%
# backward on A100 (FA2 abstract, Sec. 1), 35% on H100 (FA3 Sec. 1). Rough defaults for the
# lead's calibration, not measurements: docs/devices.md, "Achievable fractions".
A100_EFFICIENCY = (("attention", 0.5), ("matmul", 0.7))
H100_EFFICIENCY = (("attention", 0.35), ("matmul", 0.7))
DGX_GPUS = 8  # per DGX A100 and DGX H100 system

# DGX-1 (V100) hybrid cube-mesh: GPU pair -> number of NVLink 2.0 links (6 per GPU).
DGX1_NVLINKS = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
    (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}  # fmt: skip
DGX1_SIZES = (1, 2, 3, 4, 8)

# cpu-local figures used when no measurement is cached (gloo on these machines, 1 thread).
CPU_LOCAL_DEFAULTS: dict[str, float] = {
    "bandwidth": 3e9,
    "latency": 60e-6,
    "flops": 3e10,
    "mem_bandwidth": 1e10,
    "message_overhead": 5e-4,
}
CPU_LOCAL_FALLBACK_MEMORY = 24 * GiB

logger = logging.getLogger(__name__)

VALID_FORMS = (
    "p100-NxG (N >= 1 nodes, G in 1..8 GPUs), k80-NxG (N >= 1, G in 1..8), "
    "v100-dgx1-G (G in 1,2,3,4,8), dgx-a100-N, dgx-a100-80g-N, dgx-h100-N, dgx-h200-N, hgx-h800-N "
    "(N >= 1 nodes of 8 GPUs), cpu-local-N (N >= 1)"
)


def _gpus(count: int, spec: dict[str, Any], host: str, first: int = 0) -> list[Device]:
    return [Device(f"gpu{first + g}", "gpu", host=host, **spec) for g in range(count)]


def p100_cluster(nodes: int, gpus: int) -> DeviceGraph:
    """`nodes` x `gpus` P100s: all-pairs NVLink in a node, PCIe to a NIC, EDR InfiniBand between."""
    devices: list[Device] = []
    links: list[Link] = []
    switches: list[str] = ["ib"] if nodes > 1 else []
    for k in range(nodes):
        node = _gpus(gpus, P100, f"node{k}", first=k * gpus)
        nic = f"node{k}/nic"
        switches.append(nic)
        for x, gx in enumerate(node):
            links += [
                Link(gx.name, gy.name, NVLINK1_BANDWIDTH, NVLINK_LATENCY, "nvlink")
                for gy in node[x + 1 :]
            ]
            links.append(Link(gx.name, nic, PCIE3_BANDWIDTH, PCIE_LATENCY, "pcie"))
        if nodes > 1:
            links.append(Link(nic, "ib", IB_EDR_BANDWIDTH, IB_LATENCY, "infiniband"))
        devices += node
    return DeviceGraph(f"p100-{nodes}x{gpus}", devices, links, switches)


def k80_cluster(nodes: int, gpus: int) -> DeviceGraph:
    """`nodes` x `gpus` K80 dies: a PCIe switch per pair, a node PCIe switch, FDR InfiniBand."""
    devices: list[Device] = []
    links: list[Link] = []
    switches: list[str] = ["ib"] if nodes > 1 else []
    for k in range(nodes):
        host = f"node{k}/host"
        switches.append(host)
        node = _gpus(gpus, K80_DIE, f"node{k}", first=k * gpus)
        for m in range(math.ceil(gpus / 2)):
            pair = f"node{k}/pcie{m}"
            switches.append(pair)
            links.append(Link(pair, host, PCIE3_BANDWIDTH, PCIE_LATENCY, "pcie"))
            links += [
                Link(g.name, pair, PCIE3_BANDWIDTH, PCIE_LATENCY, "pcie")
                for g in node[2 * m : 2 * m + 2]
            ]
        if nodes > 1:
            links.append(Link(host, "ib", IB_FDR_BANDWIDTH, IB_LATENCY, "infiniband"))
        devices += node
    return DeviceGraph(f"k80-{nodes}x{gpus}", devices, links, switches)


def v100_dgx1(gpus: int) -> DeviceGraph:
    """The first `gpus` V100s of a DGX-1: hybrid cube-mesh NVLink 2.0 plus the PCIe tree."""
    if gpus not in DGX1_SIZES:
        raise DeviceGraphError(f"v100-dgx1-{gpus}: G must be one of {DGX1_SIZES}")
    devices = _gpus(gpus, V100, "node0")
    # A doubled NVLink is one 50 GB/s link, so routes see its full bandwidth.
    links = [
        Link(f"gpu{x}", f"gpu{y}", count * NVLINK2_BANDWIDTH, NVLINK_LATENCY, "nvlink")
        for (x, y), count in DGX1_NVLINKS.items()
        if y < gpus
    ]
    # PCIe: GPUs 2m and 2m+1 share switch pcie{m}; pcie0-1 hang off cpu0, pcie2-3 off cpu1.
    switches: list[str] = []
    for m in range(math.ceil(gpus / 2)):
        cpu = f"cpu{m // 2}"
        if cpu not in switches:
            switches.append(cpu)
        switches.append(f"pcie{m}")
        links.append(Link(f"pcie{m}", cpu, PCIE3_BANDWIDTH, PCIE_LATENCY, "pcie"))
        links += [
            Link(f"gpu{g}", f"pcie{m}", PCIE3_BANDWIDTH, PCIE_LATENCY, "pcie")
            for g in range(2 * m, min(2 * m + 2, gpus))
        ]
    if "cpu1" in switches:
        links.append(Link("cpu0", "cpu1", QPI_BANDWIDTH, QPI_LATENCY, "qpi"))
    return DeviceGraph(f"v100-dgx1-{gpus}", devices, links, switches)


def dgx_a100(nodes: int) -> DeviceGraph:
    """`nodes` DGX A100 systems: in each, 8 A100s joined all-to-all through NVSwitch (one
    300 GB/s link per GPU to the switch `node{k}/nvswitch`), and every GPU with its own HDR
    InfiniBand NIC (`node{k}/nic{g}`, over PCIe 4.0) on one non-blocking fabric switch `ib`.
    No calibrated efficiency: its plans keep the cost options' fraction (and their numbers)."""
    return _dgx(
        f"dgx-a100-{nodes}", nodes, A100, NVLINK3_GPU_BANDWIDTH, PCIE4_BANDWIDTH, IB_HDR_BANDWIDTH
    )


def dgx_a100_80g(nodes: int) -> DeviceGraph:
    """`nodes` DGX A100 80 GB systems as in Selene (Megatron-LM, Narayanan et al. SC'21): the
    `dgx_a100` layout with A100 80 GB SXM (2,039 GB/s HBM2e) and calibrated efficiencies."""
    spec = A100_80G | {"efficiency": A100_EFFICIENCY}
    return _dgx(
        f"dgx-a100-80g-{nodes}",
        nodes,
        spec,
        NVLINK3_GPU_BANDWIDTH,
        PCIE4_BANDWIDTH,
        IB_HDR_BANDWIDTH,
    )


def dgx_h100(nodes: int) -> DeviceGraph:
    """`nodes` DGX H100 systems: 8 H100 SXM 80 GB on NVLink 4 and NVSwitch (450 GB/s per GPU
    and direction), every GPU with its own 400 Gb/s NDR InfiniBand NIC over PCIe 5.0."""
    spec = H100 | {"efficiency": H100_EFFICIENCY}
    return _dgx(
        f"dgx-h100-{nodes}", nodes, spec, NVLINK4_GPU_BANDWIDTH, PCIE5_BANDWIDTH, IB_NDR_BANDWIDTH
    )


def dgx_h200(nodes: int) -> DeviceGraph:
    """`nodes` DGX H200 systems: the `dgx_h100` layout (NVLink 4, one NDR NIC per GPU) with
    H200 SXM 141 GB (HBM3e, 4.8 TB/s; the H100's compute and calibrated fractions)."""
    spec = H200 | {"efficiency": H100_EFFICIENCY}
    return _dgx(
        f"dgx-h200-{nodes}", nodes, spec, NVLINK4_GPU_BANDWIDTH, PCIE5_BANDWIDTH, IB_NDR_BANDWIDTH
    )


def hgx_h800(nodes: int) -> DeviceGraph:
    """`nodes` HGX H800 servers as in DeepSeek-V3's cluster (DeepSeek-AI 2024, Sec. 3.1;
    Zhao et al., ISCA '25, Sec. 4.1): 8 H800 SXM 80 GB (the H100's compute and memory,
    calibrated fractions and kernel rates) on NVSwitch with NVLink cut to 200 GB/s per GPU
    and direction, every GPU with its own 400 Gb/s InfiniBand NIC (ConnectX-7) over PCIe 5.0.
    DeepSeek measures 160 GB/s of NVLink and 50 GB/s of InfiniBand achievable (Sec. 3.2.2)."""
    spec = H100 | {"efficiency": H100_EFFICIENCY}
    return _dgx(
        f"hgx-h800-{nodes}", nodes, spec, NVLINK4_H800_BANDWIDTH, PCIE5_BANDWIDTH, IB_NDR_BANDWIDTH
    )


def _dgx(
    name: str, nodes: int, spec: dict[str, Any], nvlink: float, pcie: float, fabric: float
) -> DeviceGraph:
    """A DGX cluster of 8-GPU nodes of `spec`: in node k, every GPU links to the switch
    `node{k}/nvswitch` (the NVSwitches act as one non-blocking crossbar) and, with nodes > 1,
    over PCIe to its own NIC `node{k}/nic{g}` on one non-blocking fabric switch `ib`."""
    devices: list[Device] = []
    links: list[Link] = []
    switches: list[str] = ["ib"] if nodes > 1 else []
    for k in range(nodes):
        node = _gpus(DGX_GPUS, spec, f"node{k}", first=k * DGX_GPUS)
        nvswitch = f"node{k}/nvswitch"
        switches.append(nvswitch)
        for g, gpu in enumerate(node):
            links.append(Link(gpu.name, nvswitch, nvlink, NVSWITCH_LATENCY, "nvswitch"))
            if nodes > 1:
                nic = f"node{k}/nic{g}"
                switches.append(nic)
                links.append(Link(gpu.name, nic, pcie, PCIE_LATENCY, "pcie"))
                links.append(Link(nic, "ib", fabric, IB_LATENCY, "infiniband"))
        devices += node
    return DeviceGraph(name, devices, links, switches)


def cpu_local(workers: int, figures: dict[str, float] | None = None) -> DeviceGraph:
    """`workers` CPU processes on this machine, every pair joined by its own loopback link
    (gloo opens one connection per pair; a message crosses it once).

    `figures` (bandwidth, latency, flops, mem_bandwidth, message_overhead) default to the
    cached measurement, else to CPU_LOCAL_DEFAULTS; a figure missing from either comes from
    CPU_LOCAL_DEFAULTS."""
    fig = dict(CPU_LOCAL_DEFAULTS) | (
        figures if figures is not None else cpu_local_figures().figures
    )
    memory = _machine_memory() // workers
    devices = [
        Device(
            f"cpu{w}",
            "cpu",
            fig["flops"],
            fig["mem_bandwidth"],
            memory,
            "localhost",
            message_overhead=fig["message_overhead"],
        )
        for w in range(workers)
    ]
    links = [
        Link(a.name, b.name, fig["bandwidth"], fig["latency"], "loopback")
        for k, a in enumerate(devices)
        for b in devices[k + 1 :]
    ]
    return DeviceGraph(f"cpu-local-{workers}", devices, links, [])


def _ranged(name: str, value: str, low: int, high: float = math.inf) -> int:
    number = int(value)
    if not low <= number <= high:
        raise DeviceGraphError(
            f"preset {name!r}: {number} is out of range; valid forms: {VALID_FORMS}"
        )
    return number


_Count = Callable[[re.Match[str]], int]
_Build = Callable[[str, re.Match[str]], DeviceGraph]

# Each preset form: its name pattern, its device count (cheap: nothing built, sizes not
# range-checked) and its builder. A new family needs a line here only.
_PATTERNS: list[tuple[re.Pattern[str], _Count, _Build]] = [
    (
        re.compile(r"p100-(\d+)x(\d+)"),
        lambda m: int(m[1]) * int(m[2]),
        lambda n, m: p100_cluster(_ranged(n, m[1], 1), _ranged(n, m[2], 1, 8)),
    ),
    (
        re.compile(r"k80-(\d+)x(\d+)"),
        lambda m: int(m[1]) * int(m[2]),
        lambda n, m: k80_cluster(_ranged(n, m[1], 1), _ranged(n, m[2], 1, 8)),
    ),
    (re.compile(r"v100-dgx1-(\d+)"), lambda m: int(m[1]), lambda n, m: v100_dgx1(int(m[1]))),
    (
        re.compile(r"dgx-a100-(\d+)"),
        lambda m: DGX_GPUS * int(m[1]),
        lambda n, m: dgx_a100(_ranged(n, m[1], 1)),
    ),
    (
        re.compile(r"dgx-a100-80g-(\d+)"),
        lambda m: DGX_GPUS * int(m[1]),
        lambda n, m: dgx_a100_80g(_ranged(n, m[1], 1)),
    ),
    (
        re.compile(r"dgx-h100-(\d+)"),
        lambda m: DGX_GPUS * int(m[1]),
        lambda n, m: dgx_h100(_ranged(n, m[1], 1)),
    ),
    (
        re.compile(r"dgx-h200-(\d+)"),
        lambda m: DGX_GPUS * int(m[1]),
        lambda n, m: dgx_h200(_ranged(n, m[1], 1)),
    ),
    (
        re.compile(r"hgx-h800-(\d+)"),
        lambda m: DGX_GPUS * int(m[1]),
        lambda n, m: hgx_h800(_ranged(n, m[1], 1)),
    ),
    (
        re.compile(r"cpu-local-(\d+)"),
        lambda m: int(m[1]),
        lambda n, m: cpu_local(_ranged(n, m[1], 1)),
    ),
]


def get_preset(name: str) -> DeviceGraph:
    """The DeviceGraph of a preset name such as "p100-4x4"; see `list_presets`."""
    for pattern, _, build in _PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            return build(name, match)
    raise DeviceGraphError(f"unknown device preset {name!r}; valid forms: {VALID_FORMS}")


def preset_device_count(name: str) -> int | None:
    """The number of devices preset `name` has, from its name alone (no devices, links or
    routes are built, so it is cheap for any size: guards use it before building); None when
    `name` is not of a preset form. The sizes are not range-checked (`get_preset` does)."""
    for pattern, count, _ in _PATTERNS:
        match = pattern.fullmatch(name)
        if match:
            return count(match)
    return None


def list_presets() -> list[str]:
    """Example preset names (the forms accept other sizes too). Every one builds in under a
    second, dgx-h100-2048 (16,384 GPUs) included: routes are derived on demand
    (docs/devices.md, "Routes at scale")."""
    return [
        *(f"p100-{n}x4" for n in (1, 2, 4, 8, 16, 64, 256)),
        "k80-1x4",
        "k80-4x4",
        "k80-16x4",
        *(f"v100-dgx1-{g}" for g in DGX1_SIZES),
        *(f"dgx-a100-{n}" for n in (1, 4, 32, 128)),
        *(f"dgx-a100-80g-{n}" for n in (1, 4, 32, 128)),
        *(f"dgx-h100-{n}" for n in (1, 4, 32, 128, 1024, 2048)),
        *(f"dgx-h200-{n}" for n in (1, 4, 32, 128)),
        *(f"hgx-h800-{n}" for n in (1, 32, 256)),
        "cpu-local-2",
        "cpu-local-4",
    ]


def load_devices(spec: str) -> DeviceGraph:
    """A preset name, or a path to a DeviceGraph JSON file (ends with .json or exists)."""
    if spec.endswith(".json") or Path(spec).exists():
        return DeviceGraph.load(spec)
    return get_preset(spec)


# -- cpu-local: cache and measurement ---------------------------------------------------------


def cpu_local_cache_path() -> Path:
    """$LAYERWISE_CACHE_DIR/cpu-local.json (default ~/.cache/layerwise/cpu-local.json)."""
    root = os.environ.get("LAYERWISE_CACHE_DIR") or Path.home() / ".cache" / "layerwise"
    return Path(root) / "cpu-local.json"


MEASURE_COMMAND = "python -m planner devices cpu-local-2 --measure"


@dataclass(frozen=True)
class CpuLocalFigures:
    """The cpu-local figures planning uses, and where they come from."""

    figures: dict[str, float]
    note: str  # one line: the cache, when and at what load it was measured; or the defaults
    measured: bool  # from the cache (else CPU_LOCAL_DEFAULTS)
    trusted: bool  # measured at a known load within the busy threshold


def cpu_local_figures() -> CpuLocalFigures:
    """The cached cpu-local figures, else CPU_LOCAL_DEFAULTS. Cached figures log their note
    (`load.note_cached`: when and at what load they were measured; a warning when on a busy
    machine or at no recorded load)."""
    path = cpu_local_cache_path()
    if not path.exists():
        line = f"cpu-local figures: the defaults (nothing measured in {path})"
        logger.debug("%s; measure them with `%s`", line, MEASURE_COMMAND)
        return CpuLocalFigures(dict(CPU_LOCAL_DEFAULTS), line, False, False)
    try:
        cached = read_json_checked(path, "cpu-local cache")  # a FIFO there never blocks
        figures = {
            key: float(cached.get(key, CPU_LOCAL_DEFAULTS[key])) for key in CPU_LOCAL_DEFAULTS
        }
        if not all(math.isfinite(v) and v > 0 for v in figures.values()):
            raise ValueError("non-positive figure")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(
            f"ignoring unreadable cpu-local cache {path} ({exc}); using defaults. "
            f"Re-measure with `{MEASURE_COMMAND}`.",
            stacklevel=3,
        )
        line = f"cpu-local figures: the defaults ({path} is unreadable)"
        return CpuLocalFigures(dict(CPU_LOCAL_DEFAULTS), line, False, False)
    load = Load.from_json(cached.get("load"))
    what = (
        f"cpu-local figures (latency {figures['latency'] * 1e6:.0f} us, bandwidth "
        f"{figures['bandwidth'] / 1e9:.2f} GB/s, message overhead "
        f"{figures['message_overhead'] * 1e6:.0f} us)"
    )
    line = note_cached(what, path, [(cached.get("measured_at"), load)], MEASURE_COMMAND)
    return CpuLocalFigures(figures, line, True, trusted(load))


def _machine_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return CPU_LOCAL_FALLBACK_MEMORY


def measure_cpu_local(
    n: int = 2, path: Path | None = None, max_load: float | None = None
) -> dict[str, Any]:
    """Measure gloo point-to-point bandwidth/latency, the message overhead of busy workers and
    1-thread FLOP/s with `n` processes (ranks 0 and 1 exchange; the others wait).

    Latency and bandwidth come from ping-pongs between idle processes. The message overhead is
    what a message costs when both workers compute, as in training: ranks 0 and 1 repeat a
    ~1 ms matmul and then swap a small tensor (one message each way); an exchange then takes
    latency + 2 x overhead on average (the simulator's and cost model's price), so overhead =
    (mean exchange - latency) / 2. The mean, not the median: step times add up the slow
    exchanges too (a woken receiver waits for a busy core).

    Refuses a busy machine before and after (`load.LoadWatch` with the busy threshold
    `max_load`, load average per core; MachineBusyError, nothing written), and records the
    load and the time with the figures. Writes them to `path` (default
    `cpu_local_cache_path()`) and returns them.
    """
    if n < 2:
        raise DeviceGraphError(f"measure_cpu_local needs n >= 2 processes, got {n}")
    watch = LoadWatch("measuring the cpu-local figures", BUSY_WORKERS, max_load)
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="layerwise-measure-") as tmp:
        mp.spawn(_measure_worker, args=(n, tmp), nprocs=n, join=True)
        figures: dict[str, Any] = json.loads((Path(tmp) / "result.json").read_text())
    figures |= {
        "processes": n,
        "torch": torch.__version__,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "load": watch.check().to_json(),
    }
    target = path or cpu_local_cache_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, json.dumps(figures, indent=2) + "\n")
    return figures


BUSY_WORKERS = 2  # ranks 0 and 1 compute and exchange; the others wait


def _measure_worker(rank: int, n: int, tmp: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), n)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=n, timeout=timedelta(seconds=60)
    )
    try:
        small = _one_way_times(rank, torch.zeros(2), repeats=50)
        big = torch.zeros(4 * 2**20)  # 16 MB of float32
        large = _one_way_times(rank, big, repeats=8)
        latency = statistics.median(small)
        nbytes = big.numel() * big.element_size()
        exchange = _busy_exchange_seconds(torch, rank)
        figures = {
            "latency": latency,
            "bandwidth": nbytes / max(statistics.median(large) - latency, 1e-9),
            "flops": _matmul_flops(torch),
            "mem_bandwidth": _copy_bandwidth(torch),
            "message_overhead": max((exchange - latency) / 2, 1e-6),
            "busy_exchange": exchange,
        }
        dist.barrier()
        if rank == 0:
            (Path(tmp) / "result.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def _one_way_times(rank: int, tensor: Any, repeats: int) -> list[float]:
    """Half round-trip times of ping-pongs between ranks 0 and 1 (after one warm-up)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        times.append((time.perf_counter() - start) / 2)
    return times[1:]


BUSY_EXCHANGES = 600


def _busy_exchange_seconds(torch: Any, rank: int, repeats: int = BUSY_EXCHANGES) -> float:
    """Mean seconds of a swap of 2 x 64 float64 values between ranks 0 and 1 that both
    compute before each swap (1, 3 or 10 matmuls of 256 x 256, about 1 ms each, in turn);
    other ranks do nothing."""
    import torch.distributed as dist

    if rank > 1:
        return 0.0
    peer = 1 - rank
    a = torch.randn(256, 256)
    mine, theirs = torch.zeros(2, 64, dtype=torch.float64), torch.empty(2, 64, dtype=torch.float64)
    times = []
    for k in range(repeats + 10):
        for _ in range((1, 3, 10)[k % 3]):
            a = torch.tanh(a @ a)  # ~1 ms of busy core, bounded values
        start = time.perf_counter()
        ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if k >= 10:
            times.append(time.perf_counter() - start)
    return statistics.fmean(times)


def _median_seconds(fn: Callable[[], object], warmup: int = 3, repeats: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_flops(torch: Any, size: int = 512) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _median_seconds(lambda: torch.mm(a, b))


def _copy_bandwidth(torch: Any, numel: int = 16 * 2**20) -> float:
    src, dst = torch.ones(numel), torch.empty(numel)
    return 2 * src.numel() * src.element_size() / _median_seconds(lambda: dst.copy_(src))
