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

Every value is tagged with the job's secret (``refit.transport.store.SignedStore``):
a forged abort or vote is ignored.

Keys are per session name, version and attempt, so a retried version or a
second transfer in the same job does not see stale ones.

``free_port(host)`` picks the port a store (or any rendezvous listener) binds to.
"""

from __future__ import annotations

import socket
import time

from refit.errors import RefitAborted
from refit.transport.store import SignedStore


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
    """One transfer session's abort and commit signals, in the signed rendezvous store ``store``.

    Keys it owns (``<name>/v<version>.<attempt>/...``; never deleted), every value tagged with the job
    secret (``SignedStore``: a value without a valid tag is ignored, so a stranger cannot abort or commit):

    * ``.../abort``: the first abort message. ``abort`` writes it with ``SignedStore.first`` (a
      compare-and-set that displaces an invalid value), so exactly one real message wins and every
      caller gets it back.
    * ``.../ok/<proc>``: ``proc`` holds all of the version (its vote; ``{"version": v}``).
    * ``.../commit``: every member voted (written by the first process to see it).

    Who calls (``Peer.run``): a process whose refit failed calls ``abort`` once and raises
    ``RefitAborted`` with the winning message; ``raise_if_aborted`` is polled while a process
    waits on the data path and inside ``vote``; in ``"staged"`` commit every member calls
    ``vote`` once its part of the version is done; a destination commits only if it returns.

    Must agree on every process of the session: ``name``, ``world`` (how many members vote)
    and, per call, ``version`` and ``attempt``. ``proc`` is this process. A store call that fails
    (``RuntimeError``, ``OSError``: its host process died) raises ``RefitAborted`` (``store_lost``).
    """

    POLL_S = 0.005

    def __init__(self, store: SignedStore, name: str, proc: int, world: int) -> None:
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
        won = self._call(version, self.store.first, self._key(version, "abort", attempt), {"abort": message})
        return str(won.get("abort", message)) if isinstance(won, dict) else message

    def aborted(self, version: int, attempt: int) -> str | None:
        """The abort message of this version and attempt, or None while there is none."""
        value = self._call(version, self.store.peek, self._key(version, "abort", attempt))
        return str(value["abort"]) if isinstance(value, dict) and "abort" in value else None

    def raise_if_aborted(self, version: int, attempt: int) -> None:
        """Raise ``RefitAborted`` with the abort message, if one was published."""
        msg = self.aborted(version, attempt)
        if msg is not None:
            raise RefitAborted(msg)

    def vote(self, version: int, attempt: int, deadline: float, members: list[int]) -> None:
        """Say this process holds all of ``version``; return once every process of ``members`` has.
        Raises ``RefitAborted`` if one aborts first, ``TimeoutError`` naming the processes of
        ``members`` that had not voted when ``deadline`` (``time.monotonic()``) passes.

        Votes are sticky (a voter re-writes its own vote while it waits, so a deleted vote comes
        back), and the first process to see every vote records ``.../commit`` (``first``): a process
        whose deadline passes commits anyway if that record stands, so a stranger deleting keys
        after some processes returned cannot split the commit unless it also deletes the record."""
        keys = {p: self._key(version, f"ok/{p}", attempt) for p in members}
        commit = self._key(version, "commit", attempt)
        mine = {"version": version}
        while True:
            votes = self._call(version, self.store.get_all, keys.values())
            if votes.get(keys[self.proc]) != mine:
                self._call(version, self.store.put, keys[self.proc], mine)
            late = [p for p, k in keys.items() if votes.get(k) != mine and p != self.proc]
            if not late or self._call(version, self.store.peek, commit) == mine:
                self._call(version, self.store.first, commit, mine)
                return
            self.raise_if_aborted(version, attempt)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"version {version} was not finished before the deadline by "
                    + ", ".join(f"process {p}" for p in late)
                )
            time.sleep(self.POLL_S)
