"""One process of a refit across cluster hosts: ``python -m refit.tools.cluster.rank --src fsdp=2 --dst tp=1,dp=2``.

Started by ``Job`` (its environment names the rank, world and store). Processes ``0..n_src-1`` are trainer ranks
of ``--src``, the rest engine ranks of ``--dst``. Each refit ``v`` (1..``--refits``) the trainer ranks write the
reference weights of seed ``v`` into their tensors in place, every process times the same refit after a barrier,
and each engine rank checks its tensors hold that version bit for bit. With ``--sync DIR`` a process writes
``DIR/ready.<rank>`` once its Peer is built (every listener open), waits for ``DIR/go`` before the first refit,
writes ``DIR/done.<rank>`` after the last and waits for ``DIR/exit`` (files: the namespaces share the disk).
Reports ``{"rank", "host", "exact": [...], "seconds": [...], "bytes", "transports"}`` (``Job.wait``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.cluster.job import join_from_env, report
from refit.tools.verify import holds, reference_shards
from refit.transfer import Peer
from refit.transport.store import bind_address

SYNC_WAIT_S = 300.0


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="refit.tools.cluster.rank")
    ap.add_argument("--src", required=True)
    ap.add_argument("--dst", required=True)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--refits", type=int, default=3)
    ap.add_argument("--transport", default="p2p")
    ap.add_argument("--commit", default="in_place")
    ap.add_argument("--buffer-bytes", type=int, default=64 << 20)
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--hosts", default="", help="each process's host, comma-separated (for transport auto)")
    ap.add_argument("--sync", default=None, help="a directory for the ready/go/done/exit files")
    return ap.parse_args(argv)


def _await(path: Path, timeout_s: float = SYNC_WAIT_S) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.02)


def _peer(a: argparse.Namespace, rank: int, world: int, store) -> tuple[Peer, dict, object, object]:
    shapes = [(n, s, getattr(torch, a.dtype)) for n, s, _ in param_shapes(a.model)]
    src = layout_from_spec(shapes, parse_spec(a.src, "src"))
    dst = layout_from_spec(shapes, parse_spec(a.dst, "dst"))
    n_src = src.world_size
    if n_src + dst.world_size != world:
        raise ValueError(
            f"--src {a.src} and --dst {a.dst} need {n_src + dst.world_size} processes, the job has {world}"
        )
    hosts = a.hosts.split(",") if a.hosts else []
    devices = tuple(f"{h}/cpu" for h in hosts) if hosts else None
    procs = ProcessMap(tuple(range(n_src)), tuple(range(n_src, world)), devices)
    config = TransferConfig(
        transport=a.transport, commit=a.commit, buffer_bytes=a.buffer_bytes, deadline_s=a.deadline_s
    )
    if rank < n_src:
        tensors = reference_shards(src, rank, seed=0)
        peer = Peer(src, dst, rank, src_tensors=tensors, procs=procs, config=config, store=store)
    else:
        tensors = {
            t.name: torch.zeros(tuple(y - x for x, y in b), dtype=t.dtype) for t, b in dst.local_tensors(rank - n_src)
        }
        peer = Peer(src, dst, rank, dst_tensors=tensors, procs=procs, config=config, store=store)
    return peer, tensors, src, dst


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    torch.set_num_threads(1)
    rank, world, store = join_from_env()
    peer, tensors, src, dst = _peer(a, rank, world, store)
    n_src = src.world_size
    sync = Path(a.sync) if a.sync else None
    if sync:
        (sync / f"ready.{rank}").touch()
        _await(sync / "go")
    exact, seconds = [], []
    for v in range(1, a.refits + 1):
        if rank < n_src:
            for name, t in reference_shards(src, rank, seed=v).items():
                tensors[name].copy_(t)
        dist.barrier()
        t0 = time.perf_counter()
        peer.run(v)
        seconds.append(time.perf_counter() - t0)
        exact.append(True if rank < n_src else holds(tensors, dst, rank - n_src, seed=v))
    if sync:
        (sync / f"done.{rank}").touch()
        _await(sync / "exit")
    received = sum(t.numel() * t.element_size() for t in tensors.values()) if rank >= n_src else 0
    transports = sorted({m.transport for m in peer.plan.messages})
    report(
        {
            "rank": rank,
            "host": bind_address(),
            "exact": exact,
            "seconds": seconds,
            "bytes": received,
            "transports": transports,
        }
    )
    peer.close()
    dist.destroy_process_group()  # process 0, the store's host, serves on at exit until the others leave


if __name__ == "__main__":
    main()
