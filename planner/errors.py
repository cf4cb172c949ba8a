"""Exceptions for misuse and bad input (search outcomes are statuses)."""

from __future__ import annotations

from typing import Any


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


class ExportError(LayerwiseError):
    """A strategy cannot be expressed as DTensor placements (or the module does not match)."""


class ProblemError(LayerwiseError):
    """A Problem (cost tables) is malformed or cannot be built."""


class BackendError(LayerwiseError):
    """A backend cannot run: unknown name, missing package, unsupported objective or problem,
    or settings it does not take."""


def given(value: Any, instance: bool = False) -> str:
    """A value a caller gave, as an error message shows it: its repr and its type, or "the
    class X itself" for a class; `instance`: an instance of a class was expected, and the
    message says to pass one."""
    if isinstance(value, type):
        name = value.__name__
        hint = f" (pass an instance, e.g. {name}(...))" if instance else ""
        return f"the class {name} itself{hint}"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} (a {type(value).__name__})"
