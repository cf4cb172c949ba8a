"""`cpsat`: OR-Tools CP-SAT on both objectives, as encode / solve / decode.

Additive (OptCNN Eq. 1) on `backends.placement.Selection`: a Boolean x[i, c] per allowed
choice with ExactlyOne per node; each remaining edge gets a Boolean y[e, a, b] per finite
pair, tied to its ends by row and column sums (sum_b y[e, a, b] = x[u, a], sum_a y[e, a, b]
= x[v, b]: the local marginal polytope, exact on trees, so the LP bound is strong), or with
extra={"edges": "implied"} only y >= x[u, a] + x[v, b] - 1 for pairs of positive cost (fewer
constraints, a weak LP). Forbidden pairs get no y (or a clause); memory rows are linear.

CP-SAT needs integers: costs are multiplied by a power of two S (1 when they are integers
already) and rounded down, so every encoded objective is <= S x the real one and the solver's
bound / S is a proven bound in real units; the answer is at most (nodes + edges) / S worse
than the real optimum (`stats["rounding_slack"]`, ~1e-12 relative). Memory usages are exact
when integral, else rounded up with the limit rounded down (never accepts too much memory).

Makespan (DLPlacer Eqs. 7-13) on `backends.placement.PlacementProblem`: a Boolean P[k, d] per
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
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from ortools.sat.python import cp_model

from backends.base import Backend, BackendError, Limit, SolveOptions, SolveResult, Status
from backends.placement import (
    PlacementError,
    PlacementOutcome,
    PlacementProblem,
    Schedule,
    Selection,
    canonical_placement,
    greedy_placement,
    list_schedule,
    placement_lower_bound,
    placement_problem,
    retime,
    seed_choices,
    selection,
)
from planner.evaluate import additive_cost, memory_feasible
from planner.problem import Problem

__all__ = ["CpsatBackend", "CpsatModel", "decode", "encode", "solve_encoded"]

COST_BITS = 52  # the sum of every encoded cost coefficient stays below 2**COST_BITS
TIME_BITS = 40  # the makespan upper bound is about 2**TIME_BITS time units
SYMMETRY_DEPTH = 64  # nodes covered by the lexicographic-leader constraints
CHECK_EVERY = 512  # encoded items between two looks at the clock


class _OutOfTime(Exception):
    pass


@dataclass
class CpsatModel:
    """An encoded problem: the CP-SAT model and what decoding needs."""

    objective: str
    model: cp_model.CpModel
    scale: float  # integer units per real unit
    sel: Selection | None = None
    x: list[list[Any]] = field(default_factory=list)  # per node, per allowed choice (or device)
    pp: PlacementProblem | None = None
    order: str = "free"
    start: list[Any] = field(default_factory=list)
    makespan: Any = None
    slack: float = 0.0  # real units the rounding can hide
    hint: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class CpsatRun:
    status: str
    values: dict[str, Any]
    bound: float | None  # integer units
    wall: float
    timed_out: bool


class _Clock:
    def __init__(self, deadline: float):
        self.deadline, self.count = deadline, 0

    def tick(self) -> None:
        self.count += 1
        if self.count % CHECK_EVERY == 0 and time.perf_counter() > self.deadline:
            raise _OutOfTime


# ------------------------------------------------------------------------------ encode


def encode(problem: Problem, options: SolveOptions, deadline: float = math.inf) -> CpsatModel:
    """The CP-SAT model of `problem` under options.objective (raises _OutOfTime past deadline)."""
    if options.objective == "additive":
        sel = selection(problem)
        warm = _warm_choices(problem, sel, options)
        return encode_selection(sel, options, warm[0] if warm else None, deadline)
    pp = _placement(problem, options)
    return encode_placement(pp, options, _warm_schedule(pp, options), deadline)


def _warm_choices(
    problem: Problem, sel: Selection, options: SolveOptions
) -> tuple[tuple[int, ...], str] | None:
    if options.warm_start is not None:
        ch = problem.check_choices(options.warm_start)
        if math.isfinite(additive_cost(problem, ch)) and memory_feasible(problem, ch):
            return ch, "warm_start"
    if options.extra.get("seed_heuristic", True):
        seed = seed_choices(problem, sel)
        if seed is not None:
            return seed[0], "heuristic"
    return None


def _int_costs(tables: list[np.ndarray]) -> float:
    """The power-of-two scale of the cost tables (1 when integral and small enough)."""
    finite = [t[np.isfinite(t)] for t in tables]
    total = float(sum(np.abs(f).sum() for f in finite))
    if total < 2.0**COST_BITS and all((f == np.floor(f)).all() for f in finite):
        return 1.0
    return 2.0 ** math.floor(math.log2(2.0**COST_BITS / max(total, 1e-300)))


def encode_selection(
    sel: Selection,
    options: SolveOptions,
    warm: tuple[int, ...] | None = None,
    deadline: float = math.inf,
) -> CpsatModel:
    """The additive selection model (see the module docstring)."""
    mode = options.extra.get("edges", "marginal")
    if mode not in ("marginal", "implied"):
        raise BackendError(f"cpsat edges must be 'marginal' or 'implied', got {mode!r}")
    clock = _Clock(deadline)
    m = cp_model.CpModel()
    scale = _int_costs([*sel.node_cost, *sel.edge_cost])
    out = CpsatModel("additive", m, scale, sel=sel)
    if sel.infeasible:
        m.add_bool_or([])  # the reductions proved it: an empty clause
        return out
    terms: list[Any] = []
    coefs: list[int] = []
    const = 0
    for c in sel.node_cost:
        ic = np.floor(c * scale).astype(np.int64)
        if len(c) == 1:
            out.x.append([1])
            const += int(ic[0])
            continue
        xs = [m.new_bool_var("") for _ in c]
        m.add_exactly_one(xs)
        out.x.append(xs)
        terms += xs
        coefs += ic.tolist()
    npairs = 0
    for (u, v), t in zip(sel.edges, sel.edge_cost, strict=True):
        it = np.where(np.isfinite(t), np.floor(np.where(np.isfinite(t), t, 0) * scale), -1)
        xu, xv = out.x[u], out.x[v]
        if mode == "marginal":
            rows: list[list[Any]] = [[] for _ in xu]
            cols: list[list[Any]] = [[] for _ in xv]
            for a, b in zip(*np.nonzero(np.isfinite(t)), strict=True):
                y = m.new_bool_var("")
                rows[a].append(y)
                cols[b].append(y)
                terms.append(y)
                coefs.append(int(it[a, b]))
                npairs += 1
                clock.tick()
            for a, ys in enumerate(rows):
                m.add(sum(ys) == xu[a])
            for b, ys in enumerate(cols):
                m.add(sum(ys) == xv[b])
        else:
            for a, b in zip(*np.nonzero(~np.isfinite(t) | (it > 0)), strict=True):
                if not np.isfinite(t[a, b]):
                    m.add_bool_or([xu[a].Not(), xv[b].Not()])
                    continue
                y = m.new_bool_var("")
                m.add_bool_or([xu[a].Not(), xv[b].Not(), y])
                terms.append(y)
                coefs.append(int(it[a, b]))
                npairs += 1
                clock.tick()
    _selection_memory(m, sel, out.x)
    m.minimize(cp_model.LinearExpr.weighted_sum(terms, coefs) + const)
    out.slack = (sel.num_nodes + len(sel.edges)) / scale
    out.stats = {"edges": mode, "pair_variables": npairs, "memory_rows": len(sel.memory)}
    if warm is not None:
        _hint_selection(m, sel, out.x, warm)
        out.hint = "given"
    return out


def _selection_memory(m: cp_model.CpModel, sel: Selection, x: list[list[Any]]) -> None:
    coefs = [c for row in sel.memory for c in row.coef]
    integral = all((c == np.floor(c)).all() for c in coefs)
    total = float(sum(c.max() for c in coefs)) if coefs else 0.0
    f = 1.0 if integral and total < 2.0**60 else 2.0 ** math.floor(math.log2(2.0**50 / total))
    for row in sel.memory:
        terms, ws = [], []
        rhs = math.floor(row.rhs * f)
        for i, c in zip(row.nodes, row.coef, strict=True):
            ic = np.ceil(c * f).astype(np.int64)
            if len(c) == 1:
                rhs -= int(ic[0])
                continue
            terms += x[i]
            ws += ic.tolist()
        m.add(cp_model.LinearExpr.weighted_sum(terms, ws) <= rhs)


def _hint_selection(
    m: cp_model.CpModel, sel: Selection, x: list[list[Any]], choices: tuple[int, ...]
) -> None:
    pos = sel.positions(choices)
    if pos is None:
        return
    for xs, k in zip(x, pos, strict=True):
        if len(xs) > 1:
            for j, var in enumerate(xs):
                m.add_hint(var, j == k)


def _placement(problem: Problem, options: SolveOptions) -> PlacementProblem:
    try:
        return placement_problem(
            problem,
            phases=options.extra.get("phases", "training"),
            routing=options.extra.get("routing", "fixed"),
        )
    except PlacementError as exc:
        raise BackendError(str(exc)) from None


def _warm_schedule(pp: PlacementProblem, options: SolveOptions) -> tuple[Schedule, str] | None:
    order = options.extra.get("order", "free")
    if options.warm_start is not None:
        place = pp.placement_of(options.warm_start)
        if place is not None and pp.memory_ok(place):
            return list_schedule(pp, canonical_placement(pp, place), order), "warm_start"
    if options.extra.get("seed_heuristic", True):
        greedy = greedy_placement(pp, order)
        if greedy is not None:
            return greedy, "heuristic"
    return None


def encode_placement(
    pp: PlacementProblem,
    options: SolveOptions,
    warm: tuple[Schedule, str] | None = None,
    deadline: float = math.inf,
) -> CpsatModel:
    """DLPlacer's placement model (see the module docstring)."""
    order = options.extra.get("order", "free")
    if order not in ("free", "fifo"):
        raise BackendError(f"order must be 'free' or 'fifo', got {order!r}")
    clock = _Clock(deadline)
    top = warm[0].makespan if warm else float(pp.duration.max(axis=1).sum() + pp.delay.max(axis=(1, 2)).sum())
    scale = 2.0 ** math.floor(math.log2(2.0**TIME_BITS / max(top, 1e-300)))
    dur, delay = pp.scaled(scale)
    horizon = int(dur.max(axis=1).sum() + delay.max(axis=(1, 2)).sum()) + 1
    m = cp_model.CpModel()
    out = CpsatModel("makespan", m, scale, pp=pp, order=order)
    allowed = pp.allowed
    for k in range(pp.num_nodes):
        ds = np.flatnonzero(allowed[k])
        lits: list[Any] = [None] * pp.num_devices
        if len(ds) == 1:
            lits[ds[0]] = 1
        else:
            for d in ds:
                lits[d] = m.new_bool_var("")
            m.add_exactly_one([lits[d] for d in ds])
        out.x.append(lits)
    start = [m.new_int_var(0, horizon, "") for _ in range(pp.num_tasks)]
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
            m.add(start[y] >= ends[x] + int(delay[p, a, b])).only_enforce_if(
                [lit for lit in lits if lit is not 1]
            )
            clock.tick()
    for d in range(pp.num_devices):
        intervals = []
        for t in range(pp.num_tasks):
            lit = out.x[node[t]][d]
            if lit is None or dur[t, d] == 0:
                continue
            if lit is 1:
                intervals.append(m.new_fixed_size_interval_var(start[t], int(dur[t, d]), ""))
            else:
                intervals.append(
                    m.new_optional_fixed_size_interval_var(start[t], int(dur[t, d]), lit, "")
                )
        m.add_no_overlap(intervals)
    if order == "fifo":
        for x, y in pp.exclusive_pairs("fifo"):
            first, second = (x, y) if pp.order_key[x] <= pp.order_key[y] else (y, x)
            for d in np.flatnonzero(allowed[node[x]] & allowed[node[y]]):
                lits = [out.x[node[first]][d], out.x[node[second]][d]]
                m.add(start[second] >= start[first] + int(dur[first, d])).only_enforce_if(
                    [lit for lit in dict.fromkeys(lits) if lit is not 1]
                )
                clock.tick()
    span = m.new_int_var(0, horizon, "makespan")
    out.makespan = span
    sinks = set(range(pp.num_tasks)) - {int(x) for x in pp.prec[:, 0]}
    for t in sorted(sinks):
        m.add(span >= ends[t])
    for d in range(pp.num_devices):
        load = [(out.x[node[t]][d], int(dur[t, d])) for t in range(pp.num_tasks)]
        load = [(lit, w) for lit, w in load if lit is not None and w > 0]
        m.add(span >= sum(w if lit is 1 else w * lit for lit, w in load))
    _placement_memory(m, pp, out.x)
    _lex_leader(m, pp, out.x)
    m.minimize(span)
    n_items = pp.num_tasks + len(pp.prec)
    out.slack = n_items / scale
    out.stats = {"order": order, "routing": pp.routing, "symmetries": len(pp.symmetries)}
    if warm is not None:
        _hint_placement(m, out, warm[0], dur, delay)
        out.hint = warm[1]
    return out


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
            if lit is 1:
                rhs -= w
            else:
                terms.append(lit)
                ws.append(w)
        m.add(cp_model.LinearExpr.weighted_sum(terms, ws) <= rhs)


