"""The commands that README.md and docs/*.md show in their code blocks, read as a reader
would type them, and run the same way (tests/test_docs_commands.py says which and checks
what the docs claim they print)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
SHELL_LANGUAGES = ("sh", "bash", "console")

# A block's line that starts a command: the programs the docs tell readers to run, with a
# console block's `$ ` prompt. `layerwise` is `python -m planner` once installed.
COMMAND = re.compile(r"^(?:\$ )?(?:python -m (?:planner|runtime|experiments)\b|layerwise )")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
COMMENT = re.compile(r"\s+#(?:\s.*)?$")
OPTIONAL = re.compile(r"\s*\[[^\]]*\]")  # `[--json]`: an optional argument, left out


@dataclass(frozen=True)
class Command:
    """One documented command: `doc` (README.md or docs/x.md), the `line` it starts on, its
    `text` (continuation lines joined, the `$ ` prompt and the trailing comment removed),
    the block's `language` and the `comment`."""

    doc: str
    line: int
    text: str
    language: str
    comment: str

    @property
    def argv(self) -> list[str]:
        """The command as run: optional `[...]` arguments left out, `layerwise` as `python -m
        planner`, `python` as this interpreter."""
        argv = shlex.split(OPTIONAL.sub("", self.text))
        if argv[0] == "layerwise":
            argv = ["python", "-m", "planner", *argv[1:]]
        return [sys.executable, *argv[1:]]


def doc_text(doc: str) -> str:
    return (ROOT / doc).read_text()


def blocks(doc: str) -> list[tuple[str, int, str]]:
    """The fenced blocks of a doc: (language, line of the first content line, content)."""
    text = doc_text(doc)
    return [(m[1], text.count("\n", 0, m.start(2)) + 1, m[2]) for m in FENCE.finditer(text)]


def commands(docs: tuple[str, ...] = DOCS) -> list[Command]:
    """Every command in the docs' code blocks, in the order they appear."""
    found = []
    for doc in docs:
        for language, first, content in blocks(doc):
            lines = content.splitlines()
            i = 0
            while i < len(lines):
                start = i
                if not COMMAND.match(lines[i]):
                    i += 1
                    continue
                parts = [lines[i]]
                while parts[-1].endswith("\\") and i + 1 < len(lines):
                    parts[-1] = parts[-1][:-1]
                    i += 1
                    parts.append(lines[i])
                i += 1
                whole = " ".join(p.strip() for p in parts).removeprefix("$ ")
                match = COMMENT.search(whole)
                comment = match[0].strip().removeprefix("#").strip() if match else ""
                text = " ".join(whole[: match.start()].split() if match else whole.split())
                found.append(Command(doc, first + start, text, language, comment))
    return found


def normalized(text: str) -> str:
    """Whitespace collapsed: the docs wrap lines that a program prints as one."""
    return " ".join(text.split())


def run(command: Command, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a command in `cwd` as a reader would, with the repository importable."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(cwd), str(ROOT)]),
        "MPLBACKEND": "Agg",
    }
    return subprocess.run(
        command.argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
