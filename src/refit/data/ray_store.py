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

import contextlib
import math
import os
import threading
import time
import uuid
import warnings
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .meta import BatchMeta
from .placed import PendingPuts, Placed, PutRows, origins, placed_of
from .store import FieldData, NotReady, Rows, StorageUnit, Store, gather, group_rows, normalize_put

try:
    import ray
except ImportError:  # pragma: no cover - exercised only without ray
    ray = None

SETTLE_TIMEOUT_S = 120.0  # a reader that needs a durable copy waits at most this long for it
MAX_PENDING_COPIES = 8  # durable copies queued per storage actor before a put waits for one
ADOPT_NICE = 10  # how much lower the copy thread's priority is than its actor's (``_background``)
ARRIVAL_WINDOW_S = 60.0  # a take or clear through a shipped meta waits this long after its put for the put's call
MAX_ARRIVALS = 1 << 17  # trust_meta puts a storage actor remembers at most (``_StorageActor.arrived``)
MAX_ORIGIN_CHARS = 80  # a put's origin: 32 hex digits, "@", its time
AWAITS = "awaits"  # the storage actor's threads for takes and clears through a meta, which may wait for a put
AWAIT_THREADS = 16  # their number (the puts they wait for run on the actor's other threads)


def encode(t: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    """``t``'s bytes as a flat uint8 array (sharing memory with a contiguous CPU ``t``), its dtype
    name and its shape: any dtype survives ``decode`` bit for bit."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _quiet_readonly_views() -> None:
    """torch warns once per process when it views a read-only numpy array (as every zero-copy read of
    an object-store buffer does); spend that one warning here, silently, so ``decode`` needs no
    ``warnings.catch_warnings`` per call (what the first read used to spend it on)."""
    arr = np.zeros(1, dtype=np.uint8)
    arr.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(arr)


_quiet_readonly_views()


def decode(w: tuple[np.ndarray, str, tuple[int, ...]], copy: bool) -> torch.Tensor:
    """The tensor ``encode`` described; ``copy=False`` views the array's memory (never write to it
    when it is an object-store buffer), ``copy=True`` owns a writable copy."""
    arr, dtype, shape = w
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


class _Payload:
    """One put's object in the object store: the writer's reference until the storage actor owns a
    copy (``durable``), then the actor's. ``held`` pins the writer's bytes in the actor's process
    (zero-copy) from the put call until the copy exists: they stay readable even if the writer has
    died (Ray keeps a mapped object alive for a process that holds it). ``live``: the put's chunks
    still held (a copy of a put whose keys are all gone is skipped); ``error``: why the last copy
    failed (``held`` is then kept, and the copy is tried again when a reader or ``settle`` needs it)."""

    __slots__ = ("ref", "held", "settled", "error", "live", "origin")

    def __init__(self, ref: Any, held: Any, live: int, origin: str | None = None) -> None:
        self.ref, self.held, self.error, self.live, self.origin = ref, held, None, live, origin
        self.settled = threading.Event()
        if held is None:
            self.settled.set()


def _background() -> None:
    """Run by the copy thread when it starts: lower its own scheduling priority by ``ADOPT_NICE`` (Linux: a
    thread's nice value is its own), so the durable copies, background work by design, yield the CPU to
    the reads and calls this node runs meanwhile (on 2 cores a 48 MiB copy overlaps the reads of the put it
    copies). Where the platform does not allow it, the copy keeps the process's priority."""
    with contextlib.suppress(AttributeError, OSError):  # no setpriority (not POSIX), or not allowed
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + ADOPT_NICE))


def _copied(payload: tuple[_Payload, str]) -> bool:
    return payload[0].settled.is_set() and payload[0].error is None


