"""The commands of `python -m planner` and their parser (see planner.cli)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from planner.api import DEFAULT_TIME_LIMIT
from planner.cli.args import (
    EXIT_NO_SOLUTION,
    MAX_LOAD_HELP,
    VERBOSE_HELP,
    OneLineArgumentParser,
    UsageError,
    add_logging_options,
    load_limit,
    nonnegative_int,
    positive_int,
    positive_seconds,
    report_errors,
    size_bytes,
)
from planner.cli.output import print_ops, print_summary, quantity
from planner.errors import LayerwiseError
from planner.files import check_output_path, strict_json, write_text_atomic

# -- argument types -------------------------------------------------------------------------


def _memory_limit(text: str) -> str | float:
    if text == "device":
        return text
    try:
        return size_bytes(text)
    except argparse.ArgumentTypeError as exc:
        if text.strip().startswith("-"):
            raise
        raise argparse.ArgumentTypeError(f"{exc} (or 'device': each device's memory)") from None


def _kv(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _input_spec(text: str) -> Any:
    """--input 8x3x32x32[:dtype] -> InputSpec."""
    from planner.graph.models import DTYPE_NAMES, InputSpec

    shape_text, _, dtype = text.partition(":")
    try:
        shape = tuple(int(s) for s in shape_text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"expected a shape like 8x3x32x32 (optionally :dtype), got {text!r}"
        )
    if dtype and dtype not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {dtype!r} in {text!r}; one of {', '.join(DTYPE_NAMES)}"
        )
    return InputSpec(shape, dtype or "float32")


def plot_path(text: str) -> Path:
    """A path whose suffix is a format matplotlib can write (checked before any work)."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(text)
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise argparse.ArgumentTypeError(
            f"cannot write a plot as {path.name!r}: use one of the formats matplotlib writes "
            f"({', '.join('.' + f for f in sorted(formats))})"
        )
    return path


# -- the parser -----------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    add_logging_options(p, f"{VERBOSE_HELP}; plan: list every op")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=positive_int, help="global batch size (default: the model's)")
    p.add_argument(
        "--set",
        dest="model_kwargs",
        type=_kv,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model argument, e.g. --set image_size=64 --set steps=4 (see `planner models`); "
        "for a factory: its keyword arguments",
    )
    p.add_argument(
        "--input",
        dest="inputs",
        type=_input_spec,
        action="append",
        default=[],
        metavar="SHAPE[:DTYPE]",
        help="an example input of a factory model, e.g. --input 8x3x32x32 (batch first; "
        "dtype float32 unless given, e.g. 8x40:int64); once per forward() argument",
    )
    p.add_argument("--no-coarsen", action="store_true", help="keep every captured op")


MODEL_HELP = "zoo model name, or a user model factory 'package.module:callable' (with --input)"


