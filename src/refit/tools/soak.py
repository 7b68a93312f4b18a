"""``refit soak``: many consecutive refits; resident memory, threads and process groups must not grow.

Each process holds one Peer and runs ``refits`` refits with a new version
each (the trainer changes its weights in place before each). After
``warmup`` refits it records its resident set size (``/proc/self/statm``),
its thread count and the number of process groups torch.distributed knows;
after the last refit again. The last refit's weights are checked bit for bit.
After ``Peer.close()`` no refit thread may be left.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout import ModelLayout
from refit.plan import ProcessMap
from refit.tools.launch import World, run_local
from refit.tools.resources import check_memory, held_bytes
from refit.tools.verify import holds, reference_shards
from refit.transfer import Peer


def rss_bytes() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _process_groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


@dataclass(frozen=True)
class SoakResult:
    """What ``soak`` measured: one row per process, by process rank.

    A row: ``role``, ``rank``; ``rss_*`` (bytes), ``threads_*`` and ``groups_*`` (process
    groups) after ``warmup`` refits (``_warm``) and after the last (``_end``); ``seconds``;
    ``exact``: whether the engine's final weights are right bit for bit (None on a trainer);
    ``refit_threads_closed``: names of ``refit*`` threads still alive once ``Peer.close()`` returned.
    ``ok``: resident memory grew by at most 5% on every process, no thread or process-group
    count changed, no engine's weights differ, and no refit thread outlived ``close``.
    """

    refits: int
    warmup: int
    rows: list[dict]  # per process: rss/threads/groups after warm-up and at the end, exact, seconds

    @property
    def worst_rss_growth(self) -> float:
        return max(r["rss_end"] / r["rss_warm"] - 1 for r in self.rows)

    @property
    def ok(self) -> bool:
        return (
            self.worst_rss_growth <= 0.05
            and all(r["threads_end"] == r["threads_warm"] for r in self.rows)
            and all(r["groups_end"] == r["groups_warm"] for r in self.rows)
            and all(r["exact"] is not False for r in self.rows)
            and not any(r["refit_threads_closed"] for r in self.rows)
        )


def _worker(world: World, src: ModelLayout, dst: ModelLayout, config: TransferConfig, refits: int, warmup: int):
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    is_src = world.src_rank is not None
    rank = world.src_rank if is_src else world.dst_rank
    layout = src if is_src else dst
    tensors = reference_shards(layout, rank)
    kw = {"src_tensors": tensors} if is_src else {"dst_tensors": tensors}
    peer = Peer(src, dst, world.rank, procs=procs, config=config, **kw)
    row = {"role": "trainer" if is_src else "engine", "rank": rank}
    t0 = time.perf_counter()
    for v in range(1, refits + 1):
        if is_src:  # new weights each step, in place (a cheap change: scale by a power of two)
            for t in tensors.values():
                t.mul_(2.0 if v % 2 else 0.5)
        peer.run(v)
        if v == warmup:
            row.update(rss_warm=rss_bytes(), threads_warm=threading.active_count(), groups_warm=_process_groups())
    row.update(
        rss_end=rss_bytes(),
        threads_end=threading.active_count(),
        groups_end=_process_groups(),
        seconds=time.perf_counter() - t0,
    )
    factor = 2.0 if refits % 2 else 1.0  # the product of the scalings after `refits` steps
    row["exact"] = None if is_src else holds(tensors, dst, rank, scale=factor)
    peer.close()
    # the job's store (``refit-store*`` threads, hosted by process 0) belongs to the launcher, which keeps it until
    # every result is in: not the Peer's
    row["refit_threads_closed"] = [
        t.name for t in threading.enumerate() if t.name.startswith("refit") and not t.name.startswith("refit-store")
    ]
    return row


def soak(
    src: ModelLayout, dst: ModelLayout, refits: int = 200, warmup: int = 20, config: TransferConfig = TransferConfig()
) -> SoakResult:
    """``refits`` refits from ``src`` to ``dst``, one process per rank on this machine (gloo),
    measured after ``warmup`` and at the end; ``ConfigError`` unless ``1 <= warmup < refits`` and the
    shards of both sides fit in this machine's memory."""
    if not 1 <= warmup < refits:
        raise ConfigError(f"need 1 <= warmup < refits, got warmup={warmup}, refits={refits}")
    n = src.world_size + dst.world_size
    check_memory(held_bytes(src) + held_bytes(dst), f"soak on {n} processes")
    rows = run_local(
        _worker,
        src.world_size,
        dst.world_size,
        src,
        dst,
        config,
        refits,
        warmup,
        backend="gloo",
        timeout_s=600 + refits,
    )
    return SoakResult(refits, warmup, rows)


__all__ = ["soak", "SoakResult", "rss_bytes"]
