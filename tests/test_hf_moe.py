"""Hugging Face transformers 5's mixtures of experts as they are: Mixtral, Qwen2-MoE (a shared
expert behind a sigmoid gate) and Qwen3-MoE, each a router module (`weight` (E, h), top-k,
normalisation flag) and experts as one module of fused 3-D parameters (`gate_up_proj`
(E, 2f, h), `down_proj` (E, h, f)), built from tiny configs. Each captures with one moe op
per layer (`planner.graph.moe_capture`), the op's math equals the block's own forward and
backward in float64, an altered block is refused naming it, and the runtime trains the
captured model like the model itself in float64 (`--check`), with the experts spread too."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import runtime
from planner.errors import GraphError
from planner.graph.capture import capture
from planner.graph.hf import traceable
from planner.graph.moe import ffn_shard, moe_flops, moe_math, spec_of
from planner.graph.moe_capture import moe_found

T = pytest.importorskip("transformers")

H, F, FS, E, SEQ = 64, 32, 64, 4, 16
BASE = dict(
    num_hidden_layers=2,
    hidden_size=H,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    use_cache=False,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=E, intermediate_size=F)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=E,
            num_experts_per_tok=2,
            moe_intermediate_size=F,
            shared_expert_intermediate_size=FS,
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, norm_topk_prob=True),
    ),
}
# what the recogniser must read of each family's block (besides the router: softmax)
ATTRS: dict[str, dict[str, Any]] = {
    "mixtral": dict(top_k=2, norm_topk=True, roles=["router", "w13", "w2"]),
    "qwen2-moe": dict(
        top_k=2,
        norm_topk=False,
        shared_ffn=FS,
        roles=["router", "w13", "w2", "sw1", "sw3", "sw2", "sgate"],
    ),
    "qwen3-moe": dict(top_k=2, norm_topk=True, roles=["w13", "w2", "router"]),
}


def hf_model(family: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """The family's causal LM from a tiny config, its weights random (the Qwen routers start
    at zero: every expert would tie), in float32 with transformers' default experts kernel."""
    config_class, extra = FAMILIES[family]
    config = getattr(T, config_class)(**{**BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model


def tokens(batch: int = 2) -> tuple[torch.Tensor]:
    return (torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(1)),)


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp for layer in model.model.layers]  # type: ignore[union-attr]


# -- capture ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_captures_one_moe_op_per_layer_with_its_attrs_and_flops(family: str) -> None:
    model = hf_model(family)
    graph = capture(model, tokens(), family)
    moes = [op for op in graph.ops if op.kind == "moe"]
    assert [op.name for op in moes] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    want = {"experts": E, "ffn": F, "router": "softmax", "router_dtype": "float32"}
    want |= {"expert_act": "swiglu", **ATTRS[family]}
    for op in moes:
        attrs = dict(op.attrs)
        assert {k: attrs.get(k) for k in want} == {**want, "roles": tuple(want["roles"])}
        assert attrs.get("shared_ffn", 0) == want.get("shared_ffn", 0)
        # the op's parameters are the model's own, by name
        assert [p.name for p in op.params] == [
            f"{op.name}.{n}" for n, _ in model.get_submodule(op.name).named_parameters()
        ]
        # per token: the router's 2hE, the 2 chosen experts' 2 x 3 x h x f, the shared
        # expert's 2 x 3 x h x fs and its gate's 2h
        shared = (2 * 3 * H * FS + 2 * H) if "shared_ffn" in want else 0
        assert op.flops == 2 * SEQ * (2 * H * E + 2 * 2 * 3 * H * F + shared)
        assert op.flops == moe_flops(spec_of(attrs), H, 2 * SEQ).total


def test_the_unread_model_names_its_block_and_k_beyond_the_experts_is_refused() -> None:
    # Qwen3-MoE's default top 8 of 4 experts: the model cannot run (torch.topk refuses it)
    model = hf_model("qwen3-moe", num_experts_per_tok=8)
    assert moe_found(moe_blocks(model)[0]) is None
    with pytest.raises(GraphError) as error:
        capture(model, tokens(), "q")
    message = str(error.value)
    assert "\n" not in message
    assert "module 'model.layers.0.mlp' (its top_k 8 is not between 1 and its 4 experts)" in message
    assert "looks like a mixture of experts" in message


