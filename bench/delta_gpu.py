"""Delta refits: kernel timings, the encoding rule's choice per link, and S1 dense vs delta.

    python -m bench.delta_gpu --out delta.json                      # CUDA: llama-3.1-8b shapes (bf16)
    python -m bench.delta_gpu --device cpu --model tiny-llama --out /tmp/delta.json

1. Kernels (one process, the first device): the model's bf16 weights, a base copy and an engine copy.
   Per changed fraction (0.1%, 1%, 10%, 100%): an optimizer-like step (every element flips its last
   mantissa bit with probability F: +-1 ulp, spread over every tensor, not in blocks), then per tensor
   ``find_changes`` (find: the one-pass Triton kernel on CUDA; its torch path and the kernel launched alone,
   without copying the changes out, timed beside it), ``encode``
   sparse (pack), ``decode`` + ``apply_changes`` into the engine
   copy (apply), and the base update; each phase timed over the whole model (tensors in groups of
   ``--group-gb``, synchronized per phase), against a dense on-device copy of every tensor. The engine
   copy is checked bit for bit after every fraction.
2. The rule (``refit.delta.rule.choose_encoding``) per link kind at each fraction, with the measured
   cost on one GPU: S2 (the engine on the trainer's GPU) must pick dense, since find + pack + apply
   reads more than the dense copy moves.
3. S1 (2 GPUs, or 2 CPU processes with ``--device cpu``): a Sender on GPU 0 and a Receiver on GPU 1 over
   NCCL P2P (``transport="p2p"``), Peer pairs dense (``delta="off"``), ``delta="auto"`` (the rule: dense
   over NVLink at the measured H100 rates, so it must match dense) and ``delta="sparse"`` (forced: what a
   delta costs there), all refit after every step; per fraction the median refit time (slowest process)
   and the bytes on the wire.
4. S3 (``--s3``; 2 GPUs, or 4 CPU processes): trainer fsdp=2 -> engine tp=2, colocated (processes 0-1 and 2-3
   on GPUs 0-1), ``transport="auto"``: a dense Peer and a ``delta="auto"`` one refit after every step. On CUDA
   every link is CUDA IPC, which ``auto`` keeps dense (on one GPU reading two versions costs more than
   copying one), so auto must match dense; the rows say whether a delta schedule was built at all.
5. S2 over NIXL (``--s2-nixl``; one GPU, or 2 CPU processes): trainer and engine on one device, Peers over
   CUDA IPC (dense), NIXL dense, NIXL with ``delta="auto"`` and forced words (``refit.transport.nixl_delta``),
   each refit after every step at 0.1%, 1% and 100% changed, the engine checked bit for bit after each.
6. S1 over CUDA IPC (``--s1-ipc``; 2 GPUs): dense IPC pulls beside IPC deltas (``refit.transport.ipc_delta``:
   ``auto``, forced words, forced words through a landing copy) and NCCL deltas (forced words) at 0.1%, 1% and 100%
   changed, exact-checked, its table printed last (``bench.delta_ipc``, which also runs alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.delta.elements import apply_changes, find_changes, find_changes_many, launch_many
from refit.delta.rule import LINKS, choose_encoding
from refit.delta.wire import decode, encode, wire_bytes
from refit.delta.words import addressable, find_words_many, launch_words_table, words_in
from refit.layout import box_slices
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.bench.weights import make_weight
from refit.tools.launch import run_local
from refit.transfer import Peer, Receiver, Sender

FRACTIONS = (0.001, 0.01, 0.1, 1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def refit_in_turn(peers: dict, names: list[str], version: int, turn: int, dev: torch.device, times: dict):
    """Every Peer of ``names`` refits ``version`` once, starting at ``names[turn % len(names)]`` (each first in
    turn), each timed from a barrier to its device's idle into ``times[name]``; yields ``(name, its stats)`` after
    each, so the caller checks it (untimed) before the next Peer's refit writes the same tensors."""
    turn %= len(names)
    for k in names[turn:] + names[:turn]:
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        st = peers[k].run(version)
        _sync(dev)
        times[k].append(time.perf_counter() - t0)
        yield k, st


def optimizer_step(tensors: dict[str, torch.Tensor], fraction: float, seed: int, chunk: int = 1 << 26) -> None:
    """Every element's last mantissa bit flips with probability ``fraction`` (a +-1 ulp bf16 change)."""
    gen = torch.Generator(device=next(iter(tensors.values())).device).manual_seed(seed)
    for t in tensors.values():
        flat = t.view(-1).view(torch.int16)
        for s in range(0, flat.numel(), chunk):
            c = flat[s : s + chunk]
            c ^= (torch.rand(c.shape, device=c.device, generator=gen) < fraction).to(torch.int16)


