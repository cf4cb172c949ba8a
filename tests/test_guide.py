"""docs/guide.md runs: its Python blocks are one script (plan, evaluate, run), and its shell
block plans a factory model and runs the plan file with --check."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "guide.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", GUIDE, flags=re.S)


def test_the_guide_plans_and_evaluates_in_process() -> None:
    """Sections 1-3 (section 4 starts workers, which import the script: see the slow test)."""
    script = [b for b in blocks("python") if "run_strategy" not in b]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile("\n".join(script), "docs/guide.md", "exec"), namespace)
    result, scores = namespace["result"], namespace["scores"]
    assert result.status.value == "OPTIMAL"
    assert scores.additive == pytest.approx(result.objective)


def test_the_guide_script_plans_only_under_the_main_guard() -> None:
    """Worker processes import the script: outside the guard it may only define things and
    build the module and its batch, or every worker would plan and print again."""
    tree = ast.parse("\n".join(blocks("python")))
    guards = [s for s in tree.body if isinstance(s, ast.If) and "__main__" in ast.unparse(s.test)]
    assert len(guards) == 1
    definitions = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef)
    run_on_import = [s for s in tree.body if s not in guards and not isinstance(s, definitions)]
    calls = {
        ast.unparse(n.func) for s in run_on_import for n in ast.walk(s) if isinstance(n, ast.Call)
    }
    assert calls <= {"Net", "torch.randn"}, calls


@pytest.mark.slow
def test_the_guide_runs_as_a_script_and_its_shell_commands_work(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    script = tmp_path / "guide.py"
    script.write_text("\n".join(blocks("python")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Status.OPTIMAL") == 1, proc.stdout  # planned once, not per worker
    deviation = float(re.search(r"single-process training: (\S+)", proc.stdout)[1])  # type: ignore[index]
    assert deviation < 1e-9, proc.stdout
    # Section 5: Net in mymodels.py, then the shell block (with `python -m planner` for the
    # console script, which needs an install)
    model = blocks("python")[0]
    (tmp_path / "mymodels.py").write_text(model.split("net = Net()")[0])
    for deviation in run_shell(blocks("sh")[0], tmp_path, env):
        assert deviation < 1e-5  # float32


def run_shell(block: str, cwd: Path, env: dict[str, str]) -> list[float]:
    """Run a shell block's commands (`layerwise` as `python -m planner`, which needs no
    install); each must exit 0. The deviations `runtime.run --check` reports (asked for
    as --json)."""
    deviations = []
    for line in block.replace("\\\n", " ").splitlines():
        command = shlex.split(line.split("#")[0])
        if not command:
            continue
        if command[0] == "layerwise":
            command = ["python", "-m", "planner", *command[1:]]
        if "runtime.run" in command:
            command.append("--json")
        proc = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True,
                              cwd=cwd, env=env, timeout=600)  # fmt: skip
        assert proc.returncode == 0, (line, proc.stderr)
        if "runtime.run" in command:
            deviations.append(json.loads(proc.stdout)["max_deviation"])
    return deviations


@pytest.mark.slow
def test_the_guides_transformer_plans_and_trains_like_single_process(tmp_path: Path) -> None:
    """Section 7: mygpt.py as the guide writes it, planned and run from the shell in float64."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    (tmp_path / "mygpt.py").write_text(blocks("py")[0])
    deviations = run_shell(blocks("sh")[1], tmp_path, env)
    assert len(deviations) == 1 and deviations[0] < 1e-9
    plan = json.loads((tmp_path / "gpt.json").read_text())
    kinds = [op["kind"] for op in plan["graph"]["json"]["ops"]]
    assert kinds.count("attention") == 2 and kinds.count("slice") == 6
