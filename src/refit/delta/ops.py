"""One P2P message in delta mode (``DeltaOp``) and the setup facts a run derives from lists of them, built once
and kept (``memoized``, ``Pieces``, ``by_peer``): a refit does numpy over arrays, not Python per message. And
``DeltaStats``, what one run put on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import numpy as np
import torch

from refit.delta.rule import LinkSpeed
from refit.delta.wire import ENCODINGS
from refit.transport.p2p import _Op


@dataclass
class DeltaOp:
    """One P2P op in delta mode: its plain op, its pieces' views and (sender) base views, its link."""

    op: _Op
    views: list[torch.Tensor]
    bases: list[torch.Tensor]
    link: LinkSpeed
    header: torch.Tensor
    payload: torch.Tensor | None = None  # during a step: what is sent or received (dense: the op's tensor)
    kind: str = "dense"
    changes: list = field(default_factory=list)
    fraction: float | None = None  # sender: the changed fraction last measured
    dense_next: bool = False  # sender: its last diff went dense (the rule, or a piece over its slots): ``auto``
    # skips it until a probe
    dense_runs: int = 0  # sender: runs sent dense since the last diff
    stale: bool = False  # sender: this message's base was not brought to the last version (``plan_of``)
    may_pay: bool = True  # a delta could beat dense on this link (``op_may_pay``; set at setup)
    share: float = 0.0  # the message's part of its chunk's bytes: it pays that part of ``LinkSpeed.chunk_s``
    words: bool = False  # sender: changes are found per 64-bit word (``_by_words``; set at setup)
    parts: list = field(default_factory=list)  # sender, words: the payload's pieces (``join_payloads`` copies them)
    numels: list = field(default_factory=list)  # per piece: elements, and 64-bit words (None: not whole)
    nwords: list = field(default_factory=list)
    fast: bool = False  # words by address (``_fast``): every view (and base) addressable by the word kernels
    ptrs: tuple = ()  # fast: per piece byte addresses, numpy: (base, current) on a sender, (destination,)
    found: tuple | None = None  # fast sender, per run: (``Found``, first piece, end) of its pieces there
    wire: int = 0  # fast sender sending words, per run: its payload's bytes (``join_payloads`` packs it)
    nbytes: int = 0  # its pieces' bytes (set at setup)
    shared: bool = False  # sender: another message of this process reads some of its elements (``SourceBase``)
    flat: torch.Tensor | None = None  # a small message (``JOIN_BYTES``): its plain op's tensor as flat bytes; when
    # it goes dense it travels in its peer's joined buffer (``join_payloads``), not as a P2P operation of its own
    memo: dict = field(default_factory=dict)  # ``memoized``: setup facts of op lists this op heads, kept between refits


JOIN_BYTES = 1 << 20
"""A message of at most this many bytes that goes dense travels in its peer's joined buffer, after the deltas,
not as a P2P operation of its own: a copy into the buffer and one out of it cost far less than an operation does
(a norm layer's few KiB; S1 under ``auto`` at 1%: 65 of 291 messages)."""


MEMO_MAX = 64  # op lists memoized per first op (``memoized``; under ``auto`` a batch may diff another subset each run)


def memoized(ops: list[DeltaOp], what: tuple, make):
    """``make(ops)``, computed once per list of ops (by identity, in order) and ``what``, kept on the first op: a
    refit repeats its step-chunks' op lists (find batches, a peer's group), so what ``make`` derives from their
    setup fields (views, addresses, sizes, peers; never per-run state) is built once. The entry keeps the ops,
    so their ids stay theirs while it lives; at most ``MEMO_MAX`` per first op."""
    key = (*what, *map(id, ops))
    memo = ops[0].memo
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= MEMO_MAX:
            memo.clear()
        hit = memo[key] = (tuple(ops), make(ops))
    return hit[1]


