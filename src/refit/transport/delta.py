"""Delta refits over torch.distributed P2P: each message carries only what changed since the base version.

Setup (once): ``SourceBase`` copies a source process's tensors that it sends over P2P (on the device or
in pinned host memory: ``TransferConfig.delta_base``); ``DeltaSchedule`` pairs each of the process's P2P
ops (``P2PSchedule``) with its pieces' views, the base views (sender) and the link's speed; what a refit
derives from the ops of a find batch or a peer's group (addresses, sizes, header layout, groups, batches) is
built on its first use and kept (``_memo``, ``_Pieces``): a refit does numpy over arrays, not Python per message.

Per refit, per step and chunk of a step (``_chunks``: at most the staging budget of data per sending process;
host-driven; on CUDA the current stream is synchronized by the header reads, while the word finds and a
receiver's word scatters run on streams of their own, ``delta_words.side_stream``):
  1. each sender chooses its message's encoding (``DeltaSchedule._plan``): dense when the receiver does
     not hold the sender's base version (heal), on a same-device link, or when the rule sent its last diff
     dense (``dense_next``; then the base is not maintained either, until a probe every
     ``PROBE_EVERY`` runs refreshes it); else ``find_changes_many`` over the pieces and
     ``choose_encoding`` (or the forced ``TransferConfig.delta``) over the message, or, for a message
     whose pieces have whole 64-bit words under ``"words"`` / ``"auto"``, ``find_words_many`` (one launch
     for every such piece of a batch) and ``choose_words``;
  2. headers travel (int64 ``[kind, base version, version, k per piece]`` per message), one P2P message
     per peer per step holding the headers of every message of the step between the two (tag: the
     first of those messages' tags plus ``HEADER_TAG``);
  3. payloads: a dense message as the plain P2P path sends it (packed ring buffer or the tensor itself);
     the deltas of a step to one peer as one P2P message (their encoded pieces, ``quant.delta.encode``,
     one after another, sized from the headers; tag: the first delta's own). A step of 291 direct
     messages (Llama-3.1-8B, 1 -> 1) posts 2 P2P ops per peer instead of 582;
  4. receivers check the header (``check_header``: kind, version, base version = the version they hold,
     counts) and apply: dense unpacks, a delta scatters (``apply_changes``; words: one checked launch
     for the chunk, ``scatter_words_many``; by address with no host sync, ``DeltaSchedule._scatter``, the
     check read at the end of the run, ``_verify``), O(changed). A sender's payload sends stay in flight until the
     next chunk's are posted (``_in_flight``: not when one reads the packed ring buffer).
The sender's base follows what each message sent (``SourceBase.update``: dense copies as they are encoded,
word changes once the chunk's payload is posted, ``flush``; words by address from their packed payload,
``SourceBase.defer_packed``, applied once the run's last find is queued (one launch; another before, when
the buffers held would pass the staging budget), so the finds run back to back; a source box sent to several
receivers at commit); the version it holds is set after the refit
succeeded (``commit``), and a failed refit clears it (``fail``), so the next refit is dense everywhere.
On CUDA a sender packs on a high-priority stream (``_send_stream``): the next chunk's find, queued before,
fills the device with its blocks, and the pack and the payload's sends (on the NCCL group's streams, high
priority where the group was made so) start beside it, not after it.
Extra memory: the base (this process's P2P-sent source bytes) plus the payloads of one chunk's deltas
while the chunk runs (each smaller than its message's dense bytes by the rule, unless forced; a sender
briefly holds them twice, per message and joined per peer, and keeps its packed payloads of words by address
until their base update: within the staging budget, ``num_buffers * buffer_bytes``, or one larger buffer
alone, ``defer_packed``) and the find's slots (a quarter of the words found; a sender holds every find batch's
slots of a chunk until its payload is packed and posted, plus the next chunk's first batch found ahead,
``_prefetch``; on CUDA they come from the find stream's own pool, which PyTorch's allocator keeps cached for
that stream).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from itertools import accumulate, chain, groupby

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.cudart import joined
from refit.layout import box_intersect
from refit.plan import Plan
from refit.quant.delta import (
    ENCODINGS,
    LINKS,
    PAY_MARGIN,
    DeltaError,
    LinkSpeed,
    apply_changes,
    best_case,
    check_indices_many,
    choose_encoding,
    choose_words,
    choose_words_many,
    decode,
    encode,
    find_changes_many,
    may_pay,
    predicted_seconds,
    prefer_words,
    wire_bytes,
)
from refit.quant.delta_words import (
    Found,
    PendingFind,
    Scatter,
    addressable,
    check_words_many,
    find_words,
    find_words_many,
    index_bytes,
    launch_words_table,
    pack_table,
    scatter_words_many,
    side_stream,
    whole_words,
    wire_sizes,
    words_in,
)
from refit.transport.clock import RunClock
from refit.transport.p2p import P2PSchedule, _Op
from refit.transport.store import SignedStore

HEADER_TAG = (1 << 20) + (1 << 19)  # a header: its message tag plus this (inside a fan-out tag window of 1 << 21)
PROBE_EVERY = 8  # a message sent dense because of its last fraction is diffed again after this many runs
QUIET_MAX = 1 << 20  # the most quiet refits one header announces (a pair where no delta can ever pay)
FIND_BATCH_BYTES = 1 << 30  # data diffed per host sync (the kernel's slots: ~1.25x that for bf16)
WORD_BATCH_BYTES = 4 << 30  # the same for word deltas (their slots: 0.375x that)


def link_speed(plan: Plan, a: int, b: int, config: TransferConfig) -> LinkSpeed:
    """The ``LINKS`` entry of the link between processes ``a`` and ``b`` (same device; CUDA on one host:
    NVLink; CUDA across hosts: a NIC; else CPU), its link speed replaced by ``config.delta_link_gbps``."""
    procs = plan.procs
    if procs.same_device(a, b) and procs.devices is not None:
        kind = "same_device"
    elif "cuda" in procs.device_of(a) and "cuda" in procs.device_of(b):
        kind = "nvlink" if procs.host_of(a) == procs.host_of(b) else "nic"
    else:
        kind = "cpu"
    speed = LINKS[kind]
    return replace(speed, link_gbps=config.delta_link_gbps) if config.delta_link_gbps is not None else speed


def plan_may_pay(plan: Plan, config: TransferConfig) -> bool:
    """Whether the delta protocol can pay for ``plan``'s P2P messages as a whole: with nothing changed, each
    message at the cheaper of dense and its best delta (``quant.delta.best_case`` over its link), plus the
    fixed cost of every chunk (``LinkSpeed.chunk_s``: its header exchange and host syncs, paid even where
    every message goes dense), at most ``PAY_MARGIN`` of sending everything dense. Under ``delta="auto"`` a
    plan where this fails runs the plain P2P path: no base copy, no header exchange. The same answer on
    every process (the plan and the config decide it)."""
    chunk = _chunks(plan, config)
    dense = best = 0.0
    fixed: dict[tuple[int, int], float] = {}
    for i, m in enumerate(plan.messages):
        if m.transport != "p2p":
            continue
        link = link_speed(plan, plan.procs.src[m.src], plan.procs.dst[m.dst], config)
        pieces = [(p.nbytes // p.itemsize, p.itemsize) for p in m.pieces]
        words = all(whole_words(p.nbytes) for p in m.pieces) and _words_for(config, pieces, link)
        d = sum(predicted_seconds("dense", n, 0, s, link) for n, s in pieces)
        dense, best = dense + d, best + min(d, best_case(pieces, link, words))
        fixed.setdefault((m.step, chunk[i]), link.chunk_s)
    return best < dense and best + sum(fixed.values()) <= PAY_MARGIN * dense


class SourceBase:
    """A source process's copy of the bytes it last sent over P2P: every source tensor some P2P message
    of this process reads, whole (``where``: ``"device"``, beside the tensor, or ``"host"``, pinned when
    CUDA is present). ``version`` is the version it holds (``None``: nothing sent yet, or a refit failed
    after part of it was updated). ``nbytes``: the extra memory.

    Per run, each message's base is brought to what it sent (``update``): when no other message of this
    process reads any of its elements (the common case), dense copies at once, word changes found per piece
    once the chunk's payload is posted (``flush``), words by address from their packed payloads after the
    run's last find is queued (``defer_packed``); else at ``commit`` (another message to another receiver
    still has to diff against the old bytes).
    ``commit(v)`` after the run succeeded; ``fail()`` after it failed (the base is part old, part new:
    ``None``, so the next refit is dense and rebuilds it)."""

    def __init__(self, plan: Plan, proc: int, local: LocalTensors, where: str, budget: int) -> None:
        sent = _sent(plan, proc)
        names = {p.tensor for i in sent for p in plan.messages[i].pieces}
        parts = {n: tuple((box, _copy_of(t, where)) for box, t in local.src[n]) for n in names}
        self.local = replace(local, src=parts)
        self.nbytes = sum(t.numel() * t.element_size() for ps in parts.values() for _, t in ps)
        self.shared = _shared_messages(plan, sent)
        self.version: int | None = None
        self.pending: list = []  # (base view, indices or None, values or the live view, words)
        self.queued: list = []  # word updates of the current step-chunk (``flush``)
        self.packed: list = []  # words by address: (scatter rows, payload buffer) per packed buffer (``defer_packed``)
        self.packed_bytes = 0  # their buffers' bytes, held until they are applied (``_apply_packed``)
        self.budget = budget  # the packed payload bytes held at most (one buffer over it is applied alone)
        self.updating: torch.device | None = None  # a CUDA device with packed updates on its "update" stream

    def update(self, message: int, updates: list, words: bool = False) -> None:
        """``(base view, indices or None, values or the live view)`` of message ``message``'s pieces; ``words``:
        the indices and values are changed 64-bit words (``refit.quant.delta_words``). The changes may be views
        of the find's slots: a deferred update keeps copies."""
        updates = [(b, i, x, words) for b, i, x in updates]
        if message in self.shared:
            self.pending += [(b, i, x, w) if i is None else (b, i.clone(), x.clone(), w) for b, i, x, w in updates]
        elif words:
            self.queued += updates  # one scatter for a find batch's word updates (``flush``)
        else:
            _update(updates)

    def defer_found(self, found: tuple, bases: list) -> None:
        """The base update of a shared message sent as words by address (``found`` = ``(Found, a, b)``, its
        pieces there; ``bases`` its base views): copied and deferred to ``commit``."""
        f, a, b = found
        pieces = [f.piece(j) for j in range(a, b)]
        self.pending += [(v, i.clone(), w.clone(), True) for v, (i, w) in zip(bases, pieces)]

    def defer_packed(self, rows: tuple, buf: torch.Tensor) -> None:
        """The base update of messages sent as words by address, read from their packed payload ``buf``: per piece
        ``rows`` = (base address, index address, word address, changes, words) (``_pack_spans``); applied by
        ``flush(final=True)`` once the refit's last find is queued, so it runs behind the finds, not between them.
        The buffers held stay within ``budget``: those held before are applied first where ``buf`` would pass it
        (then at most ``buf`` alone is held)."""
        if not len(rows[3]):
            return  # nothing of this buffer updates a base (shared messages' wait for ``commit``)
        if self.packed and self.packed_bytes + buf.nbytes > self.budget:
            self._apply_packed()
        self.packed.append((rows, buf))
        self.packed_bytes += buf.nbytes

    def flush(self, final: bool = False) -> None:
        """Apply the queued word updates (one launch, while the finds' slots are held) and, when ``final``, the
        packed ones (``_apply_packed``)."""
        _update(self.queued)
        self.queued = []
        if final:
            self._apply_packed()

    def _apply_packed(self) -> None:
        """The packed updates held, in one launch (on CUDA on the ``"update"`` stream, behind the current one;
        ``join`` makes the current stream wait for it); then their buffers are let go."""
        if not self.packed:
            return
        rows = [np.concatenate(c) for c in zip(*(r for r, _ in self.packed))]
        dev = self.packed[0][1].device
        self.updating = dev if dev.type == "cuda" else self.updating
        stream = side_stream(dev, "update") if dev.type == "cuda" else None
        Scatter.of(*rows, dev).apply(stream, tuple(buf for _, buf in self.packed))
        self.packed, self.packed_bytes = [], 0

    def join(self) -> None:
        """The current stream waits for the packed updates ``flush`` queued on the ``"update"`` stream, if any."""
        if self.updating is not None:
            dev, self.updating = self.updating, None
            torch.cuda.current_stream(dev).wait_stream(side_stream(dev, "update"))

    def commit(self, version: int) -> None:
        """The run of ``version`` succeeded: the deferred updates, then the base holds ``version``."""
        self.flush(final=True)
        self.join()
        _update(self.pending)
        self.pending, self.version = [], version

    def fail(self) -> None:
        """The run failed: the base may be part new; the next refit sends dense and rebuilds it."""
        self.pending, self.queued, self.packed, self.packed_bytes, self.version = [], [], [], 0, None


