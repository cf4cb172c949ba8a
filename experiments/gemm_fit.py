"""`python -m experiments.gemm_fit`: the GEMM shape function, fitted on measured H100 GEMMs.

The table (`experiments/data/gemm_h100_bf16.csv`, sources in `experiments/data/SOURCES.md`)
holds the bf16 throughput of 150 GEMMs on an H100 SXM: every (m, n, k) of 256 to 4,096 in
powers of two, and the batched ones of 4 x 4,096 rows. `planner.costs.rates.GemmFit` prices
a GEMM as `launch + 2 m n k / (peak x fraction(m, n, k))` with

    fraction(m, n, k) = cap / (1 + (tiles / (m n)) ** exponent) / (1 + depth / k)

`cap` is not fitted: it is the chip's Maximum Achievable Matmul FLOPS over its peak (794.5 of
989 TFLOP/s). The other four minimise the mean squared log error of the predicted TFLOP/s
over the table (a grid, then a finer grid around the best point). The command prints the
constants, the error on the table (median and largest absolute error of the predicted
throughput, over all rows and over the rows of at least 2^33 FLOPs, the size of a
transformer's GEMMs) and compares them with `H100_GEMM`, the constants the cost model uses.

`--fp8` fits the FP8 GEMMs' function (`H100_FP8_GEMM`): its `cap` is the chip's FP8 Maximum
Achievable Matmul FLOPS over its FP8 peak (1,402.6 of 1,979 TFLOP/s), `tiles`, `exponent` and
`launch` are the bf16 fit's (the same output tiles; a tile's launch), and `depth` (the
contraction a tile's fixed work is worth: FP8 runs the contraction loop twice as fast, so its
prologue and epilogue weigh more) is fitted on the dense FP8 GEMMs of DeepGEMM's table
(`experiments/data/gemm_h800_fp8.csv`, 4,096 rows, an H800 SXM: the H100 SXM's GH100 die and
FP8 rate). It then checks the fitted contraction dependence against tilelang's FP8 sweep of
the contraction (8,192 x 8,192 x 256 ... 16,384, H800 SXM, two published versions:
`gemm_h800_fp8_ksweep.csv`), each version relative to its own largest GEMM.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from planner.costs.rates import H100_FP8_GEMM, H100_GEMM, GemmFit

TABLE = Path(__file__).parent / "data" / "gemm_h100_bf16.csv"
FP8_TABLE = Path(__file__).parent / "data" / "gemm_h800_fp8.csv"
FP8_SWEEP = Path(__file__).parent / "data" / "gemm_h800_fp8_ksweep.csv"
H100_PEAK = 989e12
H100_FP8_PEAK = 1979e12
LARGE = 2.0**33  # FLOPs: rows at least this large are "transformer-sized"


def load_table(path: Path = TABLE) -> dict[str, np.ndarray]:
    """The table's columns: batch, m, n, k, tflops (measured), as float arrays."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {key: np.array([float(r[key]) for r in rows]) for key in rows[0]}


def predicted_tflops(
    fit: GemmFit, table: dict[str, np.ndarray], peak: float = H100_PEAK
) -> np.ndarray:
    """The fit's TFLOP/s for every row of the table (a batch of b GEMMs: m = b x rows)."""
    m = table["batch"] * table["m"]
    flops = 2.0 * m * table["n"] * table["k"]
    seconds = fit.launch + flops / (peak * fit.fraction_array(m, table["n"], table["k"]))
    return flops / seconds / 1e12


def errors(fit: GemmFit, table: dict[str, np.ndarray], peak: float = H100_PEAK) -> dict[str, float]:
    """Median and largest |predicted / measured - 1| over all rows and the large ones."""
    err = np.abs(predicted_tflops(fit, table, peak) / table["tflops"] - 1.0)
    large = 2.0 * table["batch"] * table["m"] * table["n"] * table["k"] >= LARGE
    return {
        "median": float(np.median(err)),
        "max": float(err.max()),
        "large_median": float(np.median(err[large])),
        "large_max": float(err[large].max()),
        "rows": float(len(err)),
        "large_rows": float(large.sum()),
    }


def fit_table(table: dict[str, np.ndarray], cap: float = H100_GEMM.cap) -> GemmFit:
    """The four free constants minimising the mean squared log error, `cap` given."""
    m = table["batch"] * table["m"]
    n, k, measured = table["n"], table["k"], table["tflops"] * 1e12
    flops = 2.0 * m * n * k

    def loss(tiles: np.ndarray, exponent: np.ndarray, depth: np.ndarray, launch: float) -> Any:
        frac = cap / (1.0 + (tiles / (m * n)) ** exponent) / (1.0 + depth / k)
        rate = flops / (launch + flops / (H100_PEAK * frac))
        return np.mean(np.log(rate / measured) ** 2, axis=-1)

    best = (np.inf, 0.0, 0.0, 0.0, 0.0)
    grids = (np.geomspace(1e4, 1e7, 31), np.arange(0.5, 2.01, 0.25), np.geomspace(8, 2048, 33))
    for launch in np.arange(0.0, 10.01e-6, 0.5e-6):
        best = _grid(loss, grids, launch, best)
    _, tiles, exponent, depth, launch = best
    for _ in range(3):  # finer grids around the best point
        grids = (
            tiles * np.geomspace(0.8, 1.25, 15),
            exponent + np.linspace(-0.1, 0.1, 9),
            depth * np.geomspace(0.8, 1.25, 15),
        )
        for step in np.linspace(-0.5e-6, 0.5e-6, 11):
            best = _grid(loss, grids, max(0.0, launch + step), best)
        _, tiles, exponent, depth, launch = best
    return GemmFit(cap, float(tiles), float(exponent), float(depth), float(launch))


