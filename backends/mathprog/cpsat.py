"""`cpsat`: OR-Tools CP-SAT on both objectives, as encode / solve / decode.

Additive (OptCNN Eq. 1) on `backends.model.selection.Selection`: a Boolean x[i, c] per allowed
choice with ExactlyOne per node; each remaining edge gets a Boolean y[e, a, b] per finite
pair, tied to its ends by row and column sums (sum_b y[e, a, b] = x[u, a], sum_a y[e, a, b]
= x[v, b]: the local marginal polytope, exact on trees, so the LP bound is strong), or with
the setting edges "implied" only y >= x[u, a] + x[v, b] - 1 for pairs of positive cost (fewer
constraints, a weak LP; settings: `CpsatSettings`, given as `SolveOptions.extra`). Forbidden
pairs get no y (or a clause); memory rows are linear.

CP-SAT needs integers: costs are multiplied by a power of two S (1 when they are integers
already) and rounded down, so every encoded objective is <= S x the real one and the solver's
bound / S is a proven bound in real units; the answer is at most (nodes + edges) / S worse
than the real optimum (`stats["rounding_slack"]`, ~1e-12 relative). Memory usages are exact
when integral, else rounded up with the limit rounded down (never accepts too much memory).

Makespan (DLPlacer Eqs. 7-13) on `backends.placement.problem.PlacementProblem`: a Boolean P[k, d] per
node and allowed device (ExactlyOne, Eq. 7); a start per task; per device an optional
interval per task that takes time there, with NoOverlap (Eq. 12) ("fifo": the program order
instead, as conditional precedences); precedences with the route's transfer delay enforced
when producer and consumer are apart (Eqs. 10-11, routes precomputed: without link
contention the best route of each tensor does not depend on the others, so Eqs. 8-9's
routing variables are not needed); memory rows (Eq. 13); makespan >= every sink's end and
>= every device's load; lexicographic-leader constraints over the device symmetries. Times
are integers in units of 1/S s, rounded up, so decoded schedules are valid in real time.

Seeds and warm starts: random_seed = seed, num_workers = threads; a hint from
SolveOptions.warm_start (additive: the choices; makespan: a single-device placement,
canonicalized under the symmetries) or else from a construction heuristic
(`seed_choices` / `greedy_placement`); `stats["hint"]` says which.

What does not depend on the solver (warm starts, the time limit while encoding, the makespan
solve's wrapper, the Backend class body) is shared with `ilp` in `backends.mathprog.common`.
"""

from __future__ import annotations

import math
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ortools.sat.python import cp_model

from backends.base import (
    BackendError,
    Limit,
    ProgressLog,
    SolveOptions,
    SolveResult,
    Status,
    stop_requested,
)
from backends.mathprog.additive_lp import additive_program
from backends.mathprog.common import (
    CpsatSettings,
    SolverBackend,
    SolverSteps,
    Warm,
    placement_result,
    rounded_lp_start,
)
from backends.mathprog.linear import write_mps
from backends.mathprog.lns import SubRun
from backends.model.selection import Selection, memory_form
from backends.placement.problem import (
    PlacementOutcome,
    PlacementProblem,
    Schedule,
    horizon,
    lex_symmetries,
    list_schedule,
    placement_lower_bound,
    retime,
)
from backends.trace import offer_answer
from planner.deadline import Clock, OutOfTime
from planner.problems.problem import Problem

__all__ = ["CpsatBackend", "CpsatModel", "CpsatSettings", "decode", "encode", "solve_encoded"]

COST_BITS = 52  # the sum of every encoded cost coefficient stays below 2**COST_BITS
TIME_BITS = 30  # the makespan upper bound is about 2**TIME_BITS time units (larger values
# made CP-SAT 9.15's presolve return wrong optima on small placement problems)
SYMMETRY_DEPTH = 64  # nodes covered by the lexicographic-leader constraints
ALWAYS = True  # a literal fixed to true (a node with one allowed choice or device)
LP_FRACTION = 0.3  # of the time left, at most, for the LP-rounding hint (GLOP)
LP_SECONDS_PER_TERM = 1e-5  # GLOP's dual simplex on the root LP of an additive model


