"""FlexFlow's Markov chain Monte Carlo search (Jia et al. 2019, Sec. 6), the `mcmc` backend.

- `chain`: the Metropolis-Hastings search (`McmcBackend`) and its settings;
- `state`: a chain's objective, Eq. 1 cost and memory, kept incrementally;
- `proposals`: which node to change, and to which config;
- `starts`: the start strategies (Sec. 6.2).
"""

from __future__ import annotations

from backends.lazy import lazy_exports

__all__ = ["McmcBackend", "McmcSettings"]
__getattr__ = lazy_exports(
    __name__, {"McmcBackend": "backends.mcmc.chain", "McmcSettings": "backends.mcmc.chain"}
)
