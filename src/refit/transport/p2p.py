"""torch.distributed P2P: one process's send/receive steps of a plan, over gloo (CPU) or NCCL (GPU).

Setup (once, no communication): allocate the staging ring (``StagingRing``), build every step's ops
(peer, tag, the tensor on the wire, the (buffer view, tensor view) pairs to pack or unpack, ring slot;
``P2PSchedule``) from the plan's messages, tags and slots (``refit.plan.schedule``).

Per refit, per step: pack outgoing buckets into ring buffers, post all of the step's sends and receives
in one ``batch_isend_irecv`` (or, on a standalone group, its own ``send``/``recv``), unpack; on CPU a step's
receives are posted while the step before is in flight where they touch nothing it uses (``recv_ahead``). On CUDA,
packing runs on a pack stream and unpacking on an unpack stream, ordered by events, so packing step k+1
and unpacking step k-1 overlap the transfer of step k; a ring buffer is reused only after the event of
its last use. Direct pieces (contiguous on both sides) go from the source tensor straight into the
destination tensor. With checksums on, a [sum, bytes] message travels beside every message (tag plus
``SUM_TAG``) and the receiver compares (``MessageSums``).
"""

from __future__ import annotations

import bisect
import itertools
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.cudart import free_stream, private_stream
from refit.errors import ChecksumError, ConfigError
from refit.plan import Plan
from refit.plan.schedule import assign_slots, assign_tags, p2p_messages
from refit.transport.checksum import Piece, PieceSums, triton_enabled
from refit.transport.clock import RunClock

SUM_TAG = 1 << 20  # checksum messages use the message's tag plus this


@dataclass
class _Op:
    peer: int
    tag: int
    tensor: torch.Tensor  # what is sent or received into (a view or a buffer slice)
    pack: list[tuple[torch.Tensor, torch.Tensor]]  # (buffer view, tensor view)
    slot: int = -1  # ring buffer index (packed only)
    names: tuple[str, ...] = ()  # the tensors whose pieces this message carries
    step: int = 0
    sum: torch.Tensor | None = None  # checksum mode: [checksum, bytes] sent beside the message
    got: torch.Tensor | None = None  # checksum mode, receivers: the received message's checksum
    message: int = -1  # the index of this op's message in ``plan.messages``

    def what(self) -> str:
        more = f" and {len(self.names) - 3} more" if len(self.names) > 3 else ""
        return f"step {self.step}, tensors {', '.join(self.names[:3])}{more}"


@dataclass
class _Step:
    sends: list[_Op] = field(default_factory=list)
    recvs: list[_Op] = field(default_factory=list)
    pack_sums: PieceSums | None = None  # checksum mode: the sends' sums (on CUDA: fused with packing)
    unpack_sums: PieceSums | None = None  # checksum mode: the receives' sums (on CUDA: fused with unpacking)


FaultHook = Callable[[str, _Step], None]
"""``fault(where, step)``: called at "step" (sends packed, none posted; on CPU the receives may be: ``recv_ahead``)
and, on CPU, "received" (not yet checked)."""


class StagingRing:
    """The staging buffers of one process's packed P2P messages.

    ``min(num_buffers, packed messages)`` buffers, each as long as the largest packed message (so at
    most the plan's budget); ``slot_of[i]`` is the buffer of message ``plan.messages[i]``
    (``assign_slots``). Allocated once; reused every refit.
    """

    def __init__(self, plan: Plan, proc: int, device: torch.device) -> None:
        packed = [i for i in p2p_messages(plan, proc) if not plan.messages[i].direct]
        messages = [plan.messages[i] for i in packed]
        n_buf = min(plan.num_buffers, len(messages))
        buf_len = max((m.nbytes for m in messages), default=0)
        self.buffers = [torch.empty(buf_len, dtype=torch.uint8, device=device) for _ in range(n_buf)]
        self.staging_bytes = n_buf * buf_len
        self.slot_of = dict(zip(packed, assign_slots(messages, plan.num_buffers)))


