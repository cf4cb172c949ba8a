"""A plan as Megatron-LM's arguments (`pretrain_gpt.py`'s command line).

The layout (`planner.export.launchers.layout.Uniform`) maps onto Megatron-LM's own names:

| plan | Megatron-LM |
| --- | --- |
| stages p, tensor t, context c | `--pipeline-model-parallel-size`, `--tensor-model-parallel-size`, `--context-parallel-size` (data parallelism is what is left) |
| norms, dropout and residuals split by sequence inside a tensor group (the rule's) | `--sequence-parallel` (t > 1) |
| expert parallelism e (experts spread, not tensor-split) | `--expert-model-parallel-size e --expert-tensor-parallel-size 1` |
| v chunks per stage, equally many blocks | `--num-layers-per-virtual-pipeline-stage` |
| blocks per chunk not all equal (or a chunk of the head alone) | `--pipeline-model-parallel-layout` ("Ettt\\|ttt\\|ttL": E the embedding, t a layer, L the loss; chunks in order) |
| schedule 1f1b, interleaved (v > 1) | Megatron-LM's own (no flag); gpipe: none (nearest 1f1b) |
| micro-batches m of b samples per replica, global batch B | `--micro-batch-size b --global-batch-size B` (Megatron-LM runs B / (b d) = m) |
| recompute selective / full / the first k blocks | `--recompute-granularity selective` (core attention) / `full --recompute-method uniform --recompute-num-layers 1` / `full --recompute-method block --recompute-num-layers k` (k per stage in Megatron-LM: one stage only) |
| ZeRO 1 / 2 / 3 | `--use-distributed-optimizer` / `--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads` / `... optim_grads_params` (with `--ckpt-format fsdp_dtensor`, which Megatron-FSDP requires) |
| precision bf16-true / 16-true / transformer-engine(-cs) | `--bf16` / `--fp16` / `--bf16 --fp8-format hybrid --fp8-recipe delayed` (`tensorwise` for current scaling); the "mixed" precisions (fp32 weights under autocast): nearest the "true" ones with fp32 master weights, Megatron-LM's |
| the model | `--num-layers --hidden-size --num-attention-heads` (`--group-query-attention --num-query-groups`), `--seq-length --max-position-embeddings`, `--num-experts --moe-router-topk`: check them against your model; tokenizer, data and optimizer are yours |

Every name is checked against `MEGATRON_ARGUMENTS`, taken from Megatron-LM's
`megatron/training/arguments.py` (tests/test_launchers.py).
"""

from __future__ import annotations

from planner.errors import ExportError
from planner.export.launchers.common import Change, changed
from planner.export.launchers.layout import LaunchPlan, Uniform
from planner.export.launchers.megatron_model import model_args, model_differences, not_in_graph

__all__ = ["MEGATRON_ARGUMENTS", "megatron_args", "megatron_changes"]