@dataclass
class CpsatModel:
    """An encoded problem: the CP-SAT model and what decoding needs."""

    objective: str
    model: cp_model.CpModel
    scale: float  # integer units per real unit
    sel: Selection | None = None
    x: list[list[Any]] = field(default_factory=list)  # per node, per allowed choice (or device)
    y: list[list[tuple[int, int, Any]]] = field(default_factory=list)  # per edge: (a, b, var)
    pp: PlacementProblem | None = None
    order: str = "free"
    start: list[Any] = field(default_factory=list)
    makespan: Any = None
    slack: float = 0.0  # real units the rounding can hide
    hint: str | None = None  # where the hint came from: "warm_start", "heuristic" or None
    warm: tuple[int, ...] | None = None  # the hinted choice vector (additive)
    presolve: bool = True
    edge_groups: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # additive
    encoder: Any = None  # the additive model's _Encoder (to hint it again)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class CpsatRun:
    status: str
    values: dict[str, Any]
    bound: float | None  # integer units
    wall: float
    timed_out: bool
    lp: dict[str, Any] = field(default_factory=dict)  # the LP-rounding hint's figures


# ------------------------------------------------------------------------------ encode


def _int_costs(tables: list[np.ndarray]) -> float:
    """The power-of-two scale of the cost tables (1 when integral and small enough)."""
    finite = [t[np.isfinite(t)] for t in tables]
    total = float(sum(np.abs(f).sum() for f in finite))
    if total < 2.0**COST_BITS and all((f == np.floor(f)).all() for f in finite):
        return 1.0
    return 2.0 ** math.floor(math.log2(2.0**COST_BITS / max(total, 1e-300)))


class _Encoder:
    """Builds the additive model: x per choice, the edge encoding, memory, objective."""

    def __init__(self, m: cp_model.CpModel, out: CpsatModel, groups: bool):
        self.m, self.out, self.groups = m, out, groups
        self.terms: list[Any] = []
        self.coefs: list[int] = []
        self.const = 0
        self._sums: dict[tuple[int, bytes], list[Any]] = {}
        self.new_groups: list[tuple[Any, int, np.ndarray, int]] = []  # (z, node, rows, group)

    def group_literals(self, node: int, rows: np.ndarray) -> list[Any]:
        """Per group of node's choices: a literal true when the node's choice is in it (the
        choice's own x for a group of one, else a new Boolean equal to their sum); shared by
        every edge that groups the node's choices alike."""
        key = (node, rows.tobytes())
        if key not in self._sums:
            xs = self.out.x[node]
            lits = []
            for g in range(int(rows.max()) + 1):
                members = [xs[a] for a in np.flatnonzero(rows == g)]
                if len(members) == 1:
                    lits.append(members[0])
                else:
                    z = self.m.new_bool_var("")
                    self.m.add(sum(members) == z)
                    lits.append(z)
                    self.new_groups.append((z, node, rows, g))
            self._sums[key] = lits
        return self._sums[key]

    def edge(self, e: int, mode: str) -> list[tuple[int, int, Any]]:
        sel = self.out.sel
        assert sel is not None
        (u, v), t = sel.edges[e], sel.edge_cost[e]
        if self.groups and mode != "plain":
            rows, cols, table = sel.groups(e)
        else:
            rows, cols, table = np.arange(t.shape[0]), np.arange(t.shape[1]), t
        self.out.edge_groups.append((rows, cols))
        zu, zv = self.group_literals(u, rows), self.group_literals(v, cols)
        finite = np.isfinite(table)
        it = np.where(finite, np.floor(np.where(finite, table, 0) * self.out.scale), -1)
        it = it.astype(np.int64)
        ys: list[tuple[int, int, Any]] = []
        m = self.m
        if mode == "marginal":
            by_row: list[list[Any]] = [[] for _ in zu]
            by_col: list[list[Any]] = [[] for _ in zv]
            for g, h in zip(*np.nonzero(finite), strict=True):
                y = m.new_bool_var("")
                ys.append((int(g), int(h), y))
                by_row[g].append(y)
                by_col[h].append(y)
                if it[g, h]:
                    self.terms.append(y)
                    self.coefs.append(int(it[g, h]))
            for z, ones in [*zip(zu, by_row, strict=True), *zip(zv, by_col, strict=True)]:
                m.add(sum(ones) == z)
            return ys
        for g, h in zip(*np.nonzero(~finite | (it > 0)), strict=True):
            if not finite[g, h]:
                m.add_bool_or([zu[g].Not(), zv[h].Not()])
                continue
            y = m.new_bool_var("")
            ys.append((int(g), int(h), y))
            m.add_bool_or([zu[g].Not(), zv[h].Not(), y])  # y >= x_u + x_v - 1
            if mode == "plain":  # y = x_u * x_v exactly (the pairwise product)
                m.add_implication(y, zu[g])
                m.add_implication(y, zv[h])
            self.terms.append(y)
            self.coefs.append(int(it[g, h]))
        return ys


