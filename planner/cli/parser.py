"""The parser of `python -m planner`: one function per command's options, and the option
groups `plan` reads (model, search, cost model, training memory, config space, output)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from planner.cli.args import (
    MAX_LOAD_HELP,
    VERBOSE_HELP,
    OneLineArgumentParser,
    add_logging_options,
    load_limit,
    nonnegative_int,
    positive_int,
    positive_seconds,
    size_bytes,
)
from planner.request import DEFAULT_TIME_LIMIT
from planner.result import DEFAULT_GAP_TOLERANCE

__all__ = ["MODEL_HELP", "build_parser", "plot_path"]

MODEL_HELP = "zoo model name, or a user model factory 'package.module:callable' (with --input)"


def build_parser(prog: str = "python -m planner") -> argparse.ArgumentParser:
    """The parser of every command (`models`, `graph`, `devices`, `plan`, `evaluate`,
    `export`, `profile`); a usage error is one UsageError line."""
    parser = OneLineArgumentParser(
        prog=prog,
        description="Layer-wise parallelization planning: graphs, devices, plans, evaluation. "
        "Bad input ends with one `error: ...` line on stderr and exit status 2.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_command in (
        _models_parser,
        _graph_parser,
        _devices_parser,
        _plan_parser,
        _evaluate_parser,
        _export_parser,
        _profile_parser,
    ):
        add_command(sub)
    return parser


Subparsers = Any  # argparse's _SubParsersAction (private)


def _models_parser(sub: Subparsers) -> None:
    """`models`: the zoo and each model's arguments."""
    p = sub.add_parser(
        "models",
        help="list the model zoo and each model's arguments",
        description="List the zoo models with their default arguments (change them with --set).",
    )
    _logging_args(p)


def _graph_parser(sub: Subparsers) -> None:
    """`graph`: capture a model into an OpGraph."""
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
    _logging_args(p)


def _devices_parser(sub: Subparsers) -> None:
    """`devices`: show (or measure) a device graph."""
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
    _logging_args(p)


def _plan_parser(sub: Subparsers) -> None:
    """`plan`: what to plan, how to search, the cost model, training memory, the config
    space, and what to write."""
    p = sub.add_parser(
        "plan",
        help="search a strategy with a backend",
        description="Search a parallelization strategy for a zoo or user model, an OpGraph "
        "JSON, or a cost-table problem (planner.plan). -o writes a strategy file (for "
        "`evaluate` and `runtime.run`), or the choices of a cost-table problem. The time limit "
        "covers capture and build too. Ctrl-C stops the search and keeps the best answer so "
        "far. Exit status 1 when the backend finds no solution.",
    )
    _plan_input_args(p)
    _search_args(p)
    _cost_args(p)
    _memory_args(p)
    _space_args(p)
    _plan_output_args(p)
    _logging_args(p)


def _plan_input_args(p: argparse.ArgumentParser) -> None:
    """plan's input: a model (with its options), an OpGraph file or a cost-table problem."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help=MODEL_HELP)
    src.add_argument("--graph", type=Path, help="an OpGraph JSON file")
    src.add_argument(
        "--problem", type=Path, help="a cost-table problem JSON (IOPDDL format), plain or gzipped"
    )
    _model_args(p)


def _search_args(p: argparse.ArgumentParser) -> None:
    """plan's search: devices, backend, objective, time limit, seed and backend settings."""
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
        "--gap-tolerance",
        type=_gap_tolerance,
        default=DEFAULT_GAP_TOLERANCE,
        help="relative gap (objective / bound - 1) at which a search stops once its answer is "
        f"proven within it, the answer then OPTIMAL (default {DEFAULT_GAP_TOLERANCE:g}, as MIP "
        "solvers; 0: prove the optimum exactly)",
    )
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


def _cost_args(p: argparse.ArgumentParser) -> None:
    """plan's cost model: candidate configs, memory limit, sync model, analytic or measured."""
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


def _plan_output_args(p: argparse.ArgumentParser) -> None:
    """plan's output: the plan file, the recommendation, JSON on stdout."""
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


def _evaluate_parser(sub: Subparsers) -> None:
    """`evaluate`: re-score a strategy file."""
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
    _logging_args(p)


