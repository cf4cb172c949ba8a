"""From whatever a user has to a Problem: a zoo name, an `nn.Module`, a factory path, an
OpGraph, a graph or cost-table file, or a Problem (what `planner.plan` accepts).

`problem_of` captures the model (torch.fx on the meta device, then coarsening), loads the
devices, makes the cost model and builds the cost tables, timing capture and build apart; it
returns the `ModelSpec` to record in the plan file when the model can be rebuilt by another
process: a zoo model, a factory, or a module instance whose class is importable and built
without arguments (not a graph file).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.deadline import OutOfTime, run_within, stop_requested
from planner.errors import LayerwiseError, given
from planner.graph.models import InputSpec, ModelSpec, input_specs

if TYPE_CHECKING:
    from planner.costs.costmodel import CostModel
    from planner.deadline import Deadline
    from planner.graph.opgraph import OpGraph
    from planner.hardware.devices import DeviceGraph
    from planner.problems.problem import Problem

__all__ = ["cost_model", "problem_of"]

log = logging.getLogger(__name__)


def problem_of(
    model: Any,
    devices: Any,
    *,
    example_inputs: Any,
    model_kwargs: Mapping[str, Any] | None,
    name: str | None,
    coarsen: bool,
    options: Mapping[str, Any],
    max_configs: int | None,
    build_options: Mapping[str, Any],
    deadline: Deadline | None = None,
    precision: str | None = None,
) -> tuple[Problem, ModelSpec | None, dict[str, float]]:
    """The Problem to search, the model spec to record, and the seconds of capture (model to
    OpGraph, torch's import included) and build (devices, cost model, cost tables). Past
    `deadline` (checked before and after capture and while building) it raises OutOfTime."""
    from planner.problems.problem import Problem

    if isinstance(model, Problem) or is_problem_file(model):
        unused = [k for k, v in options.items() if v not in (None, "analytic")]
        unused += ["devices"] * (devices is not None) + ["max_configs"] * (max_configs is not None)
        unused += list(build_options) + ["example_inputs"] * (example_inputs is not None)
        unused += ["precision"] * (precision is not None)
        if unused:
            raise LayerwiseError(
                f"{', '.join(unused)} do(es) not apply to a cost-table problem (it has its own "
                "costs and memory limit)"
            )
        t0 = time.perf_counter()
        problem = model if isinstance(model, Problem) else _load_problem(model)
        return problem, None, {"capture_seconds": 0.0, "build_seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    graph, spec = _graph(model, example_inputs, model_kwargs, name, coarsen, deadline, precision)
    capture_seconds = time.perf_counter() - t0
    if deadline is not None:
        deadline.check()
    if devices is None:
        raise LayerwiseError("plan() needs devices: a preset name, a device JSON or a DeviceGraph")
    device_graph = _devices(devices, build_options.get("table_budget"))
    log.info(
        "%s: %d ops (%.3g s); building the cost tables for %s",
        graph.name,
        len(graph.ops),
        capture_seconds,
        device_graph.name,
    )
    from planner.costs.memory import kept_free

    memory = {k: options.get(k) for k in ("optimizer", "master_weights", "zero", "recompute")}
    memory["headroom"], memory["reserve"] = kept_free(  # a model's plan keeps them by default
        options.get("headroom"), options.get("reserve"), device_graph
    )
    cm = cost_model(graph, device_graph, options["cost"], sync=options["sync"], **memory)
    from planner.problems.problem import build_problem

    problem = build_problem(
        graph,
        device_graph,
        cm,
        max_configs,
        options["memory_limit"],
        deadline=deadline,
        **build_options,
    )
    build_seconds = time.perf_counter() - t0 - capture_seconds
    log.info(
        "built %d nodes, %d edges, %d configs in %.3g s",
        problem.num_nodes,
        len(problem.edges),
        sum(problem.sizes),
        build_seconds,
    )
    return problem, spec, {"capture_seconds": capture_seconds, "build_seconds": build_seconds}


def graph_of(
    model: Any,
    devices: Any,
    *,
    example_inputs: Any,
    model_kwargs: Mapping[str, Any] | None,
    name: str | None,
    coarsen: bool,
    deadline: Deadline | None = None,
    precision: str | None = None,
) -> tuple[OpGraph, ModelSpec | None, DeviceGraph, float]:
    """The model's graph, its spec, the devices and the capture's seconds, without cost
    tables (what a pipeline search needs). OutOfTime past `deadline`."""
    from planner.problems.problem import Problem

    if isinstance(model, Problem) or is_problem_file(model):
        raise LayerwiseError(
            "a cost-table problem has no layers to cut into pipeline stages: plan it without "
            "pipeline (pipeline=False, --pipeline off)"
        )
    t0 = time.perf_counter()
    graph, spec = _graph(model, example_inputs, model_kwargs, name, coarsen, deadline, precision)
    seconds = time.perf_counter() - t0
    if devices is None:
        raise LayerwiseError("plan() needs devices: a preset name, a device JSON or a DeviceGraph")
    return graph, spec, _devices(devices), seconds


def _graph(
    model: Any,
    example_inputs: Any,
    model_kwargs: Mapping[str, Any] | None,
    name: str | None,
    coarsen: bool,
    deadline: Deadline | None,
    precision: str | None = None,
) -> tuple[OpGraph, ModelSpec | None]:
    """An OpGraph as given, or the model captured (torch loaded within `deadline` first), in
    the dtypes of `precision` (`planner.graph.precision`; the spec records it)."""
    from planner.graph.opgraph import OpGraph
    from planner.graph.precision import with_precision

    if isinstance(model, OpGraph):
        if example_inputs is not None or model_kwargs:
            raise LayerwiseError("example_inputs and model_kwargs do not apply to an OpGraph")
        return with_precision(model, precision), None
    if deadline is not None:
        load_torch(deadline)
        deadline.check()  # no capture begins with no time left
    graph, spec = _capture(model, example_inputs, model_kwargs, name, coarsen, deadline)
    if precision is None:
        return graph, spec
    if spec is not None:
        spec = dataclasses.replace(spec, precision=precision)
    return with_precision(graph, precision), spec


def _load_problem(path: str | Path) -> Problem:
    from planner.problems.costtable import load_problem

    return load_problem(path)


def is_problem_file(model: Any) -> bool:
    """A path to a JSON file that is not an OpGraph (so a cost-table problem)."""
    if not isinstance(model, str | Path) or not _looks_like_path(model):
        return False
    from planner.errors import ProblemError
    from planner.files import read_json_checked
    from planner.problems.costtable import is_gzip

    if is_gzip(model):  # a gzipped file is a cost-table problem (IOPDDL ships them so)
        return True
    try:
        with open(model, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        head = b""
    if _OPGRAPH_FORMAT.search(head):
        return False
    if len(head) == SNIFF_BYTES:  # large, and not an OpGraph (which says so first): a
        return True  # cost table, read once by its own fast reader rather than twice here
    data = read_json_checked(model, "model", ProblemError)
    return not (isinstance(data, Mapping) and data.get("format") == "layerwise.opgraph")


SNIFF_BYTES = 1 << 20  # a file this large that does not begin as an OpGraph is a cost table
_OPGRAPH_FORMAT = re.compile(rb'"format"\s*:\s*"layerwise\.opgraph"')


def _looks_like_path(model: str | Path) -> bool:
    from planner.graph.hf_zoo import is_hf_name  # no torch: decided before the zoo loads

    if is_hf_name(model):
        return False  # a Hugging Face model, its config file's path after the prefix
    if isinstance(model, Path) or model.endswith((".json", ".json.gz")):
        return True  # no zoo name ends so: decided without importing the zoo (and torch)
    from planner.graph.zoo import MODELS

    if model in MODELS:
        return False
    return Path(model).exists() or model.endswith((".json", ".json.gz"))


def _warm_up() -> None:
    from planner.graph.capture import warm_up

    warm_up()


def load_torch(deadline: Deadline) -> None:
    """torch and its tracing machinery, loaded in a thread the deadline bounds (an import
    cannot stop itself)."""
    if "torch._dynamo" in sys.modules:
        return  # loaded already: nothing to wait for
    start = time.perf_counter()
    try:
        run_within(_warm_up, deadline)
    except OutOfTime:
        if stop_requested():
            raise
        raise LayerwiseError(
            f"loading torch's tracing machinery took the whole time limit of "
            f"{deadline.limit:g} s (stopped after {time.perf_counter() - start:.1f} s; it takes "
            "about 4.5 s on a quiet 2-core machine, once per process): raise the time limit"
        ) from None


def _capture(
    model: Any,
    example_inputs: Any,
    model_kwargs: Mapping[str, Any] | None,
    name: str | None,
    coarsen: bool,
    deadline: Deadline | None = None,
) -> tuple[OpGraph, ModelSpec | None]:
    """The graph of a zoo name, a graph file, a factory path or a module instance (OutOfTime
    past `deadline`)."""
    if isinstance(model, str | Path):
        if _looks_like_path(model):
            from planner.graph.opgraph import OpGraph

            if model_kwargs or example_inputs is not None:
                raise LayerwiseError("example_inputs and model_kwargs do not apply to a graph file")
            return OpGraph.load(model), None
        spec = _spec_of_name(str(model), example_inputs, model_kwargs, name, coarsen)
        return spec.graph(deadline), spec
    import torch
    from torch import nn

    if not isinstance(model, nn.Module):
        raise LayerwiseError(
            f"plan() takes a zoo name, an nn.Module, a 'module:factory' path, an OpGraph, a "
            f"Problem or a file path; got {given(model, instance=True)}"
        )
    if model_kwargs:
        raise LayerwiseError("model_kwargs apply to a zoo name or a factory, not to a module")
    inputs = _example_inputs(example_inputs, type(model).__name__)
    from planner.costs.declared import check_declared
    from planner.graph.capture import capture
    from planner.graph.coarsen import coarsen as coarsen_graph

    with torch.no_grad():
        graph = capture(
            model,
            tuple(x.empty() for x in inputs),
            name or _default_name(model),
            deadline=deadline,
            check=check_declared,  # declared kinds against their kernels (real parameters)
        )
    graph = coarsen_graph(graph) if coarsen else graph
    return graph, _factory_of(model, inputs, graph, coarsen, deadline)


def _factory_of(
    module: Any,
    inputs: tuple[InputSpec, ...],
    graph: OpGraph,
    coarsen: bool,
    deadline: Deadline | None,
) -> ModelSpec | None:
    """The factory that rebuilds `module` in another process, where there is one: its class,
    defined at the top level of an imported module (not a script's `__main__`) and called
    without arguments, when that builds a module of the same graph. None otherwise: the plan
    file then records no model (plan "package.module:Class" with model_kwargs instead)."""
    cls = type(module)
    path = f"{cls.__module__}:{cls.__qualname__}"
    home = sys.modules.get(cls.__module__)
    found: Any = home
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if cls.__module__ == "__main__" or getattr(home, "__spec__", None) is None or found is not cls:
        why = "its class is not importable by another process (defined in a script?)"
    elif _needs_arguments(cls):
        why = "its class needs constructor arguments"
    else:
        try:
            spec = ModelSpec(graph.name, None, {}, coarsen, path, inputs)
            if spec.graph(deadline).fingerprint() == graph.fingerprint():
                log.info("%s: recorded as model factory %r (no arguments)", graph.name, path)
                return spec
            why = f"{path}() builds a module of another graph"
        except Exception as exc:  # optional: the plan stands without it
            why = f"{path}() could not be captured ({type(exc).__name__})"
    log.info(
        "%s: the plan file records no model: %s; plan a 'package.module:factory' path with "
        "model_kwargs to record one",
        graph.name,
        why,
    )
    return None


def _needs_arguments(cls: type) -> bool:
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params
    )


def _spec_of_name(
    model: str,
    example_inputs: Any,
    model_kwargs: Mapping[str, Any] | None,
    name: str | None,
    coarsen: bool,
) -> ModelSpec:
    from planner.graph.hf_zoo import canonical_name, is_hf_name

    kwargs = dict(model_kwargs or {})
    if is_hf_name(model):
        model = canonical_name(model)
    elif ":" in model:
        inputs = _example_inputs(example_inputs, model)
        default = model.rpartition(":")[2].rpartition(".")[2].lower()
        return ModelSpec(name or default, None, kwargs, coarsen, model, inputs)
    if example_inputs is not None:
        raise LayerwiseError(
            f"example_inputs do not apply to zoo model {model!r} (size it with model_kwargs)"
        )
    if name is not None:
        raise LayerwiseError("name does not apply to a zoo model (its graph has the zoo name)")
    from planner.graph.zoo import MODELS

    if model not in MODELS and not is_hf_name(model):
        raise LayerwiseError(
            f"unknown model {model!r}: not a zoo model ({', '.join(MODELS)}), not a "
            "'module:factory' path and not an existing file"
        )
    batch = kwargs.pop("batch", None)
    return ModelSpec(model, batch, kwargs, coarsen)


def _example_inputs(example_inputs: Any, what: str) -> tuple[InputSpec, ...]:
    if example_inputs is None:
        raise LayerwiseError(
            f"{what}: give example_inputs (a tensor or a tuple of tensors: the shapes, batch "
            "included, that one training step reads)"
        )
    if not isinstance(example_inputs, tuple | list):
        example_inputs = (example_inputs,)
    if all(isinstance(x, InputSpec) for x in example_inputs):
        return tuple(example_inputs)
    return input_specs(example_inputs)


def _default_name(module: Any) -> str:
    return type(module).__name__.lower()


def _devices(devices: Any, table_budget: float | None = None) -> DeviceGraph:
    from planner.hardware.devices import DeviceGraph
    from planner.hardware.presets import load_devices
    from planner.problems.sizes import DEFAULT_TABLE_BUDGET, check_devices_spec

    if isinstance(devices, DeviceGraph):
        return devices
    if isinstance(devices, str | Path):
        check_devices_spec(str(devices), table_budget or DEFAULT_TABLE_BUDGET)  # before building
        return load_devices(str(devices))
    raise LayerwiseError(
        f"devices must be a preset name, a device JSON path or a DeviceGraph, got {given(devices, instance=True)}"
    )


def cost_model(
    graph: OpGraph, devices: DeviceGraph, source: str = "analytic", **options: Any
) -> CostModel:
    """The cost model of `graph` on `devices`: analytic, or measured (the profile cache of
    `python -m planner profile`), with `CostOptions` fields from `options` (others ignored:
    a strategy file's cost section also holds its source)."""
    from planner.costs.costmodel import CostModel, CostOptions

    if source not in ("analytic", "measured"):
        raise LayerwiseError(f"cost must be 'analytic' or 'measured', got {given(source)}")
    names = {f.name for f in dataclasses.fields(CostOptions)}
    if options.get("param_copies", 2) not in (None, 2):  # a plan file from before the rule
        raise LayerwiseError(
            f"param_copies={options['param_copies']!r} is no longer a cost option: memory "
            "follows optimizer, master_weights and zero (param_copies 2 is their default)"
        )
    opts = CostOptions(**{k: v for k, v in options.items() if k in names and v is not None})
    measured = None
    if source == "measured":
        from planner.costs.profile import MeasuredTimes

        measured = MeasuredTimes.load(devices, graph=graph)
    return CostModel(graph, devices, opts, measured=measured)
