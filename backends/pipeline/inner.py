"""A stage's layout from the per-op search: elimination on a few blocks of one tensor group,
repeated over the blocks and the data-parallel replicas.

For tensor degree t, the micro-batch graph at one sample per replica is cut into three op
ranges (`planner.pipeline.stages.range_problem`, each with input ops for what it reads from
before): the embeddings with blocks 0 and 1, blocks 1 and 2, and the last two blocks with
the head. Each is built into a Problem on t devices of one node and solved by the
`elimination` backend (OptCNN's Algorithm 1: OptCNN Eq. 1, proven optimal) through the
registry. The layout kept: the embeddings and block 0 from the first range, block 2 from the
second (block 1 there sees its input as the previous block left it, so block 2's layout is
the one a block in the middle of many repeats), the last block and the head from the third.
`SearchedLayout.strategy` then lays out any micro-batch graph of the same model on a stage
of t x d devices: every block in the middle as block 2 (by its ops' names relative to the
block), each op's samples split d more ways over the replicas, replica r on devices
r t .. r t + t - 1 (what `planner.problems.baselines.megatron` does with its own rule).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from planner.costs.config import ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.deadline import Deadline
from planner.errors import LayerwiseError
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import SAMPLE
from planner.hardware.devices import DeviceGraph
from planner.pipeline.layouts import block_ranges
from planner.pipeline.spec import batch_graph
from planner.pipeline.stages import range_problem
from planner.problems.baselines import megatron
from planner.problems.problem import build_problem
from planner.problems.sizes import DEFAULT_TABLE_BUDGET
from planner.problems.strategy import Strategy
from planner.registry import get_backend
from planner.result import SolveOptions

__all__ = ["SearchedLayout", "searched_layout"]

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class SearchedLayout:
    """Per-op configs on t devices (one replica), by op name: exact for the ops outside the
    middle blocks, relative to the block (`h.+0.attn`) for those in them."""

    tensor: int
    exact: dict[str, ParallelConfig]
    relative: dict[str, ParallelConfig]
    first_middle: int  # blocks from this index up to last_middle take the relative layout
    last_middle: int

    @property
    def expert(self) -> int:
        """The largest expert-parallel degree of its configs (1 without mixtures of experts):
        the per-op search may spread a moe op's experts inside its tensor group."""
        return max((c.expert for c in (*self.exact.values(), *self.relative.values())), default=1)

    def config(self, op: Op) -> ParallelConfig | None:
        found = self.exact.get(op.name)
        if found is not None:
            return found
        index = _block_index(op.name)
        if index is None or not self.first_middle <= index <= self.last_middle:
            return None
        return self.relative.get(_relative(op.name, index))

    def strategy(self, graph: OpGraph, group: DeviceGraph, tensor: int) -> Strategy:
        """The layout on a stage of `group` (t x d devices) for `graph` (its micro-batch of
        d x b samples); ops it has no config for take Megatron-LM's rule."""
        if tensor != self.tensor or group.num_devices % tensor:
            raise ValueError(f"a layout searched at tensor {self.tensor}, asked for {tensor}")
        data = group.num_devices // tensor
        rule: Strategy | None = None
        configs = []
        # One spread config per (config, where the samples are, whether they split): the
        # blocks' ops share a few configs, each of t x d devices (16,384 GPUs: thousands).
        spread_of: dict[tuple[int, int | None, bool], ParallelConfig | None] = {}
        for i, op in enumerate(graph.ops):
            cfg = self.config(op)
            spread = None
            if cfg is not None:
                key = _spread_key(op, cfg, data)
                if key not in spread_of:
                    spread_of[key] = _replicated(op, cfg, data, tensor)
                spread = spread_of[key]
            if spread is None:
                rule = rule or megatron(graph, group, tensor)
                spread = rule.configs[i]
            configs.append(spread)
        return Strategy(graph, group, tuple(configs))


