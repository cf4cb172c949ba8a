"""Recognising a mixture-of-experts block in a model's code: `moe_of(module)`.

Both reference forms of an MoE block cannot run on the meta device (Mixtral's loop over
experts selects tokens with `torch.where(mask)`, DeepSeek-V3's counts them with
`torch.bincount(...).tolist()`), so capture cannot trace them: a module `moe_of` recognises
becomes a leaf, one `moe` op (`planner.graph.moe`), whose output has its input's shape and
whose FLOPs are `moe_flops` (the k active experts, not E).

Recognition reads the module's structure, then checks it by running:
- the router: a weight (E, h) of a child `nn.Linear` (Mixtral's and Qwen's `gate`) or a 2-D
  parameter (DeepSeek-V3's `Gate.weight`), and optionally a selection bias (E,) (DeepSeek-V3's
  `Gate.bias`, Hugging Face's `e_score_correction_bias` when it is a parameter);
- the routed experts: an `nn.ModuleList` of E modules with the same 2 or 3 matrices (an MLP
  h -> f -> h: w1/w2/w3, gate_proj/up_proj/down_proj or any names), or 3-D parameters with a
  leading E (Hugging Face transformers 5's `gate_up_proj` (E, 2f, h) and `down_proj`,
  torchtitan's GroupedExperts w1/w2/w3 in either layout; an (in, out) layout gets the "^T"
  role suffix); a fused gate/up matrix holds the gate rows then the up rows ("w13") or the
  two interleaved ("w13i"), whichever the run agrees with;
- optionally a shared expert (2 or 3 more matrices h -> fs -> h) and its sigmoid gate (1, h);
- k from an int attribute (`top_k`, `num_experts_per_tok`, `topk`, `n_activated_experts`) of
  the module, a child, or one level into a config/args object; groups and route scale alike.
Each reading of the structure (which matrix is which, softmax or sigmoid scores, normalised
or not, group ranking, activation, the router computed in the input's dtype or in float32 as
Hugging Face's routers do: attr `router_dtype`) is then tried on random float64 tokens with
random weights against `planner.graph.moe.moe_math` until one agrees to 1e-12. The block
runs in eval mode (training-time noise is not the op's), and transformers' experts in their
eager loop (`eager_experts`: `grouped_mm` has no float64 CPU kernel). When the float64
stand-in is large (more than MOE_VERIFY_NUMEL parameters) it is run with the experts' hidden
widths cut to a few channels (the code reads them from the weights); when even that is too
large, or that run fails, the structure read alone is used with a warning
(`attrs["checked"] = False`). Every parameter of the module must have a role; a buffer, a
router with a logits bias, or biased experts are not read (declare `layerwise_kind = "moe"`
with `layerwise_attrs()` instead: `planner.costs.declared.check_declared` checks it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.graph.attention import NoKey, class_key, plain_key, tensor_shape
from planner.graph.moe import ROUTER_DTYPES as OP_ROUTER_DTYPES
from planner.graph.moe import MoESpec, moe_flops, moe_math, spec_of, tokens_of

__all__ = [
    "MOE_VERIFY_NUMEL",
    "READS",
    "MoEFound",
    "declared_moe",
    "eager_experts",
    "moe_found",
    "moe_of",
    "refusal",
    "unread_moe",
    "unread_reason",
]

MOE_VERIFY_NUMEL = 2**24  # float64 stand-in parameters run to check a reading (128 MiB)
REDUCED_FFN = 2  # the experts' hidden width of a large module's stand-in
TOKENS = (2, 8)  # the random tokens a reading is checked on
TOLERANCE = 1e-12
# the input's dtype, or one of the moe op's (float32: Hugging Face's routers)
ROUTER_DTYPES = ("", *OP_ROUTER_DTYPES)

TOP_K_NAMES = ("top_k", "num_experts_per_tok", "topk", "n_activated_experts", "moe_top_k")
GROUP_NAMES = ("n_groups", "n_group", "n_expert_groups", "num_expert_group")
TOPK_GROUP_NAMES = ("topk_groups", "topk_group", "n_limited_groups")
SCALE_NAMES = ("route_scale", "routed_scaling_factor")
SCORE_NAMES = ("score_func", "scoring_func", "score_function")
NORM_NAMES = ("norm_topk_prob", "norm_topk")

READS = (
    "a router weight (E, h) (a child nn.Linear or a 2-D parameter, optionally a selection "
    "bias (E,)), E experts as an nn.ModuleList of alike MLPs or 3-D (E, ...) parameters (a "
    "fused gate/up (E, 2f, h) concatenated or interleaved), an "
    "optional shared expert and its gate, and k from an attribute top_k, "
    "num_experts_per_tok, topk or n_activated_experts"
)
"""What the recogniser reads, for error messages."""


@dataclass(frozen=True)
class MoEFound:
    """A recognised (or declared) MoE block: its op attrs, its hidden width, and whether its
    forward returns (out, router_logits) as Hugging Face's sparse blocks do: `logits` "flat"
    (tokens, E), "shaped" (..., E) or None (it returns out alone)."""

    attrs: dict[str, Any]
    hidden: int
    logits: str | None = None

    @property
    def spec(self) -> MoESpec:
        return spec_of(self.attrs)

    def output(self, x: torch.Tensor) -> Any:
        """The block's output for input `x` (a meta tensor): a tensor like x, or the tuple
        (out, router_logits) when the block returns one."""
        out = torch.empty_like(x)
        if self.logits is None:
            return out
        lead = (tokens_of(x.shape),) if self.logits == "flat" else tuple(x.shape[:-1])
        return out, x.new_empty(*lead, self.spec.experts)

    def flops(self, shape: Sequence[int]) -> float:
        """Forward FLOPs on an input of `shape` (..., h): `moe_flops(...).total`."""
        return moe_flops(self.spec, int(shape[-1]), tokens_of(shape)).total


def moe_of(m: nn.Module) -> dict[str, Any] | None:
    """The `moe` op's attrs (with `roles` in the order of `m.named_parameters()`) when module
    `m` computes a mixture of experts the recogniser reads (module docstring); None otherwise.
    Cached per module and per structure."""
    found = moe_found(m)
    return None if found is None else dict(found.attrs)


_SEEN: dict[int, tuple[nn.Module, MoEFound | None]] = {}
_BY_KEY: dict[Hashable, MoEFound | None] = {}


def moe_found(m: nn.Module) -> MoEFound | None:
    """`moe_of`'s answer with the hidden width and output form (`MoEFound`)."""
    hit = _SEEN.get(id(m))
    if hit is not None and hit[0] is m:
        return hit[1]
    if not _may_be_moe(m):
        _SEEN[id(m)] = (m, None)
        return None
    key = tree_key(m)
    if key is not None and key in _BY_KEY:
        found = _BY_KEY[key]
    else:
        found = _recognise(m)
        if key is not None:
            _BY_KEY[key] = found
    _SEEN[id(m)] = (m, found)
    return found


