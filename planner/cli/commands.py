"""The commands of `python -m planner` (`models`, `graph`, `devices`, `profile` here; `plan`
and `evaluate` in their own modules) and `main`, which parses and runs one."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence

from planner.cli.args import UsageError, report_errors
from planner.cli.evaluate import cmd_evaluate
from planner.cli.inputs import check_outputs, model_spec
from planner.cli.output import quantity
from planner.cli.parser import build_parser
from planner.cli.plan import cmd_plan
from planner.files import write_text_atomic

__all__ = ["COMMANDS", "main"]


def cmd_models(args: argparse.Namespace) -> int:
    """List the zoo models with their default arguments."""
    from planner.graph.hf_zoo import DEFAULT_BATCH, MAX_DEFAULT_SEQ, shipped_names
    from planner.graph.zoo import MODELS

    for name, info in MODELS.items():
        defaults = ", ".join(f"{k}={v}" for k, v in info.defaults.items())
        print(f"{name:12s} {info.description}\n{'':12s} ({defaults})")
    print(
        f"{'hf:NAME':12s} a Hugging Face transformers causal LM built from its config "
        "(pip install 'layerwise[hf]'): NAME is a shipped config or a config.json path\n"
        f"{'':12s} (batch={DEFAULT_BATCH}, seq=min({MAX_DEFAULT_SEQ}, max_position_embeddings), "
        "dtype=float32, and any config field, e.g. --set num_hidden_layers=2)\n"
        f"{'':12s} shipped: {', '.join(shipped_names())}"
    )
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    """Capture a model into an OpGraph: its summary, and the graph JSON with --json."""
    check_outputs((args.json_out, "graph JSON"))
    graph = model_spec(args).graph()
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
    """Show a device graph (a preset or a JSON file); --measure a cpu-local-N preset first."""
    from planner.hardware.presets import load_devices, measure_cpu_local

    check_outputs((args.json_out, "device JSON"))
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


def cmd_export(args: argparse.Namespace) -> int:
    """Write a plan as a launcher's configuration; what it cannot express on stderr."""
    import sys

    from planner.export.launchers import export_launcher
    from planner.files import strict_json

    check_outputs((args.output, f"{args.to} configuration"))
    launch = export_launcher(args.plan, args.to, simulate=not args.no_simulate)
    if args.output is not None:
        launch.save(args.output)
    for note in launch.notes:
        print(f"cannot express: {note}", file=sys.stderr)
    if args.json:
        print(
            strict_json(
                {
                    "to": launch.to,
                    "layout": launch.uniform.describe(),
                    "world": launch.uniform.world,
                    "notes": list(launch.notes),
                    "planned_seconds": launch.planned_seconds,
                    "exported_seconds": launch.exported_seconds,
                    "args": list(launch.args),
                    "output": str(args.output) if args.output is not None else None,
                }
            )
        )
    elif args.output is None:
        sys.stdout.write(launch.text)
    if args.output is not None:
        print(f"{args.to}: {launch.uniform.describe()}, written to {args.output}", file=sys.stderr)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Measure a model's task shapes on this machine into the cost cache."""
    from planner.costs.profile import profile_graph
    from planner.hardware.presets import load_devices

    graph = model_spec(args).graph()
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
    "export": cmd_export,
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
