"""Runs one process's share of a Plan.

Setup (once): check and bind this process's local tensors to the plan's
pieces, allocate the staging ring (at most ``num_buffers`` buffers, each no
larger than the largest packed message), exchange CUDA IPC handles for IPC
links, precompute every step's ops.

Run (each refit):
  1. local copies (source and destination in this process);
  2. IPC pulls (receiver side) between two barriers: the first says every
     source's weights are final, the second that every pull has finished;
  3. P2P steps: per step, pack outgoing buckets into ring buffers, post all
     of the step's sends and receives in one ``batch_isend_irecv``, unpack.
     On CUDA, packing runs on a pack stream and unpacking on an unpack
     stream, ordered by events, so packing step k+1 and unpacking step k-1
     overlap the transfer of step k; a ring buffer is reused only after the
     event of its last use. Direct pieces (contiguous on both sides) go from
     the source tensor straight into the destination tensor.
Works with gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from refit.errors import ChecksumError, DeadlineExceeded
from refit.layout import Box, box_relative, box_shape, box_slices
from refit.plan import Plan, PlanError
from refit.plan.schedule import ipc_stages
from refit.transport.ipc import HostBarrier, IpcPuller, export_handles, import_handles


@dataclass
class _Op:
    peer: int
    tag: int
    tensor: torch.Tensor  # what is sent or received into (a view or a buffer slice)
    pack: list[tuple[torch.Tensor, torch.Tensor]]  # (buffer view, tensor view)
    slot: int = -1  # ring buffer index (packed only)
    names: tuple[str, ...] = ()  # the tensors whose pieces this message carries
    step: int = 0
    sum: torch.Tensor | None = None  # verify mode: [checksum, bytes] sent beside the message
    got: torch.Tensor | None = None  # verify mode, CUDA receivers: the received message's checksum

    def what(self) -> str:
        more = f" and {len(self.names) - 3} more" if len(self.names) > 3 else ""
        return f"step {self.step}, tensors {', '.join(self.names[:3])}{more}"


_SUM_TAG = 1 << 20  # checksum messages use the message's tag plus this


def checksum(t: torch.Tensor) -> torch.Tensor:
    """[wrapping int64 sum of the bytes as 8-byte words (and the tail bytes), byte count]: any
    changed word changes the sum. On the tensor's device; no host sync."""
    b = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
    n8 = b.numel() // 8 * 8
    words = b[:n8].view(torch.int64).sum() if n8 and b.data_ptr() % 8 == 0 else b[:n8].to(torch.int64).sum()
    tail = b[n8:].to(torch.int64).sum()
    return torch.stack([words + tail, torch.tensor(b.numel(), dtype=torch.int64, device=b.device)])


@dataclass
class _Step:
    sends: list[_Op] = field(default_factory=list)
    recvs: list[_Op] = field(default_factory=list)


@dataclass(frozen=True)
class RunStats:
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    seconds: float


def _check_local(side: str, rank: int, layout, tensors: Mapping[str, torch.Tensor]) -> dict[str, Box]:
    """Every tensor this rank holds exists with the layout's local shape and dtype."""
    boxes: dict[str, Box] = {}
    for t, box in layout.local_tensors(rank):
        if t.name not in tensors:
            raise PlanError(f"{side} rank {rank}: local tensor {t.name!r} is missing")
        x = tensors[t.name]
        if tuple(x.shape) != box_shape(box):
            raise PlanError(
                f"{side} rank {rank}: local tensor {t.name!r} has shape {list(x.shape)}, the layout expects {list(box_shape(box))}"
            )
        if x.dtype != t.dtype:
            raise PlanError(
                f"{side} rank {rank}: local tensor {t.name!r} has dtype {x.dtype}, the layout expects {t.dtype}"
            )
        boxes[t.name] = box
    return boxes


