"""One process's tensors bound to a plan: checked once, then viewed piece by piece.

``bind_local(plan, proc, src_tensors, dst_tensors)`` checks everything about this process's tensors
that could fail a refit (present, the layout's local shape and dtype, CUDA for IPC pieces, dense for
pieces that go on the wire as they lie) before any exchange, and returns a ``LocalTensors``: the
tensors with the box each one holds, from which the executor takes its views.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from refit.errors import LayoutError
from refit.layout import Box, ModelLayout, TensorLayout, box_contains, box_relative, box_shape, box_slices
from refit.plan import Plan

Part = tuple[Box, torch.Tensor]  # a global box and the tensor holding it


@dataclass(frozen=True)
class LocalTensors:
    """The tensors one process sends from (``src``) and receives into (``dst``), checked against a plan.

    Made by ``bind_local`` (which checks). A source tensor is held as its layout's ``parts``: one
    ``(box, tensor)`` each (a single part unless the layout stores it in ``row_block`` blocks); the
    boxes say which global region each tensor holds. Between refits the tensors are updated in place
    (views taken at setup stay valid).
    """

    src_rank: int | None  # this process's source rank, if any
    dst_rank: int | None  # this process's destination rank, if any
    src: Mapping[str, tuple[Part, ...]]
    dst: Mapping[str, torch.Tensor]
    dst_boxes: Mapping[str, Box]

    def src_part(self, name: str, box: Box) -> tuple[int, Part]:
        """The index and part of source tensor ``name`` that holds the global ``box`` (the plan never cuts
        a piece across parts)."""
        for i, (pbox, t) in enumerate(self.src[name]):
            if box_contains(pbox, box):
                return i, (pbox, t)
        raise LayoutError(f"source tensor {name!r}: no local part holds {[list(b) for b in box]}")

    def src_view(self, name: str, box: Box) -> torch.Tensor:
        """The part of source tensor ``name`` that holds the global ``box``."""
        _, (pbox, t) = self.src_part(name, box)
        return t[box_slices(box_relative(box, pbox))]

    def dst_view(self, name: str, box: Box) -> torch.Tensor:
        """The part of destination tensor ``name`` that holds the global ``box``."""
        return self.dst[name][box_slices(box_relative(box, self.dst_boxes[name]))]

    def with_destination(self, tensors: Mapping[str, torch.Tensor]) -> LocalTensors:
        """The same binding receiving into ``tensors`` instead: each with the checked tensor's shape,
        dtype, device and layout (a shadow made by ``torch.empty_like``); not checked again."""
        return replace(self, dst=tensors)


def _check_tensor(side: str, rank: int, t: TensorLayout, x, box: Box, what: str = "") -> None:
    """``x`` is a tensor with ``box``'s shape and the layout's dtype (``what`` names a block)."""
    name = f"{t.name!r}{what}"
    if not isinstance(x, torch.Tensor):
        raise LayoutError(f"{side} rank {rank}: local tensor {name} is a {type(x).__name__}, not a torch.Tensor")
    if tuple(x.shape) != box_shape(box):
        raise LayoutError(
            f"{side} rank {rank}: local tensor {name} has shape {list(x.shape)}, "
            f"the layout expects {list(box_shape(box))}"
        )
    if x.dtype != t.dtype:
        raise LayoutError(f"{side} rank {rank}: local tensor {name} has dtype {x.dtype}, the layout expects {t.dtype}")


def _present(side: str, rank: int, t: TensorLayout, tensors: Mapping):
    if t.name not in tensors:
        raise LayoutError(f"{side} rank {rank}: local tensor {t.name!r} is missing")
    return tensors[t.name]


def _check_sources(rank: int, layout: ModelLayout, tensors: Mapping) -> dict[str, tuple[Part, ...]]:
    """Every tensor this source rank holds exists as its parts: one tensor of the box's shape, or (a
    tensor stored in ``row_block`` blocks) one tensor per part, in order, or one tensor of the whole
    box (each part then a view of it)."""
    out: dict[str, tuple[Part, ...]] = {}
    for t, box in layout.local_tensors(rank):
        x, parts = _present("source", rank, t, tensors), t.parts(rank)
        if isinstance(x, torch.Tensor) or not parts:
            _check_tensor("source", rank, t, x, box)
            out[t.name] = tuple((p, x[box_slices(box_relative(p, box))]) for p in parts) or ((box, x),)
            continue
        xs = list(x) if isinstance(x, (list, tuple)) else None
        if xs is None or len(xs) != len(parts):
            got = f"{len(xs)} tensors" if xs is not None else type(x).__name__
            raise LayoutError(
                f"source rank {rank}: local tensor {t.name!r} is stored in {len(parts)} blocks of "
                f"{t.row_block} rows; expected a tensor or a list of {len(parts)} tensors, got {got}"
            )
        for i, (p, xi) in enumerate(zip(parts, xs)):
            _check_tensor("source", rank, t, xi, p, f" (block {i})")
        out[t.name] = tuple(zip(parts, xs))
    return out


def _check_destinations(rank: int, layout: ModelLayout, tensors: Mapping) -> dict[str, Box]:
    """Every tensor this destination rank holds exists with the layout's local shape and dtype."""
    boxes: dict[str, Box] = {}
    for t, box in layout.local_tensors(rank):
        _check_tensor("destination", rank, t, _present("destination", rank, t, tensors), box)
        boxes[t.name] = box
    return boxes