def _same(tensors: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> bool:
    """Every tensor of ``ref`` equal bit for bit in ``tensors`` (bf16 as int16)."""
    return all(torch.equal(tensors[n].view(torch.int16), ref[n].view(torch.int16)) for n in ref)


def _groups(tensors: dict[str, torch.Tensor], group_bytes: int) -> list[list[str]]:
    out, cur, size = [], [], 0
    for n, t in tensors.items():
        if cur and size + t.numel() * t.element_size() > group_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += t.numel() * t.element_size()
    return out + ([cur] if cur else [])


def _timed(device: torch.device, fn) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _find(base, cur, names, use_triton=None):
    if use_triton is False:
        return [find_changes(base[n], cur[n], use_triton=False) for n in names]
    return find_changes_many([(base[n], cur[n]) for n in names])  # what the transport runs per message


def _pack(cur, names, found, bufs):
    for n, (i, v), b in zip(names, found, bufs):
        encode("sparse", cur[n].numel(), i, v, b)


def _apply(cur, engine, names, found, bufs):
    for n, (i, _), b in zip(names, found, bufs):
        idx, vals = decode("sparse", cur[n].numel(), len(i), b, cur[n].dtype)
        apply_changes(engine[n], idx, vals)


def _base_update(base, names, found):
    for n, (i, v) in zip(names, found):
        apply_changes(base[n], i, v)


def _kernel_alone(base, cur, names):
    """The one-pass kernel alone, launched as ``find_changes_many`` launches it (``launch_many``: slots for a
    quarter of the elements, every piece, one host sync for the counts), without copying the changes out."""
    return launch_many([(base[n], cur[n]) for n in names])[0].tolist()


def _by_address(base, cur, names, device):
    """The word find as the transport launches it for a batch (``launch_words_table``: one launch over the
    pieces' addresses, then its counts read)."""
    ptrs = [np.array([t[n].data_ptr() for n in names], dtype=np.int64) for t in (base, cur)]
    nwords = np.array([words_in(cur[n]) for n in names], dtype=np.int64)
    return launch_words_table(*ptrs, nwords, device).result()


def _group(cur, base, engine, names, device, sec) -> list[tuple[int, int]]:
    """One group's phases, each synchronized and added to ``sec``; returns ``(n, k)`` per tensor."""
    if device.type == "cuda":  # the torch reference and the kernel alone, beside what find_changes takes
        sec["find_torch"] += _timed(device, partial(_find, base, cur, names, False))[0]
        sec["kernel_alone"] += _timed(device, partial(_kernel_alone, base, cur, names))[0]
    dt, found = _timed(device, partial(_find, base, cur, names))
    sec["find"] += dt
    dt, words = _timed(device, partial(find_words_many, [(base[n], cur[n]) for n in names]))
    sec["words_find"] += dt
    if all(addressable(base[n]) and addressable(cur[n]) for n in names):  # by address, as the transport finds
        sec["words_table"] += _timed(device, partial(_by_address, base, cur, names, device))[0]
    sec["words_count"] += sum(k for _, _, k in words)
    sec["words_over_slots"] += sum(i is None for i, _, _ in words)
    del words
    sizes = [wire_bytes("sparse", cur[n].numel(), len(i), 2) for n, (i, _) in zip(names, found)]
    bufs = [torch.empty(s, dtype=torch.uint8, device=device) for s in sizes]
    sec["pack"] += _timed(device, partial(_pack, cur, names, found, bufs))[0]
    sec["apply"] += _timed(device, partial(_apply, cur, engine, names, found, bufs))[0]
    sec["base_update"] += _timed(device, partial(_base_update, base, names, found))[0]
    return [(cur[n].numel(), len(i)) for n, (i, _) in zip(names, found)]


def kernel_row(cur, base, engine, fraction, device, group_bytes) -> dict:
    """One fraction's find / pack / apply / base-update seconds over the whole model, bytes, exactness."""
    keys = ("find", "find_torch", "kernel_alone", "pack", "apply", "base_update", "words_find", "words_count")
    keys = (*keys, "words_table")
    sec = dict.fromkeys((*keys, "words_over_slots"), 0.0)
    counts = [nk for names in _groups(cur, group_bytes) for nk in _group(cur, base, engine, names, device, sec)]
    n_all, k_all = sum(n for n, _ in counts), sum(k for _, k in counts)
    copy_s, _ = _timed(device, partial(_copy_all, engine, cur))  # dense, on the device
    exact = all(torch.equal(engine[n].view(torch.int16), cur[n].view(torch.int16)) for n in cur)
    exact = exact and all(torch.equal(base[n].view(torch.int16), cur[n].view(torch.int16)) for n in cur)
    return {
        "fraction": fraction,
        "changed": k_all / max(1, n_all),
        **{
            f"{k}_ms": v * 1e3
            for k, v in sec.items()
            if not k.startswith("words_") or k in ("words_find", "words_table")
        },
        "words_bytes": wire_bytes("words", n_all, int(sec["words_count"]), 2),
        "words_over_slots": int(sec["words_over_slots"]),
        "find_pack_apply_ms": (sec["find"] + sec["pack"] + sec["apply"]) * 1e3,
        "dense_copy_ms": copy_s * 1e3,
        "dense_bytes": 2 * n_all,
        "sparse_bytes": sum(wire_bytes("sparse", n, k, 2) for n, k in counts),
        "bitmask_bytes": sum(wire_bytes("bitmask", n, k, 2) for n, k in counts),
        "choice": {link: choose_encoding([(n, k, 2) for n, k in counts], LINKS[link]) for link in LINKS},
        "exact": exact,
    }


def _copy_all(engine, cur):
    for n in cur:
        engine[n].copy_(cur[n])


def kernels(model: str, device: torch.device, group_bytes: int) -> tuple[list[dict], int]:
    shapes = param_shapes(model)
    cur = {n: make_weight(n, s, torch.bfloat16, device) for n, s, _ in shapes}
    base = {n: t.clone() for n, t in cur.items()}
    engine = {n: t.clone() for n, t in cur.items()}
    # warm-up, not recorded: a step and every phase once (Triton compiles the kernel once per argument
    # specialization at its first use; the allocator grows to the phases' sizes), then the versions equal
    # again. Without it the first row (0.1%) was 5-30x slower than the others in every find path.
    optimizer_step(cur, FRACTIONS[0], seed=10_000)
    kernel_row(cur, base, engine, FRACTIONS[0], device, group_bytes)
    rows = []
    for i, f in enumerate(FRACTIONS):
        optimizer_step(cur, f, seed=i + 1)
        rows.append(kernel_row(cur, base, engine, f, device, group_bytes))
    model_bytes = sum(t.numel() * 2 for t in cur.values())
    del cur, base, engine
    return rows, model_bytes


# S1's delta Peer pairs beside the dense one: name -> mode
DELTA_PEERS = {"delta": "auto", "sparse": "sparse", "words": "words"}
ALL_PEERS = dict(DELTA_PEERS)


def _select(modes: list[str], word_piece_us: float | None) -> None:
    """This process's delta Peers (``--modes``; ``delta`` always, the run reads its base size) and, for an
    A/B of the rule, its per-piece word cost (``--word-piece-us``: ``LinkSpeed.word_piece_s`` of the CUDA
    links replaced in this process's ``refit.delta.rule.LINKS``; every process of the run calls this alike)."""
    global DELTA_PEERS
    DELTA_PEERS = {k: ALL_PEERS[k] for k in ALL_PEERS if k == "delta" or k in modes}
    if word_piece_us is not None:
        for kind in ("nvlink", "nic"):
            LINKS[kind] = dataclasses.replace(LINKS[kind], word_piece_s=word_piece_us * 1e-6)


def _profiled(peer, tensors, ref, version: int, out: str, rank: int) -> int:
    """Three more refits of ``peer`` at 1% changed under cProfile; the top functions (by own and by cumulative
    time) into ``out/profile_<rank>.txt``, the whole profile into ``out/profile_<rank>.pstats``. Returns the
    last version."""
    import cProfile
    import io
    import os
    import pstats

    prof = cProfile.Profile()
    for it in range(3):
        version += 1
        optimizer_step(tensors if ref is None else ref, 0.01, seed=99_000 + it)
        _sync(tensors[next(iter(tensors))].device)  # the step's kernels are not the refit's
        dist.barrier()
        prof.enable()
        peer.run(version)
        _sync(tensors[next(iter(tensors))].device)
        prof.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(35)
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/profile_{rank}.txt", "w") as f:
        f.write(text.getvalue())
    prof.dump_stats(f"{out}/profile_{rank}.pstats")  # the whole profile, e.g. to keep refit's own functions
    return version


def _traced(peers, tensors, ref, version: int, out: str, rank: int) -> int:
    """Two refits of each of ``auto`` and forced words at 1% changed under torch's profiler (host calls and
    CUDA kernels, one timeline per process): ``out/trace_<mode>_<rank>.json`` (Chrome trace format), to see
    where the device waits. Returns the last version."""
    import os

    from torch.profiler import ProfilerActivity, profile, record_function

    os.makedirs(out, exist_ok=True)
    dev = tensors[next(iter(tensors))].device
    for mode, key in (m for m in (("words", "words"), ("auto", "delta")) if m[1] in peers):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for it in range(2):
                version += 1
                optimizer_step(tensors if ref is None else ref, 0.01, seed=98_000 + it)
                # every peer refits every version: they share the receiver's tensors, so one left behind would
                # diff against a version its receiver no longer holds (the traced one right after dense)
                for k in ("dense", key, *(k for k in peers if k not in ("dense", key))):
                    _sync(dev)
                    dist.barrier()
                    with record_function(f"refit {k} v{version}"):
                        peers[k].run(version)
                        _sync(dev)
        prof.export_chrome_trace(f"{out}/trace_{mode}_{rank}.json")
    return version


def _s1_worker(
    world, model: str, iters: int, buffer_mb: int, profile=None, trace=None, modes=tuple(ALL_PEERS), piece_us=None
):
    """S1: process 0 sends, process 1 receives; a dense and a delta Peer pair refit after every step."""
    _select(list(modes), piece_us)
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes(model)]
    lay = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    dev = world.device
    # on CUDA the devices make the rule weigh an NVLink link (without them: a CPU link, as on the CPU run)
    procs = ProcessMap((0,), (1,), ("cuda:0", "cuda:1") if dev.type == "cuda" else None)
    base_cfg = TransferConfig(transport="p2p", num_buffers=2, buffer_bytes=buffer_mb << 20, deadline_s=600)
    cfgs = {
        "dense": base_cfg,
        **{k: TransferConfig(**{**base_cfg.__dict__, "delta": m, "name": k}) for k, m in DELTA_PEERS.items()},
    }
    group = world.data_group if dev.type == "cuda" else None  # NCCL for CUDA tensors (the default group is gloo)
    if world.src_rank is not None:
        tensors = {n: make_weight(n, s, torch.bfloat16, dev) for n, s, _ in shapes}
        peers = {
            k: Sender(lay, lay, 0, tensors, procs=procs, config=c, device=dev, group=group, tag_base=100_000 * i)
            for i, (k, c) in enumerate(cfgs.items())
        }
    else:
        tensors = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s, _ in shapes}
        peers = {
            k: Receiver(lay, lay, 1, tensors, procs=procs, config=c, device=dev, group=group, tag_base=100_000 * i)
            for i, (k, c) in enumerate(cfgs.items())
        }
    ref = {n: make_weight(n, s, torch.bfloat16, dev) for n, s, _ in shapes} if world.dst_rank is not None else None
    version, rows = 1, []
    for p in peers.values():
        p.run(version)  # version 1: dense for both (nothing to diff against)
    for fi, f in enumerate(FRACTIONS):
        times = {k: [] for k in peers}
        wire = {k: [] for k in peers}
        enc, exact = {}, True
        names = list(peers)
        for it in range(iters):
            version += 1
            optimizer_step(tensors if ref is None else ref, f, seed=1000 * fi + it)  # the receiver: its reference
            turn = (it - 1) % len(names)  # each method first in turn (the first after a step may pay for it)
            for k in names[turn:] + names[:turn]:
                p = peers[k]
                _sync(dev)  # this process's step is done before the barrier: no process starts its clock
                dist.barrier()  # while another still finishes its step (the first refit after it would pay)
                t0 = time.perf_counter()
                st = p.run(version)
                _sync(dev)
                times[k].append(time.perf_counter() - t0)
                wire[k].append(st.bytes_sent if st.delta is None else st.delta.wire_bytes)
                if st.delta is not None and world.src_rank is not None:
                    enc[k] = dict(st.delta.encodings)
                if ref is not None:  # bit for bit after every refit, dense and delta alike
                    exact = exact and _same(tensors, ref)
        warm = slice(1, None) if iters > 1 else slice(None)
        rows.append(
            {
                "fraction": f,
                **{f"{k}_ms": statistics.median(times[k][warm]) * 1e3 for k in peers},
                **{f"{k}_bytes": wire[k][-1] for k in peers},
                "encodings": enc,
                "exact": exact,
            }
        )
        if trace and f == 0.01:  # right after the 1% refits: auto diffs there (after 10% it sends dense)
            version = _traced(peers, tensors, ref, version, trace, world.rank)
    if profile:  # the receiver's reference follows the same steps, so both stay exact
        version = _profiled(peers.get("words", peers["delta"]), tensors, ref, version, profile, world.rank)
    extra = peers["delta"].executor.delta_base_bytes
    for p in peers.values():
        p.close()
    return rows, extra


