"""`planner.plan`: every kind of input, the time budget, forwarded options, one clear error."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from user_models import SmallCNN

import planner
import planner.api
import planner.recommend
import planner.request
from backends import SolveOptions, Status
from backends.exact.search import SearchBackend
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.costtable import random_problem, save_problem

IMAGES = (torch.randn(8, 3, 16, 16),)
LENET = {"model_kwargs": {"batch": 8}}
MEMORY_SHARE = 0.9  # of the unconstrained optimum's peak: devices too small for it


def test_every_kind_of_input_plans(tmp_path: Path) -> None:
    zoo = planner.plan("lenet5", "p100-1x4", **LENET)
    graph = model_graph("lenet5", batch=8)
    graph.save(tmp_path / "g.json")
    problem = random_problem(6, 3, seed=0, memory=False)
    save_problem(problem, tmp_path / "p.json")
    results = {
        "zoo": zoo,
        "graph": planner.plan(graph, "p100-1x4"),
        "graph file": planner.plan(tmp_path / "g.json", "p100-1x4"),
        "graph file name": planner.plan(str(tmp_path / "g.json"), "p100-1x4"),
        "module": planner.plan(SmallCNN(), "p100-1x4", example_inputs=IMAGES),
        "factory": planner.plan("user_models:make_cnn", "p100-1x4", example_inputs=IMAGES),
        "problem": planner.plan(problem),
        "problem file": planner.plan(tmp_path / "p.json"),
    }
    for name, r in results.items():
        assert r.status is Status.OPTIMAL and r.gap == 0.0, name
        assert {"build_seconds", "search_seconds", "total_seconds"} <= set(r.stats), name
    for name in ("graph", "graph file", "graph file name"):
        assert results[name].objective == pytest.approx(zoo.objective, rel=1e-12)
    assert results["module"].objective == pytest.approx(results["factory"].objective, rel=1e-12)
    assert zoo.model is not None and zoo.model.to_json()["batch"] == 8
    assert results["factory"].model is not None and results["module"].model is not None
    assert results["module"].model.factory == "user_models:SmallCNN"  # rebuilt without arguments
    assert results["problem"].strategy is None and results["problem"].choices is not None
    assert results["problem file"].to_json()["choices"] == list(results["problem"].choices)


def test_the_backend_gets_what_is_left_of_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[SolveOptions, float]] = []
    solve = SearchBackend.solve

    def spy(self: Any, problem: Any, options: SolveOptions) -> Any:
        seen.append((options, options.clock().left()))
        return solve(self, problem, options)

    monkeypatch.setattr(SearchBackend, "solve", spy)
    r = planner.plan("lenet5", "p100-1x4", backend="search", time_limit=30, **LENET)
    ((options, left),) = seen
    used = r.stats["capture_seconds"] + r.stats["build_seconds"]
    assert options.time_limit is None and options.deadline is not None  # the deadline only
    assert left <= 30 - used
    assert r.stats["total_seconds"] >= used + r.stats["search_seconds"]


def test_a_build_that_cannot_finish_even_past_the_time_limit_stops_with_one_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(planner.request, "OVERRUN", 0.0)  # no time past the limit
    monkeypatch.setattr(planner.request, "OVERRUN_SECONDS", 0.0)
    with pytest.raises(planner.LayerwiseError, match="did not finish within the time limit"):
        planner.plan("lenet5", "p100-4x4", time_limit=1e-6, **LENET)


def test_a_build_past_the_time_limit_is_finished_and_answered_without_a_search(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Capture and build overran a limit that left the search no time: the answer is the
    cheapest one found without a search (elimination's optimum, proven in milliseconds),
    with one warning that gives the overrun and a limit that would have searched."""
    with caplog.at_level(logging.WARNING, logger="planner.api"):
        r = planner.plan("lenet5", "p100-1x4", time_limit=1e-3, **LENET)
    exact = planner.plan("lenet5", "p100-1x4", backend="elimination", **LENET)
    assert r.has_solution and r.objective == pytest.approx(exact.objective)
    assert r.backend == "elimination" and r.status is Status.OPTIMAL
    said = [m for m in caplog.messages if "ran out before the search began" in m]
    assert len(said) == 1 and "would have left the search time" in said[0]
    assert r.stats["overrun"] == said[0] and r.summary()["message"] == said[0]