def check_backend(
    plan: Plan, proc: int, device: torch.device, group: dist.ProcessGroup | None, standalone: bool
) -> None:
    """``ConfigError`` when this process would send or receive CUDA tensors over a gloo group (``group``, or
    the default group; ``standalone``: a ProcessGroup object outside torch.distributed's world). Gloo's
    send/recv reads host memory: the process would abort in gloo, not raise."""
    if device.type != "cuda" or not any(
        m.transport == "p2p" and proc in (plan.procs.src[m.src], plan.procs.dst[m.dst]) for m in plan.messages
    ):
        return
    group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    if group is None:
        return
    try:
        backend = str(dist.get_backend(group)) if not standalone else type(group).__name__.lower()
    except (RuntimeError, ValueError):
        return
    if "gloo" in backend and "nccl" not in backend:
        raise ConfigError(
            f"process {proc}: the plan sends CUDA tensors ({device}) over P2P, but the P2P group's backend is "
            f"{backend!r}; pass group= an NCCL group (e.g. dist.new_group(ranks, backend='nccl'))"
        )


def _nccl_blocking_wait() -> bool:
    """Whether NCCL's ``Work.wait()`` blocks the host (``TORCH_NCCL_BLOCKING_WAIT``, or its old name): then a
    thread must block in it while the executor's thread keeps the clock."""
    value = os.environ.get("TORCH_NCCL_BLOCKING_WAIT", os.environ.get("NCCL_BLOCKING_WAIT", "0"))
    return value.strip().lower() in ("1", "true", "yes", "on")


def _pending(what: str, ops: list[_Op]) -> str:
    """What a wait still waits for, for a deadline's error: the peers and the first op."""
    peers = ", ".join(f"process {p}" for p in sorted({op.peer for op in ops}))
    return f"{what} with {peers} ({ops[0].what() if ops else '-'})"


def _failed(what: str, op: _Op, e: BaseException) -> RuntimeError:
    """A failed work's error, naming its peer and op."""
    return RuntimeError(f"{what} with process {op.peer} ({op.what()}) failed: {e}")


class _Waiter:
    """A daemon thread that blocks in ``Work.wait()`` for the executor's thread, which keeps the clock."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.last: threading.Event | None = None  # the latest submission's event (set once it is done)
        self.thread = threading.Thread(target=self._loop, name="refit-waiter", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            works, done, stream = item
            for i, w in enumerate(works):
                try:
                    if stream is None:
                        w.wait()
                    else:  # NCCL: the submitter's stream (thread-local: this thread's own is the default) waits
                        with torch.cuda.stream(stream):
                            w.wait()
                except BaseException as e:  # noqa: BLE001 - handed to the executor's thread
                    done.error = (i, e)
                    break
            done.set()

    def submit(self, works: list, stream: torch.cuda.Stream | None = None) -> threading.Event:
        """Wait for ``works`` in the thread; ``stream``: the CUDA stream that must be ordered after them (the
        submitter's current stream: a ``Work.wait()`` orders the *calling thread's* current stream)."""
        done = threading.Event()
        done.error = None
        self.queue.put((works, done, stream))
        self.last = done
        return done

    def stop(self) -> None:
        """End the thread. Idle (every submitted wait returned): joined, gone when this returns. Still in a
        ``Work.wait()`` that an aborted refit left pending (it cannot be interrupted): not waited for; the
        daemon thread ends when that wait does, or with the process."""
        self.queue.put(None)
        if self.last is None or self.last.is_set():
            self.thread.join()


def _build_steps(plan: Plan, proc: int, local: LocalTensors, ring: StagingRing, tag_base: int) -> list[_Step]:
    """Every P2P op of ``proc``, per step (steps without ops dropped); sends and receives in plan order."""
    tags = assign_tags(plan, proc, tag_base)
    steps = [_Step() for _ in range(plan.num_steps)]
    for i in p2p_messages(plan, proc):
        m = plan.messages[i]
        is_send = plan.procs.src[m.src] == proc
        peer = plan.procs.dst[m.dst] if is_send else plan.procs.src[m.src]
        view = local.src_view if is_send else local.dst_view
        names = tuple(dict.fromkeys(p.tensor for p in m.pieces))
        if m.direct:
            p = m.pieces[0]
            op = _Op(peer, tags[i], view(p.tensor, p.box), [], names=names, step=m.step, message=i)
        else:
            slot = ring.slot_of[i]
            buf = ring.buffers[slot]
            pack = []
            for p, off in zip(m.pieces, m.offsets):
                tv = view(p.tensor, p.box)
                pack.append((buf[off : off + p.nbytes].view(tv.dtype).view(tv.shape), tv))
            op = _Op(peer, tags[i], buf[: m.nbytes], pack, slot, names=names, step=m.step, message=i)
        (steps[m.step].sends if is_send else steps[m.step].recvs).append(op)
    return [s for s in steps if s.sends or s.recvs]


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t``'s elements lie in: [first, past the last) (a strided view: its whole extent)."""
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def recv_ahead(steps: list[_Step]) -> list[bool]:
    """Per step, whether its receives may be posted while the step before is in flight (``run_cpu``): each
    receives into a ring buffer none of that step's ops uses, or (direct) into bytes none of its ops reads
    or writes (a direct op's tensor, a packed receive's unpacking targets). The first step: False."""
    return [False] + [bool(step.recvs) and _clear_of(prev, step.recvs) for prev, step in zip(steps, steps[1:])]