def s1(
    model: str, device: str, iters: int, buffer_mb: int, profile=None, trace=None, modes=tuple(ALL_PEERS), piece_us=None
) -> list[dict] | None:
    devices = ["cuda:0", "cuda:1"] if device == "cuda" else ["cpu", "cpu"]
    args = (model, iters, buffer_mb, profile, trace, tuple(modes), piece_us)
    out = run_local(_s1_worker, 1, 1, *args, devices=devices, timeout_s=1200)
    (send_rows, extra), (recv_rows, _) = out
    rows = []
    for a, b in zip(send_rows, recv_rows):  # the slowest process's time; the receiver's exactness
        rows.append(
            {
                **a,
                **{f"{k}_ms": max(a[f"{k}_ms"], b[f"{k}_ms"]) for k in ("dense", *DELTA_PEERS)},
                "exact": b["exact"],
                "sender_base_bytes": extra,
            }
        )
    return rows


def _s3_worker(world, model: str, iters: int) -> tuple[list[dict], bool]:
    """S3: every process holds the whole model (changed alike: same seeds), a source refits its fsdp shard of
    it, an engine rank checks its tp shard bit for bit after every refit. Returns the rows (this process's
    times) and whether the ``auto`` Peer built a delta schedule (its links were P2P)."""
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes(model)]
    src_l = layout_from_spec(shapes, parse_spec("fsdp=2", "src"))
    dst_l = layout_from_spec(shapes, parse_spec("tp=2", "dst"))
    dev = world.device
    devices = ("cuda:0", "cuda:1", "cuda:0", "cuda:1") if dev.type == "cuda" else ("cpu",) * 4
    procs = ProcessMap.disjoint(2, 2).with_devices(devices)
    full = {n: make_weight(n, s, torch.bfloat16, dev) for n, s, _ in shapes}
    is_src = world.src_rank is not None
    layout, rank = (src_l, world.src_rank) if is_src else (dst_l, world.dst_rank)
    boxes = {t.name: box_slices(b) for t, b in layout.local_tensors(rank)}
    mine = {n: full[n][sl].clone() if is_src else torch.zeros_like(full[n][sl]) for n, sl in boxes.items()}
    kw = {"src_tensors": mine} if is_src else {"dst_tensors": mine}
    cfgs = {"dense": {}, "delta": {"delta": "auto"}}
    peers = {
        k: Peer(
            src_l,
            dst_l,
            world.rank,
            procs=procs,
            config=TransferConfig(name=f"s3-{k}", transport="auto", deadline_s=600, **c),
            device=dev,
            tag_base=100_000 * i,
            **kw,
        )
        for i, (k, c) in enumerate(cfgs.items())
    }
    version, rows = 1, []
    for p in peers.values():
        p.run(version)
    for fi, f in enumerate(FRACTIONS):
        times = {k: [] for k in peers}
        exact = True
        for it in range(iters):
            version += 1
            optimizer_step(full, f, seed=1000 * fi + it)  # the same change on every process
            if is_src:
                for n, sl in boxes.items():
                    mine[n].copy_(full[n][sl])
            for k in list(peers)[it % 2 :] + list(peers)[: it % 2]:  # each Peer first in turn
                _sync(dev)  # as in S1: every process's step is done before any clock starts
                dist.barrier()
                t0 = time.perf_counter()
                peers[k].run(version)
                _sync(dev)
                times[k].append(time.perf_counter() - t0)
                if not is_src:
                    exact = exact and all(
                        torch.equal(mine[n].view(torch.int16), full[n][sl].view(torch.int16)) for n, sl in boxes.items()
                    )
        warm = slice(1, None) if iters > 1 else slice(None)
        rows.append(
            {"fraction": f, **{f"{k}_ms": statistics.median(times[k][warm]) * 1e3 for k in peers}, "exact": exact}
        )
    built = peers["delta"].executor.delta is not None
    for p in peers.values():
        p.close()
    return rows, built


