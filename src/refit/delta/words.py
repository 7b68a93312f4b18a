"""Word-granular deltas: a changed 64-bit word of a piece travels whole, its int32 index and its 8 bytes.

Word ``w`` of a piece is its row-major elements ``[w * E, (w + 1) * E)`` with ``E = 8 // itemsize``, as the
64-bit integer a contiguous copy of them reads as (so a piece has words when ``numel * itemsize`` is a
multiple of 8). Finding changed words instead of changed elements reads the two versions at HBM speed
(the element kernel scans and stores per element: 2.0-2.15 TB/s on an H200 against 3.0 TB/s per word,
a variants bench in git history) and at 1% of bf16 elements changed sends 5.9% of the dense bytes (the
elements' own sparse encoding: 3%). On CUDA every step is one launch for many pieces, driven by a table
built on the host (``refit.delta.kernels``: ``_find_words``, ``_scatter_words``, ``_pack_words``), so the
host work per piece is a table row, not a dozen launches: ``find_words_many`` (one launch, one host sync for the
counts), ``pack_table`` (one launch), ``check_words_many`` (one launch, one sync) and ``scatter_words_many`` /
``Scatter`` (one launch; a receiver's apply, and a sender's base update from its packed payload or per piece).
Elsewhere (CPU, strided or unaligned pieces) the torch reference does the same per piece: ``find_words``,
``apply_words``.

Wire format of one piece (``refit.delta.wire.wire_sizes``): ``k`` int32 word indices, padded to 8 bytes, then
``k`` words.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from refit.cudart import private_stream
from refit.delta.host_find import from_numpy
from refit.delta.wire import INDEX_BYTES, WORD

SLOT_FRACTION = 4  # the kernel's slots hold a quarter of a piece's words; more changes overflow (``None``)


def words_in(t: torch.Tensor) -> int | None:
    """The number of 64-bit words of ``t``, or None when its bytes are not a whole number of them (or too
    many for an int32 index): ``whole_words`` of its bytes."""
    nbytes = t.numel() * t.element_size()
    return nbytes // WORD if whole_words(nbytes) else None


def whole_words(nbytes: int) -> bool:
    """A piece of ``nbytes`` has a word encoding: whole 64-bit words, fewer than 2**31 of them."""
    return nbytes % WORD == 0 and nbytes // WORD < 2**31


def addressable(t: torch.Tensor) -> bool:
    """The word kernels can address ``t``: contiguous, 8-byte aligned, whole words, on a CUDA device with
    Triton installed (or on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return (
        (t.is_cuda or interpret)
        and _kernels()
        and t.is_contiguous()
        and t.data_ptr() % WORD == 0
        and words_in(t) is not None
        and t.numel() > 0
    )


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
    if c.device.type == "cpu":  # numpy's vectorized compare and ``flatnonzero``: ~10x torch's ``!=`` and ``nonzero``
        idx = np.flatnonzero(b.numpy() != c.numpy())
        return from_numpy(idx.astype(np.int32)), from_numpy(np.take(c.numpy(), idx))
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
    per = WORD // dst.element_size()
    elems = (idx.long()[:, None] * per + torch.arange(per, device=idx.device)).reshape(-1)
    dst.index_put_(torch.unravel_index(elems, dst.shape), words.contiguous().view(torch.uint8).view(dst.dtype))


def _table(rows: list, per_piece: np.ndarray, device: torch.device) -> tuple[torch.Tensor, int]:
    """The kernels' table: row 0 each piece's first program (``per_piece`` programs each), then ``rows``;
    and the number of programs. On CUDA it is copied from pinned memory without waiting for the stream
    (a pageable copy would wait for every kernel queued before it)."""
    per_piece = np.asarray(per_piece, dtype=np.int64)
    first = np.zeros(len(per_piece), dtype=np.int64)
    np.cumsum(per_piece[:-1], out=first[1:])
    table = torch.from_numpy(np.stack([first, *(np.asarray(r, dtype=np.int64) for r in rows)]))
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True), int(per_piece.sum())
    return table, int(per_piece.sum())


