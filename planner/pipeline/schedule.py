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

`schedule(name, p, m, v)` returns the orders; `planner.pipeline.timeline` times them.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import LayerwiseError, given

SCHEDULES = ("gpipe", "1f1b", "interleaved")
FORWARD, BACKWARD = "F", "B"


class ScheduleError(LayerwiseError):
    """A schedule that cannot be built: an unknown name, or counts it does not accept."""


@dataclass(frozen=True, order=True)
class Work:
    """The forward ("F") or backward ("B") pass of micro-batch `micro` through chunk `chunk`."""

    kind: str
    micro: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def check_schedule(name: str, groups: int, micro_batches: int, virtual: int = 1) -> None:
    """One-line errors for a schedule's name and counts, before any work."""
    if name not in SCHEDULES:
        raise ScheduleError(
            f"unknown pipeline schedule {given(name)}: expected one of {', '.join(SCHEDULES)}"
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
    return tuple(_interleaved(s, p, m, v) for s in range(p))


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


def bubble_fraction(name: str, groups: int, micro_batches: int, virtual: int = 1) -> float:
    """The closed form of the idle share of a step on uniform stages with free transfers:
    (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) interleaved
    (Narayanan et al. SC'21 Sec. 2.2: the bubble (p - 1) / m of the ideal time, v-fold less
    interleaved)."""
    check_schedule(name, groups, micro_batches, virtual)
    p, m, v = groups, micro_batches, virtual
    return (p - 1) / (v * m + p - 1)


def in_flight(order: tuple[Work, ...]) -> int:
    """The most micro-batch chunks whose forward has run and backward has not, at once, in
    one group's order: the activations it must keep (GPipe: m; 1F1B: p - s)."""
    live = peak = 0
    for w in order:
        live += 1 if w.kind == FORWARD else -1
        peak = max(peak, live)
    return peak