def _update(updates: list) -> None:
    """Bring base views up to date: whole copies, element changes, and the word changes in one scatter."""
    words = []
    for base, idx, values, by_words in updates:
        if idx is None:
            base.copy_(values, non_blocking=True)
        elif by_words:
            words.append((base, idx, values))
        else:
            apply_changes(base, idx.to(base.device), values.to(base.device))
    if words:
        scatter_words_many(words)


def _shared_messages(plan: Plan, sent: list[int]) -> set[int]:
    """The messages among ``sent`` whose pieces overlap a piece of another of them (one source box sent
    to several receivers)."""
    by_tensor: dict[str, list[tuple[int, tuple]]] = {}
    for i in sent:
        for p in plan.messages[i].pieces:
            by_tensor.setdefault(p.tensor, []).append((i, p.box))
    shared: set[int] = set()
    for items in by_tensor.values():
        for a in range(len(items)):
            for b in range(a + 1, len(items)):
                if items[a][0] != items[b][0] and box_intersect(items[a][1], items[b][1]) is not None:
                    shared.update((items[a][0], items[b][0]))
    return shared


def _copy_of(t: torch.Tensor, where: str) -> torch.Tensor:
    if where == "host" and t.device.type == "cuda":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.detach().clone()


def _sent(plan: Plan, proc: int) -> list[int]:
    return [i for i, m in enumerate(plan.messages) if m.transport == "p2p" and plan.procs.src[m.src] == proc]


@dataclass
class _DeltaOp:
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
    stale: bool = False  # sender: this message's base was not brought to the last version (``_plan``)
    may_pay: bool = True  # a delta could beat dense on this link (``_may_pay``; set at setup)
    share: float = 0.0  # the message's part of its chunk's bytes: it pays that part of ``LinkSpeed.chunk_s``
    words: bool = False  # sender: changes are found per 64-bit word (``_by_words``; set at setup)
    parts: list = field(default_factory=list)  # sender, words: the payload's pieces (``_join`` copies them)
    numels: list = field(default_factory=list)  # per piece: elements, and 64-bit words (None: not whole)
    nwords: list = field(default_factory=list)
    fast: bool = False  # words by address (``_fast``): every view (and base) addressable by the word kernels
    ptrs: tuple = ()  # fast: per piece byte addresses, numpy: (base, current) on a sender, (destination,)
    found: tuple | None = None  # fast sender, per run: (``Found``, first piece, end) of its pieces there
    wire: int = 0  # fast sender sending words, per run: its payload's bytes (``_join`` packs it)
    nbytes: int = 0  # its pieces' bytes (set at setup)
    shared: bool = False  # sender: another message of this process reads some of its elements (``SourceBase``)
    flat: torch.Tensor | None = None  # a small message (``JOIN_BYTES``): its plain op's tensor as flat bytes; when
    # it goes dense it travels in its peer's joined buffer (``_join``), not as a P2P operation of its own
    memo: dict = field(default_factory=dict)  # ``_memo``: setup facts of op lists this op heads, kept between refits


JOIN_BYTES = 1 << 20
"""A message of at most this many bytes that goes dense travels in its peer's joined buffer, after the deltas,
not as a P2P operation of its own: a copy into the buffer and one out of it cost far less than an operation does
(a norm layer's few KiB; S1 under ``auto`` at 1%: 65 of 291 messages)."""

MEMO_MAX = 64  # op lists memoized per first op (``_memo``; under ``auto`` a batch may diff another subset each run)


