"""Word-granular deltas: a changed 64-bit word of a piece travels whole, its int32 index and its 8 bytes.

Word ``w`` of a piece is its row-major elements ``[w * E, (w + 1) * E)`` with ``E = 8 // itemsize``, as the
64-bit integer a contiguous copy of them reads as (so a piece has words when ``numel * itemsize`` is a
multiple of 8). Finding changed words instead of changed elements reads the two versions at HBM speed
(the element kernel scans and stores per element: 2.0-2.15 TB/s on an H200 against 3.0 TB/s per word,
``bench/delta_find_variants.py``) and at 1% of bf16 elements changed sends 5.9% of the dense bytes (the
elements' own sparse encoding: 3%). On CUDA every step is one launch for many pieces, driven by a table
built on the host (``refit.quant.delta_triton``: ``_find_words``, ``_scatter_words``), so the host work
per piece is a table row, not a dozen launches: ``find_words_many`` (one launch, one host sync for the
counts), ``check_words_many`` (one launch, one sync) and ``scatter_words_many`` (one launch; a sender's base
update and a receiver's apply). Elsewhere (CPU, strided or unaligned pieces) the torch reference does the
same per piece: ``find_words``, ``apply_words``.

Wire format of one piece (``wire_bytes``): ``k`` int32 word indices, padded to 8 bytes, then ``k`` words.
"""

from __future__ import annotations

import numpy as np
import torch

WORD = 8  # bytes per word
INDEX_BYTES = 4  # a word index travels as int32 (a piece of 2**31 words or more has no word encoding)
SLOT_FRACTION = 4  # the kernel's slots hold a quarter of a piece's words; more changes overflow (``None``)


def words_in(t: torch.Tensor) -> int | None:
    """The number of 64-bit words of ``t``, or None when its bytes are not a whole number of them (or too
    many for an int32 index)."""
    nbytes = t.numel() * t.element_size()
    return nbytes // WORD if nbytes % WORD == 0 and nbytes // WORD < 2**31 else None


def wire_bytes(k: int) -> int:
    """Bytes on the wire of ``k`` changed words."""
    return (k * INDEX_BYTES + 7) // 8 * 8 + k * WORD


def _addressable(t: torch.Tensor) -> bool:
    """The word kernels can address ``t``: contiguous CUDA memory at an 8-byte aligned address."""
    return t.is_cuda and t.is_contiguous() and t.data_ptr() % WORD == 0 and words_in(t) is not None


def _flat_words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s words as a 1-D int64 tensor (a view when contiguous and aligned, else a copy)."""
    flat = t.reshape(-1)
    if not (t.is_contiguous() and t.data_ptr() % WORD == 0):
        flat = flat.clone()
    return flat.view(torch.uint8).view(torch.int64)


def find_words(base: torch.Tensor, cur: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: indices (int32, ascending) of ``cur``'s words whose bits differ from ``base``'s,
    and those words (int64). Same shape and dtype, any strides; ``base`` may live on another device."""
    if base.shape != cur.shape or base.dtype != cur.dtype or words_in(cur) is None:
        raise ValueError(f"find_words: base {list(base.shape)} {base.dtype} vs current {list(cur.shape)} {cur.dtype}")
    b, c = _flat_words(base.to(cur.device)), _flat_words(cur)
    idx = (b != c).nonzero().squeeze(1)
    return idx.to(torch.int32), c[idx]


def apply_words(dst: torch.Tensor, idx: torch.Tensor, words: torch.Tensor) -> None:
    """``dst``'s words at ``idx`` become ``words`` (the torch path, any strides): an ``index_put_`` of the
    words where ``dst`` is contiguous and aligned, else of their elements."""
    if not idx.numel():
        return
    if dst.is_contiguous() and dst.data_ptr() % WORD == 0:
        dst.reshape(-1).view(torch.uint8).view(torch.int64).index_put_((idx.long(),), words)
        return
    from refit.quant.delta import apply_changes

    per = WORD // dst.element_size()
    elems = (idx.long()[:, None] * per + torch.arange(per, device=idx.device)).reshape(-1)
    apply_changes(dst, elems, words.contiguous().view(torch.uint8).view(dst.dtype))


def _table(rows: list[list[int]], per_piece: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """The kernels' table: row 0 each piece's first program (``per_piece`` programs each), then ``rows``;
    and the number of programs. On CUDA it is copied from pinned memory without waiting for the stream
    (a pageable copy would wait for every kernel queued before it)."""
    first = np.zeros(len(per_piece), dtype=np.int64)
    np.cumsum(per_piece[:-1], out=first[1:])
    table = torch.from_numpy(np.stack([first, *(np.asarray(r, dtype=np.int64) for r in rows)]))
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True), int(sum(per_piece))
    return table, int(sum(per_piece))