def build_parser(prog: str = "python -m planner") -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog=prog,
        description="Layer-wise parallelization planning: graphs, devices, plans, evaluation. "
        "Bad input ends with one `error: ...` line on stderr and exit status 2.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "models",
        help="list the model zoo and each model's arguments",
        description="List the zoo models with their default arguments (change them with --set).",
    )
    _common(p)

    p = sub.add_parser(
        "graph",
        help="capture a model into an OpGraph",
        description="Capture a zoo or user model with torch.fx (on the meta device) into an "
        "OpGraph.",
    )
    p.add_argument("model", help=MODEL_HELP)
    _model_args(p)
    p.add_argument("--json", dest="json_out", type=Path, help="write the graph JSON here")
    p.add_argument(
        "--summary",
        action="store_true",
        help="print one JSON object (name, ops, edges, forward_flops, parameter_bytes, kinds)",
    )
    _common(p)

    p = sub.add_parser(
        "devices",
        help="show a device preset or a device-graph JSON",
        description="Show a device graph: a preset name or a device-graph JSON file.",
    )
    p.add_argument("preset", help="preset name (e.g. p100-4x4) or a device JSON file")
    p.add_argument("--json", dest="json_out", type=Path, help="write the device graph JSON here")
    p.add_argument(
        "--measure", action="store_true", help="cpu-local-N only: measure links/FLOPs and cache"
    )
    p.add_argument("--max-load", type=load_limit, metavar="PER_CORE", help=MAX_LOAD_HELP)
    _common(p)

    p = sub.add_parser(
        "plan",
        help="search a strategy with a backend",
        description="Search a parallelization strategy for a zoo or user model, an OpGraph "
        "JSON, or a cost-table problem (planner.plan). -o writes a strategy file (for "
        "`evaluate` and `runtime.run`), or the choices of a cost-table problem. The time limit "
        "covers capture and build too. Ctrl-C stops the search and keeps the best answer so "
        "far. Exit status 1 when the backend finds no solution.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help=MODEL_HELP)
    src.add_argument("--graph", type=Path, help="an OpGraph JSON file")
    src.add_argument(
        "--problem", type=Path, help="a cost-table problem JSON (IOPDDL format), plain or gzipped"
    )
    _model_args(p)
    p.add_argument("--devices", help="device preset or JSON (not used with --problem)")
    p.add_argument(
        "--backend",
        default="auto",
        help="search backend (default auto: elimination, exact, when its answer fits the "
        "devices' memory, else portfolio under the memory limit; mcmc for --objective makespan)",
    )
    p.add_argument(
        "--objective",
        default="additive",
        choices=["additive", "makespan"],
        help="additive: OptCNN Eq. 1 (default); makespan: simulated iteration time",
    )
    p.add_argument(
        "--time-limit",
        type=positive_seconds,
        default=DEFAULT_TIME_LIMIT,
        help="seconds for the whole plan, capture and build included (default 60; exact "
        "backends stop as soon as they have proven their answer)",
    )
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random seed >= 0 (default 0)")
    p.add_argument(
        "--option",
        dest="backend_options",
        type=_kv,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the backend (VALUE as JSON, else a string), e.g. --option mode=astar "
        "for search; an unknown key is an error that lists the backend's settings",
    )
    p.add_argument(
        "--max-configs", type=positive_int, help="cap on candidate configs per op (>= 1)"
    )
    p.add_argument(
        "--memory-limit",
        type=_memory_limit,
        help="'device' (each device's memory) or a size per device: 16GiB, 16GB (powers of "
        "1000), 1e9 (bytes) (default none)",
    )
    p.add_argument("--sync", choices=["ring", "ps"], help="parameter sync model (default ring)")
    p.add_argument("--cost", choices=["analytic", "measured"], help="cost model (default analytic)")
    _memory_args(p)
    _space_args(p)
    p.add_argument("-o", "--output", type=Path, help="write the plan (a strategy file) here")
    p.add_argument(
        "--no-recommend",
        action="store_true",
        help="return the searched answer even when an expert baseline simulates faster "
        "(default: recommend that baseline instead; the searched answer stays in the plan "
        "file under 'searched')",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object on stdout (status, objective, bound, gap, phase "
        "seconds; strict JSON: null for an unknown or infinite value)",
    )
    _common(p)

    p = sub.add_parser(
        "evaluate",
        help="re-score a strategy file",
        description="Re-score a strategy file (e.g. `plan -o`): OptCNN's additive cost and "
        "FlexFlow's simulated per-iteration time (makespan).",
    )
    p.add_argument("strategy", type=Path, help="a strategy JSON file")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (additive, makespan, compute, sync, transfer in seconds; "
        "memory)",
    )
    p.add_argument("--trace", type=Path, help="write the simulated timeline as a Chrome trace")
    p.add_argument(
        "--plot", type=plot_path, help="write a Gantt chart of the timeline (e.g. T.png, T.svg)"
    )
    _common(p)

    p = sub.add_parser(
        "profile",
        help="measure op costs on this machine into the cost cache",
        description="Measure op costs of a zoo model on this machine into the cost cache.",
    )
    p.add_argument("model", help=MODEL_HELP)
    _model_args(p)
    p.add_argument("--devices", default="cpu-local-2", help="device preset (default cpu-local-2)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed runs per task")
    p.add_argument(
        "--max-configs", type=positive_int, help="cap on candidate configs per op (>= 1)"
    )
    p.add_argument(
        "--space",
        choices=["full", "mesh"],
        default="full",
        help="config space whose task shapes to measure (default full, which covers mesh)",
    )
    p.add_argument(
        "--refresh",
        action="store_true",
        help="time every shape again (default: only those not cached, or cached untrusted: "
        "measured on a busy machine or at no recorded load)",
    )
    p.add_argument("--max-load", type=load_limit, metavar="PER_CORE", help=MAX_LOAD_HELP)
    _common(p)
    return parser


def _space_args(p: argparse.ArgumentParser) -> None:
    """plan's config-space options (docs/space.md)."""
    p.add_argument(
        "--space",
        choices=["auto", "full", "mesh"],
        help="config space: full (every config), mesh (structured, homogeneous clusters), "
        "auto (full when small, else mesh; the default)",
    )
    p.add_argument(
        "--max-split-dims", type=positive_int, help="at most this many split dims per op"
    )
    p.add_argument(
        "--no-reduce",
        dest="reduce",
        action="store_const",
        const=False,
        help="no contraction (row-parallel) splits of linears and convolutions",
    )
    p.add_argument(
        "--table-budget",
        type=size_bytes,
        help="memory the cost tables may take, e.g. 4GiB (the default) or 16GiB",
    )


# -- loading user input ---------------------------------------------------------------------


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


def _model_spec(args: argparse.Namespace) -> Any:
    """The ModelSpec of the command line's model: a zoo name or a factory with --input."""
    from planner.graph.models import ModelSpec

    kwargs = dict(args.model_kwargs)
    coarsen = not args.no_coarsen
    if ":" in args.model:
        if args.batch is not None:
            raise UsageError("--batch applies to a zoo model; a factory's batch is --input's")
        if not args.inputs:
            raise UsageError(
                f"model factory {args.model!r} needs --input SHAPE for each forward() argument"
            )
        name = args.model.rpartition(":")[2].rpartition(".")[2].lower()
        return ModelSpec(name, None, kwargs, coarsen, args.model, tuple(args.inputs))
    if args.inputs:
        raise UsageError("--input applies to a factory model ('module:callable'), not a zoo model")
    batch = args.batch
    if "batch" in kwargs:
        if batch is not None:
            raise UsageError("give the batch size once: --batch N or --set batch=N")
        batch = kwargs.pop("batch")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise UsageError(f"--set batch must be a positive integer, got {batch!r}")
    _check_model_kwargs(args.model, kwargs)
    return ModelSpec(args.model, batch, kwargs, coarsen)


def _malformed(what: str, path: Path, load: Callable[[], Any]) -> Any:
    """Run `load`; a TypeError/KeyError/AttributeError from a malformed file is bad input.

    The loaders (OpGraph.load, load_strategy) should raise LayerwiseError themselves for
    every malformed file; this catches the cases they miss, only around the load of `path`.
    """
    try:
        return load()
    except (TypeError, KeyError, AttributeError) as exc:
        raise LayerwiseError(f"{what} {path} is malformed: {type(exc).__name__}: {exc}") from None


def _memory_args(p: argparse.ArgumentParser) -> None:
    """Training memory options of `plan` (docs/cost_model.md, "Memory")."""
    p.add_argument(
        "--optimizer",
        choices=["none", "sgd", "adam"],
        help="optimizer state kept per parameter: none (default: weights and gradients only), "
        "sgd (a momentum buffer), adam (two fp32 moments)",
    )
    p.add_argument(
        "--master-weights",
        action="store_const",
        const=True,
        help="keep an fp32 master copy of 16-bit weights (mixed precision)",
    )
    p.add_argument(
        "--zero",
        type=_zero_stage,
        help="ZeRO stage 0-3 (shard optimizer state, then gradients, then weights over the "
        "data-parallel replicas) or auto (the lowest stage whose plan fits); default: 0, "
        "or auto with --recompute auto when the plan does not fit without them",
    )
    p.add_argument(
        "--headroom",
        type=_headroom,
        help="fraction of each device's memory kept free, in [0, 1) (default 0)",
    )
    p.add_argument(
        "--recompute",
        type=_recompute_mode,
        help="activation recomputation: none (default: keep every activation), full (the "
        "ops inside the model's numbered blocks run their forward again in the backward "
        "instead of keeping their outputs), N (the first N blocks do) or auto (the fastest "
        "plan that fits); default: none, or auto with --zero auto when the plan does not "
        "fit without them",
    )
    p.add_argument(
        "--pipeline",
        type=_pipeline_mode,
        default="auto",
        help="pipeline parallelism (docs/pipeline.md): on (search stages, micro-batches and "
        "schedules with tensor and data degrees), off, or auto (default: on for a model of "
        "numbered blocks on more than one host, or that does not fit otherwise)",
    )


def _pipeline_mode(text: str) -> bool | str:
    modes: dict[str, bool | str] = {"auto": "auto", "on": True, "off": False}
    if text not in modes:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return modes[text]


def _zero_stage(text: str) -> int | str:
    if text == "auto":
        return text
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"expected a ZeRO stage 0, 1, 2, 3 or auto, got {text!r}")
    return int(text)


def _recompute_mode(text: str) -> str | int:
    if text in ("none", "full", "auto"):
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected none, full, auto or a number of blocks, got {text!r}"
        )
    return int(text)


