"""Executing strategies with torch.distributed: see docs/runtime.md."""

from runtime.launch import RunOptions, RunResult, WorkerError, run_strategy
from runtime.plan import ExecPlan, RuntimeConfigError, build_plan
from runtime.reference import ModelSpec

__all__ = [
    "ExecPlan",
    "ModelSpec",
    "RunOptions",
    "RunResult",
    "RuntimeConfigError",
    "WorkerError",
    "build_plan",
    "run_strategy",
]
