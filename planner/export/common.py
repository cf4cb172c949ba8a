"""What the exports share: the check that a module is the one a strategy was planned for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.errors import ExportError

if TYPE_CHECKING:
    from torch import nn

    from planner.problems.strategy import Strategy

__all__ = ["check_params"]


def check_params(strategy: Strategy, module: nn.Module) -> None:
    """An ExportError unless `module` has every parameter the strategy's graph names (the
    graph was captured from it)."""
    have = {name for name, _ in module.named_parameters()}
    missing = sorted({p.name for op in strategy.graph.ops for p in op.params} - have)
    if missing:
        raise ExportError(
            f"the module has no parameters named {missing[:3]}: the strategy's graph "
            f"{strategy.graph.name!r} does not come from this module"
        )
