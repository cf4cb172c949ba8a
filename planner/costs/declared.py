"""Declared op kinds checked against the kernels that compute them.

A module may declare its op kind (`layerwise_kind`, `layerwise_attrs()`); capture then
plans it as that kind and the runtime computes it with that kind's kernel, not with the
module's code. `check_declared` (given to `planner.graph.capture.capture` as its `check`)
runs both on a random float64 input and refuses a difference, naming the op.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from planner.costs.config import ParallelConfig
from planner.costs.kernels import plan_task, run_task
from planner.errors import GraphError
from planner.graph.capture import Declared
from planner.graph.opgraph import OpGraph

__all__ = ["check_declared"]


def _node_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def check_declared(
    graph: OpGraph,
    declared: Sequence[Declared],
    values: dict[fx.Node, Any],
) -> None:
    """No declared kind is taken on trust: every op of a module that declares its kind
    (`layerwise_kind`) is run both ways on a random float64 input, by the module's own forward
    and by the kernel the runtime computes the kind with (`planner.costs.kernels.run_task`),
    and a difference raises GraphError naming the op. Skipped for a module whose parameters
    are on the meta device (nothing to compute with): the runtime checks when it runs."""
    index = {op.name: i for i, op in enumerate(graph.ops)}
    for name, m, node in declared:
        tensors = list(m.parameters()) + list(m.buffers())
        if any(t.is_meta for t in tensors):
            continue
        g = torch.Generator().manual_seed(0)
        made: dict[fx.Node, torch.Tensor] = {}

        def random(
            a: fx.Node, made: dict[fx.Node, torch.Tensor] = made, g: torch.Generator = g
        ) -> Any:
            v = values.get(a)
            if not isinstance(v, torch.Tensor):
                return v
            if a in made:
                return made[a]
            if not v.is_floating_point():
                made[a] = torch.zeros(tuple(v.shape), dtype=v.dtype)
            else:
                made[a] = torch.randn(tuple(v.shape), generator=g, dtype=torch.float64)
            return made[a]

        args = fx.node.map_arg(node.args, random)
        kwargs = fx.node.map_arg(node.kwargs, random)
        state = {
            k: v.detach().to(torch.float64) if v.is_floating_point() else v
            for k, v in itertools.chain(m.named_parameters(), m.named_buffers())
        }
        i = index[name]
        op = graph.ops[i]
        try:
            with torch.no_grad():
                want = torch.func.functional_call(m, state, tuple(args), dict(kwargs))
                plan = plan_task(graph, i, ParallelConfig((1,) * len(op.output.dims), (0,)))
                xs = [made[a] for a in _node_args(node) if a in made]
                params = [state[k] for k, _ in m.named_parameters()]
                got = run_task(plan, xs, params)
        except GraphError as exc:
            raise GraphError(
                f"op {name!r} ({type(m).__name__}) is declared as {op.kind!r}: {exc}"
            ) from None
        want = want[0] if isinstance(want, tuple | list) else want
        scale = float(want.abs().max()) or 1.0
        error = float((got - want).abs().max()) / scale if got.shape == want.shape else math.inf
        if not error <= 1e-9:
            raise GraphError(
                f"op {name!r} ({type(m).__module__}.{type(m).__name__}) is declared as "
                f"{op.kind!r} {dict(op.attrs) or ''} but computes something else: its forward "
                f"and layerwise's {op.kind} kernel differ by {error:.2g} (relative) on a random "
                "input; declare the kind and attrs it computes (layerwise_attrs), or drop "
                "layerwise_kind and let capture read its code"
            )
