"""Checksums of bytes on the device: what a receiver compares with what its sender saw."""

from __future__ import annotations

import torch


def checksum(t: torch.Tensor) -> torch.Tensor:
    """[wrapping int64 sum of the bytes as 8-byte words (and the tail bytes), byte count]: any
    changed word changes the sum. On the tensor's device; no host sync."""
    b = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
    n8 = b.numel() // 8 * 8
    words = b[:n8].view(torch.int64).sum() if n8 and b.data_ptr() % 8 == 0 else b[:n8].to(torch.int64).sum()
    tail = b[n8:].to(torch.int64).sum()
    return torch.stack([words + tail, torch.tensor(b.numel(), dtype=torch.int64, device=b.device)])