def _check_messages(plan: Plan, proc: int, local: LocalTensors) -> None:
    """IPC pieces are on CUDA; direct P2P pieces are one dense run in memory."""
    for m in plan.messages:
        for side, rank_proc, view in (
            ("source", plan.procs.src[m.src], local.src_view),
            ("destination", plan.procs.dst[m.dst], local.dst_view),
        ):
            if rank_proc != proc:
                continue
            if m.transport == "ipc":
                for p in m.pieces:
                    dev = view(p.tensor, p.box).device
                    if dev.type != "cuda":
                        raise LayoutError(f"{side} tensor {p.tensor!r} is on {dev}; CUDA IPC needs CUDA tensors")
            elif m.direct:  # sent or received as it lies: the piece must be one dense run in memory
                p = m.pieces[0]
                v = view(p.tensor, p.box)
                if not v.is_contiguous():
                    rank = m.src if side == "source" else m.dst
                    whole = local.src_part(p.tensor, p.box)[1][1] if side == "source" else local.dst[p.tensor]
                    raise LayoutError(
                        f"{side} rank {rank}: local tensor {p.tensor!r} (strides {list(whole.stride())}) "
                        f"is not laid out densely, so its piece {[list(b) for b in p.box]} cannot go on the wire "
                        "as it lies; pass contiguous tensors"
                    )


def bind_local(
    plan: Plan,
    proc: int,
    src_tensors: Mapping[str, torch.Tensor] | None,
    dst_tensors: Mapping[str, torch.Tensor] | None,
) -> LocalTensors:
    """Check this process's tensors against ``plan`` (``LayoutError`` naming side, rank, tensor and both
    values) and bind them. Run before pre-flight: a failure here is published to the peers."""
    src_rank = plan.procs.src.index(proc) if proc in plan.procs.src else None
    dst_rank = plan.procs.dst.index(proc) if proc in plan.procs.dst else None
    src = src_tensors or {}
    dst = dst_tensors or {}
    parts = _check_sources(src_rank, plan.src_layout, src) if src_rank is not None else {}
    dst_boxes = _check_destinations(dst_rank, plan.dst_layout, dst) if dst_rank is not None else {}
    local = LocalTensors(src_rank, dst_rank, parts, dst, dst_boxes)
    _check_messages(plan, proc, local)
    return local
