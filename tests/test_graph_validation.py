"""A graph JSON whose shapes disagree with what its op kinds compute is refused with one
line naming the op (issue 42: a lenet5 graph whose conv lost its channel dim was planned).
Each case mutates a valid zoo graph's JSON the way a hand edit would: a dim deleted, a dim
renamed, a size or a weight shape changed so that the op's weight and its producer disagree."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main
from planner.errors import GraphError
from planner.graph.opgraph import OpGraph
from planner.graph.zoo import model_graph

Mutation = Callable[[dict[str, Any]], None]


@pytest.fixture(scope="module")
def lenet5() -> dict[str, Any]:
    return model_graph("lenet5", batch=8).to_json()


@pytest.fixture(scope="module")
def gpt2() -> dict[str, Any]:
    return model_graph("gpt2", batch=2, seq=16, n_layer=1).to_json()


def op(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(o for o in data["ops"] if o["name"] == name)


def first(data: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(o for o in data["ops"] if o["kind"] == kind)


def rename(out: dict[str, int], old: str, new: str) -> None:
    out.update({(new if d == old else d): s for d, s in out.items()})
    del out[old]


def refused(data: dict[str, Any], mutate: Mutation, says: str) -> str:
    bad = copy.deepcopy(data)
    mutate(bad)
    with pytest.raises(GraphError) as info:
        OpGraph.from_json(bad)
    message = str(info.value)
    assert "\n" not in message
    assert says in message, message
    return message


def test_the_graphs_mutated_here_are_valid(lenet5: dict[str, Any], gpt2: dict[str, Any]) -> None:
    assert OpGraph.from_json(lenet5).to_json() == lenet5
    assert OpGraph.from_json(gpt2).to_json() == gpt2


LENET5_CASES: dict[str, tuple[Mutation, str]] = {
    "conv output channel deleted": (
        lambda g: op(g, "conv1")["output"].pop("channel"),
        "op 'conv1' (conv2d): its output ('sample', 'height', 'width') has no 'channel'",
    ),
    "conv output channel renamed": (
        lambda g: rename(op(g, "conv1")["output"], "channel", "channels"),
        "op 'conv1' (conv2d): its output ('sample', 'height', 'width', 'channels') has no "
        "'channel'",
    ),
    "pool output channel deleted": (
        lambda g: op(g, "pool1")["output"].pop("channel"),
        "op 'pool1' (pool2d): its output",
    ),
    "input channel renamed": (
        lambda g: rename(op(g, "x")["output"], "channel", "colour"),
        "op 'conv1' (conv2d): input 0 ('x') of dims ('sample', 'height', 'width', 'colour') "
        "has no 'channel'",
    ),
    "conv weight reads other channels than its producer gives": (
        lambda g: op(g, "conv2")["params"][0].update(shape=[16, 5, 5, 5]),
        "op 'conv2' (conv2d): input 'pool1' has 6 channels but weight 'conv2.weight' "
        "(16, 5, 5, 5) with groups 1 reads 5",
    ),
    "conv and pool channels changed together, away from the weights": (
        lambda g: [op(g, n)["output"].update(channel=7) for n in ("conv1", "pool1")],
        "op 'conv1' (conv2d): weight 'conv1.weight' (6, 1, 5, 5) gives 6 channels, the "
        "output has 7",
    ),
    "conv kernel attr differs from its weight": (  # dilated: the same output size
        lambda g: op(g, "conv1")["attrs"].update(kernel=[3, 3], dilation=[2, 2]),
        "op 'conv1' (conv2d): attr kernel [3, 3] differs from weight 'conv1.weight'",
    ),
    "conv padding negative": (
        lambda g: op(g, "conv1")["attrs"].update(kernel=[5, 5], padding=[-1, -1], stride=[1, 1]),
        "op 'conv1' (conv2d): attr padding [-1, -1] must be a pair of integers >= 0",
    ),
    "linear weight reads other features than its producer gives": (
        lambda g: op(g, "fc1")["params"][0].update(shape=[120, 399]),
        "op 'fc1' (linear): input 'pool2' ('sample', 'channel', 'height', 'width') gives "
        "400 features but weight 'fc1.weight' (120, 399) reads 399",
    ),
    "linear output channel renamed": (
        lambda g: rename(op(g, "fc2")["output"], "channel", "feature"),
        "op 'fc2' (linear): its output ('sample', 'feature') has no 'channel'",
    ),
    "linear output channels changed, away from its weight": (
        lambda g: (
            op(g, "fc2")["output"].update(channel=85),
            op(g, "fc3")["params"][0].update(shape=[10, 85]),
        ),
        "op 'fc2' (linear): weight 'fc2.weight' (84, 120) gives 84 output features, the "
        "output has 85 channels",
    ),
    "softmax output channel deleted": (
        lambda g: op(g, "softmax")["output"].pop("channel"),
        "op 'softmax' (softmax): its output ('sample',) has no 'channel'",
    ),
}


@pytest.mark.parametrize("case", LENET5_CASES)
def test_a_mutated_lenet5_is_refused_naming_the_op(lenet5: dict[str, Any], case: str) -> None:
    mutate, says = LENET5_CASES[case]
    refused(lenet5, mutate, says)


def gpt2_cases(g: dict[str, Any]) -> dict[str, tuple[Mutation, str]]:
    norm, attention = first(g, "norm")["name"], first(g, "attention")["name"]
    embedding = first(g, "embedding")["name"]
    linear = next(o for o in g["ops"] if o["kind"] == "linear" and o["inputs"] == [norm])
    return {
        "norm output length deleted": (
            lambda g: op(g, norm)["output"].pop("length"),
            f"op {norm!r} (norm): input 0",
        ),
        "norm parameter of another width": (
            lambda g: op(g, norm)["params"][0].update(shape=[700]),
            f"op {norm!r} (norm): parameter",
        ),
        "attention output length renamed": (
            lambda g: rename(op(g, attention)["output"], "length", "time"),
            f"op {attention!r} (attention): its output",
        ),
        "embedding table of another width": (
            lambda g: op(g, embedding)["params"][0].update(shape=[50257, 700]),
            f"op {embedding!r} (embedding): table",
        ),
        "linear weight reads another width": (
            lambda g: op(g, linear["name"])["params"][0].update(shape=[2304, 700]),
            f"op {linear['name']!r} (linear): input {norm!r}",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "norm output length deleted",
        "norm parameter of another width",
        "attention output length renamed",
        "embedding table of another width",
        "linear weight reads another width",
    ],
)
def test_a_mutated_gpt2_is_refused_naming_the_op(gpt2: dict[str, Any], case: str) -> None:
    mutate, says = gpt2_cases(gpt2)[case]
    refused(gpt2, mutate, says)


def test_plan_refuses_a_graph_whose_conv_lost_its_channel(
    lenet5: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's reproduction: it was planned (exit 0)."""
    bad = copy.deepcopy(lenet5)
    del bad["ops"][1]["output"]["channel"]
    path = tmp_path / "g.json"
    path.write_text(json.dumps(bad))
    argv = ["plan", "--graph", str(path), "--devices", "p100-1x2", "--backend", "elimination"]
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: op 'conv1' (conv2d): its output ('sample', 'height', 'width') has no "
        "'channel' dimension; a conv2d's output is (sample, channel, height, width): add it "
        "(or correct its name)"
    ]
