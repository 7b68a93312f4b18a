"""``BatchMeta``: what the driver holds instead of a batch — the keys of a set of samples in a
store partition, the fields every one of them has, per-sample tags and sequence lengths, and
free-form ``extra_info`` (e.g. the packing a trainer rank must use), and, where the store that
wrote them gives it, ``where``: each key's location (so a read needs no call to the store).

Metadata is small and cheap to move; the tensor columns stay in the store until a consumer
fetches exactly the fields it names. Every operation returns a new object and keeps the
per-sample lists (keys, tags, sequence lengths) aligned.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def _picked(seq: Sequence[Any], idx: list[int]) -> tuple[Any, ...]:
    """``seq``'s entries at ``idx`` as a tuple, in one C-level step (``itemgetter``) where there are several."""
    return operator.itemgetter(*idx)(seq) if len(idx) > 1 else tuple([seq[i] for i in idx])


def _positions(indices: Any, what: str) -> list[int]:
    """``indices`` as a list of ``int`` (numpy and torch integers too): ``TypeError`` for a float, a string or a
    boolean mask (``True`` would otherwise read as position 1), naming the method."""
    items = list(indices)
    if str(getattr(indices, "dtype", "")) in ("bool", "torch.bool") or bool in set(map(type, items)):
        raise TypeError(f"BatchMeta.{what}: positions expected, not a boolean mask")
    try:
        return list(map(operator.index, items))
    except TypeError as e:
        raise TypeError(f"BatchMeta.{what}: positions must be integers ({e})") from None


def _refuse_duplicates(keys: Sequence[str], partition: str) -> None:
    """``ValueError`` naming up to three keys that occur more than once."""
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})[:3]
        raise ValueError(f"BatchMeta: duplicate keys {dup} in partition {partition!r}")


def _refuse_misaligned(n: int, tags: Sequence[Any], seq_lens: Sequence[int] | None, where: Any) -> None:
    """``ValueError`` naming the counts where the tags, seq_lens or locations are not one per key."""
    for what, items in (("tags", tags), ("seq_lens", seq_lens), ("locations", where)):
        if items is not None and len(items) != n:
            raise ValueError(f"BatchMeta: {len(items)} {what} for {n} keys")


