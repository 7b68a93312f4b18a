"""NIXL pulls: every receiver reads its plan's pieces from its sources' registered memory (one-sided READs).

Setup (once, through the store; no process group spans sources and receivers):

* each process makes a NIXL agent (UCX backend, NIXL's own metadata listener off) after applying the
  UCX settings of ``refit.transport.nics`` (``UCX_NET_DEVICES``: the selected NICs plus the bind
  address's interface, ``UCX_MAX_RMA_RAILS``; no NIC where the plan's devices put every peer on this
  host; on CUDA, READs over CUDA IPC allowed without NVLink: ``apply_ucx_settings``), and registers
  the memory its pieces live in: a source
  the storage of every tensor a receiver reads (whole parameters; a view registers its storage), a
  receiver the storage of every tensor it receives into;
* each source publishes, for each of its receivers, a record sealed with the job secret
  (``SignedStore.put_sealed``: AES-GCM, useless without the secret): its agent name and metadata,
  its registered regions and the address and strides of every tensor part that receiver reads;
  plain JSON, never pickled (NIXL's ``get_serialized_descs`` is not used);
* each receiver checks every field of its sources' records (``check_record``: known keys, types,
  ranges, every piece inside a region its source registered) before ``add_remote_agent``, then
  turns its pieces into descriptors (``runs``: one per contiguous run common to both sides) and
  prepares READ requests of at most ``config.buffer_bytes`` each.

Per refit: a source announces that its tensors are final (``<name>/nixl/<agent>/ready`` = the run
number); a receiver waits for that, posts its requests, at most ``config.num_buffers`` in flight,
then announces ``<name>/nixl/<agent>/done/<proc>``; a source returns once every receiver of it is
done (its tensors may change again). Every wait polls under the run's ``RunClock`` (a frozen peer
is a ``DeadlineExceeded``, never a hang; another process's abort ends it too). A source that dies
mid-read fails the read (``TransferError`` naming it).

Debugging (``REFIT_NIXL_DEBUG=1``, ``Trace``): a line per phase on stderr (agent made, regions
registered and how long it took, records published and read, remote agents added, requests prepared;
per refit: announced, each post of the first refit, every 5 s what a wait still waits for, bytes read
and the rate, checksums, finished), and UCX prints the transports and protocols it chose.

Staging: a source packs the pieces whose runs in its tensors are short (``SourceStaging``: a column
slice of a row-sharded weight) into a registered staging buffer of ``num_buffers`` slots of
``buffer_bytes``, in rounds: the first ``num_buffers`` rounds before it announces a refit, each later
round into the slot of the round ``num_buffers`` before, once every receiver has read that one
(``<agent>/packed`` and ``<agent>/consumed/<proc>``, counting up over refits; ``_Reads``). Receivers
read a staged piece as one descriptor. Other pieces are read in place, one descriptor per run common to
both sides (one request gathers many): one copy each for UCX, so strided ones are slow.

Checksums (``config.checksums``; ``NixlSums``): a source sums every piece it sends
(``transport.checksum``'s definition: the torch reference on the CPU, the Triton kernel on CUDA)
once its tensors are final, before it packs its staging buffer, and publishes, per receiver, the
sums of that receiver's pieces with the run number, sealed (``<name>/nixl/<agent>/sums/<proc>``,
written before the announcement); a receiver, once every read is done, sums what it received, checks
the record field by field and compares: the first differing piece (plan order) is a
``ChecksumError`` naming its tensor, box and source process, raised before it announces ``done``.
"""

from __future__ import annotations

import base64
import bisect
import ctypes
import itertools
import json
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from refit.binding import LocalTensors
from refit.config import PIECE_ALIGN, TransferConfig
from refit.errors import ChecksumError, ConfigError, PlanError, TransferError
from refit.layout import box_relative
from refit.plan import Plan
from refit.plan.schedule import part_key, source_part
from refit.transport.checksum import Piece, PieceSums
from refit.transport.clock import RunClock
from refit.transport.nics import process_nics, ucx_settings
from refit.transport.store import SignedStore, bind_address, interface_of

log = logging.getLogger("refit.nixl")

MEM_TYPES = ("DRAM", "VRAM")
MAX_RECORD_ENTRIES = 1 << 16  # regions or tensor parts in one record
MAX_METADATA_BYTES = 1 << 20
MAX_DESCRIPTORS = 1 << 16  # per READ request
_ADDR_LIMIT = 1 << 63
_POLL_S = 0.001
STAGE_RUN_BYTES = 64 << 10  # a source piece whose runs are shorter than this is staged (packed) if it fits a slot
SYSFS_ENV = "REFIT_SYSFS_ROOT"  # where NIC discovery reads sysfs (default /sys; a container's mount, tests)
SET_ENV = "REFIT_UCX_SET"  # the UCX variables refit itself set (JSON): chosen anew for a later agent
DEBUG_ENV = "REFIT_NIXL_DEBUG"  # "1": a line per phase on stderr (``Trace``), UCX's own choices printed
UCX_SHOWN = ("UCX_NET_DEVICES", "UCX_MAX_RMA_RAILS", "UCX_TLS")
PROGRESS_EVERY_S = 5.0  # debug: how often a long wait says what it still waits for


