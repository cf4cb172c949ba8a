"""Sub-tensor regions of tasks and their overlaps: the transfer plan behind t_x.

A task of a config owns a box of its op's output tensor (equal partitions, row-major task
order). A consumer task needs a box of each input tensor, derived per dimension from its
output box by the op kind's `DimMap` (same range, whole dimension, conv/pool window with its
halo, concat offset). The bytes producer task p must send to consumer task q are the volume
of the intersection of p's output box with q's input box.

Everything here is computed per dimension and vectorized over all partitions at once:
boxes are arrays (P, T, n) of [lo, hi) bounds for P partitions, T task slots (padded with
empty boxes) and n dims. The runtime imports `task_boxes` and `needed_boxes` so the
transfers it performs are the ones the cost model prices.

Contraction splits (`ParallelConfig.reduce`) fit the same box algebra through `edge_grid`:
a producer whose r tasks hold partial sums of each box gets one more tensor dim of size r
(task j holds [j, j+1) of it) that every consumer task reads whole, so each consumer task
receives all r partials of its box (r x the volume: a reduce-scatter when the consumer
splits the box r ways, a reduce when one task reads it); a consumer that splits its sum r
ways gets one more output dim, of the contracted length, which the contracted input dim
follows, so task j reads its 1/r of that dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.errors import ConfigError
from planner.graph.opkinds import REDUCE, DimMap, contraction

if TYPE_CHECKING:
    from planner.graph.opgraph import Op


def task_index(partitions: np.ndarray, slots: int) -> np.ndarray:
    """Row-major task multi-indices: (P, slots, n); slots beyond a partition's tasks are -1."""
    parts = np.asarray(partitions, dtype=np.int64)
    P, n = parts.shape
    idx = np.full((P, slots, n), -1, dtype=np.int64)
    t = np.arange(slots)
    ntasks = parts.prod(axis=1)
    rem = np.broadcast_to(t, (P, slots)).copy()
    for d in range(n - 1, -1, -1):
        idx[:, :, d] = rem % parts[:, d : d + 1]
        rem //= parts[:, d : d + 1]
    idx[t[None, :] >= ntasks[:, None]] = -1
    return idx


def task_boxes(
    sizes: Sequence[int], partitions: np.ndarray, slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """Output boxes [lo, hi) of every task of every partition: two (P, slots, n) arrays."""
    parts = np.asarray(partitions, dtype=np.int64)
    size = np.asarray(sizes, dtype=np.int64)[None, None, :]
    idx = task_index(parts, slots)
    step = size // parts[:, None, :]
    lo = idx * step
    hi = lo + step
    empty = idx < 0
    lo[empty] = 0
    hi[empty] = 0
    return lo, hi


def needed_boxes(
    maps: Sequence[DimMap],
    in_sizes: Sequence[int],
    out_dims: Sequence[str],
    out_lo: np.ndarray,
    out_hi: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Input boxes that consumer tasks need, from their output boxes (P, T, n_out).

    Returns two (P, T, n_in) arrays; empty task slots (lo == hi on every dim) stay empty.
    """
    P, T, _ = out_lo.shape
    n_in = len(in_sizes)
    lo = np.zeros((P, T, n_in), dtype=np.int64)
    hi = np.zeros((P, T, n_in), dtype=np.int64)
    empty = (out_hi <= out_lo).all(axis=2) if out_lo.shape[2] else np.zeros((P, T), bool)
    for d, (m, size) in enumerate(zip(maps, in_sizes, strict=True)):
        if m.kind == "full":
            lo[:, :, d], hi[:, :, d] = 0, size
            continue
        k = list(out_dims).index(m.out_dim)
        olo, ohi = out_lo[:, :, k], out_hi[:, :, k]
        if m.kind == "same":
            a, b = olo, ohi
        elif m.kind == "window":
            extent = m.dilation * (m.kernel - 1) + 1
            a = olo * m.stride - m.pad
            b = (ohi - 1) * m.stride - m.pad + extent
        elif m.kind == "group":  # whole input heads of the query heads' groups
            per = m.per_input_head
            a = (olo // per) * m.kernel
            b = -(-ohi // per) * m.kernel
        else:  # offset: the input sits at [offset, offset + size) of the output
            a, b = olo - m.offset, ohi - m.offset
        a = np.clip(a, 0, size)
        b = np.clip(b, 0, size)
        lo[:, :, d], hi[:, :, d] = a, np.maximum(a, b)
    lo[empty] = 0
    hi[empty] = 0
    return lo, hi


def overlap_volume(
    lo_a: np.ndarray, hi_a: np.ndarray, lo_b: np.ndarray, hi_b: np.ndarray
) -> np.ndarray:
    """Elements shared by every box pair: (Pa, Ta, n) x (Pb, Tb, n) -> (Pa, Ta, Pb, Tb)."""
    Pa, Ta, n = lo_a.shape
    Pb, Tb, _ = lo_b.shape
    vol = np.ones((Pa, Ta, Pb, Tb), dtype=np.float64)
    for d in range(n):
        top = np.minimum(hi_a[:, :, d][:, :, None, None], hi_b[:, :, d][None, None, :, :])
        bot = np.maximum(lo_a[:, :, d][:, :, None, None], lo_b[:, :, d][None, None, :, :])
        vol *= np.clip(top - bot, 0, None)
    return vol


@dataclass(frozen=True)
class EdgeGrid:
    """An edge seen by one producer and one consumer task grid (`ParallelConfig.grid`):
    per dim of the producer's tensor its map (`maps`) and size (`in_sizes`), and the
    consumer grid's sizes and dims (`out_sizes`, `out_dims`)."""

    maps: tuple[DimMap, ...]
    in_sizes: tuple[int, ...]
    out_sizes: tuple[int, ...]
    out_dims: tuple[str, ...]


def edge_grid(
    src: Op, dst: Op, position: int, maps: Sequence[DimMap], ru: int = 1, rv: int = 1
) -> EdgeGrid:
    """The edge from `src` to input `position` of `dst` (whose dims follow `maps`) when the
    producer's contraction degree is `ru` and the consumer's `rv` (module docstring)."""
    in_sizes, out_sizes = tuple(src.output.sizes), tuple(dst.output.sizes)
    out_dims, grid_maps = tuple(dst.output.dims), list(maps)
    if rv > 1:
        con = contraction(dst)
        if con is None:
            raise ConfigError(f"op {dst.name!r} has no sum to split {rv} ways")
        out_sizes, out_dims = (*out_sizes, con.size), (*out_dims, REDUCE)
        if position == con.position:
            d = src.output.dims.index(con.dim)
            if contraction(dst, src.output) is None:
                raise ConfigError(
                    f"op {dst.name!r} sums over {con.size} elements of input {src.name!r} "
                    f"{dict(src.output.shape)}, more than its {con.dim}: it cannot split "
                    f"its sum (reduce {rv}); give it reduce 1"
                )
            grid_maps[d] = DimMap("same", REDUCE)
    if ru > 1:
        in_sizes = (*in_sizes, ru)
        grid_maps.append(DimMap("full"))
    return EdgeGrid(tuple(grid_maps), in_sizes, out_sizes, out_dims)
