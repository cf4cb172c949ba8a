"""`python -m planner`: models, graph, devices, plan, evaluate, profile.

Every command ends bad input with a one-line `error: ...` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner.errors import LayerwiseError

EXIT_BAD_INPUT = 2


def _kv(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, help="global batch size (default: the model's)")
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
    parser = argparse.ArgumentParser(
        prog="python -m planner",
        description="Layer-wise parallelization planning: graphs, devices, plans, evaluation.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list the model zoo and each model's arguments")

    p = sub.add_parser("graph", help="capture a zoo model into an OpGraph")
    p.add_argument("model", help="zoo model name (see `models`)")
    _model_args(p)
    p.add_argument("--json", dest="json_out", type=Path, help="write the graph JSON here")
    p.add_argument("--summary", action="store_true", help="print one JSON summary object")

    p = sub.add_parser("devices", help="show a device preset or a device-graph JSON")
    p.add_argument("preset", help="preset name (e.g. p100-4x4) or a device JSON file")
    p.add_argument("--json", dest="json_out", type=Path, help="write the device graph JSON here")
    p.add_argument(
        "--measure", action="store_true", help="cpu-local-N only: measure links/FLOPs and cache"
    )

    p = sub.add_parser("plan", help="search a strategy with a backend")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("model", nargs="?", help="zoo model name")
    src.add_argument("--graph", type=Path, help="an OpGraph JSON file")
    src.add_argument("--problem", type=Path, help="a cost-table problem JSON (IOPDDL format)")
    _model_args(p)
    p.add_argument("--devices", help="device preset or JSON (not needed with --problem)")
    p.add_argument("--backend", default="baselines", help="search backend (default baselines)")
    p.add_argument("--objective", default="additive", choices=["additive", "makespan"])
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-configs", type=int, help="cap on candidate configs per op")
    p.add_argument(
        "--memory-limit", help="'device' (each device's memory) or bytes per device (default none)"
    )
    p.add_argument("--sync", choices=["ring", "ps"], default="ring", help="parameter sync model")
    p.add_argument("--cost", choices=["analytic", "measured"], default="analytic")
    p.add_argument("-o", "--output", type=Path, help="write the plan (a strategy file) here")

    p = sub.add_parser("evaluate", help="re-score a strategy file")
    p.add_argument("strategy", type=Path)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("profile", help="measure op costs on this machine into the cost cache")
    p.add_argument("model", help="zoo model name")
    _model_args(p)
    p.add_argument("--devices", default="cpu-local-2", help="device preset (default cpu-local-2)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-configs", type=int, help="cap on candidate configs per op")
    return parser


# -- commands -----------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    from planner.zoo import MODELS

    for name, info in MODELS.items():
        defaults = ", ".join(f"{k}={v}" for k, v in info.defaults.items())
        print(f"{name:12s} {info.description}\n{'':12s} ({defaults})")
    return 0


def _graph_from_args(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    from planner.zoo import model_graph

    kwargs = dict(args.model_kwargs)
    graph = model_graph(args.model, batch=args.batch, coarsen=not args.no_coarsen, **kwargs)
    model = {
        "name": args.model,
        "batch": args.batch,
        "kwargs": kwargs,
        "coarsen": not args.no_coarsen,
    }
    return graph, model


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
    from planner.presets import load_devices, measure_cpu_local

    if args.measure:
        if not args.preset.startswith("cpu-local-"):
            raise LayerwiseError("--measure only applies to cpu-local-N presets")
        print(json.dumps(measure_cpu_local(int(args.preset.rsplit("-", 1)[1]))))
    devices = load_devices(args.preset)
    if args.json_out:
        devices.save(args.json_out)
    print(devices.summary())
    return 0


def _cost_model(graph: Any, devices: Any, options: dict[str, Any], source: str) -> Any:
    from planner.costmodel import CostModel, CostOptions

    fields = {f.name for f in dataclasses.fields(CostOptions)}
    opts = CostOptions(**{k: v for k, v in options.items() if k in fields})
    measured = None
    if source == "measured":
        from planner.profile import MeasuredTimes

        measured = MeasuredTimes.load(devices)
    return CostModel(graph, devices, opts, measured=measured)


def cmd_plan(args: argparse.Namespace) -> int:
    from backends import SolveOptions, get_backend
    from planner.problem import build_problem

    backend = get_backend(args.backend)
    options = SolveOptions(objective=args.objective, time_limit=args.time_limit, seed=args.seed)
    model: dict[str, Any] | None = None
    if args.problem:
        from planner.costtable import load_problem

        problem = load_problem(args.problem)
    else:
        if not args.devices:
            raise LayerwiseError("--devices is required to plan a model or a graph")
        from planner.presets import load_devices

        devices = load_devices(args.devices)
        if args.graph:
            from planner.opgraph import OpGraph

            graph = OpGraph.load(args.graph)
        else:
            graph, model = _graph_from_args(args)
        cm = _cost_model(graph, devices, {"sync": args.sync}, args.cost)
        limit = args.memory_limit
        if limit is not None and limit != "device":
            try:
                limit = float(limit)
            except ValueError:
                raise LayerwiseError(
                    f"--memory-limit must be 'device' or bytes, got {limit!r}"
                ) from None
        problem = build_problem(graph, devices, cm, args.max_configs, limit)
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
    }
    cm = problem.cost_model
    if result.strategy is not None and cm is not None:
        cost = {**dataclasses.asdict(cm.options), "source": cm.source}
        data = result.strategy.to_json(model=model, extra={**out, "cost": cost})
        _print_plan(out, result.strategy.describe())
    else:
        data = {**out, "choices": list(result.choices) if result.choices else None}
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
    from planner.evaluate import score_strategy
    from planner.strategy import load_strategy

    strategy, data = load_strategy(args.strategy)
    cost = data.get("cost", {})
    cm = _cost_model(strategy.graph, strategy.devices, cost, cost.get("source", "analytic"))
    b = score_strategy(cm, strategy)
    result = {
        "additive": b.total,
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
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from planner.presets import load_devices
    from planner.profile import profile_graph

    graph, _ = _graph_from_args(args)
    devices = load_devices(args.devices)
    path = profile_graph(graph, devices, repeats=args.repeats, max_configs=args.max_configs)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except LayerwiseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
