"""FP8 engines: trainer ranks quantize their shards (128x128 blocks in real models) before the wire;
engines receive FP8 weights and ``weight_scale_inv`` laid out as vLLM's block-FP8 layers hold them."""

import json

import pytest
import torch

from refit.layout import LayoutError
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.quant import FP8, fp8_layout, quantized_names, scale_name
from refit.tools.cli import main
from refit.tools.verify import verify


def _layout(model, spec, side="src", shapes=None):
    return layout_from_spec(shapes or param_shapes(model), parse_spec(spec, side))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model,src,dst,block",
    [
        ("tiny-qwen3-moe", "ep=2", "tp=2", 32),
        ("tiny-qwen3-moe", "ep=2,tp=2", "tp=4", 16),
        ("tiny-qwen3-moe", "pp=2,ep=2", "tp=2,dp=2", 32),
        ("tiny-qwen3-moe", "etp=2,ep=2", "ep=2,tp=2", 32),
        ("tiny-qwen2", "fsdp=2", "tp=2", 32),  # ragged edge blocks (intermediate 320 = 10 blocks of 32)
    ],
)
def test_fp8_engine_receives_the_bytes_of_quantizing_the_whole_tensor(model, src, dst, block):
    # every engine rank's FP8 weight and scale boxes equal quantize_fp8_block(full tensor) at that box, byte
    # for byte, although each trainer rank quantized only its own shard
    res = verify(_layout(model, src), _layout(model, dst, "dst"), fp8_block=(block, block))
    assert res.ok, res.mismatches[:3]
    assert res.plan.ratio == 1.0
    q = quantized_names(res.plan.dst_layout)
    assert "model.layers.0.mlp.experts.gate_up_proj" in q or model == "tiny-qwen2"
    assert "model.embed_tokens.weight" not in q and "lm_head.weight" not in q


def test_scales_are_laid_out_as_vllm_holds_them():
    lay = fp8_layout(_layout("qwen3-30b-a3b", "tp=2", "dst"))
    q = lay["model.layers.0.self_attn.q_proj.weight"]
    s = lay[scale_name("model.layers.0.self_attn.q_proj.weight")]
    assert q.dtype == FP8 and s.dtype == torch.float32
    assert s.shape == (32, 16)  # [4096, 2048] in 128x128 blocks
    assert s.box(1) == ((16, 32), (0, 16))  # tp rank 1: its 2048 rows are block rows 16-31
    e = lay[scale_name("model.layers.0.mlp.experts.gate_up_proj")]
    # [E, 2, I/128, H/128]; tp rank 1 holds I rows 384-767 of gate and up: vLLM's w13_weight_scale_inv [E, 2*3, 16]
    assert e.shape == (128, 2, 6, 16) and e.box(1) == ((0, 128), (0, 2), (3, 6), (0, 16))
    o = lay[scale_name("model.layers.0.self_attn.o_proj.weight")]
    assert o.box(0) == ((0, 16), (0, 16))  # row-parallel: columns 0-2047 of 4096
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "model.layers.0.mlp.gate.weight"):
        assert lay[name].dtype == torch.bfloat16 and scale_name(name) not in lay.names


def test_shards_off_block_boundaries_are_refused_naming_tensor_rank_and_rows(capsys):
    with pytest.raises(LayoutError, match=r"experts\.gate_up_proj.*destination rank 0 holds rows \[0, 192\).*128-row"):
        fp8_layout(_layout("qwen3-30b-a3b", "tp=4", "dst"), side="destination")  # I = 768 / 4 (vLLM refuses it too)
    assert main(["plan", "--model", "qwen3-30b-a3b", "--src", "tp=2", "--dst", "tp=4", "--fp8"]) == 2
    assert "not on 128-row block boundaries" in capsys.readouterr().err


def test_fp8_plan_moves_the_quantized_bytes(capsys):
    args = ["plan", "--model", "qwen3-30b-a3b", "--src", "pp=2,ep=4,tp=2", "--dst", "tp=2,dp=4", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["ratio"] == 1.0 and fp8["bytes_moved"] == fp8["bytes_needed"]
    # 1 byte per weight + 4 per 128x128 block instead of 2: about half (embeddings and lm_head stay bf16)
    assert 0.49 < fp8["bytes_needed"] / plain["bytes_needed"] < 0.53


@pytest.mark.timeout(300)
def test_kv_cache_scales_travel_as_small_tensors():
    shapes = param_shapes("tiny-qwen3") + [
        (f"model.layers.{i}.self_attn.attn.{k}_scale", (), torch.float32) for i in range(4) for k in ("k", "v")
    ]
    src, dst = _layout(None, "tp=2", shapes=shapes), _layout(None, "tp=2,dp=2", "dst", shapes=shapes)
    t = dst["model.layers.3.self_attn.attn.v_scale"]
    assert all(t.box(r) == () for r in range(4))  # every engine rank holds the scalar
    res = verify(src, dst, fp8_block=(32, 32))
    assert res.ok, res.mismatches[:3]


def _two_versions(world):
    from refit.plan import ProcessMap
    from refit.quant import Fp8Quantizer, expected_fp8
    from refit.tools.verify import reference_shards, same_bits
    from refit.transfer import Receiver, Sender

    plain = _layout("tiny-qwen3", "tp=1")
    src, dst = fp8_layout(plain, block=(32, 32)), fp8_layout(_layout("tiny-qwen3", "tp=1", "dst"), block=(32, 32))
    procs = ProcessMap.disjoint(1, 1)
    name = "model.layers.1.mlp.down_proj.weight"
    if world.src_rank is not None:
        live = reference_shards(plain, 0)
        quantizer = Fp8Quantizer(src, 0, live, (32, 32))
        sender = Sender(src, dst, world.rank, quantizer.tensors, procs=procs, prepare=quantizer)
        sender.push(1)
        with torch.no_grad():
            live[name].mul_(-3.0)  # an optimizer step, in place
        sender.push(2)
        return live[name]
    local = {t.name: torch.zeros([b - a for a, b in box], dtype=t.dtype) for t, box in dst.local_tensors(0)}
    recv = Receiver(src, dst, world.rank, local, procs=procs)
    recv.pull(1)
    first = local[name].clone()
    recv.pull(2)
    full = reference_shards(plain, 0)[name] * -3.0
    want_q, want_s = expected_fp8(full, ((0, full.shape[0]), (0, full.shape[1])), ((0, 4), (0, 6)), (32, 32))
    return (
        same_bits(local[name], want_q),
        same_bits(local[scale_name(name)], want_s),
        not same_bits(first, local[name]),
    )


@pytest.mark.timeout(120)
def test_quantizer_refreshes_from_the_live_weights_every_push():
    from refit.tools.launch import run_local

    out = run_local(_two_versions, 1, 1, backend="gloo", timeout_s=100)
    assert out[1] == (True, True, True)
