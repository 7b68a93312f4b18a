"""Runs one process's share of a Plan.

Setup (once, named steps): bind this process's local tensors to the plan's pieces (``refit.binding.bind_local``,
checked before pre-flight); build its P2P steps (``refit.transport.p2p.P2PSchedule``: the staging ring of at most
``num_buffers`` buffers, each no larger than the largest packed message, and every step's ops); for a plan with CUDA
IPC links, exchange handles and capture the pulls (``refit.transport.ipc.IpcLink``); for a plan with NIXL links,
register memory, exchange sealed records and prepare the reads (``refit.transport.nixl.NixlLink``).

Run (each refit):
  1. prepare: the source's tensors are made final (e.g. FP8 quantization, except what receivers quantize on
     their pulls: ``ipc_quant``); all-IPC plans in ``config.stages`` stages, each just before its pull;
  2. NIXL sources announce that their tensors are final (through the store); IPC pulls (receiver side), one per
     stage, each after a barrier saying every source's tensors of that stage are final; they run on the GPU meanwhile
     (with deltas, sources first find and stage what changed, receivers scatter it: ``refit.transport.ipc_delta``);
  3. local copies (source and destination in this process);
  4. P2P steps: per step, pack outgoing buckets into ring buffers, post all of the step's sends and receives in one
     ``batch_isend_irecv``, unpack; on CPU a step's receives go out during the step before where they touch nothing
     it uses; on CUDA, pipelined over pack and unpack streams (``refit.transport.p2p``);
  5. on CUDA, enqueue the IPC checksums' last sums, wait for the device (within the deadline), then read
     the checksum verdicts; NIXL receivers read their pieces, NIXL sources wait until their receivers are done;
  6. with IPC links, a last barrier: every pull is done, sources (who alone wait there) may change their weights.
Works with gloo (CPU) and NCCL (GPU)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from refit.binding import LocalTensors
from refit.comms import Comms
from refit.config import TransferConfig
from refit.cudart import current_stream, device_index, free_stream, idle, join_events, joined, private_stream
from refit.delta.schedule import DeltaSchedule, DeltaStats
from refit.plan import Plan
from refit.plan.schedule import ipc_stages
from refit.transport.clock import RunClock
from refit.transport.ipc import IpcLink, IpcPuller
from refit.transport.nixl import NixlLink
from refit.transport.p2p import P2PSchedule, _Step, check_backend

__all__ = ["Comms", "Executor", "FaultHook", "RunStats"]

FaultHook = Callable[[str, dict], None]
"""``fault(where, info)`` (tests and ``refit verify --inject``): ``where`` is "step" (a P2P step's sends
are packed, none posted yet; on CPU its receives may be, during the step before: ``recv_ahead``), on CPU
"received" (its messages arrived, not yet checked or unpacked), or "nixl-announce" (a NIXL source's tensors
are final and its checksums taken; nothing packed or announced yet); ``info`` holds ``"executor"`` and, for
P2P steps, ``"step"`` (its ops: ``sends``, ``recvs``)."""


@dataclass(frozen=True)
class RunStats:
    """What one ``Executor.run`` moved on this process: link bytes sent and received (P2P and IPC),
    bytes copied inside the process, and the run's wall seconds."""

    bytes_sent: int
    bytes_received: int
    bytes_local: int
    seconds: float
    delta: DeltaStats | None = None  # delta mode: P2P bytes actually on the wire and encodings chosen


