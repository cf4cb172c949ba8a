"""The flat module names of layerwise 0.1 (`planner.costmodel`, `planner.zoo`, ...).

planner/ was one folder; it is now grouped in subpackages (graph, hardware, costs, problems,
sim). Importing an old name gives the very module object of its new home, so
`planner.costmodel is planner.costs.costmodel` and code written against 0.1 keeps working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "opgraph": "graph",
    "opkinds": "graph",
    "capture": "graph",
    "coarsen": "graph",
    "zoo": "graph",
    "devices": "hardware",
    "presets": "hardware",
    "config": "costs",
    "costmodel": "costs",
    "regions": "costs",
    "kernels": "costs",
    "profile": "costs",
    "problem": "problems",
    "costtable": "problems",
    "strategy": "problems",
    "evaluate": "problems",
    "baselines": "problems",
    "simulator": "sim",
    "trace": "sim",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The target module ran when it was imported."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, tail = fullname.partition(".")
        if head != "planner" or tail not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(f"planner.{MOVED[tail]}.{tail}")
        )


def install() -> None:
    """Make the old flat names importable (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
