"""Double-buffered refit with a commit by pointer swap: the engine pauses only to switch which of
two weight sets it reads; no byte is copied under the pause.

An engine process holds two destination sets, A and B, each its whole share (same names, shapes,
dtypes and devices; no shared storage). One is *live* (the engine reads it), the other *spare*.
Every process of the refit (trainers and engines) builds a ``SwapCommit`` once, which builds two
``Peer``s, one per set (``config.name`` + ``"-a"`` / ``"-b"``, each with its own plan, executor and
IPC handles; ``commit="staged"`` so the fleet votes, ``private_dst``: bytes land straight in the set).

* ``stage(v)``: version v moves into the spare set while the engine keeps running on the live one,
  then the existing vote: returns once every process holds all of v. A failure leaves the live set
  and ``version`` untouched (every process raises the same ``RefitAborted``); the spare set is then
  part written, and this ``SwapCommit`` is spent (build a new one, fresh ``config.name``, to retry).
* ``commit(pause, resume)``: ``pause()``, the engine's ``rebind(tensors)`` hook switches its weights to
  the spare set, ``resume()``. The former live set still holds v-1.
* ``rollback(pause, resume)``: rebind back to v-1, no copy, no trainer; once per commit, and only
  until the next ``stage`` begins (staging overwrites the set that held v-1).

Which set a version goes into is "the one not live", so every process must call ``stage``,
``commit`` and ``rollback`` alike (on a trainer they only move the bookkeeping); a process that
skipped a rollback would stage into the other ``Peer`` and the refit would time out at
``config.deadline_s``.

Extra memory of an engine process: the second set, one share (as a staged commit's shadow; a staged
commit with ``keep_previous`` needs two). The engine must read its weights by reference on every
pass (eager PyTorch; refit's stand-in). An engine that captured the weights' addresses (vLLM with
CUDA graphs) would keep reading the old set after a rebind: it uses the copy commit
(``refit.commit.StagedCommit``) instead.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from refit.commit import share_bytes
from refit.config import TransferConfig
from refit.errors import ConfigError, RefitError
from refit.layout import ModelLayout
from refit.transfer import Peer
from refit.transport.control import RefitAborted

Hook = Callable[[], None]
Rebind = Callable[[dict[str, torch.Tensor]], None]


def check_sets(sets: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``sets`` as two dicts if it is two mappings of the same tensor names with equal shapes,
    dtypes and devices and no storage in common; else ``ConfigError`` naming the first difference."""
    if not isinstance(sets, (tuple, list)) or len(sets) != 2 or not all(isinstance(s, Mapping) for s in sets):
        raise ConfigError(f"SwapCommit sets must be two mappings name -> tensor (live, spare), got {type(sets)!r}")
    a, b = dict(sets[0]), dict(sets[1])
    if a.keys() != b.keys():
        diff = sorted(a.keys() ^ b.keys())
        raise ConfigError(f"SwapCommit sets hold different tensors: {diff[0]!r} is in one set only")
    ptrs = {t.untyped_storage().data_ptr() for t in a.values() if t.numel()}
    for n, t in a.items():
        u = b[n]
        for what, x, y in (("shape", tuple(t.shape), tuple(u.shape)), ("dtype", t.dtype, u.dtype)):
            if x != y:
                raise ConfigError(
                    f"SwapCommit sets differ on tensor {n!r}: {what} {x} in the live set, {y} in the spare"
                )
        if t.device != u.device:
            raise ConfigError(f"SwapCommit sets differ on tensor {n!r}: device {t.device} live, {u.device} spare")
        if u.numel() and u.untyped_storage().data_ptr() in ptrs:
            raise ConfigError(f"SwapCommit sets share storage (tensor {n!r}): the spare set must be its own memory")
    return a, b


