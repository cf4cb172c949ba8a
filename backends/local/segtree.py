"""The memory profile over time as a segment tree: range add, range max, in O(log T).

An iterative (bottom-up) segment tree with lazy additions, in the style of the "efficient
segment tree" of Al.Cash (Codeforces blog 18051, 2015): `mx[k]` is the largest value in
node k's range *without* the additions held by its strict ancestors, and `ad[k]` (internal
nodes only) the addition waiting for k's children. A range add touches the O(log T) nodes
that cover the range and rebuilds the two paths to the root; a range max first pushes the
additions down the two paths of its ends, then reads the covering nodes. Leaves past the
T times hold -inf. The root `mx[1]` is the true maximum; `seg_argmax` walks down to it.

The tree of one memory pool is two float64 arrays of length 2 * size (size: the power of two
>= T); `Profile` wraps them for tests and callers outside compiled code.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "Profile",
    "seg_add",
    "seg_argmax",
    "seg_build",
    "seg_max",
    "tree_size",
]


def tree_size(num_times: int) -> int:
    """The number of leaves: the power of two >= num_times (at least 1)."""
    size = 1
    while size < num_times:
        size *= 2
    return size


@njit(cache=True)
def seg_build(mx: np.ndarray, ad: np.ndarray, values: np.ndarray) -> None:
    """Fill the tree with `values` (length <= size = len(mx) // 2); no pending additions."""
    size = len(mx) // 2
    for k in range(size):
        ad[k] = 0.0
    for t in range(size):
        mx[size + t] = values[t] if t < len(values) else -np.inf
    for k in range(size - 1, 0, -1):
        mx[k] = max(mx[2 * k], mx[2 * k + 1])


@njit(cache=True)
def _apply(mx: np.ndarray, ad: np.ndarray, k: int, v: float, size: int) -> None:
    mx[k] += v
    if k < size:
        ad[k] += v


@njit(cache=True)
def _rebuild(mx: np.ndarray, ad: np.ndarray, k: int) -> None:
    k >>= 1
    while k >= 1:
        mx[k] = max(mx[2 * k], mx[2 * k + 1]) + ad[k]
        k >>= 1


@njit(cache=True)
def _push(mx: np.ndarray, ad: np.ndarray, k: int, size: int) -> None:
    """Hand the additions on the path from the root to leaf-level node k to the children."""
    h = 0
    while (1 << (h + 1)) <= k:
        h += 1
    for s in range(h, 0, -1):
        i = k >> s
        if ad[i] != 0.0:
            _apply(mx, ad, 2 * i, ad[i], size)
            _apply(mx, ad, 2 * i + 1, ad[i], size)
            ad[i] = 0.0


@njit(cache=True)
def seg_add(mx: np.ndarray, ad: np.ndarray, lo: int, hi: int, v: float) -> None:
    """Add v to every time in [lo, hi)."""
    if lo >= hi:
        return
    size = len(mx) // 2
    left, right = lo + size, hi + size
    first, last = left, right - 1
    while left < right:
        if left & 1:
            _apply(mx, ad, left, v, size)
            left += 1
        if right & 1:
            right -= 1
            _apply(mx, ad, right, v, size)
        left >>= 1
        right >>= 1
    _rebuild(mx, ad, first)
    _rebuild(mx, ad, last)


@njit(cache=True)
def seg_max(mx: np.ndarray, ad: np.ndarray, lo: int, hi: int) -> float:
    """The largest value over [lo, hi) (-inf for an empty range)."""
    if lo >= hi:
        return -np.inf
    size = len(mx) // 2
    left, right = lo + size, hi + size
    _push(mx, ad, left, size)
    _push(mx, ad, right - 1, size)
    best = -np.inf
    while left < right:
        if left & 1:
            best = max(best, mx[left])
            left += 1
        if right & 1:
            right -= 1
            best = max(best, mx[right])
        left >>= 1
        right >>= 1
    return best


@njit(cache=True)
def seg_argmax(mx: np.ndarray, ad: np.ndarray) -> int:
    """A time at which the maximum is reached (the leftmost one)."""
    size = len(mx) // 2
    k = 1
    while k < size:
        k = 2 * k if mx[2 * k] >= mx[2 * k + 1] else 2 * k + 1
    return k - size


class Profile:
    """A segment tree over `values` for use from Python (tests, checks)."""

    def __init__(self, values: np.ndarray):
        values = np.ascontiguousarray(values, dtype=np.float64)
        size = tree_size(len(values))
        self.num_times = len(values)
        self.mx = np.empty(2 * size)
        self.ad = np.zeros(2 * size)
        seg_build(self.mx, self.ad, values)

    def add(self, lo: int, hi: int, v: float) -> None:
        seg_add(self.mx, self.ad, lo, hi, v)

    def max(self, lo: int, hi: int) -> float:
        return float(seg_max(self.mx, self.ad, lo, hi))

    def argmax(self) -> int:
        return int(seg_argmax(self.mx, self.ad))

    def values(self) -> np.ndarray:
        return np.array([self.max(t, t + 1) for t in range(self.num_times)])
