"""The checksum of ``refit.transport.checksum`` as one Triton kernel over many pieces, optionally fused
with their copy; bit for bit equal to ``reference_sum``. The definition's constants come from
there, as the launch's ``constants`` (this module imports nothing of it, so it stays a leaf).

One launch covers a fixed table of pieces (built once, reused every refit): per piece its source
address, destination address (0: sum only), byte count, and how its logical words map to memory:
``row_words`` 8-byte words per row, ``src_pitch`` / ``dst_pitch`` words between rows (a 1-D run is
one endless row). A second table cuts every piece into chunks of ``BLOCK * STEPS`` words; one
program per chunk loads each word once (and stores it to the destination: the copy is the read the
checksum needs anyway), hashes it with its position and adds its chunk's total into ``out[slot]``
with one 64-bit atomic add (wrapping addition is order-free, so the result is deterministic). A
program's steps are unrolled and branch-free: whether it copies and whether rows are narrower than a
step (then a division per word finds the row) are per launch, one launch per kind present.

Addressable here: pieces whose rows are 8-byte aligned (base address, row width and pitches
multiples of 8 bytes), or 1-D runs at an 8-byte aligned address with any length (the tail bytes
are read one by one). Anything else goes to the torch path (``kernel_row`` returns None).
Measured on an H100 (``bench/checksum_kernels.py``: 3.93 GB in 81 Llama-shaped bf16 pieces, one launch):
the sum alone reads 2.5 TB/s in every shape tried, below the ~3 TB/s a read can reach: each word costs
three 64-bit multiplications and three 64-bit xor-shifts (several 32-bit instructions each), and the
pass is bound by issuing them. Fused with the copy: 3.71 ms with the default shape against 2.84 ms for
torch ``copy_`` of the same pieces; a first version whose steps were a loop (8 steps of 1024 words,
4 warps; per-step branches on row width and copy) took 2.89 ms, i.e. copy speed: the next shape to
try (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import os

import torch

from refit.transport.rows import row_copy, rows_of

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # noqa: BLE001 - no Triton (CPU-only installs): the torch path is used
    AVAILABLE = False

DENSE = 1 << 62  # row_words / pitch of a 1-D run: one row longer than any piece
BLOCK = 1024  # words a program handles per step
STEPS = 2  # steps per program, unrolled (a chunk: 16 KiB)
NUM_WARPS = 4


if AVAILABLE:

    @triton.jit
    def _mix(z, MUL1: tl.constexpr, MUL2: tl.constexpr):
        z = z ^ (z >> 30)
        z = z * MUL1
        z = z ^ (z >> 27)
        z = z * MUL2
        return z ^ (z >> 31)

    @triton.jit
    def _narrow_offsets(w, rw, pitch):
        """Word offsets of logical words ``w`` in rows of ``rw`` words, ``pitch`` apart (any ``rw``)."""
        r = w // rw
        return r * pitch + (w - r * rw)

    @triton.jit
    def _wide_offsets(r0, c, rw, pitch):
        """The same where a step starts at column ``c[0]`` of row ``r0`` and ``rw`` >= the step:
        it crosses at most one row end, so no division per word."""
        return r0 * pitch + c + tl.where(c >= rw, pitch - rw, 0)

    @triton.jit
    def _tail(
        src, dst, nbytes, n8, base, COPY: tl.constexpr, KEY: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr
    ):
        """The hashed last partial word (its bytes one by one; copied too)."""
        jb = tl.arange(0, 8)
        bm = jb < nbytes - n8 * 8
        b = tl.load((src + n8 * 8).to(tl.pointer_type(tl.uint8)) + jb, mask=bm, other=0)
        if COPY:
            tl.store((dst + n8 * 8).to(tl.pointer_type(tl.uint8)) + jb, b, mask=bm)
        word = tl.sum(b.to(tl.uint64) << (jb * 8).to(tl.uint64), axis=0)
        return _mix(word ^ ((n8 + base + 1).to(tl.uint64) * KEY), MUL1, MUL2)

    @triton.jit
    def _sum_kernel(
        meta_ptr,
        chunk_ptr,
        out_ptr,
        COPY: tl.constexpr,
        NARROW: tl.constexpr,
        BLOCK: tl.constexpr,
        STEPS: tl.constexpr,
        KEY: tl.constexpr,
        MUL1: tl.constexpr,
        MUL2: tl.constexpr,
        LEN_KEY: tl.constexpr,
    ):
        pid = tl.program_id(0)
        e = tl.load(chunk_ptr + 2 * pid)
        w0 = tl.load(chunk_ptr + 2 * pid + 1)
        m = meta_ptr + 8 * e
        src = tl.load(m)
        dst = tl.load(m + 1)
        nbytes = tl.load(m + 2)
        rw = tl.load(m + 3)
        sp = tl.load(m + 4)
        dp = tl.load(m + 5)
        base = tl.load(m + 6)
        slot = tl.load(m + 7)
        n8 = nbytes // 8
        sptr = src.to(tl.pointer_type(tl.int64))
        dptr = dst.to(tl.pointer_type(tl.int64))
        ar = tl.arange(0, BLOCK).to(tl.int64)
        ar_key = ar.to(tl.uint64) * KEY
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        r0 = w0 // rw  # wide rows: the row and column each step starts at, advanced without division
        c0 = w0 - r0 * rw
        for j in tl.static_range(STEPS):  # unrolled, no branches inside: all loads can be in flight at once
            s = w0 + j * BLOCK
            w = s + ar
            mask = w < n8
            if NARROW:
                x = tl.load(sptr + _narrow_offsets(w, rw, sp), mask=mask, other=0)
                if COPY:
                    tl.store(dptr + _narrow_offsets(w, rw, dp), x, mask=mask)
            else:
                c = c0 + ar
                x = tl.load(sptr + _wide_offsets(r0, c, rw, sp), mask=mask, other=0)
                if COPY:
                    tl.store(dptr + _wide_offsets(r0, c, rw, dp), x, mask=mask)
                c0 += BLOCK
                wrap = (c0 >= rw).to(tl.int64)
                c0 -= wrap * rw
                r0 += wrap
            key = (s + base + 1).to(tl.uint64) * KEY + ar_key
            acc += tl.where(mask, _mix(x.to(tl.uint64, bitcast=True) ^ key, MUL1, MUL2), 0)
        total = tl.sum(acc, axis=0)
        if w0 == 0:
            total += _mix(nbytes.to(tl.uint64) ^ LEN_KEY, MUL1, MUL2)
        if (nbytes > n8 * 8) & (n8 >= w0) & (n8 < w0 + BLOCK * STEPS):
            total += _tail(src, dst, nbytes, n8, base, COPY, KEY, MUL1, MUL2)
        tl.atomic_add(out_ptr + slot, total.to(tl.int64, bitcast=True))


def kernel_row(src: torch.Tensor, dst: torch.Tensor | None, base: int, slot: int) -> tuple[int, ...] | None:
    """The kernel's table row for summing ``src`` (and copying it into ``dst``): (src, dst or 0, nbytes,
    row_words, src_pitch, dst_pitch, base, slot) in bytes / 8-byte words, or None where the kernel
    cannot address it (the torch path then does)."""
    if dst is None:
        r = rows_of(src)
        spec = None if r is None else (r[0], r[1], r[2], r[2])
    else:
        spec = row_copy(dst, src)
        spec = None if spec is None else (spec[0], spec[1], spec[3], spec[2])
    if spec is None:
        return None
    rows, width, spitch, dpitch = spec
    ptrs = (src.data_ptr(), 0 if dst is None else dst.data_ptr())
    if any(a % 8 for a in ptrs):
        return None
    nbytes = rows * width
    if rows == 1 or (spitch == width and dpitch == width):
        return (*ptrs, nbytes, DENSE, DENSE, DENSE, base, slot)
    if width % 8 or spitch % 8 or dpitch % 8:
        return None
    return (*ptrs, nbytes, width // 8, spitch // 8, dpitch // 8, base, slot)


def tuning() -> tuple[int, int, int]:
    """(block, steps, warps): the defaults (the shape ``refit bench`` S2 was measured with, see
    docs/benchmarks.md), or ``REFIT_SUM_KERNEL=block,steps,warps`` (powers of two) to measure another
    shape of the same kernel (``bench/checksum_kernels.py`` compares some)."""
    env = os.environ.get("REFIT_SUM_KERNEL")
    if not env:
        return BLOCK, STEPS, NUM_WARPS
    vals = tuple(int(v) for v in env.split(","))
    if len(vals) != 3 or any(v < 1 or v & (v - 1) for v in vals):
        raise ValueError(f"REFIT_SUM_KERNEL must be block,steps,warps (powers of two), got {env!r}")
    return vals


class _Group:
    """The tables of one launch: pieces that all copy or all only sum, all wide or all narrow rows."""

    def __init__(self, rows: list[tuple[int, ...]], chunk: int, device: torch.device) -> None:
        meta = torch.tensor(rows, dtype=torch.int64).reshape(-1, 8)
        words = (meta[:, 2] + 7) // 8  # the tail counts as a word
        per = torch.clamp((words + chunk - 1) // chunk, min=1)
        entry = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64), per)
        first = torch.cumsum(per, 0) - per
        start = (torch.arange(entry.numel(), dtype=torch.int64) - first[entry]) * chunk
        self.meta = meta.to(device)
        self.chunks = torch.stack([entry, start], 1).contiguous().to(device)
        self.programs = entry.numel()


class SumLaunch:
    """The kernel launches over a fixed table of rows (``kernel_row``) on ``device``: one per kind of
    piece present (copy or sum only, x rows at least one step wide or narrower), usually one.

    ``constants``: the definition's (KEY, MUL1, MUL2, LEN_KEY); ``block`` / ``steps`` / ``num_warps``:
    ``tuning()`` unless given. ``launch(out)`` enqueues on the current stream and adds each piece's sum
    into ``out[slot]`` (the caller zeroes those slots first). The addresses in the table must stay valid."""

    def __init__(
        self,
        rows: list[tuple[int, ...]],
        device: torch.device,
        constants: tuple[int, int, int, int],
        block: int | None = None,
        steps: int | None = None,
        num_warps: int | None = None,
    ) -> None:
        tb, ts, tw = tuning()
        self.block, self.steps, self.num_warps = block or tb, steps or ts, num_warps or tw
        self.device, self.entries = torch.device(device), len(rows)
        self.constants = dict(zip(("KEY", "MUL1", "MUL2", "LEN_KEY"), constants))
        kinds: dict[tuple[bool, bool], list[tuple[int, ...]]] = {}
        for r in rows:
            kinds.setdefault((r[1] != 0, r[3] < self.block), []).append(r)
        self.groups = {k: _Group(rs, self.block * self.steps, self.device) for k, rs in sorted(kinds.items())}

    def launch(self, out: torch.Tensor) -> None:
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for (copy, narrow), g in self.groups.items():
                _sum_kernel[(g.programs,)](
                    g.meta,
                    g.chunks,
                    out,
                    COPY=copy,
                    NARROW=narrow,
                    BLOCK=self.block,
                    STEPS=self.steps,
                    num_warps=self.num_warps,
                    **self.constants,
                )
