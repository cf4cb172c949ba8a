"""Training memory per parameter: weights, gradients, optimizer state, master weights, ZeRO.

The rule of ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC'20), Sec. 3.1: mixed-precision Adam keeps per parameter 2 bytes of
16-bit weights, 2 of 16-bit gradients and K = 12 bytes of fp32 optimizer state (a master
copy of the weights, momentum and variance): 16 bytes ("16 Psi"). Here the weights and the
gradients take the parameter's own dtype (`Param.dtype_bytes`), the optimizer state and the
master weights fp32:

    bytes per element = b (weights) + b (gradients) + S (optimizer state) + M (master copy)
    S = 0 ("none"), 4 ("sgd": one momentum buffer), 8 ("adam": two moments)
    M = 4 when `master_weights` and the parameter is 16-bit (b = 2), else 0

ZeRO's stages (Sec. 5.1-5.3, Fig. 1) shard over the r data-parallel replicas of a
parameter shard (the tasks that hold the same shard, a row of `CostModel.replica_array`):
stage 1 the optimizer state and master copy (S + M -> (S + M) / r), stage 2 also the
gradients, stage 3 also the weights. FSDP's SHARD_GRAD_OP is stage 2, FULL_SHARD stage 3.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from planner.graph.opgraph import Param
    from planner.hardware.devices import DeviceGraph

__all__ = [
    "DEFAULT_HEADROOM",
    "DEFAULT_RESERVE",
    "OPTIMIZER_STATE_BYTES",
    "default_reserve",
    "kept_free",
    "ParamBytes",
    "param_bytes",
    "usable_memory",
]

# fp32 bytes of optimizer state per parameter element (ZeRO Sec. 3.1: Adam's K = 12 is these
# 8 plus the 4-byte master copy).
OPTIMIZER_STATE_BYTES = {"none": 0, "sgd": 4, "adam": 8}
FP32 = 4
GiB = 2**30

# What a plan leaves free of each device by default (`planner.plan`, the CLI, the pipeline
# search; docs/cost_model.md, "Memory"): what the cost model does not count, the training
# framework's and the allocator's own.
# - DEFAULT_RESERVE, bytes on each GPU: the CUDA context with PyTorch's kernels (0.5-1 GiB
#   per process: "~700+MB depending on the CUDA version and device", PyTorch forums,
#   discuss.pytorch.org/t/high-gpu-memory-overhead/81330; less with lazy module loading),
#   NCCL's buffers (NCCL_BUFFSIZE, 4 MiB by default, per channel and peer of every
#   communicator: docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html; a Megatron-LM
#   rank holds tensor-, pipeline-, data-parallel and embedding communicators, some hundreds
#   of MiB to a GiB in all) and the cuBLAS/cuBLASLt workspaces (32 MiB per handle on Hopper
#   in PyTorch and Transformer Engine): 2 GiB.
# - DEFAULT_HEADROOM, a fraction of each device's memory: the caching allocator's
#   fragmentation (memory "reserved but unallocated", the PyTorch CUDA semantics notes on
#   `expandable_segments`, docs.pytorch.org/docs/stable/notes/cuda.html), and the transients
#   the count leaves out (an op's output before the op that reads it frees its input, the
#   activation gradients of the layer in its backward): 5%.
# On an 80 GiB GPU a plan may use 74 GiB (2 GiB + 4 GiB kept), on a 40 GiB one 36 GiB. On
# GPUs of less than 20 GiB the default reserve is a tenth of their memory (`default_reserve`).
DEFAULT_RESERVE = 2 * GiB
DEFAULT_HEADROOM = 0.05
RESERVE_SHARE_CAP = 0.1


def kept_free(
    headroom: float | None, reserve: float | None, devices: DeviceGraph
) -> tuple[float, float]:
    """A plan's headroom and reserve on `devices`: the given ones, the defaults for None."""
    return (
        DEFAULT_HEADROOM if headroom is None else headroom,
        default_reserve(devices) if reserve is None else reserve,
    )


def default_reserve(devices: DeviceGraph) -> int:
    """The reserve a plan keeps on each GPU of `devices` by default: `DEFAULT_RESERVE`, or a
    tenth of the smallest GPU's memory when that is less (16 GiB P100s keep 1.6 GiB; a toy
    device of a few MiB keeps a tenth of it, not more than it has)."""
    gpus = [float(d.memory) for d in devices.devices if d.kind == "gpu"]
    return math.floor(min([DEFAULT_RESERVE, *(RESERVE_SHARE_CAP * m for m in gpus)]))


@dataclass(frozen=True)
class ParamBytes:
    """Bytes of one op's parameters, summed over its tensors, unsharded: the weights and the
    gradients (the parameters' dtypes) and the fp32 state (optimizer state + master copy)."""

    weights: int
    gradients: int
    state: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.state

    def held(self, replicas: int, zero: int) -> float:
        """Bytes a task keeps for a whole (unsharded) op when each of its shards has
        `replicas` data-parallel copies, at ZeRO stage `zero` (0: nothing sharded). Divide by
        the op's parameter shards for one task's part."""
        r = max(1, replicas)
        return (
            (self.weights / r if zero >= 3 else self.weights)
            + (self.gradients / r if zero >= 2 else self.gradients)
            + (self.state / r if zero >= 1 else self.state)
        )

    def updated(self, replicas: int, zero: int) -> float:
        """Bytes the optimizer step reads and writes for a whole op: every byte a replica holds
        (weights, gradients, state), and with ZeRO (any stage) only its 1/r slice of each."""
        return self.total / max(1, replicas) if zero >= 1 else float(self.total)


def param_bytes(params: Iterable[Param], optimizer: str, master_weights: bool) -> ParamBytes:
    """ParamBytes of an op's parameter tensors under an optimizer (`OPTIMIZER_STATE_BYTES`)
    with or without fp32 master copies of its 16-bit tensors."""
    state = OPTIMIZER_STATE_BYTES[optimizer]
    w = s = 0
    for p in params:
        n = math.prod(p.shape)
        w += n * p.dtype_bytes
        s += n * (state + (FP32 if master_weights and p.dtype_bytes == 2 else 0))
    return ParamBytes(weights=w, gradients=w, state=s)


def usable_memory(devices: DeviceGraph, headroom: float = 0.0, reserve: float = 0.0) -> np.ndarray:
    """(D,) bytes of each device a plan may use: (1 - headroom) x its memory, less `reserve`
    bytes on each GPU (the framework's own: CUDA context, NCCL buffers, workspaces; CPU
    workers have none of them), at least 0 (`DEFAULT_HEADROOM`, `DEFAULT_RESERVE`)."""
    mem = np.array([float(d.memory) for d in devices.devices])
    if headroom:
        mem = mem * (1.0 - headroom)
    if reserve:
        gpu = np.array([d.kind == "gpu" for d in devices.devices])
        mem = np.maximum(0.0, mem - reserve * gpu)
    return mem
