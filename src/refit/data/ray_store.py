"""The Ray backend of the rollout store: key metadata in storage actors (keys spread over them by
a stable hash of partition and key), payloads in Ray's object store.

A put encodes every field (a tensor travels as its raw bytes in a numpy uint8 array plus dtype
and shape, so any dtype, bf16 included, survives bit for bit, and Ray moves it zero-copy) and
``ray.put``s them once; with ``durable=True`` (the default) one storage actor copies that object
into one it owns (Ray ties an object's life to its owner, and the writer — a rollout worker —
may exit before the trainer reads), costing one more copy per put; each actor holding some of
the keys records the object reference and its rows. A get
asks the actors where its keys' rows are (a small call to each, all at once), ``ray.get``s the
objects (zero-copy on the same node) and gathers exactly the requested rows into fresh, writable
tensors in key order. An object is freed when the last of its rows is cleared.

Trade-off: a reader on another node pulls the whole objects that hold its rows (Ray moves objects,
not rows); put batches the size you want readers to move.

The client (``RayStore``) is a small picklable object (the actor handles): pass it to rollout
workers and trainer ranks. A put is checked on every actor before any actor writes, so a refused
put (a field that exists, without ``overwrite``) leaves nothing half-written; two writers racing
on the same keys are not serialized against each other.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any

import numpy as np
import torch

from .meta import BatchMeta
from .store import FieldData, Rows, StorageUnit, Store, gather, normalize_put

try:
    import ray
except ImportError:  # pragma: no cover - exercised only without ray
    ray = None


def encode(t: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """``t``'s bytes as a flat uint8 array (sharing memory with a contiguous CPU ``t``), its dtype
    name and its shape: any dtype survives ``decode`` bit for bit."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def decode(w: tuple[np.ndarray, str, tuple[int, ...]], copy: bool) -> torch.Tensor:
    """The tensor ``encode`` described; ``copy=False`` views the array's memory (never write to it
    when it is an object-store buffer), ``copy=True`` owns a writable copy."""
    arr, dtype, shape = w
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only object-store buffers
        t = torch.from_numpy(arr)
    if copy:
        t = t.clone()
    return t.view(getattr(torch, dtype)).reshape(shape)


def _encode_field(d: FieldData) -> Any:
    if isinstance(d, torch.Tensor):
        return ("batch", encode(d))
    return ("rows", [encode(r) for r in d])


def _decode_field(w: Any) -> FieldData:
    kind, v = w
    return decode(v, copy=False) if kind == "batch" else [decode(r, copy=False) for r in v]


class _StorageActor:
    """Keys -> (object reference, row) per field; the payload bytes stay in the object store."""

    def __init__(self) -> None:
        self.unit = StorageUnit()

    def check_put(self, partition: str, keys: list[str], fields: list[str]) -> str | None:
        return self.unit.clash(partition, keys, fields)

    def adopt(self, holder: list) -> list:
        """A copy of the writer's object, owned by this actor."""
        return [ray.put(ray.get(holder[0]))]

    def put(self, partition, keys, holder, fields, rows, tags, seq_lens, overwrite) -> None:
        ref = holder[0]  # nested in a list: Ray passes the reference, not the value
        self.unit.put(partition, keys, {f: (ref, f) for f in fields}, tags, seq_lens, overwrite, rows)

    def locate(self, partition, keys, select) -> dict[str, list]:
        return {
            f: [([ref], name, pos, rows) for (ref, name), pos, rows in groups]
            for f, groups in self.unit.locate(partition, keys, select).items()
        }

    def clear(self, partition, keys) -> int:
        return self.unit.clear(partition, keys)

    def keys(self) -> list[tuple[str, str]]:
        return self.unit.keys()

    def meta(self, partition, keys) -> BatchMeta:
        return self.unit.meta(partition, keys)

    def chunks(self) -> int:
        return self.unit.chunks()


def _shard(partition: str, key: str, n: int) -> int:
    return zlib.crc32(f"{partition}\x00{key}".encode()) % n


