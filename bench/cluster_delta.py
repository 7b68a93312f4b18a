"""NIXL dense against NIXL deltas across namespace hosts (needs root and iproute2).

    .venv/bin/python -m bench.cluster_delta --rate 1gbit --fractions 0.001,0.01,1 --refits 5

Two hosts, each link shaped to ``--rate`` both ways: trainer ``--src`` (default fsdp=2) on host a, one tp=1 engine
on host b, the Llama-shaped model of ``bench.cluster_dense`` (``--layers``: 4 is 44 MB in bf16, each layer 6.8 MB
more, 49 is 351 MB) in ``--dtype`` (default bf16). Two
Peers over the same tensors of the trainer, both ``transport="nixl"``: one dense (``delta="off"``), one with
``delta="auto"`` weighing the link at ``--rate`` (``delta_link_gbps``). Version 1 warms both up (dense); then per
fraction ``--refits`` versions, each changing that fraction of every tensor's elements (the lowest bit flipped),
each moved by the dense Peer and then by the delta Peer. A refit's time is the slowest process's (every process
starts it after a barrier and, once done, waits at another before the bench's own work), its CPU time the sum of
every process's (``time.process_time``: what a loaded machine inflates least); its bytes on the wire are what
host b's NIC received during it (``/sys/class/net`` inside the namespace: payload, TCP/IP headers, the store's
records); each engine copy is checked bit for bit against the version after every refit. Prints one JSON object:
per fraction the medians and ratios delta / dense (``--out`` also writes it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from bench.cluster_dense import llama_config

MODES = ("dense", "delta")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--fractions", default="0.001,0.01,1", help="comma-separated changed fractions")
    ap.add_argument("--src", default="fsdp=2")
    ap.add_argument("--refits", type=int, default=5, help="versions per fraction")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-buffers", type=int, default=2, help="requests in flight per receiver (and staging rounds)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="a folder: each process's cProfile of its delta refits")
    ap.add_argument("--rank", action="store_true", help="(internal) run as one process of the job")
    ap.add_argument("--model", default=None, help="(internal) the model's config.json")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------- one process
class Versions:
    """The trainer's full tensors version by version, the same in every process: version 1 the reference values,
    each later one with ``fraction`` of every tensor's elements (drawn with repeats) changed in its lowest bit."""

    def __init__(self, layout) -> None:
        from refit.tools.verify import reference_tensor

        self.full = {t.name: reference_tensor(t.name, t.shape, t.dtype) for t in layout}
        self.version = 1

    def step(self, fraction: float) -> None:
        self.version += 1
        for name, t in self.full.items():
            bits = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
            if fraction >= 1:
                bits ^= 1
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{self.version}".encode()))
            bits[torch.randint(bits.numel(), (round(fraction * bits.numel()),), generator=gen).unique()] ^= 1

    def shards(self, layout, rank: int) -> dict[str, torch.Tensor]:
        from refit.layout import box_slices

        return {t.name: self.full[t.name][box_slices(b)] for t, b in layout.local_tensors(rank)}


def _rx_bytes() -> int:
    """Bytes this host's NIC received so far (every interface of the namespace but loopback)."""
    nets = [n for n in os.listdir("/sys/class/net") if n != "lo"]
    return sum(int(Path(f"/sys/class/net/{n}/statistics/rx_bytes").read_text()) for n in nets)


def _peers(a: argparse.Namespace, rank: int, store, model: Versions, src, dst, rate_gbps: float) -> dict:
    from refit.config import TransferConfig
    from refit.plan import ProcessMap
    from refit.transfer import Peer

    n_src = src.world_size
    procs = ProcessMap(tuple(range(n_src)), (n_src,), tuple(["a/cpu"] * n_src + ["b/cpu"]))
    base = dict(transport="nixl", num_buffers=a.num_buffers, deadline_s=300.0, preflight_timeout_s=300.0)
    configs = {
        "dense": TransferConfig(name="dense", **base),
        "delta": TransferConfig(name="delta", delta="auto", delta_link_gbps=rate_gbps, **base),
    }
    if rank < n_src:
        tensors = {n: t.clone() for n, t in model.shards(src, rank).items()}
        return {"tensors": tensors} | {
            m: Peer(src, dst, rank, src_tensors=tensors, procs=procs, config=c, store=store) for m, c in configs.items()
        }
    out = {}
    for m, c in configs.items():
        tensors = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in dst}
        out[m] = Peer(src, dst, rank, dst_tensors=tensors, procs=procs, config=c, store=store)
        out[f"{m}-tensors"] = tensors
    return out


def _refit(peers: dict, mode: str, v: int, rank: int, n_src: int, model: Versions, dst, prof=None) -> dict:
    import torch.distributed as dist

    dist.barrier()
    rx, t0, c0 = _rx_bytes(), time.perf_counter(), time.process_time()
    if prof is not None:
        prof.enable()
    st = peers[mode].run(v)
    row = {"s": time.perf_counter() - t0, "cpu": time.process_time() - c0}
    if prof is not None:
        prof.disable()
    dist.barrier()  # every process done with the refit before any does the bench's own work (the checks below,
    # the next version): the namespace hosts share this machine's cores, a host's work would slow another's refit
    if rank == 0:  # the encodings trainer rank 0 chose
        row["encodings"] = dict(st.delta.encodings) if st.delta is not None else {}
    if rank >= n_src:
        got = peers[f"{mode}-tensors"]
        want = model.shards(dst, 0)
        row["exact"] = all(
            torch.equal(got[n].view(-1).view(torch.uint8), w.view(-1).view(torch.uint8)) for n, w in want.items()
        )
        row["wire"] = _rx_bytes() - rx
        row["read"] = st.bytes_received
    return row


