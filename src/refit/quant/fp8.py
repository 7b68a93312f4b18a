"""FP8 block quantization of weights, as vLLM's block-FP8 engines lay them out.

A bf16/fp32 weight ``[N, K]`` becomes ``weight`` in ``float8_e4m3fn`` (same
shape) and ``weight_scale_inv`` in float32 ``[ceil(N/bn), ceil(K/bk)]`` (one
scale per 128 x 128 block by default); ``weight ~= q * scale_inv`` blockwise.
The arithmetic is that of vLLM's reference ``per_block_cast_to_fp8``: per
block ``amax = max(|x|)`` in float32, clamped below at 1e-4;
``scale_inv = amax / 448``; ``q = (x * (1 / scale_inv))`` cast to e4m3 —
with both divisions correctly rounded on every device (CPU, CUDA, the Triton
kernel), so trainer and engine agree byte for byte wherever they quantize.
Partial edge blocks are quantized as if zero-padded.

Where it runs: on the sender, before the wire (docs/architecture.md says
why). ``fp8_layout`` turns a layout into its quantized form: each selected
tensor becomes ``float8_e4m3fn`` with the same boxes, and a companion
``<name>_scale_inv`` float32 tensor (one scale per block over the last two
dims; leading dims, e.g. experts, kept) whose boxes are the weight boxes in
block units. Every box must start and end on block boundaries (or at the
tensor's end): a block's scale then depends only on elements one rank holds,
so quantizing each shard gives the bytes quantizing the whole tensor gives.
``Fp8Quantizer`` holds a sender's FP8 copies and refreshes them from the
live weights before every push; the plan then moves FP8 bytes like any other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

from refit.layout.hf_names import LINEAR, STACKED_EXPERTS, Role, is_weight, param_role
from refit.layout.tensors import Box, LayoutError, ModelLayout, TensorLayout, box_shape, box_slices
from refit.quant.graphs import StepGraphs

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
AMAX_FLOOR = 1e-4


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/bn), ceil(K/bk)] float32) of a weight
    of 2 or more dims; blocks cover the last two dims, leading dims (experts) are kept."""
    if w.dim() < 2:
        raise ValueError(f"quantize_fp8_block takes a weight of 2 or more dims, got shape {list(w.shape)}")
    bn, bk = block
    if bn < 1 or bk < 1:
        raise ValueError(f"block sizes must be >= 1, got {block}")
    *lead, n, k = w.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    x = w.reshape(-1, n, k)
    if n % bn or k % bk:  # partial edge blocks: quantized as if zero-padded
        padded = torch.zeros((x.shape[0], gn * bn, gk * bk), dtype=w.dtype, device=w.device)
        padded[:, :n, :k] = x
        x = padded
    blocks = x.view(-1, gn, bn, gk, bk)
    amax = blocks.abs().float().amax(dim=(2, 4), keepdim=True).clamp(min=AMAX_FLOOR)
    # amax / 448 correctly rounded on every device: a Python-scalar divisor lets CUDA multiply by
    # fl(1/448) instead, which differs in the last bit for some blocks
    scale_inv = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks * (1.0 / scale_inv)).to(FP8).view(-1, gn * bn, gk * bk)[:, :n, :k]
    return q.reshape(*lead, n, k), scale_inv.view(*lead, gn, gk)


_TRITON: bool | None = None


def use_triton(block: tuple[int, int]) -> bool:
    """Whether CUDA quantization runs the one-pass Triton kernel (power-of-two blocks, Triton
    importable, ``REFIT_FP8_TRITON`` not ``0``); otherwise the torch expression, with a warning once."""
    global _TRITON
    if _TRITON is None:
        import os
        import warnings

        from refit.quant import fp8_triton

        _TRITON = fp8_triton.AVAILABLE and os.environ.get("REFIT_FP8_TRITON", "1") != "0"
        if not _TRITON:
            warnings.warn(
                "refit: FP8 quantization on CUDA without Triton runs the multi-pass torch expression "
                "(same bytes, several times slower)",
                stacklevel=2,
            )
    return _TRITON and all(b & (b - 1) == 0 for b in block)


