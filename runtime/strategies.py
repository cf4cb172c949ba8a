"""Strategies to exercise the runtime with: random draws from the ConfigSpace."""

from __future__ import annotations

import random

from planner.costs.config import ConfigSpace, ParallelConfig
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.problems.problem import tied_nodes
from planner.problems.strategy import Strategy

__all__ = ["random_strategy"]


def random_strategy(
    graph: OpGraph, devices: DeviceGraph, seed: int, tie_groups: bool = True
) -> Strategy:
    """One config per op drawn uniformly from the ConfigSpace (ops of a shared parameter
    group with the same candidates take the same config when `tie_groups`, as the Problem
    ties them: `planner.problems.problem.tied_nodes`)."""
    rng = random.Random(seed)
    space = ConfigSpace(graph, devices)
    nodes = tied_nodes(graph, space) if tie_groups else [[i] for i in range(len(graph.ops))]
    configs: list[ParallelConfig | None] = [None] * len(graph.ops)
    for ops in nodes:
        options = space[ops[0]].configs
        k = rng.randrange(len(options))
        for i in ops:
            configs[i] = options[k]
    return Strategy(graph, devices, tuple(c for c in configs if c is not None))
