"""The static execution plan of a Strategy: what each rank computes, sends and synchronizes.

Every rank derives the same `ExecPlan` from the strategy alone (no communication):

- tasks: op i under its config has tasks numbered row-major over the degrees
  (`planner.costs.regions.task_boxes`); task t runs on rank `cfg.devices[t]` with the
  `planner.costs.kernels.TaskPlan` of `plan_task` (its output box, the input boxes it reads, halos
  included, its parameter shards).
- transfers: for each edge and each (producer task p, consumer task q), the intersection of
  p's output box with q's needed box (`planner.costs.regions.needed_boxes`) is one `Transfer`,
  exactly the overlaps whose volume `planner.costs.regions.overlap_volume` gives the cost model's
  t_x. Forward, the producer's rank sends that region to the consumer's rank (a local slice
  when both are the same rank); backward, the consumer sends the gradient of the region back
  and the producer sums the pieces. An LSTM step passes its state (h, c) to the next step:
  both travel with the same boxes (2 components).
- parameter sync: each task holds its shards of the op's parameters (`ShardKey`: a channel
  interval of the parameter's split axis, or the whole tensor). The gradient of every
  element of a parameter is the sum over all tasks, on all ranks, whose shards hold it
  (replicas of a sample or spatial split, the steps of an unrolled RNN that share the
  weights). The channel axis is cut into elementary intervals at every shard boundary; each
  interval held by several ranks is one all-reduce item in the group of those ranks
  (`SyncItem`), launched as soon as the backward pass has passed every op that uses it.
- batch norm over a split sample/height/width dimension: the tasks that hold the same
  channels form a statistics group whose per-channel sums are all-reduced, forward and
  backward, so the normalization equals the single-process one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from planner.costs.config import ParallelConfig
from planner.costs.kernels import TaskPlan, fused_ops, plan_task
from planner.costs.regions import edge_grid, needed_boxes, overlap_volume, task_boxes
from planner.errors import LayerwiseError
from planner.graph.moe import ffn_axis, moe_spec
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import (
    CHANNEL,
    contraction,
    is_batch_norm,
    parameter_dims,
    stats_groups,
)
from planner.problems.strategy import Strategy

__all__ = [
    "ExecPlan",
    "RuntimeConfigError",
    "ShardKey",
    "SyncItem",
    "Transfer",
    "build_plan",
]

Box = tuple[tuple[int, int], ...]

# Pointwise functions the runtime computes as the identity: dropout, so that a run is
# deterministic and comparable with single-process training (see docs/runtime.md).
IDENTITY_FUNCTIONS = ("dropout",)


class RuntimeConfigError(LayerwiseError):
    """A strategy, graph or option that the runtime cannot execute (raised before spawning)."""


@dataclass(frozen=True)
class Transfer:
    """One region of an edge's tensor moving from a producer task to a consumer task."""

    edge: int  # index into graph.edges
    src_task: int
    dst_task: int
    src_rank: int
    dst_rank: int
    box: Box  # absolute region of the producer's output tensor
    components: int  # 2 for an LSTM state (h, c), else 1
    tag: int  # message tag of component 0 forward; component c adds c; backward adds offset
    partial: bool = False  # a partial sum (the producer splits its contraction): pieces add up

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)


@dataclass(frozen=True)
class ShardKey:
    """A task's shard of parameter `name`: channels [lo, hi) of its split axis (the whole
    parameter when the axis is None or not split: lo, hi = 0, extent)."""

    name: str
    lo: int
    hi: int


@dataclass(frozen=True)
class ParamInfo:
    """How the tasks of the ops that use parameter `name` cut it."""

    name: str
    shape: tuple[int, ...]
    axis: int | None  # the axis a channel split slices
    blocks: int  # stacked channel-sized blocks along that axis (4 LSTM gates)
    extent: int  # channels along the axis (1 when the parameter is never sliced)


