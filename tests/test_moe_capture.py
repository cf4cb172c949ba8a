"""Mixtures of experts captured from code as people write it (`planner.graph.moe_capture`):
the reference forms of Mixtral, DeepSeek-V3 and Qwen-MoE (`planner.graph.llm`), stacked
experts (Hugging Face transformers 5, torchtitan), a declared block, and the refusals."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import planner
from planner.costs.declared import check_declared
from planner.errors import GraphError
from planner.graph import moe_capture
from planner.graph.capture import capture
from planner.graph.llm import FeedForward, build_llm
from planner.graph.moe import moe_math, spec_of
from planner.graph.moe_capture import moe_of

TINY = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
# DeepSeek-V3's multi-head latent attention at a tiny size
MLA_TINY = dict(
    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
STYLES: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(n_experts=4, top_k=2, moe_hidden=24),
    "deepseek-v3-like": dict(
        n_experts=8, top_k=3, moe_hidden=16, n_groups=4, topk_groups=2, first_dense=1,
        hidden_dim=40, n_kv_heads=None, **MLA_TINY,
    ),
    "qwen-moe-like": dict(n_experts=6, top_k=2, moe_hidden=16, shared_hidden=24),
    "qwen3-30b-a3b": dict(n_experts=6, top_k=3, moe_hidden=16, head_dim=12),
}  # fmt: skip
# what moe_of reads from each tiny block (besides its roles)
ATTRS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(router="softmax", norm_topk=True, experts=4, top_k=2, ffn=24),
    "deepseek-v3-like": dict(
        router="sigmoid", norm_topk=True, experts=8, top_k=3, ffn=16, groups=4, topk_groups=2,
        group_score="top2", route_scale=2.5, shared_ffn=16,
    ),
    "qwen-moe-like": dict(
        router="softmax", norm_topk=False, experts=6, top_k=2, ffn=16, shared_ffn=24
    ),
    "qwen3-30b-a3b": dict(router="softmax", norm_topk=True, experts=6, top_k=3, ffn=16),
}  # fmt: skip


def tiny(name: str, **overrides: Any) -> tuple[nn.Module, torch.Tensor]:
    """A 2-layer, width-32 MoE decoder in float64 on CPU with tokens (2, 8)."""
    torch.manual_seed(0)
    kwargs = {**TINY, **STYLES[name], **overrides}
    model, (tokens,) = build_llm(name, device="cpu", batch=2, seq=8, **kwargs)
    return model.double(), tokens


def block(model: nn.Module) -> nn.Module:
    return model.layers[-1].feed_forward  # type: ignore[index,union-attr]


@pytest.mark.parametrize("name", STYLES)
def test_each_reference_block_is_recognised_with_its_attrs_and_roles(name: str) -> None:
    model, _ = tiny(name)
    moe = block(model)
    attrs = moe_of(moe)
    assert attrs is not None
    roles = attrs.pop("roles")
    assert {k: v for k, v in attrs.items() if k != "expert_act"} == ATTRS[name]
    assert attrs["expert_act"] == "swiglu"
    names = [n for n, _ in moe.named_parameters()]
    assert len(roles) == len(names)
    by_name = dict(zip(names, roles, strict=True))
    if name == "mixtral-8x7b":  # experts first, then the gate (Mistral's MoeLayer order)
        assert roles[:3] == ["w1.0", "w2.0", "w3.0"] and roles[-1] == "router"
    if name == "deepseek-v3-like":
        assert by_name["gate.weight"] == "router" and by_name["gate.bias"] == "router_bias"
        assert by_name["shared_experts.w3.weight"] == "sw3"
    if name == "qwen-moe-like":
        assert by_name["experts.5.down_proj.weight"] == "w2.5"
        assert by_name["shared_expert_gate.weight"] == "sgate"
    if name == "qwen3-30b-a3b":  # Qwen3-MoE's block: Qwen-MoE's without the shared expert
        assert by_name["experts.5.down_proj.weight"] == "w2.5"
        assert not any("shared" in r or r == "sgate" for r in roles)


@pytest.mark.parametrize("name", STYLES)
def test_the_blocks_own_weights_compute_moe_math(name: str) -> None:
    """The roles in named_parameters order are what the kernel and the runtime read."""
    model, _ = tiny(name)
    moe = block(model)
    with torch.no_grad():
        moe.gate.bias.normal_() if name == "deepseek-v3-like" else None  # type: ignore[union-attr,operator]
    spec = spec_of(moe_of(moe) or {})
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    out = moe(x)
    out = out[0] if isinstance(out, tuple) else out
    want = moe_math(x, [p.detach() for p in moe.parameters()], spec)
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=1e-12)


# Hugging Face transformers 5's MixtralExperts: gate_up_proj (E, 2f, h), down_proj (E, h, f)
class HFExperts(nn.Module):
    def __init__(self, e: int, h: int, f: int) -> None:
        super().__init__()
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.randn(e, h, f))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out


class HFSparseBlock(nn.Module):
    def __init__(self, e: int = 4, h: int = 16, f: int = 12, k: int = 2) -> None:
        super().__init__()
        self.top_k = k
        self.gate = nn.Linear(h, e, bias=False)
        self.experts = HFExperts(e, h, f)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, h = hidden.shape
        x = hidden.view(-1, h)
        logits = self.gate(x)
        weights = F.softmax(logits, dim=1)
        weights, index = torch.topk(weights, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, index, weights).reshape(b, t, h), logits


# torchtitan's GroupedExperts stored (E, in, out) and multiplied with bmm-style matmuls
class Config:
    def __init__(self) -> None:
        self.n_activated = 0
        self.moe_top_k = 3


class TitanMoE(nn.Module):
    def __init__(self, e: int = 4, h: int = 16, f: int = 8) -> None:
        super().__init__()
        self.args = Config()  # k one level into a config object
        self.router = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, h, f))
        self.w2 = nn.Parameter(torch.randn(e, f, h))
        self.w3 = nn.Parameter(torch.randn(e, h, f))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        scores = torch.sigmoid(self.router(flat))
        top, index = scores.topk(self.args.moe_top_k, dim=-1)
        out = torch.zeros_like(flat)
        for e in range(self.w1.shape[0]):
            token, slot = torch.where(index == e)
            h = F.silu(flat[token] @ self.w1[e]) * (flat[token] @ self.w3[e])
            out[token] += (h @ self.w2[e]) * top[token, slot, None]
        return out.reshape(x.shape)


def test_stacked_experts_of_hugging_face_5_and_torchtitan_are_read_with_their_layouts() -> None:
    torch.manual_seed(0)
    hf = moe_capture.moe_found(HFSparseBlock())
    assert hf is not None and hf.logits == "flat"
    assert hf.attrs["roles"] == ["router", "w13", "w2"]
    titan = moe_of(TitanMoE())
    assert titan is not None
    assert titan["roles"] == ["w1^T", "w2^T", "w3^T", "router"]  # own parameters first
    assert (titan["router"], titan["norm_topk"], titan["top_k"]) == ("sigmoid", False, 3)


class Dense(nn.Module):
    """E experts and a router, but every expert runs on every token (softmax-weighted): not a
    top-k mixture."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.gate = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(FeedForward(16, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.softmax(self.gate(x), dim=-1)
        return sum(w[..., i, None] * e(x) for i, e in enumerate(self.experts))  # type: ignore[return-value]