def _clear_of(prev: _Step, recvs: list[_Op]) -> bool:
    """Whether ``recvs`` touch no ring buffer and no byte that an op of ``prev`` uses (``recv_ahead``)."""
    slots = {op.slot for op in prev.sends + prev.recvs if op.pack}
    spans = sorted(
        [_span(op.tensor) for op in prev.sends + prev.recvs if not op.pack]
        + [_span(tv) for op in prev.recvs for _, tv in op.pack]
    )
    starts = [a for a, _ in spans]
    reach = list(itertools.accumulate((b for _, b in spans), max))  # the furthest end among spans[: i + 1]
    for op in recvs:
        if op.pack:
            if op.slot in slots:
                return False
            continue
        lo, hi = _span(op.tensor)
        i = bisect.bisect_left(starts, hi) - 1  # the last span starting before hi
        if i >= 0 and reach[i] > lo:
            return False
    return True


def _message_pieces(op: _Op, slot: int, fused: bool, outgoing: bool) -> list[Piece]:
    """``op``'s message as checksum pieces: each packed piece at its word offset in the ring buffer
    (fused: with its pack or unpack copy), or a direct message's tensor at 0."""
    if not op.pack:
        return [Piece(op.tensor, slot)]
    start, pieces = op.tensor.data_ptr(), []
    for bv, tv in op.pack:
        base = (bv.data_ptr() - start) // 8  # offsets are PIECE_ALIGN-ed
        if not fused:
            pieces.append(Piece(bv, slot, base=base))
        else:
            pieces.append(Piece(tv, slot, dst=bv, base=base) if outgoing else Piece(bv, slot, dst=tv, base=base))
    return pieces


