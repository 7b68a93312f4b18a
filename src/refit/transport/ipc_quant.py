"""FP8 engines on one GPU: the receiver quantizes its source's bf16 weights straight into its FP8 weights and
scales, in one pass (one read of the bf16 bytes, one write of the FP8 bytes), instead of the source
quantizing into FP8 copies that the receiver then copies (a second read and write of the FP8 bytes).

Where (decided by the source, from the plan, and published to the receiver): a quantized weight
(``quant.quantized_names``) that one receiver on the source's GPU pulls whole over CUDA IPC, weight and scales,
from a source whose ``prepare`` offers its live weight (``pull_sources()``: ``Fp8Quantizer`` does for a
weight held in one part); not in checksum mode (its sums compare the source's FP8 copy with what
arrived); not with ``REFIT_FP8_ON_PULL=0``. The source publishes, sealed, per receiver, the block shape and
the IPC handles of those live weights (an empty record when none); the receiver maps them and quantizes
each in its pull's CUDA graph (``IpcPuller``'s kernels), and the source's ``prepare`` skips them
(``skipped``). Both read the weight after the stage barrier that says the source's tensors are final,
so the bytes are those the source would have quantized (the same kernel, ``quant.quantize_into``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from refit.errors import PlanError
from refit.plan import Plan
from refit.quant import quantize_into, quantized_names, scale_name
from refit.transport.ipc_handles import check_handle_fields, handle_fields, rebuild_handle
from refit.transport.store import SignedStore


def enabled() -> bool:
    """``REFIT_FP8_ON_PULL`` is not ``0`` (the source's choice; its receivers follow its record)."""
    return os.environ.get("REFIT_FP8_ON_PULL", "1") != "0"


def _key(name: str, src_proc: int, receiver: int) -> str:
    return f"{name}/ipc/{src_proc}/{receiver}/fp8"


def wanted(plan: Plan) -> bool:
    """Whether the plan moves quantized weights (then every IPC source publishes a record per receiver)."""
    return bool(quantized_names(plan.src_layout))


def on_pull_names(plan: Plan, proc: int, receiver: int, offered: dict[str, torch.Tensor]) -> list[str]:
    """The quantized weights of source process ``proc`` that ``receiver`` quantizes on its pull: pulled by it
    alone, over IPC on the same GPU, weight and scales each as the source's whole tensor."""
    if not plan.procs.same_device(proc, receiver):
        return []
    pulls: dict[str, list[tuple[int, tuple]]] = {}
    for m in plan.messages:
        if m.transport == "ipc" and plan.procs.src[m.src] == proc:
            for p in m.pieces:
                pulls.setdefault(p.tensor, []).append((plan.procs.dst[m.dst], p.box))
    src_rank = plan.procs.src.index(proc)
    out = []
    for name in quantized_names(plan.src_layout):
        if name not in offered:
            continue
        ok = True
        for n in (name, scale_name(name)):
            whole = plan.src_layout[n].box(src_rank)
            ok &= [(r, _box(b)) for r, b in pulls.get(n, [])] == [(receiver, _box(whole))]
        if ok:
            out.append(name)
    return out


def _box(box) -> tuple:
    return tuple(tuple(d) for d in box) if box is not None else ()


def publish(plan: Plan, proc: int, store: SignedStore, name: str, prepare: object, checksums: bool) -> set[str]:
    """Source side: for every receiver that pulls from this process, publish which weights it quantizes on
    its pull (and their live tensors' handles); returns those names (``prepare`` skips them)."""
    offer = getattr(prepare, "pull_sources", None)
    offered = offer() if callable(offer) and enabled() and not checksums else {}
    receivers = sorted(
        {plan.procs.dst[m.dst] for m in plan.messages if m.transport == "ipc" and plan.procs.src[m.src] == proc}
    )
    skipped: set[str] = set()
    for r in receivers:
        names = on_pull_names(plan, proc, r, offered)
        record = {"block": list(getattr(prepare, "block", (128, 128))), "handles": {}}
        for n in names:
            record["handles"][n] = handle_fields(offered[n])
        store.put_sealed(_key(name, proc, r), json.dumps(record).encode())
        skipped.update(names)
    return skipped


class OnPull:
    """One weight quantized on the receiver's pull: the source's live weight (mapped) into this process's
    FP8 weight and scales. ``fn(stream)`` enqueues it; ``warm()`` compiles its kernel (setup, before a
    graph records it) into scratch tensors, never into the destination."""

    def __init__(self, name: str, w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]):
        gn, gk = (-(-n // b) for n, b in zip(w.shape[-2:], block))
        want_s = (*w.shape[:-2], gn, gk)
        if tuple(q.shape) != tuple(w.shape) or tuple(s.shape) != want_s or q.device != w.device:
            raise PlanError(
                f"FP8 on pull: weight {name!r}: the source's {list(w.shape)} on {w.device} cannot fill this "
                f"process's weight {list(q.shape)} and scales {list(s.shape)} on {q.device} (want {list(want_s)})"
            )
        self.name, self.w, self.q, self.s, self.block = name, w, q, s, block
        self.cost = w.numel() * 3 // 2  # bytes moved, in a copy's units (a copy of n bytes moves 2n)

    def fn(self, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            quantize_into(self.w, self.q, self.s, self.block)

    def warm(self) -> None:
        quantize_into(self.w, torch.empty_like(self.q), torch.empty_like(self.s), self.block)


def import_jobs(
    store: SignedStore, name: str, src_proc: int, proc: int, timeout_s: float, views: Callable[[str], tuple]
) -> list[OnPull]:
    """Receiver side: the weights source process ``src_proc`` published for this process (``publish``), each
    an ``OnPull`` into ``views(name)`` = (FP8 weight view, scales view)."""
    record = json.loads(store.get_sealed(_key(name, src_proc, proc), timeout_s))
    if not isinstance(record, dict) or set(record) != {"block", "handles"} or not isinstance(record["handles"], dict):
        raise PlanError(f"FP8 on pull: the record of process {src_proc} is not {{block, handles}}")
    block = record["block"]
    if not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and 0 < b <= 1 << 16 for b in block)
    ):
        raise PlanError(f"FP8 on pull: process {src_proc} published block {block!r}, not two positive ints")
    jobs = []
    for n, f in sorted(record["handles"].items()):
        w = rebuild_handle(check_handle_fields(f))
        jobs.append(OnPull(n, w, *views(n), (block[0], block[1])))
    return jobs
