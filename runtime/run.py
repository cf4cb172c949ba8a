"""`python -m runtime.run STRATEGY.json --steps K [--world N] [--check] [--json]`.

Trains K steps of a strategy file (`python -m planner plan ... -o STRATEGY.json`) on N local
worker processes, or on the processes of a torchrun launch, and prints the median step time
after the warm-up steps; with --check also the largest relative deviation of the loss and
parameters from single-process training of the same model (a zoo model, or a user model
rebuilt from the factory the file names). Everything that can be wrong with the arguments,
the file, its fingerprints, the model or the world size is one `error:` line before any
process starts (exit status 2); a worker that fails, or a loss or parameter that becomes
non-finite, is reported by rank (exit status 1); with --check, a deviation above the
tolerance (by dtype, TOLERANCE; or --tolerance) is one `error:` line after the report (exit
status 3). A file with a `pipeline` section (`planner.pipeline.spec.PipelinedStrategy`) runs
its m micro-batches per step in the pipeline's schedule (runtime.pipeline).
"""

from __future__ import annotations

import os
import sys

# A Ctrl-C during the imports below (numpy, the planner) is one line and status 130, not a
# traceback of importlib frames; `main` handles the later ones (torch's import among them).
if __name__ == "__main__":
    from planner.startup import end_guard, guard_start

    _previous = guard_start()

import argparse  # noqa: E402
import json  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from planner.cli.args import (  # noqa: E402
    EXIT_BAD_INPUT,
    OneLineArgumentParser,
    add_logging_options,
    exit_now,
    nonnegative_int,
    positive_int,
    positive_number,
    positive_seconds,
    report_errors,
)
from planner.costs.context import CP_ORDERS  # noqa: E402
from planner.costs.recompute import recompute_error  # noqa: E402
from planner.errors import LayerwiseError  # noqa: E402
from planner.pipeline.timeline import counted  # noqa: E402

if __name__ == "__main__":
    end_guard(_previous)

EXIT_WORKER_FAILED = 1  # and EXIT_BAD_INPUT (2), as every command line of the project
EXIT_DEVIATION = 3  # --check: the run deviates from single-process training beyond tolerance
# --check's default tolerance per dtype: float64 runs agree to 1e-15..1e-13 on well-conditioned
# models and to about 1e-9 on deep batch-normalized ones at tiny batches (docs/runtime.md,
# "What was tested"); float32 to about 1e-6..1e-5. A wrong kernel deviates by 1e-4 or more.
TOLERANCE = {"float64": 1e-8, "float32": 1e-3}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(
        prog="python -m runtime.run",
        description="Execute a strategy file with torch.distributed and measure its step time. "
        "Bad input ends with one `error: ...` line and exit status 2; a failed worker with "
        "exit status 1.",
    )
    p.add_argument("strategy", type=Path, help="a strategy JSON file (planner plan -o)")
    p.add_argument("--steps", type=positive_int, default=5, help="training steps (default 5)")
    p.add_argument(
        "--warmup",
        type=nonnegative_int,
        help="first steps left out of the median, less than --steps (default 1; 0 for one step)",
    )
    p.add_argument(
        "--world",
        type=positive_int,
        help="number of worker processes (default: the strategy's device count; must match)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="also train single-process and report the largest relative deviation; exit "
        f"status {EXIT_DEVIATION} when it is above the tolerance",
    )
    p.add_argument(
        "--tolerance",
        type=positive_number,
        help="largest relative deviation --check accepts (default by dtype: "
        + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items())
        + ")",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--lr", type=positive_number, default=0.05, help="SGD step (default 0.05)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="model and data seed")
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=120.0,
        help="seconds without progress before the run is declared hung (default 120)",
    )
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    add_logging_options(p)
    return p


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def main(argv: Sequence[str] | None = None) -> int:
    """Run `python -m runtime.run`; returns the exit status."""

    def run() -> int:
        args = build_parser().parse_args(argv)
        if args.warmup is not None and args.warmup >= args.steps:
            raise LayerwiseError(
                f"--warmup {args.warmup} leaves no step to time out of --steps {args.steps}: "
                "give more steps or a smaller --warmup"
            )
        from planner.logs import setup_logging

        setup_logging(args.verbose, args.log_file)
        return _run(args)  # a Ctrl-C stops the workers first (run_strategy), then exits 130

    return report_errors(run, _status)


