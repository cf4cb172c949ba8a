"""Plans as launchers take them (planner.export.launchers, `planner export`): the uniform
layout read from a plan, Megatron-LM's arguments, torchtitan's TOML and 0.3 overrides, the
FSDP2/TP script; what each cannot express in one line with a simulated nearest layout; names
checked against the launchers' own lists, and against the launchers themselves where they are
installed (torchtitan, megatron-core: optional, the tests skip without them)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

import planner
from planner.cli import main
from planner.errors import ExportError, LayerwiseError
from planner.export.launchers import export_launcher, read_plan
from planner.export.launchers.architecture import read_architecture
from planner.export.launchers.common import changed
from planner.export.launchers.megatron import MEGATRON_ARGUMENTS, megatron_args
from planner.export.launchers.torchtitan import (
    LLAMA3_FLAVORS,
    TORCHTITAN_02_FIELDS,
    TORCHTITAN_03_CHECKPOINTING,
    TORCHTITAN_03_FIELDS,
    llama3_fit,
    torchtitan_sections,
)
from planner.graph.precision import with_precision
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.pipeline.layouts import pipelined
from planner.pipeline.spec import micro_batch_graph
from planner.problems.baselines import megatron
from planner.problems.strategy import Strategy

ROOT = Path(__file__).resolve().parent.parent
GPT: dict[str, Any] = {"seq": 16, "n_head": 4, "n_embd": 32, "vocab_size": 128, "block_size": 16}


def gpt_spec(batch: int, layers: int, precision: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": "gpt2", "batch": batch, "coarsen": True,
                            "kwargs": {**GPT, "n_layer": layers}}  # fmt: skip
    return {**spec, "precision": precision} if precision else spec


def gpt_graph(batch: int, layers: int, precision: str | None = None) -> Any:
    graph = model_graph("gpt2", batch=batch, n_layer=layers, **GPT)
    return with_precision(graph, precision) if precision else graph


def per_op(
    tensor: int = 2,
    devices: str = "p100-1x4",
    batch: int = 8,
    layers: int = 2,
    cost: dict[str, Any] | None = None,
    precision: str | None = None,
    edit: str | None = None,
) -> dict[str, Any]:
    """A per-op plan: Megatron-LM's rule at `tensor` (with op `edit` whole on device 0)."""
    graph = gpt_graph(batch, layers, precision)
    strategy = megatron(graph, get_preset(devices), tensor)
    if edit is not None:
        configs = list(strategy.configs)
        i = next(k for k, op in enumerate(graph.ops) if op.name == edit)
        configs[i] = dataclasses.replace(
            configs[i], degrees=(1,) * len(configs[i].degrees), devices=(0,), reduce=1
        )
        strategy = Strategy(graph, strategy.devices, tuple(configs))
    return strategy.to_json(model=gpt_spec(batch, layers, precision), extra={"cost": cost or {}})


