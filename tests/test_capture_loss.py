"""A model that computes its loss inside forward is refused at capture, naming the fx node
that computes it (issue 42, item 7). Before, F.cross_entropy and nn.CrossEntropyLoss were
planned as a softmax of the logits (with the targets as a data input) and only the runtime
refused them; the other forms were refused as an unknown op, without saying what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loss_models import (
    CLASSES,
    FEATURES,
    L1,
    CrossEntropy,
    CrossEntropyModule,
    CrossEntropyOwnTargets,
    CrossEntropyPerSample,
    GatheredMean,
    GatheredMeanOwnTargets,
    LogitsAndLoss,
    Mse,
    NllAfterLogSoftmax,
)
from torch import nn

import planner
from planner.errors import GraphError
from planner.graph.capture import capture

X = torch.randn(8, FEATURES)
CLASS_TARGETS = torch.randint(0, CLASSES, (8,))
FLOAT_TARGETS = torch.randn(8, CLASSES)

# (model, example inputs, the fx node the refusal names)
CASES = [
    (CrossEntropy, (X, CLASS_TARGETS), "cross_entropy"),
    (CrossEntropyOwnTargets, (X,), "cross_entropy"),
    (CrossEntropyModule, (X, CLASS_TARGETS), "criterion"),
    (CrossEntropyPerSample, (X, CLASS_TARGETS), "cross_entropy"),
    (NllAfterLogSoftmax, (X, CLASS_TARGETS), "nll_loss"),
    (Mse, (X, FLOAT_TARGETS), "mse_loss"),
    (L1, (X, FLOAT_TARGETS), "l1_loss"),
    (GatheredMean, (X, CLASS_TARGETS), "mean"),
    (GatheredMeanOwnTargets, (X,), "mean"),
    (LogitsAndLoss, (X, CLASS_TARGETS), "cross_entropy"),
]


@pytest.mark.parametrize(("cls", "inputs", "node"), CASES, ids=[c[0].__name__ for c in CASES])
def test_a_loss_computed_in_forward_is_refused_at_capture_naming_its_node(
    cls: type[nn.Module], inputs: tuple[torch.Tensor, ...], node: str
) -> None:
    with pytest.raises(GraphError) as info:
        planner.plan(cls(), "p100-1x4", example_inputs=inputs, backend="elimination")
    message = str(info.value)
    assert "\n" not in message
    assert f"fx node {node!r}" in message
    assert "compute the loss outside forward" in message


def test_targets_left_at_their_default_plan_the_logits_with_their_loss_head() -> None:
    """nanoGPT's forward(x, targets=None) without the targets: the logits are traced, and
    capture adds the log_softmax the runtime trains with."""
    graph = capture(LogitsAndLoss(), (X,), "mlp")
    heads = [op for op in graph.ops if op.kind == "softmax"]
    assert [(op.attr("op"), op.attr("implicit")) for op in heads] == [("log_softmax", True)]
    assert graph.ops[-1].output.dims == ("sample", "channel")


class _Softmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc(x), dim=1)


def test_a_softmax_output_is_still_a_softmax_op() -> None:
    graph = capture(_Softmax(), (X,), "softmax")
    assert [(op.kind, op.attr("op")) for op in graph.ops] == [
        ("input", None),
        ("linear", None),
        ("softmax", "softmax"),
    ]
