"""A strategy as PyTorch DTensor placements: a `DeviceMesh` and `parallelize_module`.

`export_plan(strategy, module)` reads each op's config against a 1-D mesh of the strategy's
D devices (mesh rank k = device k) and says how its module runs:

- "data": the op splits its samples D ways over devices 0..D-1 in order (FlexFlow's Sample
  dim): parameters `Replicate()`, input redistributed to `Shard(0)` (data parallelism; the
  gradients of replicated parameters come back as `Partial` sums, reduced by DTensor);
- "colwise": a linear or embedding splits its output channels D ways over devices 0..D-1
  (the Parameter dim): `ColwiseParallel` (weight rows sharded, output `Shard(-1)`);
- "heads": an attention op splits its heads D ways: not placed (its q, k, v arrive sharded
  by channels, or whole where they are slices of a fused projection's column-parallel
  output, and it computes each rank's heads, see `_DTensorMode`; `ExportPlan.by_heads`
  names its module); "propagate": a slice (a piece of a fused QKV projection) takes its
  input's layout;
- on a 2-D mesh (`mesh_shape=(data, tensor)`, rank s * tensor + c): "data" as above over
  the whole mesh (`[Shard(0), Shard(0)]`), and an op split samples x channels data x tensor
  ways is "colwise" over the second mesh dim with its samples sharded over the first;
- anything else is not expressible with one mesh dimension: height/width/length splits
  (DTensor convolutions have no halo exchange), output-channel splits of convolutions
  (DTensor on gloo does not shard conv weights), splits of several dims, and placements on a
  subset or another order of the devices. Those ops are named in one `ExportError`, or with
  `fallback="replicate"` run replicated on every rank (parameters `Replicate()`, input
  redistributed to `Replicate()`) and are listed in `ExportPlan.fell_back`.

- "rowwise": a linear splits its sum (`ParallelConfig.reduce`, Megatron-LM's row-parallel
  layer) D ways over devices 0..D-1: `RowwiseParallel` (weight columns sharded, input
  `Shard(-1)`, the partial sums all-reduced into a `Replicate()` output); on a 2-D mesh, the
  sum split over the second dim with the samples split over the first.

A channel-split linear that reads another one's sharded output gets its input all-gathered
(`Replicate()`), exactly the transfer the cost model priced; a row-wise linear's partial sums
are all-reduced, where the cost model may have priced a reduce-scatter into a consumer that
splits its rows (the same bytes on a ring). Ops without parameters are not placed: DTensor's sharding
propagation runs them in their inputs' layout, and the next module with parameters
redistributes its input to the layout above. Module outputs stay DTensors
(`use_local_output=False`), so layouts flow from module to module; call `.full_tensor()` on
the model's output for the loss.

Activation recomputation (`recompute="full"` or k, the plan file's `cost.recompute`): the modules
of the numbered blocks whose ops recompute (`planner.costs.recompute.recomputed_ops`:
`transformer.h.0`, ...) run their forward under `torch.utils.checkpoint.checkpoint`
(non-reentrant) after parallelizing, as Megatron-LM's "full" recomputation does: a block keeps
its input and output, and its backward runs its forward again (listed in
`ExportPlan.checkpointed`).

ZeRO (`zero=`, the plan file's `cost.zero`): the parameters of each module are sharded over
the mesh dims that replicate them (`ExportPlan.sharded`: every dim for a data-parallel module,
the data dim of a (data, tensor) mesh for a column/row-parallel one, none for those on a 1-D
mesh: their shards have no replicas). Stage 3 is FSDP2's `fully_shard(reshard_after_forward=
True)` on those modules, stage 2 `fully_shard(reshard_after_forward=False)` (the weights stay
gathered from the forward to the backward: ZeRO-2's memory during a step, and ZeRO-3's
between steps), both over the DTensor mesh itself (`dp_mesh_dims`), the gradients' partial
sums reduce-scattered (summed, not averaged). Stage 1 is `torch.distributed.optim.
ZeroRedundancyOptimizer` over the parameters' local tensors after their gradients are
all-reduced: `Exported.optimizer(cls, **options)` builds it (`ZeroOneOptimizer`). Modules that
fall back to replication are sharded too: like batch norm's, their gradients are whole on
every rank, and become partial sums before the reduce-scatter (`planner.export.zero`).

`parallelize(strategy, module)` applies the plan in every rank of an initialized process
group (torchrun, or `torch.distributed.init_process_group`); `with process_group():` sets one
up for a block and tears it down after a barrier: see docs/runtime.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.costs.recompute import recompute_error, recomputed_ops
from planner.errors import ExportError
from planner.export.common import check_params
from planner.export.zero import ZeroOneOptimizer, fully_shard_plan
from planner.graph.hf import is_hf_model
from planner.graph.opkinds import CHANNEL, LENGTH, SAMPLE

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from planner.costs.config import ParallelConfig
    from planner.graph.opgraph import Op
    from planner.problems.strategy import Strategy

__all__ = [
    "ExportError",
    "ExportPlan",
    "Exported",
    "OpPlacement",
    "export_plan",
    "parallelize",
    "process_group",
]

STYLES = ("data", "colwise", "rowwise", "replicate", "heads", "propagate")
FALLBACKS = ("error", "replicate")
ZERO_STAGES = (0, 1, 2, 3)
_COLWISE_KINDS = ("linear", "embedding")


@dataclass(frozen=True)
class OpPlacement:
    """How one op of the strategy runs under DTensor: its style ("data", "colwise",
    "replicate"), its module paths, and why it fell back to replication (None if it did not)."""

    op: str
    kind: str
    config: str
    style: str
    modules: tuple[str, ...] = ()
    reason: str | None = None


@dataclass(frozen=True)
class ExportPlan:
    """Per op and per module, the DTensor style of a strategy on a 1-D mesh of `world` ranks;
    `inputs` is the placement of the model's inputs ("shard": `Shard(0)`, or "replicate")."""

    world: int
    ops: tuple[OpPlacement, ...]
    modules: tuple[tuple[str, str], ...]  # (module path, style), in graph order
    inputs: str
    mesh: tuple[int, ...] = ()  # the mesh's shape: (world,), or (data, tensor) for 2-D
    checkpointed: tuple[str, ...] = ()  # block modules that recompute (recompute="full")
    # modules whose F.scaled_dot_product_attention calls recompute (recompute="selective")
    checkpointed_attention: tuple[str, ...] = ()
    zero: int = 0  # the ZeRO stage
    # (module path, mesh dims its parameters are sharded over) of the modules ZeRO shards
    sharded: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # modules whose attention ops split by heads ("heads"): each rank computes its own heads
    by_heads: tuple[str, ...] = ()

    @property
    def fell_back(self) -> tuple[OpPlacement, ...]:
        """The ops that are not expressible and run replicated instead (fallback="replicate")."""
        return tuple(o for o in self.ops if o.reason is not None)

    def describe(self) -> list[str]:
        """One line per module: 'path: style', and the mesh dims ZeRO shards it over."""
        dims = dict(self.sharded)
        return [
            f"{path}: {style}"
            + (f", ZeRO-{self.zero} over mesh dims {dims[path]}" if path in dims else "")
            for path, style in self.modules
        ]


