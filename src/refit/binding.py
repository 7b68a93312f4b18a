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
from refit.layout import Box, ModelLayout, box_relative, box_shape, box_slices
from refit.plan import Plan


@dataclass(frozen=True)
class LocalTensors:
    """The tensors one process sends from (``src``) and receives into (``dst``), checked against a plan.

    Made by ``bind_local`` (which checks); the boxes say which global region each tensor holds.
    Between refits the tensors are updated in place (views taken at setup stay valid).
    """

    src_rank: int | None  # this process's source rank, if any
    dst_rank: int | None  # this process's destination rank, if any
    src: Mapping[str, torch.Tensor]
    dst: Mapping[str, torch.Tensor]
    src_boxes: Mapping[str, Box]
    dst_boxes: Mapping[str, Box]

    def src_view(self, name: str, box: Box) -> torch.Tensor:
        """The part of source tensor ``name`` that holds the global ``box``."""
        return self.src[name][box_slices(box_relative(box, self.src_boxes[name]))]

    def dst_view(self, name: str, box: Box) -> torch.Tensor:
        """The part of destination tensor ``name`` that holds the global ``box``."""
        return self.dst[name][box_slices(box_relative(box, self.dst_boxes[name]))]

    def with_destination(self, tensors: Mapping[str, torch.Tensor]) -> LocalTensors:
        """The same binding receiving into ``tensors`` instead: each with the checked tensor's shape,
        dtype, device and layout (a shadow made by ``torch.empty_like``); not checked again."""
        return replace(self, dst=tensors)


def _check_local(side: str, rank: int, layout: ModelLayout, tensors: Mapping[str, torch.Tensor]) -> dict[str, Box]:
    """Every tensor this rank holds exists with the layout's local shape and dtype."""
    boxes: dict[str, Box] = {}
    for t, box in layout.local_tensors(rank):
        if t.name not in tensors:
            raise LayoutError(f"{side} rank {rank}: local tensor {t.name!r} is missing")
        x = tensors[t.name]
        if tuple(x.shape) != box_shape(box):
            raise LayoutError(
                f"{side} rank {rank}: local tensor {t.name!r} has shape {list(x.shape)}, "
                f"the layout expects {list(box_shape(box))}"
            )
        if x.dtype != t.dtype:
            raise LayoutError(
                f"{side} rank {rank}: local tensor {t.name!r} has dtype {x.dtype}, the layout expects {t.dtype}"
            )
        boxes[t.name] = box
    return boxes


def _check_messages(
    plan: Plan,
    proc: int,
    src_tensors: Mapping[str, torch.Tensor] | None,
    dst_tensors: Mapping[str, torch.Tensor] | None,
) -> None:
    """IPC pieces are on CUDA; direct P2P pieces are one dense run in memory."""
    for m in plan.messages:
        for side, rank, rank_proc, tensors, layout in (
            ("source", m.src, plan.procs.src[m.src], src_tensors, plan.src_layout),
            ("destination", m.dst, plan.procs.dst[m.dst], dst_tensors, plan.dst_layout),
        ):
            if rank_proc != proc:
                continue
            if m.transport == "ipc":
                for p in m.pieces:
                    dev = tensors[p.tensor].device
                    if dev.type != "cuda":
                        raise LayoutError(f"{side} tensor {p.tensor!r} is on {dev}; CUDA IPC needs CUDA tensors")
            elif m.direct:  # sent or received as it lies: the piece must be one dense run in memory
                p = m.pieces[0]
                view = tensors[p.tensor][box_slices(box_relative(p.box, layout[p.tensor].box(rank)))]
                if not view.is_contiguous():
                    raise LayoutError(
                        f"{side} rank {rank}: local tensor {p.tensor!r} (strides {list(tensors[p.tensor].stride())}) "
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
    src_boxes = _check_local("source", src_rank, plan.src_layout, src) if src_rank is not None else {}
    dst_boxes = _check_local("destination", dst_rank, plan.dst_layout, dst) if dst_rank is not None else {}
    _check_messages(plan, proc, src_tensors, dst_tensors)
    return LocalTensors(src_rank, dst_rank, src, dst, src_boxes, dst_boxes)
