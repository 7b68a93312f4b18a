"""Tensor parallelism for HF Llama / Qwen2 / Qwen3 dense models with ``parallelize_module``.

The placements are ``refit.layout.rules``' (column-parallel q/k/v/gate/up and
vocab-parallel embeddings and lm_head: Shard(0); row-parallel o/down: Shard(1);
the rest replicated), so a model parallelized here has the layout
``layout_from_spec(..., "tp=N")`` describes.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from refit.layout.hf_names import HEAD_LOCAL_NORMS, Role, param_role
from refit.layout.rules import tp_placement

# the linear modules of an HF dense decoder layer (Llama, Qwen2, Qwen3), under ``model.layers.<i>.``
_LAYER_LINEARS = tuple(
    f"{block}.{role.value}"
    for block, roles in (
        ("self_attn", (Role.Q_PROJ, Role.K_PROJ, Role.V_PROJ, Role.O_PROJ)),
        ("mlp", (Role.GATE_PROJ, Role.UP_PROJ, Role.DOWN_PROJ)),
    )
    for role in roles
)


def tp_plan(num_layers: int) -> dict:
    """``parallelize_module``'s plan: each linear colwise or rowwise as ``rules.tp_placement`` shards
    its weight (``Shard(0)``: colwise, ``Shard(1)``: rowwise); vocab-parallel embeddings and lm_head."""
    plan: dict = {
        f"model.{Role.EMBED.value}": RowwiseParallel(input_layouts=Replicate()),
        Role.LM_HEAD.value: ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(num_layers):
        for linear in _LAYER_LINEARS:
            path = f"model.layers.{i}.{linear}"
            rowwise = tp_placement(f"{path}.weight") == Shard(1)
            plan[path] = RowwiseParallel() if rowwise else ColwiseParallel()
    return plan


def check_tp_degree(config, tp: int) -> None:
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    if heads % tp or kv % tp:
        raise ValueError(
            f"tp={tp} must divide num_attention_heads={heads} and num_key_value_heads={kv} "
            "to run the model tensor-parallel"
        )


def parallelize_tp(model: nn.Module, group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """Shard ``model`` in place over ``group`` (one TP mesh) and return the mesh."""
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
    parallelize_module(model, mesh, tp_plan(model.config.num_hidden_layers))
    return mesh


def sync_head_local_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """q_norm / k_norm are replicated but act on local heads: their gradients are partial sums."""
    for name, p in model.named_parameters():
        if p.grad is not None and param_role(name) in HEAD_LOCAL_NORMS:
            dist.all_reduce(p.grad, group=group)


__all__ = ["tp_plan", "check_tp_degree", "parallelize_tp", "sync_head_local_grads"]
