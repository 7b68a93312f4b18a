"""Sources held by several holder sets: one source side made of several layouts of the same tensors
(a fan-out wave's trainer ranks and the replicas that already hold the version), each covering every
tensor on its own.

``stack_holder_sets(layouts)`` builds that side: its ranks are each layout's ranks one after another,
every tensor a ``HolderSets`` (explicit boxes, plus where each set starts and how it stores its rows).
Within a set, boxes are disjoint or identical (replicas) and cover the tensor; between sets they may
overlap however the layouts differ (the trainer's FSDP rows and a replica's whole tensor, a TP=1
trainer's whole tensor and a TP=2 replica's halves). The planner then cuts the tensor into the common
refinement of every set's boxes (``refined_tiles``): each tile lies wholly inside one box of every set,
so every set holds it whole, and the choice among its holders is the usual one (least loaded by bytes
sent). Tiles one holder serves to one receiver are merged back where they make one box of that
holder's storage (``merge_choices``), so a receiver served whole by one replica gets one piece per
tensor, not one per tile.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate

from refit.errors import PlanError
from refit.layout.tensors import Box, Mesh, ModelLayout, TensorLayout, box_contains, box_numel, box_runs_whole


@dataclass(frozen=True)
class HolderSets(TensorLayout):
    """A source tensor held by several holder sets (explicit ``boxes``): set ``i`` is ranks
    ``set_starts[i]`` up to the next start; ``set_blocks[i]`` its ``row_block`` (None: one tensor per
    rank). ``parts(rank)`` cuts a rank's box by its own set's block."""

    set_starts: tuple[int, ...] = (0,)
    set_blocks: tuple[int | None, ...] = (None,)

    def __post_init__(self) -> None:
        super().__post_init__()
        starts = self.set_starts
        if not starts or starts[0] != 0 or list(starts) != sorted(set(starts)) or len(starts) != len(self.set_blocks):
            raise PlanError(
                f"tensor {self.name!r}: holder sets start at {list(starts)} with blocks {list(self.set_blocks)}; "
                "starts must ascend from 0, one block per set"
            )

    def set_of(self, rank: int) -> int:
        """The index of the holder set ``rank`` belongs to."""
        return bisect.bisect_right(self.set_starts, rank) - 1

    def parts(self, rank: int) -> list[Box]:
        b = self.box(rank)
        if b is None or box_numel(b) == 0:
            return []
        return cut_rows(b, self.set_blocks[self.set_of(rank)])


def cut_rows(box: Box, block: int | None) -> list[Box]:
    """``box`` cut at every multiple of ``block`` on dim 0 (itself without a block)."""
    if block is None:
        return [box]
    lo, hi = box[0]
    cuts = [lo, *range((lo // block + 1) * block, hi, block), hi]
    return [((a, z),) + box[1:] for a, z in zip(cuts, cuts[1:])]


def stack_holder_sets(layouts: Sequence[ModelLayout]) -> ModelLayout:
    """One source side whose ranks are ``layouts``' ranks one after another, each rank holding what it
    holds there; each layout is one holder set (``HolderSets``). Every layout must have the same tensors
    (names, shapes, dtypes: ``PlanError`` naming the first that differs)."""
    first = layouts[0]
    starts, base = [], 0
    for layout in layouts:
        starts.append(base)
        base += layout.world_size
        if layout.names != first.names:
            raise PlanError(
                f"holder set {len(starts) - 1} has tensors {layout.names[:3]}..., set 0 has {first.names[:3]}..."
            )
    out = []
    for t in first:
        boxes: dict[int, Box] = {}
        for layout, start in zip(layouts, starts):
            lt = layout[t.name]
            if (lt.shape, lt.dtype) != (t.shape, t.dtype):
                raise PlanError(
                    f"tensor {t.name!r}: holder set {starts.index(start)} has shape {list(lt.shape)} {lt.dtype}, "
                    f"set 0 {list(t.shape)} {t.dtype}"
                )
            boxes.update({start + r: b for r, b in lt._all_boxes.items()})
        blocks = tuple(layout[t.name].row_block for layout in layouts)
        mesh = Mesh((base,), ("r",), tuple(range(base)))
        out.append(HolderSets(t.name, t.shape, t.dtype, mesh, (Replicate(),), boxes, None, tuple(starts), blocks))
    return ModelLayout(tuple(out), base)


def _set_tiles(t: HolderSets, i: int) -> tuple[list[tuple[Box, list[int]]], int | None]:
    """Holder set ``i``'s distinct boxes with their holders, checked disjoint and covering the tensor."""
    lo = t.set_starts[i]
    hi = t.set_starts[i + 1] if i + 1 < len(t.set_starts) else None
    held: dict[Box, list[int]] = {}
    for r, b in t._all_boxes.items():
        if r >= lo and (hi is None or r < hi) and box_numel(b) > 0:
            held.setdefault(b, []).append(r)
    tiles = sorted(held.items())
    for j, (a, _) in enumerate(tiles):
        for b, _ in tiles[j + 1 :]:
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b)):
                raise PlanError(
                    f"tensor {t.name!r}: in holder set {i} (ranks from {lo}) boxes {list(a)} and {list(b)} "
                    "overlap without being replicas"
                )
    covered = sum(box_numel(b) for b, _ in tiles)
    if covered != t.numel:
        raise PlanError(
            f"tensor {t.name!r} {list(t.shape)}: holder set {i} (ranks from {lo}) holds {covered} of "
            f"{t.numel} elements (coverage gap)"
        )
    return tiles, t.set_blocks[i]


