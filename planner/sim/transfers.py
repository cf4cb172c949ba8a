"""Which producer task sends how many elements to which consumer task, without a dense table.

The region overlaps of `planner.costs.regions` for one edge and one config pair, as a sparse
list: only the (producer task, consumer task) pairs that share a sub-tensor, found per
dimension. A consumer task needs an interval of every input dimension (`needed_boxes`); the
producer tasks along that dimension are equal slices, so the ones it meets are a contiguous
run of indices, and the pairs are the product of the runs over the dimensions. Work and
memory are proportional to the pairs that move data (a data-parallel edge on 1,024 devices:
1,024 pairs, not 1,024^2 overlaps).

Volumes are products of per-dimension lengths taken in dimension order from 1.0, as
`overlap_volume` takes them, so they are the same floats.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from planner.costs.regions import needed_boxes, task_boxes
from planner.graph.opkinds import DimMap

__all__ = ["transfer_pairs"]


def transfer_pairs(
    maps: Sequence[DimMap],
    in_sizes: Sequence[int],
    producer_degrees: Sequence[int],
    out_sizes: Sequence[int],
    out_dims: Sequence[str],
    consumer_degrees: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(p, q, elements): producer task p holds `elements` of what consumer task q needs, for
    every pair with elements > 0, in row-major (p, q) order. Tasks are numbered row-major
    over their degrees."""
    k = int(np.prod(consumer_degrees))
    olo, ohi = task_boxes(out_sizes, np.array([consumer_degrees]), k)
    nlo, nhi = needed_boxes(maps, in_sizes, out_dims, olo, ohi)
    nlo, nhi = nlo[0], nhi[0]  # (k, n_in)
    q = np.arange(k)
    p = np.zeros(k, dtype=np.int64)
    vol = np.ones(k)
    for d, (size, g) in enumerate(zip(in_sizes, producer_degrees, strict=True)):
        step = size // g
        lo, hi = nlo[q, d], nhi[q, d]
        first = lo // step
        count = np.where(hi > lo, -(-hi // step) - first, 0)  # producer slices met
        rows = np.repeat(np.arange(len(q)), count)
        offset = np.arange(len(rows)) - np.repeat(np.cumsum(count) - count, count)
        index = first[rows] + offset
        length = np.minimum(hi[rows], (index + 1) * step) - np.maximum(lo[rows], index * step)
        q, p, vol = q[rows], p[rows] * g + index, vol[rows] * length
    order = np.lexsort((q, p))
    return p[order], q[order], vol[order]
