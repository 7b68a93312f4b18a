"""One-pass MXFP8 and NVFP4 quantization on CUDA (Triton), byte-identical to ``refit.quant.mx``.

A program reads ``ROWS`` rows x ``TILE`` columns (``TILE / B`` scale blocks of B = 32 columns for MXFP8, 16 for
NVFP4: long rows of contiguous bytes) once and writes its elements and scales: one read of the weight, one write
of the quantized bytes. The arithmetic is
that of ``mx.py`` in the same IEEE operations: ``max |x|`` in float32 (exact); MXFP8's ``amax / 448`` with
``div_rn`` (Triton's ``/`` is approximate), the E8M0 exponent from its bits, ``x * 2**(127-e)`` (exactly
``x / 2**(e-127)``), round-to-nearest-even to E4M3; NVFP4's ``6 * weight_scale_2`` (one multiply),
``amax / that`` and ``x / (scale * weight_scale_2)`` with ``div_rn``, the E2M1 code by the same thresholds,
two codes a byte (low nibble first). Columns past ``K`` read zeros, as the torch path's zero padding.
NVFP4 keeps ``div_rn`` per element: the division-free form (``mx.e2m1_codes_exact``, per block seven float32
bounds from exact float64 products, per element seven comparisons) wrote the same bytes on an H200 but no
faster (a 14336 x 4096 bf16 weight: 136-138 us either way, 62-72 us with no element codes at all: the cost is
the per-element comparisons and packing, not the division).
Checked against the torch path on a GPU by ``tests/test_gpu_quant_mx.py`` (not on CPU: Triton's
interpreter converts to float8 differently from the GPU, so it cannot stand in).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    AVAILABLE = True
except Exception:  # noqa: BLE001 - no Triton (CPU-only installs): the torch path is used
    AVAILABLE = False

# a program's tile: ROWS rows x TILE columns (powers of two; on one H200, a 14336 x 4096 bf16 weight: MXFP8 in
# 50.8 us, 3.5 TB/s of its bytes, NVFP4 in 134 us, against 80.8 / 160 us for 32 rows x one scale block)
ROWS = 16
TILE = 256


if AVAILABLE:
    SUB_E1 = tl.constexpr(7340033 * 2.0**-141)  # the least float32 above 448 * (2**-127 + 2**-150) (normal, exact)

    @triton.jit
    def _div_rn(a, b):
        return libdevice.div_rn(a, b)

    @triton.jit
    def _load(x_ptr, rows, cols, r_n, k, sxr, sxk):
        mask = (rows[:, None] < r_n) & (cols[None, :] < k)
        ptr = x_ptr + rows.to(tl.int64)[:, None] * sxr + cols.to(tl.int64)[None, :] * sxk
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32), mask

    @triton.jit
    def _mxfp8_rows(x_ptr, q_ptr, s_ptr, r_n, k, sxr, sxk, sqr, sqk, ssr, ssk, BR: tl.constexpr, NB: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        j = tl.program_id(1) * NB + tl.arange(0, NB)  # this program's scale blocks
        cols = tl.program_id(1) * NB * 32 + tl.arange(0, NB * 32)
        x, mask = _load(x_ptr, rows, cols, r_n, k, sxr, sxk)
        xb = tl.reshape(x, (BR, NB, 32))
        amax = tl.maximum(tl.max(tl.abs(xb), axis=2), 1.1754943508222875e-38)
        bits = _div_rn(amax, 448.0).to(tl.int32, bitcast=True)
        ex, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        # a subnormal amax / 448 (flushed to zero here): its exponent is 1 iff it rounds above 2**-127, i.e. iff
        # amax > 448 * (2**-127 + 2**-150), i.e. iff amax >= SUB_E1 (the next float32 above that bound)
        e = tl.where(ex == 0, (amax >= SUB_E1).to(tl.int32), ex + (man != 0).to(tl.int32))
        e = tl.minimum(tl.maximum(e, 0), 254)
        # x / 2**(e - 127) as x * 2**(127 - e): exact either way, and 2**(127 - e) is a normal float for every e a
        # finite amax gives, where 2**-127 (e == 0) as a divisor is subnormal and the GPU flushes it to zero
        inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
        q = tl.reshape((xb * inv[:, :, None]).to(tl.float8e4nv), (BR, NB * 32))
        r64 = rows.to(tl.int64)
        tl.store(q_ptr + r64[:, None] * sqr + cols.to(tl.int64)[None, :] * sqk, q, mask=mask)
        smask = (rows[:, None] < r_n) & (j[None, :] * 32 < k)
        tl.store(s_ptr + r64[:, None] * ssr + j.to(tl.int64)[None, :] * ssk, e.to(tl.uint8), mask=smask)

    @triton.jit
    def _nvfp4_rows(
        x_ptr, q_ptr, s_ptr, s2_ptr, rps, r_n, k, sxr, sxk, sqr, sqk, ssr, ssk, BR: tl.constexpr, NB: tl.constexpr
    ):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        j = tl.program_id(1) * NB + tl.arange(0, NB)  # this program's scale blocks
        x, _ = _load(x_ptr, rows, tl.program_id(1) * NB * 16 + tl.arange(0, NB * 16), r_n, k, sxr, sxk)
        xb = tl.reshape(x, (BR, NB, 16))
        s2 = tl.load(s2_ptr + rows // rps, mask=rows < r_n, other=1.0)[:, None]  # rps rows share a weight scale
        amax = tl.max(tl.abs(xb), axis=2)
        bs = tl.minimum(_div_rn(amax, s2 * 6.0), 448.0).to(tl.float8e4nv)
        denom = (bs.to(tl.float32) * s2)[:, :, None]
        y = _div_rn(xb, denom)
        a = tl.abs(tl.where(denom == 0, 0.0, y))
        code = (a > 0.25).to(tl.uint8) + (a >= 0.75).to(tl.uint8) + (a > 1.25).to(tl.uint8)
        code += (a >= 1.75).to(tl.uint8) + (a > 2.5).to(tl.uint8) + (a >= 3.5).to(tl.uint8) + (a > 5.0).to(tl.uint8)
        code = code | ((xb < 0).to(tl.uint8) << 3)
        lo, hi = tl.split(tl.reshape(code, (BR, NB * 8, 2)))
        byte_cols = tl.program_id(1) * NB * 8 + tl.arange(0, NB * 8)
        r64 = rows.to(tl.int64)
        bmask = (rows[:, None] < r_n) & (byte_cols[None, :] < (k + 1) // 2)
        tl.store(q_ptr + r64[:, None] * sqr + byte_cols.to(tl.int64)[None, :] * sqk, lo | (hi << 4), mask=bmask)
        smask = (rows[:, None] < r_n) & (j[None, :] * 16 < k)
        tl.store(s_ptr + r64[:, None] * ssr + j.to(tl.int64)[None, :] * ssk, bs, mask=smask)


def quantize_rows_triton(
    x: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    fmt: str,
    scale_2: torch.Tensor | None = None,
    rows_per_scale: int = 1,
) -> None:
    """``x`` [R, K] on CUDA quantized in ``fmt`` (``"mxfp8"``, ``"nvfp4"``) into ``q`` [R, K | ceil(K/2)] and
    ``s`` [R, ceil(K/B)]; NVFP4's ``scale_2``: float32 [ceil(R / rows_per_scale)] on ``x``'s device, the
    ``weight_scale_2`` of each run of ``rows_per_scale`` rows (one [N, K] matrix: N rows; no per-row copy)."""
    r_n, k = x.shape
    if r_n == 0 or k == 0:
        return
    block = 32 if fmt == "mxfp8" else 16
    nb = min(TILE // block, triton.next_power_of_2(triton.cdiv(k, block)))  # scale blocks a program quantizes
    grid = (triton.cdiv(r_n, ROWS), triton.cdiv(k, block * nb))
    strides = (*x.stride(), *q.stride(), *s.stride())
    if fmt == "mxfp8":
        _mxfp8_rows[grid](x, q, s, r_n, k, *strides, BR=ROWS, NB=nb)
        return
    want = -(-r_n // rows_per_scale)
    if scale_2 is None or scale_2.shape != (want,) or scale_2.dtype != torch.float32 or scale_2.device != x.device:
        raise ValueError(f"NVFP4 on CUDA: scale_2 must be float32 [{want}] on {x.device}, got {scale_2}")
    _nvfp4_rows[grid](x, q, s, scale_2.contiguous(), rows_per_scale, r_n, k, *strides, BR=ROWS, NB=nb)
