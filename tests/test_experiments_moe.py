"""`experiments.moe`: the published MoE anchors' layouts and their simulation, on a tiny
stand-in of the Mixtral anchor (the full anchors run in `python -m experiments.moe`)."""

from __future__ import annotations

import dataclasses

import pytest

from experiments.moe import ANCHORS, Anchor, predict, table
from experiments.moe_flops import megatron_flops_per_token

TINY = dict(
    n_layers=4, dim=256, n_heads=4, n_kv_heads=2, hidden_dim=512, moe_hidden=512,
    vocab_size=1024,
)  # fmt: skip


def tiny(**changes: object) -> Anchor:
    mixtral = next(a for a in ANCHORS if a.model == "mixtral-8x7b")
    base = dict(gpus=16, seq=256, gbs=32, mbs=1, tp=1, pp=2, vp=1, ep=8, sizes=TINY)
    return dataclasses.replace(mixtral, **(base | changes))  # type: ignore[arg-type]


def test_the_anchors_layouts_are_the_published_ones() -> None:
    mixtral, deepseek = ANCHORS
    assert (mixtral.data, mixtral.micro_batches) == (16, 16)  # 64 / (TP1 x PP4); 256 / 16
    assert mixtral.layout == "TP1 PP4 VP8 EP8 DP16 MBS1 GBS256"
    assert (deepseek.data, deepseek.micro_batches) == (128, 120)  # 2,048 / PP16; 15,360 / 128
    assert deepseek.ep == 64 and deepseek.gpus // 8 == 256


def test_a_tiny_anchor_is_predicted_in_its_published_unit() -> None:
    anchor = tiny()
    out = predict(anchor)
    tokens = anchor.gbs * anchor.seq / out["step_seconds"] / anchor.gpus
    assert out["tokens_per_gpu"] == pytest.approx(tokens)
    per_token = megatron_flops_per_token(anchor.shape, anchor.seq, causal=False)
    assert out["predicted"] == pytest.approx(tokens * per_token / 1e12)
    assert out["error"] == pytest.approx(out["predicted"] / anchor.published - 1)
    assert 0 < out["peak_gib"] <= sum(out["peak_parts_gib"].values()) + 1e-9
    assert "468" in table([out]) and anchor.layout in table([out])


def test_spreading_the_experts_changes_the_prediction() -> None:
    spread, alone = predict(tiny(ep=8)), predict(tiny(ep=1))
    assert spread["step_seconds"] != pytest.approx(alone["step_seconds"], rel=1e-6)
    # each GPU holds 1/8 of the routed experts: less for its parameters' training state
    assert spread["peak_parts_gib"]["parameters"] < alone["peak_parts_gib"]["parameters"]


def test_learned_routing_loads_the_busiest_rank_beyond_the_mean() -> None:
    from experiments.moe import LEARNED_IMBALANCE, options_of

    assert tiny(routing="balanced").expert_capacity == 1.0
    assert tiny().expert_capacity == LEARNED_IMBALANCE > 1.0  # dropless, learned router
    assert tiny(capacity_factor=1.1).expert_capacity == 1.1  # tokens beyond 1.1 are dropped
    assert options_of(tiny()).expert_capacity == LEARNED_IMBALANCE
    balanced, learned = predict(tiny(routing="balanced")), predict(tiny())
    assert learned["step_seconds"] > balanced["step_seconds"]
    assert (learned["routing"], balanced["expert_capacity"]) == ("learned", 1.0)


@pytest.mark.slow
def test_the_planner_plans_a_tiny_anchors_model_on_its_gpus() -> None:
    from experiments.moe import plan_anchor

    anchor = tiny()
    out = plan_anchor(anchor, time_limit=10.0)
    summary = out["summary"]
    assert summary["status"] in ("FEASIBLE", "OPTIMAL") and summary["memory_fits"]
    layout = summary["layout"]
    devices = layout["stages"] * layout["tensor"] * layout["context"] * layout["data"]
    assert devices == anchor.gpus and anchor.gpus % layout["expert"] == 0


def test_published_moe_rows_become_anchors_or_say_why_not() -> None:
    from experiments.moe import DEEPEP, LEARNED_IMBALANCE, row_anchors
    from experiments.published import ROWS, read_rows

    moe_rows = [r for r in read_rows(ROWS) if r.ep > 1]
    anchors, skipped = row_anchors()
    assert len(anchors) + len(skipped) == len(moe_rows) > 0
    assert all(reason for _, reason in skipped)
    assert any(r.model == "GPT-OSS-120B" for r, _ in skipped)  # no zoo entry builds it
    for a in anchors:
        assert a.unit == "tokens/s per GPU" and a.published > 0
        assert a.gpus == a.tp * a.pp * a.data and a.micro_batches >= 1
        row = next(r for r in moe_rows if a.name.endswith(f"line {r.line})"))
        balanced = "force-balanced" in row.notes
        assert a.routing == ("balanced" if balanced else "learned")
        dropping = "tokendrop" in row.notes
        assert a.expert_capacity == (1.0 if balanced or dropping else LEARNED_IMBALANCE)
        assert (a.options == DEEPEP) == (a.ep > 8)
    pinned = {  # CSV line: (routing, busiest / mean, DeepEP), from the rows' own notes
        263: ("learned", LEARNED_IMBALANCE, True),  # DeepSeekV3, dropless, EP64
        264: ("token drop", 1.0, False),  # Qwen3-30B-A3B, tokendrop, EP8 in a node
        268: ("balanced", 1.0, True),  # Qwen3-235B-A22B, force-balanced, EP32
    }
    by_line = {int(a.name.rsplit("line ", 1)[1].rstrip(")")): a for a in anchors}
    got = {
        line: (a.routing_label, a.expert_capacity, a.options == DEEPEP)
        for line, a in by_line.items()
        if line in pinned
    }
    assert got == pinned


def test_a_row_anchor_is_predicted_in_tokens_per_gpu() -> None:
    anchor = tiny(unit="tokens/s per GPU", published=1000.0)
    out = predict(anchor)
    assert out["predicted"] == pytest.approx(out["tokens_per_gpu"])
    assert out["error"] == pytest.approx(out["predicted"] / 1000.0 - 1)


def test_the_deepseek_anchor_runs_dualpipe() -> None:
    from planner.pipeline.schedule import check_schedule

    mixtral, deepseek = ANCHORS
    assert (mixtral.pipeline_schedule, tiny(vp=1).pipeline_schedule) == ("interleaved", "1f1b")
    assert deepseek.pipeline_schedule == "dualpipe"
    check_schedule("dualpipe", deepseek.pp, deepseek.micro_batches)  # 120 on PP16
    one, dual = predict(tiny()), predict(tiny(schedule="dualpipe"))  # PP2, 4 micro-batches
    assert (one["schedule"], dual["schedule"]) == ("1f1b", "dualpipe")
    assert dual["step_seconds"] != pytest.approx(one["step_seconds"], rel=1e-6)
    # each stage's copy on the other group too: the parameters' training state twice
    assert dual["peak_parts_gib"]["parameters"] > 1.5 * one["peak_parts_gib"]["parameters"]
