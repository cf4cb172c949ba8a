"""Compiled local search for cost-table problems (numba), the `local` backend.

- `flat`: a Problem as flat numpy arrays (CSR strategies, edge tables, adjacency, memory);
- `segtree`: the memory profile over time as a segment tree (range add, range max);
- `kernels`: the compiled construction, repair and simulated annealing moves;
- `anneal`: the backend (`LocalBackend`), its settings and the Python loop around the
  kernels (chunks, the clock, rounds and restarts).
"""

from __future__ import annotations

from backends.lazy import lazy_exports

__all__ = ["LocalBackend", "LocalSettings"]
__getattr__ = lazy_exports(
    __name__, {"LocalBackend": "backends.local.anneal", "LocalSettings": "backends.local.anneal"}
)
