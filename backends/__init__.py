"""Search backends: one module and one class each, same contract (backends.base)."""

from __future__ import annotations

import importlib

from backends.base import (
    Backend,
    BackendError,
    Limit,
    SolveOptions,
    SolveResult,
    Status,
)

# name -> "module:Class"; modules are imported on first use so heavy solvers stay lazy.
REGISTRY: dict[str, str] = {
    "baselines": "backends.baselines:BaselinesBackend",
    "elimination": "backends.elimination:EliminationBackend",
    "search": "backends.search:SearchBackend",
    "mcmc": "backends.mcmc:McmcBackend",
    "ilp": "backends.ilp:IlpBackend",
    "cpsat": "backends.cpsat:CpsatBackend",
    "portfolio": "backends.portfolio:PortfolioBackend",
}


def backend_names() -> list[str]:
    return list(REGISTRY)


def get_backend(name: str) -> Backend:
    """An instance of the backend registered as `name`."""
    try:
        module, cls = REGISTRY[name].split(":")
    except KeyError:
        raise BackendError(f"unknown backend {name!r}; available: {', '.join(REGISTRY)}") from None
    backend: Backend = getattr(importlib.import_module(module), cls)()
    return backend


__all__ = [
    "REGISTRY",
    "Backend",
    "BackendError",
    "Limit",
    "SolveOptions",
    "SolveResult",
    "Status",
    "backend_names",
    "get_backend",
]
