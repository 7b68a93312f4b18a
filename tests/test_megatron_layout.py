"""Megatron's storage as refit layouts, without Megatron: interleaved qkv rows, sources stored in parts
(``row_block``) through planner, binding and a real refit, padded vocabulary, the CLI's ``megatron:`` specs."""

import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from refit.binding import bind_local
from refit.layout import LayoutError, Mesh, ModelLayout, TensorLayout, box_contains, box_slices
from refit.layout.megatron import megatron_layout, padded_vocab, qkv_rows
from refit.layout.models import load_config, param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap, build_plan
from refit.tools.cli import main
from refit.transfer import Peer


def _interleaved(heads: int, groups: int, hd: int, cols: int = 3):
    """Distinct q, k, v and Megatron's interleaved [q_g; k_g; v_g] of them, built independently."""
    per = heads // groups
    q = torch.arange(heads * hd * cols, dtype=torch.float32).view(heads * hd, cols)
    k = 10_000 + torch.arange(groups * hd * cols, dtype=torch.float32).view(groups * hd, cols)
    v = 20_000 + torch.arange(groups * hd * cols, dtype=torch.float32).view(groups * hd, cols)
    rows = []
    for g in range(groups):
        rows += [q[g * per * hd : (g + 1) * per * hd], k[g * hd : (g + 1) * hd], v[g * hd : (g + 1) * hd]]
    return {"q": q, "k": k, "v": v}, torch.cat(rows)


@pytest.mark.parametrize("heads,groups,tp", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (8, 2, 8), (12, 4, 2), (4, 4, 4)])
def test_qkv_rows_match_an_interleaved_tensor(heads, groups, tp):
    hd = 4
    hf, qkv = _interleaved(heads, groups, hd)
    rows = qkv.shape[0] // tp
    covered = {w: torch.zeros(t.shape[0], dtype=torch.int64) for w, t in hf.items()}
    for r in range(tp):
        local = qkv[r * rows : (r + 1) * rows]
        for what, runs in qkv_rows(r * rows, (r + 1) * rows, heads, groups, hd).items():
            for a, b, off in runs:
                assert torch.equal(local[off : off + b - a], hf[what][a:b])
                covered[what][a:b] += 1
            if runs:  # one rank's runs of one tensor follow each other: a single box
                assert all(x[1] == y[0] for x, y in zip(runs, runs[1:]))
    assert all(bool((c == 1).all()) for c in covered.values())


def test_parts_cut_a_box_at_row_block_multiples():
    mesh = Mesh((2,), ("tp",), (0, 1))
    t = TensorLayout("w", (12, 4), torch.float32, mesh, (Replicate(),), {0: ((0, 8), (0, 4)), 1: ((5, 12), (0, 4))}, 4)
    assert t.parts(0) == [((0, 4), (0, 4)), ((4, 8), (0, 4))]
    assert t.parts(1) == [((5, 8), (0, 4)), ((8, 12), (0, 4))]
    assert TensorLayout("w", (12, 4), torch.float32, mesh, (Shard(0),)).parts(1) == [((6, 12), (0, 4))]
    for bad in (0, True, 2.0):
        with pytest.raises(LayoutError, match="row_block must be an integer >= 1"):
            TensorLayout("w", (12, 4), torch.float32, mesh, (Shard(0),), row_block=bad)


def test_row_block_survives_json_and_changes_the_digest():
    params = param_shapes("tiny-llama")
    src = megatron_layout(params, parse_spec("tp=2", "src"), load_config("tiny-llama"))
    assert src["model.layers.0.self_attn.q_proj.weight"].row_block == 64  # 2 q heads of 32 per group
    doc = json.loads(json.dumps(src.to_json()))
    assert ModelLayout.from_json(doc) == src
    dst = layout_from_spec(params, parse_spec("tp=1", "dst"))
    plain = layout_from_spec(params, parse_spec("tp=2", "src"))
    assert build_plan(src, dst).digest != build_plan(plain, dst).digest


