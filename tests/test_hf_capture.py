"""Hugging Face models as they are (`planner.graph.hf`): tiny configs of each dense family
captured unedited on the meta device, what their code needed read right (Gemma's norms,
soft-capped attention and scaled embedding, GPT-2's tanh GELU and positions, number operands
of pointwise ops), and the runtime training them in float64 against single-process training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from budget import time_budget
from torch import nn

import planner
import runtime
from planner.errors import GraphError
from planner.graph.attention import rms_norm
from planner.graph.capture import activation_of, capture, norm_of
from planner.graph.hf import HFRoot, is_hf_model, traceable
from planner.graph.models import InputSpec, ModelSpec
from planner.hardware.presets import get_preset
from runtime.reference import constant_scalars
from runtime.strategies import random_strategy

T = pytest.importorskip("transformers")

from hf_models import SMALL  # noqa: E402 - after the skip: it builds transformers' models

TOKENS = (torch.zeros(2, 16, dtype=torch.int64),)
FAMILIES: dict[str, Callable[[], object]] = {
    "gpt2": lambda: T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64),
    "llama": lambda: T.LlamaConfig(**SMALL),
    "mistral": lambda: T.MistralConfig(**SMALL),
    "qwen2": lambda: T.Qwen2Config(**SMALL),
    "qwen3": lambda: T.Qwen3Config(**SMALL, head_dim=16),
    "gemma2": lambda: T.Gemma2Config(**SMALL, head_dim=16),
    "gemma3": lambda: T.Gemma3TextConfig(**SMALL, head_dim=16),
    "phi3": lambda: T.Phi3Config(**SMALL, pad_token_id=0),
}


def hf(family: str, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return T.AutoModelForCausalLM.from_config(FAMILIES[family]())


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    with time_budget(300):
        yield


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_captures_on_meta_with_its_own_names(family: str) -> None:
    model = hf(family, "meta")
    graph = capture(model, TOKENS, family)
    attention = [op for op in graph.ops if op.kind == "attention"]
    assert len(attention) == 2 and all(op.attr("causal") for op in attention)
    names = {n for n, _ in model.named_parameters()}
    held = {p.name for op in graph.ops for p in op.params}
    assert held == names  # every parameter, by the model's own name (tied ones once)
    tokens = TOKENS[0].numel()
    for op in graph.ops:  # a linear's FLOPs are its weight's multiply-adds per token
        if op.kind == "linear":
            assert op.flops == 2 * tokens * math.prod(op.params[0].shape)


def test_hf_root_shares_the_models_tables() -> None:
    model = hf("llama")
    root = traceable(model)
    assert is_hf_model(model) and isinstance(root, HFRoot) and traceable(root) is root
    assert dict(root.named_parameters()) == dict(model.named_parameters())
    logits = root(TOKENS[0])
    assert torch.equal(logits, model(input_ids=TOKENS[0], use_cache=False).logits)
    assert not is_hf_model(nn.Linear(2, 2))


def test_gemma_reads_its_norms_softcap_and_embedding_scale() -> None:
    model = hf("gemma2", "meta")
    g2 = capture(model, TOKENS, "gemma2")
    attn = next(op for op in g2.ops if op.kind == "attention")
    assert attn.attr("softcap") == model.config.attn_logit_softcapping == 50.0
    assert attn.attr("softmax") == "float32"
    assert attn.attr("scale") == pytest.approx(model.config.query_pre_attn_scalar**-0.5)
    norms = [op for op in g2.ops if op.kind == "norm"]
    assert norms and all(op.attr("offset") == 1.0 and op.attr("weight") == "inside" for op in norms)
    scaled = [op for op in g2.ops if op.kind == "elementwise" and op.attr("scalar_node")]
    assert len(scaled) == 1  # the embedding's scale: a buffer, unknown on meta
    capped = [op.attr("scalar") for op in g2.ops if op.kind == "elementwise" and op.attr("scalar")]
    assert capped == [30.0, 30.0]  # the final logits' soft cap: / 30, tanh, * 30
    g3 = capture(hf("gemma3"), TOKENS, "gemma3")  # on the CPU the scale is known: sqrt(64)
    assert [op.attr("scalar") for op in g3.ops if op.attr("scalar")] == [8.0]
    attn = next(op for op in g3.ops if op.kind == "attention")
    assert attn.attr("qk_norm_offset") == 1.0 and attn.attr("qk_norm_weight") == "inside"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gemma_norm_kernel_equals_the_module(dtype: torch.dtype) -> None:
    norm = hf("gemma3").model.norm
    attrs = norm_of(norm)
    assert attrs is not None and attrs["offset"] == 1.0
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 64, dtype=dtype)
    norm = norm.to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight, attrs), norm(x))
        llama_norm = hf("llama").model.norm.to(dtype)
        llama_norm.weight.normal_()
        found = norm_of(llama_norm)
        assert found is not None and "offset" not in found and "weight" not in found
        assert torch.equal(rms_norm(x, llama_norm.weight, found), llama_norm(x))


def test_activations_are_read_by_what_they_compute() -> None:
    from transformers.activations import ACT2FN

    assert activation_of(ACT2FN["gelu_new"]) == {"op": "gelu_tanh"}  # GPT-2's, with pow(x, 3)
    assert activation_of(ACT2FN["gelu_pytorch_tanh"]) == {"op": "gelu_tanh"}

    class Twice(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * x

    assert activation_of(Twice()) is None


class _Scaled(nn.Embedding):
    """An embedding whose subclass multiplies by a buffer, as Gemma's does."""

    def __init__(self) -> None:
        super().__init__(64, 16)
        self.register_buffer("scale", torch.tensor(3.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale.to(self.weight.dtype)


class ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = _Scaled(), nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1.0 - self.head(self.emb(x)) * 0.5) / 3.0 + 2


def test_number_operands_and_constant_factors_are_kept() -> None:
    graph = capture(ScaledNet(), TOKENS, "scaled")
    got = [
        (op.attr("op"), op.attr("scalar"), op.attr("scalar_first", False))
        for op in graph.ops
        if op.kind == "elementwise"
    ]
    assert got == [
        ("mul", 3.0, False),  # the buffer's value (on the CPU)
        ("mul", 0.5, False),
        ("sub", 1.0, True),
        ("truediv", 3.0, False),
        ("add", 2.0, False),
    ]
    # on meta the buffer has no value: named, and filled in from the model by the runtime
    spec = ModelSpec(
        "scaled", factory="test_hf_capture:ScaledNet", inputs=(InputSpec((2, 16), "int64"),)
    )
    meta = spec.graph()
    assert [op.attr("scalar_node") for op in meta.ops if op.attr("scalar_node")] == ["to"]
    filled = constant_scalars(meta, spec, 0, torch.float64)
    assert [op.attr("scalar") for op in filled.ops if op.attr("scalar_node")] == [3.0]


def test_a_trace_error_names_the_models_class_and_line() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            if h.sum() > 0:  # data-dependent control flow
                return h
            return -h

    with pytest.raises(
        GraphError, match=r"in Branchy\.forward \(test_hf_capture\.py:\d+: `if h\.sum\(\) > 0:"
    ):
        capture(Branchy(), TOKENS, "branchy")


F64 = runtime.RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=60)
RUN_TOKENS = (torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0)),)


