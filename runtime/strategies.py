"""Strategies to exercise the runtime with: random draws from the ConfigSpace."""

from __future__ import annotations

import random

from planner.config import ConfigSpace
from planner.devices import DeviceGraph
from planner.opgraph import OpGraph
from planner.strategy import Strategy

__all__ = ["random_strategy"]


def random_strategy(
    graph: OpGraph, devices: DeviceGraph, seed: int, tie_groups: bool = True
) -> Strategy:
    """One config per op drawn uniformly from the ConfigSpace (ops of a shared parameter
    group take the same config when `tie_groups`, as the Problem ties them)."""
    rng = random.Random(seed)
    space = ConfigSpace(graph, devices)
    chosen: dict[str, int] = {}
    configs = []
    for i, op in enumerate(graph.ops):
        options = space[i].configs
        group = op.param_group if tie_groups else None
        if group is not None and group in chosen and chosen[group] < len(options):
            configs.append(options[chosen[group]])
            continue
        k = rng.randrange(len(options))
        if group is not None:
            chosen[group] = k
        configs.append(options[k])
    return Strategy(graph, devices, tuple(configs))
