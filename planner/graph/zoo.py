"""The model zoo: the DNNs of the OptCNN and FlexFlow papers as plain `nn.Module`s.

Every size is a keyword with the papers' default (see `MODELS[name].defaults`). Builders
create the module under a device (meta by default: no memory, no compute) and return it
with example inputs; `model_graph` captures and coarsens it into an `OpGraph`.

Defaults and where they come from:
- CNNs: batch 64 (FlexFlow, Sec. 8: "a batch size of 64 for all DNN benchmarks"; FlexFlow
  used 256 for AlexNet and OptCNN 32 per GPU, pass `batch=` for those), 224x224 images
  (299x299 for Inception-v3), 1000 classes. LeNet-5: 32x32 grey images, 10 classes.
- RNNs (FlexFlow, Sec. 8): 40 unrolled steps per recurrent layer; RNNTC 4 LSTM layers of
  1024, RNNLM 2 LSTM layers of 2048 with the Penn Treebank vocabulary (10000), NMT 2 encoder +
  2 decoder layers of 1024 with attention, 32000-token vocabularies, 40 source and 40 target
  steps. Embedding width = hidden width.
- transformer: GPT-2 small (12 layers, width 768, 12 heads, vocabulary 50257) at sequence
  length 512 and batch 16; the LM head is untied from the token embedding (GPT-2 ties them:
  163M parameters here instead of 124M; `tie_weights=True` ties them).

Every model ends in its softmax (the loss op of the graph). Models build in train mode:
Inception-v3 keeps its auxiliary classifier and returns (main, aux) softmaxes.
Recurrent models call the same cell module at every time step (shared parameters).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.deadline import Deadline
from planner.errors import LayerwiseError
from planner.graph.hf_zoo import build_hf, is_hf_name
from planner.graph.opgraph import OpGraph

__all__ = [
    "MODELS",
    "Attention",
    "ModelInfo",
    "RNNAttention",
    "build_model",
    "list_models",
    "model_graph",
]

Inputs = tuple[torch.Tensor, ...]


# -- leaf modules with their own op kind ------------------------------------------------------


class Attention(nn.Module):
    """Multi-head scaled dot-product attention over q, k, v of shape (N, T, C); no weights
    (the q/k/v/output projections are nn.Linear ops around it). Op kind "attention"."""

    layerwise_kind = "attention"

    def __init__(self, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal

    def layerwise_attrs(self) -> dict[str, Any]:
        return {"heads": self.heads, "causal": self.causal}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, t, c = q.shape
        d = c // self.heads

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, -1, self.heads, d).transpose(1, 2)

        scores = heads(q) @ heads(k).transpose(-2, -1) / math.sqrt(d)
        if self.causal:
            mask = torch.ones(t, k.shape[1], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ heads(v)
        return y.transpose(1, 2).reshape(n, t, c)


class RNNAttention(nn.Module):
    """Luong-style (dot) attention of a decoder state h (N, C) over the encoder states, each
    (N, C), followed by the output projection tanh(W [context; h]). Op kind "rnn_attention"."""

    layerwise_kind = "rnn_attention"

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.out = nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor, encoder_states: list[torch.Tensor]) -> torch.Tensor:
        enc = torch.stack(encoder_states, dim=1)  # (N, T, C)
        weights = torch.softmax(torch.bmm(enc, h.unsqueeze(2)).squeeze(2), dim=1)
        context = torch.bmm(weights.unsqueeze(1), enc).squeeze(1)
        return torch.tanh(self.out(torch.cat([context, h], dim=1)))


# -- CNNs ---------------------------------------------------------------------------------------


class LeNet5(nn.Module):
    def __init__(self, num_classes: int = 10, image_size: int = 32, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        side = ((image_size - 4) // 2 - 4) // 2
        self.fc1 = nn.Linear(16 * side * side, 120)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(120, 84)
        self.relu4 = nn.ReLU()
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = self.relu4(self.fc2(self.relu3(self.fc1(x))))
        return F.softmax(self.fc3(x), dim=1)


class AlexNet(nn.Module):
    """The one-tower AlexNet of torchvision (Krizhevsky 2014 variant): 0.714 GMAC at 224."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(3, 2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.avgpool(self.features(x)), 1)
        return F.softmax(self.classifier(x), dim=1)


_VGG16: list[int | str] = [
    64,
    64,
    "M",
    128,
    128,
    "M",
    256,
    256,
    256,
    "M",
    512,
    512,
    512,
    "M",
    512,
    512,
    512,
    "M",
]


