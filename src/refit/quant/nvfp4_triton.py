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

The code (``ADD_CODE``) is found by one addition that rounds ``y`` to the E2M1 grid (``_code_add``; 2: without
its upper exponent clamp, a y >= 8 coding 7 all the same), else by three comparisons (``_code_cmp``).

``BOUNDS`` (where MODE 2 holds, on sm_90 and later) finds no quotient: ``RN(a / d) >= t`` for a threshold ``t``
(0.75, 1.75, 3.5; a tie rounds to the even ``t``) iff ``a >= (t - e) d``, ``e`` half ``t``'s float32 step, and
``RN(a / d) > t`` (0.25, 1.25, 2.5, 5) iff ``a > (t + e) d``. For a bf16 magnitude ``a`` that is ``a >= L`` with
``L`` the bound rounded up to bf16 (from a fused multiply-add rounding upward, ``fma_ru(d, t, -e d)``), or the
next bf16 past the bound rounded down. ``L`` as an integer (bf16 magnitudes order as their 15 bits) gives
``0x8000 - L`` in both halves of a word: ``a + that`` has bit 15 (31) set iff ``a >= L``, for both elements of a
pair at once; a binary search over the seven bounds (``prmt`` turns a half's top bit into a 16-bit mask that
picks the next bound) gives the code's three bits, and one ``mul.hi`` moves the two nibbles into the output byte.
A block whose ``d`` is 0 (its elements below 2**73) takes the bounds of ``d = 2**89``: magnitude 0, as the torch
path's. It is the default on sm_90 and later (``PAIRS``): 200 us a Llama-8B layer on one H200 against 216 for the
quotient path and 220 for a bf16 ``copy_`` (``bench.nvfp4_kernels``, ``bench/results/h200-nvfp4-kernels.json``;
every tile shape there, 4-16 rows, 32 or 64 blocks, 2-8 warps, writes the torch path's bytes).

The block scale stays float32 (its E4M3 value, exact) from its rounding to its store, where it becomes fp8: no
8-bit value crosses a layout conversion. The scale store's layout is not the codes', and Triton 3.6 with its
ptxas 12.8 on Hopper moved an 8-bit scale between them through shared memory wrongly wherever four went to one
32-bit store (a thread holding one or four blocks: 4 x 32, 8 x 64, 16 x 32 tiles, 8 warps; fp8 and uint8 alike,
the codes then from wrong scales, the stored scales right); as float32 every tile writes the torch path's bytes.

SASS for sm_90 from Triton 3.6, instructions an element on the straight path (``BR = 8``, ``NB = 32``, 4 warps;
2 LDG.E.128, 2 STG.E of 4 bytes and one scale byte a block): MODE 2 23.6 (2.5 MUFU a block), without the upper
clamp 22.6, ``BOUNDS`` 16.9 (1.5 MUFU a block: the scale's ``div_rn``), 15.3 with ``BR = 16``; against 36.3 for
``mx_triton._nvfp4_blocks`` (17 MUFU, 8 32-bit loads and 9 byte stores a block).
"""

from __future__ import annotations

import functools

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
def _code_add(y, CLAMP_TOP: tl.constexpr):
    # the same code by one rounding: y + C with C = 2**22 * 2**s, s = clamp(exponent(y), 0, 2), rounds y to the
    # E2M1 grid's spacing at y (C's ulp: 0.5 below 2, 1 below 4, 2 above; ties to even), and bits(y + C) - bits(C)
    # counts those steps: the code less 2 * s, 7 at most (compared unsigned: a NaN y, from an infinite quotient,
    # codes 7 whatever its sign bit). Without the clamp at 2 (CLAMP_TOP false) a y >= 8 still codes 7: its steps
    # are 2 or more past 2 * s >= 6, or, where 2**(22 + s) is past float32's range (y >= 2**106), the difference
    # is negative (0 after an infinite C), compared unsigned or with 2 * s >= 212 added
    s = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) - 127, 0)
    if CLAMP_TOP:
        s = tl.minimum(s, 2)
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
        c_lo, c_hi = _code_add(y_lo, ADD_CODE == 1), _code_add(y_hi, ADD_CODE == 1)
    else:
        c_lo, c_hi = _code_cmp(y_lo), _code_cmp(y_hi)
    c_lo += (lo < 0).to(tl.int32) * 8
    c_hi += (hi < 0).to(tl.int32) * 8
    return (c_lo | (c_hi << 4)).to(tl.uint8)


@triton.jit
def _half_masks(v):
    # 0xFFFF in each 16-bit half of v whose top bit (15, 31) is set, else 0 (PTX prmt, sign-replicating bytes 1, 3)
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0xBB99;", "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _max_u16x2(a, b):
    return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bound(d, t, e, STRICT: tl.constexpr):
    # 0x8000 - L in both 16-bit halves, L the least bf16 magnitude (as an integer) whose quotient by d codes past
    # t: RN(a / d) >= t iff a / d >= t - e (a tie rounds to the even t), so iff a >= RU((t - e) d); RN(a / d) > t
    # iff a / d > t + e, so iff a is past RD((t + e) d). e is half t's float32 step (a power of two: e d exact);
    # the fused multiply-add rounds the exact (t -+ e) d once, upward or downward, and bf16 RU / RD by its bits
    if STRICT:
        b = libdevice.fma_rd(tl.full(d.shape, t, tl.float32), d, d * e)
        lim = (b.to(tl.int32, bitcast=True) >> 16) + 1
    else:
        b = libdevice.fma_ru(tl.full(d.shape, t, tl.float32), d, d * -e)
        lim = (b.to(tl.int32, bitcast=True) + 0xFFFF) >> 16
    return ((0x8000 - lim) * 65537)[:, None]


@triton.jit
def _bytes_bounds(w, k1, k2, k3, k4, k5, k6, k7):
    # words [M, n] -> bytes [M, n] with no quotient: a bf16 magnitude a (15 bits, a half of w & 0x7FFF7FFF) is
    # at least the bound L of threshold i iff bit 15 of its half of a + (0x8000 - L) is set; the code's three
    # bits by a binary search over the thresholds, both halves at once (0.75 >=, 1.75 >=, 3.5 >= and 0.25 >,
    # 1.25 >, 2.5 >, 5 > as k2, k4, k6 and k1, k3, k5, k7), the sign bit where x < 0 (a half's sign and a >= 1)
    a = w & 0x7FFF7FFF
    h = _half_masks(a + k4)
    m = _half_masks(a + ((h & k6) | (~h & k2)))
    low = a + ((h & ((m & k7) | (~m & k5))) | (~h & ((m & k3) | (~m & k1))))
    sign = w & (a + 0x7FFF7FFF) & -2147450880  # 0x80008000
    v = (h & 0x40004000) | (m & 0x20002000) | sign | ((low >> 3) & 0x10001000)
    # v holds the low element's code in bits 12-15 and the high one's in 28-31: v << 20 + v << 8 (no carries)
    # brings them to bits 32-35 and 36-39
    return tl.umulhi(v.to(tl.uint32, bitcast=True), 0x100100).to(tl.uint8)


@triton.jit
def _bounds(amax, s2):
    # (E4M3 scale, k1..k7) per block for _bytes_bounds; s2 in [2**-80, 2**80], so d is 0 or in [2**-89, 2**89];
    # a block whose d is 0 (all its elements below 2**73) gets bounds for 2**89 (code 0, as the torch path's)
    bs = tl.minimum(libdevice.div_rn(amax, s2 * 6.0), 448.0).to(tl.float8e4nv).to(tl.float32)
    d = bs * s2
    d = tl.where(d > 0, d, 2.0**89)
    k1 = _bound(d, 0.25, 2.0**-26, True)
    k2 = _bound(d, 0.75, 2.0**-25, False)
    k3 = _bound(d, 1.25, 2.0**-24, True)
    k4 = _bound(d, 1.75, 2.0**-24, False)
    k5 = _bound(d, 2.5, 2.0**-23, True)
    k6 = _bound(d, 3.5, 2.0**-23, False)
    k7 = _bound(d, 5.0, 2.0**-22, True)
    return bs, k1, k2, k3, k4, k5, k6, k7


@triton.jit
def _block_params(amax, s2, MODE: tl.constexpr):
    # (E4M3 scale, p0, p1, p2, p3) per block, as MODE's quotient wants them
    bs = tl.minimum(libdevice.div_rn(amax, s2 * 6.0), 448.0).to(tl.float8e4nv).to(tl.float32)
    d = bs * s2
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
    if HALVES:
        w1 = tl.load(x_base + w_off + 4, mask=m1, other=0)
    if MODE == 3:  # the code from bounds on the magnitudes (s2 in [2**-80, 2**80])
        am = tl.reduce(w0 & 0x7FFF7FFF, 1, _max_u16x2)
        if HALVES:
            am = _max_u16x2(am, tl.reduce(w1 & 0x7FFF7FFF, 1, _max_u16x2))
        amax = (tl.maximum(am & 0xFFFF, am >> 16) << 16).to(tl.float32, bitcast=True)
        bs, k1, k2, k3, k4, k5, k6, k7 = _bounds(amax, s2)
        tl.store(q_base + b_off, _bytes_bounds(w0, k1, k2, k3, k4, k5, k6, k7), mask=m0)
        if HALVES:
            tl.store(q_base + b_off + 4, _bytes_bounds(w1, k1, k2, k3, k4, k5, k6, k7), mask=m1)
    else:
        amax = _absmax(w0)
        if HALVES:
            amax = tl.maximum(amax, _absmax(w1))
        bs, p0, p1, p2, p3 = _block_params(amax, s2, MODE)
        p0, p1, p2, p3 = p0[:, None], p1[:, None], p2[:, None], p3[:, None]
        tl.store(q_base + b_off, _bytes(w0, p0, p1, p2, p3, MODE, ADD_CODE), mask=m0)
        if HALVES:
            tl.store(q_base + b_off + 4, _bytes(w1, p0, p1, p2, p3, MODE, ADD_CODE), mask=m1)
    tl.store(s_base + rr * ssr + g, bs.to(tl.float8e4nv), mask=live)  # float32 until here (the docstring)


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
    BOUNDS: tl.constexpr,
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
            if BOUNDS:
                _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 3, ADD_CODE, FULL_K)
            else:
                _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 2, ADD_CODE, FULL_K)
        else:
            _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 1, ADD_CODE, FULL_K)
    else:
        s2 = tl.load(s2_ptr + (r0 + rr) // rps, mask=live, other=1.0)
        _tile(xb, qb, sb, s2, rr, g, live, kp, sxr, sqr, ssr, HALVES, 1, ADD_CODE, FULL_K)


# the shape the quantizer launches: BR rows x NB blocks a program, each block's words in two halves, the code
# from per-block bounds on sm_90 and later (else the quotient from the block's reciprocal, its code by one addition
# without the upper clamp), 4 warps
PAIRS = {"br": 8, "nb": 32, "halves": True, "exact_div": False, "add_code": 2, "num_warps": 4, "bounds": True}


@functools.cache
def _sm90(device: int | None) -> bool:
    """Whether the GPU runs the bounds path's PTX (``max.u16x2`` needs sm_90); an older one takes the quotient."""
    return torch.cuda.get_device_capability(device)[0] >= 9


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
    shape = {**PAIRS, **shape}
    br, nb, halves, exact_div, num_warps = (shape[n] for n in ("br", "nb", "halves", "exact_div", "num_warps"))
    r_n, k = x.shape
    kp, g_n = k // 2, triton.cdiv(k, 16)
    words = x.view(torch.int32)  # [R, K/2] words, row stride x.stride(0) / 2
    grid = (triton.cdiv(r_n, br), triton.cdiv(g_n, nb))
    _nvfp4_pairs[grid](
        words, q, s, scale_2, rows_per_scale, r_n, g_n, kp, words.stride(0), q.stride(0), s.stride(0),
        BR=br, NB=nb, HALVES=halves, EXACT_DIV=exact_div, ADD_CODE=int(shape["add_code"]), FULL_K=kp % 8 == 0,
        TILE_S2=rows_per_scale % br == 0, BOUNDS=shape["bounds"] and _sm90(x.device.index), num_warps=num_warps,
    )  # fmt: skip