def _memo(ops: list[_DeltaOp], what: tuple, make):
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
class _Pieces:
    """Setup facts of a list of ops, per op and per piece (numpy int64, the pieces of the ops one after
    another), built once per list (``_pieces``) so that a refit does numpy over them, not Python per op."""

    first: np.ndarray  # per op its first piece, and the total: ``[0, ..., pieces]``
    spans: list  # per op (first piece, end) as ints
    nwords: np.ndarray  # per piece: its 64-bit words (-1: not whole)
    numels: np.ndarray  # per piece: its elements
    itemsize: np.ndarray  # per piece: its element size
    ptrs: tuple  # per side of ``_DeltaOp.ptrs``, every piece's addresses (where every op is ``fast``)
    op_words: np.ndarray  # per op: its pieces' words (where whole)
    header_bytes: np.ndarray  # per op: its header's bytes
    dense_bytes: np.ndarray  # per op: its plain op's bytes (what it is when sent dense)
    shared: np.ndarray  # per op (bool): ``_DeltaOp.shared``
    mine: np.ndarray  # per piece (bool): its op is not shared (its base is updated from its packed payload)
    heads: np.ndarray  # per op: where its header starts in the group's headers (``3 + pieces`` each)
    counted: np.ndarray  # per header word (bool): a count (not kind, base version, version)

    @staticmethod
    def of(ops: list[_DeltaOp]) -> _Pieces:
        counts = np.array([len(d.views) for d in ops], dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        lens = counts + 3
        heads = np.cumsum(lens) - lens
        counted = np.ones(int(lens.sum()), dtype=bool)
        counted[np.concatenate([heads, heads + 1, heads + 2])] = False
        nwords = np.array([-1 if w is None else w for d in ops for w in d.nwords], dtype=np.int64)
        sides = len(ops[0].ptrs) if all(d.fast for d in ops) else 0
        return _Pieces(
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


def _pieces(ops: list[_DeltaOp]) -> _Pieces:
    """``_Pieces`` of ``ops`` (non-empty, each with pieces), built once per list (``_memo``)."""
    return _memo(ops, ("pieces",), _Pieces.of)


@dataclass
class DeltaStats:
    """What one delta run put on the wire from this process: bytes (headers included), the dense bytes
    the same messages would have been, the count of messages per encoding and of messages diffed."""

    diffed: int = 0
    wire_bytes: int = 0
    dense_bytes: int = 0
    received_bytes: int = 0
    encodings: dict = field(default_factory=lambda: dict.fromkeys(ENCODINGS, 0))


class DeltaSchedule:
    """One process's P2P steps in delta mode, built once beside its ``P2PSchedule`` and run per refit.

    Lifecycle: built on every process of the plan (no communication); ``run(clock, version, held)``
    once per refit instead of the P2P schedule's run, same order everywhere; a source calls
    ``base.commit(version)`` after the refit succeeded. Must agree with every peer: the plan, the tags,
    ``config.delta`` and the staging budget (the chunks; pre-flight checks them). ``held``: per receiving
    peer, the version it holds.
    """

    def __init__(self, p2p: P2PSchedule, plan: Plan, proc: int, local: LocalTensors, config: TransferConfig) -> None:
        self.p2p, self.plan, self.proc, self.config = p2p, plan, proc, config
        self.dst_rank = local.dst_rank
        budget = config.num_buffers * config.buffer_bytes
        self.base = SourceBase(plan, proc, local, config.delta_base, budget) if local.src_rank is not None else None
        chunk = _chunks(plan, config)
        self.shares = _shares(plan, config)
        self.steps = []  # per P2P step, its chunks in order; each side's ops grouped by peer (plan order within)
        for st in p2p.steps:
            sends = [self._op(op, local, True) for op in st.sends]
            recvs = [self._op(op, local, False) for op in st.recvs]
            for c in sorted({chunk[d.op.message] for d in sends + recvs}):
                self.steps.append(
                    (
                        sorted((d for d in sends if chunk[d.op.message] == c), key=lambda d: d.op.peer),
                        sorted((d for d in recvs if chunk[d.op.message] == c), key=lambda d: d.op.peer),
                    )
                )
        self.quiet: dict[int, int] = {}  # receiver: sending peer -> quiet refits left (announced by it)
        self.told: dict[int, bool] | None = None  # sender, this refit: receiving peer -> it expects a quiet one
        self.last: dict[tuple[int, int], int] = {}  # (side, peer) -> the step-chunk of its last header message
        self.sends_to: dict[int, list[_DeltaOp]] = {}  # receiving peer -> this process's ops to it (peers sorted)
        for d in sorted((d for sends, _ in self.steps for d in sends), key=lambda d: d.op.peer):
            self.sends_to.setdefault(d.op.peer, []).append(d)
        for i, sides in enumerate(self.steps):
            for side, ops in enumerate(sides):
                for d in ops:
                    self.last[(side, d.op.peer)] = i
        self.headers = self._headers()
        self.ahead: tuple | None = None  # (step-chunk, plans, batches, its first find): queued by ``_prefetch``
        self.applying: torch.device | None = None  # a CUDA device with scatters on its "apply" stream (``_apply``)
        self.ready: torch.cuda.Event | None = None  # sender on CUDA, per run: the run's finds wait for it only
        self.checks: list = []  # receiver, per run: each word scatter's index check (flags, ops, pieces): ``_verify``

    @property
    def receivers(self) -> list[int]:
        """The processes this one sends P2P messages to (it needs the version each holds)."""
        return list(self.sends_to)

    @property
    def receives(self) -> bool:
        """Whether this process receives P2P messages (it tells its senders the version it holds)."""
        return any(recvs for _, recvs in self.steps)

    def _op(self, op: _Op, local: LocalTensors, outgoing: bool) -> _DeltaOp:
        m = self.plan.messages[op.message]
        view = local.src_view if outgoing else local.dst_view
        views = [view(p.tensor, p.box) for p in m.pieces]
        bases = [self.base.local.src_view(p.tensor, p.box) for p in m.pieces] if outgoing else []
        link = link_speed(self.plan, self.plan.procs.src[m.src], self.plan.procs.dst[m.dst], self.config)
        d = _DeltaOp(op, views, bases, link, torch.empty(0))
        d.words = outgoing and self._by_words(views, link)
        d.share = self.shares[op.message]
        d.may_pay = self._may_pay(d)
        d.numels, d.nwords = [v.numel() for v in views], [words_in(v) for v in views]
        d.nbytes = sum(v.numel() * v.element_size() for v in views)
        d.fast = _fast(views + bases) and (d.words or not outgoing)
        d.shared = outgoing and op.message in self.base.shared
        t = op.tensor
        if 0 < t.numel() * t.element_size() <= JOIN_BYTES and t.is_contiguous():
            d.flat = t.view(-1).view(torch.uint8)
        if d.fast:
            sides = (bases, views) if outgoing else (views,)
            d.ptrs = tuple(np.array([t.data_ptr() for t in ts], dtype=np.int64) for ts in sides)
        return d

    def _by_words(self, views: list[torch.Tensor], link: LinkSpeed) -> bool:
        """A message is diffed per 64-bit word (``refit.quant.delta_words``) when every piece has whole words:
        under ``delta="words"``, and under ``"auto"`` where the rule prefers words over its link
        (``_words_for``, decided from the plan alike on every process)."""
        pieces = [(v.numel(), v.element_size()) for v in views]
        return all(words_in(v) is not None for v in views) and _words_for(self.config, pieces, link)

    def _headers(self) -> list[tuple[torch.Tensor, torch.Tensor, tuple]]:
        """Per step, one int64 buffer for the headers it sends and one for those it receives; each op's
        ``header`` is its slice, and the slices of one peer's ops are contiguous (one host-to-device copy
        and one read per step, one P2P message per peer); and the step's header messages to post
        (``_header_msgs`` of both sides), built here once."""
        out = []
        for sends, recvs in self.steps:
            bufs = []
            for ops in (sends, recvs):
                dev = ops[0].op.tensor.device if ops else torch.device("cpu")
                peers = len({d.op.peer for d in ops})
                buf = torch.zeros(sum(3 + len(d.views) for d in ops) + peers, dtype=torch.int64, device=dev)
                off = 0
                for _, group in _by_peer(ops):
                    for d in group:
                        d.header = buf[off : off + 3 + len(d.views)]
                        off += 3 + len(d.views)
                    off += 1  # the trailer: quiet refits announced (``_quiet_after``)
                bufs.append(buf)
            out.append((bufs[0], bufs[1], (self._header_msgs(sends, bufs[0]), self._header_msgs(recvs, bufs[1]))))
        return out

    @staticmethod
    def _header_msgs(ops: list[_DeltaOp], buf: torch.Tensor) -> tuple[list[tuple[int, torch.Tensor, int]], list[_Op]]:
        """``(peer, headers, tag)`` per peer of ``ops`` (the contiguous slice of ``buf`` holding their
        headers and the peer's trailer), and per posted message the op that names it in an error (its
        peer's first)."""
        out, named, off = [], [], 0
        for peer, group in _by_peer(ops):
            n = sum(d.header.numel() for d in group) + 1
            out.append((peer, buf[off : off + n], group[0].op.tag + HEADER_TAG))
            named.append(group[0].op)
            off += n
        return out, named

    @staticmethod
    def _payload_msgs(
        ops: list[_DeltaOp], base: SourceBase | None = None, send: bool = False
    ) -> tuple[list[tuple[int, torch.Tensor, int]], list[_Op]]:
        """``(peer, tensor, tag)`` to post: each large dense message as itself; the deltas to (from) one peer and
        its small dense messages (``_DeltaOp.flat``) as one buffer, their payloads one after another (``_join``:
        every delta's ``payload`` is its slice of it; a sender's ``base`` defers the update of what went as words
        by address to its buffer, ``SourceBase.defer_packed``; ``send``: the small dense messages are copied in,
        else received there and copied out by ``_apply``), under its first message's tag. And per posted message
        the op that names it in an error."""
        out, named = [], []
        for peer, group in _by_peer(ops):
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
                out.append((peer, _join(deltas, base, small, send), (deltas or small)[0].op.tag))
                named.append((deltas or small)[0].op)
        return out, named

    def run(self, clock: RunClock, version: int, held: dict[int, int | None]) -> DeltaStats:
        """Every step: choose and encode (sends), headers, payloads, check and apply (receives). Between a
        pair in a quiet refit (``quiet``: announced by the pair's last header of an earlier refit) no header
        travels: every message between them is dense, as on the plain P2P path. On return (or raise) the
        current stream is behind every scatter queued on the side (``_apply``)."""
        try:
            stats = self._run(clock, version, held)
        except BaseException:
            with contextlib.suppress(Exception):  # the run's own error is the one to see
                self._behind_apply()
            self.fail()  # whoever catches it (a Peer also calls this): nothing this run queued or half-did stays
            raise
        self._behind_apply()
        return stats

    def _behind_apply(self) -> None:
        """The current stream waits for the scatters ``_apply`` queued on the "apply" stream, and for the base's
        updates (``SourceBase.join``), if any."""
        if self.base is not None:
            self.base.join()
        if self.applying is not None:
            dev, self.applying = self.applying, None
            torch.cuda.current_stream(dev).wait_stream(side_stream(dev, "apply"))

    def _run(self, clock: RunClock, version: int, held: dict[int, int | None]) -> DeltaStats:
        stats = DeltaStats()
        self.ahead = None  # a find queued ahead by a run that did not finish is not this run's
        # a process that also receives waits for its whole current stream before each find (its receives could
        # write memory its sends read, were a destination to share storage with a source)
        self.ready = None if self.receives else _ready(self.steps)
        sending: tuple = ([], [])  # the previous chunk's payload sends, still in flight (``_in_flight``)
        quiet = self._quiet_pairs()  # (0 sends / 1 receives, peer): pairs without headers this refit
        after: dict[tuple[int, int], int] = {}  # the quiet refits each pair's last header announced
        # a pure receiver posts a chunk's header receives before it applies the previous chunk, so the sender's next
        # header lands meanwhile (a process that also sends does not: on NCCL a receive queued ahead of its own
        # sends could wait on a peer that waits on them)
        pure_receiver = not any(sends for sends, _ in self.steps)
        pure_sender = not self.receives
        early = self._post_headers(0, quiet) if pure_receiver else ([], [])
        for i, ((sends, recvs), (send_hdr, recv_hdr, headers)) in enumerate(zip(self.steps, self.headers)):
            if sends:
                heads = self._send_step(i, sends, version, held, stats, quiet)
                heads = self._with_trailers(i, sends, heads, quiet, after)
                send_hdr.copy_(_pinned(heads, send_hdr.is_cuda), non_blocking=True)
            if pure_sender:
                sending = self._post_chunk(clock, i, sends, headers[0], quiet, sending)
                continue
            out, out_ops = _loud(*headers[0], 0, quiet)
            inc, inc_ops = ([], []) if pure_receiver else _loud(*headers[1], 1, quiet)
            works = self.p2p.post(out, inc) if out or inc else []
            if works or early[0]:
                reads = bool(inc_ops or early[1])  # the headers are read next: the host waits under the clock
                self.p2p.wait(clock, works + early[0], out_ops + inc_ops + early[1], "delta header exchange", reads)
            got = recv_hdr.tolist() if inc_ops or early[1] else []
            self._receive_headers(i, recvs, got, version, held, quiet, after)
            (out, out_ops), (inc, inc_ops) = self._payload_msgs(sends, self.base, True), self._payload_msgs(recvs)
            works = self.p2p.post(out, inc)
            if sends:  # the base's updates, behind the payload's packing: the sends do not wait for them; the packed
                # ones once the run's last find is queued (the chunk before the last queued its first batch ahead,
                # ``_prefetch``; a later batch of the last chunk may still run beside them)
                self.base.flush(final=i >= len(self.steps) - 2)
            early = self._post_headers(i + 1, quiet) if pure_receiver else ([], [])
            if sending[0]:
                self.p2p.wait(clock, *sending, "delta transfer")
            # sends stay in flight only where their works are their own: NCCL returns one work for a batch
            # of sends and receives, and a receive must be waited for before it is applied
            apart = not inc or len(works) == len(out) + len(inc)
            sending = (works[: len(works) - len(inc)], out_ops) if apart and _in_flight(sends) else ([], [])
            rest, named = works[len(sending[0]) :], (out_ops + inc_ops)[len(out_ops) if sending[0] else 0 :]
            if rest:  # a delta's indices checked on the host next (not words by address, ``_scatter``): the host
                # waits under the clock first
                self.p2p.wait(clock, rest, named, "delta transfer", any(_host_checked(d) for d in recvs))
            self._apply(recvs)
            if recvs:
                stats.received_bytes += sum(d.payload.nbytes for d in recvs) + int(_pieces(recvs).header_bytes.sum())
            for d in sends + recvs:  # the step's payloads are freed now, not held until the next refit
                d.payload = None
        if self.base is not None:
            self.base.flush(final=True)
        if sending[0]:
            self.p2p.wait(clock, *sending, "delta transfer")
        self._verify(clock)
        for peer in {p for side, p in quiet | set(after) if side == 1}:  # counted down, or as announced
            self.quiet[peer] = self.quiet.get(peer, 0) - 1 if (1, peer) in quiet else after.get((1, peer), 0)
        self.told = None
        return stats

    def _post_chunk(self, clock: RunClock, i: int, sends: list, headers: tuple, quiet: set, sending: tuple) -> tuple:
        """A pure sender's step-chunk ``i`` once encoded: its payloads packed, then its headers and payloads posted
        as one batch (a peer receives a header before the payload it sizes: sends to one peer complete in the
        order posted), so the packing waits for no header send and the host for none of them. The base's updates
        behind them (``SourceBase.flush``); the previous chunk's sends waited for (``sending``); returns what
        stays in flight (``_in_flight``)."""
        out, out_ops = _loud(*headers, 0, quiet)
        pay, pay_ops = self._payload_msgs(sends, self.base, True)
        works, ops = self.p2p.post(out + pay, []) if out or pay else [], out_ops + pay_ops
        if sends:
            self.base.flush(final=i >= len(self.steps) - 2)
        if sending[0]:
            self.p2p.wait(clock, *sending, "delta transfer")
        for d in sends:  # the chunk's payloads are freed once sent, not held until the next refit
            d.payload = None
        if _in_flight(sends):
            return works, ops
        if works:
            self.p2p.wait(clock, works, ops, "delta transfer")
        return [], []

    def _post_headers(self, i: int, quiet: set) -> tuple[list, list]:
        """Post step-chunk ``i``'s header receives (but a quiet pair's): ``(works, ops)``; none past the last."""
        if i >= len(self.headers):
            return [], []
        inc, inc_ops = _loud(*self.headers[i][2][1], 1, quiet)
        return (self.p2p.post([], inc), inc_ops) if inc else ([], [])

    def quiet_senders(self) -> list[int]:
        """Receiver: the sending peers whose next refit it expects quiet (published with the version it
        holds: ``exchange_held``; the sender follows it, so a pair never disagrees, even after one of
        them saw a refit fail and the other did not)."""
        return sorted(p for p, left in self.quiet.items() if left > 0)

    def _quiet_pairs(self) -> set[tuple[int, int]]:
        """This refit's quiet pairs: the senders this receiver published (``quiet_senders``) and the
        receivers that published this sender; none without the exchange (``told`` is None)."""
        if self.told is None:
            return set()
        return {(1, p) for p in self.quiet_senders()} | {(0, p) for p, q in self.told.items() if q}

    def fail(self) -> None:
        """The refit failed on some process (each that sees it calls this): no quiet refits are left on
        this one, and a source's base is dropped (``SourceBase.fail``)."""
        self.quiet.clear()
        self.told = None
        self.ahead = None
        self.checks = []
        for d in (d for sides in self.steps for ops in sides for d in ops):  # drop what the failed run held
            d.payload, d.parts, d.changes, d.found = None, [], [], None
        if self.base is not None:
            self.base.fail()

    def _with_trailers(self, i: int, sends: list[_DeltaOp], heads: list[int], quiet: set, after: dict) -> list[int]:
        """Step-chunk ``i``'s send headers with each peer's trailer: in the pair's last header of this refit,
        the quiet refits that follow (``_quiet_after``); 0 elsewhere."""
        out, at = [], 0
        for peer, group in _by_peer(sends):
            n = len(_pieces(group).counted)
            out += heads[at : at + n]
            at += n
            trailer = 0
            if i == self.last[(0, peer)] and (0, peer) not in quiet:
                trailer = self._quiet_after(peer)
            out.append(trailer)
        return out

    def _quiet_after(self, peer: int) -> int:
        """How many refits after this one send every message to ``peer`` dense without a diff, under
        ``delta="auto"`` (a run's plans, ``_plan``, are known from each message's state): a message that
        cannot pay never diffs; one whose last diff the rule sent dense (``dense_next``, or that is stale) diffs
        again after its probe, ``PROBE_EVERY - dense_runs`` refits on; any other diffs next time (0). The least of
        them."""
        if self.config.delta != "auto":
            return 0
        left = QUIET_MAX
        for d in self.sends_to[peer]:
            if not d.may_pay:
                continue
            if not (d.stale or (d.fraction is not None and d.dense_next)):
                return 0
            left = min(left, max(1, PROBE_EVERY - d.dense_runs))
        return left

    def _receive_headers(self, i: int, recvs: list, got: list[int], version: int, held, quiet, after) -> None:
        """Check and size step-chunk ``i``'s receives from ``got`` (its header buffer read once): per peer its
        ops' headers, then the trailer (read in the pair's last header of the refit). A quiet pair's
        messages are dense without a header."""
        off = 0
        for peer, group in _by_peer(recvs):
            at = off + len(_pieces(group).counted)
            if (1, peer) in quiet or not _headers_at_once(group, got[off:at], version, held.get(self.proc)):
                at = off
                for d in group:
                    header = None if (1, peer) in quiet else got[at : at + 3 + len(d.views)]
                    self._receive_into(d, header, version, held.get(self.proc))
                    at += 3 + len(d.views)
            if (1, peer) not in quiet and i == self.last[(1, peer)]:
                after[(1, peer)] = _announced(got[at], group[0].op)
            off = at + 1

    def _send_step(
        self, i: int, sends: list[_DeltaOp], version: int, held: dict, stats: DeltaStats, quiet: set = frozenset()
    ) -> list[int]:
        """Plan, diff and encode step-chunk ``i``'s sends; their headers, in order. Messages to diff are diffed
        in batches of at most ``FIND_BATCH_BYTES`` of data (``find_changes_many``: one host sync per batch)
        and encoded at once (a chunk's slots are held until its payload is posted: bounded by the chunk). Once
        the last batch's find is queued, the next step-chunk's first find is queued behind it (``_prefetch``; with
        one batch or none, before this chunk's dense messages are encoded): the device finds it while the host
        encodes this one."""
        plans, batches, pending = self._planned(i, sends, held, quiet)
        if batches and pending is None:  # the first find queued before the dense messages' copies
            pending = _launch_fast([sends[j] for j in batches[0]], self.ready)
        if len(batches) <= 1:
            self._prefetch(i + 1, held, quiet)
        heads: list[list[int]] = [[] for _ in sends]
        for j, d in enumerate(sends):
            if plans[j] != "diff":
                heads[j] = self._encode(d, plans[j], version, stats)
        for b, batch in enumerate(batches):
            ops = [sends[j] for j in batch]
            launched = pending if b == 0 else _launch_fast(ops, self.ready)
            if b == len(batches) - 1 > 0:  # the next step-chunk's find queued behind this one, before the wait
                self._prefetch(i + 1, held, quiet)
            _find(ops, launched)  # encoded batch by batch; the slots are dropped once the chunk is posted
            at_once = self._encode_found([sends[j] for j in batch], version, stats)
            for j in batch:
                heads[j] = at_once.get(id(sends[j])) or self._encode(sends[j], "diff", version, stats)
        return list(chain.from_iterable(heads))

    def _planned(self, i: int, sends: list[_DeltaOp], held: dict, quiet: set) -> tuple:
        """Step-chunk ``i``'s plans, its find batches and its first batch's find if ``_prefetch`` queued it."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == i:
            return ahead[1:]
        plans = self._plans(sends, held, quiet)
        return plans, _batches_of(sends, plans), None

    def _plans(self, sends: list[_DeltaOp], held: dict, quiet: set) -> list[str]:
        base = self.base.version
        plans = [self._plan(d, base is not None and held.get(d.op.peer) == base) for d in sends]
        return ["skip" if p == "diff" and (0, d.op.peer) in quiet else p for p, d in zip(plans, sends)]

    def _prefetch(self, i: int, held: dict, quiet: set) -> None:
        """Queue step-chunk ``i``'s first find where its messages go by address (``launch_words_table``, no
        wait): ``_send_step(i)`` takes it with the plans it was made for."""
        sends = self.steps[i][0] if i < len(self.steps) else []
        if not sends:
            return
        plans = self._plans(sends, held, quiet)
        batches = _batches_of(sends, plans)
        self.ahead = (i, plans, batches, _launch_fast([sends[j] for j in batches[0]], self.ready) if batches else None)

    def _encode(self, d: _DeltaOp, plan: str, version: int, stats: DeltaStats) -> list[int]:
        """Fill ``d``'s payload (dense: packed as the P2P path does) by ``plan`` (``_plan``) and the
        changes ``_find`` found; return its header ``[encoding, base version, version, k per piece]``."""
        base = self.base.version
        d.kind = "dense"
        if plan == "diff":
            d.kind = self._choose(d)
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
                self.base.update(d.op.message, [(b, None, v) for b, v in zip(d.bases, d.views)])
            if plan == "refresh":
                d.fraction, d.dense_next = None, False  # the next run diffs and measures again
        elif d.found is not None:  # words by address: packed by ``_join``, the base updated from it (``defer_packed``)
            d.payload, d.wire = None, int(wire_sizes(np.array(counts)).sum())
            if d.shared:
                self.base.defer_found(d.found, d.bases)
        else:
            d.payload = self._pack_delta(d)
            self.base.update(d.op.message, [(b, i, x) for b, (i, x) in zip(d.bases, d.changes)], d.kind == "words")
        d.changes = []
        payload = d.wire if d.payload is None else d.payload.numel() * d.payload.element_size()
        stats.wire_bytes += payload + d.header.numel() * 8
        stats.dense_bytes += d.op.tensor.numel() * d.op.tensor.element_size()
        stats.encodings[d.kind] += 1
        return [ENCODINGS.index(d.kind), -1 if base is None else base, version, *counts]

    def _encode_found(self, ops: list[_DeltaOp], version: int, stats: DeltaStats) -> dict[int, list[int]]:
        """``_encode`` at once of a find batch's diffed messages found by address that go as words (numpy over
        the find's counts: no Python step per piece): their headers by ``id``. The others (the rule says
        dense, a piece over its slots, several finds) are left to ``_encode``."""
        fast = [d for d in ops if d.found is not None]
        if not fast or not _one_run(fast):
            return {}
        found, s, at = fast[0].found[0], _pieces(fast), fast[0].found[1]
        k, starts, cap = found.count[at : at + s.first[-1]], s.first[:-1], found.cap[at : at + s.first[-1]]
        words = np.add.reduceat((k > cap).astype(np.int64), starts) == 0
        if self.config.delta != "words":
            words &= self._rule_says_words(fast, k, s)
        fraction = (np.add.reduceat(k, starts) / np.maximum(1, s.op_words)).tolist()
        wire, counts = np.add.reduceat(wire_sizes(k), starts), k.tolist()
        base, out, chosen = self.base.version, {}, np.flatnonzero(words)
        head = [ENCODINGS.index("words"), -1 if base is None else base, version]
        for j, w in zip(chosen.tolist(), wire[chosen].tolist()):
            d, (a, b) = fast[j], s.spans[j]
            d.kind, d.dense_runs, d.fraction, d.changes, d.payload, d.wire = "words", 0, fraction[j], [], None, w
            d.dense_next = False
            out[id(d)] = head + counts[a:b]
        for j in np.flatnonzero(words & s.shared).tolist():  # shared ones' bases wait for ``commit``; the others'
            # come from the packed payload (``SourceBase.defer_packed``)
            self.base.defer_found(fast[j].found, fast[j].bases)
        stats.wire_bytes += int(wire[chosen].sum() + s.header_bytes[chosen].sum())
        stats.dense_bytes += int(s.dense_bytes[chosen].sum())
        stats.diffed += len(out)
        stats.encodings["words"] += len(out)
        return out

    @staticmethod
    def _rule_says_words(ops: list[_DeltaOp], k: np.ndarray, s: _Pieces) -> np.ndarray:
        """``choose_words`` of ``ops`` (``s``: their ``_pieces``; ``k``: the changes per piece), at once where they
        share one link (else op by op)."""
        n, size, first = s.numels, s.itemsize, s.first
        if all(d.link == ops[0].link for d in ops):
            share = np.array([d.share for d in ops])
            return choose_words_many(n, k, size, first, ops[0].link, share)
        pieces = [list(zip(n[a:b].tolist(), k[a:b].tolist(), size[a:b].tolist())) for a, b in zip(first, first[1:])]
        return np.array([choose_words(p, d.link, d.share) == "words" for p, d in zip(pieces, ops)], dtype=bool)

    def _choose(self, d: _DeltaOp) -> str:
        """The encoding of a diffed message (``d.changes`` found, ``d.fraction`` measured): the forced one or
        the rule's. A word-found message is sent as words or dense; one whose changes overflowed the find's
        slots (``None``) is found again when words are forced, else sent dense."""
        forced = self.config.delta if self.config.delta in ENCODINGS else None
        if not d.words:
            forced = "sparse" if forced == "words" else forced  # a piece without whole words: per element
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

    def _plan(self, d: _DeltaOp, base_ok: bool) -> str:
        """``"diff"``; ``"refresh"`` (dense, and the base copied at commit so the next run may diff: a
        receiver without the base, the first run, a probe every ``PROBE_EVERY`` dense runs); or ``"skip"``
        (dense, the base left as it was and marked stale: under ``auto`` on a link where no delta can pay
        (``_may_pay``: a same-device link, NVLink at the measured find rate), or while the rule sent its last
        diff dense (``dense_next``), so a steady 100% change costs neither a diff nor a copy)."""
        auto = self.config.delta == "auto"
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

    @staticmethod
    def _may_pay(d: _DeltaOp) -> bool:
        """Whether a delta of ``d`` could beat dense at all (``quant.delta.may_pay``: its best case by a
        margin), else finding the changes costs about what sending everything does (NVLink with the
        measured find rate) and ``auto`` never diffs ``d``, not even to probe."""
        return may_pay([(v.numel(), v.element_size()) for v in d.views], d.link, d.words, d.share)

    def _pack_delta(self, d: _DeltaOp) -> torch.Tensor:
        """``d``'s payload: its pieces encoded one after another. Words are not copied here: ``d.parts`` lists
        their bytes (indices, padding, words per piece) and ``_join`` copies them once into the peer's
        buffer; the payload returned is only sized (``device="meta"``)."""
        sizes = [_piece_wire(d.kind, v, len(i)) for v, (i, _) in zip(d.views, d.changes)]
        if d.kind == "words":
            d.parts = [p for i, w in d.changes for p in _word_parts(i, w)]
            return torch.empty(sum(sizes), dtype=torch.uint8, device="meta")
        out = torch.empty(sum(sizes), dtype=torch.uint8, device=d.op.tensor.device)
        off = 0
        for v, (i, x), n in zip(d.views, d.changes, sizes):
            encode(d.kind, v.numel(), i, x, out[off : off + n])
            off += n
        return out

    def _receive_into(self, d: _DeltaOp, header: list[int], version: int, held: int | None) -> None:
        """Check ``d``'s received header and size its payload (dense: the plain op's tensor; a delta: an
        unallocated tensor of its length, made a slice of its peer's buffer by ``_join``)."""
        me = f"process {self.proc} (destination rank {self.dst_rank})"
        if header is None:  # a quiet refit: dense, no header
            d.kind, d.changes = "dense", [0] * len(d.views)
        else:
            d.kind, d.changes = check_header(header, d.numels, version, held, d.op, me, d.nwords)
        if d.kind == "dense":
            d.payload = d.op.tensor
        else:
            n = sum(_piece_wire(d.kind, v, k) for v, k in zip(d.views, d.changes))
            d.payload = torch.empty(n, dtype=torch.uint8, device="meta")

    def _apply(self, recvs: list[_DeltaOp]) -> None:
        """Check every delta's indices first (one host sync per kind: a bad index raises ``DeltaError``
        naming its message before anything of the chunk is written; words by address: ``_scatter``, checked on
        the device, nothing of the chunk's words stored if one is bad, named at the run's end), then unpack the
        dense messages (a small one first copied out of its peer's joined buffer) and scatter the deltas into their
        views."""
        todo, words, fast = [], [], [d for d in recvs if d.kind == "words" and d.fast]
        for d in recvs:
            if d.kind == "dense" or (d.kind == "words" and d.fast):
                continue
            off = 0
            for v, k in zip(d.views, d.changes):
                n = _piece_wire(d.kind, v, k)
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
        if fast:
            self._scatter(fast)

    def _scatter(self, fast: list[_DeltaOp]) -> None:
        """Words by address: every index checked and the words scattered, one launch each, queued without a host
        sync (on CUDA the scatter beside the current stream: the next chunk's header read does not wait for it).
        The scatter stores nothing if any index of the chunk is outside its piece; ``_verify`` reads the check
        at the end of the run and names the message."""
        scatter, dev = _located(fast), fast[0].views[0].device
        flags = torch.zeros(1 + len(scatter.pieces), dtype=torch.int32, device=dev)
        scatter.check(flags)
        self.checks.append((flags, fast, scatter.pieces))
        self.applying = dev if dev.type == "cuda" else None
        scatter.apply(side_stream(dev, "apply") if self.applying else None, tuple(d.payload for d in fast), flags)

    def _verify(self, clock: RunClock) -> None:
        """The index checks ``_scatter`` queued, read once (on CUDA under ``clock``): ``DeltaError`` naming the
        first message with a word index outside its piece (its chunk stored none of its words)."""
        checks, self.checks = self.checks, []
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
                d = ops[int(np.searchsorted(_pieces(ops).first, bad, side="right")) - 1]
                raise DeltaError(
                    f"delta from process {d.op.peer} ({d.op.what()}): a word index is outside its piece "
                    "(none of that chunk's words were stored)"
                )