def _lex_leader(m: cp_model.CpModel, pp: PlacementProblem, x: list[list[Any]]) -> None:
    """For every symmetry sigma: the placement is lexicographically <= its image, truncated to
    the first SYMMETRY_DEPTH nodes (f_k: nodes before k are all fixed by sigma)."""
    for sigma in pp.symmetries:
        fixed = [d for d in range(pp.num_devices) if sigma[d] == d]
        f: Any = 1
        for k in range(min(pp.num_nodes, SYMMETRY_DEPTH)):
            for b in range(pp.num_devices):
                if sigma[b] < b and x[k][b] is not None:
                    m.add_bool_or([lit for lit in (f, x[k][b]) if lit is not 1] and
                                  [(f.Not() if f is not 1 else None), x[k][b].Not()]
                                  if f is not 1 else [x[k][b].Not()])  # fmt: skip
            if not fixed:
                break
            nxt = m.new_bool_var("")
            for a in fixed:
                if x[k][a] is None:
                    continue
                clause = [nxt] + ([] if f is 1 else [f.Not()])
                clause += [] if x[k][a] is 1 else [x[k][a].Not()]
                m.add_bool_or(clause)
            f = nxt


def _hint_placement(
    m: cp_model.CpModel, out: CpsatModel, warm: Schedule, dur: np.ndarray, delay: np.ndarray
) -> None:
    assert out.pp is not None
    pp = out.pp
    for k, d in enumerate(warm.placement):
        for e, lit in enumerate(out.x[k]):
            if lit is not None and lit is not 1:
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


