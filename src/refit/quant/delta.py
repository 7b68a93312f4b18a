"""Delta encoding of a tensor against the copy last sent: find, encode, apply. Pure torch, any device.

A refit after a small optimizer step changes few bf16 values (about 1% under RL learning rates). A
sender that keeps the last version it sent (the *base*) can send only the changed elements:

* ``find_changes(base, cur)``: the flat indices (row-major over the tensor's shape, int64) of
  the elements whose **bits** differ (so ``-0.0`` vs ``0.0`` and NaN payloads count) and their new
  values; read in chunks of at most ``chunk_bytes`` so the temporary memory is bounded whatever the
  tensor's size (strided views too).
* an **encoding** per message (``ENCODINGS``): ``dense`` (every element), ``sparse`` (int32 indices +
  values: 4 + itemsize bytes per change), ``bitmask`` (one bit per element + values: n/8 + k x
  itemsize). ``choose_encoding`` picks by the cost rule below.
* ``words`` (``refit.quant.delta_words``): changed 64-bit words, each sent whole (int32 index + 8 bytes),
  found, checked and scattered in one launch per batch on CUDA; ``choose_words`` weighs it against dense.
* ``apply_changes(dst, indices, values)``: ``dst[indices] = values`` by ``index_put_`` on the
  unravelled indices, O(changed): no pass over the whole tensor (a strided destination view too).

Cost rule (``predicted_seconds``), on measured rates (``LINKS``): a dense message costs its bytes over the
link; a delta costs reading base and current once on the sender (``2 x n x itemsize`` at the find rate),
its wire bytes over the link, the per-change work (pack, base update, the receiver's scatter:
``k x (4 + 2 x itemsize)`` bytes at the apply rate) and a fixed time per piece (the kernel launches of
those steps). The cheapest wins, dense on ties. With the H100 rates measured (find 0.78 TB/s: the find
reads two versions, so it costs about what NVLink takes to move one), a delta over NVLink does not
beat dense and the rule sends dense there; over a NIC (50 GB/s) a delta wins up to ~47% changed
(sparse below ~4%, then the bitmask) at Llama-3.1-8B shapes. On a
same-device link (S2: the engine on the trainer's GPU) a dense copy (read n, write n) is never slower
than reading two versions: ``choose_encoding`` returns dense there without looking at ``k``. Both
sides read the same rule, but only the sender decides; the message header carries its choice.

One pass on CUDA: ``refit.quant.delta_triton`` compares, compacts (and can update the base) reading each
version once; ``find_changes`` uses it for contiguous CUDA tensors when Triton is installed, and its
torch path is the kernel's reference (``tests/delta_interpret.py`` runs the kernel in Triton's
interpreter against it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from refit.errors import ConfigError, TransferError

ENCODINGS = ("dense", "sparse", "bitmask", "words")
INDEX_BYTES = 4  # sparse indices travel as int32 (a piece of 2**31 elements or more cannot be sparse)
CHECK_CHUNK = 1 << 25  # indices checked side by side per launch group (``check_indices_many``)
CHECK_ALONE = 1 << 20  # a piece with at least this many indices is checked alone (``check_indices_many``)
CHUNK_BYTES = 256 << 20  # default read size of find_changes (per version): bounds its temporaries
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(TransferError):
    """A delta cannot apply: wrong base version, malformed header or indices out of range."""


@dataclass(frozen=True)
class LinkSpeed:
    """What the encoding rule weighs for one link, all measured: ``link_gbps`` (GB/s on the wire),
    ``find_gbps`` (GB/s of base + current the sender's find reads), ``apply_gbps`` (GB/s of index +
    value bytes of the per-change work: pack, base update, scatter), ``piece_s`` (fixed seconds per
    piece diffed) and ``same_device`` (the link is the device's own memory: dense always)."""

    link_gbps: float
    find_gbps: float
    apply_gbps: float
    piece_s: float = 0.0
    same_device: bool = False
    word_find_gbps: float | None = None
    word_piece_s: float | None = None
    chunk_s: float = 0.0

    def __post_init__(self) -> None:
        if self.word_find_gbps is None:
            object.__setattr__(self, "word_find_gbps", self.find_gbps)
        if self.word_piece_s is None:
            object.__setattr__(self, "word_piece_s", self.piece_s)
        for field in ("link_gbps", "find_gbps", "apply_gbps", "word_find_gbps"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ConfigError(f"LinkSpeed.{field} must be a finite number of GB/s > 0, got {value!r}")
        for field in ("piece_s", "word_piece_s", "chunk_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"LinkSpeed.{field} must be seconds in [0, 1), got {value!r}")


# CUDA rates measured on one H100 (docs/benchmarks.md, "Delta kernels on an H100": Llama-3.1-8B shapes,
# 16.06 GB bf16, 291 pieces): find 41 ms for 32 GB read at 1% changed (Triton); pack + base update +
# apply add ~31 ms at 0.1% (per piece: ~108 us) and ~15 ms more per 7.2e8 changes (~400 GB/s of
# index + value bytes).
_H100 = {"find_gbps": 780.0, "apply_gbps": 400.0, "piece_s": 108e-6}
# Word deltas (``refit.quant.delta_words``), measured on 2x H200 (docs/benchmarks.md, "Word deltas by address"):
# the find read 2.3-2.65 TB/s; the rule takes 1.7 TB/s, that scaled to an H100's memory bandwidth (3.35 vs
# 4.8 TB/s; not measured on an H100). Per piece: 2 us (a piece is a row of the kernels' tables and of the host's
# numpy encoding; with 2 us `auto` sends the k/v projections as words, 0.37-0.41x dense at 1% on S1 against
# 0.41-0.54x with 10 us, docs/benchmarks.md "Finds behind one event"). Per chunk of a delta step (header exchange,
# the find's and the check's host syncs): 1.05 ms (S1 with 32 chunks vs 4: 54.9 vs 25.4 ms).
_WORDS = {"word_find_gbps": 1700.0, "word_piece_s": 2e-6, "chunk_s": 1.05e-3}
LINKS = {
    "same_device": LinkSpeed(1500.0, **_H100, same_device=True),  # S2: a copy on one H100 (read + write HBM)
    "nvlink": LinkSpeed(370.0, **_H100, **_WORDS),  # S1/S3: H100 NVLink, measured ~370 GB/s one way
    "nic": LinkSpeed(50.0, **_H100, **_WORDS),  # a 400 Gb/s NIC per GPU
    "cpu": LinkSpeed(2.0, 10.0, 10.0),  # gloo over loopback on a CPU host (rough; no per-piece time measured)
}
"""Speeds per kind of link (``TransferConfig.delta_link_gbps`` overrides the link's)."""


def wire_bytes(encoding: str, n: int, k: int, itemsize: int) -> int:
    """Bytes on the wire of ``k`` changed elements out of ``n`` of ``itemsize`` bytes (8-byte aligned
    segments, as ``encode`` lays them out)."""
    if encoding == "dense":
        return n * itemsize
    if encoding == "sparse":
        return _align(k * INDEX_BYTES) + _align(k * itemsize)
    if encoding == "bitmask":
        return _align((n + 7) // 8) + _align(k * itemsize)
    if encoding == "words":  # k counts changed 64-bit words
        from refit.quant.delta_words import wire_sizes

        return wire_sizes(k)
    raise ConfigError(f"delta encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")


def predicted_seconds(encoding: str, n: int, k: int, itemsize: int, link: LinkSpeed) -> float:
    """The rule's time for one message: see the module docstring."""
    wire = wire_bytes(encoding, n, k, itemsize) / (link.link_gbps * 1e9)
    if encoding == "dense":
        return wire
    if encoding == "words":  # k words of 8 bytes: index, word, base update and scatter
        find = 2 * n * itemsize / (link.word_find_gbps * 1e9)
        return find + wire + k * (INDEX_BYTES + 16) / (link.apply_gbps * 1e9) + link.word_piece_s
    find = 2 * n * itemsize / (link.find_gbps * 1e9)
    apply = k * (INDEX_BYTES + 2 * itemsize) / (link.apply_gbps * 1e9)
    return find + wire + apply + link.piece_s


def choose_encoding(pieces: list[tuple[int, int, int]], link: LinkSpeed, share: float = 0.0) -> str:
    """The cheapest encoding of one message whose pieces have ``(n, k, itemsize)`` (``k`` changes in ``n``
    elements) over ``link``: the sum of ``predicted_seconds`` over the pieces, dense on a same-device
    link and on ties; sparse never when a piece has 2**31 elements or more."""
    if link.same_device or not any(n for n, _, _ in pieces):
        return "dense"
    kinds = ["dense", "bitmask"] + (["sparse"] if all(n < 2**31 for n, _, _ in pieces) else [])
    return _cheapest(pieces, link, kinds, share)


def choose_words(pieces: list[tuple[int, int, int]], link: LinkSpeed, share: float = 0.0) -> str:
    """``"words"`` or ``"dense"`` for one message whose pieces have ``(n, k, itemsize)``, ``k`` changed 64-bit
    words in ``n`` elements (found by ``refit.quant.delta_words``): the cheaper by ``predicted_seconds``,
    dense on a same-device link and on ties."""
    if link.same_device or not any(n for n, _, _ in pieces):
        return "dense"
    return _cheapest(pieces, link, ["dense", "words"], share)


def choose_words_many(
    n: np.ndarray, k: np.ndarray, itemsize: np.ndarray, first: np.ndarray, link: LinkSpeed, share: np.ndarray
) -> np.ndarray:
    """``choose_words`` of many messages over one ``link`` at once: their pieces as numpy arrays (``n``
    elements, ``k`` changed words, ``itemsize``), message ``j``'s pieces at ``first[j]:first[j + 1]`` (at least
    one each), ``share`` per message. True where ``"words"``: the same sums, in the same order."""
    first = np.asarray(first)
    if link.same_device:
        return np.zeros(len(first) - 1, dtype=bool)
    dense = _in_order(predicted_seconds("dense", n, k, itemsize, link), first)
    words = link.chunk_s * np.asarray(share) + _in_order(predicted_seconds("words", n, k, itemsize, link), first)
    return (np.add.reduceat(n, first[:-1]) > 0) & (words < dense)


def _in_order(x: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Per message, its pieces' values (``x[first[j]:first[j + 1]]``) added one by one in order, as Python's
    ``sum`` adds them (``np.add.reduceat`` may add them in another order, and round differently)."""
    counts = np.diff(first)
    out = np.zeros(len(counts))
    for p in range(int(counts.max(initial=0))):
        has = counts > p
        out[has] += x[first[:-1][has] + p]
    return out


def _cheapest(pieces: list[tuple[int, int, int]], link: LinkSpeed, kinds: list[str], share: float = 0.0) -> str:
    """The kind of ``kinds`` with the least ``predicted_seconds`` summed over ``pieces``, earliest on ties; a
    delta also pays ``share`` (the message's part of its chunk's bytes) of the link's ``chunk_s``."""

    def cost(e: str) -> float:
        step = 0.0 if e == "dense" else link.chunk_s * share
        return step + sum(predicted_seconds(e, n, k, s, link) for n, k, s in pieces)

    return min(kinds, key=lambda e: (cost(e), ENCODINGS.index(e)))


PAY_MARGIN = 0.9
"""A delta is worth its machinery only where its best case (nothing changed) takes at most this share of
dense: the rates are measured to about 10%, and the rule leaves out the delta path's own per-step header
exchange (S1 on 2x H200, 289-291 of 291 messages sent dense through it: 1.10-1.30x the plain path,
docs/benchmarks.md)."""


TYPICAL_FRACTION = 0.01  # the changed fraction ``prefer_words`` weighs (RL steps on bf16: ~1%)


def words_changed(fraction: float, itemsize: int) -> float:
    """The share of 64-bit words that change where ``fraction`` of the elements (``itemsize`` bytes each)
    change independently: ``1 - (1 - fraction)**(8 // itemsize)``."""
    return 1 - (1 - fraction) ** max(1, 8 // itemsize)


def prefer_words(pieces: list[tuple[int, int]], link: LinkSpeed) -> bool:
    """Whether a message whose pieces have ``(n, itemsize)`` (all with whole 64-bit words) is better found per
    word than per element over ``link``, at ``TYPICAL_FRACTION`` of its elements changed (each word of ``E``
    elements then changes with probability ``1 - (1 - f)**E``): the words' predicted time against the best
    element encoding's. Words read faster and pay less per piece; elements send fewer bytes (FP8 over a NIC:
    5% of dense per element, 11.5% per word)."""
    f = TYPICAL_FRACTION
    words = [(n, round(words_changed(f, s) * n * s / 8), s) for n, s in pieces]
    elements = [(n, round(f * n), s) for n, s in pieces]
    kinds = ["bitmask"] + (["sparse"] if all(n < 2**31 for n, _ in pieces) else [])
    by_word = sum(predicted_seconds("words", n, k, s, link) for n, k, s in words)
    return by_word <= min(sum(predicted_seconds(e, n, k, s, link) for n, k, s in elements) for e in kinds)


def best_case(pieces: list[tuple[int, int]], link: LinkSpeed, words: bool = False) -> float:
    """The rule's time for a delta of a message whose pieces have ``(n, itemsize)`` when nothing changed: its
    cheapest encoding (``words``: found per 64-bit word, then that is its only one); ``inf`` on a
    same-device link or for an empty message."""
    if link.same_device or not any(n for n, _ in pieces):
        return math.inf
    if words:
        kinds = ["words"]
    else:
        kinds = ["bitmask"] + (["sparse"] if all(n < 2**31 for n, _ in pieces) else [])
    return min(sum(predicted_seconds(e, n, 0, s, link) for n, s in pieces) for e in kinds)


def may_pay(pieces: list[tuple[int, int]], link: LinkSpeed, words: bool = False, share: float = 0.0) -> bool:
    """Whether a delta of a message whose pieces have ``(n, itemsize)`` can pay over ``link``: with nothing
    changed (``best_case``), plus ``share`` (its part of its chunk's bytes) of ``link.chunk_s``, it takes at
    most ``PAY_MARGIN`` of dense (never on a same-device link)."""
    dense = sum(predicted_seconds("dense", n, 0, s, link) for n, s in pieces)
    return best_case(pieces, link, words) + link.chunk_s * share <= PAY_MARGIN * dense


def _align(nbytes: int) -> int:
    return (nbytes + 7) // 8 * 8


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (bitwise comparison; no copy)."""
    return t.view(_BITS[t.element_size()])


def _row_chunks(t: torch.Tensor, chunk_bytes: int):
    """``(start element, chunk)`` over ``t``'s leading dim, each at most ``chunk_bytes`` (one row at least)."""
    if t.dim() == 0:
        yield 0, t.reshape(1)
        return
    row = t[0].numel() if t.shape[0] else 0
    rows = max(1, chunk_bytes // max(1, row * t.element_size()))
    for r in range(0, t.shape[0], rows):
        yield r * row, t[r : r + rows]


def find_changes(
    base: torch.Tensor, cur: torch.Tensor, chunk_bytes: int = CHUNK_BYTES, use_triton: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices (int64, row-major over the shape) of the elements of ``cur`` whose bits differ from
    ``base``, and ``cur``'s values there. Same shape and dtype; any strides; ``base`` may live on another
    device (a pinned host copy: each chunk is copied to ``cur``'s device first). The torch path returns
    the indices sorted; the one-pass kernel (``use_triton``; default: both contiguous on one CUDA device
    with Triton installed) sorted by chunk, in no particular order inside one (every consumer here is
    order-free)."""
    if base.shape != cur.shape or base.dtype != cur.dtype:
        raise ValueError(f"find_changes: base {list(base.shape)} {base.dtype} vs current {list(cur.shape)} {cur.dtype}")
    if use_triton is None:
        use_triton = _kernel_fits(base, cur)
    if use_triton:
        return _find_kernel(base, cur, chunk_bytes)
    idx, vals = [], []
    for (start, b), (_, c) in zip(_row_chunks(base, chunk_bytes), _row_chunks(cur, chunk_bytes)):
        b = b.to(c.device, non_blocking=True)
        changed = (bits(b) != bits(c)).reshape(-1)
        nz = changed.nonzero().squeeze(1)
        idx.append(nz + start)
        vals.append(c.reshape(-1)[nz])
    if not idx:
        return torch.empty(0, dtype=torch.int64, device=cur.device), cur.new_empty(0)
    return torch.cat(idx), torch.cat(vals)


def _kernel_fits(base: torch.Tensor, cur: torch.Tensor) -> bool:
    from refit.quant import delta_triton

    return (
        delta_triton.AVAILABLE
        and cur.is_cuda
        and base.device == cur.device
        and base.is_contiguous()
        and cur.is_contiguous()
    )


def _find_kernel(base: torch.Tensor, cur: torch.Tensor, chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``find_changes`` through the one-pass kernel (``refit.quant.delta_triton``), chunk by chunk."""
    from refit.quant.delta_triton import diff_compact

    b, c = bits(base).reshape(-1), bits(cur).reshape(-1)
    step = max(1, chunk_bytes // cur.element_size())
    idx, vals = [], []
    for s in range(0, c.numel(), step):
        i, v, _ = diff_compact(b[s : s + step], c[s : s + step], start=s)
        idx.append(i.clone())  # copied out, so the chunk's slots are freed now
        vals.append(v.view(cur.dtype).clone())
    if not idx:
        return torch.empty(0, dtype=torch.int64, device=cur.device), cur.new_empty(0)
    return torch.cat(idx), torch.cat(vals)


def find_changes_many(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    chunk_bytes: int = CHUNK_BYTES,
    use_triton: bool | None = None,
    copy: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``find_changes`` of every ``(base, cur)`` pair (the pieces of one message). Pairs the one-pass
    kernel takes (contiguous, one CUDA device, at most ``chunk_bytes``) are launched together with one
    host sync for all of them, into slots for a quarter of their elements (a pair with more changes is
    found again by ``find_changes``, with every slot); the rest go through ``find_changes``. ``use_triton``: as
    ``find_changes``' (True: every pair that fits the chunk, e.g. in Triton's interpreter). ``copy=False``:
    the kernel's pairs come back as views of their slots (no copy, two launches less per pair; the slots,
    a quarter of the pair's elements each, stay allocated while a view is held: drop them soon)."""
    out: list = [None] * len(pairs)
    fits = [
        i
        for i, (b, c) in enumerate(pairs)
        if c.numel() * c.element_size() <= chunk_bytes and (_kernel_fits(b, c) if use_triton is None else use_triton)
    ]
    if fits:
        counts, slots = launch_many([pairs[i] for i in fits])
        for i, k, (idx, vals) in zip(fits, counts.tolist(), slots):
            if k <= len(idx):  # copied out (``copy``), so the slots are freed now
                idx, vals = idx[:k], vals[:k].view(pairs[i][1].dtype)
                out[i] = (idx.clone(), vals.clone()) if copy else (idx, vals)
    return [o if o is not None else find_changes(b, c, chunk_bytes, use_triton) for o, (b, c) in zip(out, pairs)]


def launch_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    """Enqueue the one-pass kernel for every ``(base, cur)`` pair (contiguous, one device), no host sync:
    ``(counts, slots)``, each pair's true number of changes (int32 on the device) and its ``(indices,
    bits)`` slots for a quarter of its elements (``find_changes_many`` reads them after one sync)."""
    from refit.quant.delta_triton import launch

    counts = torch.zeros(len(pairs), dtype=torch.int32, device=pairs[0][1].device)
    slots = []
    for j, (b, c) in enumerate(pairs):
        cap = max(1024, c.numel() // 4)
        idx, vals = torch.empty(cap, dtype=torch.int64, device=c.device), bits(c.new_empty(cap))
        launch(bits(b).reshape(-1), bits(c).reshape(-1), idx, vals, counts[j : j + 1])
        slots.append((idx, vals))
    return counts, slots


def apply_changes(dst: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``dst``'s elements at flat row-major ``indices`` become ``values``: one ``index_put_``, O(changed),
    on any strides. ``indices`` must lie in ``[0, dst.numel())`` (``check_indices``)."""
    if not indices.numel():
        return
    if dst.is_contiguous():
        dst.view(-1).index_put_((indices.long(),), values)
    else:
        dst.index_put_(torch.unravel_index(indices.long(), dst.shape), values)


def check_indices(indices: torch.Tensor, n: int, what: str) -> None:
    """A received index list is within ``[0, n)`` (``DeltaError`` naming ``what``): a bad index must never
    reach a scatter (on CUDA it would be a device-side assert). One reduction over the indices."""
    if indices.numel():
        lo, hi = torch.stack([indices.min(), indices.max()]).tolist()
        if lo < 0 or hi >= n:
            raise DeltaError(f"{what}: delta index {lo if lo < 0 else hi} is outside the piece's {n} elements")


def check_indices_many(pieces: list[tuple[torch.Tensor, int]], what: str) -> None:
    """``check_indices`` of every ``(indices, n)`` with one host sync (per device) for all of them. A piece of at least
    ``CHECK_ALONE`` indices is checked alone (its min and max: two reads); smaller ones side by side against
    each piece's bound, ``CHECK_CHUNK`` indices at a time (a few launches per chunk, not two per piece, where
    launches cost more than the reads; extra memory at most a chunk). Where one is out of range, the pieces
    one by one name it."""
    pieces = [(i, n) for i, n in pieces if i.numel()]
    if not pieces:
        return
    flags = [_out_of_range([p]) for p in pieces if p[0].numel() >= CHECK_ALONE]
    groups: dict[tuple, tuple[list[tuple[torch.Tensor, int]], list[int]]] = {}  # (dtype, device) -> pieces, size
    for i, n in (p for p in pieces if p[0].numel() < CHECK_ALONE):
        group, size = groups.setdefault((i.dtype, i.device), ([], [0]))
        if group and size[0] + i.numel() > CHECK_CHUNK:
            flags.append(_out_of_range(group))
            group.clear()
            size[0] = 0
        group.append((i, n))
        size[0] += i.numel()
    flags += [_out_of_range(list(g)) for g, _ in groups.values() if g]
    if not any(bool(f) for f in _per_device_any(flags)):  # one host sync per device
        return
    for i, n in pieces:  # name the first bad index (an error path: a sync per piece is fine)
        check_indices(i, n, what)
    raise DeltaError(f"{what}: a delta index is outside its piece (found by the joint check, not per piece)")


def _per_device_any(flags: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flags`` (0-d bools) reduced to one per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return [torch.stack(fs).any() for fs in by_device.values()]


def _out_of_range(group: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Whether an index of ``group`` (one dtype, one device) is outside its piece: a 0-d bool tensor."""
    if len(group) == 1:
        i, n = group[0]
        return (i.min() < 0) | (i.max() >= n)
    flat = torch.cat([i.reshape(-1) for i, _ in group])
    sizes = torch.tensor([n for _, n in group], dtype=torch.int64).to(flat.device, non_blocking=True)
    counts = torch.tensor([i.numel() for i, _ in group], dtype=torch.int64).to(flat.device, non_blocking=True)
    limits = torch.repeat_interleave(sizes, counts, output_size=flat.numel())
    return ((flat < 0) | (flat >= limits)).any()


def encode(encoding: str, n: int, indices: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """Write one piece's changes as ``encoding`` into ``out`` (uint8, ``wire_bytes`` long): sparse: int32
    indices, then values; bitmask: bit i of byte i // 8 set for every changed element, then values (each
    segment 8-byte aligned). ``dense`` is not encoded here (the piece travels as it lies)."""
    k, size = indices.numel(), values.element_size()
    if encoding == "sparse":
        head = _align(k * INDEX_BYTES)
        out[: k * INDEX_BYTES].view(torch.int32).copy_(indices)
    elif encoding == "bitmask":
        head = _align((n + 7) // 8)
        mask = torch.zeros(head * 8, dtype=torch.bool, device=out.device)
        mask[indices] = True
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=out.device)
        out[:head].copy_((mask.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8))
    else:
        raise ValueError(f"encode: {encoding!r} is not a delta encoding")
    out[head : head + k * size].view(values.dtype).copy_(values)


def decode(
    encoding: str, n: int, k: int, payload: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``encode``: ``(indices, values)`` of one piece from its ``wire_bytes`` payload."""
    size = torch.empty(0, dtype=dtype).element_size()
    if encoding == "sparse":
        head = _align(k * INDEX_BYTES)
        indices = payload[: k * INDEX_BYTES].view(torch.int32)
    elif encoding == "bitmask":
        head = _align((n + 7) // 8)
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        mask = ((payload[:head, None] >> shifts) & 1).view(-1)[:n]
        indices = mask.nonzero().squeeze(1)
        if indices.numel() != k:
            raise DeltaError(f"a bitmask delta marks {indices.numel()} elements, its header says {k}")
    elif encoding == "words":  # k 64-bit words (``refit.quant.delta_words``)
        from refit.quant.delta_words import index_bytes

        head = index_bytes(k)
        return payload[: k * INDEX_BYTES].view(torch.int32), payload[head : head + k * 8].view(torch.int64)
    else:
        raise ValueError(f"decode: {encoding!r} is not a delta encoding")
    return indices, payload[head : head + k * size].view(dtype)
