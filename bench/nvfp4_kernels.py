"""NVFP4 quantize kernels on one GPU: ``mx_triton._nvfp4_blocks`` against ``nvfp4_triton``'s pairs kernel shapes.

    PYTHONPATH=$PWD/src:$PWD python3 -m bench.nvfp4_kernels [--iters 20] [--launches 20] [--out FILE.json]

First every variant's bytes (elements and block scales) are compared with the torch path on the CPU
(``refit.quant.mx.quantize_nvfp4``) on bf16 inputs: random weights, elements on and one bf16 step either side
of every E2M1 threshold times their block's divisor (exact ties), zeros and negative zeros, float32-subnormal,
huge and infinite elements, weight scales from the floor to near float32's largest, odd K (4100, 4104), strided
and offset views, and (where ``tests/`` is importable) ``nvfp4_adversarial``; a pairs shape is checked as it is
and with one row a program (``checked``). Then each variant's device time is taken on Llama-3.1-8B's weight
shapes: ``--launches`` launches recorded into one CUDA graph, cycling through enough copies of the weight that
none is read from L2, the median over ``--iters`` replays timed in CUDA events, per launch; beside it a ``copy_``
of the weight (bf16 read and write: a memory reference) timed the same way, and the host time of one call (the
Python wrapper and launch, which a refit's CUDA graph does not pay). The table: microseconds per shape, the sum
over one layer's seven weights, the host time and the mismatched bytes (a variant with any is not a candidate).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.cuda_timing import median_device_s
from refit.quant import mx_triton
from refit.quant.mx import quantize_nvfp4
from refit.quant.nvfp4_triton import PAIRS, pairs_fit, quantize_nvfp4_pairs

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 1024x4096": (1024, 4096), "gate/up 14336x4096": (14336, 4096),
          "down 4096x14336": (4096, 14336)}  # fmt: skip
LAYER = {"q/o 4096x4096": 2, "k/v 1024x4096": 2, "gate/up 14336x4096": 2, "down 4096x14336": 1}
# name -> pairs kernel shape where it differs from nvfp4_triton.PAIRS (br rows x nb blocks a program, halves,
# exact_div: div_rn an element, add_code: the code by three comparisons (0), one addition (1), one addition with no
# upper exponent clamp (2), num_warps, bounds: the code from per-block bounds on the bf16 magnitudes, no quotient)
VARIANTS = {
    "pairs": {},
    "pairs-4x32": {"br": 4},
    "pairs-16x32": {"br": 16},
    "pairs-8x32-w2": {"num_warps": 2},
    "pairs-8x32-w8": {"num_warps": 8},
    "pairs-8x64": {"nb": 64},
    "pairs-one": {"halves": False},
    "quotient": {"bounds": False},
    "quotient-cmp": {"bounds": False, "add_code": 0},
    "quotient-clamp": {"bounds": False, "add_code": 1},
    "quotient-div_rn": {"bounds": False, "exact_div": True},
    "quotient-one": {"bounds": False, "halves": False},
    "quotient-16x32": {"bounds": False, "br": 16},
    "quotient-1x128": {"bounds": False, "br": 1, "nb": 128},
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


def checked(name: str) -> list:
    """The launchers whose bytes count for kernel ``name``: its own and, for a pairs shape of more than one row a
    program, the same with one row a program, where every tile shares one weight scale, so that the cases with a
    weight scale a row (ties, the tests' adversarial values) take the tile-wide quotient or bounds path too."""
    if name == "blocks":
        return [_blocks]
    shape = VARIANTS[name]
    one = [_pairs({**shape, "br": 1})] if {**PAIRS, **shape}["br"] > 1 else []
    return [_pairs(shape), *one]


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


def check(fn, case, want=None) -> int:
    """Mismatched bytes (elements and scales) of ``fn`` against the torch path (``want``: its bytes, if known)
    on one case."""
    _, x, s2, rps = case
    p, b = want if want is not None else expected(x, s2, rps)
    base = x if x._base is None else x._base  # the same view of a copy of its tensor on the GPU
    gx = torch.as_strided(base.cuda(), x.shape, x.stride(), x.storage_offset())
    gp = torch.full(p.shape, 0xAA, dtype=torch.uint8, device="cuda")
    gb = torch.full(b.shape, 0x55, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    fn(gx, gp, gb, s2.cuda(), rps)
    torch.cuda.synchronize()
    return int((gp.cpu() != p).sum()) + int((gb.cpu().view(torch.uint8) != b.view(torch.uint8)).sum())


def _ring(shape: tuple[int, int], nbytes: int) -> int:
    """Copies of a shape's buffers a timing cycles through: enough that their inputs (``nbytes`` each) are 256 MB
    or more, so that a launch reads its weight from memory, not from the last launch's L2 (50 MB on an H200)."""
    return max(2, -(-(256 << 20) // nbytes))


def device_us(fn, argsets: list[tuple], launches: int, replays: int) -> float:
    """Device microseconds a launch of ``fn``: ``launches`` launches (cycling through ``argsets``) recorded into
    one CUDA graph, the median over ``replays`` replays of one replay's time between two events, divided by
    ``launches``. Every argset is launched once first (Triton compiles there, not in the capture). Where the
    capture fails, the launches are enqueued back to back between the events instead (the host runs ahead of the
    GPU for all but the first)."""
    for a in argsets:
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(launches):
                fn(*argsets[i % len(argsets)])
        run = graph.replay
    except RuntimeError as e:
        print(f"(graph capture failed, launches enqueued instead: {e})")
        torch.cuda.synchronize()

        def run():
            for i in range(launches):
                fn(*argsets[i % len(argsets)])

    return median_device_s(run, replays) * 1e6 / launches


def host_us(fn, args: tuple, calls: int) -> float:
    """Host microseconds of one call of ``fn`` (the Python wrapper and the launch; in a refit the launch is
    replayed from a CUDA graph and this cost is not paid): the median over ``calls`` calls, each timed alone."""
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _copy(y, x):
    y.copy_(x)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20, help="graph replays timed (the median is taken)")
    ap.add_argument("--launches", type=int, default=20, help="launches a graph holds (at least the ring's copies)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    for name in ("iters", "launches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    g = torch.Generator().manual_seed(52)
    ks, cs = kernels(), cases(g)
    wants = [expected(*c[1:]) for c in cs]
    bad = {n: {c[0]: sum(check(f, c, w) for f in checked(n)) for c, w in zip(cs, wants)} for n in ks}
    result = {"device": torch.cuda.get_device_name(), "triton": __import__("triton").__version__, "pairs": PAIRS,
              "variants": VARIANTS, "mismatched_bytes": bad, "us": {}, "host_us": {}}  # fmt: skip
    for case in cs:
        print(f"{case[0]:<45}", " ".join(f"{n}={bad[n][case[0]]}" for n in ks))
    ref = {}
    for label, (r, k) in SHAPES.items():
        x0 = (torch.randn(r, k, device="cuda") * 0.02).bfloat16()
        s2 = (x0.float().abs().amax() / 2688).reshape(1)
        xs = [x0] + [x0.clone() for _ in range(_ring((r, k), x0.nbytes) - 1)]
        sets = [(x, torch.empty(r, k // 2, dtype=torch.uint8, device="cuda"),
                 torch.empty(r, k // 16, dtype=torch.float8_e4m3fn, device="cuda"), s2, r) for x in xs]  # fmt: skip
        launches = max(args.launches, len(sets))
        ref[label] = device_us(_copy, [(torch.empty_like(x), x) for x in xs], launches, args.iters)
        for n, fn in ks.items():
            result["us"].setdefault(n, {})[label] = device_us(fn, sets, launches, args.iters)
            result["host_us"].setdefault(n, {})[label] = host_us(fn, sets[0], 200)
        del xs, sets
        torch.cuda.empty_cache()
    result["us"]["copy_ (bf16)"] = ref
    cols = list(SHAPES)
    print(f"\ndevice time a launch (a CUDA graph of {args.launches}+ launches over weights not in L2), and the host")
    print("time of one call (wrapper and launch; not paid where a refit replays its graph):")
    print(f"{'kernel':<18}" + "".join(f"{c:>20}" for c in cols) + f"{'layer':>10}{'host':>9}{'bad bytes':>11}")
    for n, per in result["us"].items():
        layer = sum(per[c] * LAYER[c] for c in cols)
        nbad = sum(bad[n].values()) if n in bad else 0
        host = result["host_us"].get(n, {}).get(cols[0])
        hs = f"{host:>7.1f}us" if host is not None else f"{'':>9}"
        print(f"{n:<18}" + "".join(f"{per[c]:>18.1f}us" for c in cols) + f"{layer:>8.0f}us{hs}{nbad:>11}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
