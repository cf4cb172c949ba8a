"""A plan as a plain PyTorch script: FSDP2 (`fully_shard`) over data, DTensor tensor
parallelism (`parallelize_module` with `ColwiseParallel` / `RowwiseParallel` on the named
linears and embeddings) inside each tensor group, run with `torchrun`.

The script lays out the plan's uniform degrees on a (data, tensor) `DeviceMesh` in
Megatron-LM's rank order (tensor innermost): each linear or embedding the rule
(`planner.problems.baselines.megatron`) splits by output channels is `ColwiseParallel`, each
whose sum it splits `RowwiseParallel`; module outputs stay DTensors (`use_local_output=
False`) and the ops without parameters run in the layouts DTensor propagates (on CPUs,
where DTensor has no rule for the attention kernel, attention runs every head on every rank
of the group: `CpuAttention`); the other modules with parameters are replicated over the
tensor group (`distribute_module`).
Modules that share a weight (a tied embedding and head) stay replicated. Then the blocks
that recompute are wrapped in `checkpoint_wrapper` (full recomputation: "full", or the first
k blocks), and data parallelism is FSDP2 over the data dim: `fully_shard` per block and on the
root, `reshard_after_forward=True` for ZeRO 3, False for ZeRO 2; ZeRO 0 without tensor
parallelism is `replicate` (DDP). Precision: "bf16-mixed" / "16-mixed" run the forward under
`torch.autocast` (the project's definition of them), the "true" precisions convert the model.

It has no pipeline stages, no context or expert parallelism, no FP8 and no ZeRO 1: each is a
note with the nearest layout (stages folded into data parallelism, CP and EP 1, bf16, ZeRO 2).
The model is the plan's (`graph.model`): a zoo model through `planner.graph.zoo.build_model`,
a factory model through its import path; the data are random tokens or images of the
example inputs' shapes with random targets, for you to replace.
"""

from __future__ import annotations

from typing import Any

from planner.export.launchers.common import Change, changed, keeps_master_weights
from planner.export.launchers.layout import LaunchPlan, Uniform
from planner.graph.opkinds import CHANNEL

__all__ = ["fsdp_changes", "render", "tensor_plan"]


def fsdp_changes(lp: LaunchPlan) -> tuple[Uniform, list[Change]]:
    """The layout the script runs of the plan's nearest uniform layout, and what it changes."""
    u, changes = lp.uniform, []
    if u.stages > 1:
        u = changed(u, data=u.data * u.stages, stages=1, virtual=1, micro_batches=1,
                    schedule="1f1b", blocks=(lp.model.layers,))  # fmt: skip
        changes.append(Change(f"pipeline of {lp.uniform.stages} stages: the script has none "
                              "(planner.parallelize_pipeline runs torch's pipelining)",
                              f"{u.degrees()} (the stages' ranks as data parallelism)", u))  # fmt: skip
    if u.context > 1:
        u = changed(u, data=u.data * u.context, context=1)
        changes.append(Change(f"context parallelism {lp.uniform.context}: the script has none",
                              u.degrees(), u))  # fmt: skip
    if u.expert > 1:
        u = changed(u, expert=1)
        changes.append(Change(f"expert parallelism {lp.uniform.expert}: the script has none",
                              "EP 1 (every rank holds every expert)", u))  # fmt: skip
    if u.zero == 1 or (u.zero == 0 and u.tensor > 1 and u.data > 1):
        why = (
            "FSDP2 shards the weights and gradients too"
            if u.zero == 1
            else "data parallelism over DTensor weights is FSDP2 in the script"
        )
        u = changed(u, zero=2)
        changes.append(Change(f"ZeRO {lp.uniform.zero}: {why}",
                              "ZeRO 2 (reshard_after_forward=False)", u))  # fmt: skip
    if u.recompute == "selective":
        u = changed(u, recompute="full")
        changes.append(Change("recompute selective (attention): the script checkpoints whole "
                              "blocks", "full", u))  # fmt: skip
    if u.precision in ("transformer-engine", "transformer-engine-cs"):
        u = changed(u, precision="bf16-true")
        changes.append(Change("FP8 linears: the script has none (torchao's float8 converts "
                              "them)", "bf16-true", u))  # fmt: skip
    if u.precision in ("bf16-true", "16-true") and keeps_master_weights(lp, u):
        near = "bf16-mixed" if u.precision == "bf16-true" else "16-mixed"
        u = changed(u, precision=near, master_weights=False)
        changes.append(Change("16-bit weights with fp32 master copies: the script's optimizer "
                              "steps the weights it converts", f"{near} (autocast over fp32 "
                              "weights)", u))  # fmt: skip
    plan, tied = tensor_plan(lp, u)
    if u.tensor > 1:
        changes.append(
            Change(
                "ops without parameters (attention, norms' statistics, residuals): the script "
                "runs them in the layouts DTensor propagates (on CPUs attention runs every head "
                "on every rank of the tensor group)"
                + (
                    f"; modules sharing a weight ({', '.join(tied[:2])}) replicated" if tied else ""
                ),
                "as the rule lays out the linears",
            )
        )
    return u, changes


