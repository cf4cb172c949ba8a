"""The model a run trains: a recorded `ModelSpec` (zoo or factory) or a user's module instance.

A strategy file names its model so that any process can rebuild it
(`planner.graph.models.ModelSpec`: a zoo name, or an importable factory
"package.module:callable" with its kwargs and example input shapes). In one Python process a
user can also hand `run_strategy` the `nn.Module` itself: `ModuleModel` carries it to the
workers serialized with `torch.save` (so its class must be importable by the workers: defined
in a module, or in a script under `if __name__ == "__main__":`), and its current parameters
are the initial ones (the seed then only draws the data).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.errors import LayerwiseError
from planner.graph.models import InputSpec, ModelSpec, prepare_for_training
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import SAMPLE
from planner.pipeline.spec import micro_batch_graph
from runtime.plan import RuntimeConfigError
from runtime.reference import Model

__all__ = ["ModuleModel", "as_model", "model_from_job", "model_key", "model_to_job"]


@dataclass(frozen=True)
class ModuleModel:
    """A module instance sent to the workers (torch.save bytes), with the example input
    shapes and the coarsening its strategy's graph was captured with."""

    name: str
    data: bytes
    inputs: tuple[InputSpec, ...]
    coarsen: bool = True

    @classmethod
    def of(cls, module: nn.Module, graph: OpGraph, micro_batches: int = 1) -> ModuleModel:
        """The model of `module` for a strategy whose graph is `graph` (checked: the module
        captured with inputs of the graph's input shapes gives that graph, coarsened or not).
        With `micro_batches` m, `graph` is one micro-batch's: the module takes m times the
        samples, and its graph's micro-batch graph is compared."""
        inputs = _graph_inputs(graph, micro_batches)
        buf = io.BytesIO()
        try:
            torch.save(module, buf)
        except Exception as exc:
            raise RuntimeConfigError(
                f"cannot send the module to the workers: torch.save failed ({type(exc).__name__}: "
                f"{exc}); define its class at the top level of a module"
            ) from None
        for coarsen in (True, False):
            model = cls(graph.name, buf.getvalue(), inputs, coarsen)
            if micro_batch_graph(model.graph(), micro_batches).fingerprint() == graph.fingerprint():
                return model
        raise RuntimeConfigError(
            f"the strategy's graph {graph.name!r} is not the graph of this {type(module).__name__} "
            "captured with inputs of the graph's input shapes: plan the strategy for this module"
        )

    def module(self) -> nn.Module:
        """A fresh copy of the module (unpickled: its class must be importable here)."""
        try:
            module = torch.load(io.BytesIO(self.data), weights_only=False)
        except (AttributeError, ImportError, ModuleNotFoundError) as exc:
            raise LayerwiseError(
                f"a worker cannot rebuild the module {self.name!r}: {exc} (define its class in "
                "an importable module, or in a script under `if __name__ == '__main__':`)"
            ) from None
        if not isinstance(module, nn.Module):
            raise LayerwiseError(f"the data of {self.name!r} is not an nn.Module")
        return module

    def graph(self) -> OpGraph:
        """The module's graph, captured on the meta device with the recorded input shapes."""
        from planner.graph.capture import capture
        from planner.graph.coarsen import coarsen

        meta = tuple(x.empty("meta") for x in self.inputs)
        graph = capture(self.module(), meta, self.name)
        return coarsen(graph) if self.coarsen else graph

    def build(self, seed: int, dtype: torch.dtype) -> nn.Module:
        """The module with its own current parameters (the seed does not change them)."""
        return prepare_for_training(self.module().train(), dtype)

    def describe(self) -> str:
        """'module NAME', for messages."""
        return f"module {self.name!r}"


def _graph_inputs(graph: OpGraph, micro_batches: int = 1) -> tuple[InputSpec, ...]:
    """Input shapes and dtypes from the graph's input ops (tokens read by an embedding are
    int64; other inputs have the float size recorded in the graph), with `micro_batches`
    times their samples."""
    floats = {2: "float16", 4: "float32", 8: "float64"}
    out = []
    for i, op in enumerate(graph.ops):
        if op.kind != "input":
            continue
        tokens = any(graph.ops[c].kind == "embedding" for c in graph.consumers[i])
        dtype = "int64" if tokens else floats.get(op.output.dtype_bytes, "float32")
        shape = (s * micro_batches if d == SAMPLE else s for d, s in op.output.shape)
        out.append(InputSpec(tuple(shape), dtype))
    return tuple(out)


def as_model(model: Any, graph: OpGraph, micro_batches: int = 1) -> Model | None:
    """The runtime's model for what a user passed: None, a ModelSpec, or an nn.Module (for
    a strategy of `graph`; one of `micro_batches` micro-batches' graph in a pipeline)."""
    if model is None or isinstance(model, ModelSpec | ModuleModel):
        return model  # type: ignore[no-any-return]
    if isinstance(model, nn.Module):
        return ModuleModel.of(model, graph, micro_batches)
    raise RuntimeConfigError(
        f"model must be a ModelSpec, an nn.Module or None, got {type(model).__name__}"
    )


def model_to_job(model: Model | None) -> dict[str, Any] | None:
    """What the workers receive of the model (picklable)."""
    if model is None:
        return None
    if isinstance(model, ModuleModel):
        return {
            "name": model.name,
            "module": model.data,
            "inputs": [x.to_json() for x in model.inputs],
            "coarsen": model.coarsen,
        }
    assert isinstance(model, ModelSpec)
    return model.to_json()


def model_from_job(data: Mapping[str, Any] | None) -> Model | None:
    """The inverse of `model_to_job` (in a worker)."""
    if data is None or "module" not in data:
        return ModelSpec.from_json(data)
    inputs = tuple(InputSpec(tuple(x["shape"]), x["dtype"]) for x in data["inputs"])
    return ModuleModel(data["name"], data["module"], inputs, bool(data["coarsen"]))


def model_key(model: Model) -> str:
    """A key that identifies the model (caches of fingerprints and references)."""
    if isinstance(model, ModuleModel):
        digest = hashlib.sha256(model.data).hexdigest()[:16]
        return f"module:{model.name}:{digest}:{model.coarsen}"
    assert isinstance(model, ModelSpec)
    import json

    return json.dumps(model.to_json(), sort_keys=True)
