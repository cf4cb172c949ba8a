"""Sizes before building, and the guards that use them (docs/space.md, "Guards").

Every size of a Problem is known from counts before any table is built: configs per op
(`config.count_partitions` times the device sets per task count), the distinct node, memory
and edge tables (ops and edges with equal signatures share one table), their entries and
bytes, the device graph's D x D route tables. `estimate` computes them (and a rough build
time) in milliseconds with little memory; `check_budget` stops with one line that says how
big the problem would be and which option makes it smaller. Two more guards catch absurd
inputs before any work: `check_int64` (a tensor too large for 64-bit byte offsets) and
`check_memory_fits` (no placement at all fits the devices' memory); `check_devices_spec`
refuses a preset whose device graph alone would not fit, before it is built. After a search,
`strategy_memory` reports a strategy's peak bytes per device against each device's memory.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.costs.config import MESH_MAX_SPLIT_DIMS, count_partitions
from planner.costs.memory import param_bytes, usable_memory
from planner.costs.mesh import mesh_blocks
from planner.errors import ProblemError
from planner.graph.opkinds import parallel_dims, split_unit
from planner.hardware.presets import preset_device_count

if TYPE_CHECKING:
    from planner.costs.costmodel import CostModel, CostOptions
    from planner.graph.opgraph import OpGraph
    from planner.hardware.devices import DeviceGraph
    from planner.problems.strategy import Strategy

GiB = 2**30
DEFAULT_TABLE_BUDGET = 4 * GiB
# `space="auto"` takes the full space when its tables would need at most this many bytes and
# its estimated build time is at most AUTO_FULL_SECONDS, else the mesh space.
AUTO_FULL_BYTES = 256 * 2**20
AUTO_FULL_SECONDS = 30.0
SPACES = ("auto", "full", "mesh")
INT64_BYTES = 2**62  # largest tensor (in bytes) whose offsets, halos and products fit int64

# Rough seconds per unit of work, measured on the 2-core development machine (docs/space.md):
# hierarchical t_x per (config pair, task), dense t_x per (config pair, task pair), node
# tables per config, device routes per device pair.
SECONDS_PER_PAIR_TASK = 1.5e-7
SECONDS_PER_TASK_PAIR = 2e-8
SECONDS_PER_CONFIG = 1e-4
SECONDS_PER_ROUTE = 2e-5
ROUTE_BYTES = 3 * 8 + 64  # inv_bandwidth, latency, message cost, and the route itself
# A device graph's own bytes per device: devices, switches, links, the routing graph and the
# hierarchy's proof (dgx-h100-2048: 128 MiB over the imports at the peak of building it and
# its hierarchy, 16,384 GPUs; p100-2048x8: 100 MiB), and seconds per device to build it and
# prove its hierarchy (0.8 s for dgx-h100-2048, load 0.5; docs/devices.md).
DEVICE_GRAPH_BYTES = 8 * 1024
# A larger graph's cached trees per device pair: hops, seconds per byte and latency to every
# device (20 bytes) and the parent links of its ~2 nodes per device (8).
ROW_BYTES = 28
SECONDS_PER_DEVICE = 5e-5


class SizeError(ProblemError):
    """A problem too large to build, an input beyond 64-bit sizes, or a plan too large for
    the devices' memory."""


class MemoryRefusal(SizeError):
    """A model or a plan that does not fit the devices' memory with the training-memory
    options given (`check_memory_fits`, `check_strategy_memory`): `planner.plan` answers it,
    when ZeRO and recomputation were left unset, by planning again with both "auto".
    `fact`: what does not fit, without the advice."""

    def __init__(self, message: str, fact: str, final: bool = False) -> None:
        super().__init__(message)
        self.fact = fact
        self.final = final  # no ZeRO stage, recomputation or pipeline can make it fit


# Size units, as GNU tools read them: KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB and
# the bare K, M, G, T in powers of 1024; B or nothing, bytes. Letters in any case.
SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
    **{p: 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}


