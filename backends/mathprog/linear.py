"""Sparse linear programs built with numpy and written as MPS, for large encodings.

A modelling library that makes one Python object per variable and per term (pulp) spends
most of a large model's time and memory on them: the `ilp` backend's additive model of an
800-node contest problem has ~10^5 columns and ~10^6 terms. `LinearBuilder` collects columns
and rows as numpy blocks instead, `LinearProgram` holds them in coordinate form, and
`write_mps` writes the fixed-format MPS file CBC reads (names X0000000 / C0000000, integer
columns between one pair of markers, binaries as integer columns with upper bound 1).
`write_start` writes a MIP start and `read_solution` reads CBC's solution file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["LinearBuilder", "LinearProgram", "read_solution", "write_mps", "write_start"]

SENSES = {"E": 0, "L": 1, "G": 2}
_SENSE_NAMES = ("E", "L", "G")


@dataclass(frozen=True)
class LinearProgram:
    """min obj @ x subject to rows (coordinate form); 0 <= x <= upper; integer columns."""

    obj: np.ndarray  # (N,)
    upper: np.ndarray  # (N,), inf for none
    integer: np.ndarray  # (N,) bool
    row: np.ndarray  # (Z,) row of each term
    col: np.ndarray  # (Z,) column of each term
    val: np.ndarray  # (Z,) coefficient of each term
    sense: np.ndarray  # (R,) 0: ==, 1: <=, 2: >=
    rhs: np.ndarray  # (R,)

    @property
    def num_columns(self) -> int:
        return len(self.obj)

    @property
    def num_rows(self) -> int:
        return len(self.rhs)

    @property
    def num_terms(self) -> int:
        return len(self.val)

    def violated(self, x: np.ndarray, tol: float = 1e-9) -> np.ndarray:
        """The rows an assignment breaks (relative tolerance `tol`), and its bounds."""
        lhs = np.bincount(self.row, self.val * x[self.col], minlength=self.num_rows)
        slack = tol * np.maximum(1.0, np.abs(self.rhs))
        bad = np.where(
            self.sense == 0,
            np.abs(lhs - self.rhs) > slack,
            np.where(self.sense == 1, lhs > self.rhs + slack, lhs < self.rhs - slack),
        )
        if (x < -tol).any() or (x > self.upper + tol).any():
            raise ValueError("the assignment is outside the columns' bounds")
        return np.flatnonzero(bad)


class LinearBuilder:
    """Collects columns and rows as numpy blocks; `build` concatenates them once."""

    def __init__(self) -> None:
        self._obj: list[np.ndarray] = []
        self._upper: list[np.ndarray] = []
        self._integer: list[np.ndarray] = []
        self._terms: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._sense: list[np.ndarray] = []
        self._rhs: list[np.ndarray] = []
        self.num_columns = 0
        self.num_rows = 0

    def columns(self, obj: np.ndarray, integer: bool, upper: float = 1.0) -> np.ndarray:
        """New columns with these objective coefficients; returns their indices."""
        obj = np.asarray(obj, dtype=np.float64).reshape(-1)
        first = self.num_columns
        self._obj.append(obj)
        self._upper.append(np.full(len(obj), upper))
        self._integer.append(np.full(len(obj), integer))
        self.num_columns += len(obj)
        return np.arange(first, self.num_columns)

    def rows(
        self,
        row: np.ndarray,
        col: np.ndarray,
        val: np.ndarray | float,
        sense: str,
        rhs: np.ndarray | float,
        count: int | None = None,
    ) -> np.ndarray:
        """`count` new rows (default: max(row) + 1) from terms (row in 0..count-1, column,
        coefficient), all with one sense ("E", "L" or "G"); returns their indices."""
        row = np.asarray(row, dtype=np.int64)
        count = int(row.max(initial=-1)) + 1 if count is None else count
        col = np.asarray(col, dtype=np.int64)
        val = np.broadcast_to(np.asarray(val, dtype=np.float64), row.shape)
        first = self.num_rows
        self._terms.append((row + first, col, np.array(val)))
        self._sense.append(np.full(count, SENSES[sense], dtype=np.int8))
        self._rhs.append(np.broadcast_to(np.asarray(rhs, dtype=np.float64), (count,)).copy())
        self.num_rows += count
        return np.arange(first, self.num_rows)

    def build(self) -> LinearProgram:
        def cat(parts: Sequence[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

        return LinearProgram(
            obj=cat(self._obj, np.float64),
            upper=cat(self._upper, np.float64),
            integer=cat(self._integer, bool),
            row=cat([t[0] for t in self._terms], np.int64),
            col=cat([t[1] for t in self._terms], np.int64),
            val=cat([t[2] for t in self._terms], np.float64),
            sense=cat(self._sense, np.int8),
            rhs=cat(self._rhs, np.float64),
        )


def write_mps(lp: LinearProgram, path: str | Path) -> None:
    """Fixed-format MPS (what CBC reads): integer columns first, between markers. The lines
    are assembled as byte matrices with numpy (~0.3 us per term)."""
    if lp.num_columns >= 10**7 or lp.num_rows >= 10**7:
        raise ValueError("MPS names hold at most 10^7 columns and rows")
    keep = lp.val != 0
    col, row, val = lp.col[keep], lp.row[keep], lp.val[keep]
    # one block per column: its objective (row -1 stands for OBJ) then its terms; a column
    # without terms is listed by its objective entry (even 0) so that CBC knows it
    present = np.zeros(lp.num_columns, dtype=bool)
    present[col] = True
    objective = np.flatnonzero((lp.obj != 0) | ~present)
    col = np.concatenate([objective, col])
    row = np.concatenate([np.full(len(objective), -1), row])
    val = np.concatenate([lp.obj[objective], val])
    order = np.lexsort((row, col, ~lp.integer[col]))
    col, row, val = col[order], row[order], val[order]
    integers = int(lp.integer[col].sum())
    with open(path, "wb") as f:
        f.write(b"NAME          MODEL\nROWS\n N  OBJ\n")
        senses = np.frombuffer(b" E  C L  C G  C", dtype=np.uint8).reshape(3, 5)[lp.sense]
        f.write(_table([senses, _digits(np.arange(lp.num_rows))]))
        f.write(b"COLUMNS\n")
        rows = np.where(row < 0, 0, row)
        fields = [b"    X", _digits(col), b"  C", _digits(rows), b"   ", _numbers(val)]
        body = _table(fields, objective=row < 0)
        width = len(body) // len(col) if len(col) else 0
        if integers:
            f.write(b"    MARK      'MARKER'                 'INTORG'\n")
            f.write(body[: integers * width])
            f.write(b"    MARK      'MARKER'                 'INTEND'\n")
        f.write(body[integers * width :])
        f.write(b"RHS\n")
        nz = np.flatnonzero(lp.rhs)
        f.write(_table([b"    RHS       C", _digits(nz), b"   ", _numbers(lp.rhs[nz])]))
        f.write(b"BOUNDS\n")
        up = np.flatnonzero(np.isfinite(lp.upper))
        f.write(_table([b" UP BND       X", _digits(up), b"   ", _numbers(lp.upper[up])]))
        f.write(b"ENDATA\n")


def _digits(ids: np.ndarray) -> np.ndarray:
    """(n, 7) bytes: each id as seven decimal digits."""
    powers = 10 ** np.arange(6, -1, -1, dtype=np.int64)
    return ((np.asarray(ids, dtype=np.int64)[:, None] // powers) % 10 + 48).astype(np.uint8)


def _numbers(values: np.ndarray) -> np.ndarray:
    """(n, w) bytes: each value's shortest round-trip text, padded with spaces."""
    unique, inverse = np.unique(values, return_inverse=True)
    text = [repr(float(v)).encode() for v in unique.tolist()]
    width = max((len(t) for t in text), default=1)
    table = np.frombuffer(b"".join(t.ljust(width) for t in text), dtype=np.uint8)
    return table.reshape(len(text), width)[inverse.reshape(-1)]


