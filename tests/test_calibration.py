"""`python -m experiments.calibration`: the published rows it reads, what it skips and why,
the layouts it builds, and one small row end to end (docs/calibration.md)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from experiments.calibration import (
    COLUMNS,
    ROWS,
    calibration_candidate,
    calibration_configurations,
    chunk_layers,
    configuration,
    framework_options,
    held_out_kind,
    main,
    nemo_flops_per_token,
    read_rows,
    recompute,
    replica_layout,
    unsupported,
)
from experiments.published import LLAMA3_PAPER, precision
from planner.errors import LayerwiseError

TINY = {
    "source": "test",
    "release": "r1",
    "model": "Llama-tiny",
    "layers": "4",
    "hidden": "256",
    "ffn_hidden": "512",
    "heads": "4",
    "kv_heads": "2",
    "vocab": "1024",
    "tied": "false",
    "gpus": "16",
    "gpu": "H100-SXM-80GB",
    "precision": "bf16",
    "seq": "128",
    "gbs": "16",
    "mbs": "1",
    "tp": "2",
    "pp": "2",
    "cp": "1",
    "vp": "1",
    "ep": "1",
    "fsdp": "distopt",
    "sequence_parallel": "true",
    "recompute": "none",
    "recompute_layers": "",
    "tokens_per_sec_per_gpu": "100000",
    "tflops_per_gpu": "100",
    "notes": "",
}


def write_rows(path: Path, *rows: dict[str, str], columns: list[str] = COLUMNS) -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_the_shipped_table_parses_and_says_why_it_skips_rows() -> None:
    rows = read_rows(ROWS)
    reasons = {unsupported(r) for r in rows}
    done = [r for r in rows if unsupported(r) is None]
    assert len(rows) > 250 and len(done) >= 150
    assert any(r and r.startswith("fine-tuning") for r in reasons)
    assert any(r and r.startswith("no layers") for r in reasons)  # MoE rows without shapes
    assert {r.precision for r in done} == {"bf16", "fp8", "fp8-cs"}
    assert max(r.cp for r in done) == 32  # Llama 2 7B at 1M tokens
    paper = [r for r in done if r.source == LLAMA3_PAPER]
    assert len(paper) == 3 and all(r.virtual == 8 for r in paper)  # derived: Sec. 3.3.2


def test_fp8_and_context_parallel_rows_parse_into_their_precision_and_layout(
    tmp_path: Path,
) -> None:
    cases = write_rows(
        tmp_path / "r.csv",
        TINY | {"precision": "fp8"},
        TINY | {"precision": "fp8-cs", "cp": "2"},
        TINY | {"precision": "fp8", "source": "github.com/pytorch/torchtitan"},
        TINY | {"cp": "2", "gpus": "32"},
    )
    fp8, cs, titan, cp = read_rows(cases)
    assert (precision(fp8), precision(cs), precision(titan)) == (
        "transformer-engine",
        "transformer-engine-cs",
        "transformer-engine-cs",  # torchao's float8: tensorwise dynamic scaling
    )
    assert precision(cp) is None and all(unsupported(r) is None for r in (fp8, cs, titan, cp))
    assert [held_out_kind(r) for r in (fp8, cs, cp)] == ["fp8", "fp8+cp", "cp"]
    assert not any(calibration_candidate(r) for r in (fp8, cs, titan, cp))
    assert cp.data == 4 and cp.name == "Llama-tiny 32 GPUs TP2 PP2 CP2 GBS 16"
    keep, nodes, here = replica_layout(cp)  # per stage, 2 replicas of TP 2 x CP 2
    assert (len(keep), here) == (2 * 2 * 2 * 2, 2)
    assert keep[:4] == (0, 1, 2, 3) and keep[4:8] == (12, 13, 14, 15)  # the last replica


def test_a_bad_value_or_column_is_one_error_naming_file_line_and_column(tmp_path: Path) -> None:
    bad = write_rows(tmp_path / "bad.csv", TINY | {"tp": "two"})
    with pytest.raises(LayerwiseError, match=r"bad.csv:2: column 'tp' must be a positive integer"):
        read_rows(bad)
    short = write_rows(tmp_path / "short.csv", TINY, columns=COLUMNS[:-3])
    with pytest.raises(LayerwiseError, match="missing column"):
        read_rows(short)
    empty = write_rows(
        tmp_path / "empty.csv", TINY | {"tokens_per_sec_per_gpu": "", "tflops_per_gpu": ""}
    )
    with pytest.raises(LayerwiseError, match="give tokens_per_sec_per_gpu or tflops_per_gpu"):
        read_rows(empty)
    with pytest.raises(LayerwiseError, match="cannot read rows file"):
        read_rows(tmp_path / "nothing.csv")


def test_rows_with_a_bad_file_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write_rows(tmp_path / "bad.csv", TINY | {"gbs": "-4"})
    assert main(["--rows", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "column 'gbs'" in err[0]
    assert not (tmp_path / "out").exists()


def test_what_cannot_be_expressed_is_skipped_with_its_reason(tmp_path: Path) -> None:
    cases = {
        "precision": ("mxfp8", "'mxfp8' is not priced"),
        "release": ("r1 (finetuning table)", "fine-tuning"),
        "gpu": ("MI300X", "no preset for the GPU"),
        "ep": ("8", "mixture of experts"),
        "vp": ("", "virtual stages"),
        "gbs": ("10", "GBS 10 is not a multiple"),
        "tp": ("16", "beyond one 8-GPU node"),
    }
    for column, (value, reason) in cases.items():
        changed = {column: value} | ({"pp": "1"} if column == "tp" else {})
        path = write_rows(tmp_path / f"{column}.csv", TINY | changed)
        (row,) = read_rows(path)
        found = unsupported(row)
        assert found is not None and reason in found, (column, found)
    (ok,) = read_rows(write_rows(tmp_path / "ok.csv", TINY))
    assert unsupported(ok) is None


def test_layers_spread_over_chunks_with_the_ends_lighter() -> None:
    assert chunk_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B on PP 16
    assert chunk_layers(80, 40) == [2] * 40
    assert chunk_layers(126, 64) == [1] + [2] * 62 + [1]  # Megatron-Bridge's 405B split
    assert chunk_layers(126, 128) == [0] + [1] * 126 + [0]  # Llama 3: embedding, head alone
    for layers, chunks in ((10, 3), (7, 1), (9, 2), (96, 96)):
        assert sum(chunk_layers(layers, chunks)) == layers


def test_nemo_flops_per_token_matches_a_published_row() -> None:
    rows = [
        r
        for r in read_rows(ROWS)
        if "24.07" in r.release and r.model == "Llama3-8B" and r.tokens and r.tflops
    ]
    assert rows
    for row in rows:
        assert row.tflops is not None and row.tokens is not None
        assert nemo_flops_per_token(row) == pytest.approx(row.tflops * 1e12 / row.tokens, rel=0.01)


def test_the_calibration_subset_is_a_third_of_the_configurations_by_a_fixed_rule() -> None:
    """Of the bf16 configurations without context parallelism (those the model expressed
    before FP8 and context parallelism), the same three as before: every FP8 row, every row
    with context parallelism and the Llama 3 paper's rows are held out."""
    rows = read_rows(ROWS)
    chosen = calibration_configurations(rows)
    expressible = {configuration(r) for r in rows if calibration_candidate(r)}
    assert chosen <= expressible and len(chosen) == -(-len(expressible) // 3)
    assert calibration_configurations(list(reversed(rows))) == chosen
    picked = [r for r in rows if configuration(r) in chosen and calibration_candidate(r)]
    assert len(picked) == 19
    assert {r.model for r in picked} == {"GPT3-175B", "Nemotron4-15B", "Llama2-70B"}
    assert all(r.precision == "bf16" and r.cp == 1 for r in picked)


def test_the_frameworks_settings(tmp_path: Path) -> None:
    (row,) = read_rows(write_rows(tmp_path / "r.csv", TINY))
    options = framework_options(row)
    assert (options.optimizer, options.master_weights, options.zero) == ("adam", True, 1)
    assert options.rates == "shape" and options.attention_kernel == "cudnn"
    assert options.pp_overlap == 0.0  # no interleaving: Megatron-Bridge's batched p2p
    assert options.cp_overlap == 1.0  # ring attention
    (paper,) = read_rows(write_rows(tmp_path / "p.csv", TINY | {"source": LLAMA3_PAPER}))
    llama3 = framework_options(paper)
    assert (llama3.cp_overlap, llama3.pp_overlap) == (0.0, 1.0)  # all-gather CP, async p2p
    (maxtext,) = read_rows(
        write_rows(tmp_path / "m.csv", TINY | {"source": "maxtext", "recompute": "unknown"})
    )
    assert recompute(maxtext) == "full" and recompute(row) == "none"
    (titan,) = read_rows(write_rows(tmp_path / "t.csv", TINY | {"source": "pytorch/torchtitan"}))
    assert framework_options(titan).attention_kernel == "fa2"  # PyTorch's SDPA
    assert options.nic_rails  # NCCL's rings, one per NIC


def test_a_small_row_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = write_rows(tmp_path / "mine.csv", TINY, TINY | {"precision": "mxfp8"})
    out = tmp_path / "out"
    assert main(["--rows", str(rows), "--out", str(out)]) == 0
    report = json.loads((out / "calibration.json").read_text())
    meta = report["meta"]  # the project's provenance (experiments.runinfo)
    assert meta["command"].startswith("python -m experiments.calibration --rows")
    assert meta["elapsed_seconds"] >= 0 and "git" in meta and meta["rows"] == str(rows)
    done, skipped = report["rows"]
    assert done["set"] == "yours" and done["step_seconds"] > 0
    assert done["tokens_predicted"] == pytest.approx(16 * 128 / done["step_seconds"] / 16)
    shares = sum(v for k, v in done.items() if k.startswith("share_"))
    assert shares == pytest.approx(1.0)  # the breakdown adds up to the step
    assert "'mxfp8' is not priced" in skipped["skipped"]
    assert (out / "calibration.png").stat().st_size > 0
    assert "yours: 1 rows" in capsys.readouterr().out
