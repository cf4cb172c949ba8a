"""Every command that README.md and docs/*.md show in a code block is classified here and run
as documented: `fast` ones by default, `slow` ones under `-m slow`, `skip` ones never (with
the reason). A documented command missing from the table fails the test, so a new one must
be classified. Where the doc states a result beside the command (a layout, a count, a
status), the table holds that text as `claim`: it must stand in the doc near the command and
in the command's output (the layout and the counts, never a time).

Commands run in a temporary directory, a doc's in its order (a command reads the files the
doc's earlier commands wrote), with the repository on PYTHONPATH, measurements cached in the
temporary directory (LAYERWISE_CACHE_DIR), and measuring allowed whatever the load
(LAYERWISE_MAX_LOAD=inf: the test machine is shared; the docs say measuring is refused when
it is busy)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from docs_commands import (
    DOCS,
    SHELL_LANGUAGES,
    Command,
    blocks,
    commands,
    doc_text,
    normalized,
    run,
)

FAST_TIMEOUT = 120.0  # seconds; a fast command takes a few, more on a loaded machine
SLOW_TIMEOUT = 1200.0


@dataclass(frozen=True)
class Run:
    """How the tests treat a documented command: `kind` fast, slow or skip (`why` says why),
    the `claim` the doc makes beside it, and for a slow command the earlier slow commands of
    its doc (`after`, their text) whose files it reads."""

    kind: str
    why: str = ""
    claim: str = ""
    after: tuple[str, ...] = ()


def fast(claim: str = "") -> Run:
    return Run("fast", claim=claim)


def slow(claim: str = "", after: tuple[str, ...] = ()) -> Run:
    return Run("slow", claim=claim, after=after)


def skip(why: str) -> Run:
    return Run("skip", why=why)


PLACEHOLDER = "its arguments are placeholders (the reader's files)"
GUIDE = "run by tests/test_guide.py (slow), with the files the guide's Python blocks make"
LLAMA_70B = (
    "python -m planner plan llama2-70b --devices dgx-a100-80g-128 --set batch=1024 "
    "--set dtype=bfloat16 --optimizer adam --master-weights --time-limit 600 -o plan.json"
)
VGG16_JSON = "python -m planner graph vgg16 --batch 32 --json vgg16.json"
PP_PLAN = (
    "python -m planner plan gpt2 --batch 8 --set n_layer=4 --set n_embd=64 --set n_head=4 "
    "--set seq=64 --set block_size=64 --set vocab_size=512 --devices p100-2x2 --pipeline on "
    "-o pp.json"
)
GEMMA_PLAN = (
    "python -m planner plan hf:google/gemma-2-9b --set num_hidden_layers=2 --set hidden_size=256 "
    "--set intermediate_size=512 --set num_attention_heads=4 --set num_key_value_heads=2 "
    "--set head_dim=64 --set query_pre_attn_scalar=64 --set vocab_size=1024 "
    "--set sliding_window=64 --set seq=128 --batch 64 --devices p100-1x4 -o gemma.json"
)
HF_FACTORY_PLAN = (
    "python -m planner plan hfmodels:llama --input 4x16:int64 --devices cpu-local-2 -o hf.json"
)
RUNTIME_PLAN = (
    "python -m planner plan alexnet --batch 8 --set num_classes=100 --devices cpu-local-2 "
    "--backend elimination -o plan.json"
)

HF_TINY = (
    "--set num_hidden_layers=2 --set hidden_size=64 --set intermediate_size=128 "
    "--set num_attention_heads=4 --set num_key_value_heads=2 --set vocab_size=512 --set seq=16"
)
HF_GRAPH = f"python -m planner graph hf:meta-llama/Llama-3.1-8B {HF_TINY}"
HF_PLAN = (
    f"python -m planner plan hf:llama-3.1-8b {HF_TINY} --batch 4 --devices cpu-local-2 -o hf.json"
)
GUIDE_HF_TINY = f"python -m planner plan hf:meta-llama/Llama-3.1-8B {HF_TINY} --batch 4 --devices cpu-local-2 -o tiny.json"  # noqa: E501
GUIDE_HF_8B = (
    "python -m planner plan hf:meta-llama/Llama-3.1-8B --devices dgx-h100-1 --batch 32 "
    "--set seq=4096 --precision bf16-mixed --optimizer adam --time-limit 60 -o llama8b.json"
)

# (doc, command as extracted: continuation lines joined, comment removed) -> how to treat it
TABLE: dict[tuple[str, str], Run] = {
    ("README.md", "python -m planner models"): fast(),
    ("README.md", "python -m planner graph inception_v3 --summary"): fast('"ops": 128'),
    ("README.md", VGG16_JSON): slow(),
    ("README.md", "python -m planner devices p100-4x4"): fast(),
    ("README.md", "python -m planner devices cpu-local-2 --measure"): slow(),
    ("README.md", "python -m planner devices p100-2x4 --json my_cluster.json"): fast(),
    ("README.md", "python -m planner plan vgg16 --devices p100-1x4 --backend baselines -o plan.json"): fast(),  # noqa: E501
    ("README.md", "python -m planner plan --graph vgg16.json --devices my_cluster.json --backend baselines"): slow(after=(VGG16_JSON,)),  # noqa: E501
    ("README.md", "python -m planner plan --problem problem.json --backend portfolio --time-limit 60"): slow(),  # noqa: E501
    ("README.md", "python -m planner plan inception_v3 --devices p100-4x4 --backend mcmc --objective makespan --time-limit 60"): slow(),  # noqa: E501
    ("README.md", "python -m planner plan alexnet --devices p100-1x4 --backend search --option mode=astar"): slow(),  # noqa: E501
    ("README.md", "python -m planner plan resnet101 --devices p100-256x4 --batch 32768 --backend elimination --time-limit 600"): slow(),  # noqa: E501
    ("README.md", "python -m planner plan my_pkg.models:make_net --input 64x3x32x32 --devices p100-2x4 --backend elimination"): skip(PLACEHOLDER),  # noqa: E501
    ("README.md", "python -m planner evaluate plan.json [--json]"): fast(),
    ("README.md", "python -m planner evaluate plan.json --trace t.json --plot t.png"): fast(),
    ("README.md", "python -m planner profile lenet5 --devices cpu-local-2"): slow(),
    ("docs/compare.md", "python -m experiments.compare"): slow(),
    ("docs/compare.md", "python -m experiments.compare --full"): skip("13 minutes"),
    ("docs/compare.md", "python -m experiments.compare --models lenet5 --presets p100-1x4 --backends elimination mcmc --time-limit 5"): slow(),  # noqa: E501
    ("docs/compare.md", "python -m experiments.compare --objective makespan"): slow(),
    ("docs/cost_model.md", "python -m planner profile lenet5 --devices cpu-local-2"): slow(),
    ("docs/cost_model.md", "python -m planner profile alexnet --batch 8 --devices cpu-local-4 --repeats 5"): slow(),  # noqa: E501
    ("docs/cost_model.md", "python -m planner profile lenet5 --devices cpu-local-2 --refresh"): slow(),  # noqa: E501
    ("docs/cost_model.md", "python -m planner plan lenet5 --devices cpu-local-2 --cost measured"): slow(after=("python -m planner profile lenet5 --devices cpu-local-2",)),  # noqa: E501
    ("docs/costtable.md", "python -m experiments.costtables --generate DIR --sizes 800,35000 --count 3 [--seed 0]"): skip(PLACEHOLDER),  # noqa: E501
    ("docs/costtable.md", "python -m experiments.costtables DIR --backends baselines ilp cpsat portfolio --time-limit 60"): skip(PLACEHOLDER),  # noqa: E501
    ("docs/costtable.md", "python -m experiments.iopddl DIR_OR_FILES... [--backends portfolio ...] [--time-limit S]"): skip("a synopsis, not a command"),  # noqa: E501
    ("docs/costtable.md", "python -m experiments.iopddl DIR --backends portfolio toulbar2 --seeds 0 1 2 --background 2"): skip("needs the contest's instances (downloaded by hand); about an hour"),  # noqa: E501
    ("docs/costtable.md", "python -m experiments.iopddl DIR --backends portfolio"): skip("needs the contest's instances (downloaded by hand); about 11 minutes"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.costtables --generate gen --sizes 300 --count 1"): slow(),
    ("docs/bench.md", "python -m experiments.many_strategies gen/contest-n300-seed0.json many.json --seed 0 --mean 60"): slow(after=("python -m experiments.costtables --generate gen --sizes 300 --count 1",)),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl gen/contest-n300-seed0.json many.json --backends portfolio toulbar2 --time-limit 5 --out res"): slow(after=("python -m experiments.costtables --generate gen --sizes 300 --count 1", "python -m experiments.many_strategies gen/contest-n300-seed0.json many.json --seed 0 --mean 60")),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl DIR --backends portfolio toulbar2 --seeds 0 --dispatch ray"): skip("needs the contest's instances (downloaded by hand); about 21 minutes"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl DIR --backends portfolio toulbar2 --seeds 0 1 2 3 4"): skip("needs the contest's instances (downloaded by hand); hours"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl DIR --backends portfolio toulbar2 --seeds 0 1 2 3 4 --dispatch ray"): skip("needs the contest's instances (downloaded by hand); hours"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl DIR --backends local --seeds 0 1 2 3 4 --threads 1 --dispatch ray"): skip("needs the contest's instances (downloaded by hand); hours"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl /shared/iopddl --backends portfolio cpsat --seeds 0 1 2 3 4 --threads 8 --ray ADDRESS"): skip("needs a Ray cluster of several machines"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl --resume RESULTS_FOLDER"): skip(PLACEHOLDER),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl --resume RESULTS_FOLDER --ray ADDRESS"): skip("needs a Ray cluster of several machines"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.iopddl DIR --backends portfolio --seeds 0 1 2 3 4 --background 2"): skip("needs the contest's instances (downloaded by hand); hours"),  # noqa: E501
    ("docs/bench.md", "python -m experiments.anytime RESULTS_FOLDER [MORE_FOLDERS] [--out FOLDER]"): skip("a synopsis, not a command"),  # noqa: E501
    ("docs/costtable.md", "python -m planner plan --problem P.json --backend NAME"): skip(PLACEHOLDER),  # noqa: E501
    ("docs/devices.md", "python -m planner devices p100-2x2 --json my_cluster.json"): fast(),  # noqa: E501
    ("docs/devices.md", "python -m planner devices my_cluster.json"): fast(),
    ("docs/devices.md", "python -m planner plan vgg16 --devices my_cluster.json --backend elimination -o plan.json"): fast(),  # noqa: E501
    ("docs/devices.md", "python -m planner devices cpu-local-2 --measure"): slow(),
    ("docs/devices.md", "python -m planner devices cpu-local-2 --measure --max-load inf"): slow(),
    ("docs/guide.md", "python -m planner plan mymodels:Net --input 32x3x32x32 --set classes=10 --devices cpu-local-2 --backend elimination -o plan.json"): skip(GUIDE),  # noqa: E501
    ("docs/guide.md", "python -m runtime.run plan.json --steps 5 --check"): skip(GUIDE),
    ("docs/guide.md", "layerwise evaluate plan.json"): skip(GUIDE),
    ("docs/guide.md", "python -m planner plan mygpt:GPT --input 8x32:int64 --devices cpu-local-2 -o gpt.json"): skip(GUIDE),  # noqa: E501
    ("docs/guide.md", "python -m runtime.run gpt.json --steps 3 --dtype float64 --check"): skip(GUIDE),  # noqa: E501
    ("docs/guide.md", GUIDE_HF_TINY): fast(),
    ("docs/guide.md", "python -m runtime.run tiny.json --steps 3 --dtype float64 --check"): slow(),  # noqa: E501
    ("docs/guide.md", GUIDE_HF_8B): slow(),
    ("docs/guide.md", "python -m planner export --to torchtitan llama8b.json -o llama8b.toml"): slow(after=(GUIDE_HF_8B,)),  # noqa: E501
    ("docs/guide.md", "python -m planner export --to megatron llama8b.json -o llama8b.args"): slow(after=(GUIDE_HF_8B,)),  # noqa: E501
    ("docs/guide.md", "python -m planner export --to fsdp llama8b.json -o train_llama8b.py"): slow(after=(GUIDE_HF_8B,)),  # noqa: E501
    ("docs/cost_model.md", "python -m experiments.gemm_fit"): fast("median 3.3%, max 38.1%"),
    ("docs/cost_model.md", "python -m experiments.gemm_fit --fp8"): fast("(median |error| 2.3%)"),
    ("docs/cost_model.md", "python -m experiments.expert_tensor"): fast("sample=32,reduce=2,expert=4"),  # noqa: E501
    ("docs/moe.md", "python -m experiments.moe"): slow("TP1 PP4 VP8 EP8 DP16 MBS1 GBS256"),
    ("docs/moe.md", "python -m experiments.moe --rows"): slow("Qwen3-235B-A22B (MB 25.11"),
    ("docs/calibration.md", "python -m experiments.calibration"): slow("held-out bf16: 20 rows, median |error| 6.8%, max 10.2%"),
    ("docs/calibration.md", "python -m experiments.calibration --rows mine.csv"): skip(PLACEHOLDER),  # noqa: E501
    ("docs/calibration.md", "python -m experiments.calibration --lines 171 203"): slow(),
    ("docs/calibration.md", "python -m experiments.calibration --fit"): skip("about 12 minutes"),  # noqa: E501
    ("docs/graphs.md", HF_GRAPH): fast("attention=2"),
    ("docs/graphs.md", HF_PLAN): slow(),
    ("docs/graphs.md", "python -m planner graph hf:Qwen/Qwen3-8B --batch 1 --set seq=4096 --summary"): slow(),  # noqa: E501
    ("docs/launchers.md", "python -m planner plan gpt2 --set n_layer=2 --batch 8 --devices p100-1x4 -o plan.json"): fast(),  # noqa: E501
    ("docs/launchers.md", "python -m planner export --to megatron plan.json -o megatron.args"): fast("TP 1 x DP 4"),  # noqa: E501
    ("docs/launchers.md", "python -m planner export --to torchtitan plan.json -o job.toml"): fast(),  # noqa: E501
    ("docs/launchers.md", "python -m planner export --to fsdp plan.json -o train.py"): fast(),
    ("docs/launchers.md", GEMMA_PLAN): slow(),
    ("docs/launchers.md", "python -m planner export --to megatron gemma.json -o gemma.args"): slow("TP 1 x DP 4", after=(GEMMA_PLAN,)),  # noqa: E501
    ("docs/launchers.md", PP_PLAN): slow(),
    ("docs/launchers.md", "python -m planner export --to torchtitan pp.json"): slow("PP 2", after=(PP_PLAN,)),  # noqa: E501
    ("docs/megatron.md", "python -m experiments.megatron"): skip("about 14 minutes"),
    ("docs/megatron.md", "python -m experiments.megatron --rows 1 2 3 4"): slow(),
    ("docs/megatron.md", "python -m experiments.megatron --rows 5 6 7 8 9 10 --time-limit 150"): slow(),  # noqa: E501
    ("docs/megatron.md", "python -m experiments.megatron --no-search"): slow(),
    ("docs/megatron.md", "python -m experiments.megatron --rows 1 --attention-efficiency 0.5"): slow(),  # noqa: E501
    ("docs/pipeline.md", LLAMA_70B): slow("PP 1 x TP 8 x DP 128"),
    ("docs/pipeline.md", "python -m planner plan gpt2 --devices dgx-a100-80g-2 --pipeline on"): slow(),  # noqa: E501
    ("docs/pipeline.md", "python -m planner plan gpt2 --devices dgx-a100-80g-2 --pipeline off"): slow(),  # noqa: E501
    ("docs/pipeline.md", "python -m planner evaluate plan.json --plot timeline.png"): slow(after=(LLAMA_70B,)),  # noqa: E501
    ("docs/pipeline.md", "python -m planner plan mixtral-8x7b --devices dgx-h100-8 -o plan.json"): slow("PP 8 x TP 8 x DP 1, EP 8"),  # noqa: E501
    ("docs/runtime.md", RUNTIME_PLAN): slow(),
    ("docs/runtime.md", "python -m runtime.run plan.json --steps 10"): slow(after=(RUNTIME_PLAN,)),
    ("docs/runtime.md", "python -m runtime.run plan.json --steps 3 --check"): slow(after=(RUNTIME_PLAN,)),  # noqa: E501
    ("docs/runtime.md", "python -m runtime.run plan.json --steps 10 --json"): slow(after=(RUNTIME_PLAN,)),  # noqa: E501
    ("docs/runtime.md", HF_FACTORY_PLAN): slow(),  # 10 s: transformers' import, the capture
    ("docs/runtime.md", "python -m runtime.run hf.json --steps 2 --dtype float64 --check"): slow(after=(HF_FACTORY_PLAN,)),  # noqa: E501
    ("docs/runtime.md", "python -m experiments.accuracy"): skip("about 17 minutes"),
    ("docs/runtime.md", "python -m experiments.accuracy --quick"): slow(),
    ("docs/runtime.md", "python -m experiments.accuracy --prediction additive"): skip("about 17 minutes"),  # noqa: E501
    ("docs/scaling.md", "python -m experiments.scaling"): slow(),
    ("docs/scaling.md", "python -m experiments.scaling --full --families p100"): skip("13 minutes"),  # noqa: E501
    ("docs/scaling.md", "python -m experiments.scaling --full --families dgx --devices 16 64 256 1024"): skip("over 10 minutes"),  # noqa: E501
    ("docs/space.md", "python -m planner plan inception_v3 --devices p100-256x4 --batch 32768 --backend elimination --space mesh --time-limit 600 -o plan.json"): slow(),  # noqa: E501
    ("docs/space.md", "python -m planner plan vgg16 --devices p100-4x5 --backend elimination --no-recommend"): fast("the plan uses 4 of the 20 devices"),  # noqa: E501
    ("docs/space.md", "python -m experiments.space_loss"): slow(),
    ("docs/space.md", "python -m experiments.space_loss --models rnnlm transformer nmt"): slow(),
    ("docs/space.md", "python -m experiments.space_loss --presets k80-4x4"): slow(),
}  # fmt: skip


def costtable_example(doc: str = "docs/costtable.md") -> str:
    """The example cost-table file of docs/costtable.md, "The format"."""
    return next(b for _, _, b in blocks(doc) if b.startswith('{"problem"'))


def hf_factory_example(doc: str = "docs/runtime.md") -> str:
    """The model factory file of docs/runtime.md, "Hugging Face models"."""
    return next(b for _, _, b in blocks(doc) if b.startswith("# hfmodels.py"))


# Files a doc's commands read that no command of it writes (the doc says where they come from)
SETUP = {
    "README.md": {"problem.json": costtable_example},
    "docs/runtime.md": {"hfmodels.py": hf_factory_example},
}

DOCUMENTED = commands()


def key(command: Command) -> tuple[str, str]:
    return (command.doc, command.text)


def test_every_documented_command_is_classified() -> None:
    documented = {key(c) for c in DOCUMENTED}
    missing = sorted(documented - TABLE.keys())
    assert not missing, "classify these documented commands in TABLE (fast, slow or skip):\n" + (
        "\n".join(f"    {k!r}: ..." for k in missing)
    )
    stale = sorted(TABLE.keys() - documented)
    assert not stale, f"TABLE names commands the docs no longer show: {stale}"
    assert all(r.kind in ("fast", "slow", "skip") for r in TABLE.values())
    assert all(r.why for r in TABLE.values() if r.kind == "skip"), "a skip needs its reason"
    for command in DOCUMENTED:
        for earlier in TABLE[key(command)].after:
            assert TABLE[(command.doc, earlier)].kind == "slow", (command.text, earlier)


def test_the_extraction_reads_continuations_comments_and_prompts(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "```sh\npython -m planner plan a \\\n    --devices b -o p.json   # why\n"
        "layerwise evaluate p.json [--json]\n```\n\n```console\n$ python -m planner models\n"
        "lenet5 ...\n```\n"
    )
    found = commands((str(doc),))
    assert [(c.line, c.text, c.comment) for c in found] == [
        (1 + 1, "python -m planner plan a --devices b -o p.json", "why"),
        (1 + 3, "layerwise evaluate p.json [--json]", ""),
        (1 + 7, "python -m planner models", ""),
    ]
    assert found[1].argv[1:] == ["-m", "planner", "evaluate", "p.json"]


def test_commands_stand_in_shell_blocks() -> None:
    """```sh, ```bash or ```console, so readers (and this test) know what to type."""
    wrong = [f"{c.doc}:{c.line}" for c in DOCUMENTED if c.language not in SHELL_LANGUAGES]
    assert not wrong, f"label these blocks sh, bash or console: {wrong}"


def test_each_claim_stands_in_the_doc_beside_its_command() -> None:
    for command in DOCUMENTED:
        claim = TABLE[key(command)].claim
        if claim:
            lines = doc_text(command.doc).splitlines()
            near = normalized("\n".join(lines[max(0, command.line - 15) : command.line + 15]))
            assert normalized(claim) in near, (command.doc, command.line, claim)


def test_every_device_preset_the_docs_give_exists() -> None:
    """`--devices NAME` in a planner command, in a block or inline: a preset `get_preset`
    builds."""
    from planner.hardware.presets import get_preset

    named = set()
    for doc in DOCS:
        for span in re.findall(r"(?:python -m planner|layerwise) [^`]*", doc_text(doc)):
            named.update(re.findall(r"--devices\s+([\w.-]+)", span))
    # a device file, or a placeholder (`--devices D`, `--devices ...`)
    named = {n for n in named if not n.endswith(".json") and re.search("[a-z]", n)}
    assert "p100-4x4" in named
    for name in sorted(named):
        get_preset(name)  # raises DeviceGraphError naming the valid forms