def piped(
    stages: int = 2,
    tensor: int = 1,
    micro_batches: int = 2,
    schedule: str = "1f1b",
    virtual: int = 1,
    blocks: tuple[int, ...] | None = None,
    layers: int = 4,
    batch: int = 8,
    devices: str = "p100-2x2",
    cost: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pipelined plan laid out by Megatron-LM's rule in every stage."""
    micro = micro_batch_graph(gpt_graph(batch, layers), micro_batches)
    ps = pipelined(
        micro, get_preset(devices), stages, micro_batches,
        lambda g, d: megatron(g, d, tensor), schedule, virtual, blocks,
    )  # fmt: skip
    layout = {"stages": stages, "tensor": tensor, "context": 1, "expert": 1}
    return ps.to_json(model=gpt_spec(batch, layers), extra={"cost": cost or {}, "layout": layout})


def pairs(args: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """--flag value / --flag tokens as a dict."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[a] = nxt if nxt is not None and not nxt.startswith("--") else None
    return out


# -- the uniform layout -----------------------------------------------------------------------


def test_a_plan_of_uniform_degrees_is_read_exactly_and_costs_what_it_costs() -> None:
    lp = read_plan(per_op(tensor=2))
    u = lp.uniform
    assert (u.stages, u.tensor, u.context, u.data, u.expert) == (1, 2, 1, 2, 1)
    assert lp.differ == () and lp.alike == 1.0
    launch = export_launcher(per_op(tensor=2), "megatron")
    assert launch.notes == ()
    assert launch.exported_seconds == pytest.approx(launch.planned_seconds, rel=1e-12)
    assert "# simulated step" in launch.text


def test_ops_laid_out_otherwise_are_one_line_with_the_nearest_layout_and_its_cost() -> None:
    plan = per_op(tensor=2, edit="transformer.h.0.mlp.c_fc")
    launch = export_launcher(plan, "megatron")
    (line,) = launch.notes
    assert line.startswith("per-op layouts: 1 of ") and "transformer.h.0.mlp.c_fc" in line
    assert "nearest TP 2 x DP 2" in line and "simulated" in line and "the plan's" in line
    assert launch.exported_seconds == pytest.approx(
        export_launcher(per_op(tensor=2), "megatron").planned_seconds, rel=1e-12
    )
    assert launch.planned_seconds != launch.exported_seconds
    quiet = export_launcher(plan, "megatron", simulate=False)
    assert quiet.planned_seconds is None and "simulated" not in quiet.notes[0]


def test_a_pipelined_plan_reads_stages_micro_batches_and_blocks() -> None:
    lp = read_plan(piped(stages=2, micro_batches=4, blocks=(3, 1)))
    u = lp.uniform
    assert (u.stages, u.data, u.micro_batches, u.schedule, u.blocks) == (2, 2, 4, "1f1b", (3, 1))
    assert lp.model.global_batch == 8 and lp.model.layers == 4 and lp.model.seq == 16
    assert lp.differ == ()
    assert lp.simulate(u) == pytest.approx(lp.planned_seconds, rel=1e-12)


def test_stages_on_other_devices_are_said() -> None:
    plan = piped(stages=2)
    plan["pipeline"]["groups"] = [[0, 2], [1, 3]]
    for name, cfg in plan["configs"].items():  # every op on its stage's group
        i = list(plan["configs"]).index(name)
        group = [0, 2] if i < plan["pipeline"]["bounds"][1] else [1, 3]
        cfg["devices"] = [group[d % 2] for d in cfg["devices"]]
    notes = export_launcher(plan, "megatron").notes
    assert any(n.startswith("stage devices [[0, 2], [1, 3]]") for n in notes), notes


# -- Megatron-LM ------------------------------------------------------------------------------


def test_megatron_arguments_of_a_pipelined_tensor_parallel_plan() -> None:
    args = pairs(export_launcher(piped(stages=2, tensor=2, micro_batches=4), "megatron").args)
    assert args["--tensor-model-parallel-size"] == "2"
    assert args["--pipeline-model-parallel-size"] == "2"
    assert "--sequence-parallel" in args
    assert args["--micro-batch-size"] == "2" and args["--global-batch-size"] == "8"  # 8/(1*4)
    assert args["--num-layers"] == "4" and args["--hidden-size"] == "32"
    assert args["--num-attention-heads"] == "4" and args["--seq-length"] == "16"
    assert "--pipeline-model-parallel-layout" not in args


def test_megatron_virtual_stages_and_uneven_blocks() -> None:
    inter = export_launcher(
        piped(stages=2, micro_batches=4, schedule="interleaved", virtual=2, layers=8), "megatron"
    )
    assert pairs(inter.args)["--num-layers-per-virtual-pipeline-stage"] == "2"
    assert inter.notes == ()
    uneven = export_launcher(piped(stages=2, blocks=(3, 1)), "megatron")
    assert pairs(uneven.args)["--pipeline-model-parallel-layout"] == "Ettt|tL"


def test_megatron_has_no_gpipe_the_nearest_is_1f1b_with_its_simulated_step() -> None:
    launch = export_launcher(piped(stages=2, micro_batches=4, schedule="gpipe"), "megatron")
    (line,) = launch.notes
    assert line.startswith("schedule gpipe: Megatron-LM runs 1F1B or interleaved: nearest 1f1b")
    assert "simulated" in line and launch.uniform.schedule == "1f1b"
    assert launch.exported_seconds is not None and launch.planned_seconds is not None


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"zero": 1}, ["--use-distributed-optimizer"]),
        ({"zero": 3}, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                       "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]),
        ({"recompute": "selective"}, ["--recompute-granularity", "selective"]),
        ({"recompute": "full"}, ["--recompute-granularity", "full", "--recompute-method",
                                 "uniform", "--recompute-num-layers", "1"]),
        ({"recompute": 1}, ["--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "1"]),
        ({"precision": "bf16-mixed"}, ["--bf16"]),
        ({"precision": "16-true"}, ["--fp16"]),
        ({"precision": "transformer-engine"}, ["--bf16", "--fp8-format", "hybrid",
                                               "--fp8-recipe", "delayed"]),
        ({"precision": "transformer-engine-cs"}, ["--fp8-recipe", "tensorwise"]),
    ],
)  # fmt: skip
def test_megatron_memory_and_precision_arguments(
    change: dict[str, Any], expected: list[str]
) -> None:
    lp = read_plan(per_op(tensor=2))
    args = megatron_args(lp, changed(lp.uniform, **change))
    text = " ".join(args)
    assert " ".join(expected) in text, text


def test_megatron_expert_parallelism_of_a_mixture_of_experts() -> None:
    sizes = dict(batch=4, seq=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128,
                 hidden_dim=64, moe_hidden=64, n_experts=4, top_k=2, max_seq_len=16,
                 multiple_of=16)  # fmt: skip
    graph = model_graph("mixtral-8x7b", **sizes)
    plan = megatron(graph, get_preset("p100-1x4"), 2, 1, 2).to_json(extra={"cost": {}})
    args = pairs(export_launcher(plan, "megatron").args)
    assert args["--expert-model-parallel-size"] == "2"
    assert args["--expert-tensor-parallel-size"] == "1"
    assert args["--num-experts"] == "4" and args["--moe-router-topk"] == "2"
    assert "--group-query-attention" in args and args["--num-query-groups"] == "2"
    titan = pairs(export_launcher(plan, "torchtitan").args)
    assert titan["--parallelism.expert_parallel_degree"] == "2"


def all_megatron_exports() -> list[tuple[str, ...]]:
    lp = read_plan(per_op(tensor=2))
    variants = [{"zero": z} for z in (1, 2, 3)] + [{"recompute": r} for r in ("selective",
                "full", 1)] + [{"precision": p} for p in ("bf16-mixed", "16-mixed",
                "transformer-engine", "transformer-engine-cs")]  # fmt: skip
    out = [tuple(megatron_args(lp, changed(lp.uniform, **v))) for v in variants]
    for plan in (piped(stages=2, tensor=2, micro_batches=4), piped(stages=2, blocks=(3, 1)),
                 piped(stages=2, micro_batches=4, schedule="interleaved", virtual=2, layers=8)):  # fmt: skip
        out.append(export_launcher(plan, "megatron", simulate=False).args)
    return out


def test_every_megatron_argument_is_megatron_lms_with_a_value_it_takes() -> None:
    for args in [*all_megatron_exports(), *model_exports().values()]:
        for flag, value in pairs(args).items():
            assert flag in MEGATRON_ARGUMENTS, flag
            _, kind = MEGATRON_ARGUMENTS[flag]
            if kind in ("flag", "off"):
                assert value is None, (flag, value)
            elif kind is int:
                assert value is not None and int(value) >= 1, (flag, value)
            elif kind is float:
                assert value is not None and float(value) >= 0, (flag, value)
            elif isinstance(kind, tuple):
                assert value in kind, (flag, value)
            elif kind is str:
                assert value, (flag, value)
            else:
                assert value is not None and MEGATRON_TYPES[str(kind)](value), (flag, value)


def tuple_type(x: str) -> tuple[int, ...]:
    """Megatron-LM's `tuple_type` (arguments.py): "4095,0" -> (4095, 0)."""
    return tuple(int(i) for i in x.strip("()").split(","))


def moe_freq_type(x: str) -> int | list[int]:
    """Megatron-LM's `moe_freq_type` (arguments.py): an integer, or a list expression of
    digits, commas, brackets, parentheses, + and * only (`_eval_pattern`)."""
    if "[" not in x:
        return int(x)
    if re.search(r"[^,\d\[\]\(\)\+\*]", x):
        raise ValueError(f"Invalid pattern: {x}")
    return list(eval(x))  # noqa: S307 - Megatron-LM's own parsing of the checked expression


MEGATRON_TYPES: dict[str, Any] = {"int,int": tuple_type, "pattern": moe_freq_type}


def megatron_namespace(args: tuple[str, ...]) -> argparse.Namespace:
    """Megatron-LM's parsing of `args`: its names, destinations and types (MEGATRON_ARGUMENTS,
    taken from megatron/training/arguments.py), only the arguments given."""
    parser = argparse.ArgumentParser(allow_abbrev=False, argument_default=argparse.SUPPRESS)
    for flag, (dest, kind) in MEGATRON_ARGUMENTS.items():
        if kind in ("flag", "off"):
            action = "store_true" if kind == "flag" else "store_false"
            parser.add_argument(flag, dest=dest, action=action)
        elif isinstance(kind, tuple):
            parser.add_argument(flag, dest=dest, choices=kind)
        else:
            kind = MEGATRON_TYPES.get(str(kind), kind)
            parser.add_argument(flag, dest=dest, type=kind)  # type: ignore[arg-type]
    return parser.parse_args(list(args))


def megatron_core_config(args: tuple[str, ...]) -> Any:
    """megatron-core's TransformerConfig from Megatron-LM's arguments, as Megatron-LM builds
    it (`validate_args` then `core_transformer_config_from_args`)."""
    import torch
    from megatron.core.transformer import TransformerConfig

    ns = megatron_namespace(args)
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TransformerConfig)
          if hasattr(ns, f.name)}  # fmt: skip
    pp = getattr(ns, "pipeline_model_parallel_size", 1)
    if hasattr(ns, "num_layers_per_virtual_pipeline_stage"):
        per_stage = ns.num_layers // pp
        kw["virtual_pipeline_model_parallel_size"] = (
            per_stage // ns.num_layers_per_virtual_pipeline_stage
        )
    dtype = torch.bfloat16 if getattr(ns, "bf16", False) else torch.float32
    kw |= {"pipeline_dtype": dtype, "params_dtype": dtype}
    if hasattr(ns, "num_experts"):
        kw["num_moe_experts"] = ns.num_experts
    if not getattr(ns, "group_query_attention", False):
        kw.pop("num_query_groups", None)
    # core_transformer_config_from_args: the names that differ, and --swiglu's two fields
    kw["layernorm_zero_centered_gamma"] = getattr(ns, "apply_layernorm_1p", False)
    if hasattr(ns, "norm_epsilon"):
        kw["layernorm_epsilon"] = ns.norm_epsilon
    if getattr(ns, "swiglu", False):
        kw |= {"activation_func": torch.nn.functional.silu, "gated_linear_unit": True}
    if not getattr(ns, "add_bias_linear", True):
        kw["add_bias_linear"] = False
    else:
        kw.pop("add_qkv_bias", None)  # validate_args: biases everywhere include q, k, v's
    if getattr(ns, "multi_latent_attention", False):
        from megatron.core.transformer import MLATransformerConfig

        names = {f.name for f in dataclasses.fields(MLATransformerConfig)}
        kw |= {k: getattr(ns, k) for k in names if hasattr(ns, k) and k not in kw}
        return MLATransformerConfig(**kw)
    return TransformerConfig(**kw)


