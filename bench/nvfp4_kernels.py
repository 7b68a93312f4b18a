"""NVFP4 quantize kernels on one GPU: today's ``_nvfp4_blocks`` against ``nvfp4_triton``'s pairs kernel shapes.

    PYTHONPATH=$PWD/src:$PWD python3 -m bench.nvfp4_kernels [--iters 50] [--out bench/results/nvfp4-kernels.json]

First every variant's bytes (elements and block scales) are compared with the torch path on the CPU
(``refit.quant.mx.quantize_nvfp4``) on bf16 inputs: random weights, elements on and one bf16 step either side
of every E2M1 threshold times their block's divisor (exact ties), zeros and negative zeros, float32-subnormal,
huge and infinite elements, weight scales from the floor to near float32's largest, odd K (4100, 4104), strided
and offset views, and (where ``tests/`` is importable) ``nvfp4_adversarial``. Then each variant is timed on
Llama-3.1-8B's weight shapes (the median of ``--iters`` launches in CUDA events after a warm-up), beside a
``copy_`` of the weight (bf16 read and write: a memory reference), and a table printed: microseconds per shape,
the sum over one layer's seven weights, and the mismatched bytes (a variant with any is not a candidate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from refit.quant import mx_triton
from refit.quant.mx import quantize_nvfp4
from refit.quant.nvfp4_triton import PAIRS, pairs_fit, quantize_nvfp4_pairs

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096), "gate/up 14336x4096": (14336, 4096),
          "down 4096x14336": (4096, 14336)}  # fmt: skip
LAYER = {"q/o 4096x4096": 2, "k/v 1024x4096": 2, "gate/up 14336x4096": 2, "down 4096x14336": 1}
# name -> pairs kernel shape where it differs from nvfp4_triton.PAIRS (br rows x nb blocks a program, halves,
# exact_div: div_rn an element, add_code: the code by one addition (else three comparisons), num_warps)
VARIANTS = {
    "pairs": {},
    "pairs-cmp": {"add_code": False},
    "pairs-div_rn": {"exact_div": True},
    "pairs-one": {"halves": False},
    "pairs-8x32-w4": {"br": 8, "nb": 32, "num_warps": 4},
    "pairs-16x32-w4": {"br": 16, "nb": 32, "num_warps": 4},
    "pairs-8x32-w8": {"br": 8, "nb": 32, "num_warps": 8},
    "pairs-2x64": {"br": 2, "nb": 64},
    "pairs-1x128": {"br": 1, "nb": 128},
}


def _blocks(x, q, s, s2, rps):
    saved, mx_triton.NVFP4_KERNEL = mx_triton.NVFP4_KERNEL, "blocks"
    try:
        mx_triton.quantize_rows_triton(x, q, s, "nvfp4", s2, rps)
    finally:
        mx_triton.NVFP4_KERNEL = saved


def _pairs(shape):
    def run(x, q, s, s2, rps):
        if not pairs_fit(x, q, s):  # the quantizer's fallback
            return _blocks(x, q, s, s2, rps)
        quantize_nvfp4_pairs(x, q, s, s2, rps, **shape)

    return run


def kernels() -> dict:
    return {"blocks": _blocks, **{n: _pairs(v) for n, v in VARIANTS.items()}}


def _tie_weight(rows: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [rows, k] whose blocks' divisors have few significant bits (power-of-two weight scales), so that
    threshold * divisor is a bf16 value: elements on each threshold and one bf16 step either side, signs random;
    row i's weight scale 2**(i % 40 - 20) (rows_per_scale 1)."""
    s2 = torch.pow(2.0, (torch.arange(rows) % 40 - 20).float())
    blocks = -(-k // 16)
    amax = s2[:, None] * 6 * torch.pow(2.0, torch.randint(-10, 11, (rows, blocks), generator=g).float())
    ts = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 6.0])
    x = torch.zeros(rows, blocks, 16)
    x[..., 0] = amax
    from refit.quant.mx import nvfp4_block_scales

    _, d = nvfp4_block_scales(x.unsqueeze(1), s2)
    v = (d.reshape(rows, blocks, 1) * ts[torch.randint(len(ts), (rows, blocks, 15), generator=g)]).bfloat16()
    bits = v.view(torch.int16) + torch.randint(-1, 2, v.shape, generator=g, dtype=torch.int16) * (v != 0)
    v = bits.view(torch.bfloat16).float() * (torch.randint(0, 2, v.shape, generator=g) * 2 - 1)
    x[..., 1:] = v
    return x.reshape(rows, blocks * 16)[:, :k].bfloat16(), s2


def _odd_values(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """bf16 [rows, k] random blocks with zeros, negative zeros, subnormal, huge and infinite elements."""
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 4)
    x[0::7, :16] = 0.0
    x[1::7, :16] = -0.0
    x[2::7, :16] = torch.randn(16, generator=g) * 1e-40
    x[3::7, 16:32] = torch.tensor([float("inf"), float("-inf"), 1.0, -0.0] * 4)
    x[4::7, 32:48] = torch.randn(16, generator=g) * 3e38
    x[5::7, 5] = -1e-39
    return x.bfloat16()