@dataclass(frozen=True)
class BatchMeta:
    """The samples ``keys`` of store partition ``partition``, described without their data.

    Owns nothing in the store: it names keys; whoever holds it fetches (``Store.get``) or clears
    them. ``fields``: the fields every key has (as written or as ``Store.meta`` found them, not
    re-checked). ``tags``: one dict per key (default: an empty dict each). ``seq_lens``: one
    int per key, or None when unknown. ``extra_info``: free-form (e.g. a rank's packing).
    ``where``: one location per key, opaque (the backend that wrote the keys made them and is the
    only one that reads them; e.g. ``RayStore(trust_meta=True)`` names the object holding each
    row), or None: a tuple, or, in a meta the backend built itself, an immutable sequence of its own
    that may offer ``select(positions)`` (non-negative, in range, distinct) giving the same kind for
    those entries (``RayStore``'s ``PutRows``: one put's rows without a pair per key).

    Must agree: ``keys`` are unique; ``tags``, ``seq_lens`` and ``where`` have one entry per key,
    entry ``i`` describing ``keys[i]``. Checked in ``__post_init__`` (``ValueError`` naming the
    partition or both counts), which also turns the lists into tuples; ``trusted`` skips that, for
    the metas a store builds from a put it has checked and those ``select`` builds from checked ones.

    Frozen: ``select``, ``reorder``, ``chunk``, ``concat``, ``with_fields`` and
    ``with_extra_info`` return a new ``BatchMeta`` (``extra_info`` deep-copied), keeping the
    per-key entries aligned.
    """

    keys: tuple[str, ...]
    partition: str
    fields: tuple[str, ...] = ()  # fields present for every key
    tags: tuple[dict[str, Any], ...] = ()  # one dict per key (empty dicts when untagged)
    seq_lens: tuple[int, ...] | None = None  # one per key, when known
    extra_info: dict[str, Any] = field(default_factory=dict)
    where: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)  # one location per key, or None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "fields", tuple(self.fields))
        tags = tuple(dict(t) for t in self.tags) if self.tags else tuple({} for _ in self.keys)
        object.__setattr__(self, "tags", tags)
        if self.seq_lens is not None:
            object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens))
        if self.where is not None:
            object.__setattr__(self, "where", tuple(self.where))
        _refuse_duplicates(self.keys, self.partition)
        _refuse_misaligned(len(self.keys), self.tags, self.seq_lens, self.where)

    @classmethod
    def trusted(
        cls,
        keys: tuple[str, ...],
        partition: str,
        fields: tuple[str, ...],
        tags: tuple[dict[str, Any], ...],
        seq_lens: tuple[int, ...] | None = None,
        where: tuple[Any, ...] | None = None,
        extra_info: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """The meta a store builds for a put it has already checked (``normalize_put``), or ``select`` from
        a meta's checked entries: equal to what the validated constructor gives (``where`` may stay the
        backend's compact sequence instead of a tuple), without its per-key work (no copy of ``tags``, no
        duplicate check, no conversion). Only for refit's own code: the
        caller guarantees the contract above (tuples, unique ``str`` keys, ``int`` lengths, one fresh tag
        dict and one location per key, nobody else holding those dicts or ``extra_info``); nothing is
        checked. ``extra_info``: empty when not given."""
        meta = object.__new__(cls)
        for name, value in (
            ("keys", keys),
            ("partition", partition),
            ("fields", fields),
            ("tags", tags),
            ("seq_lens", seq_lens),
            ("extra_info", {} if extra_info is None else extra_info),
            ("where", where),
        ):
            object.__setattr__(meta, name, value)
        return meta

    def __reduce__(self):
        """Pickled as its fields, in the dataclass's order (``_unpickled`` takes them so: a new field goes into
        both), the tags as None where every one is empty (a put without tags: no empty dict per key on the
        wire); ``_unpickled`` checks the types and counts and builds it back."""
        tags = self.tags if any(self.tags) else None
        return (_unpickled, (self.keys, self.partition, self.fields, tags, self.seq_lens, self.extra_info, self.where))

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def total_tokens(self) -> int:
        """The sum of ``seq_lens``; ``ValueError`` when they are unknown."""
        if self.seq_lens is None:
            raise ValueError(f"BatchMeta of partition {self.partition!r} has no seq_lens")
        return sum(self.seq_lens)

    def select(self, indices: Sequence[int]) -> BatchMeta:
        """The samples at ``indices`` (positions in this meta, negative ones from the end), in that
        order. ``IndexError`` naming the positions out of range; ``ValueError`` for a position given twice
        (the keys would repeat). Built from this meta's checked entries without checking each again:
        tags copied, ``where`` kept compact where it offers ``select`` (``RayStore``'s ``PutRows``)."""
        n = len(self.keys)
        idx = _positions(indices, "select")
        if idx and not -n <= min(idx) <= max(idx) < n:
            bad = [i for i in idx if not -n <= i < n]
            raise IndexError(f"BatchMeta.select: indices {bad[:3]} out of range for {n} keys")
        if idx and min(idx) < 0:
            idx = [i % n for i in idx]
        keys, lens, where = self.keys, self.seq_lens, self.where
        if len(set(idx)) != len(idx):
            _refuse_duplicates([keys[i] for i in idx], self.partition)
        if where is not None:  # an empty selection: no location, as the validated constructor made it
            where = where.select(idx) if idx and hasattr(where, "select") else _picked(where, idx)
        return BatchMeta.trusted(
            _picked(keys, idx),
            self.partition,
            self.fields,
            tuple(map(dict.copy, _picked(self.tags, idx))),
            None if lens is None else _picked(lens, idx),
            where,
            copy.deepcopy(self.extra_info) if self.extra_info else {},
        )

    def reorder(self, perm: Sequence[int]) -> BatchMeta:
        """Sample ``i`` of the result is sample ``perm[i]`` of this one; ``perm`` must be a
        permutation of ``range(len(self))``."""
        perm = _positions(perm, "reorder")  # read once: an iterator is not used up by the check
        if sorted(perm) != list(range(len(self))):
            raise ValueError(f"BatchMeta.reorder: not a permutation of range({len(self)}): {perm[:8]}...")
        return self.select(perm)

    def chunk(self, n: int) -> list[BatchMeta]:
        """``n`` consecutive parts whose sizes differ by at most one (the first ones larger);
        ``n`` may exceed ``len(self)``, giving empty parts."""
        if n < 1:
            raise ValueError(f"BatchMeta.chunk: n must be >= 1, got {n}")
        q, r = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            size = q + (1 if i < r else 0)
            out.append(self.select(range(start, start + size)))
            start += size
        return out

    def with_fields(self, fields: Sequence[str]) -> BatchMeta:
        """The same samples with ``fields`` added to ``self.fields`` (order kept, no repeats)."""
        return BatchMeta(
            self.keys,
            self.partition,
            tuple(dict.fromkeys([*self.fields, *fields])),
            self.tags,
            self.seq_lens,
            copy.deepcopy(self.extra_info),
            self.where,
        )

    def with_extra_info(self, **info: Any) -> BatchMeta:
        """The same samples with ``info`` merged into ``extra_info`` (``info`` wins)."""
        return BatchMeta(
            self.keys,
            self.partition,
            self.fields,
            self.tags,
            self.seq_lens,
            {**copy.deepcopy(self.extra_info), **info},
            self.where,
        )

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        """The samples of ``metas`` one after another; all in one partition. Fields: those every
        part has. seq_lens and where: kept when every part has them. extra_info: merged, later parts
        win."""
        if not metas:
            raise ValueError("BatchMeta.concat: nothing to concatenate")
        parts = {m.partition for m in metas}
        if len(parts) > 1:
            raise ValueError(f"BatchMeta.concat: metas from different partitions {sorted(parts)}")
        fields = [f for f in metas[0].fields if all(f in m.fields for m in metas)]
        lens = None
        if all(m.seq_lens is not None for m in metas):
            lens = [n for m in metas for n in m.seq_lens]  # type: ignore[union-attr]
        where = None
        if all(m.where is not None for m in metas):
            where = [w for m in metas for w in m.where]  # type: ignore[union-attr]
        info: dict[str, Any] = {}
        for m in metas:
            info.update(copy.deepcopy(m.extra_info))
        return BatchMeta(
            keys=[k for m in metas for k in m.keys],
            partition=metas[0].partition,
            fields=fields,
            tags=[t for m in metas for t in m.tags],
            seq_lens=lens,
            extra_info=info,
            where=where,
        )


def _unpickled(keys, partition, fields, tags, seq_lens, extra_info, where) -> BatchMeta:
    """``BatchMeta.__reduce__``'s inverse: one fresh empty dict per key where ``tags`` is None; a count that
    does not match the keys raises ``ValueError`` (as the constructor would) instead of making a meta whose
    entries are not aligned, and so does a field of the wrong kind. Its entries are not checked one by one
    again (O(1) here): they were when it was built."""
    kinds = ((keys, tuple), (partition, str), (fields, tuple), (extra_info, dict))
    if not all(isinstance(v, t) for v, t in kinds) or not all(v is None or type(v) is tuple for v in (tags, seq_lens)):
        raise ValueError("BatchMeta: not a pickled meta (keys, fields, tags and seq_lens are tuples, partition a str)")
    tags = tuple([{} for _ in keys]) if tags is None else tags
    _refuse_misaligned(len(keys), tags, seq_lens, where)
    return BatchMeta.trusted(keys, partition, fields, tags, seq_lens, where, extra_info)
