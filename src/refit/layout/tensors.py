"""Layouts: how each tensor of one side (trainer or engine) is split over ranks.

Vocabulary
----------
* ``Box``: a tuple of ``(start, stop)`` per tensor dim, in global coordinates.
* ``Mesh``: an n-d array of side-local ranks with named dims.
* ``TensorLayout``: name, global shape, dtype, mesh and one placement per mesh
  dim (``torch.distributed.tensor``'s ``Shard`` / ``Replicate``). Answers which
  box a rank holds. Several mesh dims sharding the same tensor dim nest in
  mesh-dim order, each splitting the previous one's piece with ``torch.chunk``
  semantics (ceil-sized chunks, the last ones short or empty), as DTensor does.
  A source tensor may be stored in blocks (``row_block``): every aligned run of
  ``row_block`` indices of dim 0 a rank holds lies in memory of its own (a query
  group inside Megatron's interleaved ``linear_qkv``, one expert among separate
  expert parameters); the rank's box is then the union of its ``parts``.
* ``ModelLayout``: the ordered TensorLayouts of one side and its world size.

This module knows nothing of models, transports or devices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from refit.errors import LayoutError

Box = tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- boxes


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(s)) for s in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    n = 1  # a plain loop: the planner calls this millions of times at cluster scale
    for lo, hi in box:
        n *= hi - lo
    return n


def box_intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None if it is empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo = a0 if a0 > b0 else b0
        hi = a1 if a1 < b1 else b1
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_contains(outer: Box, inner: Box) -> bool:
    """True if ``inner`` lies inside ``outer`` (same coordinates)."""
    return all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(inner, outer))


def box_relative(box: Box, origin: Box) -> Box:
    """``box`` expressed in the local coordinates of ``origin`` (which contains it)."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def box_runs_whole(box: Box, outer: Box) -> bool:
    """True if ``box`` (inside ``outer``, same coordinates) is one contiguous run of ``outer``'s
    row-major tensor: after the leading dims of extent 1, at most one partial dim, then only
    dims ``outer`` spans in full."""
    k, n = 0, len(box)
    while k < n and box[k][1] - box[k][0] == 1:
        k += 1
    for j in range(k + 1, n):
        if box[j] != outer[j]:
            return False
    return True


def box_is_contiguous(box: Box, local_shape: Sequence[int]) -> bool:
    """True if ``box`` (local coordinates) is one contiguous run of a row-major tensor."""
    return box_runs_whole(box, full_box(local_shape))


def split_box(box: Box, max_numel: int) -> list[Box]:
    """Split ``box`` into row-major ordered pieces of at most ``max_numel`` elements."""
    if max_numel < 1:
        raise LayoutError(f"max_numel must be >= 1, got {max_numel}")
    if box_numel(box) <= max_numel:
        return [box]
    # the first dim whose extent is > 1 is the one we cut along
    d = next(i for i, (a, b) in enumerate(box) if b - a > 1)
    inner = math.prod(box_shape(box[d + 1 :]))
    lo, hi = box[d]
    if inner <= max_numel:
        rows = max_numel // inner
        return [box[:d] + ((s, min(s + rows, hi)),) + box[d + 1 :] for s in range(lo, hi, rows)]
    out: list[Box] = []
    for s in range(lo, hi):
        out.extend(split_box(box[:d] + ((s, s + 1),) + box[d + 1 :], max_numel))
    return out


