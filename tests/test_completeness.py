"""Nothing registered goes untested or undocumented.

- every registered backend (`planner.registry.REGISTRY`) has a conformance subclass in tests
  (a class deriving from `backends.testing.BackendConformance` whose `backend_name` is it),
  and every registered pipeline search (`PIPELINE_REGISTRY`) one of
  `backends.pipeline.testing.PipelineConformance` (its `search_name`);
- every package under planner/, backends/, runtime/ and experiments/, and every module at the
  top of planner/ and backends/, is named in docs/extending.md's layout block, and the block
  names nothing that is not there;
- docs/architecture.md's backend table lists every registered backend, and nothing else.

Read from the source (no test module is imported), so the checks cost milliseconds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from planner.registry import PIPELINE_REGISTRY, REGISTRY

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "backends", "runtime", "experiments")
LOOSE_MODULES_OF = ("planner", "backends")  # whose top-level modules the layout block names
BACKEND_SUITE = (ROOT / "backends" / "testing.py", "BackendConformance")
PIPELINE_SUITE = (ROOT / "backends" / "pipeline" / "testing.py", "PipelineConformance")


# --- conformance subclasses --------------------------------------------------------------


def _base_names(node: ast.ClassDef) -> list[str]:
    """The names of a class's bases, by their last part (`testing.X` is `X`)."""
    out = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            out.append(base.id)
        elif isinstance(base, ast.Attribute):
            out.append(base.attr)
    return out


def _own_name(node: ast.ClassDef, attr: str) -> str | None:
    """The string a class body assigns to `attr`, if it assigns one."""
    for stmt in node.body:
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign):
            targets = [stmt.target]
        else:
            continue
        named = any(isinstance(t, ast.Name) and t.id == attr for t in targets)
        if named and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            return stmt.value.value
    return None


def classes_in(paths: list[Path]) -> dict[str, list[ast.ClassDef]]:
    """Every class the files define, by name (two files may reuse a name)."""
    classes: dict[str, list[ast.ClassDef]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    return classes


def classes_in_tests(tests: Path = ROOT / "tests") -> dict[str, list[ast.ClassDef]]:
    """Every class defined in a test file, by name."""
    return classes_in(sorted(tests.glob("*.py")))


def subclasses_of(suite: str, classes: dict[str, list[ast.ClassDef]]) -> list[ast.ClassDef]:
    """The test classes that derive from `suite`, directly or through other test classes."""
    memo: dict[str, bool] = {}

    def derives(name: str, seen: frozenset[str]) -> bool:
        if name == suite:
            return True
        if name in seen or name not in classes:
            return False
        if name not in memo:
            memo[name] = any(
                derives(b, seen | {name}) for c in classes[name] for b in _base_names(c)
            )
        return memo[name]

    return [
        c
        for name, nodes in classes.items()
        for c in nodes
        if name != suite and any(derives(b, frozenset({name})) for b in _base_names(c))
    ]


def names_tested(
    suite: ast.ClassDef, attr: str, classes: dict[str, list[ast.ClassDef]]
) -> dict[str, list[str]]:
    """name -> the subclasses of `suite` in `classes` that run it: the string each assigns
    to `attr`, or inherits from a test class, or from the suite's own default."""

    def name_of(node: ast.ClassDef, seen: frozenset[str]) -> str | None:
        own = _own_name(node, attr)
        if own is not None:
            return own
        for base in _base_names(node):
            for parent in classes.get(base, []):
                if parent.name not in seen:
                    found = name_of(parent, seen | {parent.name})
                    if found is not None:
                        return found
        return None

    tested: dict[str, list[str]] = {}
    for node in subclasses_of(suite.name, classes):
        name = name_of(node, frozenset({node.name})) or _own_name(suite, attr)
        if name is not None:
            tested.setdefault(name, []).append(node.name)
    return tested


def suite(path: Path, name: str) -> ast.ClassDef:
    """The conformance suite `name` defined in `path`."""
    found = classes_in([path]).get(name)
    assert found, f"no class {name} in {path.relative_to(ROOT)}"
    return found[0]


def backends_tested(tests: Path = ROOT / "tests") -> dict[str, list[str]]:
    return names_tested(suite(*BACKEND_SUITE), "backend_name", classes_in_tests(tests))


def pipeline_searches_tested(tests: Path = ROOT / "tests") -> dict[str, list[str]]:
    return names_tested(suite(*PIPELINE_SUITE), "search_name", classes_in_tests(tests))


def test_every_registered_backend_has_a_conformance_subclass() -> None:
    tested = backends_tested()
    assert [name for name in REGISTRY if name not in tested] == []


def test_every_conformance_subclass_runs_a_registered_backend() -> None:
    tested = backends_tested()
    assert {n: c for n, c in tested.items() if n not in REGISTRY} == {}


def test_every_registered_pipeline_search_has_a_conformance_subclass() -> None:
    tested = pipeline_searches_tested()
    assert [name for name in PIPELINE_REGISTRY if name not in tested] == []
    assert {n: c for n, c in tested.items() if n not in PIPELINE_REGISTRY} == {}


def test_the_checks_see_a_missing_subclass(tmp_path: Path) -> None:
    """The checks above fail when a suite has no subclass (they can fail)."""
    (tmp_path / "test_a.py").write_text(
        "class TestA(BackendConformance):\n    backend_name = 'a'\n"
        "class TestB(TestA):\n    pass\n"
        "class TestC(testing.BackendConformance):\n    backend_name: str = 'c'\n"
        "class TestP(PipelineConformance):\n    pass\n"
        "class Helper:\n    backend_name = 'h'\n"
    )
    assert backends_tested(tmp_path) == {"a": ["TestA", "TestB"], "c": ["TestC"]}
    assert pipeline_searches_tested(tmp_path) == {"pipeline": ["TestP"]}  # the default
    (tmp_path / "test_a.py").write_text("class TestP:\n    search_name = 'pipeline'\n")
    assert backends_tested(tmp_path) == pipeline_searches_tested(tmp_path) == {}


# --- docs/extending.md's layout block ------------------------------------------------------


def layout_block(text: str) -> list[str]:
    """The lines of the first code block after the heading "## The layout"."""
    after = text.split("\n## The layout", 1)[1]
    block = after.split("```", 2)[1]
    return block.splitlines()[1:]  # after the fence's language tag (none)


def layout_names(lines: list[str]) -> tuple[set[str], set[str]]:
    """(the packages the block names, as dotted paths; the modules it names at a package's
    top, as dotted paths). A line that starts (after its indent) with `name/` opens a
    package inside the nearest less-indented open package; `name.py` tokens anywhere on a
    line name modules of the package the line sits in (on a package's own line: that package's)."""
    packages: set[str] = set()
    modules: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, dotted package)
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        first = line.split()[0]
        if re.fullmatch(r"[A-Za-z_]\w*/", first):
            dotted = f"{parent}.{first[:-1]}" if parent else first[:-1]
            packages.add(dotted)
            stack.append((indent, dotted))
            parent = dotted  # `export/  dtensor.py zero.py`: the package's own modules
        for token in re.findall(r"(?<![\w/.])([A-Za-z_]\w*)\.py\b", line):
            if parent:
                modules.add(f"{parent}.{token}")
    return packages, modules