def rank_main(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    from refit.layout.models import param_shapes
    from refit.layout.rules import layout_from_spec
    from refit.layout.spec import parse_spec
    from refit.tools.cluster import parse_rate
    from refit.tools.cluster.job import join_from_env, report

    torch.set_num_threads(1)
    rank, world, store = join_from_env()
    shapes = [(n, s, getattr(torch, a.dtype)) for n, s, _ in param_shapes(a.model)]
    src = layout_from_spec(shapes, parse_spec(a.src, "src"))
    dst = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    n_src = src.world_size
    model = Versions(src)
    peers = _peers(a, rank, store, model, src, dst, parse_rate(a.rate) / 8e9)
    rows: dict[str, list] = {}
    fractions = [None] + [float(f) for f in a.fractions.split(",") for _ in range(a.refits)]
    profs: dict = {}
    for v, f in enumerate(fractions, 1):
        if f is not None:
            model.step(f)
            if rank < n_src:
                for n, t in model.shards(src, rank).items():
                    peers["tensors"][n].copy_(t)
        for mode in MODES:
            prof = profs.setdefault(f, cProfile.Profile()) if a.profile and mode == "delta" and f else None
            rows.setdefault(f"{f}/{mode}", []).append(_refit(peers, mode, v, rank, n_src, model, dst, prof))
    for f, prof in profs.items():
        prof.dump_stats(str(Path(a.profile) / f"rank{rank}-{f}.prof"))
    for mode in MODES:
        peers[mode].close()
    report({"rank": rank, "rows": rows})
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- the driver
def run(a: argparse.Namespace, config: str) -> dict:
    from refit.layout.models import param_shapes
    from refit.tools.cluster import Cluster, LinkShape, parse_rate
    from refit.tools.cluster.job import Job

    itemsize = getattr(torch, a.dtype).itemsize
    model_bytes = sum(math.prod(s) * itemsize for _, s, _ in param_shapes(config))
    n_src = math.prod(int(kv.split("=")[1]) for kv in a.src.split(","))
    placement = ["a"] * n_src + ["b"]
    argv = [sys.executable, "-m", "bench.cluster_delta", "--rank", "--model", config]
    argv += ["--rate", a.rate, "--fractions", a.fractions, "--src", a.src, "--refits", str(a.refits)]
    argv += ["--dtype", a.dtype, "--num-buffers", str(a.num_buffers)]
    if a.profile:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        argv += ["--profile", str(Path(a.profile).resolve())]
    rate_bit = parse_rate(a.rate)
    started, load = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()[0]
    with Cluster(["a", "b"], LinkShape(rate_bit)) as cluster:
        results = Job(cluster, placement, argv).wait(3600)
    engine = results[-1]["rows"]
    out = {"date": started, "load_at_start": round(load, 2), "load_at_end": round(os.getloadavg()[0], 2)}
    out |= {"rate": a.rate, "src": a.src, "dtype": a.dtype, "layers": a.layers, "model_bytes": model_bytes}
    out["refits"] = a.refits
    out["num_buffers"] = a.num_buffers
    out["copy_s"] = round(model_bytes / (rate_bit / 8), 4)
    for f in a.fractions.split(","):
        key = str(float(f))
        row = {}
        for mode in MODES:
            name = f"{key}/{mode}"
            exact = [r["exact"] for r in engine[name]]
            if not all(exact):
                raise SystemExit(f"{name}: a refit was not exact: {exact}")
            secs = [max(r[name][i]["s"] for r in (x["rows"] for x in results)) for i in range(a.refits)]
            cpu = [sum(r[name][i]["cpu"] for r in (x["rows"] for x in results)) for i in range(a.refits)]
            row[mode] = {
                "refit_s": [round(t, 4) for t in secs],
                "median_s": round(statistics.median(secs), 4),
                "median_cpu_s": round(statistics.median(cpu), 4),
                "wire_bytes": int(statistics.median(r["wire"] for r in engine[name])),
                "read_bytes": int(statistics.median(r["read"] for r in engine[name])),
                "encodings": results[0]["rows"][name][-1]["encodings"],
            }
        row["time_ratio"] = round(row["delta"]["median_s"] / row["dense"]["median_s"], 4)
        row["wire_ratio"] = round(row["delta"]["wire_bytes"] / row["dense"]["wire_bytes"], 4)
        out[key] = row
    return out


def main() -> None:
    a = _args()
    if a.rank:
        rank_main(a)
        return
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "config.json"
        config.write_text(json.dumps(llama_config(a.layers)))
        row = run(a, str(config))
    print(json.dumps(row))
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