def validate_local(
    plan: Plan,
    proc: int,
    src_tensors: Mapping[str, torch.Tensor] | None,
    dst_tensors: Mapping[str, torch.Tensor] | None,
) -> None:
    """Everything about this process's tensors that could fail the run, checked before any exchange."""
    if proc in plan.procs.src:
        _check_local("source", plan.procs.src.index(proc), plan.src_layout, src_tensors or {})
    if proc in plan.procs.dst:
        _check_local("destination", plan.procs.dst.index(proc), plan.dst_layout, dst_tensors or {})
    for m in plan.messages:
        for side, rank, rank_proc, tensors, layout in (
            ("source", m.src, plan.procs.src[m.src], src_tensors, plan.src_layout),
            ("destination", m.dst, plan.procs.dst[m.dst], dst_tensors, plan.dst_layout),
        ):
            if rank_proc != proc:
                continue
            if m.transport == "ipc":
                for p in m.pieces:
                    dev = tensors[p.tensor].device
                    if dev.type != "cuda":
                        raise PlanError(f"{side} tensor {p.tensor!r} is on {dev}; CUDA IPC needs CUDA tensors")
            elif m.direct:  # sent or received as it lies: the piece must be one dense run in memory
                p = m.pieces[0]
                view = tensors[p.tensor][box_slices(box_relative(p.box, layout[p.tensor].box(rank)))]
                if not view.is_contiguous():
                    raise PlanError(
                        f"{side} rank {rank}: local tensor {p.tensor!r} (strides {list(tensors[p.tensor].stride())}) "
                        f"is not laid out densely, so its piece {[list(b) for b in p.box]} cannot go on the wire "
                        "as it lies; pass contiguous tensors"
                    )


