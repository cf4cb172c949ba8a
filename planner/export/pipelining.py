"""A pipelined strategy as PyTorch's own pipelining (`torch.distributed.pipelining`).

`pipeline_plan(planned, module)` checks what torch's pipelining can run of a
`planner.pipeline.PipelinedStrategy` and says how: chunk c of the pipeline is torch's stage
c, cut from `module` by tracing (`torch.distributed.pipelining.pipeline` with a
`SplitPoint.BEGINNING` at the module whose call starts the chunk), on rank c % p (torch's
loop order, the project's group c % p); the schedule is `ScheduleGPipe`, `Schedule1F1B` or
`ScheduleInterleaved1F1B` (v chunks per rank) over m micro-batches. What it cannot express is
one `ExportError` line (see `_refusals`): a tensor that skips a stage, a stage on several
devices (data or tensor parallelism inside a stage), stages not on ranks 0..p-1 in order,
batch norm with m > 1, a chunk that does not start at a module's call, 1F1B with m < p; and,
once traced (`parallelize_pipeline`), a traced value computed from the inputs that skips a
stage (`_refuse_skips`). A Hugging Face model is traced as capture traces it
(`planner.graph.hf.traceable`).

Values computed without the inputs' values (from shapes, constants and buffers alone: a Hugging
Face decoder's rotary tables, from its `rotary_emb.inv_freq` buffer, its causal mask and
position ids, all computed once before block 0 and handed to every block) are not sent from
the stage that computes them: each stage that reads one computes it again (`_recompute`),
from the buffers it then holds too. So a decoder pipelines with any number of stages, where
sending them would pass them past a stage, which torch's pipelining cannot run.

`parallelize_pipeline(planned, module, example_inputs, loss_fn)` builds this rank's stages
and schedule in every rank of an initialized process group of p ranks; its
`PipelineExported.step(inputs, targets)` runs one step's forwards and backwards with the
runtime's semantics (runtime/pipeline.py): each micro-batch's loss is divided by m (torch's
schedule then leaves the gradients unscaled, `scale_grads=False`), so the parts add up to the
mean loss of the whole batch and the gradients accumulated over the m micro-batches are the
whole batch's. Parameters that several stages hold (a tied embedding and head) have their
gradients summed over the stages; the update is the caller's optimizer over
`PipelineExported.parameters()` (plain `torch.optim.SGD` is the runtime's update).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import ExportError
from planner.export.common import check_params
from planner.graph.hf import traceable
from planner.graph.opkinds import SAMPLE, is_batch_norm
from planner.pipeline.timeline import counted

if TYPE_CHECKING:
    import torch
    from torch import nn

    from planner.pipeline.spec import PipelinedStrategy

__all__ = [
    "PipelineExported",
    "PipelineExportPlan",
    "StagePlan",
    "parallelize_pipeline",
    "pipeline_plan",
]

TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
}


@dataclass(frozen=True)
class StagePlan:
    """Torch's stage `index` (the pipeline's chunk): its rank, the module whose call starts it
    (None for the first), its ops `first <= i < end` and the modules they run in."""

    index: int
    rank: int
    split_at: str | None
    first: int
    end: int
    modules: tuple[str, ...]


@dataclass(frozen=True)
class PipelineExportPlan:
    """What torch's pipelining runs of a pipelined strategy: p ranks, v stages each, the
    torch schedule class, m micro-batches."""

    ranks: int
    stages: tuple[StagePlan, ...]
    schedule: str
    micro_batches: int

    @property
    def split_spec(self) -> dict[str, str]:
        """The split points: module path -> "BEGINNING" (`SplitPoint.BEGINNING`)."""
        return {s.split_at: "BEGINNING" for s in self.stages if s.split_at is not None}

    def stages_of(self, rank: int) -> tuple[StagePlan, ...]:
        """The stages that run on `rank` (v of them with an interleaved schedule)."""
        return tuple(s for s in self.stages if s.rank == rank)

    def describe(self) -> list[str]:
        """One line per stage, then the schedule."""
        lines = [
            f"stage {s.index} on rank {s.rank}: ops {s.first}-{s.end - 1}, "
            f"{'from the input' if s.split_at is None else 'from ' + s.split_at} "
            f"({', '.join(s.modules) or 'no modules'})"
            for s in self.stages
        ]
        return [
            *lines,
            f"{self.schedule}, {counted(self.micro_batches, 'micro-batch', 'micro-batches')}",
        ]


def pipeline_plan(planned: PipelinedStrategy, module: nn.Module) -> PipelineExportPlan:
    """The stages and schedule of `planned` (for `module`, the module its graph was captured
    from) in torch's pipelining; one ExportError for what it cannot express."""
    from planner.pipeline.spec import PipelinedStrategy

    if not isinstance(planned, PipelinedStrategy):
        raise ExportError(
            f"pipeline_plan exports a PipelinedStrategy, got a {type(planned).__name__}: "
            "export a plain strategy with planner.parallelize"
        )
    graph, pipe = planned.strategy.graph, planned.pipeline
    if pipe.schedule not in TORCH_SCHEDULES:
        raise ExportError(
            f"torch's pipelining has no {pipe.schedule!r} schedule (the planner times it "
            f"only): export the plan with one of {', '.join(TORCH_SCHEDULES)}"
        )
    kinds = {name: type(m).__name__ for name, m in module.named_modules()}
    check_params(planned.strategy, module)
    _refusals(planned)
    stages = []
    for c in range(pipe.chunks):
        first, end = pipe.bounds[c], pipe.bounds[c + 1]
        split_at = None if c == 0 else _split_point(graph, first, kinds)
        mods = [_module_of_op(graph.ops[i].name, kinds) for i in range(first, end)]
        named = tuple(dict.fromkeys(m for m in mods if m))
        stages.append(StagePlan(c, c % pipe.stages, split_at, first, end, named))
    return PipelineExportPlan(
        pipe.stages, tuple(stages), TORCH_SCHEDULES[pipe.schedule], pipe.micro_batches
    )


