"""Process setup for running trainer and engine ranks on one machine.

``run_local(fn, n_src, n_dst, *args)`` spawns ``n_src + n_dst`` processes
(processes ``0..n_src-1`` are trainer ranks, the rest engine ranks), joins them
with a TCP rendezvous on the bind address, creates the trainer group and the engine
group, calls ``fn(world, *args)`` in each and returns the results by process
rank. Processes fork from a ``forkserver`` that imported torch and refit once (``PRELOAD``), so a rank
starts in a fraction of a second where a fresh interpreter spends seconds importing; each gets this
process's environment as it is at the call (a forkserver's children would otherwise inherit the server's).
The job's secret (``REFIT_SECRET`` if set, else a fresh one) and bind address
(``REFIT_BIND_ADDRESS``, default loopback) reach each child through a pipe; the store,
gloo and NCCL listen on that address only. A worker's exception is re-raised in the caller with its rank; a worker
that dies or overruns ``timeout_s`` fails the call instead of hanging it.
``devices`` pins each process to a device (several may share a GPU, as in
colocated refits); the world group is then gloo, used for barriers and the
store, and ``world.data_group`` is a NCCL group when every process has a GPU of its own.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refit.errors import ConfigError
from refit.transport import auth
from refit.transport.control import free_port
from refit.transport.store import BIND_ENV, JOB_ENV, SignedStore, bind_address, open_store, pin_interfaces, signed

PRELOAD = ["torch", "torch.distributed", "refit.transfer", "refit.tools.launch", "refit.tools.warm"]
"""What the forkserver imports before it forks a rank (never CUDA: importing torch does not initialize it;
``refit.tools.warm`` brings in transformers with the preset architectures and triton, which ranks import late)."""

MAX_LOCAL_PROCESSES = 256
"""The most processes ``run_local`` starts on one machine (one per rank): a typo such as ``tp=100000`` is an
error, not a fork bomb."""


class WorkerError(RuntimeError):
    """A spawned worker raised, died or overran its deadline."""


@dataclass
class World:
    """What ``run_local`` hands ``fn`` in each spawned process: the world's shape, this
    process's place in it, and the groups, all set up before ``fn`` runs (the process group is
    destroyed after it returns).

    Processes ``0..n_src-1`` are trainer ranks; engine ranks are processes ``n_src..`` (or
    ``0..n_dst-1`` when ``colocated``: both sides share processes). ``src_rank`` / ``dst_rank``:
    this process's rank on each side, or None. ``trainer_group`` / ``engine_group``: groups over
    those processes (None for an empty side); every process is in the world group, on
    ``backend``. ``device``: this process's; ``devices``: every process's, when ``run_local`` was
    given them (else empty).
    """

    rank: int
    world_size: int
    n_src: int
    n_dst: int
    backend: str
    device: torch.device
    trainer_group: Any
    engine_group: Any
    colocated: bool = False
    devices: tuple[str, ...] = ()  # every process's device, by rank
    # the group for data P2P: None = the default group; a NCCL group over all ranks when the
    # world is gloo but every process has a GPU of its own
    data_group: Any = None

    @property
    def store(self) -> SignedStore:
        """The job's rendezvous store (hosted by process 0), signed with the job's secret."""
        return signed(dist.distributed_c10d._get_default_store())

    @property
    def src_rank(self) -> int | None:
        return self.rank if self.rank < self.n_src else None

    @property
    def dst_rank(self) -> int | None:
        if self.colocated:
            return self.rank if self.rank < self.n_dst else None
        r = self.rank - self.n_src
        return r if 0 <= r < self.n_dst else None


_HOSTED: list = []
"""The store process 0 hosts, held until the caller of ``run_local`` has every result."""


def _join(
    rank: int, world_size: int, backend: str, port: int, secret: bytes, address: str, job_id: str, timeout_s: float
) -> None:
    """This process's part of the job: its secret and bind address in its environment (for ``Peer``s it
    builds), gloo/NCCL pinned to that address's interface, the store hosted by process 0 on that address
    alone, then the default group over it."""
    os.environ.update(auth.child_env(secret))
    os.environ[JOB_ENV] = job_id  # this run's scope in every tag: values of another run do not verify
    os.environ[BIND_ENV] = address
    pin_interfaces(address)
    store = open_store(address, port, world_size, rank == 0, timeout_s, secret=secret, scope=job_id)
    if rank == 0:
        _HOSTED.append(store)  # outlives the default group: the others may still use it (``_worker``)
    options = nccl_options() if backend == "nccl" else None
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), pg_options=options
    )


def nccl_options():
    """Options of the launcher's default group (when NCCL) and its NCCL data group: streams of high priority,
    so that a P2P send or receive starts beside a large kernel already queued on another stream (a delta
    refit's next find) instead of after its blocks (``refit.delta.payload``); None where this torch has no
    NCCL."""
    options = getattr(dist, "ProcessGroupNCCL", None)
    return None if options is None else options.Options(is_high_priority_stream=True)


def _worker(rank, world_size, n_src, n_dst, colocated, backend, port, fn, args, results, timeout_s, devices, job):
    try:
        shape = (rank, world_size, n_src, n_dst, colocated, backend, port)
        _run_worker(*shape, fn, args, results, timeout_s, devices, job)
    finally:
        if rank == 0:  # the store's host: it stays until the caller has every result or gave up on them
            job[4].wait(timeout_s + 60)


def _run_worker(rank, world_size, n_src, n_dst, colocated, backend, port, fn, args, results, timeout_s, devices, job):
    try:
        os.environ.clear()  # the caller's environment at run_local, not the forkserver's
        os.environ.update(job[3])
        torch.set_num_threads(1)
        if devices:
            device = torch.device(devices[rank])
        elif backend == "nccl":
            device = torch.device("cuda", rank % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        _join(rank, world_size, backend, port, *job[:3], timeout_s)
        trainer = dist.new_group(list(range(n_src))) if n_src else None
        engine_ranks = list(range(n_dst)) if colocated else list(range(n_src, n_src + n_dst))
        engine = dist.new_group(engine_ranks) if n_dst else None
        all_devices = tuple(devices) if devices else ()
        world = World(rank, world_size, n_src, n_dst, backend, device, trainer, engine, colocated, all_devices)
        if backend != "nccl" and len(set(all_devices)) == world_size and all(d.startswith("cuda") for d in all_devices):
            world.data_group = dist.new_group(list(range(world_size)), backend="nccl", pg_options=nccl_options())
        payload = pickle.dumps(fn(world, *args))  # plain bytes: no shared memory outliving us
        release_at_exit(world.store, rank, _cuda_ranks(world))
        results.put((rank, True, payload))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


EXIT_WAIT_S = 10.0
"""How long a process that used CUDA waits at exit for the others (``release_at_exit``): a dead peer costs this."""


def _cuda_ranks(world: World) -> list[int]:
    """The processes a CUDA process waits for at exit: those pinned to a GPU, or every one when ``run_local``
    was given no devices (one of those that never initializes CUDA does not come: waited for ``EXIT_WAIT_S``)."""
    if world.devices:
        return [r for r, d in enumerate(world.devices) if d.startswith("cuda")]
    return list(range(world.world_size))


def release_at_exit(store: Any, rank: int, ranks: list[int], timeout_s: float = EXIT_WAIT_S) -> bool:
    """After a worker's ``fn`` returned: free its garbage and, if this process initialized CUDA, the CUDA
    IPC memory it shared that no one maps any more; so that no process exits while another still maps its
    memory, first wait (at most ``timeout_s``; a dead peer is not waited for longer) until every process of
    ``ranks`` got here, recorded under ``launch/exit/<rank>`` in ``store`` (a ``SignedStore``).

    Returns whether it waited. Without CUDA initialized it returns False at once and never touches
    ``store``. A store that fails (its host, process 0, already left) ends the wait: everyone got here."""
    gc.collect()  # cycles still holding tensors or mappings (Peers, graphs)
    if not torch.cuda.is_initialized():  # no driver call
        return False
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()  # mappings this process dropped; the blocks it exported that others released
    _wait_for_all(store, rank, ranks, timeout_s)
    torch.cuda.ipc_collect()  # the others have dropped their mappings of ours by now
    return True


def _wait_for_all(store: Any, rank: int, ranks: list[int], timeout_s: float) -> None:
    """Publish that ``rank`` reached its exit, then poll until every rank of ``ranks`` has, ``timeout_s``
    passes, or the store fails (best effort: never raises for a peer that is gone)."""
    keys = [f"launch/exit/{r}" for r in ranks]
    deadline = time.monotonic() + timeout_s
    try:
        store.put(f"launch/exit/{rank}", True)
        while len(store.get_all(keys)) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.005)
    except (RuntimeError, OSError):  # the store's host left: it got here before it did
        pass


_COLLATERAL = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _death(code: int) -> str:
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"process exited with {how} without a result"


def _describe_failure(procs, out: dict, errors: dict) -> str:
    """Name the process that most likely failed first: one that died without a result (a signal,
    an abort), else one whose error is not just a peer having gone away, else the lowest rank."""
    for r, p in enumerate(procs):
        if r not in out and r not in errors and p.exitcode not in (None, 0):
            errors[r] = _death(p.exitcode)
    silent = [r for r in errors if errors[r].startswith("process exited")]
    own = [r for r in errors if not any(c in errors[r] for c in _COLLATERAL)]
    first = min(silent or own or errors)
    others = ", ".join(f"{r}: {errors[r].splitlines()[0][:160]}" for r in sorted(errors) if r != first)
    return f"process {first} failed: {errors[first]}" + (f"\n(also: {others})" if others else "")


def run_local(
    fn: Callable[..., Any],
    n_src: int,
    n_dst: int,
    *args: Any,
    backend: str | None = None,
    colocated: bool = False,
    timeout_s: float = 600.0,
    devices: list[str] | None = None,
    expect_dead: set[int] | frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``fn(world, *args)`` in each process; return results ordered by process rank.

    ``expect_dead``: processes allowed to die without a result (fault injection); theirs is None."""
    if n_src < 0 or n_dst < 0 or n_src + n_dst < 1:
        raise ValueError(f"need at least one process, got n_src={n_src}, n_dst={n_dst}")
    world_size = max(n_src, n_dst) if colocated else n_src + n_dst
    if world_size > MAX_LOCAL_PROCESSES:
        raise ConfigError(
            f"{n_src} trainer + {n_dst} engine ranks need {world_size} processes on this machine, more than "
            f"the limit of {MAX_LOCAL_PROCESSES} for a local run (plan such layouts with `refit plan`)"
        )
    if devices is not None and len(devices) != world_size:
        raise ValueError(f"devices names {len(devices)} devices for {world_size} processes")
    backend = _backend(backend, devices, world_size)
    ctx = _context()
    results = ctx.Queue()
    address = bind_address()
    port = free_port(address)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    released = ctx.Event()  # set once this call has every result (or failed): then process 0 may take the store down
    job = (auth.secret_or_new(), address, uuid.uuid4().hex, env, released)  # a pipe to the children, never a socket
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, n_src, n_dst, colocated, backend, port, fn, args, results, timeout_s, devices, job),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        _collect(procs, results, out, errors, timeout_s, expect_dead)
        if errors:
            _collect_late(procs, results, out, errors)
            raise WorkerError(_describe_failure(procs, out, errors))
        return [out[r] for r in range(world_size)]
    finally:
        released.set()
        _stop(procs, failed=bool(errors))