def solve_encoded(model: CpsatModel, options: SolveOptions, time_limit: float) -> CpsatRun:
    """Run CP-SAT for at most `time_limit` seconds with options.seed and options.threads."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit, 1e-3)
    solver.parameters.num_workers = options.threads
    solver.parameters.random_seed = options.seed
    if options.threads > 1:
        solver.parameters.interleave_search = True  # deterministic with several workers
    start = time.perf_counter()
    code = solver.solve(model.model)
    wall = time.perf_counter() - start
    status = _STATUS.get(code, "UNKNOWN")
    if status == "MODEL_INVALID":
        raise BackendError(f"cpsat built an invalid model: {model.model.validate()}")
    values: dict[str, Any] = {}
    if status in ("OPTIMAL", "FEASIBLE"):
        values["x"] = [
            [lit if lit is None or lit is 1 else solver.boolean_value(lit) for lit in xs]
            for xs in model.x
        ]
        values["objective"] = solver.objective_value
        if model.objective == "makespan":
            values["start"] = [solver.value(s) for s in model.start]
    bound = solver.best_objective_bound if status != "INFEASIBLE" else None
    timed_out = status in ("FEASIBLE", "UNKNOWN")
    return CpsatRun(status, values, bound, wall, timed_out)


# ------------------------------------------------------------------------------ decode


def decode_selection(model: CpsatModel, run: CpsatRun) -> tuple[tuple[int, ...] | None, float | None]:
    """The choice vector of a run and its proven bound in real units."""
    sel = model.sel
    assert sel is not None
    bound = run.bound / model.scale if run.bound is not None else None
    if "x" not in run.values:
        return None, bound
    choices = []
    for a, xs in zip(sel.allowed, run.values["x"], strict=True):
        k = next(j for j, v in enumerate(xs) if v is 1 or v is True)
        choices.append(int(a[k]))
    return tuple(choices), bound


def decode_placement(model: CpsatModel, run: CpsatRun) -> PlacementOutcome:
    """The placement, its re-timed schedule, and the model's bound in seconds."""
    pp = model.pp
    assert pp is not None
    stats = {"solver_status": run.status, "solver_seconds": run.wall, "hint": model.hint}
    bound = None
    if run.bound is not None:
        bound = max(placement_lower_bound(pp), (run.bound - model.slack * model.scale) / model.scale)
    if "x" not in run.values:
        status = "INFEASIBLE" if run.status == "INFEASIBLE" else "NO_SOLUTION"
        return PlacementOutcome(status, None, None, bound, run.timed_out, stats)
    place = [
        next(d for d, v in enumerate(xs) if v is 1 or v is True) for xs in run.values["x"]
    ]
    start = np.asarray(run.values["start"], dtype=np.float64) / model.scale
    schedule = retime(pp, place, start, model.order)
    status = "OPTIMAL" if run.status == "OPTIMAL" else "FEASIBLE"
    if status == "OPTIMAL":
        bound = min(bound, schedule.makespan) if bound is not None else schedule.makespan
    model_span = run.values["objective"] / model.scale
    return PlacementOutcome(status, schedule, model_span, bound, run.timed_out, stats)


