"""Published runs that trained on 80 GB GPUs are estimated to fit them
(experiments/memory_published.py; docs/pipeline.md, "Published runs")."""

from __future__ import annotations

import pytest

from experiments.memory_published import H100_RUNS, GiB, estimate, sc21_runs, usable


def test_the_usable_memory_of_an_80_gib_gpu_is_74_gib() -> None:
    assert usable(H100_RUNS[0]) == 74 * GiB


def test_llama3_70b_on_64_h100s_fits() -> None:
    # Megatron-Bridge's Llama 3 70B (TP 4, PP 8, VP 5, MBS 1, seq 8192, no recomputation):
    # every op's output kept, it came to 108 GiB on the first stage
    run = H100_RUNS[0]
    assert (run.tp, run.pp, run.vp, run.recompute) == (4, 8, 5, "none")
    out = estimate(run)
    assert out["fits"] and out["max_gib"] == pytest.approx(71.6, abs=0.1)
    # the first stage holds the most: p = 8 stages, v = 5: (p - 1) 2 + (v - 1) p + 1 = 47
    # chunks of 2 layers in flight, 94 layers' activations (Korthikanti: 80 (1 + 7 / 40))
    assert out["in_flight"][0] == 47 and out["peak_gib"][0] == max(out["peak_gib"])
    parts = out["parts_gib"][0]
    assert parts["activations"] == pytest.approx(94 * 33.5 * 8192 * 8192 / 4 / GiB, rel=0.01)
    assert out["parts_gib"][-1]["working_set"] > 0  # the logits' gradient, on the last


@pytest.mark.slow
@pytest.mark.parametrize("run", [*H100_RUNS, *sc21_runs()], ids=lambda r: f"{r.name} {r.layout()}")
def test_every_published_run_fits_its_gpus(run) -> None:  # type: ignore[no-untyped-def]
    assert estimate(run)["fits"]