class LeastLikely(nn.Module):
    """A router that picks the k experts of lowest score: no moe op computes that."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.weight, self.top_k = router.weight, router.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x.reshape(-1, x.shape[-1]), self.weight)
        probs = torch.softmax(logits, dim=-1)
        value, index = torch.topk(-probs, self.top_k, dim=-1)
        return logits, -value / (-value).sum(-1, keepdim=True), index


class DoubleSoftmax(LeastLikely):
    """Top k of the scores, then a softmax over the k gate weights again."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x.reshape(-1, x.shape[-1]), self.weight)
        value, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, torch.softmax(value, dim=-1), index


@pytest.mark.parametrize("router", [LeastLikely, DoubleSoftmax])
def test_a_block_with_another_top_k_rule_is_refused_in_one_line_naming_it(router: type) -> None:
    model = hf_model("mixtral")
    block = moe_blocks(model)[1]
    block.gate = router(block.gate)
    assert moe_found(block) is None
    with pytest.raises(GraphError) as error:
        capture(model, tokens(), "altered")
    message = str(error.value)
    assert "\n" not in message
    assert "module 'model.layers.1.mlp' looks like a mixture of experts" in message
    assert 'layerwise_kind = "moe"' in message


# -- the math -----------------------------------------------------------------------------------


def _block_and_spec(family: str, **overrides: Any) -> tuple[nn.Module, Any]:
    model = hf_model(family, **overrides).double()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on the CPU
    block = moe_blocks(model)[0]
    found = moe_found(block)
    assert found is not None
    return block, spec_of(found.attrs)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_moe_math_is_the_blocks_forward_and_backward_in_float64(family: str) -> None:
    block, spec = _block_and_spec(family)
    params = [p for _, p in block.named_parameters()]
    for seed in range(3):
        x = torch.randn(
            2, SEQ, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
        )
        x.requires_grad_(True)
        y = block(x)
        want = moe_math(x, params, spec)
        diff = (y - want).detach().abs().max()
        assert float(diff) <= 1e-12 * float(want.detach().abs().max())
        # gradients into the fused (E, 2f, h) parameter, the router and the input alike
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, *params], dy)
        ref = torch.autograd.grad(want, [x, *params], dy)
        for g, r in zip(got, ref, strict=True):
            assert float((g - r).abs().max()) <= 1e-12 * max(1.0, float(r.abs().max()))


