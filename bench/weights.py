"""Deterministic random weights made on the device, the same in every process."""

from __future__ import annotations

import zlib
from typing import Sequence

import torch


def make_weight(name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) + 7919 * seed) & 0x7FFFFFFF)
    x = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32).to(dtype)
    x[x == 0] = 1  # never zero
    return x


def poison(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        t.fill_(float("nan") if t.dtype.is_floating_point else -1)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)
