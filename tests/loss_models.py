"""Models that compute their loss inside `forward`, in the common ways people write it.
layerwise plans the model and the runtime computes the loss (the cross-entropy of the
model's outputs), so capture refuses each of these (tests/test_capture_loss.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, CLASSES = 16, 10


class _MLP(nn.Module):
    """linear - relu - linear: the logits the losses below are computed from."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class CrossEntropy(_MLP):
    """forward(x, targets) returns F.cross_entropy."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), targets)


class CrossEntropyOwnTargets(_MLP):
    """forward(x) makes its targets itself and returns F.cross_entropy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        targets = torch.zeros(x.shape[0], dtype=torch.long)
        return F.cross_entropy(self.logits(x), targets)


class CrossEntropyModule(_MLP):
    """The module form: nn.CrossEntropyLoss."""

    def __init__(self) -> None:
        super().__init__()
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.logits(x), targets)


class CrossEntropyPerSample(_MLP):
    """F.cross_entropy(reduction="none"): one loss per sample."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.logits(x), targets, reduction="none")


class NllAfterLogSoftmax(_MLP):
    """F.nll_loss after F.log_softmax."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(F.log_softmax(self.logits(x), dim=1), targets)


class Mse(_MLP):
    """A regression loss: F.mse_loss against float targets."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.logits(x), y)


class L1(_MLP):
    """F.l1_loss against float targets."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(self.logits(x), y)


class GatheredMean(_MLP):
    """The NLL written by hand: the log-probabilities of the targets, gathered, `.mean()`."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(self.logits(x), dim=1)
        return -logp.gather(1, targets.unsqueeze(1)).mean()


class GatheredMeanOwnTargets(_MLP):
    """The same with targets made inside forward: no loss function, only a scalar returned."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(self.logits(x), dim=1)
        return -logp[:, :1].mean()


class LogitsAndLoss(_MLP):
    """nanoGPT's form: forward(x, targets=None) returns the logits, and with targets also
    their loss."""

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits, targets)
