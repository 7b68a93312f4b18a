"""One process of a fan-out across cluster hosts: ``python -m refit.tools.cluster.fanout_rank --src fsdp=2
--replicas 3 --modes relay,waves,broadcast``.

Started by ``Job`` (its environment names the rank, world and store). Processes ``0..n_src-1`` are trainer ranks of
``--src``, then one tp=1 replica per process. For each mode in ``--modes`` it runs ``--refits`` refits and times
each after a barrier:

* ``relay``: ``Fanout(relay=1)``, a chain (``refit.fanout_relay``);
* ``waves``: ``Fanout`` in doubling waves, the direct plan;
* ``broadcast``: the baseline, a packed gloo broadcast of the whole model from trainer rank 0 to every replica
  (rank 0 holds the model gathered beforehand, untimed).

Each replica checks it holds version ``v`` (reference weights of seed ``v``) bit for bit after every refit.
Reports ``{"rank", "host", "modes": {mode: {"exact": [...], "seconds": [...]}}}`` (``Job.wait``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.fanout import Fanout
from refit.layout import ModelLayout
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.tools.cluster.job import join_from_env, report
from refit.tools.verify import holds, reference_shards
from refit.transport.store import bind_address


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="refit.tools.cluster.fanout_rank")
    ap.add_argument("--src", default="fsdp=2")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--refits", type=int, default=3)
    ap.add_argument("--modes", default="relay,waves,broadcast")
    ap.add_argument("--chunk-bytes", type=int, default=None, help="the relay's chunk (default: the model / 64)")
    ap.add_argument("--deadline-s", type=float, default=120.0)
    ap.add_argument("--hosts", default="", help="each process's host, comma-separated")
    return ap.parse_args(argv)


def _replica_tensors(replica: ModelLayout) -> dict[str, torch.Tensor]:
    return {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in replica}


def _fanout(mode: str, a, rank: int, trainer: ModelLayout, replica: ModelLayout, store) -> tuple:
    n_src = trainer.world_size
    tensors = reference_shards(trainer, rank) if rank < n_src else _replica_tensors(replica)
    hosts = a.hosts.split(",") if a.hosts else []
    cfg = TransferConfig(name=f"fan-{mode}", deadline_s=a.deadline_s, preflight_timeout_s=300.0)
    f = Fanout(
        trainer,
        replica,
        rank,
        list(range(n_src)),
        [[n_src + j] for j in range(a.replicas)],
        tensors,
        store=store,
        config=cfg,
        devices=[f"{h}/cpu" for h in hosts] or None,
        relay=1 if mode == "relay" else 0,
        relay_chunk_bytes=a.chunk_bytes,
    )
    return f, tensors


def _broadcast_setup(rank: int, trainer: ModelLayout, replica: ModelLayout, n_src: int):
    """The baseline's group (trainer rank 0 and every replica) and this process's flat buffer and tensors."""
    group = dist.new_group([0, *range(n_src, dist.get_world_size())])
    if rank != 0 and rank < n_src:
        return group, None, None
    flat = torch.zeros(replica.nbytes // 4, dtype=torch.float32)  # float32 models only
    tensors, at = {}, 0
    for t in replica:
        tensors[t.name] = flat[at : at + t.numel].view(t.shape)
        at += t.numel
    return group, flat, tensors


def _run_mode(mode: str, a, rank: int, trainer: ModelLayout, replica: ModelLayout, store) -> dict:
    n_src = trainer.world_size
    if mode == "broadcast":
        group, flat, tensors = _broadcast_setup(rank, trainer, replica, n_src)
    else:
        f, tensors = _fanout(mode, a, rank, trainer, replica, store)
    exact, seconds = [], []
    for v in range(1, a.refits + 1):
        if rank < n_src and tensors is not None:  # the trainer's new weights (rank 0 of the baseline: all of them)
            ref = reference_shards(trainer if mode != "broadcast" else replica, rank if mode != "broadcast" else 0, v)
            for name, t in ref.items():
                tensors[name].copy_(t)
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "broadcast":
            if flat is not None:
                dist.broadcast(flat, src=0, group=group)
        else:
            f.run(v)
        seconds.append(time.perf_counter() - t0)
        exact.append(rank < n_src or holds(tensors, replica, 0, seed=v))
    if mode != "broadcast":
        f.close()
    return {"exact": exact, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    torch.set_num_threads(1)
    rank, world, store = join_from_env()
    shapes = param_shapes(a.model)
    trainer = layout_from_spec(shapes, parse_spec(a.src, "src"))
    replica = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    if trainer.world_size + a.replicas != world:
        raise ValueError(f"--src {a.src} and --replicas {a.replicas} need {trainer.world_size + a.replicas} processes")
    modes = {m: _run_mode(m, a, rank, trainer, replica, store) for m in a.modes.split(",")}
    report({"rank": rank, "host": bind_address(), "modes": modes})
    dist.destroy_process_group()  # process 0, the store's host, serves on at exit until the others leave


if __name__ == "__main__":
    main()
