"""Which box of each HF-named tensor an SGLang TP rank holds, and where it lives, read from SGLang's live modules.

SGLang's weight loaders take full HF tensors and narrow them to the rank's share; the share is a property
of the module the loader belongs to, read here from the module itself (never from the config alone):

* ``QKVParallelLinear`` (q/k/v): q rows of this rank's heads (rank in ``tp_group``); k/v rows of the KV
  head group ``kv_rank // num_kv_head_replicas`` (rank in ``kv_tp_group``; KV heads are replicated when
  TP exceeds their number). Live ``qkv_proj`` rows are ``[q | k | v]`` of this rank.
* ``MergedColumnParallelLinear`` (gate/up): rows ``[r*s, (r+1)*s)`` with ``s = output_sizes[i] // tp``;
  live ``gate_up_proj`` rows are ``[gate | up]`` of this rank.
* ``RowParallelLinear`` (o/down): columns ``[r*n, (r+1)*n)``, ``n = input_size_per_partition``; bias whole.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: rows ``[org_vocab_start_index, org_vocab_end_index)``,
  the live parameter's first rows (SGLang pads the vocab; padding never travels).
* ``FusedMoE`` (``mlp.experts``): experts ``[ep_rank*E_local, (ep_rank+1)*E_local)`` times rows
  ``[tp_rank*s, (tp_rank+1)*s)`` of the intermediate size (``s = intermediate_size_per_partition``): exactly
  ``w13_weight`` ``[E_local, 2s, H]`` (gate, then up) and ``w2_weight`` ``[E_local, H, s]``.
* anything else (norms, qk-norms, the router): the whole tensor, in the parameter of the same name.

Padding (SGLang on CPU, ``sglang/srt/configs/update_config.py`` ``adjust_config_with_unaligned_cpu_tp``: intermediate
sizes padded to a multiple of 32 x tp, heads to a multiple of tp where tp does not divide them; the rules as data in
``refit.layout.engines``): a rank's share above is then partly or wholly beyond the HF tensor. SGLang's CPU loaders
narrow the checkpoint to the real part and zero the rest (``narrow_padded_param_and_loaded_weight``,
``sglang/srt/model_loader/weight_utils.py``, called where ``_is_cpu`` in ``sglang/srt/layers/linear.py``); refit does
the same: the box is the real part (possibly empty), the view its rows or columns at the share's start, and padding
is never written (it keeps the zeros SGLang's load put there). On other devices SGLang does not pad, and a share
beyond the tensor is refused.

``share`` returns the box and a view of the live parameter the loader would have written (strided where the real
columns of a padded row-parallel share or a padded expert share are a part of each row: the caller receives into a
dense copy); it refuses (``RegionError`` naming the tensor, the module and both shapes) where SGLang repacked or
replaced a parameter, so that refit never writes bytes where SGLang does not read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refit.errors import LayoutError
from refit.layout import Box, full_box
from refit.layout.hf_names import (
    QKV_SHARDS,
    ROW_PARALLEL,
    STACKED_EXPERTS,
    VOCAB_PARALLEL,
    Role,
    fused_target,
    is_weight,
    param_role,
)


class RegionError(LayoutError):
    """An SGLang rank's share of a tensor cannot be determined, or its live parameter is not as loaded."""


@dataclass(frozen=True)
class Share:
    """One HF tensor on one SGLang rank: its ``box`` (of the HF shape), the ``view`` of the live parameter
    that holds exactly that box (same shape as the box), ``rule`` (what decided it) and ``param`` (the
    live parameter's name)."""

    box: Box
    view: torch.Tensor
    rule: str
    param: str


def _rank_size(group) -> tuple[int, int]:
    """(rank, size) in an SGLang group coordinator; ``None`` is an unsharded layer."""
    return (0, 1) if group is None else (group.rank_in_group, group.world_size)