def declared_moe(m: nn.Module) -> MoEFound | None:
    """A module that declares `layerwise_kind = "moe"`: its attrs from `layerwise_attrs()`,
    its hidden width from its router role's parameter. None for any other module."""
    if getattr(type(m), "layerwise_kind", None) != "moe":
        return None
    attrs_fn = getattr(m, "layerwise_attrs", None)
    attrs = dict(attrs_fn()) if callable(attrs_fn) else {}
    spec = spec_of(attrs, type(m).__name__)
    hidden = 0
    for (_, p), role in zip(m.named_parameters(), spec.roles, strict=False):
        if role in ("router", "router^T"):
            hidden = int(p.shape[-1] if role == "router" else p.shape[0])
    return MoEFound(attrs, hidden)


def unread_moe(module: nn.Module) -> str | None:
    """The qualified name of the first submodule of `module` that looks like a mixture of
    experts (an int top-k attribute, and E alike expert MLPs in a child ModuleList or 3-D
    parameters on it or a child: `_may_be_moe`) but is neither recognised nor declared; None
    when there is none. The outermost such module is named (the block, not its experts),
    and nothing inside a recognised one."""
    inside = None
    for name, m in module.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        if moe_found(m) is not None or declared_moe(m) is not None:
            inside = f"{name}." if name else ""
            continue
        if _may_be_moe(m) and _attribute(m, TOP_K_NAMES, int) is not None:
            return name or type(m).__name__
    return None