def cases(g: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    """(name, bf16 x [R, K] on the CPU (a view where named so), weight scales [ceil(R / rps)], rps)."""
    out = []
    w = torch.randn(4096, 4096, generator=g).bfloat16() * 0.02
    out.append(("random 4096x4096", w, (w.float().abs().amax() / 2688).reshape(1), 4096))
    for k in (4096, 4100, 4104, 96, 50):
        x, s2 = _tie_weight(512, k, g)
        out.append((f"ties K={k}", x, s2, 1))
    for k in (4100, 4104, 64):
        x = _odd_values(300, k, g)
        out.append((f"odd values K={k}", x, torch.full((1,), 2.0), 300))
    x = _odd_values(256, 4096, g).float()
    x = x / x.abs().nan_to_num(posinf=0).amax(dim=1, keepdim=True).clamp(min=1e-30)
    huge = torch.finfo(torch.float32).max / 448 * torch.pow(2.0, -(torch.arange(256).float() % 12) - 1)
    sized = x * huge[:, None] * 6 * torch.pow(2.0, torch.randint(-12, 11, (256, 1), generator=g).float())
    out.append(("huge scales", sized.bfloat16(), huge, 1))
    floor = torch.full((256,), 1e-12 / 2688)
    sized = x * floor[:, None] * 6 * torch.pow(2.0, torch.randint(-12, 11, (256, 1), generator=g).float())
    out.append(("floor scales", sized.bfloat16(), floor, 1))
    base = _odd_values(256, 8200, g)
    out.append(("view [:, :4096] (row stride 8200)", base[:, :4096], torch.full((1,), 0.02), 256))
    out.append(("view [:, 2:4098] (offset 4 bytes)", base[:, 2:4098], torch.full((1,), 0.03), 256))
    out.append(("view [:, 1:4097] (misaligned: falls back)", base[:, 1:4097], torch.full((1,), 0.03), 256))
    out.append(("view [::2] (rows)", base[::2, :4104], torch.full((2,), 0.01), 64))
    try:  # the tests' adversarial values (near-miss divisors, every threshold), where tests/ is importable
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from test_quant_mx import nvfp4_adversarial

        x, s2 = nvfp4_adversarial(4096, 32, 11)
        out.append(("tests' nvfp4_adversarial", x.bfloat16(), s2, 1))
    except Exception as e:  # noqa: BLE001 - pytest or the tests' imports missing here
        print(f"(nvfp4_adversarial skipped: {type(e).__name__}: {e})")
    return out


def expected(x: torch.Tensor, s2: torch.Tensor, rps: int) -> tuple[torch.Tensor, torch.Tensor]:
    r, k = x.shape
    groups = -(-r // rps)
    pad = groups * rps - r
    xx = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).to(x.dtype) if pad else x
    p, b = quantize_nvfp4(xx.reshape(groups, rps, k), s2)
    return p.reshape(-1, p.shape[-1])[:r], b.reshape(-1, b.shape[-1])[:r]


def check(fn, case) -> int:
    """Mismatched bytes (elements and scales) of ``fn`` against the torch path on one case."""
    _, x, s2, rps = case
    p, b = expected(x, s2, rps)
    base = x if x._base is None else x._base  # the same view of a copy of its tensor on the GPU
    gx = torch.as_strided(base.cuda(), x.shape, x.stride(), x.storage_offset())
    gp = torch.full(p.shape, 0xAA, dtype=torch.uint8, device="cuda")
    gb = torch.full(b.shape, 0x55, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    fn(gx, gp, gb, s2.cuda(), rps)
    torch.cuda.synchronize()
    return int((gp.cpu() != p).sum()) + int((gb.cpu().view(torch.uint8) != b.view(torch.uint8)).sum())


def time_us(fn, args, iters: int) -> float:
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.iters < 1:
        raise SystemExit(f"--iters must be at least 1, got {args.iters}")
    g = torch.Generator().manual_seed(52)
    ks, cs = kernels(), cases(g)
    bad = {n: {c[0]: check(fn, c) for c in cs} for n, fn in ks.items()}
    result = {"device": torch.cuda.get_device_name(), "triton": __import__("triton").__version__, "pairs": PAIRS,
              "variants": VARIANTS, "mismatched_bytes": bad, "us": {}}  # fmt: skip
    for case in cs:
        print(f"{case[0]:<45}", " ".join(f"{n}={bad[n][case[0]]}" for n in ks))
    ref = {}
    for label, (r, k) in SHAPES.items():
        x = (torch.randn(r, k, device="cuda") * 0.02).bfloat16()
        s2 = (x.float().abs().amax() / 2688).reshape(1)
        q = torch.empty(r, k // 2, dtype=torch.uint8, device="cuda")
        s = torch.empty(r, k // 16, dtype=torch.float8_e4m3fn, device="cuda")
        y = torch.empty_like(x)
        ref[label] = time_us(y.copy_, (x,), args.iters)
        for n, fn in ks.items():
            result["us"].setdefault(n, {})[label] = time_us(fn, (x, q, s, s2, r), args.iters)
    result["us"]["copy_ (bf16)"] = ref
    cols = list(SHAPES)
    print(f"\n{'kernel':<16}" + "".join(f"{c:>20}" for c in cols) + f"{'layer':>10}{'bad bytes':>11}")
    for n, per in result["us"].items():
        layer = sum(per[c] * LAYER[c] for c in cols)
        nbad = sum(bad[n].values()) if n in bad else 0
        print(f"{n:<16}" + "".join(f"{per[c]:>18.1f}us" for c in cols) + f"{layer:>8.0f}us{nbad:>11}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
