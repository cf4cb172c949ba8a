"""Hugging Face models by name, offline: published configs shipped, built with `transformers`.

`hf:NAME` names a causal language model as `transformers` builds it from a config
(`AutoConfig.for_model(model_type, **fields)`, then `AutoModelForCausalLM.from_config`), the
way people who do not write their model's code build it. NAME is either

- a config shipped in `planner/graph/hf_configs/` (the published `config.json` fields that
  shape the model, written from the checkpoints' model cards; their parameter counts equal
  the published ones, tests/test_hf_zoo.py): the checkpoint's Hub id, its org prefix
  optional, any case (`hf:meta-llama/Llama-3.1-8B`, `hf:llama-3.1-8b`); or
- a path to a `config.json` (or a folder holding one), e.g. a checkpoint's on disk.

Any config field can be overridden (`num_hidden_layers=2, hidden_size=64`, the family's
aliases such as GPT-2's `num_hidden_layers` for `n_layer` included); `transformers` checks
the values and its message becomes one error line. Beside the config fields a model takes
`batch` (default 8), `seq` (default min(2048, max_position_embeddings)) and `dtype` of its
weights ("float32", the default, "bfloat16" or "float16"). The key/value cache is off
(training), and the attention implementation is the one transformers picks for the family.

The zoo (`planner.graph.zoo.build_model`) hands every `hf:` name here (its module is the
model behind `planner.graph.hf.HFRoot`, `forward(input_ids) -> logits`), so a plan file records
`{"name": "hf:meta-llama/Llama-3.1-8B", "batch": 8, "kwargs": {...}}` and another process
(the runtime's workers) rebuilds the same module from it (`ModelSpec`). `transformers` is an
optional dependency (`pip install 'layerwise[hf]'`); nothing here imports it before a model
is built.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import LayerwiseError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "HF_PREFIX",
    "build_hf",
    "canonical_name",
    "hf_config",
    "hf_model",
    "is_hf_name",
    "shipped_names",
]

HF_PREFIX = "hf:"
CONFIG_DIR = Path(__file__).with_name("hf_configs")
INSTALL = "pip install 'layerwise[hf]'"
DEFAULT_BATCH = 8
MAX_DEFAULT_SEQ = 2048
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
OPTIONS = ("batch", "seq", "dtype")  # a model's settings that are not config fields
# config.json entries that describe the file, not the model, or that the build decides
_METADATA = ("_name_or_path", "architectures", "transformers_version", "auto_map")
_DECIDED = {"torch_dtype": "dtype", "dtype": "dtype", "use_cache": None}
# a config field holding a size or a count: an integer that must be at least 1
_SIZE = re.compile(r"^(n_|num_)|(_size|_dim|_layers|_heads|_positions|_embeddings)$")


def is_hf_name(name: object) -> bool:
    """Whether `name` is an `hf:` model name."""
    return isinstance(name, str) and name.startswith(HF_PREFIX)


@cache
def _shipped() -> dict[str, dict[str, Any]]:
    """Hub id -> the shipped config's fields, in the files' order (read once: package data).
    Callers copy what they change."""
    out = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        out[data["_name_or_path"]] = data
    return out


def shipped_names() -> list[str]:
    """The Hub ids of the shipped configs (`hf:` + one of them names a model)."""
    return list(_shipped())


def _find_shipped(text: str) -> str | None:
    key = text.strip().lower()
    for hub_id in _shipped():
        if key in (hub_id.lower(), hub_id.rpartition("/")[2].lower()):
            return hub_id
    return None


def _config_path(text: str) -> Path | None:
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    return path if path.is_file() else None


def _resolve(name: str) -> tuple[str, dict[str, Any]]:
    """The canonical `hf:` name of `name` and the config fields it names."""
    text = name.removeprefix(HF_PREFIX)
    hub_id = _find_shipped(text)
    if hub_id is not None:
        return HF_PREFIX + hub_id, copy.deepcopy(_shipped()[hub_id])
    path = _config_path(text)
    if path is None:
        raise LayerwiseError(
            f"unknown Hugging Face model {name!r}: neither a shipped config "
            f"({', '.join(shipped_names())}) nor a config.json file or a folder holding one"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayerwiseError(f"cannot read Hugging Face config {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise LayerwiseError(
            f'Hugging Face config {path} has no "model_type": it is not a transformers config.json'
        )
    return HF_PREFIX + str(path.resolve()), data


def canonical_name(name: str) -> str:
    """`name` as a plan file records it: `hf:` + the Hub id of a shipped config, or `hf:` +
    the absolute path of a config file (LayerwiseError for an unknown name)."""
    return _resolve(name)[0]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise LayerwiseError(
            f"Hugging Face models need the transformers package: {INSTALL}"
        ) from None
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise LayerwiseError(
            f"transformers {transformers.__version__} is installed; layerwise builds Hugging "
            f"Face models with transformers 5: {INSTALL}"
        )
    return transformers


def _config_class(transformers: Any, label: str, model_type: str) -> Any:
    try:
        return transformers.AutoConfig.for_model(model_type).__class__
    except (ValueError, KeyError):
        raise LayerwiseError(
            f"{label}: transformers {transformers.__version__} has no model_type "
            f"{model_type!r} (a newer transformers, or a model with its own code, which "
            "layerwise does not run)"
        ) from None


def _fields(config_cls: Any, data: Mapping[str, Any]) -> set[str]:
    """The fields a config of `config_cls` takes: its own, its aliases, the file's."""
    import dataclasses

    if dataclasses.is_dataclass(config_cls):
        names = {f.name for f in dataclasses.fields(config_cls)}
    else:
        names = set(config_cls().to_dict())
    names |= set(getattr(config_cls, "attribute_map", {})) | set(data)
    if "rope_parameters" in names:  # the names config.json files use for them
        names |= {"rope_theta", "rope_scaling"}
    fixed = {*_METADATA, *_DECIDED, "model_type"}  # the family is the config's
    return {n for n in names if not n.startswith("_")} - fixed