def parse_bytes(text: str) -> int:
    """A size -> bytes: '16GiB' (binary), '16GB' (decimal), '2G' (binary), '1e9', '512 MiB'.

    The one parser of every size option (--memory-limit, --table-budget); anything else is
    one SizeError that says what a size looks like."""
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(\S*)\s*", text)
    example = "such as 16GiB, 512MiB, 16GB or 1e9 (bytes)"
    if match is None:
        raise SizeError(f"expected a size {example}, got {text!r}")
    unit = SIZE_UNITS.get(match[2].lower())
    if unit is None:
        raise SizeError(
            f"unknown size unit {match[2]!r} in {text!r}: use B, KB/MB/GB/TB (powers of 1000) "
            "or KiB/MiB/GiB/TiB (powers of 1024)"
        )
    try:
        value = float(match[1]) * unit
    except ValueError:
        raise SizeError(f"expected a size {example}, got {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise SizeError(f"a size must be at least 1 byte, got {text!r}")
    return int(value)


def format_bytes(n: float) -> str:
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1024:.3g} KiB" if n >= 1024 else f"{n:.0f} B"


@dataclass(frozen=True)
class SizeEstimate:
    """What a Problem would hold, from counts alone."""

    space: str
    num_devices: int
    configs_max: int
    configs_total: int
    node_tables: int  # distinct (shared by ops with equal signatures)
    edge_tables: int
    edge_entries: int  # in the distinct edge tables
    edge_entries_all: int  # if every edge had its own table
    node_entries: int  # configs of the distinct node tables (a memory table has D per config)
    seconds: float  # rough build time

    @property
    def table_bytes(self) -> int:
        """float64 node, memory (C x D) and edge tables, plus the routes' (`route_table_bytes`:
        D x D tables on a small graph, a bounded cache of trees on a larger one)."""
        return 8 * (self.node_entries * (1 + self.num_devices) + self.edge_entries) + (
            route_table_bytes(self.num_devices)
        )

    def describe(self) -> str:
        return (
            f"{self.space} config space on {self.num_devices:,} devices: up to "
            f"{self.configs_max:,} configs per op, {self.edge_entries:,} edge-table entries in "
            f"{self.edge_tables} distinct tables, {format_bytes(self.table_bytes)} of tables, "
            f"~{self.seconds:.0f} s to build"
        )


def device_graph_bytes(num_devices: int) -> int:
    """Bytes of a device graph of `num_devices` devices, what any search holds (the pipeline
    search's included): its own (`DEVICE_GRAPH_BYTES` per device) and, up to
    `pairs.DENSE_DEVICES` devices, its D x D route tables (`route_table_bytes`)."""
    from planner.hardware.pairs import DENSE_DEVICES

    tables = route_table_bytes(num_devices) if num_devices <= DENSE_DEVICES else 0
    return DEVICE_GRAPH_BYTES * num_devices + tables


def route_table_bytes(num_devices: int) -> int:
    """Bytes of the routes the per-op search's cost tables ask of a device graph: up to
    `pairs.DENSE_DEVICES` devices, the D x D route and cost tables (`ROUTE_BYTES` per pair);
    beyond, the shortest-path trees of the sources it asks for (`ROW_BYTES` per pair at
    most), in a cache every graph shares and that never exceeds `pairs.ROW_CACHE_BYTES` (a
    cluster whose route costs follow a hierarchy needs none of it)."""
    from planner.hardware.pairs import DENSE_DEVICES, ROW_CACHE_BYTES

    if num_devices <= DENSE_DEVICES:
        return ROUTE_BYTES * num_devices**2
    return min(ROW_CACHE_BYTES, ROW_BYTES * num_devices**2)


def route_seconds(num_devices: int) -> float:
    """Rough seconds to build a device graph and the routes a plan asks of it."""
    from planner.hardware.pairs import DENSE_DEVICES

    if num_devices <= DENSE_DEVICES:
        return SECONDS_PER_ROUTE * num_devices**2
    return SECONDS_PER_DEVICE * num_devices


