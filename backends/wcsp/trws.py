"""Sequential tree-reweighted message passing (TRW-S) over a `Network`, compiled with numba.

Kolmogorov, "Convergent tree-reweighted message passing for energy minimization", IEEE
TPAMI 28(10), 2006: nodes are visited in one order and then in reverse; at node i with
theta_hat_i = theta_i + sum of the messages into i, the message to each neighbour j later in
the order (earlier, on the way back) becomes (Eq. 20, with monotone chains)

    m_ij(x_j) = min_{x_i} [ gamma_i * theta_hat_i(x_i) - m_ji(x_i) + theta_ij(x_i, x_j) ],
    gamma_i = 1 / max(#neighbours before i, #neighbours after i),

normalized to min 0. Messages define a reparametrization: theta'_i = theta_i + sum_j m_ji,
theta'_ij(x_i, x_j) = theta_ij - m_ij(x_j) - m_ji(x_i), which leaves every assignment's
energy unchanged. Any reparametrization gives a lower bound (the dual of the local polytope
relaxation): here each edge goes to the star of one of its ends and the bound is the sum over
nodes of min_x [theta'_i(x) + sum of its edges' row minima] (`star_bound`, the better of the
two ownerships). It is valid whatever state the messages are in, so the search may stop at
any time. `decode` labels the nodes in the order, each given its already labelled neighbours
and the messages from the rest (TRW-S's own primal rule, Sec. 5.1).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["Incidence", "decode", "incidence", "passes", "star_bound"]

Incidence = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def incidence(noff: np.ndarray, eu: np.ndarray, ev: np.ndarray) -> Incidence:
    """(ioff, iedge, iside, gamma): node i's edges are iedge[ioff[i]:ioff[i+1]], iside 0
    where i is the edge's lower end; gamma as in the module docstring."""
    n = len(noff) - 1
    ends = np.concatenate([eu, ev])
    order = np.argsort(ends, kind="stable")
    iedge = np.concatenate([np.arange(len(eu)), np.arange(len(ev))])[order].astype(np.int64)
    iside = np.concatenate([np.zeros(len(eu)), np.ones(len(ev))])[order].astype(np.int64)
    ioff = np.concatenate([[0], np.cumsum(np.bincount(ends, minlength=n))]).astype(np.int64)
    later = np.bincount(eu, minlength=n)
    earlier = np.bincount(ev, minlength=n)
    gamma = 1.0 / np.maximum(np.maximum(later, earlier), 1)
    return ioff, iedge, iside, gamma


