"""Where a graph's model comes from: a zoo model, or a user's factory named by import path.

A strategy file records its model (`"graph": {"model": ...}`) so that another process (the
runtime's workers, `python -m runtime.run`) can rebuild the very `nn.Module` the strategy
was planned for, with the same parameters for the same seed:

- a zoo model: `{"name": "lenet5", "batch": 8, "kwargs": {...}, "coarsen": true}`;
- a user model: `{"name": "net", "factory": "mypkg.models:make_net", "kwargs": {...},
  "inputs": [{"shape": [8, 3, 32, 32], "dtype": "float32"}], "coarsen": true}`. The
  factory is any importable callable (a function or an `nn.Module` class) that returns the
  module when called with `kwargs`; `inputs` are the shapes and dtypes of the example
  inputs it was captured with (the batch is their first dim).

`ModelSpec.graph()` captures the model on the meta device (nothing computed) and
`ModelSpec.build(seed, dtype)` builds it on the CPU under `torch.manual_seed(seed)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from planner.errors import LayerwiseError
from planner.graph.precision import check_precision, with_precision

if TYPE_CHECKING:
    import torch
    from torch import nn

    from planner.deadline import Deadline
    from planner.graph.opgraph import OpGraph

__all__ = ["InputSpec", "ModelSpec", "load_factory"]

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")


@dataclass(frozen=True)
class InputSpec:
    """The shape and dtype of one example input (what a plan file records of it)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise LayerwiseError(
                f"input dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}"
            )
        if not self.shape or any(not isinstance(s, int) or s < 1 for s in self.shape):
            raise LayerwiseError(f"an input shape needs positive sizes, got {self.shape!r}")

    @classmethod
    def of(cls, tensor: torch.Tensor) -> InputSpec:
        """The spec of an example tensor."""
        return cls(tuple(int(s) for s in tensor.shape), str(tensor.dtype).removeprefix("torch."))

    def empty(self, device: str = "meta") -> torch.Tensor:
        """An uninitialized tensor of this shape and dtype (meta: no memory)."""
        import torch

        return torch.empty(self.shape, dtype=getattr(torch, self.dtype), device=device)

    def to_json(self) -> dict[str, Any]:
        """{"shape": [...], "dtype": "..."}, as a plan file records an input."""
        return {"shape": list(self.shape), "dtype": self.dtype}


