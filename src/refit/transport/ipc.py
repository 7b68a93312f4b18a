"""CUDA IPC: a receiver maps its sources' memory and pulls with the copy engine.

Setup (once): each source process exports an IPC handle per local tensor that
some receiver pulls from and publishes them through the rendezvous store;
each receiver rebuilds (maps) them. Pull (per refit): one copy per piece,
recorded once into a CUDA graph and replayed: same-GPU pieces as memcpy (or a
copy kernel where strided), peer pieces (other GPU, over NVLink) as
copy-engine copies pushed from the source GPU, so both links work at once;
peer pieces that are not one contiguous run use 2-D strided copies
(``cudaMemcpy2DAsync``).

``IpcLink.open`` does one process's whole IPC setup for a plan: export and map the
handles, build one ``IpcPuller`` per stage (``refit.plan.schedule.ipc_stages``),
capture each into a CUDA graph, and, for a plan whose links are all IPC (one
host), agree on a shared-memory ``HostBarrier`` through the store. The handles' export and checked import
live in ``ipc_handles``, the pacing of pulls (``TransferConfig.pull_gbps``) in ``ipc_pace``, the barrier in
``host_barrier``, deltas between two GPUs (``TransferConfig.delta``) in ``ipc_delta``, checksum mode
(``TransferConfig.checksums``) in ``ipc_sums``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence

import torch

from refit.binding import LocalTensors
from refit.config import TransferConfig
from refit.cudart import OwnedStreams, cuda_runtime, launch_on
from refit.delta.ops import DeltaStats
from refit.errors import PlanError
from refit.layout import box_relative, box_slices
from refit.plan import Plan
from refit.plan.schedule import ipc_stages, part_key, source_part
from refit.transport import ipc_delta, ipc_quant
from refit.transport.checksum import PieceSums
from refit.transport.host_barrier import HostBarrier
from refit.transport.ipc_handles import export_per_receiver, import_handles
from refit.transport.ipc_pace import pace_chunks, sleep_cycles_per_s, then_sleep
from refit.transport.ipc_quant import OnPull
from refit.transport.ipc_sums import Checked, IpcSums, Pair
from refit.transport.nixl_delta import with_stats
from refit.transport.rows import row_copy
from refit.transport.store import SignedStore

_PEER_ACCESS_ALREADY_ENABLED = 704
_CUDA_MEMCPY_DEFAULT = 4


def enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Let ``device`` read ``peer``'s memory directly (NVLink); without it copies stage through the host."""
    lib = cuda_runtime()
    if lib is None or device == peer:
        return
    if not torch.cuda.can_device_access_peer(device.index, peer.index):
        raise RuntimeError(
            f"{device} cannot access {peer} directly; CUDA IPC between them would stage through the host"
        )
    with torch.cuda.device(device):
        rc = lib.cudaDeviceEnablePeerAccess(peer.index, 0)
        if rc == _PEER_ACCESS_ALREADY_ENABLED:
            lib.cudaGetLastError()  # clear the sticky-free error so later checks do not see it
        elif rc != 0:
            raise RuntimeError(f"cudaDeviceEnablePeerAccess({device} -> {peer}) failed with CUDA error {rc}")