@pytest.mark.parametrize("src_spec,dst_spec", [("tp=2", "tp=1"), ("tp=1", "tp=2"), ("tp=4", "tp=2")])
def test_no_piece_crosses_a_part(src_spec, dst_spec):
    params = param_shapes("tiny-llama")
    src = megatron_layout(params, parse_spec(src_spec, "src"), load_config("tiny-llama"))
    dst = layout_from_spec(params, parse_spec(dst_spec, "dst"))
    plan = build_plan(src, dst)
    assert plan.ratio == 1.0
    pieces = [p for m in plan.messages for p in m.pieces] + list(plan.local)
    split = {t.name for t in src if t.row_block is not None}
    assert split >= {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    for p in pieces:
        if p.tensor in split:
            assert any(box_contains(part, p.box) for part in src[p.tensor].parts(p.src)), p


def test_megatron_vocab_rows_are_the_padded_vocabularys_without_padding():
    assert padded_vocab(500, 2) == 512 and padded_vocab(512, 2) == 512 and padded_vocab(513, 2) == 768
    params = [(n, (500, *s[1:]) if "embed" in n or "lm_head" in n else s, d) for n, s, d in param_shapes("tiny-llama")]
    cfg = load_config("tiny-llama")
    lay = megatron_layout(params, parse_spec("tp=4", "src"), cfg, vocab_divisible_by=64)
    # padded to 512: 128 rows per rank; rank 3 holds rows 384..499 only, never the 12 padding rows
    assert [lay["lm_head.weight"].box(r)[0] for r in range(4)] == [(0, 128), (128, 256), (256, 384), (384, 500)]


def test_tied_embedding_has_a_replica_on_the_last_stage():
    cfg = load_config("tiny-llama")
    cfg.tie_word_embeddings = True
    params = [p for p in param_shapes("tiny-llama") if p[0] != "lm_head.weight"]
    lay = megatron_layout(params, parse_spec("pp=2,tp=2", "src"), cfg)
    holders = lay["model.embed_tokens.weight"].holders()
    assert sorted(holders.values()) == [[0, 2], [1, 3]]  # (stage 0, stage 1) per TP rank


def test_fewer_query_groups_than_tp_ranks_split_q_k_v_between_ranks():
    params = param_shapes("tiny-llama")  # 4 heads, 2 KV groups of 32: per group 2 q heads + k + v = 128 rows
    lay = megatron_layout(params, parse_spec("tp=4", "src"), load_config("tiny-llama"))
    q, k = lay["model.layers.0.self_attn.q_proj.weight"], lay["model.layers.0.self_attn.k_proj.weight"]
    assert [q.box(r) and q.box(r)[0] for r in range(4)] == [(0, 64), None, (64, 128), None]
    assert [k.box(r) and k.box(r)[0] for r in range(4)] == [None, (0, 32), None, (32, 64)]


def test_a_source_held_in_parts_refits_exactly_and_a_wrong_part_count_is_named():
    heads, groups, hd, cols = 4, 2, 2, 3
    hf, qkv = _interleaved(heads, groups, hd, cols)
    mesh = Mesh((1,), ("r",), (0,))
    shapes = {w: t.shape for w, t in hf.items()}
    src = ModelLayout(
        tuple(
            TensorLayout(w, shapes[w], torch.float32, mesh, (Replicate(),), row_block=(4 if w == "q" else 2))
            for w in hf
        ),
        1,
    )
    dst = ModelLayout(tuple(TensorLayout(w, shapes[w], torch.float32, mesh, (Replicate(),)) for w in hf), 1)
    parts = {w: [] for w in hf}
    for w, runs in qkv_rows(0, qkv.shape[0], heads, groups, hd).items():
        parts[w] = [qkv[o : o + b - a] for a, b, o in runs]  # views into the interleaved tensor
    out = {w: torch.zeros_like(t) for w, t in hf.items()}
    peer = Peer(src, dst, 0, src_tensors=parts, dst_tensors=out, procs=ProcessMap.colocated(1, 1))
    qkv.mul_(3)  # an optimizer step in place: the bound views see it
    peer.run(1)
    peer.close()
    for w in hf:
        assert torch.equal(out[w], hf[w] * 3)
    plan = build_plan(src, dst)
    with pytest.raises(LayoutError, match="stored in 2 blocks of 4 rows; expected a tensor or a list of 2 tensors"):
        bind_local(plan, 0, {**parts, "q": parts["q"][:1]}, out)
    whole = {w: hf[w][box_slices(src[w].box(0))] for w in hf}  # one tensor of the whole box also works
    assert bind_local(plan, 0, whole, out).src_view("q", ((4, 6), (0, 3))).data_ptr() == hf["q"][4].data_ptr()


def test_cli_plans_megatron_specs(capsys):
    assert main(["plan", "--model", "tiny-qwen3-moe", "--src", "megatron:tp=2,ep=2", "--dst", "tp=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ratio"] == 1.0
    rb = {t["name"]: t.get("row_block") for t in out["src_layout"]["tensors"]}
    assert rb["model.layers.0.mlp.experts.gate_up_proj"] == 1 and rb["model.layers.0.self_attn.q_proj.weight"] == 64


@pytest.mark.parametrize(
    "src,msg",
    [
        ("foo:tp=2", "unknown trainer family 'foo' in 'foo:tp=2'; known: megatron"),
        ("megatron:tp=3", "tp=3 must divide num_attention_heads=4"),
        ("megatron:tp=2,zz=1", "unknown key 'zz'"),
    ],
)
def test_cli_bad_megatron_spec_is_one_line_exit_2(capsys, src, msg):
    assert main(["plan", "--model", "tiny-llama", "--src", src, "--dst", "tp=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err


class _Layer(torch.nn.Module):
    def __init__(self, extra: str | None, hidden: int) -> None:
        super().__init__()
        self.layer_number = 1
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.ones(hidden))
        if extra is not None:  # a parameter the HF model has no counterpart for, at a dotted path
            mod = self
            for part in extra.split(".")[:-1]:
                mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(extra.rsplit(".", 1)[1], torch.nn.Parameter(torch.zeros(hidden, hidden)))


def _fake_gpt(extra: str | None, stride: int = 1):
    """A stand-in for a Megatron ``GPTModel`` chunk: the attributes ``read_holds`` reads, one layer."""
    cfg = load_config("tiny-llama")
    chunk = torch.nn.Module()
    chunk.config = type("Cfg", (), {"num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 32})()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = torch.nn.ModuleList([_Layer(extra, cfg.hidden_size)])
    if stride != 1:
        proj = torch.nn.Parameter(torch.zeros(cfg.hidden_size, cfg.hidden_size))
        proj.tensor_model_parallel, proj.partition_dim, proj.partition_stride = True, 1, stride
        chunk.decoder.layers[0].add_module("self_attention", torch.nn.Module())
        chunk.decoder.layers[0].self_attention.add_module("linear_proj", torch.nn.Module())
        chunk.decoder.layers[0].self_attention.linear_proj.weight = proj
    return chunk, cfg


@pytest.mark.parametrize(
    "extra,stride,msg",
    [
        ("mlp.shared_experts.linear_fc1.weight", 1, "'decoder.layers.0.mlp.shared_experts.linear_fc1.weight' .* no HF"),
        ("self_attention.linear_proj.bias", 1, "'decoder.layers.0.self_attention.linear_proj.bias' .* no HF"),
        (None, 2, "'decoder.layers.0.self_attention.linear_proj.weight' has partition_stride 2"),
    ],
)
def test_a_megatron_parameter_that_is_not_boxes_of_hf_tensors_is_named_at_setup(monkeypatch, extra, stride, msg):
    from refit.trainers import megatron as mt

    monkeypatch.setattr(mt, "_tp_coords", lambda: ((0, 1), (0, 1)))  # parallel_state without Megatron
    chunk, cfg = _fake_gpt(extra, stride)
    with pytest.raises(LayoutError, match=msg):
        mt.read_holds([chunk], cfg)
    ok, _ = _fake_gpt(None)
    names = [h.name for h in mt.read_holds([ok], cfg)]  # the same model without it maps
    assert names == ["model.layers.0.input_layernorm.weight"]
