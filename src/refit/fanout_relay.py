"""Fan-out as a pipelined relay: the trainer sends one copy of the model, and every replica forwards each
chunk to the next while it still receives the rest, so the trainer host's uplink carries one copy however
many replicas follow.

The tree (``relay_parents``): replica 0 receives from the trainer, replica ``i`` from replica
``(i - 1) // degree`` (``degree`` 1: a chain, the fastest on links of equal rate: every link carries one
copy). The plan (``relay_plan``) is one ``Plan`` over every edge of the tree. The trainer's edge is the
planner's choice between the trainer's layout and the replica's (any trainer layout into any replica
layout); each destination rank's pieces, in order, are one stream cut row-major into windows of
``chunk_bytes`` (by default the model / 64: ``chunk_bytes_for``), window ``k`` meant for step ``k``. A relay
forwards each piece it received, in the order it arrived, to the same rank of its child, in the step after
it arrived. Pieces are packed into messages of at most a chunk; each message gets the first step from its
window on in which its sender has a free send lane and its receiver a free receive lane (at most
``chunk_bytes`` and one packed message per step and direction). The executor runs a process's steps in
order, unpacking a step's receives before packing the next step's sends, so a relay forwards only what it
holds; on CPU it posts a step's receives while the step before is in flight (``recv_ahead``), so a sender
starts its next message as soon as its last one is out. Steps on different processes overlap, which is the
pipeline: window ``c`` leaves the trainer in step ``c`` and reaches the replica ``k`` hops down ``k`` steps
later. Total: about ``(chunks + depth - 1) / chunks`` copies' time (``refit.cost.relay_seconds``).

Limits: P2P only (a NIXL or IPC pull happens before the P2P steps, not in them), CPU only (on CUDA the
executor packs a step on its own stream without waiting for the previous step's unpacking), no delta (a
delta schedule runs its own loop). ``Fanout(relay=degree)`` refuses each with ``ConfigError``. A dead relay
is planned around as waves are: the tree is rebuilt over the replicas still alive and the version sent
again.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from refit.config import PIECE_ALIGN, TransferConfig
from refit.errors import ConfigError, PlanError
from refit.layout import ModelLayout
from refit.layout.tensors import Box, box_intersect, box_runs_whole, split_box
from refit.plan import Message, Piece, Plan, ProcessMap
from refit.plan.holders import stack_holder_sets
from refit.plan.planner import _pack_link
from refit.plan.sources import check_compatible, choose_sources, gc_paused


def relay_parents(replicas: int, degree: int = 1) -> list[int]:
    """The parent of each replica in the relay tree: -1 (the trainer) for replica 0, else replica
    ``(i - 1) // degree``."""
    if replicas < 1 or degree < 1:
        raise ValueError(f"relay_parents: replicas and degree must be >= 1, got {replicas} and {degree}")
    return [-1] + [(i - 1) // degree for i in range(1, replicas)]


def check_relay_config(config: TransferConfig, devices: Sequence[str] | None) -> None:
    """``ConfigError`` for what a relay cannot do: a transport but P2P, a delta, CUDA devices."""
    if config.transport != "p2p":
        raise ConfigError(
            f"Fanout(relay=...) forwards chunks over P2P steps; TransferConfig.transport={config.transport!r} "
            "pulls outside them: use transport='p2p' (or the waves, relay=0)"
        )
    if config.delta != "off":
        raise ConfigError(f"Fanout(relay=...) does not send deltas yet: TransferConfig.delta={config.delta!r}")
    cuda = sorted({d for d in devices or () if d.startswith("cuda")})
    if cuda:
        raise ConfigError(
            f"Fanout(relay=...) runs on CPU processes only (gloo); devices name {cuda[:2]}: on CUDA a step's "
            "packing is not ordered after the previous step's unpacking"
        )


def chunk_bytes_for(model_bytes: int, config: TransferConfig, chunks: int = 64) -> int:
    """A relay's chunk: the model in about ``chunks`` parts, within ``[64 KiB, config.buffer_bytes]``,
    a multiple of ``PIECE_ALIGN``."""
    size = min(config.buffer_bytes, max(64 << 10, -(-model_bytes // chunks)))
    return -(-size // PIECE_ALIGN) * PIECE_ALIGN


def relay_sides(
    trainer: ModelLayout, replica: ModelLayout, receivers: Sequence[int], parents: Sequence[int]
) -> tuple[list[int], ModelLayout, ModelLayout]:
    """The relays (receivers with children, in order) and the plan's two sides: the trainer's ranks then
    each relay's (holder sets), and each receiver's ranks."""
    relays = [receivers[i] for i in sorted({p for p in parents if p >= 0})]
    src = stack_holder_sets([trainer] + [replica for _ in relays])
    dst = stack_holder_sets([replica for _ in receivers])
    return relays, src, dst


# one edge of the tree as plan inputs: (parent's layout, its first source rank, its ranks' processes, the
# child's first destination rank, the parent's first destination rank or -1 for the trainer)
_Edge = tuple[ModelLayout, int, tuple[int, ...], int, int]


def relay_plan(
    trainer: ModelLayout,
    replica: ModelLayout,
    trainer_procs: Sequence[int],
    replica_procs: Sequence[Sequence[int]],
    receivers: Sequence[int],
    config: TransferConfig,
    degree: int = 1,
    devices: Sequence[str] | None = None,
) -> Plan:
    """The relay's plan (the module docstring) to ``receivers`` (replica indices, in tree order), with
    ``config.buffer_bytes`` as the chunk. ``replica_procs[j]``: the processes of replica ``j``'s ranks."""
    check_compatible(trainer, replica)
    parents = relay_parents(len(receivers), degree)
    relays, src, dst = relay_sides(trainer, replica, receivers, parents)
    nt, nr = trainer.world_size, replica.world_size
    procs = ProcessMap(
        tuple(trainer_procs) + tuple(p for j in relays for p in replica_procs[j]),
        tuple(p for j in receivers for p in replica_procs[j]),
        tuple(devices) if devices is not None else None,
    )
    edges: list[_Edge] = []
    for i, parent in enumerate(parents):
        if parent < 0:
            edges.append((trainer, 0, procs.src[:nt], i * nr, -1))
        else:
            k = relays.index(receivers[parent])
            edges.append((replica, nt + k * nr, procs.src[nt + k * nr : nt + (k + 1) * nr], i * nr, parent * nr))
    with gc_paused():
        return _build(src, dst, procs, config, edges, replica)


# what arrived at each destination rank: (piece, step), in step order as the plan is built
_Arrivals = dict[int, list[tuple[Piece, int]]]


def _trainer_pieces(edge: _Edge, replica: ModelLayout, procs: ProcessMap, chunk: int) -> list[tuple[Piece, bool, int]]:
    """The trainer's edge: the planner's choice between the two layouts, in the plan's rank numbers, with its
    direct flag and its window: each destination rank's pieces, in order, are one stream cut into windows of
    ``chunk`` bytes (a piece cut row-major where a window ends), so that window ``k`` fills step ``k``."""
    layout, s0, sprocs, d0, _ = edge
    sub = ProcessMap(sprocs, procs.dst[d0 : d0 + replica.world_size], procs.devices)
    fill: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # destination rank -> [window, bytes in it]
    out = []
    for name, h, r, box, item, _, direct in choose_sources(layout, replica, sub):
        part = next(p for p in layout[name].parts(h) if box_intersect(p, box) == box)
        dbox = replica[name].box(r)
        copied = sub.src[h] == sub.dst[r]  # colocated: a local copy, not on the wire
        for b, w in [(box, 0)] if copied else _windows(box, item, chunk, fill[r]):
            d = direct and box_runs_whole(b, part) and box_runs_whole(b, dbox)
            out.append((Piece(name, s0 + h, d0 + r, b, item), d, w))
    return out


def _windows(box: Box, item: int, chunk: int, fill: list[int]) -> list[tuple[Box, int]]:
    """``box`` cut row-major into parts that each fit what is left of one window of ``chunk`` bytes, with
    their windows; ``fill`` (``[window, bytes in it]``) is advanced past them. A row larger than a whole
    window is cut by ``split_box``, a window per part."""
    out: list[tuple[Box, int]] = []
    while True:
        room = chunk - fill[1]
        if _numel(box) * item <= room:
            out.append((box, fill[0]))
            fill[1] += _numel(box) * item
            return out
        cut = _cut(box, room // item)
        if cut is not None:
            out.append((cut[0], fill[0]))
            box = cut[1]
        elif fill[1] == 0:
            parts = split_box(box, max(1, chunk // item))
            out += [(b, fill[0] + i) for i, b in enumerate(parts)]
            fill[:] = [fill[0] + len(parts) - 1, _numel(parts[-1]) * item]
            return out
        fill[:] = [fill[0] + 1, 0]


def _cut(box: Box, numel: int) -> tuple[Box, Box] | None:
    """``box`` as its first rows of at most ``numel`` elements (along its first dimension longer than 1) and
    the rest; None when not one such row fits."""
    d = next((i for i, (lo, hi) in enumerate(box) if hi - lo > 1), None)
    if d is None:
        return None
    inner = _numel(box[d + 1 :])
    rows = numel // inner
    if rows < 1:
        return None
    lo, hi = box[d]
    return box[:d] + ((lo, lo + rows),) + box[d + 1 :], box[:d] + ((lo + rows, hi),) + box[d + 1 :]


def _relayed_pieces(edge: _Edge, replica: ModelLayout, arrived: _Arrivals) -> list[tuple[Piece, bool, int]]:
    """A relay's edge: each rank forwards what arrived at it, piece by piece in the order it arrived, to the
    child's rank of the same number (replicas share one layout), so each piece waits for one arrival only;
    its window is the step after its arrival."""
    _, s0, _, d0, p0 = edge
    out = []
    for q in range(replica.world_size):
        for p, step in arrived[p0 + q]:
            whole = replica[p.tensor].box(q)
            out.append((Piece(p.tensor, s0 + q, d0 + q, p.box, p.itemsize), box_runs_whole(p.box, whole), step + 1))
    return out


def _build(
    src: ModelLayout, dst: ModelLayout, procs: ProcessMap, config: TransferConfig, edges: list[_Edge], replica
) -> Plan:
    chunk = config.buffer_bytes
    lanes = _Lanes(chunk)
    arrived: _Arrivals = defaultdict(list)
    messages: list[Message] = []
    local: list[Piece] = []
    for edge in edges:  # parents before children: a relay's arrivals are known before it forwards
        relayed = edge[4] >= 0
        pieces = _relayed_pieces(edge, replica, arrived) if relayed else _trainer_pieces(edge, replica, procs, chunk)
        # messages per (window, link); the trainer's packed pieces per link (one packed message per step and
        # direction: packed per window, two sending ranks' messages would each take a step of their own)
        groups: dict[tuple[int, int, int], list[tuple[Piece, bool]]] = defaultdict(list)
        window: dict[Piece, int] = {}
        for p, d, w in pieces:
            if procs.src[p.src] == procs.dst[p.dst]:
                local.append(p)  # a colocated trainer rank: copied before the steps, from the trainer
                arrived[p.dst].append((p, -1))
            else:
                window[p] = w
                groups[w if d or relayed else -1, p.src, p.dst].append((p, d))
        raw: list = []
        for (_, s, r), plist in sorted(groups.items()):
            _pack_link(s, r, plist, chunk, raw)
        ready = [min(window[p] for p in m[3]) for m in raw]  # a message's first step: its first window's
        if relayed:  # and after its bytes arrived
            ready = [max(w, _ready(m[3], m[0] - edge[1] + edge[4], arrived)) for w, m in zip(ready, raw)]
        for first, n in sorted(zip(ready, range(len(raw)))):
            s, r, direct, plist, offs, nbytes = raw[n]
            step = lanes.take(procs.src[s], procs.dst[r], nbytes, not direct, first)
            messages.append(Message(s, r, step, direct, tuple(plist), tuple(offs), nbytes))
            arrived[r] += [(p, step) for p in plist]
    messages.sort(key=lambda m: (m.step, m.src, m.dst))
    num_steps = max((m.step for m in messages), default=-1) + 1
    return Plan(src, dst, procs, config, tuple(messages), tuple(local), num_steps)


def _ready(pieces: list[Piece], rank: int, arrived: _Arrivals) -> int:
    """The first step a relayed message may take: after every step that brought its bytes to destination
    rank ``rank`` (the relay's rank in its own edge). ``PlanError`` if the relay never receives one."""
    ready = 0
    for p in pieces:
        need = p.nbytes // p.itemsize
        for q, step in arrived[rank]:
            cut = box_intersect(q.box, p.box) if q.tensor == p.tensor else None
            if cut is not None:
                ready = max(ready, step + 1)
                need -= _numel(cut)
        if need:
            raise PlanError(
                f"relay: destination rank {rank} would forward {p.tensor!r} {list(p.box)} that it never receives"
            )
    return ready


def _numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


class _Lanes:
    """Per process and direction (send, receive), the bytes and packed messages taken in each step: a
    step holds at most ``step_bytes`` (or one larger message alone) and one packed message (its ring slot)."""

    def __init__(self, step_bytes: int) -> None:
        self.step_bytes = step_bytes
        self.used: dict[tuple[int, int], list[list[int]]] = defaultdict(list)  # (proc, dir) -> [bytes, packed]

    def _fits(self, lane: tuple[int, int], step: int, nbytes: int, packed: bool) -> bool:
        steps = self.used[lane]
        if step >= len(steps):
            return True
        used, n = steps[step]
        return (used == 0 or used + nbytes <= self.step_bytes) and not (packed and n)

    def _add(self, lane: tuple[int, int], step: int, nbytes: int, packed: bool) -> None:
        steps = self.used[lane]
        steps.extend([0, 0] for _ in range(step + 1 - len(steps)))
        steps[step][0] += nbytes
        steps[step][1] += packed

    def take(self, sender: int, receiver: int, nbytes: int, packed: bool, first: int) -> int:
        """The first step >= ``first`` with room on the sender's send lane and the receiver's receive lane."""
        step = first
        while not (self._fits((sender, 0), step, nbytes, packed) and self._fits((receiver, 1), step, nbytes, packed)):
            step += 1
        self._add((sender, 0), step, nbytes, packed)
        self._add((receiver, 1), step, nbytes, packed)
        return step
