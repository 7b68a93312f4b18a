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
  deadline passes first (one record decides: commit or timeout). A voter waits
  on the store's side for the late votes (no poll interval on the refit's path).

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
    * ``.../ok/<proc>``: ``proc`` holds all of the version (its vote; ``{"version": v}``), or, where
      ``proc`` had not voted when a process aborted, the abort message (it wakes the voters waiting there).
    * ``.../commit``: the version's one outcome: ``{"version": v}`` (every member voted; written by the
      first process to see it) or ``{"timeout": why}`` (a voter's deadline passed first).

    Who calls (``Peer.run``): a process whose refit failed calls ``abort`` once and raises
    ``RefitAborted`` with the winning message; ``raise_if_aborted`` is polled while a process
    waits on the data path and inside ``vote``; in ``"staged"`` commit every member calls
    ``vote`` once its part of the version is done; a destination commits only if it returns.

    Must agree on every process of the session: ``name``, ``world`` (how many members vote), ``members``
    (the processes that vote; default ``range(world)``) and, per call, ``version`` and ``attempt``. ``proc``
    is this process. A store call that fails (``RuntimeError``, ``OSError``: its host process died) raises
    ``RefitAborted`` (``store_lost``).
    """

    POLL_S = 0.005

    def __init__(self, store: SignedStore, name: str, proc: int, world: int, members: list[int] | None = None) -> None:
        self.store, self.name, self.proc, self.world = store, name, proc, world
        self.members = list(members) if members is not None else list(range(world))

    def _call(self, version: int, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, OSError) as e:  # DistStoreError, a closed socket: the store is gone
            raise store_lost(version, e) from e

    def _key(self, version: int, what: str, attempt: int) -> str:
        return f"{self.name}/v{version}.{attempt}/{what}"

    def abort(self, version: int, attempt: int, message: str) -> str:
        """Publish ``message`` unless another process was first; return the message that won. Then wake
        the voters: the won message goes under every member's vote key that holds nothing yet (never a
        vote), so a process blocked in ``vote`` waiting for that key returns at once and finds the abort."""
        won = self._call(version, self.store.first, self._key(version, "abort", attempt), {"abort": message})
        won = str(won.get("abort", message)) if isinstance(won, dict) else message
        for p in self.members:
            self._call(version, self.store.put_absent, self._key(version, f"ok/{p}", attempt), {"abort": won})
        return won

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

        The outcome is one record, ``.../commit``, written once (``first``): ``{"version": v}`` by the
        first process to see every vote, or, by a process whose deadline passed first, a timeout; every
        process acts on the record that stands, so no two processes decide differently. Between reads a
        voter blocks on the store until the late votes' keys exist (``SignedStore.wait_keys``: woken by
        a vote, or by ``abort``'s message under the key), not a fixed poll. Votes are sticky (after a wait
        a voter re-writes its own vote if it is gone), so a stranger deleting a vote only delays the
        commit (the record still ends the wait at the deadline)."""
        keys = {p: self._key(version, f"ok/{p}", attempt) for p in members}
        others = {p: k for p, k in keys.items() if p != self.proc}
        commit = self._key(version, "commit", attempt)
        mine = {"version": version}
        self._call(version, self.store.put, keys[self.proc], mine)
        waited = present = False
        while True:
            votes = self._call(version, self.store.get_all, others.values())
            late = [p for p, k in others.items() if votes.get(k) != mine]
            if not late or (waited and self._call(version, self.store.peek, commit) == mine):
                self._decide(version, commit, mine)
                return
            self.raise_if_aborted(version, attempt)
            left = deadline - time.monotonic()
            if left <= 0:
                self._decide(version, commit, self._timeout_record(version, late))
                return  # a commit record stood after all
            if waited and self._call(version, self.store.peek, keys[self.proc]) != mine:
                self._call(version, self.store.put, keys[self.proc], mine)  # a stranger deleted it
            if present:  # the late keys exist but hold no valid vote (forged): poll, do not spin
                time.sleep(self.POLL_S)
            waited = True
            present = self._call(version, self.store.wait_keys, [others[p] for p in late], left)

    @staticmethod
    def _timeout_record(version: int, late: list[int]) -> dict:
        who = ", ".join(f"process {p}" for p in late)
        return {"timeout": f"version {version} was not finished before the deadline by {who}"}

    def _decide(self, version: int, commit: str, outcome: dict) -> None:
        """Write ``outcome`` as the version's record unless one stands; return if the standing one commits,
        raise ``TimeoutError`` (a timeout stands) otherwise."""
        won = self._call(version, self.store.first, commit, outcome)
        if won != {"version": version}:
            what = won.get("timeout") if isinstance(won, dict) else None
            raise TimeoutError(str(what) if what else f"version {version}: the commit record holds {won!r}")
