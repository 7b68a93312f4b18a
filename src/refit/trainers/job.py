"""A refit job between trainer ranks and engine processes that share no ``torch.distributed`` world.

Trainers such as Megatron-Core own their processes' default group (its world is the trainer's ranks
alone, and Megatron sizes its parallel groups from it); engine processes have their own or none. A
``TransferJob`` joins both sides in a transfer group of their own, beside those worlds::

    job = TransferJob.join("10.0.0.1", 29600, proc, n_src=4, n_dst=2)  # every process; process 0 hosts
    src = job.share_layout(source.layout() if proc == 0 else None)  # process 0's layout, on every process
    peer = job.peer(src, dst, src_tensors=...)  # a trainer process; an engine process: dst_tensors=...
    peer.run(version)  # after each optimizer step, on every process, same increasing version
    peer.close()

Processes ``0..n_src-1`` are the trainer ranks (the source layout's ranks, in order; process 0 is trainer
rank 0 and hosts the rendezvous store), processes ``n_src..n_src+n_dst-1`` the engine ranks. Every process
needs the job's secret in ``REFIT_SECRET`` (or ``REFIT_SECRET_FILE``): every value refit reads from the
store is tagged with it. The store listens on ``address`` only; the group's listeners on
``REFIT_BIND_ADDRESS`` if set, else on this host's address on the route to ``address``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from refit.config import TransferConfig
from refit.errors import ConfigError
from refit.layout import ModelLayout
from refit.plan import ProcessMap
from refit.transfer import Peer
from refit.transport import auth
from refit.transport.store import BIND_ENV, JOB_ENV, SignedStore, gloo_group, local_address_for, open_store

_PREFIX = "refit-job"


def _count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"TransferJob: {name} must be an integer >= {least}, got {value!r}")
    return value


@dataclass
class TransferJob:
    """One process's membership in a refit job whose transfer group is its own (see the module).

    ``store``: the job's rendezvous store, signed with the job secret (plain JSON values; ``Peer``'s
    pre-flight, aborts and votes go through it, and so may the user's own values, under keys of their
    own). ``group``: a standalone gloo group over all ``n_src + n_dst`` processes, outside any
    ``torch.distributed`` world (the trainer's default group stays the trainer's).

    Lifecycle: ``join`` on every process at once; ``share_layout`` and ``peer`` in the same order on every
    process; ``Peer.run(version)`` per refit; ``Peer.close()``. Process 0 hosts the store: it must not exit
    while the others still use the job (their last ``run``, or their own values in the store).
    """

    proc: int
    n_src: int
    n_dst: int
    store: SignedStore
    group: Any
    timeout_s: float

    @classmethod
    def join(
        cls, address: str, port: int, proc: int, *, n_src: int, n_dst: int, timeout_s: float = 300.0
    ) -> TransferJob:
        """Join the job (blocks until all ``n_src + n_dst`` processes have joined, up to ``timeout_s``):
        process 0 hosts the store at ``address:port``, the others connect to it, then all make the group.

        ``ConfigError`` naming the argument for bad counts, ``proc`` outside the job, a port outside
        1..65535 or a missing job secret (checked before anything listens)."""
        n_src, n_dst = _count("n_src", n_src, 1), _count("n_dst", n_dst, 1)
        world = n_src + n_dst
        if isinstance(proc, bool) or not isinstance(proc, int) or not 0 <= proc < world:
            raise ConfigError(
                f"TransferJob: proc must be in 0..{world - 1} ({n_src} + {n_dst} processes), got {proc!r}"
            )
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
            raise ConfigError(f"TransferJob: port must be in 1..65535 (every process names it), got {port!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not math.isfinite(timeout_s):
            raise ConfigError(f"TransferJob: timeout_s must be a finite number of seconds, got {timeout_s!r}")
        if timeout_s <= 0:
            raise ConfigError(f"TransferJob: timeout_s must be > 0, got {timeout_s!r}")
        secret = auth.job_secret()  # ConfigError without one, before anything listens
        raw = open_store(address, port, world, proc == 0, timeout_s, secret=secret)
        store = SignedStore(dist.PrefixStore(_PREFIX, raw), secret, os.environ.get(JOB_ENV, ""))
        listen = os.environ.get(BIND_ENV) or local_address_for(address, port)
        group = gloo_group(dist.PrefixStore(f"{_PREFIX}/pg", raw), proc, world, timeout_s, listen)
        return cls(proc, n_src, n_dst, store, group, float(timeout_s))

    @property
    def procs(self) -> ProcessMap:
        """Trainer ranks are processes ``0..n_src-1``, engine ranks follow (``ProcessMap.disjoint``)."""
        return ProcessMap.disjoint(self.n_src, self.n_dst)

    @property
    def src_rank(self) -> int | None:
        """This process's trainer rank, or None on an engine process."""
        return self.proc if self.proc < self.n_src else None

    @property
    def dst_rank(self) -> int | None:
        """This process's engine rank, or None on a trainer process."""
        return self.proc - self.n_src if self.proc >= self.n_src else None

    def share_layout(self, layout: ModelLayout | None = None, *, owner: int = 0) -> ModelLayout:
        """Process ``owner``'s ``layout`` on every process: ``owner`` publishes it (as a
        ``refit.layout/1`` document, ``ModelLayout.to_json``), the others read it back (waiting up to
        ``timeout_s``; ``from_json`` validates it) and ignore what they pass. Typical: trainer rank 0
        shares the source layout, which the engines cannot read from a model they do not hold."""
        if not 0 <= owner < self.n_src + self.n_dst:
            raise ConfigError(f"TransferJob.share_layout: owner must be a process of the job, got {owner!r}")
        key = f"layout/{owner}"
        if self.proc == owner:
            if not isinstance(layout, ModelLayout):
                raise ConfigError(
                    f"TransferJob.share_layout: process {owner} shares the layout; it passed "
                    f"{type(layout).__name__}, not a ModelLayout"
                )
            self.store.put(key, layout.to_json())
            return layout
        return ModelLayout.from_json(self.store.get(key, self.timeout_s))

    def peer(
        self,
        src_layout: ModelLayout,
        dst_layout: ModelLayout,
        *,
        src_tensors: dict[str, torch.Tensor] | None = None,
        dst_tensors: dict[str, torch.Tensor] | None = None,
        config: TransferConfig | None = None,
        **kwargs: Any,
    ) -> Peer:
        """This process's ``Peer`` over the job's group and store (collective: every process of the job
        builds its own, with the same layouts and ``config``): a trainer process passes its local
        shards as ``src_tensors``, an engine process its live tensors as ``dst_tensors``. ``kwargs``
        go to ``Peer`` (``device``, ``prepare``, ``tag_base``, ...); ``config.preflight_timeout_s``
        defaults to the job's ``timeout_s``. Two Peers on one job need distinct ``config.name``s."""
        if src_layout.world_size != self.n_src or dst_layout.world_size != self.n_dst:
            raise ConfigError(
                f"TransferJob.peer: the job has {self.n_src} trainer and {self.n_dst} engine processes; the "
                f"layouts have {src_layout.world_size} source and {dst_layout.world_size} destination ranks"
            )
        config = config if config is not None else TransferConfig(preflight_timeout_s=self.timeout_s)
        return Peer(
            src_layout,
            dst_layout,
            self.proc,
            src_tensors=src_tensors,
            dst_tensors=dst_tensors,
            procs=self.procs,
            group=self.group,
            store=self.store,
            standalone=True,
            config=config,
            **kwargs,
        )


__all__ = ["TransferJob"]
