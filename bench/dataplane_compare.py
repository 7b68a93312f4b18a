"""refit's data plane beside zero-copy numpy Ray and TransferQueue, on the same batches in the same run.

    python -m bench.dataplane_compare [--samples 512 --seq 8192 --dp 4 --iters 9]
        [--producers 16 --consumers 8 --batches-per-producer 8 --mp-samples 32 --mp-seq 2048 --bound 16]
        [--out bench/results/cpu-dataplane-compare.json]

Three parts, every method run in the same Ray session (one node; object store capped at 3 GiB):

- ``put_get``: the driver puts one batch (int64 ids + float32 logprobs, [samples, seq]) and gets
  every row back. Rounds interleave the methods (each round runs each once, so drift on a busy
  machine hits all alike; each method goes first in turn, here and in ``dp<N>``); median and p99
  of ``--iters`` rounds after a warm-up that also checks the bytes. Methods: ``ray numpy``
  (``ray.put``/``ray.get`` of numpy arrays, read-only views),
  ``ray numpy + copy`` (then writable torch copies), ``refit`` (``RayStore``: views), ``refit
  copy=True``, ``refit durable=False``, the same two with ``trust_meta`` (gets read where the put's
  ``BatchMeta`` says: no call), ``transferqueue`` (``kv_batch_put`` of a TensorDict,
  ``kv_batch_get``; SimpleStorage backend, its default). Clearing is done outside the timing, and
  so is the wait for refit's background durable copy (``RayStore.settle``: the put returns before
  the storage actor's copy exists); ``after_median_ms`` reports that clear + wait, so the copy's cost
  is shown and never falls on the next method of the round.
- ``dp<N>``: the batch is put once, then ``--dp`` consumer actors fetch their balanced shares
  (``balanced_shards`` of long-tailed lengths: scattered rows) at once; time from the put to the
  last consumer done. Ray: ``ray.get`` of the whole object, then its rows (one ``index_select``).
- ``mpmc``: ``--producers`` actors each put ``--batches-per-producer`` small batches and push their
  handles into one bounded queue (``ray.util.queue.Queue(maxsize=--bound)``, a new one per method and
  round, warmed before the timing with one handle of each kind: ``warm_queue``); ``--consumers`` actors
  pop, read every field, and release them (refit: ``take``, one call that reads and clears;
  TransferQueue: ``kv_batch_get`` then ``kv_clear``; Ray: drop the reference). Throughput is bytes
  moved over the wall time; latencies are per put and per get, measured in the actors; memory is the
  peak, sampled every 50 ms, of Ray's object store plus the resident memory of the store's own
  processes (TransferQueue keeps data in its storage actors' heaps, refit and Ray in the object
  store).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import threading
import time

import numpy as np
import torch

from bench.dataplane import long_tail
from refit.data import balanced_shards

FIELDS = ["ids", "logprobs"]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def timing_row(part: str, method: str, times_s: list[float], size: int) -> dict:
    med = statistics.median(times_s)
    return {
        "part": part,
        "method": method,
        "median_ms": 1e3 * med,
        "p99_ms": 1e3 * pct(times_s, 99),
        "gbps": size / med / 1e9,
        "bytes": size,
        "n": len(times_s),
    }


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: each method goes first in turn (the first of a round pays for what the
    round before left behind, e.g. TransferQueue's clear and garbage collection)."""
    k = r % len(names)
    return names[k:] + names[:k]


def round_order(names: list[str], r: int, order: str, rng: random.Random) -> list[str]:
    """Round ``r``'s order of ``names``: ``rotated`` (each first in turn, always behind the same neighbour) or
    ``shuffled`` (a fresh sample of ``rng``: no method always pays for the same neighbour's leftovers)."""
    return rotated(names, r) if order == "rotated" else rng.sample(names, len(names))


