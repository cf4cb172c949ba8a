"""The contract every search backend follows (docs/architecture.md, Backends).

A backend sees only the frozen `Problem` and `SolveOptions`. `Backend.solve` checks that the
backend can run, calls the subclass's `_solve`, and re-scores the returned choices with
planner's evaluators: the `objective` of a result is never the backend's own number (that
is kept in `stats["reported_objective"]` when the backend gives one).

Stopping early. `solve` makes one deadline (`planner.deadline.Deadline`: the caller's, or
`time_limit` from now), keeps a share of it for the re-score, and hands the rest to `_solve`
as `options.deadline`; every search loop looks at `past(options.deadline.at)`: true once it
has passed *or* the user asked to stop. While `solve` runs in the main thread, the first
Ctrl-C (SIGINT) only asks to stop (`request_stop`): the backend returns its best answer so
far and `solve` marks the result with limit INTERRUPTED (status FEASIBLE unless optimality
was proven). A second Ctrl-C raises KeyboardInterrupt as usual.

Settings. Each backend declares its settings as a frozen dataclass (`settings_type`, a
`BackendSettings`: typed fields, documented, with today's defaults; `Annotated` rules such as
`POSITIVE` for the values). `solve` turns `options.extra` into that object once, before it
searches (`BackendSettings.of`: every name must be a field, every value of the field's type
and within its rules), and hands it to `_solve`; an unknown name or a bad value is one
BackendError line that names it and lists the valid names, e.g. "backend 'search' has no
setting 'tyop'; its settings are: mode". A settings object is itself a read-only mapping of
its fields, so it can be given as `extra` directly. What the caller and a running search say
to each other (answers, a stop flag) is not a setting: `SolveOptions.channel`.

Progress. Long searches report best-so-far lines through the standard `logging` module
(`logging.getLogger("backends.<name>")`), at most one every `PROGRESS_SECONDS`
(`ProgressLog`); the command lines show them on stderr.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import math
import numbers
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import (
    Annotated,
    Any,
    ClassVar,
    Generic,
    Literal,
    Self,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from planner.deadline import (
    catch_interrupt,
    past,
    request_stop,
    stop_requested,
)
from planner.errors import BackendError
from planner.problems.evaluate import memory_feasible
from planner.problems.problem import Problem
from planner.result import (
    OBJECTIVES,
    Channel,
    Limit,
    SolveOptions,
    SolveResult,
    Status,
    StopFlag,
    evaluate_objective,
)

__all__ = [
    "OBJECTIVES",
    "POSITIVE",
    "PROGRESS_SECONDS",
    "Backend",
    "BackendError",
    "BackendSettings",
    "Channel",
    "Check",
    "Coerce",
    "Limit",
    "ProgressLog",
    "SolveOptions",
    "SolveResult",
    "Status",
    "StopFlag",
    "at_least",
    "between",
    "evaluate_objective",
    "past",
    "request_stop",
    "stop_requested",
]

PROGRESS_SECONDS = 5.0  # at most one progress line per search this often
RESCORE_SHARE = 0.05  # of a makespan search's time kept for the re-score's simulation


class ProgressLog:
    """Best-so-far lines for a long search: `log(lambda: "...")` logs at INFO at most once
    every `every` seconds (the message is only built when it is logged)."""

    def __init__(self, name: str, every: float = PROGRESS_SECONDS):
        self.logger = logging.getLogger(f"backends.{name}")
        self.every = every
        self.start = self.last = time.perf_counter()

    def __call__(self, message: Callable[[], str], force: bool = False) -> None:
        now = time.perf_counter()
        if (force or now - self.last >= self.every) and self.logger.isEnabledFor(logging.INFO):
            self.last = now
            self.logger.info("%.1f s: %s", now - self.start, message())


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


SettingsT = TypeVar("SettingsT", bound=BackendSettings)


class Backend(ABC, Generic[SettingsT]):
    """Base class: subclasses set the class attributes (`settings_type` among them: the
    backend's settings) and implement `_solve`."""

    name: ClassVar[str]
    settings_type: type[SettingsT]
    objectives: ClassVar[tuple[str, ...]] = ("additive",)
    exact: ClassVar[bool] = False
    REQUIRED_MODULES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def is_installed(cls) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in cls.REQUIRED_MODULES)

    def can_run(self, problem: Problem, options: SolveOptions) -> str | None:
        """None when this backend can solve `problem` as asked, else the reason it cannot."""
        if not self.is_installed():
            missing = [m for m in self.REQUIRED_MODULES if importlib.util.find_spec(m) is None]
            return f"backend {self.name!r} needs the package(s) {missing}: pip install them"
        if options.objective not in self.objectives:
            return f"backend {self.name!r} does not optimize the {options.objective!r} objective"
        if options.objective == "makespan" and problem.cost_model is None:
            return (
                f"the makespan objective needs a problem built from a DNN; {problem.name!r} is "
                "a cost-table problem (use the additive objective)"
            )
        return None

    def settings(self, options: SolveOptions) -> SettingsT:
        """`options.extra` as this backend's settings, checked (see the module docstring)."""
        return self.settings_type.of(options.extra, f"backend {self.name!r}")

    def solve(self, problem: Problem, options: SolveOptions | None = None) -> SolveResult:
        options = options or SolveOptions()
        settings = self.settings(options)
        reason = self.can_run(problem, options)
        if reason is not None:
            raise BackendError(reason)
        start = time.perf_counter()
        clock = options.clock().within(options.time_limit)  # the earlier of the two
        with catch_interrupt():
            search = clock
            if options.objective == "makespan":
                search = clock.reserve(RESCORE_SHARE * min(options.time_limit, clock.left()))
            inner = dataclasses.replace(
                options, deadline=search, time_limit=max(search.left(), 1e-3)
            )
            raw = self._solve(problem, inner, settings)
            interrupted = stop_requested()
            elapsed = time.perf_counter() - start
            proven = raw.status in (Status.OPTIMAL, Status.INFEASIBLE) and raw.limit is None
            if interrupted and not proven:
                status = Status.FEASIBLE if raw.choices is not None else Status.NO_SOLUTION
                raw = dataclasses.replace(raw, status=status, limit=Limit.INTERRUPTED)
            return self._finish(problem, options, raw, elapsed)

    @abstractmethod
    def _solve(self, problem: Problem, options: SolveOptions, settings: SettingsT) -> SolveResult:
        """Search with these settings (`options.extra` checked). Return choices, status,
        limit, bound, stats; the objective is re-scored."""

    def _finish(
        self, problem: Problem, options: SolveOptions, raw: SolveResult, elapsed: float
    ) -> SolveResult:
        stats = {"search_seconds": elapsed, **raw.stats}
        if raw.objective is not None:
            stats["reported_objective"] = raw.objective
        if raw.choices is None:
            return SolveResult(self.name, raw.status, None, None, raw.bound, raw.limit, None, stats)
        choices = problem.check_choices(raw.choices)
        value = evaluate_objective(problem, choices, options.objective)
        if not math.isfinite(value) or not memory_feasible(problem, choices):
            raise BackendError(
                f"backend {self.name!r} returned an invalid answer (forbidden choice or memory "
                "over the limit): this is a bug in the backend"
            )
        strategy = problem.strategy(choices) if problem.space is not None else None
        return SolveResult(
            self.name, raw.status, choices, value, raw.bound, raw.limit, strategy, stats
        )
