"""Delta refits over torch.distributed P2P: each message carries only what changed since the base version.

Setup (once): ``SourceBase`` (``base``) copies a source process's tensors that it sends over P2P (on the device
or in pinned host memory: ``TransferConfig.delta_base``); ``DeltaSchedule`` pairs each of the process's P2P ops
(``P2PSchedule``) with its pieces' views, the base views (sender) and the link's speed (``DeltaOp``, ``ops``);
what a refit derives from the ops of a find batch or a peer's group (addresses, sizes, header layout, groups,
batches) is built on its first use and kept (``memoized``, ``Pieces``): a refit does numpy over arrays, not
Python per message.

Per refit, per step and chunk of a step (``chunks.step_chunks``: at most the staging budget of data per
sending process; host-driven; on CUDA the current stream is synchronized by the header reads, while the word
finds and a receiver's word scatters run on streams of their own, ``words.side_stream``):

1. each sender plans and encodes its messages (``send``): dense when the receiver does not hold the sender's
   base version (heal), on a same-device link, or when the rule sent its last diff dense (``dense_next``;
   then the base is not maintained either, until a probe every ``PROBE_EVERY`` runs refreshes it); else
   ``find_changes_many`` over the pieces and ``choose_encoding`` (or the forced ``TransferConfig.delta``) over
   the message, or, for a message whose pieces have whole 64-bit words under ``"words"`` / ``"auto"``,
   ``find_words_many`` (one launch for every such piece of a batch) and ``choose_words``;
2. headers travel (``header``: int64 ``[kind, base version, version, k per piece]`` per message), one P2P
   message per peer per step holding the headers of every message of the step between the two (tag: the
   first of those messages' tags plus ``HEADER_TAG``);
3. payloads (``payload``): a dense message as the plain P2P path sends it (packed ring buffer or the tensor
   itself); the deltas of a step to one peer as one P2P message (their encoded pieces, ``wire.encode``, one
   after another, sized from the headers; tag: the first delta's own). A step of 291 direct messages
   (Llama-3.1-8B, 1 -> 1) posts 2 P2P ops per peer instead of 582;
4. receivers (``receive``) check the header (``check_header``: kind, version, base version = the version
   they hold, counts) and apply: dense unpacks, a delta scatters (``apply_changes``; words: one checked
   launch for the chunk, ``scatter_words_many``; by address with no host sync, ``scatter_by_address``, the
   check read at the end of the run, ``verify_checks``), O(changed). A sender's payload sends stay in flight
   until the next chunk's are posted (``_in_flight``: not when one reads the packed ring buffer).

The sender's base follows what each message sent (``SourceBase.update``: dense copies as they are encoded,
word changes once the chunk's payload is posted, ``flush``; words by address from their packed payload,
``SourceBase.defer_packed``, applied once the run's last find is queued (one launch; another before, when the
buffers held would pass the staging budget), so the finds run back to back; a source box sent to several
receivers at commit); the version it holds is set after the refit succeeded (``commit``), and a failed refit
clears it (``fail``), so the next refit is dense everywhere. On CUDA a sender packs on a high-priority stream
(``payload.send_stream``): the next chunk's find, queued before, fills the device with its blocks, and the
pack and the payload's sends (on the NCCL group's streams, high priority where the group was made so) start
beside it, not after it.

Extra memory: the base (this process's P2P-sent source bytes) plus the payloads of one chunk's deltas while
the chunk runs (each smaller than its message's dense bytes by the rule, unless forced; a sender briefly holds
them twice, per message and joined per peer, and keeps its packed payloads of words by address until their
base update: within the staging budget, ``num_buffers * buffer_bytes``, or one larger buffer alone,
``defer_packed``) and the find's slots (a quarter of the words found; a sender holds every find batch's slots
of a chunk until its payload is packed and posted, plus the next chunk's first batch found ahead,
``_prefetch``; on CUDA they come from the find stream's own pool, which PyTorch's allocator keeps cached for
that stream).
"""