def _export_parser(sub: Subparsers) -> None:
    """`export`: a plan as a launcher's configuration."""
    from planner.export.launchers import LAUNCHERS

    p = sub.add_parser(
        "export",
        help="write a plan as torchtitan's, Megatron-LM's or an FSDP2 script's configuration",
        description="Write a plan file (`plan -o`) as what a launcher takes: torchtitan's TOML "
        "job config (torchtitan 0.3's overrides in its header), Megatron-LM's arguments, or a "
        "Python script with FSDP2 and DTensor tensor parallelism (docs/launchers.md). What the "
        "launcher cannot express of the plan is one line each on stderr, with the nearest "
        "layout it can and that layout's simulated step beside the plan's.",
    )
    p.add_argument("plan", type=Path, help="a plan file (`planner plan ... -o PLAN`)")
    p.add_argument("--to", required=True, choices=LAUNCHERS, help="the launcher")
    p.add_argument(
        "-o", "--output", type=Path, help="write the configuration here (default: stdout)"
    )
    p.add_argument(
        "--no-simulate",
        action="store_true",
        help="do not simulate the plan and the nearest layouts (quicker for a large plan)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (launcher, layout, notes, simulated seconds, arguments, "
        "output) on stdout instead of the configuration (with -o, the file is written too)",
    )
    _logging_args(p)


def _profile_parser(sub: Subparsers) -> None:
    """`profile`: measure op costs into the cost cache."""
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
    _logging_args(p)


# -- option groups --------------------------------------------------------------------------


def _logging_args(p: argparse.ArgumentParser) -> None:
    """-v and --log-file, on every command."""
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
    p.add_argument(
        "--precision",
        type=_precision,
        help="how the model trains, in Lightning's names: bf16-mixed or 16-mixed (autocast: "
        "fp32 weights, matrix products at the 16-bit rate, norms and the loss in fp32), "
        "bf16-true, 16-true, 32-true, 64-true (default: the dtypes the model holds)",
    )


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
        help="no contraction splits: row-parallel linears and convolutions, a mixture of "
        "experts' hidden widths (expert tensor parallelism)",
    )
    p.add_argument(
        "--table-budget",
        type=size_bytes,
        help="memory the cost tables may take, e.g. 4GiB (the default) or 16GiB",
    )


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
        help="fraction of each device's memory kept free, in [0, 1) (default 0.05: the "
        "allocator's fragmentation; docs/cost_model.md, Memory)",
    )
    p.add_argument(
        "--reserve",
        type=_reserve_gib,
        help="GiB kept free on each GPU for the framework (CUDA context, NCCL buffers, "
        "workspaces), besides the headroom (default 2)",
    )
    p.add_argument(
        "--recompute",
        type=_recompute_mode,
        help="activation recomputation: none (default: keep what the backward reads), "
        "selective (the attention ops of the model's numbered blocks run their forward again "
        "in the backward, Megatron-LM's --recompute-granularity selective), full (every op "
        "inside the numbered blocks does instead of keeping its activations), N (the first N "
        "blocks do) or auto (the fastest plan that fits); default: none, or auto with --zero "
        "auto when the plan does not fit without them",
    )
    p.add_argument(
        "--pipeline",
        type=_pipeline_mode,
        default="auto",
        help="pipeline parallelism (docs/pipeline.md): on (search stages, micro-batches and "
        "schedules with tensor and data degrees), off, or auto (default: on for a model of "
        "numbered blocks on more than one host, or that does not fit otherwise)",
    )


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


def _precision(text: str) -> str | None:
    from planner.errors import LayerwiseError
    from planner.graph.precision import check_precision

    try:
        return check_precision(text)
    except LayerwiseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    if text in ("none", "selective", "full", "auto"):
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected none, selective, full, auto or a number of blocks, got {text!r}"
        )
    return int(text)


def _reserve_gib(text: str) -> float:
    """--reserve's GiB as bytes."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of GiB >= 0, got {text!r}")
    return value * 2**30


def _gap_tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a relative gap in [0, 1) (e.g. 1e-4, or 0 to prove exactly), got {text!r}"
        )
    return value


def _headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value
