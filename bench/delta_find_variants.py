"""Delta find kernel variants on one GPU: what limits the one-pass find (issue 22).

Two versions of ``--gib`` GiB of bf16 (one flat tensor each), the current one differing from the base by one
ulp in a random fraction of the elements (spread, as an optimizer step on bf16 weights). Per fraction, each
variant runs ``--reps`` times (median, CUDA events); the base is restored before each rep of a variant that
updates it. Variants:

* ``lib`` : the library's kernel (``refit.quant.delta_triton``) as launched, on bf16 elements (int16 bits);
* ``lib b=B w=W``: the same kernel, other block sizes and warp counts;
* ``word32`` / ``word64``: the same kernel on the bits viewed as int32 / int64 words (2 / 4 bf16 per word):
  a changed word is sent whole (its index and its bits), so fewer, larger changes;
* ``+update``: with the fused base update (what a sender runs);
* ``words table``: the library's word find by table (``delta_words.launch_words_table``) over the tensor as one
  piece, ``words table llama`` over Llama-3.1-8B's 291 tensor sizes (scaled to ``--gib``);
* ``count``: read both versions, count the changes per block, one atomic per block: no scan, no stores (the
  read's ceiling for this access pattern);
* ``copy``: ``torch`` copy of one version into the other's place (read + write the same bytes: HBM's pace).

    python3 -m bench.delta_find_variants --gib 8 --fractions 0.001,0.01,0.1 --out variants.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
import triton.language as tl

from refit.quant import delta_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _count(base_ptr, cur_ptr, count_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    b = tl.load(base_ptr + offs, mask=inb, other=0)
    c = tl.load(cur_ptr + offs, mask=inb, other=0)
    tl.atomic_add(count_ptr, tl.sum(((b != c) & inb).to(tl.int32), axis=0))


def _versions(gib: float, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = int(gib * (1 << 30)) // 2 // 4096 * 4096
    g = torch.Generator(device=DEV).manual_seed(seed)
    base = torch.randint(-(1 << 14), 1 << 14, (n,), dtype=torch.int16, device=DEV, generator=g)
    cur = base.clone()
    step = 1 << 28
    for s in range(0, n, step):
        e = min(n, s + step)
        cur[s:e] += (torch.rand(e - s, device=DEV, generator=g) < fraction).to(torch.int16)
    return base, cur


def _time(fn, reps: int, before=None) -> list[float]:
    out = []
    for _ in range(reps + 1):  # the first is a warm-up (Triton compiles)
        if before is not None:
            before()
        if DEV == "cpu":  # a smoke run in Triton's interpreter (TRITON_INTERPRET=1)
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out[1:]


def _lib(word: torch.dtype, block: int, warps: int, update: bool):
    def run(base, cur, slots):
        bb, cb = base.view(word), cur.view(word)
        idx, vals, count = slots[word]
        count.zero_()
        n = cb.numel()
        delta_triton._diff_compact[(triton.cdiv(n, block),)](
            bb, cb, idx, vals, count, n, 0, len(idx), UPDATE=update, BLOCK=block, num_warps=warps
        )
        return count

    return run


# Llama-3.1-8B's tensor sizes in bf16 elements, in model order (embedding, 32 x (q, k, v, o, gate, up, down,
# 2 norms), norm, lm head): the pieces the library's find sees in S1
_LLAMA = (
    [128256 * 4096]
    + [4096 * 4096, 1024 * 4096, 1024 * 4096, 4096 * 4096, 14336 * 4096, 14336 * 4096, 4096 * 14336, 4096, 4096] * 32
    + [4096, 128256 * 4096]
)


def _pieces(n16: int, llama: bool) -> list[tuple[int, int]]:
    """(start, elements) of the pieces of a flat bf16 tensor of ``n16`` elements: one, or Llama's sizes scaled
    to fit (each a multiple of 4 elements: whole words)."""
    if not llama:
        return [(0, n16 // 4 * 4)]
    scale = n16 / sum(_LLAMA)
    sizes = [max(4, int(x * scale) // 4 * 4) for x in _LLAMA]
    out, at = [], 0
    for x in sizes:
        if at + x > n16:
            break
        out.append((at, x))
        at += x
    return out


def _table_run(llama: bool):
    """The library's word find by table (``delta_words.launch_words_table``)."""
    import numpy as np

    from refit.quant import delta_words as dw

    cache = {}

    def run(base, cur, slots):
        key = (base.data_ptr(), cur.data_ptr())
        if key not in cache:
            pcs = _pieces(cur.numel(), llama)
            bptr = np.array([base.data_ptr() + 2 * a for a, _ in pcs], dtype=np.int64)
            cptr = np.array([cur.data_ptr() + 2 * a for a, _ in pcs], dtype=np.int64)
            cache[key] = (bptr, cptr, np.array([x // 4 for _, x in pcs], dtype=np.int64))
        return torch.from_numpy(dw.launch_words_table(*cache[key], cur.device).result().count)

    return run


def _count_run(base, cur, slots):
    count = slots["count"]
    count.zero_()
    n = cur.numel()
    _count[(triton.cdiv(n, 4096),)](base, cur, count, n, BLOCK=4096, num_warps=8)
    return count


VARIANTS = {
    "lib": _lib(torch.int16, delta_triton.BLOCK, delta_triton.NUM_WARPS, False),
    "lib+update": _lib(torch.int16, delta_triton.BLOCK, delta_triton.NUM_WARPS, True),
    "lib b=2048 w=4": _lib(torch.int16, 2048, 4, False),
    "lib b=8192 w=8": _lib(torch.int16, 8192, 8, False),
    "lib b=8192 w=16": _lib(torch.int16, 8192, 16, False),
    "lib b=16384 w=16": _lib(torch.int16, 16384, 16, False),
    "word32": _lib(torch.int32, 4096, 8, False),
    "word32 b=8192": _lib(torch.int32, 8192, 8, False),
    "word64": _lib(torch.int64, 4096, 8, False),
    "word64 b=2048": _lib(torch.int64, 2048, 8, False),
    "word64+update": _lib(torch.int64, 4096, 8, True),
    "count": _count_run,
    "words table": _table_run(False),
    "words table llama": _table_run(True),
}


def _slots(n16: int, cap_fraction: float) -> dict:
    out = {"count": torch.zeros(1, dtype=torch.int32, device=DEV)}
    for word, per in ((torch.int16, 1), (torch.int32, 2), (torch.int64, 4)):
        cap = max(1, int(n16 // per * cap_fraction))
        out[word] = (
            torch.empty(cap, dtype=torch.int64, device=DEV),
            torch.empty(cap, dtype=word, device=DEV),
            torch.zeros(1, dtype=torch.int32, device=DEV),
        )
    return out


def _variant(name, fn, base, cur, keep, slots, f, reps, nbytes) -> dict:
    restore = (lambda: base.copy_(keep)) if "update" in name else None
    ms = _time(lambda: fn(base, cur, slots), reps, restore)
    if restore:
        restore()
    count = int(fn(base, cur, slots).sum().item()) if "update" not in name else None
    word = 8 if "word64" in name or "words" in name else 4 if "word32" in name else 2
    want = None
    if name in ("lib", "word32", "word64", "words table"):  # checked against torch
        v = {8: torch.int64, 4: torch.int32, 2: torch.int16}[word]
        want = int((base.view(v) != cur.view(v)).sum().item())
    med = statistics.median(ms)
    row = {
        "fraction": f,
        "variant": name,
        "ms": med,
        "min_ms": min(ms),
        "tbps": 2 * nbytes / med / 1e9,
        "changes": count,
        "exact_count": None if want is None else count == want,
        "wire_over_dense": None if count is None else count * (8 + word) / nbytes,
        "wire_int32_idx_over_dense": None if count is None else count * (4 + word) / nbytes,
    }
    print(
        f"{f:>7.3%} {name:<18} {med:7.2f} ms  {row['tbps']:5.2f} TB/s"
        + ("" if count is None else f"  wire {row['wire_int32_idx_over_dense']:.2%} (int32 idx)")
        + ("" if want is None else f"  count {'ok' if count == want else 'WRONG'}"),
        flush=True,
    )
    return row


def _fraction(gib: float, f: float, reps: int, only: list[str] | None) -> list[dict]:
    base, cur = _versions(gib, f, seed=int(f * 1e6))
    keep = base.clone()
    slots = _slots(cur.numel(), min(1.0, 4 * f + 0.01))
    nbytes = cur.numel() * 2
    rows = [
        _variant(name, fn, base, cur, keep, slots, f, reps, nbytes)
        for name, fn in VARIANTS.items()
        if not only or name in only or name == "lib"
    ]
    copy_ms = statistics.median(_time(lambda: keep.copy_(cur), reps))  # keep is spent from here
    rows.append({"fraction": f, "variant": "copy", "ms": copy_ms, "tbps": 2 * nbytes / copy_ms / 1e9})
    print(f"{f:>7.3%} {'copy':<18} {copy_ms:7.2f} ms  {2 * nbytes / copy_ms / 1e9:5.2f} TB/s", flush=True)
    return rows


def run(gib: float, fractions: list[float], reps: int, only: list[str] | None) -> list[dict]:
    rows = []
    for f in fractions:
        rows += _fraction(gib, f, reps, only)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="GiB of bf16 per version")
    ap.add_argument("--fractions", default="0.001,0.01,0.1")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma-separated variant names (lib is always run)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not (a.gib > 0 and a.reps >= 1):
        ap.error(f"--gib must be > 0 and --reps >= 1, got {a.gib} and {a.reps}")
    fractions = [float(x) for x in a.fractions.split(",")]
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)"
    print(f"{name}: {a.gib} GiB bf16 per version, {a.reps} reps", flush=True)
    rows = run(a.gib, fractions, a.reps, a.only.split(",") if a.only else None)
    with open(a.out, "w") as fh:
        json.dump({"device": name, "gib": a.gib, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
