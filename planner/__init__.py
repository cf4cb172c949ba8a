"""layerwise's planner: the problem representation, cost model, evaluators and simulator.

Layers (each a subpackage): `planner.graph` (OpGraph, op kinds, torch.fx capture, the zoo),
`planner.hardware` (DeviceGraph, presets), `planner.costs` (configs, the config space, the
cost model, kernels, profiling), `planner.problems` (cost tables, cost-table files,
strategies, evaluators, baselines) and `planner.sim` (FlexFlow's simulator, traces).
The public names below are imported lazily, so `import planner` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from planner import _compat

_compat.install()

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LayerwiseError": "planner.errors",
    "OpGraph": "planner.graph.opgraph",
    "capture": "planner.graph.capture",
    "coarsen": "planner.graph.coarsen",
    "model_graph": "planner.graph.zoo",
    "MODELS": "planner.graph.zoo",
    "Device": "planner.hardware.devices",
    "DeviceGraph": "planner.hardware.devices",
    "Link": "planner.hardware.devices",
    "get_preset": "planner.hardware.presets",
    "load_devices": "planner.hardware.presets",
    "ParallelConfig": "planner.costs.config",
    "ConfigSpace": "planner.costs.config",
    "CostModel": "planner.costs.costmodel",
    "CostOptions": "planner.costs.costmodel",
    "Problem": "planner.problems.problem",
    "build_problem": "planner.problems.problem",
    "load_problem": "planner.problems.costtable",
    "Strategy": "planner.problems.strategy",
    "load_strategy": "planner.problems.strategy",
    "additive_cost": "planner.problems.evaluate",
    "memory_feasible": "planner.problems.evaluate",
    "score_strategy": "planner.problems.evaluate",
    "Simulator": "planner.sim.simulator",
    "simulate": "planner.sim.simulator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