def _chunks(plan: Plan, config: TransferConfig) -> dict[int, int]:
    """Each P2P message's chunk within its step: the step's messages in plan order, cut where their bytes pass
    the staging budget (at most ``FIND_BATCH_BYTES``, or ``WORD_BATCH_BYTES`` where words may be sent) times
    the step's sending processes. Every process
    computes the same cuts and runs a step chunk by chunk (headers, payloads, apply), so a receiver applies
    one chunk while its sender finds the next, and the changes held at a time stay bounded."""
    by_step: dict[int, list[int]] = {}
    for i, m in enumerate(plan.messages):
        if m.transport == "p2p":
            by_step.setdefault(m.step, []).append(i)
    out: dict[int, int] = {}
    for ids in by_step.values():
        senders = len({plan.procs.src[plan.messages[i].src] for i in ids})
        batch = WORD_BATCH_BYTES if config.delta in ("words", "auto") else FIND_BATCH_BYTES
        limit = max(1, min(batch, config.num_buffers * config.buffer_bytes)) * senders
        c, size = 0, 0
        for i in ids:
            if size and size + plan.messages[i].nbytes > limit:
                c, size = c + 1, 0
            out[i] = c
            size += plan.messages[i].nbytes
    return out


def _headers_at_once(group: list[_DeltaOp], got: list[int], version: int, held: int | None) -> bool:
    """``_receive_into`` at once (numpy) of one peer's ops whose headers (``got``) all say words or dense of this
    ``version``: words on the base ``held``, every count within its piece's words; dense with every count 0 (as
    a sender writes them). False otherwise, nothing set (op by op, ``check_header`` then names what is wrong).
    A chunk of a few dense messages among many of words (``auto``: a norm's few KiB go dense) takes no Python
    step per op but for its dense ones."""
    s, h = _pieces(group), np.array(got, dtype=np.int64)
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


