"""Expert parallelism's costs: a mixture of experts' compute, all-to-all, parameters by class.

A `moe` op (`planner.graph.moe`) under a config with `ParallelConfig.expert` e > 1 spreads its
E routed experts over every e consecutive token boxes (an expert-parallel, EP, group): member
m holds experts [m E/e, (m+1) E/e) and runs them on the tokens of the whole group routed to
them (Megatron-Core's alltoall token dispatcher; Lepikhin et al. 2021, GShard, Sec. 2.2).

- **Compute.** The router and the shared expert run on the task's own tokens: their FLOPs /
  tasks. The routed experts' FLOPs are tokens x k active experts (`moe_flops`); with e > 1 the
  busiest rank of a group gets `capacity` (`CostOptions.expert_capacity`, >= 1) times the
  mean share of them: the capacity factor of Fedus et al. 2021 (Switch Transformers, Sec. 2.2:
  expert capacity = tokens per batch / experts x capacity factor) and Megatron-Core's
  `--moe-expert-capacity-factor`. A collective waits for its slowest member, so the op's time
  is that rank's. With e = 1 every task runs its own tokens through all experts: no
  imbalance between devices.
- **All-to-all** (`a2a_seconds`). Dispatch: each member sends each peer the copies of its
  tokens routed to the peer's experts, on average tokens_m x k x h x bytes / e (tokens_m: the
  member's tokens; each token goes to k experts, E/e of the E on each member); the busiest
  receiver gets `capacity` times that from each peer. Combine returns the expert outputs the
  same way (the busiest rank sends `capacity` times the mean). The backward pass runs the two
  again, reversed (the gradients of the combine, then of the dispatch): 4 all-to-alls per
  step. A member's messages leave through its egress one after another and arrive through
  its ingress one after another (NCCL's all-to-all: one send and one receive per peer on one
  GPU's links); an all-to-all lasts, for a member, the slower of the two, each message
  priced by the device graph's pair costs (NVLink peers at NVLink, peers on other nodes at
  the NIC's InfiniBand bandwidth, plus the message's fixed cost); the group waits for its
  slowest member. Per member and direction that is tokens_m x k x h x bytes x (e - 1) / e.
- **Parameters by class** (`param_classes`): the router (and its bias) and the shared
  expert are replicated on every task of the op (their gradients synchronized over all of
  them, as a data-parallel weight's); the routed experts are cut e ways: each expert's
  weights, gradients and optimizer state live on one member of each EP group, replicated on
  the tasks with the same expert rank (Megatron-Core's expert-data-parallel group, size
  tasks / e), which synchronize their gradients and over which ZeRO shards their state.
- **Activations.** What a mixture of experts keeps for the backward
  (`planner.costs.activations`): the dispatched part (the k copies of each token, the experts'
  outputs and hidden activations) lives on the expert's rank: the busiest keeps `capacity`
  times the mean (`planner.costs.activations.moe_dispatched_bytes` per token).

**Expert tensor parallelism** (a config's `reduce` t > 1, Megatron-Core's
`--expert-tensor-parallel-size`): each token box is computed by t tasks that read the same
tokens (the consumers add their partial sums: priced as any contraction split's, a
reduce-scatter or an all-reduce of the partials on the device graph), each holding 1/t of
every expert's hidden width (`planner.graph.moe.ffn_shard`). Per task: the router (and the
shared expert's gate) run whole on the box's tokens, replicated; the routed and shared
experts' GEMMs have f / t (fs / t) columns or rows; the permutation, the un-permutation and
the all-to-alls move every token of the box (each of the t tasks dispatches the box's
tokens to its own expert-parallel group, `ParallelConfig.expert_groups`: one group per
partial index), so an all-to-all is t times the volume Megatron-Core's dispatcher moves
when its TP ranks hold disjoint tokens and all-gather them inside the expert-tensor group
after the dispatch; only the activation's hidden elements and what the experts keep of
them are cut t ways. The parameters: the router, its bias and the shared gate replicated on
every task; the shared expert cut t ways (replicated over the boxes); the routed experts cut
e x t ways (`expert_replicas`).

Not modelled: all-to-all traffic contending with other transfers on the same links (the
simulator prices it as device-occupying exchange tasks), NVLink and InfiniBand messages of
one member running at once (serialised here), dropped tokens (the runtime is dropless:
`capacity` only prices the imbalance), the SMs a dispatch kernel takes from the GEMMs.
`node_a2a_seconds` prices DeepEP's node dispatch (`CostOptions.ep_dispatch`). Under the "transformer-engine" precisions the
experts' GEMMs run in FP8 and the router's in bf16 (`expert_gemm_seconds`' `experts`;
`planner.costs.fp8`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from planner.costs.activations import moe_buffers, moe_dispatched_bytes
from planner.graph.moe import ffn_axis, is_routed, moe_flops, moe_spec, tokens_of
from planner.graph.opkinds import CHANNEL

if TYPE_CHECKING:
    from planner.costs.config import ParallelConfig
    from planner.costs.rates import GemmFit
    from planner.graph.moe import MoESpec
    from planner.graph.opgraph import Op, Param

__all__ = [
    "a2a_bytes",
    "a2a_seconds",
    "cuts_experts",
    "kept_by_task",
    "expert_gemm_seconds",
    "expert_replicas",
    "moe_task_flops",
    "param_classes",
    "spreads_experts",
    "token_pass_bytes",
    "EP_DISPATCHES",
    "node_a2a_seconds",
    "nodes_per_token",
]

PairCosts = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def spreads_experts(op: Op, cfg: ParallelConfig) -> bool:
    """Whether `cfg` spreads op's routed experts over more than one task."""
    return op.kind == "moe" and cfg.expert > 1


