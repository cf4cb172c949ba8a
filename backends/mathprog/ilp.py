"""`ilp`: integer linear programs solved by CBC, as encode / solve / decode.

Additive (OptCNN Eq. 1) on `backends.model.selection.Selection`: the sparse program of
`backends.mathprog.additive_lp` (binary x[i, c] per allowed choice with sum_c x[i, c] = 1; per edge a
continuous y per finite pair of its groups of equal rows and columns, tied to the x by row and
column sums (the local marginal polytope, exact on trees), or with the setting edges "implied"
only y >= X[u, g] + X[v, h] - 1 for pairs of positive cost; memory as explicit rows per
binding check time or, when those would be too many terms, as a running sum), built with numpy
and written as MPS directly (`backends.mathprog.linear`), then run with CBC's binary (`backends.mathprog.cbc`).
The setting memory "rows" | "chain" forces a memory form (settings: `IlpSettings`, given as
`SolveOptions.extra`).

Makespan: DLPlacer's formulation (Pal et al. 2019, Eqs. 7-13) on
`backends.placement.problem.PlacementProblem`: binary P[k, d] with sum_d P[k, d] = 1 (Eq. 7);
starts T_t >= 0; end E_t = T_t + sum_d dur[t, d] P[k, d]; a precedence x -> y is
T_y >= E_x + delta_p with delta_p >= delay[p, a, b] (P[u, a] + P[v, b] - 1) for a != b
(Eqs. 10-11); with the setting route_variables True (needs routing "shortest") delta_p is
instead sum over directed links of C[p, l] (bytes / bandwidth + latency) with flow
conservation sum_out C - sum_in C = P[u, n] - P[v, n] at every device n and 0 at switches
(Eqs. 8-9). Two tasks that may share a device and that no path orders get an order binary o
and a same-device s >= P[u, d] + P[v, d] - 1 with the big-M disjunction of Eq. 12,
T_y >= E_x - M (1 - o) - M (1 - s) and T_x >= E_y - M o - M (1 - s) ("fifo": the program order,
T_y >= E_x - M (1 - s)); M is the makespan of the warm start, an upper bound of the optimum
(C <= M). Memory rows (Eq. 13); C >= every sink's end and >= every device's load;
lexicographic-leader symmetry breaking over the device permutations that preserve the data.

The makespan model is built with pulp.

Scaling: CBC's tolerances are absolute, so costs and times are multiplied by a power of ten
that makes the warm start (or the trivial bound) about 1e6 (costs) or 1e4 (times).

CBC: threads = SolveOptions.threads, "randomSeed" and "randomCbcSeed" = seed + 1 (0 would mean
"from the clock"), "sec" = what is left of the time limit after encoding. A warm start
(SolveOptions.warm_start, else `backends.heuristics.feasible`'s heuristic) is passed to the additive
model as a MIP start (CBC's -mips); `stats["warm_start_accepted"]` is what CBC's log says
about it. The makespan model gets none (see `encode_placement`: a CBC defect). Status,
objective and lower bound are read from CBC's log. A margin before the deadline CBC gets SIGINT
(it stops and writes its best solution); if it has not stopped by the deadline it is killed and the
start is the answer (FEASIBLE, limit TIME, with the last bound CBC printed).

What does not depend on the solver (warm starts, the time limit while encoding, the makespan
solve's wrapper, the Backend class body) is shared with `cpsat` in `backends.mathprog.common`.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pulp

from backends.base import BackendError, Limit, SolveOptions, SolveResult, Status, stop_requested
from backends.mathprog.additive_lp import AdditiveProgram, additive_program, assignment, positions
from backends.mathprog.cbc import parse_log, run_cbc
from backends.mathprog.common import (
    IlpSettings,
    SolverBackend,
    SolverSteps,
    Warm,
    placement_result,
    rounded_lp_start,
)
from backends.mathprog.linear import read_solution, write_mps, write_start
from backends.model.selection import Selection
from backends.placement.problem import (
    PlacementOutcome,
    PlacementProblem,
    Schedule,
    hardware_graph,
    horizon,
    lex_symmetries,
    placement_lower_bound,
    retime,
)
from planner.deadline import Clock
from planner.problems.problem import Problem

__all__ = [
    "IlpBackend",
    "IlpModel",
    "IlpSettings",
    "constraints",
    "decode",
    "encode",
    "encoded_objective",
    "solve_encoded",
]

ALWAYS = True  # a variable fixed to 1 (a node with one allowed choice or device)
COST_MAGNITUDE = 1e6  # scaled additive objectives are about this large
TIME_MAGNITUDE = 1e4  # scaled makespans are about this large
SYMMETRY_DEPTH = 64
IO_SECONDS_PER_VARIABLE = 2e-5  # pulp writing the MPS file or reading the solution
IO_SECONDS_PER_ROW = 2e-5  # ... per constraint (the placement model's: mostly 3-4 terms)
IO_SECONDS_PER_TERM = 2e-6  # writing our MPS file or reading CBC's solution, per term
STOP_FRACTION = 0.08  # CBC's own limit and its SIGINT come this far before the deadline ...
STOP_SECONDS = 3.0  # ... but at most this far (plus its I/O): long runs lose little time
LP_FRACTION = 0.15  # of the time left, at most, for the LP-rounding start
LP_SECONDS_PER_TERM = 3e-6  # CLP's time per term on the root LP of an additive model
logger = logging.getLogger("backends.ilp")
KILL_SECONDS = 0.0  # CBC still running this long past the deadline is killed: at it, so
# that the time limit covers the whole solve (it had its SIGINT a margin before the
# deadline: a run that has not stopped by then loses its answer; 0.25 s past it overran a 3 s
# limit by 0.3 s on a busy machine)


def _ratio_gap(options: SolveOptions, offset: float = 0.0) -> list[str]:
    """CBC's relative gap option for `options.gap_tolerance` (none for 0: CBC proves exactly,
    its default). CBC stops when best - bound <= ratioGap * |best| (CbcModel's
    CbcAllowableFractionGap, relative to the incumbent), so r / (1 + r) keeps best / bound - 1
    <= r; the additive model's constant `offset`, kept out of CBC's objective, must be >= 0
    for that to hold of the whole objective (else CBC proves exactly)."""
    r = options.gap_tolerance
    if r <= 0 or offset < 0:
        return []
    return ["-ratioGap", f"{r / (1 + r):.12g}"]


def _stop_margin(options: SolveOptions, io_seconds: float) -> float:
    """Seconds before the deadline at which CBC gets its SIGINT (its own limit one margin
    earlier): enough to write and read its solution, STOP_FRACTION of the time limit (of
    options' deadline) but at most STOP_SECONDS."""
    return max(io_seconds, min(STOP_FRACTION * options.clock().limit, STOP_SECONDS))


@dataclass
class IlpModel:
    """An encoded problem: the pulp model and what decoding needs."""

    objective: str
    lp: pulp.LpProblem | None  # the makespan model
    scale: float
    sel: Selection | None = None
    ap: AdditiveProgram | None = None  # the additive model
    x: list[list[Any]] = field(default_factory=list)  # per node, per allowed choice or device
    y: list[list[tuple[int, int, Any]]] = field(default_factory=list)
    pp: PlacementProblem | None = None
    order: str = "free"
    start: list[Any] = field(default_factory=list)
    makespan: Any = None
    hint: str | None = None  # "warm_start", "heuristic" or None
    warm: tuple[int, ...] | None = None
    routes: dict[int, tuple[list, list]] = field(default_factory=dict)  # Eqs. 8-9 arcs, C vars
    offset: float = 0.0  # scaled objective constant, kept out of the LP (CBC's log omits it)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class IlpRun:
    status: str  # "OPTIMAL" | "FEASIBLE" | "INFEASIBLE" | "UNKNOWN"
    objective: float | None  # scaled
    bound: float | None  # scaled
    wall: float
    timed_out: bool
    log: dict[str, Any]
    values: np.ndarray | None = None  # the additive model's column values


def _var(
    lp: pulp.LpProblem, name: str, binary: bool = False, low: float = 0.0, up: float | None = 1.0
) -> Any:
    cat = pulp.LpBinary if binary else pulp.LpContinuous
    if hasattr(lp, "add_variable"):  # pulp >= 3.3 (the pulp 4 API)
        return lp.add_variable(name, lowBound=low, upBound=up, cat=cat)
    return pulp.LpVariable(name, lowBound=low, upBound=up, cat=cat)


def constraints(lp: pulp.LpProblem) -> list[Any]:
    """The model's constraints (pulp 4's list, or pulp 3's dict values)."""
    found = lp.constraints
    return list(found()) if callable(found) else list(found.values())


def _expr(pairs: list[tuple[Any, float]], const: float = 0.0) -> pulp.LpAffineExpression:
    """sum coef * var (+ const), with variables fixed to one folded into the constant."""
    e = pulp.LpAffineExpression()
    for var, c in pairs:
        if var is ALWAYS:
            const += c
        elif c:
            e.addterm(var, c)
    e.constant = const
    return e


def _power_of_ten(value: float, magnitude: float) -> float:
    return 10.0 ** round(math.log10(magnitude / value)) if value > 0 else 1.0


# ------------------------------------------------------------------------------ encode


def encode_selection(
    sel: Selection,
    options: SolveOptions,
    settings: IlpSettings,
    warm: Warm | None = None,
    deadline: float = math.inf,
) -> IlpModel:
    """The additive selection model (see the module docstring and `backends.mathprog.additive_lp`)."""
    mode, memory = settings.edges, settings.memory
    reference = sel.cost(warm[0]) if warm is not None else sel.trivial_bound()
    scale = _power_of_ten(reference if math.isfinite(reference) else 0.0, COST_MAGNITUDE)
    out = IlpModel("additive", None, scale, sel=sel)
    if sel.infeasible:
        return out
    ap = additive_program(sel, scale, mode, memory, deadline)
    out.ap, out.offset = ap, ap.offset
    prog = ap.program
    out.stats = {
        "edges": mode,
        "memory_form": ap.memory,
        "columns": prog.num_columns,
        "rows": prog.num_rows,
        "terms": prog.num_terms,
        "edge_variables": int(sum((e.pair >= 0).sum() for e in ap.edges)),
        "memory_rows": int(sum(m.binding.sum() for m in sel.memory)),
    }
    if warm is not None:
        out.hint, out.warm = warm[1], warm[0]
    return out


def encoded_objective(model: IlpModel, choices: tuple[int, ...]) -> float:
    """The encoded objective of a choice vector, in real units, after checking that the
    assignment it implies satisfies every row of the model (additive only)."""
    sel, ap = model.sel, model.ap
    assert sel is not None and ap is not None and model.objective == "additive"
    pos = sel.positions(choices)
    if pos is None:
        return math.inf
    x = assignment(ap, sel, pos)
    broken = ap.program.violated(x)
    if len(broken):
        raise BackendError(f"the choices violate {len(broken)} rows, e.g. row {broken[0]}")
    return (float(ap.program.obj @ x) + ap.offset) / model.scale


def encode_placement(
    pp: PlacementProblem,
    options: SolveOptions,
    settings: IlpSettings,
    warm: tuple[Schedule, str] | None = None,
    deadline: float = math.inf,
) -> IlpModel:
    """DLPlacer's placement ILP (see the module docstring). `warm` gives big-M and the start."""
    order = settings.order
    flow = settings.route_variables
    if flow and pp.routing != "shortest":
        raise BackendError("route_variables model Eqs. 8-9's free routing: use routing='shortest'")
    clock = Clock(deadline)
    top = warm[0].makespan if warm is not None else horizon(pp)
    scale = _power_of_ten(top, TIME_MAGNITUDE)
    big_m = top * scale * (1 + 1e-9)
    dur, delay = pp.duration * scale, pp.delay * scale
    lp = pulp.LpProblem("placement", pulp.LpMinimize)
    out = IlpModel("makespan", lp, scale, pp=pp, order=order)
    for k in range(pp.num_nodes):
        ds = np.flatnonzero(pp.allowed[k])
        xs: list[Any] = [None] * pp.num_devices
        if len(ds) == 1:
            xs[ds[0]] = ALWAYS
        else:
            for d in ds:
                xs[d] = _var(lp, f"P{k}_{d}", binary=True)
            lp += _expr([(xs[d], 1.0) for d in ds]) == 1  # Eq. 7
        out.x.append(xs)
    node = pp.task_node
    out.start = [_var(lp, f"T{t}", up=big_m) for t in range(pp.num_tasks)]
    ends = [_end_terms(out, t, dur) for t in range(pp.num_tasks)]
    span = _var(lp, "C", up=big_m)
    out.makespan = span
    routes = _flow_routes(lp, out) if flow else None
    for p, (x, y) in enumerate(pp.prec):
        if node[x] == node[y] or not pp.nbytes[p]:
            lp += _expr([(out.start[y], 1.0)] + [(v, -c) for v, c in ends[x]]) >= 0
            continue
        if routes is not None:
            delta = routes(p, x, y)
        else:
            delta = _var(lp, f"delta{p}", up=None)
            for a, b in zip(*np.nonzero(delay[p]), strict=True):
                pu, pv = out.x[node[x]][a], out.x[node[y]][b]
                if pu is not None and pv is not None:
                    w = float(delay[p, a, b])
                    lp += _expr([(delta, 1.0), (pu, -w), (pv, -w)]) >= -w
                    clock.tick()  # up to D^2 rows per precedence (256 on 16 GPUs)
        lp += _expr([(out.start[y], 1.0), (delta, -1.0)] + [(v, -c) for v, c in ends[x]]) >= 0
        clock.tick()
    for x, y in pp.exclusive_pairs(order):
        _exclusive(lp, out, x, y, ends, big_m, order)
        clock.tick()
    sinks = sorted(set(range(pp.num_tasks)) - {int(x) for x in pp.prec[:, 0]})
    for t in sinks:
        lp += _expr([(span, 1.0)] + [(v, -c) for v, c in ends[t]]) >= 0
    for dev in range(pp.num_devices):
        load = [(out.x[node[t]][dev], -float(dur[t, dev])) for t in range(pp.num_tasks)]
        lp += _expr([(span, 1.0)] + [(v, c) for v, c in load if v is not None]) >= 0
    for r, row in enumerate(pp.memory):
        norm = max(row.limit, float(row.coef.max()), 1e-300)
        terms = [
            (out.x[k][d], float(row.coef[k, d]) / norm)
            for k, d in zip(*np.nonzero(row.coef), strict=True)
            if out.x[k][d] is not None
        ]
        lp.addConstraint(_expr(terms) <= row.limit * (1 + 1e-9) / norm, f"memory{r}")
    _lex_leader(lp, pp, out.x, clock)
    lp += _expr([(span, 1.0)])
    out.stats = {
        "order": order,
        "routing": pp.routing,
        "route_variables": flow,
        "symmetries": len(pp.symmetries),
        "symmetries_broken": len(lex_symmetries(pp)),
        "big_m": top,
    }
    # The warm start gives big-M (so it bounds C) and stays the answer when CBC finds
    # nothing better, but it is not passed to CBC as a MIP start (-mips): with one, CBC 2.10
    # has reported an answer 1.6% above the optimum as optimal
    # (random_placement_problem(5, p100-1x3, seed=5982, heterogeneous, memory): the
    # brute-force check in tests/test_backend_solvers.py).
    return out


def _end_terms(out: IlpModel, t: int, dur: np.ndarray) -> list[tuple[Any, float]]:
    """E_t = T_t + sum_d dur[t, d] P[k, d] as (variable, coefficient) terms."""
    assert out.pp is not None
    xs = out.x[out.pp.task_node[t]]
    return [(out.start[t], 1.0)] + [
        (v, float(dur[t, d])) for d, v in enumerate(xs) if v is not None and dur[t, d]
    ]


def _exclusive(
    lp: pulp.LpProblem,
    out: IlpModel,
    x: int,
    y: int,
    ends: list[list[tuple[Any, float]]],
    big_m: float,
    order: str,
) -> None:
    """Eq. 12 for one pair of tasks (or the program order in "fifo")."""
    assert out.pp is not None
    pp = out.pp
    u, v = pp.task_node[x], pp.task_node[y]
    same: Any = ALWAYS
    if u != v:
        same = _var(lp, f"s{x}_{y}")
        for d in np.flatnonzero(pp.allowed[u] & pp.allowed[v]):
            lp += _expr([(same, 1.0), (out.x[u][d], -1.0), (out.x[v][d], -1.0)]) >= -1
    apart = [(same, big_m)] if same is not ALWAYS else []
    const = -big_m if same is not ALWAYS else 0.0

    def after(first: int, second: int, extra: list[tuple[Any, float]], c: float) -> None:
        # T_second - E_first + M (1 - same) [+ M (1 - o) or M o] >= 0
        terms = [(out.start[second], 1.0)] + [(w, -k) for w, k in ends[first]]
        lp.addConstraint(_expr(terms + [(w, -k) for w, k in apart] + extra) >= const + c)

    if order == "fifo":
        first, second = (x, y) if pp.order_key[x] <= pp.order_key[y] else (y, x)
        after(first, second, [], 0.0)
        return
    o = _var(lp, f"o{x}_{y}", binary=True)
    after(x, y, [(o, -big_m)], -big_m)  # o = 1: x before y
    after(y, x, [(o, big_m)], 0.0)


def _flow_routes(lp: pulp.LpProblem, out: IlpModel) -> Callable[[int, int, int], Any]:
    """Eqs. 8-9: a routing of each transfer over the hardware graph's directed links."""
    assert out.pp is not None
    pp = out.pp
    g = hardware_graph(pp.devices)
    arcs = [(a, b, data["links"]) for a, b, data in g.edges(data=True)]
    arcs += [(b, a, links) for a, b, links in arcs]
    device_index = {d.name: k for k, d in enumerate(pp.devices.devices)}

    def route(p: int, x: int, y: int) -> Any:
        size = float(pp.nbytes[p])
        c = [_var(lp, f"C{p}_{j}", binary=True) for j in range(len(arcs))]
        out.routes[p] = (arcs, c)
        for h in g.nodes:
            terms = [(c[j], 1.0) for j, (a, _, _) in enumerate(arcs) if a == h]
            terms += [(c[j], -1.0) for j, (_, b, _) in enumerate(arcs) if b == h]
            if h in device_index:
                d = device_index[h]
                for var, sign in (
                    (out.x[pp.task_node[x]][d], -1.0),
                    (out.x[pp.task_node[y]][d], 1.0),
                ):
                    if var is not None:
                        terms.append((var, sign))
            lp.addConstraint(_expr(terms) == 0)
        weight = [min(size / bw + lat for bw, lat in links) * out.scale for _, _, links in arcs]
        delta = _var(lp, f"delta{p}", up=None)
        lp.addConstraint(
            _expr([(delta, 1.0)] + [(v, -w) for v, w in zip(c, weight, strict=True)]) == 0
        )
        return delta

    return route


def _lex_leader(lp: pulp.LpProblem, pp: PlacementProblem, x: list[list[Any]], clock: Clock) -> None:
    """As in the cpsat backend: f_k (continuous) >= 1 when nodes before k are all on devices
    sigma fixes; then node k may not be on a device b with sigma(b) < b (for the symmetries
    of `lex_symmetries`)."""
    for s, sigma in enumerate(lex_symmetries(pp)):
        fixed = [d for d in range(pp.num_devices) if sigma[d] == d]
        f: Any = ALWAYS
        for k in range(min(pp.num_nodes, SYMMETRY_DEPTH)):
            for b in range(pp.num_devices):
                if sigma[b] < b and x[k][b] is not None:
                    lp += _expr([(f, 1.0), (x[k][b], 1.0)]) <= 1
                    clock.tick()
            if not fixed:
                break
            nxt = _var(lp, f"f{s}_{k}")
            terms = [(nxt, 1.0), (f, -1.0)] + [
                (x[k][a], -1.0) for a in fixed if x[k][a] is not None
            ]
            lp += _expr(terms) >= -1
            f = nxt


def solve_encoded(
    model: IlpModel,
    options: SolveOptions,
    settings: IlpSettings,
    seconds: float,
    until: float = math.inf,
) -> IlpRun:
    """Run CBC on the model for at most `seconds`, file writing included, and never past
    `until` (a `time.perf_counter()` value) or options' deadline."""
    seconds = min(seconds, until - time.perf_counter())
    if model.objective == "additive":
        return _solve_additive(model, options, settings, seconds)
    assert model.lp is not None
    nvars = len(model.lp.variables())
    if nvars == 0:  # every node has a single choice: nothing to search
        return IlpRun("OPTIMAL", 0.0, 0.0, 0.0, False, {"cbc_result": "not run (no variables)"})
    now = time.perf_counter()
    deadline = options.clock().within(seconds).at
    # pulp writes the model before CBC starts, with no look at the clock (5.5 s for DLPlacer's
    # model of Inception-v3 on 16 GPUs: 335,000 rows), and reads the solution's columns
    read = IO_SECONDS_PER_VARIABLE * nvars
    write = read + IO_SECONDS_PER_ROW * model.lp.numConstraints()
    margin = _stop_margin(options, read)
    searching = deadline - now - write - 2 * margin
    if searching <= 0:  # writing it would take the time that is left: the start is the answer
        why = f"not run (writing the model takes ~{write:.2g} s)"
        return IlpRun("UNKNOWN", None, None, 0.0, True, {"cbc_result": why, "result": "UNKNOWN"})
    gap = _ratio_gap(options)  # pulp passes each option as "-name value"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PULP_CBC_CMD's notice about pulp 4
        solver = pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=max(0.1, searching),
            threads=options.threads,
            warmStart=False,  # see encode_placement
            options=[
                f"randomS {options.seed + 1}",
                f"randomC {options.seed + 1}",
                "timeMode elapsed",
                *([f"{gap[0][1:]} {gap[1]}"] if gap else []),
            ],
        )
    with tempfile.TemporaryDirectory(prefix="layerwise-cbc-") as tmp:
        solver.tmpDir = tmp
        start = time.perf_counter()
        text, killed, io = _run_cbc(model.lp, solver, deadline - margin, deadline + KILL_SECONDS)
        wall = time.perf_counter() - start
    log = {**parse_log(text), **io}
    if killed:
        log.update(result="UNKNOWN", stopped=True, cbc_result="stopped at the time limit")
    status = log["result"]
    objective = log.get("objective")
    bound = log.get("bound", objective if status == "OPTIMAL" else None)
    return IlpRun(status, objective, bound, wall, bool(log["stopped"]), log)


