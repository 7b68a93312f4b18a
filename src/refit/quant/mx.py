"""MXFP8 and NVFP4 weights, as vLLM's ModelOpt checkpoints hold them (``quant_method`` ``MXFP8`` / ``NVFP4``).

Both scale blocks of elements along the reduction (input, last) dim of a weight ``[..., N, K]``:

* **MXFP8** (OCP Microscaling, E4M3 elements): ``weight`` ``float8_e4m3fn`` ``[..., N, K]`` and ``weight_scale``
  ``uint8`` ``[..., N, K/32]``, each a biased E8M0 exponent ``e`` (the block's scale is ``2**(e - 127)``).
  The exponent is vLLM's (``mxfp8_utils._mxfp8_e4m3_quantize_torch``, ModelOpt's ``MXFP8QTensor``):
  ``e = ceil(log2(amax / 448)) + 127`` clamped to ``[0, 254]``, with ``amax`` the block's ``max |x|`` in float32
  (at least float32's ``tiny``) and ``amax / 448`` correctly rounded; then ``q = e4m3(x / 2**(e - 127))``.
  The OCP spec's example rule (``floor(log2(amax)) - 8``) lets elements overflow and saturate; the ceiling
  never does. ``ceil(log2(r))`` is read from ``r``'s bits (its exponent, plus one unless ``r`` is a power of
  two), not from a ``log2`` that may differ in the last bit between devices.
* **NVFP4** (E2M1 elements, two a byte): ``weight`` ``uint8`` ``[..., N, K/2]`` (element ``2j`` in the low
  nibble of byte ``j``, ``2j + 1`` in the high one; nibble = sign bit 3, magnitude code 0-7 for
  0, 0.5, 1, 1.5, 2, 3, 4, 6), ``weight_scale`` ``float8_e4m3fn`` ``[..., N, K/16]`` and ``weight_scale_2``
  float32, one per tensor (``[...]``: per leading index, e.g. per expert). ModelOpt's arithmetic:
  ``weight_scale_2 = A / 2688`` (``A``: the tensor's ``max |x|``, at least ``AMAX_FLOOR``; 2688 = 6 * 448),
  ``weight_scale = e4m3(min(amax_block / (6 * weight_scale_2), 448))``,
  ``q = e2m1(x / (weight_scale * weight_scale_2))`` rounded to nearest, ties to even, saturating at 6
  (a block whose scale is 0 holds zeros); the sign of a code is ``x``'s. Every division correctly rounded.

Partial blocks at the end of ``K`` (and an odd ``K``'s last byte) are quantized as if zero-padded; vLLM's
loaders want ``K`` per rank a multiple of the block. Every operation here is an IEEE operation with one
rounding, so the torch path (any device) and the Triton kernels (``mx_triton``) give the same bytes.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E8M0 = torch.uint8  # vLLM's MXFP8_SCALE_DTYPE: the biased exponent
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
FP8_MAX = 448.0
FP4_MAX = 6.0
AMAX_FLOOR = 1e-12  # NVFP4: a tensor of zeros gets weight_scale_2 = 1e-12 / 2688, not 0
# E2M1 magnitudes by code, and the rounding thresholds between codes: ">" rounds ties down to the even
# code (0.25 -> 0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4), ">=" up to it (0.75 -> 1.0, 1.75 -> 2, 3.5 -> 4)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    """``w`` [..., N, K] as float32 [..., N, ceil(K/block), block], zero-padded at the end of K."""
    if w.dim() < 2:
        raise ValueError(f"MX/NVFP4 quantization takes a weight of 2 or more dims, got shape {list(w.shape)}")
    k = w.shape[-1]
    g = -(-k // block)
    x = w.float()
    if g * block != k:
        x = torch.nn.functional.pad(x, (0, g * block - k))
    return x.reshape(*w.shape[:-1], g, block)


def _div(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """``a / b`` correctly rounded on every device (a Python-scalar divisor lets CUDA multiply by its
    reciprocal instead)."""
    return a / (b if isinstance(b, torch.Tensor) else torch.full_like(a, b))


def e8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The biased E8M0 exponent (int32) of blocks of float32 ``amax``: ``ceil(log2(amax / 448)) + 127``
    clamped to [0, 254], read from the bits of ``r = amax / 448`` (an exact ceiling)."""
    r = _div(amax.clamp(min=torch.finfo(torch.float32).tiny), FP8_MAX)
    bits = r.view(torch.int32)
    exp, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    normal = exp + (man != 0).to(torch.int32)
    # a subnormal r = man * 2**-149: ceil(log2 r) + 127 is 1 above 2**-127 (man > 2**22), else <= 0
    sub = (man > (1 << 22)).to(torch.int32)
    return torch.where(exp == 0, sub, normal).clamp(0, 254)


