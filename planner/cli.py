"""`python -m planner`: models, graph, devices, plan, evaluate, profile.

Every command ends bad input with a one-line `error: ...` on stderr and exit status 2 (usage
errors included: no argparse usage block). A plan that finds no solution exits with status 1.

The library in planner/ never imports a backend; only this entry point does, lazily, in
`plan`, because the issue asks for `python -m planner plan --backend NAME`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from planner.errors import LayerwiseError

EXIT_NO_SOLUTION = 1
EXIT_BAD_INPUT = 2


class UsageError(LayerwiseError):
    """The command line itself is wrong (unknown option, missing argument, bad value)."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that reports usage errors as one `UsageError` (no usage block)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


# -- argument types -------------------------------------------------------------------------


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def _finite_float(text: str, what: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        bound = "> 0" if positive else ">= 0"
        raise argparse.ArgumentTypeError(f"expected a finite {what} {bound}, got {text}")
    return value


def positive_seconds(text: str) -> float:
    return _finite_float(text, "number of seconds", positive=True)


def nonnegative_seconds(text: str) -> float:
    return _finite_float(text, "number of seconds", positive=False)


def positive_number(text: str) -> float:
    return _finite_float(text, "number", positive=True)


def _memory_limit(text: str) -> str | float:
    if text == "device":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected 'device' or a positive number of bytes per device, got {text!r}"
        )
    return value