def unread_reason(module: nn.Module, name: str) -> str:
    """What is wrong with the unread mixture of experts `name` in `module` when it is plain
    (', its top_k 8 is more than its 4 experts'), else ''."""
    try:
        m = module.get_submodule(name)
    except AttributeError:
        return ""
    params: list[tuple[str, torch.Tensor]] = list(m.named_parameters())
    readings = list(_readings(m, params)) if len(params) >= 3 else []
    top_k = _attribute(m, TOP_K_NAMES, int)
    if readings and top_k is not None and not 1 <= top_k <= readings[0].experts:
        return f" (its top_k {top_k} is not between 1 and its {readings[0].experts} experts)"
    return ""


def refusal(where: str) -> str:
    """The one-line refusal of a mixture of experts written in a form not read."""
    return (
        f"{where} looks like a mixture of experts that layerwise cannot read: the recogniser "
        f"reads {READS}, and checks the reading against planner.graph.moe.moe_math; write the "
        'block in that form, or declare it: a class attribute layerwise_kind = "moe" and a '
        "layerwise_attrs() method giving the moe op's attrs (planner.graph.moe)"
    )


def _may_be_moe(m: nn.Module) -> bool:
    """A quick look before the structure key: E >= 2 alike experts of 2 or 3 matrices in a
    child ModuleList, or 3-D parameters on the module or a child (a model's 80 layers, or a
    MoE's 256 experts, are refused here without a key)."""
    if type(m).__module__.startswith("torch.nn."):
        return False
    for child in m.children():
        if isinstance(child, nn.ModuleList) and len(child) >= 2:
            first = list(child[0].parameters())
            if len(first) in (2, 3) and all(p.dim() == 2 for p in first):
                return True
    owners = [m, *m.children()]
    return any(p.dim() == 3 for o in owners for p in o.parameters(recurse=False))


# -- structure keys -----------------------------------------------------------------------------


def tree_key(m: nn.Module) -> Hashable | None:
    """What running `m` depends on, over its whole module tree (`attention.module_key` is per
    leaf module): every submodule's classes, parameter names and shapes, and public plain
    attributes (a dataclass config by its fields). None when a submodule holds a buffer, a
    hook, or a public attribute that is not plain."""
    from torch.nn.modules import module as torch_module

    if any(getattr(torch_module, "_global" + h) for h in _HOOKS[:4]):
        return None
    classes: dict[type, Hashable] = {}
    try:
        parts = []
        for name, sub in m.named_modules():
            if sub._buffers or any(getattr(sub, h) for h in _HOOKS):
                return None
            cls = type(sub)
            if cls not in classes:
                classes[cls] = class_key(cls)
            params = tuple(
                (n, None if p is None else tensor_shape(p)) for n, p in sub._parameters.items()
            )
            plain = tuple((k, plain_key(v)) for k, v in vars(sub).items() if not k.startswith("_"))
            parts.append((name, classes[cls], params, plain))
        key = tuple(parts)
        hash(key)
    except (NoKey, TypeError):
        return None
    return key


_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
)


# -- reading the structure ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Reading:
    """One reading of a module's parameters: a role each (named_parameters order), the
    widths, and the routing attributes found on the module."""

    roles: tuple[str, ...]
    experts: int
    hidden: int
    ffn: int
    shared_ffn: int
    gated: bool


def _recognise(m: nn.Module) -> MoEFound | None:
    if type(m).__module__.startswith("torch.nn.") or m._buffers:
        return None
    params: list[tuple[str, torch.Tensor]] = list(m.named_parameters())
    if len(params) < 3 or any(b is not None for _, b in m.named_buffers()):
        return None
    readings = list(_readings(m, params))
    if not readings:
        return None
    top_k = _attribute(m, TOP_K_NAMES, int)
    if top_k is not None and not 1 <= top_k <= readings[0].experts:
        return None
    return _verify(m, params, readings, top_k)


