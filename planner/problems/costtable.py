"""Cost-table problems in the format of the public IOPDDL auto-sharding contest.

```
{"problem": {"name": str,
  "nodes": {"intervals": [[start, end), ...], "costs": [[cost per strategy], ...],
            "usages": [[memory per strategy], ...]},
  "edges": {"nodes": [[u, v], ...], "costs": [[|S_u| x |S_v| costs, row-major by u], ...]},
  "usage_limit": optional number}}
```

A cost >= 1e18 (`FORBIDDEN`) forbids the choice: it is `inf` in the Problem and written back
as 1e18. A node is live at time t when start <= t < end (an empty interval is never live);
a choice vector fits in memory when the live usages sum to at most `usage_limit` at every t.
`random_problem` makes seeded instances of the same shape and `brute_force` is the exhaustive
reference optimum for small ones. See docs/costtable.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import gzip
import itertools
import json
import math
import os
import re
import stat
import warnings
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from planner.errors import ProblemError
from planner.files import check_input_file, open_text_atomic, read_bytes_checked
from planner.problems.problem import FORBIDDEN, Problem, forbid

__all__ = [
    "BRUTE_FORCE_LIMIT",
    "brute_force",
    "compiled_integers",
    "contest_problem",
    "is_gzip",
    "load_problem",
    "problem_from_json",
    "problem_to_json",
    "random_problem",
    "read_bytes",
    "save_problem",
]

BRUTE_FORCE_LIMIT = 2_000_000  # most choice vectors brute_force will enumerate
_NUMBER = (int, float)  # bool is a subclass of int but type(True) is bool, so it is refused


# ----------------------------------------------------------------------------- reading


def problem_from_json(
    data: Mapping[str, Any], edge_costs: tuple[np.ndarray, np.ndarray] | None = None
) -> Problem:
    """A Problem from a parsed cost-table document (`{"problem": {...}}` or the inner object).

    `edge_costs`: edges.costs already parsed as (flat values, length of each row), when the
    document holds an empty list there (`load_problem`'s fast path for large files)."""
    if not isinstance(data, Mapping):
        raise ProblemError(f"a cost-table problem is a JSON object, not {type(data).__name__}")
    p = data.get("problem", data)
    if not isinstance(p, Mapping):
        raise ProblemError('"problem" must be a JSON object')
    name = p.get("name", "costtable")
    if not isinstance(name, str):
        raise ProblemError(f'"name" must be a string, not {name!r}')
    try:
        return _read(p, name, edge_costs)
    except ProblemError as exc:
        raise ProblemError(f"cost-table problem {name!r}: {exc}") from None


def _read(
    p: Mapping[str, Any], name: str, edge_costs: tuple[np.ndarray, np.ndarray] | None
) -> Problem:
    nodes = _field(p, "nodes", Mapping, "problem")
    edges = _field(p, "edges", Mapping, "problem")
    costs, sizes = _ragged(_field(nodes, "costs", list, "nodes"), "nodes.costs", "node", True)
    n = len(sizes)
    empty = np.flatnonzero(sizes == 0)
    if len(empty):
        raise ProblemError(f"node {empty[0]} has no strategies (an empty cost list)")
    _check_nonnegative(costs, sizes, "nodes.costs", "node")
    node_off = _offsets(sizes)

    pairs = _pairs(_field(edges, "nodes", list, "edges"), n)
    rows = _field(edges, "costs", list, "edges")
    ecosts, elens = edge_costs or _ragged(rows, "edges.costs", "edge", True)
    if len(elens) != len(pairs):
        raise ProblemError(f"edges.costs has {len(elens)} tables for {len(pairs)} edges.nodes")
    expected = sizes[pairs[:, 0]] * sizes[pairs[:, 1]] if len(pairs) else elens
    bad = np.flatnonzero(elens != expected)
    if len(bad):
        e = bad[0]
        u, v = pairs[e]
        raise ProblemError(
            f"edge {e} ({u} -> {v}) has {elens[e]} costs, expected "
            f"{sizes[u]} x {sizes[v]} = {expected[e]} (row-major by node {u}'s strategy)"
            + (f"; {len(bad) - 1} more edges are mis-sized" if len(bad) > 1 else "")
        )
    _check_nonnegative(ecosts, elens, "edges.costs", "edge")
    edge_off = _offsets(elens)

    node_cost = _split(forbid(costs), node_off)
    flat_e = forbid(ecosts)
    edge_cost = tuple(
        flat_e[edge_off[e] : edge_off[e + 1]].reshape(sizes[u], sizes[v])
        for e, (u, v) in enumerate(pairs.tolist())
    )
    usage, intervals, limit = _memory(p, nodes, sizes, node_off)
    names = nodes.get("names")
    if names is None:
        node_names = tuple(str(i) for i in range(n))
    elif isinstance(names, list) and len(names) == n and all(isinstance(s, str) for s in names):
        node_names = tuple(names)
    else:
        raise ProblemError(f"nodes.names must be a list of {n} strings")
    return Problem(
        name=name,
        node_names=node_names,
        node_cost=node_cost,
        edges=tuple((int(u), int(v)) for u, v in pairs.tolist()),
        edge_cost=edge_cost,
        usage=usage,
        intervals=intervals,
        usage_limit=limit,
    )


def _memory(
    p: Mapping[str, Any], nodes: Mapping[str, Any], sizes: np.ndarray, node_off: np.ndarray
) -> tuple[tuple[np.ndarray, ...] | None, np.ndarray | None, np.ndarray | None]:
    """Usage tables (C_i, 1), intervals (n, 2) and the limit (1,); all None without usages."""
    has_usage, has_intervals = "usages" in nodes, "intervals" in nodes
    limit_value = p.get("usage_limit")
    if not has_usage:
        if has_intervals or limit_value is not None:
            raise ProblemError(
                '"intervals" and "usage_limit" need nodes.usages (memory per strategy)'
            )
        return None, None, None
    n = len(sizes)
    usage, ulens = _ragged(_field(nodes, "usages", list, "nodes"), "nodes.usages", "node")
    if len(ulens) != n:
        raise ProblemError(f"nodes.usages has {len(ulens)} rows, expected one per node ({n})")
    bad = np.flatnonzero(ulens != sizes)
    if len(bad):
        i = bad[0]
        raise ProblemError(
            f"node {i} has {ulens[i]} usages, expected {sizes[i]} (one per strategy)"
        )
    if not np.isfinite(usage).all():
        raise ProblemError("nodes.usages must be finite numbers")
    _check_nonnegative(usage, ulens, "nodes.usages", "node")
    intervals = _intervals(_field(nodes, "intervals", list, "nodes"), n)
    limit = None
    if limit_value is not None:
        if type(limit_value) not in _NUMBER or not 0 <= limit_value < math.inf:
            raise ProblemError(f"usage_limit must be a finite number >= 0, not {limit_value!r}")
        limit = np.array([float(limit_value)])
    tables = tuple(u.reshape(-1, 1) for u in _split(usage, node_off))
    return tables, intervals, limit


def _field(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise ProblemError(f'{where} has no "{key}"')
    value = obj[key]
    if not isinstance(value, kind):
        expected = "a list" if kind is list else "an object"
        raise ProblemError(f"{where}.{key} must be {expected}, not {type(value).__name__}")
    return value


def _ragged(
    rows: list[Any], where: str, what: str, costs: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Flatten a list of number lists in one pass: (values, length of each row).

    `costs`: an integer below FORBIDDEN that float64 rounds up to it stays allowed
    (`_allowed_below_forbidden`)."""
    if all(type(r) is list for r in rows):
        flat = list(itertools.chain.from_iterable(rows))
        if set(map(type, flat)) <= set(_NUMBER):
            try:
                values = np.array(flat, dtype=np.float64)
            except OverflowError:
                raise ProblemError(f"{where} holds a number too large for a float") from None
            if costs:
                _allowed_below_forbidden(values, flat)
            lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
            return values, lengths
    for i, row in enumerate(rows):  # slow path, only to say what is wrong
        if type(row) is not list:
            raise ProblemError(f"{where}[{i}] ({what} {i}) must be a list of numbers, not {row!r}")
        for k, x in enumerate(row):
            if type(x) not in _NUMBER:
                raise ProblemError(f"{where}[{i}][{k}] ({what} {i}) is {x!r}, not a number")
    raise AssertionError("unreachable")  # pragma: no cover


# The largest float64 below FORBIDDEN: what an allowed cost that float64 would round up to
# 1e18 (an integer from 999999999999999937 to 999999999999999999) is read as.
BELOW_FORBIDDEN = float(np.nextafter(FORBIDDEN, 0.0))
_FORBIDDEN_INT = 10**18


def _allowed_below_forbidden(values: np.ndarray, exact: list[Any]) -> None:
    """Values that became exactly FORBIDDEN as floats but are below it as written (`exact`:
    Python ints, compared exactly) become BELOW_FORBIDDEN: whether a cost is forbidden is
    decided from the number in the file, not from its float64 rounding."""
    suspects = np.flatnonzero(values == FORBIDDEN)
    if not len(suspects) or exact.count(_FORBIDDEN_INT) == len(suspects):
        return  # all are 1e18 itself (most of a contest file's forbidden entries): counted in C
    for i in suspects.tolist():
        if exact[i] < _FORBIDDEN_INT:  # int < int, or float < int: both exact in Python
            values[i] = BELOW_FORBIDDEN


def _parse_float(text: str) -> float:
    """json's parse_float for files that hold a number near FORBIDDEN: a decimal below 1e18
    that rounds to it (999999999999999999.0) stays below it."""
    value = float(text)
    if value == FORBIDDEN and decimal.Decimal(text) < _FORBIDDEN_INT:
        return BELOW_FORBIDDEN
    return value


def _check_nonnegative(values: np.ndarray, lengths: np.ndarray, where: str, what: str) -> None:
    bad = np.flatnonzero(~(values >= 0))  # catches NaN too
    if len(bad):
        row = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise ProblemError(f"{what} {row} has a negative or NaN value {values[bad[0]]} in {where}")


def _offsets(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _split(values: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(values[a:b] for a, b in itertools.pairwise(offsets.tolist()))


def _int_array(rows: list[Any], n: int, where: str, what: str) -> np.ndarray:
    """An (n, 2) int array from a list of [a, b] pairs of integers."""
    if len(rows) != n:
        raise ProblemError(f"{where} has {len(rows)} entries, expected {n}")
    ok = all(type(r) is list and len(r) == 2 for r in rows)
    flat = list(itertools.chain.from_iterable(rows)) if ok else []
    if ok and set(map(type, flat)) <= set(_NUMBER):
        with contextlib.suppress(OverflowError):  # an enormous int: said below
            arr = np.array(flat, dtype=np.float64).reshape(n, 2)
            if (arr == np.round(arr)).all() and (np.abs(arr) < 2**62).all():
                return arr.astype(np.int64)
    for i, r in enumerate(rows):
        if not (
            type(r) is list
            and len(r) == 2
            and all(type(x) is int or (type(x) is float and x.is_integer()) for x in r)
        ):
            raise ProblemError(f"{where}[{i}] ({what} {i}) must be a pair of integers, not {r!r}")
    raise ProblemError(f"{where} holds an integer out of range")


def _pairs(rows: list[Any], n: int) -> np.ndarray:
    pairs = _int_array(rows, len(rows), "edges.nodes", "edge").reshape(-1, 2)
    bad = np.flatnonzero((pairs < 0).any(axis=1) | (pairs >= n).any(axis=1))
    if len(bad):
        e = bad[0]
        raise ProblemError(
            f"edge {e} ({pairs[e, 0]} -> {pairs[e, 1]}) names a node that does not exist "
            f"(nodes are 0..{n - 1})"
        )
    loops = np.flatnonzero(pairs[:, 0] == pairs[:, 1])
    if len(loops):
        raise ProblemError(f"edge {loops[0]} joins node {pairs[loops[0], 0]} to itself")
    return pairs


def _intervals(rows: list[Any], n: int) -> np.ndarray:
    iv = _int_array(rows, n, "nodes.intervals", "node")
    bad = np.flatnonzero(iv[:, 1] < iv[:, 0])
    if len(bad):
        i = bad[0]
        raise ProblemError(
            f"node {i} has interval [{iv[i, 0]}, {iv[i, 1]}) whose end is before its start"
        )
    return iv


def load_problem(path: str | Path) -> Problem:
    """Read a cost-table problem file, plain or gzipped (known by its magic bytes, whatever
    the name); every defect is a ProblemError naming the file.

    Files over FAST_LOAD_BYTES (once decompressed) read edges.costs (nearly all of a large
    file) with numpy straight from the text, in a few seconds and about twice the file's
    size in memory (Python's json needs ~10x, and 40 s for a 35,000-node instance);
    anything unusual in that array falls back to the plain reader, which says what is
    wrong."""
    raw = read_bytes(path)
    try:
        fast = _load_fast(raw) if len(raw) >= FAST_LOAD_BYTES else None
    except ProblemError as exc:
        raise ProblemError(f"{path}: {exc}") from None
    if fast is not None:
        return fast
    try:
        data = json.loads(raw, parse_float=_parse_float)  # a float near 1e18 read exactly
    except UnicodeDecodeError:
        raise ProblemError(f"cost-table file {path} is not text (expected UTF-8 JSON)") from None
    except json.JSONDecodeError as exc:
        raise ProblemError(f"cost-table file {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ProblemError(f"cost-table file {path} is nested too deeply") from None
    try:
        return problem_from_json(data)
    except ProblemError as exc:
        raise ProblemError(f"{path}: {exc}") from None


GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: str | Path, what: str = "model") -> bool:
    """Whether the file starts with gzip's magic bytes (False if it cannot be read).

    A path that is a directory, FIFO, socket or device (or a symlink loop) is a ProblemError
    naming `what`: sniffing a FIFO would block for ever."""
    check_input_file(path, what, ProblemError)
    try:
        # O_NONBLOCK: a FIFO swapped in since the check does not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode) and f.read(2) == GZIP_MAGIC
        except OSError:
            return False


def read_bytes(path: str | Path) -> bytes:
    """A cost-table file's bytes, decompressed when it is gzipped; a ProblemError naming the
    file when it cannot be read or is no regular file (a FIFO, socket, device or directory,
    refused without reading: `planner.files.read_bytes_checked`)."""
    raw = read_bytes_checked(path, "cost-table", ProblemError)
    try:
        return gzip.decompress(raw) if raw[:2] == GZIP_MAGIC else raw
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ProblemError(f"cost-table file {path} is not a valid gzip file: {exc}") from None
    except OSError as exc:
        raise ProblemError(f"cannot read cost-table file {path}: {exc.strerror or exc}") from None


FAST_LOAD_BYTES = 16 << 20
_COSTS_KEY = re.compile(rb'"costs"\s*:\s*\[\s*\[')
_TABLE_END = re.compile(rb"\]\s*\]")
_NUMERIC = b"0123456789+-.eE, \t\r\n[]"  # the bytes of an array of numbers
_INTEGRAL = b"0123456789, \n[]"  # those `_integers` reads


def _load_fast(raw: bytes) -> Problem | None:
    """The problem in the file's bytes, with edges.costs parsed by numpy; None to use the
    plain reader."""
    spans = []
    for m in _COSTS_KEY.finditer(raw):
        end = _TABLE_END.search(raw, m.end())
        if end is not None:
            spans.append((raw.index(b"[", m.start()), end.end()))
    for a, b in sorted(spans, key=lambda ab: ab[0] - ab[1]):  # the largest array first
        rest = raw[:a] + _SENTINEL + raw[b:]
        try:
            doc = json.loads(rest, parse_float=_parse_float)
        except (ValueError, RecursionError):
            continue
        inner = doc.get("problem", doc) if isinstance(doc, dict) else None
        edges = inner.get("edges") if isinstance(inner, dict) else None
        if not isinstance(edges, dict) or edges.get("costs") != _SENTINEL.decode().strip('"'):
            continue  # the array cut out was not edges.costs
        edges["costs"] = []
        parsed = _numeric_rows(memoryview(raw)[a:b])  # no copy of the array's text
        return None if parsed is None else problem_from_json(doc, edge_costs=parsed)
    return None


_SENTINEL = b'"layerwise: edges.costs read with numpy"'


def _numeric_rows(text: bytes | memoryview) -> tuple[np.ndarray, np.ndarray] | None:
    """`[[n, ...], ...]` as (flat float64 values, row lengths); None unless exactly that.

    The passes over the text go in chunks, so a 1 GB array needs no 1 GB temporaries."""
    arr = np.frombuffer(text, dtype=np.uint8)
    view = memoryview(text)
    integral, commas = True, 0
    for k in _chunks(arr):
        chunk = bytes(view[k : k + _CHUNK])
        integral = integral and not chunk.translate(None, _INTEGRAL)  # nothing else in it
        commas += chunk.count(b",")
    if not integral and not all(
        not bytes(view[k : k + _CHUNK]).translate(None, _NUMERIC) for k in _chunks(arr)
    ):
        return None  # true, null, NaN, strings...: the plain reader says what is wrong
    opens = _positions(arr, ord("["))
    closes = _positions(arr, ord("]"))
    if len(opens) != len(closes) or len(opens) < 2 or opens[0] != 0 or closes[-1] != len(arr) - 1:
        return None
    rows_open, rows_close = opens[1:], closes[:-1]
    if not ((rows_open < rows_close).all() and (rows_close[:-1] < rows_open[1:]).all()):
        return None  # nested deeper than rows of numbers
    if integral:
        compiled = compiled_integers() if len(arr) >= COMPILED_BYTES else None
        if compiled is not None:
            values = np.empty(commas + 1)
            lengths = np.zeros(len(rows_open), dtype=np.int64)
            found = compiled(arr, values, lengths)
            parsed = None if found < 0 else (values[:found], lengths)
        else:
            parsed = _integers(arr, rows_open, rows_close)
        if parsed is None:
            return None
        values, lengths = parsed
    else:  # decimals or exponents: numpy's text parser (slower, ~8 MB/s)
        data = bytes(text)
        bounds = np.stack([rows_open, rows_close], axis=1).reshape(-1)
        lengths = np.add.reduceat(arr == ord(","), bounds, dtype=np.int64)[::2] + 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                values = np.fromstring(data.translate(_NO_BRACKETS), sep=",")
            except (ValueError, DeprecationWarning):
                return None
        if (values == FORBIDDEN).any():
            return None  # maybe a decimal below 1e18 that strtod rounded up: the exact reader
    # one comma between two numbers of a row and between two rows, no others (no empty
    # entries, no numbers run together)
    if len(values) != lengths.sum() or commas != len(values) - 1:
        return None
    return values, lengths


def _chunks(arr: np.ndarray) -> range:
    return range(0, len(arr), _CHUNK)


def _positions(arr: np.ndarray, byte: int) -> np.ndarray:
    """Where `byte` occurs, in order."""
    found = [np.flatnonzero(arr[k : k + _CHUNK] == byte) + k for k in _chunks(arr)]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


_CHUNK = 1 << 24


def _integers(
    arr: np.ndarray, rows_open: np.ndarray, rows_close: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """The non-negative integers in `[[...], ...]` (digits, commas, brackets, whitespace)
    and how many fall in each row (`rows_open[r]` to `rows_close[r]`), vectorized in chunks
    that end at a separator; None if a number has more than 19 digits."""
    out = []
    lengths = np.zeros(len(rows_open), dtype=np.int64)
    lo = 0
    while lo < len(arr):
        hi = min(len(arr), lo + _CHUNK)
        while hi < len(arr) and int(arr[hi]) - 48 in range(10):
            hi += 1  # end the chunk at a separator
        digit = arr[lo:hi] - np.uint8(48)  # wraps around: separators become >= 10
        is_digit = np.concatenate([[False], digit < 10, [False]])
        change = np.flatnonzero(is_digit[1:] != is_digit[:-1])
        first, size = change[::2], change[1::2] - change[::2]
        if len(size) and size.max() > 19:
            return None
        value = np.zeros(len(first), dtype=np.uint64)
        places = size
        long = np.flatnonzero(size == len(_FORBIDDEN_DIGITS))
        if len(long):  # most bytes of a contest file are 1e18 (forbidden): compare, not sum
            window = np.lib.stride_tricks.sliding_window_view(digit, len(_FORBIDDEN_DIGITS))
            exact = long[(window[first[long]] == _FORBIDDEN_DIGITS).all(axis=1)]
            value[exact] = np.uint64(FORBIDDEN)
            places = size.copy()
            places[exact] = 0
        for k in range(int(places.max(initial=0))):  # Horner's rule, one digit place at a time
            more = np.flatnonzero(places > k)
            value[more] = value[more] * np.uint64(10) + digit[first[more] + k]
        as_float = value.astype(np.float64)
        # an allowed cost float64 rounds up to FORBIDDEN stays allowed (exact uint64 compare)
        as_float[(as_float >= FORBIDDEN) & (value < np.uint64(_FORBIDDEN_INT))] = BELOW_FORBIDDEN
        out.append(as_float)
        # the numbers of each row met in this chunk (a number outside every row is counted
        # in none, so the caller's total check refuses it)
        at = first + lo
        rows = slice(
            max(0, int(np.searchsorted(rows_close, lo))), int(np.searchsorted(rows_open, hi))
        )
        lengths[rows] += np.searchsorted(at, rows_close[rows]) - np.searchsorted(
            at, rows_open[rows]
        )
        lo = hi
    return (np.concatenate(out) if out else np.zeros(0)), lengths


_FORBIDDEN_DIGITS = np.frombuffer(b"%d" % FORBIDDEN, dtype=np.uint8) - np.uint8(48)
COMPILED_BYTES = 64 << 20  # arrays this large are parsed by the compiled loop (numba)


def compiled_integers() -> Any:
    """`_scan_integers` compiled by numba (cached on disk), or None without numba."""
    global _COMPILED
    if _COMPILED is None:
        try:
            import numba
        except ImportError:  # pragma: no cover - numba is a dependency
            _COMPILED = False
        else:
            _COMPILED = numba.njit(cache=True, nogil=True)(_scan_integers)
    return _COMPILED or None


_COMPILED: Any = None


def _scan_integers(arr: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> int:
    """One pass over `[[n, ...], ...]` (digits, commas, brackets, whitespace only): the
    numbers into `values`, how many each row has into `lengths`; how many numbers in all,
    or -1 for a number outside a row or of more than 19 digits. The reference is
    `_integers`; the tests compare the two."""
    count, row, depth, digits, value, large = 0, -1, 0, 0, 0, 0.0
    for k in range(len(arr)):
        c = int(arr[k])
        if 48 <= c <= 57:
            if digits == 19 or depth != 2:
                return -1
            if digits < 18:
                value = value * 10 + (c - 48)  # exact in int64 up to 18 digits
            elif value < 10**17:  # a 19th digit after a leading 0: not JSON, the plain reader
                return -1
            else:  # >= 1e18, forbidden: the rounding of floats is enough
                large = float(value) * 10.0 + float(c - 48)
            digits += 1
            continue
        if digits:
            if count == len(values):
                return -1
            if digits == 19:
                values[count] = large
            elif value < _FORBIDDEN_INT and float(value) >= FORBIDDEN:
                values[count] = BELOW_FORBIDDEN  # allowed, though float64 rounds it up to 1e18
            else:
                values[count] = value
            lengths[row] += 1
            count += 1
            digits, value = 0, 0
        if c == 91:  # [
            depth += 1
            if depth == 2:
                row += 1
        elif c == 93:  # ]
            depth -= 1
    return count


_NO_BRACKETS = bytes.maketrans(b"[]", b"  ")


# ----------------------------------------------------------------------------- writing


def problem_to_json(problem: Problem) -> dict[str, Any]:
    """The cost-table document of a problem with one memory pool (or none).

    Forbidden (inf) costs are written as 1e18; integral tables are written as integers.
    Node names other than "0", "1", ... go to the extra key nodes.names.
    """
    p = problem
    pools = _pools(p)
    if pools > 1:
        raise ProblemError(
            f"problem {p.name!r} has {pools} memory pools (one per device); the cost-table "
            "format holds one: build it for a single device or drop the memory tables"
        )
    nodes: dict[str, Any] = {}
    if p.usage is not None and p.intervals is not None:
        nodes["intervals"] = np.asarray(p.intervals, dtype=np.int64).tolist()
    nodes["costs"] = _rows([_writable(c, p.name) for c in p.node_cost])
    if p.usage is not None:
        usages = [np.asarray(u, dtype=np.float64).reshape(-1) for u in p.usage]
        if not all(np.isfinite(u).all() for u in usages):
            raise ProblemError(f"problem {p.name!r} has a non-finite memory usage")
        nodes["usages"] = _rows(usages)
    if p.node_names != tuple(str(i) for i in range(p.num_nodes)):
        nodes["names"] = list(p.node_names)
    edges = {
        "nodes": [[u, v] for u, v in p.edges],
        "costs": _rows([_writable(t, p.name).reshape(-1) for t in p.edge_cost]),
    }
    out: dict[str, Any] = {"name": p.name, "nodes": nodes, "edges": edges}
    if p.usage_limit is not None:
        limit = float(np.asarray(p.usage_limit).reshape(-1)[0])
        if not math.isfinite(limit):
            raise ProblemError(f"problem {p.name!r} has a non-finite usage limit")
        out["usage_limit"] = int(limit) if limit.is_integer() else limit
    return {"problem": out}


def _pools(p: Problem) -> int:
    pools = {np.asarray(u).reshape(len(u), -1).shape[1] for u in p.usage or ()}
    if p.usage_limit is not None:
        pools.add(np.asarray(p.usage_limit).size)
    return max(pools, default=0)


def _writable(table: np.ndarray, name: str) -> np.ndarray:
    t = np.asarray(table, dtype=np.float64)
    if np.isnan(t).any():
        raise ProblemError(f"problem {name!r} has a NaN cost")
    return np.where(t >= FORBIDDEN, FORBIDDEN, t)


def _rows(tables: Sequence[np.ndarray]) -> list[list[Any]]:
    """Tables as JSON rows: integers when every value is integral (as IOPDDL writes them)."""
    if not tables:
        return []
    flat = np.concatenate([np.asarray(t).reshape(-1) for t in tables])
    if len(flat) and (flat == np.floor(flat)).all() and (np.abs(flat) < 2**63).all():
        values: list[Any] = flat.astype(np.int64).tolist()
    else:
        values = flat.tolist()
    off = _offsets(np.array([np.asarray(t).size for t in tables], dtype=np.int64)).tolist()
    return [values[a:b] for a, b in itertools.pairwise(off)]


def save_problem(problem: Problem, path: str | Path) -> None:
    """Write a problem as a cost-table file (compact JSON, no inf or NaN), atomically and only
    to a regular file (`planner.files.open_text_atomic`).

    The edge tables are streamed row by row, so a 35,000-node instance is written without
    holding its ~60 million costs as Python numbers."""
    p = problem
    doc = problem_to_json(dataclasses.replace(p, edges=(), edge_cost=()))
    doc["problem"]["edges"] = {"nodes": [[u, v] for u, v in p.edges], "costs": []}
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    head, tail = text.rsplit('"costs":[]', 1)
    tables = [_writable(t, p.name).reshape(-1) for t in p.edge_cost]
    integral = all((t == np.floor(t)).all() and (np.abs(t) < 2**63).all() for t in tables)
    with open_text_atomic(path, "cost-table problem") as f:  # never half a file, nor a FIFO
        f.write(head + '"costs":[')
        for e, t in enumerate(tables):
            values = t.astype(np.int64).tolist() if integral else t.tolist()
            f.write(("," if e else "") + "[" + ",".join(map(repr, values)) + "]")
        f.write("]" + tail + "\n")


# ----------------------------------------------------------------------------- random


def random_problem(
    num_nodes: int,
    max_strategies: int,
    seed: int,
    edge_prob: float = 0.3,
    forbid_prob: float = 0.05,
    memory: bool = True,
    name: str | None = None,
) -> Problem:
    """A seeded random cost-table problem shaped like IOPDDL's instances.

    A DAG in node order (each node usually consumes a recent node; with probability
    `edge_prob`, repeatedly, one more input: a nearby node (diamonds), a hub (fan-out) or a
    repeated input (parallel edges)); 1..max_strategies strategies per node; integer costs,
    each forbidden with probability `forbid_prob` but never every strategy of a node. With
    `memory`, usages, intervals from each node to its last consumer, and a usage limit between
    the peak of the least-memory choice vector (which is kept feasible, edges included) and
    the peak of the most-memory one. The tables do not depend on `memory`.
    """
    if num_nodes < 1 or max_strategies < 1:
        raise ProblemError(
            f"random_problem needs num_nodes >= 1 and max_strategies >= 1, "
            f"got {num_nodes} and {max_strategies}"
        )
    if not (0 <= edge_prob < 1 and 0 <= forbid_prob < 1):
        raise ProblemError(
            f"edge_prob and forbid_prob must be in [0, 1), got {edge_prob} and {forbid_prob}"
        )
    rng = np.random.default_rng(seed)
    n = num_nodes
    sizes = rng.integers(1, max_strategies + 1, size=n)
    pairs = _random_dag(rng, n, edge_prob)

    node_off = _offsets(sizes)
    scale = np.repeat(np.round(10 ** rng.uniform(1, 4, n)), sizes)
    costs = np.floor(rng.random(node_off[-1]) * scale)
    banned = rng.random(node_off[-1]) < forbid_prob
    for i in np.flatnonzero(np.add.reduceat(~banned, node_off[:-1]) == 0):
        banned[node_off[i] + rng.integers(sizes[i])] = False  # keep one strategy per node
    costs[banned] = np.inf
    usage = np.floor(rng.random(node_off[-1]) * np.repeat(10 ** rng.uniform(0, 3, n), sizes))
    allowed_use = np.where(banned, np.inf, usage)
    least = np.array([np.argmin(allowed_use[a:b]) for a, b in itertools.pairwise(node_off)])

    elens = sizes[pairs[:, 0]] * sizes[pairs[:, 1]]
    edge_off = _offsets(elens)
    ecosts = np.floor(
        rng.random(edge_off[-1]) * np.repeat(10 ** rng.uniform(1, 4, len(elens)), elens)
    )
    ecosts[rng.random(edge_off[-1]) < 0.3] = 0.0  # matching shardings need no resharding
    ebanned = rng.random(edge_off[-1]) < forbid_prob
    ebanned[edge_off[:-1] + least[pairs[:, 0]] * sizes[pairs[:, 1]] + least[pairs[:, 1]]] = False
    ecosts[ebanned] = np.inf

    intervals = _random_intervals(rng, n, pairs)
    peak_min = _peak(np.array([usage[node_off[i] + least[i]] for i in range(n)]), intervals, n)
    most = np.maximum.reduceat(np.where(banned, -np.inf, usage), node_off[:-1])
    peak_max = _peak(most, intervals, n)
    limit = math.floor(peak_min + rng.uniform(0.2, 0.6) * (peak_max - peak_min))

    return Problem(
        name=name or f"random-n{num_nodes}-s{max_strategies}-seed{seed}",
        node_names=tuple(str(i) for i in range(n)),
        node_cost=_split(costs, node_off),
        edges=tuple((int(u), int(v)) for u, v in pairs.tolist()),
        edge_cost=tuple(
            ecosts[edge_off[e] : edge_off[e + 1]].reshape(sizes[u], sizes[v])
            for e, (u, v) in enumerate(pairs.tolist())
        ),
        usage=tuple(u.reshape(-1, 1) for u in _split(usage, node_off)) if memory else None,
        intervals=intervals if memory else None,
        usage_limit=np.array([float(limit)]) if memory else None,
    )


def _random_dag(rng: np.random.Generator, n: int, edge_prob: float) -> np.ndarray:
    edges: list[tuple[int, int]] = []
    hubs = [0]
    for v in range(1, n):
        preds: list[int] = []
        if rng.random() >= 0.03:  # else v starts a new chain (a source)
            preds.append(v - min(int(rng.geometric(0.5)), v))
        while rng.random() < edge_prob:
            r = rng.random()
            if r < 0.15 and preds:
                preds.append(preds[int(rng.integers(len(preds)))])  # parallel edge
            elif r < 0.35:
                preds.append(hubs[int(rng.integers(len(hubs)))])  # fan-out of a hub
            else:
                preds.append(v - min(int(rng.geometric(0.3)), v))  # fan-in: diamonds
        edges.extend((u, v) for u in preds)
        if rng.random() < 0.02:
            hubs.append(v)
    return np.array(edges, dtype=np.int64).reshape(-1, 2)


def _random_intervals(rng: np.random.Generator, n: int, pairs: np.ndarray) -> np.ndarray:
    """Node i is live from i until past its last consumer (or longer); a few never live."""
    start = np.arange(n, dtype=np.int64)
    last = start.copy()
    np.maximum.at(last, pairs[:, 0], pairs[:, 1])
    extra = rng.geometric(1 / max(2.0, n / 16), n)
    end = np.minimum(np.maximum(start + extra, last + 1), n)
    end[rng.random(n) < 0.05] = n  # long-lived (parameters)
    empty = rng.random(n) < 0.05
    end[empty] = start[empty]
    return np.stack([start, end], axis=1)


def _peak(use: np.ndarray, intervals: np.ndarray, horizon: int) -> float:
    delta = np.zeros(horizon + 1)
    np.add.at(delta, intervals[:, 0], use)
    np.add.at(delta, intervals[:, 1], -use)
    return float(np.cumsum(delta).max())


# ----------------------------------------------------------------------------- contest-like

LAYOUTS = 12  # sharding layouts of a tensor in `contest_problem` (layout 0: replicated)


def contest_problem(
    num_nodes: int,
    seed: int,
    strategies: tuple[int, int] = (20, 60),
    tightness: tuple[float, float] = (0.9, 1.0),
    name: str | None = None,
    follow: float = 0.5,
    saved: float = 0.1,
    parallel: float = 0.02,
    reverse: float = 0.2,
    never_live: float = 0.08,
) -> Problem:
    """A seeded auto-sharding problem shaped like the IOPDDL contest's real instances.

    A program in node order: about 15% of the nodes are parameters (no inputs, live from
    their definition, or from time 0, to the end of the program, with 4-12 strategies: one
    per layout they may take); the others are operations with `strategies` (inclusive range)
    strategies each, consuming a recent value, often a parameter, sometimes a value from
    far back (a skip connection or a backward pass) or a second recent value. An operation is
    live from its own time until its last consumer (most intervals are short).

    A strategy fixes the layout of the node's output and the layout it wants each operand in
    (one of `LAYOUTS` shardings, each with a shard factor); its cost is compute time under
    that sharding plus some noise, its usage the output's bytes divided by the shard factor.
    An edge costs the producer's bytes times a resharding factor of (output layout, wanted
    layout), zero when they match: like real resharding costs, it depends only on those
    two layouts, so strategies that share them have equal rows and columns. About 2% of the
    operations' strategies are forbidden, and on 30% of the edges so are the pairs whose
    resharding is impossible (4% of the layout pairs), but a witness choice vector (every
    node at one of its least-usage strategies) stays allowed.

    The usage limit is set so that the witness (the lowest possible peak) peaks at a fraction
    of the limit drawn from `tightness`: 0.9-1.0 leaves almost no room at the peak.

    What the public instances (A, G, M, S) have besides, drawn from a second random stream
    (all five at 0 give the problems of the first version of this generator):
    `follow`: the fraction of edges whose consumer keeps the producer's layout (an
    elementwise op, a reshape): the only allowed pairs, at cost 0, are those of equal layouts
    (at least one per row), every other pair is forbidden: 35-68% of the real instances'
    edge entries are such forbidden pairs; `saved`: the fraction of the first half's
    operations read again near the mirrored time (an activation saved for the backward pass:
    long live ranges); `parallel`: the fraction of edges repeated (a second table between
    the same two nodes); `reverse`: the fraction of edges written from consumer to producer
    (the table transposed), as in instance A; `never_live`: the fraction of operations with
    an empty live interval (their usage never counts).
    """
    lo, hi = strategies
    if num_nodes < 2 or not 1 <= lo <= hi or not 0 < tightness[0] <= tightness[1] <= 1:
        raise ProblemError(
            f"contest_problem needs num_nodes >= 2, 1 <= strategies[0] <= strategies[1] and "
            f"0 < tightness[0] <= tightness[1] <= 1; got {num_nodes}, {strategies}, {tightness}"
        )
    for what, value in (("follow", follow), ("saved", saved), ("parallel", parallel),
                        ("reverse", reverse), ("never_live", never_live)):  # fmt: skip
        if not 0 <= value <= 1:
            raise ProblemError(f"contest_problem needs 0 <= {what} <= 1, got {value}")
    rng = np.random.default_rng(seed)
    real = np.random.default_rng([seed, 20])  # the draws of the real instances' structure
    n = num_nodes
    param = rng.random(n) < 0.15
    param[:2] = [False, True]
    pairs = _more_edges(real, _program_dag(rng, param), param, saved, parallel)
    shard = np.array([1, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 16], dtype=np.float64)[:LAYOUTS]
    # resharding factor from layout a to layout b: moving most of the tensor, 0 if equal
    reshard = (1 / shard[:, None] + 1 / shard[None, :]) * rng.uniform(0.6, 1.6, (LAYOUTS,) * 2)
    np.fill_diagonal(reshard, 0.0)
    tensor_layouts = [np.sort(rng.choice(LAYOUTS, int(rng.integers(4, LAYOUTS + 1)),
                                         replace=False)) for _ in range(n)]  # fmt: skip
    sizes = np.where(param, [len(t) for t in tensor_layouts], rng.integers(lo, hi + 1, n))
    out_layout = [t if param[i] else rng.choice(t, sizes[i]) for i, t in enumerate(tensor_layouts)]
    nbytes = np.round(10 ** rng.uniform(2, 5, n))
    flops = np.where(param, 0.0, np.round(10 ** rng.uniform(2, 5, n)))
    impossible = rng.random((LAYOUTS, LAYOUTS)) < 0.04  # resharding a layout cannot do
    np.fill_diagonal(impossible, False)
    node_cost, usage, witness = [], [], []
    for i in range(n):
        f = shard[out_layout[i]]
        cost = np.floor(flops[i] * (1 / f + rng.uniform(0, 0.5, sizes[i])))
        use = np.floor(nbytes[i] / f)
        smallest = np.flatnonzero(use == use.min())
        witness.append(int(smallest[rng.integers(len(smallest))]))
        if not param[i] and sizes[i] > 1:
            banned = rng.random(sizes[i]) < 0.02
            banned[witness[i]] = False
            cost[banned] = np.inf
        node_cost.append(cost)
        usage.append(use.reshape(-1, 1))
    edge_cost = []
    for u, v in pairs.tolist():
        if follow and real.random() < follow:  # v keeps u's layout, or cannot take u at all
            same = out_layout[u][:, None] == out_layout[v][None, :]
            lonely = np.flatnonzero(~same.any(axis=1))
            same[lonely, real.integers(0, sizes[v], len(lonely))] = True
            same[witness[u], witness[v]] = True
            edge_cost.append(np.where(same, 0.0, np.inf))
            continue
        wanted = rng.choice(tensor_layouts[u], sizes[v])  # the layout v wants u's output in
        table = np.floor(nbytes[u] * reshard[np.ix_(out_layout[u], wanted)])
        if rng.random() < 0.3:
            table[impossible[np.ix_(out_layout[u], wanted)]] = np.inf
            table[witness[u], witness[v]] = np.floor(
                nbytes[u] * reshard[out_layout[u][witness[u]], wanted[witness[v]]]
            )
        edge_cost.append(table)
    intervals = _program_intervals(rng, pairs, param)
    empty = ~param & (real.random(n) < never_live)
    intervals[empty, 1] = intervals[empty, 0]
    flip = real.random(len(pairs)) < reverse
    pairs[flip] = pairs[flip][:, ::-1]
    edge_cost = [t.T if f else t for t, f in zip(edge_cost, flip.tolist(), strict=True)]
    # the witness (allowed, every node at its least usage) peaks at the lowest possible peak
    peak_min = _peak(np.array([u[k, 0] for u, k in zip(usage, witness, strict=True)]), intervals, n)
    limit = math.floor(peak_min / rng.uniform(*tightness))
    return Problem(
        name=name or f"contest-n{n}-seed{seed}",
        node_names=tuple(str(i) for i in range(n)),
        node_cost=tuple(node_cost),
        edges=tuple((int(u), int(v)) for u, v in pairs.tolist()),
        edge_cost=tuple(edge_cost),
        usage=tuple(usage),
        intervals=intervals,
        usage_limit=np.array([float(limit)]),
    )


def _more_edges(
    rng: np.random.Generator, pairs: np.ndarray, param: np.ndarray, saved: float, parallel: float
) -> np.ndarray:
    """The program's edges, plus backward reads of saved activations (an operation v of the
    first half read by the operation nearest after its mirrored time n - 1 - v) and repeated
    edges; sorted by consumer, as a program is."""
    n = len(param)
    ops = np.flatnonzero(~param)
    first_half = ops[(ops < n // 2) & (rng.random(len(ops)) < saved)]
    later = np.searchsorted(ops, n - 1 - first_half)
    ok = later < len(ops)
    backward = np.stack([first_half[ok], ops[later[ok]]], axis=1)
    backward = backward[backward[:, 0] < backward[:, 1]]
    repeated = pairs[rng.random(len(pairs)) < parallel]
    out = np.concatenate([pairs, backward, repeated]).reshape(-1, 2)
    return out[np.lexsort((out[:, 0], out[:, 1]))]


def _program_dag(rng: np.random.Generator, param: np.ndarray) -> np.ndarray:
    """Edges u -> v (u < v) of a program: each operation reads a recent value, often a
    recent parameter, sometimes a value from far back or a second recent value."""
    edges: list[tuple[int, int]] = []
    values: list[int] = []
    params: list[int] = []
    for v in range(len(param)):
        if param[v]:
            params.append(v)
            continue
        inputs = set()
        if values:
            inputs.add(values[-min(int(rng.geometric(0.6)), len(values))])
            if rng.random() < 0.08:
                inputs.add(values[-min(int(rng.geometric(0.01)), len(values))])  # skip / backward
            if rng.random() < 0.05:
                inputs.add(values[-min(int(rng.geometric(0.3)), len(values))])
        if params and rng.random() < 0.5:
            inputs.add(params[-min(int(rng.geometric(0.5)), len(params))])
        edges.extend((u, v) for u in sorted(inputs))
        values.append(v)
    return np.array(edges, dtype=np.int64).reshape(-1, 2)


def _program_intervals(
    rng: np.random.Generator, pairs: np.ndarray, param: np.ndarray
) -> np.ndarray:
    """An operation lives from its time until its last consumer (one step if none); a
    parameter from its time, or half the time from 0, to the end."""
    n = len(param)
    start = np.arange(n, dtype=np.int64)
    last = start.copy()
    np.maximum.at(last, pairs[:, 0], pairs[:, 1])
    end = last + 1
    end[param] = n
    start[param & (rng.random(n) < 0.5)] = 0
    return np.stack([start, end], axis=1)


# ----------------------------------------------------------------------------- brute force


def brute_force(
    problem: Problem, respect_memory: bool = True
) -> tuple[tuple[int, ...] | None, float]:
    """The exhaustive optimum of the additive objective: (choices, cost), (None, inf) if none.

    Enumerates every choice vector in `itertools.product` order (vectorized in blocks), so
    among tied optima the first in that order wins. Costs are summed in the same order as
    `planner.problems.evaluate.additive_cost`; memory uses its liveness rule and tolerance.
    """
    sizes = problem.sizes
    total = math.prod(sizes)
    if total > BRUTE_FORCE_LIMIT:
        raise ProblemError(
            f"problem {problem.name!r} has {total:.3g} choice vectors; brute_force enumerates "
            f"at most {BRUTE_FORCE_LIMIT:.0e}: use an exact backend"
        )
    if problem.num_nodes == 0:
        return (), 0.0
    memory = respect_memory and problem.usage_limit is not None and problem.usage is not None
    if memory:
        assert problem.usage is not None and problem.intervals is not None
        start, end = problem.intervals[:, 0], problem.intervals[:, 1]
        times = np.unique(start)
        live = ((start[None, :] <= times[:, None]) & (times[:, None] < end[None, :])).astype(
            np.float64
        )
        usage = [np.asarray(u, dtype=np.float64).reshape(len(u), -1) for u in problem.usage]
        limit = np.asarray(problem.usage_limit, dtype=np.float64).reshape(-1) * (1 + 1e-9)
    best, best_cost = None, math.inf
    block = max(1, (1 << 22) // (problem.num_nodes + len(problem.edges)))
    for lo in range(0, total, block):
        ch = np.unravel_index(np.arange(lo, min(total, lo + block)), sizes)
        cost = np.zeros(len(ch[0]))
        for i, c in enumerate(problem.node_cost):
            cost += c[ch[i]]
        for (u, v), t in zip(problem.edges, problem.edge_cost, strict=True):
            cost += t[ch[u], ch[v]]
        if memory:
            for m in range(len(limit)):
                use = np.stack([u[ch[i], m] for i, u in enumerate(usage)])  # (n, block)
                cost[((live @ use) > limit[m]).any(axis=0)] = math.inf
        k = int(np.argmin(cost))
        if cost[k] < best_cost:
            best, best_cost = lo + k, float(cost[k])
    if best is None:
        return None, math.inf
    return tuple(int(x) for x in np.unravel_index(best, sizes)), best_cost
