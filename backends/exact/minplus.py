"""The min-plus product of OptCNN's node elimination (Eq. 2), exact, with early termination.

    out[i, k] = min_j (a[i, j] + mid[j]) + b[j, k]

is O(C^3). Most j cannot win: node costs differ by orders of magnitude between configs,
transfers much less. `min_plus` cuts `out` into tiles of ROWS x COLS; in a tile, every j has
a lower bound lb[j] = min_i (a[i, j] + mid[j]) + min_k b[j, k] on what it can add, and the j
are visited cheapest bound first, STEP at a time, as dense numpy blocks, until the next
bound exceeds the largest entry of the tile so far: no later j can lower any entry (float
addition is monotone, so this holds after rounding too). Each term is computed as the dense
product computes it, so the result is the dense product's, bit for bit. On the zoo's tables
at 32 devices (~450 configs per op) it does a fraction of the dense work.

Long products look at the clock between tiles (`past(deadline)`) and raise `OutOfTime`, so
a time limit holds at any size.
"""

from __future__ import annotations

import numpy as np

from planner.deadline import OutOfTime, past

__all__ = ["OutOfTime", "min_plus", "min_plus_dense"]

CHUNK_ELEMENTS = 1 << 21  # elements of one temporary block (dense product)
ROWS, COLS, STEP = 64, 128, 32  # tile of `out`, and the j visited per dense step
DENSE_BELOW = 96**3  # smaller products: dense (the bounds would not pay)


def min_plus_dense(
    a: np.ndarray, mid: np.ndarray, b: np.ndarray, deadline: float = np.inf
) -> np.ndarray:
    """out[i, k] = min_j (a[i, j] + mid[j]) + b[j, k], by broadcasting in row chunks."""
    left = a + mid[None, :]
    rows = max(1, CHUNK_ELEMENTS // max(1, b.size))
    out = np.empty((a.shape[0], b.shape[1]))
    for r in range(0, a.shape[0], rows):
        if r and past(deadline):
            raise OutOfTime
        out[r : r + rows] = (left[r : r + rows, :, None] + b[None, :, :]).min(axis=1)
    return out


def min_plus(a: np.ndarray, mid: np.ndarray, b: np.ndarray, deadline: float = np.inf) -> np.ndarray:
    """out[i, k] = min_j a[i, j] + mid[j] + b[j, k]  (OptCNN Eq. 2): the dense product's
    values, computed tile by tile over the j whose lower bound can still matter."""
    n, J = a.shape
    K = b.shape[1]
    if n * J * K < DENSE_BELOW:
        return min_plus_dense(a, mid, b, deadline)
    left = a + mid[None, :]
    out = np.empty((n, K))
    for c in range(0, K, COLS):
        cols = b[:, c : c + COLS]
        col_min = cols.min(axis=1)
        for r in range(0, n, ROWS):
            if past(deadline):
                raise OutOfTime
            out[r : r + ROWS, c : c + COLS] = _tile(left[r : r + ROWS], cols, col_min)
    return out


def _tile(rows: np.ndarray, cols: np.ndarray, col_min: np.ndarray) -> np.ndarray:
    """min_j rows[:, j] + cols[j, :] over the j whose bound does not exceed the tile's max."""
    bound = rows.min(axis=0) + col_min
    order = np.argsort(bound, kind="stable")
    bound = bound[order]
    js = order[:STEP]
    tile = (rows[:, js, None] + cols[js][None, :, :]).min(axis=1)
    for s in range(STEP, len(order), STEP):
        if bound[s] > tile.max():
            break
        js = order[s : s + STEP]
        np.minimum(tile, (rows[:, js, None] + cols[js][None, :, :]).min(axis=1), out=tile)
    return tile
