"""MoE layouts: stacked experts split by ep (experts) and etp/tp (inside experts), real reshards bit for bit."""

import json

import pytest
from torch.distributed.tensor import Replicate, Shard

from refit.cli import main
from refit.models import load_config, param_shapes
from refit.rules import layout_from_spec
from refit.spec import parse_spec
from refit.verify import verify

MODEL = "tiny-qwen3-moe"


def _layout(spec, side="src"):
    return layout_from_spec(param_shapes(MODEL), parse_spec(spec, side))


def test_logical_expert_tensors_split_hf_gate_up():
    cfg = load_config(MODEL)
    shapes = {n: s for n, s, _ in param_shapes(MODEL)}
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert shapes["model.layers.0.mlp.experts.gate_proj"] == (e, i, h)
    assert shapes["model.layers.0.mlp.experts.up_proj"] == (e, i, h)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (e, h, i)
    assert shapes["model.layers.0.mlp.gate.weight"] == (e, h)  # the router
    assert not any(n.endswith("gate_up_proj") for n in shapes)


def test_ep_splits_experts_tp_splits_inside_them_dense_tensors_replicated_over_ep():
    lay = _layout("ep=2,tp=2")  # mesh (ep, tp): rank = 2 * ep_index + tp_index
    gate = lay["model.layers.0.mlp.experts.gate_proj"]
    down = lay["model.layers.0.mlp.experts.down_proj"]
    assert gate.box(3) == ((4, 8), (32, 64), (0, 128))  # experts 4-7, second half of I
    assert down.box(1) == ((0, 4), (0, 128), (32, 64))
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert q.box(0) == q.box(2) == ((0, 64), (0, 128))  # tp-sharded, the same on both ep ranks
    router = lay["model.layers.0.mlp.gate.weight"]
    assert all(router.box(r) == ((0, 8), (0, 128)) for r in range(4))


def test_etp_takes_tp_inside_experts():
    lay = _layout("etp=2,ep=2")
    gate = lay["model.layers.0.mlp.experts.gate_proj"]
    assert list(gate.placements) == [Shard(0), Shard(1)]
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert all(isinstance(p, Replicate) for p in q.placements) or q.mesh.size == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("src,dst", [("ep=2", "tp=2"), ("ep=2,tp=2", "tp=4"), ("pp=2,ep=2", "tp=2,dp=2"),
                                     ("etp=2,ep=2", "ep=2,tp=2")])
def test_moe_reshard_is_bit_exact(src, dst):
    res = verify(_layout(src), _layout(dst, "dst"))
    assert res.ok, res.mismatches[:3]
    assert res.plan.ratio == 1.0


def test_qwen3_30b_a3b_plan_moves_exactly_what_is_needed(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b", "--src", "pp=2,ep=4,tp=2", "--dst", "tp=4,dp=2", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["ratio"] == 1.0
    assert info["bytes_moved"] == info["bytes_needed"]
    assert 2 * 60e9 < info["bytes_needed"] < 2 * 62e9  # about 61 GB of bf16, once per engine replica


@pytest.mark.timeout(300)
def test_a_parameter_no_rule_knows_still_arrives_whole():
    import torch

    shapes = param_shapes(MODEL) + [("model.layers.1.mlp.mystery_scale", (3, 7, 5), torch.float32)]
    src = layout_from_spec(shapes, parse_spec("ep=2,tp=2", "src"))
    dst = layout_from_spec(shapes, parse_spec("tp=2", "dst"))
    t = dst["model.layers.1.mlp.mystery_scale"]
    assert all(t.box(r) == ((0, 3), (0, 7), (0, 5)) for r in range(2))  # replicated: every engine rank gets all of it
    res = verify(src, dst)
    assert res.ok, res.mismatches[:3]
