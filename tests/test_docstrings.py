"""Every public name of the library has a docstring: planner's (and runtime's) exports, the
public methods of the entry-point modules, and the backends' result types."""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

# Modules whose every public function, class and method is documented.
WHOLE_MODULES = ("planner.api", "planner.request", "planner.plans", "planner.pipelined",
                 "planner.sources", "planner.export.dtensor", "planner.export.zero",
                 "planner.export.pipelining", "planner.export.common", "planner.cli.args",
                 "planner.cli.output", "planner.graph.models", "planner.files",
                 "planner.logs", "planner.result", "planner.deadline", "planner.registry",
                 "planner.recommend", "runtime.models")  # fmt: skip


def documented(obj: Any) -> bool:
    """A docstring written for `obj` (not dataclass's generated signature, not Enum's)."""
    doc = inspect.getdoc(obj) if not inspect.isclass(obj) else obj.__doc__
    if not doc or not doc.strip():
        return False
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return not doc.startswith(f"{obj.__name__}(")
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return doc != enum.Enum.__doc__
    return True


def exported() -> Iterator[tuple[str, Any]]:
    """planner's and runtime's exports, and the backends' result types."""
    for package in ("planner", "runtime"):
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield f"{package}.{name}", obj
    backends = importlib.import_module("backends")
    for name in ("SolveOptions", "SolveResult", "Status", "Limit"):
        yield f"backends.{name}", getattr(backends, name)


def methods(cls: type) -> Iterator[tuple[str, Any]]:
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if inspect.isfunction(fn):
            yield name, fn


def test_every_exported_name_has_a_docstring() -> None:
    missing = [n for n, obj in exported() if not documented(obj)]
    assert missing == []


def test_the_entry_point_modules_document_every_public_function_and_method() -> None:
    missing = []
    for module_name in WHOLE_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not documented(obj):
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                missing += [f"{module_name}.{name}.{m}" for m, fn in methods(obj) if not fn.__doc__]
    assert missing == []