def _refusals(planned: PipelinedStrategy) -> None:
    """One ExportError for the first thing torch's pipelining cannot run as planned."""
    graph, pipe = planned.strategy.graph, planned.pipeline
    p, m = pipe.stages, pipe.micro_batches
    split = [  # (stage, op) of the ops split other than by samples, on a group of several
        (pipe.chunk_of(i) % p, op.name)
        for i, (op, cfg) in enumerate(zip(graph.ops, planned.strategy.configs, strict=True))
        if cfg.reduce > 1
        or any(g > 1 and d != SAMPLE for d, g in zip(op.output.dims, cfg.degrees, strict=True))
    ]
    wide = [k for k, group in enumerate(pipe.groups) if len(group) > 1]
    if split or wide:
        k = split[0][0] if split else wide[0]
        what = (
            f"tensor or contraction splits inside it (op {split[0][1]!r})"
            if split
            else "data parallelism inside it"
        )
        raise ExportError(
            f"pipeline stage {k} runs on devices {list(pipe.groups[k])} with {what}: the export "
            "to torch's pipelining runs one rank per stage; plan one device per stage, or run "
            "the strategy with runtime.run_strategy"
        )
    order = tuple((k,) for k in range(p))
    if pipe.groups != order:
        raise ExportError(
            f"the pipeline's stages run on devices {[list(g) for g in pipe.groups]}: torch's "
            f"pipelining runs stage k on rank k, so number the devices 0-{p - 1} in stage order"
        )
    if pipe.schedule == "1f1b" and m < p:
        raise ExportError(
            f"torch's Schedule1F1B needs at least as many micro-batches as stages: {m} < {p}; "
            "use more micro-batches or the gpipe schedule"
        )
    if m > 1:
        for op in graph.ops:
            if is_batch_norm(op):
                raise ExportError(
                    f"op {op.name!r} normalizes with batch statistics, which over {m} "
                    "micro-batches would be each micro-batch's, not the batch's: pipelines with "
                    "batch norm export with 1 micro-batch only"
                )
    for e in graph.edges:
        a, b = pipe.chunk_of(e.src), pipe.chunk_of(e.dst)
        if b > a + 1:
            raise ExportError(
                f"the output of op {graph.ops[e.src].name!r} (chunk {a}) is read by op "
                f"{graph.ops[e.dst].name!r} (chunk {b}): torch's pipelining passes tensors only "
                "to the next stage; move the bounds so no tensor skips a stage"
            )