def chunk_range(lo: int, hi: int, n: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``n`` ``torch.chunk`` pieces of ``[lo, hi)`` (possibly empty)."""
    size = hi - lo
    step = -(-size // n) if size else 0
    a = min(lo + i * step, hi)
    return a, min(a + step, hi)


# --------------------------------------------------------------------------- mesh


@dataclass(frozen=True)
class Mesh:
    """An n-d array of side-local ranks with named dims (row-major ``ranks``)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.dim_names):
            raise LayoutError(f"mesh has {len(self.shape)} dims but {len(self.dim_names)} names {self.dim_names}")
        if any(s < 1 for s in self.shape):
            raise LayoutError(f"mesh dims must be >= 1, got shape {self.shape}")
        if math.prod(self.shape) != len(self.ranks):
            raise LayoutError(f"mesh shape {self.shape} holds {math.prod(self.shape)} ranks, got {len(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            raise LayoutError(f"mesh ranks repeat: {self.ranks}")

    @classmethod
    def from_nested(cls, nested, dim_names: Sequence[str] | None = None) -> Mesh:
        t = torch.as_tensor(nested, dtype=torch.long)
        names = tuple(dim_names) if dim_names is not None else tuple(f"d{i}" for i in range(t.dim()))
        return cls(tuple(t.shape), names, tuple(int(r) for r in t.flatten().tolist()))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def coords(self, rank: int) -> tuple[int, ...] | None:
        """The mesh coordinates of ``rank``, or None if the rank is not in the mesh."""
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            return None
        out = []
        for s in reversed(self.shape):
            out.append(flat % s)
            flat //= s
        return tuple(reversed(out))

    def to_nested(self) -> list:
        return torch.tensor(self.ranks, dtype=torch.long).reshape(self.shape).tolist()


def placement_str(p: Placement) -> str:
    if isinstance(p, Shard) and type(p) is Shard:
        return f"S{p.dim}"
    if isinstance(p, Replicate):
        return "R"
    raise LayoutError(f"unsupported placement {p!r}: only Shard(d) and Replicate() are supported")


def parse_placement(s: str) -> Placement:
    if s == "R":
        return Replicate()
    if s.startswith("S") and s[1:].isdigit():
        return Shard(int(s[1:]))
    raise LayoutError(f"cannot parse placement {s!r}: expected 'R' or 'S<dim>'")


# --------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorLayout:
    """One tensor's global shape and dtype, and the box each side-local rank holds.

    The boxes come from ``mesh`` and ``placements`` unless ``boxes`` is given
    explicitly (rank -> box), for shardings that no mesh describes.

    ``row_block`` (source layouts): each holder stores every aligned run of ``row_block``
    indices of dim 0 separately, so no piece may cross a multiple of ``row_block`` there;
    ``parts(rank)`` lists its box cut at those multiples. None: each rank's box is one tensor.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: Mesh
    placements: tuple[Placement, ...]
    boxes: Mapping[int, Box] | None = field(default=None, compare=True)
    row_block: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "placements", tuple(self.placements))
        if len(self.placements) != self.mesh.ndim:
            raise LayoutError(
                f"tensor {self.name!r}: {len(self.placements)} placements "
                f"for a {self.mesh.ndim}-d mesh {self.mesh.dim_names}"
            )
        for p in self.placements:
            placement_str(p)  # rejects unsupported kinds
            if isinstance(p, Shard) and not 0 <= p.dim < len(self.shape):
                raise LayoutError(f"tensor {self.name!r} of shape {list(self.shape)}: placement {p} is out of range")
        if self.boxes is not None:
            for r, b in self.boxes.items():
                if len(b) != len(self.shape) or any(not 0 <= lo <= hi <= n for (lo, hi), n in zip(b, self.shape)):
                    raise LayoutError(
                        f"tensor {self.name!r}: box {b} of rank {r} lies outside shape {list(self.shape)}"
                    )
            object.__setattr__(self, "boxes", dict(sorted(self.boxes.items())))
        rb = self.row_block
        if rb is not None and (isinstance(rb, bool) or not isinstance(rb, int) or rb < 1 or not self.shape):
            raise LayoutError(f"tensor {self.name!r}: row_block must be an integer >= 1 (on dim 0), not {rb!r}")

    def parts(self, rank: int) -> list[Box]:
        """The boxes ``rank`` stores as separate tensors, in order along dim 0: its box cut at every
        multiple of ``row_block`` (without ``row_block``: the box itself); empty if it holds nothing."""
        b = self.box(rank)
        if b is None or box_numel(b) == 0:
            return []
        if self.row_block is None:
            return [b]
        lo, hi = b[0]
        rb = self.row_block
        cuts = [lo, *range((lo // rb + 1) * rb, hi, rb), hi]
        return [((a, z),) + b[1:] for a, z in zip(cuts, cuts[1:])]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        return tuple(self.boxes) if self.boxes is not None else tuple(sorted(self.mesh.ranks))

    @cached_property
    def _all_boxes(self) -> dict[int, Box]:
        if self.boxes is not None:
            return dict(self.boxes)
        # (mesh dim, tensor dim) of each Shard, looked up once (isinstance on placements is slow)
        shards = [(i, p.dim) for i, p in enumerate(self.placements) if isinstance(p, Shard)]
        strides = [math.prod(self.mesh.shape[i + 1 :]) for i in range(self.mesh.ndim)]
        sizes = self.mesh.shape
        memo: dict[tuple[int, ...], Box] = {}  # ranks with the same shard coordinates share a box
        out: dict[int, Box] = {}
        for flat, r in enumerate(self.mesh.ranks):
            key = tuple((flat // strides[i]) % sizes[i] for i, _ in shards)
            box = memo.get(key)
            if box is None:
                b = [[0, int(n)] for n in self.shape]
                for (i, dim), c in zip(shards, key):
                    lo, hi = b[dim]
                    b[dim] = list(chunk_range(lo, hi, sizes[i], c))
                box = memo[key] = tuple((lo, hi) for lo, hi in b)
            out[r] = box
        return out if list(out) == sorted(out) else dict(sorted(out.items()))

    def box(self, rank: int) -> Box | None:
        """The global box ``rank`` holds (possibly empty), or None if it holds no part."""
        return self._all_boxes.get(rank)

    def local_shape(self, rank: int) -> tuple[int, ...] | None:
        b = self.box(rank)
        return None if b is None else box_shape(b)

    def holders(self) -> dict[Box, list[int]]:
        """Distinct non-empty boxes and the ranks holding each (replicas), sorted."""
        out: dict[Box, list[int]] = {}
        for r in self.ranks:
            b = self.box(r)
            if b is not None and box_numel(b) > 0:
                out.setdefault(b, []).append(r)
        return out


@dataclass(frozen=True)
class ModelLayout:
    """The ordered TensorLayouts of one side; ``world_size`` ranks numbered from 0."""

    tensors: tuple[TensorLayout, ...]
    world_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", tuple(self.tensors))
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise LayoutError(f"tensor name {t.name!r} appears twice in the layout")
            seen.add(t.name)
            bad = [r for r in t.ranks if not 0 <= r < self.world_size]
            if bad:
                raise LayoutError(f"tensor {t.name!r} places data on ranks {bad} outside 0..{self.world_size - 1}")

    def __iter__(self) -> Iterator[TensorLayout]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @cached_property
    def _by_name(self) -> dict[str, TensorLayout]:
        return {t.name: t for t in self.tensors}

    def __getitem__(self, name: str) -> TensorLayout:
        return self._by_name[name]

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def local_tensors(self, rank: int) -> Iterable[tuple[TensorLayout, Box]]:
        """The tensors ``rank`` holds a part of, with that part's box."""
        for t in self.tensors:
            b = t.box(rank)
            if b is not None:
                yield t, b

    def to_json(self) -> dict:
        """This layout as a ``refit.layout/1`` document (plain JSON data; docs/layout-json.md):
        meshes listed once and referred to by index, explicit ``boxes`` only where a tensor has them.
        ``ModelLayout.from_json(layout.to_json()) == layout``."""
        meshes: dict[Mesh, int] = {}
        tensors = []
        for t in self.tensors:
            d = {
                "name": t.name,
                "shape": list(t.shape),
                "dtype": dtype_name(t.dtype),
                "mesh": meshes.setdefault(t.mesh, len(meshes)),
                "placements": [placement_str(p) for p in t.placements],
            }
            if t.boxes is not None:
                d["boxes"] = {str(r): [list(x) for x in b] for r, b in t.boxes.items()}
            if t.row_block is not None:
                d["row_block"] = t.row_block
            tensors.append(d)
        return {
            "format": LAYOUT_FORMAT,
            "world_size": self.world_size,
            "meshes": [
                {"shape": list(m.shape), "dim_names": list(m.dim_names), "ranks": list(m.ranks)} for m in meshes
            ],
            "tensors": tensors,
        }

    @classmethod
    def from_json(cls, doc: Mapping) -> ModelLayout:
        """The layout a ``refit.layout/1`` document describes (``to_json``'s inverse). A document that
        is not one, or describes an inconsistent layout, raises ``LayoutError`` naming the tensor."""
        fmt = doc.get("format") if isinstance(doc, Mapping) else None
        if fmt != LAYOUT_FORMAT:
            raise LayoutError(f"not a {LAYOUT_FORMAT} layout document (format {fmt!r})")
        try:
            world_size = _int(doc["world_size"], "world_size")
            meshes = [_mesh_from_json(i, m) for i, m in enumerate(doc["meshes"])]
            tensors = doc["tensors"]
        except LayoutError as e:
            raise LayoutError(f"{LAYOUT_FORMAT} layout document: {e}") from e
        except (KeyError, TypeError) as e:
            raise LayoutError(f"{LAYOUT_FORMAT} layout document: missing or malformed field {e}") from e
        return cls(tuple(_tensor_from_json(i, t, meshes) for i, t in enumerate(tensors)), world_size)


LAYOUT_FORMAT = "refit.layout/1"
"""The ``format`` key of ``ModelLayout.to_json`` documents (docs/layout-json.md)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; anything that is not a torch dtype raises ``LayoutError``."""
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise LayoutError(f"unknown dtype {name!r}")
    return d


def _int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise LayoutError(f"{what} must be an integer, got {v!r}")
    return v


def _ints(values, what: str) -> tuple[int, ...]:
    return tuple(_int(v, what) for v in values)


def _mesh_from_json(i: int, d: Mapping) -> Mesh:
    """Mesh ``i`` of a ``refit.layout/1`` document."""
    try:
        shape, ranks = _ints(d["shape"], "shape"), _ints(d["ranks"], "ranks")
        return Mesh(shape, tuple(map(str, d["dim_names"])), ranks)
    except LayoutError as e:
        raise LayoutError(f"mesh {i}: {e}") from e


def _tensor_from_json(i: int, d: Mapping, meshes: Sequence[Mesh]) -> TensorLayout:
    """Tensor ``i`` of a ``refit.layout/1`` document (``TensorLayout`` checks the rest, naming it)."""
    name = d.get("name") if isinstance(d, Mapping) else None
    if not isinstance(name, str):
        raise LayoutError(f"{LAYOUT_FORMAT} layout document: tensor #{i} has no name")
    try:
        mesh = _int(d["mesh"], "mesh index")
        if not 0 <= mesh < len(meshes):
            raise LayoutError(f"mesh index {mesh} is not one of the document's {len(meshes)} meshes")
        boxes = d.get("boxes")
        if boxes is not None:
            boxes = {int(r): tuple(_ints(x, "box bound") for x in b) for r, b in boxes.items()}
        shape, dtype = _ints(d["shape"], "shape"), dtype_from_name(d["dtype"])
        placements = tuple(parse_placement(p) for p in d["placements"])
        row_block = d.get("row_block")
        if row_block is not None:
            row_block = _int(row_block, "row_block")
    except LayoutError as e:
        raise LayoutError(f"{LAYOUT_FORMAT} layout document, tensor {name!r}: {e}") from e
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LayoutError(
            f"{LAYOUT_FORMAT} layout document, tensor {name!r}: missing or malformed field ({type(e).__name__}: {e})"
        ) from e
    try:
        return TensorLayout(name, shape, dtype, meshes[mesh], placements, boxes, row_block)
    except LayoutError as e:
        raise LayoutError(f"{LAYOUT_FORMAT} layout document: {e}") from e