def _kv(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


# -- the parser -----------------------------------------------------------------------------


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=positive_int, help="global batch size (default: the model's)")
    p.add_argument(
        "--set",
        dest="model_kwargs",
        type=_kv,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model argument, e.g. --set image_size=64 --set steps=4 (see `planner models`)",
    )
    p.add_argument("--no-coarsen", action="store_true", help="keep every captured op")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="python -m planner",
        description="Layer-wise parallelization planning: graphs, devices, plans, evaluation. "
        "Bad input ends with one `error: ...` line on stderr and exit status 2.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "models",
        help="list the model zoo and each model's arguments",
        description="List the zoo models with their default arguments (change them with --set).",
    )

    p = sub.add_parser(
        "graph",
        help="capture a zoo model into an OpGraph",
        description="Capture a zoo model with torch.fx (on the meta device) into an OpGraph.",
    )
    p.add_argument("model", help="zoo model name (see `models`)")
    _model_args(p)
    p.add_argument("--json", dest="json_out", type=Path, help="write the graph JSON here")
    p.add_argument(
        "--summary",
        action="store_true",
        help="print one JSON object (name, ops, edges, forward_flops, parameter_bytes, kinds)",
    )

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

    p = sub.add_parser(
        "plan",
        help="search a strategy with a backend",
        description="Search a parallelization strategy for a zoo model, an OpGraph JSON, or a "
        "cost-table problem. -o writes a strategy file (for `evaluate`), or the choices of a "
        "cost-table problem. Exit status 1 when the backend finds no solution.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help="zoo model name")
    src.add_argument("--graph", type=Path, help="an OpGraph JSON file")
    src.add_argument("--problem", type=Path, help="a cost-table problem JSON (IOPDDL format)")
    _model_args(p)
    p.add_argument("--devices", help="device preset or JSON (not used with --problem)")
    p.add_argument("--backend", default="baselines", help="search backend (default baselines)")
    p.add_argument(
        "--objective",
        default="additive",
        choices=["additive", "makespan"],
        help="additive: OptCNN Eq. 1 (default); makespan: simulated iteration time",
    )
    p.add_argument("--time-limit", type=positive_seconds, default=10.0, help="seconds (default 10)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random seed >= 0 (default 0)")
    p.add_argument(
        "--max-configs", type=positive_int, help="cap on candidate configs per op (>= 1)"
    )
    p.add_argument(
        "--memory-limit",
        type=_memory_limit,
        help="'device' (each device's memory) or bytes per device (default none)",
    )
    p.add_argument("--sync", choices=["ring", "ps"], help="parameter sync model (default ring)")
    p.add_argument("--cost", choices=["analytic", "measured"], help="cost model (default analytic)")
    _space_args(p)
    p.add_argument("-o", "--output", type=Path, help="write the plan (a strategy file) here")

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
    p.add_argument("--plot", type=Path, help="write a Gantt chart of the timeline (e.g. T.png)")

    p = sub.add_parser(
        "profile",
        help="measure op costs on this machine into the cost cache",
        description="Measure op costs of a zoo model on this machine into the cost cache.",
    )
    p.add_argument("model", help="zoo model name")
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
    return parser


def _table_budget(text: str) -> float:
    from planner.problems.sizes import parse_bytes

    try:
        return float(parse_bytes(text))
    except LayerwiseError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
        "--table-budget",
        type=_table_budget,
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


def _graph_from_args(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from planner.graph.zoo import model_graph

    kwargs = dict(args.model_kwargs)
    batch = args.batch
    if "batch" in kwargs:
        if batch is not None:
            raise UsageError("give the batch size once: --batch N or --set batch=N")
        batch = kwargs.pop("batch")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise UsageError(f"--set batch must be a positive integer, got {batch!r}")
    _check_model_kwargs(args.model, kwargs)
    if batch is not None and batch >= 2**60:  # 4-byte samples past 2^62 bytes: int64 overflow
        raise UsageError(f"--batch {batch} is beyond 64-bit tensor sizes: use a smaller batch")
    try:
        graph = model_graph(args.model, batch=batch, coarsen=not args.no_coarsen, **kwargs)
    except (RuntimeError, OverflowError) as exc:  # e.g. torch: sizes beyond 64 bits
        raise LayerwiseError(
            f"model {args.model!r} cannot be captured with batch {batch}: {_one_line(exc)} "
            "(use a smaller batch)"
        ) from None
    model = {
        "name": args.model,
        "batch": batch,
        "kwargs": kwargs,
        "coarsen": not args.no_coarsen,
    }
    return graph, model


def _malformed(what: str, path: Path, load: Callable[[], Any]) -> Any:
    """Run `load`; a TypeError/KeyError/AttributeError from a malformed file is bad input.

    The loaders (OpGraph.load, load_strategy) should raise LayerwiseError themselves for
    every malformed file; this catches the cases they miss, only around the load of `path`.
    """
    try:
        return load()
    except (TypeError, KeyError, AttributeError) as exc:
        raise LayerwiseError(f"{what} {path} is malformed: {type(exc).__name__}: {exc}") from None


def _cost_model(graph: Any, devices: Any, options: dict[str, Any], source: str) -> Any:
    from planner.costs.costmodel import CostModel, CostOptions

    fields = {f.name for f in dataclasses.fields(CostOptions)}
    opts = CostOptions(**{k: v for k, v in options.items() if k in fields})
    measured = None
    if source == "measured":
        from planner.costs.profile import MeasuredTimes

        measured = MeasuredTimes.load(devices, graph=graph)
    return CostModel(graph, devices, opts, measured=measured)


def _check_cost_section(cost: Any) -> dict[str, Any]:
    """The `cost` object of a strategy file: the CostOptions it was planned with."""
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
        if value is None or f.name == "sync":
            continue  # CostOptions checks sync
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise LayerwiseError(
                f"the strategy file's cost option {f.name!r} must be a number, got {value!r}"
            )
    return cost


# -- commands -------------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    from planner.graph.zoo import MODELS

    for name, info in MODELS.items():
        defaults = ", ".join(f"{k}={v}" for k, v in info.defaults.items())
        print(f"{name:12s} {info.description}\n{'':12s} ({defaults})")
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    graph, _ = _graph_from_args(args)
    if args.json_out:
        graph.save(args.json_out)
    summary = graph.summary()
    if args.summary:
        print(json.dumps(summary))
    else:
        print(
            f"{graph.name}: {summary['ops']} ops, {summary['edges']} edges, "
            f"{summary['forward_flops'] / 1e9:.3f} GFLOP forward, "
            f"{summary['parameter_bytes'] / 2**20:.1f} MiB parameters"
        )
        print("kinds: " + ", ".join(f"{k}={v}" for k, v in summary["kinds"].items()))
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from planner.hardware.presets import load_devices, measure_cpu_local

    if args.measure:
        match = re.fullmatch(r"cpu-local-(\d+)", args.preset)
        if match is None:
            raise UsageError("--measure only applies to cpu-local-N presets")
        print(json.dumps(measure_cpu_local(int(match[1]))))
    devices = load_devices(args.preset)
    if args.json_out:
        devices.save(args.json_out)
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
                ("--no-coarsen", args.no_coarsen),
            )
            if value
        ]
        if given:
            source = "--graph" if args.graph else "--problem"
            verb = "applies" if len(given) == 1 else "apply"
            raise UsageError(f"{', '.join(given)} only {verb} to a zoo model, not to {source}")
    if args.problem:
        given = [
            flag
            for flag, value in (
                ("--devices", args.devices),
                ("--max-configs", args.max_configs),
                ("--memory-limit", args.memory_limit),
                ("--sync", args.sync),
                ("--cost", args.cost),
                ("--space", args.space),
                ("--max-split-dims", args.max_split_dims),
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


def cmd_plan(args: argparse.Namespace) -> int:
    from backends import SolveOptions, get_backend
    from planner.problems.problem import build_problem

    _check_plan_args(args)
    backend = get_backend(args.backend)
    options = SolveOptions(objective=args.objective, time_limit=args.time_limit, seed=args.seed)
    model: dict[str, Any] | None = None
    if args.problem:
        from planner.problems.costtable import load_problem

        problem = load_problem(args.problem)
    else:
        from planner.hardware.presets import load_devices
        from planner.problems.sizes import DEFAULT_TABLE_BUDGET, check_devices_spec

        budget = args.table_budget or DEFAULT_TABLE_BUDGET
        check_devices_spec(args.devices, budget)
        devices = load_devices(args.devices)
        if args.graph:
            from planner.graph.opgraph import OpGraph

            path = args.graph
            graph = _malformed("graph file", path, lambda: OpGraph.load(path))
        else:
            graph, model = _graph_from_args(args)
        cm = _cost_model(graph, devices, {"sync": args.sync or "ring"}, args.cost or "analytic")
        problem = build_problem(
            graph,
            devices,
            cm,
            args.max_configs,
            args.memory_limit,
            space=args.space or "auto",
            table_budget=budget,
            max_split_dims=args.max_split_dims,
        )
    result = backend.solve(problem, options)
    out = {
        "status": result.status.value,
        "limit": result.limit.value if result.limit else None,
        "objective": result.objective,
        "bound": result.bound,
        "gap": result.gap,
        "backend": result.backend,
        "objective_kind": args.objective,
        "search_seconds": result.stats.get("search_seconds"),
        "build_seconds": problem.stats.get("build_seconds"),
        "space": problem.space_kind,
    }
    if result.choices is None:
        print(json.dumps(out))
        print(
            f"error: backend {result.backend!r} found no solution (status "
            f"{result.status.value}){'; nothing written' if args.output else ''}",
            file=sys.stderr,
        )
        return EXIT_NO_SOLUTION
    cm = problem.cost_model
    if result.strategy is not None and cm is not None:
        from planner.problems.sizes import check_strategy_memory

        check_strategy_memory(cm, result.strategy)  # a plan the devices cannot hold is an error
        cost = {**dataclasses.asdict(cm.options), "source": cm.source}
        data = result.strategy.to_json(model=model, extra={**out, "cost": cost})
        _print_plan(out, result.strategy.describe())
    else:
        data = {**out, "choices": list(result.choices)}
        print(json.dumps(out))
    if args.output:
        args.output.write_text(json.dumps(data, indent=1))
        print(f"plan written to {args.output}", file=sys.stderr)
    return 0


def _print_plan(out: dict[str, Any], rows: list[tuple[str, str, str]]) -> None:
    for name, kind, cfg in rows:
        print(f"  {name:40s} {kind:12s} {cfg}")
    print(json.dumps(out))


def cmd_evaluate(args: argparse.Namespace) -> int:
    from planner.problems.evaluate import score_strategy
    from planner.problems.strategy import load_strategy
    from planner.sim.simulator import simulate
    from planner.sim.trace import save_chrome_trace, save_gantt

    path = args.strategy
    strategy, data = _malformed("strategy file", path, lambda: load_strategy(path))
    cost = _check_cost_section(data.get("cost", {}))
    cm = _cost_model(strategy.graph, strategy.devices, cost, cost.get("source", "analytic"))
    b = score_strategy(cm, strategy)
    timeline = simulate(cm, strategy)
    if args.trace:
        save_chrome_trace(timeline, args.trace)
    if args.plot:
        save_gantt(
            timeline,
            args.plot,
            f"{strategy.graph.name} on {strategy.devices.name}: "
            f"{timeline.makespan * 1e3:.3f} ms simulated",
        )
    result = {
        "additive": b.total,
        "makespan": timeline.makespan,
        "compute": b.compute,
        "sync": b.sync,
        "transfer": b.transfer,
        "memory_peak_bytes": float(b.memory.max()),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"additive (OptCNN Eq. 1): {b.total * 1e3:.3f} ms = compute {b.compute * 1e3:.3f} "
            f"+ sync {b.sync * 1e3:.3f} + transfer {b.transfer * 1e3:.3f}; "
            f"peak memory per device {b.memory.max() / 2**20:.1f} MiB"
        )
        print(f"makespan (FlexFlow simulation): {timeline.makespan * 1e3:.3f} ms")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from planner.costs.profile import profile_graph
    from planner.hardware.presets import load_devices

    graph, _ = _graph_from_args(args)
    devices = load_devices(args.devices)
    path = profile_graph(
        graph, devices, repeats=args.repeats, max_configs=args.max_configs, space=args.space
    )
    print(f"measured costs cached in {path}")
    return 0


COMMANDS = {
    "models": cmd_models,
    "graph": cmd_graph,
    "devices": cmd_devices,
    "plan": cmd_plan,
    "evaluate": cmd_evaluate,
    "profile": cmd_profile,
}


def _one_line(exc: BaseException) -> str:
    """The first non-empty line of an error message (some wrap a multi-line torch error)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except LayerwiseError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UnicodeDecodeError as exc:  # a binary file given where JSON was expected
        print(f"error: an input file is not UTF-8 text (JSON expected): {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
