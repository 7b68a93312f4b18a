"""S2's parts on one GPU, in one process, timed with CUDA events (median of ``--iters``): where a colocated
refit's time goes beside the floor (one copy of all bytes), and what its checksum and FP8 variants cost.

Rows (Llama-3.1-8B shapes unless ``--model``, random bf16 weights, fresh each run of the script):
  floor                 the plan's bytes as copies of at most 8 GiB (``refit bench``'s floor)
  pull sN [nograph]     ``IpcPuller`` over every tensor (same GPU), N streams, replayed graph or issued
  foreach_copy          ``torch._foreach_copy_`` of every tensor (one multi-tensor kernel family)
  ipc pull sN           the same pull from another process's tensors (mapped through CUDA IPC, as S2)
  ipc kernel sN         those copies as int64 kernels (``torch.add(src, 0, out=dst)``) instead of memcpy
  sums B,S,W            checksum mode's same-GPU work: the fused copy+sum, then the sources' re-read
                        (``PieceSums`` with ``REFIT_SUM_KERNEL=B,S,W``)
  fp8 floor             one copy of the FP8 engine's bytes (weights, scales, unquantized tensors)
  fp8 quantize wN       the Triton quantization of every linear weight (``REFIT_FP8_KERNEL=N`` warps)
  fp8 fused wN [graph]  that quantization writing the engine's tensors, beside the copy of the rest
Every variant's output is compared with the first one's (bit for bit); ``--json`` keeps every number.

    python -m bench.s2_parts [--model llama-3.1-8b] [--iters 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.checksum_kernels import _time
from refit.layout.models import param_shapes
from refit.layout.rules import layout_from_spec
from refit.layout.spec import parse_spec
from refit.quant import fp8_layout, quantized_names, scale_name
from refit.quant.fp8 import FP8
from refit.transport.checksum import Piece, PieceSums
from refit.transport.ipc import IpcPuller


def timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` on the current stream (CUDA events), after two warm-up calls."""
    fn()
    return _time(fn, iters) * 1e3


def floor_copy(nbytes: int, dev: torch.device):
    chunk = min(nbytes, 8 << 30)
    a = torch.empty(chunk, dtype=torch.uint8, device=dev)
    b = torch.empty(chunk, dtype=torch.uint8, device=dev)

    def run() -> None:
        for off in range(0, nbytes, chunk):
            m = min(chunk, nbytes - off)
            b[:m].copy_(a[:m], non_blocking=True)

    return run, (a, b)


def _owner(shapes, queue, done) -> None:
    """Another process: the source tensors, shared through CUDA IPC (torch.multiprocessing), until ``done``."""
    torch.manual_seed(1)
    src = {n: (torch.randn(s, device="cuda:0") * 0.02).to(d) for n, s, d in shapes}
    queue.put(src)
    done.wait()