def _readings(m: nn.Module, params: list[tuple[str, torch.Tensor]]) -> Iterator[_Reading]:
    """Every consistent reading of the parameters, the likeliest (by names) first."""
    listed = _listed_experts(m)
    if listed is not None:
        prefix, count, names = listed
        expert_params = [(n, p) for n, p in params if n.startswith(prefix + ".")]
        first = [p for n, p in expert_params if n.startswith(f"{prefix}.0.")]
        stacked = False
    else:
        expert_params = [(n, p) for n, p in params if p.dim() == 3]
        counts = {int(p.shape[0]) for _, p in expert_params}
        if len(expert_params) not in (2, 3) or len(counts) != 1:
            return
        count = counts.pop()
        names = [n for n, _ in expert_params]
        first = [p[0] for _, p in expert_params]
        stacked = True
    if count < 2:
        return
    in_experts = {n for n, _ in expert_params}
    rest = [(n, p) for n, p in params if n not in in_experts]
    for router, hidden in _routers(rest, count):
        left = [(n, p) for n, p in rest if n != router]
        bias = [n for n, p in left if tuple(p.shape) == (count,)]
        if len(bias) > 1 or (bias and _is_linear_bias(m, router, bias[0])):
            continue
        left = [(n, p) for n, p in left if n not in bias]
        for experts, ffn, gated in _mlp_roles(names, first, hidden, stacked):
            for shared, shared_ffn in _shared_roles(left, hidden, gated):
                roles = {router: "router", **dict.fromkeys(bias, "router_bias"), **shared}
                if stacked:
                    roles.update(zip(names, experts, strict=True))
                else:
                    for n, _ in expert_params:
                        index, _, local = n[len(prefix) + 1 :].partition(".")
                        roles[n] = f"{experts[names.index(local)]}.{index}"
                if set(roles) != {n for n, _ in params}:
                    continue
                ordered = tuple(roles[n] for n, _ in params)
                yield _Reading(ordered, count, hidden, ffn, shared_ffn, gated)


def _listed_experts(m: nn.Module) -> tuple[str, int, list[str]] | None:
    """(child name, E, the parameter names of an expert) of a child nn.ModuleList of E >= 2
    modules with the same 2 or 3 matrices and nothing else."""
    for name, child in m.named_children():
        if not isinstance(child, nn.ModuleList) or len(child) < 2:
            continue
        shapes = [[(n, tuple(p.shape)) for n, p in e.named_parameters()] for e in child]
        if any(s != shapes[0] for s in shapes) or len(shapes[0]) not in (2, 3):
            continue
        if all(len(s) == 2 for _, s in shapes[0]):
            return name, len(child), [n for n, _ in shapes[0]]
    return None


def _routers(rest: list[tuple[str, torch.Tensor]], count: int) -> Iterator[tuple[str, int]]:
    """(name, h) of the 2-D (E, h) parameters that may be the router, names with gate or
    router first, shared ones last."""
    found = [(n, int(p.shape[1])) for n, p in rest if p.dim() == 2 and int(p.shape[0]) == count]
    yield from sorted(
        found, key=lambda f: (_score(f[0], ("gate", "router")) <= 0, "shared" in f[0])
    )


def _is_linear_bias(m: nn.Module, router: str, bias: str) -> bool:
    """Whether `bias` is the bias of the router's own nn.Linear (added to the logits: the
    moe op has no such bias)."""
    owner = router.rpartition(".")[0]
    return bias == f"{owner}.bias" and isinstance(m.get_submodule(owner), nn.Linear)


_W13_NAMES = ("gate_up", "w13", "w1_3")  # a fused gate and up matrix
_NAME_HINTS = {
    "w1": ("w1", "gate_proj", "gate", "fc1", "wi_0"),
    "w3": ("w3", "up_proj", "up", "wi_1"),
    "w2": ("w2", "down_proj", "down", "fc2", "wo"),
    "w13": _W13_NAMES,
    "w13i": _W13_NAMES,
}


def _score(name: str, hints: Sequence[str]) -> int:
    last = name.rsplit(".", 2)
    tail = ".".join(last[-2:]).lower()
    return max((len(h) for h in hints if h in tail), default=0)