def _module_of_op(name: str, kinds: dict[str, str]) -> str:
    """The innermost module an op runs in: the longest prefix of its name that is a module."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        path = ".".join(parts[:k])
        if path in kinds:
            return path
    return ""


def _split_point(graph: Any, first: int, kinds: dict[str, str]) -> str:
    """The outermost module whose call starts with op `first` (its first op is `first`)."""
    names = [op.name for op in graph.ops]
    parts = names[first].split(".")
    for k in range(1, len(parts) + 1):
        path = ".".join(parts[:k])
        if path not in kinds or kinds[path] in ("ModuleList", "ModuleDict"):
            continue
        start = next(i for i, n in enumerate(names) if n == path or n.startswith(path + "."))
        if start == first:
            return path
    starts = sorted(
        {
            next(i for i, n in enumerate(names) if n == path or n.startswith(path + "."))
            for path in {_module_of_op(n, kinds) for n in names}
            if path and kinds[path] not in ("ModuleList", "ModuleDict")
        }
    )
    near = min(starts, key=lambda i: abs(i - first)) if starts else None
    hint = f" (the nearest is op {near}, {names[near]!r})" if near is not None else ""
    raise ExportError(
        f"a pipeline chunk starts at op {first} ({names[first]!r}), which does not begin a "
        f"module's call: torch's pipelining splits a model where a submodule is called; move "
        f"the bound to an op that starts a module{hint}"
    )


# -- running it (every rank of an initialized process group) -----------------------------------


@dataclass(frozen=True)
class _Tied:
    """One parameter of the module that several stages hold: (stage, name) of each holder."""

    shape: tuple[int, ...]
    dtype: Any
    holders: tuple[tuple[int, str], ...]


@dataclass
class PipelineExported:
    """This rank's stages of a pipelined strategy in torch's pipelining, and its schedule."""

    plan: PipelineExportPlan
    rank: int
    modules: dict[int, nn.Module]  # stage index -> its module (a traced GraphModule)
    schedule: Any
    tied: tuple[_Tied, ...] = ()

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, each once (for the optimizer)."""
        seen: dict[int, Any] = {}
        for mod in self.modules.values():
            for p in mod.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def step(self, inputs: Sequence[torch.Tensor], targets: torch.Tensor) -> float:
        """One step's forwards and backwards over the m micro-batches of the whole batch
        (`inputs` and `targets`, the same on every rank: the first stage reads the inputs,
        the last the targets); gradients accumulate in `.grad` (zero them between steps).
        Returns the mean loss of the whole batch on every rank."""
        import torch
        import torch.distributed as dist

        first = 0 in self.modules
        last = len(self.plan.stages) - 1 in self.modules
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if first else ()
        self.schedule.step(*args, target=targets if last else None, losses=losses)
        self._sum_tied()
        total = torch.zeros((), dtype=torch.float64)
        if last:
            total += sum(float(x.detach()) for x in losses)
        dist.broadcast(total, src=self.plan.stages[-1].rank)
        return float(total)

    def _sum_tied(self) -> None:
        """A parameter several stages hold gets the sum of their gradients on every holder:
        one all-reduce over all ranks per such parameter, zeros where it is not held (adding
        zeros is exact, so the sum is the holders' alone)."""
        import torch
        import torch.distributed as dist

        for tied in self.tied:
            held = [self.modules[s].get_parameter(n) for s, n in tied.holders if s in self.modules]
            distinct = list({id(p): p for p in held}.values())
            total = torch.zeros(tied.shape, dtype=tied.dtype)
            for p in distinct:
                if p.grad is not None:
                    total += p.grad
            dist.all_reduce(total)
            for p in distinct:
                p.grad = total.clone()


