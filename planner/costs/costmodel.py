"""Cost functions of OptCNN Sec. 5.1: t_c (compute), t_s (parameter sync), t_x (transfers).

- t_c(op, c): forward + backward time of the slowest task of `op` under config `c`. Analytic:
  a roofline per task, max(FLOPs / (peak * compute_efficiency), bytes / (memory bandwidth *
  memory_efficiency)), times (1 + backward_factor), plus a fixed overhead per task. Measured:
  the median time profiled on this machine for the task's shape (`planner.costs.profile`), falling
  back to analytic for shapes that were not profiled.
- t_s(op, c): synchronizing the gradients of replicated parameter shards. Parameters split
  along the op's Parameter dims; every shard is replicated on the tasks that share its
  parameter index. "ps": each replica sends its gradients to a parameter server (the first
  replica's device) and receives the parameters back (OptCNN). "ring": ring all-reduce,
  2 (r - 1) / r of the shard over the slowest ring link plus 2 (r - 1) steps' fixed costs.
  Every message also pays its endpoints' message overheads, scaled by the shard's share of a
  gradient bucket (`sync_bucket_bytes`: the runtime all-reduces gradients in buckets of that
  size, as DDP does, so a small shard pays its part of a bucket's fixed cost). Ops sharing a
  parameter group (unrolled RNN steps) each carry 1/|group| of the group's sync.
- t_x(e, c_u, c_v): the forward activations producer tasks send to consumer tasks (volume of
  the overlap of their regions, `planner.costs.regions`), serialized per receiving device, plus the
  backward gradients sent back the same way (none to the graph's input ops: data gets no
  gradient); the slowest receiver counts in each direction. Transfers between tasks on the
  same device are free. An LSTM step's state edge carries two tensors (h and c) back to back:
  one message of twice the bytes. Each message pays the route latency and the message
  overhead of both endpoint devices (`Device.message_overhead`: processor time per message of
  host-driven transports such as gloo on CPU workers; 0 for GPUs).
- Synchronized batch norm: a batch-norm op (its own or folded into a conv) whose config splits
  samples, height or width sums its per-channel statistics over the tasks that hold the same
  channels, once forward and once backward, before it can go on (`norm_exchange`): a blocking
  exchange of 2 x channels float64 sums, priced like one message each way (two ranks) or an
  all-reduce (more), and charged to t_c. FlexFlow and OptCNN do not price it.

OptCNN's objective (Eq. 1) is the sum of t_c + t_s over ops and t_x over edges
(`planner.problems.evaluate`, `Problem`); the simulator (`planner.sim.simulator`) uses the same task times.

`edge_table` and `node_table` build the cost tables for all config pairs at once (vectorized
per dimension and per group of partitions); `transfer_time` is an independent, direct
task-by-task computation for one config pair, used to re-score strategies and in tests.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from planner.costs.config import OpConfigs, ParallelConfig
from planner.costs.regions import needed_boxes, overlap_volume, task_boxes
from planner.errors import LayerwiseError
from planner.graph.opkinds import CHANNEL, DimMap, parameter_dims, stats_groups

if TYPE_CHECKING:
    from planner.graph.opgraph import Edge, Op, OpGraph
    from planner.hardware.devices import DeviceGraph


class MeasuredTimes(Protocol):
    """A source of measured forward+backward times per task (see planner.costs.profile)."""

    def task_time(self, op: Op, cfg: ParallelConfig) -> float | None: ...


@dataclass(frozen=True)
class CostOptions:
    sync: Literal["ring", "ps"] = "ring"
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    backward_factor: float = 2.0
    task_overhead: float = 0.0
    param_copies: float = 2.0  # weights and gradients held per parameter byte
    sync_bucket_bytes: float = 4 * 2**20  # gradient all-reduce bucket (runtime.sync)

    def __post_init__(self) -> None:
        if self.sync not in ("ring", "ps"):
            raise LayerwiseError(f"sync must be 'ring' or 'ps', got {self.sync!r}")
        if not 0 < self.compute_efficiency <= 1 or not 0 < self.memory_efficiency <= 1:
            raise LayerwiseError("compute_efficiency and memory_efficiency must be in (0, 1]")
        if min(self.backward_factor, self.task_overhead, self.param_copies) < 0:
            raise LayerwiseError("backward_factor, task_overhead and param_copies must be >= 0")
        if self.sync_bucket_bytes < 0:
            raise LayerwiseError("sync_bucket_bytes must be >= 0 (0: no buckets)")


class CostModel:
    """t_c, t_s, t_x and per-device memory for ops of `graph` on `devices`."""

    def __init__(
        self,
        graph: OpGraph,
        devices: DeviceGraph,
        options: CostOptions | None = None,
        measured: MeasuredTimes | None = None,
    ):
        self.graph = graph
        self.devices = devices
        self.options = options or CostOptions()
        bind = getattr(measured, "bind", None)
        if bind is not None and getattr(measured, "graph", graph) is None:
            measured = bind(graph)  # key tasks by the graph's real inputs (data: no gradient)
        self.measured = measured
        self.num_devices = devices.num_devices
        self.inv_bw = np.asarray(devices.inv_bandwidth, dtype=np.float64)
        self.latency = np.asarray(devices.latency, dtype=np.float64)
        self.flops = np.array([d.flops for d in devices.devices], dtype=np.float64)
        self.mem_bw = np.array([d.mem_bandwidth for d in devices.devices], dtype=np.float64)
        self.overhead = np.array([d.message_overhead for d in devices.devices], dtype=np.float64)
        # Fixed seconds per message from i to j: route latency + both endpoints' overheads.
        self.msg_cost = self.latency + self.overhead[:, None] + self.overhead[None, :]
        np.fill_diagonal(self.msg_cost, 0.0)  # no message within a device
        groups = Counter(op.param_group for op in graph.ops if op.param_group is not None)
        self._group_size = dict(groups)
        self._norm_groups: dict[tuple[int, tuple[int, ...]], list[list[int]] | None] = {}

    @property
    def source(self) -> str:
        return "measured" if self.measured is not None else "analytic"

    # -- t_c ------------------------------------------------------------------------------

    def _task_work(self, op: Op) -> tuple[float, float]:
        """(FLOPs, bytes) of the whole op's forward pass."""
        nbytes = op.mem_bytes
        if not nbytes:
            ins = sum(self.graph.op(n).output.nbytes for n in op.inputs)
            nbytes = ins + op.output.nbytes + op.param_bytes
        return op.flops, float(nbytes)

    def task_times(self, i: int, cfg: ParallelConfig) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds of each task of op i under cfg (two (k,) arrays).

        Measured times (forward + backward) are split in the analytic ratio 1 : backward_factor;
        the per-task overhead (what a runtime spends around the kernels) is charged to the
        forward task, analytic or measured."""
        op = self.graph.ops[i]
        k, o = cfg.num_tasks, self.options
        if op.kind == "input":
            return np.zeros(k), np.zeros(k)
        measured = self.measured.task_time(op, cfg) if self.measured is not None else None
        if measured is not None:
            fwd = np.full(k, measured / (1.0 + o.backward_factor))
            return fwd + o.task_overhead, fwd * o.backward_factor
        flops, nbytes = self._task_work(op)
        dev = np.asarray(cfg.devices)
        fwd = np.maximum(
            flops / k / (self.flops[dev] * o.compute_efficiency),
            nbytes / k / (self.mem_bw[dev] * o.memory_efficiency),
        )
        return fwd + o.task_overhead, fwd * o.backward_factor

    def compute_time(self, i: int, cfg: ParallelConfig) -> float:
        """t_c: forward + backward seconds of the slowest task of op i under cfg, with its
        batch-norm statistics exchanges (one forward, one backward)."""
        fwd, bwd = self.task_times(i, cfg)
        total = fwd + bwd
        exchange = self.norm_exchange(i, cfg)
        if exchange is not None:
            total = total + 2.0 * exchange
        return float(total.max())

    def norm_groups(self, i: int, cfg: ParallelConfig) -> list[list[int]] | None:
        """Per task, the task indices that hold the same channels of a batch-norm op whose
        config splits its samples, height or width (they sum their statistics); None when
        op i needs no such exchange."""
        key = (i, cfg.degrees)
        if key not in self._norm_groups:
            self._norm_groups[key] = stats_groups(self.graph.ops[i], cfg.degrees)
        return self._norm_groups[key]

    def norm_exchange(self, i: int, cfg: ParallelConfig) -> np.ndarray | None:
        """Seconds of one batch-norm statistics exchange per task of op i under cfg (the
        forward and the backward pass each make one), or None when it needs none.

        2 x (channels of the task) float64 sums; two tasks swap them (one message each way:
        latency, bytes / bandwidth and both overheads), larger groups all-reduce as the
        gradients do (`CostOptions.sync`), without bucket sharing."""
        groups = self.norm_groups(i, cfg)
        if groups is None:
            return None
        op = self.graph.ops[i]
        nbytes = 2 * 8 * op.output.size(CHANNEL) / cfg.degrees[op.output.dims.index(CHANNEL)]
        out = np.zeros(cfg.num_tasks)
        for t, members in enumerate(groups):
            devs = sorted({cfg.devices[m] for m in members})
            if len(devs) == 2:
                a, b = devs
                out[t] = max(
                    nbytes * self.inv_bw[a, b] + self.msg_cost[a, b],
                    nbytes * self.inv_bw[b, a] + self.msg_cost[b, a],
                )
            elif len(devs) > 2:
                out[t] = self._sync_group(devs, nbytes, bucketed=False)
        return out

    # -- t_s ------------------------------------------------------------------------------

    def replica_groups(self, op: Op, cfg: ParallelConfig) -> list[list[int]]:
        """Device lists that hold the same parameter shard (one list per shard)."""
        pdims = [op.output.dims.index(d) for d in parameter_dims(op)]
        groups: dict[tuple[int, ...], list[int]] = {}
        for t, dev in enumerate(cfg.devices):
            idx = np.unravel_index(t, cfg.degrees)
            groups.setdefault(tuple(int(idx[d]) for d in pdims), []).append(dev)
        return list(groups.values())

    def sync_time(self, i: int, cfg: ParallelConfig) -> float:
        """t_s: seconds to synchronize op i's replicated parameter gradients under cfg."""
        op = self.graph.ops[i]
        if not op.params or cfg.num_tasks == 1:
            return 0.0
        groups = self.replica_groups(op, cfg)
        shard = op.param_bytes / len(groups)
        return max(self._sync_group(g, shard) for g in groups) / self._share(op)

    def _share(self, op: Op) -> int:
        """Ops of a shared parameter group each carry 1/|group| of its sync and memory."""
        return self._group_size[op.param_group] if op.param_group is not None else 1

    def bucket_share(self, nbytes: float) -> float:
        """The share of a gradient bucket's fixed message costs that `nbytes` carries."""
        bucket = self.options.sync_bucket_bytes
        return 1.0 if bucket <= 0 else min(1.0, nbytes / bucket)

    def _sync_group(self, devs: list[int], nbytes: float, bucketed: bool = True) -> float:
        r = len(devs)
        if r == 1 or nbytes == 0:
            return 0.0
        d = np.asarray(devs)
        share = self.bucket_share(nbytes) if bucketed else 1.0

        def fixed(a: np.ndarray, b: np.ndarray) -> np.ndarray:  # latency + shared overheads
            return self.latency[a, b] + share * (self.msg_cost[a, b] - self.latency[a, b])

        if self.options.sync == "ps":
            ps, rest = d[0], d[1:]
            push = nbytes * self.inv_bw[rest, ps] + fixed(rest, ps)
            pull = nbytes * self.inv_bw[ps, rest] + fixed(ps, rest)
            return float((push + pull).sum())
        nxt = np.roll(d, -1)
        slow = float(self.inv_bw[d, nxt].max())
        return 2.0 * (r - 1) / r * nbytes * slow + 2.0 * (r - 1) * float(fixed(d, nxt).max())

    # -- memory ---------------------------------------------------------------------------

    def memory(self, i: int, cfg: ParallelConfig) -> np.ndarray:
        """Bytes op i keeps on each device under cfg: parameter shards and output activations."""
        op = self.graph.ops[i]
        out = np.zeros(self.num_devices)
        shards = len(self.replica_groups(op, cfg)) if op.params else 1
        per_task = op.param_bytes / shards * self.options.param_copies / self._share(op)
        per_task += op.output.nbytes / cfg.num_tasks
        out[list(cfg.devices)] = per_task
        return out

    # -- t_x (direct, task by task) -------------------------------------------------------

    def transfer_time(self, edge: Edge, cu: ParallelConfig, cv: ParallelConfig) -> float:
        """t_x of one edge for one config pair, computed task pair by task pair."""
        src, dst = self.graph.ops[edge.src], self.graph.ops[edge.dst]
        maps = self.graph.input_maps(edge)
        esize = src.output.dtype_bytes
        k = self.edge_components(edge)
        fwd_recv: dict[int, float] = {}
        bwd_recv: dict[int, float] = {}
        prod_boxes = [
            (dev, _box(src.output.sizes, cu.degrees, t)) for t, dev in enumerate(cu.devices)
        ]
        for tq, dq in enumerate(cv.devices):
            out_box = _box(dst.output.sizes, cv.degrees, tq)
            need = [
                _need(m, s, dst.output.dims, out_box)
                for m, s in zip(maps, src.output.sizes, strict=True)
            ]
            for dp, pbox in prod_boxes:
                if dp == dq:
                    continue
                vol = math.prod(
                    max(0, min(b1, b2) - max(a1, a2))
                    for (a1, b1), (a2, b2) in zip(pbox, need, strict=True)
                )
                if vol == 0:
                    continue
                nbytes = vol * esize
                fwd_recv[dq] = (
                    fwd_recv.get(dq, 0.0) + k * nbytes * self.inv_bw[dp, dq] + self.msg_cost[dp, dq]
                )
                bwd_recv[dp] = (
                    bwd_recv.get(dp, 0.0) + k * nbytes * self.inv_bw[dq, dp] + self.msg_cost[dq, dp]
                )
        backward = 0.0 if src.kind == "input" else max(bwd_recv.values(), default=0.0)
        return max(fwd_recv.values(), default=0.0) + backward

    def edge_components(self, edge: Edge) -> int:
        """Tensors an edge carries: 2 for an LSTM step's state (h and c, the same box, sent
        back to back: priced as one message of twice the bytes), else 1."""
        return 2 if self.graph.ops[edge.dst].kind == "lstm" and edge.position == 1 else 1

    # -- vectorized tables ----------------------------------------------------------------

    def node_table(self, i: int, configs: OpConfigs) -> np.ndarray:
        """t_c + t_s for every config of op i."""
        return np.array([self.compute_time(i, c) + self.sync_time(i, c) for c in configs.configs])

    def memory_table(self, i: int, configs: OpConfigs) -> np.ndarray:
        """(C, D) bytes per device for every config of op i."""
        return (
            np.stack([self.memory(i, c) for c in configs.configs])
            if len(configs)
            else np.zeros((0, self.num_devices))
        )

    def edge_table(self, edge: Edge, cu: OpConfigs, cv: OpConfigs) -> np.ndarray:
        """t_x for every (producer config, consumer config) pair: (C_u, C_v)."""
        src, dst = self.graph.ops[edge.src], self.graph.ops[edge.dst]
        D = self.num_devices
        parts_u = np.array([g[0] for g in cu.groups], dtype=np.int64)
        parts_v = np.array([g[0] for g in cv.groups], dtype=np.int64)
        plo, phi = task_boxes(src.output.sizes, parts_u, D)
        olo, ohi = task_boxes(dst.output.sizes, parts_v, D)
        nlo, nhi = needed_boxes(
            self.graph.input_maps(edge), src.output.sizes, dst.output.dims, olo, ohi
        )
        # Only real tasks, flattened partition by partition: rows[p] = first row of partition p.
        real_u, real_v = plo[..., 0] < phi[..., 0], ohi[..., 0] > olo[..., 0]
        rows_u, rows_v = _first_rows(real_u), _first_rows(real_v)
        vol = overlap_volume(
            plo[real_u][None], phi[real_u][None], nlo[real_v][None], nhi[real_v][None]
        )
        # (tasks of all u partitions, ... v); an LSTM state carries h and c together
        nbytes = vol[0, :, 0, :] * src.output.dtype_bytes * self.edge_components(edge)
        table = np.zeros((len(cu), len(cv)))
        for ku, a_idx, sets_u, cfg_u in _batches(cu):
            r = (rows_u[a_idx][:, None] + np.arange(ku)).ravel()
            for kv, b_idx, sets_v, cfg_v in _batches(cv):
                c = (rows_v[b_idx][:, None] + np.arange(kv)).ravel()
                b = nbytes[np.ix_(r, c)].reshape(len(a_idx), ku, len(b_idx), kv)
                table[np.ix_(cfg_u.ravel(), cfg_v.ravel())] = self._combine(
                    b, sets_u, sets_v, backward=src.kind != "input"
                )
        return table

    def _combine(
        self, nbytes: np.ndarray, sets_u: np.ndarray, sets_v: np.ndarray, backward: bool = True
    ) -> np.ndarray:
        """Bytes (A, ku, B, kv) on device sets (Ou, ku), (Ov, kv) -> t_x (A*Ou, B*Ov)."""
        A, _, B, _ = nbytes.shape
        su, sv = sets_u[:, :, None, None], sets_v[None, None, :, :]
        w_f, w_b = self.inv_bw[su, sv], self.inv_bw[sv, su]  # (Ou, ku, Ov, kv)
        l_f, l_b = self.msg_cost[su, sv], self.msg_cost[sv, su]
        msg = (nbytes > 0).astype(np.float64)
        fwd = np.einsum("apbq,opwq->aobwq", nbytes, w_f) + np.einsum("apbq,opwq->aobwq", msg, l_f)
        t = fwd.max(axis=4)
        if backward:
            bwd = np.einsum("apbq,opwq->aobwp", nbytes, w_b)
            t = t + (bwd + np.einsum("apbq,opwq->aobwp", msg, l_b)).max(axis=4)
        return t.reshape(A * sets_u.shape[0], B * sets_v.shape[0])


