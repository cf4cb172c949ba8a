"""Context parallelism in the published-layout rule (`planner.problems.baselines.megatron`
with `context`): the layout, the key/value exchange the simulator prices and overlaps
(`CostOptions.cp_overlap`), the gradient sync over data x context replicas, and attention's
kernels on sequence chunks (docs/space.md, "Context parallelism in the published layouts")."""

from __future__ import annotations

import pytest

from planner.costs.costmodel import CostModel, CostOptions
from planner.costs.rates import ATTENTION_KERNELS, attention_seconds
from planner.errors import LayerwiseError
from planner.graph.capture import capture
from planner.graph.coarsen import coarsen
from planner.graph.llm import build_llm
from planner.graph.opgraph import OpGraph
from planner.graph.opkinds import CHANNEL, LENGTH, SAMPLE
from planner.hardware.presets import get_preset
from planner.problems.baselines import megatron
from planner.sim.simulator import Simulator

BATCH, SEQ, DIM, HEADS, KV_HEADS = 4, 256, 256, 4, 2
BATCH_LONG, PRESET_LONG = 2, "dgx-h100-1"


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    module, inputs = build_llm(
        "llama3-8b", dtype="bfloat16", batch=BATCH, seq=SEQ, n_layers=2, dim=DIM,
        n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=512, vocab_size=512, max_seq_len=SEQ,
    )  # fmt: skip
    return coarsen(capture(module, inputs, "tiny"))


def attention_of(graph: OpGraph) -> int:
    return next(i for i, op in enumerate(graph.ops) if op.kind == "attention")


def test_every_op_splits_its_sequence_over_context_ranks_inside_data_outside_tensor(
    graph: OpGraph,
) -> None:
    devices = get_preset("dgx-h100-1")
    s = megatron(graph, devices, tensor=2, context=2)  # data 2
    for op, cfg in zip(graph.ops, s.configs, strict=True):
        degree = dict(zip(op.output.dims, cfg.degrees, strict=True))
        assert degree[SAMPLE] == 2
        split = degree.get(CHANNEL, 1) * cfg.reduce  # tensor parallel, else sequence parallel
        assert degree[LENGTH] == (2 if split == 2 else 4), op.name
    a = attention_of(graph)
    att = s.configs[a]
    assert att.degrees == (2, 2, 2) and att.devices == tuple(range(8))
    # task (sample s, chunk l, heads h) on device 4 s + 2 l + h: tensor, context, data
    assert att.devices[att.num_tasks - 1] == 7
    with pytest.raises(LayerwiseError, match="context-parallel size 3"):
        megatron(graph, devices, tensor=1, context=3)


