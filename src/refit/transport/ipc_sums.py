"""Checksum mode of CUDA IPC pulls (``IpcSums``): every pulled piece summed against its source, batched into a few
kernel launches and one host sync per refit; ``refit.transport.ipc``'s ``IpcLink`` builds it from its checked
pulls, its pullers run its fused work beside their copies."""

from __future__ import annotations

import torch

from refit.cudart import OwnedStreams, launch_on
from refit.errors import ChecksumError
from refit.transport.checksum import Piece, PieceSums, fusable

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination view, mapped source view)


Checked = tuple[str, int, bool, Pair]  # (tensor name, stage, same GPU, pair) of one pull


class IpcSums:
    """Checksum mode of one receiver's IPC pulls: every pulled piece against its source, batched into
    a few kernel launches and one host sync per refit.

    Same-GPU pieces that the Triton kernel can address (``fusable``) are not memcpy'd: the kernel
    copies them and sums the bytes it moves, then a second launch on the same stream sums their
    sources again (``fused_work(stage)``, run by that stage's puller beside its other copies, so on
    S3 the re-read overlaps the copy engines' NVLink pulls). The other pieces (from a peer GPU, whose
    copy engine moved them, or without Triton) are summed at both ends once the pulls finished:
    their destinations on this GPU, their sources on the source's GPU, on a stream of this process
    there (``enqueue``). ``enqueue`` then compares everything on this GPU into a flag and an index;
    ``check()``, after the caller's wait for the device, reads them back (16 bytes).
    A fused piece thus catches a source changed after the pull read it (until its re-read) and a
    copy that read wrong; the others catch any difference between destination and source. Traffic
    per byte beside the copy's read and write: one read for a fused piece, two for the others.
    Lifecycle: built at setup from ``_map_pulls``' checked pulls; per refit the pullers run
    ``fused_work``, then ``enqueue()`` after the last pull, the caller's wait for the device, ``check()``.
    """

    def __init__(self, checked: list[Checked], device: torch.device, stages: int) -> None:
        self.device = device
        self.names = [name for name, *_ in checked]
        self.nbytes = [dst.numel() * dst.element_size() for *_, (dst, _) in checked]
        n = len(checked)
        self.got = torch.zeros(n, dtype=torch.int64, device=device)
        self.want = torch.zeros(n, dtype=torch.int64, device=device)  # every source's sum lands here
        fused: list[list[Piece]] = [[] for _ in range(stages)]
        others: list[Piece] = []
        sources: dict[torch.device, list[Piece]] = {}  # the sources of the pieces not fused
        self._fused_ids: set[int] = set()
        for slot, (_, stage, on_gpu, pair) in enumerate(checked):
            dst, src = pair
            piece = Piece(src, slot, dst=dst)
            if on_gpu and fusable(piece):
                fused[stage].append(piece)
                self._fused_ids.add(id(pair))
            else:
                others.append(Piece(dst, slot))
                sources.setdefault(src.device, []).append(Piece(src, slot))
        self.fused = [PieceSums(ps, self.got) if ps else None for ps in fused]
        self.reread = [PieceSums([Piece(p.src, p.slot) for p in ps], self.want) if ps else None for ps in fused]
        self.dst_sums = PieceSums(others, self.got) if others else None
        self.src_sums = {
            d: PieceSums(ps, self.want if d == device else torch.zeros(n, dtype=torch.int64, device=d))
            for d, ps in sources.items()
        }
        self.owned = OwnedStreams()  # the peer GPUs' side streams (``close`` frees them)
        self.side = {d: self.owned.new(d) for d in self.src_sums if d != device}
        self.slots = {d: self.src_sums[d].slots.to(device) for d in self.side}  # what each peer GPU sums
        self.verdict: torch.Tensor | None = None  # (mismatch?, first such slot) once ``enqueue`` ran
        self.graph: torch.cuda.CUDAGraph | None = None  # ``capture``: enqueue's work, the verdict to pinned memory
        self._host: torch.Tensor | None = None

    def fuses(self, pair: Pair) -> bool:
        """Whether the fused kernel copies ``pair`` (the puller then leaves it out)."""
        return id(pair) in self._fused_ids

    def fused_work(self, stage: int) -> list[PieceSums]:
        """What ``stage``'s puller runs, in order, on its checksum stream: the fused copy and sum of
        the stage's same-GPU pieces, then the re-read of their sources."""
        return [w for w in (self.fused[stage], self.reread[stage]) if w is not None]

    def capture(self) -> None:
        """Record ``enqueue``'s work into a CUDA graph (setup), where it runs on this GPU alone (no peer GPU's
        sources) and the Triton kernel sums every piece: one launch a refit instead of a dozen, the verdict
        copied into pinned host memory that ``check`` reads after the caller's wait without a CUDA call."""
        sums = [ps for ps in (self.dst_sums, *self.src_sums.values()) if ps is not None]
        if not self.names or self.side or any(ps.fallback for ps in sums):
            return
        for ps in sums:
            ps.warm()
        host = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(graph):
                self._enqueue()
                host.copy_(self.verdict, non_blocking=True)
        self.graph, self._host, self.verdict = graph, host, None

    def enqueue(self) -> None:
        """After the last stage's pull: sum the pieces not fused at both ends (destinations and this GPU's
        sources on the current stream, a peer GPU's sources on a side stream there) and compare every
        piece into ``verdict`` on the current stream (no host sync)."""
        if not self.names:  # pulls nothing (a source process)
            return
        if self.graph is not None:
            launch_on(self.graph, torch.cuda.current_stream(self.device))
            self.verdict = self._host
            return
        self._enqueue()

    def _enqueue(self) -> None:
        current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for side in self.side.values():  # after the pulls (the peer copies are ordered before this point),
            side.wait_stream(current)  # not after the destination sums: both ends are summed at once
        if self.dst_sums is not None:
            self.dst_sums.run()
        for d, ps in self.src_sums.items():
            if d == self.device:
                ps.run()
                continue
            with torch.cuda.device(d), torch.cuda.stream(self.side[d]):
                ps.run()
                here = ps.out.to(self.device)  # on the side stream, both ends' current streams synchronized
            current.wait_stream(self.side[d])
            self.want.index_copy_(0, self.slots[d], here.index_select(0, self.slots[d]))
        bad = self.got != self.want
        self.verdict = torch.stack([bad.any().to(torch.int64), torch.argmax(bad.to(torch.int32)).to(torch.int64)])

    def close(self) -> None:
        """Free the side streams (queued work still finishes)."""
        self.side = {}
        self.owned.free()

    def check(self) -> None:
        """Raise ``ChecksumError`` naming the first tensor whose received sum differs from its source's.
        Reads what ``enqueue`` left (enqueues it first if it did not run); one small read-back."""
        if not self.names:
            return
        if self.verdict is None:
            self.enqueue()
            if self.graph is not None:  # its verdict lands in pinned memory: wait for it
                torch.cuda.current_stream(self.device).synchronize()
        verdict, self.verdict = self.verdict, None
        flag, i = verdict.tolist()  # pinned host memory (``capture``): no CUDA call
        if flag:
            raise ChecksumError(
                f"checksum mismatch in tensor {self.names[i]!r} pulled over CUDA IPC: "
                f"source {int(self.want[i])}, received {int(self.got[i])} ({self.nbytes[i]} bytes)"
            )