def available() -> bool:
    """Whether ``nixl`` imports here (with its UCX plugin)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- UCX settings, agent
def apply_ucx_settings(device: torch.device, env: dict | None = None, one_host: bool = False) -> dict[str, str]:
    """Set this process's UCX variables for a NIXL agent on ``device`` (``nics.process_nics`` on the
    sysfs under ``REFIT_SYSFS_ROOT``, default ``/sys``, and ``nics.ucx_settings``; ``REFIT_BIND_ADDRESS``'s
    interface, loopback by default) in ``env`` (default ``os.environ``: UCX reads it when an agent is
    created) and return them (logged). ``one_host``: every peer of this process is on its host, so no
    NIC is selected (UCX moves bytes through shared memory, CMA or CUDA IPC; registering GPU memory
    with an HCA would only cost time). On CUDA, ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``: UCX turns READs
    over CUDA IPC off where NVML shows no active NVLink on GPU 0 (one GPU, PCIe), and refit's READs
    then crawl through UCX's software emulation. ``REFIT_NIXL_DEBUG=1`` adds ``UCX_LOG_LEVEL=info``
    and ``UCX_PROTO_INFO=y`` (UCX prints the transports and protocols it chose). A variable the
    environment already sets is the user's choice and stays; one that refit set for an earlier agent
    (recorded in ``REFIT_UCX_SET``, inherited by child processes too) is chosen anew."""
    env = os.environ if env is None else env
    ours = _refit_set(env)
    for k in ours:  # refit's own earlier choice (another device, or another host set): not the user's
        env.pop(k, None)
    sysfs_root = env.get(SYSFS_ENV) or "/sys"
    address = bind_address(env.get("REFIT_BIND_ADDRESS"))
    interface = None if address in ("0.0.0.0", "::") else interface_of(address)
    nics = [] if one_host else process_nics(str(device), sysfs_root, env)
    chosen = ucx_settings(nics, interface, env)
    extra = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"} if torch.device(device).type == "cuda" else {}
    if env.get(DEBUG_ENV) == "1":
        extra |= {"UCX_LOG_LEVEL": "info", "UCX_PROTO_INFO": "y"}
    chosen |= {k: v for k, v in extra.items() if k not in env}
    env.update(chosen)
    env[SET_ENV] = json.dumps(chosen, sort_keys=True)
    shown = {k: env[k] for k in (*UCX_SHOWN, *extra) if k in env}
    log.info("refit nixl: UCX settings for %s (bind %s%s): %s", device, address, ", one host" * one_host, shown)
    return chosen


def _refit_set(env: Mapping[str, str]) -> dict[str, str]:
    """The UCX variables refit set in ``env`` (``REFIT_UCX_SET``) that still hold refit's value."""
    try:
        mine = json.loads(env.get(SET_ENV, "{}"))
    except ValueError:
        return {}
    if not isinstance(mine, dict):
        return {}
    return {k: v for k, v in mine.items() if isinstance(k, str) and k.startswith("UCX_") and env.get(k) == v}


def make_agent(name: str, device: torch.device, one_host: bool = False):
    """A NIXL agent named ``name`` with the UCX backend, no metadata listener and NIXL's strict thread
    mode (its calls serialized: links of one process may run from different threads); the UCX
    settings applied first (``apply_ucx_settings``)."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    apply_ucx_settings(device, one_host=one_host)
    config = nixl_agent_config(
        backends=[], enable_listen_thread=False, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    agent = nixl_agent(name, config)
    agent.create_backend("UCX", {})
    return agent


class SharedAgent:
    """This process's NIXL agent, shared by its links (one per ``Peer``): one UCX context, worker and
    progress thread per process however many Peers it holds (a fan-out replica: one per wave).

    ``acquire(device, one_host)``: the agent made with those UCX settings (the first call makes it,
    ``make_agent``; a later call with other settings, e.g. a link with peers on other hosts after one
    without, gets an agent of its own); ``release()`` once per acquire: the last one drops the agent.
    Remote agents are counted per link: ``add_remote(metadata)`` loads a remote agent's metadata, or
    refreshes it (a source that registered more memory for another link publishes newer metadata, which
    NIXL merges; requests prepared before stay valid); ``drop_remote(name)`` forgets it once no link
    of this process reads from it. Thread-safe."""

    _lock = threading.Lock()
    _agents: dict[tuple[str, bool], SharedAgent] = {}

    def __init__(self, key: tuple[str, bool], agent, name: str) -> None:
        self.key, self.agent, self.name = key, agent, name
        self.users = 0
        self.remotes: Counter[str] = Counter()

    @classmethod
    def acquire(cls, device: torch.device, one_host: bool = False) -> SharedAgent:
        key = (str(device), one_host)
        with cls._lock:
            shared = cls._agents.get(key)
            if shared is None:
                name = f"refit-{os.getpid()}-{uuid.uuid4().hex[:16]}"
                shared = cls._agents[key] = cls(key, make_agent(name, device, one_host), name)
            shared.users += 1
            return shared

    @classmethod
    def count(cls) -> int:
        """How many agents this process holds now."""
        with cls._lock:
            return len(cls._agents)

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users > 0:
                return
            if self._agents.get(self.key) is self:
                del self._agents[self.key]
            self.agent = None  # NIXL's agent (its UCX worker and progress thread) goes with the last reference

    def add_remote(self, metadata: bytes) -> str:
        """Load (or refresh) a remote agent's metadata; its name (NIXL's own errors propagate)."""
        got = self.agent.add_remote_agent(metadata)
        name = got.decode() if isinstance(got, bytes) else got
        with self._lock:
            self.remotes[name] += 1
        return name

    def drop_remote(self, name: str) -> None:
        with self._lock:
            self.remotes[name] -= 1
            if self.remotes[name] > 0:
                return
            del self.remotes[name]
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass


def peers_on_this_host(plan: Plan, proc: int) -> bool:
    """Whether the plan's devices show every NIXL peer of ``proc`` on its host (False without devices:
    where the processes run is not known)."""
    procs = plan.procs
    if procs.devices is None:
        return False
    peers = {procs.src[m.src] for m in plan.messages if m.transport == "nixl" and procs.dst[m.dst] == proc}
    peers |= {procs.dst[m.dst] for m in plan.messages if m.transport == "nixl" and procs.src[m.src] == proc}
    return all(procs.host_of(p) == procs.host_of(proc) for p in peers)


class Trace:
    """``REFIT_NIXL_DEBUG=1``: one line per NIXL phase on stderr, flushed at once (a run that stalls
    shows where), with the process id, the plan's process number and the seconds since ``t0``;
    otherwise nothing. ``every(key, s)``: whether ``s`` seconds passed since that key last said so."""

    def __init__(self, proc: int) -> None:
        self.on = os.environ.get(DEBUG_ENV) == "1"
        self.proc, self.t0 = proc, time.monotonic()
        self._last: dict[str, float] = {}

    def __call__(self, fmt: str, *args) -> None:
        if self.on:
            head = f"[refit nixl pid {os.getpid()} process {self.proc} +{time.monotonic() - self.t0:.3f}s] "
            print(head + (fmt % args), file=sys.stderr, flush=True)

    def every(self, key: str, seconds: float) -> bool:
        now = time.monotonic()
        if not self.on or now - self._last.setdefault(key, now) < seconds:
            return False
        self._last[key] = now
        return True


def ucx_config() -> dict[str, str]:
    """UCX's own reading of its configuration in this process (``ucp_config_read`` and
    ``ucp_config_print`` of the libucp NIXL loaded): ``{"UCX_NET_DEVICES": ..., ...}``. Empty before
    an agent exists. A diagnostic: what a running transfer's UCX context was configured with."""
    with open("/proc/self/maps") as f:
        path = next((line.split()[-1] for line in f if "libucp" in line), None)
    if path is None:
        return {}
    lib, libc = ctypes.CDLL(path), ctypes.CDLL(None)
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    lib.ucp_config_read.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.ucp_config_print.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.ucp_config_release.argtypes = [ctypes.c_void_p]
    cfg = ctypes.c_void_p()
    if lib.ucp_config_read(None, None, ctypes.byref(cfg)) != 0:
        return {}
    try:
        with tempfile.NamedTemporaryFile("r", prefix="refit-ucx-") as out:
            fp = libc.fopen(out.name.encode(), b"w")
            lib.ucp_config_print(cfg, fp, b"refit", 1)  # UCS_CONFIG_PRINT_CONFIG
            libc.fclose(fp)
            text = out.read()
    finally:
        lib.ucp_config_release(cfg)
    return dict(line.split("=", 1) for line in text.splitlines() if line.startswith("UCX_") and "=" in line)


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.device.type == "cuda" else ("DRAM", 0)


