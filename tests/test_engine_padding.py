"""Engine layouts as engines allocate them (``refit.layout.engines``), without an engine running.

The vocabulary split is checked against vLLM's own ``VocabParallelEmbedding._get_indices`` (where vLLM is installed);
SGLang's CPU intermediate padding against the numbers measured on SGLang 0.5.23 (136 at tp=2: rank 0 holds rows
0-95, rank 1 rows 96-135, then padding); replicated KV heads against vLLM's rule (rank r holds head r // (tp/kv)).
``refit plan|verify --engine`` use these layouts: the plan's bytes are the real bytes, ``verify`` passes. SGLang's
regions fill the real rows of a padded share (stand-in modules with SGLang's attributes).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from refit.engines.sglang.regions import RegionError, share
from refit.errors import SpecError
from refit.layout import ModelLayout
from refit.layout.engines import ENGINES, check_engine_fits, engine_layout, engine_rules, engine_sizes, tp_split
from refit.layout.models import load_config, param_shapes
from refit.layout.spec import parse_spec
from refit.tools.cli import main

ODD = "tiny-llama-odd"  # vocab 1003, intermediate 136, 4 heads, 2 KV heads of 32, hidden 128, 2 layers
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
Q, K, O_PROJ = (f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "o_proj"))
GATE, DOWN = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"


def _layout(engine: str, dst: str, model: str = ODD):
    return engine_layout(param_shapes(model), parse_spec(dst, "dst"), load_config(model), engine)


def _dim(layout, name: str, dim: int, ranks: int) -> list[tuple[int, int]]:
    return [layout[name].box(r)[dim] for r in range(ranks)]


def test_the_odd_preset_has_every_oddity():
    cfg = load_config(ODD)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.num_key_value_heads) == (1003, 136, 2)
    assert cfg.vocab_size % 64 and cfg.intermediate_size % 64 and cfg.num_attention_heads % 4 == 0


@pytest.mark.parametrize("vocab", [1003, 1024, 1000, 64, 151936, 129280, 50257])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_vocab_split_is_vllms(vocab, tp):
    emb = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
    padded = emb.pad_vocab_size(vocab)
    if padded % tp:
        pytest.skip("vLLM refuses this tp")
    sizes = engine_sizes(engine_rules("vllm"), SimpleNamespace(), tp, vocab)
    split = tp_split(EMBED, 0, vocab, sizes)
    for r in range(tp):
        idx = emb.VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, r, tp)
        assert split(r) == (idx.org_vocab_start_index, idx.org_vocab_end_index)


def test_vllm_tp2_pads_the_vocab_and_nothing_else():
    lay = _layout("vllm", "tp=2")
    for name in (EMBED, LM_HEAD):
        assert _dim(lay, name, 0, 2) == [(0, 512), (512, 1003)]  # 1024 split in two, not torch.chunk's 502 + 501
    assert _dim(lay, GATE, 0, 2) == [(0, 68), (68, 136)] and _dim(lay, DOWN, 1, 2) == [(0, 68), (68, 136)]
    assert _dim(lay, K, 0, 2) == [(0, 32), (32, 64)]
    assert lay[GATE].boxes is None  # torch.chunk's split is the engine's: kept in mesh form


def test_vllm_tp4_replicates_each_kv_head_on_two_ranks():
    lay = _layout("vllm", "tp=4")
    assert _dim(lay, K, 0, 4) == [(0, 32), (0, 32), (32, 64), (32, 64)]  # head r // (tp / kv)
    assert _dim(lay, Q, 0, 4) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert _dim(lay, EMBED, 0, 4) == [(0, 256), (256, 512), (512, 768), (768, 1003)]
    assert sorted(lay[K].holders().values()) == [[0, 1], [2, 3]]
    assert ModelLayout.from_json(json.loads(json.dumps(lay.to_json()))) == lay  # explicit boxes travel in JSON
    two = _layout("vllm", "tp=4,dp=2")  # each replica the same
    assert [two[K].box(r)[0] for r in range(8)] == _dim(lay, K, 0, 4) * 2


def test_sglang_cpu_tp2_pads_the_intermediate_size_as_measured():
    lay = _layout("sglang-cpu", "tp=2")
    assert _dim(lay, GATE, 0, 2) == [(0, 96), (96, 136)]  # 136 -> 192: rank 1 holds 40 real rows, 56 of padding
    assert _dim(lay, DOWN, 1, 2) == [(0, 96), (96, 136)]
    assert _dim(lay, EMBED, 0, 2) == [(0, 512), (512, 1003)]
    assert _layout("sglang", "tp=2")[GATE].boxes is None  # SGLang pads only on CPU


def test_sglang_cpu_pads_heads_instead_of_replicating():
    lay = _layout("sglang-cpu", "tp=4")  # 2 KV heads -> 4, 4 query heads -> 8: ranks 2, 3 hold only padding
    assert _dim(lay, K, 0, 4) == [(0, 32), (32, 64), (64, 64), (64, 64)]
    assert _dim(lay, Q, 0, 4) == [(0, 64), (64, 128), (128, 128), (128, 128)]
    assert _dim(lay, O_PROJ, 1, 4) == [(0, 64), (64, 128), (128, 128), (128, 128)]
    assert _dim(lay, GATE, 0, 4) == [(0, 64), (64, 128), (128, 136), (136, 136)]  # 136 -> 256


def test_sglang_pads_the_vocab_further_where_tp_does_not_divide_it(tmp_path):
    cfg = load_config("tiny-llama")
    cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size = 1003, 6, 6, 192
    cfg.intermediate_size = 192
    cfg.save_pretrained(tmp_path)
    spec, shapes = parse_spec("tp=3", "dst"), param_shapes(str(tmp_path))
    with pytest.raises(SpecError, match=r"tp=3 must divide the vocabulary padded to a multiple of 64 \(1003 -> 1024"):
        check_engine_fits(shapes, spec, cfg, "vllm")
    check_engine_fits(shapes, spec, cfg, "sglang")  # 64 x 3: 1152
    lay = engine_layout(shapes, spec, cfg, "sglang")
    assert _dim(lay, EMBED, 0, 3) == [(0, 384), (384, 768), (768, 1003)]


@pytest.mark.parametrize(
    "engine,dst,match",
    [
        ("vllm", "tp=8", r"tp=8 must divide num_attention_heads=4 \(a rank holds whole heads\) on engine vllm"),
        ("vllm", "tp=3", "tp=3 must divide num_attention_heads=4"),
        ("sglang", "tp=8", "tp=8 must divide num_attention_heads=4"),
    ],
)
def test_engine_refusals_name_the_engine_and_numbers(engine, dst, match):
    with pytest.raises(SpecError, match=match):
        check_engine_fits(param_shapes(ODD), parse_spec(dst, "dst"), load_config(ODD), engine)


def test_vllm_refuses_an_intermediate_size_tp_does_not_divide(tmp_path):
    cfg = load_config(ODD)
    cfg.intermediate_size = 130
    cfg.save_pretrained(tmp_path)
    shapes, spec = param_shapes(str(tmp_path)), parse_spec("tp=4", "dst")
    with pytest.raises(SpecError, match=r"tp=4 must divide dim 0 of model.layers.0.mlp.gate_proj.weight \[130, 128\]"):
        check_engine_fits(shapes, spec, cfg, "vllm")
    check_engine_fits(shapes, spec, cfg, "sglang-cpu")  # pads it to 256


def _real_bytes(engine: str, tp: int) -> int:
    """Bytes the ranks of one replica of engine ``engine`` at ``tp`` need together, counted from the config by hand
    (real rows only; vLLM's replicated KV heads once per rank holding them)."""
    cfg = load_config(ODD)
    hidden, head, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    kv_copies = max(tp // cfg.num_key_value_heads, 1) if engine == "vllm" else 1
    attn = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads * kv_copies) * head * hidden
    norms = (2 * layers + 1) * hidden * tp  # replicated: every rank needs them
    return 4 * (layers * (attn + 3 * cfg.intermediate_size * hidden) + 2 * cfg.vocab_size * hidden + norms)


@pytest.mark.parametrize("engine,dst", [("vllm", "tp=2"), ("vllm", "tp=4"), ("sglang-cpu", "tp=2")])
def test_plan_counts_real_bytes(capsys, engine, dst):
    assert main(["plan", "--model", ODD, "--src", "tp=2", "--dst", dst, "--engine", engine, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tp = int(dst.split("=")[1])
    assert out["engine"] == engine
    assert out["bytes_needed"] == out["bytes_moved"] == _real_bytes(engine, tp)
    dst_layout = out["dst_layout"]
    k = next(t for t in dst_layout["tensors"] if t["name"] == K)
    if engine == "vllm" and tp == 4:
        assert k["boxes"]["1"] == k["boxes"]["0"] == [[0, 32], [0, 128]]


def test_verify_dst_tp4_of_two_kv_heads_passes(capsys):
    # spec layouts used to refuse it ("spec layouts split KV heads, they cannot replicate them")
    assert main(["verify", "--model", ODD, "--src", "tp=2", "--dst", "tp=4"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verified 21 tensors on 4 ranks") and "moved/needed=1.00" in last, last
    assert f"{_real_bytes('vllm', 4)} bytes" in last


@pytest.mark.parametrize("value", ["tgi", "", "VLLM"])
def test_a_bad_engine_is_one_line_and_exit_2(capsys, value):
    assert main(["plan", "--model", ODD, "--engine", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--engine: unknown engine {value!r}; known: {', '.join(ENGINES)}" in err[0], err


# ----------------------------------------------------------------- SGLang's regions of a padded share


def _group(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(rank_in_group=rank, world_size=size)


def _mlp_model(rank: int, tp: int, padded: int, hidden: int, device: str) -> torch.nn.Module:
    """One SGLang-like MLP as SGLang on CPU allocates it for an intermediate size padded to ``padded``."""
    per = padded // tp
    gate_up = torch.nn.Module()
    gate_up.tp_group, gate_up.output_sizes = _group(rank, tp), [padded, padded]
    gate_up.weight = torch.nn.Parameter(torch.zeros(2 * per, hidden, device=device), requires_grad=False)
    down = torch.nn.Module()
    down.tp_group, down.input_size_per_partition = _group(rank, tp), per
    down.weight = torch.nn.Parameter(torch.zeros(hidden, per, device=device), requires_grad=False)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.gate_up_proj, layer.mlp.down_proj = gate_up, down
    model.model.layers = torch.nn.ModuleList([layer])
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_sglang_regions_fill_the_real_rows_of_a_padded_share(rank):
    hidden, real = 8, 136
    model = _mlp_model(rank, 2, 192, hidden, "cpu")
    live = model.model.layers[0].mlp
    want = [(0, 96), (96, 136)][rank]
    gate = share(model, GATE, (real, hidden))
    up = share(model, "model.layers.0.mlp.up_proj.weight", (real, hidden))
    down = share(model, DOWN, (hidden, real))
    assert gate.box[0] == up.box[0] == down.box[1] == want
    n = want[1] - want[0]
    base, row = live.gate_up_proj.weight.data_ptr(), hidden * 4
    assert (gate.view.data_ptr() - base) // row == 0 and gate.view.shape == (n, hidden)
    assert (up.view.data_ptr() - base) // row == 96 and up.view.shape == (n, hidden)  # up starts after 96 gate rows
    assert down.view.shape == (hidden, n) and down.view.data_ptr() == live.down_proj.weight.data_ptr()
    assert down.view.is_contiguous() == (n == 96)  # 40 of 96 columns: strided, the loader receives densely
    # the box matches the library's SGLang-CPU layout
    lay = engine_layout(param_shapes(ODD), parse_spec("tp=2", "dst"), load_config(ODD), "sglang-cpu")
    assert lay[GATE].box(rank)[0] == gate.box[0] and lay[DOWN].box(rank)[1] == down.box[1]


def test_sglang_regions_refuse_a_share_beyond_the_tensor_off_cpu():
    model = _mlp_model(1, 2, 192, 8, "meta")  # SGLang pads (and zeroes the padding) only on CPU
    with pytest.raises(RegionError, match=r"gate_proj.weight \[136, 8\]: SGLang's .* rows wants \[96, 192\)"):
        share(model, GATE, (136, 8))
    with pytest.raises(RegionError, match=r"RowParallelLinear columns wants \[96, 192\)"):
        share(model, DOWN, (8, 136))


def test_padding_is_never_counted():
    lay = _layout("sglang-cpu", "tp=2")
    per_rank = [sum(math.prod(b1 - b0 for b0, b1 in t.box(r)) for t in lay) for r in range(2)]
    cfg = load_config(ODD)
    total = sum(math.prod(s) for _, s, _ in param_shapes(ODD))
    replicated = 2 * cfg.num_hidden_layers * cfg.hidden_size + cfg.hidden_size  # the norms, on both ranks
    assert sum(per_rank) == total + replicated


def _moe_model(rank: int, experts: int, padded: int, hidden: int) -> torch.nn.Module:
    """One SGLang-like ``FusedMoE`` (TP=2, no EP) as SGLang on CPU allocates it for a padded expert size."""
    per = padded // 2
    moe = torch.nn.Module()
    moe.num_local_experts, moe.intermediate_size_per_partition = experts, per
    moe.moe_ep_rank, moe.moe_tp_rank, moe.moe_tp_size, moe.num_fused_shared_experts = 0, rank, 2, 0
    moe.w13_weight = torch.nn.Parameter(torch.zeros(experts, 2 * per, hidden), requires_grad=False)
    moe.w2_weight = torch.nn.Parameter(torch.zeros(experts, hidden, per), requires_grad=False)
    layer = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    layer.mlp.experts = moe
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_sglang_cpu_padded_expert_shares_match_the_layout(tmp_path, rank):
    cfg = load_config("tiny-qwen3-moe")
    cfg.moe_intermediate_size = 48  # SGLang on CPU at tp=2: 64, rank 1 holds rows 32-47 then 16 of padding
    cfg.save_pretrained(tmp_path)
    lay = engine_layout(param_shapes(str(tmp_path)), parse_spec("tp=2", "dst"), cfg, "sglang-cpu")
    e, hidden = cfg.num_experts, cfg.hidden_size
    model = _moe_model(rank, e, 64, hidden)
    gate_up = share(model, "model.layers.0.mlp.experts.gate_up_proj", (e, 2, 48, hidden))
    down = share(model, "model.layers.0.mlp.experts.down_proj", (e, hidden, 48))
    want = [(0, 32), (32, 48)][rank]
    assert gate_up.box[2] == down.box[2] == want
    assert lay["model.layers.0.mlp.experts.gate_up_proj"].box(rank)[2] == want
    assert lay["model.layers.0.mlp.experts.down_proj"].box(rank)[2] == want
    n = want[1] - want[0]
    assert gate_up.view.shape == (e, 2, n, hidden) and down.view.shape == (e, hidden, n)
    # the up rows start after this rank's 32 (padded) gate rows, whatever the real count
    gate_up.view[0, 1, 0, 0] = 1.0
    assert model.model.layers[0].mlp.experts.w13_weight[0, 32, 0] == 1.0