def _solve_additive(
    model: IlpModel, options: SolveOptions, settings: IlpSettings, seconds: float
) -> IlpRun:
    """Write the sparse model and its MIP start, run CBC's binary, read its solution."""
    ap, sel = model.ap, model.sel
    start = time.perf_counter()
    if ap is None:  # the reductions proved infeasibility
        return IlpRun("INFEASIBLE", None, None, 0.0, False, {"cbc_result": "not run (infeasible)"})
    prog = ap.program
    if prog.num_columns == 0:  # every node has a single choice: nothing to search
        return IlpRun("OPTIMAL", 0.0, 0.0, 0.0, False, {"cbc_result": "not run (no variables)"},
                      np.zeros(0))  # fmt: skip
    deadline = options.clock().within(seconds).at
    io_seconds = IO_SECONDS_PER_TERM * (prog.num_terms + prog.num_columns)
    lp_stats: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="layerwise-cbc-") as tmp:
        mps, sol, mst, log = (Path(tmp) / f for f in ("m.mps", "m.sol", "m.mst", "m.log"))
        write_mps(prog, mps)
        written = time.perf_counter()
        if sel is not None and settings.lp_start:
            lp_stats = _lp_start(model, options, mps, Path(tmp), deadline, io_seconds)
        if stop_requested():  # Ctrl-C while the LP start ran: no CBC run after it
            parsed = {**lp_stats, "result": "UNKNOWN", "stopped": True,
                      "cbc_result": "not run (stopped)"}  # fmt: skip
            wall = time.perf_counter() - start
            return IlpRun("UNKNOWN", None, lp_stats.get("lp_bound"), wall, True, parsed)
        args = [_cbc_path(), str(mps)]
        if model.warm is not None and sel is not None:
            pos = sel.positions(model.warm)
            assert pos is not None
            x = assignment(ap, sel, pos)
            given = np.flatnonzero(prog.integer | (x != 0))  # CBC needs the chain's sums too
            write_start(mst, given, x[given])
            args += ["-mips", str(mst)]
        started = time.perf_counter()
        # CBC checks its own limit only now and then (and stops late when the machine is
        # busy), so it gets less than is left, a SIGINT a little before the deadline and a
        # kill a little after it
        margin = _stop_margin(options, io_seconds)
        seconds = deadline - started - margin
        args += ["-timeMode", "elapsed", "-sec", f"{max(0.1, seconds - margin):.2f}",
                 "-threads", str(options.threads),
                 "-randomS", str(options.seed + 1), "-randomC", str(options.seed + 1),
                 *_ratio_gap(options, model.offset),
                 "-solve", "-printingOptions", "normal", "-solution", str(sol)]  # fmt: skip
        stop_at = deadline - margin
        kill_at = deadline + KILL_SECONDS
        proc = run_cbc(args, log, stop_at, kill_at, _should_stop(options),
                       _bound_reporter(model, options))  # fmt: skip
        parsed = parse_log(proc.text)
        parsed.update(lp_stats, cbc_peak_mib=proc.peak_mib)
        values = None
        if not proc.killed and sol.exists():
            status_line, values = read_solution(sol, prog.num_columns)
            parsed["solution_status"] = status_line
        elif proc.returncode < 0 and not proc.killed and not proc.interrupted:
            # CBC's binary crashes now and then on a restricted round (signal 11, seen
            # about once in ten runs of tests/test_lns.py): that run has no answer, the
            # search keeps its best so far
            logger.warning("CBC crashed (signal %d): this run has no answer", -proc.returncode)
            parsed["cbc_crashed"] = -proc.returncode
        elif not proc.killed and not proc.interrupted:
            raise BackendError(f"CBC failed (exit {proc.returncode}): {proc.text[-500:]}")
    parsed["write_seconds"] = written - start
    if proc.killed or values is None:
        why = "killed past the time limit" if proc.killed else "stopped before writing a solution"
        if "cbc_crashed" in parsed:
            why = f"crashed (signal {parsed['cbc_crashed']})"
        parsed.update(result="UNKNOWN", stopped=True, cbc_result=why)
    elif proc.interrupted:
        parsed["stopped"] = True
    status = parsed["result"]
    if values is not None and status == "UNKNOWN" and "objective" not in parsed:
        values = None  # CBC wrote no solution
    objective = parsed.get("objective")
    bound = parsed.get("bound", objective if status == "OPTIMAL" else None)
    if "lp_bound" in parsed:  # the root LP, optimal: a bound even when CBC says nothing
        bound = max(bound if bound is not None else -math.inf, parsed["lp_bound"])
    wall = time.perf_counter() - start
    return IlpRun(status, objective, bound, wall, bool(parsed["stopped"]), parsed, values)


