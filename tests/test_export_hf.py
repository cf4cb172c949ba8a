"""`planner.parallelize` and `planner.parallelize_pipeline` on Hugging Face models as they are
(`tests/hf_models.py`): tensor-parallel styles on their named linears (q/k/v_proj and
gate/up_proj column-parallel, o_proj and down_proj row-parallel, attention by heads), FSDP2
over data, torch's pipelining with decoder blocks as stages; trained 2 SGD steps in float64
on gloo beside single-process training of the same model.

The families' RMSNorms compute in float32 whatever the model's dtype (`hidden_states.to(
torch.float32)`): a sum the layout adds in another order (a row-parallel linear's partial
sums, a data-parallel gradient) differs from one process's in its last float64 bit, which
now and then flips a float32 rounding in a norm: up to 1.3e-8 after 2 steps here. So each
layout also runs with every RMSNorm computing in float64 (`norms64`,
`hf_models.norms_in_model_dtype`): what the export computes then agrees with one process to
float64 rounding (1e-15), the check that would see a wrong layout."""

from __future__ import annotations

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
from test_export_llm import heads_split, megatron, two_by_two
from test_export_pipeline import pipelined
from workers import run_workers

import planner
from planner.export import export_plan, pipeline_plan
from planner.export.pipelining import _refuse_skips, _traced_stages
from planner.graph.hf import traceable
from planner.hardware.presets import get_preset
from planner.pipeline.spec import PipelinedStrategy
from planner.problems.baselines import data_parallel
from planner.problems.strategy import Strategy, strategy_from_json

pytest.importorskip("transformers")
from hf_models import hf  # noqa: E402

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
LR, STEPS = 0.1, 2
STRICT, AS_IS = 1e-12, 1e-7  # with norms in float64; the models as they are (module docstring)
ROW_PARALLEL = ("o_proj", "down_proj")  # the families' output projections


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(400):
        yield


@functools.cache
def graph_of(family: str, tied: bool = False, layers: int = 2) -> Any:
    result = planner.plan(hf(family, tied, layers), "cpu-local-2", example_inputs=(TOKENS,),
                          backend="baselines")  # fmt: skip
    return result.problem.dnn().graph


def layouts(family: str, world: int = 2, tied: bool = False) -> dict[str, tuple[Strategy, Any]]:
    """Data parallelism, heads (q/k/v column-parallel, attention by heads), Megatron-LM's
    pairing (column- then row-parallel, embeddings and norms data parallel); at world 4 the
    heads and Megatron's pairing on a (2, 2) mesh, data x tensor."""
    dp = data_parallel(graph_of(family, tied), get_preset(f"cpu-local-{world}"))
    if world == 4:
        return {"2x2": (two_by_two(dp), (2, 2)), "megatron-2x2": (_megatron(dp, 2), (2, 2))}
    return {"data": (dp, None), "heads": (heads_split(dp), None), "megatron": (_megatron(dp), None)}


def _megatron(dp: Strategy, data: int = 1) -> Strategy:
    return megatron(dp, data, row_parallel=ROW_PARALLEL)


def test_megatron_layout_lands_on_the_named_linears() -> None:
    strategy, _ = layouts("llama")["megatron"]
    plan = export_plan(strategy, hf("llama"))
    modules = dict(plan.modules)
    for layer in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                  "mlp.up_proj"):  # fmt: skip
        assert modules[f"model.layers.1.{layer}"] == "colwise"
    for layer in ("self_attn.o_proj", "mlp.down_proj"):
        assert modules[f"model.layers.1.{layer}"] == "rowwise"
    assert {o.style for o in plan.ops if o.kind == "attention"} == {"heads"}
    assert modules["model.embed_tokens"] == modules["lm_head"] == "data" and not plan.fell_back


def test_fused_projections_attend_by_heads() -> None:
    """Phi-3's qkv_proj cut by columns holds q on rank 0, k and v on rank 1: the slices that
    take them apart gather them (DTensor), and each rank's attention takes its own heads."""
    strategy, _ = layouts("phi3")["heads"]
    plan = export_plan(strategy, hf("phi3"))
    assert dict(plan.modules)["model.layers.0.self_attn.qkv_proj"] == "colwise"
    assert plan.by_heads == ("model.layers.0.self_attn", "model.layers.1.self_attn")


def test_a_tied_head_takes_its_embeddings_style() -> None:
    module = hf("llama", tied=True)
    strategy, _ = layouts("llama", tied=True)["megatron"]
    modules = dict(export_plan(strategy, module).modules)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    assert modules.get("lm_head", modules["model.embed_tokens"]) == modules["model.embed_tokens"]


