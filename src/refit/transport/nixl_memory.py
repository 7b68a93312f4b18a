"""Registered memory of NIXL links: the regions a process registers, the runs a piece is read in, and a
source's staging buffer.

``storage_regions``: the storages of the tensors a process's pieces live in, as ``[address, bytes,
device, memory type]`` (a source: every tensor a receiver reads, whole parameters, a view by its
storage; a receiver: every tensor it receives into); overlapping storages merged, and touching ones only
inside one allocation (host memory; on a GPU one segment of torch's caching allocator,
``cuda_segments``): UCX's ``cuda_ipc`` maps only the allocation a region starts in. ``memory_of``:
NIXL's memory type and device of a tensor.

Geometry (pure functions of shapes, strides and addresses): ``runs`` cuts a piece into the contiguous
runs common to its source and destination views (one READ descriptor each; trailing dimensions dense on
both sides merge), ``dense_strides``, ``span``.

Staging: a source packs the pieces whose runs in its tensors are short (``SourceStaging``: a column
slice of a row-sharded weight, runs under ``STAGE_RUN_BYTES``) into a registered staging buffer of
``num_buffers`` slots of ``buffer_bytes``, in rounds (round r into slot r % ``num_buffers``); receivers
read a staged piece as one descriptor. When each round is packed is the link's protocol
(``refit.transport.nixl``). Other pieces are read in place, one descriptor per run common to both
sides: one copy each for UCX, so strided ones are slow.

Uses torch, numpy and the plan (``refit.plan``, ``refit.binding``); no NIXL.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.config import PIECE_ALIGN
from refit.plan import Plan

STAGE_RUN_BYTES = 64 << 10  # a source piece whose runs are shorter than this is staged (packed) if it fits a slot


def memory_of(t: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device of ``t``'s memory: ``("VRAM", cuda index)`` or ``("DRAM", 0)``."""
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


def cuda_segments(device: int) -> list[tuple[int, int]]:
    """The caching allocator's segments on CUDA device ``device`` (one allocation each), as sorted
    ``(start, end)`` addresses; none with expandable segments (one of those maps several allocations)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        return []
    snap = torch.cuda.memory_snapshot()
    return sorted((g["address"], g["address"] + g["total_size"]) for g in snap if g["device"] == device)


def _allocation_of(mem: str, dev: int, segments: dict[int, list[tuple[int, int]]]):
    """``addr -> which allocation holds it`` on ``(mem, dev)``: host memory is one (CMA and shared memory
    read across touching storages), a GPU's are the caching allocator's ``segments[dev]`` (None outside
    them: memory torch did not allocate is never merged)."""
    if mem == "DRAM":
        return lambda addr: 0
    seg = segments.get(dev, [])
    starts = [lo for lo, _ in seg]

    def which(addr: int):
        i = bisect.bisect_right(starts, addr) - 1
        return i if i >= 0 and addr < seg[i][1] else None

    return which


def storage_regions(
    tensors: Sequence[torch.Tensor], segments: dict[int, list[tuple[int, int]]] | None = None
) -> list[list]:
    """The storages of ``tensors`` as ``[address, bytes, device, memory type]``: overlapping ones merged,
    and touching ones where one allocation holds both (``_allocation_of``; ``segments``: per CUDA device,
    its allocations, default ``cuda_segments``).

    Touching storages of two allocations stay apart: allocations can lie back to back in the address
    space, and a region across both breaks UCX's ``cuda_ipc`` (it maps the one allocation a region starts
    in, so a READ past its end fails with "cuMemcpyDtoDAsync ... invalid argument": 16 GB of Llama-3.1-8B
    on 2x H200). Merging within an allocation keeps the regions few (the record's size: a model of
    thousands of unfused tensors registers a few allocations, not one region per tensor)."""
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            spans.setdefault(memory_of(t), []).append((st.data_ptr(), st.data_ptr() + st.nbytes()))
    if segments is None:
        segments = {dev: cuda_segments(dev) for mem, dev in spans if mem == "VRAM"}
    out = []
    for (mem, dev), ranges in sorted(spans.items()):
        out += [[lo, hi - lo, dev, mem] for lo, hi in merge_ranges(ranges, _allocation_of(mem, dev, segments))]
    return out


def merge_ranges(ranges: list[tuple[int, int]], which) -> list[list[int]]:
    """``[start, end)`` ranges, sorted and merged where they overlap, or touch inside one allocation
    (``which(addr)``: the allocation holding ``addr``, None for unknown)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        last = merged[-1] if merged else None
        touch = last is not None and lo == last[1] and which(lo) is not None and which(lo) == which(last[0])
        if last is not None and (lo < last[1] or touch):
            last[1] = max(last[1], hi)
        else:
            merged.append([lo, hi])
    return merged


