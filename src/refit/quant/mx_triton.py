"""One-pass MXFP8 and NVFP4 quantization on CUDA (Triton), byte-identical to ``refit.quant.mx``.

An MXFP8 program reads ``ROWS`` rows x ``TILE`` columns (``TILE / 32`` scale blocks: long rows of contiguous
bytes), an NVFP4 one ``NVFP4_BLOCKS`` scale blocks of 16 columns (numbered row-major, each loaded as 8 pairs so a
byte's two codes meet in one thread), once, and writes their elements and scales: one read of the weight, one
write of the quantized bytes. The arithmetic is that of ``mx.py`` in the same IEEE operations: ``max |x|`` in
float32 (exact); MXFP8's ``amax / 448`` with ``div_rn`` (Triton's ``/`` is approximate), the E8M0 exponent from
its bits, ``x * 2**(127-e)`` (exactly ``x / 2**(e-127)``), round-to-nearest-even to E4M3; NVFP4's
``6 * weight_scale_2`` (one multiply), ``amax / that`` and ``x / (scale * weight_scale_2)`` with ``div_rn``, the
E2M1 code by the same thresholds (found in three comparisons, a binary search), two codes a byte (low nibble
first). Columns past ``K`` read zeros, as the torch path's zero padding.
On one H200 (a 14336 x 4096 bf16 weight) NVFP4 takes 114 us (the rows x columns tiling of MXFP8: 134-138 us).
A division-free form of the codes (each element against per-block float32 bounds from exact float64 products)
was no faster there, and under Triton 3.6 it wrote wrong bytes for some shapes and warp counts (not isolated
further; its float64 steps are the suspects), so the kernel keeps ``div_rn``.
``NVFP4_KERNEL = "pairs"`` (the default; ``"blocks"`` keeps every weight here) sends bf16 weights that
``nvfp4_triton.pairs_fit`` to ``nvfp4_triton`` (the weight read as pairs of elements, a quotient from each block's
reciprocal; on sm_90 two thirds of this kernel's instructions an element, a sixth of its MUFU reciprocals, a quarter
of its memory instructions; on one H200 under half its device time; its shape is ``PAIRS``).
Checked against the torch path on a GPU by ``tests/test_gpu_quant_mx.py`` (not on CPU: Triton's
interpreter converts to float8 differently from the GPU, so it cannot stand in).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from refit.quant.nvfp4_triton import pairs_fit, quantize_nvfp4_pairs

    AVAILABLE = True
except Exception:  # noqa: BLE001 - no Triton (CPU-only installs): the torch path is used
    AVAILABLE = False

# a program's tile: ROWS rows x TILE columns (powers of two; on one H200, a 14336 x 4096 bf16 weight: MXFP8 in
# 50.8 us, 3.5 TB/s of its bytes, NVFP4 in 134 us, against 80.8 / 160 us for 32 rows x one scale block)
ROWS = 16
TILE = 256
NVFP4_BLOCKS = 256  # NVFP4: 16-element scale blocks a program quantizes (8 warps)
# the NVFP4 kernel the quantizer launches: "blocks" (``_nvfp4_blocks``, any dtype and strides) or "pairs"
# (``nvfp4_triton``: bf16 read as pairs, where ``pairs_fit``; other weights still go through "blocks")
NVFP4_KERNEL = "pairs"


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
    def _nvfp4_blocks(x_ptr, q_ptr, s_ptr, s2_ptr, rps, r_n, k, g_n, sxr, sxk, sqr, sqk, ssr, ssk, BLK: tl.constexpr):
        # BLK scale blocks a program, numbered row-major over [rows, g_n]; a block's 16 elements loaded as 8 pairs
        # [BLK, 8, 2], so the two codes of a byte meet in one thread
        b = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
        row, g = b // g_n, b % g_n
        live = row < r_n
        s2 = tl.load(s2_ptr + row // rps, mask=live, other=1.0)  # rps rows share a weight scale
        col = g[:, None, None] * 16 + 2 * tl.arange(0, 8)[None, :, None] + tl.arange(0, 2)[None, None, :]
        x = tl.load(x_ptr + row[:, None, None] * sxr + col * sxk, mask=live[:, None, None] & (col < k), other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
        bs = tl.minimum(_div_rn(amax, s2 * 6.0), 448.0).to(tl.float8e4nv)
        denom = (bs.to(tl.float32) * s2)[:, None, None]
        y = tl.abs(tl.where(denom == 0, 0.0, _div_rn(x, denom)))
        # the code counts the thresholds y passes (0.25 >, 0.75 >=, 1.25 >, 1.75 >=, 2.5 >, 3.5 >=, 5 >), found
        # in three comparisons: >= 1.75, then >= 3.5 or >= 0.75, then the strict one of the pair left
        h = y >= 1.75
        m = y >= tl.where(h, 3.5, 0.75)
        lo_bit = y > tl.where(h, tl.where(m, 5.0, 2.5), tl.where(m, 1.25, 0.25))
        code = h.to(tl.int32) * 4 + m.to(tl.int32) * 2 + lo_bit.to(tl.int32) + (x < 0).to(tl.int32) * 8
        lo, hi = tl.split(code.to(tl.uint8))
        byte_col = g[:, None] * 8 + tl.arange(0, 8)[None, :]
        bmask = live[:, None] & (byte_col < (k + 1) // 2)
        tl.store(q_ptr + row[:, None] * sqr + byte_col * sqk, lo | (hi << 4), mask=bmask)
        tl.store(s_ptr + row * ssr + g * ssk, bs, mask=live)


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
    strides = (*x.stride(), *q.stride(), *s.stride())
    if fmt == "mxfp8":
        nb = min(TILE // 32, triton.next_power_of_2(triton.cdiv(k, 32)))  # scale blocks a program quantizes
        grid = (triton.cdiv(r_n, ROWS), triton.cdiv(k, 32 * nb))
        _mxfp8_rows[grid](x, q, s, r_n, k, *strides, BR=ROWS, NB=nb)
        return
    want = -(-r_n // rows_per_scale)
    if scale_2 is None or scale_2.shape != (want,) or scale_2.dtype != torch.float32 or scale_2.device != x.device:
        raise ValueError(f"NVFP4 on CUDA: scale_2 must be float32 [{want}] on {x.device}, got {scale_2}")
    if NVFP4_KERNEL not in ("blocks", "pairs"):
        raise ValueError(f"mx_triton.NVFP4_KERNEL must be 'blocks' or 'pairs', got {NVFP4_KERNEL!r}")
    if NVFP4_KERNEL == "pairs" and pairs_fit(x, q, s):
        quantize_nvfp4_pairs(x, q, s, scale_2.contiguous(), rows_per_scale)
        return
    g_n = triton.cdiv(k, 16)
    grid = (triton.cdiv(r_n * g_n, NVFP4_BLOCKS),)
    args = (x, q, s, scale_2.contiguous(), rows_per_scale, r_n, k, g_n, *strides)
    _nvfp4_blocks[grid](*args, BLK=NVFP4_BLOCKS, num_warps=8)
