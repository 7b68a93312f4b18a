"""ModelLayout from a live ``torch.nn.Module`` whose parameters are DTensors.

Works for models parallelized with ``parallelize_module`` (TP) or
``fully_shard`` (FSDP2): each DTensor parameter contributes its device mesh
(global ranks of the trainer group, which must be ``0..world_size-1``) and its
placements; plain parameters are replicated on every trainer rank.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from refit.layout import LayoutError, Mesh, ModelLayout, TensorLayout


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
            out.append(TensorLayout(name, tuple(p.shape), p.dtype, mesh, tuple(p.placements)))
        else:
            out.append(TensorLayout(name, tuple(p.shape), p.dtype, everyone, (Replicate(),)))
    return ModelLayout(tuple(out), world_size)


def local_shards(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local tensor of every parameter (sharing storage with the live parameter)."""
    out = {}
    for name, p in _params(module):
        out[name] = p._local_tensor if isinstance(p, DTensor) else p.data
    return out


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter (a collective over each DTensor's mesh); for checks, not refits."""
    with torch.no_grad():
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone() for n, p in _params(module)}
