"""A NIXL source's element deltas on host memory, many messages at once.

What ``refit.delta.send``'s ``choose`` and ``encode_op`` and ``NixlDelta._encode`` do message by message, for the
diffed messages of one find batch whose one piece is contiguous host memory of whole 64-bit words, found per
element (``on_host``): their changes found together (``host_find.find_words`` over int64 views made once per
batch), the rule's encodings at once (``rule.choose_encoding_many``), each delta's payload written straight into
the receiver's region of the staging (two numpy copies for a sparse one: no tensor made, nothing copied twice).
The bases are brought up to date by the find itself (``find_words(update=True)``: each changed word written
while it is in cache, not scattered later into a base gone cold); a message whose find stopped over its cutoff
(``send.dense_words``: sent dense) has its base copied whole as ``encode_op`` does. A base updated so, before its
receivers read, is still right: these messages are read by no other receiver (``on_host``), and a refit that
fails leaves the base holding no version (the next refit is dense). The headers, statistics, staged bytes and
bases are the one-by-one path's (tests compare them); a refit of many small messages pays a few Python steps per
message instead of some forty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from refit.delta.base import SourceBase
from refit.delta.host_find import by_words, find_words, from_numpy, words_of
from refit.delta.ops import DeltaOp, DeltaStats, memoized
from refit.delta.rule import choose_encoding, choose_encoding_many
from refit.delta.send import dense_words
from refit.delta.served import OVER_STAGING
from refit.delta.wire import ENCODINGS, encode, index_bytes, wire_bytes

_DENSE, _SPARSE = ENCODINGS.index("dense"), ENCODINGS.index("sparse")


def on_host(d: DeltaOp) -> bool:
    """Whether a sender's message ``d`` (its base built) is staged here: one piece found per element, read by no
    other message of its process, whose base and view are contiguous host memory of whole 64-bit words, of fewer
    than 2**31 elements."""
    if len(d.views) != 1 or d.words or d.shared or d.fast or d.op.pack or len(d.bases) != 1:
        return False
    v = d.views[0]
    return 0 < v.numel() < 2**31 and v.element_size() in (1, 2, 4, 8) and by_words(d.bases[0], v)


@dataclass
class _Facts:
    """Setup facts of a batch of ``on_host`` messages (``memoized``): per message its base's and its view's
    int64 words, elements, element size, part of its pair's bytes, dense bytes and (``delta="auto"``) the changed
    words above which the rule sends it dense (``send.dense_words``)."""

    words: list
    n: np.ndarray
    size: np.ndarray
    share: np.ndarray
    nbytes: list
    most: list
    one_link: bool

    @staticmethod
    def of(ops: list[DeltaOp], auto: bool) -> _Facts:
        return _Facts(
            words=[(words_of(d.bases[0]), words_of(d.views[0])) for d in ops],
            n=np.array([d.views[0].numel() for d in ops], dtype=np.int64),
            size=np.array([d.views[0].element_size() for d in ops], dtype=np.int64),
            share=np.array([d.share for d in ops], dtype=np.float64),
            nbytes=[d.nbytes for d in ops],
            most=[dense_words(d) if auto else None for d in ops],
            one_link=all(d.link == ops[0].link for d in ops),
        )


def stage_host(
    ops: list[DeltaOp], region: np.ndarray, used: int, offsets: dict, version: int, stats: DeltaStats,
    base: SourceBase, mode: str,
) -> tuple[list[list[int]], int]:  # fmt: skip
    """Find, choose and stage ``ops`` (``on_host``, all diffed this refit) for one receiver: each delta written
    into ``region`` (the receiver's staging region, uint8) from byte ``used`` on, its offset noted in ``offsets``;
    one that does not fit goes dense (``OVER_STAGING``), its base brought up to date all the same. ``mode``:
    ``TransferConfig.delta``. Returns each message's header and the region's bytes used."""
    facts = memoized(ops, ("host", mode == "auto"), lambda ops: _Facts.of(ops, mode == "auto"))
    sizes = facts.size.tolist()
    found = find_words(facts.words, sizes, facts.most, update=True)  # the bases brought up to date as found
    k = np.array([-1 if i is None else len(i) for i, _ in found], dtype=np.int64)
    kinds, held = _kinds(ops, facts, k, mode), base.version
    heads, cap, n = [], len(region), facts.n.tolist()
    for j, d in enumerate(ops):
        kind, kj, (idx, vals) = kinds[j], int(k[j]), found[j]
        d.kind, d.dense_runs, d.changes = ENCODINGS[kind], 0, []
        d.fraction, d.dense_next = (1.0, True) if kj < 0 else (kj / n[j], kind == _DENSE)
        stats.diffed += 1
        stats.dense_bytes += facts.nbytes[j]
        view = d.views[0]
        if kind == _DENSE:
            d.payload = view
            if kj < 0:  # its find stopped over ``most``: its base copied whole (before the refit returns)
                base.update(d.op.message, [(d.bases[0], None, view)])
            heads.append(_dense(stats, facts.nbytes[j], held, version))
            continue
        nb = wire_bytes(d.kind, n[j], kj, sizes[j])
        d.payload = None
        if used + nb > cap:  # over this refit's staging: dense
            d.kind = "dense"
            stats.dense_why[OVER_STAGING] = stats.dense_why.get(OVER_STAGING, 0) + 1
            heads.append(_dense(stats, facts.nbytes[j], held, version))
            continue
        _write(region[used : used + nb], d.kind, n[j], idx, vals, view.dtype)
        offsets[str(d.op.message)], used = used, used + nb
        stats.wire_bytes += nb
        stats.encodings[d.kind] += 1
        heads.append([kind, -1 if held is None else held, version, kj])
    return heads, used


def _kinds(ops: list[DeltaOp], facts: _Facts, k: np.ndarray, mode: str) -> list[int]:
    """Each message's encoding (its index in ``ENCODINGS``), as ``send.choose`` picks it: the forced one
    (``mode``; words are sent per element here), else the rule's, dense where the find stopped over
    ``dense_words`` (``k`` -1)."""
    if mode in ENCODINGS:
        return [ENCODINGS.index("sparse" if mode == "words" else mode)] * len(ops)
    if facts.one_link:
        kinds = choose_encoding_many(facts.n, np.maximum(k, 0), facts.size, ops[0].link, facts.share)
    else:
        pieces = zip(facts.n.tolist(), np.maximum(k, 0).tolist(), facts.size.tolist())
        kinds = [ENCODINGS.index(choose_encoding([p], d.link, d.share)) for p, d in zip(pieces, ops)]
    return np.where(k < 0, _DENSE, kinds).tolist()


def _dense(stats: DeltaStats, nbytes: int, held: int | None, version: int) -> list[int]:
    stats.wire_bytes += nbytes
    stats.encodings["dense"] += 1
    return [_DENSE, -1 if held is None else held, version, 0]


def _write(out: np.ndarray, kind: str, n: int, idx: np.ndarray, vals: np.ndarray, dtype: torch.dtype) -> None:
    """One piece's payload in ``out`` (``wire.encode``'s layout): a sparse one by numpy, a bitmask by ``encode``."""
    if kind != "sparse":
        encode(kind, n, from_numpy(idx), from_numpy(vals).view(dtype), from_numpy(out))
        return
    k, head = len(idx), index_bytes(len(idx))
    out[: 4 * k].view(np.int32)[:] = idx
    out[head : head + vals.nbytes].view(vals.dtype)[:] = vals  # (the lanes' integer type, as found)
