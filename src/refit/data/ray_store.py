"""The Ray backend of the rollout store: key metadata in storage actors (one per partition,
chosen by a stable hash of the partition's name), payloads in Ray's object store.

Per operation, one control round trip: a put is one ``ray.put`` of the encoded fields plus one
call to the partition's storage actor, which checks (refusing a field a key already has, unless
``overwrite``) and records every key in one step; a get is one call (where the keys' rows are)
plus the ``ray.get`` of those objects; a clear is one call, and so is a ``take`` (get and
clear). A tensor travels as its raw bytes in a numpy uint8 array plus dtype and shape, so any
dtype, bf16 included, survives bit for bit, and Ray moves it zero-copy: a reader on the
object's node maps the bytes without copying them, and ``get`` returns views of that shared
memory (read-only by contract) where the rows asked for are one run of consecutive rows of one
put, in order; other selections (a DP rank's balanced share) are gathered with one vectorized
gather per put. ``copy=True`` gives private writable tensors.

Ownership. Ray ties an object's life to its owner, the process that put it. ``durable=True``
(the default) makes the data outlive the writer (a rollout worker may exit before the trainer
reads): in the call that records the keys, the storage actor maps the writer's object (zero-copy:
this pins its bytes, which then outlive the writer), and a background thread of the actor (at a lower
scheduling priority, ``ADOPT_NICE``) copies it into an object the actor owns, one copy per put, off the
writer's path. Until that copy exists
readers get the writer's object; one that finds the writer gone asks again and waits for the
copy; ``take`` waits for it before it drops the keys (a take that fails clears nothing); at most
``MAX_PENDING_COPIES`` copies queue per storage actor (then a put waits: pinned memory stays
bounded); a copy that fails keeps the pin and is tried again when a reader or ``settle()`` needs
it. The pin's survival is relied on within one node (the storage actor maps the object where it
runs). Ray used to offer ``ray.put(..., _owner=actor)`` to name another owner without a copy; Ray
2.56 removed it (Ray 2.60 raises ``ValueError``), so no public API gives ownership without that copy.
``durable=False`` keeps the writer's object as is (no copy); its keys become unreadable (Ray
raises an owner-died error) once the writer exits.

A put is atomic: one partition lives on one actor and the actor checks and records a put's keys
in one call, so a refused put writes nothing, and a writer killed mid-put either reached the
actor (the whole batch is recorded) or did not (nothing is; its orphaned object is freed by Ray
with its owner). An object is freed when the last of its rows is cleared (a durable put's copy
still queued is then skipped, and the writer's bytes unpinned when the copy thread reaches it).

Reads through the meta (``trust_meta=True``). A put's ``BatchMeta`` then carries where each row
is (``BatchMeta.where``: the put's object reference and the row), and a ``get`` through such a meta
reads those objects directly: no call to the storage actor at all, the same ``ray.get`` a plain
``ray.put``/``ray.get`` pipeline makes. Each such put has an origin (a random token and the time the
put was made) the storage actor keeps with its rows. A put submits its call and returns without
waiting for the reply; a refusal (a key that already has the field) is raised by this client's next
call before that call does anything (``put`` raises the refusals already in), or by ``confirm()``;
a put that overwrites, or writes keys one of this client's pending puts wrote, first waits for those
(the storage actor is threaded: Ray would not keep their order). A writer that may exit right after its puts calls
``confirm()`` first: until the storage actor has recorded a put, and for a durable one pinned its
bytes, the put lives only in its writer. A ``take`` through the meta reads the replies of its puts
(those this client made) and of this client's pending ones (raising refusals), then the objects,
then drops the keys in one call that checks each key still holds its put's rows (same origin), so
exactly-once holds: a refused put's rival, or a key taken and written again or overwritten since,
raises ``MissingKeyError`` and nothing is dropped. A ``clear`` through such a meta drops only the
keys holding its puts' rows. A meta pickled or copied (a DP rank's share sent to a trainer rank)
carries no reply (``Placed``): a call that carried a reference to a reply not yet in started 1-2 ms
later, and a get needs none. A take or clear through such a meta learns the put's fate at its
storage actor instead. The actor knows each ``trust_meta`` put from the start of its call and
remembers it, recorded or refused, for ``2 * ARRIVAL_WINDOW_S`` (at most ``MAX_ARRIVALS``); a take
or clear that finds keys not its put's, where the put is new since it first looked or has not
arrived, waits for it (while its call runs there, up to ``SETTLE_TIMEOUT_S``; otherwise until
``ARRIVAL_WINDOW_S`` after the put was made: an origin carries its time on the writer's clock, so
clocks further apart than that make such a take fail at once instead of waiting), then tries once
more, and a refused put's take raises its refusal (``ValueError``). These calls run on threads of
their own (``AWAITS``), so the puts they wait for are never queued behind them. A take whose
durable writer died (read through ``locate``) and a get of fields the meta's put did not write
do not wait: they see the put once it is recorded, as any other client does. The trade, opt-in
because it weakens the contract: a get through a meta
does not ask the store, so it returns the rows that put wrote even after they were overwritten,
refused or cleared; a meta keeps its objects in the object store until it is dropped (a durable
put's object beside the storage actor's copy: twice its bytes while the meta lives); and another
client sees a put only once it is recorded (read through the meta, or have the writer
``confirm()``). Gets by key list, and fields the meta's put did not write, go through the storage
actor as usual.

Trade-offs: a reader on another node pulls the whole objects that hold its rows (Ray moves
objects, not rows): put batches the size you want readers to move. One partition's metadata is
served by one actor (spread partitions to spread the load). Two writers racing on the same keys
are serialized by the actor's lock (the second is refused, or overwrites with ``overwrite=True``).

The client (``RayStore``) is a small picklable object: pass it to rollout workers and trainer ranks.
Pickled, it carries its storage actors' names (they are named actors), not their handles: Ray registers
every handle it unpickles, which cost more per call than the rest of a get through a ``trust_meta`` meta
(which needs no actor); a client looks the handles up by name once per process, when first needed. The
actors live as long as the store that made them (until ``shutdown()`` or until it is dropped): clients do
not keep them alive. Nothing refit reads is unpickled outside Ray's own transport.
"""