def _first_rows(real: np.ndarray) -> np.ndarray:
    """Row of each partition's first task once the real tasks (P, slots) are flattened."""
    counts = real.sum(axis=1)
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def _batches(c: OpConfigs) -> Iterable[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """Groups of partitions that share task count and device sets, for one vectorized step.

    Yields (tasks k, partition indices (A,), device sets (O, k), config indices (A, O)).
    """
    batches: dict[tuple[int, int], list[int]] = {}
    for g, (part, sets, _) in enumerate(c.groups):
        batches.setdefault((math.prod(part), len(sets)), []).append(g)
    for (k, _), gs in batches.items():
        sets = c.groups[gs[0]][1]
        cfg_idx = np.stack([c.groups[g][2] for g in gs])
        yield k, np.array(gs), sets, cfg_idx


def _box(sizes: tuple[int, ...], degrees: tuple[int, ...], task: int) -> list[tuple[int, int]]:
    idx = np.unravel_index(task, degrees)
    return [
        (int(i) * (s // g), (int(i) + 1) * (s // g))
        for i, s, g in zip(idx, sizes, degrees, strict=True)
    ]


def _need(
    m: DimMap, size: int, out_dims: tuple[str, ...], out_box: list[tuple[int, int]]
) -> tuple[int, int]:
    if m.kind == "full":
        return 0, size
    a, b = out_box[out_dims.index(m.out_dim)]
    if m.kind == "window":
        a, b = a * m.stride - m.pad, (b - 1) * m.stride - m.pad + m.dilation * (m.kernel - 1) + 1
    elif m.kind == "offset":
        a, b = a - m.offset, b - m.offset
    a, b = min(max(a, 0), size), min(max(b, 0), size)
    return a, max(a, b)