@dataclass(frozen=True)
class SyncItem:
    """Channels [lo, hi) of parameter `param`, whose gradient is summed over `ranks`."""

    param: str
    lo: int
    hi: int
    ranks: tuple[int, ...]
    ready: int  # the op index after whose backward (reverse order) the sum can start


@dataclass(frozen=True)
class OpExec:
    """Op `index` under its config: one TaskPlan per task and the rank of each task."""

    index: int
    op: Op
    cfg: ParallelConfig
    plans: tuple[TaskPlan, ...]
    shards: tuple[tuple[ShardKey, ...], ...]  # per task, one key per op parameter
    norm_groups: tuple[tuple[int, ...], ...]  # per task: ranks sharing its batch statistics
    # per task: the ranks of its expert-parallel group in member order (a moe op under
    # `ParallelConfig.expert` e > 1; else the task's rank alone)
    expert_groups: tuple[tuple[int, ...], ...] = ()

    @property
    def batch_norm(self) -> bool:
        """Whether the op normalizes with batch statistics (a norm op or a folded one)."""
        return is_batch_norm(self.op)

    def task_of(self, rank: int) -> int | None:
        try:
            return self.cfg.devices.index(rank)
        except ValueError:
            return None


@dataclass(frozen=True)
class ExecPlan:
    """What every rank derives from a strategy: per-op tasks, the transfers between them, the
    parameter shards and their gradient sums, the loss ops and the process groups."""

    graph: OpGraph
    world: int
    ops: tuple[OpExec, ...]
    transfers: tuple[Transfer, ...]
    backward_offset: int  # backward message tags are the forward ones plus this
    params: dict[str, ParamInfo]
    sync: tuple[SyncItem, ...]
    sinks: tuple[int, ...]  # the loss ops (softmax ops nothing reads), in graph order
    # rank sets that need a process group, sorted, per use: "sync" (gradient sums), "norm"
    # (batch-norm statistics); each use has its own groups, so its messages do not queue
    # behind another's on the same connections
    groups: dict[str, tuple[tuple[int, ...], ...]]
    into: dict[tuple[int, int], tuple[Transfer, ...]] = field(repr=False)  # (edge, dst task)
    out_of: dict[tuple[int, int], tuple[Transfer, ...]] = field(repr=False)  # (op, src task)
    # parameters that ops cut along different axes: every rank that uses one holds it whole,
    # its tasks compute with their slices of it, and the whole gradient is summed
    whole: frozenset[str] = frozenset()

    def transfer_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes moved between different ranks in one forward pass (components included)."""
        return sum(t.numel * t.components * dtype_bytes for t in self.transfers if not t.local)


def build_plan(strategy: Strategy) -> ExecPlan:
    """The execution plan of `strategy` on `strategy.devices.num_devices` ranks."""
    graph = strategy.graph
    world = strategy.devices.num_devices
    _check_graph(graph)
    ops = tuple(_op_exec(graph, i, cfg) for i, cfg in enumerate(strategy.configs))
    transfers, n_msgs = _transfers(graph, strategy.configs, ops)
    params, whole = _param_infos(ops)
    ops = tuple(_hold_whole(o, whole) for o in ops)
    sync = _sync_items(ops, params)
    sinks = tuple(
        i for i, op in enumerate(graph.ops) if op.kind == "softmax" and _is_sink(graph, i)
    )
    sync_groups = sorted({it.ranks for it in sync if len(it.ranks) > 1})
    norm_groups = sorted({g for o in ops for g in o.norm_groups if len(g) > 1})
    expert_groups = sorted({tuple(sorted(g)) for o in ops for g in o.expert_groups if len(g) > 1})
    into: dict[tuple[int, int], list[Transfer]] = {}
    out_of: dict[tuple[int, int], list[Transfer]] = {}
    for t in transfers:
        into.setdefault((t.edge, t.dst_task), []).append(t)
        out_of.setdefault((graph.edges[t.edge].src, t.src_task), []).append(t)
    return ExecPlan(
        graph=graph,
        world=world,
        ops=ops,
        transfers=transfers,
        backward_offset=n_msgs,
        params=params,
        sync=sync,
        sinks=sinks,
        groups={
            "sync": tuple(sync_groups),
            "norm": tuple(norm_groups),
            "expert": tuple(expert_groups),
        },
        into={k: tuple(v) for k, v in into.items()},
        out_of={k: tuple(v) for k, v in out_of.items()},
        whole=whole,
    )


# -- checks ------------------------------------------------------------------------------------


def _is_sink(graph: OpGraph, i: int) -> bool:
    return not graph.consumers[i]


def _check_graph(graph: OpGraph) -> None:
    """Refuse what the runtime cannot compute, naming the op and why."""
    for i, op in enumerate(graph.ops):
        if _is_sink(graph, i) and op.kind != "softmax":
            raise RuntimeConfigError(
                f"op {op.name!r} ({op.kind}) is a graph output but not a softmax: the runtime "
                "trains with the cross-entropy of every softmax output, so every output must "
                "be a softmax op"
            )
        if _is_sink(graph, i) and op.attr("op") == "cross_entropy":
            raise RuntimeConfigError(
                f"op {op.name!r} computes a cross-entropy loss inside the model; the runtime "
                "trains with its own NLL loss of the model's outputs: return log_softmax (or "
                "softmax) over the classes from forward() instead"
            )
        if op.kind == "lstm" and (op.attr("pre_ops") or fused_ops(op)):
            raise RuntimeConfigError(
                f"LSTM op {op.name!r} has folded ops {fused_ops(op)}; the runtime computes "
                "LSTM steps with their cell state and does not fold ops into them"
            )
        if op.kind == "lstm" and len(op.inputs) == 2:
            prev = graph.op(op.inputs[1])
            if prev.kind != "lstm":
                raise RuntimeConfigError(
                    f"LSTM op {op.name!r} reads its state from {prev.name!r}, not an LSTM step"
                )


# -- tasks ---------------------------------------------------------------------------------------


def _op_exec(graph: OpGraph, i: int, cfg: ParallelConfig) -> OpExec:
    op = graph.ops[i]
    if op.kind == "input":
        plans = tuple(_input_plan(graph, i, cfg, t) for t in range(cfg.num_tasks))
    else:
        plans = tuple(_deterministic(plan_task(graph, i, cfg, t)) for t in range(cfg.num_tasks))
    shards = tuple(_shard_keys(p) for p in plans)
    return OpExec(i, op, cfg, plans, shards, _norm_groups(op, cfg), _expert_groups(cfg))


def _input_plan(graph: OpGraph, i: int, cfg: ParallelConfig, t: int) -> TaskPlan:
    """Input ops have no kernel: a plan that only records the task's output box."""
    op = graph.ops[i]
    lo, hi = task_boxes(op.output.sizes, np.array([cfg.degrees]), cfg.num_tasks)
    box = tuple((int(a), int(b)) for a, b in zip(lo[0, t], hi[0, t], strict=True))
    return TaskPlan(op, tuple(cfg.degrees), t, box, (), (), (), (), (), ())


