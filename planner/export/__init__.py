"""A plan run by PyTorch itself: the export family.

- `planner.export.dtensor`: a strategy as DTensor placements on a `DeviceMesh`
  (`export_plan` says how each module runs, `parallelize` applies it in every rank of a
  process group, `process_group()` sets one up for a block);
- `planner.export.zero`: ZeRO in that export (FSDP2's `fully_shard` for stages 2-3,
  `ZeroOneOptimizer` for stage 1);
- `planner.export.pipelining`: a pipelined strategy as torch's pipelining (`pipeline_plan`,
  `parallelize_pipeline`);
- `planner.export.common`: what they share (`check_params`);
- `planner.export.launchers`: a plan as what launchers take (`export_launcher`: torchtitan's
  job config, Megatron-LM's arguments, an FSDP2 + tensor-parallel script), what they cannot
  express said in one line each (docs/launchers.md).

Nothing here imports torch until a function runs; what cannot be expressed is one
`ExportError`. See docs/runtime.md.
"""

from planner.errors import ExportError
from planner.export.dtensor import (
    Exported,
    ExportPlan,
    OpPlacement,
    export_plan,
    parallelize,
    process_group,
)
from planner.export.launchers import Launch, export_launcher
from planner.export.pipelining import (
    PipelineExported,
    PipelineExportPlan,
    StagePlan,
    parallelize_pipeline,
    pipeline_plan,
)
from planner.export.zero import ZeroOneOptimizer, fully_shard_plan

__all__ = [
    "ExportError",
    "ExportPlan",
    "Exported",
    "Launch",
    "OpPlacement",
    "PipelineExportPlan",
    "PipelineExported",
    "StagePlan",
    "ZeroOneOptimizer",
    "export_launcher",
    "export_plan",
    "fully_shard_plan",
    "parallelize",
    "parallelize_pipeline",
    "pipeline_plan",
    "process_group",
]
