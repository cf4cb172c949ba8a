"""Many-strategy problems on a real problem's graph: `many_strategies(source, seed)`.

A held-out IOPDDL contest instance has the graph of the public instance G (816 nodes, 1,023
edges, the same live intervals and memory limit) but about 29 strategies per node on average
(178 at most, 10% of them forbidden) where G has 12.3 (39 at most): its tables hold about ten
times G's entries. `many_strategies` makes such problems from any source problem (G for the
bench, a small `contest_problem` in the tests), keeping the source's nodes, edges, intervals
and usage limit, and the structure of its tables rather than uniform noise:

- every allowed strategy of the source is kept as it is (band 0): any valid answer of the
  source is a valid answer of the new problem, of the same cost (so the source's optimum is
  an upper bound of the new one's);
- the others are variants of the kept ones (a layout on another mesh axis), in bands: band
  j >= 1 holds the j-th variant of each kept strategy in turn, and a band shards more (half
  the memory, more compute), less (twice the memory, less compute) or as much as its source
  strategy, at costs scaled by the band's factor and a little noise (a free strategy stays
  free);
- an edge's entry between strategies of the same band is the source's entry between their
  source strategies (resharding-free pairs stay zero, forbidden pairs forbidden); between
  two bands it is that entry scaled by the bands' resharding factor, plus the edge's typical
  resharding cost (the median nonzero entry of its source table);
- a node's number of strategies is the kept ones plus a heavy-tailed (log-normal) draw,
  scaled so that the mean is `mean`, the largest `most`; nodes with a single strategy in the
  source keep one, and nodes joined by an edge that forbids pairs (a consumer that keeps its
  producer's layout) with as many kept strategies share their draw, so that their bands line
  up as real instances' strategies do along such edges; `forbidden` of all strategies are
  forbidden (only variants: the kept ones stay allowed).

Deterministic for a seed. `python -m experiments.many_strategies SOURCE OUT` writes one.
"""

from __future__ import annotations

import numpy as np

from planner.errors import ProblemError
from planner.problems.problem import Problem

__all__ = ["many_strategies"]

SPREAD = 1.0  # sigma of the log-normal that draws the strategies per node (heavy tail)


MOST_FORBIDDEN = 0.9  # of the new strategies at most (each node keeps a choice)