def test_megatron_core_builds_its_configs_from_the_arguments() -> None:
    pytest.importorskip("megatron.core")
    from megatron.core import ModelParallelConfig

    configs = [megatron_core_config(args) for args in all_megatron_exports()]
    assert all(isinstance(c, ModelParallelConfig) for c in configs)
    first = configs[0]  # TP 2 x DP 2 with the distributed optimizer
    assert first.tensor_model_parallel_size == 2 and first.sequence_parallel
    pp, uneven, inter = configs[-3:]
    assert pp.pipeline_model_parallel_size == 2 and pp.tensor_model_parallel_size == 2
    assert uneven.pipeline_model_parallel_layout is not None
    assert inter.virtual_pipeline_model_parallel_size == 2
    fp8 = [c for c in configs if c.fp8]
    assert [(c.fp8, c.fp8_recipe) for c in fp8] == [("hybrid", "delayed"), ("hybrid", "tensorwise")]
    recompute = [(c.recompute_granularity, c.recompute_method) for c in configs[3:6]]
    assert recompute == [("selective", None), ("full", "uniform"), ("full", "block")]


# -- Megatron-LM's model arguments, read from the graph ---------------------------------------

LLAMA: dict[str, Any] = dict(seq=16, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128,
                             multiple_of=16)  # fmt: skip
DEEPSEEK: dict[str, Any] = dict(
    seq=16, vocab_size=128, dim=64, n_layers=3, n_heads=4, hidden_dim=128, n_experts=4, top_k=2,
    moe_hidden=32, n_groups=2, topk_groups=1, first_dense=1, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
)  # fmt: skip
QWEN_MOE: dict[str, Any] = dict(seq=16, n_layers=2, dim=64, n_heads=4, vocab_size=128,
                                n_experts=4, top_k=2, moe_hidden=32, shared_hidden=64,
                                hidden_dim=128)  # fmt: skip
HF_SMALL: dict[str, Any] = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                seq=16)  # fmt: skip


