"""A transformer's architecture as its graph says it: what a launcher's model arguments need.

Megatron-LM and torchtitan build their own model from arguments (a GPT of `--num-layers`
layers, `--swiglu`, `--normalization RMSNorm`, ...), so an export that gave only the sizes
would train another model than the plan's. `read_architecture(graph)` reads the model's
design from its ops, never from a model's name:

- the token embedding (the embedding an input feeds: its rows are the vocabulary), what runs
  between it and the first numbered block (a position table: an op holding a (positions,
  width) parameter; a scale: an elementwise product), the head (the last linear outside the
  blocks as wide as the vocabulary: tied when it holds the embedding's weight) and what runs
  between the head and the loss (a soft cap);
- in every numbered block (`layers.3`): the attention op (heads, key-value heads, head
  width, rotary embeddings and how many channels they turn, QK-norm, a sliding window, a
  soft cap, the scale), the linears it reads (q, k, v: the block's linears it depends on;
  with MLA the down- and up-projections whose widths are its ranks), the ones that read it
  (its output projection) and the others (the MLP: its last one the down-projection, whose
  input width is the MLP's hidden width; gated when that input is the product of two
  branches, the activation the one on either branch), their biases, the block's norms
  (those of the model's width that no linear of the block feeds into the attention: not
  MLA's norms of its latents), norms applied to the attention's or MLP's output before the
  residual add, and a mixture of experts (`moe` op: `planner.graph.moe.MoESpec`).

The launchers map these facts onto their own names and say in one line what they cannot
express (`planner.export.launchers.megatron`, `torchtitan`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.costs.recompute import block_of
from planner.graph.moe import MoESpec, moe_spec, split_role
from planner.graph.opgraph import Op, OpGraph
from planner.graph.opkinds import CHANNEL

__all__ = ["Architecture", "read_architecture"]

_NOT_ACTIVATIONS = ("dropout", "mul", "add", "identity")


@dataclass(frozen=True)
class Architecture:
    """A decoder's design, read from its graph (module docstring). None: the graph does not
    say (or has no such part). Per-layer facts are tuples over the numbered blocks."""

    layers: int
    hidden: int | None = None
    vocab: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None  # a query/key head's channels
    v_head_dim: int | None = None
    ffn: int | None = None  # the dense MLP's hidden width
    gated: bool = False  # w2(act(w1 x) * w3 x)
    activation: str | None = None  # the MLP's ("silu", "gelu_tanh", ...)
    norm: str | None = None  # "rms" or "layer"
    norm_eps: float | None = None
    norm_offset: float = 0.0  # the scale is offset + weight (Gemma's 1 + weight)
    post_norms: bool = False  # norms on the attention's and the MLP's outputs too
    position: str = "none"  # "rope", "learned" or "none"
    rope: str | None = None  # how rotary embeddings pair channels ("half": rotate-half)
    rope_dim: int | None = None  # channels of a head they turn, when not all
    positions: int | None = None  # a learned position table's rows
    tied: bool = False  # the head's weight is the embedding's
    bias: str = "none"  # on the blocks' linears: "none", "qkv" (only q, k, v), "all", "mixed"
    head_bias: bool = False
    final_norm: bool = True
    qk_norm: str | None = None
    qk_norm_offset: float = 0.0
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (keys it sees)
    softcap: float | None = None  # attention scores' cap * tanh(scores / cap)
    scale: float | None = None  # the attention's scale when it is not 1/sqrt(head_dim)
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    moe: MoESpec | None = None
    moe_layers: tuple[bool, ...] = ()
    embedding_ops: tuple[str, ...] = ()  # between the embedding and the first layer
    logit_ops: tuple[str, ...] = ()  # between the head and the loss
    dropout: bool = False  # any dropout op
    mixed: tuple[str, ...] = field(default=())  # what differs between layers

    @property
    def moe_shared_gate(self) -> bool:
        """A sigmoid gate on the shared expert's output (the `sgate` role)."""
        return self.moe is not None and "sgate" in {split_role(r)[0] for r in self.moe.roles}

    @property
    def moe_router_bias(self) -> bool:
        """A bias added to the router's scores for the selection only (`router_bias`)."""
        return self.moe is not None and "router_bias" in self.moe.roles


