"""Activation recomputation (gradient checkpointing): which ops recompute, and what it costs.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016), as Megatron-LM uses it
(Narayanan et al., SC'21, Sec. 3.5: "full" recomputation, one checkpoint per transformer
layer): the repeated blocks of a model (the layers of a ModuleList or Sequential, named
`transformer.h.3`, `layers.3`, `layer1.0`: the op's module path up to its first numeric part)
keep only their outputs; in the backward pass each block runs its forward again from the
kept tensors before its backward.

Per op of such a block whose output only ops of the same block read (`recomputed_ops`):
- time: one more forward pass, charged to its backward task (`CostModel.task_times`);
- memory: its output is not kept between the forward and the backward. During a block's
  backward its recomputed outputs are all live at once, so a device's peak is what the kept
  tensors take plus the largest block's recomputed outputs (`CostModel.strategy_memory`).
  The per-op memory the searches add up charges each recomputed output 1/n of its bytes,
  n the blocks that hold the same op (`RecomputeShare.share`): the sum is one block's worth,
  exact when the blocks are alike and alike placed.

The block's outputs (read by the next block or by ops outside the blocks) stay, as does every
op outside the blocks (embeddings, the head, the loss). `CostOptions.recompute`: "none" (the
default) or "full"; `planner.plan(recompute="auto")` recomputes only when the answer does not
fit otherwise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.graph.opgraph import OpGraph

__all__ = ["RECOMPUTE", "RecomputeShare", "block_of", "recomputed_ops"]

RECOMPUTE = ("none", "full")


def block_of(name: str) -> tuple[str, str] | None:
    """(block, name within it) of an op named by its module path: the block is the path up
    to its first numeric part (`transformer.h.3.attn.c_attn` -> (`transformer.h.3`,
    `attn.c_attn`)); None for an op outside any numbered block."""
    parts = name.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1]), ".".join(parts[k + 1 :])
    return None


@dataclass(frozen=True)
class RecomputeShare:
    """The ops a graph recomputes: op index -> its block, and the share of its output bytes
    the additive memory rule charges it (1 / the blocks holding the same op)."""

    block: dict[int, str]
    share: dict[int, float]

    def __contains__(self, i: int) -> bool:
        return i in self.block

    def __len__(self) -> int:
        return len(self.block)


def recomputed_ops(graph: OpGraph) -> RecomputeShare:
    """The ops of `graph`'s numbered blocks whose outputs only ops of their own block read."""
    where = {op.name: block_of(op.name) for op in graph.ops}
    readers: dict[str, list[str]] = {op.name: [] for op in graph.ops}
    for op in graph.ops:
        for name in op.inputs:
            readers[name].append(op.name)
    block: dict[int, str] = {}
    inner: dict[int, str] = {}
    for i, op in enumerate(graph.ops):
        home = where[op.name]
        if op.kind == "input" or home is None or not readers[op.name]:
            continue
        if all((w := where[r]) is not None and w[0] == home[0] for r in readers[op.name]):
            block[i], inner[i] = home
    copies = Counter(inner.values())
    return RecomputeShare(block, {i: 1.0 / copies[inner[i]] for i in block})
