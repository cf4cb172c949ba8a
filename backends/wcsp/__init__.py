"""Cost function networks: the Problem as a weighted CSP, toulbar2, and lower bounds.

- `network`: the Problem as a pruned pairwise network in flat arrays (forbidden values out,
  parallel edges merged, arc consistency on the forbidden pairs);
- `contract`: functional contraction, the nodes whose value a neighbour's fixes folded into it
  (the network's answers lift back exactly);
- `trws`: TRW-S message passing (Kolmogorov 2006) and the lower bound its messages prove,
  compiled with numba;
- `memory`: time steps, live usage, per-node prices, and the greedy repair and polish of an
  answer against the memory limit (numba);
- `crossover`: partition crossover of two labellings within the memory limit, and the parts
  that do not fit moved and repaired (numba);
- `bound`: `lower_bound(problem, deadline)`, a Lagrangian relaxation of the memory rows over
  the TRW-S bound, usable by any backend;
- `toulbar2`: the `toulbar2` backend (`Toulbar2Backend`, `Toulbar2Settings`): the network
  with the memory rule priced into unary costs, solved in rounds by toulbar2, repaired.

Importing the package imports no solver: `toulbar2` needs pytoulbar2, the others numba.
"""

from __future__ import annotations

from backends.lazy import lazy_exports

__all__ = ["Toulbar2Backend", "Toulbar2Settings", "lower_bound"]
__getattr__ = lazy_exports(
    __name__,
    {
        "Toulbar2Backend": "backends.wcsp.toulbar2",
        "Toulbar2Settings": "backends.wcsp.toulbar2",
        "lower_bound": "backends.wcsp.bound",
    },
)
