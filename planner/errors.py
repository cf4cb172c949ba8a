"""Exceptions for misuse and bad input. Search outcomes are statuses, not exceptions."""

from __future__ import annotations


class LayerwiseError(ValueError):
    """Base class: bad input or misuse, with a message that says what is wrong."""


class GraphError(LayerwiseError):
    """An OpGraph is malformed: a cycle, a dangling input, a shape mismatch, an unknown op kind."""


class DeviceGraphError(LayerwiseError):
    """A DeviceGraph is malformed: a zero bandwidth, an unreachable device, an unknown preset."""


class ConfigError(LayerwiseError):
    """A parallel configuration does not fit its op or the devices."""


class StrategyError(LayerwiseError):
    """A strategy file does not match the graph or machine it is used with."""


class ProblemError(LayerwiseError):
    """A Problem (cost tables) is malformed or cannot be built."""