def op_space_key(graph: OpGraph, i: int, reduce: bool = True) -> tuple[Any, ...]:
    """What op i's candidate configs depend on (ops with equal keys share one config list)."""
    op = graph.ops[i]
    pdims = parallel_dims(op)
    con = graph.contraction(i) if reduce else None
    shape = tuple((d, s, d in pdims, split_unit(op, d)) for d, s in op.output.shape)
    experts = op.attr("experts") if op.kind == "moe" else None  # its expert degrees
    return (*shape, ("reduce", con.size if con is not None else None), ("experts", experts))


def op_configs(
    graph: OpGraph,
    i: int,
    num_devices: int,
    kind: str,
    sizes: Sequence[int] | None = None,
    hosts: int = 1,
    max_split_dims: int | None = None,
    max_configs: int | None = None,
    seeds: int = 0,
    reduce: bool = True,
) -> tuple[int, float]:
    """(configs, task count summed over them) of op i in a `kind` space, without listing
    them. sizes: the hierarchy (mesh); hosts: host count (the full space's strided sets)."""
    if kind == "mesh" and max_split_dims is None:
        max_split_dims = MESH_MAX_SPLIT_DIMS
    summable = reduce and graph.contraction(i) is not None
    parts = count_partitions(graph.ops[i], num_devices, max_split_dims, summable)
    configs, tasks = 0, 0.0
    for k, n in sorted(parts.items(), reverse=True):
        if kind == "mesh":
            assert sizes is not None
            sets = len(mesh_blocks(sizes, k))
        else:
            local = num_devices // hosts if num_devices % hosts == 0 else 0
            sets = num_devices // k + (local if k == hosts and hosts > 1 and local > 1 else 0)
        take = n * sets if max_configs is None else min(n * sets, max_configs - configs)
        configs += take
        tasks += take * k
        if max_configs is not None and configs >= max_configs:
            break
    return configs + seeds, tasks + seeds * num_devices


def estimate(
    graph: OpGraph,
    num_devices: int,
    kind: str,
    sizes: Sequence[int] | None = None,
    hosts: int = 1,
    max_split_dims: int | None = None,
    max_configs: int | None = None,
    seeds: int = 0,
    signatures: Sequence[Any] | None = None,
    edge_signatures: Sequence[Any] | None = None,
    reduce: bool = True,
) -> SizeEstimate:
    """The sizes of `graph`'s Problem in a `kind` space ("full" or "mesh"). signatures: each
    op's node-table signature (`CostModel.node_signature`), edge_signatures each edge's
    (`CostModel.edge_signature`); ops (edges) with equal signatures and config lists share
    tables (default: every op and edge its own). reduce: whether contraction splits are in
    the space (`ConfigSpace`)."""
    keys = [op_space_key(graph, i, reduce) for i in range(len(graph.ops))]
    count: dict[Any, tuple[int, float]] = {}
    for key, i in {k: i for i, k in reversed(list(enumerate(keys)))}.items():
        count[key] = op_configs(
            graph, i, num_devices, kind, sizes, hosts, max_split_dims, max_configs, seeds, reduce
        )
    configs = [count[key][0] for key in keys]
    mean_tasks = [count[key][1] / max(1, count[key][0]) for key in keys]
    sigs = signatures if signatures is not None else list(range(len(graph.ops)))
    nodes = {(sigs[i], keys[i]): configs[i] for i in range(len(graph.ops))}
    edges: dict[Any, tuple[int, int]] = {}
    hierarchical = kind == "mesh" or sizes is not None
    seconds = SECONDS_PER_CONFIG * sum(nodes.values()) + route_seconds(num_devices)
    for n, e in enumerate(graph.edges):
        sig = edge_signatures[n] if edge_signatures is not None else n
        key = (sig, keys[e.src], keys[e.dst])
        if key in edges:
            continue
        cu, cv = configs[e.src], configs[e.dst]
        edges[key] = (cu, cv)
        ku, kv = mean_tasks[e.src], mean_tasks[e.dst]
        if hierarchical:
            seconds += SECONDS_PER_PAIR_TASK * cu * cv * (ku + kv)
        else:
            seconds += SECONDS_PER_TASK_PAIR * cu * cv * ku * kv
    return SizeEstimate(
        space=kind,
        num_devices=num_devices,
        configs_max=max(configs, default=0),
        configs_total=sum(configs),
        node_tables=len(nodes),
        edge_tables=len(edges),
        edge_entries=sum(a * b for a, b in edges.values()),
        edge_entries_all=sum(configs[e.src] * configs[e.dst] for e in graph.edges),
        node_entries=sum(nodes.values()),
        seconds=seconds,
    )


