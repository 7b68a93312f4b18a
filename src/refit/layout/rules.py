"""Sharding rules for HF decoder checkpoints, and layouts from specs.

Parameters are told apart by their role (``hf_names.param_role``), never by matching names here.
Tensor parallel (Megatron style, ``hf_names``' TP groups):
  * column-parallel, ``Shard(0)``: q/k/v/gate/up projections and MLA's ``q_b_proj`` / ``kv_b_proj``
    (weight and bias), ``embed_tokens`` and ``lm_head`` (vocab-parallel);
  * row-parallel, ``Shard(1)``: o/down projection weights; their biases are replicated;
  * everything else (norms, q_norm/k_norm, MLA's low-rank ``q_a_proj`` / ``kv_a_proj_with_mqa``,
    routers, unknown names) is replicated.
Pipeline parallel: decoder layers split into contiguous stages (the first
``layers % pp`` stages get one more); embeddings on the first stage, the final
norm and ``lm_head`` on the last; any other tensor on the first stage.
FSDP: ``Shard(0)`` over the ``fsdp`` mesh dim, nested before ``tp`` (mesh order).
MoE (experts stacked per layer: ``mlp.experts.gate_up_proj`` ``[E, 2, I, H]``,
``down_proj`` ``[E, H, I]``, see ``models.param_shapes``):
``ep`` shards the expert dim (``Shard(0)``); expert tensor parallelism
(``etp`` if the spec has it, else ``tp``) shards ``I`` of both
(``Shard(2)``); the router
(``mlp.gate.weight``) and every dense tensor are replicated over ``ep`` and
``etp``.

``layout_from_spec`` places any degree (a split may be uneven, chunked as ``torch.chunk`` does), as the
planner's tests use (an engine's own splits, padded or replicated, are ``engines.engine_layout``'s);
``check_spec_fits`` says whether a model can run under a spec as trainers run it (whole heads and experts on each
rank, even splits): a user's trainer spec is checked with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from refit.errors import SpecError
from refit.layout.hf_names import (
    COLUMN_PARALLEL,
    LAST_STAGE,
    ROW_PARALLEL,
    STACKED_EXPERTS,
    VOCAB_PARALLEL,
    Role,
    is_weight,
    is_weight_or_bias,
    layer_of,
    num_layers,
    param_role,
)
from refit.layout.spec import ParallelSpec
from refit.layout.tensors import Mesh, ModelLayout, TensorLayout

ParamShape = tuple[str, Sequence[int], torch.dtype]


def expert_placement(name: str, dim: str) -> Placement | None:
    """The placement of a stacked expert tensor over mesh dim ``dim`` ("ep" or the expert TP dim),
    or None if ``name`` is not one."""
    if param_role(name) not in STACKED_EXPERTS:
        return None
    return Shard(0) if dim == "ep" else Shard(2)  # [E, 2, I, H] and [E, H, I]: I is dim 2 of both


def tp_placement(name: str) -> Placement:
    """The tensor-parallel placement of an HF dense decoder parameter."""
    role = param_role(name)
    if (role in COLUMN_PARALLEL and is_weight_or_bias(name)) or (role in VOCAB_PARALLEL and is_weight(name)):
        return Shard(0)
    if role in ROW_PARALLEL and is_weight(name):
        return Shard(1)
    return Replicate()


def stage_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous ``[first, last)`` decoder layers of each pipeline stage."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def pp_stage(name: str, num_layers: int, pp: int) -> int:
    """The pipeline stage holding ``name``: its layer's, the last for ``lm_head`` and the final norm,
    else the first."""
    if pp == 1:
        return 0
    i = layer_of(name)
    if i is not None:
        for s, (a, b) in enumerate(stage_bounds(num_layers, pp)):
            if a <= i < b:
                return s
        raise ValueError(f"tensor {name!r}: layer {i} is beyond num_layers={num_layers}")
    return pp - 1 if param_role(name) in LAST_STAGE else 0


def layout_from_spec(params: Sequence[ParamShape], spec: ParallelSpec) -> ModelLayout:
    """Place every parameter on the ranks of ``spec`` by the dense TP/PP/FSDP rules."""
    shape = spec.mesh_shape
    names = spec.dim_names
    grid = torch.arange(spec.world_size).reshape(shape)
    pp = spec.degree("pp")
    n_layers = num_layers(n for n, _, _ in params)
    if "pp" in names:
        stage_axis = names.index("pp")
        sub_names = names[:stage_axis] + names[stage_axis + 1 :]
    else:
        stage_axis, sub_names = None, names
    out = []
    for name, pshape, dtype in params:
        stage = pp_stage(name, n_layers, pp)
        sub = grid.select(stage_axis, stage) if stage_axis is not None else grid
        placements: list[Placement] = []
        expert_tp = "etp" if spec.degree("etp") > 1 else "tp"
        is_expert = expert_placement(name, "ep") is not None and len(pshape) >= 3
        for dim in sub_names:
            if is_expert and dim in ("ep", expert_tp):
                placements.append(expert_placement(name, dim))
            elif is_expert and dim in ("tp", "etp"):
                placements.append(Replicate())  # experts use etp, not tp
            elif dim == "tp":
                p = tp_placement(name)
                placements.append(p if not (isinstance(p, Shard) and p.dim >= len(pshape)) else Replicate())
            elif dim == "fsdp":
                placements.append(Shard(0) if len(pshape) else Replicate())
            else:  # dp, ep (dense tensors), etp (dense tensors): replicas
                placements.append(Replicate())
        keep = [i for i, n in enumerate(sub.shape) if n > 1] or [0]
        sub_kept = sub.reshape([sub.shape[i] for i in keep])
        mesh = Mesh(tuple(sub_kept.shape), tuple(sub_names[i] for i in keep), tuple(sub_kept.flatten().tolist()))
        out.append(TensorLayout(name, tuple(pshape), dtype, mesh, tuple(placements[i] for i in keep)))
    return ModelLayout(tuple(out), spec.world_size)


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""The config field that counts a MoE layer's routed experts (Qwen-MoE, Mixtral, DeepSeek-V3)."""


