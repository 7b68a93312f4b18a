import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from refit.layout.models import PRESETS, ModelError, load_config, param_shapes
from refit.layout.rules import layout_from_spec, pp_stage, stage_bounds, tp_placement
from refit.layout.spec import SpecError, parse_spec


def test_parse_spec_orders_dims_and_counts_ranks():
    s = parse_spec("tp=2,pp=2", "src")
    assert s.dim_names == ("pp", "dp", "fsdp", "ep", "etp", "tp")
    assert s.mesh_shape == (2, 1, 1, 1, 1, 2)
    assert s.world_size == 4
    d = parse_spec(" dp = 4 ,tp=1", "dst")
    assert (d.degree("dp"), d.degree("tp"), d.world_size) == (4, 1, 4)


@pytest.mark.parametrize(
    "text,side,match",
    [
        ("tp=2,cp=2", "src", "unknown key 'cp'.*allowed keys: pp, dp, fsdp, ep, etp, tp"),
        ("pp=2", "dst", "unknown key 'pp'.*allowed keys: dp, ep, tp"),
        ("etp=2", "dst", "unknown key 'etp'"),
        ("tp=0", "src", "must be >= 1, got 0"),
        ("tp=x", "src", "must be an integer"),
        ("tp=2,tp=2", "src", "given twice"),
        ("tp2", "src", "expected key=degree"),
        ("", "dst", "empty"),
    ],
)
def test_bad_specs(text, side, match):
    with pytest.raises(SpecError, match=match):
        parse_spec(text, side)


def test_replica_spec_and_ranks():
    d = parse_spec("tp=4,dp=2", "dst")
    assert str(d.replica()) == "tp=4" and d.replica().world_size == 4
    assert d.replica_ranks() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    one = parse_spec("tp=2", "dst")
    assert one.replica() == one and one.replica_ranks() == [[0, 1]]
    assert str(parse_spec("dp=3", "dst").replica()) == "tp=1"


def test_spec_world_size_mismatch_names_numbers():
    with pytest.raises(SpecError, match=r"pp=2 x tp=2 = 4 ranks, but 3 are given"):
        parse_spec("tp=2,pp=2", "src").check_world_size(3)


@pytest.mark.parametrize(
    "name,placement",
    [
        ("model.layers.3.self_attn.q_proj.weight", Shard(0)),
        ("model.layers.3.self_attn.k_proj.bias", Shard(0)),
        ("model.layers.3.self_attn.o_proj.weight", Shard(1)),
        ("model.layers.3.self_attn.o_proj.bias", Replicate()),
        ("model.layers.3.mlp.gate_proj.weight", Shard(0)),
        ("model.layers.3.mlp.up_proj.weight", Shard(0)),
        ("model.layers.3.mlp.down_proj.weight", Shard(1)),
        ("model.embed_tokens.weight", Shard(0)),
        ("lm_head.weight", Shard(0)),
        ("model.layers.3.self_attn.q_norm.weight", Replicate()),
        ("model.layers.3.input_layernorm.weight", Replicate()),
        ("model.norm.weight", Replicate()),
    ],
)
def test_tp_rules(name, placement):
    assert tp_placement(name) == placement


def test_pp_stages_contiguous_with_embeddings_first_and_head_last():
    assert stage_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert pp_stage("model.embed_tokens.weight", 10, 4) == 0
    assert pp_stage("model.layers.5.mlp.up_proj.weight", 10, 4) == 1
    assert pp_stage("model.norm.weight", 10, 4) == 3
    assert pp_stage("lm_head.weight", 10, 4) == 3


def test_llama_8b_shapes_without_weights():
    shapes = param_shapes("llama-3.1-8b")
    assert len(shapes) == 291
    assert sum(torch.Size(s).numel() * 2 for _, s, _ in shapes) == 16_060_522_496
    assert all(d == torch.bfloat16 for _, _, d in shapes)


def test_qwen3_has_qk_norm_and_qwen2_has_qkv_bias():
    q3 = dict((n, s) for n, s, _ in param_shapes("tiny-qwen3"))
    assert "model.layers.0.self_attn.q_norm.weight" in q3
    q2 = dict((n, s) for n, s, _ in param_shapes("tiny-qwen2"))
    assert "model.layers.0.self_attn.q_proj.bias" in q2


def test_unknown_model_and_config_path(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'nope'"):
        load_config("nope")
    cfg = load_config("tiny-llama")
    cfg.save_pretrained(tmp_path)
    assert [n for n, _, _ in param_shapes(str(tmp_path))] == [n for n, _, _ in param_shapes("tiny-llama")]


def test_layout_from_spec_pp_tp_fsdp():
    shapes = param_shapes("tiny-llama")
    lay = layout_from_spec(shapes, parse_spec("pp=2,fsdp=2,tp=2", "src"))
    q = lay["model.layers.0.self_attn.q_proj.weight"]  # stage 0: ranks 0..3, fsdp outer, tp inner
    assert q.mesh.dim_names == ("fsdp", "tp") and q.mesh.ranks == (0, 1, 2, 3)
    assert [q.box(r)[0] for r in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    head = lay["lm_head.weight"]
    assert head.mesh.ranks == (4, 5, 6, 7) and head.box(0) is None


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_saved_config_json_loads_back(tmp_path, name):
    """A config.json transformers wrote passes refit's checks (object, known model_type, positive sizes)."""
    load_config(name).save_pretrained(tmp_path)
    assert load_config(str(tmp_path)).to_dict() == load_config(name).to_dict()
