"""The strategies experts use, as reference points for every search.

- data parallelism: every op split along the sample dimension over all devices;
- model parallelism (OptCNN's baseline): every layer's parameters split over all devices
  (ops without parameters split along channel where they can, else along sample);
- OWT ("one weird trick", Krizhevsky 2014): data-parallel convolutions and pools,
  model-parallel dense layers;
- expert for RNNs (GNMT, used by FlexFlow Sec. 8): recurrent layers of the same depth on one
  device per host (layer l on local device l mod G), data parallel across hosts; other ops data
  parallel;
- Megatron-LM's tensor parallelism (`megatron`, Shoeybi et al. 2019, Sec. 3; Narayanan et al.
  SC'21, Sec. 2.3) within groups of `tensor` consecutive devices, context parallelism (the
  sequence split over groups of them, Megatron-Core's) and data parallelism across them,
  a mixture of experts' experts spread over `expert` consecutive devices (expert
  parallelism, Megatron-Core's `--expert-model-parallel-size`);
- expert parallelism (`expert_parallel`): data parallelism, a mixture of experts' experts
  spread over groups of consecutive devices of one node where they fit.

Each degree is the largest one that divides both the dimension and the device count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from planner.costs.config import ParallelConfig, divisors
from planner.errors import LayerwiseError
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import (
    CHANNEL,
    LENGTH,
    SAMPLE,
    contraction,
    parallel_dims,
    parameter_dims,
    split_unit,
)
from planner.hardware.devices import DeviceGraph
from planner.problems.strategy import Strategy


def _largest_degree(op: Op, dim: str, limit: int) -> int:
    if dim not in parallel_dims(op):
        return 1
    units = op.output.size(dim) // split_unit(op, dim)
    return math.gcd(units, limit)


def split_along(op: Op, dim: str, devices: list[int]) -> ParallelConfig:
    """`op` split along `dim` over as many of `devices` as divide evenly (first ones)."""
    g = _largest_degree(op, dim, len(devices))
    degrees = tuple(g if d == dim else 1 for d in op.output.dims)
    return ParallelConfig(degrees, tuple(devices[:g]))


def data_parallel(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    all_devs = list(range(devices.num_devices))
    return Strategy(graph, devices, tuple(split_along(op, SAMPLE, all_devs) for op in graph.ops))


def _model_config(op: Op, devs: list[int]) -> ParallelConfig:
    pdims = parameter_dims(op) if op.params else ()
    for dim in (*pdims, CHANNEL, SAMPLE):
        if _largest_degree(op, dim, len(devs)) > 1 or dim == SAMPLE:
            return split_along(op, dim, devs)
    raise AssertionError("unreachable: sample is always a candidate")


def model_parallel(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    devs = list(range(devices.num_devices))
    return Strategy(graph, devices, tuple(_model_config(op, devs) for op in graph.ops))


_OWT_MODEL = ("linear", "embedding", "lstm", "rnn_attention")


def owt(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    devs = list(range(devices.num_devices))
    configs = tuple(
        _model_config(op, devs) if op.kind in _OWT_MODEL else split_along(op, SAMPLE, devs)
        for op in graph.ops
    )
    return Strategy(graph, devices, configs)


def expert_rnn(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    hosts: dict[str, list[int]] = {}
    for i, d in enumerate(devices.devices):
        hosts.setdefault(d.host, []).append(i)
    per_host = list(hosts.values())
    local = min(len(h) for h in per_host)
    layers: dict[str, int] = {}
    all_devs = list(range(devices.num_devices))
    configs = []
    for op in graph.ops:
        if op.kind != "lstm":
            configs.append(split_along(op, SAMPLE, all_devs))
            continue
        layer = layers.setdefault(op.param_group or op.name, len(layers))
        devs = [h[layer % local] for h in per_host]
        configs.append(split_along(op, SAMPLE, devs))
    return Strategy(graph, devices, tuple(configs))


def _divides(op: Op, dim: str, degree: int) -> bool:
    """`op` can split `dim` `degree` ways in whole split units."""
    return dim in parallel_dims(op) and (op.output.size(dim) // split_unit(op, dim)) % degree == 0


def megatron(
    graph: OpGraph,
    devices: DeviceGraph,
    tensor: int,
    context: int = 1,
    expert: int = 1,
    expert_tensor: int | None = None,
) -> Strategy:
    """Megatron-LM's layout: tensor parallelism of degree `tensor` within groups of that many
    consecutive devices (a node's GPUs), context parallelism of degree `context` over
    consecutive tensor groups, data parallelism of degree devices / (tensor x context)
    across the rest (every op's samples split that many ways): Megatron-LM's rank order,
    tensor innermost, then context, then data.

    Within a tensor group, in graph order: a linear whose summed input is split along its
    channels splits its sum (row-parallel, `reduce`), else linears, embeddings and attention
    split their output channels (column-parallel; attention by whole heads); an op whose
    inputs are all channel-split keeps the split when it can (slices, activations); every
    other op (norms, dropout, residual adds, the loss) splits the sequence (Korthikanti et
    al. 2022's sequence parallelism: Megatron-LM of SC'21 repeats them on every rank of the
    group instead), so each column/row pair reduce-scatters into the sequence and
    all-gathers out of it, the volume of Megatron's all-reduce. With tensor 1: data
    parallelism.

    Context parallelism (Megatron-Core's `--context-parallel-size`) splits every op's
    sequence `context` ways on top of that (the data's tokens too: each rank loads its own
    chunks), so the tensor groups of one replica hold consecutive chunks of the sequence as
    laid out (in `CostOptions.cp_order` "balanced", the default, the runtime lays the tokens
    out so that chunk i holds Megatron's halves i and 2c-1-i: `planner.costs.context`);
    attention keeps its
    queries' chunk and reads the keys and values of every chunk from the other context
    ranks (the exchange the simulator prices, `CostOptions.cp_overlap`), and a weight is
    replicated over data x context ranks, whose gradients it syncs. Every op that a context
    split applies to must have a sequence that `context` x `tensor` divides.

    Expert parallelism (`expert` e > 1): every mixture-of-experts op spreads its experts over
    e consecutive token boxes, which are e consecutive devices (`ParallelConfig.expert`):
    inside one replica's tensor x context ranks when e divides them, across replicas beyond
    that (Megatron-Core's MoE "parallel folding" places EP beside TP and CP the same way);
    e must divide the experts of every moe op and its token boxes (the devices).

    Expert tensor parallelism (`expert_tensor` t, Megatron-Core's
    `--expert-tensor-parallel-size`): every moe op splits its experts' hidden width over t
    consecutive devices (`reduce` t: each computes a partial sum of the same tokens, the
    router on each) and its tokens over the devices / t boxes that remain (samples `data`
    ways, the sequence tensor x context / t ways); t must divide tensor x context and the
    experts' widths. None (the default) keeps the layout this function had before it: a moe
    op's tokens split tensor x context ways, each expert whole (t = 1), where Megatron-Core
    defaults to t = tensor."""
    n = devices.num_devices
    if tensor < 1 or context < 1 or n % (tensor * context):
        raise LayerwiseError(
            f"tensor-parallel size {tensor} x context-parallel size {context} must divide the "
            f"{n} devices of {devices.name}"
        )
    data = n // (tensor * context)
    if expert_tensor is not None and (expert_tensor < 1 or (tensor * context) % expert_tensor):
        raise LayerwiseError(
            f"expert-tensor-parallel size {expert_tensor} must divide tensor-parallel size "
            f"{tensor} x context-parallel size {context}"
        )
    devs = tuple(range(n))
    channel_split: dict[str, bool] = {}
    configs = []
    for i, op in enumerate(graph.ops):
        if not _divides(op, SAMPLE, data):
            raise LayerwiseError(
                f"op {op.name!r}: its {op.output.size(SAMPLE)} samples do not split over "
                f"data-parallel degree {data}: use a batch that {data} divides"
            )
        split: dict[str, int] = {SAMPLE: data}
        if context > 1:
            if not _divides(op, LENGTH, context):
                raise LayerwiseError(
                    f"op {op.name!r} has no sequence that context-parallel size {context} "
                    f"divides: context parallelism splits every op along its sequence"
                )
            split[LENGTH] = context
        reduce = 1
        if op.kind == "moe" and expert_tensor is not None:
            split, reduce = _expert_tensor_split(op, expert_tensor, data, tensor * context)
        elif tensor > 1:
            ins = [channel_split[name] for name in op.inputs]
            con = graph.contraction(i)
            internal = con is None or con.internal  # a moe op's ffn: not its input's
            if not internal and con is not None and ins[con.position] and con.size % tensor == 0:
                reduce = tensor
            elif (
                op.kind in ("linear", "embedding", "attention") or (ins and all(ins))
            ) and _divides(op, CHANNEL, tensor):
                split[CHANNEL] = tensor
            elif _divides(op, LENGTH, tensor * context):
                split[LENGTH] = tensor * context
            elif context == 1 and _divides(op, SAMPLE, n):
                split[SAMPLE] = n
            else:
                raise LayerwiseError(
                    f"op {op.name!r} splits neither its channels, its sequence nor its samples "
                    f"{tensor} ways: Megatron's layout needs sizes that {tensor} divides"
                )
        channel_split[op.name] = CHANNEL in split
        degrees = tuple(split.get(d, 1) for d in op.output.dims)
        configs.append(ParallelConfig(degrees, devs, reduce))
    return with_experts(Strategy(graph, devices, tuple(configs)), expert)


def _expert_tensor_split(op: Op, t: int, data: int, group: int) -> tuple[dict[str, int], int]:
    """A moe op's (token splits, reduce) in `megatron` with expert tensor parallelism t: its
    hidden width t ways, its tokens over the data x group / t boxes (samples `data` ways, the
    sequence group / t ways, or the samples all of them when the sequence cannot)."""
    con = contraction(op)
    if con is None or con.size % t:
        width = con.size if con is not None else op.attr("ffn")
        raise LayerwiseError(
            f"op {op.name!r}: expert-tensor-parallel size {t} must divide its experts' hidden "
            f"width {width} (and its shared expert's)"
        )
    per = group // t
    if per == 1 or _divides(op, LENGTH, per):
        split = {SAMPLE: data} | ({LENGTH: per} if per > 1 else {})
    elif _divides(op, SAMPLE, data * per):
        split = {SAMPLE: data * per}
    else:
        raise LayerwiseError(
            f"op {op.name!r} splits neither its sequence {per} ways nor its samples "
            f"{data * per} ways: expert tensor parallelism {t} leaves it that many token boxes"
        )
    return split, t


def with_experts(strategy: Strategy, expert: int) -> Strategy:
    """`strategy` with every moe op's experts spread `expert` ways over consecutive token
    boxes; a LayerwiseError when `expert` does not divide an op's experts or token boxes."""
    if expert == 1:
        return strategy
    configs = list(strategy.configs)
    moe = [i for i, op in enumerate(strategy.graph.ops) if op.kind == "moe"]
    if expert < 1 or not moe:
        raise LayerwiseError(
            f"expert-parallel size {expert} needs a positive size and mixture-of-experts ops; "
            f"{strategy.graph.name!r} has {len(moe)}"
        )
    for i in moe:
        op, cfg = strategy.graph.ops[i], configs[i]
        experts, boxes = int(op.attr("experts", 0)), cfg.num_tasks // cfg.reduce
        if experts % expert or boxes % expert:
            raise LayerwiseError(
                f"op {op.name!r}: expert-parallel size {expert} must divide its {experts} "
                f"experts and its {boxes} token boxes (devices): choose a size dividing both"
            )
        configs[i] = dataclasses.replace(cfg, expert=expert)
    return Strategy(strategy.graph, strategy.devices, tuple(configs))


def expert_parallel(graph: OpGraph, devices: DeviceGraph) -> Strategy:
    """Data parallelism with every mixture of experts' experts spread over e consecutive
    devices: e the largest divisor of its experts and token boxes that fits in one node
    (EP inside a node, on NVLink, as Megatron-Core's MoE recipes place it first), else the
    largest over nodes. Data parallelism alone when no moe op splits its tokens."""
    strategy = data_parallel(graph, devices)
    local = min(_per_host(devices).values())
    configs = list(strategy.configs)
    for i, op in enumerate(graph.ops):
        if op.kind != "moe":
            continue
        cfg = configs[i]
        options = divisors(math.gcd(int(op.attr("experts", 1)), cfg.num_tasks))
        inside = [e for e in options if e <= local]
        e = inside[-1] if inside[-1] > 1 else options[-1]
        configs[i] = dataclasses.replace(cfg, expert=e)
    return Strategy(graph, devices, tuple(configs))


def _per_host(devices: DeviceGraph) -> dict[str, int]:
    hosts: dict[str, int] = {}
    for d in devices.devices:
        hosts[d.host] = hosts.get(d.host, 0) + 1
    return hosts


BASELINES: dict[str, Callable[[OpGraph, DeviceGraph], Strategy]] = {
    "data_parallel": data_parallel,
    "model_parallel": model_parallel,
    "owt": owt,
    "expert": expert_rnn,
    "expert_parallel": expert_parallel,
}


def applicable(graph: OpGraph) -> list[str]:
    """Baselines that make sense for `graph` (the RNN expert only where there are LSTMs,
    expert parallelism only where there are mixtures of experts)."""
    names = ["data_parallel", "model_parallel", "owt"]
    if any(op.kind == "lstm" for op in graph.ops):
        names.append("expert")
    if any(op.kind == "moe" for op in graph.ops):
        names.append("expert_parallel")
    return names
