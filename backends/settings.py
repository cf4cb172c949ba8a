"""Backend settings: each backend's typed, validated `SolveOptions.extra`.

A backend declares its settings as a frozen dataclass deriving from `BackendSettings` (typed,
documented fields with their defaults; `Annotated` rules such as `POSITIVE` for the values).
`BackendSettings.of(extra)` turns a mapping into that object once: every name must be a
field, every value of the field's type and within its rules; otherwise one BackendError line
names it and lists the valid names. A settings object is itself a read-only mapping of its
fields, so it can be given as `extra` directly.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
from collections.abc import Callable, Iterator, Mapping
from typing import (
    Annotated,
    Any,
    Literal,
    Self,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from planner.errors import BackendError

__all__ = ["POSITIVE", "BackendSettings", "Check", "Coerce", "at_least", "between"]


@dataclasses.dataclass(frozen=True)
class Check:
    """A rule a setting's value must meet, put in its type: `Annotated[float, POSITIVE]`.
    `must` completes "setting 'x' must be ..." in the error."""

    must: str
    test: Callable[[Any], bool]


@dataclasses.dataclass(frozen=True)
class Coerce:
    """A conversion applied to a given value before its type is checked, in the setting's
    type: `Annotated[tuple[float, float], Coerce(pair)]` (e.g. one number for a pair)."""

    convert: Callable[[Any], Any]


POSITIVE = Check("a positive number", lambda v: v > 0)


def at_least(low: float, what: str = "a number") -> Check:
    """The rule value >= low."""
    return Check(f"{what} >= {low:g}", lambda v: v >= low)


def between(low: float, high: float, what: str = "a number") -> Check:
    """The rule low <= value <= high."""
    return Check(f"{what} in [{low:g}, {high:g}]", lambda v: low <= v <= high)


class _Invalid(Exception):
    """A value does not fit a setting's type or rule (reported by `BackendSettings.of`)."""


@dataclasses.dataclass(frozen=True)
class BackendSettings(Mapping[str, Any]):
    """Base of every backend's settings: a frozen dataclass whose fields are the settings,
    typed, with defaults, and which reads as a mapping of its fields (so it can be given as
    `SolveOptions.extra` itself, and `dict(settings)` gives it back as one).

    Field types understood by `of`: bool, int, float (an int is taken), str, Literal[...],
    unions (`X | None`), tuple[X, ...] and tuple[X, Y] (from a list or tuple), Mapping[K, V],
    Any, and another BackendSettings class (from a mapping: a backend's settings inside
    another's); `Annotated[T, Coerce(f), Check(...)]` adds a conversion and value rules."""

    @classmethod
    def of(cls, extra: Mapping[str, Any], where: str = "") -> Self:
        """The settings `extra` gives (the defaults for the names it leaves out), checked:
        one BackendError line naming the first bad name or value and listing the valid
        names otherwise. `where` starts the message (e.g. "backend 'search'")."""
        where = where or f"settings {cls.__name__}"
        spec = _spec(cls)
        valid = f"its settings are: {', '.join(spec)}" if spec else "it takes no settings"
        if not isinstance(extra, Mapping):
            raise BackendError(
                f"{where} takes its settings as a mapping of names to values, got "
                f"{_short(extra)}; {valid}"
            )
        unknown = [k for k in extra if k not in spec]
        if unknown:
            s = "s" if len(unknown) > 1 else ""
            names = ", ".join(repr(k) for k in unknown)
            raise BackendError(f"{where} has no setting{s} {names}; {valid}")
        values = {}
        for key, value in extra.items():
            try:
                values[key] = _convert(spec[key], value, f"{where} setting {key!r}")
            except _Invalid:
                raise BackendError(
                    f"{where} setting {key!r} must be {_describe(spec[key])}, got "
                    f"{_short(value)}; {valid}"
                ) from None
        return cls(**values)

    def __getitem__(self, key: str) -> Any:
        if key not in _spec(type(self)):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_spec(type(self)))

    def __len__(self) -> int:
        return len(_spec(type(self)))


@functools.cache
def _spec(cls: type[BackendSettings]) -> dict[str, Any]:
    """The settings of a class, in field order, with their (Annotated) types."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _short(value: Any, width: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _convert(tp: Any, value: Any, where: str) -> Any:
    """`value` as a setting of type `tp` (its conversions and rules applied); _Invalid if it
    is not one (a nested settings mapping raises its own BackendError)."""
    rules: tuple[Any, ...] = ()
    if get_origin(tp) is Annotated:
        tp, *extras = get_args(tp)
        rules = tuple(extras)
    for rule in rules:
        if isinstance(rule, Coerce):
            value = rule.convert(value)
    value = _typed(tp, value, where)
    for rule in rules:
        if isinstance(rule, Check) and not rule.test(value):
            raise _Invalid
    return value


def _typed(tp: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if origin is Annotated:
        return _convert(tp, value, where)
    if isinstance(tp, type) and issubclass(tp, BackendSettings):
        if not isinstance(value, Mapping):
            raise _Invalid
        return tp.of(value, where)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise _Invalid
    if origin is Union or origin is types.UnionType:
        for arg in args:
            try:
                return _typed(arg, value, where)
            except _Invalid:
                continue
        raise _Invalid
    if tp is type(None):
        if value is None:
            return None
        raise _Invalid
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Invalid
    if tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        raise _Invalid
    if tp is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        raise _Invalid
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Invalid
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise _Invalid
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(args[0], v, where) for v in value)
        if len(value) != len(args):
            raise _Invalid
        return tuple(_typed(a, v, where) for a, v in zip(args, value, strict=True))
    if origin is Mapping or origin is dict:
        if not isinstance(value, Mapping):
            raise _Invalid
        key, item = args
        return {_typed(key, k, where): _typed(item, v, where) for k, v in value.items()}
    raise TypeError(f"a setting of type {tp!r} is not supported ({where})")


def _describe(tp: Any) -> str:
    """What a value of a setting's type must be, for the error message."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        checks = [r.must for r in args[1:] if isinstance(r, Check)]
        return " and ".join(checks) if checks else _describe(args[0])
    parts = _alternatives(tp)
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def _alternatives(tp: Any) -> list[str]:
    """The alternatives a value of the type is one of, described."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return [repr(a) for a in args]
    if origin is Union or origin is types.UnionType:
        return [part for a in args for part in _alternatives(a)]
    if tp is bool:
        return ["True", "False"]
    return [_one(tp)]


def _one(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return _describe(tp)
    if tp is Any:
        return "any value"
    if isinstance(tp, type) and issubclass(tp, BackendSettings):
        return f"a mapping of settings ({', '.join(_spec(tp))})"
    simple = {type(None): "None", int: "an integer", float: "a number", str: "a string"}
    if tp in simple:
        return simple[tp]
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list (each item {_describe(args[0])})"
        return f"a list of {len(args)} items ({', '.join(_describe(a) for a in args)})"
    if origin is Mapping or origin is dict:
        return f"a mapping ({_describe(args[0])} to {_describe(args[1])})"
    return repr(tp)
