"""Megatron-Core's trainer layout from a spec (``refit plan --src megatron:tp=2,pp=2``), no model built.

Megatron's ``GPTModel`` holds the boxes of ``rules.layout_from_spec`` (TP, PP, EP, expert-TP; its
rank order puts ``tp`` fastest, then ``ep``, ``dp``, ``pp``), stored its own way:

* q, k, v live interleaved in ``linear_qkv`` per query group (``[q heads of g; k_g; v_g]``), cut
  contiguously over TP: each rank stores one part per group (``row_block``); with fewer groups
  than TP ranks a rank holds a slice of one group's rows, which may be q rows, or k and v rows
  (``qkv_rows``);
* embeddings and the output layer are cut by rows of the padded vocabulary (a multiple of
  ``vocab_divisible_by * tp``): rank ``t`` holds rows ``[t*Vp/tp, (t+1)*Vp/tp)`` below the HF
  vocabulary; with tied weights and pipeline stages the last stage holds a replica of the
  embedding (its ``output_layer``);
* stacked experts: one part per expert (separate parameters).

``refit.trainers.megatron`` reads the same from a live model; the tests check both agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from refit.layout.hf_names import STACKED_EXPERTS, VOCAB_PARALLEL, Role, param_role
from refit.layout.rules import ParamShape, layout_from_spec
from refit.layout.spec import ParallelSpec
from refit.layout.tensors import Box, ModelLayout, TensorLayout

FAMILY = "megatron"
"""The trainer family prefix of a source spec: ``megatron:tp=2,pp=2``."""

_QKV = {Role.Q_PROJ: "q", Role.K_PROJ: "k", Role.V_PROJ: "v"}


def qkv_rows(lo: int, hi: int, heads: int, groups: int, head_dim: int) -> dict[str, list[tuple[int, int, int]]]:
    """Rows ``[lo, hi)`` of Megatron's interleaved ``linear_qkv`` (per query group ``[q; k; v]``) as HF
    rows: ``{"q" | "k" | "v": [(hf_start, hf_stop, offset in [lo, hi)), ...]}``, one entry per group met,
    in order."""
    per = heads // groups
    seg = (per + 2) * head_dim
    out: dict[str, list[tuple[int, int, int]]] = {"q": [], "k": [], "v": []}
    segments = (("q", 0, per * head_dim), ("k", per * head_dim, head_dim), ("v", seg - head_dim, head_dim))
    for g in range(lo // seg, -(-hi // seg)):
        for what, off, n in segments:
            a, b = max(lo, g * seg + off), min(hi, g * seg + off + n)
            if a < b:
                base = g * n - (g * seg + off)  # interleaved row -> HF row
                out[what].append((a + base, b + base, a - lo))
    return out


def qkv_row_block(what: str, heads: int, groups: int, head_dim: int) -> int:
    """HF rows of q, k or v that one query group holds: the parts Megatron stores them in."""
    return (heads // groups) * head_dim if what == "q" else head_dim


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's ``vocab_size_with_padding``: ``vocab`` rounded up to a multiple of ``divisible_by * tp``."""
    step = divisible_by * tp
    return -(-vocab // step) * step


def megatron_layout(
    params: Sequence[ParamShape], spec: ParallelSpec, config: Any, vocab_divisible_by: int = 128
) -> ModelLayout:
    """The source layout of a Megatron ``GPTModel`` of ``config`` (an HF config) under ``spec``."""
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = []
    for t in layout_from_spec(params, spec):
        role = param_role(t.name)
        if role in _QKV:
            out.append(_qkv(t, _QKV[role], spec, heads, groups, head_dim))
        elif role in VOCAB_PARALLEL:
            out.append(_vocab(t, spec, vocab_divisible_by, tied))
        elif role in STACKED_EXPERTS:
            out.append(replace(t, row_block=1))
        else:
            out.append(t)
    return ModelLayout(tuple(out), spec.world_size)


def _coord(spec: ParallelSpec, rank: int, dim: str) -> int:
    """``rank``'s coordinate along ``dim`` of the spec's mesh (last dim fastest)."""
    i = spec.dim_names.index(dim)
    after = 1
    for d in spec.mesh_shape[i + 1 :]:
        after *= d
    return (rank // after) % spec.mesh_shape[i]


def _explicit(t: TensorLayout, boxes: dict[int, Box], row_block: int | None = None) -> TensorLayout:
    return TensorLayout(t.name, t.shape, t.dtype, t.mesh, t.placements, boxes, row_block)


def _qkv(t: TensorLayout, what: str, spec: ParallelSpec, heads: int, groups: int, head_dim: int) -> TensorLayout:
    block = qkv_row_block(what, heads, groups, head_dim)
    tp = spec.degree("tp")
    if groups % tp == 0:  # whole groups per rank: the spec's boxes, stored one part per group
        return replace(t, row_block=block)
    rows = groups * (heads // groups + 2) * head_dim // tp
    boxes = {}
    for r in t.ranks:
        c = _coord(spec, r, "tp")
        got = qkv_rows(c * rows, (c + 1) * rows, heads, groups, head_dim)[what]
        if got:
            boxes[r] = ((got[0][0], got[-1][1]),) + tuple((0, n) for n in t.shape[1:])
    return _explicit(t, boxes, block)


def _vocab(t: TensorLayout, spec: ParallelSpec, divisible_by: int, tied: bool) -> TensorLayout:
    tp, pp = spec.degree("tp"), spec.degree("pp")
    rows = padded_vocab(t.shape[0], tp, divisible_by) // tp
    ranks = list(t.ranks)
    if tied and pp > 1 and param_role(t.name) is Role.EMBED:  # the last stage's output layer: a replica
        ranks += [r for r in range(spec.world_size) if _coord(spec, r, "pp") == pp - 1]
    boxes = {}
    for r in ranks:
        c = _coord(spec, r, "tp")
        lo, hi = min(c * rows, t.shape[0]), min((c + 1) * rows, t.shape[0])
        if hi > lo:
            boxes[r] = ((lo, hi),) + tuple((0, n) for n in t.shape[1:])
    return _explicit(t, boxes)


__all__ = ["FAMILY", "megatron_layout", "padded_vocab", "qkv_row_block", "qkv_rows"]
