"""The Ray backend of the rollout store: keys spread over storage actors (by a stable hash of
partition and key), payloads through Ray's object store.

A tensor travels as its raw bytes in a numpy uint8 array (Ray moves numpy arrays zero-copy
through its shared-memory object store; any dtype, bf16 included, survives bit for bit) plus its
dtype and shape. A put sends each actor the rows of its keys, all actors at once; the actor keeps
the batch whole and indexes rows into it (``StorageUnit``). A get asks every actor holding some
of the keys at once and interleaves the answers in key order; the result is copied out of the
object store, so the caller owns writable memory that never aliases the store.

The client (``RayStore``) is a small picklable object (the actor handles): pass it to rollout
workers and trainer ranks. A put is checked on every actor before any actor writes, so a refused
put (a field that exists, without ``overwrite``) leaves nothing half-written; two writers racing
on the same keys are not serialized against each other.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Any, Sequence

import numpy as np
import torch

from .meta import BatchMeta
from .store import FieldData, Rows, StorageUnit, Store, normalize_put

try:
    import ray
except ImportError:  # pragma: no cover - exercised only without ray
    ray = None


def encode(t: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def decode(w: tuple[np.ndarray, str, tuple[int, ...]], copy: bool) -> torch.Tensor:
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
    def __init__(self) -> None:
        self.unit = StorageUnit()

    def check_put(self, partition: str, keys: list[str], fields: list[str]) -> str | None:
        return self.unit.clash(partition, keys, fields)

    def put(self, partition, keys, fields, tags, seq_lens, overwrite) -> None:
        self.unit.put(partition, keys, {n: _decode_field(w) for n, w in fields.items()}, tags, seq_lens, overwrite)

    def get(self, partition, keys, select) -> dict[str, Any]:
        out = self.unit.get_stacked(partition, keys, select)
        return {f: _encode_field(v) for f, v in out.items()}

    def clear(self, partition, keys) -> int:
        return self.unit.clear(partition, keys)

    def keys(self) -> list[tuple[str, str]]:
        return self.unit.keys()

    def meta(self, partition, keys) -> BatchMeta:
        return self.unit.meta(partition, keys)

    def nbytes(self) -> int:
        return self.unit.nbytes()


def _shard(partition: str, key: str, n: int) -> int:
    return zlib.crc32(f"{partition}\x00{key}".encode()) % n


class RayStore(Store):
    """``RayStore(num_units=2)`` starts ``num_units`` storage actors (Ray must be initialized);
    ``actor_options`` go to ``.options()`` (e.g. ``num_cpus``, a node ``scheduling_strategy``)."""

    def __init__(self, num_units: int = 2, actor_options: dict | None = None,
                 _actors: list | None = None) -> None:
        if ray is None:
            raise ImportError("RayStore needs ray: pip install 'refit-rl[data]'")
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
        ray.get([a.nbytes.remote() for a in self.actors])  # started

    def __reduce__(self):
        return (RayStore, (len(self.actors), None, self.actors))

    def shutdown(self) -> None:
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
        if not overwrite:
            errs = ray.get([self.actors[u].check_put.remote(partition, [keys[i] for i in pos], list(fields))
                            for u, pos in parts.items()])
            for e in errs:
                if e:
                    raise ValueError(e)
        calls = []
        for u, pos in parts.items():
            whole = len(pos) == len(keys)
            idx = torch.tensor(pos, dtype=torch.long)
            wire = {}
            for n, d in fields.items():
                if isinstance(d, torch.Tensor):
                    wire[n] = _encode_field(d if whole else d.index_select(0, idx))
                else:
                    wire[n] = _encode_field([d[i] for i in pos])
            calls.append(self.actors[u].put.remote(partition, [keys[i] for i in pos], wire,
                                                   [tag_list[i] for i in pos],
                                                   None if lens is None else [lens[i] for i in pos], overwrite))
        ray.get(calls)
        return BatchMeta(keys=keys, partition=partition, fields=list(fields), tags=tag_list, seq_lens=lens)

    def get(self, keys, *, select_fields, partition=None) -> dict[str, Rows]:
        keys, partition, select = self._request(keys, partition, select_fields)
        parts = self._split(partition, keys)
        units = list(parts)
        answers = ray.get([self.actors[u].get.remote(partition, [keys[i] for i in parts[u]], select) for u in units])
        out: dict[str, Rows] = {}
        for f in select:
            got = [(parts[u], a[f]) for u, a in zip(units, answers)]
            if all(kind == "batch" for _, (kind, _) in got):
                ts = [(pos, decode(w, copy=False)) for pos, (_, w) in got]
                shape, dtype = ts[0][1].shape[1:], ts[0][1].dtype
                if all(t.shape[1:] == shape and t.dtype == dtype for _, t in ts):
                    if len(ts) == 1:
                        out[f] = ts[0][1].clone()
                        continue
                    res = torch.empty((len(keys), *shape), dtype=dtype)
                    for pos, t in ts:
                        res[torch.tensor(pos, dtype=torch.long)] = t
                    out[f] = res
                    continue
            rows: list[torch.Tensor | None] = [None] * len(keys)
            for pos, (kind, w) in got:
                vals = list(decode(w, copy=True)) if kind == "batch" else [decode(r, copy=True) for r in w]
                for p, v in zip(pos, vals):
                    rows[p] = v
            out[f] = rows  # type: ignore[assignment]
        return out

    def clear(self, keys, *, partition=None) -> int:
        keys, partition = self._resolve(keys, partition)
        parts = self._split(partition, keys)
        return sum(ray.get([self.actors[u].clear.remote(partition, [keys[i] for i in pos])
                            for u, pos in parts.items()]))

    def clear_partition(self, partition: str) -> int:
        return self.clear(self.keys(partition), partition=partition)

    def keys(self, partition=None):
        held = [pk for ks in ray.get([a.keys.remote() for a in self.actors]) for pk in ks]
        return held if partition is None else [k for p, k in held if p == partition]

    def meta(self, keys, *, partition="default") -> BatchMeta:
        keys = [str(k) for k in keys]
        parts = self._split(partition, keys)
        metas = dict(zip(parts, ray.get([self.actors[u].meta.remote(partition, [keys[i] for i in pos])
                                         for u, pos in parts.items()])))
        where = {i: (u, j) for u, pos in parts.items() for j, i in enumerate(pos)}
        order = [where[i] for i in range(len(keys))]
        fields = [f for f in next(iter(metas.values())).fields if all(f in m.fields for m in metas.values())]
        lens = None
        if all(m.seq_lens is not None for m in metas.values()):
            lens = [metas[u].seq_lens[j] for u, j in order]
        return BatchMeta(keys=keys, partition=partition, fields=fields,
                         tags=[metas[u].tags[j] for u, j in order], seq_lens=lens)

    def nbytes(self) -> int:
        return sum(ray.get([a.nbytes.remote() for a in self.actors]))