def export_plan(
    strategy: Strategy,
    module: nn.Module,
    fallback: str = "error",
    mesh_shape: Sequence[int] | None = None,
    recompute: str | int = "none",
    zero: int = 0,
) -> ExportPlan:
    """The DTensor styles of `strategy` for `module` (the module it was planned for).

    fallback="error" raises one ExportError naming every op that DTensor cannot express;
    fallback="replicate" runs those replicated and lists them in `fell_back`. mesh_shape:
    (world,) (the default) or (data, tensor) for a 2-D mesh, rank = i * tensor + j: an op
    that splits its samples `data` ways and its channels `tensor` ways over the devices in
    order is then data x tensor parallel (see `_style`). recompute: "none", "full" or a
    number k of blocks (the plan file's `cost.recompute`): the numbered blocks that recompute
    (all, or the first k) are `checkpointed`.
    zero: the ZeRO stage 0-3 (the plan file's `cost.zero`): the modules whose parameters it
    shards, and over which mesh dims, are `sharded` (see the module's docstring)."""
    from planner.pipeline.spec import PipelinedStrategy

    if isinstance(strategy, PipelinedStrategy):
        raise ExportError(
            "this is a pipelined strategy (it has a pipeline section): export it to torch's "
            "pipelining with planner.parallelize_pipeline, not to DTensor placements"
        )
    if fallback not in FALLBACKS:
        raise ExportError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if (error := recompute_error(recompute)) is not None:
        raise ExportError(error)
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ExportError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero!r}")
    graph, world = strategy.graph, strategy.devices.num_devices
    shape = (world,) if mesh_shape is None else tuple(int(n) for n in mesh_shape)
    if len(shape) not in (1, 2) or math.prod(shape) != world or min(shape) < 1:
        raise ExportError(
            f"mesh_shape must be (world,) or (data, tensor) with data x tensor = {world} "
            f"(the strategy's devices), got {tuple(mesh_shape or ())}"
        )
    types = {name: type(m) for name, m in module.named_modules()}
    check_params(strategy, module)
    ops: list[OpPlacement] = []
    for op, cfg in zip(graph.ops, strategy.configs, strict=True):
        paths = tuple(dict.fromkeys(_module_of(p.name) for p in op.params))
        style, reason = _style(op, cfg, shape, {p: types.get(p) for p in paths})
        if op.kind == "elementwise" and op.params and style == "data":
            # a parameter an add reads (a position embedding's weight): its module is
            # replicated and reads its input (the positions) whole
            style = "replicate"
        if reason is not None and not op.params and op.kind != "input":
            reason += " (it has no parameters: DTensor runs it in its input's layout)"
        ops.append(OpPlacement(op.name, op.kind, cfg.describe(op), style, paths, reason))
    ops = _agree_per_module(ops, _tied_modules(module))
    sharded = _sharded(ops, len(shape), zero) if world > 1 else ()
    bad = [o for o in ops if o.reason is not None]
    if bad and fallback == "error":
        listed = "; ".join(f"{o.op} ({o.kind}, {o.config}): {o.reason}" for o in bad[:6])
        more = f"; and {len(bad) - 6} more" if len(bad) > 6 else ""
        cp = any(o.reason.startswith(CONTEXT_PARALLEL_REASON) for o in bad if o.reason)
        why = f" Context parallelism is not exported: {CONTEXT_PARALLEL_REASON}." if cp else ""
        raise ExportError(
            f"{len(bad)} op(s) of the strategy cannot be expressed as DTensor placements: "
            f"{listed}{more}.{why} Pass fallback='replicate' to run them replicated"
        )
    modules: dict[str, str] = {}
    for o in ops:
        for path in o.modules:
            modules.setdefault(path, o.style)
    inputs = [o for o in ops if o.kind == "input"]
    shard = world > 1 and all(o.style == "data" for o in inputs)
    placed = tuple(modules.items())
    blocks = () if recompute == "selective" else _blocks(graph, types, recompute)
    attention = _attention_modules(graph, types) if recompute == "selective" else ()
    inputs_style = "shard" if shard else "replicate"
    heads = (_enclosing(o.op, types) for o in ops if o.style == "heads")
    by_heads = tuple(dict.fromkeys(p for p in heads if p))
    return ExportPlan(
        world, tuple(ops), placed, inputs_style, shape, blocks, attention, zero, sharded, by_heads
    )