def check_budget(est: SizeEstimate, budget: float, name: str) -> None:
    """Stop with one line when the estimated tables exceed `budget` bytes."""
    if est.table_bytes <= budget:
        return
    smaller = ["fewer devices", "--max-configs N"]
    if est.space == "full":
        smaller.insert(0, "--space mesh")
    elif est.space == "mesh":
        smaller.insert(0, "--max-split-dims 1")
    raise SizeError(
        f"{name}: the {est.describe()}, over the table budget of {format_bytes(budget)}: "
        f"make it smaller with {', '.join(smaller)} (or raise --table-budget)"
    )


# -- absurd inputs ----------------------------------------------------------------------------


def check_int64(graph: OpGraph) -> None:
    """Every tensor must be small enough for 64-bit byte offsets, halos and products."""
    for op in graph.ops:
        nbytes = math.prod(op.output.sizes) * op.output.dtype_bytes
        if nbytes >= INT64_BYTES:
            raise SizeError(
                f"op {op.name!r} of {graph.name!r} outputs a {format_bytes(nbytes)} tensor "
                f"{dict(op.output.shape)}: beyond 64-bit sizes; use a smaller batch"
            )


def least_memory(graph: OpGraph, options: CostOptions) -> float:
    """Bytes every placement must keep somewhere at the turn from forward to backward: the
    activations kept of each op for the backward once (`planner.costs.activations`; with
    recomputation, a recomputed op's working set counts as one region's) and its parameters'
    training state once (weights, gradients, optimizer state, master copy:
    `planner.costs.memory`; ZeRO shards only what replicas would repeat, so no stage keeps
    less than one copy), shared groups once."""
    from planner.costs.activations import activation_memory
    from planner.costs.recompute import recomputed_ops

    groups: dict[str, int] = {}
    for op in graph.ops:
        if op.param_group is not None:
            groups[op.param_group] = groups.get(op.param_group, 0) + 1
    act = activation_memory(graph, recomputed_ops(graph, options.recompute))
    total = 0.0
    for i, op in enumerate(graph.ops):
        share = groups.get(op.param_group, 1) if op.param_group is not None else 1
        held = param_bytes(op.params, options.optimizer, options.master_weights).total
        total += float(op.output.nbytes) * act.per_op(i) + held / share
    return total


def state_memory(graph: OpGraph, options: CostOptions) -> float:
    """Bytes of every parameter's training state (weights, gradients, optimizer state, master
    copy), shared groups once: what every plan keeps somewhere, whatever its ZeRO stage (which
    shards each byte over replicas, one copy in all), recomputation, pipeline or batch."""
    return sum(
        param_bytes(op.params, options.optimizer, options.master_weights).total
        for op in graph.parameter_owners()
    )


def kept_words(options: CostOptions) -> str:
    """' (less the 5% headroom and a 2 GiB reserve per GPU)', or '' when nothing is kept."""
    parts = []
    if options.headroom:
        parts.append(f"the {options.headroom:.0%} headroom")
    if options.reserve:
        parts.append(f"a {format_bytes(options.reserve)} reserve per GPU")
    return f" (less {' and '.join(parts)})" if parts else ""


