"""How the processes of one plan reach each other (``Comms``): what the executor is handed at setup."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from refit.errors import ConfigError
from refit.transport.store import SignedStore

__all__ = ["Comms"]


@dataclass(frozen=True)
class Comms:
    """How the processes of one plan reach each other.

    ``group``: P2P ops (default: the default group). ``sync_group``: the barriers of a plan with IPC
    links that are not all IPC. ``store``: the rendezvous store (IPC handles, the host barrier's
    name). ``standalone``: ``group`` is a ProcessGroup object made outside torch.distributed's world
    (e.g. ``ProcessGroupGloo(store, rank, size)`` inside a vLLM worker, whose world is vLLM's); peers
    are its ranks and ops go straight to it.
    """

    group: dist.ProcessGroup | None = None
    sync_group: dist.ProcessGroup | None = None
    store: SignedStore | None = None
    standalone: bool = False

    def __post_init__(self) -> None:
        if self.standalone and self.group is None:
            raise ConfigError("Comms(standalone=True) needs the ProcessGroup object as group, got group=None")
