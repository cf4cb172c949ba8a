"""The clock is finished (issue 37): after the entry points only a `Deadline` travels, and no
module below them computes a deadline from a number of seconds.

The entry points (`planner.plan` in planner/api.py, planner/request.py, the CLI, the
experiments, runtime) turn the user's time limit into one `Deadline`; `Backend.solve`
(backends/base.py) makes a solve's one deadline from `SolveOptions` (`SolveOptions.clock`).
Below them a phase takes a share of the deadline it was given (`part`, `share`, `reserve`,
`within`), so these read the source of backends/ and planner/ and fail on:

- an addition or subtraction with `time_limit` in it (`t0 + SHARE * options.time_limit`: a
  point in time made from the limit);
- a deadline made from `time_limit` (`Deadline.after(options.time_limit)`,
  `clock.within(time_limit)`);
- in backends/, any read of `<options>.time_limit`, or a `time_limit=` handed to a call (a
  backend sees its deadline only, and hands a sub-search a deadline).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENTRY = ("planner/api.py", "planner/request.py", "planner/cli/", "planner/__main__.py")
# where the one deadline of a solve is made from a time limit: (file, function)
MAKERS = {("backends/base.py", "solve"), ("planner/result.py", "clock")}
DEADLINE_CALLS = {"after", "within", "at_least", "reserve", "part", "share"}


def _mentions_limit(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id == "time_limit")
        or (isinstance(n, ast.Attribute) and n.attr == "time_limit")
        for n in ast.walk(node)
    )


def _functions(tree: ast.AST) -> dict[ast.AST, str]:
    """Each node's enclosing function name ("" at module level)."""
    owner: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else name
            )
            owner[child] = inner
            visit(child, inner)

    visit(tree, "")
    return owner


def clock_arithmetic(source: str, path: str) -> list[str]:
    """Where `source` (the file at `path`, relative to the repository) makes a deadline from
    a time limit, one line each ("path:line: what")."""
    tree = ast.parse(source)
    owner = _functions(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if (path, owner.get(node, "")) in MAKERS:
            continue
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Add | ast.Sub)
            and _mentions_limit(node)
        ):
            found.append(f"{where}: a point in time from time_limit: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in DEADLINE_CALLS
            and any(_mentions_limit(a) for a in [*node.args, *(k.value for k in node.keywords)])
        ):
            found.append(f"{where}: a deadline from time_limit: {ast.unparse(node)}")
        elif (
            path.startswith("backends/")
            and not path.endswith("/testing.py")  # a conformance suite: a caller of solve
            and isinstance(node, ast.Call)
            and any(k.arg == "time_limit" for k in node.keywords)
        ):
            found.append(f"{where}: a backend hands on a number of seconds: {ast.unparse(node)}")
        elif (
            path.startswith("backends/")
            and isinstance(node, ast.Attribute)
            and node.attr == "time_limit"
            and isinstance(node.ctx, ast.Load)
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{where}: a backend reads the time limit: {ast.unparse(node)}")
    return found


def _sources() -> list[str]:
    files = sorted((ROOT / "backends").rglob("*.py")) + sorted((ROOT / "planner").rglob("*.py"))
    names = [f.relative_to(ROOT).as_posix() for f in files]
    return [n for n in names if not n.startswith(ENTRY)]


def test_no_module_below_the_entry_points_computes_a_deadline_from_a_time_limit() -> None:
    found = [
        hit for path in _sources() for hit in clock_arithmetic((ROOT / path).read_text(), path)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "until = t0 + LNS_WHOLE_SHARE * options.time_limit",
        "cap = time.perf_counter() + FEASIBLE_SHARE * options.time_limit",
        "deadline = min(options.clock().at, now + time_limit)",
        "budget = self.t0 + START_SHARE * self.opts.time_limit",
        "clock = Deadline.after(options.time_limit)",
        "clock = options.clock().within(options.time_limit)",
        "wind_down = min(WIND_DOWN_SECONDS, WIND_DOWN_SHARE * options.time_limit)",
        "opts = replace(options, time_limit=max(0.05, until - time.perf_counter()))",
        "elim.solve(p, SolveOptions(time_limit=max(deadline.left(), 1e-3), deadline=deadline))",
    ],
)
def test_the_check_finds_what_the_clock_was(line: str) -> None:
    """The code the check replaced (backends before issue 37) fails it."""
    assert clock_arithmetic(f"def f():\n    {line}\n", "backends/x.py")


@pytest.mark.parametrize(
    "line",
    [
        "until = clock.part(LNS_WHOLE_SHARE).at",
        "cap = options.clock().share(0.1)",
        "frac = (time.perf_counter() - t0) / clock.limit",
        "opts = options.with_deadline(clock.within(max(0.05, min(left, SEGMENT_SECONDS))))",
        "time_limit = self.time_limit",
    ],
)
def test_the_check_passes_shares_of_a_deadline(line: str) -> None:
    assert not clock_arithmetic(f"def f():\n    {line}\n", "backends/x.py")


def test_the_check_allows_the_one_clock_of_a_solve() -> None:
    source = "class B:\n    def solve(self, options):\n        return Deadline.after(options.time_limit)\n"
    assert clock_arithmetic(source, "backends/x.py")
    assert not clock_arithmetic(source, "backends/base.py")


# -- the one clock of a solve ----------------------------------------------------------------


def test_solve_options_take_a_time_limit_or_a_deadline_not_both() -> None:
    from planner.deadline import Deadline
    from planner.errors import BackendError
    from planner.result import DEFAULT_SOLVE_SECONDS, SolveOptions

    with pytest.raises(BackendError, match="not both"):
        SolveOptions(time_limit=5.0, deadline=Deadline.after(5.0))
    assert SolveOptions().clock().limit == DEFAULT_SOLVE_SECONDS
    assert SolveOptions(time_limit=3.0).clock().limit == 3.0
    given = Deadline.after(7.0)
    narrowed = SolveOptions(time_limit=3.0, seed=4).with_deadline(given)
    assert narrowed.time_limit is None and narrowed.clock() is given and narrowed.seed == 4


def test_a_backend_gets_a_deadline_only_its_span_counted_from_the_solve() -> None:
    from backends.base import Backend, BackendSettings
    from planner.problems.costtable import random_problem
    from planner.problems.problem import Problem
    from planner.result import SolveOptions, SolveResult, Status

    seen: list[SolveOptions] = []

    class Spy(Backend[BackendSettings]):
        name = "spy"
        settings_type = BackendSettings

        def _solve(
            self, problem: Problem, options: SolveOptions, settings: BackendSettings
        ) -> SolveResult:
            seen.append(options)
            return SolveResult(self.name, Status.NO_SOLUTION)

    Spy().solve(random_problem(4, 2, seed=0), SolveOptions(time_limit=30.0))
    (inner,) = seen
    assert inner.time_limit is None and inner.deadline is not None
    assert 29.0 < inner.deadline.limit <= 30.0  # its span, for the phases' parts
    part = inner.deadline.part(0.5)
    assert part.at <= inner.deadline.at and 14.0 < part.left() <= 15.0
