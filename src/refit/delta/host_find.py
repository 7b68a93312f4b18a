"""The changed elements of many CPU pieces, found through their 64-bit words (numpy).

A piece whose base and current version are both contiguous host memory of whole 64-bit words (``by_words``) is
compared a word at a time: one vectorized ``not_equal`` per piece into a flag buffer of this thread's, then the flags
compacted (the groups of eight words with a changed one first, through a 64-bit view of the flags, then the flags of
those groups), and only the changed words compared element by element (``changed_elements``). ``find_words`` does
it for many pieces at once, on their int64 views (``words_of``): the flags of consecutive small pieces side by side
(``BATCH_WORDS``), compacted once for all of them and cut by piece, so that a refit of many small tensors does not
pay the compaction's numpy calls and the per-piece checks of ``find_changes`` for each; ``find_many`` is the same
over tensors. ``find`` is one piece, in passes of at most ``chunk_bytes`` (``refit.delta.elements.find_changes``
calls it).

Results as ``find_changes``': the flat indices (int64, ascending) of the elements whose bits differ and their
values; ``(None, None)`` for a piece with more than its ``most`` changed words (none compared element by element:
the caller sends it dense).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

SCRATCH_WORDS = 1 << 20  # words compared per numpy call: their flags fit in L2
# ``find_many``: pieces of at most this many words in all compacted together (both versions' bytes of them fit in
# L2, where their changed words are gathered from after the compaction; larger pieces alone, as ``find``)
BATCH_WORDS = 1 << 17
_SCRATCH = threading.local()
_BITS_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # numpy's integer types of each element size

Found = tuple[torch.Tensor | None, torch.Tensor | None]


def by_words(base: torch.Tensor, cur: torch.Tensor) -> bool:
    """Both on the CPU, contiguous, 8-byte aligned, whole 64-bit words: readable as words here."""
    return all(
        t.device.type == "cpu" and t.is_contiguous() and t.data_ptr() % 8 == 0 and t.numel() * t.element_size() % 8 == 0
        for t in (base, cur)
    )


def find(base: torch.Tensor, cur: torch.Tensor, chunk_bytes: int, most: int | None = None) -> Found:
    """One piece (``by_words``) in passes of at most ``chunk_bytes`` (and ``BATCH_WORDS`` words)."""
    step = max(8, min(chunk_bytes // 8, BATCH_WORDS) // 8 * 8)
    return _torch(find_alone(words_of(base), words_of(cur), cur.element_size(), step, most), cur)


def find_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], most: Sequence[int | None]) -> list[Found]:
    """``find`` of every ``(base, cur)`` pair (each ``by_words``), through ``find_words``."""
    words = [(words_of(b), words_of(c)) for b, c in pairs]
    got = find_words(words, [c.element_size() for _, c in pairs], most)
    return [_torch(g, c) for g, (_, c) in zip(got, pairs)]


def find_words(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    sizes: Sequence[int],
    most: Sequence[int | None],
    update: bool = False,
) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """The changes of every ``(base words, words)`` pair (int64 views of whole pieces whose elements are
    ``sizes`` bytes): per pair the flat indices (int64, ascending) of its changed elements and their bits (the
    integer type of their size), ``(None, None)`` over its ``most`` changed words. The flags of consecutive pieces
    of at most ``BATCH_WORDS`` words in all side by side (each from an offset that is a multiple of 8, padded with
    unset flags) and compacted together; a piece larger than that alone (``find_alone``). ``update``: each base's
    changed words become the current ones as they are found (while in cache): a pair found whole then has its
    base equal to it; one stopped over its ``most`` may have part of its base updated."""
    out: list = [None] * len(pairs)
    flags = _scratch()
    batch: list[tuple[int, int]] = []  # (pair, offset of its flags)
    at = 0
    for i, (bw, cw) in enumerate(pairs):
        n = len(cw)
        if n > BATCH_WORDS or at + n > BATCH_WORDS:
            _cut(batch, flags[:at], pairs, sizes, most, out, update)
            batch, at = [], 0
        if n > BATCH_WORDS:  # alone, in passes (its changed words gathered while they are in cache)
            out[i] = find_alone(bw, cw, sizes[i], BATCH_WORDS, most[i], update)
            continue
        np.not_equal(bw, cw, out=flags[at : at + n])
        end = -(-(at + n) // 8) * 8
        flags[at + n : end] = False
        batch.append((i, at))
        at = end
    _cut(batch, flags[:at], pairs, sizes, most, out, update)
    return out


def find_alone(bw: np.ndarray, cw: np.ndarray, size: int, step: int, most: int | None, update: bool = False):
    """``find_words`` of one pair, in passes of ``step`` words (a multiple of 8), each pass's changed elements
    read from its words while they are in cache (and, ``update``, its base's changed words written)."""
    idx, vals, seen = [], [], 0
    for s in range(0, max(1, len(cw)), step):
        b, c = bw[s : s + step], cw[s : s + step]
        words = changed_words(b, c)
        seen += len(words)
        if most is not None and seen > most:
            return None, None
        i, v = changed_elements(b, c, words, size, update)
        idx.append(i + s * (8 // size))
        vals.append(v)
    return (idx[0], vals[0]) if len(idx) == 1 else (np.concatenate(idx), np.concatenate(vals))


def _cut(batch, flags: np.ndarray, pairs, sizes, most, out: list, update: bool) -> None:
    """The set ``flags`` of ``batch``'s pieces compacted at once, then cut by piece into ``out``."""
    if not batch:
        return
    pos = _set_flags(flags)
    cuts = np.searchsorted(pos, [o for _, o in batch]).tolist() + [len(pos)]
    for k, (i, o) in enumerate(batch):
        words = pos[cuts[k] : cuts[k + 1]] - o
        m = most[i]
        over = m is not None and len(words) > m
        out[i] = (None, None) if over else changed_elements(*pairs[i], words, sizes[i], update)


def changed_words(bw: np.ndarray, cw: np.ndarray) -> np.ndarray:
    """The indices (int64, ascending) of the words where ``bw`` and ``cw`` (int64, at most ``SCRATCH_WORDS``)
    differ: their flags in this thread's scratch, then ``_set_flags``."""
    n = len(bw)
    flags = _scratch()[: -(-n // 8) * 8]
    np.not_equal(bw, cw, out=flags[:n])
    flags[n:] = False
    return _set_flags(flags)


def _set_flags(flags: np.ndarray) -> np.ndarray:
    """The indices (int64, ascending) of the set ``flags`` (a multiple of 8 of them, 8-byte aligned): the groups
    of eight with one set found through a 64-bit view of the flags, then the set flags of those groups (two
    compactions over an eighth of the flags and the changed groups', not one over all of them)."""
    groups = flags.view(np.uint64)
    g = np.flatnonzero(groups != 0)
    p = np.flatnonzero(groups[g].view(np.bool_))  # each changed group's eight flags, one after another
    return (g[p >> 3] << 3) + (p & 7)


def changed_elements(
    bw: np.ndarray, cw: np.ndarray, words: np.ndarray, size: int, update: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """The flat indices (int64, ascending) of the changed elements (``size`` bytes each) inside the changed
    ``words`` of ``bw`` / ``cw``, and their bits in ``cw`` (an integer type of ``size`` bytes): read from the two
    gathered copies of those words, not from the whole tensors. ``update``: then ``bw``'s changed words become
    ``cw``'s."""
    got = cw[words]
    old = bw[words] if size != 8 else None
    if update:
        bw[words] = got
    if size == 8:
        return words, got
    per, shift = 8 // size, (8 // size).bit_length() - 1  # per is 2, 4 or 8
    lanes = _BITS_NP[size]
    at = np.flatnonzero((old ^ got).view(lanes) != 0)  # changed elements of the gathered words (a bool
    # mask first: numpy compacts one 4x faster than the lanes themselves)
    return (words[at >> shift] << shift) + (at & (per - 1)), got.view(lanes)[at]


def _torch(found: tuple, cur: torch.Tensor) -> Found:
    """``find_words``' result for one piece as tensors (the values in ``cur``'s dtype)."""
    idx, vals = found
    return (None, None) if idx is None else (from_numpy(idx), from_numpy(vals).view(cur.dtype))


def words_of(t: torch.Tensor) -> np.ndarray:
    """``t`` (``by_words``) as a flat int64 numpy view of its 64-bit words."""
    return t.reshape(-1).view(torch.int64).numpy()


def _scratch() -> np.ndarray:
    """This thread's ``SCRATCH_WORDS`` flags (allocated once, 8-byte aligned: no page faults per piece; read eight
    at a time as one 64-bit word)."""
    flags = getattr(_SCRATCH, "flags", None)
    if flags is None or len(flags) < SCRATCH_WORDS:
        flags = _SCRATCH.flags = np.zeros(SCRATCH_WORDS // 8, dtype=np.uint64).view(np.bool_)
    return flags


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(a)``, an empty ``a`` as a fresh empty tensor (numpy's empty arrays come out with stride
    0, which byte views refuse)."""
    t = torch.from_numpy(a)
    return t if a.size else torch.empty(0, dtype=t.dtype)