def parallelize_pipeline(
    planned: PipelinedStrategy,
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: str = "cpu",
) -> PipelineExported:
    """This rank's stages and schedule of `planned` for `module` (every rank calls it with
    the same module and parameters). example_inputs: the whole batch's inputs (their first
    micro-batch traces the model); loss_fn(output, target): the mean loss of a micro-batch,
    e.g. `F.cross_entropy` (it is divided by m here)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pp

    plan = pipeline_plan(planned, module)
    if not dist.is_available() or not dist.is_initialized():
        raise ExportError(
            "parallelize_pipeline needs an initialized process group: launch with torchrun, "
            "or call torch.distributed.init_process_group first"
        )
    if dist.get_world_size() != plan.ranks:
        raise ExportError(
            f"the pipeline has {counted(plan.ranks, 'stage')} (one rank each) but the "
            f"process group has {counted(dist.get_world_size(), 'rank')}"
        )
    m = plan.micro_batches
    batch = example_inputs[0].shape[0]
    if batch % m:
        raise ExportError(
            f"{counted(m, 'micro-batch', 'micro-batches')} do not divide the batch of "
            f"{counted(batch, 'sample')}"
        )
    micro = tuple(x.narrow(0, 0, x.shape[0] // m) for x in example_inputs)
    # a Hugging Face model is traced as capture traced it: forward(input_ids) -> logits, no
    # key/value cache, its own module and parameter names (planner.graph.hf)
    module = traceable(module)
    pipe, origins = _traced_stages(module, micro, tuple(plan.split_spec))
    if pipe.num_stages != len(plan.stages):
        raise ExportError(
            f"tracing cut the module into {counted(pipe.num_stages, 'stage')} where the "
            f"pipeline has {counted(len(plan.stages), 'chunk')}: a split module "
            f"({', '.join(plan.split_spec)}) is not "
            "called where the graph says"
        )
    _refuse_skips(pipe, [s.split_at for s in plan.stages], origins)
    rank = dist.get_rank()
    info, dev = pipe.info(), torch.device(device)
    mine = {s.index: pipe.get_stage_module(s.index) for s in plan.stages_of(rank)}
    stages: list[Any] = [pp.build_stage(mod, i, info, dev) for i, mod in mine.items()]

    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / m  # a part of the whole batch's mean

    if plan.schedule == "ScheduleInterleaved1F1B":
        schedule = pp.ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False)
    else:
        cls = getattr(pp, plan.schedule)
        schedule = cls(stages[0], m, loss_fn=loss, scale_grads=False)
    return PipelineExported(plan, rank, mine, schedule, _tied(module, pipe, len(plan.stages)))


def _traced_stages(
    module: nn.Module, micro: Sequence[torch.Tensor], split_at: Sequence[str]
) -> tuple[Any, dict[str, str]]:
    """torch's `Pipe` of `module` traced on the micro-batch inputs `micro` and cut before the
    call of each module in `split_at` (as `pipeline(module, micro, split_spec={path:
    SplitPoint.BEGINNING})` cuts it), each stage computing again the values it reads that are
    computed without the inputs (`_recompute`); and, for the values a stage reads from another
    (by their traced names), the module that computes each. The modules' forwards are theirs
    again when it returns."""
    from torch.distributed import pipelining as pp

    origins: dict[str, str] = {}

    def policy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        _recompute(gm)
        for node in gm.graph.nodes:
            stack = list((node.meta.get("nn_module_stack") or {}).values())
            origins[node.name] = stack[-1][0] if stack else ""
        return gm

    split = [module.get_submodule(path) for path in split_at]
    own = [sub.__dict__.get("forward") for sub in split]  # a forward set on the instance
    try:
        for sub in split:
            sub.forward = _split_before(sub.forward)
        pipe = pp.Pipe.from_tracing(module, tuple(micro), split_policy=policy)
    finally:
        for sub, forward in zip(split, own, strict=True):
            if forward is None:
                del sub.forward
            else:
                sub.forward = forward
    return pipe, origins


def _split_before(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` with a split point before it (torch's `SplitPoint.BEGINNING`)."""
    from torch.distributed import pipelining as pp

    def split_then_forward(*args: Any, **kwargs: Any) -> Any:
        pp.pipe_split()
        return forward(*args, **kwargs)

    return split_then_forward


def _recompute(gm: torch.fx.GraphModule) -> None:
    """Where a stage reads a value an earlier stage computes without the inputs' values
    (`_input_free`), it computes the value itself: the nodes that compute it are copied into
    the stage, after its split point, and read there; the buffers they read become the
    stage's too (torch's pipelining gives each stage the attributes its nodes read). The
    values are the same (deterministic ops on the same buffers); nothing is sent for them."""
    free = _input_free(gm)
    stage_of: dict[torch.fx.Node, int] = {}
    anchor: dict[int, torch.fx.Node] = {}  # stage -> its last node so far among the copies
    stage = 0
    for node in gm.graph.nodes:
        if _is_split_point(node):
            stage += 1
            anchor[stage] = node
        stage_of[node] = stage
    copies: dict[tuple[int, torch.fx.Node], torch.fx.Node] = {}

    def local(node: torch.fx.Node, k: int) -> torch.fx.Node:
        """`node`'s value in stage k: itself, or its copy there."""
        if node.op == "get_attr" or stage_of[node] == k:
            return node
        if (k, node) not in copies:
            for a in node.all_input_nodes:  # its inputs' copies first, in order
                local(a, k)
            with gm.graph.inserting_after(anchor[k]):
                copy = gm.graph.node_copy(node, lambda a: local(a, k))
            copies[k, node] = anchor[k] = copy
            stage_of[copy] = k
        return copies[k, node]

    for node in list(gm.graph.nodes):
        k = stage_of[node]
        for a in node.all_input_nodes:
            if a in free and a.op != "get_attr" and stage_of[a] < k:
                node.replace_input_with(a, local(a, k))
    gm.recompile()