def _grid(
    loss: Any, grids: tuple[np.ndarray, ...], launch: float, best: tuple[float, ...]
) -> tuple[float, ...]:
    t, e, d = (
        g.reshape(shape)
        for g, shape in zip(grids, ((-1, 1, 1, 1), (1, -1, 1, 1), (1, 1, -1, 1)), strict=True)
    )
    values = loss(t, e, d, launch)
    i = np.unravel_index(int(np.argmin(values)), values.shape)
    if values[i] < best[0]:
        return (float(values[i]), grids[0][i[0]], grids[1][i[1]], grids[2][i[2]], launch)
    return best


def fit_fp8_depth(table: dict[str, np.ndarray], base: GemmFit = H100_GEMM) -> GemmFit:
    """The FP8 fit: the FP8 MAMF cap, `base`'s tiles, exponent and launch, and the `depth`
    (a grid of 2,001 values from 8 to 8,192, log-spaced) minimising the mean squared log
    error of the predicted TFLOP/s over `table` at the FP8 peak."""
    depths = np.geomspace(8.0, 8192.0, 2001)
    best = (np.inf, depths[0])
    for depth in depths:
        fit = GemmFit(H100_FP8_GEMM.cap, base.tiles, base.exponent, float(depth), base.launch)
        loss = np.mean(np.log(predicted_tflops(fit, table, H100_FP8_PEAK) / table["tflops"]) ** 2)
        best = min(best, (float(loss), float(depth)))
    return GemmFit(H100_FP8_GEMM.cap, base.tiles, base.exponent, best[1], base.launch)


def sweep_errors(fit: GemmFit, path: Path = FP8_SWEEP) -> dict[str, list[float]]:
    """Per series of the contraction sweep: predicted / measured - 1 of each GEMM's
    throughput relative to the series' largest contraction (the series' own ceiling)."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    out: dict[str, list[float]] = {}
    for name in dict.fromkeys(r["series"] for r in rows):
        mine = [r for r in rows if r["series"] == name]
        top = max(mine, key=lambda r: float(r["k"]))
        ref = fit.fraction(float(top["m"]), float(top["n"]), float(top["k"]))
        out[name] = [
            fit.fraction(float(r["m"]), float(r["n"]), float(r["k"])) / ref
            / (float(r["tflops"]) / float(top["tflops"])) - 1.0
            for r in mine
        ]  # fmt: skip
    return out


def _print_fp8() -> None:
    table = load_table(FP8_TABLE)
    fitted = fit_fp8_depth(table)
    for name, fit in (
        ("fitted", fitted),
        ("used (planner.costs.rates.H100_FP8_GEMM)", H100_FP8_GEMM),
    ):
        err = predicted_tflops(fit, table, H100_FP8_PEAK) / table["tflops"] - 1.0
        sweep = "; ".join(
            f"series {k}: " + ", ".join(f"{100 * x:+.1f}%" for x in v)
            for k, v in sweep_errors(fit).items()
        )
        print(
            f"FP8 {name}: cap {fit.cap:.4f}, depth {fit.depth:.0f}; on the {len(err)} DeepGEMM "
            f"rows: " + ", ".join(f"{100 * x:+.1f}%" for x in err)
            + f" (median |error| {np.median(np.abs(err)):.1%}); contraction sweep (k 256 ... "
            f"16,384, relative): {sweep}"
        )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.gemm_fit", description=__doc__)
    parser.add_argument("--table", type=Path, default=TABLE, help="CSV: batch,m,n,k,tflops")
    parser.add_argument("--fp8", action="store_true", help="fit the FP8 GEMMs' depth instead")
    args = parser.parse_args(argv)
    if args.fp8:
        _print_fp8()
        return 0
    table = load_table(args.table)
    fitted = fit_table(table)
    for name, fit in (("fitted", fitted), ("used (planner.costs.rates.H100_GEMM)", H100_GEMM)):
        e = errors(fit, table)
        print(
            f"{name}: cap {fit.cap:.4f}, tiles {fit.tiles:.3g}, exponent {fit.exponent:.3f}, "
            f"depth {fit.depth:.1f}, launch {fit.launch * 1e6:.2f} us; error on {e['rows']:.0f} "
            f"rows: median {e['median']:.1%}, max {e['max']:.1%}; on the {e['large_rows']:.0f} "
            f"of >= 2^33 FLOPs: median {e['large_median']:.1%}, max {e['large_max']:.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
