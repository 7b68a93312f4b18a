"""What users run today, each as ``setup(ctx) -> run()`` so the harness times only ``run``.

``ctx`` is a ``Ctx``: this process's role, its source / destination tensors,
the groups, the plan. Methods that do not apply to a process return a no-op.
The harness calls ``setup`` on every process together (refit's methods build a
Peer: collective), then ``run()`` on every process once per iteration (warm-up
included), then, after a barrier, ``run.close()`` where it exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.layout import box_slices
from refit.plan import Plan
from refit.transfer import Peer


@dataclass
class Ctx:
    """One benchmark process's inputs, built once per scenario by the harness and passed to
    every method's ``setup``.

    ``rank``: the global process; ``src`` / ``dst``: its source shards / engine tensors (None
    when it has none); ``plan``: refit's plan for the scenario, the same on every process;
    ``nccl`` / ``nccl_ranks``: the group the broadcast methods and ``refit_nccl`` use, and its
    ranks (broadcasts go from ``nccl_ranks[0]``); ``trainer_nccl``: a NCCL group over the
    trainer ranks (``gather_then_slice``) or None; ``store``: the rendezvous store;
    ``config``: the bench's ``TransferConfig``. ``extra``: ``"round"`` (the method's index in
    the scenario: fresh session names), ``"prepare"`` (the FP8 quantizer, Peer's ``prepare``,
    or None) and, for ``refit_fanout``, ``"fanout"``.
    """

    rank: int
    device: torch.device
    plan: Plan  # refit's plan for this scenario (transport "auto")
    src: dict[str, torch.Tensor] | None  # this process's source shards
    dst: dict[str, torch.Tensor] | None  # this process's engine tensors
    nccl: Any  # NCCL group over the processes that own distinct GPUs, or None
    nccl_ranks: list[int]
    trainer_nccl: Any  # NCCL group over the trainer ranks (S3), or None
    store: Any
    config: TransferConfig
    extra: dict = field(default_factory=dict)


def refit_method(transport: str, **overrides) -> Callable[[Ctx], Callable[[], None]]:
    """refit's own path; ``overrides``: TransferConfig fields (e.g. ``checksums=True``)."""

    def setup(ctx: Ctx) -> Callable[[], None]:
        fields = {
            "num_buffers": ctx.config.num_buffers,
            "buffer_bytes": ctx.config.buffer_bytes,
            "transport": transport,
            "name": f"bench-{transport}-{ctx.extra.get('round', 0)}",
            "copy_streams": ctx.config.copy_streams,
            "cuda_graph": ctx.config.cuda_graph,
            "stages": ctx.config.stages,
            "deadline_s": ctx.config.deadline_s,
        }
        cfg = TransferConfig(**{**fields, **overrides})
        group = ctx.nccl if transport == "p2p" else None
        peer = Peer(
            ctx.plan.src_layout,
            ctx.plan.dst_layout,
            ctx.rank,
            src_tensors=ctx.src,
            dst_tensors=ctx.dst,
            procs=ctx.plan.procs,
            group=group,
            config=cfg,
            device=ctx.device,
            store=ctx.store,
            prepare=ctx.extra.get("prepare"),
        )
        return RefitRun(peer)

    return setup


def refit_fanout(ctx: Ctx) -> Callable[[], None]:
    """refit's fan-out waves (``refit.fanout``): replicas that hold the version become sources
    for the next wave; every link CUDA IPC where both ends share a host. Needs
    ``ctx.extra["fanout"] = (replica layout, processes of each replica, every process's device)``."""
    from refit.fanout import Fanout

    replica, replica_procs, devices = ctx.extra["fanout"]
    cfg = TransferConfig(
        num_buffers=ctx.config.num_buffers,
        buffer_bytes=ctx.config.buffer_bytes,
        transport="auto",
        name=f"bench-fanout-{ctx.extra.get('round', 0)}",
        copy_streams=ctx.config.copy_streams,
        cuda_graph=ctx.config.cuda_graph,
        deadline_s=ctx.config.deadline_s,
    )
    trainer_procs = list(ctx.plan.procs.src)
    tensors = ctx.src if ctx.src is not None else ctx.dst
    f = Fanout(
        ctx.plan.src_layout,
        replica,
        ctx.rank,
        trainer_procs,
        replica_procs,
        tensors,
        config=cfg,
        devices=devices,
        device=ctx.device,
        store=ctx.store,
    )
    state = {"version": 0}

    def run() -> None:
        state["version"] += 1
        f.run(state["version"])

    run.fanout = f  # type: ignore[attr-defined]
    run.close = f.close  # type: ignore[attr-defined]
    return run