def tensor_plan(lp: LaunchPlan, u: Uniform) -> tuple[dict[str, str], list[str]]:
    """Module path -> "colwise" / "rowwise" of the linears and embeddings the rule splits
    (none without tensor parallelism), and the modules left out for sharing a weight."""
    if u.tensor == 1:
        return {}, []
    strategy, _ = lp.rule(u)
    styles: dict[str, str] = {}
    users: dict[str, set[str]] = {}
    for op, cfg in zip(strategy.graph.ops, strategy.configs, strict=True):
        if op.kind not in ("linear", "embedding"):
            continue
        for p in op.params:
            users.setdefault(p.name, set()).add(op.name)
        if cfg.reduce > 1:
            styles[op.name] = "rowwise"
        elif cfg.degree(op, CHANNEL) > 1:
            styles[op.name] = "colwise"
    tied = sorted({m for names in users.values() if len(names) > 1 for m in names})
    return {m: s for m, s in styles.items() if m not in tied}, tied


def render(
    lp: LaunchPlan, u: Uniform, notes: tuple[str, ...], simulated: str
) -> tuple[str, list[str]]:
    """The script's text (and no arguments)."""
    plan, _ = tensor_plan(lp, u)
    blocks = list(lp.model.blocks)
    recompute = u.recompute
    checkpointed = (
        blocks
        if recompute == "full"
        else blocks[: int(recompute)]
        if isinstance(recompute, int)
        else []
    )
    optimizer = str(lp.cost.get("optimizer") or "sgd")
    header = "\n".join(
        [
            f"FSDP2 + tensor parallelism for {lp.model.name} on {u.world} ranks: {u.describe()}.",
            f"Planned by layerwise from {lp.name}. Run: torchrun --nproc-per-node {u.world} "
            "THIS_FILE [--steps N]",
            f"{simulated[0].upper()}{simulated[1:]}.",
            *(f"cannot express: {note}" for note in notes),
        ]
    )
    values: dict[str, object] = {
        "HEADER": header.replace('"""', "'''"),
        "WORLD": u.world,
        "DATA": u.data,
        "TENSOR": u.tensor,
        "GLOBAL_BATCH": lp.model.global_batch,
        "ZERO": u.zero,
        "PRECISION": u.precision,
        "TENSOR_PLAN": plan,
        "CHECKPOINT": checkpointed,
        "BLOCKS": blocks,
        "OPTIMIZER": optimizer if optimizer in ("sgd", "adam") else "sgd",
        "LOSS": _loss_kind(lp),
        "MODEL": _model_code(lp.model.spec),
    }
    text = SCRIPT
    for key, value in values.items():
        code = value if isinstance(value, str) and key in ("HEADER", "MODEL") else repr(value)
        text = text.replace(f"@{key}@", code)
    return text, []


def _loss_kind(lp: LaunchPlan) -> str:
    """What the model outputs: "logits" (the graph's loss head is implicit), else the
    probabilities or log-probabilities of its last softmax."""
    last = lp.strategy.graph.ops[-1]
    if last.kind != "softmax" or last.attr("implicit", False):
        return "logits"
    return "log-probabilities" if "log" in str(last.attr("op", "")) else "probabilities"


def _model_code(spec: Any) -> str:
    """The body of the script's `build_model`: the plan's model rebuilt on the CPU."""
    if not spec:
        return (
            '    raise NotImplementedError("the plan records no model: build yours on `device` "'
            '"and return (module, example inputs of the whole batch)")'
        )
    kwargs = dict(spec.get("kwargs") or {})
    if "factory" in spec:
        module, _, attr = str(spec["factory"]).partition(":")
        shapes = [(tuple(i["shape"]), i.get("dtype", "float32")) for i in spec.get("inputs", [])]
        return (
            f"    import importlib\n\n"
            f"    factory = getattr(importlib.import_module({module!r}), {attr!r})\n"
            f"    with torch.device(device):\n"
            f"        module = factory(**{kwargs!r})\n"
            f"        inputs = tuple(torch.zeros(s, dtype=getattr(torch, d)) for s, d in {shapes!r})\n"
            f"    return module.train(), inputs"
        )
    if spec.get("batch") is not None:
        kwargs["batch"] = spec["batch"]
    return (
        "    from planner.graph.zoo import build_model as zoo_model\n\n"
        f"    return zoo_model({spec.get('name')!r}, device=device, **{kwargs!r})"
    )


