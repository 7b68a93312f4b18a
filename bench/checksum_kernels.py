"""Throughput of the checksum kernel (``refit.transport.checksum_triton``) on one GPU, against a plain copy.

    python -m bench.checksum_kernels [--gib 4] [--out bench/results/checksum-kernels.json]

For Llama-3.1-8B-like pieces (bf16, a few hundred tensors making up ``--gib``): torch ``copy_`` of all
pieces (what the IPC pull does), the sum-only kernel over the sources (one launch), the fused
copy-and-sum kernel (one launch), and the torch reference (for scale), each the median of 10 after a
warm-up, in CUDA events, for a few block / steps / warps shapes of the kernel (``best``: the least
time for one fused pass plus one sum, what S2 with checksums does; ``REFIT_SUM_KERNEL`` runs refit
with a shape). Every kernel result is checked against the torch reference first.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.cuda_timing import median_device_s
from refit.transport.checksum import KEY, LEN_KEY, MUL1, MUL2, Piece, PieceSums, reference_sum
from refit.transport.checksum_triton import SumLaunch, kernel_row

VARIANTS = (  # block, steps, warps, loop (1: the steps are a loop, 0: unrolled)
    (1024, 8, 4, 1),
    (1024, 4, 4, 1),
    (1024, 16, 4, 1),
    (512, 8, 4, 1),
    (512, 16, 4, 1),
    (2048, 8, 8, 1),
    (1024, 8, 8, 1),
    (2048, 4, 4, 1),
    (1024, 2, 4, 0),
    (1024, 4, 4, 0),
)


def _pieces(gib: float, dev: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
    per_layer = sum(a * b for a, b in shapes) * 2
    layers = max(1, int(gib * (1 << 30) // per_layer))
    src = [torch.randn(s, device=dev).to(torch.bfloat16) for _ in range(layers) for s in shapes]
    src += [torch.randn(4096, device=dev).to(torch.bfloat16) for _ in range(2 * layers)]  # norms
    return src, [torch.empty_like(t) for t in src]


def _launch(pairs, copy: bool, shape: tuple[int, int, int, int], out: torch.Tensor):
    rows = [kernel_row(s, d if copy else None, 0, i) for i, (d, s) in enumerate(pairs)]
    block, steps, warps, loop = shape
    constants = (KEY, MUL1, MUL2, LEN_KEY)
    launch = SumLaunch(rows, out.device, constants, block=block, steps=steps, num_warps=warps, loop=bool(loop))

    def run() -> None:
        out.zero_()
        launch.launch(out)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--out", default="bench/results/checksum-kernels.json")
    args = ap.parse_args()
    src, dst = _pieces(args.gib, "cuda")
    nbytes = sum(t.numel() * t.element_size() for t in src)
    pairs = list(zip(dst, src))
    out = torch.zeros(len(src), dtype=torch.int64, device="cuda")
    want = [int(reference_sum(t)) for t in src]
    PieceSums([Piece(s, i, dst=d) for i, (d, s) in enumerate(pairs)], out).run()
    assert out.tolist() == want and all(torch.equal(d, s) for d, s in pairs), "fused kernel differs"
    PieceSums([Piece(s, i) for i, s in enumerate(src)], out).run()
    assert out.tolist() == want, "sum kernel differs"
    rows = {"device": torch.cuda.get_device_name(), "bytes": nbytes, "pieces": len(src)}
    rows["copy_s"] = median_device_s(lambda: [d.copy_(s) for d, s in pairs], 10)
    rows["reference_sum_s"] = median_device_s(lambda: [reference_sum(s) for s in src], 3)
    variants = []
    for shape in VARIANTS:
        v = dict(zip(("block", "steps", "warps", "loop"), shape))
        v["sum_s"] = median_device_s(_launch(pairs, False, shape, out), 10)
        v["fused_s"] = median_device_s(_launch(pairs, True, shape, out), 10)
        variants.append(v)
        print(
            f"shape {shape}: sum {nbytes / v['sum_s'] / 1e9:.0f} GB/s read, "
            f"fused {v['fused_s'] * 1e3:.2f} ms vs copy {rows['copy_s'] * 1e3:.2f} ms",
            flush=True,
        )
    rows["variants"] = variants
    best = min(variants, key=lambda v: v["sum_s"] + v["fused_s"])  # S2 with checksums: one fused pass, one sum
    rows["best"] = f"{best['block']},{best['steps']},{best['warps']},{best['loop']}"
    print(json.dumps(rows, indent=1))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
