"""One-pass FP8 block quantization on CUDA (Triton), byte-identical to ``quant.quantize_fp8_block``.

The torch expression in ``refit.quant.fp8`` makes ~8 passes over fp32 temporaries
(abs, cast, amax, scale, multiply, cast): 388 ms for Qwen3-30B-A3B's 57 GB on
an H200. Here one program reads one ``bn x bk`` block once (bf16/fp16/fp32),
and writes its e4m3 bytes and its scale: one read of the weight and a write
of half its size. The arithmetic is the same IEEE operations in the same
order: ``amax`` of ``|x|`` in fp32 (exact), ``max(amax, 1e-4)``,
``scale_inv = amax / 448`` and ``inv = 1 / scale_inv`` correctly rounded
(``div_rn``; Triton's ``/`` is approximate), ``x * inv`` in fp32, then
round-to-nearest-even to e4m3 (values stay within +-448). Partial edge blocks
read zeros outside the tensor, as the zero-padding of the torch version.
Tested against the torch path on the GPU machine (``tests/test_gpu.py``) and
checked on every refit of ``refit bench --fp8``.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    AVAILABLE = True
except Exception:  # noqa: BLE001 - no Triton (CPU-only installs): the torch path is used
    AVAILABLE = False


if AVAILABLE:

    @triton.jit
    def _quant_block(
        x_ptr,
        q_ptr,
        s_ptr,
        n,
        k,
        gn,
        gk,
        sxb,
        sxn,
        sxk,
        sqb,
        sqn,
        sqk,
        ssb,
        ssn,
        ssk,
        BN: tl.constexpr,
        BK: tl.constexpr,
        AMAX_FLOOR: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        pid = tl.program_id(0)
        per = gn * gk
        b = pid // per
        i = (pid % per) // gk
        j = pid % gk
        rows = i * BN + tl.arange(0, BN)
        cols = j * BK + tl.arange(0, BK)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        b64 = b.to(tl.int64)
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        x = tl.load(x_ptr + b64 * sxb + r64[:, None] * sxn + c64[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        amax = tl.maximum(amax, AMAX_FLOOR)
        scale_inv = libdevice.div_rn(amax, FP8_MAX)
        inv = libdevice.div_rn(1.0, scale_inv)
        q = (x * inv).to(tl.float8e4nv)
        tl.store(q_ptr + b64 * sqb + r64[:, None] * sqn + c64[None, :] * sqk, q, mask=mask)
        tl.store(s_ptr + b64 * ssb + i.to(tl.int64) * ssn + j.to(tl.int64) * ssk, scale_inv)


def quantize_into_triton(
    w: torch.Tensor,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    fp8_max: float,
    amax_floor: float,
) -> None:
    """``fp8.quantize_into`` in one kernel launch: ``w`` [..., N, K] on CUDA into ``q`` / ``scale_inv``
    (``fp8_max``, ``amax_floor``: fp8.FP8_MAX and fp8.AMAX_FLOOR, passed in: this module imports nothing of refit)."""

    *lead, n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    x, qx, sx = w.reshape(-1, n, k), q.view(-1, n, k), scale_inv.view(-1, gn, gk)
    grid = (x.shape[0] * gn * gk,)
    if grid[0] == 0:
        return
    _quant_block[grid](
        x,
        qx,
        sx,
        n,
        k,
        gn,
        gk,
        *x.stride(),
        *qx.stride(),
        *sx.stride(),
        BN=bn,
        BK=bk,
        AMAX_FLOOR=amax_floor,
        FP8_MAX=float(fp8_max),
        num_warps=num_warps(),
    )


def num_warps() -> int:
    """Warps per block program: 4 (on an H200 the quantization of Llama-3.1-8B's linear weights took 6.42 ms
    beside the copy of the rest, against 6.62 ms with 8 and 6.73 ms with 16: ``bench/s2_parts.py``), or
    ``REFIT_FP8_KERNEL`` (a power of two) to measure another shape."""
    env = os.environ.get("REFIT_FP8_KERNEL")
    if not env:
        return 4
    if not env.isdigit() or int(env) < 1 or int(env) & (int(env) - 1):
        raise ValueError(f"REFIT_FP8_KERNEL must be a power of two (warps per program), got {env!r}")
    return int(env)
