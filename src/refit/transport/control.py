"""The side channel every process of a refit shares: abort together, commit together.

A refit's data moves over collectives (gloo, NCCL) or CUDA IPC; a failure
inside them must not turn into a hang elsewhere. Every process also holds the
rendezvous store (a TCP key-value store, outside the data path), and through
it:

* ``abort(version, attempt, message)``: the first process to fail publishes
  why; the store keeps the first message (compare-and-set), and every process
  raises :class:`RefitAborted` with that same message — the ones that failed,
  and the ones that find the key while they wait;
* ``vote(version, attempt, deadline, members)``: two-phase commit for atomic
  refits: each process says "all of v arrived here"; nobody commits v until
  every process has said so, and nobody commits at all if one aborts or the
  deadline passes first.

Keys are per session name, version and attempt, so a retried version or a
second transfer in the same job does not see stale ones.

``free_port(host)`` picks the port a store (or any rendezvous listener) binds to.
"""

from __future__ import annotations

import socket
import time

import torch.distributed as dist

from refit.errors import RefitAborted


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now: bound there (not on every interface) and released.

    Another process may take it before the caller binds it; callers bind soon after.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def store_lost(version: int, error: BaseException) -> RefitAborted:
    """The side channel itself is gone (its host process died): every process says the same."""
    return RefitAborted(
        f"refit of version {version} aborted: the rendezvous store is unreachable "
        f"({type(error).__name__}); the process hosting it has likely died"
    )


class AbortChannel:
    """One transfer session's abort and commit signals, in the rendezvous store ``store``.

    Keys it owns (``<name>/v<version>.<attempt>/...``; never deleted):

    * ``.../abort``: the first abort message. ``abort`` writes it by compare-and-set
      (``store.compare_set(key, "", message)`` writes only while the key is absent, and returns
      the value that stands), so exactly one message wins and every caller gets it back.
    * ``.../ok``: a counter, one ``add`` per vote; ``.../ok/<proc>``: ``proc`` has voted (to
      name the late ones).

    Who calls (``Peer.run``): a process whose refit failed calls ``abort`` once and raises
    ``RefitAborted`` with the winning message; ``raise_if_aborted`` is polled while a process
    waits on the data path and inside ``vote``; in ``"staged"`` commit every member calls
    ``vote`` once its part of the version is done; a destination commits only if it returns.

    Must agree on every process of the session: ``name``, ``world`` (how many members vote)
    and, per call, ``version`` and ``attempt``. ``proc`` is this process. A store call that fails
    (``RuntimeError``, ``OSError``: its host process died) raises ``RefitAborted`` (``store_lost``).
    """

    POLL_S = 0.005

    def __init__(self, store: dist.Store, name: str, proc: int, world: int) -> None:
        self.store, self.name, self.proc, self.world = store, name, proc, world

    def _call(self, version: int, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:  # DistStoreError, a closed socket: the store is gone
            raise store_lost(version, e) from e

    def _key(self, version: int, what: str, attempt: int) -> str:
        return f"{self.name}/v{version}.{attempt}/{what}"

    def abort(self, version: int, attempt: int, message: str) -> str:
        """Publish ``message`` unless another process was first; return the message that won."""
        key = self._key(version, "abort", attempt)
        won = self._call(version, self.store.compare_set, key, "", message)
        return won.decode() if isinstance(won, bytes) else str(won)

    def aborted(self, version: int, attempt: int) -> str | None:
        """The abort message of this version and attempt, or None while there is none."""
        key = self._key(version, "abort", attempt)
        if self._call(version, self.store.check, [key]):
            return self._call(version, self.store.get, key).decode()
        return None

    def raise_if_aborted(self, version: int, attempt: int) -> None:
        """Raise ``RefitAborted`` with the abort message, if one was published."""
        msg = self.aborted(version, attempt)
        if msg is not None:
            raise RefitAborted(msg)

    def vote(self, version: int, attempt: int, deadline: float, members: list[int]) -> None:
        """Say this process holds all of ``version``; return once ``world`` processes have.
        Raises ``RefitAborted`` if one aborts first, ``TimeoutError`` naming the processes of
        ``members`` that had not voted when ``deadline`` (``time.monotonic()``) passes."""
        key = self._key(version, "ok", attempt)
        self._call(version, self.store.set, f"{key}/{self.proc}", "1")
        n = self._call(version, self.store.add, key, 1)
        while n < self.world:
            self.raise_if_aborted(version, attempt)
            if time.monotonic() > deadline:
                late = [p for p in members if not self._call(version, self.store.check, [f"{key}/{p}"])]
                raise TimeoutError(
                    f"version {version} was not finished before the deadline by "
                    + ", ".join(f"process {p}" for p in late)
                )
            time.sleep(self.POLL_S)
            n = self._call(version, self.store.add, key, 0)
