"""Late joiners of a fan-out with deltas: a replica that holds no version, or another one than the fleet's (its
engine reloaded its weights: ``Fanout.invalidate``), reads the fleet's previous version dense from its peer
replicas in a join wave before the version's waves (the trainer is no source of it), then takes the delta to the
new version in its own wave like every other replica. The trainer's uplink carries only deltas, and the waves'
plans do not change, so every source keeps its base and every other replica its deltas.

Before each refit with deltas every process publishes the version it holds; the coordinator (the first trainer
process) reads them all and publishes the join (``agree_join``): the late replicas, the fleet's previous version
(its own) and the replicas that hold it, the join's sources; every other process reads that one record. No join
where the fleet holds no version yet, where no replica is late, or where no replica holds the previous version
(the late ones then read dense from their wave's sources, the trainer among them).
"""

from __future__ import annotations

from refit.errors import FanoutError
from refit.transport.store import SignedStore

JOIN = -1  # the join wave's index (its store keys, its Peer; the waves are 0, 1, ...)
NONE = -1  # what a process publishes when it holds no version


def agree_join(
    store: SignedStore,
    key: str,
    proc: int,
    held: int | None,
    members: list[int],
    replica_procs: list[list[int]],
    dead: frozenset[int],
    timeout_s: float,
) -> tuple[list[int], list[int], int | None]:
    """Publish ``held`` (None: no version) under ``{key}/held/{proc}``; the coordinator (``members[0]``) waits up to
    ``timeout_s`` for every member's (a silent one is left out: the waves find it dead), decides (``join_of``) and
    publishes ``{key}/join``, which every other member reads (``FanoutError`` past twice ``timeout_s``, or for a
    record that is not a join). Returns ``(late replicas, their sources, the previous version)``."""
    store.put(f"{key}/held/{proc}", NONE if held is None else held)
    if proc == members[0]:
        got = store.wait_all([f"{key}/held/{p}" for p in members], timeout_s)
        versions = {p: _version(got[f"{key}/held/{p}"], p) for p in members if f"{key}/held/{p}" in got}
        late, sources, prev = join_of(versions, proc, replica_procs, dead)
        store.put(f"{key}/join", {"late": late, "sources": sources, "prev": NONE if prev is None else prev})
        return late, sources, prev
    try:
        rec = store.get(f"{key}/join", 2 * timeout_s)
    except (TimeoutError, RuntimeError, OSError) as e:
        raise FanoutError(f"fan-out join: process {proc} waited {2 * timeout_s:.0f}s for {key}/join ({e})") from e
    n = len(replica_procs)
    ok = isinstance(rec, dict) and set(rec) == {"late", "sources", "prev"}
    ok = ok and all(isinstance(rec[k], list) and all(_int(j, 0, n - 1) for j in rec[k]) for k in ("late", "sources"))
    if not ok or not _int(rec["prev"], NONE, 1 << 62):
        raise FanoutError(f"fan-out join: {key}/join holds {str(rec)[:120]}, not {{late, sources, prev}}")
    return rec["late"], rec["sources"], None if rec["prev"] == NONE else rec["prev"]


def _int(v: object, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _version(v: object, p: int) -> int | None:
    """A published version (``NONE``: no version), checked."""
    if not _int(v, NONE, 1 << 62):
        raise FanoutError(f"fan-out join: process {p} published {v!r} as the version it holds, not an int >= -1")
    return None if v == NONE else v


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
