"""FlexFlow's execution simulator (Jia et al. 2019, Sec. 5): task graph, full and delta simulation.

Task graph (Sec. 5.1). For every op and its config: a forward and a backward task per
partition on its device. For every tensor edge and every pair of producer/consumer tasks that
share a sub-tensor (`planner.sim.transfers`: the overlaps of `planner.costs.regions`, the ones
the cost model prices, found per dimension so only pairs that move data are visited): a
dependency when they are on one device, else a communication task on each link of the route
(links are resources of their own, one per direction, so transfers overlap with compute),
forward for the activations and backward for the gradients (none to the graph's input ops).
Parameter synchronization of replicated shards (FlexFlow's public code priced it at 0; we do
not): ring all-reduce as one transfer of 2 (r - 1) / r of the shard on each hop of the ring,
or a parameter server (each replica sends its gradients to the first replica and receives
the parameters back), then an update task on every device that holds the shard. Ops sharing
a parameter group synchronize once.

Activation recomputation (`CostOptions.recompute`, `planner.costs.recompute`): a recomputed
op's backward task also runs its forward again (`CostModel.task_times`), and each of its
incoming transfers between devices is sent once more, in the backward phase just before that
task (Megatron-LM's tensor-parallel all-reduces of a recomputed layer run again too).

Host-driven messages (`Device.message_overhead` > 0, CPU workers with gloo): a transfer also
occupies the sending device for the overhead right after the producer task (the send runs on
its thread) and the receiving device just before the consumer task (the arrival is handled
on its processor). Synchronized batch norm: a batch-norm op whose config splits samples,
height or width gets an exchange task after its forward and after its backward task on every
device (`CostModel.norm_exchange`), which waits for every task holding the same channels;
the op's consumers and gradient transfers wait for it. Expert parallelism: a moe op whose
config spreads its experts gets the same exchange tasks for its all-to-alls (dispatch and
combine, `CostModel.expert_exchange`), each waiting for its expert-parallel group's join (a
collective waits for its slowest member), less what `CostOptions.ep_overlap` hides under the
task's own compute (`planner.costs.overlap.exposed_seconds`). They occupy the devices, not
the links: all-to-all traffic does not contend with transfers on the simulated links. Its
gradient sync runs per parameter class (`CostModel.param_groups`: the router and shared
expert over every task, the routed experts over each expert rank's tasks).

A task that waits for a whole group (a batch-norm exchange for its group's tasks, a ring
all-reduce for every replica's backward, an update for every ring transfer) waits for one
zero-time join task of the group, so the dependencies grow with the tasks, not with their
square; the times are the same (a max of the same ends).

Order on a device (assumption A3, FIFO): tasks run in program order: forward ops in
topological order (an op's incoming transfers just before it), then backward ops in reverse,
each followed by its outgoing gradient transfers and its parameter sync, then the updates.
A task starts when its dependencies are done and the task before it on its device is done.

Full simulation (Algorithm 1) builds the graph and sets every task's start and end in that
order. Delta simulation (Algorithm 2) changes one op's config: it replaces the op's tasks,
the transfers of its edges and its group's sync, and re-times only the tasks whose inputs
moved, in program order, until nothing moves further (`planner.sim.tasks`). Since the order
on every resource is fixed, both give the same timeline, bit for bit (tested).
"""

from __future__ import annotations

import gc
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from planner.costs.overlap import exposed_seconds
from planner.costs.regions import needed_boxes, task_boxes
from planner.deadline import OutOfTime, past
from planner.graph.opkinds import LENGTH
from planner.sim.tasks import JOIN, PHASE_SHIFT, SUB_SHIFT, TaskBatch, TaskGraph, pack, unpack
from planner.sim.transfers import transfer_pairs

if TYPE_CHECKING:
    from planner.costs.config import ParallelConfig
    from planner.costs.costmodel import CostModel
    from planner.graph.opgraph import Op, OpGraph
    from planner.problems.strategy import Strategy

Key = tuple[int, int, int, int, int, int]
# A message's keys: its send overhead, its hops' prefix (the hop index completes it), its
# receive overhead (None: the hops' prefix with the hop count).
_Keys = tuple[Key, tuple[int, int, int, int, int], Key | None]
FWD, BWD, UPDATE = 0, 1, 2  # phases of the program order
SYNC_SUB = 2  # the sub-step of a backward-phase key that belongs to parameter sync
_AFTER = 1 << 20  # task-index offset that orders an op's exchange tasks after its own tasks
_JOINS = _AFTER // 2  # index offset of a backward join: after the tasks, before the exchanges
_LAST = (1 << 39) - 1  # pair index that orders a task after every message of a sync
# Entries kept for delta simulation, which rebuilds the same configs again and again (each
# cache is emptied when full, so a long search on a large cluster stays bounded).
COST_CACHE = 4096  # (op, config) -> task times
PAIRS_CACHE = 4096  # (edge shapes, maps, degrees) -> task pairs that share data
HOPS_CACHE = 1 << 18  # (device, device) -> the route's hops


