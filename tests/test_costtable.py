"""Cost-table problems (IOPDDL format): reading, writing, random instances, brute force."""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.errors import ProblemError
from planner.problems.costtable import (
    brute_force,
    contest_problem,
    load_problem,
    problem_from_json,
    problem_to_json,
    random_problem,
    save_problem,
)
from planner.problems.evaluate import additive_cost, memory_feasible, memory_peak
from planner.problems.problem import FORBIDDEN, Problem

F = int(FORBIDDEN)

# Four nodes; node 1's strategy 1 and the edge pair (0:1, 1:1) are forbidden. Node 3 is never
# live (empty interval) although it uses 100. Live sets: t=0 {0}, t=1 {0,1}, t=3 {0,2}, so a
# choice vector's peak is max(u0 + u1, u0 + u2).
#   choices      cost                                  peak
#   (1,2,1,0)    5+2+3+1 + e01[1][2]=0 + e12[2][1]=0 = 11   max(8+6, 8+5) = 14
#   (0,0,1,0)    10+4+3+1 + 0 + 3                     = 21   max(3+2, 3+5) = 8
#   (0,2,1,0)    10+2+3+1 + 6 + 0                     = 22   max(3+6, 3+5) = 9
#   (1,0,0,0)    5+4+8+1 + 4 + 0                      = 22   max(8+2, 8+1) = 10
#   (0,0,0,0)    10+4+8+1 + 0 + 0                     = 23   max(3+2, 3+1) = 5
# Unconstrained optimum (1,2,1,0) = 11; with usage_limit 12 it is (0,0,1,0) = 21.
SMALL: dict[str, Any] = {
    "problem": {
        "name": "small",
        "nodes": {
            "intervals": [[0, 4], [1, 3], [3, 5], [2, 2]],
            "costs": [[10, 5], [4, F, 2], [8, 3], [1]],
            "usages": [[3, 8], [2, 0, 6], [1, 5], [100]],
        },
        "edges": {
            "nodes": [[0, 1], [1, 2], [0, 3]],
            "costs": [[0, 1, 6, 4, F, 0], [0, 3, 2, 2, 5, 0], [0, 0]],
        },
        "usage_limit": 12,
    }
}


def small(limit: float | None = 12) -> Problem:
    doc = copy.deepcopy(SMALL)
    if limit is None:
        del doc["problem"]["usage_limit"]
    else:
        doc["problem"]["usage_limit"] = limit
    return problem_from_json(doc)


def naive_optimum(p: Problem, respect_memory: bool = True) -> float:
    """The plain itertools.product reference, through the evaluators."""
    best = math.inf
    for ch in itertools.product(*(range(k) for k in p.sizes)):
        if respect_memory and not memory_feasible(p, ch):
            continue
        best = min(best, additive_cost(p, ch))
    return best


