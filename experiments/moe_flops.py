"""Training FLOPs per token of mixture-of-experts decoders, in the conventions the published
MoE throughput figures use (`experiments.moe`).

Megatron-LM's `num_floating_point_operations` (megatron/training/training.py; Megatron-Bridge
counts the same in its flop_utils): per token, forward and backward (3 x a forward, 2 FLOPs a
multiply-add), per layer:

- attention: 6 h (q + 2 kv) for the q, k, v projections, 6 q h for the output projection, and
  the core products QK^T and AV, 6 s heads (d_qk + d_v), halved with `causal` (a causal mask
  computes half of them); multi-head latent attention (DeepSeek-V2/V3) counts its low-rank
  projections instead (`MLA`);
- MLP: 6 h f x 3 (SwiGLU's three matrices; 2 without a gate) for a dense layer, and for a
  mixture of experts the k routed experts and the shared experts only, never the E experts
  nor the router;
- the logits: 6 h V (per multi-token-prediction module one more, with `mtp`).

The 2024 version (Megatron-Core v0.8/v0.9, when Megatron-Core published 468 TFLOP/s for
Mixtral 8x7B) did not halve causal attention; later versions and DeepSeek's own "causal"
figure do. `six_n` is the 6 x activated parameters rule (Kaplan et al. 2020).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MLA", "MoEShape", "megatron_flops_per_token", "six_n"]


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention's shapes (DeepSeek-V3 report Sec. 2.1.1, its config):
    query and key/value compression ranks, the per-head no-rope and rope key dims and the
    value dim."""

    q_lora: int = 1536
    kv_lora: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v: int = 128


@dataclass(frozen=True)
class MoEShape:
    """A decoder with `dense_layers` dense MLP layers (first) and `moe_layers` MoE ones."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dense_layers: int
    dense_ffn: int
    moe_layers: int
    moe_ffn: int
    top_k: int
    experts: int
    shared_ffn: int = 0
    gated: bool = True
    mla: MLA | None = None

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers

    def active_params(self) -> float:
        """Parameters a token goes through (attention, the k experts, shared experts,
        router, embedding and head; norms left out)."""
        h, m = self.hidden, 3 if self.gated else 2
        attention = self._attention_macs_projections()
        dense = m * h * self.dense_ffn
        moe = m * h * (self.top_k * self.moe_ffn + self.shared_ffn) + h * self.experts
        return (
            self.layers * attention
            + self.dense_layers * dense
            + self.moe_layers * moe
            + 2 * self.vocab * h
        )

    def _attention_macs_projections(self) -> float:
        h = self.hidden
        if self.mla is not None:
            a, n = self.mla, self.heads
            return (
                h * a.q_lora
                + a.q_lora * n * (a.qk_nope + a.qk_rope)
                + h * (a.kv_lora + a.qk_rope)
                + a.kv_lora * n * (a.qk_nope + a.v)
                + n * a.v * h
            )
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * (q + 2 * kv) + q * h

    def _core_macs(self, seq: int) -> float:
        """Multiply-adds of QK^T and AV per token over the whole sequence."""
        if self.mla is not None:
            a = self.mla
            return seq * self.heads * (a.qk_nope + a.qk_rope + a.v)
        return seq * self.heads * 2 * self.head_dim


def megatron_flops_per_token(shape: MoEShape, seq: int, causal: bool = True, mtp: int = 0) -> float:
    """Training FLOPs per token by Megatron-LM's count (module docstring): `causal` halves
    the core attention (the 2024 count did not), `mtp` multi-token-prediction modules each
    add an MoE layer and a head (their small projection left out)."""
    h, m = shape.hidden, 3 if shape.gated else 2
    core = shape._core_macs(seq) * (0.5 if causal else 1.0)
    attention = 6 * (shape._attention_macs_projections() + core)
    dense = 6 * h * m * shape.dense_ffn
    moe = 6 * h * m * (shape.top_k * shape.moe_ffn + shape.shared_ffn)
    layers = shape.layers + mtp
    return (
        layers * attention
        + shape.dense_layers * dense
        + (shape.moe_layers + mtp) * moe
        + 6 * h * shape.vocab * (1 + mtp)
    )


def six_n(shape: MoEShape) -> float:
    """6 x the activated parameters per token (Kaplan et al. 2020, Sec. 2.1)."""
    return 6.0 * shape.active_params()


MIXTRAL_8X7B = MoEShape(
    hidden=4096, heads=32, kv_heads=8, head_dim=128, vocab=32000, dense_layers=0, dense_ffn=0,
    moe_layers=32, moe_ffn=14336, top_k=2, experts=8,
)  # fmt: skip
QWEN3_30B_A3B = MoEShape(
    hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936, dense_layers=0, dense_ffn=0,
    moe_layers=48, moe_ffn=768, top_k=8, experts=128,
)  # fmt: skip
QWEN3_235B_A22B = MoEShape(
    hidden=4096, heads=64, kv_heads=4, head_dim=128, vocab=151936, dense_layers=0, dense_ffn=0,
    moe_layers=94, moe_ffn=1536, top_k=8, experts=128,
)  # fmt: skip
DEEPSEEK_V3 = MoEShape(
    hidden=7168, heads=128, kv_heads=128, head_dim=128, vocab=129280, dense_layers=3,
    dense_ffn=18432, moe_layers=58, moe_ffn=2048, top_k=8, experts=256, shared_ffn=2048,
    mla=MLA(),
)  # fmt: skip