def _blocks(n: int) -> int:
    from refit.quant.delta_triton import WORD_BLOCK

    return -(-n // WORD_BLOCK)


def find_words_many(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], use_triton: bool | None = None
) -> list[tuple[torch.Tensor | None, torch.Tensor | None, int]]:
    """``(indices, words, count)`` of the changed words of every ``(base, current)`` pair (each with words).
    The pairs the kernel addresses (one CUDA device) are found in one launch with one host sync; their
    results are views of shared slots (a quarter of each piece's words; drop them soon) and a piece with
    more changed words than that comes back as ``(None, None, count)``: the caller sends it dense or finds
    it with ``find_words``. The others (and all with ``use_triton=False``) through ``find_words``."""
    out: list = [None] * len(pairs)
    kernel = [
        i
        for i, (b, c) in enumerate(pairs)
        if (_addressable(b) and _addressable(c) and b.device == c.device if use_triton is None else use_triton)
        and c.numel()
    ]
    if kernel:
        from refit.quant.delta_triton import launch_find_words

        device = pairs[kernel[0]][1].device
        table, programs, slots, caps = _find_table([pairs[i] for i in kernel], device)
        idx = torch.empty(sum(caps), dtype=torch.int32, device=device)
        vals = torch.empty(sum(caps), dtype=torch.int64, device=device)
        counts = torch.zeros(len(kernel), dtype=torch.int32, device=device)
        launch_find_words(table, programs, idx, vals, counts)
        for i, k, s, cap in zip(kernel, counts.tolist(), slots, caps):
            out[i] = (idx[s : s + k], vals[s : s + k], k) if k <= cap else (None, None, k)
    for i, (b, c) in enumerate(pairs):
        if out[i] is None:
            found = find_words(b, c)
            out[i] = (*found, len(found[0]))
    return out


_FIND_TABLES: dict[tuple, tuple] = {}  # the find's tables by the pieces' addresses and sizes (a refit repeats them)
_FIND_TABLES_MAX = 256


def _find_table(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> tuple:
    """``(table, programs, slot offsets, slot capacities)`` of ``_find_words`` over ``pairs``, built once per
    set of addresses and sizes (a refit's batches repeat every time) and kept (at most ``_FIND_TABLES_MAX``)."""
    key = (device, *((b.data_ptr(), c.data_ptr(), c.numel() * c.element_size()) for b, c in pairs))
    hit = _FIND_TABLES.get(key)
    if hit is None:
        n = [words_in(c) for _, c in pairs]
        caps = [max(1, w // SLOT_FRACTION) for w in n]
        slots = np.zeros(len(pairs), dtype=np.int64)
        np.cumsum(caps[:-1], out=slots[1:])
        rows = [[b.data_ptr() for b, _ in pairs], [c.data_ptr() for _, c in pairs], n, slots, caps]
        hit = (*_table(rows, [_blocks(w) for w in n], device), slots.tolist(), caps)
        if len(_FIND_TABLES) >= _FIND_TABLES_MAX:
            _FIND_TABLES.pop(next(iter(_FIND_TABLES)))
        _FIND_TABLES[key] = hit
    return hit


def _scatter_table(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, int]:
    items = [it for it in items if it[1].numel()]
    rows = [
        [d.data_ptr() for d, _, _ in items],
        [i.data_ptr() for _, i, _ in items],
        [w.data_ptr() for _, _, w in items],
        [i.numel() for _, i, _ in items],
        [words_in(d) for d, _, _ in items],
    ]
    return _table(rows, [_blocks(i.numel()) for _, i, _ in items], items[0][0].device)


def _kernel_items(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], use_triton: bool | None) -> list[int]:
    """The items one launch takes: contiguous int32 indices and int64 words beside an addressable destination,
    all on the first item's CUDA device (``use_triton=True``: every such item, e.g. in Triton's interpreter)."""
    if use_triton is False or not items:
        return []
    device = items[0][0].device

    def fits(d, i, w):
        ok = i.is_contiguous() and w.is_contiguous() and i.dtype == torch.int32 and w.dtype == torch.int64
        same = d.device == device and i.device == device and w.device == device
        return ok and same and i.numel() and (use_triton or _addressable(d))

    return [j for j, it in enumerate(items) if fits(*it)]


def check_words_many(pieces: list[tuple[torch.Tensor, int]], use_triton: bool | None = None) -> bool:
    """Whether every ``(indices, words)`` has its indices in ``[0, words)``: one launch and one host sync for
    the contiguous int32 indices on the first piece's CUDA device, a min and a max per piece for the others."""
    pieces = [(i, n) for i, n in pieces if i.numel()]
    if not pieces:
        return True
    device = pieces[0][0].device
    on = [
        j
        for j, (i, _) in enumerate(pieces)
        if use_triton is not False
        and (use_triton or i.is_cuda)
        and i.device == device
        and i.dtype == torch.int32
        and i.is_contiguous()
    ]
    if on:
        from refit.quant.delta_triton import launch_scatter_words

        sel = [pieces[j] for j in on]
        rows = [[0] * len(sel), [i.data_ptr() for i, _ in sel], [0] * len(sel), [i.numel() for i, _ in sel]]
        table, programs = _table([*rows, [n for _, n in sel]], [_blocks(i.numel()) for i, _ in sel], device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        launch_scatter_words(table, programs, flag, check=True)
        if int(flag.item()):
            return False
    skip = set(on)
    for j, (i, n) in enumerate(pieces):
        if j not in skip:
            lo, hi = torch.stack([i.min(), i.max()]).tolist()
            if lo < 0 or hi >= n:
                return False
    return True


def scatter_words_many(
    items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], use_triton: bool | None = None
) -> None:
    """``apply_words`` of every ``(destination, indices, words)`` (indices checked before: ``check_words_many``):
    one launch for those on one CUDA device that the kernel addresses, ``apply_words`` for the others."""
    on = _kernel_items(items, use_triton)
    if on:
        from refit.quant.delta_triton import launch_scatter_words

        table, programs = _scatter_table([items[j] for j in on])
        launch_scatter_words(table, programs, table[0, :1], check=False)  # no flag: nothing is checked
    skip = set(on)
    for j, (d, i, w) in enumerate(items):
        if j not in skip:
            apply_words(d, i.to(d.device), w.to(d.device))