def _input_free(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The traced nodes whose values do not depend on the inputs' values (nor on the
    parameters): buffers and constants (`get_attr` of a tensor that is not a parameter), and
    ops whose tensor arguments are all such nodes (arange, a rotary table, a causal mask),
    except random ones, and except tensors some op writes in place (`_written`: a copy of the
    nodes that compute a value would miss a write made elsewhere). capture's `_constants`
    (planner/graph/capture.py) decides it the same way, with parameters counted in."""
    import torch
    from torch import nn

    written = _written(gm)
    free: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node in written:
            continue
        if node.op == "get_attr":
            if not isinstance(_attribute(gm, str(node.target)), nn.Parameter):
                free.add(node)
        elif node.op == "call_function" and not _is_split_point(node):
            tags = getattr(node.target, "tags", ())
            if torch.Tag.nondeterministic_seeded not in tags and all(
                a in free for a in node.all_input_nodes
            ):
                free.add(node)
    return free


def _written(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The traced nodes whose tensors an op writes in place, through any view of them (torch's
    traced graphs keep in-place ops: `add_`, `fill_` of a `select`, a buffer's running
    statistics): the nodes are grouped by the tensors they share (an argument the op's schema
    aliases, a getitem of an op's outputs), and a group one of whose tensors is written is
    written."""
    import operator

    import torch

    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def root(n: torch.fx.Node) -> torch.fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    written: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        shared: list[tuple[Any, bool]] = []  # (argument, written) of the arguments node aliases
        if node.target is operator.getitem:
            shared = [(node.args[0], False)]
        elif (schema := getattr(node.target, "_schema", None)) is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None:
                    value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                    shared.append((value, arg.alias_info.is_write))
        for value, write in shared:
            nodes: list[torch.fx.Node] = []
            torch.fx.node.map_arg(value, nodes.append)
            for a in nodes:
                if root(a) is not root(node):
                    parent[root(a)] = root(node)
                if write:
                    written.append(a)
    roots = {root(n) for n in written}
    return {n for n in gm.graph.nodes if root(n) in roots}


def _attribute(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _is_split_point(node: torch.fx.Node) -> bool:
    import torch

    return node.op == "call_function" and node.target is torch.ops.pippy._pipe_split.default


def _refuse_skips(pipe: Any, split_at: Sequence[str | None], origins: dict[str, str]) -> None:
    """One ExportError if the traced stages pass a value past a stage, which torch's
    pipelining cannot run (its stages send to the next one only; a floating value read by two
    later stages fails at the first step with "Backward of skip connections not supported
    yet"). Values computed without the inputs are computed again where they are read
    (`_recompute`); what is left is computed from the inputs (or the parameters), and the op
    graph can be free of such an edge where the traced module is not."""
    stage_of: dict[Any, int] = {}  # traced node -> the stage that computes it
    stages = 0
    for node in pipe.split_gm.graph.nodes:
        if node.op == "call_function" and node.args and node.args[0] in stage_of:
            stage_of[node] = stage_of[node.args[0]]  # a getitem of a stage's outputs
        elif node.op == "call_module":
            inputs = [p for p in pipe.get_stage_module(stages).graph.nodes if p.op == "placeholder"]
            for arg, placeholder in zip(node.args, inputs, strict=False):
                source = stage_of.get(arg, stages)
                if source < stages - 1:
                    name = str(placeholder.target)
                    where = origins.get(name) or "the root module"
                    raise ExportError(
                        "torch's pipelining would pass a value computed from the inputs or "
                        f"parameters, or written in place ({name!r}, in {where}), from stage "
                        f"{source} to stage {stages} (from "
                        f"{split_at[stages]!r}) past the stages between, and its stages send "
                        "only to the next one: move the bounds or use fewer stages so each "
                        "stage reads only what the stage before it computes, or run the plan "
                        "with runtime.run_strategy"
                    )
            stage_of[node] = stages
            stages += 1


def _tied(module: nn.Module, pipe: Any, n: int) -> tuple[_Tied, ...]:
    """The parameters of `module` that several of the `n` stages hold, in the module's
    parameter order (the same on every rank)."""
    original: dict[str, Any] = dict(module.named_parameters(remove_duplicate=False))
    holders: dict[int, list[tuple[int, str]]] = {}
    for s in range(n):
        for name, _ in pipe.get_stage_module(s).named_parameters(remove_duplicate=False):
            if name in original:
                holders.setdefault(id(original[name]), []).append((s, name))
    out: dict[int, _Tied] = {}
    for p in original.values():
        found = holders.get(id(p), [])
        if len({s for s, _ in found}) > 1 and id(p) not in out:
            out[id(p)] = _Tied(tuple(p.shape), p.dtype, tuple(found))
    return tuple(out.values())
