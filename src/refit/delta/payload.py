"""A step-chunk's payloads to one peer as one P2P message: the deltas one after another, then the small dense
messages (``join_payloads``); a sender's words by address packed in one launch (``_pack_spans``), its base
update read back from the packed buffer (``SourceBase.defer_packed``).
"""

from __future__ import annotations

import contextlib
from itertools import accumulate

import numpy as np
import torch

from refit.cudart import joined
from refit.delta.base import SourceBase
from refit.delta.ops import DeltaOp, by_peer, memoized, pieces_of
from refit.delta.wire import index_bytes, wire_sizes
from refit.delta.words import Found, pack_table, side_stream
from refit.transport.p2p import _Op


def payload_msgs(
    ops: list[DeltaOp], base: SourceBase | None = None, send: bool = False
) -> tuple[list[tuple[int, torch.Tensor, int]], list[_Op]]:
    """``(peer, tensor, tag)`` to post: each large dense message as itself; the deltas to (from) one peer and
    its small dense messages (``DeltaOp.flat``) as one buffer, their payloads one after another (``join_payloads``:
    every delta's ``payload`` is its slice of it; a sender's ``base`` defers the update of what went as words
    by address to its buffer, ``SourceBase.defer_packed``; ``send``: the small dense messages are copied in,
    else received there and copied out by ``apply_received``), under its first message's tag. And per posted message
    the op that names it in an error."""
    out, named = [], []
    for peer, group in by_peer(ops):
        deltas, small = [], []
        for d in group:
            if d.kind != "dense":
                deltas.append(d)
            elif d.flat is not None:
                small.append(d)
            else:
                out.append((peer, d.payload, d.op.tag))
                named.append(d.op)
        if deltas or small:
            out.append((peer, join_payloads(deltas, base, small, send), (deltas or small)[0].op.tag))
            named.append((deltas or small)[0].op)
    return out, named


def join_payloads(
    deltas: list[DeltaOp], base: SourceBase | None = None, small: list[DeltaOp] = (), send: bool = False
) -> torch.Tensor:
    """One uint8 buffer holding the deltas' payloads one after another, then the bytes of the ``small`` dense
    messages (``_join_small``); each delta's ``payload`` becomes its slice. A sender's payloads (and words'
    ``parts``) are copied in by one ``torch.cat``, its words by address packed (``_pack_spans``) and their base
    update deferred to the buffer (``base``, ``SourceBase.defer_packed``); a receiver's are sized only
    (``device="meta"``) and filled by the receive. A lone message whose payload exists goes as itself."""
    alone = deltas[0] if len(deltas) == 1 and not small else small[0] if len(small) == 1 and not deltas else None
    if alone is not None and alone.payload is not None and alone.payload.device.type != "meta":
        return alone.payload
    extra = sum(d.flat.numel() for d in small)
    if deltas and deltas[0].found is not None and all(d.found is not None for d in deltas) and one_run(deltas):
        buf = _join_run(deltas, base, extra)
    elif deltas:
        buf = _join_any(deltas, base, extra)
    else:
        buf = torch.empty(extra, dtype=torch.uint8, device=small[0].op.tensor.device)
    if small:
        _join_small(small, buf[buf.numel() - extra :], send)
    return buf


def _join_any(deltas: list[DeltaOp], base: SourceBase | None, extra: int) -> torch.Tensor:
    """``join_payloads``'s deltas in a buffer of their bytes and ``extra`` more, slice by slice."""
    sizes = [d.wire if d.payload is None else d.payload.numel() for d in deltas]
    buf = torch.empty(sum(sizes) + extra, dtype=torch.uint8, device=deltas[0].op.tensor.device)
    packs: dict[int, tuple[Found, list, list]] = {}  # words by address, per find: (first piece, end, offset), ops
    parts = buf.split([*sizes, extra])  # one call for the slices
    for d, off, part in zip(deltas, accumulate(sizes, initial=0), parts):
        if d.found is not None:  # a sender's words by address: packed below, one launch per find
            found, spans, ops = packs.setdefault(id(d.found[0]), (d.found[0], [], []))
            spans.append((*d.found[1:], off))
            ops.append(d)
            d.found = None
        else:
            if d.parts or (d.payload is not None and d.payload.device.type != "meta"):  # a sender's, copied in
                torch.cat(d.parts or [d.payload], out=part)
            d.payload, d.parts = part, []
    rows = [_pack_spans(found, np.array(spans, dtype=np.int64), buf, ops) for found, spans, ops in packs.values()]
    if rows and base is not None:
        base.defer_packed(tuple(np.concatenate(c) for c in zip(*rows)), buf)
    return buf


