"""The Problem as a pairwise cost function network, in flat arrays for compiled loops.

A cost function network (a weighted CSP) has one variable per node whose domain is the node's
strategies, a unary cost function per node and a binary one per edge (Cooper et al., "Soft
arc consistency revisited", Artificial Intelligence 2010). `build_network` makes it from a
`Problem`:

- forbidden strategies (inf) leave the domain; `keep[i]` maps a domain index back to the
  strategy index of the Problem;
- parallel edges are summed into one table, oriented from the lower node to the higher;
- arc consistency on the forbidden pairs: a value that has no allowed partner in some
  neighbour's domain is removed too, until nothing changes. A domain that empties proves
  that no answer avoids every forbidden choice (INFEASIBLE, memory aside).

Forbidden pairs stay `inf` in `binary`; after arc consistency every value has a finite
partner on every edge, so message passing (`backends.wcsp.trws`) stays finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.deadline import Deadline
from planner.problems.problem import Problem

__all__ = ["Network", "build_network"]


@dataclass(frozen=True, eq=False)
class Network:
    """A pruned, merged pairwise network in flat arrays.

    Node i's domain is `keep[i]` (strategy indices of the Problem); its unary costs are
    `unary[noff[i]:noff[i+1]]` and per-pool usages `usage[noff[i]:noff[i+1]]` (D, M).
    Edge e joins `eu[e] < ev[e]`; its table, row-major |D_u| x |D_v|, is
    `binary[eoff[e]:eoff[e+1]]`. `empty` names a node whose domain emptied (None if none)."""

    keep: tuple[np.ndarray, ...]
    noff: np.ndarray
    unary: np.ndarray
    usage: np.ndarray
    eu: np.ndarray
    ev: np.ndarray
    eoff: np.ndarray
    binary: np.ndarray
    empty: int | None

    @property
    def num_nodes(self) -> int:
        return len(self.keep)

    @property
    def dom(self) -> np.ndarray:
        return np.diff(self.noff)

    def table(self, e: int) -> np.ndarray:
        """Edge e's table as a |D_u| x |D_v| view."""
        du, dv = len(self.keep[self.eu[e]]), len(self.keep[self.ev[e]])
        return self.binary[self.eoff[e] : self.eoff[e + 1]].reshape(du, dv)

    def choices(self, local: np.ndarray) -> tuple[int, ...]:
        """Domain indices as the Problem's strategy indices."""
        return tuple(int(k[x]) for k, x in zip(self.keep, local, strict=True))

    def local(self, choices: tuple[int, ...] | list[int]) -> np.ndarray | None:
        """The Problem's strategy indices as domain indices (None if one was pruned)."""
        out = np.empty(self.num_nodes, dtype=np.int64)
        for i, (k, c) in enumerate(zip(self.keep, choices, strict=True)):
            hit = np.flatnonzero(k == c)
            if len(hit) == 0:
                return None
            out[i] = hit[0]
        return out


def build_network(problem: Problem, deadline: Deadline | None = None) -> Network:
    """`problem` as a `Network` (see the module docstring); arc consistency stops early,
    still valid, when `deadline` passes."""
    n = problem.num_nodes
    alive = [np.isfinite(c) for c in problem.node_cost]
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True):
        a, b, tab = (u, v, t) if u < v else (v, u, t.T)
        if (a, b) in merged:
            merged[(a, b)] = merged[(a, b)] + tab
        else:
            merged[(a, b)] = np.asarray(tab, dtype=np.float64)
    pairs = sorted(merged)
    tables = [merged[p] for p in pairs]
    _arc_consistency(alive, pairs, tables, deadline)
    keep = tuple(np.flatnonzero(a) for a in alive)
    empty = next((i for i in range(n) if len(keep[i]) == 0), None)
    if empty is not None:  # keep one value so the arrays stay well formed
        keep = tuple(k if len(k) else np.zeros(1, dtype=np.int64) for k in keep)
    sizes = np.array([len(k) for k in keep], dtype=np.int64)
    noff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    unary = np.concatenate([c[k] for c, k in zip(problem.node_cost, keep, strict=True)])
    unary = np.where(np.isfinite(unary), unary, 0.0)  # only in an `empty` network
    if problem.usage is not None:
        pools = problem.usage[0].reshape(len(problem.usage[0]), -1).shape[1]
        usage = np.concatenate(
            [
                np.asarray(u, dtype=np.float64).reshape(len(u), -1)[k]
                for u, k in zip(problem.usage, keep, strict=True)
            ]
        ).reshape(-1, pools)
    else:
        usage = np.zeros((int(noff[-1]), 1))
    sub = [t[np.ix_(keep[a], keep[b])] for (a, b), t in zip(pairs, tables, strict=True)]
    eoff = np.concatenate([[0], np.cumsum([s.size for s in sub])]).astype(np.int64)
    binary = np.concatenate([s.ravel() for s in sub]) if sub else np.zeros(0)
    eu = np.array([p[0] for p in pairs], dtype=np.int64)
    ev = np.array([p[1] for p in pairs], dtype=np.int64)
    return Network(keep, noff, unary, usage, eu, ev, eoff, binary, empty)


def _arc_consistency(
    alive: list[np.ndarray],
    pairs: list[tuple[int, int]],
    tables: list[np.ndarray],
    deadline: Deadline | None,
) -> None:
    """Remove values without an allowed partner on some edge, until a fixpoint (AC-3 on the
    forbidden pairs, edge by edge)."""
    incident: dict[int, list[int]] = {}
    for e, (a, b) in enumerate(pairs):
        incident.setdefault(a, []).append(e)
        incident.setdefault(b, []).append(e)
    allowed = [np.isfinite(t) for t in tables]
    queue = list(range(len(pairs)))
    queued = set(queue)
    while queue:
        if deadline is not None and deadline.expired():
            return  # fewer removals: still a correct network
        e = queue.pop()
        queued.discard(e)
        a, b = pairs[e]
        ok = allowed[e][np.ix_(alive[a], alive[b])]
        for node, support in ((a, ok.any(axis=1)), (b, ok.any(axis=0))):
            if support.all():
                continue
            idx = np.flatnonzero(alive[node])
            alive[node][idx[~support]] = False
            if not alive[node].any():
                return
            for f in incident[node]:
                if f not in queued:
                    queued.add(f)
                    queue.append(f)
