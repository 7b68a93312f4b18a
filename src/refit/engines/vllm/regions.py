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
* anything else, including names no rule knows: the whole tensor (the loader
  gets exactly what a full load would give it).

Reading the module attributes rather than the HF config makes the share the
one the loader will actually read.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from refit.layout import Box, full_box

_STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}
_ROW = re.compile(r"\.(o_proj|down_proj)\.(weight|bias)$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.weight$")


class RegionError(ValueError):
    """The worker's share of a tensor cannot be determined or disagrees with the tensor."""


def _module(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _rows(shape: Sequence[int], lo: int, hi: int) -> Box:
    return ((lo, hi),) + full_box(shape[1:])


def region(model: torch.nn.Module, name: str, shape: Sequence[int]) -> tuple[Box, str]:
    """(box, rule) for HF tensor ``name`` of ``shape`` on this worker; rule names what decided it."""
    stem, _, leaf = name.rpartition(".")
    for hf, (vllm_name, shard) in _STACKED.items():
        if stem.endswith(hf):
            mod = _module(model, stem[: -len(hf)] + vllm_name)
            if mod is None:
                break
            if shard in ("q", "k", "v"):
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
                raise RegionError(f"{name} {list(shape)}: vLLM's {type(mod).__name__} wants rows [{lo}, {lo + n}) beyond the tensor")
            return _rows(shape, lo, lo + n), rule
    if _ROW.search(name):
        mod = _module(model, stem)
        if mod is not None and leaf == "weight" and hasattr(mod, "input_size_per_partition"):
            n = mod.input_size_per_partition
            lo = mod.tp_rank * n
            if len(shape) != 2 or lo + n > shape[1]:
                raise RegionError(f"{name} {list(shape)}: vLLM's RowParallelLinear wants columns [{lo}, {lo + n})")
            return ((0, shape[0]), (lo, lo + n)), "row"
        return full_box(shape), "row-bias"
    if _VOCAB.search(name):
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


def live_target(model: torch.nn.Module, name: str, shape: Sequence[int], box: Box, rule: str) -> tuple[torch.Tensor | None, str]:
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
    if rule.startswith(("qkv:", "merged:")):
        hf = next(h for h in _STACKED if stem.endswith(h))
        vllm_name, shard = _STACKED[hf]
        path = stem[: -len(hf)] + vllm_name
        mod = _module(model, path)
        param = _param(model, f"{path}.{leaf}")
        if mod is None or param is None:
            return None, f"{path}.{leaf} not found"
        if shard in ("q", "k", "v"):
            q = mod.num_heads * mod.head_size
            k = mod.num_kv_heads * mod.head_size
            off = {"q": 0, "k": q, "v": q + k}[shard]
        else:
            off = sum(mod.output_sizes[:shard]) // mod.tp_size
        target, where = param, f"{path}.{leaf}"
        expect_rows = (mod.output_size_per_partition,)
    elif rule in ("row", "row-bias", "vocab", "full"):
        target, where = _param(model, name), name
        if target is None:
            return None, f"{name} not found"
        off, expect_rows = 0, None
    else:
        return None, f"no direct rule for {rule!r}"
    rows = want[0] if want else 0
    if expect_rows is not None and (target.dim() == 0 or target.shape[0] != expect_rows[0]):
        return None, f"{where} has shape {list(target.shape)}, not as loaded ({expect_rows[0]} rows)"
    if target.dim() != len(want) or tuple(target.shape[1:]) != want[1:] or off + rows > target.shape[0]:
        return None, f"{where} has shape {list(target.shape)}, not as loaded (rows [{off}, {off + rows}) of {list(want)})"
    if rule == "full" and tuple(target.shape) != want:
        return None, f"{where} has shape {list(target.shape)}, the HF tensor {list(want)}"
    view = target.data[off : off + rows] if len(want) else target.data
    if not view.is_contiguous():
        return None, f"{where} rows [{off}, {off + rows}) are not contiguous"
    return view, where
