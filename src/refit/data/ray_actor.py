"""The storage actor of ``refit.data.ray_store``: one per group of partitions, holding every key's
metadata (a ``StorageUnit``) and, for durable puts, the copies of the writers' objects it owns.

``refit.data.ray_store``'s docstring is the contract (ownership, atomic puts, reads through a
meta); this module is the actor's side of it: ``put`` records a put's keys in one call (and, for a
``trust_meta`` put, remembers its origin: ``arrived``), a background thread at a lower priority
(``ADOPT_NICE``) copies durable puts' objects, and ``locate`` / ``drop`` / ``clear`` answer readers,
waiting on threads of their own (``AWAITS``) for a put a take through a meta names. Tensors travel
as raw bytes (``encode`` / ``decode``: any dtype, bf16 included, bit for bit).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from .inputs import FieldData
from .meta import BatchMeta
from .store import NotReady, StorageUnit

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
