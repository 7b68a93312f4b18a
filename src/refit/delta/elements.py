"""Per-element deltas of a tensor against the copy last sent: find, apply, check. Pure torch, any device.

A refit after a small optimizer step changes few bf16 values (about 1% under RL learning rates). A sender
that keeps the last version it sent (the *base*, ``refit.delta.base``) can send only the changed elements:

* ``find_changes(base, cur)``: the flat indices (row-major over the tensor's shape, int64) of the elements
  whose **bits** differ (so ``-0.0`` vs ``0.0`` and NaN payloads count) and their new values; read in chunks
  of at most ``chunk_bytes`` so the temporary memory is bounded whatever the tensor's size (strided views
  too). ``find_changes_many`` finds many pieces with one host sync.
* ``apply_changes(dst, indices, values)``: ``dst[indices] = values`` by ``index_put_`` on the unravelled
  indices, O(changed): no pass over the whole tensor (a strided destination view too).
* ``check_indices`` / ``check_indices_many``: a received index list lies inside its piece (``DeltaError``
  otherwise) before anything is scattered.

One pass on CUDA: ``refit.delta.kernels`` compares, compacts (and can update the base) reading each version
once; ``find_changes`` uses it for contiguous CUDA tensors when Triton is installed, and its torch path is the
kernel's reference (``tests/delta_interpret.py`` runs the kernel in Triton's interpreter against it). How the
changes travel is ``refit.delta.wire``; 64-bit words instead of elements, ``refit.delta.words``.
"""

from __future__ import annotations

import torch

from refit.delta import host_find
from refit.delta.wire import DeltaError