@dataclass
class Pieces:
    """Setup facts of a list of ops, per op and per piece (numpy int64, the pieces of the ops one after
    another), built once per list (``pieces_of``) so that a refit does numpy over them, not Python per op."""

    first: np.ndarray  # per op its first piece, and the total: ``[0, ..., pieces]``
    spans: list  # per op (first piece, end) as ints
    nwords: np.ndarray  # per piece: its 64-bit words (-1: not whole)
    numels: np.ndarray  # per piece: its elements
    itemsize: np.ndarray  # per piece: its element size
    ptrs: tuple  # per side of ``DeltaOp.ptrs``, every piece's addresses (where every op is ``fast``)
    op_words: np.ndarray  # per op: its pieces' words (where whole)
    header_bytes: np.ndarray  # per op: its header's bytes
    dense_bytes: np.ndarray  # per op: its plain op's bytes (what it is when sent dense)
    shared: np.ndarray  # per op (bool): ``DeltaOp.shared``
    mine: np.ndarray  # per piece (bool): its op is not shared (its base is updated from its packed payload)
    heads: np.ndarray  # per op: where its header starts in the group's headers (``3 + pieces`` each)
    counted: np.ndarray  # per header word (bool): a count (not kind, base version, version)

    @staticmethod
    def of(ops: list[DeltaOp]) -> Pieces:
        counts = np.array([len(d.views) for d in ops], dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        lens = counts + 3
        heads = np.cumsum(lens) - lens
        counted = np.ones(int(lens.sum()), dtype=bool)
        counted[np.concatenate([heads, heads + 1, heads + 2])] = False
        nwords = np.array([-1 if w is None else w for d in ops for w in d.nwords], dtype=np.int64)
        sides = len(ops[0].ptrs) if all(d.fast for d in ops) else 0
        return Pieces(
            first=first,
            spans=list(zip(first[:-1].tolist(), first[1:].tolist())),
            nwords=nwords,
            numels=np.array([n for d in ops for n in d.numels], dtype=np.int64),
            itemsize=np.array([v.element_size() for d in ops for v in d.views], dtype=np.int64),
            ptrs=tuple(np.concatenate([d.ptrs[c] for d in ops]) for c in range(sides)),
            op_words=np.add.reduceat(np.maximum(nwords, 0), first[:-1]) if len(nwords) else first[:-1],
            header_bytes=np.array([d.header.numel() * 8 for d in ops], dtype=np.int64),
            dense_bytes=np.array([d.op.tensor.numel() * d.op.tensor.element_size() for d in ops], dtype=np.int64),
            shared=np.array([d.shared for d in ops], dtype=bool),
            mine=np.repeat(np.array([not d.shared for d in ops], dtype=bool), counts),
            heads=heads,
            counted=counted,
        )


def pieces_of(ops: list[DeltaOp]) -> Pieces:
    """``Pieces`` of ``ops`` (non-empty, each with pieces), built once per list (``memoized``)."""
    return memoized(ops, ("pieces",), Pieces.of)


def by_peer(ops: list[DeltaOp]) -> list[tuple[int, list[DeltaOp]]]:
    """``ops`` (sorted by peer) as ``(peer, its ops in order)``, grouped once per list (``memoized``)."""
    if not ops:
        return []
    return memoized(ops, ("peers",), lambda ops: [(p, list(g)) for p, g in groupby(ops, key=lambda d: d.op.peer)])


@dataclass
class DeltaStats:
    """What one delta run put on the wire from this process: bytes (headers included), the dense bytes
    the same messages would have been, the count of messages per encoding and of messages diffed. NIXL deltas
    add: ``served``, messages a fan-out replica served as the delta it received (``refit.delta.served``);
    ``dense_why``, per reason the messages that went dense where a delta was wanted; ``base_bytes``, the memory
    of this process's NIXL base (0 where it keeps none); ``staging_bytes``, its registered delta staging and
    landing buffers."""

    diffed: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    received_bytes: int = 0
    encodings: dict = field(default_factory=lambda: dict.fromkeys(ENCODINGS, 0))
    served: int = 0
    dense_why: dict = field(default_factory=dict)
    base_bytes: int = 0
    staging_bytes: int = 0
