"""The backends by name: how planner reaches a backend without importing one up front.

`REGISTRY` maps a name to "module:Class"; `get_backend(name)` imports that module on first
use, so heavy solvers stay lazy and planner never imports a backend module by path. The
pipeline search is reached the same way: `PIPELINE_REGISTRY`, `get_pipeline_solver(name)`.
"""

from __future__ import annotations

import importlib
from typing import cast

from planner.errors import BackendError
from planner.result import PipelineSolver, Solver

__all__ = [
    "PIPELINE_REGISTRY",
    "REGISTRY",
    "backend_names",
    "get_backend",
    "get_pipeline_solver",
    "pipeline_search_names",
]

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


PIPELINE_REGISTRY: dict[str, str] = {
    "pipeline": "backends.pipeline.search:PipelineSearch",
}


def pipeline_search_names() -> list[str]:
    """The registered pipeline searches' names."""
    return list(PIPELINE_REGISTRY)


def get_pipeline_solver(name: str = "pipeline") -> PipelineSolver:
    """An instance of the pipeline search registered as `name`
    (`backends.pipeline.search.PipelineSearch`), imported on first use."""
    try:
        module, cls = PIPELINE_REGISTRY[name].split(":")
    except (KeyError, AttributeError, TypeError):
        raise BackendError(
            f"unknown pipeline search {name!r}; available: {', '.join(PIPELINE_REGISTRY)}"
        ) from None
    return cast(PipelineSolver, getattr(importlib.import_module(module), cls)())
