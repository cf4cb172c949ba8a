"""Cost functions of OptCNN Sec. 5.1: t_c (compute), t_s (parameter sync), t_x (transfers).

- t_c(op, c): forward + backward time of the slowest task of `op` under config `c`. Analytic:
  a roofline per task, max(FLOPs / (peak * efficiency), bytes / (memory bandwidth *
  memory_efficiency)), times (1 + backward_factor), plus a fixed overhead per task. The peak
  is the device's for the op's precision (`compute_peak`: 16-bit matrix products on tensor
  cores, float64, FP32 or TF32) and the efficiency the fraction of it the op's class reaches
  (`compute_efficiency_of`: matmul, attention, or the default). Measured:
  the median time profiled on this machine for the task's shape (`planner.costs.profile`), falling
  back to analytic for shapes that were not profiled.
- t_s(op, c): synchronizing the gradients of replicated parameter shards. Parameters split
  along the op's Parameter dims; every shard is replicated on the tasks that share its
  parameter index. "ps": each replica sends its gradients to a parameter server (the first
  replica's device) and receives the parameters back (OptCNN). "ring": ring all-reduce,
  2 (r - 1) / r of the shard over the slowest ring link plus 2 (r - 1) steps' fixed costs.
  Every message also pays its endpoints' message overheads, scaled by the shard's share of a
  gradient bucket (`sync_bucket_bytes`: the runtime all-reduces gradients in buckets of that
  size, as DDP does, so a small shard pays its part of a bucket's fixed cost). Ops sharing a
  parameter group (unrolled RNN steps) each carry 1/|group| of the group's sync.
- t_x(e, c_u, c_v): the forward activations producer tasks send to consumer tasks (volume of
  the overlap of their regions, `planner.costs.regions`), serialized per receiving device, plus the
  backward gradients sent back the same way (none to the graph's input ops: data gets no
  gradient); the slowest receiver counts in each direction. Transfers between tasks on the
  same device are free. An LSTM step's state edge carries two tensors (h and c) back to back:
  one message of twice the bytes. Each message pays the route latency and the message
  overhead of both endpoint devices (`Device.message_overhead`: processor time per message of
  host-driven transports such as gloo on CPU workers; 0 for GPUs).
- Synchronized batch norm: a batch-norm op (its own or folded into a conv) whose config splits
  samples, height or width sums its per-channel statistics over the tasks that hold the same
  channels, once forward and once backward, before it can go on (`norm_exchange`): a blocking
  exchange of 2 x channels float64 sums, priced like one message each way (two ranks) or an
  all-reduce (more), and charged to t_c. FlexFlow and OptCNN do not price it.

OptCNN's objective (Eq. 1) is the sum of t_c + t_s over ops and t_x over edges
(`planner.problems.evaluate`, `Problem`); the simulator (`planner.sim.simulator`) uses the same task times.

`edge_table` and `node_table` build the cost tables for all configs and config pairs
(`planner.costs.transfer`: per hierarchy level from interval intersections on a homogeneous
cluster, task pair by task pair per partition pair elsewhere; docs/cost_model.md);
`transfer_time` is an independent, direct task-pair computation for one config pair, used to
re-score strategies and in tests.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from planner.costs.activations import ActivationMemory, activation_memory, moe_buffers
from planner.costs.config import OpConfigs, ParallelConfig
from planner.costs.context import CP_EXCHANGES, CP_ORDERS, permutable, task_work
from planner.costs.experts import (
    EP_DISPATCHES,
    a2a_bytes,
    a2a_seconds,
    cuts_experts,
    expert_gemm_seconds,
    kept_by_task,
    moe_task_flops,
    node_a2a_seconds,
    param_classes,
    spreads_experts,
    token_pass_bytes,
)
from planner.costs.fp8 import (
    FP8_BYTES,
    WEIGHT_CACHE_BYTES,
    cast_bytes,
    computes_in_fp8,
    fp8_linear,
    fp8_weight_elements,
    moe_cast_bytes,
)
from planner.costs.memory import (
    OPTIMIZER_STATE_BYTES,
    ParamBytes,
    param_bytes,
    usable_memory,
)
from planner.costs.overlap import OVERLAP_FIELDS
from planner.costs.rates import (
    ATTENTION_KERNELS,
    ChipRates,
    GemmFit,
    attention_seconds,
    chip_rates,
    linear_gemms,
)
from planner.costs.recompute import RecomputeShare, recompute_error, recomputed_ops
from planner.costs.regions import EdgeGrid, edge_grid
from planner.costs.transfer import EdgeGeometry, EdgeTables, Layout
from planner.errors import LayerwiseError
from planner.graph.moe import moe_flops, moe_spec, tokens_of
from planner.graph.opkinds import (
    CHANNEL,
    LENGTH,
    DimMap,
    contraction,
    fused_ops,
    kind_spec,
    parameter_dims,
    stats_groups,
)
from planner.hardware.pairs import DENSE_DEVICES

if TYPE_CHECKING:
    from planner.graph.opgraph import Edge, Op, OpGraph
    from planner.hardware.devices import Device, DeviceGraph, Hierarchy


# What a device's peak holds (`CostModel.memory_breakdown`), in the order reports list them
PEAK_PARTS = ("weights", "gradients", "optimizer_state", "activations", "working_set")


class MeasuredTimes(Protocol):
    """A source of measured forward+backward times per task (see planner.costs.profile)."""

    def task_time(self, op: Op, cfg: ParallelConfig) -> float | None: ...


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the analytic cost model: gradient synchronization (`sync`: "ring"
    all-reduce or a parameter server "ps"), the fraction of peak FLOP/s and memory bandwidth
    kernels reach, the backward pass's cost relative to the forward, a fixed overhead per
    task in seconds, the gradient all-reduce bucket size (as the runtime's), and what
    training keeps in memory (`planner.costs.memory`, docs/cost_model.md "Memory"):
    `optimizer` state ("none": weights and gradients only, "sgd": a momentum buffer, "adam":
    two moments, fp32), fp32 `master_weights` of 16-bit parameters, the `zero` stage (0-3:
    optimizer state, then gradients, then weights sharded over each shard's data-parallel
    replicas; 1-2 sync by reduce-scatter + all-gather, 3 also all-gathers the weights before
    the forward and the backward), a `headroom` fraction of each device's memory and a
    `reserve` of bytes on each GPU kept free (the allocator's fragmentation; the CUDA
    context, NCCL's buffers, workspaces: `planner.costs.memory.DEFAULT_RESERVE`), and
    activation `recompute` ("none"; "selective": the attention ops of a model's numbered
    blocks; "full": the ops inside its numbered blocks keep nothing and run their forward
    again in the backward pass; or a number k: the first k blocks do;
    `planner.costs.recompute`). Activations count what the backward reads
    (`planner.costs.activations`). The defaults are the plain rule: weights, gradients and
    the activations, no optimizer state, all of each device's memory (`planner.plan` keeps
    `DEFAULT_HEADROOM` and `DEFAULT_RESERVE` free by default).

    Compute per op class (`compute_efficiency_of`): `matmul_efficiency` (linear, conv2d,
    lstm, rnn_attention) and `attention_efficiency` (scaled dot-product attention: its two
    batched matmuls and softmax) override, when given, the fraction a device calibrates for
    the class (`Device.efficiency`); a class neither gives, and every memory-bound op, takes
    `compute_efficiency`. `tf32`: float32 matmul-like ops run at the device's TF32 peak
    (None or False: FP32, PyTorch's default for matmuls).

    `rates`: "shape" prices 16-bit linears and attention on a chip with measured kernel rates
    (`planner.costs.rates.chip_rates`: the H100 and H200 presets) by their kernels' shapes: a
    linear as its three GEMMs at the fraction of peak their (m, n, k) reach, attention at
    the measured rate of `attention_kernel` ("fa2": FlashAttention-2, what PyTorch's
    scaled_dot_product_attention runs; "cudnn": cuDNN's fused attention, Transformer
    Engine's on Hopper; "fa3": FlashAttention-3) at its sequence length, a causal kernel
    doing half the work of the full product. A class's fraction given in the options
    (`matmul_efficiency`, `attention_efficiency`) still wins. "flat": one fraction per class
    everywhere, as before (docs/cost_model.md, "Kernel rates by shape").

    Communication overlap per kind (`planner.costs.overlap`; fractions in [0, 1], read by
    the simulator and the pipeline timeline, not by the additive t_s and t_x):
    `dp_overlap` of each op's gradient sync runs under the rest of the backward pass (the
    rest after it), `param_gather_overlap` of ZeRO's parameter all-gathers runs under
    compute (off the step), `tp_overlap` of each transfer into or out of a linear runs under
    its GEMM, `pp_overlap` of each pipeline message travels while its sender computes (the
    rest blocks it), `cp_overlap` of the keys and values a context-parallel attention op
    exchanges runs under its kernels: `cp_exchange` "all-gather" (the default) lets that
    share run under the op's whole kernels, "ring" under one block's per step of the ring
    (c - 1 steps of one chunk); `cp_order` is the sequence order of context parallelism:
    "balanced" (the default: rank i holds chunks i and 2c-1-i of 2c, equal causal work) or
    "contiguous" (chunk l does (2l+1)/c of the mean: `planner.costs.context`);
    `ep_overlap` of a mixture of experts' all-to-alls runs under its own compute
    (DeepSeek-V3's DualPipe hides them under another micro-batch's). The defaults are PyTorch's
    (`FRAMEWORK_OVERLAP["pytorch"]`). `chunk_sync_overlap`: of a pipeline chunk's overlapped
    sync (`dp_overlap`), the share that starts at that chunk's last backward and runs under
    the stage's later backwards (interleaved schedules: the other chunks'); the rest waits
    for the stage's last backward. 0 (the default) is what published interleaved runs step
    like (fitted on the calibration rows: docs/calibration.md, "What is fitted").
    `transfer_once`: in the simulator, a tensor that several consumers need in the same
    boxes on the same devices moves once (its gradients summed where they are made, then
    sent once), as frameworks that fuse those consumers' inputs do (Megatron-LM's fused
    QKV and gate/up projections: one all-gather of a layer norm's output); False: every
    edge moves its own copy, as layerwise's runtime does. `nic_rails`: a gradient ring whose
    replicas are several on each of several hosts runs one ring per member position, each
    crossing hosts on its own NIC, as NCCL does ("rails", `CostModel.ring_plan`); False: one
    ring, whose host-crossing link (one NIC) is its slowest.

    `expert_capacity` (>= 1): with expert parallelism (`ParallelConfig.expert` > 1), the
    busiest expert-parallel rank's routed tokens over the mean (Fedus et al. 2021's capacity
    factor, Megatron-Core's `--moe-expert-capacity-factor`): it scales that rank's expert
    compute, the tokens it receives and the activations it keeps (`planner.costs.experts`;
    1: perfectly balanced routing). `ep_dispatch`: how the all-to-alls move tokens between
    nodes, "direct" (every copy to its expert's GPU, NCCL's all-to-all: Megatron-Core's
    alltoall dispatcher) or "node" (a token crosses to each node it uses once, then fans out
    over NVLink: DeepEP, DeepSeek-V3 Sec. 3.2.2); `ep_dispatch_bytes`: bytes per element of
    the dispatched tokens (0: the activations' own; 1: FP8 dispatch, DeepSeek-V3 Sec. 3.3.4;
    the combine moves the activations' dtype). `comm_sm_share` (in [0, 1)): the share of each
    GPU's compute units that communication kernels hold for the whole step, so that every
    kernel runs on the rest, its seconds divided by 1 - share (DeepSeek-V3 gives 20 of an
    H800's 132 SMs to its all-to-all dispatch and combine, which DualPipe keeps in flight
    beside the computation: Sec. 3.2.2; 0, the default: communication takes no SMs from
    compute, as NCCL's few channels are priced)."""

    sync: Literal["ring", "ps"] = "ring"
    compute_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    backward_factor: float = 2.0
    task_overhead: float = 0.0
    sync_bucket_bytes: float = 4 * 2**20  # gradient all-reduce bucket (runtime.sync)
    optimizer: Literal["none", "sgd", "adam"] = "none"
    master_weights: bool = False
    zero: int = 0
    headroom: float = 0.0
    reserve: float = 0.0
    recompute: Literal["none", "selective", "full"] | int = "none"
    matmul_efficiency: float | None = None
    attention_efficiency: float | None = None
    tf32: bool | None = None
    rates: Literal["shape", "flat"] = "shape"
    attention_kernel: Literal["fa2", "fa3", "cudnn"] = "fa2"
    dp_overlap: float = 1.0
    param_gather_overlap: float = 0.0
    tp_overlap: float = 0.0
    pp_overlap: float = 1.0
    cp_overlap: float = 0.0
    ep_overlap: float = 0.0
    expert_capacity: float = 1.0
    ep_dispatch: Literal["direct", "node"] = "direct"
    ep_dispatch_bytes: int = 0
    comm_sm_share: float = 0.0
    cp_exchange: Literal["all-gather", "ring"] = "all-gather"
    cp_order: Literal["balanced", "contiguous"] = "balanced"
    chunk_sync_overlap: float = 0.0
    transfer_once: bool = False
    nic_rails: bool = False

    @property
    def chunk_sync_share(self) -> float:
        """The share of each pipeline chunk's gradient sync that starts at the chunk's last
        backward (the pipeline timeline's `grad_overlap`): dp_overlap x chunk_sync_overlap."""
        return self.dp_overlap * self.chunk_sync_overlap

    def __post_init__(self) -> None:
        if self.sync not in ("ring", "ps"):
            raise LayerwiseError(f"sync must be 'ring' or 'ps', got {self.sync!r}")
        if not 0 < self.compute_efficiency <= 1 or not 0 < self.memory_efficiency <= 1:
            raise LayerwiseError("compute_efficiency and memory_efficiency must be in (0, 1]")
        if min(self.backward_factor, self.task_overhead) < 0:
            raise LayerwiseError("backward_factor and task_overhead must be >= 0")
        if self.sync_bucket_bytes < 0:
            raise LayerwiseError("sync_bucket_bytes must be >= 0 (0: no buckets)")
        for name in ("matmul_efficiency", "attention_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise LayerwiseError(
                    f"{name} must be a fraction of peak in (0, 1] (or None: the device's "
                    f"calibrated one, else compute_efficiency), got {value!r}"
                )
        if self.tf32 not in (None, True, False):
            raise LayerwiseError(f"tf32 must be True, False or None, got {self.tf32!r}")
        if self.rates not in ("shape", "flat"):
            raise LayerwiseError(
                f"rates must be 'shape' (kernel rates by shape where the chip has a "
                f"calibration) or 'flat' (one fraction per op class), got {self.rates!r}"
            )
        for name in ("transfer_once", "nic_rails"):
            if not isinstance(getattr(self, name), bool):
                raise LayerwiseError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in (*OVERLAP_FIELDS, "chunk_sync_overlap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise LayerwiseError(
                    f"{name} must be the fraction of that communication hidden under compute, "
                    f"in [0, 1], got {value!r}"
                )
        capacity = self.expert_capacity
        if isinstance(capacity, bool) or not isinstance(capacity, int | float):
            capacity = float("nan")
        if not 1 <= capacity < float("inf"):
            raise LayerwiseError(
                f"expert_capacity must be the busiest expert-parallel rank's tokens over the "
                f"mean, a number >= 1 (1: balanced routing), got {self.expert_capacity!r}"
            )
        if self.ep_dispatch not in EP_DISPATCHES:
            raise LayerwiseError(
                f"ep_dispatch must be 'direct' (every token copy to its expert's GPU) or "
                f"'node' (once to each node, then over NVLink), got {self.ep_dispatch!r}"
            )
        if isinstance(self.ep_dispatch_bytes, bool) or self.ep_dispatch_bytes not in (0, 1, 2, 4):
            raise LayerwiseError(
                f"ep_dispatch_bytes must be 0 (the activations' dtype), 1 (FP8), 2 or 4, got "
                f"{self.ep_dispatch_bytes!r}"
            )
        share = self.comm_sm_share
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share < 1:
            raise LayerwiseError(
                f"comm_sm_share must be the share of each GPU's compute units held by "
                f"communication kernels, in [0, 1) (DeepSeek-V3: 20/132), got {share!r}"
            )
        if self.cp_exchange not in CP_EXCHANGES:
            raise LayerwiseError(
                f"cp_exchange must be 'all-gather' (keys and values gathered before attention) "
                f"or 'ring' (passed chunk by chunk beside its blocks), got {self.cp_exchange!r}"
            )
        if self.cp_order not in CP_ORDERS:
            raise LayerwiseError(
                f"cp_order must be 'balanced' (rank i holds sequence chunks i and 2c-1-i of "
                f"2c) or 'contiguous', got {self.cp_order!r}"
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise LayerwiseError(
                f"attention_kernel must be one of {', '.join(map(repr, ATTENTION_KERNELS))}, "
                f"got {self.attention_kernel!r}"
            )
        self._check_memory_options()

    def _check_memory_options(self) -> None:
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise LayerwiseError(
                f"optimizer must be 'none', 'sgd' or 'adam', got {self.optimizer!r}"
            )
        if not isinstance(self.master_weights, bool):
            raise LayerwiseError(
                f"master_weights must be True or False, got {self.master_weights!r}"
            )
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise LayerwiseError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if self.zero and self.sync != "ring":
            raise LayerwiseError(
                "ZeRO stages shard over a ring of replicas (reduce-scatter + all-gather): "
                "use sync='ring' with zero >= 1"
            )
        if not (isinstance(self.headroom, int | float) and 0 <= self.headroom < 1):
            raise LayerwiseError(
                f"headroom must be a fraction of device memory in [0, 1), got {self.headroom!r}"
            )
        reserve = self.reserve
        if (
            isinstance(reserve, bool)
            or not isinstance(reserve, int | float)
            or not (0 <= reserve < float("inf"))
        ):
            raise LayerwiseError(
                f"reserve must be a number of bytes >= 0 kept free on each GPU, got {reserve!r}"
            )
        error = recompute_error(self.recompute)
        if error is not None:
            raise LayerwiseError(error)


def efficiency_class(kind: str) -> str | None:
    """The op class whose achievable fraction of peak an op kind reaches: "attention", "matmul"
    (the other FLOP-bound kinds: linear, conv2d, lstm, rnn_attention) or None (memory-bound
    kinds, `KindSpec.compute == "bytes"`)."""
    if kind_spec(kind).compute != "flops":
        return None
    return "attention" if kind == "attention" else "matmul"


def compute_peak(
    device: Device, kind: str, dtype_bytes: int, tf32: bool = False, fp8: bool = False
) -> float:
    """FLOP/s `device` peaks at for an op of `kind` whose output has `dtype_bytes` per element.

    Matrix products (FLOP-bound kinds) in 16-bit floats run on tensor cores (`peak16`), in
    FP8 (`fp8`: a linear the "transformer-engine" precisions mark) at `peak8`, float32 ones at
    FP32 or, with `tf32`, at `peak_tf32`; float64 runs at `peak64` whatever the kind;
    memory-bound kinds' few FLOPs run on the vector units at FP32 (their bytes, not their
    peak, set their time)."""
    if dtype_bytes == 8:
        return device.peak64
    if efficiency_class(kind) is None:
        return device.flops
    if fp8:
        return device.peak8
    if dtype_bytes == 2:
        return device.peak16
    return device.peak_tf32 if tf32 and dtype_bytes == 4 else device.flops


def compute_efficiency_of(device: Device, kind: str, options: CostOptions) -> float:
    """The fraction of its peak `device` reaches on an op of `kind`: the options' fraction for
    the kind's class when given, else the device's calibrated one, else
    `options.compute_efficiency` (docs/cost_model.md, "Analytic mode")."""
    op_class = efficiency_class(kind)
    if op_class is None:
        return options.compute_efficiency
    given: float | None = getattr(options, f"{op_class}_efficiency")
    if given is not None:
        return given
    calibrated = device.efficiency_of(op_class)
    return calibrated if calibrated is not None else options.compute_efficiency


class CostModel:
    """t_c, t_s, t_x and per-device memory for ops of `graph` on `devices`."""

    def __init__(
        self,
        graph: OpGraph,
        devices: DeviceGraph,
        options: CostOptions | None = None,
        measured: MeasuredTimes | None = None,
    ):
        self.graph = graph
        self.devices = devices
        self.options = options or CostOptions()
        bind = getattr(measured, "bind", None)
        if bind is not None and getattr(measured, "graph", graph) is None:
            measured = bind(graph)  # key tasks by the graph's real inputs (data: no gradient)
        self.measured = measured
        self.num_devices = devices.num_devices
        self.flops = np.array([d.flops for d in devices.devices], dtype=np.float64)
        self.mem_bw = np.array([d.mem_bandwidth for d in devices.devices], dtype=np.float64)
        self.overhead = np.array([d.message_overhead for d in devices.devices], dtype=np.float64)
        # A small graph's pair costs as D x D tables (a gather each); a larger one's asked of
        # the device graph per query (`pair_costs`): nothing of size D x D is built.
        self._tables: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        if devices.num_devices <= DENSE_DEVICES:
            self._tables = (self.inv_bw, self.latency, self.msg_cost)
        groups = Counter(op.param_group for op in graph.ops if op.param_group is not None)
        self._group_size = dict(groups)
        self._norm_groups: dict[tuple[int, tuple[int, ...]], list[list[int]] | None] = {}
        self._layouts: dict[tuple[tuple[int, ...], bytes], Layout | None] = {}
        self._rates: dict[tuple[str, int, bool], np.ndarray] = {}
        self._kernels: dict[
            tuple[int, tuple[int, ...], int, int, int], tuple[float, float] | None
        ] = {}

    @property
    def source(self) -> str:
        return "measured" if self.measured is not None else "analytic"

    # -- pair costs -----------------------------------------------------------------------

    def pair_costs(self, a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
        """(seconds per byte, fixed seconds per message) from devices a to devices b (index
        arrays, broadcast): the route's 1 / bottleneck bandwidth, and its latency plus both
        endpoints' message overheads (0 within a device)."""
        if self._tables is not None:
            return self._tables[0][a, b], self._tables[2][a, b]
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        inv, lat = self.devices.pair_costs(a, b)
        return inv, np.where(a == b, 0.0, lat + self.overhead[a] + self.overhead[b])

    def _pair_latency(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
        """(seconds per byte, latency, fixed seconds per message) from devices a to b."""
        if self._tables is not None:
            inv, lat, msg = self._tables
            return inv[a, b], lat[a, b], msg[a, b]
        a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
        inv, lat = self.devices.pair_costs(a, b)
        return inv, lat, np.where(a == b, 0.0, lat + self.overhead[a] + self.overhead[b])

    @cached_property
    def inv_bw(self) -> np.ndarray:
        """(D, D) seconds per byte between devices (a small graph's table; queries:
        `pair_costs`)."""
        return np.asarray(self.devices.inv_bandwidth, dtype=np.float64)

    @cached_property
    def latency(self) -> np.ndarray:
        """(D, D) route latency between devices (a small graph's table)."""
        return np.asarray(self.devices.latency, dtype=np.float64)

    @cached_property
    def msg_cost(self) -> np.ndarray:
        """(D, D) fixed seconds per message from i to j: route latency + both endpoints'
        overheads, 0 within a device (a small graph's table; queries: `pair_costs`)."""
        out = self.latency + self.overhead[:, None] + self.overhead[None, :]
        np.fill_diagonal(out, 0.0)  # no message within a device
        return out

    # -- t_c ------------------------------------------------------------------------------

    @cached_property
    def _cp_order(self) -> str:
        """The token order causal attention's sequence chunks run in: the options', but
        contiguous where the graph cannot run permuted (`planner.costs.context.permutable`:
        the runtime keeps such a sequence in order)."""
        return self.options.cp_order if permutable(self.graph) else "contiguous"

    def _task_work(self, op: Op) -> tuple[float, float]:
        """(FLOPs, bytes) of the whole op's forward pass."""
        nbytes = op.mem_bytes
        if not nbytes:
            ins = sum(self.graph.op(n).output.nbytes for n in op.inputs)
            nbytes = ins + op.output.nbytes + op.param_bytes
        return op.flops, float(nbytes)

    def compute_rate(self, op: Op) -> np.ndarray:
        """(D,) FLOP/s each device reaches on `op`'s kernels: the peak of its precision and
        kind (`compute_peak`) times the fraction its class reaches (`compute_efficiency_of`)."""
        return self._rate(op.kind, op.output.dtype_bytes, computes_in_fp8(op))

    def _rate(self, kind: str, dtype_bytes: int, fp8: bool) -> np.ndarray:
        """`compute_rate` of an op of `kind`, output dtype and FP8 marking."""
        key = (kind, dtype_bytes, fp8)
        rate = self._rates.get(key)
        if rate is None:
            o = self.options
            rate = np.array(
                [
                    compute_peak(d, kind, dtype_bytes, bool(o.tf32), fp8)
                    * compute_efficiency_of(d, kind, o)
                    for d in self.devices.devices
                ],
                dtype=np.float64,
            )
            self._rates[key] = rate
        return rate

    def task_times(self, i: int, cfg: ParallelConfig) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward seconds of each task of op i under cfg (two (k,) arrays).

        Measured times (forward + backward) are split in the analytic ratio 1 : backward_factor;
        the per-task overhead (what a runtime spends around the kernels) is charged to the
        forward task, analytic or measured. An op that recomputes (`recomputed`) runs its
        forward kernels again in its backward task."""
        op = self.graph.ops[i]
        k, o = cfg.num_tasks, self.options
        if op.kind == "input":
            return np.zeros(k), np.zeros(k)
        measured = self.measured.task_time(op, cfg) if self.measured is not None else None
        if spreads_experts(op, cfg):  # a profile times a task alone: not its group's routing
            measured = None
        if measured is not None:
            fwd = np.full(k, measured / (1.0 + o.backward_factor) / (1.0 - o.comm_sm_share))
            return fwd + o.task_overhead, fwd * (o.backward_factor + self._again(i))
        flops, nbytes = self._task_work(op)
        dev = np.asarray(cfg.devices)
        bandwidth = self.mem_bw[dev] * o.memory_efficiency
        memory = nbytes / k / bandwidth
        casts = self._fp8_casts(op, cfg)  # Transformer Engine's casts of an FP8 linear
        if op.kind == "moe":  # its routing, permutation and activation kernels
            passes = token_pass_bytes(op, cfg, o.expert_capacity)
            casts = (casts[0] + passes, casts[1] + passes * o.backward_factor)
        shaped = self._kernel_times(i, cfg)
        kernels: tuple[Any, Any] | None = shaped
        work = task_work(op, cfg, self._cp_order)  # causal chunks' unequal shares
        task_flops: Any = flops if work is None else flops * work
        if work is not None and shaped is not None:
            kernels = (shaped[0] * work, shaped[1] * work)
        if kernels is not None:  # by the kernels' shapes (`planner.costs.rates`)
            fwd = np.maximum(kernels[0], memory) + casts[0] / bandwidth
            bwd = np.maximum(kernels[1], memory * o.backward_factor) + casts[1] / bandwidth
        else:
            if op.kind == "moe":  # the busiest expert-parallel rank (`planner.costs.experts`)
                task_flops = moe_task_flops(op, cfg, o.expert_capacity) * k
            fwd = np.maximum(self._flat_seconds(op, task_flops / k, dev, cfg), memory)
            bwd = fwd * o.backward_factor + casts[1] / bandwidth
            fwd = fwd + casts[0] / bandwidth
        if o.comm_sm_share:  # the kernels run on the compute units communication leaves
            fwd, bwd = fwd / (1.0 - o.comm_sm_share), bwd / (1.0 - o.comm_sm_share)
        return fwd + o.task_overhead, bwd + fwd * self._again(i)

    def _flat_seconds(self, op: Op, flops: Any, dev: np.ndarray, cfg: ParallelConfig) -> Any:
        """Seconds of a task's `flops` on devices `dev` at the flat rates (`compute_rate`); an
        FP8 moe's router FLOPs at the bf16 rate, the rest at the FP8 one."""
        rate = self.compute_rate(op)[dev]
        if op.kind != "moe" or not computes_in_fp8(op):
            return flops / rate
        router = moe_flops(moe_spec(op), op.output.size(CHANNEL), tokens_of(op.output.sizes))
        mine = router.router / (cfg.num_tasks // cfg.reduce)  # whole on each partial's task
        bf16 = self._rate(op.kind, op.output.dtype_bytes, False)[dev]
        return (flops - mine) / rate + mine / bf16

    def _fp8_casts(self, op: Op, cfg: ParallelConfig) -> tuple[float, float]:
        """(forward, backward) bytes of one task of an FP8 linear's casts and transposes
        (`planner.costs.fp8.cast_bytes`), or of an FP8 moe's expert GEMMs' (`moe_cast_bytes`);
        (0, 0) for every other op."""
        if not computes_in_fp8(op):
            return 0.0, 0.0
        if op.kind == "moe":
            return moe_cast_bytes(op, cfg, self.options.expert_capacity)
        shapes = linear_gemms(op, cfg)
        if shapes is None:
            return 0.0, 0.0
        ((m, n, k),) = shapes
        return cast_bytes(op, cfg, m, n, k, self._cast_sharers(op))

    def _cast_sharers(self, op: Op) -> int:
        """The FP8 linears that cast `op`'s input once between them: with `transfer_once`
        (frameworks that fuse the consumers of one tensor, Megatron-Core's QKV and gate/up
        projections) every FP8 linear reading the same tensor, else 1."""
        if not self.options.transfer_once:
            return 1
        readers = self.graph.consumers[self.graph.index(op.inputs[0])]
        return max(1, sum(fp8_linear(self.graph.ops[r]) for r in readers))

    @cached_property
    def _chips(self) -> tuple[list[ChipRates | None], np.ndarray]:
        """Each device's measured chip rates (or None), and its chip's index (-1: none)."""
        chips = [chip_rates(d) for d in self.devices.devices]
        known = {id(c): n for n, c in enumerate({id(c): c for c in chips if c}.values())}
        index = np.array([known[id(c)] if c else -1 for c in chips], dtype=np.int64)
        return chips, index

    def _kernel_times(self, i: int, cfg: ParallelConfig) -> tuple[float, float] | None:
        """Forward and backward seconds of one task of op i (a 16-bit linear or attention)
        on a chip with measured kernel rates, when `rates` is "shape", every device of cfg
        has the same such chip and the options give no fraction for the op's class; else
        None (the flat fraction prices it)."""
        op, o = self.graph.ops[i], self.options
        given = {
            "linear": o.matmul_efficiency,
            "moe": o.matmul_efficiency,
            "attention": o.attention_efficiency,
        }
        if o.rates != "shape" or op.output.dtype_bytes != 2 or op.kind not in given:
            return None
        if given[op.kind] is not None:
            return None
        chips, index = self._chips
        found = index[np.asarray(cfg.devices)]
        if found[0] < 0 or np.any(found != found[0]):
            return None
        chip = chips[int(cfg.devices[0])]
        assert chip is not None
        key = (i, cfg.degrees, cfg.reduce, cfg.expert, int(found[0]))
        times = self._kernels.get(key)
        if times is None:
            device = self.devices.devices[cfg.devices[0]]
            gemm: GemmFit | None
            experts: tuple[GemmFit, float] | None = None
            if computes_in_fp8(op) and op.kind == "moe":  # experts in FP8, the router bf16
                gemm, peak = (chip.gemm if chip.gemm8 else None), device.peak16
                experts = None if chip.gemm8 is None else (chip.gemm8, device.peak8)
            elif computes_in_fp8(op):  # FP8 GEMMs at the chip's FP8 fit, when it has one
                gemm, peak = chip.gemm8, device.peak8
            else:
                gemm, peak = chip.gemm, device.peak16
            times = None if gemm is None else self._shaped(op, cfg, chip, gemm, peak, experts)
            self._kernels[key] = times
        return times

    def _shaped(
        self,
        op: Op,
        cfg: ParallelConfig,
        chip: ChipRates,
        gemm: GemmFit,
        peak: float,
        experts: tuple[GemmFit, float] | None = None,
    ) -> tuple[float, float] | None:
        if op.kind == "attention":
            dims = op.output.dims
            seq = op.output.size(LENGTH) if LENGTH in dims else 1
            chunks = cfg.degrees[dims.index(LENGTH)] if LENGTH in dims else 1
            kernel = chip.attention[self.options.attention_kernel]
            flops = op.flops / cfg.num_tasks
            causal = bool(op.attr("causal", False))
            window = op.attr("window", None)
            return attention_seconds(kernel, flops, seq, causal, chunks, window)
        if op.kind == "moe":  # router, shared expert, grouped expert GEMMs
            capacity = self.options.expert_capacity
            return expert_gemm_seconds(op, cfg, gemm, peak, capacity, experts)
        shapes = linear_gemms(op, cfg)
        if shapes is None:
            return None
        ((m, n, k),) = shapes
        forward = gemm.seconds(m, n, k, peak)
        backward = gemm.seconds(m, k, n, peak) + gemm.seconds(n, k, m, peak)
        # folded functions (`coarsen`) add FLOPs the GEMMs do not have: at the flat rate
        extra = max(0.0, op.flops / cfg.num_tasks - 2.0 * m * n * k) / (peak * gemm.cap)
        return forward + extra, backward + extra * self.options.backward_factor

    @cached_property
    def recomputed(self) -> RecomputeShare:
        """The ops that keep no output and run their forward again in the backward pass
        (`CostOptions.recompute`; `planner.costs.recompute.recomputed_ops`)."""
        return recomputed_ops(self.graph, self.options.recompute)

    def _again(self, i: int) -> float:
        """Forward passes op i runs again in its backward task: 1 if it recomputes, else 0."""
        return 1.0 if i in self.recomputed else 0.0

    def compute_time(self, i: int, cfg: ParallelConfig) -> float:
        """t_c: forward + backward seconds of the slowest task of op i under cfg, with its
        batch-norm statistics exchanges (one forward, one backward) or its experts'
        all-to-alls (`expert_exchange`: whole, as the additive objective prices every
        communication; the simulator hides `ep_overlap` of them)."""
        fwd, bwd = self.task_times(i, cfg)
        total = fwd + bwd
        exchange = self.norm_exchange(i, cfg)
        if exchange is not None:
            total = total + 2.0 * exchange
        a2a = self.expert_exchange(i, cfg)
        if a2a is not None:
            total = total + a2a[0] + a2a[1]
        return float(total.max())

    def expert_exchange(self, i: int, cfg: ParallelConfig) -> tuple[np.ndarray, np.ndarray] | None:
        """(forward, backward) seconds per task of op i's expert-parallel all-to-alls under
        cfg: dispatch + combine each way (`planner.costs.experts.a2a_seconds`; a recomputed op
        dispatches and combines again in its backward), or None when cfg spreads no experts."""
        op = self.graph.ops[i]
        if not spreads_experts(op, cfg):
            return None
        o = self.options
        combine_bytes = a2a_bytes(op, cfg)
        width = o.ep_dispatch_bytes or op.output.dtype_bytes
        dispatch_bytes = combine_bytes * width / op.output.dtype_bytes

        def both(nbytes: float) -> tuple[np.ndarray, np.ndarray]:  # (dispatch, combine)
            if o.ep_dispatch == "node":
                hosts = self._host_ids
                return node_a2a_seconds(self.pair_costs, op, cfg, hosts, nbytes, o.expert_capacity)
            return a2a_seconds(self.pair_costs, cfg, nbytes, o.expert_capacity)

        dispatch, combine = both(combine_bytes)
        if dispatch_bytes != combine_bytes:  # FP8 dispatch: the combine stays as it was
            dispatch = both(dispatch_bytes)[0]
        once = dispatch + combine
        return once, once * (1.0 + self._again(i))

    @cached_property
    def _host_ids(self) -> np.ndarray:
        """(D,) an integer per device naming its host (devices that share NVLink)."""
        names: dict[str, int] = {}
        return np.array([names.setdefault(d.host, len(names)) for d in self.devices.devices])

    def norm_groups(self, i: int, cfg: ParallelConfig) -> list[list[int]] | None:
        """Per task, the task indices that hold the same channels of a batch-norm op whose
        config splits its samples, height or width (they sum their statistics); None when
        op i needs no such exchange."""
        key = (i, cfg.degrees)
        if key not in self._norm_groups:
            self._norm_groups[key] = stats_groups(self.graph.ops[i], cfg.degrees)
        return self._norm_groups[key]

    def norm_exchange(self, i: int, cfg: ParallelConfig) -> np.ndarray | None:
        """Seconds of one batch-norm statistics exchange per task of op i under cfg (the
        forward and the backward pass each make one), or None when it needs none.

        2 x (channels of the task) float64 sums; two tasks swap them (one message each way:
        latency, bytes / bandwidth and both overheads), larger groups all-reduce as the
        gradients do (`CostOptions.sync`), without bucket sharing. Computed once per group of
        tasks holding the same channels (every member waits for the same exchange)."""
        if self.norm_groups(i, cfg) is None:
            return None
        op = self.graph.ops[i]
        c = op.output.dims.index(CHANNEL)
        nbytes = 2 * 8 * op.output.size(CHANNEL) / cfg.degrees[c]
        # Tasks with the same channel index, each group's devices ascending: (channels, r).
        grid = np.arange(cfg.num_tasks).reshape(cfg.degrees)
        members = np.moveaxis(grid, c, 0).reshape(cfg.degrees[c], -1)
        devs = np.sort(np.asarray(cfg.devices, dtype=np.int64)[members], axis=1)
        if devs.shape[1] == 2:
            a, b = devs[:, 0], devs[:, 1]
            (inv_ab, msg_ab), (inv_ba, msg_ba) = self.pair_costs(a, b), self.pair_costs(b, a)
            per_group = np.maximum(nbytes * inv_ab + msg_ab, nbytes * inv_ba + msg_ba)
        else:
            per_group = self._sync_groups(devs, nbytes, bucketed=False)
        channel_of_task = np.unravel_index(np.arange(cfg.num_tasks), cfg.degrees)[c]
        return per_group[channel_of_task]

    # -- t_s ------------------------------------------------------------------------------

    def replica_array(self, op: Op, cfg: ParallelConfig) -> np.ndarray:
        """(shards, replicas) devices: row s holds the devices of the tasks that share
        parameter shard s, in task order; shards in row-major order of the parameter index.
        A contraction split cuts the weight too (its bias, 1/K of it, is priced as cut)."""
        pdims = [op.output.dims.index(d) for d in parameter_dims(op)]
        if cfg.reduce > 1:
            pdims.append(len(cfg.degrees))
        rest = [d for d in range(len(cfg.grid)) if d not in pdims]
        grid = np.arange(cfg.num_tasks).reshape(cfg.grid).transpose(pdims + rest)
        shards = math.prod(cfg.grid[d] for d in pdims)
        return np.asarray(cfg.devices, dtype=np.int64)[grid.reshape(shards, -1)]

    def replica_groups(self, op: Op, cfg: ParallelConfig) -> list[list[int]]:
        """Device lists that hold the same parameter shard (one list per shard)."""
        return self.replica_array(op, cfg).tolist()

    def sync_time(self, i: int, cfg: ParallelConfig) -> float:
        """t_s: seconds to synchronize op i's replicated parameter gradients under cfg.

        ZeRO 1-2 reduce-scatter the gradients and all-gather the updated weights: on a ring
        each is half an all-reduce (r - 1 steps of shard / r), so they cost what it does.
        ZeRO 3 also all-gathers the weights before the forward and again before the
        backward, and needs no all-gather after the step: reduce-scatter + 2 all-gathers, 1.5x
        the all-reduce (ZeRO paper Sec. 7.2: 3 Psi instead of 2 Psi)."""
        op = self.graph.ops[i]
        if not op.params or cfg.num_tasks == 1:
            return 0.0
        total = 0.0
        for nbytes, groups in self.param_groups(op, cfg):
            shard = nbytes / len(groups)
            total += float(self._sync_groups(groups, shard, passes=self.ring_passes).max())
        return total / self._share(op)

    def param_groups(self, op: Op, cfg: ParallelConfig) -> list[tuple[float, np.ndarray]]:
        """op's parameters by class under cfg: (bytes, (shards, replicas) devices) each, the
        replica array as `replica_array` gives it. One class for every op but a moe op whose
        experts cfg spreads: its router and shared expert replicated on every task, its
        routed experts cut `expert` ways, replicated over the tasks of one expert rank
        (`planner.costs.experts.param_classes`). Each class syncs its gradients over its own
        replicas, one after the other."""
        out = []
        for params, tasks in param_classes(op, cfg):
            nbytes = float(sum(p.nbytes for p in params))
            if tasks.size:
                out.append((nbytes, np.asarray(cfg.devices, dtype=np.int64)[tasks]))
            elif params:
                out.append((nbytes, self.replica_array(op, cfg)))
        return out

    @property
    def ring_passes(self) -> int:
        """Ring passes (each r - 1 steps of shard / r) of one step's parameter sync: 2 (an
        all-reduce, or ZeRO 1-2's reduce-scatter + all-gather), 3 at ZeRO 3."""
        return 3 if self.options.zero >= 3 else 2

    @property
    def exposed_passes(self) -> float:
        """The ring passes of a step's parameter sync left on the simulated step: all of
        them, less `param_gather_overlap` of ZeRO's all-gathers (one pass at ZeRO 1-2, two
        at ZeRO 3), which run under compute (`planner.costs.overlap`)."""
        gathers = {0: 0, 1: 1, 2: 1, 3: 2}[self.options.zero]
        return self.ring_passes - self.options.param_gather_overlap * gathers

    def _share(self, op: Op) -> int:
        """Ops of a shared parameter group each carry 1/|group| of its sync and memory."""
        return self._group_size[op.param_group] if op.param_group is not None else 1

    def bucket_share(self, nbytes: float) -> float:
        """The share of a gradient bucket's fixed message costs that `nbytes` carries."""
        bucket = self.options.sync_bucket_bytes
        return 1.0 if bucket <= 0 else min(1.0, nbytes / bucket)

    def _sync_group(self, devs: list[int], nbytes: float, bucketed: bool = True) -> float:
        """Seconds for one replica group (devices in ring order) to synchronize nbytes."""
        return float(self._sync_groups(np.asarray([devs]), nbytes, bucketed)[0])

    def _sync_groups(
        self, devs: np.ndarray, nbytes: float, bucketed: bool = True, passes: int = 2
    ) -> np.ndarray:
        """Seconds per replica group for groups of equal size: devs (groups, r) -> (groups,).
        Ring: `passes` passes of r - 1 steps (2: an all-reduce)."""
        r = devs.shape[1]
        if r == 1 or nbytes == 0:
            return np.zeros(len(devs))
        share = self.bucket_share(nbytes) if bucketed else 1.0

        def costs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """Seconds per byte, and latency + the bucket's share of both overheads."""
            inv, lat, msg = self._pair_latency(a, b)
            return inv, lat + share * (msg - lat)

        if self.options.sync == "ps":
            ps, rest = devs[:, :1], devs[:, 1:]
            inv_push, fixed_push = costs(rest, ps)
            inv_pull, fixed_pull = costs(ps, rest)
            push = nbytes * inv_push + fixed_push
            pull = nbytes * inv_pull + fixed_pull
            return (push + pull).sum(axis=1)
        steps = float(passes) * (r - 1)
        if self.options.nic_rails:
            out = np.zeros(len(devs))
            for g, row in enumerate(devs):
                src, dst, part = self.ring_plan(row.tolist())
                inv, fixed = costs(src, dst)
                out[g] = steps / r * nbytes * float((part * inv).max()) + steps * fixed.max()
            return out
        nxt = np.roll(devs, -1, axis=1)
        inv, fixed = costs(devs, nxt)
        slow = inv.max(axis=1)
        return steps / r * nbytes * slow + steps * fixed.max(axis=1)

    def ring_plan(self, devs: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The messages of a ring all-reduce over `devs` (ring order): senders, receivers and
        each one's share of what a member sends. One ring: every member to the next. With
        `nic_rails`, a group of m > 1 members on each of several hosts runs one ring per
        member position, as NCCL runs one ring per NIC ("rails"): each member sends (m - 1)
        / m of it to the next member of its host and 1 / m to the member at its position on
        the next host, so the hosts' m NICs share the inter-host traffic (docs/devices.md,
        "Rails")."""
        r = len(devs)
        ring = (np.asarray(devs), np.roll(np.asarray(devs), -1), np.ones(r))
        if not self.options.nic_rails:
            return ring
        hosts: dict[str, list[int]] = {}
        for d in devs:
            hosts.setdefault(self.devices.devices[d].host, []).append(d)
        members = [sorted(h) for h in hosts.values()]
        m = len(members[0])
        if len(members) < 2 or m < 2 or any(len(h) != m for h in members):
            return ring
        src, dst, part = [], [], []
        for k, here in enumerate(members):
            there = members[(k + 1) % len(members)]
            for j, d in enumerate(here):
                src += [d, d]
                dst += [here[(j + 1) % m], there[j]]
                part += [(m - 1) / m, 1 / m]
        return np.asarray(src), np.asarray(dst), np.asarray(part)

    # -- memory ---------------------------------------------------------------------------

    def memory(self, i: int, cfg: ParallelConfig) -> np.ndarray:
        """Bytes op i keeps on each device under cfg: its parameters' training state
        (`param_copies`) and the activations kept of it for the backward (its output when a
        consumer saves it, its own buffers: `planner.costs.activations`; of a recomputed op,
        its share of its region's working set; a strategy's peak: `strategy_memory`)."""
        out = np.zeros(self.num_devices)
        out[list(cfg.devices)] = self._task_memory(i, cfg)
        return out

    def _task_memory(self, i: int, cfg: ParallelConfig) -> float:
        kept = self._kept_unit(i, cfg) * self.activations.per_op(i) + self._dispatched_extra(i, cfg)
        return self._param_memory(i, cfg) + kept

    def _kept_unit(self, i: int, cfg: ParallelConfig) -> float:
        """Bytes of op i's output per task of cfg, as activations are kept: a contraction
        split's partial sums are kept (and its folded dropout's mask made) after the sum is
        scattered over its tasks, as Megatron-LM's row-parallel layer with sequence
        parallelism does: 1 / every task of it."""
        return self.graph.ops[i].output.nbytes / cfg.num_tasks

    def activation_bytes(self, i: int, cfg: ParallelConfig) -> float:
        """Bytes of activations each task of cfg keeps of op i from the forward to the
        backward pass (`planner.costs.activations`: its output when an op's backward reads it,
        its own buffers; not a recomputed op's working set)."""
        kept = self._kept_unit(i, cfg) * float(self.activations.kept[i])
        return kept + self._dispatched_extra(i, cfg)

    def _param_memory(self, i: int, cfg: ParallelConfig) -> float:
        """Bytes of op i's parameters' training state each task of cfg keeps."""
        return sum(self._param_parts(i, cfg))

    def _param_parts(self, i: int, cfg: ParallelConfig) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state with master copies) bytes of op i's
        parameters each task of cfg keeps (`planner.costs.memory.ParamBytes.held`)."""
        op = self.graph.ops[i]
        if not op.params:
            return 0.0, 0.0, 0.0
        if cuts_experts(op, cfg):
            return self._class_parts(op, cfg)
        shards = math.prod(cfg.degree(op, d) for d in parameter_dims(op))
        shards *= cfg.reduce  # a contraction split cuts the weight too
        r, zero = max(1, cfg.num_tasks // shards), self.options.zero
        state = self.param_state(op)
        scale = 1.0 / (shards * self._share(op))
        return (
            state.weights / (r if zero >= 3 else 1) * scale,
            state.gradients / (r if zero >= 2 else 1) * scale,
            state.state / (r if zero >= 1 else 1) * scale,
        )

    def _class_parts(self, op: Op, cfg: ParallelConfig) -> tuple[float, float, float]:
        """`_param_parts` of a moe op whose experts cfg spreads: per parameter class
        (`param_classes`), its state over its shards, ZeRO over its replicas."""
        zero, o = self.options.zero, self.options
        parts = np.zeros(3)
        for params, tasks in param_classes(op, cfg):
            if not params:
                continue
            shards, r = tasks.shape if tasks.size else (1, cfg.num_tasks)
            state = param_bytes(params, o.optimizer, o.master_weights)
            cache = WEIGHT_CACHE_BYTES * fp8_weight_elements(op, params)  # FP8 experts
            held = (state.weights + cache, state.gradients, state.state)
            cut = (zero >= 3, zero >= 2, zero >= 1)
            scale = 1.0 / (shards * self._share(op))
            parts += [b / (r if c else 1) * scale for b, c in zip(held, cut, strict=True)]
        return float(parts[0]), float(parts[1]), float(parts[2])

    def _dispatched_extra(self, i: int, cfg: ParallelConfig) -> float:
        """Bytes a task of a moe op keeps beyond its share of op i's activations: on the
        busiest expert-parallel rank (capacity - 1) x the dispatched part, and under expert
        tensor parallelism the box's tokens' copies, outputs and probabilities on every task
        of the box (`planner.costs.experts.kept_by_task` less the share the graph-wide rule
        gives it); 0 unless op i is a moe op whose experts cfg spreads or cuts and keeps its
        activations (a recomputed one keeps none)."""
        op = self.graph.ops[i]
        if not cuts_experts(op, cfg) or not self.activations.kept[i]:
            return 0.0
        mine = kept_by_task(op, cfg, self.options.expert_capacity)
        return mine - self._kept_unit(i, cfg) * moe_buffers(op)

    @cached_property
    def activations(self) -> ActivationMemory:
        """What each op keeps for the backward, per byte of its output, under the options'
        recomputation (`planner.costs.activations.activation_memory`)."""
        return activation_memory(self.graph, self.recomputed)

    def strategy_memory(self, configs: Sequence[ParallelConfig | None]) -> np.ndarray:
        """(D,) peak bytes per device of a strategy's configs (None: an op not placed yet):
        the parameters' training state, the activations kept for the backward, and the
        largest working set of one region on each device (a recomputed block or attention
        op rebuilding its activations, or the loss's logits gradient: `planner.costs.
        activations`) rather than the per-op shares `memory` charges."""
        peak = np.zeros(self.num_devices)
        regions: dict[str, np.ndarray] = {}
        act = self.activations
        for i, cfg in enumerate(configs):
            if cfg is None:
                continue
            peak += self.memory(i, cfg)
            if i in act.region:
                devs = list(cfg.devices)
                work = regions.setdefault(act.region[i], np.zeros(self.num_devices))
                held = self._kept_unit(i, cfg) * float(act.work[i])
                work[devs] += held
                peak[devs] -= held * act.share[i]
        if regions:
            peak += np.max(np.stack(list(regions.values())), axis=0)
        return peak

    def memory_parts(
        self, configs: Sequence[ParallelConfig]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(D,) bytes per device of a strategy's configs in three parts that sum to
        `strategy_memory`: the parameters' training state, the activations kept from the
        forward to the backward, and the largest region's working set (a recomputed block or
        attention op, or the loss's logits gradient). A pipeline keeps the second per
        micro-batch in flight, the others once."""
        params = np.zeros(self.num_devices)
        kept = np.zeros(self.num_devices)
        for i, cfg in enumerate(configs):
            devs = list(cfg.devices)
            params[devs] += self._param_memory(i, cfg)
            kept[devs] += self.activation_bytes(i, cfg)
        working = self.strategy_memory(configs) - params - kept
        return params, kept, working

    def memory_breakdown(self, configs: Sequence[ParallelConfig]) -> dict[str, np.ndarray]:
        """(D,) bytes per device of a strategy's configs by what they hold, summing to
        `strategy_memory`: "weights", "gradients", "optimizer_state" (optimizer state and
        fp32 master copies), "activations" (kept from the forward to the backward) and
        "working_set" (the largest region's: a recomputed block or attention op, or the
        loss's logits gradient)."""
        parts = {k: np.zeros(self.num_devices) for k in PEAK_PARTS[:3]}
        for i, cfg in enumerate(configs):
            devs = list(cfg.devices)
            for key, value in zip(PEAK_PARTS[:3], self._param_parts(i, cfg), strict=True):
                parts[key][devs] += value
        _, kept, working = self.memory_parts(configs)
        return {**parts, "activations": kept, "working_set": working}

    def param_state(self, op: Op) -> ParamBytes:
        """Op's parameter bytes in training, unsharded: weights, gradients, fp32 state. The
        weights of an FP8 linear (an FP8 moe's experts) count Transformer Engine's FP8 copy of
        its weight and of its transpose, kept across micro-batches (`planner.costs.fp8.
        WEIGHT_CACHE_BYTES`, `fp8_weight_elements`)."""
        state = param_bytes(op.params, self.options.optimizer, self.options.master_weights)
        if computes_in_fp8(op):
            cache = WEIGHT_CACHE_BYTES * fp8_weight_elements(op)
            state = dataclasses.replace(state, weights=state.weights + cache)
        return state

    def param_copies(self, op: Op, replicas: int = 1) -> float:
        """Bytes a task keeps per byte of op's parameters it holds, when each shard has
        `replicas` data-parallel copies (`planner.costs.memory`): 2.0 by default (weights
        and gradients), 8.0 for bf16 + Adam + master weights at ZeRO 0 (16 B per 2 B)."""
        if not op.param_bytes:
            return 0.0
        return self.param_state(op).held(replicas, self.options.zero) / op.param_bytes

    def update_copies(self, op: Op, replicas: int = 1) -> float:
        """Bytes the optimizer step reads and writes per byte of op's parameters a task
        holds (its whole shard at ZeRO 0, its 1/replicas slice at ZeRO >= 1)."""
        if not op.param_bytes:
            return 0.0
        return self.param_state(op).updated(replicas, self.options.zero) / op.param_bytes

    def usable_memory(self) -> np.ndarray:
        """(D,) bytes of each device a plan may use: (1 - headroom) x its memory, less the
        reserve on each GPU (`planner.costs.memory.usable_memory`)."""
        return usable_memory(self.devices, self.options.headroom, self.options.reserve)

    # -- t_x (direct, task by task) -------------------------------------------------------

    def transfer_time(self, edge: Edge, cu: ParallelConfig, cv: ParallelConfig) -> float:
        """t_x of one edge for one config pair, computed task pair by task pair over the pairs
        whose regions overlap (vectorized; independent of the tables' per-level sums)."""
        src = self.graph.ops[edge.src]
        grid = self.edge_grid(edge, cu.reduce, cv.reduce)
        nbytes, grad_nbytes = self.edge_element_bytes(edge)
        olo, ohi = _boxes(grid.out_sizes, cv.grid)
        nlo, nhi = _needs(grid.maps, grid.in_sizes, grid.out_dims, olo, ohi)  # (k_v, n)
        q, p, vol = _overlapping_pairs(grid.in_sizes, cu.grid, nlo, nhi)
        dp = np.asarray(cu.devices, dtype=np.int64)[p]
        dq = np.asarray(cv.devices, dtype=np.int64)[q]
        far = dp != dq  # transfers between tasks on the same device are free
        q, p, dp, dq, b = q[far], p[far], dp[far], dq[far], vol[far] * nbytes
        # Each config has one task per device: the receiving tasks are the receiving devices.
        inv_there, msg_there = self.pair_costs(dp, dq)
        there = b * inv_there + msg_there
        fwd = np.bincount(q, weights=there, minlength=cv.num_tasks)
        passes = 1.0 + self._again(edge.dst)  # a recomputed consumer receives it again
        if src.kind == "input":  # data gets no gradient
            return passes * float(fwd.max(initial=0.0))
        inv_back, msg_back = self.pair_costs(dq, dp)
        back = b * (grad_nbytes / nbytes) * inv_back + msg_back
        bwd = np.bincount(p, weights=back, minlength=cu.num_tasks)
        return passes * float(fwd.max(initial=0.0)) + float(bwd.max(initial=0.0))

    def edge_element_bytes(self, edge: Edge) -> tuple[int, int]:
        """Bytes per element of `edge`'s tensor as it travels forward and as its gradient
        travels back (times the tensors it carries, `edge_components`): the producer's dtype,
        but 1 byte (FP8) into an FP8 linear, which Transformer Engine casts before gathering
        it, and for the gradient sent back to an FP8 linear, cast before its gather as well
        (`planner.costs.fp8`)."""
        src, dst = self.graph.ops[edge.src], self.graph.ops[edge.dst]
        size = src.output.dtype_bytes
        forward = FP8_BYTES if fp8_linear(dst) and edge.position == 0 else size
        backward = FP8_BYTES if fp8_linear(src) else size
        n = self.edge_components(edge)
        return forward * n, backward * n

    def edge_components(self, edge: Edge) -> int:
        """Tensors an edge carries: 2 for an LSTM step's state (h and c, the same box, sent
        back to back: priced as one message of twice the bytes), else 1."""
        return 2 if self.graph.ops[edge.dst].kind == "lstm" and edge.position == 1 else 1

    # -- tables ---------------------------------------------------------------------------

    @cached_property
    def hierarchy(self) -> Hierarchy | None:
        """The cluster's nested groups (`DeviceGraph.hierarchy()`), or None."""
        return self.devices.hierarchy()

    def node_table(self, i: int, configs: OpConfigs) -> np.ndarray:
        """t_c + t_s for every config of op i."""
        return np.array([self.compute_time(i, c) + self.sync_time(i, c) for c in configs.configs])

    def memory_table(self, i: int, configs: OpConfigs) -> np.ndarray:
        """(C, D) bytes per device for every config of op i."""
        out = np.zeros((len(configs), self.num_devices))
        for _, sets, idx in configs.groups:  # one partition: the same bytes on every task
            if len(idx):
                out[idx[:, None], sets] = self._task_memory(i, configs.configs[int(idx[0])])
        return out

    def edge_grid(self, edge: Edge, ru: int = 1, rv: int = 1) -> EdgeGrid:
        """The edge as task grids with contraction degrees ru (producer) and rv (consumer)
        see it (`planner.costs.regions.edge_grid`)."""
        src, dst = self.graph.ops[edge.src], self.graph.ops[edge.dst]
        return edge_grid(src, dst, edge.position, self.graph.input_maps(edge), ru, rv)

    def edge_geometry(self, edge: Edge, ru: int = 1, rv: int = 1) -> EdgeGeometry:
        """What t_x of `edge` depends on besides the two configs, for producer configs of
        contraction degree ru and consumer configs of degree rv."""
        src = self.graph.ops[edge.src]
        grid = self.edge_grid(edge, ru, rv)
        return EdgeGeometry(
            in_sizes=grid.in_sizes,
            out_sizes=grid.out_sizes,
            out_dims=grid.out_dims,
            maps=grid.maps,
            nbytes=self.edge_element_bytes(edge)[0],
            grad_nbytes=self.edge_element_bytes(edge)[1],
            backward=src.kind != "input",
            forward_passes=1 + int(self._again(edge.dst)),
        )

    def edge_table(self, edge: Edge, cu: OpConfigs, cv: OpConfigs) -> np.ndarray:
        """t_x for every (producer config, consumer config) pair: (C_u, C_v)
        (`planner.costs.transfer`: per-level sums on a homogeneous cluster, else dense), one
        block per pair of contraction degrees."""
        blocks_u, blocks_v = cu.by_reduce(), cv.by_reduce()
        if len(blocks_u) == 1 and len(blocks_v) == 1:
            (ru, _), (rv, _) = blocks_u[0], blocks_v[0]
            return self._edge_block(edge, ru, rv, cu, cv)
        out = np.zeros((len(cu), len(cv)))
        for ru, rows in blocks_u:
            for rv, cols in blocks_v:
                part = self._edge_block(edge, ru, rv, cu.subset(rows), cv.subset(cols))
                out[np.ix_(rows, cols)] = part
        return out

    def _edge_block(self, edge: Edge, ru: int, rv: int, cu: OpConfigs, cv: OpConfigs) -> np.ndarray:
        geom = self.edge_geometry(edge, ru, rv)
        tables = EdgeTables(geom, self.hierarchy, self.pair_costs, self._layouts)
        return tables.table(cu, cv)

    def node_signature(self, i: int) -> tuple[Any, ...]:
        """Everything op i's node and memory tables depend on (`node_signature`, whether it
        recomputes, and the activation bytes kept of it)."""
        again = self.recomputed.share.get(i) if i in self.recomputed else None
        memory = self.activations.per_op(i)
        return (*node_signature(self.graph, i, self._share(self.graph.ops[i])), again, memory)

    def edge_signature(self, edge: Edge) -> tuple[EdgeGeometry, Any]:
        """Everything `edge`'s t_x table depends on besides the two config lists (the
        geometry, and the consumer's contraction, which its split configs read by)."""
        return self.edge_geometry(edge), contraction(self.graph.ops[edge.dst])


def node_signature(graph: OpGraph, i: int, share: int = 1) -> tuple[Any, ...]:
    """Everything op i's node and memory tables depend on, besides its configs: ops with
    equal signatures and equal config lists have equal tables. Shapes, work, parameter shapes,
    attributes, the folded functions, which inputs are data and the shared-group size; never
    names (the `fused` attribute lists the folded ops' names)."""
    op = graph.ops[i]
    inputs = tuple((graph.op(n).output, graph.op(n).kind == "input") for n in op.inputs)
    attrs = tuple((k, v) for k, v in op.attrs if k != "fused")
    params = tuple((p.shape, p.dtype_bytes) for p in op.params)
    return (op.kind, op.output, params, op.flops, op.mem_bytes, inputs, attrs, fused_ops(op),
            share)  # fmt: skip


def _overlapping_pairs(
    sizes: tuple[int, ...], degrees: tuple[int, ...], nlo: np.ndarray, nhi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (consumer task, producer task) pair whose producer box (equal partition of
    `sizes` by `degrees`) overlaps the consumer's needed box [nlo, nhi) (k_v, n), with the
    overlap volume: the producer cells each needed range meets, enumerated per consumer."""
    width = np.asarray(sizes, dtype=np.int64) // np.asarray(degrees, dtype=np.int64)
    c1 = nlo // width
    c2 = np.where(nhi > nlo, -(-nhi // width), c1)  # an empty need meets nothing
    span = c2 - c1
    counts = np.prod(span, axis=1)
    q = np.repeat(np.arange(len(nlo)), counts)
    rank = np.arange(len(q)) - np.repeat(np.cumsum(counts) - counts, counts)
    idx = np.empty((len(q), len(sizes)), dtype=np.int64)
    for d in range(len(sizes) - 1, -1, -1):  # row-major digits of the rank within the box
        idx[:, d] = c1[q, d] + rank % span[q, d]
        rank //= span[q, d]
    top = np.minimum((idx + 1) * width, nhi[q])
    vol = np.prod(top - np.maximum(idx * width, nlo[q]), axis=1, dtype=np.float64)
    p = np.ravel_multi_index(tuple(idx.T), degrees) if len(sizes) else np.zeros_like(q)
    return q, np.asarray(p, dtype=np.int64), vol


def _boxes(sizes: tuple[int, ...], degrees: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Output boxes [lo, hi) of every task (row-major): two (k, n) arrays."""
    k = math.prod(degrees)
    idx = np.stack(np.unravel_index(np.arange(k), degrees), axis=1).reshape(k, len(degrees))
    step = np.asarray(sizes, dtype=np.int64) // np.asarray(degrees, dtype=np.int64)
    return idx * step, (idx + 1) * step


def _needs(
    maps: tuple[DimMap, ...],
    sizes: tuple[int, ...],
    out_dims: tuple[str, ...],
    olo: np.ndarray,
    ohi: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Input boxes the consumer tasks need, from their output boxes: two (k, n_in) arrays."""
    k = olo.shape[0]
    lo = np.zeros((k, len(maps)), dtype=np.int64)
    hi = np.zeros((k, len(maps)), dtype=np.int64)
    for d, (m, size) in enumerate(zip(maps, sizes, strict=True)):
        if m.kind == "full":
            hi[:, d] = size
            continue
        a, b = olo[:, out_dims.index(m.out_dim)], ohi[:, out_dims.index(m.out_dim)]
        if m.kind == "window":
            a, b = (
                a * m.stride - m.pad,
                (b - 1) * m.stride - m.pad + m.dilation * (m.kernel - 1) + 1,
            )
        elif m.kind == "offset":
            a, b = a - m.offset, b - m.offset
        elif m.kind == "group":
            per = m.per_input_head
            a, b = (a // per) * m.kernel, -(-b // per) * m.kernel
        lo[:, d] = np.clip(a, 0, size)
        hi[:, d] = np.maximum(lo[:, d], np.clip(b, 0, size))
    return lo, hi
