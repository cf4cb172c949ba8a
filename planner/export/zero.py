"""ZeRO in the DTensor export: FSDP2 for stages 2-3, ZeroRedundancyOptimizer for stage 1.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC'20), Sec. 5.1-5.3: the optimizer state (stage 1), the gradients (2) and the weights (3) of
each parameter are partitioned over its data-parallel replicas. `planner.export.dtensor` says which
modules are sharded over which mesh dims (`ExportPlan.sharded`); this module applies it:

- stages 2 and 3 (`fully_shard`): each module of `sharded` (modules that share a parameter
  together, then the root) becomes an FSDP2 unit over the DTensor mesh itself
  (`DataParallelMeshDims(shard=<its dims>)`: its parameters are already replicated DTensors
  on those dims). DTensor leaves the gradients of a sample split as partial sums, so they are
  reduce-scattered summed (`set_gradient_divide_factor(1.0)`), not averaged; a gradient that
  DTensor leaves whole on every rank (batch norm's, a replicated fallback's) is made a
  partial sum first (`_summable_gradients`), or it would be summed once per rank;
- stage 1 (`ZeroOneOptimizer`): gradients are all-reduced as without ZeRO, then
  `torch.distributed.optim.ZeroRedundancyOptimizer` steps each parameter on the rank that owns
  its state and broadcasts it, over the process group of the dims that replicate it. It runs
  on the parameters' local tensors: on DTensor parameters its broadcast fails
  (`NotImplementedError: Operator c10d.broadcast_.default does not have a sharding strategy
  registered`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from planner.errors import ExportError

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ZeroOneOptimizer", "fully_shard_plan"]


def fully_shard_plan(
    module: nn.Module,
    mesh: DeviceMesh,
    sharded: Sequence[tuple[str, tuple[int, ...]]],
    tied: Sequence[set[str]],
    reshard_after_forward: bool,
) -> None:
    """FSDP2 on each module path of `sharded` over its mesh dims (bottom-up; modules that hold
    one parameter, `tied`, in one unit), then on `module` itself (the root FSDP2 needs; it
    shards its own parameters if "" is in `sharded`, and ignores every other parameter)."""
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

    names = mesh.mesh_dim_names
    if names is None:
        raise ExportError(
            "ZeRO stage 2-3 shards over named mesh dims (FSDP2's dp_mesh_dims): pass a mesh "
            "made with init_device_mesh(..., mesh_dim_names=...), or no mesh"
        )
    _on_mesh(module, mesh)
    dims_of = dict(sharded)

    def shard(units: Any, dims: tuple[int, ...], ignored: set[Any] | None = None) -> list[Any]:
        """FSDP2 units over `dims` (the root: `ignored` are the parameters it leaves)."""
        on = DataParallelMeshDims(shard=tuple(names[d] for d in dims))
        done = fully_shard(
            units,
            mesh=mesh,
            dp_mesh_dims=on,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored,
        )
        for unit in done if isinstance(done, list) else [done]:
            unit.set_gradient_divide_factor(1.0)  # partial sums: summed, not averaged
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        units = units if isinstance(units, list) else [units]
        for unit in units:
            if ignored is None or "" in dims_of:  # the root's own parameters only if sharded
                unit.register_forward_pre_hook(_summable_gradients(dims))
        return units

    wrapped: list[Any] = []
    done: set[str] = set()
    for path in sorted((p for p in dims_of if p), key=lambda p: -p.count(".")):
        if path in done:
            continue
        group = next((sorted(g) for g in tied if path in g), [path])
        done.update(group)
        wrapped += shard([module.get_submodule(p) for p in group], dims_of[path])
    managed = {id(p) for unit in wrapped for p in unit.parameters()}
    if "" in dims_of:
        managed |= {id(p) for p in module.parameters(recurse=False)}
    shard(module, dims_of.get("", (0,)), {p for p in module.parameters() if id(p) not in managed})


def _summable_gradients(dims: tuple[int, ...]) -> Any:
    """A forward pre-hook (after FSDP's, which gathers the weights) that makes the gradients
    of the module's gathered parameters partial sums on `dims`, as FSDP's summing
    reduce-scatter takes them: DTensor leaves a sample split's gradient as a partial sum
    (`Partial()`), except where it computed the op on replicated data (batch norm: its
    statistics over the whole batch), whose gradient is whole on every rank (`Replicate()`)
    and would be summed r times. That one becomes a partial sum exactly, without
    communication: the whole value on the first rank of the dims, zeros on the others."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def summable(grad: Any) -> Any:
        placements = list(grad.placements)
        whole = [d for d in dims if isinstance(placements[d], Replicate)]
        for d in dims:
            if d not in whole and (
                not isinstance(placements[d], Partial) or placements[d].reduce_op != "sum"
            ):
                raise ExportError(
                    f"a gradient placed {grad.placements} on the mesh: ZeRO-2/3 shards a "
                    f"parameter's gradient over mesh dims {dims} from a sum or a whole value"
                )
        if not whole:
            return grad
        mesh = grad.device_mesh
        local = grad.to_local()
        if any(mesh.get_local_rank(d) != 0 for d in whole):
            local = torch.zeros_like(local)
        for d in whole:
            placements[d] = Partial()
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=grad.shape, stride=grad.stride()
        )

    def hook(module: Any, args: Any) -> None:
        for p in module.parameters(recurse=False):
            gathered = isinstance(p, DTensor) and len(p.placements) > max(dims)
            if not gathered or getattr(p, "_layerwise_summable", False) or not p.requires_grad:
                continue
            if all(isinstance(p.placements[d], Replicate) for d in dims):
                p.register_hook(summable)
                p._layerwise_summable = True

    return hook


