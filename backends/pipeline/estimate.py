"""A chunk's micro-batch in closed form: the cost model's per-op times summed, no simulation.

The pipeline search ranks its stage layouts with this before it simulates any
(`backends.pipeline.search`): `closed_form_chunk` takes the place of
`planner.pipeline.stages.simulate_chunk` in `backends.pipeline.units.unit_costs` and
returns the same six figures for one op range on its group (`planner.pipeline.stages.
range_problem`), from the same `CostModel`, so that they follow its compute rates, transfers
and sync (and any change to them):

- **forward**: every op's slowest forward task (`CostModel.task_times`, with a mixture of
  experts' all-to-alls, `CostModel.expert_exchange`, less the `ep_overlap` the simulator
  hides), one after another, plus each edge's transfer forward (`CostModel.transfer_time`,
  its forward share);
- **backward**: the ops in reverse, each its slowest backward task (recomputation in it) and
  the gradients of its inputs sent back;
- **sync**: what is left after the backward of the gradient sync and the update, as
  FlexFlow's simulator orders them (Jia et al. 2019, Sec. 5.1; `planner.sim.simulator`): op
  i's ring all-reduce (`CostModel.sync_time`) starts once its backward is done and the sync
  before it has ended (one link resource), the updates run after the backward, in op order,
  each once its sync has ended (`CostModel.update_copies` bytes at the memory bandwidth);
- **memory**: `CostModel.memory_parts`, exactly as the simulation reports it.

Transfers of different ops never overlap here and compute never waits for a transfer on
another link, so forward and backward are a little above the simulation when transfers and
compute overlap and below it when links are shared. The sync is the cost model's: a ring
step at the route's bottleneck bandwidth, where FlexFlow's simulator here sends a message
link after link (store and forward: a route of 4 links takes 4 times as long), so across
nodes the closed form's sync is a third to a quarter of the simulated one. It ranks stage
layouts as their costing does all the same (docs/pipeline.md, "How a layout is scored"),
and the search measures its best layouts by simulation before it answers ("What is
simulated and returned").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from backends.pipeline.units import (
    Units,
    composed_units,
    range_scales,
    unit_message,
    unit_ranges,
)
from planner.costs.costmodel import CostModel, CostOptions
from planner.graph.opgraph import OpGraph
from planner.hardware.devices import DeviceGraph
from planner.pipeline.layouts import block_kinds
from planner.pipeline.stages import Chunk, range_problem
from planner.problems.strategy import Strategy

__all__ = ["QuickUnits", "closed_form_chunk"]


def closed_form_chunk(
    options: CostOptions, measured: Any, ch: Chunk
) -> tuple[float, float, float, float, float, float]:
    """(forward, backward, sync seconds; kept, fixed and working bytes: the largest on a
    device of its group) of one micro-batch on a chunk, as `simulate_chunk` returns them,
    from the cost model's per-op times instead of a simulation."""
    cm = CostModel(ch.graph, ch.devices, options, measured=measured)
    graph, configs = ch.graph, ch.configs
    n = len(graph.ops)
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    for i in range(n):
        f, b = cm.task_times(i, configs[i])
        a2a = cm.expert_exchange(i, configs[i])  # the simulator's exchange tasks, as it hides them
        if a2a is not None:
            f, b = f + a2a[0] * (1 - options.ep_overlap), b + a2a[1] * (1 - options.ep_overlap)
        fwd[i], bwd[i] = float(f.max(initial=0.0)), float(b.max(initial=0.0))
    grad_back = np.zeros(n)  # gradients op i sends back to its inputs, after its backward
    for edge in graph.edges:
        seconds = cm.transfer_time(edge, configs[edge.src], configs[edge.dst])
        if not seconds:
            continue
        if graph.ops[edge.src].kind == "input":  # no gradient: all of it forward
            fwd[edge.dst] += seconds
            continue
        passes = 2.0 + (1.0 if edge.dst in cm.recomputed else 0.0)  # forward (again), back
        fwd[edge.dst] += seconds / passes
        grad_back[edge.dst] += seconds * (passes - 1) / passes
    forward = float(fwd.sum())
    done = np.cumsum((bwd + grad_back)[::-1])[::-1]  # op i's backward ends at done[i]
    backward = float(done[0]) if n else 0.0
    params, kept, working = cm.memory_parts(configs)
    sync = _sync_left(cm, configs, done, backward)
    return (
        forward,
        backward,
        sync,
        float(np.max(kept)),
        float(np.max(params + working)),
        float(np.max(working)),
    )


