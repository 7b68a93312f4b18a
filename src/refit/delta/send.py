"""The sender's side of a delta run, message by message: what to do with it this run (``plan_of``: diff,
refresh or skip), finding its changes in batches (``batches_of``, ``launch_fast``, ``find_batch``), the
encoding the rule or the config picks (``choose``) and the payload and header it sends (``encode_op``,
``encode_found``), and how many refits a pair may go quiet (``quiet_after``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from refit.delta.base import SourceBase
from refit.delta.chunks import FIND_BATCH_BYTES, WORD_BATCH_BYTES
from refit.delta.elements import find_changes, find_changes_many
from refit.delta.header import QUIET_MAX
from refit.delta.ops import DeltaOp, DeltaStats, Pieces, memoized, pieces_of
from refit.delta.payload import one_run, word_parts
from refit.delta.rule import LinkSpeed, choose_encoding, choose_words, choose_words_many, may_pay
from refit.delta.wire import ENCODINGS, encode, piece_wire, wire_sizes
from refit.delta.words import Found, PendingFind, find_words, find_words_many, launch_words_table

PROBE_EVERY = 8  # a message sent dense because of its last fraction is diffed again after this many runs


def ready_event(steps: list) -> torch.cuda.Event | None:
    """On a CUDA sender, an event on the current stream at the start of a run: every write of the weights
    and of the base the run's finds read is queued before it (the base's updates of this run touch only
    messages already found, and a shared message's wait for ``commit``), so the finds wait for it, not for
    the packing, sends and base updates of the chunks before theirs."""
    dev = next((d.views[0].device for sends, _ in steps for d in sends if d.fast and d.words), None)
    if dev is None or dev.type != "cuda":
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(dev))
    return ready


def _launch(fast: list[DeltaOp], after: torch.cuda.Event | None = None) -> PendingFind:
    """The find of ``fast`` (messages found per word by address) in one launch, not waited for; on CUDA
    behind ``after`` (``launch_words_table``)."""
    s = pieces_of(fast)
    return launch_words_table(s.ptrs[0], s.ptrs[1], s.nwords, fast[0].views[0].device, after)


def launch_fast(ops: list[DeltaOp], after: torch.cuda.Event | None = None) -> PendingFind | None:
    """``_launch`` of those of ``ops`` found per word by address; None where there are none."""
    fast = [d for d in ops if d.words and d.fast]
    return _launch(fast, after) if fast else None


def _batches(sends: list[DeltaOp], plans: list[str]) -> list[list[int]]:
    """The positions of ``sends`` to diff (``plans``), in order, in find batches of at most
    ``WORD_BATCH_BYTES`` of data where every message of the batch is found per word, else
    ``FIND_BATCH_BYTES``."""
    batches, batch, size, words = [], [], 0, True
    for j, d in enumerate(sends):
        if plans[j] != "diff":
            continue
        joined = words and d.words  # the batch with message j: all found per word
        if batch and size + d.nbytes > (WORD_BATCH_BYTES if joined else FIND_BATCH_BYTES):
            batches.append(batch)
            batch, size, words = [], 0, True
        batch.append(j)
        size += d.nbytes
        words = words and d.words
    return [*batches, batch] if batch else batches


def batches_of(sends: list[DeltaOp], plans: list[str]) -> list[list[int]]:
    """``_batches``, cut once per step-chunk and set of plans (``memoized``: a refit repeats them)."""
    return memoized(sends, ("batches", *plans), lambda ops: _batches(ops, plans)) if sends else []


def find_batch(ops: list[DeltaOp], pending: PendingFind | None, mode: str = "") -> Found | None:
    """The changes of every piece of ``ops`` (one batch of a step's sends): words by address from ``pending``
    (``launch_fast`` of this batch, queued by the caller or ``_prefetch``; each op's ``found``: its pieces'
    range there), other word-found ops per piece
    (``find_words_many``: ``changes`` = ``(indices, words, count)`` per piece), the rest per element
    (``find_changes_many``: ``(indices, values)`` per piece). All views of the finds' slots, encoded and
    dropped soon. Returns the find by address (None: none). ``mode`` ``"auto"``: a one-piece element op on the CPU
    whose changed words already say dense (``dense_words``) comes back as ``(None, None)``, its elements unread."""
    fast, found = [d for d in ops if d.words and d.fast], None
    if fast:
        found = pending.result()  # ``launch_fast`` returns None only where no op is fast
        for d, (a, b) in zip(fast, pieces_of(fast).spans):
            d.found = (found, a, b)
    rest = [d for d in ops if not (d.words and d.fast)] if len(fast) < len(ops) else []
    for by_words in (True, False):
        chosen = [d for d in rest if d.words == by_words]
        pairs = [(b, v) for d in chosen for b, v in zip(d.bases, d.views)]
        if by_words:
            got = find_words_many(pairs) if chosen else []
        else:
            most = [dense_words(d) if mode == "auto" else None for d in chosen for _ in d.views]
            got = find_changes_many(pairs, copy=False, most=most) if chosen else []
        for d in chosen:
            d.changes, got = got[: len(d.views)], got[len(d.views) :]
    return found


def dense_words(d: DeltaOp) -> int | None:
    """For a one-piece element op on the CPU with whole 64-bit words: the changed words above which the rule sends
    it dense, its changed elements estimated from them (each word of ``E`` elements changes with probability
    ``1 - (1 - f)**E`` where ``f`` of the elements change independently); None where there is no such count.
    Computed once per op (the rule is monotone in the changes: a binary search)."""
    if "dense_words" not in d.memo:
        d.memo["dense_words"] = _dense_words(d)
    return d.memo["dense_words"]


def _dense_words(d: DeltaOp) -> int | None:
    if len(d.views) != 1 or d.nwords[0] is None or d.views[0].device.type != "cpu" or not d.nwords[0]:
        return None
    return _words_cutoff(d.numels[0], d.views[0].element_size(), d.nwords[0], d.link, d.share)


@functools.lru_cache(maxsize=4096)
def _words_cutoff(n: int, size: int, words: int, link: LinkSpeed, share: float) -> int | None:
    """``dense_words`` of a piece of ``n`` elements of ``size`` bytes in ``words`` words (pieces of one shape and
    link repeat: layers)."""

    def dense(kw: int) -> bool:
        f = 1 - (1 - kw / words) ** (size / 8)
        return choose_encoding([(n, round(f * n), size)], link, share) == "dense"

    if not dense(words):
        return None
    lo, hi = 0, words  # dense(hi); the least such
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if dense(mid) else (mid + 1, hi)
    return max(0, lo - 1)


def plan_of(d: DeltaOp, base_ok: bool, mode: str) -> str:
    """``"diff"``; ``"refresh"`` (dense, and the base copied at commit so the next run may diff: a
    receiver without the base, the first run, a probe every ``PROBE_EVERY`` dense runs); or ``"skip"``
    (dense, the base left as it was and marked stale: under ``auto`` on a link where no delta can pay
    (``op_may_pay``: a same-device link, NVLink at the measured find rate), or while the rule sent its last
    diff dense (``dense_next``), so a steady 100% change costs neither a diff nor a copy). ``mode``:
    ``TransferConfig.delta``."""
    auto = mode == "auto"
    if auto and not d.may_pay:
        return "skip"
    if not base_ok:
        return "refresh"
    if not auto:
        return "refresh" if d.stale else "diff"
    probe = "refresh" if d.dense_runs + 1 >= PROBE_EVERY else "skip"
    if d.stale:
        return probe
    if d.fraction is None:
        return "diff"
    return probe if d.dense_next else "diff"


def op_may_pay(d: DeltaOp) -> bool:
    """Whether a delta of ``d`` could beat dense at all (``refit.delta.rule.may_pay``: its best case by a
    margin), else finding the changes costs about what sending everything does (NVLink with the
    measured find rate) and ``auto`` never diffs ``d``, not even to probe."""
    return may_pay([(v.numel(), v.element_size()) for v in d.views], d.link, d.words, d.share)


def choose(d: DeltaOp, mode: str) -> str:
    """The encoding of a diffed message (``d.changes`` found, ``d.fraction`` measured): the forced one or
    the rule's. A word-found message is sent as words or dense; one whose changes overflowed the find's
    slots (``None``) is found again when words are forced, else sent dense. ``mode``: ``TransferConfig.delta``."""
    forced = mode if mode in ENCODINGS else None
    if not d.words:
        forced = "sparse" if forced == "words" else forced  # a piece without whole words: per element
        if any(i is None for i, _ in d.changes):  # over ``dense_words``: dense, its elements not read
            if not forced:
                d.fraction, d.dense_next = 1.0, True
                return "dense"
            d.changes = [find_changes(b, v) for b, v in zip(d.bases, d.views)]
        pieces = [(v.numel(), len(i), v.element_size()) for v, (i, _) in zip(d.views, d.changes)]
        d.fraction = sum(k for _, k, _ in pieces) / max(1, sum(n for n, _, _ in pieces))
        kind = forced or choose_encoding(pieces, d.link, d.share)
        d.dense_next = kind == "dense"
        return kind
    if d.found is not None:  # by address: the counts, and whether a piece is over its slots
        found, a, b = d.found
        counts, over = found.count[a:b].tolist(), bool((found.count[a:b] > found.cap[a:b]).any())
    else:
        counts, over = [k for _, _, k in d.changes], any(i is None for i, _, _ in d.changes)
    d.fraction = sum(counts) / max(1, sum(d.nwords))
    pieces = [(n, k, v.element_size()) for n, k, v in zip(d.numels, counts, d.views)]
    kind = "words" if forced else choose_words(pieces, d.link, d.share)
    if kind == "words" and over:
        if not forced:
            kind = "dense"
        else:  # found again by the torch reference, piece by piece
            if d.found is not None:
                d.changes = [(*found.piece(j), k) for j, k in zip(range(a, b), counts)]
                d.found = None
            again = zip(d.bases, d.views, d.changes)
            d.changes = [(*find_words(b, v), k) if i is None else (i, w, k) for b, v, (i, w, k) in again]
    if kind != "words":
        d.found = None
    d.dense_next = kind == "dense"
    d.changes = counts if d.found is not None else [(i, w) for i, w, *_ in d.changes] if kind == "words" else []
    return kind


def _rule_says_words(ops: list[DeltaOp], k: np.ndarray, s: Pieces) -> np.ndarray:
    """``choose_words`` of ``ops`` (``s``: their ``pieces_of``; ``k``: the changes per piece), at once where they
    share one link (else op by op)."""
    n, size, first = s.numels, s.itemsize, s.first
    if all(d.link == ops[0].link for d in ops):
        share = np.array([d.share for d in ops])
        return choose_words_many(n, k, size, first, ops[0].link, share)
    pieces = [list(zip(n[a:b].tolist(), k[a:b].tolist(), size[a:b].tolist())) for a, b in zip(first, first[1:])]
    return np.array([choose_words(p, d.link, d.share) == "words" for p, d in zip(pieces, ops)], dtype=bool)


def encode_op(d: DeltaOp, plan: str, version: int, stats: DeltaStats, base: SourceBase, mode: str) -> list[int]:
    """Fill ``d``'s payload (dense: packed as the P2P path does) by ``plan`` (``plan_of``) and the
    changes ``find_batch`` found; return its header ``[encoding, base version, version, k per piece]``. ``base``:
    the sender's ``SourceBase``, brought to what ``d`` sends; ``mode``: ``TransferConfig.delta``."""
    held = base.version
    d.kind = "dense"
    if plan == "diff":
        d.kind = choose(d, mode)
        d.dense_runs = 0
        stats.diffed += 1
    else:
        d.dense_runs += 1
    if d.kind == "dense":
        counts = [0] * len(d.views)
    else:
        counts = d.changes if d.found is not None else [len(i) for i, _ in d.changes]
    if d.kind == "dense":
        for bv, tv in d.op.pack:
            bv.copy_(tv)
        d.payload = d.op.tensor
        d.stale = plan == "skip"  # a skipped base is not diffed until it is refreshed
        if not d.stale:
            base.update(d.op.message, [(b, None, v) for b, v in zip(d.bases, d.views)])
        if plan == "refresh":
            d.fraction, d.dense_next = None, False  # the next run diffs and measures again
    elif d.found is not None:  # words by address: packed by ``join_payloads``, the base updated from it
        # (``defer_packed``)
        d.payload, d.wire = None, int(wire_sizes(np.array(counts)).sum())
        if d.shared:
            base.defer_found(d.found, d.bases)
    else:
        d.payload = pack_delta(d)
        base.update(d.op.message, [(b, i, x) for b, (i, x) in zip(d.bases, d.changes)], d.kind == "words")
    d.changes = []
    payload = d.wire if d.payload is None else d.payload.numel() * d.payload.element_size()
    stats.wire_bytes += payload + d.header.numel() * 8
    stats.dense_bytes += d.op.tensor.numel() * d.op.tensor.element_size()
    stats.encodings[d.kind] += 1
    return [ENCODINGS.index(d.kind), -1 if held is None else held, version, *counts]


def encode_found(
    ops: list[DeltaOp], version: int, stats: DeltaStats, base: SourceBase, mode: str
) -> dict[int, list[int]]:
    """``encode_op`` at once of a find batch's diffed messages found by address that go as words (numpy over
    the find's counts: no Python step per piece): their headers by ``id``. The others (the rule says
    dense, a piece over its slots, several finds) are left to ``encode_op``. ``base``, ``mode``: as there."""
    fast = [d for d in ops if d.found is not None]
    if not fast or not one_run(fast):
        return {}
    found, s, at = fast[0].found[0], pieces_of(fast), fast[0].found[1]
    k, starts, cap = found.count[at : at + s.first[-1]], s.first[:-1], found.cap[at : at + s.first[-1]]
    words = np.add.reduceat((k > cap).astype(np.int64), starts) == 0
    if mode != "words":
        words &= _rule_says_words(fast, k, s)
    fraction = (np.add.reduceat(k, starts) / np.maximum(1, s.op_words)).tolist()
    wire, counts = np.add.reduceat(wire_sizes(k), starts), k.tolist()
    held, out, chosen = base.version, {}, np.flatnonzero(words)
    head = [ENCODINGS.index("words"), -1 if held is None else held, version]
    for j, w in zip(chosen.tolist(), wire[chosen].tolist()):
        d, (a, b) = fast[j], s.spans[j]
        d.kind, d.dense_runs, d.fraction, d.changes, d.payload, d.wire = "words", 0, fraction[j], [], None, w
        d.dense_next = False
        out[id(d)] = head + counts[a:b]
    for j in np.flatnonzero(words & s.shared).tolist():  # shared ones' bases wait for ``commit``; the others'
        # come from the packed payload (``SourceBase.defer_packed``)
        base.defer_found(fast[j].found, fast[j].bases)
    stats.wire_bytes += int(wire[chosen].sum() + s.header_bytes[chosen].sum())
    stats.dense_bytes += int(s.dense_bytes[chosen].sum())
    stats.diffed += len(out)
    stats.encodings["words"] += len(out)
    return out


def pack_delta(d: DeltaOp) -> torch.Tensor:
    """``d``'s payload: its pieces encoded one after another. Words are not copied here: ``d.parts`` lists
    their bytes (indices, padding, words per piece) and ``join_payloads`` copies them once into the peer's
    buffer; the payload returned is only sized (``device="meta"``)."""
    sizes = [piece_wire(d.kind, v, len(i)) for v, (i, _) in zip(d.views, d.changes)]
    if d.kind == "words":
        d.parts = [p for i, w in d.changes for p in word_parts(i, w)]
        return torch.empty(sum(sizes), dtype=torch.uint8, device="meta")
    out = torch.empty(sum(sizes), dtype=torch.uint8, device=d.op.tensor.device)
    off = 0
    for v, (i, x), n in zip(d.views, d.changes, sizes):
        encode(d.kind, v.numel(), i, x, out[off : off + n])
        off += n
    return out


def quiet_after(ops: list[DeltaOp], mode: str) -> int:
    """How many refits after this one send every message of ``ops`` (this sender's to one peer) dense without a
    diff, under ``delta="auto"`` (``mode``; a run's plans, ``plan_of``, are known from each message's state): a
    message that cannot pay never diffs; one whose last diff the rule sent dense (``dense_next``, or that is
    stale) diffs again after its probe, ``PROBE_EVERY - dense_runs`` refits on; any other diffs next time (0).
    The least of them."""
    if mode != "auto":
        return 0
    left = QUIET_MAX
    for d in ops:
        if not d.may_pay:
            continue
        if not (d.stale or (d.fraction is not None and d.dense_next)):
            return 0
        left = min(left, max(1, PROBE_EVERY - d.dense_runs))
    return left