CHECK_CHUNK = 1 << 25  # indices checked side by side per launch group (``check_indices_many``)
CHECK_ALONE = 1 << 20  # a piece with at least this many indices is checked alone (``check_indices_many``)
CHUNK_BYTES = 256 << 20  # default read size of find_changes (per version): bounds its temporaries


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (bitwise comparison; no copy)."""
    return t.view(_BITS[t.element_size()])


def _row_chunks(t: torch.Tensor, chunk_bytes: int):
    """``(start element, chunk)`` over ``t``'s leading dim, each at most ``chunk_bytes`` (one row at least)."""
    if t.dim() == 0:
        yield 0, t.reshape(1)
        return
    row = t[0].numel() if t.shape[0] else 0
    rows = max(1, chunk_bytes // max(1, row * t.element_size()))
    for r in range(0, t.shape[0], rows):
        yield r * row, t[r : r + rows]


def find_changes(
    base: torch.Tensor,
    cur: torch.Tensor,
    chunk_bytes: int = CHUNK_BYTES,
    use_triton: bool | None = None,
    most: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Flat indices (int64, row-major over the shape) of the elements of ``cur`` whose bits differ from
    ``base``, and ``cur``'s values there. Same shape and dtype; any strides; ``base`` may live on another
    device (a pinned host copy: each chunk is copied to ``cur``'s device first). The torch path returns
    the indices sorted; the one-pass kernel (``use_triton``; default: both contiguous on one CUDA device
    with Triton installed) sorted by chunk, in no particular order inside one (every consumer here is
    order-free). ``most``: on the CPU's word path (``host_find``), more than this many changed 64-bit words
    return ``(None, None)`` before any element is looked at (the caller sends the piece dense)."""
    if base.shape != cur.shape or base.dtype != cur.dtype:
        raise ValueError(f"find_changes: base {list(base.shape)} {base.dtype} vs current {list(cur.shape)} {cur.dtype}")
    if use_triton is None:
        use_triton = _kernel_fits(base, cur)
    if use_triton:
        return _find_kernel(base, cur, chunk_bytes)
    if host_find.by_words(base, cur):
        return host_find.find(base, cur, chunk_bytes, most)
    idx, vals = [], []
    for (start, b), (_, c) in zip(_row_chunks(base, chunk_bytes), _row_chunks(cur, chunk_bytes)):
        b = b.to(c.device, non_blocking=True)
        changed = (bits(b) != bits(c)).reshape(-1)
        nz = changed.nonzero().squeeze(1)
        idx.append(nz + start)
        vals.append(c.reshape(-1)[nz])
    if not idx:
        return torch.empty(0, dtype=torch.int64, device=cur.device), cur.new_empty(0)
    return torch.cat(idx), torch.cat(vals)


def _host_words(base: torch.Tensor, cur: torch.Tensor) -> bool:
    return base.shape == cur.shape and base.dtype == cur.dtype and host_find.by_words(base, cur)


def _kernel_fits(base: torch.Tensor, cur: torch.Tensor) -> bool:
    if not cur.is_cuda:  # (importing the kernels imports Triton: not on a CPU path)
        return False
    from refit.delta import kernels

    return (
        kernels.AVAILABLE and cur.is_cuda and base.device == cur.device and base.is_contiguous() and cur.is_contiguous()
    )


def _find_kernel(base: torch.Tensor, cur: torch.Tensor, chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``find_changes`` through the one-pass kernel (``refit.delta.kernels``), chunk by chunk."""
    from refit.delta.kernels import diff_compact

    b, c = bits(base).reshape(-1), bits(cur).reshape(-1)
    step = max(1, chunk_bytes // cur.element_size())
    idx, vals = [], []
    for s in range(0, c.numel(), step):
        i, v, _ = diff_compact(b[s : s + step], c[s : s + step], start=s)
        idx.append(i.clone())  # copied out, so the chunk's slots are freed now
        vals.append(v.view(cur.dtype).clone())
    if not idx:
        return torch.empty(0, dtype=torch.int64, device=cur.device), cur.new_empty(0)
    return torch.cat(idx), torch.cat(vals)


def find_changes_many(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    chunk_bytes: int = CHUNK_BYTES,
    use_triton: bool | None = None,
    copy: bool = True,
    most: list[int | None] | None = None,
) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``find_changes`` of every ``(base, cur)`` pair (the pieces of one message). Pairs the one-pass
    kernel takes (contiguous, one CUDA device, at most ``chunk_bytes``) are launched together with one
    host sync for all of them, into slots for a quarter of their elements (a pair with more changes is
    found again by ``find_changes``, with every slot); host pairs of whole words through ``host_find.find_many``
    (compacted together), the rest through ``find_changes``. ``use_triton``: as
    ``find_changes``' (True: every pair that fits the chunk, e.g. in Triton's interpreter). ``copy=False``:
    the kernel's pairs come back as views of their slots (no copy, two launches less per pair; the slots,
    a quarter of the pair's elements each, stay allocated while a view is held: drop them soon). ``most``: per
    pair, ``find_changes``' (``(None, None)`` over it on the CPU's word path)."""
    out: list = [None] * len(pairs)
    fits = [
        i
        for i, (b, c) in enumerate(pairs)
        if c.numel() * c.element_size() <= chunk_bytes and (_kernel_fits(b, c) if use_triton is None else use_triton)
    ]
    if fits:
        counts, slots = launch_many([pairs[i] for i in fits])
        for i, k, (idx, vals) in zip(fits, counts.tolist(), slots):
            if k <= len(idx):  # copied out (``copy``), so the slots are freed now
                idx, vals = idx[:k], vals[:k].view(pairs[i][1].dtype)
                out[i] = (idx.clone(), vals.clone()) if copy else (idx, vals)
    most = most or [None] * len(pairs)
    host = [i for i, (b, c) in enumerate(pairs) if out[i] is None and use_triton is not True and _host_words(b, c)]
    for i, got in zip(host, host_find.find_many([pairs[i] for i in host], [most[i] for i in host])):
        out[i] = got  # the CPU's word path, many pieces compacted together (a mismatch: ``find_changes`` refuses it)
    return [
        o if o is not None else find_changes(b, c, chunk_bytes, use_triton, m) for o, (b, c), m in zip(out, pairs, most)
    ]


def launch_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list]:
    """Enqueue the one-pass kernel for every ``(base, cur)`` pair (contiguous, one device), no host sync:
    ``(counts, slots)``, each pair's true number of changes (int32 on the device) and its ``(indices,
    bits)`` slots for a quarter of its elements (``find_changes_many`` reads them after one sync)."""
    from refit.delta.kernels import launch

    counts = torch.zeros(len(pairs), dtype=torch.int32, device=pairs[0][1].device)
    slots = []
    for j, (b, c) in enumerate(pairs):
        cap = max(1024, c.numel() // 4)
        idx, vals = torch.empty(cap, dtype=torch.int64, device=c.device), bits(c.new_empty(cap))
        launch(bits(b).reshape(-1), bits(c).reshape(-1), idx, vals, counts[j : j + 1])
        slots.append((idx, vals))
    return counts, slots


def apply_changes(dst: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """``dst``'s elements at flat row-major ``indices`` become ``values``: one ``index_put_``, O(changed),
    on any strides. ``indices`` must lie in ``[0, dst.numel())`` (``check_indices``)."""
    if not indices.numel():
        return
    if dst.device.type == "cpu" and indices.device.type == "cpu" and dst.is_contiguous():  # numpy's: ~5x faster
        bits(dst).view(-1).numpy()[indices.numpy()] = bits(values.to(dst.dtype)).numpy()
    elif dst.is_contiguous():
        dst.view(-1).index_put_((indices.long(),), values)
    else:
        dst.index_put_(torch.unravel_index(indices.long(), dst.shape), values)


def check_indices(indices: torch.Tensor, n: int, what: str) -> None:
    """A received index list is within ``[0, n)`` (``DeltaError`` naming ``what``): a bad index must never
    reach a scatter (on CUDA it would be a device-side assert). One reduction over the indices."""
    if indices.numel():
        lo, hi = torch.stack([indices.min(), indices.max()]).tolist()
        if lo < 0 or hi >= n:
            raise DeltaError(f"{what}: delta index {lo if lo < 0 else hi} is outside the piece's {n} elements")


def check_indices_many(pieces: list[tuple[torch.Tensor, int]], what: str) -> None:
    """``check_indices`` of every ``(indices, n)`` with one host sync (per device) for all of them. A piece of at least
    ``CHECK_ALONE`` indices is checked alone (its min and max: two reads); smaller ones side by side against
    each piece's bound, ``CHECK_CHUNK`` indices at a time (a few launches per chunk, not two per piece, where
    launches cost more than the reads; extra memory at most a chunk). On the CPU, numpy's min and max of each
    piece (no launches to save: a concatenation would only copy). Where one is out of range, the pieces one by
    one name it."""
    pieces = [(i, n) for i, n in pieces if i.numel()]
    if not pieces:
        return
    if all(i.device.type == "cpu" for i, _ in pieces):  # numpy's min and max per piece: no concatenation
        if all((a := i.numpy()).min() >= 0 and a.max() < n for i, n in pieces):
            return
        for i, n in pieces:
            check_indices(i, n, what)  # names the first bad index
    flags = [_out_of_range([p]) for p in pieces if p[0].numel() >= CHECK_ALONE]
    groups: dict[tuple, tuple[list[tuple[torch.Tensor, int]], list[int]]] = {}  # (dtype, device) -> pieces, size
    for i, n in (p for p in pieces if p[0].numel() < CHECK_ALONE):
        group, size = groups.setdefault((i.dtype, i.device), ([], [0]))
        if group and size[0] + i.numel() > CHECK_CHUNK:
            flags.append(_out_of_range(group))
            group.clear()
            size[0] = 0
        group.append((i, n))
        size[0] += i.numel()
    flags += [_out_of_range(list(g)) for g, _ in groups.values() if g]
    if not any(bool(f) for f in _per_device_any(flags)):  # one host sync per device
        return
    for i, n in pieces:  # name the first bad index (an error path: a sync per piece is fine)
        check_indices(i, n, what)
    raise DeltaError(f"{what}: a delta index is outside its piece (found by the joint check, not per piece)")


def _per_device_any(flags: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flags`` (0-d bools) reduced to one per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return [torch.stack(fs).any() for fs in by_device.values()]


def _out_of_range(group: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Whether an index of ``group`` (one dtype, one device) is outside its piece: a 0-d bool tensor."""
    if len(group) == 1:
        i, n = group[0]
        return (i.min() < 0) | (i.max() >= n)
    flat = torch.cat([i.reshape(-1) for i, _ in group])
    sizes = torch.tensor([n for _, n in group], dtype=torch.int64).to(flat.device, non_blocking=True)
    counts = torch.tensor([i.numel() for i, _ in group], dtype=torch.int64).to(flat.device, non_blocking=True)
    limits = torch.repeat_interleave(sizes, counts, output_size=flat.numel())
    return ((flat < 0) | (flat >= limits)).any()