def _deterministic(plan: TaskPlan) -> TaskPlan:
    """The plan with dropout computed as the identity (see IDENTITY_FUNCTIONS)."""
    fused = tuple("identity" if f in IDENTITY_FUNCTIONS else f for f in plan.fused)
    pre = tuple("identity" if f in IDENTITY_FUNCTIONS else f for f in plan.pre)
    op = plan.op
    if op.kind == "elementwise" and str(op.attr("op", op.attr("fn", ""))) in IDENTITY_FUNCTIONS:
        attrs = {**dict(op.attrs), "op": "identity"}
        op = replace(op, attrs=Op.make_attrs(attrs))
    if (fused, pre, op) == (plan.fused, plan.pre, plan.op):
        return plan
    return replace(plan, fused=fused, pre=pre, op=op)


def _channel_split(op: Op) -> bool:
    return CHANNEL in parameter_dims(op)


def _shard_keys(plan: TaskPlan) -> tuple[ShardKey, ...]:
    op = plan.op
    if plan.experts is not None:
        return _expert_shard_keys(plan)
    keys = []
    for p, role in zip(op.params, plan.roles, strict=True):
        if role.axis is None:
            keys.append(ShardKey(p.name, 0, 1))
            continue
        extent = p.shape[role.axis] // role.blocks
        if _channel_split(op):
            lo, hi = plan.out_range(CHANNEL)
        else:
            lo, hi = 0, extent
        keys.append(ShardKey(p.name, lo, hi))
    return tuple(keys)


