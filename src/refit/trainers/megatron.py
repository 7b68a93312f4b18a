"""Megatron-Core ``GPTModel`` as refit's source: the box of every HF tensor each rank holds, read
from the live model, nothing gathered.

Megatron keeps tensors in its own layouts; each maps to HF boxes exactly:

==========================================  ===================================================
Megatron parameter (per rank)               HF tensor(s), box
==========================================  ===================================================
``linear_qkv`` weight / bias                q, k, v: per query group ``g`` the rows
                                            ``[q heads of g; k_g; v_g]``, cut on dim 0 by TP
                                            (whole groups, or part of one group when TP > groups);
                                            one part per group (``row_block``)
``linear_fc1`` (``partition_stride`` 2)     gate rows and up rows of the rank's chunk:
                                            ``[gate[r*F/tp:(r+1)*F/tp]; up[same]]``
``linear_proj``, ``linear_fc2``             o_proj, down_proj: columns (``partition_dim`` 1)
embedding, ``output_layer``                 embed_tokens, lm_head: rows of the padded vocabulary;
                                            rows at or past the HF vocabulary are never sent
``local_experts.j.linear_fc{1,2}``          stacked ``mlp.experts.gate_up_proj`` ``[E, 2, I, H]`` /
                                            ``down_proj`` ``[E, H, I]``: expert
                                            ``mlp.local_expert_indices[j]``, cut by expert-TP;
                                            one part per expert (``row_block`` 1)
norms, router                               replicated
==========================================  ===================================================

What is read where: the global layer from each layer's ``layer_number`` (1-based, Megatron numbers
layers locally per pipeline stage), TP sharding from each parameter's ``tensor_model_parallel``,
``partition_dim`` and ``partition_stride``, TP ranks and sizes from ``parallel_state`` (expert-TP for
experts), global experts from the MoE layer's ``local_expert_indices``, ties from the output weight's
``shared_embedding``. Heads, query groups and head size come from the model's ``TransformerConfig``.
A parameter with no HF counterpart (shared experts, biases the HF model lacks, ...) raises
``LayoutError`` naming it, at setup.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from refit.layout import Box, LayoutError, Mesh, ModelLayout, TensorLayout, box_shape
from refit.layout.hf_names import logical_shape
from refit.layout.megatron import qkv_row_block, qkv_rows
from refit.layout.tensors import dtype_from_name, dtype_name
from refit.trainers.gather import all_gather_json

Part = tuple[Box, torch.Tensor]


@dataclass(frozen=True)
class Hold:
    """One rank's hold on one HF tensor: its box, and the local views that hold it, one per part."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[Part, ...]
    row_block: int | None = None

    @property
    def box(self) -> Box:
        first, last = self.parts[0][0], self.parts[-1][0]
        return ((first[0][0], last[0][1]),) + first[1:]

    def entry(self) -> list:
        """Plain data for the exchange: ``[name, shape, dtype, box, row_block]``."""
        return [self.name, list(self.shape), dtype_name(self.dtype), [list(b) for b in self.box], self.row_block]


@dataclass(frozen=True)
class _Ctx:
    """What maps one Megatron parameter: the HF shapes, the attention geometry and this rank's TP
    coordinates (dense and expert)."""

    hf: dict[str, tuple[int, ...]]
    vocab: int
    heads: int
    groups: int
    head_dim: int
    tp: tuple[int, int]  # (rank, size)
    etp: tuple[int, int]

    def shape(self, name: str, mname: str) -> tuple[int, ...]:
        if name not in self.hf:
            raise LayoutError(f"Megatron parameter {mname!r} maps to {name!r}, which the HF model does not have")
        return self.hf[name]


