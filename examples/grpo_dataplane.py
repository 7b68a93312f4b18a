"""A toy GRPO loop on CPU through refit's data plane.

Rollout workers (Ray tasks, other processes) write trajectories as tensor columns into a
``RayStore``; the driver reads only the small columns (lengths, rewards), computes GRPO
advantages and writes them back beside the rollouts, plans balanced DP shards with packing
(``balanced_shards``: equal microbatch counts on every rank, groups kept together), and each
DP trainer rank (a Ray actor) fetches exactly its share and "trains". The step's keys are
cleared; at the end the store must be empty.

    python examples/grpo_dataplane.py --steps 5 --dp 4
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray
import torch

from refit.data import BatchMeta, balance_stats, balanced_shards, restore_order
from refit.data.ray_store import RayStore

FIELDS = ["ids", "logprobs", "mask", "adv"]


@ray.remote(num_cpus=0)
def rollout(
    store: RayStore, version: int, step: int, worker: int, prompts: list[int], group: int, max_len: int, seed: int
) -> BatchMeta:
    """Generate ``group`` responses per prompt (long-tailed lengths) and write them."""
    rng = np.random.default_rng(seed)
    n = len(prompts) * group
    lens = np.minimum(rng.lognormal(np.log(max_len / 16), 1.0, n).astype(int) + 8, max_len)
    ids = torch.zeros(n, max_len, dtype=torch.int64)
    mask = torch.zeros(n, max_len, dtype=torch.bool)
    for i, L in enumerate(lens):
        ids[i, :L] = torch.from_numpy(rng.integers(1, 150_000, L))
        mask[i, :L] = True
    logprobs = (-torch.rand(n, max_len, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)
    reward = torch.from_numpy((rng.random(n) < 0.3).astype(np.float32))
    keys = [f"v{version}/s{step}/p{p}/g{j}" for p in prompts for j in range(group)]
    return store.put(
        keys,
        {
            "ids": ids,
            "mask": mask,
            "logprobs": logprobs,
            "reward": reward,
            "length": torch.from_numpy(lens.astype(np.int64)),
        },
        partition="train",
        tags={"version": version, "worker": worker},
        seq_lens=lens.tolist(),
    )


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def train_step(self, store: RayStore, meta: BatchMeta) -> dict:
        t0 = time.perf_counter()
        batch = store.get(meta, select_fields=FIELDS)  # exactly this rank's share, only these fields
        fetch_s = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in batch.values())
        per_sample = []
        pos = 0
        for mb in meta.extra_info["microbatches"]:  # the driver's packing, not re-packed here
            sl = slice(pos, pos + len(mb))
            m = batch["mask"][sl]
            lp = batch["logprobs"][sl].float()
            per_sample.append((batch["adv"][sl, None] * lp * m).sum(1) / m.sum(1))  # a policy-gradient-ish term
            pos += len(mb)
        return {
            "rank": self.rank,
            "microbatches": len(meta.extra_info["microbatches"]),
            "tokens": sum(meta.seq_lens),
            "bytes": nbytes,
            "fetch_s": fetch_s,
            "per_sample": torch.cat(per_sample),
        }


def grpo_advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    r = reward.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO group)")
    ap.add_argument("--dp", type=int, default=4, help="data-parallel trainer ranks")
    ap.add_argument("--rollout-workers", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=2048, help="longest response (tokens)")
    ap.add_argument("--max-tokens-per-microbatch", type=int, default=8192)
    ap.add_argument("--storage-units", type=int, default=2)
    args = ap.parse_args(argv)
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(2, args.rollout_workers), include_dashboard=False, log_to_driver=False)
    store = RayStore(num_units=args.storage_units)
    trainers = [Trainer.remote(r) for r in range(args.dp)]
    summary = {"steps": []}
    try:
        for step in range(args.steps):
            version = step  # the weights that generate this step's rollouts
            t0 = time.perf_counter()
            prompts = np.array_split(np.arange(args.prompts), args.rollout_workers)
            metas = ray.get(
                [
                    rollout.remote(store, version, step, w, p.tolist(), args.group, args.max_len, seed=1000 * step + w)
                    for w, p in enumerate(prompts)
                    if len(p)
                ]
            )
            meta = BatchMeta.concat(metas)
            t_roll = time.perf_counter() - t0
            # driver: small columns only
            small = store.get(meta, select_fields=["reward", "length"])
            adv = grpo_advantages(small["reward"], args.group)
            store.put(meta.keys, {"adv": adv}, partition=meta.partition)
            lens = small["length"].tolist()
            shards = balanced_shards(lens, args.dp, args.max_tokens_per_microbatch, group_size=args.group)
            rank_metas = []
            for rank in shards:
                order = [i for mb in rank for i in mb]
                pos = {i: j for j, i in enumerate(order)}
                rank_metas.append(
                    meta.select(order).with_extra_info(microbatches=[[pos[i] for i in mb] for mb in rank])
                )
            t1 = time.perf_counter()
            results = ray.get([t.train_step.remote(store, m) for t, m in zip(trainers, rank_metas)])
            t_train = time.perf_counter() - t1
            # per-sample results back in the rollout order (what the driver would log / reuse)
            restored = restore_order([r["per_sample"] for r in results], shards)
            assert restored.shape == (len(meta),)
            store.clear(meta)
            left = len(store.keys("train"))
            stats = balance_stats(shards, lens)
            mb = [r["microbatches"] for r in results]
            nbytes = sum(r["bytes"] for r in results)
            row = {
                "step": step,
                "samples": len(meta),
                "tokens": sum(lens),
                "max_over_mean": stats["max_over_mean"],
                "microbatches": mb,
                "fetch_MBps": nbytes / max(r["fetch_s"] for r in results) / 1e6,
                "rollout_s": t_roll,
                "train_s": t_train,
                "keys_left": left,
            }
            summary["steps"].append(row)
            print(
                f"step {step}: {len(meta)} samples, {sum(lens)} tokens, tokens/rank max/mean "
                f"{stats['max_over_mean']:.3f}, microbatches/rank {mb}, fetch {row['fetch_MBps']:.0f} MB/s "
                f"({nbytes / 1e6:.1f} MB), rollout {t_roll * 1e3:.0f} ms, train {t_train * 1e3:.0f} ms "
                f"({sum(lens) / t_train / 1e3:.0f}k tokens/s), "
                f"keys left {left}",
                flush=True,
            )
            if len(set(mb)) != 1:
                raise AssertionError(f"unequal microbatch counts across DP ranks: {mb}")
        summary["keys_left"] = len(store.keys())
        print(f"done: {args.steps} steps, keys left in the store: {summary['keys_left']}")
        if summary["keys_left"]:
            raise AssertionError(f"{summary['keys_left']} keys leaked")
        return summary
    finally:
        store.shutdown()
        for t in trainers:
            ray.kill(t)
        if started:
            ray.shutdown()


if __name__ == "__main__":
    main()
