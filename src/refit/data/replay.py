"""Replay buffer for asynchronous RL: references to trajectories in the store, tagged with the
weight version that generated them and the version they are meant to train.

- ``add(meta, generated_version, target_version=None)``: one entry (a trajectory or a GRPO
  group: any number of keys).
- ``sample(n, current_version, select_fields=[...])``: the ``n`` oldest eligible entries, each
  returned exactly once: eligible means generated at most ``max_age`` versions ago and targeting
  ``current_version`` or earlier. Their fields are taken from the store (``Store.take``: read
  and cleared in one step), under one lock (a concurrent ``add`` cannot race the clear). Returns ``None`` (and
  takes nothing) when fewer than ``n`` are eligible. If the fetch fails the entries stay in the
  buffer and the error propagates: nothing is lost.
- Entries older than ``max_age`` are dropped and their keys cleared at the next ``sample`` (they
  can never become eligible again); ``stats()`` counts them. ``close()`` clears whatever is left.

No key outlives its entry: consumed, expired or closed, the keys are cleared.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from refit.errors import DataError

from .meta import BatchMeta
from .store import Rows, Store


@dataclass(frozen=True)
class Entry:
    """One ``ReplayBuffer.add``: the keys of a trajectory or a GRPO group, the weight version
    that generated them, and the earliest version allowed to train on them (None: any)."""

    meta: BatchMeta
    generated_version: int
    target_version: int | None


@dataclass
class ReplayStats:
    """A ``ReplayBuffer``'s counters since it was built (``stats()`` returns a copy).

    ``added`` / ``consumed`` / ``expired``: entries; ``keys_cleared``: store keys the buffer
    cleared (consumed, expired or closed, as ``Store.clear`` counted them); ``ages``: per
    consumed entry, ``current_version - generated_version``, in the order they were sampled.
    """

    added: int = 0
    consumed: int = 0
    expired: int = 0
    keys_cleared: int = 0
    ages: list[int] = field(default_factory=list)  # age (current - generated) of each consumed entry


class BufferFull(DataError):
    """``ReplayBuffer.add`` on a buffer already holding ``max_size`` entries; nothing was added."""


class ReplayBuffer:
    """Entries (``BatchMeta`` of keys in ``store``) by weight version; the module docstring
    gives the eligibility and expiry rules.

    Owns: its entries and, from ``add`` on, their keys in the store: it clears them when they
    are sampled, expire or at ``close()`` (the caller must not clear them itself). The store is
    the caller's. ``max_age >= 0``; ``max_size``: None (unbounded) or ``>= 1`` entries
    (``ValueError`` naming the value).

    Lifecycle: ``add`` (rollout workers) and ``sample`` (the trainer) in any order, from any
    threads: every method takes one lock, and ``sample`` holds it across its store ``take``.
    ``close()`` when done: clears the keys still held.

    Must agree: ``current_version`` (``sample``, ``eligible``) and ``generated_version`` /
    ``target_version`` (``add``) count the same weight versions. Entries expired at one
    ``sample`` are gone, even if a later call passes a smaller version. The entries one
    ``sample`` takes must share a partition (``BatchMeta.concat`` raises otherwise; they stay).
    """

    def __init__(self, store: Store, max_age: int, max_size: int | None = None) -> None:
        if max_age < 0:
            raise ValueError(f"ReplayBuffer: max_age must be >= 0, got {max_age}")
        if max_size is not None and max_size < 1:
            raise ValueError(f"ReplayBuffer: max_size must be >= 1, got {max_size}")
        self.store, self.max_age, self.max_size = store, max_age, max_size
        self._entries: list[Entry] = []
        self._lock = threading.Lock()
        self._stats = ReplayStats()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def add(self, meta: BatchMeta, generated_version: int, target_version: int | None = None) -> None:
        """Hold ``meta`` (at least one key) as one entry. ``ValueError`` for an empty meta or
        ``target_version < generated_version``; ``BufferFull`` at ``max_size`` entries."""
        if len(meta) == 0:
            raise ValueError("ReplayBuffer.add: an entry needs at least one key")
        if target_version is not None and target_version < generated_version:
            raise ValueError(
                f"ReplayBuffer.add: target_version {target_version} < generated_version {generated_version}"
            )
        with self._lock:
            if self.max_size is not None and len(self._entries) >= self.max_size:
                raise BufferFull(f"ReplayBuffer.add: full ({len(self._entries)} of max_size={self.max_size} entries)")
            self._entries.append(Entry(meta, int(generated_version), target_version))
            self._stats.added += 1

    def _eligible(self, e: Entry, current: int) -> bool:
        return current - e.generated_version <= self.max_age and (
            e.target_version is None or e.target_version <= current
        )

    def _expire(self, current: int) -> None:
        stale = [e for e in self._entries if current - e.generated_version > self.max_age]
        if not stale:
            return
        for e in stale:
            self._stats.keys_cleared += self.store.clear(e.meta)
        self._entries = [e for e in self._entries if current - e.generated_version <= self.max_age]
        self._stats.expired += len(stale)

    def eligible(self, current_version: int) -> int:
        """How many entries a ``sample`` at ``current_version`` could take (drops nothing)."""
        with self._lock:
            return sum(self._eligible(e, current_version) for e in self._entries)

    def sample(
        self, n: int, current_version: int, *, select_fields: Sequence[str], copy: bool = False
    ) -> tuple[BatchMeta, dict[str, Rows]] | None:
        """Drop expired entries, then take the ``n`` oldest eligible ones (in ``add`` order):
        their concatenated ``BatchMeta`` and ``{field: rows}`` for ``select_fields`` (as
        ``Store.get``: read-only views where it can, which stay valid after the clear; private
        writable tensors with ``copy=True``), their keys cleared in the same step (``Store.take``:
        exactly-once). None, taking nothing, when fewer than ``n`` are eligible; a failed take
        propagates, clears nothing and leaves them in the buffer."""
        if n < 1:
            raise ValueError(f"ReplayBuffer.sample: n must be >= 1, got {n}")
        with self._lock:
            self._expire(current_version)
            picked = [e for e in self._entries if self._eligible(e, current_version)][:n]
            if len(picked) < n:
                return None
            meta = BatchMeta.concat([e.meta for e in picked])
            data = self.store.take(
                meta, select_fields=select_fields, copy=copy
            )  # raises: nothing cleared, entries stay
            ids = {id(e) for e in picked}
            self._entries = [e for e in self._entries if id(e) not in ids]
            self._stats.keys_cleared += len(meta)
            self._stats.consumed += len(picked)
            self._stats.ages.extend(current_version - e.generated_version for e in picked)
            return meta, data

    def close(self) -> int:
        """Clear every remaining entry's keys; returns how many keys were held."""
        with self._lock:
            n = sum(self.store.clear(e.meta) for e in self._entries)
            self._stats.keys_cleared += n
            self._entries = []
            return n

    def stats(self) -> ReplayStats:
        """A copy of the counters."""
        with self._lock:
            return ReplayStats(
                self._stats.added,
                self._stats.consumed,
                self._stats.expired,
                self._stats.keys_cleared,
                list(self._stats.ages),
            )
