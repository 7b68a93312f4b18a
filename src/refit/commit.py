"""The commit step of a staged refit: version v leaves the shadow for the live tensors in one short step.

A staged refit has two parts. *Staging* moves every byte of v into a shadow of this process's
destination share while the engine keeps running on the live tensors (v-1); nothing live is written.
*Commit* (``StagedCommit.commit``) is the only place the live tensors change: the engine's ``pause``
hook, one copy shadow -> live per tensor (on the tensors' device), its ``resume`` hook. So an engine
never runs a forward pass on a half-written version: before the commit it reads v-1 whole, after it v
whole, and during it nothing (it is paused).

Extra memory of one destination process (its share = the bytes of its live tensors):

* the shadow: one share;
* with ``keep_previous``: a second share holding v-1, copied from the live tensors when the commit
  begins, before the pause (the engine only reads them), so ``rollback()`` restores v-1 with one
  copy, without the trainer.

Both are bounded by ``TransferConfig.commit_budget_bytes`` when the user sets it: a share that does
not fit is refused when the buffers are made (``ConfigError`` naming both numbers), never later.

``TokenVersions`` is what an engine reports with every finished request: the weight version of each
token, as the token indices where the version changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from refit.config import COMMIT_POLICIES
from refit.errors import ConfigError, RefitError

Hook = Callable[[], None]


def share_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes of ``tensors`` (a process's destination share)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_policy(policy: str) -> str:
    """``policy`` if it is one of ``COMMIT_POLICIES``, else ``ConfigError`` naming it."""
    if policy not in COMMIT_POLICIES:
        raise ConfigError(f"commit policy must be one of {', '.join(COMMIT_POLICIES)}, got {policy!r}")
    return policy


class StagedCommit:
    """The buffers and the commit of one destination process (see the module docstring).

    ``live``: the engine's tensors (only ``commit`` and ``rollback`` write them); ``shadow``: where
    staging writes v (allocated like ``live``); ``previous``: v-1 when ``keep_previous``. ``version``:
    the version the live tensors hold (None before the first commit), ``previous_version``: the one
    ``previous`` holds (None when there is none to roll back to). ``extra_bytes``: what this adds to
    the process's memory, checked against ``budget`` (``None``: unbounded) at construction.
    """

    def __init__(
        self, live: Mapping[str, torch.Tensor], *, keep_previous: bool = False, budget: int | None = None
    ) -> None:
        self.live = dict(live)
        self.keep_previous = keep_previous
        share = share_bytes(self.live)
        self.extra_bytes = share * (2 if keep_previous else 1)
        if budget is not None and self.extra_bytes > budget:
            what = "shadow + previous version" if keep_previous else "shadow"
            raise ConfigError(
                f"TransferConfig.commit_budget_bytes={budget} is too small for this process's staged commit: "
                f"its {what} needs {self.extra_bytes} bytes (share {share} bytes"
                + (" x 2; set keep_previous=False to need one share" if keep_previous else "")
                + ")"
            )
        self.shadow = {n: torch.empty_like(t) for n, t in self.live.items()}
        self.previous = {n: torch.empty_like(t) for n, t in self.live.items()} if keep_previous else {}
        self.version: int | None = None
        self.previous_version: int | None = None
        self.restorable = False  # ``previous`` holds the version before the last commit

    def commit(self, version: int, pause: Hook | None = None, resume: Hook | None = None) -> float:
        """Make ``version`` (in the shadow) live: with ``keep_previous`` first copy the live tensors
        into ``previous`` (the engine still runs: it only reads them), then ``pause()``, copy shadow ->
        live, ``resume()``. Returns the seconds the copy under the pause took (the engine's pause is
        that plus its hooks). ``resume`` runs even if the copy fails."""
        if self.keep_previous:
            _copy(self.previous, self.live)
        if pause is not None:
            pause()
        try:
            t0 = time.perf_counter()
            _copy(self.live, self.shadow)
            seconds = time.perf_counter() - t0
        finally:
            if resume is not None:
                resume()
        if self.keep_previous:
            self.previous_version, self.restorable = self.version, True
        self.version = version
        return seconds

    def rollback(self, pause: Hook | None = None, resume: Hook | None = None) -> int | None:
        """Restore the version before the last commit into the live tensors (``pause``, one copy,
        ``resume``) and return it (None: the weights the engine had before its first refit). Possible
        once per commit; ``RefitError`` (nothing written) when ``keep_previous`` is off or there is
        nothing to restore."""
        if not self.keep_previous:
            raise RefitError(
                "rollback() needs TransferConfig(commit='staged', keep_previous=True): without it the previous "
                f"version is not kept (it would take another {share_bytes(self.live)} bytes on this process)"
            )
        if not self.restorable:
            raise RefitError(
                f"rollback(): nothing to restore on this process (live version {self.version}; a rollback "
                "undoes one commit, once)"
            )
        if pause is not None:
            pause()
        try:
            _copy(self.live, self.previous)
        finally:
            if resume is not None:
                resume()
        self.version, self.previous_version, self.restorable = self.previous_version, None, False
        return self.version


def _copy(dst: Mapping[str, torch.Tensor], src: Mapping[str, torch.Tensor]) -> None:
    """``dst[n] <- src[n]`` for every tensor, finished on the device when this returns."""
    for n, t in dst.items():
        t.copy_(src[n])
    _sync(dst)


def _sync(tensors: Mapping[str, torch.Tensor]) -> None:
    devices = {t.device for t in tensors.values() if t.is_cuda}
    for d in devices:
        torch.cuda.synchronize(d)


@dataclass(frozen=True)
class TokenVersions:
    """The weight version of every token of one finished request.

    ``changes``: ``(first token index, version)`` pairs in token order: token ``i`` came from the
    version of the last pair whose index is <= ``i``; the first pair's index is 0. ``n_tokens``: the
    request's output tokens. ``aborted``: the request was aborted at a commit (policy ``abort``)."""

    changes: tuple[tuple[int, int], ...]
    n_tokens: int
    aborted: bool = False

    def __post_init__(self) -> None:
        """Indices start at 0, increase and lie within the tokens; versions are integers."""
        idx = [i for i, _ in self.changes]
        if not self.changes or idx[0] != 0 or idx != sorted(set(idx)) or idx[-1] > max(self.n_tokens, 0):
            raise ValueError(f"TokenVersions.changes must start at index 0 and increase, got {self.changes!r}")

    def per_token(self) -> list[int]:
        """The version of each token."""
        out, bounds = [], [*(i for i, _ in self.changes[1:]), self.n_tokens]
        for (start, v), end in zip(self.changes, bounds):
            out += [v] * (end - start)
        return out