def many_strategies(
    source: Problem,
    seed: int,
    mean: float = 29.0,
    most: int = 178,
    forbidden: float = 0.10,
    name: str | None = None,
) -> Problem:
    """A problem with the nodes, edges, intervals and usage limit of `source` and about
    `mean` strategies per node (at most `most`; `forbidden` of them forbidden), its costs
    and usages variants of the source's (module docstring)."""
    n = source.num_nodes
    allowed = [np.flatnonzero(np.isfinite(c)) for c in source.node_cost]
    kept = np.array([len(a) for a in allowed])
    if n == 0 or (kept == 0).any():
        raise ProblemError(
            f"many_strategies needs a source with nodes, each with an allowed strategy; "
            f"{source.name!r} has {n} nodes, {int((kept == 0).sum())} without one"
        )
    if not (most >= kept.max() and 1 <= mean <= most and 0 <= forbidden < 1):
        raise ProblemError(
            f"many_strategies needs 1 <= mean <= most, most >= the source's allowed strategies "
            f"per node ({kept.max()}) and 0 <= forbidden < 1; got mean {mean}, most {most}, "
            f"forbidden {forbidden}"
        )
    if seed < 0 or mean < kept.mean():
        raise ProblemError(
            f"many_strategies needs a seed >= 0 and a mean of at least the source's "
            f"{kept.mean():.3g} strategies per node (they are kept); got seed {seed}, mean {mean}"
        )
    rng = np.random.default_rng(seed)
    sizes = _sizes(rng, source, kept, mean, most)
    # band j >= 1: the j-th variant of every kept strategy, in the kept ones' order
    bands = int(np.ceil(most / kept.min()))
    memory = np.concatenate([[1.0], rng.choice([0.5, 1.0, 2.0], bands, p=[0.35, 0.3, 0.35])])
    compute = np.where(memory < 1, 1.6, np.where(memory > 1, 0.7, 1.1))
    compute = compute * rng.uniform(0.85, 1.15, bands + 1)
    compute[0] = 1.0
    pair = rng.uniform(0.8, 1.6, (bands + 1, bands + 1))  # resharding between two bands
    pair = np.triu(pair) + np.triu(pair, 1).T
    np.fill_diagonal(pair, 1.0)
    parent, band = [], []
    for i in range(n):
        s = np.arange(sizes[i])
        parent.append(allowed[i][s % kept[i]])
        band.append(s // kept[i])
    extras = int((sizes - kept).sum())
    if forbidden * sizes.sum() > MOST_FORBIDDEN * extras:
        raise ProblemError(
            f"many_strategies forbids only new strategies, at most {MOST_FORBIDDEN:.0%} of "
            f"them: {forbidden:g} of {int(sizes.sum())} strategies is more; give a smaller "
            "forbidden share or a larger mean"
        )
    rate = forbidden * sizes.sum() / extras if extras else 0.0
    node_cost, usage = [], []
    for i in range(n):
        p, b = parent[i], band[i]
        noise = np.where(b > 0, rng.lognormal(0.0, 0.1, len(p)), 1.0)
        own = source.node_cost[i][p]  # band 0: the source's strategies, exactly as they are
        cost = np.where(b > 0, np.floor(own * compute[b] * noise), own)
        cost[(b > 0) & (rng.random(len(p)) < rate)] = np.inf
        node_cost.append(cost)
        if source.usage is not None:
            u = np.asarray(source.usage[i], dtype=np.float64).reshape(len(source.node_cost[i]), -1)
            variant = np.maximum(np.floor(u[p] * memory[b][:, None]), 1.0)
            usage.append(np.where(b[:, None] > 0, variant, u[p]))
    edge_cost = []
    for (a, c), table in zip(source.edges, source.edge_cost, strict=True):
        base = table[np.ix_(parent[a], parent[c])]
        positive = table[np.isfinite(table) & (table > 0)]
        reshard = float(np.median(positive)) if len(positive) else 1.0
        ba, bc = band[a][:, None], band[c][None, :]
        with np.errstate(invalid="ignore"):
            t = np.where(ba == bc, base, np.floor(base * pair[ba, bc] + reshard))
        edge_cost.append(t)
    return Problem(
        name=name or f"{source.name}-many{mean:g}-seed{seed}",
        node_names=source.node_names,
        node_cost=tuple(node_cost),
        edges=source.edges,
        edge_cost=tuple(edge_cost),
        usage=tuple(usage) if source.usage is not None else None,
        intervals=source.intervals,
        usage_limit=source.usage_limit,
    )


def _sizes(
    rng: np.random.Generator, source: Problem, kept: np.ndarray, mean: float, most: int
) -> np.ndarray:
    """Strategies per node: a single one where the source has one, else the kept ones plus
    a log-normal draw scaled (by bisection) to make the mean `mean`; the largest is `most`.
    Nodes joined by an edge that forbids pairs (a consumer that must keep its producer's
    layout), with as many kept strategies, share their draw, as such nodes share their
    strategies in real instances: the bands of variants line up along them."""
    grow = np.array(source.sizes) > 1
    n = len(kept)
    root = np.arange(n)

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = int(root[i])
        return i

    for (u, v), t in zip(source.edges, source.edge_cost, strict=True):
        if kept[u] == kept[v] and not np.isfinite(t).all():
            root[find(u)] = find(v)
    z = rng.lognormal(0.0, SPREAD, n)[[find(i) for i in range(n)]]
    if not grow.any():
        return kept.copy()

    def sizes(c: float) -> np.ndarray:
        return np.where(grow, np.minimum(kept + np.round(c * z), most), kept).astype(np.int64)

    lo, hi = 0.0, float(most)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sizes(mid).mean() < mean else (lo, mid)
    out = sizes(hi)
    out[np.argmax(np.where(grow, z, -np.inf))] = most
    return out
