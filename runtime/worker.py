"""What every worker process of a run executes, and the options of a run.

`worker_entry` is the target of a local worker process (started by `runtime.launch`);
`session` is what every rank runs between rendezvous and results, locally or under torchrun:
build the execution plan, the model's parameters and the process groups, then train
`options.steps` steps, timing each one between a barrier and the end of its SGD update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.costs.context import CP_ORDERS, sequence_positions
from planner.costs.recompute import recompute_error
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import CHANNEL, LENGTH
from planner.pipeline.spec import Pipeline
from planner.problems.strategy import Strategy, strategy_from_json
from runtime.executor import DONE, INIT, Executor, Status
from runtime.models import model_from_job
from runtime.pipeline import PipelineExecutor, full_batch_graph
from runtime.plan import ExecPlan, RuntimeConfigError, build_plan
from runtime.reference import (
    DTYPES,
    NonFiniteError,
    check_finite,
    float64_islands,
    init_params,
    make_inputs,
    make_targets,
    model_constants,
    with_scalars,
)

__all__ = ["Job", "RunOptions", "session", "worker_entry"]


@dataclass(frozen=True)
class RunOptions:
    """How to run: steps, warm-up steps left out of the median (default 1, or 0 for one
    step), SGD step, dtype, seed, hang timeout, gloo or nccl, whether to compare with
    single-process training (`check`), the ZeRO stage of the gradient sync (`zero`: 0
    all-reduces; 1-3 reduce-scatter, update 1/r slices, all-gather: runtime.sync), and
    activation recomputation (`recompute`: "none", or "full": the tasks of the ops
    `planner.costs.recompute.recomputed_ops` names run their forward again in the backward,
    runtime.executor)."""

    steps: int = 5
    warmup: int | None = None  # steps left out of the median step time (None: 1, 0 if steps 1)
    lr: float = 0.05
    dtype: str = "float32"
    seed: int = 0
    timeout: float = 120.0  # seconds without progress on any rank before the run is hung
    backend: str = "gloo"
    check: bool = False  # compare loss and parameters with single-process training
    # "eager": sends as soon as a region is computed, receives posted ahead (gloo);
    # "ordered": every edge's messages exchanged in one global order (safe for NCCL);
    # "auto": ordered for nccl, eager otherwise.
    exchange: str = "auto"
    fault: Mapping[str, Any] | None = None  # tests: {"rank", "step", "kind": raise|exit|hang}
    zero: int = 0  # ZeRO stage (the plan file's cost.zero)
    recompute: str | int = "none"  # activation recomputation (the plan file's cost.recompute)
    # context parallelism's token order (the plan file's cost.cp_order: planner.costs.context)
    cp_order: str = "balanced"

    def validate(self) -> None:
        if self.steps < 1:
            raise RuntimeConfigError(f"steps must be >= 1, got {self.steps}")
        if self.warmup is not None and not 0 <= self.warmup < self.steps:
            raise RuntimeConfigError(
                f"warmup must be >= 0 and less than steps ({self.steps}) so that some step is "
                f"timed, got {self.warmup}"
            )
        if self.dtype not in DTYPES:
            raise RuntimeConfigError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not self.lr > 0 or not self.timeout > 0:
            raise RuntimeConfigError("lr and timeout must be positive")
        if self.backend not in ("gloo", "nccl"):
            raise RuntimeConfigError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise RuntimeConfigError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if (error := recompute_error(self.recompute)) is not None:
            raise RuntimeConfigError(error)
        if self.cp_order not in CP_ORDERS:
            raise RuntimeConfigError(
                f"cp_order must be one of {', '.join(map(repr, CP_ORDERS))}, got {self.cp_order!r}"
            )
        if self.exchange not in ("auto", "eager", "ordered"):
            raise RuntimeConfigError(
                f"exchange must be 'auto', 'eager' or 'ordered', got {self.exchange!r}"
            )

    @property
    def warmup_steps(self) -> int:
        """Steps left out of the median: `warmup`, by default 1 (0 when there is one step)."""
        return self.warmup if self.warmup is not None else min(1, self.steps - 1)

    @property
    def ordered(self) -> bool:
        return self.exchange == "ordered" or (self.exchange == "auto" and self.backend == "nccl")


@dataclass(frozen=True)
class Job:
    """What every worker of a run needs: picklable, sent to each process."""

    strategy: dict[str, Any]  # Strategy.to_json()
    model: dict[str, Any] | None
    options: RunOptions
    pipeline: dict[str, Any] | None = None  # Pipeline.to_json(): the strategy is a micro-batch's


def worker_entry(
    rank: int, world: int, job: Job, tmp: str, status_array: Any, launcher: int
) -> None:
    """A local worker: rendezvous in `tmp`, run, write result-<rank>.pt or error-<rank>.txt."""
    if not os.path.isdir(tmp):  # the launcher stopped (Ctrl-C) while this worker was forked:
        os._exit(1)  # its FileStore would retry in the missing folder, holding the GIL
    _exit_with(launcher)
    status = Status(status_array, rank)
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group(
            job.options.backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=2 * job.options.timeout + 10),
        )
        result = session(job, rank, world, status)
        torch.save(result, os.path.join(tmp, f"result-{rank}.pt"))
        status.set(job.options.steps, DONE)
    except BaseException as exc:  # noqa: BLE001 - everything is reported by rank
        text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        with contextlib.suppress(OSError):  # the launcher gone (Ctrl-C), its folder with it
            Path(tmp, f"error-{rank}.txt").write_text(text + "\n" + traceback.format_exc())
        os._exit(1)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _exit_with(launcher: int) -> None:
    """Exit this worker if the launching process goes away (no orphans)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(launcher, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:
                pass

    threading.Thread(target=watch, daemon=True).start()


def session(job: Job, rank: int, world: int, status: Status) -> dict[str, Any]:
    """What every rank runs between rendezvous and results (a float64 run with the model's
    float32 islands in float64, as its reference: `runtime.reference.Float64Islands`)."""
    strategy = strategy_from_json(job.strategy)
    with float64_islands(DTYPES[job.options.dtype], strategy.graph):
        return _session(job, strategy, rank, world, status)


def _session(job: Job, strategy: Strategy, rank: int, world: int, status: Status) -> dict[str, Any]:
    opts = job.options
    status.set(0, INIT)
    model = model_from_job(job.model)
    dtype = DTYPES[opts.dtype]
    pipeline = Pipeline.from_json(job.pipeline) if job.pipeline is not None else None
    # the graph of the whole batch, whose inputs and targets a step draws
    data_graph = (
        strategy.graph
        if pipeline is None
        else full_batch_graph(strategy.graph, pipeline.micro_batches)
    )
    module = model.build(opts.seed, dtype) if model is not None else None  # built once
    # the model's constants: the factors capture could not compute on meta (Gemma's
    # embedding scale) and the rotary tables, from one trace
    scalars, tables = model_constants(data_graph, model, opts.seed, dtype, module)
    strategy = dataclasses.replace(strategy, graph=with_scalars(strategy.graph, scalars))
    plan = build_plan(strategy)
    device = _device(opts.backend)
    groups = _groups(plan, world)
    params, eps = init_params(plan.graph, model, opts.seed, dtype, module)
    del module
    args = (plan, rank, params, opts.lr, dtype, device, groups, opts.timeout * 2, status, eps)
    more = (opts.ordered, tables, opts.zero, opts.recompute)
    ex = Executor(*args, *more) if pipeline is None else PipelineExecutor(pipeline, *args, *more)
    del params, args
    positions = sequence_positions(plan.graph, strategy.configs, opts.cp_order)
    if positions is not None:
        ex.positions = torch.as_tensor(positions)
    needs_inputs = any(o.op.kind == "input" and o.task_of(rank) is not None for o in plan.ops)
    needs_targets = any(plan.ops[i].task_of(rank) is not None for i in plan.sinks)
    losses, seconds = [], []
    for s in range(opts.steps):
        status.set(s, INIT)
        inputs = make_inputs(data_graph, s, opts.seed, dtype) if needs_inputs else []
        targets = make_targets(data_graph, plan.sinks, s, opts.seed) if needs_targets else []
        if positions is not None:  # the data loader lays every sequence out in that order
            inputs, targets = permuted(data_graph, plan.sinks, inputs, targets, ex.positions)
        _inject(opts.fault, rank, s)
        status.waiting(True)
        dist.barrier()
        status.waiting(False)
        t0 = time.perf_counter()
        losses.append(ex.step(inputs, targets))
        if device.type == "cuda":  # pragma: no cover - no GPU here
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
        _check_step(ex, losses[-1], rank, s)
    result: dict[str, Any] = {
        "losses": losses,
        "seconds": seconds,
        "phases": ex.phase_seconds,
        "recomputed": ex.recomputed_tasks,
        "expert_tokens": ex.expert_tokens,
    }
    if opts.check:
        result["shards"] = ex.shard_state()
    return result


def permuted(
    graph: OpGraph,
    sinks: Sequence[int],
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    positions: torch.Tensor | None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The inputs (one per input op, or none) and the targets (one per sink, or none) with
    their sequences laid out in `positions`' order: place j holds token positions[j]."""
    if positions is None:
        return inputs, targets
    ins = [op for op in graph.ops if op.kind == "input"]

    def take(x: torch.Tensor, dims: Sequence[str]) -> torch.Tensor:
        return x.index_select(list(dims).index(LENGTH), positions) if LENGTH in dims else x

    if inputs:
        inputs = [take(x, op.output.dims) for x, op in zip(inputs, ins, strict=True)]
    if targets:
        dims = [[d for d in graph.ops[i].output.dims if d != CHANNEL] for i in sinks]
        targets = [take(t, d) for t, d in zip(targets, dims, strict=True)]
    return inputs, targets


def _check_step(ex: Executor, loss: float, rank: int, step: int) -> None:
    """Stop at a non-finite loss part or parameter (after the timed part of the step)."""
    check_finite(loss, step, f"on rank {rank}")
    name = ex.sync.first_non_finite()
    if name is not None:
        raise NonFiniteError(
            f"step {step}: parameter {name!r} became non-finite on rank {rank} (a NaN or "
            "infinite gradient); try a smaller --lr or --dtype float64"
        )


def _device(backend: str) -> torch.device:
    if backend == "nccl":  # pragma: no cover - no GPU here
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _groups(plan: ExecPlan, world: int) -> dict[tuple[str, tuple[int, ...]], Any]:
    """A process group per (use, rank set) of the plan, created in the same order on every
    rank; point-to-point transfers use the default group."""
    groups: dict[tuple[str, tuple[int, ...]], Any] = {}
    for use in ("sync", "norm", "expert"):
        for ranks in plan.groups[use]:
            groups[(use, ranks)] = dist.new_group(list(ranks))
    return groups


def _inject(fault: Mapping[str, Any] | None, rank: int, step: int) -> None:
    """Test hook: fail on purpose at the start of a step."""
    if not fault or fault.get("rank") != rank or fault.get("step", 0) != step:
        return
    kind = fault.get("kind")
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:
            time.sleep(0.1)