def _headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _check_cost_section(cost: Any) -> dict[str, Any]:
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
    for f in dataclasses.fields(CostOptions):
        value = cost.get(f.name)
        if value is None or f.name in ("sync", "optimizer", "master_weights", "recompute", "tf32"):
            continue  # CostOptions checks these
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise LayerwiseError(
                f"the strategy file's cost option {f.name!r} must be a number, got {value!r}"
            )
    return cost


def _outputs(*paths: tuple[Path | None, str]) -> None:
    """Every output path is writable before any work starts."""
    for path, what in paths:
        if path is not None:
            check_output_path(path, what)


# -- commands -------------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    from planner.graph.zoo import MODELS

    for name, info in MODELS.items():
        defaults = ", ".join(f"{k}={v}" for k, v in info.defaults.items())
        print(f"{name:12s} {info.description}\n{'':12s} ({defaults})")
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    _outputs((args.json_out, "graph JSON"))
    graph = _model_spec(args).graph()
    if args.json_out:
        write_text_atomic(args.json_out, json.dumps(graph.to_json(), indent=1))
    summary = graph.summary()
    if args.summary:
        print(json.dumps(summary))
    else:
        print(
            f"{graph.name}: {quantity(summary['ops'], 'op')}, "
            f"{quantity(summary['edges'], 'edge')}, "
            f"{summary['forward_flops'] / 1e9:.3f} GFLOP forward, "
            f"{summary['parameter_bytes'] / 2**20:.1f} MiB parameters"
        )
        print("kinds: " + ", ".join(f"{k}={v}" for k, v in summary["kinds"].items()))
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from planner.hardware.presets import load_devices, measure_cpu_local

    _outputs((args.json_out, "device JSON"))
    if args.measure:
        match = re.fullmatch(r"cpu-local-(\d+)", args.preset)
        if match is None:
            raise UsageError("--measure only applies to cpu-local-N presets")
        print(json.dumps(measure_cpu_local(int(match[1]), max_load=args.max_load)))
    elif args.max_load is not None:
        raise UsageError("--max-load applies to --measure only")
    devices = load_devices(args.preset)
    if args.json_out:
        write_text_atomic(args.json_out, json.dumps(devices.to_json(), indent=1))
    print(devices.summary())
    return 0


