"""Mixture-of-experts layers: the `moe` op kind's arithmetic, parameters and FLOPs.

A `moe` op is a whole sparse MLP block as Mixtral (Jiang et al. 2024, Sec. 2.1), Qwen-MoE and
DeepSeek-V3 (DeepSeek-AI 2024, Sec. 2.1.2, eqs. 12-16) write it: a router (a linear of the
hidden size to E scores), the top k of E experts per token, gate weights from the scores,
the k chosen experts' MLPs on the token summed with those weights, and optionally a shared
expert every token goes through. Tokens are independent: a task owning a box of tokens (a
split of `sample` or `length`) computes its box alone. The channel is never split (the output
is a sum over experts); expert parallelism (`ParallelConfig.expert`) spreads the experts, not
the tokens, and exchanges tokens inside the op (all-to-all). Expert tensor parallelism (a
config's `reduce` r > 1: the op's internal contraction, `planner.graph.opkinds.contraction`)
cuts every expert's hidden width r ways (`ffn_shard`: w1 and w3 rows, w2 columns, the shared
expert's alike): `moe_math` on such a shard computes a partial sum of the output, the r
partial sums adding up to the whole (the router and the shared expert's gate run whole on
every shard: the gates multiply each expert's output, a linear function of its w2 columns).

Attributes of the op (`Op.attr`):

| attr | meaning |
| --- | --- |
| experts | E, the routed experts |
| top_k | k, experts per token |
| ffn | f, each routed expert's hidden width |
| router | "softmax" (Mixtral, Qwen: softmax over E, then top-k) or "sigmoid" (DeepSeek-V3) |
| norm_topk | whether the k gate weights are divided by their sum (Mixtral, DeepSeek-V3: yes) |
| router_dtype | "float32": the scores, the selection and the gate weights computed in float32 whatever the input's dtype, the gates then cast to it (Hugging Face's routers: `softmax(logits, dtype=torch.float)`); absent: in the input's dtype |
| route_scale | a factor on the gate weights (DeepSeek-V3: 2.5; default 1) |
| groups, topk_groups | group-limited routing: experts in `groups` groups, a token's k chosen in its best `topk_groups` groups (DeepSeek-V3: 8 and 4; default 1 and 1: no limit) |
| group_score | how a group is ranked: "top2" (the sum of its two best scores, DeepSeek-V3) or "max" |
| expert_act | "swiglu" (w2(silu(w1 x) * w3 x): Mixtral, Qwen, DeepSeek), "gelu", "relu" or "silu" (w2(act(w1 x))) |
| shared_ffn | the shared expert's hidden width (0: none) |
| roles | one per parameter, in order (below) |

Parameter roles (weights as `nn.Linear` stores them, (out, in), unless the role ends in "^T"):
"router" (E, h); "router_bias" (E,), added to the scores for the selection only (DeepSeek-V3's
`e_score_correction_bias`); per expert i "w1.i" (f, h), "w3.i" (f, h), "w2.i" (h, f); or, for
all experts in one tensor, "w1" (E, f, h), "w3" (E, f, h), "w13" (E, 2f, h: the gate rows
first, then the up rows, as Hugging Face's `gate_up_proj`), "w13i" (E, 2f, h: the gate and up
rows interleaved, gate row j at 2j and up row j at 2j + 1), "w2" (E, h, f); the shared expert
"sw1" (fs, h), "sw3" (fs, h), "sw2" (h, fs) and "sgate" (1, h), a sigmoid gate on the shared
expert's output (Qwen-MoE). Kernels, memory and the runtime read roles, never names.

FLOPs (`moe_flops`, 2 per multiply-add, forward) count the router and the k active experts
per token, not E, as Megatron-Core's MoE FLOP count and DeepSeek-V3's activated parameters do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from planner.errors import GraphError


class _Param(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


class Op(Protocol):
    """What this module reads of an op (`planner.graph.opgraph.Op`; a protocol, so that
    opgraph, which checks moe ops with `check_params`, is not imported back)."""

    @property
    def name(self) -> str: ...

    @property
    def attrs(self) -> tuple[tuple[str, Any], ...]: ...

    @property
    def params(self) -> tuple[_Param, ...]: ...


ROUTERS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "gelu", "relu", "silu")
GROUP_SCORES = ("top2", "max")
# roles of a routed expert's weights, per expert ("w1.3") or stacked over experts ("w1")
EXPERT_ROLES = ("w1", "w3", "w13", "w13i", "w2")
SHARED_ROLES = ("sw1", "sw3", "sw2", "sgate")
ROUTER_ROLES = ("router", "router_bias")
ROUTER_DTYPES = {"float32": torch.float32}
T = "^T"  # suffix of a role whose weight is stored (in, out)


@dataclass(frozen=True)
class MoESpec:
    """The attributes of a `moe` op, read and checked once (`moe_spec`)."""

    experts: int
    top_k: int
    ffn: int
    router: str = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2"
    expert_act: str = "swiglu"
    shared_ffn: int = 0
    roles: tuple[str, ...] = ()
    router_dtype: str = ""

    @property
    def gated(self) -> bool:
        return self.expert_act == "swiglu"

    @property
    def matrices(self) -> int:
        """Weight matrices per expert MLP: 3 gated (w1, w3, w2), else 2."""
        return 3 if self.gated else 2


def moe_spec(op: Op) -> MoESpec:
    """The `MoESpec` of a moe op; GraphError naming the op when an attribute is missing or
    out of range."""
    attrs = {k: v for k, v in op.attrs}
    return spec_of(attrs, op.name)


def spec_of(attrs: Mapping[str, Any], name: str = "moe") -> MoESpec:
    """`MoESpec` from an attribute mapping (`moe_spec` for an op)."""

    def refuse(what: str) -> GraphError:
        return GraphError(f"moe op {name!r}: {what}; see planner.graph.moe for its attributes")

    for key in ("experts", "top_k", "ffn"):
        if key not in attrs:
            raise refuse(f"attribute {key!r} is missing")
    spec = MoESpec(
        experts=int(attrs["experts"]),
        top_k=int(attrs["top_k"]),
        ffn=int(attrs["ffn"]),
        router=str(attrs.get("router", "softmax")),
        norm_topk=bool(attrs.get("norm_topk", True)),
        route_scale=float(attrs.get("route_scale", 1.0)),
        groups=int(attrs.get("groups", 1)),
        topk_groups=int(attrs.get("topk_groups", 1)),
        group_score=str(attrs.get("group_score", "top2")),
        expert_act=str(attrs.get("expert_act", "swiglu")),
        shared_ffn=int(attrs.get("shared_ffn", 0)),
        roles=tuple(str(r) for r in attrs.get("roles", ())),
        router_dtype=str(attrs.get("router_dtype") or ""),
    )
    if spec.experts < 1 or spec.ffn < 1 or not 1 <= spec.top_k <= spec.experts:
        raise refuse(
            f"needs 1 <= top_k <= experts and ffn >= 1 (got top_k {spec.top_k}, experts "
            f"{spec.experts}, ffn {spec.ffn})"
        )
    if spec.router not in ROUTERS:
        raise refuse(f"router {spec.router!r} is not one of {', '.join(ROUTERS)}")
    if spec.expert_act not in ACTIVATIONS:
        raise refuse(f"expert_act {spec.expert_act!r} is not one of {', '.join(ACTIVATIONS)}")
    if spec.router_dtype and spec.router_dtype not in ROUTER_DTYPES:
        raise refuse(
            f"router_dtype {spec.router_dtype!r} is not one of {', '.join(ROUTER_DTYPES)} (or absent)"
        )
    if spec.group_score not in GROUP_SCORES:
        raise refuse(f"group_score {spec.group_score!r} is not one of {', '.join(GROUP_SCORES)}")
    if spec.groups < 1 or spec.experts % spec.groups or not 1 <= spec.topk_groups <= spec.groups:
        raise refuse(
            f"groups {spec.groups} must divide the {spec.experts} experts and topk_groups "
            f"{spec.topk_groups} be between 1 and groups"
        )
    if spec.topk_groups * (spec.experts // spec.groups) < spec.top_k:
        raise refuse(
            f"top_k {spec.top_k} is more than the {spec.topk_groups} groups of "
            f"{spec.experts // spec.groups} experts a token may use"
        )
    return spec


# -- parameter roles ----------------------------------------------------------------------------


def split_role(role: str) -> tuple[str, int | None, bool]:
    """(base, expert index or None for a stacked or non-expert weight, stored transposed)."""
    transposed = role.endswith(T)
    role = role[: -len(T)] if transposed else role
    base, _, index = role.partition(".")
    return base, (int(index) if index else None), transposed


def expert_of(role: str) -> int | None:
    """The routed expert a per-expert weight belongs to (None: stacked, router or shared)."""
    base, index, _ = split_role(role)
    return index if base in EXPERT_ROLES else None


def is_routed(role: str) -> bool:
    """Whether the weight is a routed expert's (per expert or stacked over experts): the
    weights expert parallelism spreads."""
    return split_role(role)[0] in EXPERT_ROLES


def expected_shape(spec: MoESpec, role: str, hidden: int) -> tuple[int, ...]:
    """The shape a parameter of `role` must have on a moe op of width `hidden`."""
    base, index, transposed = split_role(role)
    e, f, fs = spec.experts, spec.ffn, spec.shared_ffn
    shapes: dict[str, tuple[int, ...]] = {
        "router": (e, hidden),
        "router_bias": (e,),
        "w1": (f, hidden),
        "w3": (f, hidden),
        "w13": (2 * f, hidden),
        "w13i": (2 * f, hidden),
        "w2": (hidden, f),
        "sw1": (fs, hidden),
        "sw3": (fs, hidden),
        "sw2": (hidden, fs),
        "sgate": (1, hidden),
    }
    if base not in shapes:
        known = ", ".join([*ROUTER_ROLES, *EXPERT_ROLES, *SHARED_ROLES])
        raise GraphError(f"unknown moe parameter role {role!r}; known roles: {known}")
    shape = shapes[base]
    if transposed and len(shape) == 2:
        shape = shape[::-1]
    if base in EXPERT_ROLES and index is None:
        shape = (e, *shape)
    return shape


# where each role holds the experts' hidden width, as stored: (axis, blocks of it on the axis);
# an interleaved w13i is one block of 2f rows whose contiguous slices keep their gate/up pairs
_FFN_AXES = {"w1": (0, 1), "w3": (0, 1), "w13": (0, 2), "w13i": (0, 1), "w2": (1, 1)}
_FFN_AXES |= {"s" + base: axes for base, axes in _FFN_AXES.items() if not base.startswith("w13")}


def ffn_axis(role: str) -> tuple[int, int] | None:
    """(axis, blocks) of the hidden width f (a shared expert's: fs) in a parameter of `role`
    as stored (`expected_shape`): w1 and w3 rows, w2 columns, one block each, w13 two (the
    gate rows, then the up rows), w13i one (2f interleaved rows: a slice of an even number of
    them holds whole gate/up pairs); None for the router, its bias and the shared gate."""
    base, index, transposed = split_role(role)
    if base not in _FFN_AXES:
        return None
    axis, blocks = _FFN_AXES[base]
    if transposed:
        axis = 1 - axis
    if base in EXPERT_ROLES and index is None:  # stacked: the experts lead
        axis += 1
    return axis, blocks


def ffn_shard(p: torch.Tensor, role: str, part: int, parts: int) -> torch.Tensor:
    """Slice `part` of `parts` of the hidden width of parameter `p` of `role` (`ffn_axis`;
    of each block: a w13 keeps its gate and its up rows of the slice): expert tensor
    parallelism's shard. `p` itself when its role has no hidden width or `parts` is 1."""
    found = ffn_axis(role)
    if found is None or parts == 1:
        return p
    axis, blocks = found
    width = p.shape[axis] // blocks
    step = width // parts  # w13i: 2f / parts rows, whole pairs as parts divides f
    pieces = [p.narrow(axis, b * width + part * step, step) for b in range(blocks)]
    return pieces[0] if blocks == 1 else torch.cat(pieces, dim=axis)


def ffn_shard_shape(shape: Sequence[int], role: str, parts: int) -> tuple[int, ...]:
    """The shape of `ffn_shard`'s slices of a parameter shaped `shape`."""
    found = ffn_axis(role)
    out = list(shape)
    if found is not None:
        out[found[0]] //= parts
    return tuple(out)


def check_params(op: Op, hidden: int, output_channels: int) -> None:
    """GraphError unless op's parameters match its roles: a router, every expert's weights
    once (all per expert or all stacked), a shared expert when `shared_ffn` says so, shapes
    from the attributes and the input's `hidden` channels."""
    spec = moe_spec(op)

    def refuse(what: str) -> GraphError:
        return GraphError(f"moe op {op.name!r}: {what}; make its parameters, roles and attrs agree")

    if output_channels != hidden:
        raise refuse(f"its output has {output_channels} channels, its input {hidden}")
    if len(spec.roles) != len(op.params):
        raise refuse(f"{len(op.params)} parameters but {len(spec.roles)} roles")
    for param, role in zip(op.params, spec.roles, strict=True):
        want = expected_shape(spec, role, hidden)
        if tuple(param.shape) != want:
            raise refuse(f"parameter {param.name!r} ({role}) has shape {param.shape}, not {want}")
    bases = [split_role(r)[0] for r in spec.roles]
    if bases.count("router") != 1:
        raise refuse("it needs exactly one 'router' parameter")
    fused = [b for b in ("w13", "w13i") if b in bases]
    gate_up = tuple(fused[:1]) if fused else ("w1", "w3") if spec.gated else ("w1",)
    for base in (*gate_up, "w2"):
        indices = [split_role(r)[1] for r in spec.roles if split_role(r)[0] == base]
        if indices != [None] and sorted(i for i in indices if i is not None) != list(
            range(spec.experts)
        ):
            raise refuse(f"its {base!r} weights must be one stacked tensor or one per expert")
    shared = [b for b in bases if b in ("sw1", "sw3", "sw2")]
    want_shared = ["sw1", "sw3", "sw2"] if spec.gated else ["sw1", "sw2"]
    if spec.shared_ffn and sorted(shared) != sorted(want_shared):
        raise refuse(f"shared_ffn {spec.shared_ffn} needs shared weights {want_shared}")
    if not spec.shared_ffn and (shared or "sgate" in bases):
        raise refuse("it has shared-expert weights but shared_ffn is 0")


# -- arithmetic ---------------------------------------------------------------------------------


_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": torch.nn.functional.silu,
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
}