def cuda_segments(device: int) -> list[tuple[int, int]]:
    """The caching allocator's segments on CUDA device ``device`` (one allocation each), as sorted
    ``(start, end)`` addresses; none with expandable segments (one of those maps several allocations)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        return []
    snap = torch.cuda.memory_snapshot()
    return sorted((g["address"], g["address"] + g["total_size"]) for g in snap if g["device"] == device)


def _allocation_of(mem: str, dev: int, segments: dict[int, list[tuple[int, int]]]):
    """``addr -> which allocation holds it`` on ``(mem, dev)``: host memory is one (CMA and shared memory
    read across touching storages), a GPU's are the caching allocator's ``segments[dev]`` (None outside
    them: memory torch did not allocate is never merged)."""
    if mem == "DRAM":
        return lambda addr: 0
    seg = segments.get(dev, [])
    starts = [lo for lo, _ in seg]

    def which(addr: int):
        i = bisect.bisect_right(starts, addr) - 1
        return i if i >= 0 and addr < seg[i][1] else None

    return which


def storage_regions(
    tensors: Sequence[torch.Tensor], segments: dict[int, list[tuple[int, int]]] | None = None
) -> list[list]:
    """The storages of ``tensors`` as ``[address, bytes, device, memory type]``: overlapping ones merged,
    and touching ones where one allocation holds both (``_allocation_of``; ``segments``: per CUDA device,
    its allocations, default ``cuda_segments``).

    Touching storages of two allocations stay apart: allocations can lie back to back in the address
    space, and a region across both breaks UCX's ``cuda_ipc`` (it maps the one allocation a region starts
    in, so a READ past its end fails with "cuMemcpyDtoDAsync ... invalid argument": 16 GB of Llama-3.1-8B
    on 2x H200). Merging within an allocation keeps the regions few (the record's size: a model of
    thousands of unfused tensors registers a few allocations, not one region per tensor)."""
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            spans.setdefault(_mem(t), []).append((st.data_ptr(), st.data_ptr() + st.nbytes()))
    if segments is None:
        segments = {dev: cuda_segments(dev) for mem, dev in spans if mem == "VRAM"}
    out = []
    for (mem, dev), ranges in sorted(spans.items()):
        out += [[lo, hi - lo, dev, mem] for lo, hi in merge_ranges(ranges, _allocation_of(mem, dev, segments))]
    return out


def merge_ranges(ranges: list[tuple[int, int]], which) -> list[list[int]]:
    """``[start, end)`` ranges, sorted and merged where they overlap, or touch inside one allocation
    (``which(addr)``: the allocation holding ``addr``, None for unknown)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        last = merged[-1] if merged else None
        touch = last is not None and lo == last[1] and which(lo) is not None and which(lo) == which(last[0])
        if last is not None and (lo < last[1] or touch):
            last[1] = max(last[1], hi)
        else:
            merged.append([lo, hi])
    return merged


