"""Executing strategies with torch.distributed: see docs/runtime.md.

The public names below are imported lazily (as planner's are), so `python -m runtime.run`
can handle a Ctrl-C before torch's import, which takes seconds, has begun.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "ExecPlan": "runtime.plan",
    "ModelSpec": "runtime.reference",
    "ModuleModel": "runtime.models",
    "NonFiniteError": "runtime.reference",
    "RunOptions": "runtime.launch",
    "RunResult": "runtime.launch",
    "RuntimeConfigError": "runtime.plan",
    "WorkerError": "runtime.launch",
    "build_plan": "runtime.plan",
    "run_strategy": "runtime.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
