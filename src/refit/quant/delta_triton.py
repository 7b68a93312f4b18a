"""Delta find on CUDA (Triton): which elements of the current version differ (bitwise) from the base, their
flat indices and new values, optionally updating the base, in passes that each stream their input once.
``refit.quant.delta.find_changes`` is the reference and calls this on contiguous CUDA tensors.

Two passes (``mark`` then ``gather``; ``diff_compact`` / ``find_many`` run both):

* ``mark``: one program per block of ``BLOCK`` (4096) elements reads base and current as integers, writes
  the block's changed elements as a bitmask (bit i of byte i // 8, refit's ``bitmask`` encoding), their
  count per block, and with ``update`` the new values into the base (a sender's base update, fused). No
  atomics and no scan: a pure streaming pass over both versions.
* the blocks' counts' exclusive prefix sum (torch) gives each block its output offset, and their total the
  output size (one host sync, for any number of pieces: ``find_many``);
* ``gather``: per block, the bitmask (n / 8 bytes) and the current values where a bit is set (only the
  sectors that hold a change are read) -> indices (int64, plus ``start``) and values at the block's offset
  plus the changes before it inside the block. The output is sorted by index.

Both see a block as ``BLOCK // 8`` rows of 8 elements, one mask byte per row: the 8 elements of a row are
contiguous (one vector load per thread), and a byte is packed or expanded in registers (a first version
addressed the mask per element: one byte load per element made the gather ~2x slower than the first
one-pass kernel on an H200).

The first version was one pass (compare, a 4096-element scan and one atomic add on a shared counter per
block, writing in no particular order); on an H200 it read the two versions at about 1.0 TB/s. It is kept
as ``one_pass`` for ``bench/delta_gpu.py`` to measure beside. Imports nothing of refit (tested in Triton's
interpreter on CPU: ``tests/delta_interpret.py``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # noqa: BLE001 - no Triton (CPU-only installs): the torch path is used
    AVAILABLE = False

BLOCK = 4096  # elements per program: fewer atomics on the shared counter (one per program)
NUM_WARPS = 8

if AVAILABLE:

    @triton.jit
    def _diff_compact(
        base_ptr, cur_ptr, idx_ptr, val_ptr, count_ptr, n, start, cap, UPDATE: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        b = tl.load(base_ptr + offs, mask=inb, other=0)
        c = tl.load(cur_ptr + offs, mask=inb, other=0)
        changed = (b != c) & inb
        ones = changed.to(tl.int32)
        first = tl.atomic_add(count_ptr, tl.sum(ones, axis=0))
        pos = (first + tl.cumsum(ones, axis=0) - ones).to(tl.int64)
        ok = changed & (pos < cap)
        tl.store(idx_ptr + pos, offs + start, mask=ok)
        tl.store(val_ptr + pos, c, mask=ok)
        if UPDATE:
            tl.store(base_ptr + offs, c, mask=changed)


if AVAILABLE:

    @triton.jit
    def _mark(base_ptr, cur_ptr, mask_ptr, counts_ptr, n, UPDATE: tl.constexpr, BLOCK: tl.constexpr):
        # a block as BLOCK // 8 rows of 8 elements: row r is mask byte r, its 8 elements contiguous (one
        # vector load per thread), so the byte is packed in registers
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
        inb = offs < n
        b = tl.load(base_ptr + offs, mask=inb, other=0)
        c = tl.load(cur_ptr + offs, mask=inb, other=0)
        changed = (b != c) & inb
        ones = changed.to(tl.int32)
        byte = tl.sum(ones << tl.arange(0, 8)[None, :], axis=1)
        tl.store(mask_ptr + rows, byte.to(tl.uint8), mask=rows < (n + 7) // 8)
        tl.store(counts_ptr + pid, tl.sum(tl.sum(ones, axis=1), axis=0))
        if UPDATE:
            tl.store(base_ptr + offs, c, mask=changed)

    @triton.jit
    def _gather(mask_ptr, cur_ptr, starts_ptr, idx_ptr, val_ptr, n, start, BLOCK: tl.constexpr):
        # the same rows: one mask byte per row, expanded in registers; a change's slot is the block's offset
        # + the changes in earlier rows (a scan over BLOCK // 8 row counts) + those earlier in its row
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        byte = tl.load(mask_ptr + rows, mask=rows < (n + 7) // 8, other=0).to(tl.int32)
        ones = (byte[:, None] >> tl.arange(0, 8)[None, :]) & 1  # bits past n are 0 (mark wrote them so)
        per_row = tl.sum(ones, axis=1)
        before = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + (tl.cumsum(ones, axis=1) - ones)
        pos = tl.load(starts_ptr + pid) + before.to(tl.int64)
        changed = ones == 1
        offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
        c = tl.load(cur_ptr + offs, mask=changed, other=0)
        tl.store(idx_ptr + pos, offs + start, mask=changed)
        tl.store(val_ptr + pos, c, mask=changed)


def mark(base_bits: torch.Tensor, cur_bits: torch.Tensor, update: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Enqueue ``mark`` (no host sync) over contiguous 1-D integer views of equal length: ``(mask, counts)``,
    the bitmask (uint8, ``ceil(n / 8)`` bytes) and the changed elements per block of ``BLOCK`` (int32)."""
    n = cur_bits.numel()
    blocks = triton.cdiv(n, BLOCK) if n else 0
    mask = torch.empty((n + 7) // 8, dtype=torch.uint8, device=cur_bits.device)
    counts = torch.zeros(blocks, dtype=torch.int32, device=cur_bits.device)
    if n:
        _mark[(blocks,)](base_bits, cur_bits, mask, counts, n, UPDATE=update, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return mask, counts


def gather(
    mask: torch.Tensor, counts: torch.Tensor, cur_bits: torch.Tensor, k: int, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Enqueue ``gather`` (no host sync): the ``k`` (the sum of ``counts``) changed elements ``mark`` found,
    as sorted flat indices (int64, plus ``start``) and current bits."""
    idx = torch.empty(k, dtype=torch.int64, device=cur_bits.device)
    vals = torch.empty(k, dtype=cur_bits.dtype, device=cur_bits.device)
    if k:
        starts = torch.cumsum(counts, 0, dtype=torch.int64) - counts
        _gather[(counts.numel(),)](
            mask, cur_bits, starts, idx, vals, cur_bits.numel(), start, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return idx, vals


def find_many(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], update: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``mark`` every ``(base_bits, cur_bits)`` pair, one host sync for all their counts, then ``gather``
    each: ``(indices, bits)`` per pair, sorted, exact in size."""
    marked = [mark(b, c, update) for b, c in pairs]
    totals = torch.stack([c.sum(dtype=torch.int64) for _, c in marked]).tolist() if marked else []
    return [gather(m, c, cur, k) for (m, c), (_, cur), k in zip(marked, pairs, totals)]


def launch(
    base_bits: torch.Tensor,
    cur_bits: torch.Tensor,
    idx: torch.Tensor,
    vals: torch.Tensor,
    count: torch.Tensor,
    start: int = 0,
    update: bool = False,
) -> None:
    """Enqueue the kernel (no host sync): at most ``len(idx)`` changes of ``cur_bits`` vs ``base_bits``
    (contiguous 1-D integer views of equal length) into ``idx`` (int64, plus ``start``) and ``vals``
    (``cur_bits``' dtype); ``count`` (one int32, zeroed) receives the true number of changes."""
    n = cur_bits.numel()
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        _diff_compact[grid](
            base_bits, cur_bits, idx, vals, count, n, start, len(idx), UPDATE=update, BLOCK=BLOCK, num_warps=NUM_WARPS
        )


def diff_compact(
    base_bits: torch.Tensor, cur_bits: torch.Tensor, start: int = 0, update: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``mark``, one host sync, ``gather``: ``(indices, values, count)`` of every changed element, sorted."""
    mask, counts = mark(base_bits, cur_bits, update)
    k = int(counts.sum(dtype=torch.int64)) if counts.numel() else 0
    idx, vals = gather(mask, counts, cur_bits, k, start)
    return idx, vals, k


def one_pass(
    base_bits: torch.Tensor, cur_bits: torch.Tensor, start: int = 0, cap: int | None = None, update: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The first version (one pass, an atomic counter per launch; for the bench): ``launch`` into fresh
    slots (``cap``, default every element), then one host sync. Returns ``(indices, values, count)``: the
    first ``min(count, cap)`` changed elements' flat indices (plus ``start``, in no particular order) and
    current bits, and the true number of changes ``count``."""
    cap = cur_bits.numel() if cap is None else cap
    idx = torch.empty(cap, dtype=torch.int64, device=cur_bits.device)
    vals = torch.empty(cap, dtype=cur_bits.dtype, device=cur_bits.device)
    count = torch.zeros(1, dtype=torch.int32, device=cur_bits.device)
    launch(base_bits, cur_bits, idx, vals, count, start, update)
    k = int(count.item())
    return idx[: min(k, cap)], vals[: min(k, cap)], k
