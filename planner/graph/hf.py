"""Hugging Face models as they are: the root capture traces instead of their own `forward`.

A `transformers` model's `forward` takes a dozen keyword arguments behind decorators that
take `*args, **kwargs` (`can_return_tuple`, `check_model_inputs`), which torch.fx cannot turn
into graph inputs ("co_varnames is too small"), and it returns a `ModelOutput`, not a
tensor. `traceable(model)` gives, for such a model, a module that holds the very same
submodules, parameters and buffers under the very same names (so a plan names
`model.layers.0.self_attn.q_proj` as the model does) and whose `forward(input_ids)` runs the
model's own forward with `use_cache=False` and returns its logits (a causal LM) or its last
hidden state (a base model). Nothing else changes: the rotary tables, attention masks,
norms and attention the model's classes compute are traced as they run them, on meta
tensors, with the attention implementation the model's config selects (`sdpa` for most
families, `eager` where the family asks for it: Gemma 2's logit soft-capping).

`transformers` is optional (`pip install layerwise[hf]`): nothing here imports it; a model is
recognised by its class deriving from transformers' `PreTrainedModel`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from planner.errors import GraphError

__all__ = ["HFRoot", "is_hf_model", "traceable"]


def is_hf_model(module: Any) -> bool:
    """Whether `module` is a Hugging Face `transformers` model (its class derives from
    `transformers.PreTrainedModel`)."""
    return isinstance(module, nn.Module) and any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


class HFRoot(nn.Module):
    """A Hugging Face model seen as `forward(input_ids) -> logits` (module docstring). It
    shares the model's submodule, parameter and buffer tables, so `named_parameters()`,
    `named_modules()` and `state_dict()` are the model's own, and an update to one is an
    update to the other."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        # the same dicts, not copies: names and tensors are the model's
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        object.__setattr__(self, "hf_model", model)  # not a submodule: no "hf_model." prefix

    hf_model: nn.Module

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        model = self.hf_model
        # the model's own forward, called as a method: its submodules are this module's
        out = model.forward(input_ids=input_ids, use_cache=False, return_dict=True)
        logits = _field(out, "logits")
        if logits is not None:
            return logits
        hidden = _field(out, "last_hidden_state")
        if hidden is not None:
            return hidden
        raise GraphError(
            f"{type(model).__name__} returns neither logits nor a last hidden state; layerwise "
            "plans causal language models (AutoModelForCausalLM) and base models"
        )

    def train(self, mode: bool = True) -> HFRoot:
        self.hf_model.training = mode  # its children are this module's: set once, below
        return super().train(mode)


def _field(out: Any, name: str) -> Any:
    if isinstance(out, dict):  # transformers' ModelOutput is an OrderedDict
        return out.get(name)
    return getattr(out, name, None)


def traceable(module: nn.Module) -> nn.Module:
    """`module` as capture traces it: a Hugging Face model behind `HFRoot`, any other module
    itself."""
    if is_hf_model(module) and not isinstance(module, HFRoot):
        return HFRoot(module)
    return module
