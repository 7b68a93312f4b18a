"""NVFP4 of bf16 weights on CUDA (Triton) from their pairs of elements, byte-identical to ``refit.quant.mx``.

A bf16 weight read as int32 (two elements a word: element ``2j`` in the low half, ``2j + 1`` in the high one,
each a float32 by a shift or a mask) gives the two codes of an output byte in one thread with no reshape or
split: a program holds ``BR`` rows x ``NB`` scale blocks (a 2-D grid: no division finds a block's row; int32
offsets from the tile's int64 base), each block's 8 words loaded by one thread as two 16-byte halves
(``HALVES``; else as one [M, 8] tensor, a block then shared by two threads). Stores are 4 bytes a half.

The arithmetic is ``mx.py``'s: ``amax`` in float32, the E4M3 block scale ``e4m3(min(amax / (6 * s2), 448))``
(``div_rn``, once a block), each element's ``y = |x| / d`` (``d = scale * s2``) correctly rounded, its E2M1 code
and the sign bit ``x < 0``. The quotient (``MODE``; ``p0..p3`` are per-block values):

* 0 (``EXACT_DIV``): ``div_rn`` an element (a MUFU reciprocal and a range check each).
* 2 (a tile whose ``s2`` lies in [2**-80, 2**80], so ``d`` is 0 or in [2**-89, 2**89]: every real weight):
  ``r = div_rn(1, d)`` once a block (0 where ``d`` is 0), then ``q0 = |x| r``, ``q1 = q0 + (|x| - d q0) r``,
  ``y = q1 + (|x| - d q1) r`` in fused multiply-adds. ``q1`` is faithful (within half an ulp plus 2**-46 of the
  quotient), so the remainder ``|x| - d q1`` is exact, and with a correctly rounded reciprocal Markstein's
  theorem makes ``y`` the correctly rounded quotient; where a code depends on it (y in [2**-3, 8]) no remainder
  underflows (multiples of ulp(d) ulp(y) >= 2**-140). An infinite quotient (a huge ``x``) turns NaN: code 7.
* 1 (any other ``s2``): the same with ``d`` and ``|x|`` scaled by one power of two ``kf`` (exact;
  ``d kf`` in [2**-23, 4) for every finite ``d > 0``, ``|x| kf`` clamped at 2**64, where every quotient codes 7).
  A block whose ``d`` is 0, infinite or NaN gets magnitude 0 (``kf`` and the clamp 0; the torch path's quotient
  is 0 or NaN there), its sign bits still ``x < 0``.

The code (``ADD_CODE``) is found by one addition that rounds ``y`` to the E2M1 grid (``_code_add``), else by
three comparisons (``_code_cmp``). SASS for sm_90 from Triton 3.6, per element on the straight path: 24.5
instructions (MODE 2, the default shape; 3 MUFU, 2 LDG.E.128 and 3 stores a block) against 36.3 for
``mx_triton._nvfp4_blocks`` (17 MUFU, 8 32-bit loads and 9 byte stores a block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _code_cmp(y):
    # E2M1 magnitude code of y >= 0: the thresholds passed (0.25 >, 0.75 >=, 1.25 >, 1.75 >=, 2.5 >, 3.5 >=,
    # 5 >), in three comparisons: >= 1.75, then >= 3.5 or >= 0.75, then the strict one of the pair left (each as
    # "not below", so that a NaN y, from an infinite quotient, codes 7)
    h = ~(y < 1.75)
    m = ~(y < tl.where(h, 3.5, 0.75))
    lo_bit = ~(y <= tl.where(h, tl.where(m, 5.0, 2.5), tl.where(m, 1.25, 0.25)))
    return h.to(tl.int32) * 4 + m.to(tl.int32) * 2 + lo_bit.to(tl.int32)


@triton.jit
def _code_add(y):
    # the same code by one rounding: y + C with C = 2**22 * 2**s, s = clamp(exponent(y), 0, 2), rounds y to the
    # E2M1 grid's spacing at y (C's ulp: 0.5 below 2, 1 below 4, 2 above; ties to even), and bits(y + C) - bits(C)
    # counts those steps: the code less 2 * s, 7 at most (compared unsigned: a NaN y, from an infinite quotient,
    # codes 7 whatever its sign bit)
    s = tl.minimum(tl.maximum((y.to(tl.int32, bitcast=True) >> 23) - 127, 0), 2)
    c = 0x4A800000 + (s << 23)
    steps = (y + c.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - c + 2 * s
    return tl.minimum(steps.to(tl.uint32, bitcast=True), 7).to(tl.int32, bitcast=True)


@triton.jit
def _quotient(x, p0, p1, p2, p3, MODE: tl.constexpr):
    # |x| / d rounded to float32 (see the module docstring for the block parameters p0..p3 of each MODE)
    if MODE == 0:
        return libdevice.div_rn(tl.minimum(tl.abs(x), p3), p0)
    if MODE == 1:
        a = tl.minimum(tl.abs(x) * p1, p3)
    else:
        a = tl.abs(x)
    q = a * p2
    q = tl.fma(tl.fma(-p0, q, a), p2, q)
    return tl.fma(tl.fma(-p0, q, a), p2, q)


@triton.jit
def _bytes(w, p0, p1, p2, p3, MODE: tl.constexpr, ADD_CODE: tl.constexpr):
    # words [M, n] of bf16 pairs -> bytes [M, n]: the low element's code in the low nibble, sign bits from x < 0
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    y_lo = _quotient(lo, p0, p1, p2, p3, MODE)
    y_hi = _quotient(hi, p0, p1, p2, p3, MODE)
    if ADD_CODE:
        c_lo, c_hi = _code_add(y_lo), _code_add(y_hi)
    else:
        c_lo, c_hi = _code_cmp(y_lo), _code_cmp(y_hi)
    c_lo += (lo < 0).to(tl.int32) * 8
    c_hi += (hi < 0).to(tl.int32) * 8
    return (c_lo | (c_hi << 4)).to(tl.uint8)


@triton.jit
def _block_params(amax, s2, MODE: tl.constexpr):
    # (E4M3 scale, p0, p1, p2, p3) per block, as MODE's quotient wants them
    bs = tl.minimum(libdevice.div_rn(amax, s2 * 6.0), 448.0).to(tl.float8e4nv)
    d = bs.to(tl.float32) * s2
    ok = (d > 0) & (d < float("inf"))
    one = tl.full(d.shape, 1.0, tl.float32)
    if MODE == 0:
        return bs, tl.where(ok, d, float("inf")), d, d, tl.where(ok, float("inf"), 0.0)
    if MODE == 1:
        e = (d.to(tl.int32, bitcast=True) >> 23) & 0xFF
        k = tl.minimum(tl.maximum(127 - e, -126), 126)
        kf = tl.where(ok, ((k + 127) << 23).to(tl.float32, bitcast=True), 0.0)
        dn = tl.where(ok, d * kf, 1.0)
        return bs, dn, kf, libdevice.div_rn(one, dn), tl.where(ok, 2.0**64, 0.0)
    # MODE 2: s2 in [2**-80, 2**80], so d is 0 or in [2**-89, 2**89]
    return bs, d, d, tl.where(d > 0, libdevice.div_rn(one, tl.where(d > 0, d, 1.0)), 0.0), d


@triton.jit
def _tile(x_base, q_base, s_base, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES: tl.constexpr, MODE: tl.constexpr,
          ADD_CODE: tl.constexpr, FULL_K: tl.constexpr):  # fmt: skip
    if HALVES:
        j = tl.arange(0, 4)[None, :]
    else:
        j = tl.arange(0, 8)[None, :]
    w_off = (rr * sxr + g * 8)[:, None] + j
    b_off = (rr * sqr + g * 8)[:, None] + j
    if FULL_K:
        m0 = live[:, None]
        m1 = live[:, None]
    else:
        m0 = live[:, None] & (g[:, None] * 8 + j < kp)
        m1 = live[:, None] & (g[:, None] * 8 + 4 + j < kp)
    w0 = tl.load(x_base + w_off, mask=m0, other=0)
    amax = _absmax(w0)
    if HALVES:
        w1 = tl.load(x_base + w_off + 4, mask=m1, other=0)
        amax = tl.maximum(amax, _absmax(w1))
    bs, p0, p1, p2, p3 = _block_params(amax, s2, MODE)
    p0, p1, p2, p3 = p0[:, None], p1[:, None], p2[:, None], p3[:, None]
    tl.store(q_base + b_off, _bytes(w0, p0, p1, p2, p3, MODE, ADD_CODE), mask=m0)
    if HALVES:
        tl.store(q_base + b_off + 4, _bytes(w1, p0, p1, p2, p3, MODE, ADD_CODE), mask=m1)
    tl.store(s_base + rr * ssr + g, bs, mask=live)


@triton.jit
def _absmax(w):
    lo = tl.abs((w << 16).to(tl.float32, bitcast=True))
    hi = tl.abs((w & -65536).to(tl.float32, bitcast=True))
    return tl.max(tl.maximum(lo, hi), axis=1)


@triton.jit
def _nvfp4_pairs(
    x_ptr,
    q_ptr,
    s_ptr,
    s2_ptr,
    rps,
    r_n,
    g_n,
    kp,
    sxr,
    sqr,
    ssr,
    BR: tl.constexpr,
    NB: tl.constexpr,
    HALVES: tl.constexpr,
    EXACT_DIV: tl.constexpr,
    ADD_CODE: tl.constexpr,
    FULL_K: tl.constexpr,
    TILE_S2: tl.constexpr,
):
    # x_ptr: int32 words of bf16 pairs, rows of kp words (row stride sxr words); q_ptr bytes (row stride sqr)
    r0 = tl.program_id(0) * BR
    i = tl.arange(0, BR * NB)
    rr = i // NB  # row in the tile
    g = tl.program_id(1) * NB + i % NB
    live = (r0 + rr < r_n) & (g < g_n)
    xb = x_ptr + r0.to(tl.int64) * sxr
    qb = q_ptr + r0.to(tl.int64) * sqr
    sb = s_ptr + r0.to(tl.int64) * ssr
    if EXACT_DIV:
        if TILE_S2:
            s2 = tl.load(s2_ptr + r0 // rps)
        else:
            s2 = tl.load(s2_ptr + (r0 + rr) // rps, mask=live, other=1.0)
        _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 0, ADD_CODE, FULL_K)
    elif TILE_S2:  # the tile's rows share one weight scale (rps a multiple of BR)
        s2 = tl.load(s2_ptr + r0 // rps)
        if (s2 >= 2.0**-80) & (s2 <= 2.0**80):
            _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 2, ADD_CODE, FULL_K)
        else:
            _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 1, ADD_CODE, FULL_K)
    else:
        s2 = tl.load(s2_ptr + (r0 + rr) // rps, mask=live, other=1.0)
        _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 1, ADD_CODE, FULL_K)


# the shape the quantizer launches: BR rows x NB blocks a program, each block's words in two halves, the
# quotient from the block's reciprocal, 4 warps
PAIRS = {"br": 8, "nb": 32, "halves": True, "exact_div": False, "add_code": True, "num_warps": 4}


def pairs_fit(x, q, s) -> bool:
    """Whether ``x`` [R, K] can be read as bf16 pairs: bf16, columns contiguous, K and the row stride even,
    4-byte aligned, ``q`` and ``s`` with contiguous columns, and a tile's offsets within int32."""
    return (
        x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and x.shape[1] % 2 == 0
        and x.stride(0) % 2 == 0
        and x.data_ptr() % 4 == 0
        and q.stride(1) == 1
        and s.stride(1) == 1
        and 64 * max(x.stride(0), q.stride(0)) < 2**31
    )