class RefitRun:
    """One refit per call, with increasing versions; ``peer`` stays reachable for profiling."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.version = 0

    def __call__(self) -> None:
        self.version += 1
        self.peer.run(self.version)

    def close(self) -> None:
        self.peer.close()


def _names(ctx: Ctx) -> list[str]:
    return [t.name for t in ctx.plan.dst_layout]


def per_tensor_broadcast(ctx: Ctx) -> Callable[[], None]:
    """One NCCL broadcast of every full tensor from trainer rank 0 (S1)."""
    tensors = ctx.src if ctx.src is not None else ctx.dst
    order = [tensors[n] for n in _names(ctx)]

    def run() -> None:
        for t in order:
            dist.broadcast(t, src=ctx.nccl_ranks[0], group=ctx.nccl)

    return run


def packed_broadcast(num_buffers: int, total_bytes: int) -> Callable[[Ctx], Callable[[], None]]:
    """Pack tensors into ``num_buffers`` rotating buffers (on as many streams) and broadcast each (S1).

    A tensor larger than one buffer is broadcast on its own.
    """

    def setup(ctx: Ctx) -> Callable[[], None]:
        size = total_bytes // num_buffers
        is_src = ctx.src is not None
        tensors = ctx.src if is_src else ctx.dst
        buckets: list[list[tuple[str, int]]] = [[]]
        used = 0
        for n in _names(ctx):
            nb = tensors[n].numel() * tensors[n].element_size()
            if nb > size:
                buckets.append([(n, -1)])
                buckets.append([])
                used = 0
                continue
            if used + nb > size:
                buckets.append([])
                used = 0
            buckets[-1].append((n, used))
            used += (nb + 255) // 256 * 256
        buckets = [b for b in buckets if b]
        bufs = [torch.empty(size, dtype=torch.uint8, device=ctx.device) for _ in range(num_buffers)]
        streams = [torch.cuda.Stream(ctx.device) for _ in range(num_buffers)]
        main = torch.cuda.current_stream(ctx.device)

        def run() -> None:
            for s in streams:
                s.wait_stream(main)
            for i, bucket in enumerate(buckets):
                k = i % num_buffers
                with torch.cuda.stream(streams[k]):
                    if bucket[0][1] < 0:
                        dist.broadcast(tensors[bucket[0][0]], src=ctx.nccl_ranks[0], group=ctx.nccl)
                        continue
                    views = []
                    for n, off in bucket:
                        t = tensors[n]
                        views.append((bufs[k][off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape), t))
                    if is_src:
                        for bv, t in views:
                            bv.copy_(t)
                    end = bucket[-1][1] + tensors[bucket[-1][0]].numel() * tensors[bucket[-1][0]].element_size()
                    dist.broadcast(bufs[k][:end], src=ctx.nccl_ranks[0], group=ctx.nccl)
                    if not is_src:
                        for bv, t in views:
                            t.copy_(bv)
            for s in streams:
                main.wait_stream(s)

        return run

    return setup


def gather_then_slice(ctx: Ctx) -> Callable[[], None]:
    """S3: each trainer rank all-gathers every full tensor (FSDP ``full_tensor()``), then writes
    its colocated engine's TP slice into the engine's tensors (mapped through CUDA IPC)."""
    from refit.transport.ipc_handles import export_handles, import_handles

    plan = ctx.plan
    key = f"gts/{ctx.rank}"
    if ctx.dst is not None:
        export_handles(ctx.store, key, ctx.dst)
    if ctx.src is None:
        return lambda: None
    # the engine process on this GPU
    engine_proc = next(p for p in plan.procs.dst if p != ctx.rank and plan.procs.same_device(p, ctx.rank))
    engine_rank = plan.procs.dst.index(engine_proc)
    engine = import_handles(ctx.store, f"gts/{engine_proc}", 120)
    jobs = []
    world = dist.get_world_size(ctx.trainer_nccl)
    for t in plan.src_layout:
        shard = ctx.src[t.name]
        dbox = plan.dst_layout[t.name].box(engine_rank)
        jobs.append((shard, t.shape, world, engine[t.name], box_slices(dbox)))

    def run() -> None:
        for shard, shape, n, target, sl in jobs:
            full = torch.empty((shard.shape[0] * n, *shape[1:]), dtype=shard.dtype, device=ctx.device)
            dist.all_gather_into_tensor(full, shard, group=ctx.trainer_nccl)
            target.copy_(full[sl])

    return run
