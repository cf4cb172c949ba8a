"""Activations kept for the backward as frameworks keep them (planner/costs/activations.py):
the per-layer totals of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Sec. 4, Table 2) on captured GPT-2 and Llama blocks under Megatron's
layout, with sequence parallelism, at tensor degrees 1, 2, 4 and 8."""

from __future__ import annotations

from functools import cache

import pytest

from planner.costs.activations import activation_memory, saves_input
from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.recompute import recomputed_ops
from planner.graph.capture import capture
from planner.graph.coarsen import coarsen
from planner.graph.llm import build_llm
from planner.graph.opgraph import OpGraph
from planner.hardware.presets import get_preset
from planner.problems.baselines import megatron

S = 256  # sequence
H = 512  # hidden
A = 16  # heads
GPUS = 8  # dgx-a100-80g-1; data parallel 8 / t, one sample per replica


@cache
def _gpt(batch: int) -> OpGraph:
    module, inputs = build_llm("gpt2", batch=batch, seq=S, dtype="bfloat16", n_layer=3,
                               n_head=A, n_embd=H, vocab_size=1024, block_size=S)  # fmt: skip
    return capture(module, inputs, "gpt")


@cache
def _llama(batch: int, kv: int = 8) -> OpGraph:
    module, inputs = build_llm("llama2-7b", batch=batch, seq=S, dtype="bfloat16", n_layers=3,
                               n_heads=A, n_kv_heads=kv, dim=H, vocab_size=1024,
                               max_seq_len=S)  # fmt: skip
    return capture(module, inputs, "llama")


