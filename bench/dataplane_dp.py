"""Only the DP-readers row of ``bench.dataplane_compare``, many alternating rounds, each after a pause.

    python -m bench.dataplane_dp [--samples 512 --seq 8192 --dp 4 --rounds 40 --gap-ms 50]
        [--all] [--tq] [--floor] [--parts] [--store-per-call] [--aa] [--order shuffled|rotated --seed 0]
        [--out bench/results/cpu-dataplane-dp.json]

The batch (int64 ids + float32 logprobs, [samples, seq]) is put once by the driver, then ``--dp`` consumer
actors fetch their balanced shares (``balanced_shards`` of long-tailed lengths: scattered rows) at once; the
time is from the put to the last consumer done, exactly as ``bench.dataplane_compare``'s ``dp<N>`` row (same
consumers, same shares). Methods: ``ray numpy`` (``ray.put`` of numpy arrays; each rank ``ray.get``s the whole
object, then its rows with one ``index_select``), refit ``RayStore(trust_meta=True)`` ``durable=False`` and
durable (each rank holds the store's client from setup, as TransferQueue's ranks hold theirs from ``tq.init()``,
and gets ``meta.select(share)`` through the meta); ``--all`` adds the two configurations without ``trust_meta``,
``--tq`` TransferQueue (``kv_batch_put`` / ``kv_batch_get``; needs it on ``PYTHONPATH``), ``--store-per-call``
each refit store again with its client sent in every call, ``--floor`` ``ray numpy``
plus one put call to an actor that records nothing (``floor_method``) and the same with the actor keeping the
object's reference until the clear (``keep``: what a store whose keys outlive the writer's meta must do),
``--parts`` the ``durable=False trust_meta`` store's put read by ``ray numpy``'s readers (``parts_method``: the
put's side alone) and the same with each reader sent its share's meta (``send_meta``: the meta as a call
argument, without the store's ``get``).

Rounds interleave the methods in a fresh random order each (``--order shuffled``, the default, seeded by
``--seed``), so no method always follows the same neighbour: with ``--order rotated`` (each going first in turn)
every method keeps one predecessor, whose leftovers bias it (the ``floor``, which
does more than ``ray numpy``, read 0.85x of it so). ``--aa`` times ``ray numpy`` twice, as two methods (``ray
numpy (A/A)``): its paired ratio, 1.00 in an unbiased run, is the bench's own error. After each method its clear
(refit: and the wait for the durable copy, ``settle``) and a pause of ``--gap-ms`` (Ray frees a released object
in the background; a put that runs meanwhile on 2 cores is slower), both outside the timing; two warm-up rounds
are not timed. Reports each method's median and p90 over the rounds, its ratio to ``ray numpy``'s median of the
same run, and its paired ratio: the median over rounds of its time over ``ray numpy``'s in the same round (a
round's methods run back to back, so the machine's drift over a run cancels in each pair; the rounds' spread of
that ratio is reported as p10-p90)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import uuid

from bench.dataplane_compare import (
    FIELDS,
    add_order_args,
    dp_methods,
    dp_shares,
    make_batch,
    make_dp_consumer,
    pct,
    round_keys,
    round_order,
)


def make_sink(ray):
    """An actor whose ``put(call)`` records nothing (``put(call, keep=True)`` keeps only the call's object
    reference, until ``drop(origin)``), started and called once."""

    @ray.remote(num_cpus=0, max_concurrency=16)
    class Sink:
        def __init__(self) -> None:
            self.kept: dict = {}

        def put(self, call, keep: bool = False):
            if keep:
                self.kept[call[-1]] = call[2]

        def drop(self, origin) -> None:
            self.kept.pop(origin, None)

    sink = Sink.remote()
    ray.get(sink.put.remote(None))
    return sink


def floor_method(ray, batch, consumers, shares, counter, keep: bool = False):
    """``ray numpy`` plus, per put, the one call a store whose keys live outside the writer makes: the
    arguments ``RayStore``'s put call carries (partition, the keys, the object reference, fields, origin)
    to an actor that records nothing, not waited for (as a ``trust_meta`` put). The readers are ``ray
    numpy``'s. What no such store can go below. ``keep``: the actor keeps the object reference, as a
    store must for its keys to stay readable once the writer drops the put's meta (Ray then counts the
    actor as a borrower of the writer's object), until the round's clear (``drop``, outside the timing)."""

    sink = make_sink(ray)
    samples = batch["ids"].shape[0]
    as_numpy = {k: v.numpy() for k, v in batch.items()}
    want = 2 * batch["ids"].numel()

    def run():
        ref = ray.put(as_numpy)
        keys, origin = round_keys(counter, samples), uuid.uuid4().hex
        sink.put.remote(("bench", keys, [ref], tuple(as_numpy), None, None, False, False, origin), keep)
        assert sum(ray.get([c.ray.remote([ref], s) for c, s in zip(consumers, shares)])) == want
        return (lambda: ray.get(sink.drop.remote(origin))) if keep else (lambda: None)

    return run


def parts_method(ray, store, batch, consumers, shares, counter, send_meta: bool = False):
    """refit's put (``store``, ``trust_meta``), read by ``ray numpy``'s readers: each gets the put's object
    reference and its rows and gathers them without the store (``refit_raw``). Between ``floor_method`` and
    the refit method of the same store, it splits refit's time into the put's side and the readers' side.
    ``send_meta``: each reader is sent its share's meta instead (``meta.select(share)``, as the refit method
    sends it) and reads the object and rows it names the same way (``refit_meta_raw``), splitting the readers'
    side into the meta as a call argument and the store's ``get``."""
    samples = batch["ids"].shape[0]
    want = 2 * batch["ids"].numel()

    def run():
        meta = store.put(round_keys(counter, samples), batch, partition="bench")
        if send_meta:
            calls = [c.refit_meta_raw.remote(meta.select(s)) for c, s in zip(consumers, shares)]
        else:
            calls = [c.refit_raw.remote(meta.where.placed.holder, s) for c, s in zip(consumers, shares)]
        assert sum(ray.get(calls)) == want
        return lambda: (store.clear(meta), store.settle())

    return run