def _deviations(module: nn.Module, world: int, draws: int) -> list[float]:
    result = planner.plan(module, "cpu-local-2", example_inputs=RUN_TOKENS, backend="elimination")
    graph = result.problem.dnn().graph
    assert graph is not None
    devices = get_preset(f"cpu-local-{world}")
    strategies = [random_strategy(graph, devices, seed) for seed in range(draws)]
    out = []
    for strategy in strategies:
        run = runtime.run_strategy(strategy, traceable(module), F64)
        assert all(math.isfinite(x) for x in run.losses)
        assert run.deviation is not None
        out.append(run.deviation["max_deviation"])
    return out


@pytest.mark.slow
def test_the_runtime_trains_gemma3_as_single_process_training() -> None:
    assert max(_deviations(hf("gemma3"), 2, 1)) <= 1e-9


def test_the_runtime_keeps_number_operands() -> None:
    result = planner.plan(
        ScaledNet(), "cpu-local-2", example_inputs=RUN_TOKENS, backend="elimination"
    )
    run = runtime.run_strategy(result.strategy, ScaledNet(), F64)
    assert run.deviation is not None and run.deviation["max_deviation"] <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "gemma2", "gemma3", "phi3", "qwen3"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_runtime_trains_each_family_under_random_plans(family: str, world: int) -> None:
    assert max(_deviations(hf(family), world, 2)) <= 1e-9


