"""CPU per operation of the data plane's small batches, summed over every Ray process of the node.

    python -m bench.dataplane_cpu [--samples 32 --seq 2048 --ops 200]

Why the 16 producers x 8 consumers run of ``bench.dataplane_compare`` is slower with refit than with zero-copy
numpy Ray: on 2 cores, 24 busy clients make the wall time the CPU the node spends per batch. One process puts
a batch (int64 ids + float32 logprobs, [samples, seq]) and reads it back, ``--ops`` times, per method; the CPU
time (user + system) of this process, the raylet, the GCS and every Ray worker is read before and after.
Methods: ``ray numpy`` (``ray.put`` + ``ray.get``), ``refit durable=False`` and ``refit durable``
(``RayStore`` put + take), each also with ``trust_meta``, and ``actor heap`` (the batch passed to an actor
that keeps a copy in its heap and returns it on take: no object references; how TransferQueue stores, as a
design probe for refit)."""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from bench.dataplane_compare import make_batch


def ray_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every Ray process of the node."""
    import psutil

    total = 0.0
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline()[:2])
            if p.pid == os.getpid() or "ray" in cmd or p.name() in ("raylet", "gcs_server"):
                t = p.cpu_times()
                total += t.user + t.system
        except (psutil.Error, OSError):
            continue
    return total


def measure(op, ops: int) -> dict:
    op(-1)  # warm-up
    c0, t0 = ray_cpu_seconds(), time.perf_counter()
    for i in range(ops):
        op(i)
    wall, cpu = time.perf_counter() - t0, ray_cpu_seconds() - c0
    return {"wall_ms_per_op": 1e3 * wall / ops, "cpu_ms_per_op": 1e3 * cpu / ops}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ops", type=int, default=200)
    args = ap.parse_args(argv)
    import ray

    from refit.data.ray_store import RayStore

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    batch = make_batch(args.samples, args.seq)
    as_numpy = {k: v.numpy() for k, v in batch.items()}

    @ray.remote(num_cpus=0, max_concurrency=16)
    class Heap:
        def __init__(self) -> None:
            self.held = {}

        def put(self, key, fields):
            self.held[key] = {f: np.array(v, copy=True) for f, v in fields.items()}

        def take(self, key):
            return self.held.pop(key)

    heap = Heap.remote()
    stores = {
        "refit durable=False": RayStore(num_units=1, durable=False),
        "refit durable": RayStore(num_units=1),
        "refit durable=False trust_meta": RayStore(num_units=1, durable=False, trust_meta=True),
        "refit durable trust_meta": RayStore(num_units=1, trust_meta=True),
    }

    def ray_numpy(i):
        ref = ray.put(as_numpy)
        out = ray.get(ref)
        del out, ref

    def refit(store):
        def op(i):
            meta = store.put([f"b{i}/{j}" for j in range(args.samples)], batch, partition="cpu")
            out = store.take(meta, select_fields=list(batch))
            del out

        return op

    def actor_heap(i):
        ray.get(heap.put.remote(i, as_numpy))
        out = ray.get(heap.take.remote(i))
        del out

    rows = {"ray numpy": measure(ray_numpy, args.ops)}
    rows.update({name: measure(refit(s), args.ops) for name, s in stores.items()})
    rows["actor heap"] = measure(actor_heap, args.ops)
    ray.shutdown()
    base = rows["ray numpy"]["cpu_ms_per_op"]
    print(f"{'method':32s} {'wall ms/op':>10s} {'cpu ms/op':>10s} {'x ray numpy (cpu)':>18s}")
    for name, r in rows.items():
        print(f"{name:32s} {r['wall_ms_per_op']:10.2f} {r['cpu_ms_per_op']:10.2f} {r['cpu_ms_per_op'] / base:18.2f}")
    print(json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
