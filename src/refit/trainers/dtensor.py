"""ModelLayout from a live ``torch.nn.Module`` whose parameters are DTensors.

Works for models parallelized with ``parallelize_module`` (TP) or
``fully_shard`` (FSDP2): each DTensor parameter contributes its device mesh
(global ranks of the trainer group, which must be ``0..world_size-1``) and its
placements; plain parameters are replicated on every trainer rank.

HF's fused stacked experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``) are
seen as ``[E, 2, I, H]`` (``hf_names.logical_shape``): a view of the same memory,
so sharding over experts (EP, FSDP: ``Shard(0)``) or hidden (``Shard(2)`` ->
``Shard(3)``) carries over. ``Shard(1)`` of the fused dim is refused: a
DTensor cannot tell a plain split (rank 0 all gate) from a packed one (each
rank [gate | up] of its share), and guessing would corrupt weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from refit.layout import LayoutError, Mesh, ModelLayout, TensorLayout
from refit.layout.hf_names import is_fused_gate_up, logical_shape


def _params(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    return module.named_parameters()


def layout_from_module(module: nn.Module, world_size: int) -> ModelLayout:
    """The source layout of ``module`` on a trainer of ``world_size`` ranks (the same on every rank)."""
    everyone = Mesh((world_size,), ("dp",), tuple(range(world_size)))
    out = []
    for name, p in _params(module):
        if isinstance(p, DTensor):
            dm = p.device_mesh
            names = dm.mesh_dim_names or tuple(f"d{i}" for i in range(dm.ndim))
            mesh = Mesh(tuple(dm.mesh.shape), tuple(names), tuple(int(r) for r in dm.mesh.flatten().tolist()))
            for pl in p.placements:
                if not (type(pl) is Shard or isinstance(pl, Replicate)):
                    raise LayoutError(
                        f"parameter {name!r} has placement {pl!r}; refit supports Shard(d) and Replicate() "
                        "(strided or partial placements are not supported yet)"
                    )
            out.append(
                TensorLayout(
                    name,
                    logical_shape(name, tuple(p.shape)),
                    p.dtype,
                    mesh,
                    _logical_placements(name, p.shape, p.placements),
                )
            )
        else:
            out.append(TensorLayout(name, logical_shape(name, tuple(p.shape)), p.dtype, everyone, (Replicate(),)))
    return ModelLayout(tuple(out), world_size)


def _logical_placements(name: str, shape, placements) -> tuple:
    if not is_fused_gate_up(name, tuple(shape)):
        return tuple(placements)
    out = []
    for pl in placements:
        if isinstance(pl, Shard) and pl.dim == 1:
            raise LayoutError(
                f"parameter {name!r} {list(shape)} is sharded on its fused gate/up dim (Shard(1)); "
                "refit cannot tell a plain split from a packed [gate | up] one there: shard experts "
                "(dim 0) or hidden (dim 2)"
            )
        out.append(Shard(3) if isinstance(pl, Shard) and pl.dim == 2 else pl)
    return tuple(out)


def _logical_local(name: str, p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not is_fused_gate_up(name, tuple(p.shape)):
        return local
    e, two_i, h = local.shape
    return local.view(e, 2, two_i // 2, h)  # a view: the same memory the optimizer updates


def local_shards(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local tensor of every parameter (sharing storage with the live parameter)."""
    out = {}
    for name, p in _params(module):
        out[name] = _logical_local(name, p, p._local_tensor if isinstance(p, DTensor) else p.data)
    return out


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter by HF name and shape (a collective over each DTensor's mesh);
    for checks, not refits."""
    with torch.no_grad():
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone() for n, p in _params(module)}
