"""The model zoo and its capture into OpGraphs: FLOPs, parameters, shared weights, errors."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo_sizes import LLMS, SMALL

from planner.errors import GraphError, LayerwiseError
from planner.graph.capture import capture
from planner.graph.coarsen import coarsen
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import MODELS, LeNet5, build_model, list_models, model_graph


@cache
def raw_graph(name: str, batch: int | None = None) -> OpGraph:
    return model_graph(name, batch=batch, coarsen=False, **SMALL.get(name, {}))


def module_param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())  # shared: once


def test_list_models_names_the_zoo() -> None:
    assert list_models() == [
        "lenet5",
        "alexnet",
        "vgg16",
        "inception_v3",
        "resnet101",
        "rnntc",
        "rnnlm",
        "nmt",
        "transformer",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "llama2-7b",
        "llama2-13b",
        "llama2-70b",
        "llama3-8b",
        "mixtral-8x7b",
        "deepseek-v3-like",
        "qwen-moe-like",
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
    ]
    for name, info in MODELS.items():
        assert info.name == name and info.description and "batch" in info.defaults


# Published forward cost, 2 FLOPs per multiply-add (torchvision's GMAC x 2), per image.
PUBLISHED_FLOPS = {
    "alexnet": 1.43e9,
    "vgg16": 30.9e9,
    "resnet101": 15.6e9,
    "inception_v3": 11.4e9,  # main path 5.71 GMAC; the aux head adds 0.1%
}


def per_image_flops(name: str) -> float:
    """Forward FLOPs of the default batch's capture (shared with the tests below) per image:
    FLOPs scale with the batch (test_flops_scale_with_batch)."""
    return raw_graph(name).forward_flops / MODELS[name].defaults["batch"]


@cache
def inception_without_aux_head() -> OpGraph:
    return model_graph("inception_v3", batch=1, coarsen=False, aux_logits=False)


@pytest.mark.parametrize("name", sorted(PUBLISHED_FLOPS))
def test_forward_flops_per_image_match_published(name: str) -> None:
    assert per_image_flops(name) == pytest.approx(PUBLISHED_FLOPS[name], rel=0.05)


def test_inception_flops_without_aux_head() -> None:
    g = inception_without_aux_head()
    assert g.forward_flops == pytest.approx(11.4e9, rel=0.05)
    assert g.forward_flops < per_image_flops("inception_v3")


def test_flops_scale_with_batch() -> None:
    assert raw_graph("alexnet").forward_flops == pytest.approx(
        64 * raw_graph("alexnet", batch=1).forward_flops
    )


# torchvision's parameter counts (AlexNet 61.1M, VGG-16 138.4M, ResNet-101 44.5M,
# Inception-v3 27.2M with the aux head, 23.8M without).
@pytest.mark.parametrize(
    ("name", "kwargs", "count"),
    [
        ("alexnet", {}, 61_100_840),
        ("vgg16", {}, 138_357_544),
        ("resnet101", {}, 44_549_160),
        ("inception_v3", {}, 27_161_264),
        ("inception_v3", {"aux_logits": False}, 23_834_568),
        ("lenet5", {}, 61_706),
    ],
)
def test_parameter_counts_match_published(name: str, kwargs: dict, count: int) -> None:
    g = inception_without_aux_head() if kwargs else raw_graph(name)  # any batch: its captures
    assert g.parameter_bytes == 4 * count


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_captures_valid_graph_with_json_round_trip(name: str) -> None:
    g = raw_graph(name)
    module, _ = build_model(name, **SMALL.get(name, {}))
    assert g.name == name
    assert g.parameter_bytes == module_param_bytes(module)
    assert g.ops[0].kind == "input"
    assert any(op.kind == "softmax" for op in g.ops)
    text = json.dumps(g.to_json())
    back = OpGraph.from_json(json.loads(text))
    assert back == g
    assert back.fingerprint() == g.fingerprint()
    for op in g.ops:
        assert op.mem_bytes > 0  # every op moves bytes; FLOPs only where there is a matmul
        if op.kind in ("conv2d", "linear", "lstm", "attention", "rnn_attention"):
            assert op.flops > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_default_graphs_stay_at_a_few_hundred_ops(name: str) -> None:
    # model_graph's own steps on the capture the test above made: capture, then coarsen
    g = coarsen(raw_graph(name))
    if name in ("lenet5", "gpt2"):
        assert g == model_graph(name, **SMALL.get(name, {}))
    if name in LLMS:  # their default sizes are for planning, not for a quick test
        assert len(g) <= 20 * 2 + 10  # a couple dozen ops per layer
        return
    assert 5 <= len(g) <= 400
    assert g.ops[0].output.size("sample") == MODELS[name].defaults["batch"]


@pytest.mark.parametrize(
    ("name", "groups"),
    [
        ("rnntc", {"embed": 5, "cells.0": 5, "cells.3": 5}),
        ("rnnlm", {"embed": 5, "cells.0": 5, "cells.1": 5, "decoder": 5}),
        ("nmt", {"src_embed": 4, "encoder.1": 4, "decoder.0": 3, "attention": 3, "project": 3}),
    ],
)
def test_recurrent_models_share_parameters_per_layer(name: str, groups: dict[str, int]) -> None:
    g = raw_graph(name)
    for group, uses in groups.items():
        ops = [op for op in g.ops if op.param_group == group]
        assert len(ops) == uses, group
        assert len({op.params for op in ops}) == 1
        assert [op.name for op in ops] == [f"{group}@{t}" for t in range(uses)]
    unshared = sum(op.param_bytes for op in g.ops)
    module, _ = build_model(name, **SMALL[name])
    assert g.parameter_bytes == module_param_bytes(module) < unshared


def test_lstm_steps_read_input_then_previous_step() -> None:
    g = raw_graph("rnnlm")
    first, second = g.op("cells.1@0"), g.op("cells.1@1")
    assert first.kind == "lstm" and first.inputs == ("cells.0@0",)
    assert second.inputs == ("cells.0@1", "cells.1@0")
    assert second.output.shape == (("sample", 64), ("channel", 32))
    emb = g.op("embed@3")
    assert emb.inputs == ("tokens",) and emb.attr("select") == ("length", 3)
    assert emb.output.dims == ("sample", "channel")


def test_nmt_attention_reads_every_encoder_state() -> None:
    g = raw_graph("nmt")
    attn = g.op("attention@2")
    assert attn.kind == "rnn_attention"
    assert attn.inputs == (
        "decoder.1@2",
        "encoder.1@0",
        "encoder.1@1",
        "encoder.1@2",
        "encoder.1@3",
    )
    # The decoder starts from the encoder's final state of the same layer.
    assert g.op("decoder.0@0").inputs == ("tgt_embed@0", "encoder.0@3")
    assert sum(op.kind == "softmax" for op in g.ops) == 3


def test_transformer_attention_and_shapes() -> None:
    g = raw_graph("transformer")
    attn = g.op("blocks.1.attn")
    assert attn.kind == "attention"
    assert attn.attr("heads") == 4 and attn.attr("causal") is True
    assert attn.inputs == ("blocks.1.q", "blocks.1.k", "blocks.1.v")
    assert attn.output.shape == (("sample", 16), ("length", 16), ("channel", 32))
    assert g.op("blocks.0.ln1").attr("norm") == "layer"
    assert g.op("tokens").output.dims == ("sample", "length")
    # attention FLOPs: QK^T and AV, 2 * 2 * N * T * T * C
    assert attn.flops == 4 * 16 * 16 * 16 * 32


def test_tied_transformer_weights_are_counted_once() -> None:
    kwargs = {**SMALL["transformer"], "tie_weights": True}
    g = model_graph("transformer", coarsen=False, **kwargs)
    module, _ = build_model("transformer", **kwargs)
    assert g.op("head").param_group == g.op("tok_embed").param_group == "tok_embed"
    assert g.parameter_bytes == module_param_bytes(module)


def test_cnn_op_names_follow_module_paths() -> None:
    g = raw_graph("resnet101")
    conv = g.op("layer1.0.conv1")
    assert conv.kind == "conv2d" and conv.attr("kernel") == (1, 1)
    assert g.op("layer1.0.downsample.0").attr("stride") == (1, 1)
    assert g.op("layer2.0.conv2").attr("stride") == (2, 2)
    assert g.op("layer1.0.add").inputs == ("layer1.0.bn3", "layer1.0.downsample.1")
    assert g.op("layer1.0.bn1").attr("norm") == "batch"
    pool = g.op("avgpool")
    assert pool.attr("kernel") == (7, 7) and pool.output.size("height") == 1
    cat = raw_graph("inception_v3").op("Mixed_5b.cat")
    assert cat.kind == "concat" and cat.attr("dim") == "channel"
    assert cat.attr("offsets") == (0, 64, 128, 224)


def test_build_model_rejects_unknown_names_and_options() -> None:
    with pytest.raises(LayerwiseError, match="unknown model 'resnet50'.*alexnet.*transformer"):
        build_model("resnet50")
    with pytest.raises(LayerwiseError, match="'depth'.*valid options: batch, image_size"):
        build_model("vgg16", depth=19)


def test_models_run_for_real_on_cpu() -> None:
    module, inputs = build_model("rnnlm", device="cpu", batch=2, **SMALL["rnnlm"])
    outs = module(*inputs)
    assert len(outs) == 5 and outs[0].shape == (2, 100)
    assert torch.allclose(outs[0].sum(dim=1), torch.ones(2))
    module, inputs = build_model("transformer", device="cpu", batch=2, **SMALL["transformer"])
    assert module(*inputs).shape == (2, 16, 100)


def test_capture_of_cpu_module_runs_on_meta_and_matches() -> None:
    module, inputs = build_model("lenet5", device="cpu", batch=8)
    assert isinstance(module, LeNet5)
    devices: list[str] = []
    module.conv1.register_forward_pre_hook(lambda m, args: devices.append(args[0].device.type))
    g = capture(module, inputs, "lenet5")
    assert devices and set(devices) == {"meta"}  # traced and run on meta, never on the CPU
    assert module.conv1.weight.device.type == "cpu"
    assert g == model_graph("lenet5", batch=8, coarsen=False)


def test_full_size_capture_is_meta_only() -> None:
    module, inputs = build_model("vgg16")
    assert inputs[0].device.type == "meta"
    g = capture(module, inputs, "vgg16")
    assert g.forward_flops == pytest.approx(64 * 30.9e9, rel=0.05)


class _WithConv1d(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Conv1d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _WithMatmul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, x)


class _SlicesActivations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[:, 1]  # drops the channel dim (a range, [:, 1:], is a slice op)


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


@pytest.mark.parametrize(
    ("module", "shape", "message"),
    [
        (_WithConv1d(), (2, 3, 4), r"'body' \(call_module body: torch.nn.modules.conv.Conv1d\)"),
        (nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4)), (2, 3, 4), "LSTM"),
        (_WithMatmul(), (2, 4, 4), "'bmm' .*call_function bmm"),
        (_SlicesActivations(), (2, 4), "slices 'fc'.* an index that drops a dim"),
        (_DataDependent(), (2, 4), "could not trace"),
    ],
)
def test_unmappable_nodes_raise_graph_error(
    module: nn.Module, shape: tuple[int, ...], message: str
) -> None:
    with pytest.raises(GraphError, match=message):
        capture(module, (torch.empty(shape, device="meta"),), "bad")


class _UserNet(nn.Module):
    """torchvision-style idioms: functional ops, x.view(x.size(0), -1), nn.Flatten, Identity."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding="same")
        self.skip = nn.Identity()
        self.flat = nn.Flatten()
        self.fc = nn.Linear(8 * 4 * 4, 5)
        self.fc2 = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(self.skip(F.relu(self.conv(x))), 2)
        y = y + y
        out = self.fc(y.view(y.size(0), -1)) * 0.5 + self.fc2(self.flat(y))
        return F.log_softmax(out, dim=1)


def test_capture_of_common_idioms() -> None:
    g = capture(_UserNet(), (torch.empty(2, 3, 8, 8),), "user")
    kinds = {op.name: op.kind for op in g.ops}
    assert kinds == {
        "x": "input",
        "conv": "conv2d",
        "relu": "elementwise",
        "max_pool2d": "pool2d",
        "add": "elementwise",
        "view": "flatten",
        "fc": "linear",
        "mul": "elementwise",
        "flat": "flatten",
        "fc2": "linear",
        "add_1": "elementwise",
        "log_softmax": "softmax",
    }
    assert g.op("conv").attr("padding") == (1, 1)
    assert g.op("add").inputs == ("max_pool2d", "max_pool2d")
    assert g.op("max_pool2d").attr("stride") == (2, 2)


@pytest.mark.benchmark
def test_capture_speed_vgg16(benchmark: Any) -> None:
    benchmark(model_graph, "vgg16")