# ---------------------------------------------------------------------------- geometry
def runs(
    shape: Sequence[int], src: int, src_strides: Sequence[int], dst: int, dst_strides: Sequence[int], itemsize: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """The contiguous runs common to a source and a destination view of one ``shape`` (addresses in
    bytes, strides in elements, all >= 0): (source addresses, destination addresses, bytes per run),
    in row-major order. Trailing dimensions that are dense on both sides merge into one run."""
    if any(n == 0 for n in shape):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    dims = [(n, s, d) for n, s, d in zip(shape, src_strides, dst_strides) if n != 1]
    run, k = 1, len(dims)
    while k > 0 and dims[k - 1][1] == run and dims[k - 1][2] == run:
        run *= dims[k - 1][0]
        k -= 1
    s_addr, d_addr = np.array([src], np.int64), np.array([dst], np.int64)
    for n, s, d in dims[:k]:
        step = np.arange(n, dtype=np.int64)
        s_addr = (s_addr[:, None] + step * (s * itemsize)).reshape(-1)
        d_addr = (d_addr[:, None] + step * (d * itemsize)).reshape(-1)
    return s_addr, d_addr, run * itemsize


def dense_strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides (in elements) of a dense tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def span(shape: Sequence[int], addr: int, strides: Sequence[int], itemsize: int) -> tuple[int, int]:
    """The first byte and one past the last byte a view touches."""
    last = sum((n - 1) * s for n, s in zip(shape, strides))
    return addr, addr + (last + 1) * itemsize


# ---------------------------------------------------------------------------- source staging
class SourceStaging:
    """A source's staging buffer: the pieces it sends whose runs in its tensors are shorter than
    ``STAGE_RUN_BYTES`` (a column slice of a row-sharded weight) and that fit one slot, packed dense at
    ``PIECE_ALIGN``-ed offsets. Pieces go, the receivers' in turn and each receiver's in plan order, into
    rounds of at most ``slot_bytes`` (the config's ``buffer_bytes``, aligned down); round r is packed into
    slot r % ``slots`` (``num_buffers``), so the buffer never exceeds ``slots`` x ``slot_bytes`` however
    many bytes are staged. Longer pieces are read in
    place, one descriptor per run. Receivers read a staged piece as one descriptor.

    Lifecycle: built at setup (``offsets``: message index -> byte offset; ``round_of``: message index ->
    round); the first ``slots`` rounds are packed before a refit is announced, each later round r once
    every receiver has read round r - ``slots`` (``NixlLink``'s ``packed`` / ``consumed`` keys);
    registered with the source's other memory."""

    def __init__(
        self, plan: Plan, proc: int, local: LocalTensors, slot_bytes: int, slots: int, device: torch.device
    ) -> None:
        self.offsets: dict[int, int] = {}
        self.round_of: dict[int, int] = {}
        self.slots = slots
        stride = slot_bytes // PIECE_ALIGN * PIECE_ALIGN  # slots start aligned, all within the budget
        views: list[list[tuple[int, torch.Tensor]]] = []
        used = stride
        for i, v in self._candidates(plan, proc, local, stride):
            p = plan.messages[i].pieces[0]
            start = -(-used // PIECE_ALIGN) * PIECE_ALIGN
            if start + p.nbytes > stride:
                views.append([])
                start = 0
            r = len(views) - 1
            self.offsets[i], self.round_of[i], used = (r % slots) * stride + start, r, start + p.nbytes
            views[-1].append((self.offsets[i], v))
        full = min(len(views), slots) - 1  # slots filled before the last one used
        size = 0 if not views else full * stride + (used if len(views) <= slots else stride)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.rounds = [[(self._slot(o, v), v) for o, v in r] for r in views]

    @staticmethod
    def _candidates(plan: Plan, proc: int, local: LocalTensors, fits: int) -> list[tuple[int, torch.Tensor]]:
        """The messages this source stages (short runs, at most ``fits`` bytes) with their source views,
        the receivers' in turn (each round then serves every receiver: none waits for another to finish
        its part of the buffer)."""
        per: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for i, m in enumerate(plan.messages):
            if m.transport != "nixl" or plan.procs.src[m.src] != proc:
                continue
            p = m.pieces[0]
            v = local.src_view(p.tensor, p.box)
            run = runs(v.shape, 0, v.stride(), 0, dense_strides(v.shape), p.itemsize)[2]
            if run < min(STAGE_RUN_BYTES, p.nbytes) and p.nbytes <= fits:
                per.setdefault(plan.procs.dst[m.dst], []).append((i, v))
        lists = [per[r] for r in sorted(per)]
        return [x for group in itertools.zip_longest(*lists) for x in group if x is not None]

    def _slot(self, offset: int, v: torch.Tensor) -> torch.Tensor:
        return self.buffer[offset : offset + v.numel() * v.element_size()].view(v.dtype).view(v.shape)

    def pack(self, r: int) -> None:
        """Copy round ``r``'s pieces into their slot (the source's tensors are final)."""
        for dst, src in self.rounds[r]:
            dst.copy_(src)

    def address(self, index: int) -> int:
        """Where message ``index``'s staged piece lies."""
        return self.buffer.data_ptr() + self.offsets[index]