def _blocks(n) -> np.ndarray:
    """Programs per piece of ``n`` words or changes (an int or an array)."""
    from refit.delta.kernels import WORD_BLOCK

    return -(-np.asarray(n, dtype=np.int64) // WORD_BLOCK)


@dataclass
class Found:
    """What one find launch found: the slots (``idx`` int32, ``words`` int64) and, per piece (numpy int64),
    its slot offset, its capacity and its true number of changed words (more than ``cap``: over its slots,
    nothing usable was kept)."""

    idx: torch.Tensor
    words: torch.Tensor
    slot: np.ndarray
    cap: np.ndarray
    count: np.ndarray

    def mark_current(self) -> None:
        """On CUDA, the slots are marked as read on the current stream (``record_stream``): a kernel about to
        read them there (a sender's pack, on a stream of its own) does so before their memory can go back to
        the find's stream."""
        if self.idx.is_cuda:
            current = torch.cuda.current_stream(self.idx.device)
            for t in (self.idx, self.words):
                t.record_stream(current)

    def piece(self, j: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Piece ``j``'s indices and words as views of the slots, or ``(None, None)`` over its slots."""
        k, s = int(self.count[j]), int(self.slot[j])
        return (self.idx[s : s + k], self.words[s : s + k]) if k <= self.cap[j] else (None, None)

    def addresses(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte addresses of pieces ``sel``' indices and words in the slots."""
        slot = self.slot[sel]
        return self.idx.data_ptr() + INDEX_BYTES * slot, self.words.data_ptr() + WORD * slot


def find_words_table(base: np.ndarray, cur: np.ndarray, nwords: np.ndarray, device: torch.device) -> Found:
    """The changed words of pieces at byte addresses ``base`` / ``cur`` (int64 arrays, 8-byte aligned,
    contiguous, ``nwords`` words each, ``nwords > 0``) on ``device``: one launch, one host sync."""
    return launch_words_table(base, cur, nwords, device).result()


@dataclass
class PendingFind:
    """A find launched and not waited for (``launch_words_table``): its slots, and its counts on their way
    to the host (behind ``done`` on CUDA). ``result()`` waits for them."""

    idx: torch.Tensor
    words: torch.Tensor
    slot: np.ndarray
    cap: np.ndarray
    counts: torch.Tensor  # on the host (pinned on CUDA), filled when ``done`` completes
    done: torch.cuda.Event | None

    def result(self) -> Found:
        """The ``Found`` (waits for the find and its counts: one host sync; on CUDA the current stream also
        waits for the find's stream)."""
        if self.done is not None:
            self.done.synchronize()
            current = torch.cuda.current_stream(self.idx.device)
            current.wait_event(self.done)
            for t in (self.idx, self.words):  # read on the current stream from now on: their memory goes back to
                t.record_stream(current)  # the find's pool only after that
        count = self.counts.numpy().astype(np.int64)
        return Found(self.idx, self.words, self.slot, self.cap, count)


_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}  # per CUDA device and purpose


HIGH_PRIORITY = ("send",)  # side streams of the device's greatest priority (``side_stream``)


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """The CUDA stream of ``device`` that work of ``purpose`` (``"find"``, ``"apply"``, ``"send"``, ``"update"``)
    runs on beside the current stream, made once. ``"send"`` (a sender's packing) is of the device's greatest
    priority: its small kernels start while a find's blocks fill the device, not after them."""
    key = (device, purpose)
    if key not in _STREAMS:  # kept for the process's life: one per device and purpose
        _STREAMS[key] = private_stream(device, high=purpose in HIGH_PRIORITY)
    return _STREAMS[key]


def launch_words_table(
    base: np.ndarray,
    cur: np.ndarray,
    nwords: np.ndarray,
    device: torch.device,
    after: torch.cuda.Event | None = None,
) -> PendingFind:
    """``find_words_table`` without the wait. On CUDA the find runs on a stream of its own, behind ``after``
    (an event the caller recorded on the current stream after the weights' and the bases' last writes) or
    all work queued so far on the current stream (``after`` None), and behind its table's copy, and its
    counts are copied to the host behind it: what the current stream queues next (e.g. packing and sending
    the chunk before, the base's update) does not wait for this find, nor this find for it, and the host can
    go on while the device finds. The slots are allocated on the find's stream (``PendingFind.result``
    hands them to the current one)."""
    from refit.delta.kernels import launch_find_words

    table, pieces, slot, cap, made = _find_table(base, cur, nwords, device)
    if device.type != "cuda":
        idx, words, counts = _slots(int(cap.sum()), len(nwords), device)
        launch_find_words(table, pieces, idx, words, counts)
        return PendingFind(idx, words, slot, cap, counts, None)
    side = side_stream(device, "find")
    if after is None:
        side.wait_stream(torch.cuda.current_stream(device))
    else:
        side.wait_event(after)
    side.wait_event(made)
    for t in (table, pieces):  # made on another stream, used on the find's: not freed before it is done
        t.record_stream(side)  # (they may leave ``_FIND_TABLES`` while the find runs)
    host = torch.empty(len(nwords), dtype=torch.int32, pin_memory=True)
    with torch.cuda.stream(side):  # the slots come from the find stream's pool: no wait on the current stream
        idx, words, counts = _slots(int(cap.sum()), len(nwords), device)
        launch_find_words(table, pieces, idx, words, counts)
        host.copy_(counts, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    return PendingFind(idx, words, slot, cap, host, done)


def _slots(n: int, pieces: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A find's slots for ``n`` changed words (int32 indices, int64 words) and its ``pieces`` counts."""
    idx = torch.empty(n, dtype=torch.int32, device=device)
    words = torch.empty(n, dtype=torch.int64, device=device)
    return idx, words, torch.zeros(pieces, dtype=torch.int32, device=device)


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
        if (addressable(b) and addressable(c) and b.device == c.device if use_triton is None else use_triton)
        and c.numel()
    ]
    if kernel:
        sel = [pairs[i] for i in kernel]
        ptrs = [_ptrs(ts) for ts in zip(*sel)]
        n = np.array([words_in(c) for _, c in sel], dtype=np.int64)
        found = find_words_table(*ptrs, n, sel[0][1].device)
        for j, i in enumerate(kernel):
            out[i] = (*found.piece(j), int(found.count[j]))
    for i, (b, c) in enumerate(pairs):
        if out[i] is None:
            got = find_words(b, c)
            out[i] = (*got, len(got[0]))
    return out


_FIND_TABLES: dict[tuple, tuple] = {}  # the find's tables by the pieces' addresses and sizes (a refit repeats them)
_FIND_TABLES_MAX = 256


def _table_key(base: np.ndarray, cur: np.ndarray, nwords: np.ndarray, device: torch.device) -> tuple:
    return (device, base.tobytes(), cur.tobytes(), nwords.tobytes())


def _find_table(base: np.ndarray, cur: np.ndarray, nwords: np.ndarray, device: torch.device) -> tuple:
    """``(table, each program's piece, slot offsets, slot capacities, made)`` of ``_find_words`` over the
    pieces, built once per set of addresses and sizes (a refit's batches repeat every time) and kept (at most
    ``_FIND_TABLES_MAX``; the per-program pieces take 4 bytes per 16 KiB found); on CUDA ``made``: an event
    behind the table's copies to the device (a find on another stream waits for it), else None."""
    key = _table_key(base, cur, nwords, device)
    hit = _FIND_TABLES.get(key)
    if hit is None:
        cap = np.maximum(1, nwords // SLOT_FRACTION)
        slot = np.zeros(len(cap), dtype=np.int64)
        np.cumsum(cap[:-1], out=slot[1:])
        table, _ = _table([base, cur, nwords, slot, cap], _blocks(nwords), device)
        pieces = _program_pieces(_blocks(nwords), device)
        made = None
        if device.type == "cuda":
            made = torch.cuda.Event()
            made.record(torch.cuda.current_stream(device))
        hit = (table, pieces, slot, cap, made)
        if len(_FIND_TABLES) >= _FIND_TABLES_MAX:
            _FIND_TABLES.pop(next(iter(_FIND_TABLES)))
        _FIND_TABLES[key] = hit
    return hit


def _program_pieces(programs: np.ndarray, device: torch.device) -> torch.Tensor:
    """Each program's piece (int32, on ``device``): piece ``j`` repeated ``programs[j]`` times."""
    return torch.from_numpy(np.repeat(np.arange(len(programs), dtype=np.int32), programs)).to(device)


@dataclass
class Scatter:
    """One table of pieces given by byte addresses, for ``_scatter_words``: built once, then checked
    (``ok``, or ``check`` without a host sync) and applied (``apply``), one launch each."""

    table: torch.Tensor | None
    programs: int
    device: torch.device
    pieces: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # each row's piece in ``of``

    @staticmethod
    def of(dst: np.ndarray, idx: np.ndarray, words: np.ndarray, k: np.ndarray, n: np.ndarray, device) -> Scatter:
        """Pieces (int64 arrays): ``dst`` (contiguous, 8-byte aligned, ``n`` words), its ``k`` int32 indices at
        ``idx`` and ``k`` words at ``words``; those with ``k == 0`` left out (``pieces``: the others' positions)."""
        keep = k > 0
        if not keep.any():
            return Scatter(None, 0, device)
        rows = [dst[keep], idx[keep], words[keep], k[keep], n[keep]]
        return Scatter(*_table(rows, _blocks(k[keep]), device), device, np.flatnonzero(keep))

    def ok(self) -> bool:
        """Whether every index is in ``[0, n)`` of its piece (one launch, one host sync; nothing stored)."""
        if self.table is None:
            return True
        flag = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.check(flag)
        return not int(flag.item())

    def check(self, flags: torch.Tensor) -> None:
        """Launch the check of every index into ``flags`` (int32, zeroed, ``1 + len(pieces)`` or 1 of them on the
        device): ``flags[0]`` is raised where some index is outside its piece, and ``flags[1 + r]`` for row ``r``
        (piece ``pieces[r]``) where it has room. No host sync: read them later (``apply(flag=flags)`` stores
        nothing where ``flags[0]`` is raised)."""
        from refit.delta.kernels import launch_scatter_words

        if self.table is not None:
            launch_scatter_words(self.table, self.programs, flags, check=True, pieces=len(flags) > 1)

    def apply(
        self,
        stream: torch.cuda.Stream | None = None,
        keep: tuple[torch.Tensor, ...] = (),
        flag: torch.Tensor | None = None,
    ) -> None:
        """Store every word at its index (checked before: ``ok``; or, with ``flag``, by ``check(flag)`` queued
        before: nothing is stored where it raised ``flag[0]``). With ``stream`` (CUDA): on that stream, behind
        all work queued so far on the current one, and the table, ``flag`` and ``keep`` (the tensors the table
        points into) are not freed before it is done; the caller makes its stream wait for ``stream``."""
        from refit.delta.kernels import launch_scatter_words

        if self.table is None:
            return
        guard = _never_raised(self.device) if flag is None else flag
        if stream is None or self.device.type != "cuda":
            launch_scatter_words(self.table, self.programs, guard, check=False)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            launch_scatter_words(self.table, self.programs, guard, check=False)
        for t in (self.table, guard, *keep):
            t.record_stream(stream)


_ZERO_FLAGS: dict[torch.device, torch.Tensor] = {}  # per device, one int32 0 (``_never_raised``)


def _never_raised(device: torch.device) -> torch.Tensor:
    """A check flag (int32) of ``device`` that nothing raises, made once: ``Scatter.apply``'s guard when no check
    was queued before it (never written after it is made, so any stream may read it)."""
    flag = _ZERO_FLAGS.get(device)
    if flag is None:
        flag = _ZERO_FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def pack_table(found: Found, sel: np.ndarray, dst: np.ndarray, device) -> None:
    """Pieces ``sel`` of ``found`` (within their slots) into their wire format at byte addresses ``dst``
    (8-byte aligned): its indices, zero padding to 8 bytes, its words. One launch."""
    from refit.delta.kernels import launch_pack_words

    k = found.count[sel]
    keep = k > 0
    if keep.any():
        found.mark_current()
        idx, words = found.addresses(sel)
        table, programs = _table([idx[keep], words[keep], k[keep], dst[keep]], _blocks(k[keep]), device)
        launch_pack_words(table, programs)


def _ptrs(ts) -> np.ndarray:
    return np.array([t.data_ptr() for t in ts], dtype=np.int64)


def _kernels() -> bool:
    from refit.delta import kernels

    return kernels.AVAILABLE


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
        and (use_triton or (i.is_cuda and _kernels()))
        and i.device == device
        and i.dtype == torch.int32
        and i.is_contiguous()
    ]
    if on:
        sel = [pieces[j] for j in on]
        zeros = np.zeros(len(sel), dtype=np.int64)
        k = np.array([i.numel() for i, _ in sel], dtype=np.int64)
        n = np.array([n for _, n in sel], dtype=np.int64)
        if not Scatter.of(zeros, _ptrs(i for i, _ in sel), zeros, k, n, device).ok():
            return False
    skip = set(on)
    for j, (i, n) in enumerate(pieces):
        if j not in skip:
            lo, hi = torch.stack([i.min(), i.max()]).tolist()
            if lo < 0 or hi >= n:
                return False
    return True


def _kernel_items(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], use_triton: bool | None) -> list[int]:
    """The items one launch takes: contiguous int32 indices and int64 words beside an addressable destination,
    all on the first item's CUDA device (``use_triton=True``: every such item, e.g. in Triton's interpreter)."""
    if use_triton is False or not items:
        return []
    device = items[0][0].device

    def fits(d, i, w):
        ok = i.is_contiguous() and w.is_contiguous() and i.dtype == torch.int32 and w.dtype == torch.int64
        same = d.device == device and i.device == device and w.device == device
        return ok and same and i.numel() and (use_triton or addressable(d))

    return [j for j, it in enumerate(items) if fits(*it)]


def scatter_words_many(
    items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], use_triton: bool | None = None
) -> None:
    """``apply_words`` of every ``(destination, indices, words)`` (indices checked before: ``check_words_many``):
    one launch for those on one CUDA device that the kernel addresses, ``apply_words`` for the others."""
    on = _kernel_items(items, use_triton)
    if on:
        sel = [items[j] for j in on]
        k = np.array([i.numel() for _, i, _ in sel], dtype=np.int64)
        n = np.array([words_in(d) for d, _, _ in sel], dtype=np.int64)
        ptrs = [_ptrs(t[c] for t in sel) for c in range(3)]
        Scatter.of(*ptrs, k, n, sel[0][0].device).apply()
    skip = set(on)
    for j, (d, i, w) in enumerate(items):
        if j not in skip:
            apply_words(d, i.to(d.device), w.to(d.device))