# Megatron-LM's argument names, with their destination and type or choices, as
# megatron/training/arguments.py defines them (NVIDIA/Megatron-LM at commit
# 000c4ac24f61159c138b0975def722c65245983c, the megatron-core 0.14-0.16 era: the
# `_add_distributed_args`, `_add_training_args`, `_add_mixed_precision_args`,
# `_add_transformer_engine_args`, `_add_moe_args`, `_add_network_size_args`,
# `_add_data_args`, `_add_checkpointing_args`, `_add_regularization_args`,
# `_add_tokenizer_args`, `_add_mla_args` and, for --qk-layernorm, `_add_vision_args` groups).
# "flag": store_true; "off": store_false; "int,int": its `tuple_type` ("4095,0"); "pattern":
# its `moe_freq_type` (an integer, or a list expression such as "([0]*3+[1]*58)").
MEGATRON_ARGUMENTS: dict[str, tuple[str, object]] = {
    "--tensor-model-parallel-size": ("tensor_model_parallel_size", int),
    "--pipeline-model-parallel-size": ("pipeline_model_parallel_size", int),
    "--num-layers-per-virtual-pipeline-stage": ("num_layers_per_virtual_pipeline_stage", int),
    "--num-virtual-stages-per-pipeline-rank": ("num_virtual_stages_per_pipeline_rank", int),
    "--pipeline-model-parallel-layout": ("pipeline_model_parallel_layout", str),
    "--context-parallel-size": ("context_parallel_size", int),
    "--sequence-parallel": ("sequence_parallel", "flag"),
    "--expert-model-parallel-size": ("expert_model_parallel_size", int),
    "--expert-tensor-parallel-size": ("expert_tensor_parallel_size", int),
    "--num-experts": ("num_experts", int),
    "--moe-router-topk": ("moe_router_topk", int),
    "--recompute-granularity": ("recompute_granularity", ("full", "selective")),
    "--recompute-method": ("recompute_method", ("uniform", "block")),
    "--recompute-num-layers": ("recompute_num_layers", int),
    "--use-distributed-optimizer": ("use_distributed_optimizer", "flag"),
    "--use-megatron-fsdp": ("use_megatron_fsdp", "flag"),
    "--data-parallel-sharding-strategy": (
        "data_parallel_sharding_strategy",
        ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    ),
    "--ckpt-format": ("ckpt_format", ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")),
    "--micro-batch-size": ("micro_batch_size", int),
    "--global-batch-size": ("global_batch_size", int),
    "--seq-length": ("seq_length", int),
    "--max-position-embeddings": ("max_position_embeddings", int),
    "--num-layers": ("num_layers", int),
    "--hidden-size": ("hidden_size", int),
    "--num-attention-heads": ("num_attention_heads", int),
    "--group-query-attention": ("group_query_attention", "flag"),
    "--num-query-groups": ("num_query_groups", int),
    "--bf16": ("bf16", "flag"),
    "--fp16": ("fp16", "flag"),
    "--fp8-format": ("fp8", ("e4m3", "hybrid")),
    "--fp8-recipe": ("fp8_recipe", ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")),
    "--ffn-hidden-size": ("ffn_hidden_size", int),
    "--kv-channels": ("kv_channels", int),
    "--swiglu": ("swiglu", "flag"),
    "--normalization": ("normalization", ("LayerNorm", "RMSNorm")),
    "--norm-epsilon": ("norm_epsilon", float),
    "--apply-layernorm-1p": ("apply_layernorm_1p", "flag"),
    "--position-embedding-type": (
        "position_embedding_type",
        ("learned_absolute", "rope", "mrope", "relative", "none"),
    ),
    "--rotary-percent": ("rotary_percent", float),
    "--rotary-interleaved": ("rotary_interleaved", "flag"),
    "--untie-embeddings-and-output-weights": ("untie_embeddings_and_output_weights", "flag"),
    "--padded-vocab-size": ("padded_vocab_size", int),
    "--disable-bias-linear": ("add_bias_linear", "off"),
    "--add-qkv-bias": ("add_qkv_bias", "flag"),
    "--qk-layernorm": ("qk_layernorm", "flag"),
    "--window-size": ("window_size", "int,int"),
    "--window-attn-skip-freq": ("window_attn_skip_freq", "pattern"),
    "--hidden-dropout": ("hidden_dropout", float),
    "--multi-latent-attention": ("multi_latent_attention", "flag"),
    "--q-lora-rank": ("q_lora_rank", int),
    "--kv-lora-rank": ("kv_lora_rank", int),
    "--qk-head-dim": ("qk_head_dim", int),
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", int),
    "--v-head-dim": ("v_head_dim", int),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", int),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", int),
    "--moe-layer-freq": ("moe_layer_freq", "pattern"),
    "--moe-router-score-function": ("moe_router_score_function", ("softmax", "sigmoid")),
    "--moe-router-pre-softmax": ("moe_router_pre_softmax", "flag"),
    "--moe-router-num-groups": ("moe_router_num_groups", int),
    "--moe-router-group-topk": ("moe_router_group_topk", int),
    "--moe-router-topk-scaling-factor": ("moe_router_topk_scaling_factor", float),
    "--moe-router-enable-expert-bias": ("moe_router_enable_expert_bias", "flag"),
    "--moe-router-dtype": ("moe_router_dtype", ("fp32", "fp64")),
}

_SHARDING = {2: "optim_grads", 3: "optim_grads_params"}
_FP8_RECIPE = {"transformer-engine": "delayed", "transformer-engine-cs": "tensorwise"}


def megatron_changes(lp: LaunchPlan) -> tuple[Uniform, list[Change]]:
    """The layout Megatron-LM runs of the plan's nearest uniform layout, and what it
    changes."""
    if lp.model.layers == 0:
        raise ExportError(
            f"Megatron-LM trains transformers of numbered layers ('layers.3'): {lp.model.name!r} "
            "has none (`--to fsdp` writes a script for any model)"
        )
    u, changes = lp.uniform, []
    if u.stages > 1 and u.schedule == "gpipe":
        u = changed(u, schedule="1f1b")
        changes.append(Change("schedule gpipe: Megatron-LM runs 1F1B or interleaved", "1f1b", u))
    if isinstance(u.recompute, int) and u.stages > 1 and 0 < u.recompute < lp.model.layers:
        per = -(-u.recompute // u.stages)
        changes.append(
            Change(
                f"recompute the first {u.recompute} blocks: Megatron-LM's --recompute-method "
                f"block recomputes as many layers on every stage",
                f"{per} per stage ({per * u.stages} blocks)",
            )
        )
    if u.precision in ("bf16-mixed", "16-mixed"):
        near = "bf16-true" if u.precision == "bf16-mixed" else "16-true"
        u = changed(u, precision=near, master_weights=True)
        changes.append(
            Change(
                f"precision {lp.uniform.precision} (fp32 weights, 16-bit matrix products): "
                f"Megatron-LM's {'--bf16' if near == 'bf16-true' else '--fp16'} keeps 16-bit "
                "weights with fp32 main copies in its optimizer",
                f"{near} with master weights",
                u,
            )
        )
    if u.precision == "64-true":
        u = changed(u, precision="32-true")
        changes.append(Change("precision 64-true: Megatron-LM trains in fp32, bf16 or fp16",
                              "32-true", u))  # fmt: skip
    differ = model_differences(lp.architecture, u.tensor)
    if differ:
        changes.append(
            Change(
                "model parts Megatron-LM's GPT has no arguments for: " + "; ".join(differ),
                "the model its arguments build",
            )
        )
    return u, changes


def megatron_args(lp: LaunchPlan, u: Uniform) -> list[str]:
    """Megatron-LM's arguments for layout `u` of the plan's model, as tokens."""
    m = lp.model
    args = [
        "--tensor-model-parallel-size", str(u.tensor),
        "--pipeline-model-parallel-size", str(u.stages),
        "--context-parallel-size", str(u.context),
    ]  # fmt: skip
    if u.tensor > 1:
        args.append("--sequence-parallel")
    if m.experts:
        args += ["--expert-model-parallel-size", str(u.expert)]
        args += ["--expert-tensor-parallel-size", "1"]
    args += _pipeline_args(u)
    micro = m.global_batch // (u.data * u.micro_batches)
    args += ["--micro-batch-size", str(micro), "--global-batch-size", str(m.global_batch)]
    args += _recompute_args(u)
    if u.zero == 1:
        args.append("--use-distributed-optimizer")
    elif u.zero in _SHARDING:
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", _SHARDING[u.zero]]
        args += ["--ckpt-format", "fsdp_dtensor"]
    args += _precision_args(u.precision)
    return args + model_args(m, lp.architecture, u.tensor)


def _pipeline_args(u: Uniform) -> list[str]:
    """Virtual stages, or the layout string when the chunks' blocks are not all equal."""
    if u.stages == 1:
        return []
    blocks = u.blocks
    if len(set(blocks)) == 1 and blocks[0] > 0:
        return ["--num-layers-per-virtual-pipeline-stage", str(blocks[0])] if u.virtual > 1 else []
    chunks = ["t" * k for k in blocks]  # no "t*k": the shell would glob a star
    chunks[0] = "E" + chunks[0]
    chunks[-1] += "L"
    return ["--pipeline-model-parallel-layout", "|".join(chunks)]


def _recompute_args(u: Uniform) -> list[str]:
    if u.recompute == "selective":
        return ["--recompute-granularity", "selective"]
    if u.recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform",
                "--recompute-num-layers", "1"]  # fmt: skip
    if isinstance(u.recompute, int) and u.recompute > 0:
        per = -(-u.recompute // u.stages)
        return ["--recompute-granularity", "full", "--recompute-method", "block",
                "--recompute-num-layers", str(per)]  # fmt: skip
    return []


def _precision_args(precision: str | None) -> list[str]:
    if precision in ("bf16-mixed", "bf16-true"):
        return ["--bf16"]
    if precision in ("16-mixed", "16-true"):
        return ["--fp16"]
    if precision in _FP8_RECIPE:
        return ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", _FP8_RECIPE[precision]]
    return []


def render(
    lp: LaunchPlan, u: Uniform, notes: tuple[str, ...], simulated: str
) -> tuple[str, list[str]]:
    """The argument file: comment lines (the plan, what is not expressed), then one argument
    (with its value) per line, for `$(grep -v '^#' FILE)`."""
    args = megatron_args(lp, u)
    lines = [
        f"# Megatron-LM arguments for {lp.model.name} on {u.world} GPUs: {u.describe()}",
        "# (planned by layerwise from " + lp.name + "; pass with $(grep -v '^#' THIS_FILE),",
        "#  with your tokenizer, data and optimizer arguments)",
        f"# {simulated}",
    ]
    unknown = not_in_graph(lp.architecture)
    if unknown:
        lines.append(f"# not in the plan's graph: {' and '.join(unknown)} (add your model's)")
    lines += [f"# cannot express: {note}" for note in notes]
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"{args[i]} {args[i + 1]}")
            i += 2
        else:
            lines.append(args[i])
            i += 1
    return "\n".join(lines) + "\n", args