def _status(exc: LayerwiseError) -> int:
    """A failed worker exits with status 1, any other error with 2 (bad input)."""
    from runtime.launch import WorkerError

    return EXIT_WORKER_FAILED if isinstance(exc, WorkerError) else EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    from planner.graph.models import ModelSpec
    from planner.pipeline.spec import PipelinedStrategy, load_planned
    from runtime.launch import RunOptions, run_strategy, torchrun_main

    try:  # a file with a "pipeline" section runs pipelined (runtime.pipeline)
        strategy, data = load_planned(args.strategy)
    except (TypeError, KeyError, AttributeError) as exc:
        raise LayerwiseError(f"strategy file {args.strategy} is malformed: {exc}") from None
    model = ModelSpec.from_json(data.get("graph", {}).get("model"))
    options = RunOptions(
        steps=args.steps,
        warmup=args.warmup,
        lr=args.lr,
        dtype=args.dtype,
        seed=args.seed,
        timeout=args.timeout,
        backend=args.backend,
        check=args.check,
        zero=_zero_stage(data),
        recompute=_recompute_mode(data),
        cp_order=_cp_order(data),
    )
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world is not None and args.world != world:
            raise LayerwiseError(f"--world {args.world} but torchrun started {world} processes")
        result = torchrun_main(strategy, model, options)
        if result is None:
            return 0
    else:
        result = run_strategy(strategy, model, options, args.world)
    summary = result.summary()
    plain = strategy.strategy if isinstance(strategy, PipelinedStrategy) else strategy
    _report(summary, plain.graph.name, args)
    deviation = summary["max_deviation"]
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    if deviation is not None and not deviation <= tolerance:
        print(
            f"error: the run deviates from single-process training by {deviation:.2e}, above "
            f"the {args.dtype} tolerance {tolerance:g}: the strategy computes something else "
            "than the model (a kernel that differs from the model's code?); --tolerance "
            "raises the bar",
            file=sys.stderr,
        )
        return EXIT_DEVIATION
    return 0


def _zero_stage(data: dict[str, Any]) -> int:
    """The ZeRO stage the plan was made for (its `cost.zero`; 0 when absent)."""
    cost = data.get("cost")
    zero = cost.get("zero", 0) if isinstance(cost, dict) else 0
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise LayerwiseError(f"the strategy file's cost.zero must be 0, 1, 2 or 3, got {zero!r}")
    return int(zero)


def _cp_order(data: dict[str, Any]) -> str:
    """The token order of context parallelism the plan was priced for (its `cost.cp_order`;
    "balanced" when absent: `planner.costs.context`)."""
    cost = data.get("cost")
    order = cost.get("cp_order", "balanced") if isinstance(cost, dict) else "balanced"
    if order not in CP_ORDERS:
        raise LayerwiseError(
            f"the strategy file's cost.cp_order must be one of {', '.join(map(repr, CP_ORDERS))}, "
            f"got {order!r}"
        )
    return str(order)


def _recompute_mode(data: dict[str, Any]) -> str | int:
    """The activation recomputation the plan was made for (its `cost.recompute`; "none" when
    absent)."""
    cost = data.get("cost")
    mode = cost.get("recompute", "none") if isinstance(cost, dict) else "none"
    if (error := recompute_error(mode)) is not None:
        raise LayerwiseError(f"the strategy file's cost.{error}")
    return mode  # type: ignore[no-any-return]


def _report(summary: dict[str, Any], name: str, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(summary))
        return
    timed = len(summary["step_seconds"]) - summary["warmup"]
    print(
        f"{name} on {counted(summary['world'], 'worker')} ({args.backend}, {args.dtype}): "
        f"median step {summary['median_step_seconds'] * 1e3:.2f} ms over "
        f"{counted(timed, 'step')} after {summary['warmup']} warm-up"
    )
    losses = summary["losses"]
    line = f"loss {losses[0]:.6g} -> {losses[-1]:.6g}"
    if summary["max_deviation"] is not None:
        dev = summary["deviation"]
        line += (
            f"; max relative deviation from single-process training {dev['max_deviation']:.2e} "
            f"(loss {dev['loss_deviation']:.1e}, parameters {dev['param_deviation']:.1e})"
        )
    print(line)


def _stop_server() -> None:
    """The forkserver ends with this command, not 1-2 s after it (runtime.launch.stop_server)."""
    launch = sys.modules.get("runtime.launch")  # not imported: no server was started
    if launch is not None:
        launch.stop_server()


if __name__ == "__main__":
    code = main()
    _stop_server()
    exit_now(code)  # without the interpreter's teardown (1-2 s with torch loaded)