def s3(model: str, device: str, iters: int) -> list[dict]:
    """``_s3_worker`` on 4 processes: per fraction the slowest process's median per Peer, every engine rank's
    exactness, and whether any process built a delta schedule."""
    devices = ["cuda:0", "cuda:1", "cuda:0", "cuda:1"] if device == "cuda" else ["cpu"] * 4
    out = run_local(_s3_worker, 2, 2, model, iters, devices=devices, timeout_s=1200)
    rows = []
    for i, r in enumerate(out[0][0]):
        per = [o[0][i] for o in out]
        rows.append(
            {
                "fraction": r["fraction"],
                **{f"{k}_ms": max(p[f"{k}_ms"] for p in per) for k in ("dense", "delta")},
                "exact": all(p["exact"] for p in per),
                "delta_schedule": any(built for _, built in out),
            }
        )
    return rows


S2_NIXL_PEERS = {  # name -> TransferConfig fields: CUDA IPC dense, NIXL dense, NIXL deltas (the rule's, forced words)
    "ipc": {"transport": "auto"},
    "nixl": {"transport": "nixl"},
    "nixl_auto": {"transport": "nixl", "delta": "auto"},
    "nixl_words": {"transport": "nixl", "delta": "words"},
}
S2_FRACTIONS = (0.001, 0.01, 1.0)


