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
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from planner.cli.args import OneLineArgumentParser, nonnegative_int, one_line, positive_int
from planner.errors import LayerwiseError
from planner.problems.costtable import load_problem, save_problem
from planner.problems.many_strategies import many_strategies
from planner.problems.problem import Problem

EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
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
    try:
        args = p.parse_args(argv)
        source = load_problem(args.source)
        name = args.out.name.removesuffix(".gz").removesuffix(".json")
        problem = many_strategies(
            source, args.seed, args.mean, args.most, args.forbidden, name=name
        )
        write(problem, args.out)
    except (LayerwiseError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
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
    """`save_problem`, gzipped when `out` ends in .gz."""
    if out.suffix != ".gz":
        save_problem(problem, out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "problem.json"
        save_problem(problem, plain)
        with open(plain, "rb") as f, gzip.open(out, "wb") as g:
            shutil.copyfileobj(f, g)


if __name__ == "__main__":
    sys.exit(main())
