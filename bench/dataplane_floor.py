"""The floor of a data plane with one control round trip per put and per get, beside refit, in one run.

    python -m bench.dataplane_floor [--samples 512 --seq 8192 --iters 15] [--aa] [--order shuffled|rotated --seed 0]
        [--out FILE]

The put+get row of ``bench.dataplane_compare`` (the driver puts one batch of int64 ids + float32 logprobs,
[samples, seq], and reads every row back) asks refit to be within 1.2x of zero-copy numpy Ray. Any design that
keeps its keys somewhere other than the writer (a store others can read, refuse duplicates in and clear) makes
at least one call to that place per put and one per get. This bench times that floor directly: ``ray numpy``
(``ray.put`` + ``ray.get``), ``+ 2 empty calls`` (the same plus two calls to an actor that does nothing: the
least any such design pays), and refit's ``RayStore`` (views) with ``durable=False`` and durable, each also
with ``trust_meta`` (the get reads where the put's ``BatchMeta`` says: no call, so one call per round trip in
all), each put followed by a get of every row; clears and the durable copy's wait (``settle``) are outside the
timing, and so is a pause of ``--gap-ms`` after each method: Ray frees a released object in the background,
and a put that runs meanwhile on 2 cores took 2-3x as long (7 ms vs 18-24 ms for the same 48 MiB, in ad hoc
timings). Rounds interleave the methods in a fresh random order each (``--order shuffled``, the default; ``rotated``:
each going first in turn); ``--aa`` times ``ray numpy`` twice (the bench's own error).
Reports medians, each method's ratio to ``ray numpy``'s median and its paired ratio (the median over rounds of its
time over ``ray numpy``'s in the same round), as ``bench.dataplane_dp``. The empty calls take the arguments refit's
put call takes (512 keys, tags, lengths), so only refit's own work differs. Each round's key list is made before
the timing (the caller's work, not refit's)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from bench.dataplane_compare import add_order_args, make_batch, round_order
from bench.dataplane_dp import row


def call_costs(ray, actor, ref, keys, fields, tags, lens, n: int = 300) -> dict[str, float]:
    """Median ms of one call to ``actor`` (it does nothing) with no arguments, with each of refit's put
    arguments alone, and with all of them; the variants interleaved."""
    cases = {
        "no arguments": (),
        "keys": (keys,),
        "reference": ([ref],),
        "tags": (tags,),
        "lengths": (lens,),
        "all of put's": ("floor", keys, [ref], fields, tags, lens),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(n + 20):
        for name, call_args in cases.items():
            t0 = time.perf_counter()
            ray.get(actor.call.remote(*call_args))
            if i >= 20:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--gap-ms", type=float, default=50.0)
    add_order_args(ap)
    ap.add_argument("--out", default=None, help="also write the record (the JSON line printed last) to this file")
    args = ap.parse_args(argv)
    import ray

    from refit.data.ray_store import RayStore

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=3 << 30)
    batch = make_batch(args.samples, args.seq)
    as_numpy = {k: v.numpy() for k, v in batch.items()}

    @ray.remote(num_cpus=0, max_concurrency=16)
    class Empty:
        def call(self, *args) -> None:
            return None

    empty = Empty.remote()
    ray.get(empty.call.remote())
    stores = {
        "refit durable=False": RayStore(num_units=1, durable=False),
        "refit durable": RayStore(num_units=1),
        "refit durable=False trust_meta": RayStore(num_units=1, durable=False, trust_meta=True),
        "refit durable trust_meta": RayStore(num_units=1, trust_meta=True),
    }

    keys = [f"k{j}" for j in range(args.samples)]
    tags, lens = [{}] * args.samples, [args.seq] * args.samples

    def ray_numpy(i: int, calls: int = 0) -> None:
        ref = ray.put(as_numpy)
        for _ in range(calls):
            ray.get(empty.call.remote("floor", keys, [ref], list(as_numpy), tags, lens))
        out = ray.get(ref)
        del out, ref

    # each round's keys made before the timing: the caller's work, not the store's (ray numpy has none)
    round_keys = {i: [f"b{i}/{j}" for j in range(args.samples)] for i in range(-2, args.iters)}
    fields = list(batch)

    def refit(store: RayStore):
        def op(i: int) -> None:
            meta = store.put(round_keys[i], batch, partition="floor")
            out = store.get(meta, select_fields=fields)
            del out

        def after(i: int) -> None:
            store.clear(round_keys[i], partition="floor")
            store.settle()

        return op, after

    methods = {
        "ray numpy": (ray_numpy, None),
        "+ 2 empty calls": (lambda i: ray_numpy(i, calls=2), None),
        **{name: refit(s) for name, s in stores.items()},
    }
    if args.aa:
        methods["ray numpy (A/A)"] = methods["ray numpy"]
    times: dict[str, list[float]] = {m: [] for m in methods}
    rng = random.Random(args.seed)
    for i in range(-2, args.iters):  # two warm-up rounds
        for name in round_order(list(methods), i, args.order, rng):
            op, after = methods[name]
            t0 = time.perf_counter()
            op(i)
            if i >= 0:
                times[name].append(time.perf_counter() - t0)
            if after is not None:
                after(i)
            time.sleep(args.gap_ms / 1e3)
    calls = call_costs(ray, empty, ray.put(as_numpy), keys, list(as_numpy), tags, lens)
    ray.shutdown()
    base = statistics.median(times["ray numpy"])
    rows = {m: row(t, times["ray numpy"], base) for m, t in times.items()}
    print(f"{'method':32s} {'median ms':>10s} {'x ray numpy':>12s} {'paired x':>9s} {'p10-p90':>11s}")
    for name, r in rows.items():
        lo, hi = r["paired_p10_p90"]
        print(f"{name:32s} {r['median_ms']:10.2f} {r['x_ray_numpy']:12.2f} {r['paired_x']:9.3f} {lo:5.2f}-{hi:5.2f}")
    print("one empty call, median of 300, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in calls.items()))
    record = {"args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows, "empty_call_ms": calls}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