# -- DTensor on gloo ---------------------------------------------------------------------------


def _train(module: Any, inputs: Any, optimizer: Any) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(STEPS):
        target = torch.randint(0, 256, (4, 16), generator=g)
        logits = module(input_ids=inputs).logits  # the model's own forward and output
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _deviation(net: Any, ref: Any, losses: list[float], ref_losses: list[float]) -> float:
    """The runtime's measure (`runtime.reference.deviation`): losses relative, parameters
    relative to their largest value or 1e-2 (a bias that starts at zero)."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    params = dict(ref.named_parameters())
    for n, p in net.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        q = params[n].detach()
        worst = max(worst, float((full - q).abs().max() / max(float(q.abs().max()), 1e-2)))
    return worst


def _worker(rank: int, world: int, tmp: str, cases: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        for case, (family, tied, norms64, data, mesh_shape, zero) in cases.items():
            ref = hf(family, tied, norms64=norms64).double()
            ref_losses = _train(ref, TOKENS, torch.optim.SGD(ref.parameters(), lr=LR))
            net = hf(family, tied, norms64=norms64).double()
            exported = planner.parallelize(strategy_from_json(data), net, mesh_shape=mesh_shape,
                                           zero=zero)  # fmt: skip
            (inputs,) = exported.distribute_inputs(TOKENS)
            seen: list[str] = []  # the layout of block 0's attention output
            o_proj = net.get_submodule("model.layers.0.self_attn.o_proj")
            o_proj.register_forward_pre_hook(
                lambda m, a, seen=seen: seen.append(str(a[0].placements)), prepend=True
            )
            losses = _train(net, inputs, exported.optimizer(torch.optim.SGD, lr=LR))
            head = getattr(net, "lm_head", None)
            report[case] = {
                "deviation": _deviation(net, ref, losses, ref_losses),
                "tied": not tied or head.weight is net.model.embed_tokens.weight,
                "fell back": [o.op for o in exported.fell_back],
                "sharded": len(exported.plan.sharded),
                "attention output": seen[0],
            }
    if rank == 0:
        Path(tmp, "report.json").write_text(json.dumps(report))


def _case(
    family: str, layout: str, world: int = 2, tied: bool = False, zero: int = 0
) -> dict[str, Any]:
    """The layout of the family's model as it is and with its norms in float64."""
    strategy, shape = layouts(family, world, tied)[layout]
    name = f"{family}{' tied' if tied else ''} {layout}{f' zero {zero}' if zero else ''}"
    return {
        f"{name}{' norms64' if n64 else ''}": (family, tied, n64, strategy.to_json(), shape, zero)
        for n64 in (True, False)
    }


def _launch(cases: dict[str, Any], world: int, tmp_path: Path) -> dict[str, Any]:
    assert run_workers(_worker, world, world, str(tmp_path), cases, timeout=300) == [0] * world
    report: dict[str, Any] = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == set(cases)
    for case, r in report.items():
        print(f"{case}: {r['deviation']:.2e}")
        tolerance = STRICT if "norms64" in case else AS_IS
        assert r["deviation"] <= tolerance and r["tied"] and not r["fell back"], (case, r)
        assert (r["sharded"] > 0) == ("zero" in case), (case, r)  # FSDP2's units
        # by heads, each rank computes its own (Phi-3's too, whose q, k, v arrive whole)
        by_heads = "heads" in case or "megatron" in case or "2x2" in case
        assert ("Shard(dim=2)" in r["attention output"]) == by_heads, (case, r)
    return report


