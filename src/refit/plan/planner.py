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
     that box's receivers. The load of every forced piece (a box with a single
     holder, or one chosen by 1. or 2.) is counted before this choice starts.

Pieces on a link are grouped into messages: a piece that is one contiguous run
in both the source's and the destination's local tensor travels alone and
unpacked ("direct"); the others are packed into buckets of at most
``buffer_bytes``. Messages are scheduled into steps so that no process has
more than half of its ``num_buffers`` ring in flight in one step (the other
half is being packed or unpacked), never more than ``num_buffers`` at once.
Links between CUDA processes of one host may use IPC (``transport``): the
receiver pulls each piece from the source's mapped memory, no staging. Links
may use NIXL (``transport`` "nixl", or "auto" between hosts): the receiver reads
each piece from the source's registered memory, one message per piece, no staging.

This module knows nothing of devices or transports.
"""

from __future__ import annotations

import contextlib
import gc
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
    TensorLayout,
    box_intersect,
    box_numel,
    box_runs_whole,
    split_box,
)


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

    def with_devices(self, devices) -> ProcessMap:
        return ProcessMap(self.src, self.dst, tuple(devices))

    @classmethod
    def disjoint(cls, n_src: int, n_dst: int) -> ProcessMap:
        """Trainer ranks are processes ``0..n_src-1``, engine ranks follow."""
        return cls(tuple(range(n_src)), tuple(range(n_src, n_src + n_dst)))

    @classmethod
    def colocated(cls, n_src: int, n_dst: int) -> ProcessMap:
        """Source rank i and destination rank i share process i."""
        return cls(tuple(range(n_src)), tuple(range(n_dst)))

    @property
    def world_size(self) -> int:
        return len(set(self.src) | set(self.dst))


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
        with _gc_paused():  # its lists are few per tensor, but no collection should walk the plan meanwhile
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
        with _gc_paused():  # nothing it allocates outlives it: no collection needs to walk the plan meanwhile
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


def canonical_tensor(t: TensorLayout) -> list:
    """``[name, shape, dtype, ranks, boxes]`` (and ``row_block`` where set): every rank holding a part
    (sorted) and its box, as JSON lists; equal for equivalent layouts however described (mesh names,
    explicit boxes)."""
    lists: dict[int, list] = {}  # id(box) -> its JSON form: the ranks of one shard share a box object
    boxes = []
    for b in t._all_boxes.values():
        j = lists.get(id(b))
        if j is None:
            j = lists[id(b)] = [list(x) for x in b]
        boxes.append(j)
    out = [t.name, list(t.shape), str(t.dtype).removeprefix("torch."), list(t._all_boxes), boxes]
    return out if t.row_block is None else [*out, t.row_block]


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
        raise PlanError(f"{len(extra)} source tensor(s) are not wanted by the destination, first: {extra[0]!r}")
    for d in dst:
        s = src[d.name]
        if s.shape != d.shape:
            raise PlanError(f"tensor {d.name!r}: source shape {list(s.shape)} != destination shape {list(d.shape)}")
        if s.dtype != d.dtype:
            raise PlanError(f"tensor {d.name!r}: source dtype {s.dtype} != destination dtype {d.dtype}")


def _source_tiles(t: TensorLayout) -> list[tuple[Box, list[int]]]:
    """Distinct source boxes with their holders, cut into the parts the holders store separately
    (``row_block``); they must tile the tensor exactly."""
    tiles = sorted(t.holders().items())
    if t.row_block is not None:
        tiles = [(part, holders) for box, holders in tiles for part in t.parts(holders[0])]
    if t.boxes is not None:  # boxes from a mesh and placements are disjoint by construction
        for i, (a, _) in enumerate(tiles):
            for b, _ in tiles[i + 1 :]:
                if box_intersect(a, b) is not None:
                    raise PlanError(
                        f"tensor {t.name!r}: source boxes {list(a)} and {list(b)} overlap without being replicas"
                    )
    covered = sum(box_numel(b) for b, _ in tiles)
    if covered != t.numel:
        raise PlanError(
            f"tensor {t.name!r} {list(t.shape)}: source ranks hold {covered} of {t.numel} elements (coverage gap)"
        )
    return tiles


def check_coverage(dst: ModelLayout, pieces: list[Piece]) -> None:
    """Every destination element is written exactly once (pieces inside the box, pairwise
    disjoint, their sizes summing to the box's). The planner guarantees it by construction
    (disjoint source tiles covering each tensor, each destination box cut by every tile,
    sizes summed in ``_choose_sources``); this independent check is for tests and callers
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


# (tensor, source rank, destination rank, global box, itemsize, bytes, direct): one piece before it is a
# Piece; direct: one contiguous run in both the source's and the destination's local tensor
_Choice = tuple[str, int, int, Box, int, int, bool]
# a piece whose source LPT still has to choose: (its index in the choices, tensor, destination rank, box,
# holders, the receiver's index among the tile's receivers, itemsize, bytes, direct)
_Open = tuple[int, str, int, Box, list[int], int, int, int, bool]


def _choose_sources(src: ModelLayout, dst: ModelLayout, procs: ProcessMap) -> list[_Choice]:
    """Every piece every destination rank needs, with its source rank, in a stable order.

    Pieces whose source is forced (a single holder, one in the receiver's process or on its
    device, or the counterpart of an identically laid-out tensor) are fixed first and
    count as load before the others are chosen by LPT. Plain tuples, not Pieces: at
    cluster scale (~10^6 pieces) object creation is most of the cost.
    """
    out: list[_Choice | None] = []  # in receiver order; None where LPT still has to choose
    open_: list[_Open] = []
    for d in dst:
        _tensor_choices(src[d.name], d, procs, out, open_)
    if open_:
        _choose_least_loaded(out, open_, procs)
    return out  # type: ignore[return-value]  (every None was filled)


def _receivers(d: TensorLayout) -> tuple[list[Box], list[tuple[int, int]]]:
    """The distinct non-empty boxes of ``d`` (replicas share one), and every rank holding one, in rank
    order, with the index of its box."""
    distinct: dict[Box, int] = {}  # box -> index in dboxes, -1 for an empty box
    dboxes: list[Box] = []
    ranks_in_order: list[tuple[int, int]] = []
    for r, b in d._all_boxes.items():
        i = distinct.get(b)
        if i is None:
            i = distinct[b] = len(dboxes) if box_numel(b) > 0 else -1
            if i >= 0:
                dboxes.append(b)
        if i >= 0:
            ranks_in_order.append((r, i))
    return dboxes, ranks_in_order


def _tensor_choices(
    s: TensorLayout, d: TensorLayout, procs: ProcessMap, out: list[_Choice | None], open_: list[_Open]
) -> None:
    """Append the pieces of destination tensor ``d`` to ``out``, tile by tile, receivers in rank order:
    forced sources fixed, the others ``None`` with their entry in ``open_``. Raises PlanError if a
    destination box would not be covered exactly."""
    item = d.itemsize
    dboxes, ranks_in_order = _receivers(d)
    got = [0] * len(dboxes)  # bytes each distinct box receives, summed over the tiles
    identical: bool | None = None  # same boxes on both sides: computed only when it matters
    for tile, holders in _source_tiles(s):
        cut = [box_intersect(tile, b) for b in dboxes]  # once per distinct box, not per rank
        nbytes = [box_numel(c) * item if c is not None else 0 for c in cut]
        got = [a + b for a, b in zip(got, nbytes)]
        # holders hold exactly ``tile``: contiguity on both sides is a property of the cut
        direct = [c is not None and box_runs_whole(c, tile) and box_runs_whole(c, b) for c, b in zip(cut, dboxes)]
        if len(holders) == 1:
            h = holders[0]
            out += [(d.name, h, r, cut[i], item, nbytes[i], direct[i]) for r, i in ranks_in_order if nbytes[i]]
            continue
        by_proc, by_dev = _nearest_holders(holders, procs)
        k = 0  # the receiver's index among this tile's receivers
        for r, i in ranks_in_order:
            nb = nbytes[i]
            if not nb:
                continue
            near = by_proc.get(procs.dst[r])
            if near is None and by_dev:
                near = by_dev.get(procs.device_of(procs.dst[r]))
            if near is not None:
                out.append((d.name, near, r, cut[i], item, nb, direct[i]))
            elif r in holders and (
                identical if identical is not None else (identical := canonical_tensor(s) == canonical_tensor(d))
            ):
                out.append((d.name, r, r, cut[i], item, nb, direct[i]))
            else:
                open_.append((len(out), d.name, r, cut[i], holders, k, item, nb, direct[i]))
                out.append(None)
            k += 1
    for b, n in zip(dboxes, got):  # disjoint tiles covering the tensor cut every box exactly once
        if n != box_numel(b) * item:
            r = next(r for r, i in ranks_in_order if dboxes[i] == b)
            raise PlanError(
                f"tensor {d.name!r}: destination rank {r} would receive {n // item} of "
                f"{box_numel(b)} elements of box {list(b)} (coverage gap)"
            )


def _nearest_holders(holders: list[int], procs: ProcessMap) -> tuple[dict[int, int], dict[str, int]]:
    """The first holder in each process, and (with devices) on each device: looked up, not scanned."""
    by_proc: dict[int, int] = {}
    by_dev: dict[str, int] = {}
    for h in holders:
        by_proc.setdefault(procs.src[h], h)
        if procs.devices is not None:
            by_dev.setdefault(procs.device_of(procs.src[h]), h)
    return by_proc, by_dev


def _choose_least_loaded(out: list[_Choice | None], open_: list[_Open], procs: ProcessMap) -> None:
    """Fill every open choice: largest pieces first (LPT), each to the least-loaded holder by bytes sent
    over links so far (forced pieces counted first); ties go to the rotation that starts at the
    receiver's index among the tile's receivers."""
    load: dict[int, int] = defaultdict(int)
    for c in out:
        if c is not None and not procs.same_device(procs.src[c[1]], procs.dst[c[2]]):
            load[c[1]] += c[5]
    for at, name, r, piece, holders, k, item, nb, dr in sorted(open_, key=lambda x: (-x[7], x[0])):
        start = k % len(holders)
        h = min(holders[start:] + holders[:start], key=load.__getitem__)  # first of equals (defaultdict: 0 if unseen)
        load[h] += nb
        out[at] = (name, h, r, piece, item, nb, dr)


@contextlib.contextmanager
def _gc_paused():
    """The cyclic garbage collector off while the planner allocates millions of tuples that
    stay alive (at cluster scale its repeated full passes were most of the build time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def link_bytes(src: ModelLayout, dst: ModelLayout, procs: ProcessMap | None = None) -> dict[tuple[int, int], int]:
    """Bytes per (source rank, destination rank) that ``build_plan`` would move, local copies
    included (same process: the key's two ranks share a process) — the source choice alone,
    without messages or schedule (what a cost model needs at cluster scale)."""
    procs = procs or ProcessMap.disjoint(src.world_size, dst.world_size)
    check_compatible(src, dst)
    out: dict[tuple[int, int], int] = defaultdict(int)
    with _gc_paused():
        for _, h, r, _, _, nb, _ in _choose_sources(src, dst, procs):
            out[(h, r)] += nb
    return dict(out)


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
    with _gc_paused():
        return _build(src, dst, procs, config)


def _build(src: ModelLayout, dst: ModelLayout, procs: ProcessMap, config: TransferConfig) -> Plan:
    """Sources chosen, each link's pieces grouped into messages (IPC and NIXL links: one per piece), the
    packed ones scheduled into steps."""
    local, per_link = _by_link(_choose_sources(src, dst, procs), procs)
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
    choices: list[_Choice], procs: ProcessMap
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
