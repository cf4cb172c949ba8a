"""Mathematical programming: the selection model (`backends.model.selection`: OptCNN Eq. 1
reduced) solved by CBC and by CP-SAT.

- `linear`, `additive_lp`: the selection model as a sparse linear program (MPS);
- `cbc`, `ilp`: CBC under a time limit, the `ilp` backend;
- `cpsat`: OR-Tools CP-SAT, the `cpsat` backend;
- `lns`: a large-neighbourhood search over nodes whose rounds are exact sub-solves;
- `common`: what `ilp` and `cpsat` share (starts, restricted rounds, the `SolverBackend`)
  and their settings (`IlpSettings`, `CpsatSettings`: importable without either solver).

Importing the package imports no solver: `ilp` needs pulp, `cpsat` needs ortools.
"""

from __future__ import annotations

from backends.lazy import lazy_exports

__all__ = ["CpsatBackend", "CpsatSettings", "IlpBackend", "IlpSettings"]
__getattr__ = lazy_exports(
    __name__,
    {
        "CpsatBackend": "backends.mathprog.cpsat",
        "CpsatSettings": "backends.mathprog.common",
        "IlpBackend": "backends.mathprog.ilp",
        "IlpSettings": "backends.mathprog.common",
    },
)
