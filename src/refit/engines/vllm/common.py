"""What the trainer side and the worker side share: rendezvous, layout exchange, info types."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from refit.layout import Box, Mesh, ModelLayout, TensorLayout

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class RefitInitInfo:
    """Worker-side init info (sent by trainer rank 0 through the client).

    The transfer group has ``world_size`` ranks: trainer ranks ``0..n_trainer-1``
    then workers ``n_trainer + (dp_index * tp * pp + worker rank)``.
    """

    master_address: str
    master_port: int
    n_trainer: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_buffers: int = 2
    buffer_bytes: int = 64 << 20
    session: str = "refit"
    load_path: str = "auto"  # "direct", "loader" or "auto" (direct where vLLM keeps parameters as loaded)


LOAD_PATHS = ("auto", "direct", "loader")


@dataclass
class RefitUpdateInfo:
    version: int = 0
    extra: dict = field(default_factory=dict)


def open_store(info: RefitInitInfo, is_master: bool) -> dist.Store:
    """The rendezvous store (trainer rank 0 hosts it), under the session's prefix."""
    timeout = timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(
        info.master_address,
        info.master_port,
        info.world_size if is_master else None,
        is_master,
        timeout=timeout,
        wait_for_workers=False,
    )
    return dist.PrefixStore(info.session, store)


def join_group(info: RefitInitInfo, store: dist.Store, rank: int) -> dist.ProcessGroup:
    """A standalone gloo group of the trainer ranks and the workers (blocks until all join)."""
    return dist.ProcessGroupGloo(
        dist.PrefixStore("pg", store), rank, info.world_size, timedelta(seconds=info.timeout_s)
    )


def wait_workers(store: dist.Store, n_workers: int, timeout_s: float) -> None:
    """Wait until every worker published its regions; raise at once with a worker's setup error."""
    import time

    deadline = time.monotonic() + timeout_s
    pending = set(range(n_workers))
    while pending:
        for w in sorted(pending):
            if store.check([f"error/{w}"]):
                raise RuntimeError(
                    f"refit: vLLM worker {w} refused the transfer at init: {store.get(f'error/{w}').decode()}"
                )
            if store.check([f"dst/{w}"]):
                pending.discard(w)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"refit: vLLM workers {sorted(pending)} did not answer within {timeout_s:.0f}s")
        if pending:
            time.sleep(0.01)


def layout_to_json(layout: ModelLayout) -> str:
    out = []
    for t in layout:
        boxes = {str(r): [list(x) for x in b] for r in t.ranks if (b := t.box(r)) is not None}
        out.append(
            {"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "boxes": boxes}
        )
    return json.dumps({"world_size": layout.world_size, "tensors": out})


def boxes_layout(
    entries: list[tuple[str, tuple[int, ...], torch.dtype, dict[int, Box]]], world_size: int
) -> ModelLayout:
    """A ModelLayout given by explicit per-rank boxes."""
    mesh = Mesh((world_size,), ("rank",), tuple(range(world_size)))
    return ModelLayout(
        tuple(TensorLayout(n, shape, dtype, mesh, (Replicate(),), boxes=boxes) for n, shape, dtype, boxes in entries),
        world_size,
    )


def layout_from_json(text: str) -> ModelLayout:
    d = json.loads(text)
    entries = [
        (
            t["name"],
            tuple(t["shape"]),
            getattr(torch, t["dtype"]),
            {int(r): tuple(tuple(x) for x in b) for r, b in t["boxes"].items()},
        )
        for t in d["tensors"]
    ]
    return boxes_layout(entries, d["world_size"])


def gather_dst_layout(store: dist.Store, src: ModelLayout, n_workers: int) -> ModelLayout:
    """Every worker's published regions, as the destination layout (HF names, worker ranks)."""
    per_worker = [json.loads(store.get(f"dst/{w}")) for w in range(n_workers)]
    entries = []
    for t in src:
        boxes = {w: tuple(tuple(x) for x in regs[t.name]) for w, regs in enumerate(per_worker)}
        entries.append((t.name, t.shape, t.dtype, boxes))
    return boxes_layout(entries, n_workers)
