"""Functional contraction of a cost function network: nodes whose value the forbidden pairs
fix, once a neighbour's value is known, folded into that neighbour.

On an edge (u, v) where every value of u has exactly one allowed partner f(a) in v's domain,
v is a function of u: any answer that avoids the forbidden pairs has x_v = f(x_u). v then
leaves the network: its unary costs join u's (u's value a pays v's cost at f(a) and the
edge's at (a, f(a))), and v's other edges become edges of u through f. Applied along a forest
of such edges (no cycles: a node has one parent), every tree becomes one node, its root, with
the root's domain; an edge between two nodes of one tree becomes a unary cost of the root
(forbidden values of the root leave its domain), edges between trees are summed per pair of
roots. The contracted network has the same optimum as the original for any unary costs
added later (the memory prices of `backends.wcsp.toulbar2`'s rounds), and its answers lift
back exactly: this is toulbar2's own "functional variable elimination" done once, in numpy,
instead of in each round's preprocessing (IOPDDL A: 23 of its 29 s of preprocessing per
round).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.wcsp.network import Network
from planner.deadline import Deadline

__all__ = ["Contraction", "contract"]

CHECK_EVERY = 2_000  # edges between two looks at the deadline


@dataclass(frozen=True, eq=False)
class Contraction:
    """A contracted network and how to go between it and the original.

    `net` is the contracted network: one node per tree, in the order of the trees' roots,
    whose values are the root's values that no edge inside its tree forbids, and whose unary
    costs are zero (`unary` gives them for any original costs).
    `slot[i]` is original node i's contracted node. For every original node i and every value
    k of its contracted node, `member_value[member_start[i] + k]` is i's flat value in the
    original and `member_target[...]` the contracted flat value it belongs to.
    """

    net: Network
    slot: np.ndarray
    member_start: np.ndarray
    member_value: np.ndarray
    member_target: np.ndarray
    intra: np.ndarray  # per contracted flat value: the costs of the edges inside its tree
    original_noff: np.ndarray
    removed: int  # nodes folded into others

    def unary(self, original: np.ndarray) -> np.ndarray:
        """Flat unary costs of the contracted network for the original's flat unary costs
        `original` (the original's costs plus any prices)."""
        out = np.bincount(
            self.member_target, weights=original[self.member_value], minlength=len(self.intra)
        )
        return out + self.intra

    def lift(self, labels: np.ndarray) -> np.ndarray:
        """A labelling of the contracted network (domain indices) as one of the original."""
        own = np.asarray(labels, dtype=np.int64)[self.slot]
        return self.member_value[self.member_start + own] - self.original_noff[:-1]


def _functions(net: Network) -> list[tuple[int, int, np.ndarray]]:
    """(u, v, f) for every edge direction where u's value fixes v's: f[a] = the only allowed
    value of v beside u's a (all edges at once, in flat arrays)."""
    dom = net.dom
    du, dv = dom[net.eu], dom[net.ev]
    m = len(net.eu)
    if m == 0:
        return []
    size = du * dv
    edge = np.repeat(np.arange(m), size)  # each table entry's edge
    pos = np.arange(len(net.binary)) - net.eoff[:-1][edge]
    row, col = pos // dv[edge], pos % dv[edge]
    ok = np.isfinite(net.binary)
    roff = np.concatenate([[0], np.cumsum(du)])  # global row ids: roff[e] + a
    coff = np.concatenate([[0], np.cumsum(dv)])
    rid, cid = roff[:-1][edge] + row, coff[:-1][edge] + col
    rcount = np.bincount(rid, weights=ok, minlength=int(roff[-1]))
    ccount = np.bincount(cid, weights=ok, minlength=int(coff[-1]))
    rarg = np.bincount(rid, weights=ok * col, minlength=int(roff[-1])).astype(np.int64)
    carg = np.bincount(cid, weights=ok * row, minlength=int(coff[-1])).astype(np.int64)
    # an edge is functional one way when every row (column) has exactly one allowed entry
    rows_ok = np.minimum.reduceat(rcount == 1, roff[:-1]) & (dv > 1)
    cols_ok = np.minimum.reduceat(ccount == 1, coff[:-1]) & (du > 1)
    out = []
    for e in np.flatnonzero(rows_ok | cols_ok):
        u, v = int(net.eu[e]), int(net.ev[e])
        if rows_ok[e]:
            out.append((u, v, rarg[roff[e] : roff[e + 1]]))
        if cols_ok[e]:
            out.append((v, u, carg[coff[e] : coff[e + 1]]))
    return out


def contract(net: Network, deadline: Deadline | None = None) -> Contraction | None:
    """`net` contracted along a forest of functional edges (module docstring); None if
    `deadline` passes first (it is looked at every CHECK_EVERY edges)."""
    n = net.num_nodes
    dom = net.dom
    parent = np.full(n, -1, dtype=np.int64)
    fmap: dict[int, np.ndarray] = {}
    top = np.arange(n)  # union-find: the tree's root

    def find(i: int) -> int:
        while top[i] != i:
            top[i] = top[top[i]]
            i = int(top[i])
        return i

    for u, v, f in _functions(net):
        if parent[v] >= 0 or find(u) == v:  # v has a parent, or u hangs below v: a cycle
            continue
        parent[v], fmap[v] = u, f
        top[v] = find(u)
    root = np.array([find(i) for i in range(n)], dtype=np.int64)
    # g[i]: root's domain index -> i's domain index, down each tree from its root
    children: dict[int, list[int]] = {}
    for w in np.flatnonzero(parent >= 0):
        children.setdefault(int(parent[w]), []).append(int(w))
    g: dict[int, np.ndarray] = {}
    roots = np.flatnonzero(root == np.arange(n))
    for r in roots:
        g[int(r)] = np.arange(int(dom[r]))
        stack = [int(r)]
        while stack:
            u = stack.pop()
            for v in children.get(u, []):
                g[v] = fmap[v][g[u]]
                stack.append(v)
    # edges inside a tree cost its root's values; forbidden ones remove them
    inner = {int(r): np.zeros(int(dom[r])) for r in roots}
    across: dict[tuple[int, int], np.ndarray] = {}
    for e in range(len(net.eu)):
        if e % CHECK_EVERY == 0 and deadline is not None and deadline.expired():
            return None
        u, v = int(net.eu[e]), int(net.ev[e])
        ru, rv = int(root[u]), int(root[v])
        t = net.table(e)
        if ru == rv:
            inner[ru] = inner[ru] + t[g[u], g[v]]
            continue
        tab = t[np.ix_(g[u], g[v])]
        key, tab = ((ru, rv), tab) if ru < rv else ((rv, ru), tab.T)
        across[key] = across[key] + tab if key in across else tab
    values = tuple(np.flatnonzero(np.isfinite(inner[int(r)])) for r in roots)
    # a tree none of whose values avoids every forbidden pair: no answer does (one value kept
    # so the arrays stay well formed, as in `build_network`)
    empty = next((j for j, k in enumerate(values) if len(k) == 0), None)
    values = tuple(k if len(k) else np.zeros(1, dtype=np.int64) for k in values)
    slot_of_root = np.full(n, -1, dtype=np.int64)
    slot_of_root[roots] = np.arange(len(roots))
    slot = slot_of_root[root]
    sizes = np.array([len(k) for k in values], dtype=np.int64)
    noff = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    intra = np.concatenate([inner[int(r)][k] for r, k in zip(roots, values, strict=True)])
    intra = np.where(np.isfinite(intra), intra, 0.0)  # only when a tree has no value left
    # every original node's value for each of its root's kept values
    member_value, member_target = [], []
    for i in range(n):
        s = int(slot[i])
        kept = values[s]
        member_value.append(net.noff[i] + g[i][kept])
        member_target.append(noff[s] + np.arange(len(kept)))
    starts = np.concatenate([[0], np.cumsum([len(m) for m in member_value])[:-1]])
    pairs = sorted(across)
    sub = [
        across[(a, b)][np.ix_(values[slot_of_root[a]], values[slot_of_root[b]])] for a, b in pairs
    ]
    eoff = np.concatenate([[0], np.cumsum([s.size for s in sub])]).astype(np.int64)
    binary = np.concatenate([s.ravel() for s in sub]) if sub else np.zeros(0)
    eu = np.array([slot_of_root[a] for a, _ in pairs], dtype=np.int64)
    ev = np.array([slot_of_root[b] for _, b in pairs], dtype=np.int64)
    size = int(noff[-1])
    small = Network(
        tuple(np.arange(len(k)) for k in values),
        noff, np.zeros(size), np.zeros((size, 1)), eu, ev, eoff, binary, empty,
    )  # fmt: skip
    return Contraction(
        small,
        slot,
        starts.astype(np.int64),
        np.concatenate(member_value).astype(np.int64),
        np.concatenate(member_target).astype(np.int64),
        intra,
        net.noff,
        int(n - len(roots)),
    )
