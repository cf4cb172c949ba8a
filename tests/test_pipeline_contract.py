"""The pipeline search under the result contract: `PipelineSearch` through the conformance
suite every pipeline search runs (`backends.pipeline.testing`), and its settings."""

from __future__ import annotations

import pytest

from backends.pipeline.settings import PipelineSettings
from backends.pipeline.testing import PipelineConformance
from planner.errors import BackendError
from planner.registry import get_pipeline_solver, pipeline_search_names


class TestPipelineSearch(PipelineConformance):
    search_name = "pipeline"


def test_every_registered_pipeline_search_has_a_conformance_subclass() -> None:
    tested = {cls.search_name for cls in PipelineConformance.__subclasses__()}
    assert set(pipeline_search_names()) <= tested


def test_settings_take_what_plan_takes() -> None:
    """ "auto" (or None) for what `plan` searches, one value for a list of one."""
    given = {"recompute": "auto", "zero": None, "schedules": "1f1b", "stages": [2]}
    settings = PipelineSettings.of(given)
    assert settings.recompute == ("none", "selective", "full") and settings.zero == (0, 1)
    assert settings.schedules == ("1f1b",) and settings.stages == (2,)
    assert PipelineSettings.of({"zero": 1, "recompute": "full"}).zero == (1,)
    assert PipelineSettings.of({"recompute": "selective"}).recompute == ("selective",)


@pytest.mark.parametrize(
    "extra,says",
    [
        ({"zero": 5}, "setting 'zero' must be 0, 1, 2, 3 or 'auto', got 5"),
        ({"recompute": 3}, "setting 'recompute' must be 'none', 'selective', 'full' or 'auto'"),
        ({"schedules": ("zigzag",)}, "setting 'schedules' must be some of gpipe, 1f1b"),
        ({"stages": [0]}, "setting 'stages' must be pipeline sizes >= 1"),
        ({"exact": 0}, "setting 'exact' must be an integer >= 1"),
    ],
)
def test_a_bad_choice_is_one_line(extra: dict[str, object], says: str) -> None:
    from planner.result import SolveOptions

    with pytest.raises(BackendError, match=says) as info:
        get_pipeline_solver().settings(SolveOptions(extra=extra))
    assert str(info.value).startswith("the pipeline search setting")


def test_an_unknown_pipeline_search_is_one_line() -> None:
    with pytest.raises(BackendError, match="unknown pipeline search 'zigzag'; available: pipeline"):
        get_pipeline_solver("zigzag")