def add_order_args(ap: argparse.ArgumentParser, aa: bool = True) -> None:
    """``--order`` (shuffled by default) and ``--seed`` for ``round_order``; ``aa``: also ``--aa`` (time ``ray
    numpy`` twice: the bench's own error)."""
    ap.add_argument("--order", choices=("rotated", "shuffled"), default="shuffled", help="each round's method order")
    ap.add_argument("--seed", type=int, default=0, help="the shuffled orders' seed")
    if aa:
        ap.add_argument("--aa", action="store_true", help="also ray numpy a second time (A/A: the bench's own bias)")


def make_batch(samples: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 150_000, (samples, seq), generator=g),
        "logprobs": -torch.rand(samples, seq, generator=g),
    }


def nbytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


class MemoryProbe:
    """Peak of (object store bytes + resident bytes of the given processes), sampled in a thread."""

    def __init__(self, pids: list[int]) -> None:
        import psutil

        self.procs = [psutil.Process(p) for p in pids]
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def plasma_bytes() -> int:
        import ray
        from ray._private.internal_api import memory_summary

        summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
        m = re.search(r"Plasma memory usage (\d+) MiB", summary)
        return int(m.group(1)) << 20 if m else 0

    def sample(self) -> int:
        rss = 0
        for p in self.procs:
            try:
                rss += p.memory_info().rss
            except Exception:  # noqa: BLE001 - a process that exited holds nothing
                pass
        return self.plasma_bytes() + rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            time.sleep(0.05)

    def __enter__(self) -> MemoryProbe:
        self.base = self.sample()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def tq_storage_pids() -> list[int]:
    from ray.util.state import list_actors

    return [
        a.pid
        for a in list_actors(filters=[("state", "=", "ALIVE")])
        if "Storage" in a.class_name or "TransferQueue" in a.class_name
    ]


def _as_dense(t, rows: int) -> torch.Tensor:
    """TransferQueue returns fields as jagged nested tensors: their values, one row per sample."""
    return t.values().view(rows, -1) if getattr(t, "is_nested", False) else t


def refit_stores(RayStore, units: int) -> dict:
    """The refit configurations every part runs: name -> ``RayStore``."""
    return {
        "refit": RayStore(num_units=units),
        "refit durable=False": RayStore(num_units=units, durable=False),
        "refit trust_meta": RayStore(num_units=units, trust_meta=True),
        "refit durable=False trust_meta": RayStore(num_units=units, durable=False, trust_meta=True),
    }


def round_keys(counter, n: int, prefix: str = "d") -> list[str]:
    """One round's ``n`` keys under one fresh number from ``counter`` (no two rounds share a key), as a
    user names a batch's samples: one list built once, not one counter step per key."""
    b = next(counter)
    return [f"{prefix}{b}/{i}" for i in range(n)]


def put_get_methods(ray, tq, stores, batch, counter) -> dict:
    """name -> (put() -> handle, get(handle) -> rows, clear(handle))."""
    from tensordict import TensorDict

    as_numpy = {k: v.numpy() for k, v in batch.items()}
    n = batch["ids"].shape[0]
    td = TensorDict(batch, batch_size=n)

    def keys():
        return round_keys(counter, n, "b")

    def refit(s, copy):
        def clear(meta):  # and wait for the storage actor's background copy (durable): not the next method's cost
            s.clear(meta)
            s.settle()

        return (
            lambda: s.put(keys(), batch, partition="bench"),
            lambda meta: s.get(meta, select_fields=FIELDS, copy=copy),
            clear,
        )

    def tq_put():
        k = keys()
        tq.kv_batch_put(keys=k, partition_id="bench", fields=td)
        return k

    return {
        "ray numpy": (
            lambda: ray.put(as_numpy),
            lambda ref: {f: torch.from_numpy(v) for f, v in ray.get(ref).items()},
            lambda ref: None,
        ),
        "ray numpy + copy": (
            lambda: ray.put(as_numpy),
            lambda ref: {f: torch.from_numpy(v.copy()) for f, v in ray.get(ref).items()},
            lambda ref: None,
        ),
        **{name: refit(s, False) for name, s in stores.items()},
        "refit copy=True": refit(stores["refit"], True),
        "transferqueue": (
            tq_put,
            lambda k: {
                f: _as_dense(v, n)
                for f, v in tq.kv_batch_get(keys=k, partition_id="bench", select_fields=FIELDS).items()
            },
            lambda k: tq.kv_clear(keys=k, partition_id="bench"),
        ),
    }


