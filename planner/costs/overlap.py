"""Communication overlap per kind: how much of each collective runs under compute.

Frameworks hide communication behind computation by choice, and each kind differently
(docs/cost_model.md, "Communication overlap"). `CostOptions` carries one fraction per kind,
each in [0, 1]; the simulator (`planner.sim.simulator`), the pipeline timeline
(`planner.pipeline.timeline`) and the pipeline search's per-block estimates
(`backends.pipeline.units`) read them:

- `dp_overlap`, data-parallel gradient reduction: that fraction of every op's gradient sync
  starts as soon as the op's backward is done (PyTorch DDP's buckets, Megatron-Core's
  `--overlap-grad-reduce`), running under the rest of the backward pass; the rest waits for
  the end of the backward pass (Megatron-LM without the flag reduces after it).
- `param_gather_overlap`, ZeRO's parameter all-gathers: that fraction of them runs under
  compute that does not need the parameters yet (Megatron-Core's `--overlap-param-gather`:
  the all-gather after the optimizer step under the next step's forward; FSDP's prefetch:
  the gathers before the forward and the backward under the op before), so it leaves the
  step; one all-gather pass of ZeRO 1-2, two of ZeRO 3.
- `tp_overlap`, tensor-parallel (and every other activation) transfers into or out of a
  linear op: that fraction runs under the linear's GEMM (Transformer Engine's userbuffers,
  Megatron-Core's `--tp-comm-overlap`: the all-gather before a column-parallel linear and
  the reduce-scatter after a row-parallel one split into chunks pipelined with the GEMM's
  chunks), but never more than the GEMM lasts: `exposed_seconds`.
- `pp_overlap`, pipeline point-to-point messages: that fraction travels while the sender
  goes on computing (Megatron-Core's `--overlap-p2p-communication`, asynchronous sends);
  the rest blocks the sender, as a blocking send does.
- `cp_overlap`, context parallelism's key/value exchange: that fraction of the keys and
  values an attention op whose sequence is split receives (and of their gradients it sends
  back) runs under its own kernels, never more than they last (`exposed_seconds`).
  Megatron-Core's context parallelism is Transformer Engine's ring attention
  (`AttnFuncWithCPAndKVP2P`, `--cp-comm-type p2p`, the default): each step's attention
  block runs while the next block's keys and values travel, so it overlaps by design (1).
  An all-gather form gathers them before the kernel: the Llama 3 paper's ("the all-gather
  communication latency is exposed in the critical path", Sec. 3.3.2): 0.
- `ep_overlap`, expert parallelism's all-to-alls (a mixture of experts' token dispatch and
  combine, `planner.costs.experts`): that fraction runs under the moe op's own compute,
  never more than it lasts (`exposed_seconds`). Megatron-Core's alltoall dispatcher blocks
  on them by default (`--overlap-moe-expert-parallel-comm`, Megatron-Bridge's
  `overlap_moe_expert_parallel_comm`, is off by default): 0. DeepSeek-V3's DualPipe
  (DeepSeek-AI 2024, Sec. 3.2.1) runs one micro-batch's dispatch and combine under another
  micro-batch's compute and reports the all-to-all "almost fully hidden": close to 1.

`FRAMEWORK_OVERLAP` gives the settings of the frameworks; the defaults of `CostOptions` are
PyTorch's ("pytorch": the runtime's DDP-style sync overlaps the backward pass, nothing else is
hidden but the pipeline's asynchronous sends).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

__all__ = ["FRAMEWORK_OVERLAP", "OVERLAP_FIELDS", "Overlap", "exposed_seconds"]

OVERLAP_FIELDS = (
    "dp_overlap",
    "param_gather_overlap",
    "tp_overlap",
    "pp_overlap",
    "cp_overlap",
    "ep_overlap",
)


@dataclass(frozen=True)
class Overlap:
    """One framework's overlap fractions, by the `CostOptions` fields they set."""

    dp_overlap: float
    param_gather_overlap: float
    tp_overlap: float
    pp_overlap: float
    cp_overlap: float
    ep_overlap: float = 0.0

    def options(self) -> dict[str, float]:
        """The fractions as `CostOptions` keyword arguments."""
        return asdict(self)


FRAMEWORK_OVERLAP: Mapping[str, Overlap] = {
    # PyTorch DDP all-reduces gradient buckets as the backward produces them; nothing else
    # is overlapped (the runtime's own execution, and the defaults of CostOptions).
    "pytorch": Overlap(1.0, 0.0, 0.0, 1.0, 0.0),
    # Megatron-LM's argument defaults (megatron/training/arguments.py): --overlap-grad-reduce,
    # --overlap-param-gather and --tp-comm-overlap off; --overlap-p2p-communication on;
    # context parallelism by Transformer Engine's ring attention (--cp-comm-type p2p).
    "megatron": Overlap(0.0, 0.0, 0.0, 1.0, 1.0),
    # NeMo / Megatron-Bridge performance recipes on H100 (the runs of their performance
    # summaries): the distributed optimizer with overlap_grad_reduce and
    # overlap_param_gather, tp_comm_overlap with userbuffers when TP > 1, overlapped p2p,
    # ring attention for context parallelism. Expert parallelism's all-to-alls are left
    # blocking in all three (ep_overlap 0: the flag that overlaps them is off by default;
    # whether a recipe turns it on was not checked).
    "megatron-recipe": Overlap(1.0, 1.0, 1.0, 1.0, 1.0),
}


def exposed_seconds(transfer: float, partner: float, overlap: float) -> float:
    """The seconds of a `transfer` left on the critical path when `overlap` of it may run
    under `partner` seconds of compute: max((1 - overlap) x transfer, transfer - partner),
    at least 0. Full overlap of a transfer no longer than its partner hides it."""
    return max(0.0, (1.0 - overlap) * transfer, transfer - partner)