def encode_selection(
    sel: Selection,
    options: SolveOptions,
    settings: CpsatSettings,
    warm: Warm | None = None,
    deadline: float = math.inf,
) -> CpsatModel:
    """The additive selection model (see the module docstring); `warm` is a valid choice
    vector and where it came from, hinted to the solver."""
    mode, memory = settings.edges, settings.memory
    clock = Clock(deadline)
    m = cp_model.CpModel()
    scale = _int_costs([*sel.node_cost, *sel.edge_cost])
    out = CpsatModel("additive", m, scale, sel=sel)
    if sel.infeasible:
        m.add_bool_or([])  # the reductions proved it: an empty clause
        return out
    enc = _Encoder(m, out, groups=settings.groups)
    for c in sel.node_cost:
        ic = np.floor(c * scale).astype(np.int64)
        if len(c) == 1:
            out.x.append([ALWAYS])
            enc.const += int(ic[0])
            continue
        xs = [m.new_bool_var("") for _ in c]
        m.add_exactly_one(xs)
        out.x.append(xs)
        enc.terms += xs
        enc.coefs += ic.tolist()
        clock.tick()
    for e in range(len(sel.edges)):
        out.y.append(enc.edge(e, mode))
        for _ in range(1 + len(out.y[-1]) // 16):
            clock.tick()
    clock.check()
    form = _selection_memory(m, sel, out.x, memory, clock) if sel.memory else "none"
    clock.check()
    m.minimize(cp_model.LinearExpr.weighted_sum(enc.terms, enc.coefs) + enc.const)
    exact = scale == 1.0 and all(
        (t[np.isfinite(t)] == np.floor(t[np.isfinite(t)])).all()
        for t in (*sel.node_cost, *sel.edge_cost)
    )
    out.slack = 0.0 if exact else (sel.num_nodes + len(sel.edges)) / scale
    npairs = sum(len(ys) for ys in out.y)
    out.presolve = settings.presolve
    out.stats = {
        "edges": mode,
        "edge_variables": npairs,
        "memory_form": form,
        "memory_rows": int(sum(mm.binding.sum() for mm in sel.memory)),
    }
    out.encoder = enc
    if warm is not None:
        clock.check()
        _hint_selection(m, out, warm[0], enc)
        out.hint, out.warm = warm[1], warm[0]
    clock.check()
    return out


def _selection_memory(
    m: cp_model.CpModel, sel: Selection, x: list[list[Any]], form: str, clock: Clock
) -> str:
    """The memory rule as explicit rows per binding check time, or as a running sum of
    integer variables (linear size, for many long-lived nodes); returns the form used."""
    coefs = [c for mem in sel.memory for c in mem.coef]
    integral = all((c == np.floor(c)).all() for c in coefs)
    total = float(sum(c.max() for c in coefs)) if coefs else 0.0
    f = 1.0 if integral and total < 2.0**60 else 2.0 ** math.floor(math.log2(2.0**50 / total))
    form = memory_form(sel, form)
    for mem in sel.memory:
        ic = [np.ceil(c * f).astype(np.int64) for c in mem.coef]
        rhs = np.floor(mem.rhs * f).astype(np.int64)
        if form == "rows":
            for t, ks in mem.rows():
                clock.tick()
                terms = [lit for k in ks for lit in x[mem.nodes[k]]]
                ws = [w for k in ks for w in ic[k].tolist()]
                m.add(cp_model.LinearExpr.weighted_sum(terms, ws) <= int(rhs[t]))
            continue
        use = [cp_model.LinearExpr.weighted_sum(x[i], w.tolist()) for i, w in
               zip(mem.nodes, ic, strict=True)]  # fmt: skip
        entering: list[list[int]] = [[] for _ in range(mem.num_times)]
        leaving: list[list[int]] = [[] for _ in range(mem.num_times)]
        for k, (a, b) in enumerate(zip(mem.first.tolist(), mem.last.tolist(), strict=True)):
            entering[a].append(k)
            if b < mem.num_times:
                leaving[b].append(k)
        top = int(sum(int(w.max()) for w in ic))
        prev: Any = 0
        for t in range(mem.num_times):
            s = m.new_int_var(0, int(rhs[t]) if mem.binding[t] else top, "")
            m.add(s == prev + sum(use[k] for k in entering[t]) - sum(use[k] for k in leaving[t]))
            prev = s
    return form


def _hint_selection(
    m: cp_model.CpModel, out: CpsatModel, choices: tuple[int, ...], enc: _Encoder
) -> None:
    """A complete hint: every x, group literal and pair variable (the memory sums follow)."""
    assert out.sel is not None
    pos = out.sel.positions(choices)
    if pos is None:
        return
    for xs, k in zip(out.x, pos, strict=True):
        if len(xs) > 1:
            for j, var in enumerate(xs):
                m.add_hint(var, j == k)
    for z, node, rows, g in enc.new_groups:
        m.add_hint(z, bool(rows[pos[node]] == g))
    for (u, v), (rows, cols), ys in zip(out.sel.edges, out.edge_groups, out.y, strict=True):
        gu, gv = rows[pos[u]], cols[pos[v]]
        for g, h, var in ys:
            m.add_hint(var, g == gu and h == gv)


def encode_placement(
    pp: PlacementProblem,
    options: SolveOptions,
    settings: CpsatSettings,
    warm: tuple[Schedule, str] | None = None,
    deadline: float = math.inf,
) -> CpsatModel:
    """DLPlacer's placement model (see the module docstring)."""
    order = settings.order
    clock = Clock(deadline)
    top = warm[0].makespan if warm and warm[0].makespan > 0 else horizon(pp)
    # a zero makespan (every task free, no transfer): any scale serves, and 2**TIME_BITS /
    # 1e-300 would overflow (tasks of zero duration on a random heterogeneous cluster)
    scale = 2.0 ** math.floor(math.log2(2.0**TIME_BITS / top)) if top > 0 else 1.0
    dur, delay = pp.scaled(scale)
    span_max = int(dur.max(axis=1).sum() + delay.max(axis=(1, 2)).sum()) + 1
    m = cp_model.CpModel()
    out = CpsatModel("makespan", m, scale, pp=pp, order=order)
    allowed = pp.allowed
    for k in range(pp.num_nodes):
        ds = np.flatnonzero(allowed[k])
        lits: list[Any] = [None] * pp.num_devices
        if len(ds) == 1:
            lits[ds[0]] = ALWAYS
        else:
            for dv in ds:
                lits[dv] = m.new_bool_var("")
            m.add_exactly_one([lits[dv] for dv in ds])
        out.x.append(lits)
    start = [m.new_int_var(0, span_max, "") for _ in range(pp.num_tasks)]
    out.start = start
    ends = [_end(out, t, dur) for t in range(pp.num_tasks)]
    node = pp.task_node
    for p, (x, y) in enumerate(pp.prec):
        m.add(start[y] >= ends[x])
        if node[x] == node[y]:
            continue
        for a, b in zip(*np.nonzero(delay[p]), strict=True):
            lits = [out.x[node[x]][a], out.x[node[y]][b]]
            if lits[0] is None or lits[1] is None:
                continue
            # x is on a here, so its end is start + dur[x, a] (no literal in the expression)
            gap = int(dur[x, a] + delay[p, a, b])
            m.add(start[y] >= start[x] + gap).only_enforce_if(
                [lit for lit in lits if lit is not ALWAYS]
            )
            clock.tick()
    for d in range(pp.num_devices):
        intervals = []
        for t in range(pp.num_tasks):
            lit = out.x[node[t]][d]
            if lit is None or dur[t, d] == 0:
                continue
            if lit is ALWAYS:
                intervals.append(m.new_fixed_size_interval_var(start[t], int(dur[t, d]), ""))
            else:
                intervals.append(
                    m.new_optional_fixed_size_interval_var(start[t], int(dur[t, d]), lit, "")
                )
        m.add_no_overlap(intervals)
    _cumulative(m, pp, start, dur)
    if order == "fifo":
        for x, y in pp.exclusive_pairs("fifo"):
            first, second = (x, y) if pp.order_key[x] <= pp.order_key[y] else (y, x)
            for shared in np.flatnonzero(allowed[node[x]] & allowed[node[y]]):
                lits = [out.x[node[first]][shared], out.x[node[second]][shared]]
                gap = int(dur[first, shared])
                m.add(start[second] >= start[first] + gap).only_enforce_if(
                    [lit for lit in dict.fromkeys(lits) if lit is not ALWAYS]
                )
                clock.tick()
    span = m.new_int_var(0, span_max, "makespan")
    out.makespan = span
    sinks = set(range(pp.num_tasks)) - {int(x) for x in pp.prec[:, 0]}
    for t in sorted(sinks):
        m.add(span >= ends[t])
    for dev in range(pp.num_devices):
        load = [(out.x[node[t]][dev], int(dur[t, dev])) for t in range(pp.num_tasks)]
        load = [(lit, w) for lit, w in load if lit is not None and w > 0]
        m.add(span >= sum(w if lit is ALWAYS else w * lit for lit, w in load))
    _placement_memory(m, pp, out.x)
    _lex_leader(m, pp, out.x, clock)
    m.minimize(span)
    n_items = pp.num_tasks + len(pp.prec)
    out.slack = n_items / scale
    out.stats = {
        "order": order,
        "routing": pp.routing,
        "symmetries": len(pp.symmetries),
        "symmetries_broken": len(lex_symmetries(pp)),
    }
    if warm is not None:
        _hint_placement(m, out, warm[0], dur, delay)
        out.hint = warm[1]
    return out


def _cumulative(
    m: cp_model.CpModel, pp: PlacementProblem, start: list[Any], dur: np.ndarray
) -> None:
    """Redundant: all tasks at their shortest duration on D devices at once (a relaxation
    whose energetic reasoning bounds the makespan far better than the precedences alone)."""
    shortest = np.where(pp.allowed[pp.task_node], dur, np.iinfo(np.int64).max).min(axis=1)
    busy = [t for t in range(pp.num_tasks) if shortest[t] > 0]
    intervals = [m.new_fixed_size_interval_var(start[t], int(shortest[t]), "") for t in busy]
    m.add_cumulative(intervals, [1] * len(busy), pp.num_devices)


def _end(out: CpsatModel, t: int, dur: np.ndarray) -> Any:
    assert out.pp is not None
    lits = out.x[out.pp.task_node[t]]
    ds = [d for d, lit in enumerate(lits) if lit is not None]
    if len({int(dur[t, d]) for d in ds}) == 1:
        return out.start[t] + int(dur[t, ds[0]])
    return out.start[t] + sum(int(dur[t, d]) * lits[d] for d in ds)


def _placement_memory(m: cp_model.CpModel, pp: PlacementProblem, x: list[list[Any]]) -> None:
    for row in pp.memory:
        integral = bool((row.coef == np.floor(row.coef)).all())
        total = float(row.coef.max(axis=1).sum())
        f = 1.0 if integral and total < 2.0**60 else 2.0 ** math.floor(math.log2(2.0**50 / total))
        rhs = math.floor(row.limit * (1 + 1e-9) * f)
        terms, ws = [], []
        for k, d in zip(*np.nonzero(row.coef), strict=True):
            lit, w = x[k][d], int(math.ceil(row.coef[k, d] * f))
            if lit is None:
                continue
            if lit is ALWAYS:
                rhs -= w
            else:
                terms.append(lit)
                ws.append(w)
        m.add(cp_model.LinearExpr.weighted_sum(terms, ws) <= rhs)


def _lex_leader(
    m: cp_model.CpModel, pp: PlacementProblem, x: list[list[Any]], clock: Clock
) -> None:
    """For every symmetry sigma of `lex_symmetries`: the placement is lexicographically <=
    its image, truncated to the first SYMMETRY_DEPTH nodes. f_k: every node before k is on a
    device sigma fixes."""

    def clause(*lits: Any) -> None:  # (not a) or (not b) ..., skipping literals always true
        m.add_bool_or([lit.Not() for lit in lits if lit is not ALWAYS])
        clock.tick()

    for sigma in lex_symmetries(pp):
        fixed = [d for d in range(pp.num_devices) if sigma[d] == d]
        f: Any = ALWAYS
        for k in range(min(pp.num_nodes, SYMMETRY_DEPTH)):
            for b in range(pp.num_devices):
                if sigma[b] < b and x[k][b] is not None:
                    clause(f, x[k][b])  # f_k and d_k = b would make the image smaller
            if not fixed:
                break
            nxt = m.new_bool_var("")
            for a in fixed:
                if x[k][a] is not None:
                    clause(f, x[k][a], nxt.Not())  # f_k and d_k = a imply f_k+1
            f = nxt


def _hint_placement(
    m: cp_model.CpModel, out: CpsatModel, warm: Schedule, dur: np.ndarray, delay: np.ndarray
) -> None:
    assert out.pp is not None
    pp = out.pp
    for k, d in enumerate(warm.placement):
        for e, lit in enumerate(out.x[k]):
            if lit is not None and lit is not ALWAYS:
                m.add_hint(lit, e == d)
    priority = sorted(range(pp.num_tasks), key=lambda t: (warm.start[t], t))
    timed = list_schedule(pp, warm.placement, out.order, priority, dur, delay)
    for t, var in enumerate(out.start):
        m.add_hint(var, int(timed.start[t]))
    m.add_hint(out.makespan, int(timed.end.max()))


# ------------------------------------------------------------------------------- solve


_STATUS = {
    cp_model.OPTIMAL: "OPTIMAL",
    cp_model.FEASIBLE: "FEASIBLE",
    cp_model.INFEASIBLE: "INFEASIBLE",
    cp_model.UNKNOWN: "UNKNOWN",
    cp_model.MODEL_INVALID: "MODEL_INVALID",
}


_DEFAULTS: dict[str, dict[str, Any]] = {"additive": {}}  # CP-SAT parameters per objective
WATCH_SECONDS = 0.05  # how often a running solve looks for a stop request


def _watch(solver: cp_model.CpSolver, done: threading.Event, stop: Any) -> None:
    """Stop the search when the user asks (Ctrl-C) or `stop` (an Event) is set."""
    while not done.wait(WATCH_SECONDS):
        if stop_requested() or (stop is not None and stop.is_set()):
            solver.stop_search()
            return


class _Report(cp_model.CpSolverSolutionCallback):
    """Each improving solution: a throttled progress line, and for the additive objective
    its choices to `on_incumbent(choices, "cpsat")` when the caller gave one."""

    def __init__(self, model: CpsatModel, on_incumbent: Any):
        super().__init__()
        self.model, self.on_incumbent = model, on_incumbent
        self.progress = ProgressLog("cpsat")

    def on_solution_callback(self) -> None:
        value = self.objective_value / self.model.scale
        self.progress(
            lambda: f"best {value:.6g}, bound {self.best_objective_bound / self.model.scale:.6g}"
        )
        sel = self.model.sel
        if self.on_incumbent is None or sel is None:
            return
        # the value is known: the choices are read (O(variables)) only when someone needs
        # them, not for the anytime trace alone (`backends.trace.offer_answer`)
        offer_answer(self.on_incumbent, value, "cpsat", lambda: sel.choices(self._positions()))

    def _positions(self) -> list[int]:
        return [
            0 if len(xs) == 1 else next(j for j, lit in enumerate(xs) if self.boolean_value(lit))
            for xs in self.model.x
        ]


def solve_encoded(
    model: CpsatModel,
    options: SolveOptions,
    settings: CpsatSettings,
    seconds: float,
    until: float = math.inf,
) -> CpsatRun:
    """Run CP-SAT for at most `seconds` with options.seed and options.threads
    (additive: first the LP-rounding hint, `_lp_hint`, unless `settings.lp_start` is False),
    the search itself ending by `until` (a `time.perf_counter()` value) at the latest."""
    start = time.perf_counter()
    lp: dict[str, Any] = {}
    sel = model.sel
    additive = model.objective == "additive" and sel is not None and not sel.infeasible
    if additive and settings.lp_start:
        lp = _lp_hint(model, options, start + seconds)
    now = time.perf_counter()
    # the search alone may have to end earlier (`SolverBackend`: the neighbourhoods follow)
    seconds = min(seconds - (now - start), until - now)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(seconds, 1e-3)
    solver.parameters.num_workers = options.threads
    solver.parameters.random_seed = options.seed
    solver.parameters.cp_model_presolve = model.presolve
    # Python's handler takes a Ctrl-C (the stop request `_watch` ends the search with): CP-SAT's
    # own would swallow it, and the phases after this solve would run on
    solver.parameters.catch_sigint_signal = False
    # CP-SAT stops with OPTIMAL once |objective - bound| <= relative_gap_limit * |objective|
    # (sat_parameters.proto): r / (1 + r) keeps objective / bound - 1 <= r
    r = options.gap_tolerance
    solver.parameters.relative_gap_limit = r / (1 + r)
    on_bound = options.channel.on_bound
    if on_bound is not None and model.objective == "additive":  # in real units (the portfolio)
        solver.best_bound_callback = lambda bound: on_bound(bound / model.scale, "cpsat")
    if options.threads > 1:
        solver.parameters.interleave_search = settings.interleave
    for key, value in {**_DEFAULTS.get(model.objective, {}), **settings.parameters}.items():
        try:
            setattr(solver.parameters, key, value)
        except (AttributeError, TypeError, ValueError) as exc:
            raise BackendError(f"cpsat parameter {key}={value!r}: {exc}") from None
    start = time.perf_counter()
    report = _Report(model, options.channel.on_incumbent)
    stop = options.channel.stop  # an Event another thread or process may set
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(solver, done, stop), daemon=True)
    watcher.start()
    handler = _sigint_handler()
    try:
        code = solver.solve(model.model, report)
    finally:
        done.set()
        watcher.join()
        _restore_sigint(handler)
    wall = time.perf_counter() - start
    status = _STATUS.get(code, "UNKNOWN")
    if status == "MODEL_INVALID":
        raise BackendError(f"cpsat built an invalid model: {model.model.validate()}")
    values: dict[str, Any] = {}
    if status in ("OPTIMAL", "FEASIBLE"):
        values["x"] = [
            [lit if lit is None or lit is ALWAYS else solver.boolean_value(lit) for lit in xs]
            for xs in model.x
        ]
        values["objective"] = solver.objective_value
        if model.objective == "makespan":
            values["start"] = [solver.value(s) for s in model.start]
    bound = solver.best_objective_bound if status != "INFEASIBLE" else None
    if bound is not None and "lp_bound" in lp:
        bound = max(bound, math.floor(lp["lp_bound"] * model.scale))  # integer units
    timed_out = status in ("FEASIBLE", "UNKNOWN")
    return CpsatRun(status, values, bound, wall, timed_out, lp)