def cuts_experts(op: Op, cfg: ParallelConfig) -> bool:
    """Whether `cfg` places a moe op's parameters by class (`param_classes`): it spreads its
    experts or cuts their hidden width (expert tensor parallelism, `reduce` > 1)."""
    return op.kind == "moe" and (cfg.expert > 1 or cfg.reduce > 1)


def box_tokens(op: Op, cfg: ParallelConfig) -> float:
    """Tokens of one task's box: every task of a token box (its t expert-tensor-parallel
    partials) reads all of them."""
    return tokens_of(op.output.sizes) / (cfg.num_tasks // cfg.reduce)


def routed_flops(op: Op) -> float:
    """Forward FLOPs of op's k active routed experts over all its tokens."""
    spec = moe_spec(op)
    return moe_flops(spec, op.output.size(CHANNEL), tokens_of(op.output.sizes)).experts


def router_flops(op: Op) -> float:
    """Forward FLOPs of op's router over all its tokens."""
    spec = moe_spec(op)
    return moe_flops(spec, op.output.size(CHANNEL), tokens_of(op.output.sizes)).router


def moe_task_flops(op: Op, cfg: ParallelConfig, capacity: float) -> float:
    """Forward FLOPs of the busiest task of a moe op: the experts' / tasks (the routed ones
    times `capacity` when the experts are spread), the router's / token boxes (each of a
    box's expert-tensor-parallel tasks routes all its tokens; module doc)."""
    flops = op.flops / cfg.num_tasks
    if cfg.reduce > 1:
        flops += router_flops(op) * (cfg.reduce - 1) / cfg.num_tasks
    if not spreads_experts(op, cfg):
        return flops
    return flops + (capacity - 1.0) * routed_flops(op) / cfg.num_tasks


def a2a_bytes(op: Op, cfg: ParallelConfig) -> float:
    """Bytes one member of an EP group sends each peer in one all-to-all on average:
    tokens_m x k x h x bytes / e, tokens_m its box's tokens (module doc)."""
    spec = moe_spec(op)
    h = op.output.size(CHANNEL)
    return box_tokens(op, cfg) * spec.top_k * h * op.output.dtype_bytes / cfg.expert


def token_pass_bytes(op: Op, cfg: ParallelConfig, capacity: float) -> float:
    """Bytes one task of a moe op moves in its memory-bound kernels in the forward pass, on
    top of its GEMMs: the router's fp32 scores (written, softmaxed, ranked: 16 bytes per
    expert per token), the permutation (each token read, its k copies written in expert
    order), the experts' activation (SwiGLU reads the w1 and w3 outputs and writes their
    product: 3 f per copy; 2 f ungated) on the busiest rank's `capacity` x its share of the
    copies when the experts are spread, the un-permutation with the gate weights (k copies
    read, the token written), and the shared expert's activation and its sum into the output
    (3 h). Megatron-Core runs each as its own kernel (moe/token_dispatcher.py, experts.py), so
    they add to the GEMMs' time rather than hide under it. Under expert tensor parallelism
    every task passes its box's tokens, and the hidden widths are its 1/t."""
    spec = moe_spec(op)
    h, b, k, t = op.output.size(CHANNEL), op.output.dtype_bytes, spec.top_k, cfg.reduce
    spread = capacity if spreads_experts(op, cfg) else 1.0
    per_token = 16.0 * spec.experts + b * (2 * h + 2 * k * h)
    per_token += b * k * spec.matrices * spec.ffn / t * spread
    if spec.shared_ffn:
        per_token += b * (spec.matrices * spec.shared_ffn / t + 3 * h)
    return box_tokens(op, cfg) * per_token


def expert_replicas(cfg: ParallelConfig) -> np.ndarray:
    """(e t, tasks / (e t)) task indices: row m t + j holds the tasks of expert rank m and
    partial index j (each holds the same slice of the same experts: Megatron-Core's
    expert-data-parallel group), in task order; t = `reduce`, 1 without expert tensor
    parallelism."""
    tasks = np.arange(cfg.num_tasks)
    ranks = (tasks // cfg.reduce) % cfg.expert
    part = tasks % cfg.reduce
    return np.stack(
        [tasks[(ranks == m) & (part == j)] for m in range(cfg.expert) for j in range(cfg.reduce)]
    )


def a2a_seconds(
    pair_costs: PairCosts, cfg: ParallelConfig, nbytes: float, capacity: float
) -> tuple[np.ndarray, np.ndarray]:
    """(dispatch, combine) seconds per task of one all-to-all each, every member sending each
    peer `nbytes` on average and the busiest receiving (dispatch) or sending (combine)
    `capacity` times that; a member's egress and ingress each serialise its messages, and
    every member of a group waits for the group's slowest (module doc)."""
    groups = np.asarray(cfg.expert_groups(), dtype=np.int64)  # (groups, e) task indices
    devs = np.asarray(cfg.devices, dtype=np.int64)[groups]
    e = devs.shape[1]
    src = np.repeat(devs[:, :, None], e, axis=2)  # [g, m, p]: m sends to p
    dst = np.repeat(devs[:, None, :], e, axis=1)
    off = ~np.eye(e, dtype=bool)[None, :, :]
    inv, msg = pair_costs(src, dst)
    inv, msg = np.where(off, inv, 0.0), np.where(off, msg, 0.0)

    def collective(sent: float, received: float) -> np.ndarray:
        egress = (sent * inv + msg).sum(axis=2)  # [g, m]
        ingress = (received * inv + msg).sum(axis=1)  # [g, p]: what p receives
        slowest = np.maximum(egress, ingress).max(axis=1)  # [g]
        out = np.zeros(cfg.num_tasks)
        out[groups] = slowest[:, None]
        return out

    return collective(nbytes, capacity * nbytes), collective(capacity * nbytes, nbytes)


EP_DISPATCHES = ("direct", "node")


def nodes_per_token(op: Op, nodes: int) -> float:
    """The expected number of nodes a token's k chosen experts sit on, of an expert-parallel
    group spread over `nodes` nodes with the experts in contiguous blocks per node: k experts
    chosen uniformly, n (1 - (1 - 1/n)^k); at most `topk_groups` when group-limited routing's
    groups fall whole on nodes (DeepSeek-V3's node-limited routing: groups of experts = nodes,
    a token's experts in at most 4 of them, Sec. 2.1.2 and 3.2.2)."""
    spec = moe_spec(op)
    expected = nodes * (1.0 - (1.0 - 1.0 / nodes) ** spec.top_k)
    if spec.groups > 1 and spec.groups % nodes == 0:
        expected = min(expected, float(spec.topk_groups))
    return min(expected, float(spec.top_k))


def node_a2a_seconds(
    pair_costs: PairCosts,
    op: Op,
    cfg: ParallelConfig,
    hosts: np.ndarray,
    nbytes: float,
    capacity: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(dispatch, combine) seconds per task of one all-to-all each that moves a token to each
    node it uses once (DeepEP's normal kernels, DeepSeek-V3 Sec. 3.2.2): over InfiniBand to the
    GPU with the same place on that node, then over NVLink to the GPUs of its experts there,
    the two pipelined (a member's time is the slower). `nbytes` is `a2a_bytes`' mean per peer
    (tokens_m x k x h x bytes / e): across nodes a member sends each other node of its group
    tokens_m x h x bytes x (expected remote nodes per token) / (nodes - 1)
    (`nodes_per_token`); over NVLink it hands each of its node's other g - 1 members of the
    group the copies for their experts, tokens_m x k x h x bytes / g each (n nodes, g = e / n
    members on each). A group on one node is `a2a_seconds`'s."""
    groups = np.asarray(cfg.expert_groups(), dtype=np.int64)
    devs = np.asarray(cfg.devices, dtype=np.int64)[groups]  # [g, e]
    node_of = hosts[devs]
    n = len(np.unique(node_of[0]))
    if n == 1:
        return a2a_seconds(pair_costs, cfg, nbytes, capacity)
    e = devs.shape[1]
    g = e // n
    spec = moe_spec(op)
    token_bytes = nbytes * e / spec.top_k  # tokens_m x h x bytes
    remote = nodes_per_token(op, n) * (n - 1) / n
    per_node = token_bytes * remote / (n - 1)
    # over NVLink a member hands each other member of its node the copies for that member's
    # experts that reached it (its own tokens' and, as the IB receiver of its place, the
    # other nodes'): a member receives tokens_m x k copies in all, 1/g of them directly
    forward = nbytes * n
    # the IB leg: member m to the member of each other node at the same place on that node
    place = np.arange(e) % g
    src = np.repeat(devs[:, :, None], e, axis=2)
    dst = np.repeat(devs[:, None, :], e, axis=1)
    cross = (node_of[:, :, None] != node_of[:, None, :]) & (place[:, None] == place[None, :])
    same = (node_of[:, :, None] == node_of[:, None, :]) & ~np.eye(e, dtype=bool)[None]
    inv, msg = pair_costs(src, dst)

    def leg(mask: np.ndarray, sent: float, received: float) -> np.ndarray:
        i, m = np.where(mask, inv, 0.0), np.where(mask, msg, 0.0)
        egress = (sent * i + m).sum(axis=2)
        ingress = (received * i + m).sum(axis=1)
        return np.maximum(egress, ingress)  # [g, member]

    def collective(sent: float, received: float) -> np.ndarray:
        ib = leg(cross, per_node * sent, per_node * received)
        nvl = leg(same, forward * sent, forward * received)
        slowest = np.maximum(ib, nvl).max(axis=1)
        out = np.zeros(cfg.num_tasks)
        out[groups] = slowest[:, None]
        return out

    return collective(1.0, capacity), collective(capacity, 1.0)


def param_classes(op: Op, cfg: ParallelConfig) -> list[tuple[tuple[Param, ...], np.ndarray]]:
    """A moe op's parameters by class when its experts are spread: (the router's and the
    shared expert's, None: replicated like any weight), (the routed experts', their replica
    tasks: `expert_replicas`). Under expert tensor parallelism (`reduce` t > 1) three, each
    with its (shards, replicas) task array: the router, its bias and the shared gate on every
    task; the shared expert cut t ways (shard j on the tasks of partial j); the routed
    experts cut e t ways (`expert_replicas`); classes without parameters left out. One class
    of all parameters otherwise (empty tasks array: the op's own replica rule)."""
    none = np.zeros((0, 0), dtype=np.int64)
    if not cuts_experts(op, cfg):
        return [(op.params, none)]
    roles = moe_spec(op).roles
    pairs = list(zip(op.params, roles, strict=True))
    routed = tuple(p for p, r in pairs if is_routed(r))
    dense = tuple(p for p, r in pairs if not is_routed(r))
    if cfg.reduce == 1:
        return [(dense, none), (routed, expert_replicas(cfg))]
    tasks = np.arange(cfg.num_tasks, dtype=np.int64)
    replicated = tuple(p for p, r in pairs if not is_routed(r) and ffn_axis(r) is None)
    shared = tuple(p for p, r in pairs if not is_routed(r) and ffn_axis(r) is not None)
    classes = [
        (replicated, tasks[None, :]),
        (shared, tasks.reshape(-1, cfg.reduce).T),
        (routed, expert_replicas(cfg)),
    ]
    return [(params, where) for params, where in classes if params]


def kept_by_task(op: Op, cfg: ParallelConfig, capacity: float) -> float:
    """Bytes one task of a moe op keeps of its own buffers for the backward
    (`planner.costs.activations.moe_buffers`) under cfg: its box's tokens', the hidden widths
    cut `reduce` ways, the dispatched part on the busiest expert-parallel rank `capacity`
    times the mean when cfg spreads the experts."""
    h = op.output.size(CHANNEL)
    t = cfg.reduce
    per_token = moe_buffers(op, t) * h * op.output.dtype_bytes
    if spreads_experts(op, cfg):
        per_token += (capacity - 1.0) * moe_dispatched_bytes(op, t) * op.output.dtype_bytes
    return box_tokens(op, cfg) * per_token


def expert_gemm_seconds(
    op: Op,
    cfg: ParallelConfig,
    gemm: GemmFit,
    peak: float,
    capacity: float,
    experts: tuple[GemmFit, float] | None = None,
) -> tuple[float, float]:
    """(forward, backward) seconds of one task of a moe op as its GEMMs at the shaped rates
    (`planner.costs.rates.GemmFit`): the router (m x E, contracting h) and the shared
    expert's as plain GEMMs on the task's m tokens; the routed experts as grouped GEMMs of
    the task's E / e local experts, each on m_x = group tokens x k / E rows (times
    `capacity` when spread): per gated expert three (w1 and w3: m_x x f contracting h; w2:
    m_x x h contracting f), each backward twice (the input gradient, and the weight
    gradient contracting the m_x rows). A grouped GEMM of b problems runs at the fraction
    of one GEMM of b x m_x rows (GemmFit's convention for batched GEMMs); a weight gradient
    at that of its b x f outputs and m_x-long contraction, with one launch per grouped
    GEMM. `experts`: the (fit, peak) the routed and shared experts' GEMMs run at when they
    differ from the router's (an FP8 moe, `planner.costs.fp8`: the router stays bf16).
    Tile waste of uneven per-expert rows (Megatron-Core's padded grouped GEMM) is not
    modelled."""
    spec = moe_spec(op)
    t = cfg.reduce  # expert tensor parallelism: the hidden widths' 1/t, the box's tokens
    h, f, fs = op.output.size(CHANNEL), spec.ffn / t, spec.shared_ffn / t
    m = box_tokens(op, cfg)
    local = spec.experts // cfg.expert
    rows = m * cfg.expert * spec.top_k / spec.experts
    if cfg.expert > 1:
        rows *= capacity
    forward = backward = 0.0
    fit, fit_peak = experts or (gemm, peak)

    def dense(n: float, k: float, count: int = 1, g: GemmFit = gemm, top: float = peak) -> None:
        nonlocal forward, backward
        if n < 1 or m < 1:
            return
        forward += count * g.seconds(m, n, k, top)
        backward += count * (g.seconds(m, k, n, top) + g.seconds(n, k, m, top))

    def grouped(n: float, k: float) -> float:
        flops = 2.0 * local * rows * n * k
        return fit.launch + flops / (fit_peak * fit.fraction(local * rows, n, k))

    def grouped_grad(n: float, k: float) -> float:  # dW: local problems of n x k over rows
        flops = 2.0 * local * rows * n * k
        return fit.launch + flops / (fit_peak * fit.fraction(local * n, k, max(rows, 1.0)))

    dense(spec.experts, h)
    if fs:
        dense(fs, h, spec.matrices - 1, fit, fit_peak)
        dense(h, fs, 1, fit, fit_peak)
    if rows > 0:
        for n, k in [(f, h)] * (spec.matrices - 1) + [(h, f)]:
            forward += grouped(n, k)
            backward += grouped(k, n) + grouped_grad(n, k)
    extra = max(0.0, moe_task_flops(op, cfg, 1.0) - _gemm_flops(spec, h, m, t))
    return forward + extra / (peak * gemm.cap), backward + 2 * extra / (peak * gemm.cap)


def _gemm_flops(spec: MoESpec, h: int, m: float, t: int = 1) -> float:
    """Forward FLOPs of the GEMMs `expert_gemm_seconds` prices, on m tokens at capacity 1,
    the hidden widths cut t ways."""
    per_token = 2.0 * h * spec.experts + 2.0 * spec.matrices * h * spec.shared_ffn / t
    per_token += spec.top_k * 2.0 * spec.matrices * h * spec.ffn / t
    return m * per_token
