"""Delta find on CUDA (Triton): which elements of the current version differ (bitwise) from the base, their
flat indices and new values, optionally updating the base, in passes that each stream their input once.
``refit.quant.delta.find_changes`` is the reference and calls this on contiguous CUDA tensors.

Two passes (``mark`` then ``gather``; ``find_many`` runs both), each **one launch over all the pieces**
of a batch (of one element size): a table of the pieces' addresses and lengths and their first global
block; a program finds its piece by a binary search of that table (launched per piece, ~300 Llama-shaped
pieces cost ~300 Python launches of each kernel and of the torch steps between them).

* ``mark``: one program per block of ``BLOCK`` (4096) elements reads base and current as integers, writes
  the block's changed elements as a bitmask (bit i of byte i // 8, refit's ``bitmask`` encoding), their
  count per block, and with ``update`` the new values into the base (a sender's base update, fused). No
  atomics and no scan: a pure streaming pass over both versions.
* the blocks' counts' exclusive prefix sum (torch) gives each block its output offset, and their total the
  output size (one host sync, for any number of pieces: ``find_many``);
* ``gather``: per block, the bitmask (n / 8 bytes) and the current values where a bit is set (only the
  sectors that hold a change are read) -> indices (int64, within the piece) and values at the block's offset
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

BLOCK = 4096  # elements per program
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
    def _piece_of(firsts_ptr, pieces, pid, LOG: tl.constexpr):
        """The piece whose blocks hold global block ``pid``: ``firsts[i] <= pid < firsts[i + 1]``."""
        lo = pid * 0
        hi = lo + pieces
        for _ in tl.static_range(LOG):
            mid = (lo + hi) // 2
            go = tl.load(firsts_ptr + mid) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        return lo

    @triton.jit
    def _mark(
        meta_ptr, firsts_ptr, mask_ptr, counts_ptr, like_ptr, pieces, UPDATE: tl.constexpr, LOG: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # a block as BLOCK // 8 rows of 8 elements: row r is mask byte r, its 8 elements contiguous (one
        # vector load per thread), so the byte is packed in registers
        pid = tl.program_id(0).to(tl.int64)
        p = _piece_of(firsts_ptr, pieces, pid, LOG)
        base = tl.load(meta_ptr + 3 * p).to(like_ptr.dtype)
        cur = tl.load(meta_ptr + 3 * p + 1).to(like_ptr.dtype)
        n = tl.load(meta_ptr + 3 * p + 2)
        rows = (pid - tl.load(firsts_ptr + p)) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
        inb = offs < n
        b = tl.load(base + offs, mask=inb, other=0)
        c = tl.load(cur + offs, mask=inb, other=0)
        changed = (b != c) & inb
        ones = changed.to(tl.int32)
        byte = tl.sum(ones << tl.arange(0, 8)[None, :], axis=1)
        tl.store(mask_ptr + pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8), byte.to(tl.uint8))
        tl.store(counts_ptr + pid, tl.sum(tl.sum(ones, axis=1), axis=0))
        if UPDATE:
            tl.store(base + offs, c, mask=changed)

    @triton.jit
    def _gather(
        meta_ptr, firsts_ptr, mask_ptr, starts_ptr, idx_ptr, val_ptr, pieces, LOG: tl.constexpr, BLOCK: tl.constexpr
    ):
        # the same rows: one mask byte per row, expanded in registers; a change's slot is the block's offset
        # + the changes in earlier rows (a scan over BLOCK // 8 row counts) + those earlier in its row
        pid = tl.program_id(0).to(tl.int64)
        p = _piece_of(firsts_ptr, pieces, pid, LOG)
        cur = tl.load(meta_ptr + 3 * p + 1).to(val_ptr.dtype)
        byte = tl.load(mask_ptr + pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)).to(tl.int32)
        ones = (byte[:, None] >> tl.arange(0, 8)[None, :]) & 1  # bits past a piece's end are 0 (mark's)
        per_row = tl.sum(ones, axis=1)
        before = (tl.cumsum(per_row, axis=0) - per_row)[:, None] + (tl.cumsum(ones, axis=1) - ones)
        pos = tl.load(starts_ptr + pid) + before.to(tl.int64)
        changed = ones == 1
        rows = (pid - tl.load(firsts_ptr + p)) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        offs = rows[:, None] * 8 + tl.arange(0, 8)[None, :]
        c = tl.load(cur + offs, mask=changed, other=0)
        tl.store(idx_ptr + pos, offs, mask=changed)
        tl.store(val_ptr + pos, c, mask=changed)


class Marked:
    """One ``mark`` launch over pairs of one element size (enqueued at construction, no host sync): their
    table, the bitmask and the changes per block; ``gather()`` then finds every pair's changes."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], update: bool) -> None:
        cur0 = pairs[0][1]
        self.device, self.dtype = cur0.device, cur0.dtype
        blocks = [triton.cdiv(c.numel(), BLOCK) for _, c in pairs]
        firsts = [0]
        for b in blocks:
            firsts.append(firsts[-1] + b)
        self.blocks, self.firsts_list = firsts[-1], firsts
        rows = [(b.data_ptr(), c.data_ptr(), c.numel()) for b, c in pairs]
        self.meta = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        self.firsts = torch.tensor(firsts, dtype=torch.int64).to(self.device, non_blocking=True)
        self.log = max(1, len(pairs).bit_length())
        self.mask = torch.empty(self.blocks * (BLOCK // 8), dtype=torch.uint8, device=self.device)
        self.counts = torch.empty(self.blocks, dtype=torch.int32, device=self.device)
        _mark[(self.blocks,)](
            self.meta, self.firsts, self.mask, self.counts, cur0, len(pairs),
            UPDATE=update, LOG=self.log, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )  # fmt: skip

    def gather(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every piece's changes (sorted indices, bits): one host sync for all pieces' totals."""
        incl = torch.cumsum(self.counts, 0, dtype=torch.int64)
        starts = incl - self.counts
        ends = torch.cat([incl.new_zeros(1), incl])[self.firsts]  # changes before each piece's first block
        bounds = ends.tolist()
        total = bounds[-1]
        idx = torch.empty(total, dtype=torch.int64, device=self.device)
        vals = torch.empty(total, dtype=self.dtype, device=self.device)
        if total:
            pieces = len(self.firsts_list) - 1
            _gather[(self.blocks,)](
                self.meta, self.firsts, self.mask, starts, idx, vals, pieces,
                LOG=self.log, BLOCK=BLOCK, num_warps=NUM_WARPS,
            )  # fmt: skip
        return [(idx[a:b], vals[a:b]) for a, b in zip(bounds, bounds[1:])]


def find_many(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], update: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The changes of every ``(base_bits, cur_bits)`` pair (contiguous 1-D integer views of equal length, all
    on one device): one ``mark`` launch per element size over all of them, one host sync, one ``gather``
    launch. ``(indices, bits)`` per pair, sorted, exact in size (views into one buffer per element size)."""
    out: list = [(torch.empty(0, dtype=torch.int64, device=c.device), c[:0]) for _, c in pairs]
    by_size: dict[int, list[int]] = {}
    for i, (_, c) in enumerate(pairs):
        if c.numel():
            by_size.setdefault(c.element_size(), []).append(i)
    for members in by_size.values():
        for i, found in zip(members, Marked([pairs[i] for i in members], update).gather()):
            out[i] = found
    return out


def mark(base_bits: torch.Tensor, cur_bits: torch.Tensor, update: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``mark`` of one pair: its bitmask (uint8, ``ceil(n / 8)`` bytes; bit i of byte i // 8) and its changed
    elements per block of ``BLOCK`` (int32). Enqueued, no host sync."""
    n = cur_bits.numel()
    if not n:
        return torch.empty(0, dtype=torch.uint8, device=cur_bits.device), torch.empty(0, dtype=torch.int32)
    m = Marked([(base_bits, cur_bits)], update)
    return m.mask[: (n + 7) // 8], m.counts


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
    """``find_many`` of one pair: ``(indices plus start, values, count)`` of every changed element, sorted."""
    idx, vals = find_many([(base_bits, cur_bits)], update)[0]
    return idx + start, vals, len(idx)


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