def check_memory_fits(graph: OpGraph, devices: DeviceGraph, options: CostOptions) -> None:
    """Stop when even spread evenly over every device the model cannot fit: the least bytes
    any placement needs (`least_memory`) exceed the devices' usable memory summed. When its
    parameters' training state alone does (`state_memory`), the refusal is `final`: no
    memory option makes it fit, only more devices (or less state) do."""
    from planner.costs.recompute import recomputed_ops

    need = least_memory(graph, options)
    have = float(usable_memory(devices, options.headroom, options.reserve).sum())
    if need <= have:
        return
    n = devices.num_devices
    kept = kept_words(options)
    if have <= 0:
        raise MemoryRefusal(
            f"the memory of {devices.name!r} is all kept free{kept}: nothing fits; give a smaller "
            "headroom or reserve (headroom=, reserve=; --headroom, --reserve)",
            f"{devices.name!r} has no memory left to plan with{kept}",
            final=True,
        )
    state = state_memory(graph, options)
    if state > have:
        fact = (
            f"the parameters of {graph.name!r} and their training state alone take "
            f"{format_bytes(state)}; spread evenly over the {n:,} device{'s' if n != 1 else ''} "
            f"of {devices.name!r} that is {format_bytes(state / n)} per device, more than their "
            f"{format_bytes(have / n)}{kept}"
        )
        lighter = (
            ", or keep less state (a lighter optimizer, no master weights)"
            if options.optimizer != "none" or options.master_weights
            else ""
        )
        raise MemoryRefusal(
            f"{fact}: no ZeRO stage, recomputation, pipeline or smaller batch makes it fit; "
            f"use at least {math.ceil(state / (have / n)):,} devices of "
            f"{format_bytes(have / n)}{lighter}",
            fact,
            final=True,
        )
    fact = (
        f"{graph.name!r} needs at least {format_bytes(need)} of activations and parameters; "
        f"spread evenly over the {n:,} device{'s' if n != 1 else ''} of {devices.name!r} that is "
        f"{format_bytes(need / n)} per device, more than their {format_bytes(have / n)}{kept}"
    )
    raise MemoryRefusal(
        f"{fact}: use a smaller batch or more devices"
        + (
            ", or recompute activations (recompute='full' or 'auto', --recompute)"
            if options.recompute in ("none", 0) and len(recomputed_ops(graph))
            else ""
        ),
        fact,
    )


def check_devices_spec(spec: str, budget: float = DEFAULT_TABLE_BUDGET) -> None:
    """Refuse a preset whose device graph alone (`device_graph_bytes`: linear in the devices
    beyond a small graph's tables) exceeds `budget`, before building it."""
    n = preset_device_count(spec)
    if n is None or device_graph_bytes(n) <= budget:
        return
    raise SizeError(
        f"{spec} has {n:,} devices: its device graph alone would need "
        f"{format_bytes(device_graph_bytes(n))}, over the table budget of "
        f"{format_bytes(budget)}: use fewer devices (or raise --table-budget)"
    )


# -- after a search ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryFit:
    """A strategy's peak bytes per device (parameters with their training state, the
    activations kept for the backward and the largest working set: `CostModel.
    strategy_memory`) against what each device may use (its memory less the headroom and
    reserve kept free)."""

    peak: np.ndarray  # (D,)
    capacity: np.ndarray  # (D,)
    names: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return bool((self.peak <= self.capacity).all())

    @property
    def worst(self) -> int:
        """The device with the largest peak / capacity."""
        return worst_device(self.peak, self.capacity)

    def describe(self) -> str:
        d = self.worst
        return (
            f"peak {format_bytes(float(self.peak[d]))} on {self.names[d]} of "
            f"{format_bytes(float(self.capacity[d]))}"
        )