def test_what_computes_something_else_is_not_taken_for_a_mixture() -> None:
    assert moe_of(Dense()) is None
    model, _ = tiny("mixtral-8x7b")
    assert moe_of(model) is None and moe_of(model.layers[0]) is None  # type: ignore[index]
    assert moe_of(block(model).experts[0]) is None  # type: ignore[union-attr,index]


def test_a_large_block_is_checked_on_narrow_experts_or_read_alone_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, _ = tiny("deepseek-v3-like")
    moe = block(model)
    numel = sum(p.numel() for p in moe.parameters())
    for name in ("_SEEN", "_BY_KEY"):
        monkeypatch.setattr(moe_capture, name, {})
    monkeypatch.setattr(moe_capture, "MOE_VERIFY_NUMEL", numel - 1)  # narrow experts fit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        narrow = moe_of(moe)
    assert narrow is not None and "checked" not in narrow
    for name in ("_SEEN", "_BY_KEY"):
        monkeypatch.setattr(moe_capture, name, {})
    monkeypatch.setattr(moe_capture, "MOE_VERIFY_NUMEL", 100)  # nothing fits
    with pytest.warns(UserWarning, match="structure alone.*--check"):
        alone = moe_of(moe)
    assert alone == {**narrow, "checked": False}


# -- capture --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", STYLES)
def test_capture_makes_moe_ops_whose_flops_are_what_the_cpu_run_counts(name: str) -> None:
    """FlopCounterMode on the CPU run counts the matmuls that ran: the router and the k
    experts each token chose (and a shared expert and its gate), as moe_flops does. The
    explicit attention's matmuls are counted by both."""
    model, tokens = tiny(name, attention="ones")
    graph = capture(model, (tokens,), name)
    moes = [op for op in graph.ops if op.kind == "moe"]
    assert len(moes) == 2 - STYLES[name].get("first_dense", 0)
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    assert graph.forward_flops == counter.get_total_flops()
    h, k, e, f = 32, STYLES[name]["top_k"], STYLES[name]["n_experts"], STYLES[name]["moe_hidden"]
    shared = {"deepseek-v3-like": 2 * 3 * h * 16, "qwen-moe-like": 2 * 3 * h * 24 + 2 * h}
    assert moes[0].flops == 16 * (2 * h * e + k * 2 * 3 * h * f + shared.get(name, 0))