def _expert_shard_keys(plan: TaskPlan) -> tuple[ShardKey, ...]:
    """A moe task under expert parallelism holds its routed experts only: rows [lo, hi) of a
    stacked expert weight (split along its expert axis), an expert's own weight whole when
    the expert is its, else nothing (lo = hi: it covers no interval, so its gradient is
    summed over the ranks that hold the expert, the expert-data-parallel group); the router
    and the shared expert whole, summed over every replica."""
    keys = []
    for p, role, shape in zip(plan.op.params, plan.roles, plan.param_shapes, strict=True):
        if role.axis is not None:  # stacked: axis 0 holds the experts
            lo, _ = plan.experts or (0, 0)
            keys.append(ShardKey(p.name, lo, lo + shape[0]))
        else:
            keys.append(ShardKey(p.name, 0, 1 if shape == tuple(p.shape) else 0))
    return tuple(keys)


def _expert_groups(cfg: ParallelConfig) -> tuple[tuple[int, ...], ...]:
    """Per task, the ranks of its expert-parallel group in member order."""
    out: list[tuple[int, ...]] = [()] * cfg.num_tasks
    for group in cfg.expert_groups():
        for t in group:
            out[t] = tuple(cfg.devices[m] for m in group)
    return tuple(out)


def _norm_groups(op: Op, cfg: ParallelConfig) -> tuple[tuple[int, ...], ...]:
    """Per task, the ranks of the tasks with the same channels (batch norm ops only)."""
    groups = stats_groups(op, cfg.degrees)
    if groups is None:
        return tuple((d,) for d in cfg.devices)
    return tuple(tuple(cfg.devices[m] for m in g) for g in groups)


# -- transfers ---------------------------------------------------------------------------------


def _transfers(
    graph: OpGraph, configs: Sequence[ParallelConfig], ops: Sequence[OpExec]
) -> tuple[tuple[Transfer, ...], int]:
    """Every (edge, producer task, consumer task) overlap, from planner.costs.regions."""
    out: list[Transfer] = []
    tag = 0
    for k, e in enumerate(graph.edges):
        src, dst = graph.ops[e.src], graph.ops[e.dst]
        cu, cv = configs[e.src], configs[e.dst]
        # contraction splits: partial sums as one more producer dim (planner.costs.regions)
        grid = edge_grid(src, dst, e.position, graph.input_maps(e), cu.reduce, cv.reduce)
        plo, phi = task_boxes(grid.in_sizes, np.array([cu.grid]), cu.num_tasks)
        olo, ohi = task_boxes(grid.out_sizes, np.array([cv.grid]), cv.num_tasks)
        nlo, nhi = needed_boxes(grid.maps, grid.in_sizes, grid.out_dims, olo, ohi)
        vol = overlap_volume(plo, phi, nlo, nhi)[0, :, 0, :]
        components = 2 if dst.kind == "lstm" and e.position == 1 else 1
        n = len(src.output.dims)
        for q in range(cv.num_tasks):
            need = tuple(zip(nlo[0, q].tolist()[:n], nhi[0, q].tolist()[:n], strict=True))
            if need != ops[e.dst].plans[q].in_boxes[e.position]:
                raise AssertionError(f"needed box of {dst.name!r} differs from its TaskPlan")
            for p in range(cu.num_tasks):
                if vol[p, q] <= 0:
                    continue
                lo = np.maximum(plo[0, p], nlo[0, q])[:n]
                hi = np.minimum(phi[0, p], nhi[0, q])[:n]
                box = tuple((int(a), int(b)) for a, b in zip(lo, hi, strict=True))
                t = Transfer(
                    k, p, q, cu.devices[p], cv.devices[q], box, components, tag, cu.reduce > 1
                )
                out.append(t)
                if not t.local:
                    tag += components
    return tuple(out), tag


