"""The layering of docs/architecture.md, held by reading every import of the non-test code.

Each package and each layer may import only the layers below it: planner's by role
(foundation, graph and hardware, costs, problems, sim, pipeline, the contract that backends
see, the policy that runs backends, the entry points, the CLI; the export family below the
contract) and backends' (base, the shared model, the families each on its own, the families
built on others, the tools over all). Planner reaches backends only through the registry by
name (a string, not an import); runtime never imports a backend; backends never import torch
and see planner up to the contract only; no private name is imported across modules; and no
two modules import each other, directly or around a cycle, not even under `if
TYPE_CHECKING:`.
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

# planner's layers, low to high: each may import itself and the layers before it in its row
# of ALLOWED. Top-level modules are placed by name; subpackages by their first name.
PLANNER_MODULES = {
    "errors": "foundation",  # modules that import no layer
    "files": "foundation",
    "deadline": "foundation",
    "logs": "foundation",
    "startup": "foundation",
    "result": "contract",  # what backends see: the result contract and the registry by name
    "registry": "contract",
    "auto": "policy",  # choosing a backend, re-ranking an answer: they run backends
    "recommend": "policy",
    "request": "entry",  # a call's request, its plan types, sources, the two searches' entry
    "plans": "entry",
    "sources": "entry",
    "pipelined": "entry",
    "api": "entry",
    "__main__": "cli",
}
PLANNER_LAYERS = ("graph", "hardware", "costs", "problems", "sim", "pipeline", "export", "cli")
LOWER = ["planner.foundation"]
ALLOWED: dict[str, set[str]] = {"planner.foundation": set()}
for _name, _below in (
    ("graph", ()),
    ("hardware", ()),
    ("costs", ("graph", "hardware")),
    ("problems", ("graph", "hardware", "costs")),
    ("sim", ("graph", "hardware", "costs", "problems")),
    ("pipeline", ("graph", "hardware", "costs", "problems", "sim")),
    ("contract", ("graph", "hardware", "costs", "problems", "sim", "pipeline")),
    ("policy", ("graph", "hardware", "costs", "problems", "sim", "pipeline", "contract")),
    ("export", ("graph", "hardware", "costs", "problems", "sim", "pipeline")),
    ("entry", ("graph", "hardware", "costs", "problems", "sim", "pipeline", "contract", "policy")),
    ("cli", ("graph", "hardware", "costs", "problems", "sim", "pipeline", "contract", "policy",
             "entry", "export")),
):  # fmt: skip
    ALLOWED[f"planner.{_name}"] = {"planner.foundation", *(f"planner.{b}" for b in _below)}
PLANNER = {*ALLOWED, "planner"}
ALLOWED["planner"] = PLANNER  # the package: its public names, imported lazily by name

# backends' layers: the base (the Backend class, settings, the conformance suite), the model
# the families share, the families (each on its own: no family imports another of its row),
# then the families built on others, then the tools over all of them
BACKEND_ROWS: tuple[dict[str, tuple[str, ...]], ...] = (
    {"base": ()},
    {"model": ("base",)},
    {f: ("base", "model") for f in ("exact", "heuristics", "placement", "local", "wcsp", "pipeline")},
    {"mathprog": ("base", "model", "heuristics", "placement"), "mcmc": ("base", "model", "heuristics")},
    {t: ("base", "model", "exact", "heuristics", "placement", "local", "wcsp", "pipeline",
         "mathprog", "mcmc") for t in ("portfolio", "warm")},
)  # fmt: skip
BACKEND_BASE = {"base", "settings", "lazy", "testing", "trace"}  # backends' own top-level modules
# what backends may see of planner: up to the contract, never the policy, entry, cli, export
BACKENDS_SEE = {f"planner.{n}" for n in ("foundation", "graph", "hardware", "costs", "problems",
                                          "sim", "pipeline", "contract")}  # fmt: skip
for _row in BACKEND_ROWS:
    for _family, _below in _row.items():
        ALLOWED[f"backends.{_family}"] = BACKENDS_SEE | {f"backends.{b}" for b in _below}
ALLOWED["runtime"] = PLANNER
ALLOWED["experiments"] = (
    PLANNER | {"backends", "runtime"} | {f"backends.{f}" for row in BACKEND_ROWS for f in row}
)
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
    if parts[0] == "backends":
        if len(parts) == 1 or parts[1] in BACKEND_BASE:
            return "backends.base"
        return f"backends.{parts[1]}"
    if parts[0] != "planner":
        return parts[0]
    if len(parts) == 1:
        return "planner"
    if parts[1] in PLANNER_LAYERS:
        return f"planner.{parts[1]}"
    if parts[1] in PLANNER_MODULES:
        return f"planner.{PLANNER_MODULES[parts[1]]}"
    raise AssertionError(f"{module} is in no layer: give it one in tests/test_layout.py")


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
        if i.target in known and not allowed(i.source, i.target)
    ]
    assert upward == []


def allowed(source: str, target: str) -> bool:
    """Whether `source` may import `target` (its own layer or one ALLOWED below it)."""
    return layer(target) in ALLOWED[layer(source)] | {layer(source)}


def test_every_module_has_a_layer() -> None:
    """A new top-level module of planner must be placed (layer() raises otherwise)."""
    for module in our_modules():
        assert layer(module) in ALLOWED or layer(module) in PACKAGES, module


def test_backends_see_planner_up_to_the_contract_only(all_imports: list[Import]) -> None:
    bad = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in all_imports
        if layer(i.source).startswith("backends")
        and layer(i.target).startswith("planner")
        and layer(i.target) not in BACKENDS_SEE
    ]
    assert bad == []


def test_no_private_name_is_imported_across_modules() -> None:
    """`from a.b import _c` outside a.b reaches into another module's insides."""
    bad = []
    for module, path in our_modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.split(".")[0] not in PACKAGES or node.module == module:
                continue
            bad += [f"{module}:{node.lineno} {node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    assert bad == []


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
    from planner.registry import PIPELINE_REGISTRY, REGISTRY

    for entry in (*REGISTRY.values(), *PIPELINE_REGISTRY.values()):
        module, _, cls = entry.partition(":")
        assert layer(module).startswith("backends.") and cls, entry
        assert (ROOT / Path(*module.split("."))).with_suffix(".py").exists(), entry


def test_no_import_cycles_not_even_for_types(all_imports: list[Import]) -> None:
    """No two modules import each other, directly or around a cycle: at run time, and not
    under `if TYPE_CHECKING:` either (a type one module needs of another is a protocol or
    lives below both)."""
    known = our_modules()
    graph = nx.DiGraph()
    graph.add_edges_from((i.source, i.target) for i in all_imports if i.target in known)
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert cycles == []


def test_the_layering_test_catches_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks can fail: a planner module importing a backend, and two modules importing
    each other, are both reported."""
    known = {"planner.problems.x": tmp_path / "x.py", "backends.exact.y": tmp_path / "y.py"}
    known["planner.problems.x"].write_text("def f():\n    from backends.exact.y import g\n")
    known["backends.exact.y"].write_text("from planner.problems.x import f\n")
    found = [i for m, p in known.items() for i in imports_of(m, p, known)]
    up = [i for i in found if not allowed(i.source, i.target)]
    assert [(i.source, i.target) for i in up] == [("planner.problems.x", "backends.exact.y")]
    graph = nx.DiGraph((i.source, i.target) for i in found)
    assert any(len(c) == 2 for c in nx.strongly_connected_components(graph))


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("backends.heuristics.feasible", "backends.mathprog.selection"),  # a family up its row
        ("backends.exact.search", "backends.local.anneal"),  # a family beside it
        ("backends.model.selection", "backends.placement.problem"),  # the model up
        ("backends.base", "backends.exact.search"),
        ("backends.mcmc.chain", "planner.api"),  # a backend above the contract
        ("backends.mcmc.chain", "planner.auto"),
        ("planner.result", "planner.auto"),  # the contract above itself
        ("planner.api", "planner.cli.args"),
        ("planner.export.dtensor", "planner.api"),
        ("planner.sim.simulator", "planner.pipeline.spec"),
        ("runtime.run", "backends.base"),
    ],
)
def test_the_layers_refuse_what_runs_up_or_across(source: str, target: str) -> None:
    assert not allowed(source, target)
    assert allowed(target, "planner.errors") and allowed(source, "planner.errors")


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