class _Waiter:
    """A daemon thread that blocks in ``Work.wait()`` for the executor's thread, which keeps the clock."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="refit-waiter", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            works, done = item
            for i, w in enumerate(works):
                try:
                    w.wait()
                except BaseException as e:  # noqa: BLE001 - handed to the executor's thread
                    done.error = (i, e)
                    break
            done.set()

    def submit(self, works: list) -> threading.Event:
        done = threading.Event()
        done.error = None
        self.queue.put((works, done))
        return done

    def stop(self) -> None:
        self.queue.put(None)


class Executor:
    def __init__(
        self,
        plan: Plan,
        proc: int,
        *,
        src_tensors: Mapping[str, torch.Tensor] | None = None,
        dst_tensors: Mapping[str, torch.Tensor] | None = None,
        group: dist.ProcessGroup | None = None,
        sync_group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        store: dist.Store | None = None,
        name: str = "refit",
        timeout_s: float = 120.0,
        standalone: bool = False,
        copy_streams: int = 2,
        cuda_graph: bool = True,
        verify: bool = False,
        stages: int = 1,
        prepare: Callable[[set[str] | None], None] | None = None,
        tag_base: int = 0,
    ) -> None:
        """``tag_base``: added to every P2P tag (an executor replacing a failed one on the same
        group uses a fresh range, so a receive left posted by the failed one never matches);
        ``copy_streams``: CUDA IPC pulls spread over this many streams per source GPU;
        ``cuda_graph``: IPC pulls recorded into a CUDA graph at setup, replayed per refit;
        ``verify``: checksums beside every message, checked by the receiver.
        ``prepare(names)``: run on this process before its tensors ``names`` are read (``None``:
        all), e.g. FP8 quantization of a trainer rank's shards.
        ``stages``: a plan whose links are all CUDA IPC is pulled in this many stages (the
        source tensors in plan order, cut into runs of about equal bytes; ``ipc_stages``):
        stage i is pulled while the sources prepare stage i + 1, so preparation overlaps the
        transfer except for the first stage. Other plans prepare everything first.
        ``standalone``: ``group`` is a ProcessGroup object made outside torch.distributed's
        world (e.g. ``ProcessGroupGloo(store, rank, size)`` inside a vLLM worker, whose world is
        vLLM's); peers are its ranks and ops go straight to it."""
        self.plan = plan
        self.proc = proc
        self.group = group
        self.standalone = standalone
        if standalone and group is None:
            raise PlanError("standalone=True needs the ProcessGroup object as group")
        self.sync_group = sync_group
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.src_rank = plan.procs.src.index(proc) if proc in plan.procs.src else None
        self.dst_rank = plan.procs.dst.index(proc) if proc in plan.procs.dst else None
        src_boxes = (
            _check_local("source", self.src_rank, plan.src_layout, src_tensors or {})
            if self.src_rank is not None
            else {}
        )
        dst_boxes = (
            _check_local("destination", self.dst_rank, plan.dst_layout, dst_tensors or {})
            if self.dst_rank is not None
            else {}
        )

        def src_view(name: str, box: Box, tensors=src_tensors, boxes=src_boxes) -> torch.Tensor:
            return tensors[name][box_slices(box_relative(box, boxes[name]))]

        def dst_view(name: str, box: Box) -> torch.Tensor:
            return dst_tensors[name][box_slices(box_relative(box, dst_boxes[name]))]

        p2p = [m for m in plan.messages if m.transport == "p2p"]
        sends = [m for m in p2p if plan.procs.src[m.src] == proc]
        recvs = [m for m in p2p if plan.procs.dst[m.dst] == proc]
        mine = sorted((m for m in sends + recvs if not m.direct), key=lambda m: (m.step, m.src, m.dst))
        n_buf = min(plan.num_buffers, len(mine))
        buf_len = max((m.nbytes for m in mine), default=0)
        self.buffers = [torch.empty(buf_len, dtype=torch.uint8, device=self.device) for _ in range(n_buf)]
        self.staging_bytes = n_buf * buf_len
        slot_of = {id(m): i % max(n_buf, 1) for i, m in enumerate(mine)}

        self.steps = [_Step() for _ in range(plan.num_steps)]
        tag_of: dict[tuple[int, int, int], int] = defaultdict(int)
        for is_send, msgs in ((True, sends), (False, recvs)):
            for m in msgs:
                peer = plan.procs.dst[m.dst] if is_send else plan.procs.src[m.src]
                key = (m.step, m.src, m.dst)
                tag = tag_base + tag_of[key]
                tag_of[key] += 1
                view = src_view if is_send else dst_view
                names = tuple(dict.fromkeys(p.tensor for p in m.pieces))
                if m.direct:
                    p = m.pieces[0]
                    op = _Op(peer, tag, view(p.tensor, p.box), [], names=names, step=m.step)
                else:
                    slot = slot_of[id(m)]
                    buf = self.buffers[slot]
                    pack = []
                    for p, off in zip(m.pieces, m.offsets):
                        tv = view(p.tensor, p.box)
                        pack.append((buf[off : off + p.nbytes].view(tv.dtype).view(tv.shape), tv))
                    op = _Op(peer, tag, buf[: m.nbytes], pack, slot, names=names, step=m.step)
                (self.steps[m.step].sends if is_send else self.steps[m.step].recvs).append(op)
        self.steps = [s for s in self.steps if s.sends or s.recvs]
        # verify mode (off by default): a checksum travels beside every message
        self.verify = verify
        if verify:
            for step in self.steps:
                for op in step.sends + step.recvs:
                    op.sum = torch.zeros(2, dtype=torch.int64, device=self.device)
                for op in step.recvs:
                    op.got = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.ipc_pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # verify mode, IPC receivers
        # deadline and fault injection, set per run by the caller (Peer)
        self.deadline: float | None = None
        self.check_abort: Callable[[], None] | None = None
        self.fault: Callable[[str, dict], None] | None = None  # fault("where", info): tests and `refit verify --inject`
        self._waiter: _Waiter | None = None
        self.local = [(dst_view(p.tensor, p.box), src_view(p.tensor, p.box)) for p in plan.local_of(proc)]

        # CUDA IPC: sources publish handles, receivers map them (once)
        ipc = [m for m in plan.messages if m.transport == "ipc"]
        self.uses_ipc = bool(ipc)
        self.puller: IpcPuller | None = None  # the one puller of a single-stage pull (profiling)
        self.pullers: list[IpcPuller | None] = []  # per stage
        self.prepare = prepare
        all_ipc = bool(ipc) and all(m.transport == "ipc" for m in plan.messages)
        self.stage_names = ipc_stages(plan, stages if all_ipc else 1)
        stage_of = {n: i for i, names in enumerate(self.stage_names) for n in names}
        if ipc:
            if store is None:
                raise PlanError("the plan has CUDA IPC links but no rendezvous store was given")
            exported = sorted({p.tensor for m in ipc if plan.procs.src[m.src] == proc for p in m.pieces})
            if exported:
                export_handles(store, f"{name}/ipc/{proc}", {n: src_tensors[n] for n in exported})
            my_pulls = [m for m in ipc if plan.procs.dst[m.dst] == proc]
            mapped: dict[int, dict[str, torch.Tensor]] = {}
            pairs = [([], []) for _ in self.stage_names]  # per stage: (same GPU, peer GPU)
            for m in my_pulls:
                sp = plan.procs.src[m.src]
                if sp not in mapped:
                    mapped[sp] = import_handles(store, f"{name}/ipc/{sp}", timeout_s)
                p = m.pieces[0]
                s_box = plan.src_layout[p.tensor].box(m.src)
                sv = mapped[sp][p.tensor][box_slices(box_relative(p.box, s_box))]
                pair = (dst_view(p.tensor, p.box), sv)
                same, peer = pairs[stage_of[p.tensor]]
                (same if plan.procs.same_device(sp, proc) else peer).append(pair)
                if verify:
                    self.ipc_pairs.append((p.tensor, *pair))
            for same, peer in pairs:
                puller = IpcPuller(self.device, same, peer, streams_per_lane=copy_streams) if same or peer else None
                if puller is not None and cuda_graph:
                    try:
                        puller.capture()
                    except RuntimeError as e:  # speed only: the same copies are issued one by one
                        warnings.warn(
                            f"refit: rank {proc}: recording the IPC pull into a CUDA graph failed ({e}); "
                            "issuing its copies one by one (set TransferConfig.cuda_graph=False to skip)"
                        )
                        puller.graph = None
                self.pullers.append(puller)
            self.puller = next((pl for pl in self.pullers if pl is not None), None) if len(self.pullers) == 1 else None
            self._mapped = mapped  # keep the mappings alive
        # a plan whose links are all IPC (one host) synchronizes through shared memory
        self.host_barrier: HostBarrier | None = None
        if ipc and all(m.transport == "ipc" for m in plan.messages):
            members = sorted({*plan.procs.src, *plan.procs.dst})
            key = f"{name}/barrier"
            if members.index(proc) == 0:
                store.set(key, f"refit_{uuid.uuid4().hex[:16]}")
            store.set_timeout(timedelta(seconds=timeout_s))
            seg = store.get(key).decode()
            self.host_barrier = HostBarrier(seg, members.index(proc), len(members), timeout_s)
        if self.cuda:
            self.pack_stream = torch.cuda.Stream(self.device)
            self.unpack_stream = torch.cuda.Stream(self.device)
            self.free = [None] * len(self.buffers)  # event: ring buffer's last use finished

        self.bytes_sent = sum(sum(p.nbytes for p in m.pieces) for m in plan.messages if plan.procs.src[m.src] == proc)
        self.bytes_received = sum(
            sum(p.nbytes for p in m.pieces) for m in plan.messages if plan.procs.dst[m.dst] == proc
        )
        self.bytes_local = sum(p.nbytes for p in plan.local_of(proc))

    # ------------------------------------------------------------------ run
    def _barrier(self) -> None:
        if self.host_barrier is not None:
            self.host_barrier.wait(self._left())
        else:
            dist.barrier(group=self.sync_group)

    def _left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _watch(self, finished: Callable[[], bool], pending: Callable[[], str]) -> None:
        """Poll ``finished`` until it is true, giving up at the deadline and checking the side
        channel every 20 ms for another process's abort (short waits spin, longer ones yield)."""
        start = time.monotonic()
        next_check = start + 0.02
        while not finished():
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline:
                raise DeadlineExceeded(f"{pending()} still pending at the deadline")
            if self.check_abort is not None and now >= next_check:
                self.check_abort()
                next_check = now + 0.02
            if now - start > 0.05:
                time.sleep(0.0001)

    def _wait(self, works: list, ops: list[_Op], what: str) -> None:
        """Wait for ``works`` (one per op, in order) under ``_watch``; a failed work names its peer.

        A blocked gloo wait cannot be interrupted (and gloo's own wait-with-timeout breaks the
        pair), so a waiter thread blocks in ``wait()`` while this thread keeps the clock; past
        the deadline the waiter stays blocked until the group's own timeout, and the refit is
        aborted (its Peer is then unusable anyway)."""
        if self.deadline is None and self.check_abort is None:
            for w in works:
                w.wait()
            return
        if self._waiter is None:
            self._waiter = _Waiter()
        done = self._waiter.submit(works)
        peers = ", ".join(f"process {p}" for p in sorted({op.peer for op in ops}))
        self._watch(lambda: done.wait(0.001), lambda: f"{what} with {peers} ({ops[0].what() if ops else '-'})")
        if done.error is not None:
            i, e = done.error
            raise RuntimeError(f"{what} with process {ops[i].peer} ({ops[i].what()}) failed: {e}") from e

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None
        if self.host_barrier is not None:
            self.host_barrier.close()
            self.host_barrier = None

    def _run_steps_cpu(self) -> None:
        for step in self.steps:
            for op in step.sends:
                for bv, tv in op.pack:
                    bv.copy_(tv)
                if op.sum is not None:
                    op.sum.copy_(checksum(op.tensor))
            if self.fault is not None:
                self.fault("step", {"step": step, "executor": self})
            ops = step.sends + step.recvs
            self._wait(self._post(step), ops, "transfer")
            if self.verify:
                self._wait(self._post(step, sums=True), ops, "checksum exchange")
            if self.fault is not None:
                self.fault("received", {"step": step, "executor": self})
            self._check_sums(step)
            for op in step.recvs:
                for bv, tv in op.pack:
                    tv.copy_(bv)

    def _check_sums(self, step: _Step) -> None:
        if not self.verify:
            return
        for op in step.recvs:
            got = (op.got if self.cuda else checksum(op.tensor)).tolist()
            want = op.sum.tolist()
            if got != want:
                raise ChecksumError(
                    f"checksum mismatch in the message from process {op.peer} ({op.what()}): sent {want[0]} over {want[1]} bytes, "
                    f"received {got[0]} over {got[1]} bytes"
                )

    def _check_ipc_sums(self) -> None:
        for name, dst, src in self.ipc_pairs:
            got, want = checksum(dst).tolist(), checksum(src).tolist()
            if got != want:
                raise ChecksumError(
                    f"checksum mismatch in tensor {name!r} pulled over CUDA IPC: "
                    f"source {want[0]}, received {got[0]} ({want[1]} bytes)"
                )

    def _post(self, step: _Step, sums: bool = False) -> list:
        """Post every send and receive of a step (or, ``sums``, of their checksums); return the works."""

        def msgs(ops: list[_Op]) -> list[tuple[int, torch.Tensor, int]]:
            return [(op.peer, op.sum, op.tag + _SUM_TAG) if sums else (op.peer, op.tensor, op.tag) for op in ops]

        sends, recvs = msgs(step.sends), msgs(step.recvs)
        if self.standalone:
            return [self.group.send([t], p, tag) for p, t, tag in sends] + [
                self.group.recv([t], p, tag) for p, t, tag in recvs
            ]
        return dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, t, p, self.group, tag) for p, t, tag in sends]
            + [dist.P2POp(dist.irecv, t, p, self.group, tag) for p, t, tag in recvs]
        )

    def _run_steps_cuda(self) -> None:
        main = torch.cuda.current_stream(self.device)
        self.pack_stream.wait_stream(main)  # the source weights are final
        for step in self.steps:
            packed = [op for op in step.sends + step.recvs if op.pack]
            with torch.cuda.stream(self.pack_stream):
                for op in packed:
                    if self.free[op.slot] is not None:
                        self.pack_stream.wait_event(self.free[op.slot])
                for op in step.sends:
                    for bv, tv in op.pack:
                        bv.copy_(tv, non_blocking=True)
                    if op.sum is not None:
                        op.sum.copy_(checksum(op.tensor))
            main.wait_stream(self.pack_stream)
            if self.fault is not None:
                self.fault("step", {"step": step, "executor": self})
            for w in self._post(step):
                w.wait()  # the main stream waits for NCCL; the host does not
            if self.verify:
                for w in self._post(step, sums=True):
                    w.wait()
                for op in step.recvs:
                    op.got.copy_(checksum(op.tensor))
            done = torch.cuda.Event()
            done.record(main)
            with torch.cuda.stream(self.unpack_stream):
                self.unpack_stream.wait_event(done)
                for op in step.recvs:
                    for bv, tv in op.pack:
                        tv.copy_(bv, non_blocking=True)
                free = torch.cuda.Event()
                free.record(self.unpack_stream)
            for op in packed:
                self.free[op.slot] = free
        main.wait_stream(self.unpack_stream)

    def _sync_device(self) -> None:
        """Wait for this GPU's work until the deadline (the host never blocks inside CUDA past it)."""
        if self.deadline is None and self.check_abort is None:
            torch.cuda.synchronize(self.device)
            return
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._watch(ev.query, lambda: "GPU work of the refit (NCCL transfers or IPC pulls)")

    def _prepare(self, names: set[str] | None) -> None:
        if self.prepare is not None and self.src_rank is not None:
            with torch.no_grad():
                self.prepare(names)

    def run(self, deadline: float | None = None) -> RunStats:
        """One refit. ``deadline`` (``time.monotonic()`` value): every blocking wait gives up then."""
        t0 = time.perf_counter()
        self.deadline = deadline
        staged = len(self.stage_names) > 1
        if not staged:
            self._prepare(None)
        if self.uses_ipc:
            for i, names in enumerate(self.stage_names):
                if staged:
                    self._prepare(names)
                if self.cuda:
                    self._sync_device()
                self._barrier()  # every source's tensors of this stage are final
                if self.pullers and self.pullers[i] is not None:
                    self.pullers[i].pull()  # runs on the GPU while the sources prepare the next stage
        for dst, src in self.local:
            dst.copy_(src, non_blocking=True)
        if self.cuda:
            self._run_steps_cuda()
            self._sync_device()
            for step in self.steps:
                self._check_sums(step)
            if self.ipc_pairs:
                self._check_ipc_sums()
        else:
            self._run_steps_cpu()
        if self.uses_ipc:
            self._barrier()  # every pull is done: sources may change their weights again
        return RunStats(self.bytes_sent, self.bytes_received, self.bytes_local, time.perf_counter() - t0)
