"""Cost model: predicted refit time per strategy on a cluster, from the bytes each pair of GPUs
exchanges, and the busiest resource.

A ``Topology`` (nodes, GPUs per node, NVLink, HBM, NICs) is read from JSON; every number is
validated (finite, > 0) with an error naming the field. A transfer set maps (source GPU,
destination GPU) -> bytes; its time is the largest load over the resources it uses, each moving
bytes at its own speed, all at once (the bottleneck bound; refit's executor keeps every link
busy, so measured refits sit a few percent above it — docs/benchmarks.md checks it against
nvidia-h200-x2 runs):

- ``hbm`` of a GPU: a same-GPU copy reads and writes (2x its bytes), a peer or network transfer
  reads on the sender and writes on the receiver; capacity ``hbm_gbps`` (read + write).
- ``nvlink_out`` / ``nvlink_in`` of a GPU: transfers to / from another GPU of its node.
- ``nic_out`` / ``nic_in`` of a GPU: transfers to / from another node, at one NIC's speed
  (``nic_mode`` "auto": the nearest NIC) or at all the node's NICs' speed capped by the GPU's
  PCIe link ("stripe"); ``node_nic_out`` / ``node_nic_in``: a node's NICs together ("first": the
  node's first NIC alone, whatever GPU sends: what gloo does on a host whose NICs share a subnet, its
  connecting TCP sockets binding no address, so that the route table's one NIC carries them all).

Strategies (``predict``):
- ``broadcast``: one trainer rank sends the whole model (engine dtype) to every engine GPU as a
  pipelined ring (NCCL's broadcast): every hop carries every byte, so time = model bytes / the
  slowest hop (NIC when the ring crosses nodes, else NVLink). The gather onto that rank before
  it is not counted (in its favour). Hops inside a node run at NCCL's speed (``nccl_gbps``).
- ``p2p``: refit's plan from all trainer ranks (``plan.link_bytes``: the planner's own source
  choice), placed on GPUs: trainer ranks on the first GPUs, engine ranks after them (or on the
  same GPUs when colocated).
- ``nixl`` (with ``nixl_nic_mode``): the same plan pulled through NIXL, whose UCX backend uses the
  NICs refit selects (``refit.transport.nics``: ``REFIT_NIC_MODE``): its cross-node links run at
  ``gpu_nic_gbps`` of that mode ("stripe": every NIC of the node, capped by PCIe; "auto": the
  nearest one), whatever the topology's own ``nic_mode`` says (that one describes NCCL's choice).
- ``delta`` (with ``changed_fraction``): refit's plan sending only the changed elements
  (``refit.delta.rule``): per link the encoding ``delta="auto"`` picks for that fraction over that
  link (dense on a same-GPU link; per 64-bit word where ``prefer_words`` says words beat the element
  encodings, as on NVLink and NICs for bf16, each word then changed with probability
  ``1 - (1 - f)**(8 / itemsize)``); a sender's ``find`` resource reads base and current (2x the
  link's dense bytes) and packs, a receiver's ``scatter`` applies, at the rule's rates (``LINKS``);
  the wire carries the encoded bytes. Links inside a node are CUDA IPC pulls (``transport="auto"``), each pair
  that pulls a delta paying ``IPC_PAIR_S`` on its receiver (the staging's header read and wait); across nodes the
  fixed cost per chunk of a P2P delta step (``chunk_s``) is not counted: it depends on the staging budget, not on
  the cluster.
  Changes are taken as spread evenly (an optimizer step on bf16 weights), so every link sees the
  same fraction; FP8 engines: the same
  fraction of FP8 elements (the blocks whose inputs changed are re-quantised; an element whose FP8
  value did not change is not sent).
- ``nixl-delta`` (with both ``nixl_nic_mode`` and ``changed_fraction``): ``delta`` over the NIXL NICs: the source
  finds and stages the changed words into registered staging (``find``), the receiver reads them (the NICs) and
  scatters them (``scatter``, plus ``NIXL_PAIR_S`` per pair that pulls a delta: the sealed record, one READ).
- ``fanout``: waves (``refit.fanout``) — the engine replicas that hold the version become sources; with the
  trainer as one more source group, the number of holders doubles per wave (ceil(log2(R + 1)) waves). Each wave
  is the plan ``Fanout`` builds for it (``refit.fanout_waves.waves_for``: sources the trainer ranks and the replicas
  that hold the version, the planner's own choice among them, which balances bytes per sending rank, not per
  node), placed on GPUs (``fanout_gpus``: each replica on nodes of its own after the trainer's where the
  topology has them, as the relay's; else packed after the trainer's GPUs, as the p2p row's engine ranks). A
  wave's time is its bottleneck bound; waves run one after another (a wave's receivers serve the next), so the
  time is their sum.
- ``relay`` (with ``relay`` = the tree's degree d, 1: a chain; ``Fanout(relay=d)``, ``refit.fanout_relay``): every
  edge of the tree at once, each replica on nodes of its own after the trainer's: the trainer's edge is refit's
  plan into replica 0, a relay sends each of its ranks' bytes to the same rank of each child. Their bottleneck
  bound is the steady pipeline (a chain on equal links: one copy over one link; degree d: d copies over a
  relay's NIC), times ``(chunks + depth - 1) / chunks`` for filling it (``relay_seconds``: ``chunks`` windows of
  ``chunk_bytes_for`` per destination rank, ``depth`` hops to the deepest replica). TCP/IP headers are not
  counted (about 4.6% on 1500-byte frames).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, fields, replace
from typing import Any

from refit.config import TransferConfig
from refit.delta.rule import (
    IPC_PAIR_S,
    LINKS,
    NIXL_PAIR_S,
    LinkSpeed,
    choose_encoding,
    choose_words,
    may_pay,
    prefer_words,
    words_changed,
)
from refit.delta.wire import INDEX_BYTES, wire_bytes
from refit.errors import TopologyError
from refit.fanout_relay import chunk_bytes_for, relay_parents
from refit.fanout_waves import waves_for
from refit.layout import ModelLayout
from refit.plan.procs import ProcessMap
from refit.plan.sources import link_bytes

NIC_MODES = ("auto", "stripe", "first")


@dataclass(frozen=True)
class Topology:
    """A cluster for the cost model: ``nodes`` x ``gpus_per_node`` GPUs (GPU ``g`` on node
    ``g // gpus_per_node``) and the speed of each resource in GB/s, one direction
    (``hbm_gbps``: read + write). Defaults: measured H200 numbers, noted per field.

    Validated once in ``__post_init__``: every number finite and > 0 (booleans refused), the
    three counts whole, ``nic_mode`` "auto", "stripe" or "first"; ``TopologyError`` names the topology,
    the field and the value. ``from_dict`` / ``from_json`` also refuse unknown fields and need
    ``nodes`` and ``gpus_per_node``; ``from_json`` names the topology after its file unless
    the JSON sets ``name``. Derived: ``gpus``, ``node(g)``, ``gpu_nic_gbps`` (one NIC in
    "auto" and "first"; in "stripe" all the node's NICs, capped by ``pcie_gbps``), ``node_nic_gbps``
    (all the node's NICs; one in "first"). Frozen.
    """

    nodes: int
    gpus_per_node: int
    nvlink_gbps: float = 396.0  # GPU -> GPU peer copy, one direction (H200 NV18, measured)
    nccl_gbps: float = 370.0  # NCCL send/recv / broadcast between two GPUs of a node (measured, 1-4 GiB)
    hbm_gbps: float = 4292.0  # read + write traffic of one GPU (2x a measured 2146 GB/s on-device copy)
    nics_per_node: int = 8
    nic_gbps: float = 50.0  # one NIC, one direction (400 Gb/s)
    nic_mode: str = "auto"  # "auto": a GPU uses its nearest NIC; "stripe": all of its node's NICs; "first": NIC 0
    pcie_gbps: float = 55.0  # caps one GPU's traffic to the NICs in stripe mode
    name: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("name", "nic_mode"):
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise TopologyError(f"topology {self.name or '?'}: {f.name} must be a finite number > 0, got {v!r}")
            if f.name in ("nodes", "gpus_per_node", "nics_per_node") and int(v) != v:
                raise TopologyError(f"topology {self.name or '?'}: {f.name} must be an integer, got {v!r}")
        if self.nic_mode not in NIC_MODES:
            raise TopologyError(
                f"topology {self.name or '?'}: nic_mode must be 'auto', 'stripe' or 'first', got {self.nic_mode!r}"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Topology:
        """A topology from its fields (``dataclasses.asdict`` gives them back)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TopologyError(f"topology: unknown fields {unknown} (known: {sorted(known)})")
        missing = [k for k in ("nodes", "gpus_per_node") if k not in d]
        if missing:
            raise TopologyError(f"topology: missing fields {missing}")
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> Topology:
        """A topology from a JSON file of its fields; ``TopologyError`` names an unreadable file."""
        from refit.jsonio import read_json

        d = read_json(path, "topology", TopologyError)  # size and depth bounded: one line, never a RecursionError
        if not isinstance(d, dict):
            raise TopologyError(f"topology {path} must hold a JSON object of fields, got a {type(d).__name__}")
        return cls.from_dict({"name": os.path.basename(str(path)), **d})

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node(self, gpu: int) -> int:
        """The node of GPU ``gpu``."""
        return gpu // self.gpus_per_node

    @property
    def gpu_nic_gbps(self) -> float:
        """The network speed one GPU gets, one direction."""
        if self.nic_mode == "stripe":
            return min(self.pcie_gbps, self.nics_per_node * self.nic_gbps)
        return self.nic_gbps

    @property
    def node_nic_gbps(self) -> float:
        """The network speed of one node's NICs together, one direction (one NIC's in "first")."""
        return self.nic_gbps if self.nic_mode == "first" else self.nics_per_node * self.nic_gbps

    def describe(self) -> str:
        """One line: the shape and the speeds."""
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} GPUs; NVLink {self.nvlink_gbps:g} GB/s per GPU per "
            f"direction; HBM {self.hbm_gbps:g} GB/s (read+write); {self.nics_per_node} NICs x {self.nic_gbps:g} "
            f"GB/s per node, {self.nic_mode} ({self.gpu_nic_gbps:g} GB/s per GPU)"
        )


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted refit time (``predict``): ``seconds``, the resource that sets it
    (``busiest``, e.g. "nic_out of GPU 3") and the bytes that resource moves, with a ``note``
    on what was counted."""

    strategy: str
    seconds: float
    busiest: str  # the resource that sets the time
    busiest_bytes: int
    note: str = ""


def loads(
    transfers: dict[tuple[int, int], int], topo: Topology
) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float]]:
    """Seconds of work and bytes per resource (see the module docstring)."""
    b: dict[tuple[str, int], float] = defaultdict(float)
    for (s, d), n in transfers.items():
        if n <= 0:
            continue
        if s == d:
            b[("hbm", s)] += 2 * n
        elif topo.node(s) == topo.node(d):
            b[("hbm", s)] += n
            b[("hbm", d)] += n
            b[("nvlink_out", s)] += n
            b[("nvlink_in", d)] += n
        else:
            b[("hbm", s)] += n
            b[("hbm", d)] += n
            b[("nic_out", s)] += n
            b[("nic_in", d)] += n
            b[("node_nic_out", topo.node(s))] += n
            b[("node_nic_in", topo.node(d))] += n
    speed = {
        "hbm": topo.hbm_gbps,
        "nvlink_out": topo.nvlink_gbps,
        "nvlink_in": topo.nvlink_gbps,
        "nic_out": topo.gpu_nic_gbps,
        "nic_in": topo.gpu_nic_gbps,
        "node_nic_out": topo.node_nic_gbps,
        "node_nic_in": topo.node_nic_gbps,
    }
    return {k: v / (speed[k[0]] * 1e9) for k, v in b.items()}, dict(b)


def transfer_time(transfers: dict[tuple[int, int], int], topo: Topology) -> tuple[float, str, int]:
    """The bottleneck bound of ``transfers``: (seconds, busiest resource, its bytes); (0.0, "-",
    0) when nothing moves."""
    secs, raw = loads(transfers, topo)
    if not secs:
        return 0.0, "-", 0
    (kind, idx), t = max(secs.items(), key=lambda kv: kv[1])
    where = f"node {idx}" if kind.startswith("node") else f"GPU {idx}"
    return t, f"{kind} of {where}", int(raw[(kind, idx)])


def delta_time(
    transfers: dict[tuple[int, int], int],
    topo: Topology,
    fraction: float,
    itemsize: int,
    pair_s: float = 0.0,
    node_pair_s: float | None = None,
) -> tuple[float, str, int, int]:
    """The bottleneck bound of ``transfers`` sent as deltas with ``fraction`` of the elements (of
    ``itemsize`` bytes) changed (the module docstring's ``delta``): (seconds, busiest resource, its
    bytes, bytes on the wire in all). ``pair_s``: a fixed time per (source, destination) pair that sends a
    delta, on the receiver's ``scatter`` (NIXL: ``refit.delta.rule.NIXL_PAIR_S``, its record and one more READ);
    ``node_pair_s`` (None: ``pair_s``): the same for a pair of two GPUs of one node (CUDA IPC:
    ``refit.delta.rule.IPC_PAIR_S``, the header's read and wait)."""
    if not 0 <= fraction <= 1:
        raise TopologyError(f"changed fraction must be within [0, 1], got {fraction!r}")
    wire: dict[tuple[int, int], int] = {}
    work: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0.0, 0.0])  # bytes, seconds
    for (s, d), n in transfers.items():
        wire[(s, d)], find, apply = _delta_link(n, itemsize, fraction, _link_speed(s, d, topo))
        fixed = node_pair_s if node_pair_s is not None and s != d and topo.node(s) == topo.node(d) else pair_s
        apply = (apply[0], apply[1] + (fixed if wire[(s, d)] < n else 0.0))
        for key, (b, t) in ((("find", s), find), (("scatter", d), apply)):
            work[key][0] += b
            work[key][1] += t
    secs, raw = loads(wire, topo)
    for key, (b, t) in work.items():
        raw[key], secs[key] = b, t
    if not secs:
        return 0.0, "-", 0, 0
    (kind, idx), t = max(secs.items(), key=lambda kv: kv[1])
    where = f"node {idx}" if kind.startswith("node") else f"GPU {idx}"
    return t, f"{kind} of {where}", int(raw[(kind, idx)]), sum(wire.values())


