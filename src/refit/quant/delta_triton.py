"""One-pass delta find on CUDA (Triton): compare, compact and (optionally) update the base, reading each
version once. ``refit.quant.delta.find_changes`` is its reference and calls it on contiguous CUDA tensors.

The torch reference makes several passes (compare into a bool tensor, ``nonzero``, gather the values).
Here one program reads a block of ``BLOCK`` (2048) elements of the base and the current version as integers
(bitwise), counts its changed elements, reserves that many output slots with one atomic add on a global
counter, and writes their flat indices (int64) and new values at its reserved offset plus the exclusive
prefix sum of its changes; with ``update`` it also writes the new values into the base (the base update
of a sender, fused). Blocks reserve in the order they run, so the indices come out grouped by block in no
particular order across blocks (every consumer is order-free: ``encode``, ``apply_changes``). At most
``cap`` changes are written; the returned count says how many there were, so a caller sees an overflow.
Imports nothing of refit (tested in Triton's interpreter on CPU: ``tests/delta_interpret.py``).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # noqa: BLE001 - no Triton (CPU-only installs): the torch path is used
    AVAILABLE = False

# elements per program and its warps: 2048 x 4 found 2.02-2.15 TB/s on an H200 against 1.78-1.99 for 4096 x 8 and
# 1.10-1.24 for 8192 or more (bench/delta_find_variants.py, bench/results/h200-x2-session33/find.txt)
BLOCK = 2048
NUM_WARPS = 4

if AVAILABLE:

    @triton.jit
    def _diff_compact(
        base_ptr, cur_ptr, idx_ptr, val_ptr, count_ptr, n, start, cap, UPDATE: tl.constexpr, BLOCK: tl.constexpr
    ):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        b = tl.load(base_ptr + offs, mask=inb, other=0)
        c = tl.load(cur_ptr + offs, mask=inb, other=0)
        changed = (b != c) & inb
        ones = changed.to(tl.int32)
        first = tl.atomic_add(count_ptr, tl.sum(ones, axis=0))
        pos = (first + tl.cumsum(ones, axis=0) - ones).to(tl.int64)
        ok = changed & (pos < cap)
        tl.store(idx_ptr + pos, offs + start, mask=ok)
        tl.store(val_ptr + pos, c, mask=ok)
        if UPDATE:
            tl.store(base_ptr + offs, c, mask=changed)


def launch(
    base_bits: torch.Tensor,
    cur_bits: torch.Tensor,
    idx: torch.Tensor,
    vals: torch.Tensor,
    count: torch.Tensor,
    start: int = 0,
    update: bool = False,
) -> None:
    """Enqueue the kernel (no host sync): at most ``len(idx)`` changes of ``cur_bits`` vs ``base_bits``
    (contiguous 1-D integer views of equal length) into ``idx`` (int64, plus ``start``) and ``vals``
    (``cur_bits``' dtype); ``count`` (one int32, zeroed) receives the true number of changes."""
    n = cur_bits.numel()
    if n:
        grid = (triton.cdiv(n, BLOCK),)
        _diff_compact[grid](
            base_bits, cur_bits, idx, vals, count, n, start, len(idx), UPDATE=update, BLOCK=BLOCK, num_warps=NUM_WARPS
        )


def diff_compact(
    base_bits: torch.Tensor, cur_bits: torch.Tensor, start: int = 0, cap: int | None = None, update: bool = False
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``launch`` into fresh slots (``cap``, default every element), then one host sync. Returns
    ``(indices, values, count)``: the first ``min(count, cap)`` changed elements' flat indices (plus
    ``start``) and current bits, and the true number of changes ``count``."""
    cap = cur_bits.numel() if cap is None else cap
    idx = torch.empty(cap, dtype=torch.int64, device=cur_bits.device)
    vals = torch.empty(cap, dtype=cur_bits.dtype, device=cur_bits.device)
    count = torch.zeros(1, dtype=torch.int32, device=cur_bits.device)
    launch(base_bits, cur_bits, idx, vals, count, start, update)
    k = int(count.item())
    return idx[: min(k, cap)], vals[: min(k, cap)], k
