"""A pipeline's step, timed: micro-batch tasks per device group in their schedule's order.

Input: per chunk (`ChunkTimes`) the seconds of one micro-batch's forward and backward on its
group, the seconds to send its output forward and its input's gradient back (point-to-point
between groups, on the device graph), the exposed seconds of its gradient synchronization
and update after its last backward, and its bytes (kept per in-flight micro-batch, and
fixed: parameters with their training state, and its working set). `simulate_pipeline` runs
the schedule, and a group's peak memory is its chunks' parameters, the most activations its
order keeps at once and its largest working set (`stage_peak`):

- a group runs its works (`planner.pipeline.schedule`) one at a time, in order, each as
  soon as the one before it on the group is done and its input is there;
- the forward of micro-batch i on chunk c needs the forward of i on chunk c - 1 and its
  message; the backward of i on chunk c needs the forward of i on c (same group) and the
  backward of i on c + 1 and its message (the last chunk's backward follows its forward);
- where the schedule splits the backward ("dualpipe"), "B" is its input gradient,
  `1 - weight_share` of `backward`, and "W" the weight gradient, the rest, after B on the
  same group; works joined into one unit (`Work.joined`: DualPipe's overlapped forward and
  backward, a backward with its weight gradient) start when all their inputs are there,
  run one after another, and send their messages when the unit ends;
- a message travels while the groups compute (its own stream: Megatron-LM's p2p
  communication), on its own link: messages between the same two groups in the same
  direction go one at a time, in the order they are ready; with `p2p_overlap` below 1
  (`CostOptions.pp_overlap`) the rest of its seconds keep the sender from its next work;
- after a group's last backward of a chunk, that chunk's gradient sync and update
  (`sync`), one chunk's at a time per group, in the order the chunks' last backwards end:
  with the interleaved schedule, whose backwards run a group's chunks in reverse, the later
  chunks' syncs overlap the group's later backwards of earlier chunks; the last of them
  ends the step on that group at the latest. Without the overlapped gradient reduce
  (`grad_overlap` below 1: Megatron-LM's default) that share of every sync waits for the
  group's last backward.

With "dualpipe" (DeepSeek-V3, arXiv 2412.19437, Sec. 3.2.1; `planner.pipeline.schedule`)
the chunks are its p stages, each on two groups (`schedule.group_of`:
micro-batches fed from either end), messages go both ways between neighbours, a group
keeps both its stages' parameters (`schedule.held`), and each copy syncs its own
gradients (`_syncs`). A micro-batch's activations are kept until its weight gradient.

The timeline is exact for this model: on uniform chunks with free messages and no sync its
idle share is the closed form `schedule.bubble_fraction` (a test checks it).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from planner.pipeline.schedule import (
    BACKWARD,
    DUALPIPE,
    FORWARD,
    WEIGHT,
    ScheduleError,
    Work,
    group_of,
    held,
    in_flight,
    releases,
    schedule,
)


def counted(n: int, noun: str, plural: str = "") -> str:
    """'1 stage', '4 stages', '1 micro-batch', '8 micro-batches' (`plural`: when not noun + s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


@dataclass(frozen=True)
class ChunkTimes:
    """One chunk's costs for one micro-batch (seconds, bytes per device of its group)."""

    forward: float
    backward: float
    send_forward: float = 0.0  # its output to the next chunk (0 for the last)
    send_backward: float = 0.0  # its input's gradient to the previous chunk (0 for the first)
    sync: float = 0.0  # gradient sync and update left after its last backward
    activation_bytes: float = 0.0  # kept per in-flight micro-batch, on each device of its group
    fixed_bytes: float = 0.0  # parameters, their training state and working_bytes, on each device
    working_bytes: float = 0.0  # of fixed_bytes: the largest working set (recomputation, loss)
    # of backward: the weight gradient's share, where a schedule runs it apart ("dualpipe");
    # a linear's backward is two GEMMs of its forward's size, dX and dW: 0.5
    weight_share: float = 0.5


@dataclass(frozen=True)
class Slot:
    """A work or a message on the timeline. `group`: the device group that runs it (for a
    message, the sender); `to`: the receiving group of a message, else -1."""

    work: Work
    group: int
    start: float
    end: float
    to: int = -1

    @property
    def is_message(self) -> bool:
        return self.to >= 0


@dataclass(frozen=True)
class PipelineTimeline:
    groups: int
    micro_batches: int
    virtual: int
    schedule: str
    works: tuple[Slot, ...]  # every forward and backward, in start order
    messages: tuple[Slot, ...]  # every point-to-point message
    syncs: tuple[Slot, ...]  # per chunk: its gradient sync and update
    makespan: float
    busy: tuple[float, ...]  # per group: seconds of forward and backward work
    in_flight: tuple[int, ...]  # per group: most micro-batch chunks whose activations it keeps
    peak_bytes: tuple[float, ...]  # per group, per device: the sum of its `peak_parts`
    # per group, per device: what its peak holds (`stage_peak`): "parameters" (weights,
    # gradients, optimizer state), "activations" (the micro-batches in flight) and
    # "working_set" (the largest of its chunks'); () when not computed
    peak_parts: tuple[dict[str, float], ...] = ()

    @property
    def bubble(self) -> float:
        """The idle share of the step, averaged over groups: 1 - busy / makespan."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.groups * self.makespan)


def simulate_pipeline(
    chunks: Sequence[ChunkTimes],
    name: str,
    groups: int,
    micro_batches: int,
    p2p_overlap: float = 1.0,
    grad_overlap: float = 1.0,
) -> PipelineTimeline:
    """Time one step of `name`'s schedule over `groups` device groups; `chunks` has
    groups x v entries (v chunks per group; chunk c on group c % groups; "dualpipe": v = 1,
    each chunk on two groups, `schedule.group_of`). `p2p_overlap`
    (`CostOptions.pp_overlap`): the share of each message that travels while its sender
    goes on; the rest of it keeps the sender busy after the work that sent it (a blocking
    send). `grad_overlap` (`CostOptions.chunk_sync_share`): the share of a chunk's gradient sync
    that may start when the chunk's last backward is done; the rest waits for its group's
    last backward."""
    p, m = groups, micro_batches
    if not chunks or len(chunks) % p:
        raise ScheduleError(
            f"{counted(len(chunks), 'pipeline chunk')} do not spread evenly over "
            f"{counted(p, 'stage')}: give a multiple of {p}"
        )
    for c, ch in enumerate(chunks):
        if min(ch.forward, ch.backward) < 0 or not 0 <= ch.weight_share <= 1:
            raise ScheduleError(
                f"pipeline chunk {c}: seconds must be >= 0 and its backward's weight-gradient "
                f"share in [0, 1], got forward {ch.forward}, backward {ch.backward}, share "
                f"{ch.weight_share}"
            )
    v = len(chunks) // p
    orders = schedule(name, p, m, v)
    n = len(chunks)
    split = any(w.kind == WEIGHT for o in orders for w in o)  # B is the input gradient only
    done: dict[Work, float] = {}  # work -> its end
    arrive: dict[Work, float] = {}  # work -> when its input message is there
    link_free: dict[tuple[int, int], float] = {}
    works: list[Slot] = []
    messages: list[Slot] = []
    nxt = [0] * p  # next position in each group's order
    free = [0.0] * p  # when each group is free
    # messages not yet on their link: (ready, seq, receiving work, from, to, seconds)
    messages_in: list[tuple[float, int, Work, int, int, float]] = []
    seq = 0

    ends = [_unit_ends(o) for o in orders]  # per position: the end of the unit it starts
    lengths = {  # seconds of each kind of work per chunk
        FORWARD: [c.forward for c in chunks],
        BACKWARD: [c.backward * (1.0 - c.weight_share) if split else c.backward for c in chunks],
        WEIGHT: [c.backward * c.weight_share for c in chunks],
    }
    mirrored = name == DUALPIPE

    def ready(w: Work, inside: Collection[Work] = ()) -> float | None:
        """When w's inputs are all there (those from works of its own unit, `inside`, do not
        count), or None while one is missing."""
        kind, t = w.kind, 0.0
        if kind != FORWARD:  # its own forward (or for W its input gradient) on this group
            own = Work(BACKWARD if kind == WEIGHT else FORWARD, w.micro, w.chunk)
            if own not in inside:
                if own not in done:
                    return None
                t = done[own]
            if kind == WEIGHT:
                return t
        if (kind == FORWARD and w.chunk > 0) or (kind == BACKWARD and w.chunk < n - 1):
            if w not in arrive:
                return None
            t = max(t, arrive[w])
        return t

    def send(w: Work, end: float) -> float:
        """Queue w's outgoing message (forward to chunk + 1, or a gradient to chunk - 1);
        the seconds it blocks its sender."""
        nonlocal seq
        if w.kind == FORWARD and w.chunk < n - 1:
            to, seconds = Work(FORWARD, w.micro, w.chunk + 1), chunks[w.chunk].send_forward
        elif w.kind == BACKWARD and w.chunk > 0:
            to, seconds = Work(BACKWARD, w.micro, w.chunk - 1), chunks[w.chunk].send_backward
        else:
            return 0.0
        if mirrored:
            a, b = group_of(name, p, m, w), group_of(name, p, m, to)
        else:
            a, b = w.chunk % p, to.chunk % p
        heapq.heappush(messages_in, (end, seq, to, a, b, seconds))
        seq += 1
        return (1.0 - p2p_overlap) * seconds

    def deliver(until: float) -> None:
        """Put every message ready by `until` on its link, in the order they were ready."""
        while messages_in and messages_in[0][0] <= until:
            t, _, to, a, b, seconds = heapq.heappop(messages_in)
            start = max(t, link_free.get((a, b), 0.0))
            end = start + seconds
            link_free[(a, b)] = end
            arrive[to] = end
            messages.append(Slot(to, a, start, end, b))
            refresh(b)

    # each group's next work, keyed by when it can start (stale entries skipped by version)
    heads: list[tuple[float, int, int]] = []
    version = [0] * p

    def refresh(g: int) -> None:
        version[g] += 1
        order, k = orders[g], nxt[g]
        if k < len(order):
            end = ends[g][k]
            if end == k + 1:
                r = ready(order[k])
            else:  # a unit: when all its works' inputs are there
                mine = order[k:end]
                times = [ready(w, mine) for w in mine]
                r = None if None in times else max(t for t in times if t is not None)
            if r is not None:
                heapq.heappush(heads, (max(r, free[g]), g, version[g]))

    def earliest() -> tuple[float, int, int] | None:
        while heads and heads[0][2] != version[heads[0][1]]:
            heapq.heappop(heads)
        return heads[0] if heads else None

    for g in range(p):
        refresh(g)
    remaining = sum(len(o) for o in orders)
    while remaining:
        # the group whose next work can start earliest, given the messages sent so far
        best = earliest()
        if messages_in and (best is None or messages_in[0][0] <= best[0]):
            deliver(messages_in[0][0])  # a message ready first may change who goes next
            continue
        if best is None:  # cannot happen for the schedules above: a bug, not bad input
            raise ScheduleError(
                f"schedule {name!r} deadlocks with {counted(p, 'stage')} and "
                f"{counted(m, 'micro-batch', 'micro-batches')}"
            )
        start, g, _ = heapq.heappop(heads)
        first, last = nxt[g], ends[g][nxt[g]]
        for k in range(first, last):  # one after another
            w = orders[g][k]
            end = start + lengths[w.kind][w.chunk]
            done[w] = end
            works.append(Slot(w, g, start, end))
            start = end
        nxt[g], remaining = last, remaining - (last - first)
        if last == first + 1:
            free[g] = end + send(orders[g][first], end)
        else:  # a unit's messages leave when it ends
            free[g] = end + sum(send(orders[g][k], end) for k in range(first, last))
        refresh(g)
    deliver(float("inf"))
    syncs = _syncs(chunks, name, p, m, done, grad_overlap)
    makespan = max([s.end for s in syncs] + [s.end for s in works] + [s.end for s in messages])
    busy = [0.0] * p
    for s in works:
        busy[s.group] += s.end - s.start
    flight = [in_flight(o) for o in orders]
    parts = [
        stage_peak(orders[g], [chunks[k] for k in held(name, p, n, g)], chunks) for g in range(p)
    ]
    works.sort(key=lambda s: (s.start, s.group))
    return PipelineTimeline(
        groups=p,
        micro_batches=m,
        virtual=v,
        schedule=name,
        works=tuple(works),
        messages=tuple(sorted(messages, key=lambda s: (s.start, s.group))),
        syncs=tuple(syncs),
        makespan=makespan,
        busy=tuple(busy),
        in_flight=tuple(flight),
        peak_bytes=tuple(sum(q.values()) for q in parts),
        peak_parts=tuple(parts),
    )


def _unit_ends(order: Sequence[Work]) -> list[int]:
    """Per position of `order`, the end of the unit of works joined to it (`Work.joined`)
    that starts there: the position after its last work."""
    ends = [0] * len(order)
    for k in range(len(order) - 1, -1, -1):
        ends[k] = ends[k + 1] if order[k].joined and k + 1 < len(order) else k + 1
    return ends


def _syncs(
    chunks: Sequence[ChunkTimes],
    name: str,
    p: int,
    m: int,
    done: dict[Work, float],
    grad_overlap: float,
) -> list[Slot]:
    """Per copy of a chunk's parameters (one per chunk; "dualpipe": two, on groups c and
    p - 1 - c), in chunk order, its gradient sync and update, one at a time per group:
    `grad_overlap` (`CostOptions.chunk_sync_share`) of it ready at the copy's last backward
    (its last weight gradient where the backward is split) (Megatron-Core's overlapped
    gradient reduce starts a chunk's buckets when its backward is done: with interleaving,
    the later chunks first, under the earlier chunks' backwards), the rest at the group's
    last backward (without the overlap, Megatron-LM reduces the gradients after the
    pipeline's flush); the parts in the order they are ready. A copy's slot spans its
    parts. DualPipe's two copies of a stage each reduce their own gradients over the
    stage's data-parallel replicas, at the chunk's sync seconds (adding the two copies'
    gradients makes that reduce one over twice the replicas, a ring's bytes per device
    (2n - 1) / n against 2 (n - 1) / n: not counted)."""
    n = len(chunks)
    kind = WEIGHT if any(w.kind == WEIGHT for w in done) else BACKWARD  # a gradient's last
    copies = [(g, k) for g in range(p) for k in held(name, p, n, g)]
    copies.sort(key=lambda c: (c[1], c[0]))
    final: dict[tuple[int, int], float] = {}  # copy -> its gradient's last work's end
    for w, end in done.items():
        g = group_of(name, p, m, w)
        if w.kind == kind:
            final[g, w.chunk] = max(final.get((g, w.chunk), end), end)
    last = [final[c] for c in copies]
    flush = [max(t for (g, _), t in zip(copies, last, strict=True) if g == h) for h in range(p)]
    parts = []  # (ready, chunk, group, seconds, copy)
    for j, (g, k) in enumerate(copies):
        c = chunks[k]
        if grad_overlap > 0:
            parts.append((last[j], k, g, grad_overlap * c.sync, j))
        if grad_overlap < 1:
            parts.append((flush[g], k, g, (1.0 - grad_overlap) * c.sync, j))
    free = [0.0] * p  # when each group's previous sync ends
    span: dict[int, tuple[float, float]] = {}
    for ready, _, g, seconds, j in sorted(parts):
        start = max(ready, free[g])
        free[g] = start + seconds
        first = span[j][0] if j in span else start
        span[j] = (first, free[g])
    return [Slot(Work("S", m - 1, k), g, *span[j]) for j, (g, k) in enumerate(copies)]


def stage_peak(
    order: Sequence[Work], mine: Sequence[ChunkTimes], chunks: Sequence[ChunkTimes]
) -> dict[str, float]:
    """What a group's peak holds per device: its chunks' parameters (with gradients and
    optimizer state), the most activation bytes it keeps at once in its schedule's `order`
    (`_activation_peak`), and the largest working set of its chunks (one runs at a time)."""
    return {
        "parameters": sum(c.fixed_bytes - c.working_bytes for c in mine),
        "activations": _activation_peak(order, chunks),
        "working_set": max((c.working_bytes for c in mine), default=0.0),
    }


def _activation_peak(order: Sequence[Work], chunks: Sequence[ChunkTimes]) -> float:
    """The most activation bytes a group keeps at once: each forward adds its chunk's
    bytes per micro-batch until that micro-batch's backward on the chunk frees them. With
    uniform chunks of L / (p v) layers this is Korthikanti et al.'s count (2022, Sec. 4.2.3):
    1F1B keeps p - s micro-batches on stage s (the first stage: p x L / p = L layers' worth),
    interleaved 1F1B on the first stage (p - 1) 2 + (v - 1) p + 1 chunks, L (1 + (p - 1) /
    (p v)) layers' worth."""
    release = releases(order)
    live = peak = 0.0
    for w in order:
        b = chunks[w.chunk].activation_bytes
        if w.kind == FORWARD:
            live += b
        elif w.kind == release:
            live -= b
        peak = max(peak, live)
    return peak
