"""The baselines backend through the conformance suite, and the baselines themselves."""

from __future__ import annotations

from backends.testing import BackendConformance, tiny_cnn
from planner.hardware.presets import get_preset
from planner.problems.baselines import BASELINES, data_parallel, expert_rnn, model_parallel, owt
from planner.problems.problem import build_problem


class TestBaselinesConformance(BackendConformance):
    backend_name = "baselines"


def test_data_parallel_splits_every_op_by_sample_over_all_devices() -> None:
    g, d = tiny_cnn(), get_preset("p100-1x4")
    for op, cfg in zip(g.ops, data_parallel(g, d).configs, strict=True):
        assert cfg.degree(op, "sample") == 4 and cfg.num_tasks == 4
        assert cfg.devices == (0, 1, 2, 3)


def test_model_parallel_splits_parameters_over_all_devices() -> None:
    g, d = tiny_cnn(), get_preset("p100-1x4")
    s = model_parallel(g, d)
    for op, cfg in zip(g.ops, s.configs, strict=True):
        if op.params:
            assert cfg.degree(op, "channel") == 4 and cfg.degree(op, "sample") == 1


def test_owt_is_data_parallel_for_convs_and_model_parallel_for_dense() -> None:
    g, d = tiny_cnn(), get_preset("p100-1x4")
    s = owt(g, d)
    assert s.config("a").degree(g.op("a"), "sample") == 4
    assert s.config("fc").degree(g.op("fc"), "channel") == 4


def test_expert_places_no_lstm_on_a_non_rnn_graph_and_matches_data_parallel() -> None:
    g, d = tiny_cnn(), get_preset("p100-2x4")
    assert expert_rnn(g, d) == data_parallel(g, d)


def test_every_baseline_is_in_the_config_space() -> None:
    g, d = tiny_cnn(), get_preset("p100-2x4")
    p = build_problem(g, d)
    for name, make in BASELINES.items():
        choices = p.choices_of(make(g, d))
        assert len(choices) == len(g.ops), name