def _loud(msgs: list, ops: list, side: int, quiet: set) -> tuple[list, list]:
    """The header messages (and the ops naming them) of the pairs not quiet this refit."""
    keep = [j for j, (peer, _, _) in enumerate(msgs) if (side, peer) not in quiet]
    return [msgs[j] for j in keep], [ops[j] for j in keep]


def _announced(value: int, op: _Op) -> int:
    """A header trailer (the quiet refits a sender announces), checked: ``DeltaError`` unless in range."""
    if not 0 <= value <= QUIET_MAX:
        raise DeltaError(f"malformed delta header from process {op.peer}: {value} quiet refits announced")
    return value


def _send_stream(device: torch.device):
    """On a CUDA sender, what runs inside (a chunk's packing) is queued on the device's high-priority ``"send"``
    side stream, behind everything queued on the current stream so far, and the current stream then waits for it
    (``cudart.joined``). The next chunk's find, queued before on its own stream, fills the device with its
    blocks: a kernel of the current stream's default priority would start only once they are all scheduled, this
    one starts at once, and so do the payload's sends behind it where the NCCL group's streams are of high
    priority too (``ProcessGroupNCCL.Options(is_high_priority_stream=True)``). A kernel inside reading tensors
    made on another stream marks them for this one (``record_stream``). On CPU: nothing."""
    return joined(side_stream(device, "send"), device) if device.type == "cuda" else contextlib.nullcontext()