def searched_layout(
    graph: OpGraph,
    devices: DeviceGraph,
    tensor: int,
    options: CostOptions,
    deadline: Deadline,
    table_budget: float | None = DEFAULT_TABLE_BUDGET,
) -> SearchedLayout | None:
    """The per-op search's layout at tensor degree `tensor` on the first `tensor` devices of
    `devices` (one node), or None when the model is too small to cut, a range finds no
    answer in time or within `table_budget` (`build_problem`'s), or the answer is
    Megatron-LM's rule's own layout."""
    try:
        one = batch_graph(graph, 1)
    except Exception:  # noqa: BLE001 - an op whose samples do not scale to one
        return None
    blocks = block_ranges(one)
    n, count = len(one.ops), len(blocks)
    if count < 4:
        return None
    group = devices.subset(range(tensor), f"{devices.name}[{tensor}]")
    mine = tuple(range(tensor))
    rule = megatron(one, group, tensor)
    ranges = (
        (range(0, blocks[2][0]), range(0, blocks[1][0])),
        (range(blocks[1][0], blocks[3][0]), range(blocks[2][0], blocks[2][1])),
        (range(blocks[-2][0], n), range(blocks[-1][0], n)),
    )
    found: list[dict[str, ParallelConfig]] = []
    for ops, keep in ranges:
        if deadline.expired():
            return None
        ch = range_problem(group, one, rule.configs, ops, mine, lambda j: mine)
        plain = dataclasses.replace(options, headroom=0.0, reserve=0.0)  # the units check memory
        try:
            cm = CostModel(ch.graph, ch.devices, plain)
            problem = build_problem(ch.graph, ch.devices, cm, table_budget=table_budget)
        except LayerwiseError:  # e.g. a range too big for one group: the rule alone
            return None
        result = get_backend("elimination").solve(problem, SolveOptions(deadline=deadline))
        if result.strategy is None:
            return None
        kept = {one.ops[i].name for i in keep}
        found.append(
            {
                op.name: cfg
                for op, cfg in zip(ch.graph.ops, result.strategy.configs, strict=True)
                if op.name in kept
            }
        )
    middle = _block_index(one.ops[blocks[2][0]].name)
    assert middle is not None
    relative = {_relative(name, middle): cfg for name, cfg in found[1].items()}
    first = _block_index(one.ops[blocks[1][0]].name)
    last = _block_index(one.ops[blocks[-2][0]].name)
    assert first is not None and last is not None
    layout = SearchedLayout(tensor, {**found[0], **found[2]}, relative, first, last)
    if layout.strategy(one, group, tensor).configs == rule.configs:
        return None  # the search's layout is the rule's: nothing new to cost
    return layout


def _block_index(name: str) -> int | None:
    match = _INDEX.search(name)
    return int(match.group(1)) if match else None


def _relative(name: str, base: int) -> str:
    return _INDEX.sub(lambda m: f".{int(m.group(1)) - base:+d}", name, count=1)


def _replicated(op: Op, cfg: ParallelConfig, data: int, tensor: int) -> ParallelConfig | None:
    """`cfg` (one replica's, on devices 0..t-1) with op's samples split `data` more ways:
    replica r's tasks on devices r t + (their device in `cfg`); None when op has no samples
    or they do not split so."""
    if data == 1:
        return cfg
    dims = op.output.dims
    if SAMPLE not in dims:
        return None
    k = dims.index(SAMPLE)
    degrees = list(cfg.degrees)
    if op.output.size(SAMPLE) % (degrees[k] * data):
        return None
    old_grid = cfg.grid
    new_degrees = tuple(d * data if j == k else d for j, d in enumerate(degrees))
    new_grid = (*new_degrees, cfg.reduce) if cfg.reduce > 1 else new_degrees
    coords = np.array(np.unravel_index(np.arange(int(np.prod(new_grid))), new_grid))
    replica, coords[k] = coords[k] // degrees[k], coords[k] % degrees[k]
    old = np.ravel_multi_index(tuple(coords), old_grid)
    devices = np.asarray(cfg.devices)[old] + replica * tensor
    # its expert degree kept: EP groups are consecutive token boxes, inside each replica
    return dataclasses.replace(cfg, degrees=new_degrees, devices=tuple(devices.tolist()))


def _spread_key(op: Op, cfg: ParallelConfig, data: int) -> tuple[int, int | None, bool]:
    """What `_replicated(op, cfg, data, ...)` depends on besides data and the tensor degree:
    the config (by identity: the layout's configs live as long as it), where op's samples
    are and whether they split data more ways."""
    dims = op.output.dims
    if SAMPLE not in dims:
        return id(cfg), None, False
    k = dims.index(SAMPLE)
    return id(cfg), k, op.output.size(SAMPLE) % (cfg.degrees[k] * data) == 0