def _lp_hint(model: CpsatModel, options: SolveOptions, deadline: float) -> dict[str, Any]:
    """The additive model's LP relaxation (`backends.mathprog.additive_lp`, solved by GLOP) rounded to
    each node's largest x, repaired and improved (`backends.heuristics.feasible`): the hint when it is
    better than the current one (reported to `options.channel.on_incumbent`); the LP optimum is a
    bound. Skipped when it would take more than LP_FRACTION of the time left."""
    from ortools.linear_solver.python import model_builder

    sel = model.sel
    assert sel is not None
    t0 = time.perf_counter()
    try:
        ap = additive_program(sel, 1.0, deadline=t0 + LP_FRACTION * (deadline - t0))
    except OutOfTime:
        return {"lp_start": "skipped (no time left to build it)"}
    left = deadline - t0
    if LP_SECONDS_PER_TERM * ap.program.num_terms > LP_FRACTION * left:
        return {"lp_start": "skipped (too large for the time left)"}
    with tempfile.TemporaryDirectory(prefix="layerwise-lp-") as tmp:
        path = Path(tmp) / "lp.mps"
        write_mps(ap.program, path)
        lp = model_builder.Model()
        lp.import_from_mps_file(str(path))
    glop = model_builder.Solver("glop")
    glop.set_time_limit_in_seconds(max(0.1, t0 + LP_FRACTION * left - time.perf_counter()))
    glop.set_solver_specific_parameters("use_dual_simplex: true")
    status = glop.solve(lp)
    out: dict[str, Any] = {"lp_seconds": time.perf_counter() - t0}
    if status != model_builder.SolveStatus.OPTIMAL:
        return {**out, "lp_start": f"no LP solution in time ({status.name})"}
    out["lp_bound"] = glop.objective_value + ap.offset
    # every value as one array (Solver.values would need pandas)
    x = np.asarray(glop._Solver__solve_helper.variable_values())  # type: ignore[attr-defined]
    polish = min(deadline, time.perf_counter() + LP_FRACTION * left)
    choices, out["lp_start"] = rounded_lp_start(sel, ap, x, model.warm, polish)
    if choices is not None:
        model.model.clear_hints()
        _hint_selection(model.model, model, choices, model.encoder)
        model.warm, model.hint = choices, "lp_rounding"
        callback = options.channel.on_incumbent
        if callback is not None:
            callback(choices, "cpsat")
    return out


