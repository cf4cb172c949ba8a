"""planner.problems.idle: a plan that leaves devices idle says so, and why."""

from __future__ import annotations

import json

import pytest
from graphs import linear_head

import planner
from backends import Status
from planner.graph.zoo import model_graph
from planner.problems.idle import device_use, split_counts


def test_a_device_count_no_split_divides_leaves_devices_idle_and_says_which_count_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """linear_head's dims are powers of two: on 6 GPUs no op splits over more than 2 of them
    (a split's task count must divide 6), and the plan says so, naming 4 as a device count
    the ops can use in full."""
    with caplog.at_level("WARNING", logger="planner.api"):
        r = planner.plan(linear_head(), "p100-1x6", backend="elimination", recommend=False)
    s = r.summary()
    assert s["devices_used"] == 1 and s["devices_total"] == 6
    assert (
        "ops with 100% of the forward FLOPs cannot be split over more than 2" in s["idle_devices"]
    )
    assert "all of those ops split 4 ways: plan on 4 devices" in s["idle_devices"]
    # and the proven optimum of Eq. 1 on a graph this small uses one device: said too
    assert (
        "configs over up to 2 of them were searched, and the proven optimum" in (s["idle_devices"])
    )
    assert s["idle_devices"] in caplog.text  # a warning, on stderr from the command line
    json.dumps(s, allow_nan=False)


def test_a_plan_that_uses_every_device_says_nothing_more() -> None:
    r = planner.plan("lenet5", "p100-1x4", backend="baselines", model_kwargs={"batch": 8})
    assert r.summary()["devices_used"] == r.summary()["devices_total"] == 4
    assert "idle_devices" not in r.summary()


def test_fewer_devices_chosen_by_the_objective_are_told_apart_from_a_space_that_cannot_use_them() -> (
    None
):
    """linear_head on 16 GPUs: its ops could be split 8 and 16 ways, and Eq. 1's proven optimum
    puts everything on one device; the reason says the objective chose it, not the space."""
    r = planner.plan(linear_head(), "p100-4x4", backend="elimination", recommend=False)
    use = device_use(r.problem, r.choices or (), "additive", r.status is Status.OPTIMAL)
    assert (use.used, use.total, use.widest) == (1, 16, 16)
    assert use.reason == r.summary()["idle_devices"]
    assert use.reason == (
        "the plan uses 1 of the 16 devices: configs over up to 16 of them were searched, and the "
        "proven optimum under the additive objective uses fewer (no plan that uses more costs "
        "less under it)"
    )


def test_split_counts_are_the_products_of_dividing_degrees() -> None:
    fc1 = linear_head().ops[1]  # sample 8 x channel 64
    assert split_counts(fc1, 6) == {1, 2, 4}
    assert max(split_counts(fc1, 20)) == 16 and max(split_counts(fc1, 64)) == 64
    ops = model_graph("lenet5", batch=8).ops
    fc = next(op for op in ops if op.kind == "linear" and dict(op.output.shape)["channel"] == 10)
    assert 5 in split_counts(fc, 20)  # ten classes split five ways
