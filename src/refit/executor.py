"""Runs one process's share of a Plan over torch.distributed point-to-point ops.

Setup (once): bind the plan's pieces to views of this process's local tensors,
allocate at most ``num_buffers`` staging buffers of ``buffer_bytes`` (only as
many as the busiest step needs), and precompute every step's ops.
Run (each refit): for each step, pack the outgoing buckets, post all sends and
receives of the step in one ``batch_isend_irecv``, wait, unpack. Direct pieces
(contiguous on both sides) go straight from the source tensor into the
destination tensor. Pieces whose source and destination share this process are
copied locally. Works with gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from refit.layout import Box, box_relative, box_shape, box_slices
from refit.plan import Plan, PlanError


@dataclass
class _Op:
    peer: int
    tag: int
    tensor: torch.Tensor  # what is sent or received into (a view or a buffer slice)
    pack: list[tuple[torch.Tensor, torch.Tensor]]  # (buffer view, tensor view): copy src->buf or buf->dst


@dataclass(frozen=True)
class RunStats:
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    seconds: float


def _check_local(side: str, rank: int, layout, tensors: Mapping[str, torch.Tensor]) -> dict[str, Box]:
    """Every tensor this rank holds exists with the layout's local shape and dtype."""
    boxes: dict[str, Box] = {}
    for t, box in layout.local_tensors(rank):
        if t.name not in tensors:
            raise PlanError(f"{side} rank {rank}: local tensor {t.name!r} is missing")
        x = tensors[t.name]
        if tuple(x.shape) != box_shape(box):
            raise PlanError(
                f"{side} rank {rank}: local tensor {t.name!r} has shape {list(x.shape)}, the layout expects {list(box_shape(box))}"
            )
        if x.dtype != t.dtype:
            raise PlanError(f"{side} rank {rank}: local tensor {t.name!r} has dtype {x.dtype}, the layout expects {t.dtype}")
        boxes[t.name] = box
    return boxes


class Executor:
    def __init__(
        self,
        plan: Plan,
        proc: int,
        *,
        src_tensors: Mapping[str, torch.Tensor] | None = None,
        dst_tensors: Mapping[str, torch.Tensor] | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.plan = plan
        self.proc = proc
        self.group = group
        self.device = torch.device(device)
        self.src_rank = plan.procs.src.index(proc) if proc in plan.procs.src else None
        self.dst_rank = plan.procs.dst.index(proc) if proc in plan.procs.dst else None
        src_boxes = (
            _check_local("source", self.src_rank, plan.src_layout, src_tensors or {}) if self.src_rank is not None else {}
        )
        dst_boxes = (
            _check_local("destination", self.dst_rank, plan.dst_layout, dst_tensors or {})
            if self.dst_rank is not None
            else {}
        )

        def src_view(name: str, box: Box) -> torch.Tensor:
            return src_tensors[name][box_slices(box_relative(box, src_boxes[name]))]

        def dst_view(name: str, box: Box) -> torch.Tensor:
            return dst_tensors[name][box_slices(box_relative(box, dst_boxes[name]))]

        sends = [m for m in plan.sends_of(proc)]
        recvs = [m for m in plan.recvs_of(proc)]
        # staging buffers: slot k of a step -> buffer k
        slots_per_step: dict[int, int] = defaultdict(int)
        for m in sends + recvs:
            if not m.direct:
                slots_per_step[m.step] += 1
        n_buf = max(slots_per_step.values(), default=0)
        if n_buf > plan.num_buffers:
            raise PlanError(f"process {proc}: a step needs {n_buf} buffers, budget is {plan.num_buffers}")
        buf_len = max((m.nbytes for m in sends + recvs if not m.direct), default=0)
        self.buffers = [torch.empty(buf_len, dtype=torch.uint8, device=self.device) for _ in range(n_buf)]
        self.staging_bytes = n_buf * buf_len

        # per step: (send ops, recv ops); tags number the messages of one link within a step
        self.steps: list[tuple[list[_Op], list[_Op]]] = [([], []) for _ in range(plan.num_steps)]
        used: dict[int, int] = defaultdict(int)
        tag_of: dict[tuple[int, int, int], int] = defaultdict(int)

        def global_rank(p: int) -> int:
            return p if group is None else dist.get_global_rank(group, p)

        for is_send, msgs in ((True, sends), (False, recvs)):
            for m in msgs:
                peer = plan.procs.dst[m.dst] if is_send else plan.procs.src[m.src]
                key = (m.step, m.src, m.dst)
                tag = tag_of[key]
                tag_of[key] += 1
                view = src_view if is_send else dst_view
                if m.direct:
                    p = m.pieces[0]
                    op = _Op(global_rank(peer), tag, view(p.tensor, p.box), [])
                else:
                    buf = self.buffers[used[m.step]]
                    used[m.step] += 1
                    pack = []
                    for p, off in zip(m.pieces, m.offsets):
                        tv = view(p.tensor, p.box)
                        bv = buf[off : off + p.nbytes].view(tv.dtype).view(tv.shape)
                        pack.append((bv, tv))
                    op = _Op(global_rank(peer), tag, buf[: m.nbytes], pack)
                self.steps[m.step][0 if is_send else 1].append(op)
        self.local = [
            (dst_view(p.tensor, p.box), src_view(p.tensor, p.box)) for p in plan.local_of(proc)
        ]
        self.bytes_sent = sum(sum(p.nbytes for p in m.pieces) for m in sends)
        self.bytes_received = sum(sum(p.nbytes for p in m.pieces) for m in recvs)
        self.bytes_local = sum(p.nbytes for p in plan.local_of(proc))

    def run(self) -> RunStats:
        import time

        t0 = time.perf_counter()
        for dst, src in self.local:
            dst.copy_(src)
        for send_ops, recv_ops in self.steps:
            if not send_ops and not recv_ops:
                continue
            for op in send_ops:
                for bv, tv in op.pack:
                    bv.copy_(tv)
            p2p = [dist.P2POp(dist.isend, op.tensor, op.peer, self.group, op.tag) for op in send_ops]
            p2p += [dist.P2POp(dist.irecv, op.tensor, op.peer, self.group, op.tag) for op in recv_ops]
            for w in dist.batch_isend_irecv(p2p):
                w.wait()
            for op in recv_ops:
                for bv, tv in op.pack:
                    tv.copy_(bv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return RunStats(self.bytes_sent, self.bytes_received, self.bytes_local, time.perf_counter() - t0)
