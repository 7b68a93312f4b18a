"""The transfer plan: which source rank sends which box of which tensor to which destination rank.

Built once from the two sides' ModelLayouts and a process map; a refit step
only executes it. Both sides derive it independently and compare ``digest``.

Source choice among replicas (several source ranks holding the same box), in order:
  1. a holder in the receiver's own process (a local copy, no link bytes), else
     one on the receiver's device (an on-device copy through CUDA IPC);
  2. for a tensor laid out identically on both sides (same box on every rank),
     the receiver's counterpart: the source rank with the same number;
  3. otherwise, largest pieces first, the least-loaded holder by bytes sent so
     far, ties broken by a rotation that starts at the receiver's index among
     that box's receivers.

Pieces on a link are grouped into messages: a piece that is one contiguous run
in both the source's and the destination's local tensor travels alone and
unpacked ("direct"); the others are packed into buckets of at most
``buffer_bytes``. Messages are scheduled into steps so that no process has
more than half of its ``num_buffers`` ring in flight in one step (the other
half is being packed or unpacked), never more than ``num_buffers`` at once.
Links between CUDA processes of one host may use IPC (``transport``): the
receiver pulls each piece from the source's mapped memory, no staging.

This module knows nothing of devices or transports.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from refit.layout import (
    Box,
    ModelLayout,
    TensorLayout,
    box_intersect,
    box_is_contiguous,
    box_numel,
    box_relative,
    box_shape,
    split_box,
)

ALIGN = 64  # byte alignment of pieces inside a staging buffer


class PlanError(ValueError):
    """The two layouts cannot be connected (names, shapes, dtypes, coverage, budget)."""


TRANSPORTS = ("p2p", "ipc", "auto")


@dataclass(frozen=True)
class ProcessMap:
    """Which global process hosts each side-local rank, and (optionally) each process's device.

    ``devices[p]`` is ``"cuda:0"``, ``"cpu"`` or ``"host/cuda:1"``; without a host
    prefix every process is on one host. Without ``devices`` every process is
    taken to have a device of its own.
    """

    src: tuple[int, ...]
    dst: tuple[int, ...]
    devices: tuple[str, ...] | None = None

    def device_of(self, proc: int) -> str:
        return self.devices[proc] if self.devices is not None else f"proc{proc}"

    def host_of(self, proc: int) -> str:
        d = self.device_of(proc)
        return d.split("/", 1)[0] if "/" in d else "localhost"

    def same_device(self, a: int, b: int) -> bool:
        return a == b or (self.devices is not None and self.device_of(a) == self.device_of(b))

    def ipc_capable(self, a: int, b: int) -> bool:
        """Both processes on one host, both on CUDA devices."""
        return (
            self.devices is not None
            and self.host_of(a) == self.host_of(b)
            and "cuda" in self.device_of(a)
            and "cuda" in self.device_of(b)
        )

    def with_devices(self, devices) -> "ProcessMap":
        return ProcessMap(self.src, self.dst, tuple(devices))

    @classmethod
    def disjoint(cls, n_src: int, n_dst: int) -> "ProcessMap":
        """Trainer ranks are processes ``0..n_src-1``, engine ranks follow."""
        return cls(tuple(range(n_src)), tuple(range(n_src, n_src + n_dst)))

    @classmethod
    def colocated(cls, n_src: int, n_dst: int) -> "ProcessMap":
        """Source rank i and destination rank i share process i."""
        return cls(tuple(range(n_src)), tuple(range(n_dst)))

    @property
    def world_size(self) -> int:
        return len(set(self.src) | set(self.dst))


@dataclass(frozen=True)
class Piece:
    """One box of one tensor, from a source rank to a destination rank (global coordinates)."""

    tensor: str
    src: int
    dst: int
    box: Box
    itemsize: int

    @cached_property
    def nbytes(self) -> int:
        return box_numel(self.box) * self.itemsize


@dataclass(frozen=True)
class Message:
    """One transfer on a link: a direct piece, or a bucket of packed pieces with byte offsets."""

    src: int
    dst: int
    step: int
    direct: bool
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]  # byte offset of each piece in the staging buffer (packed only)
    nbytes: int  # bytes on the wire (packed: buffer length incl. alignment)
    transport: str = "p2p"  # "p2p": torch.distributed send/recv; "ipc": the receiver pulls from mapped memory


@dataclass(frozen=True)
class Plan:
    src_layout: ModelLayout
    dst_layout: ModelLayout
    procs: ProcessMap
    num_buffers: int
    buffer_bytes: int
    transport: str
    messages: tuple[Message, ...]
    local: tuple[Piece, ...]  # same-process copies
    num_steps: int
    _index: dict = field(default_factory=dict, compare=False, repr=False)

    # ---------------------------------------------------------------- stats
    @cached_property
    def bytes_needed(self) -> int:
        """Bytes all destination ranks hold once the refit is done."""
        return sum(
            box_numel(b) * t.itemsize for t in self.dst_layout for r in t.ranks if (b := t.box(r)) is not None
        )

    @cached_property
    def links(self) -> dict[int, dict[int, int]]:
        """Payload bytes per link: source rank -> destination rank -> bytes (local copies excluded)."""
        out: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        for m in self.messages:
            out[m.src][m.dst] += sum(p.nbytes for p in m.pieces)
        return {s: dict(sorted(d.items())) for s, d in sorted(out.items())}

    @cached_property
    def bytes_same_device(self) -> int:
        """Link bytes whose two processes share a device (on-device copies, no interconnect)."""
        return sum(
            sum(p.nbytes for p in m.pieces)
            for m in self.messages
            if self.procs.same_device(self.procs.src[m.src], self.procs.dst[m.dst])
        )

    @cached_property
    def bytes_moved(self) -> int:
        return sum(sum(d.values()) for d in self.links.values())

    @cached_property
    def bytes_local(self) -> int:
        return sum(p.nbytes for p in self.local)

    @property
    def ratio(self) -> float:
        return self.bytes_moved / self.bytes_needed if self.bytes_needed else 1.0

    @property
    def max_link_bytes(self) -> int:
        return max((b for d in self.links.values() for b in d.values()), default=0)

    def predicted_seconds(self, bandwidth_gbps: float) -> float:
        """Time if every process sends and receives at ``bandwidth_gbps`` GB/s, in parallel."""
        sent: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        for s, d in self.links.items():
            for r, b in d.items():
                sent[self.procs.src[s]] += b
                recv[self.procs.dst[r]] += b
        busiest = max([*sent.values(), *recv.values(), 0])
        return busiest / (bandwidth_gbps * 1e9)

    # ---------------------------------------------------------------- identity
    def canonical(self) -> dict:
        """What the plan means, independent of how the layouts were described (mesh names etc.)."""
        return {
            "src": [canonical_tensor(t) for t in self.src_layout],
            "dst": [canonical_tensor(t) for t in self.dst_layout],
            "procs": [list(self.procs.src), list(self.procs.dst)],
            "devices": list(self.procs.devices) if self.procs.devices is not None else None,
            "buffers": [self.num_buffers, self.buffer_bytes],
            "messages": [
                [m.src, m.dst, m.step, m.direct, m.transport, [[p.tensor, [list(x) for x in p.box]] for p in m.pieces], list(m.offsets)]
                for m in self.messages
            ],
            "local": [[p.tensor, p.src, p.dst, [list(x) for x in p.box]] for p in self.local],
        }

    @cached_property
    def digest(self) -> str:
        blob = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---------------------------------------------------------------- per process
    def local_of(self, proc: int) -> list[Piece]:
        return [p for p in self.local if self.procs.dst[p.dst] == proc]


# ---------------------------------------------------------------------------- building


def canonical_tensor(t: TensorLayout) -> list:
    """Name, shape, dtype and the box of every rank: equal for equivalent layouts."""
    boxes = [[r, [list(x) for x in b]] for r in t.ranks if (b := t.box(r)) is not None]
    return [t.name, list(t.shape), str(t.dtype).removeprefix("torch."), boxes]


def check_compatible(src: ModelLayout, dst: ModelLayout) -> None:
    """Names, shapes and dtypes must agree; raises PlanError naming the first difference."""
    src_names, dst_names = set(src.names), set(dst.names)
    missing = [n for n in dst.names if n not in src_names]
    if missing:
        raise PlanError(
            f"{len(missing)} destination tensor(s) have no source, first: {missing[0]!r}"
            + (f" (others: {', '.join(missing[1:4])}{', ...' if len(missing) > 4 else ''})" if len(missing) > 1 else "")
        )
    extra = [n for n in src.names if n not in dst_names]
    if extra:
        raise PlanError(
            f"{len(extra)} source tensor(s) are not wanted by the destination, first: {extra[0]!r}"
        )
    for d in dst:
        s = src[d.name]
        if s.shape != d.shape:
            raise PlanError(f"tensor {d.name!r}: source shape {list(s.shape)} != destination shape {list(d.shape)}")
        if s.dtype != d.dtype:
            raise PlanError(f"tensor {d.name!r}: source dtype {s.dtype} != destination dtype {d.dtype}")


def _source_tiles(t: TensorLayout) -> list[tuple[Box, list[int]]]:
    """Distinct source boxes with their holders; they must tile the tensor exactly."""
    tiles = sorted(t.holders().items())
    for i, (a, _) in enumerate(tiles):
        for b, _ in tiles[i + 1 :]:
            if box_intersect(a, b) is not None:
                raise PlanError(f"tensor {t.name!r}: source boxes {list(a)} and {list(b)} overlap without being replicas")
    covered = sum(box_numel(b) for b, _ in tiles)
    if covered != t.numel:
        raise PlanError(
            f"tensor {t.name!r} {list(t.shape)}: source ranks hold {covered} of {t.numel} elements (coverage gap)"
        )
    return tiles


def check_coverage(dst: ModelLayout, pieces: list[Piece]) -> None:
    """Every destination element is written exactly once (pieces pairwise disjoint, sum = box)."""
    by_target: dict[tuple[str, int], list[Box]] = defaultdict(list)
    for p in pieces:
        by_target[(p.tensor, p.dst)].append(p.box)
    for t in dst:
        for r in t.ranks:
            want = t.box(r)
            if want is None or box_numel(want) == 0:
                continue
            got = sorted(by_target.get((t.name, r), []))
            for b in got:
                if box_intersect(b, want) != b:
                    raise PlanError(f"tensor {t.name!r}: piece {list(b)} for destination rank {r} lies outside its box {list(want)}")
            for i, a in enumerate(got):
                for b in got[i + 1 :]:
                    if box_intersect(a, b) is not None:
                        raise PlanError(f"tensor {t.name!r}: destination rank {r} would be written twice in {list(box_intersect(a, b))}")
            n = sum(box_numel(b) for b in got)
            if n != box_numel(want):
                raise PlanError(
                    f"tensor {t.name!r}: destination rank {r} would receive {n} of {box_numel(want)} elements of box {list(want)} (coverage gap)"
                )


def _choose_sources(src: ModelLayout, dst: ModelLayout, procs: ProcessMap) -> list[Piece]:
    fixed: list[tuple[int, Piece]] = []
    open_: list[tuple[int, str, int, Box, list[int], int, int, int]] = []  # pieces whose source is still to choose
    for d in dst:
        s = src[d.name]
        dst_boxes = [(r, b) for r in d.ranks if (b := d.box(r)) is not None and box_numel(b) > 0]
        identical: bool | None = None  # same boxes on both sides: computed only when it matters
        for tile, holders in _source_tiles(s):
            receivers = [(r, piece) for r, b in dst_boxes if (piece := box_intersect(tile, b)) is not None]
            # the first holder in this process, else the first on this device (looked up, not scanned)
            by_proc: dict[int, int] = {}
            by_dev: dict[str, int] = {}
            for h in holders:
                by_proc.setdefault(procs.src[h], h)
                if procs.devices is not None:
                    by_dev.setdefault(procs.device_of(procs.src[h]), h)
            for k, (r, piece) in enumerate(receivers):
                order = len(fixed) + len(open_)
                near = by_proc.get(procs.dst[r])
                if near is None and by_dev:
                    near = by_dev.get(procs.device_of(procs.dst[r]))
                if near is not None:
                    fixed.append((order, Piece(d.name, near, r, piece, d.itemsize)))
                elif r in holders and (identical if identical is not None else
                                       (identical := canonical_tensor(s) == canonical_tensor(d))):
                    fixed.append((order, Piece(d.name, r, r, piece, d.itemsize)))
                else:
                    open_.append((order, d.name, r, piece, holders, k, d.itemsize, box_numel(piece) * d.itemsize))
    load: dict[int, int] = defaultdict(int)
    for _, p in fixed:
        if not procs.same_device(procs.src[p.src], procs.dst[p.dst]):
            load[p.src] += p.nbytes
    # largest pieces first (LPT), each to the least-loaded holder; ties go to the
    # rotation that starts at the receiver's index among the tile's receivers
    chosen: list[tuple[int, Piece]] = []
    for order, name, r, piece, holders, k, itemsize, nb in sorted(open_, key=lambda x: (-x[7], x[0])):
        start = k % len(holders)
        rotated = holders[start:] + holders[:start]
        h = min(rotated, key=load.__getitem__)  # min keeps the first of equals (defaultdict: 0 if unseen)
        p = Piece(name, h, r, piece, itemsize)
        p.__dict__["nbytes"] = nb  # the cached_property's slot: computed once above
        load[h] += nb
        chosen.append((order, p))
    return [p for _, p in sorted(fixed + chosen, key=lambda x: x[0])]


def link_bytes(src: ModelLayout, dst: ModelLayout, procs: ProcessMap | None = None) -> dict[tuple[int, int], int]:
    """Bytes per (source rank, destination rank) that ``build_plan`` would move, local copies
    included (same process: the key's two ranks share a process) — the source choice alone,
    without messages or schedule (what a cost model needs at cluster scale)."""
    procs = procs or ProcessMap.disjoint(src.world_size, dst.world_size)
    check_compatible(src, dst)
    out: dict[tuple[int, int], int] = defaultdict(int)
    for p in _choose_sources(src, dst, procs):
        out[(p.src, p.dst)] += p.nbytes
    return dict(out)


def build_plan(
    src: ModelLayout,
    dst: ModelLayout,
    procs: ProcessMap | None = None,
    *,
    num_buffers: int = 2,
    buffer_bytes: int = 64 << 20,
    transport: str = "p2p",
) -> Plan:
    """Compute the plan; raises PlanError before anything moves if the sides cannot match.

    ``transport``: ``"p2p"`` sends everything with torch.distributed; ``"ipc"``
    has every receiver pull from its sources' memory (CUDA, one host; an error
    otherwise); ``"auto"`` uses IPC where both ends are CUDA on one host.
    """
    if transport not in TRANSPORTS:
        raise PlanError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if num_buffers < 1:
        raise PlanError(f"num_buffers must be >= 1, got {num_buffers}")
    if buffer_bytes < ALIGN:
        raise PlanError(f"buffer_bytes must be >= {ALIGN}, got {buffer_bytes}")
    procs = procs or ProcessMap.disjoint(src.world_size, dst.world_size)
    if len(procs.src) != src.world_size or len(procs.dst) != dst.world_size:
        raise PlanError(
            f"process map covers {len(procs.src)} source / {len(procs.dst)} destination ranks, "
            f"layouts have {src.world_size} / {dst.world_size}"
        )
    check_compatible(src, dst)
    pieces = _choose_sources(src, dst, procs)
    check_coverage(dst, pieces)

    local = tuple(p for p in pieces if procs.src[p.src] == procs.dst[p.dst])
    per_link: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in pieces:
        if procs.src[p.src] != procs.dst[p.dst]:
            per_link[(p.src, p.dst)].append(p)

    def link_transport(s: int, r: int) -> str:
        ok = procs.ipc_capable(procs.src[s], procs.dst[r])
        if transport == "ipc" and not ok:
            raise PlanError(
                f"transport 'ipc' needs source rank {s} ({procs.device_of(procs.src[s])}) and destination rank {r} "
                f"({procs.device_of(procs.dst[r])}) on CUDA devices of one host"
            )
        return "ipc" if ok and transport in ("ipc", "auto") else "p2p"

    # group each link's pieces into messages (link order, then piece order)
    raw: list[tuple[int, int, bool, list[Piece], list[int], int]] = []
    ipc_messages: list[Message] = []
    for (s, r), plist in sorted(per_link.items()):
        if link_transport(s, r) == "ipc":  # pulled piece by piece from mapped memory: no staging
            ipc_messages += [Message(s, r, 0, True, (p,), (0,), p.nbytes, "ipc") for p in plist]
            continue
        bucket: list[Piece] = []
        offs: list[int] = []
        used = 0

        def flush() -> None:
            nonlocal bucket, offs, used
            if bucket:
                raw.append((s, r, False, bucket, offs, used))
            bucket, offs, used = [], [], 0

        for p in plist:
            sbox = box_relative(p.box, src[p.tensor].box(s))
            dbox = box_relative(p.box, dst[p.tensor].box(r))
            if box_is_contiguous(sbox, box_shape(src[p.tensor].box(s))) and box_is_contiguous(
                dbox, box_shape(dst[p.tensor].box(r))
            ):
                raw.append((s, r, True, [p], [0], p.nbytes))
                continue
            for sub in split_box(p.box, max(1, buffer_bytes // p.itemsize)):
                q = Piece(p.tensor, p.src, p.dst, sub, p.itemsize)
                start = -(-used // ALIGN) * ALIGN
                if bucket and start + q.nbytes > buffer_bytes:
                    flush()
                    start = 0
                bucket.append(q)
                offs.append(start)
                used = start + q.nbytes
        flush()

    # schedule: earliest step >= the link's previous one where both ends have a free buffer.
    # Half the ring may be in flight per step, so the other half can be packed / unpacked
    # meanwhile (the executor overlaps consecutive steps on CUDA).
    per_step = max(1, num_buffers // 2)
    slots: dict[tuple[int, int], int] = defaultdict(int)  # (proc, step) -> buffers in use
    cursor: dict[tuple[int, int], int] = defaultdict(int)
    messages: list[Message] = []
    for s, r, direct, plist, offs, nbytes in raw:
        step = cursor[(s, r)]
        ps, pr = procs.src[s], procs.dst[r]
        if not direct:
            while slots[(ps, step)] >= per_step or slots[(pr, step)] >= per_step:
                step += 1
            slots[(ps, step)] += 1
            slots[(pr, step)] += 1
        cursor[(s, r)] = step
        messages.append(Message(s, r, step, direct, tuple(plist), tuple(offs), nbytes))
    messages.sort(key=lambda m: (m.step, m.src, m.dst))
    num_steps = max((m.step for m in messages), default=-1) + 1
    return Plan(src, dst, procs, num_buffers, buffer_bytes, transport, tuple(messages + ipc_messages), local, num_steps)
