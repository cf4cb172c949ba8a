"""Parallel configurations of an op and the space of candidates per op.

A `ParallelConfig` (OptCNN Sec. 4, FlexFlow Sec. 4) gives a degree for every dimension of the
op's output tensor (1 where it is not split; the product is the number of tasks) and the
device of each task. Tasks are numbered row-major over the degree grid; partitions are equal.

The `ConfigSpace` enumerates candidates per op for a device count D:
- every degree combination over the op's parallelizable dims whose degrees divide the
  dimension (in whole split units, e.g. attention heads) and whose product k divides D;
- for each, every aligned block of k consecutive devices (offsets 0, k, 2k, ...), so that ops
  can also run side by side on different devices (the operation dimension);
- on machines with several hosts, also the strided sets that take the same local device on
  each host (one device per host), as the expert strategies for RNNs do.
Order is deterministic: by task count k descending, then by partition (fewest split dims
first, then degrees), then by device set. `max_configs` truncates that order per op.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.errors import ConfigError
from planner.graph.opkinds import parallel_dims, split_unit

if TYPE_CHECKING:
    from planner.graph.opgraph import Op, OpGraph
    from planner.hardware.devices import DeviceGraph


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees per output dimension of the op (aligned with `op.output.dims`) and task devices."""

    degrees: tuple[int, ...]
    devices: tuple[int, ...]

    @property
    def num_tasks(self) -> int:
        return math.prod(self.degrees)

    @property
    def partition(self) -> tuple[int, ...]:
        return self.degrees

    def degree(self, op: Op, dim: str) -> int:
        return self.degrees[op.output.dims.index(dim)] if dim in op.output.dims else 1

    def describe(self, op: Op) -> str:
        """e.g. 'sample=2,channel=2 @ [0,1,2,3]'."""
        split = ",".join(
            f"{d}={g}" for d, g in zip(op.output.dims, self.degrees, strict=True) if g > 1
        )
        return f"{split or 'whole'} @ [{','.join(map(str, self.devices))}]"

    def to_json(self, op: Op) -> dict[str, Any]:
        return {
            "degrees": {d: g for d, g in zip(op.output.dims, self.degrees, strict=True) if g > 1},
            "devices": list(self.devices),
        }

    @classmethod
    def from_json(cls, op: Op, data: Mapping[str, Any], num_devices: int) -> ParallelConfig:
        degrees = data.get("degrees", {})
        unknown = set(degrees) - set(op.output.dims)
        if unknown:
            raise ConfigError(f"op {op.name!r} has no dimension(s) {sorted(unknown)} to split")
        cfg = cls(
            tuple(int(degrees.get(d, 1)) for d in op.output.dims),
            tuple(int(x) for x in data.get("devices", [])),
        )
        check_config(op, cfg, num_devices)
        return cfg


def check_config(op: Op, cfg: ParallelConfig, num_devices: int) -> None:
    """Raise ConfigError if `cfg` does not fit `op` on `num_devices` devices."""
    if len(cfg.degrees) != len(op.output.dims):
        raise ConfigError(f"op {op.name!r}: {len(cfg.degrees)} degrees for dims {op.output.dims}")
    allowed = set(parallel_dims(op))
    for dim, size, deg in zip(op.output.dims, op.output.sizes, cfg.degrees, strict=True):
        if deg < 1:
            raise ConfigError(f"op {op.name!r}: degree {deg} on {dim!r} must be >= 1")
        if deg > 1 and dim not in allowed:
            raise ConfigError(f"op {op.name!r} ({op.kind}) cannot be split along {dim!r}")
        unit = split_unit(op, dim)
        if size % (deg * unit):
            raise ConfigError(
                f"op {op.name!r}: degree {deg} does not divide dimension {dim!r} of size {size}"
                + (f" in units of {unit}" if unit > 1 else "")
            )
    if len(cfg.devices) != cfg.num_tasks:
        raise ConfigError(
            f"op {op.name!r}: {cfg.num_tasks} tasks but {len(cfg.devices)} devices given"
        )
    if len(set(cfg.devices)) != len(cfg.devices):
        raise ConfigError(f"op {op.name!r}: two tasks on one device {list(cfg.devices)}")
    bad = [d for d in cfg.devices if not 0 <= d < num_devices]
    if bad:
        raise ConfigError(
            f"op {op.name!r}: device {bad[0]} out of range (the machine has {num_devices})"
        )