def quantize_nvfp4_pairs(x, q, s, scale_2, rows_per_scale: int, **shape) -> None:
    """NVFP4 of ``x`` [R, K] bf16 (``pairs_fit``) into ``q`` [R, K/2] uint8 and ``s`` [R, ceil(K/16)] float8_e4m3fn
    with ``scale_2`` float32 [ceil(R / rows_per_scale)]; the tile shape from ``PAIRS`` unless given."""
    unknown = set(shape) - set(PAIRS)
    if unknown:
        raise ValueError(f"quantize_nvfp4_pairs: shape keys {sorted(unknown)} not among {sorted(PAIRS)}")
    br, nb, halves, exact_div, add_code, num_warps = ({**PAIRS, **shape}[n] for n in PAIRS)
    r_n, k = x.shape
    kp, g_n = k // 2, triton.cdiv(k, 16)
    words = x.view(torch.int32)  # [R, K/2] words, row stride x.stride(0) / 2
    grid = (triton.cdiv(r_n, br), triton.cdiv(g_n, nb))
    _nvfp4_pairs[grid](
        words, q, s, scale_2, rows_per_scale, r_n, g_n, kp, words.stride(0), q.stride(0), s.stride(0),
        BR=br, NB=nb, HALVES=halves, EXACT_DIV=exact_div, ADD_CODE=add_code, FULL_K=kp % 8 == 0,
        TILE_S2=rows_per_scale % br == 0, num_warps=num_warps,
    )  # fmt: skip
