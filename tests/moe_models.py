"""Tiny mixture-of-experts language models for the runtime's expert-parallel tests (importable
by worker processes: the tests folder is on their path).

`MoEBlock` declares the `moe` op kind (`layerwise_kind`, `layerwise_attrs`) and computes it in
a dense form: every expert on every token, weighted by a (tokens, experts) matrix that holds
the top-k gate weights and zeros elsewhere. That runs on meta tensors (no `torch.where` or
`bincount`) and computes what the sparse form does (planner.graph.moe: an expert a token does
not choose adds an exact zero). Two routings: Mixtral's (softmax over the experts, top k,
renormalized; Jiang et al. 2024, Sec. 2.1) and DeepSeek-V3's (sigmoid scores, a selection
bias, a route scale, a shared expert; DeepSeek-AI 2024, Sec. 2.1.2), here with Qwen-MoE's
sigmoid gate on the shared expert.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """w2(silu(w1 x) * w3 x), the SwiGLU MLP of Mixtral's and DeepSeek's experts."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEBlock(nn.Module):
    """A sparse MLP block declared as layerwise's `moe` op (module docstring). `deepseek`:
    sigmoid routing with a selection bias and route scale 2.5, plus a gated shared expert;
    `stacked`: the experts' weights as (E, 2f, h) and (E, h, f) tensors, as Hugging Face's
    fused experts hold them, instead of one module per expert."""

    layerwise_kind = "moe"

    def __init__(
        self,
        hidden: int,
        experts: int,
        top_k: int,
        ffn: int,
        deepseek: bool = False,
        stacked: bool = False,
    ) -> None:
        super().__init__()
        self.experts_n, self.top_k, self.ffn = experts, top_k, ffn
        self.deepseek, self.stacked = deepseek, stacked
        self.gate = nn.Linear(hidden, experts, bias=False)
        if deepseek:  # small: it reorders some choices without deciding all of them
            self.bias = nn.Parameter(0.05 * torch.randn(experts))
        if stacked:
            self.w13 = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / hidden**0.5)
            self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
        else:
            self.experts = nn.ModuleList(Expert(hidden, ffn) for _ in range(experts))
        if deepseek:
            self.shared = Expert(hidden, ffn // 2)
            self.shared_gate = nn.Linear(hidden, 1, bias=False)

    def layerwise_attrs(self) -> dict[str, Any]:
        # roles in the order of named_parameters (this module's own tensors come first)
        names = {"gate.weight": "router", "bias": "router_bias", "w13": "w13", "w2": "w2"}
        names |= {f"shared.{w}.weight": f"s{w}" for w in ("w1", "w3", "w2")}
        names |= {"shared_gate.weight": "sgate"}
        roles = [
            names.get(n) or "{}.{}".format(n.split(".")[2], n.split(".")[1])  # experts.i.wj
            for n, _ in self.named_parameters()
        ]
        attrs: dict[str, Any] = {"experts": self.experts_n, "top_k": self.top_k, "ffn": self.ffn}
        if self.deepseek:
            attrs |= {"router": "sigmoid", "route_scale": 2.5, "shared_ffn": self.ffn // 2}
        return attrs | {"roles": roles}

    def _expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if not self.stacked:
            return self.experts[i](x)
        w1, w3 = self.w13[i, : self.ffn], self.w13[i, self.ffn :]
        return (F.silu(x @ w1.T) * (x @ w3.T)) @ self.w2[i].T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.gate(tokens)
        scores = torch.sigmoid(logits) if self.deepseek else torch.softmax(logits, dim=-1)
        chosen = scores + self.bias if self.deepseek else scores
        index = torch.topk(chosen, self.top_k, dim=-1).indices
        gate = scores.gather(-1, index)
        gate = gate / gate.sum(dim=-1, keepdim=True)
        if self.deepseek:
            gate = gate * 2.5
        weights = torch.zeros_like(scores).scatter(-1, index, gate)
        out = torch.zeros_like(tokens)
        for i in range(self.experts_n):  # dense: zero weight where a token did not choose i
            out = out + weights[:, i : i + 1] * self._expert(i, tokens)
        if self.deepseek:
            out = out + self.shared(tokens) * torch.sigmoid(self.shared_gate(tokens))
        return out.reshape(x.shape)


class Layer(nn.Module):
    """x + moe(rms_norm(x)): a pre-norm residual block whose MLP is a mixture of experts."""

    def __init__(self, hidden: int, moe: MoEBlock) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    """Embedding, `layers` residual MoE blocks (`Layer`), an RMS norm and a log-softmax head:
    the smallest language model with experts."""

    def __init__(
        self,
        vocab: int = 32,
        hidden: int = 16,
        experts: int = 8,
        top_k: int = 2,
        ffn: int = 24,
        layers: int = 2,
        deepseek: bool = False,
        stacked: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            Layer(hidden, MoEBlock(hidden, experts, top_k, ffn, deepseek, stacked))
            for _ in range(layers)
        )
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.log_softmax(self.head(self.norm(x)), dim=-1)
