"""A barrier for the processes of one host through shared memory (tens of microseconds, no sockets): the IPC
path's step barrier where every link of a plan is IPC, and the bench harness's."""

from __future__ import annotations

import errno
import os
import re
import stat
import time
import uuid
import weakref
from collections.abc import Callable

import numpy as np

from refit.errors import PlanError
from refit.transport.clock import RunClock
from refit.transport.store import SignedStore


class BarrierLeft(RuntimeError):
    """A participant of a ``HostBarrier`` closed it while others still waited in a refit (its refit failed)."""


class HostBarrier:
    """A barrier for processes of one host through shared memory (tens of microseconds, no sockets).

    Slot i of a shared int64 array holds participant i's generation. ``wait()``
    bumps this process's generation and spins until every slot has reached it.
    ``leave()`` marks this process's slot as gone (negative): a ``wait()`` elsewhere then raises
    ``BarrierLeft`` instead of passing, so a process that failed and closed can never be mistaken
    for one that arrived; ``leave()`` itself returns once every participant has left (or at its timeout).
    The lowest participant creates the segment (``O_EXCL``, mode 0600, tracked by its resource
    tracker, so a crash still frees it) and alone unlinks it; the others map ``/dev/shm/<name>``
    directly (no symlink; refused unless it belongs to this user and grants nobody else access), so
    no other process's resource tracker ever registers, warns about or unlinks a segment it does not own.
    ``close()`` (idempotent) unmaps and, in the owner, unlinks; a barrier never closed does the same
    when it is collected or at interpreter exit.
    """

    def __init__(self, name: str, index: int, size: int, timeout_s: float = 120.0) -> None:
        self.index, self.size, self.timeout_s, self.gen = index, size, timeout_s, 0
        self.owner = index == 0
        self.name = name
        self.shm = self._create(name, size) if self.owner else None
        self._map = None if self.owner else self._attach(name, size, timeout_s)
        # holds the segment, never ``self``: runs once, from close(), on collection or at exit
        self._finalizer = weakref.finalize(self, HostBarrier._release, self.shm, self._map)
        buf = self.shm.buf if self.shm is not None else self._map
        # a new segment is zero-filled by the OS; zeroing it here could erase a slot another
        # process already bumped after attaching
        self.slots = np.ndarray((size,), dtype=np.int64, buffer=buf)

    @staticmethod
    def _create(name: str, size: int):
        """A new segment ``name`` of ``size`` slots, created exclusively with mode 0600 (a stale file of
        ours, from a crashed earlier run, is removed first; anyone else's is an error)."""
        from multiprocessing import shared_memory

        path = f"/dev/shm/{name}"
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
        except FileNotFoundError:
            pass
        try:  # shm_open(O_CREAT | O_EXCL, 0o600): never opens an existing file
            return shared_memory.SharedMemory(name=name, create=True, size=8 * size)
        except FileExistsError:
            raise PlanError(
                f"barrier segment {path} already exists (not a stale segment of this user's); not using it"
            ) from None

    @staticmethod
    def _attach(name: str, size: int, timeout_s: float):
        """Map the owner's segment once it exists and is sized, after ``_check_private``."""
        import mmap

        path = f"/dev/shm/{name}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                try:
                    st = os.fstat(fd)
                    HostBarrier._check_private(path, st)
                    if st.st_size >= 8 * size:
                        return mmap.mmap(fd, 8 * size)
                finally:
                    os.close(fd)
            except FileNotFoundError:  # not there yet (or created but not sized yet: checked above)
                pass
            except PermissionError:
                raise PlanError(f"barrier segment {path} is not this user's; not using it") from None
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                raise PlanError(f"barrier segment {path} is a symbolic link; not using it") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier segment {name!r} did not appear within {timeout_s:.0f}s")
            time.sleep(0.001)

    @classmethod
    def agree(cls, store: SignedStore, key: str, index: int, size: int, timeout_s: float) -> HostBarrier:
        """Participant ``index`` of ``size`` joins the barrier whose segment name participant 0
        publishes under ``key``: a fresh random name, published only once participant 0 has created
        the segment, checked against its pattern by the others."""
        if index == 0:
            barrier = cls(f"refit_{uuid.uuid4().hex[:16]}", 0, size, timeout_s)
            try:
                store.put(key, {"segment": barrier.name})
            except BaseException:
                barrier.close()
                raise
            return barrier
        seg = store.get(key, timeout_s).get("segment", "")
        if not re.fullmatch(r"refit_[0-9a-f]{16}", seg):
            raise PlanError(f"barrier segment name {seg!r} under {key!r} is not one refit makes")
        return cls(seg, index, size, timeout_s)

    def wait(self, timeout_s: float | None = None, check: Callable[[], None] | None = None) -> None:
        """Return once every participant has called ``wait()`` as often as this one. ``DeadlineExceeded`` (a
        ``TimeoutError``) after ``timeout_s``; ``BarrierLeft`` if a participant left instead; ``check()`` (an
        abort check) is called every 20 ms while waiting and may raise. Polls through ``RunClock.watch``
        (the same spin, GIL yield and sleeps as every other host wait of a refit)."""
        self.gen += 1
        self.slots[self.index] = self.gen
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        RunClock(time.monotonic() + timeout_s, check).watch(
            self._arrived,
            lambda: (
                "barrier: participants "
                f"{[i for i in range(self.size) if self.slots[i] < self.gen]} (waited {timeout_s:g} s for them)"
            ),
        )

    def arrive(self) -> None:
        """Count as arrived at the next generation without waiting for the others (a participant that only needs
        the others to know it got here: an IPC receiver at a refit's last barrier, which only its sources wait at).
        Its next ``wait()`` is for the generation after."""
        self.gen += 1
        self.slots[self.index] = self.gen

    def _arrived(self) -> bool:
        """Whether every participant has reached this generation; ``BarrierLeft`` if one left instead."""
        low = int(self.slots.min())
        if low >= self.gen:
            return True
        if low >= 0:  # nobody left (a slot that left is negative): some have not arrived yet
            return False
        if self._reached() >= self.gen:
            return True
        gone = [i for i in range(self.size) if -1 - int(self.slots[i]) in range(self.gen)]
        if gone:
            raise BarrierLeft(f"barrier: participants {gone} left (closed) instead of arriving")
        return False

    def _reached(self) -> int:
        """The lowest generation every participant has reached (one that left counts what it had reached)."""
        v = self.slots
        return int(np.where(v < 0, -1 - v, v).min())

    def leave(self, timeout_s: float) -> bool:
        """Mark this participant as gone and wait until every participant has left (True) or ``timeout_s``
        passed (False: a peer died or is still inside a refit)."""
        self.slots[self.index] = -1 - self.gen  # "left, having reached generation gen"
        deadline = time.monotonic() + timeout_s
        while int(self.slots.max()) >= 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0001)
        return True

    def close(self) -> None:
        """Unmap the segment; the owner also unlinks it. Idempotent."""
        self.slots = None  # the view on the mapping goes first, so the mapping can close
        self.shm = self._map = None
        self._finalizer()

    @staticmethod
    def _check_private(path: str, st: os.stat_result) -> None:
        """``PlanError`` unless ``st`` (of ``path``) is a regular file of this user that grants nobody else access
        (what ``HostBarrier._create`` makes): another local user cannot plant or read a barrier segment."""
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PlanError(
                f"barrier segment {path} has owner uid {st.st_uid} and mode {stat.filemode(st.st_mode)}; "
                f"refit only maps a regular file of its own user (uid {os.geteuid()}) with mode 0600"
            )

    @staticmethod
    def _release(shm, mapping) -> None:
        """A ``HostBarrier``'s finalizer: unlink the owner's segment (``shm``), then unmap. Unlinking needs no
        mapping, so it happens even when the barrier is being collected with its slot view still holding the
        buffer; that mapping then goes with the view."""
        if shm is not None:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass
        for m in (shm, mapping):
            if m is not None:
                try:
                    m.close()
                except BufferError:  # the slot view is still alive (collection, exit): it unmaps when freed
                    pass
