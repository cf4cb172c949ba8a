"""A stage layout's candidates: every schedule, chunks per stage and blocks per stage, each
estimated in closed form from the layout's units (`backends.pipeline.units.Units`).

For p stages of t x d devices, b samples per replica per micro-batch (m micro-batches),
recomputation and ZeRO fixed, a candidate adds the schedule ("gpipe", "1f1b", "interleaved"
with v chunks per stage) and the blocks of each chunk. Its `estimate` of the step:

- one chunk per stage: fill and drain through every stage plus (m - 1) x the busiest
  stage's work per micro-batch (Narayanan et al., SC'21, Sec. 2.2.1: the bubble is p - 1
  micro-batch times on uniform stages), plus the messages and the sync left at the end;
- interleaved: m x the busiest stage's work plus the other stages' work per micro-batch
  over v ((p - 1) / v of the busiest on equal stages: Sec. 2.2.2, the bubble shrinks
  v-fold), plus the messages and the sync left at the end;
- the sync left at the end is what a stage's chunks' syncs run past its last backward, as
  the pipeline's timeline runs them (`planner.pipeline.timeline.simulate_pipeline`: one at
  a time, each after its chunk's last backward, in the order those end), the largest over
  the stages (`sync_tail`): one chunk's sync per stage, or interleaved the last chunk's and
  whatever the earlier ones' did not finish under the backwards after them.

Its `peak` per device: each stage's fixed bytes plus its kept activations times the
micro-batches its schedule keeps in flight (`in_flight_counts`).

Blocks per chunk (`splits`): the first chunk (which also holds the embeddings) and the last
(the final norm, the head and the loss) take their counts around the point where the
chunks' work balances, and the chunks between share the rest evenly (interleaved: equal
chunks too, when they divide the blocks). A head of a 128k vocabulary weighs several blocks, so the last stage's count
is centred that many blocks below the others' (what Megatron-LM's
`--decoder-first-pipeline-num-layers` and `--decoder-last-pipeline-num-layers` set by hand).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from backends.pipeline.units import Units
from planner.pipeline.problem import Layout
from planner.pipeline.timeline import ChunkTimes

__all__ = [
    "SPLIT_WINDOW",
    "Candidate",
    "balance",
    "candidates",
    "in_flight_counts",
    "splits",
    "sync_tail",
]

SPLIT_WINDOW = 3  # blocks either side of the balance point the first and last stages try

Flights = dict[tuple[str, int, int, int], tuple[int, ...]]


@dataclass(frozen=True)
class Candidate:
    """A point of the space, estimated in closed form: its step and its peak bytes per
    device."""

    estimate: float
    layout: Layout
    peak: float


def candidates(
    u: Units,
    layout: tuple[int, int, int, int, int, str, int, str],
    blocks: int,
    schedules: Sequence[str],
    flights: Flights,
    context: int = 1,
    expert: int = 1,
) -> list[Candidate]:
    """Every candidate of a stage layout `(p, t, d, b, m, recompute, zero, rule)` at context
    degree `context` and expert degree `expert` whose units are `u`, on a model of `blocks`
    blocks; `flights` caches the schedules' in-flight counts."""
    p, t, d, b, m, rc, z, rule = layout
    composed: dict[tuple[bool, bool, int, int], ChunkTimes] = {}
    out = []
    for name in schedules:
        for v in virtuals(name, p, m, blocks):
            count = p * v
            key = (name, p, m, v)
            if key not in flights:
                flights[key] = in_flight_counts(name, p, m, v)
            for split in splits(blocks, p, v, u):
                chunks = []
                start = 0
                for c, k in enumerate(split):
                    # all a chunk's composition reads (its first block too, kinds mixed)
                    where = (c == 0, c == count - 1, k, start if u.mixed else 0)
                    if where not in composed:
                        composed[where] = u.chunk(c, count, k, start)
                    chunks.append(composed[where])
                    start += k
                estimate, peak = _score(chunks, p, v, m, u, flights[key])
                layout_ = Layout(p, t, d, b, m, name, v, rc, z, tuple(split), rule, context, expert)
                out.append(Candidate(estimate, layout_, peak))
    return out


