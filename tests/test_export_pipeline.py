"""Export of pipelined strategies to torch's pipelining (planner.export.pipelining): the stages
and schedule it plans, what it refuses (no processes), and real runs on gloo workers trained
2 SGD steps in float64 beside single-process training of the whole batch."""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from budget import time_budget
from user_models import SmallCNN
from workers import run_workers

import planner
from planner.costs.config import ParallelConfig
from planner.errors import ExportError
from planner.export import export_plan, pipeline_plan
from planner.export.pipelining import _refuse_skips, _traced_stages
from planner.graph.capture import capture
from planner.graph.coarsen import coarsen
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import CHANNEL, SAMPLE
from planner.graph.zoo import build_model, model_graph
from planner.hardware.presets import get_preset
from planner.pipeline.spec import Pipeline, PipelinedStrategy, micro_batch_graph
from planner.problems.strategy import Strategy

GPT_SIZES: dict[str, Any] = {"seq": 16, "n_head": 2, "n_embd": 32, "vocab_size": 128,
                             "block_size": 16}  # fmt: skip
TWO, FOUR = ((0,), (1,)), ((0,), (1,), (2,), (3,))
LR, STEPS = 0.1, 2


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(120):
        yield


def model(spec: str, device: str = "meta") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """ "lenet5" (batch 8) or "gpt2-L" (L layers, batch 4), with example inputs."""
    if spec == "lenet5":
        return build_model("lenet5", device=device, batch=8)
    return build_model("gpt2", device=device, batch=4, **GPT_SIZES, n_layer=int(spec[5:]))


@functools.cache
def graph_of(spec: str) -> OpGraph:
    if spec == "lenet5":
        return model_graph("lenet5", batch=8)
    return model_graph("gpt2", batch=4, **GPT_SIZES, n_layer=int(spec[5:]))


def pipelined(
    graph: OpGraph,
    bounds: tuple[int, ...],
    groups: tuple[tuple[int, ...], ...],
    m: int,
    schedule: str,
    tensor: bool = False,
) -> PipelinedStrategy:
    """Every op split over its chunk's group by samples (with `tensor`, linears by channels),
    or whole on the group's first device where the group's size does not divide it."""
    micro = micro_batch_graph(graph, m)
    pipe = Pipeline(bounds, groups, m, schedule)
    configs = []
    for i, op in enumerate(micro.ops):
        group = pipe.group_of(pipe.chunk_of(i))
        dim = CHANNEL if tensor and op.kind == "linear" else SAMPLE
        n = len(group) if dim in op.output.dims and op.output.size(dim) % len(group) == 0 else 1
        degrees = tuple(n if d == dim else 1 for d in op.output.dims)
        configs.append(ParallelConfig(degrees, group[:n]))
    world = max(d for g in groups for d in g) + 1
    return PipelinedStrategy(
        Strategy(micro, get_preset(f"cpu-local-{world}"), tuple(configs)), pipe
    )


# (model, bounds, groups, micro-batches, schedule)
CASES: dict[str, tuple[str, tuple[int, ...], tuple[tuple[int, ...], ...], int, str]] = {
    "lenet5-2-gpipe-m2": ("lenet5", (0, 4, 9), TWO, 2, "gpipe"),
    "lenet5-2-1f1b-m4": ("lenet5", (0, 5, 9), TWO, 4, "1f1b"),
    # the tied embedding (stage 0) and head (stage 1): their gradients summed over the stages
    "gpt2-2-1f1b-m2": ("gpt2-2", (0, 15, 30), TWO, 2, "1f1b"),
    "gpt2-interleaved-2x2chunks-m2": ("gpt2-2", (0, 3, 15, 27, 30), TWO, 2, "interleaved"),
}
SLOW_CASES = {
    "lenet5-4-1f1b-m4": ("lenet5", (0, 2, 4, 6, 9), FOUR, 4, "1f1b"),
    "gpt2-4-1f1b-m4": ("gpt2-4", (0, 15, 27, 39, 54), FOUR, 4, "1f1b"),
    "gpt2-4-gpipe-m2": ("gpt2-4", (0, 15, 27, 39, 54), FOUR, 2, "gpipe"),
}


def case(name: str) -> PipelinedStrategy:
    spec, bounds, groups, m, schedule = {**CASES, **SLOW_CASES}[name]
    return pipelined(graph_of(spec), bounds, groups, m, schedule)


# -- the plan ---------------------------------------------------------------------------------


