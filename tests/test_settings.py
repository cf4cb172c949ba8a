"""Typed backend settings (`backends.base.BackendSettings`): how `SolveOptions.extra` is
checked and converted, the one-line errors, settings objects given directly, nested settings
(the portfolio's members'), the caller's `Channel`, and `planner.plan`'s `backend_options`.
The per-backend checks (unknown and ill-typed names, defaults, round trip) are in the
conformance suite (`backends.testing`)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
import pytest

import planner
from backends import BackendError, SolveOptions, Status, get_backend
from backends.base import POSITIVE, BackendSettings, Channel, Check, Coerce, at_least
from backends.exact.search import SearchSettings
from backends.mathprog.common import CpsatSettings, IlpSettings
from backends.mcmc.chain import McmcSettings
from backends.portfolio import PortfolioSettings
from planner.errors import LayerwiseError
from planner.problems.costtable import random_problem


@dataclasses.dataclass(frozen=True)
class Inner(BackendSettings):
    depth: int = 1


@dataclasses.dataclass(frozen=True)
class Every(BackendSettings):
    flag: bool = False
    count: Annotated[int, Check("a positive integer", lambda v: v > 0)] = 3
    rate: Annotated[float, POSITIVE] = 1.5
    share: Annotated[float, at_least(0)] = 0.0
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    auto: bool | Literal["auto"] = "auto"
    cap: int | None = None
    names: tuple[str, ...] = ()
    pair: Annotated[
        tuple[float, float], Coerce(lambda v: (v, v) if isinstance(v, float) else v)
    ] = (
        1.0,
        2.0,
    )
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    anything: Any = None
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_search_names_the_unknown_setting_and_its_settings() -> None:
    with pytest.raises(BackendError) as info:
        get_backend("search").solve(random_problem(4, 3, seed=0), SolveOptions(extra={"tyop": 1}))
    assert str(info.value) == "backend 'search' has no setting 'tyop'; its settings are: mode"


def test_every_unknown_name_is_listed_and_a_backend_without_settings_says_so() -> None:
    with pytest.raises(BackendError) as info:
        get_backend("elimination").settings(SolveOptions(extra={"a": 1, "b": 2}))
    assert str(info.value) == "backend 'elimination' has no settings 'a', 'b'; it takes no settings"


def test_values_are_converted_to_their_types() -> None:
    s = Every.of(
        {
            "flag": True,
            "count": np.int64(7),
            "rate": 2,
            "name": "y",
            "mode": "b",
            "auto": False,
            "cap": 4,
            "names": ["p", "q"],
            "pair": 0.5,
            "weights": {"w": 1},
            "anything": [1, "two"],
            "inner": {"depth": 2},
        }
    )
    assert s.count == 7 and type(s.count) is int
    assert s.rate == 2.0 and type(s.rate) is float
    assert s.names == ("p", "q") and s.pair == (0.5, 0.5)
    assert s.weights == {"w": 1.0} and type(s.weights["w"]) is float
    assert s.inner == Inner(depth=2) and s.anything == [1, "two"]
    assert Every.of({"auto": "auto", "cap": None}) == Every()
    assert Every.of({"inner": Inner(depth=5)}).inner == Inner(depth=5)


@pytest.mark.parametrize(
    "key, value, must",
    [
        ("flag", 1, "True or False"),
        ("count", 0, "a positive integer"),
        ("count", 2.0, "a positive integer"),
        ("rate", "fast", "a positive number"),
        ("rate", True, "a positive number"),
        ("rate", float("nan"), "a positive number"),
        ("share", -1, "a number >= 0"),
        ("name", 3, "a string"),
        ("mode", "c", "'a' or 'b'"),
        ("auto", "yes", "True, False or 'auto'"),
        ("cap", 1.5, "an integer or None"),
        ("names", "pq", "a list (each item a string)"),
        ("names", ["p", 1], "a list (each item a string)"),
        ("pair", [1.0, 2.0, 3.0], "a list of 2 items (a number, a number)"),
        ("weights", {"w": "heavy"}, "a mapping (a string to a number)"),
        ("inner", 3, "a mapping of settings (depth)"),
    ],
)
def test_a_bad_value_is_one_line_naming_it_and_what_it_must_be(
    key: str, value: Any, must: str
) -> None:
    with pytest.raises(BackendError) as info:
        Every.of({key: value}, "backend 'x'")
    message = str(info.value)
    assert message == (
        f"backend 'x' setting {key!r} must be {must}, got {value!r}; its settings are: flag, "
        "count, rate, share, name, mode, auto, cap, names, pair, weights, anything, inner"
    )


def test_a_nested_settings_error_says_where_it_is() -> None:
    with pytest.raises(BackendError) as info:
        Every.of({"inner": {"depth": "deep"}}, "backend 'x'")
    assert str(info.value) == (
        "backend 'x' setting 'inner' setting 'depth' must be an integer, got 'deep'; "
        "its settings are: depth"
    )
    with pytest.raises(BackendError, match="setting 'cpsat' has no setting 'lnss'"):
        get_backend("portfolio").settings(SolveOptions(extra={"cpsat": {"lnss": False}}))


def test_settings_must_come_as_a_mapping_and_long_values_are_cut() -> None:
    with pytest.raises(BackendError, match="takes its settings as a mapping"):
        SearchSettings.of(["mode"])  # type: ignore[arg-type]
    with pytest.raises(BackendError) as info:
        Every.of({"name": list(range(1000))})
    assert len(str(info.value)) < 300 and "..." in str(info.value)


def test_a_settings_object_is_a_mapping_and_can_be_the_extra_itself() -> None:
    s = SearchSettings(mode="astar")
    assert dict(s) == {"mode": "astar"} and list(s) == ["mode"] and len(s) == 1
    assert s["mode"] == "astar" and "mode" in s and s.get("tyop") is None
    with pytest.raises(KeyError):
        s["tyop"]
    p = random_problem(8, 3, seed=1, memory=False)
    r = get_backend("search").solve(p, SolveOptions(extra=s))
    assert r.status is Status.OPTIMAL and r.stats["mode"] == "astar"
    with pytest.raises(BackendError, match="has no settings 'iterations', 'inits'"):
        get_backend("search").solve(p, SolveOptions(extra=McmcSettings()))


def test_the_portfolio_takes_its_members_settings_as_mappings_or_objects() -> None:
    given = {"members": ["cpsat"], "cpsat": {"lns": False, "edges": "implied"}}
    s = get_backend("portfolio").settings(SolveOptions(extra=given))
    assert s == PortfolioSettings(
        members=("cpsat",), cpsat=CpsatSettings(lns=False, edges="implied")
    )
    assert s.ilp == IlpSettings() and s.mcmc == McmcSettings()
    for bad in ({"members": []}, {"members": ["search"]}, {"workers": 0}):
        with pytest.raises(BackendError, match=next(iter(bad))):
            get_backend("portfolio").settings(SolveOptions(extra=bad))
    with pytest.raises(BackendError, match="setting 'edges' must be 'marginal' or 'implied'"):
        get_backend("portfolio").settings(SolveOptions(extra={"ilp": {"edges": "plain"}}))


def test_a_solver_setting_of_the_other_solver_is_unknown() -> None:
    ilp = get_backend("ilp").settings_type
    with pytest.raises(BackendError, match="backend 'ilp' has no setting 'lns'"):
        get_backend("ilp").settings(SolveOptions(extra={"lns": False}))
    with pytest.raises(BackendError, match="backend 'cpsat' has no setting 'route_variables'"):
        get_backend("cpsat").settings(SolveOptions(extra={"route_variables": True}))
    assert ilp().terms_per_second == 40_000 and CpsatSettings().terms_per_second == 15_000


def test_the_channel_is_not_a_setting_and_not_compared() -> None:
    stop = threading.Event()
    with_channel = SolveOptions(channel=Channel(stop=stop))
    assert with_channel == SolveOptions() and with_channel.channel.stop is stop
    assert SolveOptions().channel == Channel()
    with pytest.raises(BackendError, match="no setting 'stop'"):
        get_backend("cpsat").settings(SolveOptions(extra={"stop": stop}))


def test_a_set_stop_flag_stops_cpsat_and_ilp_at_once() -> None:
    stop = threading.Event()
    stop.set()
    p = random_problem(60, 8, seed=1, memory=False)
    for name in ("cpsat", "ilp"):
        r = get_backend(name).solve(p, SolveOptions(time_limit=20.0, channel=Channel(stop=stop)))
        assert r.has_solution and r.stats["search_seconds"] < 10.0, name


def test_plan_passes_backend_options_to_the_backend() -> None:
    problem = random_problem(8, 3, seed=0, memory=False)
    r = planner.plan(problem, backend="search", backend_options={"mode": "astar"})
    assert r.stats["mode"] == "astar"
    r = planner.plan(problem, backend="search", backend_options=SearchSettings(mode="plain"))
    assert r.stats["mode"] == "plain"
    with pytest.raises(LayerwiseError, match="backend 'search' has no setting 'tyop'"):
        planner.plan(problem, backend="search", backend_options={"tyop": 1})
    # before any work: the zoo model is never built
    with pytest.raises(LayerwiseError, match="backend 'mcmc' setting 'iterations' must be"):
        planner.plan("lenet5", "p100-1x4", backend="mcmc", backend_options={"iterations": 0},
                     model_kwargs={"batch": 8}, time_limit=1e-9)  # fmt: skip
