"""Refit a real ``AsyncLLM`` (CPU) while it generates: trainer rank 0 and the engine's driver in this process
(one event loop), rank 1 forked (launch.start_process); both trainer ranks take a step, stage the new version and gather
the full weights (for the HF check) per version.

Versions: 1 before generation starts, then one per policy while requests stream: every request's tokens,
their logprobs, arrival times and ``TokenVersions`` are kept, with each ``CommitRecord``.
By hand: ``cd tests && python -m vllm_backend.overlap_harness``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from refit.layout.models import build_model, load_config
from refit.tools.launch import start_process
from refit.transport.control import free_port

from .harness import _train_step, _trainer_model, check_vllm_secure, engine_args

# a small Llama (about 11.5 M parameters, 46 MB in float32): big enough that staging takes several decode
# steps on this machine, small enough to start quickly
CONFIG = dict(
    model_type="llama",
    vocab_size=2048,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
POLICIES = ("drain", "abort", "in_place")
MAX_TOKENS = 40
STREAMS = 2  # requests in flight at once
BUFFER_BYTES = 256 << 10  # small buffers: staging takes many steps


def _trainer_info(rank, xfer_port, n_workers):
    from refit.engines.vllm.trainer import RefitTrainerInitInfo

    return RefitTrainerInitInfo(
        rank=rank,
        master_port=xfer_port,
        n_trainer=2,
        n_workers=n_workers,
        timeout_s=120,
        commit="staged",
        buffer_bytes=BUFFER_BYTES,
    )


def _trainer_setup(rank, port, xfer_port, config_dir, n_workers, client=None):
    from refit.engines.vllm.trainer import RefitTrainerEngine, ShardedModuleSource

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    model = _trainer_model(config_dir, "tp=2", rank)
    info = _trainer_info(rank, xfer_port, n_workers)
    engine = RefitTrainerEngine.trainer_init(info, client=client, source=ShardedModuleSource(model, 2))
    return model, engine


def _step(model, version, vocab):
    """One optimizer step with a large rate, so versions differ clearly in their logprobs."""
    _train_step(model, "tp=2", version, vocab)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator().manual_seed(1000 * version)  # replicated parameters stay equal on both ranks
            local.add_(0.02 * torch.randn(local.shape, generator=g))


def _rank1(port, xfer_port, config_dir, n_workers, versions):
    from refit.trainers.dtensor import full_state

    model, engine = _trainer_setup(1, port, xfer_port, config_dir, n_workers)
    vocab = load_config(config_dir).vocab_size
    try:
        for v in versions:
            _step(model, v, vocab)
            engine.stage_weights(v)
            full_state(model)
        engine.shutdown()
    finally:
        dist.destroy_process_group()


async def _stream(driver, results, stop, index, vocab):
    """Requests back to back until ``stop``: distinct random prompts (no prefix-cache sharing)."""
    from vllm import SamplingParams

    rng, k = random.Random(index), 0
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    while not stop.is_set():
        prompt = [rng.randrange(1, vocab) for _ in range(8)]
        rid = f"s{index}r{k}"
        k += 1
        out, versions, arrivals = await driver.generate({"prompt_token_ids": prompt}, params, rid)
        o = out.outputs[0]
        results.append(
            {
                "id": rid,
                "prompt": prompt,
                "tokens": list(o.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)],
                "finish": o.finish_reason,
                "versions": versions.per_token(),
                "aborted": versions.aborted,
                "arrivals": arrivals,
            }
        )


async def _warm_up(engine, vocab):
    """One request to the end: the engine's first passes do one-time work (seconds on this CPU) that must
    not be mistaken for a stall of the refit that follows."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate({"prompt_token_ids": list(range(1, 9))}, params, "warm-up"):
        pass


async def _run(workdir, engine_tp):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from refit.engines.vllm.extension import QUALNAME
    from refit.engines.vllm.overlap import AsyncLLMClient, OverlapDriver
    from refit.trainers.dtensor import full_state

    loop = asyncio.get_running_loop()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(workdir, engine_tp, QUALNAME)))
    versions = [1, *range(2, 2 + len(POLICIES))]
    port, xfer_port = free_port(), free_port()
    p = start_process(_rank1, (port, xfer_port, workdir, engine_tp, versions))
    out = {"weights": {}, "commits": [], "results": [], "refits": []}
    try:
        model, trainer = await asyncio.to_thread(
            _trainer_setup, 0, port, xfer_port, workdir, engine_tp, AsyncLLMClient(engine, loop)
        )
        vocab = load_config(workdir).vocab_size
        driver = OverlapDriver(engine, "drain")
        stop, tasks = asyncio.Event(), []
        for v, policy in zip(versions, ("drain", *POLICIES)):
            await asyncio.to_thread(_step, model, v, vocab)
            t0 = time.perf_counter()
            await driver.stage(v, lambda v=v: trainer.stage_weights(v))
            while tasks and not any(0 < n <= MAX_TOKENS // 2 for n in driver.in_flight().values()):
                await asyncio.sleep(0.002)  # a request part way through, far from its end, meets the commit
            record = await driver.commit(v, policy)
            record.stage_s = record.paused_at - record.pause_s - t0
            out["refits"].append({"version": v, "policy": policy, "started": t0, "record": vars(record)})
            out["weights"][v] = await asyncio.to_thread(full_state, model)
            if v == 1:  # generation starts on version 1, after one request has warmed the engine up
                await _warm_up(engine, vocab)
                tasks = [asyncio.create_task(_stream(driver, out["results"], stop, i, vocab)) for i in range(STREAMS)]
            await asyncio.sleep(1.0)  # requests in flight, several of them part way, at the next commit
        stop.set()
        await asyncio.gather(*tasks)
        out["stats"] = await engine.collective_rpc("refit_stats")
        out["version"] = await engine.get_weight_version()
        trainer.shutdown()
        await asyncio.to_thread(dist.destroy_process_group)
    finally:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
        engine.shutdown()
    assert p.exitcode == 0, f"trainer rank 1 failed (exit code {p.exitcode})"
    return out


def run(engine_tp: int = 2) -> dict:
    """Start the engine on the small model (seed 1000 weights), refit it as the module docstring says."""
    check_vllm_secure()
    if engine_tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(engine_tp)))
    with tempfile.TemporaryDirectory() as workdir:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        build_model(load_config(workdir), torch.float32, seed=1000).save_pretrained(workdir)
        out = asyncio.run(_run(workdir, engine_tp))
        out["config_dir_config"] = dict(CONFIG)
        return out


def hf_logprobs(models: dict, prompt: list[int], tokens: list[int], versions: list[int]) -> list[float]:
    """The logprob of each token when token i is made by ``models[versions[i]]`` on the KV cache that the
    earlier passes left (each position's keys and values computed by the model that processed it), as an
    engine that switches weights mid-request (``in_place``) computes it."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    with torch.no_grad():
        for i, (tok, v) in enumerate(zip(tokens, versions)):
            ids = prompt if i == 0 else [tokens[i - 1]]
            pos = torch.arange(len(prompt) + i - len(ids), len(prompt) + i)[None]
            logits = models[v](input_ids=torch.tensor([ids]), past_key_values=cache, position_ids=pos).logits
            out.append(float(torch.log_softmax(logits[0, -1].double(), -1)[tok]))
    return out


if __name__ == "__main__":
    r = run()
    for ref in r["refits"]:
        print(ref["version"], ref["policy"], {k: v for k, v in ref["record"].items() if k != "tokens"})
    print(len(r["results"]), "requests")
