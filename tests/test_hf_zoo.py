"""Hugging Face models by name (planner/graph/hf_zoo.py): the shipped configs build the
published models (their parameter counts), overrides apply, bad names and fields are one
error line, `hf:NAME` plans through the command line, and its plan file rebuilds the same
module in another process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from planner.cli import main  # noqa: E402
from planner.errors import LayerwiseError  # noqa: E402
from planner.graph.capture import capture  # noqa: E402
from planner.graph.hf import HFRoot  # noqa: E402
from planner.graph.hf_zoo import (  # noqa: E402
    CONFIG_DIR,
    _shipped,
    build_hf,
    canonical_name,
    hf_config,
    hf_model,
    shipped_names,
)
from planner.graph.models import ModelSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The published parameter counts: the Hub's safetensors metadata ("Model size" / parameter
# count of each checkpoint's page), exact. Sources as checked: GPT-2 124,439,808 and
# Llama-2-7b 6,738,415,616 (nanoGPT and PEFT's print_trainable_parameters of these
# checkpoints), Llama-3.1-8B 8,030,261,248, Mistral-7B-v0.1 7,241,732,096, v0.3 7,248,023,552,
# Qwen2-7B 7,615,616,512 (the Qwen2/2.5-7B architecture, "7.62B"), Qwen3-8B 8,190,735,360,
# Gemma-2-9b 9,241,705,984, Gemma-3-1b 999,885,952 (KerasHub's summary of the same
# checkpoint), Phi-3-mini-4k 3,821,079,552, Mixtral-8x7B 46,702,792,704 ("46.7B" on its card),
# Qwen1.5-MoE-A2.7B 14,315,784,192 ("14.3B" on its card), Qwen3-30B-A3B 30,532,122,624.
PUBLISHED = {
    "openai-community/gpt2": 124_439_808,
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "mistralai/Mistral-7B-v0.3": 7_248_023_552,
    "Qwen/Qwen2-7B": 7_615_616_512,
    "Qwen/Qwen3-8B": 8_190_735_360,
    "google/gemma-2-9b": 9_241_705_984,
    "google/gemma-3-1b-pt": 999_885_952,
    "microsoft/Phi-3-mini-4k-instruct": 3_821_079_552,
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen/Qwen1.5-MoE-A2.7B": 14_315_784_192,
    "Qwen/Qwen3-30B-A3B": 30_532_122_624,
}

# 2 layers, width 64, 4 heads, vocabulary 512: the shapes of the fast tests
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
TINY_OF = {
    "openai-community/gpt2": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 512,
    },
    "google/gemma-2-9b": {**TINY, "head_dim": 16},
    "google/gemma-3-1b-pt": {**TINY, "head_dim": 16},
    "Qwen/Qwen3-8B": {**TINY, "head_dim": 16},
    "mistralai/Mixtral-8x7B-v0.1": {**TINY, "num_local_experts": 4},
    "Qwen/Qwen1.5-MoE-A2.7B": {
        **TINY,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "Qwen/Qwen3-30B-A3B": {
        **TINY,
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
}
# The 7-8B configs (and Phi-3-mini, 3.8B), captured full size on meta at batch 1 x seq 4096
# (slow); Phi-3's sliding window of 2047 then hides more than the causal mask (attr window).
FULL_SIZE = [
    ("meta-llama/Llama-2-7b-hf", 4096),
    ("meta-llama/Llama-3.1-8B", 4096),
    ("mistralai/Mistral-7B-v0.1", 4096),
    ("Qwen/Qwen2-7B", 4096),
    ("Qwen/Qwen3-8B", 4096),
    ("microsoft/Phi-3-mini-4k-instruct", 4096),
]


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied weight counted once


def one_line_error(call: Any, *match: str) -> str:
    with pytest.raises(LayerwiseError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for text in match:
        assert text in message, message
    return message


# -- the shipped configs ------------------------------------------------------------------


def test_every_shipped_config_has_its_published_count_here() -> None:
    assert sorted(shipped_names()) == sorted(PUBLISHED)
    for path in CONFIG_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        assert data["model_type"] and data["architectures"], path.name


@pytest.mark.parametrize("hub_id", list(PUBLISHED))
def test_a_shipped_config_builds_the_published_model_on_meta(hub_id: str) -> None:
    model = hf_model(hub_id)
    assert parameters(model) == PUBLISHED[hub_id]
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.config.use_cache is False and model.training
    architecture = _shipped()[hub_id]["architectures"][0]
    assert type(model).__name__ == architecture


def test_names_take_any_case_with_or_without_the_org() -> None:
    for name in (
        "hf:meta-llama/Llama-3.1-8B",
        "hf:llama-3.1-8b",
        "hf:META-LLAMA/LLAMA-3.1-8B",
        "meta-llama/Llama-3.1-8B",
    ):
        assert canonical_name(name) == "hf:meta-llama/Llama-3.1-8B"
    assert canonical_name("hf:gpt2") == "hf:openai-community/gpt2"


def test_a_config_json_path_or_its_folder_builds_that_config(tmp_path: Path) -> None:
    data = json.loads((CONFIG_DIR / "qwen2-7b.json").read_text())
    data.pop("_name_or_path")
    data.update(TINY, torch_dtype="bfloat16", transformers_version="4.41.2", use_cache=True)
    (tmp_path / "config.json").write_text(json.dumps(data))
    for given in (str(tmp_path / "config.json"), str(tmp_path)):
        assert canonical_name("hf:" + given) == f"hf:{tmp_path.resolve() / 'config.json'}"
        model = hf_model("hf:" + given)
        assert type(model).__name__ == "Qwen2ForCausalLM"
        assert model.config.num_hidden_layers == 2 and model.config.use_cache is False
        assert next(model.parameters()).dtype == torch.float32  # the dtype option, not the file's


# -- overrides ----------------------------------------------------------------------------


def test_overrides_apply_and_give_the_count_by_hand() -> None:
    model = hf_model("hf:llama-3.1-8b", **TINY)
    h, f, v, kv = 64, 128, 512, 2 * 16  # head dim 16: 2 key/value heads are 32 wide
    block = h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; 2 norms
    assert parameters(model) == 2 * v * h + 2 * block + h  # embedding and head untied
    assert model.config.rope_parameters["rope_type"] == "llama3"  # the published rest stays


def test_a_familys_aliases_set_its_own_fields() -> None:
    config = hf_config("gpt2", num_hidden_layers=3, hidden_size=96, num_attention_heads=4)
    assert (config.n_layer, config.n_embd, config.n_head) == (3, 96, 4)


def test_a_smaller_vocabulary_drops_token_ids_beyond_it() -> None:
    # Phi-3's padding id 32000 would be an embedding row past a table of 512
    model = hf_model("microsoft/Phi-3-mini-4k-instruct", **TINY)
    assert model.config.pad_token_id is None and model.config.bos_token_id == 1
    kept = hf_config("microsoft/Phi-3-mini-4k-instruct", **TINY, pad_token_id=3)
    assert kept.pad_token_id == 3


def test_the_zoos_module_is_the_model_seen_as_input_ids_to_logits() -> None:
    module, (tokens,) = build_hf("hf:mistral-7b-v0.1", device="cpu", batch=2, seq=8, **TINY)
    assert isinstance(module, HFRoot) and type(module.hf_model).__name__ == "MistralForCausalLM"
    assert dict(module.named_parameters()).keys() == dict(module.hf_model.named_parameters()).keys()
    logits = module(tokens)
    assert logits.shape == (2, 8, 512)
    assert torch.equal(logits, module.hf_model(input_ids=tokens).logits)


def test_batch_seq_and_dtype_shape_the_example_and_the_weights() -> None:
    model, (tokens,) = build_hf("hf:qwen3-8b", batch=2, seq=16, dtype="bfloat16", **TINY)
    assert tokens.shape == (2, 16) and tokens.dtype == torch.long
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _, (default,) = build_hf("hf:gpt2", **TINY_OF["openai-community/gpt2"])
    assert default.shape == (8, 1024)  # batch 8, seq min(2048, GPT-2's 1024 positions)
    _, (cpu,) = build_hf("hf:gpt2", device="cpu", batch=2, seq=8, vocab_size=512, n_layer=1)
    assert int(cpu.min()) >= 0 and int(cpu.max()) < 512


# -- one-line errors ----------------------------------------------------------------------


def test_an_unknown_name_lists_the_shipped_ones() -> None:
    one_line_error(
        lambda: canonical_name("hf:llama-9"),
        "'hf:llama-9'",
        "meta-llama/Llama-3.1-8B",
        "config.json",
    )


def test_an_unknown_field_names_the_nearby_ones() -> None:
    one_line_error(
        lambda: hf_model("llama-3.1-8b", num_hiden_layers=2),
        "'num_hiden_layers'",
        "LlamaConfig",
        "did you mean num_hidden_layers",
        "batch, seq, dtype",
    )


def test_invalid_values_are_transformers_checks_in_one_line() -> None:
    one_line_error(
        lambda: hf_model("llama-3.1-8b", hidden_size=64, num_attention_heads=3),
        "hidden_size=64",
        "not a multiple of the number of attention heads",
    )
    one_line_error(lambda: hf_model("qwen2-7b", hidden_size="wide"), "hidden_size", "int")
    one_line_error(lambda: hf_model("qwen2-7b", num_hidden_layers=0), "at least 1, got 0")
    one_line_error(lambda: hf_model("qwen2-7b", dtype="int8"), "float32, bfloat16, float16")
    one_line_error(lambda: hf_model("qwen2-7b", use_cache=True), "'use_cache'", "always off")


def test_a_sequence_beyond_the_positions_and_a_bad_batch_are_refused() -> None:
    one_line_error(
        lambda: build_hf("hf:gpt2", seq=2048), "seq 2048", "max_position_embeddings 1024"
    )
    one_line_error(lambda: build_hf("hf:gpt2", batch=0), "batch must be a positive integer")


def test_a_config_without_model_type_and_an_unknown_family_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"hidden_size": 64}))
    one_line_error(lambda: hf_model(str(tmp_path / "a.json")), 'no "model_type"')
    (tmp_path / "b.json").write_text(json.dumps({"model_type": "no-such-family"}))
    one_line_error(lambda: hf_model(str(tmp_path / "b.json")), "no model_type 'no-such-family'")


def test_without_transformers_the_error_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    one_line_error(lambda: hf_model("gpt2"), "pip install 'layerwise[hf]'")


# -- capture ------------------------------------------------------------------------------


def _tiny(hub_id: str) -> dict[str, Any]:
    return TINY_OF.get(hub_id, TINY)


@pytest.mark.parametrize("hub_id", PUBLISHED)
def test_a_tiny_model_of_each_family_captures_with_its_parameters(hub_id: str) -> None:
    model, tokens = build_hf("hf:" + hub_id, batch=2, seq=16, **_tiny(hub_id))
    graph = capture(model, tokens, "hf:" + hub_id)
    counted = {p.name: math.prod(p.shape) for op in graph.ops for p in op.params}
    assert sum(counted.values()) == parameters(model)
    assert len([op for op in graph.ops if op.kind == "attention"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize(("hub_id", "seq"), FULL_SIZE)
def test_a_7_to_8b_config_captures_full_size_on_meta(hub_id: str, seq: int) -> None:
    model, tokens = build_hf("hf:" + hub_id, batch=1, seq=seq)
    graph = capture(model, tokens, "hf:" + hub_id)
    counted = {p.name: math.prod(p.shape) for op in graph.ops for p in op.params}
    assert sum(counted.values()) == PUBLISHED[hub_id]
    attention = [op for op in graph.ops if op.kind == "attention"]
    assert len(attention) == model.hf_model.config.num_hidden_layers


@pytest.mark.benchmark
@pytest.mark.parametrize(("hub_id", "seq"), FULL_SIZE)
def test_capture_speed_of_the_7_to_8b_configs(benchmark, hub_id: str, seq: int) -> None:  # type: ignore[no-untyped-def]
    """Measures issue 40's target, a capture on meta in 15 s or less (batch 1, sequence
    4,096, the build on meta included): seconds are read off the benchmark's table, never
    asserted."""

    def build_and_capture() -> Any:
        model, tokens = build_hf("hf:" + hub_id, batch=1, seq=seq)
        return capture(model, tokens, "hf:" + hub_id)

    graph = benchmark.pedantic(build_and_capture, rounds=1, iterations=1)
    attention = [op for op in graph.ops if op.kind == "attention"]
    assert len(attention) > 0


# -- the command line and the plan file ---------------------------------------------------

TINY_SETS = [f"--set={k}={v}" for k, v in TINY.items()]


def test_the_hf_form_plans_a_tiny_llama_on_cpu_local_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "hf:meta-llama/Llama-3.1-8B", *TINY_SETS, "--set", "seq=16", "--batch", "4"]
    code = main([*argv, "--devices", "cpu-local-2", "--backend", "elimination", "-o", str(out)])
    _, err = capsys.readouterr()
    assert code == 0, err
    recorded = json.loads(out.read_text())["graph"]["model"]
    assert recorded["name"] == "hf:meta-llama/Llama-3.1-8B" and recorded["batch"] == 4
    assert recorded["kwargs"] == {**TINY, "seq": 16}
    spec = ModelSpec.from_json(recorded)
    assert spec is not None
    planned = json.loads(out.read_text())["graph"]["fingerprint"]
    assert spec.graph().fingerprint() == planned


def test_the_hf_form_with_a_bad_field_is_one_error_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["graph", "hf:llama-3.1-8b", "--set", "num_layers=2", "--summary"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and "num_hidden_layers" in err
    code = main(["graph", "hf:no-such-model", "--summary"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "Qwen/Qwen3-8B" in err


def test_plan_takes_an_hf_config_path_and_records_it_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import planner

    data = json.loads((CONFIG_DIR / "mistral-7b-v0.1.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(data))
    monkeypatch.chdir(tmp_path)
    kwargs = {**TINY, "seq": 16, "batch": 2}
    result = planner.plan(
        "hf:config.json", "cpu-local-2", model_kwargs=kwargs, backend="elimination"
    )
    assert result.model is not None and result.strategy is not None
    assert result.model.name == f"hf:{tmp_path.resolve() / 'config.json'}"
    assert result.model.batch == 2 and dict(result.model.kwargs) == {**TINY, "seq": 16}
    assert planner.hf_model("hf:config.json", **TINY).config.sliding_window == 4096


def test_a_spec_rebuilds_the_same_module_for_the_same_seed() -> None:
    spec = ModelSpec("hf:meta-llama/Llama-3.1-8B", 2, {**TINY, "seq": 16})
    again = ModelSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec
    one, two = spec.build(0, torch.float64), again.build(0, torch.float64)
    ours, theirs = one.state_dict(), two.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    other = spec.build(1, torch.float64)
    assert not torch.equal(one.lm_head.weight, other.lm_head.weight)


REBUILD = """
import json, sys, torch
from planner.graph.models import ModelSpec
spec = ModelSpec.from_json(json.loads(sys.argv[1]))
torch.save(spec.build(0, torch.float64).state_dict(), sys.argv[2])
print(spec.graph().fingerprint())
"""


@pytest.mark.slow
def test_another_process_rebuilds_the_same_module_and_graph(tmp_path: Path) -> None:
    spec = ModelSpec("hf:Qwen/Qwen3-8B", 2, {**TINY, "head_dim": 16, "seq": 16})
    proc = subprocess.run(
        [sys.executable, "-c", REBUILD, json.dumps(spec.to_json()), str(tmp_path / "s.pt")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == spec.graph().fingerprint()
    theirs = torch.load(tmp_path / "s.pt")
    ours = spec.build(0, torch.float64).state_dict()
    assert list(theirs) == list(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)


@pytest.mark.slow
def test_the_runtime_trains_the_recorded_model_at_world_2_as_one_process(tmp_path: Path) -> None:
    import runtime
    from planner.problems.strategy import load_strategy

    out = tmp_path / "plan.json"
    argv = ["plan", "hf:llama-3.1-8b", *TINY_SETS, "--set", "seq=16", "--batch", "4"]
    assert (
        main([*argv, "--devices", "cpu-local-2", "--backend", "elimination", "-o", str(out)]) == 0
    )
    strategy, data = load_strategy(out)
    spec = ModelSpec.from_json(data["graph"]["model"])
    options = runtime.RunOptions(steps=2, dtype="float64", lr=0.1, check=True, timeout=120)
    run = runtime.run_strategy(strategy, spec, options)
    assert run.deviation is not None and run.deviation["max_deviation"] <= 1e-9, run.deviation