def in_order(doc: str, kinds: tuple[str, ...]) -> list[Command]:
    return [c for c in DOCUMENTED if c.doc == doc and TABLE[key(c)].kind in kinds]


def prepare(doc: str, cwd: Path) -> None:
    for name, make in SETUP.get(doc, {}).items():
        (cwd / name).write_text(make())


def run_checked(command: Command, cwd: Path, timeout: float) -> None:
    proc = run(command, cwd, timeout)
    where = f"{command.doc}:{command.line} `{command.text}`"
    assert proc.returncode == 0, f"{where} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    claim = TABLE[key(command)].claim
    if claim:
        output = normalized(proc.stdout + "\n" + proc.stderr)
        assert normalized(claim) in output, f"{where}: the doc says {claim!r}; it printed\n" + (
            proc.stdout[-4000:] + proc.stderr[-4000:]
        )


@pytest.fixture(autouse=True)
def isolated_measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LAYERWISE_MAX_LOAD", "inf")


FAST_DOCS = sorted({c.doc for c in DOCUMENTED if TABLE.get(key(c), skip("?")).kind == "fast"})
SLOW = [c for c in DOCUMENTED if TABLE.get(key(c), skip("?")).kind == "slow"]


@pytest.mark.parametrize("doc", FAST_DOCS)
def test_the_fast_commands_run_as_documented(doc: str, tmp_path: Path) -> None:
    prepare(doc, tmp_path)
    for command in in_order(doc, ("fast",)):
        run_checked(command, tmp_path, FAST_TIMEOUT)


@pytest.mark.slow
@pytest.mark.parametrize("command", SLOW, ids=[f"{c.doc}:{c.line}" for c in SLOW])
def test_the_slow_commands_run_as_documented(command: Command, tmp_path: Path) -> None:
    """After the doc's earlier fast commands (the files they write) and the slow ones it
    names."""
    prepare(command.doc, tmp_path)
    after = TABLE[key(command)].after
    for earlier in in_order(command.doc, ("fast", "slow")):
        if earlier.line >= command.line:
            break
        if TABLE[key(earlier)].kind == "fast" or earlier.text in after:
            run_checked(earlier, tmp_path, SLOW_TIMEOUT)
    run_checked(command, tmp_path, SLOW_TIMEOUT)