def plan_of(graph: Any, tensor: int = 2, cost: dict[str, Any] | None = None,
            kwargs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Megatron-LM's rule at `tensor` on p100-1x4 as a plan of `graph` (batch 4)."""
    spec = {"name": graph.name, "batch": 4, "kwargs": kwargs or {}, "coarsen": True}
    strategy = megatron(graph, get_preset("p100-1x4"), tensor)
    return strategy.to_json(model=spec, extra={"cost": cost or {}})


@functools.cache
def model_exports() -> dict[str, tuple[str, ...]]:
    """Megatron-LM's arguments of zoo models of four designs (2-3 layers, width 32-64)."""
    sizes = {"llama3-8b": LLAMA, "deepseek-v3-like": DEEPSEEK, "qwen-moe-like": QWEN_MOE,
             "gpt2": {**GPT, "n_layer": 2}}  # fmt: skip
    return {
        name: export_launcher(
            plan_of(model_graph(name, batch=4, **kw), 2 if name != "gpt2" else 1),
            "megatron",
            simulate=False,
        ).args  # fmt: skip
        for name, kw in sizes.items()
    }


@functools.cache
def llama_architecture() -> Any:
    """The architecture of a 2-layer Llama 3 of width 64 (a design Megatron-LM builds)."""
    return read_architecture(model_graph("llama3-8b", batch=4, **LLAMA))


def windowed(args: dict[str, str | None], layers: int) -> list[bool]:
    """Megatron-Core's `is_layer_window_attention` over layers 1..L: no --window-size, none;
    else all but every n-th (an integer), or the pattern's 1s."""
    if "--window-size" not in args:
        return [False] * layers
    freq = args.get("--window-attn-skip-freq")
    skip = moe_freq_type(freq) if freq else None
    if isinstance(skip, list):
        return [bool(f) for f in skip]
    return [skip is None or (i + 1) % skip != 0 for i in range(layers)]


def test_megatron_builds_a_llama_as_its_graph_says() -> None:
    graph = model_graph("llama3-8b", batch=4, **LLAMA)
    w1, norm = graph.op("layers.0.feed_forward.w1"), graph.op("layers.0.attention_norm")
    launch = export_launcher(plan_of(graph), "megatron", simulate=False)
    args = pairs(launch.args)
    assert args["--ffn-hidden-size"] == str(w1.output.size("channel"))
    assert "--swiglu" in args and args["--normalization"] == "RMSNorm"
    assert float(str(args["--norm-epsilon"])) == norm.attr("eps")
    assert args["--position-embedding-type"] == "rope" and "--rotary-percent" not in args
    assert "--untie-embeddings-and-output-weights" in args and "--disable-bias-linear" in args
    assert "--add-qkv-bias" not in args and "--kv-channels" not in args
    assert args["--padded-vocab-size"] == str(graph.op("tok_embeddings").params[0].shape[0])
    assert args["--hidden-dropout"] == "0"  # no dropout op: Megatron-LM's default is 0.1
    assert launch.notes == ()  # the rule's own layout, a model Megatron-LM's GPT builds
    assert "# not in the plan's graph: the rotary base and scaling" in launch.text


def test_megatron_builds_gpt2_with_learned_positions_tied_weights_and_biases() -> None:
    graph = model_graph("gpt2", batch=4, **{**GPT, "n_layer": 2, "block_size": 32})
    args = pairs(export_launcher(plan_of(graph, tensor=1), "megatron", simulate=False).args)
    table = next(p for op in graph.ops for p in op.params if p.name == "transformer.wpe.weight")
    assert args["--position-embedding-type"] == "learned_absolute"
    assert args["--max-position-embeddings"] == str(table.shape[0]) != args["--seq-length"]
    fc = graph.op("transformer.h.0.mlp.c_fc")
    assert args["--ffn-hidden-size"] == str(fc.output.size("channel"))
    for absent in ("--swiglu", "--normalization", "--untie-embeddings-and-output-weights",
                   "--disable-bias-linear", "--hidden-dropout", "--kv-channels"):  # fmt: skip
        assert absent not in args, absent


def test_megatron_builds_mla_and_experts_as_the_graph_says() -> None:
    graph = model_graph("deepseek-v3-like", batch=4, **DEEPSEEK)
    attention = graph.op("layers.0.attention.attention")
    moe = next(op for op in graph.ops if op.kind == "moe")
    args = pairs(model_exports()["deepseek-v3-like"])
    assert "--multi-latent-attention" in args and "--kv-channels" not in args
    width = {n: str(graph.op(f"layers.0.attention.{n}").output.size("channel"))
             for n in ("q_norm", "kv_norm")}  # fmt: skip
    assert (args["--q-lora-rank"], args["--kv-lora-rank"]) == (width["q_norm"], width["kv_norm"])
    rope = attention.attr("rope_dim")
    assert args["--qk-pos-emb-head-dim"] == str(rope)
    assert args["--qk-head-dim"] == str(attention.attr("head_dim") - rope)
    assert args["--v-head-dim"] == str(attention.attr("v_head_dim"))
    assert args["--moe-ffn-hidden-size"] == str(moe.attr("ffn"))
    assert args["--moe-shared-expert-intermediate-size"] == str(moe.attr("shared_ffn"))
    sparse = [any(op.kind == "moe" for op in graph.ops if op.name.startswith(f"layers.{i}."))
              for i in range(DEEPSEEK["n_layers"])]  # fmt: skip
    assert moe_freq_type(str(args["--moe-layer-freq"])) == [int(x) for x in sparse]
    assert args["--moe-router-score-function"] == "sigmoid"
    assert args["--moe-router-num-groups"] == str(moe.attr("groups"))
    assert args["--moe-router-group-topk"] == str(moe.attr("topk_groups"))
    assert float(str(args["--moe-router-topk-scaling-factor"])) == moe.attr("route_scale")
    assert "--moe-router-enable-expert-bias" in args  # its router_bias role


def test_megatron_names_the_parts_its_gpt_cannot_build_in_one_line() -> None:
    """Qwen-MoE's sigmoid gate on its shared expert; q, k, v biases and a softmax over all
    experts it can."""
    args = pairs(model_exports()["qwen-moe-like"])
    assert "--disable-bias-linear" in args and "--add-qkv-bias" in args
    assert "--moe-router-pre-softmax" in args  # top-k gates not renormalised
    graph = model_graph("qwen-moe-like", batch=4, **QWEN_MOE)
    notes = export_launcher(plan_of(graph), "megatron").notes
    (line,) = [n for n in notes if n.startswith("model parts")]
    assert "a sigmoid gate on the shared expert" in line and "(not simulated" in line


@pytest.mark.parametrize(
    "windows", [(4, 4), (4, None), (4, 4, 4, 4, 4, None), (None, None, 4, 4), (None, 4, 4, 4)]
)
def test_megatron_windows_are_megatron_cores_per_layer(windows: tuple[int | None, ...]) -> None:
    from planner.export.launchers.megatron_model import model_args, model_differences

    arch = dataclasses.replace(llama_architecture(), layers=len(windows), windows=windows)
    facts = read_plan(per_op(tensor=1)).model
    args = pairs(model_args(facts, arch, 1))
    assert windowed(args, len(windows)) == [w is not None for w in windows]
    assert tuple_type(str(args["--window-size"])) == (4 - 1, 0)  # TE's inclusive (left, right)
    assert model_differences(arch, 1) == []
    two = dataclasses.replace(arch, layers=2, windows=(4, 8))
    assert "--window-size" not in model_args(facts, two, 1)
    assert model_differences(two, 1) == ["sliding windows of 4 and 8 keys"]


def test_megatron_pads_a_vocabulary_the_tensor_degree_does_not_divide() -> None:
    from planner.export.launchers.megatron_model import model_args, model_differences

    facts = read_plan(per_op(tensor=1)).model
    odd = dataclasses.replace(llama_architecture(), vocab=127)
    assert pairs(model_args(facts, odd, 2))["--padded-vocab-size"] == "128"
    assert pairs(model_args(facts, odd, 1))["--padded-vocab-size"] == "127"
    assert model_differences(odd, 2) == ["a vocabulary of 127 that TP 2 does not divide (padded)"]
    assert model_differences(odd, 1) == []


def test_layers_unlike_each_other_or_without_parts_are_said() -> None:
    """A ResNet's numbered blocks have no attention and no MLP: said, not built as a GPT."""
    from planner.export.launchers.megatron_model import model_differences

    differ = model_differences(read_architecture(model_graph("resnet101")), 1)
    assert "layers without attention (its GPT is a transformer)" in differ
    assert "layers without an MLP" in differ
    tiny = llama_architecture()
    mixed = dataclasses.replace(tiny, mixed=("attention", "norms"))
    assert model_differences(mixed, 1) == ["attention, norms unlike between layers"]
    assert model_differences(tiny, 1) == []


@pytest.mark.parametrize(
    "name,overrides,present,cannot",
    [
        ("hf:Qwen/Qwen2-7B", {}, ["--disable-bias-linear", "--add-qkv-bias"], []),
        ("hf:Qwen/Qwen3-8B", {"head_dim": 32}, ["--kv-channels", "--qk-layernorm"], []),
        ("hf:mistralai/Mistral-7B-v0.1", {"sliding_window": 4}, ["--window-size"], []),
        ("hf:google/gemma-2-9b", {"head_dim": 16, "sliding_window": 4},
         ["--apply-layernorm-1p", "--window-attn-skip-freq"],
         ["a gated MLP of gelu_tanh", "norms on the attention's and the MLP's outputs too",
          "attention scores soft-capped at", "scaled embeddings", "(a soft cap)"]),
    ],
)  # fmt: skip
def test_megatron_arguments_of_hugging_face_models(
    name: str, overrides: dict[str, Any], present: list[str], cannot: list[str]
) -> None:
    pytest.importorskip("transformers")
    graph = model_graph(name, batch=4, **{**HF_SMALL, **overrides})
    attention = [op for op in graph.ops if op.kind == "attention"]
    head = attention[0].attr("head_dim") or attention[0].output.size("channel") // 4
    launch = export_launcher(plan_of(graph), "megatron", simulate=False)
    args = pairs(launch.args)
    for flag in present:
        assert flag in args, flag
    if "--kv-channels" in args:
        assert args["--kv-channels"] == str(head) and 4 * head != HF_SMALL["hidden_size"]
    assert windowed(args, len(attention)) == [bool(op.attr("window")) for op in attention]
    if "--window-size" in args:
        size = next(op.attr("window") for op in attention if op.attr("window"))
        assert tuple_type(str(args["--window-size"])) == (size - 1, 0)
    line = [n for n in launch.notes if n.startswith("model parts")]
    assert all(any(c in n for n in line) for c in cannot), line
    assert bool(line) == bool(cannot)
    if importlib.util.find_spec("megatron") is not None:  # megatron-core takes them
        config = megatron_core_config(launch.args)
        assert config.qk_layernorm == ("--qk-layernorm" in args)
        assert config.layernorm_zero_centered_gamma == ("--apply-layernorm-1p" in args)


def test_megatron_core_builds_the_models_the_arguments_describe() -> None:
    pytest.importorskip("megatron.core")
    configs = {name: megatron_core_config(args) for name, args in model_exports().items()}
    llama, mla, qwen, gpt = (configs[n] for n in ("llama3-8b", "deepseek-v3-like",
                                                  "qwen-moe-like", "gpt2"))  # fmt: skip
    assert llama.gated_linear_unit and llama.normalization == "RMSNorm"
    assert not llama.add_bias_linear and llama.hidden_dropout == 0
    assert type(mla).__name__ == "MLATransformerConfig"
    args = pairs(model_exports()["deepseek-v3-like"])
    assert (mla.q_lora_rank, mla.kv_lora_rank) == (int(str(args["--q-lora-rank"])),
                                                  int(str(args["--kv-lora-rank"])))  # fmt: skip
    assert mla.moe_layer_freq == moe_freq_type(str(args["--moe-layer-freq"]))
    assert mla.moe_router_score_function == "sigmoid" and mla.moe_router_enable_expert_bias
    assert qwen.add_qkv_bias and not qwen.add_bias_linear and qwen.moe_router_pre_softmax
    assert gpt.add_bias_linear and not gpt.gated_linear_unit and gpt.normalization == "LayerNorm"


# -- torchtitan -------------------------------------------------------------------------------


def torchtitan_exports() -> list[Any]:
    lp = read_plan(per_op(tensor=2))
    variants = [{"zero": z} for z in (0, 2, 3)] + [{"recompute": r} for r in ("none", "full",
                "selective", 1)] + [{"precision": p} for p in ("bf16-mixed", "bf16-true",
                "transformer-engine-cs")]  # fmt: skip
    out = [torchtitan_sections(lp, changed(lp.uniform, **v)) for v in variants]
    for plan in (piped(stages=2, tensor=2, micro_batches=4, schedule="gpipe"),
                 piped(stages=2, blocks=(3, 1))):  # fmt: skip
        out.append(tomllib.loads(export_launcher(plan, "torchtitan", simulate=False).text))
    return out


def flatten(sections: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """TOML tables as 'quantize.linear.float8' -> fields."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in sections.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            out |= flatten(value, name + ".")
        else:
            out[name] = value
    return out


def test_the_toml_uses_torchtitans_field_names() -> None:
    for sections in torchtitan_exports():
        for table, fields in flatten(sections).items():
            assert table in TORCHTITAN_02_FIELDS, table
            assert set(fields) <= set(TORCHTITAN_02_FIELDS[table]), (table, fields)
        assert set(sections["training"]) <= set(TORCHTITAN_03_FIELDS["training"])
        assert set(sections["parallelism"]) <= set(TORCHTITAN_03_FIELDS["parallelism"])


def test_the_toml_parses_and_reproduces_the_layout_and_its_03_overrides_say_the_same() -> None:
    launch = export_launcher(piped(stages=2, tensor=2, micro_batches=4), "torchtitan")
    toml = tomllib.loads(launch.text)
    par = toml["parallelism"]
    assert par["pipeline_parallel_degree"] == 2 and par["tensor_parallel_degree"] == 2
    assert par["pipeline_parallel_schedule"] == "1F1B"
    assert par["pipeline_parallel_microbatch_size"] == 2
    assert par["module_fqns_per_model_part"] == [
        ["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm", "output"]
    ]  # fmt: skip
    assert toml["training"] == {"local_batch_size": 8, "global_batch_size": 8, "seq_len": 16,
                                "mixed_precision_param": "float32"}  # fmt: skip
    args = launch.args
    assert args[-1].startswith("activation_checkpoint:")
    assert args[-1].split(":")[1] in TORCHTITAN_03_CHECKPOINTING
    assert args[0] == "--training.disable_cuda_graphs"  # 0.3 refuses CUDA graphs with pipelines
    keys = [a[2:].split(".", 1) for a in args if a.startswith("--")]
    assert all(key in TORCHTITAN_03_FIELDS[section] for section, key in keys)
    assert "--module MODEL --config CONFIG " + " ".join(args) in launch.text
    assert launch.notes == ()


def test_torchtitan_runs_ddp_alone_beside_tensor_parallelism_fsdp() -> None:
    alone = export_launcher(per_op(tensor=1), "torchtitan")
    assert alone.notes == ()
    assert tomllib.loads(alone.text)["parallelism"]["data_parallel_replicate_degree"] == 4
    beside = export_launcher(per_op(tensor=2), "torchtitan")
    (line,) = beside.notes
    assert line.startswith("ZeRO 0: torchtitan's DDP runs with no other parallelism: nearest "
                           "ZeRO 2 (fsdp_reshard_after_forward never) (simulated")  # fmt: skip
    par = tomllib.loads(beside.text)["parallelism"]
    assert par["data_parallel_shard_degree"] == 2 and par["fsdp_reshard_after_forward"] == "never"


def test_torchtitan_notes_what_it_lacks() -> None:
    lp = read_plan(per_op(tensor=1, cost={"zero": 1, "recompute": "selective"},
                          precision="transformer-engine"))  # fmt: skip
    launch = export_launcher(per_op(tensor=1, cost={"zero": 1, "recompute": "selective"},
                                    precision="transformer-engine"), "torchtitan")  # fmt: skip
    notes = "\n".join(launch.notes)
    assert "ZeRO 1: torchtitan shards data parallelism with FSDP2 only" in notes
    assert "recompute selective (attention)" in notes and "not simulated" in notes
    assert "FP8 with delayed scaling" in notes and 'recipe_name "tensorwise"' in notes
    assert len(launch.notes) == 3 and lp.uniform.zero == 1
    toml = tomllib.loads(launch.text)
    assert toml["model"]["converters"] == ["quantize.linear.float8"]
    assert toml["quantize"]["linear"]["float8"]["recipe_name"] == "tensorwise"
    assert toml["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}


def test_torchtitan_names_its_llama3_flavor_when_the_graph_is_one() -> None:
    """The [model] line from the graph: torchtitan's llama3 flavor at its sizes, else whose
    design it is (a Llama at other sizes) or what is not Llama 3 (GPT-2)."""
    graph = model_graph("llama3-8b", batch=4, **LLAMA)
    tiny = read_architecture(graph)
    flavor, line = llama3_fit(tiny)
    assert flavor is None and "has this design but no flavor of these sizes" in line
    for name, (layers, dim, heads, kv, ffn) in LLAMA3_FLAVORS.items():
        big = dataclasses.replace(tiny, layers=layers, hidden=dim, heads=heads, kv_heads=kv,
                                  head_dim=dim // heads, ffn=ffn, vocab=128256)  # fmt: skip
        assert llama3_fit(big)[0] == name
        assert llama3_fit(dataclasses.replace(big, tied=True))[0] is None
        assert llama3_fit(dataclasses.replace(big, vocab=32000))[0] is None
    launch = export_launcher(plan_of(graph), "torchtitan", simulate=False)
    assert f"# {line}\n" in launch.text and "model" not in tomllib.loads(launch.text)
    assert "--module MODEL --config CONFIG" in launch.text
    gpt = export_launcher(per_op(tensor=1), "torchtitan", simulate=False).text
    assert "# [model] is yours: torchtitan's llama3 is not this model (layer norms" in gpt
    assert "tied embeddings" in gpt and "learned positions" in gpt


@pytest.mark.slow
def test_llama_3_1_8b_exports_as_torchtitans_8b_and_megatrons_arguments() -> None:
    """Hugging Face's Llama-3.1-8B captured on meta (about 4 s): torchtitan's llama3 8B, and
    Megatron-LM's arguments of its sizes and design with nothing it cannot build."""
    pytest.importorskip("transformers")
    graph = model_graph("hf:meta-llama/Llama-3.1-8B", batch=4, seq=16)
    plan = plan_of(graph)
    titan = export_launcher(plan, "torchtitan", simulate=False)
    assert tomllib.loads(titan.text)["model"] == {"name": "llama3", "flavor": "8B"}
    assert "--module llama3 --config llama3_8b " in titan.text
    args = pairs(export_launcher(plan, "megatron", simulate=False).args)
    mlp = graph.op("model.layers.0.mlp.gate_proj").output.size("channel")
    assert args["--ffn-hidden-size"] == str(mlp) and args["--num-query-groups"] == "8"
    assert args["--padded-vocab-size"] == str(graph.op("model.embed_tokens").params[0].shape[0])
    assert "--swiglu" in args and "--untie-embeddings-and-output-weights" in args


def _torchtitan_version() -> str:
    torchtitan = pytest.importorskip("torchtitan")
    from importlib.metadata import version

    return getattr(torchtitan, "__version__", None) or version("torchtitan")


def test_torchtitans_own_parser_takes_the_export(tmp_path: Path) -> None:
    """torchtitan 0.2: its ConfigManager reads the TOML; 0.3: it reads the overrides on top
    of its llama3 debug config function."""
    release = _torchtitan_version()
    from torchtitan.config.manager import ConfigManager

    def parse(launch: Any) -> Any:
        if release.startswith("0.2"):
            path = tmp_path / "job.toml"
            launch.save(path)
            return ConfigManager().parse_args(["--job.config_file", str(path)])
        return ConfigManager().parse_args(
            ["--module", "llama3", "--config", "llama3_debugmodel", *launch.args]
        )

    config = parse(export_launcher(piped(stages=2, tensor=2, micro_batches=4), "torchtitan"))
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.tensor_parallel_degree) == (2, 2)
    assert par.data_parallel_shard_degree == 1
    assert par.pipeline_parallel_microbatch_size == 2
    assert par.module_fqns_per_model_part[1] == ["layers.2", "layers.3", "norm", "output"]
    assert config.training.local_batch_size == 8
    others = (per_op(tensor=2), per_op(tensor=1, cost={"recompute": 1, "zero": 3},
              precision="transformer-engine-cs"))  # fmt: skip
    configs = [parse(export_launcher(plan, "torchtitan", simulate=False)) for plan in others]
    assert configs[0].parallelism.fsdp_reshard_after_forward == "never"
    assert configs[1].parallelism.data_parallel_shard_degree == 4


def test_the_field_lists_are_the_installed_torchtitans() -> None:
    release = _torchtitan_version()
    if release.startswith("0.2"):
        from torchtitan.config import job_config as jc

        classes = {"training": jc.Training, "parallelism": jc.Parallelism,
                   "activation_checkpoint": jc.ActivationCheckpoint, "model": jc.Model,
                   "quantize.linear.float8": jc.Float8Linear}  # fmt: skip
        lists = TORCHTITAN_02_FIELDS
    else:
        from torchtitan.config import configs

        classes = {"training": configs.TrainingConfig, "parallelism": configs.ParallelismConfig}
        lists = TORCHTITAN_03_FIELDS
    for table, cls in classes.items():
        assert tuple(f.name for f in dataclasses.fields(cls)) == lists[table], table


# -- the FSDP2 / tensor-parallel script -------------------------------------------------------


def test_the_script_compiles_and_notes_what_it_has_no_part_for() -> None:
    for plan in (per_op(tensor=2), per_op(tensor=1, cost={"zero": 3, "recompute": "full"}),
                 piped(stages=2, tensor=2, micro_batches=4)):  # fmt: skip
        launch = export_launcher(plan, "fsdp")
        compile(launch.text, "launch.py", "exec")
    notes = "\n".join(launch.notes)
    assert "pipeline of 2 stages: the script has none" in notes
    assert launch.uniform.stages == 1 and launch.uniform.data == 2  # the stages as data
    dp = export_launcher(per_op(tensor=1, cost={"zero": 3, "recompute": "full"}), "fsdp")
    assert dp.notes == ()
    assert "CHECKPOINT = ['transformer.h.0', 'transformer.h.1']" in dp.text
    assert "ZERO = 3" in dp.text and "TENSOR_PLAN = {}" in dp.text
    tp = export_launcher(per_op(tensor=2), "fsdp")
    assert "'transformer.h.0.attn.c_attn': 'colwise'" in tp.text
    assert "'transformer.h.0.attn.c_proj': 'rowwise'" in tp.text
    assert "lm_head" not in tp.text.split("TENSOR_PLAN =")[1].split("\n")[0]  # tied weight


def _torchrun(script: Path, world: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={world}", str(script), "--steps", "2"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step")]


