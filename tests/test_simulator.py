"""The execution simulator: task graph, full simulation, delta simulation."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from graphs import GRAPHS, chain_cnn
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costs.config import ConfigSpace, ParallelConfig
from planner.costs.costmodel import CostModel, CostOptions
from planner.graph.zoo import model_graph
from planner.hardware.presets import get_preset
from planner.problems.baselines import data_parallel, model_parallel
from planner.problems.problem import Problem, build_problem
from planner.problems.strategy import Strategy
from planner.sim.simulator import Simulator, simulate


@cache
def problem(name: str, preset: str, sync: str = "ring") -> Problem:
    graph = GRAPHS[name]() if name in GRAPHS else model_graph(name, batch=8, **_small(name))
    devices = get_preset(preset)
    cm = CostModel(graph, devices, CostOptions(sync=sync))
    return build_problem(graph, devices, cm, tie_groups=False)


def _small(name: str) -> dict[str, int]:
    return {
        "inception_v3": {"image_size": 75, "aux_logits": False},
        "rnnlm": {"steps": 3, "hidden": 64, "vocab": 100},
        "transformer": {"seq": 16, "width": 32, "layers": 2, "heads": 4, "vocab": 100},
    }.get(name, {})


def _single_device(p: Problem, device: int) -> Strategy:
    cfgs = tuple(ParallelConfig((1,) * len(op.output.dims), (device,)) for op in p.dnn().graph.ops)
    return Strategy(p.dnn().graph, p.dnn().devices, cfgs)


def test_one_device_runs_every_task_back_to_back() -> None:
    p = problem("chain_cnn", "p100-1x4")
    cm = p.dnn().cost_model
    t = simulate(cm, _single_device(p, 2))
    total = sum(
        float(sum(cm.task_times(i, c)[0] + cm.task_times(i, c)[1]))
        for i, c in enumerate(_single_device(p, 2).configs)
    )
    updates = sum(task.end - task.start for task in t.tasks if task.name.startswith("update"))
    assert t.makespan == pytest.approx(total + updates, rel=1e-12)
    busy = [task for task in t.tasks if task.end > task.start]
    assert {task.resource for task in busy} == {2}
    spans = sorted((task.start, task.end) for task in busy)
    assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:], strict=False))


def test_tasks_respect_their_dependencies_and_fifo_devices() -> None:
    p = problem("inception", "p100-2x4")
    tg = Simulator(p.dnn().cost_model, model_parallel(p.dnn().graph, p.dnn().devices).configs).tasks
    for t in tg.order:
        for q in tg.preds[t]:
            assert tg.end[q] <= tg.end[t] - tg.dur[t] + 1e-15
    for keys, ids in tg.chains.values():
        assert keys == sorted(keys)
        ends = [tg.end[t] for t in ids]
        starts = [tg.end[t] - tg.dur[t] for t in ids]
        assert all(e <= s + 1e-15 for e, s in zip(ends, starts[1:], strict=False))


def test_data_parallel_synchronizes_parameters_on_links() -> None:
    p = problem("chain_cnn", "p100-1x4")
    t = simulate(p.dnn().cost_model, data_parallel(p.dnn().graph, p.dnn().devices))
    sync = [task for task in t.tasks if "allreduce" in task.name]
    assert sync and all(task.resource >= t.num_devices for task in sync)
    ps = simulate(
        problem("chain_cnn", "p100-1x4", "ps").dnn().cost_model,
        data_parallel(p.dnn().graph, p.dnn().devices),
    )
    assert any("push" in task.name for task in ps.tasks)


def test_makespan_is_below_the_additive_cost_for_data_parallel() -> None:
    """Overlap can only help: the simulated step is at most the sum of Eq. 1's parts."""
    from planner.problems.evaluate import score_strategy

    for name in ("chain_cnn", "inception", "residual"):
        p = problem(name, "p100-1x4")
        s = data_parallel(p.dnn().graph, p.dnn().devices)
        assert (
            simulate(p.dnn().cost_model, s).makespan
            <= score_strategy(p.dnn().cost_model, s).total * 1.5
        )