# ---------------------------------------------------------------------------- geometry
def runs(
    shape: Sequence[int], src: int, src_strides: Sequence[int], dst: int, dst_strides: Sequence[int], itemsize: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """The contiguous runs common to a source and a destination view of one ``shape`` (addresses in
    bytes, strides in elements, all >= 0): (source addresses, destination addresses, bytes per run),
    in row-major order. Trailing dimensions that are dense on both sides merge into one run."""
    if any(n == 0 for n in shape):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    dims = [(n, s, d) for n, s, d in zip(shape, src_strides, dst_strides) if n != 1]
    run, k = 1, len(dims)
    while k > 0 and dims[k - 1][1] == run and dims[k - 1][2] == run:
        run *= dims[k - 1][0]
        k -= 1
    s_addr, d_addr = np.array([src], np.int64), np.array([dst], np.int64)
    for n, s, d in dims[:k]:
        step = np.arange(n, dtype=np.int64)
        s_addr = (s_addr[:, None] + step * (s * itemsize)).reshape(-1)
        d_addr = (d_addr[:, None] + step * (d * itemsize)).reshape(-1)
    return s_addr, d_addr, run * itemsize


def dense_strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides (in elements) of a dense tensor of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def span(shape: Sequence[int], addr: int, strides: Sequence[int], itemsize: int) -> tuple[int, int]:
    """The first byte and one past the last byte a view touches."""
    last = sum((n - 1) * s for n, s in zip(shape, strides))
    return addr, addr + (last + 1) * itemsize


# ---------------------------------------------------------------------------- source staging
class SourceStaging:
    """A source's staging buffer: the pieces it sends whose runs in its tensors are shorter than
    ``STAGE_RUN_BYTES`` (a column slice of a row-sharded weight) and that fit one slot, packed dense at
    ``PIECE_ALIGN``-ed offsets. Pieces go, the receivers' in turn and each receiver's in plan order, into
    rounds of at most ``slot_bytes`` (the config's ``buffer_bytes``, aligned down); round r is packed into
    slot r % ``slots`` (``num_buffers``), so the buffer never exceeds ``slots`` x ``slot_bytes`` however
    many bytes are staged. Longer pieces are read in
    place, one descriptor per run. Receivers read a staged piece as one descriptor.

    Lifecycle: built at setup (``offsets``: message index -> byte offset; ``round_of``: message index ->
    round); the first ``slots`` rounds are packed before a refit is announced, each later round r once
    every receiver has read round r - ``slots`` (``NixlLink``'s ``packed`` / ``consumed`` keys);
    registered with the source's other memory."""

    def __init__(
        self, plan: Plan, proc: int, local: LocalTensors, slot_bytes: int, slots: int, device: torch.device
    ) -> None:
        self.offsets: dict[int, int] = {}
        self.round_of: dict[int, int] = {}
        self.slots = slots
        stride = slot_bytes // PIECE_ALIGN * PIECE_ALIGN  # slots start aligned, all within the budget
        views: list[list[tuple[int, torch.Tensor]]] = []
        used = stride
        for i, v in self._candidates(plan, proc, local, stride):
            p = plan.messages[i].pieces[0]
            start = -(-used // PIECE_ALIGN) * PIECE_ALIGN
            if start + p.nbytes > stride:
                views.append([])
                start = 0
            r = len(views) - 1
            self.offsets[i], self.round_of[i], used = (r % slots) * stride + start, r, start + p.nbytes
            views[-1].append((self.offsets[i], v))
        full = min(len(views), slots) - 1  # slots filled before the last one used
        size = 0 if not views else full * stride + (used if len(views) <= slots else stride)
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.rounds = [[(self._slot(o, v), v) for o, v in r] for r in views]

    @staticmethod
    def _candidates(plan: Plan, proc: int, local: LocalTensors, fits: int) -> list[tuple[int, torch.Tensor]]:
        """The messages this source stages (short runs, at most ``fits`` bytes) with their source views,
        the receivers' in turn (each round then serves every receiver: none waits for another to finish
        its part of the buffer)."""
        per: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for i, m in enumerate(plan.messages):
            if m.transport != "nixl" or plan.procs.src[m.src] != proc:
                continue
            p = m.pieces[0]
            v = local.src_view(p.tensor, p.box)
            run = runs(v.shape, 0, v.stride(), 0, dense_strides(v.shape), p.itemsize)[2]
            if run < min(STAGE_RUN_BYTES, p.nbytes) and p.nbytes <= fits:
                per.setdefault(plan.procs.dst[m.dst], []).append((i, v))
        lists = [per[r] for r in sorted(per)]
        return [x for group in itertools.zip_longest(*lists) for x in group if x is not None]

    def _slot(self, offset: int, v: torch.Tensor) -> torch.Tensor:
        return self.buffer[offset : offset + v.numel() * v.element_size()].view(v.dtype).view(v.shape)

    def pack(self, r: int) -> None:
        """Copy round ``r``'s pieces into their slot (the source's tensors are final)."""
        for dst, src in self.rounds[r]:
            dst.copy_(src)

    def address(self, index: int) -> int:
        """Where message ``index``'s staged piece lies."""
        return self.buffer.data_ptr() + self.offsets[index]


# ---------------------------------------------------------------------------- records
_RECORD_KEYS = {"agent", "metadata", "regions", "parts", "staged", "rounds"}


def _int(x: object, lo: int = 0, hi: int = _ADDR_LIMIT) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x < hi


def _check_regions(regions: object, who: str) -> list[list]:
    if not isinstance(regions, list) or not 0 < len(regions) <= MAX_RECORD_ENTRIES:
        raise PlanError(f"NIXL record of {who}: regions must be a list of 1..{MAX_RECORD_ENTRIES} entries")
    for r in regions:
        ok = isinstance(r, list) and len(r) == 4 and _int(r[0]) and _int(r[1], 1) and _int(r[2], 0, 1 << 16)
        if not ok or r[3] not in MEM_TYPES or r[0] + r[1] > _ADDR_LIMIT:
            raise PlanError(f"NIXL record of {who}: region {str(r)[:80]} is not [address, bytes, device, memory]")
    return regions


def _check_parts(parts: object, who: str, ndims: dict[str, int]) -> dict[str, list]:
    """Exactly the parts this receiver reads, each ``[address, strides, device, memory type]``."""
    if not isinstance(parts, dict) or set(parts) != set(ndims):
        got = sorted(parts)[:5] if isinstance(parts, dict) else type(parts).__name__
        raise PlanError(f"NIXL record of {who}: parts {got} are not the {len(ndims)} tensor parts read from it")
    for key, p in parts.items():
        ok = isinstance(p, list) and len(p) == 4 and _int(p[0]) and isinstance(p[1], list)
        ok = ok and len(p[1]) == ndims[key] and all(_int(s, 0, 1 << 48) for s in p[1])
        if not ok or not _int(p[2], 0, 1 << 16) or p[3] not in MEM_TYPES:
            raise PlanError(f"NIXL record of {who}: part {key!r} is {str(p)[:80]}, not [address, strides, dev, mem]")
    return parts


def _check_staged(staged: object, who: str, messages: set[int]) -> dict[int, int]:
    """Staged pieces: message index (one this receiver reads from ``who``) -> address."""
    if not isinstance(staged, dict) or not all(isinstance(k, str) and k.isascii() and k.isdigit() for k in staged):
        raise PlanError(f"NIXL record of {who}: staged must map message indices to addresses")
    out = {int(k): v for k, v in staged.items()}
    if not set(out) <= messages or not all(_int(v) for v in out.values()):
        bad = sorted(set(out) - messages)[:5]
        raise PlanError(f"NIXL record of {who}: staged names messages {bad} not read from it, or a bad address")
    return out


def _check_rounds(rounds: object, who: str, staged: dict[int, int]) -> dict:
    """The source's staging rounds: ``{"count": rounds, "slots": slots, "of": {message: round}}`` with a
    round for exactly the staged messages."""
    ok = isinstance(rounds, dict) and set(rounds) == {"count", "slots", "of"} and isinstance(rounds["of"], dict)
    ok = ok and _int(rounds["count"], 0, MAX_RECORD_ENTRIES + 1) and _int(rounds["slots"], 1, 1 << 16)
    of = {int(k): v for k, v in rounds["of"].items() if k.isascii() and k.isdigit()} if ok else {}
    if not ok or set(of) != set(staged) or len(of) != len(rounds["of"]):
        raise PlanError(f"NIXL record of {who}: rounds must be {{count, slots, of}} with a round per staged message")
    if not all(_int(r, 0, rounds["count"]) for r in of.values()):
        raise PlanError(f"NIXL record of {who}: a staged message's round is outside 0..{rounds['count'] - 1}")
    return {"count": rounds["count"], "slots": rounds["slots"], "of": of}


def check_record(rec: object, who: str, ndims: dict[str, int], messages: set[int] = frozenset()) -> dict:
    """A source's record if every field is well formed (known keys; an agent name; base64 metadata of at
    most ``MAX_METADATA_BYTES``; regions; the parts ``ndims`` names, each with one stride per dimension;
    staged pieces among ``messages``, the indices of the messages read from it, each in a staging round),
    else ``PlanError``
    naming ``who`` and the field. Whether each piece lies in a region: ``_piece_runs``."""
    if not isinstance(rec, dict) or set(rec) != _RECORD_KEYS:
        keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise PlanError(f"NIXL record of {who} has keys {keys}, expected {sorted(_RECORD_KEYS)}")
    name = rec["agent"]
    if not isinstance(name, str) or not 0 < len(name) <= 200 or not name.isprintable():
        raise PlanError(f"NIXL record of {who}: agent name {str(name)[:80]!r} is not a short printable string")
    try:
        md = base64.b64decode(rec["metadata"], validate=True) if isinstance(rec["metadata"], str) else b""
    except ValueError:
        md = b""
    if not 0 < len(md) <= MAX_METADATA_BYTES:
        raise PlanError(f"NIXL record of {who}: metadata is not base64 of 1..{MAX_METADATA_BYTES} bytes")
    staged = _check_staged(rec["staged"], who, set(messages))
    return {
        "agent": name,
        "metadata": md,
        "regions": _check_regions(rec["regions"], who),
        "parts": _check_parts(rec["parts"], who, ndims),
        "staged": staged,
        "rounds": _check_rounds(rec["rounds"], who, staged),
    }


def _inside(regions: list[list], mem: str, dev: int, lo: int, hi: int) -> bool:
    return any(r[3] == mem and r[2] == dev and r[0] <= lo and hi <= r[0] + r[1] for r in regions)


# ---------------------------------------------------------------------------- checksums
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
        if not isinstance(rec, dict) or set(rec) != _SUMS_KEYS or not _int(rec["run"], 0):
            raise TransferError(f"NIXL checksum record of process {sp} is not {{run, sums}}: {str(rec)[:80]}")
        if rec["run"] < run:
            return None
        want = {str(k) for k, s in self.reads.items() if s == sp}
        sums = rec["sums"]
        ok = rec["run"] == run and isinstance(sums, dict) and set(sums) == want
        if not ok or not all(_int(v, -(1 << 63), 1 << 63) for v in sums.values()):
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


# ---------------------------------------------------------------------------- the link
@dataclass
class _Request:
    """One prepared READ: ``nbytes`` from source process ``peer`` (agent ``agent``); ``round``: the
    source's staging round it reads from (-1: in place)."""

    peer: int
    agent: str
    handle: object
    nbytes: int
    descriptors: int
    round: int = -1


def _record_for(
    plan: Plan, local: LocalTensors, agent, name: str, regions: list, receiver: int, staging: SourceStaging
) -> dict:
    """What receiver process ``receiver`` needs to read this source's pieces (see the module docstring)."""
    parts, staged, of = {}, {}, {}
    for k, m in enumerate(plan.messages):
        if m.transport == "nixl" and plan.procs.dst[m.dst] == receiver and m.src == local.src_rank:
            for p in m.pieces:
                i, (_, t) = local.src_part(p.tensor, p.box)
                mem, dev = _mem(t)
                parts[part_key(p.tensor, i)] = [t.data_ptr(), list(t.stride()), dev, mem]
            if k in staging.offsets:
                staged[str(k)], of[str(k)] = staging.address(k), staging.round_of[k]
    md = base64.b64encode(agent.get_agent_metadata()).decode()
    rounds = {"count": len(staging.rounds), "slots": staging.slots, "of": of}
    return {"agent": name, "metadata": md, "regions": regions, "parts": parts, "staged": staged, "rounds": rounds}


def _piece_runs(
    plan: Plan, k: int, local: LocalTensors, rec: dict, who: str
) -> tuple[tuple, np.ndarray, np.ndarray, int]:
    """Message ``k``'s piece as runs: ((source memory, device, destination memory, device), source
    addresses, destination addresses, bytes per run), read in place or, staged, from the source's
    staging buffer; ``PlanError`` if it leaves its source's regions."""
    m = plan.messages[k]
    p = m.pieces[0]
    i, pbox = source_part(plan, m.src, p.tensor, p.box)
    addr, strides, dev, mem = rec["parts"][part_key(p.tensor, i)]
    rel = box_relative(p.box, pbox)
    shape = [hi - lo for lo, hi in rel]
    start = addr + sum(lo * s for (lo, _), s in zip(rel, strides)) * p.itemsize
    if k in rec.get("staged", {}):
        start, strides = rec["staged"][k], dense_strides(shape)
    lo, hi = span(shape, start, strides, p.itemsize)
    if not _inside(rec["regions"], mem, dev, lo, hi):
        raise PlanError(
            f"NIXL record of {who}: tensor {p.tensor!r} piece {[list(b) for b in p.box]} spans bytes "
            f"[{lo:#x}, {hi:#x}) of {mem}:{dev}, outside every region it registered"
        )
    view = local.dst_view(p.tensor, p.box)
    s_addr, d_addr, run = runs(shape, start, strides, view.data_ptr(), view.stride(), p.itemsize)
    return (mem, dev, *_mem(view)), s_addr, d_addr, run


def _chunks(lengths: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Cut descriptors of ``lengths`` bytes into consecutive [start, stop) ranges of at most ``limit``
    bytes (a longer one alone) and ``MAX_DESCRIPTORS`` descriptors."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if i > start and (acc + n > limit or i - start >= MAX_DESCRIPTORS):
            out.append((start, i))
            start, acc = i, 0
        acc += n
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def _prepare_reads(agent, plan: Plan, proc: int, local: LocalTensors, rec: dict, sp: int, limit: int) -> list:
    """The READ requests of ``proc`` from source process ``sp`` (validated ``rec``), each of at most
    ``limit`` bytes, prepared once (``initialize_xfer``) and posted again every refit."""
    groups: dict[tuple, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for k, m in enumerate(plan.messages):
        if m.transport == "nixl" and plan.procs.dst[m.dst] == proc and plan.procs.src[m.src] == sp:
            kind, s_addr, d_addr, run = _piece_runs(plan, k, local, rec, f"process {sp}")
            key = (rec["rounds"]["of"].get(k, -1), *kind)
            groups.setdefault(key, []).append((s_addr, d_addr, np.full(len(s_addr), run, np.int64)))
    out = []
    for (rnd, mem, dev, dmem, ddev), arrays in sorted(groups.items()):
        s_addr, d_addr, lens = (np.concatenate(a) for a in zip(*arrays))
        for a, b in _chunks(lens, limit):
            n = b - a
            remote = np.stack([s_addr[a:b], lens[a:b], np.full(n, dev)], 1).astype(np.uint64)
            mine = np.stack([d_addr[a:b], lens[a:b], np.full(n, ddev)], 1).astype(np.uint64)
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(mine, dmem), agent.get_xfer_descs(remote, mem), rec["agent"], b""
            )
            out.append(_Request(sp, rec["agent"], handle, int(lens[a:b].sum()), n, rnd))
    return out


class _Reads:
    """A receiver's READs in one refit, at most ``num_buffers`` in flight. Requests read in place, or from
    a staging round packed before the announcement (round < slots), go at once; those of a later round r
    wait until their source says it packed r (``<agent>/packed``). Once every request of rounds 0..r of a
    source is done, the receiver says so (``<agent>/consumed/<proc>``) where the source waits for it: for
    rounds r < rounds - slots, the ones whose slot is packed again. Values count up over refits:
    (run - 1) x rounds + r + 1."""

    def __init__(self, link: NixlLink, rounds: dict[int, tuple[int, int]]) -> None:
        self.link, self.rounds = link, rounds
        self.pending = [q for q in link.requests if q.round < rounds[q.peer][1]]
        self.held: dict[tuple[int, int], list[_Request]] = {}  # (source, round) -> requests not yet packed
        for q in link.requests:
            if q.round >= rounds[q.peer][1]:
                self.held.setdefault((q.peer, q.round), []).append(q)
        self.left = Counter((q.peer, q.round) for q in link.requests if q.round >= 0)
        self.reported = {sp: 0 for sp, (count, slots) in rounds.items() if count > slots and sp in link.sources}
        self.flying: list[_Request] = []
        self.done = 0

    def _base(self, sp: int) -> int:
        return (self.link.runs - 1) * self.rounds[sp][0]

    def step(self) -> bool:
        """Release packed rounds, post, poll, report; whether everything is read and reported."""
        link, limit = self.link, self.link.config.num_buffers
        if self.held and len(self.pending) < limit:
            self._release()
        while self.pending and len(self.flying) < limit:
            req = self.pending.pop(0)
            if link.runs == 1:  # a post that blocks (UCX mapping a source's memory) shows here
                link.trace("run 1: posting %d bytes (%d pieces) from process %d", req.nbytes, req.descriptors, req.peer)
            if link._call(req, link.agent.transfer, "posting") != "DONE":
                self.flying.append(req)
            else:
                self._finished(req)
        for req in list(self.flying):
            if link._call(req, link.agent.check_xfer_state, "reading") == "DONE":
                self.flying.remove(req)
                self._finished(req)
        self._report()
        if self.flying and link.trace.every("flying", PROGRESS_EVERY_S):
            link.trace("run %d: still reading: %s", link.runs, self.what())
        return not (self.pending or self.flying or self.held) and all(
            n >= self.rounds[sp][0] - self.rounds[sp][1] for sp, n in self.reported.items()
        )

    def _finished(self, req: _Request) -> None:
        self.done += 1
        if req.round >= 0:
            self.left[(req.peer, req.round)] -= 1

    def _release(self) -> None:
        for sp in sorted({p for p, _ in self.held}):
            v = self.link.store.peek(self.link._key(f"{self.link.sources[sp]}/packed"))
            if not isinstance(v, int) or isinstance(v, bool):
                continue
            for key in [k for k in self.held if k[0] == sp and self._base(sp) + k[1] + 1 <= v]:
                self.pending += self.held.pop(key)

    def _report(self) -> None:
        for sp, n in self.reported.items():
            count, slots = self.rounds[sp]
            while n < count - slots and self.left[(sp, n)] == 0 and (sp, n) not in self.held:
                n += 1
            if n > self.reported[sp]:
                self.reported[sp] = n
                self.link.store.put(
                    self.link._key(f"{self.link.sources[sp]}/consumed/{self.link.proc}"), self._base(sp) + n
                )

    def what(self) -> str:
        """What is still being read, or waited for."""
        if self.flying or self.pending:
            return NixlLink._pending(self.flying + self.pending)
        if self.held:
            sp, r = min(self.held)
            return (
                f"process {sp} packing its staging round {r} (NIXL; it packs a round once every receiver "
                "has read the one before it in that slot, from its finish on)"
            )
        return ""


class NixlLink:
    """One process's NIXL part of a plan: its agent and registered memory, the records it published
    (source) and the READ requests it prepared (receiver).

    Lifecycle: ``NixlLink.open(...)`` on every process with NIXL messages, after pre-flight (collective
    through the store: sources publish sealed records, receivers wait for theirs up to
    ``config.preflight_timeout_s``); per refit ``start(clock)`` (a source packs its first staging rounds
    and announces its tensors are final) then ``finish(clock)`` (a receiver reads everything; a source
    packs its later staging rounds as its receivers free the slots, then waits until they are done);
    ``close()``. Receivers of a source with more staging rounds than slots progress past the first
    rounds only once that source is in ``finish`` (after its other transports' work in a mixed plan).
    Must agree on every process: the plan and ``config.name`` (store keys); the job secret (records are
    sealed with it). Between refits: registrations and requests stay; sources change their tensors in
    place only between their ``finish`` and the next ``start``.
    """

    def __init__(self, agent, name: str, store: SignedStore, config: TransferConfig, proc: int) -> None:
        self.agent, self.name, self.store, self.config, self.proc = agent, name, store, config, proc
        self.registered: list = []  # NIXL registration lists (deregistered at close)
        self.tensors: list[torch.Tensor] = []  # what the registered memory belongs to (kept alive)
        self.staging: SourceStaging | None = None  # source: short-run pieces packed before each refit
        self.requests: list[_Request] = []  # receiver: READs, prepared once
        self.sources: dict[int, str] = {}  # receiver: source process -> its agent name
        self.unreachable: dict[int, str] = {}  # receiver: sources whose agent refused the connection at setup
        self.receivers: list[int] = []  # source: processes that read from this one
        self.sums: NixlSums | None = None  # checksum mode
        self.runs = 0  # refits started so far (the same count on every process of the plan)
        self.source_rounds: dict[int, tuple[int, int]] = {}  # receiver: source process -> (rounds, slots)
        self.packed = 0  # source: staging rounds packed in this run
        self.consumed: dict[int, int] = {}  # source: the last ``consumed`` value seen per receiver
        self.bytes_read = 0
        self.trace = Trace(proc)  # REFIT_NIXL_DEBUG=1: a line per phase
        self.shared: SharedAgent | None = None  # the process's agent (``agent`` is its NIXL object)

    @classmethod
    def open(cls, plan: Plan, proc: int, local: LocalTensors, store: SignedStore | None, config: TransferConfig):
        """Make the agent, register, publish and import records, prepare the reads (see the class)."""
        if store is None:
            raise PlanError("the plan has NIXL links but no rendezvous store was given")
        if not available():
            raise ConfigError("the plan has NIXL links but nixl is not installed: pip install 'refit-rl[nixl]'")
        mine = [m for m in plan.messages if m.transport == "nixl"]
        sends = [m for m in mine if plan.procs.src[m.src] == proc]
        recvs = [m for m in mine if plan.procs.dst[m.dst] == proc]
        tensors = [local.src_part(p.tensor, p.box)[1][1] for m in sends for p in m.pieces]
        tensors += [local.dst_view(p.tensor, p.box) for m in recvs for p in m.pieces]
        device = tensors[0].device if tensors else torch.device("cpu")
        staging = SourceStaging(plan, proc, local, config.buffer_bytes, config.num_buffers, device)
        tensors += [staging.buffer] if staging.offsets else []
        trace = Trace(proc)
        trace("setup on %s: %d pieces to send, %d to read, staging %d bytes", device, len(sends), len(recvs),
              staging.buffer.numel())  # fmt: skip
        one_host = peers_on_this_host(plan, proc)
        shared = SharedAgent.acquire(device, one_host)
        name = shared.name
        link = cls(shared.agent, name, store, config, proc)
        link.shared, link.trace = shared, trace
        trace("agent %s (UCX backend; one host: %s) used by %d link(s) here", name, one_host, shared.users)
        link.tensors, link.staging = tensors, staging  # registered memory stays allocated while the link lives
        link.sums = NixlSums(plan, proc, local, device) if config.checksums else None
        try:
            link._register(storage_regions(tensors))
            link.receivers = sorted({plan.procs.dst[m.dst] for m in sends})
            for r in link.receivers:
                rec = _record_for(plan, local, link.agent, name, link._regions, r, staging)
                store.put_sealed(link._key(f"record/{proc}/{r}"), json.dumps(rec).encode())
            trace("records published for processes %s", link.receivers)
            for sp in sorted({plan.procs.src[m.src] for m in recvs}):
                link._connect(plan, local, sp)
        except Exception:
            link.close()
            raise
        log.info("refit nixl: process %d agent %s: %d reads prepared", proc, name, len(link.requests))
        trace("setup done: %d READ requests prepared", len(link.requests))
        return link

    def _key(self, what: str) -> str:
        return f"{self.config.name}/nixl/{what}"

    def _register(self, regions: list[list]) -> None:
        self._regions = regions
        for mem in MEM_TYPES:
            rows = [(a, n, dev, "") for a, n, dev, m in regions if m == mem]
            if rows:
                t0 = time.monotonic()
                self.trace("registering %d %s regions, %d bytes", len(rows), mem, sum(r[1] for r in rows))
                self.registered.append(self.agent.register_memory(rows, mem))
                self.trace("registered %s in %.3f s", mem, time.monotonic() - t0)

    def _connect(self, plan: Plan, local: LocalTensors, sp: int) -> None:
        """Read, check and import source process ``sp``'s record; prepare the reads from it."""
        key = self._key(f"record/{sp}/{self.proc}")
        try:
            raw = self.store.get_sealed(key, self.config.preflight_timeout_s)
            rec = json.loads(raw)
        except (TimeoutError, ValueError) as e:
            raise PlanError(f"NIXL setup: no valid record from process {sp} under {key!r}: {e}") from e
        ndims, messages = {}, set()
        for k, m in enumerate(plan.messages):
            if m.transport == "nixl" and plan.procs.dst[m.dst] == self.proc and plan.procs.src[m.src] == sp:
                p = m.pieces[0]
                ndims[part_key(p.tensor, source_part(plan, m.src, p.tensor, p.box)[0])] = len(p.box)
                messages.add(k)
        rec = check_record(rec, f"process {sp}", ndims, messages)
        self.trace("record of process %d read: agent %s, %d regions", sp, rec["agent"], len(rec["regions"]))
        try:
            got = self.shared.add_remote(rec["metadata"])
        except Exception as e:  # noqa: BLE001 - NIXL's own error: the source's agent is gone
            self.unreachable[sp] = f"{type(e).__name__}: {e}"
            log.warning("refit nixl: process %d cannot reach process %d: %s", self.proc, sp, e)
            return
        self.sources[sp] = got  # counted: close() drops it
        if got != rec["agent"]:
            raise PlanError(f"NIXL record of process {sp}: metadata is of agent {got!r}, not {rec['agent']!r}")
        self.trace("agent of process %d added", sp)
        self.source_rounds[sp] = (rec["rounds"]["count"], rec["rounds"]["slots"])
        reqs = _prepare_reads(self.agent, plan, self.proc, local, rec, sp, self.config.buffer_bytes)
        self.requests += reqs
        self.trace("%d READ requests from process %d prepared: %d descriptors, %d bytes", len(reqs), sp,
                   sum(r.descriptors for r in reqs), sum(r.nbytes for r in reqs))  # fmt: skip

    # ------------------------------------------------------------------ run
    def start(self, clock: RunClock, fault=None) -> None:
        """Begin this process's part of a refit: a source (its tensors final) takes its checksums
        (checksum mode), calls ``fault("nixl-announce")`` (tests: a change now is what a receiver
        must catch), packs its first ``num_buffers`` staging rounds, publishes its sums and announces
        that its tensors are final."""
        self.runs += 1
        if not self.receivers:
            return
        self.trace("run %d: source, tensors final", self.runs)
        sent = self.sums.sent(clock) if self.sums is not None else None
        if fault is not None:
            fault("nixl-announce")
        if self.staging is not None:  # the first rounds packed, and on a GPU every write before the announcement done
            self.packed = min(len(self.staging.rounds), self.staging.slots)
            for r in range(self.packed):
                self.staging.pack(r)
            device_wait(self.staging.buffer.device, clock, "packing the NIXL staging buffer")
        if sent is not None:
            for r in self.receivers:
                rec = json.dumps(self.sums.record(r, self.runs, sent)).encode()
                self.store.put_sealed(self._key(f"{self.name}/sums/{r}"), rec)
        self.store.put(self._key(f"{self.name}/ready"), self.runs)
        self.trace("run %d: announced to processes %s", self.runs, self.receivers)

    def finish(self, clock: RunClock) -> None:
        """A receiver: wait for each source's announcement, read every piece (at most
        ``config.num_buffers`` requests in flight), announce it is done. A source: wait until every
        receiver of it is done. Every wait under ``clock``. A source this receiver could not connect to at
        setup (it died meanwhile) fails the refit here, naming it, so a fan-out re-plans around it."""
        if self.unreachable:
            sp, why = min(self.unreachable.items())
            raise TransferError(f"NIXL: process {sp} could not be reached when the reads were set up ({why})")
        for sp, agent in sorted(self.sources.items()):
            self._wait_for(self._key(f"{agent}/ready"), clock, lambda sp=sp: f"process {sp} announcing its tensors")
        if self.requests or self._rounds_to_pack() or any(c > n for c, n in self.source_rounds.values()):
            self.trace("run %d: every source announced; reading %d requests", self.runs, len(self.requests))
            self._pump(clock)
        if self.sums is not None and self.sources:
            self._check_sums(clock)
            self.trace("run %d: checksums equal", self.runs)
        for agent in self.sources.values():
            self.store.put(self._key(f"{agent}/done/{self.proc}"), self.runs)
        for r in self.receivers:
            key = self._key(f"{self.name}/done/{r}")
            self._wait_for(key, clock, lambda r=r: f"process {r} reading from process {self.proc} over NIXL")
        self.trace("run %d: finished", self.runs)

    def _check_sums(self, clock: RunClock) -> None:
        """Compare what was read with every source's sums of this run (``NixlSums.check``)."""
        want: dict[int, int] = {}
        for sp, agent in sorted(self.sources.items()):
            key = self._key(f"{agent}/sums/{self.proc}")
            got: dict = {}

            def arrived(sp=sp, key=key, got=got) -> bool:
                raw = self.store.peek_sealed(key)
                sums = None if raw is None else self.sums.check_record(json.loads(raw), sp, self.runs)
                got.update(sums or {})
                if sums is None:
                    time.sleep(_POLL_S)
                return sums is not None

            clock.watch(arrived, lambda sp=sp, key=key: f"process {sp}'s checksums (NIXL, store key {key!r})")
            want.update(got)
        self.sums.check(want, clock)

    def _wait_for(self, key: str, clock: RunClock, what) -> None:
        """Until the signed value under ``key`` reaches this run's number (an older value, or a forged
        one, does not end the wait)."""

        def reached() -> bool:
            v = self.store.peek(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= self.runs:
                return True
            if self.trace.every(key, PROGRESS_EVERY_S):
                self.trace("run %d: still waiting for %s", self.runs, what())
            time.sleep(_POLL_S)
            return False

        clock.watch(reached, lambda: f"{what()} (NIXL, store key {key!r})")

    def _rounds_to_pack(self) -> bool:
        return self.staging is not None and bool(self.receivers) and self.packed < len(self.staging.rounds)

    def _pump(self, clock: RunClock) -> None:
        """Read every prepared READ (``_Reads``) and, as a source, pack each later staging round once its
        receivers are done with the slot; both under ``clock`` until nothing is left."""
        reads = _Reads(self, self.source_rounds)
        t0 = time.monotonic()

        def step() -> bool:
            self._pack_next(clock)
            done = reads.step()
            if self.trace.every("read", PROGRESS_EVERY_S):
                self.trace("run %d: %d of %d requests read", self.runs, reads.done, len(self.requests))
            return done and not self._rounds_to_pack()

        clock.watch(step, lambda: reads.what() or self._packing())
        self.bytes_read = sum(r.nbytes for r in self.requests)
        dt = time.monotonic() - t0
        rate = self.bytes_read / max(dt, 1e-9) / 1e9  # run 1 includes UCX mapping the sources' memory
        self.trace("run %d: read %d bytes in %.3f s (%.2f GB/s)", self.runs, self.bytes_read, dt, rate)

    def _pack_next(self, clock: RunClock) -> None:
        """A source: pack the next staging round once every receiver reported the round that used its
        slot before (``consumed``), then say so (``packed``)."""
        if not self._rounds_to_pack() or self._late(first=True):
            return
        st, r = self.staging, self.packed
        st.pack(r)
        device_wait(st.buffer.device, clock, f"packing NIXL staging round {r}")
        self.store.put(self._key(f"{self.name}/packed"), (self.runs - 1) * len(st.rounds) + r + 1)
        self.packed += 1
        self.trace("run %d: staging round %d of %d packed", self.runs, r, len(st.rounds))

    def _late(self, first: bool) -> list[int]:
        """The receivers that have not reported the round whose slot the next round reuses (asked of the
        store where the last value seen is short; ``first``: stop at the first one)."""
        st = self.staging
        need = (self.runs - 1) * len(st.rounds) + self.packed - st.slots + 1
        late = []
        for rcv in self.receivers:
            if self.consumed.get(rcv, -1) < need:
                v = self.store.peek(self._key(f"{self.name}/consumed/{rcv}"))
                if isinstance(v, int) and not isinstance(v, bool):
                    self.consumed[rcv] = v
                if self.consumed.get(rcv, -1) < need:
                    late.append(rcv)
                    if first:
                        break
        return late

    def _packing(self) -> str:
        """A source's wait for its receivers (only the late ones are named)."""
        if not self._rounds_to_pack():
            return ""
        late, slot_round = self._late(first=False), self.packed - self.staging.slots
        return f"processes {late} reading staging round {slot_round} of process {self.proc} over NIXL"

    def _call(self, req: _Request, fn, what: str) -> str:
        try:
            state = fn(req.handle)
        except Exception as e:  # noqa: BLE001 - NIXL's own errors (a peer gone): name the peer
            raise TransferError(
                f"NIXL {what} {req.nbytes} bytes ({req.descriptors} pieces) from process {req.peer} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
        if state == "ERR":
            raise TransferError(f"NIXL {what} {req.nbytes} bytes from process {req.peer} failed (state ERR)")
        return state

    @staticmethod
    def _pending(flying: list[_Request]) -> str:
        peers = ", ".join(f"process {p}" for p in sorted({r.peer for r in flying}))
        return f"NIXL reads of {sum(r.nbytes for r in flying)} bytes from {peers}"

    def close(self) -> None:
        """Release the requests, forget the remote agents, deregister memory and drop the agent. Idempotent."""
        for req in self.requests:
            try:
                req.handle.release()
            except Exception:  # noqa: BLE001, S110 - a request left mid-flight by an aborted refit
                pass
        self.requests = []
        if self.agent is None or self.shared is None:
            return
        for agent in self.sources.values():
            self.shared.drop_remote(agent)
        for reg in self.registered:
            self.agent.deregister_memory(reg)
        self.shared.release()
        self.registered, self.sources, self.agent, self.shared, self.tensors = [], {}, None, None, []
