"""Layouts of MXFP8 and NVFP4 engines: which tensors are quantized, their names, shapes and boxes.

Names and shapes are those of vLLM's ModelOpt checkpoints (``modelopt_mxfp8``, ``modelopt_fp4``): a selected
weight ``X`` (``default_fp8_tensors``: linear projection weights, stacked experts included) keeps its name and
becomes ``float8_e4m3fn`` ``[..., N, K]`` (MXFP8) or ``uint8`` ``[..., N, ceil(K/2)]`` (NVFP4, two values a
byte); ``X_scale`` (``X.weight`` -> ``X.weight_scale``) holds the block scales ``[..., N, ceil(K/B)]``
(MXFP8: E8M0 ``uint8``, B = 32; NVFP4: ``float8_e4m3fn``, B = 16); NVFP4 adds ``X_scale_2`` (float32, the
shape of the leading dims: ``[]`` for a matrix, ``[E, 2]`` for stacked gate/up experts). A rank's boxes are its
weight box in those units. Blocks run along the last (reduction) dim only, so any cut of the rows is exact;
a cut of the columns must fall on a block boundary (or the tensor's end) on every rank, else the layout is
refused naming the tensor, the rank and the columns. ``X_scale_2`` goes to every rank holding part of ``X``:
the trainer ranks agree on it (``MxQuantizer.agree``) before quantizing.

NVFP4's ``weight_scale_2`` is shared where vLLM fuses (``global_key``): q/k/v of one layer, gate/up of one MLP
or one expert (vLLM takes the max of a fused layer's scales and refuses experts whose w1/w3 scales differ),
as ModelOpt's export makes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate

from refit.layout.hf_names import Role, expert_of, fused_target, param_role
from refit.layout.tensors import Box, LayoutError, ModelLayout, TensorLayout, box_numel
from refit.quant.fp8 import default_fp8_tensors
from refit.quant.mx import E8M0, FP8, MXFP8_BLOCK, NVFP4_BLOCK


@dataclass(frozen=True)
class MxFormat:
    """One block format: its name, block length along K, element and scale dtypes, whether two elements
    share a byte and whether a per-tensor ``_scale_2`` comes with it."""

    name: str
    block: int
    dtype: torch.dtype
    scale_dtype: torch.dtype
    packed: bool
    global_scale: bool


MXFP8 = MxFormat("mxfp8", MXFP8_BLOCK, FP8, E8M0, packed=False, global_scale=False)
NVFP4 = MxFormat("nvfp4", NVFP4_BLOCK, torch.uint8, FP8, packed=True, global_scale=True)
FORMATS = {f.name: f for f in (MXFP8, NVFP4)}


def mx_format(name: str) -> MxFormat:
    """The format called ``name`` (``mxfp8``, ``nvfp4``); ``LayoutError`` naming the choices otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise LayoutError(f"quant format {name!r} is not one of {', '.join(FORMATS)}") from None


def block_scale_name(name: str) -> str:
    """``X.weight`` -> ``X.weight_scale`` (ModelOpt's and vLLM's name)."""
    return name + "_scale"


def global_scale_name(name: str) -> str:
    """``X.weight`` -> ``X.weight_scale_2`` (NVFP4's per-tensor scale, ModelOpt's name)."""
    return name + "_scale_2"


def global_key(name: str) -> tuple[str, int | None]:
    """Tensors with one key share NVFP4's ``weight_scale_2``: the fused engine parameter (per expert) they land
    in, or the tensor itself."""
    target = fused_target(name)
    if target is None or param_role(name) in (Role.EXPERTS_GATE_UP, Role.EXPERTS_DOWN):
        return name, None
    return target.name, expert_of(name)


def shares_dim1(name: str) -> bool:
    """Stacked gate/up experts ``[E, 2, I, H]``: gate and up of one expert share their scale (dim 1)."""
    return param_role(name) == Role.EXPERTS_GATE_UP


def _cols(t: TensorLayout, rank: int, box: Box, fmt: MxFormat, side: str) -> tuple[int, int]:
    lo, hi = box[-1]
    k, b = t.shape[-1], fmt.block
    if box_numel(box) and (lo % b or (hi % b and hi != k)):
        raise LayoutError(
            f"{fmt.name.upper()} {side}: tensor {t.name!r} {list(t.shape)} on {side} rank {rank} holds columns "
            f"[{lo}, {hi}), not on {b}-column block boundaries; each block's scale needs the whole block on one "
            f"rank (shard the input dim on multiples of {b})"
        )
    return lo, hi


def _last(box: Box, lo: int, hi: int) -> Box:
    return box[:-1] + ((lo, hi),)


def mx_tensors(t: TensorLayout, fmt: MxFormat, side: str) -> list[TensorLayout]:
    """The weight, its block scales and (NVFP4) its global scale for one selected tensor."""
    if len(t.shape) < 2:
        raise LayoutError(f"{fmt.name.upper()}: tensor {t.name!r} {list(t.shape)} has fewer than 2 dims")
    boxes = {r: b for r in t.ranks if (b := t.box(r)) is not None}
    cols = {r: _cols(t, r, b, fmt, side) for r, b in boxes.items()}
    k, b = t.shape[-1], fmt.block
    sshape = t.shape[:-1] + (-(-k // b),)
    scales = {r: _last(box, lo // b, -(-hi // b)) for (r, box), (lo, hi) in zip(boxes.items(), cols.values())}
    if fmt.packed:
        wshape = t.shape[:-1] + (-(-k // 2),)
        wboxes = {r: _last(box, lo // 2, -(-hi // 2)) for (r, box), (lo, hi) in zip(boxes.items(), cols.values())}
        weight = TensorLayout(t.name, wshape, fmt.dtype, t.mesh, t.placements, wboxes, t.row_block)
    else:
        weight = TensorLayout(t.name, t.shape, fmt.dtype, t.mesh, t.placements, t.boxes, t.row_block)
    out = [weight, TensorLayout(block_scale_name(t.name), sshape, fmt.scale_dtype, t.mesh, t.placements, scales)]
    if fmt.global_scale:
        gboxes = {r: box[:-2] for r, box in boxes.items() if box_numel(box)}
        whole = tuple(Replicate() for _ in t.placements)  # the boxes say who holds what
        out.append(TensorLayout(global_scale_name(t.name), t.shape[:-2], torch.float32, t.mesh, whole, gboxes))
    return out


def mx_layout(
    layout: ModelLayout,
    fmt: MxFormat | str,
    *,
    select: Callable[[TensorLayout], bool] = default_fp8_tensors,
    side: str = "source",
) -> ModelLayout:
    """``layout`` with every selected tensor in ``fmt`` and its scales after it (see the module docstring)."""
    fmt = mx_format(fmt) if isinstance(fmt, str) else fmt
    out: list[TensorLayout] = []
    for t in layout:
        out += mx_tensors(t, fmt, side) if select(t) else [t]
    return ModelLayout(tuple(out), layout.world_size)


def mx_names(layout: ModelLayout, fmt: MxFormat) -> list[str]:
    """Names of the ``fmt`` weights of a layout from ``mx_layout``."""
    names = set(layout.names)
    return [
        t.name
        for t in layout
        if t.dtype == fmt.dtype
        and block_scale_name(t.name) in names
        and layout[block_scale_name(t.name)].dtype == fmt.scale_dtype
        and (global_scale_name(t.name) in names) == fmt.global_scale
    ]
