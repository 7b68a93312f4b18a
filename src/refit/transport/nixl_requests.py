"""A NIXL receiver's READ requests: its pieces turned into descriptors and prepared once at setup.

``prepare_reads`` turns every piece a receiver reads from one source into descriptors (``piece_runs``: one
per contiguous run common to both sides, every piece inside a region its source registered, read in place
or from the source's staging buffer) and gathers them into READ requests (``initialize_xfer``), posted
again every refit. How big a request is and whether it counts against the staging budget in flight
(``Request.capped``) depends on what it reads:

* in place between GPUs: at least ``nixl_agent.GPU_WORKERS`` requests of at most ``GPU_REQUEST_BYTES``,
  all in flight at once, each prepared on a thread of its own. UCX's ``cuda_ipc`` transport issues a
  worker's copies from one source GPU on one stream and NIXL binds each new thread to the next worker,
  so the requests run on that many streams (``nixl_agent.ucx_workers``); buffer-sized requests two at
  a time left the copy engine idle between them (16 GB GPU0 -> GPU1 on 2x H200 in 73 requests of
  <= 256 MiB, two in flight: 83 ms, against 41 ms for a copy). Nothing is staged on either side, so
  nothing bounds them but UCX's own queues.
* everything else (host memory, or a staging round): requests of at most ``config.buffer_bytes``, at
  most ``config.num_buffers`` in flight (``refit.transport.nixl``'s ``_Reads``): a staging round's
  slot is reused once read, and over TCP between hosts small requests keep the progress of every
  source's worker even.

Delta mode (``per_message``): each message's runs are also a request of their own, so a refit reads only
its dense messages this way (``refit.transport.nixl_delta``).

Knows nothing of the store or of a refit's rounds; imports ``nixl`` through the agent it is handed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from refit.binding import LocalTensors
from refit.errors import PlanError
from refit.layout import box_relative
from refit.plan import Plan
from refit.plan.schedule import part_key, source_part
from refit.transport.nixl_agent import GPU_WORKERS
from refit.transport.nixl_memory import dense_strides, memory_of, runs, span
from refit.transport.nixl_record import inside

MAX_DESCRIPTORS = 1 << 16  # per READ request
GPU_REQUEST_BYTES = 4 << 30  # an in-place READ between GPUs (module docstring)


@dataclass
class Request:
    """One prepared READ: ``nbytes`` from source process ``peer`` (agent ``agent``); ``round``: the
    source's staging round it reads from (-1: in place); ``capped``: whether it counts against
    ``config.num_buffers`` requests in flight (module docstring)."""

    peer: int
    agent: str
    handle: object
    nbytes: int
    descriptors: int
    round: int = -1
    message: int = -1  # delta mode: the one message it reads (``prepare_reads``)
    capped: bool = True


def piece_runs(
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
    if not inside(rec["regions"], mem, dev, lo, hi):
        raise PlanError(
            f"NIXL record of {who}: tensor {p.tensor!r} piece {[list(b) for b in p.box]} spans bytes "
            f"[{lo:#x}, {hi:#x}) of {mem}:{dev}, outside every region it registered"
        )
    view = local.dst_view(p.tensor, p.box)
    s_addr, d_addr, run = runs(shape, start, strides, view.data_ptr(), view.stride(), p.itemsize)
    return (mem, dev, *memory_of(view)), s_addr, d_addr, run


def chunks(lengths: np.ndarray, limit: int) -> list[tuple[int, int]]:
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


def prepare_reads(
    agent, plan: Plan, proc: int, local: LocalTensors, rec: dict, sp: int, limit: int, per_message: bool = False
) -> list[Request]:
    """The READ requests of ``proc`` from source process ``sp`` (validated ``rec``), each of at most
    ``limit`` bytes (``GPU_REQUEST_BYTES`` in place between GPUs: the module docstring), prepared once
    (``initialize_xfer``) and posted again every refit; ``per_message`` (delta mode): each message's runs
    are also a request of their own, so a refit reads only its dense messages this way."""
    groups: dict[tuple, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for k, m in enumerate(plan.messages):
        if m.transport == "nixl" and plan.procs.dst[m.dst] == proc and plan.procs.src[m.src] == sp:
            kind, s_addr, d_addr, run = piece_runs(plan, k, local, rec, f"process {sp}")
            key = (rec["rounds"]["of"].get(k, -1), *kind)
            for tag in {-1, k if per_message else -1}:  # delta mode: grouped too (``NixlDelta.dense_requests``)
                groups.setdefault((*key, tag), []).append((s_addr, d_addr, np.full(len(s_addr), run, np.int64)))
    out = []
    for (rnd, mem, dev, dmem, ddev, k), arrays in sorted(groups.items()):
        s_addr, d_addr, lens = (np.concatenate(a) for a in zip(*arrays))
        gpu = rnd < 0 and k < 0 and mem == dmem == "VRAM"  # grouped, in place, GPU to GPU
        if gpu:  # at least one request per UCX worker (module docstring)
            total = int(lens.sum())
            limit_here = min(GPU_REQUEST_BYTES, -(-total // GPU_WORKERS))
        for a, b in chunks(lens, limit_here if gpu else limit):
            n = b - a
            remote = np.stack([s_addr[a:b], lens[a:b], np.full(n, dev)], 1).astype(np.uint64)
            mine = np.stack([d_addr[a:b], lens[a:b], np.full(n, ddev)], 1).astype(np.uint64)

            def make(mine=mine, remote=remote, dmem=dmem, mem=mem):
                mine_d, remote_d = agent.get_xfer_descs(mine, dmem), agent.get_xfer_descs(remote, mem)
                return agent.initialize_xfer("READ", mine_d, remote_d, rec["agent"], b"")

            handle = on_new_thread(make) if gpu else make()
            out.append(Request(sp, rec["agent"], handle, int(lens[a:b].sum()), n, rnd, k, capped=not gpu))
    return out


def on_new_thread(fn):
    """``fn()`` on a thread of its own, its result or exception returned here: NIXL's UCX backend binds a
    thread to its next worker at the thread's first request (module docstring)."""
    got: dict = {}

    def run() -> None:
        try:
            got["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            got["error"] = e

    t = threading.Thread(target=run, name="refit-nixl-prepare", daemon=True)
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["value"]