def same_problem(a: Problem, b: Problem) -> None:
    assert a.name == b.name and a.node_names == b.node_names and a.edges == b.edges
    for x, y in zip(a.node_cost, b.node_cost, strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(a.edge_cost, b.edge_cost, strict=True):
        np.testing.assert_array_equal(x, y)
    if a.usage is None:
        assert b.usage is None and b.intervals is None and b.usage_limit is None
        return
    assert b.usage is not None and a.intervals is not None and b.intervals is not None
    for x, y in zip(a.usage, b.usage, strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.intervals, b.intervals)
    if a.usage_limit is None:
        assert b.usage_limit is None
    else:
        np.testing.assert_array_equal(a.usage_limit, b.usage_limit)


# ----------------------------------------------------------------------------- reading


def test_reads_tables_shapes_and_forbidden() -> None:
    p = small()
    assert p.name == "small" and p.sizes == (2, 3, 2, 1)
    assert p.edges == ((0, 1), (1, 2), (0, 3))
    assert p.edge_cost[0].shape == (2, 3) and p.edge_cost[0][0, 2] == 6  # row-major by u
    assert p.node_cost[1][1] == math.inf and p.edge_cost[0][1, 1] == math.inf
    assert all(u.shape == (k, 1) for u, k in zip(p.usage or (), p.sizes, strict=True))
    assert p.intervals is not None and p.intervals.dtype.kind == "i"
    assert p.intervals.shape == (4, 2)
    np.testing.assert_array_equal(p.usage_limit, [12.0])


def test_hand_instance_optimum_and_liveness() -> None:
    p = small()
    assert brute_force(p) == ((0, 0, 1, 0), 21.0)
    assert brute_force(p, respect_memory=False) == ((1, 2, 1, 0), 11.0)
    assert brute_force(small(None)) == ((1, 2, 1, 0), 11.0)  # no limit: nothing to respect
    assert additive_cost(p, (0, 0, 1, 0)) == 21.0 and additive_cost(p, (1, 2, 1, 0)) == 11.0
    # liveness: nodes 1 and 2 never overlap and node 3 (empty interval) never counts
    assert memory_peak(p, (0, 2, 1, 0))[0] == 9.0 and memory_feasible(p, (0, 2, 1, 0))
    assert memory_peak(p, (1, 2, 1, 0))[0] == 14.0 and not memory_feasible(p, (1, 2, 1, 0))
    assert brute_force(small(7)) == ((0, 0, 0, 0), 23.0)
    assert brute_force(small(4)) == (None, math.inf)  # every vector peaks at >= 5


def test_forbidden_never_chosen() -> None:
    doc = copy.deepcopy(SMALL)
    doc["problem"]["nodes"]["costs"][1] = [F, 0, F]  # only node 1's strategy 1 is allowed
    doc["problem"]["edges"]["costs"][0] = [0, F, 0, 0, 0, 0]  # ... and (0:0, 1:1) is forbidden
    p = problem_from_json(doc)
    ch, cost = brute_force(p, respect_memory=False)
    assert ch is not None and ch[:2] == (1, 1) and math.isfinite(cost)
    doc["problem"]["edges"]["costs"][0] = [0, F, 0, 0, F, 0]  # now nothing is allowed
    assert brute_force(problem_from_json(doc), respect_memory=False) == (None, math.inf)
    assert additive_cost(problem_from_json(doc), (0, 1, 0, 0)) == math.inf


def test_accepts_inner_object_and_optional_memory() -> None:
    inner = copy.deepcopy(SMALL["problem"])
    same_problem(problem_from_json(inner), small())
    for key in ("intervals", "usages"):
        del inner["nodes"][key]
    del inner["usage_limit"]
    p = problem_from_json(inner)
    assert p.usage is None and p.intervals is None and p.usage_limit is None
    assert brute_force(p) == ((1, 2, 1, 0), 11.0)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    *keys, last = path.split(".")

    def mutate(doc: dict[str, Any]) -> None:
        obj: Any = doc
        for k in keys:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        if value is _DELETE:
            del obj[last]
        elif isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value

    return mutate


_DELETE = object()

MALFORMED = [
    ("problem.nodes", _DELETE, r'problem has no "nodes"'),
    ("problem.edges", _DELETE, r'problem has no "edges"'),
    ("problem.nodes.costs", _DELETE, r'nodes has no "costs"'),
    ("problem.nodes.costs", {"a": 1}, r"nodes\.costs must be a list"),
    ("problem.nodes.costs.1", [4, "x", 2], r"nodes\.costs\[1\]\[1\] \(node 1\) is 'x'"),
    ("problem.nodes.costs.1", [4, True, 2], r"node 1\) is True, not a number"),
    ("problem.nodes.costs.2", 7, r"nodes\.costs\[2\] \(node 2\) must be a list"),
    ("problem.nodes.costs.2", [], r"node 2 has no strategies"),
    ("problem.nodes.costs.0", [10, -1], r"node 0 has a negative or NaN value -1"),
    ("problem.nodes.costs.0", [10, float("nan")], r"node 0 has a negative or NaN"),
    ("problem.nodes.usages.1", [2, 0], r"node 1 has 2 usages, expected 3"),
    ("problem.nodes.usages.1", [2, -3, 6], r"node 1 has a negative .* nodes\.usages"),
    ("problem.nodes.usages", [[3, 8]], r"nodes\.usages has 1 rows, expected one per node \(4\)"),
    ("problem.nodes.intervals", [[0, 4]], r"nodes\.intervals has 1 entries, expected 4"),
    ("problem.nodes.intervals.2", [5, 3], r"node 2 has interval \[5, 3\) whose end is before"),
    ("problem.nodes.intervals.2", [5], r"nodes\.intervals\[2\] \(node 2\) must be a pair"),
    ("problem.nodes.intervals.2", [0.5, 3], r"must be a pair of integers"),
    ("problem.nodes.usages", _DELETE, r"need nodes\.usages"),
    ("problem.edges.costs.1", [0, 3, 2, 2, 5], r"edge 1 \(1 -> 2\) has 5 costs, expected 3 x 2"),
    ("problem.edges.costs.0", [0, -1, 6, 4, F, 0], r"edge 0 has a negative or NaN value -1"),
    ("problem.edges.costs", [[0, 0]], r"1 tables for 3 edges"),
    ("problem.edges.nodes.1", [1, 4], r"edge 1 \(1 -> 4\) names a node that does not exist"),
    ("problem.edges.nodes.1", [-1, 2], r"edge 1 \(-1 -> 2\) names a node that does not exist"),
    ("problem.edges.nodes.1", [2, 2], r"edge 1 joins node 2 to itself"),
    ("problem.edges.nodes.1", [1, 2, 3], r"edges\.nodes\[1\] \(edge 1\) must be a pair"),
    ("problem.usage_limit", -5, r"usage_limit must be a finite number >= 0"),
    ("problem.usage_limit", "big", r"usage_limit must be a finite number"),
    ("problem.name", 3, r'"name" must be a string'),
    ("problem.nodes.names", ["a"], r"nodes\.names must be a list of 4 strings"),
]


@pytest.mark.parametrize(("path", "value", "message"), MALFORMED)
def test_malformed_input_is_a_clear_error(
    tmp_path: Path, path: str, value: Any, message: str
) -> None:
    doc = copy.deepcopy(SMALL)
    _set(path, value)(doc)
    with pytest.raises(ProblemError, match=message) as info:
        problem_from_json(doc)
    if path != "problem.name":
        assert "'small'" in str(info.value)  # names the problem
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ProblemError, match=message) as info:
        load_problem(f)
    assert str(f) in str(info.value)  # names the file


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ProblemError, match=r"missing\.json does not exist"):
        load_problem(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"problem": {"nodes": ')
    with pytest.raises(ProblemError, match=r"bad\.json is not valid JSON"):
        load_problem(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ProblemError, match=r"is a JSON object, not list"):
        load_problem(bad)
    with pytest.raises(ProblemError, match=r'"problem" must be a JSON object'):
        problem_from_json({"problem": [1]})


# ----------------------------------------------------------------------------- writing


def test_round_trip_preserves_tables_forbidden_and_limit(tmp_path: Path) -> None:
    p = small()
    f = tmp_path / "p.json"
    save_problem(p, f)
    text = f.read_text()
    assert "Infinity" not in text and "NaN" not in text and str(F) in text
    q = load_problem(f)
    same_problem(p, q)
    assert q.node_cost[1][1] == math.inf and q.edge_cost[0][1, 1] == math.inf
    assert json.loads(text) == SMALL  # integral tables are written back as integers


def test_round_trip_floats_names_and_no_memory(tmp_path: Path) -> None:
    p = Problem(
        name="floats",
        node_names=("conv", "relu"),
        node_cost=(np.array([0.1, 1 / 3]), np.array([2.5e-7, np.inf])),
        edges=((0, 1), (0, 1)),
        edge_cost=(np.array([[0.0, 1e-300], [7.0, np.inf]]), np.zeros((2, 2))),
    )
    save_problem(p, tmp_path / "f.json")
    q = load_problem(tmp_path / "f.json")
    same_problem(p, q)
    assert "intervals" not in problem_to_json(p)["problem"]["nodes"]


def _pooled(pools: int) -> Problem:
    return Problem(
        name="dnn",
        node_names=("a", "b"),
        node_cost=(np.array([1.0, 2.0]), np.array([3.0])),
        edges=((0, 1),),
        edge_cost=(np.array([[0.0], [1.0]]),),
        usage=(np.ones((2, pools)), np.ones((1, pools))),
        intervals=np.array([[0, 4], [1, 3]]),
        usage_limit=np.full(pools, 2.0),
    )


def test_problem_with_several_memory_pools_is_refused() -> None:
    with pytest.raises(ProblemError, match=r"'dnn' has 4 memory pools"):
        problem_to_json(_pooled(4))
    doc = problem_to_json(_pooled(1))
    assert doc["problem"]["usage_limit"] == 2 and doc["problem"]["nodes"]["usages"] == [[1, 1], [1]]
    same_problem(_pooled(1), problem_from_json(doc))


# ----------------------------------------------------------------------------- random


def test_random_problem_is_deterministic_and_well_formed() -> None:
    a, b = random_problem(60, 6, seed=3), random_problem(60, 6, seed=3)
    assert problem_to_json(a) == problem_to_json(b)
    assert problem_to_json(a) != problem_to_json(random_problem(60, 6, seed=4))
    assert all(1 <= k <= 6 for k in a.sizes)
    assert all(u < v for u, v in a.edges)
    assert all(np.isfinite(c).any() for c in a.node_cost)
    assert a.intervals is not None and (a.intervals[:, 0] <= a.intervals[:, 1]).all()
    # the tables do not depend on `memory`
    c = random_problem(60, 6, seed=3, memory=False)
    assert c.usage is None and c.intervals is None and c.usage_limit is None
    for x, y in zip(a.node_cost, c.node_cost, strict=True):
        np.testing.assert_array_equal(x, y)


def test_random_problem_shape_like_iopddl() -> None:
    p = random_problem(800, 40, seed=0)
    assert p.num_nodes == 800 and max(p.sizes) == 40
    assert 1.0 <= len(p.edges) / p.num_nodes <= 2.0
    assert p.intervals is not None
    spans = p.intervals[:, 1] - p.intervals[:, 0]
    assert 0 < spans.mean() < 800 / 2 and (spans == 0).any()
    g = nx.MultiDiGraph(p.edges)
    assert any(k > 1 for k in Counter(p.edges).values())  # parallel edges
    assert max(d for _, d in g.out_degree()) >= 10  # fan-out
    assert max(d for _, d in g.in_degree()) >= 3  # fan-in
    reconverge = False  # a diamond: two distinct inputs of a node share an ancestor
    for v in g:
        preds = sorted(set(g.predecessors(v)))
        for a, b in itertools.combinations(preds, 2):
            if (nx.ancestors(g, a) | {a}) & (nx.ancestors(g, b) | {b}):
                reconverge = True
                break
        if reconverge:
            break
    assert reconverge
    # the limit binds: the cheapest strategy of every node does not fit in memory
    greedy = [int(np.argmin(c)) for c in p.node_cost]
    assert not memory_feasible(p, greedy)


def test_random_problem_rejects_bad_arguments() -> None:
    with pytest.raises(ProblemError, match="num_nodes >= 1"):
        random_problem(0, 3, seed=0)
    with pytest.raises(ProblemError, match="edge_prob"):
        random_problem(5, 3, seed=0, edge_prob=1.0)


def test_brute_force_refuses_huge_problems() -> None:
    with pytest.raises(ProblemError, match=r"choice vectors; brute_force enumerates at most"):
        brute_force(random_problem(30, 8, seed=0))


sizes = st.tuples(
    st.integers(1, 7),  # nodes
    st.integers(1, 4),  # strategies
    st.integers(0, 2**32 - 1),  # seed
    st.sampled_from([0.0, 0.3, 0.7]),  # edge_prob
    st.sampled_from([0.0, 0.05, 0.4]),  # forbid_prob
    st.booleans(),  # memory
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(args=sizes)
def test_random_problems_round_trip_exactly(tmp_path: Path, args: tuple) -> None:
    n, k, seed, edge_prob, forbid_prob, memory = args
    p = random_problem(n, k, seed, edge_prob=edge_prob, forbid_prob=forbid_prob, memory=memory)
    f = tmp_path / "r.json"
    save_problem(p, f)
    same_problem(p, load_problem(f))


@settings(max_examples=60, deadline=None)
@given(args=sizes, picks=st.lists(st.integers(0, 10**6), min_size=7, max_size=7))
def test_brute_force_is_the_optimum(args: tuple, picks: list[int]) -> None:
    n, k, seed, edge_prob, forbid_prob, memory = args
    p = random_problem(n, k, seed, edge_prob=edge_prob, forbid_prob=forbid_prob, memory=memory)
    ch, cost = brute_force(p)
    assert ch is not None  # random problems always have a feasible choice vector
    assert memory_feasible(p, ch) and additive_cost(p, ch) == cost and math.isfinite(cost)
    free = brute_force(p, respect_memory=False)[1]
    assert free <= cost
    if math.prod(p.sizes) <= 600:  # the plain loop is slow
        assert cost == naive_optimum(p) and free == naive_optimum(p, respect_memory=False)
    other = tuple(x % s for x, s in zip(picks, p.sizes, strict=False))
    if memory_feasible(p, other):
        assert cost <= additive_cost(p, other)
    if forbid_prob:  # forbidden strategies are never chosen
        assert all(math.isfinite(c[i]) for c, i in zip(p.node_cost, ch, strict=True))


# ----------------------------------------------------------------------------- speed


@pytest.mark.benchmark
def test_bench_load_800x40(benchmark: Any, tmp_path: Path) -> None:
    f = tmp_path / "big.json"
    save_problem(random_problem(800, 40, seed=0), f)
    p = benchmark(load_problem, f)
    assert p.num_nodes == 800


@pytest.mark.benchmark
def test_bench_random_problem_800x40(benchmark: Any) -> None:
    p = benchmark(random_problem, 800, 40, 0)
    assert p.num_nodes == 800


# ----------------------------------------------------------------------------- large files


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(args=sizes)
def test_the_fast_reader_gives_the_same_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple
) -> None:
    import planner.problems.costtable as ct

    n, k, seed, edge_prob, forbid_prob, memory = args
    p = random_problem(n, k, seed, edge_prob=edge_prob, forbid_prob=forbid_prob, memory=memory)
    f = tmp_path / "r.json"
    save_problem(p, f)
    monkeypatch.setattr(ct, "FAST_LOAD_BYTES", 0)
    monkeypatch.setattr(ct, "_CHUNK", 7)  # many chunks, cut inside numbers
    for compiled in (1 << 62, 0):  # the numpy reference, then the compiled loop
        monkeypatch.setattr(ct, "COMPILED_BYTES", compiled)
        if len(p.edges):
            assert ct._load_fast(f.read_bytes()) is not None
        same_problem(p, load_problem(f))


def test_gzipped_files_are_read_by_their_magic_bytes(tmp_path: Path) -> None:
    import gzip

    import planner.problems.costtable as ct

    p = random_problem(30, 5, seed=3)
    plain = tmp_path / "p.json"
    save_problem(p, plain)
    for name in ("p.json.gz", "p.json"):  # the name does not matter, the content does
        f = tmp_path / "gz" / name
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(gzip.compress(plain.read_bytes()))
        assert ct.is_gzip(f)
        same_problem(p, load_problem(f))
    assert not ct.is_gzip(plain) and not ct.is_gzip(tmp_path / "missing")
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(gzip.compress(plain.read_bytes())[:-20])
    with pytest.raises(ProblemError, match=r"bad\.json\.gz is not a valid gzip file"):
        load_problem(bad)
    with pytest.raises(ProblemError, match=r"is a directory"):
        load_problem(tmp_path)


def test_the_fast_reader_reads_gzipped_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gzip

    import planner.problems.costtable as ct

    p = contest_problem(60, seed=2)
    f = tmp_path / "c.json"
    save_problem(p, f)
    f.write_bytes(gzip.compress(f.read_bytes()))
    monkeypatch.setattr(ct, "FAST_LOAD_BYTES", 0)
    assert ct._load_fast(ct.read_bytes(f)) is not None
    same_problem(p, load_problem(f))


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (b"[[1000000000000000000,0,12],[7]]", ([1e18, 0, 12, 7], [3, 1])),
        (
            b"[[1000000000000000001,1000000000000000000],[1000000000000000000]]",
            ([1e18 + 1, 1e18, 1e18], [2, 1]),
        ),  # fmt: skip
        (b"[[999999999999999999,2000000000000000000]]", ([999999999999999872, 2e18], [2])),
        (b"[ [ 1 , 2 ] ,\n [3]]", ([1, 2, 3], [2, 1])),
        (b"[[1.5,2e3],[3]]", ([1.5, 2000, 3], [2, 1])),
        (b"[[1,,2]]", None),
        (b"[[1 2]]", None),
        (b"[[1],[2]", None),
        (b"[[1][2]]", None),
        (b"[[]]", None),
        (b"[[1,[2]]]", None),
        (b"[[1],2]", None),  # a number outside the rows
        (b"[[1,true]]", None),
        (b"[[12345678901234567890]]", None),  # more than 19 digits: the plain reader
    ],
)
@pytest.mark.parametrize("compiled", [False, True])
def test_numeric_rows(
    text: bytes, parsed: tuple | None, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import planner.problems.costtable as ct

    monkeypatch.setattr(ct, "COMPILED_BYTES", 0 if compiled else 1 << 62)
    got = ct._numeric_rows(text)
    if parsed is None:
        assert got is None
    else:
        assert got is not None
        np.testing.assert_array_equal(got[0], parsed[0])
        np.testing.assert_array_equal(got[1], parsed[1])


def test_a_large_malformed_file_gets_the_plain_readers_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import planner.problems.costtable as ct

    doc = copy.deepcopy(SMALL)
    doc["problem"]["edges"]["costs"][1][2] = "x"
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    monkeypatch.setattr(ct, "FAST_LOAD_BYTES", 0)
    with pytest.raises(ProblemError, match=r"edges.costs\[1\]\[2\] \(edge 1\) is 'x'"):
        load_problem(f)


# ----------------------------------------------------------------------------- contest-like


def test_contest_problem_is_deterministic_tight_and_structured() -> None:
    a, b = contest_problem(300, seed=5), contest_problem(300, seed=5)
    assert problem_to_json(a) == problem_to_json(b)
    assert a.num_nodes == 300 and 1.0 <= len(a.edges) / a.num_nodes <= 2.0
    assert 0.7 <= np.mean([u < v for u, v in a.edges]) <= 0.9  # some edges written reversed
    ops = [k for k in a.sizes if k > 12]
    assert ops and all(20 <= k <= 60 for k in ops)
    assert a.intervals is not None and a.usage is not None and a.usage_limit is not None
    spans = a.intervals[:, 1] - a.intervals[:, 0]
    assert np.median(spans) <= 5 and (a.intervals[:, 1] == 300).sum() >= 20  # parameters
    # the least-usage peak is 90-100% of the limit, and the cheapest choices do not fit
    least = [int(np.argmin(np.where(np.isfinite(c), u[:, 0], np.inf)))
             for c, u in zip(a.node_cost, a.usage, strict=True)]  # fmt: skip
    assert 0.9 * a.usage_limit[0] - 1 <= memory_peak(a, least)[0] <= a.usage_limit[0]
    assert not memory_feasible(a, [int(np.argmin(c)) for c in a.node_cost])
    # some pairs are forbidden, yet a valid answer exists; edge tables repeat rows and columns
    assert any(not np.isfinite(t).all() for t in a.edge_cost)
    big = max(a.edge_cost, key=lambda t: t.size)
    assert len(np.unique(big, axis=0)) < big.shape[0] and len(np.unique(big, axis=1)) < big.shape[1]


def test_contest_problem_has_the_real_instances_structure() -> None:
    from planner.problems.presolve import presolve

    p = contest_problem(400, seed=2)
    assert p.intervals is not None
    # follow edges: many forbidden pairs, allowed ones free
    entries = sum(t.size for t in p.edge_cost)
    forbidden = sum(int(np.isinf(t).sum()) for t in p.edge_cost)
    assert 0.2 < forbidden / entries < 0.8
    follow = [t for t in p.edge_cost if np.isin(t, [0.0, np.inf]).all() and np.isinf(t).any()]
    assert len(follow) > 0.3 * len(p.edges)
    pairs = Counter(tuple(sorted(e)) for e in p.edges)
    assert 1 <= sum(c - 1 for c in pairs.values()) <= 0.05 * len(p.edges)  # parallel edges
    spans = p.intervals[:, 1] - p.intervals[:, 0]
    assert 0.02 < np.mean(spans == 0) < 0.15  # never live
    assert np.mean(spans > 200) > 0.05  # long live ranges (parameters, saved activations)
    r = presolve(p)  # a valid answer exists (the witness), and presolve removes much
    assert sum(r.problem.sizes) < 0.9 * sum(p.sizes)
    # small enough to enumerate: the optimum is valid and the cheapest choices are not
    q = contest_problem(8, seed=1, strategies=(2, 3))
    choices, cost = brute_force(q)
    assert choices is not None and math.isfinite(cost) and memory_feasible(q, choices)
    # with the real structure turned off: the first version's problems
    old = contest_problem(50, seed=1, follow=0, saved=0, parallel=0, reverse=0, never_live=0)
    assert all(u < v for u, v in old.edges)
    with pytest.raises(ProblemError, match="follow"):
        contest_problem(10, seed=0, follow=1.5)


def test_contest_problem_rejects_bad_arguments() -> None:
    with pytest.raises(ProblemError, match="num_nodes >= 2"):
        contest_problem(1, seed=0)
    with pytest.raises(ProblemError, match="tightness"):
        contest_problem(10, seed=0, tightness=(0.5, 1.2))


def test_plan_and_the_api_read_a_gzipped_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    from planner import plan
    from planner.cli import main

    p = random_problem(12, 3, seed=4)
    f = tmp_path / "p.json.gz"
    save_problem(p, tmp_path / "p.json")
    f.write_bytes(gzip.compress((tmp_path / "p.json").read_bytes()))
    argv = ["plan", "--problem", str(f), "--backend", "search", "--gap-tolerance", "0", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["status"] == "OPTIMAL" and summary["gap_tolerance"] == 0
    assert math.isclose(summary["objective"], brute_force(p)[1])
    exact = plan(str(f), backend="search", gap_tolerance=0)
    assert math.isclose(exact.objective, brute_force(p)[1])
