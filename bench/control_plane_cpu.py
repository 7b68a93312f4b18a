"""A refit's fixed cost on CPU: tiny-llama, one trainer and one engine process over gloo, weights unchanged
between refits. Per setting, the median wall time of ``Peer.run`` (the slower process, after a barrier) and
the median CPU time both processes spent in it (every thread; less sensitive to other jobs' load than wall):

  dense in_place          every byte moved (tiny-llama's few MB), no vote
  delta in_place          delta="auto" with 0 bytes changed: headers and the held-version exchange only
  delta staged            the same, plus the staged commit's vote through the store and the shadow copy
  vote, one 2 ms late     the staged commit's vote alone (``AbortChannel.vote``), process 1 voting 2 ms
                          after process 0: the time from the barrier until both returned (2 ms of it the delay)

    python -m bench.control_plane_cpu [--iters 50] [--json OUT]

Timings on a loaded machine are inflated: compare settings of one run, never assert on them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.plan import ProcessMap
from refit.tools.launch import run_local
from refit.tools.verify import reference_tensor
from refit.transfer import Peer
from refit.transport.control import AbortChannel

SETTINGS = {
    "dense in_place": {},
    "delta in_place": {"delta": "auto"},
    "delta staged": {"delta": "auto", "commit": "staged"},
}


def _worker(world, iters: int) -> dict[str, list[float]]:
    shapes = param_shapes("tiny-llama")
    src_l = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    dst_l = layout_from_spec(shapes, parse_spec("tp=1", "dst"))
    src = dst = None
    if world.rank == 0:
        src = {t.name: reference_tensor(t.name, t.shape, t.dtype, 0) for t in src_l}
    else:
        dst = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in dst_l}
    out = {}
    for i, (label, fields) in enumerate(SETTINGS.items()):
        cfg = TransferConfig(name=f"cp{i}", **fields)
        peer = Peer(
            src_l, dst_l, world.rank, src_tensors=src, dst_tensors=dst, procs=ProcessMap.disjoint(1, 1), config=cfg
        )
        times, cpu = [], []
        for v in range(1, iters + 1):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            peer.run(v)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        dist.barrier()
        peer.close()
        out[label] = (times[2:], cpu[2:])  # the first refits send dense and warm up
    out[VOTE] = _votes(world, iters)
    return out


VOTE = "vote, one 2 ms late"


def _votes(world, iters: int) -> tuple[list[float], list[float]]:
    """``iters`` staged-commit votes of both processes, process 1 voting ``VOTE``'s delay late."""
    channel = AbortChannel(world.store, "cp-vote", world.rank, 2)
    times, cpu = [], []
    for v in range(1, iters + 1):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if world.rank == 1:
            time.sleep(0.002)
        channel.vote(v, 0, time.monotonic() + 60, [0, 1])
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return times[2:], cpu[2:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = run_local(_worker, 1, 1, args.iters, backend="gloo", devices=["cpu", "cpu"], timeout_s=600)
    rows, cpu = {}, {}
    for label in [*SETTINGS, VOTE]:
        (wall0, cpu0), (wall1, cpu1) = res[0][label], res[1][label]
        per_refit = [max(a, b) for a, b in zip(wall0, wall1)]
        rows[label] = statistics.median(per_refit) * 1e3
        cpu[label] = statistics.median(a + b for a, b in zip(cpu0, cpu1)) * 1e3
        print(
            f"{label:<20} median {rows[label]:7.3f} ms per refit, {cpu[label]:7.3f} ms CPU (n={len(per_refit)})",
            flush=True,
        )
    if args.json:
        record = {"model": "tiny-llama", "ms_per_refit": rows, "cpu_ms_per_refit": cpu, "iters": args.iters}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
