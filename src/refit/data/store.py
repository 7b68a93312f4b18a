"""The rollout store: tensor columns under string keys, in named partitions.

Contract (every backend):

- ``put(keys, fields, partition=..., tags=..., seq_lens=...)`` writes, for each key, one row of
  every field. A field is either a tensor whose first dimension has one entry per key (row ``i``
  belongs to ``keys[i]``; a 1-D field gives 0-d rows) or a list of one tensor per key (ragged
  rows). Writing a field a key already has raises unless ``overwrite=True``; new fields may be
  added to existing keys at any time (the driver writes advantages next to the rollouts).
  Returns the ``BatchMeta`` of the keys with the fields just written (``meta()`` lists all).
- ``get(keys_or_meta, select_fields=[...])`` returns ``{field: rows}`` in the order of the keys:
  one stacked tensor when every row has the same shape and dtype (a 1-D field comes back 1-D),
  else the list of rows. ``select_fields`` is required: nothing is read that was not named.
  A key or field that was never written raises ``MissingKeyError`` / ``MissingFieldError``
  naming the partition, key and field. Bytes, dtypes and shapes are exactly what was put.
  Zero-copy by default: what comes back may be a view of the store's memory (a run of
  consecutive rows of one put, in order, is returned as a view; other selections are gathered
  into fresh memory with one vectorized gather per put) and is **read-only by contract** —
  writing to it may corrupt what other readers see (torch has no read-only flag to enforce
  it). ``copy=True`` returns private, writable tensors that never alias the store. A view
  stays valid after its keys are cleared (it keeps its memory alive until it is dropped).
- ``take(keys_or_meta, select_fields=[...])`` is ``get`` then ``clear`` in one step (a
  missing key or field raises and clears nothing), for readers that consume.
- ``clear(keys, partition)`` drops keys (idempotent: clearing an absent key is not an error);
  ``clear_partition(partition)`` drops a whole partition.
- ``keys(partition=None)`` lists what is held (leak checks), ``meta(keys, partition)`` rebuilds
  the ``BatchMeta`` (fields every key has, tags, sequence lengths) of keys held.

``StorageUnit`` is the storage itself (no I/O); ``InProcessStore`` wraps one in the calling
process (the embedded default); ``refit.data.ray_store.RayStore`` spreads keys over several
storage actors.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from refit.errors import RefitError

from .inputs import FieldData, check_keys, check_name, check_names, normalize_put
from .meta import BatchMeta

Rows = torch.Tensor | list[torch.Tensor]


class MissingKeyError(RefitError, KeyError):
    """A key that was never written (or already cleared)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class MissingFieldError(RefitError, KeyError):
    """A field that was never produced for a key."""

    def __str__(self) -> str:
        return str(self.args[0])


def _in_order(n: int, pos: Sequence[int], rows: Sequence[int]) -> bool:
    """Whether ``pos`` and ``rows`` are ``range`` objects (a whole put read through its meta) with output
    row ``i`` payload row ``rows[0] + i`` for every ``i < n``: decided at once. Other sequences get
    ``_one_payload``'s vectorized check."""
    if isinstance(pos, range) and isinstance(rows, range):
        return pos == range(n) and rows.step == 1 and len(rows) == n
    return False


def _one_payload(n: int, p: torch.Tensor, pos: Sequence[int], rows: Sequence[int], copy: bool) -> torch.Tensor:
    """The ``n`` rows of one batch tensor in output order: a view when they are one run of
    consecutive rows in order (unless ``copy``), else one vectorized gather (fresh memory)."""
    if n and _in_order(n, pos, rows):
        view = p.narrow(0, rows[0], n)
        return view.clone() if copy else view
    order = np.asarray(rows, dtype=np.int64)
    if not (isinstance(pos, range) and pos == range(n)):  # else output row i is rows[i] already
        order = order[np.argsort(np.asarray(pos, dtype=np.int64), kind="stable")]
    start = int(order[0]) if n else 0
    if n and order[-1] - start == n - 1 and bool((np.diff(order) == 1).all()):
        view = p.narrow(0, start, n)
        return view.clone() if copy else view
    return p.index_select(0, torch.from_numpy(order))