def test_router_logits_returned_and_unread_are_dropped_read_are_refused() -> None:
    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.moe = HFSparseBlock()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, logits = self.moe(x)
            return out + logits.sum(-1).view(x.shape[0], -1, 1)  # an auxiliary term

    class Unread(Reader):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _logits = self.moe(x)
            return out

    x = (torch.randn(2, 4, 16),)
    graph = capture(Unread(), x, "u")
    assert [op.kind for op in graph.ops] == ["input", "moe", "softmax"]  # the loss head
    with pytest.raises(GraphError, match="reads the router logits of the mixture of experts"):
        capture(Reader(), x, "r")


class BiasedRouter(nn.Module):
    """Mixtral's loop with a bias on the router's logits: no moe op reads that."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = 2
        self.gate = nn.Linear(16, 4, bias=True)
        self.experts = nn.ModuleList(FeedForward(16, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1, 16)
        weights, chosen = torch.topk(self.gate(flat), self.top_k)
        weights = F.softmax(weights, dim=1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            token, nth = torch.where(chosen == i)
            out[token] += weights[token, nth, None] * expert(flat[token])
        return out.view_as(x)


class Declared(BiasedRouter):
    layerwise_kind = "moe"

    def __init__(self, top_k: int = 2) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 4, bias=False)
        self.declared_k = top_k

    def layerwise_attrs(self) -> dict[str, Any]:
        roles = ["router"] + [f"w{j}.{i}" for i in range(4) for j in (1, 2, 3)]
        return dict(experts=4, top_k=self.declared_k, ffn=8, roles=roles)


def test_a_block_not_read_is_refused_in_one_line_naming_the_way_out() -> None:
    torch.manual_seed(0)
    with pytest.raises(GraphError) as error:
        capture(BiasedRouter(), (torch.randn(2, 4, 16),), "b")
    message = str(error.value)
    assert "\n" not in message and "looks like a mixture of experts" in message
    assert "router weight (E, h)" in message and 'layerwise_kind = "moe"' in message


def test_a_declared_moe_is_a_leaf_with_analytic_flops_checked_against_the_kernel() -> None:
    torch.manual_seed(0)
    x = (torch.randn(2, 4, 16),)
    graph = capture(nn.Sequential(Declared()), x, "d", check=check_declared)
    (op,) = [op for op in graph.ops if op.kind == "moe"]
    assert op.flops == 8 * (2 * 16 * 4 + 2 * 2 * 3 * 16 * 8)
    with pytest.raises(GraphError, match="declared as 'moe'.*computes something else"):
        capture(nn.Sequential(Declared(top_k=1)), x, "d", check=check_declared)


@pytest.mark.parametrize("name", STYLES)
def test_a_tiny_moe_is_planned_end_to_end(name: str) -> None:
    kwargs = {**TINY, **STYLES[name], "seq": 8}
    out = planner.plan(name, "cpu-local-2", model_kwargs=kwargs, time_limit=60)
    assert out.has_solution
    assert any(op.kind == "moe" for op in out.problem.origin.graph.ops)  # type: ignore[union-attr]


FULL = {
    "mixtral-8x7b": (32, 46_702_792_704),
    "qwen-moe-like": (24, 14_315_784_192),
    "deepseek-v3-like": (58, 671_026_419_200),
    "qwen3-30b-a3b": (48, 30_532_122_624),
    "qwen3-235b-a22b": (94, 235_093_634_560),
}


@pytest.mark.parametrize(
    "name",
    [
        "mixtral-8x7b",
        "qwen-moe-like",
        pytest.param("deepseek-v3-like", marks=pytest.mark.slow),
        pytest.param("qwen3-30b-a3b", marks=pytest.mark.slow),
        pytest.param("qwen3-235b-a22b", marks=pytest.mark.slow),
    ],
)
def test_full_sizes_capture_on_meta_with_every_parameter_and_analytic_flops(name: str) -> None:
    """Mixtral 8x7B's 32 blocks of 8 x 3 x 4096 x 14336 run nowhere: each is read once (on
    narrow stand-in experts) and costed by formula. Timing (batch 8, sequence 2048, a busy
    2-core machine at load 4.5): Mixtral 2.0 s, Qwen 2.5 s, DeepSeek-V3-like 12.5 s; at load
    1.8: Qwen3-30B-A3B 3.8 s, Qwen3-235B-A22B 7.4 s, DeepSeek-V3-like (MLA) 8.1 s."""
    module, tokens = build_llm(name, batch=8, seq=2048)
    graph = capture(module, tokens, name)
    layers, count = FULL[name]
    moes = [op for op in graph.ops if op.kind == "moe"]
    assert len(moes) == layers and not any(op.attr("checked") is False for op in moes)
    params = sum(
        math.prod(p.shape) for p in {p.name: p for op in graph.ops for p in op.params}.values()
    )
    assert params == sum(p.numel() for p in module.parameters())
    if count is not None:
        assert params == count
    spec = spec_of(dict(moes[0].attrs))
    h, tokens_ = module.config.dim, 8 * 2048  # type: ignore[union-attr]
    shared = 2 * 3 * h * spec.shared_ffn + (2 * h if name == "qwen-moe-like" else 0)
    assert moes[0].flops == tokens_ * (
        2 * h * spec.experts + spec.top_k * 6 * h * spec.ffn + shared
    )
