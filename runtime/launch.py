"""Start the workers of a run, watch them, collect their results, and compare with the reference.

Locally, `run_strategy` starts one process per rank (a forkserver with torch preloaded, so a
run starts in a fraction of a second after the first), rendezvous through a FileStore in a
temporary directory, and watches the workers: a worker that raises is reported by rank with
its exception, one that dies by rank with its exit code or signal, and when no rank makes
progress for `timeout` seconds the run is declared hung and each rank's position (step,
phase, op, computing or waiting for a peer) is reported. In every case all workers are
terminated and joined before `WorkerError` is raised: no process is left behind. A worker
also exits when the launching process disappears.

Across machines, `torchrun ... -m runtime.run STRATEGY.json` runs `torchrun_main` in every
process (env:// rendezvous); rank 0 prints the result.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import GraphError, LayerwiseError
from planner.graph.opgraph import OpGraph
from planner.pipeline.spec import Pipeline, PipelinedStrategy, micro_batch_graph
from planner.pipeline.timeline import counted
from planner.problems.strategy import Strategy
from runtime.executor import PHASES, Status
from runtime.models import as_model, model_key, model_to_job
from runtime.pipeline import check_pipelined, full_batch_graph
from runtime.plan import ExecPlan, RuntimeConfigError, ShardKey, build_plan
from runtime.reference import (
    DTYPES,
    Model,
    ReferenceResult,
    deviation,
    make_inputs,
    reference_train,
)
from runtime.worker import Job, RunOptions, session, worker_entry

log = logging.getLogger(__name__)

__all__ = [
    "RunOptions",
    "RunResult",
    "WorkerError",
    "assemble_params",
    "prepare",
    "run_strategy",
    "torchrun_main",
    "worker_context",
]


class WorkerError(LayerwiseError):
    """A worker raised, died or hung; `failures` maps rank -> what happened."""

    def __init__(self, message: str, failures: Mapping[int, str], pids: Sequence[int] = ()):
        super().__init__(message)
        self.failures = dict(failures)
        self.pids = tuple(pids)  # the worker processes (all ended and joined)


@dataclass
class RunResult:
    """What a run measured: per-step times and losses, bytes moved, per-rank phase times,
    and with `check` the deviation from single-process training and the final parameters."""

    world: int
    step_seconds: list[float]  # per step, the slowest rank's time
    losses: list[float]  # the total loss of each step (before its update)
    warmup: int
    transfer_bytes: int  # bytes sent between ranks per forward pass (of all m micro-batches)
    # per rank, median over the timed steps of (forward, backward, sync + update, waiting)
    phase_seconds: list[tuple[float, ...]] = field(default_factory=list)
    # per step, the task forwards all ranks ran again in the backward (recompute="full")
    recomputed_tasks: list[int] = field(default_factory=list)
    # per step, per moe op under expert parallelism: rank -> (token copies it sent to each
    # expert, copies each of its own experts computed), from the op's first forward
    expert_tokens: list[dict[str, dict[int, tuple[list[int], list[int]]]]] = field(
        default_factory=list
    )
    deviation: dict[str, Any] | None = None
    params: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def median_step_seconds(self) -> float:
        """The median step time after the warm-up steps."""
        timed = self.step_seconds[self.warmup :] or self.step_seconds
        return statistics.median(timed)

    @property
    def max_deviation(self) -> float | None:
        """The largest relative deviation from single-process training (None without check)."""
        return None if self.deviation is None else float(self.deviation["max_deviation"])

    def summary(self) -> dict[str, Any]:
        """The result as JSON values (what `runtime.run --json` prints)."""
        return {
            "median_step_seconds": self.median_step_seconds,
            "max_deviation": self.max_deviation,
            "step_seconds": self.step_seconds,
            "losses": self.losses,
            "world": self.world,
            "warmup": self.warmup,
            "transfer_bytes": self.transfer_bytes,
            "phase_seconds": {
                "forward": [p[0] for p in self.phase_seconds],
                "backward": [p[1] for p in self.phase_seconds],
                "sync_update": [p[2] for p in self.phase_seconds],
                "waiting": [p[3] for p in self.phase_seconds],
            },
            "recomputed_tasks": self.recomputed_tasks,
            "expert_tokens": [
                {op: {str(r): v for r, v in ranks.items()} for op, ranks in step.items()}
                for step in self.expert_tokens
            ],
            "deviation": self.deviation,
        }


# -- before any process starts -------------------------------------------------------------------


def prepare(
    strategy: Strategy,
    model: Model | None,
    options: RunOptions,
    world: int | None = None,
    pipeline: Pipeline | None = None,
) -> tuple[int, ExecPlan]:
    """Every check that can fail before spawning: options, world size, model, the plan
    (with a pipeline: `strategy` is one micro-batch's, and what a pipelined run refuses)."""
    options.validate()
    n = strategy.devices.num_devices
    world = n if world is None else world
    if world != n:
        raise RuntimeConfigError(
            f"the strategy is for {counted(n, 'device')} ({strategy.devices.name}) but the "
            f"world size is {world}: run it with {counted(n, 'worker')}, or plan for "
            f"cpu-local-{world}"
        )
    if options.check and model is None:
        raise RuntimeConfigError(
            "--check needs the model the strategy was planned for; this strategy file records "
            "none (plan a zoo model or a 'module:factory' model with `planner.plan` or "
            '`python -m planner plan`, which write "model"; or pass the nn.Module to '
            "runtime.run_strategy)"
        )
    if model is not None:
        graph = _model_graph(model)
        ours, of = graph, model.describe()
        if pipeline is not None:
            ours = micro_batch_graph(graph, pipeline.micro_batches)
            m = counted(pipeline.micro_batches, "micro-batch", "micro-batches")
            of = f"one of {m} of {of}"
        if ours.fingerprint() != strategy.graph.fingerprint():
            raise RuntimeConfigError(
                f"the strategy's graph (fingerprint {strategy.graph.fingerprint()}) is not the "
                f"graph of {of} (fingerprint {ours.fingerprint()})"
            )
        if options.check or any(op.kind == "attention" for op in strategy.graph.ops):
            _check_kinds(model, graph, options.seed)
    if options.backend == "nccl" and torch.cuda.device_count() < 1:
        raise RuntimeConfigError("backend nccl needs CUDA devices; this machine has none")
    if pipeline is not None:
        check_pipelined(strategy.graph, pipeline, options.ordered)
    return world, build_plan(strategy)


_CHECKED: set[str] = set()


def _check_kinds(model: Model, graph: OpGraph, seed: int) -> None:
    """The model built for real (on the CPU, in its own dtype) and captured again: capture
    compares every op whose kind a module declares (in float64, module by module), and
    every attention read from tensor code, with the kernels the workers will compute them
    with (`planner.costs.declared.check_declared`, `planner.graph.attention`); on the meta
    device it could not. Done for `--check` runs and for models with attention, once per
    model and process (it costs one build of the model)."""
    key = model_key(model)
    if key in _CHECKED:
        return
    from planner.costs.declared import check_declared
    from planner.graph.capture import capture

    module = model.build(seed, torch.float32)
    inputs = tuple(make_inputs(graph, 0, seed, torch.float32))
    try:
        capture(module, inputs, graph.name, check=check_declared)
    except GraphError as exc:
        raise RuntimeConfigError(f"{model.describe()}: {exc}") from None
    _CHECKED.add(key)


_GRAPHS: dict[str, OpGraph] = {}
_REFERENCES: dict[tuple[Any, ...], ReferenceResult] = {}


def _model_graph(model: Model) -> OpGraph:
    """The model's graph (captured once per process)."""
    key = model_key(model)
    if key not in _GRAPHS:
        _GRAPHS[key] = model.graph()
    return _GRAPHS[key]


def _reference(model: Model, graph: OpGraph, options: RunOptions) -> ReferenceResult:
    """Single-process training of the whole batch of `graph` (computed once per process for
    the same model and options)."""
    key = (model_key(model), options.steps, options.lr, options.seed, options.dtype)
    if key not in _REFERENCES:
        dtype = DTYPES[options.dtype]
        log.info("single-process reference: %s, %d steps", model.describe(), options.steps)
        ref = reference_train(model, graph, options.steps, options.lr, options.seed, dtype)
        _REFERENCES.clear()  # keep one: references of big models are big
        _REFERENCES[key] = ref
    return _REFERENCES[key]


def run_strategy(
    strategy: Strategy | PipelinedStrategy,
    model: Model | Any = None,
    options: RunOptions | None = None,
    world: int | None = None,
) -> RunResult:
    """Train `options.steps` steps of `strategy` on local worker processes.

    strategy: a `Strategy`, or a `PipelinedStrategy` (one micro-batch's strategy and its
    pipeline: each step runs m micro-batches in the schedule's order, runtime.pipeline).
    model: the model the strategy was planned for: a `ModelSpec` (zoo or factory; a plan
    file's `"model"`), the `nn.Module` itself (its current parameters are the initial ones),
    or None (seeded random parameters; no `check`)."""
    options = options or RunOptions()
    world, plan, model, job = _prepare_job(strategy, model, options, world)
    log.info(
        "%s on %d local workers (%s, %s): %d steps, %d transfers per forward pass",
        plan.graph.name,
        world,
        options.backend,
        options.dtype,
        options.steps,
        sum(not t.local for t in plan.transfers),
    )
    with tempfile.TemporaryDirectory(prefix="layerwise-run-") as tmp:
        _launch_local(job, world, Path(tmp))
        results = [
            torch.load(Path(tmp) / f"result-{r}.pt", weights_only=False) for r in range(world)
        ]
    return _finish(plan, model, options, results, _micro_batches(job))


def _prepare_job(
    strategy: Strategy | PipelinedStrategy,
    model: Model | Any,
    options: RunOptions,
    world: int | None,
) -> tuple[int, ExecPlan, Model | None, Job]:
    """`prepare`, and the job every worker receives."""
    if isinstance(strategy, PipelinedStrategy):
        plain, pipeline = strategy.strategy, strategy.pipeline
    else:
        plain, pipeline = strategy, None
    m = 1 if pipeline is None else pipeline.micro_batches
    model = as_model(model, plain.graph, m)
    world, plan = prepare(plain, model, options, world, pipeline)
    piped = None if pipeline is None else pipeline.to_json()
    return world, plan, model, Job(plain.to_json(), model_to_job(model), options, piped)


def _micro_batches(job: Job) -> int:
    return 1 if job.pipeline is None else int(job.pipeline["micro_batches"])


def _finish(
    plan: ExecPlan,
    model: Model | None,
    options: RunOptions,
    results: Sequence[dict[str, Any]],
    micro_batches: int = 1,
) -> RunResult:
    steps = options.steps
    losses = [sum(r["losses"][s] for r in results) for s in range(steps)]
    step_seconds = [max(r["seconds"][s] for r in results) for s in range(steps)]
    skip = options.warmup_steps
    phases = [
        tuple(statistics.median(p[k] for p in r["phases"][skip:]) for k in range(4))
        for r in results
    ]
    out = RunResult(
        world=len(results),
        step_seconds=step_seconds,
        losses=losses,
        warmup=skip,
        transfer_bytes=micro_batches
        * plan.transfer_bytes(torch.finfo(DTYPES[options.dtype]).bits // 8),
        phase_seconds=phases,
        recomputed_tasks=[sum(r["recomputed"][s] for r in results) for s in range(steps)],
        expert_tokens=[_expert_tokens(results, s) for s in range(steps)],
    )
    if options.check:
        assert model is not None
        params, replica_dev = assemble_params(plan, [r["shards"] for r in results])
        ref = _reference(model, full_batch_graph(plan.graph, micro_batches), options)
        out.params = params
        out.deviation = {**deviation(losses, params, ref), "replica_deviation": replica_dev}
    return out


def _expert_tokens(
    results: Sequence[dict[str, Any]], step: int
) -> dict[str, dict[int, tuple[list[int], list[int]]]]:
    """Step `step`'s expert token counts of every rank, by op (RunResult.expert_tokens)."""
    out: dict[str, dict[int, tuple[list[int], list[int]]]] = {}
    for rank, r in enumerate(results):
        for op, counts in r.get("expert_tokens", {}).get(step, {}).items():
            out.setdefault(op, {})[rank] = counts
    return out


def assemble_params(
    plan: ExecPlan, shards: Sequence[Mapping[ShardKey, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], float]:
    """Full parameters from every rank's shards, and the largest difference between two
    replicas of the same element (0 when the replicas were kept in sync)."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    worst = 0.0
    for rank_shards in shards:
        for key, value in rank_shards.items():
            info = plan.params[key.name]
            if key.name not in full:
                full[key.name] = torch.zeros(info.shape, dtype=value.dtype)
                seen[key.name] = torch.zeros(info.shape, dtype=torch.bool)
            dst, mask = full[key.name], seen[key.name]
            for d, m, v in _block_views(dst, mask, value, info.axis, info.blocks, info.extent, key):
                if m.any():
                    worst = max(worst, float((d[m] - v[m]).abs().max()))
                d.copy_(v)
                m.fill_(True)
    missing = [n for n, m in seen.items() if not bool(m.all())]
    if missing or set(full) != set(plan.params):
        raise LayerwiseError(
            f"no rank holds (all of) parameters {missing or set(plan.params) - set(full)}"
        )
    return full, worst


def _block_views(
    full: torch.Tensor,
    mask: torch.Tensor,
    shard: torch.Tensor,
    axis: int | None,
    blocks: int,
    extent: int,
    key: ShardKey,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    if axis is None:
        return [(full, mask, shard)]
    width = key.hi - key.lo
    return [
        (
            full.narrow(axis, b * extent + key.lo, width),
            mask.narrow(axis, b * extent + key.lo, width),
            shard.narrow(axis, b * width, width),
        )
        for b in range(blocks)
    ]


# -- local processes -----------------------------------------------------------------------------

_CONTEXT: Any = None


def worker_context() -> Any:
    """The multiprocessing context of worker processes: a forkserver that has imported torch
    and the runtime once (spawn where unavailable). Shared by everything that starts
    workers in this process, so they all fork from one warm server."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx: Any
        try:
            ctx = mp.get_context("forkserver")
            # symbolic_shapes: the first backward of a matmul imports it (0.5 s, sympy).
            ctx.set_forkserver_preload(
                [
                    "torch",
                    "torch.distributed",
                    "torch.fx.experimental.symbolic_shapes",
                    "runtime.launch",
                    "runtime.worker",
                ]
            )
        except ValueError:
            ctx = mp.get_context("spawn")
        _CONTEXT = ctx
    _start_server(_CONTEXT)
    return _CONTEXT


def _start_server(ctx: Any) -> None:
    """Start the forkserver (if it is not running) with SIGINT ignored, a disposition it and
    every worker it forks inherit: Ctrl-C then reaches the launcher alone, which stops the
    workers and says so in one line. Otherwise the server, importing torch for seconds,
    dies of the KeyboardInterrupt with a long traceback and the workers print theirs."""
    if ctx.get_start_method() != "forkserver" or threading.current_thread() is not (
        threading.main_thread()
    ):
        return  # signal handlers can only be changed in the main thread
    from multiprocessing import forkserver, resource_tracker

    # While the server starts, SIGINT is ignored (what it inherits) and blocked here: a Ctrl-C
    # in this window stays pending (Linux keeps a blocked signal even when ignored) and reaches
    # the launcher once its handler is back; ignored alone, it was lost and the run went on to
    # its end with status 0. The resource tracker starts first: starting, it unblocks SIGINT.
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def stop_server() -> None:
    """End the forkserver now (SIGTERM), for a command line that is done with it. Left to
    itself it ends once it sees the launcher gone, through the interpreter's teardown with
    torch loaded: 1-2 s after the command's last line, holding its output streams (a pipe
    reading them waits). A later run starts a new one (multiprocessing checks it is alive)."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def _launch_local(job: Job, world: int, tmp: Path) -> None:
    ctx = worker_context()
    status = ctx.Array("d", world * Status.SLOTS, lock=False)
    procs = [
        ctx.Process(
            target=worker_entry,
            args=(r, world, job, str(tmp), status, os.getpid()),
            name=f"layerwise-rank{r}",
            daemon=True,
        )
        for r in range(world)
    ]
    started: list[Any] = []
    try:  # Ctrl-C while starting (the first start waits for the server to import torch)
        for p in procs:  # stops the workers started so far
            p.start()
            started.append(p)
        _watch(procs, status, tmp, job)
    except WorkerError as exc:
        _stop(procs)
        exc.pids = tuple(p.pid for p in procs)
        raise
    finally:
        _stop(started)


def _watch(procs: list[Any], status: Any, tmp: Path, job: Job) -> None:
    timeout = job.options.timeout
    last_beat, last_change = -1.0, time.monotonic()
    while True:
        codes = [p.exitcode for p in procs]
        if any(c not in (None, 0) for c in codes):
            _fail(procs, tmp, job)
        if all(c == 0 for c in codes):
            return
        beat = sum(status[r * Status.SLOTS + 4] for r in range(len(procs)))
        now = time.monotonic()
        if beat != last_beat:
            last_beat, last_change = beat, now
        elif now - last_change > timeout:
            _hung(procs, status, job)
        time.sleep(0.01)


def _fail(procs: list[Any], tmp: Path, job: Job) -> None:
    """A worker ended with an error: wait briefly for the others' reports, then stop all."""
    first = {r for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and any(p.exitcode is None for p in procs):
        time.sleep(0.02)
    _stop(procs)
    failures = {
        r: _failure(r, p.exitcode, tmp) for r, p in enumerate(procs) if p.exitcode not in (0,)
    }
    order = sorted(failures, key=lambda r: (r not in first, r))
    lines = [f"rank {r}: {failures[r]}" for r in order]
    raise WorkerError("worker failed: " + "; then ".join(lines), failures)


def _failure(rank: int, code: int | None, tmp: Path) -> str:
    path = tmp / f"error-{rank}.txt"
    if path.exists():
        text = path.read_text()
        first = text.splitlines()[0] if text else "raised"
        return first.split(" This is typically caused")[0]  # gloo's long advice
    if code is None:
        return "stopped (still running when the run failed)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"died (killed by {signal.Signals(-code).name})"
        return f"died (signal {-code})"
    return f"exited with code {code} without an error message"


def _hung(procs: list[Any], status: Any, job: Job) -> None:
    graph_ops = job.strategy["graph"]["json"]["ops"]
    failures = {}
    for r, p in enumerate(procs):
        if p.exitcode is not None:
            continue
        step, phase, op, waiting = (int(status[r * Status.SLOTS + k]) for k in range(4))
        where = PHASES.get(phase, "?")
        name = f" of op {graph_ops[op]['name']!r}" if 0 <= op < len(graph_ops) else ""
        doing = "waiting for a peer" if waiting else "computing"
        failures[r] = f"{doing} in {where}{name} at step {step}"
    _stop(procs)
    culprits = [r for r, f in failures.items() if f.startswith("computing")] or list(failures)
    lines = [f"rank {r}: {failures[r]}" for r in sorted(failures, key=lambda r: r not in culprits)]
    raise WorkerError(
        f"no progress for {job.options.timeout:g} s (hung): " + "; ".join(lines), failures
    )


def _stop(procs: list[Any]) -> None:
    """Terminate and join every worker still alive (SIGTERM, then SIGKILL)."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()


# -- torchrun --------------------------------------------------------------------------------------


def torchrun_main(
    strategy: Strategy | PipelinedStrategy, model: Model | Any, options: RunOptions
) -> RunResult | None:
    """One process of a torchrun launch; returns the result on rank 0, None elsewhere."""
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    _, plan, model, job = _prepare_job(strategy, model, options, world)
    torch.set_num_threads(int(os.environ.get("LAYERWISE_THREADS", "1")))
    dist.init_process_group(options.backend, timeout=timedelta(seconds=2 * options.timeout + 10))
    try:
        result = session(job, rank, world, Status(None, rank))
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    assert gathered is not None
    return _finish(plan, model, options, gathered, _micro_batches(job))