def e8m0_value(e: torch.Tensor) -> torch.Tensor:
    """``2**(e - 127)`` in float32, exact (``e`` 0 is the subnormal 2**-127)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)
    return bits.view(torch.float32)


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., N, K] float8_e4m3fn, weight_scale [..., N, ceil(K/32)] uint8 E8M0) of ``w``."""
    x = _blocks(w, MXFP8_BLOCK)
    e = e8m0_exponent(x.abs().amax(dim=-1))
    q = _div(x, e8m0_value(e).unsqueeze(-1).expand_as(x)).to(FP8)
    return q.flatten(-2)[..., : w.shape[-1]], e.to(E8M0)


def nvfp4_scale_2(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's ``weight_scale_2`` (float32) of a tensor's ``max |x|``: ``max(amax, AMAX_FLOOR) / 2688``."""
    return _div(amax.float().clamp(min=AMAX_FLOOR), FP8_MAX * FP4_MAX)


def e2m1_codes(y: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of float32 ``y``: magnitude rounded to nearest, ties to even, saturating
    at 6; sign bit from ``negative``."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for t, inclusive in _E2M1_UP:
        code += (a >= t) if inclusive else (a > t)
    return code | (negative.to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes -> [..., ceil(K/2)] bytes, element 2j in the low nibble (zero-padded)."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def nvfp4_block_scales(x: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_scale float8_e4m3fn [..., N, G], its elements' divisor ``weight_scale * weight_scale_2`` float32
    [..., N, G, 1]) of blocks ``x`` float32 [..., N, G, 16] with ``scale_2`` of the leading dims' shape."""
    s2 = scale_2.float().reshape(*scale_2.shape, 1, 1)
    six = (s2 * FP4_MAX).expand_as(x[..., 0])  # 6 * weight_scale_2, one IEEE multiply
    bs = _div(x.abs().amax(dim=-1), six).clamp(max=FP8_MAX).to(FP8)
    return bs, (bs.float() * s2).unsqueeze(-1)


def quantize_nvfp4(w: torch.Tensor, scale_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [..., N, ceil(K/2)] uint8, weight_scale [..., N, ceil(K/16)] float8_e4m3fn) of ``w`` [..., N, K]
    with the agreed ``scale_2`` (float32, the shape of ``w``'s leading dims: one per [N, K] matrix)."""
    if tuple(scale_2.shape) != tuple(w.shape[:-2]):
        raise ValueError(f"NVFP4: weight_scale_2 of shape {list(scale_2.shape)} for a weight {list(w.shape)}")
    x = _blocks(w, NVFP4_BLOCK)
    bs, denom = nvfp4_block_scales(x, scale_2)
    denom = denom.expand_as(x)
    codes = e2m1_codes(torch.where(denom == 0, 0.0, _div(x, denom)), x < 0)
    return pack_fp4(codes.flatten(-2)[..., : w.shape[-1]]), bs


def unpack_fp4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [..., k] values of packed E2M1 bytes (the inverse of ``pack_fp4``, for checks)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[..., :k].long()
    v = table[codes & 7]
    return torch.where(codes >= 8, -v, v)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, k: int) -> torch.Tensor:
    """float32 ``q * weight_scale * weight_scale_2`` (for checks)."""
    s = scale.float().repeat_interleave(NVFP4_BLOCK, -1)[..., :k]
    return unpack_fp4(packed, k) * s * scale_2.float().reshape(*scale_2.shape, 1, 1)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * 2**(e - 127)`` blockwise (for checks)."""
    return q.float() * e8m0_value(scale).repeat_interleave(MXFP8_BLOCK, -1)[..., : q.shape[-1]]
