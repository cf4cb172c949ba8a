"""The state of an `mcmc` chain: its objective, its Eq. 1 cost and its memory, kept incrementally.

- `AdditiveCost`: OptCNN's Eq. 1 (sum of node costs t_c + t_s and edge costs t_x) of the
  current choices, updated in O(degree) per change; forbidden (inf) terms are counted apart,
  so a chain can leave a forbidden start step by step.
- `MemoryUsage`: the live usage of every memory pool at every interval start (the liveness
  rule of `planner.problems.evaluate.memory_peak`), updated per change over the changed
  node's interval only, and the excess over the limit.
- `ChainState`: one choice vector with the three views: the objective (the simulated makespan
  by delta simulation, FlexFlow Alg. 2, or Eq. 1), Eq. 1 for the proposals' pre-screen, and
  the memory excess for the soft penalty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from planner.problems.problem import Problem

MEMORY_RTOL = 1e-9  # the tolerance of planner.problems.evaluate.memory_feasible


# A change of more nodes than this share (and REBUILD_MIN) is simulated in full.
REBUILD_SHARE, REBUILD_MIN = 0.25, 32


class AdditiveCost:
    """Eq. 1 of the current choices: `finite` (the sum of finite terms) and `forbidden`
    (how many terms are inf)."""

    def __init__(self, problem: Problem, choices: Sequence[int]):
        self.p = problem
        self.choices = list(choices)
        self.incident: list[list[int]] = [[] for _ in range(problem.num_nodes)]
        for k, (u, v) in enumerate(problem.edges):
            self.incident[u].append(k)
            self.incident[v].append(k)
        self.finite, self.forbidden = self._total()

    def _total(self) -> tuple[float, int]:
        terms = [float(c[k]) for c, k in zip(self.p.node_cost, self.choices, strict=True)]
        terms += [
            float(t[self.choices[u], self.choices[v]])
            for (u, v), t in zip(self.p.edges, self.p.edge_cost, strict=True)
        ]
        bad = sum(1 for x in terms if not math.isfinite(x))
        return sum(x for x in terms if math.isfinite(x)), bad

    def _part(self, i: int, c: int) -> tuple[float, int]:
        """Node i's own term and its edges' terms if it took config c."""
        terms = [float(self.p.node_cost[i][c])]
        for k in self.incident[i]:
            u, v = self.p.edges[k]
            t = self.p.edge_cost[k]
            terms.append(float(t[c, self.choices[v]] if u == i else t[self.choices[u], c]))
        bad = sum(1 for x in terms if not math.isfinite(x))
        return sum(x for x in terms if math.isfinite(x)), bad

    def delta(self, i: int, c: int) -> tuple[float, int]:
        """The change of (finite, forbidden) if node i took config c."""
        new, old = self._part(i, c), self._part(i, self.choices[i])
        return new[0] - old[0], new[1] - old[1]

    def node_deltas(self, i: int) -> np.ndarray:
        """Eq. 1 change for every config of node i (inf where a term is forbidden): O(C x degree)."""
        total = np.asarray(self.p.node_cost[i], dtype=np.float64).copy()
        for k in self.incident[i]:
            u, v = self.p.edges[k]
            t = self.p.edge_cost[k]
            total += t[:, self.choices[v]] if u == i else t[self.choices[u], :]
        now = total[self.choices[i]]
        return total - now if math.isfinite(now) else total

    def delta_many(self, changes: Sequence[tuple[int, int]]) -> float:
        """The change of the finite part if every (node, config) of `changes` were applied."""
        before, old = self.finite, [(i, self.choices[i]) for i, _ in changes]
        for i, c in changes:
            self.set(i, c)
        after = self.finite
        for i, c in reversed(old):
            self.set(i, c)
        self.finite = before  # exact, whatever the rounding of the round trip
        return after - before

    def set(self, i: int, c: int) -> None:
        d, bad = self.delta(i, c)
        self.choices[i] = c
        self.finite += d
        self.forbidden += bad

    @property
    def cost(self) -> float:
        return self.finite if self.forbidden == 0 else math.inf


class MemoryUsage:
    """Live bytes per pool at every distinct interval start, (T, M), kept incrementally.

    Node i is live at the starts t with start_i <= t < end_i: a contiguous run [lo_i, hi_i)
    of the sorted distinct starts, so a change adds one (M,) row difference to that run."""

    def __init__(self, problem: Problem, choices: Sequence[int]):
        assert problem.usage is not None and problem.intervals is not None
        assert problem.usage_limit is not None
        self.usage = [np.asarray(u, dtype=np.float64).reshape(len(u), -1) for u in problem.usage]
        start, end = problem.intervals[:, 0], problem.intervals[:, 1]
        times = np.unique(start)
        self.lo = np.searchsorted(times, start, side="left")
        self.hi = np.searchsorted(times, end, side="left")
        self.limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1)
        self.cap = self.limit * (1 + MEMORY_RTOL)
        self.scale = np.maximum(self.limit, 1e-300)
        self.smallest = np.stack([u.min(axis=0) for u in self.usage])  # (n, M)
        self.current = np.stack([u[c] for u, c in zip(self.usage, choices, strict=True)])
        self.live = self._sweep(self.current, len(times))

    def _sweep(self, rows: np.ndarray, horizon: int) -> np.ndarray:
        """Live usage of `rows` (n, M) at every start: a difference array, O(n + T)."""
        diff = np.zeros((horizon + 1, rows.shape[1]))
        np.add.at(diff, self.lo, rows)
        np.add.at(diff, self.hi, -rows)
        return np.cumsum(diff[:-1], axis=0)

    def proven_infeasible(self) -> str | None:
        """Why no choice vector can fit, or None: at some start, the live nodes at their
        smallest usage overflow one pool, or overflow all pools together (the bytes must be
        somewhere)."""
        least = self._sweep(self.smallest, len(self.live))
        over = least > self.cap[None, :]
        if over.any():
            t, m = np.argwhere(over)[0]
            return (
                f"memory limit {self.limit[m]:.6g} of pool {m} is below the smallest possible "
                f"live usage {least[t, m]:.6g}"
            )
        total = np.array([u.sum(axis=1).min() for u in self.usage])[:, None]
        need = self._sweep(total, len(self.live))[:, 0]
        if len(need) and need.max() > self.cap.sum():
            return (
                f"the memory limits sum to {self.limit.sum():.6g} bytes, below the smallest "
                f"possible total live usage {need.max():.6g}"
            )
        return None

    def set(self, i: int, c: int) -> None:
        row = self.usage[i][c]
        self.live[self.lo[i] : self.hi[i]] += row - self.current[i]
        self.current[i] = row

    def resync(self) -> None:
        """Recompute the live usage from scratch (drops the rounding of many updates)."""
        self.live = self._sweep(self.current, len(self.live))

    def excess(self) -> float:
        """Sum over pools of the peak's excess over the limit, relative to the limit (0: fits)."""
        if len(self.live) == 0:
            return 0.0
        over = self.live.max(axis=0) - self.cap
        return float((np.maximum(over, 0.0) / self.scale).sum())

    def overfull(self) -> tuple[int, int] | None:
        """(start index, pool) of the largest relative excess, or None when everything fits."""
        if len(self.live) == 0:
            return None
        over = (self.live - self.cap[None, :]) / self.scale[None, :]
        t, m = np.unravel_index(int(np.argmax(over)), over.shape)
        return (int(t), int(m)) if over[t, m] > 0 else None

    def relievers(self, t: int, m: int) -> np.ndarray:
        """Per node, how much it could free on pool m at start t by its smallest config."""
        live = (self.lo <= t) & (t < self.hi)
        return np.where(live, self.current[:, m] - self.smallest[:, m], 0.0)