class Weights:
    """A moe op's parameters by role: `expert(i)` gives expert i's (w1, w3, w2) as (out, in)
    matrices (w3 None when not gated), whether stored per expert, stacked or fused."""

    def __init__(self, spec: MoESpec, params: Sequence[torch.Tensor]) -> None:
        if len(params) != len(spec.roles):
            raise GraphError(f"moe op has {len(spec.roles)} roles, got {len(params)} parameters")
        self.spec = spec
        self.by_role: dict[tuple[str, int | None], torch.Tensor] = {}
        for p, role in zip(params, spec.roles, strict=True):
            base, index, transposed = split_role(role)
            if transposed:
                p = p.transpose(-1, -2)
            self.by_role[(base, index)] = p

    def get(self, base: str, index: int | None = None) -> torch.Tensor | None:
        """The (out, in) matrix of `base` for expert `index` (stacked weights sliced)."""
        if (base, index) in self.by_role:
            return self.by_role[(base, index)]
        stacked = self.by_role.get((base, None))
        if stacked is None or index is None:
            return stacked
        return stacked[index]

    def expert(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        w13, w13i = self.get("w13", i), self.get("w13i", i)
        w1: torch.Tensor | None
        w3: torch.Tensor | None
        if w13 is not None:
            f = w13.shape[0] // 2
            w1, w3 = w13[:f], w13[f:]
        elif w13i is not None:
            w1, w3 = w13i[0::2], w13i[1::2]
        else:
            w1, w3 = self.get("w1", i), self.get("w3", i)
        w2 = self.get("w2", i)
        if w1 is None or w2 is None:
            raise GraphError(f"moe op has no weights for expert {i}")
        return w1, w3, w2


def mlp(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor | None, w2: torch.Tensor, act: str
) -> torch.Tensor:
    """One expert's MLP on tokens x (T, h): w2(act(w1 x) * w3 x), or w2(act(w1 x))."""
    hidden = _ACT[act](x @ w1.T)
    if w3 is not None and act == "swiglu":
        hidden = hidden * (x @ w3.T)
    return hidden @ w2.T


def route(x: torch.Tensor, spec: MoESpec, weights: Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate weights (T, k), expert indices (T, k)) of tokens x (T, h) (module docstring).
    With `router_dtype` the logits are cast to it, and the scores, the selection and the gate
    weights computed in it, the gates cast back to x's dtype (autograd casts their gradient
    alike), as Hugging Face's routers do."""
    router = weights.get("router")
    assert router is not None
    logits = x @ router.T
    if spec.router_dtype:
        logits = logits.to(ROUTER_DTYPES[spec.router_dtype])
    scores = torch.softmax(logits, dim=-1) if spec.router == "softmax" else torch.sigmoid(logits)
    chosen = scores
    bias = weights.get("router_bias")
    if bias is not None:
        chosen = chosen + bias.to(chosen.dtype)
    if spec.groups > 1:
        chosen = _limit_groups(chosen, spec)
    index = torch.topk(chosen, spec.top_k, dim=-1).indices
    gate = scores.gather(-1, index)
    if spec.norm_topk:
        gate = gate / gate.sum(dim=-1, keepdim=True)
    if spec.route_scale != 1.0:
        gate = gate * spec.route_scale
    return gate.to(x.dtype), index