# ------------------------------------------------------------------------------ decode


def decode_selection(
    model: CpsatModel, run: CpsatRun
) -> tuple[tuple[int, ...] | None, float | None]:
    """The choice vector of a run and its proven bound in real units."""
    sel = model.sel
    assert sel is not None
    bound = run.bound / model.scale if run.bound is not None else None
    if "x" not in run.values:
        return None, bound
    choices = []
    for a, xs in zip(sel.allowed, run.values["x"], strict=True):
        k = next(j for j, v in enumerate(xs) if v is True)
        choices.append(int(a[k]))
    return tuple(choices), bound


def decode_placement(model: CpsatModel, run: CpsatRun) -> PlacementOutcome:
    """The placement, its re-timed schedule, and the model's bound in seconds."""
    pp = model.pp
    assert pp is not None
    stats = {"solver_status": run.status, "solver_seconds": run.wall, "hint": model.hint}
    bound = None
    if run.bound is not None:
        bound = max(
            placement_lower_bound(pp), (run.bound - model.slack * model.scale) / model.scale
        )
    if "x" not in run.values:
        status = "INFEASIBLE" if run.status == "INFEASIBLE" else "NO_SOLUTION"
        return PlacementOutcome(status, None, None, bound, run.timed_out, stats)
    place = [next(d for d, v in enumerate(xs) if v is True) for xs in run.values["x"]]
    start = np.asarray(run.values["start"], dtype=np.float64) / model.scale
    schedule = retime(pp, place, start, model.order)
    status = "OPTIMAL" if run.status == "OPTIMAL" else "FEASIBLE"
    if status == "OPTIMAL":
        bound = min(bound, schedule.makespan) if bound is not None else schedule.makespan
    model_span = run.values["objective"] / model.scale
    return PlacementOutcome(status, schedule, model_span, bound, run.timed_out, stats)