def quantize_into(
    w: torch.Tensor,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    chunk_bytes: int = 512 << 20,
) -> None:
    """``quantize_fp8_block(w)`` written into ``q`` and ``scale_inv``, a chunk at a time (whole
    blocks per chunk, so the bytes are the same) to bound the temporaries to ~``chunk_bytes``."""
    if w.is_cuda and use_triton(block):  # one pass, the same bytes (fp8_triton.py)
        from refit.quant.fp8_triton import quantize_into_triton

        quantize_into_triton(w, q, scale_inv, block, FP8_MAX, AMAX_FLOOR)
        return
    *lead, n, k = w.shape
    bn, _ = block
    x, qx, sx = w.reshape(-1, n, k), q.view(-1, n, k), scale_inv.view(-1, *scale_inv.shape[-2:])
    per_item = max(1, n * k * 4)
    step = max(1, chunk_bytes // per_item)
    for b0 in range(0, x.shape[0], step):
        b1 = min(x.shape[0], b0 + step)
        if step > 1 or n * k * 4 <= chunk_bytes:
            qq, ss = quantize_fp8_block(x[b0:b1], block)
            qx[b0:b1].copy_(qq)
            sx[b0:b1].copy_(ss)
            continue
        rows = max(bn, (chunk_bytes // max(1, k * 4)) // bn * bn)  # one big matrix: whole row blocks at a time
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            qq, ss = quantize_fp8_block(x[b0, r0:r1], block)
            qx[b0, r0:r1].copy_(qq)
            sx[b0, r0 // bn : r0 // bn + ss.shape[0]].copy_(ss)


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float32 ``q * scale_inv`` blockwise (the inverse map, for checks)."""
    bn, bk = block
    s = scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


SCALE_SUFFIX = "_scale_inv"
# DeepSeek-V3's FP8 checkpoints also quantize kv_a_proj_with_mqa; refit has always sent it unquantized
# (plans and bytes stay as they were until that is changed on purpose)
FP8_ROLES = LINEAR - {Role.KV_A_PROJ}


def default_fp8_tensors(t: TensorLayout) -> bool:
    """The tensors vLLM's block-FP8 checkpoints quantize: linear projection weights (attention, MLP,
    shared and routed experts: ``hf_names.LINEAR``); not embeddings, lm_head, norms, routers or biases."""
    if not (t.dtype.is_floating_point and len(t.shape) >= 2):
        return False
    role = param_role(t.name)
    return role in FP8_ROLES and (role in STACKED_EXPERTS or is_weight(t.name))


def scale_name(name: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv`` (vLLM's name); stacked experts alike."""
    return name + SCALE_SUFFIX


def _scale_box(t: TensorLayout, rank: int, box: Box, block: tuple[int, int], side: str) -> Box:
    out = list(box[:-2])
    for (lo, hi), n, b, what in zip(box[-2:], t.shape[-2:], block, ("row", "column")):
        if lo % b or (hi % b and hi != n):
            raise LayoutError(
                f"FP8 {side}: tensor {t.name!r} {list(t.shape)} on {side} rank {rank} holds {what}s [{lo}, {hi}), "
                f"not on {b}-{what} block boundaries; each block's scale needs the whole block on one rank "
                f"(shard on multiples of {b}, or use a smaller block)"
            )
        out.append((lo // b, -(-hi // b)))
    return tuple(out)


def fp8_layout(
    layout: ModelLayout,
    *,
    block: tuple[int, int] = (128, 128),
    select: Callable[[TensorLayout], bool] = default_fp8_tensors,
    side: str = "source",
) -> ModelLayout:
    """``layout`` with every selected tensor in FP8 plus its ``_scale_inv`` companion (after it)."""
    out: list[TensorLayout] = []
    for t in layout:
        if not select(t):
            out.append(t)
            continue
        boxes = {r: b for r in t.ranks if (b := t.box(r)) is not None}
        scales = {r: _scale_box(t, r, b, block, side) for r, b in boxes.items()}
        gshape = tuple(t.shape[:-2]) + tuple(-(-n // b) for n, b in zip(t.shape[-2:], block))
        out.append(TensorLayout(t.name, t.shape, FP8, t.mesh, t.placements, t.boxes, t.row_block))
        out.append(TensorLayout(scale_name(t.name), gshape, torch.float32, t.mesh, t.placements, scales))
    return ModelLayout(tuple(out), layout.world_size)


def quantized_names(layout: ModelLayout) -> list[str]:
    """Names of the FP8 weights of a layout from ``fp8_layout``."""
    names = set(layout.names)
    return [t.name for t in layout if t.dtype == FP8 and scale_name(t.name) in names]


class Fp8Quantizer:
    """A sender's FP8 copies of its shards of the quantized tensors, refreshed per push.

    ``tensors`` is what to give the Sender (FP8 weights and scales; every other
    tensor the live one itself); call the quantizer (``Sender(..., prepare=q)``
    does, per stage with ``TransferConfig.stages``) after the optimizer step and
    before the push. Memory: this rank's
    quantized shards, about half their bf16 size, allocated once.
    """

    def __init__(
        self,
        qlayout: ModelLayout,
        rank: int,
        live: Mapping[str, torch.Tensor],
        block: tuple[int, int] = (128, 128),
        chunk_bytes: int = 512 << 20,
    ) -> None:
        self.block, self.chunk_bytes = block, chunk_bytes
        self.jobs: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.tensors: dict[str, torch.Tensor] = {}
        quantized = set(quantized_names(qlayout))
        boxes = {t.name: b for t, b in qlayout.local_tensors(rank)}
        for name in boxes:
            if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in quantized:
                continue
            if name not in live:
                raise LayoutError(f"FP8 source rank {rank}: local tensor {name!r} is missing")
            w = live[name]
            if name not in quantized:
                self.tensors[name] = w
                continue
            sbox, box = boxes[scale_name(name)], boxes[name]
            parts = list(w) if isinstance(w, (list, tuple)) else [w]
            q = torch.empty(box_shape(box), dtype=FP8, device=parts[0].device)
            s = torch.empty(box_shape(sbox), dtype=torch.float32, device=parts[0].device)
            self.tensors[name], self.tensors[scale_name(name)] = q, s
            self.jobs += _part_jobs(qlayout[name], rank, parts, q, s, block)
        on_gpu = bool(self.jobs) and all(w.is_cuda for _, w, _, _ in self.jobs) and use_triton(block)
        self.graphs = StepGraphs(on_gpu, "the FP8 quantization")

    @property
    def nbytes(self) -> int:
        return sum(q.numel() * q.element_size() + s.numel() * 4 for _, _, q, s in self.jobs)

    def pull_sources(self) -> dict[str, torch.Tensor]:
        """The live weights held whole (one part) on a GPU: a receiver on that GPU may quantize them itself
        on its pull (``refit.transport.ipc_quant``), the FP8 copy here then unused."""
        count: dict[str, int] = {}
        for name, *_ in self.jobs:
            count[name] = count.get(name, 0) + 1
        return {name: w for name, w, _, _ in self.jobs if count[name] == 1 and w.is_cuda and w.numel()}

    def __call__(self, names: set[str] | None = None) -> None:
        """Quantize the shards of ``names`` (``None``: all) from the live weights. On CUDA with the Triton
        kernel, the launches of each set of names are a CUDA graph from its second call on (``StepGraphs``)."""
        if not any(w.numel() and (names is None or name in names) for name, w, _, _ in self.jobs):
            return
        with torch.no_grad():
            self.graphs.run(None if names is None else frozenset(names), lambda: self._quantize(names))

    def _quantize(self, names: set[str] | None) -> None:
        for name, w, q, s in self.jobs:
            if w.numel() and (names is None or name in names):
                quantize_into(w, q, s, self.block, self.chunk_bytes)


def _part_jobs(t: TensorLayout, rank: int, live: list[torch.Tensor], q: torch.Tensor, s: torch.Tensor, block):
    """``(name, live part, its rows of q, its rows of s)`` per part of a source stored in parts (``row_block``;
    one part: the whole tensor). Splitting dim 0 of a 2-D weight needs each part on whole blocks of rows."""
    parts = t.parts(rank)
    if len(live) == 1:
        return [(t.name, live[0], q, s)]
    lo, out = parts[0][0][0], []
    for part, w in zip(parts, live):
        a, b = part[0]
        rows = (a - lo, b - lo)
        if len(t.shape) == 2:
            if a % block[0] or (b % block[0] and b != t.shape[0]):
                raise LayoutError(
                    f"FP8 source: tensor {t.name!r} is stored in parts of {t.row_block} rows; part [{a}, {b}) is "
                    f"not on {block[0]}-row block boundaries (use a smaller block)"
                )
            rows = (a // block[0] - lo // block[0], -(-b // block[0]) - lo // block[0])
        out.append((t.name, w, q[a - lo : b - lo], s[rows[0] : rows[1]]))
    return out


def expected_fp8(
    full: torch.Tensor, box: Box, scale_box: Box | None, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q, scale_inv) at ``box`` / ``scale_box`` of the whole tensor quantized at once (for checks)."""
    q, s = quantize_fp8_block(full, block)
    return q[box_slices(box)], (s[box_slices(scale_box)] if scale_box is not None else None)
