"""NIXL pulls: every receiver reads its plan's pieces from its sources' registered memory (one-sided READs).

This module is the link (``NixlLink``: setup, per-refit protocol, checksums). It builds on
``refit.transport.nixl_agent`` (the process's NIXL agent and its UCX settings, ``Trace``),
``refit.transport.nixl_memory`` (registered regions, runs, the source's staging buffer) and
``refit.transport.nixl_record`` (the sealed per-receiver record and its checks).

Setup (once, through the store; no process group spans sources and receivers):

* each process takes its NIXL agent (``SharedAgent``: UCX backend, NIXL's own metadata listener off,
  the UCX settings of ``refit.transport.nics`` applied first) and registers the memory its pieces live
  in (``storage_regions``): a source the storage of every tensor a receiver reads (whole parameters; a
  view registers its storage), a receiver the storage of every tensor it receives into;
* each source publishes, for each of its receivers, a record sealed with the job secret
  (``record_for``, ``SignedStore.put_sealed``): its agent name and metadata, its registered regions
  and the address and strides of every tensor part that receiver reads;
* each receiver checks every field of its sources' records (``check_record``) before
  ``add_remote_agent``, then turns its pieces into descriptors and prepares its READ requests
  (``refit.transport.nixl_requests``).

Per refit: a source announces that its tensors are final (``<name>/nixl/<agent>/ready/<run>`` = the run
number, written in one store call with its delta and checksum records; the key of the run two before is
deleted); a receiver waits for that (where it is no source itself blocking on the store, not polling: no CPU
taken from the sources while they find their deltas; one call waits for every source's key and reads them with
the delta records), posts its requests (those read in place between GPUs all at once, others at most
``config.num_buffers`` in flight: ``refit.transport.nixl_requests``), then, once nothing reads a source's memory
any more (before it scatters its deltas; after it checked the sums in checksum mode), announces
``<name>/nixl/<agent>/done/<proc>``: the signed value as a NIXL notification to each source, then in the store
on a thread of its own, not waited for (a write that failed fails the next refit). A source returns once every
receiver of it is done (its tensors may change again), reading its notifications at each poll and the store
every 25th (a notification's value is checked as the store's). Every wait polls under the run's ``RunClock`` (a
frozen peer is a ``DeadlineExceeded``, never a hang; another process's abort ends it too). A source that dies
mid-read fails the read (``TransferError`` naming it).

Debugging (``REFIT_NIXL_DEBUG=1``, ``Trace``): a line per phase on stderr (agent made, regions
registered and how long it took, records published and read, remote agents added, requests prepared;
per refit: announced, each post of the first refit, every 5 s what a wait still waits for, bytes read
and the rate, checksums, finished), and UCX prints the transports and protocols it chose.

Staging: a source packs the pieces whose runs in its tensors are short (``SourceStaging``: a column
slice of a row-sharded weight) into a registered staging buffer of ``num_buffers`` slots of
``buffer_bytes``, in rounds: the first ``num_buffers`` rounds before it announces a refit, each later
round into the slot of the round ``num_buffers`` before, once every receiver has read that one
(``<agent>/packed`` and ``<agent>/consumed/<proc>``, counting up over refits; ``_Reads``). Receivers
read a staged piece as one descriptor. Other pieces are read in place, one descriptor per run common to
both sides (one request gathers many): one copy each for UCX, so strided ones are slow.

Deltas (``config.delta`` not "off", ``refit.transport.nixl_delta``): a source stages what changed since the
version each receiver holds and names it in a sealed record; receivers read only that and scatter it.

Checksums (``config.checksums``; ``NixlSums``, ``refit.transport.nixl_sums``): a source sums every piece it sends
(``transport.checksum``'s definition: the torch reference on the CPU, the Triton kernel on CUDA)
once its tensors are final, before it packs its staging buffer, and publishes, per receiver, the
sums of that receiver's pieces with the run number, sealed (``<name>/nixl/<agent>/sums/<proc>``,
written before the announcement); a receiver, once every read is done, sums what it received, checks
the record field by field and compares: the first differing piece (plan order) is a
``ChecksumError`` naming its tensor, box and source process, raised before it announces ``done``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.delta.ops import DeltaStats
from refit.errors import ConfigError, PlanError, TransferError
from refit.plan import Plan
from refit.plan.schedule import part_key, source_part
from refit.transport.clock import RunClock
from refit.transport.nixl_agent import PROGRESS_EVERY_S, SharedAgent, Trace, available, peers_on_this_host
from refit.transport.nixl_delta import NixlDelta, read_handles, with_stats
from refit.transport.nixl_memory import SourceStaging, storage_regions
from refit.transport.nixl_record import MEM_TYPES, check_record, record_for
from refit.transport.nixl_requests import Request, prepare_reads
from refit.transport.nixl_sums import NixlSums, device_wait
from refit.transport.store import SignedStore

log = logging.getLogger("refit.nixl")

_POLL_S = 0.001
_NOTED_POLL_S = 0.0002  # a wait on a notified key (``_wait_for(noted=True)``): a poll reads local notifications
_NOTED_FAST_S = 0.05  # ... that often for this long (a delta refit's wait), then every ``_POLL_S`` (a dense one's)
_STORE_EVERY = 25  # ... and the store every this many polls (5 ms, then 25 ms: a notification that did not come)
_READY_WAIT_S = 0.02  # a receiver's blocking wait for an announcement, per store call (the abort check's cadence)


# ---------------------------------------------------------------------------- the link
class _Reads:
    """A receiver's READs in one refit, at most ``num_buffers`` in flight. Requests read in place, or from
    a staging round packed before the announcement (round < slots), go at once; those of a later round r
    wait until their source says it packed r (``<agent>/packed``). Once every request of rounds 0..r of a
    source is done, the receiver says so (``<agent>/consumed/<proc>``) where the source waits for it: for
    rounds r < rounds - slots, the ones whose slot is packed again. Values count up over refits:
    (run - 1) x rounds + r + 1."""

    def __init__(self, link: NixlLink, rounds: dict[int, tuple[int, int]], requests: list[Request]) -> None:
        self.link, self.rounds, self.requests = link, rounds, requests
        self.pending = [q for q in requests if q.round < rounds[q.peer][1]]
        self.held: dict[tuple[int, int], list[Request]] = {}  # (source, round) -> requests not yet packed
        for q in requests:
            if q.round >= rounds[q.peer][1]:
                self.held.setdefault((q.peer, q.round), []).append(q)
        self.left = Counter((q.peer, q.round) for q in requests if q.round >= 0)
        self.reported = {sp: 0 for sp, (count, slots) in rounds.items() if count > slots and sp in link.sources}
        self.flying: list[Request] = []
        self.done = 0

    def _base(self, sp: int) -> int:
        return (self.link.runs - 1) * self.rounds[sp][0]

    def step(self) -> bool:
        """Release packed rounds, post, poll, report; whether everything is read and reported."""
        link, limit = self.link, self.link.config.num_buffers
        if self.held and len(self.pending) < limit:
            self._release()
        room, later = limit - sum(q.capped for q in self.flying), []
        for req in self.pending:  # an uncapped request (in place between GPUs) goes at once
            if req.capped and room <= 0:
                later.append(req)
                continue
            room -= req.capped
            if link.runs == 1:  # a post that blocks (UCX mapping a source's memory) shows here
                link.trace("run 1: posting %d bytes (%d pieces) from process %d", req.nbytes, req.descriptors, req.peer)
            if link._call(req, link.agent.transfer, "posting") != "DONE":
                self.flying.append(req)
            else:
                self._finished(req)
        self.pending = later
        for req in list(self.flying):
            if link._call(req, link.agent.check_xfer_state, "reading") == "DONE":
                self.flying.remove(req)
                self._finished(req)
        self._report()
        if self.flying and link.trace.every("flying", PROGRESS_EVERY_S):
            link.trace("run %d: still reading: %s", link.runs, self.what())
        return not (self.pending or self.flying or self.held) and all(
            n >= self.rounds[sp][0] - self.rounds[sp][1] for sp, n in self.reported.items()
        )

    def _finished(self, req: Request) -> None:
        self.done += 1
        if req.round >= 0:
            self.left[(req.peer, req.round)] -= 1

    def _release(self) -> None:
        for sp in sorted({p for p, _ in self.held}):
            v = self.link.store.peek(self.link._key(f"{self.link.sources[sp]}/packed"))
            if not isinstance(v, int) or isinstance(v, bool):
                continue
            for key in [k for k in self.held if k[0] == sp and self._base(sp) + k[1] + 1 <= v]:
                self.pending += self.held.pop(key)

    def _report(self) -> None:
        for sp, n in self.reported.items():
            count, slots = self.rounds[sp]
            while n < count - slots and self.left[(sp, n)] == 0 and (sp, n) not in self.held:
                n += 1
            if n > self.reported[sp]:
                self.reported[sp] = n
                self.link.store.put(
                    self.link._key(f"{self.link.sources[sp]}/consumed/{self.link.proc}"), self._base(sp) + n
                )

    def what(self) -> str:
        """What is still being read, or waited for."""
        if self.flying or self.pending:
            return NixlLink._pending(self.flying + self.pending)
        if self.held:
            sp, r = min(self.held)
            return (
                f"process {sp} packing its staging round {r} (NIXL; it packs a round once every receiver "
                "has read the one before it in that slot, from its finish on)"
            )
        return ""


class NixlLink:
    """One process's NIXL part of a plan: its agent and registered memory, the records it published
    (source) and the READ requests it prepared (receiver).

    Lifecycle: ``NixlLink.open(...)`` on every process with NIXL messages, after pre-flight (collective
    through the store: sources publish sealed records, receivers wait for theirs up to
    ``config.preflight_timeout_s``); per refit ``start(clock)`` (a source packs its first staging rounds
    and announces its tensors are final) then ``finish(clock)`` (a receiver reads everything; a source
    packs its later staging rounds as its receivers free the slots, then waits until they are done);
    ``close()``. Receivers of a source with more staging rounds than slots progress past the first
    rounds only once that source is in ``finish`` (after its other transports' work in a mixed plan).
    Must agree on every process: the plan and ``config.name`` (store keys); the job secret (records are
    sealed with it). Between refits: registrations and requests stay; sources change their tensors in
    place only between their ``finish`` and the next ``start``.
    """

    def __init__(self, agent, name: str, store: SignedStore, config: TransferConfig, proc: int) -> None:
        self.agent, self.name, self.store, self.config, self.proc = agent, name, store, config, proc
        self.registered: list = []  # NIXL registration lists (deregistered at close)
        self.tensors: list[torch.Tensor] = []  # what the registered memory belongs to (kept alive)
        self.staging: SourceStaging | None = None  # source: short-run pieces packed before each refit
        self.requests: list[Request] = []  # receiver: READs, prepared once
        self.sources: dict[int, str] = {}  # receiver: source process -> its agent name
        self.unreachable: dict[int, str] = {}  # receiver: sources whose agent refused the connection at setup
        self.receivers: list[int] = []  # source: processes that read from this one
        self.sums: NixlSums | None = None  # checksum mode
        self.runs = 0  # refits started so far (the same count on every process of the plan)
        self.source_rounds: dict[int, tuple[int, int]] = {}  # receiver: source process -> (rounds, slots)
        self.packed = 0  # source: staging rounds packed in this run
        self.consumed: dict[int, int] = {}  # source: the last ``consumed`` value seen per receiver
        self.delta: NixlDelta | None = None  # delta mode (``refit.transport.nixl_delta``)
        self.remote_regions: dict[int, list[list]] = {}  # receiver: each source's registered regions
        self.bytes_read = 0
        self.trace = Trace(proc)  # REFIT_NIXL_DEBUG=1: a line per phase
        self.shared: SharedAgent | None = None  # the process's agent (``agent`` is its NIXL object)
        self.device = torch.device("cpu")  # where this process's registered tensors are
        self._writer: ThreadPoolExecutor | None = None  # receiver: writes its done values (``_write_done``)
        self._done: Future | None = None  # ... the last of those writes

    @classmethod
    def open(cls, plan: Plan, proc: int, local: LocalTensors, store: SignedStore | None, config: TransferConfig):
        """Make the agent, register, publish and import records, prepare the reads (see the class)."""
        if store is None:
            raise PlanError("the plan has NIXL links but no rendezvous store was given")
        if not available():
            raise ConfigError("the plan has NIXL links but nixl is not installed: pip install 'refit-rl[nixl]'")
        mine = [m for m in plan.messages if m.transport == "nixl"]
        sends = [m for m in mine if plan.procs.src[m.src] == proc]
        recvs = [m for m in mine if plan.procs.dst[m.dst] == proc]
        tensors = [local.src_part(p.tensor, p.box)[1][1] for m in sends for p in m.pieces]
        tensors += [local.dst_view(p.tensor, p.box) for m in recvs for p in m.pieces]
        device = tensors[0].device if tensors else torch.device("cpu")
        staging = SourceStaging(plan, proc, local, config.buffer_bytes, config.num_buffers, device)
        tensors += [staging.buffer] if staging.offsets else []
        delta = NixlDelta(plan, proc, local, config, device) if config.deltas else None
        tensors += delta.buffers() if delta is not None else []
        trace = Trace(proc)
        trace("setup on %s: %d pieces to send, %d to read, staging %d bytes", device, len(sends), len(recvs),
              staging.buffer.numel())  # fmt: skip
        one_host = peers_on_this_host(plan, proc)
        shared = SharedAgent.acquire(device, one_host)
        name = shared.name
        link = cls(shared.agent, name, store, config, proc)
        link.shared, link.trace, link.device = shared, trace, device
        trace("agent %s (UCX backend; one host: %s) used by %d link(s) here", name, one_host, shared.users)
        link.tensors, link.staging = tensors, staging  # registered memory stays allocated while the link lives
        link.delta = delta
        link.sums = NixlSums(plan, proc, local, device) if config.checksums else None
        try:
            link._register(storage_regions(tensors))
            link.receivers = sorted({plan.procs.dst[m.dst] for m in sends})
            for r in link.receivers:
                rec = record_for(plan, local, link.agent, name, link._regions, r, staging)
                store.put_sealed(link._key(f"record/{proc}/{r}"), json.dumps(rec).encode())
            trace("records published for processes %s", link.receivers)
            for sp in sorted({plan.procs.src[m.src] for m in recvs}):
                link._connect(plan, local, sp)
        except Exception:
            link.close()
            raise
        log.info("refit nixl: process %d agent %s: %d reads prepared", proc, name, len(link.requests))
        trace("setup done: %d READ requests prepared", len(link.requests))
        return link

    def _key(self, what: str) -> str:
        return f"{self.config.name}/nixl/{what}"

    def _register(self, regions: list[list]) -> None:
        self._regions = regions
        for mem in MEM_TYPES:
            rows = [(a, n, dev, "") for a, n, dev, m in regions if m == mem]
            if rows:
                t0 = time.monotonic()
                self.trace("registering %d %s regions, %d bytes", len(rows), mem, sum(r[1] for r in rows))
                self.registered.append(self.agent.register_memory(rows, mem))
                self.trace("registered %s in %.3f s", mem, time.monotonic() - t0)

    def _connect(self, plan: Plan, local: LocalTensors, sp: int) -> None:
        """Read, check and import source process ``sp``'s record; prepare the reads from it."""
        key = self._key(f"record/{sp}/{self.proc}")
        try:
            raw = self.store.get_sealed(key, self.config.preflight_timeout_s)
            rec = json.loads(raw)
        except (TimeoutError, ValueError) as e:
            raise PlanError(f"NIXL setup: no valid record from process {sp} under {key!r}: {e}") from e
        ndims, messages = {}, set()
        for k, m in enumerate(plan.messages):
            if m.transport == "nixl" and plan.procs.dst[m.dst] == self.proc and plan.procs.src[m.src] == sp:
                p = m.pieces[0]
                ndims[part_key(p.tensor, source_part(plan, m.src, p.tensor, p.box)[0])] = len(p.box)
                messages.add(k)
        rec = check_record(rec, f"process {sp}", ndims, messages)
        self.trace("record of process %d read: agent %s, %d regions", sp, rec["agent"], len(rec["regions"]))
        try:
            got = self.shared.add_remote(rec["metadata"])
        except Exception as e:  # noqa: BLE001 - NIXL's own error: the source's agent is gone
            self.unreachable[sp] = f"{type(e).__name__}: {e}"
            log.warning("refit nixl: process %d cannot reach process %d: %s", self.proc, sp, e)
            return
        self.sources[sp] = got  # counted: close() drops it
        if got != rec["agent"]:
            raise PlanError(f"NIXL record of process {sp}: metadata is of agent {got!r}, not {rec['agent']!r}")
        self.trace("agent of process %d added", sp)
        self.source_rounds[sp] = (rec["rounds"]["count"], rec["rounds"]["slots"])
        self.remote_regions[sp] = rec["regions"]
        reqs = prepare_reads(self.agent, plan, self.proc, local, rec, sp, self.config.buffer_bytes, bool(self.delta))
        self.requests += reqs
        self.trace("%d READ requests from process %d prepared: %d descriptors, %d bytes", len(reqs), sp,
                   sum(r.descriptors for r in reqs), sum(r.nbytes for r in reqs))  # fmt: skip

    # ------------------------------------------------------------------ run
    def start(self, clock: RunClock, fault=None, version: int = 0, held: dict[int, int | None] | None = None) -> None:
        """Begin this process's part of a refit: a source (its tensors final) takes its checksums
        (checksum mode), calls ``fault("nixl-announce")`` (tests: a change now is what a receiver
        must catch), packs its first ``num_buffers`` staging rounds, stages its deltas (delta mode:
        ``_stage_deltas``), publishes its sums and announces that its tensors are final. Delta mode:
        ``version`` is the one being sent, ``held[proc]`` the version this process holds (a receiver reads a
        delta on another base dense)."""
        self.runs += 1
        if self.delta is not None:
            self.delta.begin(version, (held or {}).get(self.proc))
        if not self.receivers:
            return
        self.trace("run %d: source, tensors final", self.runs)
        sent = self.sums.sent(clock) if self.sums is not None else None
        if fault is not None:
            fault("nixl-announce")
        if self.staging is not None:  # the first rounds packed, and on a GPU every write before the announcement done
            self.packed = min(len(self.staging.rounds), self.staging.slots)
            for r in range(self.packed):
                self.staging.pack(r)
            device_wait(self.staging.buffer.device, clock, "packing the NIXL staging buffer")
        records = self._stage_deltas(clock) if self.delta is not None else {}
        for r in self.receivers if sent is not None else ():
            key = self._key(f"{self.name}/sums/{r}")
            records[key] = self.store.sealed(key, json.dumps(self.sums.record(r, self.runs, sent)).encode())
        records[self._key(f"{self.name}/ready/{self.runs}")] = self.runs  # last, in the same store call as the rest
        self.store.put_many(records)
        self.trace("run %d: announced to processes %s", self.runs, self.receivers)

    def finish(self, clock: RunClock, stats: DeltaStats | None = None) -> DeltaStats | None:
        """A receiver: wait for each source's announcement, read every piece (at most
        ``config.num_buffers`` requests in flight), announce it is done. A source: wait until every
        receiver of it is done. Every wait under ``clock``. A source this receiver could not connect to at
        setup (it died meanwhile) fails the refit here, naming it, so a fan-out re-plans around it.
        Returns ``stats`` (a P2P delta run's) with this refit's NIXL delta statistics added (``with_stats``)."""
        if self.unreachable:
            sp, why = min(self.unreachable.items())
            raise TransferError(f"NIXL: process {sp} could not be reached when the reads were set up ({why})")
        e = self._done.exception() if self._done is not None and self._done.done() else None
        if e is not None:
            raise TransferError(f"NIXL: writing the last refit's done values failed: {type(e).__name__}: {e}")
        announced = self._wait_announced(clock)
        self.bytes_read = 0
        delta = self.delta is not None and self.sources
        requests, made = self._delta_reads(announced) if delta else (self.requests, [])
        try:
            if requests or self._rounds_to_pack() or any(c > n for c, n in self.source_rounds.values()):
                self.trace("run %d: every source announced; reading %d requests", self.runs, len(requests))
                self._pump(clock, requests)
                if requests and self.device.type == "cuda":
                    # NIXL says a READ over CUDA IPC is done before UCX's copies of it have all landed (on 2x
                    # H200 up to 20 ms before: a device wait after it took that long): nothing reads what
                    # arrived, and no source is told it may change its tensors, before the device is done
                    torch.cuda.synchronize(self.device)
        finally:
            _release(made)
        if self.sums is None:  # nothing reads a source's memory any more: their waits end while this one applies
            self._say_done()
        if self.delta is not None:
            self.delta.stats.received_bytes += self.bytes_read
            self.delta.apply()
        if self.sums is not None:  # checksum mode: done once what was read is checked
            if self.sources:
                self._check_sums(clock)
                self.trace("run %d: checksums equal", self.runs)
            self._say_done()
        for r in self.receivers:
            key = self._key(f"{self.name}/done/{r}")
            what = lambda r=r: f"process {r} reading from process {self.proc} over NIXL"  # noqa: E731
            self._wait_for(key, clock, what, noted=True)
        if self.receivers and self.runs > 2:  # a receiver waits for the key of its own run (they run in step): older
            # ones go, once this run's receivers are done (a store call before then would delay serving their reads)
            self.store.raw.delete_key(self._key(f"{self.name}/ready/{self.runs - 2}"))
        if self.delta is not None and self.receivers:  # a source's base updates once its receivers are done reading,
            self.delta.settle()  # on its own thread: its waits stayed light, reads were served and store calls answered
        self.trace("run %d: finished", self.runs)
        return with_stats(stats, self)

    def _say_done(self) -> None:
        """A receiver tells each of its sources it is done reading (``<agent>/done/<proc>`` = the run number,
        signed): as a NIXL notification first (a source may end its wait at once), then in the store, where a
        source looks too, written on the link's own thread and not waited for (``_write_done``)."""
        done = {agent: self._key(f"{agent}/done/{self.proc}") for agent in self.sources.values()}
        signed = {key: self.store.sign(key, self.runs) for key in done.values()}
        for agent, key in done.items():
            self.shared.notify(agent, key, signed[key])
        if signed:
            self._write_done(signed)

    def _write_done(self, signed: dict[str, bytes]) -> None:
        """A receiver's done values (``signed``, already sent as notifications) written to the store in one call on
        the link's own thread, not waited for: its sources end their waits on the notifications, and the store's
        copy (what a source reads where a notification did not come) lands meanwhile. A write that failed fails the
        next refit (``finish``), before it reads anything."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="refit-nixl-done")
        self._done = self._writer.submit(self.store.put_signed, signed)

    def _check_sums(self, clock: RunClock) -> None:
        """Compare what was read with every source's sums of this run (``NixlSums.check``)."""
        want: dict[int, int] = {}
        for sp, agent in sorted(self.sources.items()):
            key = self._key(f"{agent}/sums/{self.proc}")
            got: dict = {}

            def arrived(sp=sp, key=key, got=got) -> bool:
                self.shared.progress()
                raw = self.store.peek_sealed(key)
                sums = None if raw is None else self.sums.check_record(json.loads(raw), sp, self.runs)
                got.update(sums or {})
                if sums is None:
                    time.sleep(_POLL_S)
                return sums is not None

            clock.watch(arrived, lambda sp=sp, key=key: f"process {sp}'s checksums (NIXL, store key {key!r})")
            want.update(got)
        self.sums.check(want, clock)

    def _wait_announced(self, clock: RunClock) -> dict[str, object]:
        """A receiver, until every source announced this run. One that is no source here blocks on the
        store, not polling and not progressing UCX (no CPU taken from the sources while they find their deltas):
        one store call waits, at most ``_READY_WAIT_S`` at a time (the abort check and the deadline still come),
        until every source's ready key (and, delta mode, its delta record, written in the same store call) exists
        and reads them all (``SignedStore.wait_values``); a value not validly tagged, or of an earlier run, ends
        no wait. One that is also a source polls each ready key (``_wait_for``: it progresses its worker, so its
        own receivers' reads are served). Returns the values read by key (the records ``_delta_reads`` checks)."""
        ready = {sp: self._key(f"{agent}/ready/{self.runs}") for sp, agent in sorted(self.sources.items())}
        if self.receivers or not ready:
            for sp, key in ready.items():
                self._wait_for(key, clock, lambda sp=sp: f"process {sp} announcing its tensors")
            return {}
        keys = list(ready.values()) + ([self._record_key(sp) for sp in ready] if self.delta is not None else [])
        got: dict[str, object] = {}

        def announced() -> bool:
            left = clock.left()
            values = self.store.wait_values(keys, _READY_WAIT_S if left is None else min(_READY_WAIT_S, left))
            got.update(values or {})
            if values is not None and all(self._valid(got[k]) for k in ready.values()):
                return True
            if values is not None:  # every key there, not every value valid: poll until valid ones replace them
                time.sleep(_POLL_S)
            if self.trace.every("ready", PROGRESS_EVERY_S):
                self.trace("run %d: still waiting for %s", self.runs, late())
            return False

        def late() -> str:
            sps = [sp for sp, key in ready.items() if not self._valid(got.get(key))]
            return ", ".join(f"process {sp}" for sp in sps) + " announcing its tensors"

        clock.watch(announced, lambda: f"{late()} (NIXL, store keys {keys!r})")
        return got

    def _valid(self, value) -> bool:
        """Whether ``value`` (a signed value read, or None) is this run's number or a later one."""
        return isinstance(value, int) and not isinstance(value, bool) and value >= self.runs

    def _wait_for(self, key: str, clock: RunClock, what, noted: bool = False) -> None:
        """Until the signed value under ``key`` reaches this run's number (an older value, or a forged one, does
        not end the wait), polling and progressing UCX between reads. ``noted``: the writer also sends the signed
        value as a NIXL notification (``SharedAgent.notify``): each poll reads the notifications (local, no store
        round trip; a value checked as the store's), the store every ``_STORE_EVERY``-th poll, and polls come
        every ``_NOTED_POLL_S`` for the first ``_NOTED_FAST_S``, then every ``_POLL_S``."""
        polls, fast = [0], time.monotonic() + _NOTED_FAST_S

        def now() -> bool:
            polls[0] += 1
            if noted:
                if self.shared.threaded:
                    self.shared.listen()
                raw = self.shared.notes.get(key)
                if raw is not None and self._valid(self.store.verified(key, raw)):
                    return True
                if polls[0] % _STORE_EVERY != 1:
                    return False
            return self._valid(self.store.peek(key))

        def reached() -> bool:
            self.shared.progress()
            if now():
                return True
            if self.trace.every(key, PROGRESS_EVERY_S):
                self.trace("run %d: still waiting for %s", self.runs, what())
            time.sleep(_NOTED_POLL_S if noted and time.monotonic() < fast else _POLL_S)
            return False

        clock.watch(reached, lambda: f"{what()} (NIXL, store key {key!r})")

    def _stage_deltas(self, clock: RunClock) -> dict[str, dict]:
        """Delta mode, a source: its deltas staged (``NixlDelta.stage``), the staging written before the
        announcement; each receiver's sealed record by its store key, for the announcement to publish."""
        records = {}
        for r, rec in self.delta.stage(self.runs).items():
            key = self._key(f"{self.name}/delta/{r}")
            records[key] = self.store.sealed(key, rec)
        device_wait(self.delta.staging.device, clock, "staging the NIXL deltas")
        return records

    def _delta_reads(self, announced: dict[str, object]) -> tuple[list[Request], list[Request]]:
        """Delta mode, a receiver, every source announced: their records (read with the announcements where
        ``announced`` holds them, else from the store) checked (``NixlDelta.plan_reads``); this refit's requests
        (the dense messages' prepared ones, one READ per source of its deltas) and those made."""

        def raw_of(sp: int) -> bytes:
            key = self._record_key(sp)
            value = announced.get(key) if key in announced else self.store.peek(key)
            if value is None:
                raise TransferError(f"NIXL: process {sp} announced refit {self.runs} without its delta record")
            return self.store.unseal(key, value)

        dense, reads = self.delta.plan_reads(raw_of, self.runs)
        made = [Request(sp, self.sources[sp], h, n, 1) for sp, h, n in read_handles(self.agent, reads, self)]
        return self.delta.dense_requests(self.requests, dense) + made, made

    def _record_key(self, sp: int) -> str:
        """The store key of source process ``sp``'s delta record for this process."""
        return self._key(f"{self.sources[sp]}/delta/{self.proc}")

    def commit(self, version: int) -> None:
        """Delta mode: the refit of ``version`` succeeded on every process (``NixlDelta.commit``)."""
        if self.delta is not None:
            self.delta.commit(version)

    def fail(self) -> None:
        """Delta mode: the refit failed (``NixlDelta.fail``: the next refit is dense)."""
        if self.delta is not None:
            self.delta.fail()

    def _rounds_to_pack(self) -> bool:
        return self.staging is not None and bool(self.receivers) and self.packed < len(self.staging.rounds)

    def _pump(self, clock: RunClock, requests: list[Request]) -> None:
        """Read every one of ``requests`` (``_Reads``) and, as a source, pack each later staging round once its
        receivers are done with the slot; both under ``clock`` until nothing is left."""
        reads = _Reads(self, self.source_rounds, requests)
        t0 = time.monotonic()

        def step() -> bool:
            self.shared.progress()
            self._pack_next(clock)
            done = reads.step()
            if self.trace.every("read", PROGRESS_EVERY_S):
                self.trace("run %d: %d of %d requests read", self.runs, reads.done, len(requests))
            return done and not self._rounds_to_pack()

        clock.watch(step, lambda: reads.what() or self._packing())
        self.bytes_read = sum(r.nbytes for r in requests)
        dt = time.monotonic() - t0
        rate = self.bytes_read / max(dt, 1e-9) / 1e9  # run 1 includes UCX mapping the sources' memory
        self.trace("run %d: read %d bytes in %.3f s (%.2f GB/s)", self.runs, self.bytes_read, dt, rate)

    def _pack_next(self, clock: RunClock) -> None:
        """A source: pack the next staging round once every receiver reported the round that used its
        slot before (``consumed``), then say so (``packed``)."""
        if not self._rounds_to_pack() or self._late(first=True):
            return
        st, r = self.staging, self.packed
        st.pack(r)
        device_wait(st.buffer.device, clock, f"packing NIXL staging round {r}")
        self.store.put(self._key(f"{self.name}/packed"), (self.runs - 1) * len(st.rounds) + r + 1)
        self.packed += 1
        self.trace("run %d: staging round %d of %d packed", self.runs, r, len(st.rounds))

    def _late(self, first: bool) -> list[int]:
        """The receivers that have not reported the round whose slot the next round reuses (asked of the
        store where the last value seen is short; ``first``: stop at the first one)."""
        st = self.staging
        need = (self.runs - 1) * len(st.rounds) + self.packed - st.slots + 1
        late = []
        for rcv in self.receivers:
            if self.consumed.get(rcv, -1) < need:
                v = self.store.peek(self._key(f"{self.name}/consumed/{rcv}"))
                if isinstance(v, int) and not isinstance(v, bool):
                    self.consumed[rcv] = v
                if self.consumed.get(rcv, -1) < need:
                    late.append(rcv)
                    if first:
                        break
        return late

    def _packing(self) -> str:
        """A source's wait for its receivers (only the late ones are named)."""
        if not self._rounds_to_pack():
            return ""
        late, slot_round = self._late(first=False), self.packed - self.staging.slots
        return f"processes {late} reading staging round {slot_round} of process {self.proc} over NIXL"

    def _call(self, req: Request, fn, what: str) -> str:
        try:
            state = fn(req.handle)
        except Exception as e:  # noqa: BLE001 - NIXL's own errors (a peer gone): name the peer
            raise TransferError(
                f"NIXL {what} {req.nbytes} bytes ({req.descriptors} pieces) from process {req.peer} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        if state == "ERR":
            raise TransferError(f"NIXL {what} {req.nbytes} bytes from process {req.peer} failed (state ERR)")
        return state

    @staticmethod
    def _pending(flying: list[Request]) -> str:
        peers = ", ".join(f"process {p}" for p in sorted({r.peer for r in flying}))
        return f"NIXL reads of {sum(r.nbytes for r in flying)} bytes from {peers}"

    def close(self) -> None:
        """Release the requests, forget the remote agents, deregister memory and drop the agent. Idempotent."""
        if self._writer is not None:  # the last done write lands first
            self._writer.shutdown(wait=True)
            self._writer = None
        if self.delta is not None:  # and a source's last base updates
            self.delta.close()
        _release(self.requests)
        self.requests = []
        if self.agent is None or self.shared is None:
            return
        for agent in self.sources.values():
            self.shared.drop_remote(agent)
        for reg in self.registered:
            self.agent.deregister_memory(reg)
        self.shared.release()
        self.registered, self.sources, self.agent, self.shared, self.tensors = [], {}, None, None, []


def _release(requests: list[Request]) -> None:
    """Release the handles of ``requests`` (one left mid-flight by an aborted refit too)."""
    for req in requests:
        try:
            req.handle.release()
        except Exception:  # noqa: BLE001, S110 - a request left mid-flight by an aborted refit
            pass
