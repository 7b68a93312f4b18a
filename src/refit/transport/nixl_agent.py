"""This process's NIXL agent: its UCX settings, the agent its links share, and NIXL debugging.

``available()``: whether ``nixl`` imports here (with its UCX plugin). ``apply_ucx_settings`` sets the
process's UCX variables before an agent is made: those of ``refit.transport.nics`` (``UCX_NET_DEVICES``:
the selected NICs plus the bind address's interface, ``UCX_MAX_RMA_RAILS``; no NIC where the plan's
devices put every peer on this host: ``peers_on_this_host``; on CUDA, READs over CUDA IPC allowed
without NVLink); a variable the user set stays, one that refit set for an earlier agent
(``REFIT_UCX_SET``) is chosen anew. ``make_agent``: a NIXL agent with the UCX backend, NIXL's own
metadata listener off (it binds every interface and has no authentication) and NIXL's strict thread
mode. ``SharedAgent``: one agent per process and UCX settings however many links (Peers) use it,
remote agents counted per link.

Debugging (``REFIT_NIXL_DEBUG=1``): ``Trace`` prints a line per phase on stderr, flushed at once (the
phases are the link's: ``refit.transport.nixl``), and UCX prints the transports and protocols it chose
(``UCX_LOG_LEVEL=info``, ``UCX_PROTO_INFO=y``); ``ucx_config()`` reads back UCX's own parsed
configuration in this process (a diagnostic).

Imports ``nixl`` only inside ``available`` and ``make_agent`` (an optional extra: refit imports without
it); uses ``refit.transport.nics`` (which NICs) and ``refit.transport.store`` (the bind address).
Knows nothing of records or registered memory.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping

import torch

from refit.plan import Plan
from refit.transport.nics import process_nics, ucx_settings
from refit.transport.store import bind_address, interface_of

log = logging.getLogger("refit.nixl")

SYSFS_ENV = "REFIT_SYSFS_ROOT"  # where NIC discovery reads sysfs (default /sys; a container's mount, tests)
SET_ENV = "REFIT_UCX_SET"  # the UCX variables refit itself set (JSON): chosen anew for a later agent
DEBUG_ENV = "REFIT_NIXL_DEBUG"  # "1": a line per phase on stderr (``Trace``), UCX's own choices printed
UCX_SHOWN = ("UCX_NET_DEVICES", "UCX_MAX_RMA_RAILS", "UCX_TLS")
PROGRESS_EVERY_S = 5.0  # debug: how often a long wait says what it still waits for
GPU_WORKERS = 8  # UCX workers of an agent on a GPU (``ucx_workers``)


def available() -> bool:
    """Whether ``nixl`` imports here (with its UCX plugin)."""
    try:
        import nixl._api  # noqa: F401
    except ImportError:
        return False
    return True


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


def progress_thread(device: torch.device) -> bool:
    """Whether an agent for ``device`` runs NIXL's progress thread. Not for host memory: there UCX's TCP
    transport serves a READ only when the source's worker progresses, and NIXL's thread polls it without
    rest (about a third of a core per process, idle or not); on 2 cores beside the processes it served it
    stalled reads across hosts for seconds. The refit's own waits progress the worker instead
    (``SharedAgent.progress``). On CUDA the thread stays (reads go by the copy engines)."""
    return torch.device(device).type == "cuda"


def ucx_workers(device: torch.device) -> int:
    """How many UCX workers an agent for ``device`` has: ``GPU_WORKERS`` on CUDA, else one. UCX's
    ``cuda_ipc`` transport makes every copy a worker reads from one source GPU on one stream, and NIXL
    binds each thread to the next worker at its first request, so a receiver that prepares its reads
    between GPUs on threads of their own (``nixl_requests.prepare_reads``) spreads them over this many
    streams. S1 on 2x H200 (16 GB GPU0 -> GPU1 in 291 tensors, the floor 41 ms): 60.5 ms with 2 workers,
    49.0 ms with 8, 45.4 ms with 16 (one run each, the same call)."""
    return GPU_WORKERS if torch.device(device).type == "cuda" else 1


def make_agent(name: str, device: torch.device, one_host: bool = False):
    """A NIXL agent named ``name`` with the UCX backend (``ucx_workers`` workers), no metadata listener and
    NIXL's strict thread mode (its calls serialized: links of one process may run from different threads),
    a progress thread only where ``progress_thread`` says; the UCX settings applied first
    (``apply_ucx_settings``)."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    apply_ucx_settings(device, one_host=one_host)
    config = nixl_agent_config(
        backends=[],
        enable_listen_thread=False,
        enable_prog_thread=progress_thread(device),
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(name, config)
    agent.create_backend("UCX", {"num_workers": str(ucx_workers(device))})
    return agent


NOTES_KEPT = 256  # notifications kept per process (``SharedAgent.listen``): the newest, one per key


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

    def __init__(self, key: tuple[str, bool], agent, name: str, threaded: bool = True) -> None:
        self.key, self.agent, self.name, self.threaded = key, agent, name, threaded
        self.users = 0
        self.remotes: Counter[str] = Counter()
        self.notes: dict[str, bytes] = {}  # the latest notification per key (``listen``), at most ``NOTES_KEPT``

    def progress(self) -> None:
        """Progress the UCX worker where no progress thread does (``progress_thread``), keeping the notifications
        that came (``listen``): called by every wait of a refit, so a source serves its receivers' READs while it
        waits for them."""
        if not self.threaded:
            self.listen()

    def listen(self) -> None:
        """Keep the notifications received since the last call (with no progress thread this progresses the
        worker too): each ``key + b"\\n" + value`` (``notify``) as ``notes[key] = value``, the newest
        ``NOTES_KEPT`` keys. A note is a hint, unchecked here: its reader verifies the value's tag."""
        if self.agent is None:
            return
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                raw, sep, value = bytes(msg).partition(b"\n")
                key = raw.decode(errors="replace")
                if sep:
                    self.notes.pop(key, None)  # (re-inserted: the newest last)
                    self.notes[key] = value
        while len(self.notes) > NOTES_KEPT:
            self.notes.pop(next(iter(self.notes)))

    def notify(self, remote: str, key: str, value: bytes) -> None:
        """Send ``value`` for ``key`` to the remote agent ``remote`` as a notification (a hint its ``listen``
        keeps); nothing where NIXL refuses (the store holds the same value)."""
        try:
            self.agent.send_notif(remote, key.encode() + b"\n" + value)
        except Exception:  # noqa: BLE001, S110 - a hint: the reader falls back to the store
            pass

    @classmethod
    def acquire(cls, device: torch.device, one_host: bool = False) -> SharedAgent:
        key = (str(device), one_host)
        with cls._lock:
            shared = cls._agents.get(key)
            if shared is None:
                name = f"refit-{os.getpid()}-{uuid.uuid4().hex[:16]}"
                agent = make_agent(name, device, one_host)
                shared = cls._agents[key] = cls(key, agent, name, progress_thread(device))
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