def _check_plan_args(args: argparse.Namespace) -> None:
    """Options that do not apply to the chosen input are an error, not silently ignored."""
    if args.model is None:
        given = [
            flag
            for flag, value in (
                ("--batch", args.batch),
                ("--set", args.model_kwargs),
                ("--input", args.inputs),
                ("--no-coarsen", args.no_coarsen),
            )
            if value
        ]
        if given:
            source = "--graph" if args.graph else "--problem"
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{', '.join(given)} only {verb} to a model, not to {source}")
    if args.problem:
        given = [
            flag
            for flag, value in (
                ("--devices", args.devices),
                ("--max-configs", args.max_configs),
                ("--memory-limit", args.memory_limit),
                ("--sync", args.sync),
                ("--cost", args.cost),
                ("--optimizer", args.optimizer),
                ("--master-weights", args.master_weights),
                ("--zero", args.zero),
                ("--headroom", args.headroom),
                ("--recompute", args.recompute),
                ("--space", args.space),
                ("--max-split-dims", args.max_split_dims),
                ("--no-reduce", args.reduce),
                ("--table-budget", args.table_budget),
            )
            if value is not None
        ]
        if given:
            verb = "does" if len(given) == 1 else "do"
            raise UsageError(
                f"{', '.join(given)} {verb} not apply to --problem (a cost-table problem "
                "has its own costs and memory limit)"
            )
    elif not args.devices:
        raise UsageError("--devices is required to plan a model or a graph")


