"""The transfer plan: which source rank sends which box of which tensor to which destination rank.

Built once from the two sides' ModelLayouts and a process map (``refit.plan.procs``); a refit step only
executes it. Both sides derive it independently and compare ``digest``. Which replica serves each piece is
``refit.plan.sources``; this module groups the chosen pieces into messages and steps.

Pieces on a link are grouped into messages: a piece that is one contiguous run in both the source's and the
destination's local tensor travels alone and unpacked ("direct"); the others are packed into buckets of at
most ``buffer_bytes``. Messages are scheduled into steps so that no process has more than half of its
``num_buffers`` ring in flight in one step (the other half is being packed or unpacked), never more than
``num_buffers`` at once. Links between CUDA processes of one host may use IPC (``transport``): the receiver
pulls each piece from the source's mapped memory, no staging. Links may use NIXL (``transport`` "nixl", or
"auto" between hosts): the receiver reads each piece from the source's registered memory, one message per
piece, no staging.

This module knows nothing of devices or transports.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from operator import attrgetter

from refit.config import PIECE_ALIGN, TransferConfig
from refit.errors import PlanError
from refit.layout.tensors import (
    Box,
    ModelLayout,
    box_intersect,
    box_numel,
    split_box,
)
from refit.plan.procs import ProcessMap
from refit.plan.sources import Choice, canonical_tensor, check_compatible, choose_sources, gc_paused


@dataclass(frozen=True, slots=True)
class Piece:
    """One box of one tensor, from a source rank to a destination rank (global coordinates).

    ``nbytes`` is computed from the box unless given (the planner knows it already)."""

    tensor: str
    src: int
    dst: int
    box: Box
    itemsize: int
    nbytes: int = field(default=-1, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            object.__setattr__(self, "nbytes", box_numel(self.box) * self.itemsize)


@dataclass(frozen=True, slots=True)
class Message:
    """One transfer on a link: a direct piece, or a bucket of packed pieces with byte offsets."""

    src: int
    dst: int
    step: int
    direct: bool
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]  # byte offset of each piece in the staging buffer (packed only)
    nbytes: int  # bytes on the wire (packed: buffer length incl. alignment)
    transport: str = "p2p"  # "p2p": torch.distributed send/recv; "ipc" / "nixl": the receiver pulls the piece


@dataclass(frozen=True)
class Plan:
    """A built plan: every message (link, step, pieces, buffer offsets) and same-process copy of one refit.

    Made by ``build_plan`` from two layouts, a process map and a ``TransferConfig``; immutable. Every
    process of the refit builds it on its own and must get the same ``digest`` (pre-flight checks).
    ``messages`` are sorted by (step, source rank, destination rank), P2P before IPC and NIXL: that order is part
    of the contract, since ring slots and P2P tags are derived from it (``plan.schedule``). ``num_steps``:
    the P2P steps (IPC and NIXL messages are all step 0, pulled at once); ``local``: pieces whose source and
    destination rank share a process (copied, never sent).
    """

    src_layout: ModelLayout
    dst_layout: ModelLayout
    procs: ProcessMap
    config: TransferConfig
    messages: tuple[Message, ...]
    local: tuple[Piece, ...]  # same-process copies
    num_steps: int

    @property
    def num_buffers(self) -> int:
        return self.config.num_buffers

    @property
    def buffer_bytes(self) -> int:
        return self.config.buffer_bytes

    @property
    def transport(self) -> str:
        return self.config.transport

    # ---------------------------------------------------------------- stats
    @cached_property
    def bytes_needed(self) -> int:
        """Bytes all destination ranks hold once the refit is done."""
        return sum(box_numel(b) * t.itemsize for t in self.dst_layout for r in t.ranks if (b := t.box(r)) is not None)

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
        """What every process must agree on besides the messages, independent of how the layouts were
        described (mesh names etc.): both sides' tensors with every rank's box, the process map, the
        devices and ``config.agreement()``. Plain JSON data; pre-flight compares it part by part to name
        the first difference."""
        with gc_paused():  # its lists are few per tensor, but no collection should walk the plan meanwhile
            return {
                "src": [canonical_tensor(t) for t in self.src_layout],
                "dst": [canonical_tensor(t) for t in self.dst_layout],
                "procs": [list(self.procs.src), list(self.procs.dst)],
                "devices": list(self.procs.devices) if self.procs.devices is not None else None,
                "config": self.config.agreement(),
            }

    @cached_property
    def digest(self) -> str:
        """sha256 over ``canonical()`` (as JSON), then every message and local copy packed as 64-bit ints.

        Equal on two processes exactly when they would run the same plan: it changes with any layout
        box, the process map, a device, an agreed config field, and any message's link, step, transport,
        offsets or piece (tensor, ranks, box), or any local copy."""
        with gc_paused():  # nothing it allocates outlives it: no collection needs to walk the plan meanwhile
            h = hashlib.sha256(json.dumps(self.canonical(), sort_keys=True, separators=(",", ":")).encode())
            index = {t.name: i for i, t in enumerate(self.dst_layout)}  # the order canonical() hashed
            h.update(_packed([self.num_steps, len(self.messages), len(self.local)]))
            for lo in range(0, len(self.messages), _DIGEST_CHUNK):
                for column in _message_columns(self.messages[lo : lo + _DIGEST_CHUNK], index):
                    h.update(_packed(column))
            for lo in range(0, len(self.local), _DIGEST_CHUNK):
                for column in _piece_columns(self.local[lo : lo + _DIGEST_CHUNK], index):
                    h.update(_packed(column))
        return h.hexdigest()[:16]

    # ---------------------------------------------------------------- per process
    def local_of(self, proc: int) -> list[Piece]:
        return [p for p in self.local if self.procs.dst[p.dst] == proc]

    def link_bytes_of(self, proc: int) -> tuple[int, int]:
        """Bytes process ``proc`` sends and receives over links (P2P, IPC, NIXL) in one refit."""
        src, dst = self.procs.src, self.procs.dst
        sent = sum(p.nbytes for m in self.messages if src[m.src] == proc for p in m.pieces)
        return sent, sum(p.nbytes for m in self.messages if dst[m.dst] == proc for p in m.pieces)

    def transports_of(self, proc: int) -> set[str]:
        """The transports of the messages process ``proc`` sends or receives."""
        return {m.transport for m in self.messages if proc in (self.procs.src[m.src], self.procs.dst[m.dst])}


# ---------------------------------------------------------------------------- digest
# The digest reads the plan column by column (one attribute of every message or piece at a time) through
# C-level iterators: at cluster scale (~10^6 pieces) a Python loop per piece would be most of its cost.

_DIGEST_CHUNK = 1 << 16  # messages (or local pieces) hashed at a time
_TRANSPORT_CODES = {"p2p": 0, "ipc": 1, "nixl": 2}
_PIECES, _OFFSETS, _TRANSPORT, _TENSOR, _BOX = (
    attrgetter(a) for a in ("pieces", "offsets", "transport", "tensor", "box")
)
_MESSAGE_INTS = tuple(attrgetter(a) for a in ("src", "dst", "step", "direct", "nbytes"))
_PIECE_INTS = tuple(attrgetter(a) for a in ("src", "dst"))


def _packed(words: Iterable[int]) -> bytes:
    """Little-endian signed 64-bit ints (the same bytes on every host)."""
    a = array("q", words)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _message_columns(messages: Sequence[Message], index: dict[str, int]) -> Iterator[Iterable[int]]:
    """Link, step, direct, bytes and transport of every message, its offsets and pieces (counts first,
    so every column's length follows from the ones before it)."""
    for get in _MESSAGE_INTS:
        yield map(get, messages)
    transports = list(map(_TRANSPORT, messages))
    unknown = set(transports) - _TRANSPORT_CODES.keys()
    if unknown:
        raise PlanError(f"plan has messages with unknown transport(s) {sorted(unknown)}; known: p2p, ipc, nixl")
    yield map(_TRANSPORT_CODES.__getitem__, transports)
    yield map(len, map(_OFFSETS, messages))
    yield chain.from_iterable(map(_OFFSETS, messages))
    yield map(len, map(_PIECES, messages))
    yield from _piece_columns(list(chain.from_iterable(map(_PIECES, messages))), index)


def _piece_columns(pieces: Sequence[Piece], index: dict[str, int]) -> Iterator[Iterable[int]]:
    """Tensor (its index in the destination layout), source and destination rank, and box of every piece."""
    yield map(index.__getitem__, map(_TENSOR, pieces))
    for get in _PIECE_INTS:
        yield map(get, pieces)
    boxes = list(map(_BOX, pieces))
    yield map(len, boxes)
    yield chain.from_iterable(chain.from_iterable(boxes))


# ---------------------------------------------------------------------------- building


def check_coverage(dst: ModelLayout, pieces: list[Piece]) -> None:
    """Every destination element is written exactly once (pieces inside the box, pairwise
    disjoint, their sizes summing to the box's). The planner guarantees it by construction
    (disjoint source tiles covering each tensor, each destination box cut by every tile,
    sizes summed in ``choose_sources``); this independent check is for tests and callers
    who assemble pieces themselves."""
    by_target: dict[tuple[str, int], list[Box]] = defaultdict(list)
    for p in pieces:
        by_target[p.tensor, p.dst].append(p.box)
    for t in dst:
        for r, want in t._all_boxes.items():
            n_want = box_numel(want)
            if n_want == 0:
                continue
            got = sorted(by_target.get((t.name, r), ()))
            n = 0
            for i, a in enumerate(got):
                if any(lo < wlo or hi > whi for (lo, hi), (wlo, whi) in zip(a, want)):
                    raise PlanError(
                        f"tensor {t.name!r}: piece {list(a)} for destination rank {r} lies outside its box {list(want)}"
                    )
                n += box_numel(a)
                for b in got[i + 1 :]:  # sorted by the first dim: only boxes starting before a ends can meet it
                    if a and b[0][0] >= a[0][1]:
                        break
                    if box_intersect(a, b) is not None:
                        raise PlanError(
                            f"tensor {t.name!r}: destination rank {r} would be written twice in "
                            f"{list(box_intersect(a, b))}"
                        )
            if n != n_want:
                raise PlanError(
                    f"tensor {t.name!r}: destination rank {r} would receive {n} of {n_want} elements of box "
                    f"{list(want)} (coverage gap)"
                )


def build_plan(
    src: ModelLayout,
    dst: ModelLayout,
    procs: ProcessMap | None = None,
    config: TransferConfig | None = None,
) -> Plan:
    """Compute the plan; raises PlanError before anything moves if the sides cannot match.

    ``config`` (default ``TransferConfig()``) gives the staging budget (``num_buffers`` x
    ``buffer_bytes``) and the transport: ``"p2p"`` sends everything with torch.distributed;
    ``"ipc"`` has every receiver pull from its sources' memory (CUDA, one host; an error
    otherwise); ``"nixl"`` has every receiver pull through NIXL; ``"auto"`` uses IPC where both ends
    are CUDA on one host, NIXL between hosts where installed (``TransferConfig.cross_host``), else P2P.
    """
    config = config if config is not None else TransferConfig()
    procs = procs or ProcessMap.disjoint(src.world_size, dst.world_size)
    if len(procs.src) != src.world_size or len(procs.dst) != dst.world_size:
        raise PlanError(
            f"process map covers {len(procs.src)} source / {len(procs.dst)} destination ranks, "
            f"layouts have {src.world_size} / {dst.world_size}"
        )
    check_compatible(src, dst)
    with gc_paused():
        return _build(src, dst, procs, config)


def _build(src: ModelLayout, dst: ModelLayout, procs: ProcessMap, config: TransferConfig) -> Plan:
    """Sources chosen, each link's pieces grouped into messages (IPC and NIXL links: one per piece), the
    packed ones scheduled into steps."""
    local, per_link = _by_link(choose_sources(src, dst, procs), procs)
    raw: list[_Raw] = []
    ipc_messages: list[Message] = []
    for (s, r), plist in sorted(per_link.items()):
        kind = _link_transport(procs, config, s, r)
        if kind == "ipc":  # pulled piece by piece: no staging
            ipc_messages += [Message(s, r, 0, True, (p,), (0,), p.nbytes, "ipc") for p, _ in plist]
        elif kind == "nixl":  # read piece by piece (one descriptor per contiguous run): no staging
            ipc_messages += [Message(s, r, 0, dr, (p,), (0,), p.nbytes, "nixl") for p, dr in plist]
        else:
            _pack_link(s, r, plist, config.buffer_bytes, raw)
    messages = _schedule(raw, procs, config.num_buffers)
    num_steps = max((m.step for m in messages), default=-1) + 1
    return Plan(src, dst, procs, config, tuple(messages + ipc_messages), local, num_steps)


def _by_link(
    choices: list[Choice], procs: ProcessMap
) -> tuple[tuple[Piece, ...], dict[tuple[int, int], list[tuple[Piece, bool]]]]:
    """The chosen pieces as Pieces: the same-process copies, and per link (source rank, destination
    rank) the others, in choice order, each with its direct flag."""
    local: list[Piece] = []
    per_link: dict[tuple[int, int], list[tuple[Piece, bool]]] = defaultdict(list)
    for name, h, r, box, item, nb, dr in choices:
        p = Piece(name, h, r, box, item, nb)
        if procs.src[h] == procs.dst[r]:
            local.append(p)
        else:
            per_link[(h, r)].append((p, dr))
    return tuple(local), per_link


def _link_transport(procs: ProcessMap, config: TransferConfig, s: int, r: int) -> str:
    """``"nixl"`` where the config asks for it; ``"ipc"`` where the config allows it and both ends are CUDA
    on one host; between hosts ``config.cross_host``; else ``"p2p"``. Raises PlanError where the config
    demands IPC and the link cannot have it."""
    transport = config.transport
    if transport == "nixl":
        return "nixl"
    ok = procs.ipc_capable(procs.src[s], procs.dst[r])
    if transport == "auto" and not ok and procs.host_of(procs.src[s]) != procs.host_of(procs.dst[r]):
        return config.cross_host
    if transport == "ipc" and not ok:
        raise PlanError(
            f"transport 'ipc' needs source rank {s} ({procs.device_of(procs.src[s])}) and destination rank {r} "
            f"({procs.device_of(procs.dst[r])}) on CUDA devices of one host"
        )
    return "ipc" if ok and transport in ("ipc", "auto") else "p2p"


# one P2P message before it has a step: (source rank, destination rank, direct, pieces, offsets, bytes)
_Raw = tuple[int, int, bool, list[Piece], list[int], int]


def _pack_link(s: int, r: int, plist: list[tuple[Piece, bool]], buffer_bytes: int, raw: list[_Raw]) -> None:
    """Append one P2P link's messages to ``raw``, in piece order: a direct piece travels alone; the others
    are packed at ``PIECE_ALIGN``-ed offsets into buckets of at most ``buffer_bytes`` (a larger piece is split
    row-major first)."""
    bucket: list[Piece] = []
    offs: list[int] = []
    used = 0
    for p, dr in plist:
        if dr:
            raw.append((s, r, True, [p], [0], p.nbytes))
            continue
        subs = [p.box] if p.nbytes <= buffer_bytes else split_box(p.box, max(1, buffer_bytes // p.itemsize))
        for sub in subs:
            q = p if sub is p.box else Piece(p.tensor, p.src, p.dst, sub, p.itemsize)
            start = -(-used // PIECE_ALIGN) * PIECE_ALIGN
            if bucket and start + q.nbytes > buffer_bytes:
                raw.append((s, r, False, bucket, offs, used))
                bucket, offs, start = [], [], 0
            bucket.append(q)
            offs.append(start)
            used = start + q.nbytes
    if bucket:
        raw.append((s, r, False, bucket, offs, used))


def _schedule(raw: list[_Raw], procs: ProcessMap, num_buffers: int) -> list[Message]:
    """Give every message of ``raw`` (grouped by link, in link order) its step and sort by (step, link).

    A packed message takes the earliest step >= its link's previous one where both ends have a free
    buffer; half the ring may be in flight per step, so the other half can be packed / unpacked
    meanwhile (the executor overlaps consecutive steps on CUDA). A direct message needs no buffer: it
    goes in its link's current step."""
    steps = _StepBuffers(max(1, num_buffers // 2))
    messages: list[Message] = []
    psrc, pdst = procs.src, procs.dst
    link, step = None, 0
    for s, r, direct, plist, offs, nbytes in raw:
        if (s, r) != link:
            link, step = (s, r), 0
        if not direct:
            step = steps.take_both(psrc[s], pdst[r], step)
        messages.append(Message(s, r, step, direct, tuple(plist), tuple(offs), nbytes))
    messages.sort(key=lambda m: (m.step, m.src, m.dst))
    return messages


class _StepBuffers:
    """Buffers each process has in flight per step (at most ``per_step``), and the first step from a
    given one where a process has a free buffer.

    A full step points past itself (``skip``, paths compressed as they are walked), so a busy process's
    full steps are jumped over, not rescanned, for every message."""

    def __init__(self, per_step: int) -> None:
        self.per_step = per_step
        self.used: dict[int, list[int]] = defaultdict(list)  # proc -> buffers in use per step
        self.skip: dict[int, list[int]] = defaultdict(list)  # proc -> per step: itself if free, else a later step

    def free_from(self, proc: int, step: int) -> int:
        """The first step >= ``step`` where ``proc`` has a free buffer."""
        skip = self.skip[proc]
        n = len(skip)
        free = step
        while free < n and skip[free] != free:
            free = skip[free]
        while step < n and skip[step] != step:  # every step walked over now points at ``free``
            skip[step], step = free, skip[step]
        return free

    def take_both(self, a: int, b: int, step: int) -> int:
        """Take a buffer on processes ``a`` and ``b`` in the first step >= ``step`` where both have one."""
        while True:
            step = self.free_from(a, step)
            later = self.free_from(b, step)
            if later == step:
                break
            step = later
        self._take(a, step)
        self._take(b, step)
        return step

    def _take(self, proc: int, step: int) -> None:
        used, skip = self.used[proc], self.skip[proc]
        if step >= len(used):
            skip.extend(range(len(used), step + 1))
            used.extend([0] * (step + 1 - len(used)))
        used[step] += 1
        if used[step] >= self.per_step:
            skip[step] = step + 1
