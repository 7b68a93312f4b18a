"""Delta refits over CUDA IPC links between two GPUs: a source finds what changed since its base and stages the
changed 64-bit words in device memory its receiver mapped; the receiver scatters them from there.

Setup (``IpcDelta.open``, inside ``refit.transport.ipc.IpcLink.open``): per pair of a source and a receiver on two
GPUs, the messages that may go as words (``pair_facts``: whole words; under ``delta="auto"`` those whose best case
pays over the link, ``rule.may_pay`` with ``rule.ipc_link``) and a device staging for them on the source
(``refit.delta.staging``: a header, then at most ``num_buffers x buffer_bytes`` of payloads), exported with the IPC
handles (``<name>/ipc/<source>/<receiver>/delta``) and mapped by the receiver, whose GPU is let read the source's
(peer access). A source keeps a base on its device (``SourceBase`` of the messages the word kernels address); a
receiver keeps, besides the captured pull of everything, one of what no delta takes (``rest``: same-GPU pulls,
quantization on the pull, pieces the kernels do not address). Same-GPU links stay dense: a copy reads n bytes and
writes n, a find reads 2n (the rule's ``same_device``); they count as dense in ``DeltaStats.dense_why``.

Per refit:

1. a source, its tensors final, before the stage barrier (``begin``): each message planned as over P2P and NIXL
   (``plan_of`` on its base: diff, refresh or skip), the diffed ones found in one launch per ``WORD_BATCH_BYTES``
   (``launch_words_table``, the P2P path's kernel on its own stream, one host wait for the counts); a message goes as
   words where the rule says so (forced under another ``delta`` mode), its changes fit the find's slots and its
   payload the staging, else dense; the words are packed into the staging (``pack_table``), then the header at its
   start is written (one small copy); the executor then waits for the device, and the barrier passes;
2. a receiver, after the barrier (``pull``): each source's header read (one small copy per source, one host wait)
   and checked (``read_header``); a words message applies where the header's base is the version this receiver
   holds, else it is copied dense from the source's tensors, as its dense ones are. Where nothing applies, the
   captured pull of everything runs; else the ``rest`` pull, the dense ones copy by copy (pushed by the source
   GPU's copy engine) and per source one scatter of its applied messages' words (``Scatter``: its indices checked
   first, nothing stored if one is outside its piece; the check is read after the executor's wait, ``verify``).
   By default (``REFIT_IPC_DELTA_READ=land``) the used part of each source's staging is first copied to a landing
   copy on this GPU (the source GPU's copy engine) and every source's words are scattered in one kernel here; with
   ``REFIT_IPC_DELTA_READ=peer`` the scatter runs on the source's GPU instead, on this process's stream there (its
   lane): it reads the staging where it lies and stores into this GPU over NVLink (peer access), slower on 2x H200
   (S1, Llama-3.1-8B: 12.7 against 11.9 ms at 0.1% changed, 24.4 against 19.2 ms at 1%: scattered 8-byte stores
   over NVLink). Either way this process maps the staging in its context of the
   source's GPU (torch opens an IPC handle on the device it came from, and a device's handles open in one context
   per process): a kernel on this GPU reading that mapping faults (illegal address);
3. a source, after the barrier: its base brought to what it staged (one scatter from the staging, one copy per
   dense message that refreshes it) while its receivers read; after the refit's last barrier (``finish``) its base
   holds the version. Until then it holds none: a refit that fails on the way leaves the next one dense.

Versions and bases behave as over NIXL: a source does not wait to hear what its receivers hold; one that does not
hold the base (its first refit, ``Peer.invalidate``, a torn refit) copies those messages dense instead. A source
with ``delta_base="host"`` sends everything dense, a receiver that paces its pulls (``pull_gbps``) copies everything
dense (``wanted``; ``transport="ipc"`` refuses both). Extra
memory: the source's base (the tensors it sends as words) and a staging per peer receiver; a receiver keeps a
landing copy of each source's staging (none with ``REFIT_IPC_DELTA_READ=peer``). Each step of a pull names
itself and the process in a CUDA error raised in it
(``_step``; such an error may come from work queued before it: ``CUDA_LAUNCH_BLOCKING=1`` ties it to its launch).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.cudart import OwnedStreams
from refit.delta.base import SourceBase
from refit.delta.chunks import WORD_BATCH_BYTES, link_speed
from refit.delta.ops import DeltaOp, DeltaStats
from refit.delta.rule import LinkSpeed, choose_words_many, ipc_link, may_pay
from refit.delta.send import plan_of
from refit.delta.served import OVER_STAGING
from refit.delta.staging import FIELDS, header_bytes, offsets, pack_header, read_header, used_bytes
from refit.delta.wire import DeltaError, index_bytes, wire_sizes
from refit.delta.words import Scatter, addressable, launch_words_table, pack_table, whole_words
from refit.errors import PlanError, RefitError
from refit.plan import Plan
from refit.transport.ipc_handles import export_handles, import_handles
from refit.transport.p2p import _Op
from refit.transport.store import SignedStore

SAME_DEVICE = "same device"  # ``dense_why``: a same-GPU link (the rule sends it dense)
NOT_ADDRESSED = "not addressed by the word kernels"  # a strided or unaligned view
HOST_BASE = "delta_base='host'"  # a source that keeps no base on its device
OTHER_BASE = "not the base this receiver holds"
RULE = "the rule"  # the rule chose dense at the fraction found (or the changes overflowed the find's slots)


@dataclass
class PairFacts:
    """One source and receiver on two GPUs: their IPC messages in plan order (``ids``), which may go as words
    (``words``), each one's part of the pair's bytes (``share``), the link as the rule weighs it and the staging's
    bytes (``cap``; 0: no staging, every message dense). The same on every process (the plan and the config)."""

    ids: list[int]
    words: np.ndarray
    share: np.ndarray
    link: LinkSpeed
    cap: int


def pair_facts(plan: Plan, config: TransferConfig) -> dict[tuple[int, int], PairFacts]:
    """``PairFacts`` per (source process, receiver process) with IPC messages between two GPUs."""
    ids: dict[tuple[int, int], list[int]] = {}
    for k, m in enumerate(plan.messages):
        s, r = plan.procs.src[m.src], plan.procs.dst[m.dst]
        if m.transport == "ipc" and not plan.procs.same_device(s, r):
            ids.setdefault((s, r), []).append(k)
    out = {}
    budget = config.num_buffers * config.buffer_bytes
    for (s, r), ks in ids.items():
        link = ipc_link(link_speed(plan, s, r, config))
        pieces = [plan.messages[k].pieces[0] for k in ks]
        share = np.array([p.nbytes for p in pieces], dtype=np.float64) / max(1, sum(p.nbytes for p in pieces))
        words = np.array(
            [
                p.nbytes > 0
                and whole_words(p.nbytes)
                and (config.delta != "auto" or may_pay([(p.nbytes // p.itemsize, p.itemsize)], link, True, float(w)))
                for p, w in zip(pieces, share)
            ],
            dtype=bool,
        )
        payload = sum(p.nbytes for p, w in zip(pieces, words) if w)
        cap = header_bytes(len(ks)) + min(payload, budget) // 8 * 8 if words.any() else 0
        out[(s, r)] = PairFacts(ks, words, share, link, cap)
    return out


def wanted(plan: Plan, config: TransferConfig) -> bool:
    """Whether ``plan``'s CUDA IPC links run in delta mode: deltas on, pulled in one stage. The same answer on every
    process (fields pre-flight compares). A source whose ``delta_base`` is ``"host"`` sends its messages dense (its
    receivers copy them), a receiver that paces its pulls (``pull_gbps``) copies every message dense (its paced pull);
    ``transport="ipc"`` refuses both (``TransferConfig.ipc_delta_refusal``)."""
    return config.deltas and config.stages == 1 and any(m.transport == "ipc" for m in plan.messages)


@dataclass
class _From:
    """A receiver's messages from one source on another GPU: ``pulls`` (destination, mapped source) in plan order,
    which it scatters as words when they come so (``fast``), the words each may claim (``nwords``, -1: none), the
    mapped staging and what reads its header."""

    source: int
    facts: PairFacts
    names: list[str]
    pulls: list[tuple[torch.Tensor, torch.Tensor]]
    fast: np.ndarray
    nwords: np.ndarray
    nbytes: np.ndarray
    dst: np.ndarray
    staging: torch.Tensor | None
    lane: torch.cuda.Stream | None = None
    host: torch.Tensor | None = None
    read: Callable | None = None  # ``read(lane)``: the header's copy into ``host``
    copies: list = field(default_factory=list)
    landing: torch.Tensor | None = None


class IpcDelta:
    """One process's CUDA IPC links in delta mode (see the module docstring). Built by ``open`` (collective through
    the store: sources export their staging, receivers map it); per refit ``begin`` (before the stage barrier),
    ``pull`` (after it), ``verify`` (after the executor's wait), ``finish`` (after the last barrier); ``close``."""

    def __init__(self, plan: Plan, proc: int, local: LocalTensors, config: TransferConfig, device) -> None:
        self.plan, self.proc, self.config, self.device = plan, proc, config, torch.device(device)
        self.facts = pair_facts(plan, config)
        read = os.environ.get("REFIT_IPC_DELTA_READ", "land")
        if read not in ("land", "peer"):
            raise ValueError(f"REFIT_IPC_DELTA_READ must be 'land' or 'peer', got {read!r}")
        self.land = read == "land"
        same = [m for m in plan.messages if m.transport == "ipc" and plan.procs.src[m.src] == proc]
        self.same = [m.nbytes for m in same if plan.procs.same_device(proc, plan.procs.dst[m.dst])]
        self.sends: dict[int, list[DeltaOp]] = {}  # receiver -> this source's messages to it
        self.staging: dict[int, torch.Tensor] = {}  # receiver -> the staging it maps
        self.heads: dict[int, torch.Tensor] = {}  # receiver -> the header's pinned host copy
        self.base: SourceBase | None = None
        self.recvs: dict[int, _From] = {}  # source -> this receiver's messages from it
        self.taken: set[int] = set()  # ids of the pulls the delta takes (the ``rest`` pull leaves them out)
        self.rest = None  # the captured pull of everything else (``IpcLink.open`` sets it)
        self.owned = OwnedStreams()
        self.version, self.held, self.stats = 0, None, DeltaStats()
        self.pending: tuple = ([], [])  # a source, per refit: its base's word updates and dense refreshes
        self.order: list[tuple[int, DeltaOp]] = []  # a source's messages in header order (``_arrays``)
        self.checks: list[tuple] = []  # a receiver, per refit: (flags, pieces, names) of each scatter's check
        self.head_copies: dict[int, Callable] = {}  # receiver -> ``fn(stream)``: the header's copy into its staging
        self._source(local)

    @classmethod
    def open(
        cls,
        plan: Plan,
        proc: int,
        local: LocalTensors,
        store: SignedStore,
        config: TransferConfig,
        device,
        peer_pulls: list[tuple[torch.Tensor, torch.Tensor]],
        copies: tuple[Callable, Callable],
    ) -> IpcDelta:
        """Build this process's side, export its staging per receiver and map its sources' (``peer_pulls``: its
        pulls from other GPUs, in plan order, as ``IpcLink`` paired them; ``copies``: ``refit.transport.ipc``'s
        ``make_copy`` and ``enable_peer_access``)."""
        self = cls(plan, proc, local, config, device)
        self.make_copy, self.enable_peer_access = copies
        # the headers' copies through the runtime: torch's copy would note the executor's stream on the pinned
        # header, and freeing it after the executor destroyed that stream (``close``) records an event there
        # ('invalid device context' or SIGSEGV at exit)
        for r, heads in self.heads.items():
            self.head_copies[r] = self.make_copy(self.staging[r][: heads.numel() * 8].view(torch.int64), heads)[1]
        for r, staging in sorted(self.staging.items()):
            export_handles(store, f"{config.name}/ipc/{proc}/{r}/delta", {"staging": staging})
        self._receiver(store, peer_pulls)
        return self

    # ------------------------------------------------------------------ setup
    def _source(self, local: LocalTensors) -> None:
        for (s, r), f in sorted(self.facts.items()):
            if s != self.proc:
                continue
            ops = []
            for k, words, share in zip(f.ids, f.words.tolist(), f.share.tolist()):
                p = self.plan.messages[k].pieces[0]
                view = local.src_view(p.tensor, p.box)
                d = DeltaOp(_Op(r, 0, view, [], (p.tensor,), message=k), [view], [], f.link, torch.empty(0))
                d.numels, d.nwords, d.nbytes, d.share = [view.numel()], [p.nbytes // 8], p.nbytes, share
                host = self.config.delta_base != "device"
                d.fast = d.words = d.may_pay = words and addressable(view) and not host
                # why it is dense where it is not ``fast``: pieces with whole words the rule leaves dense, or not
                d.memo["why"] = RULE if not words and p.nbytes and whole_words(p.nbytes) else NOT_ADDRESSED
                d.memo["why"] = HOST_BASE if words and host else d.memo["why"]
                ops.append(d)
            self.sends[r] = ops
            if f.cap:
                self.staging[r] = torch.zeros(f.cap, dtype=torch.uint8, device=self.device)
                self.heads[r] = torch.zeros(FIELDS + len(ops), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        fast = [d for ops in self.sends.values() for d in ops if d.fast]
        if fast:
            budget = self.config.num_buffers * self.config.buffer_bytes
            sent = sorted({d.op.message for d in fast})
            self.base = SourceBase(self.plan, self.proc, local, "device", budget, "ipc", sent)
        for d in fast:
            p = self.plan.messages[d.op.message].pieces[0]
            d.bases = [self.base.local.src_view(p.tensor, p.box)]
            d.fast = d.words = d.may_pay = addressable(d.bases[0])
        self._arrays()

    def _receiver(self, store: SignedStore, peer_pulls: list) -> None:
        mine = sorted(k for (_, r), f in self.facts.items() if r == self.proc for k in f.ids)
        if len(mine) != len(peer_pulls):
            raise PlanError(
                f"process {self.proc}: {len(peer_pulls)} CUDA IPC pulls from other GPUs, the plan has {len(mine)}"
            )
        pull_of = dict(zip(mine, peer_pulls))
        for (s, r), f in sorted(self.facts.items()):
            if r != self.proc:
                continue
            staging = None
            if f.cap:
                got = import_handles(store, f"{self.config.name}/ipc/{s}/{r}/delta", self.config.preflight_timeout_s)
                staging = got.get("staging")
                if set(got) != {"staging"} or staging.dtype != torch.uint8 or staging.shape != (f.cap,):
                    raise PlanError(f"process {s} exported a CUDA IPC delta staging that is not {f.cap} bytes")
            self._add_source(s, [pull_of[k] for k in f.ids], staging)

    def _add_source(self, s: int, pulls: list[tuple[torch.Tensor, torch.Tensor]], staging: torch.Tensor | None) -> None:
        """This receiver's messages from source process ``s``: ``pulls`` (destination, mapped source) in plan order,
        ``staging``: the source's staging for it as mapped here (None: it has none, every message dense)."""
        f, make_copy = self.facts[(s, self.proc)], self.make_copy
        paced = self.config.pull_gbps is not None  # its paced pull of everything, every refit
        fast = np.array(
            [w and addressable(d) and addressable(sv) and not paced for w, (d, sv) in zip(f.words.tolist(), pulls)],
            dtype=bool,
        )
        nwords = np.array([p.nbytes // 8 if w else -1 for p, w in zip(self._pieces(f), f.words)], dtype=np.int64)
        names = [self.plan.messages[k].pieces[0].tensor for k in f.ids]
        dst = np.array([d.data_ptr() for d, _ in pulls], dtype=np.int64)
        nbytes = np.array([p.nbytes for p in self._pieces(f)], dtype=np.int64)
        got_from = _From(s, f, names, pulls, fast, nwords, nbytes, dst, staging)
        if staging is not None:
            src_dev, cuda = staging.device, staging.device.type == "cuda"
            self.enable_peer_access(src_dev, self.device)  # its copies and scatter store into this GPU
            got_from.lane = self.owned.new(src_dev) if cuda else None
            got_from.host = torch.zeros(FIELDS + len(f.ids), dtype=torch.int64, pin_memory=cuda)
            got_from.read = make_copy(got_from.host, staging[: got_from.host.numel() * 8].view(torch.int64))[1]
            got_from.copies = [make_copy(d, sv)[1] if ok else None for (d, sv), ok in zip(pulls, fast.tolist())]
            if self.land:
                got_from.landing = torch.empty(f.cap, dtype=torch.uint8, device=self.device)
            self.taken |= {id(q) for q, ok in zip(pulls, fast.tolist()) if ok}
        self.recvs[s] = got_from

    def _pieces(self, f: PairFacts) -> list:
        return [self.plan.messages[k].pieces[0] for k in f.ids]

    # ------------------------------------------------------------------ per refit
    def begin(self, version: int, held: int | None) -> None:
        """A refit of ``version`` starts; this process holds ``held`` (None: no version, or a stale one). A source's
        tensors are final: it finds, packs and writes its headers (queued on the current stream; the executor waits
        for its device before the stage barrier)."""
        self.version, self.held, self.checks = version, held, []
        self.stats = DeltaStats(base_bytes=self.base.nbytes if self.base is not None else 0)
        landing = sum(f.landing.numel() for f in self.recvs.values() if f.landing is not None)
        self.stats.staging_bytes = sum(t.numel() for t in self.staging.values()) + landing
        if self.same:
            self._count("dense", sum(self.same), sum(self.same), len(self.same), SAME_DEVICE)
        if self.sends:
            with _on(self.device):  # its kernels launch on its GPU, whichever device is current
                self._stage()

    def _count(self, kind: str, wire: int, dense: int, n: int, why: str | None = None) -> None:
        """``n`` messages sent as ``kind`` (``wire`` bytes of ``dense``), dense because of ``why``."""
        self.stats.encodings[kind] += n
        self.stats.wire_bytes += wire
        self.stats.dense_bytes += dense
        if why is not None and n:
            self.stats.dense_why[why] = self.stats.dense_why.get(why, 0) + n

    def _stage(self) -> None:
        """A source's refit up to its headers (see the module docstring): plans, finds per batch (the next one
        queued before this one's counts are read), choices and fits as numpy over each batch, packs, headers."""
        order, a, mode = self.order, self.arrays, self.config.delta
        ok = self.base is not None and self.base.version is not None
        held = self.base.version if self.base is not None else None
        if self.base is not None:
            self.base.version = None  # part new from here on, until ``finish``
        plans = [plan_of(d, ok, mode) if d.fast else "skip" for _, d in order]
        counts = np.full(len(order), -1, dtype=np.int64)
        used = {r: header_bytes(b - f) for r, (f, b) in self.spans.items()}
        words, refresh = [], []  # the base's updates after the barrier (``_update_base``)
        diff = [j for j, p in enumerate(plans) if p == "diff"]
        self.stats.diffed += len(diff)
        ready = None  # on CUDA the finds wait for the tensors' last writes, queued so far on the current stream
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        batches = [np.array(b, dtype=np.int64) for b in _batches(diff, a["nbytes"])]
        ahead = self._find(batches[0], ready) if batches else None
        for bi, sel in enumerate(batches):
            pending = ahead  # the next batch's find queued before this one's counts are waited for
            with self._step("the find of its changed words"):
                ahead = self._find(batches[bi + 1], ready) if bi + 1 < len(batches) else None
                found = pending.result()
            k = found.count.astype(np.int64)
            want = k <= found.cap  # over its slots: dense
            if mode == "auto":
                want &= self._rule(sel, k)
            take, offs = self._fit(sel, k, want, used)
            t = sel[take]
            counts[t] = k[take]
            at = a["staging"][t] + offs[take]
            with self._step("packing its changed words into the staging"):
                pack_table(found, np.flatnonzero(take), at, self.device)
            words.append((a["base"][t], at, at + index_bytes(k[take]), k[take], a["nwords"][t]))
            fraction = (k / np.maximum(1, a["nwords"][sel])).tolist()
            for j, f, w, staged in zip(sel.tolist(), fraction, want.tolist(), take.tolist()):
                d = order[j][1]
                d.fraction, d.dense_runs, d.dense_next = f, 0, mode == "auto" and not w
                if not staged:
                    refresh.append(d)
            self._count("words", int(wire_sizes(k[take]).sum()), int(a["nbytes"][t].sum()), len(t))
            for why, dense in ((RULE, sel[~want]), (OVER_STAGING, sel[want & ~take])):
                self._count("dense", int(a["nbytes"][dense].sum()), int(a["nbytes"][dense].sum()), len(dense), why)
        for j, p in enumerate(plans):
            if p == "diff":
                continue
            d = order[j][1]
            d.dense_runs += 1
            d.stale = p == "skip"
            if p == "refresh":
                d.fraction, d.dense_next = None, False
                refresh.append(d)
            self._count("dense", d.nbytes, d.nbytes, 1, None if d.fast else d.memo["why"])
        for r, heads in self.heads.items():
            f, b = self.spans[r]
            heads.numpy()[:] = pack_header(held, self.version, counts[f:b])
            if r in self.head_copies:
                with self._step(f"writing the header for process {r}"):
                    self.head_copies[r](torch.cuda.current_stream(self.device))
            else:  # on the CPU (Triton's interpreter)
                self.staging[r][: heads.numel() * 8].view(torch.int64).copy_(heads)
            self.stats.wire_bytes += heads.numel() * 8
        self.pending = (words, refresh)

    def _fit(self, sel: np.ndarray, k: np.ndarray, want: np.ndarray, used: dict) -> tuple[np.ndarray, np.ndarray]:
        """Which of the messages ``sel`` (positions in ``order``) that ``want`` words (``k`` changed) fit their
        receiver's staging after its ``used`` bytes (updated), in order: a payload that does not fit goes dense, and
        so do the ones after it in this batch (the same receiver's next batch may fit). Returns ``(take, offsets)``."""
        sizes, rs = wire_sizes(k), self.arrays["receiver"][sel]
        take, offs = np.zeros(len(sel), dtype=bool), np.zeros(len(sel), dtype=np.int64)
        for r in np.unique(rs[want]).tolist():
            mine = np.flatnonzero(want & (rs == r))
            ends = used[r] + np.cumsum(sizes[mine])
            fit = ends <= self.staging[r].numel()
            take[mine[fit]] = True
            offs[mine[fit]] = (ends - sizes[mine])[fit]
            used[r] = int(ends[fit][-1]) if fit.any() else used[r]
        return take, offs

    def _arrays(self) -> None:
        """A source's messages in header order (receivers in order, plan order within: ``order``, each receiver's
        ``spans`` there) and what a refit reads of them as numpy (``arrays``), fixed at setup."""
        self.order = [(r, d) for r, ops in sorted(self.sends.items()) for d in ops]
        self.spans, at = {}, 0
        for r, ops in sorted(self.sends.items()):
            self.spans[r], at = (at, at + len(ops)), at + len(ops)
        links = sorted({d.link for _, d in self.order}, key=repr)

        def col(fn) -> np.ndarray:
            return np.array([fn(r, d) for r, d in self.order], dtype=np.int64)

        self.arrays = {
            "receiver": col(lambda r, d: r),
            "nbytes": col(lambda r, d: d.nbytes),
            "nwords": col(lambda r, d: d.nwords[0]),
            "numel": col(lambda r, d: d.numels[0]),
            "itemsize": col(lambda r, d: d.views[0].element_size()),
            "base": col(lambda r, d: d.bases[0].data_ptr() if d.fast else 0),
            "current": col(lambda r, d: d.views[0].data_ptr()),
            "staging": col(lambda r, d: self.staging[r].data_ptr() if r in self.staging else 0),
            "link": col(lambda r, d: links.index(d.link)),
            "share": np.array([d.share for _, d in self.order], dtype=np.float64),
        }
        self.links = links

    def _find(self, sel: np.ndarray, ready: torch.cuda.Event | None):
        """The find of messages ``sel`` (positions in ``order``): one launch on its own stream, behind ``ready``, not
        waited for."""
        a = self.arrays
        return launch_words_table(a["base"][sel], a["current"][sel], a["nwords"][sel], self.device, ready)

    def _rule(self, sel: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Where the rule sends each of messages ``sel`` (``k`` changed words each) as words over its link."""
        a, out = self.arrays, np.zeros(len(sel), dtype=bool)
        for li in np.unique(a["link"][sel]).tolist():
            m = a["link"][sel] == li
            j = sel[m]
            out[m] = choose_words_many(
                a["numel"][j], k[m], a["itemsize"][j], np.arange(len(j) + 1), self.links[li], a["share"][j]
            )
        return out

    def pull(self, stream: torch.cuda.Stream | None, full) -> None:
        """After the stage barrier: a source queues its base's updates (``_update_base``, on ``stream``, which its
        next refit's find and its trainer's next step follow); a receiver reads its sources' headers and pulls on
        ``stream`` (see the module docstring); ``full``: the captured pull of everything. ``stream`` None: the current
        one of this process's GPU."""
        if stream is None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
        if self.base is not None:
            with _on(self.device, stream), self._step("the update of its base from the staging"):
                self._update_base()
        if not self.recvs:
            if full is not None:
                with self._step("the pull of everything"):
                    full.pull(stream)
            return
        with self._step("reading the headers"):
            got = self._headers()
        apply = {}
        for s, f in self.recvs.items():
            base, counts = got[s]
            ok = f.fast & (counts >= 0)
            if ok.any() and (base is None or base != self.held):
                self.stats.dense_why[OTHER_BASE] = self.stats.dense_why.get(OTHER_BASE, 0) + int(ok.sum())
                ok[:] = False
            apply[s] = ok
            self.stats.received_bytes += int(f.nbytes[~ok].sum())
        if not any(a.any() for a in apply.values()):
            if full is not None:
                with self._step("the pull of everything"):
                    full.pull(stream)
            return
        if self.rest is not None:
            with self._step("the pull of what no delta takes"):
                self.rest.pull(stream)
        self._scatter(stream, got, apply)

    def _headers(self) -> dict[int, tuple[int | None, np.ndarray]]:
        """Each source's header, read (one small copy per source on its lane, then one wait each) and checked."""
        for f in self.recvs.values():
            if f.staging is not None:
                with _on(f.staging.device):
                    f.read(f.lane)
        out = {}
        for s, f in self.recvs.items():
            if f.staging is None:
                out[s] = (None, np.full(len(f.pulls), -1, dtype=np.int64))
                continue
            if f.lane is not None:
                f.lane.synchronize()
            out[s] = read_header(f.host.numpy(), self.version, f.nwords, f.facts.cap, f"process {s}")
            self.stats.received_bytes += f.host.numel() * 8
        return out

    def _scatter(self, stream: torch.cuda.Stream | None, got: dict, apply: dict) -> None:
        """Per source, on its lane (``stream``'s work before them first): the taken messages that do not apply copied
        dense, and the applied messages' words scattered from its staging (on its GPU, whose context maps the
        staging: see the module docstring) or, where ``land``, the used part of its staging copied to the landing
        copy; then the landed words of every source in one scatter on ``stream``. Each scatter's indices are checked
        first (read by ``verify``)."""
        landed = []
        for s, f in self.recvs.items():
            if f.staging is None:
                continue
            counts, ok = got[s][1], apply[s]
            dense, sel = np.flatnonzero(f.fast & ~ok).tolist(), np.flatnonzero(ok)
            self.stats.received_bytes += int(wire_sizes(counts[sel]).sum())
            if not dense and not len(sel):
                continue
            names = [(s, f.names[i]) for i in sel.tolist()]
            _wait(f.lane, stream)
            with _on(f.staging.device, f.lane):
                with self._step(f"the dense copies from process {s}"):
                    for i in dense:
                        f.copies[i](f.lane)
                if len(sel) and self.land:
                    with self._step(f"the copy of process {s}'s staging to the landing copy"):
                        n = used_bytes(counts)
                        self.make_copy(f.landing[:n], f.staging[:n])[1](f.lane)
                    landed.append((scatter_rows(counts, ok, f.landing.data_ptr(), f.dst, f.nwords), names))
                elif len(sel):
                    rows = scatter_rows(counts, ok, f.staging.data_ptr(), f.dst, f.nwords)
                    self._launch(rows, names, f.staging.device, f"the scatter of process {s}'s words")
            _wait(stream, f.lane)
        if landed:
            rows = tuple(np.concatenate(c) for c in zip(*(r for r, _ in landed)))
            with _on(self.device, stream):
                self._launch(rows, [n for _, ns in landed for n in ns], self.device, "the scatter of the landed words")

    def _launch(self, rows: tuple, names: list, device: torch.device, what: str) -> None:
        """One checked scatter of ``rows`` (``scatter_rows``; ``names``: each row's source and tensor) on ``device``
        and its current stream; the check's flags kept for ``verify``."""
        with self._step(f"{what} (on {device})"):
            scatter = Scatter.of(*rows, device)
            flags = torch.zeros(1 + len(scatter.pieces), dtype=torch.int32, device=device)
            scatter.check(flags)
            scatter.apply(flag=flags)
        self.checks.append((flags, scatter.pieces, names))

    def _update_base(self) -> None:
        """A source, after the barrier: its base brought to what it staged (one scatter of the words read from the
        staging, one copy per message that refreshes it), on the current stream, while its receivers read."""
        words, refresh = self.pending
        self.pending = ([], [])
        if words:
            Scatter.of(*(np.concatenate(c) for c in zip(*words)), self.device).apply()
        if refresh:
            torch._foreach_copy_([d.bases[0] for d in refresh], [d.views[0] for d in refresh])

    @contextlib.contextmanager
    def _step(self, what: str) -> Iterator[None]:
        """A CUDA error (or Triton's) raised inside names this process and ``what`` it was doing; it may come from
        work queued before (``CUDA_LAUNCH_BLOCKING=1`` ties it to its launch)."""
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, RefitError):
                raise
            raise RuntimeError(f"process {self.proc}, CUDA IPC delta, {what}: {e}") from e

    def verify(self) -> None:
        """A receiver, after the executor's wait for its device: ``DeltaError`` naming the source and tensor if an
        index of one of the refit's scatters was outside its piece (then none of that scatter's words were stored)."""
        checks, self.checks = self.checks, []
        for flags, pieces, names in checks:
            got = flags.tolist()
            if got[0]:
                s, name = names[int(pieces[[r for r, v in enumerate(got[1:]) if v][0]])]
                raise DeltaError(
                    f"CUDA IPC delta from process {s} ({name}): a word index is outside its piece (none of the words "
                    "of its scatter were stored)"
                )

    def finish(self, version: int) -> None:
        """After the refit's last barrier (every receiver's pull is done): a source's base holds ``version``."""
        if self.base is not None:
            self.base.version = version

    def close(self) -> None:
        """Drop the mapped stagings, the ``rest`` pull and the lanes (queued work still finishes); a source keeps its
        staging until it is dropped (its receivers may still map it until the link's last barrier)."""
        if self.rest is not None:
            self.rest.close()
        self.rest, self.recvs, self.checks = None, {}, []
        self.owned.free()


def scatter_rows(counts: np.ndarray, apply: np.ndarray, staging: int, dst: np.ndarray, nwords: np.ndarray) -> tuple:
    """``Scatter.of``'s rows of the messages ``apply`` selects from a staging at byte address ``staging`` holding
    ``counts`` (``refit.delta.staging``): their destinations (``dst``), indices and words (at their offsets) and
    counts and words."""
    sel = np.flatnonzero(apply)
    at, k = staging + offsets(counts)[sel], counts[sel]
    return dst[sel], at, at + index_bytes(k), k, nwords[sel]


def _batches(diff: list[int], nbytes: list[int]) -> list[list[int]]:
    """``diff`` (positions, in order) in find batches of at most ``WORD_BATCH_BYTES`` of data each."""
    out, cur, size = [], [], 0
    for j in diff:
        if cur and size + nbytes[j] > WORD_BATCH_BYTES:
            out.append(cur)
            cur, size = [], 0
        cur.append(j)
        size += nbytes[j]
    return [*out, cur] if cur else out


@contextlib.contextmanager
def _on(device: torch.device, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
    """Device work inside is launched on ``device`` (its current device: Triton launches there) and ``stream`` (None:
    that device's current one); nothing to set on the CPU."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device), torch.cuda.stream(stream):
        yield


def _wait(stream: torch.cuda.Stream | None, other: torch.cuda.Stream | None) -> None:
    """``stream`` waits for the work queued so far on ``other`` (no streams on the CPU)."""
    if stream is not None and other is not None:
        stream.wait_stream(other)