class SwapCommit:
    """One process's part in double-buffered refits (see the module docstring).

    ``sets``: ``(live, spare)`` on a process that hosts a destination rank (``live`` holds what the
    engine reads now), with ``rebind(tensors)``: the engine's hook that makes it read ``tensors`` from
    its next pass on. ``src_tensors``: on a process that hosts a source rank. The other keywords are
    ``Peer``'s (``config``'s ``commit`` and ``keep_previous`` are set here). Collective like ``Peer``.
    ``version``: the version the live set holds (None before the first commit); ``live``: its index.
    """

    def __init__(
        self,
        src_layout: ModelLayout,
        dst_layout: ModelLayout,
        proc: int,
        *,
        sets: Any = None,
        rebind: Rebind | None = None,
        src_tensors: Mapping[str, torch.Tensor] | None = None,
        config: TransferConfig | None = None,
        **peer_kw: Any,
    ) -> None:
        if (sets is None) != (rebind is None):
            raise ConfigError(
                "SwapCommit needs both sets=(live, spare) and the engine's rebind(tensors) hook on a destination "
                f"process, or neither (got sets={'given' if sets is not None else None}, rebind={rebind!r})"
            )
        if rebind is not None and not callable(rebind):
            raise ConfigError(f"SwapCommit rebind must be the engine's callable rebind(tensors), got {rebind!r}")
        self.sets = check_sets(sets) if sets is not None else ({}, {})
        self.rebind = rebind
        base = config if config is not None else TransferConfig()
        self.peers = tuple(
            Peer(
                src_layout,
                dst_layout,
                proc,
                src_tensors=src_tensors,
                dst_tensors=self.sets[i] or None,
                config=dataclasses.replace(base, name=f"{base.name}-{ab}", commit="staged", keep_previous=False),
                private_dst=True,
                **peer_kw,
            )
            for i, ab in enumerate("ab")
        )
        self.extra_bytes = share_bytes(self.sets[1])
        self.live = 0
        self.version: int | None = None
        self.previous_version: int | None = None
        self.restorable = False  # the spare set holds the version before the last commit, whole
        self.staged_version: int | None = None
        self.broken: str | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The live set (what the engine reads)."""
        return self.sets[self.live]

    def stage(self, version: int, **kw: Any) -> Any:
        """Move ``version`` into the spare set (``Peer.stage``: transfer, then the fleet's vote) while the
        engine keeps reading the live set; returns the ``RunStats``. ``RefitAborted`` on failure, the
        live set and ``version`` untouched. ``kw``: ``Peer.stage``'s (``fault_hook``)."""
        if self.broken is not None:
            raise RefitAborted(f"this SwapCommit is spent by an aborted refit ({self.broken}); build a new one")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version must increase: got {version} after {self.version}")
        self.restorable = False  # staging overwrites the spare set, which held the previous version
        self.staged_version = None
        try:
            stats = self.peers[1 - self.live].stage(version, **kw)
        except RefitAborted as e:
            self.broken = str(e)
            raise
        self.staged_version = version
        return stats

    def commit(self, pause: Hook | None = None, resume: Hook | None = None) -> float:
        """Make the staged version live: ``pause()``, ``rebind(spare set)``, ``resume()`` (which runs even
        if the rebind fails). Returns the seconds of the rebind (0 without a destination here).
        ``RefitError`` if nothing is staged."""
        version = self.staged_version
        if version is None:
            raise RefitError("commit(): no staged version (call stage(v) first; a failed stage leaves none)")
        target = 1 - self.live
        seconds = self._switch(target, pause, resume)
        self.peers[target].commit()  # records the version; private_dst: no copy
        self.live, self.staged_version = target, None
        self.previous_version, self.version, self.restorable = self.version, version, True
        return seconds

    def rollback(self, pause: Hook | None = None, resume: Hook | None = None) -> int | None:
        """Switch the engine back to the version before the last commit (``pause()``, ``rebind``,
        ``resume()``; no copy, no trainer) and return it (None: the weights before the first refit).
        Call it on every process. ``RefitError`` (nothing changed) when there is nothing to restore."""
        if not self.restorable:
            raise RefitError(
                f"rollback(): nothing to restore (live version {self.version}; a rollback undoes one commit, "
                "once, and only until the next stage begins)"
            )
        self._switch(1 - self.live, pause, resume)
        self.live = 1 - self.live
        self.version, self.previous_version, self.restorable = self.previous_version, None, False
        return self.version

    def close(self) -> None:
        """Close both Peers (the sets stay as they are)."""
        for p in self.peers:
            p.close()

    def _switch(self, target: int, pause: Hook | None, resume: Hook | None) -> float:
        if self.rebind is None:
            return 0.0
        if pause is not None:
            pause()
        try:
            t0 = time.perf_counter()
            self.rebind(self.sets[target])
            return time.perf_counter() - t0
        finally:
            if resume is not None:
                resume()