def worst_device(peak: np.ndarray, capacity: np.ndarray) -> int:
    """The device whose peak is largest for what it may use (over it first, when any is)."""
    over = peak - capacity
    if (over > 0).any():
        return int(np.argmax(over))
    ratio = np.divide(peak, capacity, out=np.zeros_like(peak), where=capacity > 0)
    return int(np.argmax(ratio))


def peak_parts(cost_model: CostModel, configs: Sequence[Any]) -> dict[str, Any]:
    """What a strategy's peak holds, on the device where it is tightest (`worst_device`):
    bytes of weights, gradients, optimizer state (with master copies), activations kept for
    the backward and the largest working set (`CostModel.memory_breakdown`), their `total`,
    and the device's `memory`, of which `kept_free` bytes (headroom and reserve) are not
    for the plan. What plan summaries, plan files and `planner evaluate` report."""
    parts = cost_model.memory_breakdown(configs)
    total = np.sum(np.stack(list(parts.values())), axis=0)
    usable = cost_model.usable_memory()
    d = worst_device(total, usable)
    memory = float(cost_model.devices.devices[d].memory)
    return {
        "device": cost_model.devices.devices[d].name,
        **{k: float(v[d]) for k, v in parts.items()},
        "total": float(total[d]),
        "kept_free": memory - float(usable[d]),
        "memory": memory,
    }


_PEAK_META = ("device", "stage", "total", "kept_free", "memory")


def pipeline_peak_parts(
    timeline: Any, devices: DeviceGraph, options: CostOptions
) -> dict[str, Any]:
    """What a pipelined step's peak holds, on the stage whose peak is largest (`PipelineTimeline.
    peak_parts`: parameters with their training state, activations in flight, the working
    set), with its `total`, a device's `memory` and the `kept_free` bytes of it."""
    g = int(np.argmax(timeline.peak_bytes))
    usable = usable_memory(devices, options.headroom, options.reserve)
    d = int(np.argmin(usable))
    memory = float(devices.devices[d].memory)
    parts = timeline.peak_parts[g] if timeline.peak_parts else {}
    return {
        "stage": g,
        **{k: float(v) for k, v in parts.items()},
        "total": float(timeline.peak_bytes[g]),
        "kept_free": memory - float(usable[d]),
        "memory": memory,
    }


def describe_peak(parts: dict[str, Any]) -> str:
    """'peak 61.2 GiB = weights 8 GiB + ... on gpu3, of 80 GiB (6 GiB of it kept free: ...)'."""
    terms = " + ".join(
        f"{k.replace('_', ' ')} {format_bytes(v)}"
        for k, v in parts.items()
        if k not in _PEAK_META and v
    )
    where = f"stage {parts['stage']}" if "stage" in parts else parts.get("device", "?")
    return (
        f"peak {format_bytes(parts['total'])} = {terms or 'nothing'} on {where}, of "
        f"{format_bytes(parts['memory'])} ({format_bytes(parts['kept_free'])} of it kept free: "
        "headroom and reserve)"
    )


def strategy_memory(cost_model: CostModel, strategy: Strategy) -> MemoryFit:
    """Peak bytes per device of `strategy` (the cost model's memory rule) and the capacity
    (each device's memory less the cost options' headroom and reserve)."""
    peak = cost_model.strategy_memory(strategy.configs)
    names = tuple(d.name for d in cost_model.devices.devices)
    return MemoryFit(peak, cost_model.usable_memory(), names)


def check_strategy_memory(cost_model: CostModel, strategy: Strategy) -> MemoryFit:
    """The strategy's MemoryFit; SizeError when some device's peak exceeds its memory."""
    fit = strategy_memory(cost_model, strategy)
    if not fit.fits:
        parts = describe_peak(peak_parts(cost_model, strategy.configs))
        fact = f"the plan does not fit the devices' memory ({parts})"
        raise MemoryRefusal(
            f"{fact}: plan again with "
            f"backend 'auto' (the default: it searches under the devices' memory when memory "
            f"is tight), or with memory_limit='device' (--memory-limit device) and any backend "
            f"but elimination (portfolio, cpsat, ilp, search, mcmc), or let ZeRO shard the "
            f"training state (zero='auto', --zero auto) and recompute activations "
            f"(recompute='auto', --recompute auto), or use more devices or a smaller batch",
            fact,
        )
    return fit


