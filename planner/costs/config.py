"""Parallel configurations of an op and the space of candidates per op.

A `ParallelConfig` (OptCNN Sec. 4, FlexFlow Sec. 4) gives a degree for every dimension of the
op's output tensor (1 where it is not split; the product is the number of tasks) and the
device of each task. Tasks are numbered row-major over the degree grid; partitions are equal.
An op that sums over a dim of an input (a linear, a convolution) may also split that sum
(`reduce`: Megatron-LM's row-parallel linear), its tasks then computing partial results.

The `ConfigSpace` enumerates candidates per op for a device count D, in one of two kinds
(docs/space.md):
- "full": every degree combination over the op's parallelizable dims (and its contraction,
  `reduce`) whose degrees divide
  the dimension (in whole split units, e.g. attention heads) and whose product k divides D;
  for each, every aligned block of k consecutive devices (offsets 0, k, 2k, ...), so that ops
  can also run side by side on different devices (the operation dimension); on machines with
  several hosts, also the strided sets that take the same local device on each host (one
  device per host), as the expert strategies for RNNs do. Grows like ~14.5 x D configs per op.
- "mesh" (homogeneous clusters only, `DeviceGraph.hierarchy()`): the same partitions with at
  most `max_split_dims` split dims (default 2), each on the few device blocks of
  `planner.costs.mesh.mesh_blocks` (contiguous from device 0, spread over every node,
  translates inside node 0), plus any `seeds` (build_problem seeds the baseline strategies'
  configs, so every baseline is in the space). A few hundred configs per op at 1,024 devices.
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

from planner.costs.mesh import mesh_blocks
from planner.errors import ConfigError
from planner.graph.opkinds import REDUCE, contraction, parallel_dims, split_unit

if TYPE_CHECKING:
    from planner.graph.opgraph import Op, OpGraph
    from planner.hardware.devices import DeviceGraph


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees per output dimension of the op (aligned with `op.output.dims`), task devices,
    and the degree of a contraction split (`reduce`; `planner.graph.opkinds.contraction`):
    with reduce r > 1 every output box is computed by r tasks, each summing over 1/r of the
    contracted dim, and its consumers add the r partial results. Tasks are numbered row-major
    over `grid` = degrees + (r,): task t computes output box t // r, partial t % r.

    `expert` (a mixture of experts, `planner.graph.moe`: expert parallelism) e > 1 spreads
    the routed experts over e tasks: every e consecutive token boxes form an expert-parallel
    group whose member m holds experts [m E/e, (m+1) E/e) and runs them on the tokens of the
    whole group routed to them, exchanged by all-to-all inside the op (Megatron-Core's
    alltoall dispatcher, Lepikhin et al. 2021 GShard Sec. 2.2). It adds no tasks."""

    degrees: tuple[int, ...]
    devices: tuple[int, ...]
    reduce: int = 1
    expert: int = 1

    @property
    def num_tasks(self) -> int:
        return math.prod(self.degrees) * self.reduce

    @property
    def grid(self) -> tuple[int, ...]:
        """The task grid: the degrees, and the contraction degree when it is above 1."""
        return (*self.degrees, self.reduce) if self.reduce > 1 else self.degrees

    @property
    def partition(self) -> tuple[int, ...]:
        return self.grid

    def expert_groups(self) -> list[list[int]]:
        """The expert-parallel groups: tasks of e consecutive token boxes (one group of
        one task each when `expert` is 1)."""
        boxes = self.num_tasks // self.reduce
        e = self.expert
        return [
            [b * self.reduce + r for b in range(g * e, (g + 1) * e)]
            for g in range(boxes // e)
            for r in range(self.reduce)
        ]

    def expert_rank(self, task: int) -> int:
        """The task's member index in its expert-parallel group (its expert shard)."""
        return (task // self.reduce) % self.expert

    def degree(self, op: Op, dim: str) -> int:
        if dim == REDUCE:
            return self.reduce
        return self.degrees[op.output.dims.index(dim)] if dim in op.output.dims else 1

    def describe(self, op: Op) -> str:
        """e.g. 'sample=2,channel=2 @ [0-3]', 'sample=2,reduce=4 @ [0-7]' (devices as
        `device_ranges` writes them)."""
        split = [f"{d}={g}" for d, g in zip(op.output.dims, self.degrees, strict=True) if g > 1]
        if self.reduce > 1:
            split.append(f"{REDUCE}={self.reduce}")
        if self.expert > 1:
            split.append(f"expert={self.expert}")
        return f"{','.join(split) or 'whole'} @ [{device_ranges(self.devices)}]"

    def to_json(self, op: Op) -> dict[str, Any]:
        out: dict[str, Any] = {
            "degrees": {d: g for d, g in zip(op.output.dims, self.degrees, strict=True) if g > 1},
            "devices": list(self.devices),
        }
        if self.reduce > 1:
            out["reduce"] = self.reduce
        if self.expert > 1:
            out["expert"] = self.expert
        return out

    @classmethod
    def from_json(cls, op: Op, data: Mapping[str, Any], num_devices: int) -> ParallelConfig:
        degrees = data.get("degrees", {})
        unknown = set(degrees) - set(op.output.dims)
        if unknown:
            raise ConfigError(f"op {op.name!r} has no dimension(s) {sorted(unknown)} to split")
        cfg = cls(
            tuple(int(degrees.get(d, 1)) for d in op.output.dims),
            tuple(int(x) for x in data.get("devices", [])),
            int(data.get("reduce", 1)),
            int(data.get("expert", 1)),
        )
        check_config(op, cfg, num_devices)
        return cfg


REGULAR_RUNS = 4  # more runs than this, evenly spaced and of one length, are elided


def device_ranges(devices: Sequence[int]) -> str:
    """Task devices in task order, short at any scale: runs of consecutive ids as ranges
    ('0-7,16-23'), and more than REGULAR_RUNS runs of one length at one spacing as the first
    two, '...' and the last ('0-1023'; '0,4,...,1020'; '0-1,4-5,...,1020-1021')."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(runs) > REGULAR_RUNS:
        lengths = {b - a for a, b in runs}
        steps = {q[0] - p[0] for p, q in itertools.pairwise(runs)}
        if len(lengths) == 1 and len(steps) == 1:
            text = [text[0], text[1], "...", text[-1]]
    return ",".join(text)


def check_config(
    op: Op, cfg: ParallelConfig, num_devices: int, checked: set[int] | None = None
) -> None:
    """Raise ConfigError if `cfg` does not fit `op` on `num_devices` devices. `checked`: ids
    of device tuples already found distinct and in range (a strategy's ops share them: on
    16,384 GPUs each lists thousands), skipped and added to."""
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
    if cfg.reduce != 1:
        con = contraction(op)
        if con is None:
            raise ConfigError(
                f"op {op.name!r} ({op.kind}) has no contraction it may split (reduce "
                f"{cfg.reduce}): only a linear or an ungrouped convolution with its weight and "
                "no folded function other than dropout sums over a dim it can cut"
            )
        if cfg.reduce < 1 or con.size % cfg.reduce:
            raise ConfigError(
                f"op {op.name!r}: reduce degree {cfg.reduce} does not divide the {con.size} "
                f"elements it sums over"
            )
    if cfg.expert != 1:
        _check_expert(op, cfg)
    if len(cfg.devices) != cfg.num_tasks:
        raise ConfigError(
            f"op {op.name!r}: {cfg.num_tasks} tasks but {len(cfg.devices)} devices given"
        )
    if checked is None or id(cfg.devices) not in checked:
        _check_devices(op, cfg, num_devices)
        if checked is not None:
            checked.add(id(cfg.devices))


def _check_expert(op: Op, cfg: ParallelConfig) -> None:
    """Expert parallelism: only on a mixture of experts, its degree dividing the experts
    and the op's token boxes."""
    if op.kind != "moe":
        raise ConfigError(
            f"op {op.name!r} ({op.kind}) has no experts to spread (expert {cfg.expert}): "
            "expert parallelism applies to moe ops only"
        )
    experts = int(op.attr("experts", 0))
    boxes = cfg.num_tasks // cfg.reduce
    if cfg.expert < 1 or experts % cfg.expert or boxes % cfg.expert:
        raise ConfigError(
            f"op {op.name!r}: expert degree {cfg.expert} must divide its {experts} experts "
            f"and its {boxes} token boxes (split sample or length so that it does)"
        )


def _check_devices(op: Op, cfg: ParallelConfig, num_devices: int) -> None:
    """Raise ConfigError unless cfg's devices are distinct and in 0..num_devices-1."""
    if len(set(cfg.devices)) != len(cfg.devices):
        raise ConfigError(f"op {op.name!r}: two tasks on one device {list(cfg.devices)}")
    bad = [d for d in cfg.devices if not 0 <= d < num_devices]
    if bad:
        raise ConfigError(
            f"op {op.name!r}: device {bad[0]} out of range (the machine has {num_devices})"
        )


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def degree_options(op: Op, num_devices: int, reduce: bool = True) -> list[list[int]]:
    """Per output dim, the degrees it may take: divisors of num_devices that divide the dim
    in whole split units (1 only for dims the op kind cannot split); with `reduce`, for an op
    with a contraction (`planner.graph.opkinds.contraction`), one more entry: the degrees
    that divide the contracted length."""
    pdims = parallel_dims(op)
    devs = divisors(num_devices)
    options: list[list[int]] = []
    for dim, size in zip(op.output.dims, op.output.sizes, strict=True):
        units = size // split_unit(op, dim) if dim in pdims else 1
        options.append([g for g in devs if units % g == 0] if dim in pdims else [1])
    con = contraction(op) if reduce else None
    if con is not None:
        options.append([g for g in devs if con.size % g == 0])
    return options


def partitions(
    op: Op, num_devices: int, max_split_dims: int | None = None, reduce: bool = True
) -> list[tuple[int, ...]]:
    """Task grids for `op` (degree tuples, with the contraction degree last when the op has
    one and `reduce` is on; `ParallelConfig.grid`) whose product divides `num_devices` (with
    at most `max_split_dims` degrees above 1), in enumeration order."""
    n = len(op.output.dims)
    parts = [
        p[:n] if len(p) > n and p[n] == 1 else p
        for p in itertools.product(*degree_options(op, num_devices, reduce))
        if num_devices % math.prod(p) == 0
        and (max_split_dims is None or sum(g > 1 for g in p) <= max_split_dims)
    ]
    parts.sort(key=partition_order)
    return parts


def make_config(
    op: Op, grid: tuple[int, ...], devices: tuple[int, ...], expert: int = 1
) -> ParallelConfig:
    """The config of `op` with task grid `grid` (`ParallelConfig.grid`) on `devices`, its
    routed experts spread `expert` ways (a moe op: `ParallelConfig.expert`)."""
    n = len(op.output.dims)
    return ParallelConfig(grid[:n], devices, grid[n] if len(grid) > n else 1, expert)


def expert_options(op: Op, grid: tuple[int, ...]) -> list[int]:
    """The expert-parallel degrees a config of `op` with task grid `grid` may take: for a moe
    op, the divisors of gcd(experts, token boxes) (every degree `_check_expert` accepts),
    ascending; [1] for every other op."""
    if op.kind != "moe":
        return [1]
    n = len(op.output.dims)
    boxes = math.prod(grid[:n])
    return divisors(math.gcd(int(op.attr("experts", 1)), boxes))


def partition_order(p: tuple[int, ...]) -> tuple[Any, ...]:
    """Sort key of partitions: more tasks first, then fewer split dims, then larger degrees."""
    return (-math.prod(p), sum(g > 1 for g in p), tuple(-g for g in p))


def count_partitions(
    op: Op, num_devices: int, max_split_dims: int | None = None, reduce: bool = True
) -> dict[int, int]:
    """Partitions of `op` per task count k, counted without listing them (a dynamic program
    over dims whose state is the product so far and the split dims used); a moe op's counts
    times its expert-parallel degrees per partition (`expert_options`), as `ConfigSpace`
    lists them."""
    if op.kind == "moe":
        return _count_moe_partitions(op, num_devices, max_split_dims, reduce)
    states: dict[tuple[int, int], int] = {(1, 0): 1}
    for opts in degree_options(op, num_devices, reduce):
        nxt: dict[tuple[int, int], int] = {}
        for (k, used), n in states.items():
            for g in opts:
                key = (k * g, used + (g > 1))
                if num_devices % key[0] or (max_split_dims is not None and key[1] > max_split_dims):
                    continue
                nxt[key] = nxt.get(key, 0) + n
        states = nxt
    out: dict[int, int] = {}
    for (k, _), n in states.items():
        out[k] = out.get(k, 0) + n
    return out


def _count_moe_partitions(
    op: Op, num_devices: int, max_split_dims: int | None, reduce: bool
) -> dict[int, int]:
    """`count_partitions` of a moe op: its few grids listed, each times its expert-parallel
    degrees (`expert_options`: they divide its token boxes, k / reduce)."""
    out: dict[int, int] = {}
    for grid in partitions(op, num_devices, max_split_dims, reduce):
        k = math.prod(grid)
        out[k] = out.get(k, 0) + len(expert_options(op, grid))
    return out


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
    """The candidate configs of one op, grouped by partition for vectorized cost tables.

    Ops whose enumeration is the same (same dims, sizes, split units and seeds) share one
    OpConfigs object, so cost tables can be keyed by its identity."""

    configs: tuple[ParallelConfig, ...]
    # For each group: (partition, device sets (O, k) array, indices of its configs in `configs`).
    groups: tuple[tuple[tuple[int, ...], np.ndarray, np.ndarray], ...]

    def __len__(self) -> int:
        return len(self.configs)

    @cached_property
    def _positions(self) -> dict[ParallelConfig, int]:
        return {c: i for i, c in reversed(list(enumerate(self.configs)))}

    def index(self, cfg: ParallelConfig) -> int:
        try:
            return self._positions[cfg]
        except KeyError:
            raise ConfigError(f"config {cfg} is not in the config space") from None

    def by_reduce(self) -> list[tuple[int, np.ndarray]]:
        """(contraction degree, indices of the configs with it) for each degree present,
        ascending (one entry, degree 1, for ops without contraction splits)."""
        reduce = np.array([c.reduce for c in self.configs], dtype=np.int64)
        return [(int(r), np.flatnonzero(reduce == r)) for r in np.unique(reduce)] or [
            (1, np.zeros(0, dtype=np.int64))
        ]

    def subset(self, rows: np.ndarray) -> OpConfigs:
        """The configs at `rows` (whole partition groups, ascending), regrouped."""
        where = {int(r): k for k, r in enumerate(rows)}
        groups = []
        for part, sets, idx in self.groups:
            keep = [i for i, r in enumerate(idx.tolist()) if r in where]
            if keep:
                new_idx = np.array([where[int(idx[i])] for i in keep], dtype=np.int64)
                groups.append((part, sets[keep], new_idx))
        return OpConfigs(tuple(self.configs[int(r)] for r in rows), tuple(groups))


SPACE_KINDS = ("full", "mesh")
MESH_MAX_SPLIT_DIMS = 2  # docs/space.md: the loss this costs, measured


class ConfigSpace:
    """Candidate configs per op of `graph` on `devices` (deterministic; see module doc).

    kind: "full" or "mesh" (needs a homogeneous cluster). max_split_dims: at most this many
    split dims per partition (mesh default 2, full default unlimited). seeds: extra configs
    per op (a sequence with one sequence of configs per op) that the mesh space must hold.
    reduce: whether ops with a contraction may also split it (`ParallelConfig.reduce`; a
    split dim like the others for `max_split_dims`)."""

    def __init__(
        self,
        graph: OpGraph,
        devices: DeviceGraph,
        max_configs: int | None = None,
        kind: str = "full",
        max_split_dims: int | None = None,
        seeds: Sequence[Sequence[ParallelConfig]] | None = None,
        reduce: bool = True,
    ):
        if max_configs is not None and max_configs < 1:
            raise ConfigError(f"max_configs must be >= 1, got {max_configs}")
        if kind not in SPACE_KINDS:
            raise ConfigError(f"config space kind must be one of {SPACE_KINDS}, got {kind!r}")
        if max_split_dims is not None and max_split_dims < 1:
            raise ConfigError(f"max_split_dims must be >= 1, got {max_split_dims}")
        if seeds is not None and len(seeds) != len(graph.ops):
            raise ConfigError(f"{len(seeds)} seed lists for {len(graph.ops)} ops")
        self.graph = graph
        self.devices = devices
        self.max_configs = max_configs
        self.kind = kind
        self.num_devices = devices.num_devices
        self.hierarchy = devices.hierarchy() if kind == "mesh" else None
        if kind == "mesh" and self.hierarchy is None:
            raise ConfigError(
                f"the mesh config space needs a homogeneous cluster of nested groups, and "
                f"{devices.name!r} is not one (DeviceGraph.hierarchy() is None): use the full space"
            )
        if max_split_dims is None and kind == "mesh":
            max_split_dims = MESH_MAX_SPLIT_DIMS
        self.max_split_dims = max_split_dims
        self.seeds = seeds
        self.reduce = reduce
        host_names = [d.host for d in devices.devices]
        host_ids = {h: i for i, h in enumerate(dict.fromkeys(host_names))}
        self._hosts = [host_ids[h] for h in host_names]
        self._sets: dict[int, np.ndarray] = {}
        self._tuples: dict[int, list[tuple[int, ...]]] = {}
        self._cache: dict[Any, OpConfigs] = {}

    def describe(self) -> dict[str, Any]:
        """What was searched, as recorded in plan files: kind, caps and the hierarchy."""
        return {
            "kind": self.kind,
            "max_split_dims": self.max_split_dims,
            "max_configs": self.max_configs,
            "hierarchy": list(self.hierarchy.sizes) if self.hierarchy is not None else None,
            "seeded": self.seeds is not None,
            "reduce": self.reduce,
        }

    def _device_sets(self, k: int) -> np.ndarray:
        if k not in self._sets:
            if self.hierarchy is not None:
                self._sets[k] = mesh_blocks(self.hierarchy.sizes, k)
            else:
                self._sets[k] = device_sets(self.num_devices, k, self._hosts)
            self._sets[k].setflags(write=False)
        return self._sets[k]

    def _set_tuples(self, k: int) -> list[tuple[int, ...]]:
        if k not in self._tuples:
            self._tuples[k] = [tuple(row) for row in self._device_sets(k).tolist()]
        return self._tuples[k]

    @cached_property
    def ops(self) -> tuple[OpConfigs, ...]:
        return tuple(self._op_configs(i) for i in range(len(self.graph.ops)))

    def __getitem__(self, i: int) -> OpConfigs:
        return self.ops[i]

    def sizes(self) -> list[int]:
        return [len(c) for c in self.ops]

    def _op_configs(self, i: int) -> OpConfigs:
        op = self.graph.ops[i]
        seeds = tuple(dict.fromkeys(self.seeds[i])) if self.seeds is not None else ()
        pdims = parallel_dims(op)
        con = self.graph.contraction(i) if self.reduce else None
        key = (
            tuple((d, s, d in pdims, split_unit(op, d)) for d, s in op.output.shape),
            con.size if con is not None else None,
            op.attr("experts") if op.kind == "moe" else None,
            seeds,
        )
        if key not in self._cache:
            self._cache[key] = self._enumerate(op, seeds, con is not None)
        return self._cache[key]

    def _enumerate(
        self, op: Op, seeds: tuple[ParallelConfig, ...], reduce: bool = False
    ) -> OpConfigs:
        extra: dict[tuple[int, ...], dict[int, list[tuple[int, ...]]]] = {}
        for cfg in seeds:
            check_config(op, cfg, self.num_devices)
            extra.setdefault(cfg.grid, {}).setdefault(cfg.expert, []).append(cfg.devices)
        parts = partitions(op, self.num_devices, self.max_split_dims, reduce)
        parts += sorted(set(extra) - set(parts), key=partition_order)
        parts.sort(key=partition_order)
        configs: list[ParallelConfig] = []
        groups = []
        # a moe op: each grid once per expert-parallel degree (it adds no tasks and no split
        # dim: `max_split_dims` does not count it), each its own group of device sets
        cases = [
            (part, e)
            for part in parts
            for e in sorted(set(expert_options(op, part)) | set(extra.get(part, {})))
        ]
        for part, e in cases:
            if self.max_configs is not None and len(configs) >= self.max_configs:
                break
            k = math.prod(part)
            structured = self.max_split_dims is None or _splits(part) <= self.max_split_dims
            structured = structured and e in expert_options(op, part)
            sets = self._device_sets(k) if structured else np.zeros((0, k), dtype=np.int64)
            rows = self._set_tuples(k) if structured else []
            more = [s for s in extra.get(part, {}).get(e, []) if s not in set(rows)]
            if more:
                sets = np.concatenate([sets, np.array(more, dtype=np.int64)])
                sets.setflags(write=False)
                rows = rows + more
            if self.max_configs is not None:
                sets = sets[: self.max_configs - len(configs)]
                rows = rows[: len(sets)]
            idx = np.arange(len(configs), len(configs) + len(sets))
            configs.extend(make_config(op, part, row, e) for row in rows)
            groups.append((part, sets, idx))
        return OpConfigs(tuple(configs), tuple(groups))


def _splits(part: tuple[int, ...]) -> int:
    return sum(g > 1 for g in part)