from __future__ import annotations

__all__ = ["RayStore", "encode", "decode"]  # encode/decode: the storage actor's (ray_actor), re-exported

import contextlib
import threading
import time
import uuid
import zlib
from typing import Any

from .inputs import FieldData, check_keys, check_name, normalize_put
from .meta import BatchMeta
from .placed import PendingPuts, Placed, PutRows, origins, placed_of
from .ray_actor import (
    AWAIT_THREADS,
    AWAITS,
    SETTLE_TIMEOUT_S,
    _decode_field,
    _encode_field,
    _StorageActor,
    decode,
    encode,
)
from .store import Rows, Store, gather, group_rows

try:
    import ray
except ImportError:  # pragma: no cover - exercised only without ray
    ray = None


def _objects(located: dict[str, list]) -> dict[Any, Any]:
    """Every object ``locate`` named, once, read all at once (zero-copy)."""
    refs = list(dict.fromkeys(holder[0] for groups in located.values() for holder, _, _, _ in groups))
    return dict(zip(refs, ray.get(refs)))


def _assemble(n: int, select: list[str], located: dict[str, list], objects: dict, copy: bool) -> dict[str, Rows]:
    """The ``n`` rows of each field asked, from per-field groups (holder ``[ref]``, field name in the
    object, positions, rows) — ``locate``'s, or a ``trust_meta`` meta's — and ``objects`` (``_objects``):
    each (object, field) decoded once, zero-copy, then ``gather`` (views where it can, unless ``copy``)."""
    decoded: dict[tuple[Any, str], FieldData] = {}
    out: dict[str, Rows] = {}
    for f in select:
        groups = []
        for holder, name, pos, rows in located[f]:
            key = (holder[0], name)
            if key not in decoded:
                decoded[key] = _decode_field(objects[holder[0]][name])
            groups.append((decoded[key], pos, rows))
        out[f] = gather(n, groups, copy)
    return out


NAMED_CACHED = 4  # stores whose storage actors' handles a process keeps (``_named``)
_named_handles: dict[tuple[str, tuple[str, ...]], list] = {}  # insertion-ordered: the oldest store goes first
_named_lock = threading.Lock()


def _named(namespace: str, names: tuple[str, ...]) -> list:
    """The storage actors ``names`` name in ``namespace`` (``ray.get_actor``), looked up once per process for
    the last ``NAMED_CACHED`` stores: a client unpickled again (one per call that passes the store) finds
    them here. Looked-up handles do not keep the actors alive: the store that made them does (until
    ``shutdown()`` or until it is dropped); ``ValueError`` from Ray where they are gone."""
    key = (namespace, names)
    with _named_lock:
        got = _named_handles.get(key)
    if got is not None:
        return got
    got = [ray.get_actor(n, namespace=namespace) for n in names]
    with _named_lock:
        _named_handles[key] = got
        while len(_named_handles) > NAMED_CACHED:
            del _named_handles[next(iter(_named_handles))]
    return got


