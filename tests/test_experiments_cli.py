"""The experiments' command lines: bad arguments are one `error:` line and exit status 2,
before any experiment work (each runs in-process in well under a second)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

CASES: dict[str, tuple[str, list[str], str]] = {
    "hybrid: zero devices per worker": ("hybrid", ["--m", "0"], "positive integer"),
    "hybrid: worker larger than a node": ("hybrid", ["--m", "8"], "--m must be in 1..4"),
    "hybrid: unknown model": ("hybrid", ["--model", "nope"], "invalid choice"),
    "hybrid: negative time limit": ("hybrid", ["--time-limit", "-1"], "--time-limit"),
    "hybrid: plot into a missing folder": (
        "hybrid",
        ["--plot", "{tmp}/missing/h.png"],
        "does not exist",
    ),
    "dlplacer: zero GPUs": ("dlplacer_inception", ["--gpus", "0"], "positive integer"),
    "dlplacer: more GPUs than a DGX-1": ("dlplacer_inception", ["--gpus", "9"], "8 GPUs"),
    "dlplacer: unknown backend": ("dlplacer_inception", ["--backends", "x"], "invalid choice"),
    "dlplacer: zero time limit": ("dlplacer_inception", ["--time-limit", "0"], "--time-limit"),
    "table5: zero batch": ("optcnn_table5", ["--per-gpu-batch", "0"], "positive integer"),
    "table5: unknown option": ("optcnn_table5", ["--frob"], "unrecognized arguments"),
    "elimination: unknown model": ("elimination_speed", ["--models", "nope"], "unknown model"),
    "elimination: zero repeats": ("elimination_speed", ["--repeats", "0"], "positive integer"),
    "build: unknown model": ("build_speed", ["--models", "nope"], "unknown model"),
    "build: zero max configs": ("build_speed", ["--max-configs", "0"], "positive integer"),
    "accuracy: warm-up of every step": ("accuracy", ["--warmup", "7"], "no step to time"),
    "accuracy: a GPU preset": ("accuracy", ["--preset", "p100-1x4"], "cpu-local-N"),
    "accuracy: unknown model": ("accuracy", ["--models", "nope"], "unknown model"),
    "overruns: unknown backend": ("overruns", ["--backends", "nope"], "invalid choice"),
    "overruns: zero limit": ("overruns", ["--limits", "0"], "--limits"),
    "overruns: no checkout": ("overruns", ["--code", "{tmp}"], "no planner package"),
    "megatron: no such row": ("megatron", ["--rows", "11"], "invalid choice"),
    "megatron: zero time limit": ("megatron", ["--time-limit", "0"], "--time-limit"),
    "megatron: attention above peak": ("megatron", ["--attention-efficiency", "2"], "(0, 1]"),
    "expert tensor: a layout of two sizes": ("expert_tensor", ["--layouts", "2x4"], "2x4x2"),
    "expert tensor: a zero size": ("expert_tensor", ["--layouts", "2x0x1"], "positive sizes"),
    "expert tensor: zero batch": ("expert_tensor", ["--batch", "0"], "positive integer"),
    "pipeline chart: no stages": (
        "pipeline_chart",
        ["--stages", "0"],
        "--stages must be at least 1",
    ),
    "pipeline chart: blocks that do not cut": (
        "pipeline_chart",
        ["--layers", "6", "--stages", "4"],
        "6 blocks, which do not cut into 4 chunks",
    ),
    "pipeline chart: interleaved rounds": (
        "pipeline_chart",
        ["--schedule", "interleaved", "--chunks", "2", "--micro-batches", "6"],
        "not a multiple of 4",
    ),
    "anytime: no such folder": ("anytime", ["{tmp}/missing"], "is not a folder"),
    "anytime: a folder without rows": ("anytime", ["{tmp}"], "no rows.json or rows.csv"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_arguments_are_one_error_line(
    case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    module, argv, says = CASES[case]
    main = importlib.import_module(f"experiments.{module}").main
    code = main([a.format(tmp=tmp_path) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert says in err, err
