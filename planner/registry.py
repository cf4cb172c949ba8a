"""The backends by name: how planner reaches a backend without importing one up front.

`REGISTRY` maps a name to "module:Class"; `get_backend(name)` imports that module on first
use, so heavy solvers stay lazy and planner never imports a backend module by path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

from planner.errors import BackendError
from planner.result import Solver

__all__ = ["REGISTRY", "backend_names", "get_backend"]

REGISTRY: dict[str, str] = {
    "baselines": "backends.heuristics.baselines:BaselinesBackend",
    "elimination": "backends.exact.elimination:EliminationBackend",
    "search": "backends.exact.search:SearchBackend",
    "mcmc": "backends.mcmc.chain:McmcBackend",
    "ilp": "backends.mathprog.ilp:IlpBackend",
    "cpsat": "backends.mathprog.cpsat:CpsatBackend",
    "local": "backends.local.anneal:LocalBackend",
    "portfolio": "backends.portfolio:PortfolioBackend",
    "toulbar2": "backends.wcsp.toulbar2:Toulbar2Backend",
}


def backend_names() -> list[str]:
    """The registered backends' names, in the registry's order."""
    return list(REGISTRY)


def get_backend(name: str) -> Solver:
    """An instance of the backend registered as `name` (a `backends.base.Backend`)."""
    try:
        module, cls = REGISTRY[name].split(":")
    except (KeyError, AttributeError, TypeError):
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(REGISTRY)}") from None
    return cast(Solver, getattr(importlib.import_module(module), cls)())


PIPELINE_SEARCH = "backends.pipeline.search:search_pipeline"


def get_pipeline_search() -> Callable[..., Any]:
    """The pipeline search (`backends.pipeline.search.search_pipeline`), imported on first use."""
    module, name = PIPELINE_SEARCH.split(":")
    return cast(Callable[..., Any], getattr(importlib.import_module(module), name))