def ipc_rows(shapes, dst, row, iters: int, total: int) -> None:
    """Pulls from another process's tensors: memcpy (``IpcPuller``) and int64 copy kernels, in graphs."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(shapes, queue, done))
    owner.start()
    src = queue.get()
    pairs = [(dst[n], src[n]) for n in src]
    for streams in (2, 4):
        p = IpcPuller(dst[next(iter(dst))].device, pairs, [], streams_per_lane=streams)
        p.capture()
        row(f"ipc pull s{streams}", timed(p.pull, iters), total)
        p.close()
    print(f"ipc pull bit-exact: {all(torch.equal(d.view(torch.uint8), s.view(torch.uint8)) for d, s in pairs)}")
    wide = [
        (d.view(-1).view(torch.int64), s.view(-1).view(torch.int64))
        for d, s in pairs
        if d.numel() * d.element_size() % 8 == 0
    ]
    for streams in (1, 2):
        lanes = [torch.cuda.Stream() for _ in range(streams)]

        def kernels(lanes=lanes) -> None:
            cur = torch.cuda.current_stream()
            for st in lanes:
                st.wait_stream(cur)
            for i, (d, s) in enumerate(wide):
                with torch.cuda.stream(lanes[i % len(lanes)]):
                    torch.add(s, 0, out=d)
            for st in lanes:
                cur.wait_stream(st)

        kernels()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            kernels()
        row(f"ipc kernel s{streams}", timed(g.replay, iters), total)
    print(f"ipc kernel bit-exact: {all(torch.equal(d, s) for d, s in wide)}")
    wide.clear()
    del src, pairs
    done.set()
    owner.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sum-tunings", default="2048,16,8;1024,16,4;1024,32,4;2048,32,8")
    ap.add_argument("--fp8-warps", default="4,8,16")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    shapes = param_shapes(args.model)
    src = {n: (torch.randn(s, device=dev) * 0.02).to(d) for n, s, d in shapes}
    dst = {n: torch.empty_like(t) for n, t in src.items()}
    total = sum(t.numel() * t.element_size() for t in src.values())
    rows: dict[str, float] = {}

    def row(name: str, ms: float, nbytes: int, base: str | None = "floor") -> None:
        rows[name] = ms
        ratio = f"{ms / rows[base]:.3f}x {base}" if base in rows else ""
        print(f"{name:<28} {ms:8.3f} ms  {nbytes / ms / 1e6:7.0f} GB/s  {ratio}", flush=True)

    run, keep = floor_copy(total, dev)
    row("floor", timed(run, args.iters), total)
    del keep
    pairs = [(dst[n], src[n]) for n in src]
    for streams in (1, 2, 4):
        for graph in (True, False):
            p = IpcPuller(dev, pairs, [], streams_per_lane=streams)
            if graph:
                p.capture()
            row(f"pull s{streams}{'' if graph else ' nograph'}", timed(p.pull, args.iters), total)
            p.close()
    ok = all(torch.equal(dst[n].view(torch.uint8), src[n].view(torch.uint8)) for n in src)
    print(f"pull bit-exact: {ok}")
    dl, sl = list(dst.values()), list(src.values())
    row("foreach_copy", timed(lambda: torch._foreach_copy_(dl, sl), args.iters), total)
    ipc_rows(shapes, dst, row, args.iters, total)

    out = torch.zeros(2 * len(src), dtype=torch.int64, device=dev)
    for tuning in args.sum_tunings.split(";"):
        os.environ["REFIT_SUM_KERNEL"] = tuning
        fused = PieceSums([Piece(s, i, dst=d) for i, (d, s) in enumerate(pairs)], out)
        reread = PieceSums([Piece(s, len(pairs) + i) for i, (_, s) in enumerate(pairs)], out)
        row(f"sums {tuning} fused", timed(fused.run, args.iters), 2 * total)
        row(f"sums {tuning} reread", timed(reread.run, args.iters), total)
        row(f"sums {tuning}", timed(lambda f=fused, r=reread: (f.run(), r.run()), args.iters), total)
        ok = torch.equal(out[: len(pairs)], out[len(pairs) :])
        print(f"  sums agree: {ok}")
    os.environ.pop("REFIT_SUM_KERNEL", None)

    # FP8: the engine's bytes and the trainer's quantization
    layout = layout_from_spec(shapes, parse_spec("tp=1", "src"))
    q8 = fp8_layout(layout)
    qn = set(quantized_names(q8))
    q = {n: torch.empty(src[n].shape, dtype=FP8, device=dev) for n in qn}
    sc = {n: torch.empty(tuple(q8[scale_name(n)].shape), dtype=torch.float32, device=dev) for n in qn}
    plain = [n for n in src if n not in qn]
    fp8_bytes = sum(t.numel() for t in q.values()) + sum(t.numel() * 4 for t in sc.values())
    fp8_bytes += sum(src[n].numel() * src[n].element_size() for n in plain)
    run, keep = floor_copy(fp8_bytes, dev)
    row("fp8 floor", timed(run, args.iters), fp8_bytes)
    del keep
    from refit.quant import fp8_triton

    ref = None
    side = torch.cuda.Stream(dev)
    for w in (int(x) for x in args.fp8_warps.split(",")):
        os.environ["REFIT_FP8_KERNEL"] = str(w)

        def quant() -> None:
            for n in qn:
                fp8_triton.quantize_into_triton(src[n], q[n], sc[n], (128, 128), 448.0, 1e-4)

        def fused() -> None:
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                for n in plain:
                    dst[n].copy_(src[n], non_blocking=True)
            quant()
            cur.wait_stream(side)

        qbytes = sum(src[n].numel() * 3 for n in qn)
        row(f"fp8 quantize w{w}", timed(quant, args.iters), qbytes, "fp8 floor")
        row(f"fp8 fused w{w}", timed(fused, args.iters), fp8_bytes, "fp8 floor")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fused()
        row(f"fp8 fused w{w} graph", timed(g.replay, args.iters), fp8_bytes, "fp8 floor")
        got = torch.cat([q[n].view(torch.uint8).reshape(-1) for n in sorted(qn)])
        ref = got.clone() if ref is None else ref
        print(f"  fp8 bytes as the first variant's: {torch.equal(got, ref)}")
    os.environ.pop("REFIT_FP8_KERNEL", None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "bytes": total, "fp8_bytes": fp8_bytes, "ms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
