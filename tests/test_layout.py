"""The layering of docs/architecture.md, held by reading every import of the non-test code.

Each package (and each layer of planner) may import only the layers below it; planner
reaches backends only through the registry by name (a string, not an import); runtime never
imports a backend; backends never import torch; and no two modules import each other at run
time, directly or around a cycle (imports under `if TYPE_CHECKING:` are types only: they
count for the layering, not for cycles).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "backends", "runtime", "experiments")
FOUNDATION = {"errors", "files", "deadline", "logs"}  # planner's modules that import no layer
PLANNER_LAYERS = ("graph", "hardware", "costs", "problems", "sim", "pipeline")

# layer -> the layers it may import (itself included)
ALLOWED: dict[str, set[str]] = {
    "planner.foundation": set(),
    "planner.graph": {"planner.foundation"},
    "planner.hardware": {"planner.foundation"},
    "planner.costs": {"planner.foundation", "planner.graph", "planner.hardware"},
    "planner.problems": {
        "planner.foundation",
        "planner.graph",
        "planner.hardware",
        "planner.costs",
    },
    "planner.sim": {
        "planner.foundation",
        "planner.graph",
        "planner.hardware",
        "planner.costs",
        "planner.problems",
    },
    "planner.pipeline": {
        "planner.foundation",
        "planner.graph",
        "planner.hardware",
        "planner.costs",
        "planner.problems",
        "planner.sim",
    },
}
PLANNER = {*ALLOWED, "planner"}
ALLOWED["planner"] = PLANNER
ALLOWED["backends"] = PLANNER
ALLOWED["runtime"] = PLANNER
ALLOWED["experiments"] = PLANNER | {"backends", "runtime"}
FORBIDDEN_THIRD_PARTY = {"backends": {"torch"}}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # a module of ours, or a third-party top-level package
    line: int
    typing_only: bool


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {
        module_name(p): p
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "planner":
        return parts[0]
    if len(parts) > 1 and parts[1] in PLANNER_LAYERS:
        return f"planner.{parts[1]}"
    if len(parts) > 1 and parts[1] in FOUNDATION:
        return "planner.foundation"
    return "planner"  # the top: api, cli, sources, export, result, registry, recommend


def _typing_blocks(tree: ast.AST) -> set[int]:
    """Line numbers inside `if TYPE_CHECKING:` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every import in the module (module level and inside functions), resolved to one of our
    modules (the longest known prefix) or to a third-party top-level package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing = _typing_blocks(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            parts = name.split(".")
            target = next(
                (
                    ".".join(parts[:k])
                    for k in range(len(parts), 0, -1)
                    if ".".join(parts[:k]) in known
                ),
                None,
            )
            if target is None and parts[0] not in PACKAGES:
                target = parts[0]  # third party (or the standard library)
            if target is not None and target != module:
                out.append(Import(module, target, node.lineno, node.lineno in typing))
    return list(dict.fromkeys(out))  # `from a.b import c` names a.b twice


@pytest.fixture(scope="module")
def all_imports() -> list[Import]:
    known = our_modules()
    return [imp for m, p in known.items() for imp in imports_of(m, p, known)]


def test_the_reader_sees_the_imports_it_must_judge(all_imports: list[Import]) -> None:
    """The checks below are only as good as the reader: it finds imports in functions, under
    TYPE_CHECKING and relative ones."""
    found = {(i.source, i.target) for i in all_imports}
    assert ("planner.api", "planner.registry") in found  # inside plan()
    assert ("backends.mathprog.cpsat", "ortools") in found
    assert any(i.typing_only for i in all_imports)
    assert len(our_modules()) > 100


def test_every_import_goes_down_the_layers(all_imports: list[Import]) -> None:
    known = our_modules()
    upward = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in all_imports
        if i.target in known and layer(i.target) not in ALLOWED[layer(i.source)] | {layer(i.source)}
    ]
    assert upward == []


def test_backends_never_import_torch_and_runtime_never_imports_a_backend(
    all_imports: list[Import],
) -> None:
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in all_imports
        if i.target in FORBIDDEN_THIRD_PARTY.get(layer(i.source), set())
        or (layer(i.source) == "runtime" and layer(i.target) == "backends")
    ]
    assert bad == []


def test_planner_reaches_backends_only_through_the_registry_by_name() -> None:
    from planner.registry import REGISTRY

    for entry in REGISTRY.values():
        module, _, cls = entry.partition(":")
        assert layer(module) == "backends" and cls, entry
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").exists(), entry


def test_no_import_cycles_at_run_time(all_imports: list[Import]) -> None:
    known = our_modules()
    graph = nx.DiGraph()
    graph.add_edges_from(
        (i.source, i.target) for i in all_imports if i.target in known and not i.typing_only
    )
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == []


def test_the_layering_test_catches_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks can fail: a planner module importing a backend, and two modules importing
    each other, are both reported."""
    known = {"planner.problems.x": tmp_path / "x.py", "backends.y": tmp_path / "y.py"}
    known["planner.problems.x"].write_text("def f():\n    from backends.y import g\n")
    known["backends.y"].write_text("from planner.problems.x import f\n")
    found = [i for m, p in known.items() for i in imports_of(m, p, known)]
    up = [i for i in found if layer(i.target) not in ALLOWED[layer(i.source)] | {layer(i.source)}]
    assert [(i.source, i.target) for i in up] == [("planner.problems.x", "backends.y")]
    graph = nx.DiGraph((i.source, i.target) for i in found)
    assert any(len(c) == 2 for c in nx.strongly_connected_components(graph))


def test_public_names_resolve_lazily() -> None:
    import planner

    for name in planner.__all__:
        assert getattr(planner, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = planner.nonsense  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["capture", "coarsen"])
def test_importing_a_module_never_shadows_a_public_function(name: str) -> None:
    """`planner.coarsen` is the function, also after its module was imported."""
    code = (
        f"import importlib, inspect, planner; importlib.import_module('planner.graph.{name}'); "
        f"print(inspect.isfunction(planner.{name}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_importing_planner_does_not_import_torch() -> None:
    code = "import sys, planner, planner.problems.problem; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_one_backend_imports_only_its_own_solver() -> None:
    code = (
        "import sys; from backends.mathprog.cpsat import CpsatBackend; "
        "print('pulp' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
