"""Deterministic random weights made on the device, the same in every process."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from refit.tools.verify import reference_tensor


def make_weight(
    name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    return reference_tensor(name, shape, dtype, seed, device)


def poison(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        if t.element_size() == 1:  # FP8 (0xFF is its NaN), NVFP4's packed bytes, E8M0 scales: all ones
            t.view(torch.uint8).fill_(0xFF)
        else:
            t.fill_(float("nan") if t.dtype.is_floating_point else -1)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)
