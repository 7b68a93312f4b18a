"""Where a put's rows are, for ``RayStore(trust_meta=True)``: ``Placed`` (one put, as its ``BatchMeta``
names it) and ``PendingPuts`` (a client's puts whose storage actor's reply was not read yet).

A ``trust_meta`` put returns before its storage actor has recorded it; the reply (None, or why the put
was refused) is read later. ``PendingPuts`` keeps those puts (each one's reply reference and keys, not
its object) until it reads their replies: every refusal is raised once, all of them in one
``ValueError``, and a put that writes keys a pending put wrote can wait for it first (the storage actor
is threaded: Ray would not keep their order). Thread-safe (one lock). Needs Ray only when it reads
replies.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from .meta import BatchMeta


class Placed:
    """Where one put's rows are, as ``RayStore(trust_meta=True)`` records them in its ``BatchMeta``
    (each key's location is ``(placed, row)``): the put's object and the reply of its storage
    actor's call (each in a list: Ray passes the reference, not the value), the fields it holds,
    its origin (a random token and the time the put was made, ``<hex>@<time>``, which the storage actor
    keeps with its rows: a take or clear through the meta acts only on rows of this put) and what the
    put was (for errors). The reply resolves to None, or why the put was refused; only the writer's
    own ``Placed`` holds it (pickled, ``reply`` is None)."""

    __slots__ = ("holder", "reply", "fields", "origin", "what")

    def __init__(self, holder: list, reply: list | None, fields: tuple[str, ...], origin: str, what: str) -> None:
        self.holder, self.reply, self.fields, self.origin, self.what = holder, reply, fields, origin, what

    def __reduce__(self):
        """Pickled without the reply, which stays with the writer (its ``PendingPuts`` reads it). A get
        through the meta needs no reply, and a call that carried a reference to a reply not yet in started
        1-2 ms later (measured: 4 DP readers of a share, stop 44); a take or clear through a shipped meta
        waits for the put at its storage actor instead (``ray_store.ARRIVAL_WINDOW_S``)."""
        return (Placed, (self.holder, None, self.fields, self.origin, self.what))


class PutRows(Sequence):
    """``BatchMeta.where`` for rows of one put, without a tuple per key: entry ``i`` is
    ``(placed, rows[i])`` (a sequence equal, item by item, to ``tuple((placed, r) for r in rows)``).
    ``rows``: ``range(n)`` for a whole put as it returned it, a tuple of rows after ``select``. Pickles
    as ``(placed, rows)``. Immutable; ``BatchMeta.select`` (so ``reorder`` and ``chunk``) keeps it
    compact, ``concat`` and the validated constructor turn it into pairs, so a read through the meta
    of a put, or of a DP rank's share of it, finds its one put and its rows in O(1)."""

    __slots__ = ("placed", "rows")

    def __init__(self, placed: Placed, rows: range | tuple[int, ...]) -> None:
        self.placed, self.rows = placed, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        if not -len(self.rows) <= i < len(self.rows):
            raise IndexError(f"PutRows: index {i} out of range for {len(self.rows)} rows")
        return (self.placed, self.rows[i])

    def __iter__(self):
        return zip(itertools.repeat(self.placed, len(self.rows)), self.rows)

    def __eq__(self, other: object) -> bool:  # equal to its pairs, as the tuple it stands for
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple whose hash it does not share: unhashable

    def select(self, indices: list[int]) -> PutRows:
        """The entries at ``indices`` (checked by the caller: in range, not negative), still compact."""
        rows = self.rows
        return PutRows(self.placed, tuple(indices) if rows == range(len(rows)) else tuple(rows[i] for i in indices))

    def __reduce__(self):
        return (PutRows, (self.placed, self.rows))


def placed_of(where: Any) -> list[Placed] | None:
    """The ``Placed`` of each entry of a meta's ``where`` (once for a ``PutRows``), or None where an
    entry is not a ``(Placed, row)`` pair (not a ``trust_meta`` store's meta)."""
    if isinstance(where, PutRows):
        return [where.placed]
    try:
        puts, _ = zip(*where)
    except (TypeError, ValueError):
        return None
    return list(puts) if all(map(isinstance, puts, itertools.repeat(Placed))) else None  # in C


def origins(where: Any) -> str | list[str]:
    """Per key, the origin of the put whose rows a meta's ``where`` names; one ``str`` for a ``PutRows``
    (every key is that put's): what a take or clear through the meta sends its storage actor."""
    if isinstance(where, PutRows):
        return where.placed.origin
    return [p.origin for p, _ in where]


def refused(whats: list[str], replies: list) -> None:
    """Raise every refusal among the replies of these puts (``whats``: what each put was), in one
    ``ValueError``."""
    bad = [f"{err} ({what})" for what, err in zip(whats, replies) if err]
    if bad:
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(
            f"{len(bad)} put(s) refused by the storage actor after they returned (trust_meta): "
            + "; ".join(bad[:3])
            + more
        )


class PendingPuts:
    """One client's ``trust_meta`` puts not confirmed yet: each put's reply reference, what it was, its
    partition and keys. Not the put's object: a put whose keys were taken or cleared elsewhere is freed
    as soon as no meta names it, not at this client's next call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[Any, str, str, frozenset]] = []  # (reply ref, what, partition, keys)

    def add(self, placed: Placed, partition: str, keys: list[str]) -> None:
        with self._lock:
            self._items.append((placed.reply[0], placed.what, partition, frozenset(keys)))

    def touches(self, partition: str, keys: list[str]) -> bool:
        """Whether a pending put wrote some of ``keys`` of ``partition``."""
        with self._lock:
            return any(p == partition and not held.isdisjoint(keys) for _, _, p, held in self._items)

    def confirm(self, block: bool, meta: Any = None) -> None:
        """Raise the refusals among the replies of the pending puts (all of them, or, unless ``block``,
        those already in) and of the puts ``meta`` names."""
        refused(*self.replies(block, meta))

    def replies(self, block: bool, meta: Any = None) -> tuple[list[str], list]:
        """What each put whose reply was read was (pending ones, and ``meta``'s), and those replies; a put
        leaves the pending list (its refusal is reported once) only once its reply is read."""
        import ray

        with self._lock:
            puts = {reply: what for reply, what, _, _ in self._items}
        named = {}
        if isinstance(meta, BatchMeta) and meta.where is not None:
            where = [(meta.where.placed, 0)] if isinstance(meta.where, PutRows) else meta.where
            named = {p.reply[0]: p.what for p, _ in where if isinstance(p, Placed) and p.reply is not None}
        puts.update(named)
        if not puts:
            return [], []
        refs = list(puts)
        done = refs if block else ray.wait(refs, num_returns=len(refs), timeout=0)[0]
        replies = ray.get(done)
        with self._lock:  # a pending put another thread read meanwhile was reported there
            still = {e[0] for e in self._items}
            ready = set(done)
            self._items = [e for e in self._items if e[0] not in ready]
        ours = [i for i, r in enumerate(done) if r in still or r in named]
        return [puts[done[i]] for i in ours], [replies[i] for i in ours]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