def _module(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _param(model: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        raise RegionError(f"SGLang's model has no parameter {name!r}") from None


def _rows(shape: Sequence[int], lo: int, hi: int) -> Box:
    return ((lo, hi),) + full_box(shape[1:])


def _real(lo: int, n: int, size: int, name: str, shape: Sequence[int], what: str, pads: bool) -> tuple[int, int]:
    """The real part ``[lo, hi)`` of a share ``[lo, lo + n)`` of a dim of ``size``: clipped where SGLang pads
    (``pads``: its CPU loaders zero what lies beyond the tensor), else ``RegionError`` if it does not fit."""
    if lo + n <= size:
        return lo, lo + n
    if not pads:
        raise RegionError(f"{name} {list(shape)}: SGLang's {what} wants [{lo}, {lo + n}) beyond the tensor")
    return min(lo, size), size


def _pads(param: torch.Tensor) -> bool:
    """SGLang pads (and its loaders zero the padding) only on CPU (``_is_cpu`` in ``sglang/srt/layers/linear.py``)."""
    return param.device.type == "cpu"


def _view(param: torch.Tensor, where: str, name: str, off: int, box: Box, rule: str) -> Share:
    """The rows ``[off, off + rows)`` of ``param`` as the live home of ``box``; checked to fit exactly."""
    want = tuple(hi - lo for lo, hi in box)
    rows = want[0] if want else 0
    data = param.data
    if data.dim() != len(want) or tuple(data.shape[1:]) != want[1:] or off + rows > data.shape[0]:
        raise RegionError(
            f"{name}: SGLang's {where} has shape {list(data.shape)}, not as loaded "
            f"(rows [{off}, {off + rows}) of {list(want)}): padded or repacked weights are not supported"
        )
    view = data[off : off + rows] if want else data
    if not view.is_contiguous():
        raise RegionError(f"{name}: rows [{off}, {off + rows}) of SGLang's {where} are not contiguous")
    return Share(box, view, rule, where)


def _qkv(mod: torch.nn.Module, name: str, shape: Sequence[int], shard: str) -> tuple[int, int, int]:
    """(first row in the HF tensor, rows, first row in the live ``qkv_proj``) of ``shard`` on this rank."""
    tp_rank, _ = _rank_size(mod.tp_group)
    kv_rank, _ = _rank_size(getattr(mod, "kv_tp_group", mod.tp_group))
    q = mod.num_heads * mod.head_size
    k = mod.num_kv_heads * mod.head_size
    if shard == "q":
        return tp_rank * q, q, 0
    n = mod.num_kv_heads * (mod.v_head_size if shard == "v" else mod.head_size)
    return (kv_rank // mod.num_kv_head_replicas) * n, n, q if shard == "k" else q + k


def _merged(mod: torch.nn.Module, shard: int) -> tuple[int, int, int]:
    """(first row in the HF tensor, rows, first row in the live ``gate_up_proj``) of output ``shard``."""
    tp_rank, tp = _rank_size(mod.tp_group)
    n = mod.output_sizes[shard] // tp
    return tp_rank * n, n, sum(mod.output_sizes[:shard]) // tp


def _fused(model: torch.nn.Module, name: str, shape: Sequence[int]) -> Share | None:
    """q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``; None for other tensors."""
    t = fused_target(name)
    if t is None or not (t.shard in QKV_SHARDS or isinstance(t.shard, int)):
        return None
    mod = _module(model, t.module)
    if mod is None:
        raise RegionError(f"{name}: SGLang's model has no module {t.module!r}")
    lo, n, off = _qkv(mod, name, shape, t.shard) if t.shard in QKV_SHARDS else _merged(mod, t.shard)
    rule = f"qkv:{t.shard}" if t.shard in QKV_SHARDS else f"merged:{t.shard}"
    where = f"{t.module}.{t.param}"
    param = _param(model, where)
    lo, hi = _real(lo, n, shape[0], name, shape, f"{type(mod).__name__} rows", _pads(param))
    whole = _fused_rows(mod, t.shard in QKV_SHARDS)
    if param.dim() == 0 or param.shape[0] != whole:
        raise RegionError(
            f"{name}: SGLang's {where} has shape {list(param.shape)}, not the {whole} rows of this rank's "
            f"{type(mod).__name__} shards: padded or repacked weights are not supported"
        )
    return _view(param, where, name, off, _rows(shape, lo, hi), rule)


def _fused_rows(mod: torch.nn.Module, qkv: bool) -> int:
    """Rows of a live fused parameter as loaded: [q | k | v] or the merged outputs of this rank."""
    if qkv:
        return (mod.num_heads + mod.num_kv_heads) * mod.head_size + mod.num_kv_heads * mod.v_head_size
    return sum(mod.output_sizes) // _rank_size(mod.tp_group)[1]


def _experts(model: torch.nn.Module, name: str, shape: Sequence[int]) -> Share:
    """A stacked expert tensor (``[E, 2, I, H]`` gate/up, ``[E, H, I]`` down) into ``FusedMoE``'s w13/w2."""
    stem = name.rpartition(".")[0]
    mod = _module(model, stem)
    if mod is None or not hasattr(mod, "w13_weight"):
        raise RegionError(f"{name}: SGLang's model has no fused-MoE layer at {stem!r}")
    if getattr(mod, "num_fused_shared_experts", 0):
        raise RegionError(f"{name}: shared experts fused into {stem!r} are not supported")
    e_local, s = mod.num_local_experts, mod.intermediate_size_per_partition
    e0, i0 = mod.moe_ep_rank * e_local, mod.moe_tp_rank * s
    gate_up = param_role(name) is Role.EXPERTS_GATE_UP
    where = f"{stem}.{'w13_weight' if gate_up else 'w2_weight'}"
    param = _param(model, where)
    i_dim = shape[2]
    i0, i1 = _real(i0, s, i_dim, name, shape, f"FusedMoE rows of I (tp {mod.moe_tp_size})", _pads(param))
    if e0 + e_local > shape[0] or (i_dim // mod.moe_tp_size != s and not _pads(param)):
        raise RegionError(
            f"{name} {list(shape)}: SGLang's FusedMoE holds experts [{e0}, {e0 + e_local}) and rows "
            f"[{i0}, {i0 + s}) of I (tp {mod.moe_tp_size}): uneven expert shares are not supported"
        )
    data, real = param.data, i1 - i0
    if gate_up:
        box = ((e0, e0 + e_local), (0, 2), (i0, i1), (0, shape[3]))
        want = (e_local, 2 * s, shape[3])
        view = data.view(e_local, 2, s, shape[3])[:, :, :real] if tuple(data.shape) == want else None
    else:
        box = ((e0, e0 + e_local), (0, shape[1]), (i0, i1))
        want = (e_local, shape[1], s)
        view = data[:, :, :real] if tuple(data.shape) == want else None
    if view is None:
        raise RegionError(f"{name}: SGLang's {where} has shape {list(data.shape)}, not as loaded ({list(want)})")
    return Share(box, view, "moe:w13" if gate_up else "moe:w2", where)


def share(model: torch.nn.Module, name: str, shape: Sequence[int]) -> Share:
    """This SGLang rank's share of HF tensor ``name`` of ``shape`` (``RegionError`` where there is none)."""
    stem, _, leaf = name.rpartition(".")
    role = param_role(name)
    if role in STACKED_EXPERTS and len(shape) in (3, 4):
        return _experts(model, name, shape)
    fused = _fused(model, name, shape)
    if fused is not None:
        return fused
    mod = _module(model, stem)
    if role in ROW_PARALLEL and leaf == "weight" and hasattr(mod, "input_size_per_partition"):
        return _row(model, mod, name, shape)
    if role in VOCAB_PARALLEL and is_weight(name) and getattr(mod, "shard_indices", None) is not None:
        idx = mod.shard_indices
        lo, hi = idx.org_vocab_start_index, min(idx.org_vocab_end_index, shape[0])
        return _view(_param(model, name), name, name, 0, _rows(shape, lo, hi), "vocab")
    box = full_box(shape)
    return Share(box, _whole(model, name, box), "full", name)


def _row(model: torch.nn.Module, mod: torch.nn.Module, name: str, shape: Sequence[int]) -> Share:
    """A row-parallel weight: columns ``[r*n, (r+1)*n)`` of the (padded) input, the real ones at the live
    parameter's first columns."""
    rank, _ = _rank_size(mod.tp_group)
    n = mod.input_size_per_partition
    param = _param(model, name)
    if len(shape) != 2:
        raise RegionError(f"{name} {list(shape)}: SGLang's RowParallelLinear wants a 2-d weight")
    lo, hi = _real(rank * n, n, shape[1], name, shape, "RowParallelLinear columns", _pads(param))
    data = param.data
    if tuple(data.shape) != (shape[0], n):
        raise RegionError(f"{name}: SGLang's parameter has shape {list(data.shape)}, not as loaded ({[shape[0], n]})")
    return Share(((0, shape[0]), (lo, hi)), data[:, : hi - lo], "row", name)


def _whole(model: torch.nn.Module, name: str, box: Box) -> torch.Tensor:
    """The live parameter ``name``, which must hold exactly ``box``."""
    data = _param(model, name).data
    want = tuple(hi - lo for lo, hi in box)
    if tuple(data.shape) != want or not data.is_contiguous():
        raise RegionError(f"{name}: SGLang's parameter has shape {list(data.shape)}, refit's share is {list(want)}")
    return data