def _plan_source(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """What `planner.plan` plans (a Problem, an OpGraph or a model) and its model options."""
    if args.problem:
        from planner.problems.costtable import load_problem

        return load_problem(args.problem), {}
    if args.graph:
        from planner.graph.opgraph import OpGraph

        path = args.graph
        return _malformed("graph file", path, lambda: OpGraph.load(path)), {}
    spec = _model_spec(args)
    kwargs = dict(spec.kwargs)
    if spec.factory is not None:
        return spec.factory, {
            "model_kwargs": kwargs,
            "example_inputs": spec.inputs,
            "name": spec.name,
            "coarsen": spec.coarsen,
        }
    if spec.batch is not None:
        kwargs["batch"] = spec.batch
    return spec.name, {"model_kwargs": kwargs, "coarsen": spec.coarsen}


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.deadline import Deadline

    deadline = Deadline.after(args.time_limit)  # the limit counts from the command's start
    from planner.api import PlanResult, check_backend, plan
    from planner.pipelined import PipelinePlan

    _check_plan_args(args)
    _outputs((args.output, "plan"))
    check_backend(args.backend, args.objective)  # refused before torch is imported
    if args.model is not None and args.model.endswith((".json", ".json.gz", ".gz")):
        from planner.files import check_input_file  # a FIFO or directory: refused before torch

        check_input_file(args.model, "model")
    if not (args.problem or args.graph):  # the one step no clock can stop, bounded
        from planner.sources import load_torch

        load_torch(deadline)
    source, model_options = _plan_source(args)
    dnn = not args.problem
    result = plan(
        source,
        args.devices if dnn else None,
        backend=args.backend,
        objective=args.objective,
        time_limit=args.time_limit,
        seed=args.seed,
        max_configs=args.max_configs,
        memory_limit=args.memory_limit,
        cost=args.cost or "analytic",
        sync=args.sync,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        zero=args.zero,
        headroom=args.headroom,
        recompute=args.recompute,
        pipeline=args.pipeline if dnn else False,
        recommend=not args.no_recommend,
        backend_options=dict(args.backend_options),
        deadline=deadline,
        **model_options,
        **{
            k: v
            for k, v in (
                ("space", args.space),
                ("max_split_dims", args.max_split_dims),
                ("reduce", args.reduce),
                ("table_budget", args.table_budget),
            )
            if v is not None
        },
    )
    summary = result.summary()
    if args.json:
        print(strict_json(summary))
    elif isinstance(result, PipelinePlan):
        print_ops(result.describe(), args.verbose > 0)
        pipe = summary["layout"]
        print(
            f"pipeline: {pipe['layout']}; bubble {pipe['bubble']:.1%}, peak "
            f"{summary['memory_peak_bytes'] / 2**30:.1f} GiB per device"
        )
        print_summary(summary, seconds=True)
    elif result.has_solution:
        print_ops(result.describe(), args.verbose > 0)
        print_summary(summary, seconds=result.problem.is_dnn, problem=result.problem)
    if "zero" in summary:  # --zero auto: which stage and why
        tried = "; ".join(f"stage {t['zero']}: {t['why']}" for t in summary["zero"]["tried"])
        print(f"ZeRO stage {summary['zero']['chose']}" + (f" ({tried})" if tried else ""),
              file=sys.stderr)  # fmt: skip
    if "memory_fallback" in summary:  # ZeRO and recomputation (or pipelines) unset, needed
        how = "pipelines" if "layout" in summary else "--zero auto --recompute auto"
        print(f"planned with {how}: {summary['memory_fallback']}", file=sys.stderr)
    if "recompute" in summary:  # --recompute auto: which and why
        tried = "; ".join(f"{t['recompute']}: {t['why']}" for t in summary["recompute"]["tried"])
        print(f"recompute {summary['recompute']['chose']}" + (f" ({tried})" if tried else ""),
              file=sys.stderr)  # fmt: skip
    if isinstance(result, PlanResult) and not result.has_solution:
        reason = result.message or (
            f"backend {result.backend!r} found no solution (status {result.status.value})"
        )
        print(f"error: {reason}{'; nothing written' if args.output else ''}", file=sys.stderr)
        return EXIT_NO_SOLUTION
    # an interrupted search said so when the Ctrl-C came (planner.deadline's warning) and the
    # status line says (INTERRUPTED): no line of its own repeats it
    if args.output:
        result.save(args.output)
        what = " (the best answer found so far)" if summary["limit"] == "INTERRUPTED" else ""
        print(f"plan written to {args.output}{what}", file=sys.stderr)
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Re-score a strategy file; each phase says what it does on stderr once it has lasted a
    few seconds (a 70B pipeline plan's simulation takes minutes): planner.logs.phase."""
    from planner.api import Evaluation
    from planner.logs import phase
    from planner.problems.evaluate import score_strategy
    from planner.problems.strategy import load_strategy
    from planner.sim.simulator import simulate
    from planner.sources import cost_model

    _outputs((args.trace, "trace"), (args.plot, "plot"))
    path = args.strategy
    with phase(EVALUATE_LOG, f"reading {path}: rebuilding its graph and devices"):
        strategy, data = _malformed("strategy file", path, lambda: load_strategy(path))
    cost = _check_cost_section(data.get("cost", {}))
    options = {k: v for k, v in cost.items() if k != "source"}
    what = f"{strategy.graph.name} ({quantity(len(strategy.graph.ops), 'op')})"
    on = f"{strategy.devices.name} ({quantity(strategy.devices.num_devices, 'device')})"
    with phase(EVALUATE_LOG, f"the cost model of {what} on {on}"):
        cm = cost_model(strategy.graph, strategy.devices, cost.get("source", "analytic"), **options)
    if "pipeline" in data:  # the step is the schedule's timeline of micro-batch costs
        return _evaluate_pipelined(strategy, data, cm, args)
    with phase(EVALUATE_LOG, f"the additive cost (OptCNN Eq. 1) of {what}"):
        b = score_strategy(cm, strategy)
    with phase(EVALUATE_LOG, f"simulating the step of {what} on {on} (FlexFlow)"):
        timeline = simulate(cm, strategy)
    scores = Evaluation(
        b.total, timeline.makespan, b.compute, b.sync, b.transfer, float(b.memory.max()), timeline
    )
    _timeline_files(scores.timeline, strategy, args)
    if args.json:
        print(strict_json(scores.to_json()))
    else:
        print(
            f"additive (OptCNN Eq. 1): {scores.additive * 1e3:.3f} ms = compute "
            f"{scores.compute * 1e3:.3f} + sync {scores.sync * 1e3:.3f} + transfer "
            f"{scores.transfer * 1e3:.3f}; peak memory per device "
            f"{scores.memory_peak_bytes / 2**20:.1f} MiB"
        )
        print(f"makespan (FlexFlow simulation): {scores.makespan * 1e3:.3f} ms")
    return 0


EVALUATE_LOG = logging.getLogger("planner.evaluate")


def _evaluate_pipelined(
    strategy: Any, data: dict[str, Any], cm: Any, args: argparse.Namespace
) -> int:
    """A pipelined plan file: its step simulated as a pipeline (docs/simulator.md,
    "Pipelines"); --plot draws the pipeline's timeline, --trace is refused."""
    from planner.logs import phase
    from planner.pipeline.spec import Pipeline, PipelinedStrategy
    from planner.pipeline.stages import simulate_pipelined

    if args.trace:
        raise UsageError("--trace is not written for a pipelined plan: use --plot")
    pipe = _malformed("strategy file", args.strategy, lambda: Pipeline.from_json(data["pipeline"]))
    ps = _malformed("strategy file", args.strategy, lambda: PipelinedStrategy(strategy, pipe))
    chunks = quantity(pipe.chunks, "chunk")
    group = quantity(len(pipe.group_of(0)), "device")
    with phase(EVALUATE_LOG, f"simulating the pipeline's step: {chunks}, {group} per stage"):
        timeline = simulate_pipelined(cm, ps)
    out = {
        "makespan": timeline.makespan,
        "bubble": timeline.bubble,
        "memory_peak_bytes": max(timeline.peak_bytes),
        "peak_bytes_per_stage": list(timeline.peak_bytes),
        "stages": pipe.stages,
        "chunks": pipe.chunks,
        "micro_batches": pipe.micro_batches,
        "schedule": pipe.schedule,
    }
    if args.plot:
        from planner.pipeline.chart import gantt

        with phase(EVALUATE_LOG, f"drawing {args.plot}"):
            gantt(timeline, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        print(strict_json(out))
    else:
        print(
            f"pipeline: {quantity(pipe.stages, 'stage')} x {quantity(pipe.virtual, 'chunk')}, "
            f"{quantity(pipe.micro_batches, 'micro-batch', plural='micro-batches')}, "
            f"{pipe.schedule}; peak memory per device "
            f"{out['memory_peak_bytes'] / 2**20:.1f} MiB"
        )
        print(
            f"step (pipeline simulation): {timeline.makespan * 1e3:.3f} ms, bubble "
            f"{timeline.bubble:.1%}"
        )
    return 0


def _timeline_files(timeline: Any, strategy: Any, args: argparse.Namespace) -> None:
    from planner.sim.trace import save_chrome_trace, save_gantt

    if args.trace:
        save_chrome_trace(timeline, args.trace)
        print(f"trace written to {args.trace}", file=sys.stderr)
    if args.plot:
        save_gantt(
            timeline,
            args.plot,
            f"{strategy.graph.name} on {strategy.devices.name}: "
            f"{timeline.makespan * 1e3:.3f} ms simulated",
        )
        print(f"plot written to {args.plot}", file=sys.stderr)


def cmd_profile(args: argparse.Namespace) -> int:
    from planner.costs.profile import profile_graph
    from planner.hardware.presets import load_devices

    graph = _model_spec(args).graph()
    devices = load_devices(args.devices)
    path = profile_graph(
        graph,
        devices,
        repeats=args.repeats,
        max_configs=args.max_configs,
        space=args.space,
        refresh=args.refresh,
        max_load=args.max_load,
    )
    data = json.loads(path.read_text(encoding="utf-8"))
    run = data["profiled"][-1]  # this run's record (profile_graph appends one)
    entries = f"{len(data['entries']):,} task shapes in all"
    if run["measured"]:
        print(
            f"measured {run['measured']:,} new task shapes of {graph.name} on {devices.name} "
            f"in {run['seconds']:.1f} s ({quantity(args.repeats, 'timed run')} each); the cache "
            f"{path} holds {entries}: plan with --cost measured"
        )
    else:
        print(
            f"nothing new to measure: every task shape of {graph.name} on {devices.name} is "
            f"in the cache {path} ({entries}): plan with --cost measured"
        )
    return 0


COMMANDS = {
    "models": cmd_models,
    "graph": cmd_graph,
    "devices": cmd_devices,
    "plan": cmd_plan,
    "evaluate": cmd_evaluate,
    "profile": cmd_profile,
}


def main(argv: Sequence[str] | None = None, prog: str = "python -m planner") -> int:
    """Run one command of `python -m planner`; returns the exit status."""

    def run() -> int:
        from planner.logs import setup_logging

        args = build_parser(prog).parse_args(argv)
        setup_logging(args.verbose, args.log_file)
        return COMMANDS[args.command](args)

    return report_errors(run)
