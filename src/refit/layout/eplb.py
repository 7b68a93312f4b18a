"""Expert-parallel load balancing (EPLB): engine layouts whose MoE layers hold physical expert slots, as data.

An EPLB engine (vLLM's ``vllm/distributed/eplb/``; SGLang's is alike) holds, per MoE layer, ``P = E + R``
*physical* expert slots for ``E`` logical experts (``R = num_redundant_experts``); EP rank ``c`` of ``ep`` holds the
contiguous slots ``[c * P / ep, (c + 1) * P / ep)``, slot ``s`` holding logical expert ``physical_to_logical[l][s]``
of MoE layer ``l`` (vLLM's ``EplbModelState.physical_to_logical_map``, shape ``[num_moe_layers, P]``, one row per
MoE layer in layer order). A hot expert has several slots (replicas, on different ranks or on one), so an engine
rank's expert tensor is no box of the logical ``[E, ...]`` tensor.

refit models that by giving every physical slot a tensor of its own, on both sides: the stacked expert tensor ``T``
(``[E, 2, I, H]`` or ``[E, H, I]``, ``models.param_shapes``) becomes, for each slot ``s`` holding expert ``e``,
``T[slot s: expert e]`` of shape ``[1, ...]``: held on the engine by the ranks of slot ``s``'s EP coordinate (each with
its own expert-TP share of the other dims) and on the trainer by the ranks whose box of ``T`` holds row ``e``
(any trainer layout: ep, tp, fsdp, pp, Megatron's per-expert parts). The planner then delivers every slot exactly once
per rank holding it, replicas included; the names carry the map, so the plan's digest does too. Every other tensor is
unchanged. ``EplbLayouts.src_tensors`` / ``dst_tensors`` turn the trainer's logical tensors and the engine's physical
ones (``[P / ep, ...]`` per rank) into the slot views the plan moves: nothing is copied.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import Shard

from refit.errors import LayoutError
from refit.jsonio import read_json
from refit.layout.hf_names import STACKED_EXPERTS, layer_of, param_role
from refit.layout.tensors import Box, ModelLayout, TensorLayout, box_numel, box_shape

MAX_PHYSICAL_EXPERTS = 1 << 16
"""The most physical slots one MoE layer of an expert map may have (vLLM caps redundancy at 1023)."""

MAP_KEYS = ("physical_to_logical", "num_redundant_experts", "num_logical_experts")
"""The fields of an expert-map JSON document (``docs/concepts/layouts.md``); only the first is required."""


def _count(value: Any, what: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise LayoutError(f"{what} must be an integer >= {least}, got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class ExpertMap:
    """Which logical expert each physical slot of each MoE layer holds: ``physical_to_logical[l][s]`` (vLLM's
    ``physical_to_logical_map``). Checked here for shape and values; against a model by ``eplb_layouts``.
    ``num_redundant`` / ``num_logical``: where given, the counts the map must have (``P - E`` and ``E``)."""

    physical_to_logical: tuple[tuple[int, ...], ...]
    num_redundant: int | None = None
    num_logical: int | None = None

    def __post_init__(self) -> None:
        rows = self.physical_to_logical
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        if not isinstance(rows, (list, tuple)) or not rows:
            raise LayoutError(f"expert map: physical_to_logical must be a non-empty list of rows, got {_short(rows)}")
        table = tuple(self._row(i, r) for i, r in enumerate(rows))
        width = len(table[0])
        for i, r in enumerate(table):
            if len(r) != width:
                raise LayoutError(f"expert map: row {i} has {len(r)} physical slots, row 0 has {width}")
        object.__setattr__(self, "physical_to_logical", table)
        if self.num_redundant is not None:
            _count(self.num_redundant, "expert map: num_redundant_experts")
        if self.num_logical is not None:
            _count(self.num_logical, "expert map: num_logical_experts", 1)

    @staticmethod
    def _row(i: int, row: Any) -> tuple[int, ...]:
        if not isinstance(row, (list, tuple)) or not row:
            raise LayoutError(f"expert map: row {i} must be a non-empty list of expert ids, got {_short(row)}")
        if len(row) > MAX_PHYSICAL_EXPERTS:
            raise LayoutError(f"expert map: row {i} has {len(row):,} slots, over the limit of {MAX_PHYSICAL_EXPERTS:,}")
        return tuple(_count(e, f"expert map: row {i} slot {s}") for s, e in enumerate(row))

    @property
    def num_layers(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical[0])

    @cached_property
    def digest(self) -> str:
        """16 hex digits of SHA-256 over the table: what both sides of a refit must agree on."""
        return hashlib.sha256(json.dumps(self.physical_to_logical, separators=(",", ":")).encode()).hexdigest()[:16]

    def logical_to_physical(self, layer: int) -> list[list[int]]:
        """The slots of each logical expert of MoE layer ``layer`` (vLLM's ``logical_to_physical_map`` without its
        ``-1`` padding); ``logical_replica_count`` is the length of each list."""
        row = self.physical_to_logical[layer]
        out: list[list[int]] = [[] for _ in range(max(row) + 1)]
        for s, e in enumerate(row):
            out[e].append(s)
        return out

    def check(self, num_logical: int, num_layers: int, ep: int) -> None:
        """``LayoutError`` unless the map fits a model of ``num_logical`` experts in ``num_layers`` MoE layers on
        ``ep`` EP ranks: one row per layer, ``ep`` divides the slots, every id below ``num_logical`` and every expert
        in every row, and the counts the map states agree."""
        p = self.num_physical
        if self.num_layers != num_layers:
            raise LayoutError(f"expert map has {self.num_layers} rows; the model has {num_layers} MoE layers")
        if self.num_logical is not None and self.num_logical != num_logical:
            raise LayoutError(f"expert map: num_logical_experts={self.num_logical}; the model has {num_logical}")
        if self.num_redundant is not None and p - num_logical != self.num_redundant:
            raise LayoutError(
                f"expert map: {p} physical slots for {num_logical} experts make {p - num_logical} redundant ones, "
                f"num_redundant_experts says {self.num_redundant}"
            )
        if p % ep:
            raise LayoutError(f"expert map: ep={ep} must divide its {p} physical slots (each EP rank holds P / ep)")
        for i, row in enumerate(self.physical_to_logical):
            bad = next((s for s, e in enumerate(row) if e >= num_logical), None)
            if bad is not None:
                raise LayoutError(
                    f"expert map: row {i} slot {bad} holds expert {row[bad]}; the model has experts 0-{num_logical - 1}"
                )
            missing = sorted(set(range(num_logical)) - set(row))
            if missing:
                raise LayoutError(f"expert map: row {i} holds no slot of expert {missing[0]} ({len(missing)} missing)")

    def to_json(self) -> dict:
        doc: dict = {"physical_to_logical": [list(r) for r in self.physical_to_logical]}
        if self.num_redundant is not None:
            doc["num_redundant_experts"] = self.num_redundant
        if self.num_logical is not None:
            doc["num_logical_experts"] = self.num_logical
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> ExpertMap:
        """The map a JSON object holds (``MAP_KEYS``; unknown keys refused, naming them)."""
        if not isinstance(doc, Mapping):
            raise LayoutError(f"expert map must be a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(MAP_KEYS))
        if unknown:
            raise LayoutError(f"expert map: unknown field {unknown[0]!r}; known: {', '.join(MAP_KEYS)}")
        if "physical_to_logical" not in doc:
            raise LayoutError("expert map has no 'physical_to_logical' field ([MoE layers][physical slots])")
        return cls(doc["physical_to_logical"], doc.get("num_redundant_experts"), doc.get("num_logical_experts"))

    @classmethod
    def read(cls, path: str) -> ExpertMap:
        """The map in JSON file ``path`` (bounded in size and depth by ``jsonio``), errors naming the file."""
        try:
            return cls.from_json(read_json(path, "expert map", LayoutError))
        except LayoutError as e:
            msg = str(e)
            raise LayoutError(msg if repr(str(path)) in msg else f"{path!r}: {msg}") from None


class ExpertSlot(NamedTuple):
    """Physical slot ``slot`` of stacked expert tensor ``base`` (MoE layer ``layer``) holds logical ``expert``."""

    base: str
    layer: int
    slot: int
    expert: int


def slot_name(base: str, slot: int, expert: int) -> str:
    """The tensor of one physical slot: ``model.layers.0.mlp.experts.down_proj[slot 5: expert 3]``."""
    return f"{base}[slot {slot}: expert {expert}]"


def moe_layers(layout: ModelLayout) -> list[list[TensorLayout]]:
    """The stacked expert tensors of ``layout`` grouped by decoder layer, in layer order (the map's rows)."""
    by_layer: dict[int, list[TensorLayout]] = {}
    for t in layout:
        if param_role(t.name) in STACKED_EXPERTS and len(t.shape) >= 3:
            by_layer.setdefault(layer_of(t.name) or 0, []).append(t)
    return [by_layer[i] for i in sorted(by_layer)]


def ep_of(t: TensorLayout) -> tuple[int, int | None]:
    """The EP degree of destination tensor ``t`` and the index of its ``ep`` mesh dim (None: not split by ep)."""
    names = t.mesh.dim_names
    if "ep" in names:
        axis = names.index("ep")
        if t.placements[axis] == Shard(0):
            return t.mesh.shape[axis], axis
    return 1, None


@dataclass(frozen=True)
class EplbLayouts:
    """Both sides' layouts under one expert map (``eplb_layouts``): ``src`` and ``dst`` with one tensor per physical
    slot (``slots``: slot tensor name -> ``ExpertSlot``); ``base_src`` / ``base_dst``: the logical layouts."""

    src: ModelLayout
    dst: ModelLayout
    slots: Mapping[str, ExpertSlot]
    expert_map: ExpertMap
    base_src: ModelLayout
    base_dst: ModelLayout

    def physical_shape(self, base: str, rank: int) -> tuple[int, ...] | None:
        """The shape of the engine's expert tensor ``base`` on destination ``rank``: ``[P / ep, ...]`` with the
        rank's expert-TP share of the other dims (None: the rank holds none of it)."""
        t = self.base_dst[base]
        box = t.box(rank)
        if box is None:
            return None
        return (self.expert_map.num_physical // ep_of(t)[0], *box_shape(box)[1:])

    def dst_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        """What destination ``rank`` allocates: physical expert tensors, every other tensor's box."""
        stacked = {t.name for layer in moe_layers(self.base_dst) for t in layer}
        return {
            t.name: self.physical_shape(t.name, rank) if t.name in stacked else box_shape(b)
            for t, b in self.base_dst.local_tensors(rank)
        }

    def src_tensors(self, rank: int, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Source ``rank``'s tensors for the plan: each stacked expert tensor (its box, or Megatron's list of
        per-expert parts) replaced by views of the rows its slot tensors need."""
        out = {n: x for n, x in tensors.items() if n not in self._stacked}
        for t, _ in self.src.local_tensors(rank):
            slot = self.slots.get(t.name)
            if slot is not None:
                out[t.name] = self._src_row(rank, slot, tensors)
        return out

    def dst_tensors(self, rank: int, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Destination ``rank``'s tensors for the plan: each physical expert tensor (``physical_shape``) replaced
        by one view per slot it holds; ``LayoutError`` naming the rank, tensor and shapes if one is not that."""
        out = {n: x for n, x in tensors.items() if n not in self._stacked}
        for t, _ in self.dst.local_tensors(rank):
            slot = self.slots.get(t.name)
            if slot is None:
                continue
            x = _present("destination", rank, slot.base, tensors)
            want = self.physical_shape(slot.base, rank)
            if tuple(x.shape) != want:
                raise LayoutError(
                    f"destination rank {rank}: physical expert tensor {slot.base!r} has shape {list(x.shape)}, "
                    f"expected {list(want)} ({self.expert_map.num_physical} slots over "
                    f"ep={ep_of(self.base_dst[slot.base])[0]})"
                )
            j = slot.slot % want[0]
            out[t.name] = x[j : j + 1]
        return out

    @cached_property
    def _stacked(self) -> frozenset[str]:
        return frozenset(s.base for s in self.slots.values())

    def _src_row(self, rank: int, slot: ExpertSlot, tensors: Mapping[str, Any]) -> torch.Tensor:
        t = self.base_src[slot.base]
        x = _present("source", rank, slot.base, tensors)
        parts = t.parts(rank)
        xs = list(x) if isinstance(x, (list, tuple)) else None
        if xs is None:
            parts, xs = [t.box(rank)], [x]
        if len(xs) != len(parts):
            raise LayoutError(
                f"source rank {rank}: local tensor {slot.base!r} is stored in {len(parts)} blocks, "
                f"got {len(xs)} tensors"
            )
        for part, xi in zip(parts, xs):
            lo, hi = part[0]
            if lo <= slot.expert < hi:
                if not isinstance(xi, torch.Tensor) or tuple(xi.shape) != box_shape(part):
                    got = list(xi.shape) if isinstance(xi, torch.Tensor) else type(xi).__name__
                    raise LayoutError(
                        f"source rank {rank}: local tensor {slot.base!r} is {got}, the layout expects "
                        f"{list(box_shape(part))}"
                    )
                return xi[slot.expert - lo : slot.expert - lo + 1]
        raise LayoutError(f"source rank {rank}: local tensor {slot.base!r} holds no row of expert {slot.expert}")


def _present(side: str, rank: int, name: str, tensors: Mapping[str, Any]) -> Any:
    if name not in tensors:
        raise LayoutError(f"{side} rank {rank}: local tensor {name!r} is missing")
    return tensors[name]


def eplb_layouts(src: ModelLayout, dst: ModelLayout, expert_map: ExpertMap) -> EplbLayouts:
    """Trainer layout ``src`` and engine layout ``dst`` (logical, e.g. ``engines.engine_layout``) with every stacked
    expert tensor replaced by one tensor per physical slot of ``expert_map`` (module docstring). ``LayoutError`` if
    the map does not fit the model (``ExpertMap.check``) or the model has no stacked experts."""
    layers = moe_layers(dst)
    if not layers:
        raise LayoutError("an expert map needs a MoE model: the destination layout has no stacked expert tensors")
    first = layers[0][0]
    expert_map.check(first.shape[0], len(layers), ep_of(first)[0])
    slots: dict[str, ExpertSlot] = {}
    src_out: dict[str, TensorLayout] = {}
    dst_out: dict[str, TensorLayout] = {}
    for i, tensors in enumerate(layers):
        row = expert_map.physical_to_logical[i]
        for t in tensors:
            if t.shape[0] != first.shape[0] or ep_of(t)[0] != ep_of(first)[0]:
                raise LayoutError(
                    f"tensor {t.name!r} has {t.shape[0]} experts over ep={ep_of(t)[0]}, "
                    f"{first.name!r} {first.shape[0]} over ep={ep_of(first)[0]}: one map cannot place both"
                )
            if t.name not in src.names:
                raise LayoutError(f"tensor {t.name!r}: the source layout has no such tensor")
            for s, e in enumerate(row):
                name = slot_name(t.name, s, e)
                slots[name] = ExpertSlot(t.name, i, s, e)
                src_out[name] = _src_slot(src[t.name], name, e)
                dst_out[name] = _dst_slot(t, name, s, len(row))
    return EplbLayouts(_replaced(src, slots, src_out), _replaced(dst, slots, dst_out), slots, expert_map, src, dst)


def _replaced(layout: ModelLayout, slots: Mapping[str, ExpertSlot], new: Mapping[str, TensorLayout]) -> ModelLayout:
    """``layout`` with each stacked expert tensor replaced, in place, by its slot tensors."""
    by_base: dict[str, list[TensorLayout]] = {}
    for name, slot in slots.items():
        by_base.setdefault(slot.base, []).append(new[name])
    out: list[TensorLayout] = []
    for t in layout:
        out.extend(by_base.get(t.name, [t]))
    return ModelLayout(tuple(out), layout.world_size)


def _slot_layout(t: TensorLayout, name: str, boxes: dict[int, Box]) -> TensorLayout:
    return TensorLayout(name, (1, *t.shape[1:]), t.dtype, t.mesh, t.placements, boxes)


def _src_slot(t: TensorLayout, name: str, expert: int) -> TensorLayout:
    """Slot tensor ``name`` on the trainer: every rank whose box of ``t`` holds row ``expert``, with that row."""
    boxes: dict[int, Box] = {}
    for r in t.ranks:
        b = t.box(r)
        if b is not None and box_numel(b) and b[0][0] <= expert < b[0][1]:
            boxes[r] = ((0, 1), *b[1:])
    if not boxes:
        raise LayoutError(f"tensor {t.name!r}: no source rank holds expert {expert}")
    return _slot_layout(t, name, boxes)


def _dst_slot(t: TensorLayout, name: str, slot: int, num_physical: int) -> TensorLayout:
    """Slot tensor ``name`` on the engine: the ranks of slot ``slot``'s EP coordinate, each with its box of ``t``
    in the other dims."""
    ep, axis = ep_of(t)
    owner = slot // (num_physical // ep)
    boxes: dict[int, Box] = {}
    for r in t.ranks:
        b = t.box(r)
        if b is not None and (axis is None or t.mesh.coords(r)[axis] == owner):
            boxes[r] = ((0, 1), *b[1:])
    return _slot_layout(t, name, boxes)


__all__: Sequence[str] = (
    "MAP_KEYS",
    "MAX_PHYSICAL_EXPERTS",
    "EplbLayouts",
    "ExpertMap",
    "ExpertSlot",
    "eplb_layouts",
    "ep_of",
    "moe_layers",
    "slot_name",
)
