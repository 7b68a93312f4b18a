"""``refit verify``: a real multi-process reshard with deterministic weights, checked bit for bit."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout import ModelLayout, box_slices
from refit.plan import Plan, ProcessMap, build_plan
from refit.quant import FP8, Fp8Quantizer, expected_fp8, fp8_layout, quantized_names, scale_name
from refit.quant.mx_layout import mx_format, mx_layout
from refit.quant.mx_quantizer import MxQuantizer, expected_mx_shards
from refit.tools.launch import World, run_local
from refit.tools.resources import check_memory, held_bytes
from refit.transfer import Receiver, Sender


def reference_tensor(
    name: str, shape: Sequence[int], dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Deterministic, never-zero values for ``name``, the same in every process on the same
    kind of device (made on ``device`` with that device's generator)."""
    g = torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) + 7919 * seed) & 0x7FFFFFFF)
    x = torch.randn(tuple(shape), generator=g, device=device, dtype=torch.float32).to(dtype)
    x[x == 0] = 1
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def reference_shards(layout: ModelLayout, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """This rank's boxes of every tensor's reference values (fresh tensors, contiguous)."""
    return {
        t.name: reference_tensor(t.name, t.shape, t.dtype, seed)[box_slices(b)].clone()
        for t, b in layout.local_tensors(rank)
    }


def holds(tensors: dict[str, torch.Tensor], layout: ModelLayout, rank: int, seed: int = 0, scale: float = 1.0) -> bool:
    """Whether ``tensors`` are this rank's reference boxes (times ``scale``), bit for bit."""
    return all(
        same_bits(tensors[t.name], reference_tensor(t.name, t.shape, t.dtype, seed)[box_slices(b)] * scale)
        for t, b in layout.local_tensors(rank)
    )


@dataclass(frozen=True)
class VerifyResult:
    """What ``verify`` found: tensors and destination ranks checked, bytes compared, every mismatching
    shard (``"tensor rank r: ..."``; empty when every byte matched) and the plan that moved them."""

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


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A destination tensor that cannot pass for received data: NaN (FP8: 0xFF, its NaN) or -1."""
    if dtype in (FP8, torch.uint8):
        return torch.full(shape, 0xFF, dtype=torch.uint8).view(dtype)
    return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype)


def _expected(plain: ModelLayout, dst: ModelLayout, rank: int, seed: int, block, quant=None) -> dict[str, torch.Tensor]:
    """What destination ``rank`` must hold: reference boxes, FP8 (MXFP8, NVFP4) ones quantized from the whole
    tensor."""
    want = {}
    if quant:
        full = {t.name: reference_tensor(t.name, t.shape, t.dtype, seed) for t in plain}
        want = expected_mx_shards(full, dst, rank, mx_format(quant))
    boxes = {t.name: b for t, b in dst.local_tensors(rank)}
    fp8 = set(quantized_names(dst)) if block else set()
    for t, box in dst.local_tensors(rank):
        if t.name in fp8:
            p = plain[t.name]
            sname = scale_name(t.name)
            q, sc = expected_fp8(reference_tensor(p.name, p.shape, p.dtype, seed), box, boxes.get(sname), block)
            want[t.name] = q
            if sname in boxes:
                want[sname] = sc
        elif t.name not in want:
            want[t.name] = reference_tensor(t.name, t.shape, t.dtype, seed)[box_slices(box)]
    return want


def _verify_worker(
    world: World,
    src: ModelLayout,
    dst: ModelLayout,
    config: TransferConfig,
    seed: int,
    dump: str | None,
    plain_src: ModelLayout | None = None,
    block: tuple[int, int] | None = None,
    quant: str | None = None,
):
    procs = ProcessMap.disjoint(src.world_size, dst.world_size)
    if world.src_rank is not None:
        if quant:  # MXFP8 / NVFP4: the trainer ranks quantize their shards (and agree on NVFP4's global scales)
            shards = reference_shards(plain_src, world.src_rank, seed)
            quantizer = MxQuantizer(src, world.src_rank, shards, mx_format(quant), group=world.trainer_group)
            Sender(src, dst, world.rank, quantizer.tensors, procs=procs, config=config, prepare=quantizer).push(1)
        elif block:  # the trainer holds bf16/fp32 shards; its quantizer sends FP8 ones
            quantizer = Fp8Quantizer(src, world.src_rank, reference_shards(plain_src, world.src_rank, seed), block)
            Sender(src, dst, world.rank, quantizer.tensors, procs=procs, config=config, prepare=quantizer).push(1)
        else:
            Sender(src, dst, world.rank, reference_shards(src, world.src_rank, seed), procs=procs, config=config).push(
                1
            )
        return None
    r = world.dst_rank
    local = {t.name: _poisoned(tuple(b - a for a, b in box), t.dtype) for t, box in dst.local_tensors(r)}
    Receiver(src, dst, world.rank, local, procs=procs, config=config).pull(1)
    mismatches, nbytes = [], 0
    expected = _expected(plain_src or src, dst, r, seed, block, quant)
    for t, box in dst.local_tensors(r):
        want = expected[t.name]
        got = local[t.name]
        nbytes += got.numel() * got.element_size()
        if not same_bits(got, want):
            bad = (got.float() != want.float()).sum().item() if got.shape == want.shape else "shape"
            mismatches.append(f"destination rank {r}: tensor {t.name!r} box {list(box)} differs ({bad} elements)")
    if dump:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in local.items()}, os.path.join(dump, f"dst_rank{r}.safetensors"))
    return mismatches, nbytes


def dump_files(n_dst: int) -> list[str]:
    """The files ``verify(dump=...)`` writes into its folder."""
    return ["full.safetensors", "layout.json", *(f"dst_rank{r}.safetensors" for r in range(n_dst))]


def check_dump(dump: str, n_dst: int) -> None:
    """``ConfigError`` unless ``dump`` is a folder (or a path to make one at, under a folder this process may
    write) holding none of ``dump_files``: verify never overwrites a file."""
    if os.path.exists(dump) and not os.path.isdir(dump):
        raise ConfigError(f"{dump!r} is a file, not a folder to write into")
    parent = os.path.abspath(dump)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write into {dump!r}: {parent!r} is not a folder this process may write")
    existing = [f for f in dump_files(n_dst) if os.path.lexists(os.path.join(dump, f))]
    if existing:
        raise ConfigError(
            f"folder {dump!r} already holds {existing[0]} ({len(existing)} of the {n_dst + 2} files verify writes); "
            "choose a new or empty folder"
        )


def verify_bytes(plain_src: ModelLayout, src: ModelLayout, dst: ModelLayout, dump: str | None) -> int:
    """A lower bound of the bytes ``verify``'s processes hold together: the trainers' shards (plain and, with
    FP8, quantized), the engines' shards twice (received and expected) and, to dump it, the whole model."""
    quantized = held_bytes(src) if src is not plain_src else 0
    return held_bytes(plain_src) + quantized + 2 * held_bytes(dst) + (plain_src.nbytes if dump else 0)


def verify(
    src: ModelLayout,
    dst: ModelLayout,
    *,
    config: TransferConfig | None = None,
    seed: int = 0,
    dump: str | None = None,
    timeout_s: float = 600.0,
    fp8_block: tuple[int, int] | None = None,
    quant: str | None = None,
) -> VerifyResult:
    """``fp8_block``: the engine holds FP8 weights (and their scales) blockwise-quantized with
    this block; the trainer's ranks quantize their shards before sending (``Fp8Quantizer``).
    ``quant``: ``"mxfp8"`` or ``"nvfp4"`` instead (``MxQuantizer``; ModelOpt's names and shapes).

    Refused with ``ConfigError`` before any process starts: a ``dump`` that would overwrite a file
    (``check_dump``), more memory than this machine has (``verify_bytes``), too many processes."""
    config = config if config is not None else TransferConfig()
    if dump:
        check_dump(dump, dst.world_size)
    plain_src = src
    if quant and fp8_block:
        raise ConfigError(f"fp8_block {fp8_block} and quant {quant!r} together: an engine holds one format")
    if quant:
        src, dst = mx_layout(src, quant), mx_layout(dst, quant, side="destination")
    if fp8_block:
        src, dst = fp8_layout(src, block=fp8_block), fp8_layout(dst, block=fp8_block, side="destination")
    plan = build_plan(src, dst, config=config)  # fails fast
    n = src.world_size + dst.world_size
    check_memory(verify_bytes(plain_src, src, dst, dump), f"verify on {n} processes")
    if dump:
        try:
            os.makedirs(dump, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot make dump folder {dump!r}: {e.strerror}") from None
        from safetensors.torch import save_file

        save_file(
            {t.name: reference_tensor(t.name, t.shape, t.dtype, seed) for t in plain_src},
            os.path.join(dump, "full.safetensors"),
        )
        with open(os.path.join(dump, "layout.json"), "w") as f:  # both sides, refit.layout/1 (docs/layout-json.md)
            json.dump({"src": src.to_json(), "dst": dst.to_json()}, f, indent=1)
    results = run_local(
        _verify_worker,
        src.world_size,
        dst.world_size,
        src,
        dst,
        config,
        seed,
        dump,
        plain_src,
        fp8_block,
        quant,
        backend="gloo",
        timeout_s=timeout_s,
    )
    mismatches: list[str] = []
    nbytes = 0
    for res in results[src.world_size :]:
        mismatches += res[0]
        nbytes += res[1]
    return VerifyResult(len(dst), dst.world_size, nbytes, mismatches, plan)