class ChainState:
    """A choice vector with its objective, Eq. 1 cost and memory excess, changed one node
    (or a few) at a time.

    `violation` counts what makes the choices invalid: the relative memory excess plus,
    under the additive objective, the number of forbidden terms; valid when 0."""

    def __init__(
        self, problem: Problem, choices: Sequence[int], objective: str, simulation: str = "delta"
    ):
        self.p = problem
        self.objective = objective
        self.full = simulation == "full"
        self.choices = list(choices)
        self.additive = AdditiveCost(problem, choices)
        self.memory = MemoryUsage(problem, choices) if problem.usage_limit is not None else None
        self.sim = None
        self.stale: set[int] = set()  # nodes whose config the simulator has not caught up on
        if objective == "makespan":
            from planner.sim.simulator import Simulator

            cm = problem.dnn("the makespan objective simulates the DNN's strategy").cost_model
            self.sim = Simulator(cm, problem.strategy(choices).configs)
        self.cost, self.violation = self._measure()

    def _measure(self) -> tuple[float, float]:
        excess = self.memory.excess() if self.memory is not None else 0.0
        if self.sim is not None:
            return self.sim.makespan, excess
        return self.additive.finite, excess + self.additive.forbidden

    @property
    def valid(self) -> bool:
        return self.violation == 0

    def move(self, changes: Sequence[tuple[int, int]]) -> tuple[float, float]:
        """Give node i config c for every (i, c); returns the new (cost, violation)."""
        for i, c in changes:
            self.choices[i] = c
            self.additive.set(i, c)
            if self.memory is not None:
                self.memory.set(i, c)
        if self.sim is not None:
            self._simulate({i for i, _ in changes} | self.stale)
            self.stale = set()
        self.cost, self.violation = self._measure()
        return self.cost, self.violation

    def undo(self, changes: Sequence[tuple[int, int]], cost: float, violation: float) -> None:
        """Go back to the choices before a move (`changes` restores them), whose cost and
        violation the caller knows. The simulator catches up at the next move: one delta
        simulation for a rejected proposal and the next one instead of two."""
        for i, c in changes:
            self.choices[i] = c
            self.additive.set(i, c)
            if self.memory is not None:
                self.memory.set(i, c)
        self.stale.update(i for i, _ in changes)
        self.cost, self.violation = cost, violation

    def _simulate(self, nodes: set[int]) -> None:
        from planner.sim.simulator import Simulator

        p, sim, dnn = self.p, self.sim, self.p.dnn()
        assert sim is not None
        if self.full or len(nodes) > max(REBUILD_MIN, REBUILD_SHARE * p.num_nodes):
            # Algorithm 1 from scratch: FlexFlow's baseline in its Table 4, and cheaper than
            # a delta that re-times almost everything (a restart from another start)
            self.sim = Simulator(dnn.cost_model, p.strategy(self.choices).configs)
            return
        ops = dnn.node_ops
        sim.change_many(
            [(op, dnn.space[op].configs[self.choices[i]]) for i in sorted(nodes) for op in ops[i]]
        )

    def jump_to(self, choices: Sequence[int]) -> None:
        """Move to another choice vector by changing only the nodes that differ."""
        diff = [
            (i, c) for i, (a, c) in enumerate(zip(self.choices, choices, strict=True)) if a != c
        ]
        if diff:
            self.move(diff)
