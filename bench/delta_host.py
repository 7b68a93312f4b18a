"""The host (Python) time of a delta refit on CPU: Llama-3.1-8B's tensor list at tiny shapes, words by address.

    TRITON_INTERPRET=1 python -m bench.delta_host                  # 20 refits at 1%, forced words
    TRITON_INTERPRET=1 python -m bench.delta_host --delta auto --iters 30 --out /tmp/host.json

Two processes over gloo (``run_local``): a Sender (process 0) and a Receiver (process 1), ``transport="p2p"``.
The 291 tensors of ``param_shapes("llama-3.1-8b")`` keep their names and ranks, each dimension divided by
``--div`` (rounded up; 64: a q_proj is 64 x 64, the embedding 2004 x 64, whole 64-bit words everywhere), and the
staging budget cuts the step into ``--chunks`` chunks: the messages, pieces and chunks of the GPU case
(``bench/results/h200-x2-session39``: 291 messages in 4 chunks), not its bytes.

``TRITON_INTERPRET=1`` makes ``delta_words.addressable`` true on the CPU, so the word path goes by address
(``launch_words_table``, ``pack_table``, ``Scatter``) as on CUDA; the Triton launches themselves
(``delta_triton.launch_find_words`` / ``launch_pack_words`` /
``launch_scatter_words``) are replaced in both
processes by numpy stand-ins reading the same tables (raw addresses), so the interpreter's kernel time stays
out of the measurement. The stand-ins must be exact: the receiver compares every tensor with its reference
(the same steps from the same seed) bit for bit after every refit and the run fails otherwise.

Per refit: an optimizer-like step (``bench.delta_gpu.optimizer_step``: each element's last bit flips with
probability ``--fraction``), a barrier, then ``run(version)`` timed on each process. Reported per process over
``--iters`` refits (after a dense first refit and one warm-up diff): the median ``run()`` wall time (it includes
the stand-ins, gloo and waiting for the peer: noisy on a shared 2-core machine) and the median host CPU time of
``run()``'s thread less the stand-ins' and the waits' for the peer (``P2PSchedule.wait``, ``SignedStore.get``:
their polling costs what the peer takes), by ``time.thread_time``: refit's own host work, the number to compare;
then ``--profiled`` more refits under cProfile: the tottime per refit of refit's own functions (``src/refit``, but
those that wait for the peer), the function calls per refit but the waits' and the harness's (a count the
machine's load does not change), the tottime of the harness (the stand-ins) and of everything, and refit's top
functions (``--verbose``: the others too).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import math
import os
import pstats
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from bench.delta_gpu import optimizer_step
from refit.config import TransferConfig
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.bench.weights import make_weight
from refit.tools.launch import run_local
from refit.transfer import Receiver, Sender


def _at(addr: int, nbytes: int, dtype) -> np.ndarray:
    """The ``nbytes`` at byte address ``addr`` as a writable numpy array of ``dtype`` (no copy; kept, as a refit
    repeats the weights' and bases' addresses: a view of an address is the same whatever lives there)."""
    key = (addr, nbytes, dtype)
    got = _VIEWS.get(key)
    if got is None:
        if len(_VIEWS) > 1 << 16:
            _VIEWS.clear()
        got = _VIEWS[key] = np.frombuffer((ctypes.c_char * nbytes).from_address(int(addr)), dtype=dtype)
    return got


_VIEWS: dict[tuple, np.ndarray] = {}


def _rows(table: torch.Tensor) -> list[list[int]]:
    return table.numpy().tolist()


def _find_words(table, pieces, idx, vals, counts) -> None:
    """``_find_words``: per piece (rows: first, base, cur, words, slot, cap) the changed words' indices and bits
    into its slots (at most ``cap``), and its true count."""
    if not len(pieces):
        return
    _, base, cur, nwords, slot, cap = _rows(table)
    i32, i64, cnt = idx.numpy(), vals.numpy(), counts.numpy()
    for j in range(len(nwords)):
        b, c = _at(base[j], 8 * nwords[j], np.int64), _at(cur[j], 8 * nwords[j], np.int64)
        changed = np.flatnonzero(b != c)
        cnt[j] = len(changed)
        m = min(len(changed), cap[j])
        i32[slot[j] : slot[j] + m] = changed[:m]
        i64[slot[j] : slot[j] + m] = c[changed[:m]]


def _scatter_words(table, programs, flag, check, pieces=False) -> None:
    """``_scatter_words``: per piece (rows: first, destination, indices, words, k, n) check every index into
    ``flag`` (``pieces``: and ``flag[1 + j]``) or, unless ``flag[0]`` is raised, store each word at its index."""
    if not programs or (not check and int(flag[0])):
        return
    _, dst, idx, words, k, n = _rows(table)
    for j in range(len(k)):
        i = _at(idx[j], 4 * k[j], np.int32)
        if check:
            if k[j] and (i.min() < 0 or i.max() >= n[j]):
                flag[0] = 1
                if pieces:
                    flag[1 + j] = 1
        else:
            _at(dst[j], 8 * n[j], np.int64)[i] = _at(words[j], 8 * k[j], np.int64)


def _pack_words(table, programs) -> None:
    """``_pack_words``: per piece (rows: first, indices, words, k, destination) its wire format."""
    if not programs:
        return
    _, idx, words, k, dst = _rows(table)
    for j in range(len(k)):
        pad = (4 * k[j] + 7) // 8 * 8
        out = _at(dst[j], pad + 8 * k[j], np.uint8)
        out[: 4 * k[j]] = _at(idx[j], 4 * k[j], np.uint8)
        out[4 * k[j] : pad] = 0
        out[pad:] = _at(words[j], 8 * k[j], np.uint8)


def _timed(fn, spent: list[float]):
    """``fn``, its main-thread CPU time added to ``spent[0]`` (taken out of a refit's host time)."""

    def call(*args, **kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.thread_time() - t0

    return call


SPENT = [0.0]  # the stand-ins' CPU time so far
WAITED = [0.0]  # the CPU time of the waits for the peer so far (polling a P2P work, the store's records)
STAND_INS = {
    "launch_find_words": _find_words,
    "launch_scatter_words": _scatter_words,
    "launch_pack_words": _pack_words,
}


def _stand_in() -> None:
    """Replace the word kernels' Triton launches by the numpy stand-ins (this process only)."""
    from refit.quant import delta_triton

    assert os.environ.get("TRITON_INTERPRET") == "1" and delta_triton.AVAILABLE, "needs Triton and TRITON_INTERPRET=1"
    for name, fn in STAND_INS.items():
        setattr(delta_triton, name, _timed(fn, SPENT))
    from refit.transport.p2p import P2PSchedule
    from refit.transport.store import SignedStore

    P2PSchedule.wait = _timed(P2PSchedule.wait, WAITED)  # CPU spent waiting (polling) depends on the peer
    SignedStore.get = _timed(SignedStore.get, WAITED)


def shapes(div: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Llama-3.1-8B's tensors, each dimension divided by ``div`` (rounded up, the last one to a multiple of 4:
    bf16 rows of whole 64-bit words)."""
    out = []
    for name, shape, _ in param_shapes("llama-3.1-8b"):
        s = [max(1, math.ceil(d / div)) for d in shape]
        s[-1] = -(-s[-1] // 4) * 4
        out.append((name, tuple(s), torch.bfloat16))
    return out


def _budget(shp: list, chunks: int) -> int:
    """A buffer size (two buffers) that cuts the step of ``shp``'s bytes into ``chunks`` chunks."""
    total = sum(math.prod(s) * 2 for _, s, _ in shp)
    return -(-total // (2 * chunks)) + 4096


def _own(stats: pstats.Stats) -> tuple[float, float, float, list, list]:
    """tottime of refit's functions, of the harness (the stand-ins), of everything; the top 12 (name, tottime)
    of refit's and of the others."""
    own, stand, total, top, other = 0.0, 0.0, 0.0, [], []
    for (file, line, fn), (_, _, tt, _, _) in stats.stats.items():
        total += tt
        if "/src/refit/" in file and not _waiting(file, fn):
            own += tt
            top.append((f"{file.split('/src/refit/')[1]}:{line}({fn})", tt))
        elif file.endswith("delta_host.py"):
            stand += tt
        else:
            other.append((f"{file.split('/')[-1]}:{line}({fn})", tt))
    return own, stand, total, *(sorted(t, key=lambda x: -x[1])[:25] for t in (top, other))


def _calls(stats: pstats.Stats) -> int:
    """The function calls made under the profile but by the waits for the peer and by the harness (every call
    whose caller is neither): a count that the machine's load does not change, unlike the times."""
    calls = 0
    for (file, _, fn), (_, _, _, _, callers) in stats.stats.items():
        if not (_waiting(file, fn) or file.endswith("delta_host.py")):
            calls += sum(
                v[1] for c, v in callers.items() if not (_waiting(c[0], c[2]) or c[0].endswith("delta_host.py"))
            )
    return calls


def _waiting(file: str, fn: str) -> bool:
    """A function of refit's that waits for the peer (polls a P2P work or the store): not counted as its own."""
    return file.endswith("transport/clock.py") or (
        file.endswith(("transport/p2p.py", "transport/store.py")) and fn in {"wait", "_wait_inline", "<lambda>", "get"}
    )


def _worker(world, args: dict) -> dict:
    _stand_in()
    shp = shapes(args["div"])
    lay = layout_from_spec(shp, parse_spec("tp=1", "src"))
    procs = ProcessMap((0,), (1,), None)
    cfg = TransferConfig(
        transport="p2p",
        num_buffers=2,
        buffer_bytes=_budget(shp, args["chunks"]),
        deadline_s=600,
        delta=args["delta"],
        name="host",
    )
    sender = world.src_rank is not None
    make = (lambda n, s: make_weight(n, s, torch.bfloat16, torch.device("cpu"))) if sender else None
    tensors = {n: make(n, s) if sender else torch.zeros(s, dtype=torch.bfloat16) for n, s, _ in shp}
    peer = (Sender if sender else Receiver)(lay, lay, 0 if sender else 1, tensors, procs=procs, config=cfg)
    ref = None if sender else {n: make_weight(n, s, torch.bfloat16, torch.device("cpu")) for n, s, _ in shp}
    chunks = sorted({(s, c) for s, c in _chunk_ids(peer)})
    times, cpu, version, exact, enc = [], [], 1, True, {}
    prof = cProfile.Profile()
    for it in range(2 + args["iters"] + args["profiled"]):
        if it:  # refit 1 is dense (nothing to diff against)
            optimizer_step(tensors if ref is None else ref, args["fraction"], seed=it)
        dist.barrier()
        profiled = it >= 2 + args["iters"]
        if profiled:
            prof.enable()
        t0, c0, s0 = time.perf_counter(), time.thread_time(), SPENT[0] + WAITED[0]
        st = peer.run(version)
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0 - (SPENT[0] + WAITED[0] - s0)
        if profiled:
            prof.disable()
        elif it >= 2:
            times.append(dt)
            cpu.append(dc)
        if sender and st.delta is not None:
            enc = dict(st.delta.encodings)
        if ref is not None:
            exact = exact and all(torch.equal(tensors[n].view(torch.int16), ref[n].view(torch.int16)) for n in ref)
        version += 1
    if args.get("dump"):
        prof.dump_stats(os.path.join(args["dump"], f"prof_{'sender' if sender else 'receiver'}.pstats"))
    stats = pstats.Stats(prof)
    own, stand, total, top, other = _own(stats)
    calls = _calls(stats)
    peer.close()
    n = max(1, args["profiled"])
    return {
        "side": "sender" if sender else "receiver",
        "run_ms": statistics.median(times) * 1e3,
        "host_ms": statistics.median(cpu) * 1e3,
        "own_ms": own / n * 1e3,
        "stand_in_ms": stand / n * 1e3,
        "calls": calls // n,
        "profiled_total_ms": total / n * 1e3,
        "top": [(f, tt / n * 1e3) for f, tt in top],
        "other": [(f, tt / n * 1e3) for f, tt in other],
        "exact": exact,
        "encodings": enc,
        "chunks": len(chunks),
        "messages": sum(len(s) + len(r) for s, r in peer.executor.delta.steps) if _delta(peer) else 0,
    }


def _delta(peer):
    return getattr(peer.executor, "delta", None)


def _chunk_ids(peer) -> list[tuple[int, int]]:
    d = _delta(peer)
    return [] if d is None else [(0, i) for i in range(len(d.steps))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--div", type=int, default=64, help="each dimension divided by this")
    ap.add_argument("--chunks", type=int, default=4, help="chunks the staging budget cuts the step into")
    ap.add_argument("--delta", default="words", choices=["words", "auto"])
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profiled", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--verbose", action="store_true", help="also the top functions outside refit")
    ap.add_argument("--dump", default=None, help="a folder: each side's profile as pstats (prof_sender.pstats, ...)")
    args = vars(ap.parse_args())
    verbose = args["verbose"]
    os.environ.setdefault("TRITON_INTERPRET", "1")
    run_args = {k: args[k] for k in ("div", "chunks", "delta", "fraction", "iters", "profiled", "dump")}
    res = run_local(_worker, 1, 1, run_args, backend="gloo", timeout_s=1200)
    assert all(r["exact"] for r in res), "the receiver's tensors differ from the sender's"
    print(f"delta={args['delta']} fraction={args['fraction']} chunks={res[0]['chunks']} msgs={res[0]['messages']}")
    print(f"sender encodings: {res[0]['encodings']}")
    cols = ("run() ms", "host cpu ms", "refit own ms", "calls/refit", "stand-ins ms", "prof all ms")
    print(f"{'side':<9}" + "".join(f"{c:>14}" for c in cols))
    for r in res:
        keys = ("run_ms", "host_ms", "own_ms", "calls", "stand_in_ms", "profiled_total_ms")
        print(f"{r['side']:<9}" + "".join(f"{r[k]:14.2f}" if k != "calls" else f"{r[k]:14d}" for k in keys))
    for r in res:
        print(f"{r['side']}: refit's top functions, tottime ms per refit")
        for f, ms in r["top"]:
            print(f"  {ms:7.3f}  {f}")
    if verbose:
        for r in res:
            print(f"{r['side']}: the top others (torch, gloo waits, numpy), tottime ms per refit")
            for f, ms in r["other"]:
                print(f"  {ms:7.3f}  {f}")
    if args["out"]:
        with open(args["out"], "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
