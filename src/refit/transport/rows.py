"""Strided views as evenly spaced rows of bytes: what a 2-D copy (``cudaMemcpy2DAsync``) or a pitched
kernel (the checksum and fused copy in ``refit.transport.checksum_triton``) can address with a base,
a row width and a pitch. Pure stride arithmetic; no device work."""

from __future__ import annotations

import torch


def rows_of(view: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, row_bytes, pitch_bytes) if ``view`` is evenly spaced contiguous rows, else None."""
    if view.dim() == 0:
        return None
    shape, stride = list(view.shape), list(view.stride())
    k, expect = len(shape), 1
    while k > 0 and (stride[k - 1] == expect or shape[k - 1] == 1):
        expect *= shape[k - 1]
        k -= 1
    if k == len(shape) and any(n != 1 for n in shape):
        return None  # not even the last dim is dense: no rows to copy
    head = [(n, s) for n, s in zip(shape[:k], stride[:k]) if n != 1]
    while len(head) > 1 and head[-2][1] == head[-1][0] * head[-1][1]:  # evenly spaced across dims: merge
        (n0, _), (n1, s1) = head[-2], head[-1]
        head[-2:] = [(n0 * n1, s1)]
    if len(head) > 1:
        return None
    item = view.element_size()
    if not head:
        return 1, expect * item, expect * item
    return head[0][0], expect * item, head[0][1] * item


def row_copy(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(rows, width, dst_pitch, src_pitch) in bytes if ``dst <- src`` is a copy of equal rows, else None.

    A side that is one dense run takes the other side's row width (pitch = width)."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        return None
    d, s = rows_of(dst), rows_of(src)
    if d is None or s is None:
        return None
    if d[:2] != s[:2]:
        if d[0] == 1 and s[0] * s[1] == d[1]:
            d = (s[0], s[1], s[1])
        elif s[0] == 1 and d[0] * d[1] == s[1]:
            s = (d[0], d[1], d[1])
        else:
            return None
    if d[0] == 1:  # one run: pitches are irrelevant
        return 1, d[1], d[1], d[1]
    return d[0], d[1], d[2], s[2]