def _bound_reporter(model: IlpModel, options: SolveOptions) -> Callable[[float], None] | None:
    """CBC's bounds as it proves them, in real units, to `options.channel.on_bound` (the
    portfolio's shared bound), when the caller listens."""
    on_bound = options.channel.on_bound
    if on_bound is None:
        return None
    scale, offset = model.scale, model.offset
    return lambda bound: on_bound((bound + offset) / scale * (1 - 1e-12), "ilp")


def _should_stop(options: SolveOptions) -> Callable[[], bool]:
    """A stop request: the user's (Ctrl-C) or the caller's (`options.channel.stop`)."""
    event = options.channel.stop
    return lambda: stop_requested() or (event is not None and event.is_set())


def _lp_start(
    model: IlpModel, options: SolveOptions, mps: Path, tmp: Path, deadline: float, io: float
) -> dict[str, Any]:
    """The LP relaxation (CBC's -initialSolve, i.e. CLP) rounded to each node's largest x,
    repaired and improved (`backends.heuristics.feasible`): the start when it beats the current one
    (reported to `options.channel.on_incumbent`), and the LP optimum as a bound. Skipped when it would
    take more than LP_FRACTION of the time left."""
    ap, sel = model.ap, model.sel
    assert ap is not None and sel is not None
    now = time.perf_counter()
    left = deadline - now
    if LP_SECONDS_PER_TERM * ap.program.num_terms > LP_FRACTION * left:
        return {"lp_start": "skipped (too large for the time left)"}
    sol, log = tmp / "lp.sol", tmp / "lp.log"
    args = [_cbc_path(), str(mps), "-timeMode", "elapsed", "-sec", f"{LP_FRACTION * left:.2f}",
            "-initialSolve", "-printingOptions", "normal", "-solution", str(sol)]  # fmt: skip
    stop = now + LP_FRACTION * left
    proc = run_cbc(args, log, stop, min(stop + 1.0, deadline), _should_stop(options))
    out: dict[str, Any] = {"lp_seconds": time.perf_counter() - now}
    if proc.killed or not sol.exists():
        return {**out, "lp_start": "no LP solution in time"}
    status, x = read_solution(sol, ap.program.num_columns)
    if status.startswith("Optimal"):
        value = float(status.rsplit(" ", 1)[-1])
        out["lp_bound"] = value  # scaled, without the offset (as CBC's bound)
        report = _bound_reporter(model, options)
        if report is not None:
            report(value)
    polish = min(deadline, time.perf_counter() + LP_FRACTION * left)
    choices, out["lp_start"] = rounded_lp_start(sel, ap, x, model.warm, polish)
    if choices is not None:
        model.warm, model.hint = choices, "lp_rounding"
        callback = options.channel.on_incumbent
        if callback is not None:
            callback(choices, "ilp")
    return out


