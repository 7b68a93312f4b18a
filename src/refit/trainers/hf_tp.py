"""Tensor parallelism for HF Llama / Qwen2 / Qwen3 dense models with ``parallelize_module``.

The placements match ``refit.layout.rules`` (column-parallel q/k/v/gate/up and
vocab-parallel embeddings and lm_head: Shard(0); row-parallel o/down: Shard(1);
the rest replicated), so a model parallelized here has the layout
``layout_from_spec(..., "tp=N")`` describes.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def tp_plan(num_layers: int) -> dict:
    plan: dict = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}"
        for n in ("q_proj", "k_proj", "v_proj"):
            plan[f"{p}.self_attn.{n}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        for n in ("gate_proj", "up_proj"):
            plan[f"{p}.mlp.{n}"] = ColwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return plan


def check_tp_degree(config, tp: int) -> None:
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    if heads % tp or kv % tp:
        raise ValueError(
            f"tp={tp} must divide num_attention_heads={heads} and num_key_value_heads={kv} to run the model tensor-parallel"
        )


def parallelize_tp(model: nn.Module, group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """Shard ``model`` in place over ``group`` (one TP mesh) and return the mesh."""
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
    parallelize_module(model, mesh, tp_plan(model.config.num_hidden_layers))
    return mesh


def sync_head_local_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """q_norm / k_norm are replicated but act on local heads: their gradients are partial sums."""
    for name, p in model.named_parameters():
        if p.grad is not None and (".q_norm." in name or ".k_norm." in name):
            dist.all_reduce(p.grad, group=group)


__all__ = ["tp_plan", "check_tp_degree", "parallelize_tp", "sync_head_local_grads"]