# -- a limit no answer can meet ---------------------------------------------------------------


@dataclass(frozen=True)
class UsageBound:
    """Lower bounds on any answer's memory use, from each node's least usage: per pool, the
    largest over time of the live nodes' least usage in that pool, summed (`per_pool`, (M,));
    the same for all pools together (`together`); and the largest single node's least
    usage in its busiest pool (`node`)."""

    per_pool: np.ndarray
    together: float
    node: float

    @property
    def peak(self) -> float:
        """A lower bound on the largest pool's peak of any answer."""
        return max(float(self.per_pool.max()), self.together / len(self.per_pool), self.node)


def usage_bound(problem: Any) -> UsageBound | None:
    """The `UsageBound` of a Problem with usage tables (None without): a sweep over the
    nodes' live intervals, O(nodes log nodes + nodes x pools)."""
    if problem.usage is None or problem.intervals is None or not problem.usage:
        return None
    least = np.array([u.min(axis=0) for u in problem.usage], dtype=float)  # (N, M)
    least_sum = np.array([u.sum(axis=1).min() for u in problem.usage], dtype=float)
    starts, ends = problem.intervals[:, 0], problem.intervals[:, 1]
    ever = ends > starts  # an empty interval is never live
    node = max(
        (float(u.max(axis=1).min()) for u, e in zip(problem.usage, ever, strict=True) if e),
        default=0.0,
    )
    times = np.unique(starts)
    weights = np.concatenate([least, least_sum[:, None]], axis=1) * ever[:, None]
    change = np.zeros((len(times) + 1, weights.shape[1]))
    np.add.at(change, np.searchsorted(times, starts), weights)
    np.add.at(change, np.searchsorted(times, ends), -weights)  # ends past the last start: row -1
    level = np.cumsum(change[:-1], axis=0).max(axis=0)
    return UsageBound(level[:-1], float(level[-1]), node)


LIMIT_RTOL = 1e-9  # memory_feasible's default rtol


def usage_limit_error(problem: Any) -> str | None:
    """Why no answer can meet the problem's usage limit, in one line naming the smallest
    footprint any answer can have (`usage_bound`), or None when the bound does not rule
    every answer out (or there is no limit)."""
    limit = problem.usage_limit
    bound = usage_bound(problem) if limit is not None else None
    if bound is None:
        return None
    # the evaluators' tolerance (planner.problems.evaluate.memory_feasible): a limit an
    # answer meets within it is not refused
    slack = 1.0 + LIMIT_RTOL
    over = bool((bound.per_pool > limit * slack).any()) or bound.together > float(
        limit.sum() * slack
    )
    ever = problem.intervals[:, 1] > problem.intervals[:, 0]
    over = over or any(
        float((u / np.maximum(limit, 1e-300)).max(axis=1).min()) > slack
        for u, e in zip(problem.usage, ever, strict=True)
        if e
    )
    if not over:
        return None
    dnn = problem.is_dnn
    show = format_bytes if dnn else (lambda x: f"{x:.6g}")
    pool = "device" if dnn else "pool"
    uniform = bool(np.all(limit == limit[0]))
    given = (
        f"{show(float(limit[0]))} per {pool}"
        if uniform
        else f"of {show(float(limit.min()))} per {pool} or more"
    )
    return (
        f"the memory limit {given} is below the smallest footprint any answer can have: at "
        f"least {show(bound.peak)} on the busiest {pool} (each node's least memory, summed "
        f"over the nodes live at once): raise the limit to at least that"
        + (", or plan with more devices" if dnn else "")
    )
