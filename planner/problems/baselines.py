"""The strategies experts use, as reference points for every search.

- data parallelism: every op split along the sample dimension over all devices;
- model parallelism (OptCNN's baseline): every layer's parameters split over all devices
  (ops without parameters split along channel where they can, else along sample);
- OWT ("one weird trick", Krizhevsky 2014): data-parallel convolutions and pools,
  model-parallel dense layers;
- expert for RNNs (GNMT, used by FlexFlow Sec. 8): recurrent layers of the same depth on one
  device per host (layer l on local device l mod G), data parallel across hosts; other ops data
  parallel.

Each degree is the largest one that divides both the dimension and the device count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from planner.costs.config import ParallelConfig
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import CHANNEL, SAMPLE, parallel_dims, parameter_dims, split_unit
from planner.hardware.devices import DeviceGraph
from planner.problems.strategy import Strategy


def _largest_degree(op: Op, dim: str, limit: int) -> int:
    if dim not in parallel_dims(op):
        return 1
    units = op.output.size(dim) // split_unit(op, dim)
    return math.gcd(units, limit)


def split_along(op: Op, dim: str, devices: list[int]) -> ParallelConfig:
    """`op` split along `dim` over as many of `devices` as divide evenly (first ones)."""
    g = _largest_degree(op, dim, len(devices))
    degrees = tuple(g if d == dim else 1 for d in op.output.dims)
    return ParallelConfig(degrees, tuple(devices[:g]))


def data_parallel(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    all_devs = list(range(devices.num_devices))
    return Strategy(graph, devices, tuple(split_along(op, SAMPLE, all_devs) for op in graph.ops))


def _model_config(op: Op, devs: list[int]) -> ParallelConfig:
    pdims = parameter_dims(op) if op.params else ()
    for dim in (*pdims, CHANNEL, SAMPLE):
        if _largest_degree(op, dim, len(devs)) > 1 or dim == SAMPLE:
            return split_along(op, dim, devs)
    raise AssertionError("unreachable: sample is always a candidate")


def model_parallel(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    devs = list(range(devices.num_devices))
    return Strategy(graph, devices, tuple(_model_config(op, devs) for op in graph.ops))


_OWT_MODEL = ("linear", "embedding", "lstm", "rnn_attention")


def owt(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    devs = list(range(devices.num_devices))
    configs = tuple(
        _model_config(op, devs) if op.kind in _OWT_MODEL else split_along(op, SAMPLE, devs)
        for op in graph.ops
    )
    return Strategy(graph, devices, configs)


def expert_rnn(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    hosts: dict[str, list[int]] = {}
    for i, d in enumerate(devices.devices):
        hosts.setdefault(d.host, []).append(i)
    per_host = list(hosts.values())
    local = min(len(h) for h in per_host)
    layers: dict[str, int] = {}
    all_devs = list(range(devices.num_devices))
    configs = []
    for op in graph.ops:
        if op.kind != "lstm":
            configs.append(split_along(op, SAMPLE, all_devs))
            continue
        layer = layers.setdefault(op.param_group or op.name, len(layers))
        devs = [h[layer % local] for h in per_host]
        configs.append(split_along(op, SAMPLE, devs))
    return Strategy(graph, devices, tuple(configs))


BASELINES: dict[str, Callable[[OpGraph, DeviceGraph], Strategy]] = {
    "data_parallel": data_parallel,
    "model_parallel": model_parallel,
    "owt": owt,
    "expert": expert_rnn,
}


def applicable(graph: OpGraph) -> list[str]:
    """Baselines that make sense for `graph` (the RNN expert only where there are LSTMs)."""
    names = ["data_parallel", "model_parallel", "owt"]
    if any(op.kind == "lstm" for op in graph.ops):
        names.append("expert")
    return names