def _s2_nixl_worker(world, model: str, iters: int, buffer_mb: int, names: tuple[str, ...]) -> list[dict]:
    """S2 over NIXL: process 0 (trainer) and 1 (engine) on one device; per fraction, after every step, each
    Peer of ``names`` (``S2_NIXL_PEERS``) refits in turn (each first in turn); the engine checks every refit bit
    for bit."""
    shapes = [(n, s, torch.bfloat16) for n, s, _ in param_shapes(model)]
    lay = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    dev = world.device
    procs = ProcessMap((0,), (1,), (str(dev), str(dev)))
    is_src = world.src_rank is not None
    tensors = {n: make_weight(n, s, torch.bfloat16, dev) if is_src else torch.zeros(s, dtype=torch.bfloat16, device=dev)
               for n, s, _ in shapes}  # fmt: skip
    ref = None if is_src else {n: make_weight(n, s, torch.bfloat16, dev) for n, s, _ in shapes}
    kw = {"src_tensors": tensors} if is_src else {"dst_tensors": tensors}
    base = {"num_buffers": 2, "buffer_bytes": buffer_mb << 20, "deadline_s": 600}
    peers = {
        k: Peer(
            lay,
            lay,
            world.rank,
            procs=procs,
            config=TransferConfig(**base, **S2_NIXL_PEERS[k], name=f"s2-{k}"),
            device=dev,
            tag_base=100_000 * i,
            **kw,
        )  # fmt: skip
        for i, k in enumerate(names)
    }
    version, rows = 1, []
    for p in peers.values():
        p.run(version)  # dense for all: nothing to diff against
    for fi, f in enumerate(S2_FRACTIONS):
        times, exact, enc = {k: [] for k in peers}, True, {}
        for it in range(iters):
            version += 1
            optimizer_step(tensors if ref is None else ref, f, seed=1000 * fi + it)
            for k, st in refit_in_turn(peers, names, version, it, dev, times):
                if st.delta is not None and is_src:
                    enc[k] = dict(st.delta.encodings)
                if ref is not None:
                    exact = exact and _same(tensors, ref)
        warm = slice(1, None) if iters > 1 else slice(None)
        rows.append({"fraction": f, **{f"{k}_ms": statistics.median(v[warm]) * 1e3 for k, v in times.items()},
                     "exact": exact, "encodings": enc})  # fmt: skip
    for p in peers.values():
        p.close()
    return rows


