"""Real Megatron-Core GPT models on CPU gloo (refit.tools.megatron_cpu): every layout gives the single-process
logits of the same seed, and training steps lower the loss in place, equal across layouts.

One spawn of 4 processes runs every layout in turn (Megatron's import costs seconds per process); the tests below
read its results.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from refit.layout.models import PRESETS  # noqa: E402
from refit.tools.launch import run_local  # noqa: E402

pytestmark = pytest.mark.multiproc

WORLD = 4
TOL = 1e-5
TOKENS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(7))
DIVISIBLE_BY = 48  # vocabulary 512 pads to 528 at tp=1, 576 at tp=2 and tp=4: padding differs by layout

# (preset, tp, pp, ep, etp); the first of each preset is the single-process reference
FORWARD = [
    ("tiny-llama", 1, 1, 1, None),
    ("tiny-llama", 2, 1, 1, None),
    ("tiny-llama", 1, 2, 1, None),
    ("tiny-llama", 2, 2, 1, None),
    ("tiny-llama", 4, 1, 1, None),  # 2 kv heads < tp: Megatron gathers q/k/v over TP
    ("tiny-qwen2", 1, 1, 1, None),
    ("tiny-qwen2", 2, 2, 1, None),  # q/k/v biases
    ("tiny-qwen3", 1, 1, 1, None),
    ("tiny-qwen3", 2, 1, 1, None),  # q/k norms
    ("tiny-qwen3-moe", 1, 1, 1, None),
    ("tiny-qwen3-moe", 1, 1, 2, 1),
    ("tiny-qwen3-moe", 2, 1, 2, 1),
    ("tiny-qwen3-moe", 2, 2, 2, 1),
    ("tiny-mixtral", 1, 1, 1, None),
    ("tiny-mixtral", 2, 1, 2, 1),
]
TIED = {**PRESETS["tiny-llama"].config, "tie_word_embeddings": True}
TRAIN = [  # (name, hf config, model type, tp, pp, ep, etp)
    ("tied-llama", TIED, "llama", 1, 1, 1, None),
    ("tied-llama", TIED, "llama", 2, 2, 1, None),
    ("tiny-qwen3-moe", PRESETS["tiny-qwen3-moe"].config, "qwen3_moe", 1, 1, 1, None),
    ("tiny-qwen3-moe", PRESETS["tiny-qwen3-moe"].config, "qwen3_moe", 2, 1, 2, 1),
    ("tiny-qwen3-moe", PRESETS["tiny-qwen3-moe"].config, "qwen3_moe", 2, 1, 1, 2),  # experts cut over TP
]
STEPS = 4
LR = 0.02  # the loss falls at every step (0.05 overshoots at the 4th)


HF_CHECKS = [(p, PRESETS[p].config, PRESETS[p].model_type) for p in dict.fromkeys(lay[0] for lay in FORWARD)] + [
    ("qwen3-moe-unnormalised", {**PRESETS["tiny-qwen3-moe"].config, "norm_topk_prob": False}, "qwen3_moe"),
    ("tied-llama", {**PRESETS["tiny-llama"].config, "tie_word_embeddings": True}, "llama"),
]


def _to_hf(model, hf_config) -> dict:
    """A single-process (tp=pp=ep=1) Megatron model's weights under HF names, from Megatron's layout: linear_qkv
    is ``[q heads; k; v]`` per query group, linear_fc1 ``[gate; up]``, the embedding padded past the HF vocab; HF
    stacks experts as ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``. A test oracle, not refit's rules."""
    sd = {n: p.detach() for n, p in model.named_parameters()}
    c, v = hf_config, hf_config.vocab_size
    heads, groups = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:v]}
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = sd.get("output_layer.weight", sd["embedding.word_embeddings.weight"])[:v]
    rename = {
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "mlp.router.weight": "mlp.gate.weight",
    }
    for i in range(c.num_hidden_layers):
        mp, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        for m, h in rename.items():
            if mp + m in sd:
                out[hp + h] = sd[mp + m]
        for suffix in ("weight", "bias"):
            if mp + "self_attention.linear_qkv." + suffix in sd:
                t = sd[mp + "self_attention.linear_qkv." + suffix].reshape(groups, (heads // groups + 2) * hd, -1)
                q, k, val = torch.split(t, [heads // groups * hd, hd, hd], dim=1)
                for name, x in (("q", q), ("k", k), ("v", val)):
                    out[f"{hp}self_attn.{name}_proj.{suffix}"] = x.reshape(-1, t.shape[-1]).squeeze(-1)
        if mp + "mlp.linear_fc1.weight" in sd:
            out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = sd[mp + "mlp.linear_fc1.weight"].chunk(2)
        experts = sorted(n for n in sd if n.startswith(mp + "mlp.experts.") and n.endswith("linear_fc1.weight"))
        if experts:
            fc = [f"{mp}mlp.experts.local_experts.{e}.linear_fc" for e in range(len(experts))]
            out[hp + "mlp.experts.gate_up_proj"] = torch.stack([sd[f + "1.weight"] for f in fc])
            out[hp + "mlp.experts.down_proj"] = torch.stack([sd[f + "2.weight"] for f in fc])
    return out


def _hf_error(mc, name, config, model_type) -> float:
    """Max |Megatron - HF| logits for one config, HF loading the Megatron model's weights (strict)."""
    from transformers import AutoConfig

    from refit.layout.models import build_model

    model = mc.build_gpt(config, model_type, seed=0, make_vocab_size_divisible_by=DIVISIBLE_BY)
    hf_config = AutoConfig.for_model(model_type, **config)
    hf = build_model(hf_config, torch.float32)
    hf.load_state_dict(_to_hf(model, hf_config), strict=True)
    with torch.no_grad():
        return (mc.forward_logits(model, TOKENS) - hf(TOKENS).logits).abs().max().item()


def _forward_all(mc, rank: int) -> dict:
    out = {}
    for preset, tp, pp, ep, etp in FORWARD:
        mc.init_parallel(tp, pp, ep, etp)
        p = PRESETS[preset]
        model = mc.build_gpt(p.config, p.model_type, seed=0, make_vocab_size_divisible_by=DIVISIBLE_BY)
        out[(preset, tp, pp, ep, etp)] = (mc.forward_logits(model, TOKENS), model.vocab_size)
    mc.init_parallel(1, 1)  # from here on, no collective: every process is a whole model
    p = PRESETS["tiny-llama"]
    out["seed=1"] = mc.forward_logits(mc.build_gpt(p.config, p.model_type, seed=1), TOKENS)
    if rank == 0:
        out["hf"] = {name: _hf_error(mc, name, cfg, kind) for name, cfg, kind in HF_CHECKS}
    return out


def _train(mc, config, model_type, tp, pp, ep, etp) -> dict:
    from megatron.core import parallel_state as ps

    mc.init_parallel(tp, pp, ep, etp)
    model = mc.build_gpt(config, model_type, seed=0)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    losses = mc.train_steps(model, TOKENS, steps=STEPS, lr=LR)
    after = dict(model.named_parameters())
    tied = None
    if model.share_embeddings_and_output_weights and ps.is_rank_in_embedding_group():
        tied = model.shared_embedding_or_output_weight().detach().clone()
    return dict(
        losses=losses,
        same_storage=all(after[n].data_ptr() == ptr for n, (ptr, _) in before.items()),
        # an expert no token was routed to has no gradient and keeps its weights
        unchanged={mc.global_param_name(model, n) for n, (_, t) in before.items() if torch.equal(after[n].detach(), t)},
        tied=tied,
        stage=ps.get_pipeline_model_parallel_rank(),
    )


def _worker(world):
    import refit.tools.megatron_cpu as mc

    mc.patch_for_cpu()
    mc.patch_for_cpu()  # idempotent
    try:
        mc.init_parallel(3, 1)
        bad = None
    except ValueError as e:
        bad = str(e)
    forward = _forward_all(mc, world.rank)
    train = {(name, *lay): _train(mc, cfg, kind, *lay) for name, cfg, kind, *lay in TRAIN}
    return forward, train, bad


@pytest.fixture(scope="module")
def results():
    return run_local(_worker, WORLD, 0, backend="gloo", timeout_s=700)


def _reference(preset: str, out: dict) -> torch.Tensor:
    return next(v[0] for k, v in out.items() if k[0] == preset)


@pytest.mark.timeout(800)  # the first pays for the module's spawned job, slower beside another xdist worker
@pytest.mark.parametrize("layout", FORWARD[1:], ids=lambda lay: "{}-tp{}-pp{}-ep{}-etp{}".format(*lay))
def test_every_layout_gives_the_single_process_logits(results, layout):
    for rank, (forward, *_) in enumerate(results):
        logits, padded = forward[layout]
        ref = _reference(layout[0], forward)
        assert logits.shape == (2, 12, 512), (rank, logits.shape)
        assert padded % (DIVISIBLE_BY * layout[1]) == 0 and padded >= 512
        err = (logits - ref).abs().max().item()
        assert err < TOL, f"rank {rank}: {layout} differs from the single-process logits by {err}"


def test_megatron_logits_equal_hf_logits_for_every_model_type(results):
    errors = results[0][0]["hf"]
    assert sorted(errors) == sorted(name for name, *_ in HF_CHECKS)
    assert all(e < TOL for e in errors.values()), errors


def test_padding_differs_between_layouts_and_the_seed_matters(results):
    forward = results[0][0]
    assert forward[("tiny-llama", 1, 1, 1, None)][1] == 528
    assert forward[("tiny-llama", 2, 1, 1, None)][1] == 576
    assert forward[("tiny-llama", 4, 1, 1, None)][1] == 576
    ref = _reference("tiny-llama", forward)
    assert ref.std() > 0.05  # logits are not flat
    assert (forward["seed=1"] - ref).abs().max() > 100 * TOL


@pytest.mark.timeout(800)  # the first pays for the module's spawned job, slower beside another xdist worker
@pytest.mark.parametrize("name", ["tied-llama", "tiny-qwen3-moe"])
def test_training_lowers_the_loss_in_place_equally_in_every_layout(results, name):
    runs = {k: [r[1][k] for r in results] for k in results[0][1] if k[0] == name}
    (single, *layouts) = runs
    ref = runs[single][0]["losses"]
    assert len(ref) == STEPS and all(b < a - 0.1 for a, b in zip(ref, ref[1:])), ref
    for lay in runs:
        for rank, r in enumerate(runs[lay]):
            assert r["same_storage"], (lay, rank)
            assert all(".mlp.experts." in n for n in r["unchanged"]), (lay, rank, r["unchanged"])
            assert max(abs(a - b) for a, b in zip(r["losses"], ref)) < TOL, (lay, rank, r["losses"], ref)
        # the same experts idle in every layout: the global names of the single-process run's idle ones
        idle = set.union(*(r["unchanged"] for r in runs[lay]))
        assert idle == runs[single][0]["unchanged"], lay
        assert len(idle) <= 4, idle  # most experts got tokens


def test_tied_weights_stay_equal_across_pipeline_stages(results):
    runs = [r[1][("tied-llama", 2, 2, 1, None)] for r in results]
    first = [r["tied"] for r in runs if r["stage"] == 0]
    last = [r["tied"] for r in runs if r["stage"] == 1]
    assert len(first) == len(last) == 2  # tp=2 ranks on each end
    for a, b in zip(first, last):
        assert torch.equal(a, b)


def test_megatron_accepts_fewer_kv_heads_than_tp_only_when_tp_is_a_multiple():
    from refit.tools.megatron_cpu import transformer_config

    cfg = PRESETS["tiny-llama"].config  # 4 heads, 2 kv heads
    assert transformer_config(cfg, "llama", tp=4).num_query_groups == 2
    odd = {**cfg, "hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3}
    with pytest.raises(ValueError, match=r"num_query_groups \(3\) must be a multiple or divisor of"):
        transformer_config(odd, "llama", tp=2)


def test_init_parallel_names_the_degrees_that_do_not_fit(results):
    assert results[0][2] == "world size 4 is not divisible by tp=3 x pp=1 = 3"
    from refit.tools.megatron_cpu import init_parallel

    with pytest.raises(ValueError, match="init_process_group"):
        init_parallel(2, 1)