def solve_placement(
    pp: PlacementProblem, options: SolveOptions, warm: tuple[Schedule, str] | None = None
) -> PlacementOutcome:
    """Encode, solve and decode a placement problem within options.time_limit."""
    t0 = time.perf_counter()
    if warm is None:
        warm = _warm_schedule(pp, options)
    model = encode_placement(pp, options, warm)
    run = solve_encoded(model, options, options.time_limit - (time.perf_counter() - t0))
    return decode_placement(model, run)


def decode(problem: Problem, model: CpsatModel, run: CpsatRun, name: str = "cpsat") -> SolveResult:
    """The SolveResult of a run (objective re-scored later by the Backend base class)."""
    stats: dict[str, Any] = {
        **model.stats,
        "solver_status": run.status,
        "solver_seconds": run.wall,
        "hint": model.hint,
        "scale": model.scale,
        "rounding_slack": model.slack,
    }
    limit = Limit.TIME if run.timed_out else None
    if model.objective == "makespan":
        return _placement_result(model, decode_placement(model, run), limit, stats, name)
    choices, bound = decode_selection(model, run)
    if run.status == "INFEASIBLE":
        stats["reason"] = (model.sel.infeasible if model.sel else None) or "proven by CP-SAT"
        return SolveResult(name, Status.INFEASIBLE, bound=math.inf, stats=stats)
    if choices is None:
        return SolveResult(name, Status.NO_SOLUTION, bound=bound, limit=limit, stats=stats)
    status = Status.OPTIMAL if run.status == "OPTIMAL" else Status.FEASIBLE
    return SolveResult(name, status, choices, bound=bound, limit=limit, stats=stats)


