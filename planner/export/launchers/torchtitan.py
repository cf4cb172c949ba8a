"""A plan as torchtitan's job configuration: a TOML file, and torchtitan 0.3's overrides.

torchtitan 0.2 reads a TOML job config (`--job.config_file`: `[training]`, `[parallelism]`,
`[activation_checkpoint]`, `[model]`, `[quantize.linear.float8]`). torchtitan 0.3 reads none:
a job is a Python config function (`--module llama3 --config llama3_8b`) and command-line
overrides of its fields (`--parallelism.tensor_parallel_degree 2 ...`, the activation
checkpointing policy as the last word, `activation_checkpoint:full`). `torchtitan_config`
writes the TOML, with the 0.3 overrides of the same layout in its header; the `[training]`
and `[parallelism]` field names are the same in both.

| plan | torchtitan |
| --- | --- |
| data d, ZeRO 0 | `data_parallel_replicate_degree = d` (DDP, which torchtitan runs alone: beside other parallelism nearest ZeRO 2) |
| ZeRO 2 / 3 | `data_parallel_shard_degree = d` (FSDP2) with `fsdp_reshard_after_forward` "never" / "always"; ZeRO 1: none (nearest 2) |
| tensor t, context c, expert e, stages p | `tensor_parallel_degree` (with sequence parallelism, torchtitan's default), `context_parallel_degree`, `expert_parallel_degree`, `pipeline_parallel_degree` |
| schedule, micro-batches of b per replica | `pipeline_parallel_schedule` ("GPipe", "1F1B", "Interleaved1F1B"), `pipeline_parallel_microbatch_size = b` |
| blocks per chunk | `module_fqns_per_model_part`, in torchtitan's module names (`tok_embeddings`, `layers.i`, `norm`, `output`: its Llama 3 and DeepSeek-V3) |
| global batch B, sequence | `local_batch_size = B / d`, `global_batch_size = B`, `seq_len` |
| recompute none / full / selective / the first k blocks | `mode` "none" / "full" / "selective" with `selective_ac_option = "op"` (a policy of its own: not modelled) / `"n"`, every n-th layer (nearest) |
| precision bf16-mixed, 32-true, bf16-true | `mixed_precision_param` "bfloat16", "float32"; `dtype = "bfloat16"`; 16-bit float: none (nearest bf16) |
| transformer-engine(-cs) (FP8) | `converters = ["quantize.linear.float8"]` with `recipe_name = "tensorwise"` (current scaling; delayed: none), the output layer left out |
| 16-bit weights with fp32 master copies (a bf16 graph, cost option master_weights) | none: FSDP2's fp32 weights computing in bf16 (`mixed_precision_param`, nearest bf16-mixed) |
| the model | `[model] name = "llama3"`, `flavor` when the graph is torchtitan's Llama 3 of one of its flavors' sizes (`llama3_fit`), else one header line: the [model] section is yours |

Field names are checked against the lists below, taken from torchtitan's source
(tests/test_launchers.py; and against torchtitan itself where it is installed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from planner.errors import ExportError
from planner.export.launchers.architecture import Architecture
from planner.export.launchers.common import Change, changed, keeps_master_weights
from planner.export.launchers.layout import LaunchPlan, Uniform

__all__ = [
    "TORCHTITAN_02_FIELDS",
    "TORCHTITAN_03_CHECKPOINTING",
    "TORCHTITAN_03_FIELDS",
    "llama3_fit",
    "torchtitan_changes",
    "torchtitan_sections",
]

# torchtitan 0.2.2 (the last release that reads TOML), torchtitan/config/job_config.py:
# the fields of the dataclasses Training, Parallelism, ActivationCheckpoint, Model and
# Float8Linear (JobConfig.quantize.linear.float8).
TORCHTITAN_02_FIELDS: dict[str, tuple[str, ...]] = {
    "training": (
        "dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len",
        "max_norm", "steps", "enable_cpu_offload", "dtype", "mixed_precision_param",
        "mixed_precision_reduce", "gc_freq", "gc_debug", "dataloader",
    ),
    "parallelism": (
        "data_parallel_replicate_degree", "data_parallel_shard_degree",
        "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel",
        "enable_async_tensor_parallel", "pipeline_parallel_degree", "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
        "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
        "pipeline_parallel_expert_parallel_overlap", "context_parallel_degree",
        "context_parallel_load_balancer", "context_parallel_rotate_method",
        "expert_parallel_degree", "expert_tensor_parallel_degree", "expert_parallel_comm_backend",
    ),
    "activation_checkpoint": (
        "mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop", "memory_budget", "visualize_memory_budget_pareto", "preserve_rng_state",
        "determinism_check", "debug",
    ),
    "model": (
        "name", "flavor", "hf_assets_path", "tokenizer_path", "converters",
        "print_after_conversion",
    ),
    "quantize.linear.float8": (
        "enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp",
        "recipe_name", "filter_fqns", "emulate",
    ),
}  # fmt: skip

# torchtitan 0.3.0, torchtitan/config/configs.py: the fields of TrainingConfig and
# ParallelismConfig (Trainer.Config.training and .parallelism).
TORCHTITAN_03_FIELDS: dict[str, tuple[str, ...]] = {
    "training": (
        "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
        "enable_cpu_offload", "disable_cuda_graphs", "dtype", "mixed_precision_param",
        "mixed_precision_reduce", "gc_freq", "gc_debug",
    ),
    "parallelism": (
        "data_parallel_replicate_degree", "data_parallel_shard_degree",
        "fsdp_reshard_after_forward", "enable_fsdp_symm_mem", "tensor_parallel_degree",
        "enable_sequence_parallel", "spmd_backend", "pipeline_parallel_degree",
        "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
        "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
        "pipeline_parallel_microbatch_size", "context_parallel_degree",
        "context_parallel_load_balancer", "context_parallel_ptrr_mask_key",
        "expert_parallel_degree",
    ),
}  # fmt: skip
# torchtitan 0.3.0, torchtitan/distributed/activation_checkpoint.py: the subcommands of
# ActivationCheckpointingConfig (Trainer.Config.activation_checkpoint).
TORCHTITAN_03_CHECKPOINTING = ("selective", "full", "memory-budget", "none")

# torchtitan's Llama 3 flavors (torchtitan/models/llama3/__init__.py, `llama3_configs`; a TOML
# names one `[model] name = "llama3"`, `flavor = "8B"` as train_configs/llama3_8b.toml does;
# 0.3's config functions are llama3_8b, llama3_70b, llama3_405b): layers, width,
# heads, key-value heads and the MLP's width compute_ffn_hidden_dim(dim, multiple_of,
# ffn_dim_multiplier) = (4096, 1024, 1.3) -> 14336, (8192, 4096, 1.3) -> 28672, (16384, 4096,
# 1.2) -> 53248; every flavor RMSNorm (eps 1e-5), SwiGLU, rotary embeddings of base 500000
# with Llama 3.1's scaling, untied, no biases, Llama 3's vocabulary of 128256.
LLAMA3_FLAVORS = {
    "8B": (32, 4096, 32, 8, 14336),
    "70B": (80, 8192, 64, 8, 28672),
    "405B": (126, 16384, 128, 8, 53248),
}
LLAMA3_VOCAB = 128256

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
FP8 = ("transformer-engine", "transformer-engine-cs")


def torchtitan_changes(lp: LaunchPlan) -> tuple[Uniform, list[Change]]:
    """The layout torchtitan runs of the plan's nearest uniform layout, and what it changes."""
    if lp.model.layers == 0:
        raise ExportError(
            f"torchtitan trains transformers of numbered layers ('layers.3'): {lp.model.name!r} "
            "has none (`--to fsdp` writes a script for any model)"
        )
    u, changes = lp.uniform, []
    alone = u.world == u.data  # torchtitan's DDP runs with no other parallelism
    if u.data > 1 and (u.zero == 1 or (u.zero == 0 and not alone)):
        why = (
            "torchtitan shards data parallelism with FSDP2 only"
            if u.zero == 1
            else "torchtitan's DDP runs with no other parallelism"
        )
        u = changed(u, zero=2)
        changes.append(
            Change(f"ZeRO {lp.uniform.zero}: {why}", "ZeRO 2 (fsdp_reshard_after_forward never)", u)
        )
    if u.context > 1 and u.zero < 3:
        u = changed(u, zero=3)
        changes.append(
            Change(
                f"ZeRO {lp.uniform.zero} with context parallelism: torchtitan shards the "
                "weights over the context ranks with FSDP2",
                "ZeRO 3",
                u,
            )
        )
    layers = lp.model.layers
    if u.recompute == "selective":
        changes.append(
            Change(
                "recompute selective (attention): torchtitan's selective policy saves the "
                "matmuls (recomputing every second one) and recomputes the other ops",
                'mode "selective", selective_ac_option "op"',
            )
        )
    elif isinstance(u.recompute, int) and 0 < u.recompute < layers:  # k >= L: "full"
        every = max(1, round(layers / u.recompute))
        u = changed(u, recompute=layers // every)
        changes.append(
            Change(
                f"recompute the first {lp.uniform.recompute} blocks: torchtitan checkpoints "
                "every n-th layer",
                f'selective_ac_option "{every}" ({layers // every} blocks)',
                u,
            )
        )
    if u.precision in ("16-mixed", "16-true", "64-true"):
        near = "bf16-mixed" if u.precision == "16-mixed" else "bf16-true"
        near = "32-true" if u.precision == "64-true" else near
        u = changed(u, precision=near)
        changes.append(
            Change(
                f"precision {lp.uniform.precision}: torchtitan trains in bfloat16 or float32",
                near,
                u,
            )
        )
    if u.precision == "bf16-true" and keeps_master_weights(lp, u):
        u = changed(u, precision="bf16-mixed", master_weights=False)
        changes.append(
            Change(
                "bf16 weights with fp32 master copies: torchtitan keeps FSDP2's weights in "
                "fp32 and computes in bfloat16 (mixed_precision_param)",
                "bf16-mixed",
                u,
            )
        )
    if u.precision == "transformer-engine":
        u = changed(u, precision="transformer-engine-cs")
        changes.append(
            Change(
                "FP8 with delayed scaling: torchtitan's float8 scales by the current amax",
                'recipe_name "tensorwise"',
                u,
            )
        )
    return u, changes


def torchtitan_sections(lp: LaunchPlan, u: Uniform) -> dict[str, dict[str, Any]]:
    """The job config of layout `u`: section -> field -> value (torchtitan 0.2's TOML)."""
    batch = lp.model.global_batch
    training: dict[str, Any] = {"local_batch_size": batch // u.data, "global_batch_size": batch}
    if lp.model.seq:
        training["seq_len"] = lp.model.seq
    if u.precision in ("bf16-true",):
        training["dtype"] = "bfloat16"
    training["mixed_precision_param"] = (
        "float32" if u.precision in (None, "32-true", "64-true") else "bfloat16"
    )
    par: dict[str, Any] = {}
    if u.zero >= 2:
        par |= {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": u.data,
                "fsdp_reshard_after_forward": "always" if u.zero == 3 else "never"}  # fmt: skip
    else:
        par |= {"data_parallel_replicate_degree": u.data, "data_parallel_shard_degree": 1}
    par |= {
        "tensor_parallel_degree": u.tensor,
        "context_parallel_degree": u.context,
        "expert_parallel_degree": u.expert,
        "pipeline_parallel_degree": u.stages,
    }
    if u.stages > 1:
        par["pipeline_parallel_schedule"] = SCHEDULES[u.schedule]
        par["pipeline_parallel_microbatch_size"] = batch // (u.data * u.micro_batches)
        par["module_fqns_per_model_part"] = module_fqns(u.blocks)
    sections: dict[str, dict[str, Any]] = {"training": training, "parallelism": par}
    sections["activation_checkpoint"] = _checkpointing(u.recompute, lp.model.layers)
    flavor = llama3_fit(lp.architecture)[0]
    if flavor:
        sections["model"] = {"name": "llama3", "flavor": flavor}
    if u.precision in FP8:
        sections.setdefault("model", {})["converters"] = ["quantize.linear.float8"]
        sections["quantize.linear.float8"] = {"recipe_name": "tensorwise",
                                              "filter_fqns": ["output"]}  # fmt: skip
    return sections


def llama3_fit(a: Architecture) -> tuple[str | None, str]:
    """(torchtitan's Llama 3 flavor of architecture `a` or None, one line on its [model]):
    a flavor when the graph is Llama 3's design (RMSNorm, SwiGLU, rotary embeddings, untied,
    no biases; `LLAMA3_FLAVORS`) at one flavor's sizes and vocabulary."""
    unlike = _unlike_llama3(a)
    if unlike:
        return None, f"[model] is yours: torchtitan's llama3 is not this model ({unlike})"
    sizes = (a.layers, a.hidden, a.heads, a.kv_heads, a.ffn)
    flavor = next((f for f, s in LLAMA3_FLAVORS.items() if s == sizes), None)
    if flavor is None or a.vocab != LLAMA3_VOCAB:
        return None, (
            "[model] is yours: torchtitan's llama3 has this design but no flavor of these "
            f"sizes ({a.layers} layers of {a.hidden}, {a.heads} heads, {a.kv_heads} key-value "
            f"heads, MLP {a.ffn}, vocabulary {a.vocab})"
        )
    return flavor, (
        f'[model] name "llama3", flavor "{flavor}" (0.3: --module llama3 --config '
        f"llama3_{flavor.lower()}) has this model's design and sizes; its rotary base and "
        'scaling are Llama 3.1\'s (500000, "llama")'
    )


def _unlike_llama3(a: Architecture) -> str:
    """What of `a` is not torchtitan's Llama 3 ("" when nothing is)."""
    out = [] if a.norm == "rms" else [f"{a.norm} norms"]
    if a.norm_eps is not None and not math.isclose(a.norm_eps, 1e-5):
        out.append(f"norm epsilon {a.norm_eps:g}")
    checks = (
        ("norms of offset + weight", bool(a.norm_offset)),
        ("norms after attention and MLP", a.post_norms),
        ("no final norm", not a.final_norm),
        ("experts", a.moe is not None),
        (f"{'a gated' if a.gated else 'an'} MLP of {a.activation}",
         a.moe is None and not (a.gated and a.activation == "silu")),
        (f"{a.position} positions", a.position != "rope"),
        ("partial rotary embeddings", a.rope_dim is not None and not a.mla),
        ("MLA", a.mla),
        ("biases", a.bias != "none" or a.head_bias),
        ("tied embeddings", a.tied),
        ("QK-norm", a.qk_norm is not None),
        ("sliding windows", any(a.windows)),
        ("soft caps", bool(a.softcap) or "tanh" in a.logit_ops),
        ("another attention scale", a.scale is not None),
        ("heads not of the width", not a.mla and (a.heads is None or a.head_dim is None
         or a.head_dim * a.heads != a.hidden)),
        ("scaled embeddings", bool(a.embedding_ops)),
        ("layers unlike each other", bool(a.mixed)),
        ("dropout", a.dropout),
    )  # fmt: skip
    return ", ".join(out + [name for name, differs in checks if differs])


def module_fqns(blocks: tuple[int, ...]) -> list[list[str]]:
    """Each chunk's modules in torchtitan's names: the embedding first, `layers.i`, the final
    norm and output last."""
    out, at = [], 0
    for c, k in enumerate(blocks):
        names = ["tok_embeddings"] if c == 0 else []
        names += [f"layers.{i}" for i in range(at, at + k)]
        at += k
        if c == len(blocks) - 1:
            names += ["norm", "output"]
        out.append(names)
    return out


def _checkpointing(recompute: str | int, layers: int) -> dict[str, Any]:
    if recompute in ("none", 0):
        return {"mode": "none"}
    if recompute == "full" or (isinstance(recompute, int) and recompute >= layers):
        return {"mode": "full"}
    if recompute == "selective":
        return {"mode": "selective", "selective_ac_option": "op"}
    every = max(1, round(layers / int(recompute)))
    return {"mode": "selective", "selective_ac_option": str(every)}


def overrides_03(sections: Mapping[str, Mapping[str, Any]], u: Uniform) -> list[str]:
    """torchtitan 0.3's command-line overrides of the same fields (its `[training]` and
    `[parallelism]`; the activation checkpointing policy last). 0.3 captures CUDA graphs by
    default and refuses them with pipelines and with expert parallelism's dispatchers:
    `--training.disable_cuda_graphs` there."""
    out = []
    if u.stages > 1 or u.expert > 1:
        out.append("--training.disable_cuda_graphs")
    for section in ("training", "parallelism"):
        for key, value in sections[section].items():
            if key not in TORCHTITAN_03_FIELDS[section]:
                continue
            out.append(f"--{section}.{key}")
            if isinstance(value, list):
                out += [",".join(chunk) for chunk in value]
            else:
                out.append(str(value))
    mode = sections["activation_checkpoint"]["mode"]
    out.append(f"activation_checkpoint:{mode}")
    return out


def render(
    lp: LaunchPlan, u: Uniform, notes: tuple[str, ...], simulated: str
) -> tuple[str, list[str]]:
    """The TOML file (header: the plan, torchtitan 0.3's overrides, what is not expressed)
    and the 0.3 overrides as a list."""
    sections = torchtitan_sections(lp, u)
    args = overrides_03(sections, u)
    ac = sections["activation_checkpoint"]
    flavor, model_line = llama3_fit(lp.architecture)
    module = f"llama3 --config llama3_{flavor.lower()}" if flavor else "MODEL --config CONFIG"
    lines = [
        f"# torchtitan job config for {lp.model.name} on {u.world} GPUs: {u.describe()}",
        f"# (planned by layerwise from {lp.name}). torchtitan 0.2 reads this file",
        "# (--job.config_file); add your data and optimizer.",
        f"# {model_line}",
        f"# {simulated}",
        "# torchtitan 0.3 reads no TOML: run its config function with these overrides",
        f"#   --module {module} {' '.join(args)}",
    ]
    if ac.get("selective_ac_option", "op") != "op":
        lines.append("#   (0.3 has no layer-frequency checkpointing: selective there is per op)")
    if u.precision in FP8:
        lines.append("#   (0.3 sets float8 in the config function: Float8LinearConverter, rowwise)")
    if u.stages > 1:
        lines.append("# module_fqns_per_model_part names torchtitan's own modules (Llama 3).")
    lines += [f"# cannot express: {note}" for note in notes]
    for section, values in sections.items():
        lines.append(f"\n[{section}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n", args


def _toml(value: Any) -> str:
    """A TOML value: an integer, a string (JSON's escapes are TOML's), a list."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))
