"""The receiver's side of a delta run: each message's header checked and its payload sized
(``receive_into``; one peer's at once where every header passes, ``headers_at_once``), then a chunk's indices
checked and its changes applied (``apply_received``; words by address checked on the device and scattered
without a host sync, ``scatter_by_address``, the checks read once at the run's end, ``verify_checks``; a NIXL
receiver's sparse deltas into host memory through numpy, ``host_sparse`` and ``scatter_host``).
"""

from __future__ import annotations

import numpy as np
import torch

from refit.delta.elements import apply_changes, bits, check_indices_many
from refit.delta.header import check_header
from refit.delta.ops import DeltaOp, pieces_of
from refit.delta.wire import ENCODINGS, INDEX_BYTES, DeltaError, decode, index_bytes, piece_wire, wire_sizes
from refit.delta.words import Scatter, check_words_many, scatter_words_many, side_stream, words_in
from refit.transport.clock import RunClock


def receive_into(d: DeltaOp, header: list[int] | None, version: int, held: int | None, me: str) -> None:
    """Check ``d``'s received header and size its payload (dense: the plain op's tensor; a delta: an
    unallocated tensor of its length, made a slice of its peer's buffer by ``join_payloads``). ``header`` None:
    a quiet refit, dense; ``me`` names this receiver in an error."""
    if header is None:  # a quiet refit: dense, no header
        d.kind, d.changes = "dense", [0] * len(d.views)
    else:
        d.kind, d.changes = check_header(header, d.numels, version, held, d.op, me, d.nwords)
    if d.kind == "dense":
        d.payload = d.op.tensor
    else:
        n = sum(piece_wire(d.kind, v, k) for v, k in zip(d.views, d.changes))
        d.payload = torch.empty(n, dtype=torch.uint8, device="meta")


def headers_at_once(group: list[DeltaOp], got: list[int], version: int, held: int | None) -> bool:
    """``receive_into`` at once (numpy) of one peer's ops whose headers (``got``) all say words or dense of this
    ``version``: words on the base ``held``, every count within its piece's words; dense with every count 0 (as
    a sender writes them). False otherwise, nothing set (op by op, ``check_header`` then names what is wrong).
    A chunk of a few dense messages among many of words (``auto``: a norm's few KiB go dense) takes no Python
    step per op but for its dense ones."""
    s, h = pieces_of(group), np.array(got, dtype=np.int64)
    starts = s.heads
    if len(h) != len(s.counted):
        return False
    kind = h[starts]
    words, dense = kind == ENCODINGS.index("words"), kind == ENCODINGS.index("dense")
    if not (words | dense).all() or (h[starts + 2] != version).any():
        return False
    if words.any() and (held is None or (h[starts + 1][words] != held).any()):
        return False
    k = h[s.counted]
    if ((k < 0) | (k > np.where(np.repeat(words, np.diff(s.first)), s.nwords, 0))).any():
        return False
    wire, counts = np.add.reduceat(wire_sizes(k), s.first[:-1]).tolist(), k.tolist()
    for d, w, (a, b), by_words in zip(group, wire, s.spans, words.tolist()):
        if by_words:
            d.kind, d.changes, d.payload, d.wire = "words", counts[a:b], None, w
        else:
            d.kind, d.changes, d.payload = "dense", counts[a:b], d.op.tensor
    return True


def apply_received(recvs: list[DeltaOp]) -> tuple | None:
    """Check every delta's indices first (one host sync per kind: a bad index raises ``DeltaError``
    naming its message before anything of the chunk is written; words by address: ``scatter_by_address``, checked on
    the device, nothing of the chunk's words stored if one is bad, named at the run's end), then unpack the
    dense messages (a small one first copied out of its peer's joined buffer) and scatter the deltas into their
    views."""
    todo, words, fast = [], [], [d for d in recvs if d.kind == "words" and d.fast]
    for d in recvs:
        if d.kind == "dense" or (d.kind == "words" and d.fast):
            continue
        off = 0
        for v, k in zip(d.views, d.changes):
            n = piece_wire(d.kind, v, k)
            (words if d.kind == "words" else todo).append(
                (d, v, *decode(d.kind, v.numel(), k, d.payload[off : off + n], v.dtype))
            )
            off += n
    _named(lambda group: check_words_many([(i, words_in(v)) for _, v, i, _ in group]), words)
    try:
        check_indices_many([(idx, v.numel()) for _, v, idx, _ in todo], "delta")
    except DeltaError:
        for d, v, idx, _ in todo:  # name the message
            check_indices_many([(idx, v.numel())], f"delta from process {d.op.peer} ({d.op.what()})")
        raise
    joined = [d for d in recvs if d.kind == "dense" and d.payload is not d.op.tensor]  # ``_join_small``
    if joined:
        torch._foreach_copy_([d.flat for d in joined], [d.payload for d in joined])
    for d in recvs:
        if d.kind == "dense":
            for bv, tv in d.op.pack:
                tv.copy_(bv)
    for _, v, idx, vals in todo:
        apply_changes(v, idx, vals)
    scatter_words_many([(v, idx, w) for _, v, idx, w in words])
    return scatter_by_address(fast) if fast else None