def _sharded(
    ops: Sequence[OpPlacement], ndim: int, zero: int
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(module path, mesh dims) of the modules whose parameters ZeRO shards: over the dims
    that replicate them (ZeRO shards over a shard's data-parallel replicas)."""
    if not zero:
        return ()
    out: dict[str, tuple[int, ...]] = {}
    for o in ops:
        if o.style in ("data", "replicate"):
            dims = tuple(range(ndim))
        elif o.style in ("colwise", "rowwise") and ndim == 2:
            dims = (0,)  # the data dim; the tensor dim shards the weights themselves
        else:
            continue  # column/row-parallel on a 1-D mesh: no replicas; heads: no parameters
        for path in o.modules:
            out.setdefault(path, dims)
    return tuple(out.items())


def _blocks(graph: Any, types: dict[str, Any], recompute: str | int) -> tuple[str, ...]:
    """The module paths of the numbered blocks whose ops recompute, in graph order."""
    blocks = tuple(dict.fromkeys(recomputed_ops(graph, recompute).block.values()))
    missing = [b for b in blocks if b not in types]
    if missing:
        raise ExportError(
            f"recompute checkpoints the numbered blocks of the graph, but the module has "
            f"no submodule {missing[0]!r}: the graph's op names are not this module's paths"
        )
    return blocks


def _enclosing(name: str, types: dict[str, Any]) -> str:
    """The longest module path op `name` starts with ("" if none): the module that computes
    it (`model.layers.0.self_attn` for `model.layers.0.self_attn.attention`)."""
    parts = name.split(".")
    paths = (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
    return next((p for p in paths if p in types), "")


def _attention_modules(graph: Any, types: dict[str, Any]) -> tuple[str, ...]:
    """The modules that compute the attention ops "selective" recomputes: per op, the
    longest module path its name starts with (`transformer.h.0.attn` for the op
    `transformer.h.0.attn.attention`)."""
    out = []
    for i in recomputed_ops(graph, "selective").block:
        found = _enclosing(graph.ops[i].name, types)
        if not found:
            raise ExportError(
                f"recompute='selective' checkpoints the attention of {graph.ops[i].name!r}, "
                "but the module has no submodule of that path: the graph's op names are not "
                "this module's paths"
            )
        out.append(found)
    return tuple(dict.fromkeys(out))


def _tied_modules(module: nn.Module) -> list[set[str]]:
    """Sets of module paths that hold the same parameter tensor."""
    holders: dict[int, set[str]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for _, p in sub.named_parameters(recurse=False):
            holders.setdefault(id(p), set()).add(path)
    return [paths for paths in holders.values() if len(paths) > 1]


def _module_of(param: str) -> str:
    return param.rsplit(".", 1)[0] if "." in param else ""


def _style(
    op: Op, cfg: ParallelConfig, shape: tuple[int, ...], types: dict[str, Any]
) -> tuple[str, str | None]:
    """(style, None) when expressible, else ("replicate", why not). On a 2-D mesh (data,
    tensor), the tensor-parallel styles are those of a 1-D mesh of `tensor` ranks with the
    samples split `data` ways besides (task (s, c) on rank s * tensor + c)."""
    from torch import nn

    world = math.prod(shape)
    split = {d: g for d, g in zip(op.output.dims, cfg.degrees, strict=True) if g > 1}
    if op.kind == "moe" and (cfg.expert > 1 or cfg.reduce > 1):
        # not "data": that would hold every expert whole on every rank, silently
        what = [f"expert parallelism (expert {cfg.expert})"] if cfg.expert > 1 else []
        if cfg.reduce > 1:  # no DTensor style cuts a fused block's experts' hidden width
            what.append(f"expert tensor parallelism (the experts' widths cut {cfg.reduce} ways)")
        return "replicate", (
            f"{' and '.join(what)} {'is' if len(what) == 1 else 'are'} not exported to DTensor "
            f"placements (the layerwise runtime runs {'it' if len(what) == 1 else 'them'}: "
            "runtime.run_strategy)"
        )
    if world == 1 or (
        split == {SAMPLE: world} and cfg.devices == tuple(range(world)) and cfg.reduce == 1
    ):
        return "data", None
    if cfg.devices != tuple(range(world)):
        where = ",".join(map(str, cfg.devices))
        return "replicate", f"placed on devices [{where}], not on the whole mesh in order"
    if cfg.reduce > 1:
        return _rowwise(op, cfg, split, shape, types)
    if len(shape) == 2:
        data, tensor = shape
        if op.kind == "slice":
            return "propagate", None
        if split != {SAMPLE: data, CHANNEL: tensor}:
            return "replicate", (
                f"on the {data} x {tensor} mesh an op splits its samples {world} ways, or "
                f"its samples {data} and its channels {tensor} ways"
            )
        split, world = {CHANNEL: tensor}, tensor
    if op.kind == "attention" and LENGTH in split:
        return "replicate", CONTEXT_PARALLEL_REASON
    if op.kind == "attention" and split == {CHANNEL: world}:
        # heads: computed per rank on its heads (_DTensorMode), as q arrives sharded
        heads = int(op.attr("kv_heads", op.attr("heads", 1)))
        if heads % world == 0:
            return "heads", None
        return "replicate", f"{heads} k/v heads do not split {world} ways"
    if op.kind == "slice" and len(split) == 1:
        return "propagate", None  # a piece of its input, in whatever layout that has
    if split == {CHANNEL: world} and op.kind in _COLWISE_KINDS:
        others = {
            p: t
            for p, t in types.items()
            if t is None or not issubclass(t, nn.Linear | nn.Embedding)
        }
        if not others:
            return "colwise", None
        named = ", ".join(
            f"{p or '<the model>'} ({t.__name__ if t is not None else 'no module'})"
            for p, t in others.items()
        )
        return "replicate", (
            f"a channel split of an op with parameters of {named}, not of an nn.Linear or "
            "nn.Embedding (coarsening folds an add of a parameter into the layer before it)"
        )
    if len(split) > 1:
        return "replicate", f"splits {len(split)} dims; a 1-D mesh shards one"
    (dim,) = split
    if op.kind == "conv2d" and dim == CHANNEL:
        return "replicate", "an output-channel split of a convolution (not on DTensor/gloo)"
    if dim in ("height", "width"):
        return "replicate", f"a {dim} split (DTensor convolutions have no halo exchange)"
    return "replicate", f"a {dim} split of a {op.kind} op"


# torch 2.13's context_parallel (torch.distributed.tensor.experimental._context_parallel.
# _attention) replaces only the CUDA kernels aten._scaled_dot_product_{flash,efficient,cudnn}
# _attention ("CP only supports flash attention and memory efficient attention now"); a
# DTensor sharded along the sequence has no CPU SDPA sharding rule
CONTEXT_PARALLEL_REASON = (
    "a sequence (context-parallel) split of attention: DTensor on gloo has no CPU "
    "scaled_dot_product_attention for sequence shards, and torch's experimental "
    "context_parallel runs only the CUDA flash/efficient/cuDNN kernels"
)


def _rowwise(
    op: Op,
    cfg: ParallelConfig,
    split: dict[str, int],
    shape: tuple[int, ...],
    types: dict[str, Any],
) -> tuple[str, str | None]:
    """A contraction split: `RowwiseParallel` when it sums over the tensor-parallel ranks (the
    whole 1-D mesh, or the second dim of a (data, tensor) mesh with the samples split over
    the first) in an nn.Linear."""
    from torch import nn

    tensor = shape[-1]
    wanted = {SAMPLE: shape[0]} if len(shape) == 2 else {}
    if op.kind != "linear" or cfg.reduce != tensor or split != wanted:
        return "replicate", (
            f"a sum split {cfg.reduce} ways{' with ' + str(split) if split else ''}: DTensor "
            f"expresses a linear's sum split over the {tensor} tensor-parallel ranks"
            + (f" with the samples split {shape[0]} ways" if len(shape) == 2 else "")
        )
    others = [p for p, t in types.items() if t is None or not issubclass(t, nn.Linear)]
    if others:
        return (
            "replicate",
            f"a sum split of an op with parameters of {others[0] or '<the model>'}, not of an nn.Linear",
        )
    return "rowwise", None


def _agree_per_module(ops: list[OpPlacement], tied: Sequence[set[str]] = ()) -> list[OpPlacement]:
    """A module used by several ops (unrolled steps, shared weights) takes one style, and so
    do modules that share a parameter (`tied`: sets of module paths, e.g. a language model's
    embedding and output layer): when they disagree, all of them fall back to replication."""
    styles: dict[str, set[str]] = {}
    for o in ops:
        for path in o.modules:
            styles.setdefault(path, set()).add(o.style)
    for group in tied:
        union = set().union(*(styles.get(p, set()) for p in group))
        for p in group:
            if p in styles:
                styles[p] = union
    mixed = {path for path, s in styles.items() if len(s) > 1}
    return [
        o
        if not mixed & set(o.modules)
        else OpPlacement(
            o.op,
            o.kind,
            o.config,
            "replicate",
            o.modules,
            o.reason or "shares its module with ops placed differently",
        )
        for o in ops
    ]


# -- applying the plan (every rank of an initialized process group) -------------------------------


@dataclass(frozen=True)
class Exported:
    """A module parallelized with DTensor: the module (changed in place), its mesh, the plan."""

    module: nn.Module
    mesh: DeviceMesh
    plan: ExportPlan
    # the ZeroOneOptimizers `optimizer` made (stage 1; the forward refuses to run without one)
    zero_optimizers: list[Any] = field(default_factory=list, compare=False, repr=False)

    @property
    def fell_back(self) -> tuple[OpPlacement, ...]:
        """The ops that run replicated because DTensor cannot express their config."""
        return self.plan.fell_back

    def distribute_inputs(self, *tensors: Any) -> tuple[Any, ...]:
        """Full input tensors (the same on every rank) as DTensors in the plan's input
        layout. A rank that holds only its own samples uses `DTensor.from_local(x, mesh,
        [Shard(0)])` instead."""
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        layout = Shard(0) if self.plan.inputs == "shard" else Replicate()
        return tuple(distribute_tensor(t, self.mesh, [layout] * self.mesh.ndim) for t in tensors)

    def optimizer(self, cls: Any, **options: Any) -> Any:
        """An optimizer of class `cls` (`torch.optim.SGD`, `torch.optim.Adam`, ...; `options`
        its arguments but the parameters) for the module at the plan's ZeRO stage: stages 0,
        2 and 3 `cls(module.parameters(), **options)` (at 2-3 FSDP's sharded parameters keep
        sharded state); stage 1 a `ZeroOneOptimizer` (`step()` and `zero_grad()`): each rank
        keeps the state of a share of `plan.sharded`'s modules' parameters (whole parameters,
        balanced by size). At stage 1 the module refuses to run forward until it is made.
        Every rank calls it, in the same order as the other collectives."""
        if self.plan.zero != 1:
            return cls(self.module.parameters(), **options)
        dims = dict(self.plan.sharded)
        params: dict[int, tuple[Any, tuple[int, ...]]] = {}
        for path, sub in self.module.named_modules(remove_duplicate=False):
            for p in sub.parameters(recurse=False):
                params.setdefault(id(p), (p, dims.get(path, ())))
        made = ZeroOneOptimizer(params.values(), self.mesh, cls, **options)
        self.zero_optimizers.append(made)
        return made


def parallelize(
    strategy: Strategy,
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    fallback: str = "error",
    mesh_shape: Sequence[int] | None = None,
    recompute: str | int = "none",
    zero: int = 0,
) -> Exported:
    """Apply `strategy` to `module` in place with `parallelize_module` (every rank calls it).

    mesh: a DeviceMesh of the strategy's device count, 1-D or 2-D (data, tensor) (default:
    all ranks in `mesh_shape`, (world,) unless given, on "cuda" with the nccl backend, else
    "cpu"). Parameters of modules the strategy does not place are replicated. recompute:
    the plan file's `cost.recompute`; "full" or k checkpoints `plan.checkpointed`'s blocks. zero:
    the plan file's `cost.zero`; stages 2-3 apply FSDP2's `fully_shard` to `plan.sharded`'s
    modules (then to `module`), stage 1 needs the optimizer of `Exported.optimizer`. The mesh
    made here names its dims ("world",) or ("data", "tensor"); a mesh passed for stage 2-3
    must name its dims."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    if mesh is not None and mesh_shape is None:
        mesh_shape = tuple(mesh.shape)
    plan = export_plan(strategy, module, fallback, mesh_shape, recompute, zero)
    if not dist.is_available() or not dist.is_initialized():
        raise ExportError(
            "parallelize needs an initialized process group: launch with torchrun, or call "
            "torch.distributed.init_process_group first"
        )
    if mesh is None:
        if dist.get_world_size() != plan.world:
            raise ExportError(
                f"the strategy is for {plan.world} devices but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        names = ("world",) if len(plan.mesh) == 1 else ("data", "tensor")
        mesh = init_device_mesh(device, plan.mesh, mesh_dim_names=names)
    if tuple(mesh.shape) != plan.mesh:
        raise ExportError(f"the mesh must have shape {plan.mesh}, got {tuple(mesh.shape)}")
    styles = {
        path: _parallel_style(style, mesh.ndim)
        for path, style in plan.modules
        if path and style not in ("heads", "propagate")
    }
    _no_cache(module)
    holders = _holders(module)
    parallelize_module(module, mesh, styles)
    _replicate_the_rest(module, mesh)
    _retie(holders)
    _compute_in_mode(module)
    for path in plan.checkpointed:
        _checkpoint(module.get_submodule(path))
    for path in plan.checkpointed_attention:
        _checkpoint_attention(module.get_submodule(path), path)
    for path in plan.by_heads:
        _attend_by_heads(module.get_submodule(path))
    if plan.zero >= 2 and plan.sharded:
        tied = _tied_modules(module)
        fully_shard_plan(module, mesh, plan.sharded, tied, reshard_after_forward=plan.zero == 3)
    exported = Exported(module, mesh, plan)
    if plan.zero == 1 and plan.sharded:
        module.register_forward_pre_hook(_needs_zero_optimizer(exported.zero_optimizers))
    return exported


def _no_cache(module: Any) -> None:
    """A Hugging Face model trains without its key/value cache (`config.use_cache` off, as
    capture traces it: `planner.graph.hf`): the cache's empty plain tensors would meet the
    layers' DTensors in `torch.cat`."""
    config = getattr(module, "config", None)
    if config is not None and is_hf_model(module) and getattr(config, "use_cache", False):
        config.use_cache = False


def _needs_zero_optimizer(made: list[Any]) -> Any:
    """Stage 1 shards only through the optimizer: one's own would keep the whole state on every
    rank, so the module's forward (a pre-hook) refuses to run until `Exported.optimizer` made
    one (`made`)."""

    def check(module: Any, args: Any) -> None:
        if not made:
            raise ExportError(
                "the plan's ZeRO stage 1 shards the optimizer state: build the optimizer with "
                "exported.optimizer(cls, **options) (e.g. exported.optimizer(torch.optim.AdamW, "
                "lr=1e-4)) before the first forward"
            )

    return check


def _holders(module: Any) -> list[list[tuple[Any, str]]]:
    """(module, attribute) pairs that hold the same parameter, for `_retie`."""
    groups: dict[int, list[tuple[Any, str]]] = {}
    for _, sub in module.named_modules(remove_duplicate=False):
        for key, p in sub.named_parameters(recurse=False):
            groups.setdefault(id(p), []).append((sub, key))
    return [g for g in groups.values() if len(g) > 1]


def _retie(holders: list[list[tuple[Any, str]]]) -> None:
    """Distributing a module's parameters replaces them: a parameter that several modules
    held (tied weights) is one again, the first holder's (their styles agree:
    `_agree_per_module`), or its gradients would be summed apart and the copies drift."""
    for group in holders:
        first = getattr(group[0][0], group[0][1])
        for sub, key in group[1:]:
            if getattr(sub, key) is not first:
                setattr(sub, key, first)


def _compute_in_mode(module: Any) -> None:
    """The module's forward runs under `_DTensorMode` (see there): attention written as
    tensor code then computes on DTensors. Idempotent."""
    forward = module.forward
    if getattr(forward, "_layerwise_mode", False):
        return

    def in_mode(*args: Any, **kwargs: Any) -> Any:
        with _DTensorMode():
            return forward(*args, **kwargs)

    in_mode._layerwise_mode = True  # type: ignore[attr-defined]
    module.forward = in_mode


def _checkpoint(block: Any) -> None:
    """The block's forward runs under non-reentrant activation checkpointing: it keeps its
    arguments and output, none of its inner activations, and runs again (under
    `_DTensorMode`, which the backward pass is not in) when its backward needs them. The
    forward is replaced on the instance, so parameter names stay as they were. Idempotent."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward
    if getattr(forward, "_layerwise_checkpoint", False):
        return

    def run(*args: Any, **kwargs: Any) -> Any:
        with _DTensorMode():
            return forward(*args, **kwargs)

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    checkpointed._layerwise_checkpoint = True  # type: ignore[attr-defined]
    block.forward = checkpointed


# Attention kernels selective recomputation ran again in backward passes, in this process
ATTENTION_RECOMPUTED = [0]
# While a module of `ExportPlan.checkpointed_attention` runs its forward: a one-element list
# counting its F.scaled_dot_product_attention calls, each checkpointed by `_DTensorMode`
_SELECTIVE: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "layerwise_selective", default=None
)


# True while a module whose attention op the plan splits by heads runs its forward
_BY_HEADS: contextvars.ContextVar[bool] = contextvars.ContextVar("layerwise_heads", default=False)


def _attend_by_heads(attn: Any) -> None:
    """`attn`'s F.scaled_dot_product_attention calls compute each rank's heads, even where q, k
    and v arrive whole (`_DTensorMode`). The forward is replaced on the instance. Idempotent."""
    forward = attn.forward
    if getattr(forward, "_layerwise_heads", False):
        return

    def by_heads(*args: Any, **kwargs: Any) -> Any:
        token = _BY_HEADS.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _BY_HEADS.reset(token)

    by_heads._layerwise_heads = True  # type: ignore[attr-defined]
    attn.forward = by_heads


def _checkpoint_attention(attn: Any, path: str) -> None:
    """Megatron-LM's selective recomputation in the export: every
    `F.scaled_dot_product_attention` call of `attn`'s forward runs under non-reentrant
    checkpointing (it keeps q, k and v, none of the kernel's own buffers, and runs again
    in the backward pass). A forward that makes no such call (attention written out as
    tensor code) is one ExportError: nothing would be recomputed. Idempotent."""
    forward = attn.forward
    if getattr(forward, "_layerwise_selective", False):
        return

    def selective(*args: Any, **kwargs: Any) -> Any:
        calls = [0]
        token = _SELECTIVE.set(calls)
        try:
            out = forward(*args, **kwargs)
        finally:
            _SELECTIVE.reset(token)
        if not calls[0]:
            raise ExportError(
                f"recompute='selective' checkpoints F.scaled_dot_product_attention, which "
                f"{path!r}'s forward does not call (its attention is written out as tensor "
                "code): export with recompute='full' or 'none'"
            )
        return out

    selective._layerwise_selective = True  # type: ignore[attr-defined]
    attn.forward = selective


def _dtensor_mode_class() -> Any:
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import local_map
    from torch.overrides import TorchFunctionMode
    from torch.utils.checkpoint import checkpoint

    sdpa = F.scaled_dot_product_attention

    class Mode(TorchFunctionMode):
        """What DTensor lacks for attention code, during a parallelized forward:
        - a plain tensor that meets a DTensor in one call (a causal mask made with
          `torch.ones(T, T).tril()`, a rotary table, position indices) is taken as replicated
          on the mesh, as the module computed it the same on every rank;
        - `F.scaled_dot_product_attention` (no sharding rule for torch's CPU kernel) runs on
          each rank's local q, k, v with `local_map`, k and v in q's layout (samples or heads
          split: each rank computes its own)."""

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            found = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
            counting = _SELECTIVE.get()
            if func is sdpa and counting is not None:  # recompute="selective"
                counting[0] += 1
                q, k, v = args[:3]
                rest, extra = args[3:], dict(kwargs)
                if isinstance(q, DTensor):
                    mesh, layout = q.device_mesh, list(q.placements)
                    k, v = k.redistribute(mesh, layout), v.redistribute(mesh, layout)
                attend = self._attend(q, rest, extra)
                runs = [0]

                def counted(a: Any, b: Any, c: Any) -> Any:
                    runs[0] += 1
                    ATTENTION_RECOMPUTED[0] += runs[0] > 1  # a run after the first: again
                    return attend(a, b, c)

                return checkpoint(counted, q, k, v, use_reentrant=False)
            if not found:
                return func(*args, **kwargs)
            mesh = found[0].device_mesh
            if func is sdpa and isinstance(args[0], DTensor):
                q, k, v = args[:3]
                layout = list(q.placements)
                attend = self._attend(q, args[3:], dict(kwargs))
                return attend(q, k.redistribute(mesh, layout), v.redistribute(mesh, layout))

            def replicated(a: Any) -> Any:
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() > 0:
                    return DTensor.from_local(a, mesh, [Replicate()] * mesh.ndim, run_check=False)
                return a

            args = tuple(replicated(a) for a in args)
            kwargs = {k: replicated(v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

        @staticmethod
        def _attend(q: Any, rest: Any, extra: dict[str, Any]) -> Any:
            """sdpa of (q, k, v) with `rest` and `extra` as its other arguments: on each
            rank's local tensors in q's layout when q is a DTensor (k and v redistributed to
            it first). In a module whose attention the plan splits by heads (`_BY_HEADS`)
            where q arrives whole on the last (tensor) mesh dim, as slices of a fused
            projection's column-parallel output do (DTensor gathers a slice that crosses
            shards), each rank computes its own heads of the whole q, k and v; its output is
            sharded by heads, and its gradients of q, k and v, nonzero on its heads only,
            partial sums."""
            if not isinstance(q, DTensor):
                return lambda a, b, c: sdpa(a, b, c, *rest, **extra)
            layout = list(q.placements)
            if not (_BY_HEADS.get() and isinstance(layout[-1], Replicate)):
                return local_map(
                    lambda a, b, c: sdpa(a, b, c, *rest, **extra),
                    out_placements=layout,
                    in_placements=(layout, layout, layout),
                )
            mesh = q.device_mesh
            ways, mine = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)

            def own_heads(a: Any, b: Any, c: Any) -> Any:  # (batch, heads, rows, head_dim)
                a, b, c = (x.chunk(ways, dim=1)[mine] for x in (a, b, c))
                return sdpa(a, b, c, *rest, **extra)

            grads = [*layout[:-1], Partial()]
            return local_map(
                own_heads,
                out_placements=[*layout[:-1], Shard(1)],
                in_placements=(layout, layout, layout),
                in_grad_placements=(grads, grads, grads),
            )

    return Mode


class _DTensorMode:
    """A fresh `TorchFunctionMode` per forward (built lazily: torch imports stay local)."""

    def __enter__(self) -> Any:
        self.mode = _dtensor_mode_class()()
        return self.mode.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.mode.__exit__(*exc)


@contextlib.contextmanager
def process_group(backend: str | None = None, **init: Any) -> Iterator[None]:
    """torch.distributed's default process group for a `with` block in every process of a
    launch: initialized on entry (torchrun's environment, or `init`: store, rank,
    world_size, timeout, ...; backend None: nccl with CUDA, else gloo) unless one is already,
    and at the end of the block destroyed after a barrier. Without the barrier a rank that
    destroys the group while a peer's last collectives are in flight can make gloo abort the
    process at exit (SIGABRT). After an exception the group is destroyed without waiting:
    a failed peer may never reach the barrier. A group initialized before is left as it is."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, **init)
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        raise
    if dist.get_backend() == "nccl":  # pragma: no cover - no GPU here
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    dist.destroy_process_group()


def _parallel_style(style: str, ndim: int = 1) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise" and ndim == 1:
        return ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        )
    if style == "colwise":  # (data, tensor): samples by the first dim, rows by the second
        return _placed_style([Shard(0), Replicate()], [Replicate(), Shard(0)])
    if style == "rowwise" and ndim == 1:  # the weight's columns; the sum all-reduced
        return RowwiseParallel(
            input_layouts=Shard(-1), output_layouts=Replicate(), use_local_output=False
        )
    if style == "rowwise":  # (data, tensor): samples by the first dim, columns by the second
        return _placed_style(
            [Shard(0), Shard(-1)],
            [Replicate(), Shard(1)],
            bias=True,
            output=[Shard(0), Replicate()],
        )
    layout = Shard(0) if style == "data" else Replicate()
    return _placed_style([layout] * ndim)


def _placed_style(
    layout: list[Any],
    weights: list[Any] | None = None,
    bias: bool = False,
    output: list[Any] | None = None,
) -> Any:
    """A ParallelStyle: every tensor input redistributed to `layout` (plain tensors are taken
    as replicated), parameters replicated or, with `weights`, placed so (a linear's weight
    and bias by rows, an embedding's table by columns: its output channels); with `bias`,
    1-D parameters (a row-wise linear's bias) replicated instead; with `output`, the output
    redistributed to it (a row-wise linear's partial sums, summed)."""
    from torch import nn
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )
    from torch.distributed.tensor.parallel import ParallelStyle

    def inputs(module: Any, args: Any, mesh: Any) -> Any:
        def place(x: Any) -> Any:
            if isinstance(x, tuple | list):
                return type(x)(place(v) for v in x)
            if isinstance(x, DTensor):
                return x.redistribute(mesh, layout)
            if hasattr(x, "dim"):  # a torch.Tensor
                whole = [Replicate()] * mesh.ndim
                return DTensor.from_local(x, mesh, whole).redistribute(mesh, layout)
            return x

        return place(args)

    def params(name: str, module: Any, mesh: Any) -> None:
        if weights is None:
            _replicate_params(name, module, mesh)
            return
        for key, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                continue
            placements = weights
            if bias and p.dim() == 1:
                placements = [Replicate()] * mesh.ndim
            if isinstance(module, nn.Embedding):  # the table's columns are the channels
                placements = [Shard(1) if isinstance(w, Shard) else w for w in weights]
            placed = distribute_tensor(p.data, mesh, placements)
            module.register_parameter(key, nn.Parameter(placed, p.requires_grad))

    def outputs(module: Any, out: Any, mesh: Any) -> Any:
        if output is not None and isinstance(out, DTensor):
            return out.redistribute(mesh, output)
        return out

    class Placed(ParallelStyle):
        def _apply(self, module: Any, device_mesh: Any) -> Any:
            return distribute_module(module, device_mesh, params, inputs, outputs)

    return Placed()


def _replicate_params(name: str, module: Any, mesh: Any) -> None:
    """distribute_module's partition_fn: each direct parameter as a replicated DTensor."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    for key, p in list(module.named_parameters(recurse=False)):
        if not isinstance(p, DTensor):
            replicated = distribute_tensor(p.data, mesh, [Replicate()] * mesh.ndim)
            module.register_parameter(key, nn.Parameter(replicated, p.requires_grad))


def _replicate_the_rest(module: Any, mesh: Any) -> None:
    """Parameters no style placed (root parameters, unused modules) become replicated."""
    for name, sub in module.named_modules():
        _replicate_params(name, sub, mesh)
