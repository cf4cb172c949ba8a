"""Executing strategies with torch.distributed: see docs/runtime.md."""

from runtime.launch import RunOptions, RunResult, WorkerError, run_strategy
from runtime.models import ModuleModel
from runtime.plan import ExecPlan, RuntimeConfigError, build_plan
from runtime.reference import ModelSpec, NonFiniteError

__all__ = [
    "ExecPlan",
    "ModelSpec",
    "ModuleModel",
    "NonFiniteError",
    "RunOptions",
    "RunResult",
    "RuntimeConfigError",
    "WorkerError",
    "build_plan",
    "run_strategy",
]
