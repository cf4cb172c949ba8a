"""Proposals of the `mcmc` search: which node to change, and to which config.

FlexFlow (Sec. 6.2) gives one random op a random config. Most such proposals are far worse
than the current strategy (a convolution moved from 16 devices to one), so a chain with a
budget of a few hundred simulations wastes most of them. Kinds here:

- `jump`: a uniformly random config (FlexFlow's proposal; keeps the chain able to go anywhere);
- `degree`: one dimension's degree one step up or down, or a factor moved from one dimension
  to another, on the device set that overlaps the current one most (a sub-block when
  shrinking, the enclosing block when growing);
- `move`: the same partition on another device set (a block moved or shifted: the
  operation dimension, e.g. two branches side by side);
- `align`: the config of a neighbouring node in the graph, translated by dimension name
  (transfers between matching partitions vanish);
- `group`: a `degree` or `move` change applied to a connected region of nodes around the
  chosen one that share its config (translated by dimension name), e.g. a whole branch moved
  to other devices, or a layer's ops split another way, in one step (one delta simulation);
- `eq1`: the best other config under OptCNN's Eq. 1 given the neighbours' configs (for
  cost-table problems, whose configs have no structure, the one local move there is);
- `repair`: when memory is over the limit, a node live at the worst peak takes a config that
  uses less of the over-full pool (the one cheapest under Eq. 1, or a random one).

A node of the Problem can be several tied ops (a shared parameter group): it changes as one.
Proposals are not symmetric, so the chain is strictly a simulated annealing, not a sampler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from backends.mcmc.state import ChainState
from planner.problems.problem import Problem

if TYPE_CHECKING:
    from planner.costs.config import OpConfigs, ParallelConfig

KINDS = ("jump", "degree", "move", "group", "align", "eq1", "repair")
DNN_MIX = {"jump": 0.1, "degree": 0.2, "move": 0.1, "group": 0.25, "align": 0.2, "eq1": 0.15}
GROUP_GROWTH = 0.7  # a group region grows by another node with this probability
TABLE_MIX = {"jump": 0.5, "eq1": 0.5}


class _OpNeighbours:
    """The structured neighbours of the configs of one op (computed on first use)."""

    def __init__(self, configs: OpConfigs, num_devices: int):
        self.configs = configs
        self.num_devices = num_devices
        self.group_of = np.empty(len(configs), dtype=np.int64)
        for g, (_, _, idx) in enumerate(configs.groups):
            self.group_of[idx] = g
        # task grids, a contraction degree last where one is split: padded to one length
        width = max((len(part) for part, _, _ in configs.groups), default=0)
        self.parts = [(*part, *(1,) * (width - len(part))) for part, _, _ in configs.groups]
        self._adjacent: dict[int, list[int]] = {}
        self._degree: dict[int, np.ndarray] = {}
        self.index: dict[ParallelConfig, int] = {c: k for k, c in enumerate(configs.configs)}

    def moves(self, c: int) -> np.ndarray:
        """Other configs with the same partition (other device sets)."""
        idx = self.configs.groups[self.group_of[c]][2]
        return idx[idx != c]

    def degrees(self, c: int) -> np.ndarray:
        """Configs one degree step away, each on the device set closest to c's."""
        if c not in self._degree:
            devs = np.zeros(self.num_devices, dtype=bool)
            devs[list(self.configs.configs[c].devices)] = True
            out: list[int] = []
            for g in self.adjacent(int(self.group_of[c])):
                _, sets, idx = self.configs.groups[g]
                overlap = devs[sets].sum(axis=1)
                out.extend(int(k) for k in idx[overlap == overlap.max()])
            self._degree[c] = np.array(out, dtype=np.int64)
        return self._degree[c]

    def adjacent(self, g: int) -> list[int]:
        """Partitions one step from partition g: one degree to the next allowed value (the
        others fixed), or a factor moved between two dimensions (same task count)."""
        if g not in self._adjacent:
            p = self.parts[g]
            out = []
            for h, q in enumerate(self.parts):
                diff = [d for d in range(len(p)) if p[d] != q[d]]
                step = len(diff) == 1 and self._next_value(p, q, diff[0])
                if step or (len(diff) == 2 and np.prod(p) == np.prod(q)):
                    out.append(h)
            self._adjacent[g] = out
        return self._adjacent[g]

    def _next_value(self, p: tuple[int, ...], q: tuple[int, ...], d: int) -> bool:
        """Whether q[d] is the value next to p[d] among partitions equal to p elsewhere."""
        values = sorted(
            r[d] for r in self.parts if all(r[e] == p[e] for e in range(len(p)) if e != d)
        )
        k = values.index(p[d])
        return q[d] in values[max(0, k - 1) : k + 2]