def run_put_get(methods: dict, batch: dict, iters: int) -> list[dict]:
    for name, (put, get, clear) in methods.items():  # warm-up, and the bytes checked once
        h = put()
        got = get(h)
        assert all(torch.equal(got[f], batch[f]) for f in FIELDS), name
        del got
        clear(h)
    t: dict[str, dict[str, list[float]]] = {m: {"put": [], "get": [], "total": [], "after": []} for m in methods}
    for r in range(iters):
        for name in rotated(list(methods), r):
            put, get, clear = methods[name]
            t0 = time.perf_counter()
            h = put()
            t1 = time.perf_counter()
            got = get(h)
            t2 = time.perf_counter()
            del got
            clear(h)
            t[name]["put"].append(t1 - t0)
            t[name]["get"].append(t2 - t1)
            t[name]["total"].append(t2 - t0)
            t[name]["after"].append(time.perf_counter() - t2)  # clear (+ refit durable: its background copy)
    rows = [timing_row("put_get", m, v["total"], nbytes(batch)) for m, v in t.items()]
    for r, v in zip(rows, t.values()):
        for part in ("put", "get", "after"):
            r[f"{part}_median_ms"] = 1e3 * statistics.median(v[part])
    return rows


def make_dp_consumer(ray, with_tq: bool = True):
    """A DP rank's actor; ``with_tq=False``: TransferQueue is not attached (its ``tq_get`` is then unusable)."""

    @ray.remote(num_cpus=0)
    class DPConsumer:
        def __init__(self) -> None:
            if with_tq:
                import transfer_queue as tq

                tq.init()  # attaches to the running controller
                self.tq = tq
            self.stores: dict = {}

        def attach(self, stores):
            """The refit store clients, once at setup (as ``tq.init()`` attaches TransferQueue's)."""
            self.stores.update(stores)

        def refit(self, name, meta):
            return self.refit_with(self.stores[name], meta)

        def refit_with(self, store, meta):
            return sum(t.numel() for t in store.get(meta, select_fields=FIELDS).values())

        def ray(self, holder, rows):
            idx = torch.as_tensor(rows)
            return sum(torch.from_numpy(v).index_select(0, idx).numel() for v in ray.get(holder[0]).values())

        def refit_raw(self, holder, rows):
            """``ray`` on a refit put's object (its fields as ``encode`` wrote them), without the store."""
            from refit.data.ray_store import decode

            idx = torch.as_tensor(rows)
            return sum(decode(w, copy=False).index_select(0, idx).numel() for _, w in ray.get(holder[0]).values())

        def refit_meta_raw(self, meta):
            """``refit_raw`` on the object and rows a share's meta names (``PutRows``), without the store:
            the share's meta travels as ``refit``'s does, the read is ``refit_raw``'s."""
            return self.refit_raw(meta.where.placed.holder, meta.where.rows)

        def tq_get(self, keys):
            out = self.tq.kv_batch_get(keys=keys, partition_id="bench", select_fields=FIELDS)
            return sum(_as_dense(v, len(keys)).numel() for v in out.values())

    return DPConsumer


