"""The additive objective (OptCNN Eq. 1) as a sparse linear program: the `ilp` encoding.

Built with numpy blocks (`backends.mathprog.linear`), one block per node, edge and memory pool, so an
800-node contest problem is encoded in about a second. On `backends.model.selection.Selection`:

- x[i, c] binary per allowed choice, sum_c x[i, c] = 1 (nodes with one choice are constants);
- per edge, over its groups of equal rows and columns (`selection.edge_groups`):
  "marginal" (default): y[g, h] in [0, 1] per finite group pair, sum_h y[g, h] = sum of x[u, a]
  over the choices a of row group g, and likewise for columns (the local marginal polytope,
  exact on trees); "implied": y[g, h] >= X[u, g] + X[v, h] - 1 for groups of positive cost
  only (valid since costs are >= 0; a weak LP) and X[u, g] + X[v, h] <= 1 for forbidden ones;
- memory, per pool: "rows" writes one row per binding check time (sum of usage above the
  smallest <= rhs); "chain" writes it as a running sum S_j = S_(j-1) + (usages entering at
  check time j) - (usages leaving), with S_j <= rhs_j: the same LP in O(n) terms, for
  problems whose explicit rows would hold many more terms (long-lived nodes appear in every
  row). "auto" picks (`selection.memory_form`).

`assignment` gives the column values of a choice vector (warm starts and tests) and
`positions` reads a solution back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from backends.mathprog.linear import LinearBuilder, LinearProgram
from backends.model.selection import Memory, Selection, memory_form
from planner.deadline import Clock

__all__ = [
    "AdditiveProgram",
    "EdgeColumns",
    "additive_program",
    "assignment",
    "positions",
]

EDGE_MODES = ("marginal", "implied")
MEMORY_FORMS = ("auto", "rows", "chain")


@dataclass(frozen=True)
class EdgeColumns:
    """An edge's groups and the column of each group pair's y (-1: none)."""

    rows: np.ndarray
    cols: np.ndarray
    pair: np.ndarray


@dataclass(frozen=True)
class AdditiveProgram:
    program: LinearProgram
    scale: float  # objective units per real unit
    offset: float  # scaled objective of the single-choice nodes (not in the program)
    x: tuple[np.ndarray | None, ...]  # per node, the columns of its allowed choices
    edges: tuple[EdgeColumns, ...]
    mode: str
    memory: str  # "rows", "chain" or "none"
    chains: tuple[tuple[np.ndarray, float], ...]  # per pool in chain form: S columns, norm


def additive_program(
    sel: Selection,
    scale: float,
    mode: str = "marginal",
    memory: str = "auto",
    deadline: float = math.inf,
) -> AdditiveProgram:
    """The linear program of `sel` with its objective multiplied by `scale` (OutOfTime past
    `deadline`, a perf_counter value, looked at between edges and memory pools)."""
    clock = Clock(deadline)
    if mode not in EDGE_MODES or memory not in MEMORY_FORMS:
        raise ValueError(f"edges must be one of {EDGE_MODES} and memory one of {MEMORY_FORMS}")
    b = LinearBuilder()
    x: list[np.ndarray | None] = []
    offset = 0.0
    for c in sel.node_cost:
        if len(c) == 1:
            x.append(None)
            offset += float(c[0]) * scale
        else:
            x.append(b.columns(c * scale, integer=True))
    multi = [cols for cols in x if cols is not None]
    if multi:
        sizes = [len(cols) for cols in multi]
        b.rows(np.repeat(np.arange(len(multi)), sizes), np.concatenate(multi), 1.0, "E", 1.0)
    edges = []
    for e, (u, v) in enumerate(sel.edges):
        clock.tick()
        edges.append(_edge(b, x[u], x[v], sel.groups(e), scale, mode))
    form = "none"
    chains: list[tuple[np.ndarray, float]] = []
    if sel.memory:
        form = memory_form(sel, memory)
        for m in sel.memory:
            clock.check()
            if form == "rows":
                _memory_rows(b, m, x)
            else:
                chains.append(_memory_chain(b, m, x))
    clock.check()
    return AdditiveProgram(
        b.build(), scale, offset, tuple(x), tuple(edges), mode, form, tuple(chains)
    )


def _edge(
    b: LinearBuilder,
    xu: np.ndarray | None,
    xv: np.ndarray | None,
    grouped: tuple[np.ndarray, np.ndarray, np.ndarray],
    scale: float,
    mode: str,
) -> EdgeColumns:
    assert xu is not None and xv is not None  # selection folds edges with a single-choice end
    rows, cols, table = grouped
    gu, gv = table.shape
    finite = np.isfinite(table)
    pair = np.full(table.shape, -1, dtype=np.int64)
    if mode == "marginal":
        g, h = np.nonzero(finite)
        y = b.columns(table[g, h] * scale, integer=False)
        pair[g, h] = y
        # row group g: sum_h y[g, h] - sum_{a in g} x[u, a] = 0; then the column groups
        r = np.concatenate([g, rows, gu + h, gu + cols])
        c = np.concatenate([y, xu, y, xv])
        val = np.concatenate(
            [np.ones(len(y)), -np.ones(len(xu)), np.ones(len(y)), -np.ones(len(xv))]
        )
        b.rows(r, c, val, "E", 0.0, count=gu + gv)
        return EdgeColumns(rows, cols, pair)
    g, h = np.nonzero(finite & (table > 0))
    y = b.columns(table[g, h] * scale, integer=False)
    pair[g, h] = y
    # y - X[u, g] - X[v, h] >= -1, each X a sum over the group's choices
    r, c, val = _group_terms(np.arange(len(y)), g, h, rows, cols, xu, xv, -1.0)
    b.rows(np.concatenate([np.arange(len(y)), r]), np.concatenate([y, c]),
           np.concatenate([np.ones(len(y)), val]), "G", -1.0, count=len(y))  # fmt: skip
    fg, fh = np.nonzero(~finite)
    r, c, val = _group_terms(np.arange(len(fg)), fg, fh, rows, cols, xu, xv, 1.0)
    b.rows(r, c, val, "L", 1.0, count=len(fg))
    return EdgeColumns(rows, cols, pair)


def _group_terms(
    row: np.ndarray, g: np.ndarray, h: np.ndarray, rows: np.ndarray, cols: np.ndarray,
    xu: np.ndarray, xv: np.ndarray, sign: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Terms sign * (X[u, g] + X[v, h]) for each listed row."""
    members_u = [np.flatnonzero(rows == k) for k in range(rows.max() + 1)]
    members_v = [np.flatnonzero(cols == k) for k in range(cols.max() + 1)]
    parts_r, parts_c = [], []
    for r_, g_, h_ in zip(row.tolist(), g.tolist(), h.tolist(), strict=True):
        cu, cv = xu[members_u[g_]], xv[members_v[h_]]
        parts_c += [cu, cv]
        parts_r.append(np.full(len(cu) + len(cv), r_))
    if not parts_r:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    c = np.concatenate(parts_c)
    return np.concatenate(parts_r), c, np.full(len(c), sign)