class MessageSums:
    """Checksum mode of one process's P2P messages.

    A message's checksum is the sum (``refit.transport.checksum``) of its pieces' bytes, each at its
    word offset in the message (a direct message: one piece at 0); both sides leave out the padding
    between packed pieces. Senders keep ``[sum, bytes]`` per send in ``sent`` (sent beside the
    message, tag plus ``SUM_TAG``); receivers get the peer's row in ``want`` and compute theirs in
    ``got``. ``fused`` (CUDA with Triton): one kernel per step packs every outgoing piece into the ring
    buffer and sums it, one unpacks every received piece and sums what it read: packed bytes are
    read no extra time; a direct message is summed once on each side. Otherwise (CPU, or no Triton)
    the ring buffer is summed after packing and before unpacking.
    Lifecycle: built once with the steps (sets every op's ``sum`` / ``got`` and each step's
    ``pack_sums`` / ``unpack_sums``); per run the steps run them; ``check()`` compares every received
    message at once (CUDA: after the run finished on the device; one host sync).
    """

    def __init__(self, steps: list[_Step], device: torch.device, fused: bool) -> None:
        self.fused = fused
        sends = [op for st in steps for op in st.sends]
        self.recvs = [op for st in steps for op in st.recvs]
        self._row = {id(op): k for k, op in enumerate(self.recvs)}
        sent = torch.zeros(len(sends), 2, dtype=torch.int64)
        sent[:, 1] = torch.tensor([op.tensor.numel() * op.tensor.element_size() for op in sends], dtype=torch.int64)
        got = torch.zeros(len(self.recvs), 2, dtype=torch.int64)
        got[:, 1] = torch.tensor([op.tensor.numel() * op.tensor.element_size() for op in self.recvs])
        self.sent, self.got = sent.to(device), got.to(device)
        self.want = torch.zeros_like(self.got)
        for k, op in enumerate(sends):
            op.sum = self.sent[k]
        for k, op in enumerate(self.recvs):
            op.sum, op.got = self.want[k], self.got[k]
        slot = {id(op): 2 * k for k, op in enumerate(sends)} | {id(op): 2 * k for k, op in enumerate(self.recvs)}
        for st in steps:
            for ops, out, outgoing in ((st.sends, self.sent, True), (st.recvs, self.got, False)):
                pieces = [p for op in ops for p in _message_pieces(op, slot[id(op)], fused, outgoing)]
                sums = PieceSums(pieces, out.view(-1), use_triton=fused) if pieces else None
                if outgoing:
                    st.pack_sums = sums
                else:
                    st.unpack_sums = sums

    def check(self, ops: list[_Op] | None = None) -> None:
        """Every received message in ``ops`` (default: all) against its sender's sum; one host read."""
        idx = [self._row[id(op)] for op in ops] if ops is not None else None
        got, want = (self.got, self.want) if idx is None else (self.got[idx], self.want[idx])
        if not got.numel():
            return
        bad = (got != want).any(1)
        flag, i = torch.stack([bad.any().to(torch.int64), torch.argmax(bad.to(torch.int32)).to(torch.int64)]).tolist()
        if flag:
            op = self.recvs[i if idx is None else idx[i]]
            (g, gn), (w, wn) = op.got.tolist(), op.sum.tolist()
            raise ChecksumError(
                f"checksum mismatch in the message from process {op.peer} ({op.what()}): "
                f"sent {w} over {wn} bytes, received {g} over {gn} bytes"
            )


