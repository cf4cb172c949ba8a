"""Exact search over the additive cost tables (and small makespan problems).

- `elimination`: OptCNN's node/edge elimination DP (Jia et al. 2018, Sec. 5.2, Algorithm 1),
  the `elimination` backend;
- `search`: depth-first branch and bound, A*, OptCNN's plain DFS, the `search` backend;
- `branch_and_bound`: the exact search over pairwise tables that both use;
- `minplus`: the min-plus product of node elimination (Eq. 2), pruned by bounds.
"""

from __future__ import annotations

from backends.lazy import lazy_exports

__all__ = ["EliminationBackend", "EliminationSettings", "SearchBackend", "SearchSettings"]
__getattr__ = lazy_exports(
    __name__,
    {
        "EliminationBackend": "backends.exact.elimination",
        "EliminationSettings": "backends.exact.elimination",
        "SearchBackend": "backends.exact.search",
        "SearchSettings": "backends.exact.search",
    },
)