class MegatronSource:
    """A Megatron-Core ``GPTModel`` (or the list of its virtual-pipeline chunks on this rank) as refit's
    source, for ``Peer`` / ``Sender`` or the vLLM backend (``RefitTrainerEngine``).

    ``hf_config`` is the HF model the weights are (a ``transformers`` config): it names and shapes
    the tensors. Construction reads this rank's parameters (no collective); ``layout()`` exchanges
    every rank's holds (collective over ``group``, the trainer's default group unless given, plain
    JSON) and returns the source ``ModelLayout``; ``local()`` is this rank's tensors for it: views of
    the live parameters (one per part where a tensor is held in parts), updated by the optimizer in
    place. Raises ``LayoutError`` naming the parameter for a layout that is not boxes of HF tensors.
    """

    def __init__(self, model, hf_config, group: dist.ProcessGroup | None = None) -> None:
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.group = group
        self.holds = read_holds(self.chunks, hf_config)
        self._hf_order = list(_hf_shapes(hf_config))
        self.world_size = dist.get_world_size(group)

    def layout(self) -> ModelLayout:
        """The source layout over every rank of ``group`` (collective)."""
        gathered = all_gather_json([h.entry() for h in self.holds], self.group)
        return merge_holds(gathered, self._hf_order)

    def local(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """This rank's tensors by HF name: a view, or a list of views (one per part)."""
        return {h.name: (h.parts[0][1] if len(h.parts) == 1 else [t for _, t in h.parts]) for h in self.holds}


def _hf_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> logical shape, from a meta-device model (no memory)."""
    from refit.layout.models import build_model

    meta = build_model(hf_config, torch.float32, device="meta", seed=None)
    return {n: logical_shape(n, tuple(p.shape)) for n, p in meta.named_parameters()}


def _tp_coords() -> tuple[tuple[int, int], tuple[int, int]]:
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    return tp, etp


def read_holds(chunks: Sequence[torch.nn.Module], hf_config) -> list[Hold]:
    """This rank's holds of every HF tensor, from the model chunks' own attributes (no collective)."""
    cfg = chunks[0].config
    hf = _hf_shapes(hf_config)
    tp, etp = _tp_coords()
    heads = cfg.num_attention_heads
    ctx = _Ctx(hf, hf_config.vocab_size, heads, cfg.num_query_groups or heads, cfg.kv_channels, tp, etp)
    holds: dict[str, Hold] = {}
    for chunk in chunks:
        for hold in _chunk_holds(chunk, ctx):
            prev = holds.get(hold.name)
            holds[hold.name] = hold if prev is None else _join(prev, hold)
    return list(holds.values())


def _join(a: Hold, b: Hold) -> Hold:
    """One hold of the parts of ``a`` and ``b`` (experts of one stacked tensor, a replica held twice)."""
    if a.box == b.box:
        return a  # the same rows twice: a tied weight seen from two chunks
    if a.row_block is None or a.row_block != b.row_block:
        raise LayoutError(f"this rank holds {a.name!r} twice, as {a.box} and {b.box}")
    parts = tuple(sorted(a.parts + b.parts, key=lambda part: part[0][0]))
    return _checked(Hold(a.name, a.shape, a.dtype, parts, a.row_block), a.name)


def _chunk_holds(chunk: torch.nn.Module, ctx: _Ctx) -> Iterator[Hold]:
    layers = {f"decoder.layers.{i}.": layer for i, layer in enumerate(getattr(chunk.decoder, "layers", ()))}
    for mname, p in chunk.named_parameters():
        prefix = next((k for k in layers if mname.startswith(k)), None)
        if prefix is None:
            yield from _top_holds(mname, p, ctx)
        else:
            layer = layers[prefix]
            yield from _layer_holds(mname, mname[len(prefix) :], p, layer, layer.layer_number - 1, ctx)


def _top_holds(mname: str, p: torch.Tensor, ctx: _Ctx) -> Iterator[Hold]:
    if mname in ("embedding.word_embeddings.weight", "output_layer.weight"):
        tied = mname == "embedding.word_embeddings.weight" or getattr(p, "shared_embedding", False)
        yield from _vocab_hold("model.embed_tokens.weight" if tied else "lm_head.weight", mname, p, ctx)
    elif mname == "decoder.final_layernorm.weight":
        yield _replicated("model.norm.weight", mname, p, ctx)
    else:
        raise LayoutError(f"Megatron parameter {mname!r} {list(p.shape)} has no HF counterpart refit knows")


_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_SPLIT = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_EXPERT = re.compile(r"^mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")


def _layer_holds(mname: str, rest: str, p: torch.Tensor, layer, g: int, ctx: _Ctx) -> Iterator[Hold]:
    hf = f"model.layers.{g}."
    if rest in _NORMS:
        yield _replicated(hf + _NORMS[rest], mname, p, ctx)
    elif rest in _SPLIT:
        yield _tp_split(hf + _SPLIT[rest], mname, p, ctx)
    elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        yield from _qkv_holds(hf + "self_attn.", rest.rsplit(".", 1)[1], mname, p, ctx)
    elif rest == "mlp.linear_fc1.weight":
        yield from _fc1_holds(hf + "mlp.", mname, p, ctx)
    elif m := _EXPERT.match(rest):
        j, fc = (int(m[1]), m[2]) if m[1] is not None else (int(m[4]), m[3])
        yield _expert_hold(hf + "mlp.experts.", fc, layer.mlp.local_expert_indices[j], mname, p, ctx)
    else:
        raise LayoutError(
            f"Megatron parameter {mname!r} {list(p.shape)} has no HF counterpart refit knows "
            "(supported: attention, dense MLP, routed experts, norms, embeddings)"
        )


def _whole(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _replicated(name: str, mname: str, p: torch.Tensor, ctx: _Ctx) -> Hold:
    shape = ctx.shape(name, mname)
    if tuple(p.shape) != shape:
        raise LayoutError(f"Megatron parameter {mname!r} {list(p.shape)} does not match HF {name!r} {list(shape)}")
    return Hold(name, shape, p.dtype, ((_whole(shape), p.detach()),))


def _tp_split(name: str, mname: str, p: torch.Tensor, ctx: _Ctx) -> Hold:
    """A tensor cut along its ``partition_dim`` over TP, one chunk per rank in rank order."""
    shape = ctx.shape(name, mname)
    if not getattr(p, "tensor_model_parallel", False):
        return _replicated(name, mname, p, ctx)
    if getattr(p, "partition_stride", 1) != 1:
        raise LayoutError(f"Megatron parameter {mname!r} has partition_stride {p.partition_stride}; expected 1")
    d, (r, _) = p.partition_dim, ctx.tp
    n = p.shape[d]
    box = list(_whole(shape))
    box[d] = (r * n, (r + 1) * n)
    return _checked(Hold(name, shape, p.dtype, ((tuple(box), p.detach()),)), mname)


def _checked(h: Hold, mname: str) -> Hold:
    """``h``'s parts lie inside the HF shape, follow each other on dim 0 and have their boxes' shapes."""
    for (a, _), (b, _) in zip(h.parts, h.parts[1:]):
        if a[0][1] != b[0][0] or a[1:] != b[1:]:
            raise LayoutError(f"Megatron parameter {mname!r}: its parts of {h.name!r} are not one box ({a}, {b})")
    for box, t in h.parts:
        if any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(box, h.shape)) or tuple(t.shape) != box_shape(box):
            raise LayoutError(
                f"Megatron parameter {mname!r}: its part {list(t.shape)} at {[list(b) for b in box]} does not fit "
                f"HF {h.name!r} {list(h.shape)} (a layout refit cannot express as boxes, or another model)"
            )
    return h


def _vocab_hold(name: str, mname: str, p: torch.Tensor, ctx: _Ctx) -> Iterator[Hold]:
    """Rows ``[r*L, (r+1)*L)`` of the padded vocabulary, cut at the HF vocabulary: padding never sent
    (a rank holding only padding holds nothing)."""
    shape = ctx.shape(name, mname)
    r = ctx.tp[0] if getattr(p, "tensor_model_parallel", False) else 0
    rows = p.shape[0]
    lo, hi = min(r * rows, ctx.vocab), min((r + 1) * rows, ctx.vocab)
    if hi > lo:
        part = (((lo, hi),) + _whole(shape[1:]), p.detach()[: hi - lo])
        yield _checked(Hold(name, shape, p.dtype, (part,)), mname)


def _qkv_holds(prefix: str, kind: str, mname: str, p: torch.Tensor, ctx: _Ctx) -> Iterator[Hold]:
    """q, k, v parts of this rank's rows of the interleaved ``[q_g; k_g; v_g]`` groups."""
    hd, groups = ctx.head_dim, ctx.groups
    rows, (r, size) = p.shape[0], (ctx.tp if getattr(p, "tensor_model_parallel", False) else (0, 1))
    if rows * size != groups * (ctx.heads // groups + 2) * hd:
        raise LayoutError(
            f"Megatron parameter {mname!r} has {rows} rows on each of {size} ranks; {groups} query groups of "
            f"{ctx.heads // groups} q heads + k + v at head size {hd} need {groups * (ctx.heads // groups + 2) * hd}"
        )
    w, rest = p.detach(), _whole(p.shape[1:])
    for what, runs in qkv_rows(r * rows, (r + 1) * rows, ctx.heads, groups, hd).items():
        if runs:
            name = f"{prefix}{what}_proj.{kind}"
            parts = tuple((((a, b),) + rest, w[o : o + b - a]) for a, b, o in runs)
            block = qkv_row_block(what, ctx.heads, groups, hd)
            yield _checked(Hold(name, ctx.shape(name, mname), p.dtype, parts, block), mname)


def _fc1_holds(prefix: str, mname: str, p: torch.Tensor, ctx: _Ctx) -> Iterator[Hold]:
    """gate and up rows of this rank's ``[gate chunk; up chunk]``."""
    stride = getattr(p, "partition_stride", 1)
    split = getattr(p, "tensor_model_parallel", False)
    if split and (stride != 2 or p.partition_dim != 0):
        raise LayoutError(
            f"Megatron parameter {mname!r}: partition_stride {stride}, partition_dim {p.partition_dim}; "
            "refit reads the SwiGLU fc1 as [gate chunk; up chunk] (partition_stride 2 on dim 0)"
        )
    n = p.shape[0] // 2
    r = ctx.tp[0] if split else 0
    w = p.detach()
    for k, what in enumerate(("gate_proj", "up_proj")):
        name = f"{prefix}{what}.weight"
        box = ((r * n, (r + 1) * n),) + _whole(w.shape[1:])
        yield _checked(Hold(name, ctx.shape(name, mname), p.dtype, ((box, w[k * n : (k + 1) * n]),)), mname)


def _expert_hold(prefix: str, fc: str, e: int, mname: str, p: torch.Tensor, ctx: _Ctx) -> Hold:
    """One expert's fc1 (as ``[1, 2, I/etp, H]`` of ``gate_up_proj``) or fc2 (``[1, H, I/etp]`` of
    ``down_proj``), cut by expert-TP; a part of its own (``row_block`` 1: experts are separate tensors)."""
    r = ctx.etp[0] if getattr(p, "tensor_model_parallel", False) else 0
    w = p.detach()
    if fc == "linear_fc1":
        name, n = prefix + "gate_up_proj", w.shape[0] // 2
        view, box = w.view(1, 2, n, w.shape[1]), ((e, e + 1), (0, 2), (r * n, (r + 1) * n), (0, w.shape[1]))
    else:
        name, n = prefix + "down_proj", w.shape[1]
        view, box = w.unsqueeze(0), ((e, e + 1), (0, w.shape[0]), (r * n, (r + 1) * n))
    if name not in ctx.hf:
        raise LayoutError(
            f"Megatron parameter {mname!r}: the HF model has no stacked {name!r}; refit maps Megatron experts to "
            "transformers' stacked experts (transformers >= 5)"
        )
    return _checked(Hold(name, ctx.hf[name], p.dtype, ((box, view),), 1), mname)


def merge_holds(per_rank: Sequence[Sequence[list]], order: Sequence[str]) -> ModelLayout:
    """The source layout from every rank's ``Hold.entry()`` list (rank order), tensors in HF ``order``.

    Every rank's entry for one tensor must agree on shape, dtype and ``row_block`` (``LayoutError``
    naming both ranks otherwise); a tensor no rank holds is left out (the planner then names it)."""
    world = len(per_rank)
    mesh = Mesh((world,), ("rank",), tuple(range(world)))
    seen: dict[str, tuple] = {}
    boxes: dict[str, dict[int, Box]] = {}
    for rank, entries in enumerate(per_rank):
        for name, shape, dtype, box, block in entries:
            key = (tuple(shape), dtype, block)
            first = seen.setdefault(name, (*key, rank))
            if first[:3] != key:
                raise LayoutError(
                    f"tensor {name!r}: rank {first[3]} holds it as shape {list(first[0])} {first[1]} "
                    f"row_block {first[2]}, rank {rank} as {shape} {dtype} row_block {block}"
                )
            boxes.setdefault(name, {})[rank] = tuple(tuple(b) for b in box)
    missing = [n for n in order if n not in seen]
    if missing:
        raise LayoutError(
            f"{len(missing)} HF tensor(s) held by no Megatron rank, first: {missing[0]!r} "
            "(a model chunk missing from this source, or another HF config)"
        )
    tensors = []
    for name in order:
        shape, dtype, block, _ = seen[name]
        tensors.append(
            TensorLayout(name, shape, dtype_from_name(dtype), mesh, (Replicate(),), boxes[name], row_block=block)
        )
    return ModelLayout(tuple(tensors), world)


__all__ = ["Hold", "MegatronSource", "merge_holds", "read_holds"]
