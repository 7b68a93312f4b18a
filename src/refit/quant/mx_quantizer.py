"""A trainer rank's MXFP8 / NVFP4 copies of its shards, refreshed before every push (``MxQuantizer``).

Each rank quantizes only its own shards: blocks run along the last dim and layouts are refused where a
column cut splits a block (``mx_layout``), so every block lies on one rank and the bytes are those of
quantizing the whole tensor. NVFP4's ``weight_scale_2`` depends on the whole tensor's ``max |x|``: before
quantizing, the trainer ranks agree on it (``agree``: one all-reduce MAX over ``group`` of a float32 vector,
one entry per leading index of every NVFP4 tensor, the entries of tensors a rank does not hold at 0), then
share it within the groups vLLM fuses (``mx_layout.global_key``). On CUDA the Triton kernels of ``mx_triton``
write the same bytes in one pass.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from refit.layout.tensors import Box, LayoutError, ModelLayout, TensorLayout, box_shape, box_slices
from refit.quant.graphs import StepGraphs
from refit.quant.mx import nvfp4_scale_2, quantize_mxfp8, quantize_nvfp4
from refit.quant.mx_layout import MxFormat, block_scale_name, global_key, global_scale_name, mx_names, shares_dim1
from refit.quant.mx_scales import ScaleTable

CHUNK_BYTES = 256 << 20

Job = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, Box]  # name, live part, its q rows, s rows, its box


def use_triton(w: torch.Tensor) -> bool:
    """CUDA tensors go through ``mx_triton`` (one pass) unless ``REFIT_MX_TRITON=0`` or Triton is missing."""
    if not w.is_cuda or os.environ.get("REFIT_MX_TRITON", "1") == "0":
        return False
    from refit.quant import mx_triton

    return mx_triton.AVAILABLE


def quantize_into(
    w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, fmt: MxFormat, scale_2: torch.Tensor | None = None
) -> None:
    """``w`` [..., N, K] quantized in ``fmt`` into ``q`` and ``s`` (contiguous), ``scale_2``: NVFP4's agreed
    global scale (the shape of ``w``'s leading dims). Rows are independent: the work runs on [rows, K]."""
    k = w.shape[-1]
    x = w.reshape(-1, k)
    rows = x.shape[0]
    if use_triton(w):
        from refit.quant.mx_triton import quantize_rows_triton

        s2 = None if scale_2 is None else scale_2.reshape(-1).to(w.device, torch.float32)  # a view where it is
        quantize_rows_triton(x, q.view(rows, -1), s.view(rows, -1), fmt.name, s2, w.shape[-2] if w.dim() > 1 else 1)
        return
    s2 = None if scale_2 is None else scale_2.float().reshape(*scale_2.shape, 1).expand(*w.shape[:-1]).reshape(-1)
    qx, sx = q.view(rows, -1), s.view(rows, -1)
    step = max(1, CHUNK_BYTES // max(1, 8 * k))  # float32 temporaries of about CHUNK_BYTES
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if s2 is not None:
            qq, ss = quantize_nvfp4(x[r0:r1].unsqueeze(1), s2[r0:r1])
        else:
            qq, ss = quantize_mxfp8(x[r0:r1])
        qx[r0:r1].copy_(qq.reshape(r1 - r0, -1))
        sx[r0:r1].copy_(ss.reshape(r1 - r0, -1))


def shared_scale_2(amax: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NVFP4 ``weight_scale_2`` per tensor from each whole tensor's ``max |x|`` per leading index (float32),
    shared where vLLM fuses: gate and up of a stacked expert, tensors of one ``global_key``."""
    amax = {n: a.amax(dim=1, keepdim=True).expand_as(a) if shares_dim1(n) else a for n, a in amax.items()}
    shared: dict[tuple[str, int | None], torch.Tensor] = {}
    for n, a in amax.items():
        key = global_key(n)
        shared[key] = a if key not in shared else torch.maximum(shared[key], a)
    return {n: nvfp4_scale_2(shared[global_key(n)]) for n in amax}


class MxQuantizer:
    """A sender's ``fmt`` copies of its shards of the quantized tensors.

    ``tensors`` is what to give the Sender (quantized weights, block scales, NVFP4 global scales; every other
    tensor the live one); pass the quantizer as its ``prepare``. ``group``: the trainer ranks' process group,
    over which NVFP4's global scales are agreed (required for NVFP4 when the trainer has more than one rank).
    A refit that prepares all names at once agrees first by itself; a staged one (``TransferConfig.stages``)
    needs ``agree()`` called on every trainer rank after each optimizer step: a weight prepared twice since the
    last agreement is refused. On CUDA the agreement's steps and the quantization are CUDA graphs after their
    second use (``StepGraphs``; the all-reduce stays outside).

    NVFP4's agreement reads every weight once for its ``max |x|`` unless the trainer hands it over first:
    ``set_amax`` (after the optimizer step whose weights the next refit sends), consumed by the next agreement;
    an agreement without it reads the weights, and amax handed over before a weight changed in place (its
    tensor's version counter moved) is refused. With one trainer rank ``set_amax`` computes the global scales
    itself (nothing to agree on): the refit then launches nothing for them.
    """

    def __init__(
        self,
        qlayout: ModelLayout,
        rank: int,
        live: Mapping[str, torch.Tensor],
        fmt: MxFormat,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.fmt, self.rank, self.group, self.layout = fmt, rank, group, qlayout
        self.quantized = mx_names(qlayout, fmt)
        if fmt.global_scale and group is None and qlayout.world_size > 1 and self.quantized:
            raise LayoutError(
                f"NVFP4 source rank {rank}: {qlayout.world_size} trainer ranks must agree on weight_scale_2 of "
                f"{self.quantized[0]!r} and the others; pass group= (the trainer ranks' process group)"
            )
        self.jobs: list[Job] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.scale_2: dict[str, torch.Tensor] = {}  # the agreed global scales, whole (leading-dims shape)
        self._pending: set[str] = set()
        self._on_pull: set[str] = set()  # weights receivers quantize on their pulls (``on_pull``)
        self._steps: dict = {}  # per call's names: what the call does (``_steps_of``; ``on_pull`` clears it)
        self._amax: list[int] | None = None  # the jobs' versions when the trainer handed its amax over
        boxes = {t.name: b for t, b in qlayout.local_tensors(rank)}
        qset = set(self.quantized)
        companions = {block_scale_name(n) for n in qset} | {global_scale_name(n) for n in qset}
        for name, box in boxes.items():
            if name in companions:
                continue
            if name not in live:
                raise LayoutError(f"{fmt.name.upper()} source rank {rank}: local tensor {name!r} is missing")
            if name not in qset:
                self.tensors[name] = live[name]
                continue
            self._add(qlayout[name], live[name], box, boxes)
        self.device = next((w.device for _, w, _, _, _ in self.jobs if w.numel()), torch.device("cpu"))
        self.graphs = StepGraphs(self.device.type == "cuda", f"the {fmt.name.upper()} quantization")
        self.table = None
        if fmt.global_scale:
            self.table = ScaleTable(qlayout, rank, self.quantized, [(n, p) for n, _, _, _, p in self.jobs], self.device)
            self.tensors.update(self.table.tensors)
            self.scale_2 = {n: self.table.whole(n) for n in self.quantized}

    def _add(self, t: TensorLayout, w, box: Box, boxes: dict[str, Box]) -> None:
        parts = list(w) if isinstance(w, (list, tuple)) else [w]
        dev = parts[0].device
        q = torch.empty(box_shape(box), dtype=self.fmt.dtype, device=dev)
        s = torch.empty(box_shape(boxes[block_scale_name(t.name)]), dtype=self.fmt.scale_dtype, device=dev)
        self.tensors[t.name], self.tensors[block_scale_name(t.name)] = q, s
        spans = t.parts(self.rank) if len(parts) > 1 else [box]
        lo = box[0][0]
        for part, p in zip(spans, parts):
            a, b = part[0][0] - lo, part[0][1] - lo  # rows (dim 0) are never cut by a block
            self.jobs.append((t.name, p, q[a:b], s[a:b], part))

    def set_amax(self, amax: Mapping[str, torch.Tensor]) -> None:
        """NVFP4: the trainer's ``max |x|`` of each NVFP4 weight this rank holds (its part of it), float32 of the
        part's leading dims' shape (``[]`` for a matrix, ``[E]`` for stacked experts), on the weights' device,
        finite and ``>= 0``; the next agreement uses it instead of reading the weights (once). Where this rank
        agrees with no other (one trainer rank), the global scales are computed from it here, and that agreement
        only checks that no weight changed since."""
        if self.table is None:
            raise ValueError(f"{self.fmt.name.upper()} source rank {self.rank}: set_amax is for NVFP4's global scales")
        self.table.hand_over(self.table.check_amax(amax, self.rank, self.device))
        self._amax = [w._version for _, w, _, _, _ in self.jobs]
        if self._alone():  # nothing to agree on with other ranks: the global scales now, not inside the refit
            with torch.no_grad():
                self.graphs.run(("amax and scales", "handed"), self._handed_scales)

    def read_amax(self) -> dict[str, torch.Tensor]:
        """What ``set_amax`` takes, read from this rank's weights (the amax a trainer would hand over)."""
        if self.table is None:
            raise ValueError(f"{self.fmt.name.upper()} source rank {self.rank}: read_amax is for NVFP4's global scales")
        with torch.no_grad():
            self.table.local_amax([w.detach() for _, w, _, _, _ in self.jobs])
            flat = self.table.local[self.table.amax_index]
        out, at = {}, 0
        for n, shape in self.table.amax_shape.items():
            k = math.prod(shape)
            out[n], at = flat[at : at + k].reshape(shape).clone(), at + k
        return out

    def _alone(self) -> bool:
        """Whether this rank agrees with no other (a maximum over one rank is its own)."""
        return self.group is None or dist.get_world_size(self.group) == 1

    def _handed_scales(self) -> None:
        self.table.take_amax()
        self.table.scales()

    def _amax_handed(self) -> bool:
        """Whether the trainer handed its amax over for this agreement (True: in the table's ``handed``), checked
        against the weights' versions then; False: nothing handed over."""
        if self._amax is None:
            return False
        versions, self._amax = self._amax, None
        now = [w._version for _, w, _, _, _ in self.jobs]
        if now != versions:
            name = next(j[0] for j, v, n in zip(self.jobs, versions, now) if v != n)
            raise LayoutError(
                f"NVFP4 source rank {self.rank}: weight {name!r} changed after set_amax; hand the amax over "
                "after the optimizer step whose weights the refit sends"
            )
        return True

    def agree(self) -> None:
        """NVFP4: agree with the other trainer ranks (collective over ``group``) on every tensor's
        ``weight_scale_2`` and write this rank's boxes of them. MXFP8: nothing to agree."""
        if self.table is None:
            return
        table = self.table
        alone, handed = self._alone(), self._amax_handed()
        if handed and alone:  # ``set_amax`` computed this rank's scales already
            self._pending = set(self.quantized)
            return

        def take() -> None:  # this rank's amax: the trainer's, or read from the weights
            if handed:
                table.take_amax()
            else:
                table.local_amax([w.detach() for _, w, _, _, _ in self.jobs])

        if alone:  # nothing to agree: the amax read and the scales as one step (one graph)
            self.graphs.run(("amax and scales", "read"), lambda: (take(), table.scales()))
            self._pending = set(self.quantized)
            return
        self.graphs.run(("amax", "handed" if handed else "read"), take)
        backend = dist.get_backend(self.group)
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        buf = table.local.to(dev)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        table.local.copy_(buf)
        self.graphs.run("scales", table.scales)
        self._pending = set(self.quantized)

    def pull_sources(self) -> dict[str, torch.Tensor]:
        """The live weights held whole (one part) on a GPU, which a receiver on that GPU may quantize itself on its
        pull (``refit.transport.ipc_quant``; NVFP4's with ``scale_2[name]``, agreed before the pull)."""
        parts = [name for name, *_ in self.jobs]
        return {name: w for name, w, *_ in self.jobs if parts.count(name) == 1 and w.is_cuda and w.numel()}

    def on_pull(self, names: set[str]) -> None:
        """``names``: the weights receivers quantize on their pulls (``ipc_quant.publish``); a prepare of every
        other quantized weight is then a whole refit, which agrees first."""
        self._on_pull = set(names)
        self._steps = {}

    @property
    def nbytes(self) -> int:
        return sum(q.numel() * q.element_size() + s.numel() * s.element_size() for _, _, q, s, _ in self.jobs)

    def _quantize(self, names: frozenset[str] | None) -> None:
        for j, (name, w, q, s, part) in enumerate(self.jobs):
            if w.numel() and (names is None or name in names):
                s2 = self.table.job_scales(j, box_shape(part[:-2])) if self.table is not None else None
                quantize_into(w, q, s, self.fmt, s2)

    def __call__(self, names: set[str] | None = None) -> None:
        """Quantize the shards of ``names`` (``None``: all, after agreeing on NVFP4's global scales)."""
        key = None if names is None else frozenset(names)
        agrees, want, work = self._steps.get(key) or self._steps_of(key)
        with torch.no_grad():
            if agrees:
                self.agree()
            elif self.fmt.global_scale:  # a stage; a weight quantized on its pull counts with its block scales
                stale = sorted(want - self._pending)
                if stale:
                    raise LayoutError(
                        f"NVFP4 source rank {self.rank}: weight {stale[0]!r} is quantized again without a new "
                        "weight_scale_2 agreement; in a staged refit call agree() on every trainer rank after each "
                        "optimizer step, before the push"
                    )
                self._pending -= want
            if work:  # nothing to launch where receivers quantize every weight of ``names`` on their pulls
                self.graphs.run(("quantize", key), lambda: self._quantize(key))

    def _steps_of(self, key: frozenset[str] | None) -> tuple[bool, set[str], bool]:
        """What a call with ``key``'s names does (kept per key; a refit repeats them): whether it agrees first, the
        quantized weights a stage takes (NVFP4), whether any shard is quantized here."""
        agrees = key is None or (self.fmt.global_scale and set(self.quantized) <= key | self._on_pull)
        want: set[str] = set()
        if not agrees and self.fmt.global_scale:
            want = {n for n in key if n in self.quantized} | {n for n in self._on_pull if block_scale_name(n) in key}
        work = any(w.numel() and (key is None or name in key) for name, w, _, _, _ in self.jobs)
        if len(self._steps) >= 64:  # a refit repeats a few (its stages); other callers' sets are not all kept
            self._steps.clear()
        self._steps[key] = (agrees, want, work)
        return self._steps[key]


def expected_mx(
    full: torch.Tensor, fmt: MxFormat, boxes: Mapping[str, Box], name: str, s2: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """What a destination rank holding ``boxes`` of ``name``'s weight, scales (and global scale) must hold:
    the whole tensor ``full`` quantized at once with NVFP4's ``s2`` (from ``shared_scale_2``; for checks)."""
    if fmt.global_scale:
        q, s = quantize_nvfp4(full, s2)
    else:
        q, s, s2 = *quantize_mxfp8(full), None
    out = {}
    for key, val in ((name, q), (block_scale_name(name), s), (global_scale_name(name), s2)):
        if key in boxes and val is not None:
            out[key] = val[box_slices(boxes[key])]
    return out


def expected_mx_shards(
    full: Mapping[str, torch.Tensor], dst: ModelLayout, rank: int, fmt: MxFormat
) -> dict[str, torch.Tensor]:
    """Every quantized tensor (weights, block and global scales) destination ``rank`` of ``dst`` (from
    ``mx_layout``) must hold, from the whole unquantized tensors ``full`` (for checks)."""
    names = mx_names(dst, fmt)
    s2 = shared_scale_2({n: full[n].abs().float().amax(dim=(-2, -1)) for n in names}) if fmt.global_scale else {}
    boxes = {t.name: b for t, b in dst.local_tensors(rank)}
    out: dict[str, torch.Tensor] = {}
    for n in names:
        if n in boxes:
            out.update(expected_mx(full[n], fmt, boxes, n, s2.get(n)))
    return out