def s2_nixl(model: str, device: str, iters: int, buffer_mb: int) -> list[dict]:
    """``_s2_nixl_worker`` on 2 processes of one device, once per NIXL Peer (a process holds one NIXL link: a
    second one's registrations invalidate the first's prepared reads on GPUs), each beside the IPC Peer and
    after the same steps: per fraction the slower process's medians (IPC: the first run's), the engine's
    exactness over every run and the trainer's delta encodings."""
    devices = ["cuda:0", "cuda:0"] if device == "cuda" else ["cpu", "cpu"]
    rows: list[dict] = []
    for k in (k for k in S2_NIXL_PEERS if k != "ipc"):
        src, dst = run_local(_s2_nixl_worker, 1, 1, model, iters, buffer_mb, ("ipc", k), devices=devices,
                             timeout_s=1200)  # fmt: skip
        for i, (a, b) in enumerate(zip(src, dst)):
            got = {f"{n}_ms": max(a[f"{n}_ms"], b[f"{n}_ms"]) for n in ("ipc", k)}
            if i == len(rows):
                rows.append({"fraction": a["fraction"], **got, "exact": b["exact"], "encodings": a["encodings"]})
                continue
            rows[i] |= {f"{k}_ms": got[f"{k}_ms"], "exact": rows[i]["exact"] and b["exact"]}
            rows[i]["encodings"] |= a["encodings"]
    return rows


