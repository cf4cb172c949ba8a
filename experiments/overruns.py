"""`python -m experiments.overruns`: does `--time-limit` hold? (issue 19)

Every cell runs the real command line in a fresh process,

    python -m planner plan MODEL --devices D --backend B --objective O --time-limit L --seed 0 --json

and measures its wall time from launch to exit; the interpreter's start-up (`python -c
"import planner.cli"`, measured just before the cell) is subtracted, so what is judged is
the time the command itself took: torch's import, capture, build, search, re-score and
recommendation. A cell passes when

    wall - startup <= L + max(0.05 L, 1 s)

whatever the command answered (an answer, no answer, or an error line that says why: a
limit too short to build the problem is an answer about time too). A limit that torch's
import, capture and build use up is the one exception: `plan` finishes them (up to twice
the limit more, at least 30 s) and answers without a search, said in one line (outcome
"answer, no search"); such a cell passes when its answer took at most max(0.05 L, 1 s) after
them. A combination the
backend refuses (the command's `error: ... does not optimize ...` line) is recorded as
"refused"; a cell still running after `3 L + 60 s` is killed and fails ("timeout").

One line per cell as it finishes, the load at the start and the end, and with `--out FILE`
the rows as JSON (with the run's provenance) and as CSV (FILE with the suffix .csv).
`--code DIR` runs another checkout's planner (its root as PYTHONPATH): the same cells
before and after a change.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.runinfo import REPO, finish, load, load_line, run_info
from planner.cli.args import (
    OneLineArgumentParser,
    UsageError,
    positive_seconds,
    report_errors,
    zoo_model,
)
from planner.files import check_output_path, write_text_atomic
from planner.registry import backend_names

MODELS = ["lenet5", "alexnet", "inception_v3", "transformer"]
PRESETS = ["p100-1x4", "p100-4x4"]
LIMITS = [2.0, 10.0, 30.0]
OBJECTIVES = ["additive", "makespan"]
QUICK = {"models": ["lenet5"], "devices": ["p100-1x4"], "limits": [2.0]}
TOLERANCE = (0.05, 1.0)  # a cell may end max(5% of the limit, 1 s) past it
# a cell whose capture and build used the limit up and which was answered without a search
# (`planner.plan` finishes them, up to its overrun, rather than answer nothing): it passes when
# its answer took no more than the tolerance after them
NOT_SEARCHED = "answer, no search"

FIELDS = [
    "backend",
    "objective",
    "model",
    "devices",
    "limit",
    "wall",
    "startup",
    "net",
    "overrun",
    "outcome",
    "status",
    "stopped_by",
    "detail",
    "exit",
    "passed",
    "load",
]


def slack(limit: float) -> float:
    """How far past the limit a cell may end and still pass."""
    share, floor = TOLERANCE
    return max(share * limit, floor)


def _env(code: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    return env


def startup_seconds(code: Path | None = None, python: str = sys.executable) -> float:
    """Seconds to start the interpreter and import planner's command line (no torch)."""
    t0 = time.perf_counter()
    subprocess.run(
        [python, "-c", "import planner.cli"],
        env=_env(code),
        cwd=code,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def command(backend: str, objective: str, model: str, devices: str, limit: float) -> list[str]:
    """The `plan` command of one cell (after `python -m planner`)."""
    return [
        "plan",
        model,
        "--devices",
        devices,
        "--backend",
        backend,
        "--objective",
        objective,
        "--time-limit",
        f"{limit:g}",
        "--seed",
        "0",
        "--json",
    ]


def run_cell(
    backend: str,
    objective: str,
    model: str,
    devices: str,
    limit: float,
    *,
    code: Path | None = None,
    startup: float | None = None,
    timeout: float | None = None,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Run one cell in a fresh process and return its row (the FIELDS). `startup`: the
    interpreter's start-up in seconds (measured now when None); `timeout`: seconds before
    the process is killed (default 3 limit + 60)."""
    if startup is None:
        startup = startup_seconds(code, python)
    timeout = 3 * limit + 60 if timeout is None else timeout
    argv = [python, "-m", "planner", *command(backend, objective, model, devices, limit)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        env=_env(code),
        cwd=code,  # `python -m` puts the working directory first on the path
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends the solvers it started
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        killed = True
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {
        "backend": backend,
        "objective": objective,
        "model": model,
        "devices": devices,
        "limit": limit,
        "wall": round(wall, 3),
        "startup": round(startup, 3),
        "net": round(wall - startup, 3),
        "overrun": round(wall - startup - limit, 3),
        "status": None,
        "stopped_by": None,
        "detail": "",
        "exit": None if killed else proc.returncode,
        "load": load(),
    }
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    said = [line.strip() for line in err.splitlines() if line.strip()]
    summary = _last_json(out)
    if killed:
        row["outcome"] = "timeout"
        row["detail"] = f"killed after {timeout:g} s"
    elif summary is not None:
        row["outcome"] = "answer" if summary.get("objective") is not None else "no answer"
        if "overrun" in summary:  # capture and build used the limit up: answered unsearched
            row["outcome"] = NOT_SEARCHED
        row["status"] = summary.get("status")
        row["stopped_by"] = summary.get("limit")
        row["detail"] = summary.get("message") or (errors[0][7:] if errors else "")
        if not row["detail"] and said:
            row["detail"] = said[-1]  # the last thing it said (a warning, a progress line)
    elif errors and "does not optimize" in errors[0]:
        row["outcome"] = "refused"
        row["detail"] = errors[0][7:]
    else:
        row["outcome"] = "error"
        row["detail"] = (errors or err.strip().splitlines()[-1:] or [""])[0].removeprefix(
            "error: "
        )[:300]
    row["passed"] = _passed(row, summary, limit, killed)
    return row


def _passed(
    row: dict[str, Any], summary: dict[str, Any] | None, limit: float, killed: bool
) -> bool | None:
    """The cell's verdict: None when refused; else it ended within the limit and its
    tolerance, or (answered without a search) its answer took at most the tolerance after
    capture and build."""
    if row["outcome"] == "refused":
        return None
    within = row["net"] <= limit + slack(limit)
    if row["outcome"] == NOT_SEARCHED and summary is not None:  # only capture and build ran on
        within = within or float(summary.get("search_seconds") or 0.0) <= slack(limit)
    return not killed and within


def _last_json(out: str) -> dict[str, Any] | None:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


HEADER = (
    f"{'backend':<11} {'objective':<9} {'model':<12} {'devices':<9} {'limit':>5} "
    f"{'wall':>7} {'net':>7} {'overrun':>8}  {'result':<24} {'verdict':<7}"
)


def format_row(row: dict[str, Any]) -> str:
    """One table line: the cell, its times, what it answered and pass/fail."""
    result = row["outcome"]
    if row["status"] is not None:
        result = row["status"] + (f"/{row['stopped_by']}" if row["stopped_by"] else "")
    verdict = {None: "-", True: "pass", False: "FAIL"}[row["passed"]]
    line = (
        f"{row['backend']:<11} {row['objective']:<9} {row['model']:<12} {row['devices']:<9} "
        f"{row['limit']:>5g} {row['wall']:>7.2f} {row['net']:>7.2f} {row['overrun']:>+8.2f}  "
        f"{result:<24} {verdict:<7}"
    )
    if row["detail"] and row["outcome"] != "refused":
        line += f" {row['detail'][:110]}"
    return line


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as CSV text (the load as one 'a b c' field)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS)
    w.writeheader()
    for row in rows:
        load_ = row.get("load")
        w.writerow({**row, "load": " ".join(map(str, load_)) if load_ else ""})
    return buf.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the table; bad arguments are one `error:` line and exit status 2. Exit status 1
    when a cell failed."""
    return report_errors(lambda: _main(argv))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.overruns", description=__doc__)
    p.add_argument("--limits", nargs="+", type=positive_seconds, default=None)
    p.add_argument("--backends", nargs="+", choices=backend_names(), default=None)
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=OBJECTIVES)
    p.add_argument("--models", nargs="+", type=zoo_model, default=None)
    p.add_argument("--devices", nargs="+", default=None, help="device presets")
    p.add_argument("--out", type=Path, default=None, help="JSON results (and FILE.csv)")
    p.add_argument("--code", type=Path, default=None, help="checkout to run (default this one)")
    p.add_argument("--quick", action="store_true", help="lenet5 on p100-1x4 at 2 s")
    args = p.parse_args(argv)
    quick = QUICK if args.quick else {"models": MODELS, "devices": PRESETS, "limits": LIMITS}
    for key, value in quick.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backends is None:
        args.backends = backend_names()
    if args.out is not None:
        check_output_path(args.out, "results")
        check_output_path(args.out.with_suffix(".csv"), "results")
    if args.code is not None and not (args.code / "planner" / "__init__.py").exists():
        raise UsageError(f"--code {args.code}: no planner package there")
    return args


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    info = run_info("experiments.overruns", argv, args)
    code = args.code.resolve() if args.code else REPO
    print(f"code: {code}; {load_line()} at the start", flush=True)
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    for limit in args.limits:
        for backend in args.backends:
            for objective in args.objectives:
                for model in args.models:
                    for devices in args.devices:
                        row = run_cell(backend, objective, model, devices, limit, code=code)
                        rows.append(row)
                        print(format_row(row), flush=True)
    info = finish(info)
    judged = [r for r in rows if r["passed"] is not None]
    failed = [r for r in judged if not r["passed"]]
    worst = max(judged, key=lambda r: r["overrun"], default=None)
    print(
        f"{len(judged) - len(failed)} of {len(judged)} cells within the limit "
        f"({len(rows) - len(judged)} refused); worst overrun "
        + (
            f"{worst['overrun']:+.2f} s ({format_row(worst).split('  ')[0].strip()})"
            if worst
            else "-"
        )  # fmt: skip
    )
    print(f"{load_line(info)}; {info['elapsed_seconds']:.0f} s in all", flush=True)
    if args.out is not None:
        data = {"format": "layerwise.overruns", "run": info, "rows": rows}
        write_text_atomic(args.out, json.dumps(data, indent=1))
        write_text_atomic(args.out.with_suffix(".csv"), to_csv(rows))
        print(f"results written to {args.out} and {args.out.with_suffix('.csv')}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
