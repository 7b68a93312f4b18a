"""The delta kernels on CUDA (Triton). The one-pass element find: compare, compact and (optionally) update the
base, reading each version once; ``refit.delta.elements.find_changes`` is its reference and calls it on
contiguous CUDA tensors.

The torch reference makes several passes (compare into a bool tensor, ``nonzero``, gather the values).
Here one program reads a block of ``BLOCK`` (2048) elements of the base and the current version as integers
(bitwise), counts its changed elements, reserves that many output slots with one atomic add on a global
counter, and writes their flat indices (int64) and new values at its reserved offset plus the exclusive
prefix sum of its changes; with ``update`` it also writes the new values into the base (the base update
of a sender, fused). Blocks reserve in the order they run, so the indices come out grouped by block in no
particular order across blocks (every consumer is order-free: ``encode``, ``apply_changes``). At most
``cap`` changes are written; the returned count says how many there were, so a caller sees an overflow.
The word kernels (``_find_words``, ``_scatter_words``, ``_pack_words``, launched by ``refit.delta.words``) take a
table with a row per piece, so one launch serves many pieces. Imports nothing of refit (tested in Triton's
interpreter on CPU: ``tests/delta_interpret.py``, ``tests/delta_words_interpret.py``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # noqa: BLE001 - no Triton (CPU-only installs): the torch path is used
    AVAILABLE = False

# elements per program and its warps: 2048 x 4 found 2.02-2.15 TB/s on an H200 against 1.78-1.99 for 4096 x 8 and
# 1.10-1.24 for 8192 or more (a variants bench on 2x H200, 2026-11-26, kept in git history)
BLOCK = 2048
NUM_WARPS = 4

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

    @triton.jit
    def _piece_of(tab_ptr, pid, NP, LOG: tl.constexpr):
        """The piece ``j`` of program ``pid``: the last whose first program (row 0 of the table, ascending,
        ``tab[0] == 0``) is at most ``pid``; a binary search of ``LOG`` steps (``2**LOG >= NP``)."""
        lo = pid - pid
        hi = lo + NP
        for _ in tl.static_range(LOG):
            mid = (lo + hi) // 2
            go = tl.load(tab_ptr + mid) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        return lo

    @triton.jit
    def _find_words(tab_ptr, piece_ptr, idx_ptr, val_ptr, count_ptr, NP, BLOCK: tl.constexpr):
        """Table rows (int64, ``NP`` pieces each): first program, base address, current address, words, slot
        offset, slot capacity; ``piece_ptr``: each program's piece (int32, one load instead of a search: the
        find reads at HBM speed, so a program's start is on its critical path). One program compares ``BLOCK``
        64-bit words of one piece and writes each changed word's index (int32, within its piece) and bits at
        its piece's slots."""
        pid = tl.program_id(0).to(tl.int64)
        j = tl.load(piece_ptr + pid).to(tl.int64)
        base = tl.load(tab_ptr + NP + j).to(tl.pointer_type(tl.int64))
        cur = tl.load(tab_ptr + 2 * NP + j).to(tl.pointer_type(tl.int64))
        n = tl.load(tab_ptr + 3 * NP + j)
        slot = tl.load(tab_ptr + 4 * NP + j)
        cap = tl.load(tab_ptr + 5 * NP + j)
        offs = (pid - tl.load(tab_ptr + j)) * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        b = tl.load(base + offs, mask=inb, other=0)
        c = tl.load(cur + offs, mask=inb, other=0)
        changed = (b != c) & inb
        ones = changed.to(tl.int32)
        first = tl.atomic_add(count_ptr + j, tl.sum(ones, axis=0))
        pos = (first + tl.cumsum(ones, axis=0) - ones).to(tl.int64)
        ok = changed & (pos < cap)
        tl.store(idx_ptr + slot + pos, offs.to(tl.int32), mask=ok)
        tl.store(val_ptr + slot + pos, c, mask=ok)

    @triton.jit
    def _scatter_words(
        tab_ptr, flag_ptr, NP, LOG: tl.constexpr, CHECK: tl.constexpr, PIECES: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Table rows (int64, ``NP`` pieces each): first program, destination address, index address (int32),
        word address (int64), changes, words in the piece. ``CHECK``: raise ``flag[0]`` where an index is outside
        ``[0, words)`` (``PIECES``: and ``flag[1 + j]`` for its piece ``j``), store nothing; else, unless
        ``flag[0]`` is raised, store each word at its index."""
        pid = tl.program_id(0).to(tl.int64)
        j = _piece_of(tab_ptr, pid, NP, LOG)
        k = tl.load(tab_ptr + 4 * NP + j)
        offs = (pid - tl.load(tab_ptr + j)) * BLOCK + tl.arange(0, BLOCK)
        m = offs < k
        i = tl.load(tl.load(tab_ptr + 2 * NP + j).to(tl.pointer_type(tl.int32)) + offs, mask=m, other=0).to(tl.int64)
        if CHECK:
            bad = tl.max((m & ((i < 0) | (i >= tl.load(tab_ptr + 5 * NP + j)))).to(tl.int32), axis=0)
            tl.atomic_max(flag_ptr, bad)
            if PIECES:
                tl.atomic_max(flag_ptr + 1 + j, bad)
        else:
            m = m & (tl.zeros_like(offs) == tl.load(flag_ptr))  # a raised flag masks every store
            v = tl.load(tl.load(tab_ptr + 3 * NP + j).to(tl.pointer_type(tl.int64)) + offs, mask=m)
            tl.store(tl.load(tab_ptr + NP + j).to(tl.pointer_type(tl.int64)) + i, v, mask=m)

    @triton.jit
    def _pack_words(tab_ptr, NP, LOG: tl.constexpr, BLOCK: tl.constexpr):
        """Table rows (int64, ``NP`` pieces each): first program, index address (int32), word address (int64),
        changes ``k``, destination byte address. Writes the wire format: ``k`` indices, a zero int32 when
        ``k`` is odd (padding to 8 bytes), then the ``k`` words."""
        pid = tl.program_id(0).to(tl.int64)
        j = _piece_of(tab_ptr, pid, NP, LOG)
        k = tl.load(tab_ptr + 3 * NP + j)
        dst = tl.load(tab_ptr + 4 * NP + j)
        offs = (pid - tl.load(tab_ptr + j)) * BLOCK + tl.arange(0, BLOCK)
        m = offs < k
        i = tl.load(tl.load(tab_ptr + NP + j).to(tl.pointer_type(tl.int32)) + offs, mask=m, other=0)
        tl.store(dst.to(tl.pointer_type(tl.int32)) + offs, i, mask=offs < k + k % 2)  # the pad: a masked 0
        v = tl.load(tl.load(tab_ptr + 2 * NP + j).to(tl.pointer_type(tl.int64)) + offs, mask=m)
        tl.store((dst + (k * 4 + 7) // 8 * 8).to(tl.pointer_type(tl.int64)) + offs, v, mask=m)


WORD_BLOCK = 2048  # 64-bit words per program of the word kernels: 3.0 TB/s found on an H200 (words, flat: find.txt)
WORD_WARPS = 8


def _log2(n: int) -> int:
    return max(1, (max(1, n) - 1).bit_length())


def launch_find_words(
    table: torch.Tensor, pieces: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, counts: torch.Tensor
) -> None:
    """Enqueue ``_find_words`` over ``table`` (int64 ``[6, NP]`` on the device) with ``pieces`` (int32, each
    program's piece): changed words into ``idx`` (int32) / ``vals`` (int64) at each piece's slots; ``counts``
    (int32 ``[NP]``, zeroed) receives each piece's true number of changed words."""
    if len(pieces):
        _find_words[(len(pieces),)](
            table, pieces, idx, vals, counts, table.shape[1], BLOCK=WORD_BLOCK, num_warps=WORD_WARPS
        )


def launch_scatter_words(
    table: torch.Tensor, programs: int, flag: torch.Tensor, check: bool, pieces: bool = False
) -> None:
    """Enqueue ``_scatter_words`` over ``table`` (int64 ``[6, NP]`` on the device): check every index into
    ``flag`` (int32, zeroed: ``flag[0]`` 1 where one is out of range; ``pieces``: ``NP + 1`` of them, ``flag[1 + j]``
    for piece ``j``), or scatter unless ``flag[0]`` is raised."""
    if programs:
        np_ = table.shape[1]
        _scatter_words[(programs,)](
            table, flag, np_, LOG=_log2(np_), CHECK=check, PIECES=pieces, BLOCK=WORD_BLOCK, num_warps=WORD_WARPS
        )


def launch_pack_words(table: torch.Tensor, programs: int) -> None:
    """Enqueue ``_pack_words`` over ``table`` (int64 ``[5, NP]`` on the device)."""
    if programs:
        np_ = table.shape[1]
        _pack_words[(programs,)](table, np_, LOG=_log2(np_), BLOCK=WORD_BLOCK, num_warps=WORD_WARPS)


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
    base_bits: torch.Tensor, cur_bits: torch.Tensor, start: int = 0, cap: int | None = None, update: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``launch`` into fresh slots (``cap``, default every element), then one host sync. Returns
    ``(indices, values, count)``: the first ``min(count, cap)`` changed elements' flat indices (plus
    ``start``) and current bits, and the true number of changes ``count``."""
    cap = cur_bits.numel() if cap is None else cap
    idx = torch.empty(cap, dtype=torch.int64, device=cur_bits.device)
    vals = torch.empty(cap, dtype=cur_bits.dtype, device=cur_bits.device)
    count = torch.zeros(1, dtype=torch.int32, device=cur_bits.device)
    launch(base_bits, cur_bits, idx, vals, count, start, update)
    k = int(count.item())
    return idx[: min(k, cap)], vals[: min(k, cap)], k