def _delta_link(
    n: int, itemsize: int, fraction: float, speed: LinkSpeed
) -> tuple[int, tuple[float, float], tuple[float, float]]:
    """One link's ``n`` bytes as ``delta="auto"`` sends them: (wire bytes, (bytes, seconds) of the
    sender's find + pack + base update, (bytes, seconds) of the receiver's scatter). The rule weighs
    messages (at most a tensor), not a link's total: one message of up to 2**28 elements stands for
    them. Found per 64-bit word where ``prefer_words`` says so (each word of ``8 // itemsize`` elements
    changes with probability ``words_changed``), else per element."""
    elems = n // itemsize
    msg = min(elems, 1 << 28)
    words = prefer_words([(msg, itemsize)], speed)
    if not may_pay([(msg, itemsize)], speed, words):  # as ``auto``: dense where no delta can pay by the margin
        return n, (0.0, 0.0), (0.0, 0.0)
    if words:
        changed = words_changed(fraction, itemsize)
        kind = choose_words([(msg, round(changed * msg * itemsize / 8), itemsize)], speed)
        k, per_change, find_gbps = round(changed * n / 8), INDEX_BYTES + 16, speed.word_find_gbps
    else:
        kind = choose_encoding([(msg, round(fraction * msg), itemsize)], speed)
        k, per_change, find_gbps = round(fraction * elems), INDEX_BYTES + 2 * itemsize, speed.find_gbps
    if kind == "dense":
        return n, (0.0, 0.0), (0.0, 0.0)
    apply = (k * per_change, k * per_change / (speed.apply_gbps * 1e9))  # pack + base update; scatter
    find = (2 * n + apply[0], 2 * n / (find_gbps * 1e9) + apply[1])  # reads base and current, then packs
    return wire_bytes(kind, elems, k, itemsize), find, apply


