"""layerwise's planner: plan a model's parallelization, prove how good it is, export it.

The entry point is `planner.plan(model, devices, backend=..., ...)` (planner/api.py): a zoo
name, an `nn.Module` with example inputs, a "module:factory" path, an OpGraph, a Problem or
a file, to a `PlanResult` or, pipelined, a `PipelinePlan` (planner/plans.py: status,
objective, bound, gap, strategy, phase seconds, the plan file). Its arguments become one
frozen `PlanRequest` (planner/request.py), checked once; `plan_request` plans one. The export family `planner.export` runs a plan with PyTorch itself: a strategy with
DTensor (`parallelize`, in the `process_group()` of a launch; ZeRO with FSDP2), a pipelined
strategy with torch's pipelining (`parallelize_pipeline`).

Layers (each a subpackage): `planner.graph` (OpGraph, op kinds, torch.fx capture, the zoo,
model specs), `planner.hardware` (DeviceGraph, presets), `planner.costs` (configs, the config
space, the cost model, kernels, profiling), `planner.problems` (cost tables, cost-table files,
strategies, evaluators, baselines) and `planner.sim` (FlexFlow's simulator, traces).
The public names below are imported lazily, so `import planner` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "plan": "planner.api",
    "plan_request": "planner.api",
    "PlanRequest": "planner.request",
    "Plan": "planner.plans",
    "PlanResult": "planner.plans",
    "plan_pipeline": "planner.pipelined",
    "PipelinePlan": "planner.plans",
    "Evaluation": "planner.plans",
    "evaluate_strategy": "planner.plans",
    "cost_model": "planner.sources",
    "parallelize": "planner.export",
    "export_plan": "planner.export",
    "ExportPlan": "planner.export",
    "Exported": "planner.export",
    "ExportError": "planner.export",
    "process_group": "planner.export",
    "parallelize_pipeline": "planner.export",
    "pipeline_plan": "planner.export",
    "PipelineExportPlan": "planner.export",
    "PipelineExported": "planner.export",
    "export_launcher": "planner.export",
    "Launch": "planner.export",
    "ModelSpec": "planner.graph.models",
    "InputSpec": "planner.graph.models",
    "LayerwiseError": "planner.errors",
    "OpGraph": "planner.graph.opgraph",
    "capture": "planner.graph.capture",
    "coarsen": "planner.graph.coarsen",
    "model_graph": "planner.graph.zoo",
    "hf_model": "planner.graph.hf_zoo",
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