# -- parameters --------------------------------------------------------------------------------


def _param_infos(ops: Sequence[OpExec]) -> tuple[dict[str, ParamInfo], frozenset[str]]:
    """How the ops cut each parameter, and the parameters that ops cut along different axes
    (a language model's token embedding, tied to its output layer: the embedding splits the
    table's columns, the output layer its rows). Those are held whole (`ExecPlan.whole`)."""
    infos: dict[str, ParamInfo] = {}
    whole: set[str] = set()
    for o in ops:
        if not o.op.params:
            continue
        con = contraction(o.op) if o.cfg.reduce > 1 else None
        if con is not None and con.internal:  # a moe op's experts cut along their width
            whole.update(_ffn_params(o.op))
        elif con is not None:  # cut along its summed axis too: held whole (the runtime's
            whole.add(o.op.params[con.param].name)  # shard keys are one axis's intervals)
        roles = o.plans[0].roles
        for p, role in zip(o.op.params, roles, strict=True):
            extent = 1 if role.axis is None else p.shape[role.axis] // role.blocks
            info = ParamInfo(p.name, tuple(p.shape), role.axis, role.blocks, extent)
            if infos.setdefault(p.name, info) != info:
                whole.add(p.name)
    for name in whole:
        infos[name] = ParamInfo(name, infos[name].shape, None, 1, 1)
    return infos, frozenset(whole)


def _ffn_params(op: Op) -> list[str]:
    """The parameters of a moe op that expert tensor parallelism cuts along the experts'
    hidden width (`planner.graph.moe.ffn_axis`): held whole, each task computing with its
    slices of them (as a row-parallel linear's weight), their gradients summed over all."""
    roles = moe_spec(op).roles
    return [p.name for p, r in zip(op.params, roles, strict=True) if ffn_axis(r) is not None]


def _hold_whole(o: OpExec, whole: frozenset[str]) -> OpExec:
    """`o` with the shard keys of the parameters held whole replaced by the whole one's."""
    if not any(p.name in whole for p in o.op.params):
        return o
    shards = tuple(
        tuple(ShardKey(k.name, 0, 1) if k.name in whole else k for k in keys) for keys in o.shards
    )
    return replace(o, shards=shards)


def _sync_items(ops: Sequence[OpExec], params: dict[str, ParamInfo]) -> tuple[SyncItem, ...]:
    """Gradient sums per elementary channel interval of every parameter (module doc)."""
    holders: dict[str, list[tuple[int, int, int, int]]] = {}  # name -> (rank, lo, hi, op)
    for o in ops:
        for t, keys in enumerate(o.shards):
            for key in keys:
                holders.setdefault(key.name, []).append((o.cfg.devices[t], key.lo, key.hi, o.index))
    items: list[SyncItem] = []
    for name in params:
        hs = holders[name]
        cuts = sorted({h[1] for h in hs} | {h[2] for h in hs})
        for a, b in zip(cuts, cuts[1:], strict=False):
            covering = [h for h in hs if h[1] <= a and b <= h[2]]
            ranks = tuple(sorted({h[0] for h in covering}))
            # Several ranks hold it (replicas) or one rank holds it in several shards
            # (steps of a shared group with different splits): sum the gradients.
            distinct = {(h[0], h[1], h[2]) for h in covering}
            if len(ranks) > 1 or len(distinct) > len(ranks):
                ready = min(h[3] for h in covering)
                items.append(SyncItem(name, a, b, ranks, ready))
    return tuple(items)
