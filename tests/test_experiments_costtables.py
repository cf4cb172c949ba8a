"""`python -m experiments.costtables`: generated problems through backends, one process per
case, answers re-checked; bad arguments are one error line and exit status 2."""

from __future__ import annotations

import csv
import gzip
from pathlib import Path

import pytest

from experiments import costtables


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give a directory"),
        (["/no/such/dir"], "is not a directory"),
        (["{tmp}", "--backends", "nope"], "unknown backend 'nope'"),
        (["{tmp}"], "holds no *.json"),
        (["{tmp}", "--time-limit", "0"], "time-limit"),
        (["--generate", "{tmp}", "--sizes", "8,x"], "--sizes must be node counts"),
    ],
)
def test_bad_arguments_are_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert costtables.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_generate_then_run_checks_every_answer(tmp_path: Path) -> None:
    problems, out = tmp_path / "problems", tmp_path / "results"
    assert costtables.main(["--generate", str(problems), "--sizes", "40", "--count", "2"]) == 0
    assert len(list(problems.glob("*.json"))) == 2
    first = sorted(problems.glob("*.json"))[0]  # one of them gzipped: read the same way
    first.with_suffix(".json.gz").write_bytes(gzip.compress(first.read_bytes()))
    first.unlink()
    argv = [str(problems), "--backends", "baselines", "ilp", "--time-limit", "5", "--out", str(out)]
    assert costtables.main(argv) == 0
    (path,) = out.glob("costtables-*.csv")
    rows = list(csv.DictReader(path.open()))
    assert len(rows) == 4 and {r["problem"] for r in rows} == {
        first.name.removesuffix(".json"),
        "contest-n40-seed1",
    }
    for row in rows:
        assert row["valid"] == "yes", row
        assert float(row["rss_mib"]) > 0 and float(row["wall"]) > 0
    ilp = [r for r in rows if r["backend"] == "ilp"]
    assert all(r["status"] == "OPTIMAL" and float(r["gap"]) < 1e-9 for r in ilp)