CASES = [
    ("chain_cnn", "p100-1x4"),
    ("inception", "p100-2x4"),
    ("residual", "p100-1x4"),
    ("shared_steps", "p100-2x4"),
    ("attention_block", "p100-1x4"),
    ("lenet5", "p100-2x4"),
    ("inception_v3", "p100-1x4"),
    ("rnnlm", "p100-1x4"),
    ("transformer", "p100-1x2"),
    # Message overheads on the devices and batch-norm exchanges.
    ("chain_cnn", "cpu-local-4"),
    ("inception_v3", "cpu-local-2"),
    ("rnnlm", "cpu-local-2"),
]
# Inception-v3 (122 ops at this size) takes most of the time: slow. In the default run
# `inception` (branches, p100-2x4) and `chain_cnn` (batch norm, cpu-local-4) stand for it.
SLOW_CASES = {"inception_v3"}


@pytest.mark.parametrize(
    "name, preset",
    [pytest.param(*c, marks=pytest.mark.slow if c[0] in SLOW_CASES else ()) for c in CASES],
)
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sync=st.sampled_from(["ring", "ps"]))
def test_delta_equals_full_after_random_changes(
    name: str, preset: str, seed: int, sync: str
) -> None:
    p = problem(name, preset, sync)
    rng = np.random.default_rng(seed)
    start = [
        p.dnn().space[i].configs[int(rng.integers(len(p.dnn().space[i])))]
        for i in range(p.num_nodes)
    ]
    sim = Simulator(p.dnn().cost_model, start)
    for step in range(12):
        i = int(rng.integers(p.num_nodes))
        sim.change(i, p.dnn().space[i].configs[int(rng.integers(len(p.dnn().space[i])))])
        if step % 4 == 3:
            full = Simulator(p.dnn().cost_model, sim.configs)
            assert sim.timeline().by_key() == full.timeline().by_key()
            assert sim.makespan == full.makespan


def test_memory_is_reported_per_device() -> None:
    p = problem("chain_cnn", "p100-1x4")
    t = simulate(p.dnn().cost_model, _single_device(p, 1))
    assert t.memory[1] > 0 and t.memory[0] == t.memory[2] == t.memory[3] == 0


