"""Where the CPU of ``bench.dataplane_compare``'s 16 producers x 8 consumers run goes, per process kind.

    python -m bench.dataplane_mpmc_cpu [--rounds 1] [--cold-queue] [--out FILE]

Runs that bench's ``mpmc`` part (``run_mpmc``: every method, same arguments as its defaults) and, around each
method's timed run, reads the CPU time (user + system) of every Ray process of the node, grouped by what it
runs (``ray::Producer``, ``ray::Consumer``, ``ray::_QueueActor``, ``ray::_StorageActor``, TransferQueue's
actors, ``raylet``, ...); reported per batch (128 per run). ``--cold-queue``: skip ``warm_queue``, as the bench
did until stop 41 (each method's new queue actor then imports what unpickling its first handle needs inside
the timed run: refit, and torch with it, for a ``BatchMeta``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics

import bench.dataplane_compare as dc


def cpu_by_kind() -> dict[str, float]:
    """CPU seconds so far of this process and every Ray process of the node, by kind of process."""
    import psutil

    out: dict[str, float] = {}
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline()[:2])
            if not (p.pid == os.getpid() or "ray" in cmd or p.name() in ("raylet", "gcs_server")):
                continue
            kind = re.sub(r"\..*", "", cmd.split()[0]) if cmd.startswith("ray::") else p.name()
            t = p.cpu_times()
            out[kind] = out.get(kind, 0.0) + t.user + t.system
        except (psutil.Error, OSError, IndexError):
            continue
    return out


class _Probe(dc.MemoryProbe):
    """``MemoryProbe`` that also records the CPU by kind spent during its block."""

    spent: list[dict[str, float]] = []

    def __enter__(self):
        self._cpu0 = cpu_by_kind()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        after = cpu_by_kind()
        _Probe.spent.append({k: v - self._cpu0.get(k, 0.0) for k, v in after.items()})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cold-queue", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    import ray
    import transfer_queue as tq

    from refit.data.ray_store import RayStore

    ray.init(address="local", num_cpus=8, include_dashboard=False, object_store_memory=3 << 30, log_to_driver=False)
    tq.init()
    stores = dc.refit_stores(RayStore, 2)
    mp = argparse.Namespace(
        producers=16, consumers=8, batches_per_producer=8, mp_samples=32, mp_seq=2048, bound=16, mp_rounds=args.rounds
    )
    dc.MemoryProbe = _Probe
    if args.cold_queue:
        dc.warm_queue = lambda ray, queue: None
    try:
        rows = dc.run_mpmc(ray, stores, mp, [])
    finally:
        tq.close()
        ray.shutdown()
    modes = ["ray numpy", *stores, "transferqueue"]
    timed = _Probe.spent[len(modes) :]  # round 0 warms up
    batches = mp.producers * mp.batches_per_producer
    out = []
    for r in rows:
        runs = [s for i, s in enumerate(timed) if modes[i % len(modes)] == r["method"]]
        kinds = {k for s in runs for k in s}
        by_kind = {k: 1e3 * statistics.median(s.get(k, 0.0) for s in runs) / batches for k in kinds}
        total = 1e3 * statistics.median(sum(s.values()) for s in runs) / batches
        out.append({"method": r["method"], "wall_s": r["wall_s"], "cpu_ms_per_batch": total, "by_kind": by_kind})
        top = sorted(by_kind.items(), key=lambda kv: -kv[1])[:6]
        print(
            f"{r['method']:32s} wall {r['wall_s']:5.2f} s  cpu/batch {total:5.1f} ms  "
            + ", ".join(f"{k} {v:.1f}" for k, v in top)
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "load_avg": os.getloadavg(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