def _memory_rows(b: LinearBuilder, m: Memory, x: list[np.ndarray | None]) -> None:
    """One row per binding check time, each normalized by its largest number."""
    for t, ks in m.rows():
        cols = [x[m.nodes[k]] for k in ks]
        coefs = [m.coef[k] for k in ks]
        norm = max(float(m.rhs[t]), max(float(c.max()) for c in coefs), 1e-300)
        c = np.concatenate([col for col in cols if col is not None])
        v = np.concatenate([cf for col, cf in zip(cols, coefs, strict=True) if col is not None])
        b.rows(np.zeros(len(c), dtype=np.int64), c, v / norm, "L", m.rhs[t] / norm, count=1)


def _memory_chain(
    b: LinearBuilder, m: Memory, x: list[np.ndarray | None]
) -> tuple[np.ndarray, float]:
    """S_j = S_(j-1) + entering - leaving, S_j <= rhs_j where it can bind (normalized)."""
    T = m.num_times
    norm = max(float(m.rhs.max()), 1e-300)
    s = b.columns(np.zeros(T), integer=False, upper=np.inf)
    listed = [k for k in range(len(m.nodes)) if x[m.nodes[k]] is not None]
    cols = [x[m.nodes[k]] for k in listed]
    coef = [m.coef[k] / norm for k in listed]
    sizes = np.array([len(c) for c in coef], dtype=np.int64)
    first = np.repeat(m.first[listed], sizes)
    last = np.repeat(m.last[listed], sizes)
    c = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    v = np.concatenate(coef) if coef else np.zeros(0)
    leaving = last < T
    r = np.concatenate([np.arange(T), np.arange(1, T), first, last[leaving]])
    col = np.concatenate([s, s[:-1], c, c[leaving]])
    val = np.concatenate([np.ones(T), -np.ones(T - 1), -v, v[leaving]])
    b.rows(r, col, val, "E", 0.0, count=T)
    # the bound S_j <= rhs_j as a row (CBC's presolve turns it into a column bound)
    bind = np.flatnonzero(m.binding)
    b.rows(np.arange(len(bind)), s[bind], 1.0, "L", m.rhs[bind] / norm, count=len(bind))
    return s, norm


def assignment(ap: AdditiveProgram, sel: Selection, pos: list[int]) -> np.ndarray:
    """The value of every column for a position per node."""
    out = np.zeros(ap.program.num_columns)
    for cols, k in zip(ap.x, pos, strict=True):
        if cols is not None:
            out[cols[k]] = 1.0
    for (u, v), e in zip(sel.edges, ap.edges, strict=True):
        col = e.pair[e.rows[pos[u]], e.cols[pos[v]]]
        if col >= 0:
            out[col] = 1.0
    for m, (s, norm) in zip(sel.memory if ap.chains else (), ap.chains, strict=True):
        use = np.array([c[pos[i]] for i, c in zip(m.nodes, m.coef, strict=True)]) / norm
        running = np.cumsum(
            np.bincount(m.first, use, minlength=m.num_times + 1)
            - np.bincount(m.last, use, minlength=m.num_times + 1)
        )
        out[s] = running[: m.num_times]
    return out


def positions(ap: AdditiveProgram, values: np.ndarray) -> list[int]:
    """A position per node from column values (the largest x of each node)."""
    return [0 if cols is None else int(np.argmax(values[cols])) for cols in ap.x]