def packages_on_disk() -> set[str]:
    """Every package (a folder with an __init__.py) under our four top-level packages."""
    return {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in PACKAGES
        for p in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def loose_modules_on_disk() -> set[str]:
    """The modules at the top of planner/ and backends/ (not __init__)."""
    return {
        f"{top}.{p.stem}"
        for top in LOOSE_MODULES_OF
        for p in (ROOT / top).glob("*.py")
        if p.name != "__init__.py"
    }


def extending_layout() -> tuple[set[str], set[str]]:
    return layout_names(layout_block((ROOT / "docs" / "extending.md").read_text("utf-8")))


def test_extending_names_every_package() -> None:
    packages, _ = extending_layout()
    assert sorted(packages_on_disk() - packages) == []


def test_extending_names_every_top_level_module_of_planner_and_backends() -> None:
    _, modules = extending_layout()
    assert sorted(loose_modules_on_disk() - modules) == []


def test_extending_names_nothing_that_is_not_there() -> None:
    packages, modules = extending_layout()
    assert sorted(packages - packages_on_disk()) == []
    missing = [m for m in modules if not (ROOT / (m.replace(".", "/") + ".py")).exists()]
    assert sorted(missing) == []


def test_the_layout_reader_sees_what_is_missing() -> None:
    lines = [
        "planner/            the core",
        "  errors.py files.py     the foundation",
        "  graph/      OpGraph, opkinds.py",
        "  export/     DTensor",
        "    dtensor.py zero.py      (see planner/api.py: a path, not a module here)",
        "backends/",
        "  base.py     the base",
        "  exact/      elimination",
        "runtime/",
    ]
    packages, modules = layout_names(lines)
    assert packages == {"planner", "planner.graph", "planner.export", "backends",
                        "backends.exact", "runtime"}  # fmt: skip
    assert modules == {"planner.errors", "planner.files", "planner.graph.opkinds",
                       "planner.export.dtensor", "planner.export.zero",
                       "backends.base"}  # fmt: skip


# --- docs/architecture.md's backend table --------------------------------------------------


def backend_tables(text: str) -> list[list[str]]:
    """The first column of every markdown table whose header is `| backend | method | ...`,
    each name without its backticks."""
    tables: list[list[str]] = []
    rows: list[str] | None = None
    for line in text.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        if cells[:2] == ["backend", "method"]:
            rows = []
            tables.append(rows)
        elif rows is not None and cells and not set(cells[0]) <= set("-: "):
            rows.append(cells[0].strip("`"))
        elif not cells:
            rows = None
    return tables


def test_architecture_backend_tables_list_every_registered_backend() -> None:
    tables = backend_tables((ROOT / "docs" / "architecture.md").read_text("utf-8"))
    assert tables, "no `| backend | method |` table in docs/architecture.md"
    for names in tables:
        assert [n for n in REGISTRY if n not in names] == []
        assert [n for n in names if n not in REGISTRY] == []


def test_the_table_reader_sees_a_missing_backend() -> None:
    text = (
        "| backend | method | exact |\n| --- | --- | --- |\n| `a` | x | yes |\n\n"
        "| backend | objective |\n| --- | --- |\n| b | c |\n"
    )
    assert backend_tables(text) == [["a"]]