@dataclass(frozen=True)
class _Block:
    """What one numbered block says."""

    attention: Op | None
    qkv: tuple[Op, ...]
    out: tuple[Op, ...]
    mlp: tuple[Op, ...]
    moe: Op | None
    norms: tuple[Op, ...]
    internal: tuple[Op, ...]  # norms inside the attention's inputs (MLA's latents)
    post_norms: bool
    ffn: int | None
    gated: bool
    activation: str | None


def read_architecture(graph: OpGraph) -> Architecture:
    """The architecture of `graph`'s numbered blocks and what surrounds them."""
    blocks = _blocks(graph)
    embed = _token_embedding(graph)
    hidden = embed.output.size(CHANNEL) if embed and CHANNEL in embed.output.dims else None
    vocab = embed.params[0].shape[0] if embed and embed.params else None
    facts = [_read_block(graph, ops, hidden) for ops in blocks]
    arch: dict[str, object] = {"layers": len(blocks), "hidden": hidden, "vocab": vocab}
    arch |= _surroundings(graph, embed, blocks, hidden, vocab)
    mixed: list[str] = []
    for part in (_attention(facts, mixed), _mlp(facts, mixed), _norms(facts, mixed)):
        arch |= part
    arch |= {"bias": _bias(facts), "mixed": tuple(mixed)}
    arch["dropout"] = any(
        op.attr("op") == "dropout" or "dropout" in (op.attr("fused_ops") or ()) for op in graph.ops
    )
    return Architecture(**arch)  # type: ignore[arg-type]


# -- the graph's parts ----------------------------------------------------------------------


def _blocks(graph: OpGraph) -> list[list[Op]]:
    """The ops of each numbered block, blocks in graph order."""
    out: dict[str, list[Op]] = {}
    for op in graph.ops:
        found = block_of(op.name)
        if found is not None:
            out.setdefault(found[0], []).append(op)
    return list(out.values())


def _token_embedding(graph: OpGraph) -> Op | None:
    """The first embedding that an input op feeds."""
    for op in graph.ops:
        if op.kind == "embedding" and all(graph.op(n).kind == "input" for n in op.inputs):
            return op
    return None


def _producer(graph: OpGraph, op: Op) -> Op:
    return graph.op(op.inputs[0])


def _acts(op: Op) -> list[str]:
    """The pointwise functions `op` computes: its own (an elementwise op's) and those folded
    into it, dropout and arithmetic aside."""
    names = [str(op.attr("op"))] if op.kind == "elementwise" and op.attr("op") else []
    names += [str(f) for f in op.attr("fused_ops") or ()]
    return [n for n in names if n not in _NOT_ACTIVATIONS]


def _surroundings(
    graph: OpGraph, embed: Op | None, blocks: Sequence[Sequence[Op]], hidden: int | None,
    vocab: int | None,
) -> dict[str, object]:  # fmt: skip
    """Positions, scaled embeddings, the head and what follows it, the final norm."""
    out: dict[str, object] = {}
    first = graph.index(blocks[0][0].name) if blocks else len(graph.ops)
    start = graph.index(embed.name) + 1 if embed else 0
    extra = []
    for op in graph.ops[start:first]:
        table = [p for p in op.params if len(p.shape) == 2 and p.shape[-1] == hidden]
        if table:  # a learned position table added to the token embeddings
            out |= {"position": "learned", "positions": table[0].shape[0]}
        elif op.kind != "input" and op.attr("op") not in ("add", "dropout"):
            extra.append(str(op.attr("op") or op.kind))
        extra += _acts(op) if op.attr("op") != "dropout" else []
    out["embedding_ops"] = tuple(extra)
    head = next(
        (
            op
            for op in reversed(graph.ops[first:])
            if op.kind == "linear"
            and block_of(op.name) is None
            and CHANNEL in op.output.dims
            and op.output.size(CHANNEL) == vocab
        ),
        None,
    )
    if head is None or embed is None:
        return out
    weights = [p for p in head.params if len(p.shape) == 2]
    out["tied"] = bool(
        (head.param_group is not None and head.param_group == embed.param_group)
        or (weights and embed.params and weights[0].name == embed.params[0].name)
    )
    out["head_bias"] = any(len(p.shape) == 1 for p in head.params)
    before = _producer(graph, head)
    while before.kind == "slice":
        before = _producer(graph, before)
    out["final_norm"] = before.kind == "norm"
    after, op = [], head
    while len(graph.consumers[graph.index(op.name)]) == 1:
        op = graph.ops[graph.consumers[graph.index(op.name)][0]]
        if op.kind == "softmax":
            break
        after += [str(op.attr("op") or op.kind), *[str(f) for f in op.attr("fused_ops") or ()]]
    out["logit_ops"] = tuple(after)
    return out