def decode(problem: Problem, model: CpsatModel, run: CpsatRun, name: str = "cpsat") -> SolveResult:
    """The SolveResult of a run (objective re-scored later by the Backend base class)."""
    stats: dict[str, Any] = {
        **model.stats,
        "solver_status": run.status,
        "solver_seconds": run.wall,
        "hint": model.hint,
        "warm_start_used": model.hint == "warm_start",
        "scale": model.scale,
        "rounding_slack": model.slack,
        **run.lp,
    }
    limit = Limit.TIME if run.timed_out else None
    if model.objective == "makespan":
        return placement_result(model.pp, decode_placement(model, run), limit, stats, name)
    choices, bound = decode_selection(model, run)
    sel = model.sel
    assert sel is not None
    if run.status == "INFEASIBLE":
        stats["reason"] = sel.infeasible or "proven by CP-SAT"
        return SolveResult(name, Status.INFEASIBLE, bound=math.inf, stats=stats)
    bound = max(bound if bound is not None else -math.inf, sel.trivial_bound())
    if model.warm is not None and (choices is None or sel.cost(model.warm) < sel.cost(choices)):
        stats["answer"] = model.hint  # the solver found nothing better than its hint in time
        choices = model.warm
    if choices is None:
        return SolveResult(name, Status.NO_SOLUTION, bound=bound, limit=limit, stats=stats)
    status = Status.OPTIMAL if run.status == "OPTIMAL" else Status.FEASIBLE
    return SolveResult(name, status, choices, bound=min(bound, sel.cost(choices)), limit=limit,
                       stats=stats)  # fmt: skip