def _merged(groups: list[tuple[Any, Sequence[int], Sequence[int]]]) -> list[tuple[Any, list[int], list[int]]]:
    """One group per payload (a payload may come in several groups: several calls, several puts)."""
    merged: dict[int, tuple[Any, list[int], list[int]]] = {}
    for p, pos, rows in groups:
        m = merged.setdefault(id(p), (p, [], []))
        m[1].extend(pos)
        m[2].extend(rows)
    return list(merged.values())


def gather(n: int, groups: list[tuple[Any, Sequence[int], Sequence[int]]], copy: bool = False) -> Rows:
    """Assemble ``n`` output rows from ``groups`` of (payload, output positions, payload rows: lists or ranges),
    where a payload is a batch tensor (rows on dim 0) or a list of row tensors. One stacked
    tensor when every row shares shape and dtype, else a list.

    Zero-copy where it can be: rows that form one run of consecutive rows of one batch tensor,
    in order, come back as a view of it (read-only by contract: it may be shared memory other
    readers see); any other selection is gathered with one ``index_select`` per payload (no
    per-row loop), ragged rows come back as views of the rows held. ``copy=True``: the result
    never aliases a payload (writable, private)."""
    if len(groups) > 1:
        groups = _merged(groups)
    tensors = [p for p, _, _ in groups if isinstance(p, torch.Tensor)]
    if len(tensors) == len(groups):
        shape, dtype = tensors[0].shape[1:], tensors[0].dtype
        if all(t.shape[1:] == shape and t.dtype == dtype for t in tensors):
            if len(groups) == 1:
                return _one_payload(n, *groups[0], copy=copy)
            out = torch.empty((n, *shape), dtype=dtype)
            for p, pos, rows in groups:
                out[torch.as_tensor(pos, dtype=torch.long)] = p.index_select(0, torch.as_tensor(rows, dtype=torch.long))
            return out
    flat: list[torch.Tensor | None] = [None] * n
    for p, pos, rows in groups:  # ragged rows: one tensor each
        for i, r in zip(pos, rows):
            flat[i] = p[r]
    if all(t.shape == flat[0].shape and t.dtype == flat[0].dtype for t in flat):  # type: ignore[union-attr]
        return torch.stack(flat)  # type: ignore[arg-type]
    return [t.clone() for t in flat] if copy else flat  # type: ignore[union-attr,return-value]


def group_rows(
    located: Sequence[tuple[Any, Any]], key: Callable[[Any], Any] | None = None
) -> list[tuple[Any, list[int], list[int]]]:
    """Group ``(owner, row)`` pairs by owner: one ``(owner, positions in located, rows)`` triple per
    distinct ``key(owner)`` (the owner itself when ``key`` is None), in order of first appearance;
    a group's owner is the first one seen with its key, its positions ascend and its rows follow
    them. Where every owner equals the first (``==``, identity first: one put's rows, the common
    case), the one triple is built with no Python step per pair and ``key`` is never called. Pure:
    ``located`` is only read (any sequence that unpacks as ``owners, rows = zip(*located)``)."""
    if not located:
        return []
    owners, rows = zip(*located)
    if owners.count(owners[0]) == len(owners):
        return [(owners[0], list(range(len(owners))), list(rows))]
    groups: dict[Any, tuple[Any, list[int], list[int]]] = {}
    for pos, (owner, row) in enumerate(zip(owners, rows)):
        k = owner if key is None else key(owner)
        g = groups.get(k)
        if g is None:
            g = groups[k] = (owner, [], [])
        g[1].append(pos)
        g[2].append(row)
    return list(groups.values())


class NotReady(Exception):
    """``StorageUnit.locate(clear=True, ready=...)`` found payloads not ready: nothing was dropped."""

    def __init__(self, payloads: list) -> None:
        super().__init__(f"{len(payloads)} payloads not ready")
        self.payloads = payloads


def _names(entry: dict | tuple) -> dict:
    """A key's entry in ``StorageUnit._rows`` as a mapping whose keys are its field names: the entry
    itself (``{field: (chunk, row)}``) or, for a tuple entry, its shared ``{field: chunk}`` (read it,
    never change it: other keys share it)."""
    return entry if type(entry) is dict else entry[0]


