"""The checksum of ``refit.transport.checksum`` as one Triton kernel over many pieces, optionally fused
with their copy; bit for bit equal to ``reference_sum``. The definition's constants come from
there, as the launch's ``constants`` (this module imports nothing of it, so it stays a leaf).

One launch covers a fixed table of pieces (built once, reused every refit): per piece its source
address, destination address (0: sum only), byte count, and how its logical words map to memory:
``row_words`` 8-byte words per row, ``src_pitch`` / ``dst_pitch`` words between rows (a 1-D run is
one endless row). A second table cuts every piece into chunks of ``BLOCK * STEPS`` words; one
program per chunk loads each word once (and stores it to the destination: the copy is the read the
checksum needs anyway), hashes it with its position and adds its chunk's total into ``out[slot]``
with one 64-bit atomic add (wrapping addition is order-free, so the result is deterministic). Per
launch (one per kind present): whether it copies, and how rows are addressed (1-D runs: a base
pointer per step and 32-bit offsets; rows at least a step wide; narrower rows, a division per word).
A chunk wholly inside its piece runs unmasked; the steps are a loop (or unrolled: ``LOOP``).

Addressable here: pieces whose rows are 8-byte aligned (base address, row width and pitches
multiples of 8 bytes), or 1-D runs at an 8-byte aligned address with any length (the tail bytes
are read one by one). Anything else goes to the torch path (``kernel_row`` returns None).
Measured on an H100 (``bench/checksum_kernels.py``: 3.93 GB in 81 Llama-shaped bf16 pieces, one launch;
docs/benchmarks.md, "Checksum kernel, second pass"): the sum alone reads ~3 TB/s, the fused copy and sum
takes 2.68 ms against 2.84 ms for torch ``copy_`` of the same pieces. Most of the gain over the first
version (2.5 TB/s, 3.71 ms) came from the unmasked full chunks and the 1-D addressing, not the shape.
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
STEPS = 16  # steps per program (a chunk: 128 KiB)
NUM_WARPS = 4
LOOP = True  # the steps are a loop (not unrolled)


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
    def _step(
        acc,
        sptr,
        dptr,
        s,
        r0,
        c0,
        rw,
        sp,
        dp,
        n8,
        kbase,
        ar,
        ar_key,
        COPY: tl.constexpr,
        ROWS: tl.constexpr,
        MASKED: tl.constexpr,
        BLOCK: tl.constexpr,
        KEY: tl.constexpr,
        MUL1: tl.constexpr,
        MUL2: tl.constexpr,
    ):
        """One step: the ``BLOCK`` logical words from ``s`` loaded (and copied), hashed and added into ``acc``.
        ``ROWS``: 0 a 1-D run (offset = word), 1 rows at least a step wide (``r0``/``c0``: the row and column
        the step starts at, advanced here without division), 2 narrower rows (a division per word).
        ``MASKED``: words past ``n8`` are skipped (only a piece's last chunk needs it)."""
        sq, dq = sptr, dptr
        if ROWS == 0:  # the step's base pointers, then 32-bit offsets
            sq, dq = sptr + s, dptr + s
            so, do = ar, ar
        elif ROWS == 1:
            c = c0 + ar
            so = _wide_offsets(r0, c, rw, sp)
            do = _wide_offsets(r0, c, rw, dp)
            c0 += BLOCK
            wrap = (c0 >= rw).to(tl.int64)
            c0 -= wrap * rw
            r0 += wrap
        else:
            w = s + ar
            so = _narrow_offsets(w, rw, sp)
            do = _narrow_offsets(w, rw, dp)
        key = (s + kbase).to(tl.uint64) * KEY + ar_key
        if MASKED:
            mask = (s + ar) < n8
            x = tl.load(sq + so, mask=mask, other=0)
            if COPY:
                tl.store(dq + do, x, mask=mask)
            acc += tl.where(mask, _mix(x.to(tl.uint64, bitcast=True) ^ key, MUL1, MUL2), 0)
        else:
            x = tl.load(sq + so)
            if COPY:
                tl.store(dq + do, x)
            acc += _mix(x.to(tl.uint64, bitcast=True) ^ key, MUL1, MUL2)
        return acc, r0, c0

    @triton.jit
    def _steps(
        acc,
        sptr,
        dptr,
        w0,
        r0,
        c0,
        rw,
        sp,
        dp,
        n8,
        kbase,
        ar,
        ar_key,
        COPY: tl.constexpr,
        ROWS: tl.constexpr,
        MASKED: tl.constexpr,
        LOOP: tl.constexpr,
        BLOCK: tl.constexpr,
        STEPS: tl.constexpr,
        KEY: tl.constexpr,
        MUL1: tl.constexpr,
        MUL2: tl.constexpr,
    ):
        """A chunk's ``STEPS`` steps: a loop (``LOOP``) or unrolled."""
        if LOOP:
            for j in range(STEPS):
                acc, r0, c0 = _step(
                    acc, sptr, dptr, w0 + j * BLOCK, r0, c0, rw, sp, dp, n8, kbase, ar, ar_key,
                    COPY, ROWS, MASKED, BLOCK, KEY, MUL1, MUL2,
                )  # fmt: skip
        else:
            for j in tl.static_range(STEPS):
                acc, r0, c0 = _step(
                    acc, sptr, dptr, w0 + j * BLOCK, r0, c0, rw, sp, dp, n8, kbase, ar, ar_key,
                    COPY, ROWS, MASKED, BLOCK, KEY, MUL1, MUL2,
                )  # fmt: skip
        return acc

    @triton.jit
    def _sum_kernel(
        meta_ptr,
        chunk_ptr,
        out_ptr,
        COPY: tl.constexpr,
        ROWS: tl.constexpr,
        LOOP: tl.constexpr,
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
        ar = tl.arange(0, BLOCK)
        ar_key = ar.to(tl.uint64) * KEY
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        r0 = w0 // rw  # wide rows: the row and column the first step starts at
        c0 = w0 - r0 * rw
        if w0 + BLOCK * STEPS <= n8:  # a whole chunk (all but a piece's last): no masks
            acc = _steps(
                acc, sptr, dptr, w0, r0, c0, rw, sp, dp, n8, base + 1, ar, ar_key,
                COPY, ROWS, False, LOOP, BLOCK, STEPS, KEY, MUL1, MUL2,
            )  # fmt: skip
        else:
            acc = _steps(
                acc, sptr, dptr, w0, r0, c0, rw, sp, dp, n8, base + 1, ar, ar_key,
                COPY, ROWS, True, LOOP, BLOCK, STEPS, KEY, MUL1, MUL2,
            )  # fmt: skip
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


def tuning() -> tuple[int, int, int, bool]:
    """(block, steps, warps, loop): the defaults (the shape ``refit bench`` S2 was measured with, see
    docs/benchmarks.md), or ``REFIT_SUM_KERNEL=block,steps,warps[,loop]`` (powers of two; loop 1: the
    steps are a loop, 0: unrolled; default 1) to measure another shape of the same kernel
    (``bench/checksum_kernels.py`` compares some)."""
    env = os.environ.get("REFIT_SUM_KERNEL")
    if not env:
        return BLOCK, STEPS, NUM_WARPS, LOOP
    vals = tuple(int(v) for v in env.split(","))
    if len(vals) not in (3, 4) or any(v < 1 or v & (v - 1) for v in vals[:3]) or vals[3:] not in ((), (0,), (1,)):
        raise ValueError(f"REFIT_SUM_KERNEL must be block,steps,warps[,loop] (powers of two; 0 or 1), got {env!r}")
    return vals[0], vals[1], vals[2], bool(vals[3]) if len(vals) == 4 else True


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
        loop: bool | None = None,
    ) -> None:
        tb, ts, tw, tl_ = tuning()
        self.block, self.steps, self.num_warps = block or tb, steps or ts, num_warps or tw
        self.loop = tl_ if loop is None else loop
        self.device, self.entries = torch.device(device), len(rows)
        self.constants = dict(zip(("KEY", "MUL1", "MUL2", "LEN_KEY"), constants))
        kinds: dict[tuple[bool, int], list[tuple[int, ...]]] = {}
        for r in rows:
            kinds.setdefault((r[1] != 0, 0 if r[3] == DENSE else 1 if r[3] >= self.block else 2), []).append(r)
        self.groups = {k: _Group(rs, self.block * self.steps, self.device) for k, rs in sorted(kinds.items())}

    def launch(self, out: torch.Tensor, warm: bool = False) -> None:
        """``warm``: compile what a launch runs and run nothing (an empty grid), e.g. before a CUDA graph
        records the launch (a capture must not load a module)."""
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for (copy, rows), g in self.groups.items():
                _sum_kernel[(0 if warm else g.programs,)](
                    g.meta,
                    g.chunks,
                    out,
                    COPY=copy,
                    ROWS=rows,
                    LOOP=self.loop,
                    BLOCK=self.block,
                    STEPS=self.steps,
                    num_warps=self.num_warps,
                    **self.constants,
                )
