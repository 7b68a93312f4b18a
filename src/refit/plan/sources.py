"""Which source rank serves each piece a destination rank needs: the two sides checked compatible
(``check_compatible``), each tensor's source boxes cut into tiles that must cover it exactly, and the
choice among replicas (``choose_sources``), in order:

  1. a holder in the receiver's own process (a local copy, no link bytes), else one on the receiver's device
     (an on-device copy through CUDA IPC);
  2. for a tensor laid out identically on both sides (same box on every rank, ``canonical_tensor``), the
     receiver's counterpart: the source rank with the same number;
  3. otherwise, largest pieces first, the least-loaded holder by bytes sent so far, ties broken by a rotation
     that starts at the receiver's index among that box's receivers. The load of every forced piece (a box
     with a single holder, or one chosen by 1. or 2.) is counted before this choice starts.

``link_bytes`` is the choice alone, summed per link (what the cluster cost model needs). Plain tuples, not
objects: at cluster scale (~10^6 pieces) object creation is most of the cost.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections import defaultdict
from collections.abc import Callable

from refit.errors import PlanError
from refit.layout.tensors import Box, ModelLayout, TensorLayout, box_intersect, box_numel, box_runs_whole
from refit.plan.holders import HolderSets, merge_choices, refined_tiles
from refit.plan.procs import ProcessMap


def canonical_tensor(t: TensorLayout) -> list:
    """``[name, shape, dtype, ranks, boxes]`` (and ``row_block`` where set): every rank holding a part
    (sorted) and its box, as JSON lists; equal for equivalent layouts however described (mesh names,
    explicit boxes)."""
    lists: dict[int, list] = {}  # id(box) -> its JSON form: the ranks of one shard share a box object
    boxes = []
    for b in t._all_boxes.values():
        j = lists.get(id(b))
        if j is None:
            j = lists[id(b)] = [list(x) for x in b]
        boxes.append(j)
    out = [t.name, list(t.shape), str(t.dtype).removeprefix("torch."), list(t._all_boxes), boxes]
    if isinstance(t, HolderSets):  # several holder sets: where each starts and how it stores its rows
        return [*out, ["sets", list(t.set_starts), list(t.set_blocks)]]
    return out if t.row_block is None else [*out, t.row_block]


def check_compatible(src: ModelLayout, dst: ModelLayout) -> None:
    """Names, shapes and dtypes must agree; raises PlanError naming the first difference."""
    src_names, dst_names = set(src.names), set(dst.names)
    missing = [n for n in dst.names if n not in src_names]
    if missing:
        raise PlanError(
            f"{len(missing)} destination tensor(s) have no source, first: {missing[0]!r}"
            + (f" (others: {', '.join(missing[1:4])}{', ...' if len(missing) > 4 else ''})" if len(missing) > 1 else "")
        )
    extra = [n for n in src.names if n not in dst_names]
    if extra:
        raise PlanError(f"{len(extra)} source tensor(s) are not wanted by the destination, first: {extra[0]!r}")
    for d in dst:
        s = src[d.name]
        if s.shape != d.shape:
            raise PlanError(f"tensor {d.name!r}: source shape {list(s.shape)} != destination shape {list(d.shape)}")
        if s.dtype != d.dtype:
            raise PlanError(f"tensor {d.name!r}: source dtype {s.dtype} != destination dtype {d.dtype}")


def _source_tiles(t: TensorLayout) -> list[tuple[Box, list[int]]]:
    """Distinct source boxes with their holders, cut into the parts the holders store separately
    (``row_block``); they must tile the tensor exactly. Several holder sets: their common refinement
    (``refit.plan.holders``)."""
    if isinstance(t, HolderSets):
        return refined_tiles(t)
    tiles = sorted(t.holders().items())
    if t.row_block is not None:
        tiles = [(part, holders) for box, holders in tiles for part in t.parts(holders[0])]
    if t.boxes is not None:  # boxes from a mesh and placements are disjoint by construction
        for i, (a, _) in enumerate(tiles):
            for b, _ in tiles[i + 1 :]:
                if box_intersect(a, b) is not None:
                    raise PlanError(
                        f"tensor {t.name!r}: source boxes {list(a)} and {list(b)} overlap without being replicas"
                    )
    covered = sum(box_numel(b) for b, _ in tiles)
    if covered != t.numel:
        raise PlanError(
            f"tensor {t.name!r} {list(t.shape)}: source ranks hold {covered} of {t.numel} elements (coverage gap)"
        )
    return tiles


# (tensor, source rank, destination rank, global box, itemsize, bytes, direct): one piece before it is a
# Piece; direct: one contiguous run in both the source's and the destination's local tensor
Choice = tuple[str, int, int, Box, int, int, bool]


# a piece whose source LPT still has to choose: (its index in the choices, tensor, destination rank, box,
# holders, the receiver's index among the tile's receivers, itemsize, bytes, direct)
_Open = tuple[int, str, int, Box, list[int], int, int, int, bool]


def choose_sources(src: ModelLayout, dst: ModelLayout, procs: ProcessMap) -> list[Choice]:
    """Every piece every destination rank needs, with its source rank, in a stable order.

    Pieces whose source is forced (a single holder, one in the receiver's process or on its
    device, or the counterpart of an identically laid-out tensor) are fixed first and
    count as load before the others are chosen by LPT. Plain tuples, not Pieces: at
    cluster scale (~10^6 pieces) object creation is most of the cost.
    """
    out: list[Choice | None] = []  # in receiver order; None where LPT still has to choose
    open_: list[_Open] = []
    for d in dst:
        _tensor_choices(src[d.name], d, procs, out, open_)
    if open_:
        _choose_least_loaded(out, open_, procs)
    sets = {t.name for t in src if isinstance(t, HolderSets)}
    return merge_choices(out, src, dst, sets) if sets else out  # type: ignore[arg-type,return-value]


def _receivers(d: TensorLayout) -> tuple[list[Box], list[tuple[int, int]]]:
    """The distinct non-empty boxes of ``d`` (replicas share one), and every rank holding one, in rank
    order, with the index of its box."""
    distinct: dict[Box, int] = {}  # box -> index in dboxes, -1 for an empty box
    dboxes: list[Box] = []
    ranks_in_order: list[tuple[int, int]] = []
    for r, b in d._all_boxes.items():
        i = distinct.get(b)
        if i is None:
            i = distinct[b] = len(dboxes) if box_numel(b) > 0 else -1
            if i >= 0:
                dboxes.append(b)
        if i >= 0:
            ranks_in_order.append((r, i))
    return dboxes, ranks_in_order


def _tensor_choices(
    s: TensorLayout, d: TensorLayout, procs: ProcessMap, out: list[Choice | None], open_: list[_Open]
) -> None:
    """Append the pieces of destination tensor ``d`` to ``out``, tile by tile, receivers in rank order:
    forced sources fixed, the others ``None`` with their entry in ``open_``. Raises PlanError if a
    destination box would not be covered exactly."""
    item = d.itemsize
    dboxes, ranks_in_order = _receivers(d)
    got = [0] * len(dboxes)  # bytes each distinct box receives, summed over the tiles
    identical: bool | None = None  # same boxes on both sides: computed only when it matters
    cutter = _cutter(dboxes)
    for tile, holders in _source_tiles(s):
        cut = cutter(tile)  # once per distinct box, not per rank
        nbytes = [box_numel(c) * item if c is not None else 0 for c in cut]
        got = [a + b for a, b in zip(got, nbytes)]
        # holders hold exactly ``tile``: contiguity on both sides is a property of the cut
        direct = [c is not None and box_runs_whole(c, tile) and box_runs_whole(c, b) for c, b in zip(cut, dboxes)]
        if len(holders) == 1:
            h = holders[0]
            out += [(d.name, h, r, cut[i], item, nbytes[i], direct[i]) for r, i in ranks_in_order if nbytes[i]]
            continue
        by_proc, by_dev = _nearest_holders(holders, procs)
        k = 0  # the receiver's index among this tile's receivers
        for r, i in ranks_in_order:
            nb = nbytes[i]
            if not nb:
                continue
            near = by_proc.get(procs.dst[r])
            if near is None and by_dev:
                near = by_dev.get(procs.device_of(procs.dst[r]))
            if near is not None:
                out.append((d.name, near, r, cut[i], item, nb, direct[i]))
            elif r in holders and (
                identical if identical is not None else (identical := canonical_tensor(s) == canonical_tensor(d))
            ):
                out.append((d.name, r, r, cut[i], item, nb, direct[i]))
            else:
                open_.append((len(out), d.name, r, cut[i], holders, k, item, nb, direct[i]))
                out.append(None)
            k += 1
    for b, n in zip(dboxes, got):  # disjoint tiles covering the tensor cut every box exactly once
        if n != box_numel(b) * item:
            r = next(r for r, i in ranks_in_order if dboxes[i] == b)
            raise PlanError(
                f"tensor {d.name!r}: destination rank {r} would receive {n // item} of "
                f"{box_numel(b)} elements of box {list(b)} (coverage gap)"
            )


def _cutter(dboxes: list[Box]) -> Callable[[Box], list[Box | None]]:
    """``tile -> [box_intersect(tile, b) for b in dboxes]``. Where the boxes differ in one dim only and are
    disjoint there (a split along one dim: TP, EP), the boxes a tile meets are found by bisection instead of
    intersecting every one (at cluster scale, tens of boxes per tile and millions of tiles)."""
    n = len(dboxes)
    vary = [k for k in range(len(dboxes[0])) if any(b[k] != dboxes[0][k] for b in dboxes)] if n > 2 else []
    if len(vary) != 1:
        return lambda tile: [box_intersect(tile, b) for b in dboxes]
    k = vary[0]
    order = sorted(range(n), key=lambda i: dboxes[i][k])
    starts, ends = [dboxes[i][k][0] for i in order], [dboxes[i][k][1] for i in order]
    if any(e > s for e, s in zip(ends, starts[1:])):  # overlapping along k: the plain way
        return lambda tile: [box_intersect(tile, b) for b in dboxes]
    common, others = dboxes[0], [j for j in range(len(dboxes[0])) if j != k]

    def cut(tile: Box) -> list[Box | None]:
        out: list[Box | None] = [None] * n
        for j in others:  # the dims other than k, the same in every box
            if max(tile[j][0], common[j][0]) >= min(tile[j][1], common[j][1]):
                return out
        t0, t1 = tile[k]
        i = bisect.bisect_right(ends, t0)  # the first box ending after the tile starts: it and those after it
        while i < n and starts[i] < t1:  # that start before the tile ends meet it
            out[order[i]] = box_intersect(tile, dboxes[order[i]])
            i += 1
        return out

    return cut


def _nearest_holders(holders: list[int], procs: ProcessMap) -> tuple[dict[int, int], dict[str, int]]:
    """The first holder in each process, and (with devices) on each device: looked up, not scanned."""
    by_proc: dict[int, int] = {}
    by_dev: dict[str, int] = {}
    for h in holders:
        by_proc.setdefault(procs.src[h], h)
        if procs.devices is not None:
            by_dev.setdefault(procs.device_of(procs.src[h]), h)
    return by_proc, by_dev


def _choose_least_loaded(out: list[Choice | None], open_: list[_Open], procs: ProcessMap) -> None:
    """Fill every open choice: largest pieces first (LPT), each to the least-loaded holder by bytes sent
    over links so far (forced pieces counted first); ties go to the rotation that starts at the
    receiver's index among the tile's receivers."""
    load: dict[int, int] = defaultdict(int)
    for c in out:
        if c is not None and not procs.same_device(procs.src[c[1]], procs.dst[c[2]]):
            load[c[1]] += c[5]
    for at, name, r, piece, holders, k, item, nb, dr in sorted(open_, key=lambda x: (-x[7], x[0])):
        start = k % len(holders)
        h = min(holders[start:] + holders[:start], key=load.__getitem__)  # first of equals (defaultdict: 0 if unseen)
        load[h] += nb
        out[at] = (name, h, r, piece, item, nb, dr)


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off while the planner allocates millions of tuples that
    stay alive (at cluster scale its repeated full passes were most of the build time)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def link_bytes(src: ModelLayout, dst: ModelLayout, procs: ProcessMap | None = None) -> dict[tuple[int, int], int]:
    """Bytes per (source rank, destination rank) that ``build_plan`` would move, local copies
    included (same process: the key's two ranks share a process) — the source choice alone,
    without messages or schedule (what a cost model needs at cluster scale)."""
    procs = procs or ProcessMap.disjoint(src.world_size, dst.world_size)
    check_compatible(src, dst)
    out: dict[tuple[int, int], int] = defaultdict(int)
    with gc_paused():
        for _, h, r, _, _, nb, _ in choose_sources(src, dst, procs):
            out[(h, r)] += nb
    return dict(out)