def partitions(op: Op, num_devices: int) -> list[tuple[int, ...]]:
    """Degree tuples for `op` whose product divides `num_devices`, in enumeration order."""
    pdims = parallel_dims(op)
    options: list[list[int]] = []
    for dim, size in zip(op.output.dims, op.output.sizes, strict=True):
        if dim not in pdims:
            options.append([1])
            continue
        units = size // split_unit(op, dim)
        options.append(
            [g for g in range(1, num_devices + 1) if num_devices % g == 0 and units % g == 0]
        )
    parts = [p for p in itertools.product(*options) if num_devices % math.prod(p) == 0]
    parts.sort(key=lambda p: (-math.prod(p), sum(g > 1 for g in p), tuple(-g for g in p)))
    return parts


def device_sets(num_devices: int, k: int, hosts: Sequence[int] | None = None) -> np.ndarray:
    """Device sets of size k: aligned blocks, then one-device-per-host strided sets. (O, k)."""
    blocks = [tuple(range(o, o + k)) for o in range(0, num_devices, k)]
    if hosts is not None:
        per_host: dict[int, list[int]] = {}
        for dev, h in enumerate(hosts):
            per_host.setdefault(h, []).append(dev)
        groups = list(per_host.values())
        n_hosts, local = len(groups), len(groups[0])
        uniform = all(len(g) == local for g in groups)
        if uniform and n_hosts > 1 and local > 1 and k == n_hosts:
            for i in range(local):
                s = tuple(g[i] for g in groups)
                if s not in blocks:
                    blocks.append(s)
    return np.array(blocks, dtype=np.int64).reshape(len(blocks), k)


@dataclass(frozen=True)
class OpConfigs:
    """The candidate configs of one op, grouped by partition for vectorized cost tables."""

    configs: tuple[ParallelConfig, ...]
    # For each group: (partition, device sets (O, k) array, indices of its configs in `configs`).
    groups: tuple[tuple[tuple[int, ...], np.ndarray, np.ndarray], ...]

    def __len__(self) -> int:
        return len(self.configs)

    def index(self, cfg: ParallelConfig) -> int:
        try:
            return self.configs.index(cfg)
        except ValueError:
            raise ConfigError(f"config {cfg} is not in the config space") from None


class ConfigSpace:
    """Candidate configs per op of `graph` on `devices` (deterministic; see module doc)."""

    def __init__(self, graph: OpGraph, devices: DeviceGraph, max_configs: int | None = None):
        if max_configs is not None and max_configs < 1:
            raise ConfigError(f"max_configs must be >= 1, got {max_configs}")
        self.graph = graph
        self.devices = devices
        self.max_configs = max_configs
        self.num_devices = devices.num_devices
        host_names = [d.host for d in devices.devices]
        host_ids = {h: i for i, h in enumerate(dict.fromkeys(host_names))}
        self._hosts = [host_ids[h] for h in host_names]
        self._sets: dict[int, np.ndarray] = {}

    def _device_sets(self, k: int) -> np.ndarray:
        if k not in self._sets:
            self._sets[k] = device_sets(self.num_devices, k, self._hosts)
        return self._sets[k]

    @cached_property
    def ops(self) -> tuple[OpConfigs, ...]:
        return tuple(self._enumerate(op) for op in self.graph.ops)

    def __getitem__(self, i: int) -> OpConfigs:
        return self.ops[i]

    def sizes(self) -> list[int]:
        return [len(c) for c in self.ops]

    def _enumerate(self, op: Op) -> OpConfigs:
        configs: list[ParallelConfig] = []
        groups = []
        for part in partitions(op, self.num_devices):
            if self.max_configs is not None and len(configs) >= self.max_configs:
                break
            sets = self._device_sets(math.prod(part))
            if self.max_configs is not None:
                sets = sets[: self.max_configs - len(configs)]
            idx = np.arange(len(configs), len(configs) + len(sets))
            configs.extend(ParallelConfig(part, tuple(int(d) for d in row)) for row in sets)
            groups.append((part, sets, idx))
        return OpConfigs(tuple(configs), tuple(groups))