def _limit_groups(scores: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """Scores with the experts outside each token's best `topk_groups` groups at -inf
    (DeepSeek-V3's node-limited routing, Sec. 2.1.2)."""
    grouped = scores.view(*scores.shape[:-1], spec.groups, -1)
    if spec.group_score == "top2":
        rank = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    else:
        rank = grouped.amax(dim=-1)
    best = rank.topk(spec.topk_groups, dim=-1).indices
    keep = torch.zeros_like(rank, dtype=torch.bool).scatter(-1, best, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf"))
    return masked.flatten(-2)


def experts_forward(
    x: torch.Tensor,
    gate: torch.Tensor,
    index: torch.Tensor,
    spec: MoESpec,
    weights: Weights,
    experts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Sum over the chosen experts in `experts` (default all) of gate x expert(token), in
    ascending expert order (as the reference loops run them): tokens x (T, h)."""
    out = torch.zeros_like(x)
    for i in range(spec.experts) if experts is None else experts:
        token, slot = torch.nonzero(index == i, as_tuple=True)
        if token.numel() == 0:
            continue
        w1, w3, w2 = weights.expert(i)
        y = mlp(x[token], w1, w3, w2, spec.expert_act) * gate[token, slot].unsqueeze(-1)
        out = out.index_add(0, token, y)
    return out


def shared_forward(x: torch.Tensor, spec: MoESpec, weights: Weights) -> torch.Tensor | None:
    """The shared expert's output on tokens x (T, h), gated when it has a gate; None when
    the op has no shared expert."""
    if not spec.shared_ffn:
        return None
    sw1, sw2 = weights.get("sw1"), weights.get("sw2")
    assert sw1 is not None and sw2 is not None
    y = mlp(x, sw1, weights.get("sw3"), sw2, spec.expert_act)
    sgate = weights.get("sgate")
    if sgate is not None:
        y = y * torch.sigmoid(x @ sgate.T)
    return y


def moe_math(x: torch.Tensor, params: Sequence[torch.Tensor], spec: MoESpec) -> torch.Tensor:
    """The moe block on x (..., h): the one definition the kernel, the recogniser and the
    runtime compute (module docstring)."""
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    weights = Weights(spec, params)
    gate, index = route(tokens, spec, weights)
    out = experts_forward(tokens, gate, index, spec, weights)
    shared = shared_forward(tokens, spec, weights)
    if shared is not None:
        out = out + shared
    return out.reshape(shape)


# -- FLOPs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEFlops:
    """Forward FLOPs of a moe op by part (2 per multiply-add)."""

    router: float
    experts: float  # the k active experts' MLPs (an expert-parallel rank's share varies)
    shared: float

    @property
    def total(self) -> float:
        return self.router + self.experts + self.shared


def moe_flops(spec: MoESpec, hidden: int, tokens: int) -> MoEFlops:
    """Forward FLOPs of `tokens` tokens through a moe op of width `hidden`: the router's
    2hE, the k active experts' 2 x matrices x h x f each and the shared expert's (with its
    gate's 2h) per token. Gate arithmetic (softmax, top-k, the weighted sum) is not counted,
    as in Megatron-Core's and the published MoE FLOP counts."""
    router = 2.0 * hidden * spec.experts
    experts = spec.top_k * 2.0 * spec.matrices * hidden * spec.ffn
    shared = 2.0 * spec.matrices * hidden * spec.shared_ffn
    if "sgate" in (split_role(r)[0] for r in spec.roles):
        shared += 2.0 * hidden
    return MoEFlops(router * tokens, experts * tokens, shared * tokens)


def routed_param_count(spec: MoESpec, hidden: int) -> int:
    """Parameters of the routed experts (what expert parallelism divides)."""
    return spec.experts * spec.matrices * hidden * spec.ffn


def tokens_of(shape: Sequence[int]) -> int:
    """Tokens in a (..., h) tensor."""
    return math.prod(shape[:-1])