class _StorageActor:
    """Keys -> (payload, field) per field; the payload bytes stay in the object store.

    A durable put returns once its keys are recorded and the writer's object is pinned here; the
    copy this actor owns is made afterwards by one background thread (``_adopt``), so the writer
    does not wait for it, with at most ``MAX_PENDING_COPIES`` queued (a put waits for a slot: pinned
    memory stays bounded). Readers are told the writer's reference until the copy exists; a reader
    that finds the writer gone asks again with ``settle=True``, which waits for the copy; a ``take``
    waits for the copies before it drops its keys (a take that fails clears nothing)."""

    def __init__(self) -> None:
        self.unit = StorageUnit(on_drop=self._dropped)
        self.adopter = ThreadPoolExecutor(1, thread_name_prefix="refit-adopt", initializer=_background)
        self.slots = threading.BoundedSemaphore(MAX_PENDING_COPIES)
        self.lock = threading.Lock()  # guards ``failed`` and the retry of a failed copy
        self.failed: set[_Payload] = set()
        self.arrival = threading.Condition()  # guards ``arriving`` and ``arrived``; told when a put is done
        self.arriving: set[str] = set()  # origins of the trust_meta puts being recorded now
        self.arrived: OrderedDict[str, tuple[float, str | None]] = OrderedDict()  # origin -> (when, refusal or None)

    def put(self, call: tuple) -> str | None:
        """``_record`` the put. A ``trust_meta`` put's origin is known here from the start of this call
        (``arriving``) and, once recorded or refused, remembered as arrived with its refusal, if any, for
        ``2 * ARRIVAL_WINDOW_S`` (at most ``MAX_ARRIVALS``); the takes and clears waiting for it
        (``_awaited``) are told."""
        origin, err = call[8], "the storage actor's put failed"
        if origin is not None:
            if not (isinstance(origin, str) and len(origin) <= MAX_ORIGIN_CHARS):
                return f"put: not a put's origin (a str of at most {MAX_ORIGIN_CHARS} characters); nothing was written"
            with self.arrival:
                self.arriving.add(origin)
        try:
            err = self._record(call)
        finally:
            if origin is not None:
                self._arrived(origin, err)
        return err

    def _arrived(self, origin: str, err: str | None) -> None:
        """Remember that the put of ``origin`` is done here (``err``: its refusal, or None); forget the ones
        older than ``2 * ARRIVAL_WINDOW_S`` or beyond ``MAX_ARRIVALS``; tell the waiting takes and clears."""
        now = time.monotonic()
        with self.arrival:
            self.arriving.discard(origin)
            self.arrived[origin] = (now, err)
            self.arrived.move_to_end(origin)
            while self.arrived and (
                len(self.arrived) > MAX_ARRIVALS or next(iter(self.arrived.values()))[0] < now - 2 * ARRIVAL_WINDOW_S
            ):
                self.arrived.popitem(last=False)
            self.arrival.notify_all()

    def _known(self, expect: str | list[str]) -> set[str]:
        """The puts ``expect`` names that have arrived here, as a take or clear finds them before it acts."""
        with self.arrival:
            return {o for o in _wanted(expect) if o in self.arrived}

    def _awaited(self, expect: str | list[str], before: set[str], refusals: bool) -> bool:
        """For a take or clear through a meta shipped without its puts' replies (``Placed``) that found keys
        not its puts': wait for the puts ``expect`` names (one origin, or one per key) that have not
        arrived here: while one's call is running here (a durable put may wait for a copy slot), up to
        ``SETTLE_TIMEOUT_S``; else up to ``ARRIVAL_WINDOW_S`` after the latest was made (the time in its
        origin, on the writer's clock; at most ``ARRIVAL_WINDOW_S`` from now). True where one that had not
        arrived when the caller first looked (``before``, from ``_known``) has now: the caller tries
        again, once. ``ValueError`` naming a refused one (``refusals``: a take)."""
        wanted = _wanted(expect)
        new = [o for o in wanted if o not in before]
        made = max((_made_at(o) for o in new), default=0.0)
        start, budget = time.monotonic(), min(ARRIVAL_WINDOW_S, max(0.0, made + ARRIVAL_WINDOW_S - time.time()))
        with self.arrival:
            while True:
                missing = [o for o in wanted if o not in self.arrived]
                running = any(o in self.arriving for o in missing)
                left = start + (SETTLE_TIMEOUT_S if running else budget) - time.monotonic()
                if not missing or left <= 0:
                    break
                self.arrival.wait(left)
            came = any(o in self.arrived for o in new)
            bad = [self.arrived[o][1] for o in wanted if o in self.arrived and self.arrived[o][1]]
        if refusals and bad:
            raise ValueError(
                f"{len(bad)} put(s) refused by the storage actor after they returned (trust_meta): {bad[0]}"
            )
        return came

    def _record(self, call: tuple) -> str | None:
        """Check, pin (``durable``) and record, in one call; the reason a put is refused (nothing
        written), or None. ``call``: ``(partition, keys, holder, fields, tags, seq_lens, overwrite,
        durable, origin)``, one tuple (``RayStore.put``'s: one argument costs Ray less than nine).
        The durable copy follows in the background. ``tags`` None: no key has any. ``origin``: the
        put's token (``trust_meta``), by which a take or clear through its meta recognises its rows."""
        partition, keys, holder, fields, tags, seq_lens, overwrite, durable, origin = call
        tags = [{} for _ in keys] if tags is None else tags
        if durable and not overwrite:  # refused before pinning; ``unit.put`` checks (again) under its lock
            err = self.unit.clash(partition, keys, fields)
            if err:
                return err
        ref = holder[0]  # nested in a list: Ray passes the reference, not the value
        held = None
        if durable:
            if not self.slots.acquire(timeout=SETTLE_TIMEOUT_S):
                return (
                    f"put: {MAX_PENDING_COPIES} durable copies pending for {SETTLE_TIMEOUT_S:g}s; nothing was written"
                )
            try:
                held = ray.get(ref)  # zero-copy on this node: pins the bytes
            except ray.exceptions.RayError as e:  # the writer died before its object was pinned
                self.slots.release()
                return f"put: the writer's object is gone ({type(e).__name__}); nothing was written"
        payload = _Payload(ref, held, len(fields), origin)
        try:  # checks again under the unit's lock: a racing put of the same keys may have won
            self.unit.put(partition, keys, {f: (payload, f) for f in fields}, tags, seq_lens, overwrite)
        except ValueError as e:
            if durable:
                self.slots.release()
            return str(e)
        if durable:
            self.adopter.submit(self._adopt, payload)
        return None

    def _adopt(self, p: _Payload) -> None:
        """Make the copy this actor owns (skipped when the put's keys are all gone); on failure keep
        the pin and remember the payload (``_retry``)."""
        try:
            if p.live > 0:
                p.ref = ray.put(p.held)
            p.held, p.error = None, None
            with self.lock:
                self.failed.discard(p)
        except Exception as e:  # noqa: BLE001 - kept, reported to the readers that need the copy
            p.error = f"{type(e).__name__}: {e}"
            with self.lock:
                self.failed.add(p)
        finally:
            p.settled.set()
            self.slots.release()

    def _retry(self, p: _Payload, deadline: float) -> None:
        """Ask again for a copy that failed (once per failure: concurrent readers share it)."""
        if not (p.settled.is_set() and p.error):
            return
        if not self.slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return  # the caller's wait reports the failure
        with self.lock:  # not while waiting for the slot: the copy thread takes this lock too
            if p.settled.is_set() and p.error:
                p.settled.clear()
                self.adopter.submit(self._adopt, p)
                return
        self.slots.release()  # another reader asked first

    def _dropped(self, payload: tuple[_Payload, str]) -> None:
        """A chunk of ``payload``'s put is gone (under the unit's lock); the last one releases a
        failed copy's pin (nobody can read those keys any more)."""
        p = payload[0]
        p.live -= 1
        if p.live == 0 and p.error:
            with self.lock:
                self.failed.discard(p)
            p.held = None

    def _wait(self, payloads, deadline: float, partition: str, what: str) -> None:
        for p in payloads:
            self._retry(p, deadline)
            if not p.settled.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(
                    f"{what}: the durable copy of a put in {partition!r} was not made within "
                    f"{SETTLE_TIMEOUT_S:g}s; nothing was cleared"
                )
            if p.error:
                raise RuntimeError(
                    f"{what}: the durable copy of a put in {partition!r} failed ({p.error}); nothing was "
                    "cleared (the writer's bytes stay pinned; the copy is tried again on the next read)"
                )

    def locate(self, partition, keys, select, clear=False, settle=False, expect=None) -> dict[str, list]:
        """Where the rows are; with ``clear`` (a take), the keys are dropped in the same call once
        every durable copy they need exists (nothing is dropped if one cannot be made). ``settle``:
        wait for the durable copies of the objects returned (the writer's reference may be dead).
        ``expect``: per key, the origin of the put its rows must come from, or one origin for every key
        (``_mine``)."""
        deadline, what = time.monotonic() + SETTLE_TIMEOUT_S, "take" if clear else "get"
        accept = _mine(partition, keys, expect)
        while True:
            try:
                located = self.unit.locate(
                    partition, keys, select, clear, ready=_copied if clear else None, accept=accept
                )
            except NotReady as e:  # nothing dropped: wait for those copies, then try again
                self._wait({p for p, _ in e.payloads}, deadline, partition, what)
                continue
            if settle and not clear:
                self._wait({p for groups in located.values() for (p, _), _, _ in groups}, deadline, partition, what)
            break
        return {f: [([p.ref], name, pos, rows) for (p, name), pos, rows in groups] for f, groups in located.items()}

    def drop(self, partition, keys, select, expect) -> None:
        """A take whose reader already holds the rows (it read them where its meta said): drop the
        keys (no copy needed: the reader maps the bytes); raises, dropping nothing, where a key or
        field is missing or a key's rows are not from the put ``expect`` names (``_mine``). Where that
        is so because the put's call has not arrived yet (the meta was shipped before the put was
        recorded), waits for it (``_awaited``) and tries once more; a refused put raises its refusal."""
        accept = _mine(partition, keys, expect)
        before = self._known(expect)
        try:
            self.unit.locate(partition, keys, select, clear=True, accept=accept)
        except KeyError:  # MissingKeyError, MissingFieldError
            if not self._awaited(expect, before, refusals=True):
                raise
            self.unit.locate(partition, keys, select, clear=True, accept=accept)

    def settle(self, timeout_s: float) -> None:
        """Return once every durable copy asked for before this call exists (failed ones are tried
        again; ``RuntimeError`` if one still fails)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            failed = list(self.failed)
        for p in failed:
            self._retry(p, deadline)
        self.adopter.submit(lambda: None).result(max(0.0, deadline - time.monotonic()))
        with self.lock:
            failed = [p.error for p in self.failed]
        if failed:
            raise RuntimeError(f"settle: {len(failed)} durable copies failed, e.g. {failed[0]}")

    def clear(self, partition, keys, expect=None) -> int:
        """Drop ``keys``; with ``expect`` (per key, a put's origin, or one for all), only those holding a row
        of that put, after waiting for a put whose call has not arrived yet (``_awaited``: a meta shipped
        before its put was recorded)."""
        if expect is None:
            return self.unit.clear(partition, keys)
        mine = lambda i, payloads: any(p.origin == _origin(expect, i) for p, _ in payloads)  # noqa: E731
        one = isinstance(expect, str)  # one put's meta: one answer per field map, not per key
        before = self._known(expect)
        n = self.unit.clear(partition, keys, mine, uniform=one)
        if n < len(keys) and self._awaited(expect, before, refusals=False):
            n += self.unit.clear(partition, keys, mine, uniform=one)
        return n

    def clear_partition(self, partition) -> int:
        return self.unit.clear_partition(partition)

    def keys(self) -> list[tuple[str, str]]:
        return self.unit.keys()

    def meta(self, partition, keys) -> BatchMeta:
        return self.unit.meta(partition, keys)

    def chunks(self) -> int:
        return self.unit.chunks()


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


def _mine(partition: str, keys: list[str], expect: str | list[str] | None):
    """``StorageUnit.locate``'s ``accept`` for a read through a ``trust_meta`` meta: every row located must
    come from the put whose origin ``expect`` names for its key (not a refused put's rival, nor a later
    put of a key taken or overwritten since)."""
    if expect is None:
        return None

    def accept(located: dict) -> str | None:
        for groups in located.values():
            for (p, _), pos, _ in groups:
                if isinstance(expect, str):  # one put's meta: one comparison per group
                    bad = pos[0] if pos and expect != p.origin else None
                else:
                    bad = next((i for i in pos if expect[i] != p.origin), None)
                if bad is not None:
                    return (
                        f"key {keys[bad]!r} in partition {partition!r} no longer holds the put its meta names "
                        "(that put was refused, or the key was taken and written again, or overwritten); "
                        "nothing was dropped"
                    )
        return None

    return accept


def _origin(expect: str | list[str], i: int) -> str:
    """Key ``i``'s expected origin (``placed.origins``: one ``str`` where every key is one put's)."""
    return expect if isinstance(expect, str) else expect[i]


def _made_at(origin: str) -> float:
    """When the put of ``origin`` was made (``RayStore._ordered``: ``<token>@<time.time()>``); 0 where the
    origin carries no finite time (nothing to wait for)."""
    _, at, when = origin.rpartition("@")
    try:
        t = float(when) if at and len(when) <= 32 else 0.0
    except ValueError:
        return 0.0
    return t if math.isfinite(t) else 0.0


def _wanted(expect: str | list[str]) -> set[str]:
    """The origins a take or clear through a meta expects (one for a put's meta, one per key otherwise)."""
    return {expect} if isinstance(expect, str) else set(expect)


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
        keys, fields, tag_list, lens = normalize_put(keys, fields, tags, seq_lens)
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
        self._pending.confirm(True, keys)
        return ray.get(self._unit(partition).meta.remote(partition, [str(k) for k in keys]))

    def chunks(self) -> int:
        """Field payloads referenced (an object is freed once no chunk references it)."""
        self._pending.confirm(True)
        return sum(ray.get([a.chunks.remote() for a in self.actors]))
