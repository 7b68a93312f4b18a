"""FP8 block quantization of weights, as vLLM's block-FP8 engines lay them out.

A bf16/fp32 weight ``[N, K]`` becomes ``weight`` in ``float8_e4m3fn`` (same
shape) and ``weight_scale_inv`` in float32 ``[ceil(N/bn), ceil(K/bk)]`` (one
scale per 128 x 128 block by default); ``weight ~= q * scale_inv`` blockwise.
The arithmetic is that of vLLM's reference ``per_block_cast_to_fp8``: per
block ``amax = max(|x|)`` in float32, clamped below at 1e-4;
``scale_inv = amax / 448``; ``q = (x * (1 / scale_inv))`` cast to e4m3.
Partial edge blocks are quantized as if zero-padded.

Where it runs: on the sender, before the wire (docs/architecture.md says
why); this module is only the arithmetic.
"""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
AMAX_FLOOR = 1e-4


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32) of a 2-D weight."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block takes a 2-D weight, got shape {list(w.shape)}")
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ValueError(f"block sizes must be >= 1, got {block}")
    n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros((gn * bn, gk * bk), dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    scale_inv = amax / FP8_MAX
    q = (blocks * (1.0 / scale_inv)).to(FP8)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale_inv.view(gn, gk)


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float32 ``q * scale_inv`` blockwise (the inverse map, for checks)."""
    bn, bk = block
    s = scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s
