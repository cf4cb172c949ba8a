"""Device blocks of the mesh config space, shaped by a homogeneous cluster's hierarchy.

On a homogeneous cluster (`DeviceGraph.hierarchy()`: `sizes[l]` groups of level l+1 in each
group of level l, outermost first; device ids are mixed-radix digits over `sizes`) every
group of a level is interchangeable with every other: a config's t_c and t_s depend only on
its degrees and on how many groups of each level its devices span, and t_x only on the two
blocks' relative placement. So instead of every aligned block of k devices at every offset
(FlexFlow's device assignment, ~14.5 x D configs per op at 1,024 devices) the mesh space
offers, for each partition of k tasks (docs/space.md):

1. the contiguous block: devices 0 .. k-1 (fills a node before the next one);
2. the spread block, when k >= s_0 (every node takes part): s_0 nodes, then
   min(rest, s_1) groups of level 1 in each, ... (for k = s_0 one device per node, the
   strided set of today's full space; its tasks are adjacent in the task grid's last dims
   inside a node either way);
3. translates inside node 0 of a contiguous block smaller than a node (k | node size):
   devices o .. o+k-1 for o = k, 2k, ... (FlexFlow's placement of small ops side by side,
   few by construction: at most node size - 1 of them per op).

Tasks map to a block's devices in increasing device order (row-major over the levels), as
they do to every device set of the full space.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def spread_counts(sizes: Sequence[int], k: int) -> tuple[int, ...] | None:
    """Groups per level of the spread block of k devices (outer levels filled first), or None
    when k < sizes[0], k is the whole cluster, or k does not factor over the levels."""
    total = math.prod(sizes)
    if len(sizes) < 2 or k < sizes[0] or k >= total or k % sizes[0]:
        return None
    counts, rest = [], k
    for s in sizes:
        b = min(rest, s)
        if rest % b:
            return None
        counts.append(b)
        rest //= b
    return tuple(counts) if rest == 1 else None


def block_devices(sizes: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """Devices of the block with digits [0, counts[l]) at every level, in increasing order."""
    strides = [math.prod(sizes[level + 1 :]) for level in range(len(sizes))]
    devs = np.zeros(1, dtype=np.int64)
    for count, stride in zip(counts, strides, strict=True):
        devs = (devs[:, None] + stride * np.arange(count)[None, :]).ravel()
    return devs


def mesh_blocks(sizes: Sequence[int], k: int) -> np.ndarray:
    """The mesh space's device sets for a partition of k tasks: (O, k), in the order above."""
    node = math.prod(sizes[1:])
    blocks = [np.arange(k, dtype=np.int64)]
    counts = spread_counts(sizes, k)
    if counts is not None:  # it spans all s_0 nodes, the contiguous block fewer
        blocks.append(block_devices(sizes, counts))
    if k < node and node % k == 0:
        blocks += [np.arange(o, o + k, dtype=np.int64) for o in range(k, node, k)]
    return np.stack(blocks)


def max_blocks(sizes: Sequence[int]) -> int:
    """An upper bound on `len(mesh_blocks(sizes, k))` over k (for size estimates)."""
    return 2 + max(0, math.prod(sizes[1:]) - 1)