def test_keys_and_values_arrive_from_the_other_context_ranks(graph: OpGraph) -> None:
    """Each attention task reads its heads' keys over the whole sequence: (c - 1) / c of them
    from the other context ranks, one message each, and their gradients go back the same
    way: t_x = 2 (c - 1) (bytes / bandwidth + latency)."""
    devices = get_preset("dgx-h100-1")
    c = 4
    s = megatron(graph, devices, tensor=1, context=c)  # data 2
    cm = CostModel(graph, devices)
    a = attention_of(graph)
    k_edge = next(e for e in graph.edges if e.dst == a and e.position == 1)
    per_rank = (BATCH // 2) * (SEQ // c) * (DIM // HEADS * KV_HEADS) * 2  # bytes of a chunk
    inv, fixed = cm.pair_costs(0, 1)
    expected = 2 * (c - 1) * (per_rank * float(inv) + float(fixed))
    got = cm.transfer_time(k_edge, s.configs[k_edge.src], s.configs[a])
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_ring_receives_keys_and_values_again_in_the_backward(graph: OpGraph) -> None:
    devices = get_preset("dgx-h100-1")
    s = megatron(graph, devices, tensor=1, context=2)
    names = [t.name for t in Simulator(CostModel(graph, devices), s.configs).timeline().tasks]
    again = [n for n in names if n.startswith("xfer again")]
    assert again and all(".wk->" in n or ".wv->" in n for n in again)
    plain = megatron(graph, devices, tensor=2)  # no context parallelism: nothing again
    names = [t.name for t in Simulator(CostModel(graph, devices), plain.configs).timeline().tasks]
    assert not any(n.startswith("xfer again") for n in names)


def test_cp_overlap_hides_the_exchange_under_attention(graph: OpGraph) -> None:
    devices = get_preset("dgx-h100-2")  # the context ranks on two nodes: a slow ring
    s = megatron(graph, devices, tensor=4, context=2)  # data 2; context pairs cross nodes
    steps = [
        Simulator(CostModel(graph, devices, CostOptions(cp_overlap=f)), s.configs).makespan
        for f in (0.0, 1.0)
    ]
    assert steps[1] < steps[0]
    node = get_preset("dgx-h100-1")
    plain = megatron(graph, node, tensor=2)  # attention split by heads
    both = [
        Simulator(CostModel(graph, node, CostOptions(cp_overlap=f)), plain.configs).makespan
        for f in (0.0, 1.0)
    ]
    assert both[0] == both[1]  # without context parallelism it changes nothing


def test_weights_sync_over_data_times_context_replicas(graph: OpGraph) -> None:
    devices = get_preset("dgx-h100-1")
    s = megatron(graph, devices, tensor=2, context=2)
    cm = CostModel(graph, devices)
    wq = graph.index("layers.0.attention.wq")
    groups = cm.replica_groups(graph.ops[wq], s.configs[wq])
    assert sorted(map(sorted, groups)) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_attention_on_chunks_runs_its_own_block_causal_and_the_others_full() -> None:
    cudnn = ATTENTION_KERNELS["cudnn"]
    flops = 4.0 * 8192**2 * 4096
    whole = attention_seconds(cudnn, flops, 8192, causal=True)
    assert whole == attention_seconds(cudnn, flops, 8192, causal=True, chunks=1)
    fwd, _ = attention_seconds(cudnn, flops / 2, 8192, causal=True, chunks=2)
    causal, full = cudnn.rates(4096, True)[0], cudnn.rates(4096, False)[0]
    work = flops / 2 * 0.5  # a rank's half of the causal product
    assert fwd == pytest.approx(work / 2 / causal + work / 2 / full)


def test_a_micro_batch_that_syncs_nothing_keeps_its_backward_clean(graph: OpGraph) -> None:
    """`experiments.calibration.micro_batch_times`: the forward and backward of every
    micro-batch without the gradient sync beside it, the sync what the last one takes
    beyond them (the same step for the last micro-batch)."""
    from experiments.calibration import micro_batch_times
    from planner.pipeline.spec import Pipeline, PipelinedStrategy
    from planner.pipeline.stages import chunk_times
    from planner.problems.strategy import Strategy

    devices = get_preset("dgx-h100-2")
    s = megatron(graph, devices, tensor=4, context=2)  # context pairs on two nodes
    pipe = Pipeline((0, len(graph.ops)), (tuple(range(16)),), 1, "1f1b")
    ps = PipelinedStrategy(Strategy(graph, devices, s.configs), pipe)
    cm = CostModel(graph, devices, CostOptions(dp_overlap=1.0))
    (full,) = chunk_times(cm, ps)
    (clean,) = micro_batch_times(cm, ps)
    (after,) = chunk_times(CostModel(graph, devices, CostOptions(dp_overlap=0.0)), ps)
    assert (clean.forward, clean.backward) == (after.forward, after.backward)
    total = full.forward + full.backward + full.sync
    assert clean.forward + clean.backward + clean.sync == pytest.approx(total)
    assert clean.backward < full.backward  # the sync delayed the keys and values


def test_contiguous_causal_chunks_do_unequal_work_and_the_balanced_order_equal() -> None:
    from planner.costs.context import balanced_positions, chunk_work

    assert list(balanced_positions(8, 2)) == [0, 1, 6, 7, 2, 3, 4, 5]
    assert list(chunk_work(256, 4, "contiguous")) == [0.25, 0.75, 1.25, 1.75]
    assert list(chunk_work(256, 4, "balanced")) == [1.0] * 4
    assert list(chunk_work(12, 4, "balanced")) == [0.25, 0.75, 1.25, 1.75]  # 8 does not divide


def test_the_cost_model_prices_contiguous_chunks_by_their_work(graph: OpGraph) -> None:
    devices = get_preset("dgx-h100-1")
    s = megatron(graph, devices, tensor=1, context=4)  # data 2: tasks (sample, chunk)
    a = attention_of(graph)
    times = {
        order: CostModel(graph, devices, CostOptions(cp_order=order)).task_times(a, s.configs[a])
        for order in ("balanced", "contiguous")
    }
    assert len(set(times["balanced"][0])) == 1
    contiguous = times["contiguous"][0]
    assert list(contiguous[:4]) == sorted(contiguous[:4]) and contiguous[3] > contiguous[0]
    assert list(contiguous[4:]) == list(contiguous[:4])  # the other replica alike
    assert max(contiguous) > times["balanced"][0][0]


@pytest.mark.parametrize(
    ("field", "value"), [("cp_order", "zigzag"), ("cp_exchange", "p2p"), ("cp_order", None)]
)
def test_context_options_are_checked(field: str, value: object) -> None:
    with pytest.raises(LayerwiseError, match=field):
        CostOptions(**{field: value})  # type: ignore[arg-type]


def test_a_ring_hides_its_steps_under_one_block_each_and_the_gather_under_all(
    graph: OpGraph,
) -> None:
    """Ring attention passes one chunk per step under one of c blocks of the kernel, so
    it hides less than a gather that may run under the whole kernel; with nothing
    overlapped both are the same exposed exchange."""
    devices = get_preset("dgx-h100-2")
    s = megatron(graph, devices, tensor=4, context=2)  # context pairs cross nodes

    def step(overlap: float, exchange: str) -> float:
        options = CostOptions(cp_overlap=overlap, cp_exchange=exchange)  # type: ignore[arg-type]
        return Simulator(CostModel(graph, devices, options), s.configs).makespan

    assert step(0.0, "ring") == step(0.0, "all-gather")
    assert step(1.0, "all-gather") < step(1.0, "ring") < step(0.0, "ring")


def _long_context_search(seq: int, **settings: object) -> tuple[int, int, float]:
    """The pipeline search's (context, tensor, step) for a 2-block Llama 3 8B-wide model at
    `seq` tokens, 2 sequences, on one DGX H100 (one stage, no recomputation or ZeRO)."""
    from backends.pipeline.search import PipelineSearch
    from planner.pipeline.problem import PipelineProblem
    from planner.result import SolveOptions

    module, inputs = build_llm(
        "llama3-8b", dtype="bfloat16", batch=BATCH_LONG, seq=seq, n_layers=2, max_seq_len=seq
    )
    graph = capture(module, inputs, "llama3-8b-2")
    options = CostOptions(optimizer="adam", master_weights=True)
    problem = PipelineProblem(graph, get_preset(PRESET_LONG), options)
    extra = {"stages": (1,), "recompute": "none", "zero": 0, "inner": "rule", "schedules": "1f1b"}
    result = PipelineSearch().solve(problem, SolveOptions(extra=extra | settings, time_limit=60))
    assert result.layout is not None, result.message
    return result.layout.context, result.layout.tensor, result.objective


def test_the_pipeline_search_splits_a_long_sequence_over_context_ranks() -> None:
    # 128K tokens: a replica's activations fit only split over sequence chunks; at 4K data
    # parallelism over the 2 sequences is cheaper
    long, short = _long_context_search(131072), _long_context_search(4096)
    assert long[0] > 1 and short[0] == 1, (long, short)
    without = _long_context_search(131072, context=(1,))  # chosen by cost: slower without
    assert without[0] == 1 and without[2] > long[2]