def _score(
    chunks: list[ChunkTimes], p: int, v: int, m: int, u: Units, flight: tuple[int, ...]
) -> tuple[float, float]:
    """(estimate, peak) of chunks c on stage c % p (the module's docstring)."""
    work = [0.0] * p
    fixed = [0.0] * p
    kept = [0.0] * p
    for c, ch in enumerate(chunks):
        s = c % p
        work[s] += ch.forward + ch.backward
        fixed[s] += ch.fixed_bytes
        kept[s] = max(kept[s], ch.activation_bytes)
    peak = max(f + k * a for f, k, a in zip(fixed, kept, flight, strict=True))
    busiest = max(work)
    messages = 2 * (p * v - 1) * u.message
    tail = max(sync_tail(chunks[s::p], p, u.grad_overlap) for s in range(p))
    # the busiest stage's m micro-batches, and the others' work it waits for in the fill
    # and drain, v-fold less interleaved: (p - 1) / v of it on equal stages (SC'21 Sec.
    # 2.2.2); one chunk per stage, (m - 1) x busiest + sum(work) (Sec. 2.2.1)
    estimate = m * busiest + (sum(work) - busiest) / v + messages + tail
    return estimate, peak


def sync_tail(mine: Sequence[ChunkTimes], p: int, overlap: float = 1.0) -> float:
    """Seconds a stage's chunk syncs run past its last backward, its chunks `mine` in local
    order (chunk j: the stage's j-th), as the pipeline's timeline runs them: one at a time,
    `overlap` (`CostOptions.chunk_sync_share`) of each ready at its chunk's last backward, the
    rest at the stage's last, in the order they are ready. The backward runs a stage's
    chunks in reverse, and in the last round each chunk's p micro-batches in turn
    (`planner.pipeline.schedule`), so chunk j's last backward ends at least p x chunk
    j - 1's backward before chunk j - 1's; at those gaps (no waiting: the longest tail) the
    overlapped share of chunk j's sync runs under the backwards of the chunks before it.
    One chunk, or no overlap: the syncs added."""
    ends = [0.0]  # when chunk j's last backward ends, relative to the stage's last (chunk 0's)
    for ch in mine[:-1]:
        ends.append(ends[-1] - p * ch.backward)
    parts = [(ends[j], j, overlap * ch.sync) for j, ch in enumerate(mine)]
    if overlap < 1:
        parts += [(0.0, j, (1.0 - overlap) * ch.sync) for j, ch in enumerate(mine)]
    free = -math.inf
    for ready, _, seconds in sorted(parts):
        free = max(free, ready) + seconds
    return max(0.0, free)


