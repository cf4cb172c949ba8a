"""`python -m planner` (or `layerwise`): models, graph, devices, plan, evaluate, export,
profile.

Every command ends bad input with a one-line `error: ...` on stderr and exit status 2 (usage
errors included: no argparse usage block); output paths are checked before any work. A plan
that finds no solution exits with status 1. `plan` is a thin layer over `planner.plan`
(planner/api.py): with `--json` it prints exactly one strict JSON object on stdout.
Logging (planner/logs.py): by default only warnings go to stderr; `-v` adds everything from
DEBUG up (the backends' progress lines among them), `--log-file F` keeps it all. Output is
short at any scale: device sets as ranges, a plan of more than PLAN_ROWS ops by config (`-v`:
every op), a cost-table objective as the plain number it is (no unit). The first Ctrl-C during
a search stops it and the best answer so far is printed and written (limit INTERRUPTED).

Modules: `args` (what every command line of the project shares: the one-line parser, argument
types, logging options, error reporting; runtime.run and the experiments use it), `parser`
(`build_parser`: one function per command), `commands` (`main` and the small commands),
`plan` and `evaluate` (those two commands; `export` is in `commands`), `inputs` (reading the user's model and files),
`output` (what the commands print).
"""

from planner.cli.commands import main
from planner.cli.parser import build_parser

__all__ = ["build_parser", "main"]
