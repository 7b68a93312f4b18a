"""Leader fetch: inside a model-parallel group (the TP x CP x PP ranks of one DP replica, which
all need the same batch) one rank fetches from the store and broadcasts over torch.distributed;
the others never touch the store.

The leader first broadcasts a small descriptor (fields, dtypes, shapes — or the error its fetch
raised, so the others raise the same error instead of waiting for bytes that never come), then
every field's bytes in one uint8 buffer (bit-exact for any dtype, bf16 included, on any backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from refit.errors import DataError

from .meta import BatchMeta
from .store import Rows, Store


class LeaderFetchError(DataError):
    """The leader's fetch failed; raised on every rank of the group."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def leader_fetch(
    store: Store | None,
    keys: BatchMeta | Sequence[str],
    select_fields: Sequence[str],
    group: Any = None,
    leader: int = 0,
    partition: str | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, Rows]:
    """Every rank of ``group`` (None: the default group) calls this together: it is two
    broadcasts from the rank whose group rank is ``leader``, so it must sit at the same point of
    every rank's sequence of collectives on ``group``. Only the leader uses ``store``, ``keys``,
    ``select_fields`` and ``partition`` (the others may pass ``store=None``; they learn fields,
    dtypes and shapes from the leader's descriptor). Every rank, the leader included, returns
    the same ``{field: rows}`` (as ``Store.get``), copied out of the broadcast buffer.

    ``device``: where the broadcast buffer lives (``cuda`` for NCCL groups); results are on it.
    If the leader's fetch fails (or it has no store), every rank raises ``LeaderFetchError``
    carrying the leader's error."""
    me = dist.get_rank(group)
    src = dist.get_global_rank(group, leader) if group is not None else leader
    desc: list[Any] = [None]
    data: dict[str, Rows] = {}
    if me == leader:
        if store is None:
            err = f"leader_fetch: the leader (group rank {leader}) was given no store"
            desc[0] = ("error", err)
        else:
            try:
                data = store.get(keys, select_fields=select_fields, partition=partition)
                desc[0] = (
                    "ok",
                    [
                        (
                            f,
                            [
                                (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                for t in (v if isinstance(v, list) else [v])
                            ],
                            isinstance(v, list),
                        )
                        for f, v in data.items()
                    ],
                )
            except Exception as e:  # noqa: BLE001 - re-raised below, and on the others
                desc[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(desc, src=src, group=group)
    kind, body = desc[0]
    if kind == "error":
        raise LeaderFetchError(f"leader_fetch: the leader (global rank {src}) failed: {body}")
    parts = [(f, [(getattr(torch, d), s) for d, s in specs], ragged) for f, specs, ragged in body]
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, specs, _ in parts for d, s in specs]
    if me == leader:
        flat = [_bytes(t) for v in data.values() for t in (v if isinstance(v, list) else [v])]
        buf = torch.cat(flat).to(device) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        buf = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    out: dict[str, Rows] = {}
    off = 0
    for f, specs, ragged in parts:
        rows = []
        for d, s in specs:
            n = torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
            rows.append(buf[off : off + n].clone().view(d).reshape(s))
            off += n
        out[f] = rows if ragged else rows[0]
    return out


def replica_groups(mp_size: int) -> tuple[Any, int]:
    """Split the default group into DP replicas of ``mp_size`` consecutive ranks (one model-
    parallel group each). Every rank must call it (it creates every group). Returns this rank's
    group and its DP index."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if mp_size < 1 or world % mp_size:
        raise ValueError(f"replica_groups: mp_size={mp_size} must be >= 1 and divide the world size {world}")
    mine = None
    for r in range(world // mp_size):
        g = dist.new_group(list(range(r * mp_size, (r + 1) * mp_size)))
        if r == rank // mp_size:
            mine = g
    return mine, rank // mp_size
