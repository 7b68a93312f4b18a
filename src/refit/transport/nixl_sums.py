"""Checksum mode of NIXL pulls (``refit.transport.nixl``): a source sums every piece it sends once its tensors are
final and publishes, per receiver, the sums of that receiver's pieces with the run number, sealed; a receiver, once
every read is done, sums what it received, checks the record field by field and compares (``NixlSums``). Also the
device waits both use (``device_wait``)."""

from __future__ import annotations

import torch

from refit.binding import LocalTensors
from refit.errors import ChecksumError, TransferError
from refit.plan import Plan
from refit.transport.checksum import Piece, PieceSums
from refit.transport.clock import RunClock
from refit.transport.nixl_record import is_int

_SUMS_KEYS = {"run", "sums"}


def device_wait(device: torch.device, clock: RunClock, what: str) -> None:
    """Wait until ``device``'s current stream has done its work (nothing on the CPU); polled under
    ``clock`` (``what``: the pending work, for ``DeadlineExceeded``), so the host never blocks
    inside CUDA past the deadline."""
    if device.type != "cuda":
        return
    if not clock.bounded:
        torch.cuda.current_stream(device).synchronize()
        return
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    clock.watch(ev.query, lambda: what)


def _host_ints(t: torch.Tensor, clock: RunClock, what: str) -> list[int]:
    """``t`` (int64) on the host, the wait for its device under ``clock``."""
    device_wait(t.device, clock, what)
    return t.tolist()


class NixlSums:
    """Checksum mode of one process's NIXL pieces (``transport.checksum``'s sum; Triton on CUDA): one
    slot per message it sends (a source) and per message it reads (a receiver).

    Lifecycle: built at setup on the views the link moves (the destination's are a staged commit's
    shadow); per refit a source calls ``sent(clock)`` once its tensors are final and publishes
    ``record(receiver, run, sent)`` for each receiver; a receiver, once every read is done, calls
    ``check(records, run, clock)`` with its sources' records. Views stay valid between refits."""

    def __init__(self, plan: Plan, proc: int, local: LocalTensors, device: torch.device) -> None:
        self.plan = plan
        self.sends: dict[int, list[int]] = {}  # receiver process -> indices of the messages it reads from here
        self.reads: dict[int, int] = {}  # message index -> source process, in plan order
        sent, read = [], []
        self._sent_order: list[int] = []  # message index of each slot of the sums sent
        for k, m in enumerate(plan.messages):
            if m.transport != "nixl":
                continue
            p = m.pieces[0]
            if plan.procs.src[m.src] == proc:
                self.sends.setdefault(plan.procs.dst[m.dst], []).append(k)
                self._sent_order.append(k)
                sent.append(Piece(local.src_view(p.tensor, p.box), len(sent)))
            if plan.procs.dst[m.dst] == proc:
                self.reads[k] = plan.procs.src[m.src]
                read.append(Piece(local.dst_view(p.tensor, p.box), len(read)))
        self._sent = PieceSums(sent, torch.zeros(len(sent), dtype=torch.int64, device=device))
        self._read = PieceSums(read, torch.zeros(len(read), dtype=torch.int64, device=device))

    def sent(self, clock: RunClock) -> dict[int, int]:
        """The sums of every piece this process sends, now: message index -> sum."""
        self._sent.run()
        return dict(zip(self._sent_order, _host_ints(self._sent.out, clock, "checksums of NIXL pieces sent")))

    def record(self, receiver: int, run: int, sent: dict[int, int]) -> dict:
        """What ``receiver`` compares with: ``{"run": run, "sums": {message index: sum}}`` (plain data)."""
        return {"run": run, "sums": {str(k): sent[k] for k in self.sends[receiver]}}

    def check_record(self, rec: object, sp: int, run: int) -> dict[int, int] | None:
        """Source process ``sp``'s sums for run ``run`` (message index -> sum), None if ``rec`` is of an
        earlier run; ``TransferError`` naming the field if it is not exactly the sums of the pieces
        read from ``sp`` (int64 values)."""
        if not isinstance(rec, dict) or set(rec) != _SUMS_KEYS or not is_int(rec["run"], 0):
            raise TransferError(f"NIXL checksum record of process {sp} is not {{run, sums}}: {str(rec)[:80]}")
        if rec["run"] < run:
            return None
        want = {str(k) for k, s in self.reads.items() if s == sp}
        sums = rec["sums"]
        ok = rec["run"] == run and isinstance(sums, dict) and set(sums) == want
        if not ok or not all(is_int(v, -(1 << 63), 1 << 63) for v in sums.values()):
            raise TransferError(
                f"NIXL checksum record of process {sp}: run {rec['run']} (expected {run}), "
                f"sums not the {len(want)} int64 sums of the pieces read from it: {str(sums)[:80]}"
            )
        return {int(k): v for k, v in sums.items()}

    def check(self, want: dict[int, int], clock: RunClock) -> None:
        """Sum what was read and compare with the sources' sums ``want`` (message index -> sum, every
        message read); ``ChecksumError`` names the first piece (plan order) that differs."""
        self._read.run()
        got = _host_ints(self._read.out, clock, "checksums of NIXL pieces read")
        for (k, sp), g in zip(self.reads.items(), got):
            if g != want[k]:
                p = self.plan.messages[k].pieces[0]
                raise ChecksumError(
                    f"checksum mismatch in tensor {p.tensor!r} {[list(b) for b in p.box]} read over NIXL from "
                    f"process {sp}: source {want[k]}, received {g} ({p.nbytes} bytes)"
                )