def _check_overrides(
    label: str, config_cls: Any, data: Mapping[str, Any], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The overrides under the config's own field names; an unknown field or a size below 1
    is one LayerwiseError line."""
    valid = _fields(config_cls, data)
    aliases = getattr(config_cls, "attribute_map", {})
    out = {}
    for key, value in overrides.items():
        if key in _DECIDED:
            what = "the dtype option" if _DECIDED[key] else "always off (training)"
            raise LayerwiseError(f"{label}: {key!r} is not set as a config field: it is {what}")
        if key not in valid:
            near = difflib.get_close_matches(key, sorted(valid), n=4, cutoff=0.6)
            hint = f"did you mean {', '.join(near)}? " if near else ""
            # the published fields first: those are the ones that shape the model
            listed = sorted(k for k in data if k in valid) + sorted(valid - set(data))
            raise LayerwiseError(
                f"{label} has no config field {key!r} ({config_cls.__name__}); {hint}fields "
                f"include {', '.join(listed[:12])}, ...; besides them: {', '.join(OPTIONS)}"
            )
        name = aliases.get(key, key)
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if _SIZE.search(name) and is_int and value < 1:
            raise LayerwiseError(f"{label}: {key} must be at least 1, got {value}")
        out[name] = value
    return out


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _drop_token_ids_beyond(fields: dict[str, Any], vocab: Any, applied: Mapping[str, Any]) -> None:
    """A special token id of the published config beyond a vocabulary made smaller names no
    token: it is dropped (None), so that a tiny vocabulary builds (Phi-3's padding id 32000
    would otherwise be an embedding row past the table)."""
    if not isinstance(vocab, int):
        return
    for key in _TOKEN_IDS:
        value = fields.get(key)
        if key in applied or value is None:
            continue
        if isinstance(value, list):
            kept = [v for v in value if isinstance(v, int) and v < vocab]
            fields[key] = kept or None
        elif isinstance(value, int) and value >= vocab:
            fields[key] = None


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def hf_config(name: str, **overrides: Any) -> Any:
    """The transformers config of `hf:` model `name` (the prefix optional) with `overrides`
    applied and the key/value cache off."""
    return _build_config(name, overrides)[1]


def _build_config(name: str, overrides: Mapping[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """(canonical name, config, the overrides as applied)."""
    canonical, data = _resolve(name)
    transformers = _transformers()
    label = f"model {canonical!r}"
    fields = {k: v for k, v in data.items() if k not in _METADATA and k not in _DECIDED}
    model_type = fields.pop("model_type")
    config_cls = _config_class(transformers, label, model_type)
    applied = _check_overrides(label, config_cls, data, overrides)
    fields.update(applied)
    if "vocab_size" in applied:
        _drop_token_ids_beyond(fields, applied["vocab_size"], applied)
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # transformers' validation: one line of its message
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "its published fields"
        raise LayerwiseError(f"{label} with {given}: {_last_line(exc)}") from None
    config.use_cache = False
    return canonical, config, applied


def hf_model(
    name: str, *, device: str | torch.device = "meta", dtype: str = "float32", **overrides: Any
) -> nn.Module:
    """The transformers causal LM of `hf:` model `name` (the prefix optional; a shipped
    config's Hub id or a config.json path) with config `overrides`, built on `device` (meta:
    no memory, what planning needs) with `dtype` weights, in train mode."""
    import torch

    if dtype not in WEIGHT_DTYPES:
        raise LayerwiseError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
    canonical, config, _ = _build_config(name, overrides)
    transformers = _transformers()
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=getattr(torch, dtype)
            )
    except Exception as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items()) or "its published fields"
        raise LayerwiseError(
            f"model {canonical!r} cannot be built with {given}: {_last_line(exc)}"
        ) from None
    return model.train()


def build_hf(
    name: str,
    *,
    device: str | torch.device = "meta",
    batch: int = DEFAULT_BATCH,
    seq: int | None = None,
    dtype: str = "float32",
    **overrides: Any,
) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The zoo's builder of an `hf:` model: the model as capture and the runtime call it,
    `forward(input_ids) -> logits` (`HFRoot`: the transformers model's own parameters under
    its own names; `.hf_model` is the model), and its example `input_ids` of shape (batch,
    seq), random token ids below the vocabulary size (uninitialized on meta)."""
    import torch

    from planner.graph.hf import HFRoot

    for key, value in (("batch", batch), ("seq", seq)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise LayerwiseError(f"model {name!r}: {key} must be a positive integer, got {value!r}")
    model = hf_model(name, device=device, dtype=dtype, **overrides)
    config: Any = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if seq is None:
        seq = min(MAX_DEFAULT_SEQ, limit) if isinstance(limit, int) else MAX_DEFAULT_SEQ
    elif isinstance(limit, int) and seq > limit:
        raise LayerwiseError(
            f"model {canonical_name(name)!r}: seq {seq} is beyond its max_position_embeddings "
            f"{limit}; use a shorter seq or set max_position_embeddings"
        )
    dev = torch.device(device)
    if dev.type == "meta":
        tokens = torch.empty(batch, seq, dtype=torch.long, device=dev)
    else:
        tokens = torch.randint(0, config.vocab_size, (batch, seq), device=dev)
    return HFRoot(model), (tokens,)
