"""``refit verify``: a real multi-process reshard with deterministic weights, checked bit for bit."""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Sequence

import torch

from refit.launch import World, run_local
from refit.layout import ModelLayout, box_slices
from refit.plan import Plan, ProcessMap, build_plan
from refit.transfer import Receiver, Sender, TransferConfig


def reference_tensor(name: str, shape: Sequence[int], dtype: torch.dtype, seed: int = 0,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """Deterministic, never-zero values for ``name``, the same in every process on the same
    kind of device (made on ``device`` with that device's generator)."""
    g = torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) + 7919 * seed) & 0x7FFFFFFF)
    x = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32).to(dtype)
    x[x == 0] = 1
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def reference_shards(layout: ModelLayout, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's boxes of every tensor's reference values (fresh tensors, contiguous)."""
    return {t.name: reference_tensor(t.name, t.shape, t.dtype, seed)[box_slices(b)].clone() for t, b in layout.local_tensors(rank)}


def holds(tensors: dict[str, torch.Tensor], layout: ModelLayout, rank: int, seed: int = 0, scale: float = 1.0) -> bool:
    """Whether ``tensors`` are this rank's reference boxes (times ``scale``), bit for bit."""
    return all(same_bits(tensors[t.name], reference_tensor(t.name, t.shape, t.dtype, seed)[box_slices(b)] * scale)
               for t, b in layout.local_tensors(rank))


@dataclass(frozen=True)
class VerifyResult:
    tensors: int
    ranks: int
    bytes_checked: int
    mismatches: list[str]
    plan: Plan

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> str:
        return (
            f"verified {self.tensors} tensors on {self.ranks} ranks, {self.bytes_checked} bytes, "
            f"moved/needed={self.plan.ratio:.2f}"
        )


def _verify_worker(world: World, src: ModelLayout, dst: ModelLayout, config: TransferConfig, seed: int, dump: str | None):
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    if world.src_rank is not None:
        local = reference_shards(src, world.src_rank, seed)
        Sender(src, dst, world.rank, local, procs=procs, config=config).push(1)
        return None
    r = world.dst_rank
    local = {}
    for t, box in dst.local_tensors(r):
        shape = tuple(b - a for a, b in box)
        local[t.name] = torch.full(shape, float("nan"), dtype=t.dtype) if t.dtype.is_floating_point else torch.full(shape, -1, dtype=t.dtype)
    Receiver(src, dst, world.rank, local, procs=procs, config=config).pull(1)
    mismatches, nbytes = [], 0
    for t, box in dst.local_tensors(r):
        want = reference_tensor(t.name, t.shape, t.dtype, seed)[box_slices(box)]
        got = local[t.name]
        nbytes += got.numel() * got.element_size()
        if not same_bits(got, want):
            bad = (got.float() != want.float()).sum().item() if got.shape == want.shape else "shape"
            mismatches.append(f"destination rank {r}: tensor {t.name!r} box {list(box)} differs ({bad} elements)")
    if dump:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in local.items()}, os.path.join(dump, f"dst_rank{r}.safetensors"))
    return mismatches, nbytes


def verify(
    src: ModelLayout,
    dst: ModelLayout,
    *,
    config: TransferConfig = TransferConfig(),
    seed: int = 0,
    dump: str | None = None,
    timeout_s: float = 600.0,
) -> VerifyResult:
    plan = build_plan(src, dst, num_buffers=config.num_buffers, buffer_bytes=config.buffer_bytes)  # fails fast
    if dump:
        os.makedirs(dump, exist_ok=True)
        from safetensors.torch import save_file

        save_file({t.name: reference_tensor(t.name, t.shape, t.dtype, seed) for t in src}, os.path.join(dump, "full.safetensors"))
        with open(os.path.join(dump, "layout.json"), "w") as f:
            json.dump({"tensors": [t.to_json() for t in dst]}, f, indent=1)
    results = run_local(_verify_worker, src.world_size, dst.world_size, src, dst, config, seed, dump, backend="gloo", timeout_s=timeout_s)
    mismatches: list[str] = []
    nbytes = 0
    for res in results[src.world_size :]:
        mismatches += res[0]
        nbytes += res[1]
    return VerifyResult(len(dst), dst.world_size, nbytes, mismatches, plan)
