"""The shared model: what several backend families search over, with no search of its own.

- `selection`: the additive objective's data (OptCNN Eq. 1 reduced: allowed choices, edge
  tables, the memory rule as live sets): encoded by `mathprog`'s CBC and CP-SAT models,
  searched by `heuristics.feasible` and the `portfolio`, and its live sets give
  `placement`'s memory rule.

It sits below the families (docs/extending.md): every family may import it, and it imports
no family.
"""

from __future__ import annotations

from backends.lazy import lazy_exports

# (the function `selection` is the module's: `from backends.model.selection import selection`)
__all__ = ["Memory", "Selection", "live_sets"]
__getattr__ = lazy_exports(
    __name__,
    {
        "Memory": "backends.model.selection",
        "Selection": "backends.model.selection",
        "live_sets": "backends.model.selection",
    },
)