def _print_s2_nixl(rows: list[dict]) -> None:
    print("S2 one device, CUDA IPC vs NIXL dense vs NIXL deltas (slower process, median ms; x NIXL dense):")
    for r in rows:
        cols = " | ".join(f"{k} {r[f'{k}_ms']:8.2f} ({r[f'{k}_ms'] / r['nixl_ms']:.2f}x)" for k in S2_NIXL_PEERS)
        print(f"  {r['fraction']:>6.1%} | {cols} | exact {r['exact']} {r['encodings']}")


def _print(res: dict) -> None:
    print(f"device {res['device']}, model {res['model']} ({res['model_bytes'] / 1e9:.2f} GB bf16)")
    print(
        "kernels (one process, ms): changed | find (torch path) | pack | apply | base upd | dense copy | "
        "sparse/dense bytes | exact"
    )
    gb = 2 * res["model_bytes"] / 1e9  # the find reads base and current
    for r in res["kernels"]:
        if r["kernel_alone_ms"]:
            print(
                f"  {r['fraction']:>6.1%}: find {r['find_ms']:.2f} ms ({gb / r['find_ms']:.2f} TB/s read); "
                f"the kernel launched alone {r['kernel_alone_ms']:.2f} ms ({gb / r['kernel_alone_ms']:.2f} TB/s); "
                f"words: find {r['words_find_ms']:.2f} ms ({gb / r['words_find_ms']:.2f} TB/s; find_words_many), "
                f"by address {r.get('words_table_ms', 0):.2f} ms (the transport's launch), wire "
                f"{r['words_bytes'] / r['dense_bytes']:.2%} of dense, {r['words_over_slots']} pieces over the slots"
            )
    for r in res["kernels"]:
        print(
            f"  {r['fraction']:>6.1%} ({r['changed']:.3%}) | {r['find_ms']:7.2f} ({r['find_torch_ms']:7.2f}) | "
            f"{r['pack_ms']:6.2f} | "
            f"{r['apply_ms']:6.2f} | {r['base_update_ms']:6.2f} | {r['dense_copy_ms']:7.2f} ms | "
            f"{r['sparse_bytes'] / r['dense_bytes']:6.2%} | {r['exact']}"
        )
    print("rule's choice per link (S2 = same_device):")
    for r in res["kernels"]:
        s2 = r["choice"]["same_device"]
        print(
            f"  {r['fraction']:>6.1%}: {r['choice']}; S2 picks {s2}: find+pack+apply {r['find_pack_apply_ms']:.2f} "
            f"ms vs dense copy {r['dense_copy_ms']:.2f} ms"
        )
    if res["s1"] is None:
        print(f"S1 not run: {res['s1_skipped']}")
        return
    print(
        "S1 over P2P (slowest process, median): fraction | dense ms | per delta mode (auto = delta, forced sparse, "
        "forced words): ms (x dense, bytes / dense) | exact"
    )
    for r in res["s1"]:
        modes = " | ".join(
            f"{k} {r[f'{k}_ms']:8.2f} ({r[f'{k}_ms'] / r['dense_ms']:.2f}x, {r[f'{k}_bytes'] / r['dense_bytes']:6.2%})"
            for k in DELTA_PEERS
        )
        print(f"  {r['fraction']:>6.1%} | {r['dense_ms']:8.2f} | {modes} | {r['exact']} {r['encodings']}")
    print(f"extra memory (sender base copy): {res['s1'][0]['sender_base_bytes'] / 1e9:.2f} GB")