def _join_run(deltas: list[DeltaOp], base: SourceBase | None, extra: int = 0) -> torch.Tensor:
    """``join_payloads`` of a sender's deltas that are one run of one find's pieces (words by address, ``one_run``),
    in a buffer of their bytes and ``extra`` more: packed by one launch, no slice per delta."""
    found, first, end = deltas[0].found[0], deltas[0].found[1], deltas[-1].found[2]
    buf = torch.empty(sum(d.wire for d in deltas) + extra, dtype=torch.uint8, device=deltas[0].op.tensor.device)
    rows = _pack_spans(found, np.array([[first, end, 0]], dtype=np.int64), buf, deltas)
    if base is not None:
        base.defer_packed(rows, buf)
    for d in deltas:
        d.found = None
    return buf


def _join_small(small: list[DeltaOp], out: torch.Tensor, send: bool) -> None:
    """The small dense messages' bytes (``DeltaOp.flat``) one after another in ``out``: a sender copies them in
    (one launch, on the ``"send"`` stream beside the next chunk's find, as ``_pack_spans``); a receiver's
    ``payload`` becomes its slice, copied out by ``apply_received`` once received."""
    flats = memoized(small, ("flats",), lambda ops: [d.flat for d in ops])
    if send:
        with send_stream(out.device):
            torch.cat(flats, out=out)
        return
    for d, part in zip(small, out.split([f.numel() for f in flats])):
        d.payload = part


def _pack_spans(found: Found, spans: np.ndarray, buf: torch.Tensor, ops: list[DeltaOp]) -> tuple:
    """Pack pieces of ``found`` into ``buf`` in one launch: per row of ``spans`` (first piece, end, byte offset
    in ``buf``; one row per op of ``ops``, whose pieces they are) those pieces one after another from that offset,
    each in its wire format. Returns the base update it makes possible, read from ``buf``: per piece with
    changes of an op no other message shares (``Pieces.mine``), ``(base address, index address, word address,
    changes, words)`` (numpy int64 each; ``Scatter.of``'s rows)."""
    lengths = spans[:, 1] - spans[:, 0]
    sel = np.repeat(spans[:, 0] - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
    k = found.count[sel]
    sizes = wire_sizes(k)
    before = np.cumsum(sizes) - sizes  # bytes before each piece, over all spans
    first = np.cumsum(lengths) - lengths
    dst = (buf.data_ptr() + np.repeat(spans[:, 2] - before[first], lengths) + before).astype(np.int64)
    with send_stream(buf.device):  # beside the next chunk's find
        pack_table(found, sel, dst, buf.device)
    s = pieces_of(ops)
    keep = s.mine & (k > 0) & (k <= found.cap[sel])
    return s.ptrs[0][keep], dst[keep], dst[keep] + index_bytes(k[keep]), k[keep], s.nwords[keep]


def word_parts(idx: torch.Tensor, words: torch.Tensor) -> list[torch.Tensor]:
    """One piece's word payload as byte views: its int32 indices, zero padding to 8 bytes, its words."""
    if len(idx) % 2 == 0:
        return [idx.view(torch.uint8), words.view(torch.uint8)]
    pad = _PADS.get(idx.device)
    if pad is None:
        pad = _PADS[idx.device] = torch.zeros(4, dtype=torch.uint8, device=idx.device)
    return [idx.view(torch.uint8), pad, words.view(torch.uint8)]


_PADS: dict[torch.device, torch.Tensor] = {}  # 4 zero bytes per device (``word_parts``), made once


def one_run(fast: list[DeltaOp]) -> bool:
    """Whether the ``found`` of ``fast`` (each op's ``(Found, first piece, end)``) are one find's pieces, one op's
    after the other's, as many as their pieces (``pieces_of``)."""
    f, total = fast[0].found[0], int(pieces_of(fast).first[-1])
    if fast[-1].found[2] - fast[0].found[1] != total or not all(d.found[0] is f for d in fast):
        return False
    return [d.found[1] for d in fast[1:]] == [d.found[2] for d in fast[:-1]]


def send_stream(device: torch.device):
    """On a CUDA sender, what runs inside (a chunk's packing) is queued on the device's high-priority ``"send"``
    side stream, behind everything queued on the current stream so far, and the current stream then waits for it
    (``cudart.joined``). The next chunk's find, queued before on its own stream, fills the device with its
    blocks: a kernel of the current stream's default priority would start only once they are all scheduled, this
    one starts at once, and so do the payload's sends behind it where the NCCL group's streams are of high
    priority too (``ProcessGroupNCCL.Options(is_high_priority_stream=True)``). A kernel inside reading tensors
    made on another stream marks them for this one (``record_stream``). On CPU: nothing."""
    return joined(side_stream(device, "send"), device) if device.type == "cuda" else contextlib.nullcontext()
