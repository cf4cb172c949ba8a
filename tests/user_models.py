"""Models that are not in the zoo, as a user writes them (importable by worker processes:
factories are named "user_models:make_cnn" with the tests folder on the path)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SmallCNN(nn.Module):
    """conv - batch norm - relu - pool - conv - pool - linear - relu - linear - log_softmax:
    the usual classifier, ending in log-probabilities."""

    def __init__(self, classes: int = 5, width: int = 4, poison: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4 * 4, 16)
        self.fc2 = nn.Linear(16, classes)
        if poison:  # a NaN weight: the first loss is NaN
            with torch.no_grad():
                self.fc2.weight[0, 0] = math.nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


class LogSoftmaxMLP(nn.Module):
    """linear - relu - linear - nn.LogSoftmax (the module form of the head)."""

    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.head = nn.LogSoftmax(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.relu(self.fc1(x))))


class FunctionalLogSoftmaxMLP(LogSoftmaxMLP):
    """The same with `F.log_softmax` (the issue's reproduction)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def make_cnn(classes: int = 5, width: int = 4, poison: bool = False) -> SmallCNN:
    """A factory, as `planner.plan("user_models:make_cnn", ...)` names it."""
    return SmallCNN(classes, width, poison)


class ConvBlock(nn.Module):
    """conv - batch norm - relu, with a residual add: a numbered block of `BlockCNN`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


class BlockCNN(nn.Module):
    """A stem, two numbered blocks of conv - batch norm - relu (`blocks.0`, `blocks.1`: what
    activation recomputation recomputes), pooling and a log-softmax head."""

    def __init__(self, classes: int = 5, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList([ConvBlock(width) for _ in range(2)])
        self.fc = nn.Linear(width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        x = F.max_pool2d(x, 2)
        return F.log_softmax(self.fc(torch.flatten(x, 1)), dim=1)
