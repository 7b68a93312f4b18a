"""FP8, MXFP8 and NVFP4 engines on one GPU: the receiver quantizes its source's bf16 weights straight into its
quantized weights and scales, in one pass (one read of the bf16 bytes, one write of the quantized bytes), instead
of the source quantizing into copies that the receiver then copies (a second read and write of those bytes).

Where (decided by the source, from the plan, and published to the receiver): a quantized weight (block FP8:
``quant.quantized_names``, its ``_scale_inv``; MXFP8: ``mx_layout.mx_names``, its ``_scale``) that one receiver
on the source's GPU pulls whole over CUDA IPC, weight and scales, from a source whose ``prepare`` offers its
live weight (``pull_sources()``: ``Fp8Quantizer`` and ``MxQuantizer`` do for a weight held in one part); not in
checksum mode (its sums compare the source's quantized copy with what arrived); not with
``REFIT_FP8_ON_PULL=0``. The source publishes, sealed, per receiver, the format, the FP8 block shape and the
IPC handles of those live weights (an empty record when none), for NVFP4 also those of their agreed
``weight_scale_2`` (``MxQuantizer.scale_2``: the source's prepare agrees before the stage barrier, told by
``on_pull`` that a prepare of every other weight is a whole refit; the global-scale tensors travel as
ordinary tensors); the receiver maps them and quantizes each in its pull's CUDA graph (``IpcPuller``'s
kernels), and the source's ``prepare`` skips them (``skipped``). Both read the weight after the stage barrier
that says the source's tensors are final, so the bytes are those the source would have quantized (the same
kernels: ``quant.quantize_into``, ``mx_quantizer.quantize_into``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from refit.errors import PlanError
from refit.layout import ModelLayout
from refit.plan import Plan
from refit.quant import quantize_into, quantized_names, scale_name
from refit.quant.mx_layout import FORMATS as MX_FORMATS
from refit.quant.mx_layout import MXFP8, NVFP4, block_scale_name, mx_names
from refit.quant.mx_quantizer import quantize_into as mx_quantize_into
from refit.transport.ipc_handles import check_handle_fields, handle_fields, rebuild_handle
from refit.transport.store import SignedStore


def enabled() -> bool:
    """``REFIT_FP8_ON_PULL`` is not ``0`` (the source's choice; its receivers follow its record)."""
    return os.environ.get("REFIT_FP8_ON_PULL", "1") != "0"


def _key(name: str, src_proc: int, receiver: int) -> str:
    return f"{name}/ipc/{src_proc}/{receiver}/fp8"


FORMATS = ("fp8", "mxfp8", "nvfp4")  # what a receiver quantizes on its pull


def scales_of(layout: ModelLayout) -> dict[str, str]:
    """Each quantized weight of ``layout`` a receiver may quantize on its pull -> its block scales' name."""
    out = {n: scale_name(n) for n in quantized_names(layout)}
    return out | {n: block_scale_name(n) for fmt in (MXFP8, NVFP4) for n in mx_names(layout, fmt)}


def scale_of(fmt: str, name: str) -> str:
    return scale_name(name) if fmt == "fp8" else block_scale_name(name)


def wanted(plan: Plan) -> bool:
    """Whether the plan moves quantized weights (then every IPC source publishes a record per receiver)."""
    return bool(scales_of(plan.src_layout))


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
    for name, scale in scales_of(plan.src_layout).items():
        if name not in offered:
            continue
        ok = True
        for n in (name, scale):
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
    fmt = getattr(getattr(prepare, "fmt", None), "name", "fp8")
    for r in receivers:
        names = on_pull_names(plan, proc, r, offered)
        record = {"format": fmt, "block": list(getattr(prepare, "block", (128, 128))), "handles": {}, "scale_2": {}}
        for n in names:
            record["handles"][n] = handle_fields(offered[n])
            if fmt == "nvfp4":  # the agreed global scales the receiver's kernel reads (the source's, on its GPU)
                record["scale_2"][n] = handle_fields(prepare.scale_2[n])
        store.put_sealed(_key(name, proc, r), json.dumps(record).encode())
        skipped.update(names)
    if skipped and callable(getattr(prepare, "on_pull", None)):
        prepare.on_pull(skipped)
    return skipped


class OnPull:
    """One weight quantized on the receiver's pull: the source's live weight (mapped) into this process's
    quantized weight and scales, in ``fmt`` (``FORMATS``). ``fn(stream)`` enqueues it; ``warm()`` compiles its
    kernel (setup, before a graph records it) into scratch tensors, never into the destination."""

    def __init__(
        self,
        name: str,
        w: torch.Tensor,
        q: torch.Tensor,
        s: torch.Tensor,
        block: tuple[int, int],
        fmt: str = "fp8",
        scale_2: torch.Tensor | None = None,
    ):
        want_q, want_2 = tuple(w.shape), None
        if fmt == "fp8":
            want_s = (*w.shape[:-2], *(-(-n // b) for n, b in zip(w.shape[-2:], block)))
        else:
            want_s = (*w.shape[:-1], -(-w.shape[-1] // MX_FORMATS[fmt].block))
        if fmt == "nvfp4":
            want_q, want_2 = (*w.shape[:-1], -(-w.shape[-1] // 2)), tuple(w.shape[:-2])
        bad_2 = want_2 is not None and (
            scale_2 is None or tuple(scale_2.shape) != want_2 or scale_2.dtype != torch.float32
        )
        if tuple(q.shape) != want_q or tuple(s.shape) != want_s or q.device != w.device or bad_2:
            raise PlanError(
                f"{fmt.upper()} on pull: weight {name!r}: the source's {list(w.shape)} on {w.device} cannot fill "
                f"this process's weight {list(q.shape)} and scales {list(s.shape)} on {q.device} (want "
                f"{list(want_q)} and {list(want_s)}"
                + ("" if want_2 is None else f", weight_scale_2 {list(want_2)}")
                + ")"
            )
        self.name, self.w, self.q, self.s, self.block, self.fmt = name, w, q, s, block, fmt
        self.scale_2 = scale_2
        self.scale = scale_of(fmt, name)
        self.cost = w.numel() * 3 // 2  # bytes moved, in a copy's units (a copy of n bytes moves 2n)

    def _quantize(self, q: torch.Tensor, s: torch.Tensor) -> None:
        if self.fmt == "fp8":
            quantize_into(self.w, q, s, self.block)
        else:
            mx_quantize_into(self.w, q, s, MX_FORMATS[self.fmt], self.scale_2)

    def fn(self, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            self._quantize(self.q, self.s)

    def warm(self) -> None:
        self._quantize(torch.empty_like(self.q), torch.empty_like(self.s))


def import_jobs(
    store: SignedStore, name: str, src_proc: int, proc: int, timeout_s: float, views: Callable[[str], tuple]
) -> list[OnPull]:
    """Receiver side: the weights source process ``src_proc`` published for this process (``publish``), each
    an ``OnPull`` into ``views(name, scale name)`` = (quantized weight view, scales view)."""
    record = json.loads(store.get_sealed(_key(name, src_proc, proc), timeout_s))
    keys = {"format", "block", "handles", "scale_2"}
    if (
        not isinstance(record, dict)
        or set(record) != keys
        or not all(isinstance(record[k], dict) for k in keys - {"format", "block"})
    ):
        raise PlanError(f"FP8 on pull: the record of process {src_proc} is not {{format, block, handles, scale_2}}")
    fmt, block = record["format"], record["block"]
    if fmt not in FORMATS:
        raise PlanError(f"FP8 on pull: process {src_proc} published format {fmt!r}, not one of {', '.join(FORMATS)}")
    if not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and 0 < b <= 1 << 16 for b in block)
    ):
        raise PlanError(f"FP8 on pull: process {src_proc} published block {block!r}, not two positive ints")
    if set(record["scale_2"]) != (set(record["handles"]) if fmt == "nvfp4" else set()):
        raise PlanError(
            f"FP8 on pull: process {src_proc} published weight_scale_2 handles that do not match its weights"
        )
    jobs = []
    for n, f in sorted(record["handles"].items()):
        w = rebuild_handle(check_handle_fields(f))
        s2 = rebuild_handle(check_handle_fields(record["scale_2"][n])) if fmt == "nvfp4" else None
        jobs.append(OnPull(n, w, *views(n, scale_of(fmt, n)), (block[0], block[1]), fmt, s2))
    return jobs