def layer_bytes(graph: OpGraph, t: int, recompute: str = "none") -> float:
    """Activation bytes one device keeps of the middle block (`layers.1`, `h.1`) under
    Megatron's layout at tensor degree t, data parallel over the rest."""
    cm = CostModel(graph, get_preset("dgx-a100-80g-1"), CostOptions(recompute=recompute))  # type: ignore[arg-type]
    configs = megatron(graph, cm.devices, t).configs
    return sum(
        cm.activation_bytes(i, cfg)
        for i, (op, cfg) in enumerate(zip(graph.ops, configs, strict=True))
        if ".1." in op.name and 0 in cfg.devices
    )


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("coarse", [False, True])
def test_a_gpt_layer_keeps_34_sbh_over_t(t: int, coarse: bool) -> None:
    # Korthikanti Table 2, sequence parallelism: 34 s b h / t bytes (16-bit activations, 1-byte
    # dropout masks; the 5 a s^2 b term is gone: our attention is FlashAttention's), plus
    # what the paper leaves out: the two layer norms' fp32 mean and 1/std per row (16 s b) and
    # the attention's fp32 logsumexp per row and head (4 a s b), all split t ways
    graph = _gpt(GPUS // t)
    graph = coarsen(graph) if coarse else graph
    b = 1
    expected = (34 * S * b * H + 16 * S * b + 4 * A * S * b) / t
    assert layer_bytes(graph, t) == pytest.approx(expected, rel=1e-12)
    # the small terms are 0.1% of the paper's figure here (16 / h + 4 a / h of 34)
    assert expected / (34 * S * b * H / t) - 1 < 0.006


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("coarse", [False, True])
def test_a_llama_layer_keeps_its_closed_form(t: int, coarse: bool) -> None:
    # Llama (RMSNorm, no dropout, GQA with g = kv / a, fused SwiGLU of width F): the norms'
    # inputs 2 + 2, the qkv input 2, q 2, k and v 4 g, attention's output 2, the w1/w3
    # input 2, SwiGLU's input 4 F / h and w2's input 2 F / h: s b h (12 + 4 g + 6 F / h) / t,
    # plus the norms' fp32 1/std (8 s b) and the logsumexp (4 a s b)
    kv = 8
    graph = _llama(GPUS // t, kv)
    graph = coarsen(graph) if coarse else graph
    ffn = graph.op("layers.1.feed_forward.w1").output.size("channel")
    g = kv / A
    expected = (S * H * (12 + 4 * g) + 6 * S * ffn + 8 * S + 4 * A * S) / t
    assert layer_bytes(graph, t) == pytest.approx(expected, rel=1e-12)


def test_llama3_8b_keeps_34_sbh_per_layer() -> None:
    # the shape of llama3-8b (h 4096, F 14336 = 3.5 h, 32 heads, 8 kv heads): 12 + 1 + 21
    assert 12 + 4 * 8 / 32 + 6 * 14336 / 4096 == 34


def test_what_no_backward_reads_is_not_kept() -> None:
    graph = _llama(1)
    act = activation_memory(graph, recomputed_ops(graph, "none"))
    kept = {op.name: act.kept[i] for i, op in enumerate(graph.ops)}
    # read only by a residual add (which saves nothing): the o- and down-projections
    assert kept["layers.1.attention.wo"] == 0.0
    assert kept["layers.1.feed_forward.w2"] == 0.0
    # SiLU's output, read only by the gate's mul (fused SwiGLU: rebuilt from w1's output)
    assert kept["layers.1.feed_forward.silu"] == 0.0
    assert kept["layers.1.feed_forward.w1"] == 1.0  # SiLU's input
    assert kept["layers.1.feed_forward.w3"] == 1.0  # the gate's other input
    assert kept["layers.1.add"] == pytest.approx(1.0)  # the next norm's input
    # the loss keeps the probabilities in fp32, not the bf16 logits
    assert kept["output"] == 0.0
    assert kept["output.loss"] == 2.0  # 4 bytes per 2-byte element
    loss = graph.index("output.loss")
    assert act.work[loss] == 1.0  # and its gradient of the logits, once


def test_a_dropout_keeps_a_one_byte_mask() -> None:
    graph = _gpt(1)
    act = activation_memory(graph, recomputed_ops(graph, "none"))
    i = graph.index("transformer.h.1.mlp.dropout")
    assert act.kept[i] == 0.5  # 1 byte per 2-byte element; its output only an add reads
    assert not saves_input(graph, graph.index("transformer.h.1.add"), 0)


def test_full_recomputation_keeps_the_block_input_only() -> None:
    # Korthikanti Table 2, "full recompute": 2 s b h per layer (the layer's input), whatever t
    for t in (1, 4):
        graph = _gpt(GPUS // t)
        assert layer_bytes(graph, t, "full") == pytest.approx(2 * S * H / t, rel=1e-12)


def test_selective_recomputation_frees_the_logsumexp() -> None:
    # FlashAttention keeps no s x s scores: selective (core attention) frees its logsumexp
    graph = _gpt(GPUS)
    none, selective = layer_bytes(graph, 1), layer_bytes(graph, 1, "selective")
    assert none - selective == pytest.approx(4 * A * S, rel=1e-12)


def test_selective_recomputation_never_raises_the_peak() -> None:
    # the attention's output stays kept for the output projection, whose backward runs
    # first and releases it: the recomputed copy replaces it, the working set is the
    # logsumexp alone, and the peak and the additive rule's sum both drop
    from planner.problems.sizes import least_memory

    graph = _gpt(GPUS // 2)
    devices = get_preset("dgx-a100-80g-1")
    configs = megatron(graph, devices, 2).configs
    cms = {m: CostModel(graph, devices, CostOptions(recompute=m)) for m in ("none", "selective")}  # type: ignore[arg-type]
    none, selective = cms["none"].activations, cms["selective"].activations
    for i in cms["selective"].recomputed.block:
        assert selective.kept[i] == 1.0  # its output, which the projection keeps
        assert selective.work[i] == pytest.approx(none.kept[i] - 1.0)  # the logsumexp
    peaks = {m: cm.strategy_memory(configs) for m, cm in cms.items()}
    assert (peaks["selective"] < peaks["none"]).all()
    assert least_memory(graph, CostOptions(recompute="selective")) < least_memory(
        graph, CostOptions()
    )
