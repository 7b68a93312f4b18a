"""Plain-data exchange among the trainer's ranks: JSON bytes in tensors, nothing pickled."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def all_gather_json(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (JSON-serialisable), in rank order of ``group``; collective over ``group``.

    Encoded as UTF-8 JSON in a uint8 tensor (padded to the longest), gathered with ``all_gather``
    on the group's device (CPU for gloo, the current CUDA device for NCCL); ``torch.distributed``'s
    ``all_gather_object`` would unpickle what peers sent."""
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    data = json.dumps(obj, separators=(",", ":")).encode()
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(n)]
    dist.all_gather(bufs, mine, group=group)
    return [json.loads(bytes(b[: int(s.item())].cpu().tolist())) for b, s in zip(bufs, sizes)]


__all__ = ["all_gather_json"]