def _sync_left(cm: CostModel, configs: Any, done: np.ndarray, backward: float) -> float:
    """Seconds after the backward until the last update: the ops' syncs one after another on
    one link, each from its backward's end; then the updates in op order, each after its
    sync."""
    graph = cm.graph
    link = 0.0
    synced: dict[int, float] = {}
    for i in reversed(range(len(graph.ops))):
        if not graph.ops[i].params:
            continue
        link = max(link, float(done[i])) + cm.sync_time(i, configs[i])
        synced[i] = link
    device = backward
    for i in sorted(synced):
        op, cfg = graph.ops[i], configs[i]
        rate = float(np.min(cm.mem_bw[list(cfg.devices)])) * cm.options.memory_efficiency
        update = 0.0
        for nbytes, groups in cm.param_groups(op, cfg):  # a moe op's classes: their replicas
            update += cm.update_copies(op, groups.shape[1]) * nbytes / len(groups) / rate
        device = max(device, synced[i]) + update
    return device - backward


class QuickUnits:
    """Closed-form units (`closed_form_chunk` in place of the simulation, composed and
    scaled as `backends.pipeline.units.unit_costs` does) for many stage layouts: each op range
    timed once per micro-batch graph, stage layout rule, cost options and group of the same
    figures (its devices, hosts and routes alike up to their names), so that the stage
    layouts that differ only in their number of stages share it; the message to the next
    stage once per layout rule and distance."""

    def __init__(self) -> None:
        self._ranges: dict[tuple[Any, ...], tuple[float, ...]] = {}
        self._messages: dict[tuple[int, int], float] = {}
        self._kinds: dict[int, tuple[int, ...]] = {}
        self._scales: dict[tuple[Any, ...], dict[str, tuple[float, float]]] = {}
        self._unit_ranges: dict[int, dict[str, range]] = {}
        self._figures: dict[tuple[int, tuple[int, ...]], tuple[Any, ...]] = {}
        self._kept: list[Any] = []  # what the keys' ids name, alive while this is

    def units(
        self,
        graph: OpGraph,
        devices: DeviceGraph,
        ends: tuple[int, ...],
        group_of: Callable[[], DeviceGraph],
        strategy: Strategy,
        options: CostOptions,
        next_group_offset: int,
        here: int,
        replicas: int,
    ) -> Units:
        """`unit_costs(graph, devices, group, tensor, options, next_group_offset, replicas,
        layout)` in closed form, where `group` (made by `group_of`, only when no group of the
        same figures was) is `devices`' devices `ends`, `here` replicas of `tensor`, and
        `strategy` the layout of `graph` on it."""
        if id(graph) not in self._unit_ranges:
            self._unit_ranges[id(graph)] = unit_ranges(graph)
            self._kept.append(graph)
        ranges = self._unit_ranges[id(graph)]
        where_from = (id(devices), ends)  # the same devices for every stage layout: once each
        if where_from not in self._figures:
            self._figures[where_from] = _figures(devices, ends)
            self._kept.append(devices)
        figures = self._figures[where_from]
        mine = tuple(range(len(ends)))
        group: DeviceGraph | None = None
        measured = {}
        for name, ops in ranges.items():
            key = (id(graph), id(strategy), repr(options), figures, name)
            if key not in self._ranges:
                group = group or group_of()
                ch = range_problem(group, graph, strategy.configs, ops, mine, lambda j: mine)
                self._ranges[key] = closed_form_chunk(options, None, ch)
                self._kept.append(strategy)
            measured[name] = self._ranges[key]
        where = (id(strategy), next_group_offset)
        if where not in self._messages:
            self._messages[where] = unit_message(
                devices, group or group_of(), graph, strategy, ranges["middle"], next_group_offset
            )
        scales = self._scales.get((id(strategy), repr(options), here, replicas))
        if scales is None:
            scales = range_scales(graph, strategy.configs, ranges, options, here, replicas)
            self._scales[id(strategy), repr(options), here, replicas] = scales
        if id(graph) not in self._kinds:
            self._kinds[id(graph)] = block_kinds(graph)
        kinds = self._kinds[id(graph)]
        return composed_units(measured, scales, options, self._messages[where], kinds)


def _figures(devices: DeviceGraph, ends: tuple[int, ...]) -> tuple[Any, ...]:
    """What a cost model reads of the devices `ends`, but their names: each one's figures
    and host by first appearance, and the seconds from each to each (latency, and per MiB:
    `DeviceGraph.transfer_time`'s sums, every pair at once, as bytes)."""
    hosts: dict[str, int] = {}
    figures = []
    for i in ends:
        d = devices.devices[i]
        rest = (getattr(d, f.name) for f in dataclasses.fields(d) if f.name not in ("name", "host"))
        figures.append((hosts.setdefault(d.host, len(hosts)), *rest))
    at = np.asarray(ends, dtype=np.int64)
    inv, lat = devices.pair_costs(at[:, None], at[None, :])
    apart = at[:, None] != at[None, :]  # transfer_time is 0 from a device to itself
    routes = tuple(np.where(apart, lat + size * inv, 0.0).tobytes() for size in (1.0, 2.0**20))
    return tuple(figures), routes
