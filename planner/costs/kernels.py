"""Per-task kernels: one task of an op under a ParallelConfig, computed on its sub-tensors.

A task owns a box of the op's output tensor (`planner.costs.regions.task_boxes`, row-major task
order) and reads, from each input tensor, the box that `planner.costs.regions.needed_boxes` derives
from the op kind's `DimMap`s: exactly the regions the cost model prices in t_x. The task's
parameters are the op's parameters sliced along its Parameter dims
(`planner.graph.opkinds.parameter_dims`): a channel split of a conv holds the weight rows of its
output channels; Sample and Attribute splits hold whole replicas.

`plan_task` turns (graph, op index, config, task) into a `TaskPlan`: the output box, the
needed input boxes, the zero (or -inf) padding a window op adds where its box touches the
border of the input (a task inside a height split gets a halo of real rows instead), and the
shapes of its parameter shards. `run_task(plan, inputs, params)` computes the task's output
box from its input boxes and parameter shards with torch; `shard_params` slices full
parameters into a task's shards; `task_fn` builds random inputs and parameters for a plan and
returns a closure to time forward + backward (`planner.costs.profile`).

Conventions of the op kinds (see `planner.graph.capture`):
- conv2d: params (weight (Cout, Cin/groups, kh, kw), [bias]); attrs kernel, stride, padding,
  dilation, groups. A channel split divides whole groups; a task reads the input channels of
  its groups.
- pool2d: attrs kernel, stride, padding, dilation, mode "max"/"avg" (padding counts in the
  average, as torch's default count_include_pad=True); adaptive pools are fixed windows.
- linear: (weight (out, in), [bias]) over the flattened non-sample (and non-length) dims;
  attr transposed: weight (in, out), as Hugging Face's Conv1D holds it.
- embedding: weight (vocab, C), the task holds columns of its channels; integer token input.
- lstm: LSTMCell (weight_ih, weight_hh, [bias_ih, bias_hh]) with gates i, f, g, o stacked
  along rows; a channel split holds the rows of its hidden units in each gate. With a
  previous step, the inputs are (x, h_prev, c_prev): the previous op's output stands for the
  (h, c) pair, and c_prev has the same box as h_prev.
- attention: q, k, v (sample, length, channel), attrs heads, causal, [kv_heads, scale,
  head_dim, v_head_dim, rope, rope_dim, mla, qk_norm] (`planner.graph.opkinds.AttentionDims`,
  `planner.graph.attention.attention_math`); channel splits by heads (k and v: the kv_heads
  groups those heads read; MLA's shared rotary key whole); QK-norm's two weights are whole in
  every task; a length split gives each task its query rows (k and v whole), with the
  causal mask at the task's absolute positions.
- moe: a mixture of experts over the channel (`planner.graph.moe`: params by attr roles,
  none split with the channel); a sample or length split gives each task its tokens, which
  it routes and runs through the experts alone; under expert parallelism (`expert` e > 1) a
  task holds its group member's E/e routed experts (rows of a stacked weight) and swaps
  token copies with its group through the runtime's `exchange` (`expert_parallel_moe`);
  under expert tensor parallelism (`reduce` r > 1) each of r tasks reads the same tokens,
  holds 1/r of every expert's hidden width (`planner.graph.moe.ffn_shard`) and computes a
  partial sum of their output.
- rnn_attention: (h, encoder states...), params of the output projection (C, 2C) + bias.
- norm: "batch" (batch statistics of the task's box), "layer" (over channel) or "rms" (root
  mean square over channel, weight only); attrs eps, and compute "float32" when the model
  computes the norm in float32 whatever its dtype.
- elementwise: attr "op" (or "fn"): add/sub/mul/div over its inputs (and attr scalar, a
  number operand: first with scalar_first; scalar_node names the model's 0-d constant
  whose value the runtime fills in as scalar), or a unary function.
- slice: attrs dim, start, size: its input box is the output's, shifted by start.
- concat: attrs dim, offsets. flatten: reshape to (sample, features). softmax: over channel
  (attr op softmax / log_softmax / cross_entropy: the log-softmax part of the loss).
- Folded ops (attr "fused", set by `planner.graph.coarsen`) are applied after the op: a folded norm
  (attr norm) with its two parameters, then the folded pointwise ops. The graph records
  only their names, so the function is read from attr "fused_ops" when present and guessed
  from the name otherwise (drop -> dropout, gelu, tanh, ..., default relu). Parameters that
  belong to no role above (e.g. a positional embedding folded into an embedding's add) are
  added, broadcast from the right as torch would.

Batch norm on a task that holds part of the samples uses the task's own batch statistics:
exact only when the sample, height and width dims are not split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from planner.costs.config import ParallelConfig, check_config
from planner.costs.regions import needed_boxes, task_boxes
from planner.errors import GraphError
from planner.graph.attention import RMS_ATTRS, attention_math, rms_norm
from planner.graph.capture import ACTIVATIONS
from planner.graph.moe import (
    MoESpec,
    Weights,
    expert_of,
    ffn_shard,
    ffn_shard_shape,
    is_routed,
    mlp,
    moe_math,
    moe_spec,
    route,
    shared_forward,
)
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opgraph import Tensor as Shape
from planner.graph.opkinds import (
    CHANNEL,
    HEIGHT,
    KINDS,
    LENGTH,
    REDUCE,
    SAMPLE,
    WIDTH,
    DimMap,
    attention_dims,
    contraction,
    fused_ops,
    input_dim_map,
    parameter_dims,
    stats_groups,
)

__all__ = [
    "KERNELS",
    "ExpertExchange",
    "conv_input_channels",
    "expert_parallel_moe",
    "TaskPlan",
    "fused_ops",
    "infer_input_shapes",
    "plan_op",
    "plan_task",
    "run_task",
    "shard_params",
    "task_fn",
]

Box = tuple[tuple[int, int], ...]
Pads = tuple[int, int, int, int]  # (left, right, top, bottom), the order of F.pad

# Pointwise functions by name (elementwise "op" attrs, fused-op names).
_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    **ACTIVATIONS,  # what capture recognises a module by (`activation_of`)
    "relu6": F.relu6,
    "exp": torch.exp,
    "neg": torch.neg,
    "leaky_relu": F.leaky_relu,
    "leakyrelu": F.leaky_relu,
    "hardtanh": F.hardtanh,
    "dropout": lambda x: F.dropout(x, 0.5, training=True),
    "identity": lambda x: x,
}
_BINARY: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "truediv": torch.div,
}
_NORMS = ("batch_norm", "layer_norm")
BN_EPS = 1e-5  # torch's default; the runtime passes the model's own (Inception-v3: 1e-3)
# Parameters of the op itself (not of folded ops): per kind, at most this many, each with the
# axis that the channel (Parameter dim) splits and how many stacked blocks that axis holds.
_OWN_PARAMS: dict[str, tuple[tuple[int, int], ...]] = {
    "conv2d": ((0, 1), (0, 1)),
    "linear": ((0, 1), (0, 1)),
    "embedding": ((1, 1),),
    "lstm": ((0, 4), (0, 4), (0, 4), (0, 4)),
    "rnn_attention": ((0, 1), (0, 1)),
    "norm": ((0, 1), (0, 1)),
    "attention": ((-1, 1), (-1, 1)),  # QK-norm's q and k weights (head_dim,): whole per task
}


@dataclass(frozen=True)
class ParamRole:
    """What a parameter is to the kernel and how the task's shard is cut from it.

    role: "own" (the op's weights, in order), "norm" (a folded norm's weight and bias) or
    "extra" (added to the output, broadcast from the right). `axis` is the axis that a split of
    the channel dim slices (None: replicated), holding `blocks` stacked channel-sized blocks.
    """

    role: str
    axis: int | None
    blocks: int = 1


@dataclass(frozen=True)
class TaskPlan:
    """One task of `op` under partition `degrees`: its boxes, paddings and parameter shards."""

    op: Op
    degrees: tuple[int, ...]
    task: int
    out_box: Box
    in_shapes: tuple[Shape, ...]  # the full input tensors (named dims)
    in_boxes: tuple[Box, ...]  # the box of each input the task reads
    pads: tuple[Pads | None, ...]  # window ops: border padding of each input box
    roles: tuple[ParamRole, ...]
    param_shapes: tuple[tuple[int, ...], ...]  # the task's parameter shards
    fused: tuple[str, ...]  # folded functions applied after the op, in order
    pre: tuple[str, ...] = ()  # folded functions applied to the (single) input first
    # Batch norm whose config splits samples, height or width: the positions per channel over
    # which the task's group (the tasks with the same channels) sums its statistics; 0 when
    # the task normalizes with its own statistics.
    stats_count: int = 0
    # Inputs read from the graph's input ops (data): no gradient flows back to them, so the
    # runtime and the profiler do not compute one (a first conv's is costly).
    data_inputs: tuple[int, ...] = ()
    # A contraction split's task (`ParallelConfig.reduce`): the range of the summed dim it
    # sums over (its input box and weight shard hold that slice); it computes a partial sum
    # of its output box, with the bias only in the task that starts the range at 0.
    summed: tuple[int, int] | None = None
    # A moe task under expert parallelism (`ParallelConfig.expert` e > 1): the routed experts
    # [lo, hi) it holds and runs, and e; None when it holds them all (e = 1).
    experts: tuple[int, int] | None = None
    expert_degree: int = 1

    @property
    def adds_bias(self) -> bool:
        """Whether the task adds the op's bias: not a partial sum after the first."""
        return self.summed is None or self.summed[0] == 0

    def needs_grad(self, pos: int) -> bool:
        """Whether input `pos` (c_prev of an LSTM step: the last) gets a gradient."""
        return pos not in self.data_inputs

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.out_box)

    def box_shape(self, pos: int) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.in_boxes[pos])

    def out_range(self, dim: str) -> tuple[int, int]:
        """The task's [lo, hi) along output dim `dim` (the whole range if `dim` is absent)."""
        if dim in self.op.output.dims:
            return self.out_box[self.op.output.dims.index(dim)]
        return (0, 1)

    def select(self, pos: int) -> tuple[int, int] | None:
        """(axis, index) when input `pos` is read at one position (attr select, x[:, t])."""
        sel = self.op.attr("select")
        if sel is None:
            return None
        dim, index = sel[0], int(sel[1])
        dims = self.in_shapes[pos].dims
        if dim in dims and dim not in self.op.output.dims:
            return dims.index(dim), index
        return None

    def is_index_input(self, pos: int) -> bool:
        """Integer token inputs (the embedding's)."""
        return self.op.kind == "embedding" and pos == 0

    def compute_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shapes the kernel computes on, input by input: after the selection of one
        position, the channel slice of a grouped conv's groups, the border padding of window
        ops and the flattening of a linear's features (plus c_prev for an LSTM step). They do
        not depend on how much of a window's reach is real rows or padding, so a task's key
        is the same whether input sizes come from the graph or from `infer_input_shapes`."""
        out = []
        for pos in range(len(self.in_shapes)):
            dims = list(self.in_shapes[pos].dims)
            sizes = list(self.box_shape(pos))
            pads = self.pads[pos]
            if pads is not None:
                left, right, top, bottom = pads
                sizes[dims.index(HEIGHT)] += top + bottom
                sizes[dims.index(WIDTH)] += left + right
            if self.op.kind == "conv2d" and CHANNEL in dims:
                sizes[dims.index(CHANNEL)] = conv_input_channels(self)[1]
            sel = self.select(pos)
            if sel is not None:
                del dims[sel[0]], sizes[sel[0]]
            if self.op.kind in ("linear", "flatten"):
                keep = _kept_dims(self.op, dims)
                sizes = [sizes[dims.index(d)] for d in keep] + [
                    math.prod(s for d, s in zip(dims, sizes, strict=True) if d not in keep)
                ]
            out.append(tuple(sizes))
        if self.op.kind == "lstm" and len(out) == 2:
            out.append(out[1])
        return tuple(out)


# -- plans -------------------------------------------------------------------------------------


def plan_task(graph: OpGraph, index: int, cfg: ParallelConfig, task: int | None = None) -> TaskPlan:
    """The plan of task `task` of op `index` under `cfg` (None: the task reading the most).

    Input boxes are `needed_boxes` of the consumer's output boxes with the maps of the graph's
    edges (`graph.input_maps`), as in `CostModel.edge_table`."""
    op = graph.ops[index]
    edges = sorted((e for e in graph.edges if e.dst == index), key=lambda e: e.position)
    shapes = [graph.input_tensor(e) for e in edges]
    maps = [graph.input_maps(e) for e in edges]
    plan = _plan(op, shapes, maps, cfg, task)
    data = tuple(k for k, e in enumerate(edges) if graph.ops[e.src].kind == "input")
    return replace(plan, data_inputs=data) if data else plan


def plan_op(op: Op, cfg: ParallelConfig, task: int | None = None) -> TaskPlan:
    """Like `plan_task` for an op without its graph: input sizes from `infer_input_shapes`."""
    shapes = infer_input_shapes(op)
    maps = [input_dim_map(op, pos, t) for pos, t in enumerate(shapes)]
    return _plan(op, shapes, maps, cfg, task)


def _plan(
    op: Op,
    shapes: Sequence[Shape],
    maps: Sequence[tuple[DimMap, ...]],
    cfg: ParallelConfig,
    task: int | None,
) -> TaskPlan:
    if op.kind not in KINDS:
        raise GraphError(f"no kernel for op kind {op.kind!r}; known kinds: {', '.join(KINDS)}")
    check_config(op, cfg, max(cfg.devices, default=0) + 1)
    ntasks = cfg.num_tasks
    parts = np.array([cfg.grid], dtype=np.int64)
    out_sizes, out_dims = op.output.sizes, op.output.dims
    con = contraction(op) if cfg.reduce > 1 else None
    if con is not None:  # task grid: the output and the summed dim (planner.costs.regions)
        out_sizes, out_dims = (*out_sizes, con.size), (*out_dims, REDUCE)
        maps = [
            tuple(
                DimMap("same", REDUCE) if pos == con.position and dim == con.dim else m
                for dim, m in zip(t.dims, ms, strict=True)
            )
            for pos, (ms, t) in enumerate(zip(maps, shapes, strict=True))
        ]
    olo, ohi = task_boxes(out_sizes, parts, ntasks)
    needs = [
        needed_boxes(m, t.sizes, out_dims, olo, ohi) for m, t in zip(maps, shapes, strict=True)
    ]
    if task is None:
        volume = sum((hi - lo).prod(axis=2)[0] for lo, hi in needs) if needs else np.zeros(ntasks)
        task = int(np.argmax(volume))
    if not 0 <= task < ntasks:
        raise GraphError(f"op {op.name!r}: task {task} out of range ({ntasks} tasks)")
    grid_box = _box(olo[0, task], ohi[0, task])
    out_box = grid_box[: len(op.output.dims)]
    summed = grid_box[-1] if con is not None else None
    in_boxes = tuple(_box(lo[0, task], hi[0, task]) for lo, hi in needs)
    pads = tuple(
        _pads(op, m, t, box, out_box) for m, t, box in zip(maps, shapes, in_boxes, strict=True)
    )
    roles = _param_roles(op)
    c_lo, c_hi = _channel_range(op, out_box)
    param_shapes = tuple(
        _shard_shape(p.shape, r, op, c_lo, c_hi) for p, r in zip(op.params, roles, strict=True)
    )
    if con is not None and summed is not None and con.internal:  # a moe op's ffn slices
        widths = con.size // (summed[1] - summed[0])
        param_shapes = tuple(
            ffn_shard_shape(s, role, widths)
            for s, role in zip(param_shapes, moe_spec(op).roles, strict=True)
        )
    elif con is not None and summed is not None:  # the weight's slice of the summed dim
        shape = list(param_shapes[con.param])
        shape[con.axis] = summed[1] - summed[0]
        param_shapes = (*param_shapes[: con.param], tuple(shape), *param_shapes[con.param + 1 :])
    experts = _expert_range(op, cfg, task)
    if experts is not None:
        param_shapes = tuple(
            _expert_shard_shape(s, role, experts)
            for s, role in zip(param_shapes, moe_spec(op).roles, strict=True)
        )
    return TaskPlan(
        op=op,
        degrees=tuple(cfg.degrees),
        task=task,
        out_box=out_box,
        in_shapes=tuple(shapes),
        in_boxes=in_boxes,
        pads=pads,
        roles=roles,
        param_shapes=param_shapes,
        fused=fused_ops(op),
        pre=tuple(str(f) for f in op.attr("pre_ops", ())),
        stats_count=_stats_count(op, cfg),
        summed=summed,
        experts=experts,
        expert_degree=cfg.expert if experts is not None else 1,
    )


def _expert_range(op: Op, cfg: ParallelConfig, task: int) -> tuple[int, int] | None:
    """The routed experts [lo, hi) task `task` holds under expert parallelism (None: e = 1):
    member m of its group holds [m E/e, (m+1) E/e) (`ParallelConfig.expert_groups`)."""
    if op.kind != "moe" or cfg.expert == 1:
        return None
    per = moe_spec(op).experts // cfg.expert
    m = cfg.expert_rank(task)
    return (m * per, (m + 1) * per)


def _expert_shard_shape(
    shape: tuple[int, ...], role: str, experts: tuple[int, int]
) -> tuple[int, ...]:
    """The shape of a moe parameter that a task holding routed experts [lo, hi) keeps: a
    stacked expert weight its rows [lo, hi), another expert's own weight nothing (0 rows),
    the router and the shared expert whole."""
    lo, hi = experts
    if not is_routed(role):
        return shape
    index = expert_of(role)
    if index is None:
        return (hi - lo, *shape[1:])
    return shape if lo <= index < hi else (0, *shape[1:])


def _stats_count(op: Op, cfg: ParallelConfig) -> int:
    """Positions per channel of a batch norm whose statistics several tasks share (see
    TaskPlan.stats_count), else 0."""
    if stats_groups(op, cfg.degrees) is None:
        return 0
    return op.output.numel // op.output.size(CHANNEL)


def _box(lo: np.ndarray, hi: np.ndarray) -> Box:
    return tuple((int(a), int(b)) for a, b in zip(lo, hi, strict=True))


def _pads(op: Op, maps: tuple[DimMap, ...], shape: Shape, box: Box, out_box: Box) -> Pads | None:
    """Border padding of a window op's input box: what its window reaches beyond the input."""
    if op.kind not in ("conv2d", "pool2d"):
        return None
    reach: dict[str, tuple[int, int]] = {}
    for dim, m, (a, b) in zip(shape.dims, maps, box, strict=True):
        if m.kind != "window":
            continue
        o_lo, o_hi = out_box[op.output.dims.index(m.out_dim)]
        lo = o_lo * m.stride - m.pad
        hi = (o_hi - 1) * m.stride - m.pad + m.dilation * (m.kernel - 1) + 1
        reach[dim] = (max(0, a - lo), max(0, hi - b))
    if HEIGHT not in reach or WIDTH not in reach:
        raise GraphError(f"op {op.name!r} ({op.kind}) needs an input with height and width")
    (top, bottom), (left, right) = reach[HEIGHT], reach[WIDTH]
    return (left, right, top, bottom)


