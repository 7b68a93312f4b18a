"""Which box of each HF-named tensor a vLLM worker needs, read from vLLM's modules.

vLLM's weight loaders take full HF tensors and narrow them to the worker's TP
share. The share is a property of the module the loader belongs to:

* ``QKVParallelLinear`` (q/k/v): q rows of this rank's heads; k/v rows of the
  KV head group ``tp_rank // num_kv_head_replicas`` (KV heads are replicated
  when tp exceeds their number);
* ``MergedColumnParallelLinear`` (gate/up): rows ``[tp_rank*s, (tp_rank+1)*s)``
  with ``s = output_size // tp``;
* ``RowParallelLinear`` (o/down): columns of ``input_size_per_partition``;
  its bias whole;
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: rows
  ``[org_vocab_start_index, org_vocab_end_index)`` (vLLM pads the vocab; the
  padding never travels);
* stacked experts (``mlp.experts.gate_up_proj`` ``[E, 2, I, H]``,
  ``mlp.experts.down_proj`` ``[E, H, I]``, see ``models.param_shapes``),
  read from vLLM's fused-MoE layer (``RoutedExperts`` / ``FusedMoE``): the
  experts local to this rank (one contiguous range; EP) times the rows
  ``[tp_rank*s, (tp_rank+1)*s)`` of ``I`` with ``s =
  intermediate_size_per_partition`` (MoE TP), gate and up alike: exactly
  vLLM's ``w13_weight`` ``[E_local, 2s, H]`` and ``w2_weight`` ``[E_local, H, s]``;
* anything else, including names no rule knows: the whole tensor (the loader
  gets exactly what a full load would give it).

Reading the module attributes rather than the HF config makes the share the
one the loader will actually read. Which HF tensor goes to which module (fused
``qkv_proj`` / ``gate_up_proj``, row- and vocab-parallel, stacked experts) is
``refit.layout.hf_names``' to say.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from refit.errors import LayoutError
from refit.layout import Box, box_slices, full_box
from refit.layout.hf_names import (
    QKV_SHARDS,
    ROW_PARALLEL,
    STACKED_EXPERTS,
    VOCAB_PARALLEL,
    FusedTarget,
    Role,
    fused_target,
    is_weight,
    is_weight_or_bias,
    module_aliases,
    param_role,
)


class RegionError(LayoutError):
    """The worker's share of a tensor cannot be determined or disagrees with the tensor."""