WINDOWED: dict[str, Callable[[], object]] = {
    "mistral": lambda: T.MistralConfig(**SMALL, sliding_window=6),
    "gemma2": lambda: T.Gemma2Config(**SMALL, head_dim=16, sliding_window=6),  # local, global
    "phi3": lambda: T.Phi3Config(**SMALL, pad_token_id=0, sliding_window=6),
    "qwen2": lambda: T.Qwen2Config(  # the layers from max_window_layers on
        **SMALL, use_sliding_window=True, sliding_window=6, max_window_layers=1
    ),
}
WINDOWS = {"mistral": [6, 6], "gemma2": [6, None], "phi3": [6, 6], "qwen2": [None, 6]}


def windowed(family: str) -> nn.Module:
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(WINDOWED[family]())


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_windows_are_read_from_the_mask(family: str) -> None:
    graph = capture(windowed(family), TOKENS, family)
    got = [op.attr("window") for op in graph.ops if op.kind == "attention"]
    assert got == WINDOWS[family]


def test_a_sliding_window_costs_its_share_of_the_product() -> None:
    from planner.costs.rates import attended_share

    assert attended_share(16, False) == 1.0 and attended_share(16, True) == 0.5
    assert attended_share(16, True, 16) == 0.5
    kept = torch.ones(16, 16).tril().triu(-5).sum().item()  # 6 keys per query at most
    assert attended_share(16, True, 6) == kept / 256


@pytest.mark.slow
def test_the_runtime_trains_a_sliding_window_as_single_process_training() -> None:
    assert max(_deviations(windowed("mistral"), 2, 1)) <= 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen2"])
def test_the_runtime_trains_each_windowed_family(family: str) -> None:
    assert max(_deviations(windowed(family), 2, 2)) <= 1e-9


class _OddMask(nn.Module):
    """Attention with a constant mask that hides each query's own position."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.qkv = nn.Embedding(64, 16), nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        q, k, v = (t.view(2, 16, 4, 4).transpose(1, 2) for t in self.qkv(h).split(16, -1))
        keep = torch.ones(16, 16, dtype=torch.bool).tril(-1)
        keep[0, 0] = True  # a row may not be empty
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return out.transpose(1, 2).reshape(2, 16, 16)


def test_a_mask_neither_causal_nor_a_window_is_refused_in_one_line() -> None:
    with pytest.raises(GraphError, match="hides other positions than those after each") as err:
        capture(_OddMask(), TOKENS, "odd")
    assert "\n" not in str(err.value)


def test_a_mask_too_big_to_compute_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.graph.attention as attention

    monkeypatch.setattr(attention, "MASK_ELEMENTS", 2 * 16 * 16 - 1)
    with pytest.raises(GraphError, match=r"the attention mask, \(2, 1, 16, 16\), is too big"):
        capture(hf("llama", "meta"), TOKENS, "llama")


def test_an_rms_norm_of_eps_0_keeps_it() -> None:
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w
    assert torch.equal(rms_norm(x, w, {"eps": 0.0}), want)
