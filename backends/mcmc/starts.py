"""The start candidates of an `mcmc` search (FlexFlow Sec. 6.2 uses existing strategies and
random ones); `backends.mcmc.chain` scores them all and searches from the best.

- `warm_start`: the caller's choices (e.g. another backend's answer);
- `elimination`: the optimum of OptCNN's Eq. 1 (`backends.exact.elimination`), computed here when no
  warm start is given, the problem has no memory limit, and its estimated time fits a share
  of the budget;
- `data_parallel`, `expert`: the expert strategies of `planner.problems.baselines` (for a
  cost-table problem: each node's cheapest choice);
- `feasible`: under a memory limit, a memory-feasible heuristic answer;
- `random`: a uniformly random choice per node;
- every DNN start but the random one also shrunk onto the first group of each level of the
  cluster's hierarchy (e.g. one host of p100-4x4): a small model can be fastest on fewer
  devices, which no single-node change reaches from a strategy that spans them all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backends.base import SolveOptions
from planner.costs.config import ParallelConfig
from planner.deadline import Deadline
from planner.errors import ConfigError
from planner.problems.baselines import BASELINES, applicable
from planner.problems.problem import Problem

INITS = ("warm_start", "elimination", "data_parallel", "expert", "feasible", "random")
ELIMINATION_SHARE = 0.2  # of the time limit, at most, for the Eq. 1 optimum as a start
ELIMINATION_RATE = 3e8  # table entries per second of its min-plus products (measured: 5e8)
FEASIBLE_SHARE = 0.1  # of the time limit, at most, for the memory-feasible start

Start = tuple[str, tuple[int, ...]]


def feasible_start(problem: Problem, deadline: float) -> tuple[int, ...] | None:
    """A memory-feasible choice vector found fast (the heuristic every backend shares:
    greedy by cost per byte, then repair and local search), or None."""
    from backends.heuristics.feasible import feasible_choices

    return feasible_choices(problem, deadline)


def start_choices(
    problem: Problem,
    options: SolveOptions,
    inits: Sequence[str],
    rng: np.random.Generator,
    deadline: float,
) -> list[Start]:
    """The named start candidates of `inits`, in that order, then the shrunk ones."""
    p, out = problem, []
    for name in inits:
        if name == "warm_start" and options.warm_start is not None:
            out.append((name, p.check_choices(options.warm_start)))
        elif name == "elimination" and options.warm_start is None:
            found = elimination_start(p, options.clock())
            out += [(name, found)] if found is not None else []
        elif name == "feasible" and p.usage_limit is not None:
            cap = options.clock().part(FEASIBLE_SHARE).at
            found = feasible_start(p, min(deadline, cap))
            out += [(name, found)] if found is not None else []
        elif name == "random":
            out.append((name, tuple(int(rng.integers(n)) for n in p.sizes)))
        elif name in ("data_parallel", "expert") and p.is_dnn:
            out += baseline_starts(p, name)
        elif name == "data_parallel":
            out.append(("cheapest_node", tuple(int(np.argmin(c)) for c in p.node_cost)))
    return out + shrunk_starts(p, [s for s in out if s[0] != "random"])


def baseline_starts(problem: Problem, which: str) -> list[Start]:
    """Data parallelism (`which` "data_parallel") or the other expert strategies."""
    dnn = problem.dnn("the expert strategies are strategies of a DNN")
    graph, devices = dnn.graph, dnn.devices
    names = applicable(graph)
    names = ["data_parallel"] if which == "data_parallel" else names[1:]
    out = []
    for b in names:
        try:
            out.append((b, problem.choices_of(BASELINES[b](graph, devices))))
        except ConfigError:
            continue  # not in the (capped) config space
    return out


def elimination_start(problem: Problem, deadline: Deadline) -> tuple[int, ...] | None:
    """The Eq. 1 optimum (OptCNN Algorithm 1), when its estimated time fits a share
    (ELIMINATION_SHARE) of the time limit of `deadline`: its min-plus products touch about
    C_u C_v max(C_u, C_v) entries per edge."""
    from backends import get_backend

    if problem.usage_limit is not None:
        return None  # elimination cannot hold a memory limit
    sizes = np.array(problem.sizes, dtype=np.float64)
    work = sum(sizes[u] * sizes[v] * max(sizes[u], sizes[v]) for u, v in problem.edges)
    if work / ELIMINATION_RATE > ELIMINATION_SHARE * deadline.limit:
        return None
    options = SolveOptions(deadline=deadline.part(ELIMINATION_SHARE))
    return get_backend("elimination").solve(problem, options).choices


def shrunk_starts(problem: Problem, starts: Sequence[Start]) -> list[Start]:
    """Each start shrunk onto the first group of every level of the cluster's hierarchy."""
    if not problem.is_dnn:
        return []
    hierarchy = problem.dnn().devices.hierarchy()
    if hierarchy is None:
        return []
    out, seen = [], {ch for _, ch in starts}
    for level in range(1, len(hierarchy.sizes)):
        devices = hierarchy.block(level)
        for name, choices in starts:
            found = shrink(problem, choices, devices)
            if found is not None and found not in seen:
                seen.add(found)
                out.append((f"{name}@{devices}", found))
    return out


def shrink(problem: Problem, choices: Sequence[int], devices: int) -> tuple[int, ...] | None:
    """The strategy on devices 0 .. devices-1 only: every config's largest degrees divided by
    their smallest prime factors until its tasks fit, on the block that starts at device 0.
    None if a shrunk config is not in the (capped) config space."""
    space = problem.dnn("shrinking a strategy needs its config space").space
    out = []
    for ops, c in zip(problem.ops_of_nodes, choices, strict=True):
        degrees = list(space[ops[0]].configs[c].degrees)
        while math.prod(degrees) > devices or devices % math.prod(degrees):
            d = max(range(len(degrees)), key=lambda k: degrees[k])
            degrees[d] //= _smallest_factor(degrees[d])
        cfg = ParallelConfig(tuple(degrees), tuple(range(math.prod(degrees))))
        try:
            out.append(space[ops[0]].index(cfg))
        except ConfigError:
            return None
    return tuple(out)


def _smallest_factor(n: int) -> int:
    return next(f for f in range(2, n + 1) if n % f == 0)