SCRIPT = '''"""@HEADER@
"""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.overrides import TorchFunctionMode

WORLD = @WORLD@
DATA = @DATA@  # data-parallel degree (FSDP2 or DDP over the mesh's "dp" dim)
TENSOR = @TENSOR@  # tensor-parallel degree (the mesh's "tp" dim, innermost)
GLOBAL_BATCH = @GLOBAL_BATCH@
ZERO = @ZERO@  # 3: fully_shard(reshard_after_forward=True); 2: False; 0: replicate (DDP)
PRECISION = @PRECISION@
TENSOR_PLAN = @TENSOR_PLAN@
CHECKPOINT = @CHECKPOINT@  # blocks whose forward runs again in the backward
BLOCKS = @BLOCKS@  # the FSDP2 units, then the root
OPTIMIZER = @OPTIMIZER@
LOSS = @LOSS@  # what the model outputs: logits, probabilities or log-probabilities
STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64,
          "32-true": torch.float32, "bf16-mixed": torch.float32, "16-mixed": torch.float32}


def build_model(device="cpu"):
    """The plan's model on `device`, and example inputs of the whole batch."""
@MODEL@


def batch(step, inputs, out_shape):
    """Step `step`'s whole batch: random values of the example inputs' shapes and dtypes
    (integers: below the output's classes) and random targets. Replace with your data."""
    g = torch.Generator().manual_seed(step)
    classes = out_shape[-1]
    xs = [
        torch.randn(x.shape, generator=g, dtype=x.dtype)
        if x.dtype.is_floating_point
        else torch.randint(0, classes, x.shape, generator=g, dtype=x.dtype)
        for x in inputs
    ]
    return xs, torch.randint(0, classes, out_shape[:-1], generator=g)


def loss_of(out, target):
    """The mean loss of the model's output: its logits (cross-entropy), probabilities or
    log-probabilities (negative log-likelihood) over the last dimension."""
    out, target = out.float().flatten(0, -2), target.flatten()
    if LOSS == "logits":
        return F.cross_entropy(out, target)
    return F.nll_loss(torch.log(out) if LOSS == "probabilities" else out, target)


class Dense(torch.autograd.Function):
    """The identity into contiguous memory, with a contiguous gradient (the CPU attention
    kernel's backward views its output's gradient as contiguous)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class CpuAttention(TorchFunctionMode):
    """scaled_dot_product_attention of DTensors on the CPU, where DTensor has no rule for
    the kernel: every head on every rank of the tensor group (on GPUs DTensor splits the
    heads itself)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and isinstance(args[0], DTensor):
            mesh = args[0].device_mesh
            q, k, v = (Dense.apply(x.full_tensor()) for x in args[:3])
            out = Dense.apply(func(q, k, v, *args[3:], **kwargs))
            return DTensor.from_local(out, mesh, [Replicate()])
        return func(*args, **kwargs)


def _replicated(module, inputs, mesh):
    """A module's tensor inputs as DTensors replicated over the tensor group."""
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()])
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def parallelize(model, mesh):
    """Tensor parallelism inside each "tp" group, recomputation, then data parallelism."""
    if TENSOR > 1:
        tp = mesh["tp"]
        plan = {name: STYLES[style](use_local_output=False) for name, style in TENSOR_PLAN.items()}
        parallelize_module(model, tp, plan)
        for name, module in model.named_modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if name not in TENSOR_PLAN and own and not isinstance(own[0], DTensor):
                distribute_module(module, tp, input_fn=_replicated)  # weights replicated
    for name in CHECKPOINT:
        parent, _, child = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        holder.register_module(child, checkpoint_wrapper(model.get_submodule(name)))
    if DATA > 1 and ZERO == 0 and TENSOR == 1:
        from torch.distributed._composable.replicate import replicate

        return replicate(model, device_mesh=mesh["dp"])
    if DATA > 1:
        for name in BLOCKS:
            fully_shard(model.get_submodule(name), mesh=mesh["dp"], reshard_after_forward=ZERO == 3)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=ZERO == 3)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"this layout takes {WORLD} ranks, got {dist.get_world_size()}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (DATA, TENSOR), mesh_dim_names=("dp", "tp"))
    meta, meta_inputs = build_model("meta")
    out_shape = tuple(meta(*meta_inputs).shape)
    torch.manual_seed(0)
    model, inputs = build_model()
    if PRECISION in DTYPES:
        model = model.to(DTYPES[PRECISION])
    if cuda:
        model = model.to(device)
    model = parallelize(model, mesh)
    params = list(model.parameters())
    if OPTIMIZER == "adam":
        optimizer = torch.optim.AdamW(params, lr=args.lr)
    else:
        optimizer = torch.optim.SGD(params, lr=args.lr)
    rows = slice(mesh["dp"].get_local_rank() * (GLOBAL_BATCH // DATA), None)
    rows = slice(rows.start, rows.start + GLOBAL_BATCH // DATA)
    for step in range(args.steps):
        xs, target = batch(step, inputs, out_shape)
        xs, target = [x[rows] for x in xs], target[rows]  # this data rank's samples
        if PRECISION in DTYPES:
            xs = [x.to(DTYPES[PRECISION]) if x.dtype.is_floating_point else x for x in xs]
        if cuda:
            xs, target = [x.to(device) for x in xs], target.to(device)
        autocast = PRECISION in AUTOCAST
        with torch.autocast(
            "cuda" if cuda else "cpu", AUTOCAST.get(PRECISION, torch.bfloat16), enabled=autocast
        ), CpuAttention() if TENSOR > 1 and not cuda else contextlib.nullcontext():
            out = model(*xs)
        out = out.contiguous().full_tensor() if isinstance(out, DTensor) else out
        loss = loss_of(out, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        if dist.get_rank() == 0:
            print(f"step {step}: loss {float(mean) / DATA:.12g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''
