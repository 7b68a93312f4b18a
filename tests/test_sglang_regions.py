"""``refit.engines.sglang.regions`` on stand-in modules carrying SGLang's attributes (no SGLang needed).

The real engine tests (``tests/sglang_backend``) run tiny models whose 2 KV heads split evenly over TP=2;
these cover what they cannot: KV heads replicated when TP exceeds them (k/v rows of the group
``kv_rank // num_kv_head_replicas``, placed after this rank's q rows), the second TP rank's boxes, and the
refusals where a live parameter is not as loaded (padded) or missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from refit.engines.sglang.regions import RegionError, share

H, HEAD = 64, 16


def _group(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(rank_in_group=rank, world_size=size)


def _model(rank: int, tp: int, heads: int, kv_heads: int, rows_pad: int = 0) -> torch.nn.Module:
    """A model with one SGLang-like attention block: ``qkv_proj`` (QKVParallelLinear's attributes) and
    ``o_proj`` (RowParallelLinear's), live parameters shaped as SGLang loads them (plus ``rows_pad``)."""
    q_local, kv_local = heads // tp, max(kv_heads // tp, 1)
    qkv = torch.nn.Module()
    qkv.tp_group = qkv.kv_tp_group = _group(rank, tp)
    qkv.num_heads, qkv.num_kv_heads, qkv.head_size, qkv.v_head_size = q_local, kv_local, HEAD, HEAD
    qkv.num_kv_head_replicas = max(tp // kv_heads, 1)
    rows = (q_local + 2 * kv_local) * HEAD + rows_pad
    qkv.weight = torch.nn.Parameter(torch.zeros(rows, H), requires_grad=False)
    o = torch.nn.Module()
    o.tp_group, o.input_size_per_partition = _group(rank, tp), heads * HEAD // tp
    o.weight = torch.nn.Parameter(torch.zeros(H, heads * HEAD // tp), requires_grad=False)
    attn = torch.nn.Module()
    attn.qkv_proj, attn.o_proj = qkv, o
    layer = torch.nn.Module()
    layer.self_attn = attn
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    return model


def _name(proj: str) -> str:
    return f"model.layers.0.self_attn.{proj}.weight"


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_replicated_kv_heads_and_rank_offsets(rank):
    # 4 query heads, 1 KV head, TP=4: every rank holds its q head and the one (replicated) KV head
    model = _model(rank, 4, heads=4, kv_heads=1)
    live = model.model.layers[0].self_attn.qkv_proj.weight
    q = share(model, _name("q_proj"), (4 * HEAD, H))
    k = share(model, _name("k_proj"), (HEAD, H))
    v = share(model, _name("v_proj"), (HEAD, H))
    assert q.box == ((rank * HEAD, (rank + 1) * HEAD), (0, H)) and q.rule == "qkv:q"
    assert k.box == v.box == ((0, HEAD), (0, H))
    # the views are [q | k | v] of this rank's live qkv_proj, in that order, without overlap
    base = live.data_ptr()
    offsets = [(s.view.data_ptr() - base) // (H * 4) for s in (q, k, v)]
    assert offsets == [0, HEAD, 2 * HEAD]
    o = share(model, _name("o_proj"), (H, 4 * HEAD))
    assert o.box == ((0, H), (rank * HEAD, (rank + 1) * HEAD)) and o.rule == "row"


def test_kv_groups_split_when_tp_divides_them():
    model = _model(1, 2, heads=4, kv_heads=2)
    assert share(model, _name("k_proj"), (2 * HEAD, H)).box == ((HEAD, 2 * HEAD), (0, H))
    assert share(model, _name("q_proj"), (4 * HEAD, H)).box == ((2 * HEAD, 4 * HEAD), (0, H))


def test_a_padded_live_parameter_is_refused():
    model = _model(0, 2, heads=4, kv_heads=2, rows_pad=8)  # as SGLang-CPU pads uneven head splits
    for proj, rows in (("q_proj", 4 * HEAD), ("k_proj", 2 * HEAD), ("v_proj", 2 * HEAD)):
        with pytest.raises(RegionError, match=r"qkv_proj.weight has shape \[72, 64\], not the 64 rows"):
            share(model, _name(proj), (rows, H))


def test_a_missing_module_is_refused_naming_it():
    model = _model(0, 2, heads=4, kv_heads=2)
    with pytest.raises(RegionError, match="no module 'model.layers.0.mlp.gate_up_proj'"):
        share(model, "model.layers.0.mlp.gate_proj.weight", (128, H))
    with pytest.raises(RegionError, match="no parameter 'model.norm.weight'"):
        share(model, "model.norm.weight", (H,))