def test_the_plan_names_each_stages_modules_and_the_schedule() -> None:
    plan = pipeline_plan(case("lenet5-2-gpipe-m2"), model("lenet5")[0])
    assert plan.schedule == "ScheduleGPipe" and plan.micro_batches == 2 and plan.ranks == 2
    assert plan.split_spec == {"pool2": "BEGINNING"}
    assert [s.modules for s in plan.stages] == [
        ("conv1", "pool1", "conv2"),
        ("pool2", "fc1", "fc2", "fc3"),
    ]
    plan = pipeline_plan(case("gpt2-interleaved-2x2chunks-m2"), model("gpt2-2")[0])
    assert plan.schedule == "ScheduleInterleaved1F1B"
    assert [(s.index, s.rank, s.split_at) for s in plan.stages] == [
        (0, 0, None),
        (1, 1, "transformer.h.0"),
        (2, 0, "transformer.h.1"),
        (3, 1, "transformer.ln_f"),
    ]
    assert plan.stages[3].modules == ("transformer.ln_f", "lm_head")
    assert plan.describe()[-1] == "ScheduleInterleaved1F1B, 2 micro-batches"
    assert pipeline_plan(case("gpt2-4-1f1b-m4"), model("gpt2-4")[0]).schedule == "Schedule1F1B"


def refusal(planned: PipelinedStrategy, module: torch.nn.Module) -> str:
    with pytest.raises(ExportError) as info:
        pipeline_plan(planned, module)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_tensor_that_skips_a_stage_is_refused() -> None:
    # chunk 0 ends inside block 0: its residual (op 2) is read in chunk 2
    planned = pipelined(graph_of("gpt2-2"), (0, 3, 4, 15, 30), TWO, 2, "interleaved")
    message = refusal(planned, model("gpt2-2")[0])
    assert message == (
        "the output of op 'transformer.add' (chunk 0) is read by op 'transformer.h.0.add' "
        "(chunk 2): torch's pipelining passes tensors only to the next stage; move the bounds "
        "so no tensor skips a stage"
    )


def test_a_chunk_that_does_not_start_a_module_call_is_refused() -> None:
    planned = pipelined(graph_of("gpt2-2"), (0, 5, 30), TWO, 2, "gpipe")  # at a slice of q, k, v
    message = refusal(planned, model("gpt2-2")[0])
    assert "starts at op 5 ('transformer.h.0.attn.getitem'), which does not begin" in message
    assert "the nearest is op 4, 'transformer.h.0.attn.c_attn'" in message


@pytest.mark.parametrize(
    "tensor, says",
    [(False, "data parallelism inside it"), (True, "tensor or contraction splits inside it")],
)
def test_several_devices_per_stage_are_refused(tensor: bool, says: str) -> None:
    planned = pipelined(graph_of("lenet5"), (0, 4, 9), ((0, 1), (2, 3)), 2, "gpipe", tensor)
    message = refusal(planned, model("lenet5")[0])
    stage = "1 runs on devices [2, 3]" if tensor else "0 runs on devices [0, 1]"
    assert message.startswith(f"pipeline stage {stage} with {says}")
    assert "runtime.run_strategy" in message


def test_schedules_and_layouts_torch_cannot_run_are_refused() -> None:
    lenet = model("lenet5")[0]
    swapped = pipelined(graph_of("lenet5"), (0, 4, 9), ((1,), (0,)), 2, "gpipe")
    assert "torch's pipelining runs stage k on rank k" in refusal(swapped, lenet)
    few = pipelined(graph_of("lenet5"), (0, 2, 4, 6, 9), FOUR, 2, "1f1b")
    assert refusal(few, lenet).startswith(
        "torch's Schedule1F1B needs at least as many micro-batches as stages: 2 < 4"
    )
    net = SmallCNN()
    graph = coarsen(capture(net, (torch.randn(8, 3, 16, 16),), "cnn"))
    cnn = pipelined(graph, (0, 2, len(graph.ops)), TWO, 2, "gpipe")
    assert "normalizes with batch statistics" in refusal(cnn, net)


