"""The pipeline search's settings (`SolveOptions.extra`), typed and checked once.

The choices the search explores: recomputation modes and ZeRO stages to try, the schedules,
the pipeline sizes, a cap on the layouts simulated exactly, and how a stage is laid out
(`inner`). Besides lists, a setting takes what `planner.plan` takes: "auto" (or
None) for the recomputation modes and ZeRO stages `plan` searches, one mode, stage or
schedule for a list of one. A bad value is one BackendError line naming it and the valid
settings (`backends.settings.BackendSettings.of`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

from backends.settings import BackendSettings, Check, Coerce
from planner.pipeline.schedule import SCHEDULES
from planner.problems.sizes import DEFAULT_TABLE_BUDGET

__all__ = ["INNER", "RECOMPUTE_AUTO", "ZERO_AUTO", "PipelineSettings"]

Recompute = Literal["none", "selective", "full"]  # "selective": attention ops; "full": whole blocks
Schedule = Literal["gpipe", "1f1b", "interleaved"]
Inner = Literal["rule", "search"]  # how a stage is laid out: Megatron-LM's rule, the per-op search

RECOMPUTE_AUTO: tuple[Recompute, ...] = ("none", "selective", "full")
ZERO_AUTO = (0, 1)  # with pipelines Megatron-LM-style runs shard the optimizer state at most
INNER: tuple[Inner, ...] = ("rule", "search")
ALL_SCHEDULES = cast(tuple[Schedule, ...], SCHEDULES)


def _listed(auto: tuple[Any, ...], one: type) -> Callable[[Any], Any]:
    """A setting's value as a tuple: `auto` for None or "auto", a tuple of one for a single
    `one` (not a bool); anything else as given, for the type check to judge."""

    def convert(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value == "auto"):
            return auto
        if isinstance(value, one) and not isinstance(value, bool):
            return (value,)
        return value

    return convert


def _some(must: str) -> Check:
    return Check(must, lambda v: len(v) > 0)


def _stages(value: tuple[int, ...] | None) -> bool:
    return value is None or (len(value) > 0 and all(p >= 1 for p in value))


@dataclass(frozen=True)
class PipelineSettings(BackendSettings):
    """The pipeline search's choices (defaults: what `planner.plan` searches)."""

    # activation recomputation modes to try, in order of preference ("selective": the
    # attention ops, Megatron-LM's --recompute-granularity selective; "full": whole blocks)
    recompute: Annotated[
        tuple[Recompute, ...],
        Coerce(_listed(RECOMPUTE_AUTO, str)),
        _some("'none', 'selective', 'full' or 'auto' (all three)"),
    ] = RECOMPUTE_AUTO
    # ZeRO stages to try (0: none; with pipelines at most 1 by default)
    zero: Annotated[
        tuple[int, ...],
        Coerce(_listed(ZERO_AUTO, int)),
        Check("0, 1, 2, 3 or 'auto'", lambda v: len(v) > 0 and all(0 <= z <= 3 for z in v)),
    ] = ZERO_AUTO
    # pipeline schedules to try
    schedules: Annotated[
        tuple[Schedule, ...],
        Coerce(_listed(ALL_SCHEDULES, str)),
        _some(f"some of {', '.join(SCHEDULES)}"),
    ] = ALL_SCHEDULES
    # pipeline sizes to try (None: every divisor of the devices up to the blocks)
    stages: Annotated[
        tuple[int, ...] | None, Check("pipeline sizes >= 1 (or None: every divisor)", _stages)
    ] = None
    # context-parallel degrees to try (None: 1 and every power of two up to the devices that
    # divides the sequence of a model with attention; `search._context_degrees`)
    context: Annotated[
        tuple[int, ...] | None,
        Coerce(lambda v: (v,) if isinstance(v, int) and not isinstance(v, bool) else v),
        Check("context-parallel degrees >= 1 (or None: every power of two)", _stages),
    ] = None
    # expert-parallel degrees to try (None: for a model with mixtures of experts every
    # divisor of their experts and a stage's devices; `search._expert_degrees`)
    expert: Annotated[
        tuple[int, ...] | None,
        Coerce(lambda v: (v,) if isinstance(v, int) and not isinstance(v, bool) else v),
        Check("expert-parallel degrees >= 1 (or None: every divisor)", _stages),
    ] = None
    # a cap on the layouts simulated exactly (None: as many as the rule needs: every layout
    # estimated below the answer's step is simulated; docs/pipeline.md)
    exact: Annotated[
        int | None, Check("an integer >= 1 (or None: no cap)", lambda v: v is None or v >= 1)
    ] = None
    # how a stage is laid out: Megatron-LM's "rule", the per-op "search" (both: the better)
    inner: Annotated[
        tuple[Inner, ...],
        Coerce(_listed(INNER, str)),
        _some("some of 'rule', 'search'"),
    ] = INNER
    # bytes the cost tables of the per-op search inside a stage may take (`table_budget` of
    # `build_problem`; None: no budget); the whole cluster's tables are never built
    table_budget: Annotated[
        float | None, Check("bytes > 0 (or None: no budget)", lambda v: v is None or v > 0)
    ] = DEFAULT_TABLE_BUDGET
