"""Heuristics: answers without proofs, fast.

- `feasible`: a valid answer first (forbidden choices and pairs, memory), repaired and
  improved; every additive backend starts from it;
- `baselines`: the best of the expert strategies, the `baselines` backend.
"""

from __future__ import annotations

from backends.lazy import lazy_exports

__all__ = ["BaselinesBackend", "BaselinesSettings"]
__getattr__ = lazy_exports(
    __name__,
    {
        "BaselinesBackend": "backends.heuristics.baselines",
        "BaselinesSettings": "backends.heuristics.baselines",
    },
)