def _cbc_path() -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PULP_CBC_CMD's notice about pulp 4
        path = pulp.PULP_CBC_CMD().path
    if not path or not os.path.exists(path):
        raise BackendError("the ilp backend needs CBC: pulp's bundled binary was not found")
    return str(path)


def _run_cbc(
    lp: pulp.LpProblem, solver: Any, stop_at: float, kill_at: float
) -> tuple[str, bool, dict[str, float]]:
    """pulp's COIN_CMD.solve_CBC (same files, options and -mips warm start; only the nonzero
    columns of the solution are printed and read) under `backends.mathprog.cbc.run_cbc`'s
    stop and kill. Returns CBC's output, whether it was killed (then nothing is read: its
    solution is lost) and the seconds spent writing the model and reading the solution."""
    t0 = time.perf_counter()
    mps, sol, mst, log_path = solver.create_tmp_files(lp.name, "mps", "sol", "mst", "log")
    vs, var_names, con_names, _ = lp.writeMPS(mps, rename=1)
    io = {"write_seconds": time.perf_counter() - t0}
    args = [solver.path, mps]
    if solver.optionsDict.get("warmStart"):
        solver.writesol(mst, lp, vs, var_names, con_names)
        args += ["-mips", mst]
    args += ["-sec", str(solver.timeLimit)]
    for option in solver.options + solver.getOptions():
        args += ["-" + option.split()[0], *option.split()[1:]]
    args += ["-solve", "-printingOptions", "normal", "-solution", sol]
    proc = run_cbc(args, Path(log_path), stop_at, kill_at)
    if not proc.killed:
        if proc.returncode != 0 or not os.path.exists(sol):
            if proc.interrupted:  # its SIGINT came before it could write a solution
                return proc.text, True, io
            raise BackendError(f"CBC failed (exit {proc.returncode}): {proc.text[-500:]}")
        t1 = time.perf_counter()
        status, values, _, _, _, sol_status = solver.readsol_MPS(sol, lp, vs, var_names, con_names)
        lp.assignVarsVals(values)
        lp.assignStatus(status, sol_status)
        io["read_seconds"] = time.perf_counter() - t1
    return proc.text, proc.killed, io