def dp_methods(ray, tq, stores, batch, consumers, shares, counter, suffix: str = "", per_call: bool = False) -> dict:
    """name + ``suffix`` -> run(): one put of ``batch`` read by ``consumers`` (one share each, at once),
    returning done() (the clear, outside the timing). TransferQueue only where ``tq`` is given. The
    consumers get the refit store clients once, here (a trainer rank holds its client from setup, as
    TransferQueue's consumers hold theirs from ``tq.init()``), then only each round's meta; ``per_call``
    adds each refit store again as ``<name> (store per call)``, whose client travels with every call."""
    samples = batch["ids"].shape[0]
    as_numpy = {k: v.numpy() for k, v in batch.items()}
    want = 2 * batch["ids"].numel()
    ray.get([c.attach.remote(stores) for c in consumers])

    def refit_run(name, s, passed):
        def run():
            meta = s.put(round_keys(counter, samples), batch, partition="bench")
            calls = [
                c.refit_with.remote(s, meta.select(sh)) if passed else c.refit.remote(name, meta.select(sh))
                for c, sh in zip(consumers, shares)
            ]
            assert sum(ray.get(calls)) == want
            return lambda: (s.clear(meta), s.settle())  # the background copy is not the next method's cost

        return run

    def ray_run():
        ref = ray.put(as_numpy)
        assert sum(ray.get([c.ray.remote([ref], s) for c, s in zip(consumers, shares)])) == want
        return lambda: None

    if tq is not None:
        from tensordict import TensorDict

        td = TensorDict(batch, batch_size=samples)

    def tq_run():
        keys = round_keys(counter, samples)
        tq.kv_batch_put(keys=keys, partition_id="bench", fields=td)
        assert sum(ray.get([c.tq_get.remote([keys[i] for i in s]) for c, s in zip(consumers, shares)])) == want
        return lambda: tq.kv_clear(keys=keys, partition_id="bench")

    methods = {f"ray numpy{suffix}": ray_run, **{f"{n}{suffix}": refit_run(n, s, False) for n, s in stores.items()}}
    if per_call:
        methods.update({f"{n} (store per call){suffix}": refit_run(n, s, True) for n, s in stores.items()})
    if tq is not None:
        methods[f"transferqueue{suffix}"] = tq_run
    return methods


def dp_shares(samples: int, seq: int, dp: int) -> list[list[int]]:
    """Each DP rank's rows: ``balanced_shards`` of long-tailed lengths (scattered rows)."""
    return [[i for mb in rank for i in mb] for rank in balanced_shards(long_tail(samples, seq), dp, 2 * seq)]


def run_dp(ray, tq, stores, batch, dp, iters, counter) -> list[dict]:
    samples, seq = batch["ids"].shape
    consumers = [make_dp_consumer(ray).remote() for _ in range(dp)]
    methods = dp_methods(ray, tq, stores, batch, consumers, dp_shares(samples, seq, dp), counter, f" dp{dp}")
    times: dict[str, list[float]] = {m: [] for m in methods}
    for fn in methods.values():
        fn()()
    for r in range(iters):
        for name in rotated(list(methods), r):
            fn = methods[name]
            t0 = time.perf_counter()
            done = fn()
            times[name].append(time.perf_counter() - t0)
            done()
    for c in consumers:
        ray.kill(c)
    return [timing_row(f"dp{dp}", m, v, nbytes(batch)) for m, v in times.items()]