def messages(noff: np.ndarray, eu: np.ndarray, ev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Zero messages: (to the lower end, to the higher end), each flat with `moff` offsets."""
    dom = np.diff(noff)
    return np.zeros(int(dom[eu].sum())), np.zeros(int(dom[ev].sum()))


@njit(cache=True)
def _offsets(noff, eu, ev):  # pragma: no cover - compiled
    k = len(eu)
    mu = np.zeros(k + 1, dtype=np.int64)
    mv = np.zeros(k + 1, dtype=np.int64)
    for e in range(k):
        mu[e + 1] = mu[e] + noff[eu[e] + 1] - noff[eu[e]]
        mv[e + 1] = mv[e] + noff[ev[e] + 1] - noff[ev[e]]
    return mu, mv


@njit(cache=True)
def _hat(i, noff, unary, ioff, iedge, iside, mu, mv, msg_u, msg_v, out):  # pragma: no cover
    d = noff[i + 1] - noff[i]
    for s in range(d):
        out[s] = unary[noff[i] + s]
    for k in range(ioff[i], ioff[i + 1]):
        e = iedge[k]
        if iside[k] == 0:
            for s in range(d):
                out[s] += msg_u[mu[e] + s]
        else:
            for s in range(d):
                out[s] += msg_v[mv[e] + s]


@njit(cache=True)
def passes(
    rounds, noff, unary, eu, ev, eoff, binary, ioff, iedge, iside, gamma, msg_u, msg_v
):  # pragma: no cover - compiled
    """`rounds` forward + backward TRW-S passes, updating msg_u / msg_v in place."""
    n = len(noff) - 1
    mu, mv = _offsets(noff, eu, ev)
    dmax = 1
    for i in range(n):
        dmax = max(dmax, noff[i + 1] - noff[i])
    hat = np.empty(dmax)
    new = np.empty(dmax)
    for _ in range(rounds):
        for step in range(2 * n):
            forward = step < n
            i = step if forward else 2 * n - 1 - step
            _hat(i, noff, unary, ioff, iedge, iside, mu, mv, msg_u, msg_v, hat)
            g = gamma[i]
            for k in range(ioff[i], ioff[i + 1]):
                e = iedge[k]
                side = iside[k]
                du = noff[eu[e] + 1] - noff[eu[e]]
                dv = noff[ev[e] + 1] - noff[ev[e]]
                base = eoff[e]
                if forward and side == 0:  # i = u, message to v
                    _send(hat, g, msg_u, mu[e], du, dv, binary, base, dv, 1, new, msg_v, mv[e])
                elif not forward and side == 1:  # i = v, message to u
                    _send(hat, g, msg_v, mv[e], dv, du, binary, base, 1, dv, new, msg_u, mu[e])


@njit(cache=True)
def _send(
    hat,
    g,
    msg_in,
    off_in,
    d_from,
    d_to,
    binary,
    base,
    stride_from,
    stride_to,
    new,
    msg_out,
    off_out,
):  # pragma: no cover - compiled
    """One TRW-S message (Eq. 20 of the module docstring): from a node whose reparametrized
    unaries are `hat` (weighted by `g`, less the message it received on this edge) to the
    other end, the min over its values of the edge's table; normalized to a minimum of 0.
    The edge's entry for (from s, to t) is binary[base + s * stride_from + t * stride_to]."""
    for t in range(d_to):
        new[t] = np.inf
    for s in range(d_from):
        h = g * hat[s] - msg_in[off_in + s]
        row = base + s * stride_from
        for t in range(d_to):
            c = h + binary[row + t * stride_to]
            if c < new[t]:
                new[t] = c
    low = np.inf
    for t in range(d_to):
        low = min(low, new[t])
    for t in range(d_to):
        msg_out[off_out + t] = new[t] - low


@njit(cache=True)
def star_bound(
    noff, unary, eu, ev, eoff, binary, ioff, iedge, iside, msg_u, msg_v, arg
):  # pragma: no cover - compiled
    """The lower bound of the reparametrization the messages define (module docstring): the
    better of the edges owned by their lower ends and by their higher ends. `arg` receives
    each node's minimizing value in its star: the bound's supergradient in the unary costs."""
    n = len(noff) - 1
    mu, mv = _offsets(noff, eu, ev)
    best = -np.inf
    mins = np.empty(n, dtype=np.int64)
    for owner in range(2):
        star = np.empty(noff[n])
        for i in range(n):
            _hat(i, noff, unary, ioff, iedge, iside, mu, mv, msg_u, msg_v, star[noff[i] :])
        for e in range(len(eu)):
            du = noff[eu[e] + 1] - noff[eu[e]]
            dv = noff[ev[e] + 1] - noff[ev[e]]
            base = eoff[e]
            if owner == 0:
                for s in range(du):
                    low = np.inf
                    for t in range(dv):
                        c = binary[base + s * dv + t] - msg_v[mv[e] + t]
                        if c < low:
                            low = c
                    star[noff[eu[e]] + s] += low - msg_u[mu[e] + s]
            else:
                for t in range(dv):
                    low = np.inf
                    for s in range(du):
                        c = binary[base + s * dv + t] - msg_u[mu[e] + s]
                        if c < low:
                            low = c
                    star[noff[ev[e]] + t] += low - msg_v[mv[e] + t]
        total = 0.0
        for i in range(n):
            low = np.inf
            mins[i] = 0
            for s in range(noff[i], noff[i + 1]):
                if star[s] < low:
                    low = star[s]
                    mins[i] = s - noff[i]
            total += low
        if total > best or owner == 0:
            best = total
            arg[:] = mins
    return best


@njit(cache=True)
def decode(
    noff, unary, eu, ev, eoff, binary, ioff, iedge, iside, msg_u, msg_v
):  # pragma: no cover - compiled
    """A labelling in node order: each node's best value given its labelled (earlier)
    neighbours' tables and the messages from its later ones."""
    n = len(noff) - 1
    mu, mv = _offsets(noff, eu, ev)
    x = np.zeros(n, dtype=np.int64)
    dmax = 1
    for i in range(n):
        dmax = max(dmax, noff[i + 1] - noff[i])
    score = np.empty(dmax)
    for i in range(n):
        d = noff[i + 1] - noff[i]
        for s in range(d):
            score[s] = unary[noff[i] + s]
        for k in range(ioff[i], ioff[i + 1]):
            e = iedge[k]
            if iside[k] == 0:  # a later neighbour: its message
                for s in range(d):
                    score[s] += msg_u[mu[e] + s]
            else:  # an earlier, labelled one: the table's row
                dv = d
                row = eoff[e] + x[eu[e]] * dv
                for s in range(d):
                    score[s] += binary[row + s]
        best = 0
        for s in range(1, d):
            if score[s] < score[best]:
                best = s
        x[i] = best
    return x