def test_without_an_exact_answer_in_time_the_best_fitting_baseline_is_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(planner.api, "QUICK_EXACT_SECONDS", -1.0)  # no proof in time
    r = planner.plan("lenet5", "p100-1x4", objective="makespan", time_limit=1e-3, **LENET)
    assert r.has_solution and r.status is Status.FEASIBLE and r.limit is not None
    assert r.backend.startswith("baseline ") and r.stats["memory_fits"]
    baselines = planner.recommend.baseline_times(r.problem)
    assert r.objective == pytest.approx(min(b.simulated for b in baselines.values()))


def test_a_load_that_uses_up_the_time_limit_is_said_clearly(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_problem(random_problem(30, 4, seed=1), path)
    r = planner.plan(str(path), time_limit=1e-6)
    # a memory limit (elimination cannot take it) and no baselines for a cost table: no answer
    assert r.problem.has_memory_limit
    assert r.status is Status.NO_SOLUTION and r.limit is not None and r.limit.value == "TIME"
    assert r.message is not None and "ran out before the search began" in r.message
    assert "reading the problem" in r.message and "no answer without a search" in r.message
    assert r.summary()["message"] == r.message and r.strategy is None


def test_unknown_options_go_to_build_problem_or_are_refused() -> None:
    graph = model_graph("rnnlm", batch=4, steps=3, hidden=8, layers=1, vocab=20)
    tied = planner.plan(graph, "p100-1x2")
    untied = planner.plan(graph, "p100-1x2", tie_groups=False)  # a build_problem option
    assert untied.problem.num_nodes > tied.problem.num_nodes
    with pytest.raises(planner.LayerwiseError, match="unknown option.*frob.*accepts"):
        planner.plan(graph, "p100-1x2", frob=1)


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "a module without example inputs": ({"model": SmallCNN()}, "give example_inputs"),
    "a factory without example inputs": ({"model": "user_models:make_cnn"}, "example_inputs"),
    "an unknown name": ({"model": "nope"}, "not a zoo model"),
    "an unimportable factory": (
        {"model": "no_such_module:f", "example_inputs": IMAGES},
        "cannot import model factory",
    ),
    "no devices": ({"model": "lenet5", "devices": None}, "needs devices"),
    "devices for a cost-table problem": (
        {"model": random_problem(4, 2, seed=0), "devices": "p100-1x2"},
        "devices do(es) not apply",
    ),
    "an objective the backend does not optimize": (
        {"model": "lenet5", "objective": "makespan", "backend": "elimination"},
        "does not optimize",
    ),
    "an unknown objective": ({"model": "lenet5", "objective": "fastest"}, "objective must"),
    "a zero time limit": ({"model": "lenet5", "time_limit": 0}, "time_limit"),
    "a negative seed": ({"model": "lenet5", "seed": -1}, "seed"),
    "an example input that is not a tensor": (
        {"model": SmallCNN(), "example_inputs": ([1, 2],)},
        "must be tensors",
    ),
    "example inputs for a zoo model": (
        {"model": "lenet5", "example_inputs": IMAGES},
        "do not apply to zoo model",
    ),
    "an unknown backend": ({"model": "lenet5", "backend": "nope"}, "unknown backend"),
    "an unknown cost source": ({"model": "lenet5", "cost": "guessed"}, "cost must be"),
    "something else": ({"model": 42}, "takes a zoo name"),
    "a time limit as a string": (
        {"model": "lenet5", "time_limit": "10"},
        "time_limit must be a positive number of seconds (an int or a float), got '10' (a str)",
    ),
    "a seed as a float": ({"model": "lenet5", "seed": 1.5}, "got 1.5 (a float)"),
    "a module class instead of an instance": (
        {"model": SmallCNN, "example_inputs": IMAGES},
        "got the class SmallCNN itself (pass an instance, e.g. SmallCNN(...))",
    ),
    "the DeviceGraph class instead of an instance": (
        {"model": "lenet5", "devices": planner.DeviceGraph},
        "devices must be a preset name, a device JSON path or a DeviceGraph, got the class "
        "DeviceGraph itself",
    ),
    "max_configs as a string": ({"model": "lenet5", "max_configs": "4"}, "got '4' (a str)"),
    "a memory limit as a word": ({"model": "lenet5", "memory_limit": "lots"}, "got 'lots' (a str)"),
    "a backend that is not a name": (
        {"model": "lenet5", "backend": SearchBackend},
        "backend must be a backend's name (a str), got the class SearchBackend itself",
    ),
    "settings without a backend": (
        {"model": "lenet5", "backend_options": {"mode": "astar"}},
        "'auto' chooses the backend per problem and takes no settings",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_calls_are_one_clear_error(case: str) -> None:
    kwargs, says = BAD[case]
    kwargs = {"devices": "p100-1x2", **kwargs}
    with pytest.raises(planner.LayerwiseError, match=says.replace("(", r"\(").replace(")", r"\)")):
        planner.plan(kwargs.pop("model"), **kwargs)


def test_the_plan_file_is_strict_json_and_a_strategy_file(tmp_path: Path) -> None:
    r = planner.plan(SmallCNN(), "p100-1x4", example_inputs=IMAGES, backend="baselines")
    assert r.bound is None and r.gap is None
    r.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text(), parse_constant=pytest.fail)
    assert data["status"] == "FEASIBLE" and data["gap"] is None
    strategy, _ = planner.load_strategy(tmp_path / "plan.json")
    assert strategy == r.strategy
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed
    scores = r.evaluate()
    assert math.isclose(scores.additive, r.objective or 0, rel_tol=1e-9)


def test_planner_plan_does_not_import_torch_or_a_backend_until_called() -> None:
    code = "import sys, planner; planner.plan; planner.PlanResult; print(sorted(m for m in ('torch', 'backends', 'ortools', 'pulp') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_kind_of_a_large_file_is_told_without_parsing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cost table is read once, by its own reader: telling it from an OpGraph file reads
    the file's beginning, not the whole file with Python's json (gigabytes on a contest file),
    and imports no torch."""
    import planner.files
    import planner.sources
    from planner.graph.zoo import model_graph

    monkeypatch.setattr(planner.sources, "SNIFF_BYTES", 4096)  # "large" at test scale
    big = tmp_path / "big.json"
    save_problem(random_problem(400, 8, seed=0), big)
    assert big.stat().st_size > planner.sources.SNIFF_BYTES
    graph = tmp_path / "graph.json"
    model_graph("lenet5", batch=8).save(graph)

    def parsed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole file was parsed to tell its kind")

    monkeypatch.setattr(planner.files, "read_json_checked", parsed)
    assert planner.sources.is_problem_file(str(big))
    assert not planner.sources.is_problem_file(str(graph))


def _with_memory(preset: str, memory: float) -> planner.DeviceGraph:
    data = get_preset(preset).to_json()
    for device in data["devices"]:
        device["memory"] = int(memory)
    return planner.DeviceGraph.from_json(data)


def test_auto_is_the_default_and_proves_the_optimum_when_it_fits() -> None:
    r = planner.plan("lenet5", "p100-1x4", **LENET)
    assert r.backend == "elimination" and r.status is Status.OPTIMAL
    assert (
        r.stats["auto"]["chose"] == "elimination" and r.summary()["auto"]["chose"] == "elimination"
    )
    assert r.stats["memory_fits"]


def test_auto_searches_under_the_devices_memory_when_the_optimum_does_not_fit() -> None:
    """Devices too small for elimination's optimum (no memory limit given): the default
    backend searches again under each device's memory and returns a plan that fits, with
    the unconstrained optimum as its lower bound; elimination alone stops with an error
    that names what works."""
    free = planner.plan("lenet5", "p100-1x4", backend="elimination", recommend=False, **LENET)
    peak = free.stats["memory_peak_bytes"]
    small = _with_memory("p100-1x4", peak * MEMORY_SHARE)
    r = planner.plan("lenet5", small, recommend=False, time_limit=60, **LENET)
    assert r.backend == "portfolio" and r.stats["auto"]["chose"] == "portfolio"
    assert "memory is tight" in r.stats["auto"]["why"]
    assert r.stats["auto"]["unconstrained"]["objective"] == free.objective
    assert r.stats["memory_fits"] and r.stats["memory_peak_bytes"] <= peak * MEMORY_SHARE
    assert r.has_solution and r.bound is not None and r.bound >= free.objective
    assert r.problem.has_memory_limit and r.objective >= free.objective
    with pytest.raises(planner.LayerwiseError, match="backend 'auto' .the default"):
        planner.plan("lenet5", small, backend="elimination", recommend=False, **LENET)


def test_auto_under_the_memory_limit_ends_proven_or_stalled_not_at_the_time_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A DNN's search under the devices' memory (planner/auto.py): toulbar2 and local (on
    tables of `DNN_MEMBERS_NODES` nodes or more; here made 1) with the patience,
    elimination's optimum without the limit as the portfolio's first bound; it ends proven
    within the gap tolerance or stalled, not at the time limit."""
    from planner.auto import DNN_MEMBERS

    monkeypatch.setattr("planner.auto.DNN_MEMBERS_NODES", 1)
    free = planner.plan("lenet5", "p100-1x4", backend="elimination", recommend=False, **LENET)
    small = _with_memory("p100-1x4", free.stats["memory_peak_bytes"] * MEMORY_SHARE)
    r = planner.plan("lenet5", small, recommend=False, time_limit=120, **LENET)
    assert r.backend == "portfolio" and set(r.stats["members"]) == set(DNN_MEMBERS)
    given = r.stats["bounds"][0]
    assert given[1] == "given" and given[2] == pytest.approx(free.objective, rel=1e-12)
    assert r.limit is None  # proven (OPTIMAL) or stalled (FEASIBLE, stats["stalled"])
    assert r.status is Status.OPTIMAL or r.stats["stalled"] > 0


def test_zero_auto_skips_a_stage_whose_optimum_cannot_beat_the_answer_in_hand() -> None:
    """zero="auto" with backend "auto" probes each stage's optimum without the memory limit
    first: ZeRO-1 costs a tiny GPT-2 no time in the model and its optimum fits 18.8 MiB
    (18.7 MiB) where stage 0's does not (18.9 MiB), so stage 0 is not searched under the
    memory limit (its answers cost at least that optimum): the proven optimum at stage 1.
    (Before: the portfolio searched stage 0 under the limit, 0.6% slower, and stopped.)"""
    gpt = {"batch": 8, "n_layer": 2, "n_embd": 128, "n_head": 4, "seq": 64,
           "vocab_size": 1000, "block_size": 64}  # fmt: skip
    small = _with_memory("p100-1x4", 18.8 * 2**20)
    r = planner.plan("gpt2", small, zero="auto", optimizer="adam", recommend=False,
                     headroom=0.0, reserve=0, model_kwargs=gpt)  # fmt: skip
    assert r.backend == "elimination" and r.status is Status.OPTIMAL
    assert r.stats["zero"]["chose"] == 1 and r.stats["memory_fits"]
    (tried,) = r.stats["zero"]["tried"]
    assert tried["zero"] == 0 and "cannot beat" in tried["why"]


def test_an_attempt_whose_share_ran_out_is_searched_not_answered_as_an_overrun() -> None:
    """An "auto" option's attempt gets a share of the call's time: its share spent by its
    build is not the call's limit spent (no answer without a search, no overrun line)."""
    from planner.request import PlanRequest

    graph = model_graph("lenet5", batch=8)
    request = PlanRequest.make(graph, "p100-1x4", time_limit=600)
    spent = request.within(request.deadline.share(0.0))  # a share with nothing left
    out = planner.api._plan_plain(spent)
    assert out.has_solution and "overrun" not in out.stats and out.message is None
    assert not request.call.expired() and spent.call is request.call