from __future__ import annotations

import contextlib
from itertools import chain

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.delta.base import SourceBase
from refit.delta.chunks import chunk_shares, link_speed, plan_may_pay, step_chunks, words_for
from refit.delta.header import HEADER_TAG, announced
from refit.delta.ops import JOIN_BYTES, DeltaOp, DeltaStats, by_peer, pieces_of
from refit.delta.payload import payload_msgs
from refit.delta.receive import apply_received, headers_at_once, host_checked, receive_into, verify_checks
from refit.delta.rule import LinkSpeed
from refit.delta.send import (
    batches_of,
    encode_found,
    encode_op,
    find_batch,
    launch_fast,
    op_may_pay,
    plan_of,
    quiet_after,
    ready_event,
)
from refit.delta.words import addressable, side_stream, words_in
from refit.plan import Plan
from refit.transport.clock import RunClock
from refit.transport.p2p import P2PSchedule, _Op


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
        chunk = step_chunks(plan, config)
        self.shares = chunk_shares(plan, config)
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
        self.sends_to: dict[int, list[DeltaOp]] = {}  # receiving peer -> this process's ops to it (peers sorted)
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
        self.checks: list = []  # receiver, per run: each word scatter's index check (``verify_checks``)

    @staticmethod
    def wanted(plan: Plan, config: TransferConfig) -> bool:
        """Whether ``plan`` runs in delta mode under ``config``: deltas on, and under ``delta="auto"`` only where
        the protocol can pay for the plan (``chunks.plan_may_pay``); else the plain P2P path runs (no base copy,
        no header exchange). The same answer on every process."""
        return config.deltas and (config.delta != "auto" or plan_may_pay(plan, config))

    @property
    def receivers(self) -> list[int]:
        """The processes this one sends P2P messages to (it needs the version each holds)."""
        return list(self.sends_to)

    @property
    def receives(self) -> bool:
        """Whether this process receives P2P messages (it tells its senders the version it holds)."""
        return any(recvs for _, recvs in self.steps)

    def _op(self, op: _Op, local: LocalTensors, outgoing: bool) -> DeltaOp:
        m = self.plan.messages[op.message]
        view = local.src_view if outgoing else local.dst_view
        views = [view(p.tensor, p.box) for p in m.pieces]
        bases = [self.base.local.src_view(p.tensor, p.box) for p in m.pieces] if outgoing else []
        link = link_speed(self.plan, self.plan.procs.src[m.src], self.plan.procs.dst[m.dst], self.config)
        d = DeltaOp(op, views, bases, link, torch.empty(0))
        d.words = outgoing and self._by_words(views, link)
        d.share = self.shares[op.message]
        d.may_pay = op_may_pay(d)
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
        """A message is diffed per 64-bit word (``refit.delta.words``) when every piece has whole words:
        under ``delta="words"``, and under ``"auto"`` where the rule prefers words over its link
        (``words_for``, decided from the plan alike on every process)."""
        pieces = [(v.numel(), v.element_size()) for v in views]
        return all(words_in(v) is not None for v in views) and words_for(self.config, pieces, link)

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
                for _, group in by_peer(ops):
                    for d in group:
                        d.header = buf[off : off + 3 + len(d.views)]
                        off += 3 + len(d.views)
                    off += 1  # the trailer: quiet refits announced (``quiet_after``)
                bufs.append(buf)
            out.append((bufs[0], bufs[1], (self._header_msgs(sends, bufs[0]), self._header_msgs(recvs, bufs[1]))))
        return out

    @staticmethod
    def _header_msgs(ops: list[DeltaOp], buf: torch.Tensor) -> tuple[list[tuple[int, torch.Tensor, int]], list[_Op]]:
        """``(peer, headers, tag)`` per peer of ``ops`` (the contiguous slice of ``buf`` holding their
        headers and the peer's trailer), and per posted message the op that names it in an error (its
        peer's first)."""
        out, named, off = [], [], 0
        for peer, group in by_peer(ops):
            n = sum(d.header.numel() for d in group) + 1
            out.append((peer, buf[off : off + n], group[0].op.tag + HEADER_TAG))
            named.append(group[0].op)
            off += n
        return out, named

    def run(self, clock: RunClock, version: int, held: dict[int, int | None]) -> DeltaStats:
        """Every step: choose and encode (sends), headers, payloads, check and apply (receives). Between a
        pair in a quiet refit (``quiet``: announced by the pair's last header of an earlier refit) no header
        travels: every message between them is dense, as on the plain P2P path. On return (or raise) the
        current stream is behind every scatter queued on the side (``apply_received``)."""
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
        """The current stream waits for the scatters ``apply_received`` queued on the "apply" stream, and for the base's
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
        self.ready = None if self.receives else ready_event(self.steps)
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
            (out, out_ops), (inc, inc_ops) = payload_msgs(sends, self.base, True), payload_msgs(recvs)
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
            if (
                rest
            ):  # a delta's indices checked on the host next (not words by address, ``scatter_by_address``): the host
                # waits under the clock first
                self.p2p.wait(clock, rest, named, "delta transfer", any(host_checked(d) for d in recvs))
            self._apply(recvs)
            if recvs:
                stats.received_bytes += sum(d.payload.nbytes for d in recvs) + int(pieces_of(recvs).header_bytes.sum())
            for d in sends + recvs:  # the step's payloads are freed now, not held until the next refit
                d.payload = None
        if self.base is not None:
            self.base.flush(final=True)
        if sending[0]:
            self.p2p.wait(clock, *sending, "delta transfer")
        checks, self.checks = self.checks, []
        verify_checks(checks, clock)
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
        pay, pay_ops = payload_msgs(sends, self.base, True)
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

    def _with_trailers(self, i: int, sends: list[DeltaOp], heads: list[int], quiet: set, after: dict) -> list[int]:
        """Step-chunk ``i``'s send headers with each peer's trailer: in the pair's last header of this refit,
        the quiet refits that follow (``quiet_after``); 0 elsewhere."""
        out, at = [], 0
        for peer, group in by_peer(sends):
            n = len(pieces_of(group).counted)
            out += heads[at : at + n]
            at += n
            trailer = 0
            if i == self.last[(0, peer)] and (0, peer) not in quiet:
                trailer = quiet_after(self.sends_to[peer], self.config.delta)
            out.append(trailer)
        return out

    def _encode(self, d: DeltaOp, plan: str, version: int, stats: DeltaStats) -> list[int]:
        """``encode_op`` of one of this sender's messages against its base, under ``config.delta``."""
        return encode_op(d, plan, version, stats, self.base, self.config.delta)

    def _apply(self, recvs: list[DeltaOp]) -> None:
        """``apply_received`` of a chunk's receives; the index check of its words by address is kept for
        ``verify_checks`` at the run's end, and the current stream joins its scatters' stream then
        (``_behind_apply``)."""
        check = apply_received(recvs)
        if check is not None:
            self.checks.append(check)
            dev = check[0].device
            self.applying = dev if dev.type == "cuda" else None

    @property
    def _me(self) -> str:
        return f"process {self.proc} (destination rank {self.dst_rank})"

    def _receive_headers(self, i: int, recvs: list, got: list[int], version: int, held, quiet, after) -> None:
        """Check and size step-chunk ``i``'s receives from ``got`` (its header buffer read once): per peer its
        ops' headers, then the trailer (read in the pair's last header of the refit). A quiet pair's
        messages are dense without a header."""
        off = 0
        for peer, group in by_peer(recvs):
            at = off + len(pieces_of(group).counted)
            if (1, peer) in quiet or not headers_at_once(group, got[off:at], version, held.get(self.proc)):
                at = off
                for d in group:
                    header = None if (1, peer) in quiet else got[at : at + 3 + len(d.views)]
                    receive_into(d, header, version, held.get(self.proc), self._me)
                    at += 3 + len(d.views)
            if (1, peer) not in quiet and i == self.last[(1, peer)]:
                after[(1, peer)] = announced(got[at], group[0].op)
            off = at + 1

    def _send_step(
        self, i: int, sends: list[DeltaOp], version: int, held: dict, stats: DeltaStats, quiet: set = frozenset()
    ) -> list[int]:
        """Plan, diff and encode step-chunk ``i``'s sends; their headers, in order. Messages to diff are diffed
        in batches of at most ``FIND_BATCH_BYTES`` of data (``find_changes_many``: one host sync per batch)
        and encoded at once (a chunk's slots are held until its payload is posted: bounded by the chunk). Once
        the last batch's find is queued, the next step-chunk's first find is queued behind it (``_prefetch``; with
        one batch or none, before this chunk's dense messages are encoded): the device finds it while the host
        encodes this one."""
        plans, batches, pending = self._planned(i, sends, held, quiet)
        if batches and pending is None:  # the first find queued before the dense messages' copies
            pending = launch_fast([sends[j] for j in batches[0]], self.ready)
        if len(batches) <= 1:
            self._prefetch(i + 1, held, quiet)
        heads: list[list[int]] = [[] for _ in sends]
        for j, d in enumerate(sends):
            if plans[j] != "diff":
                heads[j] = self._encode(d, plans[j], version, stats)
        for b, batch in enumerate(batches):
            ops = [sends[j] for j in batch]
            launched = pending if b == 0 else launch_fast(ops, self.ready)
            if b == len(batches) - 1 > 0:  # the next step-chunk's find queued behind this one, before the wait
                self._prefetch(i + 1, held, quiet)
            find_batch(ops, launched)  # encoded batch by batch; the slots are dropped once the chunk is posted
            at_once = encode_found([sends[j] for j in batch], version, stats, self.base, self.config.delta)
            for j in batch:
                heads[j] = at_once.get(id(sends[j])) or self._encode(sends[j], "diff", version, stats)
        return list(chain.from_iterable(heads))

    def _planned(self, i: int, sends: list[DeltaOp], held: dict, quiet: set) -> tuple:
        """Step-chunk ``i``'s plans, its find batches and its first batch's find if ``_prefetch`` queued it."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == i:
            return ahead[1:]
        plans = self._plans(sends, held, quiet)
        return plans, batches_of(sends, plans), None

    def _plans(self, sends: list[DeltaOp], held: dict, quiet: set) -> list[str]:
        base = self.base.version
        plans = [plan_of(d, base is not None and held.get(d.op.peer) == base, self.config.delta) for d in sends]
        return ["skip" if p == "diff" and (0, d.op.peer) in quiet else p for p, d in zip(plans, sends)]

    def _prefetch(self, i: int, held: dict, quiet: set) -> None:
        """Queue step-chunk ``i``'s first find where its messages go by address (``launch_words_table``, no
        wait): ``_send_step(i)`` takes it with the plans it was made for."""
        sends = self.steps[i][0] if i < len(self.steps) else []
        if not sends:
            return
        plans = self._plans(sends, held, quiet)
        batches = batches_of(sends, plans)
        self.ahead = (i, plans, batches, launch_fast([sends[j] for j in batches[0]], self.ready) if batches else None)


def _loud(msgs: list, ops: list, side: int, quiet: set) -> tuple[list, list]:
    """The header messages (and the ops naming them) of the pairs not quiet this refit."""
    keep = [j for j, (peer, _, _) in enumerate(msgs) if (side, peer) not in quiet]
    return [msgs[j] for j in keep], [ops[j] for j in keep]


def _in_flight(sends: list[DeltaOp]) -> bool:
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


def _fast(tensors: list[torch.Tensor]) -> bool:
    """Whether the word kernels address every one of ``tensors`` on one device (``words.addressable``):
    then a message's words go by address, with no per-piece tensor work."""
    return bool(tensors) and all(addressable(t) and t.device == tensors[0].device for t in tensors)
