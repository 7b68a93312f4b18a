"""Delta refits over NIXL pulls: a source finds what changed since the version a receiver holds, stages the changed
words (or elements) and their indices in a registered buffer and announces them in a sealed record; the receiver
reads only those bytes (one READ per source) and scatters them.

Per refit (``NixlDelta``, inside ``refit.transport.nixl.NixlLink``'s ``start`` and ``finish``):

1. a source plans, finds and encodes each message against its base (the version its receivers last read from it)
   as the P2P path does (``refit.delta.send``: ``plan_of``, ``batches_of``, ``find_batch``, ``encode_op`` against
   its ``SourceBase``; under ``delta="auto"`` the cost rule over the link as a NIXL pull sees it,
   ``rule.nixl_link``; the CUDA find kernels where the tensors are on CUDA, one vectorized pass over 64-bit words on
   host memory; there, messages found per element are found, chosen and written into the staging a find batch at
   once, ``refit.delta.host_stage``), copies each delta's payload into that receiver's region of its delta staging
   (``delta_caps``: within ``num_buffers x buffer_bytes``; a delta that does not fit goes dense this refit, its
   base brought up to date all the same), where some delta is staged its small dense messages after them
   (``_join``: read in the same READ, not one READ each) and publishes, sealed,
   ``{"run", "addr", "bytes", "heads", "offsets"}`` before it announces the refit
   (``<name>/nixl/<agent>/delta/<proc>``: where the payload lies, its bytes, each message's header
   ``[encoding, base version, version, k]`` and each delta's offset in the payload). It does not wait to hear what
   its receivers hold: a pull lets each receiver choose;
2. a receiver, once its source announced, checks the record field by field before it reads anything
   (``plan_reads``: each header by ``check_header``; the offsets in order inside the payload; the payload inside
   its share of the landing buffer and inside a region its source registered). Deltas on the version it holds (and
   the small dense messages joined to them) it reads in one READ into its registered landing buffer and scatters
   (``refit.delta.receive.apply_received``: every index checked before anything is written; the joined ones
   copied); another message sent dense, or a delta on a base it does not hold
   (its first refit, ``Peer.invalidate``, a torn in-place refit), it reads dense from the source's tensors (few
   large READs where every message from that source is dense, ``dense_requests``);
3. the source's base holds the version once the refit succeeded (``commit``) and nothing after a failure
   (``fail``: the next refit is dense).

Versions and bases behave as over P2P but for one thing a pull allows: a receiver that does not hold the base of
a delta is not refused, it reads those messages dense (over P2P the source pushes, so it must know first). Extra
memory: the source's base (its NIXL-sent tensors) and two registered buffers, a source's delta staging and a
receiver's landing buffer, each at most the staging budget. A fan-out replica keeps no base: it serves the deltas
it received (``serve_received``, ``refit.delta.served``).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.delta.base import SourceBase, apply_updates, shared_of
from refit.delta.chunks import link_kind, link_speed, words_for
from refit.delta.host_stage import on_host, stage_host
from refit.delta.ops import JOIN_BYTES, DeltaOp, DeltaStats, memoized
from refit.delta.receive import apply_received, host_sparse, receive_into, scatter_host
from refit.delta.rule import nixl_link
from refit.delta.send import batches_of, dense_words, encode_op, find_batch, op_may_pay, plan_of
from refit.delta.served import NOT_RECEIVED, OVER_STAGING, Got, Received, box_key
from refit.delta.wire import ENCODINGS, DeltaError, index_bytes
from refit.delta.words import words_in
from refit.errors import PlanError
from refit.plan import Plan
from refit.transport.nixl_memory import memory_of
from refit.transport.nixl_record import is_int
from refit.transport.p2p import _Op

RECORD_KEYS = {"run", "addr", "bytes", "heads", "offsets"}
_POLL_S = 0.001


def delta_caps(plan: Plan, config: TransferConfig) -> dict[tuple[int, int], int]:
    """(source process, receiver process) -> the most delta payload bytes the source stages for that receiver in
    one refit: the pair's dense NIXL bytes, at most the staging budget (``num_buffers x buffer_bytes``) shared
    evenly among the source's receivers and among the receiver's sources (a source's delta staging and a
    receiver's landing buffer each stay within the budget), in whole words. The same on every process."""
    dense: Counter = Counter()
    for m in plan.messages:
        if m.transport == "nixl":
            dense[(plan.procs.src[m.src], plan.procs.dst[m.dst])] += m.nbytes
    budget = config.num_buffers * config.buffer_bytes
    outs, ins = Counter(s for s, _ in dense), Counter(r for _, r in dense)
    return {(s, r): min(n, budget // outs[s], budget // ins[r]) // 8 * 8 for (s, r), n in dense.items()}


class NixlDelta:
    """One process's NIXL messages in delta mode (``TransferConfig.delta`` not ``"off"``): a source's base, its
    delta staging and its messages per receiver; a receiver's landing buffer and its messages per source (each a
    ``DeltaOp`` of the message's one piece, as the P2P path's). Built at the link's setup (``buffers`` are
    registered with the link's memory); per refit ``begin``, ``stage`` (source, before it announces),
    ``plan_reads``, ``dense_requests`` and ``apply`` (receiver), then ``commit`` or ``fail``."""

    def __init__(self, plan: Plan, proc: int, local: LocalTensors, config: TransferConfig, device) -> None:
        self.plan, self.proc, self.config = plan, proc, config
        caps = delta_caps(plan, config)
        budget = config.num_buffers * config.buffer_bytes
        self.local, self.budget = local, budget
        self.base: SourceBase | None = None  # a source's, built at its first refit (``ensure_base``); none served
        self.shared = shared_of(plan, proc, "nixl")
        pair: Counter = Counter()
        for m in plan.messages:
            if m.transport == "nixl":
                pair[(plan.procs.src[m.src], plan.procs.dst[m.dst])] += m.nbytes
        self.sends: dict[int, list[DeltaOp]] = {}  # receiver -> this source's messages to it, in plan order
        self.recvs: dict[int, list[DeltaOp]] = {}  # source -> this receiver's messages from it, in plan order
        for k, m in enumerate(plan.messages):
            s, r = plan.procs.src[m.src], plan.procs.dst[m.dst]
            if m.transport == "nixl" and s == proc:
                self.sends.setdefault(r, []).append(self._op(k, r, local, True, pair[(s, r)]))
            if m.transport == "nixl" and r == proc:
                self.recvs.setdefault(s, []).append(self._op(k, s, local, False, pair[(s, r)]))
        self.out_at = _regions({r: caps[(proc, r)] for r in sorted(self.sends)})  # receiver -> (offset, cap)
        self.in_at = _regions({s: caps[(s, proc)] for s in sorted(self.recvs)})  # source -> (offset, cap)
        self.staging = torch.empty(sum(c for _, c in self.out_at.values()), dtype=torch.uint8, device=device)
        self.landing = torch.empty(sum(c for _, c in self.in_at.values()), dtype=torch.uint8, device=device)
        self.host_staging = self.staging.numpy() if self.staging.device.type == "cpu" else None  # ``stage_host``'s
        self.stats = DeltaStats()
        self.version, self.held = 0, None  # this refit's version and the version this process holds
        self.joined: list[DeltaOp] = []  # receiver, per refit: small dense messages read in the deltas' READ
        self.keys = {k: box_key(m.pieces[0].tensor, m.pieces[0].box) for k, m in enumerate(plan.messages)}
        self.received: Received | None = None  # a fan-out replica: what it received (``serve_received``)
        self.serving = False  # a fan-out replica source: serves what it received, keeps no base
        self._settler: ThreadPoolExecutor | None = None  # a source's thread for its base updates (``settle``)
        self._settling: Future | None = None

    def _op(self, k: int, peer: int, local: LocalTensors, outgoing: bool, pair_bytes: int) -> DeltaOp:
        """Message ``k`` (one piece) to or from ``peer`` as a ``DeltaOp``: its view, the link as a NIXL pull sees
        it, its part of the pair's bytes (what it pays of ``NIXL_PAIR_S``); a source's base view comes with its
        base (``ensure_base``)."""
        p = self.plan.messages[k].pieces[0]
        view = (local.src_view if outgoing else local.dst_view)(p.tensor, p.box)
        ends = (self.proc, peer) if outgoing else (peer, self.proc)
        link = nixl_link(link_speed(self.plan, *ends, self.config), link_kind(self.plan, *ends) == "cpu")
        d = DeltaOp(_Op(peer, 0, view, [], (p.tensor,), message=k), [view], [], link, torch.empty(0))
        d.numels, d.nwords, d.nbytes = [view.numel()], [words_in(view)], p.nbytes
        pieces = [(view.numel(), view.element_size())]
        d.words = outgoing and words_in(view) is not None and words_for(self.config, pieces, link)
        d.share = p.nbytes / max(1, pair_bytes)
        d.may_pay = op_may_pay(d)
        if outgoing and self.config.delta == "auto":
            dense_words(d)  # its cut-off now, not in the first refit that diffs it (a binary search of the rule)
        d.shared = outgoing and k in self.shared
        return d

    def buffers(self) -> list[torch.Tensor]:
        """The buffers the link registers: the delta staging (source) and the landing buffer (receiver)."""
        return [t for t in (self.staging, self.landing) if t.numel()]

    def serve_received(self, received: Received, serve: bool) -> None:
        """A fan-out replica process (``refit.delta.served``): what it receives is noted in ``received`` (the same
        object in each of its waves); with ``serve`` (it is a source here) each message it sends is the delta it
        received for the same box: it builds no base (no copy of its tensors, no find)."""
        self.received = received
        self.serving = serve and bool(self.sends)

    def ensure_base(self) -> SourceBase:
        """A source's base, built at its first refit (a copy of the tensors it sends over NIXL), each message's
        base view with it."""
        if self.base is None:
            self.base = SourceBase(self.plan, self.proc, self.local, self.config.delta_base, self.budget, "nixl")
            for d in (d for ops in self.sends.values() for d in ops):
                p = self.plan.messages[d.op.message].pieces[0]
                d.bases = [self.base.local.src_view(p.tensor, p.box)]
        return self.base

    def begin(self, version: int, held: int | None) -> None:
        """A refit of ``version`` starts; this process holds ``held`` (None: no version, or a stale one). A
        source's base updates of the refit before are applied first (``settled``)."""
        self.settled()
        self.version, self.held, self.stats = version, held, DeltaStats()
        self.stats.staging_bytes = self.staging.numel() + self.landing.numel()

    # ------------------------------------------------------------------ source
    def stage(self, run: int) -> dict[int, bytes]:
        """A source, its tensors final: per receiver its messages planned, found, encoded against the base and
        their deltas copied into its region of the staging; returns the sealed record to publish per receiver
        (see the module docstring). Base updates of what was sent follow ``encode_op``."""
        out = {}
        self.stats.base_bytes = 0 if self.serving else self.ensure_base().nbytes
        if not self.serving and self.staging.device.type == "cpu":
            self.base.hold()  # the base's updates wait until the refit is read (``settle``)
        for r, ops in sorted(self.sends.items()):
            at, offsets = self.out_at[r][0], {}
            heads, used = (self._serve if self.serving else self._find)(ops, r, offsets)
            used = self._join(ops, r, used, offsets)
            heads_of = {str(d.op.message): h for d, h in zip(ops, heads)}
            rec = {"run": run, "addr": self.staging.data_ptr() + at, "bytes": used, "heads": heads_of}
            out[r] = json.dumps({**rec, "offsets": offsets}).encode()
            self.stats.wire_bytes += _header_bytes(ops)
        return out

    def _find(self, ops: list[DeltaOp], r: int, offsets: dict) -> tuple[list[list[int]], int]:
        """Receiver ``r``'s messages planned, found and encoded against the base (``_encode``). Returns their
        headers and the staging bytes used."""
        ok = self.base.version is not None
        plans = [plan_of(d, ok, self.config.delta) for d in ops]
        heads: list[list[int]] = [[] for _ in ops]
        used = 0
        for j, d in enumerate(ops):
            if plans[j] != "diff":
                heads[j], used = self._encode(d, plans[j], r, used, offsets)
        host = memoized(ops, ("on-host",), lambda ops: [self.host_staging is not None and on_host(d) for d in ops])
        for batch in batches_of(ops, plans):
            mine, rest = [j for j in batch if host[j]], [j for j in batch if not host[j]]
            if mine:  # host messages found per element: at once (``refit.delta.host_stage``)
                at, cap = self.out_at[r]
                region, mode = self.host_staging[at : at + cap], self.config.delta
                got, used = stage_host([ops[j] for j in mine], region, used, offsets, self.version, self.stats,
                                       self.base, mode)  # fmt: skip
                for j, head in zip(mine, got):
                    heads[j] = head
            if rest:
                find_batch([ops[j] for j in rest], None, self.config.delta)
                for j in rest:
                    heads[j], used = self._encode(ops[j], "diff", r, used, offsets)
            self.base.flush()
        return heads, used

    def settle(self) -> None:
        """A source, its receivers done reading: of the base updates ``stage`` held, ``SourceBase.take_held`` makes
        the copies from the live tensors now (before the refit returns) and hands over the found changes, which go
        to this process's base thread, applied off the refit's path (after the receivers read: the source's waits
        stay light while they plan and read; numpy's scatters let go of the GIL). ``begin`` (the next refit's find),
        ``fail`` and ``close`` wait for them (``settled``)."""
        held = self.base.take_held() if self.base is not None else []
        if not held:
            return
        if self._settler is None:
            self._settler = ThreadPoolExecutor(1, thread_name_prefix="refit-nixl-base")
        self._settling = self._settler.submit(apply_updates, held)

    def settled(self) -> None:
        """Wait until the base updates ``settle`` handed to the base thread are applied. Where they failed the
        base holds no version (the next refit sends dense) and ``DeltaError`` says why."""
        pending, self._settling = self._settling, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:  # noqa: BLE001 - reported, the base dropped
            self.base.fail()
            raise DeltaError(f"NIXL delta: the source's base update after refit failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Wait for the base thread's updates and stop it (the base is let go: an update that failed is not
        reported). Idempotent."""
        try:
            self.settled()
        except DeltaError:
            pass
        finally:
            if self._settler is not None:
                self._settler.shutdown(wait=True)
                self._settler = None

    def _serve(self, ops: list[DeltaOp], r: int, offsets: dict) -> tuple[list[list[int]], int]:
        """A fan-out replica source (``serve_received``): each of receiver ``r``'s messages received as a delta in
        this refit's version (``Received.delta``) is copied into ``r``'s staging region with the header it came
        with; the others go dense, their reason counted in ``stats.dense_why``. Returns the headers and the staging
        bytes used."""
        at, cap = self.out_at[r]
        heads, used = [], 0
        for d in ops:
            got, why = self.received.delta(self.keys[d.op.message], self.version)
            if why == NOT_RECEIVED:  # received in parts: composed (``Received.compose``)
                got, why = self.received.compose(self.keys[d.op.message], self.version, d.op.tensor, cap - used)
            if got is not None and used + got.payload.numel() > cap:
                got, why = None, OVER_STAGING
            if got is None:
                d.kind, d.payload = "dense", d.op.tensor
                self.stats.dense_why[why] = self.stats.dense_why.get(why, 0) + 1
                heads.append([ENCODINGS.index("dense"), -1, self.version, 0])
                n = d.nbytes
            else:
                n = got.payload.numel()
                self.staging[at + used : at + used + n].copy_(got.payload)
                offsets[str(d.op.message)], used = used, -(-(used + n) // 8) * 8
                d.kind, d.payload = got.kind, None
                heads.append([ENCODINGS.index(got.kind), got.base, self.version, *got.counts])
                self.stats.served += 1
            self.stats.wire_bytes += n
            self.stats.dense_bytes += d.nbytes
            self.stats.encodings[d.kind] += 1
        return heads, used

    def _encode(self, d: DeltaOp, plan: str, r: int, used: int, offsets: dict) -> tuple[list[int], int]:
        """``encode_op`` of one message to receiver ``r``; a delta's payload copied into ``r``'s staging region at
        ``used`` (its offset noted in ``offsets``) or, where it does not fit, the message sent dense (its base is
        up to date either way: ``encode_op`` applied the changes). Returns its header and the bytes used."""
        head = encode_op(d, plan, self.version, self.stats, self.base, self.config.delta)
        if d.kind == "dense":
            return head, used
        at, cap = self.out_at[r]
        n = d.payload.numel()
        if used + n > cap:  # over this refit's staging: dense
            self.stats.wire_bytes += d.nbytes - n
            self.stats.dense_why[OVER_STAGING] = self.stats.dense_why.get(OVER_STAGING, 0) + 1
            self.stats.encodings[d.kind] -= 1
            self.stats.encodings["dense"] += 1
            d.kind, d.parts, d.payload = "dense", [], None
            return [ENCODINGS.index("dense"), head[1], self.version, 0], used
        part = self.staging[at + used : at + used + n]
        if d.parts:
            torch.cat(d.parts, out=part)
        else:
            part.copy_(d.payload)
        offsets[str(d.op.message)] = used
        d.parts, d.payload = [], None
        return head, used + n

    def _join(self, ops: list[DeltaOp], r: int, used: int, offsets: dict) -> int:
        """Where some delta is staged for receiver ``r``: its small dense messages (``JOIN_BYTES`` each) copied
        after the deltas (8-byte aligned, while they fit), their offsets noted, so that the receiver reads them in
        the deltas' READ instead of one READ each (a round trip each). Returns the bytes used."""
        if not offsets:
            return used  # every message dense: the receiver reads them in a few grouped requests
        at, cap = self.out_at[r]
        for d in ops:
            used = -(-used // 8) * 8
            if d.kind != "dense" or d.nbytes > JOIN_BYTES or used + d.nbytes > cap:
                continue
            view = d.op.tensor
            self.staging[at + used : at + used + d.nbytes].view(view.dtype).view(view.shape).copy_(view)
            offsets[str(d.op.message)], used = used, used + d.nbytes
        return used

    # ------------------------------------------------------------------ receiver
    def plan_reads(self, raw_of, run: int) -> tuple[set[int], list[tuple[int, int, int, int]]]:
        """A receiver, every source announced refit ``run``: each source's sealed record (``raw_of(source)``) of
        that refit checked field by
        field and every message's header (``receive_into``) before anything is read. Returns the messages to read
        dense and the delta READs: ``(source, remote address, bytes, landing address)`` (none for an empty
        payload). ``DeltaError`` names the source and what is wrong."""
        dense: set[int] = set()
        reads, self.joined = [], []
        for sp, ops in sorted(self.recvs.items()):
            self.stats.received_bytes += _header_bytes(ops)
            rec = _record(json.loads(raw_of(sp)), sp, {str(d.op.message) for d in ops}, self.in_at[sp][1], run)
            spans = self._at_once(rec, ops, dense)
            if spans is None:
                spans = _in_payload(self._one_by_one(rec, sp, ops, dense), rec["bytes"], sp)
            for off, n, d in spans:
                at = self.in_at[sp][0] + off
                d.payload = self.landing[at : at + n]
                if d.kind == "dense":
                    self.joined.append(d)
            if rec["bytes"] and spans:
                reads.append((sp, rec["addr"], rec["bytes"], self.landing.data_ptr() + self.in_at[sp][0]))
        return dense, reads

    def _one_by_one(self, rec: dict, sp: int, ops: list[DeltaOp], dense: set[int]) -> list[tuple[int, int, DeltaOp]]:
        """``plan_reads`` of one source's messages one by one: each header checked (``receive_into``: ``DeltaError``
        naming what is wrong), those read dense added to ``dense``. Returns the spans ``(offset, bytes, op)`` to read
        in the payload, not yet checked (``_in_payload``)."""
        spans = []
        for d in ops:
            head, off = rec["heads"][str(d.op.message)], rec["offsets"].get(str(d.op.message))
            other = len(head) > 1 and head[0] != ENCODINGS.index("dense") and head[1] != self.held
            receive_into(d, head, self.version, head[1] if other else self.held, f"process {self.proc}")
            if off is None and d.kind != "dense":
                raise DeltaError(f"NIXL delta record of process {sp}: no offset for message {d.op.message}")
            if other or (d.kind == "dense" and off is None):  # dense from the source's tensors (a delta on a
                d.kind, d.payload = "dense", d.op.tensor  # base this receiver does not hold too)
                dense.add(d.op.message)
                continue
            n = d.payload.numel() if d.kind != "dense" else d.nbytes  # a delta, or a small dense one joined
            spans.append((off, n, d))
        return spans

    def _at_once(self, rec: dict, ops: list[DeltaOp], dense: set[int]) -> list[tuple[int, int, DeltaOp]] | None:
        """``_one_by_one`` and ``_in_payload`` at once (numpy over the headers and offsets, a few Python steps per
        message) where every header is this version's and either sparse on the base this receiver holds (with an
        offset) or dense with count 0 (joined with an offset, or read from the source's tensors), and the spans
        are 8-byte aligned, in the payload and apart: the checked spans. None otherwise, nothing set (the
        one-by-one path then names what is wrong, or reads the messages on another base dense)."""
        keys, numel, size, nbytes = _shape_of(ops)
        heads, offsets = rec["heads"], rec["offsets"]
        got = [heads[key] for key in keys]
        if self.held is None or any(len(h) != 4 for h in got):
            return None
        kind, base, version, k = np.array(got, dtype=np.int64).T  # ints, checked by ``_record``
        sparse, plain = kind == ENCODINGS.index("sparse"), kind == ENCODINGS.index("dense")
        ok = (sparse | plain).all() and (version == self.version).all() and (base[sparse] == self.held).all()
        if not ok or (k[plain] != 0).any() or (k < 0).any() or (k > numel).any():
            return None
        offs = [offsets.get(key) for key in keys]
        has = np.array([o is not None for o in offs])
        given = [o for o in offs if o is not None]
        if (sparse & ~has).any() or not all(type(o) is int for o in given):
            return None
        if given and not (0 <= min(given) and max(given) <= rec["bytes"]):
            return None
        off = np.array([o if o is not None else 0 for o in offs], dtype=np.int64)
        n = np.where(sparse, index_bytes(k) + (k * size + 7) // 8 * 8, nbytes)
        sel = np.flatnonzero(has & (n > 0))
        sel = sel[np.argsort(off[sel], kind="stable")]
        end = off[sel] + n[sel]
        ok = (off[sel] % 8 == 0).all() and (end <= rec["bytes"]).all() and (off[sel][1:] >= end[:-1]).all()
        empty = has & (n == 0)
        if not ok or (off[empty] > rec["bytes"]).any():
            return None
        k = k.tolist()
        for j, d in enumerate(ops):
            d.kind, d.changes = ("sparse" if sparse[j] else "dense"), [k[j]]
            if not has[j]:
                d.payload = d.op.tensor
                dense.add(d.op.message)
        spans = [(int(off[j]), int(n[j]), ops[j]) for j in sel.tolist()]
        for j in np.flatnonzero(empty).tolist():  # nothing to read: an empty view of the landing buffer
            spans.append((int(off[j]), 0, ops[j]))
        return spans

    def dense_requests(self, requests: list, dense: set[int]) -> list:
        """A receiver: of its prepared ``requests`` (``nixl_requests.prepare_reads``: per message, and grouped with
        ``message == -1``), those reading this refit's ``dense`` messages: a source's grouped ones where every
        message from it is dense (a few large READs: one per message costs a round trip each), else the dense
        messages' own."""
        whole = {sp for sp, ops in self.recvs.items() if all(d.op.message in dense for d in ops)}
        return [q for q in requests if ((q.message < 0) if q.peer in whole else (q.message in dense))]

    def apply(self) -> None:
        """A receiver, every READ done: the deltas' indices checked, then scattered (sparse ones into host memory
        through numpy, ``host_sparse``; the others ``apply_received``)."""
        deltas = [d for ops in self.recvs.values() for d in ops if d.kind != "dense"]
        try:
            host, rest = host_sparse(deltas)  # every index checked (``apply_received`` too) before any is written
            if rest:
                apply_received(rest)
            scatter_host(host)
            for d in self.joined:  # small dense messages read beside the deltas
                view = d.op.tensor
                view.copy_(d.payload.view(view.dtype).view(view.shape))
            if self.received is not None:
                self._note()
        finally:
            for d in deltas + self.joined:
                d.payload = None
            self.joined = []

    def _note(self) -> None:
        """A fan-out replica, its refit applied: each message received noted (``Received``): a delta with its base
        version, counts and payload (a view of the landing buffer, left as it is until this process's next
        refit), a dense one as such."""
        for d in (d for ops in self.recvs.values() for d in ops):
            delta = d.kind != "dense"
            got = Got(self.version, self.held, d.kind, tuple(d.changes), d.payload) if delta else None
            self.received.note(self.keys[d.op.message], got or Got(self.version, None, "dense", (), None))

    # ------------------------------------------------------------------ after the refit
    def commit(self, version: int) -> None:
        """The refit of ``version`` succeeded on every process: the source's base holds it."""
        if self.base is not None:
            self.base.commit(version)

    def fail(self) -> None:
        """The refit failed: what it held is dropped and the base holds no version (the next refit is dense)."""
        try:
            self.settled()  # nothing writes the base any more
        except DeltaError:
            pass  # the base is dropped below all the same
        for d in (d for side in (self.sends, self.recvs) for ops in side.values() for d in ops):
            d.payload, d.parts, d.changes, d.found = None, [], [], None
        if self.base is not None:
            self.base.fail()


def with_stats(stats: DeltaStats | None, link) -> DeltaStats | None:
    """``stats`` (the P2P delta run's, or None) with ``link``'s NIXL delta stats of this refit added (where it runs
    deltas, ``link.delta``), so a refit's ``RunStats.delta`` counts both."""
    mine = link.delta.stats if link is not None and link.delta is not None else None
    if mine is None or stats is None:
        return stats if mine is None else mine
    out = DeltaStats(**{k: getattr(stats, k) + getattr(mine, k) for k in _NUMBERS})
    out.encodings = {k: stats.encodings[k] + mine.encodings[k] for k in stats.encodings}
    out.dense_why = dict(Counter(stats.dense_why) + Counter(mine.dense_why))
    return out


_NUMBERS = ("diffed", "wire_bytes", "dense_bytes", "received_bytes", "served", "base_bytes", "staging_bytes")


def read_handles(agent, reads: list[tuple[int, int, int, int]], link) -> list[tuple[int, object, int]]:
    """``(source, READ handle, bytes)`` of each delta read ``(source, remote address, bytes, landing address)``
    (``NixlDelta.plan_reads``), made for one refit (release them after it); ``PlanError`` for a payload outside
    every region its source registered (``link.remote_regions``), before any is made."""
    where = []
    for sp, addr, n, _ in reads:
        reg = next((r for r in link.remote_regions[sp] if r[0] <= addr and addr + n <= r[0] + r[1]), None)
        if reg is None:
            raise PlanError(
                f"NIXL delta record of process {sp}: its payload, bytes [{addr:#x}, {addr + n:#x}), lies outside "
                "every region it registered"
            )
        where.append(reg)
    dmem, ddev = memory_of(link.delta.landing)
    out = []
    for (sp, addr, n, local), reg in zip(reads, where):
        remote = agent.get_xfer_descs(np.array([[addr, n, reg[2]]], dtype=np.uint64), reg[3])
        mine = agent.get_xfer_descs(np.array([[local, n, ddev]], dtype=np.uint64), dmem)
        out.append((sp, agent.initialize_xfer("READ", mine, remote, link.sources[sp], b""), n))
    return out


def _shape_of(ops: list[DeltaOp]) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """A receiver's messages from one source (one piece each): their keys in a record, elements, element size and
    bytes (numpy), derived once (``memoized``)."""

    def make(ops: list[DeltaOp]) -> tuple:
        views = [d.views[0] for d in ops]
        keys = [str(d.op.message) for d in ops]
        numel = np.array([v.numel() for v in views], dtype=np.int64)
        size = np.array([v.element_size() for v in views], dtype=np.int64)
        return keys, numel, size, np.array([d.nbytes for d in ops], dtype=np.int64)

    return memoized(ops, ("nixl-shape",), make)


def _header_bytes(ops: list[DeltaOp]) -> int:
    """The statistics' bytes of ``ops``' headers: 8 per field, as the P2P path's int64 headers (the record itself
    travels through the store, the control plane, as the P2P path's held versions do)."""
    return 8 * sum(3 + len(d.views) for d in ops)


def _in_payload(spans: list[tuple[int, int, DeltaOp]], nbytes: int, sp: int) -> list[tuple[int, int, DeltaOp]]:
    """``spans`` (offset, bytes, op) of one source's payload of ``nbytes``, checked: int offsets, 8-byte aligned,
    each inside the payload, none overlapping another, empty ones anywhere in it (``DeltaError`` naming the source
    otherwise)."""
    end = 0
    for off, n, d in sorted(spans, key=lambda x: x[0] if is_int(x[0]) else -1):
        if is_int(off) and n == 0 and 0 <= off <= nbytes:
            continue  # an empty delta (nothing changed): nothing to read
        if not is_int(off) or off % 8 or off < end or off + n > nbytes:
            raise DeltaError(
                f"NIXL delta record of process {sp}: message {d.op.message} ({n} bytes) at offset {off}, not 8-byte "
                f"aligned after the one before it (byte {end}) inside the payload of {nbytes} bytes"
            )
        end = off + n
    return spans


def _regions(caps: dict[int, int]) -> dict[int, tuple[int, int]]:
    """Per peer (in order) its ``(offset, bytes)`` region of one buffer, one after another."""
    out, at = {}, 0
    for peer, cap in caps.items():
        out[peer], at = (at, cap), at + cap
    return out


def _record(rec: object, sp: int, messages: set[str], cap: int, run: int) -> dict:
    """Source process ``sp``'s delta record of refit ``run``, checked: the known keys, a header (a list of ints)
    for exactly the ``messages`` read from it, the payload's ``bytes`` within this receiver's share ``cap`` of its
    landing buffer, an address and int offsets (the headers' fields themselves: ``check_header``)."""
    ok = isinstance(rec, dict) and set(rec) == RECORD_KEYS and is_int(rec["addr"]) and is_int(rec["bytes"], 0, cap + 1)
    ok = ok and is_int(rec["run"]) and rec["run"] == run
    heads, offsets = (rec["heads"], rec["offsets"]) if ok else (None, None)
    ok = ok and isinstance(heads, dict) and set(heads) == messages and isinstance(offsets, dict)
    ok = ok and all(type(h) is list for h in heads.values())
    fields = [x for h in heads.values() for x in h] if ok else []
    ok = ok and all(type(x) is int for x in fields) and (not fields or -1 <= min(fields) and max(fields) < 1 << 62)
    if not ok or not set(offsets) <= messages:
        raise DeltaError(
            f"NIXL delta record of process {sp} is not {{run: {run}, addr, bytes <= {cap}, heads, offsets}} for the "
            f"{len(messages)} messages read from it: {str(rec)[:120]}"
        )
    return rec
