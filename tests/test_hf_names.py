"""refit.layout.hf_names on real checkpoint names: the presets' meta models, and HF checkpoint names
transformers >= 5 no longer produces (per-expert tensors, Mixtral's block_sparse_moe)."""

from functools import cache

import pytest

from refit.layout.hf_names import (
    COLUMN_PARALLEL,
    LINEAR,
    ROW_PARALLEL,
    STACKED_EXPERTS,
    Role,
    expert_of,
    fused_target,
    layer_of,
    logical_shape,
    module_aliases,
    num_layers,
    param_role,
)
from refit.layout.models import PRESETS, ModelError, load_config, param_shapes

R = Role


@cache
def names(preset: str) -> frozenset[str]:
    return frozenset(n for n, _, _ in param_shapes(preset))


# (preset, name, role, decoder layer): real names of the presets' models
PRESET_NAMES = [
    # Llama
    ("tiny-llama", "model.embed_tokens.weight", R.EMBED, None),
    ("tiny-llama", "lm_head.weight", R.LM_HEAD, None),
    ("tiny-llama", "model.norm.weight", R.FINAL_NORM, None),
    ("tiny-llama", "model.layers.0.input_layernorm.weight", R.NORM, 0),
    ("tiny-llama", "model.layers.3.post_attention_layernorm.weight", R.NORM, 3),
    ("tiny-llama", "model.layers.1.self_attn.q_proj.weight", R.Q_PROJ, 1),
    ("tiny-llama", "model.layers.1.self_attn.k_proj.weight", R.K_PROJ, 1),
    ("tiny-llama", "model.layers.1.self_attn.v_proj.weight", R.V_PROJ, 1),
    ("tiny-llama", "model.layers.1.self_attn.o_proj.weight", R.O_PROJ, 1),
    ("tiny-llama", "model.layers.2.mlp.gate_proj.weight", R.GATE_PROJ, 2),
    ("tiny-llama", "model.layers.2.mlp.up_proj.weight", R.UP_PROJ, 2),
    ("tiny-llama", "model.layers.2.mlp.down_proj.weight", R.DOWN_PROJ, 2),
    # Qwen2: q/k/v biases
    ("tiny-qwen2", "model.layers.0.self_attn.q_proj.bias", R.Q_PROJ, 0),
    ("tiny-qwen2", "model.layers.0.self_attn.v_proj.bias", R.V_PROJ, 0),
    # Qwen3: per-head norms
    ("tiny-qwen3", "model.layers.2.self_attn.q_norm.weight", R.Q_NORM, 2),
    ("tiny-qwen3", "model.layers.2.self_attn.k_norm.weight", R.K_NORM, 2),
    # Qwen3-MoE: stacked experts and the router
    ("tiny-qwen3-moe", "model.layers.1.mlp.experts.gate_up_proj", R.EXPERTS_GATE_UP, 1),
    ("tiny-qwen3-moe", "model.layers.1.mlp.experts.down_proj", R.EXPERTS_DOWN, 1),
    ("tiny-qwen3-moe", "model.layers.1.mlp.gate.weight", R.ROUTER, 1),
    # Qwen2-MoE: one shared expert (a dense MLP) and its sigmoid gate
    ("tiny-qwen2-moe", "model.layers.0.mlp.shared_expert.gate_proj.weight", R.GATE_PROJ, 0),
    ("tiny-qwen2-moe", "model.layers.0.mlp.shared_expert.up_proj.weight", R.UP_PROJ, 0),
    ("tiny-qwen2-moe", "model.layers.0.mlp.shared_expert.down_proj.weight", R.DOWN_PROJ, 0),
    ("tiny-qwen2-moe", "model.layers.0.mlp.shared_expert_gate.weight", R.SHARED_EXPERT_GATE, 0),
    ("tiny-qwen2-moe", "model.layers.3.mlp.experts.gate_up_proj", R.EXPERTS_GATE_UP, 3),
    # Mixtral (transformers >= 5 calls its block_sparse_moe "mlp")
    ("tiny-mixtral", "model.layers.2.mlp.gate.weight", R.ROUTER, 2),
    ("tiny-mixtral", "model.layers.2.mlp.experts.down_proj", R.EXPERTS_DOWN, 2),
    # DeepSeek-V3: MLA, three dense layers, then routed and shared experts
    ("deepseek-v3", "model.layers.0.self_attn.q_a_proj.weight", R.Q_A_PROJ, 0),
    ("deepseek-v3", "model.layers.0.self_attn.q_a_layernorm.weight", R.NORM, 0),
    ("deepseek-v3", "model.layers.0.self_attn.q_b_proj.weight", R.Q_B_PROJ, 0),
    ("deepseek-v3", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", R.KV_A_PROJ, 0),
    ("deepseek-v3", "model.layers.0.self_attn.kv_a_layernorm.weight", R.NORM, 0),
    ("deepseek-v3", "model.layers.0.self_attn.kv_b_proj.weight", R.KV_B_PROJ, 0),
    ("deepseek-v3", "model.layers.60.self_attn.o_proj.weight", R.O_PROJ, 60),
    ("deepseek-v3", "model.layers.2.mlp.gate_proj.weight", R.GATE_PROJ, 2),
    ("deepseek-v3", "model.layers.3.mlp.gate.weight", R.ROUTER, 3),
    ("deepseek-v3", "model.layers.3.mlp.experts.gate_up_proj", R.EXPERTS_GATE_UP, 3),
    ("deepseek-v3", "model.layers.3.mlp.shared_experts.up_proj.weight", R.UP_PROJ, 3),
    ("deepseek-v3", "model.layers.3.mlp.shared_experts.down_proj.weight", R.DOWN_PROJ, 3),
    ("deepseek-v3", "model.norm.weight", R.FINAL_NORM, None),
    ("deepseek-v3", "lm_head.weight", R.LM_HEAD, None),
]


@pytest.mark.parametrize("preset,name,role,layer", PRESET_NAMES, ids=lambda v: v if isinstance(v, str) else "")
def test_preset_names(preset, name, role, layer):
    assert name in names(preset)  # a real name of that model
    assert param_role(name) is role
    assert layer_of(name) == layer
    assert expert_of(name) is None


# HF checkpoint names of one expert each (transformers < 5, and the safetensors files), DeepSeek's router
# bias (a buffer in transformers, a tensor in the checkpoint), and names no rule knows:
# (name, role, decoder layer, expert)
CHECKPOINT_NAMES = [
    ("model.layers.0.block_sparse_moe.gate.weight", R.ROUTER, 0, None),
    ("model.layers.1.block_sparse_moe.experts.3.w1.weight", R.EXPERT_GATE, 1, 3),
    ("model.layers.1.block_sparse_moe.experts.3.w3.weight", R.EXPERT_UP, 1, 3),
    ("model.layers.1.block_sparse_moe.experts.3.w2.weight", R.EXPERT_DOWN, 1, 3),
    ("model.layers.5.mlp.experts.17.gate_proj.weight", R.EXPERT_GATE, 5, 17),
    ("model.layers.5.mlp.experts.17.up_proj.weight", R.EXPERT_UP, 5, 17),
    ("model.layers.5.mlp.experts.17.down_proj.weight", R.EXPERT_DOWN, 5, 17),
    ("model.layers.3.mlp.gate.e_score_correction_bias", R.ROUTER, 3, None),
    ("model.layers.1.self_attn.o_proj.bias", R.O_PROJ, 1, None),
    ("model.layers.1.self_attn.q_proj.weight_scale_inv", R.Q_PROJ, 1, None),
    ("model.layers.1.mlp.gate_up_proj.weight", R.PROJ, 1, None),  # an engine's fused name
    ("model.layers.1.self_attn.rotary_emb.inv_freq", R.OTHER, 1, None),
    ("norm.weight", R.FINAL_NORM, None, None),
    ("weight", R.OTHER, None, None),
]


@pytest.mark.parametrize("name,role,layer,expert", CHECKPOINT_NAMES, ids=lambda v: v if isinstance(v, str) else "")
def test_checkpoint_names(name, role, layer, expert):
    assert param_role(name) is role
    assert layer_of(name) == layer
    assert expert_of(name) == expert


# (name, the fused engine parameter it loads into, shard): vLLM's and SGLang's stacked_params_mapping
# and FusedMoE expert mapping
FUSED = [
    ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.qkv_proj.weight", "q"),
    ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight", "k"),
    ("model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.qkv_proj.weight", "v"),
    ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.qkv_proj.bias", "q"),
    ("model.layers.2.mlp.gate_proj.weight", "model.layers.2.mlp.gate_up_proj.weight", 0),
    ("model.layers.2.mlp.up_proj.weight", "model.layers.2.mlp.gate_up_proj.weight", 1),
    ("model.layers.0.mlp.shared_expert.gate_proj.weight", "model.layers.0.mlp.shared_expert.gate_up_proj.weight", 0),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", "model.layers.3.mlp.shared_experts.gate_up_proj.weight", 1),
    ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.w13_weight", None),
    ("model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.w2_weight", None),
    ("model.layers.5.mlp.experts.17.gate_proj.weight", "model.layers.5.mlp.experts.w13_weight", "w1"),
    ("model.layers.5.mlp.experts.17.up_proj.weight", "model.layers.5.mlp.experts.w13_weight", "w3"),
    ("model.layers.5.mlp.experts.17.down_proj.weight", "model.layers.5.mlp.experts.w2_weight", "w2"),
    ("model.layers.1.block_sparse_moe.experts.3.w1.weight", "model.layers.1.block_sparse_moe.experts.w13_weight", "w1"),
    ("model.layers.1.block_sparse_moe.experts.3.w2.weight", "model.layers.1.block_sparse_moe.experts.w2_weight", "w2"),
    ("model.layers.1.self_attn.q_proj.weight_scale_inv", "model.layers.1.self_attn.qkv_proj.weight_scale_inv", "q"),
]
# kept as they are (no fused group): row-parallel, MLA (vLLM's fused_qkv_a_proj is not mapped), routers...
UNFUSED = [
    "model.layers.1.self_attn.o_proj.weight",
    "model.layers.2.mlp.down_proj.weight",
    "model.layers.3.mlp.shared_experts.down_proj.weight",
    "model.layers.0.self_attn.q_a_proj.weight",
    "model.layers.0.self_attn.q_b_proj.weight",
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.3.mlp.gate.weight",
    "model.layers.0.mlp.shared_expert_gate.weight",
    "model.layers.0.input_layernorm.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.1.self_attn.qkv_proj.weight",
]


@pytest.mark.parametrize("name,param,shard", FUSED, ids=lambda v: v if isinstance(v, str) else "")
def test_fused_target(name, param, shard):
    t = fused_target(name)
    assert t is not None and (t.name, t.shard) == (param, shard)
    assert t.name == f"{t.module}.{t.param}"


@pytest.mark.parametrize("name", UNFUSED)
def test_no_fused_target(name):
    assert fused_target(name) is None


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_name_has_a_known_role_and_layer_count(preset):
    ns = names(preset)
    assert not [n for n in ns if param_role(n) in (Role.OTHER, Role.PROJ)]
    assert num_layers(ns) == load_config(preset).num_hidden_layers
    # one input norm per layer, each in the layer it names
    norms = [n for n in ns if n.endswith("input_layernorm.weight")]
    assert sorted(layer_of(n) for n in norms) == list(range(num_layers(ns)))
    # one lm_head, one embedding, one final norm, outside the layers
    for role in (Role.LM_HEAD, Role.EMBED, Role.FINAL_NORM):
        found = [n for n in ns if param_role(n) is role]
        assert len(found) == 1 and layer_of(found[0]) is None


def test_moe_presets_stack_experts_in_every_moe_layer():
    ns = names("deepseek-v3")  # first_k_dense_replace=3: layers 0-2 dense, 3-60 MoE
    moe_layers = {layer_of(n) for n in ns if param_role(n) in STACKED_EXPERTS}
    assert moe_layers == set(range(3, 61))
    assert {layer_of(n) for n in ns if param_role(n) is Role.ROUTER} == moe_layers
    assert all(expert_of(n) is None for n in ns)  # stacked: no per-expert names


def test_role_groups():
    assert not COLUMN_PARALLEL & ROW_PARALLEL
    assert COLUMN_PARALLEL | ROW_PARALLEL | STACKED_EXPERTS <= LINEAR
    assert not {Role.EMBED, Role.LM_HEAD, Role.ROUTER, Role.NORM, Role.FINAL_NORM} & LINEAR
    # MLA's low-rank projections are linear but replicated over TP
    assert {Role.Q_A_PROJ, Role.KV_A_PROJ} <= LINEAR - COLUMN_PARALLEL - ROW_PARALLEL


def test_num_layers_counts_the_largest_index():
    assert num_layers([]) == 0
    assert num_layers(["lm_head.weight", "model.norm.weight"]) == 0
    assert num_layers(["model.layers.0.mlp.up_proj.weight", "model.layers.11.input_layernorm.weight"]) == 12
    assert layer_of("model.layers.7") is None  # a module, not a parameter in it
    assert layer_of("model.language_model.layers.4.mlp.up_proj.weight") == 4


def test_logical_shape_splits_fused_gate_up():
    assert logical_shape("model.layers.0.mlp.experts.gate_up_proj", (8, 128, 64)) == (8, 2, 64, 64)
    assert logical_shape("model.layers.0.mlp.experts.gate_up_proj", (8, 2, 64, 64)) == (8, 2, 64, 64)
    assert logical_shape("model.layers.0.mlp.experts.down_proj", (8, 64, 32)) == (8, 64, 32)
    assert logical_shape("model.layers.0.mlp.up_proj.weight", (64, 32)) == (64, 32)
    with pytest.raises(ModelError, match=r"experts.gate_up_proj \[8, 5, 64\]: the fused gate/up dim 5 is odd"):
        logical_shape("model.layers.0.mlp.experts.gate_up_proj", (8, 5, 64))


def test_module_aliases_name_mixtral_moe_block():
    assert module_aliases("model.layers.0.mlp.experts") == ["model.layers.0.block_sparse_moe.experts"]
    assert module_aliases("model.layers.0.self_attn.q_proj") == []
