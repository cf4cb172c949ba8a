"""`plan`: check the command line, make one plan request and plan it (what `planner.plan`
does with its arguments), print the plan and say why it chose what it chose (ZeRO stage,
recomputation, a memory fallback); write the plan file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from planner.cli.args import EXIT_NO_SOLUTION, UsageError
from planner.cli.inputs import check_outputs, malformed, model_spec
from planner.cli.output import print_ops, print_summary
from planner.files import strict_json

__all__ = ["cmd_plan"]


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan (`planner.api.plan_request`) within --time-limit counted from the command's
    start; print the plan, say what was chosen on the way, write -o. Exit status 1 when no
    solution."""
    from planner.api import plan_request
    from planner.deadline import Deadline

    deadline = Deadline.after(args.time_limit)  # the limit counts from the command's start
    _check_plan_input(args)
    request = _request(args, deadline)  # every option checked, once
    if not (args.problem or args.graph):  # the one step no clock can stop, bounded
        from planner.sources import load_torch

        load_torch(request.hard)  # as capture is: past the limit, up to its overrun
    result = plan_request(request)
    summary = result.summary()
    _print_plan(result, summary, args)
    _print_choices(summary)
    return _finish_plan(result, summary, args)


def _check_plan_input(args: argparse.Namespace) -> None:
    """What can be refused before torch is imported and before any option is read."""
    from planner.request import check_backend

    _check_plan_args(args)
    check_outputs((args.output, "plan"))
    check_backend(args.backend, args.objective)  # refused before torch is imported
    if args.model is not None and args.model.endswith((".json", ".json.gz", ".gz")):
        from planner.files import check_input_file  # a FIFO or directory: refused before torch

        check_input_file(args.model, "model")


def _request(args: argparse.Namespace, deadline: Any) -> Any:
    """The command line's options as one `planner.request.PlanRequest`, checked once."""
    from planner.request import PlanRequest

    source, model_options = _plan_source(args)
    dnn = not args.problem
    return PlanRequest.make(
        source,
        args.devices if dnn else None,
        backend=args.backend,
        objective=args.objective,
        time_limit=args.time_limit,
        seed=args.seed,
        gap_tolerance=args.gap_tolerance,
        max_configs=args.max_configs,
        memory_limit=args.memory_limit,
        cost=args.cost or "analytic",
        sync=args.sync,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        zero=args.zero,
        headroom=args.headroom,
        reserve=args.reserve,
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


def _print_plan(result: Any, summary: dict[str, Any], args: argparse.Namespace) -> None:
    """The plan on stdout: one JSON object with --json, else its ops (a pipeline's layout
    first) and the status line."""
    from planner.plans import PipelinePlan

    if args.json:
        print(strict_json(summary))
    elif isinstance(result, PipelinePlan):
        print_ops(result.describe(), args.verbose > 0)
        pipe = summary["layout"]
        estimated = not result.stats.get("answer_simulated", True)
        print(
            f"pipeline: {pipe['layout']}; bubble {pipe['bubble']:.1%}, peak "
            f"{summary['memory_peak_bytes'] / 2**30:.1f} GiB per device"
            + ("; step estimated, not simulated (the time limit came first)" if estimated else "")
        )
        print_summary(summary, seconds=True)
    elif result.has_solution:
        print_ops(result.describe(), args.verbose > 0)
        print_summary(summary, seconds=result.problem.is_dnn, problem=result.problem)
    if not args.json and summary.get("memory_peak_parts"):
        from planner.problems.sizes import describe_peak

        print(f"memory: {describe_peak(summary['memory_peak_parts'])}")


def _print_choices(summary: dict[str, Any]) -> None:
    """What "auto" chose on the way, on stderr: the ZeRO stage, a memory fallback, the
    recomputation, each with why."""
    if "zero" in summary:  # --zero auto: which stage and why
        print(_chosen(summary["zero"], "zero", "ZeRO stage", "stage "), file=sys.stderr)
    if "memory_fallback" in summary:  # ZeRO and recomputation (or pipelines) unset, needed
        how = "pipelines" if "layout" in summary else "--zero auto --recompute auto"
        print(f"planned with {how}: {summary['memory_fallback']}", file=sys.stderr)
    if "recompute" in summary:  # --recompute auto: which and why
        print(_chosen(summary["recompute"], "recompute", "recompute"), file=sys.stderr)


def _chosen(choice: dict[str, Any], key: str, what: str, each: str = "") -> str:
    """'ZeRO stage 2 (stage 0: why; stage 1: why)': the choice, then each one tried first."""
    tried = "; ".join(f"{each}{t[key]}: {t['why']}" for t in choice["tried"])
    return f"{what} {choice['chose']}" + (f" ({tried})" if tried else "")


def _finish_plan(result: Any, summary: dict[str, Any], args: argparse.Namespace) -> int:
    """No solution: one error line and exit status 1; else the plan file written (-o)."""
    from planner.plans import PlanResult

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
                ("--precision", args.problem and args.precision),
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
                ("--reserve", args.reserve),
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
        graph = malformed("graph file", path, lambda: OpGraph.load(path))
        return graph, {"precision": args.precision}
    spec = model_spec(args)
    kwargs = dict(spec.kwargs)
    if spec.factory is not None:
        return spec.factory, {
            "model_kwargs": kwargs,
            "example_inputs": spec.inputs,
            "name": spec.name,
            "coarsen": spec.coarsen,
            "precision": spec.precision,
        }
    if spec.batch is not None:
        kwargs["batch"] = spec.batch
    return spec.name, {"model_kwargs": kwargs, "coarsen": spec.coarsen, "precision": spec.precision}
