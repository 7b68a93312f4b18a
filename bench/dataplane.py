"""Data-plane benchmark on CPU: moving a GRPO batch through refit's Ray store vs plain Ray, and
the balance quality of ``balanced_shards`` vs contiguous chunking and sort-stride.

    python -m bench.dataplane [--samples 512 --seq 8192 --dp 8 --iters 7] [--out bench/results/cpu-dataplane.json]

Transfer, per method (median of ``--iters`` rounds after one warm-up; each round runs every
method once, so drift on a busy machine hits all alike; each refit run uses fresh keys):
- ``refit_put_get``: the driver puts the batch (int64 ids + float32 logprobs, [samples, seq])
  into a ``RayStore`` and gets every key back (writable tensors); also with ``durable=False``.
- ``ray_put_get``: ``ray.put`` + ``ray.get`` of the same dict, as torch tensors (what RL
  frameworks pass: pickled, not zero-copy) and as numpy arrays (zero-copy, then copied into
  writable torch tensors).
- ``*_dp<N>``: the batch is put once, then N consumer actors each fetch their balanced share
  (refit: ``store.get`` of its keys; Ray: ``ray.get`` of the whole object, then its rows) —
  time from the put to the last consumer done.
Balance: a long-tailed length distribution (lognormal, capped), ``--balance-samples`` samples
over ``--dp`` ranks with a token budget per microbatch; baselines pack each rank's samples with
the same first-fit-decreasing packer, so only the assignment to ranks differs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from refit.data import balance_stats, balanced_shards, pack_microbatches, sample_flops


def long_tail(n: int, cap: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return (np.minimum(rng.lognormal(np.log(cap / 16), 1.0, n), cap).astype(int) + 16).tolist()


def contiguous(lens: list[int], dp: int, budget: int) -> list[list[list[int]]]:
    return [pack_microbatches(c.tolist(), lens, budget) for c in np.array_split(np.arange(len(lens)), dp)]


def sort_stride(lens: list[int], dp: int, budget: int) -> list[list[list[int]]]:
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    return [pack_microbatches(order[r::dp], lens, budget) for r in range(dp)]


def pareto_tail(n: int, cap: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return np.clip((cap / 64 * (1 + rng.pareto(1.2, n))).astype(int), 16, cap).tolist()


def balance_rows(n: int, dp: int, cap: int, budget: int, group: int) -> list[dict]:
    rows = []
    for dist, lens in (("lognormal", long_tail(n, cap)), ("pareto", pareto_tail(n, budget))):
        flops = sample_flops(lens)
        cases = (
            ("balanced_shards", balanced_shards(lens, dp, budget)),
            (f"balanced_shards (group_size={group})", balanced_shards(lens, dp, budget, group_size=group)),
            ("balanced_shards (cost=flops)", balanced_shards(lens, dp, budget, cost=flops)),
            (f"balanced_shards (cost=flops, group_size={group})", balanced_shards(lens, dp, budget, group, cost=flops)),
            ("contiguous chunks", contiguous(lens, dp, budget)),
            ("sort-stride", sort_stride(lens, dp, budget)),
        )
        rows += [_balance_row(name, dist, shards, lens, flops, dp, budget) for name, shards in cases]
    return rows


def _balance_row(name, dist, shards, lens, flops, dp, budget) -> dict:
    s = balance_stats(shards, lens, cost=flops)
    return {
        "method": name,
        "lengths": dist,
        "samples": len(lens),
        "dp": dp,
        "budget": budget,
        "flops_max_over_mean": s["cost_max_over_mean"],
        "max_over_mean": s["max_over_mean"],
        "microbatches_min": min(s["microbatches"]),
        "microbatches_max": max(s["microbatches"]),
        "max_microbatch_tokens": s["max_microbatch_tokens"],
    }


def transfer_rows(samples: int, seq: int, dp: int, iters: int, units: int) -> list[dict]:
    import ray

    from refit.data.ray_store import RayStore

    ray.init(
        address="local",
        num_cpus=max(2, os.cpu_count() or 2),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=4 << 30,
    )
    stores = {True: RayStore(num_units=units), False: RayStore(num_units=units, durable=False)}
    g = torch.Generator().manual_seed(0)
    batch = {
        "ids": torch.randint(0, 150_000, (samples, seq), generator=g),
        "logprobs": -torch.rand(samples, seq, generator=g),
    }
    as_numpy = {k: v.numpy() for k, v in batch.items()}
    nbytes = sum(t.numel() * t.element_size() for t in batch.values())
    lens = long_tail(samples, seq)
    shares = [[i for mb in rank for i in mb] for rank in balanced_shards(lens, dp, 2 * seq)]

    @ray.remote(num_cpus=0)
    class Consumer:
        def refit(self, store, meta):
            out = store.get(meta, select_fields=["ids", "logprobs"])
            return sum(t.numel() for t in out.values())

        def ray(self, holder, rows):  # the whole object, then this rank's rows (writable copies)
            d = ray.get(holder[0])
            idx = torch.tensor(rows)
            return sum(torch.as_tensor(v).index_select(0, idx).numel() for v in d.values())

    consumers = [Consumer.remote() for _ in range(dp)]
    counter = iter(range(1 << 30))

    def refit_put_get(durable):
        def run():
            store = stores[durable]
            meta = store.put([f"b{next(counter)}/{i}" for i in range(samples)], batch, partition="bench")
            out = store.get(meta, select_fields=["ids", "logprobs"], copy=True)  # writable, as before
            assert torch.equal(out["ids"], batch["ids"])
            store.clear(meta)

        return run

    def ray_put_get(payload):
        def run():
            out = ray.get(ray.put(payload))
            got = {k: torch.from_numpy(v.copy()) if isinstance(v, np.ndarray) else v for k, v in out.items()}
            assert torch.equal(got["ids"], batch["ids"])

        return run

    def refit_dp():
        store = stores[True]
        meta = store.put([f"b{next(counter)}/{i}" for i in range(samples)], batch, partition="bench")
        got = ray.get([c.refit.remote(store, meta.select(s)) for c, s in zip(consumers, shares)])
        assert sum(got) == 2 * samples * seq
        store.clear(meta)

    def ray_dp(payload):
        def run():
            ref = ray.put(payload)
            got = ray.get([c.ray.remote([ref], s) for c, s in zip(consumers, shares)])
            assert sum(got) == 2 * samples * seq

        return run

    methods = {
        "ray_put_get (torch tensors)": ray_put_get(batch),
        "ray_put_get (numpy, copied to torch)": ray_put_get(as_numpy),
        "refit_put_get": refit_put_get(True),
        "refit_put_get (durable=False)": refit_put_get(False),
        f"ray_dp{dp} (torch tensors)": ray_dp(batch),
        f"ray_dp{dp} (numpy)": ray_dp(as_numpy),
        f"refit_dp{dp}": refit_dp,
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for fn in methods.values():
            fn()  # warm-up
        for _ in range(iters):  # rounds, every method once per round: drift hits all alike
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for s in stores.values():
            assert s.keys() == [] and s.chunks() == 0, "benchmark leaked keys"
    finally:
        for s in stores.values():
            s.shutdown()
        ray.shutdown()
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(
            {
                "method": name,
                "median_s": med,
                "min_s": min(ts),
                "max_s": max(ts),
                "n": iters,
                "bytes": nbytes,
                "gbps": nbytes / med / 1e9,
            }
        )
    by = {r["method"]: r["median_s"] for r in rows}
    for r in rows:
        dp_row = r["method"].startswith(("ray_dp", "refit_dp"))
        r["ratio_to_ray_torch"] = (
            r["median_s"] / by[f"ray_dp{dp} (torch tensors)" if dp_row else "ray_put_get (torch tensors)"]
        )
        r["ratio_to_ray_numpy"] = (
            r["median_s"] / by[f"ray_dp{dp} (numpy)" if dp_row else "ray_put_get (numpy, copied to torch)"]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--units", type=int, default=2, help="storage actors")
    ap.add_argument("--balance-samples", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=16384, help="max tokens per microbatch (balance part)")
    ap.add_argument("--group", type=int, default=16, help="GRPO group size (balance part)")
    ap.add_argument("--skip-transfer", action="store_true")
    ap.add_argument("--out", default="bench/results/cpu-dataplane.json")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    bal = balance_rows(args.balance_samples, args.dp, args.seq, args.budget, args.group)
    xfer = [] if args.skip_transfer else transfer_rows(args.samples, args.seq, args.dp, args.iters, args.units)
    meta = {
        "command": "python -m bench.dataplane " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "args": vars(args),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "transfer": xfer, "balance": bal}, f, indent=1)
    c = Console()
    if xfer:
        t = Table(
            title=f"put + get, {args.samples} x {args.seq} int64 ids + float32 logprobs "
            f"({xfer[0]['bytes'] / 2**20:.0f} MiB), {os.cpu_count()} CPUs"
        )
        for col in ("method", "median ms", "min ms", "max ms", "GB/s", "x ray (torch)", "x ray (numpy)"):
            t.add_column(col)
        for r in xfer:
            t.add_row(
                r["method"],
                f"{r['median_s'] * 1e3:.2f}",
                f"{r['min_s'] * 1e3:.2f}",
                f"{r['max_s'] * 1e3:.2f}",
                f"{r['gbps']:.2f}",
                f"{r['ratio_to_ray_torch']:.2f}",
                f"{r['ratio_to_ray_numpy']:.2f}",
            )
        c.print(t)
    t = Table(
        title=f"balance: {args.balance_samples} long-tailed samples over {args.dp} DP ranks, "
        f"<= {args.budget} tokens per microbatch"
    )
    for col in (
        "lengths",
        "method",
        "max/mean tokens",
        "max/mean FLOPs",
        "microbatches min..max",
        "largest microbatch",
    ):
        t.add_column(col)
    for r in bal:
        t.add_row(
            r["lengths"],
            r["method"],
            f"{r['max_over_mean']:.4f}",
            f"{r['flops_max_over_mean']:.4f}",
            f"{r['microbatches_min']}..{r['microbatches_max']}",
            str(r["max_microbatch_tokens"]),
        )
    c.print(t)
    print(f"records written to {args.out}")


if __name__ == "__main__":
    main()
