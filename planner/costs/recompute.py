"""Activation recomputation (gradient checkpointing): which ops recompute, and what it costs.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016), as Megatron-LM uses it
(Narayanan et al., SC'21, Sec. 3.5: "full" recomputation, one checkpoint per transformer
layer): the repeated blocks of a model (the layers of a ModuleList or Sequential, named
`transformer.h.3`, `layers.3`, `layer1.0`: the op's module path up to its first numeric part)
keep only their outputs; in the backward pass each block runs its forward again from the
kept tensors before its backward.

Per op that recomputes (`recomputed_ops`):
- time: one more forward pass, charged to its backward task (`CostModel.task_times`), and
  its inputs from other devices received again (`CostModel.transfer_time`);
- memory: what it would keep for the backward (`planner.costs.activations`) is not kept
  between the forward and the backward; what ops that do not recompute save of it stays, and
  so do the tensors it reads from outside its region (the checkpoints). During a region's
  backward its recomputed activations are all live at once, so a device's peak is what the
  kept tensors take plus the largest region's working set (`CostModel.strategy_memory`).
  The per-op memory the searches add up charges each recomputed op 1/n of its working set,
  n the regions that hold the same op (`RecomputeShare.share`): the sum is one region's
  worth, exact when the regions are alike and alike placed.

`CostOptions.recompute`:
- "none" (the default);
- "selective": Megatron-LM's `--recompute-granularity selective` (Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", 2022, Sec. 5; Megatron-
  Core's default recompute module "core_attn"): the attention ops of the numbered blocks,
  each its own region. Written unfused, core attention keeps 5 a s^2 b bytes per layer (the
  softmax, its dropout mask and output); our attention op is FlashAttention's, which never
  keeps them, so selective frees only its logsumexp (4 bytes per row and head) for one more
  attention forward: it is a choice worth making only where memory is that tight;
- "full" (every op of every block whose output only ops of its own block read: the block's
  outputs, read by the next block or by ops outside the blocks, stay, as does every op
  outside the blocks: embeddings, the head, the loss);
- a number k of blocks (the first k in graph order, Megatron-LM's `--recompute-num-layers`:
  time for memory a block at a time).

`planner.plan(recompute="auto")` chooses (planner/api.py). Not modelled: Megatron-Core's
further recompute modules ("layernorm", "mlp", "moe_act": a norm's or the MLP's outputs
rebuilt from their inputs).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import LayerwiseError

if TYPE_CHECKING:
    from planner.graph.opgraph import OpGraph

__all__ = [
    "RECOMPUTE",
    "RECOMPUTE_AUTO",
    "RecomputeShare",
    "block_of",
    "blocks_of",
    "check_graph_options",
    "check_recompute",
    "recompute_error",
    "recomputed_ops",
    "selective_ops",
]

RECOMPUTE = ("none", "selective", "full")  # in the order recompute="auto" tries them
RECOMPUTE_AUTO = "auto"  # planner.plan chooses: none, selective, full, or k blocks
SELECTIVE_KINDS = ("attention",)  # what "selective" recomputes: Megatron's core attention


def recompute_error(mode: object) -> str | None:
    """What is wrong with a recompute mode ("none", "selective", "full" or a number of blocks
    >= 0), or None when it is valid."""
    if mode in RECOMPUTE or (isinstance(mode, int) and not isinstance(mode, bool) and mode >= 0):
        return None
    return f"recompute must be 'none', 'selective', 'full' or a number of blocks >= 0, got {mode!r}"


def check_recompute(mode: object) -> str | int:
    """`mode` when valid, else ValueError with `recompute_error`'s line."""
    error = recompute_error(mode)
    if error is not None:
        raise ValueError(error)
    return mode  # type: ignore[return-value]


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
    """The ops a graph recomputes: op index -> its region (the block, or for "selective" the
    attention op itself), and the share of its working set the additive memory rule charges
    it (1 / the regions holding the same op)."""

    block: dict[int, str]
    share: dict[int, float]

    def __contains__(self, i: int) -> bool:
        return i in self.block

    def __len__(self) -> int:
        return len(self.block)


def blocks_of(graph: OpGraph) -> list[str]:
    """The numbered blocks that hold ops that can recompute, in graph order."""
    return list(dict.fromkeys(_recomputable(graph)[0].values()))


def selective_ops(graph: OpGraph) -> list[int]:
    """The ops "selective" recomputes: the attention ops inside numbered blocks."""
    return [
        i
        for i, op in enumerate(graph.ops)
        if op.kind in SELECTIVE_KINDS and block_of(op.name) is not None
    ]


def recomputed_ops(graph: OpGraph, mode: str | int = "full") -> RecomputeShare:
    """The ops that recompute under `mode`: none; the attention ops of `graph`'s numbered
    blocks, each a region of its own ("selective"); every op of the numbered blocks whose
    output only ops of its own block read, a region per block ("full"); or those of the first
    `mode` blocks."""
    if mode == "none":
        return RecomputeShare({}, {})
    if mode == "selective":
        ops = selective_ops(graph)
        inner = {i: block_of(graph.ops[i].name)[1] for i in ops}  # type: ignore[index]
        alike = Counter(inner.values())
        return RecomputeShare(
            {i: graph.ops[i].name for i in ops}, {i: 1.0 / alike[inner[i]] for i in ops}
        )
    block, inner = _recomputable(graph)
    if not isinstance(mode, str):
        keep = set(list(dict.fromkeys(block.values()))[:mode])
        block = {i: b for i, b in block.items() if b in keep}
        inner = {i: inner[i] for i in block}
    copies = Counter(inner.values())
    return RecomputeShare(block, {i: 1.0 / copies[inner[i]] for i in block})


def _recomputable(graph: OpGraph) -> tuple[dict[int, str], dict[int, str]]:
    """Per op that can recompute: its block, and its name within the block."""
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
    return block, inner


def check_graph_options(graph: OpGraph, recompute: Any, master_weights: Any) -> None:
    """The training-memory options the caller gave that would do nothing on `graph`: a
    recomputation it has no blocks for is refused, master weights of 32-bit parameters are
    a warning (one line each)."""
    if recompute == "selective" and not selective_ops(graph):
        raise LayerwiseError(
            f"recompute='selective' recomputes nothing in {graph.name!r}: it has no attention "
            "op inside numbered blocks (a transformer's 'layers.3.attention'): leave recompute "
            "unset, or recompute whole blocks (recompute='full')"
        )
    if recompute not in (None, "none", "selective", RECOMPUTE_AUTO, 0):
        blocks = len(blocks_of(graph))
        if blocks == 0:
            raise LayerwiseError(
                f"recompute={recompute!r} recomputes nothing in {graph.name!r}: it has no "
                "numbered blocks whose activations only the block itself reads (a "
                "transformer's 'layers.3', 'transformer.h.3'): leave recompute unset"
            )
        if not isinstance(recompute, str) and recompute > blocks:
            raise LayerwiseError(
                f"recompute={recompute} blocks, but {graph.name!r} has {blocks}: give at most "
                f"{blocks} (or 'full' for all of them, 'auto' to choose)"
            )
    if master_weights is True and all(p.dtype_bytes != 2 for op in graph.ops for p in op.params):
        logging.getLogger("planner.api").warning(
            "master_weights adds nothing for %r: every parameter is 32-bit already (master "
            "weights are fp32 copies of 16-bit ones); set a 16-bit dtype, e.g. model_kwargs "
            "{'dtype': 'bfloat16'} (--set dtype=bfloat16), to plan with them",
            graph.name,
        )
