"""NVFP4's global scales of a trainer rank as one vector (``ScaleTable``), so that a refit's agreement is a few
whole-vector operations instead of host work per tensor.

An *entry* is one ``weight_scale_2``: one leading index (``[...]`` of ``[..., N, K]``) of one NVFP4 tensor, whole
tensors in ``names`` order, row-major. Built once at setup (host work): each entry's sharing group (tensors of
one ``mx_layout.global_key`` at one leading index, gate and up of an expert together: ``shared_scale_2``'s
grouping), each job's entries (the leading indices of the part it quantizes, row-major: row ``r`` of its
``[rows, K]`` view is entry ``r // N``) and this rank's global-scale tensors as views of one buffer. Per refit:
``local_amax`` (one infinity norm launch for all 2-D parts, one per stacked part, one scatter-reduce MAX into
``local``), the caller's all-reduce of ``local``, then ``scales`` (one scatter-reduce per group, one vectorized
``nvfp4_scale_2``, two gathers: the jobs' per-row scales and the global-scale tensors). The bytes are those of
``mx_quantizer.shared_scale_2`` (the same maxima, the same division).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import torch

from refit.layout.tensors import Box, ModelLayout, box_numel, box_shape
from refit.quant.mx import nvfp4_scale_2
from refit.quant.mx_layout import global_key, global_scale_name, shares_dim1


def _indices(box: Box, shape: Sequence[int]) -> list[int]:
    """Row-major flat indices into ``shape`` of the cells of ``box`` (over the same dims), in row-major order."""
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*(range(a, b) for a, b in box))]


class ScaleTable:
    """This rank's NVFP4 entries (``local``: float32 ``max |x|`` per entry, 0 where not held; ``s2``: the agreed
    ``weight_scale_2`` per entry), its jobs' per-row scales (``job_s2``) and its global-scale tensors
    (``tensors``: views of one buffer). ``parts``: per job, (tensor name, its part's box)."""

    def __init__(
        self, layout: ModelLayout, rank: int, names: Sequence[str], parts: Sequence[tuple[str, Box]], device
    ) -> None:
        self.offset: dict[str, int] = {}
        self.lead: dict[str, tuple[int, ...]] = {}
        groups: dict[tuple, int] = {}
        group = []
        for n in names:
            self.offset[n], self.lead[n] = len(group), tuple(layout[n].shape[:-2])
            for idx in itertools.product(*(range(d) for d in self.lead[n])):
                key = (global_key(n), (idx[0], 0, *idx[2:]) if shares_dim1(n) else idx)
                group.append(groups.setdefault(key, len(groups)))
        self.n_groups = len(groups)

        def entries(name: str, lead_box: Box) -> list[int]:
            return [self.offset[name] + i for i in _indices(lead_box, self.lead[name])]

        # jobs: the 2-D parts (one entry each, one foreach norm) first, then the stacked ones
        live = [j for j, (_, b) in enumerate(parts) if box_numel(b)]
        self.flat_jobs = [j for j in live if len(parts[j][1]) == 2]
        self.stacked_jobs = [j for j in live if len(parts[j][1]) > 2]
        self.job_slice: dict[int, slice] = {}
        order: list[int] = []
        for j in self.flat_jobs + self.stacked_jobs:
            n, b = parts[j]
            e = entries(n, b[:-2])
            self.job_slice[j] = slice(len(order), len(order) + len(e))
            order += e
        own = {t.name: b for t, b in layout.local_tensors(rank)}
        self.held = [n for n in names if global_scale_name(n) in own]  # the rank's global-scale tensors, in order
        gidx = [entries(n, own[global_scale_name(n)]) for n in self.held]
        # the trainer's amax (``set_amax``): per tensor the rank quantizes a part of, its box's leading indices
        quantized = {parts[j][0] for j in live}
        self.amax_shape = {n: box_shape(own[n][:-2]) for n in names if n in quantized}
        aidx = [entries(n, own[n][:-2]) for n in self.amax_shape]

        def idx(xs) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64, device=device)

        self.group, self.job_index = idx(group), idx(order)
        self.global_index, self.amax_index = idx(sum(gidx, [])), idx(sum(aidx, []))
        f32 = {"dtype": torch.float32, "device": device}
        self.local, self.s2 = torch.zeros(len(group), **f32), torch.ones(len(group), **f32)
        self.shared, self.job_s2 = torch.zeros(self.n_groups, **f32), torch.ones(len(order), **f32)
        self.buffer = torch.ones(len(self.global_index), **f32)
        self.handed = torch.zeros(len(self.amax_index), **f32)  # the trainer's amax (``hand_over``)
        self.tensors: dict[str, torch.Tensor] = {}
        at = 0
        for n, g in zip(self.held, gidx):
            view = self.buffer[at : at + len(g)].view(box_shape(own[global_scale_name(n)]))
            self.tensors[global_scale_name(n)], at = view, at + len(g)

    def whole(self, name: str) -> torch.Tensor:
        """The agreed ``weight_scale_2`` of tensor ``name``, whole (its leading dims' shape; a view of ``s2``)."""
        o = self.offset[name]
        return self.s2[o : o + math.prod(self.lead[name])].view(self.lead[name])

    def job_scales(self, j: int, lead: Sequence[int]) -> torch.Tensor:
        """Job ``j``'s ``weight_scale_2`` per leading index of its part (a view of ``job_s2``)."""
        return self.job_s2[self.job_slice[j]].view(tuple(lead))

    def local_amax(self, weights: Sequence[torch.Tensor]) -> None:
        """``local`` from the jobs' parts ``weights`` (in job order): each part read once."""
        vals = []
        if self.flat_jobs:
            vals.append(torch.stack(torch._foreach_norm([weights[j] for j in self.flat_jobs], ord=math.inf)))
        for j in self.stacked_jobs:
            vals.append(torch.linalg.vector_norm(weights[j], ord=math.inf, dim=(-2, -1)).reshape(-1))
        self.local.zero_()
        if vals:
            self.local.scatter_reduce_(0, self.job_index, torch.cat([v.float() for v in vals]), "amax")

    def hand_over(self, flat: torch.Tensor) -> None:
        """Keep the trainer's amax ``flat`` (``check_amax``'s) in ``handed``, where ``take_amax`` reads it."""
        self.handed.copy_(flat)

    def take_amax(self) -> None:
        """``local`` from the trainer's amax (``handed``)."""
        self.local.zero_()
        self.local.index_copy_(0, self.amax_index, self.handed)

    def scales(self) -> None:
        """``s2``, ``job_s2`` and the global-scale tensors from the agreed ``local`` (whole tensors' maxima)."""
        self.shared.zero_()
        self.shared.scatter_reduce_(0, self.group, self.local, "amax")
        torch.index_select(nvfp4_scale_2(self.shared), 0, self.group, out=self.s2)
        torch.index_select(self.s2, 0, self.job_index, out=self.job_s2)
        torch.index_select(self.s2, 0, self.global_index, out=self.buffer)

    def check_amax(self, amax: Mapping[str, torch.Tensor], rank: int, device) -> torch.Tensor:
        """The trainer's ``amax`` (per held NVFP4 tensor, float32 ``max |x|`` of this rank's part per leading index)
        validated and concatenated (``amax_shape``'s order); one-line errors naming the tensor."""
        who = f"NVFP4 source rank {rank}: set_amax"
        for n in amax:
            if n not in self.amax_shape:
                raise ValueError(f"{who}: {n!r} is not an NVFP4 weight this rank holds")
        flat = []
        for n, shape in self.amax_shape.items():
            a = amax.get(n)
            if a is None:
                raise ValueError(f"{who}: the amax of {n!r} is missing (every NVFP4 weight the rank holds needs one)")
            if not isinstance(a, torch.Tensor) or a.dtype != torch.float32 or tuple(a.shape) != shape:
                got = f"{a.dtype} {list(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                raise ValueError(f"{who}: the amax of {n!r} must be float32 of shape {list(shape)}, got {got}")
            if a.device != torch.device(device):
                raise ValueError(f"{who}: the amax of {n!r} is on {a.device}, the weights on {device}")
            flat.append(a.reshape(-1))
        cat = torch.cat(flat) if flat else torch.zeros(0, device=device)
        bad = ~(torch.isfinite(cat) & (cat >= 0))
        if bool(bad.any()):  # one synchronization per refit
            first = int(bad.nonzero()[0, 0])
            at = 0
            for n, shape in self.amax_shape.items():
                at += math.prod(shape)
                if first < at:
                    raise ValueError(f"{who}: the amax of {n!r} holds {cat[first].item()}, not a finite value >= 0")
        return cat
