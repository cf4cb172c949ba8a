"""The Problem: cost tables that every exact backend consumes.

`node_cost[i]` (C_i,) holds t_c + t_s per config of node i; `edge_cost[e]` (C_u, C_v) holds
t_x per config pair of edge e = (u, v); a forbidden choice costs `inf`. Memory: `usage[i]`
(C_i, M) bytes per config in M memory pools (one per device for DNN problems, one for
cost-table problems), live over `intervals[i]` = [start, end); a choice vector is feasible
when at every time the live usages sum to at most `usage_limit` in every pool.

A Problem built from a DNN keeps where it came from in `origin` (a `DnnOrigin`: its graph,
devices, config space, cost model and the ops of each node), so choices map back to a
`Strategy`. Ops that share a parameter group (unrolled RNN steps) are tied into one node by
default, one decision for the whole group, as FlexFlow did to run OptCNN on RNNs: the node's
cost sums its ops' costs, edges inside the group add their diagonal (both ends take the same
config) and `origin.node_ops[k]` lists the ops of node k. A Problem read from a cost-table JSON
(`planner.problems.costtable`) has no DNN behind it (`origin` is None): it is the shape of the
public IOPDDL auto-sharding problems. `Problem.is_dnn` is the one test of which kind a problem
is; `Problem.dnn()` gives the origin, or one ProblemError for a cost-table problem.

For DNN problems the liveness of node i in the forward/backward order is [i, 2n - i): its
output and parameters are live from its forward until its backward, so the peak (all nodes
live at the turn from forward to backward) is the sum of every node's usage.

`build_problem` searches a config space of kind "full", "mesh" or "auto" (docs/space.md),
estimates the tables' sizes and checks them against a budget and the devices' memory before
building (`planner.problems.sizes`), and gives ops and edges with equal cost signatures the
same read-only table; the arrays may therefore be shared between nodes and edges.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from planner.costs.config import ParallelConfig
from planner.deadline import Deadline
from planner.errors import ConfigError, ProblemError
from planner.problems import sizes
from planner.problems.baselines import BASELINES, applicable
from planner.problems.sizes import DEFAULT_TABLE_BUDGET

if TYPE_CHECKING:
    from planner.costs.config import ConfigSpace
    from planner.costs.costmodel import CostModel
    from planner.graph.opgraph import OpGraph
    from planner.hardware.devices import DeviceGraph
    from planner.problems.strategy import Strategy

FORBIDDEN = 1e18  # cost-table convention: a cost >= 1e18 forbids the choice


@dataclass(frozen=True, eq=False)
class DnnOrigin:
    """What a DNN problem was built from: the op graph, the devices, the config space searched,
    the cost model that priced the tables, and `node_ops[k]`, the ops node k decides for (one
    op per node unless parameter groups are tied)."""

    graph: OpGraph
    devices: DeviceGraph
    space: ConfigSpace
    cost_model: CostModel
    node_ops: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, eq=False)
class Problem:
    """One planning problem in the form every backend reads: a graph of nodes, each with a
    cost per choice (`node_cost`, OptCNN's t_c + t_s), and edges with a cost per pair of
    choices (`edge_cost`, t_x); optionally per-choice memory `usage` with live `intervals`
    and a `usage_limit` per pool. DNN problems (from `build_problem`) also carry their
    `origin` (`DnnOrigin`: graph, devices, config space, cost model, ops per node), so a choice
    vector maps back to a `Strategy`; cost-table problems (read from JSON) carry the tables
    only (`origin` None). Ask `is_dnn` which kind a problem is, and `dnn()` for the origin.
    Tables may be shared (the same read-only array) between identical nodes or edges."""

    name: str
    node_names: tuple[str, ...]
    node_cost: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int], ...]
    edge_cost: tuple[np.ndarray, ...]
    usage: tuple[np.ndarray, ...] | None = None
    intervals: np.ndarray | None = None
    usage_limit: np.ndarray | None = None
    origin: DnnOrigin | None = None
    stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_nodes(self) -> int:
        return len(self.node_cost)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.node_cost)

    @property
    def is_dnn(self) -> bool:
        """True for a problem built from a DNN (it has an `origin`), False for a cost-table
        problem: the one test of which kind a problem is."""
        return self.origin is not None

    def dnn(self, needed_for: str = "it has cost tables only") -> DnnOrigin:
        """The DNN this problem was built from; for a cost-table problem, a ProblemError of one
        line that says what needed the DNN (`needed_for`)."""
        if self.origin is None:
            raise ProblemError(
                f"problem {self.name!r} has no DNN behind it (a cost-table problem): {needed_for}"
            )
        return self.origin

    @property
    def space_kind(self) -> str | None:
        """The config space searched ("full" or "mesh"); None for a cost-table problem."""
        return self.dnn().space.kind if self.is_dnn else None

    @property
    def has_memory_limit(self) -> bool:
        return self.usage_limit is not None

    @functools.cached_property
    def integer_costs(self) -> bool:
        """Whether every finite node and edge cost is an integer (then so is every additive
        objective, and a bound can be rounded up). Computed once: 0.1 s on IOPDDL's M."""
        tables = {id(t): t for t in (*self.node_cost, *self.edge_cost)}  # a shared table once
        flat = np.concatenate([t.ravel() for t in tables.values()] or [np.zeros(0)])
        with np.errstate(invalid="ignore"):  # inf - inf: a forbidden cost, NaN, not counted
            return not bool((flat - np.floor(flat) > 0).any())

    def with_usage_limit(self, limit: np.ndarray | None) -> Problem:
        """This problem under another usage limit per pool (None: no limit). The tables are
        shared, not copied or checked again (checking a 1,024-device problem's tables takes
        seconds)."""
        if limit is not None and self.usage is None:
            raise ProblemError("a usage limit needs usage tables")
        copy = object.__new__(Problem)
        copy.__dict__.update(self.__dict__, usage_limit=limit)
        return copy

    def check_choices(self, choices: Sequence[int]) -> tuple[int, ...]:
        """Validate a choice vector (one config index per node) and return it as a tuple."""
        ch = tuple(int(c) for c in choices)
        if len(ch) != self.num_nodes:
            raise ProblemError(f"{len(ch)} choices for {self.num_nodes} nodes")
        for i, (c, n) in enumerate(zip(ch, self.sizes, strict=True)):
            if not 0 <= c < n:
                raise ProblemError(f"choice {c} for node {self.node_names[i]!r} is not in [0, {n})")
        return ch

    def strategy(self, choices: Sequence[int]) -> Strategy:
        """The Strategy for a choice vector (DNN problems only)."""
        from planner.problems.strategy import Strategy

        dnn = self.dnn("a strategy gives configs to the ops of a DNN; use the choices")
        ch = self.check_choices(choices)
        configs: list[ParallelConfig | None] = [None] * len(dnn.graph.ops)
        for ops, c in zip(dnn.node_ops, ch, strict=True):
            for i in ops:
                configs[i] = dnn.space[i].configs[c]
        return Strategy(
            dnn.graph,
            dnn.devices,
            tuple(c for c in configs if c is not None),
            space=dnn.space.describe(),
        )

    @property
    def ops_of_nodes(self) -> tuple[tuple[int, ...], ...]:
        """The ops each node decides for (one op per node unless groups are tied)."""
        return self.dnn().node_ops if self.is_dnn else tuple((i,) for i in range(self.num_nodes))

    def choices_of(self, strategy: Strategy) -> tuple[int, ...]:
        """Config indices of a strategy's configs (each must be in the config space)."""
        dnn = self.dnn("it has no config space to find a strategy's configs in")
        out = []
        for ops in dnn.node_ops:
            cfgs = {strategy.configs[i] for i in ops}
            if len(cfgs) > 1:
                raise ConfigError(
                    f"the strategy gives different configs to the ops of parameter group "
                    f"{dnn.graph.ops[ops[0]].param_group!r}, which this problem ties together"
                )
            out.append(dnn.space[ops[0]].index(strategy.configs[ops[0]]))
        return tuple(out)


def _validate(p: Problem) -> None:
    n = len(p.node_cost)
    if len(p.node_names) != n:
        raise ProblemError(f"{len(p.node_names)} node names for {n} nodes")
    for i, c in enumerate(p.node_cost):
        if c.ndim != 1 or len(c) == 0:
            raise ProblemError(f"node {p.node_names[i]!r} needs a non-empty 1-D cost vector")
        if not (c >= 0).all():  # NaN compares false too: one pass finds both
            raise ProblemError(f"node {p.node_names[i]!r} has a negative or NaN cost")
    if len(p.edges) != len(p.edge_cost):
        raise ProblemError(f"{len(p.edges)} edges but {len(p.edge_cost)} edge cost tables")
    checked: set[int] = set()  # tables shared by identical edges are checked once
    for (u, v), t in zip(p.edges, p.edge_cost, strict=True):
        if not (0 <= u < n and 0 <= v < n) or u == v:
            raise ProblemError(f"edge ({u}, {v}) does not join two different nodes of {n}")
        if t.shape != (len(p.node_cost[u]), len(p.node_cost[v])):
            raise ProblemError(
                f"edge ({u}, {v}) cost table is {t.shape}, expected "
                f"({len(p.node_cost[u])}, {len(p.node_cost[v])})"
            )
        if id(t) not in checked:
            if not (t >= 0).all():
                raise ProblemError(f"edge ({u}, {v}) has a negative or NaN cost")
            checked.add(id(t))
    if p.usage is not None:
        if len(p.usage) != n or p.intervals is None or p.intervals.shape != (n, 2):
            raise ProblemError("usage needs one (C_i, M) table and one interval per node")
        pools = {u.shape[1] for u in p.usage if u.ndim == 2}
        if len(pools) > 1 or any(
            u.shape[0] != len(c) for u, c in zip(p.usage, p.node_cost, strict=True)
        ):
            raise ProblemError("usage tables must be (C_i, M) with the same M for every node")
    if p.usage_limit is not None and p.usage is None:
        raise ProblemError("a usage limit needs usage tables")
    if p.origin is not None:
        ops = sorted(i for node in p.origin.node_ops for i in node)
        if len(p.origin.node_ops) != n or ops != list(range(len(p.origin.graph.ops))):
            raise ProblemError(
                f"the origin's node_ops must give each of the {n} nodes its ops, every op of "
                f"{p.origin.graph.name!r} once"
            )


def forbid(costs: np.ndarray) -> np.ndarray:
    """Map the cost-table convention (>= 1e18) to inf."""
    out = np.asarray(costs, dtype=np.float64).copy()
    out[out >= FORBIDDEN] = np.inf
    return out


def build_problem(
    graph: OpGraph,
    devices: DeviceGraph,
    cost_model: CostModel | None = None,
    max_configs: int | None = None,
    memory_limit: float | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    tie_groups: bool = True,
    space: str = "auto",
    table_budget: float | None = DEFAULT_TABLE_BUDGET,
    max_split_dims: int | None = None,
    deadline: Deadline | None = None,
    reduce: bool = True,
) -> Problem:
    """Cost tables for every op and edge of `graph` on `devices`.

    memory_limit: None (no limit), "device" (each device's own memory, less the cost options'
    headroom), or bytes per device.
    tie_groups: one decision per shared parameter group (see the module docstring).
    space: "full" (every config), "mesh" (structured, homogeneous clusters), or "auto" (full
    when its tables are small, else mesh; docs/space.md). table_budget: bytes the tables may
    take (None: no limit); past it, SizeError names the options that make the problem smaller.
    max_split_dims: at most this many split dims per partition (mesh default 2).
    reduce: whether linears and convolutions may also split their sums (Megatron-LM's
    row-parallel layer: `ParallelConfig.reduce`; docs/space.md).
    deadline: the caller's `planner.deadline.Deadline`; past it (or at Ctrl-C), OutOfTime.

    Before building, the sizes are estimated and checked (`planner.problems.sizes`): tensors
    beyond 64-bit sizes and models that fit no placement of the devices' memory are refused.
    Ops (and edges) with equal signatures share one read-only table; `stats` counts them.
    """
    from planner.costs.config import ConfigSpace
    from planner.costs.costmodel import CostModel

    t0 = time.perf_counter()
    cm = cost_model or CostModel(graph, devices)
    sizes.check_int64(graph)
    sizes.check_memory_fits(graph, devices, cm.options)
    kind, est = choose_space(graph, devices, cm, space, max_configs, max_split_dims, reduce)
    if table_budget is not None:
        sizes.check_budget(est, table_budget, f"{graph.name} on {devices.name}")
    seeds = baseline_seeds(graph, devices) if kind == "mesh" else None
    cspace = ConfigSpace(graph, devices, max_configs, kind, max_split_dims, seeds, reduce)
    n = len(graph.ops)
    node_key = [(cm.node_signature(i), id(cspace[i])) for i in range(n)]
    nodes: dict[Any, tuple[np.ndarray, np.ndarray]] = {}
    clock = deadline or Deadline.never()
    for i, key in enumerate(node_key):
        if key not in nodes:
            clock.check()
            nodes[key] = (
                _frozen(cm.node_table(i, cspace[i])),
                _frozen(cm.memory_table(i, cspace[i])),
            )
    node_cost = tuple(nodes[key][0] for key in node_key)
    usage = tuple(nodes[key][1] for key in node_key)
    t1 = time.perf_counter()
    edges, edge_cost = [], []
    tables: dict[Any, np.ndarray] = {}
    for k, e in enumerate(graph.edges):
        edge_key = (cm.edge_signature(e), id(cspace[e.src]), id(cspace[e.dst]))
        if edge_key not in tables:
            clock.check()
            tables[edge_key] = _frozen(cm.edge_table(e, cspace[e.src], cspace[e.dst]))
        edges.append((e.src, e.dst))
        edge_cost.append(tables[edge_key])
        if progress is not None:
            progress(k + 1, len(graph.edges))
    intervals = np.array([[i, 2 * n - i] for i in range(n)], dtype=np.int64)
    node_ops = tied_nodes(graph, cspace) if tie_groups else [[i] for i in range(n)]
    tied = _tie(node_ops, node_cost, usage, intervals, edges, edge_cost)
    limit = _memory_limit(memory_limit, cm)
    t2 = time.perf_counter()
    configs = [len(c) for c in node_cost]
    stats = {
        "node_seconds": t1 - t0,
        "edge_seconds": t2 - t1,
        "build_seconds": t2 - t0,
        "configs_max": float(max(configs)),
        "configs_total": float(sum(configs)),
        "node_tables": float(n),
        "node_tables_distinct": float(len(nodes)),
        "edge_tables": float(len(edge_cost)),
        "edge_tables_distinct": float(len(tables)),
        "edge_entries": float(sum(t.size for t in edge_cost)),
        "edge_entries_distinct": float(sum(t.size for t in tables.values())),
        "table_bytes": float(
            sum(a.nbytes + b.nbytes for a, b in nodes.values())
            + sum(t.nbytes for t in tables.values())
        ),
        "estimated_bytes": float(est.table_bytes),
        "estimated_seconds": est.seconds,
    }
    return Problem(
        name=graph.name,
        node_names=tuple(_node_name(graph, ops) for ops in node_ops),
        node_cost=tied[0],
        edges=tied[3],
        edge_cost=tied[4],
        usage=tied[1],
        intervals=tied[2],
        usage_limit=limit,
        origin=DnnOrigin(graph, devices, cspace, cm, tuple(tuple(ops) for ops in node_ops)),
        stats=stats,
    )


def choose_space(
    graph: OpGraph,
    devices: DeviceGraph,
    cost_model: CostModel,
    space: str = "auto",
    max_configs: int | None = None,
    max_split_dims: int | None = None,
    reduce: bool = True,
) -> tuple[str, sizes.SizeEstimate]:
    """The space kind `space` resolves to, and its size estimate. "auto" is the full space
    when its tables would take at most AUTO_FULL_BYTES and AUTO_FULL_SECONDS to build, else
    the mesh space (the full space when the cluster is not homogeneous)."""
    if space not in sizes.SPACES:
        raise ProblemError(f"space must be one of {sizes.SPACES}, got {space!r}")
    hierarchy = cost_model.hierarchy
    if space == "mesh" and hierarchy is None:
        raise ProblemError(
            f"the mesh config space needs a homogeneous cluster of nested groups, and "
            f"{devices.name!r} is not one: use space='full' (--space full)"
        )
    sigs = [cost_model.node_signature(i) for i in range(len(graph.ops))]
    edge_sigs = [cost_model.edge_signature(e) for e in graph.edges]
    hosts = len({d.host for d in devices.devices})
    level_sizes = hierarchy.sizes if hierarchy is not None else None

    def est(kind: str) -> sizes.SizeEstimate:
        seeds = seed_bound(graph) if kind == "mesh" else 0
        split = max_split_dims if kind == "mesh" or max_split_dims is not None else None
        return sizes.estimate(
            graph, devices.num_devices, kind, level_sizes, hosts, split, max_configs, seeds,
            sigs, edge_sigs, reduce,
        )  # fmt: skip

    if space != "auto":
        return space, est(space)
    full = est("full")
    cheap = full.table_bytes <= sizes.AUTO_FULL_BYTES and full.seconds <= sizes.AUTO_FULL_SECONDS
    if cheap or hierarchy is None:
        return "full", full
    return "mesh", est("mesh")


def seed_bound(graph: OpGraph) -> int:
    """At most this many baseline configs per op seed the mesh space: every baseline, but
    expert parallelism only for a graph with mixtures of experts."""
    moe = any(op.kind == "moe" for op in graph.ops)
    return sum(moe or name != "expert_parallel" for name in BASELINES)


def baseline_seeds(graph: OpGraph, devices: DeviceGraph) -> list[list[ParallelConfig]]:
    """Per op, the configs the baseline strategies give it (the mesh space holds them all)."""
    seeds: list[list[ParallelConfig]] = [[] for _ in graph.ops]
    for name in applicable(graph):
        for i, cfg in enumerate(BASELINES[name](graph, devices).configs):
            seeds[i].append(cfg)
    return seeds


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _node_name(graph: OpGraph, ops: list[int]) -> str:
    op = graph.ops[ops[0]]
    return op.name if len(ops) == 1 else f"{op.param_group} (x{len(ops)})"


def tied_nodes(graph: OpGraph, space: ConfigSpace) -> list[list[int]]:
    """Ops grouped by parameter group (where their candidate configs are identical)."""
    nodes: list[list[int]] = []
    first: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        g = op.param_group
        if g is not None and g in first:
            k = first[g]
            if space[nodes[k][0]].configs == space[i].configs:
                nodes[k].append(i)
                continue
        if g is not None and g not in first:
            first[g] = len(nodes)
        nodes.append([i])
    return nodes


def _tie(
    node_ops: list[list[int]],
    node_cost: tuple[np.ndarray, ...],
    usage: tuple[np.ndarray, ...],
    intervals: np.ndarray,
    edges: list[tuple[int, int]],
    edge_cost: list[np.ndarray],
) -> tuple[Any, ...]:
    """Node and edge tables of the tied problem: sums over each node's ops."""
    if all(len(ops) == 1 for ops in node_ops):  # nothing tied: keep parallel edges apart
        return node_cost, usage, intervals, tuple(edges), tuple(edge_cost)
    node_of = {i: k for k, ops in enumerate(node_ops) for i in ops}
    costs = [sum((node_cost[i] for i in ops[1:]), node_cost[ops[0]].copy()) for ops in node_ops]
    uses = tuple(sum((usage[i] for i in ops[1:]), usage[ops[0]].copy()) for ops in node_ops)
    spans = np.array([[intervals[ops, 0].min(), intervals[ops, 1].max()] for ops in node_ops])
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (a, b), t in zip(edges, edge_cost, strict=True):
        u, v = node_of[a], node_of[b]
        if u == v:
            costs[u] = costs[u] + np.diagonal(t)
        elif (v, u) in merged:
            merged[(v, u)] = merged[(v, u)] + t.T
        else:
            merged[(u, v)] = merged[(u, v)] + t if (u, v) in merged else t
    return tuple(costs), uses, spans, tuple(merged), tuple(merged.values())


def _memory_limit(limit: float | str | None, cm: CostModel) -> np.ndarray | None:
    if limit is None:
        return None
    if limit == "device":  # each device's memory less the cost options' headroom
        return cm.usable_memory()
    if isinstance(limit, str):
        raise ProblemError(f"memory limit must be 'device' or a number of bytes, got {limit!r}")
    if not limit > 0:
        raise ProblemError(f"memory limit must be positive, got {limit}")
    return np.full(cm.num_devices, float(limit))
