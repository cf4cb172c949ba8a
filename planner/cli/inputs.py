"""What the commands read from the user: the model of the command line, files that may be
malformed, a strategy file's cost section, and output paths checked before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.cli.args import UsageError
from planner.errors import LayerwiseError
from planner.files import check_output_path

__all__ = ["check_cost_section", "check_outputs", "malformed", "model_spec"]


def model_spec(args: argparse.Namespace) -> Any:
    """The ModelSpec of the command line's model: a zoo name (an `hf:` one included) or a
    factory with --input."""
    from planner.graph.hf_zoo import canonical_name, is_hf_name
    from planner.graph.models import ModelSpec

    kwargs = dict(args.model_kwargs)
    coarsen = not args.no_coarsen
    precision = getattr(args, "precision", None)
    model = canonical_name(args.model) if is_hf_name(args.model) else args.model
    if ":" in model and not is_hf_name(model):
        if args.batch is not None:
            raise UsageError("--batch applies to a zoo model; a factory's batch is --input's")
        if not args.inputs:
            raise UsageError(
                f"model factory {args.model!r} needs --input SHAPE for each forward() argument"
            )
        name = args.model.rpartition(":")[2].rpartition(".")[2].lower()
        return ModelSpec(name, None, kwargs, coarsen, args.model, tuple(args.inputs), precision)
    if args.inputs:
        raise UsageError("--input applies to a factory model ('module:callable'), not a zoo model")
    batch = args.batch
    if "batch" in kwargs:
        if batch is not None:
            raise UsageError("give the batch size once: --batch N or --set batch=N")
        batch = kwargs.pop("batch")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise UsageError(f"--set batch must be a positive integer, got {batch!r}")
    _check_model_kwargs(model, kwargs)
    return ModelSpec(model, batch, kwargs, coarsen, precision=precision)


def _check_model_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """Type-check --set values against the model's defaults (the zoo checks the names)."""
    from planner.graph.zoo import MODELS

    info = MODELS.get(name)
    if info is None:
        return  # model_graph names the valid models
    for key, value in kwargs.items():
        if key not in info.defaults:
            continue  # model_graph names the valid options
        default = info.defaults[key]
        if default is None:  # an optional size: checked against its declared type
            kind = info.kinds.get(key)
            if value is None or kind not in _EXAMPLES:
                continue  # null keeps the default; other kinds: the model checks them
            default = _EXAMPLES[kind]
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            want = "a positive integer"
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            ok = ok and math.isfinite(value) and (key != "dropout" or 0 <= value < 1)
            want = "a probability in [0, 1)" if key == "dropout" else "a number"
        else:
            ok, want = isinstance(value, type(default)), type(default).__name__
        if not ok:
            raise UsageError(f"model {name!r}: --set {key} must be {want}, got {value!r}")


# A value of each type an optional model size may declare, for `_check_model_kwargs`'s rules.
_EXAMPLES: dict[Any, Any] = {bool: False, int: 1, float: 1.0, str: ""}


def malformed(what: str, path: Path, load: Callable[[], Any]) -> Any:
    """Run `load`; a TypeError/KeyError/AttributeError from a malformed file is bad input.

    The loaders (OpGraph.load, load_strategy) should raise LayerwiseError themselves for
    every malformed file; this catches the cases they miss, only around the load of `path`.
    """
    try:
        return load()
    except (TypeError, KeyError, AttributeError) as exc:
        raise LayerwiseError(f"{what} {path} is malformed: {type(exc).__name__}: {exc}") from None


def check_cost_section(cost: Any) -> dict[str, Any]:
    """The `cost` object of a strategy file: the CostOptions it was planned with."""
    import dataclasses

    from planner.costs.costmodel import CostOptions

    if not isinstance(cost, dict):
        raise LayerwiseError(f'the strategy file\'s "cost" must be an object, got {cost!r}')
    if cost.get("source", "analytic") not in ("analytic", "measured"):
        raise LayerwiseError(
            f"the strategy file's cost source must be 'analytic' or 'measured', "
            f"got {cost.get('source')!r}"
        )
    checked = {"sync", "optimizer", "master_weights", "recompute", "tf32", "rates"}
    checked |= {"attention_kernel", "transfer_once", "nic_rails", "cp_exchange", "cp_order"}
    checked |= {"ep_dispatch", "ep_dispatch_bytes"}
    for f in dataclasses.fields(CostOptions):
        value = cost.get(f.name)
        if value is None or f.name in checked:
            continue  # CostOptions checks these
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise LayerwiseError(
                f"the strategy file's cost option {f.name!r} must be a number, got {value!r}"
            )
    if cost and "rates" not in cost:  # planned before kernel rates by shape: as it was priced
        cost = {**cost, "rates": "flat"}
    return cost


def check_outputs(*paths: tuple[Path | None, str]) -> None:
    """Every output path is writable before any work starts."""
    for path, what in paths:
        if path is not None:
            check_output_path(path, what)