def _host_checked(d: _DeltaOp) -> bool:
    """Whether a received delta's indices are checked with a host sync (every kind but dense and words by
    address, whose check ``_scatter`` queues on the device)."""
    return d.kind != "dense" and not (d.kind == "words" and d.fast)


def _in_flight(sends: list[_DeltaOp]) -> bool:
    """Whether a chunk's payload sends may stay in flight while the next chunk is found: none reads the packed
    ring buffer, which the next chunk may fill (deltas, whole tensors and the joined buffers, where a small dense
    message's ring slice was copied, are not written again this refit; a posted send keeps its tensor alive until
    it completes)."""
    return not any(d.kind == "dense" and d.op.pack and d.flat is None for d in sends)


def _pinned(values: list[int], cuda: bool) -> torch.Tensor:
    """``values`` as an int64 CPU tensor, pinned for a copy to a CUDA device (that copy then does not wait for
    the kernels queued before it, as one from pageable memory would). Through numpy (twice as fast as
    ``torch.tensor`` on a list of a step-chunk's thousand header words)."""
    t = torch.from_numpy(np.array(values, dtype=np.int64))
    return t.pin_memory() if cuda else t


def _words_for(config: TransferConfig, pieces: list[tuple[int, int]], link: LinkSpeed) -> bool:
    """Whether a message of whole-word pieces ``(n, itemsize)`` is found per word: always under
    ``delta="words"``, under ``"auto"`` where ``quant.delta.prefer_words`` says so for its link."""
    return config.delta == "words" or (config.delta == "auto" and prefer_words(pieces, link))


