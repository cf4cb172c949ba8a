"""The task graph's storage, its program order and its timing (FlexFlow Sec. 5.2-5.3).

Tasks live in flat lists indexed by task id (ids are never reused; a removed task leaves a
hole). Each has a program-order key, packed into one int (`pack`: comparing ints is cheaper
than comparing tuples, and a million of them sort in a second), a resource (a device, a
link direction, or -1 for a join: a zero-time task that only gathers dependencies, so a
task waiting for a group waits for one join instead of every member: no quadratic
dependency lists), a duration, its predecessors and successors.

Every resource runs its tasks in key order (FIFO, assumption A3): `chains` keeps each
resource's keys and tasks sorted, `prev`/`nxt` the neighbours on the resource. `order` is
every live task in key order: a topological order, in which `time_all` sets each end once:

    end[t] = max(end of t's predecessors, end of the task before t on its resource) + dur[t]

`retime` is delta simulation's pass (Algorithm 2): from the earliest task whose inputs
changed, in the same order, a task is re-timed only when marked, and marks its successors
and the next task on its resource only when its end moved; it stops when no mark is left.
Both compute every end with the same operations, so they agree bit for bit.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from planner.deadline import OutOfTime, past

__all__ = ["JOIN", "TaskBatch", "TaskGraph", "pack", "unpack"]

JOIN = -1  # the resource of a join task
CHECK_TASKS = 1 << 16  # tasks timed between two looks at the clock

# Key fields (phase, op, sub, index, pair, hop) and their bit widths; sub and hop may be -1.
_WIDTHS = (2, 24, 4, 24, 40, 16)
_BIAS = (0, 0, 1, 0, 0, 1)


PHASE_SHIFT = sum(_WIDTHS[1:])  # key >> PHASE_SHIFT: the phase
SUB_SHIFT = sum(_WIDTHS[3:])  # (key >> SUB_SHIFT) & 15, less 1: the sub-step


def pack(phase: int, op: int, sub: int, index: int, pair: int, hop: int) -> int:
    """One int that orders like the tuple (phase, op, sub, index, pair, hop) (widths in
    `_WIDTHS`; sub and hop may be -1)."""
    return (((((phase << 24 | op) << 4 | (sub + 1)) << 24 | index) << 40 | pair) << 16) | (hop + 1)


def unpack(key: int) -> tuple[int, int, int, int, int, int]:
    """The tuple `pack` was given."""
    fields = []
    for width, bias in zip(reversed(_WIDTHS), reversed(_BIAS), strict=True):
        fields.append((key & ((1 << width) - 1)) - bias)
        key >>= width
    a, b, c, d, e, f = reversed(fields)
    return a, b, c, d, e, f


class TaskGraph:
    """Tasks, their dependencies, FIFO chains per resource, program order and ends."""

    def __init__(self) -> None:
        self.key: list[int] = []
        self.res: list[int] = []
        self.dur: list[float] = []
        self.end: list[float] = []
        self.label: list[object] = []  # shared per group of tasks; names are made on demand
        self.preds: list[list[int]] = []
        self.succs: list[list[int]] = []
        self.prev: list[int] = []  # the task before on the same resource (-1: none)
        self.nxt: list[int] = []  # the task after on the same resource (-1: none)
        self.alive: list[bool] = []
        self.marked: list[bool] = []  # delta simulation: waiting to be re-timed
        self.chains: dict[int, tuple[list[int], list[int]]] = {}  # resource -> (keys, tasks)
        self.order_keys: list[int] = []  # every live task's key, sorted
        self.order: list[int] = []  # the tasks in that order

    def __len__(self) -> int:
        return len(self.key)

    def add(self, key: int, res: int, dur: float, label: object, preds: Iterable[int]) -> int:
        t = len(self.key)
        self.key.append(key)
        self.res.append(res)
        self.dur.append(dur)
        self.end.append(0.0)
        self.label.append(label)
        ps = list(preds)
        self.preds.append(ps)
        self.succs.append([])
        for p in ps:
            self.succs[p].append(t)
        self.prev.append(-1)
        self.nxt.append(-1)
        self.alive.append(True)
        self.marked.append(False)
        return t

    def add_many(
        self,
        keys: list[int],
        res: list[int],
        durs: list[float],
        labels: list[object],
        preds: list[list[int]] | None = None,
    ) -> list[int]:
        """Add tasks in bulk (one list extension per field); returns their ids. A task's
        predecessors may be tasks added in the same call."""
        t0, n = len(self.key), len(keys)
        self.key += keys
        self.res += res
        self.dur += durs
        self.end += [0.0] * n
        self.label += labels
        self.preds += preds if preds is not None else [[] for _ in range(n)]
        self.succs += [[] for _ in range(n)]
        if preds is not None:
            succs = self.succs
            for t, ps in enumerate(preds, t0):
                for p in ps:
                    succs[p].append(t)
        self.prev += [-1] * n
        self.nxt += [-1] * n
        self.alive += [True] * n
        self.marked += [False] * n
        return list(range(t0, t0 + n))

    def depend(self, before: int, after: int) -> None:
        """`after` also waits for `before`."""
        self.preds[after].append(before)
        self.succs[before].append(after)

    # -- full simulation ----------------------------------------------------------------------

    def order_all(self) -> None:
        """Program order and FIFO chains of every task, from scratch."""
        key = self.key
        order = sorted(range(len(key)), key=key.__getitem__)
        self.order = order
        self.order_keys = keys = [key[t] for t in order]
        for a, b in zip(keys, keys[1:], strict=False):
            if a == b:
                # Two tasks with one key have no program order (a field of `pack` overflowed):
                # the timing would silently be wrong, and delta simulation would lose tasks.
                raise AssertionError(f"two tasks share the program-order key {unpack(a)}")
        chains: dict[int, tuple[list[int], list[int]]] = {}
        prev, nxt, res = self.prev, self.nxt, self.res
        for t in order:
            r = res[t]
            if r == JOIN:
                continue
            chain = chains.get(r)
            if chain is None:
                chains[r] = ([key[t]], [t])
                continue
            last = chain[1][-1]
            prev[t], nxt[last] = last, t
            chain[0].append(key[t])
            chain[1].append(t)
        self.chains = chains

    def time_all(self, deadline: float = math.inf) -> None:
        """Algorithm 1's timing: every end, in program order (OutOfTime past `deadline`,
        a perf_counter value, looked at every CHECK_TASKS tasks)."""
        end, dur, preds, prev, order = self.end, self.dur, self.preds, self.prev, self.order
        watch = math.isfinite(deadline)  # without a deadline, Ctrl-C does not stop it either
        for first in range(0, len(order), CHECK_TASKS):
            if watch and past(deadline):
                raise OutOfTime
            for t in order[first : first + CHECK_TASKS]:
                ready = 0.0
                for p in preds[t]:
                    if end[p] > ready:
                        ready = end[p]
                b = prev[t]
                if b >= 0 and end[b] > ready:
                    ready = end[b]
                end[t] = ready + dur[t]

    # -- delta simulation ---------------------------------------------------------------------

    def remove(self, tasks: Iterable[int]) -> set[int]:
        """Delete tasks; return the live tasks whose inputs changed because of it."""
        dead = list(tasks)
        alive = self.alive
        for t in dead:
            alive[t] = False
        touched: set[int] = set()
        for t in dead:
            for p in self.preds[t]:
                if alive[p]:
                    self.succs[p].remove(t)
            for s in self.succs[t]:
                if alive[s]:
                    self.preds[s].remove(t)
                    touched.add(s)
            if self.res[t] != JOIN:
                after = self._unchain(t)
                if after >= 0:
                    touched.add(after)
        dead_keys = sorted(self.key[t] for t in dead)
        self._splice(dead_keys, [], [])
        return {t for t in touched if alive[t]}

    def insert(self, tasks: list[int]) -> None:
        """Put new tasks in program order, globally and on their resources."""
        for t in tasks:
            if self.res[t] != JOIN:
                self._chain(t)
        new = sorted(tasks, key=self.key.__getitem__)
        self._splice([], [self.key[t] for t in new], new)

    def _chain(self, t: int) -> None:
        keys, ids = self.chains.setdefault(self.res[t], ([], []))
        k = bisect.bisect_left(keys, self.key[t])
        before = ids[k - 1] if k > 0 else -1
        after = ids[k] if k < len(ids) else -1
        keys.insert(k, self.key[t])
        ids.insert(k, t)
        self.prev[t], self.nxt[t] = before, after
        if before >= 0:
            self.nxt[before] = t
        if after >= 0:
            self.prev[after] = t

    def _unchain(self, t: int) -> int:
        """Take t off its resource; return the task after it (-1: none)."""
        keys, ids = self.chains[self.res[t]]
        k = bisect.bisect_left(keys, self.key[t])
        del keys[k], ids[k]
        before, after = self.prev[t], self.nxt[t]
        if before >= 0:
            self.nxt[before] = after
        if after >= 0:
            self.prev[after] = before
        return after

    def _splice(self, dead_keys: list[int], new_keys: list[int], new: list[int]) -> None:
        """Drop the sorted `dead_keys` from the global order and merge in the sorted new
        tasks: slices of the order lists, not one list operation per task."""
        keys, order = self.order_keys, self.order
        if dead_keys:
            cut = [bisect.bisect_left(keys, k) for k in dead_keys]
            kept_keys, kept = keys[: cut[0]], order[: cut[0]]
            for a, b in zip(cut, [*cut[1:], len(keys)], strict=True):
                kept_keys += keys[a + 1 : b]
                kept += order[a + 1 : b]
            keys, order = kept_keys, kept
        if new:
            bounds = [0, *(bisect.bisect_left(keys, k) for k in new_keys), len(keys)]
            merged_keys, merged = keys[: bounds[1]], order[: bounds[1]]
            for m in range(len(new)):
                merged_keys.append(new_keys[m])
                merged.append(new[m])
                merged_keys += keys[bounds[m + 1] : bounds[m + 2]]
                merged += order[bounds[m + 1] : bounds[m + 2]]
            keys, order = merged_keys, merged
        self.order_keys, self.order = keys, order

    def retime(self, dirty: set[int], new: Iterable[int]) -> int:
        """Re-time the `dirty` tasks and whatever their moves reach; return how many were
        re-timed. New tasks always count as moved (their old end means nothing)."""
        if not dirty:
            return 0
        end, dur, preds, prev, nxt = self.end, self.dur, self.preds, self.prev, self.nxt
        succs, marked, order = self.succs, self.marked, self.order
        for t in new:
            end[t] = math.nan  # never equal to a time: a new task always moves
        for t in dirty:
            marked[t] = True
        pending = len(dirty)
        k = bisect.bisect_left(self.order_keys, min(self.key[t] for t in dirty))
        count = 0
        while pending:
            t = order[k]
            k += 1
            if not marked[t]:
                continue
            marked[t] = False
            pending -= 1
            count += 1
            ready = 0.0
            for p in preds[t]:
                if end[p] > ready:
                    ready = end[p]
            b = prev[t]
            if b >= 0 and end[b] > ready:
                ready = end[b]
            value = ready + dur[t]
            if value == end[t]:
                continue
            end[t] = value
            for s in succs[t]:
                if not marked[s]:
                    marked[s] = True
                    pending += 1
            s = nxt[t]
            if s >= 0 and not marked[s]:
                marked[s] = True
                pending += 1
        return count

    # -- results ------------------------------------------------------------------------------

    def makespan(self) -> float:
        """The last end on any resource (ends grow along each FIFO chain)."""
        end = self.end
        return max((end[ids[-1]] for _, ids in self.chains.values() if ids), default=0.0)


class TaskBatch:
    """Tasks made for one group (an edge's messages, a parameter sync), added to the graph
    in bulk by `commit`: ids are known as tasks are made, so they can depend on each other.
    Nothing else may add tasks to the graph while a batch is open."""

    def __init__(self, graph: TaskGraph) -> None:
        self.graph = graph
        self.base = len(graph)
        self.keys: list[int] = []
        self.res: list[int] = []
        self.durs: list[float] = []
        self.labels: list[object] = []
        self.preds: list[list[int]] = []
        self.later: list[tuple[int, int]] = []  # (new task, existing task that waits for it)

    def add(self, key: int, res: int, dur: float, label: object, preds: list[int]) -> int:
        self.keys.append(key)
        self.res.append(res)
        self.durs.append(dur)
        self.labels.append(label)
        self.preds.append(preds)
        return self.base + len(self.keys) - 1

    def depend(self, before: int, after: int) -> None:
        """Existing task `after` also waits for `before` (made in this batch)."""
        self.later.append((before, after))

    def commit(self) -> list[int]:
        ids = self.graph.add_many(self.keys, self.res, self.durs, self.labels, self.preds)
        for before, after in self.later:
            self.graph.depend(before, after)
        return ids