def _read_block(graph: OpGraph, ops: Sequence[Op], hidden: int | None) -> _Block:
    names = {op.name for op in ops}
    attention = next((op for op in ops if op.kind == "attention"), None)
    ancestors = _ancestors(graph, attention, names) if attention else set()
    linears = [op for op in ops if op.kind == "linear"]
    qkv = tuple(op for op in linears if op.name in ancestors)
    out = tuple(op for op in linears if attention and _reads(graph, op, attention.name))
    mlp = tuple(op for op in linears if op not in qkv and op not in out)
    internal = tuple(
        op
        for op in ops
        if op.kind == "norm"
        and op.name in ancestors
        and any(lin.name in _ancestors(graph, op, names) for lin in qkv)
    )
    norms = tuple(
        op
        for op in ops
        if op.kind == "norm"
        and op not in internal
        and CHANNEL in op.output.dims
        and op.output.size(CHANNEL) == hidden
    )
    moe = next((op for op in ops if op.kind == "moe"), None)
    ends = {op.name for op in (*out, *mlp[-1:], *([moe] if moe else []))}
    post = any(_producer(graph, n).name in ends for n in norms if n.inputs)
    ffn, gated, act = _dense_mlp(graph, mlp, names)
    return _Block(attention, qkv, out, mlp, moe, norms, internal, post, ffn, gated, act)


def _ancestors(graph: OpGraph, op: Op, inside: set[str]) -> set[str]:
    """The ops of `inside` that `op` depends on."""
    seen: set[str] = set()
    stack = [n for n in op.inputs if n in inside]
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack += [n for n in graph.op(name).inputs if n in inside]
    return seen


def _reads(graph: OpGraph, op: Op, name: str) -> bool:
    """Whether `op` reads `name`'s output, directly or through slices."""
    for n in op.inputs:
        src = graph.op(n)
        while src.kind == "slice" and src.name != name:
            src = _producer(graph, src)
        if src.name == name:
            return True
    return False


def _dense_mlp(
    graph: OpGraph, mlp: Sequence[Op], inside: set[str]
) -> tuple[int | None, bool, str | None]:
    """(hidden width, gated, activation) of the MLP whose last linear is `mlp[-1]`."""
    if not mlp:
        return None, False, None
    down = mlp[-1]
    src = _producer(graph, down)
    while src.kind == "elementwise" and src.attr("op") == "dropout":
        src = _producer(graph, src)
    width = src.output.size(CHANNEL) if CHANNEL in src.output.dims else None
    gated = src.kind == "elementwise" and src.attr("op") == "mul" and len(src.inputs) == 2
    branches = [graph.op(n) for n in src.inputs] if gated else [src]
    acts = []
    for op in branches:
        while True:
            acts += _acts(op)
            if op.kind == "linear" or not op.inputs or op.inputs[0] not in inside:
                break
            op = _producer(graph, op)
    return width, gated, acts[0] if acts else None


# -- the facts over all blocks ----------------------------------------------------------------