class Executor:
    """Moves one process's share of a plan's bytes, once per refit.

    Lifecycle: built on every process of the plan, after pre-flight (collective: IPC handles go through the store);
    ``run(deadline, check_abort)`` once per refit, in the same order on every process; ``close()`` stops the waiter
    thread and the shared-memory barrier. Must agree on every process: the plan (digest), ``tag_base``,
    ``config.stages`` and ``config.checksums`` (``Peer``'s pre-flight checks them; a direct user who skips it sees a
    mismatch as a wait until the deadline, not an error). Between calls: the local tensors are changed in place only
    (the views bound at setup stay valid); a source's tensors must be final when ``run`` begins (or made so by
    ``prepare``).

    ``local``: this process's tensors, checked and bound (``bind_local``). ``config``: the refit's
    ``TransferConfig`` (copy streams, CUDA graph, checksums, stages, store namespace, setup timeout).
    ``prepare(names)``: run on a source process before its tensors ``names`` are read (``None``: all),
    e.g. FP8 quantization of a trainer rank's shards; an all-IPC plan with ``config.stages`` > 1 is
    pulled in stages (``ipc_stages``): stage i is pulled while the sources prepare stage i + 1, so
    preparation overlaps the transfer except for the first stage. Other plans prepare everything first.
    ``tag_base``: added to every P2P tag (an executor replacing a failed one on the same group uses a
    fresh range, so a receive left posted by the failed one never matches).
    ``stamps``: None, or a list each run appends ``(phase, time.perf_counter())`` to at each phase (profiling:
    ``refit bench`` prints their gaps under ``REFIT_BENCH_PROFILE=1``).
    """

    def __init__(
        self,
        plan: Plan,
        proc: int,
        *,
        local: LocalTensors,
        config: TransferConfig,
        comms: Comms = Comms(),
        device: torch.device | str = "cpu",
        prepare: Callable[[set[str] | None], None] | None = None,
        tag_base: int = 0,
    ) -> None:
        self.plan, self.proc, self.comms, self.prepare = plan, proc, comms, prepare
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.is_source = local.src_rank is not None
        check_backend(plan, proc, self.device, comms.group, comms.standalone)
        self.p2p = P2PSchedule(
            plan, proc, local, self.device, config, tag_base, group=comms.group, standalone=comms.standalone
        )
        self.delta = DeltaSchedule(self.p2p, plan, proc, local, config) if DeltaSchedule.wanted(plan, config) else None
        self.local = [(local.dst_view(p.tensor, p.box), local.src_view(p.tensor, p.box)) for p in plan.local_of(proc)]
        uses_ipc, uses_nixl = any(m.transport == "ipc" for m in plan.messages), "nixl" in plan.transports_of(proc)
        self.ipc = IpcLink.open(plan, proc, local, comms.store, config, self.device, prepare) if uses_ipc else None
        self.nixl = NixlLink.open(plan, proc, local, comms.store, config) if uses_nixl else None
        self.bytes_sent, self.bytes_received = plan.link_bytes_of(proc)
        self.bytes_local = sum(p.nbytes for p in plan.local_of(proc))
        # every refit's device work runs on this stream, never on the caller's: an engine generating on its own
        # stream while a version is staged is not queued behind the pulls, nor waited for beyond the pass in flight
        self.stream = private_stream(self.device) if self.cuda else None
        # a process that only serves IPC pulls queues nothing after its last stage barrier: no events, no sync
        self.works_on_device = bool(self.p2p.steps or self.local or (self.ipc is not None and self.ipc.pulls_here))
        # no device work (an IPC source without ``prepare``): no join (20-100 us of host), one wait on the caller
        self.joins = self.works_on_device or prepare is not None or self.nixl is not None or self.delta is not None
        # what every refit reads, fixed at setup: the stages, the names it prepares, the event a bounded wait polls
        self._stage_names = self.ipc.stage_names if self.ipc is not None else ipc_stages(plan, 1)
        self._unskipped = frozenset(t.name for t in plan.src_layout) - (self.ipc.skipped if self.ipc else set())
        self._done, self._join = (torch.cuda.Event(), join_events()) if self.cuda else (None, None)
        self._index, self._settled = device_index(self.device), False  # settled: the run waited for all it queued
        self.stamps: list[tuple[str, float]] | None = None  # a list: each run's phases are stamped into it

    # ------------------------------------------------------------ what setup built
    @property
    def steps(self) -> list[_Step]:
        """This process's P2P steps (ops per step), in run order."""
        return self.p2p.steps

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging ring (packed P2P messages)."""
        return self.p2p.ring.staging_bytes

    @property
    def delta_base_bytes(self) -> int:
        """Bytes of the delta base this process keeps (``TransferConfig.delta``; 0 when off or not a source)."""
        return self.delta.base.nbytes if self.delta is not None and self.delta.base is not None else 0

    @property
    def stage_names(self) -> list[set[str]]:
        """The source tensors of each IPC pull stage (one stage, all names, without IPC)."""
        return self._stage_names

    @property
    def puller(self) -> IpcPuller | None:
        """The one puller of a single-stage IPC pull (profiling), else None."""
        return self.ipc.puller if self.ipc is not None else None

    # ------------------------------------------------------------------ run
    def run(
        self,
        deadline: float | None = None,
        check_abort: Callable[[], None] | None = None,
        fault_hook: FaultHook | None = None,
        *,
        version: int = 0,
        held: dict[int, int | None] | None = None,
    ) -> RunStats:
        """One refit (the module docstring's phases). ``deadline`` (``time.monotonic()`` value): every
        blocking wait gives up then (``DeadlineExceeded``); ``check_abort()``: polled every 20 ms
        while waiting, raises if another process aborted the refit; ``fault_hook``: see ``FaultHook``.
        Delta mode: ``version`` is the one being sent and ``held`` the version each P2P peer (and this
        process) holds (``DeltaSchedule.run``; no fault hook there).

        On CUDA the work runs on the executor's own stream (``self.stream``): it first waits for what the
        caller's current stream has queued (the source's final weights, the last writes to a destination),
        and when it returns the caller's stream is ordered after it."""
        with self.on_stream() if self.joins else contextlib.nullcontext():
            return self._run(deadline, check_abort, fault_hook, version, held)

    def on_stream(self):
        """``joined(self.stream)``: device work inside runs on the executor's stream, ordered after the
        caller's stream and before what the caller queues next (on CPU: nothing). ``run`` uses it, and so
        does work on what a run left behind (the delta base's deferred updates read the live source
        tensors: the trainer's next step must come after them)."""
        self._settled = False
        if self.stream is None:
            return contextlib.nullcontext()
        return joined(self.stream, self.device, self._join, lambda: self._settled)

    def _run(
        self,
        deadline: float | None,
        check_abort: Callable[[], None] | None,
        fault_hook: FaultHook | None,
        version: int,
        held: dict[int, int | None] | None,
    ) -> RunStats:
        t0 = time.perf_counter()
        self._stamp("start", t0)
        clock = RunClock(deadline, check_abort)
        staged = len(self._stage_names) > 1
        if not staged:
            self._prepare(None)
        if self.nixl is not None:
            if self.cuda:  # a source's tensors are final, a receiver's free of pending writes (UCX's own streams)
                self._sync_device(clock)
            self.nixl.start(clock, self._nixl_fault(fault_hook), version, held)
        if self.ipc is not None:
            self._pull_ipc(clock, staged, version, (held or {}).get(self.proc))
        for dst, src in self.local:
            dst.copy_(src, non_blocking=True)
        fault = self._fault(fault_hook)
        delta = self.delta.run(clock, version, held or {}) if self.delta is not None else None
        if delta is not None:
            if self.cuda:
                self._sync_device(clock)
        elif self.cuda and self.works_on_device:
            if self.p2p.steps:  # nothing to order otherwise (an IPC receiver): no stream joins
                self.p2p.run_cuda(fault)
            if self.ipc is not None:
                self.ipc.enqueue_sums()  # behind the pulls, before the wait: no idle gap
            self._stamp("enqueued")
            self._sync_device(clock)
            self._settled = self.nixl is None  # NIXL's finish may queue more (its reads, a delta's scatter)
            self._stamp("device done")
            self.p2p.check_sums()
        else:
            self.p2p.run_cpu(clock, fault)
        if self.ipc is not None:  # its checksums' verdicts, or its delta scatter's index check
            self.ipc.check_sums()
        self._stamp("moved")
        if self.nixl is not None:
            delta = self.nixl.finish(clock, delta)
            self._stamp("nixl read")
        if self.ipc is not None:  # every pull is done: sources may change their weights again (only they wait)
            self._barrier(clock, wait=self.is_source)
            delta = self.ipc.finish(version, delta)  # a delta source's base holds ``version`` from here on
            self._stamp("last barrier")
        sent, received = (delta.wire_bytes, delta.received_bytes) if delta else (self.bytes_sent, self.bytes_received)
        return RunStats(sent, received, self.bytes_local, time.perf_counter() - t0, delta)

    def close(self) -> None:
        for link in (self.p2p, self.ipc, self.nixl):
            if link is not None:
                link.close()
        free_stream(self.stream)
        self.stream = None

    def _pull_ipc(self, clock: RunClock, staged: bool, version: int, held: int | None) -> None:
        """Each stage: (prepare it,) every source's tensors of the stage are final (with deltas, found and staged
        first: ``IpcLink.begin``), then pull. Only a source waits for its device before the barrier (others read
        its tensors once it is passed); a receiver's pull is ordered after its own earlier work by its stream, so it
        does not wait: its next stage's pull queues behind the one in flight."""
        self.ipc.begin(version, held)
        for i, names in enumerate(self._stage_names):
            if staged:
                self._prepare(names)
            if self.cuda and self.is_source:
                self._sync_device(clock)
            self._stamp(f"stage {i} final")
            self._barrier(clock)  # every source's tensors of this stage are final
            self._stamp(f"stage {i} barrier")
            self.ipc.pull(i, self.stream)  # runs on the GPU while the sources prepare the next stage
            self._stamp(f"stage {i} pulled")

    def _prepare(self, names: set[str] | None) -> None:
        if self.ipc is not None and self.ipc.skipped:  # its receivers quantize those on their pulls
            names = self._unskipped if names is None else names - self.ipc.skipped
        if self.prepare is not None and self.is_source and names != set():
            with torch.no_grad():
                self.prepare(names)

    def _barrier(self, clock: RunClock, wait: bool = True) -> None:
        barrier = self.ipc.host_barrier if self.ipc is not None else None
        if barrier is not None:
            barrier.wait(clock.left(), clock.check_abort) if wait else barrier.arrive()
        else:
            dist.barrier(group=self.comms.sync_group)

    def _sync_device(self, clock: RunClock) -> None:
        """Wait for this GPU's work until the deadline (the host never blocks inside CUDA past it); the current
        stream only (an engine's passes on other streams are not waited for). Nothing pending: no GPU round trip."""
        stream = current_stream(self._index)
        if (done := idle(stream)) or not clock.bounded:
            return None if done else stream.synchronize()
        self._done.record(stream)
        clock.watch(self._done.query, lambda: "GPU work of the refit (NCCL transfers or IPC pulls)")

    def _stamp(self, what: str, at: float | None = None) -> None:
        """Profiling (``stamps`` set to a list): note when this run reached ``what`` (``time.perf_counter``)."""
        if self.stamps is not None:
            self.stamps.append((what, time.perf_counter() if at is None else at))

    def _nixl_fault(self, hook: FaultHook | None) -> Callable[[str], None] | None:
        return None if hook is None else lambda where: hook(where, {"executor": self})

    def _fault(self, hook: FaultHook | None) -> Callable[[str, _Step], None] | None:
        if hook is None:
            return None
        return lambda where, step: hook(where, {"step": step, "executor": self})