class VGG16(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in _VGG16:
            if isinstance(v, str):
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1), nn.ReLU()]
                channels = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.avgpool(self.features(x)), 1)
        return F.softmax(self.classifier(x), dim=1)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck (stride on the 3x3 conv), as in torchvision."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    def __init__(
        self, blocks: tuple[int, int, int, int] = (3, 4, 23, 3), num_classes: int = 1000
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.inplanes = 64
        self.layer1 = self._layer(64, blocks[0], 1)
        self.layer2 = self._layer(128, blocks[1], 2)
        self.layer3 = self._layer(256, blocks[2], 2)
        self.layer4 = self._layer(512, blocks[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _layer(self, planes: int, n: int, stride: int) -> nn.Sequential:
        layer = []
        for b in range(n):
            layer.append(Bottleneck(self.inplanes, planes, stride if b == 0 else 1))
            self.inplanes = planes * Bottleneck.expansion
        return nn.Sequential(*layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return F.softmax(self.fc(x), dim=1)


# -- Inception-v3 (Szegedy et al. 2016, torchvision's layout) --------------------------------


class BasicConv2d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: Any, **kw: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, bias=False, **kw)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg3(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1)


class InceptionA(nn.Module):
    def __init__(self, cin: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = self.branch_pool(_avg3(x))
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, bd, bp], 1)


class InceptionC(nn.Module):
    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        bd = self.branch7x7dbl_1(x)
        bd = self.branch7x7dbl_3(self.branch7x7dbl_2(bd))
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(bd))
        bp = self.branch_pool(_avg3(x))
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(b7))
        bp = F.max_pool2d(x, kernel_size=3, stride=2)
        return torch.cat([b3, b7, bp], 1)


class InceptionE(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)
        b3 = self.branch3x3_1(x)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)
        bp = self.branch_pool(_avg3(x))
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionAux(nn.Module):
    def __init__(self, cin: int, num_classes: int) -> None:
        super().__init__()
        self.conv0 = BasicConv2d(cin, 128, 1)
        self.conv1 = BasicConv2d(128, 768, 5)
        self.fc = nn.Linear(768, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(self.conv0(F.avg_pool2d(x, kernel_size=5, stride=3)))
        x = torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1)
        return self.fc(x)


class InceptionV3(nn.Module):
    def __init__(self, num_classes: int = 1000, aux_logits: bool = True, dropout: float = 0.5):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.maxpool1 = nn.MaxPool2d(3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.maxpool2 = nn.MaxPool2d(3, stride=2)
        self.Mixed_5b = InceptionA(192, 32)
        self.Mixed_5c = InceptionA(256, 64)
        self.Mixed_5d = InceptionA(288, 64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, 128)
        self.Mixed_6c = InceptionC(768, 160)
        self.Mixed_6d = InceptionC(768, 160)
        self.Mixed_6e = InceptionC(768, 192)
        self.AuxLogits = InceptionAux(768, num_classes) if aux_logits else None
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280)
        self.Mixed_7c = InceptionE(2048)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> Any:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(self.maxpool1(x)))
        x = self.maxpool2(x)
        for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e"):
            x = getattr(self, f"Mixed_{name}")(x)
        aux = self.AuxLogits(x) if self.AuxLogits is not None and self.training else None
        for name in ("7a", "7b", "7c"):
            x = getattr(self, f"Mixed_{name}")(x)
        x = torch.flatten(self.dropout(self.avgpool(x)), 1)
        out = F.softmax(self.fc(x), dim=1)
        if aux is None:
            return out
        return out, F.softmax(aux, dim=1)


# -- RNNs (FlexFlow Sec. 8), unrolled with one shared LSTMCell per layer ----------------------


def _lstm_stack(
    cells: nn.ModuleList, x: torch.Tensor, states: list[Any]
) -> tuple[torch.Tensor, list[Any]]:
    """One time step through stacked cells; states[l] is None at step 0."""
    new: list[Any] = []
    for cell, state in zip(cells, states, strict=True):
        h, c = cell(x) if state is None else cell(x, state)
        new.append((h, c))
        x = h
    return x, new


class RNNTC(nn.Module):
    """Text classification: embedding, stacked LSTM layers, softmax on the last step."""

    def __init__(self, vocab: int, hidden: int, layers: int, steps: int, num_classes: int) -> None:
        super().__init__()
        self.steps = steps
        self.embed = nn.Embedding(vocab, hidden)
        self.cells = nn.ModuleList(nn.LSTMCell(hidden, hidden) for _ in range(layers))
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states: list[Any] = [None] * len(self.cells)
        h = tokens
        for t in range(self.steps):
            h, states = _lstm_stack(self.cells, self.embed(tokens[:, t]), states)
        return F.softmax(self.classifier(h), dim=1)


