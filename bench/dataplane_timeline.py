"""Where the time of ``bench.dataplane_dp``'s round goes: stamps in the driver and inside each DP reader.

    python -m bench.dataplane_timeline [--samples 512 --seq 8192 --dp 4 --rounds 60 --gap-ms 50]
        [--order shuffled|rotated --seed 0] [--out bench/results/cpu-dataplane-timeline.json]

Each round runs every method once, back to back, in a fresh random order (as ``bench.dataplane_dp``; ``--order
rotated``: each going first in turn), on the same batch and shares: ``ray numpy``
(``ray.put`` of numpy arrays; each reader ``ray.get``s the object and gathers its rows), ``floor`` (``ray
numpy`` plus one put call to an actor that records nothing), ``parts`` (refit's ``durable=False trust_meta``
put, read by raw readers given the object and the rows) and ``refit`` (the same put, each reader ``store.get``
of its share's meta). The readers stamp wall-clock time at the start and end of their method (one host: one
clock). Per method, the median over rounds of:

- ``put``: the driver's put (for ``floor``, with its put call), from the round's start;
- ``submit``: from the put's end until the last reader's call was submitted;
- ``start_lag``: per reader, from its call's submission to its method's start (mean over readers);
- ``work``: per reader, its method's own time (mean over readers);
- ``work_cpu``: per reader, the CPU time its method's thread spent (mean over readers): ``work`` beyond it is
  time the reader waited for a core;
- ``last_end``: from the round's start until the last reader's method ended;
- ``reply``: from the last reader's end until the driver held every reply;
- ``total``: the round, as ``bench.dataplane_dp`` times it;
- ``paired_x``: ``total`` over ``ray numpy``'s ``total`` in the same round.

A diagnostic: it says which phase a change moved, with less noise than one ``bench.dataplane_dp`` run."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid

import torch

from bench.dataplane_compare import FIELDS, add_order_args, dp_shares, make_batch, round_keys, round_order
from bench.dataplane_dp import make_sink

PHASES = ("put", "submit", "start_lag", "work", "work_cpu", "last_end", "reply", "total")


def make_reader(ray):
    """A DP reader whose methods return ``(start, end, elements read, CPU seconds of the method's thread)``."""

    @ray.remote(num_cpus=0)
    class Reader:
        def attach(self, store) -> None:
            self.store = store

        def refit(self, meta):
            t0, c0 = time.time(), time.thread_time()
            n = sum(t.numel() for t in self.store.get(meta, select_fields=FIELDS).values())
            return t0, time.time(), n, time.thread_time() - c0

        def ray(self, holder, rows):
            t0, c0 = time.time(), time.thread_time()
            idx = torch.as_tensor(rows)
            n = sum(torch.from_numpy(v).index_select(0, idx).numel() for v in ray.get(holder[0]).values())
            return t0, time.time(), n, time.thread_time() - c0

        def raw(self, holder, rows):
            from refit.data.ray_store import decode

            t0, c0 = time.time(), time.thread_time()
            idx = torch.as_tensor(rows)
            n = sum(decode(w, copy=False).index_select(0, idx).numel() for _, w in ray.get(holder[0]).values())
            return t0, time.time(), n, time.thread_time() - c0

    return Reader


def make_methods(ray, store, batch, readers, shares, counter) -> dict:
    """name -> run(): one round of the method, returning ``(put_end, submits, calls, done)``."""
    samples = batch["ids"].shape[0]
    as_numpy = {k: v.numpy() for k, v in batch.items()}

    sink = make_sink(ray)

    def submit(calls_of):
        submits, calls = [], []
        for r, share in zip(readers, shares):
            calls.append(calls_of(r, share))
            submits.append(time.time())
        return submits, calls

    def ray_numpy(with_sink: bool):
        def run():
            keys = round_keys(counter, samples)
            ref = ray.put(as_numpy)
            if with_sink:
                sink.put.remote(("bench", keys, [ref], tuple(as_numpy), None, None, False, False, uuid.uuid4().hex))
            put_end = time.time()
            return (put_end, *submit(lambda r, share: r.ray.remote([ref], share)), lambda: None)

        return run

    def refit(raw: bool):
        def run():
            meta = store.put(round_keys(counter, samples), batch, partition="bench")
            put_end = time.time()
            holder = meta.where.placed.holder
            if raw:
                submits, calls = submit(lambda r, share: r.raw.remote(holder, share))
            else:
                submits, calls = submit(lambda r, share: r.refit.remote(meta.select(share)))
            return put_end, submits, calls, lambda: (store.clear(meta), store.settle())

        return run

    return {"ray numpy": ray_numpy(False), "floor": ray_numpy(True), "parts": refit(True), "refit": refit(False)}


def one_round(ray, run, want: int) -> dict:
    t0 = time.time()
    put_end, submits, calls, done = run()
    replies = ray.get(calls)
    t_end = time.time()
    done()
    assert sum(r[2] for r in replies) == want
    starts, ends = [r[0] for r in replies], [r[1] for r in replies]
    return {
        "put": put_end - t0,
        "submit": submits[-1] - put_end,
        "start_lag": statistics.mean(s - sub for s, sub in zip(starts, submits)),
        "work": statistics.mean(e - s for s, e in zip(starts, ends)),
        "work_cpu": statistics.mean(r[3] for r in replies),
        "last_end": max(ends) - t0,
        "reply": t_end - max(ends),
        "total": t_end - t0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--gap-ms", type=float, default=50.0)
    add_order_args(ap, aa=False)
    ap.add_argument("--out", default="bench/results/cpu-dataplane-timeline.json")
    args = ap.parse_args(argv)
    import ray

    from refit.data.ray_store import RayStore

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, object_store_memory=3 << 30)
    try:
        store = RayStore(num_units=2, durable=False, trust_meta=True)
        batch = make_batch(args.samples, args.seq)
        readers = [make_reader(ray).remote() for _ in range(args.dp)]
        ray.get([r.attach.remote(store) for r in readers])
        shares = dp_shares(args.samples, args.seq, args.dp)
        methods = make_methods(ray, store, batch, readers, shares, iter(range(1 << 30)))
        want = 2 * batch["ids"].numel()
        stamps: dict[str, list[dict]] = {m: [] for m in methods}
        rng = random.Random(args.seed)
        for r in range(-2, args.rounds):  # two warm-up rounds
            for name in round_order(list(methods), r, args.order, rng):
                s = one_round(ray, methods[name], want)
                if r >= 0:
                    stamps[name].append(s)
                time.sleep(args.gap_ms / 1e3)
        assert store.keys() == [] and store.chunks() == 0, "refit leaked keys"
    finally:
        ray.shutdown()
    base = [s["total"] for s in stamps["ray numpy"]]
    rows = {}
    for name, ss in stamps.items():
        rows[name] = {p: 1e3 * statistics.median(s[p] for s in ss) for p in PHASES}
        rows[name]["paired_x"] = statistics.median(s["total"] / b for s, b in zip(ss, base))
    command = "python -m bench.dataplane_timeline " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {
        "command": command,
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_avg": os.getloadavg(),
    }
    record = {"meta": meta, "rows": rows, "stamps": stamps}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"{'method (median ms)':20s}" + "".join(f"{p:>10s}" for p in (*PHASES, "paired_x")))
    for name, row in rows.items():
        print(f"{name:20s}" + "".join(f"{row[p]:10.2f}" for p in PHASES) + f"{row['paired_x']:10.3f}")
    print(f"records written to {args.out}")


if __name__ == "__main__":
    main()