def row(t: list[float], ray_t: list[float], base: float) -> dict:
    """One method's record: median and p90 of its times, its ratio to ``ray numpy``'s median (``base``),
    and its paired ratio (the median, p10 and p90 over rounds of ``t[r] / ray_t[r]``)."""
    paired = [a / b for a, b in zip(t, ray_t)]
    return {
        "median_ms": 1e3 * statistics.median(t),
        "p90_ms": 1e3 * pct(t, 90),
        "x_ray_numpy": statistics.median(t) / base,
        "paired_x": statistics.median(paired),
        "paired_p10_p90": [pct(paired, 10), pct(paired, 90)],
        "times_ms": [round(1e3 * x, 3) for x in t],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=50.0)
    ap.add_argument("--units", type=int, default=2, help="refit storage actors")
    ap.add_argument("--all", action="store_true", help="also refit without trust_meta")
    ap.add_argument("--tq", action="store_true", help="also TransferQueue")
    ap.add_argument("--store-per-call", action="store_true", help="also each refit store passed with every call")
    ap.add_argument("--floor", action="store_true", help="also ray numpy + one put call to a sink (the floors)")
    ap.add_argument("--parts", action="store_true", help="also refit's put read by raw readers (sent ref or meta)")
    add_order_args(ap)
    ap.add_argument("--out", default="bench/results/cpu-dataplane-dp.json")
    args = ap.parse_args(argv)
    import ray

    from refit.data.ray_store import RayStore

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, object_store_memory=3 << 30)
    tq = None
    if args.tq:
        import transfer_queue as tq

        tq.init()
    stores = {
        "refit durable=False trust_meta": RayStore(num_units=args.units, durable=False, trust_meta=True),
        "refit durable trust_meta": RayStore(num_units=args.units, trust_meta=True),
    }
    if args.all:
        stores["refit durable=False"] = RayStore(num_units=args.units, durable=False)
        stores["refit durable"] = RayStore(num_units=args.units)
    batch = make_batch(args.samples, args.seq)
    consumers = [make_dp_consumer(ray, with_tq=args.tq).remote() for _ in range(args.dp)]
    shares = dp_shares(args.samples, args.seq, args.dp)
    counter = iter(range(1 << 30))  # one key space for every method: no two rounds write the same keys
    methods = dp_methods(ray, tq, stores, batch, consumers, shares, counter, per_call=args.store_per_call)
    if args.floor:
        methods["ray numpy + put call (floor)"] = floor_method(ray, batch, consumers, shares, counter)
        methods["floor, reference kept"] = floor_method(ray, batch, consumers, shares, counter, keep=True)
    if args.parts:
        store = stores["refit durable=False trust_meta"]
        methods["refit put, raw readers (parts)"] = parts_method(ray, store, batch, consumers, shares, counter)
        methods["refit put, meta to raw readers"] = parts_method(ray, store, batch, consumers, shares, counter, True)
    if args.aa:
        methods["ray numpy (A/A)"] = methods["ray numpy"]
    times: dict[str, list[float]] = {m: [] for m in methods}
    loads = []
    rng = random.Random(args.seed)
    try:
        for r in range(-2, args.rounds):
            for name in round_order(list(methods), r, args.order, rng):
                t0 = time.perf_counter()
                done = methods[name]()
                if r >= 0:
                    times[name].append(time.perf_counter() - t0)
                done()
                time.sleep(args.gap_ms / 1e3)
            loads.append(os.getloadavg()[0])
        leaked = [k for s in stores.values() for k in s.keys()]
        assert leaked == [] and sum(s.chunks() for s in stores.values()) == 0, f"refit leaked {len(leaked)} keys"
    finally:
        if tq is not None:
            tq.close()
        ray.shutdown()
    base = statistics.median(times["ray numpy"])
    rows = {m: row(t, times["ray numpy"], base) for m, t in times.items()}
    meta = {
        "command": "python -m bench.dataplane_dp " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "load_avg_start_end": [loads[0], loads[-1]],
        "load_avg_median": statistics.median(loads),
        "ray": ray.__version__,
        "fields": FIELDS,
        "args": vars(args),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(
        f"{'method':32s} {'median ms':>10s} {'p90 ms':>8s} {'x ray numpy':>12s} {'paired x':>9s} {'p10-p90':>11s}"
        f"   (load {meta['load_avg_median']:.2f})"
    )
    for name, r in rows.items():
        lo, hi = r["paired_p10_p90"]
        print(
            f"{name:32s} {r['median_ms']:10.2f} {r['p90_ms']:8.2f} {r['x_ray_numpy']:12.2f} {r['paired_x']:9.3f}"
            f" {lo:5.2f}-{hi:5.2f}"
        )
    print(f"records written to {args.out}")


if __name__ == "__main__":
    main()
