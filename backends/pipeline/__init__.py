"""Pipeline parallelism searched: stages, tensor and data degrees, micro-batches, schedules.

- `search`: the pipeline search (`PipelineSearch`, registered as "pipeline" in
  `planner.registry.PIPELINE_REGISTRY`);
- `settings`: its typed settings (`PipelineSettings`);
- `units`: per-block costs composed into a layout's chunks, the compute bound;
- `estimate`: a chunk's micro-batch in closed form (the cost model's per-op times), which
  ranks every stage layout before any is simulated;
- `candidates`: a stage layout's schedules, chunks and blocks per stage, estimated;
- `select`: what is simulated and returned (best first over values that grow more exact);
- `inner`: a stage's layout from the per-op search;
- `testing`: the conformance suite every pipeline search runs.
"""

from __future__ import annotations

from backends.lazy import lazy_exports

__all__ = ["PipelineSearch", "PipelineSettings"]
__getattr__ = lazy_exports(
    __name__,
    {
        "PipelineSearch": "backends.pipeline.search",
        "PipelineSettings": "backends.pipeline.settings",
    },
)
