"""Search backends, in families (docs/extending.md): `exact` (elimination, DFS/A*), `mcmc`,
`mathprog` (the selection model under CBC and CP-SAT, the neighbourhood search), `placement`
(DLPlacer's reduction), `heuristics` (feasibility, baselines), `local` (the compiled local
search), `wcsp` (toulbar2, TRW-S and the Lagrangian bound), `pipeline` (the pipeline search)
and the `portfolio`; below the families, `model` (the `Selection` model several of them
share).

The contract (`SolveOptions`, `SolveResult`, `Status`, `Limit`) lives in `planner.result`
and the registry in `planner.registry`; both are re-exported here.
"""

from __future__ import annotations

from backends.base import Backend
from planner.errors import BackendError
from planner.registry import REGISTRY, backend_names, get_backend
from planner.result import Limit, SolveOptions, SolveResult, Status

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