def make_mpmc_actors(ray):
    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self) -> None:
            import transfer_queue as tq

            tq.init()
            self.tq = tq

        def run(self, mode, store, queue, tag, k, samples, seq, seed):
            from tensordict import TensorDict

            batch = make_batch(samples, seq, seed)
            as_numpy = {f: v.numpy() for f, v in batch.items()}
            td = TensorDict(batch, batch_size=samples)
            lat = []
            for b in range(k):
                keys = [f"{tag}/{b}/{i}" for i in range(samples)]
                t0 = time.perf_counter()
                if mode.startswith("refit"):
                    h = store.put(keys, batch, partition="mpmc")
                elif mode == "ray numpy":
                    h = [ray.put(as_numpy)]
                else:
                    self.tq.kv_batch_put(keys=keys, partition_id="mpmc", fields=td)
                    h = keys
                lat.append(time.perf_counter() - t0)
                queue.put(h)  # blocks while the queue holds --bound batches
            return lat

    @ray.remote(num_cpus=0)
    class Consumer:
        def __init__(self) -> None:
            import transfer_queue as tq

            tq.init()
            self.tq = tq

        def run(self, mode, store, queue, count):
            lat, moved, self.errors = [], 0, []
            for _ in range(count):
                h = queue.get()
                t0 = time.perf_counter()
                if mode.startswith("refit"):
                    try:
                        out = store.take(h, select_fields=FIELDS)  # get and clear: one call
                    except KeyError as e:  # counted and reported, never expected
                        self.errors.append(f"{e} (held now: {h.keys[0] in store.keys(h.partition)})")
                        continue
                elif mode == "ray numpy":
                    out = {f: torch.from_numpy(v) for f, v in ray.get(h[0]).items()}
                else:
                    out = self.tq.kv_batch_get(keys=h, partition_id="mpmc", select_fields=FIELDS)
                    out = {f: _as_dense(v, len(h)) for f, v in out.items()}
                lat.append(time.perf_counter() - t0)
                moved += sum(t.numel() * t.element_size() for t in out.values())
                del out
                if mode == "transferqueue":
                    self.tq.kv_clear(keys=h, partition_id="mpmc")
            return lat, moved, self.errors

    return Producer, Consumer


def warm_queue(ray, queue) -> None:
    """Pass one handle of every method's kind (a Ray reference, a key list, a ``BatchMeta``) through a new
    queue before it is timed, alike for every method: unpickling a ``BatchMeta`` makes the queue's actor
    import refit, and so torch (~2.7 s of CPU, once per process), which would otherwise fall inside the
    timed run of the refit methods (~20 ms of CPU per batch of 128)."""
    from refit.data import BatchMeta

    for handle in ([ray.put(0)], ["warm"], BatchMeta(keys=["warm"], partition="mpmc")):
        queue.put(handle)
        queue.get()