def host_sparse(recvs: list[DeltaOp]) -> tuple[list[tuple], list[DeltaOp]]:
    """Of received deltas, the sparse ones of one piece into a contiguous host view from a host payload, read
    through numpy: their indices checked at once, each inside its piece (``DeltaError`` naming the first message
    with one outside and the index, before anything is written) and widened together, returned as
    ``(destination bits, indices, value bits)`` for ``scatter_host``; and the others (for ``apply_received``)."""
    items, rest, idx, bound = [], [], [], []
    for d in recvs:
        dst = _host_dst(d)
        if dst is None or d.kind != "sparse" or d.payload is None or d.payload.device.type != "cpu":
            rest.append(d)
            continue
        k, raw = d.changes[0], d.payload.numpy()
        idx.append(raw[: k * INDEX_BYTES].view(np.int32))
        bound.append(min(len(dst), 1 << 31))  # int32 indices: a negative one, as uint32, is at least 2**31
        items.append((dst, k, raw[index_bytes(k) : index_bytes(k) + k * dst.itemsize].view(dst.dtype), d))
    if not items:
        return [], rest
    counts = [k for _, k, _, _ in items]
    flat = np.concatenate(idx)
    over = flat.view(np.uint32) >= np.repeat(np.array(bound, dtype=np.uint32), counts)
    if over.any():
        j = int(np.flatnonzero(over)[0])
        d = items[int(np.searchsorted(np.cumsum(counts), j, side="right"))][3]
        raise DeltaError(
            f"delta from process {d.op.peer} ({d.op.what()}): delta index {int(flat[j])} is outside the piece's "
            f"{d.views[0].numel()} elements"
        )
    wide, at, out = flat.astype(np.intp), 0, []
    for dst, k, values, _ in items:
        out.append((dst, wide[at : at + k], values))
        at += k
    return out, rest


def _host_dst(d: DeltaOp) -> np.ndarray | None:
    """A received op's destination bits as flat numpy where it is one contiguous host view of 1, 2, 4 or 8-byte
    elements (else None), derived once (the view stays the op's)."""
    if "host" not in d.memo:
        v = d.views[0]
        one = len(d.views) == 1 and v.element_size() in (1, 2, 4, 8) and v.device.type == "cpu" and v.is_contiguous()
        d.memo["host"] = bits(v).view(-1).numpy() if one else None
    return d.memo["host"]


def scatter_host(items: list[tuple]) -> None:
    """``host_sparse``'s checked deltas scattered: one numpy assignment each (through the widened indices:
    numpy's scatter through int32 ones is ~15% slower than the widening plus a scatter through native ones)."""
    for dst, idx, values in items:
        dst[idx] = values


def scatter_by_address(fast: list[DeltaOp]) -> tuple:
    """Words by address: every index checked and the words scattered, one launch each, queued without a host
    sync (on CUDA the scatter beside the current stream: the next chunk's header read does not wait for it).
    The scatter stores nothing if any index of the chunk is outside its piece; ``verify_checks`` reads the check
    at the end of the run and names the message. Returns the check to read then: ``(flags, fast, pieces)``."""
    scatter, dev = _located(fast), fast[0].views[0].device
    flags = torch.zeros(1 + len(scatter.pieces), dtype=torch.int32, device=dev)
    scatter.check(flags)
    scatter.apply(side_stream(dev, "apply") if dev.type == "cuda" else None, tuple(d.payload for d in fast), flags)
    return flags, fast, scatter.pieces


def verify_checks(checks: list[tuple], clock: RunClock) -> None:
    """The index checks ``scatter_by_address`` queued, read once (on CUDA under ``clock``): ``DeltaError`` naming the
    first message with a word index outside its piece (its chunk stored none of its words)."""
    if not checks:
        return
    flags = torch.cat([f for f, _, _ in checks])
    if flags.is_cuda and clock.bounded:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(flags.device))
        clock.watch(done.query, lambda: "the delta word index checks")
    got, at = flags.tolist(), 0
    for f, ops, pieces in checks:
        mine, at = got[at : at + len(f)], at + len(f)
        if mine[0]:
            bad = pieces[[r for r, v in enumerate(mine[1:]) if v][0]]
            d = ops[int(np.searchsorted(pieces_of(ops).first, bad, side="right")) - 1]
            raise DeltaError(
                f"delta from process {d.op.peer} ({d.op.what()}): a word index is outside its piece "
                "(none of that chunk's words were stored)"
            )


def _located(ops: list[DeltaOp]) -> Scatter:
    """A receiver's words by address (every destination view addressable): each piece's indices and words
    located in its op's payload by arithmetic, as one ``Scatter`` table. The caller checks and applies it."""
    s = pieces_of(ops)
    k = np.array([c for d in ops for c in d.changes], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(wire_sizes(k))[:-1]]).astype(np.int64)
    first, dst, n = s.first, s.ptrs[0], s.nwords
    payload = np.repeat(np.array([d.payload.data_ptr() for d in ops], dtype=np.int64), np.diff(first))
    idx = payload + starts - np.repeat(starts[first[:-1]], np.diff(first))  # each op's pieces from its payload
    return Scatter.of(dst, idx, idx + index_bytes(k), k, n, ops[0].views[0].device)


def _named(ok, items: list[tuple]) -> None:
    """Raise ``DeltaError`` unless ``ok(items)``, naming the first message (item[0], a ``DeltaOp``) whose own
    items fail (an error path: a check per message)."""
    if not items or ok(items):
        return
    for d in dict.fromkeys(it[0] for it in items):
        if not ok([it for it in items if it[0] is d]):
            raise DeltaError(f"delta from process {d.op.peer} ({d.op.what()}): a word index is outside its piece")
    raise DeltaError("a word index is outside its piece (found by the joint check, not per message)")


def host_checked(d: DeltaOp) -> bool:
    """Whether a received delta's indices are checked with a host sync (every kind but dense and words by
    address, whose check ``scatter_by_address`` queues on the device)."""
    return d.kind != "dense" and not (d.kind == "words" and d.fast)