def refined_tiles(t: HolderSets) -> list[tuple[Box, list[int]]]:
    """The tensor cut into tiles each lying wholly inside one box (and one stored part) of every holder
    set, with every rank holding it, set by set; each set is checked first (``PlanError``: overlapping
    boxes within a set, a set that does not cover the tensor). Sets with the same boxes and blocks add
    holders, not cuts."""
    sets = [_set_tiles(t, i) for i in range(len(t.set_starts))]
    cuts: list[set[int]] = [set() for _ in t.shape]
    for tiles, block in sets:
        for box, _ in tiles:
            for d, (lo, hi) in enumerate(box):
                cuts[d].update((lo, hi))
            if block is not None:
                cuts[0].update(p[0][0] for p in cut_rows(box, block))
    axes = [sorted(c) for c in cuts]
    index = [{v: k for k, v in enumerate(a)} for a in axes]
    holders: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for tiles, _ in sets:
        for box, ranks in tiles:
            spans = [range(index[d][lo], index[d][hi]) for d, (lo, hi) in enumerate(box)]
            for key in itertools.product(*spans):
                holders[key].extend(ranks)
    out = [(tuple((axes[d][k], axes[d][k + 1]) for d, k in enumerate(key)), hs) for key, hs in holders.items()]
    return sorted(out)


# (tensor, source rank, destination rank, global box, itemsize, bytes, direct): ``sources.Choice``
_Choice = tuple[str, int, int, Box, int, int, bool]


def merge_choices(choices: list[_Choice], src: ModelLayout, dst: ModelLayout, names: set[str]) -> list[_Choice]:
    """``choices`` with the pieces of tensors ``names`` that one source rank serves to one destination
    rank merged into one piece where together they make one box inside one part that rank stores; order
    kept (a merged piece stands where its first tile stood). Every piece of ``names`` gets its direct flag
    from the part its source rank stores (a tile may be smaller than the box of the rank serving it)."""
    groups: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    for i, c in enumerate(choices):
        if c[0] in names:
            groups[c[0], c[1], c[2]].append(i)
    drop: set[int] = set()
    fixed: dict[int, _Choice] = {}
    parts: dict[tuple[str, int], list[Box]] = {}  # what each source rank stores of a tensor, looked up once
    for (name, h, r), at in groups.items():
        held = parts.get((name, h))
        if held is None:
            held = parts[name, h] = src[name].parts(h)
        if len(at) == 1:  # most groups: one tile, its own bounding box
            bbox = choices[at[0]][3]
        else:
            cols = list(zip(*(choices[i][3] for i in at)))  # per dim, every tile's (lo, hi)
            bbox = tuple((min(lo for lo, _ in c), max(hi for _, hi in c)) for c in cols)
        part = next((p for p in held if box_contains(p, bbox)), None)
        if part is not None and (len(at) == 1 or sum(box_numel(choices[i][3]) for i in at) == box_numel(bbox)):
            fixed[at[0]] = _with_box(choices[at[0]], bbox, part, dst[name].box(r))
            drop.update(at[1:])
            continue
        for i in at:  # not one box: the tiles stay as they are
            box = choices[i][3]
            part = next(p for p in held if box_contains(p, box))
            fixed[i] = _with_box(choices[i], box, part, dst[name].box(r))
    return [fixed.get(i, c) for i, c in enumerate(choices) if i not in drop]


def _with_box(c: _Choice, box: Box, part: Box, dbox: Box) -> _Choice:
    """Choice ``c`` for ``box``, direct where it is one run of the source's ``part`` and the destination's box."""
    return (c[0], c[1], c[2], box, c[4], box_numel(box) * c[4], box_runs_whole(box, part) and box_runs_whole(box, dbox))