def _mlp_roles(
    names: Sequence[str], mats: Sequence[torch.Tensor], hidden: int, stacked: bool
) -> Iterator[tuple[tuple[str, ...], int, bool]]:
    """(roles, f, gated) for matrices `mats` (an expert's, or a stacked tensor's first
    slice) of an MLP h -> f -> h: w1 (w3) (f, h) in, w2 (h, f) out, or a fused (2f, h): w13
    (the gate rows, then the up rows) or w13i (interleaved), the run telling them apart; an
    (in, out) layout is role + "^T" (for stacked tensors only: listed experts are
    nn.Linears). Likeliest by names first, the interleaved and transposed readings last."""
    options = []
    for mat in mats:
        if mat.dim() != 2:
            return
        a, b = (int(s) for s in mat.shape)
        opts: list[tuple[str, int]] = []
        if b == hidden:
            opts += [("w1", a), ("w3", a), ("w13", a // 2), ("w13i", a // 2)]
            opts += [("w2^T", a)] if stacked else []
        if a == hidden:
            opts += [("w2", b)]
            if stacked:
                opts += [("w1^T", b), ("w3^T", b), ("w13^T", b // 2), ("w13i^T", b // 2)]
        options.append(opts)
    found = []
    for combo in itertools.product(*options):
        roles = tuple(r for r, _ in combo)
        widths = {f for _, f in combo}
        bases = sorted(r.removesuffix("^T") for r in roles)
        if len(widths) != 1 or min(widths) < 1:
            continue
        if bases not in (["w1", "w2", "w3"], ["w13", "w2"], ["w13i", "w2"], ["w1", "w2"]):
            continue
        if any(
            int(m.shape[0 if not r.endswith("^T") else 1]) % 2
            for m, r in zip(mats, roles, strict=True)
            if r.startswith("w13")
        ):
            continue
        score = sum(
            _score(n, _NAME_HINTS[r.removesuffix("^T")]) for n, r in zip(names, roles, strict=True)
        )
        odd = sum(r.endswith("^T") for r in roles) + 2 * ("w13i" in bases)
        found.append((-score, odd, roles, widths.pop(), bases != ["w1", "w2"]))
    for _, _, roles, f, gated in sorted(found, key=lambda x: (x[0], x[1])):
        yield roles, f, gated


def _shared_roles(
    left: list[tuple[str, torch.Tensor]], hidden: int, gated: bool
) -> Iterator[tuple[dict[str, str], int]]:
    """({name: role}, fs) for the parameters left after the router and the experts: none,
    or a shared expert's matrices (sw1, sw3, sw2) and optionally its gate (1, h)."""
    if not left:
        yield {}, 0
        return
    gates = [n for n, p in left if tuple(p.shape) == (1, hidden)]
    for gate in [*gates, None]:
        mats = [(n, p) for n, p in left if n != gate]
        if len(mats) not in (2, 3) or any(p.dim() != 2 for _, p in mats):
            continue
        names = [n for n, _ in mats]
        for roles, fs, shared_gated in _mlp_roles(names, [p for _, p in mats], hidden, False):
            if shared_gated != gated or any(r.startswith("w13") for r in roles):
                continue  # a shared expert has no fused role
            out = {n: "s" + r for n, r in zip(names, roles, strict=True)}
            if gate is not None:
                out[gate] = "sgate"
            yield out, fs


def _attribute(m: nn.Module, names: Sequence[str], kind: type) -> Any:
    """The first attribute of `names` of type `kind` on `m`, a child of `m`, or one level
    into a config/args object of either (Mistral's `self.args.num_experts_per_tok`)."""
    owners: list[Any] = [m, *m.children()]
    for owner in list(owners):
        for v in vars(owner).values():
            if not isinstance(v, nn.Module | torch.Tensor | dict) and hasattr(v, "__dict__"):
                owners.append(v)
    for owner in owners:
        for name in names:
            v = vars(owner).get(name) if hasattr(owner, "__dict__") else None
            if v is None and not isinstance(owner, nn.Module):
                v = getattr(owner, name, None)
            if (
                isinstance(v, bool)
                if kind is bool
                else isinstance(v, kind) and not isinstance(v, bool)
            ):
                return v
    return None


# -- checking a reading by running it -----------------------------------------------------------


def _variants(m: nn.Module, reading: _Reading, top_k: int | None) -> Iterator[dict[str, Any]]:
    """The routing variants to try, the module's own attributes first."""
    score = _attribute(m, SCORE_NAMES, str)
    routers = ["sigmoid", "softmax"] if score == "sigmoid" else ["softmax", "sigmoid"]
    norm = _attribute(m, NORM_NAMES, bool)
    norms = [True, False] if norm is not False else [False, True]
    groups = _attribute(m, GROUP_NAMES, int) or 1
    topk_groups = _attribute(m, TOPK_GROUP_NAMES, int) or 1
    scale = _attribute(m, SCALE_NAMES, float)
    scale = float(scale) if scale is not None else float(_attribute(m, SCALE_NAMES, int) or 1)
    biased = "router_bias" in reading.roles
    group_scores = ["top2", "max"] if biased else ["max", "top2"]
    acts = ["swiglu"] if reading.gated else ["silu", "gelu", "relu"]
    ks = [top_k] if top_k is not None else list(range(1, min(reading.experts, 8) + 1))
    for k, router, norm_topk, group_score, act, router_dtype in itertools.product(
        ks, routers, norms, group_scores if groups > 1 else ["top2"], acts, ROUTER_DTYPES
    ):
        attrs: dict[str, Any] = {
            "experts": reading.experts,
            "top_k": k,
            "ffn": reading.ffn,
            "router": router,
            "norm_topk": norm_topk,
            "expert_act": act,
            "roles": list(reading.roles),
        }
        if router_dtype:
            attrs["router_dtype"] = router_dtype
        if scale != 1.0:
            attrs["route_scale"] = scale
        if groups > 1:
            attrs |= {"groups": groups, "topk_groups": topk_groups, "group_score": group_score}
        if reading.shared_ffn:
            attrs["shared_ffn"] = reading.shared_ffn
        try:
            spec_of(attrs)
        except Exception:  # noqa: BLE001 - an inconsistent combination: not a variant
            continue
        yield attrs


def _verify(
    m: nn.Module,
    params: list[tuple[str, torch.Tensor]],
    readings: list[_Reading],
    top_k: int | None,
) -> MoEFound | None:
    reading = readings[0]
    full = sum(p.numel() for _, p in params)
    reduced = _reduced_numel(params, reading)
    if full > MOE_VERIFY_NUMEL and reduced > MOE_VERIFY_NUMEL:
        return _unchecked(m, reading, top_k, f"{full:,} parameters")
    shrink = full > MOE_VERIFY_NUMEL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: on a busy 2-core machine 2 threads took 1000x longer
    # in eval mode: training-time noise (dropout, Mixtral's router jitter) is not the op's,
    # as the runtime trains with it off (`planner.graph.models.prepare_for_training`)
    training = {sub: sub.training for sub in m.modules()}
    m.eval()
    try:
        # transformers' experts in their eager loop: the grouped kernels have no float64 one
        with eager_experts(m):
            return _run_readings(m, params, readings, top_k, shrink)
    finally:
        torch.set_num_threads(threads)
        for sub, flag in training.items():
            sub.training = flag


def _run_readings(
    m: nn.Module,
    params: list[tuple[str, torch.Tensor]],
    readings: list[_Reading],
    top_k: int | None,
    shrink: bool,
) -> MoEFound | None:
    reading = readings[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*TOKENS, reading.hidden, generator=g, dtype=torch.float64)
    for r in readings:
        if (r.hidden, r.ffn, r.shared_ffn) != (reading.hidden, reading.ffn, reading.shared_ffn):
            continue
        state = {
            n: _stand_in(p, role, r, shrink, g)
            for (n, p), role in zip(params, r.roles, strict=True)
        }
        try:
            out = _call(m, state, x)
        except Exception:  # noqa: BLE001 - not a module of one tensor in, (tensor, ...) out
            if shrink:
                return _unchecked(m, reading, top_k, "its stand-in with narrow experts failed")
            return None
        y, logits = _split_output(out, x, r.experts)
        if y is None:
            return None
        weights = [state[n] for n, _ in params]
        for attrs in _variants(m, r, top_k):
            spec = _shrunk(spec_of(attrs), r, shrink)
            want = moe_math(x, weights, spec)
            if _close(y, want):
                return MoEFound(attrs, r.hidden, logits)
    return None


def _call(m: nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    """m's output on x with parameters `state` (float64)."""
    with torch.no_grad():
        return torch.func.functional_call(m, state, (x,))


@contextlib.contextmanager
def eager_experts(m: nn.Module) -> Iterator[bool]:
    """Within the block, every transformers config of m's submodules (a `config` attribute
    with a string `_experts_implementation`) set to "eager", the experts' reference loop
    (`transformers.integrations.moe.use_experts_implementation`), and restored after; yields
    whether any was switched."""
    changed: list[tuple[Any, str]] = []
    for sub in m.modules():
        config: Any = vars(sub).get("config")
        impl = getattr(config, "_experts_implementation", None)
        if isinstance(impl, str) and impl != "eager":
            changed.append((config, impl))
            config._experts_implementation = "eager"
    try:
        yield bool(changed)
    finally:
        for config, impl in reversed(changed):
            config._experts_implementation = impl


def _split_output(out: Any, x: torch.Tensor, experts: int) -> tuple[torch.Tensor | None, Any]:
    """(the block's output, its router logits' form) when `out` is a tensor like x or
    (tensor like x, router logits (tokens, E) or (..., E)); (None, None) otherwise."""
    logits = None
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        out, second = out
        flat, shaped = (tokens_of(x.shape), experts), (*x.shape[:-1], experts)
        logits = {flat: "flat", shaped: "shaped"}.get(tuple(second.shape))
        if logits is None:
            return None, None
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None, None
    return out, logits


def _close(y: torch.Tensor, want: torch.Tensor) -> bool:
    scale = max(1.0, float(want.abs().max()))
    return bool((y - want).abs().max() <= TOLERANCE * scale)


def _unchecked(m: nn.Module, reading: _Reading, top_k: int | None, why: str) -> MoEFound | None:
    if top_k is None:
        return None
    attrs = next(_variants(m, reading, top_k))
    attrs["checked"] = False
    warnings.warn(
        f"the mixture of experts {type(m).__name__} is read by its structure alone ({why}: too "
        f"big to check by running it): {attrs['router']} router, top {top_k} of "
        f"{reading.experts}; check a plan with `python -m runtime.run plan.json --check`",
        stacklevel=4,
    )
    return MoEFound(attrs, reading.hidden)


def _reduced_numel(params: list[tuple[str, torch.Tensor]], reading: _Reading) -> int:
    return sum(
        _reduced_shape(p, role, reading).numel()
        for (_, p), role in zip(params, reading.roles, strict=True)
    )


def _reduced_shape(p: torch.Tensor, role: str, reading: _Reading) -> torch.Size:
    """The shape of parameter `p` with the experts' hidden widths cut to REDUCED_FFN: the
    hidden-width axis of an (out, in) matrix is -2 for w1, w3, w13 (and their shared forms),
    -1 for w2, the other one when the role ends in "^T"."""
    base = role.split(".")[0]
    transposed = base.endswith("^T")
    base = base.removesuffix("^T")
    width = reading.shared_ffn if base.startswith("sw") else reading.ffn
    if base in ("router", "router_bias", "sgate") or width <= REDUCED_FFN:
        return p.shape
    axis = -1 if base.removeprefix("s") == "w2" else -2
    if transposed:
        axis = -3 - axis
    shape = list(p.shape)
    shape[axis] = 2 * REDUCED_FFN if base == "w13" else REDUCED_FFN
    return torch.Size(shape)


def _stand_in(
    p: torch.Tensor, role: str, reading: _Reading, shrink: bool, g: torch.Generator
) -> torch.Tensor:
    shape = _reduced_shape(p, role, reading) if shrink else p.shape
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64)


def _shrunk(spec: MoESpec, reading: _Reading, shrink: bool) -> MoESpec:
    if not shrink:
        return spec
    return dataclasses.replace(
        spec,
        ffn=min(spec.ffn, REDUCED_FFN),
        shared_ffn=min(spec.shared_ffn, REDUCED_FFN) if spec.shared_ffn else 0,
    )
