"""The floor each method's time is divided by: the plan's bytes moved as a few large copies (per link, all
at once, or one engine's bytes over one link), and on S1 an NCCL send of the same bytes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from refit.layout import box_numel

from . import methods as M
from .scenarios import Scenario

FLOOR_CHUNK = 8 << 30  # the floor's copies go through buffers of at most this size


def floor_setup(ctx: M.Ctx, scen: Scenario) -> dict[str, Callable[[], None]]:
    """Single large copies of the plan's per-link byte counts; returns named variants."""
    plan = ctx.plan
    dev = ctx.device
    if ctx.src is None:  # engines idle; the trainer processes make the copies
        return {}
    if dev.type == "cpu":
        n = plan.bytes_moved // max(1, len(plan.procs.src))
        a, b = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        return {"memcpy": lambda: b.copy_(a)}
    same = 0
    peer: dict[torch.device, int] = {}  # destination GPU -> bytes this process sends there
    for m in plan.messages:
        if plan.procs.src[m.src] != ctx.rank:
            continue
        nbytes = sum(p.nbytes for p in m.pieces)
        if plan.procs.same_device(ctx.rank, plan.procs.dst[m.dst]):
            same += nbytes
        else:
            other = torch.device(plan.procs.device_of(plan.procs.dst[m.dst]))
            peer[other] = peer.get(other, 0) + nbytes
    if scen.floor == "one_link":
        # the largest per-link byte count of an ideal fan-out (every engine's bytes cross one link
        # once): one engine's share over one link
        biggest = max(
            sum(box_numel(b) * t.itemsize for t in plan.dst_layout if (b := t.box(r)) is not None)
            for r in range(len(plan.procs.dst))
        )
        first = torch.device(plan.procs.device_of(plan.procs.dst[0]))
        peer, same = ({first: biggest} if ctx.rank == plan.procs.src[0] else {}), 0
    out = {}
    # n bytes as copies of at most FLOOR_CHUNK bytes through one buffer pair (the same bytes cross the
    # link; a 60 GB model's floor then needs no second and third copy of the model)
    peer_bufs = [
        (
            n,
            torch.empty(min(n, FLOOR_CHUNK), dtype=torch.uint8, device=dev),
            torch.empty(min(n, FLOOR_CHUNK), dtype=torch.uint8, device=d),
        )
        for d, n in sorted(peer.items(), key=str)
    ]
    if same:
        ls = torch.empty(min(same, FLOOR_CHUNK), dtype=torch.uint8, device=dev)
        ld = torch.empty(min(same, FLOOR_CHUNK), dtype=torch.uint8, device=dev)
    streams = [torch.cuda.Stream(dev) for _ in range(len(peer_bufs) + 1)]
    main = torch.cuda.current_stream(dev)

    def chunked(n: int, a: torch.Tensor, b: torch.Tensor) -> None:
        for off in range(0, n, FLOOR_CHUNK):
            m = min(FLOOR_CHUNK, n - off)
            b[:m].copy_(a[:m], non_blocking=True)

    def copies() -> None:
        for st in streams:
            st.wait_stream(main)
        for st, (n, src_buf, dst_buf) in zip(streams, peer_bufs):
            with torch.cuda.stream(st):
                chunked(n, src_buf, dst_buf)
        if same:
            with torch.cuda.stream(streams[-1]):
                chunked(same, ls, ld)
        for st in streams:
            main.wait_stream(st)

    out["copy"] = copies
    if scen.name == "S1" and ctx.nccl is not None:
        n, buf = peer_bufs[0][0], peer_bufs[0][1]

        def nccl_send() -> None:
            for off in range(0, n, FLOOR_CHUNK):
                dist.send(buf[: min(FLOOR_CHUNK, n - off)], dst=1, group=ctx.nccl)

        out["nccl_send"] = nccl_send
    return out


def engine_floor(ctx: M.Ctx, scen: Scenario) -> dict[str, Callable[[], None]]:
    if ctx.dst is None or scen.name != "S1" or ctx.nccl is None or ctx.device.type != "cuda":
        return {}
    n = ctx.plan.bytes_moved
    buf = torch.empty(min(n, FLOOR_CHUNK), dtype=torch.uint8, device=ctx.device)

    def nccl_recv() -> None:
        for off in range(0, n, FLOOR_CHUNK):
            dist.recv(buf[: min(FLOOR_CHUNK, n - off)], src=0, group=ctx.nccl)

    return {"copy": lambda: None, "nccl_send": nccl_recv}