def _link_speed(s: int, d: int, topo: Topology) -> LinkSpeed:
    """The encoding rule's view of the link between GPUs ``s`` and ``d`` of ``topo``."""
    if s == d:
        return replace(LINKS["same_device"], link_gbps=topo.hbm_gbps / 2)
    link = topo.nvlink_gbps if topo.node(s) == topo.node(d) else topo.gpu_nic_gbps
    return replace(LINKS["nvlink"], link_gbps=link)  # the find, pack and scatter rates measured on an H100


def gpu_placement(n_src: int, n_dst: int, topo: Topology, colocated: bool = False) -> ProcessMap:
    """Trainer rank ``r`` on GPU ``r``, engine rank ``r`` on GPU ``n_src + r`` (on GPU ``r`` when
    ``colocated``); ``TopologyError`` naming both counts when the topology has too few GPUs."""
    need = max(n_src, n_dst) if colocated else n_src + n_dst
    if need > topo.gpus:
        raise TopologyError(
            f"{n_src} trainer + {n_dst} engine ranks need {need} GPUs"
            f"{' (colocated)' if colocated else ''}; the topology has {topo.gpus}"
        )
    return ProcessMap(tuple(range(n_src)), tuple(range(n_dst)) if colocated else tuple(range(n_src, n_src + n_dst)))