SUB_SETTINGS = CpsatSettings(lp_start=False)  # a round's sub-problem is small: no LP start


def solve_sub(
    sub: Selection, options: SolveOptions, hint: Warm, seconds: float, latest: float
) -> SubRun:
    """A neighbourhood-search round (`backends.mathprog.lns.SubSolve`): encode within
    `seconds` (OutOfTime past them), then search for `seconds`, never past `latest`, with
    SUB_SETTINGS (the defaults without the LP start)."""
    model = encode_selection(sub, options, SUB_SETTINGS, hint, time.perf_counter() + seconds)
    seconds = max(1e-3, min(seconds, latest - time.perf_counter()))
    run = solve_encoded(model, options, SUB_SETTINGS, seconds)
    found, bound = decode_selection(model, run)
    return SubRun(found, run.status == "OPTIMAL", run.wall, bound)


# ----------------------------------------------------------------------------- backend


class CpsatBackend(SolverBackend[CpsatSettings, CpsatModel, CpsatRun]):
    name = "cpsat"
    REQUIRED_MODULES = ("ortools",)
    settings_type = CpsatSettings  # its "lns": `backends.mathprog.lns` after the whole model
    steps = SolverSteps(encode_selection, encode_placement, solve_encoded, decode_placement, decode)
    solve_sub = staticmethod(solve_sub)


_BACKEND = CpsatBackend()
encode = _BACKEND.encode  # the CP-SAT model of a Problem under options.objective
solve_placement = _BACKEND.solve_placement  # the makespan solve on a PlacementProblem


def _sigint_handler() -> Any:
    """Python's SIGINT handler, when this is the main thread (where it can be set again)."""
    if threading.current_thread() is threading.main_thread():
        return signal.getsignal(signal.SIGINT)
    return None


def _restore_sigint(handler: Any) -> None:
    """Set Python's SIGINT handler again after a solve: CP-SAT (ortools 9.15) that catches
    SIGINT (its default, which `parameters` may set again) leaves the signal at SIG_DFL, so
    the next Ctrl-C would kill the process without a line or a plan."""
    if handler is not None:
        signal.signal(signal.SIGINT, handler)