def _channel_range(op: Op, out_box: Box) -> tuple[int, int]:
    if CHANNEL in parameter_dims(op):
        return out_box[op.output.dims.index(CHANNEL)]
    return (0, op.output.size(CHANNEL)) if CHANNEL in op.output.dims else (0, 0)


def _prefix(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _param_roles(op: Op) -> tuple[ParamRole, ...]:
    """Own parameters (leading, sharing the first one's module prefix), then a folded norm's
    weight and bias, then extras."""
    params = op.params
    if op.kind == "moe":  # every parameter is the block's own, none split with the channel;
        # a stacked expert weight's axis 0 holds the experts (expert parallelism cuts it)
        moe_roles = moe_spec(op).roles
        return tuple(ParamRole("own", 0 if _stacked_expert(r) else None) for r in moe_roles)
    layout = _OWN_PARAMS.get(op.kind, ())
    if op.kind == "norm" and op.attr("norm") in ("layer", "rms"):
        layout = ((-1, 1), (-1, 1))  # layer and RMS norm: channel is never split
    if op.kind == "linear" and op.attr("transposed"):
        layout = ((1, 1), (0, 1))  # weight (in, out): the output channels are its columns
    n_own = 0
    if op.kind == "attention":  # QK-norm's weights (two modules: q_norm, k_norm)
        n_own = min(len(params), 2) if op.attr("qk_norm") else 0
    elif layout and params:
        first = _prefix(params[0].name)
        n_own = 1
        while (
            n_own < min(len(layout), len(params))
            and _prefix(params[n_own].name) == first
            and (first or op.kind in ("lstm", "norm"))
        ):
            n_own += 1
        if not first and n_own == 1 and op.kind in ("conv2d", "linear", "rnn_attention"):
            # names without module prefixes (hand-written graphs): a bias is the next 1D
            # parameter of the output channels, unless it is a folded norm's.
            rest_1d = [p for p in params[1:] if len(p.shape) == 1]
            norm_n = 2 if op.attr("norm") in ("batch", "layer") else 0
            if len(params) > 1 and len(params[1].shape) == 1 and len(rest_1d) > norm_n:
                n_own = 2
    roles = [ParamRole("own", _axis(layout[k][0]), layout[k][1]) for k in range(n_own)]
    rest = list(params[n_own:])
    channels = op.output.size(CHANNEL) if CHANNEL in op.output.dims else 0
    norm = op.attr("norm")
    affine = len(rest) >= 2 and all(p.shape == (channels,) for p in rest[:2])
    if op.kind != "norm" and norm in ("batch", "layer") and affine:
        axis = 0 if norm == "batch" else None
        roles += [ParamRole("norm", axis), ParamRole("norm", axis)]
        rest = rest[2:]
    for p in rest:
        roles.append(ParamRole("extra", _extra_axis(op, p.shape)))
    return tuple(roles)


def _stacked_expert(role: str) -> bool:
    """Whether a moe role is a routed weight stacked over the experts (E, ...)."""
    return is_routed(role) and expert_of(role) is None


def _axis(axis: int) -> int | None:
    return None if axis < 0 else axis


def _extra_axis(op: Op, shape: tuple[int, ...]) -> int | None:
    """The axis of a broadcast parameter that lines up with the output's channel dim."""
    dims = op.output.dims
    if CHANNEL not in dims:
        return None
    axis = len(shape) - (len(dims) - dims.index(CHANNEL))
    if axis >= 0 and shape[axis] == op.output.size(CHANNEL):
        return axis
    return None


def _shard_shape(
    shape: tuple[int, ...], role: ParamRole, op: Op, c_lo: int, c_hi: int
) -> tuple[int, ...]:
    if role.axis is None or CHANNEL not in parameter_dims(op):
        return tuple(shape)
    out = list(shape)
    out[role.axis] = role.blocks * (c_hi - c_lo)
    return tuple(out)


# -- input sizes without the graph -------------------------------------------------------------


def infer_input_shapes(op: Op) -> list[Shape]:
    """The input tensors of `op` as far as the op alone tells (for keys without the graph).

    Exact for the zoo's ops up to what does not change a task's compute shapes (a strided
    window's input may be a few rows longer than the smallest one inferred here). Assumes
    self-attention (k and v as long as q) and elementwise inputs shaped like the output.
    Raises GraphError when the op lacks what is needed (e.g. a conv without its weight)."""
    out = op.output
    n = out.size(SAMPLE)
    kind = op.kind

    def weight(k: int = 0) -> tuple[int, ...]:
        if len(op.params) <= k:
            raise GraphError(f"op {op.name!r} ({kind}) has no weight to infer its input from")
        return op.params[k].shape

    if kind == "input":
        return []
    if kind in ("conv2d", "pool2d"):
        kernel = op.attr("kernel", (1, 1))
        stride = op.attr("stride", (1, 1))
        padding = op.attr("padding", (0, 0))
        dilation = op.attr("dilation", (1, 1))
        hw = [
            (out.size(d) - 1) * int(stride[a])
            + int(dilation[a]) * (int(kernel[a]) - 1)
            + 1
            - 2 * int(padding[a])
            for a, d in enumerate((HEIGHT, WIDTH))
        ]
        c = weight()[1] * int(op.attr("groups", 1)) if kind == "conv2d" else out.size(CHANNEL)
        return [Shape.of(sample=n, channel=c, height=max(1, hw[0]), width=max(1, hw[1]))]
    if kind == "linear":
        dims = {SAMPLE: n} | ({LENGTH: out.size(LENGTH)} if LENGTH in out.dims else {})
        return [Shape(tuple(dims.items()) + ((CHANNEL, weight()[1]),))]
    if kind == "embedding":
        sel = op.attr("select")
        if LENGTH in out.dims:
            return [Shape.of(8, sample=n, length=out.size(LENGTH))]
        length = int(sel[1]) + 1 if sel is not None else 1
        return [Shape.of(8, sample=n, length=length)]
    if kind == "lstm":
        x = Shape.of(sample=n, channel=weight()[1])
        return [x] + [Shape.of(sample=n, channel=out.size(CHANNEL))] * (len(op.inputs) - 1)
    if kind == "rnn_attention":
        state = Shape.of(sample=n, channel=weight()[1] // 2)
        return [state] * len(op.inputs)
    if kind == "concat":
        dim, offsets = op.attr("dim"), [int(o) for o in op.attr("offsets")]
        ends = offsets[1:] + [out.size(dim)]
        return [
            Shape(tuple((d, e - o if d == dim else s) for d, s in out.shape))
            for o, e in zip(offsets, ends, strict=True)
        ]
    if kind == "flatten":
        return [Shape.of(sample=n, channel=out.size(CHANNEL))]
    return [out] * len(op.inputs)  # attention, norm, elementwise, softmax


# -- parameters --------------------------------------------------------------------------------


def shard_params(plan: TaskPlan, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The task's shards of the op's full parameters (views, sliced along the channel)."""
    op = plan.op
    if len(params) != len(op.params):
        raise GraphError(f"op {op.name!r} has {len(op.params)} parameters, got {len(params)}")
    c_lo, c_hi = _channel_range(op, plan.out_box)
    split = CHANNEL in parameter_dims(op)
    full = op.output.size(CHANNEL) if CHANNEL in op.output.dims else 0
    out = []
    con = contraction(op) if plan.summed is not None else None
    if op.kind == "moe":
        return _moe_shards(plan, params)
    for k, (p, role) in enumerate(zip(params, plan.roles, strict=True)):
        if con is not None and k == con.param:  # a contraction split's slice of the weight
            assert plan.summed is not None
            p = p.narrow(con.axis, plan.summed[0], plan.summed[1] - plan.summed[0])
        if role.axis is None or not split or (c_lo, c_hi) == (0, full):
            out.append(p)
            continue
        if role.blocks == 1:
            out.append(p.narrow(role.axis, c_lo, c_hi - c_lo))
        else:
            block = p.shape[role.axis] // role.blocks
            pieces = [
                p.narrow(role.axis, k * block + c_lo, c_hi - c_lo) for k in range(role.blocks)
            ]
            out.append(torch.cat(pieces, dim=role.axis))
    return out


def _moe_shards(plan: TaskPlan, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A moe task's shards: under expert tensor parallelism (`plan.summed`) its slice of
    every expert's hidden width (`planner.graph.moe.ffn_shard`), under expert parallelism
    its routed experts only (rows [lo, hi) of a stacked weight, nothing of another
    member's expert)."""
    roles = moe_spec(plan.op).roles
    out = list(params)
    con = contraction(plan.op) if plan.summed is not None else None
    if con is not None and plan.summed is not None:
        lo, hi = plan.summed
        part, parts = lo // (hi - lo), con.size // (hi - lo)
        out = [ffn_shard(p, r, part, parts) for p, r in zip(out, roles, strict=True)]
    if plan.experts is not None:
        first = plan.experts[0]
        out = [
            p.narrow(0, first if expert_of(r) is None else 0, s[0]) if is_routed(r) else p
            for p, r, s in zip(out, roles, plan.param_shapes, strict=True)
        ]
    return out


# -- running a task ----------------------------------------------------------------------------


Reduce = Callable[[torch.Tensor], torch.Tensor]


class ExpertExchange(Protocol):
    """How the tasks of an expert-parallel group swap token copies: the runtime's
    all-to-all over the group's ranks (`runtime.experts.GroupExchange`). Members are
    numbered in the group's task order (`ParallelConfig.expert_groups`)."""

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        """From (e, E/e) int64 counts, row m this task's token copies for member m's
        experts, to the same shape, row m member m's copies for this task's experts."""
        ...

    def __call__(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of x, send[m] of them to member m in member order, exchanged for recv[m]
        rows from each member m (differentiable: the gradient goes back the reverse way)."""
        ...


class _Loopback:
    """The exchange of a task alone (the profiler's, or a kernel run without the runtime):
    its copies come back to it as if every member routed as it does, so it runs as many
    rows through its experts as a rank of a balanced group (timing only: the numbers are
    not the op's)."""

    def counts(self, sent: torch.Tensor) -> torch.Tensor:
        return sent

    def __call__(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return x


def run_task(
    plan: TaskPlan,
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    reduce: Reduce | None = None,
    eps: float = BN_EPS,
    tables: Sequence[torch.Tensor] | None = None,
    exchange: ExpertExchange | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The task's output box from its input boxes (`plan.in_boxes`, plus c_prev for an LSTM
    step) and its parameter shards (`plan.param_shapes`).

    A moe task under expert parallelism (`plan.experts`) swaps its tokens with its group by
    `exchange` (`expert_parallel_moe`); without one, given the op's whole parameters, it
    computes its tokens with every expert itself (`moe_math`), and given its shards, it
    runs its experts on its own token copies (`_Loopback`: the work, not the result).

    Batch norm uses epsilon `eps`; when the plan's statistics are shared (`stats_count`),
    `reduce` sums a tensor over the task's group (the runtime's exchange; None: this task
    alone, which computes the same arithmetic, as the profiler measures it). `tables`: an
    attention op's rotary tables (cos, sin), as the model computes them. `positions`: the
    token position at each place of the sequence when it runs permuted (context
    parallelism's balanced order, `planner.costs.context`), which attention's mask and
    rotation and a position embedding's rows follow."""
    norm_args = (reduce, eps)
    op = plan.op
    expected = len(plan.in_boxes) + (1 if op.kind == "lstm" and len(plan.in_boxes) == 2 else 0)
    if len(inputs) != expected:
        raise GraphError(f"op {op.name!r}: task needs {expected} inputs, got {len(inputs)}")
    xs = [_select(plan, pos, x) for pos, x in enumerate(inputs)]
    for fn in plan.pre:
        xs[0] = _unary(op, fn)(xs[0])
    own = [p for p, r in zip(params, plan.roles, strict=True) if r.role == "own"]
    norm = [p for p, r in zip(params, plan.roles, strict=True) if r.role == "norm"]
    extras = [
        _align_extra(plan, p, positions)
        for p, r in zip(params, plan.roles, strict=True)
        if r.role == "extra"
    ]
    try:
        kernel = KERNELS[op.kind]
    except KeyError:
        raise GraphError(f"no kernel for op kind {op.kind!r}") from None
    if op.kind == "norm":
        return _normalize(plan, xs[0], _norm_fn(plan.op), own, norm_args)
    if op.kind == "attention" and tables:  # the model's rotary tables (cos, sin)
        return _attention(plan, xs, own, list(tables), positions)
    if op.kind == "moe" and plan.experts is not None:
        return _epilogue(plan, _moe(plan, xs, own, extras, exchange), norm, extras, norm_args)
    if op.kind == "attention":
        y = _attention(plan, xs, own, extras, positions)
    else:
        y = kernel(plan, xs, own, extras)
    return _epilogue(plan, y, norm, extras, norm_args)


def _select(plan: TaskPlan, pos: int, x: torch.Tensor) -> torch.Tensor:
    sel = plan.select(pos) if pos < len(plan.in_shapes) else None
    return x if sel is None else x.select(sel[0], sel[1])


def _align_extra(
    plan: TaskPlan, p: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """A broadcast parameter cut to the task's output box on its non-parameter dims (along
    the sequence, the rows of the box's `positions` when the sequence runs permuted)."""
    dims, sizes = plan.op.output.dims, plan.op.output.sizes
    pdims = parameter_dims(plan.op)
    for axis in range(p.dim()):
        k = len(dims) - (p.dim() - axis)
        if k < 0 or p.shape[axis] == 1 or dims[k] in pdims:
            continue
        # the length dim of a position embedding's table may be longer than the sequence:
        # positions 0..T-1 are its first rows (capture reads only torch.arange(T))
        if p.shape[axis] != sizes[k] and not (dims[k] == LENGTH and p.shape[axis] > sizes[k]):
            continue
        lo, hi = plan.out_box[k]
        if positions is not None and dims[k] == LENGTH:
            p = p.index_select(axis, positions[lo:hi].to(p.device))
        else:
            p = p.narrow(axis, lo, hi - lo)
    return p


def _epilogue(
    plan: TaskPlan,
    y: torch.Tensor,
    norm: list[torch.Tensor],
    extras: list[torch.Tensor],
    norm_args: tuple[Reduce | None, float] = (None, BN_EPS),
) -> torch.Tensor:
    extras = list(extras)
    for fn in plan.fused:
        if fn in _NORMS:
            y = _normalize(plan, y, fn, norm, norm_args)
        elif fn in _BINARY:
            y = _BINARY[fn](y, extras.pop(0) if extras else 1.0)
        else:
            y = _unary(plan.op, fn)(y)
    for e in extras:
        y = y + e
    return y


def _unary(op: Op, fn: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _UNARY[fn]
    except KeyError:
        raise GraphError(
            f"op {op.name!r}: no kernel for pointwise function {fn!r}; known: "
            f"{', '.join([*_UNARY, *_BINARY])}"
        ) from None


def _normalize(
    plan: TaskPlan,
    x: torch.Tensor,
    fn: str,
    wb: list[torch.Tensor],
    norm_args: tuple[Reduce | None, float],
) -> torch.Tensor:
    w, b = (wb[0], wb[1]) if len(wb) == 2 else (None, None)
    axis = plan.op.output.dims.index(CHANNEL)
    if fn == "rms_norm":  # as the model computes it (float32, Gemma's 1 + weight, ...)
        attrs = {k: plan.op.attr(k, None) for k in RMS_ATTRS}
        return rms_norm(x.movedim(axis, -1), wb[0] if wb else None, attrs).movedim(-1, axis)
    if fn == "layer_norm":
        x = x.movedim(axis, -1)
        y = F.layer_norm(x, (x.shape[-1],), w, b, float(plan.op.attr("eps", 1e-5)))
        return y.movedim(-1, axis)
    reduce, eps = norm_args
    if plan.stats_count:
        return shared_batch_norm(x, w, b, axis, plan.stats_count, eps, reduce)
    x = x.movedim(axis, 1)
    # torch.batch_norm, not F.batch_norm: a task may hold one value per channel (F refuses).
    y = torch.batch_norm(x, w, b, None, None, True, 0.1, eps, False)
    return y.movedim(1, axis)


def _norm_fn(op: Op) -> str:
    norm = op.attr("norm", "batch")
    if norm not in ("batch", "layer", "rms"):
        raise GraphError(f"norm {op.name!r}: norm must be 'batch', 'layer' or 'rms', got {norm!r}")
    return f"{norm}_norm"


class SharedBatchNorm(torch.autograd.Function):
    """`shared_batch_norm(x, w, b, axis, count, eps, reduce)`: batch norm of x over all dims
    but `axis` with the statistics of `count` positions per channel, summed over a group of
    tasks by `reduce` (None: this task alone; biased variance, as torch's training mode).

    Forward: per-channel sums of x and x^2 accumulated in float64 (so that E[x^2] - E[x]^2
    keeps a float32 variance), reduced over the group, then torch's fused batch norm with
    those statistics. Backward: the sums of dy and dy x reduced the same way, then the
    textbook batch-norm gradient, dx = w / sigma (dy - sum(dy) / N - x_hat sum(dy x_hat) / N),
    in two fused passes. One reduction each way, of 2 x channels float64 values."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor | None,
        b: torch.Tensor | None,
        axis: int,
        count: int,
        eps: float,
        reduce: Reduce | None,
    ) -> torch.Tensor:
        reduce = reduce or (lambda t: t)
        dims = [d for d in range(x.dim()) if d != axis]
        wide = torch.float64
        sums = reduce(torch.stack([x.sum(dims, dtype=wide), (x * x).sum(dims, dtype=wide)]))
        mean = sums[0] / count
        var = (sums[1] / count - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        xc = x.movedim(axis, 1)
        y = torch.batch_norm(
            xc, w, b, mean.to(x.dtype), var.to(x.dtype), False, 0.0, eps, False
        ).movedim(1, axis)
        ctx.save_for_backward(x, w, mean, invstd)
        ctx.axis, ctx.count, ctx.reduce, ctx.has_b = axis, count, reduce, b is not None
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> Any:
        x, w, mean, invstd = ctx.saved_tensors
        axis, count = ctx.axis, ctx.count
        dims = [d for d in range(x.dim()) if d != axis]
        shape = [1] * x.dim()
        shape[axis] = x.shape[axis]
        wide = torch.float64
        g_sum = gy.sum(dims, dtype=wide)
        g_xmu = (gy * x).sum(dims, dtype=wide) - mean * g_sum  # sum dy (x - mean)
        gw = (g_xmu * invstd).to(x.dtype) if w is not None else None
        gb = g_sum.to(x.dtype) if ctx.has_b else None
        total = ctx.reduce(torch.stack([g_sum, g_xmu]))
        scale = invstd * (w.to(wide) if w is not None else 1.0)
        # dx = scale (dy - total0 / N - (x - mean) invstd^2 total1 / N) = a dy + c x + d
        c = -scale * invstd * invstd * total[1] / count
        d = -scale * total[0] / count - c * mean
        gx = torch.addcmul(d.to(x.dtype).view(shape), x, c.to(x.dtype).view(shape))
        gx.addcmul_(gy, scale.to(x.dtype).view(shape))
        return gx, gw, gb, None, None, None, None


# -- kernels per op kind -----------------------------------------------------------------------

Kernel = Callable[[TaskPlan, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], Any]


def _input(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    raise GraphError(f"op {plan.op.name!r} is an input: it has no computation to run")


def _spatial_pad(plan: TaskPlan, x: torch.Tensor, value: float) -> tuple[torch.Tensor, int, int]:
    """Pad the input box where the window reaches beyond the tensor. Returns (x, pad_h, pad_w):
    when the task computes the whole height and width, the op's own symmetric padding is left
    to the torch op."""
    left, right, top, bottom = plan.pads[0] or (0, 0, 0, 0)
    out = plan.op.output
    if all(plan.out_range(d) == (0, out.size(d)) for d in (HEIGHT, WIDTH)):
        pad_h, pad_w = (int(p) for p in plan.op.attr("padding", (0, 0)))
        if (top, left) == (pad_h, pad_w) and bottom <= pad_h and right <= pad_w:
            return x, pad_h, pad_w
    if left or right or top or bottom:
        x = F.pad(x, (left, right, top, bottom), value=value)
    return x, 0, 0


def conv_input_channels(plan: TaskPlan) -> tuple[int, int, int]:
    """(first input channel, input channels, groups) that the task's output channels read."""
    op = plan.op
    groups = int(op.attr("groups", 1))
    cin = plan.in_shapes[0].size(CHANNEL)
    if plan.summed is not None:  # a contraction split: its input box holds its channels
        return 0, plan.summed[1] - plan.summed[0], 1
    if groups == 1:
        return 0, cin, 1
    per_out = op.output.size(CHANNEL) // groups
    c_lo, c_hi = plan.out_range(CHANNEL)
    g_lo, g_hi = c_lo // per_out, -(-c_hi // per_out)
    per_in = cin // groups
    return g_lo * per_in, (g_hi - g_lo) * per_in, g_hi - g_lo


def _conv2d(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    op = plan.op
    if not own:
        raise GraphError(f"conv {op.name!r} has no weight parameter")
    x = _to_nchw(plan, xs[0])
    first, count, groups = conv_input_channels(plan)
    if count != x.shape[1]:
        x = x.narrow(1, first, count)
    x, ph, pw = _spatial_pad(plan, x, 0.0)
    bias = own[1] if len(own) > 1 and plan.adds_bias else None
    y = F.conv2d(
        x,
        own[0],
        bias,
        stride=tuple(op.attr("stride", (1, 1))),
        padding=(ph, pw),
        dilation=tuple(op.attr("dilation", (1, 1))),
        groups=groups,
    )
    return _from_nchw(plan, y)


def _pool2d(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    op = plan.op
    mode = op.attr("mode", "max")
    x = _to_nchw(plan, xs[0])
    x, ph, pw = _spatial_pad(plan, x, -math.inf if mode == "max" else 0.0)
    kernel = tuple(op.attr("kernel", (1, 1)))
    stride = tuple(op.attr("stride", kernel))
    if mode == "max":
        y = F.max_pool2d(x, kernel, stride, (ph, pw), tuple(op.attr("dilation", (1, 1))))
    elif mode == "avg":
        y = F.avg_pool2d(x, kernel, stride, (ph, pw))
    else:
        raise GraphError(f"pool {op.name!r}: mode must be 'max' or 'avg', got {mode!r}")
    return _from_nchw(plan, y)


def _to_nchw(plan: TaskPlan, x: torch.Tensor) -> torch.Tensor:
    dims = plan.in_shapes[0].dims
    order = [dims.index(d) for d in (SAMPLE, CHANNEL, HEIGHT, WIDTH)]
    return x if order == [0, 1, 2, 3] else x.permute(order)


def _from_nchw(plan: TaskPlan, y: torch.Tensor) -> torch.Tensor:
    dims = plan.op.output.dims
    if dims == (SAMPLE, CHANNEL, HEIGHT, WIDTH):
        return y
    return y.permute([(SAMPLE, CHANNEL, HEIGHT, WIDTH).index(d) for d in dims])


def _kept_dims(op: Op, in_dims: Sequence[str]) -> list[str]:
    """Input dims a linear/flatten keeps (sample, and length if the output has it)."""
    return [d for d in in_dims if d in (SAMPLE, LENGTH) and d in op.output.dims]


def _features(plan: TaskPlan, x: torch.Tensor, pos: int = 0) -> torch.Tensor:
    """x with the kept dims first and every other dim flattened into the last one."""
    dims = list(plan.in_shapes[pos].dims)
    sel = plan.select(pos)
    if sel is not None:
        del dims[sel[0]]
    keep = _kept_dims(plan.op, dims)
    rest = [d for d in dims if d not in keep]
    order = [dims.index(d) for d in keep + rest]
    if order != list(range(len(dims))):
        x = x.permute(order)
    return x.reshape(*x.shape[: len(keep)], -1)


def _linear(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    if not own:
        raise GraphError(f"linear {plan.op.name!r} has no weight parameter")
    weight = own[0].t() if plan.op.attr("transposed") else own[0]  # (in, out): HF's Conv1D
    bias = own[1] if len(own) > 1 and plan.adds_bias else None
    y = F.linear(_features(plan, xs[0]), weight, bias)
    return _channel_last_to_output(plan, y)


def _channel_last_to_output(plan: TaskPlan, y: torch.Tensor) -> torch.Tensor:
    """y laid out (kept dims..., channel) -> the output's dim order."""
    dims = plan.op.output.dims
    layout = [d for d in dims if d != CHANNEL] + [CHANNEL]
    if list(dims) == layout:
        return y
    return y.permute([layout.index(d) for d in dims])


def _embedding(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    if not own:
        raise GraphError(f"embedding {plan.op.name!r} has no weight parameter")
    return _channel_last_to_output(plan, F.embedding(xs[0], own[0]))


def lstm_step(
    plan: TaskPlan, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """An LSTM step's task: (h, c) of its hidden units (`run_task` returns h only; the
    runtime passes both to the next step). Inputs: x, then h_prev and c_prev over all hidden
    units; params: the rows of its units in each gate of weight_ih, weight_hh, bias_ih,
    bias_hh."""
    xs = [_select(plan, pos, x) for pos, x in enumerate(inputs)]
    return _lstm_cell(plan, xs, list(params))


def _lstm_cell(
    plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    if len(own) < 2:
        raise GraphError(f"lstm {plan.op.name!r} needs weight_ih and weight_hh")
    w_ih, w_hh = own[0], own[1]
    b = own[2] + own[3] if len(own) >= 4 else None
    gates = F.linear(xs[0], w_ih, b)
    c_prev = None
    if len(xs) == 3:
        gates = gates + F.linear(xs[1], w_hh)
        c_lo, c_hi = plan.out_range(CHANNEL)
        c_prev = xs[2].narrow(1, c_lo, c_hi - c_lo)
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(i) * torch.tanh(g)
    if c_prev is not None:
        c = c + torch.sigmoid(f) * c_prev
    return torch.sigmoid(o) * torch.tanh(c), c


def _lstm(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    return _lstm_cell(plan, xs, own)[0]


def _attention(
    plan: TaskPlan,
    xs: list[torch.Tensor],
    own: list[torch.Tensor],
    extras: Any,
    positions: torch.Tensor | None = None,
) -> Any:
    """`planner.graph.attention.attention_math` on the task's heads and query rows; `extras`
    holds the rotary tables (cos, sin) when the op has them (the runtime passes the model's);
    `positions` the tokens' positions when the sequence runs permuted."""
    op = plan.op
    if op.output.dims != (SAMPLE, LENGTH, CHANNEL) or len(xs) != 3:
        raise GraphError(f"attention {op.name!r} needs q, k, v of dims (sample, length, channel)")
    q = xs[0]
    heads = q.shape[-1] // attention_dims(op).head_dim
    tables = (extras[0], extras[1]) if len(extras) == 2 else None
    start = plan.out_range(LENGTH)[0]
    return attention_math(
        q,
        xs[1],
        xs[2],
        op,
        q_start=start,
        heads=heads,
        tables=tables,
        positions=positions,
        norms=own,
    )


def _rnn_attention(
    plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any
) -> Any:
    if not own or len(xs) < 2:
        raise GraphError(f"rnn_attention {plan.op.name!r} needs (h, states...) and its weight")
    h, enc = xs[0], torch.stack(xs[1:], dim=1)  # (N, C), (N, T, C)
    weights = torch.softmax(torch.bmm(enc, h.unsqueeze(2)).squeeze(2), dim=1)
    context = torch.bmm(weights.unsqueeze(1), enc).squeeze(1)
    bias = own[1] if len(own) > 1 else None
    return torch.tanh(F.linear(torch.cat([context, h], dim=1), own[0], bias))


def _norm(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    return _normalize(plan, xs[0], _norm_fn(plan.op), own, (None, BN_EPS))


def _align(plan: TaskPlan, pos: int, x: torch.Tensor) -> torch.Tensor:
    """An elementwise input laid out in the output's dim order (missing dims of size 1)."""
    dims = list(plan.in_shapes[pos].dims)
    out = plan.op.output.dims
    if tuple(dims) == out:
        return x
    if not set(dims) <= set(out):
        raise GraphError(f"op {plan.op.name!r}: input {pos} has dims {dims} beyond {out}")
    present = [d for d in out if d in dims]
    x = x.permute([dims.index(d) for d in present])
    return x.reshape([x.shape[present.index(d)] if d in dims else 1 for d in out])


def _elementwise(
    plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: list[torch.Tensor]
) -> Any:
    op = plan.op
    fn = str(op.attr("op", op.attr("fn", "relu"))).strip("_")
    xs = [_align(plan, pos, x) for pos, x in enumerate(xs)]
    if fn in _BINARY:
        y, scalar = xs[0], op.attr("scalar", None)
        if scalar is None and op.attr("scalar_node", None) is not None:
            raise GraphError(
                f"op {op.name!r} reads a constant of the model ({op.attr('scalar_node')}) "
                "whose value is not known: run it with its model (runtime.reference."
                "model_constants)"
            )
        if scalar is not None:  # x * 0.5, or 1.0 - x with scalar_first
            first = bool(op.attr("scalar_first", False))
            y = _BINARY[fn](y.new_tensor(scalar), y) if first else _BINARY[fn](y, scalar)
        others: list[Any] = xs[1:] or (
            [] if scalar is not None else [extras.pop(0) if extras else 1.0]
        )
        for other in others:
            y = _BINARY[fn](y, other)
        return y
    y = _unary(op, fn)(xs[0])
    for other in xs[1:]:
        y = y + other
    return y


def _concat(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    axis = plan.op.output.dims.index(plan.op.attr("dim"))
    pieces = [x for x in xs if x.shape[axis] > 0]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=axis)


def _slice(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    # the task's input box is its output range shifted by the start: already the slice
    return xs[0]


def _flatten(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    return _features(plan, xs[0])


def _softmax(plan: TaskPlan, xs: list[torch.Tensor], own: list[torch.Tensor], extras: Any) -> Any:
    op = plan.op
    axis = op.output.dims.index(CHANNEL)
    fn = str(op.attr("op", "softmax"))
    if fn in ("log_softmax", "logsoftmax", "cross_entropy"):
        return torch.log_softmax(xs[0], dim=axis)
    return torch.softmax(xs[0], dim=axis)


def _moe(
    plan: TaskPlan,
    xs: list[torch.Tensor],
    own: list[torch.Tensor],
    extras: Any,
    exchange: ExpertExchange | None = None,
) -> Any:
    """A mixture-of-experts block on the task's tokens (`planner.graph.moe.moe_math`): tokens
    are independent, so a box of them computes alone; the channel is read whole. Under
    expert parallelism the task runs its experts on its group's tokens (`run_task`); under
    expert tensor parallelism (`plan.summed`) its slice of the experts' hidden width, a
    partial sum of the output (given the op's whole parameters, it cuts its slices)."""
    x = xs[0]
    axis = plan.in_shapes[0].dims.index(CHANNEL)
    last = x.movedim(axis, -1)
    spec = moe_spec(plan.op)
    whole = all(tuple(p.shape) == q.shape for p, q in zip(own, plan.op.params, strict=True))
    if whole and plan.summed is not None:  # expert tensor parallelism: the task's ffn slices
        own = _moe_shards(replace(plan, experts=None), own)
    if plan.experts is None or (exchange is None and whole):
        y = moe_math(last, own, spec)
    else:
        tokens = last.reshape(-1, last.shape[-1])
        y = expert_parallel_moe(
            tokens, own, spec, plan.experts, plan.expert_degree, exchange or _Loopback()
        ).reshape(last.shape)
    return y.movedim(-1, plan.op.output.dims.index(CHANNEL))


def expert_parallel_moe(
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    spec: MoESpec,
    experts: tuple[int, int],
    degree: int,
    exchange: ExpertExchange,
) -> torch.Tensor:
    """The moe block on tokens x (T, h) of one member of an expert-parallel group of
    `degree` members that holds routed experts [lo, hi) (`params`: its shards), dropless:

    route the tokens (the router is replicated); sort the T k token copies by expert (stable:
    token order within an expert); exchange the per-expert counts, then the copies, so that
    each member receives the copies of its experts from every member (dispatch); run each
    local expert on its rows; send the results back the reverse way (combine); weight them
    with the gates and add them up per token in ascending expert order, as
    `planner.graph.moe.experts_forward` does; add the shared expert, computed locally.
    Megatron-Core's all-to-all token dispatcher (Lepikhin et al. 2021, GShard, Sec. 2.2)
    without a capacity: every copy is computed."""
    lo, hi = experts
    weights = Weights(spec, params)
    gate, index = route(x, spec, weights)
    flat = index.reshape(-1)  # copy c is token c // k's choice c % k
    order = torch.argsort(flat, stable=True)
    token = order // spec.top_k
    sent = torch.bincount(flat, minlength=spec.experts).view(degree, hi - lo)
    received = exchange.counts(sent)
    send, recv = sent.sum(1).tolist(), received.sum(1).tolist()
    arrived = exchange(x.index_select(0, token), send, recv)
    done = _run_local_experts(arrived, received.tolist(), spec, weights, lo)
    back = exchange(done, recv, send)
    weighted = back * gate.reshape(-1).index_select(0, order).unsqueeze(-1)
    out = torch.zeros_like(x).index_add(0, token, weighted)
    shared = shared_forward(x, spec, weights)
    return out if shared is None else out + shared


def _run_local_experts(
    arrived: torch.Tensor,
    counts: list[list[int]],
    spec: MoESpec,
    weights: Weights,
    lo: int,
) -> torch.Tensor:
    """Each local expert j on its rows of `arrived` (laid out member by member, expert by
    expert within a member: counts[m][j] rows), the results in the same layout."""
    per = len(counts[0])
    starts, at = [], 0
    for row in counts:
        starts.append([at + sum(row[:j]) for j in range(per)])
        at += sum(row)
    stacked = any(_stacked_expert(r) for r in spec.roles)
    outs, rows = [], []
    for j in range(per):
        idx = torch.cat(
            [torch.arange(starts[m][j], starts[m][j] + c[j]) for m, c in enumerate(counts)]
        ).to(arrived.device)
        w1, w3, w2 = weights.expert(j if stacked else lo + j)  # a stacked shard starts at lo
        outs.append(mlp(arrived.index_select(0, idx), w1, w3, w2, spec.expert_act))
        rows.append(idx)
    perm = torch.cat(rows)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return torch.cat(outs).index_select(0, inverse)


KERNELS: dict[str, Kernel] = {
    "input": _input,
    "conv2d": _conv2d,
    "pool2d": _pool2d,
    "linear": _linear,
    "embedding": _embedding,
    "lstm": _lstm,
    "attention": _attention,
    "rnn_attention": _rnn_attention,
    "norm": _norm,
    "moe": _moe,
    "elementwise": _elementwise,
    "concat": _concat,
    "slice": _slice,
    "flatten": _flatten,
    "softmax": _softmax,
}
assert set(KERNELS) == set(KINDS), "every op kind needs a kernel"


# -- random task instances ---------------------------------------------------------------------


def random_inputs(
    plan: TaskPlan,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Random input boxes for `plan` (token ids for an embedding, c_prev for an LSTM step)."""
    inputs = []
    for pos in range(len(plan.in_boxes)):
        shape = plan.box_shape(pos)
        if plan.is_index_input(pos):
            vocab = plan.param_shapes[0][0] if plan.param_shapes else 2
            inputs.append(torch.randint(0, vocab, shape, generator=generator))
        else:
            inputs.append(torch.randn(shape, dtype=dtype, generator=generator))
    if plan.op.kind == "lstm" and len(inputs) == 2:
        inputs.append(torch.randn(plan.box_shape(1), dtype=dtype, generator=generator))
    return [x.to(device) for x in inputs] if device is not None else inputs


def random_params(
    plan: TaskPlan,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """Random parameter shards for `plan` (small values: no saturated activations)."""
    params = [torch.randn(s, dtype=dtype, generator=generator) * 0.1 for s in plan.param_shapes]
    return [p.to(device) for p in params] if device is not None else params


def task_fn(
    graph: OpGraph,
    index: int,
    cfg: ParallelConfig,
    dtype: torch.dtype = torch.float32,
    task: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """(forward closure, leaves requiring grad) of one task of op `index` under `cfg`, on
    random data: input boxes and parameter shards as `plan_task` gives them (task None: the
    task reading the most). Run `out = fn(); out.backward(grad)` to time forward + backward.
    Raises GraphError for an unknown op kind or attrs the kernel cannot run."""
    plan = plan_task(graph, index, cfg, task)
    return plan_fn(plan, dtype, generator)


def plan_fn(
    plan: TaskPlan,
    dtype: torch.dtype = torch.float32,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    """`task_fn` for a plan (tensors created on the CPU, then moved to `device`)."""
    if plan.op.kind == "input":
        data = torch.randn(plan.out_shape, dtype=dtype, generator=generator)
        data = data.to(device) if device is not None else data
        return data.clone, []
    inputs = random_inputs(plan, dtype, generator, device)
    params = random_params(plan, dtype, generator, device)
    wanted = [x for pos, x in enumerate(inputs) if plan.needs_grad(pos)]
    leaves = [
        t.requires_grad_() for t in wanted + params if t.is_floating_point() and t.numel() > 0
    ]

    def forward() -> torch.Tensor:
        return run_task(plan, inputs, params)

    return forward, leaves


shared_batch_norm = SharedBatchNorm.apply