@dataclass(frozen=True)
class TaskInfo:
    key: Key
    name: str  # e.g. "fwd conv1 #2", "xfer fc->loss 0->1 hop 3"
    resource: int  # device index, or num_devices + 2 * link + direction
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    tasks: tuple[TaskInfo, ...]
    makespan: float
    num_devices: int
    resource_names: tuple[str, ...]
    memory: np.ndarray  # bytes per device
    op_kinds: Mapping[str, str] = field(default_factory=dict)  # op name -> kind (charts)

    def by_key(self) -> dict[Key, tuple[float, float]]:
        return {t.key: (t.start, t.end) for t in self.tasks}


class Simulator:
    """A task graph and its timeline for a strategy; `change` re-simulates incrementally."""

    def __init__(
        self,
        cost_model: CostModel,
        configs: Sequence[ParallelConfig | None],
        deadline: float = math.inf,
    ):
        """Build and time the task graph of `configs`; with a finite `deadline` (a
        perf_counter value, checked while building and timing), raise OutOfTime past it or
        at Ctrl-C. Without one it always finishes (a re-score after Ctrl-C needs it)."""
        self.deadline = deadline
        self.cm = cost_model
        self.graph = cost_model.graph
        self.devices = cost_model.devices
        self.n = len(self.graph.ops)
        self.configs: list[ParallelConfig | None] = list(configs)  # None: op left out
        self._hops_cache: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
        self._pairs_cache: dict[tuple, tuple] = {}
        self._cost_cache: dict[tuple[int, ParallelConfig], tuple] = {}
        self._names = [op.name for op in self.graph.ops]
        self._overhead: list[float] = cost_model.overhead.tolist()  # per message, per device
        self._sync_op = _sync_ops(self.graph)
        self._sync_of = {i: s for s, members in self._sync_op.items() for i in members}
        self._incident: list[list[int]] = [[] for _ in range(self.n)]
        self._out_edges: list[list[int]] = [[] for _ in range(self.n)]
        for k, e in enumerate(self.graph.edges):
            self._incident[e.src].append(k)
            self._out_edges[e.src].append(k)
            if e.dst != e.src:
                self._incident[e.dst].append(k)
        # `CostOptions.transfer_once`: per producer, each out-edge's leader (the edge whose
        # messages it shares), and each leader's messages by task pair (arrival, first task
        # of the gradient's message)
        self._leaders: dict[int, dict[int, int]] = {}
        self._shared: dict[int, tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]] = {}
        self.tasks = TaskGraph()
        self.owned: list[list[int]] = [[] for _ in range(self.n)]  # op -> its F/B tasks
        self.edge_tasks: dict[int, list[int]] = {}  # edge index -> its transfer tasks
        self.sync_tasks: dict[int, list[int]] = {}  # sync op -> sync and update tasks
        # Per op and phase, per partition: the task whose end is that partition's end (the
        # batch-norm exchange when there is one) and the task that starts it (its compute).
        self._ends: dict[tuple[int, int], list[int]] = {}
        self._starts: dict[tuple[int, int], list[int]] = {}
        self.retimed = 0  # tasks the last change re-timed
        self.full()

    # -- building ------------------------------------------------------------------------

    def _build_op(self, i: int) -> list[int]:
        op, cfg, tg = self.graph.ops[i], self.configs[i], self.tasks
        made: list[int] = []
        self.owned[i] = made
        if cfg is None:  # absent from a partial strategy
            return made
        fwd, bwd, groups, exchange = self._op_costs(i, cfg)[:4]
        back = self.n - 1 - i
        devs = list(cfg.devices)
        k = len(devs)
        fs = tg.add_many(
            [pack(FWD, i, 2, t, 0, 0) for t in range(k)], devs, fwd, [f"fwd {op.name} #"] * k
        )
        bs = tg.add_many(
            [pack(BWD, back, 0, t, 0, 0) for t in range(k)],
            devs,
            bwd,
            [f"bwd {op.name} #"] * k,
            [[f] for f in fs],
        )
        made += fs + bs
        self._starts[(FWD, i)], self._starts[(BWD, i)] = fs, bs
        self._ends[(FWD, i)], self._ends[(BWD, i)] = fs, bs
        if groups is not None and exchange is not None:
            made += self._build_exchanges(i, devs, fs, bs, groups, exchange)
        a2a = self._op_costs(i, cfg)[4]
        if a2a is not None:
            labels = ("ep a2a", "ep grad a2a")
            made += self._build_exchanges(i, devs, fs, bs, a2a[0], a2a[1], labels, a2a[2])
        return made

    def _build_exchanges(
        self,
        i: int,
        devs: list[int],
        fs: list[int],
        bs: list[int],
        groups: list[list[int]],
        exchange: list[float],
        labels: tuple[str, str] = ("bn stats", "bn grad stats"),
        backward: list[float] | None = None,
    ) -> list[int]:
        """Synchronized batch norm (or expert parallelism's all-to-alls: `labels`, with the
        `backward` exchange's own seconds): after each forward and backward task, an
        exchange that waits for its group's join of all its members; inputs still go to the
        compute tasks, outputs leave after the exchange."""
        tg, name, back, k = self.tasks, self._names[i], self.n - 1 - i, len(devs)
        made: list[int] = []
        distinct, group_of = _distinct(groups)
        seconds = {FWD: exchange, BWD: exchange if backward is None else backward}
        for phase, tasks, label in ((FWD, fs, labels[0]), (BWD, bs, labels[1])):
            joins = []
            for g, members in enumerate(distinct):
                key = (
                    pack(FWD, i, 2, _AFTER + g, 0, 0)
                    if phase == FWD
                    else pack(BWD, back, 0, _JOINS + g, 0, 0)
                )
                joins.append(tg.add(key, JOIN, 0.0, "join", [tasks[m] for m in members]))
            keys = (
                [pack(FWD, i, 3, t, 0, 0) for t in range(k)]
                if phase == FWD
                else [pack(BWD, back, 0, _AFTER + t, 0, 0) for t in range(k)]
            )
            preds = [[joins[g]] for g in group_of]
            ends = tg.add_many(keys, devs, seconds[phase], [f"{label} {name} #"] * k, preds)
            made += joins + ends
            self._ends[(phase, i)] = ends
        return made

    def _op_costs(self, i: int, cfg: ParallelConfig) -> tuple:
        """Task times, batch-norm groups and exchange times of op i under cfg, and its
        expert-parallel all-to-alls (None, or per-task groups, forward and backward exposed
        seconds: `_all_to_all`) (cached: delta simulation rebuilds the same configs again
        and again)."""
        key = (i, cfg)
        found = self._cost_cache.get(key)
        if found is None:
            fwd, bwd = self.cm.task_times(i, cfg)
            groups = self.cm.norm_groups(i, cfg)
            exchange = self.cm.norm_exchange(i, cfg) if groups is not None else None
            found = (
                fwd.tolist(),
                bwd.tolist(),
                groups,
                None if exchange is None else exchange.tolist(),
                self._all_to_all(i, cfg, fwd, bwd),
            )
            if len(self._cost_cache) >= COST_CACHE:
                self._cost_cache.clear()
            self._cost_cache[key] = found
        return found

    def _all_to_all(
        self, i: int, cfg: ParallelConfig, fwd: np.ndarray, bwd: np.ndarray
    ) -> tuple[list[list[int]], list[float], list[float]] | None:
        """Op i's expert-parallel all-to-alls under cfg: each task's expert-parallel group
        (task indices), and the forward and backward seconds of its exchange task: the
        all-to-alls' (`CostModel.expert_exchange`) less `ep_overlap` of them hidden under
        the task's own compute of that pass. None when cfg spreads no experts."""
        a2a = self.cm.expert_exchange(i, cfg)
        if a2a is None:
            return None
        f = self.cm.options.ep_overlap
        group_of = {t: members for members in cfg.expert_groups() for t in members}
        groups = [group_of[t] for t in range(cfg.num_tasks)]
        exposed = [
            [exposed_seconds(float(x), float(c), f) for x, c in zip(a, comp, strict=True)]
            for a, comp in ((a2a[0], fwd), (a2a[1], bwd))
        ]
        return groups, exposed[0], exposed[1]

    def _hops(self, a: int, b: int) -> list[tuple[int, float, float]]:
        """(resource, seconds per byte, latency) of each link on the route a -> b."""
        hops = self._hops_cache.get((a, b))
        if hops is None:
            D, links = self.devices.num_devices, self.devices.links
            here = self.devices.devices[a].name
            hops = []
            for li in self.devices.route(a, b):
                link = links[li]
                direction = 0 if link.a == here else 1
                here = link.b if direction == 0 else link.a
                hops.append((D + 2 * li + direction, 1.0 / link.bandwidth, link.latency))
            if len(self._hops_cache) >= HOPS_CACHE:
                self._hops_cache.clear()
            self._hops_cache[(a, b)] = hops
        return hops

    def _pairs(self, e: int, cu: ParallelConfig, cv: ParallelConfig) -> tuple:
        """(p, q, elements) of the task pairs of edge e that share data, as Python lists (the
        same for every edge with the same shapes, maps and degrees: unrolled steps)."""
        edge = self.graph.edges[e]
        grid = self.cm.edge_grid(edge, cu.reduce, cv.reduce)  # partial sums: contraction splits
        key = (grid, cu.grid, cv.grid)
        found = self._pairs_cache.get(key)
        if found is None:
            p, q, vol = transfer_pairs(
                grid.maps, grid.in_sizes, cu.grid, grid.out_sizes, grid.out_dims, cv.grid
            )
            found = (p.tolist(), q.tolist(), vol.tolist())
            if len(self._pairs_cache) >= PAIRS_CACHE:
                self._pairs_cache.clear()
            self._pairs_cache[key] = found
        return found

    def _build_edge(self, e: int) -> list[int]:
        edge = self.graph.edges[e]
        u, v = edge.src, edge.dst
        cu, cv = self.configs[u], self.configs[v]
        if cu is None or cv is None:
            self.edge_tasks[e] = []
            return []
        tg, out = self.tasks, TaskBatch(self.tasks)
        fwd_bytes, bwd_bytes = self.cm.edge_element_bytes(edge)  # x tensors carried
        fwd_label = f"{self._names[u]}->{self._names[v]}"
        bwd_label = f"grad {self._names[v]}->{self._names[u]}"
        gradient = self.graph.ops[u].kind != "input"  # data gets no gradient
        u_end, v_start = self._ends[(FWD, u)], self._starts[(FWD, v)]
        u_back, v_back = self._starts[(BWD, u)], self._ends[(BWD, v)]
        # v runs its forward again, or is context-parallel attention reading keys and values
        # it did not keep (`_context_kv`): it receives them again before its backward
        ring = self._context_kv(e, cv)
        again = v in self.cm.recomputed or ring
        v_again, again_label = self._starts[(BWD, v)], f"again {fwd_label}"
        back_v, back_u = self.n - 1 - v, self.n - 1 - u
        preds, succs = tg.preds, tg.succs
        devs_u, devs_v = cu.devices, cv.devices
        hidden = self._hidden_share(u, v, cu, cv, *self._pairs(e, cu, cv)[:2])
        leader = self._leader(e)
        if leader != e:  # the tensor is on these devices already: share the leader's messages
            self.edge_tasks[e] = []
            self._share(e, leader, gradient, u_end, v_start, u_back, v_back)
            return []
        arrive: dict[tuple[int, int], int] = {}
        first_back: dict[tuple[int, int], int] = {}
        self._shared[e] = (arrive, first_back)
        for p, q, elements in zip(*self._pairs(e, cu, cv), strict=True):
            dp, dq = devs_u[p], devs_v[q]
            if dp == dq:  # a dependency each way (inlined: most pairs of many strategies)
                a, b = u_end[p], v_start[q]
                preds[b].append(a)
                succs[a].append(b)
                a, b = v_back[q], u_back[p]
                preds[b].append(a)
                succs[a].append(b)
                continue
            size = elements * fwd_bytes  # an LSTM state: h and c together
            there = (
                size if hidden is None else self._exposed(dp, dq, size, hidden[0][p, q], hidden[2])
            )
            pair = p * 65536 + q
            keys: _Keys = ((FWD, u, 4, e, pair, 0), (FWD, v, 1, e, pair), None)
            arrive[p, q] = self._message(out, keys, dp, dq, there, u_end[p], fwd_label)
            out.depend(arrive[p, q], v_start[q])
            if again:  # before v's backward task, which recomputes v first
                if ring and hidden is not None:  # under v's backward, with the gradients
                    there = self._exposed(dp, dq, size, hidden[1][p, q], hidden[2])
                keys = ((BWD, back_v, -1, e, pair, -1), (BWD, back_v, -1, e, pair), None)
                msg = self._message(out, keys, dp, dq, there, u_end[p], again_label)
                out.depend(msg, v_again[q])
            if not gradient:
                continue
            size = elements * bwd_bytes
            back = (
                size if hidden is None else self._exposed(dq, dp, size, hidden[1][p, q], hidden[2])
            )
            pair = q * 65536 + p
            keys = (
                (BWD, back_v, 1, e, pair, -1),
                (BWD, back_v, 1, e, pair),
                (BWD, back_u, -1, e, pair, 0),
            )
            firsts: list[int] = []
            msg = self._message(out, keys, dq, dp, back, v_back[q], bwd_label, firsts=firsts)
            first_back[p, q] = firsts[0]
            out.depend(msg, u_back[p])
        self.edge_tasks[e] = made = out.commit()
        return made

    def _leaders_first(self, edges: Sequence[int]) -> list[int]:
        """`edges` in order, each group's leader before the edges that share its messages."""
        if not self.cm.options.transfer_once:
            return list(edges)
        return sorted(edges, key=lambda k: (self._leader(k) != k, k))

    def _leader(self, e: int) -> int:
        """The edge whose messages edge e shares (`CostOptions.transfer_once`): among the
        out-edges of e's producer whose consumers have the same devices and need the same
        boxes of the tensor, the one into the earliest consumer (its messages come first in
        the forward and last in the backward). e itself without the option or a twin."""
        if not self.cm.options.transfer_once:
            return e
        u = self.graph.edges[e].src
        leaders = self._leaders.get(u)
        if leaders is None:
            leaders = self._leaders[u] = self._group_out_edges(u)
        return leaders.get(e, e)

    def _group_out_edges(self, u: int) -> dict[int, int]:
        """Each configured out-edge of op u -> the leader of its group of twins."""
        groups: dict[tuple[object, ...], list[int]] = {}
        cu = self.configs[u]
        for k in self._out_edges[u]:
            edge = self.graph.edges[k]
            cv = self.configs[edge.dst]
            if cu is None or cv is None or edge.dst in self.cm.recomputed:
                continue
            grid = self.cm.edge_grid(edge, cu.reduce, cv.reduce)
            k_v = math.prod(cv.grid)
            lo, hi = task_boxes(grid.out_sizes, np.array([cv.grid]), k_v)
            nlo, nhi = needed_boxes(grid.maps, grid.in_sizes, grid.out_dims, lo, hi)
            key = (cv.devices, cv.grid, self.cm.edge_components(edge), nlo.tobytes(), nhi.tobytes())
            groups.setdefault(key, []).append(k)
        out: dict[int, int] = {}
        for members in groups.values():
            first = min(members, key=lambda k: (self.graph.edges[k].dst, k))
            out |= {k: first for k in members}
        return out

    def _share(
        self,
        e: int,
        leader: int,
        gradient: bool,
        u_end: list[int],
        v_start: list[int],
        u_back: list[int],
        v_back: list[int],
    ) -> None:
        """Edge e's dependencies on its leader's messages: its consumer's tasks start when
        the leader's arrive, and the gradient the leader sends back waits for e's consumer's
        backward too (the gradients are summed where they are made, then sent once)."""
        edge = self.graph.edges[e]
        cu, cv = self.configs[edge.src], self.configs[edge.dst]
        assert cu is not None and cv is not None
        arrive, first_back = self._shared[leader]
        tg = self.tasks
        for p, q, _ in zip(*self._pairs(e, cu, cv), strict=True):
            if cu.devices[p] == cv.devices[q]:
                tg.depend(u_end[p], v_start[q])
                tg.depend(v_back[q], u_back[p])
                continue
            tg.depend(arrive[p, q], v_start[q])
            if gradient:
                tg.depend(v_back[q], first_back[p, q])

    def _hidden_share(
        self, u: int, v: int, cu: ParallelConfig, cv: ParallelConfig, ps: list[int], qs: list[int]
    ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float], float] | None:
        """Communication a kernel hides (`planner.costs.overlap`): per task pair (p, q) of an
        edge into or out of a linear op (`CostOptions.tp_overlap`), or of the keys and values
        into a context-parallel attention op (`cp_overlap`: the ring's messages run beside
        its blocks' kernels), the compute seconds each of its forward and backward messages
        may run under: that op's task at that end (the consumer's when both are linear),
        shared among the messages that task sends or receives on this edge; and the fraction
        hidden. None when nothing overlaps."""
        kinds = self.graph.ops[u].kind, self.graph.ops[v].kind
        fraction = self.cm.options.tp_overlap
        ring = False
        if kinds[1] == "attention" and _splits_length(self.graph.ops[v], cv):
            fraction = self.cm.options.cp_overlap
            ring = self.cm.options.cp_exchange == "ring"
            side, cfg, tasks = v, cv, qs
        elif "linear" in kinds:
            side, cfg, tasks = (v, cv, qs) if kinds[1] == "linear" else (u, cu, ps)
        else:
            return None
        if fraction <= 0:
            return None
        fwd, bwd = self._op_costs(side, cfg)[:2]
        count = Counter(tasks)
        if ring:
            count = self._ring_steps(v, cv, tasks)
        # a ring attention's backward also receives the keys and values again: half each
        split = 2.0 if side == v and kinds[1] == "attention" and fraction > 0 else 1.0
        forward: dict[tuple[int, int], float] = {}
        backward: dict[tuple[int, int], float] = {}
        for p, q in zip(ps, qs, strict=True):
            t = q if side == v else p
            forward[p, q] = fwd[t] / count[t]
            backward[p, q] = bwd[t] / count[t] / split
        return forward, backward, fraction

    def _ring_steps(self, v: int, cv: ParallelConfig, tasks: list[int]) -> Counter[int]:
        """Ring attention (`CostOptions.cp_exchange` "ring", Megatron-Core's
        `AttnFuncWithCPAndKVP2P`): each of the c - 1 steps passes one chunk of keys and values
        while one of the c blocks computes, so a message of one of the op's key/value edges
        runs under 1 / c of the task's kernels, shared with the other key/value edges'."""
        op = self.graph.ops[v]
        c = cv.degrees[op.output.dims.index(LENGTH)]
        edges = sum(1 for e in self.graph.edges if e.dst == v and e.position > 0)
        return Counter({t: c * edges for t in set(tasks)})

    def _context_kv(self, e: int, cv: ParallelConfig | None) -> bool:
        """Whether edge e brings keys or values (an input after the first) to an attention op
        whose config splits its sequence (context parallelism). Ring attention (Megatron-Core
        with Transformer Engine) and all-gather attention (the Llama 3 paper) keep only their
        own chunk of keys and values, so the backward receives the others again beside the
        gradients it sends back (`CostModel.activations` keeps the producers' shards)."""
        edge = self.graph.edges[e]
        op = self.graph.ops[edge.dst]
        return op.kind == "attention" and edge.position > 0 and _splits_length(op, cv)

    def _exposed(
        self, a: int, b: int, size: float, partner: float, fraction: float | None = None
    ) -> float:
        """The bytes of a message from a to b whose transfer is left exposed when `fraction`
        of it may run under `partner` seconds of compute (`planner.costs.overlap.
        exposed_seconds`; default the tensor-parallel overlap): the message is sent with
        those bytes (its hops' latencies stay)."""
        hops = self._hops(a, b)
        inv = sum(h[1] for h in hops)
        lat = sum(h[2] for h in hops)
        if inv <= 0:
            return size
        f = self.cm.options.tp_overlap if fraction is None else fraction
        seconds = exposed_seconds(size * inv + lat, partner, f)
        return max(0.0, seconds - lat) / inv

    def _message(
        self,
        out: TaskBatch,
        keys: _Keys,
        a: int,
        b: int,
        size: float,
        after: int,
        what: str,
        share: float = 1.0,
        firsts: list[int] | None = None,
    ) -> int:
        """A message from device a to b after task `after`: the sender's overhead (key 0),
        the hops (key prefix 1, hop index last), the receiver's overhead (key 2; None: the
        hop prefix with the hop count); overheads scaled by `share`. Returns the last task
        (and appends the first to `firsts` when given)."""
        made: list[int] = []
        cost = self._overhead[a] * share
        if cost > 0:  # the send runs on the sender's processor
            after = out.add(pack(*keys[0]), a, cost, ("send", what), [after])
            made.append(after)
        label = (what, a, b)
        hops = self._hops(a, b)
        hop_key = pack(*keys[1], -1)  # + h + 1: hop h's key (the hop is the lowest field)
        for h, (res, inv_bw, lat) in enumerate(hops, start=1):
            after = out.add(hop_key + h, res, size * inv_bw + lat, label, [after])
            made.append(after)
        if firsts is not None and made:
            firsts.append(made[0])
        cost = self._overhead[b] * share
        if cost > 0:  # the arrival is handled on the receiver's processor
            recv = keys[2] if keys[2] is not None else (*keys[1], len(hops))
            after = out.add(pack(*recv), b, cost, ("recv", what), [after])
        return after

    def _join(self, out: TaskBatch, key: int, preds: list[int]) -> list[int]:
        """`preds` itself when short, else one join task that waits for all of them."""
        if len(preds) <= 2:
            return preds
        return [out.add(key, JOIN, 0.0, "join", preds)]

    def _build_sync(self, s: int) -> list[int]:
        """Gradient sync and update of the parameter group whose sync op is s."""
        op, cfg = self.graph.ops[s], self.configs[s]
        members = [j for j in self._sync_op[s] if self.configs[j] is not None]
        if not op.params or cfg is None:
            self.sync_tasks[s] = []
            return []
        out = TaskBatch(self.tasks)
        where = {j: _positions(self.configs[j]) for j in members}
        update = f"update {op.name} shard "
        # per parameter class (one but for a moe op whose experts are spread), its shards
        # numbered on from the class before's: g indexes class x shard
        classes = []
        for nbytes, array in self.cm.param_groups(op, cfg):
            groups = array.tolist()
            # The step reads and writes what the memory rule keeps (weights, gradients,
            # optimizer state, master copy); with ZeRO each replica only its 1/r slice.
            copies = self.cm.update_copies(op, len(groups[0]))
            classes += [(devs, nbytes / len(groups), copies) for devs in groups]
        for g, (devs, shard, copies) in enumerate(classes):
            ready = [
                self._ends[(BWD, j)][t]
                for j in members
                for d in devs
                if (t := where[j].get(d)) is not None
            ]
            done: list[int] = ready
            last = pack(BWD, self.n - 1 - s, SYNC_SUB, g, _LAST, 0)
            if len(devs) > 1:
                done, last = self._overlapped_sync(out, s, g, devs, shard, ready)
            done = self._join(out, last, done)
            label = f"{update}{g}"
            for d in devs:
                dur = copies * shard / (self.cm.mem_bw[d] * self.cm.options.memory_efficiency)
                # g in the index field: the 4-bit sub field would overflow at 16 groups
                out.add(pack(UPDATE, s, 0, g, d, 0), d, float(dur), label, done)
        self.sync_tasks[s] = made = out.commit()
        return made

    def _overlapped_sync(
        self, out: TaskBatch, s: int, g: int, devs: list[int], shard: float, ready: list[int]
    ) -> tuple[list[int], int]:
        """The sync of replica group g of op s, split by `CostOptions.dp_overlap` f: f of the
        shard right after the group's backward of the op (under the rest of the backward),
        the rest keyed into the update phase, so that on every device it waits for the whole
        backward pass (the FIFO order). Returns the last tasks and the key of their join."""
        f = self.cm.options.dp_overlap
        done: list[int] = []
        if f > 0:
            base = (BWD, self.n - 1 - s, SYNC_SUB, g)
            done += self._sync_transfers(out, base, s, devs, shard * f, ready)
        if f < 1:
            base = (UPDATE, s, -1, g)
            done += self._sync_transfers(out, base, s, devs, shard * (1 - f), ready)
            return done, pack(UPDATE, s, -1, g, _LAST, 0)
        return done, pack(BWD, self.n - 1 - s, SYNC_SUB, g, _LAST, 0)

    def _sync_transfers(
        self,
        out: TaskBatch,
        base: tuple[int, int, int, int],
        s: int,
        devs: list[int],
        shard: float,
        ready: list[int],
    ) -> list[int]:
        """Ring all-reduce: every replica sends 2 (r - 1) / r of the shard to the next one
        (its 2 (r - 1) pipelined steps as one transfer, after every replica's backward), each
        step's message overheads before and after it. ZeRO 1-2 (reduce-scatter + all-gather)
        cost the same; ZeRO 3's two weight all-gathers and gradient reduce-scatter are one
        transfer of 3 (r - 1) / r of the shard here, as t_s prices them (the simulator does
        not place the gathers before the op's forward and backward). Parameter server: pushes to the first
        device, then pulls. Overheads count the shard's share of a gradient bucket
        (`CostModel.bucket_share`). The passes are `CostModel.exposed_passes` (ZeRO's
        all-gathers hidden under compute leave the step). `base`: the key prefix of the
        tasks."""
        r = len(devs)
        name = self._names[s]
        share = self.cm.bucket_share(shard)

        def keys(k: int) -> _Keys:  # the k-th message of this sync
            return (*base, 3 * k + 1, 0), (*base, 3 * k + 2), (*base, 3 * k + 3, 0)

        ready = self._join(out, pack(*base, 0, -1), ready)
        if self.cm.options.sync == "ring":
            passes = self.cm.exposed_passes  # 2: all-reduce (ZeRO 1-2: reduce-scatter + gather)
            size = passes * (r - 1) / r * shard
            steps = passes * (r - 1) * share  # each step: one message to the next replica
            what, gate_label = f"allreduce {name}", f"sync {name} ready"
            src, dst, part = self.cm.ring_plan(devs)  # one ring, or one per NIC (rails)
            gates = {
                a: out.add(pack(*base, 0, j), a, 0.0, gate_label, ready) for j, a in enumerate(devs)
            }
            return [
                self._message(out, keys(k), a, b, size * f, gates[a], what, steps)
                for k, (a, b, f) in enumerate(
                    zip(src.tolist(), dst.tolist(), part.tolist(), strict=True)
                )
            ]
        ps, rest = devs[0], devs[1:]
        gate = out.add(pack(*base, 0, 0), ps, 0.0, f"sync {name} ready", ready)
        ins = [
            self._message(out, keys(j), a, ps, shard, gate, f"push {name}", share)
            for j, a in enumerate(rest)
        ]
        arrived = out.add(pack(*base, 3 * r + 1, 0), ps, 0.0, f"ps {name} has all", ins)
        return [
            self._message(out, keys(r + 1 + j), ps, a, shard, arrived, f"pull {name}", share)
            for j, a in enumerate(rest)
        ]

    # -- simulation ----------------------------------------------------------------------

    def full(self) -> float:
        """Algorithm 1: build the whole task graph and time every task."""
        with _cyclic_gc_paused():
            return self._full()

    def _full(self) -> float:
        self.tasks = TaskGraph()
        self._ends.clear()
        self._starts.clear()
        at, watch = self.deadline, math.isfinite(self.deadline)
        for i in range(self.n):
            if watch and past(at):
                raise OutOfTime
            self._build_op(i)
        self._leaders.clear()
        self._shared.clear()
        for e in self._leaders_first(range(len(self.graph.edges))):
            if watch and past(at):
                raise OutOfTime
            self._build_edge(e)
        for s in self._sync_op:
            self._build_sync(s)
        self.tasks.order_all()
        self.tasks.time_all(at)
        self.retimed = len(self.tasks.order)
        return self.makespan

    def change(self, i: int, cfg: ParallelConfig | None) -> float:
        """Algorithm 2: give op i config `cfg` and re-simulate only what changes.

        `None` leaves the op out (a partial strategy); since ops only add tasks and
        dependencies, a partial strategy's makespan is a lower bound for every completion."""
        return self.change_many([(i, cfg)])

    def change_many(self, changes: Sequence[tuple[int, ParallelConfig | None]]) -> float:
        """Several ops' configs at once (e.g. every op of a tied parameter group), with one
        re-propagation: the same timeline as changing them one by one."""
        with _cyclic_gc_paused():
            return self._change_many(changes)

    def _change_many(self, changes: Sequence[tuple[int, ParallelConfig | None]]) -> float:
        tg = self.tasks
        ops = sorted({i for i, _ in changes})
        edges = sorted({k for i in ops for k in self._incident[i]})
        if self.cm.options.transfer_once:  # twins share messages: rebuild a producer's all
            srcs = {self.graph.edges[k].src for k in edges}
            edges = sorted(set(edges) | {k for u in srcs for k in self._out_edges[u]})
        syncs = sorted({self._sync_of[i] for i in ops})
        old = [t for i in ops for t in self.owned[i]]
        old += [t for k in edges for t in self.edge_tasks[k]]
        old += [t for s in syncs for t in self.sync_tasks[s]]
        dirty = tg.remove(old)
        for i, cfg in changes:
            self.configs[i] = cfg
        for i in ops:
            for phase in (FWD, BWD):
                self._ends.pop((phase, i), None)
                self._starts.pop((phase, i), None)
        new: list[int] = []
        for i in ops:
            new += self._build_op(i)
        # A rebuilt op's tasks are new: every edge and sync that reads them is rebuilt too.
        for u in {self.graph.edges[k].src for k in edges}:
            self._leaders.pop(u, None)
        for k in self._leaders_first(edges):
            new += self._build_edge(k)
        for s in syncs:
            new += self._build_sync(s)
        tg.insert(new)
        for t in new:
            dirty.add(t)
            if tg.nxt[t] >= 0:
                dirty.add(tg.nxt[t])
        self.retimed = tg.retime(dirty, new)
        return self.makespan

    # -- results -------------------------------------------------------------------------

    @property
    def makespan(self) -> float:
        """The last end on any device or link (ends grow along each FIFO order)."""
        return self.tasks.makespan()

    def phase_ends(self) -> tuple[float, float]:
        """(the last end of a forward task, the last end of a backward task that is not
        parameter sync): one micro-batch's forward and backward on a pipeline chunk
        (`planner.pipeline.stages`); the makespan adds what is left of sync and updates."""
        tg = self.tasks
        forward = backward = 0.0
        for t in tg.order:
            key = tg.key[t]
            phase = key >> PHASE_SHIFT
            if phase == FWD:
                forward = max(forward, tg.end[t])
            elif phase == BWD and ((key >> SUB_SHIFT) & 15) - 1 != SYNC_SUB:
                backward = max(backward, tg.end[t])
        return forward, backward

    @property
    def num_tasks(self) -> int:
        """Live tasks on devices and links (joins excluded)."""
        tg = self.tasks
        return sum(1 for t in tg.order if tg.res[t] != JOIN)

    def timeline(self) -> Timeline:
        D = self.devices.num_devices
        tg = self.tasks
        tasks = tuple(
            TaskInfo(unpack(tg.key[t]), _name(tg, t), tg.res[t], tg.end[t] - tg.dur[t], tg.end[t])
            for t in tg.order
            if tg.res[t] != JOIN
        )
        memory = self.cm.strategy_memory(self.configs)
        names = [d.name for d in self.devices.devices]
        for link in self.devices.links:
            names += [f"{link.a}->{link.b}", f"{link.b}->{link.a}"]
        kinds = {op.name: op.kind for op in self.graph.ops}
        return Timeline(tasks, self.makespan, D, tuple(names), memory, kinds)


