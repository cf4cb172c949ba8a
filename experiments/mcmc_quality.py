"""`python -m experiments.mcmc_quality`: how good the `mcmc` search is (FlexFlow Sec. 8.3-8.4).

Parts (`--part`):

- `quality` (default): per case (zoo model x device preset), the simulated makespan of `mcmc`
  after `--budget` seconds against the reference: the best of `elimination`'s strategy (the
  optimum of OptCNN's Eq. 1) re-simulated and the expert strategies (data parallel, model
  parallel, OWT, the RNN expert). "headroom" is the most any strategy could gain over the
  reference: down to `work_bound`, the busiest device's least possible compute. Quick by default (3 models x 2 presets x 10 s); `--full`:
  the 8 models x 3 presets of the issue at 60 s.
- `proposals`: FlexFlow's proposals (a random config for a random node, no pre-screen)
  against this backend's mix, each from the same start (the best of the starts) for the same
  time: proposals, simulations, acceptance rate, gain, gain per second.
- `schedule`: temperature policies (`POLICIES`) on `TUNE_CASES` for `--budget` seconds: the
  gain over the best start.
- `exact` (FlexFlow 8.4): on problems where the exact `search` backend proves the optimum of
  the makespan, does `mcmc` find it, and how fast?

Every part prints a table and writes a CSV to `--out` (default results/). Exit status 2 with
one `error:` line on bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from backends import SolveOptions, get_backend
from backends.base import evaluate_objective
from planner.cli.args import OneLineArgumentParser, nonnegative_int, one_line, positive_seconds
from planner.errors import LayerwiseError
from planner.problems.baselines import BASELINES
from planner.recommend import baseline_choices

QUICK = (["alexnet", "vgg16", "inception_v3"], ["p100-1x4", "p100-2x4"], 10.0)
FULL_MODELS = ["lenet5", "alexnet", "vgg16", "inception_v3", "resnet101"]
FULL = (FULL_MODELS + ["rnnlm", "transformer", "nmt"], ["p100-1x4", "p100-2x4", "p100-4x4"], 60.0)
TUNE_CASES = ["lenet5:p100-1x4", "alexnet:p100-4x4", "vgg16:p100-2x4", "inception_v3:p100-2x4"]
TUNE_CASES += ["resnet101:p100-2x4", "rnnlm:p100-2x4", "transformer:p100-2x4"]
POLICIES = {
    "reheat 0.1% -> 2% (default)": {},
    "cool 0.1%": {"temperature": 0.001},
    "hot 2%, restart 200": {"temperature": 0.02, "cycle": 200},
    "hot 2%, no restart": {"temperature": 0.02, "cycle": 10**9},
}
PROPOSALS = {
    "FlexFlow: random config": {"mix": {"jump": 1.0}, "screen": 0.0},
    "mix, no screen": {"screen": 0.0},
    "mix + Eq. 1 screen (default)": {},
}
SMALL = [("lenet5", {}), ("rnnlm", {"steps": 2})]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m experiments.mcmc_quality", description=__doc__)
    p.add_argument("--part", choices=["quality", "proposals", "schedule", "exact"])
    p.add_argument("--full", action="store_true", help="every case of the issue, 60 s each")
    p.add_argument("--models", nargs="+", help="zoo models (default: by --full)")
    p.add_argument("--presets", nargs="+", help="device presets (default: by --full)")
    p.add_argument("--budget", type=positive_seconds, help="mcmc seconds per run")
    p.add_argument("--exact-cap", type=positive_seconds, default=600.0, help="for `exact`")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", type=Path, default=Path("results"), help="CSV folder")
    args = p.parse_args(argv)
    models, presets, budget = FULL if args.full else QUICK
    args.part = args.part or "quality"
    args.models = args.models or models
    args.presets = args.presets or presets
    args.budget = args.budget or budget
    _check_cases(args.models, args.presets)
    return args


def _check_cases(models: Sequence[str], presets: Sequence[str]) -> None:
    from planner.graph.zoo import MODELS
    from planner.hardware.presets import get_preset

    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise LayerwiseError(f"unknown model(s) {unknown}; available: {', '.join(MODELS)}")
    for preset in presets:
        get_preset(preset)


def _problem(model: str, preset: str, **kwargs: Any) -> Any:
    from planner.graph.zoo import model_graph
    from planner.hardware.presets import get_preset
    from planner.problems.problem import build_problem

    return build_problem(model_graph(model, **kwargs), get_preset(preset))


def reference(problem: Any) -> tuple[str, float, tuple[int, ...] | None]:
    """(name, makespan, choices) of the best of elimination's strategy re-simulated and the
    expert strategies."""
    found = []
    elim = get_backend("elimination").solve(problem, SolveOptions(time_limit=60))
    if elim.choices is not None:
        found.append(("elimination", elim.choices))
    found += list(baseline_choices(problem).items())  # those in the space and memory
    unique = {c: n for n, c in reversed(found)}  # one simulation per strategy (owt may be mp)
    scored = [(evaluate_objective(problem, c, "makespan"), n, c) for c, n in unique.items()]
    value, name, choices = min(scored)
    return name, value, choices


def work_bound(problem: Any) -> float:
    """A lower bound on the makespan of every strategy: each op's least total task time
    (forward + backward, summed over its tasks, over its configs), summed over the ops and
    divided by the device count (the busiest device has at least the average load)."""
    dnn = problem.dnn("the work bound sums the task times of a DNN's ops")
    cm, space = dnn.cost_model, dnn.space
    total = 0.0
    for i in range(len(dnn.graph.ops)):
        total += min(sum(float(t.sum()) for t in cm.task_times(i, c)) for c in space[i].configs)
    return total / dnn.devices.num_devices


def _mcmc(problem: Any, seconds: float, seed: int, **kwargs: Any) -> Any:
    opts = SolveOptions(objective="makespan", time_limit=seconds, seed=seed, **kwargs)
    return get_backend("mcmc").solve(problem, opts)


def _grid(args: argparse.Namespace) -> list[tuple[str, ...]]:
    return [(m, p) for m in args.models for p in args.presets]


def _built(
    cases: Iterable[Sequence[str]], say: Callable[[str], None]
) -> Iterator[tuple[str, str, Any]]:
    """Each (model, preset) case with its problem, built when its turn comes."""
    for model, preset in cases:
        say(f"{model} on {preset}: building the problem")
        yield model, preset, _problem(model, preset)


def quality(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for model, preset, problem in _built(_grid(args), say):
        name, ref, _ = reference(problem)
        dnn = problem.dnn()
        dp = evaluate_objective(
            problem,
            problem.choices_of(BASELINES["data_parallel"](dnn.graph, dnn.devices)),
            "makespan",
        )
        say(
            f"{model} on {preset}: mcmc for {args.budget:g} s (reference {name} {ref * 1e3:.3f} ms)"
        )
        r = _mcmc(problem, args.budget, args.seed)
        rows.append(
            {
                "model": model,
                "preset": preset,
                "data_parallel_ms": dp * 1e3,
                "reference": name,
                "reference_ms": ref * 1e3,
                "headroom_pct": 100 * (1 - work_bound(problem) / ref),
                "mcmc_ms": r.objective * 1e3,
                "gain_pct": 100 * (1 - r.objective / ref),
                "vs_data_parallel": dp / r.objective,
                "proposals": r.stats["proposals"],
                "acceptance": r.stats["acceptance_rate"],
                "start": r.stats["start"],
            }
        )
    return rows


def proposals(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for model, preset, problem in _built(_grid(args), say):
        _, ref, choices = reference(problem)
        for label, extra in PROPOSALS.items():
            say(f"{model} on {preset}: {label}, {args.budget:g} s")
            warm = {"inits": ["warm_start"], **extra}
            t0 = time.perf_counter()
            r = _mcmc(problem, args.budget, args.seed, warm_start=choices, extra=warm)
            seconds = time.perf_counter() - t0
            gain = 100 * (1 - r.objective / ref)
            rows.append(
                {
                    "model": model,
                    "preset": preset,
                    "proposals": label,
                    "proposed": r.stats["proposals"],
                    "simulated": r.stats["simulated"],
                    "acceptance": r.stats["acceptance_rate"],
                    "gain_pct": gain,
                    "gain_pct_per_s": gain / seconds,
                }
            )
    return rows


def schedule(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    cases = [tuple(c.split(":")) for c in TUNE_CASES]
    if args.models != QUICK[0] or args.presets != QUICK[1]:
        cases = _grid(args)
    for model, preset, problem in _built(cases, say):
        for label, extra in POLICIES.items():
            say(f"{model} on {preset}: {label}, {args.budget:g} s")
            r = _mcmc(problem, args.budget, args.seed, extra=extra)
            starts = [v for k, v in r.stats["starts"].items() if v is not None and k != "random"]
            rows.append(
                {
                    "model": model,
                    "preset": preset,
                    "policy": label,
                    "proposals": r.stats["proposals"],
                    "gain_pct": 100 * (1 - r.objective / min(starts)),
                }
            )
    return rows


def exact(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    for model, kwargs in SMALL:
        say(f"{model} {kwargs or ''} on p100-1x4: exact search (up to {args.exact_cap:g} s)")
        problem = _problem(model, "p100-1x4", **kwargs)
        dnn = problem.dnn()
        dp = problem.choices_of(BASELINES["data_parallel"](dnn.graph, dnn.devices))
        opts = SolveOptions(objective="makespan", time_limit=args.exact_cap, warm_start=dp)
        e = get_backend("search").solve(problem, opts)
        say(f"{model}: mcmc")
        m = _mcmc(problem, args.budget, args.seed)
        reach = next((s for s, v in m.stats["trace"]["incumbent"] if v <= m.objective), None)
        rows.append(
            {
                "model": f"{model} {kwargs or ''}".strip(),
                "configs": " x ".join(map(str, problem.sizes)),
                "exact_ms": e.objective * 1e3,
                "exact_status": e.status.value,
                "exact_s": e.stats["search_seconds"],
                "mcmc_ms": m.objective * 1e3,
                "mcmc_s_to_best": reach,
                "same": abs(m.objective - e.objective) <= 1e-9 * e.objective,
            }
        )
    return rows


PARTS = {"quality": quality, "proposals": proposals, "schedule": schedule, "exact": exact}


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    t = Table(title=title)
    if not rows:
        return t
    for col in rows[0]:
        t.add_column(col, justify="left" if isinstance(rows[0][col], str) else "right")
    for row in rows:
        t.add_row(*(_fmt(v) for v in row.values()))
    return t


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _save(rows: list[dict[str, Any]], folder: Path, part: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"mcmc_quality-{part}-{time.strftime('%Y%m%d-%H%M%S')}.csv"
    with path.open("w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def summary(rows: list[dict[str, Any]]) -> str:
    """The issue's targets, for the quality part."""
    worse = [f"{r['model']}/{r['preset']}" for r in rows if r["gain_pct"] < -1e-7]
    better = sum(r["gain_pct"] >= 3.0 for r in rows)
    return (
        f"mcmc no worse than the reference on {len(rows) - len(worse)}/{len(rows)} cases"
        + (f" (worse: {', '.join(worse)})" if worse else "")
        + f"; at least 3% better on {better}/{len(rows)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    try:
        args = parse_args(argv)
        rows = PARTS[args.part](args, lambda text: console.print(text, style="dim"))
        path = _save(rows, args.out, args.part)
    except (LayerwiseError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    console.print(_table(f"mcmc quality: {args.part}", rows))
    if args.part == "quality":
        console.print(summary(rows))
    console.print(f"CSV written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