def _table(fields: list, objective: np.ndarray | None = None) -> bytes:
    """One line per row of the (n, w) byte matrices, with constant byte strings between;
    rows flagged `objective` get "OBJ     " in place of the row name (fields 2-3)."""
    n = next(len(x) for x in fields if isinstance(x, np.ndarray))
    parts = []
    for x in fields:
        if isinstance(x, bytes):
            parts.append(np.broadcast_to(np.frombuffer(x, dtype=np.uint8), (n, len(x))))
        else:
            parts.append(x)
    parts.append(np.full((n, 1), ord("\n"), dtype=np.uint8))
    out = np.concatenate(parts, axis=1)
    if objective is not None and objective.any():
        start = sum(p.shape[1] for p in parts[:2]) + 2  # after "    X" + digits + "  "
        out[objective, start : start + 8] = np.frombuffer(b"OBJ     ", dtype=np.uint8)
    return out.tobytes()


def write_start(path: str | Path, columns: np.ndarray, values: np.ndarray) -> None:
    """A MIP start in CBC's solution-file format (CBC's -mips), for the given columns."""
    lines = ["Stopped on time - objective value 0\n"]
    lines += [
        f"{k:>7} X{c:07d} {v:>15} {0:>23}\n"
        for k, (c, v) in enumerate(zip(columns.tolist(), values.tolist(), strict=True))
    ]
    Path(path).write_text("".join(lines))


def read_solution(path: str | Path, num_columns: int) -> tuple[str, np.ndarray]:
    """CBC's solution file: its first line (the status) and every column's value."""
    x = np.zeros(num_columns)
    with open(path) as f:
        status = f.readline().strip()
        for line in f:
            fields = line.split()
            if fields and fields[0] == "**":  # an infeasible row or column is marked
                fields = fields[1:]
            if len(fields) >= 3 and fields[1][:1] == "X":
                x[int(fields[1][1:])] = float(fields[2])
    return status, x