def _shares(plan: Plan, config: TransferConfig) -> dict[int, float]:
    """Each P2P message's part of its chunk's bytes (``_chunks``): the part of a chunk's fixed cost
    (``LinkSpeed.chunk_s``) the encoding rule charges a delta of it. The same on every process."""
    chunk = _chunks(plan, config)
    total: dict[tuple[int, int], int] = {}
    for i, c in chunk.items():
        key = (plan.messages[i].step, c)
        total[key] = total.get(key, 0) + plan.messages[i].nbytes
    return {i: plan.messages[i].nbytes / max(1, total[(plan.messages[i].step, c)]) for i, c in chunk.items()}


def _by_peer(ops: list[_DeltaOp]) -> list[tuple[int, list[_DeltaOp]]]:
    """``ops`` (sorted by peer) as ``(peer, its ops in order)``, grouped once per list (``_memo``)."""
    if not ops:
        return []
    return _memo(ops, ("peers",), lambda ops: [(p, list(g)) for p, g in groupby(ops, key=lambda d: d.op.peer)])


def _join(
    deltas: list[_DeltaOp], base: SourceBase | None = None, small: list[_DeltaOp] = (), send: bool = False
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
    if deltas and deltas[0].found is not None and all(d.found is not None for d in deltas) and _one_run(deltas):
        buf = _join_run(deltas, base, extra)
    elif deltas:
        buf = _join_any(deltas, base, extra)
    else:
        buf = torch.empty(extra, dtype=torch.uint8, device=small[0].op.tensor.device)
    if small:
        _join_small(small, buf[buf.numel() - extra :], send)
    return buf


def _join_any(deltas: list[_DeltaOp], base: SourceBase | None, extra: int) -> torch.Tensor:
    """``_join``'s deltas in a buffer of their bytes and ``extra`` more, slice by slice."""
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


def _join_run(deltas: list[_DeltaOp], base: SourceBase | None, extra: int = 0) -> torch.Tensor:
    """``_join`` of a sender's deltas that are one run of one find's pieces (words by address, ``_one_run``),
    in a buffer of their bytes and ``extra`` more: packed by one launch, no slice per delta."""
    found, first, end = deltas[0].found[0], deltas[0].found[1], deltas[-1].found[2]
    buf = torch.empty(sum(d.wire for d in deltas) + extra, dtype=torch.uint8, device=deltas[0].op.tensor.device)
    rows = _pack_spans(found, np.array([[first, end, 0]], dtype=np.int64), buf, deltas)
    if base is not None:
        base.defer_packed(rows, buf)
    for d in deltas:
        d.found = None
    return buf


def _join_small(small: list[_DeltaOp], out: torch.Tensor, send: bool) -> None:
    """The small dense messages' bytes (``_DeltaOp.flat``) one after another in ``out``: a sender copies them in
    (one launch, on the ``"send"`` stream beside the next chunk's find, as ``_pack_spans``); a receiver's
    ``payload`` becomes its slice, copied out by ``_apply`` once received."""
    flats = _memo(small, ("flats",), lambda ops: [d.flat for d in ops])
    if send:
        with _send_stream(out.device):
            torch.cat(flats, out=out)
        return
    for d, part in zip(small, out.split([f.numel() for f in flats])):
        d.payload = part


def _pack_spans(found: Found, spans: np.ndarray, buf: torch.Tensor, ops: list[_DeltaOp]) -> tuple:
    """Pack pieces of ``found`` into ``buf`` in one launch: per row of ``spans`` (first piece, end, byte offset
    in ``buf``; one row per op of ``ops``, whose pieces they are) those pieces one after another from that offset,
    each in its wire format. Returns the base update it makes possible, read from ``buf``: per piece with
    changes of an op no other message shares (``_Pieces.mine``), ``(base address, index address, word address,
    changes, words)`` (numpy int64 each; ``Scatter.of``'s rows)."""
    lengths = spans[:, 1] - spans[:, 0]
    sel = np.repeat(spans[:, 0] - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
    k = found.count[sel]
    sizes = wire_sizes(k)
    before = np.cumsum(sizes) - sizes  # bytes before each piece, over all spans
    first = np.cumsum(lengths) - lengths
    dst = (buf.data_ptr() + np.repeat(spans[:, 2] - before[first], lengths) + before).astype(np.int64)
    with _send_stream(buf.device):  # beside the next chunk's find
        pack_table(found, sel, dst, buf.device)
    s = _pieces(ops)
    keep = s.mine & (k > 0) & (k <= found.cap[sel])
    return s.ptrs[0][keep], dst[keep], dst[keep] + index_bytes(k[keep]), k[keep], s.nwords[keep]


def _word_parts(idx: torch.Tensor, words: torch.Tensor) -> list[torch.Tensor]:
    """One piece's word payload as byte views: its int32 indices, zero padding to 8 bytes, its words."""
    if len(idx) % 2 == 0:
        return [idx.view(torch.uint8), words.view(torch.uint8)]
    pad = _PADS.get(idx.device)
    if pad is None:
        pad = _PADS[idx.device] = torch.zeros(4, dtype=torch.uint8, device=idx.device)
    return [idx.view(torch.uint8), pad, words.view(torch.uint8)]


_PADS: dict[torch.device, torch.Tensor] = {}  # 4 zero bytes per device (``_word_parts``), made once


def _ready(steps: list) -> torch.cuda.Event | None:
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


def _launch(fast: list[_DeltaOp], after: torch.cuda.Event | None = None) -> PendingFind:
    """The find of ``fast`` (messages found per word by address) in one launch, not waited for; on CUDA
    behind ``after`` (``launch_words_table``)."""
    s = _pieces(fast)
    return launch_words_table(s.ptrs[0], s.ptrs[1], s.nwords, fast[0].views[0].device, after)


def _launch_fast(ops: list[_DeltaOp], after: torch.cuda.Event | None = None) -> PendingFind | None:
    """``_launch`` of those of ``ops`` found per word by address; None where there are none."""
    fast = [d for d in ops if d.words and d.fast]
    return _launch(fast, after) if fast else None


def _batches(sends: list[_DeltaOp], plans: list[str]) -> list[list[int]]:
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


def _batches_of(sends: list[_DeltaOp], plans: list[str]) -> list[list[int]]:
    """``_batches``, cut once per step-chunk and set of plans (``_memo``: a refit repeats them)."""
    return _memo(sends, ("batches", *plans), lambda ops: _batches(ops, plans)) if sends else []


def _find(ops: list[_DeltaOp], pending: PendingFind | None) -> Found | None:
    """The changes of every piece of ``ops`` (one batch of a step's sends): words by address from ``pending``
    (``_launch_fast`` of this batch, queued by the caller or ``_prefetch``; each op's ``found``: its pieces'
    range there), other word-found ops per piece
    (``find_words_many``: ``changes`` = ``(indices, words, count)`` per piece), the rest per element
    (``find_changes_many``: ``(indices, values)`` per piece). All views of the finds' slots, encoded and
    dropped soon. Returns the find by address (None: none)."""
    fast, found = [d for d in ops if d.words and d.fast], None
    if fast:
        found = pending.result()  # ``_launch_fast`` returns None only where no op is fast
        for d, (a, b) in zip(fast, _pieces(fast).spans):
            d.found = (found, a, b)
    rest = [d for d in ops if not (d.words and d.fast)] if len(fast) < len(ops) else []
    for by_words, find in ((True, find_words_many), (False, lambda pairs: find_changes_many(pairs, copy=False))):
        chosen = [d for d in rest if d.words == by_words]
        got = find([(b, v) for d in chosen for b, v in zip(d.bases, d.views)]) if chosen else []
        for d in chosen:
            d.changes, got = got[: len(d.views)], got[len(d.views) :]
    return found


def _one_run(fast: list[_DeltaOp]) -> bool:
    """Whether the ``found`` of ``fast`` (each op's ``(Found, first piece, end)``) are one find's pieces, one op's
    after the other's, as many as their pieces (``_pieces``)."""
    f, total = fast[0].found[0], int(_pieces(fast).first[-1])
    if fast[-1].found[2] - fast[0].found[1] != total or not all(d.found[0] is f for d in fast):
        return False
    return [d.found[1] for d in fast[1:]] == [d.found[2] for d in fast[:-1]]


def _fast(tensors: list[torch.Tensor]) -> bool:
    """Whether the word kernels address every one of ``tensors`` on one device (``delta_words.addressable``):
    then a message's words go by address, with no per-piece tensor work."""
    return bool(tensors) and all(addressable(t) and t.device == tensors[0].device for t in tensors)


def _located(ops: list[_DeltaOp]) -> Scatter:
    """A receiver's words by address (every destination view addressable): each piece's indices and words
    located in its op's payload by arithmetic, as one ``Scatter`` table. The caller checks and applies it."""
    s = _pieces(ops)
    k = np.array([c for d in ops for c in d.changes], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(wire_sizes(k))[:-1]]).astype(np.int64)
    first, dst, n = s.first, s.ptrs[0], s.nwords
    payload = np.repeat(np.array([d.payload.data_ptr() for d in ops], dtype=np.int64), np.diff(first))
    idx = payload + starts - np.repeat(starts[first[:-1]], np.diff(first))  # each op's pieces from its payload
    return Scatter.of(dst, idx, idx + index_bytes(k), k, n, ops[0].views[0].device)


def _named(ok, items: list[tuple]) -> None:
    """Raise ``DeltaError`` unless ``ok(items)``, naming the first message (item[0], a ``_DeltaOp``) whose own
    items fail (an error path: a check per message)."""
    if not items or ok(items):
        return
    for d in dict.fromkeys(it[0] for it in items):
        if not ok([it for it in items if it[0] is d]):
            raise DeltaError(f"delta from process {d.op.peer} ({d.op.what()}): a word index is outside its piece")
    raise DeltaError("a word index is outside its piece (found by the joint check, not per message)")


def exchange_held(
    store: SignedStore,
    key: str,
    proc: int,
    held: int | None,
    publish: bool,
    peers: list[int],
    timeout_s: float,
    quiet: list[int] = (),
) -> tuple[dict[int, int | None], dict[int, bool]]:
    """Before a delta run: a receiving process publishes ``{"held": version, "quiet": [senders]}`` under
    ``{key}/{proc}`` (signed; ``quiet``: the senders whose refit it expects without headers,
    ``DeltaSchedule.quiet_senders``), a sending one reads its receivers' (``timeout_s`` each); returns
    ``({proc: version}`` with this process's own, ``{receiver: whether it expects this sender quiet})``. A
    record that is not ``{"held": int >= 0 or null, "quiet": [int >= 0, ...]}`` raises ``DeltaError``."""
    if publish:
        store.put(f"{key}/{proc}", {"held": held, "quiet": list(quiet)})
    out, told = {proc: held}, {}
    for p in peers:
        rec = store.get(f"{key}/{p}", timeout_s)
        ok = isinstance(rec, dict) and set(rec) == {"held", "quiet"}
        v, q = (rec["held"], rec["quiet"]) if ok else (-1, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            ok = False
        if not isinstance(q, list) or len(q) > 1 << 16 or not all(_proc_id(x) for x in q):
            ok = False
        if not ok:
            raise DeltaError(
                f"process {p} published {rec!r} as the version it holds, not "
                "{'held': version or null, 'quiet': [process, ...]}"
            )
        out[p], told[p] = v, proc in q
    return out, told


def _proc_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31


def _piece_wire(kind: str, view: torch.Tensor, k: int) -> int:
    return wire_bytes(kind, view.numel(), k, view.element_size())


def check_header(
    header: list[int],
    sizes: list[int],
    version: int,
    held: int | None,
    op: _Op,
    me: str = "this receiver",
    words: list[int | None] | None = None,
) -> tuple[str, list[int]]:
    """A received header, field by field: the encoding, the version being sent, a delta's base version
    equal to the version this receiver holds, and ``0 <= k <= n`` per piece (``n``: its elements, or for
    words its 64-bit ``words``, None where it has none). Returns ``(encoding, counts)``; ``DeltaError``
    names both versions and the peer otherwise."""
    who = f"process {op.peer} ({op.what()})"
    if len(header) != 3 + len(sizes) or not 0 <= header[0] < len(ENCODINGS):
        raise DeltaError(f"malformed delta header from {who}: {header[:3]}")
    kind, base, sent, counts = ENCODINGS[header[0]], header[1], header[2], header[3:]
    if sent != version:
        raise DeltaError(f"the message from {who} is of version {sent}, this refit is version {version}")
    if kind != "dense" and base != held:
        mine = "no version" if held is None else f"version {held}"
        raise DeltaError(
            f"{me} refuses a delta of version {version} from {who}: it was computed on base version {base}, "
            f"{me} holds {mine} (a dense refit heals it)"
        )
    if kind == "words":
        sizes = [-1 if w is None else w for w in (words or [None] * len(sizes))]
    for k, n in zip(counts, sizes):
        if not 0 <= k <= n:
            raise DeltaError(f"delta header from {who} claims {k} changes in a piece of {n} elements")
    return kind, counts