def _placement_result(
    model: CpsatModel, out: PlacementOutcome, limit: Limit | None, stats: dict, name: str
) -> SolveResult:
    """Makespan answers are FEASIBLE: the placement model is exact only over single-device
    placements and its schedule is not the simulator's (see docs/solvers.md)."""
    pp = model.pp
    assert pp is not None
    stats.update(out.stats)
    stats.update(
        model_status=out.status,
        model_makespan=out.model_makespan,
        model_bound=out.bound,
        model_gap=out.gap,
        schedule_makespan=out.schedule.makespan if out.schedule else None,
    )
    if out.schedule is None:
        status = Status.INFEASIBLE if out.status == "INFEASIBLE" else Status.NO_SOLUTION
        return SolveResult(name, status, limit=limit, stats=stats)
    stats["placement"] = {
        pp.node_names[k]: pp.devices.devices[d].name for k, d in enumerate(out.schedule.placement)
    }
    choices = pp.choices(out.schedule.placement)
    return SolveResult(name, Status.FEASIBLE, choices, limit=limit, stats=stats)


# ----------------------------------------------------------------------------- backend


class CpsatBackend(Backend):
    name = "cpsat"
    objectives = ("additive", "makespan")
    exact = True
    REQUIRED_MODULES = ("ortools",)

    def can_run(self, problem: Problem, options: SolveOptions) -> str | None:
        reason = super().can_run(problem, options)
        if reason is None and options.objective == "makespan" and problem.graph is None:
            reason = (
                f"the makespan objective places the ops of a DNN; problem {problem.name!r} "
                "is a cost table"
            )
        return reason

    def _solve(self, problem: Problem, options: SolveOptions) -> SolveResult:
        t0 = time.perf_counter()
        deadline = t0 + options.time_limit
        try:
            model = encode(problem, options, deadline)
        except _OutOfTime:
            return _out_of_time(problem, options, self.name)
        run = solve_encoded(model, options, deadline - time.perf_counter())
        result = decode(problem, model, run, self.name)
        result.stats["encode_seconds"] = run and (time.perf_counter() - t0 - run.wall)  # type: ignore[index]
        return result


def _out_of_time(problem: Problem, options: SolveOptions, name: str) -> SolveResult:
    """The time limit passed while encoding: the warm start or heuristic answer, if any."""
    stats: dict[str, Any] = {"solver_status": "NOT_RUN (time limit while encoding)"}
    if options.objective == "additive":
        sel = selection(problem)
        warm = _warm_choices(problem, sel, options)
        if warm is not None:
            stats["hint"] = warm[1]
            return SolveResult(
                name, Status.FEASIBLE, warm[0], bound=sel.trivial_bound(), limit=Limit.TIME,
                stats=stats,
            )  # fmt: skip
    return SolveResult(name, Status.NO_SOLUTION, limit=Limit.TIME, stats=stats)