class Proposer:
    """Draws proposals (kind, [(node, config)]) for a chain; `mix` weighs the kinds."""

    def __init__(self, problem: Problem, mix: Mapping[str, float], rng: np.random.Generator):
        self.p = problem
        self.rng = rng
        self.movable = np.flatnonzero(np.array(problem.sizes) > 1)
        kinds = [k for k, w in mix.items() if w > 0 and (problem.is_dnn or k in ("jump", "eq1"))]
        kinds = kinds or ["jump"]  # e.g. only structured kinds asked of a cost-table problem
        weights = np.array([mix.get(k, 1.0) for k in kinds], dtype=np.float64)
        self.kinds = kinds
        self.weights = weights / weights.sum()
        self.nbrs: list[list[int]] = [[] for _ in range(problem.num_nodes)]
        for u, v in problem.edges:
            self.nbrs[u].append(v)
            self.nbrs[v].append(u)
        self._ops: dict[int, _OpNeighbours] = {}

    def propose(self, state: ChainState, repair: float) -> tuple[str, list[tuple[int, int]]] | None:
        """(kind, [(node, new config), ...]); None when no node has a second config."""
        if len(self.movable) == 0:
            return None
        if repair > 0 and state.memory is not None and self.rng.random() < repair:
            found = self._repair(state)
            if found is not None:
                return "repair", found
        for _ in range(8):
            kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.weights))]
            i = int(self.movable[int(self.rng.integers(len(self.movable)))])
            c = self._config(kind, state, i)
            if c is None or c == state.choices[i]:
                continue
            if kind == "group":
                return kind, self._group(state, i, c)
            return kind, [(i, c)]
        i = int(self.movable[int(self.rng.integers(len(self.movable)))])
        return "jump", [(i, self._jump(state, i))]

    def _config(self, kind: str, state: ChainState, i: int) -> int | None:
        cur = state.choices[i]
        if kind == "group":
            kind = "move" if self.rng.random() < 0.5 else "degree"
        if kind == "jump":
            return self._jump(state, i)
        if kind == "eq1":
            d = state.additive.node_deltas(i)
            d[cur] = np.inf
            k = int(np.argmin(d))
            return k if np.isfinite(d[k]) else None
        if kind == "align":
            return self._align(state, i)
        ops = self._neighbours(i)
        pool = ops.moves(cur) if kind == "move" else ops.degrees(cur)
        return int(pool[int(self.rng.integers(len(pool)))]) if len(pool) else None

    def _jump(self, state: ChainState, i: int) -> int:
        c = int(self.rng.integers(self.p.sizes[i] - 1))
        return c + 1 if c >= state.choices[i] else c

    def _neighbours(self, i: int) -> _OpNeighbours:
        op = self.p.ops_of_nodes[i][0]  # tied ops share one config list
        if op not in self._ops:
            space = self.p.dnn("structured proposals move the configs of a DNN's ops").space
            self._ops[op] = _OpNeighbours(space[op], space.num_devices)
        return self._ops[op]

    def _align(self, state: ChainState, i: int) -> int | None:
        """Node i takes a random graph neighbour's config, translated by dimension name."""
        if not self.nbrs[i]:
            return None
        j = self.nbrs[i][int(self.rng.integers(len(self.nbrs[i])))]
        return self._translate(j, state.choices[j], i)

    def _translate(self, j: int, c: int, i: int) -> int | None:
        """The config of node i with the degrees (by dimension name) and devices of node j's
        config c, if i has it."""
        dnn = self.p.dnn("structured proposals move the configs of a DNN's ops")
        graph, space = dnn.graph, dnn.space
        oi, oj = self.p.ops_of_nodes[i][0], self.p.ops_of_nodes[j][0]
        if oi == oj or space[oi].configs is space[oj].configs:
            return c
        theirs = space[oj].configs[c]
        op_i, op_j = graph.ops[oi], graph.ops[oj]
        degrees = tuple(theirs.degree(op_j, d) for d in op_i.output.dims)
        # moe to moe: the experts' width cut alike (expert tensor parallelism)
        reduce = theirs.reduce if op_i.kind == op_j.kind == "moe" else 1
        if np.prod(degrees) * reduce != theirs.num_tasks:
            return None  # a split dimension that node i does not have
        from planner.costs.config import ParallelConfig

        expert = theirs.expert if op_i.kind == "moe" else 1  # only a moe op spreads experts
        cfg = ParallelConfig(degrees, theirs.devices, reduce, expert)
        return self._neighbours(i).index.get(cfg)

    def _group(self, state: ChainState, i: int, c: int) -> list[tuple[int, int]]:
        """Node i to c, and with it a random connected region of the nodes around i whose
        config is i's current one (translated), each to c translated."""
        old = state.choices[i]
        changes, seen, frontier = [(i, c)], {i}, [i]
        while frontier and self.rng.random() < GROUP_GROWTH:
            k = int(self.rng.integers(len(frontier)))
            grown = False
            for j in self.rng.permutation(self.nbrs[frontier[k]]):
                j = int(j)
                if j in seen:
                    continue
                seen.add(j)
                new = self._translate(i, c, j)
                if new is not None and self._translate(i, old, j) == state.choices[j] != new:
                    changes.append((j, new))
                    frontier.append(j)
                    grown = True
                    break
            if not grown:
                frontier.pop(k)
        return changes

    def _repair(self, state: ChainState) -> list[tuple[int, int]] | None:
        """A node live at the worst overflow takes a config using less of that pool; a
        neighbour whose current config that forbids (an inf pair) moves with it to its
        cheapest allowed one (a single change could never get there: it would be inf)."""
        assert state.memory is not None
        spot = state.memory.overfull()
        if spot is None:
            return None
        t, m = spot
        weight = state.memory.relievers(t, m)
        if not (weight > 0).any():
            return None
        i = int(self.rng.choice(len(weight), p=weight / weight.sum()))
        usage = state.memory.usage[i][:, m]
        smaller = np.flatnonzero(usage < usage[state.choices[i]])
        if self.rng.random() < 0.5:
            d = state.additive.node_deltas(i)[smaller]
            c = int(smaller[int(np.argmin(d))])
        else:
            c = int(smaller[int(self.rng.integers(len(smaller)))])
        changes = {i: c}
        for k in state.additive.incident[i]:
            u, v = self.p.edges[k]
            other, costs = (
                (v, self.p.edge_cost[k][c, :]) if u == i else (u, self.p.edge_cost[k][:, c])
            )
            if other in changes or np.isfinite(costs[state.choices[other]]):
                continue
            total = costs + np.asarray(self.p.node_cost[other], dtype=np.float64)
            if np.isfinite(total).any():
                changes[other] = int(np.argmin(total))
        return list(changes.items())