def check_spec_fits(
    params: Sequence[ParamShape], spec: ParallelSpec, config: Any, *, kv_replicas: bool = False
) -> None:
    """``SpecError`` unless every rank of ``spec`` holds whole units of the model (``config``: its HF config):

    * ``tp`` divides ``num_attention_heads`` and ``num_key_value_heads`` (spec layouts split KV heads; an
      engine's replicated KV heads and padding are ``engines.engine_layout``'s, checked by
      ``engines.check_engine_fits``); with ``kv_replicas`` (Megatron's layout, which cuts the interleaved query
      groups) ``tp`` may instead be a multiple of them;
    * ``ep`` divides the routed experts (``EXPERT_COUNTS``);
    * every ``tp``, ``ep`` or ``etp`` split of a tensor is even (MLP and expert intermediate sizes), but for
      the vocab, which may end in a shorter chunk (DTensor's vocab-parallel embedding does the same).

    The message names the degree, the config field or tensor and its size, not the spec (the caller's).
    """
    _divides(spec, "tp", config, "num_attention_heads", "a rank holds whole attention heads")
    kv, tp = getattr(config, "num_key_value_heads", None), spec.degree("tp")
    if not (kv_replicas and isinstance(kv, int) and tp % kv == 0):
        _divides(spec, "tp", config, "num_key_value_heads", "spec layouts split KV heads, they cannot replicate them")
    experts = next((f for f in EXPERT_COUNTS if getattr(config, f, None)), None)
    if experts is not None:
        _divides(spec, "ep", config, experts, "a rank holds whole experts")
    for t in layout_from_spec(params, spec):
        if param_role(t.name) in VOCAB_PARALLEL or (kv_replicas and param_role(t.name) in (Role.K_PROJ, Role.V_PROJ)):
            continue
        for dim, p in zip(t.mesh.dim_names, t.placements):
            degree = spec.degree(dim)
            if dim in ("tp", "ep", "etp") and isinstance(p, Shard) and t.shape[p.dim] % degree:
                raise SpecError(
                    f"{dim}={degree} must divide dim {p.dim} of {t.name} {list(t.shape)}: "
                    f"{t.shape[p.dim]} is not a multiple of {degree}"
                )


def _divides(spec: ParallelSpec, dim: str, config: Any, field: str, why: str) -> None:
    value, degree = getattr(config, field, None), spec.degree(dim)
    if isinstance(value, int) and value % degree:
        raise SpecError(f"{dim}={degree} must divide {field}={value} ({why})")