def test_chrome_trace_and_gantt(tmp_path) -> None:
    import json

    from planner.sim.trace import chrome_trace, save_chrome_trace, save_gantt

    p = problem("inception", "p100-2x4")
    t = simulate(p.dnn().cost_model, data_parallel(p.dnn().graph, p.dnn().devices))
    trace = chrome_trace(t)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans and max(e["ts"] + e["dur"] for e in spans) == pytest.approx(t.makespan * 1e6)
    assert {e["cat"] for e in spans} >= {"fwd", "bwd", "sync", "update"}
    save_chrome_trace(t, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    save_gantt(t, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_gantt_of_a_large_cluster_draws_its_busiest_rows() -> None:
    from planner.sim.simulator import TaskInfo, Timeline
    from planner.sim.trace import gantt_rows

    tasks = tuple(
        TaskInfo((0, r, 0, 0, 0, 0), f"fwd op{r} #0", r, 0.0, 1e-3 * (r % 7 + 1))
        for r in range(300)
    )
    timeline = Timeline(tasks, 7e-3, 300, tuple(map(str, range(300))), np.zeros(300))
    rows, bars, used = gantt_rows(timeline, limit=50)
    assert used == 300 and len(rows) == 50 and rows == sorted(rows)
    longest = [r for r in range(300) if r % 7 == 6]  # 42 resources busy 7 ms each
    assert set(longest) <= set(rows)
    assert sorted(set(rows) - set(longest)) == [r for r in range(300) if r % 7 == 5][:8]
    assert bars[6][("fwd", "")] == [(0.0, 7.0)]


def test_gantt_colours_by_op_kind_labels_the_longest_bars_and_has_a_legend() -> None:
    """Back-to-back ops of one kind are told apart by their labels; kinds by colour, forward
    and backward by hatch; the legend lists what is drawn."""
    from planner.sim.simulator import TaskInfo, Timeline
    from planner.sim.trace import gantt_labels, gantt_legend, gantt_rows, style_of

    spans = [
        ("fwd conv1 #0", 0, 0.0, 4.0),
        ("fwd conv2 #0", 0, 4.0, 8.0),  # the same kind, right after conv1
        ("fwd relu #0", 0, 8.0, 8.05),  # too short for a label
        ("bwd conv1 #0", 0, 8.05, 12.0),
        ("xfer conv1->conv2 0->1 hop 1", 2, 4.0, 5.0),
        ("xfer allreduce conv1 0->1 hop 1", 2, 11.0, 13.0),
    ]
    tasks = tuple(TaskInfo((0, 0, 0, 0, 0, 0), n, r, a / 1e3, b / 1e3) for n, r, a, b in spans)
    kinds = {"conv1": "conv2d", "conv2": "conv2d", "relu": "elementwise"}
    timeline = Timeline(tasks, 13e-3, 2, ("gpu0", "gpu1", "l01", "l10"), np.zeros(2), kinds)
    rows, bars, _ = gantt_rows(timeline)
    assert rows == [0, 2]
    assert bars[0][("fwd", "conv2d")] == [(0.0, 4.0), (4.0, 4.0)]
    (fwd, fwd_hatch), (bwd, bwd_hatch) = style_of(("fwd", "conv2d")), style_of(("bwd", "conv2d"))
    assert fwd == bwd and fwd_hatch != bwd_hatch
    assert style_of(("fwd", "elementwise"))[0] != fwd
    assert style_of(("xfer", ""))[0] != style_of(("sync", ""))[0]
    labels = gantt_labels(timeline, rows)
    assert (0, pytest.approx(2.0), "conv1") in labels and (0, pytest.approx(6.0), "conv2") in labels
    assert (1, pytest.approx(12.0), "allreduce conv1") in labels
    assert not any(text.startswith("relu") for _, _, text in labels)
    drawn = {s for r in rows for s in bars[r]}
    assert [label for label, _, _ in gantt_legend(drawn)] == [
        "conv2d",
        "elementwise",
        "forward",
        "backward",
        "transfer",
        "gradient sync",
    ]


def test_a_simulated_timeline_knows_its_op_kinds() -> None:
    p = problem("inception", "p100-1x4")
    graph = p.dnn().graph
    t = simulate(p.dnn().cost_model, data_parallel(graph, p.dnn().devices))
    assert dict(t.op_kinds) == {op.name: op.kind for op in graph.ops}


@pytest.mark.parametrize(
    "name, preset", [("shared_steps", "p100-2x4"), ("inception", "p100-1x4"), ("rnnlm", "p100-1x4")]
)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_changing_several_ops_at_once_equals_full(name: str, preset: str, seed: int) -> None:
    p = problem(name, preset)
    rng = np.random.default_rng(seed)
    sim = Simulator(p.dnn().cost_model, data_parallel(p.dnn().graph, p.dnn().devices).configs)
    for _ in range(4):
        ops = rng.choice(p.num_nodes, size=min(3, p.num_nodes), replace=False)
        changes = [
            (int(i), p.dnn().space[int(i)].configs[int(rng.integers(len(p.dnn().space[int(i)])))])
            for i in ops
        ]
        if rng.random() < 0.3:
            changes[0] = (changes[0][0], None)  # partial strategies too
        sim.change_many(changes)
        full = Simulator(p.dnn().cost_model, sim.configs)
        assert sim.timeline().by_key() == full.timeline().by_key()


def test_messages_occupy_cpu_workers() -> None:
    """On CPU workers (message_overhead > 0) every transfer has a send task on the sender
    right after its producer and a receive task on the receiver before its consumer, each as
    long as the device's overhead; GPUs have none."""
    p = problem("chain_cnn", "cpu-local-2")
    ovh = [d.message_overhead for d in p.dnn().devices.devices]
    assert min(ovh) > 0
    t = simulate(p.dnn().cost_model, model_parallel(p.dnn().graph, p.dnn().devices))
    sends = [x for x in t.tasks if x.name.startswith("send ")]
    recvs = [x for x in t.tasks if x.name.startswith("recv ")]
    hops = [x for x in t.tasks if x.name.startswith("xfer ") and "allreduce" not in x.name]
    assert sends and len(sends) == len(recvs) == len(hops)
    for task in sends + recvs:
        assert task.resource < t.num_devices
        assert task.end - task.start == pytest.approx(ovh[task.resource], rel=1e-12)
    gpu = problem("chain_cnn", "p100-1x4")
    names = [
        x.name
        for x in simulate(
            gpu.dnn().cost_model, model_parallel(gpu.dnn().graph, gpu.dnn().devices)
        ).tasks
    ]
    assert not any(n.startswith(("send ", "recv ")) for n in names)


def test_batch_norm_exchange_waits_for_every_member() -> None:
    """A sample-split batch norm: each device's statistics exchange starts when the slowest
    task of its group has finished (forward and backward), lasts `norm_exchange`, and the
    op's consumers start after it."""
    p = problem("chain_cnn", "cpu-local-2")
    g, cm = p.dnn().graph, p.dnn().cost_model
    bn = g.index("bn1")
    s = data_parallel(g, p.dnn().devices)
    sim = Simulator(cm, s.configs)
    exchange = cm.norm_exchange(bn, s.configs[bn])
    assert exchange is not None
    t = sim.timeline()
    by_name = {x.name: x for x in t.tasks}
    for phase, stats in (("fwd", "bn stats"), ("bwd", "bn grad stats")):
        ends = [by_name[f"{phase} bn1 #{k}"].end for k in range(2)]
        for k in range(2):
            task = by_name[f"{stats} bn1 #{k}"]
            assert task.start >= max(ends) - 1e-15
            assert task.end - task.start == pytest.approx(exchange[k], rel=1e-12)
    for k in range(2):
        assert by_name[f"fwd relu1 #{k}"].start >= by_name[f"bn stats bn1 #{k}"].end - 1e-15
    gpu = problem("chain_cnn", "p100-1x4")
    names = [
        x.name
        for x in simulate(
            gpu.dnn().cost_model, model_parallel(gpu.dnn().graph, gpu.dnn().devices)
        ).tasks
    ]
    assert not any("bn stats" in n for n in names)  # model parallelism: nothing shared


def test_a_split_batch_norm_waits_for_its_inputs() -> None:
    """The exchange task is where a split batch norm ends, not where it starts: its compute
    still waits for the activations (forward) and gradients (backward) sent to it."""
    p = problem("chain_cnn", "p100-1x4")
    g = p.dnn().graph
    conv, bn = g.index("conv1"), g.index("bn1")
    configs = [ParallelConfig((1,) * len(op.output.dims), (0,)) for op in g.ops]
    configs[bn] = ParallelConfig((2, 1, 1, 1), (1, 2))  # samples split over other devices
    timeline = simulate(p.dnn().cost_model, Strategy(g, p.dnn().devices, tuple(configs)))
    tasks = {t.name: t for t in timeline.tasks}
    conv_name, bn_name = g.ops[conv].name, g.ops[bn].name
    for k in range(2):
        arrive = max(
            t.end for t in timeline.tasks if t.name.startswith(f"xfer {conv_name}->{bn_name} ")
        )
        first = min(t.end for t in timeline.tasks if t.name.startswith(f"xfer {conv_name}->"))
        assert tasks[f"fwd {bn_name} #{k}"].start >= first - 1e-15
        assert tasks[f"bn stats {bn_name} #{k}"].start >= arrive - 1e-15
        grads_in = [
            t.end
            for t in timeline.tasks
            if t.name.startswith("xfer grad ") and f"->{bn_name} " in t.name
        ]
        assert grads_in and tasks[f"bwd {bn_name} #{k}"].start >= min(grads_in) - 1e-15


# -- at scale: sparse transfers, joins, packed keys --------------------------------------------


@cache
def scale_case(name: str, preset: str) -> tuple[CostModel, ConfigSpace]:
    """A cost model and config space without the cost tables (cheap at 32-64 devices)."""
    graph = chain_cnn(64) if name == "chain_cnn64" else GRAPHS[name]()
    devices = get_preset(preset)
    return CostModel(graph, devices), ConfigSpace(graph, devices)


SCALE_CASES = [
    ("chain_cnn64", "p100-4x4"),  # 16 devices over 4 nodes
    ("chain_cnn64", "k80-4x4"),  # 6-hop routes
    ("inception", "dgx-a100-2"),  # NVSwitch and a NIC per GPU
    ("residual", "cpu-local-4"),  # message overheads
]


@pytest.mark.parametrize("name, preset", SCALE_CASES)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_delta_equals_full_on_larger_clusters(name: str, preset: str, seed: int) -> None:
    """Random changes, several at once and partial strategies, from data parallelism (whose
    batch-norm and all-reduce groups span every device): every timeline equals a full
    simulation's."""
    cm, space = scale_case(name, preset)
    rng = np.random.default_rng(seed)
    sim = Simulator(cm, data_parallel(cm.graph, cm.devices).configs)
    n = len(cm.graph.ops)
    for _ in range(5):
        ops = rng.choice(n, size=int(rng.integers(1, 3)), replace=False)
        changes = [
            (int(i), space[int(i)].configs[int(rng.integers(len(space[int(i)])))]) for i in ops
        ]
        if rng.random() < 0.2:
            changes[0] = (changes[0][0], None)
        sim.change_many(changes)
        full = Simulator(cm, sim.configs)
        assert sim.timeline().by_key() == full.timeline().by_key()
        assert sim.makespan == full.makespan


@st.composite
def edge_configs(draw: st.DrawFn) -> tuple:
    from planner.costs.config import partitions

    name = draw(st.sampled_from(["inception", "residual", "attention_block", "chain_cnn"]))
    graph = GRAPHS[name]()
    edge = draw(st.sampled_from(graph.edges))
    devices = draw(st.sampled_from([4, 8, 16]))
    cu = draw(st.sampled_from(partitions(graph.ops[edge.src], devices)))
    cv = draw(st.sampled_from(partitions(graph.ops[edge.dst], devices)))
    return graph, edge, cu, cv


@settings(max_examples=150, deadline=None)
@given(edge_configs())
def test_transfer_pairs_are_the_nonzero_region_overlaps(case: tuple) -> None:
    from planner.costs.regions import edge_grid, needed_boxes, overlap_volume, task_boxes
    from planner.sim.transfers import transfer_pairs

    graph, edge, cu, cv = case  # task grids: a contraction degree last, when split
    src, dst = graph.ops[edge.src], graph.ops[edge.dst]
    ru = cu[-1] if len(cu) > len(src.output.dims) else 1
    rv = cv[-1] if len(cv) > len(dst.output.dims) else 1
    grid = edge_grid(src, dst, edge.position, graph.input_maps(edge), ru, rv)
    plo, phi = task_boxes(grid.in_sizes, np.array([cu]), int(np.prod(cu)))
    olo, ohi = task_boxes(grid.out_sizes, np.array([cv]), int(np.prod(cv)))
    nlo, nhi = needed_boxes(grid.maps, grid.in_sizes, grid.out_dims, olo, ohi)
    dense = overlap_volume(plo, phi, nlo, nhi)[0, :, 0, :]
    p, q, vol = transfer_pairs(grid.maps, grid.in_sizes, cu, grid.out_sizes, grid.out_dims, cv)
    want_p, want_q = np.nonzero(dense)
    assert np.array_equal(p, want_p) and np.array_equal(q, want_q)
    assert np.array_equal(vol, dense[want_p, want_q])


def test_dependencies_grow_with_the_tasks_not_their_square() -> None:
    """Data parallelism on 64 devices: a batch norm's exchange and an all-reduce wait for a
    join of their group, not for each of its 64 members."""
    cm, _ = scale_case("chain_cnn64", "p100-16x4")
    sim = Simulator(cm, data_parallel(cm.graph, cm.devices).configs)
    tg = sim.tasks
    dependencies = sum(len(tg.preds[t]) for t in tg.order)
    assert sim.num_tasks > 64 * 2 * len(cm.graph.ops)
    assert dependencies < 3 * len(tg.order)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 2**24 - 1),
            st.integers(-1, 4),
            st.integers(0, 2**22),
            st.integers(0, 2**39),
            st.integers(-1, 2**12),
        ),
        min_size=2,
        max_size=20,
    )
)
def test_packed_keys_order_like_the_tuples(keys: list) -> None:
    from planner.sim.tasks import pack, unpack

    assert sorted(keys) == sorted(keys, key=lambda k: pack(*k))
    assert all(unpack(pack(*k)) == k for k in keys)


def test_sixteen_parameter_shards_keep_their_updates_in_program_order() -> None:
    """Regression: with 16 or more parameter shards an update task's key overflowed into the
    op field, so two ops' updates shared a key (no program order): delta simulation lost
    track of a task and crashed (IndexError), full simulation could order tasks wrongly.
    Every linear of alexnet split 16 ways by channel on 16 GPUs, reached by delta steps."""
    p = problem("alexnet", "p100-4x4")
    configs = list(data_parallel(p.dnn().graph, p.dnn().devices).configs)
    sim = Simulator(p.dnn().cost_model, configs)
    split = []
    for i, op in enumerate(p.dnn().graph.ops):
        if op.kind != "linear":
            continue
        wide = [
            c
            for c in p.dnn().space[i].configs
            if len(p.dnn().cost_model.replica_groups(op, c)) >= 16
        ]
        if not wide:
            continue  # e.g. 1,000 classes do not split 16 ways
        configs[i] = wide[0]
        split.append(i)
        sim.change(i, wide[0])
    assert len(split) >= 2
    keys = sim.tasks.order_keys
    assert len(set(keys)) == len(keys)
    assert sim.makespan == Simulator(p.dnn().cost_model, configs).makespan