def _backend(backend: str | None, devices: list[str] | None, world_size: int) -> str:
    if backend is None and devices is not None:
        return "gloo"  # the world may put several processes on one GPU; NCCL cannot
    if backend is None:
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    return backend


def start_process(target: Callable[..., Any], args: tuple = ()) -> BaseProcess:
    """A started process, forked from the same forkserver as ``run_local``'s ranks, that runs ``target(*args)``
    with this process's environment as it is now (a spawned interpreter would spend seconds importing what the
    forkserver holds). Like a spawned process, an exception in ``target`` is printed and makes exit code 1."""
    p = _context().Process(target=_with_environment, args=(dict(os.environ), target, args))
    p.start()
    return p


def _with_environment(env: dict[str, str], target: Callable[..., Any], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def _context():
    """The forkserver context with ``PRELOAD`` (one server per calling process, started by the first call)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _collect(procs: list, results, out: dict, errors: dict, timeout_s: float, expect_dead) -> None:
    """Fill ``out`` (rank -> result) until every process reported, or stop at the first error or unexpected
    death (recorded in ``errors``); a process in ``expect_dead`` that dies gets the result None."""
    deadline = time.monotonic() + timeout_s + 30
    while len(out) + len(errors) < len(procs):
        try:
            rank, ok, val = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out and r not in errors]
            for r in [r for r in dead if r in expect_dead]:
                out[r] = None
            dead = [r for r in dead if r not in expect_dead]
            if dead:
                for r in dead:
                    errors[r] = _death(procs[r].exitcode)
                return
            if time.monotonic() > deadline:
                raise WorkerError(f"workers overran the {timeout_s:.0f}s deadline; killed") from None
            continue
        # ``results`` is a multiprocessing queue: a pipe this process made and handed to its own spawned
        # children, never a socket or the store, so only those children can write what is unpickled here
        (out if ok else errors)[rank] = pickle.loads(val) if ok else val
        if not ok:
            return


def _collect_late(procs: list, results, out: dict, errors: dict) -> None:
    """After a failure: give the others a moment to report their own error."""
    end = time.monotonic() + 5
    while len(out) + len(errors) < len(procs) and time.monotonic() < end:
        try:
            rank, ok, val = results.get(timeout=0.5)
            (out if ok else errors)[rank] = pickle.loads(val) if ok else val
        except queue.Empty:
            pass


def _stop(procs: list, failed: bool) -> None:
    """Join every process (briefly after a failure), killing those still alive."""
    for p in procs:
        if p.is_alive():
            p.join(timeout=10 if not failed else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