class P2PSchedule:
    """One process's P2P steps of a plan, built once and walked every refit.

    Lifecycle: built on every process of the plan (no communication: tags, slots and views come from
    the plan); ``run_cpu`` (gloo) or ``run_cuda`` (NCCL) once per refit, on every process in the same
    order; ``check_sums`` after a CUDA run; ``close()``.
    Must agree with every peer: the plan, ``tag_base`` (tags) and ``config.checksums`` (the checksum
    messages); a mismatch hangs in a receive until the deadline.
    Between refits: the ring and the views stay bound; the local tensors change in place.
    ``standalone``: ``group`` is a ProcessGroup object made outside torch.distributed's world (e.g.
    ``ProcessGroupGloo(store, rank, size)`` inside a vLLM worker); peers are its ranks and ops go
    straight to it.
    """

    def __init__(
        self,
        plan: Plan,
        proc: int,
        local: LocalTensors,
        device: torch.device,
        config: TransferConfig,
        tag_base: int,
        *,
        group: dist.ProcessGroup | None = None,
        standalone: bool = False,
    ) -> None:
        self.group, self.standalone = group, standalone
        self.device = device
        self.cuda = device.type == "cuda"
        self.ring = StagingRing(plan, proc, device)
        self.steps = _build_steps(plan, proc, local, self.ring, tag_base)
        # CPU: per step, whether its receives are posted while the step before is in flight
        self.ahead = recv_ahead(self.steps) if not self.cuda else [False] * len(self.steps)
        self.checksums = config.checksums
        self.sums = MessageSums(self.steps, device, self.cuda and triton_enabled()) if self.checksums else None
        self._waiter: _Waiter | None = None
        # NCCL in its default mode: ``Work.wait()`` only orders the current stream and returns at once, so it
        # is called inline (no thread to hand it to); a host wait that must follow goes under the clock
        self.inline_waits = self.cuda and not standalone and not _nccl_blocking_wait()
        if self.cuda:
            self.pack_stream = private_stream(device)
            self.unpack_stream = private_stream(device)
            self.free = [None] * len(self.ring.buffers)  # event: ring buffer's last use finished

    def close(self) -> None:
        """Stop the waiter thread (joined; see ``_Waiter.stop``). Idempotent."""
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None
        if self.cuda:
            free_stream(self.pack_stream)
            free_stream(self.unpack_stream)
            self.pack_stream = self.unpack_stream = None

    def _post(self, step: _Step, sums: bool = False, sends: bool = True, recvs: bool = True) -> list:
        """Post every send and receive of a step (or, ``sums``, of their checksums; ``sends`` / ``recvs`` False:
        without them); return the works."""

        def msgs(ops: list[_Op]) -> list[tuple[int, torch.Tensor, int]]:
            return [(op.peer, op.sum, op.tag + SUM_TAG) if sums else (op.peer, op.tensor, op.tag) for op in ops]

        return self.post(msgs(step.sends) if sends else [], msgs(step.recvs) if recvs else [])

    def post(self, sends: list[tuple[int, torch.Tensor, int]], recvs: list[tuple[int, torch.Tensor, int]]) -> list:
        """Post ``(peer, tensor, tag)`` sends and receives as one batch (or, standalone, the group's own
        ops); return the works, sends first. A failure to post names the peers."""
        if not sends and not recvs:
            return []
        try:
            if self.standalone:
                return [self.group.send([t], p, tag) for p, t, tag in sends] + [
                    self.group.recv([t], p, tag) for p, t, tag in recvs
                ]
            return dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, t, p, self.group, tag) for p, t, tag in sends]
                + [dist.P2POp(dist.irecv, t, p, self.group, tag) for p, t, tag in recvs]
            )
        except RuntimeError as e:  # a peer gone before the ops were even posted: name who they were for
            peers = ", ".join(f"process {p}" for p in sorted({p for p, _, _ in sends + recvs}))
            raise RuntimeError(f"posting the step's sends and receives with {peers} failed: {e}") from e

    def wait(self, clock: RunClock, works: list, ops: list[_Op], what: str, host: bool = False) -> None:
        """Wait for ``works`` (one per op, in order) under ``clock.watch``; a failed work names its peer.

        A blocked gloo wait cannot be interrupted (and gloo's own wait-with-timeout breaks the
        pair), so a waiter thread blocks in ``wait()`` while this thread keeps the clock; past
        the deadline the waiter stays blocked until the group's own timeout, and the refit is
        aborted (its Peer is then unusable anyway). On CUDA over NCCL (``inline_waits``) the waits
        only order the current stream; ``host``: the host then waits for that stream under the clock
        too (the caller reads what was received next: that read never waits past the deadline)."""
        if self.inline_waits:
            self._wait_inline(clock, works, ops, what, host)
            return
        if not clock.bounded:
            for w in works:
                w.wait()
            return
        if self._waiter is None:
            self._waiter = _Waiter()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        done = self._waiter.submit(works, stream)
        clock.watch(lambda: done.wait(0.001), lambda: _pending(what, ops))
        if done.error is not None:
            i, e = done.error
            raise _failed(what, ops[i], e) from e

    def _wait_inline(self, clock: RunClock, works: list, ops: list[_Op], what: str, host: bool) -> None:
        for i, w in enumerate(works):
            try:
                w.wait()
            except RuntimeError as e:
                raise _failed(what, ops[i], e) from e
        if host and works:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            clock.watch(done.query, lambda: _pending(what, ops))

    def run_cpu(self, clock: RunClock, fault: FaultHook | None = None) -> None:
        """Every step in turn on the host: pack, post, wait, check, unpack. A step's receives are posted while
        the step before it is in flight where they touch nothing that step uses (``recv_ahead``): gloo sends
        a message only once its receive is posted, so a sender starts its next message as soon as its last
        one is out, and no link idles while a receiver unpacks and posts."""
        ahead: list = []  # the works of this step's receives, posted during the step before
        for k, step in enumerate(self.steps):
            for op in step.sends:
                for bv, tv in op.pack:
                    bv.copy_(tv)
            if step.pack_sums is not None:
                step.pack_sums.run()
            if fault is not None:
                fault("step", step)
            ops = step.sends + step.recvs
            works = self._post(step, recvs=not self.ahead[k]) + ahead
            ahead = self._post(self.steps[k + 1], sends=False) if k + 1 < len(self.steps) and self.ahead[k + 1] else []
            self.wait(clock, works, ops, "transfer")
            if self.checksums:
                self.wait(clock, self._post(step, sums=True), ops, "checksum exchange")
            if fault is not None:
                fault("received", step)
            if self.sums is not None and step.recvs:
                step.unpack_sums.run()
                self.sums.check(step.recvs)
            for op in step.recvs:
                for bv, tv in op.pack:
                    tv.copy_(bv)

    def run_cuda(self, fault: FaultHook | None = None) -> None:
        """Every step enqueued on the GPU (pack stream, NCCL on the main stream, unpack stream); the
        host does not wait: the caller synchronizes, then ``check_sums``."""
        main = torch.cuda.current_stream(self.device)
        self.pack_stream.wait_stream(main)  # the source weights are final
        for step in self.steps:
            packed = [op for op in step.sends + step.recvs if op.pack]
            with torch.cuda.stream(self.pack_stream):
                for op in packed:
                    if self.free[op.slot] is not None:
                        self.pack_stream.wait_event(self.free[op.slot])
                fused = self.sums is not None and self.sums.fused
                for op in [] if fused else step.sends:
                    for bv, tv in op.pack:
                        bv.copy_(tv, non_blocking=True)
                if step.pack_sums is not None:
                    step.pack_sums.run()  # fused: packs too
            main.wait_stream(self.pack_stream)
            if fault is not None:
                fault("step", step)
            for w in self._post(step):
                w.wait()  # the main stream waits for NCCL; the host does not
            if self.checksums:
                for w in self._post(step, sums=True):
                    w.wait()
            done = torch.cuda.Event()
            done.record(main)
            with torch.cuda.stream(self.unpack_stream):
                self.unpack_stream.wait_event(done)
                fused = self.sums is not None and self.sums.fused
                if step.unpack_sums is not None:
                    step.unpack_sums.run()  # fused: unpacks too
                for op in [] if fused else step.recvs:
                    for bv, tv in op.pack:
                        tv.copy_(bv, non_blocking=True)
                free = torch.cuda.Event()
                free.record(self.unpack_stream)
            for op in packed:
                self.free[op.slot] = free
        main.wait_stream(self.unpack_stream)

    def check_sums(self) -> None:
        """After a CUDA run has finished on the device: every received message's checksum, at once."""
        if self.sums is not None:
            self.sums.check()