def _module(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def moe_layer(model: torch.nn.Module, stem: str) -> tuple[torch.nn.Module, str] | None:
    """(vLLM's fused-MoE layer holding ``w13_weight`` / ``w2_weight``, its path) for the
    transformers experts module path ``stem``, or None."""
    for path in (stem, *module_aliases(stem)):
        mod = _module(model, path)
        if mod is None:
            continue
        if hasattr(mod, "w13_weight"):
            return mod, path
        inner = getattr(mod, "routed_experts", None)  # vLLM >= 0.30: MoERunner wraps RoutedExperts
        if inner is not None and hasattr(inner, "w13_weight"):
            return inner, f"{path}.routed_experts"
    return None


def moe_share(mod: torch.nn.Module, name: str, shape: Sequence[int]) -> tuple[int, int, int, int]:
    """(first expert, end expert, first row of I, rows of I) this rank's fused-MoE layer loads."""
    cfg = mod.moe_config.moe_parallel_config
    local = [e for e in range(shape[0]) if mod.expert_map_manager.is_local_expert(e)]
    if not local or local != list(range(local[0], local[0] + len(local))):
        raise RegionError(
            f"{name} {list(shape)}: this rank's experts {local[:8]} are not one contiguous range "
            f"(expert placement {getattr(mod, 'expert_placement_strategy', '?')!r}); refit needs 'linear'"
        )
    if any(mod.expert_map_manager.map_global_to_local(e) != i for i, e in enumerate(local)):
        raise RegionError(f"{name}: vLLM's local expert order is not the global order")
    s = mod.intermediate_size_per_partition
    i_dim = shape[2]
    if i_dim // cfg.tp_size != s:
        raise RegionError(
            f"{name} {list(shape)}: vLLM pads I to {s} per rank (tp {cfg.tp_size}); refit sends unpadded shares"
        )
    return local[0], local[-1] + 1, cfg.tp_rank * s, s


def _rows(shape: Sequence[int], lo: int, hi: int) -> Box:
    return ((lo, hi),) + full_box(shape[1:])


def _dense_fused(name: str) -> FusedTarget | None:
    """The ``qkv_proj`` / ``gate_up_proj`` target of a q/k/v/gate/up tensor (dense or shared-expert MLP)."""
    t = fused_target(name)
    return t if t is not None and (t.shard in QKV_SHARDS or isinstance(t.shard, int)) else None


def _fused_rows(mod: torch.nn.Module, name: str, shape: Sequence[int], shard: str | int) -> tuple[Box, str]:
    """(rows, rule) of ``shard`` of a ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` this rank loads."""
    if shard in QKV_SHARDS:
        if shard == "q":
            n = mod.num_heads * mod.head_size
            lo = mod.tp_rank * n
        else:
            head = mod.v_head_size if shard == "v" else mod.head_size
            n = mod.num_kv_heads * head
            lo = (mod.tp_rank // mod.num_kv_head_replicas) * n
        rule = f"qkv:{shard}"
    else:
        n = mod.output_sizes[shard] // mod.tp_size
        lo = mod.tp_rank * n
        rule = f"merged:{shard}"
    if lo + n > shape[0]:
        raise RegionError(
            f"{name} {list(shape)}: vLLM's {type(mod).__name__} wants rows [{lo}, {lo + n}) beyond the tensor"
        )
    return _rows(shape, lo, lo + n), rule


def region(model: torch.nn.Module, name: str, shape: Sequence[int]) -> tuple[Box, str]:
    """(box, rule) for HF tensor ``name`` of ``shape`` on this worker; rule names what decided it."""
    stem, _, leaf = name.rpartition(".")
    role = param_role(name)
    if role in STACKED_EXPERTS and len(shape) in (3, 4):
        found = moe_layer(model, stem)
        if found is not None:
            e0, e1, i0, n = moe_share(found[0], name, shape)
            if role is Role.EXPERTS_GATE_UP:
                return ((e0, e1), (0, 2), (i0, i0 + n), (0, shape[3])), "moe:w13"
            return ((e0, e1), (0, shape[1]), (i0, i0 + n)), "moe:w2"
    target = _dense_fused(name)
    if target is not None:
        mod = _module(model, target.module)
        if mod is not None:
            return _fused_rows(mod, name, shape, target.shard)
    if role in ROW_PARALLEL and is_weight_or_bias(name):
        mod = _module(model, stem)
        if mod is not None and leaf == "weight" and hasattr(mod, "input_size_per_partition"):
            n = mod.input_size_per_partition
            lo = mod.tp_rank * n
            if len(shape) != 2 or lo + n > shape[1]:
                raise RegionError(f"{name} {list(shape)}: vLLM's RowParallelLinear wants columns [{lo}, {lo + n})")
            return ((0, shape[0]), (lo, lo + n)), "row"
        return full_box(shape), "row-bias"
    if role in VOCAB_PARALLEL and is_weight(name):
        mod = _module(model, stem)
        idx = getattr(mod, "shard_indices", None)
        if idx is not None:
            lo, hi = idx.org_vocab_start_index, min(idx.org_vocab_end_index, shape[0])
            return _rows(shape, lo, hi), "vocab"
    return full_box(shape), "full"


def _param(model: torch.nn.Module, path: str) -> torch.Tensor | None:
    try:
        return model.get_parameter(path)
    except AttributeError:
        return None


def live_target(
    model: torch.nn.Module, name: str, shape: Sequence[int], box: Box, rule: str
) -> tuple[torch.Tensor | None, str]:
    """(view, why): where this worker's ``box`` of HF tensor ``name`` lives in vLLM's live
    parameters, for writing received bytes there directly; (None, why not) where it cannot.

    The view is the part of the fused parameter the weight loader would have
    written: ``qkv_proj`` rows [q | k | v] of this rank, ``gate_up_proj`` rows
    [gate | up], the vocab shard's first rows (padding rows untouched), whole
    parameters otherwise. It is only valid while vLLM keeps parameters as
    loaded (CUDA, unquantized); where it repacked or dropped them (the CPU
    backend, quantized methods) the shape check below says so.
    """
    stem, _, leaf = name.rpartition(".")
    want = tuple(hi - lo for lo, hi in box)
    if rule.startswith("moe:"):
        found = moe_layer(model, stem)
        if found is None:
            return None, f"{stem}: no fused-MoE layer"
        where = f"{found[1]}.{rule[4:]}_weight"
        param = getattr(found[0], f"{rule[4:]}_weight", None)
        if param is None:
            return None, f"{where} not found"
        target = param.data
        if rule == "moe:w13" and target.dim() == 3 and target.shape[1] % 2 == 0:
            target = target.view(target.shape[0], 2, target.shape[1] // 2, target.shape[2])
        if tuple(target.shape) != want:
            return None, f"{where} has shape {list(param.shape)}, not as loaded ({list(want)})"
        if not target.is_contiguous():
            return None, f"{where} is not contiguous"
        return target, where
    if rule.startswith(("qkv:", "merged:")):
        fused = _dense_fused(name)  # region() found it
        path, shard = fused.module, fused.shard
        mod = _module(model, path)
        param = _param(model, fused.name)
        if mod is None or param is None:
            return None, f"{fused.name} not found"
        if shard in QKV_SHARDS:
            q = mod.num_heads * mod.head_size
            k = mod.num_kv_heads * mod.head_size
            off = {"q": 0, "k": q, "v": q + k}[shard]
        else:
            off = sum(mod.output_sizes[:shard]) // mod.tp_size
        target, where = param, fused.name
        expect_rows = (mod.output_size_per_partition,)
    elif rule in ("row", "row-bias", "vocab", "full"):
        where = checkpoint_name(model, name)
        target = _param(model, where)
        if target is None:
            return None, f"{name} not found"
        off, expect_rows = 0, None
    else:
        return None, f"no direct rule for {rule!r}"
    rows = want[0] if want else 0
    if expect_rows is not None and (target.dim() == 0 or target.shape[0] != expect_rows[0]):
        return None, f"{where} has shape {list(target.shape)}, not as loaded ({expect_rows[0]} rows)"
    if target.dim() != len(want) or tuple(target.shape[1:]) != want[1:] or off + rows > target.shape[0]:
        return (
            None,
            f"{where} has shape {list(target.shape)}, not as loaded (rows [{off}, {off + rows}) of {list(want)})",
        )
    if rule == "full" and tuple(target.shape) != want:
        return None, f"{where} has shape {list(target.shape)}, the HF tensor {list(want)}"
    view = target.data[off : off + rows] if len(want) else target.data
    if not view.is_contiguous():
        return None, f"{where} rows [{off}, {off + rows}) are not contiguous"
    return view, where


def checkpoint_name(model: torch.nn.Module, name: str) -> str:
    """The name vLLM's ``load_weights`` knows for transformers' ``name`` (Mixtral: ``mlp.`` is
    ``block_sparse_moe.``); ``name`` itself where vLLM has that module or no alias fits."""
    stem = name.rpartition(".")[0]
    if _module(model, stem) is not None:
        return name
    for alias in module_aliases(stem):
        if _module(model, alias) is not None:
            return alias + name[len(stem) :]
    return name


def expert_checkpoint_tensors(
    model: torch.nn.Module, name: str, shape: Sequence[int], box: Box, part: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint tensors (``experts.{e}.gate_proj.weight`` ...) for vLLM's loaders from
    this worker's ``part`` (at ``box``) of a stacked expert tensor: full-shaped ``[I, H]`` /
    ``[H, I]`` per expert of the box, of which only the box is valid (the part the loader reads)."""
    stem = name.rpartition(".")[0]
    found = moe_layer(model, stem)
    mod, path = found if found is not None else (None, stem)
    base = path[: -len(".routed_experts")] if path.endswith(".routed_experts") else path
    gate, up, down = (getattr(mod, f"ckpt_{k}_proj_name", k + "_proj") for k in ("gate", "up", "down"))
    (e0, e1), rest = box[0], box[1:]
    for e in range(e0, e1):
        if param_role(name) is Role.EXPERTS_GATE_UP:
            (g0, g1), rows, cols = rest
            for g in range(g0, g1):
                full = _outside(tuple(shape[2:]), part)
                full[rows[0] : rows[1], cols[0] : cols[1]] = part[e - e0, g - g0]
                yield f"{base}.{e}.{(gate, up)[g]}.weight", full
        else:
            full = _outside(tuple(shape[1:]), part)
            full[box_slices(rest)] = part[e - e0]
            yield f"{base}.{e}.{down}.weight", full


def loader_tensors(
    model: torch.nn.Module, name: str, shape: Sequence[int], box: Box, part: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """What vLLM's ``load_weights`` takes for this worker's ``part`` (at ``box``) of ``name``:
    checkpoint names and full shapes, of which only the box is valid (the part the loader reads).
    Stacked experts become per-expert checkpoint tensors."""
    if param_role(name) in STACKED_EXPERTS and len(shape) in (3, 4):
        yield from expert_checkpoint_tensors(model, name, shape, box, part)
        return
    ckpt = checkpoint_name(model, name)
    if tuple(part.shape) == tuple(shape):
        yield ckpt, part
        return
    full = _outside(tuple(shape), part)
    full[box_slices(box)] = part
    yield ckpt, full


def _outside(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A full-shaped tensor whose elements outside the box are NaN (a loader reading them shows)."""
    if like.dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)