# ------------------------------------------------------------------------------ decode


def _values(model: IlpModel) -> list[list[Any]]:
    return [
        [v if v is None or v is ALWAYS else (v.varValue or 0.0) > 0.5 for v in xs] for xs in model.x
    ]


def decode_placement(model: IlpModel, run: IlpRun) -> PlacementOutcome:
    """The placement, re-timed, and the model's bound in seconds."""
    pp = model.pp
    assert pp is not None
    stats = {"solver_status": run.status, "solver_seconds": run.wall, "hint": model.hint, **run.log}
    bound = None
    if run.bound is not None:
        bound = max(placement_lower_bound(pp), run.bound / model.scale * (1 - 1e-9))
    if run.status in ("INFEASIBLE", "UNKNOWN"):
        status = "INFEASIBLE" if run.status == "INFEASIBLE" else "NO_SOLUTION"
        return PlacementOutcome(status, None, None, bound, run.timed_out, stats)
    place = [next(d for d, v in enumerate(xs) if v is ALWAYS or v is True) for xs in _values(model)]
    start = np.array([(v.varValue or 0.0) / model.scale for v in model.start])
    schedule = retime(pp, place, start, model.order)
    status = "OPTIMAL" if run.status == "OPTIMAL" else "FEASIBLE"
    if status == "OPTIMAL":
        bound = min(bound, schedule.makespan) if bound is not None else schedule.makespan
    model_span = run.objective / model.scale if run.objective is not None else None
    return PlacementOutcome(status, schedule, model_span, bound, run.timed_out, stats)