def in_flight_counts(name: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """Per stage, the most micro-batch chunks whose activations it keeps at once under
    schedule `name` (`planner.pipeline.schedule.in_flight` of its order, in closed form: the
    orders of 1,000 micro-batches take milliseconds to build): GPipe m; 1F1B min(p - s, m),
    its warm-up forwards and one more (Narayanan et al. 2021, Fig. 3); interleaved the
    same over its (p - s - 1) 2 + (v - 1) p warm-up forwards of m v (Megatron-LM's)."""
    if name == "gpipe":
        return (m,) * p
    if name == "1f1b":
        return tuple(min(p - s, m) for s in range(p))
    total = m * v
    return tuple(min((p - s - 1) * 2 + (v - 1) * p + 1, total) for s in range(p))


def virtuals(name: str, p: int, m: int, blocks: int) -> list[int]:
    """The chunks per stage schedule `name` takes: 1 for GPipe (more than one stage) and
    1F1B; interleaved (m a multiple of p, as Megatron-LM's interleaved schedule requires),
    every v >= 2 that cuts the blocks into p x v equal chunks, or, when none does (126
    blocks on 4, 8 or 16 stages), every v that gives each chunk a block at least, its
    chunks uneven (`splits`). Uneven chunks where equal ones exist add many candidates whose
    closed form is less exact, and cost the search its time: on the 48-layer GPT of
    docs/pipeline.md it stopped at the limit with a layout 5% slower than it found without
    them in 25 s."""
    if name != "interleaved":
        return [1] if name == "1f1b" or p > 1 else []
    if p == 1 or m % p:
        return []
    every = list(range(2, blocks // p + 1))
    equal = [v for v in every if blocks % (p * v) == 0]
    return equal or every


def splits(blocks: int, p: int, v: int, u: Units) -> list[list[int]]:
    """Blocks per chunk (p x v chunks, chunk c on stage c % p): the first chunk (which also
    holds the embeddings) and the last (the final norm, the head and the loss) within
    `SPLIT_WINDOW` blocks of their balance points (`balance`; one block when interleaved,
    whose chunks are small), the chunks between sharing the rest evenly (the earlier ones
    one more when it does not divide: with v > 1 those are on different stages while the
    remainder is below p); interleaved, equal chunks when they divide the blocks.
    Llama 3 405B's 126 layers on 16 stages are 7 or 8 per stage, or with v = 7 one or two
    per chunk, the first and last chunks one."""
    count = p * v
    if count == 1:
        return [[blocks]]
    if v > 1 and blocks % count == 0:
        return [[blocks // count] * count]
    centre_first, centre_last = balance(blocks, count, u)
    window = SPLIT_WINDOW if v == 1 else 1
    out: list[list[int]] = []
    for first in _around(centre_first, blocks, window):
        for last in _around(centre_last, blocks, window):
            rest = blocks - first - last
            if count == 2:
                if rest == 0:
                    out.append([first, last])
                continue
            if rest < count - 2:
                continue
            q, r = divmod(rest, count - 2)
            split = [first, *(q + (1 if k < r else 0) for k in range(count - 2)), last]
            if split not in out:
                out.append(split)
    return out


def balance(blocks: int, p: int, u: Units) -> tuple[int, int]:
    """The blocks of the first and the last stage that equal the others' work per
    micro-batch: with the embeddings weighing e_f mean blocks' work beside block 0 and the
    head and loss e_l beside the last block, each of p stages does T = (blocks + e_f + e_l)
    / p mean blocks' work; the first holds the blocks from the start whose work with e_f
    comes nearest T, the last those from the end with e_l (at least 1). Blocks of two
    kinds (`Units.kinds`) weigh their own kind's middle unit: DeepSeek-V3's dense blocks
    and MoE blocks differ in work."""
    work = [_work(u.block(j)) for j in range(blocks)]
    mean = sum(work) / blocks
    if mean <= 0:
        return blocks // p, blocks // p
    extra_first = (_work(u.first) - work[0]) / mean
    extra_last = (_work(u.last) - work[-1]) / mean
    share = (blocks + extra_first + extra_last) / p
    if not u.mixed:  # alike blocks: counts, rounded
        return max(1, round(share - extra_first)), max(1, round(share - extra_last))
    share *= mean
    return (
        _nearest(work, share - extra_first * mean),
        _nearest(work[::-1], share - extra_last * mean),
    )


def _work(unit: Any) -> float:
    return float(unit.forward + unit.backward)


def _nearest(work: list[float], target: float) -> int:
    """The count of blocks from the start of `work` whose sum comes nearest `target` (at
    least 1; alike blocks: target / work rounded)."""
    total, best, gap = 0.0, 1, math.inf
    for k, w in enumerate(work, start=1):
        total += w
        if abs(total - target) < gap - 1e-12:
            best, gap = k, abs(total - target)
        elif total > target:
            break
    return best


def _around(centre: int, blocks: int, window: int = SPLIT_WINDOW) -> range:
    return range(max(1, centre - window), min(blocks, centre + window) + 1)