def _check_names(names: Any, n: int) -> None:
    """A client's ``(namespace, actor names)`` as it came through a pickle: plain strings, one name per actor."""
    ok = (
        isinstance(names, tuple)
        and len(names) == 2
        and isinstance(names[0], str)
        and isinstance(names[1], tuple)
        and len(names[1]) == n >= 1
        and all(isinstance(a, str) and a.startswith("refit-store-") for a in names[1])
    )
    if not ok:
        raise ValueError(f"RayStore: not a client's actor names for {n} actors: {names!r:.200}")


def _shard(partition: str, n: int) -> int:
    return zlib.crc32(partition.encode()) % n


class RayStore(Store):
    """``RayStore(num_units=2)`` starts ``num_units`` storage actors (Ray must be initialized);
    each partition lives on one of them. ``actor_options`` go to ``.options()`` (default
    ``num_cpus=0, max_concurrency=16``; e.g. a node ``scheduling_strategy``). ``durable=True``: each
    put's object is pinned by its storage actor in the put call and copied into one the actor owns
    in the background (``settle()`` waits for those copies; correctness never needs it, but until
    then two reads of the same keys may return different memory: the writer's, then the copy). ``durable=False``
    leaves each put's object owned by the writing process: one copy less per put, but the keys
    become unreadable (Ray raises an owner-died error) once the writer exits.

    ``get`` returns read-only views where it can (the module docstring says when) and private
    writable tensors with ``copy=True``; ``put``, ``get``, ``clear`` and ``meta`` are each one
    call to one storage actor. ``trust_meta=True``: a get through a ``BatchMeta`` that a put
    returned makes no call (it reads where the meta says; it does not see later overwrites or
    clears), and a put does not wait for its record (``confirm()`` does): the module docstring says
    what that trades and keeps.

    Lifecycle: built once, on a process where ``ray.init()`` ran (the driver); pickling it
    (passing it to a Ray task or actor) gives a client of the same actors, in the same order,
    with the same ``durable`` and ``trust_meta`` (and no pending puts: they are the writer's); it
    carries the actors' names, and looks their handles up when it first needs them (a get through a
    ``trust_meta`` meta never does). The store that made the actors keeps them alive: keep it until
    no client is in use. ``shutdown()`` kills the actors, dropping every key they hold: call it once,
    when no client is in use.

    Must agree: every client routes a partition to an actor by a stable hash of its name
    modulo the number of actors, so clients must come from one store by pickling (never build
    a second one over the same keys). Two writers racing on the same keys are serialized by
    the partition's actor.
    """

    def __init__(
        self,
        num_units: int = 2,
        actor_options: dict | None = None,
        durable: bool = True,
        trust_meta: bool = False,
        _names: tuple[str, tuple[str, ...]] | None = None,
    ) -> None:
        if ray is None:
            raise ImportError("RayStore needs ray: pip install 'refit-rl[data]'")
        self.durable, self.trust_meta = durable, trust_meta
        self._pending = PendingPuts()  # trust_meta puts whose storage actor's reply was not read yet
        self._n, self._names, self._actors = num_units, _names, None
        if _names is not None:  # a client (unpickled): (namespace, actor names); handles looked up when needed
            _check_names(_names, num_units)
            return
        if num_units < 1:
            raise ValueError(f"RayStore: num_units must be >= 1, got {num_units}")
        if not ray.is_initialized():
            raise RuntimeError("RayStore: call ray.init() first")
        if actor_options and ("name" in actor_options or "namespace" in actor_options):
            raise ValueError("RayStore: actor_options may not set name or namespace (the store names its actors)")
        cls = ray.remote(concurrency_groups={AWAITS: AWAIT_THREADS})(_StorageActor)  # waits: not on the puts' threads
        # threaded: a put waiting for a copy slot or a take waiting for a copy does not hold up other
        # calls (StorageUnit is locked)
        opts = {"num_cpus": 0, "max_concurrency": 16, **(actor_options or {})}
        prefix = f"refit-store-{uuid.uuid4().hex}"
        names = tuple(f"{prefix}-{i}" for i in range(num_units))
        self._actors = [cls.options(name=n, **opts).remote() for n in names]
        self._names = (ray.get_runtime_context().namespace, names)
        ray.get([a.chunks.remote() for a in self._actors])  # started

    @property
    def actors(self) -> list:
        """The storage actors' handles. A pickled client carries their names, not the handles: Ray
        registers every handle (and every object reference) it unpickles, which cost ~0.3-0.5 ms per call
        that passes the store (measured, stop 42), and a get through a ``trust_meta`` meta needs no actor.
        A client looks the handles up by name when it first needs them, once per process (``_named``)."""
        if self._actors is None:
            self._actors = _named(*self._names)
        return self._actors

    def __reduce__(self):
        return (RayStore, (self._n, None, self.durable, self.trust_meta, self._names))

    def shutdown(self) -> None:
        """Kill the storage actors (everything they hold is lost); no client can be used after."""
        for a in self.actors:
            ray.kill(a)
        self._actors = []
        if self._names is not None:
            with _named_lock:
                _named_handles.pop(self._names, None)

    def _unit(self, partition: str) -> Any:
        return self.actors[_shard(partition, len(self.actors))]

    def put(self, keys, fields, *, partition="default", tags=None, seq_lens=None, overwrite=False) -> BatchMeta:
        keys, fields, tag_list, lens = normalize_put(keys, fields, tags, seq_lens, partition)
        names = tuple(fields)
        origin = self._ordered(partition, keys, overwrite) if self.trust_meta else None
        ref = ray.put({n: _encode_field(d) for n, d in fields.items()})
        tags_arg = tag_list if any(tag_list) else None
        call = (partition, keys, [ref], names, tags_arg, lens, overwrite, self.durable, origin)
        reply = self._unit(partition).put.remote(call)  # one argument: Ray serializes each argument apart
        where = None
        if origin is None:
            err = ray.get(reply)
            if err:
                raise ValueError(err)
        else:
            placed = Placed([ref], [reply], names, origin, f"a put of {len(keys)} keys to partition {partition!r}")
            self._pending.add(placed, partition, keys)
            where = PutRows(placed, range(len(keys)))
        lens = None if lens is None else tuple(lens)
        return BatchMeta.trusted(tuple(keys), partition, names, tuple(tag_list), lens, where)  # normalize_put checked

    def _ordered(self, partition: str, keys: list[str], overwrite: bool) -> str:
        """Before a ``trust_meta`` put: raise the refusals already in (this put is then not made), wait for
        this client's pending puts where this one overwrites or writes keys they wrote (the storage actor is
        threaded: Ray would not keep their order); the new put's origin."""
        self._pending.confirm(block=False)
        if overwrite or self._pending.touches(partition, keys):
            self._pending.confirm(block=True)
        return f"{uuid.uuid4().hex}@{time.time():.3f}"  # when: how long a take through a shipped meta waits for it

    def confirm(self) -> None:
        """Wait for the storage actors' replies to this client's ``trust_meta`` puts; one ``ValueError``
        naming every one refused. Every other call of this client does this first (``put`` checks the
        replies already in, and waits for them where it writes keys a pending put wrote)."""
        self._pending.confirm(block=True)

    def get(self, keys, *, select_fields, partition=None, copy=False) -> dict[str, Rows]:
        return self._fetch(keys, select_fields, partition, copy, clear=False)

    def take(self, keys, *, select_fields, partition=None, copy=False) -> dict[str, Rows]:
        return self._fetch(keys, select_fields, partition, copy, clear=True)

    def _fetch(self, keys, select_fields, partition, copy: bool, clear: bool) -> dict[str, Rows]:
        placed = self._placed(keys, select_fields)
        keys_arg = keys
        keys, partition, select = self._request(keys, partition, select_fields)
        if placed is not None:
            return self._fetch_placed(placed, keys_arg, partition, keys, select, copy, clear)
        self._pending.confirm(True, keys_arg)
        return self._located(partition, keys, select, copy, clear)

    def _located(self, partition, keys, select, copy: bool, clear: bool, expect=None) -> dict[str, Rows]:
        """Read through the storage actor (``locate``, then the objects it names)."""
        try:
            located, objects = self._read(partition, keys, select, clear, False, expect)
        except ray.exceptions.ObjectLostError:
            if not self.durable:
                raise
            # a writer died before the storage actor's copy existed: ask again, for the copies
            # (a take never gets here: its locate waits for them)
            located, objects = self._read(partition, keys, select, False, True, expect)
        return _assemble(len(keys), select, located, objects, copy)

    def _placed(self, keys: Any, select_fields: Any) -> list | None:
        """The meta's locations grouped by put (``group_rows``: (placed, positions, rows), one per put,
        even where pickling made several ``Placed`` of it; at once for a ``PutRows``), where this store
        trusts them and they cover every field asked; else None."""
        if not (self.trust_meta and isinstance(keys, BatchMeta) and keys.where is not None):
            return None
        where = keys.where
        if len(where) != len(keys.keys):  # only a meta built around the checks (``trusted``) gets here
            raise ValueError(f"BatchMeta: {len(where)} locations for {len(keys.keys)} keys")
        if isinstance(where, PutRows):  # one put's rows: the whole put, or a share of it
            groups = [(where.placed, range(len(where)), where.rows)]
        elif placed_of(where) is None:  # not (placed, row) pairs: not this store's
            return None
        else:
            groups = group_rows(where, lambda p: p.origin)  # the origin identifies the put
        fields = [select_fields] if isinstance(select_fields, str) else list(select_fields or ())
        if not all(all(f in p.fields for f in fields) for p, _, _ in groups):
            return None
        return groups

    def _fetch_placed(self, groups: list, meta, partition, keys, select, copy: bool, clear: bool) -> dict[str, Rows]:
        """Read the rows where the meta says they are, with no call and no wait for a get (it reads what
        the meta's puts wrote, whether or not their storage actor recorded them). A take first reads the
        replies of the meta's puts that this client made and of its pending ones (raising refusals), then
        the objects, then drops the keys in one call that checks each key still holds its put's rows
        (``_mine``: exactly-once; ``MissingKeyError`` dropping nothing otherwise; for a shipped meta, whose
        ``Placed`` carry no reply, that call waits for a put not arrived yet: ``_StorageActor.drop``). Where
        the writer died (its reply or, ``durable``, its object is gone), the take or get goes through
        ``locate`` with the same check, which waits for the storage actor's copy."""
        expect = origins(meta.where) if clear else None
        if clear:
            try:
                self._pending.confirm(True, meta)
            except ray.exceptions.ObjectLostError:
                if not self.durable:
                    raise
                return self._located(partition, keys, select, copy, clear, expect)
        located = {f: [(p.holder, f, pos, rows) for p, pos, rows in groups] for f in select}  # as ``locate``'s
        try:
            objects = _objects(located)
        except ray.exceptions.ObjectLostError:
            if not self.durable:
                raise
            return self._located(partition, keys, select, copy, clear, expect)
        if clear:
            ray.get(
                self._unit(partition).drop.options(concurrency_group=AWAITS).remote(partition, keys, select, expect)
            )
        return _assemble(len(keys), select, located, objects, copy)

    def _read(self, partition, keys, select, clear: bool, settle: bool, expect=None) -> tuple[dict, dict]:
        """One locate call, then every object it names once, all at once, zero-copy."""
        located = ray.get(self._unit(partition).locate.remote(partition, keys, select, clear, settle, expect))
        return located, _objects(located)

    def clear(self, keys, *, partition=None) -> int:
        """Through a ``trust_meta`` meta: after its puts are recorded, only the keys holding its puts'
        rows (a refused put's rival, or a key written again since, is not this meta's to clear)."""
        meta = keys if isinstance(keys, BatchMeta) and keys.where is not None else None
        keys, partition = self._resolve(keys, partition)
        self._pending.confirm(True)
        expect = None
        if meta is not None and placed_of(meta.where) is not None:
            with contextlib.suppress(ray.exceptions.ObjectLostError):  # a dead writer: the origins decide
                self._pending.replies(True, meta)  # recorded (or refused) first; its refusals are not the clear's
            expect = origins(meta.where)
        call = self._unit(partition).clear
        if expect is not None:  # may wait for its puts: on the actor's threads for waits
            call = call.options(concurrency_group=AWAITS)
        return ray.get(call.remote(partition, keys, expect))

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Wait until the storage actors own a copy of every durable put made so far (they are made
        in the background; nothing needs this for correctness: readers wait where they must)."""
        self._pending.confirm(True)
        ray.get([a.settle.remote(timeout_s) for a in self.actors])

    def clear_partition(self, partition: str) -> int:
        self._pending.confirm(True)
        return ray.get(self._unit(partition).clear_partition.remote(partition))

    def keys(self, partition=None):
        self._pending.confirm(True)
        if partition is not None:
            return [k for p, k in ray.get(self._unit(partition).keys.remote()) if p == partition]
        return [pk for ks in ray.get([a.keys.remote() for a in self.actors]) for pk in ks]

    def meta(self, keys, *, partition="default") -> BatchMeta:
        keys, partition = check_keys(keys, "meta"), check_name(partition, "partition", "meta")
        self._pending.confirm(True, keys)
        return ray.get(self._unit(partition).meta.remote(partition, keys))

    def chunks(self) -> int:
        """Field payloads referenced (an object is freed once no chunk references it)."""
        self._pending.confirm(True)
        return sum(ray.get([a.chunks.remote() for a in self.actors]))
