"""t_x tables for every config pair of an edge (OptCNN Sec. 5.1), without every task pair.

t_x(e, c_u, c_v) = slowest receiver forward + slowest receiver backward, where a receiving
device sums, over the tasks on other devices whose regions overlap its task's, the bytes
times the route's seconds per byte plus one message cost each (`CostModel.transfer_time`
computes this directly, task pair by task pair).

**Hierarchical path.** On a homogeneous cluster (`DeviceGraph.hierarchy()`, levels 0 .. L-1,
outermost first) the route between two devices costs `w_l` seconds per byte and `m_l` per
message, l being the outermost level where their digits differ. So the forward time of a
consumer task q is a per-level sum:

    fwd(q) = sum_{l < L} w_l * (S_l(q) - S_{l+1}(q)) * bytes + m_l * (M_l(q) - M_{l+1}(q))

with S_l(q) the elements of q's needed box held by the producer tasks on the devices of q's
depth-l group (depth 0: the whole cluster; depth L: q's own device, free) and M_l(q) how
many of those tasks overlap it. When the producer tasks of every group form a box of the
degree grid (the block is aligned with the partition: true for the mesh space's blocks and
for the full space's aligned blocks and strided sets whenever the degrees and the level
sizes nest), their union is a box of the tensor and S_l, M_l are products over dimensions of
interval intersections. Backward, a producer task p receives from the consumer tasks of its
group: they form a box of the consumer's degree grid, and the sum over it of p's overlaps
with their needed boxes is a product over dimensions of sums over an index range of
|P ∩ [j delta + a, j delta + b)| (a needed interval moves by a fixed step per consumer index:
'same', 'offset', 'window' and attention's 'group' maps alike): one interval intersection
when the needed intervals tile, a difference of prefix sums over j when windows overlap
(halos). A config pair then costs O(tasks x levels x dims), not O(tasks^2); the work is
vectorized over config pairs in cache-sized chunks, and the divisions are done once per
distinct width.

**Dense path.** Elsewhere (no hierarchy, or a block not aligned with its degrees) the bytes
between every task pair of one partition pair are computed and combined per device set,
one partition pair at a time (memory bounded by the largest task grid, not by all
partitions at once).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from planner.costs.config import OpConfigs
from planner.costs.regions import overlap_volume, task_boxes

if TYPE_CHECKING:
    from planner.graph.opkinds import DimMap
    from planner.hardware.devices import Hierarchy

# (seconds per byte, fixed seconds per message) from devices a to devices b, index arrays
# broadcast against each other (`CostModel.pair_costs`).
PairCostsOf = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]

CHUNK = 1 << 21  # elements per dense step (bounds temporary memory to tens of MB)
PAIR_CHUNK = 1 << 15  # (config pair, task) entries per hierarchical step: cache-sized arrays


@dataclass(frozen=True)
class EdgeGeometry:
    """What t_x needs of an edge besides the configs: the tensor's sizes, the consumer's
    output sizes and dims, the per-dim maps, bytes per element x tensors carried, and
    whether gradients flow back (not into the graph's input ops)."""

    in_sizes: tuple[int, ...]
    out_sizes: tuple[int, ...]
    out_dims: tuple[str, ...]
    maps: tuple[DimMap, ...]
    nbytes: int  # bytes per element times tensors carried (an LSTM state: h and c)
    backward: bool
    forward_passes: int = 1  # 2 into an op that recomputes: its forward runs twice
    grad_nbytes: int | None = None  # the gradient's bytes per element (None: nbytes)

    @property
    def back_nbytes(self) -> int:
        """Bytes per element of the gradient sent back (FP8 to an FP8 linear)."""
        return self.nbytes if self.grad_nbytes is None else self.grad_nbytes

    @property
    def refs(self) -> tuple[int, ...]:
        """Per tensor dim, the consumer output dim its needed range follows (-1: whole)."""
        return tuple(-1 if m.kind == "full" else self.out_dims.index(m.out_dim) for m in self.maps)


@dataclass(frozen=True)
class Layout:
    """One config's tasks seen through the hierarchy: per depth 1 .. L, the degree-grid box
    [lo, hi) of the tasks on each device group (zeros for groups without tasks)."""

    degrees: tuple[int, ...]
    devices: np.ndarray  # (k,)
    index: np.ndarray  # (k, n) task multi-indices
    lo: tuple[np.ndarray, ...]  # per depth: (groups at that depth, n)
    hi: tuple[np.ndarray, ...]


def layout(degrees: tuple[int, ...], devices: np.ndarray, hierarchy: Hierarchy) -> Layout | None:
    """The config's layout, or None when the tasks of some device group are not a box of the
    degree grid (then its t_x goes through the dense path)."""
    sizes = hierarchy.sizes
    k, n = len(devices), len(degrees)
    index = np.stack(np.unravel_index(np.arange(k), degrees), axis=1) if n else np.zeros((k, 0))
    los, his = [], []
    for depth in range(1, len(sizes) + 1):
        span = hierarchy.block(depth)
        groups = hierarchy.num_devices // span
        gid = devices // span
        lo = np.full((groups, n), np.iinfo(np.int64).max, dtype=np.int64)
        hi = np.zeros((groups, n), dtype=np.int64)
        np.minimum.at(lo, gid, index)
        np.maximum.at(hi, gid, index + 1)
        count = np.bincount(gid, minlength=groups)
        empty = count == 0
        lo[empty] = 0
        if depth < len(sizes) and not np.array_equal(np.prod(hi - lo, axis=1), count):
            return None
        los.append(lo)
        his.append(hi)
    return Layout(tuple(degrees), devices, index, tuple(los), tuple(his))


def _need(geom: EdgeGeometry, out_lo: np.ndarray, out_hi: np.ndarray) -> np.ndarray:
    """Needed input intervals (..., n_in, 2) from consumer output boxes (..., n_out)."""
    shape = out_lo.shape[:-1]
    need = np.zeros((*shape, len(geom.maps), 2), dtype=np.int64)
    for d, (m, size) in enumerate(zip(geom.maps, geom.in_sizes, strict=True)):
        if m.kind == "full":
            need[..., d, 1] = size
            continue
        a, b = _affine(m)
        o = geom.out_dims.index(m.out_dim)
        if m.kind == "group":  # whole input heads of the output's query heads
            per = m.per_input_head
            lo = np.clip(out_lo[..., o] // per * m.kernel, 0, size)
            hi = np.clip(-(-out_hi[..., o] // per) * m.kernel, 0, size)
        else:
            lo = np.clip(out_lo[..., o] * _scale(m) + a, 0, size)
            hi = np.clip((out_hi[..., o] - 1) * _scale(m) + b, 0, size)
        need[..., d, 0], need[..., d, 1] = lo, np.maximum(lo, hi)
    return need


def _scale(m: DimMap) -> int:
    return m.stride if m.kind == "window" else 1


def _cells(m: DimMap, widths: np.ndarray) -> np.ndarray:
    """The input extent that consecutive output cells of `widths` step by: widths x stride
    for a window; for "group", whole groups of query heads (a config splits attention's
    channel only so: `split_unit`) read widths / (out_head x stride) input heads."""
    if m.kind == "group":
        return widths // m.per_input_head * m.kernel
    return widths * _scale(m)


def _affine(m: DimMap) -> tuple[int, int]:
    """Output element x needs inputs [x * scale + a, x * scale + b) (before clipping)."""
    if m.kind == "window":
        return -m.pad, -m.pad + m.dilation * (m.kernel - 1) + 1
    if m.kind == "offset":
        return -m.offset, 1 - m.offset
    return 0, 1


class EdgeTables:
    """t_x for every config pair of one edge (see the module docstring)."""

    def __init__(
        self,
        geom: EdgeGeometry,
        hierarchy: Hierarchy | None,
        pair_costs: PairCostsOf,
        layouts: dict[tuple[tuple[int, ...], bytes], Layout | None],
    ):
        self.geom = geom
        self.hierarchy = hierarchy
        self.pair_costs = pair_costs
        self._layouts = layouts  # shared across edges: keyed by (degrees, devices bytes)
        refs = [r for r in geom.refs if r >= 0]
        if len(set(refs)) < len(refs):  # two tensor dims follow one output dim: no product form
            self.hierarchy = None
        if self.hierarchy is not None and self.hierarchy.num_devices == 1:
            self.hierarchy = None  # one device: nothing moves, the dense path is trivial
        if self.hierarchy is not None:
            # Per level: the route from device 0 to the first device differing at that level.
            peers = [self.hierarchy.block(level + 1) for level in range(len(self.hierarchy.sizes))]
            w, m = pair_costs(np.zeros(len(peers), dtype=np.int64), np.array(peers))
            self.w, self.m = np.asarray(w, dtype=np.float64), np.asarray(m, dtype=np.float64)

    def table(self, cu: OpConfigs, cv: OpConfigs) -> np.ndarray:
        out = np.zeros((len(cu), len(cv)))
        fast_u, fast_v = self._fast(cu), self._fast(cv)
        if fast_u and fast_v:
            rows = np.array([i for i, _ in fast_u])
            cols = np.array([j for j, _ in fast_v])
            out[np.ix_(rows, cols)] = self._hierarchical(fast_u, fast_v)
        self._dense(cu, cv, out, {i for i, _ in fast_u}, {j for j, _ in fast_v})
        return out

    # -- layouts --------------------------------------------------------------------------

    def _fast(self, c: OpConfigs) -> list[tuple[int, Layout]]:
        if self.hierarchy is None:
            return []
        out = []
        for i, cfg in enumerate(c.configs):
            devs = np.asarray(cfg.devices, dtype=np.int64)
            key = (cfg.grid, devs.tobytes())
            if key not in self._layouts:
                self._layouts[key] = layout(cfg.grid, devs, self.hierarchy)
            lay = self._layouts[key]
            if lay is not None:
                out.append((i, lay))
        return out

    # -- hierarchical path ----------------------------------------------------------------

    def _hierarchical(
        self, us: list[tuple[int, Layout]], vs: list[tuple[int, Layout]]
    ) -> np.ndarray:
        geom = self.geom
        pu = _Side([lay for _, lay in us], geom.in_sizes)
        cv = _Side([lay for _, lay in vs], geom.out_sizes)
        refs = np.array(geom.refs, dtype=np.int64)
        # Tensor dims some config splits, on either side; elsewhere every task is whole.
        split_v = np.zeros(len(refs), dtype=bool)
        split_v[refs >= 0] = cv.split[:, refs[refs >= 0]].any(axis=0)
        active = np.flatnonzero(pu.split.any(axis=0) | split_v)
        out = np.zeros((len(us), len(vs)))
        self._forward(pu, cv, active, out)
        out *= geom.forward_passes
        if geom.backward:
            free = [o for o in range(cv.degrees.shape[1]) if o not in geom.refs]
            free_active = [o for o in free if cv.split[:, o].any()]
            self._backward(pu, cv, active, free_active, out)
        return out

    def _forward(self, pu: _Side, cv: _Side, active: np.ndarray, out: np.ndarray) -> None:
        """Add the slowest consumer task's receive time to out (C_u, C_v)."""
        geom, hier = self.geom, self.hierarchy
        assert hier is not None
        levels = len(hier.sizes)
        lo, hi, occupied = pu.tables(levels)  # per depth: (C_u, groups) per dim; occupancy
        idle = np.setdiff1d(np.arange(len(geom.maps)), active)
        wcodes = {d: np.unique(pu.width[:, d], return_inverse=True) for d in active}
        for k, members in cv.by_tasks():
            idx = np.stack([cv.lays[c].index for c in members])  # (B, k, n_out)
            devs = np.stack([cv.lays[c].devices for c in members])
            wv = cv.width[members][:, None, :]
            need = _need(geom, idx * wv, (idx + 1) * wv)  # (B, k, n_in, 2)
            size = need[..., 1] - need[..., 0]
            whole_vol = np.prod(size, axis=-1, dtype=np.float64)  # S_0, (B, k)
            idle_vol = np.prod(size[..., idle], axis=-1, dtype=np.float64)
            idle_cnt = np.all(size[..., idle] > 0, axis=-1).astype(np.float64)
            n1 = np.ascontiguousarray(np.moveaxis(need[..., 0], -1, 0))  # (n_in, B, k)
            n2 = np.ascontiguousarray(np.moveaxis(need[..., 1], -1, 0))
            gids = [devs // hier.block(level + 1) for level in range(levels)]
            cols = np.array(members)
            # The producer cells each need meets, [c1, c2) along each dim of the producer's
            # grid: divisions once per consumer batch and distinct producer width.
            c1_tab, c2_tab = {}, {}
            for d in active:
                widths = wcodes[d][0][:, None, None]
                c1_tab[d], c2_tab[d] = n1[d] // widths, -(-n2[d] // widths)
            for uc, vc in _pair_chunks(len(pu.lays), len(members), k):
                gid = [g[vc].ravel() for g in gids]  # (m,) consumer task -> device group
                g1 = {d: n1[d, vc].ravel() for d in active}
                g2 = {d: n2[d, vc].ravel() for d in active}
                w = {d: pu.width[uc, d][:, None] for d in active}  # (U, 1)
                rows = len(pu.width[uc])
                c1 = {d: c1_tab[d][wcodes[d][1][uc]][:, vc].reshape(rows, -1) for d in active}
                c2 = {d: c2_tab[d][wcodes[d][1][uc]][:, vc].reshape(rows, -1) for d in active}
                vol = whole_vol[vc].ravel()
                cnt = idle_cnt[vc].ravel()
                for d in active:
                    cnt = cnt * (c2[d] - c1[d])
                total = np.zeros((rows, len(vol)))
                for level in range(levels):
                    here = np.take(occupied[level][uc], gid[level], axis=1)
                    inner = here * idle_vol[vc].ravel()
                    inner_cnt = here * idle_cnt[vc].ravel()
                    for d in active:
                        ilo = np.take(lo[level][d][uc], gid[level], axis=1)
                        ihi = np.take(hi[level][d][uc], gid[level], axis=1)
                        ov = np.minimum(ihi * w[d], g2[d])
                        ov -= np.maximum(ilo * w[d], g1[d])
                        np.maximum(ov, 0, out=ov)
                        inner *= ov
                        np.minimum(ihi, c2[d], out=ihi)
                        ihi -= np.maximum(ilo, c1[d])
                        np.maximum(ihi, 0, out=ihi)
                        inner_cnt *= ihi
                    total += (self.w[level] * geom.nbytes) * (vol - inner)
                    total += self.m[level] * (cnt - inner_cnt)
                    vol, cnt = inner, inner_cnt
                b = len(range(*vc.indices(len(members))))
                out[uc, cols[vc]] += total.reshape(rows, b, k).max(axis=2)

    def _backward(
        self, pu: _Side, cv: _Side, active: np.ndarray, free: list[int], out: np.ndarray
    ) -> None:
        """Add the slowest producer task's receive time (gradients) to out (C_u, C_v)."""
        geom, hier = self.geom, self.hierarchy
        assert hier is not None
        levels = len(hier.sizes)
        lo, hi, occupied = cv.tables(levels)
        refs = geom.refs
        linked = [d for d in active if refs[d] >= 0]
        for k, members in pu.by_tasks():
            idx = np.stack([pu.lays[c].index for c in members])  # (B, k, n_in)
            devs = np.stack([pu.lays[c].devices for c in members])
            wu = pu.width[members][:, None, :]
            p1 = np.ascontiguousarray(np.moveaxis(idx * wu, -1, 0))  # (n_in, B, k)
            p2 = np.ascontiguousarray(np.moveaxis((idx + 1) * wu, -1, 0))
            gids = [devs // hier.block(level + 1) for level in range(levels)]
            rows = np.array(members)
            # Divisions once per producer batch and distinct consumer width, per dim.
            codes, sums = {}, {}
            for d in range(len(geom.maps)):
                if refs[d] >= 0:
                    widths, codes[d] = np.unique(cv.width[:, refs[d]], return_inverse=True)
                    sums[d] = _IntervalSums(
                        geom.maps[d], p1[d], p2[d], widths, geom.out_sizes[refs[d]]
                    )
            for vc, uc in _pair_chunks(len(cv.lays), len(members), k):
                gid = [g[uc].ravel() for g in gids]
                picked = {d: sums[d].pick(codes[d][vc], uc) for d in sums}
                # Dims no config splits: the same factor at every level (consumer index 0 of
                # that dim), as is P's extent along dims the consumer reads whole.
                const = np.ones(len(gid[0]))
                for d in range(len(geom.maps)):
                    if refs[d] < 0:
                        const = const * (p2[d, uc].ravel() - p1[d, uc].ravel())
                    elif d not in linked:
                        const = const * picked[d].at(0, 1)[0]
                const = np.atleast_2d(const)
                degrees = cv.degrees[vc]
                vol, cnt = const, (const > 0).astype(np.float64)
                for d in linked:
                    s, n = picked[d].at(0, degrees[:, refs[d], None])
                    vol, cnt = vol * s, cnt * n
                for o in free:
                    vol = vol * degrees[:, o, None]
                    cnt = cnt * degrees[:, o, None]
                total = np.zeros((len(degrees), len(gid[0])))
                for level in range(levels):
                    here = np.take(occupied[level][vc], gid[level], axis=1)
                    inner, inner_cnt = here * const, here * (const > 0)
                    for d in linked:
                        o = refs[d]
                        j0 = np.take(lo[level][o][vc], gid[level], axis=1)
                        j1 = np.take(hi[level][o][vc], gid[level], axis=1)
                        s, n = picked[d].at(j0, j1)
                        inner *= s
                        inner_cnt *= n
                    for o in free:
                        span = np.take(hi[level][o][vc], gid[level], axis=1)
                        span -= np.take(lo[level][o][vc], gid[level], axis=1)
                        inner *= span
                        inner_cnt *= span
                    total += (self.w[level] * geom.back_nbytes) * (vol - inner)
                    total += self.m[level] * (cnt - inner_cnt)
                    vol, cnt = inner, inner_cnt
                b = len(range(*uc.indices(len(members))))
                out[rows[uc], vc] += total.reshape(len(degrees), b, k).max(axis=2).T

    # -- dense path -----------------------------------------------------------------------

    def _dense(
        self, cu: OpConfigs, cv: OpConfigs, out: np.ndarray, done_u: set[int], done_v: set[int]
    ) -> None:
        """Fill every pair not both in done_u x done_v, one partition pair at a time."""
        if len(done_u) == len(cu) and len(done_v) == len(cv):
            return
        geom = self.geom
        for part_u, sets_u, idx_u in cu.groups:
            for part_v, sets_v, idx_v in cv.groups:
                todo = ~(np.isin(idx_u, list(done_u))[:, None] & np.isin(idx_v, list(done_v))[None])
                if not todo.any():
                    continue
                plo, phi = task_boxes(geom.in_sizes, np.array([part_u]), math.prod(part_u))
                olo, ohi = task_boxes(geom.out_sizes, np.array([part_v]), math.prod(part_v))
                need = _need(geom, olo[0], ohi[0])
                vol = overlap_volume(plo, phi, need[None, ..., 0], need[None, ..., 1])[0, :, 0, :]
                for ru, rv in _set_chunks(len(sets_u), len(sets_v), vol.size):
                    out[np.ix_(idx_u[ru], idx_v[rv])] = self._combine(vol, sets_u[ru], sets_v[rv])

    def _combine(self, vol: np.ndarray, sets_u: np.ndarray, sets_v: np.ndarray) -> np.ndarray:
        """Elements (ku, kv) on device sets (Ou, ku), (Ov, kv) -> t_x (Ou, Ov)."""
        su, sv = sets_u[:, :, None, None], sets_v[None, None, :, :]
        msg = (vol > 0).astype(np.float64)
        nbytes = vol * self.geom.nbytes
        inv_bw, msg_cost = self.pair_costs(su, sv)
        fwd = np.einsum("pq,opwq->owq", nbytes, inv_bw) + np.einsum("pq,opwq->owq", msg, msg_cost)
        t = fwd.max(axis=2) * self.geom.forward_passes
        if self.geom.backward:
            nbytes = vol * self.geom.back_nbytes
            inv_bw, msg_cost = self.pair_costs(sv, su)
            bwd = np.einsum("pq,opwq->owp", nbytes, inv_bw) + np.einsum(
                "pq,opwq->owp", msg, msg_cost
            )
            t = t + bwd.max(axis=2)
        return t


class _IntervalSums:
    """For producer intervals P = [p1, p2) along one tensor dim (arrays (B, k)) and consumers
    whose output cells of width w need [j cell + a, j cell + b) (cell = w x stride), the sum
    over consumer indices j in [j0, j1) of |P ∩ needed(j)| and how many j meet P. The parts
    that do not depend on [j0, j1) are computed once per distinct width: the divisions, and
    where the needed intervals overlap (halos), prefix sums over j (few: window dims are the
    spatial ones, split a few ways)."""

    def __init__(
        self, m: DimMap, p1: np.ndarray, p2: np.ndarray, widths: np.ndarray, out_size: int
    ):
        a, b = _affine(m)
        cell = _cells(m, widths)[:, None, None]  # (W, 1, 1)
        self.a, self.b, self.cell = a, cell - _scale(m) + b, cell
        self.p1, self.p2 = p1, p2
        self.tiles = _tiles(m)
        # Consumer indices whose needed interval meets P: [first, stop), per width (W, B, k).
        self.first = (p1 - self.b) // cell + 1
        self.stop = -((a - p2) // cell)
        self.prefix: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        if not self.tiles:
            self._prefix_sums(out_size // widths)

    def _prefix_sums(self, degrees: np.ndarray) -> None:
        """sums[offset[w] + task * (h_w + 1) + j] = sum of the overlaps of consumer indices
        0 .. j-1 (h_w = the consumer's degree for width w), and the same for counts."""
        sums, counts, offsets = [], [], []
        at = 0
        for w, h in enumerate(degrees.tolist()):
            j = np.arange(h)
            start = j * self.cell[w, 0, 0] + self.a
            end = j * self.cell[w, 0, 0] + self.b[w, 0, 0]
            ov = np.minimum(end, self.p2[..., None]) - np.maximum(start, self.p1[..., None])
            np.maximum(ov, 0, out=ov)  # (B, k, h)
            zero = np.zeros((*ov.shape[:-1], 1), dtype=np.int64)
            sums.append(np.concatenate([zero, ov.cumsum(axis=-1)], axis=-1).ravel())
            counts.append(np.concatenate([zero, (ov > 0).cumsum(axis=-1)], axis=-1).ravel())
            offsets.append(at)
            at += sums[-1].size
        self.prefix = (
            np.concatenate(sums),
            np.concatenate(counts),
            np.array(offsets, dtype=np.int64),
            degrees.astype(np.int64) + 1,
        )

    def pick(self, codes: np.ndarray, tasks: slice) -> _Picked:
        """The rows for consumer configs of width codes `codes` and producer configs `tasks`:
        arrays (c, m) with m their tasks, flattened."""

        def rows(x: np.ndarray) -> np.ndarray:
            return x[codes][:, tasks].reshape(len(codes), -1)

        base = None
        if self.prefix is not None:
            _, _, offsets, stride = self.prefix
            k = self.p1.shape[1]
            flat = np.arange(*tasks.indices(self.p1.shape[0]))[:, None] * k + np.arange(k)
            base = offsets[codes][:, None] + flat.ravel()[None, :] * stride[codes][:, None]
        return _Picked(
            p1=self.p1[tasks].ravel(),
            p2=self.p2[tasks].ravel(),
            a=self.a,
            cell=self.cell[codes, 0],  # (c, 1)
            first=rows(self.first),
            stop=rows(self.stop),
            base=base,
            sums=None if self.prefix is None else self.prefix[0],
            counts=None if self.prefix is None else self.prefix[1],
        )


@dataclass(frozen=True)
class _Picked:
    p1: np.ndarray
    p2: np.ndarray
    a: int
    cell: np.ndarray
    first: np.ndarray
    stop: np.ndarray
    base: np.ndarray | None  # (c, m) offsets into the prefix sums (overlapping windows)
    sums: np.ndarray | None
    counts: np.ndarray | None

    def at(self, j0: np.ndarray | int, j1: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """(sum, count) for consumer index ranges [j0, j1) (broadcast to (c, m))."""
        if self.base is None:  # the needed intervals tile: intersect P with their union
            x1 = np.maximum(self.p1, j0 * self.cell + self.a)
            x2 = np.minimum(self.p2, j1 * self.cell + self.a)
            x2 -= x1
            n = np.minimum(j1, self.stop) - np.maximum(j0, self.first)
            return np.maximum(x2, 0, out=x2), np.maximum(n, 0, out=n)
        assert self.sums is not None and self.counts is not None
        i0, i1 = self.base + j0, self.base + j1
        return (
            np.take(self.sums, i1) - np.take(self.sums, i0),
            np.take(self.counts, i1) - np.take(self.counts, i0),
        )


class _Side:
    """The configs of one side of an edge with a layout: widths and degrees per dim."""

    def __init__(self, lays: list[Layout], sizes: tuple[int, ...]):
        self.lays = lays
        self.degrees = np.array([lay.degrees for lay in lays], dtype=np.int64).reshape(
            len(lays), len(sizes)
        )
        self.width = np.asarray(sizes, dtype=np.int64)[None, :] // self.degrees
        self.split = self.degrees > 1

    def by_tasks(self) -> Iterator[tuple[int, list[int]]]:
        groups: dict[int, list[int]] = {}
        for i, lay in enumerate(self.lays):
            groups.setdefault(len(lay.devices), []).append(i)
        yield from groups.items()

    def group_ranges(self, level: int) -> np.ndarray:
        """Degree-grid index ranges of each config's tasks per device group at depth
        level + 1: (C, groups, n, 2) (empty groups: [0, 0))."""
        return np.stack([np.stack([lay.lo[level], lay.hi[level]], axis=-1) for lay in self.lays])

    def tables(
        self, levels: int
    ) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]], list[np.ndarray]]:
        """Per depth 1 .. levels: the index ranges' lo and hi per dim, (C, groups) contiguous
        arrays, and whether each group holds a task (C, groups) as 0/1 floats."""
        lo: list[list[np.ndarray]] = []
        hi: list[list[np.ndarray]] = []
        occupied: list[np.ndarray] = []
        for level in range(levels):
            r = self.group_ranges(level)
            lo.append([np.ascontiguousarray(r[..., d, 0]) for d in range(r.shape[2])])
            hi.append([np.ascontiguousarray(r[..., d, 1]) for d in range(r.shape[2])])
            occupied.append(np.asarray((r[..., 1] > r[..., 0]).all(axis=-1), dtype=np.float64))
        return lo, hi, occupied


def _tiles(m: DimMap) -> bool:
    """Whether the needed intervals of consecutive output blocks tile the input (no halo,
    no gap): 'same', 'offset', and windows whose extent equals their stride."""
    return m.kind != "window" or m.dilation * (m.kernel - 1) + 1 == m.stride


def _pair_chunks(na: int, nb: int, k: int) -> Iterator[tuple[slice, slice]]:
    """Slices of a (na, nb) config grid whose blocks hold about PAIR_CHUNK task entries."""
    per = max(1, PAIR_CHUNK // max(1, k))
    step_b = min(nb, per)
    step_a = max(1, per // step_b)
    for b in range(0, nb, step_b):
        for a in range(0, na, step_a):
            yield slice(a, a + step_a), slice(b, b + step_b)


def _set_chunks(nu: int, nv: int, pair_size: int) -> Iterator[tuple[slice, slice]]:
    step_u = max(1, int(math.sqrt(CHUNK / max(1, pair_size))))
    step_v = max(1, CHUNK // max(1, pair_size * step_u))
    for a in range(0, nu, step_u):
        for b in range(0, nv, step_v):
            yield slice(a, a + step_u), slice(b, b + step_v)