class RNNLM(nn.Module):
    """Language model: embedding, stacked LSTM layers, a softmax over the vocabulary per step."""

    def __init__(self, vocab: int, hidden: int, layers: int, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.embed = nn.Embedding(vocab, hidden)
        self.cells = nn.ModuleList(nn.LSTMCell(hidden, hidden) for _ in range(layers))
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        states: list[Any] = [None] * len(self.cells)
        outs = []
        for t in range(self.steps):
            h, states = _lstm_stack(self.cells, self.embed(tokens[:, t]), states)
            outs.append(F.softmax(self.decoder(h), dim=1))
        return tuple(outs)


class NMT(nn.Module):
    """Encoder-decoder translation: the decoder starts from the encoder's final states and
    attends over the top encoder layer's states at every step; a softmax per target step."""

    def __init__(
        self,
        src_vocab: int,
        tgt_vocab: int,
        hidden: int,
        encoder_layers: int,
        decoder_layers: int,
        src_steps: int,
        tgt_steps: int,
    ) -> None:
        super().__init__()
        if encoder_layers != decoder_layers:
            raise LayerwiseError("nmt needs as many encoder as decoder layers (state handoff)")
        self.src_steps, self.tgt_steps = src_steps, tgt_steps
        self.src_embed = nn.Embedding(src_vocab, hidden)
        self.encoder = nn.ModuleList(nn.LSTMCell(hidden, hidden) for _ in range(encoder_layers))
        self.tgt_embed = nn.Embedding(tgt_vocab, hidden)
        self.decoder = nn.ModuleList(nn.LSTMCell(hidden, hidden) for _ in range(decoder_layers))
        self.attention = RNNAttention(hidden)
        self.project = nn.Linear(hidden, tgt_vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        states: list[Any] = [None] * len(self.encoder)
        memory = []
        for t in range(self.src_steps):
            h, states = _lstm_stack(self.encoder, self.src_embed(src[:, t]), states)
            memory.append(h)
        outs = []
        for t in range(self.tgt_steps):
            h, states = _lstm_stack(self.decoder, self.tgt_embed(tgt[:, t]), states)
            outs.append(F.softmax(self.project(self.attention(h, memory)), dim=1))
        return tuple(outs)


# -- transformer (GPT-style, pre-LN) ----------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.attn = Attention(heads, causal=True)
        self.proj = nn.Linear(width, width)
        self.drop1 = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop1(self.proj(self.attn(self.q(h), self.k(h), self.v(h))))
        return x + self.drop2(self.fc2(self.act(self.fc1(self.ln2(x)))))


class Transformer(nn.Module):
    def __init__(
        self,
        vocab: int,
        seq: int,
        width: int,
        layers: int,
        heads: int,
        dropout: float = 0.1,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        if width % heads:
            raise LayerwiseError(f"transformer width {width} is not divisible by heads {heads}")
        self.tok_embed = nn.Embedding(vocab, width)
        self.pos_embed = nn.Parameter(torch.zeros(1, seq, width))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tie_weights:
            self.head.weight = self.tok_embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok_embed(tokens) + self.pos_embed)
        x = self.ln_f(self.blocks(x))
        return F.softmax(self.head(x), dim=-1)


# -- registry -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """A zoo entry: `builder(device=..., **sizes)` returns (module, example inputs).
    `kinds`: the type a size takes whose default is None (`int` for Llama's `hidden_dim`),
    so that a value given for it can be checked."""

    name: str
    builder: Callable[..., tuple[nn.Module, Inputs]]
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, type] = field(default_factory=dict)


def _images(batch: int, channels: int, size: int, device: torch.device) -> Inputs:
    if device.type == "meta":
        return (torch.empty(batch, channels, size, size, device=device),)
    return (torch.randn(batch, channels, size, size, device=device),)


def _tokens(batch: int, steps: int, vocab: int, device: torch.device) -> torch.Tensor:
    if device.type == "meta":
        return torch.empty(batch, steps, dtype=torch.long, device=device)
    return torch.randint(0, vocab, (batch, steps), device=device)


def _lenet5(device: torch.device, batch: int, image_size: int, num_classes: int) -> Any:
    return LeNet5(num_classes, image_size), _images(batch, 1, image_size, device)


def _alexnet(device: torch.device, batch: int, image_size: int, num_classes: int) -> Any:
    return AlexNet(num_classes), _images(batch, 3, image_size, device)


def _vgg16(device: torch.device, batch: int, image_size: int, num_classes: int) -> Any:
    return VGG16(num_classes), _images(batch, 3, image_size, device)


def _resnet101(device: torch.device, batch: int, image_size: int, num_classes: int) -> Any:
    return ResNet((3, 4, 23, 3), num_classes), _images(batch, 3, image_size, device)


def _inception_v3(
    device: torch.device, batch: int, image_size: int, num_classes: int, aux_logits: bool
) -> Any:
    return InceptionV3(num_classes, aux_logits), _images(batch, 3, image_size, device)


def _rnntc(
    device: torch.device,
    batch: int,
    steps: int,
    hidden: int,
    layers: int,
    vocab: int,
    num_classes: int,
) -> Any:
    model = RNNTC(vocab, hidden, layers, steps, num_classes)
    return model, (_tokens(batch, steps, vocab, device),)


def _rnnlm(
    device: torch.device, batch: int, steps: int, hidden: int, layers: int, vocab: int
) -> Any:
    return RNNLM(vocab, hidden, layers, steps), (_tokens(batch, steps, vocab, device),)


def _nmt(
    device: torch.device,
    batch: int,
    src_steps: int,
    tgt_steps: int,
    hidden: int,
    encoder_layers: int,
    decoder_layers: int,
    src_vocab: int,
    tgt_vocab: int,
) -> Any:
    model = NMT(src_vocab, tgt_vocab, hidden, encoder_layers, decoder_layers, src_steps, tgt_steps)
    src = _tokens(batch, src_steps, src_vocab, device)
    return model, (src, _tokens(batch, tgt_steps, tgt_vocab, device))


def _transformer(
    device: torch.device,
    batch: int,
    seq: int,
    width: int,
    layers: int,
    heads: int,
    vocab: int,
    dropout: float,
    tie_weights: bool,
) -> Any:
    model = Transformer(vocab, seq, width, layers, heads, dropout, tie_weights)
    return model, (_tokens(batch, seq, vocab, device),)


_CNN = {"batch": 64, "image_size": 224, "num_classes": 1000}

MODELS: dict[str, ModelInfo] = {
    m.name: m
    for m in [
        ModelInfo(
            "lenet5",
            _lenet5,
            "LeNet-5: 2 conv + 3 FC layers on 32x32 grey images",
            {"batch": 64, "image_size": 32, "num_classes": 10},
        ),
        ModelInfo("alexnet", _alexnet, "AlexNet, one-tower (torchvision) variant", dict(_CNN)),
        ModelInfo("vgg16", _vgg16, "VGG-16: 13 conv + 3 FC layers", dict(_CNN)),
        ModelInfo(
            "inception_v3",
            _inception_v3,
            "Inception-v3 with its auxiliary classifier, 299x299 images",
            {**_CNN, "image_size": 299, "aux_logits": True},
        ),
        ModelInfo("resnet101", _resnet101, "ResNet-101: bottleneck blocks 3-4-23-3", dict(_CNN)),
        ModelInfo(
            "rnntc",
            _rnntc,
            "RNN text classification: embedding, 4 LSTM layers, softmax on the last step",
            {
                "batch": 64,
                "steps": 40,
                "hidden": 1024,
                "layers": 4,
                "vocab": 20000,
                "num_classes": 2,
            },
        ),
        ModelInfo(
            "rnnlm",
            _rnnlm,
            "RNN language model: embedding, 2 LSTM layers, softmax per step",
            {"batch": 64, "steps": 40, "hidden": 2048, "layers": 2, "vocab": 10000},
        ),
        ModelInfo(
            "nmt",
            _nmt,
            "Neural machine translation: 2+2 LSTM layers, attention and softmax per step",
            {
                "batch": 64,
                "src_steps": 40,
                "tgt_steps": 40,
                "hidden": 1024,
                "encoder_layers": 2,
                "decoder_layers": 2,
                "src_vocab": 32000,
                "tgt_vocab": 32000,
            },
        ),
        ModelInfo(
            "transformer",
            _transformer,
            "GPT-style decoder-only transformer (GPT-2 small sizes), softmax per position",
            {
                "batch": 16,
                "seq": 512,
                "width": 768,
                "layers": 12,
                "heads": 12,
                "vocab": 50257,
                "dropout": 0.1,
                "tie_weights": False,
            },
        ),
    ]
}


def _llm(
    device: torch.device, name: str = "", batch: int = 8, seq: int = 1024, **config: Any
) -> Any:
    from planner.graph.llm import build_llm

    return build_llm(name, device=device, batch=batch, seq=seq, **config)


def _llm_entries() -> list[ModelInfo]:
    """GPT-2, Llama and mixtures of experts (Mixtral, DeepSeek-V3-like, Qwen-MoE-like, Qwen3) as
    their authors write them (`planner.graph.llm`), at published sizes: batch 8, sequence 1024
    (GPT-2) or 2048 (the others); dropout 0 as nanoGPT pretrains."""
    import dataclasses
    from functools import partial

    from planner.graph.llm import LLM_SIZES, GPT2Config, MoEConfig

    out = []
    for name, config in LLM_SIZES.items():
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        hints = typing.get_type_hints(type(config))
        kinds = {k: _not_none(hints[k]) for k, v in fields.items() if v is None}
        gpt = isinstance(config, GPT2Config)
        if isinstance(config, GPT2Config):
            fields["dropout"] = 0.0
            what = f"GPT-2 ({config.n_layer} layers, width {config.n_embd}), nanoGPT's code"
        elif isinstance(config, MoEConfig):
            attention = (
                ", multi-head latent attention"
                if config.mla
                else ", QK-norm"
                if config.qk_norm
                else ""
            )
            what = (
                f"mixture of experts ({config.n_layers} layers, width {config.dim}, top "
                f"{config.top_k} of {config.n_experts} experts{attention}), {config.moe}'s "
                "reference code in a Llama decoder"
            )
        else:
            what = f"Llama ({config.n_layers} layers, width {config.dim}), Meta's reference code"
        defaults = {"batch": 8, "seq": 1024 if gpt else 2048, "dtype": "float32", **fields}
        out.append(ModelInfo(name, partial(_llm, name=name), what, defaults, kinds))
    return out


def _not_none(hint: Any) -> type:
    """The type of an optional annotation (`int | None` -> int)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 else hint


MODELS.update({m.name: m for m in _llm_entries()})


def list_models() -> list[str]:
    """The zoo's model names."""
    return list(MODELS)


def _info(name: str) -> ModelInfo:
    try:
        return MODELS[name]
    except KeyError:
        raise LayerwiseError(
            f"unknown model {name!r}; available models: {', '.join(MODELS)}"
        ) from None


def build_model(
    name: str, *, device: str | torch.device = "meta", **kwargs: Any
) -> tuple[nn.Module, Inputs]:
    """Build zoo model `name` (in train mode) on `device` with its example inputs.

    Keyword arguments override the sizes in `MODELS[name].defaults`; an unknown model or
    keyword raises LayerwiseError listing the valid ones. An `hf:` name is a Hugging Face
    model built from its config (`planner.graph.hf_zoo`), its keywords config fields."""
    if is_hf_name(name):
        return build_hf(name, device=device, **kwargs)
    info = _info(name)
    unknown = sorted(set(kwargs) - set(info.defaults))
    if unknown:
        raise LayerwiseError(
            f"model {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(info.defaults)}"
        )
    sizes = {**info.defaults, **kwargs}
    dev = torch.device(device)
    with dev:
        module, inputs = info.builder(device=dev, **sizes)
    return module.train(), inputs


MAX_BATCH = 2**60  # beyond it a float32 activation's byte size no longer fits in 64 bits


def model_graph(
    name: str,
    batch: int | None = None,
    coarsen: bool = True,
    deadline: Deadline | None = None,
    **kwargs: Any,
) -> OpGraph:
    """The OpGraph of zoo model `name`, captured on the meta device (and coarsened);
    OutOfTime past `deadline`."""
    from planner.graph.capture import capture
    from planner.graph.coarsen import coarsen as coarsen_graph

    if batch is not None:
        if batch >= MAX_BATCH:  # 4-byte samples past 2^62 bytes: 64-bit sizes overflow
            raise LayerwiseError(
                f"batch {batch} of {name!r} is beyond 64-bit tensor sizes: use a smaller batch"
            )
        kwargs["batch"] = batch
    try:
        module, inputs = build_model(name, device="meta", **kwargs)
        graph = capture(module, inputs, name, deadline=deadline)
    except (RuntimeError, OverflowError) as exc:  # e.g. torch: a size beyond 64 bits
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise LayerwiseError(
            f"model {name!r} cannot be captured with {kwargs}: "
            f"{lines[0] if lines else type(exc).__name__} (use smaller sizes)"
        ) from None
    return coarsen_graph(graph) if coarsen else graph