def _reference(script: Path) -> list[float]:
    """The script's own model and data, trained in this process (SGD, lr 0.1)."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("launch_script", script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    meta, meta_inputs = mod.build_model("meta")
    shape = tuple(meta(*meta_inputs).shape)
    torch.manual_seed(0)
    model, inputs = mod.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        xs, target = mod.batch(step, inputs, shape)
        loss = mod.loss_of(model(*xs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("tensor,cost", [(2, {}), (1, {"zero": 3, "recompute": "full"})])
def test_the_script_trains_at_world_2_as_one_process_does(
    tmp_path: Path, tensor: int, cost: dict[str, Any]
) -> None:
    plan = per_op(tensor=tensor, devices="cpu-local-2", batch=4, cost=cost)
    script = tmp_path / "launch.py"
    export_launcher(plan, "fsdp", simulate=False).save(script)
    got, want = _torchrun(script, 2), _reference(script)
    assert got == pytest.approx(want, rel=1e-5), (got, want)


# -- the command and the API ------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_writes_the_configuration_and_says_what_it_cannot_express(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(piped(stages=2, micro_batches=4, schedule="gpipe")))
    code, out, err = run(capsys, "export", "--to", "megatron", str(plan), "-o",
                         str(tmp_path / "m.args"))  # fmt: skip
    assert code == 0 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("cannot express: schedule gpipe") and len(lines) == 2
    assert lines[1].startswith("megatron: PP 2 x TP 1 x DP 2") and "written to" in lines[1]
    text = (tmp_path / "m.args").read_text()
    assert "--pipeline-model-parallel-size 2\n" in text
    code, out, err = run(capsys, "export", "--to", "torchtitan", str(plan))
    assert code == 0 and tomllib.loads(out)["parallelism"]["pipeline_parallel_schedule"] == "GPipe"
    assert err.startswith("cannot express: ZeRO 0: torchtitan's DDP") and err.count("\n") == 1
    code, out, _ = run(capsys, "export", "--to", "fsdp", str(plan), "--json", "--no-simulate")
    data = json.loads(out)
    assert code == 0 and data["to"] == "fsdp" and data["planned_seconds"] is None
    assert data["layout"].startswith("TP 1 x DP 4")


@pytest.mark.parametrize(
    "content,to,says",
    [
        ('{"a": 1}', "megatron", "is not a layerwise plan"),
        ('{"status": "OPTIMAL", "choices": [0, 1]}', "torchtitan", "is a cost-table plan"),
        ("not json", "fsdp", "is not valid JSON"),
        (None, "fsdp", "does not exist"),
        ('{"a": 1}', "deepspeed", "argument --to: invalid choice: 'deepspeed'"),
    ],
)
def test_bad_input_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, to: str, says: str
) -> None:
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    code, out, err = run(capsys, "export", "--to", to, str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def test_the_api_takes_a_plan_its_file_or_its_json(tmp_path: Path) -> None:
    result = planner.plan(
        "gpt2", "p100-1x2", model_kwargs={**GPT, "n_layer": 2}, example_inputs=None,
        time_limit=30, backend="elimination",
    )  # fmt: skip
    launch = planner.export_launcher(result, to="torchtitan")
    assert isinstance(launch, planner.Launch) and launch.uniform.world == 2
    path = tmp_path / "plan.json"
    result.save(path)
    again = planner.export_launcher(path, to="torchtitan")
    assert (again.args, again.notes) == (launch.args, launch.notes)
    with pytest.raises(ExportError, match="unknown launcher 'slurm'"):
        planner.export_launcher(path, to="slurm")
    with pytest.raises(LayerwiseError, match="expected a plan file"):
        planner.export_launcher(3, to="megatron")


def test_a_model_without_numbered_layers_goes_to_the_script_only() -> None:
    plan = megatron(model_graph("lenet5"), get_preset("p100-1x2"), 1).to_json(
        model={"name": "lenet5", "batch": None, "kwargs": {}, "coarsen": True},
        extra={"cost": {}},
    )
    for to, name in (("megatron", "Megatron-LM"), ("torchtitan", "torchtitan")):
        with pytest.raises(ExportError, match=f"{name} trains transformers of numbered layers"):
            export_launcher(plan, to)
    script = export_launcher(plan, "fsdp")
    compile(script.text, "lenet.py", "exec")
    assert "LOSS = 'probabilities'" in script.text and "BLOCKS = []" in script.text


def test_megatron_keeps_16_bit_weights_with_fp32_main_copies() -> None:
    launch = export_launcher(per_op(tensor=2, precision="bf16-mixed"), "megatron")
    (line,) = launch.notes
    assert line.startswith("precision bf16-mixed (fp32 weights, 16-bit matrix products)")
    assert "nearest bf16-true with master weights (simulated" in line
    assert launch.uniform.precision == "bf16-true" and launch.uniform.master_weights
    assert "--bf16" in launch.args
    assert launch.exported_seconds != launch.planned_seconds


@pytest.mark.parametrize("dtype,precision", [("bfloat16", "bf16-true"), ("float16", "16-true")])
def test_a_plan_of_a_16_bit_model_that_names_no_precision_trains_in_16_bits(
    dtype: str, precision: str
) -> None:
    """`--set dtype=bfloat16` without --precision: the graph's 2-byte floats are the
    precision (the spec's dtype tells float16 apart); Megatron-LM's --bf16 / --fp16 and
    torchtitan's bfloat16, not float32."""
    sizes = {**GPT, "n_layer": 2}
    graph = model_graph("gpt2", batch=4, dtype=dtype, **sizes)
    assert {p.dtype_bytes for op in graph.ops for p in op.params} == {2}
    plan = plan_of(graph, tensor=1, kwargs={**sizes, "dtype": dtype})
    assert read_plan(plan).uniform.precision == precision
    assert read_plan(per_op(tensor=1)).uniform.precision is None  # float32: the model's own
    megatron_launch = export_launcher(plan, "megatron")
    assert megatron_launch.notes == ()
    assert ("--bf16" if dtype == "bfloat16" else "--fp16") in megatron_launch.args
    training = tomllib.loads(export_launcher(plan, "torchtitan", simulate=False).text)["training"]
    assert training["mixed_precision_param"] == training["dtype"] == "bfloat16"


def test_fp32_master_copies_of_bf16_weights_are_megatrons_and_torchtitans_mixed_precision() -> None:
    """A bf16 graph planned with master weights: Megatron-LM's --bf16 is exactly that (no
    note); torchtitan and the FSDP2 script keep fp32 weights under bf16 compute instead, one
    simulated line each."""
    sizes = {**GPT, "n_layer": 2}
    graph = model_graph("gpt2", batch=4, dtype="bfloat16", **sizes)
    plan = plan_of(graph, tensor=1, kwargs={**sizes, "dtype": "bfloat16"},
                   cost={"master_weights": True})  # fmt: skip
    exact = export_launcher(plan, "megatron")
    assert exact.notes == () and "--bf16" in exact.args
    assert exact.exported_seconds == pytest.approx(exact.planned_seconds, rel=1e-12)
    for to, start in (("torchtitan", "bf16 weights with fp32 master copies: torchtitan"),
                      ("fsdp", "16-bit weights with fp32 master copies: the script")):  # fmt: skip
        launch = export_launcher(plan, to)
        (line,) = launch.notes
        assert line.startswith(start) and "nearest bf16-mixed" in line and "simulated" in line
        assert launch.uniform.precision == "bf16-mixed"
        assert launch.exported_seconds != launch.planned_seconds
    training = tomllib.loads(export_launcher(plan, "torchtitan").text)["training"]
    assert training["mixed_precision_param"] == "bfloat16" and "dtype" not in training
    assert "PRECISION = 'bf16-mixed'" in export_launcher(plan, "fsdp").text


def test_the_hidden_size_is_the_models_width_not_heads_times_head_dim() -> None:
    """Qwen3's heads x head_dim (4 x 32) is twice its width (64): --hidden-size is 64."""
    from planner.export.launchers.layout import model_facts
    from planner.graph.capture import capture
    from planner.graph.llm import build_llm

    module, inputs = build_llm(
        "qwen3-30b-a3b", batch=2, seq=16, n_layers=2, dim=64, n_heads=4, n_kv_heads=2,
        head_dim=32, hidden_dim=128, moe_hidden=32, n_experts=4, top_k=2, vocab_size=128,
    )  # fmt: skip
    facts = model_facts(capture(module, inputs, "tiny-qwen3"), None)
    assert (facts.hidden, facts.heads) == (64, 4)
