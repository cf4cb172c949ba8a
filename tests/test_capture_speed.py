"""Capture checks each distinct structure numerically once (issue 42, item 8: a 70B's capture
recognised each of its 161 norms by running it, 27 of its 45 s): a model's repeated layers
share the answer, and modules or attention regions that differ in anything the check
depends on do not."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

from planner.errors import GraphError
from planner.graph import attention
from planner.graph import capture as cap
from planner.graph.capture import capture
from planner.graph.llm import GPT2, GPT2Config, Llama, LlamaConfig

TOKENS = (torch.zeros(2, 16, dtype=torch.long),)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Empty recognition caches; counts the norm recognitions (by module class) and the
    attention regions compared with the kernel."""
    for name in ("_NORMS_SEEN", "_LINEARS_SEEN", "_NORMS_BY_KEY", "_LINEARS_BY_KEY"):
        monkeypatch.setattr(cap, name, {})
    monkeypatch.setattr(attention, "_VERIFIED", set())
    runs: Counter[str] = Counter()
    recognise, math = cap._recognise_norm, attention.attention_math

    def counted_recognise(m: nn.Module) -> Any:
        runs[type(m).__name__] += 1
        return recognise(m)

    def counted_math(*args: Any, **kwargs: Any) -> Any:
        runs["attention"] += 1
        return math(*args, **kwargs)

    monkeypatch.setattr(cap, "_recognise_norm", counted_recognise)
    monkeypatch.setattr(attention, "attention_math", counted_math)
    return runs


def llama(attention: str = "sdpa", layers: int = 4) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, dim=48, n_layers=layers, n_heads=4, n_kv_heads=2, max_seq_len=16,
        attention=attention, multiple_of=32,
    )  # fmt: skip
    return Llama(config)


@pytest.mark.parametrize("kind", ["sdpa", "ones"])
def test_a_llamas_repeated_layers_are_checked_once(fresh: Counter[str], kind: str) -> None:
    graph = capture(llama(kind), TOKENS, "llama")
    norms = [op for op in graph.ops if op.kind == "norm"]
    assert len(norms) == 9 and all(op.attr("eps") == 1e-5 for op in norms)
    assert all(op.attr("norm") == "rms" and op.attr("compute") == "float32" for op in norms)
    assert len([op for op in graph.ops if op.kind == "attention"]) == 4
    assert fresh["RMSNorm"] == 1  # 9 norms of one class, width and eps
    assert fresh["attention"] == 1  # 4 regions of one structure (and rotary tables)


def test_gpt2s_layers_with_their_own_mask_buffers_are_checked_once(fresh: Counter[str]) -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=32, dropout=0.0,
        attention="buffer",
    )  # fmt: skip
    graph = capture(GPT2(config), TOKENS, "gpt2")
    assert len([op for op in graph.ops if op.kind == "attention"]) == 3
    assert fresh["attention"] == 1  # each layer's tril buffer holds the same values


class Norm(nn.Module):
    """An RMS norm with its eps as an attribute; `scale_only` makes it no norm at all, and a
    weight of 8 channels or fewer only scales too (what it computes depends on its shape)."""

    def __init__(self, width: int, eps: float = 1e-5, scale_only: bool = False) -> None:
        super().__init__()
        self.eps, self.scale_only = eps, scale_only
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_only or self.weight.shape[0] <= 8:
            return x * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Stack(nn.Module):
    def __init__(self, *norms: nn.Module, width: int = 16) -> None:
        super().__init__()
        self.norms = nn.ModuleList(norms)
        self.ins = nn.ModuleList(nn.Linear(width, n.weight.shape[0]) for n in norms)  # type: ignore[union-attr]
        self.outs = nn.ModuleList(nn.Linear(n.weight.shape[0], width) for n in norms)  # type: ignore[union-attr]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, n, b in zip(self.ins, self.norms, self.outs, strict=True):
            x = b(n(a(x)))
        return x


X = (torch.randn(2, 5, 16),)


def norm_attrs(module: nn.Module) -> list[dict[str, Any] | None]:
    """Per norm, the attrs of its norm op, or None if it is no leaf (traced through)."""
    ops = {op.name: op for op in capture(module, X, "stack").ops}
    out = []
    for name in (f"norms.{i}" for i in range(len(module.norms))):  # type: ignore[arg-type]
        op = ops.get(name)
        out.append(dict(op.attrs) if op is not None and op.kind == "norm" else None)
    return out


def test_norms_that_differ_in_eps_are_each_recognised(fresh: Counter[str]) -> None:
    found = norm_attrs(Stack(Norm(16, 1e-5), Norm(16, 1e-6), Norm(16, 1e-5)))
    assert [a and a["eps"] for a in found] == [1e-5, 1e-6, 1e-5]
    assert fresh["Norm"] == 2


def test_a_module_that_differs_in_an_attribute_or_a_shape_is_not_taken_for_a_norm(
    fresh: Counter[str],
) -> None:
    found = norm_attrs(Stack(Norm(16), Norm(16, scale_only=True), Norm(8), Norm(16)))
    assert [a and a["norm"] for a in found] == ["rms", None, None, "rms"]
    assert fresh["Norm"] == 3


def test_a_forward_patched_between_captures_is_recognised_again(
    fresh: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert norm_attrs(Stack(Norm(16)))[0] is not None
    monkeypatch.setattr(Norm, "forward", lambda self, x: x * self.weight)
    assert norm_attrs(Stack(Norm(16))) == [None]


def test_a_module_with_a_hook_or_an_object_attribute_has_no_key() -> None:
    plain = Norm(16)
    assert attention.module_key(plain) == attention.module_key(Norm(16))
    assert attention.module_key(plain) != attention.module_key(Norm(16, 1e-6))
    hooked = Norm(16)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    assert attention.module_key(hooked) is None
    patched = Norm(16)
    patched.forward = lambda x: x  # type: ignore[method-assign]
    assert attention.module_key(patched) is None


class Square(nn.Module):
    """Four heads of size 4 over four positions: q's heads taken by transpose(1, 2) or, with
    `swap`, by transpose(1, 3), which gives the same shape and another computation."""

    def __init__(self, swap: bool) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, 4, 4).transpose(1, 3 if self.swap else 2)
        k, v = (y.view(b, t, 4, 4).transpose(1, 2) for y in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TwoAttentions(nn.Module):
    def __init__(self, swap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
        self.first, self.second = Square(False), Square(swap)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + self.first(h)
        return self.head(h + self.second(h))


def test_an_attention_region_that_differs_in_an_argument_is_checked_itself(
    fresh: Counter[str],
) -> None:
    four = (torch.zeros(2, 4, dtype=torch.long),)
    capture(TwoAttentions(swap=False), four, "same")
    assert fresh["attention"] == 1
    with pytest.raises(GraphError, match="second.*computes something else"):
        capture(TwoAttentions(swap=True), four, "swapped")