def simulate(cost_model: CostModel, strategy: Strategy) -> Timeline:
    """The full simulation of a strategy: its timeline and makespan (per-iteration time)."""
    return Simulator(cost_model, strategy.configs).timeline()


def _name(tg: TaskGraph, t: int) -> str:
    """A task's display name, from its shared label and its key."""
    label, key = tg.label[t], unpack(tg.key[t])
    if isinstance(label, tuple):
        if len(label) == 2:  # a message's processor time on one end
            return f"{label[0]} {label[1]}"
        what, a, b = label
        return f"xfer {what} {a}->{b} hop {key[5]}"
    assert isinstance(label, str)
    if label.endswith("#"):
        return f"{label}{key[3] % _AFTER}"
    return label


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while millions of task lists are made: they
    hold no cycles (reference counting frees them), and every full collection would walk
    all of them (a third of a large simulation's time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _distinct(groups: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct member lists of per-task groups, and each task's index among them."""
    index: dict[tuple[int, ...], int] = {}
    by_id: dict[int, int] = {}  # the groups are usually shared list objects: hash each once
    group_of = []
    for members in groups:
        g = by_id.get(id(members))
        if g is None:
            g = index.setdefault(tuple(members), len(index))
            by_id[id(members)] = g
        group_of.append(g)
    return [list(m) for m in index], group_of


def _splits_length(op: Op, cfg: ParallelConfig | None) -> bool:
    """Whether `cfg` splits `op`'s sequence (its `length` dim) over more than one task."""
    dims = op.output.dims
    return cfg is not None and LENGTH in dims and cfg.degrees[dims.index(LENGTH)] > 1


def _positions(cfg: ParallelConfig | None) -> dict[int, int]:
    """Device -> task index of a config."""
    return {} if cfg is None else {d: t for t, d in enumerate(cfg.devices)}


def _sync_ops(graph: OpGraph) -> dict[int, list[int]]:
    """Each parameter group (or op) -> its ops; keyed by the group's first op."""
    first: dict[str, int] = {}
    out: dict[int, list[int]] = {}
    for i, op in enumerate(graph.ops):
        g = op.param_group
        if g is None:
            out[i] = [i]
        elif g in first:
            out[first[g]].append(i)
        else:
            first[g] = i
            out[i] = [i]
    return out
