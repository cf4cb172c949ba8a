"""Context parallelism's token order and the causal work of sequence chunks.

A causal attention op whose queries are split c ways along the sequence (`length`) does
unequal work per chunk when the chunks are contiguous: chunk l of c attends to l whole
blocks and half of its own, (2 l + 1) / c times the mean. Megatron-LM and the Llama 3 paper
(Sec. 3.3.2) balance it: the sequence is cut in 2 c half-chunks and rank i holds halves i
and 2 c - 1 - i, so every rank does the same work. `CostOptions.cp_order` says which order
a plan is for:

- "balanced" (the default): the runtime permutes every sequence into that order before the
  first op (tokens and targets: `sequence_positions`) and attention masks and rotates by
  the tokens' true positions (`planner.graph.attention.attention_math`); a task's attention
  costs the mean share. Only where 2 c divides the sequence; otherwise contiguous.
- "contiguous": the chunks in order, each priced with its own share (`chunk_work`).

The runtime takes one order for the whole graph: that of c = the least common multiple of
the causal attention ops' length degrees (a degree that divides c is balanced by it too:
its chunks are unions of c's balanced ones).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from planner.costs.config import ParallelConfig
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import LENGTH

__all__ = [
    "CP_EXCHANGES",
    "CP_ORDERS",
    "balanced_positions",
    "chunk_work",
    "order_degree",
    "permutable",
    "sequence_positions",
    "task_work",
]

CP_ORDERS = ("balanced", "contiguous")
CP_EXCHANGES = ("all-gather", "ring")

# op kinds whose output at a position reads only that position of their inputs (attention
# aside): a graph of only these may run with its sequence permuted
_POSITIONWISE = frozenset({"input", "linear", "embedding", "norm", "elementwise", "softmax"})


def balanced_positions(seq: int, c: int) -> np.ndarray:
    """The token position at each place of the balanced order of `seq` tokens in `c` chunks:
    chunk i holds halves i and 2 c - 1 - i of 2 c (Megatron-LM's `get_batch_on_this_cp_rank`
    order). Identity for c = 1."""
    if c <= 1:
        return np.arange(seq)
    if seq % (2 * c):
        raise ValueError(f"a balanced order of {seq} tokens needs 2 x {c} to divide them")
    halves = np.arange(seq).reshape(2 * c, seq // (2 * c))
    order = [j for i in range(c) for j in (i, 2 * c - 1 - i)]
    return halves[order].reshape(-1)


def _causal_chunks(op: Op, cfg: ParallelConfig) -> int:
    """The length degree of a causal attention op's config (1 otherwise)."""
    if op.kind != "attention" or not op.attr("causal", False) or LENGTH not in op.output.dims:
        return 1
    return cfg.degrees[op.output.dims.index(LENGTH)]


def chunk_work(seq: int, c: int, order: str) -> np.ndarray:
    """Each of c chunks' share of a causal attention's work, over the mean (c values, mean
    1): (2 l + 1) / c for contiguous chunks, 1 for the balanced order (when 2 c divides the
    sequence; else contiguous)."""
    if order == "balanced" and seq % (2 * c) == 0:
        return np.ones(c)
    return (2.0 * np.arange(c) + 1.0) / c


def task_work(op: Op, cfg: ParallelConfig, order: str) -> np.ndarray | None:
    """Each task's share of the op's work over the mean, by its sequence chunk, for a
    causal attention op whose config splits its length (tasks row-major over the degrees);
    None for every other op and when every chunk does the mean."""
    c = _causal_chunks(op, cfg)
    if c <= 1:
        return None
    work = chunk_work(op.output.size(LENGTH), c, order)
    if np.all(work == 1.0):
        return None
    axis = op.output.dims.index(LENGTH)
    inner = math.prod(cfg.degrees[axis + 1 :])
    chunk = (np.arange(cfg.num_tasks) // inner) % c
    return work[chunk]


def order_degree(graph: OpGraph, configs: Sequence[ParallelConfig | None]) -> int:
    """The c of the balanced order a strategy runs in: the least common multiple of its
    causal attention ops' length degrees whose double divides the sequence, when 2 c divides
    it too; 1 (no permutation) otherwise or when an op other than attention reads across
    positions (a convolution or recurrence along the sequence, a slice or concat of it)."""
    degrees = set()
    for op, cfg in zip(graph.ops, configs, strict=True):
        if cfg is None:
            continue
        c = _causal_chunks(op, cfg)
        if c > 1 and op.output.size(LENGTH) % (2 * c) == 0:
            degrees.add((c, op.output.size(LENGTH)))
    if not degrees or not permutable(graph):
        return 1
    c = math.lcm(*(d for d, _ in degrees))
    return c if all(seq % (2 * c) == 0 for _, seq in degrees) else 1


def permutable(graph: OpGraph) -> bool:
    """Whether the graph computes the same with its sequence permuted (positions aside):
    one sequence length, and no op but attention reads across positions."""
    seqs = {op.output.size(LENGTH) for op in graph.ops if LENGTH in op.output.dims}
    if len(seqs) != 1:
        return False
    for op in graph.ops:
        if LENGTH not in op.output.dims or op.kind in _POSITIONWISE or op.kind == "attention":
            continue
        if op.kind in ("slice", "concat") and op.attr("dim") != LENGTH:
            continue
        return False
    return True


def sequence_positions(
    graph: OpGraph, configs: Sequence[ParallelConfig | None], order: str
) -> np.ndarray | None:
    """The token position at each place of the sequence as the runtime lays it out, or None
    for the identity (contiguous order, or nothing to balance: `order_degree`)."""
    if order != "balanced":
        return None
    c = order_degree(graph, configs)
    if c == 1:
        return None
    seq = next(op.output.size(LENGTH) for op in graph.ops if LENGTH in op.output.dims)
    return balanced_positions(seq, c)