def load_factory(path: str) -> Callable[..., Any]:
    """The callable named by `"package.module:attribute"` (the attribute may be dotted)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise LayerwiseError(
            f"a model factory is named 'module:callable' (e.g. 'mypkg.models:make_net'), "
            f"got {path!r}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LayerwiseError(
            f"cannot import model factory {path!r}: {type(exc).__name__}: {exc} (run from the "
            "directory that holds the module, or add it to PYTHONPATH)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise LayerwiseError(f"model factory {path!r}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise LayerwiseError(f"model factory {path!r} is not callable")
    return obj


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model (`name`, `batch`, `kwargs`) or a user factory (`factory`, `kwargs`,
    `inputs`), whether its graph is coarsened, and the `precision` it trains in (Lightning's
    names, `planner.graph.precision`; None: the dtypes it holds): what
    `Strategy.to_json(model=...)` records."""

    name: str
    batch: int | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    coarsen: bool = True
    factory: str | None = None
    inputs: tuple[InputSpec, ...] = ()
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.factory is not None and not self.inputs:
            raise LayerwiseError(
                f"model factory {self.factory!r} needs the shapes of its example inputs"
            )

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> ModelSpec | None:
        """From a strategy file's data["graph"]["model"] (None when there is none)."""
        if data is None:
            return None
        bad = f'the strategy file\'s graph "model" is malformed: {data!r}'
        if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
            raise LayerwiseError(bad)
        kwargs, batch = data.get("kwargs") or {}, data.get("batch")
        if not isinstance(kwargs, Mapping) or not (batch is None or isinstance(batch, int)):
            raise LayerwiseError(f"{bad}: kwargs must be an object and batch an integer")
        factory = data.get("factory")
        precision = check_precision(data.get("precision"))
        if factory is None:
            kwargs = dict(kwargs)
            batch = batch if batch is not None else kwargs.pop("batch", None)
            coarse = bool(data.get("coarsen", True))
            return cls(str(data["name"]), batch, kwargs, coarse, precision=precision)
        raw_inputs = data.get("inputs")
        if not isinstance(factory, str) or not isinstance(raw_inputs, list) or not raw_inputs:
            raise LayerwiseError(f"{bad}: a factory model needs 'factory' and 'inputs'")
        try:
            inputs = tuple(
                InputSpec(tuple(x["shape"]), str(x.get("dtype", "float32"))) for x in raw_inputs
            )
        except (TypeError, KeyError, AttributeError):
            raise LayerwiseError(f"{bad}: each input is {{'shape': [...], 'dtype': ...}}") from None
        coarsen = bool(data.get("coarsen", True))
        return cls(str(data["name"]), None, dict(kwargs), coarsen, factory, inputs, precision)

    def to_json(self) -> dict[str, Any]:
        """The plan file's `"model"` object (the inverse of `from_json`)."""
        out: dict[str, Any] = {"name": self.name}
        if self.factory is not None:
            out["factory"] = self.factory
            out["inputs"] = [x.to_json() for x in self.inputs]
        else:
            out["batch"] = self.batch
        out["kwargs"] = dict(self.kwargs)
        out["coarsen"] = self.coarsen
        if self.precision is not None:
            out["precision"] = self.precision
        return out

    def describe(self) -> str:
        """'model NAME with {...}, batch B' or 'factory PATH with {...}' for messages."""
        if self.factory is not None:
            return f"model factory {self.factory!r} with {dict(self.kwargs)}"
        return f"model {self.name!r} with {dict(self.kwargs)}, batch {self.batch}"

    def module(self, device: str = "meta") -> nn.Module:
        """The model built on `device` in train mode (the zoo's or the factory's)."""
        import torch
        from torch import nn

        if self.factory is None:
            from planner.graph.zoo import build_model

            kwargs = dict(self.kwargs)
            if self.batch is not None:
                kwargs["batch"] = self.batch
            module, _ = build_model(self.name, device=device, **kwargs)
            return module
        make = load_factory(self.factory)
        try:
            with torch.device(device):
                module = make(**self.kwargs)
        except Exception as exc:
            raise LayerwiseError(
                f"model factory {self.factory!r} failed with {dict(self.kwargs)}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(module, nn.Module):
            raise LayerwiseError(
                f"model factory {self.factory!r} returned {type(module).__name__}, not an nn.Module"
            )
        return module.train()

    def example_inputs(self, device: str = "meta") -> tuple[torch.Tensor, ...]:
        """Uninitialized example inputs of the recorded shapes (factory models)."""
        return tuple(x.empty(device) for x in self.inputs)

    def graph(self, deadline: Deadline | None = None) -> OpGraph:
        """The model's OpGraph, captured on the meta device (and coarsened), in the dtypes of
        its `precision`; OutOfTime past `deadline`."""
        if self.factory is None:
            from planner.graph.zoo import model_graph

            graph = model_graph(
                self.name, self.batch, self.coarsen, deadline=deadline, **self.kwargs
            )
            return with_precision(graph, self.precision)
        from planner.graph.capture import capture
        from planner.graph.coarsen import coarsen

        graph = capture(
            self.module("meta"), self.example_inputs("meta"), self.name, deadline=deadline
        )
        return with_precision(coarsen(graph) if self.coarsen else graph, self.precision)

    def build(self, seed: int, dtype: torch.dtype) -> nn.Module:
        """The model on the CPU with its seeded initial parameters, dropout off."""
        import torch

        torch.manual_seed(seed)
        return prepare_for_training(self.module("cpu"), dtype)


DROPOUT_ATTRIBUTES = (
    "dropout",
    "attn_dropout",
    "attention_dropout",
    "dropout_p",
    "attn_pdrop",
    "jitter_noise",
)
"""Float attributes that modules pass as `F.scaled_dot_product_attention`'s dropout_p, as
nanoGPT (`self.dropout`) and Hugging Face (`attention_dropout`) write it, and Mixtral's router
jitter (`jitter_noise`: a random factor on the block's input while training)."""


def prepare_for_training(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` in `dtype` with every `nn.Dropout` at p = 0, and every float attribute of
    DROPOUT_ATTRIBUTES at 0 (runs are deterministic). A dropout held elsewhere stays on, and
    `--check` then reports the deviation (exit status 3). In float64, a Hugging Face model's
    experts run transformers' eager loop (`set_experts_implementation("eager")`): its default
    `grouped_mm` has no float64 kernel on the CPU."""
    import torch
    from torch import nn

    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in DROPOUT_ATTRIBUTES:
            value = m.__dict__.get(name)
            if isinstance(value, float) and 0.0 < value < 1.0:
                setattr(m, name, 0.0)
    for m in module.modules() if dtype == torch.float64 else ():  # the model, or behind HFRoot
        experts = getattr(m, "get_experts_implementation", None)
        if callable(experts) and set(experts().values()) - {"eager", None}:
            getattr(m, "set_experts_implementation")("eager")  # noqa: B009 - typed: a Module
    return module.to(dtype)


def input_specs(inputs: Sequence[Any]) -> tuple[InputSpec, ...]:
    """The specs of example tensors (non-tensors are refused: they cannot be recorded)."""
    import torch

    out = []
    for k, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise LayerwiseError(
                f"example input {k} is a {type(x).__name__}; the example inputs must be tensors"
            )
        out.append(InputSpec.of(x))
    return tuple(out)
