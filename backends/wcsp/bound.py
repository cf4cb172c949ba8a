"""A lower bound for any cost-table Problem: Lagrangian relaxation of the memory rows over
the local-polytope dual of the pairwise problem. Other backends may call `lower_bound`.

The memory rule asks, at every time step t and pool m, sum of the usages of the nodes live at
t <= limit_m. Pricing each row with a multiplier lambda_tm >= 0 and moving it into the
objective (Lagrangian relaxation; Fisher, "The Lagrangian relaxation method for solving
integer programming problems", Management Science 1981) gives, for every lambda >= 0,

    L(lambda) = min_x [ f(x) + sum_i sum_m P_im * usage_i(x_i, m) ] - sum_tm lambda_tm limit_m
                <= the optimum,

with P_im = the sum of lambda_tm over the steps node i is live: a pairwise problem again,
its unary costs raised by the prices. Its minimum is bounded below by any reparametrization of
the local polytope dual, which TRW-S (`backends.wcsp.trws`; Kolmogorov 2006) improves
monotonically; `star_bound` reads a valid bound off the messages at any time. So every value
this module reports is a valid lower bound, whenever it stops.

The multipliers follow projected subgradient steps (Polyak's step to a target: the best
answer known, or 5% above the best bound if that is lower): the subgradient is the usage profile of TRW-S's
labelling minus the limit, so steps over full gain price, the others lose it. Messages are
kept from one lambda to the next (warm start).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from backends.wcsp import trws
from backends.wcsp.contract import Contraction
from backends.wcsp.memory import Steps, node_prices, profile, steps
from backends.wcsp.network import Network, build_network
from planner.deadline import Deadline, past
from planner.problems.problem import Problem
from planner.result import proven_within

__all__ = ["Lagrangian", "lower_bound"]

DEFLECT = 0.3  # share of the previous direction in the next step
PATIENCE = 60  # steps without a better bound before the step size is halved (IOPDDL S,
# TRW-S alone, 120 s: 8 gave 1.422e9, halving the step within a minute to 1/2,000; 60 gave
# 1.451e9 and still rose)
MARGIN = 1e-12  # relative: float rounding of the sums may not lift a bound above the optimum


def lower_bound(problem: Problem, deadline: Deadline, upper: float | None = None) -> float:
    """A proven lower bound of `problem`'s additive optimum (memory rule included), improved
    until `deadline` (or a stop request) or until it stops improving; `upper`, the cost of an
    answer if one is known, steers the multipliers. inf when no answer avoids the forbidden
    choices; -inf only if nothing could be computed."""
    if problem.num_nodes == 0:  # nothing to choose: the network's arrays need a node
        return 0.0
    net = build_network(problem, deadline)
    return Lagrangian(net, steps(problem)).run(deadline, upper)


@dataclass
class Lagrangian:
    """The relaxation's state: multipliers `lam` (T, M), TRW-S messages, the best bound and
    the multipliers that gave it. `run` may be called again to continue.

    With a `contraction` of `net` (`backends.wcsp.contract`), TRW-S runs on the contracted
    network, its unary costs the priced ones folded along the trees: the same minimum for
    every price, the same local-polytope bound or a tighter one (the functional nodes are
    eliminated exactly), and on the contest's tables a smaller network (IOPDDL S: 28,526 ->
    7,390 nodes, twice the steps per second, 1.496e9 instead of 1.449e9 in 120 s; the
    published bound is 1.511e9). Labellings are given, and
    usages counted, in `net`'s domain indices either way; `msg_u`, `msg_v` and `unary` are
    the network's TRW-S runs on (`solved`)."""

    net: Network
    st: Steps | None
    passes_per_step: int = 3
    patience: int = PATIENCE
    contraction: Contraction | None = None
    best: float = -math.inf
    best_lam: np.ndarray | None = None
    iterations: int = 0
    tolerance: float = 0.0  # the relative gap at which `run` stops (`SolveOptions.gap_tolerance`)
    on_bound: Callable[[float], None] | None = None  # called with each better bound
    lam: np.ndarray = field(init=False)
    solved: Network = field(init=False)

    def __post_init__(self) -> None:
        net = self.solved = self.net if self.contraction is None else self.contraction.net
        self.inc = trws.incidence(net.noff, net.eu, net.ev)
        self.msg_u, self.msg_v = trws.messages(net.noff, net.eu, net.ev)
        self.count = self.st.count if self.st is not None else 0
        pools = self.net.usage.shape[1]
        self.lam = np.zeros((self.count, pools))
        self.dom = self.net.dom
        self.mu = 1.0
        self.stall = 0
        self.direction: np.ndarray | None = None
        self.best_msgs = (self.msg_u.copy(), self.msg_v.copy())
        ends = (net.eoff[:-1], net.eu, net.ev, net.noff)
        self.rows = ends

    def valid(self, x: np.ndarray) -> bool:
        """Whether labelling x of the solved network avoids every forbidden pair."""
        eoff, eu, ev, noff = self.rows
        dv = noff[ev + 1] - noff[ev]
        return bool(np.isfinite(self.solved.binary[eoff + x[eu] * dv + x[ev]]).all())

    def lift(self, x: np.ndarray) -> np.ndarray:
        """A labelling of the solved network in `net`'s domain indices."""
        return x if self.contraction is None else self.contraction.lift(x)

    def unary(self, lam: np.ndarray | None = None) -> np.ndarray:
        """The solved network's unary costs with the usages priced by `lam` (default: the
        current multipliers)."""
        priced = self.net.unary
        if self.st is not None and self.count:
            prices = node_prices(self.st, self.lam if lam is None else lam)  # (n, M)
            per_value = np.repeat(prices, self.dom, axis=0)
            with np.errstate(over="ignore", invalid="ignore"):
                charge = per_value * self.net.usage
            if not np.isfinite(prices).all():  # overflowed: no answer keeps the limit, and
                charge[self.net.usage == 0] = 0.0  # a price on no usage costs nothing (not NaN)
            priced = priced + charge.sum(axis=1)
        return priced if self.contraction is None else self.contraction.unary(priced)

    def step(self, upper: float | None) -> tuple[float, np.ndarray]:
        """TRW-S passes at the current multipliers, the bound they prove, then a subgradient
        step; returns (the bound, the labelling in `net`'s domain indices)."""
        net, (ioff, iedge, iside, gamma) = self.solved, self.inc
        unary = self.unary()
        trws.passes(
            self.passes_per_step, net.noff, unary, net.eu, net.ev, net.eoff, net.binary,
            ioff, iedge, iside, gamma, self.msg_u, self.msg_v,
        )  # fmt: skip
        arg = np.zeros(net.num_nodes, dtype=np.int64)
        pair = trws.star_bound(
            net.noff, unary, net.eu, net.ev, net.eoff, net.binary,
            ioff, iedge, iside, self.msg_u, self.msg_v, arg,
        )  # fmt: skip
        x = trws.decode(
            net.noff, unary, net.eu, net.ev, net.eoff, net.binary,
            ioff, iedge, iside, self.msg_u, self.msg_v,
        )  # fmt: skip
        self.iterations += 1
        if not math.isfinite(pair):
            return (pair if pair == math.inf else -math.inf), self.lift(x)
        value = pair
        if self.st is not None and self.count:
            value = pair - float((self.lam.sum(axis=0) * self.st.limit).sum())
        value -= MARGIN * abs(value)
        if value > self.best:
            self.best, self.best_lam = value, self.lam.copy()
            self.best_msgs = (self.msg_u.copy(), self.msg_v.copy())
            self.stall = 0
            if self.on_bound is not None:
                self.on_bound(value)
        else:
            self.stall += 1
            if self.stall >= self.patience:  # Polyak's step overshoots near the top
                self.mu, self.stall = max(self.mu / 2, 1e-4), 0
        if self.st is not None and self.count:
            if value < self.best - 0.5 * abs(self.best) and self.best_lam is not None:
                self.lam, self.mu = self.best_lam.copy(), max(self.mu / 2, 1e-4)  # diverged
                self.msg_u, self.msg_v = (m.copy() for m in self.best_msgs)
                self.direction = None
            else:
                self._subgradient(self.lift(x if self.valid(x) else arg), value, upper)
        return value, self.lift(x)

    def _subgradient(self, arg: np.ndarray, value: float, upper: float | None) -> None:
        """A projected step along the bound's supergradient: the usage profile of each
        node's minimizing value in its star (in `net`'s indices), minus the limit."""
        assert self.st is not None
        use = self.net.usage[self.net.noff[:-1] + arg]  # (n, M)
        g = profile(self.st, use, self.count) - self.st.limit
        if self.direction is not None:  # deflected (Barahona and Anbil 2000): less zigzag
            g = (1 - DEFLECT) * g + DEFLECT * self.direction
        self.direction = g
        g = g.copy()
        g[(self.lam <= 0) & (g < 0)] = 0.0  # projected: no price to take away
        norm = float((g * g).sum())
        if norm == 0:
            return
        best = max(self.best, value)
        # an answer far above the bound would make Polyak's step overshoot: at most 5% above
        target = best + 0.05 * abs(best) + 1
        if upper is not None and upper > best:
            target = min(target, upper)
        self.lam = np.maximum(0.0, self.lam + self.mu * (target - value) / norm * g)

    def _least_overfills(self) -> bool:
        """Whether every node at its least usage already breaks a memory row: no answer is
        valid (the multipliers would only grow until they overflow)."""
        if self.st is None or not self.count:
            return False
        least = np.minimum.reduceat(self.net.usage, self.net.noff[:-1], axis=0)
        return bool((profile(self.st, least, self.count) > self.st.limit).any())

    def run(
        self,
        deadline: Deadline,
        upper: float | None = None,
        on_labelling: Callable[[np.ndarray], float | None] | None = None,
        max_steps: int | None = None,
    ) -> float:
        """Steps until `deadline`, `max_steps`, no gain, or a bound that proves `upper`
        within `tolerance`; the best bound. `on_labelling` sees every labelling and may
        return the cost of an answer it made of it (which becomes the target `upper`)."""
        if self.net.empty is not None or self._least_overfills():
            self.best = math.inf
            return math.inf
        flat, done = 0, 0
        while not past(deadline.at) and (max_steps is None or done < max_steps):
            before = self.best
            value, x = self.step(upper)
            done += 1
            if value == math.inf:
                self.best = math.inf
                break
            if on_labelling is not None:
                cost = on_labelling(x)
                if cost is not None and (upper is None or cost < upper):
                    upper = cost
            if proven_within(upper, self.best, self.tolerance):
                break  # proven within the tolerance: nothing left worth closing
            gained = self.best - before
            flat = flat + 1 if gained <= 1e-7 * max(abs(self.best), 1.0) else 0
            if self.st is None or self.count == 0:
                if flat >= 3:
                    break
            elif flat >= 200 and self.mu <= 1e-3:
                break
        return self.best
