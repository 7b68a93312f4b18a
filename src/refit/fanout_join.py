"""Late joiners of a fan-out with deltas: a replica that holds no version, or another one than the fleet's (its
engine reloaded its weights: ``Fanout.invalidate``), reads the fleet's previous version dense from its peer
replicas in a join wave before the version's waves (the trainer is no source of it), then takes the delta to the
new version in its own wave like every other replica. The trainer's uplink carries only deltas, and the waves'
plans do not change, so every source keeps its base and every other replica its deltas.

Before each refit with deltas every process publishes the version it holds (``held_of``); every process reads them
all and agrees on the join (``join_of``): the late replicas, the fleet's previous version (the first trainer
process's) and the replicas that hold it, the join's sources. No join where the fleet holds no version yet, where
no replica is late, or where no replica holds the previous version (the late ones then read dense from their
wave's sources, the trainer among them).
"""

from __future__ import annotations

from collections.abc import Iterable

from refit.transport.store import SignedStore

JOIN = -1  # the join wave's index (its store keys, its Peer; the waves are 0, 1, ...)
NONE = -1  # what a process publishes when it holds no version


def held_of(store: SignedStore, key: str, proc: int, held: int | None, procs: Iterable[int], timeout_s: float):
    """Publish ``held`` (None: no version) under ``{key}/{proc}`` and read every process of ``procs``' within
    ``timeout_s``: ``{process: version or None}``, a silent process left out (the waves find it dead)."""
    store.put(f"{key}/{proc}", NONE if held is None else held)
    got = store.wait_all([f"{key}/{p}" for p in procs], timeout_s)
    out = {}
    for p in procs:
        v = got.get(f"{key}/{p}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < NONE):
            raise ValueError(f"fan-out join: process {p} published {v!r} as the version it holds, not an int >= -1")
        if v is not None:
            out[p] = None if v == NONE else v
    return out


def join_of(
    held: dict[int, int | None], coordinator: int, replica_procs: list[list[int]], dead: frozenset[int]
) -> tuple[list[int], list[int], int | None]:
    """``(late replicas, replicas holding the previous version, that version)`` from ``held`` (``held_of``): the
    previous version is the ``coordinator``'s; a replica is late where one of its live processes published another
    (a silent one is neither late nor a source). ``([], [], None)`` where there is nothing to join."""
    prev = held.get(coordinator)
    alive = [j for j, ps in enumerate(replica_procs) if not set(ps) & dead and all(p in held for p in ps)]
    late = [j for j in alive if any(held[p] != prev for p in replica_procs[j])]
    sources = [j for j in alive if j not in late]
    if prev is None or not late or not sources:
        return [], [], None
    return late, sources, prev
