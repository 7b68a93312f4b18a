"""MoE layouts: stacked experts split by ep (experts) and etp/tp (inside experts), real reshards bit for bit."""

import json

import pytest
from torch.distributed.tensor import Replicate, Shard

from refit.layout.models import load_config, param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.cli import main
from refit.tools.verify import verify

MODEL = "tiny-qwen3-moe"


def _layout(spec, side="src"):
    return layout_from_spec(param_shapes(MODEL), parse_spec(spec, side))


def test_logical_expert_tensors_split_the_fused_gate_up_dim():
    cfg = load_config(MODEL)
    shapes = {n: s for n, s, _ in param_shapes(MODEL)}
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (e, 2, i, h)  # HF: [E, 2I, H], the same memory
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (e, h, i)
    assert shapes["model.layers.0.mlp.gate.weight"] == (e, h)  # the router


def test_ep_splits_experts_tp_splits_inside_them_dense_tensors_replicated_over_ep():
    lay = _layout("ep=2,tp=2")  # mesh (ep, tp): rank = 2 * ep_index + tp_index
    gate = lay["model.layers.0.mlp.experts.gate_up_proj"]
    down = lay["model.layers.0.mlp.experts.down_proj"]
    assert gate.box(3) == ((4, 8), (0, 2), (32, 64), (0, 128))  # experts 4-7, gate and up, second half of I
    assert down.box(1) == ((0, 4), (0, 128), (32, 64))
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert q.box(0) == q.box(2) == ((0, 64), (0, 128))  # tp-sharded, the same on both ep ranks
    router = lay["model.layers.0.mlp.gate.weight"]
    assert all(router.box(r) == ((0, 8), (0, 128)) for r in range(4))


def test_etp_takes_tp_inside_experts():
    lay = _layout("etp=2,ep=2")
    gate = lay["model.layers.0.mlp.experts.gate_up_proj"]
    assert list(gate.placements) == [Shard(0), Shard(2)]
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    assert all(isinstance(p, Replicate) for p in q.placements) or q.mesh.size == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "src,dst", [("ep=2", "tp=2"), ("ep=2,tp=2", "tp=4"), ("pp=2,ep=2", "tp=2,dp=2"), ("etp=2,ep=2", "ep=2,tp=2")]
)
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


def _hf_moe_trainer(world, kind):
    """A real HF Qwen3-MoE (fused ``experts.gate_up_proj`` [E, 2I, H]) sharded by FSDP2 or by
    experts (EP: ``distribute_tensor`` Shard(0) on the expert params) refits into tp=2 engines.
    The engines build the source layout from the spec; pre-flight compares it with the one the
    trainer reads from its module (a difference fails both sides)."""
    import torch
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    from refit.layout.models import build_model
    from refit.plan import ProcessMap
    from refit.trainers.dtensor import full_state, layout_from_module, local_shards
    from refit.transfer import Receiver, Sender

    dst = _layout("tp=2", "dst")
    procs = ProcessMap.disjoint(2, 2)
    if world.src_rank is None:
        local = {
            t.name: torch.full([b - a for a, b in box], float("nan")) for t, box in dst.local_tensors(world.dst_rank)
        }
        Receiver(_layout(f"{kind}=2"), dst, world.rank, local, procs=procs).pull(1)
        return local
    model = build_model(load_config(MODEL), torch.float32, seed=0)
    mesh = DeviceMesh.from_group(world.trainer_group, "cpu", mesh_dim_names=(kind,))
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        for mod in list(model.modules()):
            for pn, p in list(mod.named_parameters(recurse=False)):
                pl = [Shard(0)] if pn in ("gate_up_proj", "down_proj") and p.dim() == 3 else [Replicate()]
                mod.register_parameter(pn, torch.nn.Parameter(distribute_tensor(p.data, mesh, pl)))
    Sender(layout_from_module(model, 2), dst, world.rank, local_shards(model), procs=procs).push(1)
    return full_state(model)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["fsdp", "ep"])
def test_trainer_with_hf_fused_experts_refits_bit_exact(kind):
    import torch

    from refit.layout import box_slices
    from refit.layout.hf_names import logical_shape
    from refit.tools.launch import run_local

    out = run_local(_hf_moe_trainer, 2, 2, kind, backend="gloo", timeout_s=280)
    full = {n: v.reshape(logical_shape(n, tuple(v.shape))) for n, v in out[0].items()}
    dst = _layout("tp=2", "dst")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert tuple(full[name].shape) == (8, 2, 64, 128)
    for r in range(2):
        got = out[2 + r]
        for t, box in dst.local_tensors(r):
            assert torch.equal(got[t.name], full[t.name][box_slices(box)]), (r, t.name)
    # engine rank 1 holds the second half of I of gate AND of up, for every expert
    hf = out[0][name]  # [E, 2I, H] = [8, 128, 128]: gate rows 0-63, up rows 64-127
    assert torch.equal(out[3][name][:, 0], hf[:, 32:64]) and torch.equal(out[3][name][:, 1], hf[:, 96:128])


def _kv_replicated_engine(shapes, tp: int, kv_heads: int, head_dim: int):
    """An engine tp=``tp`` layout as vLLM holds it when tp exceeds the KV heads: every rank gets its
    q/o share, and the whole KV head ``rank // (tp // kv_heads)`` (replicated over tp // kv_heads ranks)."""
    from refit.layout import TensorLayout

    lay = layout_from_spec(shapes, parse_spec(f"tp={tp}", "dst"))
    per = tp // kv_heads
    out = []
    for t in lay:
        if t.name.endswith((".k_proj.weight", ".v_proj.weight")):
            boxes = {r: ((r // per * head_dim, (r // per + 1) * head_dim), (0, t.shape[1])) for r in range(tp)}
            t = TensorLayout(t.name, t.shape, t.dtype, t.mesh, t.placements, boxes)
        out.append(t)
    return type(lay)(tuple(out), lay.world_size)


@pytest.mark.parametrize("src", ["dp=4", "dp=2,tp=2", "fsdp=2,tp=2"])
def test_replicated_kv_heads_spread_over_the_trainer_ranks_that_hold_them(src):
    # Qwen3-30B-A3B has 4 KV heads; engine tp=8 replicates each on 2 ranks. Every KV byte an engine
    # needs has several holders among the trainer ranks: the planner must not load one of them.
    from refit.plan import build_plan

    shapes = [s for s in param_shapes("qwen3-30b-a3b") if "layers." not in s[0] or ".layers.0." in s[0]]
    dst = _kv_replicated_engine(shapes, 8, 4, 128)
    plan = build_plan(_layout_of(shapes, src), dst)
    assert plan.ratio == 1.0
    kv = {}
    for m in plan.messages:
        for p in m.pieces:
            if p.tensor.endswith((".k_proj.weight", ".v_proj.weight")):
                kv[m.src] = kv.get(m.src, 0) + p.nbytes
    sent = sorted(kv.get(r, 0) for r in range(plan.src_layout.world_size))
    holders_per_byte = {"dp=4": 4, "dp=2,tp=2": 2, "fsdp=2,tp=2": 1}[src]
    assert sent[0] > 0 or holders_per_byte == 1
    assert sent[-1] <= 1.25 * sum(sent) / len(sent), sent  # no trainer rank sends much more than its share


def _layout_of(shapes, spec):
    return layout_from_spec(shapes, parse_spec(spec, "src"))