def _attention(facts: Sequence[_Block], mixed: list[str]) -> dict[str, object]:
    attentions = [f.attention for f in facts if f.attention is not None]
    if not attentions:
        return {}
    a = attentions[0]
    heads = int(a.attr("heads", 0)) or None
    out: dict[str, object] = {"heads": heads, "kv_heads": int(a.attr("kv_heads", 0)) or heads}
    width = a.output.size(CHANNEL) if CHANNEL in a.output.dims else None
    v_head = int(a.attr("v_head_dim", 0)) or (width // heads if width and heads else None)
    head = int(a.attr("head_dim", 0)) or v_head
    out |= {"head_dim": head, "v_head_dim": v_head}
    scale = float(a.attr("scale", 0.0) or 0.0)
    if head and scale and not math.isclose(scale, head**-0.5, rel_tol=1e-6):
        out["scale"] = scale
    if a.attr("rope"):
        out |= {"position": "rope", "rope": str(a.attr("rope"))}
        if a.attr("rope_dim"):
            out["rope_dim"] = int(a.attr("rope_dim"))
    if a.attr("qk_norm"):
        out |= {"qk_norm": str(a.attr("qk_norm")),
                "qk_norm_offset": float(a.attr("qk_norm_offset") or 0.0)}  # fmt: skip
    if a.attr("softcap"):
        out["softcap"] = float(a.attr("softcap"))
    out["windows"] = tuple(
        int(f.attention.attr("window")) if f.attention and f.attention.attr("window") else None
        for f in facts
    )
    if a.attr("mla"):
        out |= {"mla": True, **_mla_ranks(facts[0])}
    keys = ("heads", "kv_heads", "head_dim", "v_head_dim", "rope", "rope_dim", "qk_norm", "mla",
            "softcap", "scale")  # fmt: skip
    if any(tuple(b.attr(k) for k in keys) != tuple(a.attr(k) for k in keys) for b in attentions):
        mixed.append("attention")
    if len(attentions) != len(facts):
        mixed.append("layers without attention")
    return out


def _mla_ranks(block: _Block) -> dict[str, object]:
    """MLA's ranks: the widths its q and kv up-projections read (a latent of q only when
    the q projection reads one of the block's internal norms)."""
    out: dict[str, object] = {}
    if block.attention is None:
        return out
    inner = {op.name: op for op in block.internal}
    qkv = {op.name: op for op in block.qkv}
    for key, position in (("q_lora_rank", 0), ("kv_lora_rank", 1)):
        op = qkv.get(block.attention.inputs[position])
        if op is not None:
            src = op.inputs[0] if op.inputs else None
            out[key] = inner[src].output.size(CHANNEL) if src in inner else None
    return out


def _mlp(facts: Sequence[_Block], mixed: list[str]) -> dict[str, object]:
    dense = [f for f in facts if f.moe is None and f.ffn]
    moes = [f.moe for f in facts if f.moe is not None]
    out: dict[str, object] = {"moe_layers": tuple(f.moe is not None for f in facts)}
    if dense:
        d = dense[0]
        out |= {"ffn": d.ffn, "gated": d.gated, "activation": d.activation}
        if any((f.ffn, f.gated, f.activation) != (d.ffn, d.gated, d.activation) for f in dense):
            mixed.append("MLP")
    if any(f.moe is None and not f.ffn for f in facts):
        mixed.append("layers without an MLP")
    if moes:
        out["moe"] = spec = moe_spec(moes[0])
        if any(moe_spec(m) != spec for m in moes):
            mixed.append("mixture of experts")
    return out


def _norms(facts: Sequence[_Block], mixed: list[str]) -> dict[str, object]:
    norms = [n for f in facts for n in f.norms]
    out: dict[str, object] = {"post_norms": any(f.post_norms for f in facts)}
    if norms:
        n = norms[0]
        keys = ("norm", "eps", "offset")
        if any(tuple(m.attr(k) for k in keys) != tuple(n.attr(k) for k in keys) for m in norms):
            mixed.append("norms")
        eps = n.attr("eps")
        out |= {
            "norm": str(n.attr("norm") or "layer"),
            "norm_eps": float(eps) if eps is not None else None,
            "norm_offset": float(n.attr("offset") or 0.0),
        }
    return out


def _bias(facts: Sequence[_Block]) -> str:
    """ "none", "qkv" (biases on q, k and v only), "all" or "mixed"."""

    def biased(op: Op) -> bool:
        return any(len(p.shape) == 1 for p in op.params)

    qkv = [biased(op) for f in facts for op in f.qkv]
    other = [biased(op) for f in facts for op in (*f.out, *f.mlp)]
    if not any(qkv + other):
        return "none"
    if all(qkv + other):
        return "all"
    if qkv and all(qkv) and not any(other):
        return "qkv"
    return "mixed"