def _on_mesh(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every DTensor parameter on `mesh` itself. `nn.Parameter(dtensor)` detaches it through
    DTensor's cached sharding propagation, which hands back the spec of an earlier call with
    an equal mesh: after a second mesh in one process some parameters sit on the first one,
    and `fully_shard` refuses them ("Expected param's DTensor mesh to be the same mesh passed
    to fully_shard, but got different mesh objects"). So the parameter is made as
    `nn.Parameter` makes one of a tensor subclass, without the detach. Tied parameters stay
    tied."""
    import torch
    from torch.distributed.tensor import DTensor

    moved: dict[int, Any] = {}
    for sub in module.modules():
        for key, p in list(sub.named_parameters(recurse=False)):
            if not isinstance(p, DTensor) or p.device_mesh is mesh:
                continue
            if id(p) not in moved:
                with torch.no_grad():
                    local = p.to_local()
                    same = DTensor.from_local(
                        local, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                same.requires_grad_(p.requires_grad)
                same._is_param = True
                moved[id(p)] = same
            setattr(sub, key, moved[id(p)])


class ZeroOneOptimizer:
    """ZeRO stage 1 for a module parallelized with DTensor: `step()` all-reduces each gradient
    into its parameter's placement (every rank, in one order), then a
    `torch.distributed.optim.ZeroRedundancyOptimizer` per group of replicating mesh dims
    updates the parameters whose state this rank owns (whole parameters, balanced by size)
    and broadcasts them; parameters without replicas (a column-parallel weight on a 1-D mesh)
    step with a plain `cls` on every rank. Made by `Exported.optimizer(cls, **options)`."""

    def __init__(
        self,
        params: Iterable[tuple[Any, tuple[int, ...]]],
        mesh: DeviceMesh,
        cls: type[Any],
        **options: Any,
    ) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer

        self.params: list[Any] = []
        self._local: dict[int, Any] = {}
        groups: dict[tuple[int, ...], list[Any]] = {}
        for p, dims in params:
            with torch.no_grad():
                self._local[id(p)] = p.to_local()  # shares the parameter's storage
            self.params.append(p)
            groups.setdefault(dims, []).append(self._local[id(p)])
        parts: list[Any] = []
        for dims, tensors in groups.items():
            if not dims:
                parts.append(cls(tensors, **options))
                continue
            if len(dims) == mesh.ndim and mesh.size() != dist.get_world_size():
                raise ExportError(
                    f"ZeRO stage 1 over the whole mesh needs the mesh to hold every rank: it "
                    f"has {mesh.size()} of {dist.get_world_size()}"
                )
            group = mesh.get_group(dims[0]) if len(dims) < mesh.ndim else None  # None: all
            parts.append(
                ZeroRedundancyOptimizer(
                    tensors, optimizer_class=cls, process_group=group, **options
                )
            )
        self.parts: tuple[Any, ...] = tuple(parts)

    def step(self) -> None:
        """All-reduce the gradients (a collective: every rank calls it), then step: each rank
        updates the parameters it owns and broadcasts them."""
        import torch

        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:  # Partial sums all-reduced, shards kept
                    whole = p.grad.redistribute(placements=p.placements)
                    self._local[id(p)].grad = whole.to_local()
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients (`set_to_none` is accepted for the optimizers' signature;
        they are always set to None)."""
        for p in self.params:
            p.grad = None
            self._local[id(p)].grad = None

    def state_count(self) -> int:
        """How many parameters have optimizer state on this rank (the partition it owns, plus
        the parameters without replicas)."""
        return sum(len(getattr(part, "optim", part).state) for part in self.parts)
