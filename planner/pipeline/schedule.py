"""Pipeline schedules: the order in which each group of devices runs its micro-batches'
forward and backward passes.

A pipeline cuts the model into `p * v` chunks, contiguous in a topological order; chunk c
runs on device group `c % p` (v > 1: each group holds v chunks, Megatron-LM's interleaved
schedule, Narayanan et al. SC'21 Sec. 2.2.2). Every micro-batch runs through the chunks in
order forward, then back in reverse. A schedule fixes, per group, the order of its
works (forward or backward of one micro-batch on one chunk):

- "gpipe" (Huang et al. 2019): every micro-batch's forward, then every backward. A group
  keeps the activations of all m micro-batches at once.
- "1f1b" (PipeDream-Flush, Narayanan et al. 2021, Fig. 3): group s runs `p - s - 1` warm-up
  forwards, then alternates one forward and one backward, then drains the backwards. Its
  bubble is GPipe's, (p - 1) / (m + p - 1) of the step on uniform stages, but a group keeps
  at most `p - s` micro-batches' activations.
- "interleaved" (Megatron-LM, Fig. 4): 1F1B over v chunks per group, micro-batches in rounds
  of p; the bubble shrinks v-fold, to (p - 1) / (v m + p - 1), at v times the point-to-point
  messages. Needs m divisible by p.
- "dualpipe" (DeepSeek-V3, arXiv 2412.19437, Sec. 3.2.1, Fig. 5): p even, the model cut into
  p stages (chunks), group g holding stage g and stage p - 1 - g (two copies of the
  parameters). Micro-batches come from both ends: the first m / 2 run stages 0..p-1 on
  groups 0..p-1, the other m / 2 on groups p-1..0 (`group_of`). A forward of one
  direction runs overlapped with a backward of the other (`Work.joined`: one unit whose
  communication hides under its computation, the computation itself serial), and the
  backward splits into input gradient ("B") and weight gradient ("W", Qi et al. 2023's zero
  bubble): deferred Ws fill the drain. Its bubble is (p / 2 - 1)(F&B + B - 3W) (Table 2)
  against 1F1B's (p - 1)(F + B); a group keeps at most p + 1 micro-batches' activations.
  Needs m even and m >= 2p (DualPipe's reference implementation asserts the same).

`schedule(name, p, m, v)` returns the orders; `planner.pipeline.timeline` times them. The
timeline and the runtime run the first three; "dualpipe" is timed only (the pipeline search
does not choose it, the runtime and the exports refuse it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.errors import LayerwiseError, given

SCHEDULES = ("gpipe", "1f1b", "interleaved")  # what the pipeline search tries, the runtime runs
DUALPIPE = "dualpipe"  # timed by `planner.pipeline.timeline` only
KNOWN = (*SCHEDULES, DUALPIPE)
# a forward, a backward (with "W" in the schedule: its input gradient only), a weight gradient
FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


class ScheduleError(LayerwiseError):
    """A schedule that cannot be built: an unknown name, or counts it does not accept."""


@dataclass(frozen=True, order=True)
class Work:
    """The forward ("F"), backward ("B") or weight-gradient ("W") pass of micro-batch `micro`
    through chunk `chunk`. `joined`: the group runs it and the work after it in its order as
    one unit (DualPipe's overlapped forward and backward; a backward with its weight
    gradient): the unit starts when all its inputs are there, and its messages leave when it
    ends. Not part of a work's identity."""

    kind: str
    micro: int
    chunk: int
    joined: bool = field(default=False, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def check_schedule(name: str, groups: int, micro_batches: int, virtual: int = 1) -> None:
    """One-line errors for a schedule's name and counts, before any work."""
    if name not in KNOWN:
        raise ScheduleError(
            f"unknown pipeline schedule {given(name)}: expected one of {', '.join(KNOWN)}"
        )
    for what, value in (("stages", groups), ("micro-batches", micro_batches), ("chunks per stage", virtual)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(
                f"a pipeline needs a whole number of {what} >= 1, got {given(value)}"
            )
    if virtual > 1 and name != "interleaved":
        raise ScheduleError(
            f"{virtual} chunks per stage need the 'interleaved' schedule, not {name!r}"
        )
    if name == "interleaved" and micro_batches % groups:
        raise ScheduleError(
            f"the interleaved schedule runs micro-batches in rounds of the {groups} stages: "
            f"{micro_batches} micro-batches is not a multiple of {groups}"
        )
    if name == DUALPIPE and groups % 2:
        raise ScheduleError(
            f"dualpipe pairs stage s with stage p - 1 - s on one group: it needs an even "
            f"number of stages, got {groups}"
        )
    if name == DUALPIPE and (micro_batches % 2 or micro_batches < 2 * groups):
        raise ScheduleError(
            f"dualpipe feeds half the micro-batches from each end of the pipeline, at least "
            f"one per stage: it needs an even number >= 2 x {groups} stages = {2 * groups}, "
            f"got {micro_batches}"
        )


def schedule(
    name: str, groups: int, micro_batches: int, virtual: int = 1
) -> tuple[tuple[Work, ...], ...]:
    """Per device group 0..groups-1, the works it runs, in order. Chunk c is on group
    c % groups; "gpipe" and "1f1b" take virtual 1 (one chunk per group, chunk = group)."""
    check_schedule(name, groups, micro_batches, virtual)
    p, m, v = groups, micro_batches, virtual
    if name == "gpipe":
        return tuple(
            tuple(Work(FORWARD, i, s) for i in range(m))
            + tuple(Work(BACKWARD, i, s) for i in range(m))
            for s in range(p)
        )
    if name == "1f1b":
        return tuple(_one_f_one_b(s, p, m) for s in range(p))
    if name == DUALPIPE:
        return tuple(_dualpipe(g, p, m) for g in range(p))
    return tuple(_interleaved(s, p, m, v) for s in range(p))


def group_of(name: str, groups: int, micro_batches: int, work: Work) -> int:
    """The group that runs `work`: chunk c's on group c % p; with "dualpipe" micro-batches
    0..m/2-1 run chunk c on group c, the others on group p - 1 - c."""
    if name == DUALPIPE and work.micro >= micro_batches // 2:
        return groups - 1 - work.chunk
    return work.chunk % groups


def held(name: str, groups: int, chunks: int, group: int) -> tuple[int, ...]:
    """The chunks whose parameters `group` holds: c = group, group + p, ...; with "dualpipe"
    stage `group` and stage p - 1 - `group` (two copies of the model on the pipeline)."""
    if name == DUALPIPE:
        return (group, groups - 1 - group)
    return tuple(range(group, chunks, groups))


def _one_f_one_b(s: int, p: int, m: int) -> tuple[Work, ...]:
    warm = min(p - s - 1, m)
    order = [Work(FORWARD, i, s) for i in range(warm)]
    for i in range(m - warm):  # steady state: one forward, one backward
        order += [Work(FORWARD, warm + i, s), Work(BACKWARD, i, s)]
    order += [Work(BACKWARD, i, s) for i in range(m - warm, m)]
    return tuple(order)


def _interleaved(s: int, p: int, m: int, v: int) -> tuple[Work, ...]:
    """Megatron-LM's interleaved 1F1B on group s: the k-th forward step runs micro-batch
    (k // (p v)) p + k % p on local chunk (k // p) % v, the k-th backward step the same
    micro-batch on local chunk v - 1 - (k // p) % v; `(p - s - 1) * 2 + (v - 1) * p` warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards."""
    total = m * v

    def step(k: int, forward: bool) -> Work:
        local = (k // p) % v
        micro = (k // (p * v)) * p + k % p
        if forward:
            return Work(FORWARD, micro, local * p + s)
        return Work(BACKWARD, micro, (v - 1 - local) * p + s)

    warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [step(k, True) for k in range(warm)]
    for k in range(total - warm):
        order += [step(warm + k, True), step(k, False)]
    order += [step(k, False) for k in range(total - warm, total)]
    return tuple(order)


def _dualpipe(g: int, p: int, m: int) -> tuple[Work, ...]:
    """DualPipe on group g (DeepSeek-V3 Fig. 5, in the eight steps of its reference
    implementation, deepseek-ai/DualPipe). The group is h = min(g, p - 1 - g) stages from its end of the pipeline:
    the "near" direction (g < p / 2: the micro-batches fed at group 0) runs stage h on it, the
    "far" one stage p - 1 - h; with P = p / 2 and n = m / 2 micro-batches per direction:

    1. 2 (P - h - 1) near forwards;
    2. h + 1 times a near forward, a far forward;
    3. P - h - 1 times a far backward (input gradient only), its weight gradient, a far
       forward;
    4. n - p + h + 1 times a near forward overlapped with a far backward, then a far forward
       overlapped with a near backward (the middle groups, h = P - 1, run the first near
       forward and far backward one after the other: it shortens their bubble);
    5. P - h - 1 times a far backward, a far forward overlapped with a near backward;
    6. h + 1 times a far backward, a near backward; the last h + 1 of these 2 (h + 1) leave
       their weight gradients for later (zero bubble);
    7. P - h - 1 times a deferred weight gradient, a near backward leaving its own;
    8. the h + 1 deferred weight gradients left.

    A backward whose weight gradient is not left for later runs joined with it, as one
    kernel (its input gradient leaves with it)."""
    half, n = p // 2, m // 2
    h = min(g, p - 1 - g)
    near, far = 0, 1
    chunk = (h, p - 1 - h)
    first = (0, n) if g < half else (n, 0)  # near, far directions' first micro-batch
    forwards, backwards = [0, 0], [0, 0]
    deferred: deque[Work] = deque()
    order: list[Work] = []

    def forward(d: int, joined: bool = False) -> None:
        order.append(Work(FORWARD, first[d] + forwards[d], chunk[d], joined))
        forwards[d] += 1

    def backward(d: int, later: bool = False) -> None:
        micro = first[d] + backwards[d]
        backwards[d] += 1
        if later:  # its weight gradient waits in line
            order.append(Work(BACKWARD, micro, chunk[d]))
            deferred.append(Work(WEIGHT, micro, chunk[d]))
        else:  # one kernel with its weight gradient
            order.extend((Work(BACKWARD, micro, chunk[d], True), Work(WEIGHT, micro, chunk[d])))

    def weight() -> None:
        order.append(deferred.popleft())

    for _ in range(2 * (half - h - 1)):  # 1
        forward(near)
    for _ in range(h + 1):  # 2
        forward(near)
        forward(far)
    for _ in range(half - h - 1):  # 3
        backward(far, later=True)
        weight()
        forward(far)
    for i in range(n - p + h + 1):  # 4
        if i == 0 and h == half - 1:
            forward(near)
            backward(far)
        else:
            forward(near, joined=True)
            backward(far)
        forward(far, joined=True)
        backward(near)
    for _ in range(half - h - 1):  # 5
        backward(far)
        forward(far, joined=True)
        backward(near)
    later = False
    for i in range(h + 1):  # 6: the last h + 1 backwards leave their weight gradients
        later = later or (i == (h + 1) // 2 and h % 2 == 1)
        backward(far, later)
        later = later or (i == (h + 1) // 2 and h % 2 == 0)
        backward(near, later)
    for _ in range(half - h - 1):  # 7
        weight()
        backward(near, later=True)
    while deferred:  # 8
        weight()
    return tuple(order)


def bubble_fraction(
    name: str,
    groups: int,
    micro_batches: int,
    virtual: int = 1,
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    weight_share: float = 0.5,
) -> float:
    """The closed form of the idle share of a step on uniform stages with free transfers:
    (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) interleaved
    (Narayanan et al. SC'21 Sec. 2.2: the bubble (p - 1) / m of the ideal time, v-fold less
    interleaved). DualPipe's depends on a chunk's `forward`, `backward` and the backward's
    weight-gradient share (`dualpipe_bubble`): X / (m (F + B) + X), each group busy
    m (F + B); at the defaults (F = B - W = W) (p - 2) / (3 m + p - 2)."""
    check_schedule(name, groups, micro_batches, virtual)
    p, m, v = groups, micro_batches, virtual
    if name == DUALPIPE:
        idle = dualpipe_bubble(p, forward, backward, backward * weight_share)
        return idle / (m * (forward + backward) + idle)
    return (p - 1) / (v * m + p - 1)


def dualpipe_bubble(groups: int, forward: float, backward: float, weight: float) -> float:
    """The seconds each group idles in a DualPipe step (`_dualpipe`'s order) on uniform
    stages with free transfers: a chunk's forward F, backward B of which W is the weight
    gradient, b = B - W the input gradient, P = p / 2:

        max((P - 1)(2F + b - min(W, b)),  (P - 1)(F + 2b - min(W, b)) - F)

    whatever m (>= 2p): each of the P - 1 groups from a middle one to an end lengthens the
    step by the longer of 2F + b and F + 2b (the second less one F in all), less the weight
    gradient that fills a wait (at most b of it). Read off this order's timeline and checked
    on random F, B, W, p and m by a test (tests/test_pipeline_dualpipe.py), not proved.
    DeepSeek-V3's Table 2 gives (P - 1)(F&B + B - 3W): with the overlapped
    F&B counted as F + B (the communication hides under the computation, which stays
    serial) that is (P - 1)(F + 2b - W), the form above when F = b >= W (Fig. 5's cells:
    F = b = W), and not elsewhere: longer when F > b >= W, shorter by at most F when
    F < b and W <= b."""
    p, f, b = groups, forward, backward - weight
    half, fill = p // 2, min(weight, b)
    return max((half - 1) * (2 * f + b - fill), (half - 1) * (f + 2 * b - fill) - f, 0.0)


def in_flight(order: tuple[Work, ...]) -> int:
    """The most micro-batch chunks whose forward has run and backward has not, at once, in
    one group's order: the activations it must keep (GPipe: m; 1F1B: p - s). A backward
    split in two frees them at its weight gradient, which reads the layers' inputs
    (DualPipe: at most p + 1)."""
    release = releases(order)
    live = peak = 0
    for w in order:
        live += _held(w, release)
        peak = max(peak, live)
    return peak


def releases(order: Sequence[Work]) -> str:
    """The kind of work that frees a micro-batch's activations in `order`: the weight
    gradient where the backward is split, else the backward."""
    return WEIGHT if any(w.kind == WEIGHT for w in order) else BACKWARD


def _held(w: Work, release: str) -> int:
    return 1 if w.kind == FORWARD else -1 if w.kind == release else 0