def run_mpmc(ray, stores, args, pids: list[int]) -> list[dict]:
    from ray.util.queue import Queue

    Producer, Consumer = make_mpmc_actors(ray)
    producers = [Producer.remote() for _ in range(args.producers)]
    consumers = [Consumer.remote() for _ in range(args.consumers)]
    total = args.producers * args.batches_per_producer
    if total % args.consumers:
        raise SystemExit(f"--producers x --batches-per-producer ({total}) must divide by --consumers")
    per_batch = args.mp_samples * args.mp_seq * 12
    rows = []
    for r in range(args.mp_rounds + 1):  # round 0 warms up
        print(f"mpmc round {r}", flush=True)
        for mode in ("ray numpy", *stores, "transferqueue"):
            s = stores.get(mode)
            queue = Queue(maxsize=args.bound, actor_options={"num_cpus": 0})
            warm_queue(ray, queue)
            with MemoryProbe(pids) as mem:
                t0 = time.perf_counter()
                cons = [c.run.remote(mode, s, queue, total // args.consumers) for c in consumers]
                prods = [
                    p.run.remote(
                        mode, s, queue, f"r{r}p{i}", args.batches_per_producer, args.mp_samples, args.mp_seq, i
                    )
                    for i, p in enumerate(producers)
                ]
                pending = cons + prods
                while pending:  # fail fast: a consumer that raised would leave producers blocked on the queue
                    done, pending = ray.wait(pending, num_returns=1, timeout=600)
                    if not done:
                        raise TimeoutError(f"mpmc {mode}: no progress in 600 s")
                    ray.get(done)
                put_lat = [x for lat in ray.get(prods) for x in lat]
                got = ray.get(cons)
                wall = time.perf_counter() - t0
            ray.kill(queue.actor)
            get_lat = [x for lat, _, _ in got for x in lat]
            errors = [e for _, _, errs in got for e in errs]
            if errors:
                print(f"mpmc {mode} round {r}: {len(errors)} failed gets, e.g. {errors[:2]}", flush=True)
            assert errors or sum(m for _, m, _ in got) == total * per_batch, mode
            if r == 0:
                continue
            rows.append(
                {
                    "part": "mpmc",
                    "method": mode,
                    "round": r,
                    "wall_s": wall,
                    "gbps": total * per_batch / wall / 1e9,
                    "batches_per_s": total / wall,
                    "put_p50_ms": 1e3 * pct(put_lat, 50),
                    "put_p99_ms": 1e3 * pct(put_lat, 99),
                    "get_p50_ms": 1e3 * pct(get_lat, 50),
                    "get_p99_ms": 1e3 * pct(get_lat, 99),
                    "peak_mem_mib": (mem.peak - mem.base) / 2**20,
                    "failed_gets": len(errors),
                }
            )
    for a in producers + consumers:
        ray.kill(a)
    return _median_rounds(rows)


def _median_rounds(rows: list[dict]) -> list[dict]:
    out = []
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        keys = [k for k in mine[0] if k not in ("part", "method", "round")]
        out.append(
            {
                "part": "mpmc",
                "method": m,
                "rounds": len(mine),
                **{k: statistics.median(r[k] for r in mine) for k in keys},
            }
        )
    return out


def _pid(actor) -> int:
    return os.getpid()


def ratios(rows: list[dict]) -> None:
    """Each row's median against the zero-copy numpy Ray row of its part (same run)."""
    for part in {r["part"] for r in rows}:
        mine = [r for r in rows if r["part"] == part]
        key = "wall_s" if part == "mpmc" else "median_ms"
        base = next(r for r in mine if r["method"].startswith("ray numpy") and "copy" not in r["method"])
        for r in mine:
            r["x_ray_numpy"] = r[key] / base[key]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--units", type=int, default=2, help="refit storage actors")
    ap.add_argument("--producers", type=int, default=16)
    ap.add_argument("--consumers", type=int, default=8)
    ap.add_argument("--batches-per-producer", type=int, default=8)
    ap.add_argument("--mp-samples", type=int, default=32)
    ap.add_argument("--mp-seq", type=int, default=2048)
    ap.add_argument("--bound", type=int, default=16, help="batches the mpmc queue holds at most")
    ap.add_argument("--mp-rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/cpu-dataplane-compare.json")
    args = ap.parse_args(argv)
    import ray
    import transfer_queue as tq

    from refit.data.ray_store import RayStore

    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=3 << 30)
    tq.init()  # SimpleStorage, its default backend
    stores = refit_stores(RayStore, args.units)
    pids = [pid for s in stores.values() for pid in ray.get([a.__ray_call__.remote(_pid) for a in s.actors])]
    from transfer_queue import interface as tqi

    tq_actors = [tqi._TQ_CONTROLLER, *tqi._TQ_STORAGE["SimpleStorage"].values()]
    pids += ray.get([a.__ray_call__.remote(_pid) for a in tq_actors])
    counter = iter(range(1 << 30))
    batch = make_batch(args.samples, args.seq)
    try:
        rows = run_put_get(put_get_methods(ray, tq, stores, batch, counter), batch, args.iters)
        rows += run_dp(ray, tq, stores, batch, args.dp, args.iters, counter)
        rows += run_mpmc(ray, stores, args, pids)
        leaked = [k for s in stores.values() for k in s.keys()]
        assert leaked == [] and sum(s.chunks() for s in stores.values()) == 0, f"refit leaked {len(leaked)} keys"
    finally:
        tq.close()
        ray.shutdown()
    ratios(rows)
    meta = {
        "command": "python -m bench.dataplane_compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "ray": ray.__version__,
        "transferqueue": getattr(tq, "__version__", "0.1.11"),
        "args": vars(args),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    for r in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    print(f"records written to {args.out}")


if __name__ == "__main__":
    main()