class Blocks(torch.nn.Module):
    """Three linear blocks that each scale by a table computed from a buffer before the first
    (as a decoder's rotary tables); with "skip" they also add the embedding (a residual from
    the inputs), with "written" the table's first row is written in place from the inputs."""

    def __init__(self, variant: str = "") -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.register_buffer("freq", torch.arange(8.0) / 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.variant = variant

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = first = self.embed(ids)
        table = torch.cos(torch.arange(ids.shape[1])[:, None] * self.freq)  # (length, 8)
        if self.variant == "written":
            table[0] = first[0, 0].detach()
        for block in self.blocks:
            h = block(h) * table + (first if self.variant == "skip" else 0)
        return h


IDS = torch.arange(8).reshape(2, 4)
BLOCKS = ("blocks.1", "blocks.2")


def test_values_computed_without_the_inputs_are_computed_again_in_each_stage() -> None:
    net = Blocks()
    pipe, origins = _traced_stages(net, (IDS,), BLOCKS)
    for k in range(3):
        stage = pipe.get_stage_module(k)
        assert [name for name, _ in stage.named_buffers()] == ["freq"]
        inputs = [n for n in stage.graph.nodes if n.op == "placeholder"]
        assert len(inputs) == 1, (k, inputs)  # the ids, then the hidden state alone
    _refuse_skips(pipe, (None, *BLOCKS), origins)
    assert torch.equal(pipe(IDS)[0], net(IDS))
    assert "forward" not in net.blocks[1].__dict__  # the module's own forward again


@pytest.mark.parametrize(
    "variant, value", [("skip", "'embedding', in embed"), ("written", "'cos', in the root module")]
)
def test_a_traced_value_from_the_inputs_that_skips_a_stage_is_refused(
    variant: str, value: str
) -> None:
    """The embedding read by every block; the table written in place from the inputs (a copy
    of the ops that compute it would miss the write): sent, so they would skip stage 1."""
    net = Blocks(variant)
    pipe, origins = _traced_stages(net, (IDS,), BLOCKS)
    assert torch.equal(pipe(IDS)[0], net(IDS))  # in one process, where values can skip
    with pytest.raises(ExportError) as info:
        _refuse_skips(pipe, (None, *BLOCKS), origins)
    assert str(info.value).startswith(
        "torch's pipelining would pass a value computed from the inputs or parameters, or "
        f"written in place ({value}), from stage 0 to stage 2 (from 'blocks.2') past the stages"
    )
    assert "\n" not in str(info.value)


def test_the_dtensor_export_points_a_pipelined_strategy_here() -> None:
    with pytest.raises(ExportError, match="parallelize_pipeline") as info:
        export_plan(case("lenet5-2-gpipe-m2"), model("lenet5")[0])  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    with pytest.raises(ExportError, match="does not come from this module"):
        pipeline_plan(case("lenet5-2-gpipe-m2"), SmallCNN())
    with pytest.raises(ExportError, match="initialized process group"):
        planner.parallelize_pipeline(case("lenet5-2-gpipe-m2"), *model("lenet5"), F.nll_loss)


# -- on gloo: the same numbers as single-process training ------------------------------------


def loss_of(spec: str) -> Any:
    if spec == "lenet5":  # LeNet-5 ends in a softmax
        return lambda out, y: F.nll_loss(torch.log(out), y)
    return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())


def _worker(rank: int, world: int, tmp: str, cases: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        for name, (spec, data) in cases.items():
            torch.manual_seed(0)
            net, example = model(spec, "cpu")
            net = net.double()
            ref = copy.deepcopy(net)
            g = torch.Generator().manual_seed(1)
            if spec == "lenet5":
                x = torch.randn(*example[0].shape, generator=g, dtype=torch.float64)
                y = torch.randint(0, 10, (x.shape[0],), generator=g)
            else:
                x = torch.randint(0, 128, tuple(example[0].shape), generator=g)
                y = torch.randint(0, 128, tuple(example[0].shape), generator=g)
            planned = PipelinedStrategy.from_json(data)
            exported = planner.parallelize_pipeline(planned, net, (x,), loss_of(spec))
            optimizer = torch.optim.SGD(exported.parameters(), lr=LR)
            losses, ref_losses = [], []
            for _ in range(STEPS):
                losses.append(exported.step((x,), y))
                optimizer.step()
                optimizer.zero_grad()
                loss = loss_of(spec)(ref(x), y)
                loss.backward()
                with torch.no_grad():
                    for p in ref.parameters():
                        p.add_(p.grad, alpha=-LR)
                        p.grad = None
                ref_losses.append(float(loss.detach()))
            worst = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
            checked = 0
            for mod in exported.modules.values():
                for key, p in mod.named_parameters(remove_duplicate=False):
                    diff = (p.detach() - ref.get_parameter(key).detach()).abs().max()
                    worst, checked = max(worst, float(diff)), checked + 1
            report[name] = {"deviation": worst, "params": checked, "loss": losses[-1]}
    Path(tmp, f"report-{rank}.json").write_text(json.dumps(report))


def run_cases(names: list[str], world: int, tmp: Path) -> dict[str, float]:
    cases = {}
    for name in names:
        spec = {**CASES, **SLOW_CASES}[name][0]
        cases[name] = (spec, case(name).to_json())
    assert run_workers(_worker, world, world, str(tmp), cases, timeout=100) == [0] * world
    reports = [json.loads((tmp / f"report-{r}.json").read_text()) for r in range(world)]
    out = {}
    for name in names:
        assert all(r[name]["params"] > 0 for r in reports), name  # every rank holds a stage
        out[name] = max(r[name]["deviation"] for r in reports)
        print(f"{name}: max deviation {out[name]:.2e}")
        assert out[name] <= 1e-9, (name, out[name])
    return out


def test_pipelines_in_torch_train_like_single_process_at_world_2(tmp_path: Path) -> None:
    run_cases(list(CASES), 2, tmp_path)


@pytest.mark.slow
def test_pipelines_in_torch_train_like_single_process_at_world_4(tmp_path: Path) -> None:
    run_cases(list(SLOW_CASES), 4, tmp_path)