def _chunk_ids(entry: dict | tuple) -> Iterable[int]:
    return [c for c, _ in entry.values()] if type(entry) is dict else entry[0].values()


def _one_map(entries: list) -> dict | None:
    """The field map every entry shares, where each is a tuple entry with the same map (the keys of one
    put, or of one put and the fields written back to them row for row), else None."""
    if not entries or type(entries[0]) is not tuple:
        return None
    m = entries[0][0]
    for e in entries:
        if type(e) is not tuple or e[0] is not m:
            return None
    return m


class StorageUnit:
    """Rows of columns. Each field of a put is one chunk — a payload whose row ``rows[i]``
    belongs to ``keys[i]``: a batch tensor, a list of row tensors, or an opaque handle (the Ray
    backend keeps object references). A put costs one reference per field, a get one gather
    per chunk; a chunk is dropped when its last row is cleared or overwritten (``on_drop(payload)``
    is then called under the unit's lock: keep it short). Thread-safe (one lock per unit). It
    stores what it is given as is: copying (``InProcessStore``) or encoding (``RayStore``) is the
    caller's job. The common cases (a put of new keys, a get of keys that one put wrote) take
    bulk dict and set operations, not a Python step per key and field."""

    def __init__(self, on_drop: Callable[[Any], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._on_drop = on_drop
        self._chunks: dict[int, list] = {}  # id -> [payload, live rows]
        # (partition, key) -> (shared {field: chunk}, row) where all the key's fields sit at one row of their
        # chunks (a put of new keys, and fields written back to them at the same rows: one tuple per key,
        # one map per put, never changed once stored), else the key's own {field: (chunk, row)}
        self._rows: dict[tuple[str, str], dict[str, tuple[int, int]] | tuple[dict[str, int], int]] = {}
        self._info: dict[tuple[str, str], tuple[dict, int | None]] = {}  # tags, seq_len

    # -- writes -------------------------------------------------------------------------
    def put(
        self,
        partition: str,
        keys: list[str],
        fields: dict[str, Any],
        tags: list[dict],
        seq_lens: list[int] | None,
        overwrite: bool = False,
        rows: list[int] | None = None,
    ) -> None:
        """Record each field's payload as one chunk whose row ``rows[i]`` (default ``i``) belongs
        to ``keys[i]``; tags merge into a key's tags, a given seq_len replaces its own. Without
        ``overwrite`` a field a key already has refuses the whole put (``ValueError``) first."""
        if not keys:
            raise ValueError("put: no keys")
        rows = list(range(len(keys))) if rows is None else rows
        pks = [(partition, k) for k in keys]
        unique = set(pks)
        if len(unique) != len(pks):
            raise ValueError(f"put: duplicate keys in partition {partition!r}")
        for what, items in (("rows", rows), ("tags", tags), ("seq_lens", seq_lens)):
            if items is not None and len(items) != len(keys):
                raise ValueError(f"put: {len(items)} {what} for {len(keys)} keys")
        with self._lock:
            held = self._rows.keys() & unique
            if held and not overwrite:  # refuse before writing anything
                err = self._clash(partition, keys, fields, held)
                if err:
                    raise ValueError(err)
            cids = {}
            for name, payload in fields.items():
                cids[name] = next(self._ids)
                self._chunks[cids[name]] = [payload, len(keys)]
            if not held:  # new keys: bulk inserts, one (shared field map, row) tuple per key
                self._rows.update(zip(pks, zip(itertools.repeat(cids), rows)))
                self._info.update(zip(pks, zip(tags, seq_lens or itertools.repeat(None))))
                return
            released = self._write_back(pks, cids, rows)
            for cid, n in released.items():
                self._release(cid, n)
            if seq_lens is None and not any(tags):  # nothing to merge: held keys keep theirs
                self._info.update((pk, ({}, None)) for pk in pks if pk not in self._info)
                return
            for i, pk in enumerate(pks):
                old_tags, old_len = self._info.get(pk, ({}, None))
                self._info[pk] = ({**old_tags, **tags[i]}, seq_lens[i] if seq_lens is not None else old_len)

    def _write_back(self, pks: list, cids: dict[str, int], rows: list[int]) -> Counter:
        """Record a put (chunks ``cids``) over keys some of which are held (under the lock); returns the
        rows of old chunks it replaced, per chunk. A new key gets the put's map; a tuple entry written at
        its own row gets its map merged with this put's (one merged map per old map: the README's write
        back of advantages stays one tuple per key); any other key gets (or keeps) its own dict."""
        released: Counter = Counter()
        merged: dict[int, list] = {}  # id(old map) -> [old map, merged map, keys]
        for pk, r in zip(pks, rows):
            row = self._rows.get(pk)
            if row is None:
                self._rows[pk] = (cids, r)
            elif type(row) is tuple and row[1] == r:
                m = merged.get(id(row[0]))
                if m is None:  # the old map is kept alive in ``merged``: its id stays its own
                    m = merged[id(row[0])] = [row[0], {**row[0], **cids}, 0]
                m[2] += 1
                self._rows[pk] = (m[1], r)
            else:
                if type(row) is tuple:  # written at another row: this key's own dict from now on
                    row = {n: (c, row[1]) for n, c in row[0].items()}
                    self._rows[pk] = row
                for name, cid in cids.items():
                    if name in row:
                        released[row[name][0]] += 1
                    row[name] = (cid, r)
        for old, _, n in merged.values():  # the old map's chunks that this put replaced, once per key
            for name in cids.keys() & old.keys():
                released[old[name]] += n
        return released

    def clash(self, partition: str, keys: Sequence[str], fields: Iterable[str]) -> str | None:
        """Why a put of ``fields`` without ``overwrite`` would be refused, or None."""
        with self._lock:
            held = self._rows.keys() & {(partition, k) for k in keys}
            return self._clash(partition, keys, fields, held) if held else None

    def _clash(self, partition: str, keys: Sequence[str], fields: Iterable[str], held: set) -> str | None:
        fields = list(fields)
        m = _one_map([self._rows[pk] for pk in held])
        if m is not None and not any(f in m for f in fields):  # the held keys share one map: checked once
            return None
        for k in keys:
            if (partition, k) not in held:
                continue
            clash = [f for f in fields if f in _names(self._rows[(partition, k)])]
            if clash:
                return (
                    f"put: key {k!r} in partition {partition!r} already has field {clash[0]!r} "
                    f"(pass overwrite=True to replace it)"
                )
        return None

    def _release(self, cid: int, n: int) -> None:
        c = self._chunks[cid]
        c[1] -= n
        if c[1] == 0:
            del self._chunks[cid]
            if self._on_drop is not None:
                self._on_drop(c[0])

    def clear(
        self,
        partition: str,
        keys: Iterable[str],
        only: Callable[[int, list[Any]], bool] | None = None,
        uniform: bool = False,
    ) -> int:
        """Drop keys; absent ones are skipped. Returns how many were dropped. ``only(i, payloads)``:
        drop ``keys[i]`` only where it says so, given the payloads of its fields (under the lock: a
        backend drops only the rows a put of its own wrote). ``uniform``: ``only``'s answer depends on the
        payloads alone, not on ``i``: it is asked once per field map the keys share (once for the keys of
        one put), not once per key."""
        with self._lock:
            if only is not None:
                keys = self._kept(partition, list(keys), only, uniform)
            return self._drop(partition, keys)

    def _kept(self, partition: str, keys: list[str], only: Callable[[int, list[Any]], bool], uniform: bool) -> list:
        """The ``keys`` held whose payloads ``only`` accepts (``clear``; under the lock)."""
        entries = [self._rows.get((partition, str(k))) for k in keys]
        if uniform and _one_map(entries) is not None:  # one shared map: one answer for every key
            return keys if only(0, self._payloads(entries[0])) else []
        asked: dict[int, bool] = {}  # uniform: id(shared map) -> answer (each map is alive in ``_rows``)
        kept = []
        for i, (k, row) in enumerate(zip(keys, entries)):
            if row is None:
                continue
            shared = uniform and type(row) is tuple
            ok = asked.get(id(row[0])) if shared else None
            if ok is None:
                ok = only(i, self._payloads(row))
                if shared:
                    asked[id(row[0])] = ok
            if ok:
                kept.append(k)
        return kept

    def _payloads(self, entry: dict | tuple) -> list[Any]:
        """The payloads of a key's fields (its entry in ``_rows``)."""
        return [self._chunks[cid][0] for cid in _chunk_ids(entry)]

    def _drop(self, partition: str, keys: Iterable[str]) -> int:
        pks = [(partition, str(k)) for k in keys]
        dropped = [r for r in map(self._rows.pop, pks, itertools.repeat(None)) if r is not None]
        for pk in pks:
            self._info.pop(pk, None)
        m = _one_map(dropped)
        if m is not None:  # one shared map: each of its chunks loses one row per key
            for cid in m.values():
                self._release(cid, len(dropped))
            return len(dropped)
        released: Counter = Counter()
        shared: dict[int, list] = {}  # id(map) -> [map, keys dropped that share it]
        for row in dropped:
            if type(row) is dict:
                released.update(_chunk_ids(row))
            else:
                s = shared.get(id(row[0]))
                if s is None:
                    s = shared[id(row[0])] = [row[0], 0]
                s[1] += 1
        for m, n in shared.values():
            for cid in m.values():
                released[cid] += n
        for cid, n in released.items():
            self._release(cid, n)
        return len(dropped)

    def clear_partition(self, partition: str) -> int:
        """Drop every key of ``partition``; returns how many there were."""
        return self.clear(partition, [k for p, k in self.keys() if p == partition])

    # -- reads --------------------------------------------------------------------------
    def _check(self, partition: str, keys: Sequence[str], select_fields: Sequence[str]) -> None:
        for k in keys:
            row = self._rows.get((partition, k))
            if row is None:
                raise MissingKeyError(f"get: key {k!r} is not in partition {partition!r} (never written, or cleared)")
            for f in select_fields:
                if f not in _names(row):
                    raise MissingFieldError(
                        f"get: field {f!r} was never produced for key {k!r} in partition "
                        f"{partition!r} (it has {sorted(_names(row))})"
                    )

    def locate(
        self,
        partition: str,
        keys: Sequence[str],
        select_fields: Sequence[str],
        clear: bool = False,
        ready: Callable[[Any], bool] | None = None,
        accept: Callable[[dict], str | None] | None = None,
    ) -> dict[str, list[tuple[Any, list[int], list[int]]]]:
        """Per field, the groups (payload, positions in ``keys``, rows in the payload); with
        ``clear``, the keys are dropped in the same step (not when a key or field is missing, nor,
        given ``ready``, when a payload returned is not ready: ``NotReady`` names those). ``accept(out)``:
        why these groups are not the ones the caller may read (``MissingKeyError`` with that reason,
        nothing dropped), or None."""
        with self._lock:
            try:
                entries = [self._rows[(partition, k)] for k in keys]
                m = _one_map(entries)
                if m is not None:  # one map: each field is one chunk, one group, the rows in order of the keys
                    rows = [e[1] for e in entries]
                    out = {f: [(self._chunks[m[f]][0], list(range(len(rows))), rows)] for f in select_fields}
                else:
                    located = {
                        f: [e[f] if type(e) is dict else (e[0][f], e[1]) for e in entries] for f in select_fields
                    }
                    out = {f: self._groups(locs) for f, locs in located.items()}
            except KeyError:
                self._check(partition, keys, select_fields)  # raises, naming the key and field
                raise
            reason = accept(out) if accept is not None else None
            if reason:
                raise MissingKeyError(reason)
            if clear:
                if ready is not None:
                    waiting = [p for groups in out.values() for p, _, _ in groups if not ready(p)]
                    if waiting:
                        raise NotReady(waiting)
                self._drop(partition, keys)
            return out

    def _groups(self, locs: list[tuple[int, int]]) -> list[tuple[Any, list[int], list[int]]]:
        """``(chunk id, row)`` locations as ``gather``'s (payload, positions, rows) groups, one per chunk."""
        return [(self._chunks[cid][0], pos, rows) for cid, pos, rows in group_rows(locs)]

    def get_stacked(
        self, partition: str, keys: Sequence[str], select_fields: Sequence[str], copy: bool = False, clear: bool = False
    ) -> dict[str, Rows]:
        """Per field, the rows of ``keys`` in order (``gather``: views where it can, unless
        ``copy``); ``clear`` drops the keys in the same step."""
        located = self.locate(partition, keys, select_fields, clear)
        return {f: gather(len(keys), groups, copy) for f, groups in located.items()}

    def meta(self, partition: str, keys: Sequence[str]) -> BatchMeta:
        """The ``BatchMeta`` of held ``keys``: fields all of them have, their tags, and seq_lens
        if every key has one. ``MissingKeyError`` for a key not held."""
        with self._lock:
            self._check(partition, keys, ())
            entries = [self._rows[(partition, k)] for k in keys]
            m = _one_map(entries)
            fields = list(_names(entries[0])) if entries else []
            if m is None:
                fields = [f for f in fields if all(f in _names(e) for e in entries)]
            info = [self._info[(partition, k)] for k in keys]
            lens = [n for _, n in info]
            return BatchMeta(
                keys=list(keys),
                partition=partition,
                fields=fields,
                tags=[t for t, _ in info],
                seq_lens=None if any(n is None for n in lens) else lens,
            )  # type: ignore[arg-type]

    def keys(self) -> list[tuple[str, str]]:
        """Every ``(partition, key)`` held."""
        with self._lock:
            return list(self._rows)

    def nbytes(self) -> int:
        """Bytes of the tensor payloads held (opaque handles count 0)."""
        with self._lock:
            return sum(
                sum(
                    t.numel() * t.element_size()
                    for t in (p if isinstance(p, list) else [p])
                    if isinstance(t, torch.Tensor)
                )
                for p, _ in self._chunks.values()
            )

    def chunks(self) -> int:
        """Chunks held (one per field per put while any of its rows lives)."""
        with self._lock:
            return len(self._chunks)


class Store(ABC):
    """A client of the rollout store; the module docstring is the contract every backend keeps.

    Holds every row put, per ``(partition, key)``, until it is cleared (nothing expires); a
    ``BatchMeta`` only names keys. Callers: rollout workers ``put``; the driver plans from the
    ``BatchMeta`` objects ``put`` or ``meta`` return and may ``put`` more fields; trainer ranks
    ``get`` (or one rank per group, ``leader_fetch``); whoever owns the keys (the driver, a
    ``ReplayBuffer``) clears them.

    Must agree: writers and readers name the same partition (a ``BatchMeta`` carries its own;
    one passed with a different ``partition=`` is a ``ValueError``); ``keys`` is a list of
    keys or a ``BatchMeta``, never one string (``TypeError``).
    """

    @abstractmethod
    def put(
        self,
        keys: Sequence[str],
        fields: dict[str, FieldData],
        *,
        partition: str = "default",
        tags: dict | Sequence[dict] | None = None,
        seq_lens: Sequence[int] | None = None,
        overwrite: bool = False,
    ) -> BatchMeta:
        """Write one row of every field per key; the ``BatchMeta`` of what was written."""

    @abstractmethod
    def get(
        self,
        keys: BatchMeta | Sequence[str],
        *,
        select_fields: Sequence[str],
        partition: str | None = None,
        copy: bool = False,
    ) -> dict[str, Rows]:
        """``{field: rows}`` of ``select_fields`` in key order: read-only views of the store's
        memory where it can (never write to them), private writable tensors with ``copy=True``."""

    def take(
        self,
        keys: BatchMeta | Sequence[str],
        *,
        select_fields: Sequence[str],
        partition: str | None = None,
        copy: bool = False,
    ) -> dict[str, Rows]:
        """``get`` and ``clear`` of the same keys in one step, for readers that consume: what
        ``get`` returns (views stay valid after the clear), the keys dropped. A missing key or
        field raises as ``get`` does and clears nothing. This default takes two steps; the
        backends override it with one (one call to one storage actor for ``RayStore``)."""
        out = self.get(keys, select_fields=select_fields, partition=partition, copy=copy)
        self.clear(keys, partition=partition)
        return out

    @abstractmethod
    def clear(self, keys: BatchMeta | Sequence[str], *, partition: str | None = None) -> int:
        """Drop ``keys`` (absent ones skipped); returns how many were held."""

    @abstractmethod
    def clear_partition(self, partition: str) -> int:
        """Drop every key of ``partition``; returns how many there were."""

    @abstractmethod
    def keys(self, partition: str | None = None) -> list[str] | list[tuple[str, str]]:
        """Keys held in ``partition``, or every ``(partition, key)`` when it is None."""

    @abstractmethod
    def meta(self, keys: Sequence[str], *, partition: str = "default") -> BatchMeta:
        """The ``BatchMeta`` of held ``keys`` (fields all of them have, tags, seq_lens)."""

    @abstractmethod
    def chunks(self) -> int:
        """Field payloads held (one per field per put while any of its rows lives)."""

    @staticmethod
    def _resolve(keys: BatchMeta | Sequence[str], partition: str | None) -> tuple[list[str], str]:
        if isinstance(keys, BatchMeta):
            if partition is not None and partition != keys.partition:
                raise ValueError(f"partition {partition!r} given with a BatchMeta of partition {keys.partition!r}")
            return list(keys.keys), keys.partition
        keys = check_keys(keys, "store")
        return keys, check_name(partition, "partition", "store") if partition is not None else "default"

    @classmethod
    def _request(
        cls, keys: BatchMeta | Sequence[str], partition: str | None, select_fields: Sequence[str] | None
    ) -> tuple[list[str], str, list[str]]:
        """A get's keys, partition and fields, checked."""
        if select_fields is None or isinstance(select_fields, str) or len(select_fields) == 0:
            raise ValueError("get: select_fields must name at least one field (a list; nothing is read unasked)")
        keys, partition = cls._resolve(keys, partition)
        if not keys:
            raise ValueError("get: no keys")
        return keys, partition, list(dict.fromkeys(check_names(select_fields, "select_fields", "get")))


class InProcessStore(Store):
    """The embedded store: one ``StorageUnit`` in this process; threads may share it, other
    processes cannot (``RayStore`` is the shared one). ``put`` copies the caller's tensors (they
    may be reused once it returns); ``get`` returns views of the copies held where it can (read-only
    by contract), fresh tensors with ``copy=True``."""

    def __init__(self) -> None:
        self.unit = StorageUnit()

    def put(self, keys, fields, *, partition="default", tags=None, seq_lens=None, overwrite=False) -> BatchMeta:
        keys, fields, tag_list, lens = normalize_put(keys, fields, tags, seq_lens, partition)
        # keep a private copy: the caller may reuse its buffers after put returns
        fields = {
            n: d.detach().clone() if isinstance(d, torch.Tensor) else [r.detach().clone() for r in d]
            for n, d in fields.items()
        }  # a list field: one chunk, row i = item i
        self.unit.put(partition, keys, fields, tag_list, lens, overwrite)
        return BatchMeta(keys=keys, partition=partition, fields=list(fields), tags=tag_list, seq_lens=lens)

    def get(self, keys, *, select_fields, partition=None, copy=False) -> dict[str, Rows]:
        keys, partition, select = self._request(keys, partition, select_fields)
        return self.unit.get_stacked(partition, keys, select, copy)

    def take(self, keys, *, select_fields, partition=None, copy=False) -> dict[str, Rows]:
        keys, partition, select = self._request(keys, partition, select_fields)
        return self.unit.get_stacked(partition, keys, select, copy, clear=True)

    def clear(self, keys, *, partition=None) -> int:
        keys, partition = self._resolve(keys, partition)
        return self.unit.clear(partition, keys)

    def clear_partition(self, partition: str) -> int:
        return self.unit.clear_partition(partition)

    def keys(self, partition=None):
        held = self.unit.keys()
        return held if partition is None else [k for p, k in held if p == partition]

    def meta(self, keys, *, partition="default") -> BatchMeta:
        return self.unit.meta(check_name(partition, "partition", "meta"), check_keys(keys, "meta"))

    def nbytes(self) -> int:
        """Bytes of the tensors held."""
        return self.unit.nbytes()

    def chunks(self) -> int:
        return self.unit.chunks()
