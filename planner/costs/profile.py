"""Measured compute costs: profile each task shape on this machine, cache it, look it up.

`profile_graph` times forward + backward of one task of every (op, config) of a graph, on
random data built by `planner.costs.kernels` (the task's input boxes, halos included, and its
parameter shards), with one torch thread as the runtime's CPU workers use: 2 warm-up runs,
then `repeats` timed runs, the median. Configs that give the same task shape share one
measurement, and so do identical layers: the cache key (`task_key`) is the op kind, the
attrs that change the computation and the shapes the task computes on, never the op name.

The cache is one JSON file per device kind, `$LAYERWISE_CACHE_DIR/measured-<device key>.json`
(default directory `~/.cache/layerwise/`), merged on every run so that several models
accumulate. `MeasuredTimes.load(devices)` reads it for `CostModel(measured=...)`, which falls
back to the analytic t_c for shapes that were not profiled.

Profiling refuses a busy machine, before and while it measures (`planner.hardware.load`);
each entry records the run that measured it, and each run its load and time. Loading says
where the times come from, how old they are and at what load they were taken (a warning for
entries measured on a busy machine or, in a version-1 cache, at no recorded load); profiling
measures such untrusted entries again.

Only this machine's CPU workers can be measured here (device key "cpu-1thread"). The CUDA
path (timing with torch.cuda.Event, device key from the preset's GPU) is written but untested.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.costs.config import ConfigSpace, ParallelConfig
from planner.costs.kernels import TaskPlan, conv_input_channels, plan_fn, plan_op, plan_task
from planner.errors import GraphError, LayerwiseError
from planner.files import write_text_atomic
from planner.hardware.load import Load, LoadWatch, MachineBusyError, note_cached, trusted

if TYPE_CHECKING:
    import torch

    from planner.graph.opgraph import Op, OpGraph
    from planner.hardware.devices import DeviceGraph

__all__ = [
    "CACHE_FORMAT",
    "CACHE_VERSION",
    "PROFILE_THREADS",
    "MeasuredTimes",
    "cache_path",
    "device_key",
    "profile_graph",
    "task_key",
]

CACHE_FORMAT = "layerwise.measured"
CACHE_VERSION = 2  # 2: an entry is [seconds, index of its run in "profiled"]; 1: seconds
PROFILE_THREADS = 1  # the runtime's CPU workers run one torch thread each
WARMUP = 2
KEY_DTYPE = "float32"

Progress = Callable[[int, int, str], None]


# -- keys ----------------------------------------------------------------------------------------


def task_key(graph: OpGraph, index: int, cfg: ParallelConfig) -> str:
    """The cache key of the task shape of op `index` under `cfg` (see `plan_key`)."""
    return plan_key(plan_task(graph, index, cfg))


def op_task_key(op: Op, cfg: ParallelConfig) -> str:
    """`task_key` from the op alone (input sizes inferred by `kernels.infer_input_shapes`)."""
    return plan_key(plan_op(op, cfg))


def plan_key(plan: TaskPlan) -> str:
    """Kind, the attrs that change the computation, the task's compute shapes (inputs after
    border padding, selection and flattening; output box; parameter shards), the folded
    functions, whether batch-norm statistics are shared across tasks, which inputs get no
    gradient (the graph's data) and the dtype, as canonical JSON. The op's name and the task's position are
    not part of it: identical layers and configs with the same task shape share a key."""
    op = plan.op
    attrs: dict[str, Any] = {}
    if op.kind == "conv2d":
        attrs = {
            "stride": op.attr("stride", (1, 1)),
            "dilation": op.attr("dilation", (1, 1)),
            "groups": _conv_groups(plan),
        }
    elif op.kind == "pool2d":
        attrs = {
            "kernel": op.attr("kernel", (1, 1)),
            "stride": op.attr("stride", (1, 1)),
            "dilation": op.attr("dilation", (1, 1)),
            "mode": op.attr("mode", "max"),
        }
    elif op.kind == "attention":
        c_lo, c_hi = plan.out_range("channel")
        heads = int(op.attr("heads", 1)) * (c_hi - c_lo) // op.output.size("channel")
        attrs = {"heads": heads, "causal": bool(op.attr("causal", False))}
        attrs |= {k: op.attr(k) for k in ("mla", "qk_norm") if op.attr(k)}  # more work
    elif op.kind in ("elementwise", "softmax"):
        attrs = {"op": op.attr("op", op.attr("fn"))}
    elif op.kind == "norm":
        attrs = {"norm": op.attr("norm", "batch")}
    elif op.kind == "concat":
        attrs = {"axis": op.output.dims.index(op.attr("dim"))}
    record = {
        "kind": op.kind,
        "attrs": _jsonable(attrs),
        "in": [list(s) for s in plan.compute_shapes()],
        "out": list(plan.out_shape),
        "params": [list(s) for s in plan.param_shapes],
        "fused": list(plan.fused),
        "dtype": KEY_DTYPE,
    }
    if plan.stats_count:  # batch norm with statistics shared across tasks: its own kernel
        record["shared_stats"] = True
    if plan.data_inputs:  # inputs without a gradient: a cheaper backward
        record["data_inputs"] = list(plan.data_inputs)
    return json.dumps(record, sort_keys=True, separators=(",", ":"))


def _conv_groups(plan: TaskPlan) -> int:
    return conv_input_channels(plan)[2]


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


# -- devices and the cache file ----------------------------------------------------------------


def device_key(devices: DeviceGraph) -> str:
    """The kind of device whose measurements apply: "cpu-1thread" for this machine's CPU
    workers; "gpu-<TFLOP/s>tflops" for a GPU preset. Mixed device kinds are refused."""
    kinds = {d.kind for d in devices.devices}
    if kinds == {"cpu"}:
        return f"cpu-{PROFILE_THREADS}thread"
    flops = {d.flops for d in devices.devices}
    if kinds == {"gpu"} and len(flops) == 1:
        return f"gpu-{flops.pop() / 1e12:g}tflops"
    raise LayerwiseError(
        f"device graph {devices.name!r} mixes device kinds or models; measured costs need "
        "one kind of device"
    )


def cache_dir() -> Path:
    """$LAYERWISE_CACHE_DIR, default ~/.cache/layerwise."""
    root = os.environ.get("LAYERWISE_CACHE_DIR") or Path.home() / ".cache" / "layerwise"
    return Path(root)


def cache_path(key: str) -> Path:
    """The measured-cost cache of device key `key`."""
    return cache_dir() / f"measured-{key}.json"


def machine_info() -> dict[str, Any]:
    """What the measurements depend on: platform, processor, torch version, threads."""
    import torch

    return {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "torch": torch.__version__,
        "threads": PROFILE_THREADS,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache at `path` in version 2's form (a version-1 entry gets run None)."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LayerwiseError(f"measured-cost cache {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        raise LayerwiseError(f'{path} is not a measured-cost cache ("format": "{CACHE_FORMAT}")')
    version = data.get("version")
    if version not in (1, CACHE_VERSION):
        raise LayerwiseError(
            f"measured-cost cache {path} has version {version!r}; this layerwise reads versions "
            f"1 and {CACHE_VERSION}: delete it and profile again"
        )
    entries = data.get("entries")
    runs = data.get("profiled", [])
    if version == 1 and isinstance(entries, dict):
        entries = {k: [v, None] for k, v in entries.items()}
    if not (
        isinstance(entries, dict)
        and isinstance(runs, list)
        and all(_is_entry(v, len(runs)) for v in entries.values())
    ):
        raise LayerwiseError(
            f"measured-cost cache {path}: entries must map keys to [seconds > 0, run index]"
        )
    return data | {"version": CACHE_VERSION, "entries": entries, "profiled": runs}


def _is_entry(value: Any, runs: int) -> bool:
    if not (isinstance(value, list) and len(value) == 2):
        return False
    seconds, run = value
    good_run = run is None or (isinstance(run, int) and 0 <= run < runs)
    return isinstance(seconds, int | float) and seconds > 0 and good_run


def _taken(data: dict[str, Any]) -> dict[str, tuple[str | None, Load | None]]:
    """Entry key -> (time, load) of the run that measured it; (None, None) if unknown."""
    runs = [(r.get("at"), Load.from_json(r.get("load"))) for r in data["profiled"]]
    return {
        k: (None, None) if run is None else runs[run] for k, (_, run) in data["entries"].items()
    }


def _trusted(data: dict[str, Any]) -> set[str]:
    """Keys measured at a known load within the busy threshold."""
    return {k for k, (_, load) in _taken(data).items() if trusted(load)}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


# -- lookups ---------------------------------------------------------------------------------------


class MeasuredTimes:
    """Measured forward + backward seconds per task shape, for `CostModel(measured=...)`.

    `task_time(op, cfg)` keys the task shape of (op, cfg). With `graph` (see `bind`), ops of
    that graph are keyed from the graph's real input tensors; other ops from the op alone
    (`kernels.infer_input_shapes`), which gives the same key for the zoo's ops."""

    def __init__(
        self,
        entries: Mapping[str, float],
        device_key: str,
        graph: OpGraph | None = None,
        path: Path | None = None,
    ):
        self.entries = dict(entries)
        self.device_key = device_key
        self.graph = graph
        self.path = path
        self.note = ""  # where the times come from, when and at what load (set by `load`)
        self._keys: dict[tuple[Op, tuple[int, ...]], str | None] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def bind(self, graph: OpGraph) -> MeasuredTimes:
        """The same measurements, keying the ops of `graph` from its real input tensors."""
        bound = MeasuredTimes(self.entries, self.device_key, graph, self.path)
        bound.note = self.note
        return bound

    def key(self, op: Op, cfg: ParallelConfig) -> str | None:
        """The cache key of (op, cfg), or None when the op's task cannot be planned."""
        memo = (op, cfg.grid)
        if memo not in self._keys:
            self._keys[memo] = self._key(op, cfg)
        return self._keys[memo]

    def _key(self, op: Op, cfg: ParallelConfig) -> str | None:
        if op.kind == "input":
            return None
        cfg = ParallelConfig(cfg.degrees, tuple(range(cfg.num_tasks)), cfg.reduce)
        try:
            g = self.graph
            if g is not None and op.name in _names(g) and g.op(op.name) == op:
                return task_key(g, g.index(op.name), cfg)
            return op_task_key(op, cfg)
        except GraphError:
            return None

    def task_time(self, op: Op, cfg: ParallelConfig) -> float | None:
        """Seconds of forward + backward of the task shape of (op, cfg); None if not profiled."""
        key = self.key(op, cfg)
        return None if key is None else self.entries.get(key)

    @classmethod
    def load(
        cls, devices: DeviceGraph, graph: OpGraph | None = None, path: Path | None = None
    ) -> MeasuredTimes:
        """The cached measurements for the kind of device in `devices` (see `device_key`);
        logs one line on them (`load.note_cached`), kept in `note`."""
        key = device_key(devices)
        path = path or cache_path(key)
        if not path.exists():
            raise LayerwiseError(
                f"no measured costs for {key} devices ({path} does not exist); run "
                f"`python -m planner profile MODEL --devices {devices.name}` first"
            )
        data = _read_cache(path)
        _check_machine(data, path)
        remeasure = f"python -m planner profile MODEL --devices {devices.name}"
        taken = list(_taken(data).values())
        times = cls({k: s for k, (s, _) in data["entries"].items()}, key, graph, path)
        times.note = note_cached("measured op costs", path, taken, remeasure, "task shapes")
        return times


def _names(graph: OpGraph) -> set[str]:
    return {op.name for op in graph.ops}


def _check_machine(data: dict[str, Any], path: Path) -> None:
    cached = data.get("machine", {})
    here = machine_info()
    diff = [k for k in ("processor", "torch") if cached.get(k) != here[k]]
    if diff:
        warnings.warn(
            f"measured costs in {path} come from another machine or torch "
            f"({', '.join(f'{k}: {cached.get(k)!r} vs {here[k]!r} here' for k in diff)}); "
            "profile again for this machine",
            stacklevel=3,
        )


# -- profiling -----------------------------------------------------------------------------------


def profile_graph(
    graph: OpGraph,
    devices: DeviceGraph,
    repeats: int = 5,
    max_configs: int | None = None,
    progress: Progress | None = None,
    refresh: bool = False,
    space: str = "full",
    max_load: float | None = None,
) -> Path:
    """Measure every distinct task shape of `graph`'s configs on `devices` and cache them.

    For each op and each config in `ConfigSpace(graph, devices, max_configs, space)` (the
    mesh space's shapes are a subset of the full space's), the task shape
    (`task_key`) is timed once: 2 warm-up runs of forward + backward, then `repeats` timed
    runs, the median, with `torch.set_num_threads(1)` (restored after). Shapes already in the
    cache are skipped unless `refresh` or untrusted (measured on a busy machine, or at no
    recorded load). The cache file is merged, not overwritten, and written even when
    interrupted. `progress(done, total, label)` is called after each shape; with None, a rich
    progress bar is shown when stdout is a terminal. Returns the cache path.

    Other processes computing on this machine slow the timings: a busy machine (load average
    per core above `max_load`, see `planner.hardware.load`) is refused before the first shape
    and after each (MachineBusyError; nothing of this run is cached). The run's load and time
    are recorded in the cache."""
    import torch

    if repeats < 1:
        raise LayerwiseError(f"repeats must be >= 1, got {repeats}")
    key = device_key(devices)
    cuda = not key.startswith("cpu")
    if cuda and not torch.cuda.is_available():
        raise LayerwiseError(
            f"only this machine's CPU workers can be measured here (cpu-local-N presets); "
            f"{devices.name!r} has {devices.devices[0].kind} devices and this machine has no "
            "CUDA device. Profile on the machine that has them, or plan with analytic costs."
        )
    path = cache_path(key)
    data = _read_cache(path) if path.exists() else _new_cache(key)
    skip = set() if refresh else _trusted(data)
    todo = _distinct_tasks(graph, devices, max_configs, skip, space)
    what = f"profiling the op costs of {graph.name}"
    watch = LoadWatch(what, PROFILE_THREADS, max_load) if todo else None  # else nothing to time
    started = time.perf_counter()
    measured: dict[str, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(PROFILE_THREADS)
    report, close = _progress(progress, len(todo))
    busy = False
    try:
        for done, (k, (index, cfg)) in enumerate(todo.items(), start=1):
            fn, leaves = _task(graph, index, cfg, cuda)
            measured[k] = _median_time(fn, leaves, repeats, cuda)
            report(done, len(todo), f"{graph.ops[index].name} (op {index + 1}/{len(graph)})")
            if watch is not None:
                watch.check()
    except MachineBusyError:
        busy = True
        raise
    finally:
        torch.set_num_threads(threads)
        close()
        if not busy:  # a finished or interrupted run: what it measured, at its load
            record = {
                "graph": graph.name,
                "fingerprint": graph.fingerprint(),
                "devices": devices.name,
                "max_configs": max_configs,
                "space": space,
                "repeats": repeats,
                "shapes": len(todo),
                "measured": len(measured),
                "seconds": round(time.perf_counter() - started, 3),
                "load": None if watch is None else watch.load().to_json(),
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            _merge_and_write(path, key, measured, record)
    return path


def _new_cache(key: str) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "device_key": key,
        "machine": machine_info(),
        "entries": {},
        "profiled": [],
    }


def _merge_and_write(path: Path, key: str, measured: dict[str, float], record: Any) -> None:
    """Re-read the cache (another run may have written it) and merge this run's entries."""
    data = _read_cache(path) if path.exists() else _new_cache(key)
    data["machine"] = machine_info()
    run = len(data["profiled"])
    data["entries"].update({k: [seconds, run] for k, seconds in measured.items()})
    data["updated"] = record["at"]
    data.setdefault("profiled", []).append(record)
    _write_cache(path, data)


def _distinct_tasks(
    graph: OpGraph,
    devices: DeviceGraph,
    max_configs: int | None,
    skip: set[str],
    kind: str = "full",
) -> dict[str, tuple[int, ParallelConfig]]:
    """Task key -> the first (op index, config) that has it, in graph and config order."""
    space = ConfigSpace(graph, devices, max_configs, kind)
    todo: dict[str, tuple[int, ParallelConfig]] = {}
    for i, op in enumerate(graph.ops):
        if op.kind == "input":
            continue
        seen: set[tuple[int, ...]] = set()
        for cfg in space[i].configs:
            if cfg.grid in seen:
                continue
            seen.add(cfg.grid)
            k = task_key(graph, i, cfg)
            if k not in skip and k not in todo:
                todo[k] = (i, cfg)
    return todo


def _task(
    graph: OpGraph, index: int, cfg: ParallelConfig, cuda: bool
) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor]]:
    import torch

    plan = plan_task(graph, index, cfg)
    generator = torch.Generator().manual_seed(index)
    device = torch.device("cuda") if cuda else None
    return plan_fn(plan, torch.float32, generator, device)


def _median_time(
    fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], repeats: int, cuda: bool
) -> float:
    """Median seconds of forward + backward over `repeats` runs after WARMUP runs."""
    import torch

    out = fn()
    grad = torch.randn_like(out)
    del out

    def step() -> None:
        for t in leaves:
            t.grad = None
        y = fn()
        if y.requires_grad:
            y.backward(grad)

    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(repeats):
        if cuda:  # pragma: no cover - untested without a GPU
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def _progress(progress: Progress | None, total: int) -> tuple[Progress, Callable[[], None]]:
    """(report, close): the caller's callback, a rich bar on a terminal, or nothing."""
    if progress is not None:
        return progress, lambda: None
    if not sys.stdout.isatty() or total == 0:
        return (lambda done, total, label: None), lambda: None
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn("profiling {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    bar.start()
    task = bar.add_task("", total=total)

    def report(done: int, total: int, label: str) -> None:
        bar.update(task, completed=done, description=label)

    return report, bar.stop