@pytest.mark.slow  # 9 s (workers import transformers); the runtime's check stays by default
def test_megatron_and_fsdp2_on_llama_train_like_single_process(tmp_path: Path) -> None:
    """Megatron-LM's pairing on Llama's named linears, and FSDP2 (ZeRO-3) over data."""
    _launch(_case("llama", "megatron") | _case("llama", "data", zero=3), 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_each_family_trains_like_single_process_at_world_2(family: str, tmp_path: Path) -> None:
    cases = {
        k: v for layout in ("data", "heads", "megatron") for k, v in _case(family, layout).items()
    }
    if family == "llama":
        cases |= _case("llama", "megatron", tied=True)
    _launch(cases, 2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_data_by_tensor_parallelism_on_a_two_by_two_mesh(family: str, tmp_path: Path) -> None:
    _launch(_case(family, "megatron-2x2", 4) | _case(family, "2x2", 4), 4, tmp_path)


# -- torch's pipelining on gloo ----------------------------------------------------------------


def pipeline_case(
    family: str, world: int, m: int, schedule: str, tied: bool = False, layers: int = 2
) -> PipelinedStrategy:
    """One decoder block per stage (the first stage also embeds, the last also norms and
    projects to the vocabulary), each on its own rank."""
    graph = graph_of(family, tied, layers)
    names = [op.name for op in graph.ops]
    starts = [names.index(f"model.layers.{k}.input_layernorm") for k in range(1, layers)]
    bounds = (0, *starts, len(names))
    return pipelined(graph, bounds, tuple((r,) for r in range(world)), m, schedule)


def test_stages_are_the_decoder_blocks() -> None:
    plan = pipeline_plan(pipeline_case("llama", 2, 2, "1f1b", tied=True), hf("llama", tied=True))
    assert plan.split_spec == {"model.layers.1": "BEGINNING"}
    assert plan.stages[0].modules[0] == "model.embed_tokens"
    assert plan.stages[1].modules[-2:] == ("model.norm", "lm_head")


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _pipeline_worker(rank: int, world: int, tmp: str, cases: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    report: dict[str, Any] = {}
    with planner.process_group("gloo", store=store, rank=rank, world_size=world,
                               timeout=timedelta(seconds=60)):  # fmt: skip
        for name, (family, tied, layers, data) in cases.items():
            net = hf(family, tied, layers).double()
            ref = traceable(hf(family, tied, layers).double())  # forward(input_ids) -> logits
            g = torch.Generator().manual_seed(1)
            x = torch.randint(0, 256, (4, 16), generator=g)
            y = torch.randint(0, 256, (4, 16), generator=g)
            exported = planner.parallelize_pipeline(PipelinedStrategy.from_json(data), net,
                                                    (x,), _loss)  # fmt: skip
            held = [(key, p) for mod in exported.modules.values()
                    for key, p in mod.named_parameters(remove_duplicate=False)]  # fmt: skip
            optimizer = torch.optim.SGD(exported.parameters(), lr=LR)
            worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
            for _ in range(STEPS):
                loss = exported.step((x,), y)
                ref_loss = _loss(ref(x), y)
                ref_loss.backward()
                worst["loss"] = max(worst["loss"], abs(loss - float(ref_loss.detach())))
                for key, p in held:  # the whole batch's gradients (tied ones summed)
                    diff = (p.grad - ref.get_parameter(key).grad).abs().max()
                    worst["grad"] = max(worst["grad"], float(diff))
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad():
                    for p in ref.parameters():
                        p.add_(p.grad, alpha=-LR)
                        p.grad = None
            for key, p in held:
                diff = (p.detach() - ref.get_parameter(key).detach()).abs().max()
                worst["param"] = max(worst["param"], float(diff))
            buffers = {k for mod in exported.modules.values() for k, _ in mod.named_buffers()}
            report[name] = worst | {"params": len(held), "buffers": sorted(buffers)}
    Path(tmp, f"report-{rank}.json").write_text(json.dumps(report))


def _run_pipelines(cases: dict[str, Any], world: int, tmp: Path) -> dict[str, float]:
    """Each case's largest absolute deviation of a loss, gradient or parameter on any rank
    from single-process training (all within 1e-9); every stage computes the rotary tables
    itself, from the `inv_freq` buffer it holds."""
    jobs = {k: (*v[:3], v[3].to_json()) for k, v in cases.items()}
    codes = run_workers(_pipeline_worker, world, world, str(tmp), jobs, timeout=300)
    assert codes == [0] * world
    reports = [json.loads((tmp / f"report-{r}.json").read_text()) for r in range(world)]
    out = {}
    for name in cases:
        assert all(r[name]["params"] > 0 for r in reports), name  # every rank holds a stage
        assert all("model.rotary_emb.inv_freq" in r[name]["buffers"] for r in reports), name
        worst = {what: max(r[name][what] for r in reports) for what in ("loss", "grad", "param")}
        print(f"{name}: " + ", ".join(f"{what} {v:.2e}" for what, v in worst.items()))
        assert max(worst.values()) <= 1e-9, (name, worst)
        out[name] = max(worst.values())
    return out


@pytest.mark.slow  # 7-9 s
def test_a_tied_llama_pipelines_in_torch_like_single_process(tmp_path: Path) -> None:
    """The embedding on stage 0 and the head on stage 1 share a weight: their gradients are
    summed over the stages."""
    case = pipeline_case("llama", 2, 2, "1f1b", tied=True)
    _run_pipelines({"llama tied 1f1b m2": ("llama", True, 2, case)}, 2, tmp_path)


@pytest.mark.slow
def test_pipelines_of_each_family(tmp_path: Path) -> None:
    cases = {
        f"{family} gpipe m2": (family, False, 2, pipeline_case(family, 2, 2, "gpipe"))
        for family in ("mistral", "qwen2", "qwen3", "phi3")
    }
    _run_pipelines(cases, 2, tmp_path)


@pytest.mark.slow
def test_three_stages_of_each_family_at_world_3(tmp_path: Path) -> None:
    """One decoder block per stage, each stage computing the rotary tables and the causal mask
    itself; Llama's tied head on stage 2 gets the embedding's gradient from stage 0."""
    cases = {
        "llama tied 3 stages 1f1b m4": ("llama", True, 3, pipeline_case("llama", 3, 4, "1f1b",
                                                                         tied=True, layers=3)),
    } | {
        f"{family} 3 stages gpipe m2": (family, False, 3, pipeline_case(family, 3, 2, "gpipe",
                                                                         layers=3))
        for family in ("mistral", "qwen2", "qwen3", "phi3")
    }  # fmt: skip
    _run_pipelines(cases, 3, tmp_path)


@pytest.mark.slow
def test_four_stages_at_world_4(tmp_path: Path) -> None:
    cases = {
        f"{family} 4 stages {schedule} m{m}": (family, False, 4, pipeline_case(family, 4, m,
                                                                               schedule, layers=4))
        for family, schedule, m in (("llama", "1f1b", 4), ("qwen3", "gpipe", 2),
                                    ("phi3", "1f1b", 4))
    }  # fmt: skip
    _run_pipelines(cases, 4, tmp_path)


@pytest.mark.slow
def test_four_chunks_interleaved_on_two_ranks(tmp_path: Path) -> None:
    """Chunks 0 and 2 on rank 0, 1 and 3 on rank 1 (`ScheduleInterleaved1F1B`)."""
    graph = graph_of("llama", False, 4)
    names = [op.name for op in graph.ops]
    bounds = (0, *(names.index(f"model.layers.{k}.input_layernorm") for k in (1, 2, 3)),
              len(names))  # fmt: skip
    case = pipelined(graph, bounds, ((0,), (1,)), 2, "interleaved")
    _run_pipelines({"llama 2 ranks x 2 chunks interleaved m2": ("llama", False, 4, case)}, 2,
                   tmp_path)  # fmt: skip


@pytest.mark.slow  # 4-10 s: torch.export traces the model
def test_each_stage_computes_the_rotary_tables_and_the_mask_itself() -> None:
    """The decoder computes its rotary tables (from `rotary_emb.inv_freq`), causal mask and
    position ids once, before block 0, and hands them to every block. Sent from stage 0 they
    would pass stage 1 on their way to stage 2, which torch's pipelining cannot run (its first
    step failed with "Backward of skip connections not supported yet"); traced, each stage
    computes them itself from the buffer it holds, and passes the next the hidden state alone."""
    module = traceable(hf("llama", layers=3).double())
    paths = ("model.layers.1", "model.layers.2")
    pipe, origins = _traced_stages(module, (TOKENS,), paths)
    for k in range(3):
        stage = pipe.get_stage_module(k)
        assert [name for name, _ in stage.named_buffers()] == ["model.rotary_emb.inv_freq"]
        inputs = [n for n in stage.graph.nodes if n.op == "placeholder"]
        assert len(inputs) == 1, (k, inputs)  # the tokens, then the previous stage's output
    _refuse_skips(pipe, (None, *paths), origins)  # nothing passes a stage
    assert torch.equal(pipe(TOKENS)[0], module(TOKENS))
    assert "forward" not in module.get_submodule("model.layers.1").__dict__  # its own again


class PaddedLlama(torch.nn.Module):
    """A Llama called with a padding mask computed from the token ids (0 pads): the mask its
    blocks read depends on the inputs' values."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = hf("llama", layers=3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).long()
        out: torch.Tensor = self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return out


@pytest.mark.slow  # 4-10 s: torch.export traces the model
def test_a_value_computed_from_the_inputs_that_skips_a_stage_is_refused_in_one_line() -> None:
    """The rotary tables are computed again in each stage; the padding mask, computed from the
    tokens, would still go from stage 0 to stage 2."""
    from planner.errors import ExportError

    paths = ("lm.model.layers.1", "lm.model.layers.2")
    pipe, origins = _traced_stages(PaddedLlama(), (TOKENS,), paths)
    with pytest.raises(ExportError) as info:
        _refuse_skips(pipe, (None, *paths), origins)
    message = str(info.value)
    assert message.startswith("torch's pipelining would pass a value computed from the inputs or ")
    assert "in lm.model), from stage 0 to stage 2 (from 'lm.model.layers.2')" in message
    assert "\n" not in message