def decode(problem: Problem, model: IlpModel, run: IlpRun, name: str = "ilp") -> SolveResult:
    """The SolveResult of a run (objective re-scored later by the Backend base class)."""
    stats: dict[str, Any] = {
        **model.stats,
        "solver_status": run.status,
        "solver_seconds": run.wall,
        "hint": model.hint,
        "warm_start_used": model.hint == "warm_start",
        "scale": model.scale,
        **{
            k: v
            for k, v in run.log.items()
            if k
            in (
                "cbc_result",
                "warm_start_accepted",
                "write_seconds",
                "last_incumbent",
                "lp_start",
                "lp_seconds",
                "lp_bound",
                "cbc_peak_mib",
            )
        },
    }
    limit = Limit.TIME if run.timed_out else None
    if model.objective == "makespan":
        return placement_result(model.pp, decode_placement(model, run), limit, stats, name)
    sel = model.sel
    assert sel is not None
    bound = (run.bound + model.offset) / model.scale if run.bound is not None else None
    if run.status == "INFEASIBLE":
        stats["reason"] = sel.infeasible or "proven by CBC"
        return SolveResult(name, Status.INFEASIBLE, bound=math.inf, stats=stats)
    if run.values is None or model.ap is None:
        if model.warm is not None:  # CBC returned nothing: the start is the answer
            stats["answer"] = model.hint
            return SolveResult(
                name, Status.FEASIBLE, model.warm, bound=_bound(sel, bound, sel.cost(model.warm)),
                limit=limit, stats=stats,
            )  # fmt: skip
        return SolveResult(name, Status.NO_SOLUTION, bound=bound, limit=limit, stats=stats)
    choices = sel.choices(positions(model.ap, run.values))
    status = Status.OPTIMAL if run.status == "OPTIMAL" else Status.FEASIBLE
    value = sel.cost(choices)
    if model.warm is not None and sel.cost(model.warm) < value:
        choices, value = model.warm, sel.cost(model.warm)  # CBC stopped before taking its start
        stats["answer"] = model.hint
    return SolveResult(name, status, choices, bound=_bound(sel, bound, value), limit=limit,
                       stats=stats)  # fmt: skip


def _bound(sel: Selection, bound: float | None, value: float) -> float:
    """CBC's bound (or the trivial one), never above the answer's value (CBC's tolerances)."""
    found = bound if bound is not None else sel.trivial_bound()
    return min(max(found, sel.trivial_bound()), value) * (1 - 1e-12)


# ----------------------------------------------------------------------------- backend


class IlpBackend(SolverBackend[IlpSettings, IlpModel, IlpRun]):
    name = "ilp"
    REQUIRED_MODULES = ("pulp",)
    settings_type = IlpSettings
    steps = SolverSteps(encode_selection, encode_placement, solve_encoded, decode_placement, decode)


_BACKEND = IlpBackend()
encode = _BACKEND.encode  # the pulp model of a Problem under options.objective
solve_placement = _BACKEND.solve_placement  # the makespan solve on a PlacementProblem