def p2p_transfers(
    src: ModelLayout,
    dst: ModelLayout,
    topo: Topology,
    colocated: bool = False,
    placement: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> dict[tuple[int, int], int]:
    """(source GPU, destination GPU) -> bytes of refit's plan; ``placement``: the GPU of each
    trainer rank and each engine rank (default: ``gpu_placement``)."""
    if placement is not None:
        bad = [g for g in (*placement[0], *placement[1]) if not 0 <= g < topo.gpus]
        if bad:
            raise TopologyError(f"placement uses GPUs {sorted(set(bad))}; the topology has {topo.gpus}")
        procs = ProcessMap(tuple(placement[0]), tuple(placement[1]))
    else:
        procs = gpu_placement(src.world_size, dst.world_size, topo, colocated)
    out: dict[tuple[int, int], int] = defaultdict(int)
    for (s, r), n in link_bytes(src, dst, procs).items():
        out[(procs.src[s], procs.dst[r])] += n
    return dict(out)


def broadcast_time(
    model_bytes: int, n_src: int, n_dst: int, topo: Topology, colocated: bool = False
) -> tuple[float, str]:
    """(seconds, what sets them) of a pipelined ring broadcast of ``model_bytes`` from trainer
    rank 0's GPU to every engine GPU (the module docstring's ``broadcast``)."""
    procs = gpu_placement(n_src, n_dst, topo, colocated)
    ring = [procs.src[0]] + [g for g in procs.dst if g != procs.src[0]]
    crosses = any(topo.node(a) != topo.node(b) for a, b in zip(ring, ring[1:]))
    if crosses:
        return model_bytes / (topo.gpu_nic_gbps * 1e9), "nic (ring hop between nodes)"
    if len(ring) == 1:
        return 2 * model_bytes / (topo.hbm_gbps * 1e9), "hbm (one GPU)"
    return model_bytes / (topo.nccl_gbps * 1e9), "nvlink through NCCL (ring hop)"


def relay_gpus(n_src: int, nr: int, replicas: int, topo: Topology, colocated: bool = False) -> list[tuple[int, ...]]:
    """The GPUs of each replica's ``nr`` ranks in a relay: every replica on nodes of its own, after the trainer's
    (``colocated``: replica 0 on the trainer's first GPUs); ``TopologyError`` naming the counts when the topology
    has too few nodes."""
    per = -(-nr // topo.gpus_per_node)  # nodes per replica
    first = -(-n_src // topo.gpus_per_node)  # the first node after the trainer's
    fresh = replicas - 1 if colocated else replicas
    if first + fresh * per > topo.nodes:
        raise TopologyError(
            f"a relay to {replicas} replicas of {nr} ranks, each on nodes of its own after the {n_src} trainer ranks, "
            f"needs {first + fresh * per} nodes of {topo.gpus_per_node} GPUs; the topology has {topo.nodes}"
        )
    out = [tuple(range(nr))] if colocated else []
    for j in range(fresh):
        start = (first + j * per) * topo.gpus_per_node
        out.append(tuple(range(start, start + nr)))
    return out


def relay_seconds(steady_s: float, chunks: int, depth: int) -> float:
    """A pipelined relay's time: its steady pipeline (``steady_s``: every edge moving its bytes at once) plus
    filling it, one window's time per hop after the first: ``steady_s * (chunks + depth - 1) / chunks``."""
    if chunks < 1 or depth < 1:
        raise ValueError(f"relay_seconds: chunks and depth must be >= 1, got {chunks} and {depth}")
    return steady_s * (chunks + depth - 1) / chunks


def relay_time(
    src: ModelLayout, replica: ModelLayout, topo: Topology, replicas: int, degree: int = 1, colocated: bool = False
) -> tuple[float, str, int, str]:
    """The module docstring's ``relay``: (seconds, busiest resource, its bytes, a note)."""
    gpus = relay_gpus(src.world_size, replica.world_size, replicas, topo, colocated)
    parents = relay_parents(replicas, degree)
    transfers: dict[tuple[int, int], int] = defaultdict(int)
    for k, n in p2p_transfers(src, replica, topo, placement=(tuple(range(src.world_size)), gpus[0])).items():
        transfers[k] += n
    rank_bytes = [sum(_numel(t.box(r)) * t.itemsize for t in replica) for r in range(replica.world_size)]
    for i, parent in enumerate(parents):
        for r, n in enumerate(rank_bytes) if parent >= 0 else ():
            transfers[(gpus[parent][r], gpus[i][r])] += n
    steady, where, n = transfer_time(dict(transfers), topo)
    chunk = chunk_bytes_for(replica.nbytes, TransferConfig())
    chunks = max(1, -(-max(rank_bytes) // chunk))
    depth = _depth(parents)
    note = (
        f"a {'chain' if degree == 1 else f'tree of degree {degree}'} of {replicas} replicas, {depth} hops deep, "
        f"{chunks} windows per rank; steady {steady * 1e3:.1f} ms"
    )
    return relay_seconds(steady, chunks, depth), where, n, note


def fanout_gpus(n_src: int, nr: int, replicas: int, topo: Topology, colocated: bool = False) -> list[tuple[int, ...]]:
    """The GPUs of each replica's ``nr`` ranks in a fan-out in waves: on nodes of its own after the trainer's where
    the topology has them (``relay_gpus``), else packed on the GPUs after the trainer's (engine rank ``r`` on GPU
    ``n_src + r``, ``gpu_placement``; ``colocated``: from GPU 0)."""
    try:
        return relay_gpus(n_src, nr, replicas, topo, colocated)
    except TopologyError:
        dst = gpu_placement(n_src, replicas * nr, topo, colocated).dst
        return [dst[j * nr : (j + 1) * nr] for j in range(replicas)]


def wave_transfers(
    src: ModelLayout, replica: ModelLayout, topo: Topology, trainer_gpus: tuple[int, ...], replica_gpus: list
) -> list[dict[tuple[int, int], int]]:
    """(source GPU, destination GPU) -> bytes of each wave of a fan-out in waves (``refit.fanout_waves.waves_for``, the
    plans ``Fanout`` runs): trainer rank ``r`` on GPU ``trainer_gpus[r]``, rank ``r`` of replica ``j`` on
    ``replica_gpus[j][r]``; every rank its own process, each process's device its GPU's (so the planner prefers a
    holder on the receiver's GPU as it does on a colocated cluster)."""
    n_src, nr = src.world_size, replica.world_size
    if len(trainer_gpus) != n_src or any(len(g) != nr for g in replica_gpus):
        raise TopologyError(
            f"fan-out placement: {len(trainer_gpus)} trainer GPUs for {n_src} ranks, replica GPUs "
            f"{[len(g) for g in replica_gpus]} for {nr} ranks each"
        )
    gpu = [*trainer_gpus, *(g for gs in replica_gpus for g in gs)]
    bad = sorted({g for g in gpu if not 0 <= g < topo.gpus})
    if bad:
        raise TopologyError(f"fan-out placement uses GPUs {bad}; the topology has {topo.gpus}")
    devices = [f"node{topo.node(g)}/cuda:{g % topo.gpus_per_node}" for g in gpu]
    replica_procs = [list(range(n_src + j * nr, n_src + (j + 1) * nr)) for j in range(len(replica_gpus))]
    out = []
    for w in waves_for(src, replica, list(range(n_src)), replica_procs, devices=devices):
        transfers: dict[tuple[int, int], int] = defaultdict(int)
        for (s, r), n in link_bytes(w.src_layout, w.dst_layout, w.procs).items():
            transfers[(gpu[w.procs.src[s]], gpu[w.procs.dst[r]])] += n
        out.append(dict(transfers))
    return out


def waves_time(
    src: ModelLayout,
    replica: ModelLayout,
    topo: Topology,
    replicas: int,
    colocated: bool = False,
    placement: tuple[tuple[int, ...], list[tuple[int, ...]]] | None = None,
) -> tuple[float, str, int, str]:
    """The module docstring's ``fanout``: (seconds, the slowest wave's busiest resource, its bytes, a note).
    ``placement``: the trainer ranks' GPUs and each replica's (default: trainer rank ``r`` on GPU ``r``, the
    replicas as ``fanout_gpus`` places them)."""
    if placement is None:
        placement = (
            tuple(range(src.world_size)),
            fanout_gpus(src.world_size, replica.world_size, replicas, topo, colocated),
        )
    if len(placement[1]) != replicas:
        raise TopologyError(f"fan-out placement: GPUs for {len(placement[1])} replicas, not {replicas}")
    per = [transfer_time(t, topo) for t in wave_transfers(src, replica, topo, tuple(placement[0]), placement[1])]
    _, where, n = max(per, key=lambda w: w[0])
    note = (
        f"{len(per)} waves of the plans Fanout builds, one after another: "
        + " + ".join(f"{t * 1e3:.1f}" for t, _, _ in per)
        + " ms"
    )
    return sum(t for t, _, _ in per), where, n, note


def _depth(parents: list[int]) -> int:
    """Hops from the trainer to the deepest replica of a relay tree (``relay_parents``: parents first)."""
    hops: list[int] = []
    for parent in parents:
        hops.append(1 if parent < 0 else hops[parent] + 1)
    return max(hops)


def _numel(box) -> int:
    return math.prod(hi - lo for lo, hi in box) if box is not None else 0


def _weight_itemsize(dst: ModelLayout) -> int:
    """The element size of most of ``dst``'s bytes (FP8 weights: 1 beside their float32 scales)."""
    by: dict[int, int] = defaultdict(int)
    for t in dst:
        by[t.dtype.itemsize] += t.nbytes
    return max(by, key=by.get) if by else 2


def predict(
    src: ModelLayout,
    dst: ModelLayout,
    topo: Topology,
    *,
    replicas: int = 1,
    replica_dst: ModelLayout | None = None,
    colocated: bool = False,
    nixl_nic_mode: str | None = None,
    changed_fraction: float | None = None,
    relay: int = 0,
) -> list[Prediction]:
    """Predictions per strategy. ``replicas``: engine data-parallel replicas in ``dst``;
    ``replica_dst``: the layout of one replica (for ``fanout``; omitted when ``replicas`` is 1);
    ``nixl_nic_mode`` ("auto" or "stripe"): also predict the plan over NIXL with those NICs;
    ``changed_fraction``: also predict refit's plan as deltas (``delta``; the engine's largest dtype
    taken as every element's size: bf16, or FP8 for an FP8 engine); ``relay`` (the tree's degree, with
    ``replica_dst``): also predict ``Fanout(relay=relay)``."""
    model_bytes = dst.nbytes
    out = []
    t, where = broadcast_time(model_bytes, src.world_size, dst.world_size, topo, colocated)
    out.append(Prediction("broadcast", t, where, model_bytes, "whole model from trainer rank 0, pipelined ring"))
    transfers = p2p_transfers(src, dst, topo, colocated)
    t, where, n = transfer_time(transfers, topo)
    out.append(Prediction("p2p", t, where, n, "refit's plan from every trainer rank to every engine rank"))
    if changed_fraction is not None:
        item = _weight_itemsize(dst)
        td, where, n, wire = delta_time(transfers, topo, changed_fraction, item, node_pair_s=IPC_PAIR_S)
        note = (
            f"refit's plan, {changed_fraction:.2%} of elements changed (CUDA IPC inside a node, P2P across): "
            f"{wire / 1e9:.2f} GB on the wire "
            f"({wire / max(1, sum(transfers.values())):.1%} of dense)"
        )
        out.append(Prediction("delta", td, where, n, note))
    if nixl_nic_mode is not None:
        if nixl_nic_mode not in ("auto", "stripe"):  # UCX binds each NIC it uses: never "first"
            raise TopologyError(f"nixl_nic_mode must be 'auto' or 'stripe', got {nixl_nic_mode!r}")
        nic_topo = replace(topo, nic_mode=nixl_nic_mode)
        t, where, n = transfer_time(p2p_transfers(src, dst, nic_topo, colocated), nic_topo)
        note = f"refit's plan pulled through NIXL, NICs {nixl_nic_mode} ({nic_topo.gpu_nic_gbps:g} GB/s per GPU)"
        out.append(Prediction("nixl", t, where, n, note))
        if changed_fraction is not None:  # the same pulls as deltas: find, stage, read (the NICs), scatter
            item = _weight_itemsize(dst)
            transfers = p2p_transfers(src, dst, nic_topo, colocated)
            td, where, n, wire = delta_time(transfers, nic_topo, changed_fraction, item, NIXL_PAIR_S)
            note = (
                f"refit's plan pulled through NIXL as deltas, {changed_fraction:.2%} changed: {wire / 1e9:.2f} GB read"
            )
            out.append(Prediction("nixl-delta", td, where, n, note))
    if replicas > 1 and replica_dst is not None:
        out.append(Prediction("fanout", *waves_time(src, replica_dst, topo, replicas, colocated)))
        if relay:
            out.append(Prediction("relay", *relay_time(src, replica_dst, topo, replicas, relay, colocated)))
    return out
