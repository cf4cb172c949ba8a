"""`python -m experiments.many_strategies SOURCE OUT`: a many-strategy problem on a source
problem's graph, written as a contest-format file for `experiments.iopddl`.

    python -m experiments.many_strategies asplos-2025-iopddl-G.json.gz G-many-seed0.json.gz
    python -m experiments.many_strategies G.json.gz OUT.json --seed 1 --mean 29 --most 178

(`planner.problems.many_strategies.many_strategies`: the source's nodes, edges, intervals
and memory limit, about MEAN strategies per node, MOST at most, FORBIDDEN of them forbidden;
the held-out IOPDDL instance with G's graph has 29, 178 and 10%.) OUT ending in .gz is
gzipped. The table entries, strategies per node and forbidden share are printed. Bad
arguments end in one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from planner.cli.args import OneLineArgumentParser, nonnegative_int, positive_int, report_errors
from planner.problems.costtable import load_problem, save_problem
from planner.problems.many_strategies import many_strategies
from planner.problems.problem import Problem


def main(argv: Sequence[str] | None = None) -> int:
    return report_errors(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    p = OneLineArgumentParser(
        prog="python -m experiments.many_strategies",
        description="Write a problem with SOURCE's graph, intervals and memory limit but many "
        "strategies per node (a contest-format JSON file; .gz: gzipped).",
    )
    p.add_argument("source", type=Path, help="a cost-table problem file (IOPDDL format)")
    p.add_argument("out", type=Path, help="the file to write (*.json or *.json.gz)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--mean", type=float, default=29.0, help="strategies per node (default 29)")
    p.add_argument("--most", type=positive_int, default=178, help="at most (default 178)")
    p.add_argument("--forbidden", type=float, default=0.10, help="share (default 0.10)")
    args = p.parse_args(argv)
    source = load_problem(args.source)
    name = args.out.name.removesuffix(".gz").removesuffix(".json")
    problem = many_strategies(source, args.seed, args.mean, args.most, args.forbidden, name=name)
    write(problem, args.out)
    sizes = np.array(problem.sizes)
    banned = sum(int((~np.isfinite(c)).sum()) for c in problem.node_cost) / sizes.sum()
    entries = sum(t.size for t in problem.edge_cost)
    print(
        f"{args.out}: {problem.num_nodes} nodes, {len(problem.edges)} edges, {entries:,} table "
        f"entries, strategies per node mean {sizes.mean():.1f} max {sizes.max()}, "
        f"{banned:.1%} forbidden"
    )
    return 0


def write(problem: Problem, out: Path) -> None:
    """`save_problem` (atomic), gzipped when `out` ends in .gz (atomic too)."""
    if out.suffix != ".gz":
        save_problem(problem, out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "problem.json"
        save_problem(problem, plain)
        # gzipped beside `out`, then renamed over it: never half a file
        fd, packed = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent or ".")
        try:
            with open(plain, "rb") as f, os.fdopen(fd, "wb") as raw, gzip.open(raw, "wb") as g:
                shutil.copyfileobj(f, g)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(packed, 0o666 & ~umask)  # a new file's mode, not mkstemp's 0600
            os.replace(packed, out)
        finally:
            Path(packed).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