class RayStore(Store):
    """``RayStore(num_units=2)`` starts ``num_units`` storage actors (Ray must be initialized);
    ``actor_options`` go to ``.options()`` (default ``num_cpus=0``; e.g. a node
    ``scheduling_strategy``). ``durable=False`` leaves each put's object owned by the writing
    process: one copy less per put, but the keys become unreadable (Ray raises an owner-died
    error) once the writer exits.

    Lifecycle: built once, on a process where ``ray.init()`` ran (the driver); pickling it
    (passing it to a Ray task or actor) gives a client of the same actors, in the same order,
    with the same ``durable``. ``shutdown()`` kills the actors, dropping every key they hold:
    call it once, when no client is in use.

    Must agree: every client routes a key to an actor by a stable hash of (partition, key)
    modulo the number of actors, so clients must come from one store by pickling (never build
    a second one over the same keys). Two writers racing on the same keys are not serialized.
    """

    def __init__(
        self, num_units: int = 2, actor_options: dict | None = None, durable: bool = True, _actors: list | None = None
    ) -> None:
        if ray is None:
            raise ImportError("RayStore needs ray: pip install 'refit-rl[data]'")
        self.durable = durable
        if _actors is not None:
            self.actors = list(_actors)
            return
        if num_units < 1:
            raise ValueError(f"RayStore: num_units must be >= 1, got {num_units}")
        if not ray.is_initialized():
            raise RuntimeError("RayStore: call ray.init() first")
        cls = ray.remote(_StorageActor)
        opts = {"num_cpus": 0, **(actor_options or {})}
        self.actors = [cls.options(**opts).remote() for _ in range(num_units)]
        ray.get([a.chunks.remote() for a in self.actors])  # started

    def __reduce__(self):
        return (RayStore, (len(self.actors), None, self.durable, self.actors))

    def shutdown(self) -> None:
        """Kill the storage actors (everything they hold is lost); no client can be used after."""
        for a in self.actors:
            ray.kill(a)
        self.actors = []

    def _split(self, partition: str, keys: list[str]) -> dict[int, list[int]]:
        parts: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            parts.setdefault(_shard(partition, k, len(self.actors)), []).append(i)
        return parts

    def put(self, keys, fields, *, partition="default", tags=None, seq_lens=None, overwrite=False) -> BatchMeta:
        keys, fields, tag_list, lens = normalize_put(keys, fields, tags, seq_lens)
        parts = self._split(partition, keys)
        checks = (
            []
            if overwrite
            else [
                self.actors[u].check_put.remote(partition, [keys[i] for i in pos], list(fields))
                for u, pos in parts.items()
            ]
        )
        ref = ray.put({n: _encode_field(d) for n, d in fields.items()})  # the copy overlaps the checks
        for e in ray.get(checks):
            if e:
                raise ValueError(e)
        if self.durable:
            ref = ray.get(self.actors[next(iter(parts))].adopt.remote([ref]))[0]
        ray.get(
            [
                self.actors[u].put.remote(
                    partition,
                    [keys[i] for i in pos],
                    [ref],
                    list(fields),
                    pos,
                    [tag_list[i] for i in pos],
                    None if lens is None else [lens[i] for i in pos],
                    overwrite,
                )
                for u, pos in parts.items()
            ]
        )
        return BatchMeta(keys=keys, partition=partition, fields=list(fields), tags=tag_list, seq_lens=lens)

    def get(self, keys, *, select_fields, partition=None) -> dict[str, Rows]:
        keys, partition, select = self._request(keys, partition, select_fields)
        parts = self._split(partition, keys)
        located = ray.get(
            [self.actors[u].locate.remote(partition, [keys[i] for i in pos], select) for u, pos in parts.items()]
        )
        refs: dict[Any, Any] = {}
        for loc in located:
            for groups in loc.values():
                for holder, _, _, _ in groups:
                    refs.setdefault(holder[0], None)
        objects = dict(zip(refs, ray.get(list(refs))))  # every object once, all at once
        decoded: dict[tuple[Any, str], FieldData] = {}
        out: dict[str, Rows] = {}
        for f in select:
            groups = []
            for pos_u, loc in zip(parts.values(), located):
                for holder, name, pos, rows in loc[f]:
                    key = (holder[0], name)
                    if key not in decoded:
                        decoded[key] = _decode_field(objects[holder[0]][name])
                    groups.append((decoded[key], [pos_u[p] for p in pos], rows))
            out[f] = gather(len(keys), groups)
        return out

    def clear(self, keys, *, partition=None) -> int:
        keys, partition = self._resolve(keys, partition)
        parts = self._split(partition, keys)
        return sum(
            ray.get([self.actors[u].clear.remote(partition, [keys[i] for i in pos]) for u, pos in parts.items()])
        )

    def clear_partition(self, partition: str) -> int:
        return self.clear(self.keys(partition), partition=partition)

    def keys(self, partition=None):
        held = [pk for ks in ray.get([a.keys.remote() for a in self.actors]) for pk in ks]
        return held if partition is None else [k for p, k in held if p == partition]

    def meta(self, keys, *, partition="default") -> BatchMeta:
        keys = [str(k) for k in keys]
        parts = self._split(partition, keys)
        metas = dict(
            zip(
                parts,
                ray.get([self.actors[u].meta.remote(partition, [keys[i] for i in pos]) for u, pos in parts.items()]),
            )
        )
        where = {i: (u, j) for u, pos in parts.items() for j, i in enumerate(pos)}
        order = [where[i] for i in range(len(keys))]
        fields = [f for f in next(iter(metas.values())).fields if all(f in m.fields for m in metas.values())]
        lens = None
        if all(m.seq_lens is not None for m in metas.values()):
            lens = [metas[u].seq_lens[j] for u, j in order]
        return BatchMeta(
            keys=keys, partition=partition, fields=fields, tags=[metas[u].tags[j] for u, j in order], seq_lens=lens
        )

    def chunks(self) -> int:
        """Field payloads referenced (an object is freed once no chunk references it)."""
        return sum(ray.get([a.chunks.remote() for a in self.actors]))