def test_the_router_in_float32_is_told_from_one_in_the_inputs_dtype() -> None:
    block, spec = _block_and_spec("qwen3-moe")
    params = [p for _, p in block.named_parameters()]
    x = torch.randn(2, SEQ, H, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = block(x)
        native = moe_math(x, params, dataclasses.replace(spec, router_dtype=""))
    assert spec.router_dtype == "float32"
    assert float((y - native).abs().max()) > 1e-10  # what float32 routing changes


def test_normalised_or_not_follows_the_block() -> None:
    for norm in (True, False):
        _, spec = _block_and_spec("qwen3-moe", norm_topk_prob=norm)
        assert spec.norm_topk is norm


def test_the_default_grouped_kernel_is_read_as_the_eager_loop_and_agrees_in_float32() -> None:
    model = hf_model("mixtral")
    assert model.get_experts_implementation()[""] == "grouped_mm"
    block = moe_blocks(model)[0]
    found = moe_found(block)
    assert found is not None and found.attrs["roles"] == ["router", "w13", "w2"]
    assert model.get_experts_implementation()[""] == "grouped_mm"  # restored after the check
    x = torch.randn(2, SEQ, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = block(x)
        want = moe_math(x.double(), [p.double() for p in block.parameters()], found.spec)
    assert float((y.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


# -- an interleaved fused gate/up ---------------------------------------------------------------


class InterleavedExperts(nn.Module):
    """Experts whose fused gate/up rows alternate (gate row j at 2j, up row j at 2j + 1), as
    transformers' `is_concatenated=False` layout holds them."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            h = nn.functional.linear(x[token], self.gate_up_proj[e])
            h = nn.functional.silu(h[:, 0::2]) * h[:, 1::2]
            y = nn.functional.linear(h, self.down_proj[e]) * weight[token, slot, None]
            out = out.index_add(0, token, y)
        return out


class InterleavedBlock(nn.Module):
    def __init__(self, mixtral_block: nn.Module) -> None:
        super().__init__()
        self.gate = mixtral_block.gate
        self.experts = InterleavedExperts(E, H, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weight, index = self.gate(flat)
        return self.experts(flat, index, weight).reshape(x.shape)


def test_an_interleaved_fused_gate_up_is_read_by_running_it_and_cut_in_whole_pairs() -> None:
    torch.manual_seed(0)
    block = InterleavedBlock(moe_blocks(hf_model("mixtral"))[0]).double()
    found = moe_found(block)
    assert found is not None and found.attrs["roles"] == ["router", "w13i", "w2"]
    spec = found.spec
    params = [p for _, p in block.named_parameters()]
    x = torch.randn(2, SEQ, H, dtype=torch.float64)
    with torch.no_grad():
        y = block(x)
        assert float((y - moe_math(x, params, spec)).abs().max()) <= 1e-12 * float(y.abs().max())
        # expert tensor parallelism's slices of the width: partial sums adding up to the block
        parts = [
            moe_math(x, [ffn_shard(p, r, i, 2) for p, r in zip(params, spec.roles, strict=True)],
                     spec_of({**found.attrs, "ffn": F // 2}))
            for i in range(2)
        ]  # fmt: skip
    assert float((parts[0] + parts[1] - y).abs().max()) <= 1e-12 * float(y.abs().max())


# -- the runtime --------------------------------------------------------------------------------


def _run(family: str, world: int, moe: dict[str, int] | int) -> tuple[Any, Any, Any]:
    """The family trained on `world` gloo workers in float64 with --check: every op split by
    samples, the moe ops by `moe` (test_runtime_moe's strategies), or a random strategy of
    seed `moe` (every op's config drawn from its space: heads, sequence, samples, the
    experts spread or cut along their width)."""
    from test_runtime_moe import F64, _strategy

    from planner.hardware.presets import get_preset
    from runtime.strategies import random_strategy

    model = hf_model(family)
    graph = capture(model, tokens(4), family)
    if isinstance(moe, int):
        strategy = random_strategy(graph, get_preset(f"cpu-local-{world}"), moe)
    else:
        strategy = _strategy(graph, world, moe)
    return runtime.run_strategy(strategy, traceable(model), F64), graph, strategy


@pytest.mark.slow
def test_mixtral_trains_at_world_2_with_its_experts_spread_like_one_process() -> None:
    from test_runtime_moe import _check_run

    run, graph, strategy = _run("mixtral", 2, {"sample": 2, "expert": 2})
    _check_run(run, graph, strategy, tokens=4 * SEQ)  # deviation within 1e-9
    assert run.expert_tokens and all(run.expert_tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "world", "moe"),
    [
        ("qwen2-moe", 2, {"sample": 2, "expert": 2}),
        ("qwen3-moe", 2, {"length": 2, "expert": 2}),
        ("mixtral", 4, {"sample": 4, "expert": 2}),
        ("qwen2-moe", 4, {"sample": 4, "expert": 2}),
        ("qwen3-moe", 4, {"sample": 2, "length": 2, "expert": 4}),
        ("mixtral", 2, {"reduce": 2}),
        ("qwen2-moe", 4, {"sample": 2, "reduce": 2, "expert": 2}),
        ("qwen3-moe", 4, {"reduce": 4}),
    ],
)
def test_each_family_trains_like_one_process_at_world_2_and_4(
    family: str, world: int, moe: dict[str, int]
) -> None:
    """With the experts spread (expert degree 2 or 4) or cut along their width (expert
    tensor parallelism: in float64 the float32 router runs in float64 on every rank and in
    the reference, `runtime.reference.Float64Islands`, so the partial sums of its gradient
    add up as the whole)."""
    from test_runtime_moe import _check_run

    run, graph, strategy = _run(family, world, moe)
    _check_run(run, graph, strategy, tokens=4 * SEQ)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("world", "seed"), [(2, 0), (2, 1), (4, 2)])
def test_random_strategies_train_like_one_process(family: str, world: int, seed: int) -> None:
    run, _, _ = _run(family, world, seed)
    assert run.deviation is not None and run.deviation["max_deviation"] <= 1e-9, run.deviation


@pytest.mark.slow
def test_interleaved_experts_train_cut_along_their_width_and_spread() -> None:
    from test_runtime_moe import F64, _check_run, _strategy

    model = hf_model("mixtral")
    for layer in model.model.layers:  # type: ignore[union-attr]
        layer.mlp = InterleavedBlock(layer.mlp)
    graph = capture(model, tokens(4), "interleaved")
    assert {dict(op.attrs)["roles"][1] for op in graph.ops if op.kind == "moe"} == {"w13i"}
    strategy = _strategy(graph, 4, {"sample": 2, "reduce": 2, "expert": 2})
    run = runtime.run_strategy(strategy, traceable(model), F64)
    _check_run(run, graph, strategy, tokens=4 * SEQ)