def _print_s3(rows: list[dict]) -> None:
    print(
        "S3 fsdp=2 -> tp=2 colocated, transport auto (slowest process, median): fraction | dense ms | auto ms (x dense)"
    )
    for r in rows:
        print(
            f"  {r['fraction']:>6.1%} | {r['dense_ms']:8.2f} | {r['delta_ms']:8.2f} "
            f"({r['delta_ms'] / r['dense_ms']:.2f}x) | exact {r['exact']} | delta schedule built: {r['delta_schedule']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--model", default=None, help="default: llama-3.1-8b on cuda, tiny-llama on cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--iters",
        type=int,
        default=4,
        help="S1 refits per fraction (the first is not counted; 3k + 1 puts each method first equally often)",
    )
    ap.add_argument("--buffer-mb", type=int, default=256)
    ap.add_argument("--group-gb", type=float, default=1.0, help="kernel timings: tensors per phase, in GB")
    ap.add_argument("--no-s1", action="store_true", help="kernel timings and the rule only")
    ap.add_argument("--no-kernels", action="store_true", help="S1 only")
    ap.add_argument("--s3", action="store_true", help="also S3 (colocated fsdp=2 -> tp=2, 4 processes), dense vs auto")
    ap.add_argument(
        "--s2-nixl", action="store_true", help="also S2 (one device): CUDA IPC, NIXL dense and NIXL deltas (needs nixl)"
    )
    ap.add_argument("--s1-ipc", action="store_true", help="also S1 over CUDA IPC: dense, IPC deltas, NCCL deltas")
    ap.add_argument("--profile", default=None, help="a directory: cProfile of 3 forced-words S1 refits at 1%%")
    ap.add_argument("--trace", default=None, help="a directory: torch profiler timelines of S1 refits at 1%%")
    ap.add_argument("--modes", default=",".join(ALL_PEERS), help="S1's delta Peers (delta = auto, always run)")
    ap.add_argument("--word-piece-us", type=float, default=None, help="S1: the rule's per-piece word cost, for an A/B")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(ALL_PEERS))
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(ALL_PEERS)})")
    if args.word_piece_us is not None and not 0 <= args.word_piece_us < 1e6:
        ap.error(f"--word-piece-us must be microseconds in [0, 1e6), got {args.word_piece_us}")
    _select(modes, args.word_piece_us)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("llama-3.1-8b" if device == "cuda" else "tiny-llama")
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    if args.no_kernels:
        rows, model_bytes = [], sum(math.prod(s) * 2 for _, s, _ in param_shapes(model))
    else:
        rows, model_bytes = kernels(model, dev, int(args.group_gb * 1e9))
    if device == "cuda":
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    res = {"device": name, "model": model, "model_bytes": model_bytes, "kernels": rows, "s1": None}
    with open(args.out, "w") as f:  # the kernel timings are kept even if S1 fails
        json.dump(res, f, indent=1)
    _print({**res, "s1_skipped": "--no-s1" if args.no_s1 else "(runs next)"})
    if args.no_s1:
        res["s1_skipped"] = "--no-s1"
    elif device == "cpu" or torch.cuda.device_count() >= 2:
        res["s1"] = s1(model, device, args.iters, args.buffer_mb, args.profile, args.trace, modes, args.word_piece_us)
        _print({**res, "kernels": []})
    else:
        res["s1_skipped"] = f"{torch.cuda.device_count()} GPU(s): S1 needs 2"
    if args.s3 and (device == "cpu" or torch.cuda.device_count() >= 2):
        res["s3"] = s3(model, device, args.iters)
        _print_s3(res["s3"])
    if args.s2_nixl:
        res["s2_nixl"] = s2_nixl(model, device, args.iters, args.buffer_mb)
        _print_s2_nixl(res["s2_nixl"])
    if args.s1_ipc and device == "cuda" and torch.cuda.device_count() >= 2:
        from bench.delta_ipc import print_s1_ipc, s1_ipc  # it imports this module's helpers

        res["s1_ipc"] = s1_ipc(model, args.iters, args.buffer_mb)
        with open(args.out, "w") as f:  # kept if printing fails
            json.dump(res, f, indent=1)
        print_s1_ipc(res["s1_ipc"])
    elif args.s1_ipc:
        print(f"S1 over CUDA IPC not run: {torch.cuda.device_count()} GPU(s), it needs 2")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
