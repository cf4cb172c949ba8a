"""What a launcher can run of a plan: the uniform layout nearest to it, and its simulated cost.

Launchers (torchtitan, Megatron-LM, an FSDP2/TP script) take a layout as a few degrees:
p pipeline stages, each on n/p consecutive ranks, and inside every stage tensor t, context c
and data d = n / (p t c) in Megatron-LM's rank order (tensor innermost, then context, then
data), expert parallelism e over the mixtures of experts, v chunks per stage, m
micro-batches, a schedule, recomputation, ZeRO and a precision (`Uniform`). A plan lays out
every op on its own (per-op search, or the per-op search inside pipeline stages), so
`read_plan(plan)` looks for the uniform layout nearest to it: each candidate degree the plan's
ops use, laid out by Megatron-LM's rule (`planner.problems.baselines.megatron`) in every
stage, and the one that lays out the most of the plan's FLOPs alike (input ops aside) is
`LaunchPlan.uniform`; `differ` names the ops it lays out otherwise. Ties go to the degrees a
pipelined plan's `layout` section names, then to the smaller degrees.

`LaunchPlan.simulate(uniform)` times a uniform layout as the planner times plans: the rule's
strategy (pipelined when p > 1: `planner.pipeline.stages.simulate_pipelined`; else FlexFlow's
simulator) under the plan's cost options with the layout's ZeRO stage and recomputation, on
the plan's graph in the layout's precision; `LaunchPlan.planned_seconds` times the plan the
same way, so the two stand side by side.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from planner.costs.config import ParallelConfig
from planner.costs.recompute import block_of
from planner.errors import ExportError, LayerwiseError
from planner.export.launchers.architecture import Architecture, read_architecture
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import CHANNEL, LENGTH, SAMPLE
from planner.hardware.devices import DeviceGraph
from planner.pipeline.spec import Pipeline, PipelinedStrategy, batch_graph, micro_batch_graph
from planner.problems.strategy import Strategy, strategy_from_json

__all__ = ["LaunchPlan", "ModelFacts", "Uniform", "graph_precision", "read_plan"]

MAX_TIES = 8  # uniform layouts simulated to break a tie


@dataclass(frozen=True)
class Uniform:
    """A layout a launcher takes: degrees, micro-batches, schedule, recomputation ("none",
    "selective", "full" or the first k blocks), ZeRO stage, precision (Lightning's names,
    None: the model's dtypes), the numbered blocks of each chunk (chunk order) and whether
    16-bit weights keep an fp32 master copy (None: as the plan's cost options say)."""

    stages: int = 1
    tensor: int = 1
    context: int = 1
    data: int = 1
    expert: int = 1
    virtual: int = 1
    micro_batches: int = 1
    schedule: str = "1f1b"
    recompute: str | int = "none"
    zero: int = 0
    precision: str | None = None
    blocks: tuple[int, ...] = ()
    master_weights: bool | None = None  # an fp32 copy of 16-bit weights (None: the plan's)

    @property
    def world(self) -> int:
        """The ranks the layout takes: p x t x c x d."""
        return self.stages * self.tensor * self.context * self.data

    def degrees(self) -> str:
        """'PP 2 x TP 2 x DP 2' (CP and EP where above 1)."""
        parts = [f"PP {self.stages}"] if self.stages > 1 else []
        parts.append(f"TP {self.tensor}")
        if self.context > 1:
            parts.append(f"CP {self.context}")
        parts.append(f"DP {self.data}")
        ep = f", EP {self.expert}" if self.expert > 1 else ""
        return " x ".join(parts) + ep

    def describe(self) -> str:
        """One line: degrees, micro-batches and schedule, recomputation, ZeRO, precision."""
        out = self.degrees()
        if self.stages > 1:
            sched = self.schedule if self.virtual == 1 else f"{self.schedule} v={self.virtual}"
            out += f", {self.micro_batches} micro-batches, {sched}"
        out += f", recompute {self.recompute}, ZeRO {self.zero}"
        return out + (f", {self.precision}" if self.precision else "")


@dataclass(frozen=True)
class ModelFacts:
    """What a launcher's model arguments need, read from the plan's graph: the global batch,
    the sequence, the numbered blocks (names in order), and from the first block's attention
    and mixture of experts their widths and counts (None where the graph has none)."""

    name: str
    global_batch: int
    seq: int | None
    blocks: tuple[str, ...]
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    experts: int | None = None
    spec: Mapping[str, Any] | None = None  # the plan file's graph.model: how to rebuild it

    @property
    def layers(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class LaunchPlan:
    """A plan read for the launchers: its strategy (one micro-batch's when pipelined), its
    pipeline, cost options, model facts, and the uniform layout nearest to it (`uniform`;
    `alike`: the share of the plan's FLOPs that layout lays out the same; `differ`: the ops
    it lays out otherwise, `stage_groups`: whether the plan's stages run on n/p consecutive
    ranks each)."""

    name: str
    strategy: Strategy
    pipeline: Pipeline | None
    cost: Mapping[str, Any]
    model: ModelFacts
    uniform: Uniform
    alike: float
    differ: tuple[str, ...]
    stage_groups: bool
    precision: str | None
    ties: int = 1  # uniform layouts as alike, of which `uniform` simulates fastest
    _cache: dict[Uniform, float] = field(default_factory=dict, repr=False, compare=False)

    @property
    def devices(self) -> DeviceGraph:
        return self.strategy.devices

    @cached_property
    def full_graph(self) -> OpGraph:
        """The whole batch's graph (the plan's graph is one micro-batch's when pipelined)."""
        graph = self.strategy.graph
        if self.pipeline is None or self.pipeline.micro_batches == 1:
            return graph
        return batch_graph(graph, self.model.global_batch)

    @cached_property
    def architecture(self) -> Architecture:
        """The model's design as its graph says it (`read_architecture`)."""
        return read_architecture(self.strategy.graph)

    @cached_property
    def planned_seconds(self) -> float:
        """The plan's step, simulated with its own cost options."""
        cm = self._cost_model(self.strategy.graph, self.uniform_options())
        return _simulate(cm, self.strategy, self.pipeline)

    def uniform_options(self, uniform: Uniform | None = None) -> dict[str, Any]:
        """The plan's cost options, with `uniform`'s ZeRO stage and recomputation."""
        options = {k: v for k, v in self.cost.items() if k != "source"}
        if uniform is not None:
            options.update(zero=uniform.zero, recompute=uniform.recompute)
            if uniform.master_weights is not None:
                options["master_weights"] = uniform.master_weights
        return options

    def simulate(self, uniform: Uniform) -> float:
        """`uniform`'s step, simulated as the plan is (ExportError when its rule cannot lay
        out the model: sizes the degrees do not divide)."""
        if uniform not in self._cache:
            graph = self.full_graph
            if uniform.precision != self.precision and uniform.precision is not None:
                from planner.graph.precision import with_precision

                graph = with_precision(graph, uniform.precision)
            strategy, pipe = self.rule(uniform, graph)
            cm = self._cost_model(strategy.graph, self.uniform_options(uniform))
            self._cache[uniform] = _simulate(cm, strategy, pipe)
        return self._cache[uniform]

    def rule(
        self, uniform: Uniform, graph: OpGraph | None = None
    ) -> tuple[Strategy, Pipeline | None]:
        """`uniform` laid out by Megatron-LM's rule on the whole-batch `graph` (default the
        plan's): a strategy, pipelined on p equal groups of consecutive devices when p > 1."""
        graph = graph or self.full_graph
        p, devices = uniform.stages, self.devices
        if devices.num_devices != uniform.world:
            raise ExportError(
                f"the layout {uniform.degrees()} takes {uniform.world} ranks, the plan's "
                f"devices are {devices.num_devices}"
            )
        if p == 1:
            return _megatron(graph, devices, uniform), None
        micro = micro_batch_graph(graph, uniform.micro_batches)
        size = devices.num_devices // p
        groups = tuple(tuple(range(s * size, (s + 1) * size)) for s in range(p))
        pipe = Pipeline(
            self._bounds(micro, uniform), groups, uniform.micro_batches, uniform.schedule
        )
        inner = _megatron(micro, devices.subset(range(size)), uniform)
        configs = tuple(
            dataclasses.replace(
                cfg, devices=tuple(groups[pipe.chunk_of(i) % p][d] for d in cfg.devices)
            )
            for i, cfg in enumerate(inner.configs)
        )
        return Strategy(micro, devices, configs), pipe

    def _bounds(self, micro: OpGraph, uniform: Uniform) -> tuple[int, ...]:
        """The plan's own chunk bounds when the chunks are the same, else cuts at block
        starts with `uniform.blocks` per chunk."""
        pipe = self.pipeline
        if (
            pipe is not None
            and pipe.chunks == len(uniform.blocks)
            and (self.uniform.blocks == uniform.blocks)
        ):
            return pipe.bounds
        starts = [*block_starts(micro), blocks_end(micro)]
        cuts, at = [0], 0
        for k in uniform.blocks[:-1]:
            at += k
            cuts.append(starts[min(at, len(starts) - 1)])
        return (*cuts, len(micro.ops))

    def _cost_model(self, graph: OpGraph, options: Mapping[str, Any]) -> Any:
        return cost_model(graph, self.devices, str(self.cost.get("source", "analytic")), options)


def read_plan(plan: Any, simulate: bool = True) -> LaunchPlan:
    """A plan (a plan file's path, its parsed JSON, or a `planner.Plan` with a strategy) read
    for the launchers: one LayerwiseError line for anything that is not a plan of a model.
    When uniform layouts tie in how much of the plan they lay out alike, `simulate` picks
    the fastest of them (else the first: the degrees the plan's layout section names, then
    the smaller)."""
    data, name = _plan_data(plan)
    strategy = strategy_from_json(data)
    pipe = Pipeline.from_json(data["pipeline"]) if "pipeline" in data else None
    if pipe is not None:
        PipelinedStrategy(strategy, pipe)  # checks the pipeline against the strategy
    cost = _cost_section(data.get("cost", {}))
    spec = (data.get("graph") or {}).get("model")
    spec = spec if isinstance(spec, Mapping) else None
    model = model_facts(strategy.graph, pipe, spec)
    precision = (spec.get("precision") if spec else None) or graph_precision(strategy.graph, spec)
    layout = data.get("layout")
    layout = layout if isinstance(layout, Mapping) else {}
    ties, alike, differ, even = nearest_uniform(strategy, pipe, cost, precision, model, layout)
    lp = LaunchPlan(name, strategy, pipe, cost, model, ties[0], alike, differ, even, precision)
    if simulate and len(ties) > 1:  # as alike: the fastest
        times = {u: lp.simulate(u) for u in ties[:MAX_TIES] if _simulates(lp, u)}
        if times:
            lp = dataclasses.replace(lp, uniform=min(times, key=times.__getitem__), ties=len(ties))
    return lp


def graph_precision(graph: OpGraph, spec: Mapping[str, Any] | None = None) -> str | None:
    """The precision of a plan that names none (its model built in another dtype: `--set
    dtype=bfloat16`), read from its graph's parameters: 2-byte floats are "bf16-true"
    ("16-true" when the model spec's dtype is float16: the bytes cannot tell the two apart),
    8-byte ones "64-true"; None for float32 (the model's dtypes). Whether 16-bit weights keep
    fp32 master copies is the plan's cost option `master_weights`, which the launchers read
    beside it."""
    sizes = {p.dtype_bytes for op in graph.ops for p in op.params}
    if sizes == {2}:
        kwargs = (spec or {}).get("kwargs")
        dtype = str(kwargs.get("dtype", "")) if isinstance(kwargs, Mapping) else ""
        return "16-true" if dtype in ("float16", "half") else "bf16-true"
    return "64-true" if sizes == {8} else None


def _simulates(lp: LaunchPlan, uniform: Uniform) -> bool:
    try:
        lp.simulate(uniform)
    except LayerwiseError:
        return False
    return True


def _plan_data(plan: Any) -> tuple[Mapping[str, Any], str]:
    """The plan file's JSON and a name for messages."""
    from planner.files import read_json_checked

    if isinstance(plan, str | Path):
        data = read_json_checked(plan, "plan")
        name = str(plan)
    elif isinstance(plan, Mapping):
        data, name = plan, "the plan"
    elif callable(getattr(plan, "to_json", None)) and hasattr(plan, "strategy"):
        if plan.strategy is None:
            raise ExportError(
                "the plan has no strategy (a cost-table problem, or no answer): a launcher "
                "needs a model's plan"
            )
        data, name = plan.to_json(), "the plan"
    else:
        raise ExportError(
            f"expected a plan file, its JSON or a planner.Plan, got a {type(plan).__name__}"
        )
    if not isinstance(data, Mapping) or data.get("format") != "layerwise.strategy":
        if isinstance(data, Mapping) and "choices" in data and "graph" not in data:
            raise ExportError(
                f"{name} is a cost-table plan: it has no model for a launcher (plan a model "
                "with `planner plan MODEL --devices D -o PLAN`)"
            )
        raise ExportError(
            f'{name} is not a layerwise plan (no "format": "layerwise.strategy"): write one '
            "with `planner plan MODEL --devices D -o PLAN`"
        )
    return data, name


def _cost_section(cost: Any) -> dict[str, Any]:
    if not isinstance(cost, Mapping):
        raise ExportError(f'the plan\'s "cost" must be an object, got {cost!r}')
    cost = dict(cost)
    if cost and "rates" not in cost:  # planned before kernel rates by shape: as it was priced
        cost["rates"] = "flat"
    return cost


def cost_model(
    graph: OpGraph, devices: DeviceGraph, source: str, options: Mapping[str, Any]
) -> Any:
    """The plan's cost model of `graph` (analytic or measured) with `options`."""
    from planner.costs.costmodel import CostModel, CostOptions

    names = {f.name for f in dataclasses.fields(CostOptions)}
    opts = CostOptions(**{k: v for k, v in options.items() if k in names and v is not None})
    measured = None
    if source == "measured":
        from planner.costs.profile import MeasuredTimes

        measured = MeasuredTimes.load(devices, graph=graph)
    return CostModel(graph, devices, opts, measured=measured)


def _simulate(cm: Any, strategy: Strategy, pipe: Pipeline | None) -> float:
    if pipe is None:
        from planner.sim.simulator import simulate

        return float(simulate(cm, strategy).makespan)
    from planner.pipeline.stages import simulate_pipelined

    return float(simulate_pipelined(cm, PipelinedStrategy(strategy, pipe)).makespan)


# -- the model's facts --------------------------------------------------------------------


def block_starts(graph: OpGraph) -> list[int]:
    """The first op of each numbered block (`transformer.h.3`, `layers.3`), in graph order."""
    starts, last = [], None
    for i, op in enumerate(graph.ops):
        found = block_of(op.name)
        if found is not None and found[0] != last:
            starts.append(i)
        if found is not None:
            last = found[0]
    return starts


def blocks_end(graph: OpGraph) -> int:
    """The first op after the last numbered block (the final norm, the head)."""
    inside = [i for i, op in enumerate(graph.ops) if block_of(op.name) is not None]
    return inside[-1] + 1 if inside else 0


def model_facts(
    graph: OpGraph, pipe: Pipeline | None, spec: Mapping[str, Any] | None = None
) -> ModelFacts:
    """The facts of `graph` (one micro-batch's when `pipe` has several)."""
    samples = [op.output.size(SAMPLE) for op in graph.ops if SAMPLE in op.output.dims]
    batch = max(samples, default=1) * (pipe.micro_batches if pipe else 1)
    seqs = [op.output.size(LENGTH) for op in graph.ops if LENGTH in op.output.dims]
    blocks = tuple(dict.fromkeys(b[0] for op in graph.ops if (b := block_of(op.name))))
    first = blocks[0] if blocks else None
    inside = [op for op in graph.ops if first and (b := block_of(op.name)) and b[0] == first]
    attention = next((op for op in inside if op.kind == "attention"), None)
    moe = next((op for op in graph.ops if op.kind == "moe"), None)
    heads = kv = experts = None
    # the model's width: a block's norm's (attention's output is heads x head dim, which
    # MLA and Qwen3 make other than the width)
    hidden = next(
        (o.output.size(CHANNEL) for o in inside if o.kind == "norm" and CHANNEL in o.output.dims),
        None,
    )
    if attention is not None:
        heads = int(attention.attr("heads", 0)) or None
        kv = int(attention.attr("kv_heads", 0)) or heads
    if moe is not None:
        experts = int(moe.attr("experts", 0)) or None
    return ModelFacts(
        graph.name, batch, max(seqs, default=0) or None, blocks, hidden, heads, kv, experts, spec,
    )  # fmt: skip


def chunk_blocks(graph: OpGraph, pipe: Pipeline | None) -> tuple[int, ...]:
    """The numbered blocks that start in each chunk (one chunk without a pipeline)."""
    starts = block_starts(graph)
    if pipe is None:
        return (len(starts),) if starts else ()
    return tuple(
        sum(1 for s in starts if pipe.bounds[c] <= s < pipe.bounds[c + 1])
        for c in range(pipe.chunks)
    )


# -- the nearest uniform layout -----------------------------------------------------------


def nearest_uniform(
    strategy: Strategy,
    pipe: Pipeline | None,
    cost: Mapping[str, Any],
    precision: str | None,
    model: ModelFacts,
    declared: Mapping[str, Any],
) -> tuple[list[Uniform], float, tuple[str, ...], bool]:
    """The uniform layouts whose rule lays out the most of the plan's FLOPs as the plan does
    (several when they tie: the degrees a pipelined plan's layout section names first, then
    the smaller), the share of FLOPs alike, the ops laid out otherwise, and whether the
    stages are n/p consecutive ranks each."""
    graph, devices = strategy.graph, strategy.devices
    n, p = devices.num_devices, pipe.stages if pipe else 1
    size = n // p if n % p == 0 else 0
    even = (
        size > 0
        and pipe is not None
        and all(g == tuple(range(s * size, (s + 1) * size)) for s, g in enumerate(pipe.groups))
    )
    if pipe is None:
        even, size = True, n
    if size == 0:
        p, size = 1, n  # the stages cannot split the devices evenly: no pipeline
    base = Uniform(
        stages=p,
        virtual=pipe.virtual if pipe and p > 1 else 1,
        micro_batches=pipe.micro_batches if pipe and p > 1 else 1,
        schedule=pipe.schedule if pipe and p > 1 else "1f1b",
        recompute=_recompute(cost.get("recompute", "none")),
        zero=int(cost.get("zero", 0) or 0),
        precision=precision,
        blocks=chunk_blocks(graph, pipe if p > 1 else None),
    )
    want = tuple(int(declared.get(k) or 1) for k in ("tensor", "context", "expert"))
    scored = []
    for t, c, e in _candidates(strategy, size, want):
        uniform = dataclasses.replace(base, tensor=t, context=c, data=size // (t * c), expert=e)
        try:
            ref = _reference(strategy, pipe, uniform, size, p)
        except LayerwiseError:
            continue
        alike, differ = _agreement(strategy, ref)
        key = (round(alike, 12), -len(differ))
        scored.append((key, (t, c, e) != want, t, c, e, uniform, alike, differ))
    if not scored:
        raise ExportError(
            f"no uniform layout of {graph.name!r} on {n} devices: Megatron-LM's rule needs "
            "batch and sizes that the data, tensor and context degrees divide"
        )
    top = max(s[0] for s in scored)
    ties = sorted((s for s in scored if s[0] == top), key=lambda s: s[1:5])
    _, *_, alike, differ = ties[0]
    return [s[5] for s in ties], alike, differ, even


def _recompute(mode: Any) -> str | int:
    return mode if isinstance(mode, int) and not isinstance(mode, bool) else str(mode or "none")


def _candidates(
    strategy: Strategy, size: int, declared: tuple[int, ...]
) -> list[tuple[int, int, int]]:
    """(tensor, context, expert) degrees the plan's ops use (or its layout section names)
    that fit a stage of `size`."""
    tensor, context, expert = {1, declared[0]}, {1, declared[1]}, {1, declared[2]}
    for op, cfg in zip(strategy.graph.ops, strategy.configs, strict=True):
        if op.kind in ("linear", "embedding", "attention"):
            tensor.add(cfg.reduce if cfg.reduce > 1 else cfg.degree(op, CHANNEL))
        if op.kind == "attention" and LENGTH in op.output.dims:
            context.add(cfg.degree(op, LENGTH))
        if op.kind == "moe":
            expert.add(cfg.expert)
    return [
        (t, c, e)
        for t in sorted(tensor)
        for c in sorted(context)
        for e in sorted(expert)
        if size % (t * c) == 0 and e <= size
    ]


def _megatron(graph: OpGraph, devices: DeviceGraph, uniform: Uniform) -> Strategy:
    from planner.problems.baselines import megatron

    try:
        return megatron(graph, devices, uniform.tensor, uniform.context, uniform.expert)
    except LayerwiseError as exc:
        raise ExportError(f"{uniform.degrees()} does not lay out {graph.name!r}: {exc}") from None


def _reference(
    strategy: Strategy, pipe: Pipeline | None, uniform: Uniform, size: int, p: int
) -> tuple[ParallelConfig, ...]:
    """The rule's configs of the plan's own graph: on every device, or per chunk on the
    launcher's stage of it (n/p consecutive ranks, whatever groups the plan chose)."""
    graph, devices = strategy.graph, strategy.devices
    if pipe is None or p == 1:
        return _megatron(graph, devices, uniform).configs
    inner = _megatron(graph, devices.subset(range(size)), uniform)
    return tuple(
        dataclasses.replace(
            cfg, devices=tuple(pipe.chunk_of(i) % p * size + d for d in cfg.devices)
        )
        for i, cfg in enumerate(inner.configs)
    )


def _agreement(
    strategy: Strategy, reference: Sequence[ParallelConfig]
) -> tuple[float, tuple[str, ...]]:
    """The share of FLOPs (input ops aside) whose config is the reference's, and the names of
    the ops whose is not."""
    total = alike = 0.0
    differ = []
    for op, cfg, ref in zip(strategy.graph.ops, strategy.configs, reference, strict=True):
        if op.kind == "input":
            continue
        weight = max(op.flops, 0.0)
        total += weight
        if cfg == ref:
            alike += weight
        else:
            differ.append(op.name)
    return (alike / total if total > 0 else float(not differ)), tuple(differ)


def share(x: float) -> str:
    """A share as a percentage, never rounded to 100% or 0% unless exact."""
    pct = 100 * x
    if 0 < pct < 0.1:
        return "<0.1%"
    if 99.9 < pct < 100:
        return ">99.9%"
    return f"{pct:.1f}%" if not math.isclose(pct, round(pct)) else f"{round(pct)}%"