def make_copy(dst: torch.Tensor, src: torch.Tensor) -> tuple[str, Callable[[torch.cuda.Stream], None]]:
    """(kind, fn): ``fn(stream)`` issues ``dst <- src`` as one memcpy, one 2-D memcpy, or a copy kernel.

    Contiguous pieces: one memcpy. Strided pieces on one GPU: a copy kernel
    over 8-byte elements (on H200 2.1-2.6 TB/s against 0.74 TB/s for 2-D
    memcpy); across GPUs: a 2-D memcpy on the copy engine.

    Raw runtime calls avoid torch's per-copy cross-device event handshakes; the
    caller orders the streams.
    """
    lib = cuda_runtime()
    nbytes = dst.numel() * dst.element_size()
    if dst.is_contiguous() and src.is_contiguous():
        if lib is None:

            def torch_copy(stream: torch.cuda.Stream) -> None:
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)

            return "memcpy", torch_copy
        dptr, sptr = dst.data_ptr(), src.data_ptr()

        def copy1d(stream: torch.cuda.Stream) -> None:
            rc = lib.cudaMemcpyAsync(dptr, sptr, nbytes, _CUDA_MEMCPY_DEFAULT, stream.cuda_stream)
            if rc != 0:
                raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {rc} ({nbytes} bytes)")

        return "memcpy", copy1d
    spec = row_copy(dst, src) if dst.device != src.device else None  # same GPU: kernel below
    if lib is not None and spec is not None:
        rows, width, dpitch, spitch = spec
        dptr, sptr = dst.data_ptr(), src.data_ptr()

        def copy2d(stream: torch.cuda.Stream) -> None:
            rc = lib.cudaMemcpy2DAsync(
                dptr, dpitch, sptr, spitch, width, rows, _CUDA_MEMCPY_DEFAULT, stream.cuda_stream
            )
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {rc} ({rows} rows of {width} bytes)")

        return "memcpy2d", copy2d
    wd, ws = _widen(dst), _widen(src)
    if wd is None or ws is None or wd.shape != ws.shape:
        wd, ws = dst, src

    def kernel(stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            wd.copy_(ws, non_blocking=True)

    return "kernel", kernel


def _widen(view: torch.Tensor) -> torch.Tensor | None:
    """The same bytes viewed as int64 (8 bytes an element) when the rows allow, for faster copy kernels."""
    if view.dim() == 0 or view.stride(-1) != 1 or view.element_size() >= 8:
        return None
    k = 8 // view.element_size()
    if view.shape[-1] % k or view.data_ptr() % 8 or any(st % k for st in view.stride()[:-1]):
        return None
    try:
        return view.view(torch.int64)
    except RuntimeError:
        return None


class IpcPuller:
    """The receiver's pulls of one plan, precomputed.

    Call order: construct (at setup, after the sources' handles are mapped), optionally ``capture()``
    once, then ``pull()`` per refit. The mapped source tensors must outlive it (``IpcLink`` holds them).

    ``fused`` (checksum mode): the same-GPU pieces' checksum work (``IpcSums.fused_work``: one Triton
    kernel that copies and sums them, then the re-read of their sources); ``pull()`` runs it in order
    on a stream of its own beside the graph. ``kernels``: ``(cost, fn)`` work of the receiver's GPU recorded
    with its copies (FP8 on pull: ``ipc_quant.OnPull``), spread over its streams by ``cost`` (bytes in a
    copy's units).

    Same-GPU copies run on a stream of the receiver's GPU. Copies from another
    GPU run on a stream of that source GPU, in this process, with peer access
    enabled from the source to the receiver's GPU: the source's copy engine
    pushes over NVLink (reading peer memory from the receiver's side through an
    IPC mapping measured 38 GB/s on H200s; this path runs at link speed).
    """

    SMALL = 1 << 20  # copies below this are latency-bound: a stream of their own, beside the large ones
    PACE_CHUNK = 64 << 20  # paced pulls: contiguous copies cut to this size, so each burst is short

    def __init__(
        self,
        device: torch.device,
        same_device: Sequence[tuple[torch.Tensor, torch.Tensor]],
        peer: Sequence[tuple[torch.Tensor, torch.Tensor]],
        streams_per_lane: int = 2,
        fused: Sequence[PieceSums] = (),
        pace_gbps: float | None = None,
        kernels: Sequence[tuple[int, Callable[[torch.cuda.Stream], None]]] = (),
    ) -> None:
        if streams_per_lane < 1:
            raise ValueError(f"streams_per_lane must be >= 1, got {streams_per_lane}")
        self.device = device
        self.paced_s = 0.0  # the longest lane's sleeps per pull (``pace_gbps``; ``_pace``)
        self.fused = list(fused)
        self.owned = OwnedStreams()  # every stream of this puller is its own (``close`` frees them)
        self.fused_stream = self.owned.new(device) if self.fused else None
        groups: dict[torch.device, list] = {device: list(same_device)} if same_device or kernels else {}
        for d, s in peer:
            groups.setdefault(s.device, []).append((d, s))
        # one lane per source GPU: its large copies spread over ``streams_per_lane`` streams (on one
        # stream each copy's ramp-down leaves the GPU partly idle; several overlap those tails), its
        # small ones (latency-bound: norms, biases) on a stream of their own so they do not queue
        # behind the large ones.
        self.lanes = []  # (label, stream, [(kind, nbytes, fn)])
        for src_dev, pairs in sorted(groups.items(), key=lambda kv: str(kv[0])):
            if src_dev != device:
                enable_peer_access(src_dev, device)
            label = "same" if src_dev == device else f"peer{src_dev.index}"
            pieces = [c for d, s in pairs for c in pace_chunks(d, s, self.PACE_CHUNK if pace_gbps else None)]
            copies = [(kind, d.numel() * d.element_size(), fn) for d, s in pieces for kind, fn in [make_copy(d, s)]]
            if src_dev == device:  # work of this GPU's own (FP8 on pull), spread like the large copies
                copies += [("quantize", cost, fn) for cost, fn in kernels]
            small = [c for c in copies if c[1] < self.SMALL]
            large = [c for c in copies if c[1] >= self.SMALL]
            if small:
                self.lanes.append((f"{label}.small", self.owned.new(src_dev), small))
            large.sort(key=lambda c: -c[1])
            n = min(streams_per_lane, len(large))
            per = [[] for _ in range(n)]
            load = [0] * n
            for c in large:  # largest first onto the least-loaded stream
                i = load.index(min(load))
                per[i].append(c)
                load[i] += c[1]
            for i, cs in enumerate(per):
                self.lanes.append((label if n == 1 else f"{label}.{i}", self.owned.new(src_dev), cs))
        if pace_gbps:
            self._pace(pace_gbps)
        # issue order: largest first across all lanes, so every lane gets long work at once and
        # the host's enqueueing of the rest (3-5 us a call) hides behind it; grouped into runs of
        # one device so the current device switches only between runs
        order = sorted(
            ((nbytes, i, stream, fn) for i, (_, stream, copies) in enumerate(self.lanes) for _, nbytes, fn in copies),
            key=lambda x: (-x[0], x[1]),
        )
        self.runs: list[tuple[torch.device, list[tuple[torch.cuda.Stream, Callable]]]] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        for _, _, stream, fn in order:
            if not self.runs or self.runs[-1][0] != stream.device:
                self.runs.append((stream.device, []))
            self.runs[-1][1].append((stream, fn))

    def _pace(self, gbps: float) -> None:
        """Follow every copy with a sleep on its stream (a one-thread spin kernel, ``torch.cuda._sleep``) as
        long as its bytes take at its share of ``gbps`` GB/s (the lanes run side by side; each gets the
        share of its bytes, so all finish their sleeps together): the pull then uses at most that rate of
        the receiving GPU's memory, and an engine running beside it keeps the rest (refit while
        generating on the engine's own GPU). The copies themselves still run at full speed, in bursts of
        at most ``PACE_CHUNK`` bytes. ``paced_s``: the longest lane's sleeps (the pulled bytes at
        ``gbps``, from the cycles recorded); a sleep starts late while the engine's kernels fill the GPU and
        counts SM cycles (calibrated once: ``sleep_cycles_per_s``), so the pace is approximate, and a
        same-GPU copy moves twice its bytes through HBM (read and write)."""
        total = sum(nbytes for _, _, copies in self.lanes for _, nbytes, _ in copies)
        rates = {}
        for i, (label, stream, copies) in enumerate(self.lanes):
            lane = sum(nbytes for _, nbytes, _ in copies)
            if not lane:
                continue
            if stream.device not in rates:
                rates[stream.device] = sleep_cycles_per_s(stream.device)
            rate = gbps * 1e9 * lane / total  # this lane's share of the pace, bytes/s
            paced, cycles = [], 0
            for kind, nbytes, fn in copies:
                c = int(nbytes / rate * rates[stream.device])
                paced.append((kind, nbytes, then_sleep(fn, c)))
                cycles += c
            self.lanes[i] = (label, stream, paced)
            self.paced_s = max(self.paced_s, cycles / rates[stream.device])  # what the recorded sleeps add up to

    def _issue(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for _, stream, _ in self.lanes:
            stream.wait_stream(current)
        for dev, copies in self.runs:
            with torch.cuda.device(dev):
                for stream, fn in copies:
                    fn(stream)
        for _, stream, _ in self.lanes:
            current.wait_stream(stream)

    def capture(self) -> None:
        """Record every copy of a pull, and the ``fused`` checksum work beside them, into one CUDA graph (setup):
        a pull is then one launch instead of hundreds of host calls (3-5 us each, which the GPU otherwise waits
        for; a Triton launch is tens of us). Copies from a peer GPU run on its streams, joined into the graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            for work in self.fused:
                work.warm()
            for _, stream, _ in self.lanes:
                torch.cuda.synchronize(stream.device)
            with torch.cuda.graph(graph):
                self._run_fused(self._issue)
        self.graph = graph

    def _run_fused(self, copies: Callable[[], None]) -> None:
        """``copies()``, with the ``fused`` checksum work beside them on its stream (it waits for what the
        current stream has queued, and the current stream for it)."""
        current = torch.cuda.current_stream(self.device)
        if self.fused:
            self.fused_stream.wait_stream(current)
            with torch.cuda.stream(self.fused_stream):
                for work in self.fused:
                    work.run()
        copies()
        if self.fused:
            current.wait_stream(self.fused_stream)

    def pull(self, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue the copies on ``stream`` (default: the current stream of the device)."""
        current = stream if stream is not None else torch.cuda.current_stream(self.device)
        if self.graph is not None:  # one runtime call (the replay's device guard and bookkeeping: 10-15 us more)
            launch_on(self.graph, current)
            return
        with torch.cuda.stream(current):
            self._run_fused(self._issue if self.lanes else lambda: None)

    def close(self) -> None:
        """Drop the graph and the copies and free this puller's streams (queued work still finishes)."""
        self.graph, self.lanes, self.runs, self.fused_stream = None, [], [], None
        self.owned.free()

    def profile(self, repeats: int = 3) -> dict[str, tuple[int, int, float]]:
        """Seconds per lane and copy kind ("same/memcpy", "peer0/memcpy2d", ...), each run alone."""
        out = {}
        for label, stream, copies in self.lanes:
            for kind in ("memcpy", "memcpy2d", "kernel", "quantize"):
                sel = [c for c in copies if c[0] == kind]
                if not sel:
                    continue
                best = float("inf")
                for _ in range(repeats):
                    torch.cuda.synchronize(self.device)
                    torch.cuda.synchronize(stream.device)
                    t0 = time.perf_counter()
                    with torch.cuda.device(stream.device):
                        for _, _, fn in sel:
                            fn(stream)
                    stream.synchronize()
                    best = min(best, time.perf_counter() - t0)
                out[f"{label}/{kind}"] = (len(sel), sum(c[1] for c in sel), best)
        return out


def _map_pulls(
    plan: Plan, proc: int, local: LocalTensors, store: SignedStore, config: TransferConfig, stages: list[set[str]]
) -> tuple[dict[int, dict[str, torch.Tensor]], list[tuple[list[Pair], list[Pair]]], list[Checked], dict]:
    """Publish this process's handles, map its sources' (once each), and pair every pull's views.

    Returns (mapped tensors per source process, per stage (same-GPU pairs, peer-GPU pairs),
    every pull in order as ``Checked`` when checksums are on, ``(source process, tensor) -> (stage, pair)``
    of the same-GPU pulls of one piece each)."""
    ipc = [m for m in plan.messages if m.transport == "ipc"]
    name, timeout_s = config.name, config.preflight_timeout_s
    export_per_receiver(plan, proc, local, store, name, ipc)
    stage_of = {n: i for i, names in enumerate(stages) for n in names}
    mapped: dict[int, dict[str, torch.Tensor]] = {}
    pairs: list[tuple[list[Pair], list[Pair]]] = [([], []) for _ in stages]  # per stage: (same GPU, peer GPU)
    checked: list[Checked] = []
    named: dict[tuple[int, str], tuple[int, Pair] | None] = {}
    for m in (m for m in ipc if plan.procs.dst[m.dst] == proc):
        sp = plan.procs.src[m.src]
        if sp not in mapped:
            mapped[sp] = import_handles(store, f"{name}/ipc/{sp}/{proc}", timeout_s)
        p = m.pieces[0]
        part, s_box = source_part(plan, m.src, p.tensor, p.box)
        sv = mapped[sp][part_key(p.tensor, part)][box_slices(box_relative(p.box, s_box))]
        pair = (local.dst_view(p.tensor, p.box), sv)
        same, peer = pairs[stage_of[p.tensor]]
        on_gpu = plan.procs.same_device(sp, proc)
        (same if on_gpu else peer).append(pair)
        if on_gpu:  # a tensor pulled in several pieces is None: not quantized on the pull
            named[sp, p.tensor] = None if (sp, p.tensor) in named else (stage_of[p.tensor], pair)
        if config.checksums:
            checked.append((p.tensor, stage_of[p.tensor], on_gpu, pair))
    return mapped, pairs, checked, named


def _on_pull_jobs(
    plan: Plan, proc: int, store: SignedStore, config: TransferConfig, named: dict
) -> dict[int, list[tuple[OnPull, Pair, Pair]]]:
    """The weights this receiver quantizes on its pull (``ipc_quant``), per stage, with the two pulls
    (weight, scales) each replaces."""
    out: dict[int, list[tuple[OnPull, Pair, Pair]]] = {}
    sources = sorted({sp for sp, _ in named})
    for sp in sources:

        def views(n: str, scale: str, sp: int = sp) -> tuple[torch.Tensor, torch.Tensor]:
            w, s = named.get((sp, n)), named.get((sp, scale))
            if w is None or s is None:
                raise PlanError(f"FP8 on pull: process {sp} published weight {n!r}, which is not pulled whole here")
            return w[1][0], s[1][0]

        for job in ipc_quant.import_jobs(store, config.name, sp, proc, config.preflight_timeout_s, views):
            w, s = named[sp, job.name], named[sp, job.scale]
            out.setdefault(w[0], []).append((job, w[1], s[1]))
    return out


def _captured_puller(
    device: torch.device,
    same: list[Pair],
    peer: list[Pair],
    config: TransferConfig,
    proc: int,
    fused: Sequence[PieceSums] = (),
    on_pull: Sequence[OnPull] = (),
) -> IpcPuller | None:
    """The puller of one stage (None without pulls), its copies recorded into a CUDA graph if
    ``config.cuda_graph``; a failed capture warns and leaves the copies to be issued one by one.
    ``fused``: the stage's checksum work on its same-GPU pieces (``IpcSums.fused_work``; those pieces
    are not in ``same``). ``on_pull``: the stage's weights quantized on the pull (``ipc_quant``; their pulls
    are not in ``same``), compiled here before the graph records them."""
    if not (same or peer or fused or on_pull):
        return None
    kernels = [(job.cost, job.fn) for job in on_pull]
    puller = IpcPuller(
        device,
        same,
        peer,
        streams_per_lane=config.copy_streams,
        fused=fused,
        pace_gbps=config.pull_gbps,
        kernels=kernels,
    )
    for job in on_pull:
        job.warm()
    if (puller.lanes or puller.fused) and config.cuda_graph:
        _try_capture(puller.capture, proc, "the IPC pull")
    return puller


def _try_capture(capture: Callable[[], None], proc: int, what: str) -> None:
    """``capture()`` (speed only): on failure warn; the owner's graph stays None and its work is issued call by call."""
    try:
        capture()
    except RuntimeError as e:
        warnings.warn(
            f"refit: rank {proc}: recording {what} into a CUDA graph failed ({e}); issuing its work call by call "
            "(set TransferConfig.cuda_graph=False to skip)",
            stacklevel=3,
        )


class IpcLink:
    """One process's CUDA IPC part of a plan: its exported handles, its mapped sources, one puller per
    stage, and (all-IPC plans) the shared-memory barrier.

    Lifecycle: ``IpcLink.open(...)`` on every process of a plan with IPC links, after pre-flight
    (collective through the store: each source publishes the handles of the tensors receivers pull,
    each receiver maps its sources'); per refit, for each stage in order: the sources' tensors of
    that stage are final (a barrier), then ``pull(stage)``; ``enqueue_sums()``, the wait for the
    device, ``check_sums()``; ``close()``.
    Must agree on every process: the plan, ``config.name`` (store keys) and ``config.stages``.
    Between refits: the mappings stay open and the graphs are replayed; sources change their
    tensors in place only between the last barrier of one refit and the first of the next.
    """

    def __init__(
        self,
        stage_names: list[set[str]],
        pullers: list[IpcPuller | None],
        sums: IpcSums | None,
        mapped: dict[int, dict[str, torch.Tensor]],
        host_barrier: HostBarrier | None,
    ) -> None:
        self.stage_names = stage_names  # the source tensors of each stage
        self.pullers = pullers  # per stage; None where this process pulls nothing in it
        self.puller = next((pl for pl in pullers if pl is not None), None) if len(pullers) == 1 else None
        self.sums = sums  # checksum mode
        self.host_barrier = host_barrier
        self._mapped = mapped  # keep the mappings alive
        self.skipped: set[str] = set()  # a source's weights its receivers quantize on their pulls (ipc_quant)
        self.delta: ipc_delta.IpcDelta | None = None  # delta mode (``refit.transport.ipc_delta``)

    @property
    def pulls_here(self) -> bool:
        """Whether this process pulls anything (or checks sums) over IPC, or stages deltas (its finds and base updates
        run on the executor's stream, which the run waits for)."""
        deltas = self.delta is not None and bool(self.delta.sends)
        return any(pl is not None for pl in self.pullers) or (self.sums is not None and bool(self.sums.names)) or deltas

    @classmethod
    def open(
        cls,
        plan: Plan,
        proc: int,
        local: LocalTensors,
        store: SignedStore | None,
        config: TransferConfig,
        device: torch.device,
        prepare: object = None,
    ) -> IpcLink:
        """Exchange handles, build and capture the pullers, agree on the barrier (see the class).
        ``prepare``: the source's (``Executor``'s), offering live weights to quantize on the pull (``ipc_quant``)."""
        if store is None:
            raise PlanError("the plan has CUDA IPC links but no rendezvous store was given")
        all_ipc = all(m.transport == "ipc" for m in plan.messages)
        stages = ipc_stages(plan, config.stages if all_ipc else 1)
        mapped, pairs, checked, named = _map_pulls(plan, proc, local, store, config, stages)
        skipped, jobs = set(), {}
        if ipc_quant.wanted(plan):
            if proc in plan.procs.src:
                skipped = ipc_quant.publish(plan, proc, store, config.name, prepare, config.checksums)
            jobs = _on_pull_jobs(plan, proc, store, config, named)
        sums = IpcSums(checked, device, len(stages)) if config.checksums else None
        if sums is not None and config.cuda_graph:
            _try_capture(sums.capture, proc, "the IPC checksums' comparison")
        pullers = []
        replaced = {id(p) for stage in jobs.values() for _, *ps in stage for p in ps}  # a scale's stage may differ
        for i, (same, peer) in enumerate(pairs):
            same = [q for q in same if id(q) not in replaced and (sums is None or not sums.fuses(q))]
            fused = () if sums is None else sums.fused_work(i)
            pullers.append(_captured_puller(device, same, peer, config, proc, fused, [j for j, *_ in jobs.get(i, [])]))
        delta = None
        if ipc_delta.wanted(plan, config):  # one stage: ``same`` and ``peer`` are its pulls
            delta = ipc_delta.IpcDelta.open(
                plan, proc, local, store, config, device, pairs[0][1], (make_copy, enable_peer_access)
            )
            if delta.taken:  # what no delta takes, for the refits where some message comes as one
                rest = [q for q in peer if id(q) not in delta.taken]
                delta.rest = _captured_puller(device, same, rest, config, proc, (), [j for j, *_ in jobs.get(0, [])])
        barrier = None
        if all_ipc:  # a plan whose links are all IPC (one host) synchronizes through shared memory
            members = sorted({*plan.procs.src, *plan.procs.dst})
            barrier = HostBarrier.agree(
                store, f"{config.name}/barrier", members.index(proc), len(members), config.preflight_timeout_s
            )
        link = cls(stages, pullers, sums, mapped, barrier)
        link.skipped, link.delta = skipped, delta
        return link

    def begin(self, version: int, held: int | None) -> None:
        """Delta mode, before the stage barrier: a refit of ``version`` starts, this process holds ``held``; a source
        finds and stages its deltas (``IpcDelta.begin``)."""
        if self.delta is not None:
            self.delta.begin(version, held)

    def finish(self, version: int, stats: DeltaStats | None) -> DeltaStats | None:
        """Delta mode, after the last barrier: a source's base holds ``version``; returns ``stats`` with this refit's
        IPC delta statistics added (``with_stats``)."""
        if self.delta is not None:
            self.delta.finish(version)
        return with_stats(stats, self)

    def pull(self, stage: int, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue stage ``stage``'s copies on ``stream`` (default: the current one; the host does not wait)."""
        if stage == 0 and self.sums is not None:  # a new refit: no verdict of an earlier, failed one is read
            self.sums.verdict = None
        if self.delta is not None:  # deltas pull in one stage
            self.delta.pull(stream, self.pullers[stage])
        elif self.pullers[stage] is not None:
            self.pullers[stage].pull(stream)

    def enqueue_sums(self) -> None:
        """Checksum mode, after the last ``pull``: enqueue the rest of the check (``IpcSums.enqueue``)."""
        if self.sums is not None:
            self.sums.enqueue()

    def check_sums(self) -> None:
        """Every pulled piece's checksum against its source's (checksum mode; after ``enqueue_sums`` and
        the caller's wait for the device): ``IpcSums.check``."""
        if self.sums is not None:
            self.sums.check()
        if self.delta is not None:  # the delta scatter's index check
            self.delta.verify()

    CLOSE_WAIT_S = 5.0

    def close(self) -> None:
        """Release every mapping of another process's memory (graphs, pullers, mapped tensors; torch's IPC
        reference counts drop), then, on one host, wait at the barrier so that no source process exits
        while a receiver still maps its memory (best effort: a peer that died is not waited for), free what
        the receivers released (sources), and unlink the barrier (its owner). Idempotent."""
        for owner in [*self.pullers, self.sums, self.delta]:
            if owner is not None:
                owner.close()
        self.pullers, self.puller, self.sums, self._mapped = [], None, None, {}
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
        if self.host_barrier is not None:
            self.host_barrier.leave(self.CLOSE_WAIT_S)  # False: a peer died; nothing of ours is mapped any more
            if cuda:  # every receiver has dropped its mappings: a source's exported blocks can go now
                torch.cuda.ipc_collect()
            self.host_barrier.close()
            self.host_barrier = None
