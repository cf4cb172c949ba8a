"""FlexFlow's execution simulator (Jia et al. 2019, Sec. 5): task graph, full and delta simulation.

Task graph (Sec. 5.1). For every op and its config: a forward and a backward task per
partition on its device. For every tensor edge and every pair of producer/consumer tasks that
share a sub-tensor (`planner.costs.regions`, the same overlaps the cost model prices): a dependency
when they are on one device, else a communication task on each link of the route (links are
devices of their own, one per direction, so transfers overlap with compute), forward for the
activations and backward for the gradients (none to the graph's input ops). Parameter synchronization of replicated shards
(FlexFlow's public code priced it at 0; we do not): ring all-reduce as one transfer of
2 (r - 1) / r of the shard on each hop of the ring, or a parameter server (each replica sends
its gradients to the first replica and receives the parameters back), then an update task on
every device that holds the shard. Ops sharing a parameter group synchronize once.

Host-driven messages (`Device.message_overhead` > 0, CPU workers with gloo): a transfer also
occupies the sending device for the overhead right after the producer task (the send runs on
its thread) and the receiving device just before the consumer task (the arrival is handled
on its processor). Synchronized batch norm: a batch-norm op whose config splits samples,
height or width gets an exchange task after its forward and after its backward task on every
device (`CostModel.norm_exchange`), which waits for every task holding the same channels;
the op's consumers and gradient transfers wait for it.

Order on a device (assumption A3, FIFO): tasks run in program order: forward ops in
topological order (an op's incoming transfers just before it), then backward ops in reverse,
each followed by its outgoing gradient transfers and its parameter sync, then the updates.
A task starts when its dependencies are done and the task before it on its device is done.

Full simulation (Algorithm 1) builds the graph and sets every task's start and end in that
order. Delta simulation (Algorithm 2) changes one op's config: it replaces the op's tasks,
the transfers of its edges and its group's sync, and re-propagates times only from the tasks
that changed, in program order (a topological order), until nothing changes further. Since
the order on every device is fixed, both give the same timeline, bit for bit (tested).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.costs.regions import needed_boxes, overlap_volume, task_boxes

if TYPE_CHECKING:
    from planner.costs.config import ParallelConfig
    from planner.costs.costmodel import CostModel
    from planner.graph.opgraph import OpGraph
    from planner.hardware.devices import DeviceGraph
    from planner.problems.strategy import Strategy

Key = tuple[int, int, int, int, int, int]
FWD, BWD, UPDATE = 0, 1, 2  # phases of the program order
_AFTER = 1 << 20  # task-index offset that orders an op's exchange tasks after its own tasks


@dataclass(frozen=True)
class TaskInfo:
    key: Key
    name: str  # e.g. "fwd conv1 #2", "xfer fc->loss 0->1 link 3"
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

    def by_key(self) -> dict[Key, tuple[float, float]]:
        return {t.key: (t.start, t.end) for t in self.tasks}


class Simulator:
    """A task graph and its timeline for a strategy; `change` re-simulates incrementally."""

    def __init__(self, cost_model: CostModel, configs: Sequence[ParallelConfig | None]):
        self.cm = cost_model
        self.graph = cost_model.graph
        self.devices = cost_model.devices
        self.n = len(self.graph.ops)
        self.configs: list[ParallelConfig | None] = list(configs)  # None: op left out
        self._routes = _routes(self.devices)
        self._bytes_cache: dict[tuple[int, tuple[int, ...], tuple[int, ...]], np.ndarray] = {}
        self._sync_op = _sync_ops(self.graph)
        self._sync_of = {i: s for s, members in self._sync_op.items() for i in members}
        self._incident: list[list[int]] = [[] for _ in range(self.n)]
        for k, e in enumerate(self.graph.edges):
            self._incident[e.src].append(k)
            if e.dst != e.src:
                self._incident[e.dst].append(k)
        # Task storage (ids never reused; removed tasks leave holes).
        self.key: list[Key] = []
        self.res: list[int] = []
        self.dur: list[float] = []
        self.label: list[str] = []
        self.preds: list[set[int]] = []
        self.succs: list[set[int]] = []
        self.end: list[float] = []
        self.alive: list[bool] = []
        self.prev: list[int] = []  # the task before on the same resource (-1: none)
        self.next: list[int] = []  # the task after on the same resource (-1: none)
        self.affected: list[bool] = []  # delta simulation: waiting to be re-timed
        self.order: dict[int, list[tuple[Key, int]]] = {}  # resource -> sorted (key, task)
        self.gorder: list[tuple[Key, int]] = []  # every live task in program order
        self.owned: list[list[int]] = [[] for _ in range(self.n)]  # op -> its F/B tasks
        self.edge_tasks: dict[int, list[int]] = {}  # edge index -> its transfer tasks
        self.sync_tasks: dict[int, list[int]] = {}  # sync op -> sync and update tasks
        # (phase, op, task index) -> the task whose end is that partition's end (the
        # batch-norm exchange when there is one) and -> the task that starts it (its compute)
        self._fb: dict[tuple[int, int, int], int] = {}
        self._in: dict[tuple[int, int, int], int] = {}
        self.full()

    # -- building ------------------------------------------------------------------------

    def _add(self, key: Key, res: int, dur: float, label: str, preds: Iterable[int]) -> int:
        t = len(self.key)
        self.key.append(key)
        self.res.append(res)
        self.dur.append(float(dur))
        self.label.append(label)
        ps = set(preds)
        self.preds.append(ps)
        self.succs.append(set())
        for p in ps:
            self.succs[p].add(t)
        self.end.append(0.0)
        self.alive.append(True)
        self.prev.append(-1)
        self.next.append(-1)
        self.affected.append(False)
        return t

    def _remove(self, tasks: Iterable[int]) -> set[int]:
        """Delete tasks; return the live tasks whose inputs changed because of it."""
        touched: set[int] = set()
        for t in tasks:
            self.alive[t] = False
            for p in self.preds[t]:
                self.succs[p].discard(t)
            for s in self.succs[t]:
                self.preds[s].discard(t)
                touched.add(s)
            before, after = self.prev[t], self.next[t]
            if before >= 0:
                self.next[before] = after
            if after >= 0:
                self.prev[after] = before
                touched.add(after)
            lst = self.order[self.res[t]]
            del lst[bisect.bisect_left(lst, (self.key[t], t))]
            del self.gorder[bisect.bisect_left(self.gorder, (self.key[t], t))]
        return {t for t in touched if self.alive[t]}

    def _insert(self, t: int) -> None:
        """Put a new task in program order on its resource and globally."""
        item = (self.key[t], t)
        lst = self.order.setdefault(self.res[t], [])
        k = bisect.bisect_left(lst, item)
        before = lst[k - 1][1] if k > 0 else -1
        after = lst[k][1] if k < len(lst) else -1
        lst.insert(k, item)
        self.prev[t], self.next[t] = before, after
        if before >= 0:
            self.next[before] = t
        if after >= 0:
            self.prev[after] = t
        bisect.insort(self.gorder, item)

    def _build_op(self, i: int) -> list[int]:
        op, cfg = self.graph.ops[i], self.configs[i]
        made: list[int] = []
        self.owned[i] = made
        if cfg is None:  # absent from a partial strategy
            return made
        fwd, bwd = self.cm.task_times(i, cfg)
        for t, dev in enumerate(cfg.devices):
            f = self._add((FWD, i, 2, t, 0, 0), dev, fwd[t], f"fwd {op.name} #{t}", ())
            b = self._add(
                (BWD, self.n - 1 - i, 0, t, 0, 0), dev, bwd[t], f"bwd {op.name} #{t}", (f,)
            )
            self._fb[(FWD, i, t)], self._fb[(BWD, i, t)] = f, b
            self._in[(FWD, i, t)], self._in[(BWD, i, t)] = f, b
            made += [f, b]
        groups = self.cm.norm_groups(i, cfg)
        if groups is not None:
            # The statistics exchange: every task of a group waits for all of its members;
            # inputs still go to the compute tasks (self._in), outputs leave after it.
            exchange = self.cm.norm_exchange(i, cfg)
            assert exchange is not None
            fwd_tasks = [self._in[(FWD, i, t)] for t in range(cfg.num_tasks)]
            bwd_tasks = [self._in[(BWD, i, t)] for t in range(cfg.num_tasks)]
            for t, dev in enumerate(cfg.devices):
                f = self._add(
                    (FWD, i, 3, t, 0, 0),
                    dev,
                    exchange[t],
                    f"bn stats {op.name} #{t}",
                    [fwd_tasks[m] for m in groups[t]],
                )
                b = self._add(
                    (BWD, self.n - 1 - i, 0, _AFTER + t, 0, 0),
                    dev,
                    exchange[t],
                    f"bn grad stats {op.name} #{t}",
                    [bwd_tasks[m] for m in groups[t]],
                )
                self._fb[(FWD, i, t)], self._fb[(BWD, i, t)] = f, b
                made += [f, b]
        return made

    def _devices_of(self, i: int) -> tuple[int, ...]:
        cfg = self.configs[i]
        return () if cfg is None else cfg.devices

    def _edge_bytes(self, e: int, cu: ParallelConfig, cv: ParallelConfig) -> np.ndarray:
        edge = self.graph.edges[e]
        key = (e, cu.degrees, cv.degrees)
        if key not in self._bytes_cache:
            src, dst = self.graph.ops[edge.src], self.graph.ops[edge.dst]
            plo, phi = task_boxes(src.output.sizes, np.array([cu.degrees]), cu.num_tasks)
            olo, ohi = task_boxes(dst.output.sizes, np.array([cv.degrees]), cv.num_tasks)
            maps = self.graph.input_maps(edge)
            nlo, nhi = needed_boxes(maps, src.output.sizes, dst.output.dims, olo, ohi)
            vol = overlap_volume(plo, phi, nlo, nhi)[0, :, 0, :]
            self._bytes_cache[key] = vol * src.output.dtype_bytes
        return self._bytes_cache[key]

    def _build_edge(self, e: int) -> list[int]:
        edge = self.graph.edges[e]
        u, v = edge.src, edge.dst
        cu, cv = self.configs[u], self.configs[v]
        made: list[int] = []
        self.edge_tasks[e] = made
        if cu is None or cv is None:
            return made
        nbytes = self._edge_bytes(e, cu, cv)
        components = self.cm.edge_components(edge)
        names = self.graph.ops[u].name, self.graph.ops[v].name
        for p, q in zip(*np.nonzero(nbytes), strict=True):
            dp, dq = cu.devices[p], cv.devices[q]
            fu, fv = self._fb[(FWD, u, p)], self._in[(FWD, v, q)]
            bu, bv = self._in[(BWD, u, p)], self._fb[(BWD, v, q)]
            if dp == dq:
                self.preds[fv].add(fu)
                self.succs[fu].add(fv)
                self.preds[bu].add(bv)
                self.succs[bv].add(bu)
                continue
            size = float(nbytes[p, q]) * components  # an LSTM state: h and c together
            pair = int(p) * 65536 + int(q)
            hops = len(self._routes[(dp, dq)])
            keys = (FWD, u, 4, e, pair, 0), (FWD, v, 1, e, pair, 0), (FWD, v, 1, e, pair, hops)
            last = self._message(keys, dp, dq, size, fu, f"{names[0]}->{names[1]}", made)
            self.preds[fv].add(last)
            self.succs[last].add(fv)
            if self.graph.ops[u].kind == "input":
                continue  # data gets no gradient
            pair = int(q) * 65536 + int(p)
            back = self.n - 1 - v
            keys = (
                (BWD, back, 1, e, pair, -1),
                (BWD, back, 1, e, pair, 0),
                (BWD, self.n - 1 - u, -1, e, pair, 0),
            )
            last = self._message(keys, dq, dp, size, bv, f"grad {names[1]}->{names[0]}", made)
            self.preds[bu].add(last)
            self.succs[last].add(bu)
        return made

    def _message(
        self,
        keys: tuple[Key, Key, Key],
        a: int,
        b: int,
        size: float,
        after: int,
        what: str,
        made: list[int],
        share: float = 1.0,
    ) -> int:
        """A message from device a to b after task `after`: the sender's overhead (key 0),
        the hops (key 1, hop index last), the receiver's overhead (key 2); overheads scaled
        by `share`. Returns the last task."""
        after = self._overhead(keys[0], a, after, f"send {what}", made, share)
        last = self._transfer(keys[1], a, b, size, after, what, made)
        return self._overhead(keys[2], b, last, f"recv {what}", made, share)

    def _overhead(
        self, key: Key, dev: int, after: int, what: str, made: list[int], share: float = 1.0
    ) -> int:
        """A message's processor time on device `dev` after task `after` (none: `after`)."""
        cost = self.cm.overhead[dev] * share
        if cost <= 0:
            return after
        made.append(self._add(key, dev, cost, what, (after,)))
        return made[-1]

    def _transfer(
        self, key: Key, a: int, b: int, size: float, after: int, what: str, made: list[int]
    ) -> int:
        """Transfer `size` bytes from device a to b hop by hop after task `after`; last hop id."""
        prev = after
        for h, (res, inv_bw, lat) in enumerate(self._routes[(a, b)]):
            k = (*key[:5], h)
            prev = self._add(k, res, size * inv_bw + lat, f"xfer {what} {a}->{b} hop {h}", (prev,))
            made.append(prev)
        return prev

    def _build_sync(self, s: int) -> list[int]:
        """Gradient sync and update of the parameter group whose sync op is s."""
        op, cfg = self.graph.ops[s], self.configs[s]
        members = [j for j in self._sync_op[s] if self.configs[j] is not None]
        made: list[int] = []
        self.sync_tasks[s] = made
        if not op.params or cfg is None:
            return made
        groups = self.cm.replica_groups(op, cfg)
        shard = op.param_bytes / len(groups)
        copies = self.cm.options.param_copies
        for g, devs in enumerate(groups):
            ready = [
                self._fb[(BWD, j, t)]
                for j in members
                for t, d in enumerate(self._devices_of(j))
                if d in devs
            ]
            done: list[int] = ready
            if len(devs) > 1:
                done = self._sync_transfers(s, g, devs, shard, ready, made)
            for d in devs:
                dur = copies * shard / (self.cm.mem_bw[d] * self.cm.options.memory_efficiency)
                made.append(
                    self._add((UPDATE, s, g, d, 0, 0), d, dur, f"update {op.name} shard {g}", done)
                )
        return made

    def _sync_transfers(
        self, s: int, g: int, devs: list[int], shard: float, ready: list[int], made: list[int]
    ) -> list[int]:
        """Ring all-reduce: every replica sends 2 (r - 1) / r of the shard to the next one
        (its 2 (r - 1) pipelined steps as one transfer, after every replica's backward), each
        step's message overheads before and after it. Parameter server: pushes to the first
        device, then pulls. Overheads count the shard's share of a gradient bucket
        (`CostModel.bucket_share`)."""
        r = len(devs)
        base = (BWD, self.n - 1 - s, 2, g)
        name = self.graph.ops[s].name
        share = self.cm.bucket_share(shard)

        def keys(k: int) -> tuple[Key, Key, Key]:  # the k-th message of this sync
            return (*base, 3 * k + 1, 0), (*base, 3 * k + 2, 0), (*base, 3 * k + 3, 0)

        if self.cm.options.sync == "ring":
            ends = []
            for j, a in enumerate(devs):
                gate = self._add((*base, 0, j), a, 0.0, f"sync {name} ready", ready)
                made.append(gate)
                size = 2 * (r - 1) / r * shard
                steps = 2 * (r - 1) * share  # each step: one message to the next replica
                what = f"allreduce {name}"
                ends.append(
                    self._message(keys(j), a, devs[(j + 1) % r], size, gate, what, made, steps)
                )
            return ends
        ps, rest = devs[0], devs[1:]
        gate = self._add((*base, 0, 0), ps, 0.0, f"sync {name} ready", ready)
        made.append(gate)
        ins = [
            self._message(keys(j), a, ps, shard, gate, f"push {name}", made, share)
            for j, a in enumerate(rest)
        ]
        arrived = self._add((*base, 3 * r + 1, 0), ps, 0.0, f"ps {name} has all", ins)
        made.append(arrived)
        return [
            self._message(keys(r + 1 + j), ps, a, shard, arrived, f"pull {name}", made, share)
            for j, a in enumerate(rest)
        ]

    # -- simulation ----------------------------------------------------------------------

    def full(self) -> float:
        """Algorithm 1: build the whole task graph and time every task."""
        for store in (self.key, self.res, self.dur, self.label, self.preds, self.succs):
            store.clear()
        for flags in (self.end, self.alive, self.prev, self.next, self.affected):
            flags.clear()
        self._fb.clear()
        self._in.clear()
        for i in range(self.n):
            self._build_op(i)
        for e in range(len(self.graph.edges)):
            self._build_edge(e)
        for s in self._sync_op:
            self._build_sync(s)
        self.gorder = sorted((k, t) for t, k in enumerate(self.key))
        self.order = {}
        for item in self.gorder:
            t = item[1]
            lst = self.order.setdefault(self.res[t], [])
            if lst:
                self.prev[t] = lst[-1][1]
                self.next[lst[-1][1]] = t
            lst.append(item)
        end, dur, preds, prev = self.end, self.dur, self.preds, self.prev
        for _, t in self.gorder:
            ready = max([end[p] for p in preds[t]], default=0.0)
            before = prev[t]
            if before >= 0 and end[before] > ready:
                ready = end[before]
            end[t] = ready + dur[t]
        return self.makespan

    def change(self, i: int, cfg: ParallelConfig | None) -> float:
        """Algorithm 2: give op i config `cfg` and re-simulate only what changes.

        `None` leaves the op out (a partial strategy); since ops only add tasks and
        dependencies, a partial strategy's makespan is a lower bound for every completion."""
        return self.change_many([(i, cfg)])

    def change_many(self, changes: Sequence[tuple[int, ParallelConfig | None]]) -> float:
        """Several ops' configs at once (e.g. every op of a tied parameter group), with one
        re-propagation: the same timeline as changing them one by one."""
        ops = sorted({i for i, _ in changes})
        edges = sorted({k for i in ops for k in self._incident[i]})
        syncs = sorted({self._sync_of[i] for i in ops})
        old = [t for i in ops for t in self.owned[i]]
        old += [t for k in edges for t in self.edge_tasks[k]]
        old += [t for s in syncs for t in self.sync_tasks[s]]
        dirty = self._remove(old)
        for i, cfg in changes:
            self.configs[i] = cfg
        new: list[int] = []
        for i in ops:
            new += self._build_op(i)
        for k in edges:
            new += self._build_edge(k)
        for s in syncs:
            new += self._build_sync(s)
        for t in new:
            self._insert(t)
        for t in new:
            dirty.add(t)
            if self.next[t] >= 0:
                dirty.add(self.next[t])
        self._propagate(set(new), dirty)
        return self.makespan

    def _propagate(self, new: set[int], dirty: set[int]) -> None:
        """Re-time affected tasks in program order; a task whose end moves affects its
        successors and the next task on its resource. Stops when none is left."""
        end, dur, preds, prev, nxt = self.end, self.dur, self.preds, self.prev, self.next
        affected = self.affected
        for t in dirty:
            affected[t] = True
        pending = len(dirty)
        start = (
            bisect.bisect_left(self.gorder, min((self.key[t], t) for t in dirty)) if dirty else 0
        )
        for k in range(start, len(self.gorder)):
            if not pending:
                break
            t = self.gorder[k][1]
            if not affected[t]:
                continue
            affected[t] = False
            pending -= 1
            ready = max([end[p] for p in preds[t]], default=0.0)
            before = prev[t]
            if before >= 0 and end[before] > ready:
                ready = end[before]
            value = ready + dur[t]
            if value == end[t] and t not in new:
                continue
            end[t] = value
            for s in (*self.succs[t], nxt[t]):
                if s >= 0 and not affected[s]:
                    affected[s] = True
                    pending += 1

    # -- results -------------------------------------------------------------------------

    @property
    def makespan(self) -> float:
        """The last end on any device or link (ends grow along each FIFO order)."""
        return max((self.end[lst[-1][1]] for lst in self.order.values() if lst), default=0.0)

    def timeline(self) -> Timeline:
        D = self.devices.num_devices
        tasks = tuple(
            TaskInfo(
                self.key[t], self.label[t], self.res[t], self.end[t] - self.dur[t], self.end[t]
            )
            for t in range(len(self.key))
            if self.alive[t]
        )
        memory = sum(
            (self.cm.memory(i, c) for i, c in enumerate(self.configs) if c is not None),
            np.zeros(D),
        )
        names = [d.name for d in self.devices.devices]
        for link in self.devices.links:
            names += [f"{link.a}->{link.b}", f"{link.b}->{link.a}"]
        return Timeline(tasks, self.makespan, D, tuple(names), memory)


def simulate(cost_model: CostModel, strategy: Strategy) -> Timeline:
    """The full simulation of a strategy: its timeline and makespan (per-iteration time)."""
    return Simulator(cost_model, strategy.configs).timeline()


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


def _routes(devices: DeviceGraph) -> dict[tuple[int, int], list[tuple[int, float, float]]]:
    """(a, b) -> hops (resource id, seconds per byte, latency) along the route a -> b."""
    D = devices.num_devices
    names = [d.name for d in devices.devices]
    out = {}
    for a in range(D):
        for b in range(D):
            if a == b:
                continue
            hops, here = [], names[a]
            for li in devices.route(a, b):
                link = devices.links[li]
                direction = 0 if link.a == here else 1
                here = link.b if direction == 0 else link.a
                hops.append((D + 2 * li + direction, 1.0 / link.bandwidth, link.latency))
            out[(a, b)] = hops
    return out
